//! `zrun plan JOB.yaml`: which stage, offload, ZeRO++, gradients' wire
//! type, micro-batch, accumulation and activation checkpointing to run a
//! job with, found by arithmetic on measured figures of this machine
//! instead of trial jobs (DeepSpeed's autotuner launches dozens).
//!
//! The figures ([`Machine`]): candle's f32 GEMM, the STREAM triad, AdamW (from
//! `bench kernels`), the bus bandwidth of all-reduce, all-gather and
//! reduce-scatter per transport (from `bench comm` with this node's workers),
//! and the swap directory's bandwidth (`bench io`) when the job has one. They
//! are measured on first use and cached per host and workers per node
//! (`~/.cache/zrun/`, or `$ZRUN_CACHE_DIR`); other nodes are assumed alike.
//!
//! Every candidate keeps the job's global batch (micro × accumulation ×
//! workers). One that fails the job's own validation or does not fit the
//! memory per worker (the estimator's model states plus activations) is
//! dropped; the rest are ranked by predicted step time, the sum of
//! - compute: 6 FLOPs per parameter and token plus attention's 12·L·d·T, and
//!   a second forward with checkpointing, at the GEMM's rate for this
//!   worker's share of the cores;
//! - the work between the products (norms, activations, attention's
//!   softmax, the loss): the step's activation bytes (a third more with
//!   checkpointing) at the rate a small model's step went through its own,
//!   measured ([`Machine::between_gbps`]); a job in bf16 or f16 takes both
//!   rates from two steps of its own type instead ([`Rates`]);
//! - fixed overheads per block and micro-batch, per micro-batch and per step,
//!   measured by training a model too small for anything else to count;
//! - the optimizer: AdamW's 28 bytes per parameter of the rank's slice at
//!   AdamW's measured rate;
//! - communication: the collectives' bus bytes per step over the measured
//!   bus bandwidth (shared memory within a node, TCP or `--link-gbps` across
//!   nodes), none of it assumed hidden (compute and communication share the
//!   same cores); qwZ's forward gathers in its bits, hpZ's backward gathers
//!   over shared memory inside the node; reductions in 16 bits
//!   (`train.reduce_dtype`) send half the bytes but round and widen them,
//!   so they take the longer of their wire bytes over the link and their
//!   f32 bytes at the rate `bench comm` measured for the 16-bit collective
//!   on the same transport;
//! - swap traffic over the swap directory's bandwidth.
//!
//! `--verify` trains the best three for a few steps and prints predicted
//! against measured tokens/s.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::estimate::local_worker_threads;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use zconfig::estimate::{
    activation_bytes, cpu_worker_peak_bytes, frozen_flops_per_token, model_params,
    trained_elements, worker_states, Kept, StateBytes,
};
use zconfig::spec::{Device, Dtype, OptimizerKind};
use zconfig::{load_job_with, JobSpec, Topology};

use crate::cli::PlanArgs;
use crate::plan::topology;
use crate::Failure;

/// Measured figures of one host, for `workers` workers per node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    /// Host name.
    pub host: String,
    /// Cores.
    pub cpus: usize,
    /// Workers per node the figures are for.
    pub workers: usize,
    /// candle's f32 GEMM with every core, GFLOP/s.
    pub gemm_gflops: f64,
    /// STREAM triad with every core, GB/s.
    pub triad_gbps: f64,
    /// AdamW (f32, the fastest SIMD path) at one worker's share of the cores, GB/s.
    pub adamw_gbps: f64,
    /// Bus bandwidth per (transport, collective), GB/s, at the largest size;
    /// the 16-bit reductions' rows (`all_reduce_bf16`...) count the f32
    /// bytes they stand for, as `bench comm` does.
    pub busbw: Vec<(String, String, f64)>,
    /// The swap directory's read/write bandwidth, GB/s, where measured.
    pub swap_gbps: Option<f64>,
    /// Fixed costs of a training step that FLOPs and bytes do not explain.
    pub overheads: Overheads,
    /// The rate, GB/s per worker, at which a step's work between its
    /// products (norms, activations, attention's softmax, the loss) goes
    /// through its activation bytes: a small model's step time less its
    /// products at the GEMM rate and the fixed overheads. 0 in figures
    /// cached before it was measured, which are measured again.
    #[serde(default)]
    pub between_gbps: f64,
    /// The rates a step in a 16-bit working type runs at, measured the
    /// first time a job in that type is planned here.
    #[serde(default)]
    pub sixteen: Vec<Rates>,
}

/// What a step in a 16-bit working type runs at, fitted from two steps of
/// its own (`measure_sixteen`): its products (bf16 ones where the CPU
/// multiplies bf16 natively) and its passes between them (rounding too)
/// differ from f32's, and a benchmark's rate overshoots what the products
/// reach inside a step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Rates {
    /// The working type.
    pub dtype: Dtype,
    /// The products with every core, GFLOP/s.
    pub gemm_gflops: f64,
    /// The work between the products, GB/s of activations per worker.
    pub between_gbps: f64,
}

/// What a step costs beyond its FLOPs and bytes (operator dispatch,
/// allocation, synchronisation), measured by training a model so small that
/// nothing else counts: seconds per block and micro-batch, per micro-batch
/// outside the blocks, and per step.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Overheads {
    /// Per transformer block, per micro-batch (forward and backward).
    pub block_s: f64,
    /// Per micro-batch outside the blocks (embedding, head, loss, data).
    pub micro_s: f64,
    /// Per optimizer step (gradient reduction's latency, the update's dispatch,
    /// the report).
    pub step_s: f64,
}

impl Machine {
    /// (GEMM GFLOP/s with every core, GB/s between the products per worker)
    /// of a step in `dtype`: f32's figures where no 16-bit ones were measured.
    fn rates(&self, dtype: Dtype) -> (f64, f64) {
        self.sixteen
            .iter()
            .find(|r| r.dtype == dtype)
            .map_or((self.gemm_gflops, self.between_gbps), |r| {
                (r.gemm_gflops, r.between_gbps)
            })
    }

    fn busbw(&self, transport: &str, op: &str) -> Option<f64> {
        self.busbw
            .iter()
            .find(|(t, o, _)| t == transport && o == op)
            .map(|x| x.2)
    }
}

fn cache_path(workers: usize) -> PathBuf {
    let dir = std::env::var_os("ZRUN_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("zrun")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/zrun")))
        .unwrap_or_else(|| PathBuf::from(".zrun-cache"));
    dir.join(format!(
        "machine-{}-{workers}w.json",
        crate::pernode::hostname()
    ))
}

/// The GEMM rate a step is predicted from: zgemm's peak on all cores (the
/// `gemm_f32` row). The model's products run on zgemm, not on the `gemm`
/// crate that other rows time beside it.
fn gemm_peak(rows: &[zproto::KernelRow]) -> Option<f64> {
    rows.iter()
        .filter(|r| r.kernel == "gemm_f32")
        .max_by_key(|r| r.threads)
        .map(|r| r.gflops)
}

