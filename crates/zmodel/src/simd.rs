//! What the fused CPU ops share: an `exp` and a reciprocal the compiler can
//! vectorise, running a loop with AVX-512 or AVX2 (with FMA) enabled where the
//! CPU has it, and splitting rows over rayon's threads in chunks that do not
//! depend on the thread count (so results are the same bits with 1 thread or
//! 16).
//!
//! Every parallel loop of the fused ops over chunks of many rows, and
//! attention's loop over heads, runs each chunk as a leaf of its own
//! (`with_max_len(1)`): rayon otherwise cuts a loop on two threads into four
//! leaves and runs a leaf whole once begun, so a thread that falls behind
//! (preempted, or its core slowed by a neighbour's) kept the other waiting
//! for up to a quarter of the loop. With zgemm's tasks cut the same way, one
//! worker × 2 threads trained 1.04-1.23x as fast on a Zen 3 EPYC (seven
//! alternated rounds, docs/PERFORMANCE.md). Rotary embeddings' chunks are
//! single rows, too small to be a leaf each, and keep rayon's leaves.
//!
//! libm's `expf` is a scalar call, and it was most of GELU's time: an element of
//! GELU cost about 6 ns. `exp` below is Cephes' `expf` (range reduction by ln 2,
//! a degree-6 polynomial, about 1 ulp) written with plain arithmetic, fused
//! multiply-adds and bit operations, which LLVM turns into 16-lane AVX-512 or
//! 8-lane AVX2 code. Rust never contracts `a * b + c` on its own; a fused
//! multiply-add is formed only where the code says `mul_add`, which rounds
//! once on every path (an instruction on AVX-512 and AVX2, libm's `fmaf` on
//! the baseline), so the AVX-512, AVX2 and baseline paths give the same bits.

use std::mem::MaybeUninit;

/// Rows per parallel task.
pub(crate) const ROWS_PER_TASK: usize = 16;

/// 1.5 · 2^23: adding it rounds an f32 of magnitude below 2^22 to an integer,
/// which then sits in the low mantissa bits.
const ROUNDER: f32 = 12_582_912.0;

/// e^x for x in about [-87, 88] (1 ulp); held to e^-87 below and e^88 above.
///
/// Every step that multiplies and adds is one fused multiply-add
/// (`mul_add`: one rounding, the same bits on every path).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x.mul_add(LOG2E, ROUNDER);
    let n = shifted - ROUNDER;
    let ni = (shifted.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let p = 1.987_569_1e-4f32.mul_add(r, 1.398_199_9e-3);
    let p = p.mul_add(r, 8.333_452e-3);
    let p = p.mul_add(r, 4.166_579_6e-2);
    let p = p.mul_add(r, 1.666_666_5e-1);
    let p = p.mul_add(r, 0.5);
    let poly = p.mul_add(r * r, r) + 1.0;
    poly * f32::from_bits(((ni + 127) << 23) as u32)
}

/// 1 / x for x in [1, 2^126], within 2 ulp, without a division.
///
/// A divide of 16 lanes occupies AVX-512's divider for about as long as
/// thirty other instructions, and GELU's and SiLU's sigmoids were bound by
/// it. Here a first guess from the exponent bits (within 1/8) is refined by
/// three Newton steps of two fused multiply-adds each (the error squares:
/// 2^-3, 2^-6, 2^-12, 2^-24), the same arithmetic on every path, so the
/// same bits; a reciprocal estimate instruction would differ between
/// AVX-512 and AVX2.
#[inline(always)]
pub(crate) fn recip(x: f32) -> f32 {
    let mut y = f32::from_bits(0x7ef3_11c3u32.wrapping_sub(x.to_bits()));
    for _ in 0..3 {
        y = y.mul_add((-x).mul_add(y, 1.0), y);
    }
    y
}

/// 1 / (1 + e^-x), the logistic sigmoid, for every finite x (e^-x is held to
/// e^80 so that its reciprocal stays a normal float: below x = -80 the
/// sigmoid is within 2^-115 of 0 either way); NaN stays NaN.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    // Not `f32::min`, which would turn NaN into 80.
    let z = if -x > 80.0 { 80.0 } else { -x };
    recip(1.0 + exp(z))
}

/// `v = e^(v − max)` for each value of `row`: a softmax's numerators, with
/// [`exp`]'s bits. Inside [`vectorised`]; on AVX2 and AVX-512, the
/// intrinsics of [`crate::lanes`], which keep several vectors' chains in
/// flight where the compiler's loop waited on one (`attention_bench`: see
/// `lanes`).
#[inline(always)]
pub(crate) fn exp_minus(row: &mut [f32], max: f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::lanes::exp_minus(row, max) {
        return;
    }
    row.iter_mut().for_each(|v| *v = exp(*v - max));
}

