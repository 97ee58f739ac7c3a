//! LLaMA's fused ops with their own backward: RMSNorm, SwiGLU and rotary
//! position embeddings.
//!
//! Each is one pass forward and one backward over the data, vectorised and
//! split over threads in chunks that do not depend on the thread count, like
//! the GPT's layer norm and GELU in [`crate::ops`]; each carries a candle
//! backward so that autograd through a block checks the hand-written block
//! backward, and each is tested against a composed candle reference.
//!
//! - RMSNorm: `y = x / sqrt(mean(x²) + eps) · w`; backward
//!   `dx = r · (g − x̂ · mean(g · x̂))` with `g = dy · w`, `x̂ = x · r`, and
//!   `dw = Σ dy · x̂` summed per task and added in task order.
//! - Qwen3's norms of q and k: RMSNorm of each head of q and of k inside
//!   the q, k, v rows, v copied, in one pass each way (composed of narrows,
//!   copies and a concatenation it was three passes forward and four back,
//!   13% of a small model's step; see [`qk_norm`]).
//! - SwiGLU on `[gate | up]` side by side: `y = silu(gate) · up`.
//! - Rotary embeddings in Hugging Face's layout (the two halves of each head
//!   rotate together, `rotate_half`), so that exported q/k weights load into
//!   `transformers` unpermuted. The rotation is orthogonal: its backward is
//!   the rotation by the opposite angle, and needs no saved input.

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use zconfig::arch::Rotary;

use crate::documents::Documents;
use crate::ops::{cpu_f32, f32_input, sum_lanes, write_row};
use crate::simd::{
    assume_init, bf16_tensor, par_rows, par_rows_bf16, par_rows_summed, sigmoid, uninit_floats,
    vectorised, ROWS_PER_TASK,
};

/// RMSNorm over the last dimension with weight `w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?
        .apply_op2(&w.contiguous()?, RmsNorm { eps: eps as f32 })
}

/// [`rms_norm`] with its output rounded to bf16 (`[rows, d]`, laid out for
/// zgemm), for bf16 products only (as [`crate::ops::layer_norm_bf16`]); no
/// backward.
pub fn rms_norm_bf16(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (x, w) = (cpu_f32("rms norm", &xs, xl)?, cpu_f32("rms norm", &ws, wl)?);
    let d = w.len();
    if d == 0 || !x.len().is_multiple_of(d) {
        candle_core::bail!("rms norm: rows of {} do not match a weight of {d}", x.len());
    }
    let eps = eps as f32;
    par_rows_bf16(
        x,
        (d, d),
        #[inline(always)]
        |row, out| {
            let r = rms_inv(row, eps);
            write_row(out, None, [row, w], |[v, w]| v * r * w);
        },
    )
}

/// 1 / sqrt(mean(x²) + eps) of one row.
#[inline(always)]
fn rms_inv(row: &[f32], eps: f32) -> f32 {
    let ms = sum_lanes([row], |[v]| v * v) / row.len() as f32;
    1.0 / (ms + eps).sqrt()
}

struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "zrun-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_input(self.name(), s1, l1)?;
        let w = f32_input(self.name(), s2, l2)?;
        let d = w.len();
        if d == 0 || !x.len().is_multiple_of(d) {
            candle_core::bail!("rms norm: rows of {} do not match a weight of {d}", x.len());
        }
        let mut y = uninit_floats(x.len());
        par_rows(
            x,
            &mut y,
            d,
            #[inline(always)]
            |x, y| {
                for (row, out) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
                    let r = rms_inv(row, self.eps);
                    write_row(out, None, [row, w], |[v, w]| v * r * w);
                }
            },
        );
        // SAFETY: the rows cover x (checked above), and so y, whole.
        let y = unsafe { assume_init(y) };
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = rms_norm_backward(x, w, dy, f64::from(self.eps), None)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// RMSNorm's (dx, dw) from its input, weight and output gradient; with a
/// `residual`, dx is `residual + dx` (as [`crate::ops::layer_norm_backward`]).
pub fn rms_norm_backward(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    eps: f64,
    residual: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let d = w.dim(0)?;
    let rows = x.elem_count() / d;
    let op = RmsNormGrad {
        w: w.flatten_all()?.to_vec1::<f32>()?,
        eps: eps as f32,
    };
    // One op computes [dx rows; dw].
    let all = op.apply(x, dy, residual)?;
    let dx = all.narrow(0, 0, rows)?.reshape(x.shape())?;
    let dw = all.narrow(0, rows, 1)?.reshape(d)?;
    Ok((dx, dw))
}

struct RmsNormGrad {
    w: Vec<f32>,
    eps: f32,
}

impl RmsNormGrad {
    const NAME: &'static str = "zrun-rms-norm-grad";

