//! `device: cuda`: the micro-batch's forward and backward on a GPU
//! ([`zcuda::GptGpu`]), the optimizer where the job puts it.
//!
//! Two data flows, each giving the same bits:
//!
//! - **Resident** (one worker, no offload: the single-GPU job). Every group's
//!   parameters, gradients and Adam moments live on the GPU for the whole run
//!   (`Resident`): gradients are added into a device copy of the group's
//!   flat gradient buffer, the step averages, measures the norm, clips and
//!   runs AdamW there (`kernels/`: the CPU's operations in the CPU's order,
//!   so the same bits as the host flow), and nothing crosses PCIe but the
//!   tokens, the losses and a checkpoint's state when one is written.
//!   With `comm.backend: nccl` several workers run it too, at every ZeRO
//!   stage, reducing and gathering between the GPUs over NCCL where the
//!   host flow does on the host: at stage 0 each group's gradient is
//!   all-reduced at the step and every rank holds the whole state, as DDP
//!   does; at stage 1 it is reduce-scattered in place at the step, each rank
//!   holds Adam's moments of its slice only, updates that slice, and the
//!   slices are all-gathered in place; at stages 2-3 each micro-batch's
//!   gradient of a group lands in a buffer shared by the groups (the
//!   embedding's its own), is reduce-scattered as soon as the group is
//!   complete, and only this rank's slice is kept; at stage 3 a partitioned
//!   group's parameters are this rank's slice, all-gathered for each use
//!   and freed after it. The norm adds this rank's slice as the host does.
//!   Two ranks add each value once, so the bits are the host flow's.
//! - **Host** (several workers without NCCL, or `zero.offload_optimizer.device: cpu`:
//!   ZeRO-Offload). The engine's flat buffers, their partition over ranks,
//!   stage 3's gathers, the gradient buckets and AdamW stay on the host. A
//!   group's parameters come from `Engine::params_for` exactly as the CPU path
//!   takes them (under 16 bits, where the stage keeps the group whole, its
//!   16-bit working copy instead, which the products read as it is), go up
//!   for the group's forward or backward, and its gradients
//!   come down into the group's micro-batch buffer as soon as they exist,
//!   which hands the bucket to the reduction pipeline as on the CPU. Every
//!   stage computes the same values on the GPU, so stages 0-3 stay
//!   bit-identical to each other there too. Where the stage keeps a group
//!   whole its device copy is reused until the parameters change.
//!
//! In both, activations stay on the GPU from a block's forward to its
//! backward (with activation checkpointing, only the block's input, and the
//! backward recomputes the rest). The embedding's backward (a scatter-add of
//! `dx` rows into `wte`) adds each token's rows in row order, without atomics:
//! on the GPU where the state is resident, on the host from the downloaded
//! `dx` in the host flow; the same bits either way.

use std::sync::Arc;

use candle_core::{CpuStorage, Device, Storage, Tensor};
use zcuda::{
    AddInto, BlockActs, CudaSlice, CudaView, CudaViewMut, DeviceGrads, DeviceRepr, Family, GptGpu,
    GptShape, Pinned, Rows, RunParams, Staging, ValidAsZeroBits, Weights,
};
use zmodel::Batch;

use crate::adam::device_consts;
use crate::engine::Engine;
use crate::error::EngineError;
use crate::flat::{Bucket, GroupLayout, ParamSlot};
use crate::gather::Prefetcher;
use crate::group::Group;
use crate::micro_batch::MicroBatch;
use crate::precision::{Flat, Half, TASK};
use crate::StepStats;

impl From<zcuda::CudaError> for EngineError {
    fn from(e: zcuda::CudaError) -> EngineError {
        match e {
            zcuda::CudaError::OutOfMemory { .. } => EngineError::GpuOutOfMemory(e.to_string()),
            e => EngineError::Gpu(e.to_string()),
        }
    }
}

/// What a block keeps on the GPU between its forward and backward.
enum Saved {
    Acts(Box<BlockActs>),
    Input(Rows),
}

/// The shape of the job's model for the GPU, or why the GPU path cannot run
/// it ([`zconfig::spec::JobSpec::gpu_unsupported`]).
pub fn gpu_shape(spec: &zconfig::spec::JobSpec) -> Result<GptShape, String> {
    if let Some(why) = spec.gpu_unsupported() {
        return Err(why);
    }
    let m = &spec.model;
    let family = match m.kind {
        zconfig::spec::ModelKind::Gpt => Family::Gpt2,
        zconfig::spec::ModelKind::Llama => Family::Llama {
            kv_heads: m.kv_heads(),
            qkv_bias: m.qkv_biased(),
            qk_norm: m.qk_normed(),
            rope_theta: m.rope_theta(),
            rope_scaling: m.rope_scaling.clone(),
            rotary_dim: Some(m.rotary_dim()),
            window: m.sliding_window,
        },
    };
    Ok(GptShape {
        family,
        d_model: m.d_model,
        n_heads: m.n_heads,
        head_dim: m.head_dim(),
        ffn: m.ffn(),
        vocab: m.vocab_size,
        // GPT-2's position table is the model's context; LLaMA's rotary
        // table the job's sequences (LongRoPE's factors follow their length).
        seq_len: match m.learned_positions() {
            true => m.context(),
            false => m.seq_len,
        },
        eps: m.norm_eps() as f32,
    })
}

/// Uploads `tensors` (f32 on the CPU) read in place from their storage:
/// on the compute stream (`ahead` None), or on the upload stream through
/// `ahead`'s staging, returning at once ([`zcuda::Gpu::upload_ahead`]).
fn upload(
    gpu: &GptGpu,
    tensors: &[Tensor],
    ahead: Option<&mut Staging>,
) -> Result<Weights, EngineError> {
    let bad = || EngineError::Gpu("a parameter is not contiguous f32 on the CPU".into());
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let slices = guards
        .iter()
        .map(
            |(storage, layout)| match (&**storage, layout.contiguous_offsets()) {
                (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(&v[a..b]),
                _ => Err(bad()),
            },
        )
        .collect::<Result<Vec<&[f32]>, _>>()?;
    Ok(match ahead {
        None => gpu.upload(&slices)?,
        Some(staging) => Weights::from_parts(gpu.gpu().upload_ahead(&slices, staging)?),
    })
}

/// A whole group's parameters on the GPU, with the engine's parameter
/// version they were uploaded at (`Engine::params_version`: whether the
/// engine's parameters are still those).
struct DeviceCopy {
    version: u64,
    weights: Uploaded,
}

/// What an upload left on the GPU.
enum Uploaded {
    /// The model's weights.
    Ready(Arc<Weights>),
    /// Under 16 bits, the group's working copy, uploaded ahead of use: made
    /// into weights at the use ([`weights_from_words`]), so that the
    /// compute stream waits for the copy there and not before the block
    /// queued ahead of it.
    Words(zcuda::Half16, CudaSlice<u16>),
}

/// The host flow's buffers, per group.
#[derive(Default)]
pub(crate) struct HostFlow {
    /// The group's parameters on the GPU, where the stage keeps it whole.
    copies: Vec<Option<DeviceCopy>>,
    /// Per slot, the page-locked buffer its gradient lands in (made at first
    /// use, kept: allocating page-locked memory costs milliseconds).
    landing: Vec<Vec<Option<Pinned>>>,
    /// The page-locked buffers uploads ahead of use go through, used in
    /// turn: block `b`'s upload runs while block `b - 1` computes, and the
    /// one before it, whose staging `b + 1` refills, has run by then.
    staging: [Staging; 2],
    /// The same under 16 bits, where the working copy goes up.
    staging16: [Staging<u16>; 2],
}

/// A group's gradients on their way down: copies queued on the stream into
/// page-locked buffers, added into the host's buffers by
/// `Engine::gpu_finish_landing` once the GPU has more work queued.
struct Landing {
    group: usize,
    parts: Vec<(usize, Pinned)>,
}

/// A resident group's parameters.
enum ResidentParams {
    /// Whole, one buffer per slot (what the model reads); under 16 bits
    /// with the group's working copy, flat ([`Weights::with_half`]), which
    /// AdamW writes and the model's 16-bit products read.
    Whole(Arc<Weights>),
    /// Stage 3 over NCCL: this rank's slice of the flat buffer, gathered
    /// at each use.
    Slice(CudaSlice<f32>),
    /// Stage 3 over NCCL under 16 bits: this rank's slice of the working
    /// copy, gathered in 16 bits at each use.
    HalfSlice(CudaSlice<u16>),
}

/// The resident flow's state of one group on the GPU.
struct ResidentGroup {
    /// The model's weights (under 16 bits, the working copy and its values
    /// in f32).
    params: ResidentParams,
    /// f32 gradients over the flat range `held`, laid out as the host's: the
    /// group's whole buffer (padding included), into which micro-batches
    /// add, or at stages 2-3 on several ranks this rank's slice, to which each
    /// micro-batch's reduced slice is added. None where gradients are held
    /// in 16 bits (`half` holds them; CUDA refuses an empty allocation).
    grads: Option<CudaSlice<f32>>,
    held: std::ops::Range<usize>,
    /// The optimizer's moments over the region this rank updates (the
    /// group's whole flat buffer at stage 0, this rank's slice at stages
    /// 1-3), as the host's; no second under Lion.
    exp_avg: CudaSlice<f32>,
    exp_avg_sq: Option<CudaSlice<f32>>,
    /// `train.dtype: bf16 | f16` (one worker).
    half: Option<HalfGroup>,
}

/// A resident group's 16-bit state, as the host keeps it under mixed
/// precision: gradients in the working type, an f32 master copy.
struct HalfGroup {
    kind: zcuda::Half16,
    /// The gradients over the flat range `held` of the group's
    /// `ResidentGroup`, each f32 addend added and rounded as the host adds
    /// it (a micro-batch's gradient, or at stages 2-3 on several ranks
    /// each micro-batch's reduced slice); None under
    /// `train.grad_accum_dtype: f32`, whose gradients the group's f32
    /// `grads` hold.
    grads: Option<CudaSlice<u16>>,
    /// The f32 master weights over the region this rank updates: AdamW's
    /// target, which also writes their rounding into the working copy (the
    /// group's `ResidentParams`).
    master: CudaSlice<f32>,
}

impl ResidentGroup {
    /// The gradient at flat range `r` (inside `held`).
    fn grad(&self, r: std::ops::Range<usize>) -> CudaView<'_, f32> {
        self.f32_grads().slice(self.local(r))
    }

    fn grad_mut(&mut self, r: std::ops::Range<usize>) -> CudaViewMut<'_, f32> {
        let r = self.local(r);
        self.f32_grads_mut().slice_mut(r)
    }

    /// The f32 gradients, which every path but the 16-bit one (`half`)
    /// made and reads.
    fn f32_grads(&self) -> &CudaSlice<f32> {
        self.grads
            .as_ref()
            .expect("f32 gradients outside a 16-bit run")
    }

    fn f32_grads_mut(&mut self) -> &mut CudaSlice<f32> {
        self.grads
            .as_mut()
            .expect("f32 gradients outside a 16-bit run")
    }

    /// Flat range `r` (inside `held`) as indices into the held gradients.
    fn local(&self, r: std::ops::Range<usize>) -> std::ops::Range<usize> {
        r.start - self.held.start..r.end - self.held.start
    }
}

