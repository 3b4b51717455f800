#!/usr/bin/env bash
# Measures the kvxfer_perf figures (docs/PERFORMANCE.md, "The figures") in
# one go, prints them and writes docs/FIGURES.md: the machine (CPU model and
# flags), the date, the commit, every command run and the output.
#
#   1. unlimited rate: BF16 monolithic kvxfer_send/recv throughput against
#      fi_pingpong -e rdm at the same message size (the whole KV), on the
#      path each takes: (a) the default, which joins two processes of one
#      host over libfabric's shm provider, against fi_pingpong -p shm,
#      in 3 interleaved rounds (the ratio is their median); (b) the network,
#      KVXFER_OFI_PROVIDER="tcp;ofi_rxm" on 127.0.0.1, against fi_pingpong
#      -p "tcp;ofi_rxm", also at the size of one page message; each with
#      --engine_only (the codec jobs do no work);
#   2. -r 1gbit: Lynx progressive against INT8 monolithic,
#      t_anchor(lynx)/t_complete(int8) and t_complete(lynx)/t_complete(int8);
#   3. -R 16: whether the anchors of all 16 requests were ANCHOR_READY before
#      the first residual of any of them was applied;
#   4. -r 10gbit and 25gbit: Lynx, INT8 and BF16 monolithic against the time
#      the link alone needs for their bytes;
#   5. unlimited rate: t_complete of Lynx against BF16 monolithic, (a) on the
#      default path, (b) on the network (KVXFER_OFI_PROVIDER="tcp;ofi_rxm").
#
#   perf/run_figures.sh [-o FILE] [BUILD_DIR]   # BUILD_DIR default build,
#                                               # FILE default docs/FIGURES.md
#   perf/run_figures.sh --quick [BUILD_DIR]     # small sizes, one round, in
#       # seconds: checks the script; writes FIGURES.md in the logs directory
#   KVXFER_FIGURES_OUT=DIR perf/run_figures.sh  # keep the logs and JSON in DIR
#   perf/run_figures.sh --help
#
# Slow (a few minutes on 2 cores) and timing-only, so not a ctest.  Needs
# fi_pingpong (Debian package libfabric-bin) and python3; every command runs
# under `timeout`, so a hang shows up as a failure, never as a stuck script.
# Exit status: 0 when every run completed with #wrong = 0, else 1; 2 for a
# bad argument or a missing tool.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; }
build="build" quick=0 figures=""
while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --quick) quick=1; shift ;;
    -o) [[ $# -ge 2 ]] || { echo "run_figures.sh: -o needs a file" >&2; exit 2; }
      figures="$2"; shift 2 ;;
    -*) echo "run_figures.sh: unknown option $1 (--help)" >&2; exit 2 ;;
    *) build="$1"; shift ;;
  esac
done
perf="$build/perf/kvxfer_perf"
if [[ ! -x "$perf" ]]; then
  echo "run_figures.sh: $perf not found; build it first (ninja -C $build kvxfer_perf)" >&2
  exit 2
fi
for tool in python3 fi_pingpong timeout; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "run_figures.sh: $tool not found (scripts/install-deps.sh installs it)" >&2
    exit 2
  fi
done
out="${KVXFER_FIGURES_OUT:-$(mktemp -d /tmp/kvxfer-figures.XXXXXX)}"
mkdir -p "$out"
if [[ -z "$figures" ]]; then
  # --quick figures are not the ones the docs quote: they stay beside the logs.
  if ((quick)); then figures="$out/FIGURES.md"; else figures="$(cd "$here/.." && pwd)/docs/FIGURES.md"; fi
fi
status=0
: >"$out/commands"  # every command measured, one a line, for FIGURES.md

# Figure sizes: the Llama-3-8B-like default shape, 128 KiB of bf16 KV per token.
# --quick: sizes and counts that only check that every step runs.
if ((quick)); then
  big=4M big_bytes=4194304 fig2_sizes=(-b 1M -e 2M) fig3_size=256K
  rounds=1 n10=2 n5=2 n3=1 pp_iters=2 pp_page_iters=5
else
  big=64M big_bytes=67108864 fig2_sizes=(-b 16M -e 64M) fig3_size=2M
  rounds=3 n10=10 n5=5 n3=3 pp_iters=10 pp_page_iters=200
