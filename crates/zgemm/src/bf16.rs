//! bf16 products with f32 accumulation: `C = start ⊕ α·bf16(A)·bf16(B)`, the
//! GEMM of mixed-precision training (PyTorch's autocast rounds a matmul's
//! inputs to bf16 the same way and accumulates in f32).
//!
//! The operands stay f32 in memory and are rounded to bf16 (to nearest even)
//! in one pass that lays them out as AMX's `tdpbf16ps` and AVX512_BF16's
//! `vdpbf16ps` read them: each 4-byte element a pair of bf16 values adjacent
//! in `k`. `A` becomes a row-major `m × ⌈k/2⌉` matrix of pairs (read in
//! place) and `B` a `⌈k/2⌉ × n` one, and the f32 driver multiplies them
//! with a kernel that takes each element for a pair: its blocking, threads
//! and epilogues (bias, residual) are the f32 product's. A weight that is already bf16 (the working copy of
//! `train.dtype: bf16`) is rounded exactly.
//!
//! **Results.** The AVX512_BF16 kernel adds each pair odd value first, as
//! Intel's manual defines `vdpbf16ps`; the portable kernel does that
//! arithmetic in plain Rust and is tested against it bit for bit. AMX sums
//! inside a tile in an order of its own, so its results are tested against
//! an f64 product of the rounded operands within the f32 rounding bound,
//! and against themselves at every thread count (bit for bit: threads split
//! only `M` and `N`). On a CPU with neither, the portable kernel is the only
//! one, and slow: callers check [`has_native_bf16`] and multiply in f32
//! there.

use std::cell::RefCell;

use rayon::prelude::*;

use crate::{aligned, drive, Kernel, MatMut, MatRef, SendPtr, ShapeError, Start};

// Pairs are written as 16-bit halves where the even value is the low half.
#[cfg(target_endian = "big")]
compile_error!("zgemm's bf16 pairs assume a little-endian CPU");

/// Whether this CPU multiplies bf16 faster than f32: AMX-BF16 (AVX512_BF16
/// alone does not: on the Sapphire Rapids measured, `vdpbf16ps` retires one
/// every two cycles, half `vfmadd231ps`'s FLOPs).
pub fn has_native_bf16() -> bool {
    Kernel::best_bf16() == Kernel::AmxBf16
}

/// `C = start ⊕ α·bf16(A)·bf16(B)` with the fastest bf16 kernel, on up to
/// `threads` threads of the current rayon pool.
pub fn gemm_bf16(
    c: MatMut,
    a: MatRef,
    b: MatRef,
    alpha: f32,
    start: Start,
    threads: usize,
) -> Result<(), ShapeError> {
    gemm_bf16_with(Kernel::best_bf16(), c, a, b, alpha, start, threads)
}

/// [`gemm_bf16`] with a given bf16 kernel (tests and benchmarks compare them).
///
/// # Panics
///
/// If `kernel` is not in [`Kernel::available_bf16`].
pub fn gemm_bf16_with(
    kernel: Kernel,
    c: MatMut,
    a: MatRef,
    b: MatRef,
    alpha: f32,
    start: Start,
    threads: usize,
) -> Result<(), ShapeError> {
    assert!(
        Kernel::detected_bf16().contains(&kernel),
        "{kernel:?} is not a bf16 kernel this CPU can run"
    );
    if a.rows != c.rows || a.cols != b.rows || b.cols != c.cols {
        return Err(ShapeError::Mismatch {
            c_rows: c.rows,
            c_cols: c.cols,
            a_rows: a.rows,
            a_cols: a.cols,
            b_rows: b.rows,
            b_cols: b.cols,
        });
    }
    // Taken, not borrowed: rayon may run another product on this thread
    // while it waits.
    let (mut pa, mut pb) = (PAIRS_A.take(), PAIRS_B.take());
    let result = {
        let a2 = pair_columns(a, &mut pa, threads);
        let b2 = pair_rows(b, &mut pb, threads);
        drive(kernel, c, a2, b2, alpha, start, threads)
    };
    PAIRS_A.set(pa);
    PAIRS_B.set(pb);
    result
}

thread_local! {
    /// The calling thread's paired operands, reused from call to call.
    static PAIRS_A: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static PAIRS_B: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// bf16 bits of `x`, rounded to nearest even, NaN kept a quiet NaN (as
/// `half::bf16::from_f32`); branch-free, so that the loops vectorise.
#[inline(always)]
pub(crate) fn round(x: f32) -> u32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    if x.is_nan() {
        (b >> 16) | 0x40
    } else {
        rounded
    }
}

/// Two values as one pair element: `lo` is the one of even `k`.
#[inline(always)]
fn pair(lo: f32, hi: f32) -> f32 {
    f32::from_bits(round(lo) | (round(hi) << 16))
}

