#!/usr/bin/env bash
# Installs vLLM 0.33.0 and pytest from PyPI into a venv for the vLLM
# connector's tests (docs/VLLM.md): ${KVXFER_VLLM_VENV:-${XDG_CACHE_HOME:-
# $HOME/.cache}/kvxfer/vllm-venv}.  About 2 to 4 minutes and 3.5 GB of
# downloads; the venv takes 9.5 GB (vLLM's CUDA build of torch: it imports,
# and its scheduler runs, without a GPU).  Idempotent: a venv whose vLLM is
# 0.33.0 (by its package metadata) and that imports pytest is left as it is.  Needs python3-venv
# (scripts/install-deps.sh).
#
#   scripts/install-vllm.sh && ctest --test-dir build -L vllm
set -euo pipefail
venv="${KVXFER_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvxfer/vllm-venv}"
version=0.33.0
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ -x "$venv/bin/python" ]] &&
  "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '$version')" 2>/dev/null &&
  "$venv/bin/python" -c "import pytest" 2>/dev/null; then
  echo "install-vllm.sh: vLLM $version is in $venv"
  exit 0
fi
mkdir -p "$(dirname "$venv")"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
SECONDS=0
"$venv/bin/pip" install --quiet "vllm==$version" pytest
echo "install-vllm.sh: vLLM $version installed in $venv in ${SECONDS} s ($(du -sh "$venv" | cut -f1))"
