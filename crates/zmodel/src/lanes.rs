//! GELU's forward, LLaMA's SwiGLU both ways and a softmax's exponentials on
//! AVX2 and AVX-512, written with intrinsics several vectors at a time and
//! operation by operation, because the compiler's loops are bound by the
//! latency of one vector's chain, not by the arithmetic.
//!
//! GELU and its slope take about 41 vector operations per vector of values
//! (the exponential's polynomial, three Newton steps of the reciprocal, the
//! slope), one dependent chain of about 120 cycles. LLVM vectorises the
//! scalar loop one vector an iteration; on cores whose FMA units are 128 bits
//! wide every 256-bit operation is two micro-ops, the scheduler holds little
//! more than one iteration, and the loop ran at a third of its arithmetic
//! bound (2048 × 1536 values: 12.1 ms on one core, where its multiplies and
//! fused multiply-adds alone need about 4). Written per element over two
//! interleaved halves, or over arrays, the schedule stayed LLVM's, which
//! kept one chain at a time or spilled (0.85x and 1.4x the time). Here
//! [`CHAINS`] vectors go through each operation before the next one starts,
//! their constants read from memory as operands (AVX2's sixteen registers
//! hold the chains' values): 7.3 ms, 1.66x (`ops_bench`). SwiGLU's sigmoid
//! the same way: forward and backward 1.5x the compiler's loops (which until
//! then had kept bounds checks in the backward and ran it scalar, 6.3x
//! slower than here); a LLaMA of gpt-anchor's size trains 1.5-2.7% faster.
//! Attention's and the loss's `e^(v − max)`: attention's forward 2-3% faster
//! (`attention_bench`), its rows being short.
//!
//! The same kernels run on AVX-512's 16 lanes (one generic body over
//! [`Lanes`], instantiated for `__m256` and `__m512`). On a Sapphire Rapids
//! the compiler's 16-lane loops ran GELU and its slope at 0.4-0.5 of the
//! triad's bandwidth, bound by the chain as on AVX2 (the AVX2 intrinsics
//! there were slower still, 0.3-0.4: half the lanes); see `AVX512_CHAINS`
//! for what these run at.
//!
//! Every operation is the scalar code's operation, in its order (the clamps
//! with the constant first, as the compiler emits the scalar ones: `min`
//! and `max` return their second operand where one is NaN, on both widths),
//! so the results are [`crate::ops`]' and [`crate::simd::exp`]'s bits on
//! every input (tested against the scalar code at every width the CPU has,
//! NaN, infinities, subnormals and the clamps' edges included).
//!
//! A function of a bf16 value has only 2¹⁶ inputs: GELU's bf16 forward and
//! its slope for the bf16 backward are looked up in tables made once by
//! the scalar code, 16 (8) lookups to a gather instruction
//! ([`looked_up_bits`], [`times_looked_up`]). Computed here they were bound
//! by the same chains (the forward at 0.29 of the triad's bandwidth, one
//! thread); looked up, 0.63-0.66 and 0.6 (`ops_bench`).

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use crate::ops::{gelu_and_slope_of, GELU_2K, GELU_2KC, GELU_6KC};
use crate::simd::{chosen_width, exp, sigmoid, Width};

/// AVX2's vectors in flight (8 values each): 4 and 6 measured alike, 8
/// spilled.
const CHAINS: usize = 4;

/// AVX-512's vectors in flight (16 values each; thirty-two registers). GELU
/// and its slope on 2048 × 1536 values, one thread of a Sapphire Rapids,
/// the chain counts alternated call by call in one process (medians of 40,
/// four runs): 3, 5 and 6 chains alike, 4 chains 1.10-1.16x their time, 8
/// spilled; against the compiler's 16-lane loop, 1.1-1.4x as fast (the
/// larger figure where the host ran slow, when the loop is bound by
/// arithmetic rather than by memory). SwiGLU's forward 1.06-1.24x, a
/// softmax row's exponentials 1.02-1.05x on attention's short rows and
/// 1.12-1.14x on the loss's rows of GPT-2's 50304 tokens.
const AVX512_CHAINS: usize = 5;

/// SwiGLU's backward reads three streams and writes two: bound by memory,
/// its compiler's loop and the intrinsics run alike (one to three chains
/// 0.97-1.08x; five, which spill, 0.88-0.96x).
const AVX512_SWIGLU_BACKWARD_CHAINS: usize = 2;

/// 1.5 · 2^23 (see `simd::exp`).
const ROUNDER: f32 = 12_582_912.0;

/// A constant in sixteen lanes, aligned for a memory operand of either
/// width (AVX2 reads the first eight).
#[repr(align(64))]
struct Splat([f32; 16]);

