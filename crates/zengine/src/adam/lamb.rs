//! LAMB (You et al., 2020), as DeepSpeed's `Lamb` optimizer (FusedLamb,
//! csrc/lamb/fused_lamb_cuda_kernel.cu) computes it, in two passes:
//!
//! ```text
//! moments:  m = β1·m + (1 − β1)·g
//!           v = β2·v + (1 − β2)·g²
//!           u = m / (√v + ε) + λ·w        (λ only where decay applies)
//!           add w² and u² to the parameter's sums
//! apply:    r = clamp(‖w‖ / ‖u‖, min_coeff, max_coeff)   (1 where either is 0)
//!           w = w − (step_size·r)·u,   step_size = lr·√(1 − β2^t) / (1 − β1^t)
//! ```
//!
//! The ratio needs every element of a parameter before any of it moves, so
//! the engine runs the first pass over everything the rank updates, adds the
//! parameters' sums across ranks, and then runs the second, which recomputes
//! `u` from m, v and w (the same expression, so the same bits) instead of
//! keeping it. As in FusedLamb, `u` is made of the moments without their bias
//! corrections, which enter through `step_size` after the ratio.
//!
//! The sums are what keeps ZeRO's stages bit-identical: a parameter's
//! elements in one cell (a run of it inside one rank's slice, cut at fixed
//! places: `GroupLayout::norm_cells`) are summed in f64 (each square of an
//! f32 is exact there) in [`LANES`] lanes, lane i taking the elements whose
//! flat index is i mod [`LANES`], each lane in index order. That order
//! depends on the indices alone, not on where a range is cut into
//! sub-groups or threads' work, so stage 0 (which updates every slice) and
//! stages 1-3 (one slice each) add the same numbers in the same order. Both
//! passes are loops the compiler vectorises per ISA, as Lion's: each
//! operation rounds on its own.

use super::{updating, AdamStep, Buffers, Grads, Path};
use crate::precision::Half;

/// Lanes of a cell's sums of squares.
pub const LANES: usize = 8;

/// Sums of squares of one cell's elements (a run of one parameter inside
/// one rank's slice): of the parameters (w) and of the updates (u), lane by
/// lane ([`LANES`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SquareSums {
    w: [f64; LANES],
    u: [f64; LANES],
}

impl SquareSums {
    /// The sums of w² and u², the lanes added in order.
    pub fn totals(&self) -> [f64; 2] {
        [
            self.w.iter().fold(0.0, |a, x| a + x),
            self.u.iter().fold(0.0, |a, x| a + x),
        ]
    }
}

/// One LAMB step's scalars for one run of elements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LambScalars {
    gscale: f32,
    b1: f32,
    omb1: f32,
    b2: f32,
    omb2: f32,
    eps: f32,
    /// λ where decay applies, else 0.
    decay: f32,
    /// lr·√(1 − β2^t) / (1 − β1^t).
    step_size: f32,
}

impl LambScalars {
    /// The scalars of step `s`, with weight decay or without.
    pub fn new(s: &AdamStep, decay: bool) -> LambScalars {
        let (bc1, bc2) = s.bias_corrections();
        LambScalars {
            gscale: s.grad_scale,
            b1: s.beta1,
            omb1: 1.0 - s.beta1,
            b2: s.beta2,
            omb2: 1.0 - s.beta2,
            eps: s.eps,
            decay: if decay { s.weight_decay } else { 0.0 },
            step_size: (f64::from(s.lr) * bc2.sqrt() / bc1) as f32,
        }
    }
}

/// The trust ratio of a parameter whose squares sum to `w2` (its values) and
/// `u2` (its update): FusedLamb's, 1 where either norm is 0.
pub fn trust_ratio(w2: f64, u2: f64, [lo, hi]: [f64; 2]) -> f32 {
    let (w, u) = (w2.sqrt(), u2.sqrt());
    if w == 0.0 || u == 0.0 {
        return 1.0;
    }
    (w / u).clamp(lo, hi) as f32
}

/// The first pass over `b`, whose first element has flat index `at`: the
/// moments updated, the squares added to `sums` (`b.working` is untouched).
pub fn moments(path: Path, b: Buffers<'_>, at: usize, c: &LambScalars, sums: &mut SquareSums) {
    match path {
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 if std::arch::is_x86_feature_detected!("avx512f") => {
            // SAFETY: the CPU supports AVX-512F (checked just above).
            unsafe { moments_avx512(b, at, c, sums) }
        }
        #[cfg(target_arch = "x86_64")]
        Path::Avx2
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c") =>
        {
            // SAFETY: the CPU supports AVX2 and F16C (checked just above).
            unsafe { moments_avx2(b, at, c, sums) }
        }
        _ => moments_scalar(b, at, c, sums),
    }
}

