#!/usr/bin/env bash
# ctest "netns_two_hosts": two "hosts" in network namespaces joined by a veth
# pair, the sender's egress shaped with tc, a competing bulk flow, and one
# Lynx progressive kvxfer transfer between them.  Checks that the anchors,
# marked DSCP 46 (EF) by kvxfer, ride the high-priority HTB class and complete
# well before the residuals (DSCP 8, CS1), which share the default class with
# the unmarked bulk flow.
#
#   run.sh NETNS_PEER [WORK_DIR]
#
# NETNS_PEER is the tests/netns/netns_peer binary; WORK_DIR (default: a
# mktemp directory, removed at exit) receives the id file and the logs.
#
# Topology (nothing outside the two namespaces is touched; the veth pair is
# created inside them and disappears with them):
#
#   ns kvxns-s-PID  vs0 10.77.0.1/24  ==veth==  vr0 10.77.0.2/24  ns kvxns-r-PID
#   sender (rank 1)                                     receiver (rank 0)
#   bulk source                                         bulk sink
#
#   vs0 egress: htb 1: default 30
#     1:1  rate R ceil R
#       1:10  prio 0  rate 3R/4 ceil R   <- u32 match ip tos 0xb8 0xfc (EF: anchors)
#       1:30  prio 1  rate R/10 ceil R   <- u32 match ip tos 0x20 0xfc (CS1: residuals),
#                                           and by default everything else (the bulk flow)
#   (This kernel has no prio qdisc; HTB priorities do the job.)
#
# Exit status: 0 pass, 1 fail, 77 skip (no ip/tc/python3, namespaces not
# permitted, or no HTB/u32 in the kernel): ctest's SKIP_RETURN_CODE.
#
# Environment (optional, for experiments):
#   NETNS_RATE_MBIT    R above (default 40)
#   NETNS_TOKENS       tokens of the KV (default 512: 8 layers x 8 heads x 128, bf16 = 16 MiB)
#   NETNS_BULK_FLOWS   TCP connections of the bulk flow (default 3)
#   NETNS_ANCHOR_DSCP  DSCP of the anchors (default 46).  0 is the control
#                      experiment: anchors unmarked, in the default class
#                      with the bulk flow; the priority assertions then fail.
#   NETNS_TIMEOUT_MS   kvxfer_comm_config_t.timeout_ms of both ranks (default
#                      60000, longer than the transfer may take here: the
#                      sender's receive of the final STATUS is timed from its
#                      last incoming message, the handshake, so a transfer
#                      that outlasts the timeout fails on the sender)
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # bulk_flow.py lives here

peer=${1:-}
work=${2:-}
rate=${NETNS_RATE_MBIT:-40}
tokens=${NETNS_TOKENS:-512}
flows=${NETNS_BULK_FLOWS:-3}
anchor_dscp=${NETNS_ANCHOR_DSCP:-46}
timeout_ms=${NETNS_TIMEOUT_MS:-60000}

ns_s="kvxns-s-$$"
ns_r="kvxns-r-$$"
addr_s=10.77.0.1
addr_r=10.77.0.2
bulk_port=5201

skip() {
  echo "SKIP: $*"
  exit 77
}
fail() {
  echo "netns_two_hosts: FAIL: $*" >&2
  exit 1
}
step() { echo "== $*"; }

[[ -n "$peer" && -x "$peer" ]] || fail "usage: run.sh NETNS_PEER [WORK_DIR] (got '$peer')"
for tool in ip tc timeout python3 awk; do
  command -v "$tool" >/dev/null 2>&1 || skip "'$tool' not found"
done
python=$(command -v python3)