/// Stages 2-3 on several ranks: where a micro-batch's whole gradient of one
/// group lands before its reduce-scatter: f32, or under 16 bits the
/// working type, in which the host stages it (rounding each add).
struct Landings<T> {
    /// The embedding's (the tied head's part waits there for the
    /// embedding's backward, which comes last).
    embedding: CudaSlice<T>,
    /// Every other group's, one at a time; in f32 also the buffer the
    /// updated slices are gathered in (the largest group's length).
    shared: CudaSlice<T>,
}

impl<T: DeviceRepr + ValidAsZeroBits> Landings<T> {
    /// Landings for `groups`.
    fn new(gpu: &GptGpu, groups: &[Group]) -> Result<Landings<T>, EngineError> {
        Ok(Landings {
            embedding: gpu.gpu().zeros(groups[0].layout.padded)?,
            shared: gpu.gpu().zeros(largest(groups))?,
        })
    }

    /// Group `g`'s landing (the first `padded` values of its buffer).
    fn of(&mut self, g: usize, padded: usize) -> CudaViewMut<'_, T> {
        match g {
            0 => self.embedding.slice_mut(..padded),
            _ => self.shared.slice_mut(..padded),
        }
    }
}

/// What a collective over a partly frozen group's packed runs delivers
/// back into the group's buffer ([`over_trained_runs`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Delivers {
    /// This rank's runs (a reduce-scatter).
    Own,
    /// Every rank's (an all-reduce, an all-gather).
    All,
}

/// A collective `op` over NCCL on `buf`, a group's whole buffer (flat
/// indices), carrying only the runs that train where the group is frozen
/// in part, as the host's buckets carry them: every rank's runs are
/// copied into their chunks of a packed buffer ([`Bucket::trained_of`]:
/// each rank's padded to the longest rank's, so an element stays in its
/// owner's chunk), `op` runs on that, and the runs it `delivers` are
/// copied back. The rest of `buf` is left as it is: a frozen parameter's
/// gradient is zero on every rank, and its value moves on none.
fn over_trained_runs<T: DeviceRepr + ValidAsZeroBits>(
    gpu: &zcuda::Gpu,
    layout: &GroupLayout,
    rank: usize,
    buf: &mut CudaViewMut<T>,
    delivers: Delivers,
    op: impl FnOnce(&mut CudaViewMut<T>) -> Result<(), zcuda::CudaError>,
) -> Result<(), EngineError> {
    let runs = Bucket::trained_of(layout);
    let mut packed = gpu.zeros::<T>(runs.len)?;
    for r in 0..layout.world {
        for (_, range, at) in runs.chunk_runs(r) {
            let n = range.len();
            gpu.copy(&buf.slice(range), &mut packed.slice_mut(at..at + n))?;
        }
    }
    op(&mut packed.slice_mut(..))?;
    let back = match delivers {
        Delivers::Own => rank..rank + 1,
        Delivers::All => 0..layout.world,
    };
    for r in back {
        for (_, range, at) in runs.chunk_runs(r) {
            let n = range.len();
            gpu.copy(&packed.slice(at..at + n), &mut buf.slice_mut(range))?;
        }
    }
    Ok(())
}

/// NCCL's collective `op` on group `layout`'s whole f32 buffer `buf` (its
/// trained runs alone where the group is frozen in part,
/// [`over_trained_runs`]); `what` names it in a hang's report.
fn group_collective(
    gpu: &zcuda::Gpu,
    nccl: &mut zcuda::Nccl,
    (layout, rank): (&GroupLayout, usize),
    buf: &mut CudaViewMut<f32>,
    op: zcuda::NcclOp,
    what: &str,
) -> Result<(), EngineError> {
    let mut run = |b: &mut CudaViewMut<f32>| match op {
        zcuda::NcclOp::AllReduce => nccl.all_reduce_sum(b, what),
        zcuda::NcclOp::ReduceScatter => nccl.reduce_scatter_sum_in_place(b, what),
        zcuda::NcclOp::AllGather => nccl.all_gather_in_place(b, what),
    };
    if !layout.any_frozen() {
        return Ok(run(buf)?);
    }
    let delivers = match op {
        zcuda::NcclOp::ReduceScatter => Delivers::Own,
        _ => Delivers::All,
    };
    over_trained_runs(gpu, layout, rank, buf, delivers, run)
}

/// The largest group's padded length.
fn largest(groups: &[Group]) -> usize {
    groups.iter().map(|g| g.layout.padded).max().unwrap_or(0)
}

/// Whether the resident flow holds slot `s` of group `g` in its 16-bit
/// working copy alone, with no f32 values beside it (4 bytes a parameter
/// saved): a tensor only products read (zmodel's `product_operand`: the
/// linears' weights, an untied head's matrix; not the embedding's table,
/// whose rows the embedding gathers in f32), where the model's products
/// are 16-bit in the working copy's format `kind` (a GPU older than
/// compute capability 8.0 multiplies bf16 weights' f32 values).
fn held_in_16_bits(gpu: &GptGpu, kind: zcuda::Half16, g: usize, s: &ParamSlot) -> bool {
    g != 0 && s.product_operand && gpu.half_products() == Some(kind)
}

/// Group `g`'s weights from its 16-bit working copy on the device (`flat`,
/// the group's padded layout, format `kind`): the copy, which 16-bit
/// products read, and the f32 values of the tensors not held in it alone
/// ([`held_in_16_bits`]), widened from it.
fn weights_from_words(
    gpu: &GptGpu,
    kind: zcuda::Half16,
    g: usize,
    slots: &[ParamSlot],
    flat: CudaSlice<u16>,
) -> Result<Weights, EngineError> {
    let mut parts = Vec::with_capacity(slots.len());
    for s in slots {
        if held_in_16_bits(gpu, kind, g, s) {
            parts.push(None);
            continue;
        }
        let mut t = gpu.gpu().zeros(s.range.len())?;
        gpu.gpu()
            .widen16(kind, &flat.slice(s.range.clone()), &mut t.slice_mut(..))?;
        parts.push(Some(t));
    }
    let ranges = slots.iter().map(|s| s.range.clone()).collect();
    Ok(Weights::with_half(parts, kind, flat, ranges)?)
}

/// Host flow: group `g`'s 16-bit working copy on the host, to upload in
/// place of its f32 values (half the bytes over PCIe, and the products
/// read it as it is), where the stage keeps the group whole and the model's
/// products are 16-bit in its format; else None (f32 tensors go up).
fn host_words<'a>(
    groups: &'a [Group],
    half: Option<Half>,
    gpu: &GptGpu,
    g: usize,
) -> Option<(zcuda::Half16, &'a [u16])> {
    let kind = half?;
    match (&groups[g].params, groups[g].partitioned) {
        (Flat::Half(_, words), false) if gpu.half_products() == Some(kind) => Some((kind, words)),
        _ => None,
    }
}

/// Under 16 bits over NCCL, what the collectives pass through, so that
/// they move what the host's move: gradients summed in f32 (widened,
/// reduced, rounded or added back into 16 bits) and the updated working
/// copies gathered in 16 bits.
struct HalfComm {
    /// Stages 2-3 on several ranks.
    landings: Option<Landings<u16>>,
    /// A group's gradient widened for its reduction.
    wide: CudaSlice<f32>,
}

/// What the resident step needs of a group's layout.
struct StepPlan {
    /// This rank's slice: the gradient norm adds it.
    own: std::ops::Range<usize>,
    /// The region this rank updates (flat indices).
    region: std::ops::Range<usize>,
    /// Each slot's flat range and whether it decays.
    slots: Vec<(std::ops::Range<usize>, bool)>,
    /// Each slot's `train.freeze`: left out of the update.
    frozen: Vec<bool>,
}

impl StepPlan {
    /// Each trained slot's part inside the region: (slot, flat range). A
    /// frozen slot's parameters, moments and working copy stay as they
    /// are, as the host's update leaves them.
    fn pieces(&self) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
        self.slots.iter().enumerate().filter_map(|(i, (r, _))| {
            let (lo, hi) = (r.start.max(self.region.start), r.end.min(self.region.end));
            (lo < hi && !self.frozen[i]).then_some((i, lo..hi))
        })
    }
}

