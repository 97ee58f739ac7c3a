//! `zrun estimate`: ZeRO's memory arithmetic for a parameter count or a job, and
//! the warning `zrun train` prints when a job will not fit its workers.

use std::process::ExitCode;

use anyhow::Result;
use serde::Serialize;
use zconfig::estimate::{
    attention_work_bytes, comm_buffer_bytes, cpu_worker_peak_bytes, gpu_probabilities_bytes,
    held_bucket_bytes, job_activation_bytes, job_backward_bytes, largest_group, model_params,
    model_state_rows, reduce_bucket_elements, trained_elements, worker_states, CrossNodeBytes,
    Kept, Row, StateBytes, TrainedElements, WorkerStates, REDUCE_BUCKETS_HELD,
};
use zconfig::spec::OptimizerKind;
use zconfig::{load_job, Dtype, JobSpec, Topology, TopologyOptions};

use crate::cli::EstimateArgs;
use crate::plan::{fused_attention_expected, DEFAULT_CPU_WORKERS};
use crate::Failure;

/// A job's reduce buckets as the engine plans them.
#[derive(Debug, Serialize)]
struct ReduceBuckets {
    /// Buckets a step.
    count: usize,
    /// The most held at once, packed or in flight.
    held_at_once: usize,
    /// Their bytes (f32).
    held_bytes: f64,
}

#[derive(Debug, Serialize)]
struct Activations {
    micro_batch_size: usize,
    bytes_per_worker: f64,
    bytes_per_worker_checkpointed: f64,
    /// `device: cuda` with the unfused attention: the probabilities each
    /// block keeps (counted in the figures above); 0 where none are kept.
    gpu_probabilities_per_block: f64,
    /// On the CPU, the attention's work matrices each of a worker's
    /// threads holds (not in the figures above); 0 on a GPU.
    attention_work_per_thread: f64,
    /// On the CPU, what backward holds beyond the activations at its most
    /// (the gradients passing through the top block, [`job_backward_bytes`]);
    /// 0 on a GPU.
    backward_per_worker: f64,
    /// Whether the blocks keep the products' inputs in bf16 ([`Kept`]):
    /// a bf16 job where this host's CPU multiplies bf16.
    bf16_kept: bool,
}

#[derive(Debug, Serialize)]
struct Estimate {
    params: f64,
    world_size: usize,
    nodes: usize,
    workers_per_node: usize,
    /// Bytes a parameter of each kind of state (p, g, K) the rows count.
    bytes_per_param: StateBytes,
    /// The dtype and update rule they follow.
    training: String,
    rows: Vec<Row>,
    #[serde(skip_serializing_if = "Option::is_none")]
    activations: Option<Activations>,
    /// A job's stage.
    #[serde(skip_serializing_if = "Option::is_none")]
    stage: Option<u8>,
    /// A job's model states per CPU worker with its offload settings.
    #[serde(skip_serializing_if = "Option::is_none")]
    this_job: Option<WorkerStates>,
    /// A CPU job's buffers for reductions and gathers per worker
    /// ([`comm_buffer_bytes`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    comm_buffers_per_worker: Option<f64>,
    /// A CPU job of two workers or more: its reduce buckets, of which
    /// those held at once are counted in `comm_buffers_per_worker`.
    #[serde(skip_serializing_if = "Option::is_none")]
    reduce_buckets: Option<ReduceBuckets>,
    /// A CPU job: what a worker holds at its peak, of this host's threads
    /// a worker ([`cpu_worker_peak_bytes`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_per_worker: Option<f64>,
    /// A job with `train.freeze`: the elements its workers keep moments
    /// and gradients for (counted in `this_job`).
    #[serde(skip_serializing_if = "Option::is_none")]
    trained: Option<TrainedElements>,
    /// `--comm`: stage 3 against ZeRO++.
    #[serde(skip_serializing_if = "Option::is_none")]
    comm: Option<CommEstimate>,
}

