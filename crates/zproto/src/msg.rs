//! Control-plane messages between zrun (server) and zworker (client).
//!
//! The handshake is: server `Challenge` → client `Hello` (its proof, and a nonce of
//! its own) → server `Welcome` (the server's proof, the task, the topology). After
//! that the client reports (`Heartbeat`, `Report`, `BenchRows`, `Failed`, `Done`)
//! and uses the key-value store (`KvSet`, `KvGet`, `KvWait`, like torch's TCPStore);
//! the server may send `Abort` at any time.
//!
//! In per-node mode (`zrun train --nnodes`) the zrun of every other node joins
//! node 0's zrun the same way, with `NodeHello` and `NodeWelcome` under contexts
//! of their own, then relays its workers' output and exits (`NodeOutput`,
//! `NodeExited`) and is told `Abort` and, at the end, `Finished`.

use serde::{Deserialize, Serialize};
use zconfig::JobSpec;

use crate::auth::{Nonce, Proof};

/// Auth context of the control plane.
pub const CONTROL_CONTEXT: &str = "zrun-control-v1";
/// Auth context of the server's answer to the client.
pub const SERVER_CONTEXT: &str = "zrun-server-v1";
/// Auth context of a node's zrun joining node 0's (per-node mode).
pub const NODE_CONTEXT: &str = "zrun-node-v1";
/// Auth context of node 0's answer to a node's zrun.
pub const NODE_SERVER_CONTEXT: &str = "zrun-node-server-v1";

/// Worker → zrun.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ToServer {
    /// Answer to the challenge.
    Hello {
        /// Claimed rank.
        rank: u64,
        /// Job the worker belongs to.
        job_id: String,
        /// `HMAC(token, CONTROL_CONTEXT | server nonce | rank)`.
        proof: Proof,
        /// The worker's challenge for zrun.
        nonce: Nonce,
        /// The worker's process id (for diagnostics).
        pid: u32,
        /// The host the worker runs on.
        hostname: String,
    },
    /// Still alive; `op` names the collective the worker is waiting in, if any.
    Heartbeat {
        /// Current operation, for hang diagnosis.
        op: Option<String>,
    },
    /// One optimizer step done.
    Report(Box<StepReport>),
    /// `flops_profiler`: rank 0's module-by-module account of the profiled
    /// step, sent after that step's report.
    Profile(Box<FlopsProfile>),
    /// Results of `bench comm`.
    BenchRows(Vec<BenchRow>),
    /// Results of `bench kernels`.
    KernelRows(Vec<KernelRow>),
    /// Store `value` under `key`.
    KvSet {
        /// Key.
        key: String,
        /// Value.
        value: String,
    },
    /// Look up `key` now.
    KvGet {
        /// Key.
        key: String,
    },
    /// Wait until every key exists, at most `timeout_ms`.
    KvWait {
        /// Keys.
        keys: Vec<String>,
        /// Deadline.
        timeout_ms: u64,
    },
    /// The worker failed and is exiting.
    Failed {
        /// What happened.
        message: String,
    },
    /// The worker finished its task and will exit 0.
    Done,
    /// The job was asked to stop (SIGUSR1): the worker saved the checkpoint
    /// of `step`, ended early and will exit 0 (instead of `Done`).
    Stopped {
        /// The last step trained, whose checkpoint was saved.
        step: u64,
    },
    /// `train.early_stopping` ended training after `step` (its checkpoint
    /// saved where the job has a directory): the validation loss has not
    /// improved on `best_val_loss` (at `best_step`) for its patience. The
    /// worker will exit 0 (instead of `Done`).
    EarlyStopped {
        /// The last step trained.
        step: u64,
        /// The step of the best validation loss.
        best_step: u64,
        /// The best validation loss.
        best_val_loss: f64,
    },
    /// Per-node mode: a node's zrun answers the challenge (instead of `Hello`).
    NodeHello {
        /// Its node rank (1 or more: node 0 is the head).
        node: u64,
        /// `HMAC(token, NODE_CONTEXT | server nonce | node)`.
        proof: Proof,
        /// Its challenge for the head.
        nonce: Nonce,
        /// Its process id (for diagnostics).
        pid: u32,
        /// The host it runs on.
        hostname: String,
        /// How many workers it will start.
        workers: u64,
    },
    /// Per-node mode: a line a node's worker printed.
    NodeOutput {
        /// The worker's rank.
        rank: u64,
        /// The line, without its newline.
        line: String,
        /// From stderr (else stdout).
        stderr: bool,
    },
    /// Per-node mode: a node's worker ended.
    NodeExited {
        /// The worker's rank.
        rank: u64,
        /// Its raw wait status (as `waitpid` gives it).
        status: i32,
    },
    /// Per-node mode: a node's zrun is stopping the job (a signal there, or a
    /// job that is not node 0's).
    NodeStopping {
        /// Why.
        reason: String,
        /// The job's exit code for it (130 for a signal, 2 for bad input).
        code: u8,
    },
}

