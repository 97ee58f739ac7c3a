//! What the GPU path can do on this host, for `device: cuda`, and which GPU
//! a worker trains on.
//!
//! zrun asks before launch (`zworker --cuda-devices`: how many GPUs this
//! host can train on, or what is missing; `--cuda-probe`: one line for a
//! person) and refuses the job where the answer is none.

/// One line on this host's GPU support: the feature, the driver, the GPUs,
/// NVRTC and cuBLAS, or what is missing.
#[cfg(feature = "cuda")]
pub fn host_report() -> String {
    let p = zcuda::probe();
    match p.training_devices() {
        Ok(n) => format!("zworker has the `cuda` feature; {n} GPU(s), NVRTC and cuBLAS found"),
        Err(why) => format!("zworker has the `cuda` feature; {why}"),
    }
}

/// One line on this host's GPU support: the feature, the driver, the GPUs,
/// NVRTC and cuBLAS, or what is missing.
#[cfg(not(feature = "cuda"))]
pub fn host_report() -> String {
    NO_FEATURE.into()
}

#[cfg(not(feature = "cuda"))]
const NO_FEATURE: &str =
    "zworker was built without the `cuda` feature (cargo build --release --features zworker/cuda)";

/// The GPUs this host can train on, or what is missing.
pub fn training_devices() -> Result<usize, String> {
    #[cfg(feature = "cuda")]
    return zcuda::probe().training_devices();
    #[cfg(not(feature = "cuda"))]
    Err(NO_FEATURE.into())
}

/// Opens the GPU of local rank `local_rank` for `spec`'s model and attaches
/// it to `engine`. With more workers on a host than GPUs they share them
/// round-robin (each its own context): zrun's collectives run on the host,
/// so nothing stops two ranks from sharing a GPU, which is how a one-GPU
/// machine tests ZeRO's stages at a world size of two.
#[cfg(feature = "cuda")]
pub fn attach(
    engine: &mut zengine::engine::Engine,
    spec: &zconfig::spec::JobSpec,
    local_rank: usize,
) -> anyhow::Result<()> {
    let shape =
        zengine::gpu::gpu_shape(spec).map_err(|why| anyhow::anyhow!("device: cuda: {why}"))?;
    let n = training_devices().map_err(|why| anyhow::anyhow!("device: cuda: {why}"))?;
    let ordinal = local_rank % n;
    let gpu = zcuda::GptGpu::open(ordinal, shape)
        .map_err(|e| anyhow::anyhow!("device: cuda: GPU {ordinal}: {e}"))?;
    tracing::info!(
        "local rank {local_rank} on GPU {ordinal} ({}, {})",
        gpu.gpu().name(),
        gpu.gpu().arch()
    );
    engine.attach_gpu(gpu);
    Ok(())
}

/// Without the `cuda` feature there is no GPU to attach.
#[cfg(not(feature = "cuda"))]
pub fn attach(
    _engine: &mut zengine::engine::Engine,
    _spec: &zconfig::spec::JobSpec,
    _local_rank: usize,
) -> anyhow::Result<()> {
    anyhow::bail!("device: cuda: {NO_FEATURE}")
}
