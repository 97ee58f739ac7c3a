//! GELU's forward, LLaMA's SwiGLU both ways and a softmax's exponentials on
//! AVX2, written with intrinsics several vectors at a time and operation by
//! operation, because the compiler's loops are bound by the latency of one
//! vector's chain, not by the arithmetic.
//!
//! GELU and its slope take about 41 vector operations per eight values (the
//! exponential's polynomial, three Newton steps of the reciprocal, the
//! slope), one dependent chain of about 120 cycles. LLVM vectorises the
//! scalar loop one vector an iteration; on cores whose FMA units are 128 bits
//! wide every 256-bit operation is two micro-ops, the scheduler holds little
//! more than one iteration, and the loop ran at a third of its arithmetic
//! bound (2048 × 1536 values: 12.1 ms on one core, where its multiplies and
//! fused multiply-adds alone need about 4). Written per element over two
//! interleaved halves, or over arrays, the schedule stayed LLVM's, which
//! kept one chain at a time or spilled (0.85x and 1.4x the time). Here
//! [`CHAINS`] vectors go through each operation before the next one starts,
//! their constants read from memory as operands (the sixteen registers hold
//! the chains' values): 7.3 ms, 1.66x (`ops_bench`). SwiGLU's sigmoid the
//! same way: forward and backward 1.5x the compiler's loops (which until
//! then had kept bounds checks in the backward and ran it scalar, 6.3x
//! slower than here); a LLaMA of gpt-anchor's size trains 1.5-2.7% faster.
//! Attention's and the loss's
//! `e^(v − max)`: attention's forward 2-3% faster (`attention_bench`), its
//! rows being short.
//!
//! Every operation is the scalar code's operation, in its order (the clamps
//! with the constant first, as the compiler emits the scalar ones: `min`
//! and `max` return their second operand where one is NaN), so the results
//! are [`crate::ops`]' and [`crate::simd::exp`]'s bits on every input
//! (tested against the scalar code, NaN, infinities, subnormals and the
//! clamps' edges included). AVX-512 keeps the compiler's loops: thirty-two
//! registers, and no machine at hand to measure it on.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use crate::ops::{gelu_and_slope_of, GELU_2K, GELU_2KC, GELU_6KC};
use crate::simd::{exp, sigmoid};

/// Vectors in flight (8 values each): 4 and 6 measured alike, 8 spilled.
const CHAINS: usize = 4;

/// 1.5 · 2^23 (see `simd::exp`).
const ROUNDER: f32 = 12_582_912.0;

/// A constant in all eight lanes, aligned for a memory operand.
#[repr(align(32))]
struct Splat([f32; 8]);

impl Splat {
    const fn of(v: f32) -> Splat {
        Splat([v; 8])
    }

    #[inline(always)]
    fn get(&self) -> __m256 {
        // SAFETY: 32 bytes, 32-byte aligned; AVX is on wherever this is
        // inlined (callers are `avx2,fma` functions).
        unsafe { _mm256_load_ps(self.0.as_ptr()) }
    }
}

static TWO_K: Splat = Splat::of(GELU_2K);
static TWO_KC: Splat = Splat::of(GELU_2KC);
static SIX_KC: Splat = Splat::of(GELU_6KC);
static MINUS_ZERO: Splat = Splat::of(-0.0);
static EIGHTY: Splat = Splat::of(80.0);
static FLOOR: Splat = Splat::of(-87.0);
static CEILING: Splat = Splat::of(88.0);
static LOG2E: Splat = Splat::of(std::f32::consts::LOG2_E);
static ROUND: Splat = Splat::of(ROUNDER);
static MINUS_LN2_HI: Splat = Splat::of(-0.693_359_4);
static MINUS_LN2_LO: Splat = Splat::of(2.121_944_4e-4);
static P0: Splat = Splat::of(1.987_569_1e-4);
static P1: Splat = Splat::of(1.398_199_9e-3);
static P2: Splat = Splat::of(8.333_452e-3);
static P3: Splat = Splat::of(4.166_579_6e-2);
static P4: Splat = Splat::of(1.666_666_5e-1);
static HALF: Splat = Splat::of(0.5);
static ONE: Splat = Splat::of(1.0);

