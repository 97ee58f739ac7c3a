#!/usr/bin/env bash
# ZeRO++ on a slow inter-node link: the same 2 x 2 job (2 workers on
# 127.0.0.2, 2 on 127.0.0.3, the loopback hostfile) at stage 3 and with qwZ,
# hpZ and qgZ, run in a private network namespace whose loopback traffic to
# each "node" address is shaped to RATE (default 1gbit) with tc. Inside a node
# workers talk over shared memory, so the shaping only slows what crosses
# nodes: each node's incoming link gets RATE, like one NIC per node.
#
#   sudo scripts/zeropp-throttled.sh [RATE] [STEPS] [DTYPE] [COMPARE]
#
# COMPARE `reduce` instead runs stage 2 with gradients reduced in f32 and in
# 16 bits (`train.reduce_dtype` = DTYPE, bf16 unless DTYPE is f16); `hpz`
# runs stage 3 plain and with hpZ alone (lossless: backward's gathers stay
# inside each node); `loco` runs qgZ alone without and with LoCo's error
# feedback (`zero.loco`: what it costs on top of qgZ).
#
# Needs root (unshare -n, tc) and a release build. Prints tokens/s of each run
# and the ratio. A benchmark, not a test: timings depend on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-1gbit}
steps=${2:-40}
dtype=${3:-bf16}
compare=${4:-zeropp}
zrun=target/release/zrun
[ -x "$zrun" ] || { echo "build first: cargo build --release" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "needs root (unshare -n and tc)" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
printf '127.0.0.2 slots=2\n127.0.0.3 slots=2\n' >"$out/hosts"

unshare -n bash -s "$rate" "$steps" "$dtype" "$out" "$zrun" "$compare" <<'EOF'
set -euo pipefail
rate=$1 steps=$2 dtype=$3 out=$4 zrun=$5 compare=$6
ip link set lo up
if [ "$rate" != none ]; then
    # Class 1:1 (unshaped) for everything else; 1:2 and 1:3 for each node's
    # incoming traffic, each limited to the rate. (htb: this kernel may lack
    # prio and netem.)
    tc qdisc add dev lo root handle 1: htb default 1 r2q 100000
    tc class add dev lo parent 1: classid 1:1 htb rate 100gbit
    tc class add dev lo parent 1: classid 1:2 htb rate "$rate" ceil "$rate"
    tc class add dev lo parent 1: classid 1:3 htb rate "$rate" ceil "$rate"
    # A connection's initiator sends from 127.0.0.1 (the loopback route's
    # source), so traffic towards a node is what goes to its address, or what
    # the other node's address sends to 127.0.0.1 (zrun's small control
    # traffic from that node too).
    tc filter add dev lo parent 1: protocol ip prio 1 u32 match ip dst 127.0.0.2/32 flowid 1:2
    tc filter add dev lo parent 1: protocol ip prio 1 u32 \
        match ip src 127.0.0.3/32 match ip dst 127.0.0.1/32 flowid 1:2
    tc filter add dev lo parent 1: protocol ip prio 1 u32 match ip dst 127.0.0.3/32 flowid 1:3
    tc filter add dev lo parent 1: protocol ip prio 1 u32 \
        match ip src 127.0.0.2/32 match ip dst 127.0.0.1/32 flowid 1:3
fi
run() {
    local name=$1; shift
    "$zrun" train configs/tiny.yaml --hostfile "$out/hosts" --no-progress \
        --set train.steps="$steps" --set train.dtype="$dtype" \
        --set run_dir="$out/runs" --metrics "$out/$name.jsonl" "$@" >"$out/$name.log" 2>&1 \
        || { cat "$out/$name.log"; exit 1; }
    # The median step after the first (warm-up), and cross-node bytes.
    python3 - "$out/$name.jsonl" "$name" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l][1:]
rate = statistics.median(r["tokens_per_s"] for r in rows)
ms = statistics.median(r["step_ms"] for r in rows)
print(f"{sys.argv[2]}: {rate:,.0f} tokens/s, {ms:.1f} ms/step (medians), "
      f"cross-node {rows[-1]['comm_bytes']['inter_node'] / 1e6:.2f} MB/step (most of one rank), "
      f"final loss {rows[-1]['loss']:.4f}")
open(sys.argv[1] + ".rate", "w").write(str(rate))
PY
}
echo "link: $rate per node, $steps steps, $dtype"
if [ "$compare" = reduce ]; then
    half=bf16
    [ "$dtype" = f16 ] && half=f16
    run f32_reductions --set zero.stage=2
    run "${half}_reductions" --set zero.stage=2 --set train.reduce_dtype="$half"
    a=f32_reductions b="${half}_reductions"
elif [ "$compare" = loco ]; then
    run qgz --set zero.stage=3 --set zero.quantized_gradients=true
    run qgz_loco --set zero.stage=3 --set zero.quantized_gradients=true --set "zero.loco={}"
    a=qgz b=qgz_loco
elif [ "$compare" = hpz ]; then
    run stage3 --set zero.stage=3
    run hpz --set zero.stage=3 --set zero.zero_hpz_partition_size=2
    a=stage3 b=hpz
else
    run stage3 --set zero.stage=3
    run zeropp --set zero.stage=3 --set zero.zero_quantized_weights=true \
        --set zero.zero_hpz_partition_size=2 --set zero.zero_quantized_gradients=true
    a=stage3 b=zeropp
fi
python3 -c "
a = float(open('$out/$a.jsonl.rate').read()); b = float(open('$out/$b.jsonl.rate').read())
print(f'$b / $a throughput: {b / a:.2f}x')"
# Proof that the shaped classes carried the cross-node traffic.
[ "$rate" = none ] || tc -s class show dev lo | awk '/^class/ {c=$3} /Sent/ {print "  class " c ": " $2 " bytes"}'
EOF
