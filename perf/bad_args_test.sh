#!/usr/bin/env bash
# Out-of-range arguments of model_perf and codec_quality fail at once, with a
# message naming the option, before any model loads or memory is taken (they
# used to abort on std::length_error, segfault in libgomp at -t 100000, or
# print NaN tables).  None of them needs SmolLM2.
#
#   perf/bad_args_test.sh MODEL_PERF CODEC_QUALITY      (ctest: perf_bad_args)
set -uo pipefail

model_perf="${1:?usage: bad_args_test.sh MODEL_PERF CODEC_QUALITY}"
codec_quality="${2:?usage: bad_args_test.sh MODEL_PERF CODEC_QUALITY}"
fails=0

# expect BINARY "ARGS" "TEXT IN THE OUTPUT": a non-zero exit whose output has TEXT.
expect() {
  local out rc
  # shellcheck disable=SC2086  # ARGS splits into words on purpose
  out=$(timeout 20 "$1" $2 2>&1)
  rc=$?
  if [[ $rc -eq 0 || $rc -eq 124 || $rc -ge 128 ]] || ! grep -qF -- "$3" <<<"$out"; then
    echo "FAIL: $(basename "$1") $2: exit $rc, wanted \"$3\" in:"
    echo "$out" | tail -3
    fails=$((fails + 1))
  fi
}

expect "$model_perf" "-t 100000" "--threads: Value 100000 not in range"
expect "$model_perf" "-t -1" "--threads: Value -1 not in range"
expect "$model_perf" "-v 16,0" "--verify: Value 0 not in range"
expect "$model_perf" "-v -3" "--verify: Value -3 not in range"
expect "$model_perf" "-n 0" "--iters: Value 0 not in range 1 to"
expect "$model_perf" "-C 0" "--context: Value 0 not in range 1 to"
expect "$model_perf" "--model /nonexistent/x.gguf" "cannot open model file '/nonexistent/x.gguf'"

expect "$codec_quality" "-D stories --greedy-steps 512" "--greedy-steps 512 leaves no prompt in a 512-token context"
expect "$codec_quality" "-D stories --greedy-steps -1" "--greedy-steps: Value -1 not in range"
expect "$codec_quality" "-D synth --synth-layers 0" "--synth-layers: Value 0 not in range"
expect "$codec_quality" "-D synth --synth-tokens -5" "--synth-tokens: Value -5 not in range"
expect "$codec_quality" "-D synth --synth-queries 0" "--synth-queries: Value 0 not in range"
expect "$codec_quality" "-D synth --synth-queries 2000" "--synth-queries 2000 exceeds --synth-tokens 1024"
expect "$codec_quality" "-D synth --synth-layers 128 --synth-tokens 100000" "would exceed 4 GiB"
expect "$codec_quality" "-D synth --tree-study" "--tree-study needs a model data set"
expect "$codec_quality" "-D stories --tree-study --greedy-steps 3" "--tree-study needs --greedy-steps >= 4"

[[ $fails -eq 0 ]] && echo "perf_bad_args: all refused with their messages"
exit $((fails > 0))
