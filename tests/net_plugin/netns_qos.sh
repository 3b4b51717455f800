#!/usr/bin/env bash
# ctest "net_plugin_netns_qos": the two-namespace QoS test of the transport
# (tests/netns/run.sh) run through the NCCL net plugin.  Two "hosts" in network
# namespaces joined by a veth pair; the sender's egress is shaped with HTB
# classes chosen by DSCP, and an unmarked bulk TCP flow loads the link.  Two
# plugin communicators carry the transfer: NCCL trafficClass 0 (anchor: DSCP
# 46, EF) and trafficClass 1 (residual: DSCP 8, CS1), as KVXFER_NET_TC_MAP maps
# them by default.  The anchor communicator must beat the residual one.
#
#   netns_qos.sh QOS_PEER PLUGIN [WORK_DIR]
#
# Exit status: 0 pass, 1 fail, 77 skip (not root, no ip/tc/python3, no netns,
# HTB or u32).  Nothing outside the two namespaces is touched.
#
#   ns kvxnp-s-PID  vs0 10.78.0.1/24 ==veth== vr0 10.78.0.2/24  ns kvxnp-r-PID
#   sender + bulk source                         receiver + bulk sink
#   vs0 egress: htb 1: default 30, 1:1 rate R
#     1:10 prio 0 rate 3R/4 ceil R  <- ip tos 0xb8/0xfc (EF: anchor communicator)
#     1:30 prio 1 rate R/10 ceil R  <- ip tos 0x20/0xfc (CS1: residual) and the bulk flow
#
# Environment (optional): NETNS_RATE_MBIT (R, default 40), NETNS_ANCHOR_BYTES
# (default 2 MiB), NETNS_RESIDUAL_BYTES (default 4 MiB), NETNS_BULK_FLOWS (2),
# NETNS_TC_MAP: KVXFER_NET_TC_MAP for both sides; "0=LOW_LATENCY,1=residual"
# (anchors unmarked) is the control experiment, whose assertions fail.
set -uo pipefail
bulk_flow="$(cd "$(dirname "${BASH_SOURCE[0]}")/../netns" && pwd)/bulk_flow.py"  # shared with tests/netns

peer=${1:-}
plugin=${2:-}
work=${3:-}
rate=${NETNS_RATE_MBIT:-40}
anchor_bytes=${NETNS_ANCHOR_BYTES:-2097152}
residual_bytes=${NETNS_RESIDUAL_BYTES:-4194304}
flows=${NETNS_BULK_FLOWS:-2}
tc_map=${NETNS_TC_MAP:-}

ns_s="kvxnp-s-$$"
ns_r="kvxnp-r-$$"
addr_s=10.78.0.1
addr_r=10.78.0.2
bulk_port=5202

skip() {
  echo "SKIP: $*"
  exit 77
}
fail() {
  echo "net_plugin_netns_qos: FAIL: $*" >&2
  exit 1
}
step() { echo "== $*"; }

[[ -n "$peer" && -x "$peer" && -f "$plugin" ]] || fail "usage: netns_qos.sh QOS_PEER PLUGIN [WORK_DIR]"
[[ $(id -u) == 0 ]] || skip "needs root (network namespaces)"
for tool in ip tc timeout python3 awk; do
  command -v "$tool" >/dev/null 2>&1 || skip "'$tool' not found"
done
python=$(command -v python3)

