//! One block's flat buffers on one rank, and what the stage keeps of them.
//!
//! Every buffer is indexed by the group's flat element index; a buffer that holds
//! only the rank's own slice is offset by the slice's start. [`Group`] is the
//! one place that knows which buffers are whole and which are slices, so the
//! step and the reduction ask it for ranges instead of comparing stage numbers.

use std::ops::Range;

use zconfig::spec::OptimizerKind;
use zconfig::ZeroStage;

use crate::adam::{adamw_runs, lamb_apply, lamb_moments, AdamStep, Buffers, Grads, SquareSums};
use crate::flat::{GroupLayout, NormCell};
use crate::precision::{release_zero_pages, resident_zeros_in, Flat, Half};

/// One block's flat buffers on this rank.
pub(crate) struct Group {
    pub(crate) layout: GroupLayout,
    /// Stage 3 and above the persistence threshold: only the own slice is held.
    pub(crate) partitioned: bool,
    /// Working parameters (f32, or 16-bit under mixed precision): full (padded)
    /// or, if partitioned, the own slice.
    pub(crate) params: Flat,
    /// Mixed precision: the f32 master copy of the region this rank updates.
    pub(crate) master: Option<Vec<f32>>,
    /// In the working precision: full, or the own slice where the stage
    /// partitions gradients.
    pub(crate) grads: Flat,
    /// The flat index of `grads`' first element: 0 for a full buffer, the
    /// own slice's start for a slice.
    grads_at: usize,
    /// Partitioned gradients: this micro-batch's full gradient until its bucket
    /// leaves.
    pub(crate) staging: Option<Flat>,
    /// `grads` still holds the last step's gradients, which count as zero:
    /// the next micro-batch's first gradients are written over them
    /// ([`Flat::set_parts`]) rather than added, and anything else that
    /// reads or writes `grads` first zeroes it ([`Group::settled_grads`]).
    /// The step leaves a full in-memory buffer this way instead of zeroing
    /// it (a pass of its own, and the first micro-batch's adds read the
    /// zeros back).
    pub(crate) zero_owed: bool,
    /// The optimizer's moments of the region this rank updates; the second
    /// is empty under Lion, which keeps none.
    pub(crate) exp_avg: Vec<f32>,
    pub(crate) exp_avg_sq: Vec<f32>,
    /// Elements of the moments whose pages went back to the kernel
    /// ([`Group::release_frozen_moments`]).
    pub(crate) moments_released: usize,
}

impl Group {
    /// A group holding `full` (padded, f32) parameters as `stage` keeps them on
    /// `rank`, with zero gradients and moments (the second only where the
    /// optimizer's rule keeps one).
    pub(crate) fn new(
        layout: GroupLayout,
        full: Vec<f32>,
        stage: ZeroStage,
        partitioned: bool,
        rank: usize,
        (half, grads_half): (Option<Half>, Option<Half>),
        rule: OptimizerKind,
    ) -> Group {
        let n = layout.slice_len();
        let (grads, grads_at) = if stage.partitions_gradients() {
            (n, layout.slice(rank).start)
        } else {
            (layout.padded, 0)
        };
        let moments = if stage.partitions_optimizer() {
            n
        } else {
            layout.padded
        };
        // A group `train.freeze` froze whole gets no gradient and no update:
        // it holds neither buffer ([`Group::checkpoint_moments`]).
        let (grads, moments) = match layout.all_frozen() {
            true => (0, 0),
            false => (grads, moments),
        };
        let mut group = Group {
            partitioned,
            params: Flat::zeros(half, 0),
            master: None,
            grads: Flat::zeros(grads_half, 0),
            grads_at,
            staging: None,
            // A full buffer starts as one whose zero is owed: its first
            // micro-batch writes over it as every later step's does.
            zero_owed: !stage.partitions_gradients() && grads > 0,
            exp_avg: Vec::new(),
            exp_avg_sq: Vec::new(),
            moments_released: 0,
            layout,
        };
        // Zeros stored where training writes them, and only there: the
        // pages of frozen parameters are never made resident (a large
        // frozen embedding's gradient and moments, three times its size,
        // had been, only to be given back below: a worker's start peaked
        // there).
        let trained = group.grads_runs(0..grads, true);
        group.grads = Flat::zeros_in(grads_half, grads, &trained);
        let region = group.updated_region(rank, stage);
        let trained: Vec<Range<usize>> = (group.layout.runs_in(region.clone(), true).into_iter())
            .map(|r| r.start - region.start..r.end - region.start)
            .collect();
        let second = if rule.second_moment() { moments } else { 0 };
        group.exp_avg = resident_zeros_in(moments, &trained);
        group.exp_avg_sq = resident_zeros_in(second, &trained);
        group.install(full, rank, stage, half);
        group.release_frozen_moments(rank, stage);
        group.release_frozen_grads();
        group
    }

