//! Finishing an optimizer step, as named phases (DeepSpeed's stage-3 `step()`
//! has the same skeleton): wait for the reductions, average and unscale,
//! the global norm, the overflow check and loss scale, clipping, then AdamW
//! sub-group by sub-group (LAMB: its first pass over the region, the trust
//! ratios from every rank's sums, its second pass), and sharing the updated
//! slices.
//!
//! The optimizer walks the region this rank updates as a sequence of
//! sub-groups of at most `zero.sub_group_size` elements, each possibly spanning
//! several blocks. AdamW is element-wise, so the split changes no bit; it is
//! the unit that NVMe offload swaps in and out.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::accounting::{
    peak_rss_bytes, LayerDropStats, MemoryUse, StepStats, Transient, TrustRatios,
};
use crate::adam::{trust_ratio, AdamStep, OptimizerKind, SquareSums};
use crate::engine::Engine;
use crate::error::EngineError;
use crate::flat::{Bucket, NormCell};
use crate::gather::Gathering;
use crate::group::{Group, Swapped};
use crate::offload::ALIGN_ELEMS;
use crate::precision::Flat;
use crate::schedule::{beta1_at, initial_sum_at};

/// An f64 as two f32 words for a collective of f32s (hi, and the rest):
/// 48 bits of it, the same on every rank that adds them back.
fn f64_words(x: f64) -> [f32; 2] {
    let hi = x as f32;
    [hi, (x - f64::from(hi)) as f32]
}

/// The f64 that [`f64_words`] sent.
fn from_words(hi: f32, lo: f32) -> f64 {
    f64::from(hi) + f64::from(lo)
}

/// What a pass over swapped sub-groups does to each piece.
enum SwappedPass<'a> {
    /// AdamW (or Lion).
    Adam(&'a AdamStep),
    /// LAMB's first pass, adding to each group's cells' sums.
    LambMoments(&'a AdamStep, &'a [Vec<NormCell>], &'a mut [Vec<SquareSums>]),
    /// LAMB's second pass, with each group's ratios by slot.
    LambApply(&'a AdamStep, &'a [Vec<f32>]),
}

/// Part of the region this rank updates: flat ranges of one or more groups,
/// updated together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SubGroup {
    /// (group index, flat range inside that group), in group order.
    pub(crate) pieces: Vec<(usize, Range<usize>)>,
}

/// Splits the per-group `regions` (in group order) into consecutive sub-groups
/// of at most `max` elements (at least `align`), each piece starting a multiple
/// of `align` elements into its region.
pub(crate) fn plan_sub_groups(regions: &[Range<usize>], max: usize, align: usize) -> Vec<SubGroup> {
    let align = align.max(1);
    let max = (max / align).max(1) * align;
    let mut out = Vec::new();
    let mut cur = SubGroup { pieces: Vec::new() };
    let mut room = max;
    for (g, region) in regions.iter().enumerate() {
        let mut at = region.start;
        while at < region.end {
            let end = region.end.min(at + room);
            cur.pieces.push((g, at..end));
            room -= end - at;
            at = end;
            // A piece that ended its region leaves room that the next region's
            // first piece may use, in whole `align` units.
            room -= room % align;
            if room == 0 {
                out.push(std::mem::replace(&mut cur, SubGroup { pieces: Vec::new() }));
                room = max;
            }
        }
    }
    if !cur.pieces.is_empty() {
        out.push(cur);
    }
    out
}

impl Engine {
    /// Finishes the optimizer step after `grad_accum` micro-batches.
    pub fn step(&mut self) -> Result<StepStats, EngineError> {
        let started = Instant::now();
        let mut stats = self.step_after_micro_batches()?;
        stats.times.optimizer = started.elapsed();
        Ok(stats)
    }

