#!/usr/bin/env bash
# ctest's entry point for the vLLM connector's tests (label vllm): pytest on
# test_vllm_connector.py in the venv of scripts/install-vllm.sh.  Without that
# venv it says so and exits 77 (ctest SKIP_RETURN_CODE): nothing was tested.
set -euo pipefail
venv="${KVXFER_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvxfer/vllm-venv}"
if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import vllm, pytest" 2>/dev/null; then
  echo "NOT RUN: no vLLM venv at $venv; scripts/install-vllm.sh makes it (docs/VLLM.md)"
  exit 77
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$(dirname "$here"):$here${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1
exec "$venv/bin/python" "$here/run_pytest.py" -q -p no:cacheprovider "$@" \
  "$here/test_vllm_connector.py"
