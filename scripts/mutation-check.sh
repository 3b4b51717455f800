#!/usr/bin/env bash
# Mutation check of the codec tests: each mutation below is a small, plausible
# bug in the code every encoder path shares (src/codec/).  The script applies
# one at a time to a copy of this checkout, rebuilds the codec's tests and
# runs them, and reports which tests caught it.  It fails if any mutation
# survives, if the unmutated copy fails a test, or if a mutation no longer
# applies (its text is gone: update the list with the code).
#
#   scripts/mutation-check.sh            # after scripts/install-deps.sh
#   KVXFER_MUTATION_KEEP=1 ...           # keep the temporary copy (printed)
#   KVXFER_ORACLE_PAGES=N ...            # pages of the oracle's random sweep
#
# The checkout is never written: the copy (tracked files and untracked ones
# that git does not ignore, as on disk) lives in a temporary directory with
# its own build.  Tests run: the C++ codec binaries (codec_test, format_test,
# spectrum_codec_test, and gpu_emu_test when the CUDA toolkit is present)
# and the Python tests of the format oracle and golden vectors
# (python/tests/test_format_oracle.py), which share no code with src/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
src="$(pwd)"

# name | file | text | replacement.  Each text must occur exactly once.
mutations=(
  "kHistRowStride 16 -> 8|src/codec/codec_math.h|constexpr int kHistRowStride = 16;|constexpr int kHistRowStride = 8;"
  "d rounded to nearest, not up|src/codec/codec_math.h|d = f16_to_f32(f32_to_f16_up(d));|d = f16_to_f32(f32_to_f16(d));"
  "range_row0: < -> <= at the sink boundary|src/codec/codec_math.h|sink_rows > t0 && sink_rows < t1|sink_rows > t0 && sink_rows <= t1"
  "f32_to_f16 without tie-to-even|src/codec/codec_math.h|(r + 0xFFFu + ((r >> 13) & 1u)) >> 13|(r + 0xFFFu + 1u) >> 13"
  "nest_code: g - 16 -> g - 15|src/codec/codec_math.h|    r = g - 16;|    r = g - 15;"
  "LYNX alpha > 0: Y truncated, not rounded (T[k] = g(k + 1))|src/codec/codebook.cc|alpha_law_inverse(cb->alpha, k + 0.5)|alpha_law_inverse(cb->alpha, k + 1.0)"
  "INT8/INT4: codes truncated (bias L, not L + 1/2)|src/codec/codebook.cc|cb->bias = cb->scale_num + 0.5f;|cb->bias = cb->scale_num;"
  "BF16: f32_to_bf16 without tie-to-even|src/codec/codec_math.h|(u + 0x7FFFu + ((u >> 16) & 1u)) >> 16|(u + 0x8000u) >> 16"
  "SPECTRUM: anchor table samples rows t % 16 == 15|src/codec/tiered_format.cc|if (hist_row(t, 0)) ++hist[code];|if (hist_row(t + 1, 0)) ++hist[code];"
  "anchor table: empty anchors at the bin's low end, not its centre|src/codec/codec_math.h|static_cast<float>(d_div(num, den)) : centre;|static_cast<float>(d_div(num, den)) : lo;"
)

parent="$(mktemp -d "${TMPDIR:-/tmp}/kvxfer-mutation.XXXXXX")"
if [[ "${KVXFER_MUTATION_KEEP:-0}" != 1 ]]; then
  trap 'rm -rf "$parent"' EXIT
else
  echo "mutation-check: keeping $parent"
fi
work="$parent/kvxfer"
build="$parent/build"
mkdir "$work"
git -C "$src" ls-files -z --cached --others --exclude-standard |
  tar -C "$src" --null --files-from=- --ignore-failed-read -cf - | tar -C "$work" -xf -

cmake -S "$work" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVXFER_BUILD_PERF=OFF \
  >"$parent/configure.log" 2>&1 || {
  cat "$parent/configure.log" >&2
  exit 1
}
targets=(kvxfer codec_test format_test spectrum_codec_test)
if ninja -C "$build" -t targets all 2>/dev/null | grep -q '^gpu_emu_test:'; then
  targets+=(gpu_emu_test)
fi
python=python3

# Runs every test; prints the names of the failed ones (nothing if all pass).
run_tests() {
  local t
  for t in "${targets[@]:1}"; do
    "$build/tests/$t" --gtest_brief=1 >"$parent/$t.log" 2>&1 || true
    sed -n 's/^\[  FAILED  \] \([A-Za-z0-9_./]*\).*/'"$t"': \1/p' "$parent/$t.log" | sort -u
    if ! grep -q '^\[  PASSED  \]\|^\[  FAILED  \]' "$parent/$t.log"; then
      echo "$t: crashed"
    fi
  done
  local rc=0
  (cd "$work/python" && KVXFER_LIBRARY="$build/src/libkvxfer.so" PYTHONPATH=. \
    PYTHONDONTWRITEBYTECODE=1 KVXFER_CODEC_THREADS=1 \
    "$python" -m pytest -q -p no:cacheprovider tests/test_format_oracle.py \
    >"$parent/pytest.log" 2>&1) || rc=$?
  sed -n 's/^FAILED \([^ ]*\).*/python: \1/p' "$parent/pytest.log" | sort -u
  if ! grep -q ' passed\| failed' "$parent/pytest.log"; then
    echo "python: tests/test_format_oracle.py died (exit $rc$( ((rc > 128)) && echo ", signal $((rc - 128))"))"
  fi
}

# Replaces the one occurrence of $2 in file $1 with $3 (fails otherwise).
mutate() {
  "$python" - "$1" "$2" "$3" <<'EOF'
import sys
path, old, new = sys.argv[1:4]
text = open(path).read()
n = text.count(old)
if n != 1:
    sys.exit(f"mutation-check: {old!r} occurs {n} times in {path}")
open(path, "w").write(text.replace(old, new))
EOF
}

echo "mutation-check: building ${targets[*]} in $build"
ninja -C "$build" "${targets[@]}" >"$parent/build.log" 2>&1 || {
  tail -n 40 "$parent/build.log" >&2
  exit 1
}
baseline="$(run_tests)"
if [[ -n "$baseline" ]]; then
  echo "mutation-check: the unmutated copy fails:" >&2
  echo "$baseline" >&2
  exit 1
fi

survived=0
for m in "${mutations[@]}"; do
  IFS='|' read -r name file old new <<<"$m"
  cp "$work/$file" "$parent/original"
  mutate "$work/$file" "$old" "$new"
  if ! ninja -C "$build" "${targets[@]}" >"$parent/build.log" 2>&1; then
    tail -n 20 "$parent/build.log" >&2
    echo "mutation-check: '$name' does not build" >&2
    exit 1
  fi
  caught="$(run_tests)"
  cp "$parent/original" "$work/$file"
  if [[ -z "$caught" ]]; then
    echo "SURVIVED  $name"
    survived=$((survived + 1))
  else
    echo "CAUGHT    $name  ($(echo "$caught" | wc -l) tests)"
    echo "$caught" | sed 's/^/            /'
  fi
done
ninja -C "$build" "${targets[@]}" >/dev/null 2>&1 # the copy back as it was
echo "mutation-check: ${#mutations[@]} mutations, $survived survived"
((survived == 0))
