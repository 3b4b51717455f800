#!/usr/bin/env bash
# Fails when a file of the source tree names a place outside it that a test,
# benchmark or example could read: everything they need ships in the
# repository (the model is data/stories260K.bin), so a clone with nothing
# beside it passes the README's test command.  The old location of the model,
# a directory "shared" beside the clone, is the case this guards against.
#
#   tests/self_contained.sh SOURCE_DIR      (ctest: self_contained)
#
# The files are git's (tracked and untracked, not ignored) in a git work tree,
# otherwise every file but .git/ and build*/.  Binary files are skipped.
set -euo pipefail

src="$(cd "${1:?usage: self_contained.sh SOURCE_DIR}" && pwd)"
cd "$src"

# The directory beside the clone (dot-dot-slash shared, shared-slash-data) or
# a CMake path climbing out of the source tree.  Spelled with brackets so that
# this file does not match itself.
pattern='[.][.]/shared|shared/dat[a]|(PROJECT|CMAKE)_SOURCE_DIR[}]/[.][.]'

files=()
if [[ "$(git rev-parse --show-toplevel 2>/dev/null || true)" == "$src" ]]; then
  while IFS= read -r -d '' f; do
    [[ -f "$f" ]] && files+=("$f")
  done < <(git ls-files -z --cached --others --exclude-standard)
else
  while IFS= read -r -d '' f; do
    files+=("${f#./}")
  done < <(find . \( -name .git -o -path './build*' \) -prune -o -type f -print0)
fi
if ((${#files[@]} == 0)); then
  echo "self_contained.sh: no files found under $src" >&2
  exit 1
fi

status=0
hits="$(printf '%s\0' "${files[@]}" | xargs -0 grep -nIE -- "$pattern")" || status=$?
# xargs: 0 = a match, 123 = no match (grep exited 1), anything else = an error.
if [[ $status == 0 ]]; then
  echo "self_contained.sh: these lines name a path outside the repository:" >&2
  echo "$hits" >&2
  echo "Ship what they read in the repository (data/README.md) and point at it there." >&2
  exit 1
elif [[ $status != 123 ]]; then
  echo "self_contained.sh: grep failed (status $status)" >&2
  exit 1
fi
echo "self_contained.sh: ${#files[@]} files, none names a path outside $src"
