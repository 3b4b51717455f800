#!/usr/bin/env bash
# One prepared check on a machine with an NVIDIA GPU (written for an H200,
# sm_90): builds kvxfer with CUDA there, runs the GPU tests (the kernels
# against the CPU reference, bit-exact), perf/codec_perf --gpu, and the GPU
# transport tests (xfer_gpu_test: kvxfer_send/recv over libfabric loopback;
# nccl_test: the NCCL backend, one rank) where this tree has them, then
# prints one verdict.  Budget: under 8 minutes on a 16-core machine
# (docs/GPU.md).
#
# That machine is expected to have nvcc, CMake >= 3.25, ninja and a C++17
# compiler, but no package registry, no libfabric and no GoogleTest.  What is
# missing comes from the working tree: third_party/debs/, Debian 12 packages
# fetched beforehand with scripts/fetch-gpu-deps.sh, unpacked here with
# `dpkg-deb -x` (or ar + tar) into a private prefix.  Nothing is installed
# system-wide.
#
#   scripts/fetch-gpu-deps.sh      # on a machine with the Debian registry
#   scripts/gpu-check.sh           # on the GPU machine, from the repository
#
# Environment (all optional):
#   KVXFER_GPU_BUILD_DIR   build directory (default <repo>/build-gpu; build*/ is git-ignored)
#   KVXFER_DEPS_PREFIX     where the .debs are unpacked (default <build dir>/deps)
#   KVXFER_GPU_CHECK_BUDGET_S  seconds for the whole run (default 450)
#   OUT                    if set, logs, the gtest XML and codec_perf's table and JSON
#                          are copied there
#   JOBS                   build parallelism (default nproc)
#   KVXFER_GPU_CHECK_STRICT_DEPS=1  a dependency taken from outside the prefix
#                          (CMake cache, headers, ldd; always reported) is a FAIL (.ci/run)
#
# Exit status: 0 PASS (bit-exact, every step passed), 1 FAIL (build, test or
# codec_perf), 2 NOT RUN (no usable CUDA device: the GPU tests skipped).
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${KVXFER_GPU_BUILD_DIR:-$root/build-gpu}"
prefix="${KVXFER_DEPS_PREFIX:-$build/deps}"
debs="$root/third_party/debs"
budget="${KVXFER_GPU_CHECK_BUDGET_S:-450}"
jobs="${JOBS:-$(nproc)}"
logs="$build/gpu-check-logs"
start=$(date +%s)
deadline=$((start + budget))
mkdir -p "$build" "$logs"

say() { echo "== gpu-check [$(( $(date +%s) - start ))s] $*"; }
left() { local l=$((deadline - $(date +%s))); ((l > 5)) && echo "$l" || echo 5; }
finish() {  # finish <exit code> <verdict line>
  say "$2"
  if [[ -n "${OUT:-}" ]]; then mkdir -p "$OUT" && cp -r "$logs"/. "$OUT"/ 2>/dev/null; fi
  echo "gpu-check: VERDICT: $2"
  exit "$1"
}