    /// Gives back to the kernel every page of the moments that lies wholly
    /// inside a frozen parameter of a partly frozen group and holds only
    /// zeros (`madvise(MADV_DONTNEED)`: the pages read as zeros again and
    /// take no memory until written, and nothing writes them, since every
    /// rule leaves frozen parameters out). PyTorch's optimizers keep no
    /// state for a parameter that gets no gradient; this keeps the flat
    /// layout and drops the memory. Moments that a checkpoint brought
    /// (frozen after training) are not zeros and stay.
    pub(crate) fn release_frozen_moments(&mut self, rank: usize, stage: ZeroStage) {
        if !self.layout.any_frozen() || self.exp_avg.is_empty() {
            return;
        }
        let region = self.updated_region(rank, stage);
        let frozen: Vec<Range<usize>> = (self.layout.update_runs(region.clone()).into_iter())
            .filter(|(_, decay)| decay.is_none())
            .map(|(r, _)| r.start - region.start..r.end - region.start)
            .collect();
        self.moments_released = [&mut self.exp_avg, &mut self.exp_avg_sq]
            .into_iter()
            .filter(|m| !m.is_empty())
            .flat_map(|m| {
                let frozen = &frozen;
                frozen.iter().map(move |r| {
                    release_zero_pages(bytemuck::cast_slice_mut(&mut m[r.clone()])) / 4
                })
            })
            .sum();
    }

    /// Gives back the pages of the gradient buffer, full (stages 0-1) or
    /// the own slice (stages 2-3), that lie wholly inside frozen
    /// parameters, as PyTorch holds no `.grad` for a parameter that needs
    /// none: zeros that stay so, since every writer of `grads` writes only
    /// [`Group::trained_grads`] (backward adds no frozen gradient, the
    /// reductions carry none, zeroing and scaling leave them out).
    pub(crate) fn release_frozen_grads(&mut self) {
        for r in self.grads_runs(0..self.grads.len(), false) {
            self.grads.release_zero_pages(r);
        }
    }

    /// Bytes of `grads` the kernel holds no pages for now: the frozen runs'
    /// pages that [`Group::release_frozen_grads`] gave back and nothing
    /// wrote since (measured, so a writer that touched them shows).
    pub(crate) fn grads_unmapped(&self) -> usize {
        (self.grads_runs(0..self.grads.len(), false).into_iter())
            .map(|r| self.grads.unmapped_bytes(r))
            .sum()
    }

    /// The parts of `r` (indices into `grads`) that a gradient can change:
    /// the runs of parameters that train.
    pub(crate) fn trained_grads(&self, r: Range<usize>) -> Vec<Range<usize>> {
        self.grads_runs(r, true)
    }

    /// The runs of `r` (indices into `grads`) whose parameters train
    /// (`trained`) or are frozen, as indices into `grads`.
    fn grads_runs(&self, r: Range<usize>, trained: bool) -> Vec<Range<usize>> {
        if !self.layout.any_frozen() {
            return if trained { vec![r] } else { Vec::new() };
        }
        let at = self.grads_at;
        (self
            .layout
            .runs_in(r.start + at..r.end + at, trained)
            .into_iter())
        .map(|run| run.start - at..run.end - at)
        .collect()
    }

    /// `grads`, zeroed first if the zero is owed ([`Group::zero_owed`]).
    pub(crate) fn settled_grads(&mut self) -> &mut Flat {
        if std::mem::take(&mut self.zero_owed) {
            let runs = self.trained_grads(0..self.grads.len());
            self.grads.fill_zero_runs(&runs);
        }
        &mut self.grads
    }

    /// Clears `grads` after a step: a full buffer (`full`: the stage keeps
    /// whole gradients, in memory) owes its zero to the next micro-batch's
    /// first write; any other is zeroed now.
    pub(crate) fn clear_grads(&mut self, full: bool) {
        if full && self.grads.len() == self.layout.padded {
            self.zero_owed = true;
        } else {
            let runs = self.trained_grads(0..self.grads.len());
            self.grads.fill_zero_runs(&runs);
        }
    }