/// Every group's parameters, gradients and moments on the GPU (the resident
/// flow). The host's buffers are stale meanwhile: the state readers
/// (checkpoints, exports) download from here.
pub(crate) struct Resident {
    groups: Vec<ResidentGroup>,
    /// Stages 2-3 on several ranks in f32 (gradients partitioned).
    landings: Option<Landings<f32>>,
    /// 16 bits over NCCL.
    half_comm: Option<HalfComm>,
}

impl Resident {
    /// Multiplies each group's f32 gradients over the region this rank
    /// updates by `factor` (averaging, clipping: the host's f32 arithmetic).
    fn scale_f32_grads(
        &mut self,
        gpu: &GptGpu,
        plans: &[StepPlan],
        factor: f32,
    ) -> Result<(), EngineError> {
        for (g, p) in self.groups.iter_mut().zip(plans) {
            gpu.gpu().scale(&mut g.grad_mut(p.region.clone()), factor)?;
        }
        Ok(())
    }

    /// Where group `g`'s micro-batch gradients are added: its own buffer,
    /// or at stages 2-3 its landing (the first `padded` values).
    fn landing(&mut self, g: usize, padded: usize) -> CudaViewMut<'_, f32> {
        match &mut self.landings {
            Some(l) => l.of(g, padded),
            None => self.groups[g].f32_grads_mut().slice_mut(..),
        }
    }
}

impl Engine {
    /// Runs this engine's forward and backward on `gpu` from now on.
    pub fn attach_gpu(&mut self, gpu: GptGpu) {
        self.gpu = Some(Arc::new(gpu));
        self.gpu_host = HostFlow {
            copies: (0..self.groups.len()).map(|_| None).collect(),
            landing: self
                .groups
                .iter()
                .map(|g| g.layout.params.iter().map(|_| None).collect())
                .collect(),
            staging: Default::default(),
            staging16: Default::default(),
        };
        self.gpu_resident = None;
    }

    /// The GPU the micro-batches run on, if any.
    pub fn gpu(&self) -> Option<&GptGpu> {
        self.gpu.as_deref()
    }

    /// Reduces gradients between the GPUs over `nccl` from now on (the
    /// resident flow on several workers, at every ZeRO stage).
    pub fn attach_nccl(&mut self, nccl: zcuda::Nccl) {
        self.nccl = Some(nccl);
        self.gpu_resident = None;
    }

    /// Whether the optimizer runs on the GPU with every state resident there
    /// (one worker with every group whole, or several over NCCL; f32 or 16
    /// bits; no offload), rather than on the host.
    pub fn gpu_resident(&self) -> bool {
        let z = &self.spec.zero;
        self.gpu.is_some()
            && (self.comm.world_size() == 1 || self.nccl.is_some())
            && self.hpz.is_none()
            && self.offload.is_none()
            && z.offload_optimizer.device == zconfig::spec::OffloadDevice::None
            && z.offload_param.device == zconfig::spec::OffloadDevice::None
            && (self.nccl.is_some() || self.groups.iter().all(|g| !g.partitioned))
    }

    /// Resident at stages 2-3 on several ranks: each micro-batch's gradients
    /// are reduce-scattered over NCCL as each group's are complete, and
    /// this rank keeps its slice only.
    fn gpu_sliced_grads(&self) -> bool {
        self.nccl.is_some() && self.stage.partitions_gradients() && self.comm.world_size() > 1
    }

    /// The resident state, uploaded from the host's buffers the first time
    /// (and after a load, which drops it).
    fn resident(&mut self, gpu: &GptGpu) -> Result<&mut Resident, EngineError> {
        if self.gpu_resident.is_none() {
            let (rank, stage) = (self.comm.rank(), self.stage);
            let second = self.spec.train.optimizer.kind.second_moment();
            let sliced = self.gpu_sliced_grads();
            let mut groups = Vec::with_capacity(self.groups.len());
            for (gi, g) in self.groups.iter().enumerate() {
                // f32 values of the working parameters in `r` (under 16 bits
                // only those of the tensors that are not held in 16 bits).
                let f32_of = |r: std::ops::Range<usize>| g.params.to_f32(r);
                let slots = &g.layout.params;
                let up = |s: &ParamSlot| -> Result<CudaSlice<f32>, EngineError> {
                    Ok(gpu.gpu().upload(&f32_of(s.range.clone()))?)
                };
                let held = match sliced {
                    true => g.layout.slice(rank),
                    false => 0..g.layout.padded,
                };
                // The host's 16-bit working copy, its words as they are.
                let working = || -> Result<CudaSlice<u16>, EngineError> {
                    match &g.params {
                        Flat::Half(_, words) => Ok(gpu.gpu().upload(words)?),
                        Flat::F32(_) => Err(EngineError::Gpu(format!(
                            "group {}: 16-bit training with f32 working parameters",
                            g.layout.name
                        ))),
                    }
                };
                let half_kind = self.half;
                let params = match (g.partitioned, half_kind) {
                    (true, None) => {
                        ResidentParams::Slice(gpu.gpu().upload(&f32_of(0..g.params.len()))?)
                    }
                    (true, Some(_)) => ResidentParams::HalfSlice(working()?),
                    (false, None) => {
                        let parts = slots.iter().map(up).collect::<Result<_, _>>()?;
                        ResidentParams::Whole(Arc::new(Weights::from_parts(parts)))
                    }
                    (false, Some(kind)) => {
                        let parts = slots
                            .iter()
                            .map(|s| match held_in_16_bits(gpu, kind, gi, s) {
                                true => Ok(None),
                                false => up(s).map(Some),
                            })
                            .collect::<Result<_, EngineError>>()?;
                        let ranges = slots.iter().map(|s| s.range.clone()).collect();
                        let w = Weights::with_half(parts, kind, working()?, ranges)?;
                        ResidentParams::Whole(Arc::new(w))
                    }
                };
                let half = match (half_kind, &g.master) {
                    (None, _) => None,
                    (Some(kind), Some(master)) => Some(HalfGroup {
                        kind,
                        grads: match self.grads_half {
                            Some(_) => Some(gpu.gpu().zeros(held.len())?),
                            None => None,
                        },
                        master: gpu.gpu().upload(master)?,
                    }),
                    (Some(_), None) => {
                        return Err(EngineError::Gpu(format!(
                            "group {}: 16-bit parameters without their master copy",
                            g.layout.name
                        )))
                    }
                };
                // A whole frozen group holds no moments on the host: zeros
                // here (its slots are left out of every update).
                let (exp_avg, exp_avg_sq) = g.checkpoint_moments(rank, stage, second);
                groups.push(ResidentGroup {
                    params,
                    grads: match self.grads_half {
                        Some(_) => None,
                        None => Some(gpu.gpu().zeros(held.len())?),
                    },
                    held,
                    exp_avg: gpu.gpu().upload(&exp_avg)?,
                    exp_avg_sq: match exp_avg_sq.is_empty() {
                        true => None,
                        false => Some(gpu.gpu().upload(&exp_avg_sq)?),
                    },
                    half,
                });
            }
            let (landings, half_comm) = match (self.grads_half, &self.nccl) {
                (None, _) => (
                    sliced
                        .then(|| Landings::new(gpu, &self.groups))
                        .transpose()?,
                    None,
                ),
                (Some(_), None) => (None, None),
                (Some(_), Some(_)) => {
                    let n = largest(&self.groups);
                    let half_comm = HalfComm {
                        landings: sliced
                            .then(|| Landings::new(gpu, &self.groups))
                            .transpose()?,
                        wide: gpu.gpu().zeros(n)?,
                    };
                    (None, Some(half_comm))
                }
            };
            self.gpu_resident = Some(Resident {
                groups,
                landings,
                half_comm,
            });
        }
        Ok(self.gpu_resident.as_mut().expect("just made"))
    }

    /// Group `g`'s parameters on the GPU. Resident: the group's own. Host
    /// flow: where the engine keeps the group whole (stages 0-2) its device
    /// copy lasts until the parameters change (an update, a load: a new
    /// `Engine::params_version`), and the next use uploads again; so forward
    /// and backward, and every micro-batch of a step, upload a group once
    /// (under 16 bits its working copy, with no f32 tensors made on the
    /// host). Stage 3's gathered groups are uploaded at each use, as they
    /// are gathered at each use.
    fn gpu_weights(
        &mut self,
        gpu: &GptGpu,
        gather: &mut Prefetcher,
        g: usize,
    ) -> Result<Arc<Weights>, EngineError> {
        if self.gpu_resident() {
            if let ResidentParams::Whole(w) = &self.resident(gpu)?.groups[g].params {
                return Ok(w.clone());
            }
            return self.gpu_gather_params(gpu, g);
        }
        let (version, whole) = (self.params_version, !self.groups[g].partitioned);
        let current = self.gpu_host.copies[g]
            .take()
            .filter(|c| c.version == version);
        if let Some(copy) = current.filter(|_| whole) {
            let weights = match copy.weights {
                Uploaded::Ready(w) => w,
                Uploaded::Words(kind, flat) => {
                    let slots = &self.groups[g].layout.params;
                    Arc::new(weights_from_words(gpu, kind, g, slots, flat)?)
                }
            };
            self.gpu_host.copies[g] = Some(DeviceCopy {
                version,
                weights: Uploaded::Ready(weights.clone()),
            });
            return Ok(weights);
        }
        let weights = Arc::new(match host_words(&self.groups, self.half, gpu, g) {
            Some((kind, words)) => {
                let flat = gpu.gpu().upload(words)?;
                weights_from_words(gpu, kind, g, &self.groups[g].layout.params, flat)?
            }
            None => upload(gpu, &self.params_for(g, gather)?, None)?,
        });
        if whole {
            self.gpu_host.copies[g] = Some(DeviceCopy {
                version,
                weights: Uploaded::Ready(weights.clone()),
            });
        }
        Ok(weights)
    }

