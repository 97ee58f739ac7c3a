//! The engine: one model replica's ZeRO-partitioned state on one rank, and the
//! parameters each use of a block needs.
//!
//! A step is split over modules by phase: `micro_batch` runs forward
//! and backward of one micro-batch, `reduce` reduces gradient buckets
//! while backward continues, and `step` finishes the optimizer step.
//!
//! What each stage keeps ([`ZeroStage`] answers these questions by name):
//!
//! | stage | params | grads | Adam m, v | grads reduced by | after step |
//! |---|---|---|---|---|---|
//! | 0 | full | full | full | all-reduce (last micro-batch) | - |
//! | 1 | full | full | own slice | reduce-scatter (last micro-batch) | all-gather params |
//! | 2 | full | own slice | own slice | reduce-scatter (every micro-batch) | all-gather params |
//! | 3 | own slice | own slice | own slice | reduce-scatter (every micro-batch) | - |
//!
//! At stage 3 a group smaller than `param_persistence_threshold` stays whole and
//! is treated like stage 2. Partitioned groups are gathered just before each use
//! and dropped after it: once for forward and once for backward (the activations
//! hold no parameters).
//!
//! The same arithmetic in every stage: each gradient element is summed over ranks
//! in an order fixed by the bucket layout, the norm adds owned slices in rank
//! order, and Adam is element-wise. With `grad_accum: 1`, stages 0-3 give
//! bit-identical parameters; with accumulation, stages 2-3 reduce every
//! micro-batch (as DeepSpeed does) and agree with 0-1 to rounding.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use half::bf16;
use half::vec::HalfBitsVecExt;
use zcomm::{Communicator, CounterSnapshot, Quantization};
use zconfig::spec::CommsLoggerSpec;
use zconfig::{Dtype, JobSpec, ZeroStage};
use zmodel::{Gpt, Products};
use zproto::CommRecord;

use crate::accounting::{StepTimes, Transient};
use crate::error::EngineError;
use crate::flat::GroupLayout;
use crate::gather::{Gather, Prefetcher, ProcessGroups, Source, WeightQuant};
use crate::group::Group;
use crate::layer_drop::BlockFates;
use crate::offload::{Offload, ParamReadAhead};
use crate::precision::{half_of, Flat, Half, LossScaler};
use crate::reduce::Reducer;
use zquant::Bits;

/// ZeRO data-parallel training of one model replica on one rank.
pub struct Engine {
    pub(crate) model: Gpt,
    pub(crate) comm: Arc<dyn Communicator>,
    /// ZeRO++ hpZ: this rank's secondary-partition group.
    pub(crate) hpz: Option<Arc<dyn Communicator>>,
    pub(crate) spec: JobSpec,
    pub(crate) stage: ZeroStage,
    pub(crate) groups: Vec<Group>,
    /// How far down backward goes ([`backward_reach`]): 0 all the way to
    /// the embedding, else the lowest block whose gradients are needed.
    pub(crate) backward_reach: usize,
    /// Mixed precision: the 16-bit working type.
    pub(crate) half: Option<Half>,
    /// The type gradients are held and summed in: `half`, or f32 under
    /// `train.grad_accum_dtype: f32` (`None`: f32).
    pub(crate) grads_half: Option<Half>,
    /// f16: the dynamic loss scale.
    pub(crate) scaler: Option<LossScaler>,
    /// Updates applied (steps minus those f16 skipped): Adam's and the
    /// schedule's step count.
    pub(crate) updates: u64,
    /// `reduce_lr_on_plateau`: the rate its validations have set, which
    /// replaces the schedule's ([`Engine::set_plateau_lr`]).
    pub(crate) plateau_lr: Option<f64>,
    /// Gradient buckets and the reductions in flight.
    pub(crate) reducer: Reducer,
    /// Parameter tensors of groups that keep parameters whole: views of the
    /// lent buffer for the call in progress, or of a widened copy (f16, and
    /// bf16 where the products are f32) kept until the next update.
    pub(crate) param_tensors: Vec<Option<Vec<Tensor>>>,
    /// Whole groups whose parameters the model's tensors hold for the call
    /// in progress ([`Engine::with_lent_params`]): the tensor that owns
    /// each one's buffer, taken back when the call ends.
    pub(crate) lent: Vec<Option<Tensor>>,
    /// Bumped whenever the parameters change ([`Engine::params_changed`]):
    /// what the GPU host flow's device copies of whole groups are keyed by.
    pub(crate) params_version: u64,
    pub(crate) step: u64,
    /// Micro-batches run since the last step.
    pub(crate) micro: usize,
    pub(crate) loss_sum: f64,
    pub(crate) tokens: u64,
    /// Gathered parameters, staged gradients and buckets in flight.
    pub(crate) comm_buffers: Transient,
    /// hpZ: the most bytes of secondary shards held in a micro-batch of this step.
    pub(crate) secondary_peak: u64,
    /// LAMB: this step's trust ratios, for its statistics.
    pub(crate) trust_ratio: Option<crate::accounting::TrustRatios>,
    /// Per block, how many of this step's micro-batches ran it so far
    /// (all of them but under progressive layer dropping).
    pub(crate) block_runs: Vec<u64>,
    pub(crate) peak_activations: u64,
    pub(crate) counters_at_start: Option<CounterSnapshot>,
    /// Forward and backward time of the step so far.
    pub(crate) times: StepTimes,
    /// When the micro-batch in progress finished its forward (the
    /// forward/backward split of [`Engine::forward_backward`]).
    pub(crate) forward_done: Option<Instant>,
    /// NVMe offload: the swap files and their I/O.
    pub(crate) offload: Option<Offload>,
    /// Stage-3 parameter slices read from swap ahead of their gathers.
    pub(crate) param_reads: ParamReadAhead,
    /// Swap buffers held by the optimizer step (peak per step).
    pub(crate) swap_buffers: Transient,
    pub(crate) io_at_start: Option<zswap::IoStats>,
    /// Set from outside (a signal, zrun's message) to end the job after a
    /// step: this rank's word in the gradient norm's all-gather.
    pub(crate) stop_asked: Arc<AtomicBool>,
    /// Whether any rank's `stop_asked` was set when this step's norm was
    /// gathered: the same answer on every rank.
    pub(crate) stop_agreed: AtomicBool,
    /// `device: cuda`: the GPU the micro-batches run on.
    #[cfg(feature = "cuda")]
    pub(crate) gpu: Option<Arc<zcuda::GptGpu>>,
    /// `device: cuda`, host flow: per group, its parameters' copy on the GPU
    /// and the page-locked buffers its gradients land in.
    #[cfg(feature = "cuda")]
    pub(crate) gpu_host: crate::gpu::HostFlow,
    /// `device: cuda`, one worker: parameters, gradients and moments on the
    /// GPU (made at the first micro-batch, dropped by a load).
    #[cfg(feature = "cuda")]
    pub(crate) gpu_resident: Option<crate::gpu::Resident>,
    /// `comm.backend: nccl`: the communicator between the ranks' GPUs, over
    /// which the resident flow reduces gradients and gathers parameters
    /// (every ZeRO stage).
    #[cfg(feature = "cuda")]
    pub(crate) nccl: Option<zcuda::Nccl>,
}

