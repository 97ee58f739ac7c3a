//! One micro-batch: forward block by block, the head's loss and backward, then
//! backward through the blocks, last first, handing each group's gradient to
//! the reduction pipeline as soon as it is complete.
//!
//! zmodel's `block_forward` keeps a block's activations (tensors that reference
//! no parameter) and `block_backward` turns them and `dy` into the block's
//! parameter gradients and `dx` without an autograd graph; so do the head
//! (`Gpt::head_backward`: norm, output product and loss in one call) and the
//! embedding (`Gpt::embed_backward`). With activation checkpointing a block
//! keeps only its input and backward recomputes its forward on the
//! parameters it gathered for backward anyway, so checkpointing at stage 3
//! costs no third gather. The embedding's backward needs only the tokens and
//! `dx`, no parameter: at stage 3 it gathers nothing.

use std::ops::Range;
use std::time::Instant;

use candle_core::{CpuStorage, Device, Layout, Storage, Tensor};
use zmodel::profile::{self, Module, Pass};
use zmodel::{
    Batch, BlockActs, BlockDropout, BlockLinear, BlockNorm, BlockSource, Documents, Dropout,
    EmbeddingParams, HeadParams, Noise, TokenRows, WeightBias,
};

use crate::engine::{block_completion, Engine};
use crate::error::EngineError;
use crate::gather::Prefetcher;
use crate::layer_drop::BlockFates;
use crate::precision::Flat;

/// What a block keeps between its forward and backward.
enum Saved {
    /// Its activations (without checkpointing).
    Acts(BlockActs),
    /// Only its input; backward recomputes the forward.
    Input(Tensor),
}

/// The state one micro-batch carries from phase to phase.
pub(crate) struct MicroBatch {
    tokens: Tensor,
    targets: Tensor,
    /// What the sum of its counted losses is divided by ([`Batch::divisor`]).
    divisor: f64,
    /// Its sequences' documents, where they are kept apart.
    docs: Option<Documents>,
    pub(crate) gather: Prefetcher,
    /// Per block, what its backward needs.
    saved: Vec<Saved>,
    /// Whether this micro-batch's gradients are reduced as backward goes.
    pub(crate) reduce_now: bool,
    /// This micro-batch's dropouts: the hidden one's site 0 the
    /// embedding's output, site `b` block `b`'s.
    pub(crate) dropout: BlockDropout,
    /// NEFTune's noise on the embeddings' output.
    pub(crate) noise: Option<Noise>,
    /// Which blocks it runs (all but under progressive layer dropping).
    pub(crate) fates: BlockFates,
}

impl Engine {
    /// Runs forward and backward of one micro-batch and accumulates its gradients.
    /// Returns its loss: the sum of its counted targets' losses over
    /// [`Batch::divisor`] (its mean where nothing is masked; under a loss
    /// mask, what averaged over the step's micro-batches and ranks gives
    /// the mean over the step's trained targets).
    pub fn forward_backward(&mut self, batch: &Batch) -> Result<f64, EngineError> {
        self.with_lent_params(|e| e.run_micro_batch(batch))
    }

    /// [`Engine::forward_backward`] while whole groups' parameters may be
    /// lent to the model's tensors.
    fn run_micro_batch(&mut self, batch: &Batch) -> Result<f64, EngineError> {
        let started = Instant::now();
        let mut mb = self.begin_micro_batch(batch)?;
        let loss = match self.on_gpu() {
            #[cfg(feature = "cuda")]
            true => self.gpu_forward_backward(&mut mb, batch)?,
            _ => {
                let x = self.forward_embedding(&mut mb)?;
                let x = self.forward_blocks(&mut mb, x)?;
                self.forward_done = Some(Instant::now());
                let (loss, dx) = self.head_forward_backward(&mut mb, &x)?;
                let dx = self.backward_blocks(&mut mb, dx)?;
                if self.backward_reach == 0 {
                    self.backward_embedding(&mut mb, &dx)?;
                }
                loss
            }
        };
        assert!(mb.gather.finished(), "planned stage-3 gathers left unused");
        if let Some(o) = &self.offload {
            assert!(
                self.param_reads.finished(o),
                "planned parameter reads from swap left unused"
            );
        }
        self.secondary_peak = self.secondary_peak.max(mb.gather.secondary_peak());
        let ended = Instant::now();
        let split = self.forward_done.take().unwrap_or(ended);
        self.times.forward += split - started;
        self.times.backward += ended - split;
        self.loss_sum += loss;
        self.tokens += (batch.rows * batch.seq_len) as u64;
        self.micro += 1;
        Ok(loss)
    }

