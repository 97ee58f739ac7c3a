//! Working precision: the flat buffers that hold parameters and gradients in f32
//! or in a 16-bit type, and f16's dynamic loss scaling.
//!
//! With `train.dtype: bf16 | f16` the working parameters and the gradients are
//! stored in 2 bytes an element, the f32 master weights and Adam moments only for
//! the slice a rank updates (ZeRO's K = 12). Activations stay f32 (but with
//! bf16 products those that only products read are written in bf16: the
//! norms' outputs, attention's output, GPT's MLP activation). The linear
//! layers, attention and the head multiply bf16 (operands rounded, f32 accumulation) where
//! the CPU multiplies bf16 natively (AMX-BF16, or AVX512_BF16 on AMD:
//! `zmodel::Gpt::with_bf16_products`), the linear weights read straight from
//! the bf16 working copy; elsewhere they multiply the rounded weights in f32,
//! since there a 16-bit product is no faster
//! here (see README). Each micro-batch's gradient is rounded to the working
//! dtype as soon as backward produces it, in every stage, so that the stages stay
//! bit-identical; the reduction itself adds in f32 (its pieces cross the wire
//! in f32, or rounded to 16 bits under `train.reduce_dtype`). The 16-bit
//! type is `zquant::Half`, which the wire's rounding shares.
//!
//! Collectives carry f32 words. A 16-bit buffer travels packed two elements to a
//! word (its slices are multiples of 16 elements), which halves the bytes of the
//! parameter all-gathers; a gather only copies, so the bits arrive unchanged.

use std::mem::MaybeUninit;
use std::ops::Range;

use half::f16;
use rayon::prelude::*;
use zconfig::{Dtype, LossScaleSpec};

pub use zquant::Half;

/// The 16-bit type of a training dtype (`None` for f32).
pub fn half_of(d: Dtype) -> Option<Half> {
    match d {
        Dtype::F32 => None,
        Dtype::Bf16 => Some(Half::Bf16),
        Dtype::F16 => Some(Half::F16),
    }
}

/// Elements converted at a time through a stack buffer.
const BLOCK: usize = 1024;

/// Elements of one parallel task in the passes over whole buffers (widening,
/// adding a gradient, zeroing, the squared norm): 128 KiB of f32, a hand-off
/// worth its cost, and a group's buffer (a block's 1.8M parameters in the
/// model of the README) still makes tens of tasks. These passes used to run on
/// the training thread alone, 8% of a bf16 step on one worker with two
/// threads while the other core waited.
pub(crate) const TASK: usize = 1 << 15;

/// `n` zeros stored, not only allocated, for buffers that training reads
/// before it writes them: Adam's moments at the first step, a stage-0
/// gradient buffer that its first micro-batch adds into. `vec![0.0; n]`
/// maps fresh pages only when they are touched, so that step read each page
/// as the shared zero page and then faulted again to write it (a
/// copy-on-write fault, whose flush of the zero page's mapping interrupts
/// every other core the process runs on), 13 µs a page on a 2-core KVM
/// guest: the anchor job's first step spent 290 ms in the optimizer against
/// 10 ms for later steps (f32, one worker). Stored here, a zero a page, each
/// page faults once, on a write: the first step's optimizer took 10 ms, its
/// backward 20 ms less, and a 2-step job's whole run 1.43-1.49 s against
/// 1.69-1.72 (2026-12-01, alternated). The stores are volatile: the
/// compiler folds a plain fill of fresh memory with zeros back into a zeroed
/// allocation (it did, in the test below).
///
/// Only the pages that hold elements of `runs` (in bounds) are stored: the
/// others (a frozen parameter's, which nothing writes) stay unmapped until
/// written.
pub(crate) fn resident_zeros_in<T: bytemuck::Zeroable + Copy>(
    n: usize,
    runs: &[Range<usize>],
) -> Vec<T> {
    let mut v = vec![T::zeroed(); n];
    let a_page = (4096 / std::mem::size_of::<T>()).max(1);
    let inside = runs.iter().map(|r| r.start.min(n)..r.end.min(n));
    for r in inside.filter(|r| !r.is_empty()) {
        for i in r.clone().step_by(a_page).chain([r.end - 1]) {
            // SAFETY: `i < n`, inside `v`.
            unsafe { std::ptr::write_volatile(v.as_mut_ptr().add(i), T::zeroed()) };
        }
    }
    v
}

/// A flat buffer in the working precision.
#[derive(Debug, Clone, PartialEq)]
pub enum Flat {
    /// 4 bytes an element.
    F32(Vec<f32>),
    /// 2 bytes an element, as bits.
    Half(Half, Vec<u16>),
}

impl Flat {
    /// `n` zeros.
    pub fn zeros(kind: Option<Half>, n: usize) -> Flat {
        Flat::zeros_in(kind, n, std::slice::from_ref(&(0..n)))
    }

    /// `n` zeros, stored (each page written once, so that training's first
    /// pass over them takes no copy-on-write fault) only in the pages that
    /// hold elements of `runs`: the others stay unmapped until written.
    pub fn zeros_in(kind: Option<Half>, n: usize, runs: &[Range<usize>]) -> Flat {
        match kind {
            None => Flat::F32(resident_zeros_in(n, runs)),
            Some(h) => Flat::Half(h, resident_zeros_in(n, runs)),
        }
    }