/// The cached figures for `workers` per node, or new ones measured now.
fn machine(workers: usize, remeasure: bool, worker_bin: &Path) -> Result<Machine> {
    let path = cache_path(workers);
    if !remeasure {
        if let Some(m) = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Machine>(&b).ok())
            .filter(|m| m.overheads.block_s > 0.0 && m.between_gbps > 0.0)
            // Figures cached before the 16-bit reductions were measured.
            .filter(|m| m.workers < 2 || m.busbw("tcp", "reduce_scatter_bf16").is_some())
        {
            say!("zrun: machine figures from {}", path.display());
            return Ok(m);
        }
    }
    say!("zrun: measuring this machine (GEMM, memory bandwidth, AdamW, collectives with {workers} workers); cached in {}", path.display());
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let kernels = crate::bench::measure_kernels(1 << 24, worker_bin)?;
    let per_worker = crate::launch::cores_share(workers);
    // The row at the most threads a worker gets, fastest path first.
    let best = |name: &str, f: &dyn Fn(&zproto::KernelRow) -> f64| {
        kernels
            .iter()
            .filter(|r| r.kernel.starts_with(name) && !r.kernel.ends_with("_bf16"))
            .filter(|r| r.threads <= per_worker)
            .max_by(|a, b| a.threads.cmp(&b.threads).then(f(a).total_cmp(&f(b))))
            .map(f)
    };
    let all_cores = |name: &str| {
        kernels
            .iter()
            .filter(|r| r.kernel == name)
            .max_by_key(|r| r.threads)
            .map(|r| r.gbps)
    };
    let mut busbw = Vec::new();
    if workers > 1 {
        let ops: Vec<String> = [
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "all_reduce_bf16",
            "reduce_scatter_bf16",
            "all_reduce_f16",
            "reduce_scatter_f16",
        ]
        .map(String::from)
        .to_vec();
        let transports = ["shm".to_string(), "tcp".to_string()];
        for r in crate::bench::measure_comm(workers, &ops, &[16 << 20], &transports, worker_bin)? {
            if r.op != "memcpy" && r.op != "tcp_stream" {
                busbw.push((r.transport, r.op, r.busbw_gbps));
            }
        }
    }
    let gemm_gflops = gemm_peak(&kernels).unwrap_or(1.0);
    let triad_gbps = all_cores("triad").unwrap_or(1.0);
    let overheads = measure_overheads(workers, worker_bin)?;
    let between = Between {
        workers,
        gemm_gflops,
        triad_gbps,
        overheads,
    };
    let m = Machine {
        host: crate::pernode::hostname(),
        cpus,
        workers,
        gemm_gflops,
        triad_gbps,
        adamw_gbps: best("adamw", &|r| r.gbps).unwrap_or(1.0),
        busbw,
        swap_gbps: None,
        overheads,
        between_gbps: between.measure(worker_bin)?,
        sixteen: Vec::new(),
    };
    cache(&m)?;
    Ok(m)
}

/// Keeps `m` for the next plan on this host (a failure to is said, not fatal).
fn cache(m: &Machine) -> Result<()> {
    let path = cache_path(m.workers);
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Err(e) = zckpt::write_atomic(&path, &serde_json::to_vec_pretty(m)?) {
        say!(
            "zrun: could not cache the figures at {}: {e}",
            path.display()
        );
    }
    Ok(())
}

/// Median step time (after the first) of a minimal synthetic job on
/// `workers` local workers with `layers` blocks and `accum` micro-batches of
/// one 16-token sequence per step.
fn tiny_step_s(workers: usize, layers: usize, accum: usize, worker_bin: &Path) -> Result<f64> {
    let model =
        format!("{{vocab_size: 64, d_model: 16, n_layers: {layers}, n_heads: 2, seq_len: 16}}");
    Ok(step_s(workers, &model, (1, accum), Dtype::F32, worker_bin)?.0)
}

