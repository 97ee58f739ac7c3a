//! One row of `A` times `B`: generation's products (`zrun sample` runs
//! each new token through the model as one row).
//!
//! A one-row product reads every element of `B` once and does one
//! multiply-add with it, so it is bound by the bytes of `B`, not by FLOPs.
//! The blocked path packs `B` into panels first, which for one row triples
//! the traffic (read `B`, write the panels, read them again) and left the
//! kernels a tile of one live row: on a GPT-2-small shape, packing was half
//! of a generated token's time. Here `B` streams once, with the threads on
//! ranges of columns: a row-major `B` (the blocks' linears) four rows at a
//! time into `C`'s row held in L1/L2; a transposed one (a tied head's
//! `x·wteᵀ`, whose columns are stored rows) eight columns at a time, their
//! values transposed in registers so that one vector multiply-add takes
//! eight columns' terms.
//!
//! `B` may be stored as bf16 bits ([`crate::gemm_widening_b`]: a
//! model's weights kept as published, for generation), each value widened
//! exactly as it is loaded: half the bytes to stream, and the bits of the
//! same product on the widened `B`.
//!
//! The bits are the blocked path's: at α = 1 each element of `C` is one
//! fused multiply-add chain over the depth in order, from `C`, the bias or
//! zero, with the residual added after, as every kernel computes it
//! (tested against the blocked path's row of a two-row product, bit for
//! bit). Other α (whose blocks start from zero) keep the blocked path.

use rayon::prelude::*;

use crate::{Finish, FinishedTile, MatMut, MatRef};

/// Rows of `B` applied to `C`'s row per pass: four loads of `C` and stores
/// fewer than one a row, and four streams of `B` for the prefetchers.
const ROWS: usize = 4;

/// Columns a thread's range is a multiple of (two AVX-512 vectors).
const COLUMN_STEP: usize = 32;

/// What `C`'s row starts from and ends with.
pub(crate) struct Ends<'b> {
    /// `C`'s own values (`Start::Keep`).
    pub add: bool,
    /// The bias.
    pub bias: Option<&'b [f32]>,
    /// Added after the chain.
    pub residual: Option<MatRef<'b>>,
}

/// An element of `B` as [`row_times`] reads it: an f32 value, or a bf16
/// value's bits, widened exactly.
pub(crate) trait BValue: Copy + Send + Sync {
    /// The value.
    fn value(self) -> f32;

    /// The eight values from `p`.
    ///
    /// # Safety
    ///
    /// Eight values from `p` are readable; the CPU has AVX2 (the callers'
    /// `target_feature`, into which this inlines).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl BValue for f32 {
    #[inline(always)]
    fn value(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl BValue for u16 {
    #[inline(always)]
    fn value(self) -> f32 {
        f32::from_bits(u32::from(self) << 16)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's: 16 bytes from p, AVX2.
        unsafe {
            let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(halves))
        }
    }
}

/// `C[0, ·] = ends ⊕ A[0, ·]·B` on up to `threads` threads; then `finish`
/// on the row. `c` is one row, `b` has `c`'s columns and `a`'s columns as
/// its rows, and adjacent columns or adjacent rows.
pub(crate) fn row_times<T: BValue>(
    simd: bool,
    c: &MatMut,
    a: &MatRef,
    b: &MatRef<T>,
    ends: &Ends,
    threads: usize,
    finish: Option<&Finish>,
) {
    let n = c.cols;
    let per_task = n.div_ceil(threads.max(1)).next_multiple_of(COLUMN_STEP);
    let (c_ptr, rs) = (SendPtr(c.ptr), c.rs);
    let run = |j0: usize| {
        let j1 = (j0 + per_task).min(n);
        // Each task writes its own columns j0..j1 of C's one row, which
        // MatMut's constructors checked lie in C.
        let first = c_ptr.get().wrapping_add(j0);
        if !ends.add {
            // C may be uninitialised: written before it is read.
            for j in j0..j1 {
                let v = ends.bias.map_or(0.0, |bias| bias[j]);
                // SAFETY: column j of C's row (above).
                unsafe { first.add(j - j0).write(v) };
            }
        }
        // SAFETY: the columns are initialised now (kept C is, per `begin`),
        // and no other task touches them.
        let out = unsafe { std::slice::from_raw_parts_mut(first, j1 - j0) };
        if b.cs == 1 || b.cols == 1 {
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: `simd` is asked for only with an AVX2+FMA kernel.
                unsafe { chain_avx2(out, a, b, j0) };
            } else {
                chain(out, a, b, j0);
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                let _ = simd;
                chain(out, a, b, j0);
            }
        } else {
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: as above.
                unsafe { chain_columns_avx2(out, a, b, j0) };
            } else {
                chain_columns(out, a, b, j0);
            }
            #[cfg(not(target_arch = "x86_64"))]
            chain_columns(out, a, b, j0);
        }
        if let Some(r) = &ends.residual {
            for (j, o) in out.iter_mut().enumerate() {
                *o += r.data[(j0 + j) * r.cs];
            }
        }
        if let Some(finish) = finish {
            finish(FinishedTile {
                row0: 0,
                col0: j0,
                rows: 1,
                cols: j1 - j0,
                ptr: out.as_mut_ptr(),
                rs,
            });
        }
    };
    let starts = (0..n).step_by(per_task);
    if threads > 1 && n > per_task {
        starts.collect::<Vec<_>>().into_par_iter().for_each(run);
    } else {
        starts.for_each(run);
    }
}