    /// The flat range this rank updates: everything at stage 0, else its slice.
    pub(crate) fn updated_region(&self, rank: usize, stage: ZeroStage) -> Range<usize> {
        updated_region(&self.layout, rank, stage)
    }

    /// The gradient elements of the rank's own slice, as indices into `grads`
    /// (the gradient norm adds these, so that every element counts once).
    pub(crate) fn owned_grads(&self, rank: usize, stage: ZeroStage) -> Range<usize> {
        if stage.partitions_gradients() {
            0..self.grads.len()
        } else {
            self.layout.slice(rank)
        }
    }

    /// The squared norm of the rank's own gradient elements
    /// ([`Group::owned_grads`]) scaled by `scale`, frozen parameters' left
    /// out ([`own_grads_sum_sq`]).
    pub(crate) fn owned_grads_sum_sq(&self, rank: usize, stage: ZeroStage, scale: f32) -> f64 {
        let own = self.layout.slice(rank);
        let at = if stage.partitions_gradients() {
            own.start
        } else {
            0
        };
        own_grads_sum_sq(&self.layout, &self.grads, own, at, scale)
    }

    /// The gradient elements the update reads, as indices into `grads`.
    pub(crate) fn used_grads(&self, rank: usize, stage: ZeroStage) -> Range<usize> {
        if stage.partitions_optimizer() {
            self.owned_grads(rank, stage)
        } else {
            0..self.grads.len()
        }
    }

    /// Installs full (padded, f32) parameters: the working copy this rank holds
    /// and, under mixed precision, the master copy of the region it updates.
    ///
    /// `full` itself becomes what the group holds whole (f32 parameters, or
    /// the master copy under mixed precision, where this rank updates the
    /// whole group): a model's buffers are not held twice while it starts
    /// (a large-vocabulary GPT with its embedding frozen peaked at 264 MB
    /// while starting, 213 MB since).
    pub(crate) fn install(
        &mut self,
        full: Vec<f32>,
        rank: usize,
        stage: ZeroStage,
        half: Option<Half>,
    ) {
        let own = self.layout.slice(rank);
        let region = self.updated_region(rank, stage);
        let whole = |x: Vec<f32>, r: std::ops::Range<usize>| match r.len() == x.len() {
            true => x,
            false => x[r].to_vec(),
        };
        match half {
            None => {
                let held = if self.partitioned { own } else { 0..full.len() };
                self.params = Flat::F32(whole(full, held));
                self.master = None;
            }
            Some(_) => {
                let held = if self.partitioned {
                    &full[own]
                } else {
                    &full[..]
                };
                self.params = Flat::from_f32(half, held);
                self.master = Some(whole(full, region));
            }
        }
    }

    /// Installs the moments from full (padded) buffers; `v` is empty where
    /// the rule keeps no second moment.
    pub(crate) fn install_moments(
        &mut self,
        m: Vec<f32>,
        v: Vec<f32>,
        rank: usize,
        stage: ZeroStage,
    ) {
        let region = self.updated_region(rank, stage);
        let own = |x: Vec<f32>| match x.len() == region.len() || x.is_empty() {
            true => x,
            false => x[region.clone()].to_vec(),
        };
        let (m, v) = (own(m), own(v));
        // A whole frozen group keeps moments only where a checkpoint had
        // some (its training before it was frozen), to save them again.
        let none = m.iter().chain(&v).all(|&x| x == 0.0);
        (self.exp_avg, self.exp_avg_sq) = match self.layout.all_frozen() && none {
            true => (Vec::new(), Vec::new()),
            false => (m, v),
        };
        self.moments_released = 0;
        self.release_frozen_moments(rank, stage);
    }

    /// The moments of the region this rank updates as a checkpoint stores
    /// them: those held, or zeros where a whole frozen group holds none
    /// (`second`: whether the rule keeps a second moment).
    pub(crate) fn checkpoint_moments(
        &self,
        rank: usize,
        stage: ZeroStage,
        second: bool,
    ) -> (Vec<f32>, Vec<f32>) {
        if !self.exp_avg.is_empty() || !self.layout.all_frozen() {
            return (self.exp_avg.clone(), self.exp_avg_sq.clone());
        }
        let n = self.updated_region(rank, stage).len();
        (vec![0.0; n], vec![0.0; if second { n } else { 0 }])
    }

