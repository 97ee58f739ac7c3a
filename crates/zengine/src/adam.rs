//! AdamW over a flat f32 slice in one fused pass: read p, g, m, v; write p, m, v.
//!
//! The pass is bound by memory bandwidth, not arithmetic: 28 bytes move per
//! element (4 read, 3 written) for about 12 flops. So the explicit AVX-512 and
//! AVX2 bodies (chosen at run time; a portable loop otherwise) only have to keep
//! the loads streaming, and large slices are split over threads.
//!
//! Every path evaluates the same expression in the same order with plain
//! multiplies and adds (no FMA: a fused multiply-add rounds differently) and
//! correctly rounded `sqrt` and division, so every path gives the same bits as
//! the scalar reference. That is what keeps stage 0's full update equal to the
//! gathered slices of stages 1-3 whatever the slice boundaries and the CPU.

/// Hyper-parameters of one AdamW step.
#[derive(Debug, Clone, Copy)]
pub struct AdamStep {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Decoupled weight decay (applied where the range asks for it).
    pub weight_decay: f32,
    /// 1-based step, for bias correction.
    pub step: u64,
}

/// Per-step scalars shared by every path.
#[derive(Debug, Clone, Copy)]
struct Consts {
    b1: f32,
    omb1: f32,
    b2: f32,
    omb2: f32,
    step_size: f32,
    inv_sqrt_bc2: f32,
    eps: f32,
    shrink: f32,
}

impl Consts {
    fn new(s: &AdamStep, decay: bool) -> Consts {
        let bc1 = 1.0 - (s.beta1 as f64).powi(s.step as i32);
        let bc2 = 1.0 - (s.beta2 as f64).powi(s.step as i32);
        Consts {
            b1: s.beta1,
            omb1: 1.0 - s.beta1,
            b2: s.beta2,
            omb2: 1.0 - s.beta2,
            step_size: (s.lr as f64 / bc1) as f32,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
            eps: s.eps,
            shrink: if decay {
                1.0 - s.lr * s.weight_decay
            } else {
                1.0
            },
        }
    }
}

/// The vector paths this CPU has, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// 16 lanes.
    Avx512,
    /// 8 lanes.
    Avx2,
    /// Whatever the compiler makes of the plain loop.
    Portable,
}

impl Path {
    /// The best path this CPU supports.
    pub fn best() -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Path::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Path::Avx2;
            }
        }
        Path::Portable
    }

    /// Every path this CPU supports (for tests and benchmarks).
    pub fn available() -> Vec<Path> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Path::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                v.push(Path::Avx2);
            }
        }
        v.push(Path::Portable);
        v
    }
}

/// Elements below which splitting over threads costs more than it saves.
const PARALLEL_MIN: usize = 1 << 18;

/// Updates `p`, `m`, `v` in place from `g` on the best path, over `threads` threads.
pub fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], decay: bool, s: &AdamStep) {
    adamw_with(Path::best(), default_threads(), p, g, m, v, decay, s);
}

/// Threads to use: `RAYON_NUM_THREADS` (which zrun sets per worker), else all cores.
pub fn default_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// [`adamw`] on a given path and thread count.
#[allow(clippy::too_many_arguments)]
pub fn adamw_with(
    path: Path,
    threads: usize,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    decay: bool,
    s: &AdamStep,
) {
    assert!(
        p.len() == g.len() && p.len() == m.len() && p.len() == v.len(),
        "adamw: slice lengths differ"
    );
    let c = Consts::new(s, decay);
    let n = p.len();
    if threads <= 1 || n < PARALLEL_MIN {
        return run(path, p, g, m, v, &c);
    }
    // Split on 64-byte boundaries so no two threads share a cache line.
    let per = n.div_ceil(threads).div_ceil(16) * 16;
    std::thread::scope(|scope| {
        let (mut p, mut g, mut m, mut v) = (p, g, m, v);
        while !p.is_empty() {
            let k = per.min(p.len());
            let (p0, p1) = p.split_at_mut(k);
            let (g0, g1) = g.split_at(k);
            let (m0, m1) = m.split_at_mut(k);
            let (v0, v1) = v.split_at_mut(k);
            scope.spawn(move || run(path, p0, g0, m0, v0, &c));
            (p, g, m, v) = (p1, g1, m1, v1);
        }
    });
}

