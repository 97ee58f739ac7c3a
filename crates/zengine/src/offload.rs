//! NVMe offload (ZeRO-Infinity) below the flat per-block buffers: where a
//! group's optimizer state and (stage 3) its parameter slice live when they
//! live in swap files instead of memory.
//!
//! Each family of buffers (Adam's two moments, the f32 master copy under mixed
//! precision, the working parameters) has one file per rank. Group g's region
//! starts at a 4 KiB-aligned offset of each file, and the optimizer splits the
//! region into sub-groups whose pieces start at multiples of [`ALIGN_ELEMS`]
//! from the region's start; so no two transfers in flight share a disk block and
//! a piece's write never clobbers a neighbour's update.
//!
//! A group's state is installed in memory as before and then *stashed*: written
//! to its files and dropped from memory, one group at a time, so that building
//! or loading an engine never holds more than one block's state.
//!
//! Where the stage partitions gradients (2-3), the rank's reduced gradient
//! slices go to a swap file too, as DeepSpeed's optimizer swapper does: each
//! reduced slice is added to the group's accumulated slice (read back after the
//! step's first micro-batch) and written out, and the step reads it with the
//! moments, piece by piece. So no buffer that grows with the model stays in
//! memory across a step; the squared norm of a group's complete gradient is
//! taken as its last micro-batch is added, in the order and rounding that the
//! in-memory step uses, so the two stay bit-identical.

use std::collections::VecDeque;
use std::ops::Range;
use std::path::PathBuf;

use zconfig::JobSpec;
use zswap::{AioConfig, AlignedBuf, IoHandle, IoStats, SwapDir, SwapFile, Swapper};

use crate::accounting::Transient;
use crate::error::EngineError;
use crate::flat::GroupLayout;
use crate::group::{updated_region, Group};
use crate::precision::{half_of, Flat, Half};

/// Elements whose bytes fill whole 4 KiB blocks at both 2 and 4 bytes each.
pub(crate) const ALIGN_ELEMS: usize = 2048;

/// Where one group's region sits in a family's file.
#[derive(Debug, Clone)]
pub(crate) struct Region {
    /// First element in the file.
    base: u64,
    /// The flat index the region starts at.
    start: usize,
    /// Elements.
    len: usize,
}

impl Region {
    /// Byte offset and byte length of flat `range` (inside the region) in a
    /// file of `elem`-byte elements, rounded out to whole blocks.
    fn span(&self, range: &Range<usize>, elem: usize) -> (u64, usize) {
        debug_assert!(range.start >= self.start && range.end <= self.start + self.len);
        let first = self.base + (range.start - self.start) as u64;
        debug_assert_eq!(
            (first as usize * elem) % zswap::ALIGN,
            0,
            "unaligned swap piece"
        );
        (
            first * elem as u64,
            zswap::buf::round_up(range.len() * elem),
        )
    }
}

/// Lays regions of `lens` elements out one after another at aligned offsets;
/// returns the regions' first elements and the file's length in elements.
fn lay_out(lens: impl Iterator<Item = (usize, usize)>) -> (Vec<Region>, u64) {
    let mut at = 0u64;
    let regions = lens
        .map(|(start, len)| {
            let r = Region {
                base: at,
                start,
                len,
            };
            at += len.div_ceil(ALIGN_ELEMS) as u64 * ALIGN_ELEMS as u64;
            r
        })
        .collect();
    (regions, at)
}

/// Optimizer state in swap files (stages 1-3).
pub(crate) struct OptimizerFiles {
    exp_avg: SwapFile,
    /// AdamW's second moment (Lion keeps none).
    exp_avg_sq: Option<SwapFile>,
    /// Mixed precision's f32 master copy.
    master: Option<SwapFile>,
    /// Per group: its updated region.
    regions: Vec<Region>,
    /// Sub-group buffer sets in flight.
    pub(crate) buffer_count: usize,
}

/// Stage-3 parameter slices in a swap file, in the working precision.
pub(crate) struct ParamFiles {
    file: SwapFile,
    /// Per group: its own slice, for partitioned groups (others stay in memory).
    regions: Vec<Option<Region>>,
    /// Bytes per element (2 or 4).
    elem: usize,
    /// Groups read ahead of their gather.
    pub(crate) buffer_count: usize,
}

