//! The gradient reduction pipeline: buckets leave as soon as backward is done
//! with their groups, and are put away where the stage keeps gradients.
//!
//! Backward calls [`Engine::group_done`] after each group. When the last group
//! of a bucket is done, the bucket is packed rank-major (see [`crate::flat`]) and
//! handed to the communicator: an all-reduce where every rank updates
//! everything (stage 0), else a reduce-scatter that hands each rank the sum of
//! the slices it owns (with ZeRO++ qgZ, zcomm's two-hop quantized one, and
//! under `zero.loco` each bucket's kept quantization errors with it; with
//! `train.reduce_dtype: bf16 | f16`, the same two hops in 16 bits, and at stage
//! 0 the owners' 16-bit sums gathered after them). With `overlap_comm` backward carries on while the
//! reduction runs; finished reductions are put away at the next group and the
//! rest when the step waits for them. At most [`REDUCE_BUCKETS_HELD`]
//! buckets are held at once, as DeepSpeed's two IPG buffers: where the
//! reductions lag behind backward (a slower rank, a loaded machine)
//! backward waits for the oldest before it packs the next, rather than
//! piling up the whole gradient in flight.

use std::collections::VecDeque;
use std::ops::Range;

use std::sync::{Arc, Mutex};

use zcomm::{ErrorFeedback, Quantization, SharedFeedback, Work};
use zconfig::estimate::REDUCE_BUCKETS_HELD;

use crate::engine::Engine;
use crate::error::EngineError;
use crate::flat::{Bucket, GroupLayout};
use crate::group::own_grads_sum_sq;
use crate::precision::{Flat, Half};

/// A reduction in flight.
struct PendingBucket {
    bucket: usize,
    work: Work<Vec<f32>>,
    bytes: u64,
}

/// Gradient buckets and the reductions in flight, oldest first.
pub(crate) struct Reducer {
    buckets: Vec<Bucket>,
    pending: VecDeque<PendingBucket>,
    overlap: bool,
    /// ZeRO++ qgZ: reduce-scatters quantized on the wire.
    pub(crate) quantized: Option<Quantization>,
    /// LoCo: each bucket's kept quantization errors (empty without LoCo).
    pub(crate) feedback: Vec<SharedFeedback>,
    /// `train.reduce_dtype`: reductions in 16 bits on the wire.
    half: Option<Half>,
    /// Buffers that finished reductions gave back, packed into again. A
    /// bucket is one fresh allocation otherwise, and one of more than 32 MiB
    /// (gpt-anchor's whole gradient, 44 MB, in the default bucket of 5e7)
    /// is mapped anew by glibc wherever its heap has no free block that
    /// large when backward ends, its pages faulted in and zeroed by the
    /// kernel every step: bf16 at stages 0-2, 10.6k faults a worker a step,
    /// 5.8% of the step's time in `clear_page`.
    spare: Vec<Vec<f32>>,
    /// Whether to keep them: not at stage 3, whose peak is the forward's
    /// (a kept bucket raised gpt-anchor's bf16 peak RSS 425 → 466 MiB), and
    /// whose gathers leave the heap a free block for the bucket anyway (no
    /// faults a step without keeping). At stages 0-2 the peak RSS did not
    /// move.
    pool: bool,
}

impl Reducer {
    /// Buckets of at most `bucket_size` elements over groups laid out as
    /// `layouts`, which backward completes in the order `backward`; `overlap`
    /// lets reductions run while backward continues; `quantized` (qgZ) or
    /// `half` narrows what crosses the wire, `loco` (err_beta, reset_T)
    /// gives qgZ's buckets error feedback; `pool` keeps finished buckets'
    /// buffers for the next ones.
    pub(crate) fn new(
        layouts: &[GroupLayout],
        backward: &[usize],
        bucket_size: usize,
        overlap: bool,
        (quantized, loco): (Option<Quantization>, Option<(f32, u64)>),
        half: Option<Half>,
        pool: bool,
    ) -> Reducer {
        // (qgZ's blocks stay those of the whole buffers.)
        let buckets = Bucket::plan(layouts, backward, bucket_size, quantized.is_none());
        let feedback = match (quantized, loco) {
            (Some(_), Some((beta, reset))) => (0..buckets.len())
                .map(|_| Arc::new(Mutex::new(ErrorFeedback::new(beta, reset))))
                .collect(),
            _ => Vec::new(),
        };
        Reducer {
            buckets,
            pending: VecDeque::new(),
            overlap,
            quantized,
            feedback,
            half,
            spare: Vec::new(),
            pool,
        }
    }