    /// `n` elements holding `parts` (each `(at, values)`: elements `at..` are
    /// `values`) and zero elsewhere: the bits of [`Flat::zeros`] followed by
    /// [`Flat::add_f32`] of each part, each element `0 + v` rounded (so a
    /// `-0.0` arrives as `+0.0`, as the add makes it), in one pass that
    /// writes every element once: no zeroing pass before, and no read of the
    /// zeros back. A micro-batch's gradient buffer where the stage
    /// partitions gradients, made fresh for every micro-batch from its
    /// group's gradients. `None` where the parts are out of order, overlap
    /// or run past `n`.
    pub fn with_parts(kind: Option<Half>, n: usize, parts: &[(usize, &[f32])]) -> Option<Flat> {
        let mut flat = match kind {
            None => Flat::F32(Vec::with_capacity(n)),
            Some(h) => Flat::Half(h, Vec::with_capacity(n)),
        };
        match &mut flat {
            Flat::F32(v) => {
                write_parts(&mut v.spare_capacity_mut()[..n], None, parts)?;
                // SAFETY: write_parts wrote each of the first n elements.
                unsafe { v.set_len(n) };
            }
            Flat::Half(h, v) => {
                write_parts(&mut v.spare_capacity_mut()[..n], Some(*h), parts)?;
                // SAFETY: as above.
                unsafe { v.set_len(n) };
            }
        }
        Some(flat)
    }

    /// The working type: `None` for f32.
    pub fn kind(&self) -> Option<Half> {
        match self {
            Flat::F32(_) => None,
            Flat::Half(h, _) => Some(*h),
        }
    }

