#!/usr/bin/env bash
# One benchmark sitting on this machine: GEMMs (zgemm beside OpenBLAS, three
# interleaved rounds), zrun's training step beside PyTorch and DeepSpeed (f32,
# then bf16; alternated configuration by configuration, two rounds each), and
# collectives (zrun TCP and shared memory beside gloo). Nothing else should run.
#   PEERENV=/tmp/peerenv scripts/sitting.sh OUT_DIR
# PEERENV is the venv scripts/peers/setup.sh makes (torch, deepspeed, numpy).
set -u
cd "$(dirname "$0")/.."
OUT=${1:?an output directory}; mkdir -p "$OUT"
PEERENV=${PEERENV:-/tmp/peerenv}
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
PEERENV=$PEERENV scripts/peers/alternate.sh 2 > "$OUT/peers_f32.txt" 2>&1
DTYPE=bf16 PEERENV=$PEERENV scripts/peers/alternate.sh 2 > "$OUT/peers_bf16.txt" 2>&1
target/release/zrun bench comm --transports tcp,shm --sizes 16MiB,256MiB > "$OUT/comm.txt" 2>&1
timeout 300 python3 scripts/gloo_comm.py --sizes 16MiB,256MiB > "$OUT/gloo.txt" 2>&1
echo "sitting written to $OUT"