    /// Host flow: starts uploading group `g`'s parameters ahead of their
    /// use, on the GPU's upload stream, so that the copy runs while the
    /// block before computes (ZeRO-Offload's updated parameters going back
    /// to the GPU overlapped with the forward). Only where the stage keeps
    /// the group whole and its device copy is stale (the first micro-batch
    /// after an update); a no-op otherwise, and in the resident flow.
    fn gpu_upload_ahead(
        &mut self,
        gpu: &GptGpu,
        gather: &mut Prefetcher,
        g: usize,
    ) -> Result<(), EngineError> {
        if self.gpu_resident() || self.groups.get(g).is_none_or(|group| group.partitioned) {
            return Ok(());
        }
        let version = self.params_version;
        if matches!(&self.gpu_host.copies[g], Some(copy) if copy.version == version) {
            return Ok(());
        }
        let weights = match host_words(&self.groups, self.half, gpu, g) {
            Some((kind, words)) => {
                let staging = &mut self.gpu_host.staging16[g % 2];
                let mut flat = gpu.gpu().upload_ahead(&[words], staging)?;
                Uploaded::Words(kind, flat.pop().expect("one part uploaded"))
            }
            None => {
                let tensors = self.params_for(g, gather)?;
                let staging = &mut self.gpu_host.staging[g % 2];
                Uploaded::Ready(Arc::new(upload(gpu, &tensors, Some(staging))?))
            }
        };
        self.gpu_host.copies[g] = Some(DeviceCopy { version, weights });
        Ok(())
    }

    /// Stage 3 over NCCL: group `g`'s parameters for one use, gathered from
    /// every rank's slice (an in-place all-gather; under 16 bits of the
    /// working copies, as the host gathers them, which the model's 16-bit
    /// products then read), then cut into the slots' f32 tensors. Freed
    /// when the use drops them.
    fn gpu_gather_params(&mut self, gpu: &GptGpu, g: usize) -> Result<Arc<Weights>, EngineError> {
        let layout = &self.groups[g].layout;
        let (padded, own) = (layout.padded, layout.slice(self.comm.rank()));
        let slots: Vec<_> = layout.params.iter().map(|s| s.range.clone()).collect();
        let (Some(r), Some(nccl)) = (self.gpu_resident.as_mut(), self.nccl.as_mut()) else {
            return Err(EngineError::Gpu(
                "stage 3 over NCCL without its state".into(),
            ));
        };
        let what = format!("group {g}'s parameters");
        let group = &r.groups[g];
        let mut parts = Vec::with_capacity(slots.len());
        match (&group.params, &group.half) {
            (ResidentParams::Slice(mine), _) => {
                let mut buf = gpu.gpu().zeros(padded)?;
                gpu.gpu().copy(&mine.slice(..), &mut buf.slice_mut(own))?;
                nccl.all_gather_in_place(&mut buf.slice_mut(..), &what)?;
                for range in slots {
                    let mut t = gpu.gpu().zeros(range.len())?;
                    gpu.gpu().copy(&buf.slice(range), &mut t.slice_mut(..))?;
                    parts.push(t);
                }
            }
            (ResidentParams::HalfSlice(mine), Some(h)) => {
                let mut flat = gpu.gpu().zeros(padded)?;
                gpu.gpu().copy(&mine.slice(..), &mut flat.slice_mut(own))?;
                nccl.all_gather16_in_place(&mut flat.slice_mut(..), &what)?;
                let w = weights_from_words(gpu, h.kind, g, &layout.params, flat)?;
                return Ok(Arc::new(w));
            }
            _ => return Err(EngineError::Gpu(format!("group {g} is not partitioned"))),
        }
        Ok(Arc::new(Weights::from_parts(parts)))
    }

    /// Stage 3 over NCCL: waits (to the deadline) for the gathers queued
    /// so far, before a call that waits for the GPU without one.
    fn gpu_nccl_wait(&mut self) -> Result<(), EngineError> {
        if let Some(nccl) = self.nccl.as_mut() {
            nccl.wait()?;
        }
        Ok(())
    }

    /// Done with group `g`'s parameters (host flow: its gather released).
    fn gpu_release(&mut self, g: usize) {
        if !self.gpu_resident() {
            self.release(g);
        }
    }

    /// Adds gradients of group `g`'s slots (`(slot, gradient)`, each the
    /// slot's whole length) into the micro-batch's gradient: on the GPU
    /// (resident), or downloaded into the host's buffer (host flow).
    fn gpu_add_grads(
        &mut self,
        gpu: &GptGpu,
        g: usize,
        grads: &[(usize, &CudaSlice<f32>)],
    ) -> Result<(), EngineError> {
        match self.gpu_send_grads(gpu, g, grads)? {
            Some(landing) => self.gpu_finish_landing(landing),
            None => Ok(()),
        }
    }

    /// Resident: adds the gradients on the GPU (returns `None`). Host flow:
    /// queues their copies down into the group's page-locked buffers and
    /// returns them, to be added by [`Engine::gpu_finish_landing`] after
    /// more work for the GPU is queued, so that the host's adds overlap the
    /// GPU's next block.
    fn gpu_send_grads(
        &mut self,
        gpu: &GptGpu,
        g: usize,
        grads: &[(usize, &CudaSlice<f32>)],
    ) -> Result<Option<Landing>, EngineError> {
        // A frozen parameter's gradient that the GPU's backward still makes
        // (a norm's or a bias's; frozen weights make none) is dropped here:
        // its part of the group's gradient stays zero, as the host's (out
        // of the norm and of the host's reductions).
        let trained: Vec<(usize, &CudaSlice<f32>)> = (grads.iter())
            .filter(|(slot, _)| !self.groups[g].layout.params[*slot].frozen)
            .copied()
            .collect();
        let grads = trained.as_slice();
        if grads.is_empty() {
            return Ok(None);
        }
        if self.gpu_resident() {
            let starts: Vec<usize> = self.groups[g]
                .layout
                .params
                .iter()
                .map(|s| s.range.start)
                .collect();
            let padded = self.groups[g].layout.padded;
            let r = self.resident(gpu)?;
            let half = r.groups[g].half.as_mut();
            if let Some((kind, grads16)) = half.and_then(|h| Some((h.kind, h.grads.as_mut()?))) {
                // Stages 2-3 on several ranks: the 16-bit landing.
                let mut acc = match r.half_comm.as_mut().and_then(|c| c.landings.as_mut()) {
                    Some(l) => l.of(g, padded),
                    None => grads16.slice_mut(..),
                };
                gpu.gpu()
                    .add_runs(AddInto::Half(kind, &mut acc), &views(&starts, grads))?;
                return Ok(None);
            }
            let mut landing = r.landing(g, padded);
            gpu.gpu()
                .add_runs(AddInto::F32(&mut landing), &views(&starts, grads))?;
            return Ok(None);
        }
        let mut parts = Vec::with_capacity(grads.len());
        for &(slot, grad) in grads {
            let mut pinned = match self.gpu_host.landing[g][slot].take() {
                Some(p) if p.len() == grad.len() => p,
                _ => gpu.gpu().pinned(grad.len())?,
            };
            gpu.gpu().copy_to_pinned(grad, &mut pinned)?;
            parts.push((slot, pinned));
        }
        Ok(Some(Landing { group: g, parts }))
    }

    /// Waits for a landing's copies and adds them into the group's
    /// micro-batch gradient on the host; keeps the buffers for the next.
    fn gpu_finish_landing(&mut self, landing: Landing) -> Result<(), EngineError> {
        let g = landing.group;
        let slots = self.groups[g].layout.params.clone();
        for (slot, pinned) in landing.parts {
            self.add_values_to(
                g,
                slots[slot].range.clone(),
                pinned.values()?,
                &slots[slot].name,
            )?;
            self.gpu_host.landing[g][slot] = Some(pinned);
        }
        Ok(())
    }

    /// Group `g`'s gradient is complete for this micro-batch (host flow: its
    /// bucket may leave).
    fn gpu_group_done(&mut self, g: usize, reduce_now: bool) -> Result<(), EngineError> {
        if !self.gpu_resident() {
            // (The host's buckets leave wholly frozen groups out.)
            if reduce_now {
                self.group_done(g)?;
            }
        } else if self.gpu_sliced_grads() && !self.groups[g].layout.all_frozen() {
            self.gpu_reduce_scatter_group(g)?;
        }
        Ok(())
    }