    /// The elements' bytes, as they lie in memory (and in a swap file).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Flat::F32(v) => bytemuck::cast_slice(v),
            Flat::Half(_, v) => bytemuck::cast_slice(v),
        }
    }

    /// `values`, rounded to the working type.
    pub fn from_f32(kind: Option<Half>, values: &[f32]) -> Flat {
        match kind {
            None => Flat::F32(values.to_vec()),
            Some(h) => {
                let mut bits = vec![0u16; values.len()];
                h.round_slice(values, &mut bits);
                Flat::Half(h, bits)
            }
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Flat::F32(v) => v.len(),
            Flat::Half(_, v) => v.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        match self {
            Flat::F32(v) => (v.len() * 4) as u64,
            Flat::Half(_, v) => (v.len() * 2) as u64,
        }
    }

    /// Elements `r` as f32.
    pub fn to_f32(&self, r: Range<usize>) -> Vec<f32> {
        match self {
            Flat::F32(v) => v[r].par_iter().with_min_len(TASK).copied().collect(),
            // Written once, not zeroed first (calloc's memset of reused
            // memory was 3% of a bf16 step): rayon collects an indexed
            // iterator straight into the vector.
            Flat::Half(Half::Bf16, v) => v[r]
                .par_iter()
                .with_min_len(TASK)
                .map(|&b| zgemm::bf16_value(b))
                .collect(),
            Flat::Half(h, v) => {
                let mut out = vec![0f32; r.len()];
                out.par_chunks_mut(TASK)
                    .zip(v[r].par_chunks(TASK))
                    .for_each(|(o, s)| h.widen_slice(s, o));
                out
            }
        }
    }

    /// Appends elements `r` as f32 to `out`.
    pub fn extend_f32(&self, r: Range<usize>, out: &mut Vec<f32>) {
        match self {
            Flat::F32(v) => out.extend_from_slice(&v[r]),
            // As `to_f32`: no zeroing pass before the values.
            Flat::Half(Half::Bf16, v) => out.extend(v[r].iter().map(|&b| zgemm::bf16_value(b))),
            Flat::Half(h, v) => {
                let at = out.len();
                out.resize(at + r.len(), 0.0);
                h.widen_slice(&v[r], &mut out[at..]);
            }
        }
    }

    /// Stores `src` (rounded) at `at..`.
    pub fn set_f32(&mut self, at: usize, src: &[f32]) {
        match self {
            Flat::F32(v) => v[at..at + src.len()].copy_from_slice(src),
            Flat::Half(h, v) => h.round_slice(src, &mut v[at..at + src.len()]),
        }
    }

    /// Adds `src` into `at..` (in f32, then rounded).
    ///
    /// # Panics
    ///
    /// Where `src` runs past the end.
    pub fn add_f32(&mut self, at: usize, src: &[f32]) {
        assert!(
            self.add_parts(&[(at, src)]),
            "{} values at {at} in {} elements",
            src.len(),
            self.len()
        );
    }

    /// Adds each of `parts` (`(at, values)`: into elements `at..`, in f32,
    /// then rounded), in tasks of `TASK` elements of the span the parts
    /// cover: a whole gradient or the scattered rows of a token table's
    /// ([`zmodel::TokenRows`]) alike. Each element's sum is its own, so
    /// the bits do not depend on how the parts are cut into tasks. `false`
    /// (and nothing added) where the parts are out of order, overlap or
    /// run past the end.
    pub fn add_parts(&mut self, parts: &[(usize, &[f32])]) -> bool {
        let ordered = parts.windows(2).all(|w| w[0].0 + w[0].1.len() <= w[1].0);
        if !ordered
            || parts
                .last()
                .is_some_and(|(at, v)| at + v.len() > self.len())
        {
            return false;
        }
        match self {
            Flat::F32(v) => for_each_part(v, parts, |d, s| {
                d.iter_mut().zip(s).for_each(|(d, &s)| *d += s)
            }),
            // In the widest vectors (the widening and the adds; the
            // rounding has its own).
            Flat::Half(h, v) => for_each_part(v, parts, |d, s| {
                zmodel::vectorised(
                    #[inline(always)]
                    || {
                        let mut wide = [0f32; BLOCK];
                        for (d, s) in d.chunks_mut(BLOCK).zip(s.chunks(BLOCK)) {
                            let wide = &mut wide[..d.len()];
                            h.widen_slice(d, wide);
                            wide.iter_mut().zip(s).for_each(|(w, &x)| *w += x);
                            h.round_slice(wide, d);
                        }
                    },
                )
            }),
        }
        true
    }

    /// Sets the elements of each of `runs` to zero, leaving the rest
    /// untouched (a frozen parameter's pages stay unmapped).
    pub fn fill_zero_runs(&mut self, runs: &[Range<usize>]) {
        for r in runs {
            match self {
                Flat::F32(v) => v[r.clone()].par_chunks_mut(TASK).for_each(|c| c.fill(0.0)),
                Flat::Half(_, v) => v[r.clone()].par_chunks_mut(TASK).for_each(|c| c.fill(0)),
            }
        }
    }

    /// [`Flat::with_parts`] over this buffer's own elements, within each of
    /// `runs` alone: each run holds the bits of zeros plus the parts that
    /// lie in it ([`Flat::add_f32`]), in one pass that reads nothing back;
    /// the elements outside every run are untouched and parts outside them
    /// not written. `false` (and nothing written) where the parts are out
    /// of order, overlap or run past the end.
    pub fn set_parts_over(&mut self, runs: &[Range<usize>], parts: &[(usize, &[f32])]) -> bool {
        let n = self.len();
        let ordered = parts.windows(2).all(|w| w[0].0 + w[0].1.len() <= w[1].0);
        if !ordered || parts.last().is_some_and(|(at, v)| at + v.len() > n) {
            return false;
        }
        for run in runs {
            let inside: Vec<(usize, &[f32])> = (parts.iter())
                .filter(|(at, v)| *at >= run.start && at + v.len() <= run.end)
                .map(|(at, v)| (at - run.start, *v))
                .collect();
            let written = match self {
                Flat::F32(v) => write_parts(as_uninit(&mut v[run.clone()]), None, &inside),
                Flat::Half(h, v) => write_parts(as_uninit(&mut v[run.clone()]), Some(*h), &inside),
            };
            if written.is_none() {
                return false;
            }
        }
        true
    }

    /// Gives the whole pages of elements `r` that hold only (positive)
    /// zeros back to the kernel: they read as zeros again and take no
    /// memory until written. Returns the bytes they held (none where the
    /// OS is not Linux, whose `MADV_DONTNEED` is what guarantees the zeros).
    pub fn release_zero_pages(&mut self, r: Range<usize>) -> usize {
        match self {
            Flat::F32(v) => release_zero_pages(bytemuck::cast_slice_mut(&mut v[r])),
            Flat::Half(_, v) => release_zero_pages(bytemuck::cast_slice_mut(&mut v[r])),
        }
    }

    /// Bytes of the whole pages of elements `r` that the kernel does not
    /// hold in memory now (`mincore`; 0 where the OS is not Linux).
    pub fn unmapped_bytes(&self, r: Range<usize>) -> usize {
        match self {
            Flat::F32(v) => unmapped_bytes(bytemuck::cast_slice(&v[r])),
            Flat::Half(_, v) => unmapped_bytes(bytemuck::cast_slice(&v[r])),
        }
    }

    /// Multiplies f32 elements `r` by `scale` in place (16-bit buffers are
    /// scaled as they are read instead; see the step).
    pub fn scale_f32(&mut self, r: Range<usize>, scale: f32) {
        if let Flat::F32(v) = self {
            v[r].par_chunks_mut(TASK)
                .for_each(|c| c.iter_mut().for_each(|x| *x *= scale));
        }
    }

    /// Σ (x·scale)² over elements `r`, each term rounded to f32 first, added in
    /// f64: in tasks of `TASK` elements from the start of `r`, each in 8
    /// interleaved partial sums combined in a fixed order (so that the loop
    /// vectorises), the tasks' sums then added in order, so that the bits
    /// depend only on the slice, not on the threads.
    pub fn sum_sq(&self, r: Range<usize>, scale: f32) -> f64 {
        /// Each rayon task takes [`SUMS_AT_ONCE`] of the `TASK`-element
        /// sums and runs them side by side; their partial sums come back in
        /// order and are added in order.
        fn in_tasks<T: Copy + Sync>(
            v: &[T],
            f: impl Fn(&[T]) -> [f64; SUMS_AT_ONCE] + Sync + Send,
        ) -> f64 {
            let parts: Vec<[f64; SUMS_AT_ONCE]> =
                v.par_chunks(SUMS_AT_ONCE * TASK).map(f).collect();
            let tasks = v.len().div_ceil(TASK);
            parts.iter().flatten().take(tasks).sum()
        }
        // In the CPU's widest vectors (the same bits: no fused operations).
        // Each sum is a chain of dependent f64 additions, one vector of 8
        // lanes per 8 elements, so four run at once to cover the adder's
        // latency: as one baseline SSE2 chain at a time, the bf16 norm was
        // 2.3-2.8% of a bf16 step on AMX. The element closures are written
        // out, not passed by name, so that they are inlined into the wide
        // build.
        match self {
            Flat::F32(v) => in_tasks(&v[r], |c| {
                zmodel::vectorised(
                    #[inline(always)]
                    || sum_sq8_side_by_side(c, scale, |x| x),
                )
            }),
            Flat::Half(Half::Bf16, v) => in_tasks(&v[r], |c| {
                zmodel::vectorised(
                    #[inline(always)]
                    || sum_sq8_side_by_side(c, scale, |b: u16| f32::from_bits(u32::from(b) << 16)),
                )
            }),
            Flat::Half(Half::F16, v) => in_tasks(&v[r], |c| {
                sum_sq8_side_by_side(c, scale, |b| f16::from_bits(b).to_f32())
            }),
        }
    }

    /// Elements `r` as collective words: the f32 values, or 16-bit elements two
    /// to a word (`r` must then have even length; `zcomm::words_of_halves`).
    pub fn words(&self, r: Range<usize>) -> Vec<f32> {
        match self {
            Flat::F32(v) => v[r].to_vec(),
            Flat::Half(_, v) => zcomm::words_of_halves(&v[r]).into_owned(),
        }
    }

    /// A buffer of the type of `like` from collective words (see [`Flat::words`]).
    pub fn from_words(like: Option<Half>, words: Vec<f32>) -> Flat {
        match like {
            None => Flat::F32(words),
            Some(h) => Flat::Half(h, zcomm::halves_of_words(&words)),
        }
    }

    /// Collective words for `n` elements.
    pub fn words_for(kind: Option<Half>, n: usize) -> usize {
        match kind {
            None => n,
            Some(_) => n / 2,
        }
    }
}