fn run(path: Path, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: &Consts) {
    match path {
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 if std::arch::is_x86_feature_detected!("avx512f") => {
            // SAFETY: the CPU supports AVX-512F (checked just above).
            unsafe { x86::avx512(p, g, m, v, c) }
        }
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 if std::arch::is_x86_feature_detected!("avx2") => {
            // SAFETY: the CPU supports AVX2 (checked just above).
            unsafe { x86::avx2(p, g, m, v, c) }
        }
        _ => scalar(p, g, m, v, c),
    }
}

/// The reference: one element at a time, in the order every path follows.
#[inline(always)]
fn scalar(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: &Consts) {
    for i in 0..p.len() {
        let gi = g[i];
        let mi = c.b1 * m[i] + c.omb1 * gi;
        let vi = c.b2 * v[i] + c.omb2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        let denom = vi.sqrt() * c.inv_sqrt_bc2 + c.eps;
        p[i] = p[i] * c.shrink - c.step_size * mi / denom;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{scalar, Consts};

    /// 16 lanes at a time, then the scalar reference for the tail.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512(
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        c: &Consts,
    ) {
        let n = p.len() / 16 * 16;
        let (b1, omb1) = (_mm512_set1_ps(c.b1), _mm512_set1_ps(c.omb1));
        let (b2, omb2) = (_mm512_set1_ps(c.b2), _mm512_set1_ps(c.omb2));
        let (step, inv, eps, shrink) = (
            _mm512_set1_ps(c.step_size),
            _mm512_set1_ps(c.inv_sqrt_bc2),
            _mm512_set1_ps(c.eps),
            _mm512_set1_ps(c.shrink),
        );
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= n <= len of every slice (lengths are equal).
            unsafe {
                let gi = _mm512_loadu_ps(g.as_ptr().add(i));
                let mi = _mm512_add_ps(
                    _mm512_mul_ps(b1, _mm512_loadu_ps(m.as_ptr().add(i))),
                    _mm512_mul_ps(omb1, gi),
                );
                let vi = _mm512_add_ps(
                    _mm512_mul_ps(b2, _mm512_loadu_ps(v.as_ptr().add(i))),
                    _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi),
                );
                _mm512_storeu_ps(m.as_mut_ptr().add(i), mi);
                _mm512_storeu_ps(v.as_mut_ptr().add(i), vi);
                let denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), inv), eps);
                let pi = _mm512_sub_ps(
                    _mm512_mul_ps(_mm512_loadu_ps(p.as_ptr().add(i)), shrink),
                    _mm512_div_ps(_mm512_mul_ps(step, mi), denom),
                );
                _mm512_storeu_ps(p.as_mut_ptr().add(i), pi);
            }
            i += 16;
        }
        scalar(&mut p[n..], &g[n..], &mut m[n..], &mut v[n..], c);
    }

    /// 8 lanes at a time, then the scalar reference for the tail.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn avx2(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: &Consts) {
        let n = p.len() / 8 * 8;
        let (b1, omb1) = (_mm256_set1_ps(c.b1), _mm256_set1_ps(c.omb1));
        let (b2, omb2) = (_mm256_set1_ps(c.b2), _mm256_set1_ps(c.omb2));
        let (step, inv, eps, shrink) = (
            _mm256_set1_ps(c.step_size),
            _mm256_set1_ps(c.inv_sqrt_bc2),
            _mm256_set1_ps(c.eps),
            _mm256_set1_ps(c.shrink),
        );
        let mut i = 0;
        while i < n {
            // SAFETY: i + 8 <= n <= len of every slice (lengths are equal).
            unsafe {
                let gi = _mm256_loadu_ps(g.as_ptr().add(i));
                let mi = _mm256_add_ps(
                    _mm256_mul_ps(b1, _mm256_loadu_ps(m.as_ptr().add(i))),
                    _mm256_mul_ps(omb1, gi),
                );
                let vi = _mm256_add_ps(
                    _mm256_mul_ps(b2, _mm256_loadu_ps(v.as_ptr().add(i))),
                    _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi),
                );
                _mm256_storeu_ps(m.as_mut_ptr().add(i), mi);
                _mm256_storeu_ps(v.as_mut_ptr().add(i), vi);
                let denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), inv), eps);
                let pi = _mm256_sub_ps(
                    _mm256_mul_ps(_mm256_loadu_ps(p.as_ptr().add(i)), shrink),
                    _mm256_div_ps(_mm256_mul_ps(step, mi), denom),
                );
                _mm256_storeu_ps(p.as_mut_ptr().add(i), pi);
            }
            i += 8;
        }
        scalar(&mut p[n..], &g[n..], &mut m[n..], &mut v[n..], c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(t: u64) -> AdamStep {
        AdamStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: t,
        }
    }

    #[test]
    fn first_step_moves_by_lr_against_the_gradient_sign() {
        let s = AdamStep {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            step: 1,
        };
        let (mut p, g, mut m, mut v) = (
            vec![1.0, 1.0, 1.0],
            vec![0.5, -2.0, 0.0],
            vec![0.0; 3],
            vec![0.0; 3],
        );
        adamw(&mut p, &g, &mut m, &mut v, true, &s);
        // With bias correction the first update is lr · g/|g|.
        assert!((p[0] - 0.9).abs() < 1e-6 && (p[1] - 1.1).abs() < 1e-6 && p[2] == 1.0);
    }

    #[test]
    fn weight_decay_is_decoupled_and_optional() {
        let s = AdamStep {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.5,
            step: 1,
        };
        let mut p = vec![2.0];
        adamw(&mut p, &[0.0], &mut [0.0], &mut [0.0], true, &s);
        assert!((p[0] - 1.9).abs() < 1e-6);
        let mut q = vec![2.0];
        adamw(&mut q, &[0.0], &mut [0.0], &mut [0.0], false, &s);
        assert_eq!(q[0], 2.0);
    }

    /// Random-looking inputs spanning many magnitudes, including zeros.
    fn inputs(n: usize, seed: u32) -> [Vec<f32>; 4] {
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

    /// Every path and thread count gives the scalar reference's bits (well
    /// within 1 ulp), for odd lengths and unaligned starts.
    #[test]
    fn every_path_equals_the_scalar_reference() {
        for n in [0, 1, 7, 15, 16, 17, 33, 1001, (1 << 18) + 37] {
            for offset in [0, 1, 3] {
                let [p0, g, m0, v0] = inputs(n + offset, n as u32 + 1);
                let mut want = (p0.clone(), m0.clone(), v0.clone());
                scalar(
                    &mut want.0[offset..],
                    &g[offset..],
                    &mut want.1[offset..],
                    &mut want.2[offset..],
                    &Consts::new(&step(3), true),
                );
                for path in Path::available() {
                    for threads in [1, 3] {
                        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
                        adamw_with(
                            path,
                            threads,
                            &mut p[offset..],
                            &g[offset..],
                            &mut m[offset..],
                            &mut v[offset..],
                            true,
                            &step(3),
                        );
                        assert!(
                            p == want.0 && m == want.1 && v == want.2,
                            "{path:?} threads {threads} n {n} offset {offset}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn split_updates_equal_the_whole() {
        let n = 1003;
        let [p0, g, m0, v0] = inputs(n, 9);
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        adamw(&mut p, &g, &mut m, &mut v, true, &step(7));
        let (mut q, mut m2, mut v2) = (p0, m0, v0);
        for r in [0..100, 100..517, 517..n] {
            adamw(
                &mut q[r.clone()],
                &g[r.clone()],
                &mut m2[r.clone()],
                &mut v2[r.clone()],
                true,
                &step(7),
            );
        }
        assert_eq!(p, q);
        assert_eq!(m, m2);
        assert_eq!(v, v2);
    }
}
