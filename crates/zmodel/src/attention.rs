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

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use crate::ops::f32_input;
use crate::simd::{exp, vectorised};

/// `y[b, t, d]` of causal multi-head attention over `qkv[b, t, 3d]` (q, k and v
/// side by side, each `n_heads` heads of `d / n_heads`).
pub fn causal_attention(qkv: &Tensor, n_heads: usize) -> Result<Tensor> {
    qkv.contiguous()?.apply_op1(CausalAttention { n_heads })
}

/// d qkv of [`causal_attention`] from its input and the gradient of its output.
pub fn causal_attention_backward(qkv: &Tensor, dy: &Tensor, n_heads: usize) -> Result<Tensor> {
    qkv.contiguous()?
        .apply_op2_no_bwd(&dy.contiguous()?, &CausalAttentionGrad { n_heads })
}

struct CausalAttention {
    n_heads: usize,
}

/// Shapes of one call.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    d: usize,
    hd: usize,
    heads: usize,
}

impl Dims {
    fn of(l: &Layout, heads: usize) -> Result<Dims> {
        let (b, t, d3) = l.shape().dims3()?;
        if d3 % 3 != 0 || (d3 / 3) % heads != 0 {
            candle_core::bail!("attention: last dim {d3} is not 3 × heads × head size");
        }
        let d = d3 / 3;
        Ok(Dims {
            b,
            t,
            d,
            hd: d / heads,
            heads,
        })
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

/// `dst[m×n] = beta · lhs[m×k] · rhs[k×n]`, single-threaded, with element
/// strides (row, column) for each matrix.
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
            false,
            lhs,
            lhs_cs as isize,
            lhs_rs as isize,
            rhs,
            rhs_cs as isize,
            rhs_rs as isize,
            0.0,
            beta,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}

/// P = causal softmax(Q·Kᵀ·scale) of sequence `bi`, head `h` into `p[t×t]`.
fn probabilities(qkv: &[f32], dm: Dims, bi: usize, h: usize, p: &mut [f32]) {
    let (t, d3) = (dm.t, 3 * dm.d);
    let base = bi * t * d3;
    let q = qkv[base + h * dm.hd..].as_ptr();
    let k = qkv[base + dm.d + h * dm.hd..].as_ptr();
    let scale = 1.0 / (dm.hd as f32).sqrt();
    // SAFETY: rows i < t of q and k at stride 3d, columns < hd, lie in qkv; p has t×t.
    unsafe {
        matmul(
            (t, t, dm.hd),
            p.as_mut_ptr(),
            (t, 1),
            q,
            (d3, 1),
            k,
            (1, d3),
            scale,
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
        let dm = Dims::of(l, self.n_heads)?;
        let (t, d, d3) = (dm.t, dm.d, 3 * dm.d);
        let mut y = vec![0f32; dm.b * t * d];
        let out = Shared(y.as_mut_ptr());
        (0..dm.b * dm.heads).into_par_iter().for_each_init(
            || vec![0f32; t * t],
            |p, task| {
                let (bi, h) = (task / dm.heads, task % dm.heads);
                probabilities(qkv, dm, bi, h, p);
                let v = qkv[bi * t * d3 + 2 * d + h * dm.hd..].as_ptr();
                // SAFETY: y rows of sequence bi, columns of head h (disjoint per
                // task); v rows at stride 3d lie in qkv.
                unsafe {
                    matmul(
                        (t, dm.hd, t),
                        out.at(bi * t * d + h * dm.hd),
                        (d, 1),
                        p.as_ptr(),
                        (t, 1),
                        v,
                        (d3, 1),
                        1.0,
                    )
                };
            },
        );
        Ok((CpuStorage::F32(y), Shape::from_dims(&[dm.b, t, d])))
    }

    fn bwd(&self, qkv: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(causal_attention_backward(qkv, dy, self.n_heads)?))
    }
}

/// d qkv from (qkv, dy).
struct CausalAttentionGrad {
    n_heads: usize,
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
        let dm = Dims::of(l1, self.n_heads)?;
        let (t, d, d3, hd) = (dm.t, dm.d, 3 * dm.d, dm.hd);
        if dy.len() != dm.b * t * d {
            candle_core::bail!("attention backward: dy has {} elements", dy.len());
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut dqkv = vec![0f32; qkv.len()];
        let out = Shared(dqkv.as_mut_ptr());
        (0..dm.b * dm.heads).into_par_iter().for_each_init(
            || (vec![0f32; t * t], vec![0f32; t * t]),
            |(p, dp), task| {
                let (bi, h) = (task / dm.heads, task % dm.heads);
                probabilities(qkv, dm, bi, h, p);
                let base = bi * t * d3;
                let (q, k, v) = (
                    qkv[base + h * hd..].as_ptr(),
                    qkv[base + d + h * hd..].as_ptr(),
                    qkv[base + 2 * d + h * hd..].as_ptr(),
                );
                let g = dy[bi * t * d + h * hd..].as_ptr();
                // SAFETY: as in forward; each task writes only its own head's
                // columns of q, k and v in dqkv.
                unsafe {
                    let dst = out.at(base + h * hd);
                    // dV = Pᵀ · dY
                    matmul(
                        (t, hd, t),
                        dst.add(2 * d),
                        (d3, 1),
                        p.as_ptr(),
                        (1, t),
                        g,
                        (d, 1),
                        1.0,
                    );
                    // dP = dY · Vᵀ
                    matmul(
                        (t, t, hd),
                        dp.as_mut_ptr(),
                        (t, 1),
                        g,
                        (d, 1),
                        v,
                        (1, d3),
                        1.0,
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
                    let dst = out.at(base + h * hd);
                    // dQ = dS · K · scale
                    matmul(
                        (t, hd, t),
                        dst,
                        (d3, 1),
                        dp.as_ptr(),
                        (t, 1),
                        k,
                        (d3, 1),
                        scale,
                    );
                    // dK = dSᵀ · Q · scale
                    matmul(
                        (t, hd, t),
                        dst.add(d),
                        (d3, 1),
                        dp.as_ptr(),
                        (1, t),
                        q,
                        (d3, 1),
                        scale,
                    );
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

    /// The composed reference: heads, scaled scores, causal mask, softmax, P·V.
    fn composed(qkv: &Tensor, heads: usize) -> Result<Tensor> {
        let (b, t, d3) = qkv.dims3()?;
        let d = d3 / 3;
        let hd = d / heads;
        let split = |i: usize| -> Result<Tensor> {
            qkv.narrow(2, i * d, d)?
                .reshape((b, t, heads, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
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
        p.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))
    }

    #[test]
    fn matches_the_composed_version_forward_and_backward() {
        let (b, t, heads, hd) = (2, 7, 3, 4);
        let n = b * t * 3 * heads * hd;
        let vals: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let x = Var::from_vec(vals, (b, t, 3 * heads * hd), &Device::Cpu).unwrap();
        let w: Vec<f32> = (0..b * t * heads * hd)
            .map(|i| (i % 13) as f32 * 0.1 - 0.6)
            .collect();
        let w = Tensor::from_vec(w, (b, t, heads * hd), &Device::Cpu).unwrap();
        let fused = causal_attention(x.as_tensor(), heads).unwrap();
        let reference = composed(x.as_tensor(), heads).unwrap();
        let diff = (&fused - &reference)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-5);
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
            "gradient differs by {diff}"
        );
    }
}