/// The second pass over `b`: the parameters moved by `ratio` times their
/// update, and the working copy refreshed.
pub fn apply(path: Path, b: Buffers<'_>, c: &LambScalars, ratio: f32) {
    match path {
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 if std::arch::is_x86_feature_detected!("avx512f") => {
            // SAFETY: the CPU supports AVX-512F (checked just above).
            unsafe { apply_avx512(b, c, ratio) }
        }
        #[cfg(target_arch = "x86_64")]
        Path::Avx2
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c") =>
        {
            // SAFETY: the CPU supports AVX2 and F16C (checked just above).
            unsafe { apply_avx2(b, c, ratio) }
        }
        _ => apply_scalar(b, c, ratio),
    }
}

/// # Safety
///
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn moments_avx512(b: Buffers<'_>, at: usize, c: &LambScalars, sums: &mut SquareSums) {
    moments_scalar(b, at, c, sums)
}

/// # Safety
///
/// The CPU must support AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn moments_avx2(b: Buffers<'_>, at: usize, c: &LambScalars, sums: &mut SquareSums) {
    moments_scalar(b, at, c, sums)
}

/// # Safety
///
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn apply_avx512(b: Buffers<'_>, c: &LambScalars, ratio: f32) {
    apply_scalar(b, c, ratio)
}

/// # Safety
///
/// The CPU must support AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn apply_avx2(b: Buffers<'_>, c: &LambScalars, ratio: f32) {
    apply_scalar(b, c, ratio)
}

/// The first pass one element at a time in order (a loop for each kind of
/// gradient).
#[inline(always)]
pub(super) fn moments_scalar(b: Buffers<'_>, at: usize, c: &LambScalars, sums: &mut SquareSums) {
    let Buffers { p, g, m, v, .. } = b;
    match g {
        Grads::F32(g) => moments_each(p, m, v, g, |g| g, at, c, sums),
        Grads::Half(Half::Bf16, g) => {
            moments_each(p, m, v, g, |g| Half::Bf16.widen(g), at, c, sums)
        }
        Grads::Half(Half::F16, g) => moments_each(p, m, v, g, |g| Half::F16.widen(g), at, c, sums),
    }
}

/// One element of the first pass: the moments updated in place; returns
/// the update.
#[inline(always)]
fn moment(p: f32, m: &mut f32, v: &mut f32, g: f32, c: &LambScalars) -> f32 {
    let gi = g * c.gscale;
    let mi = c.b1 * *m + c.omb1 * gi;
    let vi = c.b2 * *v + c.omb2 * gi * gi;
    *m = mi;
    *v = vi;
    update(p, mi, vi, c)
}

/// The update of one element from its moments: the same expression in
/// both passes.
#[inline(always)]
fn update(p: f32, m: f32, v: f32, c: &LambScalars) -> f32 {
    m / (v.sqrt() + c.eps) + c.decay * p
}

/// Elements whose updates [`moments_each`] keeps on the stack before it
/// adds their squares (a multiple of [`LANES`]).
const BLOCK: usize = 512;

/// The first pass over one kind of gradient, a block at a time: one loop
/// updates the moments and makes the updates, a second adds the squares lane
/// by lane. (Both in one loop, the compiler kept the moments' arithmetic
/// scalar: the pass ran at 0.27 of the triad's bandwidth.)
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn moments_each<G: Copy>(
    p: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    grad: impl Fn(G) -> f32,
    at: usize,
    c: &LambScalars,
    sums: &mut SquareSums,
) {
    let n = p.len();
    let add = |s: &mut SquareSums, lane: usize, w: f32, u: f32| {
        s.w[lane] += f64::from(w) * f64::from(w);
        s.u[lane] += f64::from(u) * f64::from(u);
    };
    // Up to the first index that is a multiple of LANES, one at a time.
    let head = ((LANES - at % LANES) % LANES).min(n);
    for i in 0..head {
        let u = moment(p[i], &mut m[i], &mut v[i], grad(g[i]), c);
        add(sums, (at + i) % LANES, p[i], u);
    }
    let mut u = [0f32; BLOCK];
    let mut i = head;
    while i < n {
        let len = BLOCK.min(n - i);
        let r = i..i + len;
        let each = p[r.clone()]
            .iter()
            .zip(&mut m[r.clone()])
            .zip(&mut v[r.clone()])
            .zip(&g[r.clone()])
            .zip(&mut u[..len]);
        for ((((&p, m), v), &g), u) in each {
            *u = moment(p, m, v, grad(g), c);
        }
        // Whole lanes: element j of each chunk is lane j (the block starts
        // at a multiple of LANES).
        let whole = len / LANES * LANES;
        let (mut sw, mut su) = (sums.w, sums.u);
        let lanes = p[i..i + whole]
            .chunks_exact(LANES)
            .zip(u[..whole].chunks_exact(LANES));
        for (pc, uc) in lanes {
            // As arrays, so that the lanes' loop has no bounds to check.
            let pc: &[f32; LANES] = pc.try_into().expect("whole chunks");
            let uc: &[f32; LANES] = uc.try_into().expect("whole chunks");
            for j in 0..LANES {
                sw[j] += f64::from(pc[j]) * f64::from(pc[j]);
                su[j] += f64::from(uc[j]) * f64::from(uc[j]);
            }
        }
        (sums.w, sums.u) = (sw, su);
        for k in whole..len {
            add(sums, (at + i + k) % LANES, p[i + k], u[k]);
        }
        i += len;
    }
}

