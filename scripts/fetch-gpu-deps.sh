#!/usr/bin/env bash
# Fetches, on a Debian 12 (bookworm) machine with a package registry, the
# Debian packages that scripts/gpu-check.sh needs on a GPU machine that has
# nvcc, CMake and ninja but no registry, no libfabric and no GoogleTest.
# They land in third_party/debs/ (with a SHA256SUMS manifest), which must
# travel with the working tree to that machine:
#
#   scripts/fetch-gpu-deps.sh            # here (apt-get download, no root needed)
#   scripts/gpu-check.sh                 # there
#
# third_party/debs/ is deliberately neither committed nor git-ignored: tools
# that copy a working tree copy untracked files but skip ignored ones.  Do not
# `git add` the .debs.
#
# What each package is for:
#   googletest                      GoogleTest source (/usr/src/googletest), built there with
#                                   the machine's own compiler (no libstdc++ ABI mismatch)
#   libgtest-dev libgmock-dev       prebuilt GoogleTest, the fallback if the source build fails
#   libxxhash-dev libxxhash0        section checksums (linked by kvxfer_core)
#   libcli11-dev nlohmann-json3-dev header-only; find_package() at configure time
#   libfabric-dev libhwloc-dev      pkg-config files and headers; configure requires them
#   libfabric1 libhwloc15 + deps    their runtime libraries, for the GPU transport tests
#                                   (xfer_gpu_test, nccl_test) and codec_perf, which link
#                                   them: libfabric1 needs libibverbs1 librdmacm1 libpsm2-2
#                                   libpsm-infinipath1 ibverbs-providers (libefa) and
#                                   libnl-3-200 libnl-route-3-200
#   libnuma1 libudev1 libuuid1      what those need from the base system (libpsm2, libhwloc,
#   libatomic1                      libpsm_infinipath, libfabric); gpu-check.sh uses them
#                                   only where the machine lacks the soname
#   pkgconf-bin libpkgconf3         pkg-config, used only if the machine has none
#   libpcre2-dev libpcre2-8-0       PCRE2: configure requires libpcre2-8 (support/models/bpe_tokenizer);
#                                   its runtime library, for the tests that link kvxfer_models
# NCCL is not here: nccl_test uses the CUDA toolkit's or PyTorch's (gpu-check.sh).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${KVXFER_DEBS_DIR:-$root/third_party/debs}"

packages=(
  googletest libgtest-dev libgmock-dev
  libxxhash-dev libxxhash0
  libcli11-dev nlohmann-json3-dev
  libfabric-dev libfabric1 libibverbs1 librdmacm1 libpsm2-2 libpsm-infinipath1 ibverbs-providers
  libnl-3-200 libnl-route-3-200
  libhwloc-dev libhwloc15
  libnuma1 libudev1 libuuid1 libatomic1
  pkgconf-bin libpkgconf3
  libpcre2-dev libpcre2-8-0
)

command -v apt-get >/dev/null || { echo "fetch-gpu-deps.sh: needs apt-get (Debian 12)" >&2; exit 1; }
mkdir -p "$dest"
cd "$dest"
rm -f ./*.deb SHA256SUMS
if ! apt-get download "${packages[@]}"; then
  # Package lists missing or stale (a machine whose packages were installed
  # long ago): update them once, as root or with sudo, and retry.
  sudo=()
  [[ "$(id -u)" == 0 ]] || { command -v sudo >/dev/null && sudo=(sudo -n); }
  if [[ "$(id -u)" == 0 || ${#sudo[@]} -gt 0 ]] && "${sudo[@]}" apt-get update -q &&
     apt-get download "${packages[@]}"; then
    :
  else
    echo "fetch-gpu-deps.sh: apt-get download failed; run 'apt-get update' (as root) and retry" >&2
    exit 1
  fi
fi
sha256sum ./*.deb > SHA256SUMS
echo "fetch-gpu-deps.sh: $(ls ./*.deb | wc -l) packages, $(du -sh . | cut -f1), in $dest"
echo "fetch-gpu-deps.sh: leave them untracked (not committed, not ignored) so they travel with the tree"