/// zrun → worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ToWorker {
    /// Prove you know the token.
    Challenge {
        /// Fresh nonce.
        nonce: Nonce,
    },
    /// Authenticated: here is the work.
    Welcome(Box<Welcome>),
    /// Answer to `KvGet`.
    KvValue {
        /// Key.
        key: String,
        /// Value, if set.
        value: Option<String>,
    },
    /// Answer to `KvWait`: values in the order asked, or the keys still missing.
    KvWaited {
        /// `Ok(values)` or `Err(missing keys)` at the deadline.
        result: Result<Vec<String>, Vec<String>>,
    },
    /// Save a checkpoint after the step in progress and end (zrun got
    /// SIGUSR1: a preemption notice).
    Stop,
    /// Stop now.
    Abort {
        /// Why.
        reason: String,
    },
    /// Per-node mode: the head's answer to `NodeHello`.
    NodeWelcome(Box<NodeWelcome>),
    /// Per-node mode: the job is over and every worker gone; exit with `code`.
    Finished {
        /// The job's exit code.
        code: u8,
    },
    /// Nothing to do: sent after zrun was stopped, so that the worker's kernel
    /// learns from its acknowledgement that zrun reads again (see zrun's
    /// supervisor, `PROBE_MAX`).
    Ping,
}

/// What a node's zrun learns once authenticated (per-node mode).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeWelcome {
    /// `HMAC(token, NODE_SERVER_CONTEXT | node nonce | node)`.
    pub server_proof: Proof,
    /// The job id its workers must give.
    pub job_id: String,
    /// The workers' task (the node checks that its own job file says the same).
    pub task: Task,
}

/// What a worker learns once authenticated.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Welcome {
    /// `HMAC(token, SERVER_CONTEXT | worker nonce | rank)`: zrun knows the token too.
    pub server_proof: Proof,
    /// Node index of every rank.
    pub node_of_rank: Vec<usize>,
    /// What to do.
    pub task: Task,
}

/// A worker's task.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Task {
    /// Train the job.
    Train(Box<TrainTask>),
    /// Measure collectives.
    BenchComm(BenchCommTask),
    /// Measure CPU kernels against memory bandwidth.
    BenchKernels {
        /// Elements per array.
        elements: usize,
        /// Only the GEMM peak (`gemm_f32`), what a sweep's MFU is computed
        /// against.
        #[serde(default)]
        gemm_peak_only: bool,
    },
}

/// One row of `bench kernels`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelRow {
    /// Kernel name.
    pub kernel: String,
    /// Elements (or matrix size for GEMM).
    pub elements: usize,
    /// Threads used.
    pub threads: usize,
    /// Bytes the kernel must read and write, per second, in GB/s.
    pub gbps: f64,
    /// Floating-point operations per second, in GFLOP/s.
    pub gflops: f64,
    /// gbps over the triad's gbps at the same thread count.
    pub ratio: f64,
}