    /// [`Engine::step`]'s work.
    fn step_after_micro_batches(&mut self) -> Result<StepStats, EngineError> {
        let accum = self.spec.train.grad_accum;
        if self.micro != accum {
            return Err(EngineError::StepTooEarly {
                done: self.micro,
                accum,
            });
        }
        #[cfg(feature = "cuda")]
        if self.gpu_resident() {
            return self.gpu_step();
        }
        self.wait_for_reductions()?;
        self.check_swapped_grads()?;
        // A group that got no gradient this step reads as zeros.
        for g in &mut self.groups {
            g.settled_grads();
        }
        let step = self.step + 1;
        let loss_scale = self.scaler.as_ref().map(|s| s.scale);
        let grad_scale = self.average_gradients();
        let grad_norm = self.global_grad_norm(grad_scale)?;
        let overflow = self.check_overflow(step, grad_norm)?;
        let lr = self.next_lr();
        if !overflow {
            let (grad_scale, swapped_coef) = self.clip_gradients(grad_norm, grad_scale);
            self.updates += 1;
            let hp = self.adam_step(lr, grad_scale);
            let subs = self.sub_groups();
            if hp.rule == OptimizerKind::Lamb {
                self.lamb_steps(&subs, &hp, swapped_coef)?;
            } else if self.offload.is_some() {
                self.swapped_optimizer_steps(&subs, SwappedPass::Adam(&hp), swapped_coef)?;
            } else {
                for sub in &subs {
                    self.optimizer_step(sub, &hp);
                }
            }
            self.share_updated_params()?;
        }
        let full = !self.stage.partitions_gradients();
        for g in &mut self.groups {
            g.clear_grads(full);
        }
        if let Some(o) = &mut self.offload {
            o.reset_grads();
        }
        Ok(self.finish_step(step, lr, grad_norm, loss_scale, overflow))
    }

    /// The optimizer's hyperparameters for update number `self.updates` at
    /// `lr`.
    pub(crate) fn adam_step(&self, lr: f64, grad_scale: f32) -> AdamStep {
        let o = &self.spec.train.optimizer;
        let [mut beta1, beta2] = o.betas.map(|b| b as f32);
        if let Some(b) = beta1_at(self.updates, &self.spec.train) {
            beta1 = b as f32;
        }
        AdamStep {
            rule: o.kind,
            lr: lr as f32,
            beta1,
            beta2,
            eps: o.eps() as f32,
            weight_decay: self.spec.train.weight_decay as f32,
            step: self.updates,
            bias_correction: o.bias_correction(),
            grad_scale,
            lr_decay: o.lr_decay.unwrap_or(0.0) as f32,
            initial_sum: initial_sum_at(self.updates, &self.spec.train) as f32,
        }
    }

    /// The factor that averages gradients over ranks and micro-batches,
    /// unscales them and undoes the division before the reduction
    /// ([`Engine::seed_scale`]; a power of two where that is one).
    pub(crate) fn average_scale(&self) -> f32 {
        let (world, accum) = (self.comm.world_size(), self.spec.train.grad_accum);
        let loss_scale = self.scaler.as_ref().map_or(1.0, |s| s.scale);
        let predivide = self.spec.train.predivide(world);
        (predivide / (world * accum) as f64 / loss_scale) as f32
    }

    /// What the loss's gradient is multiplied by before backward: f16's
    /// loss scale over what gradients are divided by before the ranks add
    /// them (`train.gradient_predivide_factor`, or the world size under
    /// `train.prescale_gradients`, DeepSpeed's). Divided at the seed, every
    /// gradient a micro-batch makes and accumulates is already divided,
    /// with no pass of its own; [`Engine::average_scale`] multiplies back.
    pub(crate) fn seed_scale(&self) -> f64 {
        let loss_scale = self.scaler.as_ref().map_or(1.0, |s| s.scale);
        loss_scale / self.spec.train.predivide(self.comm.world_size())
    }

    /// Averages: f32 gradients in place (swapped ones were averaged as their
    /// last micro-batch was added). Returns the factor still to apply as
    /// gradients are read (16-bit gradients are scaled as Adam reads them).
    fn average_gradients(&mut self) -> f32 {
        let scale = self.average_scale();
        if self.grads_half.is_some() {
            return scale;
        }
        if scale == 1.0 {
            return 1.0; // one worker, one micro-batch: nothing to average
        }
        let (rank, stage) = (self.comm.rank(), self.stage);
        for g in self.groups.iter_mut().filter(|g| !g.layout.all_frozen()) {
            for r in g.trained_grads(g.used_grads(rank, stage)) {
                g.grads.scale_f32(r, scale);
            }
        }
        1.0
    }