/// Runs `f` in a function compiled for AVX-512 (16 lanes) or AVX2 (8 lanes),
/// the widest this CPU has, else as is. Callers mark the closure
/// `#[inline(always)]`: only code inlined into these functions is compiled
/// for their features, and LLVM kept the larger kernels (layer norm's
/// backward, attention's softmax) out of line, as baseline SSE code, until
/// they were marked. The loops are plain arithmetic, with fused multiply-adds
/// only where written as `mul_add`, so every width gives the same bits
/// (tested). The engine's passes over flat buffers use it too.
#[inline(always)]
pub fn vectorised<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
        fn avx512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2,fma")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        match chosen_width() {
            // SAFETY: the CPU has these AVX-512 subsets and AVX2 (`widest_here`).
            Width::Avx512 => return unsafe { avx512(f) },
            // SAFETY: the CPU has AVX2 (`widest_here`).
            Width::Avx2 => return unsafe { avx2(f) },
            Width::Baseline => {}
        }
    }
    f()
}

/// The width [`vectorised`] runs at: this CPU's widest, or narrower where a
/// test caps it.
#[inline(always)]
pub(crate) fn chosen_width() -> Width {
    widest_here().min(widest_allowed())
}

/// The vector widths [`vectorised`] picks from, narrowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Width {
    Baseline = 0,
    Avx2 = 1,
    Avx512 = 2,
}

/// The widest path [`vectorised`] can take on this CPU.
#[inline(always)]
pub(crate) fn widest_here() -> Width {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512dq")
        {
            return Width::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Width::Avx2;
        }
    }
    Width::Baseline
}

/// Tests cap the width to run the narrower paths on a machine that has the
/// wider ones (the claim that all give the same bits is tested, not assumed).
#[cfg(test)]
pub(crate) static WIDEST: std::sync::atomic::AtomicU8 =
    std::sync::atomic::AtomicU8::new(Width::Avx512 as u8);

#[cfg(test)]
fn widest_allowed() -> Width {
    match WIDEST.load(std::sync::atomic::Ordering::SeqCst) {
        0 => Width::Baseline,
        1 => Width::Avx2,
        _ => Width::Avx512,
    }
}

#[cfg(not(test))]
#[inline(always)]
fn widest_allowed() -> Width {
    Width::Avx512
}

/// Counts this thread's calls to libm's `fmaf`, which `f32::mul_add` becomes
/// in code compiled without FMA: the baseline build of a fused op calls it
/// for every multiply-add, the AVX2 and AVX-512 builds never (the
/// instruction). A test runs the ops at each width and counts, so that an
/// op whose loop fell out of [`vectorised`]'s builds (as GELU's bf16
/// forward did, for two days, at 1/15 of its speed) fails a test instead of
/// only a benchmark. The test binary's own `fmaf` takes the place of the
/// runtime's for every caller in it; it is exact (the FMA instruction, or
/// musl's correction of a double-precision sum), as the one it replaces.
#[cfg(test)]
pub(crate) fn fmaf_calls() -> Option<u64> {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    return Some(fma_probe::calls());
    #[allow(unreachable_code)]
    None
}

#[cfg(all(test, target_arch = "x86_64", target_os = "linux"))]
mod fma_probe {
    use std::cell::Cell;

    thread_local! {
        static CALLS: Cell<u64> = const { Cell::new(0) };
    }

    /// This thread's `fmaf` calls so far.
    pub(crate) fn calls() -> u64 {
        CALLS.with(Cell::get)
    }