/// A training job, and where to resume it from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainTask {
    /// The resolved spec.
    pub spec: JobSpec,
    /// A verified checkpoint directory to resume from.
    pub resume: Option<String>,
}

/// Parameters of `zrun bench comm`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchCommTask {
    /// Ops by name.
    pub ops: Vec<String>,
    /// Message sizes in bytes.
    pub sizes: Vec<u64>,
    /// Transport.
    pub transport: String,
    /// Deadline per collective, seconds.
    pub timeout_s: f64,
}

/// One row of `bench comm`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchRow {
    /// Collective.
    pub op: String,
    /// Message size in bytes.
    pub bytes: u64,
    /// Ranks.
    pub workers: usize,
    /// Transport.
    pub transport: String,
    /// Median time per call, microseconds.
    pub time_us: f64,
    /// bytes / time.
    pub algbw_gbps: f64,
    /// nccl-tests bus bandwidth.
    pub busbw_gbps: f64,
}

/// Memory held by one rank, by category (`mem_bytes` in docs/CONFIG.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemBytes {
    /// Working parameters.
    pub params: u64,
    /// Gradients.
    pub grads: u64,
    /// f32 master weights (mixed precision only).
    pub master: u64,
    /// Optimizer moments.
    pub optimizer: u64,
    /// Activations kept for backward.
    pub activations: u64,
    /// Buckets and gathered parameters in flight.
    pub comm_buffers: u64,
    /// Offload staging buffers.
    pub offload_buffers: u64,
    /// Peak resident set size of the process.
    pub peak_rss: u64,
    /// NVMe offload: bytes of the rank's swap files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvme: Option<u64>,
    /// ZeRO++ hpZ: peak of the secondary weight shards held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secondary: Option<u64>,
}

impl MemBytes {
    /// Field-wise maximum.
    pub fn max(self, o: MemBytes) -> MemBytes {
        MemBytes {
            params: self.params.max(o.params),
            grads: self.grads.max(o.grads),
            master: self.master.max(o.master),
            optimizer: self.optimizer.max(o.optimizer),
            activations: self.activations.max(o.activations),
            comm_buffers: self.comm_buffers.max(o.comm_buffers),
            offload_buffers: self.offload_buffers.max(o.offload_buffers),
            peak_rss: self.peak_rss.max(o.peak_rss),
            nvme: self.nvme.max(o.nvme),
            secondary: self.secondary.max(o.secondary),
        }
    }
}

/// One rank's swap I/O during one step (NVMe offload).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct IoReport {
    /// Bytes read from swap files.
    pub read_bytes: u64,
    /// Bytes written to swap files.
    pub write_bytes: u64,
    /// Seconds the step waited for swap I/O.
    pub wait_s: f64,
    /// Seconds at least one swap transfer was in flight.
    pub busy_s: f64,
}

impl IoReport {
    /// The share of I/O time the step did not wait for: `1 - wait / busy`.
    pub fn hidden(&self) -> f64 {
        if self.busy_s <= 0.0 {
            return 1.0;
        }
        (1.0 - self.wait_s / self.busy_s).clamp(0.0, 1.0)
    }
}

/// Bytes sent by one rank during one step (`comm_bytes` in docs/CONFIG.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommBytes {
    /// To ranks on the same node.
    pub intra_node: u64,
    /// To ranks on other nodes.
    pub inter_node: u64,
    /// By collective.
    pub by_op: OpBytes,
}

/// One value per collective: bytes sent ([`OpBytes`]) or milliseconds waited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(bound(deserialize = "T: Deserialize<'de> + Default"))]
pub struct ByOp<T> {
    /// all_reduce.
    pub all_reduce: T,
    /// reduce_scatter.
    pub reduce_scatter: T,
    /// all_gather.
    pub all_gather: T,
    /// all_to_all.
    pub all_to_all: T,
    /// broadcast.
    pub broadcast: T,
    /// ZeRO++ qgZ's quantized reduce-scatter.
    #[serde(default)]
    pub quantized_reduce_scatter: T,
}