/// The second pass one element at a time in order (a loop for each kind of
/// working copy).
#[inline(always)]
pub(super) fn apply_scalar(b: Buffers<'_>, c: &LambScalars, ratio: f32) {
    let Buffers {
        p, m, v, working, ..
    } = b;
    let scale = c.step_size * ratio;
    let all = p.iter_mut().zip(m.iter()).zip(v.iter());
    let step = |((p, &m), &v): ((&mut f32, &f32), &f32)| {
        let pi = *p - scale * update(*p, m, v, c);
        *p = pi;
        pi
    };
    updating(all, working, step);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adam::tests::{grads_of, inputs, rounded, PRECISIONS};
    use crate::adam::{lamb_apply_with, lamb_moments_with, OptimizerKind};

    fn step(t: u64) -> AdamStep {
        AdamStep {
            rule: OptimizerKind::Lamb,
            lr: 2e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 0.01,
            step: t,
            bias_correction: true,
            grad_scale: 1.0,
            lr_decay: 0.0,
            initial_sum: 0.0,
        }
    }

    /// FusedLamb's ratio: ‖w‖/‖u‖ clamped to the bounds, 1 where either
    /// norm is 0.
    #[test]
    fn the_trust_ratio_is_clamped_and_one_at_a_zero_norm() {
        let b = [0.01, 10.0];
        assert_eq!(trust_ratio(4.0, 1.0, b), 2.0);
        assert_eq!(trust_ratio(1e6, 1.0, b), 10.0);
        assert_eq!(trust_ratio(1e-8, 1.0, b), 0.01);
        assert_eq!(trust_ratio(0.0, 3.0, b), 1.0);
        assert_eq!(trust_ratio(3.0, 0.0, b), 1.0);
        assert_eq!(trust_ratio(1e6, 1.0, [0.5, 2000.0]), 1000.0);
    }

    /// Several steps of one parameter against DeepSpeed's FusedLamb kernel
    /// transcribed in f64 (part 1: moments, the undecayed-moment update with
    /// its decay, the squares; part 3: the clamped ratio, the step size
    /// with both bias corrections or, as `bias_correction: false` asks,
    /// none, the move), on every path and thread count: every parameter
    /// within f32's rounding of a few steps, with the ratio clamped on some
    /// steps (a tiny lower bound lets it free).
    #[test]
    fn lamb_follows_deepspeeds_fused_lamb_in_f64() {
        let n = 40_099;
        let [p0, _, m0, v0] = inputs(n, 5);
        let grads: Vec<Vec<f32>> = (0..5).map(|k| inputs(n, 50 + k)[1].clone()).collect();
        let settings = [
            ([0.01, 10.0], true),
            ([1e-6, 1e6], true),
            ([0.01, 10.0], false),
        ];
        for (bounds, corrected) in settings {
            for path in Path::available() {
                for threads in [1, 2] {
                    let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
                    let wide =
                        |x: &Vec<f32>| -> Vec<f64> { x.iter().map(|&x| f64::from(x)).collect() };
                    let (mut pr, mut mr, mut vr) = (wide(&p0), wide(&m0), wide(&v0));
                    for (k, g) in grads.iter().enumerate() {
                        let s = AdamStep {
                            bias_correction: corrected,
                            ..step(k as u64 + 1)
                        };
                        let mut sums = SquareSums::default();
                        let b = Buffers::f32(&mut p, g, &mut m, &mut v);
                        lamb_moments_with(path, threads, vec![(b, true, 0, &mut sums)], &s);
                        let [w2, u2] = sums.totals();
                        let ratio = trust_ratio(w2, u2, bounds);
                        let b = Buffers::f32(&mut p, g, &mut m, &mut v);
                        lamb_apply_with(path, threads, vec![(b, (true, ratio))], &s);
                        // The reference.
                        let (b1, b2) = (f64::from(s.beta1), f64::from(s.beta2));
                        let (eps, wd) = (f64::from(s.eps), f64::from(s.weight_decay));
                        let mut u = vec![0f64; n];
                        for i in 0..n {
                            let gi = f64::from(g[i]);
                            mr[i] = b1 * mr[i] + (1.0 - b1) * gi;
                            vr[i] = b2 * vr[i] + (1.0 - b2) * gi * gi;
                            u[i] = mr[i] / (vr[i].sqrt() + eps) + wd * pr[i];
                        }
                        let w_norm = pr.iter().map(|x| x * x).sum::<f64>().sqrt();
                        let u_norm = u.iter().map(|x| x * x).sum::<f64>().sqrt();
                        let coeff = (w_norm / u_norm).clamp(bounds[0], bounds[1]);
                        let t = s.step as i32;
                        let step_size = match corrected {
                            true => {
                                f64::from(s.lr) * (1.0 - b2.powi(t)).sqrt() / (1.0 - b1.powi(t))
                            }
                            false => f64::from(s.lr),
                        };
                        assert!(
                            (f64::from(ratio) - coeff).abs() <= 1e-5 * coeff,
                            "{path:?} step {}: ratio {ratio} for {coeff}",
                            s.step
                        );
                        for i in 0..n {
                            pr[i] -= step_size * coeff * u[i];
                        }
                    }
                    for i in 0..n {
                        let (got, want) = (f64::from(p[i]), pr[i]);
                        assert!(
                            (got - want).abs() <= 1e-5 * want.abs().max(1e-3),
                            "{path:?} threads {threads} bounds {bounds:?} corrected {corrected} p[{i}]: {got} for {want}"
                        );
                    }
                }
            }
        }
    }

    /// Both passes on every path and thread count, over a range cut into
    /// pieces anywhere and starting at any flat index, give the scalar
    /// reference's bits in every precision: the moments, the sums (to the
    /// bit: the order that keeps the stages identical), the parameters
    /// and the working copy.
    #[test]
    fn every_path_and_cut_gives_the_scalar_bits() {
        let s = AdamStep {
            grad_scale: 0.37,
            ..step(3)
        };
        let c = LambScalars::new(&s, true);
        for n in [1, 7, 17, 1001, (1 << 18) + 37] {
            for at in [0, 3, 8] {
                let [p0, g, m0, v0] = inputs(n, n as u32 + 7);
                for kind in PRECISIONS {
                    let gh = rounded(kind, &g);
                    let grads = grads_of(kind, &g, &gh);
                    let fresh = || {
                        let w = vec![0u16; if kind.is_some() { n } else { 0 }];
                        (p0.clone(), m0.clone(), v0.clone(), w)
                    };
                    let (mut p, mut m, mut v, mut w) = fresh();
                    let mut want_sums = SquareSums::default();
                    moments_scalar(
                        Buffers::of(&mut p, grads, &mut m, &mut v, kind, &mut w),
                        at,
                        &c,
                        &mut want_sums,
                    );
                    let [w2, u2] = want_sums.totals();
                    let ratio = trust_ratio(w2, u2, [0.01, 10.0]);
                    apply_scalar(
                        Buffers::of(&mut p, grads, &mut m, &mut v, kind, &mut w),
                        &c,
                        ratio,
                    );
                    let want = (p, m, v, w);
                    for path in Path::available() {
                        for threads in [1, 3] {
                            for cut in [n / 3, 5.min(n)] {
                                let (mut p, mut m, mut v, mut w) = fresh();
                                let mut sums = SquareSums::default();
                                let (a, b) =
                                    Buffers::of(&mut p, grads, &mut m, &mut v, kind, &mut w)
                                        .split_at(cut);
                                lamb_moments_with(
                                    path,
                                    threads,
                                    vec![(a, true, at, &mut sums)],
                                    &s,
                                );
                                lamb_moments_with(
                                    path,
                                    threads,
                                    vec![(b, true, at + cut, &mut sums)],
                                    &s,
                                );
                                let what = format!(
                                    "{path:?} {kind:?} threads {threads} n {n} at {at} cut {cut}"
                                );
                                assert_eq!(sums, want_sums, "{what}");
                                let b = Buffers::of(&mut p, grads, &mut m, &mut v, kind, &mut w);
                                lamb_apply_with(path, threads, vec![(b, (true, ratio))], &s);
                                assert!((p, m, v, w) == want, "{what}");
                            }
                        }
                    }
                }
            }
        }
    }
}
