//! What the GPU path can do on this host, for `device: cuda`, and which GPU
//! a worker trains on; the worker's side of `zrun bench comm --transports
//! nccl`; and what a GPU out-of-memory failure tells the user.
//!
//! zrun asks before launch (`zworker --cuda-devices [nccl]`: how many GPUs
//! this host can train on, with NCCL if asked, and the smallest one's
//! memory, or what is missing; `--cuda-probe`: one line for a person),
//! refuses the job where the answer is none, and warns where a worker's
//! estimate exceeds that memory.

#[cfg(feature = "cuda")]
use anyhow::Context;

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

/// The memory of this host's smallest GPU, where the driver says.
pub fn smallest_gpu_memory() -> Option<usize> {
    #[cfg(feature = "cuda")]
    {
        zcuda::smallest_gpu_memory()
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
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
    gpu.use_label_smoothing(spec.train.label_smoothing)
        .map_err(|e| anyhow::anyhow!("train.label_smoothing: {e}"))?;
    // bf16 and f16 multiply 16-bit operands with f32 sums (as autocast
    // does); a GPU older than 8.0 multiplies f32 values of the bf16
    // weights, as a CPU without native bf16 does.
    let half = match spec.train.dtype {
        zconfig::spec::Dtype::Bf16 => Some(zcuda::Half16::Bf16),
        zconfig::spec::Dtype::F16 => Some(zcuda::Half16::F16),
        zconfig::spec::Dtype::F32 => None,
    };
    let products = match half.map(|h| (h, gpu.use_half_products(h))) {
        Some((h, Ok(()))) => format!("{} operands, f32 sums, on the tensor cores", h.name()),
        Some((_, Err(e))) => format!("f32 values of the 16-bit parameters ({e})"),
        None => "f32 (TF32 with train.allow_tf32)".to_string(),
    };
    // attention.cu's fused attention: by default where the job can run it
    // at head widths up to 64 (timed faster than the unfused path on an
    // H200, docs/GPU.md), on request (ZRUN_GPU_ATTENTION=fused) at 128 too.
    let setting = std::env::var("ZRUN_GPU_ATTENTION").ok();
    match setting.as_deref() {
        None | Some("auto") | Some("unfused") | Some("fused") => {}
        Some(other) => {
            anyhow::bail!("ZRUN_GPU_ATTENTION = `{other}`: use auto, fused or unfused")
        }
    }
    let fused = match (
        setting.as_deref(),
        spec.gpu_attention_fused(setting.as_deref()),
    ) {
        (Some("fused"), _) => {
            gpu.use_fused_attention()
                .map_err(|e| anyhow::anyhow!("ZRUN_GPU_ATTENTION=fused: GPU {ordinal}: {e}"))?;
            true
        }
        // A GPU older than compute capability 8.0 keeps the unfused path.
        (_, true) => gpu.use_fused_attention().is_ok(),
        (_, false) => false,
    };
    if env.rank == 0 {
        tracing::info!(
            "attention: {} (ZRUN_GPU_ATTENTION={})",
            match fused {
                true => "the fused kernels of kernels/attention.cu",
                false => "unfused (its probabilities kept for the backward)",
            },
            setting.as_deref().unwrap_or("auto")
        );
    }
    tracing::info!(
        "local rank {} on GPU {ordinal} ({}, {})",
        env.local_rank,
        gpu.gpu().name(),
        gpu.gpu().arch()
    );
    let nccl = match nccl {
        true => {
            let timeout = std::time::Duration::from_secs_f64(spec.comm.timeout_s);
            Some(join_nccl(gpu.gpu(), timeout, env, comm, n).context("comm.backend: nccl")?)
        }
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
    timeout: std::time::Duration,
    env: &crate::env::WorkerEnv,
    comm: &dyn zcomm::Communicator,
    gpus: usize,
) -> anyhow::Result<zcuda::Nccl> {
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
        0 => zcuda::NcclId::new()?.0.to_vec(),
        _ => vec![0; 128],
    };
    let id = comm
        .broadcast(mine, 0)
        .context("sending NCCL's id from rank 0")?;
    let id = zcuda::NcclId(id.try_into().map_err(|v: Vec<u8>| {
        anyhow::anyhow!("NCCL's id arrived as {} bytes, not 128", v.len())
    })?);
    let nccl = zcuda::Nccl::init(gpu, env.rank, env.world_size, &id, timeout)?;
    tracing::info!(
        "rank {} joined NCCL {} ({} ranks)",
        env.rank,
        zcuda::nccl_version().unwrap_or(0),
        env.world_size
    );
    Ok(nccl)
}

/// A training failure `e`, with what this job is estimated to hold per GPU
/// and what holds less added where the GPU ran out of memory (the first
/// thing a user resizing the job needs).
pub fn with_memory_hint(e: anyhow::Error, spec: &zconfig::JobSpec, world: usize) -> anyhow::Error {
    let oom = e.chain().any(|c| {
        matches!(
            c.downcast_ref::<zengine::EngineError>(),
            Some(zengine::EngineError::GpuOutOfMemory(_))
        )
    });
    match oom {
        true => {
            let setting = std::env::var("ZRUN_GPU_ATTENTION").ok();
            let fused = spec.gpu_attention_fused(setting.as_deref());
            e.context(memory_hint(spec, world, fused))
        }
        false => e,
    }
}

/// What [`with_memory_hint`] adds: the activations (and, where they live on
/// the GPU, the model states) `zrun estimate` predicts per worker
/// ([`zconfig::estimate::gpu_worker_bytes`]), and
/// the settings that hold less; `fused`: whether attention runs the fused
/// kernels (`ZRUN_GPU_ATTENTION=fused`).
fn memory_hint(spec: &zconfig::JobSpec, world: usize, fused: bool) -> String {
    // GiB, or MiB under one (a small job on a small GPU is not "0.00 GiB").
    let size = |b: f64| match b / f64::from(1u32 << 30) {
        g if g >= 1.0 => format!("{g:.2} GiB"),
        g => format!("{:.1} MiB", g * 1024.0),
    };
    let t = &spec.train;
    let held = zconfig::estimate::gpu_worker_bytes(spec, world, fused);
    // The unfused attention's probabilities, which the fused kernels do
    // not keep, where this job can run those.
    let fused_holds_less = match !fused && spec.fused_attention_unsupported().is_none() {
        true => ", ZRUN_GPU_ATTENTION=fused (its probabilities are not kept)",
        false => "",
    };
    let acts = held.activations;
    let states = match held.states {
        Some(bytes) => format!(
            "{} of model states (ZeRO stage {}, {world} workers, {}) and ",
            size(bytes),
            spec.zero.stage.number(),
            t.dtype
        ),
        None => String::new(),
    };
    format!(
        "out of GPU memory: a worker of this job is estimated to hold {states}{} of \
         activations at train.micro_batch_size {} (`zrun estimate`); zero.stage: 3, \
         train.activation_checkpointing: true, a smaller train.micro_batch_size, \
         zero.offload_optimizer.device: cpu{fused_holds_less} hold less",
        size(acts),
        t.micro_batch_size
    )
}

/// `zrun bench comm --transports nccl`: NCCL's all-reduce, reduce-scatter
/// and all-gather on buffers in GPU memory, in place (see `bench`'s module
/// docs for how they are timed). A size is rounded down to whole f32
/// chunks per rank, and the row says the bytes moved.
#[cfg(feature = "cuda")]
pub fn bench_nccl(
    task: &zproto::BenchCommTask,
    comm: &dyn zcomm::Communicator,
    env: &crate::env::WorkerEnv,
) -> anyhow::Result<Vec<zproto::BenchRow>> {
    use std::time::{Duration, Instant};
    use zproto::Op;
    let gpus = training_devices(true).map_err(|why| anyhow::anyhow!("--transports nccl: {why}"))?;
    let ordinal = env.local_rank % gpus;
    let gpu = zcuda::Gpu::open(ordinal)
        .map_err(|e| anyhow::anyhow!("--transports nccl: GPU {ordinal}: {e}"))?;
    let timeout = Duration::from_secs_f64(task.timeout_s);
    let mut nccl = join_nccl(&gpu, timeout, env, comm, gpus).context("--transports nccl")?;
    let (n, rank) = (comm.world_size(), comm.rank());
    let mut rows = Vec::new();
    for name in &task.ops {
        let op = match Op::from_name(name) {
            Some(op @ (Op::AllReduce | Op::ReduceScatter | Op::AllGather)) => op,
            _ => anyhow::bail!("--ops {name}: not timed over nccl"),
        };
        for &bytes in &task.sizes {
            let elems = ((bytes / 4) as usize / n * n).max(n);
            nccl_check(&gpu, &mut nccl, op, elems, rank, n)?;
            let mut buf = gpu.zeros::<f32>(elems)?;
            let mut batch = |calls: usize| -> anyhow::Result<f64> {
                comm.barrier()?;
                let t0 = Instant::now();
                for _ in 0..calls {
                    nccl_call(&mut nccl, op, &mut buf.slice_mut(..), "the timed buffer")?;
                }
                nccl.wait()?;
                Ok(t0.elapsed().as_secs_f64() / calls as f64)
            };
            let warm = batch(1)?;
            let calls = crate::bench::agree_calls(comm, warm, crate::bench::BUDGET / BATCHES)?;
            let times = (0..BATCHES)
                .map(|_| batch(calls).map(|s| s as f32))
                .collect::<anyhow::Result<Vec<f32>>>()?;
            let secs = crate::bench::slowest_median(comm, &times)?;
            rows.push(crate::bench::row(op, (elems * 4) as u64, n, "nccl", secs));
        }
    }
    Ok(rows)
}

/// Batches of calls a NCCL row's median is taken over.
#[cfg(feature = "cuda")]
const BATCHES: u32 = 5;

/// Enqueues NCCL's `op` on `buf`, in place.
#[cfg(feature = "cuda")]
fn nccl_call(
    nccl: &mut zcuda::Nccl,
    op: zproto::Op,
    buf: &mut zcuda::CudaViewMut<f32>,
    what: &str,
) -> Result<(), zcuda::CudaError> {
    match op {
        zproto::Op::AllReduce => nccl.all_reduce_sum(buf, what),
        zproto::Op::ReduceScatter => nccl.reduce_scatter_sum_in_place(buf, what),
        _ => nccl.all_gather_in_place(buf, what),
    }
}

/// One call of `op` over `elems` f32 on known values ([`check_case`]), its
/// result compared whole with what it must be.
#[cfg(feature = "cuda")]
fn nccl_check(
    gpu: &zcuda::Gpu,
    nccl: &mut zcuda::Nccl,
    op: zproto::Op,
    elems: usize,
    rank: usize,
    n: usize,
) -> anyhow::Result<()> {
    let case = check_case(op, elems, rank, n);
    let mut buf = gpu.upload(&case.input)?;
    nccl_call(nccl, op, &mut buf.slice_mut(..), "the check")?;
    nccl.wait()?;
    let got = gpu.download(&buf)?;
    let got = &got[case.kept];
    match got.iter().zip(&case.want).position(|(g, w)| g != w) {
        None => Ok(()),
        Some(i) => anyhow::bail!(
            "NCCL's {} of {elems} f32 on {n} ranks gave {} at {i} of rank {rank}'s result, not {}",
            op.name(),
            got[i],
            case.want[i]
        ),
    }
}

/// A rank's input to an in-place collective and what the part of the
/// buffer it keeps (`kept`) must hold after.
#[cfg(any(feature = "cuda", test))]
struct CheckCase {
    input: Vec<f32>,
    want: Vec<f32>,
    kept: std::ops::Range<usize>,
}

/// The check of `op` over `elems` f32 (a multiple of `n`) on rank `rank`
/// of `n`: each rank contributes `rank + 1` (sums `n(n+1)/2`, exact in
/// f32); all-gather's other chunks start as NaN; reduce-scatter keeps the
/// rank's chunk.
#[cfg(any(feature = "cuda", test))]
fn check_case(op: zproto::Op, elems: usize, rank: usize, n: usize) -> CheckCase {
    let chunk = elems / n;
    let mine = (rank + 1) as f32;
    let sum = (n * (n + 1) / 2) as f32;
    let own = rank * chunk..(rank + 1) * chunk;
    match op {
        zproto::Op::AllGather => {
            let mut input = vec![f32::NAN; elems];
            input[own].fill(mine);
            let want = (0..elems).map(|i| (i / chunk + 1) as f32).collect();
            CheckCase {
                input,
                want,
                kept: 0..elems,
            }
        }
        zproto::Op::ReduceScatter => CheckCase {
            input: vec![mine; elems],
            want: vec![sum; chunk],
            kept: own,
        },
        _ => CheckCase {
            input: vec![mine; elems],
            want: vec![sum; elems],
            kept: 0..elems,
        },
    }
}

/// Without the `cuda` feature there is no NCCL to time (zrun refuses
/// `--transports nccl` before launch, for this reason).
#[cfg(not(feature = "cuda"))]
pub fn bench_nccl(
    _task: &zproto::BenchCommTask,
    _comm: &dyn zcomm::Communicator,
    _env: &crate::env::WorkerEnv,
) -> anyhow::Result<Vec<zproto::BenchRow>> {
    anyhow::bail!("--transports nccl: {NO_FEATURE}")
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
                    "GPU time by operation over the last {steps} steps of rank {rank} on {} \
                     (ZRUN_GPU_PROFILE; an operation's time runs from the end of the one before; \
                     GPU idle: the part of it before its launch returned, the GPU waiting for the host):\n{table}",
                    gpu.gpu().name()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// NCCL's in-place collectives done on the host over every rank's
    /// input: rank `r`'s buffer after `op`.
    fn in_place(op: zproto::Op, inputs: &[Vec<f32>], r: usize) -> Vec<f32> {
        let (n, len) = (inputs.len(), inputs[0].len());
        let chunk = len / n;
        let sum: Vec<f32> = (0..len)
            .map(|i| inputs.iter().map(|x| x[i]).sum())
            .collect();
        match op {
            zproto::Op::AllGather => (0..len).map(|i| inputs[i / chunk][i]).collect(),
            zproto::Op::ReduceScatter => {
                let mut out = inputs[r].clone();
                out[r * chunk..(r + 1) * chunk].copy_from_slice(&sum[r * chunk..(r + 1) * chunk]);
                out
            }
            _ => sum,
        }
    }

    #[test]
    fn the_nccl_benchmarks_checks_expect_what_the_collectives_compute() {
        use zproto::Op;
        for op in [Op::AllReduce, Op::ReduceScatter, Op::AllGather] {
            for n in 1..=4 {
                let elems = 3 * n;
                let cases: Vec<_> = (0..n).map(|r| check_case(op, elems, r, n)).collect();
                let inputs: Vec<_> = cases.iter().map(|c| c.input.clone()).collect();
                for (r, c) in cases.iter().enumerate() {
                    let after = in_place(op, &inputs, r);
                    assert_eq!(
                        after[c.kept.clone()],
                        c.want[..],
                        "{} on {n}, rank {r}",
                        op.name()
                    );
                }
            }
        }
        // A collective that did nothing fails its check on every rank.
        for op in [Op::AllReduce, Op::ReduceScatter, Op::AllGather] {
            for r in 0..2 {
                let c = check_case(op, 6, r, 2);
                assert_ne!(
                    c.input[c.kept.clone()],
                    c.want[..],
                    "{} rank {r}",
                    op.name()
                );
            }
        }
    }

    fn spec(extra: serde_json::Value) -> zconfig::JobSpec {
        let mut v = serde_json::json!({
            "model": {}, "data": {"format": "synthetic"}, "name": "oom",
            "zero": {"stage": 2}
        });
        if let (Some(v), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
            v.extend(extra.clone());
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_gpu_out_of_memory_failure_says_what_the_job_holds_and_what_holds_less() {
        let oom = zengine::EngineError::GpuOutOfMemory(
            "allocating 3 floats on the GPU: the GPU is out of memory (1 MiB asked, 0 MiB free of 80 MiB)".into(),
        );
        let e = anyhow::Error::from(oom).context("step 4");
        let nccl = serde_json::json!({"comm": {"backend": "nccl"}});
        let text = format!("{:#}", with_memory_hint(e, &spec(nccl.clone()), 2));
        assert!(
            text.starts_with("out of GPU memory: a worker of this job is estimated to hold ")
                && text.contains(" MiB of model states (ZeRO stage 2, 2 workers, f32) and ")
                && text.contains("zero.stage: 3, train.activation_checkpointing: true")
                && text.ends_with("step 4: GPU: allocating 3 floats on the GPU: the GPU is out of memory (1 MiB asked, 0 MiB free of 80 MiB)"),
            "{text}"
        );
        // Several workers without NCCL keep the states on the host (the
        // host flow), and so does offload: not counted.
        let e = anyhow::Error::from(zengine::EngineError::GpuOutOfMemory("x".into()));
        let text = format!("{:#}", with_memory_hint(e, &spec(serde_json::json!({})), 2));
        assert!(!text.contains("model states"), "{text}");
        // Sizes past a GiB in GiB.
        let big = spec(
            serde_json::json!({"model": {"d_model": 2048, "n_layers": 24}, "comm": {"backend": "nccl"}}),
        );
        let e = anyhow::Error::from(zengine::EngineError::GpuOutOfMemory("x".into()));
        let text = format!("{:#}", with_memory_hint(e, &big, 2));
        assert!(
            text.contains(" GiB of model states (ZeRO stage 2, 2 workers, f32) and "),
            "{text}"
        );
        // With offload the model states are not the GPU's: not counted.
        let offload =
            spec(serde_json::json!({"zero": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}));
        let e = anyhow::Error::from(zengine::EngineError::GpuOutOfMemory("x".into()));
        let text = format!("{:#}", with_memory_hint(e, &offload, 2));
        assert!(!text.contains("model states"), "{text}");
        // On the GPU with the unfused attention, its probabilities count,
        // and the fused kernels are named where the job can run them (16-bit
        // products at head width 16 here), not where it cannot (f32).
        let gpu = |dtype: &str| {
            spec(serde_json::json!({
                "device": "cuda", "train": {"dtype": dtype},
                "model": {"d_model": 64, "n_heads": 4, "seq_len": 512}
            }))
        };
        let bf16 = memory_hint(&gpu("bf16"), 2, false);
        assert!(
            bf16.contains(
                "zero.offload_optimizer.device: cpu, ZRUN_GPU_ATTENTION=fused (its probabilities are not kept) hold less"
            ),
            "{bf16}"
        );
        assert!(!memory_hint(&gpu("f32"), 2, false).contains("ZRUN_GPU_ATTENTION"));
        assert!(!memory_hint(&gpu("bf16"), 2, true).contains("ZRUN_GPU_ATTENTION"));
        // Any other failure passes as it was.
        let e = anyhow::Error::from(zengine::EngineError::Gpu("a launch failed".into()));
        assert_eq!(
            format!("{:#}", with_memory_hint(e, &spec(serde_json::json!({})), 2)),
            "GPU: a launch failed"
        );
    }
}