/// Applies `op` to each chain.
macro_rules! each {
    ($k:ident => $e:expr) => {
        for $k in 0..CHAINS {
            $e;
        }
    };
}

/// e^z of each chain (`z` already held to [-87, 88]): `simd::exp`'s
/// operations, Cephes' reduction by ln 2 and degree-6 polynomial.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp_of(z: [__m256; CHAINS]) -> [__m256; CHAINS] {
    let [mut t, mut e, mut r, mut p] = [[_mm256_setzero_ps(); CHAINS]; 4];
    each!(k => t[k] = _mm256_fmadd_ps(z[k], LOG2E.get(), ROUND.get()));
    each!(k => e[k] = _mm256_sub_ps(t[k], ROUND.get()));
    each!(k => r[k] = _mm256_fmadd_ps(e[k], MINUS_LN2_HI.get(), z[k]));
    each!(k => r[k] = _mm256_fmadd_ps(e[k], MINUS_LN2_LO.get(), r[k]));
    each!(k => p[k] = _mm256_fmadd_ps(P0.get(), r[k], P1.get()));
    each!(k => p[k] = _mm256_fmadd_ps(p[k], r[k], P2.get()));
    each!(k => p[k] = _mm256_fmadd_ps(p[k], r[k], P3.get()));
    each!(k => p[k] = _mm256_fmadd_ps(p[k], r[k], P4.get()));
    each!(k => p[k] = _mm256_fmadd_ps(p[k], r[k], HALF.get()));
    each!(k => e[k] = _mm256_mul_ps(r[k], r[k]));
    each!(k => p[k] = _mm256_add_ps(_mm256_fmadd_ps(p[k], e[k], r[k]), ONE.get()));
    each!(k => {
        let n = _mm256_sub_epi32(_mm256_castps_si256(t[k]), _mm256_castps_si256(ROUND.get()));
        let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(n, _mm256_set1_epi32(127)));
        p[k] = _mm256_mul_ps(p[k], _mm256_castsi256_ps(scale));
    });
    p
}

/// The logistic sigmoid of each chain: `simd::sigmoid`'s operations (e^-x
/// held to e^80, then the reciprocal from the exponent bits and three Newton
/// steps).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn sigmoid_of(x: [__m256; CHAINS]) -> [__m256; CHAINS] {
    let [mut z, mut t, mut e] = [[_mm256_setzero_ps(); CHAINS]; 3];
    // -x held to 80 above (NaN stays NaN), then `exp`'s clamp below.
    each!(k => z[k] = _mm256_xor_ps(x[k], MINUS_ZERO.get()));
    each!(k => z[k] = _mm256_max_ps(FLOOR.get(), _mm256_min_ps(EIGHTY.get(), z[k])));
    let p = exp_of(z);
    each!(k => z[k] = _mm256_add_ps(ONE.get(), p[k]));
    each!(k => {
        let guess = _mm256_sub_epi32(_mm256_set1_epi32(0x7ef3_11c3), _mm256_castps_si256(z[k]));
        t[k] = _mm256_castsi256_ps(guess);
    });
    for _ in 0..3 {
        each!(k => e[k] = _mm256_fnmadd_ps(z[k], t[k], ONE.get()));
        each!(k => t[k] = _mm256_fmadd_ps(t[k], e[k], t[k]));
    }
    t
}

/// Loads `CHAINS` vectors of `x` from `i`.
///
/// # Safety
///
/// `i + 8·CHAINS ≤ x.len()`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load(x: &[f32], i: usize) -> [__m256; CHAINS] {
    let mut v = [_mm256_setzero_ps(); CHAINS];
    for (k, v) in v.iter_mut().enumerate() {
        // SAFETY: i + 8·CHAINS ≤ x.len() (caller).
        *v = unsafe { _mm256_loadu_ps(x.as_ptr().add(i + 8 * k)) };
    }
    v
}