    /// `a·b + c` rounded once.
    #[no_mangle]
    extern "C" fn fmaf(a: f32, b: f32, c: f32) -> f32 {
        CALLS.with(|n| n.set(n.get() + 1));
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has FMA (checked).
            return unsafe { hardware(a, b, c) };
        }
        software(a, b, c)
    }

    /// The FMA instruction.
    ///
    /// # Safety
    ///
    /// The CPU must have FMA.
    #[target_feature(enable = "fma")]
    unsafe fn hardware(a: f32, b: f32, c: f32) -> f32 {
        use std::arch::x86_64::{_mm_cvtss_f32, _mm_fmadd_ss, _mm_set_ss};
        _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)))
    }

    /// musl's `fmaf`: the product is exact in f64, the sum rounds once
    /// there, and where rounding that to f32 would be a tie the f64 sum's
    /// last bit moves toward the sum's error, so that the second rounding
    /// goes the way a single one would.
    fn software(a: f32, b: f32, c: f32) -> f32 {
        let xy = f64::from(a) * f64::from(b);
        let z = f64::from(c);
        let sum = xy + z;
        let bits = sum.to_bits();
        let halfway = bits & 0x1fff_ffff == 0x1000_0000;
        if !halfway || sum.is_nan() || (sum - xy == z && sum - z == xy) {
            return sum as f32;
        }
        let negative = bits >> 63 == 1;
        let err = if negative == (z > xy) {
            xy - sum + z
        } else {
            z - sum + xy
        };
        let nudged = if negative == (err < 0.0) {
            bits + 1
        } else {
            bits - 1
        };
        f64::from_bits(nudged) as f32
    }

    /// The software path against the instruction, on sums whose f64 value
    /// is an f32 tie (where rounding twice goes wrong) and on a sweep of
    /// magnitudes.
    #[test]
    fn the_software_fma_is_the_instructions_bits() {
        if !std::arch::is_x86_feature_detected!("fma") {
            eprintln!("skipped: no FMA instruction here to compare the software fmaf with");
            return;
        }
        let e = f32::EPSILON;
        let mut cases = vec![
            (3.0, 1.0 / 3.0, -1.0),
            (f32::MAX, 2.0, -f32::MAX),
            (1e-30, 1e-30, 1e-45),
            (f32::INFINITY, 0.0, 1.0),
        ];
        // Ties after a first rounding: (1 + 2^-23)(1 - 2^-23)·2^s = 2^s − 2^(s−46),
        // and c with an odd last bit worth 2^(s+1), so that c + 2^s is an f32
        // tie that f64 reaches by rounding the 2^(s−46) away; once rounded, the
        // sum goes back to c, twice rounded on to the even neighbour.
        for scale in [-40, -12, 0, 9, 40] {
            for odd in [1u32, 3, 5, 0x2345] {
                for (ps, cs) in [(1.0, 1.0), (-1.0, -1.0), (1.0, -1.0), (-1.0, 1.0)] {
                    let p = 2f32.powi(scale);
                    let c = cs * 2f32.powi(scale + 24) * (1.0 + odd as f32 * e);
                    cases.push((ps * (1.0 + e) * p, 1.0 - e, c));
                }
            }
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..200_000 {
            let r = next();
            let f = |bits: u64, scale: i32| {
                (1.0 + (bits & 0x7f_ffff) as f32 * e)
                    * 2f32.powi(scale)
                    * if bits & (1 << 23) == 0 { 1.0 } else { -1.0 }
            };
            let (a, b) = (f(r, 0), f(r >> 24, (r >> 48) as i32 % 3));
            let c = -(a * b) + f(next(), -24 - (r >> 60) as i32);
            cases.push((a, b, c));
        }
        for (a, b, c) in cases {
            // SAFETY: the CPU has FMA (checked above).
            let want = unsafe { hardware(a, b, c) };
            let got = software(a, b, c);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "fmaf({a:e}, {b:e}, {c:e}) = {got:e}, the instruction gives {want:e}"
            );
        }
    }
}

/// Applies `f` to matching chunks of `rows` rows of `width` elements of `input`
/// and `out`, chunks spread over rayon's threads. `out` is fresh memory
/// (see [`uninit_floats`]) that `f` writes.
pub(crate) fn par_rows(
    input: &[f32],
    out: &mut [MaybeUninit<f32>],
    width: usize,
    f: impl Fn(&[f32], &mut [MaybeUninit<f32>]) + Sync,
) {
    use rayon::prelude::*;
    let per = width.max(1) * ROWS_PER_TASK;
    out.par_chunks_mut(per)
        .zip(input.par_chunks(per))
        .with_max_len(1)
        .for_each(|(o, i)| {
            vectorised(
                #[inline(always)]
                || f(i, o),
            )
        });
}

/// Rows of `out` (`stride` elements each) in tasks of [`ROWS_PER_TASK`],
/// spread over rayon's threads, for an op that also sums something over
/// its rows (a norm's weight gradient, a layer's bias gradient):
/// `f(rows, out, sums)` writes the task's rows (`rows`: their indices) and
/// adds its part of the sums into `sums` (`len` zeros). The parts are added
/// in task order, so the partition, and the bits, do not depend on the
/// number of threads. Returns the sums.
pub(crate) fn par_rows_summed<T: Send>(
    out: &mut [T],
    stride: usize,
    len: usize,
    f: impl Fn(std::ops::Range<usize>, &mut [T], &mut [f32]) + Sync,
) -> Vec<f32> {
    use rayon::prelude::*;
    let stride = stride.max(1);
    let parts: Vec<Vec<f32>> = out
        .par_chunks_mut(stride * ROWS_PER_TASK)
        .enumerate()
        .with_max_len(1)
        .map(|(task, out)| {
            let first = task * ROWS_PER_TASK;
            let mut sums = vec![0f32; len];
            vectorised(
                #[inline(always)]
                || f(first..first + out.len() / stride, out, &mut sums),
            );
            sums
        })
        .collect();
    let mut sums = vec![0f32; len];
    for part in &parts {
        sums.iter_mut().zip(part).for_each(|(s, v)| *s += v);
    }
    sums
}

