//! AdamW over a flat f32 slice in one fused pass: read p, g, m, v; write p, m, v.
//!
//! The loop is written so that the compiler vectorises it (no branches in the
//! body; the decay flag is hoisted per parameter range). Each element's update
//! depends only on its own p, g, m, v and the step's scalars, so the result does
//! not depend on how the buffer is split over ranks: stage 0's full update equals
//! the gathered slices of the partitioned stages.

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

/// Updates `p`, `m`, `v` in place from `g`; `decay` says whether weight decay applies.
pub fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], decay: bool, s: &AdamStep) {
    assert!(
        p.len() == g.len() && p.len() == m.len() && p.len() == v.len(),
        "adamw: slice lengths differ"
    );
    let bc1 = 1.0 - (s.beta1 as f64).powi(s.step as i32);
    let bc2 = 1.0 - (s.beta2 as f64).powi(s.step as i32);
    let step_size = (s.lr as f64 / bc1) as f32;
    let inv_sqrt_bc2 = (1.0 / bc2.sqrt()) as f32;
    let shrink = if decay {
        1.0 - s.lr * s.weight_decay
    } else {
        1.0
    };
    let (b1, b2, eps) = (s.beta1, s.beta2, s.eps);
    for i in 0..p.len() {
        let gi = g[i];
        let mi = b1 * m[i] + (1.0 - b1) * gi;
        let vi = b2 * v[i] + (1.0 - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        let denom = vi.sqrt() * inv_sqrt_bc2 + eps;
        p[i] = p[i] * shrink - step_size * mi / denom;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn split_updates_equal_the_whole() {
        let s = AdamStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 7,
        };
        let n = 1003;
        let p0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let (mut p, mut m, mut v) = (p0.clone(), vec![0.01; n], vec![0.02; n]);
        adamw(&mut p, &g, &mut m, &mut v, true, &s);
        let (mut q, mut m2, mut v2) = (p0, vec![0.01; n], vec![0.02; n]);
        for r in [0..100, 100..517, 517..n] {
            adamw(
                &mut q[r.clone()],
                &g[r.clone()],
                &mut m2[r.clone()],
                &mut v2[r.clone()],
                true,
                &s,
            );
        }
        assert_eq!(p, q);
        assert_eq!(m, m2);
        assert_eq!(v, v2);
    }
}