/// `x` (`r × k`) as a row-major `r × kp` matrix of pairs along its rows,
/// written into `buf`: `kp` is `⌈k/2⌉` rounded up to a multiple of 16 and
/// the rows to a multiple of 32, the padding zero (AMX's kernel reads
/// 16 pairs of 32 whole rows at a time; zero pairs add `+0`, which every
/// kernel does alike). Each task fills a run of output rows, reading along
/// `x`'s rows where they are contiguous and along its columns where those
/// are.
fn pair_columns<'b>(x: MatRef, buf: &'b mut Vec<f32>, threads: usize) -> MatRef<'b> {
    let (r, k) = (x.rows, x.cols);
    let kp = k.div_ceil(2).div_ceil(16) * 16;
    let rows = r.div_ceil(32) * 32;
    // Rows 16 pairs longer than they need be: at a multiple of 4 KiB apart,
    // the 16 rows of an AMX tile load shared one L1 set (measured: k = 2048
    // ran at half the rate of k = 384).
    let stride = kp + 16;
    let out = aligned(buf, rows * stride);
    if x.rs == 1 && x.cs != 1 {
        pair_transposed(x, out, stride, kp, threads);
    } else {
        // A pair is two values adjacent in a row: an output row is the
        // input row rounded, value by value, as 16-bit halves (the even
        // value in the low half: little-endian).
        let rows_per_task = (16 * 1024 / stride).max(1);
        let fill = |(t, dst): (usize, &mut [f32])| {
            for (l, row) in dst.chunks_exact_mut(stride).enumerate() {
                let i = t * rows_per_task + l;
                // SAFETY: 2·kp halves are the row's first kp floats
                // (u16 needs less alignment than f32).
                let halves = unsafe {
                    std::slice::from_raw_parts_mut(row.as_mut_ptr().cast::<u16>(), 2 * kp)
                };
                if i < r && x.cs == 1 {
                    round_into(&x.data[i * x.rs..][..k], &mut halves[..k]);
                    halves[k..].fill(0);
                } else if i < r {
                    for (p, h) in halves.iter_mut().enumerate() {
                        *h = if p < k { round(x.at(i, p)) as u16 } else { 0 };
                    }
                } else {
                    halves.fill(0);
                }
            }
        };
        if threads > 1 {
            out.par_chunks_mut(rows_per_task * stride)
                .enumerate()
                .for_each(fill);
        } else {
            out.chunks_mut(rows_per_task * stride)
                .enumerate()
                .for_each(fill);
        }
    }
    MatRef {
        data: out,
        rows: r,
        cols: kp,
        rs: stride,
        cs: 1,
    }
}

/// [`pair_columns`] of an `x` whose columns are contiguous (`xᵀ` in a weight
/// gradient), into `out` (whole padded rows of `stride`): each task takes 16
/// pairs of columns, that is 32 contiguous runs of memory, and writes a
/// 64-byte block of every output row. Tasks over runs of output rows
/// instead re-read every row of `x` for each run, twice the bytes of `x`
/// from L3 (measured: a fifth of a bf16 training step).
fn pair_transposed(x: MatRef, out: &mut [f32], stride: usize, kp: usize, threads: usize) {
    let (r, k) = (x.rows, x.cols);
    let rows = out.len() / stride;
    let at = SendPtr(out.as_mut_ptr());
    let block = |b: usize| {
        for q in b * 16..(b + 1) * 16 {
            let column = |p: usize| (p < k).then(|| &x.data[p * x.cs..][..r]);
            let (c0, c1) = (column(2 * q), column(2 * q + 1));
            let mut done = 0;
            #[cfg(target_arch = "x86_64")]
            if let (Some(c0), true) = (c0, has_avx512bw()) {
                // SAFETY: AVX-512F/BW present; rows below r·16/16 of
                // column q are inside `out` and this task's alone.
                done = unsafe { x86::pair_column(c0, c1, at.get().add(q), stride) };
            }
            for i in done..rows {
                let v = |c: Option<&[f32]>| c.and_then(|c| c.get(i).copied()).unwrap_or(0.0);
                // SAFETY: row i < rows, pair q < kp ≤ stride: inside
                // `out`, and this task alone writes pairs b·16..b·16+16.
                unsafe { at.get().add(i * stride + q).write(pair(v(c0), v(c1))) };
            }
        }
    };
    if threads > 1 {
        (0..kp / 16).into_par_iter().for_each(block);
    } else {
        (0..kp / 16).for_each(block);
    }
}