/// Stores `CHAINS` vectors into `out` from `i`.
///
/// # Safety
///
/// `i + 8·CHAINS ≤ out.len()`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store(out: &mut [MaybeUninit<f32>], i: usize, v: [__m256; CHAINS]) {
    let p = out.as_mut_ptr().cast::<f32>();
    for (k, v) in v.iter().enumerate() {
        // SAFETY: i + 8·CHAINS ≤ out.len() (caller).
        unsafe { _mm256_storeu_ps(p.add(i + 8 * k), *v) };
    }
}

/// SwiGLU's forward of one row: `out = gate · σ(gate) · up`, per element the
/// bits of the scalar expression.
///
/// # Safety
///
/// The CPU has AVX2 and FMA. `up` and `out` are at least as long as `gate`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [MaybeUninit<f32>]) {
    let (up, out) = (&up[..gate.len()], &mut out[..gate.len()]);
    let whole = gate.len() / (8 * CHAINS) * (8 * CHAINS);
    for i in (0..whole).step_by(8 * CHAINS) {
        // SAFETY: i + 8·CHAINS ≤ whole ≤ every slice's length.
        let (g, u) = unsafe { (load(gate, i), load(up, i)) };
        let mut y = sigmoid_of(g);
        each!(k => y[k] = _mm256_mul_ps(_mm256_mul_ps(g[k], y[k]), u[k]));
        // SAFETY: as above.
        unsafe { store(out, i, y) };
    }
    for ((o, &g), &u) in out[whole..]
        .iter_mut()
        .zip(&gate[whole..])
        .zip(&up[whole..])
    {
        o.write(g * sigmoid(g) * u);
    }
}

/// SwiGLU's backward of one row: `dgate = dy·up·(s + silu·(1 − s))` and
/// `dup = dy·silu` with `s = σ(gate)`, `silu = gate·s`, per element the bits
/// of the scalar expressions.
///
/// # Safety
///
/// The CPU has AVX2 and FMA. Every slice is at least as long as `gate`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn swiglu_backward(
    gate: &[f32],
    up: &[f32],
    dy: &[f32],
    dgate: &mut [MaybeUninit<f32>],
    dup: &mut [MaybeUninit<f32>],
) {
    let n = gate.len();
    let (up, dy, dgate, dup) = (&up[..n], &dy[..n], &mut dgate[..n], &mut dup[..n]);
    let whole = n / (8 * CHAINS) * (8 * CHAINS);
    for i in (0..whole).step_by(8 * CHAINS) {
        // SAFETY: i + 8·CHAINS ≤ whole ≤ every slice's length.
        let (g, u, d) = unsafe { (load(gate, i), load(up, i), load(dy, i)) };
        let s = sigmoid_of(g);
        let [mut silu, mut dg, mut du] = [[_mm256_setzero_ps(); CHAINS]; 3];
        each!(k => silu[k] = _mm256_mul_ps(g[k], s[k]));
        each!(k => {
            let bend = _mm256_add_ps(s[k], _mm256_mul_ps(silu[k], _mm256_sub_ps(ONE.get(), s[k])));
            dg[k] = _mm256_mul_ps(_mm256_mul_ps(d[k], u[k]), bend);
        });
        each!(k => du[k] = _mm256_mul_ps(d[k], silu[k]));
        // SAFETY: as above.
        unsafe { (store(dgate, i, dg), store(dup, i, du)) };
    }
    for i in whole..n {
        let s = sigmoid(gate[i]);
        let silu = gate[i] * s;
        dgate[i].write(dy[i] * up[i] * (s + silu * (1.0 - s)));
        dup[i].write(dy[i] * silu);
    }
}