    fn run(&self, x: &[f32], dy: &[f32], residual: Option<&[f32]>) -> Result<(CpuStorage, Shape)> {
        let (w, d) = (&self.w, self.w.len());
        if x.len() != dy.len()
            || d == 0
            || !x.len().is_multiple_of(d)
            || residual.is_some_and(|r| r.len() != x.len())
        {
            candle_core::bail!("rms norm backward: shapes disagree");
        }
        let rows = x.len() / d;
        let mut out = uninit_floats(x.len() + d);
        let (dx, tail) = out.split_at_mut(x.len());
        let dw = par_rows_summed(
            dx,
            d,
            d,
            #[inline(always)]
            |rows, dx, dw| {
                let span = rows.start * d..rows.end * d;
                let (x, dy) = (&x[span.clone()], &dy[span.clone()]);
                let residual = residual.map(|r| &r[span]);
                let (mut xhat, mut g) = (vec![0f32; d], vec![0f32; d]);
                for (k, (row, out)) in x.chunks_exact(d).zip(dx.chunks_exact_mut(d)).enumerate() {
                    let rows = RowGrad {
                        x: row,
                        dy: &dy[k * d..][..d],
                        w,
                        residual: residual.map(|res| &res[k * d..][..d]),
                    };
                    rows.write(self.eps, [&mut xhat, &mut g], dw, out);
                }
            },
        );
        write_row(tail, None, [&dw], |[v]| v);
        // SAFETY: the tasks wrote every row of dx, and dw the tail.
        let out = unsafe { assume_init(out) };
        Ok((CpuStorage::F32(out), Shape::from_dims(&[rows + 1, d])))
    }
}

crate::ops::norm_backward_ops!(RmsNormGrad);

/// One row of RMSNorm's backward: its input, output gradient, weight and
/// the residual to add to dx, if any.
struct RowGrad<'a> {
    x: &'a [f32],
    dy: &'a [f32],
    w: &'a [f32],
    residual: Option<&'a [f32]>,
}

impl RowGrad<'_> {
    /// Writes the row's dx into `out` and adds its `dy · x̂` into `dw`;
    /// `scratch` holds x̂ and `g = dy · w` (each as wide as the row).
    #[inline(always)]
    fn write(
        &self,
        eps: f32,
        scratch: [&mut [f32]; 2],
        dw: &mut [f32],
        out: &mut [MaybeUninit<f32>],
    ) {
        let [xhat, g] = scratch;
        let r = rms_inv(self.x, eps);
        let each = xhat.iter_mut().zip(g.iter_mut()).zip(dw.iter_mut());
        for (((xh, g), dw), ((&v, &dy), &w)) in each.zip(self.x.iter().zip(self.dy).zip(self.w)) {
            *xh = v * r;
            *g = dy * w;
            *dw += dy * *xh;
        }
        let gx_mean = sum_lanes([g, xhat], |[g, xh]| g * xh) / self.x.len() as f32;
        write_row(out, self.residual, [g, xhat], |[g, xh]| {
            r * (g - xh * gx_mean)
        });
    }
}

/// Qwen3's norms of q and k: in `qkv` rows `[n, (heads + 2·kv)·hd]`, every
/// head of q RMS-normalised and scaled by `wq` `[hd]`, every head of k by
/// `wk`, v copied: one pass over the rows (each head's values are
/// [`rms_norm`]'s of that head alone, bit for bit). No candle backward:
/// autograd's reference composes [`rms_norm`] on each head, and the
/// model's backward is [`qk_norm_backward`].
///
/// Bound: the composed form read and wrote q and k three times and the
/// whole row twice forward (narrow to a copy, the norm, the
/// concatenation), each into a fresh buffer; this reads and writes the row
/// once.
pub fn qk_norm(qkv: &Tensor, wq: &Tensor, wk: &Tensor, heads: usize, eps: f64) -> Result<Tensor> {
    let (n, width) = qkv.dims2()?;
    let (qkv, wq, wk) = (qkv.contiguous()?, wq.contiguous()?, wk.contiguous()?);
    let ((xs, xl), (qs, ql), (ks, kl)) = (
        qkv.storage_and_layout(),
        wq.storage_and_layout(),
        wk.storage_and_layout(),
    );
    let x = cpu_f32("qk norm", &xs, xl)?;
    let (wq, wk) = (cpu_f32("qk norm", &qs, ql)?, cpu_f32("qk norm", &ks, kl)?);
    let heads = QkHeads::new(width, heads, wq, wk)?;
    let eps = eps as f32;
    let mut y = uninit_floats(x.len());
    par_rows(
        x,
        &mut y,
        width,
        #[inline(always)]
        |x, y| {
            for (row, out) in x.chunks_exact(width).zip(y.chunks_exact_mut(width)) {
                let (qk, v) = row.split_at(heads.qk);
                let (out_qk, out_v) = out.split_at_mut(heads.qk);
                for (i, (head, out)) in qk
                    .chunks_exact(heads.hd)
                    .zip(out_qk.chunks_exact_mut(heads.hd))
                    .enumerate()
                {
                    let w = heads.weight(i, wq, wk);
                    let r = rms_inv(head, eps);
                    write_row(out, None, [head, w], |[v, w]| v * r * w);
                }
                write_row(out_v, None, [v], |[v]| v);
            }
        },
    );
    // SAFETY: the rows cover x (its shape is [n, width]), and so y, whole.
    let y = unsafe { assume_init(y) };
    Tensor::from_vec(y, (n, width), qkv.device())
}

