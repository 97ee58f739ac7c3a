//! The AVX-512 and AVX2 bodies of the fused AdamW pass: the scalar
//! reference's arithmetic, lane by lane, so that every path gives its bits.

use std::arch::x86_64::*;

use super::{scalar, Buffers, Grads, Scalars};
use crate::precision::Half;

/// 16 lanes at a time, then the scalar reference for the tail.
///
/// # Safety
///
/// The CPU must support AVX-512F (the dispatcher checks it at run time).
/// Every buffer must have `b.p`'s length (the caller runs `Buffers::check`);
/// every load and store relies on it.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn avx512(b: Buffers<'_>, c: &Scalars) {
    let n = b.len() / 16 * 16;
    let gscale = _mm512_set1_ps(c.gscale);
    let (b1, omb1) = (_mm512_set1_ps(c.b1), _mm512_set1_ps(c.omb1));
    let (b2, omb2) = (_mm512_set1_ps(c.b2), _mm512_set1_ps(c.omb2));
    let (step, inv, eps, shrink) = (
        _mm512_set1_ps(c.step_size),
        _mm512_set1_ps(c.inv_sqrt_bc2),
        _mm512_set1_ps(c.eps),
        _mm512_set1_ps(c.decay),
    );
    let mut b = b;
    let (p, m, v) = (b.p.as_mut_ptr(), b.m.as_mut_ptr(), b.v.as_mut_ptr());
    let w = b.working.as_mut().map(|(h, w)| (*h, w.as_mut_ptr()));
    let mut i = 0;
    while i < n {
        // SAFETY: i + 16 <= n <= the length of every buffer (checked equal).
        unsafe {
            let graw = match b.g {
                Grads::F32(g) => _mm512_loadu_ps(g.as_ptr().add(i)),
                Grads::Half(h, g) => {
                    let bits = _mm256_loadu_si256(g.as_ptr().add(i).cast());
                    match h {
                        Half::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                            _mm512_cvtepu16_epi32(bits),
                        )),
                        Half::F16 => _mm512_cvtph_ps(bits),
                    }
                }
            };
            let gi = _mm512_mul_ps(graw, gscale);
            let mi = _mm512_add_ps(
                _mm512_mul_ps(b1, _mm512_loadu_ps(m.add(i))),
                _mm512_mul_ps(omb1, gi),
            );
            let vi = _mm512_add_ps(
                _mm512_mul_ps(b2, _mm512_loadu_ps(v.add(i))),
                _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi),
            );
            _mm512_storeu_ps(m.add(i), mi);
            _mm512_storeu_ps(v.add(i), vi);
            let denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), inv), eps);
            let pi = _mm512_sub_ps(
                _mm512_mul_ps(_mm512_loadu_ps(p.add(i)), shrink),
                _mm512_div_ps(_mm512_mul_ps(step, mi), denom),
            );
            _mm512_storeu_ps(p.add(i), pi);
            if let Some((h, w)) = w {
                let half = match h {
                    Half::Bf16 => _mm512_cvtepi32_epi16(bf16_bits512(pi)),
                    Half::F16 => {
                        _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(pi)
                    }
                };
                _mm256_storeu_si256(w.add(i).cast(), half);
            }
        }
        i += 16;
    }
    scalar(b, n, c);
}

/// f32 → bf16 bits in each 32-bit lane, rounding to nearest even and keeping
/// NaN a (quiet) NaN, exactly as `half::bf16::from_f32`.
#[target_feature(enable = "avx512f")]
fn bf16_bits512(x: __m512) -> __m512i {
    let x = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
    let biased = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb);
    let rounded = _mm512_srli_epi32::<16>(biased);
    let abs = _mm512_and_si512(x, _mm512_set1_epi32(0x7fff_ffff));
    let nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f80_0000));
    let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(0x40));
    _mm512_mask_blend_epi32(nan, rounded, quiet)
}

/// 8 lanes at a time, then the scalar reference for the tail.
///
/// # Safety
///
/// The CPU must support AVX2 and F16C (the dispatcher checks it at run
/// time). Every buffer must have `b.p`'s length (the caller runs
/// `Buffers::check`); every load and store relies on it.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn avx2(b: Buffers<'_>, c: &Scalars) {
    let n = b.len() / 8 * 8;
    let gscale = _mm256_set1_ps(c.gscale);
    let (b1, omb1) = (_mm256_set1_ps(c.b1), _mm256_set1_ps(c.omb1));
    let (b2, omb2) = (_mm256_set1_ps(c.b2), _mm256_set1_ps(c.omb2));
    let (step, inv, eps, shrink) = (
        _mm256_set1_ps(c.step_size),
        _mm256_set1_ps(c.inv_sqrt_bc2),
        _mm256_set1_ps(c.eps),
        _mm256_set1_ps(c.decay),
    );
    let mut b = b;
    let (p, m, v) = (b.p.as_mut_ptr(), b.m.as_mut_ptr(), b.v.as_mut_ptr());
    let w = b.working.as_mut().map(|(h, w)| (*h, w.as_mut_ptr()));
    let mut i = 0;
    while i < n {
        // SAFETY: i + 8 <= n <= the length of every buffer (checked equal).
        unsafe {
            let graw = match b.g {
                Grads::F32(g) => _mm256_loadu_ps(g.as_ptr().add(i)),
                Grads::Half(h, g) => {
                    let bits = _mm_loadu_si128(g.as_ptr().add(i).cast());
                    match h {
                        Half::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(
                            _mm256_cvtepu16_epi32(bits),
                        )),
                        Half::F16 => _mm256_cvtph_ps(bits),
                    }
                }
            };
            let gi = _mm256_mul_ps(graw, gscale);
            let mi = _mm256_add_ps(
                _mm256_mul_ps(b1, _mm256_loadu_ps(m.add(i))),
                _mm256_mul_ps(omb1, gi),
            );
            let vi = _mm256_add_ps(
                _mm256_mul_ps(b2, _mm256_loadu_ps(v.add(i))),
                _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi),
            );
            _mm256_storeu_ps(m.add(i), mi);
            _mm256_storeu_ps(v.add(i), vi);
            let denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), inv), eps);
            let pi = _mm256_sub_ps(
                _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), shrink),
                _mm256_div_ps(_mm256_mul_ps(step, mi), denom),
            );
            _mm256_storeu_ps(p.add(i), pi);
            if let Some((h, w)) = w {
                let half = match h {
                    Half::Bf16 => {
                        let lanes = bf16_bits256(pi);
                        // Every lane is below 0x10000, so the saturating pack is exact.
                        _mm_packus_epi32(
                            _mm256_castsi256_si128(lanes),
                            _mm256_extracti128_si256::<1>(lanes),
                        )
                    }
                    Half::F16 => _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(pi),
                };
                _mm_storeu_si128(w.add(i).cast(), half);
            }
        }
        i += 8;
    }
    scalar(b, n, c);
}

/// [`bf16_bits512`] on 8 lanes.
#[target_feature(enable = "avx2")]
fn bf16_bits256(x: __m256) -> __m256i {
    let x = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
    let biased = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb);
    let rounded = _mm256_srli_epi32::<16>(biased);
    let abs = _mm256_and_si256(x, _mm256_set1_epi32(0x7fff_ffff));
    let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80_0000));
    let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(0x40));
    _mm256_blendv_epi8(rounded, quiet, nan)
}