    /// The mean loss over `batches` on every rank (a collective: every rank
    /// calls it with as many batches), forward only: nothing is accumulated
    /// and no state changes. Each batch's loss is what
    /// [`Engine::forward_backward`] would return for it.
    pub fn eval_loss(&mut self, batches: &[Batch]) -> Result<f64, EngineError> {
        let sum = self.with_lent_params(|e| {
            batches
                .iter()
                .try_fold(0f64, |sum, b| Ok(sum + e.forward_loss(b)?))
        })?;
        // The sum in f64 as two f32 words (hi + lo), so the mean keeps f64's
        // precision through an f32 all-reduce; the count alongside.
        let hi = sum as f32;
        let lo = (sum - f64::from(hi)) as f32;
        let all = self.comm.all_reduce(vec![hi, lo, batches.len() as f32])?;
        Ok((f64::from(all[0]) + f64::from(all[1])) / f64::from(all[2]).max(1.0))
    }

    /// One batch's loss without backward.
    fn forward_loss(&mut self, batch: &Batch) -> Result<f64, EngineError> {
        let mut gather = self.eval_prefetcher();
        #[cfg(feature = "cuda")]
        if self.on_gpu() {
            let loss = self.gpu_forward_loss(&mut gather, batch)?;
            assert!(gather.finished(), "planned evaluation gathers left unused");
            return Ok(loss);
        }
        let shape = (batch.rows, batch.seq_len);
        let tokens = Tensor::from_slice(&batch.inputs, shape, &Device::Cpu)?;
        let targets = Tensor::from_slice(&batch.targets, shape, &Device::Cpu)?;
        let p0 = self.params_for(0, &mut gather)?;
        let layout = self.model.layout();
        let docs = batch.documents.as_ref();
        let mut x =
            self.model
                .embed_documents(&EmbeddingParams::from_vec(p0, layout)?, &tokens, docs)?;
        self.release(0);
        let l = self.model.config().n_layers;
        let model = self.model.clone();
        for b in 1..=l {
            let mut src = BlockFromEngine::gather(self, &mut gather, b, false)?;
            x = model
                .block_forward_from(&mut src, &x, docs, BlockDropout::default())?
                .0;
            src.release_block();
        }
        let ph = self.params_for(l + 1, &mut gather)?;
        let head = HeadParams::from_vec(ph, layout)?;
        let tied = head.lm_head.is_none();
        let wte = match tied {
            true => Some(EmbeddingParams::from_vec(self.params_for(0, &mut gather)?, layout)?.wte),
            false => None,
        };
        let loss = self
            .model
            .head_loss_value(&head, wte.as_ref(), &x, &targets, batch.divisor)?;
        drop((head, wte));
        self.release(l + 1);
        if tied {
            self.release(0);
        }
        assert!(gather.finished(), "planned evaluation gathers left unused");
        Ok(loss)
    }

    fn begin_micro_batch(&mut self, batch: &Batch) -> Result<MicroBatch, EngineError> {
        let accum = self.spec.train.grad_accum;
        if self.micro >= accum {
            return Err(EngineError::TooManyMicroBatches { accum });
        }
        if self.micro == 0 {
            self.counters_at_start = Some(self.counters());
            self.io_at_start = self.offload.as_ref().map(|o| o.stats());
        }
        let shape = (batch.rows, batch.seq_len);
        let fates = self.block_fates();
        for (b, runs) in (1..).zip(&mut self.block_runs) {
            *runs += u64::from(fates.runs(b));
        }
        Ok(MicroBatch {
            tokens: Tensor::from_slice(&batch.inputs, shape, &Device::Cpu)?,
            targets: Tensor::from_slice(&batch.targets, shape, &Device::Cpu)?,
            divisor: batch.divisor,
            docs: batch.documents.clone(),
            gather: self.prefetcher(&fates),
            saved: Vec::with_capacity(self.model.config().n_layers),
            reduce_now: self.stage.partitions_gradients() || self.micro + 1 == accum,
            dropout: self.dropout(),
            noise: self.neftune(batch.seq_len),
            fates,
        })
    }

    /// Which blocks the next micro-batch of [`Engine::forward_backward`]
    /// runs: every one, or under `train.progressive_layer_drop` those its
    /// draws keep, keyed by `train.seed`, the step and the micro-batch (the
    /// same on every rank).
    pub(crate) fn block_fates(&self) -> BlockFates {
        let n = self.model.config().n_layers;
        match &self.spec.train.progressive_layer_drop {
            Some(pld) => {
                BlockFates::draw(pld, self.spec.train.seed, (self.step, self.micro as u64), n)
            }
            None => BlockFates::all(n),
        }
    }