/// [`qk_norm`]'s backward from its input `qkv` and the gradient `dy` of its
/// output: (dqkv, dwq, dwk), each head's dx as [`rms_norm_backward`]'s of
/// it alone, v's gradient passed through; the weights' gradients summed
/// per task of rows (a fixed partition: the same bits on any number of
/// threads) and added in task order.
pub fn qk_norm_backward(
    qkv: &Tensor,
    wq: &Tensor,
    wk: &Tensor,
    dy: &Tensor,
    heads: usize,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (n, width) = qkv.dims2()?;
    if dy.dims() != qkv.dims() {
        candle_core::bail!("qk norm backward: dy {:?}, qkv {:?}", dy.dims(), qkv.dims());
    }
    let (qkv, dy) = (qkv.contiguous()?, dy.contiguous()?);
    let (wq, wk) = (wq.contiguous()?, wk.contiguous()?);
    let ((xs, xl), (ds, dl)) = (qkv.storage_and_layout(), dy.storage_and_layout());
    let ((qs, ql), (ks, kl)) = (wq.storage_and_layout(), wk.storage_and_layout());
    let (x, dy) = (cpu_f32("qk norm", &xs, xl)?, cpu_f32("qk norm", &ds, dl)?);
    let (wq, wk) = (cpu_f32("qk norm", &qs, ql)?, cpu_f32("qk norm", &ks, kl)?);
    let heads = QkHeads::new(width, heads, wq, wk)?;
    let (hd, eps) = (heads.hd, eps as f32);
    let mut dx = uninit_floats(x.len());
    // dwq then dwk.
    let dw = par_rows_summed(
        &mut dx,
        width,
        2 * hd,
        #[inline(always)]
        |rows, dx, dw| {
            let span = rows.start * width..rows.end * width;
            let (x, dy) = (&x[span.clone()], &dy[span]);
            let (mut xhat, mut g) = (vec![0f32; hd], vec![0f32; hd]);
            let rows = x.chunks_exact(width).zip(dy.chunks_exact(width));
            for ((row, dyr), out) in rows.zip(dx.chunks_exact_mut(width)) {
                let (out_qk, out_v) = out.split_at_mut(heads.qk);
                let each = row[..heads.qk]
                    .chunks_exact(hd)
                    .zip(dyr[..heads.qk].chunks_exact(hd))
                    .zip(out_qk.chunks_exact_mut(hd));
                for (i, ((x, dy), out)) in each.enumerate() {
                    let grad = RowGrad {
                        x,
                        dy,
                        w: heads.weight(i, wq, wk),
                        residual: None,
                    };
                    let dw = &mut dw[usize::from(i >= heads.q) * hd..][..hd];
                    grad.write(eps, [&mut xhat, &mut g], dw, out);
                }
                write_row(out_v, None, [&dyr[heads.qk..]], |[d]| d);
            }
        },
    );
    // SAFETY: the tasks wrote every row of dx.
    let dx = unsafe { assume_init(dx) };
    let dev = qkv.device();
    let (dwq, dwk) = dw.split_at(hd);
    Ok((
        Tensor::from_vec(dx, (n, width), dev)?,
        Tensor::from_slice(dwq, hd, dev)?,
        Tensor::from_slice(dwk, hd, dev)?,
    ))
}

/// Where q's and k's heads lie in a q, k, v row, checked against the
/// weights: `q` heads of `hd`, then k's, their `qk` values before v's.
struct QkHeads {
    q: usize,
    hd: usize,
    qk: usize,
}

impl QkHeads {
    fn new(width: usize, heads: usize, wq: &[f32], wk: &[f32]) -> Result<QkHeads> {
        let hd = wq.len();
        // heads·hd of q, then kv·hd of k and of v.
        let kv_width = width.checked_sub(heads * hd).unwrap_or(usize::MAX) / 2;
        if hd == 0 || wk.len() != hd || kv_width == 0 || heads * hd + 2 * kv_width != width {
            candle_core::bail!(
                "qk norm: rows of {width} are not {heads} heads of q ({} wide norm), then k and v ({} wide norm)",
                wq.len(),
                wk.len()
            );
        }
        Ok(QkHeads {
            q: heads,
            hd,
            qk: heads * hd + kv_width,
        })
    }

    /// Head `i`'s weight: q's, then k's.
    #[inline(always)]
    fn weight<'a>(&self, i: usize, wq: &'a [f32], wk: &'a [f32]) -> &'a [f32] {
        if i < self.q {
            wq
        } else {
            wk
        }
    }
}

/// `silu(gate) · up` of `h` `[n, 2f]` holding gate and up side by side: `[n, f]`.
pub fn swiglu(h: &Tensor) -> Result<Tensor> {
    h.contiguous()?.apply_op1(SwiGlu)
}

/// [`swiglu`] for bf16 products: its values rounded to bf16 as they are
/// written, laid out for the products to read in place
/// (`simd::par_rows_bf16`): the bits the MLP's output projection and its weight
/// gradient rounded the f32 values to as they packed them, kept in half the
/// bytes (2·ffn fewer a token and block).
pub fn swiglu_bf16(h: &Tensor) -> Result<Tensor> {
    let h = h.contiguous()?;
    let (hs, hl) = h.storage_and_layout();
    let h = cpu_f32("swiglu", &hs, hl)?;
    let f2 = hl.shape().dims2()?.1;
    if !f2.is_multiple_of(2) {
        candle_core::bail!("swiglu: an odd width {f2} is not gate and up side by side");
    }
    let f = f2 / 2;
    par_rows_bf16(
        h,
        (f2, f),
        #[inline(always)]
        |row, out| {
            let (gate, up) = row.split_at(f);
            swiglu_row(gate, up, out);
        },
    )
}

struct SwiGlu;