/// Bytes sent by collective.
pub type OpBytes = ByOp<u64>;

impl<T: PartialOrd + Copy> ByOp<T> {
    /// Field-wise maximum.
    pub fn max(self, o: ByOp<T>) -> ByOp<T> {
        let max = |a: T, b: T| if b > a { b } else { a };
        ByOp {
            all_reduce: max(self.all_reduce, o.all_reduce),
            reduce_scatter: max(self.reduce_scatter, o.reduce_scatter),
            all_gather: max(self.all_gather, o.all_gather),
            all_to_all: max(self.all_to_all, o.all_to_all),
            broadcast: max(self.broadcast, o.broadcast),
            quantized_reduce_scatter: max(
                self.quantized_reduce_scatter,
                o.quantized_reduce_scatter,
            ),
        }
    }
}

impl CommBytes {
    /// Field-wise maximum.
    pub fn max(self, o: CommBytes) -> CommBytes {
        CommBytes {
            intra_node: self.intra_node.max(o.intra_node),
            inter_node: self.inter_node.max(o.inter_node),
            by_op: self.by_op.max(o.by_op),
        }
    }
}

/// Where one rank's step went, in milliseconds (`time_ms` in
/// docs/CONFIG.md): DeepSpeed's `wall_clock_breakdown`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTimesMs {
    /// The micro-batches' forward passes (embedding and blocks).
    pub forward: f64,
    /// Their backward passes (the head's loss and gradient, blocks, embedding).
    pub backward: f64,
    /// The optimizer step: the last reductions, gradient norm, clipping,
    /// AdamW, sharing updated parameters.
    pub optimizer: f64,
    /// The rest of the step (loading batches): `step_ms` less the three above.
    pub other: f64,
    /// Blocked waiting for collectives, inside the phases above:
    /// communication that compute did not hide, and waiting for slower ranks.
    pub comm_wait: f64,
    /// `comm_wait` by collective (a barrier's wait counts in the total only).
    pub comm_wait_by_op: ByOp<f64>,
}

/// One rank's account of one optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    /// 1-based step.
    pub step: u64,
    /// Passes over the training data once the step is done: the global
    /// sequences consumed over the sequences of an epoch (transformers'
    /// `epoch`).
    #[serde(default)]
    pub epoch: f64,
    /// Mean loss over this rank's micro-batches.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping; `None` when f16 gradients
    /// overflowed and the step was skipped.
    pub grad_norm: Option<f64>,
    /// Wall time of the step on this rank.
    pub step_ms: f64,
    /// Tokens this rank processed.
    pub tokens: u64,
    /// Model FLOPs this rank performed (6N + attention per token, forward + backward).
    pub flops: f64,
    /// Model parameters.
    pub params: u64,
    /// ZeRO stage.
    pub zero_stage: u8,
    /// Memory by category.
    pub mem: MemBytes,
    /// Bytes sent during the step.
    pub comm: CommBytes,
    /// Where the step's time went.
    #[serde(default)]
    pub times: StepTimesMs,
    /// f16 loss scale.
    pub loss_scale: Option<f64>,
    /// NVMe offload: the step's swap I/O.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io: Option<IoReport>,
    /// Validation loss after the step (the same on every rank), when one was
    /// computed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// LAMB: the step's trust ratios over the parameters (the same on every
    /// rank); `None` for the other rules and on a skipped step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trust_ratio: Option<TrustRatios>,
    /// `train.curriculum`: the tokens of each sequence this step trained on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<usize>,
    /// `comms_logger`: the collectives this rank ran since its previous
    /// report (the first report's include those before step 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comms: Option<Vec<CommRecord>>,
    /// `train.progressive_layer_drop`: θ of the step and the blocks its
    /// micro-batches ran (the same on every rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_drop: Option<LayerDrop>,
}