    /// The dropouts of the micro-batch [`Engine::forward_backward`] runs
    /// next: of the hidden states (site 0 the embedding's output, site `b`
    /// block `b`'s branches; `None` without `model.hidden_dropout`) and of
    /// attention's probabilities (site `b` block `b`'s; `None` without
    /// `model.attention_dropout`). The key is the seed, the step, the
    /// micro-batch and the rank: the same in a recomputed forward and after
    /// a resume, whatever the stage, and different for every batch.
    pub fn dropout(&self) -> BlockDropout {
        let m = &self.spec.model;
        let key = self.micro_batch_key();
        BlockDropout {
            hidden: Dropout::new(m.hidden_dropout(), key),
            // Another stream of keys than the hidden states'.
            attention: Dropout::new(m.attention_dropout(), !key),
        }
    }

    /// NEFTune's noise on the embeddings of the micro-batch
    /// [`Engine::forward_backward`] runs next, for sequences of `t` tokens
    /// (`None` without `train.neftune_noise_alpha`): its draws keyed as
    /// [`Engine::dropout`]'s masks, from a stream of their own.
    pub fn neftune(&self, t: usize) -> Option<Noise> {
        let alpha = self.spec.train.neftune_noise_alpha;
        let d = self.spec.model.d_model;
        Noise::new(
            alpha,
            (t, d),
            zmodel::dropout::mix64(self.micro_batch_key() ^ 0x4E45),
        )
    }

    /// The seed, the step, the micro-batch and the rank, mixed: what this
    /// micro-batch's dropout masks and noise are keyed by.
    fn micro_batch_key(&self) -> u64 {
        let counters = [self.step, self.micro as u64, self.comm.rank() as u64];
        counters.iter().fold(self.spec.train.seed, |key, &c| {
            zmodel::dropout::mix64(key ^ c)
        })
    }

    /// Group 0's forward; returns the blocks' input (without a graph).
    fn forward_embedding(&mut self, mb: &mut MicroBatch) -> Result<Tensor, EngineError> {
        let p0 = self.params_for(0, &mut mb.gather)?;
        let _t = profile::module(Module::Embedding, Pass::Forward);
        let x = self.model.embed_documents(
            &EmbeddingParams::from_vec(p0, self.model.layout())?,
            &mb.tokens,
            mb.docs.as_ref(),
        )?;
        self.release(0);
        // NEFTune's noise on the embeddings, then their dropout (as
        // transformers' hook on the input embeddings runs before it).
        let x = match mb.noise {
            Some(n) => n.add_to(&x)?,
            None => x,
        };
        Ok(match mb.dropout.hidden {
            Some(d) => d.site(0).apply(&x)?,
            None => x,
        })
    }

    /// The blocks' forward; each keeps its activations, or with checkpointing
    /// only its input. Records the bytes they hold (measured: what each
    /// block's kept tensors hold, [`zmodel::BlockActs::bytes`]) with the
    /// head's (computed), at their peak.
    fn forward_blocks(
        &mut self,
        mb: &mut MicroBatch,
        mut x: Tensor,
    ) -> Result<Tensor, EngineError> {
        let n_layers = self.model.config().n_layers;
        let checkpointing = self.spec.train.activation_checkpointing;
        let model = self.model.clone();
        let (rows, t) = mb.tokens.dims2()?;
        // Bytes of what the saved blocks keep, and of the most any block
        // keeps (with checkpointing, what backward's recomputation holds).
        let (mut kept, mut largest) = (0, 0);
        for b in 1..=n_layers {
            // A skipped block passes its input on.
            if !mb.fates.runs(b) {
                continue;
            }
            let mut src = BlockFromEngine::gather(self, &mut mb.gather, b, false)?;
            let dropout = mb.fates.dropout(b, mb.dropout.site(b as u64));
            let timed = profile::module(Module::Block(b - 1), Pass::Forward);
            let (y, acts) = model.block_forward_from(&mut src, &x, mb.docs.as_ref(), dropout)?;
            drop(timed);
            src.release_block();
            let bytes = acts.bytes();
            largest = largest.max(bytes);
            // Backward stops above frozen blocks: nothing of theirs is kept.
            if b >= self.backward_reach {
                mb.saved.push(match checkpointing {
                    true => {
                        kept += x.elem_count() * x.dtype().size_in_bytes();
                        Saved::Input(x)
                    }
                    false => {
                        kept += bytes;
                        Saved::Acts(acts)
                    }
                });
            }
            x = y;
        }
        let m = &self.spec.model;
        // The output matrix's gradient is the head's to hold where it is
        // made apart from its group's buffer.
        let apart = !self.model.frozen_output() && !self.output_gradient_fits();
        let head = zconfig::estimate::head_activation_bytes(m, rows, t, (false, apart));
        let recomputed = if checkpointing { largest } else { 0 };
        let peak = (kept + recomputed) as u64 + head as u64;
        self.peak_activations = self.peak_activations.max(peak);
        Ok(x)
    }

