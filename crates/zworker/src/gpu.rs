//! What the GPU path can do on this host, for `device: cuda`, and which GPU
//! a worker trains on.
//!
//! zrun asks before launch (`zworker --cuda-devices [nccl]`: how many GPUs
//! this host can train on, with NCCL if asked, or what is missing;
//! `--cuda-probe`: one line for a person) and refuses the job where the
//! answer is none.

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

/// The GPUs this host can train on (with NCCL between them, if `nccl`), or
/// what is missing.
pub fn training_devices(nccl: bool) -> Result<usize, String> {
    #[cfg(feature = "cuda")]
    {
        let n = zcuda::probe().training_devices()?;
        if nccl {
            zcuda::nccl_version().map_err(|e| format!("comm.backend: nccl: {e}"))?;
        }
        Ok(n)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = nccl;
        Err(NO_FEATURE.into())
    }
}

/// Opens the GPU of this worker's local rank for `spec`'s model and attaches
/// it to `engine`; with `comm.backend: nccl`, joins the GPUs' communicator
/// too. With more workers on a host than GPUs they share them round-robin
/// (each its own context): zrun's host collectives let two ranks share a
/// GPU, which is how a one-GPU machine tests ZeRO's stages, and NCCL at a
/// world size of two, on one GPU.
#[cfg(feature = "cuda")]
pub fn attach(
    engine: &mut zengine::engine::Engine,
    spec: &zconfig::spec::JobSpec,
    env: &crate::env::WorkerEnv,
    comm: &dyn zcomm::Communicator,
) -> anyhow::Result<()> {
    let shape =
        zengine::gpu::gpu_shape(spec).map_err(|why| anyhow::anyhow!("device: cuda: {why}"))?;
    let nccl = spec.comm.backend == zconfig::spec::Backend::Nccl;
    let n = training_devices(nccl).map_err(|why| anyhow::anyhow!("device: cuda: {why}"))?;
    let ordinal = env.local_rank % n;
    let mut gpu = zcuda::GptGpu::open(ordinal, shape)
        .map_err(|e| anyhow::anyhow!("device: cuda: GPU {ordinal}: {e}"))?;
    if spec.train.allow_tf32 {
        gpu.allow_tf32()
            .map_err(|e| anyhow::anyhow!("train.allow_tf32: GPU {ordinal}: {e}"))?;
    }
    // bf16 multiplies bf16 where the tensor cores can (as autocast does);
    // an older GPU multiplies f32 values of the bf16 weights, as a CPU
    // without AMX does.
    let products = match spec.train.dtype {
        zconfig::spec::Dtype::Bf16 => match gpu.use_bf16_products() {
            Ok(()) => "bf16 operands, f32 sums, on the tensor cores".to_string(),
            Err(e) => format!("f32 values of the 16-bit parameters ({e})"),
        },
        _ => "f32 values of the 16-bit parameters (TF32 with train.allow_tf32)".to_string(),
    };
    // attention.cu's fused attention: correct on an H100, but its first
    // version was slower than the unfused path there and its second is not
    // yet timed (docs/GPU.md): opt-in until a GPU times it faster.
    match std::env::var("ZRUN_GPU_ATTENTION").as_deref() {
        Err(_) | Ok("unfused") => {}
        Ok("fused") => {
            gpu.use_fused_attention()
                .map_err(|e| anyhow::anyhow!("ZRUN_GPU_ATTENTION=fused: GPU {ordinal}: {e}"))?;
            if env.rank == 0 {
                tracing::warn!(
                    "attention runs the fused kernels of kernels/attention.cu \
                     (ZRUN_GPU_ATTENTION=fused): correct on an H100, this version's speed \
                     not yet measured (docs/GPU.md)"
                );
            }
        }
        Ok(other) => anyhow::bail!("ZRUN_GPU_ATTENTION = `{other}`: use fused or unfused"),
    }
    tracing::info!(
        "local rank {} on GPU {ordinal} ({}, {})",
        env.local_rank,
        gpu.gpu().name(),
        gpu.gpu().arch()
    );
    let nccl = match nccl {
        true => Some(join_nccl(gpu.gpu(), spec, env, comm, n)?),
        false => None,
    };
    engine.attach_gpu(gpu);
    if let Some(nccl) = nccl {
        engine.attach_nccl(nccl);
    }
    if spec.train.dtype != zconfig::spec::Dtype::F32 && env.rank == 0 {
        let state = match engine.gpu_resident() {
            true => "the GPU",
            false => "the host (ZeRO-Offload's flow)",
        };
        tracing::info!(
            "train.dtype: {}: the products multiply {products}; the 16-bit state and AdamW on {state}",
            spec.train.dtype
        );
    }
    Ok(())
}

