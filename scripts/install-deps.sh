#!/usr/bin/env bash
# Installs what kvxfer needs to build and test on Debian 12 (bookworm), from
# Debian's own packages only.  Idempotent: when every package is already
# installed it runs neither `apt-get update` nor `apt-get install`.
#
#   scripts/install-deps.sh          # as root, or as a user with sudo
#   KVXFER_SKIP_DEPS=1 ...           # skip entirely (you installed them yourself)
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
  libpcre2-dev        # PCRE2 (UTF + UCP): the pre-tokenizer pattern of model/bpe_tokenizer
  libcli11-dev        # command lines of perf/ and examples/
  nlohmann-json3-dev  # JSON output of perf/
  clang               # libFuzzer targets (KVXFER_BUILD_FUZZ)
  libclang-rt-14-dev  # libFuzzer and sanitizer runtimes for clang 14
  libomp-14-dev       # OpenMP for clang 14 (the fuzz build)
  python3
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
if command -v python3 >/dev/null 2>&1; then
  for module in pytest matplotlib; do
    if ! python3 -c "import $module" >/dev/null 2>&1; then
      echo "install-deps.sh: installing $module for $(command -v python3)"
      if ! PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet "$module"; then
        echo "install-deps.sh: could not install $module; the tests that need it will be skipped" >&2
      fi
    fi
  done
fi