impl Engine {
    /// Builds the model of `spec` with seeded parameters and empty optimizer state,
    /// partitioned as the ZeRO stage says. NVMe swap files, if any, go under a
    /// directory named after the job's name and this process.
    pub fn new(spec: &JobSpec, comm: Arc<dyn Communicator>) -> Result<Engine, EngineError> {
        let job = format!("{}-{}", spec.name, std::process::id());
        Engine::for_job(spec, comm, &job)
    }

    /// [`Engine::new`] for job `job_id` (the name of its swap directories).
    pub fn for_job(
        spec: &JobSpec,
        comm: Arc<dyn Communicator>,
        job_id: &str,
    ) -> Result<Engine, EngineError> {
        let groups = ProcessGroups {
            world: comm,
            hpz: None,
        };
        Engine::with_groups(spec, groups, job_id)
    }

    /// [`Engine::for_job`] on `groups`: with `zero.hpz_partition_size` P > 1,
    /// `groups.hpz` must be this rank's group of P ranks on its node.
    pub fn with_groups(
        spec: &JobSpec,
        groups: ProcessGroups,
        job_id: &str,
    ) -> Result<Engine, EngineError> {
        let p = spec.zero.hpz_partition_size;
        let ProcessGroups { world: comm, hpz } = groups;
        let problem = match &hpz {
            None if p > 1 => Some(format!("hpZ needs a group of {p} ranks; none was given")),
            Some(h) if p <= 1 => Some(format!(
                "an hpZ group of {} ranks was given, but zero.hpz_partition_size is {p}",
                h.world_size()
            )),
            Some(h) if h.world_size() != p || !comm.world_size().is_multiple_of(p) => {
                Some(format!(
                    "hpZ group of {} ranks for zero.hpz_partition_size {p} in a world of {}",
                    h.world_size(),
                    comm.world_size()
                ))
            }
            _ => None,
        };
        if let Some(problem) = problem {
            return Err(EngineError::ProcessGroups { problem });
        }
        let stage = spec.zero.stage;
        let m = &spec.model;
        let model = Gpt::new(m)?
            .with_tile_size(m.tile_size.map(|n| n.0 as usize))
            .map_err(|e| EngineError::Tiling {
                problem: e.to_string(),
            })?
            .with_bf16_products(spec.train.dtype == Dtype::Bf16)
            .with_label_smoothing(spec.train.label_smoothing);
        let (world, rank) = (comm.world_size(), comm.rank());
        let threshold = spec.zero.param_persistence_threshold.0 as usize;
        let half = half_of(spec.train.dtype);
        let grads_half = half_of(spec.train.grads_dtype());
        let specs = model.groups();
        let mut layouts: Vec<GroupLayout> =
            specs.iter().map(|gs| GroupLayout::new(gs, world)).collect();
        for l in &mut layouts {
            l.freeze(&spec.train.freeze);
        }
        // The output matrix: `wte` (the embedding's first parameter) where
        // the head is tied, else `lm_head` (the head's last).
        let output_frozen = match model.config().tied() {
            true => layouts[0].params[0].frozen,
            false => layouts[m.n_layers + 1]
                .params
                .last()
                .is_some_and(|p| p.frozen),
        };
        let model = model.with_frozen_output(output_frozen);
        let partitioned: Vec<bool> = layouts
            .iter()
            .map(|l| stage.partitions_parameters() && l.numel >= threshold)
            .collect();
        let offload = Offload::new(spec, job_id, rank, &layouts, &partitioned, half)?;
        let mut groups = Vec::new();
        let init = model.initializer(spec.train.seed);
        for (g, layout) in layouts.iter().enumerate() {
            // Written in place: the group keeps this buffer where it holds
            // it whole, so a parameter's values are made once.
            let mut full = vec![0f32; layout.padded];
            for (i, slot) in layout.params.iter().enumerate() {
                init.write(g, i, &mut full[slot.range.clone()]);
            }
            let rule = spec.train.optimizer.kind;
            let mut group = Group::new(
                layout.clone(),
                full,
                stage,
                partitioned[g],
                rank,
                (half, grads_half),
                rule,
            );
            if let Some(o) = &offload {
                o.stash(g, &mut group, true)?;
            }
            groups.push(group);
        }
        let z = &spec.zero;
        let quantized = z.quantized_gradients.then(|| Quantization {
            bits: Bits::from_count(z.quantization.gradient_bits).expect("validated: 8 or 4"),
            block_size: z.quantization.block_size,
        });
        // Groups whose every parameter is frozen get no gradient and no
        // reduction, and backward stops above the lowest group that trains.
        let trained: Vec<bool> = layouts.iter().map(|l| !l.all_frozen()).collect();
        let backward_reach = backward_reach(&model, &trained);
        let completion: Vec<usize> = backward_completion(&model)
            .into_iter()
            .filter(|&g| trained[g])
            .collect();
        let reducer = Reducer::new(
            &layouts,
            &completion,
            z.reduce_bucket_size.0.max(1) as usize,
            z.overlap_comm,
            (
                quantized,
                (z.loco.as_ref()).map(|l| (l.err_beta as f32, l.reset_t)),
            ),
            spec.train.reduce_dtype.and_then(half_of),
            !stage.partitions_parameters(),
        );
        Ok(Engine {
            param_tensors: (0..groups.len()).map(|_| None).collect(),
            lent: (0..groups.len()).map(|_| None).collect(),
            params_version: 0,
            model,
            comm,
            hpz,
            spec: spec.clone(),
            stage,
            groups,
            backward_reach,
            half,
            grads_half,
            scaler: (half == Some(Half::F16)).then(|| LossScaler::new(&spec.train.loss_scale)),
            updates: 0,
            plateau_lr: None,
            reducer,
            step: 0,
            micro: 0,
            loss_sum: 0.0,
            tokens: 0,
            comm_buffers: Transient::default(),
            secondary_peak: 0,
            trust_ratio: None,
            block_runs: vec![0; spec.model.n_layers],
            peak_activations: 0,
            counters_at_start: None,
            times: StepTimes::default(),
            forward_done: None,
            offload,
            param_reads: ParamReadAhead::default(),
            swap_buffers: Transient::default(),
            io_at_start: None,
            stop_asked: Arc::default(),
            stop_agreed: AtomicBool::new(false),
            #[cfg(feature = "cuda")]
            gpu: None,
            #[cfg(feature = "cuda")]
            gpu_host: Default::default(),
            #[cfg(feature = "cuda")]
            gpu_resident: None,
            #[cfg(feature = "cuda")]
            nccl: None,
        })
    }