impl CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "zrun-swiglu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let h = f32_input(self.name(), s, l)?;
        let (n, f2) = l.shape().dims2()?;
        if !f2.is_multiple_of(2) {
            candle_core::bail!("swiglu: an odd width {f2} is not gate and up side by side");
        }
        let f = f2 / 2;
        let mut y = uninit_floats(n * f);
        y.par_chunks_mut(ROWS_PER_TASK * f)
            .zip(h.par_chunks(ROWS_PER_TASK * f2))
            .with_max_len(1)
            .for_each(|(y, h)| {
                vectorised(
                    #[inline(always)]
                    || {
                        for (out, row) in y.chunks_exact_mut(f).zip(h.chunks_exact(f2)) {
                            let (gate, up) = row.split_at(f);
                            swiglu_row(gate, up, out);
                        }
                    },
                )
            });
        // SAFETY: the chunks of y match the rows of h (n of them), each written whole.
        let y = unsafe { assume_init(y) };
        Ok((CpuStorage::F32(y), Shape::from_dims(&[n, f])))
    }

    fn bwd(&self, h: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(swiglu_backward(h, dy)?))
    }
}

/// `out = gate · σ(gate) · up` element by element; inside `vectorised`, on
/// AVX2 and AVX-512 through [`crate::lanes`] (the same bits).
#[inline(always)]
fn swiglu_row(gate: &[f32], up: &[f32], out: &mut [MaybeUninit<f32>]) {
    #[cfg(target_arch = "x86_64")]
    if crate::lanes::swiglu(gate, up, out) {
        return;
    }
    // Cut to one length first, so that the loop has no bounds checks left
    // and vectorises (with them, SwiGLU's backward ran scalar).
    let (up, out) = (&up[..gate.len()], &mut out[..gate.len()]);
    for i in 0..gate.len() {
        out[i].write(gate[i] * sigmoid(gate[i]) * up[i]);
    }
}

/// SwiGLU's gradients of one row (`dgate`, `dup` from `dy`); inside
/// `vectorised`, on AVX2 and AVX-512 through [`crate::lanes`] (the same
/// bits).
#[inline(always)]
fn swiglu_backward_row(
    gate: &[f32],
    up: &[f32],
    dy: &[f32],
    dgate: &mut [MaybeUninit<f32>],
    dup: &mut [MaybeUninit<f32>],
) {
    #[cfg(target_arch = "x86_64")]
    if crate::lanes::swiglu_backward(gate, up, dy, dgate, dup) {
        return;
    }
    let n = gate.len();
    let (up, dy, dgate, dup) = (&up[..n], &dy[..n], &mut dgate[..n], &mut dup[..n]);
    for i in 0..n {
        let s = sigmoid(gate[i]);
        let silu = gate[i] * s;
        dgate[i].write(dy[i] * up[i] * (s + silu * (1.0 - s)));
        dup[i].write(dy[i] * silu);
    }
}

/// d h `[n, 2f]` of [`swiglu`] from its input and output gradient.
pub fn swiglu_backward(h: &Tensor, dy: &Tensor) -> Result<Tensor> {
    h.contiguous()?
        .apply_op2_no_bwd(&dy.contiguous()?, &SwiGluGrad)
}

struct SwiGluGrad;

impl CustomOp2 for SwiGluGrad {
    fn name(&self) -> &'static str {
        "zrun-swiglu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let h = f32_input(self.name(), s1, l1)?;
        let dy = f32_input(self.name(), s2, l2)?;
        let (n, f2) = l1.shape().dims2()?;
        let f = f2 / 2;
        if dy.len() != n * f {
            candle_core::bail!("swiglu backward: {} gradients for {n}x{f}", dy.len());
        }
        let mut dh = uninit_floats(h.len());
        dh.par_chunks_mut(ROWS_PER_TASK * f2)
            .zip(
                h.par_chunks(ROWS_PER_TASK * f2)
                    .zip(dy.par_chunks(ROWS_PER_TASK * f)),
            )
            .with_max_len(1)
            .for_each(|(dh, (h, dy))| {
                vectorised(
                    #[inline(always)]
                    || {
                        for ((out, row), g) in dh
                            .chunks_exact_mut(f2)
                            .zip(h.chunks_exact(f2))
                            .zip(dy.chunks_exact(f))
                        {
                            let (gate, up) = row.split_at(f);
                            let (dgate, dup) = out.split_at_mut(f);
                            swiglu_backward_row(gate, up, g, dgate, dup);
                        }
                    },
                )
            });
        // SAFETY: the chunks of dh match the rows of h and dy (n of them), each written whole.
        let dh = unsafe { assume_init(dh) };
        Ok((CpuStorage::F32(dh), l1.shape().clone()))
    }
}

/// The rotary embedding of q and k in `qkv` `[b, t, (heads + 2·kv)·hd]`
/// (v passes through): position `p`, pair `(i, i + r/2)` of each head turns
/// by `p · inv_freq[i]` (`zconfig::arch::rope_inv_freq`: `theta^(−2i/r)`,
/// maybe scaled) and is multiplied by `rotary.scale` (YaRN's and
/// LongRoPE's attention factor, else 1), `r` twice the frequencies: the
/// head's width, or its first `r` columns where only those turn (Phi-4-
/// mini's partial rotation; the rest pass through). `inverse` turns the other way, times the same scale:
/// the backward. Position `p` is the row's in its sequence, or with `docs`
/// in its document.
pub fn rope(
    qkv: &Tensor,
    heads: usize,
    kv_heads: usize,
    rotary: &Rotary,
    inverse: bool,
    docs: Option<&Documents>,
) -> Result<Tensor> {
    qkv.contiguous()?.apply_op1(Rope {
        heads,
        kv_heads,
        inv_freq: rotary.inv_freq.as_slice().into(),
        scale: rotary.scale,
        inverse,
        start: 0,
        docs: docs.cloned(),
    })
}

