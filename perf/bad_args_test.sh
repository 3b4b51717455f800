#!/usr/bin/env bash
# Out-of-range arguments of the perf binaries and the demo fail at once, with a
# message naming the option or the limit and a non-zero status, before any
# model loads or memory is taken (they used to abort on std::length_error or
# std::bad_alloc, segfault in libgomp at -t 100000, be killed by the kernel's
# out-of-memory killer, print NaN tables, or exit 0).  None needs SmolLM2.
#
#   perf/bad_args_test.sh TOOL=PATH ...   (ctest: perf_bad_args, example_disagg_demo_bad_args)
#
# Only the cases of the TOOLs named run.
set -uo pipefail

declare -A bin
for a in "$@"; do bin[${a%%=*}]=${a#*=}; done
[[ ${#bin[@]} -gt 0 ]] || { echo "usage: bad_args_test.sh TOOL=PATH ..."; exit 2; }
fails=0

# expect TOOL "ARGS" "TEXT IN THE OUTPUT": a non-zero exit, not a signal or a
# timeout, whose output has TEXT.
expect() {
  [[ -n ${bin[$1]:-} ]] || return 0
  local out rc
  # shellcheck disable=SC2086  # ARGS splits into words on purpose
  out=$(timeout 20 "${bin[$1]}" $2 2>&1)
  rc=$?
  if [[ $rc -eq 0 || $rc -eq 124 || $rc -ge 128 ]] || ! grep -qF -- "$3" <<<"$out"; then
    echo "FAIL: $1 $2: exit $rc, wanted \"$3\" in:"
    echo "$out" | tail -3
    fails=$((fails + 1))
  fi
}

expect model_perf "-t 100000" "--threads: Value 100000 not in range"
expect model_perf "-t -1" "--threads: Value -1 not in range"
expect model_perf "-v 16,0" "--verify: Value 0 not in range"
expect model_perf "-v -3" "--verify: Value -3 not in range"
expect model_perf "-n 0" "--iters: Value 0 not in range 1 to"
expect model_perf "-C 0" "--context: Value 0 not in range 1 to"
expect model_perf "--model /nonexistent/x.gguf" "cannot open model file '/nonexistent/x.gguf'"

expect codec_quality "-D stories --greedy-steps 512" "--greedy-steps 512 leaves no prompt in a 512-token context"
expect codec_quality "-D stories --greedy-steps -1" "--greedy-steps: Value -1 not in range"
expect codec_quality "-D synth --synth-layers 0" "--synth-layers: Value 0 not in range"
expect codec_quality "-D synth --synth-tokens -5" "--synth-tokens: Value -5 not in range"
expect codec_quality "-D synth --synth-queries 0" "--synth-queries: Value 0 not in range"
expect codec_quality "-D synth --synth-queries 2000" "--synth-queries 2000 exceeds --synth-tokens 1024"
expect codec_quality "-D synth --synth-layers 128 --synth-tokens 100000" "would exceed 4 GiB"
expect codec_quality "-D synth --tree-study" "--tree-study needs a model data set"
expect codec_quality "-D stories --tree-study --greedy-steps 3" "--tree-study needs --greedy-steps >= 4"

expect spectrum_quality "--prompts -1 -D stories" "--prompts: Value -1 not in range"
expect spectrum_quality "--synth-layers -3 -D synth" "--synth-layers: Value -3 not in range"
expect spectrum_quality "--seeds 0 -D synth" "--seeds: Value 0 not in range"
expect spectrum_quality "-c 5" "--check: Value 5 not in range"
expect kvxfer_perf "-b 8T -e 8T" "not enough memory for these sizes"
expect endpoint_perf "--kv_bytes 16T --quick" "not enough memory for these sizes"
expect stream_perf "--tokens 1048576 --layers 4096" "for four copies of the KV, more than the"
expect net_plugin_perf "--fi_pingpong /nonexistent/fi_pingpong --quick" \
  "--fi_pingpong '/nonexistent/fi_pingpong' is not an executable"
expect codec_perf "--codec , --quick" "--codec ',' names no codec"
expect mesh_perf "-R 20" "--kill_at 200 and --disconnect_at 120 must be in [0, -R 20)"
expect mesh_perf "--kill_at -1 --quick" "--kill_at -1 and --disconnect_at 15 must be in [0, -R 96)"

expect disagg_demo "--threads 100000 --quick" "--threads: Value 100000 not in range"
expect disagg_demo "--prompt 1,2,abc --quick" "--prompt: 'abc' is not a token id"
expect disagg_demo "--prompt 1,,2 --quick" "--prompt: '' is not a token id"
expect disagg_demo "-p 0 --quick" "--prompt_len: Value 0 not in range"
expect disagg_demo "--temperature nan --quick" "--temperature: must be a finite number >= 0"
expect disagg_demo "--tokens 0" "--tokens: Value 0 not in range"
expect disagg_demo "--first_verify -1" "--first_verify: Value -1 not in range"
expect disagg_demo "--long_rate 1zbit --quick" "bad --long_rate '1zbit'"
expect disagg_demo "--long_text /nonexistent/x.txt --quick" "--long_text '/nonexistent/x.txt' cannot be read"

[[ $fails -eq 0 ]] && echo "bad_args_test: all refused with their messages"
exit $((fails > 0))