    /// The model.
    pub fn model(&self) -> &Gpt {
        &self.model
    }

    /// Model FLOPs per trained token as this job computes them
    /// ([`Gpt::flops_per_token`]'s accounting, which MFU figures use, less
    /// what `train.freeze` leaves out): each block parameter and the head
    /// matrix 2 in the forward, 2 for the input gradient where backward
    /// goes (the head always, the blocks from the lowest that trains
    /// up) and 2 for the gradient of each parameter that trains; attention
    /// `4·h·hd·T` forward and twice that backward. Without freezing, the
    /// model's figure. (The GPU's backward skips the same products.)
    pub fn flops_per_token(&self) -> f64 {
        self.flops_per_token_at(self.model.config().seq_len)
    }

    /// [`Engine::flops_per_token`] for sequences of `seq_len` tokens (a
    /// step of `train.curriculum`'s): attention's part grows with the keys
    /// a token sees, the rest does not.
    pub fn flops_per_token_at(&self, seq_len: usize) -> f64 {
        self.flops_per_token_ran(seq_len, None)
    }

    /// [`Engine::flops_per_token_at`] of a step that ran block `b` in the
    /// share `ran[b − 1]` of its micro-batches (progressive layer dropping,
    /// [`crate::LayerDropStats::ran`]); `None`: every block every time.
    pub fn flops_per_token_ran(&self, seq_len: usize, ran: Option<&[f64]>) -> f64 {
        let reach = self.backward_reach;
        let m = self.model.config();
        let head = (m.vocab_size * m.d_model) as f64;
        let keys = m.window().map_or(seq_len, |w| w.min(seq_len));
        let attention = 4.0 * (m.attn_width() * keys) as f64;
        let numel = |g: &usize, trained_only: bool| -> f64 {
            let params = self.groups[*g].layout.params.iter();
            params
                .filter(|p| !(trained_only && p.frozen))
                .map(|p| p.range.len() as f64)
                .sum()
        };
        let mut flops = match self.model.frozen_output() {
            true => 4.0 * head,
            false => 6.0 * head,
        };
        for b in 1..=m.n_layers {
            let groups: Vec<usize> = block_uses(&self.model, b, Pass::Forward).collect();
            let all: f64 = groups.iter().map(|g| numel(g, false)).sum();
            let mut block = 2.0 * all + attention;
            if b >= reach {
                let trained: f64 = groups.iter().map(|g| numel(g, true)).sum();
                block += 2.0 * all + 2.0 * trained + 2.0 * attention;
            }
            flops += block * ran.map_or(1.0, |r| r[b - 1]);
        }
        flops
    }

