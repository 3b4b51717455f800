#!/usr/bin/env bash
# Installs missing dependencies (scripts/install-deps.sh), then configures and
# builds kvxfer with Ninja into build/ (Release unless overridden), using every
# core.  Run it from anywhere; the build directory is <repo>/build.
#
#   scripts/build.sh                           # Release, KVXFER_WITH_CUDA=AUTO
#   scripts/build.sh -DKVXFER_WITH_CUDA=OFF    # extra arguments go to the configure step
#
# Environment: KVXFER_BUILD_DIR (default build), KVXFER_SKIP_DEPS=1 (skip the
# package check), JOBS (default nproc).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

"$root/scripts/install-deps.sh"

build_dir="${KVXFER_BUILD_DIR:-build}"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$build_dir" -j "${JOBS:-$(nproc)}"