/// An element type of a [`Flat`]: f32, or 16-bit bits of `Half`.
trait Element: Copy + Send + Sync {
    const ZERO: Self;
    /// `0 + v` for each of `values` into `out`, rounded to `half` (16-bit
    /// elements; f32 ones take `None`), as [`Flat::add_f32`] makes it.
    fn write_sums(half: Option<Half>, values: &[f32], out: &mut [MaybeUninit<Self>]);
}

impl Element for f32 {
    const ZERO: f32 = 0.0;
    fn write_sums(_: Option<Half>, values: &[f32], out: &mut [MaybeUninit<f32>]) {
        for (o, &v) in out.iter_mut().zip(values) {
            o.write(0.0 + v);
        }
    }
}

impl Element for u16 {
    const ZERO: u16 = 0;
    fn write_sums(half: Option<Half>, values: &[f32], out: &mut [MaybeUninit<u16>]) {
        let h = half.expect("16-bit elements have a half type");
        // As `add_f32` does it: the sums in a block of f32, rounded by
        // `round_slice`; the sums and the copy in the widest vectors (as
        // the baseline's 4-lane loops they held a 10.8M-element bf16
        // buffer's writing at 0.80x this on one thread, 0.89x on two: a
        // tenth of a percent of a bf16 step).
        zmodel::vectorised(
            #[inline(always)]
            || {
                let (mut wide, mut bits) = ([0f32; BLOCK], [0u16; BLOCK]);
                for (v, out) in values.chunks(BLOCK).zip(out.chunks_mut(BLOCK)) {
                    let (wide, bits) = (&mut wide[..v.len()], &mut bits[..v.len()]);
                    for (w, &v) in wide.iter_mut().zip(v) {
                        *w = 0.0 + v;
                    }
                    h.round_slice(wide, bits);
                    for (o, &b) in out.iter_mut().zip(bits.iter()) {
                        o.write(b);
                    }
                }
            },
        )
    }
}

/// Bytes of the whole pages of `bytes` that are not resident (`mincore`).
fn unmapped_bytes(bytes: &[u8]) -> usize {
    let Some(pages) = whole_pages(bytes) else {
        return 0;
    };
    let mut flags = vec![0u8; pages.len() / PAGE];
    // SAFETY: `pages` lies inside `bytes`, page-aligned; `flags` holds a
    // byte a page.
    let rc = unsafe {
        let start = bytes.as_ptr().add(pages.start);
        libc::mincore(start as *mut libc::c_void, pages.len(), flags.as_mut_ptr())
    };
    if rc != 0 {
        return 0;
    }
    PAGE * flags.iter().filter(|&&f| f & 1 == 0).count()
}

/// Gives the whole pages of `bytes` that hold only zero bytes back to the
/// kernel; returns the bytes they held (0 where the OS is not Linux, whose
/// `MADV_DONTNEED` is what guarantees that they read as zeros again). A
/// negative zero is not zero bytes: its page stays.
pub(crate) fn release_zero_pages(bytes: &mut [u8]) -> usize {
    let Some(pages) = whole_pages(bytes) else {
        return 0;
    };
    let mut released = 0;
    for page in bytes[pages].chunks_exact_mut(PAGE) {
        if page.iter().any(|&b| b != 0) {
            continue;
        }
        // SAFETY: one whole page inside `bytes`, which this holds
        // exclusively; its contents stay zeros.
        if unsafe { libc::madvise(page.as_mut_ptr().cast(), PAGE, libc::MADV_DONTNEED) } == 0 {
            released += PAGE;
        }
    }
    released
}

/// The memory page's size these calls assume (Linux on x86-64 and most
/// aarch64 kernels).
const PAGE: usize = 4096;

/// The offsets in `bytes` of the whole pages inside it; `None` where there
/// are none, or the OS is not Linux (whose page calls these rely on).
fn whole_pages(bytes: &[u8]) -> Option<Range<usize>> {
    let addr = bytes.as_ptr() as usize;
    let (start, end) = (
        addr.next_multiple_of(PAGE),
        (addr + bytes.len()) / PAGE * PAGE,
    );
    (cfg!(target_os = "linux") && start < end).then(|| start - addr..end - addr)
}

