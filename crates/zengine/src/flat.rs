//! Flat per-block buffers, their partition over ranks, and gradient buckets.
//!
//! A group's parameters are laid end to end in one f32 buffer, padded to a
//! multiple of `world × ALIGN` elements so that it splits into `world` equal slices
//! that each start on a 64-byte boundary. Rank r owns slice r.
//!
//! A bucket is a run of consecutive groups in backward order, closed once it holds
//! `reduce_bucket_size` elements. Its buffer is laid out rank-major — slice 0 of
//! every group in the bucket, then slice 1 of every group, ... — so that chunk r
//! of the bucket (zcomm's `chunk_range`) is exactly rank r's slices. A
//! reduce-scatter of a bucket therefore hands each rank the gradient of what it
//! owns, and an all-reduce is the same reduce-scatter plus an all-gather.
//! Frozen parameters (`train.freeze`) have no gradient, only zeros, so a
//! bucket leaves them out: chunk r holds rank r's slices less their frozen
//! runs, then zeros up to the longest rank's. Each element stays in its
//! owner's chunk, where zcomm's sums take the same order, so the bits are
//! those of the whole buffers' reduction.

use std::ops::Range;

use zmodel::{ColumnTile, GroupSpec};

use crate::precision::Flat;

/// Elements per slice alignment unit (16 f32 = one 64-byte cache line).
pub const ALIGN: usize = 16;

/// Elements of a cell of LAMB's sums ([`GroupLayout::norm_cells`]).
pub const NORM_CELL: usize = 1 << 16;

/// A run of one parameter's elements inside one rank's slice, whose squares
/// LAMB adds up together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NormCell {
    /// The parameter's slot in its group.
    pub slot: usize,
    /// The rank whose slice holds it.
    pub rank: usize,
    /// Flat indices.
    pub range: Range<usize>,
}

/// Where one parameter sits in its group's flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSlot {
    /// Parameter name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Element range in the flat buffer.
    pub range: Range<usize>,
    /// Whether weight decay applies.
    pub decay: bool,
    /// Whether `train.freeze` keeps it as it is ([`GroupLayout::freeze`]).
    pub frozen: bool,
    /// The columns it holds when it is a tile of parameter `name`.
    pub tile: Option<ColumnTile>,
    /// Read only by products (and the embedding's row gather): `zmodel::ParamSpec::product_operand`.
    pub product_operand: bool,
}

/// The flat layout of one group.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupLayout {
    /// Group name.
    pub name: String,
    /// Parameters in order.
    pub params: Vec<ParamSlot>,
    /// Elements actually used.
    pub numel: usize,
    /// Buffer length including padding; a multiple of `world × ALIGN`.
    pub padded: usize,
    /// Ranks the buffer is split over.
    pub world: usize,
}

impl GroupLayout {
    /// Lays out `spec` for `world` ranks.
    pub fn new(spec: &GroupSpec, world: usize) -> GroupLayout {
        let mut params = Vec::with_capacity(spec.params.len());
        let mut off = 0;
        for p in &spec.params {
            let n = p.numel();
            params.push(ParamSlot {
                name: p.name.clone(),
                shape: p.shape.clone(),
                range: off..off + n,
                decay: p.decay,
                frozen: false,
                tile: p.tile,
                product_operand: p.product_operand,
            });
            off += n;
        }
        let quantum = world * ALIGN;
        let padded = off.div_ceil(quantum) * quantum;
        GroupLayout {
            name: spec.name.clone(),
            params,
            numel: off,
            padded,
            world,
        }
    }

    /// Elements per rank slice.
    pub fn slice_len(&self) -> usize {
        self.padded / self.world
    }

    /// Rank `r`'s slice of the flat buffer.
    pub fn slice(&self, r: usize) -> Range<usize> {
        let n = self.slice_len();
        r * n..(r + 1) * n
    }