    /// The head (with the embedding, when tied), forward and backward back to
    /// back. Returns the loss and the gradient of the head's input.
    fn head_forward_backward(
        &mut self,
        mb: &mut MicroBatch,
        x: &Tensor,
    ) -> Result<(f64, Tensor), EngineError> {
        let head = self.model.config().n_layers + 1;
        let layout = self.model.layout();
        let ph = self.params_for(head, &mut mb.gather)?;
        let head_params = HeadParams::from_vec(ph, layout)?;
        let tied = head_params.lm_head.is_none();
        let wte = match tied {
            true => {
                Some(EmbeddingParams::from_vec(self.params_for(0, &mut mb.gather)?, layout)?.wte)
            }
            false => None,
        };
        let scaled = (self.seed_scale(), mb.divisor);
        let model = self.model.clone();
        let trains = !model.frozen_output();
        let in_place = trains && self.output_gradient_fits();
        let w = wte.as_ref();
        let timed = profile::module(Module::Head, Pass::Backward);
        let back = match (trains, in_place) {
            (_, true) => {
                let into = self.output_gradient_buffer()?;
                model.head_backward_into(&head_params, w, (x, &mb.targets), scaled, into)?
            }
            // Added into the group's buffer a run of rows at a time, as
            // the head makes them.
            (true, false) => {
                let (g, slot) = self.output_slot();
                let range = self.groups[g].layout.params[slot].range.clone();
                let d = model.config().d_model;
                let mut add = |row: usize, values: &[f32]| -> candle_core::Result<()> {
                    let at = range.start + row * d;
                    self.add_values_to(g, at..at + values.len(), values, "the output matrix")
                        .map_err(|e| candle_core::Error::Msg(e.to_string()))
                };
                model.head_backward_adding(&head_params, w, (x, &mb.targets), scaled, &mut add)?
            }
            (false, false) => {
                model.head_backward(&head_params, w, x, &mb.targets, scaled.0, scaled.1)?
            }
        };
        drop(timed);
        if !back.loss.is_finite() {
            return Err(EngineError::NonFinite {
                step: self.step + 1,
                what: "loss",
                value: back.loss,
            });
        }
        // The untied output matrix's gradient: made, added in place, or
        // none (frozen, `Gpt::with_frozen_output`).
        let norm = [Some(&back.norm.weight), back.norm.bias.as_ref()];
        let mut grads: Vec<SlotGrad> = norm.into_iter().flatten().map(SlotGrad::Whole).collect();
        if !tied {
            grads.push(match (&back.out, trains) {
                (Some(out), _) => SlotGrad::Whole(out),
                (None, true) => SlotGrad::Added,
                (None, false) => SlotGrad::Frozen,
            });
        }
        self.accumulate(head, &grads)?;
        let (loss_value, dx) = (back.loss, back.dx);
        drop((wte, head_params));
        self.release(head);
        if tied {
            self.release(0);
        }
        if mb.reduce_now {
            self.group_done(head)?;
        }
        Ok((loss_value, dx))
    }

    /// The output matrix's group and slot: `wte` (the embedding's first)
    /// where the head is tied, else `lm_head` (the head's last).
    fn output_slot(&self) -> (usize, usize) {
        match self.model.config().tied() {
            true => (0, 0),
            false => {
                let head = self.model.config().n_layers + 1;
                (head, self.groups[head].layout.params.len() - 1)
            }
        }
    }

    /// Whether the head can add the output matrix's gradient into its
    /// group's micro-batch buffer itself ([`Engine::output_gradient_buffer`]):
    /// where that buffer is f32 and holds none of this micro-batch's
    /// gradients yet (a full buffer whose zero is owed, or no staging buffer
    /// made). Elsewhere the gradient is made apart and added: a chain of
    /// products started from gradients already there would not end with
    /// the bits of every stage alike.
    fn output_gradient_fits(&self) -> bool {
        let (g, _) = self.output_slot();
        self.grads_half.is_none()
            && match self.stage.partitions_gradients() {
                true => self.groups[g].staging.is_none(),
                false => self.groups[g].zero_owed,
            }
    }