    /// The flag that asks the job to end after a step (a preemption notice):
    /// set on any rank, every rank's next [`crate::StepStats::stop`] says so, after
    /// the same step, so that all of them save the same checkpoint.
    pub fn stop_on(&mut self, flag: Arc<AtomicBool>) {
        self.stop_asked = flag;
    }

    /// Optimizer steps taken.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// Sets the rate of every later update, in place of the schedule's:
    /// `reduce_lr_on_plateau` after a validation lowers it (the caller keeps
    /// the rule's state, which checkpoints carry).
    pub fn set_plateau_lr(&mut self, lr: f64) {
        self.plateau_lr = Some(lr);
    }

    /// The rate of the next update: the schedule's, or the plateau rule's.
    pub(crate) fn next_lr(&self) -> f64 {
        self.plateau_lr
            .unwrap_or_else(|| crate::schedule::lr_at(self.updates + 1, &self.spec.train))
    }

    /// Every group's full f32 parameters (unpadded; the master copy under mixed
    /// precision), gathering what is partitioned. A collective: every rank must
    /// call it.
    pub fn full_params(&self) -> Result<Vec<Vec<f32>>, EngineError> {
        let mut out = Vec::with_capacity(self.groups.len());
        for (gi, g) in self.groups.iter().enumerate() {
            let mut full = if self.half.is_none() && !g.partitioned && !self.params_on_gpu() {
                g.params.to_f32(0..g.layout.padded)
            } else if !self.stage.partitions_optimizer() {
                self.updated_params(gi)?
            } else {
                self.comm
                    .all_gather(self.updated_params(gi)?, g.layout.padded)?
            };
            full.truncate(g.layout.numel);
            out.push(full);
        }
        Ok(out)
    }