    /// Whether buckets leave frozen parameters out (all but qgZ's, whose
    /// blocks stay those of the whole buffers); a staged micro-batch
    /// gradient then holds only what trains.
    pub(crate) fn leaves_frozen_out(&self) -> bool {
        self.quantized.is_none()
    }

    /// A buffer for a bucket of `len` elements: a spare one that holds them,
    /// else a new one.
    fn buffer(&mut self, len: usize) -> Vec<f32> {
        match self.spare.iter().position(|v| v.capacity() >= len) {
            Some(i) => self.spare.swap_remove(i),
            None => Vec::with_capacity(len),
        }
    }

    /// Keeps a finished reduction's buffer for a later bucket (one that can
    /// hold some bucket; no more than [`REDUCE_BUCKETS_HELD`], the most
    /// buckets held at once), where the stage keeps them at all.
    fn keep(&mut self, buffer: Vec<f32>) {
        let smallest = self.buckets.iter().map(|b| b.len).min().unwrap_or(0);
        let most = REDUCE_BUCKETS_HELD.min(self.buckets.len());
        if self.pool && self.spare.len() < most && buffer.capacity() >= smallest {
            self.spare.push(buffer);
        }
    }

    /// After a step's overflow check: LoCo's errors are forgotten where the
    /// step overflowed (they came from gradients thrown away) and follow the
    /// loss scale where it changed by `factor` (DeepSpeed's
    /// `_loco_err_buf_update`).
    pub(crate) fn follow_loss_scale(&self, overflow: bool, factor: f64) {
        for f in &self.feedback {
            let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
            if overflow {
                f.reset();
            } else if factor != 1.0 {
                f.rescale(factor as f32);
            }
        }
    }

    /// The bucket that group `g` closes, if it is the last of one.
    fn closed_by(&self, g: usize) -> Option<usize> {
        self.buckets
            .iter()
            .position(|b| b.groups.last() == Some(&g))
    }
}

impl Engine {
    /// Backward is done with group `g` for this micro-batch: launch the reduction
    /// of its bucket if every group of the bucket is done.
    pub(crate) fn group_done(&mut self, g: usize) -> Result<(), EngineError> {
        self.finish_completed()?;
        let Some(bi) = self.reducer.closed_by(g) else {
            return Ok(()); // more groups of this bucket are still to come
        };
        let world = self.comm.world_size();
        if world == 1 {
            // Nothing to reduce: a staged gradient is already the rank's own.
            if self.stage.partitions_gradients() {
                let leave_frozen_out = self.reducer.leaves_frozen_out();
                for h in self.reducer.buckets[bi].groups.clone() {
                    let staged = self.take_staged(h)?;
                    // Read in place where f32 (a copy of the group's
                    // gradient had doubled it at the end of backward).
                    let s = match &staged {
                        Flat::F32(v) => std::borrow::Cow::Borrowed(v.as_slice()),
                        half => std::borrow::Cow::Owned(half.to_f32(0..half.len())),
                    };
                    let layout = &self.groups[h].layout;
                    let runs = self.groups[h].trained_grads(0..layout.padded);
                    let runs: Vec<(usize, &[f32])> = (runs.into_iter())
                        .map(|r| {
                            let at = layout.carried_before(r.start, leave_frozen_out);
                            (r.start, &s[at..at + r.len()])
                        })
                        .collect();
                    self.add_own_grads(h, &runs)?;
                }
            }
            return Ok(());
        }
        // Hold at most REDUCE_BUCKETS_HELD buckets: this one is packed
        // once the oldest reductions beyond that are put away.
        while self.reducer.pending.len() >= REDUCE_BUCKETS_HELD {
            let oldest = self
                .reducer
                .pending
                .pop_front()
                .expect("a bucket in flight");
            self.finish_bucket(oldest)?;
        }
        let packed = self.pack_bucket(bi)?;
        let bytes = (packed.len() * 4) as u64;
        self.comm_buffers.add(bytes);
        let work = if let Some(q) = self.reducer.quantized {
            let feedback = self.reducer.feedback.get(bi).cloned();
            self.comm
                .quantized_reduce_scatter_async(packed, q, feedback)
        } else if let Some(half) = self.reducer.half {
            if self.stage.partitions_optimizer() {
                self.comm.half_reduce_scatter_async(packed, half)
            } else {
                self.comm.half_all_reduce_async(packed, half)
            }
        } else if self.stage.partitions_optimizer() {
            self.comm.reduce_scatter_async(packed)
        } else {
            self.comm.all_reduce_async(packed)
        };
        let pending = PendingBucket {
            bucket: bi,
            work,
            bytes,
        };
        if self.reducer.overlap {
            self.reducer.pending.push_back(pending);
        } else {
            self.finish_bucket(pending)?;
        }
        Ok(())
    }