impl Splat {
    const fn of(v: f32) -> Splat {
        Splat([v; 16])
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

/// One vector of f32 lanes and the operations the kernels are made of, each
/// one instruction: AVX2's `__m256` and AVX-512's `__m512`.
///
/// Every method needs its width's CPU features. They are `inline(always)`
/// and called only from the generic kernels below, themselves
/// `inline(always)` and called only from the entry points of
/// `width_entry_points!`, which are compiled with those features: that is
/// how the intrinsics end up inlined into code built for them.
trait Lanes: Copy {
    /// f32 values in a vector.
    const WIDTH: usize;
    unsafe fn zero() -> Self;
    /// A constant's lanes, read from memory.
    unsafe fn get(c: &Splat) -> Self;
    unsafe fn splat(v: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(p: *mut f32, v: Self);
    unsafe fn add(a: Self, b: Self) -> Self;
    unsafe fn sub(a: Self, b: Self) -> Self;
    unsafe fn mul(a: Self, b: Self) -> Self;
    /// `a·b + c`, one rounding.
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self;
    /// `c − a·b`, one rounding.
    unsafe fn fnmadd(a: Self, b: Self, c: Self) -> Self;
    unsafe fn xor(a: Self, b: Self) -> Self;
    /// The smaller lane, or `b`'s where either is NaN.
    unsafe fn min(a: Self, b: Self) -> Self;
    /// The larger lane, or `b`'s where either is NaN.
    unsafe fn max(a: Self, b: Self) -> Self;
    /// `2^n` for the integer `n` that adding [`ROUNDER`] left in `t`'s low
    /// bits: `((bits(t) − bits(ROUNDER) + 127) << 23)` as f32.
    unsafe fn exponent_scale(t: Self) -> Self;
    /// The reciprocal's first guess, `0x7ef311c3 − bits(z)` as f32.
    unsafe fn reciprocal_guess(z: Self) -> Self;
}

/// [`Lanes`] for one width, from its intrinsics' names.
macro_rules! impl_lanes {
    ($vector:ty, $width:expr, {
        zero: $zero:ident, load_aligned: $load_aligned:ident, set1: $set1:ident,
        loadu: $loadu:ident, storeu: $storeu:ident, add: $add:ident, sub: $sub:ident,
        mul: $mul:ident, fmadd: $fmadd:ident, fnmadd: $fnmadd:ident, xor: $xor:ident,
        min: $min:ident, max: $max:ident, to_int: $to_int:ident, to_float: $to_float:ident,
        sub_int: $sub_int:ident, add_int: $add_int:ident, set1_int: $set1_int:ident,
        shift_left: $shift_left:ident,
    }) => {
        impl Lanes for $vector {
            const WIDTH: usize = $width;
            #[inline(always)]
            unsafe fn zero() -> Self {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe { $zero() }
            }
            #[inline(always)]
            unsafe fn get(c: &Splat) -> Self {
                // SAFETY: this width's features (the trait's contract); a `Splat`
                // is 64 bytes, 64-byte aligned.
                unsafe { $load_aligned(c.0.as_ptr()) }
            }
            #[inline(always)]
            unsafe fn splat(v: f32) -> Self {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe { $set1(v) }
            }
            #[inline(always)]
            unsafe fn load(p: *const f32) -> Self {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe { $loadu(p) }
            }
            #[inline(always)]
            unsafe fn store(p: *mut f32, v: Self) {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe { $storeu(p, v) }
            }
            #[inline(always)]
            unsafe fn add(a: Self, b: Self) -> Self {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe { $add(a, b) }
            }
            #[inline(always)]
            unsafe fn sub(a: Self, b: Self) -> Self {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe { $sub(a, b) }
            }
            #[inline(always)]
            unsafe fn mul(a: Self, b: Self) -> Self {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe { $mul(a, b) }
            }
            #[inline(always)]
            unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe { $fmadd(a, b, c) }
            }
            #[inline(always)]
            unsafe fn fnmadd(a: Self, b: Self, c: Self) -> Self {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe { $fnmadd(a, b, c) }
            }
            #[inline(always)]
            unsafe fn xor(a: Self, b: Self) -> Self {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe { $xor(a, b) }
            }
            #[inline(always)]
            unsafe fn min(a: Self, b: Self) -> Self {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe { $min(a, b) }
            }
            #[inline(always)]
            unsafe fn max(a: Self, b: Self) -> Self {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe { $max(a, b) }
            }
            #[inline(always)]
            unsafe fn exponent_scale(t: Self) -> Self {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe {
                    let n = $sub_int($to_int(t), $to_int(Self::get(&ROUND)));
                    $to_float($shift_left::<23>($add_int(n, $set1_int(127))))
                }
            }
            #[inline(always)]
            unsafe fn reciprocal_guess(z: Self) -> Self {
                // SAFETY: the caller runs with this width's features (the trait's
                // contract).
                unsafe { $to_float($sub_int($set1_int(0x7ef3_11c3), $to_int(z))) }
            }
        }
    };
}

impl_lanes!(
    __m256,
    8,
    {
        zero: _mm256_setzero_ps,
        load_aligned: _mm256_load_ps,
        set1: _mm256_set1_ps,
        loadu: _mm256_loadu_ps,
        storeu: _mm256_storeu_ps,
        add: _mm256_add_ps,
        sub: _mm256_sub_ps,
        mul: _mm256_mul_ps,
        fmadd: _mm256_fmadd_ps,
        fnmadd: _mm256_fnmadd_ps,
        xor: _mm256_xor_ps,
        min: _mm256_min_ps,
        max: _mm256_max_ps,
        to_int: _mm256_castps_si256,
        to_float: _mm256_castsi256_ps,
        sub_int: _mm256_sub_epi32,
        add_int: _mm256_add_epi32,
        set1_int: _mm256_set1_epi32,
        shift_left: _mm256_slli_epi32,
    }
);
impl_lanes!(
    __m512,
    16,
    {
        zero: _mm512_setzero_ps,
        load_aligned: _mm512_load_ps,
        set1: _mm512_set1_ps,
        loadu: _mm512_loadu_ps,
        storeu: _mm512_storeu_ps,
        add: _mm512_add_ps,
        sub: _mm512_sub_ps,
        mul: _mm512_mul_ps,
        fmadd: _mm512_fmadd_ps,
        fnmadd: _mm512_fnmadd_ps,
        xor: _mm512_xor_ps,
        min: _mm512_min_ps,
        max: _mm512_max_ps,
        to_int: _mm512_castps_si512,
        to_float: _mm512_castsi512_ps,
        sub_int: _mm512_sub_epi32,
        add_int: _mm512_add_epi32,
        set1_int: _mm512_set1_epi32,
        shift_left: _mm512_slli_epi32,
    }
);

/// [`Lanes`] that also look 32-bit words up in a table by bf16 bits.
trait TableLanes: Lanes {
    /// `table[p[l]]` in lane `l`, for the `WIDTH` bf16 bits from `p`.
    ///
    /// # Safety
    ///
    /// The width's features; `table` holds 2¹⁶ words, `p` `WIDTH` values.
    unsafe fn look_up(table: *const f32, p: *const u16) -> Self;

    /// The low 16 bits of each lane's word, stored as `WIDTH` values at `p`.
    ///
    /// # Safety
    ///
    /// The width's features; `p` takes `WIDTH` values.
    unsafe fn store_low_halves(p: *mut u16, v: Self);
}

impl TableLanes for __m512 {
    #[inline(always)]
    unsafe fn look_up(table: *const f32, p: *const u16) -> Self {
        // SAFETY: AVX-512F (the trait's contract); 16 values readable
        // (caller); every u16 indexes the table.
        unsafe {
            let at = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
            _mm512_i32gather_ps::<4>(at, table)
        }
    }

    #[inline(always)]
    unsafe fn store_low_halves(p: *mut u16, v: Self) {
        // SAFETY: AVX-512F (the trait's contract); 16 values writable.
        unsafe { _mm256_storeu_si256(p.cast(), _mm512_cvtepi32_epi16(_mm512_castps_si512(v))) }
    }
}

impl TableLanes for __m256 {
    #[inline(always)]
    unsafe fn look_up(table: *const f32, p: *const u16) -> Self {
        // SAFETY: AVX2 (the trait's contract); 8 values readable (caller);
        // every u16 indexes the table.
        unsafe {
            let at = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_i32gather_ps::<4>(table, at)
        }
    }

    #[inline(always)]
    unsafe fn store_low_halves(p: *mut u16, v: Self) {
        // SAFETY: AVX2 (the trait's contract); 8 values writable. The low
        // halves masked, the unsigned saturation keeps them as they are;
        // each 128-bit lane's four go to its low 64 bits.
        unsafe {
            let low = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0xffff));
            let packed = _mm256_packus_epi32(low, low);
            let both = _mm256_permute4x64_epi64::<0b1000>(packed);
            _mm_storeu_si128(p.cast(), _mm256_castsi256_si128(both));
        }
    }
}