    /// The f32 parameters of the region this rank updates (the master copy
    /// under mixed precision).
    pub(crate) fn updated_params(&self, rank: usize, stage: ZeroStage) -> Vec<f32> {
        if let Some(m) = &self.master {
            return m.clone();
        }
        let region = self.updated_region(rank, stage);
        if self.partitioned {
            self.params.to_f32(0..self.params.len())
        } else {
            self.params.to_f32(region)
        }
    }

    /// AdamW over `range` (flat indices inside the region this rank updates),
    /// in the group's precision: reads the gradient and moments, writes the
    /// parameters (the master and the 16-bit working copy under mixed precision).
    /// Buffers in `swapped` (NVMe offload) stand in for the group's own and
    /// start at `range.start`.
    pub(crate) fn adam(
        &mut self,
        range: Range<usize>,
        rank: usize,
        stage: ZeroStage,
        hp: &AdamStep,
        swapped: Swapped<'_>,
    ) {
        let (whole, layout) = self.buffers(range.clone(), rank, stage, swapped);
        // The range cut at its parameters' edges, each decayed or not;
        // frozen ones left as they are.
        let mut rest = whole;
        let mut runs = Vec::new();
        for (r, decay) in layout.update_runs(range) {
            let (run, tail) = rest.split_at(r.len());
            if let Some(decay) = decay {
                runs.push((run, decay));
            }
            rest = tail;
        }
        adamw_runs(runs, hp);
    }

    /// LAMB's first pass over `range` (as [`Group::adam`]'s, and as it
    /// takes `swapped`): the moments updated, and each parameter's squares
    /// added to the sums of the cells they lie in (`cells`, the layout's
    /// [`GroupLayout::norm_cells`], and their sums); padding adds nothing
    /// and is left as it is. A cell cut over several calls adds its parts
    /// in order, as one call would.
    pub(crate) fn lamb_moments(
        &mut self,
        range: Range<usize>,
        rank: usize,
        stage: ZeroStage,
        hp: &AdamStep,
        (cells, sums): (&[NormCell], &mut [SquareSums]),
        swapped: Swapped<'_>,
    ) {
        let (whole, layout) = self.buffers(range.clone(), rank, stage, swapped);
        // The cells that overlap the range, in order.
        let first = cells.partition_point(|c| c.range.end <= range.start);
        let last = cells.partition_point(|c| c.range.start < range.end);
        let mut rest = whole;
        let mut at = range.start;
        let mut segments = Vec::new();
        for (cell, sums) in cells[first..last].iter().zip(&mut sums[first..last]) {
            let (s, e) = (
                cell.range.start.max(range.start),
                cell.range.end.min(range.end),
            );
            // Padding before the cell.
            rest = rest.split_at(s - at).1;
            let (seg, tail) = rest.split_at(e - s);
            let p = &layout.params[cell.slot];
            if !p.frozen {
                segments.push((seg, p.decay, s, sums));
            }
            (rest, at) = (tail, e);
        }
        lamb_moments(segments, hp);
    }

    /// LAMB's second pass over `range`: each parameter moved by its trust
    /// ratio (`ratios`, by slot) times its update.
    pub(crate) fn lamb_apply(
        &mut self,
        range: Range<usize>,
        rank: usize,
        stage: ZeroStage,
        hp: &AdamStep,
        ratios: &[f32],
        swapped: Swapped<'_>,
    ) {
        let (whole, layout) = self.buffers(range.clone(), rank, stage, swapped);
        let mut rest = whole;
        let mut runs = Vec::new();
        for (r, slot) in layout.slot_runs(range) {
            let (run, tail) = rest.split_at(r.len());
            rest = tail;
            if let Some(i) = slot.filter(|&i| !layout.params[i].frozen) {
                runs.push((run, (layout.params[i].decay, ratios[i])));
            }
        }
        lamb_apply(runs, hp);
    }