/// `v = e^(v − max)` for each value of `row` (a softmax's numerators): per
/// element the bits of `simd::exp(v - max)`.
///
/// # Safety
///
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp_minus(row: &mut [f32], max: f32) {
    let whole = row.len() / (8 * CHAINS) * (8 * CHAINS);
    let m = _mm256_set1_ps(max);
    for i in (0..whole).step_by(8 * CHAINS) {
        // SAFETY: i + 8·CHAINS ≤ whole ≤ row.len().
        let mut z = unsafe { load(row, i) };
        // `exp`'s clamp of v − max to [-87, 88].
        each!(k => z[k] = _mm256_sub_ps(z[k], m));
        each!(k => z[k] = _mm256_min_ps(CEILING.get(), _mm256_max_ps(FLOOR.get(), z[k])));
        let p = exp_of(z);
        let out = row.as_mut_ptr();
        for (k, p) in p.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm256_storeu_ps(out.add(i + 8 * k), *p) };
        }
    }
    for v in &mut row[whole..] {
        *v = exp(*v - max);
    }
}

/// GELU of `x` into `y` and its slope into `slope`: per element the bits of
/// [`gelu_and_slope_of`].
///
/// # Safety
///
/// The CPU has AVX2 and FMA. `y` and `slope` are at least as long as `x`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn gelu_and_slope(
    x: &[f32],
    y: &mut [MaybeUninit<f32>],
    slope: &mut [MaybeUninit<f32>],
) {
    let (y, slope) = (&mut y[..x.len()], &mut slope[..x.len()]);
    let whole = x.len() / (8 * CHAINS) * (8 * CHAINS);
    let zero = _mm256_setzero_ps();
    for i in (0..whole).step_by(8 * CHAINS) {
        // SAFETY: i + 8·CHAINS ≤ whole ≤ x.len().
        let v = unsafe { load(x, i) };
        let [mut v2, mut t, mut value, mut dv] = [[zero; CHAINS]; 4];
        // s = sigmoid(v·(2k + 2kc·v²)).
        each!(k => v2[k] = _mm256_mul_ps(v[k], v[k]));
        each!(k => t[k] = _mm256_fmadd_ps(v2[k], TWO_KC.get(), TWO_K.get()));
        each!(k => t[k] = _mm256_mul_ps(v[k], t[k]));
        let s = sigmoid_of(t);
        // v·s, and the slope s + s·(v·(1 − s)·(2k + 6kc·v²)).
        each!(k => value[k] = _mm256_mul_ps(v[k], s[k]));
        each!(k => {
            let a = _mm256_mul_ps(v[k], _mm256_sub_ps(ONE.get(), s[k]));
            let a = _mm256_mul_ps(a, _mm256_fmadd_ps(v2[k], SIX_KC.get(), TWO_K.get()));
            dv[k] = _mm256_fmadd_ps(s[k], a, s[k]);
        });
        // SAFETY: i + 8·CHAINS ≤ whole ≤ the outputs' lengths.
        unsafe { (store(y, i, value), store(slope, i, dv)) };
    }
    for ((y, d), &v) in y[whole..]
        .iter_mut()
        .zip(&mut slope[whole..])
        .zip(&x[whole..])
    {
        let (value, dv) = gelu_and_slope_of(v);
        y.write(value);
        d.write(dv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::uninit_floats;

    /// Whether this CPU can run the kernels; says so on stderr where not.
    fn runs_here(what: &str) -> bool {
        let yes = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        if !yes {
            eprintln!("skipped: this CPU has no AVX2 and FMA, so the AVX2 {what} cannot run");
        }
        yes
    }

    /// The same bits, or both NaN: which NaN's payload a product of two NaNs
    /// keeps is the compiler's choice (LLVM commutes a product's operands),
    /// in the scalar code as much as here.
    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// The intrinsics give the scalar code's bits on every kind of input:
    /// NaN (which the clamps must pass through), infinities, zeros of both
    /// signs, subnormals, values at and around the clamps, and a spread of
    /// ordinary ones, over a length that leaves a tail for the scalar loop.
    #[test]
    fn gelu_and_slope_on_avx2_is_the_scalar_codes_bits() {
        if !runs_here("GELU") {
            return;
        }
        let mut x = vec![
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            -1e-40,
            1e-40,
            f32::MAX,
            f32::MIN,
        ];
        // Around the clamps of the sigmoid's argument (v·(2k + 2kc·v²) at
        // ±80 and ±87 for v near ±9.5) and everywhere GELU bends.
        for i in 0..4000 {
            let v = -12.0 + i as f32 * 0.006;
            x.push(v);
            x.push(v + 1e-4);
        }
        x.extend((0..997).map(|i| ((i * 7919 % 2000) as f32 - 1000.0) * 1e-3));
        let (mut y, mut d) = (uninit_floats(x.len()), uninit_floats(x.len()));
        // SAFETY: AVX2 and FMA checked above; y and d as long as x.
        unsafe { gelu_and_slope(&x, &mut y, &mut d) };
        for (i, &v) in x.iter().enumerate() {
            // SAFETY: gelu_and_slope wrote every element.
            let (got_y, got_d) = unsafe { (y[i].assume_init(), d[i].assume_init()) };
            let (want_y, want_d) = gelu_and_slope_of(v);
            assert!(
                same(got_y, want_y) && same(got_d, want_d),
                "x[{i}] = {v:e}: AVX2 gave ({got_y:e}, {got_d:e}), the scalar code ({want_y:e}, {want_d:e})"
            );
        }
    }

    /// `exp_minus` gives `simd::exp(v - max)`'s bits on rows of every length
    /// from 0 to 100 (whole groups of 32 and tails), on values that reach
    /// both clamps, infinities and NaN.
    #[test]
    fn exp_minus_on_avx2_is_the_scalar_codes_bits() {
        if !runs_here("exp") {
            return;
        }
        let special = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 1e-40];
        for len in 0..=100 {
            let row: Vec<f32> = (0..len)
                .map(|i| match i % 17 {
                    16 => special[i / 17 % special.len()],
                    k => (k as f32 - 8.0) * 13.0 + i as f32 * 0.37,
                })
                .collect();
            for max in [0.0, 3.5, -120.0, 200.0] {
                let mut got = row.clone();
                // SAFETY: AVX2 and FMA checked above.
                unsafe { exp_minus(&mut got, max) };
                for (i, (&g, &v)) in got.iter().zip(&row).enumerate() {
                    let want = exp(v - max);
                    assert!(
                        same(g, want),
                        "row of {len}, [{i}] = {v:e}, max {max}: AVX2 gave {g:e}, the scalar code {want:e}"
                    );
                }
            }
        }
    }

    /// SwiGLU's forward and backward give the scalar expressions' bits on
    /// gates that reach both ends of the sigmoid, infinities and NaN, over a
    /// row with a tail.
    #[test]
    fn swiglu_on_avx2_is_the_scalar_codes_bits() {
        if !runs_here("SwiGLU") {
            return;
        }
        let n = 32 * 40 + 13;
        let special = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            1e-40,
            90.0,
            -90.0,
        ];
        let gate: Vec<f32> = (0..n)
            .map(|i| match i % 29 {
                28 => special[i / 29 % special.len()],
                _ => (i as f32 - n as f32 / 2.0) * 0.07,
            })
            .collect();
        let up: Vec<f32> = (0..n).map(|i| ((i * 31 % 17) as f32 - 8.0) * 0.3).collect();
        let dy: Vec<f32> = (0..n).map(|i| ((i * 13 % 11) as f32 - 5.0) * 0.2).collect();
        let (mut out, mut dgate, mut dup) = (uninit_floats(n), uninit_floats(n), uninit_floats(n));
        // SAFETY: AVX2 and FMA checked above; every slice n long.
        unsafe {
            swiglu(&gate, &up, &mut out);
            swiglu_backward(&gate, &up, &dy, &mut dgate, &mut dup);
        }
        for i in 0..n {
            let (g, u, d) = (gate[i], up[i], dy[i]);
            let s = sigmoid(g);
            let silu = g * s;
            let want = [g * s * u, d * u * (s + silu * (1.0 - s)), d * silu];
            // SAFETY: the kernels wrote every element.
            let got = unsafe {
                [
                    out[i].assume_init(),
                    dgate[i].assume_init(),
                    dup[i].assume_init(),
                ]
            };
            assert!(
                (0..3).all(|k| same(got[k], want[k])),
                "gate[{i}] = {g:e}: AVX2 gave {got:?}, the scalar code {want:?}"
            );
        }
    }
}