# ---------------------------------------------------------------------------
# 1. Tools
# ---------------------------------------------------------------------------
nvcc="$(command -v nvcc || true)"
[[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
[[ -n "$nvcc" ]] || finish 1 "FAIL: nvcc not found (PATH or /usr/local/cuda/bin)"
for t in cmake ninja c++; do
  command -v "$t" >/dev/null || finish 1 "FAIL: $t not found"
done
[[ "$(uname -m)" == x86_64 ]] || finish 1 "FAIL: third_party/debs are amd64; this machine is $(uname -m)"
say "nvcc: $("$nvcc" --version | tail -n 2 | head -n 1)"
say "cmake: $(cmake --version | head -n 1), compiler: $(c++ --version | head -n 1)"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/   GPU: /'
else
  say "nvidia-smi not found"
fi

# ---------------------------------------------------------------------------
# 2. Dependencies from third_party/debs into a private prefix
# ---------------------------------------------------------------------------
ma=x86_64-linux-gnu
ls "$debs"/*.deb >/dev/null 2>&1 ||
  finish 1 "FAIL: no .debs in third_party/debs (run scripts/fetch-gpu-deps.sh where apt works)"
# Every package fetch-gpu-deps.sh names must be there (a fetch by an older
# version of it lacks some): say which, before anything is built.
packages=()
eval "$(sed -n '/^packages=(/,/^)/p' "$root/scripts/fetch-gpu-deps.sh")"
lacking=()
for p in "${packages[@]}"; do
  ls "$debs/${p}"_*.deb >/dev/null 2>&1 || lacking+=("$p")
done
((${#lacking[@]} == 0)) ||
  finish 1 "FAIL: third_party/debs lack ${lacking[*]} (run scripts/fetch-gpu-deps.sh again where apt works)"
# The stamp names the .debs it was made from: new .debs are unpacked afresh.
stamp="$(cd "$debs" && ls -l ./*.deb | awk '{print $5, $NF}' | sha256sum | cut -c1-16)"
if [[ "$(cat "$prefix/.unpacked" 2>/dev/null)" != "$stamp" ]]; then
  if [[ -f "$debs/SHA256SUMS" ]]; then
    (cd "$debs" && sha256sum --quiet -c SHA256SUMS) || finish 1 "FAIL: third_party/debs do not match SHA256SUMS"
  fi
  rm -rf "$prefix" && mkdir -p "$prefix/base"
  for d in "$debs"/*.deb; do
    # Libraries every Linux system normally has go to base/ and are used only
    # where this machine lacks them (below), never in front of its own.
    to="$prefix"
    case "$(basename "$d")" in libnuma1_* | libudev1_* | libuuid1_* | libatomic1_*) to="$prefix/base" ;; esac
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$d" "$to" || finish 1 "FAIL: dpkg-deb -x $d"
    else
      member="$(ar t "$d" | grep '^data\.tar')"
      case "$member" in
        *.xz) z=-J ;; *.zst) z=--zstd ;; *.gz) z=-z ;; *) z= ;;
      esac
      ar p "$d" "$member" | tar -x $z -C "$to" || finish 1 "FAIL: unpacking $d"
    fi
  done
  # libfabric needs libpsm_infinipath.so.1, which Debian provides only as an
  # update-alternatives link made by the package's postinst: make it here.
  psm="$(ls "$prefix"/usr/lib/libpsm1/libpsm_infinipath.so.1.* 2>/dev/null | head -n 1)"
  [[ -n "$psm" && ! -e "$prefix/usr/lib/$ma/libpsm_infinipath.so.1" ]] &&
    ln -s "$psm" "$prefix/usr/lib/$ma/libpsm_infinipath.so.1"
  # base/: link only the sonames the system loader cannot find.
  mkdir -p "$prefix/base-lib"
  for so in libnuma.so.1 libudev.so.1 libuuid.so.1 libatomic.so.1; do
    if ! { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } |
      awk -v so="$so" '$1 == so { f = 1 } END { exit !f }'; then
      f="$(ls "$prefix"/base/usr/lib/$ma/$so "$prefix"/base/lib/$ma/$so 2>/dev/null | head -n 1)"
      if [[ -n "$f" ]]; then
        ln -sf "$f" "$prefix/base-lib/$so"
        say "system lacks $so: using the unpacked one"
      fi
    fi
  done
  # The .pc files say prefix=/usr; point them at the private prefix.
  for pc in "$prefix"/usr/lib/$ma/pkgconfig/*.pc "$prefix"/usr/share/pkgconfig/*.pc; do
    [[ -f "$pc" ]] && sed -i "s|^prefix=/usr\$|prefix=$prefix/usr|" "$pc"
  done
  rm -f "$build/CMakeCache.txt"
  echo "$stamp" > "$prefix/.unpacked"
  say "unpacked $(ls "$debs"/*.deb | wc -l) packages into $prefix"
fi
# pkg-config searches the prefix only (PKG_CONFIG_LIBDIR replaces its default
# path), so a system libfabric, hwloc, xxhash or PCRE2 cannot be picked up.
export PKG_CONFIG_LIBDIR="$prefix/usr/lib/$ma/pkgconfig:$prefix/usr/share/pkgconfig"
unset PKG_CONFIG_PATH
pkgconf_arg=(-DPKG_CONFIG_EXECUTABLE="$(command -v pkg-config)")
if ! command -v pkg-config >/dev/null; then
  mkdir -p "$prefix/bin"
  cat > "$prefix/bin/pkg-config" <<EOF
#!/bin/sh
LD_LIBRARY_PATH="$prefix/usr/lib/$ma\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$prefix/usr/bin/pkgconf" "\$@"
EOF
  chmod +x "$prefix/bin/pkg-config"
  pkgconf_arg=(-DPKG_CONFIG_EXECUTABLE="$prefix/bin/pkg-config")
  say "pkg-config: the unpacked pkgconf"
fi

# GoogleTest: built from the packaged source with this machine's compiler;
# the prebuilt Debian libraries are the fallback.
gtest_prefix="$prefix/gtest"
if [[ ! -f "$gtest_prefix/.built" ]]; then
  say "building GoogleTest from $prefix/usr/src/googletest"
  if cmake -S "$prefix/usr/src/googletest" -B "$prefix/gtest-build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
       -DCMAKE_INSTALL_PREFIX="$gtest_prefix" -DBUILD_GMOCK=ON -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
       >"$logs/gtest-build.log" 2>&1 &&
     timeout "$(left)" ninja -C "$prefix/gtest-build" -j "$jobs" install >>"$logs/gtest-build.log" 2>&1; then
    touch "$gtest_prefix/.built"
  else
    say "GoogleTest source build failed (see $logs/gtest-build.log); using the prebuilt Debian libraries"
    gtest_prefix="$prefix/usr"
  fi
fi

# Run time (and link time: ld finds libfabric's own dependencies through it).
# libnl-3 unpacks to lib/, the others to usr/lib/; base-lib/ comes last.
export LD_LIBRARY_PATH="$prefix/usr/lib/$ma:$prefix/lib/$ma${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:$prefix/base-lib"

# ---------------------------------------------------------------------------
# 3. Configure and build (CUDA on, sm_90 + PTX, only the targets needed)
# ---------------------------------------------------------------------------
# NCCL (nccl_test): CMake looks in the CUDA toolkit; where it is not there but
# PyTorch's nvidia-nccl wheel is, point CMake at the wheel.
nccl_arg=()
cuda_home="$(dirname "$(dirname "$(readlink -f "$nvcc")")")"
if [[ ! -f "$cuda_home/include/nccl.h" ]] && command -v python3 >/dev/null; then
  nccl_dir="$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)"
  nccl_lib="$(ls "$nccl_dir"/lib/libnccl.so* 2>/dev/null | head -n 1)"
  if [[ -n "$nccl_dir" && -f "$nccl_dir/include/nccl.h" && -n "$nccl_lib" ]]; then
    nccl_arg=(-DNCCL_INCLUDE_DIR="$nccl_dir/include" -DNCCL_LIBRARY="$nccl_lib")
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nccl_dir/lib"
    say "NCCL: the nvidia-nccl wheel in $nccl_dir"
  fi
fi
# find_package() is given each package's own directory in the prefix.
gtest_dir="$gtest_prefix/lib/cmake/GTest"
[[ -d "$gtest_dir" ]] || gtest_dir="$prefix/usr/lib/$ma/cmake/GTest"
say "configuring $build"
if ! cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
     -DKVXFER_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" \
     -DKVXFER_BUILD_PERF=ON -DKVXFER_BUILD_FUZZ=OFF "${nccl_arg[@]}" \
     -DCMAKE_PREFIX_PATH="$gtest_prefix;$prefix/usr" "${pkgconf_arg[@]}" \
     -DGTest_DIR="$gtest_dir" -DCLI11_DIR="$prefix/usr/share/cmake/CLI11" \
     -Dnlohmann_json_DIR="$prefix/usr/share/cmake/nlohmann_json" \
     -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$logs/configure.log" 2>&1; then
  tail -n 30 "$logs/configure.log"
  finish 1 "FAIL: configure (see $logs/configure.log)"
fi
grep -m 1 "kvxfer: CUDA support" "$logs/configure.log"
# The transport tests are built when this tree (and the configure) has them.
targets=(gpu_test codec_test codec_perf)
alltargets="$(ninja -C "$build" -t targets all 2>/dev/null)"
for t in xfer_gpu_test nccl_test; do
  if grep -q "^$t:" <<<"$alltargets"; then targets+=("$t"); else say "$t: no such target here, not built"; fi
done
say "building ${targets[*]} (-j $jobs)"
# -k 0: a target that fails to build does not stop the others from running.
timeout "$(left)" ninja -C "$build" -k 0 -j "$jobs" "${targets[@]}" >"$logs/build.log" 2>&1
build_rc=$?
if ((build_rc != 0)); then
  grep -E "error|Error|FAILED" "$logs/build.log" | head -n 30
  say "build failed (rc $build_rc, see $logs/build.log); running what was built"
fi
((build_rc == 124)) && finish 1 "FAIL: build ran out of time (see $logs/build.log)"
# Where a binary cannot be loaded (a library the .debs do not cover, an old
# glibc), say which library before running it.
check_libs() {  # check_libs <binary>
  local miss
  miss="$(ldd "$1" 2>&1 | grep -E "not found|version .* not found" | sort -u)"
  [[ -z "$miss" ]] && return 0
  say "$(basename "$1"): missing libraries:"
  echo "$miss" | sed 's/^/   /'
  return 1
}

# Did the build take the packaged dependencies from the prefix only?  Three
# records say: the CMake cache (where find_package and pkg-config found
# them), ninja's header dependencies (no packaged header from /usr/include or
# /usr/local/include) and ldd with this script's LD_LIBRARY_PATH (every
# library the prefix has resolves there; base/'s libnuma, libudev, libuuid and
# libatomic come from the system by design).  Sets deps_note and deps_leaks.
deps_leaks=()
check_prefix() {
  local cache="$build/CMakeCache.txt" line v h n_libs=0 n_hdrs=0 bin lib path
  for v in pkgcfg_lib_LIBFABRIC_fabric pkgcfg_lib_HWLOC_hwloc pkgcfg_lib_XXHASH_xxhash \
           pkgcfg_lib_PCRE2_pcre2-8 GTest_DIR CLI11_DIR nlohmann_json_DIR; do
    line="$(grep -m 1 "^$v:" "$cache")"
    [[ "${line#*=}" == "$prefix"/* ]] || deps_leaks+=("cache ${line:-$v missing}")
  done
  while read -r path; do
    # A system header is a leak when the prefix has the same file.
    h="${path#/usr/local/include/}"; h="${h#/usr/include/}"
    if [[ "$h" != "$path" && ( -e "$prefix/usr/include/$h" || -e "$gtest_prefix/include/$h" ) ]]; then
      deps_leaks+=("header $path")
    fi
    [[ "$path" == "$prefix"/* ]] && n_hdrs=$((n_hdrs + 1))
  done < <(ninja -C "$build" -t deps 2>/dev/null | sed -n 's/^ \{4\}\(\/.*\)/\1/p' | sort -u)
  for bin in "$build"/tests/{gpu_test,codec_test,xfer_gpu_test,nccl_test} "$build/perf/codec_perf"; do
    [[ -x "$bin" ]] || continue
    while read -r lib path; do
      [[ -e "$prefix/usr/lib/$ma/$lib" || -e "$prefix/lib/$ma/$lib" ]] || continue
      if [[ "$path" == "$prefix"/* ]]; then n_libs=$((n_libs + 1)); else deps_leaks+=("$(basename "$bin"): $lib => $path"); fi
    done < <(ldd "$bin" 2>/dev/null | awk '$2 == "=>" { print $1, $3 }')
  done
  if ((${#deps_leaks[@]} > 0)); then
    mapfile -t deps_leaks < <(printf '%s\n' "${deps_leaks[@]}" | sort -u)
    say "dependencies from outside $prefix:"
    printf '   %s\n' "${deps_leaks[@]}" | head -n 20
    deps_note="deps: ${#deps_leaks[@]} from outside the prefix"
  else
    deps_note="deps: prefix only (cache, $n_hdrs headers, $n_libs library loads)"
    say "$deps_note"
  fi
}
check_prefix

# Per-step time limits: every later step keeps a share of the budget.
cap() {  # cap <seconds> [reserve]: min(seconds, time left - reserve), >= 5
  local l=$(($(left) - ${2:-0}))
  ((l > $1)) && l=$1
  ((l < 5)) && l=5
  echo "$l"
}

# Runs one GoogleTest binary; sets <name>_rc/_passed/_failed/_skipped.
run_gtest() {  # run_gtest <name> <time limit>
  local name=$1 bin="$build/tests/$1" rc p f s
  if [[ ! -x "$bin" ]]; then
    printf -v "${name}_rc" '%s' 127
    say "$name: not built"
    return
  fi
  say "running $name"
  check_libs "$bin"
  timeout "$2" "$bin" --gtest_output="xml:$logs/$name.xml" >"$logs/$name.log" 2>&1
  rc=$?
  grep -E "^\[ *(OK|FAILED) *\]|^\[ *(PASSED|SKIPPED) *\] [0-9]|Failure|difference|Which is|trace:|: (LYNX|INT8|INT4|BF16) " \
    "$logs/$name.log" | head -n 80
  grep -m 1 "no CUDA device" "$logs/$name.log"
  p=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$logs/$name.log" | tail -n 1)
  s=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$logs/$name.log" | tail -n 1)
  f=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$logs/$name.log" | tail -n 1)
  printf -v "${name}_rc" '%s' "$rc"
  printf -v "${name}_passed" '%s' "${p:-0}"
  printf -v "${name}_skipped" '%s' "${s:-0}"
  printf -v "${name}_failed" '%s' "${f:-0}"
}

# ---------------------------------------------------------------------------
# 4. GPU tests: kernels against the CPU reference, byte for byte
# ---------------------------------------------------------------------------
say "running gpu_test"
[[ -x "$build/tests/gpu_test" ]] || finish 1 "FAIL: gpu_test was not built (see $logs/build.log)"
# The steps after it keep at least 150 s (codec_test, codec_perf, then the
# transport tests).  Their own caps add up to 300 s, so when gpu_test runs long
# they share what is left, first come first served (each gets >= 5 s).
timeout "$(cap 100000 150)" "$build/tests/gpu_test" --gtest_output="xml:$logs/gpu_test.xml" >"$logs/gpu_test.log" 2>&1
gpu_rc=$?
grep -E "^\[ *(OK|FAILED) *\]|^\[ *(PASSED|SKIPPED) *\] [0-9]|Failure|difference|Which is|trace:|: (LYNX|INT8|INT4|BF16) " \
  "$logs/gpu_test.log" | head -n 80
grep -m 1 "no CUDA device" "$logs/gpu_test.log"
passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$logs/gpu_test.log" | tail -n 1)
skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$logs/gpu_test.log" | tail -n 1)
failed=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$logs/gpu_test.log" | tail -n 1)

say "running codec_test (CPU paths on this machine, for context)"
timeout "$(cap 60 150)" "$build/tests/codec_test" >"$logs/codec_test.log" 2>&1
cpu_rc=$?
tail -n 3 "$logs/codec_test.log"

# ---------------------------------------------------------------------------
# 5. perf/codec_perf --gpu: kernel throughput against a device-to-device
#    cudaMemcpy, one 32K-token Llama-3-8B-like K page, bytes checked against
#    the CPU reference (docs/PERFORMANCE.md, "codec_perf --gpu").
# ---------------------------------------------------------------------------
perf_rc=127
perf_note="not built"
if [[ -x "$build/perf/codec_perf" ]]; then
  say "running codec_perf --gpu"
  check_libs "$build/perf/codec_perf"
  timeout "$(cap 90 90)" "$build/perf/codec_perf" --gpu -J "$logs/codec_perf_gpu.json" \
    >"$logs/codec_perf_gpu.log" 2>&1
  perf_rc=$?
  grep -v "^# Settings" "$logs/codec_perf_gpu.log"
  if ((perf_rc == 0)) && grep -q "^# skipped" "$logs/codec_perf_gpu.log"; then
    perf_note="skipped"
  elif ((perf_rc == 0)); then
    perf_note="bit-exact, $(grep -m 1 "^# Rows at" "$logs/codec_perf_gpu.log" | sed 's/^# //')"
  else
    perf_note="rc $perf_rc"
  fi
fi

# ---------------------------------------------------------------------------
# 6. GPU transport: kvxfer_send/recv's GPU path over libfabric loopback
#    (xfer_gpu_test) and the NCCL backend on a one-rank communicator
#    (nccl_test), where this tree has them.
# ---------------------------------------------------------------------------
run_gtest xfer_gpu_test "$(cap 90 45)"
run_gtest nccl_test "$(cap 60)"

# ---------------------------------------------------------------------------
# 7. Verdict
# ---------------------------------------------------------------------------
gtest_summary() {  # gtest_summary <name>
  local rc="${1}_rc" p="${1}_passed" f="${1}_failed" s="${1}_skipped"
  if [[ "${!rc}" == 127 ]]; then echo "$1 not built"; return; fi
  echo "$1 passed ${!p}, failed ${!f}, skipped ${!s} (rc ${!rc})"
}
summary="gpu_test passed ${passed:-0}, failed ${failed:-0}, skipped ${skipped:-0} (rc $gpu_rc); codec_test rc $cpu_rc; codec_perf --gpu: $perf_note; $(gtest_summary xfer_gpu_test); $(gtest_summary nccl_test); build rc $build_rc; $deps_note; $(( $(date +%s) - start ))s"
bad=()
((gpu_rc == 124)) && bad+=("gpu_test ran out of time")
((gpu_rc != 0 && gpu_rc != 124 || ${failed:-0} > 0)) && bad+=("gpu_test")
((cpu_rc != 0)) && bad+=("codec_test")
((build_rc != 0)) && bad+=("build")
# KVXFER_GPU_CHECK_STRICT_DEPS=1 (CI): a dependency from outside the prefix fails.
((${#deps_leaks[@]} > 0)) && [[ "${KVXFER_GPU_CHECK_STRICT_DEPS:-0}" == 1 ]] && bad+=("deps outside the prefix")
((perf_rc != 0)) && bad+=("codec_perf --gpu")
for t in xfer_gpu_test nccl_test; do
  rc="${t}_rc" f="${t}_failed"
  [[ "${!rc}" == 127 ]] && continue  # no such target in this tree: said above
  ((${!rc} != 0 || ${!f:-0} > 0)) && bad+=("$t")
done
if ((${#bad[@]} > 0)); then
  finish 1 "FAIL: ${bad[*]}; $summary"
elif ((${skipped:-0} > 0 || ${passed:-0} == 0)); then
  finish 2 "NOT RUN: the GPU tests skipped (no usable CUDA device); $summary"
fi
ran=(gpu_test codec_perf)
for t in xfer_gpu_test nccl_test; do rc="${t}_rc"; [[ "${!rc}" == 127 ]] || ran+=("$t"); done
finish 0 "PASS: ${ran[*]} (GPU kernels bit-exact with the CPU reference); $summary"