    /// The buffers of `range` ([`Group::adam`]'s), and the group's layout.
    fn buffers<'a>(
        &'a mut self,
        range: Range<usize>,
        rank: usize,
        stage: ZeroStage,
        swapped: Swapped<'a>,
    ) -> (Buffers<'a>, &'a GroupLayout) {
        let own = self.layout.slice(rank);
        // Where flat index 0 of each buffer sits: a buffer of the own slice
        // starts at the slice, a swapped piece at the range.
        let at = |sliced: bool| if sliced { own.start } else { 0 };
        let p_off = if swapped.params.is_some() {
            range.start
        } else {
            at(self.partitioned)
        };
        let g_off = if swapped.grads.is_some() {
            range.start
        } else {
            at(stage.partitions_gradients())
        };
        let m_off = if swapped.exp_avg.is_some() {
            range.start
        } else {
            at(stage.partitions_optimizer())
        };
        let Group {
            layout,
            params,
            master,
            grads,
            exp_avg,
            exp_avg_sq,
            ..
        } = self;
        let m_all: &mut [f32] = swapped.exp_avg.unwrap_or(exp_avg);
        let v_all: &mut [f32] = swapped.exp_avg_sq.unwrap_or(exp_avg_sq);
        let master_all: Option<&mut [f32]> = swapped.master.or(master.as_deref_mut());
        let p_all = match (swapped.params, params) {
            (Some(bytes), Flat::F32(_)) => ParamsMut::F32(bytemuck::cast_slice_mut(bytes)),
            (Some(bytes), Flat::Half(h, _)) => ParamsMut::Half(*h, bytemuck::cast_slice_mut(bytes)),
            (None, Flat::F32(p)) => ParamsMut::F32(p),
            (None, Flat::Half(h, w)) => ParamsMut::Half(*h, w),
        };
        let g_all = match (swapped.grads, &*grads) {
            (Some(bytes), Flat::F32(_)) => Grads::F32(bytemuck::cast_slice(bytes)),
            (Some(bytes), Flat::Half(h, _)) => Grads::Half(*h, bytemuck::cast_slice(bytes)),
            (None, Flat::F32(v)) => Grads::F32(v),
            (None, Flat::Half(h, v)) => Grads::Half(*h, v),
        };
        let shift = |off: usize| range.start - off..range.end - off;
        let g = match g_all {
            Grads::F32(v) => Grads::F32(&v[shift(g_off)]),
            Grads::Half(h, v) => Grads::Half(h, &v[shift(g_off)]),
        };
        let m = &mut m_all[shift(m_off)];
        let v: &mut [f32] = match v_all.is_empty() {
            true => &mut [],
            false => &mut v_all[shift(m_off)],
        };
        let whole = match (master_all, p_all) {
            (Some(master), ParamsMut::Half(h, w)) => Buffers {
                p: &mut master[shift(m_off)],
                g,
                m,
                v,
                working: Some((h, &mut w[shift(p_off)])),
            },
            (_, ParamsMut::F32(p)) => Buffers {
                p: &mut p[shift(p_off)],
                g,
                m,
                v,
                working: None,
            },
            (None, ParamsMut::Half(..)) => {
                unreachable!("16-bit parameters always have a master copy")
            }
        };
        (whole, layout)
    }
}

/// Working parameters being updated, wherever they are held.
enum ParamsMut<'a> {
    F32(&'a mut [f32]),
    Half(Half, &'a mut [u16]),
}

/// Buffers of one range read from swap files, each starting at the range's
/// first element; `None` where the group's own buffer is used.
#[derive(Default)]
pub(crate) struct Swapped<'a> {
    pub(crate) exp_avg: Option<&'a mut [f32]>,
    pub(crate) exp_avg_sq: Option<&'a mut [f32]>,
    pub(crate) master: Option<&'a mut [f32]>,
    /// The working parameters' bytes (f32 or 16-bit).
    pub(crate) params: Option<&'a mut [u8]>,
    /// The averaged (and, f32, clipped) gradient's bytes.
    pub(crate) grads: Option<&'a [u8]>,
}

/// The squared norm of the gradient elements `own` (flat indices; `grads`
/// holds flat index `at` at its 0) scaled by `scale`: in one sum, or, where
/// the group has frozen parameters, the sums of the runs the update moves
/// added in order (a frozen parameter has no gradient to PyTorch's clipping
/// either). Runs depend on the layout alone, so every stage adds the same.
pub(crate) fn own_grads_sum_sq(
    layout: &GroupLayout,
    grads: &Flat,
    own: Range<usize>,
    at: usize,
    scale: f32,
) -> f64 {
    if !layout.any_frozen() {
        return grads.sum_sq(own.start - at..own.end - at, scale);
    }
    layout
        .update_runs(own)
        .into_iter()
        .filter(|(_, decay)| decay.is_some())
        .map(|(r, _)| grads.sum_sq(r.start - at..r.end - at, scale))
        .sum()
}

