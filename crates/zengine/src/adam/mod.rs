//! AdamW over a flat f32 slice in one fused pass: read p, g, m, v; write p, m, v
//! and, with mixed precision, the 16-bit working copy of p. And Lion
//! (`train.optimizer.type: lion`): the same pass over p, g and m only: Lion
//! keeps no second moment, and its `v` is empty. Adagrad (`adagrad`) is
//! such a pass too, its sum of squared gradients in `m` (adagrad.rs), and
//! so is PyTorch's Adam (`adam`, l2.rs): AdamW's arithmetic on a gradient
//! with the L2 term added, the parameter not decayed. LAMB
//! (`lamb`) runs in two passes over the same buffers ([`lamb`]), its trust
//! ratios between them.
//!
//! The pass is bound by memory bandwidth, not arithmetic: 28 bytes move per
//! element for about 12 flops (f32: 4 read, 3 written; mixed precision: a 2-byte
//! gradient in and a 2-byte working copy out, the same 28). So the explicit
//! AVX-512 and AVX2 bodies (chosen at run time; a portable loop otherwise) only
//! have to keep the loads streaming, and large slices are split over threads.
//!
//! Every path evaluates the same expression in the same order with plain
//! multiplies and adds (no FMA: a fused multiply-add rounds differently),
//! correctly rounded `sqrt` and division, and round-to-nearest-even 16-bit
//! conversions, so every path gives the same bits as the scalar reference. That
//! is what keeps stage 0's full update equal to the gathered slices of stages 1-3
//! whatever the slice boundaries and the CPU. Each rule's pass is one scalar
//! loop that the compiler vectorises for each ISA ([`Path`], chosen at run
//! time: the loop compiled under AVX-512's or AVX2's `target_feature`, or
//! portably): its arithmetic (products, sums, a square root, a division and,
//! for Lion, a sign that is a select) leaves the compiler nothing to
//! reorder, so every ISA gives the scalar loop's bits. (AdamW had explicit
//! AVX-512 and AVX2 intrinsics until the ninety-second session; on AVX2 the
//! compiler's vectorisation of the same loop is as fast, see
//! docs/PERFORMANCE.md.)

pub use zconfig::spec::OptimizerKind;

use crate::precision::Half;

/// Hyper-parameters of one optimizer step.
#[derive(Debug, Clone, Copy)]
pub struct AdamStep {
    /// Which update: AdamW's, Adam's, Lion's or Adagrad's (LAMB's runs in
    /// [`lamb_moments`] and [`lamb_apply`]).
    pub rule: OptimizerKind,
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Weight decay, applied where the range asks for it: decoupled
    /// (AdamW, Lion, LAMB) or added to the gradient (Adam's and Adagrad's
    /// L2).
    pub weight_decay: f32,
    /// 1-based step, for bias correction.
    pub step: u64,
    /// Adam, AdamW and LAMB: whether the moments' bias is corrected
    /// (DeepSpeed's `bias_correction`; false: the step is `lr` and the
    /// second moment's root is taken as it is).
    pub bias_correction: bool,
    /// Every gradient is multiplied by this first (unscaling and clipping in the
    /// same pass; 1 leaves f32 gradients exactly as they are).
    pub grad_scale: f32,
    /// Adagrad: the rate of step t is `lr / (1 + (t − 1)·lr_decay)`.
    pub lr_decay: f32,
    /// Adagrad: added to each sum before this step's square, its
    /// `initial_accumulator_value` at the first update (the sums start at
    /// 0), else 0.
    pub initial_sum: f32,
}

impl AdamStep {
    /// The first and second moments' bias corrections, `1 − β^t`, or both
    /// 1 where [`AdamStep::bias_correction`] is off.
    pub fn bias_corrections(&self) -> (f64, f64) {
        match self.bias_correction {
            true => {
                let t = self.step as i32;
                let bc = |b: f32| 1.0 - f64::from(b).powi(t);
                (bc(self.beta1), bc(self.beta2))
            }
            false => (1.0, 1.0),
        }
    }
}

/// The gradient an update reads.
#[derive(Debug, Clone, Copy)]
pub enum Grads<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// 16-bit values, as bits.
    Half(Half, &'a [u16]),
}

impl<'a> Grads<'a> {
    fn len(&self) -> usize {
        match self {
            Grads::F32(g) => g.len(),
            Grads::Half(_, g) => g.len(),
        }
    }

    fn split_at(self, k: usize) -> (Grads<'a>, Grads<'a>) {
        match self {
            Grads::F32(g) => {
                let (a, b) = g.split_at(k);
                (Grads::F32(a), Grads::F32(b))
            }
            Grads::Half(h, g) => {
                let (a, b) = g.split_at(k);
                (Grads::Half(h, a), Grads::Half(h, b))
            }
        }
    }
}

/// The buffers of one update, all of one length: f32 parameters (the master
/// copy under mixed precision), gradients, moments, and the working copy to
/// refresh, if any.
#[derive(Debug)]
pub struct Buffers<'a> {
    /// Parameters, updated in place.
    pub p: &'a mut [f32],
    /// Gradients.
    pub g: Grads<'a>,
    /// First moment (Adagrad: the sum of squared gradients).
    pub m: &'a mut [f32],
    /// Second moment; empty for Lion and Adagrad, which keep none.
    pub v: &'a mut [f32],
    /// Mixed precision: receives the updated parameters rounded to 16 bits.
    pub working: Option<(Half, &'a mut [u16])>,
}

impl<'a> Buffers<'a> {
    /// Plain f32 AdamW buffers.
    pub fn f32(p: &'a mut [f32], g: &'a [f32], m: &'a mut [f32], v: &'a mut [f32]) -> Self {
        Buffers {
            p,
            g: Grads::F32(g),
            m,
            v,
            working: None,
        }
    }

    fn len(&self) -> usize {
        self.p.len()
    }

    fn check(&self, rule: OptimizerKind) {
        let n = self.p.len();
        let v = match rule.second_moment() {
            true => n,
            false => 0,
        };
        assert!(
            self.g.len() == n
                && self.m.len() == n
                && self.v.len() == v
                && self.working.as_ref().is_none_or(|(_, w)| w.len() == n),
            "adamw: buffer lengths differ"
        );
    }

    /// The first `k` elements and the rest.
    pub fn split_at(self, k: usize) -> (Buffers<'a>, Buffers<'a>) {
        let (p0, p1) = self.p.split_at_mut(k);
        let (g0, g1) = self.g.split_at(k);
        let (m0, m1) = self.m.split_at_mut(k);
        let (v0, v1): (&mut [f32], &mut [f32]) = match self.v.is_empty() {
            true => (&mut [], &mut []),
            false => self.v.split_at_mut(k),
        };
        let (w0, w1) = match self.working {
            Some((h, w)) => {
                let (a, b) = w.split_at_mut(k);
                (Some((h, a)), Some((h, b)))
            }
            None => (None, None),
        };
        (
            Buffers {
                p: p0,
                g: g0,
                m: m0,
                v: v0,
                working: w0,
            },
            Buffers {
                p: p1,
                g: g1,
                m: m1,
                v: v1,
                working: w1,
            },
        )
    }
}