    /// Swapped gradients: every group has all its micro-batches, and their
    /// writes have landed before the step reads them.
    fn check_swapped_grads(&mut self) -> Result<(), EngineError> {
        let Some(off) = &mut self.offload else {
            return Ok(());
        };
        let accum = self.spec.train.grad_accum;
        for (g, group) in self.groups.iter().enumerate() {
            // A frozen group gets no gradient to swap.
            if !group.layout.all_frozen() && off.grad_adds(g).is_some_and(|n| n != accum) {
                return Err(EngineError::MissingGradient {
                    param: format!("{} (swapped)", group.layout.name),
                });
            }
        }
        off.flush_grads(&mut self.swap_buffers)
    }

    /// The global gradient norm: each rank's owned slices, added across ranks
    /// in rank order (an f64 sum sent as two f32 words, so it is exact enough
    /// and the same on every rank).
    fn global_grad_norm(&self, grad_scale: f32) -> Result<f64, EngineError> {
        let rank = self.comm.rank();
        let swapped = |i: usize| self.offload.as_ref().and_then(|o| o.grad_sum_sq(i));
        let own_sq: f64 = self
            .groups
            .iter()
            .enumerate()
            .filter(|(_, g)| !g.layout.all_frozen())
            .map(|(i, g)| {
                swapped(i).unwrap_or_else(|| g.owned_grads_sum_sq(rank, self.stage, grad_scale))
            })
            .sum();
        self.norm_from_own_sq(own_sq)
    }

    /// The global norm from this rank's sum of squares: the ranks' sums
    /// added in rank order (each an f64 sent as two f32 words, so exact
    /// enough and the same on every rank). A third word carries the rank's
    /// stop flag ([`Engine::stop_on`]): every rank learns in the same
    /// collective whether any was asked to stop, with no message of its own.
    pub(crate) fn norm_from_own_sq(&self, own_sq: f64) -> Result<f64, EngineError> {
        let world = self.comm.world_size();
        let [hi, lo] = f64_words(own_sq);
        let stop = f32::from(u8::from(self.stop_asked.load(Ordering::SeqCst)));
        let parts = self.comm.all_gather(vec![hi, lo, stop], 3 * world)?;
        let total_sq: f64 = parts.chunks(3).map(|p| from_words(p[0], p[1])).sum();
        let any_stop = parts.chunks(3).any(|p| p[2] != 0.0);
        self.stop_agreed.store(any_stop, Ordering::SeqCst);
        Ok(total_sq.sqrt())
    }

    /// Whether the gradients overflowed. f16: updates the loss scale, and an
    /// overflow at the minimum scale fails; other dtypes: an overflow fails.
    pub(crate) fn check_overflow(
        &mut self,
        step: u64,
        grad_norm: f64,
    ) -> Result<bool, EngineError> {
        let overflow = !grad_norm.is_finite();
        let Some(scaler) = &mut self.scaler else {
            if overflow {
                return Err(EngineError::NonFinite {
                    step,
                    what: "gradient norm",
                    value: grad_norm,
                });
            }
            return Ok(false);
        };
        if overflow && scaler.at_minimum() {
            return Err(EngineError::NonFinite {
                step,
                what: "gradient norm at the minimum loss scale",
                value: grad_norm,
            });
        }
        let before = scaler.scale;
        scaler.update(step as i64 - 1, overflow);
        let factor = scaler.scale / before;
        self.reducer.follow_loss_scale(overflow, factor);
        Ok(overflow)
    }

    /// Clips by the global norm: f32 gradients in place, 16-bit ones through the
    /// returned factor that Adam applies as it reads them. Returns that factor
    /// and the coefficient swapped f32 gradients still need, in place as
    /// they are read.
    fn clip_gradients(&mut self, grad_norm: f64, grad_scale: f32) -> (f32, Option<f32>) {
        let clip = self.spec.train.grad_clip;
        if clip <= 0.0 || grad_norm <= clip {
            return (grad_scale, None);
        }
        let coef = (clip / (grad_norm + 1e-6)) as f32;
        if self.grads_half.is_some() {
            return (grad_scale * coef, None);
        }
        let swapped = self.offload.as_ref().is_some_and(|o| o.grads.is_some());
        let (rank, stage) = (self.comm.rank(), self.stage);
        // (A group frozen whole holds no gradients.)
        for g in self.groups.iter_mut().filter(|g| !g.layout.all_frozen()) {
            for r in g.trained_grads(g.used_grads(rank, stage)) {
                g.grads.scale_f32(r, coef);
            }
        }
        (grad_scale, swapped.then_some(coef))
    }