    /// Stages 2-3 over NCCL: group `g`'s micro-batch gradient, complete in its
    /// landing, reduce-scattered in place (under 16 bits, widened first);
    /// this rank's slice added into the group's, as the host adds each
    /// micro-batch's reduced slice; the landing zeroed for the next group.
    fn gpu_reduce_scatter_group(&mut self, g: usize) -> Result<(), EngineError> {
        let gpu = self.gpu.clone().expect("a GPU attached");
        let (padded, own) = (
            self.groups[g].layout.padded,
            self.groups[g].layout.slice(self.comm.rank()),
        );
        let what = format!("group {g}'s gradients");
        let no_landings = || EngineError::Gpu("stages 2-3 over NCCL without landings".into());
        let (Some(r), Some(nccl)) = (self.gpu_resident.as_mut(), self.nccl.as_mut()) else {
            return Err(EngineError::Gpu(
                "stages 2-3 over NCCL without their state".into(),
            ));
        };
        let group = &mut r.groups[g];
        let rs = zcuda::NcclOp::ReduceScatter;
        let of = (&self.groups[g].layout, self.comm.rank());
        if let (Some(h), Some(hc)) = (group.half.as_mut(), r.half_comm.as_mut()) {
            let grads16 = (h.grads.as_mut())
                .ok_or_else(|| EngineError::Gpu("16-bit gradients missing on the GPU".into()))?;
            let mut landing = hc.landings.as_mut().ok_or_else(no_landings)?.of(g, padded);
            let mut wide = hc.wide.slice_mut(..padded);
            gpu.gpu().widen16(h.kind, &landing.slice(..), &mut wide)?;
            group_collective(gpu.gpu(), nccl, of, &mut wide, rs, &what)?;
            gpu.gpu()
                .add_into16(h.kind, &mut grads16.slice_mut(..), &wide.slice(own))?;
            gpu.gpu().fill_zero(&mut landing)?;
            return Ok(());
        }
        let mut landing = r.landings.as_mut().ok_or_else(no_landings)?.of(g, padded);
        group_collective(gpu.gpu(), nccl, of, &mut landing, rs, &what)?;
        gpu.gpu()
            .add(&mut group.grad_mut(own.clone()), &landing.slice(own))?;
        gpu.gpu().fill_zero(&mut landing)?;
        Ok(())
    }

    /// Host flow: block `b`'s gradients added, its parameters released, its
    /// bucket handed on.
    fn gpu_finish_block(
        &mut self,
        b: usize,
        l: Landing,
        reduce_now: bool,
    ) -> Result<(), EngineError> {
        self.gpu_finish_landing(l)?;
        self.gpu_release(b);
        self.gpu_group_done(b, reduce_now)
    }

    /// The embedding on the GPU: `[b, t, d]` rows.
    fn gpu_embed(
        &mut self,
        gpu: &GptGpu,
        gather: &mut Prefetcher,
        batch: &Batch,
    ) -> Result<Rows, EngineError> {
        let w = self.gpu_weights(gpu, gather, 0)?;
        let first = batch.documents.as_ref().map(|d| d.per_token());
        let x = gpu.embed_documents(&batch.inputs, first, batch.rows, batch.seq_len, &w)?;
        self.gpu_release(0);
        Ok(x)
    }

    /// The head's parameters, and the embedding's when the head is tied to
    /// it (released by [`Engine::gpu_release_head`]).
    fn gpu_head_weights(
        &mut self,
        gpu: &GptGpu,
        gather: &mut Prefetcher,
    ) -> Result<(Arc<Weights>, Option<Arc<Weights>>), EngineError> {
        let head = self.model.config().n_layers + 1;
        let w = self.gpu_weights(gpu, gather, head)?;
        let tied = self.spec.model.tied();
        let wte = match tied {
            true => Some(self.gpu_weights(gpu, gather, 0)?),
            false => None,
        };
        Ok((w, wte))
    }

    fn gpu_release_head(&mut self, tied: bool) {
        self.gpu_release(self.model.config().n_layers + 1);
        if tied {
            self.gpu_release(0);
        }
    }

    /// One micro-batch's forward and backward on the GPU; its loss, as
    /// [`Engine::forward_backward`] returns it.
    pub(crate) fn gpu_forward_backward(
        &mut self,
        mb: &mut MicroBatch,
        batch: &Batch,
    ) -> Result<f64, EngineError> {
        let gpu = self.gpu.clone().expect("a GPU attached");
        let (gather, reduce_now) = (&mut mb.gather, mb.reduce_now);
        let n_layers = self.model.config().n_layers;
        let checkpointing = self.spec.train.activation_checkpointing;
        self.gpu_upload_ahead(&gpu, gather, 1)?;
        let mut x = self.gpu_embed(&gpu, gather, batch)?;
        // NEFTune's noise, then the hidden dropout's site 0: the CPU
        // model's masks and draws (zmodel's keys, the same hash).
        let embedding_mask = mb.dropout.hidden.map(|d| mask(d.site(0)));
        let noise = mb.noise.map(|z| zcuda::Noise {
            magnitude: z.magnitude(),
            key: z.key(),
        });
        gpu.noise_and_dropout(&mut x, noise, embedding_mask)?;
        // Each group's frozen tensors: a block keeps no input of a frozen
        // weight, and its backward makes no gradient of one.
        let flags: Vec<Vec<bool>> = (self.groups.iter())
            .map(|g| g.layout.params.iter().map(|p| p.frozen).collect())
            .collect();
        let frozen = |group: usize| flags[group].as_slice();
        // Block b's: its site's sites 0 (attention's output) and 1 (the
        // MLP's), and its site's attention probabilities.
        let block_masks = |b: usize| {
            let site = mb.dropout.site(b as u64);
            zcuda::Dropouts {
                hidden: site.hidden.map(|d| [mask(d.site(0)), mask(d.site(1))]),
                attention: site.attention.map(mask),
            }
        };
        let mut saved = Vec::with_capacity(n_layers);
        for block in 1..=n_layers {
            let w = self.gpu_weights(&gpu, gather, block)?;
            self.gpu_release(block);
            if block < n_layers {
                self.gpu_upload_ahead(&gpu, gather, block + 1)?;
            }
            let (y, acts) = gpu.block_forward(&w, x, block_masks(block), frozen(block))?;
            // Backward stops above frozen blocks: nothing of theirs is kept.
            if block >= self.backward_reach {
                saved.push(match checkpointing {
                    true => Saved::Input(acts.into_input()),
                    false => Saved::Acts(Box::new(acts)),
                });
            }
            x = y;
        }
        self.forward_done = Some(std::time::Instant::now());

        let head = n_layers + 1;
        let (hw, wte) = self.gpu_head_weights(&gpu, gather)?;
        let tied = wte.is_some();
        let scale = self.seed_scale();
        self.gpu_nccl_wait()?; // the head downloads its loss
        let output = !self.model.frozen_output();
        let res = gpu.head(
            &x,
            &hw,
            wte.as_deref(),
            &batch.targets,
            scale,
            batch.divisor,
            zcuda::HeadPass::Backward { output },
        )?;
        drop((x, hw, wte));
        if !res.loss.is_finite() {
            return Err(EngineError::NonFinite {
                step: self.step + 1,
                what: "loss",
                value: res.loss,
            });
        }
        let hg = res.grads.as_ref().expect("the head's backward ran");
        // The norm's gradients, then an untied output matrix's.
        // (No output matrix's where it is frozen.)
        let mut grads: Vec<_> = hg.norm.iter().enumerate().collect();
        if let (Some(out), false) = (&hg.out, tied) {
            grads.push((hg.norm.len(), out));
        }
        self.gpu_add_grads(&gpu, head, &grads)?;
        if let (Some(out), true) = (&hg.out, tied) {
            self.gpu_add_grads(&gpu, 0, &[(0, out)])?;
        }
        self.gpu_release_head(tied);
        self.gpu_group_done(head, reduce_now)?;

        let mut dx = res.dx.expect("the head's backward ran");
        let gather = &mut mb.gather;
        // Host flow: block b's gradients are added on the host while the GPU
        // runs block b - 1's backward.
        let mut landing: Option<(usize, Landing)> = None;
        for block in (self.backward_reach.max(1)..=n_layers).rev() {
            let w = self.gpu_weights(&gpu, gather, block)?;
            let acts = match saved.pop() {
                Some(Saved::Acts(acts)) => *acts,
                Some(Saved::Input(x)) => {
                    gpu.block_forward(&w, x, block_masks(block), frozen(block))?
                        .1
                }
                None => return Err(EngineError::Gpu(format!("block {block}: nothing saved"))),
            };
            let (grads, next) = gpu.block_backward(&w, &acts, &dx, frozen(block))?;
            drop((acts, w));
            let by_slot: Vec<_> = (grads.iter().enumerate())
                .filter_map(|(slot, g)| Some((slot, g.as_ref()?)))
                .collect();
            let sent = self.gpu_send_grads(&gpu, block, &by_slot)?;
            if let Some((b, l)) = landing.take() {
                self.gpu_finish_block(b, l, reduce_now)?;
            }
            match sent {
                Some(l) => landing = Some((block, l)),
                None => {
                    self.gpu_release(block);
                    self.gpu_group_done(block, reduce_now)?;
                }
            }
            dx = next;
        }
        if let Some((b, l)) = landing.take() {
            self.gpu_finish_block(b, l, reduce_now)?;
        }
        // A frozen embedding (backward stopped above it) takes no gradient.
        let embedding_trains = self.backward_reach == 0;
        if self.gpu_resident() {
            if embedding_trains {
                // The host's scatter-add, to the bit, on the GPU.
                let first = batch.documents.as_ref().map(|d| d.per_token());
                // The dropped embeddings' gradient, through the same mask.
                gpu.noise_and_dropout(&mut dx, None, embedding_mask)?;
                let grads = gpu.embed_backward(&batch.inputs, first, &dx)?;
                let by_slot: Vec<_> = grads.iter().enumerate().collect();
                self.gpu_add_grads(&gpu, 0, &by_slot)?;
                self.gpu_group_done(0, reduce_now)?;
            }
            if let Some(nccl) = self.nccl.as_mut().filter(|_| reduce_now) {
                // The next micro-batch's first download would wait on these
                // reductions with no deadline: wait here, with one.
                nccl.wait()?;
            }
        } else if embedding_trains {
            let (b, t) = dx.dims();
            let d = self.spec.model.d_model;
            let dx = Tensor::from_vec(gpu.download(&dx)?, (b, t, d), &Device::Cpu)?;
            self.backward_embedding(mb, &dx)?;
        }
        Ok(res.loss)
    }