fi
fig1_size=$big

# json FILE EXPR: evaluates a Python expression over the kvxfer_perf JSON `j`.
json() {
  python3 - "$1" "$2" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
print(eval(sys.argv[2]))
EOF
}

# run NAME ARGS...: kvxfer_perf with -J, its output in $out/NAME.log.
run() {
  local name="$1"
  shift
  echo "\$ kvxfer_perf $*" >"$out/$name.log"
  echo "${KVXFER_OFI_PROVIDER:+KVXFER_OFI_PROVIDER='$KVXFER_OFI_PROVIDER' }$perf $* -J $name.json" \
    >>"$out/commands"
  # INIT's INFO lines name the path each rank took ("ready (provider shm").
  KVXFER_DEBUG="${KVXFER_DEBUG:-INFO}" KVXFER_DEBUG_SUBSYS="${KVXFER_DEBUG_SUBSYS:-INIT}" \
    timeout 900 "$perf" "$@" -J "$out/$name.json" >>"$out/$name.log" 2>&1
  local rc=$?
  if ((rc != 0)); then
    echo "  kvxfer_perf $* FAILED (exit $rc); last lines of $out/$name.log:"
    grep -v '^# Settings' "$out/$name.log" | tail -n 6 | sed 's/^/    /'
    status=1
    return 1
  fi
  return 0
}

# path NAME: the providers the ranks of run NAME used, from its log.
path() {
  grep -o 'ready (provider [^,]*' "$out/$1.log" | sed 's/ready (provider //' | sort -u | paste -sd/ -
}

# pingpong PROVIDER SIZE ITERS: one-way GB/s of fi_pingpong PROVIDER rdm on 127.0.0.1.
pingpong() {
  local prov="$1" size="$2" iters="$3" port=$((20000 + RANDOM % 20000))
  local tag="${prov//[^a-z]/_}-$size"
  echo "fi_pingpong -p '$prov' -e rdm -S $size -I $iters  # a server, and a client to 127.0.0.1" \
    >>"$out/commands"
  timeout 300 fi_pingpong -p "$prov" -e rdm -B "$port" -S "$size" -I "$iters" \
    >"$out/pingpong-$tag.server" 2>&1 &
  local server=$!
  local line="" try
  for try in 1 2 3 4 5 6 7 8 9 10; do
    sleep 0.3
    line="$(timeout 300 fi_pingpong -p "$prov" -e rdm -P "$port" -S "$size" -I "$iters" \
      127.0.0.1 2>>"$out/pingpong-$tag.client" | tail -n 1)"
    [[ "$line" =~ ^[0-9] ]] && break
  done
  wait "$server" 2>/dev/null
  echo "$line" >>"$out/pingpong-$tag.client"
  # bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec
  if [[ "$line" =~ ^[0-9] ]]; then
    awk '{ printf "%.3f", $6 / 1000 }' <<<"$line"
  else
    echo "n/a"
  fi
}