/// A step under progressive layer dropping (zengine's `LayerDropStats`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LayerDrop {
    /// θ: the last block's chance to run.
    pub theta: f64,
    /// Blocks run per micro-batch, the mean over the step's.
    pub blocks_run: f64,
}

/// `comms_logger`: the collectives of one kind and size that a rank ran,
/// timed on its communicator's thread from start to end (waiting for the
/// other ranks to arrive included).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommRecord {
    /// The process group: `world`, or an hpZ group (`hpz0`).
    pub group: String,
    /// Ranks in the group.
    pub ranks: u64,
    /// torch.distributed's name ([`crate::Op::name`]).
    pub op: String,
    /// The collective's buffer: the all-reduce's, the reduce-scatter's
    /// input, the all-gather's output, in the caller's type (f32 for a
    /// reduction whose wire is 16-bit).
    pub bytes: u64,
    /// How many ran.
    pub count: u64,
    /// Their time added up, in microseconds.
    pub total_us: f64,
    /// The shortest one's.
    pub min_us: f64,
    /// The longest one's.
    pub max_us: f64,
}

/// `flops_profiler`: where one step's forward and backward went on rank 0,
/// module by module, with each module's parameters and model FLOPs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlopsProfile {
    /// The profiled step (1-based).
    pub step: u64,
    /// The rank that measured it.
    pub rank: u64,
    /// Workers in the job.
    pub world_size: u64,
    /// The job's ZeRO stage.
    pub zero_stage: u8,
    /// Micro-batches the step ran on this rank.
    pub micro_batches: u64,
    /// Sequences in each.
    pub micro_batch: u64,
    /// Tokens in each sequence this step.
    pub seq_len: u64,
    /// The step as the metrics line has it (this rank's figures).
    pub times: StepTimesMs,
    /// The step's wall time on this rank.
    pub step_ms: f64,
    /// Modules in the model's order, each after its parent
    /// (`blocks.0.attention.qkv` after `blocks.0.attention`), the model
    /// first under the path `model`.
    pub modules: Vec<ModuleProfile>,
}

/// One module of a [`FlopsProfile`], its figures summed over the step's
/// micro-batches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModuleProfile {
    /// Dotted path: `model`, `embedding`, `blocks.3`, `blocks.3.mlp.in`, `head`.
    pub path: String,
    /// Parameters it holds (its children's included).
    pub params: u64,
    /// Model FLOPs of its forward (PaLM's accounting, as the metrics' `tflops`).
    pub forward_flops: f64,
    /// Model FLOPs of its backward.
    pub backward_flops: f64,
    /// Milliseconds in its forward.
    pub forward_ms: f64,
    /// Milliseconds in its backward.
    pub backward_ms: f64,
    /// Milliseconds recomputing its forward in backward (activation
    /// checkpointing).
    pub recompute_ms: f64,
}

impl ModuleProfile {
    /// A module at `path` with nothing in it yet.
    pub fn empty(path: String) -> ModuleProfile {
        ModuleProfile {
            path,
            params: 0,
            forward_flops: 0.0,
            backward_flops: 0.0,
            forward_ms: 0.0,
            backward_ms: 0.0,
            recompute_ms: 0.0,
        }
    }

    /// Its depth below the model: 0 the model, 1 the embedding, a block
    /// (`h.3`: a block's path has one dot) and the head, 2 a block's norms
    /// and its attention and MLP, 3 their parts.
    pub fn depth(&self) -> usize {
        match self.path.as_str() {
            "model" => 0,
            p => p.matches('.').count().max(1),
        }
    }
}

/// The smallest, mean and largest of a LAMB step's trust ratios, one per
/// parameter (zengine's `TrustRatios`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TrustRatios {
    /// The smallest.
    pub min: f64,
    /// The mean over parameters.
    pub mean: f64,
    /// The largest.
    pub max: f64,
}