    /// One batch's loss on the GPU, forward only.
    pub(crate) fn gpu_forward_loss(
        &mut self,
        gather: &mut Prefetcher,
        batch: &Batch,
    ) -> Result<f64, EngineError> {
        let gpu = self.gpu.clone().expect("a GPU attached");
        let mut x = self.gpu_embed(&gpu, gather, batch)?;
        for block in 1..=self.model.config().n_layers {
            let w = self.gpu_weights(&gpu, gather, block)?;
            self.gpu_release(block);
            // No backward follows: as if every tensor were frozen, no
            // input is kept for one.
            let as_if_frozen = vec![true; w.tensors()];
            x = gpu
                .block_forward(&w, x, zcuda::Dropouts::default(), &as_if_frozen)?
                .0;
        }
        let (hw, wte) = self.gpu_head_weights(&gpu, gather)?;
        let tied = wte.is_some();
        self.gpu_nccl_wait()?; // the head downloads its loss
        let loss = gpu
            .head(
                &x,
                &hw,
                wte.as_deref(),
                &batch.targets,
                1.0,
                batch.divisor,
                zcuda::HeadPass::Loss,
            )?
            .loss;
        self.gpu_release_head(tied);
        Ok(loss)
    }

    /// The resident flow's optimizer step: the host step's phases on the
    /// GPU's buffers, in its order and with its operations (the reduction
    /// between GPUs, averaging and clipping by in-place multiplies over the
    /// region this rank updates, the norm over its slice in the host's chunks
    /// and f64 lanes, AdamW's kernel per slot, the updated slices gathered),
    /// so the same bits as the host flow.
    pub(crate) fn gpu_step(&mut self) -> Result<StepStats, EngineError> {
        let gpu = self.gpu.clone().expect("a GPU attached");
        let step = self.step + 1;
        let scale = self.average_scale();
        let clip = self.spec.train.grad_clip;
        let (rank, stage) = (self.comm.rank(), self.stage);
        let sliced = stage.partitions_optimizer() && self.comm.world_size() > 1;
        let plans: Vec<StepPlan> = self
            .groups
            .iter()
            .map(|g| StepPlan {
                own: g.layout.slice(rank),
                region: g.updated_region(rank, stage),
                slots: g
                    .layout
                    .params
                    .iter()
                    .map(|s| (s.range.clone(), s.decay))
                    .collect(),
                frozen: g.layout.params.iter().map(|s| s.frozen).collect(),
            })
            .collect();
        let reduced_already = self.gpu_sliced_grads();
        self.resident(&gpu)?;
        if self.half.is_some() {
            return self.gpu_step_half(&gpu, &plans, reduced_already, sliced);
        }
        self.gpu_reduce_f32_grads(&gpu, !reduced_already, sliced)?;
        let r = self.gpu_resident.as_mut().expect("just made");
        if scale != 1.0 {
            r.scale_f32_grads(&gpu, &plans, scale)?;
        }
        let mut own_sq = 0f64;
        let grads: Vec<_> = r
            .groups
            .iter()
            .zip(&plans)
            .map(|(g, p)| DeviceGrads::F32(g.grad(p.own.clone())))
            .collect();
        for parts in gpu.gpu().sum_sq_chunks_of_each(&grads, TASK, 1.0)? {
            own_sq += parts.iter().sum::<f64>();
        }
        let grad_norm = self.norm_from_own_sq(own_sq)?;
        let overflow = self.check_overflow(step, grad_norm)?;
        let lr = self.next_lr();
        if !overflow {
            self.updates += 1;
            let hp = self.adam_step(lr, 1.0);
            let r = self.gpu_resident.as_mut().expect("resident");
            if clip > 0.0 && grad_norm > clip {
                let coef = (clip / (grad_norm + 1e-6)) as f32;
                r.scale_f32_grads(&gpu, &plans, coef)?;
            }
            for (g, p) in r.groups.iter_mut().zip(&plans) {
                let ResidentGroup {
                    params,
                    grads,
                    held,
                    exp_avg,
                    exp_avg_sq,
                    ..
                } = g;
                let grads = grads.as_ref().expect("f32 gradients outside a 16-bit run");
                let mut params = match params {
                    ResidentParams::Whole(w) => Ok(Arc::get_mut(w)
                        .ok_or_else(|| {
                            EngineError::Gpu("parameters still in use at the step".into())
                        })?
                        .parts_mut()),
                    ResidentParams::Slice(mine) => Err(mine),
                    ResidentParams::HalfSlice(_) => {
                        return Err(EngineError::Gpu("16-bit parameters in an f32 step".into()))
                    }
                };
                // One launch over the region's tensors (each with its own
                // decay), indexed from the region's start in the gradients
                // and moments; the parameters the slots' own tensors (whole)
                // or the region's values (a slice).
                let region = p.region.clone();
                let n = region.len();
                let runs: Vec<_> = (p.pieces())
                    .map(|(i, at)| (at.start - region.start..at.end - region.start, p.slots[i].1))
                    .collect();
                let (mut own, mut mine_view) = (Vec::new(), None);
                let targets = match &mut params {
                    Ok(parts) => {
                        // The pieces in slot order, each slot once.
                        let mut pieces = p.pieces().peekable();
                        for (i, part) in parts.iter_mut().enumerate() {
                            let Some((_, at)) = pieces.next_if(|(j, _)| *j == i) else {
                                continue;
                            };
                            let slot = p.slots[i].0.start;
                            let part = part
                                .as_mut()
                                .ok_or_else(|| EngineError::Gpu("f32 weights missing".into()))?;
                            own.push(part.slice_mut(at.start - slot..at.end - slot));
                        }
                        RunParams::Each(&mut own)
                    }
                    Err(mine) => RunParams::Flat(mine_view.insert(mine.slice_mut(..n))),
                };
                let from = region.start - held.start;
                gpu.gpu().adamw_runs(
                    targets,
                    DeviceGrads::F32(grads.slice(from..from + n)),
                    &mut exp_avg.slice_mut(..n),
                    exp_avg_sq.as_mut().map(|v| v.slice_mut(..n)).as_mut(),
                    None,
                    &device_consts(&hp, true),
                    device_consts(&hp, false).decay,
                    &runs,
                )?;
            }
            if sliced {
                self.gpu_share_params(&gpu, &plans)?;
            }
        }
        let r = self.gpu_resident.as_mut().expect("resident");
        for g in &mut r.groups {
            gpu.gpu().fill_zero(g.f32_grads_mut())?;
        }
        Ok(self.finish_step(step, lr, grad_norm, None, overflow))
    }

    /// Over NCCL: with `reduce` (stages 0-1; stages 2-3 reduced as each
    /// micro-batch ended) every group's f32 gradients all-reduced, or
    /// (`sliced`) reduce-scattered to the rank's slice; then what is queued
    /// waited for. Without NCCL (one worker) there is nothing to do.
    fn gpu_reduce_f32_grads(
        &mut self,
        gpu: &GptGpu,
        reduce: bool,
        sliced: bool,
    ) -> Result<(), EngineError> {
        let (Some(r), Some(nccl)) = (self.gpu_resident.as_mut(), self.nccl.as_mut()) else {
            return Ok(());
        };
        for (i, g) in r.groups.iter_mut().enumerate().filter(|_| reduce) {
            if self.groups[i].layout.all_frozen() {
                continue; // its gradients are zeros
            }
            let what = format!("group {i}'s gradients");
            let op = match sliced {
                true => zcuda::NcclOp::ReduceScatter,
                false => zcuda::NcclOp::AllReduce,
            };
            let of = (&self.groups[i].layout, self.comm.rank());
            let grads = &mut g.f32_grads_mut().slice_mut(..);
            group_collective(gpu.gpu(), nccl, of, grads, op, &what)?;
        }
        nccl.wait()?;
        Ok(())
    }