/// One step's scalars, shared by every path: the CPU's kernels here and the
/// GPU's (`kernels/adamw.cu`, through `device_consts` where the `cuda`
/// feature is on), derived once so that both give the same bits. Public
/// for the GPU kernel's CPU tests (crates/zcuda-emu), which hold it to
/// these without building the GPU path into this crate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scalars {
    /// Every gradient is multiplied by this first.
    pub gscale: f32,
    /// beta1.
    pub b1: f32,
    /// 1 - beta1.
    pub omb1: f32,
    /// beta2.
    pub b2: f32,
    /// 1 - beta2.
    pub omb2: f32,
    /// lr over the first moment's bias correction (Lion: lr itself;
    /// Adagrad: lr / (1 + (t − 1)·lr_decay)).
    pub step_size: f32,
    /// 1 / sqrt of the second moment's bias correction.
    pub inv_sqrt_bc2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// The weight decay's factor: where decay applies 1 − lr·weight_decay,
    /// which scales p (decoupled), or for Adam and Adagrad weight_decay
    /// itself, the multiple of p added to the gradient (L2); where it does
    /// not, 1 (Adam and Adagrad: 0).
    pub decay: f32,
    /// Adagrad: added to the sum before the square (see
    /// [`AdamStep::initial_sum`]).
    pub initial_sum: f32,
    /// Which update.
    pub rule: OptimizerKind,
}

impl Scalars {
    /// The scalars of step `s`, with weight decay or without.
    pub fn new(s: &AdamStep, decay: bool) -> Scalars {
        // Lion's moment is not bias-corrected: its update is a sign.
        // Adagrad's rate decays as PyTorch's does.
        let lr_over = match s.rule {
            OptimizerKind::Lion => 1.0,
            OptimizerKind::Adagrad => 1.0 + (s.step - 1) as f64 * s.lr_decay as f64,
            OptimizerKind::Adamw | OptimizerKind::Adam | OptimizerKind::Lamb => {
                s.bias_corrections().0
            }
        };
        let bc2 = s.bias_corrections().1;
        let l2 = matches!(s.rule, OptimizerKind::Adam | OptimizerKind::Adagrad);
        Scalars {
            gscale: s.grad_scale,
            b1: s.beta1,
            omb1: 1.0 - s.beta1,
            b2: s.beta2,
            omb2: 1.0 - s.beta2,
            step_size: (s.lr as f64 / lr_over) as f32,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
            eps: s.eps,
            decay: match (decay, l2) {
                (true, true) => s.weight_decay,
                (true, false) => 1.0 - s.lr * s.weight_decay,
                (false, true) => 0.0,
                (false, false) => 1.0,
            },
            initial_sum: s.initial_sum,
            rule: s.rule,
        }
    }
}

/// The scalars the GPU kernel (`kernels/adamw.cu`) reads, derived exactly as
/// the CPU's, so that both give the same bits.
#[cfg(feature = "cuda")]
pub fn device_consts(s: &AdamStep, decay: bool) -> zcuda::AdamConsts {
    let c = Scalars::new(s, decay);
    zcuda::AdamConsts {
        gscale: c.gscale,
        b1: c.b1,
        omb1: c.omb1,
        b2: c.b2,
        omb2: c.omb2,
        step_size: c.step_size,
        inv_sqrt_bc2: c.inv_sqrt_bc2,
        eps: c.eps,
        decay: c.decay,
        initial_sum: c.initial_sum,
        rule: device_rule(c.rule),
    }
}

/// The GPU kernel's number for an update rule (`AdamConsts::rule` in
/// `kernels/adamw.cu`).
#[cfg(feature = "cuda")]
pub fn device_rule(rule: OptimizerKind) -> u32 {
    match rule {
        OptimizerKind::Adamw | OptimizerKind::Lamb => zcuda::RULE_ADAMW,
        OptimizerKind::Lion => zcuda::RULE_LION,
        OptimizerKind::Adagrad => zcuda::RULE_ADAGRAD,
        OptimizerKind::Adam => zcuda::RULE_ADAM,
    }
}

/// The vector paths this CPU has, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// 16 lanes.
    Avx512,
    /// 8 lanes (with F16C for the f16 conversions).
    Avx2,
    /// Whatever the compiler makes of the plain loop.
    Portable,
}

impl Path {
    /// The best path this CPU supports.
    pub fn best() -> Path {
        Path::available()[0]
    }

    /// Every path this CPU supports, best first (for tests and benchmarks).
    pub fn available() -> Vec<Path> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Path::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                v.push(Path::Avx2);
            }
        }
        v.push(Path::Portable);
        v
    }
}

/// Elements below which splitting over threads costs more than it saves.
const PARALLEL_MIN: usize = 1 << 18;

/// Updates the buffers on the best path, over the threads of the rayon pool
/// it is called in (a worker's is sized by `RAYON_NUM_THREADS`, which zrun
/// sets). Asked of the pool, not of the environment and the OS: Rust's
/// `available_parallelism` reads cgroup files on Linux, tens of µs a call,
/// which was most of an update of a few thousand elements (the test that
/// updates one element at a time, `zero.sub_group_size: 1`, took 18.2 s for
/// it, 0.8 s without).
pub fn adamw(b: Buffers<'_>, decay: bool, s: &AdamStep) {
    adamw_with(Path::best(), rayon::current_num_threads(), b, decay, s);
}

/// [`adamw`] on a given path and thread count.
pub fn adamw_with(path: Path, threads: usize, b: Buffers<'_>, decay: bool, s: &AdamStep) {
    adamw_runs_with(path, threads, vec![(b, decay)], s);
}

