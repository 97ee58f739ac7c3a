#!/usr/bin/env bash
# A GPU sitting in one call, on a GPU host, from what scripts/gpu-pack.sh
# packed elsewhere (no toolchain or build needed here): every GPU test made
# mandatory (ZRUN_REQUIRE_GPU=1), then step times of one worker at 85M and
# 152M parameters in TF32 and bf16, each with the unfused and the fused
# attention (ZRUN_GPU_ATTENTION), and f16 unfused, alternated, and bf16 at
# heads of 128 (the fused kernels' widest) both ways, and PyTorch eager beside them
# where python3 has torch; then bf16 on two workers sharing the GPU, the
# host flow against the state resident over NCCL, one worker's host flow
# (ZeRO-Offload: AdamW on the host), and `zrun bench comm
# --transports nccl`. ROUNDS (default 2) sets the rounds. Prints medians of steps 4-12 (zrun) and PyTorch's own
# median; compare only within one sitting.
#
#   scripts/gpu-sitting.sh [DIR] [tests|time|profile|all]     # default .gpu all
#   scripts/gpu-sitting.sh DIR ab OLD_DIR
#   scripts/gpu-sitting.sh DIR variants VARIANTS_DIR
#
# `profile` instead prints, for 152M steps in TF32 and bf16 with either
# attention, the GPU's time by operation (ZRUN_GPU_PROFILE=1), with the
# part of it the GPU waited for the host. `ab` times
# DIR's build against OLD_DIR's (another pack, e.g. of the commit before a
# change; two packs fit in one carry) on the jobs the GPU's recent changes
# touch, the two alternated run by run, the order swapped each round: one
# worker resident at 85M and 152M in bf16 and TF32 (attention by default),
# and the host flow (AdamW on the host) at gpt-anchor and 152M.
# `variants` runs each zworker that scripts/gpu-variant.sh built into
# VARIANTS_DIR beside DIR's zrun: a profile of the 152M step in bf16 and
# TF32 each (the 14 largest rows), then that step alternated over the
# variants, the order rotated each round (ROUNDS, default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(realpath "${1:-.gpu}")
what=${2:-all}
[ -x "$dir/release/zrun" ] || { echo "no $dir/release/zrun: run scripts/gpu-pack.sh first" >&2; exit 2; }
echo "== packed from commit $(cat "$dir/commit"); $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
if [ "$what" = ab ]; then
  old=$(realpath "${3:?ab needs the other pack: scripts/gpu-sitting.sh DIR ab OLD_DIR}")
  [ -x "$old/release/zrun" ] || { echo "no $old/release/zrun" >&2; exit 2; }
  echo "== against commit $(cat "$old/commit")"
fi