/// `--comm`: one step's cross-node bytes per node and time, stage 3 against
/// ZeRO++, with perfect overlap of communication and compute and with none.
#[derive(Debug, Serialize)]
struct CommEstimate {
    link_gbps: f64,
    worker_tflops: f64,
    tokens_per_worker: f64,
    compute_s: f64,
    stage3: CrossNodeBytes,
    zero_pp: CrossNodeBytes,
    stage3_link_s: f64,
    zero_pp_link_s: f64,
    speedup_overlapped: f64,
    speedup_serial: f64,
}

impl CommEstimate {
    /// `bytes`: a parameter's and a reduced gradient element's.
    fn new(
        psi: f64,
        (param_bytes, reduce_bytes): (f64, f64),
        (nodes, wpn): (usize, usize),
        args: &EstimateArgs,
        tokens: f64,
    ) -> CommEstimate {
        let shape = (nodes, wpn);
        let stage3 = CrossNodeBytes::stage3(psi, param_bytes, shape, reduce_bytes, false);
        let zero_pp = CrossNodeBytes::stage3(psi, param_bytes, shape, reduce_bytes, true);
        let link = args.link_gbps * 1e9 / 8.0;
        // Forward and backward: 6 FLOPs per parameter and token.
        let compute_s = 6.0 * psi * tokens / (args.worker_tflops * 1e12);
        let (a, b) = (stage3.total() / link, zero_pp.total() / link);
        CommEstimate {
            link_gbps: args.link_gbps,
            worker_tflops: args.worker_tflops,
            tokens_per_worker: tokens,
            compute_s,
            stage3,
            zero_pp,
            stage3_link_s: a,
            zero_pp_link_s: b,
            speedup_overlapped: compute_s.max(a) / compute_s.max(b),
            speedup_serial: (compute_s + a) / (compute_s + b),
        }
    }

    fn print(&self, nodes: usize, wpn: usize) {
        say!(
            "cross-node bytes per node per step ({nodes} nodes x {wpn} workers, {} Gbit/s per node; {} tokens at {} TFLOP/s per worker: {:.2} s of compute):",
            self.link_gbps,
            self.tokens_per_worker,
            self.worker_tflops,
            self.compute_s
        );
        say!(
            "{:<8} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "",
            "forward",
            "backward",
            "gradients",
            "total",
            "link time"
        );
        for (name, c, t) in [
            ("stage 3", &self.stage3, self.stage3_link_s),
            ("ZeRO++", &self.zero_pp, self.zero_pp_link_s),
        ] {
            say!(
                "{:<8} {:>10} {:>10} {:>10} {:>10} {:>9.2}s",
                name,
                gb(c.forward),
                gb(c.backward),
                gb(c.gradients),
                gb(c.total()),
                t
            );
        }
        say!(
            "ZeRO++ speedup: {:.2}x with communication hidden under compute, {:.2}x with none hidden (the ZeRO++ paper reports up to 2.16x at 384 V100s on 100 Gbit/s; it counts 16-bit gradients, 3M -> 0.75M, where zrun reduces f32 gradients)",
            self.speedup_overlapped,
            self.speedup_serial
        );
    }
}