    /// The output matrix's part of its group's micro-batch buffer, zeroed
    /// ([`Engine::micro_grads`] settles it), for the head to add its
    /// gradient into where [`Engine::output_gradient_fits`].
    fn output_gradient_buffer(&mut self) -> Result<&mut [f32], EngineError> {
        let (g, slot) = self.output_slot();
        let range = self.groups[g].layout.params[slot].range.clone();
        let at = self.micro_at(g, range.start);
        match self.micro_grads(g) {
            Flat::F32(v) => Ok(&mut v[at..at + range.len()]),
            Flat::Half(..) => Err(EngineError::BadGradient {
                param: "the output matrix".into(),
                problem: "a 16-bit gradient buffer taken for f32".into(),
            }),
        }
    }

    /// Backward through the blocks, last first, down to the lowest that
    /// trains ([`Engine::backward_reach`]); returns that block's input
    /// gradient (the embedding's output gradient where it trains).
    fn backward_blocks(
        &mut self,
        mb: &mut MicroBatch,
        mut dx: Tensor,
    ) -> Result<Tensor, EngineError> {
        let model = self.model.clone();
        for b in (self.backward_reach.max(1)..=self.model.config().n_layers).rev() {
            // A skipped block passes the gradient on and adds none of its
            // own, but its groups still complete their buckets.
            if !mb.fates.runs(b) {
                self.skipped_block_done(b, mb.reduce_now)?;
                continue;
            }
            let mut src = BlockFromEngine::gather(self, &mut mb.gather, b, mb.reduce_now)?;
            let acts = match mb.saved.pop() {
                Some(Saved::Acts(acts)) => acts,
                Some(Saved::Input(x)) => {
                    let dropout = mb.fates.dropout(b, mb.dropout.site(b as u64));
                    let _t = profile::module(Module::Block(b - 1), Pass::Recompute);
                    model
                        .block_forward_from(&mut src, &x, mb.docs.as_ref(), dropout)?
                        .1
                }
                None => return Err(missing(&format!("block {b}'s saved activations"))),
            };
            let timed = profile::module(Module::Block(b - 1), Pass::Backward);
            dx = model.block_backward_into(&mut src, &acts, &dx)?;
            drop((timed, acts));
            src.finish_backward()?;
        }
        Ok(dx)
    }

    /// Backward is done with block `b`, which this micro-batch skipped: its
    /// groups (tiles first, as backward completes them) add a zero
    /// gradient, which makes their buffers hold this step's sum so far
    /// (zeros where it is the first), and with `reduce_now` complete their
    /// buckets as a block that ran would.
    fn skipped_block_done(&mut self, b: usize, reduce_now: bool) -> Result<(), EngineError> {
        let groups: Vec<usize> = block_completion(&self.model, b).collect();
        for g in groups {
            if self.groups[g].layout.all_frozen() {
                continue;
            }
            self.micro_grads(g);
            if reduce_now {
                self.group_done(g)?;
            }
        }
        Ok(())
    }

    /// The embedding's backward, from the tokens and `dx` alone.
    pub(crate) fn backward_embedding(
        &mut self,
        mb: &mut MicroBatch,
        dx: &Tensor,
    ) -> Result<(), EngineError> {
        let dropped;
        let dx = match mb.dropout.hidden {
            Some(d) => {
                dropped = d.site(0).apply(dx)?;
                &dropped
            }
            None => dx,
        };
        // The token table (slot 0) trains unless frozen; where it does,
        // only the rows the tokens picked are made and added.
        let wte_trains = !self.groups[0].layout.params[0].frozen;
        let timed = profile::module(Module::Embedding, Pass::Backward);
        let back = (self.model).embed_backward(&mb.tokens, mb.docs.as_ref(), dx, wte_trains)?;
        let mut grads = vec![match &back.wte {
            Some(rows) => SlotGrad::Rows(rows),
            None => SlotGrad::Frozen,
        }];
        grads.extend(back.wpe.as_ref().map(SlotGrad::Whole));
        drop(timed);
        self.accumulate(0, &grads)?;
        if mb.reduce_now {
            self.group_done(0)?;
        }
        Ok(())
    }

    /// The buffer this micro-batch's gradients of group `g` accumulate into:
    /// the gradients themselves, or a staging buffer where the stage keeps only
    /// the own slice (it leaves with the group's bucket).
    fn micro_grads(&mut self, g: usize) -> &mut Flat {
        if !self.stage.partitions_gradients() {
            return self.groups[g].settled_grads();
        }
        let (half, len) = (self.grads_half, self.staged_len(g));
        let comm_buffers = &mut self.comm_buffers;
        self.groups[g].staging.get_or_insert_with(|| {
            let staging = Flat::zeros(half, len);
            comm_buffers.add(staging.bytes());
            staging
        })
    }