/// `out[j] = fma(a[p], b[p][j0 + j], out[j])` for every `p` in order.
#[inline(always)]
fn chain<T: BValue>(out: &mut [f32], a: &MatRef, b: &MatRef<T>, j0: usize) {
    let (k, len) = (a.cols, out.len());
    let row = |p: usize| &b.data[p * b.rs + j0..][..len];
    let ap = |p: usize| a.data[p * a.cs];
    let mut p = 0;
    while p + ROWS <= k {
        let (b0, b1, b2, b3) = (row(p), row(p + 1), row(p + 2), row(p + 3));
        let (a0, a1, a2, a3) = (ap(p), ap(p + 1), ap(p + 2), ap(p + 3));
        for (j, o) in out.iter_mut().enumerate() {
            let mut v = *o;
            v = a0.mul_add(b0[j].value(), v);
            v = a1.mul_add(b1[j].value(), v);
            v = a2.mul_add(b2[j].value(), v);
            v = a3.mul_add(b3[j].value(), v);
            *o = v;
        }
        p += ROWS;
    }
    for p in p..k {
        let (bp, a0) = (row(p), ap(p));
        for (o, &x) in out.iter_mut().zip(bp) {
            *o = a0.mul_add(x.value(), *o);
        }
    }
}

/// [`chain`] compiled for AVX2 and FMA, where `mul_add` is one
/// instruction and the loop over `j` takes eight columns a step.
///
/// # Safety
///
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chain_avx2<T: BValue>(out: &mut [f32], a: &MatRef, b: &MatRef<T>, j0: usize) {
    chain(out, a, b, j0);
}

/// [`chain`] for a `B` whose columns are contiguous (`Bᵀ` row-major: a
/// tied head's `x·wteᵀ`): each element of `C` a dot product along one
/// stored row, [`COLUMNS`] of them side by side so that their chains
/// overlap (one chain waits on its last multiply-add; eight keep the FMA
/// units busy, and eight streams of `B` feed them).
#[inline(always)]
fn chain_columns<T: BValue>(out: &mut [f32], a: &MatRef, b: &MatRef<T>, j0: usize) {
    let k = a.cols;
    let column = |j: usize| &b.data[j * b.cs..][..k];
    let a: Vec<f32> = (0..k).map(|p| a.data[p * a.cs]).collect();
    let mut groups = out.chunks_exact_mut(COLUMNS);
    let mut j = j0;
    for group in &mut groups {
        let cols: [&[T]; COLUMNS] = std::array::from_fn(|i| column(j + i));
        let mut acc: [f32; COLUMNS] = std::array::from_fn(|i| group[i]);
        for (p, &ap) in a.iter().enumerate() {
            for i in 0..COLUMNS {
                acc[i] = ap.mul_add(cols[i][p].value(), acc[i]);
            }
        }
        group.copy_from_slice(&acc);
        j += COLUMNS;
    }
    for o in groups.into_remainder() {
        let col = column(j);
        *o = a
            .iter()
            .zip(col)
            .fold(*o, |acc, (&ap, &x)| ap.mul_add(x.value(), acc));
        j += 1;
    }
}