bg_pids=()
own_work=0
cleanup() {
  local p ns
  for p in "${bg_pids[@]}"; do kill "$p" 2>/dev/null; done
  for ns in "$ns_s" "$ns_r"; do
    if [[ -e "/run/netns/$ns" ]]; then
      for p in $(timeout 5 ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
      timeout 10 ip netns del "$ns" 2>/dev/null
    fi
  done
  for p in "${bg_pids[@]}"; do wait "$p" 2>/dev/null; done
  if [[ $own_work == 1 ]]; then rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'echo "net_plugin_netns_qos: interrupted" >&2; exit 1' INT TERM HUP

# Namespaces of an earlier run that was killed outright (their creator is gone).
for f in /run/netns/kvxnp-[sr]-*; do
  [[ -e "$f" ]] || continue
  pid=${f##*-}
  if [[ "$pid" =~ ^[0-9]+$ && "$pid" != "$$" ]] && ! kill -0 "$pid" 2>/dev/null; then
    timeout 10 ip netns del "${f##*/}" 2>/dev/null
  fi
done

if [[ -z "$work" ]]; then
  work=$(mktemp -d /tmp/kvxfer-np-netns.XXXXXX) || fail "mktemp"
  own_work=1
else
  rm -rf "$work" && mkdir -p "$work" || fail "cannot create $work"
fi

step "namespaces $ns_s and $ns_r, veth vs0 $addr_s <-> vr0 $addr_r"
if ! err=$(timeout 10 ip netns add "$ns_s" 2>&1); then
  skip "cannot create a network namespace (${err:-timed out})"
fi
timeout 10 ip netns add "$ns_r" || fail "ip netns add $ns_r"
timeout 10 ip netns exec "$ns_s" true 2>/dev/null || skip "cannot run a process in a network namespace"
ipn() {
  local ns=$1
  shift
  timeout 10 ip -n "$ns" "$@" || fail "ip -n $ns $*"
}
ipn "$ns_s" link add vs0 type veth peer name vr0 netns "$ns_r"
ipn "$ns_s" addr add "$addr_s/24" dev vs0
ipn "$ns_r" addr add "$addr_r/24" dev vr0
for ns in "$ns_s" "$ns_r"; do ipn "$ns" link set lo up; done
ipn "$ns_s" link set vs0 up
ipn "$ns_r" link set vr0 up

step "tc on $ns_s vs0 egress: htb, ${rate}mbit"
hi=$((rate * 3 / 4))
lo=$((rate / 10 > 0 ? rate / 10 : 1))
fifo=$((rate * 125000 / 10))  # 100 ms at the link rate
tcn() { timeout 10 tc -n "$ns_s" "$@"; }
if ! err=$(tcn qdisc add dev vs0 root handle 1: htb default 30 2>&1); then
  skip "the kernel has no HTB qdisc ($err)"
fi
tcn class add dev vs0 parent 1: classid 1:1 htb rate "${rate}mbit" ceil "${rate}mbit" quantum 60000 || fail "tc 1:1"
tcn class add dev vs0 parent 1:1 classid 1:10 htb rate "${hi}mbit" ceil "${rate}mbit" prio 0 quantum 60000 || fail "tc 1:10"
tcn class add dev vs0 parent 1:1 classid 1:30 htb rate "${lo}mbit" ceil "${rate}mbit" prio 1 quantum 60000 || fail "tc 1:30"
tcn qdisc add dev vs0 parent 1:10 handle 10: bfifo limit "$fifo" || fail "tc qdisc 10:"
tcn qdisc add dev vs0 parent 1:30 handle 30: bfifo limit "$fifo" || fail "tc qdisc 30:"
ipn "$ns_s" link set dev vs0 gso_max_size 16384
if ! err=$(tcn filter add dev vs0 parent 1: protocol ip prio 1 u32 match ip tos 0xb8 0xfc flowid 1:10 2>&1); then
  skip "the kernel has no u32 classifier ($err)"
fi
tcn filter add dev vs0 parent 1: protocol ip prio 2 u32 match ip tos 0x20 0xfc flowid 1:30 || fail "tc filter CS1"

# The unmarked bulk flow: tests/netns/bulk_flow.py, shared with the transport's namespace test.

class_bytes() {
  tcn -s class show dev vs0 | awk -v c="$1" '$1 == "class" && $3 == c {f = 1} f && $1 == "Sent" {print $2; exit}'
}

step "bulk flow: $flows unmarked TCP connections"
ip netns exec "$ns_r" timeout 150 "$python" "$bulk_flow" sink "$addr_r" "$bulk_port" >/dev/null 2>&1 &
bg_pids+=($!)
ip netns exec "$ns_s" timeout 150 "$python" "$bulk_flow" source "$addr_r" "$bulk_port" "$flows" >/dev/null 2>&1 &
bg_pids+=($!)
b0=$(class_bytes 1:30)
sleep 2
b1=$(class_bytes 1:30)
bulk=$(awk -v a="${b0:-0}" -v b="${b1:-0}" 'BEGIN {printf "%.1f", (b - a) * 8 / 2 / 1e6}')
echo "bulk flow alone: ${bulk} mbit/s in class 1:30"
[[ $flows == 0 ]] || awk -v r="$bulk" -v R="$rate" 'BEGIN {exit !(r >= 0.5 * R)}' ||
  fail "the bulk flow does not load the link (${bulk} of ${rate} mbit/s)"
c10_before=$(class_bytes 1:10)
c30_before=$(class_bytes 1:30)

step "plugin: anchor communicator (class 0) ${anchor_bytes} B in 64 KiB messages, residual communicator (class 1) ${residual_bytes} B in 1 MiB messages"
env_common=(KVXFER_DEBUG=WARN KVXFER_TIMEOUT_MS=20000)
[[ -z "$tc_map" ]] || env_common+=(KVXFER_NET_TC_MAP="$tc_map")
args=(--plugin "$plugin" --dir "$work" --anchor-bytes "$anchor_bytes" --residual-bytes "$residual_bytes"
  --anchor-msg 65536 --residual-msg 1048576 --wait-s 60)
ip netns exec "$ns_r" timeout 80 env "${env_common[@]}" KVXFER_NET_IF=vr0 "$peer" --role recv "${args[@]}" \
  >"$work/recv.out" 2>"$work/recv.err" &
recv_pid=$!
bg_pids+=($recv_pid)
ip netns exec "$ns_s" timeout 80 env "${env_common[@]}" KVXFER_NET_IF=vs0 "$peer" --role send "${args[@]}" \
  >"$work/send.out" 2>"$work/send.err" &
send_pid=$!
bg_pids+=($send_pid)
wait "$send_pid"
send_rc=$?
wait "$recv_pid"
recv_rc=$?
c10=$(($(class_bytes 1:10) - c10_before))
c30=$(($(class_bytes 1:30) - c30_before))

echo "-- receiver:"
cat "$work/recv.out"
for f in recv.err send.err send.out; do
  if [[ -s "$work/$f" ]]; then
    echo "-- $f:"
    cat "$work/$f"
  fi
done
echo "-- tc -s class show dev vs0:"
tcn -s class show dev vs0

val() { awk -F= -v k="$1" '$1 == k {print substr($0, length(k) + 2); exit}' "$work/recv.out"; }
[[ $send_rc == 0 ]] || fail "sender exited with $send_rc (124: timed out)"
[[ $recv_rc == 0 ]] || fail "receiver exited with $recv_rc (124: timed out)"
[[ "$(val verify)" == ok ]] || fail "received data differs: $(val verify)"
a_last=$(val t_anchor_last_ms)
r_half=$(val t_residual_half_ms)
r_last=$(val t_residual_last_ms)
a_mbit=$(awk -v b="$anchor_bytes" -v t="$a_last" 'BEGIN {printf "%.1f", b * 8 / (t / 1e3) / 1e6}')
echo "== summary: anchors done ${a_last} ms (${a_mbit} mbit/s), half the residual ${r_half} ms," \
  "all of it ${r_last} ms (ratio $(awk -v a="$a_last" -v r="$r_last" 'BEGIN {printf "%.2f", a / r}'));" \
  "class 1:10 ${c10} B, class 1:30 ${c30} B"
awk -v a="$a_last" -v r="$r_last" 'BEGIN {exit !(a > 0 && a <= 0.6 * r)}' ||
  fail "anchor communicator not well ahead: done at ${a_last} ms, residual at ${r_last} ms (want <= 0.6 x)"
awk -v a="$a_last" -v h="$r_half" 'BEGIN {exit !(a < h)}' ||
  fail "the anchors (${a_last} ms) finished after half the residual bytes (${r_half} ms)"
awk -v m="$a_mbit" -v R="$rate" 'BEGIN {exit !(m >= 0.4 * R)}' ||
  fail "anchors got ${a_mbit} mbit/s of ${rate}: not the high-priority class's share"
awk -v c="$c10" -v a="$anchor_bytes" -v r="$residual_bytes" 'BEGIN {exit !(c >= a && c < a + r / 2)}' ||
  fail "class 1:10 sent ${c10} B: want the anchors' ${anchor_bytes} B and no residual"
awk -v c="$c30" -v r="$residual_bytes" 'BEGIN {exit !(c >= r)}' ||
  fail "class 1:30 sent ${c30} B, fewer than the residuals' ${residual_bytes} B"
echo "net_plugin_netns_qos: PASS"