/// Applies `op` to each of the `C` chains.
macro_rules! each {
    ($k:ident => $e:expr) => {
        for $k in 0..C {
            $e;
        }
    };
}

/// e^z of each chain (`z` already held to [-87, 88]): `simd::exp`'s
/// operations, Cephes' reduction by ln 2 and degree-6 polynomial.
#[inline(always)]
unsafe fn exp_of<W: Lanes, const C: usize>(z: [W; C]) -> [W; C] {
    // SAFETY: the caller runs with W's features.
    unsafe {
        let [mut t, mut e, mut r, mut p] = [[W::zero(); C]; 4];
        each!(k => t[k] = W::fmadd(z[k], W::get(&LOG2E), W::get(&ROUND)));
        each!(k => e[k] = W::sub(t[k], W::get(&ROUND)));
        each!(k => r[k] = W::fmadd(e[k], W::get(&MINUS_LN2_HI), z[k]));
        each!(k => r[k] = W::fmadd(e[k], W::get(&MINUS_LN2_LO), r[k]));
        each!(k => p[k] = W::fmadd(W::get(&P0), r[k], W::get(&P1)));
        each!(k => p[k] = W::fmadd(p[k], r[k], W::get(&P2)));
        each!(k => p[k] = W::fmadd(p[k], r[k], W::get(&P3)));
        each!(k => p[k] = W::fmadd(p[k], r[k], W::get(&P4)));
        each!(k => p[k] = W::fmadd(p[k], r[k], W::get(&HALF)));
        each!(k => e[k] = W::mul(r[k], r[k]));
        each!(k => p[k] = W::add(W::fmadd(p[k], e[k], r[k]), W::get(&ONE)));
        each!(k => p[k] = W::mul(p[k], W::exponent_scale(t[k])));
        p
    }
}

/// The logistic sigmoid of each chain: `simd::sigmoid`'s operations (e^-x
/// held to e^80, then the reciprocal from the exponent bits and three Newton
/// steps).
#[inline(always)]
unsafe fn sigmoid_of<W: Lanes, const C: usize>(x: [W; C]) -> [W; C] {
    // SAFETY: the caller runs with W's features.
    unsafe {
        let [mut z, mut t, mut e] = [[W::zero(); C]; 3];
        // -x held to 80 above (NaN stays NaN), then `exp`'s clamp below.
        each!(k => z[k] = W::xor(x[k], W::get(&MINUS_ZERO)));
        each!(k => z[k] = W::max(W::get(&FLOOR), W::min(W::get(&EIGHTY), z[k])));
        let p = exp_of(z);
        each!(k => z[k] = W::add(W::get(&ONE), p[k]));
        each!(k => t[k] = W::reciprocal_guess(z[k]));
        for _ in 0..3 {
            each!(k => e[k] = W::fnmadd(z[k], t[k], W::get(&ONE)));
            each!(k => t[k] = W::fmadd(t[k], e[k], t[k]));
        }
        t
    }
}

/// Loads `C` vectors of `x` from `i`.
///
/// # Safety
///
/// W's features; `i + W::WIDTH·C ≤ x.len()`.
#[inline(always)]
unsafe fn load<W: Lanes, const C: usize>(x: &[f32], i: usize) -> [W; C] {
    // SAFETY: W's features and the length (caller).
    unsafe {
        let mut v = [W::zero(); C];
        for (k, v) in v.iter_mut().enumerate() {
            *v = W::load(x.as_ptr().add(i + W::WIDTH * k));
        }
        v
    }
}

/// Stores `C` vectors into `out` from `i`.
///
/// # Safety
///
/// W's features; `i + W::WIDTH·C ≤ out.len()`.
#[inline(always)]
unsafe fn store<W: Lanes, const C: usize>(out: &mut [MaybeUninit<f32>], i: usize, v: [W; C]) {
    let p = out.as_mut_ptr().cast::<f32>();
    for (k, v) in v.iter().enumerate() {
        // SAFETY: W's features and the length (caller).
        unsafe { W::store(p.add(i + W::WIDTH * k), *v) };
    }
}