/// `zrun estimate`.
pub fn estimate(args: EstimateArgs) -> Result<ExitCode> {
    if args.params.is_none() {
        let given = [("--dtype", &args.dtype), ("--optimizer", &args.optimizer)];
        if let Some((flag, _)) = given.iter().find(|(_, v)| v.is_some()) {
            return Err(Failure::bad_input(format!(
                "{flag} goes with --params: a job says its own (train.dtype, train.optimizer.type; --set changes them)"
            )));
        }
    }
    let (nodes, wpn) = match &args.hostfile {
        Some(h) => {
            let topo = Topology::resolve(&TopologyOptions {
                hostfile: Some(h.clone()),
                workers_per_node: args.workers_per_node,
                num_nodes: args.nodes,
                default_local_slots: DEFAULT_CPU_WORKERS,
                ..Default::default()
            })?;
            let wpn = topo.nodes.iter().map(|n| n.slots.len()).max().unwrap_or(1);
            (topo.nodes.len(), wpn)
        }
        None => (
            args.nodes.unwrap_or(1),
            args.workers_per_node.unwrap_or(DEFAULT_CPU_WORKERS),
        ),
    };
    if nodes == 0 || wpn == 0 {
        return Err(Failure::bad_input(
            "--nodes and --workers-per-node must be at least 1",
        ));
    }
    if args.comm && !(args.link_gbps > 0.0 && args.worker_tflops > 0.0) {
        return Err(Failure::bad_input(
            "--link-gbps and --worker-tflops must be positive",
        ));
    }
    if args
        .tokens_per_worker
        .is_some_and(|t| t.is_nan() || t <= 0.0)
    {
        return Err(Failure::bad_input("--tokens-per-worker must be positive"));
    }
    let est = match (&args.job, &args.params) {
        (Some(job), None) => {
            let mut job = load_job(job, &args.set)?;
            job.validate(nodes * wpn)?;
            let mut est = job_estimate(&job.spec, nodes, wpn);
            if args.comm {
                let t = &job.spec.train;
                let tokens = args
                    .tokens_per_worker
                    .unwrap_or((t.micro_batch_size * job.spec.model.seq_len * t.grad_accum) as f64);
                let b = (StateBytes::for_dtype(t.dtype).param, t.reduce_bytes());
                est.comm = Some(CommEstimate::new(
                    est.params,
                    b,
                    (nodes, wpn),
                    &args,
                    tokens,
                ));
            }
            est
        }
        (None, Some(p)) => {
            let psi = zconfig::spec::parse_quantity(p)
                .map_err(|e| Failure::bad_input(format!("--params: {e}")))?;
            if psi < 1.0 {
                return Err(Failure::bad_input(format!(
                    "--params: `{p}` must be at least 1 parameter"
                )));
            }
            let (dtype_name, rule_name) = (
                args.dtype.as_deref().unwrap_or("bf16"),
                args.optimizer.as_deref().unwrap_or("adamw"),
            );
            let dtype = match dtype_name {
                "f32" => Dtype::F32,
                "f16" => Dtype::F16,
                _ => Dtype::Bf16,
            };
            let rule = match rule_name {
                "lion" => OptimizerKind::Lion,
                "lamb" => OptimizerKind::Lamb,
                "adagrad" => OptimizerKind::Adagrad,
                "adam" => OptimizerKind::Adam,
                _ => OptimizerKind::Adamw,
            };
            let bytes = StateBytes::for_training(dtype, rule);
            Estimate {
                params: psi,
                world_size: nodes * wpn,
                nodes,
                workers_per_node: wpn,
                bytes_per_param: bytes,
                training: format!("{dtype_name}, {rule_name}"),
                rows: model_state_rows(psi, nodes, wpn, bytes, 0.0),
                activations: None,
                stage: None,
                this_job: None,
                comm_buffers_per_worker: None,
                reduce_buckets: None,
                peak_per_worker: None,
                trained: None,
                comm: args.comm.then(|| {
                    let tokens = args.tokens_per_worker.unwrap_or(1024.0);
                    CommEstimate::new(psi, (bytes.param, 4.0), (nodes, wpn), &args, tokens)
                }),
            }
        }
        _ => {
            return Err(Failure::bad_input(
                "give a job spec or --params N (one of them)",
            ))
        }
    };
    if args.json {
        say!("{}", serde_json::to_string_pretty(&est)?);
        return Ok(ExitCode::SUCCESS);
    }
    let b = &est.bytes_per_param;
    say!(
        "{:.3e} parameters on {} node(s) x {} workers ({} ranks); model states per device \
         ({}: {} + {} + {} bytes a parameter of weights, gradients and optimizer state):",
        est.params,
        est.nodes,
        est.workers_per_node,
        est.world_size,
        est.training,
        b.param,
        b.grad,
        b.optimizer
    );
    say!(
        "{:>5}  {:<22} {:>14} {:>16} {:>16}",
        "stage",
        "offload",
        "per device",
        "host per node",
        "nvme per node"
    );
    for r in &est.rows {
        say!(
            "{:>5}  {:<22} {:>14} {:>16} {:>16}",
            r.stage,
            r.offload,
            gb(r.bytes_per_device),
            gb(r.host_bytes_per_node),
            gb(r.nvme_bytes_per_node)
        );
    }
    if let Some(a) = &est.activations {
        say!(
            "activations per worker at micro-batch {}{}: {} ({} with activation checkpointing)",
            a.micro_batch_size,
            match a.bf16_kept {
                true => " (the products' inputs in bf16: this CPU multiplies bf16)",
                false => "",
            },
            gb(a.bytes_per_worker),
            gb(a.bytes_per_worker_checkpointed)
        );
        if a.attention_work_per_thread > 0.0 {
            say!(
                "  and attention's work matrices: {} for each of a worker's threads",
                gb(a.attention_work_per_thread)
            );
        }
        if a.backward_per_worker > 0.0 {
            say!(
                "  and backward's passing gradients: {} more at their most (the top block's)",
                gb(a.backward_per_worker)
            );
        }
        if a.gpu_probabilities_per_block > 0.0 {
            say!(
                "  of which the GPU's unfused attention keeps {} of probabilities a block (ZRUN_GPU_ATTENTION=fused keeps none)",
                gb(a.gpu_probabilities_per_block)
            );
        }
    }
    if let Some(w) = &est.this_job {
        say!(
            "this job's workers (stage {}, its offload settings{}): {} of model states in memory and {} in swap files per worker",
            est.stage.unwrap_or_default(),
            match &est.trained {
                Some(t) => format!(
                    ", train.freeze: moments and gradients for {:.1}% of the parameters",
                    100.0 * t.trained / est.params,
                ),
                None => String::new(),
            },
            gb(w.memory),
            gb(w.nvme)
        );
    }
    if let Some(b) = est.comm_buffers_per_worker.filter(|&b| b > 0.0) {
        say!(
            "  and buffers for its reductions{}: {} per worker{}",
            match est.stage {
                Some(3) => " and gathers",
                _ => "",
            },
            gb(b),
            match &est.reduce_buckets {
                Some(r) if r.count == 1 => format!(" (one reduce bucket: {})", gb(r.held_bytes)),
                Some(r) => format!(
                    " (of its {} reduce buckets a step, {} held at once: {})",
                    r.count,
                    r.held_at_once,
                    gb(r.held_bytes)
                ),
                None => String::new(),
            }
        );
    }
    if let Some(p) = est.peak_per_worker {
        let threads = local_worker_threads(est.workers_per_node);
        say!(
            "at its peak a worker of {threads} thread{} holds about {} (the process, its states, buffers, activations and work matrices)",
            if threads == 1 { "" } else { "s" },
            gb(p)
        );
    }
    if let Some(c) = &est.comm {
        c.print(est.nodes, est.workers_per_node);
    }
    Ok(ExitCode::SUCCESS)
}