/// `B` (`k × n`) as a `kp × n` matrix of pairs along its columns (`kp` as
/// in [`pair_columns`], the padding zero), for the driver to pack into
/// panels: a row-major `B` gives row-major pairs, row `q` two rows of `B`
/// interleaved (a weight in forward, `dy` in a weight gradient; read and
/// written along memory); any other `B` goes through [`pair_columns`] of its
/// transpose.
fn pair_rows<'b>(b: MatRef, buf: &'b mut Vec<f32>, threads: usize) -> MatRef<'b> {
    if b.cs != 1 || b.cols == 1 {
        return pair_columns(b.t(), buf, threads).t();
    }
    let (k, n) = (b.rows, b.cols);
    let kp = k.div_ceil(2).div_ceil(16) * 16;
    let out = aligned(buf, kp * n);
    let rows_per_task = (16 * 1024 / n.max(1)).max(1);
    let fill = |(t, dst): (usize, &mut [f32])| {
        for (l, row) in dst.chunks_exact_mut(n.max(1)).enumerate() {
            let q = t * rows_per_task + l;
            let row_of = |p: usize| (p < k).then(|| &b.data[p * b.rs..][..n]);
            match row_of(2 * q) {
                Some(r0) => pair_into(r0, row_of(2 * q + 1), row),
                None => row.fill(0.0),
            }
        }
    };
    if threads > 1 {
        out.par_chunks_mut(rows_per_task * n.max(1))
            .enumerate()
            .for_each(fill);
    } else {
        out.chunks_mut(rows_per_task * n.max(1))
            .enumerate()
            .for_each(fill);
    }
    MatRef {
        data: out,
        rows: kp,
        cols: n,
        rs: n,
        cs: 1,
    }
}

/// `dst[j]` = the bf16 bits of `src[j]` ([`round`]), 16 at a time with
/// AVX-512 where the CPU has it.
pub(crate) fn round_into(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512bw() {
        // SAFETY: the CPU has AVX-512F and BW.
        return unsafe { x86::round_into(src, dst) };
    }
    for (h, &v) in dst.iter_mut().zip(src) {
        *h = round(v) as u16;
    }
}

/// `dst[i]` = the pair of `c0[i]` and `c1[i]` (zero without `c1`).
fn pair_into(c0: &[f32], c1: Option<&[f32]>, dst: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx512bw() {
        let n = dst.len().min(c0.len()) / 16 * 16;
        // SAFETY: AVX-512F/BW present; rows below n of dst (stride 1) are
        // inside it, and c0, c1 hold n values (same length as c0).
        done = unsafe { x86::pair_column(&c0[..n], c1.map(|c| &c[..n]), dst.as_mut_ptr(), 1) };
    }
    for (i, d) in dst.iter_mut().enumerate().skip(done) {
        *d = pair(c0[i], c1.map_or(0.0, |c| c[i]));
    }
}

/// Whether the CPU has AVX-512F and BW, detected once.
#[cfg(target_arch = "x86_64")]
fn has_avx512bw() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| std::arch::is_x86_feature_detected!("avx512bw"))
}

/// The rounding loops in AVX-512: the baseline build of them ran four
/// floats at a time and was a fifth of a bf16 training step.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::round;

    /// [`round`] of 16 floats, each result in the low half of its lane.
    #[target_feature(enable = "avx512f")]
    fn round16(v: __m512) -> __m512i {
        let b = _mm512_castps_si512(v);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb);
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
        let quiet_nan = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        _mm512_mask_blend_epi32(nan, rounded, quiet_nan)
    }

    /// [`super::round_into`].
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn round_into(src: &[f32], dst: &mut [u16]) {
        let n = src.len().min(dst.len());
        let whole = n / 16 * 16;
        for j in (0..whole).step_by(16) {
            // SAFETY: j + 16 ≤ n, inside both slices.
            unsafe {
                let r = round16(_mm512_loadu_ps(src.as_ptr().add(j)));
                _mm256_storeu_si256(dst.as_mut_ptr().add(j).cast(), _mm512_cvtepi32_epi16(r));
            }
        }
        for j in whole..n {
            dst[j] = round(src[j]) as u16;
        }
    }

    /// Pairs `c0[i]` with `c1[i]` (zero without `c1`) into `out[i·stride]`
    /// for the rows `i` below `c0.len()` rounded down to 16; returns how
    /// many.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F and BW; `c1` is as long as `c0`, and
    /// `out[i·stride]` is writable for those rows.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn pair_column(
        c0: &[f32],
        c1: Option<&[f32]>,
        out: *mut f32,
        stride: usize,
    ) -> usize {
        let whole = c0.len() / 16 * 16;
        let mut pairs = [0u32; 16];
        for i in (0..whole).step_by(16) {
            // SAFETY: i + 16 ≤ whole ≤ the columns' length; the stores go to
            // rows i..i+16 of column q (caller).
            unsafe {
                let lo = round16(_mm512_loadu_ps(c0.as_ptr().add(i)));
                let hi = match c1 {
                    Some(c1) => round16(_mm512_loadu_ps(c1.as_ptr().add(i))),
                    None => _mm512_setzero_si512(),
                };
                let p = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
                if stride == 1 {
                    _mm512_storeu_si512(out.add(i).cast(), p);
                } else {
                    _mm512_storeu_si512(pairs.as_mut_ptr().cast(), p);
                    for (l, &v) in pairs.iter().enumerate() {
                        out.add((i + l) * stride).write(f32::from_bits(v));
                    }
                }
            }
        }
        whole
    }
}