    /// Elements of group `g`'s staged micro-batch gradient: only those its
    /// bucket carries, so a partly frozen group stages no frozen
    /// parameter's zeros (where buckets leave them out).
    fn staged_len(&self, g: usize) -> usize {
        let layout = &self.groups[g].layout;
        layout.carried_before(layout.padded, self.reducer.leaves_frozen_out())
    }

    /// Where `range` (flat indices) of group `g` lies in its micro-batch
    /// gradient buffer: in place in whole gradients, at the carried index
    /// in a staged one ([`GroupLayout::carried_before`]).
    fn micro_at(&self, g: usize, at: usize) -> usize {
        match self.stage.partitions_gradients() {
            true => (self.groups[g].layout).carried_before(at, self.reducer.leaves_frozen_out()),
            false => at,
        }
    }

    /// Adds `values` into `range` of group `g`'s micro-batch gradient buffer.
    pub(crate) fn add_values_to(
        &mut self,
        g: usize,
        range: Range<usize>,
        values: &[f32],
        name: &str,
    ) -> Result<(), EngineError> {
        if values.len() != range.len() {
            return Err(EngineError::BadGradient {
                param: name.to_string(),
                problem: format!(
                    "{} elements for a parameter of {}",
                    values.len(),
                    range.len()
                ),
            });
        }
        let at = self.micro_at(g, range.start);
        self.micro_grads(g).add_f32(at, values);
        Ok(())
    }