    /// Whether the current parameters are on the GPU only (the resident
    /// flow of `device: cuda`), the host's buffers stale.
    fn params_on_gpu(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.gpu_resident.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// f16's loss-scaler state (for checkpoints).
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// The order of stage-3 gathers in one micro-batch: forward blocks, the head
    /// (with the embedding, if tied), backward blocks in reverse (the
    /// embedding's backward needs no parameter); a block's tiles after its own
    /// group, in the order its pass uses them.
    /// With qwZ the forward gathers of the embedding and the blocks are
    /// quantized; the head's serves its backward too, so it is not. With hpZ
    /// those forward gathers keep secondary shards, and the embedding's and
    /// blocks' later gathers come from them, inside the node.
    /// Under progressive layer dropping, only the blocks `fates` runs.
    fn gather_order(&self, fates: &BlockFates) -> Vec<Gather> {
        let l = self.model.config().n_layers;
        let keep = self.hpz.is_some();
        let later = |group| Gather {
            group,
            source: if keep {
                Source::Secondary
            } else {
                Source::World(None)
            },
            keep: false,
        };
        let checkpointing = self.spec.train.activation_checkpointing;
        let head = Gather {
            group: l + 1,
            source: Source::World(None),
            keep: false,
        };
        let mut order: Vec<Gather> = self.forward_gathers(keep, fates).collect();
        order.push(head);
        if self.model.config().tied() {
            order.push(later(0));
        }
        for b in (self.backward_reach.max(1)..=l)
            .rev()
            .filter(|&b| fates.runs(b))
        {
            order.extend(block_uses(&self.model, b, Pass::Backward { checkpointing }).map(later));
        }
        order.retain(|g| self.groups[g.group].partitioned);
        order
    }

    /// The forward gathers of the embedding and the blocks: quantized with
    /// qwZ; with `keep`, leaving hpZ's secondary shards (the embedding's only
    /// where a tied head gathers it again: its backward gathers nothing).
    fn forward_gathers<'a>(
        &'a self,
        keep: bool,
        fates: &'a BlockFates,
    ) -> impl Iterator<Item = Gather> + 'a {
        let z = &self.spec.zero;
        let quant = z.quantized_weights.then(|| WeightQuant {
            bits: Bits::from_count(z.quantization.weight_bits).expect("validated: 8 or 4"),
            block_size: z.quantization.block_size,
        });
        let l = self.model.config().n_layers;
        let tied = self.model.config().tied();
        std::iter::once(0)
            .chain(
                (1..=l)
                    .filter(|&b| fates.runs(b))
                    .flat_map(|b| block_uses(&self.model, b, Pass::Forward)),
            )
            .map(move |group| Gather {
                group,
                source: Source::World(quant),
                keep: keep && (group != 0 || tied),
            })
    }

    /// The order of stage-3 gathers in a forward-only pass (validation): the
    /// embedding and the blocks as in training's forward (quantized with qwZ),
    /// then the head (and the embedding, if tied); hpZ keeps no shards, nothing
    /// gathers them again.
    fn eval_gather_order(&self) -> Vec<Gather> {
        let l = self.model.config().n_layers;
        let every = BlockFates::all(l);
        self.forward_gathers(false, &every)
            .chain(
                [l + 1, 0]
                    .into_iter()
                    .take(if self.model.config().tied() { 2 } else { 1 })
                    .map(|group| Gather {
                        group,
                        source: Source::World(None),
                        keep: false,
                    }),
            )
            .filter(|g| self.groups[g.group].partitioned)
            .collect()
    }

    /// A prefetcher for one micro-batch's stage-3 gathers (and, with parameter
    /// offload, the read-ahead of their slices from swap).
    pub(crate) fn prefetcher(&mut self, fates: &BlockFates) -> Prefetcher {
        let order = match self.gathers_on_gpu() {
            true => Vec::new(),
            false => self.gather_order(fates),
        };
        self.prefetcher_for(order)
    }

    /// A prefetcher for one forward-only pass.
    pub(crate) fn eval_prefetcher(&mut self) -> Prefetcher {
        let order = match self.gathers_on_gpu() {
            true => Vec::new(),
            false => self.eval_gather_order(),
        };
        self.prefetcher_for(order)
    }

    /// Whether the GPU's resident flow gathers stage 3's parameters itself
    /// (over NCCL), so that the host plans none.
    fn gathers_on_gpu(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.gpu_resident();
        #[cfg(not(feature = "cuda"))]
        false
    }

    fn prefetcher_for(&mut self, order: Vec<Gather>) -> Prefetcher {
        if let Some(p) = self.offload.as_ref().and_then(|o| o.params.as_ref()) {
            // Gathers from secondary shards read no slice.
            let groups = order
                .iter()
                .filter(|g| g.source != Source::Secondary)
                .map(|g| g.group)
                .collect();
            self.param_reads = ParamReadAhead::new(groups, p.buffer_count);
        }
        let padded = self.groups.iter().map(|g| g.layout.padded).collect();
        let groups = ProcessGroups {
            world: self.comm.clone(),
            hpz: self.hpz.clone(),
        };
        Prefetcher::new(
            order,
            padded,
            self.half,
            groups,
            self.spec.zero.prefetch_bucket_size.0 as usize,
            self.spec.zero.overlap_comm,
        )
    }

    /// Parameter tensors (f32) of group `g` from a full flat buffer: views of
    /// one storage, so an f32 buffer (a stage-3 gather, a whole group's lent
    /// parameters) becomes the model's parameters without a copy; 16-bit
    /// values are widened once. They are plain tensors, not Vars: the step's
    /// backward is explicit, and the linear layers take their fast path only
    /// for tensors autograd does not follow.
    ///
    /// Under bf16 products a linear's weight is handed over as the bf16
    /// working copy it is (a `BF16` view of `full`): the products read its
    /// bits as they are, where widening it to f32 here and rounding it back
    /// as every product packs it was 2-3% of a bf16 step on AMX. The other
    /// parameters (norms, biases) are widened one by one.
    fn tensors_from(&self, g: usize, full: Flat) -> Result<Vec<Tensor>, EngineError> {
        let all = self.storage_tensor(g, full)?;
        self.views(g, &all)
    }

    /// One tensor that owns group `g`'s full buffer: f32, or the bf16 bits
    /// themselves where the products take them.
    fn storage_tensor(&self, g: usize, full: Flat) -> Result<Tensor, EngineError> {
        let len = full.len();
        Ok(match full {
            Flat::F32(v) => Tensor::from_vec(v, len, &Device::Cpu)?,
            Flat::Half(Half::Bf16, bits) if self.weights_in_bf16(g) => {
                Tensor::from_vec(bits.reinterpret_into::<bf16>(), len, &Device::Cpu)?
            }
            half => Tensor::from_vec(half.to_f32(0..len), len, &Device::Cpu)?,
        })
    }

    /// Group `g`'s parameters as views of `all` ([`Engine::storage_tensor`]),
    /// each widened to f32 where `all` is bf16 but for the product operands.
    fn views(&self, g: usize, all: &Tensor) -> Result<Vec<Tensor>, EngineError> {
        let bf16_products = all.dtype() == DType::BF16;
        (self.groups[g].layout.params.iter())
            .map(|s| {
                let view = all
                    .narrow(0, s.range.start, s.range.len())?
                    .reshape(s.shape.as_slice())?;
                Ok(match bf16_products && !s.product_operand {
                    true => view.to_dtype(DType::F32)?,
                    false => view,
                })
            })
            .collect()
    }

    /// Whether group `g`'s product operands go to the model in bf16 (see
    /// [`Engine::tensors_from`]): on the CPU only (the GPU path uploads f32).
    fn weights_in_bf16(&self, g: usize) -> bool {
        self.spec.device == zconfig::spec::Device::Cpu
            && self.half == Some(Half::Bf16)
            && self.model.products() == Products::Bf16
            && self.groups[g]
                .layout
                .params
                .iter()
                .any(|s| s.product_operand)
    }

    /// Bytes a gathered copy of group `g` holds.
    fn gathered_bytes(&self, g: usize) -> u64 {
        (Flat::words_for(self.half, self.groups[g].layout.padded) * 4) as u64
    }

    /// Group `g`'s parameters for one use: cached tensors for whole groups,
    /// fresh ones for partitioned groups, which are gathered.
    pub(crate) fn params_for(
        &mut self,
        g: usize,
        gather: &mut Prefetcher,
    ) -> Result<Vec<Tensor>, EngineError> {
        if self.groups[g].partitioned {
            let (groups, offload) = (&self.groups, self.offload.as_ref());
            let reads = &mut self.param_reads;
            let half = self.half;
            let mut own = |h: usize| match offload.filter(|o| o.swaps_params(h)) {
                Some(o) => Ok(Flat::from_words(half, reads.take(h, o)?)),
                None => Ok(groups[h].params.clone()),
            };
            let full = gather.fetch(g, &mut own)?;
            self.comm_buffers.add(full.bytes());
            return self.tensors_from(g, full);
        }
        if let Some(vars) = &self.param_tensors[g] {
            return Ok(vars.clone());
        }
        let vars = match self.lends(g) {
            true => {
                let params = &mut self.groups[g].params;
                let held = std::mem::replace(params, Flat::zeros(params.kind(), 0));
                let all = self.storage_tensor(g, held)?;
                let vars = self.views(g, &all)?;
                self.lent[g] = Some(all);
                vars
            }
            false => {
                let params = &self.groups[g].params;
                let widened = Flat::F32(params.to_f32(0..params.len()));
                self.tensors_from(g, widened)?
            }
        };
        self.param_tensors[g] = Some(vars.clone());
        Ok(vars)
    }

    /// Whether whole group `g`'s parameters are what the model's tensors
    /// would copy unchanged (f32, or bf16 that the products take as it is),
    /// so that the tensors can hold the buffer itself for a call instead.
    fn lends(&self, g: usize) -> bool {
        match &self.groups[g].params {
            Flat::F32(_) => true,
            Flat::Half(..) => self.weights_in_bf16(g),
        }
    }

    /// Runs `f`, a call that may hand whole groups' parameters to the
    /// model's tensors ([`Engine::params_for`]), and takes them back
    /// after, whatever `f` returned.
    ///
    /// Lending the buffers, where copying them into the tensors once a step
    /// kept a second copy of every whole group (4 bytes a parameter in
    /// f32, stages 0-2) beside the one the optimizer updates, is a move
    /// each way: no copy, and a worker holds its parameters once, as
    /// DeepSpeed's do.
    pub(crate) fn with_lent_params<T>(
        &mut self,
        f: impl FnOnce(&mut Engine) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let out = f(self);
        let back = self.take_back_lent();
        let out = out?;
        back?;
        Ok(out)
    }

    /// Puts every lent buffer back in its group, and drops the tensors made
    /// of it (a tensor kept past this would read an empty buffer).
    fn take_back_lent(&mut self) -> Result<(), EngineError> {
        for g in 0..self.groups.len() {
            let Some(all) = self.lent[g].take() else {
                continue;
            };
            self.param_tensors[g] = None;
            let take = TakeBuffer(std::sync::Mutex::new(None));
            all.inplace_op1(&take)?;
            let taken = take.0.into_inner().unwrap_or_else(|e| e.into_inner());
            self.groups[g].params = taken.expect("an f32 or bf16 CPU tensor gives its buffer");
        }
        Ok(())
    }

    /// The parameters changed (an update, a load): what was made of them
    /// (their tensors, the GPU's copies) is stale.
    pub(crate) fn params_changed(&mut self) {
        self.param_tensors.iter_mut().for_each(|v| *v = None);
        self.params_version += 1;
    }

    /// Bytes this rank has sent, over every process group.
    pub(crate) fn counters(&self) -> CounterSnapshot {
        let world = self.comm.counters();
        #[cfg(feature = "cuda")]
        let world = match &self.nccl {
            Some(n) => world.plus(&crate::gpu::nccl_counters(n)),
            None => world,
        };
        match &self.hpz {
            Some(h) => world.plus(&h.counters()),
            None => world,
        }
    }

    /// `comms_logger`: the collectives that `logger` asks for which every
    /// process group's communicator ran since the last call.
    pub(crate) fn op_log(&self, logger: &CommsLoggerSpec) -> Vec<CommRecord> {
        let groups = std::iter::once(&self.comm).chain(&self.hpz);
        groups
            .flat_map(|c| {
                let (group, ranks) = (c.group_name(), c.world_size() as u64);
                c.take_op_log()
                    .into_iter()
                    .filter(|t| logger.logs(t.op.name()))
                    .map(move |t| CommRecord {
                        group: group.to_string(),
                        ranks,
                        op: t.op.name().to_string(),
                        bytes: t.bytes,
                        count: t.count,
                        total_us: t.total.as_secs_f64() * 1e6,
                        min_us: t.min.as_secs_f64() * 1e6,
                        max_us: t.max.as_secs_f64() * 1e6,
                    })
            })
            .collect()
    }

    /// Marks a gathered group's parameters as released.
    pub(crate) fn release(&mut self, g: usize) {
        if self.groups[g].partitioned {
            self.comm_buffers.sub(self.gathered_bytes(g));
        }
    }
}