/// SwiGLU's forward of `C` vectors: `gate · σ(gate) · up`.
#[inline(always)]
unsafe fn swiglu_of<W: Lanes, const C: usize>(g: [W; C], u: [W; C]) -> [W; C] {
    // SAFETY: the caller runs with W's features.
    unsafe {
        let mut y = sigmoid_of(g);
        each!(k => y[k] = W::mul(W::mul(g[k], y[k]), u[k]));
        y
    }
}

/// SwiGLU's forward of one row: `out = gate · σ(gate) · up`, per element the
/// bits of the scalar expression.
///
/// # Safety
///
/// W's features. `up` and `out` are at least as long as `gate`.
#[inline(always)]
unsafe fn swiglu_with<W: Lanes, const C: usize>(
    gate: &[f32],
    up: &[f32],
    out: &mut [MaybeUninit<f32>],
) {
    let (up, out) = (&up[..gate.len()], &mut out[..gate.len()]);
    let mut i = 0;
    // Both loops: i + W::WIDTH·C (or ·1) ≤ every slice's length.
    while i + W::WIDTH * C <= gate.len() {
        // SAFETY: W's features (caller); the loop's bound keeps every vector inside the slices.
        unsafe { store(out, i, swiglu_of::<W, C>(load(gate, i), load(up, i))) };
        i += W::WIDTH * C;
    }
    while i + W::WIDTH <= gate.len() {
        // SAFETY: W's features (caller); the loop's bound keeps every vector inside the slices.
        unsafe { store(out, i, swiglu_of::<W, 1>(load(gate, i), load(up, i))) };
        i += W::WIDTH;
    }
    for ((o, &g), &u) in out[i..].iter_mut().zip(&gate[i..]).zip(&up[i..]) {
        o.write(g * sigmoid(g) * u);
    }
}

/// SwiGLU's backward of `C` vectors: `(dgate, dup)`.
#[inline(always)]
unsafe fn swiglu_backward_of<W: Lanes, const C: usize>(
    g: [W; C],
    u: [W; C],
    d: [W; C],
) -> ([W; C], [W; C]) {
    // SAFETY: the caller runs with W's features.
    unsafe {
        let s = sigmoid_of(g);
        let [mut silu, mut dg, mut du] = [[W::zero(); C]; 3];
        each!(k => silu[k] = W::mul(g[k], s[k]));
        each!(k => {
            let bend = W::add(s[k], W::mul(silu[k], W::sub(W::get(&ONE), s[k])));
            dg[k] = W::mul(W::mul(d[k], u[k]), bend);
        });
        each!(k => du[k] = W::mul(d[k], silu[k]));
        (dg, du)
    }
}

/// SwiGLU's backward of one row: `dgate = dy·up·(s + silu·(1 − s))` and
/// `dup = dy·silu` with `s = σ(gate)`, `silu = gate·s`, per element the bits
/// of the scalar expressions.
///
/// # Safety
///
/// W's features. Every slice is at least as long as `gate`.
#[inline(always)]
unsafe fn swiglu_backward_with<W: Lanes, const C: usize>(
    gate: &[f32],
    up: &[f32],
    dy: &[f32],
    dgate: &mut [MaybeUninit<f32>],
    dup: &mut [MaybeUninit<f32>],
) {
    let n = gate.len();
    let (up, dy, dgate, dup) = (&up[..n], &dy[..n], &mut dgate[..n], &mut dup[..n]);
    let mut i = 0;
    // Both loops: i + W::WIDTH·C (or ·1) ≤ every slice's length.
    while i + W::WIDTH * C <= n {
        // SAFETY: W's features (caller); the loop's bound keeps every vector inside the slices.
        unsafe {
            let (dg, du) = swiglu_backward_of::<W, C>(load(gate, i), load(up, i), load(dy, i));
            store(dgate, i, dg);
            store(dup, i, du);
        }
        i += W::WIDTH * C;
    }
    while i + W::WIDTH <= n {
        // SAFETY: W's features (caller); the loop's bound keeps every vector inside the slices.
        unsafe {
            let (dg, du) = swiglu_backward_of::<W, 1>(load(gate, i), load(up, i), load(dy, i));
            store(dgate, i, dg);
            store(dup, i, du);
        }
        i += W::WIDTH;
    }
    for i in i..n {
        let s = sigmoid(gate[i]);
        let silu = gate[i] * s;
        dgate[i].write(dy[i] * up[i] * (s + silu * (1.0 - s)));
        dup[i].write(dy[i] * silu);
    }
}

/// `e^(v − max)` of `C` vectors, `exp`'s clamp of `v − max` to [-87, 88]
/// first.
#[inline(always)]
unsafe fn exp_minus_of<W: Lanes, const C: usize>(v: [W; C], max: W) -> [W; C] {
    // SAFETY: the caller runs with W's features.
    unsafe {
        let mut z = v;
        each!(k => z[k] = W::sub(z[k], max));
        each!(k => z[k] = W::min(W::get(&CEILING), W::max(W::get(&FLOOR), z[k])));
        exp_of(z)
    }
}

/// `v = e^(v − max)` for each value of `row` (a softmax's numerators): per
/// element the bits of `simd::exp(v - max)`.
///
/// # Safety
///
/// W's features.
#[inline(always)]
unsafe fn exp_minus_with<W: Lanes, const C: usize>(row: &mut [f32], max: f32) {
    // SAFETY: W's features (caller).
    let m = unsafe { W::splat(max) };
    let mut i = 0;
    // Both loops: i + W::WIDTH·C (or ·1) ≤ row.len(); the stores
    // go back where the loads came from.
    while i + W::WIDTH * C <= row.len() {
        // SAFETY: W's features (caller); the loop's bound keeps every vector inside the slices.
        unsafe {
            let p = exp_minus_of::<W, C>(load(row, i), m);
            for (k, p) in p.iter().enumerate() {
                W::store(row.as_mut_ptr().add(i + W::WIDTH * k), *p);
            }
        }
        i += W::WIDTH * C;
    }
    while i + W::WIDTH <= row.len() {
        // SAFETY: W's features (caller); the loop's bound keeps every vector inside the slices.
        unsafe {
            let [p] = exp_minus_of::<W, 1>(load(row, i), m);
            W::store(row.as_mut_ptr().add(i), p);
        }
        i += W::WIDTH;
    }
    for v in &mut row[i..] {
        *v = exp(*v - max);
    }
}