/// [`rope`]'s forward for rows at positions `start..start + t`: the tokens
/// generation adds after `start` it has already seen (the same angles, so
/// the same bits, as those rows in a whole sequence).
pub fn rope_from(
    qkv: &Tensor,
    heads: usize,
    kv_heads: usize,
    rotary: &Rotary,
    start: usize,
) -> Result<Tensor> {
    qkv.contiguous()?.apply_op1(Rope {
        heads,
        kv_heads,
        inv_freq: rotary.inv_freq.as_slice().into(),
        scale: rotary.scale,
        inverse: false,
        start,
        docs: None,
    })
}

/// [`rope`]'s forward (positions from 0) for bf16 products: the turned
/// rows rounded to bf16 as they are written (zgemm's rounding, the bits
/// attention's bf16 products rounded the f32 rows to as they packed them),
/// `[b, t, w]` contiguous from a 64-byte line: kept for attention's
/// backward in half the bytes (2·w fewer a token and block).
pub fn rope_bf16(
    qkv: &Tensor,
    heads: usize,
    kv_heads: usize,
    rotary: &Rotary,
    docs: Option<&Documents>,
) -> Result<Tensor> {
    let op = Rope {
        heads,
        kv_heads,
        inv_freq: rotary.inv_freq.as_slice().into(),
        scale: rotary.scale,
        inverse: false,
        start: 0,
        docs: docs.cloned(),
    };
    let qkv = qkv.contiguous()?;
    let (xs, xl) = qkv.storage_and_layout();
    let x = cpu_f32("rope", &xs, xl)?;
    let (b, t, w) = xl.shape().dims3()?;
    op.head_width(b, t, w)?;
    let n = x.len();
    // 32 values more: room to start on a line.
    let mut out = uninit_floats::<u16>(n + 32);
    let start = zgemm::bf16_line_start(&out);
    let (cos, sin) = op.table(t);
    let (head, body) = out.split_at_mut(start);
    let (rows, tail) = body.split_at_mut(n);
    for v in head.iter_mut().chain(tail) {
        v.write(0);
    }
    rows.par_chunks_mut(w.max(1))
        .zip(x.par_chunks(w.max(1)))
        .enumerate()
        .for_each_init(
            || uninit_floats::<f32>(w),
            |wide, (r, (o, row))| {
                vectorised(
                    #[inline(always)]
                    || op.turn_row(r, t, (&cos, &sin), row, wide),
                );
                // SAFETY: `turn_row` writes every element of its row.
                let wide = unsafe { &*(&wide[..] as *const [MaybeUninit<f32>] as *const [f32]) };
                zgemm::bf16_bits_write(wide, o);
            },
        );
    // The head, every row and the tail were written.
    bf16_tensor(out, start, b * t, w, w)?.reshape((b, t, w))
}

#[derive(Clone)]
struct Rope {
    heads: usize,
    kv_heads: usize,
    /// A head's `[hd/2]` frequencies.
    inv_freq: std::sync::Arc<[f64]>,
    /// What cos and sin are multiplied by.
    scale: f64,
    inverse: bool,
    /// The first row's position.
    start: usize,
    /// Documents kept apart: each row's position is in its document.
    docs: Option<Documents>,
}

impl Rope {
    /// Checks `[b, t, w]` rows against the heads and documents: the head
    /// width.
    fn head_width(&self, b: usize, t: usize, w: usize) -> Result<usize> {
        if let Some(d) = &self.docs {
            if d.seq_len() != t || d.tokens() != b * t {
                candle_core::bail!("rope: documents of {} tokens for [{b}, {t}]", d.tokens());
            }
        }
        let all_heads = self.heads + 2 * self.kv_heads;
        if !w.is_multiple_of(all_heads) || !(w / all_heads).is_multiple_of(2) {
            candle_core::bail!("rope: width {w} is not {all_heads} heads of an even width");
        }
        let hd = w / all_heads;
        // The turned columns of each head: all, or its first `2·half`
        // (Phi-4-mini's partial rotation), the rest passed through.
        if 2 * self.inv_freq.len() > hd {
            candle_core::bail!(
                "rope: {} frequencies for heads of {hd}",
                self.inv_freq.len()
            );
        }
        Ok(hd)
    }

    /// Row `r` (of sequences of `t`) turned into `out`: its q and k heads by
    /// its position's angles from `(cos, sin)` ([`Rope::table`]), v passed
    /// through. Inlined into `vectorised` callers.
    #[inline(always)]
    fn turn_row(
        &self,
        r: usize,
        t: usize,
        (cos, sin): (&[f32], &[f32]),
        row: &[f32],
        out: &mut [MaybeUninit<f32>],
    ) {
        let half = self.inv_freq.len();
        let hd = row.len() / (self.heads + 2 * self.kv_heads);
        let rotated = (self.heads + self.kv_heads) * hd;
        let p = self.docs.as_ref().map_or(r % t, |d| d.position(r));
        let (c, s) = (&cos[p * half..][..half], &sin[p * half..][..half]);
        let (out_rotated, out_v) = out.split_at_mut(rotated);
        let heads = out_rotated.chunks_exact_mut(hd).zip(row.chunks_exact(hd));
        for (out, head) in heads {
            // Every slice cut to `half`: no bounds checks are left, and the
            // loop vectorises.
            let (a, b) = (&head[..half], &head[half..][..half]);
            let (oa, rest) = out.split_at_mut(half);
            let (ob, passed) = rest.split_at_mut(half);
            let oa = &mut oa[..half];
            for i in 0..half {
                oa[i].write(a[i] * c[i] - b[i] * s[i]);
                ob[i].write(b[i] * c[i] + a[i] * s[i]);
            }
            for (o, &v) in passed.iter_mut().zip(&head[2 * half..]) {
                o.write(v);
            }
        }
        for (o, &v) in out_v.iter_mut().zip(&row[rotated..]) {
            o.write(v);
        }
    }

