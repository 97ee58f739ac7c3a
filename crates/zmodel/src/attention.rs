//! Causal self-attention as one custom op with its own backward.
//!
//! Composed from candle ops, attention was the largest cost of a block that is
//! not a GEMM: three head copies, the scale, the mask add, a five-op softmax and
//! the backward of each (16 ms a block for softmax alone at 4×6×128×128). Here
//! one task per (sequence, head) runs on rayon's threads: `S = Q·Kᵀ/√d` by the
//! `gemm` crate straight from the `[b, t, 3d]` projection (strides, no copies),
//! the causal softmax row by row while S is in cache, then `Y = P·V` written
//! into the `[b, t, d]` layout the output projection reads. Backward recomputes P
//! (FlashAttention's trade: a 128×128 GEMM instead of keeping P for every block)
//! and computes dV = Pᵀ·dY, dP = dY·Vᵀ, dS = P ⊙ (dP − rowsum(dP ⊙ P)),
//! dQ = dS·K/√d, dK = dSᵀ·Q/√d into one `[b, t, 3d]` gradient. The tests check
//! both ways against the composed version.
//!
//! Grouped-query attention (LLaMA's `n_kv_heads`): the projection is
//! `[b, t, (heads + 2·kv)·hd]`, and query head `h` reads key/value head
//! `h / (heads / kv)`. Backward runs one task per (sequence, key/value head)
//! that goes through its query heads in order, adding their dK and dV in that
//! order (no two tasks write the same columns; the bits do not depend on the
//! threads). With `kv = heads` it is the plain multi-head case, unchanged.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use crate::ops::f32_input;
use crate::simd::{exp, vectorised};

/// The heads of one attention: `heads` query heads sharing `kv` key/value heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; divides `heads`.
    pub kv: usize,
}

/// `y[b, t, heads·hd]` of causal attention over `qkv[b, t, (heads + 2·kv)·hd]`
/// (q, k and v side by side).
pub fn causal_attention(qkv: &Tensor, heads: Heads) -> Result<Tensor> {
    qkv.contiguous()?.apply_op1(CausalAttention { heads })
}

/// d qkv of [`causal_attention`] from its input and the gradient of its output.
pub fn causal_attention_backward(qkv: &Tensor, dy: &Tensor, heads: Heads) -> Result<Tensor> {
    qkv.contiguous()?
        .apply_op2_no_bwd(&dy.contiguous()?, &CausalAttentionGrad { heads })
}

struct CausalAttention {
    heads: Heads,
}

/// Shapes of one call.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    /// Width of a row of qkv.
    w: usize,
    /// Width of a row of the output: heads × hd.
    d: usize,
    hd: usize,
    heads: usize,
    /// Query heads per key/value head.
    group: usize,
}

impl Dims {
    fn of(l: &Layout, h: Heads) -> Result<Dims> {
        let (b, t, w) = l.shape().dims3()?;
        let all = h.heads + 2 * h.kv;
        if h.kv == 0 || !h.heads.is_multiple_of(h.kv) || !w.is_multiple_of(all) {
            candle_core::bail!(
                "attention: last dim {w} is not ({} + 2 × {}) heads × head size",
                h.heads,
                h.kv
            );
        }
        let hd = w / all;
        Ok(Dims {
            b,
            t,
            w,
            d: h.heads * hd,
            hd,
            heads: h.heads,
            group: h.heads / h.kv,
        })
    }

    /// Column of query head `h` in a row of qkv.
    fn q(&self, h: usize) -> usize {
        h * self.hd
    }

    /// Column of the key of key/value head `g`.
    fn k(&self, g: usize) -> usize {
        self.d + g * self.hd
    }

    /// Column of the value of key/value head `g`.
    fn v(&self, g: usize) -> usize {
        self.d + (self.heads / self.group + g) * self.hd
    }
}

/// A pointer that tasks writing disjoint elements may share.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: every task writes only its own (sequence, head) columns.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    /// The element `off` places further.
    fn at(self, off: usize) -> *mut f32 {
        self.0.wrapping_add(off)
    }
}

/// `dst[m×n] = beta · lhs[m×k] · rhs[k×n]` (`add`: `dst += …`),
/// single-threaded, with element strides (row, column) for each matrix.
///
/// # Safety
///
/// For every `i < m`, `j < n`, `l < k`, the elements `dst[i·dst_rs + j·dst_cs]`,
/// `lhs[i·lhs_rs + l·lhs_cs]` and `rhs[l·rhs_rs + j·rhs_cs]` must be in bounds
/// of live allocations, `dst`'s elements written by no one else during the
/// call, and `dst` must not overlap `lhs` or `rhs`.
#[allow(clippy::too_many_arguments)]
unsafe fn matmul(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    (dst_rs, dst_cs): (usize, usize),
    lhs: *const f32,
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: *const f32,
    (rhs_rs, rhs_cs): (usize, usize),
    beta: f32,
    add: bool,
) {
    // SAFETY: the caller guarantees every strided access is in bounds.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_cs as isize,
            dst_rs as isize,
            add,
            lhs,
            lhs_cs as isize,
            lhs_rs as isize,
            rhs,
            rhs_cs as isize,
            rhs_rs as isize,
            if add { 1.0 } else { 0.0 },
            beta,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}

