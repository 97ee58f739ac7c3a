#!/usr/bin/env bash
# One benchmark sitting on this machine, in the order the README's tables were
# measured: GEMMs (zgemm beside OpenBLAS, three interleaved rounds), training
# steps (zrun f32 and bf16 at each stage, twice), the peers (PyTorch, DeepSpeed;
# f32 through the peers' side.sh, bf16 through the scripts beside this one),
# collectives (zrun TCP and shared memory beside gloo). Nothing else should run.
#   PEERENV=/tmp/peerenv PEERS=../shared/peers scripts/sitting.sh OUT_DIR
# PEERENV is the venv that the peers' setup.sh makes (torch, deepspeed, numpy).
set -u
cd "$(dirname "$0")/.."
OUT=${1:?an output directory}; mkdir -p "$OUT"
PEERENV=${PEERENV:-/tmp/peerenv}; PEERS=${PEERS:-../shared/peers}
JOB=$PEERS/gpt-anchor.yaml
cargo build --release --quiet && cargo build --release --quiet -p zgemm --example gemm_bench
. "$PEERENV/venv/bin/activate"
export TORCH_EXTENSIONS_DIR="$PEERENV/torch_ext"
for r in 1 2 3; do
  for t in 1 2; do OPENBLAS_NUM_THREADS=$t python3 scripts/gemm_openblas.py >> "$OUT/openblas.txt"; done
  # OpenBLAS's AVX2 kernels (its Haswell core type), beside zgemm's AVX2
  # column: how the AVX2 path compares where the CPU has AVX-512 too.
  for t in 1 2; do OPENBLAS_CORETYPE=Haswell OPENBLAS_NUM_THREADS=$t python3 scripts/gemm_openblas.py >> "$OUT/openblas_haswell.txt"; done
  target/release/examples/gemm_bench >> "$OUT/zgemm.txt"
done
step() { # workers stage dtype
  local w; w=$(mktemp -d)
  target/release/zrun train "$JOB" --no-progress --workers-per-node "$1" --set zero.stage="$2" \
    --set train.dtype="$3" --set run_dir="$w/r" --metrics "$w/r.jsonl" > "$w/log" 2>&1
  python3 - "$w/r.jsonl" "zrun $3 workers $1 stage $2" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][3:]
loss = [r["loss"] for r in rows if "loss" in r]
print(sys.argv[2], round(statistics.median(tps)), "tokens/s, last loss", round(loss[-1], 4))
PY
  rm -rf "$w"
}
for r in 1 2; do
  for c in "1 0" "2 0" "2 1" "2 2" "2 3"; do for dt in f32 bf16; do step $c $dt >> "$OUT/zrun.txt"; done; done
done
ZBIN=$PWD/target/release PEERENV=$PEERENV "$PEERS/side.sh" 1 > "$OUT/side.txt" 2>&1
THREADS=2 python3 scripts/torch_bf16_peer.py > "$OUT/torch_bf16.txt" 2>&1
python3 scripts/ds_bf16_peer.py 2>/dev/null | grep "^deepspeed bf16" > "$OUT/ds_bf16.txt"
target/release/zrun bench comm --transports tcp,shm --sizes 16MiB,256MiB > "$OUT/comm.txt" 2>&1
timeout 300 python3 scripts/gloo_comm.py --sizes 16MiB,256MiB > "$OUT/gloo.txt" 2>&1
echo "sitting written to $OUT"
