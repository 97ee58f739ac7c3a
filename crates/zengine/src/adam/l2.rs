//! PyTorch's Adam (`train.optimizer.type: adam`; DeepSpeed's `Adam` with
//! `adam_w_mode: false`): weight decay added to the gradient, then AdamW's
//! moments and update, the parameter itself not decayed:
//!
//! ```text
//! g = g + λ·p                  (where decay applies; PyTorch skips λ = 0)
//! m, v, p as AdamW's, with 1 in place of 1 − lr·λ
//! ```
//!
//! The arithmetic is the AdamW reference's (`scalar_loop`) on that
//! gradient, every operation rounded on its own, compiled per ISA as every
//! rule's is: 28 bytes an element, as AdamW's.

use super::{scalar_loop, Buffers, Grads, Path, Scalars};
use crate::precision::Half;

compiled_per_isa!(pub(super) run, scalar);

/// The update, one element at a time in order: AdamW's loop for each kind
/// of gradient, with the L2 term or (λ = 0) without, and no decoupled
/// decay.
#[inline(always)]
pub(super) fn scalar(b: Buffers<'_>, c: &Scalars) {
    let Buffers {
        p,
        g,
        m,
        v,
        working,
    } = b;
    match g {
        Grads::F32(g) => each(p, m, v, g, |g| g, working, c),
        Grads::Half(Half::Bf16, g) => each(p, m, v, g, |g| Half::Bf16.widen(g), working, c),
        Grads::Half(Half::F16, g) => each(p, m, v, g, |g| Half::F16.widen(g), working, c),
    }
}

/// [`scalar`] for one kind of gradient (`widen` gives its f32 value).
#[inline(always)]
fn each<G: Copy>(
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    widen: impl Fn(G) -> f32,
    working: Option<(Half, &mut [u16])>,
    c: &Scalars,
) {
    let (lambda, undecayed) = (c.decay, Scalars { decay: 1.0, ..*c });
    match lambda != 0.0 {
        true => scalar_loop(
            p,
            m,
            v,
            g,
            |g, p| widen(g) * c.gscale + lambda * p,
            working,
            &undecayed,
        ),
        false => scalar_loop(p, m, v, g, |g, _| widen(g) * c.gscale, working, &undecayed),
    }
}
