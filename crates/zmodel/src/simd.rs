//! What the fused CPU ops share: an `exp` the compiler can vectorise, running a
//! loop with AVX2 enabled where the CPU has it, and splitting rows over rayon's
//! threads in chunks that do not depend on the thread count (so results are the
//! same bits with 1 thread or 16).
//!
//! libm's `expf` is a scalar call, and it was most of GELU's time: an element of
//! GELU cost about 6 ns. `exp` below is Cephes' `expf` (range reduction by ln 2,
//! a degree-6 polynomial, about 1 ulp) written with plain arithmetic and bit
//! operations, which LLVM turns into 8-lane AVX2 code. No fused multiply-add is
//! ever formed (Rust does not contract), so the AVX2 and baseline paths give the
//! same bits.

use std::mem::MaybeUninit;

/// Rows per parallel task.
pub(crate) const ROWS_PER_TASK: usize = 16;

/// 1.5 · 2^23: adding it rounds an f32 of magnitude below 2^22 to an integer,
/// which then sits in the low mantissa bits.
const ROUNDER: f32 = 12_582_912.0;

/// e^x for x in about [-87, 88] (1 ulp); 0 below, +inf above.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * LOG2E + ROUNDER;
    let n = shifted - ROUNDER;
    let ni = (shifted.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
    let r = x - n * LN2_HI - n * LN2_LO;
    let r2 = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let poly = p * r2 + r + 1.0;
    poly * f32::from_bits(((ni + 127) << 23) as u32)
}

/// Runs `f` in a function compiled for AVX2 when this CPU has it (the closure
/// is inlined into it), else as is.
#[inline(always)]
pub(crate) fn vectorised<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if !baseline_forced() && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// Tests set this to run the baseline path on an AVX2 machine (the claim that
/// both give the same bits is tested, not assumed).
#[cfg(test)]
pub(crate) static FORCE_BASELINE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

#[cfg(test)]
fn baseline_forced() -> bool {
    FORCE_BASELINE.load(std::sync::atomic::Ordering::SeqCst)
}

#[cfg(not(test))]
#[inline(always)]
fn baseline_forced() -> bool {
    false
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
        .for_each(|(o, i)| vectorised(|| f(i, o)));
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
}
