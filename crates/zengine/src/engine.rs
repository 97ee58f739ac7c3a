//! The training step, for ZeRO stages 0-3.
//!
//! `forward_backward` runs one micro-batch block by block: zmodel's
//! `block_forward` keeps a block's activations (tensors that reference no
//! parameter) and `block_backward` turns them and `dy` into the block's parameter
//! gradients and `dx`, last block first, without an autograd graph. The
//! embedding and the head (with the loss) use candle's autograd.
//! As soon as backward is done with the groups of a bucket, the bucket is handed
//! to the communicator and backward carries on while it is reduced (overlap).
//! `step` waits for the buckets, averages, clips by the global norm, runs AdamW on
//! what this rank owns, and re-gathers parameters where the stage needs it.
//!
//! What each stage keeps (DESIGN.md's table):
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
//! hold no parameters). With activation checkpointing a block keeps only its
//! input and backward recomputes its forward on the parameters it gathered for
//! backward anyway, so checkpointing at stage 3 costs no third gather. The
//! embedding's autograd graph would hold its gathered parameters, so at stage 3
//! (or with checkpointing) it is recomputed in backward; it is only a lookup.
//!
//! The same arithmetic in every stage: each gradient element is summed over ranks
//! in an order fixed by the bucket layout, the norm adds owned slices in rank
//! order, and Adam is element-wise. With `grad_accum: 1`, stages 0-3 give
//! bit-identical parameters; with accumulation, stages 2-3 reduce every
//! micro-batch (as DeepSpeed does) and agree with 0-1 to rounding.

use std::ops::Range;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, Device, Storage, Tensor, Var};
use zcomm::{CommError, Communicator, CounterSnapshot, Op, Work};
use zconfig::JobSpec;
use zmodel::{Batch, BlockActs, Gpt, GptConfig};
use zproto::{CommBytes, MemBytes, OpBytes};

use crate::adam::{adamw, AdamStep, Buffers, Grads};
use crate::flat::{Bucket, GroupLayout};
use crate::gather::Prefetcher;
use crate::precision::{Flat, Half, LossScaler};
use crate::schedule::lr_at;

/// Why a step failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// candle failed (shape bugs, allocation).
    #[error("model: {0}")]
    Model(#[from] candle_core::Error),
    /// The loss or gradients stopped being finite.
    #[error("step {step}: {what} is not finite ({value})")]
    NonFinite {
        /// Step.
        step: u64,
        /// Loss or gradient norm.
        what: &'static str,
        /// The value.
        value: f64,
    },
    /// A call out of order or a configuration the engine cannot run.
    #[error("engine: {0}")]
    Usage(String),
}

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepStats {
    /// 1-based step.
    pub step: u64,
    /// Mean loss over this rank's micro-batches.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping (infinite on an f16 overflow).
    pub grad_norm: f64,
    /// f16: the loss scale this step's gradients were computed with.
    pub loss_scale: Option<f64>,
    /// f16: the gradients overflowed, so no update was made.
    pub skipped: bool,
    /// Tokens this rank trained on.
    pub tokens: u64,
    /// Memory by category at the end of the step (activations and buffers: peak).
    pub mem: MemBytes,
    /// Bytes this rank sent during the step.
    pub comm: CommBytes,
}

/// Optimizer hyper-parameters that SPEC.md does not expose (DeepSpeed's defaults).
const BETA1: f32 = 0.9;
const BETA2: f32 = 0.999;
const EPS: f32 = 1e-8;

/// One block's flat buffers on this rank.
pub(crate) struct Group {
    pub(crate) layout: GroupLayout,
    /// Stage 3 and above the persistence threshold: only the own slice is held.
    pub(crate) partitioned: bool,
    /// Working parameters (f32, or 16-bit under mixed precision): full (padded)
    /// or, if partitioned, the own slice.
    pub(crate) params: Flat,
    /// Mixed precision: the f32 master copy of what this rank updates (stage 0:
    /// everything; stages 1-3: the own slice).
    pub(crate) master: Option<Vec<f32>>,
    /// In the working precision. Stages 0-1: full; stages 2-3: the own slice.
    grads: Flat,
    /// Stages 2-3: this micro-batch's full gradient until its bucket leaves.
    staging: Option<Flat>,
    /// Stage 0: full; stages 1-3: the own slice.
    pub(crate) exp_avg: Vec<f32>,
    pub(crate) exp_avg_sq: Vec<f32>,
}