/// Moves a CPU tensor's buffer out of its storage (leaving it empty): how
/// lent parameters come back ([`Engine::with_lent_params`]).
struct TakeBuffer(std::sync::Mutex<Option<Flat>>);

impl candle_core::InplaceOp1 for TakeBuffer {
    fn name(&self) -> &'static str {
        "take-buffer"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        use candle_core::CpuStorage;
        let taken = match storage {
            CpuStorage::F32(v) => Flat::F32(std::mem::take(v)),
            CpuStorage::BF16(v) => {
                use half::vec::HalfFloatVecExt;
                Flat::Half(Half::Bf16, std::mem::take(v).reinterpret_into())
            }
            _ => candle_core::bail!("a lent buffer neither f32 nor bf16"),
        };
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(taken);
        Ok(())
    }
}

/// A pass over a block.
#[derive(Clone, Copy)]
enum Pass {
    Forward,
    /// With activation checkpointing backward first recomputes the forward.
    Backward {
        checkpointing: bool,
    },
}

/// The groups block `b`'s pass uses, in order: its own group, then its tiles
/// as the model asks for them (forward: linears in order; backward: last
/// linear first, each linear's tiles in column order).
fn block_uses(model: &Gpt, b: usize, pass: Pass) -> impl Iterator<Item = usize> {
    let tiles = model.tile_groups(b);
    let forward: Vec<usize> = tiles.iter().flat_map(|(_, g)| g.clone()).collect();
    let backward: Vec<usize> = tiles.iter().rev().flat_map(|(_, g)| g.clone()).collect();
    let uses = match pass {
        Pass::Forward => forward,
        Pass::Backward { checkpointing } if checkpointing => [forward, backward].concat(),
        Pass::Backward { .. } => backward,
    };
    std::iter::once(b).chain(uses)
}