    /// Waits for every reduction still in flight and puts it away.
    pub(crate) fn wait_for_reductions(&mut self) -> Result<(), EngineError> {
        while let Some(p) = self.reducer.pending.pop_front() {
            self.finish_bucket(p)?;
        }
        Ok(())
    }

    /// Takes group `h`'s staged micro-batch gradient (partitioned gradients).
    fn take_staged(&mut self, h: usize) -> Result<Flat, EngineError> {
        let s = self.groups[h]
            .staging
            .take()
            .ok_or_else(|| EngineError::MissingGradient {
                param: format!("{} (staged)", self.groups[h].layout.name),
            })?;
        self.comm_buffers.sub(s.bytes());
        Ok(s)
    }

    /// Bucket `bi`'s gradients, packed rank-major: the full gradient buffers, or
    /// the staged micro-batch gradients where the stage partitions gradients.
    fn pack_bucket(&mut self, bi: usize) -> Result<Vec<f32>, EngineError> {
        let out = self.reducer.buffer(self.reducer.buckets[bi].len);
        if !self.stage.partitions_gradients() {
            for h in self.reducer.buckets[bi].groups.clone() {
                self.groups[h].settled_grads();
            }
            let views: Vec<&Flat> = self.groups.iter().map(|x| &x.grads).collect();
            return Ok(self.reducer.buckets[bi].pack(&views, false, out));
        }
        let mut staged: Vec<Flat> = vec![Flat::zeros(self.grads_half, 0); self.groups.len()];
        for h in self.reducer.buckets[bi].groups.clone() {
            staged[h] = self.take_staged(h)?;
        }
        let views: Vec<&Flat> = staged.iter().collect();
        Ok(self.reducer.buckets[bi].pack(&views, true, out))
    }

    /// Puts away buckets that have finished, oldest first, so their buffers stop
    /// counting as held (the communicator has already freed them).
    fn finish_completed(&mut self) -> Result<(), EngineError> {
        while let Some(p) = self.reducer.pending.pop_front() {
            match p.work.try_wait() {
                Ok(result) => self.put_reduced(p.bucket, p.bytes, result?)?,
                Err(work) => {
                    self.reducer.pending.push_front(PendingBucket { work, ..p });
                    break;
                }
            }
        }
        Ok(())
    }

    /// Waits for a bucket and puts its result away.
    fn finish_bucket(&mut self, p: PendingBucket) -> Result<(), EngineError> {
        let reduced = p.work.wait()?;
        self.put_reduced(p.bucket, p.bytes, reduced)
    }

    /// Puts a reduced bucket where the stage keeps gradients: the whole
    /// all-reduced bucket into full buffers (stage 0), the own slices into full
    /// buffers (stage 1), or added to the own slices (partitioned gradients).
    fn put_reduced(
        &mut self,
        bucket: usize,
        bytes: u64,
        reduced: Vec<f32>,
    ) -> Result<(), EngineError> {
        self.comm_buffers.sub(bytes);
        let rank = self.comm.rank();
        let layouts: Vec<GroupLayout> = self.groups.iter().map(|x| x.layout.clone()).collect();
        let bucket = &self.reducer.buckets[bucket];
        if !self.stage.partitions_optimizer() {
            let mut bufs: Vec<Flat> = self
                .groups
                .iter_mut()
                .map(|g| std::mem::replace(&mut g.grads, Flat::F32(Vec::new())))
                .collect();
            bucket.unpack(&reduced, &mut bufs);
            for (g, b) in self.groups.iter_mut().zip(bufs) {
                g.grads = b;
            }
        } else if !self.stage.partitions_gradients() {
            for (g, part, offset) in bucket.own_parts(rank, &layouts) {
                let own = layouts[g].slice(rank);
                self.groups[g]
                    .grads
                    .set_f32(own.start + offset, &reduced[part]);
            }
        } else {
            let parts = bucket.own_parts(rank, &layouts);
            // Every group of the bucket, one add each (an offloaded slice
            // counts its adds), with its runs: none where all of this
            // rank's slice of it is frozen.
            for g in bucket.groups.clone() {
                let runs: Vec<(usize, &[f32])> = (parts.iter())
                    .filter(|(h, _, _)| *h == g)
                    .map(|(_, part, offset)| (*offset, &reduced[part.clone()]))
                    .collect();
                self.add_own_grads(g, &runs)?;
            }
        }
        self.reducer.keep(reduced);
        Ok(())
    }