fn gb(b: f64) -> String {
    if b == 0.0 {
        "-".into()
    } else if b >= 1e9 {
        format!("{:.1} GB", b / 1e9)
    } else {
        format!("{:.1} MB", b / 1e6)
    }
}

fn job_estimate(spec: &JobSpec, nodes: usize, wpn: usize) -> Estimate {
    let psi = model_params(&spec.model);
    let bytes = StateBytes::for_job(spec);
    let fused = spec.device == zconfig::spec::Device::Cuda && fused_attention_expected(spec);
    let kept = kept(spec);
    let (act, act_ckpt) = job_activation_bytes(spec, fused, kept);
    let cpu = spec.device == zconfig::spec::Device::Cpu;
    let probs = match !cpu && !fused {
        true => gpu_probabilities_bytes(
            &spec.model,
            spec.train.micro_batch_size,
            spec.train.dtype != Dtype::F32,
        ),
        false => 0.0,
    };
    Estimate {
        params: psi,
        world_size: nodes * wpn,
        nodes,
        workers_per_node: wpn,
        bytes_per_param: bytes,
        training: match spec.train.grads_dtype() == spec.train.dtype {
            true => format!("{}, {}", spec.train.dtype, spec.train.optimizer.kind.name()),
            false => format!(
                "{}, {}, {} gradients",
                spec.train.dtype,
                spec.train.optimizer.kind.name(),
                spec.train.grads_dtype()
            ),
        },
        rows: model_state_rows(psi, nodes, wpn, bytes, largest_group(&spec.model)),
        activations: Some(Activations {
            micro_batch_size: spec.train.micro_batch_size,
            bytes_per_worker: act,
            bytes_per_worker_checkpointed: act_ckpt,
            gpu_probabilities_per_block: probs,
            bf16_kept: kept == Kept::Bf16Products,
            attention_work_per_thread: match cpu {
                false => 0.0,
                true => attention_work_bytes(&spec.model, spec.train.dtype),
            },
            backward_per_worker: match cpu {
                false => 0.0,
                true => job_backward_bytes(spec, kept),
            },
        }),
        stage: Some(spec.zero.stage.number()),
        this_job: Some(worker_states(spec, nodes * wpn)),
        comm_buffers_per_worker: cpu.then(|| comm_buffer_bytes(spec, nodes * wpn)),
        reduce_buckets: (cpu && nodes * wpn > 1).then(|| {
            let count = reduce_bucket_elements(&spec.model, spec.zero.reduce_bucket_size.0).len();
            ReduceBuckets {
                count,
                held_at_once: count.min(REDUCE_BUCKETS_HELD),
                held_bytes: held_bucket_bytes(spec, nodes * wpn),
            }
        }),
        peak_per_worker: cpu
            .then(|| cpu_worker_peak_bytes(spec, nodes * wpn, local_worker_threads(wpn), kept)),
        trained: (!spec.train.freeze.is_empty())
            .then(|| trained_elements(&spec.model, &spec.train.freeze)),
        comm: None,
    }
}