/// GELU and its slope of `C` vectors: `(v·s, s + s·(v·(1 − s)·(2k + 6kc·v²)))`
/// with `s = σ(v·(2k + 2kc·v²))`.
#[inline(always)]
unsafe fn gelu_of<W: Lanes, const C: usize>(v: [W; C]) -> ([W; C], [W; C]) {
    // SAFETY: the caller runs with W's features.
    unsafe {
        let [mut v2, mut t, mut value, mut dv] = [[W::zero(); C]; 4];
        each!(k => v2[k] = W::mul(v[k], v[k]));
        each!(k => t[k] = W::fmadd(v2[k], W::get(&TWO_KC), W::get(&TWO_K)));
        each!(k => t[k] = W::mul(v[k], t[k]));
        let s = sigmoid_of(t);
        each!(k => value[k] = W::mul(v[k], s[k]));
        each!(k => {
            let a = W::mul(v[k], W::sub(W::get(&ONE), s[k]));
            let a = W::mul(a, W::fmadd(v2[k], W::get(&SIX_KC), W::get(&TWO_K)));
            dv[k] = W::fmadd(s[k], a, s[k]);
        });
        (value, dv)
    }
}

/// GELU of `x` into `y` and its slope into `slope`: per element the bits of
/// [`gelu_and_slope_of`].
///
/// # Safety
///
/// W's features. `y` and `slope` are at least as long as `x`.
#[inline(always)]
unsafe fn gelu_and_slope_with<W: Lanes, const C: usize>(
    x: &[f32],
    y: &mut [MaybeUninit<f32>],
    slope: &mut [MaybeUninit<f32>],
) {
    let (y, slope) = (&mut y[..x.len()], &mut slope[..x.len()]);
    let mut i = 0;
    // Both loops: i + W::WIDTH·C (or ·1) ≤ x.len(), the outputs'
    // length.
    while i + W::WIDTH * C <= x.len() {
        // SAFETY: W's features (caller); the loop's bound keeps every vector inside the slices.
        unsafe {
            let (value, dv) = gelu_of::<W, C>(load(x, i));
            store(y, i, value);
            store(slope, i, dv);
        }
        i += W::WIDTH * C;
    }
    while i + W::WIDTH <= x.len() {
        // SAFETY: W's features (caller); the loop's bound keeps every vector inside the slices.
        unsafe {
            let (value, dv) = gelu_of::<W, 1>(load(x, i));
            store(y, i, value);
            store(slope, i, dv);
        }
        i += W::WIDTH;
    }
    for ((y, d), &v) in y[i..].iter_mut().zip(&mut slope[i..]).zip(&x[i..]) {
        let (value, dv) = gelu_and_slope_of(v);
        y.write(value);
        d.write(dv);
    }
}

/// [`gelu_and_slope_with`] over a tile of a matrix: GELU of its `rows`
/// rows of `cols` values at `c` (rows `rs` apart) written over them, the
/// slope into `slope` (rows `srs` apart). The tile's whole vectors go `C`
/// at a time across its rows (an f32 product's tile is 6 rows of 64
/// values on AVX-512: a row alone is 4 vectors, fewer than the chains that
/// hide the exponential's latency); the columns past them one at a time.
///
/// # Safety
///
/// W's features; the tile's elements at `c` are initialised and valid to
/// read and write, and `slope`'s valid to write, the two not overlapping.
#[inline(always)]
unsafe fn gelu_and_slope_tile_with<W: Lanes, const C: usize>(
    c: *mut f32,
    rs: usize,
    rows: usize,
    cols: usize,
    slope: *mut f32,
    srs: usize,
) {
    let per_row = cols / W::WIDTH;
    let (mut row, mut at) = (0, 0);
    // The next vector's row and its first column.
    let mut next = || {
        let here = (row, at);
        at += W::WIDTH;
        if at == per_row * W::WIDTH {
            (row, at) = (row + 1, 0);
        }
        here
    };
    let mut left = rows * per_row;
    while left > 0 {
        let take = if left >= C { C } else { 1 };
        // SAFETY: W's features; every vector is inside the tile (caller).
        unsafe {
            if take == C {
                let mut spots = [(0, 0); C];
                each!(k => spots[k] = next());
                let mut v = [W::zero(); C];
                each!(k => v[k] = W::load(c.add(spots[k].0 * rs + spots[k].1)));
                let (value, dv) = gelu_of::<W, C>(v);
                each!(k => {
                    W::store(c.add(spots[k].0 * rs + spots[k].1), value[k]);
                    W::store(slope.add(spots[k].0 * srs + spots[k].1), dv[k]);
                });
            } else {
                let (i, j) = next();
                let ([value], [dv]) = gelu_of::<W, 1>([W::load(c.add(i * rs + j))]);
                W::store(c.add(i * rs + j), value);
                W::store(slope.add(i * srs + j), dv);
            }
        }
        left -= take;
    }
    for i in 0..rows {
        for j in per_row * W::WIDTH..cols {
            // SAFETY: inside the tile (caller).
            unsafe {
                let (value, dv) = gelu_and_slope_of(*c.add(i * rs + j));
                *c.add(i * rs + j) = value;
                *slope.add(i * srs + j) = dv;
            }
        }
    }
}

