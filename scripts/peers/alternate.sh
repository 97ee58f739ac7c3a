#!/usr/bin/env bash
# zrun and its peer run configuration by configuration, alternated, for ROUNDS
# rounds: the machine's drift falls on both sides of each ratio alike.
#   PEERENV=/tmp/peerenv scripts/peers/alternate.sh [ROUNDS] [CONFIG...]
# CONFIG: single (zrun 1 worker × 2 threads beside PyTorch in one process),
# s0 (2 workers beside DDP), s1 s2 s3 (2 workers beside DeepSpeed's stage);
# default all five. DTYPE=bf16 for mixed precision (where the CPU has no
# native bf16, PyTorch emulates it many times slower than f32: compare bf16 on
# CPUs with AVX512_BF16 or AMX). Prints one line a pair,
#   round config zrun_tokens/s peer_tokens/s zrun/peer zrun_model_GFLOP/s
# and after each round the `gemm_f32` row of `zrun bench kernels` (every
# core) measured then, the GEMM rate the step's model GFLOP/s compare
# against, each of the round's zrun runs as a share of it (step/GEMM: one
# closing row caught a slow minute of a noisy host and stood below every
# step), and fma_peak's scaling with threads (about 2x on 2 cores; near 1x
# means something else ran on the cores, a leftover process or the host, and
# that round compares nothing at 2 threads). With DTYPE=bf16 on a CPU with
# AVX512_BF16 it also prints each run as a share of `bf16_peak`, the bf16
# ceiling at the GEMM row's threads. PEER_VOCAB=50304 runs all
# of them with GPT-2's vocabulary (padded) instead of bytes, and
# PEER_SHAPE=layers,d_model,heads,seq (torch_peer.py's) another shape on
# both sides (e.g. 6,384,6,1024 for the anchor at 1024 tokens).
# Build first (cargo build --release); run on an otherwise idle machine.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PEERS=$ROOT/scripts/peers
PEERENV=${PEERENV:-/tmp/peerenv}
DTYPE=${DTYPE:-f32}
ROUNDS=${1:-2}; shift || true
MODEL_KEYS=()
if [ -n "${PEER_VOCAB:-}" ]; then export PEER_VOCAB; MODEL_KEYS=(--set model.vocab_size="$PEER_VOCAB"); fi
if [ -n "${PEER_SHAPE:-}" ]; then
  export PEER_SHAPE
  IFS=, read -r L D H S <<< "$PEER_SHAPE"
  MODEL_KEYS+=(--set model.n_layers="$L" --set model.d_model="$D" --set model.n_heads="$H" --set model.seq_len="$S")
fi
CONFIGS=("$@"); [ ${#CONFIGS[@]} -gt 0 ] || CONFIGS=(single s0 s1 s2 s3)
. "$PEERENV/venv/bin/activate"
export TORCH_EXTENSIONS_DIR="$PEERENV/torch_ext"
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT

zrun_rate() { # workers stage -> median tokens/s and model GFLOP/s of steps 4-14
  rm -rf "$W/run"
  "$ROOT/target/release/zrun" train "$ROOT/configs/gpt-anchor.yaml" --no-progress \
    --workers-per-node "$1" --set zero.stage="$2" --set train.dtype="$DTYPE" --set train.steps=14 "${MODEL_KEYS[@]}" \
    --set run_dir="$W/run" --metrics "$W/run/m.jsonl" > "$W/zrun.log" 2>&1 \
    || { echo "zrun failed: $(tail -1 "$W/zrun.log")" >&2; echo 0 0; return; }
  python3 - "$W/run/m.jsonl" <<'PY'
import json, statistics, sys
rows = [r for r in map(json.loads, filter(str.strip, open(sys.argv[1]))) if "tokens_per_s" in r][3:]
median = lambda key: statistics.median(r[key] for r in rows)
print(round(median("tokens_per_s")), round(median("tflops") * 1e3, 1))
PY
}

peer_rate() { # script args... -> the run's median tokens/s (0: it failed)
  { python3 "$PEERS/$1" "${@:2}" --dtype "$DTYPE" 2>"$W/peer.log" || true; } | python3 -c '
import json, sys
rates = [json.loads(l).get("tokens_per_s", 0) for l in sys.stdin if l.startswith("{")]
print(rates[0] if rates else 0)'
}

gemm_row() { # the round's model GFLOP/s... -> the gemm_f32 row, step/GEMM of each, fma_peak's scaling
  "$ROOT/target/release/zrun" bench kernels --json 2>/dev/null | DTYPE="$DTYPE" python3 -c '
import json, os, sys
out = json.load(sys.stdin)
rows = [r for r in out["rows"] if r["kernel"] == "gemm_f32"]
best = max(rows, key=lambda r: r["threads"])
gflops, threads = best["gflops"], best["threads"]
shares = " ".join(f"{float(g) / gflops:.2f}" for g in sys.argv[1:])
line = f"gemm_f32 {threads} threads {gflops:.1f} GFLOP/s, step/GEMM {shares}"
bf16 = {r["threads"]: r["gflops"] for r in out["rows"] if r["kernel"] == "bf16_peak"}
if os.environ.get("DTYPE") == "bf16" and threads in bf16:
    shares = " ".join(f"{float(g) / bf16[threads]:.2f}" for g in sys.argv[1:])
    line += f", step/bf16_peak {shares}"
peaks = {r["threads"]: r["gflops"] for r in out["rows"] if r["kernel"] == "fma_peak"}
if len(peaks) > 1:
    t = max(peaks)
    line += f", fma_peak {t} threads / 1 thread: {peaks[t] / peaks[1]:.2f}x"
print(line)
if out.get("shared_cores"):
    print("warning:", out["shared_cores"])' "$@"
}

for r in $(seq "$ROUNDS"); do
  rates=()
  for c in "${CONFIGS[@]}"; do
    case $c in
      single) read -r z g < <(zrun_rate 1 0); p=$(THREADS=2 peer_rate torch_peer.py single) ;;
      s0) read -r z g < <(zrun_rate 2 0); p=$(peer_rate torch_peer.py ddp) ;;
      s1|s2|s3) read -r z g < <(zrun_rate 2 "${c#s}"); p=$(peer_rate ds_peer.py "z${c#s}") ;;
      *) echo "unknown configuration $c (single s0 s1 s2 s3)" >&2; exit 2 ;;
    esac
    python3 -c "import sys; z, p = int(sys.argv[3]), int(sys.argv[4]); print(*sys.argv[1:3], z, p, f'{z / p:.2f}x' if p else 'peer failed', sys.argv[5])" "$r" "$c" "$z" "$p" "$g"
    rates+=("$g")
  done
  echo -n "$r "; gemm_row "${rates[@]}"
done