# The machine, for FIGURES.md.
started="$(date -u '+%Y-%m-%d %H:%M UTC')"
# The file this script writes is its output: rewriting it is not a change.
commit="$(git -C "$here/.." rev-parse --short HEAD 2>/dev/null || echo unknown)"
own="$(realpath -m --relative-to="$here/.." "$figures")"
unchanged=(.)
[[ "$own" != ../* ]] && unchanged+=(":!$own")
if [[ "$commit" != unknown ]] && ! git -C "$here/.." diff --quiet HEAD -- "${unchanged[@]}" 2>/dev/null; then
  commit="$commit with uncommitted changes"
fi
cpu_model="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)"
has() { grep -q -w "$1" /proc/cpuinfo && echo yes || echo no; }
avx512=no
[[ $(has avx512f)$(has avx512bw)$(has avx512vl)$(has avx512dq) == yesyesyesyes ]] && avx512=yes
cpu_flags="AVX2 $(has avx2), F16C $(has f16c), AVX-512 F/BW/VL/DQ $avx512"
fabric="$(fi_info --version 2>/dev/null | sed -n 's/^libfabric: //p' | head -n 1)"

echo "# logs and JSON in $out" >&2
# The figures go to stdout and to $out/figures.txt (for FIGURES.md).
exec 3>&1 > >(tee "$out/figures.txt")
tee_pid=$!

# ---- 1. unlimited rate: BF16 monolithic against fi_pingpong -------------------
# ratio X Y: X / Y to 3 places, or n/a.
ratio() {
  python3 -c 'import sys
try:
    print("%.3f" % (float(sys.argv[1]) / float(sys.argv[2])))
except (ValueError, ZeroDivisionError):
    print("n/a")' "$1" "$2"
}
# median A B C ...: the median of numbers (n/a ignored), or n/a.
median() {
  python3 -c 'import sys, statistics
v = [float(x) for x in sys.argv[1:] if x != "n/a"]
print("%.3f" % statistics.median(v) if v else "n/a")' "$@"
}

echo "## 1a. Same host (the default path: libfabric shm): BF16 monolithic against fi_pingpong -p shm"
ratios=()
for round in $(seq "$rounds"); do
  pp1=$(pingpong shm "$big_bytes" "$pp_iters")
  if run "fig1a-$round" -b "$fig1_size" -e "$fig1_size" -m bf16 -w 1 -n "$n10"; then
    j="$out/fig1a-$round.json"
    wbw=$(json "$j" '"%.3f" % j["rows"][0]["wirebw_gbps"]')
    tc=$(json "$j" '"%.1f" % j["rows"][0]["t_complete"]["median_us"]')
  else
    wbw="n/a" tc="n/a"
  fi
  pp2=$(pingpong shm "$big_bytes" "$pp_iters")
  pp=$(python3 -c 'import sys; v=[float(x) for x in sys.argv[1:] if x != "n/a"]; print("%.3f" % max(v) if v else "n/a")' "$pp1" "$pp2")  # the better of the two: the bound
  r=$(ratio "$wbw" "$pp")
  ratios+=("$r")
  echo "  round $round: kvxfer bf16 mono over $(path "fig1a-$round") t_complete $tc us, wirebw $wbw GB/s (median of $n10); fi_pingpong -p shm $pp1, $pp2 GB/s; ratio $r"
done
ewbw="n/a"
if run fig1a-e -b "$fig1_size" -e "$fig1_size" -m bf16 -w 1 -n "$n10" --engine_only; then
  ewbw=$(json "$out/fig1a-e.json" '"%.3f" % j["rows"][0]["wirebw_gbps"]')
fi
echo "  --engine_only (codec jobs do no work): wirebw $ewbw GB/s"
echo "  ratio wirebw(kvxfer) / fi_pingpong -p shm at $big, median of $rounds rounds: $(median "${ratios[@]}") (target >= 0.75)"
echo

echo "## 1b. Network (KVXFER_OFI_PROVIDER=tcp;ofi_rxm, 127.0.0.1): BF16 monolithic against fi_pingpong"
export KVXFER_OFI_PROVIDER="tcp;ofi_rxm"
if run fig1 -b "$fig1_size" -e "$fig1_size" -m bf16 -w 1 -n "$n5"; then
  j="$out/fig1.json"
  kv=$(json "$j" 'j["rows"][0]["kv_bytes"]')
  wire=$(json "$j" 'j["rows"][0]["wire_bytes"]')
  pages=$(json "$j" 'j["rows"][0]["pages"]')
  tc=$(json "$j" '"%.1f" % j["rows"][0]["t_complete"]["median_us"]')
  alg=$(json "$j" '"%.3f" % j["rows"][0]["algbw_gbps"]')
  wbw=$(json "$j" '"%.3f" % j["rows"][0]["wirebw_gbps"]')
  page_msg=$((wire / pages))
  pp_kv=$(pingpong "tcp;ofi_rxm" "$kv" "$pp_iters")
  pp_page=$(pingpong "tcp;ofi_rxm" "$page_msg" "$pp_page_iters")
  echo "  kvxfer bf16 mono over $(path fig1), $kv B of KV ($pages page messages of $page_msg B, $wire B on the wire):"
  echo "    t_complete $tc us, algbw $alg GB/s, wirebw $wbw GB/s (median of $n5)"
  echo "  fi_pingpong at $kv B (one message of the whole KV): $pp_kv GB/s"
  echo "  fi_pingpong at $page_msg B (one page message):      $pp_page GB/s"
  # The same transfer with the codec jobs doing no work (--engine_only): the
  # engine, the Link and the wire alone, so the gap to fi_pingpong splits into
  # the engine's share and the passthrough's copies and checksums.
  ewbw="n/a"
  if run fig1e -b "$fig1_size" -e "$fig1_size" -m bf16 -w 1 -n "$n5" --engine_only; then
    ewbw=$(json "$out/fig1e.json" '"%.3f" % j["rows"][0]["wirebw_gbps"]')
    echo "    --engine_only (codec jobs do no work): wirebw $ewbw GB/s (median of $n5)"
  fi
  echo "  ratio wirebw(kvxfer) / fi_pingpong: $(ratio "$wbw" "$pp_kv") at the KV size, $(ratio "$wbw" "$pp_page") at the page size"
  echo "  ratio wirebw(kvxfer --engine_only) / fi_pingpong at the KV size: $(ratio "$ewbw" "$pp_kv")"
fi
unset KVXFER_OFI_PROVIDER
echo

# ---- 2. -r 1gbit: Lynx progressive against INT8 monolithic --------------------
echo "## 2. Rate 1gbit: Lynx 4+4 progressive against INT8 monolithic"
if run fig2 "${fig2_sizes[@]}" -m lynx,int8 -r 1gbit -w 1 -n "$n3"; then
  j="$out/fig2.json"
  json "$j" '"\n".join("  %9d B: t_anchor(lynx)/t_complete(int8) = %.3f   t_complete(lynx)/t_complete(int8) = %.3f" % (r["kv_bytes"], r["anchor_lynx_over_complete_int8"], r["complete_lynx_over_complete_int8"]) for r in j["ratios"] if "anchor_lynx_over_complete_int8" in r) or "  no ratios"'
  json "$j" '"\n".join("    %-4s %-4s %9d B: t_anchor %.1f ms, t_complete %.1f ms, %d B on the wire" % (r["codec"], r["mode"], r["kv_bytes"], r["t_anchor"]["median_us"] / 1e3, r["t_complete"]["median_us"] / 1e3, r["wire_bytes"]) for r in j["rows"])'
  echo "    path: $(path fig2)"
fi
echo

# ---- 3. -R 16: anchors of all requests before any residual --------------------
echo "## 3. 16 requests in flight (default path): anchors of all requests before any residual?"
fig3() {
  local name="$1"
  shift
  if run "$name" "$@"; then
    json "$out/$name.json" '"  anchors of all requests landed before any residual was applied: %s (%d of %d progressive batches; worst margin %s us)" % (j["anchors_first"]["result"], j["anchors_first"]["batches_ok"], j["anchors_first"]["batches"], "%+.1f" % j["anchors_first"]["worst_margin_us"] if j["anchors_first"]["worst_margin_us"] is not None else "n/a")'
    json "$out/$name.json" '"\n".join("    %-4s %-4s %9d B x 16: t_anchor %.1f ms, t_complete %.1f ms" % (r["codec"], r["mode"], r["kv_bytes"], r["t_anchor"]["median_us"] / 1e3, r["t_complete"]["median_us"] / 1e3) for r in j["rows"])'
    return 0
  fi
  return 1
}
echo "  Llama-3-8B-like shape, $fig3_size per request:"
if fig3 fig3 -b "$fig3_size" -e "$fig3_size" -m lynx,int8 -R 16 -w 1 -n "$n3" --timeout_ms 10000; then
  echo "    path: $(path fig3)"
else
  echo "  the same with 2 layers (64 page messages per class instead of 1024):"
  fig3 fig3-small -L 2 -b 1M -e 1M -m lynx,int8 -R 16 -w 1 -n "$n3" --timeout_ms 10000
fi
echo

# ---- 4. -r 10gbit / 25gbit: Lynx against the link's own time -------------------
echo "## 4. Rates 10gbit and 25gbit, $big: Lynx 4+4 against the link alone, INT8 and BF16 monolithic"
echo "  bound: t <= 1.15 x (wire bytes / rate) + 2 ms, for t_anchor (anchor bytes) and t_complete (all bytes)"
for rate in 10gbit 25gbit; do
  if run "fig4-$rate" -b "$big" -e "$big" -m lynx,int8,bf16 -r "$rate" -w 1 -n "$n3"; then
    echo "  $rate, path $(path "fig4-$rate"):"
    json "$out/fig4-$rate.json" '"\n".join(
      (lambda bps: "    %-4s %-4s t_anchor %7.1f ms (bound %7.1f, %s)  t_complete %7.1f ms (bound %7.1f, %s)" % (
        r["codec"], r["mode"],
        r["t_anchor"]["median_us"] / 1e3, 1.15 * r["anchor_wire_bytes"] / bps * 1e3 + 2,
        "met" if r["t_anchor"]["median_us"] / 1e3 <= 1.15 * r["anchor_wire_bytes"] / bps * 1e3 + 2 else "MISSED",
        r["t_complete"]["median_us"] / 1e3, 1.15 * r["wire_bytes"] / bps * 1e3 + 2,
        "met" if r["t_complete"]["median_us"] / 1e3 <= 1.15 * r["wire_bytes"] / bps * 1e3 + 2 else "MISSED"))(
        {"10gbit": 10e9 / 8, "25gbit": 25e9 / 8}["'"$rate"'"])
      for r in j["rows"])'
    json "$out/fig4-$rate.json" '(lambda t: "    t_anchor(lynx) / t_complete(int8) = %.3f, / t_complete(bf16) = %.3f" % (t[("lynx","a")] / t[("int8","c")], t[("lynx","a")] / t[("bf16","c")]))({(r["codec"], k[2]): r[k]["median_us"] for r in j["rows"] for k in ("t_anchor", "t_complete")})'
    # The same ratio were both on the link alone: Lynx's anchor bytes over INT8's wire bytes.
    json "$out/fig4-$rate.json" '(lambda b: "    the link alone: anchor bytes(lynx) / wire bytes(int8) = %.3f" % (b["lynx"][0] / b["int8"][1]))({r["codec"]: (r["anchor_wire_bytes"], r["wire_bytes"]) for r in j["rows"]})'
  fi
done
echo

# ---- 5. unlimited: Lynx against BF16 monolithic ---------------------------------
echo "## 5. Unlimited rate, $big: t_complete(Lynx) against t_complete(BF16 monolithic)"
fig5() {
  if run "$1" -b "$big" -e "$big" -m lynx,bf16 -w 1 -n "$n5"; then
    echo "  path $(path "$1"):"
    json "$out/$1.json" '(lambda t: "    t_complete: lynx %.1f ms, bf16 %.1f ms, ratio %.3f (target <= 1)" % (t["lynx"] / 1e3, t["bf16"] / 1e3, t["lynx"] / t["bf16"]))({r["codec"]: r["t_complete"]["median_us"] for r in j["rows"]})'
  fi
}
fig5 fig5
# (b) The network, where BF16's bytes are slower than Lynx's codec work.
KVXFER_OFI_PROVIDER="tcp;ofi_rxm" fig5 fig5b
echo
if ((status == 0)); then
  echo "# all runs completed, #wrong = 0"
else
  echo "# some runs FAILED (logs in $out)"
fi
exec 1>&3 3>&-
wait "$tee_pid" 2>/dev/null

{
  echo "# Figures"
  echo
  echo "The figures of \`perf/run_figures.sh\`$( ((quick)) && echo " --quick (small sizes: a check of the script, not the figures)"), which writes this file; do not edit."
  echo "[PERFORMANCE.md](PERFORMANCE.md), \"The figures\", says what each one measures."
  echo
  echo "- Date: $started"
  echo "- Commit: $commit"
  echo "- Machine: ${cpu_model:-unknown CPU}, $(nproc) CPUs; $cpu_flags; $(uname -sr); libfabric ${fabric:-unknown}"
  echo "- Exit status: $status"
  echo
  echo "## Commands"
  echo
  echo "Each kvxfer_perf ran under \`timeout 900\` with \`KVXFER_DEBUG=INFO KVXFER_DEBUG_SUBSYS=INIT\`"
  echo "(its log names the path each rank took)."
  echo
  echo '```sh'
  awk '!seen[$0]++' "$out/commands"
  echo '```'
  echo
  echo "## Output"
  echo
  echo '```'
  cat "$out/figures.txt"
  echo '```'
} >"$figures"
echo "# wrote $figures" >&2
exit "$status"