/// P = causal softmax(Q·Kᵀ·scale) of sequence `bi`, query head `h` into `p[t×t]`.
fn probabilities(qkv: &[f32], dm: Dims, bi: usize, h: usize, p: &mut [f32]) {
    let (t, w) = (dm.t, dm.w);
    let base = bi * t * w;
    let q = qkv[base + dm.q(h)..].as_ptr();
    let k = qkv[base + dm.k(h / dm.group)..].as_ptr();
    let scale = 1.0 / (dm.hd as f32).sqrt();
    // SAFETY: rows i < t of q and k at stride w, columns < hd, lie in qkv; p has t×t.
    unsafe {
        matmul(
            (t, t, dm.hd),
            p.as_mut_ptr(),
            (t, 1),
            q,
            (w, 1),
            k,
            (1, w),
            scale,
            false,
        )
    };
    vectorised(|| {
        for (i, row) in p.chunks_exact_mut(t).enumerate() {
            let (live, masked) = row.split_at_mut(i + 1);
            let max = live.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            live.iter_mut().for_each(|v| *v = exp(*v - max));
            let inv = 1.0 / live.iter().sum::<f32>();
            live.iter_mut().for_each(|v| *v *= inv);
            masked.fill(0.0);
        }
    });
}

impl CustomOp1 for CausalAttention {
    fn name(&self) -> &'static str {
        "zrun-causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let qkv = f32_input(self.name(), s, l)?;
        let dm = Dims::of(l, self.heads)?;
        let (t, d, w) = (dm.t, dm.d, dm.w);
        let mut y = vec![0f32; dm.b * t * d];
        let out = Shared(y.as_mut_ptr());
        (0..dm.b * dm.heads).into_par_iter().for_each_init(
            || vec![0f32; t * t],
            |p, task| {
                let (bi, h) = (task / dm.heads, task % dm.heads);
                probabilities(qkv, dm, bi, h, p);
                let v = qkv[bi * t * w + dm.v(h / dm.group)..].as_ptr();
                // SAFETY: y rows of sequence bi, columns of head h (disjoint per
                // task); v rows at stride w lie in qkv.
                unsafe {
                    matmul(
                        (t, dm.hd, t),
                        out.at(bi * t * d + h * dm.hd),
                        (d, 1),
                        p.as_ptr(),
                        (t, 1),
                        v,
                        (w, 1),
                        1.0,
                        false,
                    )
                };
            },
        );
        Ok((CpuStorage::F32(y), Shape::from_dims(&[dm.b, t, d])))
    }

    fn bwd(&self, qkv: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(causal_attention_backward(qkv, dy, self.heads)?))
    }
}

/// d qkv from (qkv, dy).
struct CausalAttentionGrad {
    heads: Heads,
}

