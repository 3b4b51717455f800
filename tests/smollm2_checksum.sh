#!/usr/bin/env bash
# The SmolLM2 GGUF that scripts/install-deps.sh placed (or KVXFER_SMOLLM2_GGUF
# names) is intact: its sha256 is the one in data/smollm2.sha256.  Exits 77
# (ctest: skipped) when the file is absent.  The path is the one of
# model::smollm2_gguf_path() (support/models/model_paths.cc).
#
#   tests/smollm2_checksum.sh SOURCE_DIR      (ctest: smollm2_checksum)
set -euo pipefail

src="${1:?usage: smollm2_checksum.sh SOURCE_DIR}"
path="${KVXFER_SMOLLM2_GGUF:-}"
if [[ -z "$path" ]]; then
  cache="${XDG_CACHE_HOME:-}"
  [[ -n "$cache" ]] || cache="${HOME:+$HOME/.cache}"
  [[ -n "$cache" ]] || cache=.cache
  path="$cache/kvxfer/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
if [[ ! -f "$path" ]]; then
  echo "smollm2_checksum.sh: SKIP: $path is absent (scripts/install-deps.sh fetches it)"
  exit 77
fi
want="$(awk 'NR == 1 { print $1 }' "$src/data/smollm2.sha256")"
got="$(sha256sum "$path" | awk '{ print $1 }')"
if [[ "$got" != "$want" ]]; then
  echo "smollm2_checksum.sh: $path has sha256 $got, expected $want ($(stat -c %s "$path") bytes)." >&2
  echo "Delete it and rerun scripts/install-deps.sh." >&2
  exit 1
fi
echo "smollm2_checksum.sh: $path OK ($want)"