# ---------------------------------------------------------------------------
# Cleanup: always, whatever happens (ctest's timeout, a failed step, ^C).
# ---------------------------------------------------------------------------
own_work=0
cleanup() {
  local p ns
  # This shell's background jobs not yet waited for (their pids cannot have
  # been reused): the bulk flow and the two peers.
  for p in $(jobs -p); do kill "$p" 2>/dev/null; done
  for ns in "$ns_s" "$ns_r"; do
    if [[ -e "/run/netns/$ns" ]]; then
      # Whatever still runs in our namespaces is ours.
      for p in $(timeout 5 ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
      timeout 10 ip netns del "$ns" 2>/dev/null
    fi
  done
  wait 2>/dev/null
  if [[ $own_work == 1 ]]; then rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'echo "netns_two_hosts: interrupted" >&2; exit 1' INT TERM HUP

# Namespaces left behind by an earlier run that was killed outright (SIGKILL
# skips the trap): ours by name, and their creator is gone.
for f in /run/netns/kvxns-[sr]-*; do
  [[ -e "$f" ]] || continue
  pid=${f##*-}
  if [[ "$pid" =~ ^[0-9]+$ && "$pid" != "$$" ]] && ! kill -0 "$pid" 2>/dev/null; then
    echo "removing stale namespace ${f##*/}"
    timeout 10 ip netns del "${f##*/}" 2>/dev/null
  fi
done

if [[ -z "$work" ]]; then
  work=$(mktemp -d /tmp/kvxfer-netns.XXXXXX) || fail "mktemp"
  own_work=1
else
  { rm -rf "$work" && mkdir -p "$work"; } || fail "cannot create $work"
fi

# ---------------------------------------------------------------------------
# Two hosts.
# ---------------------------------------------------------------------------
step "namespaces $ns_s and $ns_r, veth vs0 $addr_s <-> vr0 $addr_r"
if ! err=$(timeout 10 ip netns add "$ns_s" 2>&1); then
  skip "cannot create a network namespace (ip netns add: ${err:-timed out}); run as root"
fi
timeout 10 ip netns add "$ns_r" || fail "ip netns add $ns_r"
if ! err=$(timeout 10 ip netns exec "$ns_s" true 2>&1); then
  skip "cannot run a process in a network namespace (ip netns exec: ${err:-timed out})"
fi
ipn() {  # ip in a namespace, bounded
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

step "tc on $ns_s vs0 egress: htb, total ${rate}mbit"
hi=$((rate * 3 / 4))
lo=$((rate / 10 > 0 ? rate / 10 : 1))
fifo=${NETNS_FIFO_BYTES:-$((rate * 125000 / 10))}  # 100 ms at the link rate
tcn() {
  timeout 10 tc -n "$ns_s" "$@"
}
if ! err=$(tcn qdisc add dev vs0 root handle 1: htb default 30 2>&1); then
  skip "the kernel has no HTB qdisc (tc: $err)"
fi
tcn class add dev vs0 parent 1: classid 1:1 htb rate "${rate}mbit" ceil "${rate}mbit" quantum 60000 ||
  fail "tc class 1:1"
tcn class add dev vs0 parent 1:1 classid 1:10 htb rate "${hi}mbit" ceil "${rate}mbit" prio 0 \
  quantum 60000 || fail "tc class 1:10"
tcn class add dev vs0 parent 1:1 classid 1:30 htb rate "${lo}mbit" ceil "${rate}mbit" prio 1 \
  quantum 60000 || fail "tc class 1:30"
# Short drop-tail queues under the leaves (the default pfifo of 1000 packets,
# up to 64 KiB each with GSO, would hold seconds of bulk data, and the
# residuals, at most 1 MiB in flight, would crawl behind it).  This kernel has
# no fq_codel or sfq.  Smaller GSO packets keep HTB's shaping smooth.
tcn qdisc add dev vs0 parent 1:10 handle 10: bfifo limit "$fifo" || fail "tc qdisc 10:"
tcn qdisc add dev vs0 parent 1:30 handle 30: bfifo limit "$fifo" || fail "tc qdisc 30:"
ipn "$ns_s" link set dev vs0 gso_max_size 16384
# DSCP is the top 6 bits of the TOS byte: EF 46 = 0xb8, CS1 8 = 0x20.
if ! err=$(tcn filter add dev vs0 parent 1: protocol ip prio 1 u32 match ip tos 0xb8 0xfc \
  flowid 1:10 2>&1); then
  skip "the kernel has no u32 classifier (tc: $err)"
fi
tcn filter add dev vs0 parent 1: protocol ip prio 2 u32 match ip tos 0x20 0xfc flowid 1:30 ||
  fail "tc filter CS1"
tcn qdisc show dev vs0
tcn filter show dev vs0

# ---------------------------------------------------------------------------
# The competing bulk flow: unmarked (TOS 0), so it lands in the default class.
# ---------------------------------------------------------------------------
# (tests/netns/bulk_flow.py, shared with the NCCL plugin's namespace test)

# Stops a background job: SIGTERM, then SIGKILL if it has not exited within
# 5 s.  (Whatever it leaves in the namespaces, cleanup kills.)
stop_job() {
  local pid=$1 i
  kill "$pid" 2>/dev/null
  for ((i = 0; i < 50; i++)); do
    [[ -e /proc/$pid && "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]] || break
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}

class_bytes() {  # class_bytes 1:10 -> bytes sent by that class so far
  tcn -s class show dev vs0 | awk -v c="$1" '$1 == "class" && $3 == c {f = 1} f && $1 == "Sent" {print $2; exit}'
}

step "bulk flow: $flows unmarked TCP connections $addr_s -> $addr_r:$bulk_port"
ip netns exec "$ns_r" timeout -k 5 150 "$python" "$here/bulk_flow.py" sink "$addr_r" "$bulk_port" \
  "$work/bulk_bytes" >"$work/bulk_sink.log" 2>&1 &
sink_pid=$!
ip netns exec "$ns_s" timeout -k 5 150 "$python" "$here/bulk_flow.py" source "$addr_r" "$bulk_port" \
  "$flows" >"$work/bulk_source.log" 2>&1 &
source_pid=$!
# Let it fill the default class, and prove that it does: at least half the
# link over one second, within 10 s (slow start, and a loaded machine).
bulk_rate=0
for _ in $(seq 10); do
  b0=$(class_bytes 1:30)
  sleep 1
  b1=$(class_bytes 1:30)
  bulk_rate=$(awk -v a="${b0:-0}" -v b="${b1:-0}" 'BEGIN {printf "%.1f", (b - a) * 8 / 1e6}')
  awk -v r="$bulk_rate" -v R="$rate" 'BEGIN {exit !(r >= 0.5 * R)}' && break
done
echo "bulk flow alone: ${bulk_rate} mbit/s in class 1:30"
[[ $flows == 0 ]] || awk -v r="$bulk_rate" -v R="$rate" 'BEGIN {exit !(r >= 0.5 * R)}' ||
  fail "the bulk flow does not load the link (${bulk_rate} of ${rate} mbit/s); see $work/bulk_*.log"
c10_before=$(class_bytes 1:10)
c30_before=$(class_bytes 1:30)
c10_before=${c10_before:-0} c30_before=${c30_before:-0}

# ---------------------------------------------------------------------------
# The transfer.
# ---------------------------------------------------------------------------
step "kvxfer: $tokens tokens x 8 layers x 8 kv_heads x 128 head_dim bf16, Lynx progressive"
peer_args=(--id "$work/id" --layers 8 --kv-heads 8 --head-dim 128 --tokens "$tokens"
  --page-tokens 64 --timeout-ms "$timeout_ms" --wait-s 55)
# The library's defaults mark the anchors EF (46) and the residuals CS1 (8).
# One codec thread: on a loaded 2-core machine the default (an OpenMP team per
# core, per page) encoded and decoded at half the speed, and the anchors'
# timing then measured the CPU rather than the network.
# The two namespaces share this host's /dev/shm and pids, so the auto
# provider would join them over shared memory: name the network provider.
common_env=(KVXFER_DEBUG=WARN KVXFER_CODEC_THREADS=1 "KVXFER_OFI_PROVIDER=tcp;ofi_rxm")
[[ "$anchor_dscp" == 46 ]] || common_env+=(KVXFER_ANCHOR_DSCP="$anchor_dscp")
ip netns exec "$ns_r" timeout -k 5 65 env "${common_env[@]}" KVXFER_BOOTSTRAP_ADDR="$addr_r" \
  KVXFER_BIND_ADDR="$addr_r" "$peer" --role recv "${peer_args[@]}" \
  >"$work/recv.out" 2>"$work/recv.err" &
recv_pid=$!
ip netns exec "$ns_s" timeout -k 5 65 env "${common_env[@]}" KVXFER_BIND_ADDR="$addr_s" \
  "$peer" --role send "${peer_args[@]}" >"$work/send.out" 2>"$work/send.err" &
send_pid=$!
wait "$send_pid"
send_rc=$?
wait "$recv_pid"
recv_rc=$?

c10=$(class_bytes 1:10)
c30=$(class_bytes 1:30)
c10=$((${c10:-0} - c10_before)) c30=$((${c30:-0} - c30_before))
stop_job "$source_pid"
stop_job "$sink_pid"
bulk_bytes=$(cat "$work/bulk_bytes" 2>/dev/null || echo 0)

echo "-- receiver (rank 0, $addr_r), times in ms from its kvxfer_recv:"
cat "$work/recv.out"
echo "-- sender (rank 1, $addr_s):"
grep -E '^(wait|result|anchor_bytes|residual_bytes|t_anchor_ready_ms|t_complete_ms|error)=' \
  "$work/send.out"
for f in recv.err send.err; do
  if [[ -s "$work/$f" ]]; then
    echo "-- $f:"
    cat "$work/$f"
  fi
done
echo "-- tc -s class show dev vs0 (in $ns_s):"
tcn -s class show dev vs0

# ---------------------------------------------------------------------------
# Verdict.
# ---------------------------------------------------------------------------
val() { awk -F= -v k="$1" '$1 == k {print substr($0, length(k) + 2); exit}' "$work/recv.out"; }
[[ $send_rc == 0 ]] || fail "sender exited with $send_rc (124: timed out)"
[[ $recv_rc == 0 ]] || fail "receiver exited with $recv_rc (124: timed out)"
[[ "$(val verify)" == ok ]] || fail "received KV differs from the sender's: $(val verify)"
[[ "$(val stage)" == 2 && "$(val mode)" == 1 ]] ||
  fail "not a completed progressive transfer (stage $(val stage), mode $(val mode))"

t_anchor=$(val t_anchor_ready_ms)
t_complete=$(val t_complete_ms)
a_bytes=$(val anchor_bytes)
r_bytes=$(val residual_bytes)
a_last=$(val anchor_last_ms)
r_half=$(val residual_half_ms)
# Goodput of each class on the wire: the anchors from the handshake to the
# last anchor's arrival; the residuals that landed after it, from then to the
# last residual (competing with the bulk flow only).  The high-priority class
# gets most of the link; the residuals share the default class with the bulk
# flow.  Unmarked anchors (NETNS_ANCHOR_DSCP=0) get less than the residuals.
a_mbit=$(awk -v b="$a_bytes" -v t="$a_last" -v h="$(val t_handshake_ms)" \
  'BEGIN {printf "%.1f", b * 8 / ((t - h) / 1e3) / 1e6}')
r_mbit=$(awk -v b="$(val residual_bytes_after_last_anchor)" -v t="$(val residual_last_ms)" \
  -v a="$a_last" 'BEGIN {printf "%.1f", (t > a) ? b * 8 / ((t - a) / 1e3) / 1e6 : 0}')

echo "== summary: anchor_ready ${t_anchor} ms, complete ${t_complete} ms" \
  "(ratio $(awk -v a="$t_anchor" -v c="$t_complete" 'BEGIN {printf "%.2f", a / c}'));" \
  "last anchor ${a_last} ms, half the residual bytes ${r_half} ms;" \
  "anchors ${a_mbit} mbit/s, residuals after the last anchor ${r_mbit} mbit/s (link ${rate});" \
  "class 1:10 ${c10} B (anchors ${a_bytes} B), class 1:30 ${c30} B" \
  "(residuals ${r_bytes} B + bulk ${bulk_bytes} B)"

awk -v a="$t_anchor" -v c="$t_complete" 'BEGIN {exit !(a > 0 && a <= 0.6 * c)}' ||
  fail "anchors not well before the residuals: ANCHOR_READY at ${t_anchor} ms," \
    "COMPLETE at ${t_complete} ms (want <= 0.6 x)"
awk -v a="$a_last" -v h="$r_half" 'BEGIN {exit !(a < h)}' ||
  fail "the last anchor (${a_last} ms) landed after half the residual bytes (${r_half} ms)"
awk -v a="$a_mbit" -v r="$r_mbit" 'BEGIN {exit !(a >= 1.5 * r)}' ||
  fail "anchors got ${a_mbit} mbit/s, residuals ${r_mbit}: the high-priority class got no more"
awk -v c="$c10" -v a="$a_bytes" -v r="$r_bytes" 'BEGIN {exit !(c >= a && c < a + r / 2)}' ||
  fail "class 1:10 sent ${c10} B: want the anchors' ${a_bytes} B (+ headers) and no residuals"
awk -v c="$c30" -v r="$r_bytes" 'BEGIN {exit !(c >= r)}' ||
  fail "class 1:30 sent ${c30} B, fewer than the residuals' ${r_bytes} B"
echo "netns_two_hosts: PASS"