/// Columns [`chain_columns`] runs side by side.
const COLUMNS: usize = 8;

/// [`chain_columns`] eight columns at a time in vectors: eight stored
/// columns' next eight values loaded as rows, transposed in registers, so
/// that each multiply-add takes eight columns' terms at one `p` in a
/// vector, one vector load for eight terms where the scalar chains take
/// one a term (which capped them at 23 GB/s on two threads, the tied
/// head's product, against the blocks' 32). Two such groups go side by
/// side: one group's vector is a chain of eight dependent multiply-adds a
/// step of `p`, whose latency (five cycles each on Zen 2) held a thread
/// near 16 GB/s; with two chains in flight the head's product went from
/// 25.5 to 28 GB/s on two threads. The same chains in the same order: the
/// same bits.
///
/// # Safety
///
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chain_columns_avx2<T: BValue>(out: &mut [f32], a: &MatRef, b: &MatRef<T>, j0: usize) {
    let k = a.cols;
    let av: Vec<f32> = (0..k).map(|p| a.data[p * a.cs]).collect();
    let mut pairs = out.chunks_exact_mut(16);
    let mut j = j0;
    for pair in &mut pairs {
        // SAFETY: AVX2 and FMA (caller).
        unsafe { column_groups::<T, 2>(pair, &av, b, j) };
        j += 16;
    }
    let mut groups = pairs.into_remainder().chunks_exact_mut(8);
    for group in &mut groups {
        // SAFETY: as above.
        unsafe { column_groups::<T, 1>(group, &av, b, j) };
        j += 8;
    }
    let a_rest = MatRef {
        data: &av,
        rows: 1,
        cols: k,
        rs: k,
        cs: 1,
    };
    chain_columns(groups.into_remainder(), &a_rest, b, j);
}

/// `out` (`G` groups of eight elements of `C`'s row, from column `j`)
/// plus `av`·`B[·, j..j + 8G]`, each element's chain over the depth in
/// order, `G` vector chains side by side.
///
/// # Safety
///
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn column_groups<T: BValue, const G: usize>(
    out: &mut [f32],
    av: &[f32],
    b: &MatRef<T>,
    j: usize,
) {
    use std::arch::x86_64::*;
    let k = av.len();
    let k8 = k / 8 * 8;
    let columns: [[&[T]; 8]; G] =
        std::array::from_fn(|g| std::array::from_fn(|i| &b.data[(j + 8 * g + i) * b.cs..][..k]));
    // SAFETY: out holds 8G elements; loads of eight values of each column
    // at p..p+8 ≤ k; AVX2 and FMA (caller).
    unsafe {
        let mut acc = [_mm256_setzero_ps(); G];
        for (g, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_loadu_ps(out.as_ptr().add(8 * g));
        }
        // No closures around the intrinsics: a closure is compiled without
        // the caller's target features, and each became a call.
        let mut rows = [[_mm256_setzero_ps(); 8]; G];
        for p in (0..k8).step_by(8) {
            for g in 0..G {
                let mut r = [_mm256_setzero_ps(); 8];
                for i in 0..8 {
                    r[i] = T::load8(columns[g][i].as_ptr().add(p));
                }
                rows[g] = crate::transpose8(r);
            }
            for q in 0..8 {
                let x = _mm256_set1_ps(av[p + q]);
                for g in 0..G {
                    acc[g] = _mm256_fmadd_ps(x, rows[g][q], acc[g]);
                }
            }
        }
        for (g, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * g), *acc);
        }
    }
    for (g, columns) in columns.iter().enumerate() {
        for (i, column) in columns.iter().enumerate() {
            let o = &mut out[8 * g + i];
            for p in k8..k {
                *o = av[p].mul_add(column[p].value(), *o);
            }
        }
    }
}

/// `C`'s pointer, shared by the tasks that write disjoint columns of it.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

// SAFETY: the tasks write disjoint columns (row_times).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}