/// `out = dy · table[h]` of bf16 bits `h`, a gather a vector.
///
/// # Safety
///
/// W's features. `dy` and `out` are at least as long as `h`.
#[inline(always)]
unsafe fn times_looked_up_with<W: TableLanes>(
    h: &[u16],
    dy: &[f32],
    out: &mut [f32],
    table: &[f32; 1 << 16],
) {
    let (dy, out) = (&dy[..h.len()], &mut out[..h.len()]);
    let whole = h.len() / W::WIDTH * W::WIDTH;
    for i in (0..whole).step_by(W::WIDTH) {
        // SAFETY: W's features (caller); i + WIDTH ≤ every slice's length,
        // and the table holds 2¹⁶ values.
        unsafe {
            let slope = W::look_up(table.as_ptr(), h.as_ptr().add(i));
            W::store(
                out.as_mut_ptr().add(i),
                W::mul(W::load(dy.as_ptr().add(i)), slope),
            );
        }
    }
    for ((o, &b), &d) in out[whole..].iter_mut().zip(&h[whole..]).zip(&dy[whole..]) {
        *o = d * table[usize::from(b)];
    }
}

/// `out = table[h]` (the low 16 bits of each word) for bf16 bits `h`, a
/// gather a vector.
///
/// # Safety
///
/// W's features. `out` is at least as long as `h`.
#[inline(always)]
unsafe fn looked_up_bits_with<W: TableLanes>(
    h: &[u16],
    out: &mut [MaybeUninit<u16>],
    table: &[u32; 1 << 16],
) {
    let out = &mut out[..h.len()];
    let whole = h.len() / W::WIDTH * W::WIDTH;
    for i in (0..whole).step_by(W::WIDTH) {
        // SAFETY: W's features (caller); i + WIDTH ≤ both slices' length,
        // and the table holds 2¹⁶ words.
        unsafe {
            let words = W::look_up(table.as_ptr().cast(), h.as_ptr().add(i));
            W::store_low_halves(out.as_mut_ptr().add(i).cast(), words);
        }
    }
    for (o, &b) in out[whole..].iter_mut().zip(&h[whole..]) {
        o.write(table[usize::from(b)] as u16);
    }
}

/// The kernels compiled for one width: entry points with its features, into
/// which the generic bodies and the intrinsics are inlined.
macro_rules! width_entry_points {
    ($module:ident, $vector:ty, $features:literal, $chains:expr, $backward_chains:expr) => {
        mod $module {
            use super::*;

            /// # Safety
            ///
            /// This width's features; `y` and `slope` as long as `x`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn gelu_and_slope(
                x: &[f32],
                y: &mut [MaybeUninit<f32>],
                slope: &mut [MaybeUninit<f32>],
            ) {
                // SAFETY: this function's features; the lengths (caller).
                unsafe { gelu_and_slope_with::<$vector, { $chains }>(x, y, slope) }
            }

            /// # Safety
            ///
            /// This width's features; the tile as
            /// [`gelu_and_slope_tile_with`]'s.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn gelu_and_slope_tile(
                c: *mut f32,
                rs: usize,
                rows: usize,
                cols: usize,
                slope: *mut f32,
                srs: usize,
            ) {
                // SAFETY: this function's features; the tile (caller).
                unsafe {
                    gelu_and_slope_tile_with::<$vector, { $chains }>(c, rs, rows, cols, slope, srs)
                }
            }

            /// # Safety
            ///
            /// This width's features; `out` as long as `h`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn looked_up_bits(
                h: &[u16],
                out: &mut [MaybeUninit<u16>],
                table: &[u32; 1 << 16],
            ) {
                // SAFETY: this function's features; the lengths (caller).
                unsafe { looked_up_bits_with::<$vector>(h, out, table) }
            }

            /// # Safety
            ///
            /// This width's features; `dy` and `out` as long as `h`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn times_looked_up(
                h: &[u16],
                dy: &[f32],
                out: &mut [f32],
                table: &[f32; 1 << 16],
            ) {
                // SAFETY: this function's features; the lengths (caller).
                unsafe { times_looked_up_with::<$vector>(h, dy, out, table) }
            }

            /// # Safety
            ///
            /// This width's features; `up` and `out` as long as `gate`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [MaybeUninit<f32>]) {
                // SAFETY: this function's features; the lengths (caller).
                unsafe { swiglu_with::<$vector, { $chains }>(gate, up, out) }
            }

            /// # Safety
            ///
            /// This width's features; every slice as long as `gate`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn swiglu_backward(
                gate: &[f32],
                up: &[f32],
                dy: &[f32],
                dgate: &mut [MaybeUninit<f32>],
                dup: &mut [MaybeUninit<f32>],
            ) {
                // SAFETY: this function's features; the lengths (caller).
                unsafe {
                    swiglu_backward_with::<$vector, { $backward_chains }>(gate, up, dy, dgate, dup)
                }
            }

            /// # Safety
            ///
            /// This width's features.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn exp_minus(row: &mut [f32], max: f32) {
                // SAFETY: this function's features (caller).
                unsafe { exp_minus_with::<$vector, { $chains }>(row, max) }
            }
        }
    };
}

width_entry_points!(avx2, __m256, "avx2,fma", CHAINS, CHAINS);
width_entry_points!(
    avx512,
    __m512,
    "avx512f,avx512dq",
    AVX512_CHAINS,
    AVX512_SWIGLU_BACKWARD_CHAINS
);

/// Calls `$f` with `$args` from the module of the widest vectors
/// [`chosen_width`] allows (every width module's `$f` takes the same
/// arguments) and gives true; false, nothing called, where it allows
/// neither. The caller has cut the slices to the lengths `$f` needs.
macro_rules! on_widest {
    ($f:ident($($arg:expr),* $(,)?)) => {
        match chosen_width() {
            Width::Avx512 => {
                // SAFETY: the CPU has AVX-512F and DQ (chosen_width); the
                // lengths as the caller cut them.
                unsafe { avx512::$f($($arg),*) };
                true
            }
            Width::Avx2 => {
                // SAFETY: the CPU has AVX2 and FMA (chosen_width); the
                // lengths as the caller cut them.
                unsafe { avx2::$f($($arg),*) };
                true
            }
            Width::Baseline => false,
        }
    };
}