    /// The region this rank updates, as sub-groups of `zero.sub_group_size`.
    pub(crate) fn sub_groups(&self) -> Vec<SubGroup> {
        let rank = self.comm.rank();
        // A group frozen whole is not updated: an empty region.
        let regions: Vec<Range<usize>> = self
            .groups
            .iter()
            .map(|g| match g.layout.all_frozen() {
                true => 0..0,
                false => g.updated_region(rank, self.stage),
            })
            .collect();
        // Swapped pieces start on whole disk blocks (see `offload`).
        let align = if self.offload.is_some() {
            ALIGN_ELEMS
        } else {
            1
        };
        plan_sub_groups(&regions, self.spec.zero.sub_group_size.0 as usize, align)
    }

    /// AdamW on one sub-group.
    fn optimizer_step(&mut self, sub: &SubGroup, hp: &AdamStep) {
        let (rank, stage) = (self.comm.rank(), self.stage);
        for (g, range) in &sub.pieces {
            self.groups[*g].adam(range.clone(), rank, stage, hp, Swapped::default());
        }
    }

    /// LAMB over the region this rank updates: the first pass (moments, and
    /// each parameter's sums of squares cell by cell), the trust ratios from
    /// every rank's sums, the second pass. With NVMe offload each pass runs
    /// over the sub-groups through the swap pipeline (`subs`; swapped f32
    /// gradients clipped by `coef` as the first pass reads them), so the
    /// state is read twice.
    fn lamb_steps(
        &mut self,
        subs: &[SubGroup],
        hp: &AdamStep,
        coef: Option<f32>,
    ) -> Result<(), EngineError> {
        let (rank, stage) = (self.comm.rank(), self.stage);
        let cells: Vec<Vec<NormCell>> = self.groups.iter().map(|g| g.layout.norm_cells()).collect();
        let mut sums: Vec<Vec<SquareSums>> = cells
            .iter()
            .map(|c| vec![SquareSums::default(); c.len()])
            .collect();
        let swapped = self.offload.is_some();
        if swapped {
            self.swapped_optimizer_steps(
                subs,
                SwappedPass::LambMoments(hp, &cells, &mut sums),
                coef,
            )?;
        } else {
            let all = self.groups.iter_mut().zip(&cells).zip(&mut sums);
            for ((g, c), s) in all.filter(|((g, _), _)| !g.layout.all_frozen()) {
                let region = g.updated_region(rank, stage);
                g.lamb_moments(region, rank, stage, hp, (c, s), Swapped::default());
            }
        }
        let (ratios, summary) = self.trust_ratios(&cells, &sums)?;
        self.trust_ratio = summary;
        if swapped {
            self.swapped_optimizer_steps(subs, SwappedPass::LambApply(hp, &ratios), None)?;
        } else {
            let all = self.groups.iter_mut().zip(&ratios);
            for (g, r) in all.filter(|(g, _)| !g.layout.all_frozen()) {
                let region = g.updated_region(rank, stage);
                g.lamb_apply(region, rank, stage, hp, r, Swapped::default());
            }
        }
        Ok(())
    }

