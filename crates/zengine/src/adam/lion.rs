//! Lion's update (Chen et al., 2023), in the pass AdamW's runs in:
//!
//! ```text
//! c = β1·m + (1 − β1)·g        the update's direction, of which only the sign counts
//! p = p·(1 − lr·λ) − lr·sign(c)
//! m = β2·m + (1 − β2)·g
//! ```
//!
//! 20 bytes an element move (p, m and g read, p and m written; with mixed
//! precision a 2-byte gradient in and a 2-byte working copy out, the same
//! 20), against AdamW's 28: the pass is bound by memory as AdamW's is. One
//! scalar loop, compiled once per ISA under `target_feature` so that the
//! compiler vectorises it with that ISA's lanes; each operation rounds on
//! its own (Rust contracts no multiply-add), so every path gives the same
//! bits. `sign` is PyTorch's: 0 for ±0 (the parameter only decays) and NaN
//! for NaN (a NaN gradient poisons the parameter, as AdamW's does, rather
//! than vanishing).

use super::{updating, Buffers, Grads, Path, Scalars};
use crate::precision::Half;

compiled_per_isa!(pub(super) run, scalar);

/// The update, one element at a time in order: a loop for each kind of
/// gradient and of working copy, nothing decided inside.
#[inline(always)]
pub(super) fn scalar(b: Buffers<'_>, c: &Scalars) {
    let Buffers {
        p, g, m, working, ..
    } = b;
    match g {
        Grads::F32(g) => each(p, m, g, |g| g, working, c),
        Grads::Half(Half::Bf16, g) => each(p, m, g, |g| Half::Bf16.widen(g), working, c),
        Grads::Half(Half::F16, g) => each(p, m, g, |g| Half::F16.widen(g), working, c),
    }
}

#[inline(always)]
fn each<G: Copy>(
    p: &mut [f32],
    m: &mut [f32],
    g: &[G],
    grad: impl Fn(G) -> f32,
    working: Option<(Half, &mut [u16])>,
    c: &Scalars,
) {
    let all = p.iter_mut().zip(m.iter_mut()).zip(g);
    let update = |(p, m): (&mut f32, &mut f32), g: G| {
        let gi = grad(g) * c.gscale;
        let ci = c.b1 * *m + c.omb1 * gi;
        *m = c.b2 * *m + c.omb2 * gi;
        let pi = *p * c.decay - c.step_size * sign(ci);
        *p = pi;
        pi
    };
    updating(all, working, |(pm, &g)| update(pm, g));
}

/// PyTorch's `sign`: ±1, the zero itself for ±0, NaN for NaN.
#[inline(always)]
fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        x
    }
}