    /// The resident step under bf16/f16: the host's 16-bit step on the
    /// GPU's buffers, so its bits. Over NCCL the gradients are first reduced
    /// as the host reduces them (stages 0-1 here, widened to f32, summed,
    /// rounded back; stages 2-3 as each micro-batch ended). The gradients
    /// stay unscaled in 16 bits: averaging, the loss scale and clipping
    /// fold into one factor that the norm and AdamW apply as they read
    /// them; AdamW updates the f32 master and writes its rounded working
    /// copy, whose values become the model's weights (and are gathered
    /// where ranks update slices).
    fn gpu_step_half(
        &mut self,
        gpu: &GptGpu,
        plans: &[StepPlan],
        reduced_already: bool,
        sliced: bool,
    ) -> Result<StepStats, EngineError> {
        let step = self.step + 1;
        let loss_scale = self.scaler.as_ref().map(|s| s.scale);
        let mut grad_scale = self.average_scale();
        let no_half = || EngineError::Gpu("16-bit gradients missing on the GPU".into());
        // `train.grad_accum_dtype: f32`: the gradients are the f32 path's,
        // reduced, averaged and clipped in place as the host does with f32
        // gradients; the update is this one's, on the master and working
        // copy.
        let f32_grads = self.grads_half.is_none();
        if f32_grads {
            self.gpu_reduce_f32_grads(gpu, !reduced_already, sliced)?;
        }
        if let (Some(nccl), false, false) = (self.nccl.as_mut(), reduced_already, f32_grads) {
            let r = self.gpu_resident.as_mut().expect("resident");
            let hc = r.half_comm.as_mut().ok_or_else(no_half)?;
            for (i, (g, p)) in r.groups.iter_mut().zip(plans).enumerate() {
                if self.groups[i].layout.all_frozen() {
                    continue; // its gradients are zeros
                }
                let h = g.half.as_mut().ok_or_else(no_half)?;
                let grads16 = h.grads.as_mut().ok_or_else(no_half)?;
                let what = format!("group {i}'s gradients");
                let mut wide = hc.wide.slice_mut(..grads16.len());
                gpu.gpu().widen16(h.kind, &grads16.slice(..), &mut wide)?;
                // The stream runs each group's rounding before the next
                // group's widening overwrites the buffer.
                let (op, kept) = match sliced {
                    true => (zcuda::NcclOp::ReduceScatter, p.own.clone()),
                    false => (zcuda::NcclOp::AllReduce, 0..grads16.len()),
                };
                let of = (&self.groups[i].layout, self.comm.rank());
                group_collective(gpu.gpu(), nccl, of, &mut wide, op, &what)?;
                gpu.gpu().round16(
                    h.kind,
                    &wide.slice(kept.clone()),
                    &mut grads16.slice_mut(kept),
                )?;
            }
            nccl.wait()?;
        }
        if f32_grads && grad_scale != 1.0 {
            let r = self.gpu_resident.as_mut().expect("resident");
            r.scale_f32_grads(gpu, plans, grad_scale)?;
            grad_scale = 1.0;
        }
        let r = self.gpu_resident.as_ref().expect("resident");
        let mut own_sq = 0f64;
        let grads: Vec<_> = (r.groups.iter().zip(plans))
            .map(|(g, p)| match &g.half {
                Some(HalfGroup {
                    kind,
                    grads: Some(grads16),
                    ..
                }) => DeviceGrads::Half(*kind, grads16.slice(g.local(p.own.clone()))),
                _ => DeviceGrads::F32(g.grad(p.own.clone())),
            })
            .collect();
        for parts in gpu.gpu().sum_sq_chunks_of_each(&grads, TASK, grad_scale)? {
            own_sq += parts.iter().sum::<f64>();
        }
        let grad_norm = self.norm_from_own_sq(own_sq)?;
        let overflow = self.check_overflow(step, grad_norm)?;
        let lr = self.next_lr();
        if !overflow {
            let clip = self.spec.train.grad_clip;
            if clip > 0.0 && grad_norm > clip {
                let coef = (clip / (grad_norm + 1e-6)) as f32;
                match f32_grads {
                    true => {
                        let r = self.gpu_resident.as_mut().expect("resident");
                        r.scale_f32_grads(gpu, plans, coef)?;
                    }
                    false => grad_scale *= coef,
                }
            }
            self.updates += 1;
            let hp = self.adam_step(lr, grad_scale);
            let r = self.gpu_resident.as_mut().expect("resident");
            for (g, p) in r.groups.iter_mut().zip(plans) {
                let held = g.held.clone();
                let ResidentGroup {
                    params,
                    grads,
                    exp_avg,
                    exp_avg_sq,
                    half,
                    ..
                } = g;
                let h = half.as_mut().ok_or_else(no_half)?;
                // The working copy AdamW writes: a whole group's flat copy
                // (indexed as the group) with the f32 tensors the model
                // reads, widened from it here unless ranks update slices (the
                // gather below widens every slot then); stage 3's slice
                // (indexed as the region) alone.
                let (working, whole, mut weights) = match params {
                    ResidentParams::Whole(w) => {
                        let (parts, flat) = Arc::get_mut(w)
                            .ok_or_else(|| {
                                EngineError::Gpu("parameters still in use at the step".into())
                            })?
                            .parts_and_half_mut();
                        (flat.ok_or_else(no_half)?, true, (!sliced).then_some(parts))
                    }
                    ResidentParams::HalfSlice(mine) => (mine, false, None),
                    ResidentParams::Slice(_) => {
                        return Err(EngineError::Gpu("f32 parameters in a 16-bit step".into()))
                    }
                };
                // One launch over the region's tensors (each with its own
                // decay), indexed from the region's start in every buffer.
                let region = p.region.clone();
                let n = region.len();
                let runs: Vec<_> = (p.pieces())
                    .map(|(i, at)| (at.start - region.start..at.end - region.start, p.slots[i].1))
                    .collect();
                let work = if whole { region.clone() } else { 0..n };
                let from = region.start - held.start;
                let read = match (&h.grads, grads) {
                    (Some(grads16), _) => DeviceGrads::Half(h.kind, grads16.slice(from..from + n)),
                    (None, Some(grads)) => DeviceGrads::F32(grads.slice(from..from + n)),
                    (None, None) => return Err(no_half()),
                };
                gpu.gpu().adamw_runs(
                    RunParams::Flat(&mut h.master.slice_mut(..n)),
                    read,
                    &mut exp_avg.slice_mut(..n),
                    exp_avg_sq.as_mut().map(|v| v.slice_mut(..n)).as_mut(),
                    Some((h.kind, &mut working.slice_mut(work))),
                    &device_consts(&hp, true),
                    device_consts(&hp, false).decay,
                    &runs,
                )?;
                for (i, at) in p.pieces() {
                    let slot = p.slots[i].0.start;
                    let work = match whole {
                        true => at.clone(),
                        false => at.start - region.start..at.end - region.start,
                    };
                    // (A tensor held in 16 bits alone has no f32 values.)
                    if let Some(Some(part)) = weights.as_mut().map(|w| &mut w[i]) {
                        gpu.gpu().widen16(
                            h.kind,
                            &working.slice(work),
                            &mut part.slice_mut(at.start - slot..at.end - slot),
                        )?;
                    }
                }
            }
            if sliced {
                self.gpu_share_params(gpu, plans)?;
            }
        }
        let r = self.gpu_resident.as_mut().expect("resident");
        for g in &mut r.groups {
            match (g.half.as_mut().and_then(|h| h.grads.as_mut()), &mut g.grads) {
                (Some(grads16), _) => gpu.gpu().fill_zero(grads16)?,
                (None, Some(grads)) => gpu.gpu().fill_zero(grads)?,
                (None, None) => return Err(no_half()),
            }
        }
        Ok(self.finish_step(step, lr, grad_norm, loss_scale, overflow))
    }

    /// Stages 1-3 over NCCL: every rank's updated slice of each whole group
    /// to every rank. A buffer spent by now (the group's gradient at stage
    /// 1, the shared landing at stages 2-3) carries the group's slice of the parameters into
    /// an in-place all-gather, and each slot's values come back from it.
    /// Under 16 bits the working copies' slices are gathered in place, as
    /// the host gathers them, and widened into the slots.
    fn gpu_share_params(&mut self, gpu: &GptGpu, plans: &[StepPlan]) -> Result<(), EngineError> {
        let (Some(r), Some(nccl)) = (self.gpu_resident.as_mut(), self.nccl.as_mut()) else {
            return Err(EngineError::Gpu("sharing parameters needs NCCL".into()));
        };
        for (gi, p) in plans.iter().enumerate() {
            if self.groups[gi].layout.all_frozen() {
                continue; // no parameter of it moved
            }
            let padded = self.groups[gi].layout.padded;
            let what = format!("group {gi}'s parameters");
            let g = &mut r.groups[gi];
            let ResidentParams::Whole(whole) = &mut g.params else {
                continue; // stage 3's slices stay where they are
            };
            if let Some(h) = &g.half {
                let (params, flat) = Arc::get_mut(whole)
                    .ok_or_else(|| EngineError::Gpu("parameters still in use at the step".into()))?
                    .parts_and_half_mut();
                let flat = flat.ok_or_else(|| {
                    EngineError::Gpu(format!("group {gi}: no 16-bit working copy"))
                })?;
                let flat16 = &mut flat.slice_mut(..padded);
                match self.groups[gi].layout.any_frozen() {
                    false => nccl.all_gather16_in_place(flat16, &what)?,
                    true => {
                        let (layout, rank) = (&self.groups[gi].layout, self.comm.rank());
                        let gather =
                            |b: &mut CudaViewMut<u16>| nccl.all_gather16_in_place(b, &what);
                        over_trained_runs(gpu.gpu(), layout, rank, flat16, Delivers::All, gather)?;
                    }
                }
                for (i, (range, _)) in p.slots.iter().enumerate() {
                    let Some(part) = params[i].as_mut() else {
                        continue; // held in 16 bits alone
                    };
                    gpu.gpu().widen16(
                        h.kind,
                        &flat.slice(range.clone()),
                        &mut part.slice_mut(..),
                    )?;
                }
                continue;
            }
            let mut buf = match &mut r.landings {
                Some(l) => l.shared.slice_mut(..padded),
                None => g
                    .grads
                    .as_mut()
                    .expect("f32 gradients outside a 16-bit run")
                    .slice_mut(..),
            };
            for (i, at) in p.pieces() {
                let slot = p.slots[i].0.start;
                gpu.gpu().copy(
                    &whole.part(i)?.slice(at.start - slot..at.end - slot),
                    &mut buf.slice_mut(at),
                )?;
            }
            let of = (&self.groups[gi].layout, self.comm.rank());
            group_collective(
                gpu.gpu(),
                nccl,
                of,
                &mut buf,
                zcuda::NcclOp::AllGather,
                &what,
            )?;
            let params = Arc::get_mut(whole)
                .ok_or_else(|| EngineError::Gpu("parameters still in use at the step".into()))?
                .parts_mut();
            // A frozen slot's values never left it: `buf` holds none of
            // them (the pieces leave them out), and every rank has them.
            for (i, (range, _)) in p.slots.iter().enumerate() {
                if p.frozen[i] {
                    continue;
                }
                let part = params[i]
                    .as_mut()
                    .ok_or_else(|| EngineError::Gpu("f32 weights missing".into()))?;
                gpu.gpu()
                    .copy(&buf.slice(range.clone()), &mut part.slice_mut(..))?;
            }
        }
        if let Some(l) = &mut r.landings {
            gpu.gpu().fill_zero(&mut l.shared)?;
        }
        nccl.wait()?;
        Ok(())
    }

