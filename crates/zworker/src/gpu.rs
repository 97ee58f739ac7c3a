//! What the GPU path can do on this host, for `device: cuda`.
//!
//! Training on GPUs is not built yet (the model and the engine's device
//! buffers are CPU-only; docs/GPU.md says what exists). A job that asks for it
//! is refused before launch by zrun, which prints [`host_report`] from
//! `zworker --cuda-probe`, and by a worker started some other way.

/// Why `device: cuda` is refused, whatever the host has.
pub const NOT_BUILT: &str = "training on GPUs is not in zrun yet: its kernels compile with NVRTC and are tested against the CPU kernels where a GPU is (kernels/, crates/zcuda), but the GPU model, the engine's device buffers and the NCCL transport are not built (docs/GPU.md)";

/// One line on this host's GPU support: the feature, the driver, the GPUs and
/// NVRTC, or what is missing.
#[cfg(feature = "cuda")]
pub fn host_report() -> String {
    let p = zcuda::probe();
    match p.devices {
        Ok(n) if p.nvrtc => format!("zworker has the `cuda` feature; {n} GPU(s) and NVRTC found"),
        Ok(n) => format!(
            "zworker has the `cuda` feature; {n} GPU(s) found; {}",
            p.usable_devices().unwrap_err()
        ),
        Err(why) => format!("zworker has the `cuda` feature; {why}"),
    }
}

/// One line on this host's GPU support: the feature, the driver, the GPUs and
/// NVRTC, or what is missing.
#[cfg(not(feature = "cuda"))]
pub fn host_report() -> String {
    "zworker was built without the `cuda` feature (cargo build --release --features cuda)".into()
}