/// Initialised elements as slots to write over (each gets a new value).
fn as_uninit<T: Copy>(v: &mut [T]) -> &mut [MaybeUninit<T>] {
    // SAFETY: MaybeUninit<T> has T's layout, and every slot already holds
    // an initialised T; writers only store initialised values (T is Copy,
    // nothing to drop).
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len()) }
}

/// Writes [`Flat::with_parts`]' elements into `out`: `0 + v` (rounded to
/// `half`) inside the parts, zero outside them, in tasks of [`TASK`]
/// elements spread over the pool. `None`, with nothing written, where the
/// parts are out of order, overlap or run past `out`.
fn write_parts<T: Element>(
    out: &mut [MaybeUninit<T>],
    half: Option<Half>,
    parts: &[(usize, &[f32])],
) -> Option<()> {
    let mut end = 0;
    for (at, values) in parts {
        if *at < end || at + values.len() > out.len() {
            return None;
        }
        end = at + values.len();
    }
    out.par_chunks_mut(TASK)
        .enumerate()
        .for_each(|(task, chunk)| {
            let c0 = task * TASK;
            let c1 = c0 + chunk.len();
            let mut at = c0;
            // The parts that reach into this task's elements, in order.
            let first = parts.partition_point(|(p, v)| p + v.len() <= c0);
            for (p, v) in parts[first..].iter().take_while(|(p, _)| *p < c1) {
                let (from, to) = ((*p).max(c0), (p + v.len()).min(c1));
                chunk[at - c0..from - c0].fill(MaybeUninit::new(T::ZERO));
                T::write_sums(half, &v[from - p..to - p], &mut chunk[from - c0..to - c0]);
                at = to;
            }
            chunk[at - c0..].fill(MaybeUninit::new(T::ZERO));
        });
    Some(())
}

/// Runs `f` on each of `parts` (in order, not overlapping, inside `out`)
/// with the elements of `out` it covers, in tasks of [`TASK`] elements of
/// the span from the first part's start to the last one's end, spread
/// over the pool: a task takes the pieces of the parts that lie in it.
fn for_each_part<T: Send>(
    out: &mut [T],
    parts: &[(usize, &[f32])],
    f: impl Fn(&mut [T], &[f32]) + Sync,
) {
    let (Some((start, _)), Some((last, v))) = (parts.first(), parts.last()) else {
        return;
    };
    out[*start..last + v.len()]
        .par_chunks_mut(TASK)
        .enumerate()
        .for_each(|(task, chunk)| {
            let c0 = start + task * TASK;
            let c1 = c0 + chunk.len();
            let first = parts.partition_point(|(p, v)| p + v.len() <= c0);
            for (p, v) in parts[first..].iter().take_while(|(p, _)| *p < c1) {
                let (from, to) = ((*p).max(c0), (p + v.len()).min(c1));
                f(&mut chunk[from - c0..to - c0], &v[from - p..to - p]);
            }
        });
}

/// Sums of [`Flat::sum_sq`] run side by side.
const SUMS_AT_ONCE: usize = 4;

/// [`sum_sq8`] of each `TASK` elements of `v` (up to [`SUMS_AT_ONCE`] of
/// them, zero past its end), the whole ones advanced together: their
/// additions interleave, each in its own order, so the bits are
/// [`sum_sq8`]'s.
#[inline(always)]
fn sum_sq8_side_by_side<T: Copy>(
    v: &[T],
    scale: f32,
    f: impl Fn(T) -> f32 + Copy,
) -> [f64; SUMS_AT_ONCE] {
    let mut out = [0f64; SUMS_AT_ONCE];
    if v.len() < SUMS_AT_ONCE * TASK {
        for (o, c) in out.iter_mut().zip(v.chunks(TASK)) {
            *o = sum_sq8(c, scale, f);
        }
        return out;
    }
    let sq = |x: T| {
        let y = f64::from(f(x) * scale);
        y * y
    };
    let mut acc = [[0f64; 8]; SUMS_AT_ONCE];
    for i in (0..TASK).step_by(8) {
        for (t, a) in acc.iter_mut().enumerate() {
            for (a, &x) in a.iter_mut().zip(&v[t * TASK + i..t * TASK + i + 8]) {
                *a += sq(x);
            }
        }
    }
    // TASK is a multiple of 8: no tail; the lanes combined as sum_sq8 does.
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
    }
    out
}

/// Σ (f(x)·scale)² in f64 with 8 lanes (see [`Flat::sum_sq`]).
#[inline(always)]
fn sum_sq8<T: Copy>(v: &[T], scale: f32, f: impl Fn(T) -> f32) -> f64 {
    let sq = |x: T| {
        let y = f64::from(f(x) * scale);
        y * y
    };
    let mut acc = [0f64; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += sq(x);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&x| sq(x)).sum();
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// f16's dynamic loss scale, with DeepSpeed's `DynamicLossScaler` semantics:
/// start at 2^`initial_scale_power`; on an overflow, spend one unit of
/// hysteresis, or when none is left halve the scale (not below the minimum) and
/// skip the step; after `loss_scale_window` steps without overflow since the last
/// one, double the scale and restore the hysteresis.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    /// The rules.
    pub config: LossScaleSpec,
    /// The current scale.
    pub scale: f64,
    /// Overflows tolerated before the next halving.
    pub hysteresis: u32,
    /// The 0-based iteration of the last overflow (-1 before any).
    pub last_overflow: i64,
    /// Steps skipped so far.
    pub skipped: u64,
}