/// How far down backward must go, given which groups train (`trained`, by
/// group; a group trains unless `train.freeze` froze all of it): 0 (to the
/// embedding) where the embedding trains, else the lowest block any of
/// whose groups trains (`n_layers + 1` where none does: the head alone).
/// Below it every group is frozen, so neither their gradients nor the
/// input gradients that would reach them are needed.
fn backward_reach(model: &Gpt, trained: &[bool]) -> usize {
    let l = model.config().n_layers;
    if trained[0] {
        return 0;
    }
    (1..=l)
        .find(|&b| block_uses(model, b, Pass::Forward).any(|g| trained[g]))
        .unwrap_or(l + 1)
}

/// The order in which backward completes groups' gradients: the head, each
/// block's tiles as its backward finishes them and then the block's own
/// group, last block first, and the embedding.
fn backward_completion(model: &Gpt) -> Vec<usize> {
    let l = model.config().n_layers;
    let mut order = vec![l + 1];
    for b in (1..=l).rev() {
        order.extend(block_completion(model, b));
    }
    order.push(0);
    order
}

/// Block `b`'s groups in the order its backward completes their
/// gradients: its tiles as it finishes them, then its own group.
pub(crate) fn block_completion(model: &Gpt, b: usize) -> impl Iterator<Item = usize> {
    let backward = Pass::Backward {
        checkpointing: false,
    };
    block_uses(model, b, backward).skip(1).chain([b])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use zcomm::{TcpCommunicator, TcpOptions};

    /// An engine of one rank on a small model.
    fn solo(dtype: &str) -> Engine {
        let spec: JobSpec = format!(
            "model: {{vocab_size: 64, d_model: 32, n_layers: 2, n_heads: 4, seq_len: 16}}\n\
             data: {{format: synthetic}}\n\
             train: {{steps: 2, micro_batch_size: 2, dtype: {dtype}}}\n\
             zero: {{stage: 0}}\n"
        )
        .parse()
        .unwrap();
        let listener = TcpCommunicator::bind("127.0.0.1").unwrap();
        let addr = listener.local_addr().unwrap();
        let options = TcpOptions {
            token: zproto::Token::generate(),
            timeout: Duration::from_secs(30),
            node_of_rank: vec![0],
            group: "world".into(),
            shm: None,
            single_copy: true,
        };
        let comm = TcpCommunicator::connect(0, listener, &[addr], options).unwrap();
        Engine::new(&spec, Arc::new(comm)).unwrap()
    }

    /// `zrun estimate` counts the buckets backward may hold from its own
    /// plan of them (`reduce_bucket_elements`): the engine's, bucket for
    /// bucket, for GPT-2 and LLaMA, whole and tiled, over bucket sizes
    /// from one group a bucket to the whole gradient in one.
    #[test]
    fn the_estimate_plans_the_reduce_buckets_the_engine_plans() {
        for (kind, tile) in [
            ("gpt", "null"),
            ("gpt", "4e4"),
            ("llama", "null"),
            ("llama", "4e4"),
        ] {
            let spec: JobSpec = format!(
                "model: {{kind: {kind}, vocab_size: 64, d_model: 128, n_layers: 3, n_heads: 4, seq_len: 16, tile_size: {tile}}}\n\
                 data: {{format: synthetic}}\n"
            )
            .parse()
            .unwrap();
            let m = &spec.model;
            let model = Gpt::new(m)
                .unwrap()
                .with_tile_size(m.tile_size.map(|n| n.0 as usize))
                .unwrap();
            let layouts: Vec<GroupLayout> = (model.groups().iter())
                .map(|gs| GroupLayout::new(gs, 1))
                .collect();
            assert!(
                tile == "null" || layouts.len() > m.n_layers + 2,
                "{kind} {tile}: untiled"
            );
            let order = backward_completion(&model);
            for size in [1, 30_000, 250_000, 1 << 30] {
                let engine: Vec<f64> = (crate::flat::Bucket::plan(&layouts, &order, size, true)
                    .iter())
                .map(|b| b.len as f64)
                .collect();
                let estimate = zconfig::estimate::reduce_bucket_elements(m, size as u64);
                assert_eq!(
                    estimate, engine,
                    "{kind}, tile_size {tile}, buckets of {size}"
                );
            }
        }
    }

    /// Where each group's parameter buffer starts.
    fn addresses(e: &Engine) -> Vec<usize> {
        (e.groups.iter())
            .map(|g| g.params.as_bytes().as_ptr() as usize)
            .collect()
    }

    /// Where a tensor's storage starts, through candle.
    fn storage_address(t: &Tensor) -> usize {
        let (storage, _) = t.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.as_ptr() as usize,
            candle_core::Storage::Cpu(candle_core::CpuStorage::BF16(v)) => v.as_ptr() as usize,
            _ => panic!("an unexpected storage"),
        }
    }

    #[test]
    fn whole_groups_lend_their_parameters_and_get_the_same_buffers_back() {
        for dtype in ["f32", "bf16"] {
            let mut e = solo(dtype);
            let before = addresses(&e);
            let values: Vec<Flat> = e.groups.iter().map(|g| g.params.clone()).collect();
            // A block's group: its product operands go to the model as they
            // are where the products take bf16.
            let g = 1;
            let lends = e.lends(g);
            assert!(lends || dtype == "bf16", "f32 parameters are always lent");
            // A view of the buffer itself: the first product operand (under
            // bf16 products the norms' weights are widened copies).
            let slots = &e.groups[g].layout.params;
            let i = slots.iter().position(|s| s.product_operand).unwrap();
            let ended = e.with_lent_params(|e| {
                let mut gather = e.eval_prefetcher();
                let tensors = e.params_for(g, &mut gather)?;
                if lends {
                    assert_eq!(e.groups[g].params.len(), 0, "{dtype}: lent, not copied");
                    assert_eq!(storage_address(&tensors[i]), before[g], "{dtype}");
                } else {
                    assert_eq!(e.groups[g].params, values[g], "{dtype}: copied");
                }
                // A second use takes the same tensors.
                let again = e.params_for(g, &mut gather)?;
                assert_eq!(storage_address(&again[i]), storage_address(&tensors[i]));
                // The call fails: the buffers come back all the same.
                Err::<(), _>(EngineError::Gpu("a planted failure".into()))
            });
            assert!(ended.is_err(), "{dtype}: the call's error is returned");
            assert_eq!(addresses(&e), before, "{dtype}: the same buffers");
            let after: Vec<Flat> = e.groups.iter().map(|g| g.params.clone()).collect();
            assert_eq!(after, values, "{dtype}: the same values");
            assert!(e.lent.iter().all(Option::is_none));
            assert_eq!(e.param_tensors[g].is_none(), lends, "{dtype}");
        }
    }
}