    /// Each parameter's trust ratio, by group and slot, and the step's
    /// statistics of them (each parameter once). Every rank sends,
    /// for each parameter, the sums of its cells in the rank's own slice,
    /// added in order (each f64 as two f32 words, as the gradient norm's;
    /// at stage 0 too, though it holds every slice, so that every stage adds
    /// the same numbers); a parameter's sums are added over its slots in
    /// group order (a tiled linear's tiles are one parameter), each slot's
    /// over the ranks in rank order.
    fn trust_ratios(
        &self,
        cells: &[Vec<NormCell>],
        sums: &[Vec<SquareSums>],
    ) -> Result<(Vec<Vec<f32>>, Option<TrustRatios>), EngineError> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let mut mine = Vec::new();
        for ((g, c), s) in self.groups.iter().zip(cells).zip(sums) {
            let mut own = vec![[0f64; 2]; g.layout.params.len()];
            for (cell, s) in c.iter().zip(s).filter(|(c, _)| c.rank == rank) {
                let [w, u] = s.totals();
                own[cell.slot][0] += w;
                own[cell.slot][1] += u;
            }
            mine.extend(
                own.iter()
                    .flat_map(|&[w, u]| [f64_words(w), f64_words(u)].concat()),
            );
        }
        let n = mine.len();
        let all = self.comm.all_gather(mine, n * world)?;
        let word = |r: usize, k: usize| from_words(all[r * n + k], all[r * n + k + 1]);
        let mut totals: HashMap<&str, [f64; 2]> = HashMap::new();
        let mut k = 0;
        for g in &self.groups {
            for p in &g.layout.params {
                let t = totals.entry(p.name.as_str()).or_default();
                for r in 0..world {
                    t[0] += word(r, k);
                    t[1] += word(r, k + 2);
                }
                k += 4;
            }
        }
        let bounds = self.spec.train.optimizer.trust_bounds();
        // The step's statistics count each parameter once (a tiled
        // linear's tiles share its name and its ratio), in layout order.
        let mut seen = std::collections::HashSet::new();
        let once = self.groups.iter().flat_map(|g| &g.layout.params);
        let trained = once.filter(|p| !p.frozen && seen.insert(p.name.as_str()));
        let summary = TrustRatios::of(trained.map(|p| {
            let [w, u] = totals[p.name.as_str()];
            trust_ratio(w, u, bounds)
        }));
        let ratios = self
            .groups
            .iter()
            .map(|g| {
                g.layout
                    .params
                    .iter()
                    .map(|p| {
                        let [w, u] = totals[p.name.as_str()];
                        trust_ratio(w, u, bounds)
                    })
                    .collect()
            })
            .collect();
        Ok((ratios, summary))
    }

    /// `pass` over every sub-group with state in swap files, pipelined: while
    /// sub-group k is updated, the reads of the next ones and the writes of
    /// the previous ones are in flight, at most `buffer_count` sub-groups'
    /// buffers in all (at least 3: read ahead, update, write back). Swapped
    /// f32 gradients are clipped by `coef` in place as they are read. Only
    /// what the pass changed is written back.
    fn swapped_optimizer_steps(
        &mut self,
        subs: &[SubGroup],
        mut pass: SwappedPass<'_>,
        coef: Option<f32>,
    ) -> Result<(), EngineError> {
        let (rank, stage) = (self.comm.rank(), self.stage);
        let Engine {
            offload,
            groups,
            swap_buffers,
            ..
        } = self;
        let Some(off) = offload.as_ref() else {
            return Ok(());
        };
        let sets = off.optimizer.as_ref().map_or(3, |o| o.buffer_count).max(3);
        // Moments and master (f32), parameters and gradient (at most f32).
        let set_bytes =
            |sub: &SubGroup| -> u64 { sub.pieces.iter().map(|(_, r)| r.len() as u64 * 20).sum() };
        let mut reads = VecDeque::new();
        let mut writes: VecDeque<(u64, Vec<zswap::IoHandle>)> = VecDeque::new();
        let mut next = 0;
        for sub in subs {
            // Read ahead as far as the buffer sets allow.
            while next < subs.len() && reads.len() + writes.len() < sets {
                swap_buffers.add(set_bytes(&subs[next]));
                reads.push_back(
                    off.read_pieces(&subs[next].pieces, |g, r| groups[g].layout.frozen_in(r)),
                );
                next += 1;
            }
            if reads.is_empty() {
                let (bytes, oldest) = writes.pop_front().expect("a set is in flight");
                oldest.into_iter().try_for_each(|w| w.wait().map(drop))?;
                swap_buffers.sub(bytes);
                swap_buffers.add(set_bytes(&subs[next]));
                reads.push_back(
                    off.read_pieces(&subs[next].pieces, |g, r| groups[g].layout.frozen_in(r)),
                );
                next += 1;
            }
            let pieces = reads.pop_front().expect("read above");
            let mut handles = Vec::new();
            for piece in pieces {
                let mut b = piece.wait()?;
                if let (Some(c), Some(g)) = (coef, b.grads.as_mut()) {
                    g.f32s_mut().iter_mut().for_each(|x| *x *= c);
                }
                let swapped = Swapped {
                    exp_avg: b.exp_avg.as_mut().map(|x| x.f32s_mut()),
                    exp_avg_sq: b.exp_avg_sq.as_mut().map(|x| x.f32s_mut()),
                    master: b.master.as_mut().map(|x| x.f32s_mut()),
                    params: b.params.as_mut().map(|x| x.bytes_mut()),
                    grads: b.grads.as_ref().map(|x| x.bytes()),
                };
                let (g, range) = (b.group, b.range.clone());
                match &mut pass {
                    SwappedPass::Adam(hp) => groups[g].adam(range, rank, stage, hp, swapped),
                    SwappedPass::LambMoments(hp, cells, sums) => {
                        let cells = (cells[g].as_slice(), sums[g].as_mut_slice());
                        groups[g].lamb_moments(range, rank, stage, hp, cells, swapped);
                        // The parameters are as they were read.
                        (b.params, b.master) = (None, None);
                    }
                    SwappedPass::LambApply(hp, ratios) => {
                        groups[g].lamb_apply(range, rank, stage, hp, &ratios[g], swapped);
                        // The moments are as they were read.
                        (b.exp_avg, b.exp_avg_sq) = (None, None);
                    }
                }
                handles.extend(off.write_piece(b));
            }
            writes.push_back((set_bytes(sub), handles));
        }
        for (bytes, set) in writes {
            set.into_iter().try_for_each(|w| w.wait().map(drop))?;
            swap_buffers.sub(bytes);
        }
        Ok(())
    }

    /// Shares the updated slices where ranks hold whole parameters but update
    /// only their slice (stages 1-2, and whole groups at stage 3), and drops
    /// the cached parameter tensors.
    fn share_updated_params(&mut self) -> Result<(), EngineError> {
        let world = self.comm.world_size();
        if self.stage.partitions_optimizer() && world > 1 {
            // Each group's buffer is gathered into in place: its own slice is
            // already there, and no fresh buffer is faulted in every step;
            // 16-bit ones as they are, where going through collective words
            // copied every group's parameters out and back each step.
            // A group frozen in part sends only what the update moved:
            // each rank its runs, padded to the longest rank's.
            let rank = self.comm.rank();
            let mut works = Vec::new();
            for (i, g) in self.groups.iter_mut().enumerate() {
                // A group frozen whole is as every rank already holds it.
                if g.partitioned || g.layout.all_frozen() {
                    continue;
                }
                if !g.layout.any_frozen() {
                    let buf = std::mem::replace(&mut g.params, Flat::zeros(self.half, 0));
                    works.push((
                        i,
                        Sharing::Whole(Gathering::in_place(self.comm.as_ref(), buf)),
                    ));
                    continue;
                }
                let runs = Bucket::trained_of(&g.layout);
                let mut mine = Vec::with_capacity(runs.len / world);
                runs.pack_chunk(rank, &[&g.params], false, &mut mine);
                let work = self.comm.all_gather_async(mine, runs.len);
                works.push((i, Sharing::Runs(runs, work)));
            }
            for (i, w) in works {
                match w {
                    Sharing::Whole(gathering) => {
                        self.groups[i].params = gathering.wait(self.half)?
                    }
                    Sharing::Runs(runs, work) => {
                        let params = std::slice::from_mut(&mut self.groups[i].params);
                        runs.unpack(&work.wait()?, params);
                    }
                }
            }
        }
        self.params_changed();
        Ok(())
    }

    /// The step's statistics; resets the per-step accounting.
    pub(crate) fn finish_step(
        &mut self,
        step: u64,
        lr: f64,
        grad_norm: f64,
        loss_scale: Option<f64>,
        skipped: bool,
    ) -> StepStats {
        let counters = self.counters();
        let comm = counters.since(&self.counters_at_start.take().unwrap_or(counters));
        let bytes = |f: &dyn Fn(&Group) -> u64| self.groups.iter().map(f).sum::<u64>();
        let mem = MemoryUse {
            params: bytes(&|g| g.params.bytes()),
            grads: bytes(&|g| g.grads.bytes() - g.grads_unmapped() as u64),
            master: bytes(&|g| g.master.as_ref().map_or(0, |m| (m.len() * 4) as u64)),
            optimizer: bytes(&|g| {
                ((g.exp_avg.len() + g.exp_avg_sq.len() - g.moments_released) * 4) as u64
            }),
            activations: self.peak_activations,
            comm_buffers: self.comm_buffers.peak,
            secondary: self.secondary_peak,
            offload_buffers: self.swap_buffers.peak,
            nvme: self.offload.as_ref().map_or(0, |o| o.nvme_bytes),
            peak_rss: peak_rss_bytes(),
        };
        let io = self.offload.as_ref().map(|o| {
            let now = o.stats();
            now.since(&self.io_at_start.take().unwrap_or(now))
        });
        let accum = self.spec.train.grad_accum as f64;
        let ran: Vec<f64> = (self.block_runs.iter_mut())
            .map(|r| std::mem::take(r) as f64 / accum)
            .collect();
        let stats = StepStats {
            step,
            loss: self.loss_sum / self.spec.train.grad_accum as f64,
            lr,
            grad_norm,
            loss_scale,
            skipped,
            tokens: self.tokens,
            mem,
            comm,
            io,
            times: std::mem::take(&mut self.times),
            stop: self.stop_agreed.swap(false, Ordering::SeqCst),
            trust_ratio: self.trust_ratio.take(),
            comms: self.spec.comms_logger.as_ref().map(|c| self.op_log(c)),
            layer_drop: (self.spec.train.progressive_layer_drop.as_ref()).map(|pld| {
                LayerDropStats {
                    // This step's: the statistics are made before `step`
                    // moves on.
                    theta: pld.theta_at(self.step),
                    blocks_run: ran.iter().sum(),
                    ran,
                }
            }),
        };
        self.step = step;
        self.micro = 0;
        self.loss_sum = 0.0;
        self.tokens = 0;
        self.comm_buffers = Transient::default();
        self.secondary_peak = 0;
        self.swap_buffers = Transient::default();
        self.peak_activations = 0;
        stats
    }
}