    /// Resident: group `gi`'s [f32 parameters, exp_avg, exp_avg_sq (empty
    /// under Lion)] over the region this rank updates, copied from the GPU
    /// and laid out as the host's (padding zero), or `None` where the host's
    /// buffers are current.
    pub(crate) fn gpu_state(&self, gi: usize) -> Result<Option<[Vec<f32>; 3]>, EngineError> {
        let Some(r) = &self.gpu_resident else {
            return Ok(None);
        };
        let g = &r.groups[gi];
        let gpu = self.gpu.as_ref().expect("a GPU attached").gpu();
        Ok(Some([
            self.gpu_params(gi)?.expect("resident"),
            gpu.download(&g.exp_avg)?,
            match &g.exp_avg_sq {
                Some(v) => gpu.download(v)?,
                None => Vec::new(),
            },
        ]))
    }

    /// Resident: group `gi`'s f32 parameters (the master copy under 16 bits)
    /// over the region this rank updates, copied from the GPU, or `None`.
    pub(crate) fn gpu_params(&self, gi: usize) -> Result<Option<Vec<f32>>, EngineError> {
        let Some(r) = &self.gpu_resident else {
            return Ok(None);
        };
        if let Some(h) = &r.groups[gi].half {
            let gpu = self.gpu.as_ref().expect("a GPU attached");
            return Ok(Some(gpu.gpu().download(&h.master)?));
        }
        match &r.groups[gi].params {
            ResidentParams::Whole(w) => {
                let region = self.groups[gi].updated_region(self.comm.rank(), self.stage);
                Ok(Some(self.gpu_flat(gi, w)?[region].to_vec()))
            }
            ResidentParams::Slice(mine) => {
                let gpu = self.gpu.as_ref().expect("a GPU attached");
                Ok(Some(gpu.gpu().download(mine)?))
            }
            ResidentParams::HalfSlice(_) => Err(EngineError::Gpu(format!(
                "group {gi}: 16-bit parameters without their master copy"
            ))),
        }
    }

    /// Group `gi`'s f32 tensors on the device as its padded host layout.
    fn gpu_flat(&self, gi: usize, w: &Weights) -> Result<Vec<f32>, EngineError> {
        let gpu = self.gpu.as_ref().expect("a GPU attached");
        let layout = &self.groups[gi].layout;
        let mut out = vec![0f32; layout.padded];
        for (i, slot) in layout.params.iter().enumerate() {
            out[slot.range.clone()].copy_from_slice(&gpu.gpu().download(w.part(i)?)?);
        }
        Ok(out)
    }
}

/// NCCL's bytes and waits as the engine counts them, by operation. NCCL
/// picks its own routes, so its bytes count in neither `intra_node` nor
/// `inter_node`.
/// zmodel's dropout as the GPU's mask: the same threshold, scale and key.
fn mask(d: zmodel::Dropout) -> zcuda::Mask {
    zcuda::Mask {
        threshold: d.threshold(),
        scale: d.scale(),
        key: d.key(),
    }
}

pub(crate) fn nccl_counters(nccl: &zcuda::Nccl) -> zcomm::CounterSnapshot {
    use zcomm::Op;
    let mut c = zcomm::CounterSnapshot::default();
    for (op, theirs) in [
        (Op::AllReduce, zcuda::NcclOp::AllReduce),
        (Op::ReduceScatter, zcuda::NcclOp::ReduceScatter),
        (Op::AllGather, zcuda::NcclOp::AllGather),
    ] {
        c.by_op[op.index()] = nccl.bytes_sent(theirs);
        c.waited_ns[op.index()] = u64::try_from(nccl.waited(theirs).as_nanos()).unwrap_or(u64::MAX);
    }
    c
}

/// Each slot's gradient with its place in the group's flat buffer.
fn views<'a>(
    starts: &[usize],
    grads: &[(usize, &'a CudaSlice<f32>)],
) -> Vec<(usize, CudaView<'a, f32>)> {
    grads
        .iter()
        .map(|&(slot, grad)| (starts[slot], grad.slice(..)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precision::Flat;

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// Values over many magnitudes, subnormals and signed zeros among them.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                match i % 97 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => f32::from_bits(s >> 9), // subnormal
                    _ => f32::from_bits(((s >> 1) % 0x7F00_0000) | (s << 31)),
                }
            })
            .collect()
    }

    /// The resident step's norm and in-place scaling against the host's
    /// (`Flat::sum_sq` in its chunks, `Flat::scale_f32`): the same bits,
    /// which is what keeps Adam on the GPU equal to ZeRO-Offload's.
    #[test]
    fn the_gpu_norm_and_scaling_equal_the_hosts_bit_for_bit() {
        if !zcuda::gpu_or_skip(
            "the_gpu_norm_and_scaling_equal_the_hosts",
            zcuda::probe().usable_devices(),
        ) {
            return;
        }
        let gpu = zcuda::Gpu::open(0).expect("opening GPU 0");
        // Several buffers' norms in one call (one download): each buffer's
        // chunks as alone, an empty one and one from an offset included.
        let all: Vec<(Vec<f32>, CudaSlice<f32>)> = [(3 * TASK + 13, 5), (TASK + 9, 6)]
            .into_iter()
            .map(|(n, seed)| (values(n, seed), gpu.upload(&values(n, seed)).unwrap()))
            .collect();
        let views = [
            (0, 0..0),
            (0, 0..3 * TASK + 13),
            (1, 0..0),
            (1, 7..TASK + 9),
        ];
        let grads: Vec<_> = views
            .iter()
            .map(|(i, r)| zcuda::DeviceGrads::F32(all[*i].1.slice(r.clone())))
            .collect();
        let each = gpu.sum_sq_chunks_of_each(&grads, TASK, 0.37).unwrap();
        assert_eq!(each.len(), views.len());
        for ((i, r), parts) in views.iter().zip(&each) {
            assert_eq!(parts.len(), r.len().div_ceil(TASK), "buffer {i} at {r:?}");
            let host = Flat::F32(all[*i].0[r.clone()].to_vec()).sum_sq(0..r.len(), 0.37);
            let dev: f64 = parts.iter().sum();
            assert_eq!(dev.to_bits(), host.to_bits(), "buffer {i} at {r:?}");
        }
        for (n, seed) in [(5, 1), (TASK, 2), (3 * TASK + 13, 3), ((1 << 20) + 7, 4)] {
            let v = values(n, seed);
            let d = gpu.upload(&v).unwrap();
            for scale in [1.0f32, 0.37] {
                let host = Flat::F32(v.clone()).sum_sq(0..n, scale);
                let parts = gpu
                    .sum_sq_chunks_of_each(&[zcuda::DeviceGrads::F32(d.slice(..))], TASK, scale)
                    .unwrap()
                    .remove(0);
                assert_eq!(parts.len(), n.div_ceil(TASK));
                let dev: f64 = parts.iter().sum();
                assert_eq!(
                    dev.to_bits(),
                    host.to_bits(),
                    "n {n} scale {scale}: {dev} vs {host}"
                );
            }
            let mut host = Flat::F32(v.clone());
            host.scale_f32(0..n, 0.37);
            let mut d = d;
            gpu.scale(&mut d.slice_mut(..), 0.37).unwrap();
            let Flat::F32(want) = host else {
                unreachable!()
            };
            assert!(same_bits(&gpu.download(&d).unwrap(), &want), "scale, n {n}");
        }
    }

    /// The resident 16-bit step's gradient kernels against the host's
    /// 16-bit buffers: a micro-batch added and rounded (`Flat::add_f32`),
    /// the norm of the scaled 16-bit values (`Flat::sum_sq`), the working
    /// copy widened; the same bits, overflow to infinity included.
    #[test]
    fn the_gpus_16_bit_gradients_equal_the_hosts_bit_for_bit() {
        if !zcuda::gpu_or_skip(
            "the_gpus_16_bit_gradients_equal_the_hosts",
            zcuda::probe().usable_devices(),
        ) {
            return;
        }
        let gpu = zcuda::Gpu::open(0).expect("opening GPU 0");
        for h in [Half::Bf16, Half::F16] {
            for (n, seed) in [(5, 1), (TASK, 2), (3 * TASK + 13, 3)] {
                // Two micro-batches: magnitudes that f16 rounds, flushes
                // to subnormals and overflows, and their sums.
                let (a, b) = (values(n, seed), values(n, seed + 10));
                let mut host = Flat::zeros(Some(h), n);
                let mut dev = gpu.zeros::<u16>(n).unwrap();
                for x in [&a, &b] {
                    host.add_f32(0, x);
                    let dx = gpu.upload(x).unwrap();
                    gpu.add_into16(h, &mut dev.slice_mut(..), &dx.slice(..))
                        .unwrap();
                }
                let Flat::Half(_, want) = &host else {
                    unreachable!()
                };
                assert_eq!(&gpu.download(&dev).unwrap(), want, "{h:?} sums, n {n}");
                for scale in [1.0f32, 0.37, 3e-5] {
                    let host = host.sum_sq(0..n, scale);
                    let grads = zcuda::DeviceGrads::Half(h, dev.slice(..));
                    let parts = gpu.sum_sq_chunks_of_each(&[grads], TASK, scale).unwrap();
                    let dev: f64 = parts[0].iter().sum();
                    assert_eq!(
                        dev.to_bits(),
                        host.to_bits(),
                        "{h:?} n {n} scale {scale}: {dev} vs {host}"
                    );
                }
                let mut wide = gpu.zeros::<f32>(n).unwrap();
                gpu.widen16(h, &dev.slice(..), &mut wide.slice_mut(..))
                    .unwrap();
                let want = host.to_f32(0..n);
                let got = gpu.download(&wide).unwrap();
                assert!(same_bits(&got, &want), "{h:?} widened, n {n}");
            }
        }
    }
}