/// Stages 2-3 with optimizer offload: the rank's reduced gradient slices, in
/// the working precision, and where this step's accumulation stands.
pub(crate) struct GradFiles {
    file: SwapFile,
    /// Per group: its own slice.
    regions: Vec<Region>,
    /// Bytes per element (2 or 4).
    elem: usize,
    /// Per group, this step: micro-batch gradients added so far.
    adds: Vec<usize>,
    /// Per group: its last write, in flight, and the bytes it holds.
    writes: Vec<Option<(IoHandle, u64)>>,
    /// Groups in the order their writes were started (some since waited
    /// for), so that at most `in_flight` buffers are held.
    order: VecDeque<usize>,
    in_flight: usize,
    /// Per group, once every micro-batch is added: Σ(x·scale)² of the
    /// averaged gradient, as the gradient norm adds it.
    sum_sq: Vec<Option<f64>>,
}

/// A rank's swap files and the swapper that moves them.
pub(crate) struct Offload {
    pub(crate) swapper: Swapper,
    pub(crate) optimizer: Option<OptimizerFiles>,
    pub(crate) params: Option<ParamFiles>,
    pub(crate) grads: Option<GradFiles>,
    /// Bytes this rank's files hold.
    pub(crate) nvme_bytes: u64,
    /// Held last: removing the directories after the files are closed.
    _dirs: Vec<SwapDir>,
}

/// One group's optimizer state of the region a rank updates, read whole.
pub(crate) struct OptimizerState {
    /// Mixed precision's f32 master copy.
    pub(crate) master: Option<Vec<f32>>,
    pub(crate) exp_avg: Vec<f32>,
    pub(crate) exp_avg_sq: Vec<f32>,
}

/// Everything a swapped piece of a sub-group needs, once read.
pub(crate) struct PieceBuffers {
    pub(crate) group: usize,
    pub(crate) range: Range<usize>,
    pub(crate) exp_avg: Option<AlignedBuf>,
    pub(crate) exp_avg_sq: Option<AlignedBuf>,
    pub(crate) master: Option<AlignedBuf>,
    pub(crate) params: Option<AlignedBuf>,
    /// The averaged gradient (read only).
    pub(crate) grads: Option<AlignedBuf>,
}

/// A piece's reads in flight.
pub(crate) struct PieceReads {
    group: usize,
    range: Range<usize>,
    exp_avg: Option<IoHandle>,
    exp_avg_sq: Option<IoHandle>,
    master: Option<IoHandle>,
    /// Read for f32 parameters; a fresh buffer for 16-bit ones, which the
    /// update writes whole from the master copy.
    params: Option<Result<IoHandle, AlignedBuf>>,
    grads: Option<IoHandle>,
}

fn wait(h: Option<IoHandle>) -> Result<Option<AlignedBuf>, EngineError> {
    h.map(IoHandle::wait).transpose().map_err(EngineError::from)
}

impl PieceReads {
    pub(crate) fn wait(self) -> Result<PieceBuffers, EngineError> {
        Ok(PieceBuffers {
            group: self.group,
            range: self.range,
            exp_avg: wait(self.exp_avg)?,
            exp_avg_sq: wait(self.exp_avg_sq)?,
            master: wait(self.master)?,
            params: match self.params {
                None => None,
                Some(Ok(h)) => Some(h.wait()?),
                Some(Err(fresh)) => Some(fresh),
            },
            grads: wait(self.grads)?,
        })
    }
}