/// A group's updated parameters going round after the step.
enum Sharing {
    /// The whole buffer, gathered in place.
    Whole(Gathering),
    /// Each rank's runs that train, packed as a bucket of the group alone
    /// ([`Bucket::trained_of`]).
    Runs(Bucket, zcomm::Work<Vec<f32>>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_groups_cover_every_region_once_in_order() {
        let regions = [0..10, 4..4, 3..8, 0..7];
        for max in [1, 3, 5, 7, 100] {
            let subs = plan_sub_groups(&regions, max, 1);
            let mut flat = Vec::new();
            for s in &subs {
                let len: usize = s.pieces.iter().map(|(_, r)| r.len()).sum();
                assert!(len <= max && len > 0, "max {max}: sub-group of {len}");
                for (g, r) in &s.pieces {
                    flat.extend(r.clone().map(|i| (*g, i)));
                }
            }
            let want: Vec<(usize, usize)> = regions
                .iter()
                .enumerate()
                .flat_map(|(g, r)| r.clone().map(move |i| (g, i)))
                .collect();
            assert_eq!(flat, want, "max {max}");
            assert_eq!(subs.len(), want.len().div_ceil(max), "max {max}");
        }
        assert_eq!(plan_sub_groups(&regions, usize::MAX, 1).len(), 1);
    }

    #[test]
    fn aligned_sub_groups_start_pieces_on_whole_units() {
        let regions = [100..1100, 0..0, 50..3000, 0..4096];
        for (max, align) in [(1000, 64), (64, 64), (100, 64), (5000, 2048), (1, 8)] {
            let subs = plan_sub_groups(&regions, max, align);
            let mut covered = vec![Vec::new(); regions.len()];
            for s in &subs {
                let len: usize = s.pieces.iter().map(|(_, r)| r.len()).sum();
                assert!(len <= max.max(align), "max {max}: {len}");
                for (g, r) in &s.pieces {
                    assert_eq!(
                        (r.start - regions[*g].start) % align,
                        0,
                        "{max}/{align}: {r:?}"
                    );
                    assert!(
                        r.end == regions[*g].end || (r.end - regions[*g].start) % align == 0,
                        "{max}/{align}: {r:?} ends inside a unit"
                    );
                    covered[*g].extend(r.clone());
                }
            }
            for (g, r) in regions.iter().enumerate() {
                assert_eq!(covered[g], r.clone().collect::<Vec<_>>(), "{max}/{align}");
            }
        }
    }
}
