//! Helpers shared by the engine's integration tests: small job specs, TCP
//! communicators on loopback, and training every rank in its own thread.

#![allow(dead_code)] // each test binary uses its own subset

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use zckpt::{Checkpoint, FileEntry, GroupEntry, LossScaleState, Manifest};
use zcomm::{
    Communicator, CounterSnapshot, Half, Quantization, SharedFeedback, TcpCommunicator, TcpOptions,
    Work,
};
use zconfig::JobSpec;
use zengine::{Engine, ProcessGroups};
use zmodel::{Batcher, Corpus};
use zproto::{Op, Token};

pub fn spec(accum: usize, bucket: u64, overlap: bool) -> JobSpec {
    typed_spec("f32", 0, accum, bucket, overlap, false, 6)
}

pub fn typed_spec(
    dtype: &str,
    stage: u8,
    accum: usize,
    bucket: u64,
    overlap: bool,
    ckpt: bool,
    steps: u64,
) -> JobSpec {
    let yaml = format!(
        "model: {{vocab_size: 64, d_model: 32, n_layers: 2, n_heads: 4, seq_len: 16}}\n\
         data: {{format: synthetic}}\n\
         train: {{steps: {steps}, micro_batch_size: 4, grad_accum: {accum}, lr: 3.0e-3, warmup_steps: 2, activation_checkpointing: {ckpt}, dtype: {dtype}}}\n\
         zero: {{stage: {stage}, reduce_bucket_size: {bucket}, overlap_comm: {overlap}, prefetch_bucket_size: 3000, param_persistence_threshold: 100}}\n"
    );
    yaml.parse().unwrap()
}

pub fn comms(n: usize) -> Vec<Arc<dyn Communicator>> {
    comms_on(&vec![0; n], "world")
}

/// Communicators of one group on loopback; `node_of_rank[r]` is rank r's
/// node (for the intra/inter-node byte counts).
pub fn comms_on(node_of_rank: &[usize], group: &str) -> Vec<Arc<dyn Communicator>> {
    comms_over(node_of_rank, group, false)
}