/// The region of the group laid out as `layout` that `rank` updates at
/// `stage`: everything at stage 0, else its slice.
pub(crate) fn updated_region(layout: &GroupLayout, rank: usize, stage: ZeroStage) -> Range<usize> {
    if stage.partitions_optimizer() {
        layout.slice(rank)
    } else {
        0..layout.padded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A group keeps the buffer it is given where it holds it whole (f32
    /// parameters at stage 0; the master copy under bf16) and copies only
    /// a slice (stage 3's own parameters), with the same values either way.
    #[test]
    fn a_group_keeps_its_initial_buffer_where_it_holds_it_whole() {
        let spec = zmodel::GroupSpec {
            name: "g".into(),
            params: vec![zmodel::ParamSpec {
                name: "w".into(),
                shape: vec![64],
                init: zmodel::Init::Zeros,
                decay: true,
                tile: None,
                product_operand: false,
            }],
        };
        let layout = crate::flat::GroupLayout::new(&spec, 2);
        let full: Vec<f32> = (0..layout.padded).map(|i| i as f32 / 8.0).collect();
        let cases = [
            (ZeroStage::Disabled, false, None),
            (ZeroStage::Disabled, false, Some(Half::Bf16)),
            (ZeroStage::Weights, true, None),
        ];
        for (stage, partitioned, half) in cases {
            let given = full.clone();
            let at = given.as_ptr() as usize;
            let group = Group::new(
                layout.clone(),
                given,
                stage,
                partitioned,
                1,
                (half, half),
                OptimizerKind::Adamw,
            );
            let what = format!("{stage:?} {half:?}");
            let (kept, values) = match &group.master {
                Some(m) => (m.as_ptr() as usize, m.clone()),
                None => (
                    group.params.as_bytes().as_ptr() as usize,
                    group.params.to_f32(0..group.params.len()),
                ),
            };
            let own = layout.slice(1);
            match partitioned {
                false => {
                    assert_eq!(kept, at, "{what}: the buffer itself");
                    assert_eq!(values, full, "{what}");
                }
                true => {
                    assert_ne!(kept, at, "{what}: a slice of it");
                    assert_eq!(values, full[own].to_vec(), "{what}");
                }
            }
        }
    }

    /// Pages of `v` the kernel holds in memory (`mincore`), of those wholly
    /// inside it.
    fn resident_pages(v: &[f32]) -> usize {
        let addr = v.as_ptr() as usize;
        let start = addr.next_multiple_of(4096);
        let pages = (addr + v.len() * 4 - start) / 4096;
        let mut flags = vec![0u8; pages];
        // SAFETY: `start` is page-aligned and the pages lie inside `v`.
        let rc = unsafe { libc::mincore(start as *mut _, pages * 4096, flags.as_mut_ptr()) };
        assert_eq!(rc, 0);
        flags.iter().filter(|&&f| f & 1 == 1).count()
    }

    /// The zero pages go back to the kernel and read as zeros; a page with
    /// a value in it (or a negative zero) stays in memory with its bits.
    #[test]
    fn zero_pages_go_back_and_read_as_zeros() {
        if !cfg!(target_os = "linux") {
            eprintln!("zengine: not Linux; releasing pages NOT covered");
            return;
        }
        let mut v: Vec<f32> = resident_zeros_in(64 * 1024, std::slice::from_ref(&(0..64 * 1024)));
        let (kept, negative) = (10 * 1024 + 7, 20 * 1024 + 3);
        v[kept] = 1.5;
        v[negative] = -0.0;
        let before = resident_pages(&v);
        assert!(before >= 63, "{before} pages resident");
        let released = release_zero_pages(bytemuck::cast_slice_mut(&mut v)) / 4;
        // Two pages keep values; the partial pages at the ends stay too.
        assert!(
            released >= (before - 2) * 1024,
            "{released} of {before} pages"
        );
        assert!(
            resident_pages(&v) <= 4,
            "{} still resident",
            resident_pages(&v)
        );
        assert_eq!((v[kept], v[negative].to_bits()), (1.5, (-0.0f32).to_bits()));
        let mut zeros = v
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != kept && i != negative);
        assert!(zeros.all(|(_, x)| x.to_bits() == 0));
    }
}
