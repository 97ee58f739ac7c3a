#!/usr/bin/env bash
# Two zworker builds on one job, alternated run by run for ROUNDS rounds (the
# order flips every round), so that a shared host's drift falls on both alike:
#   scripts/ab.sh ROUNDS OLD_ZWORKER NEW_ZWORKER [zrun train arguments...]
# e.g., after copying the build before a change to /tmp/zworker-old:
#   cargo build --release && scripts/ab.sh 4 /tmp/zworker-old target/release/zworker \
#       configs/gpt-anchor.yaml --set train.dtype=bf16 --workers-per-node 1
# A "worker" may be a script that sets an environment variable and execs a
# zworker: an A/B of a setting. Prints one line a run (median tokens/s and
# forward, backward and optimizer ms of the steps after the third), each
# round's new/old ratio, then the ratios' median and range, and whether the
# two builds' losses agree to the last bit (they should, for a change that
# only moves time). Build first; run on an otherwise idle machine.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
usage="usage: scripts/ab.sh ROUNDS OLD_ZWORKER NEW_ZWORKER [zrun train arguments...]"
[ $# -ge 3 ] || { echo "$usage" >&2; exit 2; }
ROUNDS=$1 OLD=$2 NEW=$3; shift 3
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS: a whole number, not '$ROUNDS'. $usage" >&2; exit 2; }
for w in "$OLD" "$NEW"; do
  [ -x "$w" ] || { echo "$w: not an executable zworker. $usage" >&2; exit 2; }
done
[ $# -gt 0 ] || set -- "$ROOT/configs/gpt-anchor.yaml"
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT

# One run: `run LABEL WORKER JOB_ARGS...` appends the line
# "LABEL tokens/s forward_ms backward_ms optimizer_ms last_loss" to $W/rows.
run() {
  local label=$1 worker=$2; shift 2
  rm -rf "$W/run"
  "$ROOT/target/release/zrun" train "$@" --no-progress --worker-bin "$(realpath "$worker")" \
    --set run_dir="$W/run" --metrics "$W/run/m.jsonl" > "$W/zrun.log" 2>&1 \
    || { echo "$label: zrun failed: $(tail -1 "$W/zrun.log")" >&2; exit 1; }
  python3 - "$label" "$W/run/m.jsonl" >> "$W/rows" <<'PY'
import json, statistics, sys
label, path = sys.argv[1:]
steps = [r for r in map(json.loads, open(path)) if "tokens_per_s" in r]
timed = steps[3:] or steps
med = statistics.median
phase = lambda k: med([r["time_ms"][k] for r in timed])
print(f"{label} {med([r['tokens_per_s'] for r in timed]):.0f} {phase('forward'):.1f} "
      f"{phase('backward'):.1f} {phase('optimizer'):.1f} {steps[-1]['loss']!r}")
PY
}

echo "run tokens/s forward_ms backward_ms optimizer_ms last_loss"
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    if [ "$side" = old ]; then run old "$OLD" "$@"; else run new "$NEW" "$@"; fi
    echo "round $r: $(tail -1 "$W/rows")"
  done
done
python3 - "$W/rows" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
old = [r for r in rows if r[0] == "old"]
new = [r for r in rows if r[0] == "new"]
ratios = [float(n[1]) / float(o[1]) for o, n in zip(old, new)]
print(f"new/old tokens/s: median {statistics.median(ratios):.3f}, "
      f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds")
losses = {r[5] for r in rows}
print("last losses: " + ("the same to the last bit" if len(losses) == 1 else "DIFFER: " + " ".join(sorted(losses))))
PY