    /// Whether the micro-batches run on a GPU.
    pub(crate) fn on_gpu(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.gpu.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Adds a group's parameter gradients, in slot order, into its micro-batch
    /// gradient buffer.
    pub(crate) fn accumulate_tensors(
        &mut self,
        g: usize,
        grads: &[&Tensor],
    ) -> Result<(), EngineError> {
        let grads: Vec<SlotGrad> = grads.iter().map(|t| SlotGrad::Whole(t)).collect();
        self.accumulate(g, &grads)
    }

    /// Adds a group's parameter gradients, in slot order, into its
    /// micro-batch gradient buffer, each whole or as the rows a token table's
    /// tokens picked ([`SlotGrad`]).
    pub(crate) fn accumulate(&mut self, g: usize, grads: &[SlotGrad]) -> Result<(), EngineError> {
        if self.groups[g].layout.all_frozen() {
            return Ok(()); // no gradient kept, none reduced
        }
        let slots = self.groups[g].layout.params.clone();
        if slots.len() != grads.len() {
            return Err(EngineError::BadGradient {
                param: self.groups[g].layout.name.clone(),
                problem: format!("{} gradients for {} parameters", grads.len(), slots.len()),
            });
        }
        // Each trained parameter's gradient as parts `(at, values)` of the
        // buffer. (A frozen parameter's gradient is not kept: zeros stay
        // zeros, and its tensor, zeros broadcast, is not made whole.)
        let tensors = (slots.iter().zip(grads))
            .map(|(slot, grad)| match (grad, slot.frozen) {
                (SlotGrad::Whole(t), false) => t.contiguous().map(Some),
                _ => Ok(None),
            })
            .collect::<candle_core::Result<Vec<Option<Tensor>>>>()?;
        let held: Vec<_> = (tensors.iter())
            .map(|t| t.as_ref().map(Tensor::storage_and_layout))
            .collect();
        let mut parts = Vec::new();
        for ((slot, grad), held) in slots.iter().zip(grads).zip(&held) {
            if slot.frozen {
                continue;
            }
            let at = self.micro_at(g, slot.range.start);
            let len = slot.range.len();
            let bad = |problem: String| EngineError::BadGradient {
                param: slot.name.clone(),
                problem,
            };
            match (grad, held) {
                (SlotGrad::Whole(_), Some((storage, layout))) => {
                    parts.push((at, grad_values(storage, layout, len, &slot.name)?));
                }
                (SlotGrad::Added, _) => {}
                (SlotGrad::Rows(rows), _) => {
                    let height = len / rows.width.max(1);
                    if rows.width * height != len
                        || rows.values.len() != rows.rows.len() * rows.width
                    {
                        return Err(bad(format!(
                            "{} rows of width {} for a parameter of {len}",
                            rows.rows.len(),
                            rows.width
                        )));
                    }
                    if let Some(r) = rows.rows.iter().find(|&&r| r as usize >= height) {
                        return Err(bad(format!("row {r} of a table of {height}")));
                    }
                    parts.extend(rows.iter().map(|(r, v)| (at + r * rows.width, v)));
                }
                _ => return Err(bad("no gradient made for a parameter that trains".into())),
            }
        }
        parts.sort_by_key(|(at, _)| *at);
        let partitioned = self.stage.partitions_gradients();
        let added = grads.iter().any(|grad| matches!(grad, SlotGrad::Added));
        if !added
            && ((partitioned && self.groups[g].staging.is_none())
                || (!partitioned && self.groups[g].zero_owed))
        {
            // The group's first gradients: its staging buffer made from
            // them in one pass (`Flat::with_parts`: the bits of zeroing it
            // and adding them, without the zeroing pass and the
            // read-modify-write; 2.4% and 0.8% of a bf16 stage-3 step's
            // samples before), or its full buffer, which holds the last
            // step's, written over the same way (`Flat::set_parts`).
            let staged_len = self.staged_len(g);
            let group = &mut self.groups[g];
            if !partitioned {
                let runs = group.trained_grads(0..group.grads.len());
                if group.grads.set_parts_over(&runs, &parts) {
                    group.zero_owed = false;
                    return Ok(());
                }
            } else if let Some(staging) = Flat::with_parts(self.grads_half, staged_len, &parts) {
                self.comm_buffers.add(staging.bytes());
                group.staging = Some(staging);
                return Ok(());
            }
        }
        match self.micro_grads(g).add_parts(&parts) {
            true => Ok(()),
            false => Err(EngineError::BadGradient {
                param: self.groups[g].layout.name.clone(),
                problem: "gradients overlapping or past the group's end".into(),
            }),
        }
    }
}

/// One parameter's gradient from a micro-batch, for [`Engine::accumulate`].
pub(crate) enum SlotGrad<'a> {
    /// Whole, in the parameter's shape.
    Whole(&'a Tensor),
    /// The rows of a token table that a micro-batch's tokens picked; the
    /// other rows' gradients are zero.
    Rows(&'a TokenRows),
    /// Added into the buffer already (the head's output matrix,
    /// [`Engine::output_gradient_buffer`]).
    Added,
    /// None made: the parameter is frozen.
    Frozen,
}

/// One block's parameters for the model's forward and backward, from the
/// engine: the block's own group (layer norms, linears kept whole) gathered
/// for the whole pass; each tile of a tiled linear gathered just before its
/// use and released right after. In backward each tile's gradient is
/// accumulated, and its bucket reduced, as soon as it exists; the block
/// group's gradient when the block is done.
struct BlockFromEngine<'a> {
    engine: &'a mut Engine,
    gather: &'a mut Prefetcher,
    /// The block's group.
    block: usize,
    /// Its parameters, in slot order.
    own: Vec<Tensor>,
    /// Per tiled linear, its tiles' groups.
    tiles: Vec<(BlockLinear, Range<usize>)>,
    /// Backward: the block group's gradients so far, in slot order.
    own_grads: Vec<Option<Tensor>>,
    /// Whether gradients are reduced as backward goes.
    reduce_now: bool,
}

impl<'a> BlockFromEngine<'a> {
    /// Gathers block `block`'s own group.
    fn gather(
        engine: &'a mut Engine,
        gather: &'a mut Prefetcher,
        block: usize,
        reduce_now: bool,
    ) -> Result<BlockFromEngine<'a>, EngineError> {
        let own = engine.params_for(block, gather)?;
        let tiles = engine.model.tile_groups(block);
        Ok(BlockFromEngine {
            own_grads: vec![None; own.len()],
            own,
            tiles,
            engine,
            gather,
            block,
            reduce_now,
        })
    }

    /// The slots of `{block prefix}.{name}.{weight, bias}` in the block's
    /// group (the bias where the layer has one: the group is the model's
    /// own, [`zmodel::Gpt::groups`]).
    fn slots(&self, name: &str) -> Result<WeightBias<usize>, EngineError> {
        let prefix = format!("{}.{name}.", self.engine.model.block_prefix(self.block));
        let slots = &self.engine.groups[self.block].layout.params;
        let find = |what: &str| {
            slots
                .iter()
                .position(|s| s.name == format!("{prefix}{what}"))
                .ok_or_else(|| missing(&format!("{prefix}{what}")))
        };
        Ok(WeightBias {
            weight: find("weight")?,
            bias: slots.iter().position(|s| s.name == format!("{prefix}bias")),
        })
    }

    fn own_pair(&self, name: &str) -> Result<WeightBias<Tensor>, EngineError> {
        Ok(self.slots(name)?.map(|s| self.own[s].clone()))
    }

