//! PyTorch's Adam (`train.optimizer.type: adam`; DeepSpeed's `Adam` with
//! `adam_w_mode: false`): weight decay added to the gradient, then AdamW's
//! moments and update, the parameter itself not decayed:
//!
//! ```text
//! g = g + λ·p                  (where decay applies; PyTorch skips λ = 0)
//! m, v, p as AdamW's, with 1 in place of 1 − lr·λ
//! ```
//!
//! The arithmetic is the AdamW reference's ([`super::scalar_loop`]) on that
//! gradient, every operation rounded on its own; the loop is compiled per
//! ISA under `target_feature` (as Lion's and Adagrad's), so every path gives
//! its bits, 28 bytes an element as AdamW's.

use super::{scalar_loop, Buffers, Grads, Path, Scalars};
use crate::precision::Half;

/// One Adam update of `b` on `path` (`c.decay` is λ where decay applies,
/// else 0).
pub(super) fn run(path: Path, b: Buffers<'_>, c: &Scalars) {
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
        _ => scalar(b, c),
    }
}

/// [`scalar`] vectorised with AVX-512's 16 lanes.
///
/// # Safety
///
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512(b: Buffers<'_>, c: &Scalars) {
    scalar(b, c)
}

/// [`scalar`] vectorised with AVX2's 8 lanes (F16C for f16 gradients).
///
/// # Safety
///
/// The CPU must support AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn avx2(b: Buffers<'_>, c: &Scalars) {
    scalar(b, c)
}

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
            0,
            &undecayed,
        ),
        false => scalar_loop(
            p,
            m,
            v,
            g,
            |g, _| widen(g) * c.gscale,
            working,
            0,
            &undecayed,
        ),
    }
}