/// A buffer for `rows` bf16 rows of `width` values laid out for zgemm's
/// products to read in place: `(buffer, start, stride)`, the rows from
/// `start` (a 64-byte line), [`zgemm::bf16_row_stride`] apart. Everything
/// outside the rows is written (zero); the rows, padding included, are the
/// caller's to write.
pub(crate) fn bf16_rows_buffer(rows: usize, width: usize) -> (Vec<MaybeUninit<u16>>, usize, usize) {
    let stride = zgemm::bf16_row_stride(width);
    // 32 values more: room to start on a line.
    let mut out = uninit_floats::<u16>(rows * stride + 32);
    let start = zgemm::bf16_line_start(&out);
    let (head, body) = out.split_at_mut(start);
    for v in head.iter_mut().chain(&mut body[rows * stride..]) {
        v.write(0);
    }
    (out, start, stride)
}

/// [`par_rows`] for an op whose output only bf16 products read: `f` writes
/// each row of `width` values, from an input row of `input_width`, in f32
/// into a scratch row in L1, which is stored rounded to bf16 (zgemm's
/// rounding, as its bits: what the products would have rounded the f32
/// output to, in half the bytes and without their pass). The result is
/// `[rows, width]`, laid out for the products to read in place: rows from
/// a 64-byte line, [`zgemm::bf16_row_stride`] apart (a view of a padded
/// buffer where that is wider than `width`; a copy of a 1536-wide
/// activation into an aligned, padded one was 1.2% of a bf16 step).
pub(crate) fn par_rows_bf16(
    input: &[f32],
    (input_width, width): (usize, usize),
    f: impl Fn(&[f32], &mut [MaybeUninit<f32>]) + Sync,
) -> candle_core::Result<candle_core::Tensor> {
    use rayon::prelude::*;
    let input_width = input_width.max(1);
    if !input.len().is_multiple_of(input_width) {
        candle_core::bail!("{} values are not rows of {input_width}", input.len());
    }
    let width = width.max(1);
    let rows = input.len() / input_width;
    let (mut out, start, stride) = bf16_rows_buffer(rows, width);
    out[start..start + rows * stride]
        .par_chunks_mut(stride * ROWS_PER_TASK)
        .enumerate()
        .with_max_len(1)
        .for_each(|(task, o)| {
            let mut wide = uninit_floats::<f32>(width);
            for (r, o) in o.chunks_mut(stride).enumerate() {
                let row = &input[(task * ROWS_PER_TASK + r) * input_width..][..input_width];
                vectorised(
                    #[inline(always)]
                    || f(row, &mut wide),
                );
                // SAFETY: `f` writes every element of its output row (as
                // every `par_rows` op does).
                let wide = unsafe { &*(&wide[..] as *const [MaybeUninit<f32>] as *const [f32]) };
                let (o, pad) = o.split_at_mut(width);
                zgemm::bf16_bits_write(wide, o);
                for o in pad {
                    o.write(0);
                }
            }
        });
    bf16_tensor(out, start, rows, stride, width)
}

/// bf16 rows mapped value by value through `table`, each value's bits
/// replaced by the low 16 bits of `table[bits]`: an element-wise function
/// of a bf16 value with a bf16 result (GELU's forward on the MLP's bf16
/// `h`), which has only 2¹⁶ inputs, looked up instead of computed (GELU's
/// exponential and reciprocal held its bf16 forward to 0.29 of the
/// triad's bandwidth). `rows` of `width` values `stride` apart in, laid out
/// as [`par_rows_bf16`]'s output.
pub(crate) fn par_rows_bf16_mapped(
    input: &[u16],
    rows: usize,
    stride: usize,
    width: usize,
    table: &[u32; 1 << 16],
) -> candle_core::Result<candle_core::Tensor> {
    use rayon::prelude::*;
    if rows > 0 && (stride < width || input.len() < (rows - 1) * stride + width) {
        candle_core::bail!(
            "{} values are not {rows} rows of {width} at stride {stride}",
            input.len()
        );
    }
    let width = width.max(1);
    let (mut out, start, out_stride) = bf16_rows_buffer(rows, width);
    out[start..start + rows * out_stride]
        .par_chunks_mut(out_stride * ROWS_PER_TASK)
        .enumerate()
        .with_max_len(1)
        .for_each(|(task, o)| {
            for (r, o) in o.chunks_mut(out_stride).enumerate() {
                let src = &input[(task * ROWS_PER_TASK + r) * stride..][..width];
                let (o, pad) = o.split_at_mut(width);
                #[cfg(target_arch = "x86_64")]
                let done = crate::lanes::looked_up_bits(src, o, table);
                #[cfg(not(target_arch = "x86_64"))]
                let done = false;
                if !done {
                    for (o, &b) in o.iter_mut().zip(src) {
                        o.write(table[usize::from(b)] as u16);
                    }
                }
                for o in pad {
                    o.write(0);
                }
            }
        });
    bf16_tensor(out, start, rows, out_stride, width)
}