    /// `[t, half]` cosines and sines of positions `start..start + t`
    /// (`half` frequencies), times the scale, computed in f64.
    fn table(&self, t: usize) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let sign = if self.inverse { -1.0 } else { 1.0 };
        let mut cos = Vec::with_capacity(t * half);
        let mut sin = Vec::with_capacity(t * half);
        for p in self.start..self.start + t {
            for &inv_freq in self.inv_freq.iter() {
                let angle = p as f64 * inv_freq;
                cos.push((self.scale * angle.cos()) as f32);
                sin.push((sign * self.scale * angle.sin()) as f32);
            }
        }
        (cos, sin)
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "zrun-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_input(self.name(), s, l)?;
        let (b, t, w) = l.shape().dims3()?;
        self.head_width(b, t, w)?;
        let (cos, sin) = self.table(t);
        let mut y = uninit_floats(x.len());
        y.par_chunks_mut(w)
            .zip(x.par_chunks(w))
            .enumerate()
            .for_each(|(r, (out, row))| {
                vectorised(
                    #[inline(always)]
                    || self.turn_row(r, t, (&cos, &sin), row, out),
                )
            });
        // SAFETY: every row of y was written whole: its rotated heads and the rest.
        let y = unsafe { assume_init(y) };
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(dy.contiguous()?.apply_op1(Rope {
            inverse: !self.inverse,
            ..self.clone()
        })?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var, D};

    #[test]
    fn rms_norm_in_bf16_is_rms_norm_rounded_as_bf16_products_round() {
        use crate::ops::tests::{bf16_bits_of, rounded};
        let (rows, d) = (37, 44);
        let x = Tensor::from_vec(wave(rows * d, 7), (rows, d), &Device::Cpu).unwrap();
        let w = Tensor::from_vec(wave(d, 5), d, &Device::Cpu).unwrap();
        let want = rounded(&rms_norm(&x, &w, 1e-5).unwrap());
        assert_eq!(bf16_bits_of(&rms_norm_bf16(&x, &w, 1e-5).unwrap()), want);
    }

    /// The bf16 forms of SwiGLU and of the rotary embedding write what the
    /// f32 ones give, rounded as bf16 products round it, to the bit: over
    /// several tasks and a short last one, with documents, a scale and a
    /// partial rotation for the embedding.
    #[test]
    fn swiglu_and_rope_in_bf16_are_theirs_rounded_as_bf16_products_round() {
        use crate::ops::tests::{bf16_bits_of, rounded};
        let dev = Device::Cpu;
        let (rows, f) = (37, 44);
        let h = Tensor::from_vec(wave(rows * 2 * f, 7), (rows, 2 * f), &dev).unwrap();
        let out = swiglu_bf16(&h).unwrap();
        assert_eq!(out.dims(), [rows, f]);
        assert_eq!(bf16_bits_of(&out), rounded(&swiglu(&h).unwrap()));
        let (b, t, heads, kv, hd) = (2, 19, 4, 2, 10);
        let x =
            Tensor::from_vec(wave(b * t * (heads + 2 * kv) * hd, 13), (b, t, 80), &dev).unwrap();
        let mut ids = vec![0u32; b * t];
        for at in [3, 4, t + 7] {
            ids[at] = 1;
        }
        let docs = Documents::after_eos(&ids, t, 1);
        let partial = Rotary {
            scale: 1.25,
            ..Rotary::new(500.0, None, 6, t)
        };
        for rotary in [Rotary::new(10_000.0, None, hd, t), partial] {
            for docs in [None, Some(&docs)] {
                let out = rope_bf16(&x, heads, kv, &rotary, docs).unwrap();
                assert_eq!(out.dims(), [b, t, 80]);
                let want = rope(&x, heads, kv, &rotary, false, docs).unwrap();
                assert_eq!(bf16_bits_of(&out), rounded(&want), "{docs:?}");
            }
        }
    }

