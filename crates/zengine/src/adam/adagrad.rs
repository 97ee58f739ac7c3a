//! Adagrad's update (Duchi et al., 2011), as PyTorch's `torch.optim.Adagrad`
//! computes it, in the pass AdamW's runs in, its sum of squares in `m`:
//!
//! ```text
//! g = g + λ·p                  weight decay added to the gradient (L2)
//! s = s + g·g                  (s + s0 + g·g at the first update: PyTorch's
//!                              initial_accumulator_value, s0)
//! p = p − (lr_t·g) / (√s + eps)    lr_t = lr / (1 + (t − 1)·lr_decay)
//! ```
//!
//! (DeepSpeed's `Adagrad` runs this PyTorch optimizer; its CPU Adagrad,
//! which it takes instead under offload, divides the gradient without the
//! L2 term, a difference only where weight decay is on.) Each operation is
//! PyTorch's, in its order (its `addcdiv` multiplies by the rate, divides,
//! then adds), each rounded on its own as AdamW's and Lion's are. PyTorch's
//! own bits are out of reach: its CPU kernels fuse `s + g·g` and `g + λ·p`
//! into multiply-adds and take an approximate square root (on AVX2, torch
//! 2.15's differs from the correctly rounded one in 16% of elements), so
//! the two agree to f32's rounding instead: over six steps of 100k
//! elements (with and without weight decay and `lr_decay`), each within
//! 2.7e-7 of an f64 reference (relative to |p| + 6·lr), and of each other
//! within 1.7e-7, 83-91% of parameters bit for bit.
//!
//! 20 bytes an element move, as Lion's (p, s and g read, p and s written;
//! with mixed precision a 2-byte gradient in and a 2-byte working copy
//! out): bound by memory. One scalar loop compiled per ISA under
//! `target_feature`, as Lion's: every path gives the same bits.

use super::{updating, Buffers, Grads, Path, Scalars};
use crate::precision::Half;

compiled_per_isa!(pub(super) run, scalar);

/// The update, one element at a time in order: a loop for each kind of
/// gradient, of working copy and of decay, nothing decided inside.
#[inline(always)]
pub(super) fn scalar(b: Buffers<'_>, c: &Scalars) {
    let Buffers {
        p, g, m, working, ..
    } = b;
    match g {
        Grads::F32(g) => decayed_or_not(p, m, g, |g| g, working, c),
        Grads::Half(Half::Bf16, g) => decayed_or_not(p, m, g, |g| Half::Bf16.widen(g), working, c),
        Grads::Half(Half::F16, g) => decayed_or_not(p, m, g, |g| Half::F16.widen(g), working, c),
    }
}

/// [`each`] with the L2 term, or without it where the decay is 0 (as
/// PyTorch skips it: adding 0·p would turn an infinite p into NaN).
#[inline(always)]
fn decayed_or_not<G: Copy>(
    p: &mut [f32],
    s: &mut [f32],
    g: &[G],
    grad: impl Fn(G) -> f32,
    working: Option<(Half, &mut [u16])>,
    c: &Scalars,
) {
    match c.decay != 0.0 {
        true => each(p, s, g, |g, p| grad(g) * c.gscale + c.decay * p, working, c),
        false => each(p, s, g, |g, _| grad(g) * c.gscale, working, c),
    }
}

#[inline(always)]
fn each<G: Copy>(
    p: &mut [f32],
    s: &mut [f32],
    g: &[G],
    grad: impl Fn(G, f32) -> f32,
    working: Option<(Half, &mut [u16])>,
    c: &Scalars,
) {
    let all = p.iter_mut().zip(s.iter_mut()).zip(g);
    let update = |(p, s): (&mut f32, &mut f32), g: G| {
        let gi = grad(g, *p);
        let si = (*s + c.initial_sum) + gi * gi;
        *s = si;
        let pi = *p - c.step_size * gi / (si.sqrt() + c.eps);
        *p = pi;
        pi
    };
    updating(all, working, |(ps, &g)| update(ps, g));
}