# CUDA's libraries from Python's NVIDIA wheels where no toolkit is installed
# (PyTorch brings NVRTC, cuBLAS and NCCL); NCCL's wheel has libnccl.so.2
# only, and cudarc loads libnccl.so: a link in a folder of our own.
libs=$(python3 -c 'import glob, site
for s in site.getsitepackages():
    print(":".join(sorted(glob.glob(s + "/nvidia/*/lib"))))' 2>/dev/null | tr '\n' ':' || true)
links=$(mktemp -d)
for d in ${libs//:/ }; do
  [ -e "$d/libnccl.so.2" ] && [ ! -e "$d/libnccl.so" ] && ln -sf "$d/libnccl.so.2" "$links/libnccl.so"
done
export LD_LIBRARY_PATH="$links:${libs}${LD_LIBRARY_PATH:-}"
export ZRUN_KERNEL_CACHE=${ZRUN_KERNEL_CACHE:-$(mktemp -d)}

if [ "$what" = tests ] || [ "$what" = all ]; then
  # The e2e tests look for the repository where they were built.
  built_in=$(cat "$dir/repo")
  if [ ! -e "$built_in/Cargo.toml" ]; then
    mkdir -p "$(dirname "$built_in")" && ln -sfn "$PWD" "$built_in"
  fi
  export ZRUN_REQUIRE_GPU=1
  echo "== GPU tests"
  # Each executable runs even when one before it failed (device minutes are
  # few); the sitting fails at the end if any did.
  failed=()
  (cd crates/zcuda && "$dir/release/deps/zcuda" --nocapture) || failed+=(zcuda)
  (cd crates/zengine && "$dir/release/deps/zengine" --nocapture adam:: gpu::) || failed+=(zengine)
  (cd tests && "$dir/release/deps/gpu" --nocapture) || failed+=(gpu)
  [ ${#failed[@]} -eq 0 ] || echo "== GPU tests FAILED in: ${failed[*]}"
fi
[ "$what" = tests ] && exit ${#failed[@]}

median() { # metrics file: the median step_ms of steps 4-12, their range, the last loss
  python3 -c 'import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "\"step_ms\"" in l]
ms, loss = [r["step_ms"] for r in rows][3:12], rows[-1]["loss"]
print(f"{statistics.median(ms):.1f} ms ({min(ms):.1f}-{max(ms):.1f}), loss {loss:.4f}")' "$1"
}
out=$(mktemp -d)
zrun_step() { # label shape-sets... : one run of 12 steps (BUILD's zrun, default DIR's), its median step
  local label=$1; shift
  local sets=() set
  for set in "$@"; do sets+=(--set "$set"); done
  "${BUILD:-$dir}/release/zrun" train configs/gpt-anchor.yaml --metrics "$out/$label.jsonl" --no-progress \
    --workers-per-node "${WORKERS:-1}" --set device=cuda --set train.steps=12 "${sets[@]}" > "$out/$label.log" 2>&1 \
    || { echo "$label failed:"; tail -5 "$out/$label.log"; return 0; }
  echo "$label: $(median "$out/$label.jsonl")"
}
torch_step() { # label env...: PyTorch eager's median step
  python3 -c 'import torch' 2>/dev/null || { echo "$1: no torch here"; return 0; }
  local label=$1; shift
  env "$@" STEPS=12 WARMUP=3 python3 scripts/torch_gpu_peer.py eager > "$out/$label.log" 2>&1 \
    || { echo "$label failed:"; tail -5 "$out/$label.log"; return 0; }
  echo "$label: $(tail -1 "$out/$label.log" | python3 -c 'import json, sys; print(json.load(sys.stdin)["step_ms"])') ms"
}
if [ "$what" = ab ]; then
  m85=(model.d_model=768 model.n_layers=12 model.n_heads=12 model.seq_len=256)
  m152=(model.d_model=1024 model.n_layers=12 model.n_heads=16 model.seq_len=512)
  offload=(zero.stage=1 zero.offload_optimizer.device=cpu)
  for round in $(seq "${ROUNDS:-2}"); do
    pair=("$old:old" "$dir:new")
    [ $((round % 2)) -eq 0 ] && pair=("$dir:new" "$old:old")
    for job in "152M-bf16:${m152[*]} train.dtype=bf16" "152M-tf32:${m152[*]} train.allow_tf32=true" \
      "85M-bf16:${m85[*]} train.dtype=bf16" "anchor-offload:${offload[*]}" \
      "152M-offload:${m152[*]} ${offload[*]}"; do
      for side in "${pair[@]}"; do
        # shellcheck disable=SC2086 # the job's sets, one word each
        BUILD=${side%%:*} zrun_step "${job%%:*}-${side##*:}-$round" ${job#*:}
      done
    done
  done
  exit 0
fi
if [ "$what" = variants ]; then
  vdir=$(realpath "${3:?variants needs the folder scripts/gpu-variant.sh built into}")
  names=()
  for f in "$vdir"/zworker-*; do
    [[ $f == *.txt ]] || names+=("${f##*/zworker-}")
  done
  [ ${#names[@]} -gt 0 ] || { echo "no zworker-NAME in $vdir" >&2; exit 2; }
  # zrun starts the zworker beside itself: a folder a variant.
  builds=$(mktemp -d)
  for n in "${names[@]}"; do
    mkdir -p "$builds/$n/release"
    cp "$dir/release/zrun" "$builds/$n/release/zrun"
    cp "$vdir/zworker-$n" "$builds/$n/release/zworker"
    cat "$vdir/zworker-$n.txt" 2>/dev/null || echo "$n"
  done
  s=(model.d_model=1024 model.n_layers=12 model.n_heads=16 model.seq_len=512)
  jobs=("bf16:train.dtype=bf16" "tf32:train.allow_tf32=true")
  for n in "${names[@]}"; do
    for job in "${jobs[@]}"; do
      label="152M-${job%%:*}-$n-profile"
      BUILD=$builds/$n ZRUN_GPU_PROFILE=1 zrun_step "$label" "${s[@]}" "${job#*:}"
      { grep -A 15 "GPU time by operation" "$out/$label.log" \
          && grep "all marked operations" "$out/$label.log"; } || tail -5 "$out/$label.log"
    done
  done
  for round in $(seq "${ROUNDS:-3}"); do
    # The order rotated a place each round.
    k=$(( (round - 1) % ${#names[@]} ))
    order=("${names[@]:k}" "${names[@]:0:k}")
    for job in "${jobs[@]}"; do
      for n in "${order[@]}"; do
        BUILD=$builds/$n zrun_step "152M-${job%%:*}-$n-$round" "${s[@]}" "${job#*:}"
      done
    done
  done
  exit 0
fi
if [ "$what" = profile ]; then
  # Where the 152M step's GPU time goes, by operation (ZRUN_GPU_PROFILE):
  # steps 4-12 of one run each, the 30 largest rows.
  s=(model.d_model=1024 model.n_layers=12 model.n_heads=16 model.seq_len=512)
  for run in tf32:train.allow_tf32=true bf16:train.dtype=bf16; do
    for attention in unfused fused; do
      label="152M-${run%%:*}-$attention-profile"
      ZRUN_GPU_PROFILE=1 ZRUN_GPU_ATTENTION=$attention zrun_step "$label" "${s[@]}" "${run#*:}"
      # The 30 largest rows, then the totals (GPU idle: its wait for the host).
      { grep -A 31 "GPU time by operation" "$out/$label.log" \
          && grep "all marked operations" "$out/$label.log"; } || tail -5 "$out/$label.log"
    done
  done
  exit 0
fi
for shape in 85M 152M; do
  case $shape in
    85M) s=(model.d_model=768 model.n_layers=12 model.n_heads=12 model.seq_len=256)
         t=(LAYERS=12 D_MODEL=768 HEADS=12 SEQ=256) ;;
    152M) s=(model.d_model=1024 model.n_layers=12 model.n_heads=16 model.seq_len=512)
          t=(LAYERS=12 D_MODEL=1024 HEADS=16 SEQ=512) ;;
  esac
  echo "== $shape (8 sequences a step), two rounds"
  for round in $(seq "${ROUNDS:-2}"); do
    ZRUN_GPU_ATTENTION=unfused zrun_step "$shape-tf32-$round" "${s[@]}" train.allow_tf32=true
    ZRUN_GPU_ATTENTION=fused zrun_step "$shape-tf32-fused-$round" "${s[@]}" train.allow_tf32=true
    torch_step "$shape-torch-tf32-$round" "${t[@]}" TF32=1
    ZRUN_GPU_ATTENTION=unfused zrun_step "$shape-bf16-$round" "${s[@]}" train.dtype=bf16
    ZRUN_GPU_ATTENTION=fused zrun_step "$shape-bf16-fused-$round" "${s[@]}" train.dtype=bf16
    torch_step "$shape-torch-bf16-$round" "${t[@]}" BF16=1
    ZRUN_GPU_ATTENTION=unfused zrun_step "$shape-f16-$round" "${s[@]}" train.dtype=f16
  done
done
echo "== 152M with heads of 128 (8 heads, seq 1024, 4 sequences a step): bf16, unfused and fused"
s=(model.d_model=1024 model.n_layers=12 model.n_heads=8 model.seq_len=1024 train.micro_batch_size=4)
for round in $(seq "${ROUNDS:-2}"); do
  ZRUN_GPU_ATTENTION=unfused zrun_step "152M-h128-bf16-$round" "${s[@]}" train.dtype=bf16
  ZRUN_GPU_ATTENTION=fused zrun_step "152M-h128-bf16-fused-$round" "${s[@]}" train.dtype=bf16
done
echo "== bf16 on two workers sharing the GPU (85M, stage 2, 8 sequences each): the host flow, then the state resident over NCCL"
s=(model.d_model=768 model.n_layers=12 model.n_heads=12 model.seq_len=256)
for round in $(seq "${ROUNDS:-2}"); do
  WORKERS=2 zrun_step "85M-bf16-2w-host-$round" "${s[@]}" train.dtype=bf16 zero.stage=2
  WORKERS=2 zrun_step "85M-bf16-2w-nccl-$round" "${s[@]}" train.dtype=bf16 zero.stage=2 comm.backend=nccl
done
echo "== the host flow, one worker (stage 1, zero.offload_optimizer.device: cpu): AdamW on the host, parameters uploaded ahead of use"
for round in $(seq "${ROUNDS:-2}"); do
  zrun_step "anchor-offload-$round" zero.stage=1 zero.offload_optimizer.device=cpu
  zrun_step "152M-offload-$round" model.d_model=1024 model.n_layers=12 model.n_heads=16 model.seq_len=512 \
    zero.stage=1 zero.offload_optimizer.device=cpu
done
echo "== NCCL between two workers sharing the GPU (over loopback sockets, not a GPU link)"
"$dir/release/zrun" bench comm --workers 2 --transports nccl --sizes 1MiB,64MiB || echo "bench comm nccl failed"