impl Group {
    /// Installs full (padded, f32) parameters: the working copy this rank holds
    /// and, under mixed precision, the master copy of the region it updates.
    pub(crate) fn install(&mut self, full: &[f32], rank: usize, stage: u8, half: Option<Half>) {
        let own = self.layout.slice(rank);
        self.params = Flat::from_f32(
            half,
            if self.partitioned {
                &full[own.clone()]
            } else {
                full
            },
        );
        let region = if stage == 0 {
            0..self.layout.padded
        } else {
            own
        };
        self.master = half.map(|_| full[region].to_vec());
    }

    /// The f32 parameters of the region this rank updates (see [`Group::install`]).
    pub(crate) fn updated_region(&self, rank: usize, stage: u8) -> Vec<f32> {
        if let Some(m) = &self.master {
            return m.clone();
        }
        let own = self.layout.slice(rank);
        if self.partitioned {
            self.params.to_f32(0..self.params.len())
        } else if stage == 0 {
            self.params.to_f32(0..self.layout.padded)
        } else {
            self.params.to_f32(own)
        }
    }
}

/// What a block keeps between its forward and backward.
enum Saved {
    /// Its activations (without checkpointing).
    Acts(BlockActs),
    /// Only its input; backward recomputes the forward.
    Input(Tensor),
}

/// A reduction in flight.
struct PendingBucket {
    bucket: usize,
    work: Work<Vec<f32>>,
    bytes: u64,
}

/// Bytes of memory transiently held, with the peak since the last step.
#[derive(Default)]
struct Transient {
    now: u64,
    peak: u64,
}

impl Transient {
    fn add(&mut self, b: u64) {
        self.now += b;
        self.peak = self.peak.max(self.now);
    }
    fn sub(&mut self, b: u64) {
        self.now = self.now.saturating_sub(b);
    }
}

/// ZeRO data-parallel training of one model replica on one rank.
pub struct Engine {
    model: Gpt,
    pub(crate) comm: Arc<dyn Communicator>,
    pub(crate) spec: JobSpec,
    pub(crate) stage: u8,
    pub(crate) groups: Vec<Group>,
    /// Mixed precision: the 16-bit working type.
    pub(crate) half: Option<Half>,
    /// f16: the dynamic loss scale.
    pub(crate) scaler: Option<LossScaler>,
    /// Updates applied (steps minus those f16 skipped): Adam's and the
    /// schedule's step count.
    pub(crate) updates: u64,
    buckets: Vec<Bucket>,
    /// Parameter Vars of the current step, for stages and groups that keep
    /// parameters whole and a forward graph (rebuilt after each update).
    pub(crate) vars: Vec<Option<Vec<Var>>>,
    pub(crate) step: u64,
    micro: usize,
    loss_sum: f64,
    tokens: u64,
    pending: Vec<PendingBucket>,
    comm_buffers: Transient,
    peak_activations: u64,
    counters_at_start: Option<CounterSnapshot>,
}