impl CustomOp2 for CausalAttentionGrad {
    fn name(&self) -> &'static str {
        "zrun-causal-attention-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let qkv = f32_input(self.name(), s1, l1)?;
        let dy = f32_input(self.name(), s2, l2)?;
        let dm = Dims::of(l1, self.heads)?;
        let (t, d, w, hd) = (dm.t, dm.d, dm.w, dm.hd);
        if dy.len() != dm.b * t * d {
            candle_core::bail!("attention backward: dy has {} elements", dy.len());
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut dqkv = vec![0f32; qkv.len()];
        let out = Shared(dqkv.as_mut_ptr());
        let kv_heads = dm.heads / dm.group;
        (0..dm.b * kv_heads).into_par_iter().for_each_init(
            || (vec![0f32; t * t], vec![0f32; t * t]),
            |(p, dp), task| {
                let (bi, g) = (task / kv_heads, task % kv_heads);
                let base = bi * t * w;
                let (k, v) = (
                    qkv[base + dm.k(g)..].as_ptr(),
                    qkv[base + dm.v(g)..].as_ptr(),
                );
                for (nth, h) in (g * dm.group..(g + 1) * dm.group).enumerate() {
                    // The group's first query head writes dK and dV, the
                    // others add to them, in order.
                    let add = nth > 0;
                    probabilities(qkv, dm, bi, h, p);
                    let q = qkv[base + dm.q(h)..].as_ptr();
                    let dy_h = dy[bi * t * d + h * hd..].as_ptr();
                    // SAFETY: as in forward; each task writes only the columns
                    // of its key/value head and of that head's query heads.
                    unsafe {
                        // dV (+)= Pᵀ · dY
                        matmul(
                            (t, hd, t),
                            out.at(base + dm.v(g)),
                            (w, 1),
                            p.as_ptr(),
                            (1, t),
                            dy_h,
                            (d, 1),
                            1.0,
                            add,
                        );
                        // dP = dY · Vᵀ
                        matmul(
                            (t, t, hd),
                            dp.as_mut_ptr(),
                            (t, 1),
                            dy_h,
                            (d, 1),
                            v,
                            (1, w),
                            1.0,
                            false,
                        );
                    }
                    // dS = P ⊙ (dP − rowsum(dP ⊙ P)), in place of dP.
                    vectorised(|| {
                        for (prow, dprow) in p.chunks_exact(t).zip(dp.chunks_exact_mut(t)) {
                            let c: f32 = prow.iter().zip(dprow.iter()).map(|(a, b)| a * b).sum();
                            dprow
                                .iter_mut()
                                .zip(prow)
                                .for_each(|(g, &pv)| *g = pv * (*g - c));
                        }
                    });
                    // SAFETY: as above.
                    unsafe {
                        // dQ = dS · K · scale
                        matmul(
                            (t, hd, t),
                            out.at(base + dm.q(h)),
                            (w, 1),
                            dp.as_ptr(),
                            (t, 1),
                            k,
                            (w, 1),
                            scale,
                            false,
                        );
                        // dK (+)= dSᵀ · Q · scale
                        matmul(
                            (t, hd, t),
                            out.at(base + dm.k(g)),
                            (w, 1),
                            dp.as_ptr(),
                            (1, t),
                            q,
                            (w, 1),
                            scale,
                            add,
                        );
                    }
                }
            },
        );
        Ok((CpuStorage::F32(dqkv), l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    /// The composed reference: heads (each key/value head repeated for its
    /// query heads), scaled scores, causal mask, softmax, P·V.
    fn composed(qkv: &Tensor, heads: Heads) -> Result<Tensor> {
        let (b, t, w) = qkv.dims3()?;
        let hd = w / (heads.heads + 2 * heads.kv);
        let group = heads.heads / heads.kv;
        let split = |start: usize, n: usize| -> Result<Tensor> {
            let x = qkv
                .narrow(2, start * hd, n * hd)?
                .reshape((b, t, n, hd))?
                .transpose(1, 2)?
                .contiguous()?;
            // [b, n, t, hd] → [b, n·group, t, hd]: each head `group` times.
            let rep: Vec<Tensor> = (0..n * group)
                .map(|i| x.narrow(1, i / (heads.heads / n), 1))
                .collect::<Result<_>>()?;
            Tensor::cat(&rep, 1)
        };
        let q = qkv
            .narrow(2, 0, heads.heads * hd)?
            .reshape((b, t, heads.heads, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let (k, v) = (
            split(heads.heads, heads.kv)?,
            split(heads.heads + heads.kv, heads.kv)?,
        );
        let s = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)?;
        let s = s.broadcast_add(&mask)?;
        let max = s.max_keepdim(D::Minus1)?.detach();
        let e = s.broadcast_sub(&max)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        p.matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, t, heads.heads * hd))
    }

    /// Multi-head (3 of 3) and grouped-query (4 query heads on 2).
    #[test]
    fn matches_the_composed_version_forward_and_backward() {
        for (heads, kv) in [(3, 3), (4, 2), (4, 1)] {
            let heads = Heads { heads, kv };
            let (b, t, hd) = (2, 7, 4);
            let n = b * t * (heads.heads + 2 * heads.kv) * hd;
            let vals: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
                .collect();
            let x = Var::from_vec(vals, (b, t, n / (b * t)), &Device::Cpu).unwrap();
            let w: Vec<f32> = (0..b * t * heads.heads * hd)
                .map(|i| (i % 13) as f32 * 0.1 - 0.6)
                .collect();
            let w = Tensor::from_vec(w, (b, t, heads.heads * hd), &Device::Cpu).unwrap();
            let fused = causal_attention(x.as_tensor(), heads).unwrap();
            let reference = composed(x.as_tensor(), heads).unwrap();
            let diff = (&fused - &reference)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap();
            assert!(diff.to_scalar::<f32>().unwrap() < 1e-5, "{heads:?}");
            let g1 = (fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (reference * &w)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let (a, r) = (
                g1.get(x.as_tensor()).unwrap(),
                g2.get(x.as_tensor()).unwrap(),
            );
            let diff = (a - r).unwrap().abs().unwrap().max_all().unwrap();
            assert!(
                diff.to_scalar::<f32>().unwrap() < 1e-5,
                "{heads:?}: gradient differs by {diff}"
            );
        }
    }
}