/// Bytes one worker of this job is expected to hold in the host's memory:
/// on the CPU what it holds at its peak ([`cpu_worker_peak_bytes`]), with
/// a `device: cuda` job its stage's model states (the activations are the
/// GPU's, where the worker's out-of-memory failure says what `zrun
/// estimate` predicts there).
pub fn per_worker_bytes(spec: &JobSpec, topo: &Topology) -> f64 {
    let wpn = topo.nodes.iter().map(|n| n.slots.len()).max().unwrap_or(1);
    if spec.device == zconfig::spec::Device::Cuda {
        return worker_states(spec, topo.world_size()).memory;
    }
    let threads = local_worker_threads(wpn);
    cpu_worker_peak_bytes(spec, topo.world_size(), threads, kept(spec))
}

/// The types `spec`'s CPU workers keep their activations in, where they
/// run on this host's CPU (bf16 where it multiplies bf16 natively, as the
/// workers' model decides).
pub fn kept(spec: &JobSpec) -> Kept {
    Kept::for_job(spec, zgemm::has_native_bf16())
}

/// The threads each of `wpn` workers on this host runs: `RAYON_NUM_THREADS`
/// where it is set (zrun passes it on), else a share of the cores, as
/// zrun's launch gives them.
pub fn local_worker_threads(wpn: usize) -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|t| t.trim().parse::<usize>().ok())
        .filter(|&t| t > 0)
        .unwrap_or_else(|| crate::launch::cores_share(wpn))
}

/// A `/proc/meminfo` field in bytes, if known.
fn meminfo(field: &str) -> Option<f64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: f64 = s
        .lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024.0)
}

/// This host's available memory (`MemAvailable`), if known.
pub fn mem_available() -> Option<f64> {
    meminfo("MemAvailable")
}

/// This host's memory and swap together (`MemTotal + SwapTotal`), if known.
pub fn mem_total() -> Option<f64> {
    Some(meminfo("MemTotal")? + meminfo("SwapTotal").unwrap_or(0.0))
}