impl Engine {
    /// Builds the model of `spec` with seeded parameters and empty optimizer state,
    /// partitioned as the ZeRO stage says.
    pub fn new(spec: &JobSpec, comm: Arc<dyn Communicator>) -> Result<Engine, EngineError> {
        let stage = spec.zero.stage;
        if stage > 3 {
            return Err(EngineError::Usage(format!(
                "ZeRO stage {stage} does not exist"
            )));
        }
        let m = &spec.model;
        let model = Gpt::new(GptConfig {
            vocab_size: m.vocab_size,
            d_model: m.d_model,
            n_layers: m.n_layers,
            n_heads: m.n_heads,
            seq_len: m.seq_len,
        })?;
        let (world, rank) = (comm.world_size(), comm.rank());
        let threshold = spec.zero.param_persistence_threshold.0 as usize;
        let half = Half::of(spec.train.dtype);
        let mut groups = Vec::new();
        for (g, gs) in model.groups().iter().enumerate() {
            let layout = GroupLayout::new(gs, world);
            let mut full = vec![0f32; layout.padded];
            for (slot, values) in layout
                .params
                .iter()
                .zip(model.init_group(g, spec.train.seed))
            {
                full[slot.range.clone()].copy_from_slice(&values);
            }
            let partitioned = stage == 3 && layout.numel >= threshold;
            let n = layout.slice_len();
            let mut group = Group {
                partitioned,
                params: Flat::zeros(half, 0),
                master: None,
                grads: Flat::zeros(half, if stage < 2 { layout.padded } else { n }),
                staging: None,
                exp_avg: vec![0f32; if stage == 0 { layout.padded } else { n }],
                exp_avg_sq: vec![0f32; if stage == 0 { layout.padded } else { n }],
                layout,
            };
            group.install(&full, rank, stage, half);
            groups.push(group);
        }
        let layouts: Vec<GroupLayout> = groups.iter().map(|g| g.layout.clone()).collect();
        let buckets = Bucket::plan(&layouts, spec.zero.reduce_bucket_size.0.max(1) as usize);
        Ok(Engine {
            vars: (0..groups.len()).map(|_| None).collect(),
            model,
            comm,
            spec: spec.clone(),
            stage,
            groups,
            half,
            scaler: (half == Some(Half::F16)).then(|| LossScaler::new(&spec.train.loss_scale)),
            updates: 0,
            buckets,
            step: 0,
            micro: 0,
            loss_sum: 0.0,
            tokens: 0,
            pending: Vec::new(),
            comm_buffers: Transient::default(),
            peak_activations: 0,
            counters_at_start: None,
        })
    }

    /// The model.
    pub fn model(&self) -> &Gpt {
        &self.model
    }