    /// Where LAMB adds up its squares: every parameter cut at the ranks'
    /// slices, and each part at every [`NORM_CELL`] elements from its start,
    /// in flat order. A cell's sums depend on the layout alone, so every
    /// stage adds the same cells; cells are the first pass's unit of work
    /// on threads.
    pub fn norm_cells(&self) -> Vec<NormCell> {
        let n = self.slice_len();
        let mut cells = Vec::new();
        for (slot, p) in self.params.iter().enumerate() {
            let mut at = p.range.start;
            while at < p.range.end {
                let rank = at / n;
                let part_end = p.range.end.min((rank + 1) * n);
                let end = part_end.min(at + NORM_CELL);
                cells.push(NormCell {
                    slot,
                    rank,
                    range: at..end,
                });
                at = end;
            }
        }
        cells
    }

    /// The parts of `range` (flat indices) covered by each parameter, with its
    /// slot; padding is reported with `None`.
    pub fn slot_runs(&self, range: Range<usize>) -> Vec<(Range<usize>, Option<usize>)> {
        let mut runs = Vec::new();
        let mut at = range.start;
        for (i, p) in self.params.iter().enumerate() {
            let s = p.range.start.max(at);
            let e = p.range.end.min(range.end);
            if s < e {
                runs.push((s..e, Some(i)));
                at = e;
            }
        }
        if at < range.end {
            runs.push((at..range.end, None));
        }
        runs
    }

    /// Marks the parameters that `patterns` (`train.freeze`) match as
    /// frozen (a tiled linear's tiles by the parameter's name).
    pub fn freeze(&mut self, patterns: &[String]) {
        for p in &mut self.params {
            p.frozen = zconfig::freeze::frozen(patterns, &p.name);
        }
    }

    /// Whether any parameter of the group is frozen.
    pub fn any_frozen(&self) -> bool {
        self.params.iter().any(|p| p.frozen)
    }

    /// Whether every parameter of the group is frozen: it needs no
    /// gradient at all.
    pub fn all_frozen(&self) -> bool {
        self.params.iter().all(|p| p.frozen)
    }

    /// Whether a frozen parameter lies in `range` (flat indices).
    pub fn frozen_in(&self, range: &Range<usize>) -> bool {
        self.params
            .iter()
            .any(|p| p.frozen && p.range.start < range.end && range.start < p.range.end)
    }

    /// Rank `r`'s slice less its frozen parameters' runs (flat indices, in
    /// order, adjacent runs joined; padding kept): the elements of the
    /// slice that a gradient or an update can change.
    pub fn trained_runs(&self, r: usize) -> Vec<Range<usize>> {
        self.runs_in(self.slice(r), true)
    }

    /// Elements before flat index `at` that a bucket carries: all of
    /// them, or with `leave_frozen_out` those that train (padding with
    /// them). A micro-batch's staged gradient holds these alone, each at
    /// this index.
    pub fn carried_before(&self, at: usize, leave_frozen_out: bool) -> usize {
        if !leave_frozen_out {
            return at;
        }
        let frozen: usize = (self.params.iter().filter(|p| p.frozen))
            .map(|p| p.range.end.min(at).saturating_sub(p.range.start))
            .sum();
        at - frozen
    }

    /// The runs of `range` (flat indices) that train (padding with them),
    /// or with `trained` false those frozen; in order, adjacent runs joined.
    pub fn runs_in(&self, range: Range<usize>, trained: bool) -> Vec<Range<usize>> {
        let mut runs: Vec<Range<usize>> = Vec::new();
        for (range, decay) in self.update_runs(range) {
            match runs.last_mut() {
                _ if decay.is_some() != trained => {}
                Some(last) if last.end == range.start => last.end = range.end,
                _ => runs.push(range),
            }
        }
        runs
    }