/// Step time of a synthetic job of `model` (its YAML) on `workers` local
/// workers, `micro` sequences a micro-batch and `accum` micro-batches a
/// step, in `dtype`, and the job it ran: the faster of two runs' medians
/// (each after its first step). A neighbour that takes the host for one
/// run only slows it, and the figures are cached: one such run had left a
/// rate between the products 0.6x what a remeasure found, and every plan
/// after it 1.13-1.20x slow.
fn step_s(
    workers: usize,
    model: &str,
    (micro, accum): (usize, usize),
    dtype: Dtype,
    worker_bin: &Path,
) -> Result<(f64, JobSpec)> {
    let dir = tempfile::tempdir()?;
    let job = dir.path().join("overhead.yaml");
    std::fs::write(
        &job,
        format!(
            "name: overhead\nmodel: {model}\n\
             data: {{format: synthetic}}\ntrain: {{steps: 12, micro_batch_size: {micro}, grad_accum: {accum}, warmup_steps: 1, dtype: {dtype}}}\n"
        ),
    )?;
    let spec = load_job_with(&job, &[], None)?.spec;
    let mut best = f64::INFINITY;
    for run in 0..2 {
        let metrics = dir.path().join(format!("m{run}.jsonl"));
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.arg("train")
            .arg(&job)
            .args(["--no-progress", "--workers-per-node", &workers.to_string()])
            .arg("--worker-bin")
            .arg(worker_bin)
            .arg("--set")
            .arg(format!(
                "run_dir={}",
                dir.path().join(format!("run{run}")).display()
            ))
            .arg("--metrics")
            .arg(&metrics);
        let out = crate::child::output_of(cmd, "measuring step overheads")?;
        if !out.status.success() {
            return Err(Failure::launch(format!(
                "measuring step overheads failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let step = crate::sweep::row_from_metrics(Vec::new(), &metrics)?.step_ms / 1e3;
        best = best.min(step);
    }
    Ok((best, spec))
}

/// What [`Machine::between_gbps`] is measured against.
struct Between {
    workers: usize,
    gemm_gflops: f64,
    triad_gbps: f64,
    overheads: Overheads,
}

impl Between {
    /// A model of d_model 64, 2 blocks and 8 sequences of 64 tokens a
    /// micro-batch: its step time less its products at the GEMM rate
    /// shared by the workers and less the fixed overheads, over its
    /// activation bytes. Larger than the overhead jobs, so that the work
    /// between the products counts; smaller than the jobs it predicts
    /// (tiny's d_model 128, the anchor's 384), so that it is not fitted to
    /// them.
    fn measure(&self, worker_bin: &Path) -> Result<f64> {
        let (step, spec) = step_s(self.workers, BETWEEN_MODEL, (8, 1), Dtype::F32, worker_bin)?;
        Ok(self.rate(step, &spec))
    }

    /// The rate from `spec`'s measured `step`; where the step was no slower
    /// than its products and overheads, nothing is left to measure, and
    /// three passes over the activations at the worker's share of the triad
    /// stand in.
    fn rate(&self, step: f64, spec: &JobSpec) -> f64 {
        let (flops, acts, fixed) = step_parts(spec, self.overheads);
        let gemm = flops / (self.gemm_gflops * 1e9 / self.workers as f64);
        let between = step - gemm - fixed;
        match between > 0.0 {
            true => acts / between / 1e9,
            false => self.triad_gbps / self.workers as f64 / 3.0,
        }
    }
}

/// The model [`Between`] measures on: d_model 64, 2 blocks, 8 sequences of
/// 64 tokens a micro-batch.
const BETWEEN_MODEL: &str = "{vocab_size: 256, d_model: 64, n_layers: 2, n_heads: 4, seq_len: 64}";

/// A one-micro-batch step of `spec` on one worker: (its products' FLOPs,
/// the activation bytes the work between them goes through, its fixed
/// overheads in seconds).
fn step_parts(spec: &JobSpec, o: Overheads) -> (f64, f64, f64) {
    let m = &spec.model;
    let micro = spec.train.micro_batch_size as f64;
    let (l, d, t) = (m.n_layers as f64, m.d_model as f64, m.seq_len as f64);
    let flops = micro * t * (6.0 * model_params(m) + 12.0 * l * d * t);
    let (acts, _) = activation_bytes(m, spec.train.micro_batch_size, (false, Kept::F32));
    (flops, acts, l * o.block_s + o.micro_s + o.step_s)
}

/// [`Rates`] of a step in `dtype` on `m`, from two steps of its own: the
/// [`Between`] model, where the work between the products weighs most, and
/// one of d_model 256, where the products do. Each step less its fixed
/// overheads is its products at the GEMM rate plus its activation bytes at
/// the rate between them: two equations in the two rates. Where the
/// machine's noise leaves no positive solution, the f32 GEMM rate stands and
/// the small step gives the rate between, as for f32.
fn measure_sixteen(m: &Machine, dtype: Dtype, worker_bin: &Path) -> Result<Rates> {
    let large = "{vocab_size: 256, d_model: 256, n_layers: 2, n_heads: 4, seq_len: 64}";
    let mut steps = Vec::new();
    for model in [BETWEEN_MODEL, large] {
        steps.push(step_s(m.workers, model, (8, 1), dtype, worker_bin)?);
    }
    let rows: Vec<[f64; 3]> = steps
        .iter()
        .map(|(step, spec)| {
            let (flops, acts, fixed) = step_parts(spec, m.overheads);
            [step - fixed, flops * m.workers as f64, acts]
        })
        .collect();
    Ok(fit_rates(dtype, &rows).unwrap_or_else(|| {
        let between = Between {
            workers: m.workers,
            gemm_gflops: m.gemm_gflops,
            triad_gbps: m.triad_gbps,
            overheads: m.overheads,
        };
        Rates {
            dtype,
            gemm_gflops: m.gemm_gflops,
            between_gbps: between.rate(steps[0].0, &steps[0].1),
        }
    }))
}

/// Solves `seconds = flops / gemm + bytes / between` for the two rates
/// from two steps' `[seconds, flops (all workers'), bytes (one worker's)]`;
/// `None` where they admit no positive pair.
fn fit_rates(dtype: Dtype, rows: &[[f64; 3]]) -> Option<Rates> {
    let [[r1, f1, a1], [r2, f2, a2]] = rows else {
        return None;
    };
    let det = f1 * a2 - f2 * a1;
    let per_flop = (r1 * a2 - r2 * a1) / det;
    let per_byte = (f1 * r2 - f2 * r1) / det;
    (per_flop > 0.0 && per_byte > 0.0 && det.is_finite()).then(|| Rates {
        dtype,
        gemm_gflops: 1.0 / per_flop / 1e9,
        between_gbps: 1.0 / per_byte / 1e9,
    })
}

/// [`Overheads`] from three minimal jobs: 1 and 3 blocks at 8 micro-batches
/// per step, and 1 block at 2.
fn measure_overheads(workers: usize, worker_bin: &Path) -> Result<Overheads> {
    let a = tiny_step_s(workers, 1, 8, worker_bin)?;
    let b = tiny_step_s(workers, 3, 8, worker_bin)?;
    let c = tiny_step_s(workers, 1, 2, worker_bin)?;
    let block_s = ((b - a) / 16.0).max(1e-7);
    let micro_s = ((a - c) / 6.0 - block_s).max(0.0);
    let step_s = (c - 2.0 * (block_s + micro_s)).max(0.0);
    Ok(Overheads {
        block_s,
        micro_s,
        step_s,
    })
}

/// One configuration and what it is predicted to cost.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    /// The job keys it sets.
    pub sets: Vec<(String, String)>,
    /// Predicted memory per worker (model states and activations), bytes.
    pub memory: f64,
    /// Predicted swap bytes per worker.
    pub swap: f64,
    /// Predicted step time, seconds, and its parts.
    pub step_s: f64,
    /// Compute (GEMM), memory-bound passes, fixed overheads, optimizer,
    /// communication, swap.
    pub parts: [f64; 6],
    /// Predicted tokens per second of the whole job.
    pub tokens_per_s: f64,
    /// Measured tokens per second (`--verify`).
    pub measured: Option<f64>,
}

impl Candidate {
    fn label(&self) -> String {
        self.sets
            .iter()
            .map(|(k, v)| format!("{}={v}", k.split_once('.').map_or(k.as_str(), |x| x.1)))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// What the prediction needs about the topology and the machine.
struct Setting<'a> {
    world: usize,
    nodes: usize,
    machine: &'a Machine,
    link_gbps: Option<f64>,
}

/// Predicted seconds of one step of `spec`:
/// `[gemm, memory, overheads, optimizer, comm, swap]`.
fn predict(spec: &JobSpec, s: &Setting) -> [f64; 6] {
    let m = &spec.model;
    let (psi, l, d, t) = (
        model_params(m),
        m.n_layers as f64,
        m.d_model as f64,
        m.seq_len as f64,
    );
    let w = s.world as f64;
    let per_node = (s.world / s.nodes.max(1)).max(1) as f64;
    let micro = spec.train.micro_batch_size as f64;
    let accum = spec.train.grad_accum as f64;
    let tokens = micro * accum * t;
    let ac = spec.train.activation_checkpointing;
    // Attention's keys per token: the sliding window where it is shorter.
    let keys = m.window().map_or(t, |w| w as f64);
    // `train.freeze`: the share of the products that freezing leaves (no
    // frozen weight's gradient, no backward below the lowest block that
    // trains), of the moments that the optimizer moves, and of the
    // gradients that are reduced and the parameters shared after the step
    // (the elements that train: buckets and the post-step gathers carry no
    // frozen parameter's, except under qgZ, whose buckets stay whole),
    // and of the parameters stage 3's backward gathers (the groups that
    // train).
    let freeze = &spec.train.freeze;
    let done = frozen_flops_per_token(m, freeze) / frozen_flops_per_token(m, &[]);
    let trained = trained_elements(m, freeze);
    let moving = trained.trained / psi;
    let reduced = match spec.zero.quantized_gradients {
        true => trained.with_grads / psi,
        false => moving,
    };
    let reached = trained.with_grads / psi;
    let per_token = (6.0 * psi + 12.0 * l * d * keys) * done;
    let recompute = if ac {
        (2.0 * psi + 4.0 * l * d * keys) * done
    } else {
        0.0
    };
    let (gemm_gflops, between_gbps) = s.machine.rates(spec.train.dtype);
    let gemm_rate = gemm_gflops * 1e9 / per_node;
    let gemm = tokens * (per_token + recompute) / gemm_rate;
    // The passes between the products go over every block's activations
    // whatever is frozen (a frozen weight's input is dropped, not left
    // unread; frozen blocks below the ones that train run forward only, a
    // third of their passes, which this leaves in). BitFit on the anchor
    // measured 0.88-0.92 of its prediction with the kept bytes here, and
    // 0.97-0.99 with every block's.
    let (acts, _) = activation_bytes(m, spec.train.micro_batch_size, (false, Kept::F32));
    // Checkpointing runs the forward's share of that work again.
    let again = if ac { 4.0 / 3.0 } else { 1.0 };
    let memory = accum * acts * again / (between_gbps * 1e9);
    let o = s.machine.overheads;
    let recomputed = if ac { 1.5 } else { 1.0 };
    let overheads = accum * (l * o.block_s * recomputed + o.micro_s) + o.step_s;
    let stage = spec.zero.stage;
    let slice = if stage.partitions_optimizer() {
        psi / w
    } else {
        psi
    };
    // AdamW and Adam move 28 bytes an element, Lion and Adagrad 20 (no second
    // moment), LAMB 40 (two passes: 24 bytes, then 16).
    let moved = match spec.train.optimizer.kind {
        OptimizerKind::Adamw | OptimizerKind::Adam => 28.0,
        OptimizerKind::Lion | OptimizerKind::Adagrad => 20.0,
        OptimizerKind::Lamb => 40.0,
    };
    let optimizer = moved * slice * moving / (s.machine.adamw_gbps * 1e9);
    let b = StateBytes::for_job(spec);
    // Gradients cross the wire in f32 whatever type holds them, or in 16
    // bits under `train.reduce_dtype`.
    let (g, p) = (spec.train.reduce_bytes() * psi * reduced, b.param * psi);
    let ring = (w - 1.0) / w;
    // Bus bytes per collective kind: (all_reduce, all_gather, backward's
    // all_gather, reduce_scatter); what backward and the step gather, only
    // of the groups that train.
    let (ar, ag, back, rs) = match stage.number() {
        0 => (2.0 * ring * g, 0.0, 0.0, 0.0),
        1 => (0.0, ring * p * reduced, 0.0, ring * g),
        2 => (0.0, ring * p * reduced, 0.0, accum * ring * g),
        _ => (
            0.0,
            accum * ring * p,
            accum * ring * p * reached,
            accum * ring * g,
        ),
    };
    let comm = if s.world > 1 {
        let rate = |op: &str| {
            let shm = s.machine.busbw("shm", op).unwrap_or(1.0);
            let tcp = s.machine.busbw("tcp", op).unwrap_or(1.0);
            if s.nodes > 1 {
                s.link_gbps.map_or(tcp, |l| l / 8.0).min(shm)
            } else {
                shm
            }
        };
        // Bytes of elements of `size` bytes, sent in `bits` where `on`.
        let quantized = |bytes: f64, size: f64, on: bool, bits: u32| {
            if on {
                bytes * f64::from(bits) / (8.0 * size)
            } else {
                bytes
            }
        };
        let (z, grad) = (&spec.zero, spec.train.reduce_bytes());
        // qwZ quantizes the forward gathers; backward's stay full precision.
        let ag = quantized(ag, b.param, z.quantized_weights, z.quantization.weight_bits);
        // hpZ: backward gathers the secondary shards inside its group, on
        // one node, over the node's shared memory. (Bytes over GB/s: ns.)
        let back_ns = match z.hpz_partition_size {
            hpz if hpz > 1 => {
                let inside = (hpz as f64 - 1.0) / hpz as f64 * back / ring;
                inside / s.machine.busbw("shm", "all_gather").unwrap_or(1.0)
            }
            _ => back / rate("all_gather"),
        };
        let rs = quantized(
            rs,
            grad,
            z.quantized_gradients,
            z.quantization.gradient_bits,
        );
        // A gradient reduction of `bytes` on the wire: in 16 bits, no faster
        // than the 16-bit collective ran on this transport with its f32
        // bytes (its rounding, widening and two hops cost more than the
        // halved bytes save on a fast path: on one host's shared memory it
        // ran at half f32's rate).
        let reduction = |bytes: f64, op: &str| {
            let wire = bytes / rate(op);
            match spec.train.reduce_dtype {
                Some(d @ (Dtype::Bf16 | Dtype::F16)) => {
                    let transport = if s.nodes > 1 { "tcp" } else { "shm" };
                    let half = s.machine.busbw(transport, &format!("{op}_{d}"));
                    half.map_or(wire, |r| wire.max(bytes * 4.0 / grad / r))
                }
                _ => wire,
            }
        };
        (reduction(ar, "all_reduce")
            + ag / rate("all_gather")
            + back_ns
            + reduction(rs, "reduce_scatter"))
            / 1e9
    } else {
        0.0
    };
    let states = worker_states(spec, s.world);
    let swap = match s.machine.swap_gbps {
        Some(bw) if states.nvme > 0.0 => {
            let params = if spec.zero.offload_param.is_nvme() {
                2.0 * accum * b.param * psi / w
            } else {
                0.0
            };
            // The optimizer's state read and written once a step; LAMB's two
            // passes read it twice and write each part once, 1.5 times the bytes.
            let passes = match spec.train.optimizer.kind {
                OptimizerKind::Lamb => 3.0,
                _ => 2.0,
            };
            (passes * (states.nvme - b.param * psi / w).max(0.0) + params) / (bw * 1e9 / per_node)
        }
        _ => 0.0,
    };
    [gemm, memory, overheads, optimizer, comm, swap]
}

/// The candidates' `--set` values: every stage, micro-batch (keeping the
/// global batch), checkpointing on and off, swap where the job names a swap
/// directory, ZeRO++ on more than one node, and there, for a job that
/// trains in 16 bits, gradients reduced in f32 or in its own type
/// (DeepSpeed's default `communication_data_type`). Not on one node: its
/// shared memory runs the 16-bit reductions slower than f32's, and an f32
/// job's gradients stay f32 unless the job says otherwise. With
/// `fixed_micro` (a ds_config's elastic batch settles the micro-batch for
/// the world size) the job's micro-batch alone.
fn candidate_sets(
    spec: &JobSpec,
    world: usize,
    nodes: usize,
    fixed_micro: bool,
) -> Vec<Vec<(String, String)>> {
    let global = spec.train.micro_batch_size * spec.train.grad_accum * world;
    let swap_dir = spec
        .zero
        .offload_optimizer
        .nvme_path
        .clone()
        .or_else(|| spec.zero.offload_param.nvme_path.clone());
    let sixteen = Some(spec.train.dtype).filter(|d| nodes > 1 && *d != Dtype::F32);
    let mut out = Vec::new();
    for stage in 0..=3u8 {
        let mut offloads: Vec<Vec<(String, String)>> = vec![vec![
            ("zero.offload_optimizer.device".into(), "none".into()),
            ("zero.offload_param.device".into(), "none".into()),
        ]];
        if let Some(dir) = &swap_dir {
            offloads.push(vec![
                ("zero.offload_optimizer.device".into(), "nvme".into()),
                ("zero.offload_optimizer.nvme_path".into(), dir.clone()),
                ("zero.offload_param.device".into(), "none".into()),
            ]);
            if stage == 3 {
                offloads.push(vec![
                    ("zero.offload_optimizer.device".into(), "nvme".into()),
                    ("zero.offload_optimizer.nvme_path".into(), dir.clone()),
                    ("zero.offload_param.device".into(), "nvme".into()),
                    ("zero.offload_param.nvme_path".into(), dir.clone()),
                ]);
            }
        }
        let mut plain = vec![
            ("zero.quantized_weights".to_string(), "false".to_string()),
            ("zero.quantized_gradients".into(), "false".into()),
            ("zero.hpz_partition_size".into(), "1".into()),
        ];
        if spec.zero.loco.is_some() {
            // LoCo's error feedback is qgZ's, and goes with it.
            plain.push(("zero.loco".into(), "null".into()));
        }
        let mut zeropp: Vec<Vec<(String, String)>> = match sixteen {
            Some(d) => [Dtype::F32, d]
                .map(|wire| {
                    let mut sets = plain.clone();
                    sets.push(("train.reduce_dtype".into(), wire.to_string()));
                    sets
                })
                .to_vec(),
            None => vec![plain],
        };
        if stage == 3 && nodes > 1 {
            // hpZ alone: lossless, stage 3's bits; backward gathers inside
            // each node.
            let hpz: Vec<_> = zeropp
                .iter()
                .map(|sets| {
                    let mut sets = sets.clone();
                    for (k, v) in &mut sets {
                        if k == "zero.hpz_partition_size" {
                            *v = (world / nodes).to_string();
                        }
                    }
                    sets
                })
                .collect();
            zeropp.extend(hpz);
            zeropp.push(vec![
                ("zero.quantized_weights".into(), "true".into()),
                ("zero.quantized_gradients".into(), "true".into()),
                (
                    "zero.hpz_partition_size".into(),
                    (world / nodes).to_string(),
                ),
                // qgZ chooses the gradients' wire format itself.
                ("train.reduce_dtype".into(), "f32".into()),
            ]);
        }
        let micros: Vec<usize> = match fixed_micro {
            true => vec![spec.train.micro_batch_size],
            false => (0..8).map(|i| 1usize << i).collect(),
        };
        for micro in micros {
            if !global.is_multiple_of(micro * world) {
                continue;
            }
            let accum = global / (micro * world);
            for ac in [false, true] {
                for off in &offloads {
                    for pp in &zeropp {
                        let mut sets = vec![
                            ("zero.stage".to_string(), stage.to_string()),
                            ("train.micro_batch_size".into(), micro.to_string()),
                            ("train.grad_accum".into(), accum.to_string()),
                            ("train.activation_checkpointing".into(), ac.to_string()),
                        ];
                        sets.extend(off.iter().cloned());
                        sets.extend(pp.iter().cloned());
                        out.push(sets);
                    }
                }
            }
        }
    }
    out
}

fn as_sets(sets: &[(String, String)]) -> Vec<String> {
    sets.iter().map(|(k, v)| format!("{k}={v}")).collect()
}

/// This host's available memory, bytes.
fn available_memory() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// `zrun plan`.
pub fn plan(args: PlanArgs) -> Result<ExitCode> {
    if let Some(out) = &args.out {
        crate::keep_existing("--out", std::slice::from_ref(out), args.overwrite)?;
    }
    let topo: Topology = topology(&args.launch)?;
    let mut base = load_job_with(&args.job, &args.set, args.deepspeed.as_deref())?;
    base.validate_on(&topo)?;
    if base.spec.device == Device::Cuda {
        return Err(Failure::bad_input(format!(
            "{}: device: cuda: zrun plan prices CPU workers from this host's measured figures; a GPU's are not measured, so it would predict nothing true (plan the job with device: cpu, or size it with zrun estimate)",
            args.job.display()
        )));
    }
    let world = topo.world_size();
    let nodes = topo.nodes.len();
    let per_node = topo.nodes.iter().map(|n| n.slots.len()).max().unwrap_or(1);
    let budget = match args.memory_gib {
        Some(g) if g > 0.0 => g * (1u64 << 30) as f64,
        Some(_) => return Err(Failure::bad_input("--memory-gib must be positive")),
        None => available_memory().unwrap_or(8.0 * (1u64 << 30) as f64) * 0.9 / per_node as f64,
    };
    let worker_bin = crate::bench::worker_bin(args.launch.worker_bin.clone())?;
    let mut machine = machine(per_node, args.remeasure, &worker_bin)?;
    let dtype = base.spec.train.dtype;
    if dtype != Dtype::F32 && !machine.sixteen.iter().any(|r| r.dtype == dtype) {
        say!("zrun: measuring {dtype} steps on this machine (once; cached with the figures)");
        let rates = measure_sixteen(&machine, dtype, &worker_bin)?;
        machine.sixteen.push(rates);
        cache(&machine)?;
    }
    // A ds_config's elasticity settles the micro-batch for the world size:
    // the candidates keep it.
    let elastic = base.deepspeed().is_some_and(|d| d.elasticity.is_some());
    let sets = candidate_sets(&base.spec, world, nodes, elastic);
    if sets.iter().any(|s| s.iter().any(|(_, v)| v == "nvme")) && machine.swap_gbps.is_none() {
        machine.swap_gbps = measure_swap(&base.spec);
    }
    let mut candidates = Vec::new();
    let (mut too_big, mut refused) = (0usize, Vec::new());
    for s in sets {
        let mut overrides = args.set.clone();
        overrides.extend(as_sets(&s));
        let job = load_job_with(&args.job, &overrides, args.deepspeed.as_deref())
            .and_then(|mut job| job.validate_on(&topo).map(|()| job));
        let job = match job {
            Ok(job) => job,
            Err(e) => {
                refused.push(e);
                continue;
            }
        };
        let states = worker_states(&job.spec, world);
        let kept = crate::estimate::kept(&job.spec);
        let threads = local_worker_threads(per_node);
        let memory = cpu_worker_peak_bytes(&job.spec, world, threads, kept);
        if memory > budget {
            too_big += 1;
            continue;
        }
        let setting = Setting {
            world,
            nodes,
            machine: &machine,
            link_gbps: args.link_gbps,
        };
        let parts = predict(&job.spec, &setting);
        let step_s: f64 = parts.iter().sum();
        let tokens = (job.spec.train.micro_batch_size
            * job.spec.train.grad_accum
            * job.spec.model.seq_len
            * world) as f64;
        candidates.push(Candidate {
            sets: s,
            memory,
            swap: states.nvme,
            step_s,
            parts,
            tokens_per_s: tokens / step_s,
            measured: None,
        });
    }
    if candidates.is_empty() {
        let why = match refused.first() {
            Some(e) => format!(
                ", {} refused by the job's checks, the first: {e}",
                refused.len()
            ),
            None => String::new(),
        };
        return Err(Failure::bad_input(format!(
            "no configuration of this job fits {:.2} GiB per worker ({too_big} too big{why}); raise --memory-gib, add workers or nodes, or give the job a swap directory (zero.offload_optimizer.nvme_path)",
            budget / (1u64 << 30) as f64
        )));
    }
    candidates.sort_by(|a, b| a.step_s.total_cmp(&b.step_s));
    if args.verify {
        verify(&args, &mut candidates)?;
    }
    let wire = base.spec.train.reduce_dtype.unwrap_or(Dtype::F32);
    print_table(&candidates, (args.top, budget, too_big), &machine, wire);
    if let Some(out) = &args.out {
        let mut overrides = args.set.clone();
        overrides.extend(as_sets(&candidates[0].sets));
        let best = load_job_with(&args.job, &overrides, args.deepspeed.as_deref())?;
        let yaml = format!(
            "# Written by `zrun plan {}`: the best of {} configurations that fit {:.2} GiB per worker\n# ({}), predicted {:.0} tokens/s on {} worker(s).\n{}",
            args.job.display(),
            candidates.len(),
            budget / (1u64 << 30) as f64,
            candidates[0].label(),
            candidates[0].tokens_per_s,
            world,
            serde_saphyr::to_string(&best.spec)?
        );
        zckpt::write_atomic(out, yaml.as_bytes())
            .map_err(|e| Failure::bad_input(format!("--out {}: {e}", out.display())))?;
        say!(
            "wrote {} (run it with `zrun train {}`)",
            out.display(),
            out.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The swap directory's bandwidth, GB/s: a 64 MiB file written, synced and
/// read back with direct I/O where the filesystem allows it.
fn measure_swap(spec: &JobSpec) -> Option<f64> {
    let dir = spec
        .zero
        .offload_optimizer
        .nvme_path
        .clone()
        .or_else(|| spec.zero.offload_param.nvme_path.clone())?;
    let path = Path::new(&dir).join(format!(".zrun-plan-probe-{}", std::process::id()));
    let data = vec![7u8; 64 << 20];
    let start = std::time::Instant::now();
    let ok = std::fs::File::create(&path).and_then(|mut f| {
        std::io::Write::write_all(&mut f, &data)?;
        f.sync_all()
    });
    let wrote = start.elapsed().as_secs_f64();
    let read = std::time::Instant::now();
    let back = std::fs::read(&path);
    let read_s = read.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&path);
    (ok.is_ok() && back.is_ok()).then(|| 2.0 * data.len() as f64 / (wrote + read_s) / 1e9)
}

/// Trains the best three for `--verify-steps` steps each and records their
/// median tokens/s.
fn verify(args: &PlanArgs, candidates: &mut [Candidate]) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let zrun = std::env::current_exe()?;
    for (i, c) in candidates.iter_mut().take(3).enumerate() {
        let metrics = dir.path().join(format!("verify-{i}.jsonl"));
        let mut cmd = std::process::Command::new(&zrun);
        cmd.arg("train")
            .arg(&args.job)
            .arg("--no-progress")
            .arg("--metrics")
            .arg(&metrics);
        if let Some(ds) = &args.deepspeed {
            cmd.arg("--deepspeed").arg(ds);
        }
        let mut sets = args.set.clone();
        sets.extend(as_sets(&c.sets));
        // The prediction is of whole sequences: a job's curriculum would
        // time its first, short steps (kept where `--set` names one).
        if !args.set.iter().any(|s| s.starts_with("train.curriculum")) {
            sets.push("train.curriculum=null".into());
        }
        // And of every block: progressive layer dropping would skip some
        // (kept where `--set` names it).
        if !(args.set.iter()).any(|s| s.starts_with("train.progressive_layer_drop")) {
            sets.push("train.progressive_layer_drop=null".into());
        }
        sets.push(format!("train.steps={}", args.verify_steps));
        sets.push("train.epochs=null".into());
        sets.push("checkpoint.dir=null".into());
        sets.push("flops_profiler=null".into());
        sets.push("comms_logger=null".into());
        sets.push("train.eval_every=0".into());
        for s in sets {
            cmd.arg("--set").arg(s);
        }
        cmd.args(crate::sweep::launch_flags(&args.launch));
        say!(
            "zrun: verifying {} ({} steps)",
            c.label(),
            args.verify_steps
        );
        let out = crate::child::output_of(cmd, &format!("verifying {}", c.label()))?;
        if !out.status.success() {
            eprint!("{}", String::from_utf8_lossy(&out.stderr));
            return Err(Failure {
                code: out.status.code().unwrap_or(1) as u8,
                message: format!("verifying {} failed", c.label()),
            }
            .into());
        }
        c.measured = Some(crate::sweep::row_from_metrics(Vec::new(), &metrics)?.tokens_per_s);
    }
    Ok(())
}

/// The best `top` of `c`, those that fit `budget` (`too_big` did not),
/// on `m`; `wire`: the job's own gradient wire type, where a candidate
/// leaves it.
fn print_table(
    c: &[Candidate],
    (top, budget, too_big): (usize, f64, usize),
    m: &Machine,
    wire: Dtype,
) {
    let gib = (1u64 << 30) as f64;
    say!(
        "machine {}: GEMM {:.1} GFLOP/s, triad {:.1} GB/s, AdamW {:.1} GB/s and between the products {:.2} GB/s of activations per worker{}",
        m.host,
        m.gemm_gflops,
        m.triad_gbps,
        m.adamw_gbps,
        m.between_gbps,
        m.busbw
            .iter()
            .filter(|(_, op, _)| op == "all_reduce")
            .map(|(t, _, bw)| match m.busbw(t, "all_reduce_bf16") {
                Some(half) => format!(", all-reduce {t} {bw:.2} GB/s (in bf16 {half:.2})"),
                None => format!(", all-reduce {t} {bw:.2} GB/s"),
            })
            .collect::<String>()
    );
    for r in &m.sixteen {
        say!(
            "{} steps: products {:.1} GFLOP/s, between them {:.2} GB/s of activations per worker (fitted from two {} steps)",
            r.dtype,
            r.gemm_gflops,
            r.between_gbps,
            r.dtype
        );
    }
    say!(
        "overheads: {:.0} µs per block and micro-batch, {:.0} µs per micro-batch, {:.2} ms per step",
        m.overheads.block_s * 1e6,
        m.overheads.micro_s * 1e6,
        m.overheads.step_s * 1e3
    );
    say!(
        "{} configurations fit {:.2} GiB per worker ({too_big} did not); best first:",
        c.len(),
        budget / gib
    );
    say!(
        "{:>3} {:>5} {:>5} {:>5} {:>5} {:>8} {:>7} {:>6} {:>9} {:>9} {:>10} {:>10} {:>8}",
        "#",
        "stage",
        "micro",
        "accum",
        "ckpt",
        "offload",
        "zero++",
        "grads",
        "mem GiB",
        "step ms",
        "pred tok/s",
        "meas tok/s",
        "meas/pred"
    );
    for (i, x) in c.iter().take(top.max(1)).enumerate() {
        let get = |k: &str| {
            x.sets
                .iter()
                .find(|(key, _)| key == k)
                .map_or("", |(_, v)| v.as_str())
        };
        let offload = match (
            get("zero.offload_optimizer.device"),
            get("zero.offload_param.device"),
        ) {
            ("nvme", "nvme") => "opt+par",
            ("nvme", _) => "opt",
            _ => "-",
        };
        let (meas, ratio) = match x.measured {
            Some(v) => (format!("{v:.0}"), format!("{:.2}", v / x.tokens_per_s)),
            None => ("-".into(), "-".into()),
        };
        say!(
            "{:>3} {:>5} {:>5} {:>5} {:>5} {:>8} {:>7} {:>6} {:>9.3} {:>9.1} {:>10.0} {:>10} {:>8}",
            i + 1,
            get("zero.stage"),
            get("train.micro_batch_size"),
            get("train.grad_accum"),
            if get("train.activation_checkpointing") == "true" {
                "on"
            } else {
                "off"
            },
            offload,
            match (
                get("zero.quantized_weights"),
                get("zero.hpz_partition_size")
            ) {
                ("true", _) => "all",
                (_, "" | "1") => "-",
                _ => "hpZ",
            },
            // The gradients' wire type: qgZ's blocks, or a float type.
            match get("zero.quantized_gradients") {
                "true" => "qgZ".to_string(),
                _ => match get("train.reduce_dtype") {
                    "" => wire.to_string(),
                    set => set.to_string(),
                },
            },
            x.memory / gib,
            x.step_s * 1e3,
            x.tokens_per_s,
            meas,
            ratio
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gemm_rate_is_zgemms_peak_not_the_fastest_gemm_row() {
        let row = |kernel: &str, threads, gflops| zproto::KernelRow {
            kernel: kernel.into(),
            elements: 0,
            threads,
            gbps: 0.0,
            gflops,
            ratio: 0.0,
        };
        let rows = [
            row("fma_peak", 2, 90.0),
            row("gemm_f32", 2, 80.0),
            row("gemm_crate_nn_2048x384x1152", 2, 85.0),
            row("zgemm_avx2_nn_2048x384x1152", 1, 44.0),
        ];
        assert_eq!(gemm_peak(&rows), Some(80.0));
        assert_eq!(gemm_peak(&rows[2..]), None);
    }

    fn machine() -> Machine {
        Machine {
            host: "test".into(),
            cpus: 2,
            workers: 2,
            gemm_gflops: 100.0,
            triad_gbps: 10.0,
            adamw_gbps: 5.0,
            busbw: vec![
                ("shm".into(), "all_reduce".into(), 2.0),
                ("shm".into(), "all_gather".into(), 2.0),
                ("shm".into(), "reduce_scatter".into(), 2.0),
            ],
            swap_gbps: None,
            overheads: Overheads {
                block_s: 1e-4,
                micro_s: 1e-4,
                step_s: 1e-3,
            },
            between_gbps: 2.0,
            sixteen: Vec::new(),
        }
    }

    fn spec(sets: &[&str]) -> JobSpec {
        let mut v = serde_json::json!({"model": {}, "data": {"format": "synthetic"}});
        for s in sets {
            let (k, val) = s.split_once('=').unwrap();
            let (a, b) = k.split_once('.').unwrap();
            v[a][b] = serde_json::from_str(val).unwrap();
        }
        serde_json::from_value(v).unwrap()
    }

    /// The rate between the products: the activation bytes over what is
    /// left of the step after its products at the workers' share of the
    /// GEMM rate and the overheads; the triad's share where nothing is left.
    #[test]
    fn the_rate_between_the_products_is_what_the_step_leaves() {
        let b = Between {
            workers: 2,
            gemm_gflops: 100.0,
            triad_gbps: 30.0,
            overheads: Overheads {
                block_s: 1e-4,
                micro_s: 2e-4,
                step_s: 1e-3,
            },
        };
        let job = spec(&[
            "model.vocab_size=256",
            "model.d_model=64",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.seq_len=64",
            "train.micro_batch_size=8",
        ]);
        let m = &job.model;
        let flops = 512.0 * (6.0 * model_params(m) + 12.0 * 2.0 * 64.0 * 64.0);
        let fixed = 2.0 * 1e-4 + 2e-4 + 1e-3;
        let (acts, _) = activation_bytes(m, 8, (false, Kept::F32));
        let step = flops / 50e9 + fixed + 0.004;
        let rate = b.rate(step, &job);
        assert!((rate - acts / 0.004 / 1e9).abs() < 1e-9 * rate, "{rate}");
        assert_eq!(b.rate(flops / 50e9, &job), 5.0, "the triad's share");
    }

    /// The arithmetic moves the way ZeRO says: stage 3 sends more than stage
    /// 0 with accumulation, partitioned stages update a slice, checkpointing
    /// recomputes, and one worker communicates nothing.
    #[test]
    fn predictions_follow_the_stages_arithmetic() {
        let m = machine();
        let s = Setting {
            world: 2,
            nodes: 1,
            machine: &m,
            link_gbps: None,
        };
        let at = |sets: &[&str]| predict(&spec(sets), &s);
        let z0 = at(&["zero.stage=0", "train.grad_accum=4"]);
        let z3 = at(&["zero.stage=3", "train.grad_accum=4"]);
        assert!(z3[4] > 3.0 * z0[4], "{z0:?} {z3:?}");
        assert!((z0[3] / at(&["zero.stage=1"])[3] - 2.0).abs() < 1e-9);
        assert!(z0[2] > at(&["train.grad_accum=1"])[2]);
        let ac = at(&["train.activation_checkpointing=true"]);
        assert!(ac[0] > z0[0] / 4.0 && ac[0] > at(&[])[0]);
        let one = predict(&spec(&[]), &Setting { world: 1, ..s });
        assert_eq!(one[4], 0.0);
    }

    /// `train.freeze` prices what the engine skips: the products by the
    /// model FLOPs a frozen job does, the optimizer by the elements that
    /// train, the reductions by the groups that train; the passes between
    /// the products as they were (they still run).
    #[test]
    fn frozen_parameters_cost_only_what_the_engine_does() {
        let m = machine();
        let s = Setting {
            world: 2,
            nodes: 1,
            machine: &m,
            link_gbps: None,
        };
        let base = ["model.n_layers=4", "zero.stage=2"];
        let plain = spec(&base);
        let model = &plain.model;
        let at = |freeze: &str| {
            let set = format!("train.freeze={freeze}");
            predict(&spec(&[base[0], base[1], &set]), &s)
        };
        let all = predict(&plain, &s);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9 * b;
        let patterns = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // Only what trains is reduced and shared after the step: BitFit's
        // biases, the upper half's parameters.
        for (freeze, fewer_reduced) in [
            (patterns(&["h.*.*.*.weight"]), true),
            (patterns(&["w*.weight", "h.{0-1}.*"]), true),
        ] {
            let got = at(&serde_json::to_string(&freeze).unwrap());
            let done = frozen_flops_per_token(model, &freeze) / frozen_flops_per_token(model, &[]);
            let t = trained_elements(model, &freeze);
            let psi = model_params(model);
            assert!(close(got[0], all[0] * done), "{freeze:?}: products");
            assert!(
                close(got[3], all[3] * t.trained / psi),
                "{freeze:?}: optimizer"
            );
            assert_eq!(
                got[4] < all[4],
                fewer_reduced,
                "{freeze:?}: {got:?} {all:?}"
            );
            assert_eq!(
                got[1], all[1],
                "{freeze:?}: the passes between the products"
            );
            assert!(done < 0.8, "{freeze:?}: {done}");
        }
    }

    /// The optimizer's time follows its bytes an element (AdamW 28, Lion 20,
    /// LAMB 40), and LAMB's two passes move 1.5 times AdamW's swap bytes.
    #[test]
    fn each_update_rule_costs_its_bytes() {
        let m = Machine {
            swap_gbps: Some(1.0),
            ..machine()
        };
        let s = Setting {
            world: 2,
            nodes: 1,
            machine: &m,
            link_gbps: None,
        };
        let nvme = r#"zero.offload_optimizer={"device": "nvme", "nvme_path": "/tmp"}"#;
        let at = |rule: &str| {
            let rule = format!(r#"train.optimizer={{"type": "{rule}"}}"#);
            predict(&spec(&["zero.stage=1", nvme, &rule]), &s)
        };
        let (adamw, lion, lamb) = (at("adamw"), at("lion"), at("lamb"));
        assert!((lion[3] / adamw[3] - 20.0 / 28.0).abs() < 1e-9, "{lion:?}");
        assert!((lamb[3] / adamw[3] - 40.0 / 28.0).abs() < 1e-9, "{lamb:?}");
        assert!(
            adamw[5] > 0.0 && (lamb[5] / adamw[5] - 1.5).abs() < 1e-9,
            "{lamb:?}"
        );
    }

    /// Two steps made from known rates give the rates back; steps that no
    /// positive pair explains (the larger model faster) give none, and the
    /// f32 figures stand.
    #[test]
    fn sixteen_bit_rates_are_fitted_from_two_steps() {
        let (gemm, between) = (300e9, 1.5e9);
        let step = |flops: f64, bytes: f64| [flops / gemm + bytes / between, flops, bytes];
        let rows = [step(2e8, 5e6), step(5e9, 2e7)];
        let r = fit_rates(Dtype::Bf16, &rows).unwrap();
        assert!((r.gemm_gflops / 300.0 - 1.0).abs() < 1e-9, "{r:?}");
        assert!((r.between_gbps / 1.5 - 1.0).abs() < 1e-9, "{r:?}");
        let noisy = [step(2e8, 5e6), [1e-4, 5e9, 2e7]];
        assert!(fit_rates(Dtype::Bf16, &noisy).is_none());
        // A bf16 job is priced at the fitted rates, an f32 one at f32's.
        let mut m = machine();
        m.sixteen.push(Rates {
            dtype: Dtype::Bf16,
            gemm_gflops: 200.0,
            between_gbps: 4.0,
        });
        let s = Setting {
            world: 1,
            nodes: 1,
            machine: &m,
            link_gbps: None,
        };
        let f32s = predict(&spec(&[]), &s);
        let bf16s = predict(&spec(&["train.dtype=\"bf16\""]), &s);
        assert!(
            (f32s[0] / bf16s[0] - 2.0).abs() < 1e-9,
            "{f32s:?} {bf16s:?}"
        );
        assert!(
            (f32s[1] / bf16s[1] - 2.0).abs() < 1e-9,
            "{f32s:?} {bf16s:?}"
        );
        let f16s = predict(&spec(&["train.dtype=\"f16\""]), &s);
        assert_eq!(f16s[0], f32s[0], "no f16 rates measured: f32's");
    }

    #[test]
    fn candidates_keep_the_global_batch() {
        let base = spec(&["train.micro_batch_size=4", "train.grad_accum=2"]);
        let sets = candidate_sets(&base, 2, 1, false);
        assert!(!sets.is_empty());
        for s in &sets {
            let get = |k: &str| -> usize {
                s.iter()
                    .find(|(key, _)| key == k)
                    .unwrap()
                    .1
                    .parse()
                    .unwrap()
            };
            assert_eq!(
                get("train.micro_batch_size") * get("train.grad_accum") * 2,
                16
            );
        }
        // Stages 0-3, micro 1, 2, 4, 8, checkpointing on and off; no ZeRO++
        // on one node, no swap without a swap directory.
        assert_eq!(sets.len(), 4 * 4 * 2);
        // An elastic batch's micro-batch (6, which no power of two is) alone.
        let elastic = spec(&["train.micro_batch_size=6", "train.grad_accum=140"]);
        let sets = candidate_sets(&elastic, 2, 1, true);
        assert_eq!(sets.len(), 4 * 2);
        for s in &sets {
            let get = |k: &str| s.iter().find(|(key, _)| key == k).unwrap().1.clone();
            assert_eq!(
                (get("train.micro_batch_size"), get("train.grad_accum")),
                ("6".into(), "140".into())
            );
        }
    }

    /// A job with LoCo (`zero.loco`, which needs qgZ) is offered every
    /// configuration: those that turn qgZ off turn LoCo off with it (they
    /// had all failed validation, and the plan had offered ZeRO++ alone),
    /// and ZeRO++'s keeps it.
    #[test]
    fn a_loco_job_is_offered_every_configuration() {
        let d = tempfile::tempdir().unwrap();
        let job = d.path().join("job.yaml");
        std::fs::write(
            &job,
            "model: {d_model: 32, n_heads: 4, n_layers: 2, seq_len: 16}\n\
             data: {format: synthetic}\n\
             zero: {stage: 3, quantized_gradients: true, loco: {}}\n",
        )
        .unwrap();
        let base = zconfig::load_job(&job, &[]).unwrap();
        let sets = candidate_sets(&base.spec, 4, 2, false);
        let mut with_loco = 0;
        for s in &sets {
            let mut j = zconfig::load_job(&job, &as_sets(s)).unwrap();
            j.validate(4).unwrap_or_else(|e| panic!("{s:?}: {e}"));
            let z = &j.spec.zero;
            assert_eq!(z.loco.is_some(), z.quantized_gradients, "{s:?}");
            with_loco += usize::from(z.loco.is_some());
        }
        assert!(with_loco > 0 && with_loco < sets.len(), "{with_loco}");
    }

    /// Across nodes stage 3 is offered as it is, with hpZ alone (lossless)
    /// and with all three parts of ZeRO++; a 16-bit job its gradients in f32
    /// and in its own type, never beside qgZ; an f32 job, or one node, keeps
    /// the job's.
    #[test]
    fn stage_3_across_nodes_is_offered_hpz_zeropp_and_sixteen_bit_reductions() {
        let offered = |sets: &[&str], nodes: usize| -> Vec<String> {
            let base = spec(sets);
            candidate_sets(&base, 4, nodes, false)
                .iter()
                .filter(|s| s.iter().any(|(k, v)| k == "zero.stage" && v == "3"))
                .filter(|s| {
                    s.iter()
                        .any(|(k, v)| k == "train.micro_batch_size" && v == "1")
                })
                .filter(|s| {
                    s.iter()
                        .any(|(k, v)| k == "train.activation_checkpointing" && v == "false")
                })
                .map(|s| {
                    let get = |k: &str| s.iter().find(|(key, _)| key == k).map_or("", |x| &x.1);
                    let wire = get("train.reduce_dtype");
                    match (
                        get("zero.quantized_gradients"),
                        get("zero.hpz_partition_size"),
                    ) {
                        ("true", hpz) => {
                            assert_eq!(wire, "f32", "qgZ sends its own format");
                            assert_eq!(hpz, (4 / nodes).to_string());
                            assert_eq!(get("zero.quantized_weights"), "true");
                            "all".to_string()
                        }
                        (_, "1") => wire.to_string(),
                        (_, hpz) => {
                            assert_eq!(hpz, (4 / nodes).to_string(), "a node's workers");
                            assert_eq!(get("zero.quantized_weights"), "false");
                            format!("hpZ {wire}")
                        }
                    }
                })
                .collect()
        };
        let sixteen = ["train.micro_batch_size=2", "train.dtype=\"bf16\""];
        assert_eq!(
            offered(&sixteen, 2),
            ["f32", "bf16", "hpZ f32", "hpZ bf16", "all"]
        );
        let half = ["train.micro_batch_size=2", "train.dtype=\"f16\""];
        assert_eq!(offered(&half, 2)[1], "f16");
        assert_eq!(offered(&sixteen, 1), [""]);
        assert_eq!(
            offered(&["train.micro_batch_size=2"], 2),
            ["", "hpZ ", "all"]
        );
    }

    /// hpZ: backward's gathers inside the node, at shared memory's rate over
    /// the node's ring, instead of across the link; the forward gathers and
    /// the gradients as stage 3's.
    #[test]
    fn hpz_prices_backward_gathers_inside_the_node() {
        let mut m = machine();
        m.busbw.extend([
            ("tcp".into(), "all_gather".into(), 2.0),
            ("tcp".into(), "reduce_scatter".into(), 2.0),
        ]);
        let s = Setting {
            world: 4,
            nodes: 2,
            machine: &m,
            link_gbps: Some(0.8),
        };
        let job = |sets: &[&str]| {
            let mut all = vec!["zero.stage=3", "zero.param_persistence_threshold=0"];
            all.extend(sets);
            spec(&all)
        };
        let plain = job(&[]);
        let comm = |spec: &JobSpec| predict(spec, &s)[4];
        let hpz = job(&["zero.hpz_partition_size=2"]);
        let psi = model_params(&plain.model);
        // What backward gathers: the groups that train (all of them here).
        let reached = trained_elements(&plain.model, &[]).with_grads / psi;
        let back = 4.0 * psi * reached;
        let saved = 0.75 * back / 0.1e9 - 0.5 * back / 2e9;
        let (a, b) = (comm(&plain), comm(&hpz));
        assert!((a - b - saved).abs() < 1e-9 * a, "{a} {b} {saved}");
    }

    /// 16-bit reductions: half the bytes on a slow link, but no faster than
    /// the 16-bit collective measured on the transport, which on a fast
    /// path makes them cost what f32's do, or more.
    #[test]
    fn sixteen_bit_reductions_are_priced_by_their_bytes_and_their_own_rate() {
        let mut m = machine();
        m.busbw.extend([
            ("tcp".into(), "all_reduce".into(), 2.0),
            ("tcp".into(), "all_gather".into(), 2.0),
            ("tcp".into(), "reduce_scatter".into(), 2.0),
            ("tcp".into(), "all_reduce_bf16".into(), 2.0),
            ("tcp".into(), "reduce_scatter_bf16".into(), 2.0),
            ("shm".into(), "all_reduce_bf16".into(), 1.0),
        ]);
        let on = |nodes: usize, link_gbps: Option<f64>| Setting {
            world: 4,
            nodes,
            machine: &m,
            link_gbps,
        };
        let comm = |sets: &[&str], s: &Setting| predict(&spec(sets), s)[4];
        let f32s = ["zero.stage=0", "train.dtype=\"bf16\""];
        let bf16s = [
            "zero.stage=0",
            "train.dtype=\"bf16\"",
            "train.reduce_dtype=\"bf16\"",
        ];
        // A 100 Mbit/s link: the wire bytes bound both, and 16 bits halve them.
        let slow = on(2, Some(0.1));
        assert!((comm(&bf16s, &slow) / comm(&f32s, &slow) - 0.5).abs() < 1e-9);
        // Loopback TCP: the 16-bit all-reduce ran at f32's rate in f32 bytes.
        let fast = on(2, None);
        assert!((comm(&bf16s, &fast) / comm(&f32s, &fast) - 1.0).abs() < 1e-9);
        // One host: shared memory's 16-bit all-reduce ran at half f32's rate.
        let host = on(1, None);
        assert!((comm(&bf16s, &host) / comm(&f32s, &host) - 2.0).abs() < 1e-9);
    }
}