/// Segments made by this test process so far (each gets its own name).
static SEGMENTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// [`comms_on`]; with `shared_memory`, ranks of a node talk through a shared
/// segment (on one node: the direct path, whose sums add in rank order).
pub fn comms_over(
    node_of_rank: &[usize],
    group: &str,
    shared_memory: bool,
) -> Vec<Arc<dyn Communicator>> {
    let n = node_of_rank.len();
    let id = SEGMENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let token = Token::generate();
    let ls: Vec<_> = (0..n)
        .map(|_| TcpCommunicator::bind("127.0.0.1").unwrap())
        .collect();
    let addrs: Vec<_> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    let hs: Vec<_> = ls
        .into_iter()
        .enumerate()
        .map(|(r, l)| {
            let addrs = addrs.clone();
            let o = TcpOptions {
                token: token.clone(),
                timeout: Duration::from_secs(30),
                node_of_rank: node_of_rank.to_vec(),
                group: group.into(),
                shm: shared_memory.then(|| {
                    format!(
                        "zengine-test-{}-{id}-n{}",
                        std::process::id(),
                        node_of_rank[r]
                    )
                }),
                single_copy: true,
            };
            std::thread::spawn(move || {
                Arc::new(TcpCommunicator::connect(r, l, &addrs, o).unwrap())
                    as Arc<dyn Communicator>
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// What one rank saw of a run. Equality compares what the arithmetic
/// decides (losses, norms, scales, parameters), not where memory was held.
#[derive(Debug, Clone)]
pub struct Run {
    pub losses: Vec<f64>,
    /// Per step: the global gradient norm.
    pub norms: Vec<f64>,
    /// Per step: the learning rate used.
    pub lrs: Vec<f64>,
    /// Per step: LAMB's trust ratios (none for the other rules).
    pub trust_ratios: Vec<Option<zengine::TrustRatios>>,
    /// The most gradient bytes held in memory at the end of a step.
    pub grads_held: u64,
    /// The most bytes of optimizer moments held in memory at the end of a
    /// step.
    pub optimizer_held: u64,
    /// Bytes of this rank's swap files (NVMe offload).
    pub nvme: u64,
    /// Final f32 parameters (master weights under mixed precision).
    pub params: Vec<Vec<f32>>,
    /// Per step: the loss scale used and whether the step was skipped.
    pub scales: Vec<(Option<f64>, bool)>,
    /// Per step: every parameter after it (only when asked for).
    pub history: Vec<Vec<Vec<f32>>>,
    /// What rank 0 needs of every rank to write the manifest, when saved.
    pub saved: Option<Saved>,
    /// Bytes this rank sent in all-gathers (every group).
    pub all_gather_bytes: u64,
    /// Bytes this rank sent, every group together.
    pub counters: CounterSnapshot,
    /// hpZ: bytes this rank sent in its hpZ group.
    pub hpz_counters: Option<CounterSnapshot>,
    /// hpZ: the most bytes of secondary shards held in a step.
    pub secondary: u64,
    /// Every group's padded length.
    pub padded: Vec<usize>,
    /// Final parameters whole, by name (tiles put back together).
    pub named: zckpt::Weights,
    /// The most bytes of gathered parameters, staged gradients and buckets in
    /// flight in a step.
    pub comm_peak: u64,
    /// The most bytes of activations a step kept for backward.
    pub activations: u64,
    /// The engine's model FLOPs per token (`Engine::flops_per_token`).
    pub flops_per_token: f64,
    /// Per step, under progressive layer dropping: the blocks its
    /// micro-batches ran, on average.
    pub blocks_run: Vec<Option<f64>>,
}

/// A rank's part of a checkpoint it wrote.
#[derive(Debug, Clone)]
pub struct Saved {
    pub file: FileEntry,
    /// LoCo's kept errors, where the run has them.
    pub feedback: Option<FileEntry>,
    pub groups: Vec<GroupEntry>,
    pub loss_scale: Option<LossScaleState>,
    pub step: u64,
}

impl PartialEq for Run {
    fn eq(&self, o: &Run) -> bool {
        (
            &self.losses,
            &self.norms,
            &self.params,
            &self.scales,
            &self.history,
        ) == (&o.losses, &o.norms, &o.params, &o.scales, &o.history)
    }
}

/// How far `got` moved each parameter from where `start` had it, against
/// where `want` moved it: the worst ‖Δgot − Δwant‖ / ‖Δwant‖ over the
/// parameters (rank 0's whole parameters, by name), and that parameter.
pub fn worst_move_apart(start: &Run, want: &Run, got: &Run) -> (f64, String) {
    let norm = |x: &mut dyn Iterator<Item = f64>| x.map(|v| v * v).sum::<f64>().sqrt();
    let mut worst = (0f64, String::new());
    for (name, (_, p0)) in &start.named {
        let moved = |run: &Run| -> Vec<f64> {
            run.named[name]
                .1
                .iter()
                .zip(p0)
                .map(|(a, b)| f64::from(a - b))
                .collect()
        };
        let (want, got) = (moved(want), moved(got));
        let off = norm(&mut got.iter().zip(&want).map(|(a, b)| a - b));
        let rel = off / norm(&mut want.iter().copied());
        if rel > worst.0 {
            worst = (rel, name.clone());
        }
    }
    worst
}

/// Trains on every rank in parallel; returns what each rank saw.
pub fn train(spec: JobSpec, world: usize) -> Vec<Run> {
    train_observed(spec, world, false)
}

pub fn train_observed(spec: JobSpec, world: usize, history: bool) -> Vec<Run> {
    let leg = Leg {
        history,
        ..Leg::default()
    };
    train_leg(spec, world, &leg)
}

/// Part of a run, for resuming.
#[derive(Default)]
pub struct Leg<'a> {
    /// Start from this checkpoint (else from scratch).
    pub resume: Option<&'a Path>,
    /// Stop after this many steps (else `train.steps`).
    pub until: Option<u64>,
    /// Then save a checkpoint here, as zworker does: every rank its shard,
    /// then the manifest.
    pub save: Option<&'a Path>,
    /// Record every parameter after every step.
    pub history: bool,
    /// Node of every rank (else all on node 0); with hpZ, group k is ranks
    /// k·P..(k+1)·P.
    pub nodes: Option<Vec<usize>>,
    /// Ranks of a node talk through shared memory.
    pub shared_memory: bool,
    /// Each step takes its micro-batches last first.
    pub reverse_micro_batches: bool,
    /// This rank (in the world group) launches every reduction this long
    /// late: the other ranks' reductions wait on it while their backward
    /// runs ahead.
    pub lagging: Option<(usize, Duration)>,
}

/// A communicator whose reductions leave `lag` late: the caller sleeps
/// before each is launched (everything else passes straight through).
struct Lagging {
    inner: Arc<dyn Communicator>,
    lag: Duration,
}

impl Communicator for Lagging {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn group_name(&self) -> &str {
        self.inner.group_name()
    }
    fn counters(&self) -> CounterSnapshot {
        self.inner.counters()
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn in_flight(&self) -> Option<zcomm::InFlight> {
        self.inner.in_flight()
    }
    fn take_op_log(&self) -> Vec<zcomm::OpTally> {
        self.inner.take_op_log()
    }
    fn all_reduce_async(&self, buf: Vec<f32>) -> Work<Vec<f32>> {
        std::thread::sleep(self.lag);
        self.inner.all_reduce_async(buf)
    }
    fn reduce_scatter_async(&self, buf: Vec<f32>) -> Work<Vec<f32>> {
        std::thread::sleep(self.lag);
        self.inner.reduce_scatter_async(buf)
    }
    fn quantized_reduce_scatter_async(
        &self,
        buf: Vec<f32>,
        q: Quantization,
        feedback: Option<SharedFeedback>,
    ) -> Work<Vec<f32>> {
        std::thread::sleep(self.lag);
        self.inner.quantized_reduce_scatter_async(buf, q, feedback)
    }
    fn half_reduce_scatter_async(&self, buf: Vec<f32>, half: Half) -> Work<Vec<f32>> {
        std::thread::sleep(self.lag);
        self.inner.half_reduce_scatter_async(buf, half)
    }
    fn half_all_reduce_async(&self, buf: Vec<f32>, half: Half) -> Work<Vec<f32>> {
        std::thread::sleep(self.lag);
        self.inner.half_all_reduce_async(buf, half)
    }
    fn all_gather_async(&self, chunk: Vec<f32>, total_len: usize) -> Work<Vec<f32>> {
        self.inner.all_gather_async(chunk, total_len)
    }
    fn all_gather_in_place_async(&self, buf: Vec<f32>) -> Work<Vec<f32>> {
        self.inner.all_gather_in_place_async(buf)
    }
    fn all_gather16_async(&self, chunk: Vec<u16>, total_len: usize) -> Work<Vec<u16>> {
        self.inner.all_gather16_async(chunk, total_len)
    }
    fn all_gather16_in_place_async(&self, buf: Vec<u16>) -> Work<Vec<u16>> {
        self.inner.all_gather16_in_place_async(buf)
    }
    fn all_to_all_async(&self, pieces: Vec<Vec<u8>>) -> Work<Vec<Vec<u8>>> {
        self.inner.all_to_all_async(pieces)
    }
    fn broadcast_async(&self, buf: Vec<u8>, root: usize) -> Work<Vec<u8>> {
        self.inner.broadcast_async(buf, root)
    }
    fn barrier_async(&self) -> Work<()> {
        self.inner.barrier_async()
    }
}

/// Every rank's process groups: the world on `nodes`, and with hpZ of P
/// ranks, group k of ranks k·P..(k+1)·P.
pub fn process_groups(nodes: &[usize], hpz: usize, shared_memory: bool) -> Vec<ProcessGroups> {
    let world = comms_over(nodes, "world", shared_memory);
    let mut hpz_groups: Vec<Option<Arc<dyn Communicator>>> = vec![None; nodes.len()];
    if hpz > 1 {
        for (k, members) in nodes.chunks(hpz).enumerate() {
            for (i, c) in comms_on(members, &format!("hpz{k}"))
                .into_iter()
                .enumerate()
            {
                hpz_groups[k * hpz + i] = Some(c);
            }
        }
    }
    world
        .into_iter()
        .zip(hpz_groups)
        .map(|(world, hpz)| ProcessGroups { world, hpz })
        .collect()
}

/// Trains `leg` of `spec` on every rank in parallel; returns what each rank saw.
pub fn train_leg(spec: JobSpec, world: usize, leg: &Leg) -> Vec<Run> {
    let ckpt = leg.resume.map(|dir| Checkpoint::open(dir).unwrap());
    let (history, save, reverse) = (leg.history, leg.save, leg.reverse_micro_batches);
    let until = leg.until.unwrap_or(spec.train.steps);
    let nodes = leg.nodes.clone().unwrap_or_else(|| vec![0; world]);
    assert_eq!(nodes.len(), world);
    let hs: Vec<_> = process_groups(&nodes, spec.zero.hpz_partition_size, leg.shared_memory)
        .into_iter()
        .enumerate()
        .map(|(rank, mut groups)| {
            if let Some((_, lag)) = leg.lagging.filter(|&(r, _)| r == rank) {
                let inner = groups.world.clone();
                groups.world = Arc::new(Lagging { inner, lag });
            }
            let (spec, ckpt) = (spec.clone(), ckpt.clone());
            let save = save.map(Path::to_path_buf);
            std::thread::spawn(move || {
                let t = &spec.train;
                let corpus = Corpus::synthetic(spec.model.vocab_size, t.seed);
                let mut data = Batcher::new(
                    corpus,
                    spec.model.seq_len,
                    t.micro_batch_size,
                    t.grad_accum,
                    world,
                    rank,
                    t.seed,
                )
                .unwrap();
                let (comm, hpz) = (groups.world.clone(), groups.hpz.clone());
                let job = format!("{}-{}", spec.name, std::process::id());
                let mut engine = Engine::with_groups(&spec, groups, &job).unwrap();
                if let Some(ckpt) = &ckpt {
                    engine.load(ckpt).unwrap();
                }
                let mut run = Run {
                    losses: Vec::new(),
                    norms: Vec::new(),
                    lrs: Vec::new(),
                    trust_ratios: Vec::new(),
                    grads_held: 0,
                    optimizer_held: 0,
                    nvme: 0,
                    params: Vec::new(),
                    scales: Vec::new(),
                    history: Vec::new(),
                    saved: None,
                    all_gather_bytes: 0,
                    counters: CounterSnapshot::default(),
                    hpz_counters: None,
                    secondary: 0,
                    padded: engine.manifest_groups().iter().map(|g| g.padded).collect(),
                    named: Default::default(),
                    comm_peak: 0,
                    activations: 0,
                    flops_per_token: engine.flops_per_token(),
                    blocks_run: Vec::new(),
                };
                for s in engine.steps_done()..until {
                    for a in 0..t.grad_accum {
                        let a = if reverse { t.grad_accum - 1 - a } else { a };
                        engine.forward_backward(&data.batch(s, a).unwrap()).unwrap();
                    }
                    let st = engine.step().unwrap();
                    run.losses.push(st.loss);
                    run.norms.push(st.grad_norm);
                    run.lrs.push(st.lr);
                    run.trust_ratios.push(st.trust_ratio);
                    run.blocks_run.push(st.layer_drop.map(|l| l.blocks_run));
                    run.grads_held = run.grads_held.max(st.mem.grads);
                    run.optimizer_held = run.optimizer_held.max(st.mem.optimizer);
                    run.nvme = st.mem.nvme;
                    run.secondary = run.secondary.max(st.mem.secondary);
                    run.comm_peak = run.comm_peak.max(st.mem.comm_buffers);
                    run.activations = run.activations.max(st.mem.activations);
                    run.scales.push((st.loss_scale, st.skipped));
                    if history {
                        run.history.push(engine.full_params().unwrap());
                    }
                }
                if let Some(dir) = save {
                    let groups = engine.manifest_groups();
                    let lens: Vec<usize> = groups.iter().map(|g| g.padded / world).collect();
                    let kinds = engine.checkpoint_kinds();
                    let file =
                        zckpt::write_shard(&dir, rank, kinds, &lens, |g| engine.own_slice(g))
                            .unwrap();
                    let feedback = (engine.feedback_state())
                        .map(|b| zckpt::write_feedback(&dir, rank, &b).unwrap());
                    run.saved = Some(Saved {
                        file,
                        feedback,
                        groups,
                        loss_scale: engine.loss_scale_state(),
                        step: engine.steps_done(),
                    });
                }
                run.hpz_counters = hpz.map(|h| h.counters());
                run.counters = comm.counters().plus(&run.hpz_counters.unwrap_or_default());
                run.all_gather_bytes = run.counters.op(Op::AllGather);
                run.params = engine.full_params().unwrap();
                run.named = engine.named_params().unwrap();
                run
            })
        })
        .collect();
    let runs: Vec<Run> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    if let Some(dir) = save {
        let first = runs[0].saved.clone().unwrap();
        let manifest = Manifest {
            val_loss: None,
            early_stopping: None,
            plateau: None,
            optimizer: spec.train.optimizer.kind,
            format: zckpt::FORMAT,
            model: spec.model.clone(),
            world_size: world,
            nodes: 1,
            stage: spec.zero.stage.number(),
            dtype: spec.train.dtype,
            step: first.step,
            samples_consumed: 0,
            loss_scale: first.loss_scale,
            groups: first.groups,
            files: runs.iter().map(|r| r.saved.clone().unwrap().file).collect(),
            feedback: (runs.iter())
                .filter_map(|r| r.saved.clone().unwrap().feedback)
                .collect(),
        };
        zckpt::write_manifest(dir, &manifest).unwrap();
    }
    runs
}