/// The `[rows, width]` tensor of a [`bf16_rows_buffer`] (or of any buffer
/// whose rows start at `start`, `stride` apart) whose every value (head,
/// rows with their padding, tail) was written.
pub(crate) fn bf16_tensor(
    out: Vec<MaybeUninit<u16>>,
    start: usize,
    rows: usize,
    stride: usize,
    width: usize,
) -> candle_core::Result<candle_core::Tensor> {
    use half::vec::HalfBitsVecExt;
    // SAFETY: every value was written (caller).
    let out = unsafe { assume_init(out) };
    let len = out.len();
    let all = candle_core::Tensor::from_vec(
        out.reinterpret_into::<half::bf16>(),
        len,
        &candle_core::Device::Cpu,
    )?;
    all.narrow(0, start, rows * stride)?
        .reshape((rows, stride))?
        .narrow(1, 0, width)
}

/// `len` values (f32, or bf16 bits) of fresh memory for a product or an op to fill: no
/// zeroing pass (on memory reused from the heap, the allocator's zeroing of a
/// large output was a serial 2% of a step, and of the ops' outputs another
/// 1%).
pub(crate) fn uninit_floats<T>(len: usize) -> Vec<MaybeUninit<T>> {
    let mut v = Vec::with_capacity(len);
    // SAFETY: `MaybeUninit` values need no initialisation.
    unsafe { v.set_len(len) };
    v
}

/// The floats a product wrote.
///
/// # Safety
///
/// Every element of `v` must have been written.
pub(crate) unsafe fn assume_init<T>(v: Vec<MaybeUninit<T>>) -> Vec<T> {
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: same allocation, layout and length; initialised (caller).
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<T>(), v.len(), v.capacity()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut worst = 0u32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            let ulp = (got.to_bits() as i64 - want.to_bits() as i64).unsigned_abs() as u32;
            worst = worst.max(ulp);
            x += 0.001_37;
        }
        assert!(worst <= 2, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-1000.0), exp(-87.0));
        assert!(exp(1000.0).is_finite());
    }

    #[test]
    fn recip_is_within_two_ulp_of_a_division() {
        // Every mantissa step of [1, 2) (the guess's error depends only on
        // the mantissa) at several exponents, up to 2^126.
        let mut worst = 0u32;
        for e in [0, 1, 7, 40, 100, 125] {
            for m in (0..1u32 << 23).step_by(97) {
                let x = f32::from_bits(((127 + e) << 23) | m);
                let (got, want) = (recip(x), 1.0 / x);
                assert!(want.is_normal() && got.is_normal(), "1/{x}: {got}");
                let ulp = (got.to_bits() as i64 - want.to_bits() as i64).unsigned_abs() as u32;
                worst = worst.max(ulp);
            }
        }
        assert!(worst <= 2, "worst error {worst} ulp");
        assert_eq!(recip(1.0), 1.0);
        assert_eq!(recip(2.0), 0.5);
    }

    #[test]
    fn sigmoid_is_within_four_ulp_of_libm_and_saturates() {
        let mut worst = 0u32;
        let mut x = -80.0f32;
        while x < 88.0 {
            let (got, want) = (sigmoid(x), 1.0 / (1.0 + (-x).exp()));
            let ulp = (got.to_bits() as i64 - want.to_bits() as i64).unsigned_abs() as u32;
            worst = worst.max(ulp);
            x += 0.003_7;
        }
        assert!(worst <= 4, "worst error {worst} ulp");
        assert_eq!(sigmoid(100.0), 1.0);
        let far = sigmoid(-1e30);
        assert!(far.is_normal() && far < 1e-34, "sigmoid(-1e30) = {far}");
        assert!(sigmoid(f32::NAN).is_nan());
    }
}
