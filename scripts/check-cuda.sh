#!/usr/bin/env bash
# The GPU path's checks: lints with the `cuda` feature, the kernels compiled by
# NVRTC (libnvrtc from NVIDIA's PyPI wheel, in a throwaway venv outside the
# repository), the GPU-oracle tests (which skip, saying so, without a GPU) and
# zrun's refusal of `device: cuda` with the feature-enabled zworker.
# CI runs it; on a GPU host run it with ZRUN_REQUIRE_GPU=1 to make the GPU
# tests mandatory. Leaves target/release/zworker built WITH the feature.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${ZRUN_NVRTC_VENV:-/tmp/zrun-nvrtc-venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check nvidia-cuda-nvrtc-cu12
nvrtc_lib=$("$venv/bin/python" -c 'import nvidia.cuda_nvrtc as m; print(list(m.__path__)[0])')/lib
export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ZRUN_REQUIRE_NVRTC=1 ZRUN_REQUIRE_CUDA_BUILD=1
export ZRUN_KERNEL_CACHE=${ZRUN_KERNEL_CACHE:-$(mktemp -d)}

echo "== clippy (cuda)"
cargo clippy --workspace --all-targets --release --features zworker/cuda -- -D warnings
echo "== doc (cuda)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --features zworker/cuda
echo "== kernels: NVRTC compiles each for compute_70/80/90; GPU oracles (skip without a GPU)"
cargo test --release -p zcuda -- --nocapture
cargo test --release -p zengine --features cuda --lib -- --nocapture adam:: gpu::
echo "== device: cuda refused before launch, by a zworker with the feature"
cargo build --release --features zworker/cuda
./target/release/zworker --cuda-probe
cargo test --release -p e2e --test gpu