    /// The parts of `range` (flat indices) the update moves, each
    /// parameter's with its decay flag, in order: frozen parameters left
    /// out, padding reported with `decay = false` (its zeros stay zeros).
    pub fn update_runs(&self, range: Range<usize>) -> Vec<(Range<usize>, Option<bool>)> {
        self.slot_runs(range)
            .into_iter()
            .map(|(r, slot)| match slot.map(|i| &self.params[i]) {
                Some(p) if p.frozen => (r, None),
                p => (r, Some(p.is_some_and(|p| p.decay))),
            })
            .collect()
    }
}

/// Groups whose gradients are reduced together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Group indices, in the order backward completes them.
    pub groups: Vec<usize>,
    /// Elements of the packed buffer: one chunk a rank, all of one length.
    pub len: usize,
    /// Each rank's runs in its chunk, in order.
    runs: Vec<Vec<Run>>,
}

/// A run of one group's elements in a rank's chunk of a bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    group: usize,
    /// Flat indices, within the rank's slice of the group.
    range: Range<usize>,
    /// Where the run starts in a staged gradient, which holds only what
    /// buckets carry ([`GroupLayout::carried_before`]).
    staged_at: usize,
}

impl Bucket {
    /// Splits groups, taken in the order backward completes them, into
    /// buckets of at least `bucket_size` elements (the last bucket may be
    /// smaller). With `leave_frozen_out`, a bucket carries no frozen
    /// parameter's elements.
    pub fn plan(
        layouts: &[GroupLayout],
        backward: &[usize],
        bucket_size: usize,
        leave_frozen_out: bool,
    ) -> Vec<Bucket> {
        let mut out = Vec::new();
        let (mut groups, mut len) = (Vec::new(), 0);
        for &g in backward {
            groups.push(g);
            len += layouts[g].padded;
            if len >= bucket_size {
                let done = std::mem::take(&mut groups);
                out.push(Bucket::over(layouts, done, leave_frozen_out));
                len = 0;
            }
        }
        if !groups.is_empty() {
            out.push(Bucket::over(layouts, groups, leave_frozen_out));
        }
        out
    }

    /// The bucket of `groups`: each rank's slices of them in order, less
    /// their frozen runs with `leave_frozen_out` (adjacent runs joined).
    fn over(layouts: &[GroupLayout], groups: Vec<usize>, leave_frozen_out: bool) -> Bucket {
        let world = groups.first().map_or(1, |&g| layouts[g].world);
        let runs: Vec<Vec<Run>> = (0..world)
            .map(|r| {
                let mut runs: Vec<Run> = Vec::new();
                for &g in &groups {
                    let kept = match leave_frozen_out {
                        true => layouts[g].trained_runs(r),
                        false => vec![layouts[g].slice(r)],
                    };
                    for range in kept {
                        match runs.last_mut() {
                            Some(last) if last.group == g && last.range.end == range.start => {
                                last.range.end = range.end
                            }
                            _ => runs.push(Run {
                                group: g,
                                staged_at: layouts[g].carried_before(range.start, leave_frozen_out),
                                range,
                            }),
                        }
                    }
                }
                runs
            })
            .collect();
        let longest = (runs.iter())
            .map(|r| r.iter().map(|run| run.range.len()).sum::<usize>())
            .max()
            .unwrap_or(0);
        Bucket {
            groups,
            len: world * longest,
            runs,
        }
    }

    /// Elements of one rank's chunk.
    fn chunk(&self) -> usize {
        self.len / self.runs.len()
    }

    /// The runs of one group's parameters that an update moves, each rank's
    /// padded to the longest rank's: what ranks share after the step, when
    /// a group is frozen in part.
    pub fn trained_of(layout: &GroupLayout) -> Bucket {
        Bucket::over(std::slice::from_ref(layout), vec![0], true)
    }