    /// Adds one micro-batch's reduced gradient slice of group `g` to the
    /// rank's accumulated slice, in memory or in its swap file: `runs` of
    /// it, each (offset in the slice, values), the rest (frozen) left as
    /// it is. Swapped, the last micro-batch's add also averages an f32
    /// slice in place and takes its squared norm, as [`Engine::step`] does
    /// in memory.
    fn add_own_grads(&mut self, g: usize, runs: &[(usize, &[f32])]) -> Result<(), EngineError> {
        let half = self.grads_half;
        let accum = self.spec.train.grad_accum;
        let (scale, rank) = (self.average_scale(), self.comm.rank());
        let Engine {
            offload,
            groups,
            swap_buffers,
            ..
        } = self;
        let Some(off) = offload.as_mut().filter(|o| o.grad_adds(g).is_some()) else {
            for (at, values) in runs {
                groups[g].grads.add_f32(*at, values);
            }
            return Ok(());
        };
        let mut grads = off.take_grads(g, half, swap_buffers)?;
        for (at, values) in runs {
            grads.add_f32(*at, values);
        }
        let complete = off.grad_adds(g) == Some(accum - 1);
        let own = groups[g].layout.slice(rank);
        let sum_sq =
            complete.then(|| average_and_sum_sq(&groups[g].layout, &mut grads, own, scale));
        off.put_grads(g, &grads, sum_sq, swap_buffers)
    }
}

/// Averages a group's complete f32 gradient slice `own` (flat indices, all
/// of `grads`) in place and returns its squared norm, as the in-memory step
/// does (16-bit gradients are scaled as read; frozen parameters left out).
pub(crate) fn average_and_sum_sq(
    layout: &GroupLayout,
    grads: &mut Flat,
    own: Range<usize>,
    scale: f32,
) -> f64 {
    let at = own.start;
    match grads {
        Flat::F32(v) => {
            v.iter_mut().for_each(|x| *x *= scale);
            own_grads_sum_sq(layout, grads, own, at, 1.0)
        }
        Flat::Half(..) => own_grads_sum_sq(layout, grads, own, at, scale),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zmodel::{GroupSpec, Init, ParamSpec};

    fn layouts(sizes: &[usize]) -> Vec<GroupLayout> {
        sizes
            .iter()
            .map(|&n| {
                let spec = GroupSpec {
                    name: "g".into(),
                    params: vec![ParamSpec {
                        name: "p".into(),
                        shape: vec![n],
                        init: Init::Zeros,
                        decay: true,
                        tile: None,
                        product_operand: false,
                    }],
                };
                GroupLayout::new(&spec, 2)
            })
            .collect()
    }

    #[test]
    fn a_finished_buckets_buffer_is_packed_into_again_where_the_stage_keeps_them() {
        // Two buckets: groups 2 and 1 (1000 + 600 elements and padding),
        // then group 0 (300).
        let l = layouts(&[300, 600, 1000]);
        let mut kept = Reducer::new(&l, &[2, 1, 0], 1500, true, (None, None), None, true);
        let lens: Vec<usize> = kept.buckets.iter().map(|b| b.len).collect();
        assert!(
            lens.len() == 2 && lens[0] >= 1600 && lens[1] < 400,
            "{lens:?}"
        );
        let first = kept.buffer(lens[0]);
        assert!(first.capacity() >= lens[0]);
        let at = first.as_ptr();
        // A reduce-scatter hands back its own chunk at the front, truncated.
        let mut reduced = first;
        reduced.extend(std::iter::repeat_n(1.0, lens[0]));
        reduced.truncate(lens[0] / 2);
        kept.keep(reduced);
        let again = kept.buffer(lens[0]);
        assert_eq!(again.as_ptr(), at, "the same allocation, not a fresh one");
        // Nothing spare is left: the next bucket gets a new buffer.
        assert!(kept.spare.is_empty());
        // A buffer too small for any bucket is not kept.
        kept.keep(Vec::with_capacity(10));
        assert!(kept.spare.is_empty());

        let mut dropped = Reducer::new(&l, &[2, 1, 0], 1500, true, (None, None), None, false);
        dropped.keep(again);
        assert!(dropped.spare.is_empty(), "stage 3 keeps none");
    }
}
