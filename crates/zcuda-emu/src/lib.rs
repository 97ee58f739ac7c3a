//! Every CUDA kernel of `kernels/` runs on the CPU here, for tests on
//! machines without a GPU: the GPU model's (`gpt.cu`), the optimizer step's
//! reductions, 16-bit conversions and AdamW (`reduce.cu`, `adamw.cu`, each
//! after `half16.cuh`), ZeRO++'s quantization (`quantize.cu`) and the fused
//! attention of bf16 products (`attention.cu`, its tensor-core products
//! emulated from PTX's fragment layout). `build.rs`
//! compiles the CUDA source as C++ with `cpp/emu.h`, which spreads a
//! launch's blocks over the CPUs and runs each block's threads as fibers of
//! one OS thread (`cpp/emu_fiber.h`: `__syncthreads` a barrier of the
//! fibers, warp shuffles an exchange between the warp's fibers,
//! `__shared__` a thread-local static, atomics `std::atomic_ref`), and
//! `cpp/emu.cpp` launches each kernel as zcuda does.
//!
//! What this checks: each kernel's indexing and arithmetic, the model's
//! against the CPU model (zmodel), the others' bits against the host's
//! kernels (zengine's `Flat` and CPU AdamW, zquant), the oracles the GPU
//! tests use too; where no GPU has been lent, the only run a kernel gets.
//! What these tests do not: cuBLAS, streams, the Rust launch code's
//! argument lists (the GPU tests cover those, below), or the GPU's own math library (expf and
//! friends come from the C library here, so the bounds are the same
//! relative ones the GPU tests state).
//!
//! The same objects also make a CPU "GPU" (`build.rs`: `libcuda.so`,
//! `libcublas.so`, `libnccl.so`, `libnvrtc.so.12` from `cpp/driver.cpp`,
//! `cublas.cpp`, `nccl.cpp`, `nvrtc.cpp`): the CUDA driver, cuBLAS, NCCL
//! and NVRTC as zcuda calls them, over host memory, every kernel launch run
//! by the emulation. With that directory on `LD_LIBRARY_PATH`, cudarc loads
//! them as the real libraries, and `scripts/check-cuda.sh` runs the GPU
//! tests themselves on them: what the kernels' tests here cannot reach (the
//! Rust launch code, the engine's GPU flows, NCCL's deadlines) runs in CI.
//!
//! Test-only: nothing in zrun links it.

#[cfg(all(test, emulator))]
mod tests;
#[cfg(all(test, emulator))]
mod tests_attention;
#[cfg(all(test, emulator))]
mod tests_driver;

#[cfg(emulator)]
mod launch;
#[cfg(emulator)]
pub use launch::*;

/// Why the emulation was not built (no C++20 compiler), or `None`.
pub fn missing() -> Option<&'static str> {
    option_env!("ZCUDA_EMU_MISSING")
}

#[cfg(all(test, not(emulator)))]
#[test]
fn the_gpu_kernels_cpu_tests_were_skipped() {
    let why = missing().unwrap_or("not built");
    assert!(
        std::env::var("ZRUN_REQUIRE_EMULATOR").as_deref() != Ok("1"),
        "ZRUN_REQUIRE_EMULATOR=1 but the emulation was not built: {why}"
    );
    eprintln!("SKIPPED the GPU kernels' CPU tests: {why}");
}