/// [`adamw`] over the runs of one update that lie side by side (a group's
/// parameters, each decayed or not), as one parallel region: each thread
/// takes an equal share of all the runs together. Called a run at a time,
/// a run below `PARALLEL_MIN` (2^18; a block's 147k-element output projection,
/// its biases and norms) ran on one thread while the others waited, and
/// every larger run forked and joined on its own.
pub fn adamw_runs(runs: Vec<(Buffers<'_>, bool)>, s: &AdamStep) {
    adamw_runs_with(Path::best(), rayon::current_num_threads(), runs, s);
}

/// [`adamw_runs`] on a given path and thread count.
pub fn adamw_runs_with(path: Path, threads: usize, runs: Vec<(Buffers<'_>, bool)>, s: &AdamStep) {
    assert!(
        s.rule != OptimizerKind::Lamb,
        "LAMB runs in two passes: lamb_moments, then lamb_apply"
    );
    runs.iter().for_each(|(b, _)| b.check(s.rule));
    in_shares(threads, runs, |b, decay| {
        run(path, b, &Scalars::new(s, decay))
    });
}

/// Calls `f` on every run, over `threads` threads where there are enough
/// elements to pay: each thread takes an equal share of all the runs
/// together, runs cut where the shares meet (`T` is what a run's cut parts
/// share, as its decay flag).
fn in_shares<T: Copy + Send>(
    threads: usize,
    runs: Vec<(Buffers<'_>, T)>,
    f: impl Fn(Buffers<'_>, T) + Sync,
) {
    let n: usize = runs.iter().map(|(b, _)| b.len()).sum();
    if threads <= 1 || n < PARALLEL_MIN {
        for (b, t) in runs {
            f(b, t);
        }
        return;
    }
    // Shares split on 64-byte boundaries (of the first run's start) so that
    // no two threads share a cache line.
    let per = n.div_ceil(threads).div_ceil(16) * 16;
    let mut shares = vec![Vec::new()];
    let mut room = per;
    for (mut b, t) in runs {
        while b.len() > 0 {
            let k = room.min(b.len());
            let (head, tail) = b.split_at(k);
            shares.last_mut().expect("a share").push((head, t));
            (b, room) = (tail, room - k);
            if room == 0 {
                shares.push(Vec::new());
                room = per;
            }
        }
    }
    let f = &f;
    rayon::scope(|scope| {
        for share in shares.into_iter().filter(|s| !s.is_empty()) {
            scope.spawn(move |_| {
                for (b, t) in share {
                    f(b, t);
                }
            });
        }
    });
}

/// One segment of LAMB's first pass: buffers lying inside one parameter
/// and one rank's slice, whether decay applies, the flat index of their
/// first element, and that parameter's sums in that slice.
pub type LambSegment<'a, 's> = (Buffers<'a>, bool, usize, &'s mut SquareSums);

/// LAMB's first pass ([`lamb::moments`]) over `segments`, a segment to a
/// task where there are enough elements to pay for threads: each segment
/// adds to its own sums, so the order of the additions is the segments'
/// own whatever the threads.
pub fn lamb_moments(segments: Vec<LambSegment<'_, '_>>, s: &AdamStep) {
    lamb_moments_with(Path::best(), rayon::current_num_threads(), segments, s);
}

/// [`lamb_moments`] on a given path and thread count.
pub fn lamb_moments_with(
    path: Path,
    threads: usize,
    segments: Vec<LambSegment<'_, '_>>,
    s: &AdamStep,
) {
    segments.iter().for_each(|(b, ..)| b.check(s.rule));
    let n: usize = segments.iter().map(|(b, ..)| b.len()).sum();
    let one = |(b, decay, at, sums): LambSegment<'_, '_>| {
        lamb::moments(path, b, at, &LambScalars::new(s, decay), sums)
    };
    if threads <= 1 || n < PARALLEL_MIN {
        segments.into_iter().for_each(one);
        return;
    }
    let one = &one;
    rayon::scope(|scope| {
        for seg in segments {
            scope.spawn(move |_| one(seg));
        }
    });
}

/// LAMB's second pass ([`lamb::apply`]) over runs, each with its decay
/// flag and its parameter's trust ratio, shared over threads as AdamW's.
pub fn lamb_apply(runs: Vec<(Buffers<'_>, (bool, f32))>, s: &AdamStep) {
    lamb_apply_with(Path::best(), rayon::current_num_threads(), runs, s);
}

/// [`lamb_apply`] on a given path and thread count.
pub fn lamb_apply_with(
    path: Path,
    threads: usize,
    runs: Vec<(Buffers<'_>, (bool, f32))>,
    s: &AdamStep,
) {
    runs.iter().for_each(|(b, _)| b.check(s.rule));
    in_shares(threads, runs, |b, (decay, ratio)| {
        lamb::apply(path, b, &LambScalars::new(s, decay), ratio)
    });
}

fn run(path: Path, b: Buffers<'_>, c: &Scalars) {
    match c.rule {
        OptimizerKind::Lion => lion::run(path, b, c),
        OptimizerKind::Adagrad => adagrad::run(path, b, c),
        OptimizerKind::Adam => l2::run(path, b, c),
        OptimizerKind::Adamw | OptimizerKind::Lamb => adamw_run(path, b, c),
    }
}

/// Defines `$vis fn $run(path, b, c)`: `$scalar` (an update's scalar loop,
/// `#[inline(always)]`) compiled for `path`'s ISA, so that the compiler
/// vectorises it with that ISA's lanes (and F16C's conversions), or the
/// portable build where the CPU lacks it. Each operation still rounds on
/// its own (Rust contracts no multiply-add), so every path gives the scalar
/// loop's bits. A macro, not a generic function: a loop passed as a
/// closure or `fn` value was called through a shim compiled without the
/// ISA's features, and ran at the portable loop's speed (0.75-0.94 of the
/// triad for AdamW on AVX2, against 1.04-1.36 written out).
macro_rules! compiled_per_isa {
    ($vis:vis $run:ident, $scalar:path) => {
        $vis fn $run(path: Path, b: Buffers<'_>, c: &Scalars) {
            match path {
                #[cfg(target_arch = "x86_64")]
                Path::Avx512 if std::arch::is_x86_feature_detected!("avx512f") => {
                    // SAFETY: the CPU supports AVX-512F (checked just above).
                    unsafe { avx512(b, c) }
                }
                #[cfg(target_arch = "x86_64")]
                Path::Avx2
                    if std::arch::is_x86_feature_detected!("avx2")
                        && std::arch::is_x86_feature_detected!("f16c") =>
                {
                    // SAFETY: the CPU supports AVX2 and F16C (checked just above).
                    unsafe { avx2(b, c) }
                }
                _ => $scalar(b, c),
            }
        }

        /// The scalar loop compiled with AVX-512's 16 lanes.
        ///
        /// # Safety
        ///
        /// The CPU must support AVX-512F.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512(b: Buffers<'_>, c: &Scalars) {
            $scalar(b, c)
        }

        /// The scalar loop compiled with AVX2's 8 lanes (F16C for f16
        /// gradients).
        ///
        /// # Safety
        ///
        /// The CPU must support AVX2 and F16C.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn avx2(b: Buffers<'_>, c: &Scalars) {
            $scalar(b, c)
        }
    };
}

compiled_per_isa!(adamw_run, scalar);

/// The reference: one element at a time, in the order every path follows.
#[inline(always)]
fn scalar(b: Buffers<'_>, c: &Scalars) {
    let Buffers {
        p,
        g,
        m,
        v,
        working,
    } = b;
    // A loop for each kind of gradient and working copy, with nothing to
    // decide inside, so that the compiler can vectorise it (deciding per
    // element held the portable bf16 update at 0.26 of the triad).
    match g {
        Grads::F32(g) => scalar_loop(p, m, v, g, |g, _| g * c.gscale, working, c),
        Grads::Half(Half::Bf16, g) => scalar_loop(
            p,
            m,
            v,
            g,
            |g, _| Half::Bf16.widen(g) * c.gscale,
            working,
            c,
        ),
        Grads::Half(Half::F16, g) => {
            scalar_loop(p, m, v, g, |g, _| Half::F16.widen(g) * c.gscale, working, c)
        }
    }
}

/// [`scalar`] for one kind of gradient (`grad` gives the gradient the
/// update reads from one and the parameter: widened and scaled, and for
/// Adam with the L2 term), and for one kind of working copy.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn scalar_loop<G: Copy>(
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    grad: impl Fn(G, f32) -> f32,
    working: Option<(Half, &mut [u16])>,
    c: &Scalars,
) {
    let each = p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g);
    let update = |((p, m), v): ((&mut f32, &mut f32), &mut f32), g: G| {
        let gi = grad(g, *p);
        let mi = c.b1 * *m + c.omb1 * gi;
        let vi = c.b2 * *v + c.omb2 * gi * gi;
        *m = mi;
        *v = vi;
        let denom = vi.sqrt() * c.inv_sqrt_bc2 + c.eps;
        let pi = *p * c.decay - c.step_size * mi / denom;
        *p = pi;
        pi
    };
    updating(each, working, |(pmv, &g)| update(pmv, g));
}

/// Runs `update` on each element of `all` (it returns the updated
/// parameter), writing its 16-bit working copy where there is one: a loop
/// for each kind of copy, nothing decided inside, so that the compiler
/// vectorises each.
#[inline(always)]
fn updating<T>(
    all: impl Iterator<Item = T>,
    working: Option<(Half, &mut [u16])>,
    update: impl Fn(T) -> f32,
) {
    match working {
        None => all.for_each(|x| {
            update(x);
        }),
        Some((Half::Bf16, w)) => all
            .zip(w.iter_mut())
            .for_each(|(x, w)| *w = Half::Bf16.round(update(x))),
        Some((Half::F16, w)) => all
            .zip(w.iter_mut())
            .for_each(|(x, w)| *w = Half::F16.round(update(x))),
    }
}

mod adagrad;
mod l2;
pub mod lamb;
mod lion;

pub use lamb::{trust_ratio, LambScalars, SquareSums};

#[cfg(test)]
mod tests {
    use super::*;

    fn step(t: u64) -> AdamStep {
        AdamStep {
            rule: OptimizerKind::Adamw,
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: t,
            bias_correction: true,
            grad_scale: 1.0,
            lr_decay: 0.0,
            initial_sum: 0.0,
        }
    }

    #[test]
    fn first_step_moves_by_lr_against_the_gradient_sign() {
        let s = AdamStep {
            lr: 0.1,
            beta2: 0.999,
            weight_decay: 0.0,
            ..step(1)
        };
        let (mut p, g, mut m, mut v) = (
            vec![1.0, 1.0, 1.0],
            vec![0.5, -2.0, 0.0],
            vec![0.0; 3],
            vec![0.0; 3],
        );
        adamw(Buffers::f32(&mut p, &g, &mut m, &mut v), true, &s);
        // With bias correction the first update is lr · g/|g|.
        assert!((p[0] - 0.9).abs() < 1e-6 && (p[1] - 1.1).abs() < 1e-6 && p[2] == 1.0);
    }

    #[test]
    fn weight_decay_is_decoupled_and_optional() {
        let s = AdamStep {
            lr: 0.1,
            beta2: 0.999,
            weight_decay: 0.5,
            ..step(1)
        };
        let mut p = vec![2.0];
        adamw(
            Buffers::f32(&mut p, &[0.0], &mut [0.0], &mut [0.0]),
            true,
            &s,
        );
        assert!((p[0] - 1.9).abs() < 1e-6);
        let mut q = vec![2.0];
        adamw(
            Buffers::f32(&mut q, &[0.0], &mut [0.0], &mut [0.0]),
            false,
            &s,
        );
        assert_eq!(q[0], 2.0);
    }

    /// Lion's first step from a zero moment moves each parameter by lr
    /// against its gradient's sign (none where the gradient is 0), after
    /// the decoupled decay; the moment becomes (1 − β2)·g; there is no v.
    #[test]
    fn lion_moves_by_lr_against_the_sign() {
        let s = AdamStep {
            rule: OptimizerKind::Lion,
            lr: 0.125,
            weight_decay: 0.5,
            ..step(1)
        };
        let (mut p, g, mut m) = (vec![2.0; 4], vec![0.5, -3.0, 0.0, 1e-30], vec![0.0; 4]);
        adamw(Buffers::f32(&mut p, &g, &mut m, &mut []), true, &s);
        let decayed = 2.0 * (1.0 - 0.125 * 0.5);
        assert_eq!(
            p,
            [decayed - 0.125, decayed + 0.125, decayed, decayed - 0.125]
        );
        let want: Vec<f32> = g.iter().map(|g| (1.0 - 0.95f32) * g).collect();
        assert_eq!(m, want);
        // Undecayed where decay does not apply.
        let mut q = vec![2.0];
        adamw(
            Buffers::f32(&mut q, &[-1.0], &mut [0.0], &mut []),
            false,
            &s,
        );
        assert_eq!(q, [2.125]);
    }

    /// A second moment is AdamW's alone: Lion or Adagrad given one, or AdamW given
    /// none, is refused before anything is written.
    #[test]
    fn the_second_moment_must_match_the_rule() {
        for (rule, v) in [
            (OptimizerKind::Lion, 4),
            (OptimizerKind::Adagrad, 4),
            (OptimizerKind::Adamw, 0),
            (OptimizerKind::Adam, 0),
        ] {
            let s = AdamStep { rule, ..step(1) };
            let refused = std::panic::catch_unwind(|| {
                let (mut p, mut m, mut v) = (vec![1.0; 4], vec![0.0; 4], vec![0.0; v]);
                adamw(Buffers::f32(&mut p, &[1.0; 4], &mut m, &mut v), true, &s);
            });
            assert!(refused.is_err(), "{rule:?} with a v of {v}");
        }
    }

    /// Lion over several steps against PyTorch's formula in f64 (the
    /// direction from the moment before its update; the decay applied to
    /// the parameter before the step): every parameter within f32's
    /// rounding of a few steps, every moment too, on every path.
    #[test]
    fn lion_follows_its_f64_formula() {
        let n = 4099;
        let [p0, _, m0, _] = inputs(n, 11);
        let grads: Vec<Vec<f32>> = (0..5).map(|k| inputs(n, 100 + k)[1].clone()).collect();
        // The coefficients as the kernel holds them (f32), widened.
        let (lr, wd, b1, b2) = (1e-3f32, 0.1f32, 0.9f32, 0.99f32);
        let shrink = f64::from(1.0 - lr * wd);
        let (omb1, omb2) = (f64::from(1.0 - b1), f64::from(1.0 - b2));
        let (lr, b1, b2) = (f64::from(lr), f64::from(b1), f64::from(b2));
        for path in Path::available() {
            let (mut p, mut m) = (p0.clone(), m0.clone());
            let (mut pr, mut mr): (Vec<f64>, Vec<f64>) = (
                p0.iter().map(|&x| f64::from(x)).collect(),
                m0.iter().map(|&x| f64::from(x)).collect(),
            );
            // Each moment's scale: the sum of its terms' magnitudes over
            // the steps (its rounding errors are relative to them).
            let mut scale = vec![0f64; n];
            for (k, g) in grads.iter().enumerate() {
                let s = AdamStep {
                    rule: OptimizerKind::Lion,
                    lr: lr as f32,
                    beta1: b1 as f32,
                    beta2: b2 as f32,
                    eps: 1e-8,
                    weight_decay: wd,
                    step: k as u64 + 1,
                    bias_correction: true,
                    grad_scale: 1.0,
                    lr_decay: 0.0,
                    initial_sum: 0.0,
                };
                adamw_with(path, 2, Buffers::f32(&mut p, g, &mut m, &mut []), true, &s);
                for i in 0..n {
                    let gi = f64::from(g[i]);
                    let c = b1 * mr[i] + omb1 * gi;
                    let sign = if c > 0.0 {
                        1.0
                    } else if c < 0.0 {
                        -1.0
                    } else {
                        0.0
                    };
                    pr[i] = pr[i] * shrink - lr * sign;
                    scale[i] = b2 * scale[i].max(mr[i].abs()) + omb2 * gi.abs();
                    mr[i] = b2 * mr[i] + omb2 * gi;
                }
            }
            for i in 0..n {
                let (got, want) = (f64::from(p[i]), pr[i]);
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
                    "{path:?} p[{i}]: {got} for {want}"
                );
                let (got, want) = (f64::from(m[i]), mr[i]);
                assert!(
                    (got - want).abs() <= 1e-6 * scale[i],
                    "{path:?} m[{i}]: {got} for {want}"
                );
            }
        }
    }

    /// PyTorch's Adam: the L2 term joins the gradient before the moments,
    /// and the parameter is not decayed. Its first step from zero moments
    /// moves each parameter by lr against the sign of `g + λ·p` (none where
    /// that is 0), where AdamW's would shrink it first.
    #[test]
    fn adam_adds_the_decay_to_the_gradient() {
        let s = AdamStep {
            rule: OptimizerKind::Adam,
            lr: 0.125,
            beta2: 0.999,
            weight_decay: 0.5,
            ..step(1)
        };
        let (mut p, g) = (vec![2.0; 3], vec![0.5, -3.0, -1.0]);
        let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
        adamw(Buffers::f32(&mut p, &g, &mut m, &mut v), true, &s);
        // g + 0.5·2 = 1.5, −2, 0.
        let want = [2.0 - 0.125, 2.0 + 0.125, 2.0];
        assert!(
            p.iter().zip(want).all(|(p, w)| (p - w).abs() < 1e-6),
            "{p:?}"
        );
        assert_eq!(m[2], 0.0, "{m:?}");
        assert!((m[0] - 0.1 * 1.5).abs() < 1e-7, "{m:?}");
        // Undecayed: the raw gradient, and nothing for none.
        let mut q = vec![2.0];
        adamw(
            Buffers::f32(&mut q, &[0.0], &mut [0.0], &mut [0.0]),
            false,
            &s,
        );
        assert_eq!(q, [2.0]);
    }

    /// PyTorch's Adam written out in f64 over several steps (L2 decay,
    /// bias corrections, eps outside the root), and DeepSpeed's Adam
    /// without the corrections: every parameter and moment within f32's
    /// rounding of a few steps, on every path.
    #[test]
    fn adam_follows_its_f64_formula() {
        let n = 4099;
        let [p0, _, m0, v0] = inputs(n, 23);
        let grads: Vec<Vec<f32>> = (0..5).map(|k| inputs(n, 300 + k)[1].clone()).collect();
        let (lr, wd, b1, b2, eps) = (1e-3f32, 0.1f32, 0.9f32, 0.95f32, 1e-8f32);
        let (omb1, omb2) = (f64::from(1.0 - b1), f64::from(1.0 - b2));
        let widen = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
        let runs = Path::available()
            .into_iter()
            .flat_map(|path| [(path, true), (path, false)]);
        for (path, corrected) in runs {
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            let (mut pr, mut mr, mut vr) = (widen(&p0), widen(&m0), widen(&v0));
            // The moments' scales: sums of their terms' magnitudes; and
            // the moves' (each step's lr·|m|/√v with m at its scale).
            let (mut ms, mut vs) = (vec![0f64; n], vec![0f64; n]);
            let mut moved = vec![0f64; n];
            for (k, g) in grads.iter().enumerate() {
                let t = k as i32 + 1;
                let s = AdamStep {
                    rule: OptimizerKind::Adam,
                    lr,
                    beta1: b1,
                    beta2: b2,
                    eps,
                    weight_decay: wd,
                    step: t as u64,
                    bias_correction: corrected,
                    ..step(1)
                };
                adamw_with(path, 2, Buffers::f32(&mut p, g, &mut m, &mut v), true, &s);
                let (bc1, bc2) = match corrected {
                    true => (1.0 - f64::from(b1).powi(t), 1.0 - f64::from(b2).powi(t)),
                    false => (1.0, 1.0),
                };
                for i in 0..n {
                    let gi = f64::from(g[i]) + f64::from(wd) * pr[i];
                    ms[i] = f64::from(b1) * ms[i].max(mr[i].abs()) + omb1 * gi.abs();
                    vs[i] = f64::from(b2) * vs[i].max(vr[i]) + omb2 * gi * gi;
                    mr[i] = f64::from(b1) * mr[i] + omb1 * gi;
                    vr[i] = f64::from(b2) * vr[i] + omb2 * gi * gi;
                    let denom = vr[i].sqrt() / bc2.sqrt() + f64::from(eps);
                    pr[i] -= f64::from(lr) / bc1 * mr[i] / denom;
                    moved[i] += f64::from(lr) / bc1 * ms[i] / denom;
                }
            }
            for i in 0..n {
                let close =
                    |got: f32, want: f64, scale: f64| (f64::from(got) - want).abs() <= 1e-6 * scale;
                assert!(
                    close(m[i], mr[i], ms[i]),
                    "{path:?} m[{i}]: {} for {}",
                    m[i],
                    mr[i]
                );
                assert!(
                    close(v[i], vr[i], vs[i]),
                    "{path:?} v[{i}]: {} for {}",
                    v[i],
                    vr[i]
                );
                let scale = pr[i].abs() + moved[i];
                assert!(
                    close(p[i], pr[i], scale),
                    "{path:?} corrected {corrected} p[{i}]: {} for {}",
                    p[i],
                    pr[i]
                );
            }
        }
    }

    /// Adagrad's first step from a zero sum: the gradient (with the L2 term
    /// where decay applies) over its own magnitude, so each parameter moves
    /// by lr (less eps's share) against its sign, none where it is 0; the
    /// sum becomes its square; there is no v.
    #[test]
    fn adagrad_first_step_moves_by_lr_against_the_sign() {
        let s = AdamStep {
            rule: OptimizerKind::Adagrad,
            lr: 0.125,
            eps: 1e-10,
            weight_decay: 0.5,
            ..step(1)
        };
        let (mut p, g, mut sum) = (vec![2.0; 3], vec![0.5, -3.0, -1.0], vec![0.0; 3]);
        adamw(Buffers::f32(&mut p, &g, &mut sum, &mut []), true, &s);
        // g + 0.5·2 = 1.5, −2, 0: the last moves not at all.
        assert_eq!(p, [2.0 - 0.125, 2.0 + 0.125, 2.0]);
        assert_eq!(sum, [2.25, 4.0, 0.0]);
        // Undecayed: the raw gradient.
        let (mut q, mut sum) = (vec![2.0], vec![0.0]);
        adamw(Buffers::f32(&mut q, &[-1.0], &mut sum, &mut []), false, &s);
        assert_eq!((q, sum), (vec![2.125], vec![1.0]));
    }

    /// Adagrad over several steps against PyTorch's `Adagrad` written out
    /// in f64 (L2 decay added to the gradient, the rate decayed by
    /// `lr_decay`, an initial accumulator added before the first square):
    /// every parameter and sum within f32's rounding of a few steps, on
    /// every path.
    #[test]
    fn adagrad_follows_its_f64_formula() {
        let n = 4099;
        let [p0, _, _, v0] = inputs(n, 17);
        let grads: Vec<Vec<f32>> = (0..5).map(|k| inputs(n, 200 + k)[1].clone()).collect();
        // The coefficients as the kernel holds them (f32), widened.
        let (lr, wd, eps, lr_decay, initial) = (1e-2f32, 0.1f32, 1e-10f32, 0.25f32, 0.1f32);
        for path in Path::available() {
            let (mut p, mut sum) = (p0.clone(), v0.clone());
            let widen = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
            let (mut pr, mut sr) = (widen(&p0), widen(&v0));
            for (k, g) in grads.iter().enumerate() {
                let s = AdamStep {
                    rule: OptimizerKind::Adagrad,
                    lr,
                    eps,
                    weight_decay: wd,
                    step: k as u64 + 1,
                    lr_decay,
                    initial_sum: if k == 0 { initial } else { 0.0 },
                    ..step(1)
                };
                adamw_with(
                    path,
                    2,
                    Buffers::f32(&mut p, g, &mut sum, &mut []),
                    true,
                    &s,
                );
                let clr = f64::from(lr) / (1.0 + k as f64 * f64::from(lr_decay));
                for i in 0..n {
                    if k == 0 {
                        sr[i] += f64::from(initial);
                    }
                    let gi = f64::from(g[i]) + f64::from(wd) * pr[i];
                    sr[i] += gi * gi;
                    pr[i] -= clr * gi / (sr[i].sqrt() + f64::from(eps));
                }
            }
            for i in 0..n {
                let (got, want) = (f64::from(sum[i]), sr[i]);
                assert!(
                    (got - want).abs() <= 1e-6 * want.max(1e-30),
                    "{path:?} sum[{i}]: {got} for {want}"
                );
                // Each step moves p by at most clr; its error is relative
                // to p and to those moves.
                let (got, want) = (f64::from(p[i]), pr[i]);
                assert!(
                    (got - want).abs() <= 1e-6 * (want.abs() + 5.0 * f64::from(lr)),
                    "{path:?} p[{i}]: {got} for {want}"
                );
            }
        }
    }

    /// Random-looking inputs spanning many magnitudes, including zeros.
    pub(super) fn inputs(n: usize, seed: u32) -> [Vec<f32>; 4] {
        let mut x = seed.wrapping_mul(2654435761) | 1;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let mant = (x >> 9) as f32 / (1 << 23) as f32 - 0.5;
            let exp = ((x & 0xff) % 12) as i32 - 8;
            if x.is_multiple_of(17) {
                0.0
            } else {
                mant * 2f32.powi(exp)
            }
        };
        let p: Vec<f32> = (0..n).map(|_| next()).collect();
        let g: Vec<f32> = (0..n).map(|_| next()).collect();
        let m: Vec<f32> = (0..n).map(|_| next() * 0.1).collect();
        let v: Vec<f32> = (0..n).map(|_| next().abs() * 0.01).collect();
        [p, g, m, v]
    }

    /// [`inputs`] for `rule`: Adagrad's state is a sum of squares, so its
    /// `m` is the non-negative `v` (a negative one would have a NaN root).
    pub(super) fn inputs_for(rule: OptimizerKind, n: usize, seed: u32) -> [Vec<f32>; 4] {
        let [p, g, m, v] = inputs(n, seed);
        match rule {
            OptimizerKind::Adagrad => [p, g, v.clone(), v],
            _ => [p, g, m, v],
        }
    }

    /// `g` rounded to `kind`'s 16 bits (empty for f32).
    pub(super) fn rounded(kind: Option<Half>, g: &[f32]) -> Vec<u16> {
        kind.map_or(Vec::new(), |h| g.iter().map(|&x| h.round(x)).collect())
    }

    /// The gradients an update reads: `g`, or its 16-bit `gh` under `kind`.
    pub(super) fn grads_of<'a>(kind: Option<Half>, g: &'a [f32], gh: &'a [u16]) -> Grads<'a> {
        match kind {
            None => Grads::F32(g),
            Some(h) => Grads::Half(h, gh),
        }
    }

    /// The precisions an update can run in: gradients and working copy types.
    pub(super) const PRECISIONS: [Option<Half>; 3] = [None, Some(Half::Bf16), Some(Half::F16)];

    /// One update of copies of the inputs; returns (p, m, v, working bits),
    /// v empty for Lion.
    fn update(
        path: Option<Path>,
        threads: usize,
        kind: Option<Half>,
        inputs: &[Vec<f32>; 4],
        offset: usize,
        s: &AdamStep,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<u16>) {
        let [p0, g, m0, v0] = inputs;
        let (mut p, mut m) = (p0.clone(), m0.clone());
        let mut v = match s.rule.second_moment() {
            true => v0.clone(),
            false => Vec::new(),
        };
        let v_from = offset.min(v.len());
        let gh = rounded(kind, g);
        let mut w = vec![0u16; if kind.is_some() { p.len() } else { 0 }];
        let b = Buffers {
            p: &mut p[offset..],
            g: match kind {
                None => Grads::F32(&g[offset..]),
                Some(h) => Grads::Half(h, &gh[offset..]),
            },
            m: &mut m[offset..],
            v: &mut v[v_from..],
            working: kind.map(|h| (h, &mut w[offset..])),
        };
        match (path, s.rule) {
            (None, OptimizerKind::Lion) => lion::scalar(b, &Scalars::new(s, true)),
            (None, OptimizerKind::Adagrad) => adagrad::scalar(b, &Scalars::new(s, true)),
            (None, OptimizerKind::Adam) => l2::scalar(b, &Scalars::new(s, true)),
            (None, _) => scalar(b, &Scalars::new(s, true)),
            (Some(path), _) => adamw_with(path, threads, b, true, s),
        }
        (p, m, v, w)
    }

    /// Every path and thread count gives the scalar reference's bits (well
    /// within 1 ulp), in every precision, for odd lengths and unaligned
    /// starts: AdamW's explicit vector bodies and Adam's, Lion's and
    /// Adagrad's compiler-vectorised loops alike.
    #[test]
    fn every_path_equals_the_scalar_reference() {
        for rule in [
            OptimizerKind::Adamw,
            OptimizerKind::Adam,
            OptimizerKind::Lion,
            OptimizerKind::Adagrad,
        ] {
            let s = AdamStep {
                rule,
                grad_scale: 0.37,
                lr_decay: 0.05,
                initial_sum: 0.25,
                ..step(3)
            };
            every_path_equals_the_scalar_reference_for(&s);
        }
    }

    fn every_path_equals_the_scalar_reference_for(s: &AdamStep) {
        let s = *s;
        for n in [0, 1, 7, 15, 16, 17, 33, 1001, (1 << 18) + 37] {
            for offset in [0, 1, 3] {
                let inputs = inputs_for(s.rule, n + offset, n as u32 + 1);
                for kind in PRECISIONS {
                    let want = update(None, 1, kind, &inputs, offset, &s);
                    for path in Path::available() {
                        for threads in [1, 3] {
                            let got = update(Some(path), threads, kind, &inputs, offset, &s);
                            assert!(
                                got == want,
                                "{:?} {path:?} {kind:?} threads {threads} n {n} offset {offset}",
                                s.rule
                            );
                        }
                    }
                }
            }
        }
    }

    impl<'a> Buffers<'a> {
        /// Buffers over whole vectors, with a working copy in `w` if `kind`.
        pub(super) fn of(
            p: &'a mut [f32],
            g: Grads<'a>,
            m: &'a mut [f32],
            v: &'a mut [f32],
            kind: Option<Half>,
            w: &'a mut [u16],
        ) -> Self {
            let working = kind.map(|h| (h, w));
            Buffers {
                p,
                g,
                m,
                v,
                working,
            }
        }
    }

    /// `b` cut into `runs` (lengths and decay flags), in order.
    fn cut<'a>(runs: &[(usize, bool)], b: Buffers<'a>) -> Vec<(Buffers<'a>, bool)> {
        let mut rest = b;
        let mut out = Vec::new();
        for &(len, decay) in runs {
            let (run, tail) = rest.split_at(len);
            out.push((run, decay));
            rest = tail;
        }
        out
    }

    /// Runs of one update, decayed or not, updated as one region give the
    /// scalar reference's bits run by run, on every path and thread count,
    /// with threads' shares that start and end inside runs.
    #[test]
    fn runs_side_by_side_equal_the_scalar_reference_run_by_run() {
        let s = AdamStep {
            grad_scale: 0.37,
            ..step(5)
        };
        let runs = [
            (5, false),
            (147_461, true),
            (17, false),
            (200_003, true),
            (1, false),
        ];
        let n: usize = runs.iter().map(|r| r.0).sum();
        assert!(n >= PARALLEL_MIN, "the runs take the parallel path");
        let [p0, g, m0, v0] = inputs(n, 99);
        for kind in PRECISIONS {
            let gh = rounded(kind, &g);
            let grads = grads_of(kind, &g, &gh);
            let fresh = || {
                let w = vec![0u16; if kind.is_some() { n } else { 0 }];
                (p0.clone(), m0.clone(), v0.clone(), w)
            };
            let (mut p, mut m, mut v, mut w) = fresh();
            for (b, decay) in cut(
                &runs,
                Buffers::of(&mut p, grads, &mut m, &mut v, kind, &mut w),
            ) {
                scalar(b, &Scalars::new(&s, decay));
            }
            let want = (p, m, v, w);
            for path in Path::available() {
                for threads in [1, 2, 3] {
                    let (mut p, mut m, mut v, mut w) = fresh();
                    let b = Buffers::of(&mut p, grads, &mut m, &mut v, kind, &mut w);
                    adamw_runs_with(path, threads, cut(&runs, b), &s);
                    assert!((p, m, v, w) == want, "{path:?} {kind:?} threads {threads}");
                }
            }
        }
    }

    /// GPU 0 and the step its kernel tests take (gradients scaled), or
    /// `None` where no GPU is (said, and refused with `ZRUN_REQUIRE_GPU=1`).
    #[cfg(feature = "cuda")]
    fn gpu_and_step(test: &str) -> Option<(zcuda::Gpu, AdamStep)> {
        if !zcuda::gpu_or_skip(test, zcuda::probe().usable_devices()) {
            return None;
        }
        let gpu = zcuda::Gpu::open(0).expect("opening GPU 0");
        let s = AdamStep {
            grad_scale: 0.37,
            ..step(3)
        };
        Some((gpu, s))
    }

    /// On a GPU, the device kernel gives the CPU's bits in every precision,
    /// AdamW's update, Adam's, Lion's and Adagrad's (skipped with a printed reason where no GPU
    /// is; `ZRUN_REQUIRE_GPU=1` makes it mandatory).
    #[cfg(feature = "cuda")]
    #[test]
    fn the_gpu_kernel_equals_the_cpu_bit_for_bit() {
        let Some((gpu, s)) = gpu_and_step("the_gpu_kernel_equals_the_cpu_bit_for_bit") else {
            return;
        };
        let [adam, lion, adagrad] = [
            OptimizerKind::Adam,
            OptimizerKind::Lion,
            OptimizerKind::Adagrad,
        ]
        .map(|rule| AdamStep {
            rule,
            lr_decay: 0.05,
            initial_sum: 0.25,
            ..s
        });
        for (s, n) in [s, adam, lion, adagrad]
            .into_iter()
            .flat_map(|s| [1, 1001, (1 << 20) + 37].map(|n| (s, n)))
        {
            let inputs = inputs_for(s.rule, n, n as u32 + 7);
            for kind in PRECISIONS {
                let want = update(None, 1, kind, &inputs, 0, &s);
                let [p, g, m, v] = &inputs;
                let up = |x: &Vec<f32>| gpu.upload(x).unwrap();
                let (mut dp, mut dm, mut dv) = (up(p), up(m), up(v));
                let gh = rounded(kind, g);
                let dg32 = up(g);
                let dgh = gpu
                    .upload(&if kind.is_some() { gh } else { vec![0] })
                    .unwrap();
                let mut dw = gpu.zeros::<u16>(n).unwrap();
                let grads = match kind {
                    None => zcuda::DeviceGrads::F32(dg32.slice(..)),
                    Some(h) => zcuda::DeviceGrads::Half(h, dgh.slice(..)),
                };
                let mut dwv = dw.slice_mut(..);
                let working = kind.map(|h| (h, &mut dwv));
                let second = s.rule.second_moment();
                gpu.adamw(
                    &mut dp.slice_mut(..),
                    grads,
                    &mut dm.slice_mut(..),
                    second.then(|| dv.slice_mut(..)).as_mut(),
                    working,
                    &device_consts(&s, true),
                )
                .unwrap();
                let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                let down = |x: &zcuda::CudaSlice<f32>| bits(gpu.download(x).unwrap());
                let rule = s.rule;
                assert_eq!(down(&dp), bits(want.0), "p, {rule:?} {kind:?} n {n}");
                assert_eq!(down(&dm), bits(want.1), "m, {rule:?} {kind:?} n {n}");
                match second {
                    true => assert_eq!(down(&dv), bits(want.2), "v, {kind:?} n {n}"),
                    false => assert_eq!(down(&dv), bits(v.clone()), "Lion's v, {kind:?} n {n}"),
                }
                if kind.is_some() {
                    assert_eq!(
                        gpu.download(&dw).unwrap(),
                        want.3,
                        "working, {kind:?} n {n}"
                    );
                }
            }
        }
    }

    /// One launch over a group's runs (`Gpu::adamw_runs`) gives the bits of
    /// one launch a run (`Gpu::adamw`, held to the CPU's bits above), each
    /// run with its own decay, whether the parameters are one flat buffer
    /// or a buffer a run (the f32 resident step's tensors), and leaves the
    /// gaps between runs as they were: 21 runs (two launches of at most
    /// 16), touching and apart, the first after a gap, in every precision.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_gpu_kernel_over_runs_equals_a_launch_a_run() {
        let Some((gpu, s)) = gpu_and_step("the_gpu_kernel_over_runs_equals_a_launch_a_run") else {
            return;
        };
        let mut runs = Vec::new();
        let mut at = 5;
        for i in 0..21usize {
            let len = 1 + (i * 37) % 200;
            runs.push((at..at + len, i % 3 != 1));
            at += len + if i % 4 == 0 { 0 } else { 3 };
        }
        let n = at + 9;
        let [p, g, m, v] = inputs(n, 11);
        #[derive(Clone, Copy, PartialEq, Debug)]
        enum Launch {
            ARun,
            Flat,
            Each,
        }
        for kind in PRECISIONS {
            let gh: Vec<u16> = g.iter().map(|&x| kind.map_or(0, |h| h.round(x))).collect();
            let w0: Vec<u16> = (0..n).map(|i| i as u16 ^ 0x5a5a).collect();
            let run = |how: Launch| {
                let up = |x: &[f32]| gpu.upload(x).unwrap();
                let (mut dp, mut dm, mut dv, dg32) = (up(&p), up(&m), up(&v), up(&g));
                let mut own: Vec<_> = runs.iter().map(|(r, _)| up(&p[r.clone()])).collect();
                let dgh = gpu.upload(&gh).unwrap();
                let mut dw = gpu.upload(&w0).unwrap();
                let grads = |r: std::ops::Range<usize>| match kind {
                    None => zcuda::DeviceGrads::F32(dg32.slice(r)),
                    Some(h) => zcuda::DeviceGrads::Half(h, dgh.slice(r)),
                };
                if how == Launch::ARun {
                    for ((r, decay), o) in runs.iter().zip(&mut own) {
                        let mut w = dw.slice_mut(r.clone());
                        gpu.adamw(
                            &mut o.slice_mut(..),
                            grads(r.clone()),
                            &mut dm.slice_mut(r.clone()),
                            Some(&mut dv.slice_mut(r.clone())),
                            kind.map(|h| (h, &mut w)),
                            &device_consts(&s, *decay),
                        )
                        .unwrap();
                    }
                } else {
                    let mut w = dw.slice_mut(..);
                    let (mut flat, mut each) = (dp.slice_mut(..), Vec::new());
                    let params = match how {
                        Launch::Flat => zcuda::RunParams::Flat(&mut flat),
                        _ => {
                            each.extend(own.iter_mut().map(|o| o.slice_mut(..)));
                            zcuda::RunParams::Each(&mut each)
                        }
                    };
                    gpu.adamw_runs(
                        params,
                        grads(0..n),
                        &mut dm.slice_mut(..),
                        Some(&mut dv.slice_mut(..)),
                        kind.map(|h| (h, &mut w)),
                        &device_consts(&s, true),
                        device_consts(&s, false).decay,
                        &runs,
                    )
                    .unwrap();
                }
                let bits = |x: &zcuda::CudaSlice<f32>| {
                    let x = gpu.download(x).unwrap();
                    x.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                // The parameters as one flat buffer: the runs' own buffers
                // laid over the flat one where they were used.
                let mut params = bits(&dp);
                if how != Launch::Flat {
                    for ((r, _), o) in runs.iter().zip(&own) {
                        params[r.clone()].copy_from_slice(&bits(o));
                    }
                }
                (params, bits(&dm), bits(&dv), gpu.download(&dw).unwrap())
            };
            let want = run(Launch::ARun);
            for how in [Launch::Flat, Launch::Each] {
                let got = run(how);
                assert!(want == got, "{kind:?}, {how:?}: the runs' launch differs");
            }
            let got = run(Launch::Flat);
            let untouched = |i: usize| {
                got.0[i] == p[i].to_bits()
                    && got.1[i] == m[i].to_bits()
                    && got.2[i] == v[i].to_bits()
                    && got.3[i] == w0[i]
            };
            let covered = |i: usize| runs.iter().any(|(r, _)| r.contains(&i));
            let gaps: Vec<usize> = (0..n).filter(|&i| !covered(i)).collect();
            assert!(gaps.len() > 40, "gaps: {gaps:?}");
            assert!(
                gaps.iter().all(|&i| untouched(i)),
                "{kind:?}: a gap changed"
            );
            for (r, _) in &runs {
                assert!(!r.clone().all(untouched), "{kind:?}: run {r:?} untouched");
            }
        }
        // A run's own buffer must be the run's length.
        let up = |x: &[f32]| gpu.upload(x).unwrap();
        let (mut dm, mut dv, dg) = (up(&m), up(&v), up(&g));
        let mut own: Vec<_> = runs
            .iter()
            .map(|(r, _)| up(&p[r.start..r.end + 1]))
            .collect();
        let mut each: Vec<_> = own.iter_mut().map(|o| o.slice_mut(..)).collect();
        let e = gpu.adamw_runs(
            zcuda::RunParams::Each(&mut each),
            zcuda::DeviceGrads::F32(dg.slice(..)),
            &mut dm.slice_mut(..),
            Some(&mut dv.slice_mut(..)),
            None,
            &device_consts(&s, true),
            device_consts(&s, false).decay,
            &runs,
        );
        assert!(format!("{:?}", e.unwrap_err()).contains("not its length"));
    }

    /// A block's gradients added into a group's flat buffer in one launch
    /// (`Gpu::add_runs`) give the bits of one `add` or `add_into16` a
    /// tensor, in f32, bf16 and f16, and leave the gaps as they were: 21
    /// tensors, given out of order, touching and apart.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_gpus_gradient_adds_over_runs_equal_an_add_a_tensor() {
        let Some((gpu, _)) = gpu_and_step("the_gpus_gradient_adds_over_runs_equal_an_add_a_tensor")
        else {
            return;
        };
        let mut places = Vec::new();
        let mut at = 3;
        for i in 0..21usize {
            let len = 1 + (i * 53) % 300;
            places.push(at..at + len);
            at += len + if i % 3 == 0 { 0 } else { 5 };
        }
        let n = at + 7;
        let [acc0, x, ..] = inputs(n, 17);
        let parts: Vec<_> = places
            .iter()
            .rev()
            .map(|r| (r.start, gpu.upload(&x[r.clone()]).unwrap()))
            .collect();
        let views: Vec<_> = parts.iter().map(|(at, d)| (*at, d.slice(..))).collect();
        for kind in PRECISIONS {
            let (by_part, by_runs) = match kind {
                None => {
                    let run = |one: bool| {
                        let mut acc = gpu.upload(&acc0).unwrap();
                        if one {
                            let mut view = acc.slice_mut(..);
                            gpu.add_runs(zcuda::AddInto::F32(&mut view), &views)
                                .unwrap();
                        } else {
                            for (at, d) in &parts {
                                gpu.add_at(&mut acc, *at, d).unwrap();
                            }
                        }
                        let got = gpu.download(&acc).unwrap();
                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    };
                    (run(false), run(true))
                }
                Some(h) => {
                    let acc16: Vec<u32> = acc0.iter().map(|&v| u32::from(h.round(v))).collect();
                    let run = |one: bool| {
                        let words: Vec<u16> = acc16.iter().map(|&w| w as u16).collect();
                        let mut acc = gpu.upload(&words).unwrap();
                        if one {
                            let mut view = acc.slice_mut(..);
                            gpu.add_runs(zcuda::AddInto::Half(h, &mut view), &views)
                                .unwrap();
                        } else {
                            for (at, d) in &parts {
                                let mut view = acc.slice_mut(*at..*at + d.len());
                                gpu.add_into16(h, &mut view, &d.slice(..)).unwrap();
                            }
                        }
                        let got = gpu.download(&acc).unwrap();
                        got.iter().map(|&w| u32::from(w)).collect::<Vec<_>>()
                    };
                    (run(false), run(true))
                }
            };
            assert!(by_part == by_runs, "{kind:?}: the runs' launch differs");
            let start = match kind {
                None => acc0.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                Some(h) => acc0.iter().map(|&v| u32::from(h.round(v))).collect(),
            };
            for i in (0..n).filter(|i| !places.iter().any(|r| r.contains(i))) {
                assert_eq!(by_runs[i], start[i], "{kind:?}: gap value {i} changed");
            }
            for r in &places {
                assert!(
                    r.clone().any(|i| by_runs[i] != start[i]),
                    "{kind:?}: nothing added at {r:?}"
                );
            }
        }
        // Places that overlap or run past the buffer are refused.
        let mut acc = gpu.upload(&acc0).unwrap();
        let mut view = acc.slice_mut(..);
        for bad in [
            vec![(0, parts[0].1.slice(..4)), (2, parts[1].1.slice(..4))],
            vec![(n - 2, parts[0].1.slice(..4))],
        ] {
            let e = gpu.add_runs(zcuda::AddInto::F32(&mut view), &bad);
            assert!(
                format!("{:?}", e.unwrap_err()).contains("not sorted apart"),
                "{bad:?}"
            );
        }
    }

    /// The working copy is the updated master rounded to nearest even, and a
    /// 16-bit gradient is read exactly.
    #[test]
    fn working_copy_is_the_rounded_master() {
        let inputs = inputs(4099, 5);
        for kind in [Half::Bf16, Half::F16] {
            let (p, _, _, w) = update(Some(Path::best()), 2, Some(kind), &inputs, 0, &step(2));
            assert!(p.iter().zip(&w).all(|(&x, &b)| kind.round(x) == b));
            // Same update as f32 gradients holding the widened 16-bit values.
            let mut widened = inputs.clone();
            widened[1] = inputs[1]
                .iter()
                .map(|&x| kind.widen(kind.round(x)))
                .collect();
            let (p32, ..) = update(Some(Path::best()), 2, None, &widened, 0, &step(2));
            assert_eq!(p, p32);
        }
    }

    /// Buffers of different lengths are a caller's bug: refused before any
    /// element is touched, on every path.
    #[test]
    #[should_panic(expected = "buffer lengths differ")]
    fn mismatched_buffer_lengths_are_refused() {
        let [mut p, g, mut m, mut v] = inputs(40, 3);
        adamw(
            Buffers::f32(&mut p, &g[..39], &mut m, &mut v),
            true,
            &step(1),
        );
    }

    #[test]
    fn split_updates_equal_the_whole() {
        let n = 1003;
        let [p0, g, m0, v0] = inputs(n, 9);
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        adamw(Buffers::f32(&mut p, &g, &mut m, &mut v), true, &step(7));
        let (mut q, mut m2, mut v2) = (p0, m0, v0);
        for r in [0..100, 100..517, 517..n] {
            adamw(
                Buffers::f32(
                    &mut q[r.clone()],
                    &g[r.clone()],
                    &mut m2[r.clone()],
                    &mut v2[r.clone()],
                ),
                true,
                &step(7),
            );
        }
        assert_eq!(p, q);
        assert_eq!(m, m2);
        assert_eq!(v, v2);
    }
}