    /// Optimizer steps taken.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// Every group's full f32 parameters (unpadded; the master copy under mixed
    /// precision), gathering what is partitioned. A collective: every rank must
    /// call it.
    pub fn full_params(&self) -> Result<Vec<Vec<f32>>, EngineError> {
        let rank = self.comm.rank();
        let mut out = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            let mut full = if self.half.is_none() && !g.partitioned {
                g.params.to_f32(0..g.layout.padded)
            } else if self.stage == 0 {
                g.updated_region(rank, 0)
            } else {
                self.comm
                    .all_gather(g.updated_region(rank, self.stage), g.layout.padded)?
            };
            full.truncate(g.layout.numel);
            out.push(full);
        }
        Ok(out)
    }

    /// f16's loss-scaler state (for checkpoints).
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// Whether the embedding keeps its autograd graph from forward to backward.
    fn embedding_keeps_graph(&self) -> bool {
        self.stage < 3 && !self.spec.train.activation_checkpointing
    }

    /// The order of stage-3 gathers in one micro-batch (see the module doc).
    fn gather_order(&self) -> Vec<usize> {
        let l = self.model.config().n_layers;
        let head = l + 1;
        let mut order: Vec<usize> = (0..=l).collect();
        order.extend([head, 0]);
        order.extend((1..=l).rev());
        order.push(0);
        order.retain(|&g| self.groups[g].partitioned);
        order
    }

    /// Parameter Vars (f32) of group `g` built from a full flat buffer. (Forward
    /// without a graph uses their detached tensors, which autograd does not track.)
    fn vars_from(&self, g: usize, full: &Flat) -> Result<Vec<Var>, EngineError> {
        let mut out = Vec::with_capacity(self.groups[g].layout.params.len());
        for slot in &self.groups[g].layout.params {
            out.push(Var::from_vec(
                full.to_f32(slot.range.clone()),
                slot.shape.as_slice(),
                &Device::Cpu,
            )?);
        }
        Ok(out)
    }

    /// Bytes a gathered copy of group `g` holds.
    fn gathered_bytes(&self, g: usize) -> u64 {
        (Flat::words_for(self.half, self.groups[g].layout.padded) * 4) as u64
    }

    /// Group `g`'s parameters for one use: cached Vars for whole groups in graph
    /// mode, fresh tensors otherwise; partitioned groups are gathered.
    fn params_for(&mut self, g: usize, gather: &mut Prefetcher) -> Result<Vec<Var>, EngineError> {
        if self.groups[g].partitioned {
            let comm = self.comm.clone();
            let slices: Vec<&Flat> = self.groups.iter().map(|x| &x.params).collect();
            let own = |h: usize| slices[h].words(0..slices[h].len());
            let words = gather.fetch(g, comm.as_ref(), &own)?;
            self.comm_buffers.add((words.len() * 4) as u64);
            let vars = self.vars_from(g, &Flat::from_words(self.half, words))?;
            return Ok(vars);
        }
        if self.vars[g].is_none() {
            let vars = self.vars_from(g, &self.groups[g].params)?;
            self.vars[g] = Some(vars);
        }
        Ok(self.vars[g].clone().expect("built above"))
    }

    /// Marks a gathered group's parameters as released.
    fn release(&mut self, g: usize) {
        if self.groups[g].partitioned {
            self.comm_buffers.sub(self.gathered_bytes(g));
        }
    }

    /// Runs forward and backward of one micro-batch and accumulates its gradients.
    /// Returns the micro-batch's mean loss.
    pub fn forward_backward(&mut self, batch: &Batch) -> Result<f64, EngineError> {
        if self.micro == 0 {
            self.counters_at_start = Some(self.comm.counters());
        }
        if self.micro >= self.spec.train.grad_accum {
            return Err(EngineError::Usage(
                "more micro-batches than grad_accum before step()".into(),
            ));
        }
        let reduce_now = self.stage >= 2 || self.micro + 1 == self.spec.train.grad_accum;
        let (rows, t) = (batch.rows, batch.seq_len);
        let tokens = Tensor::from_slice(&batch.inputs, (rows, t), &Device::Cpu)?;
        let targets = Tensor::from_slice(&batch.targets, (rows, t), &Device::Cpu)?;
        let n_layers = self.model.config().n_layers;
        let head = n_layers + 1;
        let keep_graph = self.embedding_keeps_graph();
        let keep_acts = !self.spec.train.activation_checkpointing;
        let padded: Vec<usize> = self
            .groups
            .iter()
            .map(|g| Flat::words_for(self.half, g.layout.padded))
            .collect();
        let mut gather = Prefetcher::new(
            self.gather_order(),
            padded,
            self.spec.zero.prefetch_bucket_size.0 as usize,
            self.spec.zero.overlap_comm,
        );
        let ts =
            |vars: &[Var]| -> Vec<Tensor> { vars.iter().map(|v| v.as_tensor().clone()).collect() };
        let plain =
            |vars: &[Var]| -> Vec<Tensor> { vars.iter().map(|v| v.as_tensor().detach()).collect() };

        // Forward. Blocks keep their activations, or with checkpointing only
        // their input (backward recomputes them).
        let p0 = self.params_for(0, &mut gather)?;
        let mut y0 = Some(if keep_graph {
            self.model.embed(&ts(&p0), &tokens)?
        } else {
            self.model.embed(&plain(&p0), &tokens)?
        });
        let mut x = y0.as_ref().expect("set").detach();
        if !keep_graph {
            y0 = None;
        }
        drop(p0);
        self.release(0);
        let mut saved: Vec<Saved> = Vec::with_capacity(n_layers);
        for b in 1..=n_layers {
            let p = self.params_for(b, &mut gather)?;
            let (y, acts) = self.model.block_forward(&plain(&p), &x)?;
            saved.push(if keep_acts {
                Saved::Acts(acts)
            } else {
                Saved::Input(x)
            });
            x = y;
            drop(p);
            self.release(b);
        }
        let m = &self.spec.model;
        let block_bytes = zconfig::estimate::gpt_block_activation_bytes(m, rows, t) as u64;
        let input_bytes = (rows * t * m.d_model * 4) as u64;
        let head_bytes = zconfig::estimate::gpt_head_activation_bytes(m, rows, t) as u64;
        self.peak_activations = self.peak_activations.max(if keep_acts {
            n_layers as u64 * block_bytes + head_bytes
        } else {
            n_layers as u64 * input_bytes + block_bytes + head_bytes
        });

        // The head, with the tied embedding; forward and backward back to back.
        let ph = self.params_for(head, &mut gather)?;
        let pw = self.params_for(0, &mut gather)?;
        let head_in = Var::from_tensor(&x)?;
        let loss =
            self.model
                .head_loss(&ts(&ph), pw[0].as_tensor(), head_in.as_tensor(), &targets)?;
        let loss_value = f64::from(loss.to_scalar::<f32>()?);
        if !loss_value.is_finite() {
            return Err(EngineError::NonFinite {
                step: self.step + 1,
                what: "loss",
                value: loss_value,
            });
        }
        let grads = match &self.scaler {
            Some(s) => (&loss * s.scale)?.backward()?,
            None => loss.backward()?,
        };
        self.accumulate(head, &ph, &grads)?;
        let wte = grads
            .get(pw[0].as_tensor())
            .ok_or_else(|| missing("wte (tied head)"))?;
        let wte_range = self.groups[0].layout.params[0].range.clone();
        add_grad(self.micro_grads(0), wte_range, wte)?;
        let mut dx = grads
            .get(head_in.as_tensor())
            .cloned()
            .ok_or_else(|| missing("head input"))?;
        drop((grads, loss, ph, pw));
        self.release(head);
        self.release(0);
        if reduce_now {
            self.group_done(head)?;
        }

        // Backward through the blocks, last first.
        for b in (1..=n_layers).rev() {
            let p = plain(&self.params_for(b, &mut gather)?);
            let acts = match saved.pop().expect("one saved entry per block") {
                Saved::Acts(acts) => acts,
                Saved::Input(x) => self.model.block_forward(&p, &x)?.1,
            };
            let (grads, dx_in) = self.model.block_backward(&p, &acts, &dx)?;
            drop((acts, p));
            self.accumulate_tensors(b, &grads.iter().collect::<Vec<_>>())?;
            dx = dx_in;
            self.release(b);
            if reduce_now {
                self.group_done(b)?;
            }
        }
        let p0 = self.params_for(0, &mut gather)?;
        let y0 = match y0.take() {
            Some(y) => y,
            None => self.model.embed(&ts(&p0), &tokens)?,
        };
        let grads = (y0 * &dx)?.sum_all()?.backward()?;
        self.accumulate(0, &p0, &grads)?;
        drop((grads, p0));
        self.release(0);
        if reduce_now {
            self.group_done(0)?;
        }
        debug_assert!(gather.finished());

        self.loss_sum += loss_value;
        self.tokens += (rows * t) as u64;
        self.micro += 1;
        Ok(loss_value)
    }

    /// The buffer this micro-batch's gradients of group `g` accumulate into.
    fn micro_grads(&mut self, g: usize) -> &mut Flat {
        if self.stage < 2 {
            return &mut self.groups[g].grads;
        }
        let padded = self.groups[g].layout.padded;
        let half = self.half;
        if self.groups[g].staging.is_none() {
            let staging = Flat::zeros(half, padded);
            self.comm_buffers.add(staging.bytes());
            self.groups[g].staging = Some(staging);
        }
        self.groups[g].staging.as_mut().expect("set above")
    }

    /// Adds a group's parameter gradients (from autograd) into its micro-batch
    /// gradient buffer.
    fn accumulate(&mut self, g: usize, vars: &[Var], grads: &GradStore) -> Result<(), EngineError> {
        let slots = &self.groups[g].layout.params;
        let tensors = slots
            .iter()
            .zip(vars)
            .map(|(slot, var)| {
                grads
                    .get(var.as_tensor())
                    .ok_or_else(|| missing(&slot.name))
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.accumulate_tensors(g, &tensors)
    }

    /// Adds a group's parameter gradients, in slot order, into its micro-batch
    /// gradient buffer.
    fn accumulate_tensors(&mut self, g: usize, grads: &[&Tensor]) -> Result<(), EngineError> {
        let slots = self.groups[g].layout.params.clone();
        if slots.len() != grads.len() {
            return Err(EngineError::Usage(format!(
                "{} gradients for {} parameters",
                grads.len(),
                slots.len()
            )));
        }
        let buf = self.micro_grads(g);
        for (slot, grad) in slots.iter().zip(grads) {
            add_grad(buf, slot.range.clone(), grad)?;
        }
        Ok(())
    }

    /// Puts away buckets that have finished, oldest first, so their buffers stop
    /// counting as held (the communicator has already freed them).
    fn finish_completed(&mut self) -> Result<(), EngineError> {
        while !self.pending.is_empty() {
            let p = self.pending.remove(0);
            match p.work.try_wait() {
                Ok(result) => self.put_reduced(p.bucket, p.bytes, result?),
                Err(work) => {
                    self.pending.insert(0, PendingBucket { work, ..p });
                    break;
                }
            }
        }
        Ok(())
    }

    /// Backward is done with group `g` for this micro-batch: launch the reduction
    /// of its bucket if every group of the bucket is done.
    fn group_done(&mut self, g: usize) -> Result<(), EngineError> {
        self.finish_completed()?;
        let Some(bi) = self
            .buckets
            .iter()
            .position(|b| b.groups.last() == Some(&g))
        else {
            return Ok(()); // more groups of this bucket are still to come
        };
        let world = self.comm.world_size();
        if world == 1 {
            // Nothing to reduce: a staged gradient is already the rank's own.
            if self.stage >= 2 {
                for h in self.buckets[bi].groups.clone() {
                    let s = self.groups[h]
                        .staging
                        .take()
                        .ok_or_else(|| missing("a staged gradient"))?;
                    self.comm_buffers.sub(s.bytes());
                    self.groups[h].grads.add_f32(0, &s.to_f32(0..s.len()));
                }
            }
            return Ok(());
        }
        let layouts: Vec<GroupLayout> = self.groups.iter().map(|x| x.layout.clone()).collect();
        let packed = if self.stage < 2 {
            let views: Vec<&Flat> = self.groups.iter().map(|x| &x.grads).collect();
            self.buckets[bi].pack(&layouts, &views, world)
        } else {
            let mut staged: Vec<Flat> = vec![Flat::zeros(self.half, 0); self.groups.len()];
            for &h in &self.buckets[bi].groups {
                let s = self.groups[h]
                    .staging
                    .take()
                    .ok_or_else(|| missing("a staged gradient"))?;
                self.comm_buffers.sub(s.bytes());
                staged[h] = s;
            }
            let views: Vec<&Flat> = staged.iter().collect();
            self.buckets[bi].pack(&layouts, &views, world)
        };
        let bytes = (packed.len() * 4) as u64;
        self.comm_buffers.add(bytes);
        let work = if self.stage == 0 {
            self.comm.all_reduce_async(packed)
        } else {
            self.comm.reduce_scatter_async(packed)
        };
        let pending = PendingBucket {
            bucket: bi,
            work,
            bytes,
        };
        if self.spec.zero.overlap_comm {
            self.pending.push(pending);
        } else {
            self.finish_bucket(pending)?;
        }
        Ok(())
    }

    /// Waits for a bucket and puts its result away.
    fn finish_bucket(&mut self, p: PendingBucket) -> Result<(), EngineError> {
        let reduced = p.work.wait()?;
        self.put_reduced(p.bucket, p.bytes, reduced);
        Ok(())
    }

    /// Puts a reduced bucket where the stage keeps gradients.
    fn put_reduced(&mut self, bucket: usize, bytes: u64, reduced: Vec<f32>) {
        self.comm_buffers.sub(bytes);
        let world = self.comm.world_size();
        let rank = self.comm.rank();
        let layouts: Vec<GroupLayout> = self.groups.iter().map(|x| x.layout.clone()).collect();
        let bucket = self.buckets[bucket].clone();
        match self.stage {
            0 => {
                let mut bufs: Vec<Flat> = self
                    .groups
                    .iter_mut()
                    .map(|g| std::mem::replace(&mut g.grads, Flat::F32(Vec::new())))
                    .collect();
                bucket.unpack(&layouts, &reduced, &mut bufs, world);
                for (g, b) in self.groups.iter_mut().zip(bufs) {
                    g.grads = b;
                }
            }
            1 => {
                for (g, part) in bucket.own_parts(&layouts) {
                    let own = layouts[g].slice(rank);
                    self.groups[g].grads.set_f32(own.start, &reduced[part]);
                }
            }
            _ => {
                for (g, part) in bucket.own_parts(&layouts) {
                    self.groups[g].grads.add_f32(0, &reduced[part]);
                }
            }
        }
    }

    /// Finishes the optimizer step after `grad_accum` micro-batches.
    pub fn step(&mut self) -> Result<StepStats, EngineError> {
        let accum = self.spec.train.grad_accum;
        if self.micro != accum {
            return Err(EngineError::Usage(format!(
                "step after {} of {accum} micro-batches",
                self.micro
            )));
        }
        for p in std::mem::take(&mut self.pending) {
            self.finish_bucket(p)?;
        }
        let world = self.comm.world_size();
        let rank = self.comm.rank();
        let step = self.step + 1;
        let loss_scale = self.scaler.as_ref().map(|s| s.scale);
        // Averaging over ranks and micro-batches, and unscaling (a power of two).
        let scale = (1.0 / (world * accum) as f64 / loss_scale.unwrap_or(1.0)) as f32;
        let stage = self.stage;
        let full_grads = stage < 2;
        // The gradients this rank owns (for the norm), and those it uses (stage 0
        // updates everything, so it scales and clips everything).
        let own_grads = |g: &Group| {
            if full_grads {
                g.layout.slice(rank)
            } else {
                0..g.grads.len()
            }
        };
        let used_grads = |g: &Group| {
            if stage == 0 {
                0..g.grads.len()
            } else {
                own_grads(g)
            }
        };
        // f32 gradients are scaled in place; 16-bit ones as Adam reads them.
        let mut grad_scale = scale;
        for g in &mut self.groups {
            let r = used_grads(g);
            if let Flat::F32(v) = &mut g.grads {
                v[r].iter_mut().for_each(|x| *x *= scale);
                grad_scale = 1.0;
            }
        }

        // Global norm: each rank's owned slices, added across ranks in rank order.
        let own_sq: f64 = self
            .groups
            .iter()
            .map(|g| g.grads.sum_sq(own_grads(g), grad_scale))
            .sum();
        let hi = own_sq as f32;
        let lo = (own_sq - f64::from(hi)) as f32;
        let parts = self.comm.all_gather(vec![hi, lo], 2 * world)?;
        let total_sq: f64 = parts
            .chunks(2)
            .map(|p| f64::from(p[0]) + f64::from(p[1]))
            .sum();
        let grad_norm = total_sq.sqrt();
        let overflow = !grad_norm.is_finite();
        if let Some(scaler) = &mut self.scaler {
            if overflow && scaler.at_minimum() {
                return Err(EngineError::NonFinite {
                    step,
                    what: "gradient norm at the minimum loss scale",
                    value: grad_norm,
                });
            }
            scaler.update(step as i64 - 1, overflow);
        } else if overflow {
            return Err(EngineError::NonFinite {
                step,
                what: "gradient norm",
                value: grad_norm,
            });
        }
        let t = &self.spec.train;
        let lr = lr_at(self.updates + 1, t.steps, t.lr, t.warmup_steps, t.schedule);
        if !overflow {
            let clip = t.grad_clip;
            if clip > 0.0 && grad_norm > clip {
                let coef = (clip / (grad_norm + 1e-6)) as f32;
                if self.half.is_some() {
                    grad_scale *= coef;
                } else {
                    for g in &mut self.groups {
                        let r = used_grads(g);
                        if let Flat::F32(v) = &mut g.grads {
                            v[r].iter_mut().for_each(|x| *x *= coef);
                        }
                    }
                }
            }
            self.updates += 1;
            let hp = AdamStep {
                lr: lr as f32,
                beta1: BETA1,
                beta2: BETA2,
                eps: EPS,
                weight_decay: t.weight_decay as f32,
                step: self.updates,
                grad_scale,
            };
            for g in &mut self.groups {
                update_group(g, stage, rank, &hp)?;
            }
            // Stages 1-2 (and whole groups at stage 3): share the updated slices.
            if stage >= 1 && world > 1 {
                let mut works = Vec::new();
                for (i, g) in self.groups.iter().enumerate() {
                    if !g.partitioned {
                        let own = g.params.words(g.layout.slice(rank));
                        let words = Flat::words_for(self.half, g.layout.padded);
                        works.push((i, self.comm.all_gather_async(own, words)));
                    }
                }
                for (i, w) in works {
                    self.groups[i].params = Flat::from_words(self.half, w.wait()?);
                }
            }
            self.vars.iter_mut().for_each(|v| *v = None);
        }
        for g in &mut self.groups {
            g.grads.fill_zero();
        }

        let counters = self.comm.counters();
        let comm = comm_bytes(&counters.since(&self.counters_at_start.take().unwrap_or(counters)));
        let bytes = |f: &dyn Fn(&Group) -> u64| self.groups.iter().map(f).sum::<u64>();
        let mem = MemBytes {
            params: bytes(&|g| g.params.bytes()),
            grads: bytes(&|g| g.grads.bytes()),
            master: bytes(&|g| g.master.as_ref().map_or(0, |m| (m.len() * 4) as u64)),
            optimizer: bytes(&|g| ((g.exp_avg.len() + g.exp_avg_sq.len()) * 4) as u64),
            activations: self.peak_activations,
            comm_buffers: self.comm_buffers.peak,
            offload_buffers: 0,
            peak_rss: peak_rss_bytes(),
        };
        let stats = StepStats {
            step,
            loss: self.loss_sum / accum as f64,
            lr,
            grad_norm,
            loss_scale,
            skipped: overflow,
            tokens: self.tokens,
            mem,
            comm,
        };
        self.step = step;
        self.micro = 0;
        self.loss_sum = 0.0;
        self.tokens = 0;
        self.comm_buffers = Transient::default();
        self.peak_activations = 0;
        Ok(stats)
    }
}

/// AdamW on the region of group `g` that this rank updates, in the group's
/// precision (refreshing the 16-bit working copy in the same pass).
fn update_group(g: &mut Group, stage: u8, rank: usize, hp: &AdamStep) -> Result<(), EngineError> {
    // The flat range this rank updates, and where it sits in each buffer.
    let region = if stage == 0 {
        0..g.layout.padded
    } else {
        g.layout.slice(rank)
    };
    let p_off = if g.partitioned { region.start } else { 0 };
    let g_off = if stage < 2 { 0 } else { region.start };
    let m_off = if stage == 0 { 0 } else { region.start };
    let Group {
        layout,
        params,
        master,
        grads,
        exp_avg,
        exp_avg_sq,
        ..
    } = g;
    for (r, decay) in layout.decay_runs(region) {
        let gr = r.start - g_off..r.end - g_off;
        let mr = r.start - m_off..r.end - m_off;
        let pr = r.start - p_off..r.end - p_off;
        let grads = match &*grads {
            Flat::F32(v) => Grads::F32(&v[gr]),
            Flat::Half(h, v) => Grads::Half(*h, &v[gr]),
        };
        let (m, v) = (&mut exp_avg[mr.clone()], &mut exp_avg_sq[mr.clone()]);
        let buffers = match (master.as_mut(), &mut *params) {
            (None, Flat::F32(p)) => Buffers {
                p: &mut p[pr],
                g: grads,
                m,
                v,
                working: None,
            },
            (Some(master), Flat::Half(h, w)) => Buffers {
                p: &mut master[mr],
                g: grads,
                m,
                v,
                working: Some((*h, &mut w[pr])),
            },
            _ => {
                return Err(EngineError::Usage(
                    "master and working parameters disagree on the precision".into(),
                ))
            }
        };
        adamw(buffers, decay, hp);
    }
    Ok(())
}

fn missing(what: &str) -> EngineError {
    EngineError::Usage(format!("backward produced no gradient for {what}"))
}

/// Adds a gradient tensor into `range` of `buf`, read in place from the
/// tensor's storage (no copy out of candle first).
fn add_grad(buf: &mut Flat, range: Range<usize>, grad: &Tensor) -> Result<(), EngineError> {
    let grad = grad.contiguous()?;
    let (storage, layout) = grad.storage_and_layout();
    let values = match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => &v[a..b],
        _ => {
            return Err(EngineError::Usage(
                "gradients must be f32 on the CPU".into(),
            ))
        }
    };
    if values.len() != range.len() {
        return Err(EngineError::Usage(format!(
            "gradient of {} elements for a slot of {}",
            values.len(),
            range.len()
        )));
    }
    buf.add_f32(range.start, values);
    Ok(())
}

fn comm_bytes(d: &CounterSnapshot) -> CommBytes {
    CommBytes {
        intra_node: d.intra_node,
        inter_node: d.inter_node,
        by_op: OpBytes {
            all_reduce: d.op(Op::AllReduce),
            reduce_scatter: d.op(Op::ReduceScatter),
            all_gather: d.op(Op::AllGather),
            all_to_all: d.op(Op::AllToAll),
            broadcast: d.op(Op::Broadcast),
        },
    }
}

/// Peak resident set size of this process (Linux `VmHWM`), 0 where unknown.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}