    /// Copies the groups' buffers into one rank-major bucket buffer, `out`
    /// (emptied first: a buffer an earlier reduction gave back).
    /// `bufs` is indexed by group; only this bucket's groups are read:
    /// whole buffers (flat indices), or with `staged` micro-batch
    /// gradients that hold only what the bucket carries.
    pub fn pack(&self, bufs: &[&Flat], staged: bool, mut out: Vec<f32>) -> Vec<f32> {
        out.clear();
        out.reserve(self.len);
        for r in 0..self.runs.len() {
            self.pack_chunk(r, bufs, staged, &mut out);
        }
        out
    }

    /// Appends rank `r`'s chunk of the packed buffer to `out` ([`Bucket::pack`]).
    pub fn pack_chunk(&self, r: usize, bufs: &[&Flat], staged: bool, out: &mut Vec<f32>) {
        let end = out.len() + self.chunk();
        for run in &self.runs[r] {
            let range = match staged {
                true => run.staged_at..run.staged_at + run.range.len(),
                false => run.range.clone(),
            };
            bufs[run.group].extend_f32(range, out);
        }
        out.resize(end, 0.0);
    }

    /// Splits rank `rank`'s chunk of a packed bucket into its runs: yields
    /// (group, range within the chunk, offset within the rank's slice of
    /// the group).
    pub fn own_parts(
        &self,
        rank: usize,
        layouts: &[GroupLayout],
    ) -> Vec<(usize, Range<usize>, usize)> {
        let mut at = 0;
        (self.runs[rank].iter())
            .map(|run| {
                at += run.range.len();
                let offset = run.range.start - layouts[run.group].slice(rank).start;
                (run.group, at - run.range.len()..at, offset)
            })
            .collect()
    }

    /// Copies a rank-major bucket buffer back into the groups' buffers.
    pub fn unpack(&self, packed: &[f32], bufs: &mut [Flat]) {
        for r in 0..self.runs.len() {
            for (g, range, at) in self.chunk_runs(r) {
                bufs[g].set_f32(range.start, &packed[at..at + range.len()]);
            }
        }
    }