    fn keep_grad(&mut self, name: &str, grad: WeightBias<Tensor>) -> Result<(), EngineError> {
        let s = self.slots(name)?;
        self.own_grads[s.weight] = Some(grad.weight);
        if let (Some(slot), Some(bias)) = (s.bias, grad.bias) {
            self.own_grads[slot] = Some(bias);
        }
        Ok(())
    }

    /// The group of tile `t` of `linear`, if it is tiled.
    fn tile_group(&self, linear: BlockLinear, t: usize) -> Option<usize> {
        self.tiles
            .iter()
            .find(|(l, _)| *l == linear)
            .map(|(_, groups)| groups.start + t)
    }

    /// After a forward: the block's own group is released.
    fn release_block(self) {
        self.engine.release(self.block);
    }

    /// After a backward: the block group's gradient is accumulated, its
    /// parameters released and, if due, its bucket reduced.
    fn finish_backward(self) -> Result<(), EngineError> {
        let grads = self
            .own_grads
            .into_iter()
            .enumerate()
            .map(|(i, g)| {
                g.ok_or_else(|| missing(&self.engine.groups[self.block].layout.params[i].name))
            })
            .collect::<Result<Vec<_>, _>>()?;
        drop(self.own);
        self.engine
            .accumulate_tensors(self.block, &grads.iter().collect::<Vec<_>>())?;
        self.engine.release(self.block);
        if self.reduce_now {
            self.engine.group_done(self.block)?;
        }
        Ok(())
    }
}

impl BlockSource for BlockFromEngine<'_> {
    type Error = EngineError;

    fn norm(&mut self, which: BlockNorm) -> Result<WeightBias<Tensor>, EngineError> {
        self.own_pair(self.engine.model.norm_name(which))
    }

    fn linear(
        &mut self,
        linear: BlockLinear,
        tile: usize,
        columns: Range<usize>,
    ) -> Result<WeightBias<Tensor>, EngineError> {
        let name = self.engine.model.linear_name(linear);
        let Some(g) = self.tile_group(linear, tile) else {
            return self.own_pair(name);
        };
        let mut p = self.engine.params_for(g, self.gather)?.into_iter();
        let weight = p.next().ok_or_else(|| missing(name))?;
        let bias = p.next();
        assert_eq!(weight.dim(1)?, columns.len(), "tile {tile} of {name}");
        Ok(WeightBias { weight, bias })
    }

    fn release(&mut self, linear: BlockLinear, tile: usize) -> Result<(), EngineError> {
        if let Some(g) = self.tile_group(linear, tile) {
            self.engine.release(g);
        }
        Ok(())
    }

    fn norm_grad(&mut self, which: BlockNorm, grad: WeightBias<Tensor>) -> Result<(), EngineError> {
        self.keep_grad(self.engine.model.norm_name(which), grad)
    }

    fn weight_frozen(&self, linear: BlockLinear) -> bool {
        // A tiled linear's tile groups hold its weight first, then its bias.
        let (g, slot) = match self.tile_group(linear, 0) {
            Some(g) => (g, 0),
            None => match self.slots(self.engine.model.linear_name(linear)) {
                Ok(s) => (self.block, s.weight),
                Err(_) => return false, // its gradient is missing, which `linear_grad` says
            },
        };
        self.engine.groups[g].layout.params[slot].frozen
    }

    fn linear_grad(
        &mut self,
        linear: BlockLinear,
        tile: usize,
        grad: WeightBias<Tensor>,
    ) -> Result<(), EngineError> {
        let Some(g) = self.tile_group(linear, tile) else {
            return self.keep_grad(self.engine.model.linear_name(linear), grad);
        };
        let grads = grad.into_vec();
        self.engine
            .accumulate_tensors(g, &grads.iter().collect::<Vec<_>>())?;
        if self.reduce_now {
            self.engine.group_done(g)?;
        }
        Ok(())
    }
}

fn missing(what: &str) -> EngineError {
    EngineError::MissingGradient {
        param: what.to_string(),
    }
}

/// A contiguous gradient's `len` f32 values, in place in its CPU storage.
fn grad_values<'a>(
    storage: &'a Storage,
    layout: &Layout,
    len: usize,
    name: &str,
) -> Result<&'a [f32], EngineError> {
    let bad = |problem: String| EngineError::BadGradient {
        param: name.to_string(),
        problem,
    };
    let values = match (storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => &v[a..b],
        _ => return Err(bad("not f32 on the CPU".into())),
    };
    if values.len() != len {
        return Err(bad(format!(
            "{} elements for a parameter of {len}",
            values.len()
        )));
    }
    Ok(values)
}