/// GELU of `x` into `y` and its slope into `slope` with the intrinsics of
/// the widest vectors [`chosen_width`] allows, per element the bits of
/// [`gelu_and_slope_of`]; false (nothing written) where it allows neither.
/// `y` and `slope` are at least as long as `x` (panics otherwise).
pub(crate) fn gelu_and_slope(
    x: &[f32],
    y: &mut [MaybeUninit<f32>],
    slope: &mut [MaybeUninit<f32>],
) -> bool {
    let (y, slope) = (&mut y[..x.len()], &mut slope[..x.len()]);
    on_widest!(gelu_and_slope(x, y, slope))
}

/// [`gelu_and_slope`] of a tile in place, its slope into `slope`
/// ([`gelu_and_slope_tile_with`]); false (nothing written) where neither
/// width is allowed.
///
/// # Safety
///
/// As [`gelu_and_slope_tile_with`]'s (the CPU's features aside).
pub(crate) unsafe fn gelu_and_slope_tile(
    c: *mut f32,
    rs: usize,
    rows: usize,
    cols: usize,
    slope: *mut f32,
    srs: usize,
) -> bool {
    on_widest!(gelu_and_slope_tile(c, rs, rows, cols, slope, srs))
}

/// `out = table[h]` (each word's low 16 bits) for bf16 bits `h`: a function
/// of a bf16 value with a bf16 result (GELU's forward) looked up, the
/// lookups gathered a vector at a time; false where neither width is
/// allowed. `out` is at least as long as `h`.
pub(crate) fn looked_up_bits(
    h: &[u16],
    out: &mut [MaybeUninit<u16>],
    table: &[u32; 1 << 16],
) -> bool {
    let out = &mut out[..h.len()];
    on_widest!(looked_up_bits(h, out, table))
}

/// `out = dy · table[h]` for bf16 bits `h` (a function of a bf16 value
/// looked up: GELU's slope), the lookups gathered a vector at a time (the
/// compiler's loop made them one by one); false where neither width is
/// allowed. `dy` and `out` are at least as long as `h`.
pub(crate) fn times_looked_up(
    h: &[u16],
    dy: &[f32],
    out: &mut [f32],
    table: &[f32; 1 << 16],
) -> bool {
    let (dy, out) = (&dy[..h.len()], &mut out[..h.len()]);
    on_widest!(times_looked_up(h, dy, out, table))
}

/// SwiGLU's forward of one row, `out = gate · σ(gate) · up`, as
/// [`gelu_and_slope`] (the scalar expression's bits; false where neither
/// width is allowed). `up` and `out` are at least as long as `gate`.
pub(crate) fn swiglu(gate: &[f32], up: &[f32], out: &mut [MaybeUninit<f32>]) -> bool {
    let (up, out) = (&up[..gate.len()], &mut out[..gate.len()]);
    on_widest!(swiglu(gate, up, out))
}

/// SwiGLU's backward of one row (`dgate`, `dup` from `dy`), as
/// [`gelu_and_slope`]. Every slice is at least as long as `gate`.
pub(crate) fn swiglu_backward(
    gate: &[f32],
    up: &[f32],
    dy: &[f32],
    dgate: &mut [MaybeUninit<f32>],
    dup: &mut [MaybeUninit<f32>],
) -> bool {
    let n = gate.len();
    let (up, dy, dgate, dup) = (&up[..n], &dy[..n], &mut dgate[..n], &mut dup[..n]);
    on_widest!(swiglu_backward(gate, up, dy, dgate, dup))
}