/// Joins the job's NCCL communicator: rank 0 makes its id and sends it to
/// every rank over the host communicator (authenticated at the rendezvous).
/// Ranks that share a GPU get host ids of their own (`NCCL_HOSTID`, see
/// [`zcuda::host_id_for_shared_gpu`]) and talk over loopback.
#[cfg(feature = "cuda")]
fn join_nccl(
    gpu: &zcuda::Gpu,
    spec: &zconfig::spec::JobSpec,
    env: &crate::env::WorkerEnv,
    comm: &dyn zcomm::Communicator,
    gpus: usize,
) -> anyhow::Result<zcuda::Nccl> {
    use anyhow::Context;
    let shared =
        zcuda::host_id_for_shared_gpu(&env.node_addr, env.rank, env.local_world_size, gpus);
    if let Some(host_id) = shared {
        // Set before this process's first NCCL call (below), which reads it.
        if std::env::var_os("NCCL_HOSTID").is_none() {
            std::env::set_var("NCCL_HOSTID", host_id);
        }
        if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
            std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
        }
        tracing::info!(
            "rank {}: {} ranks share {gpus} GPU(s) here; NCCL runs between them over loopback",
            env.rank,
            env.local_world_size
        );
    }
    let mine = match env.rank {
        0 => zcuda::NcclId::new()
            .context("comm.backend: nccl")?
            .0
            .to_vec(),
        _ => vec![0; 128],
    };
    let id = comm
        .broadcast(mine, 0)
        .context("comm.backend: nccl: sending NCCL's id from rank 0")?;
    let id = zcuda::NcclId(id.try_into().map_err(|v: Vec<u8>| {
        anyhow::anyhow!("NCCL's id arrived as {} bytes, not 128", v.len())
    })?);
    let timeout = std::time::Duration::from_secs_f64(spec.comm.timeout_s);
    let nccl = zcuda::Nccl::init(gpu, env.rank, env.world_size, &id, timeout)
        .context("comm.backend: nccl")?;
    tracing::info!(
        "rank {} joined NCCL {} ({} ranks)",
        env.rank,
        zcuda::nccl_version().unwrap_or(0),
        env.world_size
    );
    Ok(nccl)
}

/// With `ZRUN_GPU_PROFILE` set, the GPU's time by operation: after the
/// first `WARM_STEPS` steps it starts again (`restart`), at the end it is
/// written to stderr for `steps` steps (`report`).
#[cfg(feature = "cuda")]
pub fn profile(engine: &zengine::engine::Engine, rank: usize, at: ProfileAt) -> anyhow::Result<()> {
    let Some(gpu) = engine.gpu() else {
        return Ok(());
    };
    match at {
        ProfileAt::Restart => gpu.gpu().profile_restart()?,
        ProfileAt::Report { steps } => {
            if let Some(table) = gpu.gpu().profile_report(steps)? {
                eprintln!(
                    "GPU time by operation over the last {steps} steps of rank {rank} \
                     (ZRUN_GPU_PROFILE; an operation's time runs from the end of the one before):\n{table}"
                );
            }
        }
    }
    Ok(())
}

/// Without the `cuda` feature there is no GPU profile.
#[cfg(not(feature = "cuda"))]
pub fn profile(
    _engine: &zengine::engine::Engine,
    _rank: usize,
    _at: ProfileAt,
) -> anyhow::Result<()> {
    Ok(())
}

/// The GPU profile's two moments (see [`profile`]).
pub enum ProfileAt {
    /// After the warm-up steps: forget their times.
    Restart,
    /// At the end: the table over this many steps.
    Report {
        /// Steps since the restart.
        steps: u64,
    },
}

/// Steps the GPU profile leaves out at the start (one-time allocations,
/// cuBLAS's first choices), where the run has twice as many.
pub const WARM_STEPS: u64 = 3;

/// Without the `cuda` feature there is no GPU to attach.
#[cfg(not(feature = "cuda"))]
pub fn attach(
    _engine: &mut zengine::engine::Engine,
    _spec: &zconfig::spec::JobSpec,
    _env: &crate::env::WorkerEnv,
    _comm: &dyn zcomm::Communicator,
) -> anyhow::Result<()> {
    anyhow::bail!("device: cuda: {NO_FEATURE}")
}
