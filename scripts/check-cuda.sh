#!/usr/bin/env bash
# The GPU path's checks: lints with the `cuda` feature, the kernels compiled by
# NVRTC (libnvrtc from NVIDIA's PyPI wheel, in a throwaway venv outside the
# repository), the GPU-oracle tests (which skip, saying so, without a GPU),
# zrun's refusal of `device: cuda` with the feature-enabled zworker, and the
# GPU tests again on zcuda-emu's CPU GPU (with `--emulated-all`, every one of
# tests/gpu.rs's). CI runs it; on a GPU host run it with ZRUN_REQUIRE_GPU=1 to make the GPU
# tests mandatory. Leaves target/release/zworker built WITH the feature.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${ZRUN_NVRTC_VENV:-/tmp/zrun-nvrtc-venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12 \
  nvidia-cuda-nvdisasm
nvrtc_lib=$("$venv/bin/python" -c 'import nvidia.cuda_nvrtc as m; print(list(m.__path__)[0])')/lib
export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# ptxas (from the nvcc wheel, which has no nvcc) assembles the PTX, checking
# the inline assembly and register allocation that NVRTC passes through.
export ZRUN_PTXAS=$("$venv/bin/python" -c 'import nvidia.cuda_nvcc as m; print(list(m.__path__)[0])')/bin/ptxas
# nvdisasm (its own wheel) turns the assembled kernels into machine code, in
# which a test checks how attention.cu fetches its tiles.
export ZRUN_NVDISASM=$("$venv/bin/python" -c 'import glob, site
print(sorted(glob.glob(site.getsitepackages()[0] + "/nvidia/*/bin/nvdisasm"))[-1])')
export ZRUN_REQUIRE_NVRTC=1 ZRUN_REQUIRE_PTXAS=1 ZRUN_REQUIRE_NVDISASM=1 ZRUN_REQUIRE_CUDA_BUILD=1
export ZRUN_KERNEL_CACHE=${ZRUN_KERNEL_CACHE:-$(mktemp -d)}

echo "== clippy (cuda)"
cargo clippy --workspace --all-targets --release --features zworker/cuda -- -D warnings
echo "== doc (cuda)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --release --features zworker/cuda
# The test binaries are built for the whole workspace with the feature, so
# that dependencies keep the features the README's test command built them
# with: `cargo test -p zcuda` alone resolved them afresh and rebuilt candle,
# tokenizers and the rest twice (7-8 minutes of a CI run on a slow 2-core
# machine). Then the ones wanted here are run, each from its package's
# directory as cargo would.
test_exe() { # package-directory target-name: the test executable built for it
  python3 scripts/test_exe.py "$1" "$2" "$artifacts"
}
artifacts=$(mktemp)
cargo test --release --workspace --features zworker/cuda --lib --test gpu --no-run \
  --message-format=json-render-diagnostics > "$artifacts"
zcuda_tests=$(test_exe zcuda zcuda)
zengine_tests=$(test_exe zengine zengine)
gpu_tests=$(test_exe tests gpu)
echo "== kernels: NVRTC compiles each for compute_70/80/90, ptxas assembles them for sm_80/90, attention's tile loads in nvdisasm's machine code; GPU oracles (skip without a GPU)"
(cd crates/zcuda && "$zcuda_tests" --nocapture)
(cd crates/zengine && "$zengine_tests" --nocapture adam:: gpu::)
echo "== device: cuda refused before launch, by a zworker with the feature"
cargo build --release --features zworker/cuda
./target/release/zworker --cuda-probe
(cd tests && "$gpu_tests")

# The GPU tests again, on zcuda-emu's CPU "GPU" (crates/zcuda-emu: libcuda,
# cuBLAS and NCCL over host memory, every kernel run by the CPU emulation;
# NVRTC the real one, which it ignores), as they run on a GPU: this runs the
# Rust launch code, the engine's resident flows and NCCL's deadlines, which
# the kernels' own CPU tests cannot. Mandatory here (ZRUN_REQUIRE_GPU=1).
# Of tests/gpu.rs, CI runs those that fit its time (training against the
# CPU run: GPT-2, Qwen2, Qwen3, a loss mask, packed documents kept apart,
# a sliding window, label smoothing, a sequence-length curriculum, hidden
# dropout and NEFTune, Lion, Adagrad, LAMB on the host;
# the resident step in f32, bf16 and f16 against ZeRO-Offload's bits; a GPU
# out of memory; two GPUs, a worker each, stage 3 in f32 and stage 2 in
# bf16 over NCCL against the host flow; the profile's table; stages 0-3 to
# the bit; resumes to the bit, one GPU and stage 3 over NCCL; ZeRO++,
# bf16 reductions and NVMe offload in the host flow; NCCL's bench rows; the refusals; bf16
# and f16 against the CPU run, their stages agreeing; frozen parameters);
# the rest (LLaMA, TF32, fused attention, and two workers sharing a GPU
# over NCCL at every stage and dtype: 6 tests, 2 of the 3.5 minutes all 30
# take on 2 cores) run with `scripts/check-cuda.sh --emulated-all`.
echo "== the GPU tests on zcuda-emu's CPU GPU"
emu_gpu=$(python3 scripts/test_exe.py --emulated-gpu "$artifacts")
(
  export LD_LIBRARY_PATH="$nvrtc_lib:$emu_gpu" ZRUN_REQUIRE_GPU=1
  (cd crates/zcuda && "$zcuda_tests" gpu_ tests_gpt:: tests_nccl:: out_of_memory a_copy_to_pinned)
  # The kernels and the model again with the last warp of each block ahead
  # of the others (zcuda-emu's emu_fiber.h: each order hides races between
  # warps that the other shows).
  (cd crates/zcuda && ZCUDA_EMU_WARP_ORDER=reverse "$zcuda_tests" gpu_ tests_gpt::)
  (cd crates/zengine && "$zengine_tests" adam:: gpu::)
  if [ "${1:-}" = --emulated-all ]; then
    (cd tests && "$gpu_tests")
  else
    (cd tests && "$gpu_tests" --exact training_on_the_gpu_follows_the_cpu_loss_curve \
      qwen2_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree \
      qwen3_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree \
      a_loss_mask_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree \
      packed_documents_on_the_gpu_follow_the_cpu_loss_curve_and_its_stages_agree \
      sliding_window_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree \
      label_smoothing_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree \
      a_curriculum_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree \
      lion_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree \
      adagrad_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree \
      lamb_on_the_gpu_runs_on_the_host_and_follows_the_cpu_loss_curve \
      dropout_and_neftune_on_the_gpu_follow_the_cpu_loss_curve_and_its_stages_agree \
      adam_on_the_gpu_gives_zero_offloads_bits \
      a_gpu_out_of_memory_is_exit_1_naming_the_allocation_and_what_holds_less \
      two_gpus_get_a_worker_each_bound_to_its_own \
      the_gpu_profile_times_each_operation_and_the_gpus_wait_for_the_host \
      zero_stages_on_the_gpu_are_bit_identical \
      a_resumed_gpu_run_continues_the_uninterrupted_one_to_the_bit \
      a_resumed_nccl_stage_3_run_continues_the_uninterrupted_one_to_the_bit \
      zero_pp_and_nvme_offload_run_in_the_gpus_host_flow \
      bench_comm_times_nccl_on_device_buffers \
      device_cuda_refuses_what_the_gpu_model_does_not_run \
      nccl_and_tf32_are_refused_where_they_cannot_run \
      bf16_and_f16_on_the_gpu_follow_the_cpu_run_and_their_stages_agree \
      frozen_parameters_on_the_gpu_follow_the_cpu_run_and_keep_their_values)
  fi
)
rm -f "$artifacts"