/// `v = e^(v − max)` for each value of `row`, as [`gelu_and_slope`]
/// (`simd::exp(v - max)`'s bits; false where neither width is allowed).
pub(crate) fn exp_minus(row: &mut [f32], max: f32) -> bool {
    on_widest!(exp_minus(row, max))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::uninit_floats;

    /// The widths whose intrinsics this CPU can run; says on stderr which
    /// it cannot (those go untested here).
    fn widths_here(what: &str) -> Vec<Width> {
        let mut widths = Vec::new();
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            widths.push(Width::Avx2);
        } else {
            eprintln!("skipped: this CPU has no AVX2 and FMA, so the AVX2 {what} cannot run");
        }
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq") {
            widths.push(Width::Avx512);
        } else {
            eprintln!("skipped: this CPU has no AVX-512F and DQ, so the AVX-512 {what} cannot run");
        }
        widths
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
    /// ordinary ones, over lengths that leave single vectors and a tail;
    /// and the forward without the slope the same values.
    #[test]
    fn gelu_and_slope_intrinsics_are_the_scalar_codes_bits() {
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
        for width in widths_here("GELU") {
            for len in [x.len(), 64 * 3 + 16 * 2 + 5, 16 + 8 + 3, 7] {
                let x = &x[x.len() - len..];
                let (mut y, mut d) = (uninit_floats(len), uninit_floats(len));
                // SAFETY: the CPU has the width's features (widths_here); y
                // and d as long as x.
                unsafe {
                    match width {
                        Width::Avx2 => avx2::gelu_and_slope(x, &mut y, &mut d),
                        _ => avx512::gelu_and_slope(x, &mut y, &mut d),
                    }
                }
                for (i, &v) in x.iter().enumerate() {
                    // SAFETY: gelu_and_slope wrote every element.
                    let (got_y, got_d) = unsafe { (y[i].assume_init(), d[i].assume_init()) };
                    let (want_y, want_d) = gelu_and_slope_of(v);
                    assert!(
                        same(got_y, want_y) && same(got_d, want_d),
                        "x[{i}] = {v:e}: {width:?} gave ({got_y:e}, {got_d:e}), the scalar code ({want_y:e}, {want_d:e})"
                    );
                }
            }
        }
    }

    /// Looked-up bits are the table's low halves, for every bf16 value, at
    /// lengths with and without whole vectors.
    #[test]
    fn looked_up_bits_are_the_tables() {
        let table: Box<[u32; 1 << 16]> = (0..1u32 << 16)
            .map(|b| b.wrapping_mul(40503) & 0xffff | 0xabcd_0000)
            .collect::<Vec<_>>()
            .try_into()
            .unwrap();
        let h: Vec<u16> = (0..=u16::MAX).rev().collect();
        for width in widths_here("table lookup") {
            for len in [h.len(), 16 * 3 + 8 + 5, 7] {
                let h = &h[h.len() - len..];
                let mut out = vec![MaybeUninit::new(0u16); len];
                // SAFETY: the CPU has the width's features (widths_here);
                // out as long as h.
                unsafe {
                    match width {
                        Width::Avx2 => avx2::looked_up_bits(h, &mut out, &table),
                        _ => avx512::looked_up_bits(h, &mut out, &table),
                    }
                }
                for (i, &b) in h.iter().enumerate() {
                    // SAFETY: initialised above.
                    let got = unsafe { out[i].assume_init() };
                    let want = table[usize::from(b)] as u16;
                    assert_eq!(got, want, "h[{i}] = {b:#06x}: {width:?}, {len} values");
                }
            }
        }
    }

    /// Looked-up products are the table's values times `dy`, bit for bit,
    /// for every bf16 value, at lengths with and without whole vectors.
    #[test]
    fn looked_up_products_are_the_scalar_codes_bits() {
        let mut table = Box::new([0f32; 1 << 16]);
        for (b, t) in (0..=u16::MAX).zip(table.iter_mut()) {
            // Distinct bits for every index, NaN and infinities included.
            *t = f32::from_bits(u32::from(b).rotate_left(13) ^ 0x4000_0000);
        }
        let h: Vec<u16> = (0..=u16::MAX).rev().collect();
        let dy: Vec<f32> = (0..h.len())
            .map(|i| ((i * 7919 % 2001) as f32 - 1000.0) * 1.3e-3)
            .collect();
        for width in widths_here("table lookup") {
            for len in [h.len(), 16 * 3 + 8 + 5, 7] {
                let (h, dy) = (&h[h.len() - len..], &dy[dy.len() - len..]);
                let mut out = vec![0f32; len];
                // SAFETY: the CPU has the width's features (widths_here);
                // dy and out as long as h.
                unsafe {
                    match width {
                        Width::Avx2 => avx2::times_looked_up(h, dy, &mut out, &table),
                        _ => avx512::times_looked_up(h, dy, &mut out, &table),
                    }
                }
                for (i, (&b, &d)) in h.iter().zip(dy).enumerate() {
                    let want = d * table[usize::from(b)];
                    assert!(
                        same(out[i], want),
                        "h[{i}] = {b:#06x}, dy {d:e}: {width:?} gave {:e}, the scalar code {want:e}",
                        out[i]
                    );
                }
            }
        }
    }

    /// `exp_minus` gives `simd::exp(v - max)`'s bits on rows of every length
    /// from 0 to 150 (whole groups of chains, single vectors and tails), on
    /// values that reach both clamps, infinities and NaN.
    #[test]
    fn exp_minus_intrinsics_are_the_scalar_codes_bits() {
        let special = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 1e-40];
        for width in widths_here("exp") {
            for len in 0..=150 {
                let row: Vec<f32> = (0..len)
                    .map(|i| match i % 17 {
                        16 => special[i / 17 % special.len()],
                        k => (k as f32 - 8.0) * 13.0 + i as f32 * 0.37,
                    })
                    .collect();
                for max in [0.0, 3.5, -120.0, 200.0] {
                    let mut got = row.clone();
                    // SAFETY: the CPU has the width's features (widths_here).
                    unsafe {
                        match width {
                            Width::Avx2 => avx2::exp_minus(&mut got, max),
                            _ => avx512::exp_minus(&mut got, max),
                        }
                    }
                    for (i, (&g, &v)) in got.iter().zip(&row).enumerate() {
                        let want = exp(v - max);
                        assert!(
                            same(g, want),
                            "row of {len}, [{i}] = {v:e}, max {max}: {width:?} gave {g:e}, the scalar code {want:e}"
                        );
                    }
                }
            }
        }
    }

    /// SwiGLU's forward and backward give the scalar expressions' bits on
    /// gates that reach both ends of the sigmoid, infinities and NaN, over
    /// rows with single vectors and a tail.
    #[test]
    fn swiglu_intrinsics_are_the_scalar_codes_bits() {
        let special = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            1e-40,
            90.0,
            -90.0,
        ];
        for width in widths_here("SwiGLU") {
            for n in [64 * 20 + 16 * 3 + 13, 64 * 20 + 13, 16 + 5] {
                let gate: Vec<f32> = (0..n)
                    .map(|i| match i % 29 {
                        28 => special[i / 29 % special.len()],
                        _ => (i as f32 - n as f32 / 2.0) * 0.07,
                    })
                    .collect();
                let up: Vec<f32> = (0..n).map(|i| ((i * 31 % 17) as f32 - 8.0) * 0.3).collect();
                let dy: Vec<f32> = (0..n).map(|i| ((i * 13 % 11) as f32 - 5.0) * 0.2).collect();
                let (mut out, mut dgate, mut dup) =
                    (uninit_floats(n), uninit_floats(n), uninit_floats(n));
                // SAFETY: the CPU has the width's features (widths_here);
                // every slice n long.
                unsafe {
                    match width {
                        Width::Avx2 => {
                            avx2::swiglu(&gate, &up, &mut out);
                            avx2::swiglu_backward(&gate, &up, &dy, &mut dgate, &mut dup);
                        }
                        _ => {
                            avx512::swiglu(&gate, &up, &mut out);
                            avx512::swiglu_backward(&gate, &up, &dy, &mut dgate, &mut dup);
                        }
                    }
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
                        "gate[{i}] = {g:e}: {width:?} gave {got:?}, the scalar code {want:?}"
                    );
                }
            }
        }
    }
}