impl LossScaler {
    /// A scaler at its initial scale.
    pub fn new(config: &LossScaleSpec) -> LossScaler {
        LossScaler {
            scale: config
                .static_scale
                .unwrap_or(2f64.powi(config.initial_scale_power as i32)),
            hysteresis: config.hysteresis,
            last_overflow: -1,
            skipped: 0,
            config: config.clone(),
        }
    }

    /// Whether an overflow now could not lower the scale any more (never
    /// for a static scale, which skips the step and goes on, as DeepSpeed's
    /// does).
    pub fn at_minimum(&self) -> bool {
        self.config.static_scale.is_none()
            && self.scale <= self.config.min_loss_scale
            && self.hysteresis <= 1
    }

    /// Records iteration `iter` (0-based): whether its gradients overflowed.
    pub fn update(&mut self, iter: i64, overflow: bool) {
        if self.config.static_scale.is_some() {
            if overflow {
                self.last_overflow = iter;
                self.skipped += 1;
            }
            return;
        }
        if overflow {
            if self.hysteresis <= 1 {
                self.scale = (self.scale / 2.0).max(self.config.min_loss_scale);
            } else {
                self.hysteresis -= 1;
            }
            self.last_overflow = iter;
            self.skipped += 1;
        } else if (iter - self.last_overflow) % self.config.loss_scale_window as i64 == 0 {
            self.hysteresis = self.config.hysteresis;
            self.scale *= 2.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// How many of the pages wholly inside `v` are resident (`mincore`).
    fn resident_pages(v: &[f32]) -> (usize, usize) {
        let page = 4096;
        let start = (v.as_ptr() as usize).next_multiple_of(page);
        let end = (v.as_ptr() as usize + std::mem::size_of_val(v)) / page * page;
        let pages = (end - start) / page;
        let mut flags = vec![0u8; pages];
        // SAFETY: `start..end` lies inside `v`'s allocation, page-aligned;
        // `flags` holds a byte a page.
        let rc =
            unsafe { libc::mincore(start as *mut libc::c_void, end - start, flags.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        (flags.iter().filter(|&&f| f & 1 == 1).count(), pages)
    }

    /// The pages of [`resident_zeros_in`] are there once made, before anything reads them (a
    /// buffer merely allocated zeroed is not: the control, without which
    /// the test could not fail), and hold zeros.
    #[test]
    fn resident_zeros_are_there_before_the_first_read() {
        let n = 4 << 20;
        let mapped = vec![0f32; n];
        let (resident, pages) = resident_pages(&mapped);
        if resident == pages {
            println!("skipped: this allocator hands out zeroed memory already resident");
            return;
        }
        let written = resident_zeros_in::<f32>(n, std::slice::from_ref(&(0..n)));
        assert_eq!(resident_pages(&written), (pages, pages));
        assert!(written.iter().all(|&x| x.to_bits() == 0));
        assert!(mapped.iter().all(|&x| x.to_bits() == 0));
        // Only the pages of the runs: two runs of 10 and 3 pages' elements
        // touch 10-11 and 3-4 pages (by where the buffer starts in a page;
        // the partial pages at its ends are not counted).
        let a_page = 1024;
        let runs = [a_page / 2..a_page * 21 / 2, n - 3 * a_page - 7..n - 7];
        let some = resident_zeros_in::<f32>(n, &runs);
        let (resident, all) = resident_pages(&some);
        assert!(
            (13..=15).contains(&resident) && all == pages,
            "{resident} of {all} pages"
        );
        // Runs past the end (a buffer left empty) store nothing.
        assert!(resident_zeros_in::<f32>(0, &runs).is_empty());
        assert_eq!(
            resident_zeros_in::<f32>(8, std::slice::from_ref(&(4..20))),
            vec![0.0; 8]
        );
        assert!(some.iter().all(|&x| x.to_bits() == 0));
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one.
        assert_eq!(Half::Bf16.widen(Half::Bf16.round(1.0 + 1.0 / 256.0)), 1.0);
        assert_eq!(
            Half::Bf16.widen(Half::Bf16.round(1.0 + 3.0 / 256.0)),
            1.0 + 4.0 / 256.0
        );
        assert!(Half::F16.widen(Half::F16.round(70000.0)).is_infinite());
        assert_eq!(Half::F16.widen(Half::F16.round(65504.0)), 65504.0);
    }

    #[test]
    fn bf16_rounding_matches_the_half_crate_everywhere() {
        let mut specials = vec![
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xffc1_2345),
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            1.0 + 1.0 / 256.0,
        ];
        let mut x = 0x1234_5678u32;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            specials.push(f32::from_bits(x));
        }
        let mut slice = vec![0u16; specials.len()];
        Half::Bf16.round_slice(&specials, &mut slice);
        for (v, s) in specials.iter().zip(&slice) {
            assert_eq!(*s, bf16::from_f32(*v).to_bits(), "{v:e}");
            assert_eq!(Half::Bf16.round(*v), *s, "{v:e}");
        }
        let mut f16s = vec![0u16; specials.len()];
        Half::F16.round_slice(&specials, &mut f16s);
        let mut back = vec![0f32; specials.len()];
        Half::F16.widen_slice(&f16s, &mut back);
        for ((v, s), w) in specials.iter().zip(&f16s).zip(&back) {
            assert_eq!(*s, f16::from_f32(*v).to_bits(), "{v:e}");
            assert_eq!(w.to_bits(), f16::from_bits(*s).to_f32().to_bits());
        }
    }

    /// A buffer made from its parts is the zeroed buffer with each part
    /// added, bit for bit (`-0.0` becomes `+0.0`, NaN and infinities pass),
    /// with gaps before, between and after the parts, a part that crosses
    /// tasks, a part inside one task, parts in a task of their own and an
    /// empty one, at 1 and 3 threads; parts out of order, overlapping or
    /// running past the end are refused.
    #[test]
    fn a_buffer_made_from_its_parts_is_the_zeroed_buffer_with_them_added() {
        let n = 3 * TASK + 77;
        let values = |len: usize, salt: usize| -> Vec<f32> {
            (0..len)
                .map(|i| match (i + salt) % 97 {
                    0 => -0.0,
                    1 => f32::NAN,
                    2 => f32::NEG_INFINITY,
                    3 => 1e-41,
                    k => (k as f32 - 48.0) * 0.013 * 10f32.powi((i % 5) as i32 - 2),
                })
                .collect()
        };
        let (a, b, c, d) = (
            values(TASK + 300, 1),
            values(50, 2),
            values(0, 3),
            values(TASK - 10, 4),
        );
        let parts: Vec<(usize, &[f32])> = vec![
            (5, &a),
            (TASK + 400, &b),
            (TASK + 460, &c),
            (2 * TASK + 3, &d),
        ];
        for kind in [None, Some(Half::Bf16), Some(Half::F16)] {
            let mut want = Flat::zeros(kind, n);
            for (at, v) in &parts {
                want.add_f32(*at, v);
            }
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let got = pool.install(|| Flat::with_parts(kind, n, &parts)).unwrap();
                let bits = |f: &Flat| -> Vec<u32> {
                    match f {
                        Flat::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
                        Flat::Half(_, v) => v.iter().map(|&x| u32::from(x)).collect(),
                    }
                };
                assert_eq!(got.kind(), kind);
                assert!(bits(&got) == bits(&want), "{kind:?}, {threads} threads");
                // Over a buffer that holds a step's gradients already.
                let mut old = Flat::from_f32(kind, &values(n, 5));
                assert!(pool.install(|| old.set_parts_over(std::slice::from_ref(&(0..n)), &parts)));
                assert!(
                    bits(&old) == bits(&want),
                    "set, {kind:?}, {threads} threads"
                );
                // Within runs that leave out `b` and what lies around it:
                // outside them the old bits stay, and `b` is not written.
                let runs = [0..TASK + 310, 2 * TASK..n];
                let before = Flat::from_f32(kind, &values(n, 7));
                let mut some = before.clone();
                assert!(pool.install(|| some.set_parts_over(&runs, &parts)));
                let (got, old_bits, all) = (bits(&some), bits(&before), bits(&want));
                for i in 0..n {
                    let inside = runs.iter().any(|r| r.contains(&i));
                    let expected = if inside { all[i] } else { old_bits[i] };
                    assert_eq!(got[i], expected, "element {i}, {kind:?}");
                }
            }
        }
        let refused = |parts: &[(usize, &[f32])]| Flat::with_parts(None, n, parts).is_none();
        assert!(refused(&[(TASK + 400, &b), (5, &a)]), "out of order");
        assert!(refused(&[(5, &a), (TASK + 304, &b)]), "overlapping");
        assert!(refused(&[(n - 10, &b)]), "past the end");
        assert!(!refused(&[(5, &a), (TASK + 305, &b), (n - 50, &b)]));
        let kept_values = values(n, 6);
        let mut kept = Flat::F32(kept_values.clone());
        assert!(!kept.set_parts_over(std::slice::from_ref(&(0..n)), &[(TASK + 400, &b), (5, &a)]));
        let Flat::F32(after) = kept else {
            unreachable!("an f32 buffer stays one")
        };
        let same = after
            .iter()
            .zip(&kept_values)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "a refused set writes nothing");
    }