    /// Rank `r`'s runs: (group, flat range within the rank's slice of the
    /// group, where the run starts in the packed buffer).
    pub fn chunk_runs(&self, r: usize) -> Vec<(usize, Range<usize>, usize)> {
        let mut at = r * self.chunk();
        (self.runs[r].iter())
            .map(|run| {
                at += run.range.len();
                (run.group, run.range.clone(), at - run.range.len())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zmodel::{Init, ParamSpec};

    fn spec(sizes: &[usize]) -> GroupSpec {
        GroupSpec {
            name: "g".into(),
            params: sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| ParamSpec {
                    name: format!("p{i}"),
                    shape: vec![n],
                    init: Init::Zeros,
                    decay: i % 2 == 0,
                    tile: None,
                    product_operand: false,
                })
                .collect(),
        }
    }

    /// LAMB's cells cover every parameter element once, in flat order,
    /// each inside one parameter and one rank's slice and at most
    /// `NORM_CELL` long, cut every `NORM_CELL` from the part's start.
    #[test]
    fn norm_cells_tile_each_parameter_within_slices() {
        let l = GroupLayout::new(&spec(&[5, NORM_CELL * 2 + 3, 40]), 2);
        let half = l.slice_len();
        let cells = l.norm_cells();
        let mut at = 0;
        for c in &cells {
            assert_eq!(c.range.start, at, "{c:?} follows the last");
            assert!(c.range.len() <= NORM_CELL && !c.range.is_empty(), "{c:?}");
            assert_eq!(c.rank, c.range.start / half, "{c:?}");
            assert_eq!(c.rank, (c.range.end - 1) / half, "{c:?} inside one slice");
            let p = &l.params[c.slot].range;
            assert!(p.start <= c.range.start && c.range.end <= p.end, "{c:?}");
            at = c.range.end;
        }
        assert_eq!(at, l.numel);
        // p1 runs from 5 across the slice edge: full cells from its start,
        // then from the edge.
        let p1: Vec<_> = cells
            .iter()
            .filter(|c| c.slot == 1)
            .map(|c| c.range.clone())
            .collect();
        assert_eq!(p1[0], 5..5 + NORM_CELL);
        assert_eq!(p1[1], 5 + NORM_CELL..half);
        assert_eq!(p1[2], half..(half + NORM_CELL).min(5 + 2 * NORM_CELL + 3));
    }

    #[test]
    fn layout_pads_to_equal_aligned_slices() {
        let l = GroupLayout::new(&spec(&[10, 7]), 3);
        assert_eq!((l.numel, l.padded, l.slice_len()), (17, 48, 16));
        assert_eq!(l.slice(2), 32..48);
        let runs = l.update_runs(0..32);
        assert_eq!(
            runs,
            vec![
                (0..10, Some(true)),
                (10..17, Some(false)),
                (17..32, Some(false))
            ]
        );
        assert_eq!(
            l.update_runs(16..32),
            vec![(16..17, Some(false)), (17..32, Some(false))]
        );
    }

    /// Frozen parameters' runs are marked to be left out, by name.
    #[test]
    fn frozen_parameters_are_left_out_of_the_update() {
        let mut l = GroupLayout::new(&spec(&[10, 7, 4]), 2);
        assert!(!l.any_frozen());
        l.freeze(&["p0".into(), "p{2-9}".into()]);
        assert!(l.any_frozen() && !l.all_frozen());
        assert!(l.frozen_in(&(9..10)) && l.frozen_in(&(16..18)));
        assert!(!l.frozen_in(&(10..17)) && !l.frozen_in(&(21..32)));
        assert_eq!(
            l.params.iter().map(|p| p.frozen).collect::<Vec<_>>(),
            [true, false, true]
        );
        assert_eq!(
            l.update_runs(5..32),
            vec![
                (5..10, None),
                (10..17, Some(false)),
                (17..21, None),
                (21..32, Some(false))
            ]
        );
    }

    #[test]
    fn bucket_chunk_r_is_rank_r_slices() {
        let world = 3;
        let layouts: Vec<_> = [5, 40, 100]
            .iter()
            .map(|&n| GroupLayout::new(&spec(&[n]), world))
            .collect();
        let buckets = Bucket::plan(&layouts, &[2, 1, 0], 100, true);
        assert_eq!(
            buckets.iter().map(|b| b.groups.clone()).collect::<Vec<_>>(),
            vec![vec![2], vec![1, 0]]
        );
        let bufs: Vec<Vec<f32>> = layouts
            .iter()
            .enumerate()
            .map(|(g, l)| (0..l.padded).map(|i| (g * 1000 + i) as f32).collect())
            .collect();
        let b = &buckets[1];
        let flats: Vec<Flat> = bufs.iter().map(|v| Flat::F32(v.clone())).collect();
        let views: Vec<&Flat> = flats.iter().collect();
        // Into a used buffer, as the engine packs into one a reduction gave back.
        let packed = b.pack(&views, false, vec![7.0; 3]);
        assert_eq!(packed.len(), b.len);
        let chunk = zcomm::chunk_range(packed.len(), world, 1);
        let mut want = bufs[1][layouts[1].slice(1)].to_vec();
        want.extend_from_slice(&bufs[0][layouts[0].slice(1)]);
        assert_eq!(&packed[chunk], &want[..]);
        let mut back: Vec<Flat> = layouts
            .iter()
            .map(|l| Flat::zeros(None, l.padded))
            .collect();
        b.unpack(&packed, &mut back);
        assert_eq!(back[0], flats[0]);
        assert_eq!(back[1], flats[1]);
    }

    #[test]
    fn a_bucket_leaves_frozen_parameters_out_of_every_ranks_chunk() {
        // Two ranks; group 0: a (10, frozen), b (30), c (20, frozen), padded
        // to 64: slices 0..32 and 32..64; group 1: d (40, frozen), padded
        // to 64. Group 1's rank-0 slice is all frozen.
        let world = 2;
        let mut layouts = vec![
            GroupLayout::new(&spec(&[10, 30, 20]), world),
            GroupLayout::new(&spec(&[40, 3]), world),
        ];
        layouts[0].freeze(&["p0".into(), "p2".into()]);
        layouts[1].freeze(&["p0".into()]);
        let bufs: Vec<Flat> = (layouts.iter().enumerate())
            .map(|(g, l)| Flat::F32((0..l.padded).map(|i| (g * 1000 + i) as f32).collect()))
            .collect();
        let views: Vec<&Flat> = bufs.iter().collect();
        let b = &Bucket::plan(&layouts, &[1, 0], 1000, true)[0];
        assert_eq!(b.groups, vec![1, 0]);
        // Rank 0: group 1 nothing, group 0 10..32 (b's part); rank 1: group
        // 1 40..64 (the small parameter and padding), group 0 32..40 and
        // 60..64 (b's rest, padding): 22 and 36, so chunks of 36.
        let want0: Vec<f32> = (10..32).map(|i| i as f32).collect();
        let mut want1: Vec<f32> = (40..64).map(|i| (1000 + i) as f32).collect();
        want1.extend((32..40).chain(60..64).map(|i| i as f32));
        assert_eq!(b.len, 2 * 36);
        let packed = b.pack(&views, false, Vec::new());
        assert_eq!(&packed[..22], &want0[..]);
        assert!(packed[22..36].iter().all(|&x| x == 0.0), "{packed:?}");
        assert_eq!(&packed[36..], &want1[..]);
        // Each rank's parts: group, place in the chunk, offset in its slice.
        assert_eq!(b.own_parts(0, &layouts), vec![(0, 0..22, 10)]);
        assert_eq!(
            b.own_parts(1, &layouts),
            vec![(1, 0..24, 8), (0, 24..32, 0), (0, 32..36, 28)]
        );
        // Unpacked, every run goes back and the frozen runs keep what they
        // held.
        let mut back: Vec<Flat> = layouts
            .iter()
            .map(|l| Flat::F32(vec![-1.0; l.padded]))
            .collect();
        b.unpack(&packed, &mut back);
        let got = |g: usize| back[g].to_f32(0..layouts[g].padded);
        let frozen = |g: usize, i: usize| layouts[g].frozen_in(&(i..i + 1));
        for g in 0..2 {
            for (i, v) in got(g).into_iter().enumerate() {
                let want = if frozen(g, i) {
                    -1.0
                } else {
                    (g * 1000 + i) as f32
                };
                assert_eq!(v, want, "group {g}, element {i}");
            }
        }
        // Staged gradients hold only what trains (group 0: b's 30 and the
        // 4 of padding, 34; group 1: the small parameter and padding, 24),
        // and pack as the whole buffers do.
        let staged: Vec<Flat> = (layouts.iter().zip(&bufs))
            .map(|(l, b)| {
                let kept = l.runs_in(0..l.padded, true);
                assert_eq!(
                    l.carried_before(l.padded, true),
                    kept.iter().map(|r| r.len()).sum::<usize>()
                );
                let mut v = Vec::new();
                kept.into_iter().for_each(|r| b.extend_f32(r, &mut v));
                Flat::F32(v)
            })
            .collect();
        assert_eq!((staged[0].len(), staged[1].len()), (34, 24));
        let views: Vec<&Flat> = staged.iter().collect();
        assert_eq!(b.pack(&views, true, Vec::new()), packed);
        // Without leaving them out: whole slices, staged as they are.
        let whole = &Bucket::plan(&layouts, &[1, 0], 1000, false)[0];
        assert_eq!(whole.len, 128);
        assert_eq!(layouts[0].carried_before(40, false), 40);
        let views: Vec<&Flat> = bufs.iter().collect();
        assert_eq!(
            whole.pack(&views, true, Vec::new()),
            whole.pack(&views, false, Vec::new())
        );
    }
}