    fn wave(n: usize, k: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * k % 29) as f32 - 14.0) / 9.0).collect()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Forward and the gradients of every input, fused against `composed`,
    /// through candle's autograd, for a weighted sum of the output.
    fn check(
        inputs: &[Var],
        fused: impl Fn(&[Tensor]) -> Result<Tensor>,
        composed: impl Fn(&[Tensor]) -> Result<Tensor>,
        tol: f32,
    ) {
        let t: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
        let (a, b) = (fused(&t).unwrap(), composed(&t).unwrap());
        assert!(
            max_diff(&a, &b) < tol,
            "forward differs by {}",
            max_diff(&a, &b)
        );
        let weights = Tensor::from_vec(wave(a.elem_count(), 7), a.shape(), &Device::Cpu).unwrap();
        let ga = (a * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gb = (b * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (i, v) in inputs.iter().enumerate() {
            let (x, y) = (
                ga.get(v.as_tensor()).unwrap(),
                gb.get(v.as_tensor()).unwrap(),
            );
            assert!(
                max_diff(x, y) < tol,
                "input {i}: gradient differs by {}",
                max_diff(x, y)
            );
        }
    }

    #[test]
    fn rms_norm_matches_the_composed_version() {
        let dev = Device::Cpu;
        // 40 rows: several parallel tasks; 12 wide: a run of 8 and a tail in sum_lanes.
        let x = Var::from_vec(wave(40 * 12, 5), (40, 12), &dev).unwrap();
        let w = Var::from_vec(wave(12, 3), 12, &dev).unwrap();
        check(
            &[x, w],
            |t| rms_norm(&t[0], &t[1], 1e-5),
            |t| {
                let ms = t[0].sqr()?.mean_keepdim(D::Minus1)?;
                t[0].broadcast_div(&(ms + 1e-5)?.sqrt()?)?
                    .broadcast_mul(&t[1])
            },
            1e-5,
        );
    }

    /// Qwen3's fused norms of q and k against [`rms_norm`] and
    /// [`rms_norm_backward`] on each head alone: the forward and dqkv to
    /// the bit (the same arithmetic per head), the weights' gradients
    /// within rounding (summed over rows in other groups), at head widths
    /// with and without a tail, grouped-query heads (4 on 2 and 3 on 1),
    /// and row counts that end inside a task. A head's weight taken for
    /// another's, or v normed, is far off.
    #[test]
    fn qk_norm_is_rms_norm_on_each_head() {
        let dev = Device::Cpu;
        let per_head = |x: &Tensor, first: usize, heads: usize, hd: usize| {
            let n = x.dim(0).unwrap();
            let part = x.narrow(1, first * hd, heads * hd).unwrap();
            part.contiguous().unwrap().reshape((n * heads, hd)).unwrap()
        };
        for (rows, heads, kv, hd) in [(37, 4, 2, 6), (70, 3, 1, 32), (5, 2, 2, 128)] {
            let width = (heads + 2 * kv) * hd;
            let t = |v: Vec<f32>, shape: &[usize]| Tensor::from_vec(v, shape, &dev).unwrap();
            let x = t(wave(rows * width, 7), &[rows, width]);
            let dy = t(wave(rows * width, 5), &[rows, width]);
            let (wq, wk) = (t(wave(hd, 3), &[hd]), t(wave(hd, 11), &[hd]));
            let y = qk_norm(&x, &wq, &wk, heads, 1e-6).unwrap();
            let (dx, dwq, dwk) = qk_norm_backward(&x, &wq, &wk, &dy, heads, 1e-6).unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                v.into_iter().map(f32::to_bits).collect()
            };
            let shape = format!("{rows} rows, {heads} heads on {kv}, hd {hd}");
            for (first, n, w, dw) in [(0, heads, &wq, &dwq), (heads, kv, &wk, &dwk)] {
                let (xh, dyh) = (per_head(&x, first, n, hd), per_head(&dy, first, n, hd));
                let want = rms_norm(&xh, w, 1e-6).unwrap();
                assert_eq!(bits(&per_head(&y, first, n, hd)), bits(&want), "{shape}");
                let (want_dx, want_dw) = rms_norm_backward(&xh, w, &dyh, 1e-6, None).unwrap();
                assert_eq!(
                    bits(&per_head(&dx, first, n, hd)),
                    bits(&want_dx),
                    "{shape}"
                );
                let scale = 1.0
                    + want_dw
                        .abs()
                        .unwrap()
                        .max(0)
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap();
                assert!(max_diff(dw, &want_dw) <= 1e-6 * scale, "{shape}: dw");
            }
            // v passes through, both ways.
            let v = (heads + kv) * hd..width;
            let cols = |t: &Tensor| t.narrow(1, v.start, v.len()).unwrap();
            assert_eq!(bits(&cols(&y)), bits(&cols(&x)), "{shape}");
            assert_eq!(bits(&cols(&dx)), bits(&cols(&dy)), "{shape}");
        }
        let x = Tensor::zeros((2, 24), DType::F32, &dev).unwrap();
        let w = Tensor::ones(4, DType::F32, &dev).unwrap();
        let e = qk_norm(&x, &w, &w.narrow(0, 0, 2).unwrap(), 2, 1e-6).unwrap_err();
        assert!(e.to_string().contains("rows of 24 are not 2 heads"), "{e}");
    }

    #[test]
    fn swiglu_matches_the_composed_version() {
        let dev = Device::Cpu;
        let h = Var::from_vec(wave(40 * 10, 11), (40, 10), &dev).unwrap();
        check(
            &[h],
            |t| swiglu(&t[0]),
            |t| {
                let (gate, up) = (t[0].narrow(1, 0, 5)?, t[0].narrow(1, 5, 5)?);
                // sigmoid composed from primitives (candle-nn's has no backward).
                let sigmoid = (gate.neg()?.exp()? + 1.0)?.recip()?;
                (&gate * sigmoid)? * up
            },
            1e-5,
        );
    }

    /// Hugging Face's `apply_rotary_pos_emb` with `rotate_half`, composed.
    /// Rotary embedding composed from candle ops, at the given position of
    /// each row of the batch (`[b·t]`), cos and sin times `scale` (YaRN's
    /// attention factor).
    fn rope_composed(
        qkv: &Tensor,
        heads: usize,
        kv: usize,
        (theta, scale): (f64, f64),
        positions: &[usize],
    ) -> Result<Tensor> {
        let (b, t, w) = qkv.dims3()?;
        let hd = w / (heads + 2 * kv);
        let half = hd / 2;
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        for &p in positions {
            for i in 0..hd {
                let inv = theta.powf(-((2 * (i % half)) as f64) / hd as f64);
                cos.push((scale * (p as f64 * inv).cos()) as f32);
                sin.push((scale * (p as f64 * inv).sin()) as f32);
            }
        }
        let dev = Device::Cpu;
        let cos = Tensor::from_vec(cos, (b, t, 1, hd), &dev)?;
        let sin = Tensor::from_vec(sin, (b, t, 1, hd), &dev)?;
        let turn = |x: Tensor, n: usize| -> Result<Tensor> {
            let x = x.reshape((b, t, n, hd))?;
            let rotated = Tensor::cat(
                &[&x.narrow(3, half, half)?.neg()?, &x.narrow(3, 0, half)?],
                3,
            )?;
            (x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?.reshape((b, t, n * hd))
        };
        let q = turn(qkv.narrow(2, 0, heads * hd)?, heads)?;
        let k = turn(qkv.narrow(2, heads * hd, kv * hd)?, kv)?;
        let v = qkv.narrow(2, (heads + kv) * hd, kv * hd)?;
        Tensor::cat(&[q, k, v], 2)
    }

    /// Phi-4-mini's partial rotation: each head's first 4 columns of 10
    /// turned as a head of 4 would be (`theta^(−2i/4)`), the other 6
    /// passed through, forward and backward.
    #[test]
    fn a_partial_rope_turns_the_first_columns_of_each_head() {
        let dev = Device::Cpu;
        let (b, t, heads, kv, hd, rot) = (2, 7, 4, 2, 10, 4);
        let n = heads + 2 * kv;
        let x = Var::from_vec(wave(b * t * n * hd, 11), (b, t, n * hd), &dev).unwrap();
        let positions: Vec<usize> = (0..b * t).map(|r| r % t).collect();
        let rotary = Rotary::new(500.0, None, rot, t);
        check(
            std::slice::from_ref(&x),
            |v| rope(&v[0], heads, kv, &rotary, false, None),
            |v| {
                let per_head = v[0].reshape((b, t, n, hd))?;
                let turned = per_head.narrow(3, 0, rot)?.reshape((b, t, n * rot))?;
                let turned = rope_composed(&turned, heads, kv, (500.0, 1.0), &positions)?;
                let passed = per_head.narrow(3, rot, hd - rot)?;
                Tensor::cat(&[&turned.reshape((b, t, n, rot))?, &passed], 3)?.reshape((
                    b,
                    t,
                    n * hd,
                ))
            },
            1e-5,
        );
    }

    #[test]
    fn rope_matches_hugging_face_layout_and_inverts() {
        let dev = Device::Cpu;
        // 4 query heads sharing 2 key/value heads, head width 6.
        let (b, t, heads, kv, hd) = (2, 9, 4, 2, 6);
        let w = (heads + 2 * kv) * hd;
        let x = Var::from_vec(wave(b * t * w, 13), (b, t, w), &dev).unwrap();
        let freq = |theta| Rotary::new(theta, None, hd, t);
        let in_sequence: Vec<usize> = (0..b * t).map(|r| r % t).collect();
        check(
            std::slice::from_ref(&x),
            |t| rope(&t[0], heads, kv, &freq(10_000.0), false, None),
            |t| rope_composed(&t[0], heads, kv, (10_000.0, 1.0), &in_sequence),
            1e-5,
        );
        // YaRN's attention factor scales the turned q and k, forward and
        // backward.
        let scaled = Rotary {
            scale: 1.25,
            ..freq(10_000.0)
        };
        check(
            std::slice::from_ref(&x),
            |t| rope(&t[0], heads, kv, &scaled, false, None),
            |t| rope_composed(&t[0], heads, kv, (10_000.0, 1.25), &in_sequence),
            1e-5,
        );
        // Documents ending at tokens 3 and 4 of the first sequence, 7 of
        // the second: positions restart after each.
        let mut ids = vec![0u32; b * t];
        for at in [3, 4, t + 7] {
            ids[at] = 1;
        }
        let docs = Documents::after_eos(&ids, t, 1);
        let in_document = [0, 1, 2, 3, 0, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0];
        check(
            std::slice::from_ref(&x),
            |t| rope(&t[0], heads, kv, &freq(10_000.0), false, Some(&docs)),
            |t| rope_composed(&t[0], heads, kv, (10_000.0, 1.0), &in_document),
            1e-5,
        );
        let y = rope(x.as_tensor(), heads, kv, &freq(500.0), false, None).unwrap();
        let back = rope(&y, heads, kv, &freq(500.0), true, None).unwrap();
        assert!(max_diff(&back, x.as_tensor()) < 1e-5);
        // Position 0 does not turn; v never does.
        let v = |t: &Tensor| t.narrow(2, (heads + kv) * hd, kv * hd).unwrap();
        assert_eq!(max_diff(&v(&y), &v(x.as_tensor())), 0.0);
        let first = |t: &Tensor| t.narrow(1, 0, 1).unwrap();
        assert_eq!(max_diff(&first(&y), &first(x.as_tensor())), 0.0);
    }
}