    #[test]
    fn words_round_trip_bits() {
        let values: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.37).collect();
        for kind in [None, Some(Half::Bf16), Some(Half::F16)] {
            let mut f = Flat::from_f32(kind, &values);
            f.set_f32(3, &[f32::INFINITY, -0.0]);
            let back = Flat::from_words(kind, f.words(0..32));
            assert_eq!(back, f);
            assert_eq!(Flat::words_for(kind, 32), f.words(0..32).len());
            // The layout on the wire: two 16-bit elements a word, the first
            // in the low half, from any element (an odd one too, whose
            // halves do not start on a word in memory).
            if let Flat::Half(_, halves) = &f {
                for start in [0, 1, 4] {
                    let want: Vec<u32> = halves[start..start + 10]
                        .chunks_exact(2)
                        .map(|p| u32::from(p[0]) | (u32::from(p[1]) << 16))
                        .collect();
                    let got: Vec<u32> = f
                        .words(start..start + 10)
                        .iter()
                        .map(|w| w.to_bits())
                        .collect();
                    assert_eq!(got, want, "{kind:?} from element {start}");
                    let words: Vec<f32> = want.iter().map(|&b| f32::from_bits(b)).collect();
                    assert_eq!(
                        Flat::from_words(kind, words),
                        Flat::Half(kind.expect("half"), halves[start..start + 10].to_vec())
                    );
                }
            }
        }
    }

    /// The whole-buffer passes spread over the pool give, at 1 and 3
    /// threads, each element's own arithmetic (copy, widen, add then round,
    /// scale, zero) and a squared norm whose bits are the tasks' sums added in order,
    /// over several tasks and a partial one, from an offset (two groups of
    /// sums run side by side, then a group with one whole task and a part).
    #[test]
    fn parallel_passes_are_element_wise_and_thread_count_free() {
        let n = (2 * SUMS_AT_ONCE + 1) * TASK + 123;
        let at = 5;
        // Magnitudes over six decades, so that the order of a sum shows in its bits.
        let x: Vec<f32> = (0..n)
            .map(|i| (i as f32 * 0.7311).sin() * 10f32.powi((i % 7) as i32 - 3))
            .collect();
        let y: Vec<f32> = (0..n)
            .map(|i| ((i * 11 % 13) as f32 - 6.0) / 64.0)
            .collect();
        for kind in [None, Some(Half::Bf16), Some(Half::F16)] {
            let base = |f: &mut Flat| f.set_f32(at, &x);
            let mut norms = Vec::new();
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    let mut f = Flat::zeros(kind, n + at);
                    base(&mut f);
                    let stored = f.to_f32(at..at + n);
                    let want: Vec<f32> = x
                        .iter()
                        .map(|&v| kind.map_or(v, |h| h.widen(h.round(v))))
                        .collect();
                    assert!(stored
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()));
                    f.add_f32(at, &y);
                    let sums = f.to_f32(at..at + n);
                    let want: Vec<f32> = want
                        .iter()
                        .zip(&y)
                        .map(|(&a, &b)| kind.map_or(a + b, |h| h.widen(h.round(a + b))))
                        .collect();
                    assert!(sums
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()));
                    let norm = f.sum_sq(at..at + n, 0.5);
                    let by_task: f64 = want
                        .chunks(TASK)
                        .map(|c| sum_sq8(c, 0.5, |v| v))
                        .collect::<Vec<f64>>()
                        .iter()
                        .sum();
                    assert_eq!(norm.to_bits(), by_task.to_bits(), "{kind:?} {threads}");
                    norms.push(norm);
                    f.scale_f32(at..at + n, 0.25);
                    if kind.is_none() {
                        let scaled = f.to_f32(at..at + n);
                        assert!(scaled.iter().zip(&want).all(|(a, b)| *a == b * 0.25));
                    }
                    f.fill_zero_runs(&[0..at, at + 7..n + at]);
                    let zeroed = f.to_f32(0..n + at);
                    assert!(zeroed.iter().enumerate().all(|(i, v)| {
                        let kept = (at..at + 7).contains(&i);
                        kept || v.to_bits() == 0
                    }));
                    assert!(zeroed[at..at + 7].iter().any(|v| v.to_bits() != 0));
                });
            }
            assert_eq!(norms[0].to_bits(), norms[1].to_bits(), "{kind:?}");
        }
    }

    #[test]
    fn add_rounds_once_per_add() {
        let mut f = Flat::zeros(Some(Half::Bf16), 2);
        f.add_f32(0, &[1.0, 3.0]);
        f.add_f32(0, &[1.0 / 512.0, 1.0]);
        assert_eq!(f.to_f32(0..2), vec![1.0, 4.0]);
    }

    #[test]
    fn loss_scaler_follows_deepspeed() {
        let defaults = LossScaleSpec::default();
        let mut s = LossScaler::new(&defaults);
        assert_eq!((s.scale, s.hysteresis), (65536.0, 2));
        // First overflow spends hysteresis, the second halves.
        s.update(0, true);
        assert_eq!((s.scale, s.hysteresis), (65536.0, 1));
        s.update(1, true);
        assert_eq!((s.scale, s.hysteresis, s.skipped), (32768.0, 1, 2));
        // 1000 clean iterations after the last overflow double it again.
        for it in 2..1001 {
            s.update(it, false);
        }
        assert_eq!(s.scale, 32768.0);
        s.update(1001, false);
        assert_eq!((s.scale, s.hysteresis), (65536.0, 2));
        // Without any overflow, iteration 999 is the first doubling.
        let mut s = LossScaler::new(&defaults);
        for it in 0..999 {
            s.update(it, false);
        }
        assert_eq!(s.scale, 65536.0);
        s.update(999, false);
        assert_eq!(s.scale, 131072.0);
        // Never below the minimum, and the engine is told when it is stuck there.
        let mut s = LossScaler::new(&LossScaleSpec {
            initial_scale_power: 1,
            hysteresis: 1,
            ..defaults
        });
        assert!(!s.at_minimum());
        s.update(5, true);
        s.update(6, true);
        assert_eq!(s.scale, 1.0);
        assert!(s.at_minimum());
        // A static scale: overflows counted, the scale never moving, never
        // at a minimum that fails the step (1 is DeepSpeed's `loss_scale: 1`,
        // no scaling, at the dynamic minimum).
        for fixed in [128.0, 1.0] {
            let mut s = LossScaler::new(&LossScaleSpec {
                static_scale: Some(fixed),
                hysteresis: 1,
                ..defaults.clone()
            });
            for it in 0..2000 {
                assert!(!s.at_minimum(), "{fixed}");
                s.update(it, it % 3 == 0);
                assert_eq!(s.scale, fixed);
            }
            assert_eq!((s.skipped, s.last_overflow), (667, 1998));
        }
    }
}