/// Fault injection for tests: `ZRUN_FAULT_SWAP_DELAY_MS` stalls a rank right
/// after it has created its swap files (sparse: nothing is written to them
/// yet), so that a test can fill the disk under a running job before the
/// first write, however fast the machine.
fn fault_delay_after_create() {
    if let Some(ms) = std::env::var("ZRUN_FAULT_SWAP_DELAY_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

impl Offload {
    /// The swap files of `spec`'s NVMe offload on `rank` of job `job_id`, for
    /// groups laid out as `layouts` (with `partitioned[g]` at stage 3); `None`
    /// when nothing is offloaded to NVMe.
    pub(crate) fn new(
        spec: &JobSpec,
        job_id: &str,
        rank: usize,
        layouts: &[GroupLayout],
        partitioned: &[bool],
        half: Option<Half>,
    ) -> Result<Option<Offload>, EngineError> {
        let z = &spec.zero;
        let (opt, par) = (z.offload_optimizer.is_nvme(), z.offload_param.is_nvme());
        if !opt && !par {
            return Ok(None);
        }
        let a = &spec.aio;
        let swapper = Swapper::new(
            AioConfig {
                block_size: a.block_size.0 as usize,
                queue_depth: a.queue_depth,
                thread_count: a.thread_count,
            },
            io_path_override(),
        )?;
        tracing::info!("NVMe offload: swap I/O over {}", swapper.path().name());
        let mut dirs: Vec<(PathBuf, SwapDir)> = Vec::new();
        // Both offloads may share one path, and so one directory.
        let dir_for = |dirs: &mut Vec<(PathBuf, SwapDir)>, root: &str| {
            let root = PathBuf::from(root);
            match dirs.iter().position(|(r, _)| *r == root) {
                Some(i) => Ok::<_, EngineError>(dirs.remove(i).1),
                None => Ok(SwapDir::create(&root, job_id, rank)?),
            }
        };
        let mut nvme_bytes = 0;
        let mut grads = None;
        let optimizer = if opt {
            let root = z.offload_optimizer.nvme_path.clone().unwrap_or_default();
            let dir = dir_for(&mut dirs, &root)?;
            let stage = z.stage;
            let (regions, len) = lay_out(layouts.iter().map(|l| {
                let r = updated_region(l, rank, stage);
                (r.start, r.len())
            }));
            let bytes = len * 4;
            let second = spec.train.optimizer.kind.second_moment();
            let families = 1 + u64::from(second) + u64::from(half.is_some());
            nvme_bytes += bytes * families;
            if z.stage.partitions_gradients() {
                let elem = match half_of(spec.train.grads_dtype()) {
                    Some(_) => 2,
                    None => 4,
                };
                let (regions, len) = lay_out(layouts.iter().map(|l| {
                    let s = l.slice(rank);
                    (s.start, s.len())
                }));
                nvme_bytes += len * elem as u64;
                let n = layouts.len();
                grads = Some(GradFiles {
                    file: dir.file("grads.swp", len * elem as u64)?,
                    regions,
                    elem,
                    adds: vec![0; n],
                    writes: (0..n).map(|_| None).collect(),
                    order: VecDeque::new(),
                    in_flight: z.offload_optimizer.buffer_count.unwrap_or(4).max(1),
                    sum_sq: vec![None; n],
                });
            }
            let files = OptimizerFiles {
                exp_avg: dir.file("exp_avg.swp", bytes)?,
                exp_avg_sq: second
                    .then(|| dir.file("exp_avg_sq.swp", bytes))
                    .transpose()?,
                master: half.map(|_| dir.file("master.swp", bytes)).transpose()?,
                regions,
                buffer_count: z.offload_optimizer.buffer_count.unwrap_or(4).max(1),
            };
            dirs.push((PathBuf::from(root), dir));
            Some(files)
        } else {
            None
        };
        let params = if par {
            let root = z.offload_param.nvme_path.clone().unwrap_or_default();
            let dir = dir_for(&mut dirs, &root)?;
            let elem = if half.is_some() { 2 } else { 4 };
            let (all, len) = lay_out(layouts.iter().zip(partitioned).map(|(l, &p)| {
                let s = l.slice(rank);
                (s.start, if p { s.len() } else { 0 })
            }));
            let regions = all
                .into_iter()
                .zip(partitioned)
                .map(|(r, &p)| p.then_some(r))
                .collect();
            nvme_bytes += len * elem as u64;
            let files = ParamFiles {
                file: dir.file("params.swp", len * elem as u64)?,
                regions,
                elem,
                buffer_count: z.offload_param.buffer_count.unwrap_or(5).max(1),
            };
            dirs.push((PathBuf::from(root), dir));
            Some(files)
        } else {
            None
        };
        fault_delay_after_create();
        Ok(Some(Offload {
            swapper,
            optimizer,
            params,
            grads,
            nvme_bytes,
            _dirs: dirs.into_iter().map(|(_, d)| d).collect(),
        }))
    }

    /// Whether group `g`'s parameter slice lives in swap.
    pub(crate) fn swaps_params(&self, g: usize) -> bool {
        self.params.as_ref().is_some_and(|p| p.regions[g].is_some())
    }

    /// Bytes moved and time spent so far.
    pub(crate) fn stats(&self) -> IoStats {
        self.swapper.stats()
    }

    /// Moves group `g`'s swapped state from memory to its files and drops it
    /// from memory. `fresh_moments`: the moments are zero, which fresh
    /// (sparse) files already read as, so they are not written.
    pub(crate) fn stash(
        &self,
        g: usize,
        group: &mut Group,
        fresh_moments: bool,
    ) -> Result<(), EngineError> {
        let mut writes = Vec::new();
        if self.grads.is_some() {
            group.grads = Flat::zeros(group.grads.kind(), 0);
        }
        if let Some(o) = &self.optimizer {
            let r = &o.regions[g];
            let all = r.start..r.start + r.len;
            // Only what is held in memory (whole) is written: a group whose
            // moments were stashed before holds none.
            let m = std::mem::take(&mut group.exp_avg);
            let v = std::mem::take(&mut group.exp_avg_sq);
            group.moments_released = 0;
            if !fresh_moments && m.len() == r.len {
                writes.push(self.write_f32(&o.exp_avg, r, &all, &m));
                if let Some(file) = &o.exp_avg_sq {
                    writes.push(self.write_f32(file, r, &all, &v));
                }
            }
            if let (Some(file), Some(master)) = (&o.master, group.master.take()) {
                writes.push(self.write_f32(file, r, &all, &master));
            }
        }
        if let Some(p) = &self.params {
            if let Some(r) = &p.regions[g] {
                let all = r.start..r.start + r.len;
                let kind = group.params.kind();
                let held = std::mem::replace(&mut group.params, Flat::zeros(kind, 0));
                if held.len() == r.len {
                    let (off, len) = r.span(&all, p.elem);
                    let mut buf = AlignedBuf::zeroed(len);
                    let bytes = held.as_bytes();
                    buf.bytes_mut()[..bytes.len()].copy_from_slice(bytes);
                    writes.push(self.swapper.write(&p.file, off, buf));
                }
            }
        }
        for w in writes {
            w.wait()?;
        }
        Ok(())
    }

    /// Group `g`'s gradient slice accumulated so far this step, in the
    /// working precision `kind`: zero before its first micro-batch, else read
    /// back once its last write has landed.
    pub(crate) fn take_grads(
        &mut self,
        g: usize,
        kind: Option<Half>,
        held: &mut Transient,
    ) -> Result<Flat, EngineError> {
        let Some(gf) = &mut self.grads else {
            unreachable!("take_grads without gradient swap")
        };
        let r = &gf.regions[g];
        if gf.adds[g] == 0 {
            return Ok(Flat::zeros(kind, r.len));
        }
        if let Some((w, bytes)) = gf.writes[g].take() {
            w.wait()?;
            held.sub(bytes);
        }
        let (off, len) = r.span(&(r.start..r.start + r.len), gf.elem);
        let buf = self
            .swapper
            .read(&gf.file, off, AlignedBuf::zeroed(len))
            .wait()?;
        let words = r.len * gf.elem / 4;
        Ok(Flat::from_words(kind, buf.f32s()[..words].to_vec()))
    }

    /// Writes group `g`'s accumulated slice back after one more micro-batch
    /// was added; `sum_sq`: its squared norm, once it is complete. Waits for
    /// the oldest writes beyond `buffer_count` in flight, whose buffers would
    /// otherwise hold every group's gradient in memory.
    pub(crate) fn put_grads(
        &mut self,
        g: usize,
        grads: &Flat,
        sum_sq: Option<f64>,
        held: &mut Transient,
    ) -> Result<(), EngineError> {
        let Some(gf) = &mut self.grads else {
            unreachable!("put_grads without gradient swap")
        };
        let r = &gf.regions[g];
        let (off, len) = r.span(&(r.start..r.start + r.len), gf.elem);
        let mut buf = AlignedBuf::zeroed(len);
        let bytes = grads.as_bytes();
        buf.bytes_mut()[..bytes.len()].copy_from_slice(bytes);
        held.add(len as u64);
        gf.writes[g] = Some((self.swapper.write(&gf.file, off, buf), len as u64));
        gf.order.push_back(g);
        gf.adds[g] += 1;
        gf.sum_sq[g] = sum_sq;
        while gf.order.len() > gf.in_flight {
            let oldest = gf.order.pop_front().expect("more than in_flight");
            if let Some((w, bytes)) = gf.writes[oldest].take() {
                w.wait()?;
                held.sub(bytes);
            }
        }
        Ok(())
    }

    /// Micro-batch gradients added to group `g` this step (`None` where
    /// gradients are not swapped).
    pub(crate) fn grad_adds(&self, g: usize) -> Option<usize> {
        self.grads.as_ref().map(|gf| gf.adds[g])
    }

    /// Group `g`'s squared gradient norm, where gradients are swapped and complete.
    pub(crate) fn grad_sum_sq(&self, g: usize) -> Option<f64> {
        self.grads.as_ref().and_then(|gf| gf.sum_sq[g])
    }

    /// Waits for every gradient write in flight (before the step reads them).
    pub(crate) fn flush_grads(&mut self, held: &mut Transient) -> Result<(), EngineError> {
        if let Some(gf) = &mut self.grads {
            gf.order.clear();
            for (w, bytes) in gf.writes.iter_mut().filter_map(Option::take) {
                w.wait()?;
                held.sub(bytes);
            }
        }
        Ok(())
    }

    /// Starts the next step's accumulation from zero.
    pub(crate) fn reset_grads(&mut self) {
        if let Some(gf) = &mut self.grads {
            gf.adds.fill(0);
            gf.sum_sq.fill(None);
        }
    }

    fn write_f32(&self, file: &SwapFile, r: &Region, range: &Range<usize>, v: &[f32]) -> IoHandle {
        let (off, len) = r.span(range, 4);
        let mut buf = AlignedBuf::zeroed(len);
        buf.f32s_mut()[..v.len()].copy_from_slice(v);
        self.swapper.write(file, off, buf)
    }

    fn read_f32(&self, file: &SwapFile, r: &Region) -> Result<Vec<f32>, EngineError> {
        let (off, len) = r.span(&(r.start..r.start + r.len), 4);
        let buf = self
            .swapper
            .read(file, off, AlignedBuf::zeroed(len))
            .wait()?;
        Ok(buf.f32s()[..r.len].to_vec())
    }

    /// Group `g`'s offloaded optimizer state, read whole: (master, exp_avg,
    /// exp_avg_sq, empty under Lion) of its updated region. `None` without
    /// optimizer offload.
    pub(crate) fn read_optimizer(&self, g: usize) -> Result<Option<OptimizerState>, EngineError> {
        let Some(o) = &self.optimizer else {
            return Ok(None);
        };
        let r = &o.regions[g];
        Ok(Some(OptimizerState {
            master: o.master.as_ref().map(|f| self.read_f32(f, r)).transpose()?,
            exp_avg: self.read_f32(&o.exp_avg, r)?,
            exp_avg_sq: match &o.exp_avg_sq {
                Some(file) => self.read_f32(file, r)?,
                None => Vec::new(),
            },
        }))
    }

    /// Starts reading group `g`'s parameter slice (its collective words).
    pub(crate) fn read_params(&self, g: usize) -> Option<(IoHandle, usize)> {
        let p = self.params.as_ref()?;
        let r = p.regions[g].as_ref()?;
        let (off, len) = r.span(&(r.start..r.start + r.len), p.elem);
        let words = r.len * p.elem / 4;
        Some((
            self.swapper.read(&p.file, off, AlignedBuf::zeroed(len)),
            words,
        ))
    }

    /// Starts the reads of one sub-group's pieces. 16-bit parameters, which
    /// the update writes whole from the master, are read only where
    /// `frozen_in(group, range)`: the update leaves frozen ones as they are.
    pub(crate) fn read_pieces(
        &self,
        pieces: &[(usize, Range<usize>)],
        frozen_in: impl Fn(usize, &Range<usize>) -> bool,
    ) -> Vec<PieceReads> {
        pieces
            .iter()
            .map(|(g, range)| {
                let mut reads = PieceReads {
                    group: *g,
                    range: range.clone(),
                    exp_avg: None,
                    exp_avg_sq: None,
                    master: None,
                    params: None,
                    grads: None,
                };
                if let Some(gf) = &self.grads {
                    let (off, len) = gf.regions[*g].span(range, gf.elem);
                    reads.grads = Some(self.swapper.read(&gf.file, off, AlignedBuf::zeroed(len)));
                }
                if let Some(o) = &self.optimizer {
                    let r = &o.regions[*g];
                    let (off, len) = r.span(range, 4);
                    let read = |f: &SwapFile| self.swapper.read(f, off, AlignedBuf::zeroed(len));
                    reads.exp_avg = Some(read(&o.exp_avg));
                    reads.exp_avg_sq = o.exp_avg_sq.as_ref().map(read);
                    reads.master = o.master.as_ref().map(read);
                }
                if let Some(p) = &self.params {
                    if let Some(r) = &p.regions[*g] {
                        let (off, len) = r.span(range, p.elem);
                        reads.params = Some(if p.elem == 4 || frozen_in(*g, range) {
                            Ok(self.swapper.read(&p.file, off, AlignedBuf::zeroed(len)))
                        } else {
                            Err(AlignedBuf::zeroed(len))
                        });
                    }
                }
                reads
            })
            .collect()
    }

    /// Starts writing back what the update changed in one piece.
    pub(crate) fn write_piece(&self, b: PieceBuffers) -> Vec<IoHandle> {
        let mut out = Vec::new();
        if let Some(o) = &self.optimizer {
            let (off, _) = o.regions[b.group].span(&b.range, 4);
            let files = [Some(&o.exp_avg), o.exp_avg_sq.as_ref(), o.master.as_ref()];
            for (file, buf) in files.into_iter().zip([b.exp_avg, b.exp_avg_sq, b.master]) {
                if let (Some(f), Some(buf)) = (file, buf) {
                    out.push(self.swapper.write(f, off, buf));
                }
            }
        }
        if let (Some(p), Some(buf)) = (&self.params, b.params) {
            if let Some(r) = &p.regions[b.group] {
                let (off, _) = r.span(&b.range, p.elem);
                out.push(self.swapper.write(&p.file, off, buf));
            }
        }
        out
    }
}

/// `ZRUN_AIO=threads` or `uring` forces an I/O path (tests and benchmarks run
/// both); unset, the swapper picks io_uring where the kernel allows it.
fn io_path_override() -> Option<zswap::IoPath> {
    match std::env::var("ZRUN_AIO").ok().as_deref() {
        Some("threads") => Some(zswap::IoPath::Threads),
        Some("uring") | Some("io_uring") => Some(zswap::IoPath::Uring),
        _ => None,
    }
}

/// Stage-3 parameter slices read from swap ahead of their gathers, walking the
/// micro-batch's gather order `depth` groups ahead (`offload_param.buffer_count`).
#[derive(Default)]
pub(crate) struct ParamReadAhead {
    order: Vec<usize>,
    next: usize,
    pending: VecDeque<(usize, IoHandle, usize)>,
    depth: usize,
}

impl ParamReadAhead {
    /// Reads for the gathers of `order` (groups whose slices are not swapped
    /// are skipped as they come).
    pub(crate) fn new(order: Vec<usize>, depth: usize) -> ParamReadAhead {
        ParamReadAhead {
            order,
            next: 0,
            pending: VecDeque::new(),
            depth: depth.max(1),
        }
    }

    fn launch(&mut self, offload: &Offload) {
        while self.next < self.order.len() {
            let g = self.order[self.next];
            self.next += 1;
            if let Some((h, words)) = offload.read_params(g) {
                self.pending.push_back((g, h, words));
                return;
            }
        }
    }

    /// Group `g`'s slice as collective words; `g` must be the next swapped
    /// group in the order.
    pub(crate) fn take(&mut self, g: usize, offload: &Offload) -> Result<Vec<f32>, EngineError> {
        if self.pending.is_empty() {
            self.launch(offload);
        }
        let (_, handle, words) = self
            .pending
            .pop_front()
            .filter(|(got, ..)| *got == g)
            .expect("stage-3 parameter reads requested out of the planned order");
        while self.pending.len() < self.depth && self.next < self.order.len() {
            self.launch(offload);
        }
        let buf = handle.wait()?;
        Ok(buf.f32s()[..words].to_vec())
    }

    /// Whether every planned read was taken (none was wasted).
    pub(crate) fn finished(&self, offload: &Offload) -> bool {
        self.pending.is_empty()
            && self.order[self.next..]
                .iter()
                .all(|&g| !offload.swaps_params(g))
    }
}
