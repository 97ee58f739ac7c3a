//! The GPT-2 model on one GPU: the embedding, the blocks and the head,
//! forward and backward, in f32, with the matrix products on cuBLAS and the
//! rest on `kernels/gpt.cu`.
//!
//! What stays on the host: the parameters, their gradients and the optimizer
//! (zengine's flat buffers, partitioned by ZeRO's stage exactly as on the
//! CPU), so a group's parameters are uploaded when its forward or backward
//! needs them and its gradients downloaded as soon as they exist: the data
//! flow of ZeRO-Offload, and the reason stages 0-3 stay bit-identical to each
//! other on the GPU (the stage changes only host code; the GPU computes the
//! same thing for every stage). What stays on the GPU: activations, from a
//! block's forward to its backward.
//!
//! Numerics: the same function as the CPU model in f32 (cuBLAS's SGEMM
//! without TF32, the kernels' f32 arithmetic), not the same bits; the tests
//! hold each gradient to the CPU model's within a stated relative error.
//! Deterministic: cuBLAS on one stream and kernels without atomics repeat
//! to the bit. Attention keeps its probabilities `[b·heads, t, t]` for the
//! backward (no recomputation yet), t² floats per head and sequence.

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use crate::gpu::grid_stride;
use crate::{CudaError, Gpu};

/// The shape of a GPT-2 model, as far as the GPU needs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptShape {
    /// Model width.
    pub d_model: usize,
    /// Attention heads (dividing `d_model`).
    pub n_heads: usize,
    /// The MLP's hidden width.
    pub ffn: usize,
    /// Vocabulary (rows of the token embedding).
    pub vocab: usize,
    /// Positions (rows of the position embedding).
    pub seq_len: usize,
    /// Layer norm's epsilon.
    pub eps: f32,
}

/// Parameters of a block: norm 1 (w, b), qkv (w, b), attention output
/// (w, b), norm 2 (w, b), MLP in (w, b), MLP out (w, b): zmodel's flat order.
pub const BLOCK_PARAMS: usize = 12;

/// Rows `[b, t, d]` of activations (or their gradient) in device memory.
pub struct Rows {
    buf: CudaSlice<f32>,
    b: usize,
    t: usize,
}

impl Rows {
    /// Sequences and positions.
    pub fn dims(&self) -> (usize, usize) {
        (self.b, self.t)
    }
}

/// A parameter group's tensors in device memory, in the group's order
/// (embedding: wte, wpe; block: zmodel's flat order of [`BLOCK_PARAMS`];
/// head: the final norm's weight and bias, and an untied output matrix).
pub struct Weights {
    p: Vec<CudaSlice<f32>>,
}

impl Weights {
    /// Tensors already on the device, in the group's order.
    pub fn from_parts(p: Vec<CudaSlice<f32>>) -> Weights {
        Weights { p }
    }

    /// The tensors.
    pub fn parts(&self) -> &[CudaSlice<f32>] {
        &self.p
    }

    /// The tensors, owned.
    pub fn into_parts(self) -> Vec<CudaSlice<f32>> {
        self.p
    }

    /// The tensors, to update in place (the optimizer).
    pub fn parts_mut(&mut self) -> &mut [CudaSlice<f32>] {
        &mut self.p
    }

    /// Values held, over every tensor.
    pub fn len(&self) -> usize {
        self.p.iter().map(|p| p.len()).sum()
    }

    /// Whether it holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.p.is_empty()
    }
}

/// What a block's forward keeps for its backward.
pub struct BlockActs {
    x: Rows,
    a1: CudaSlice<f32>,
    stats1: Stats,
    attention: Attention,
    rows1: CudaSlice<f32>,
    a2: CudaSlice<f32>,
    stats2: Stats,
    h: CudaSlice<f32>,
    g: CudaSlice<f32>,
}

impl BlockActs {
    /// The block's input alone (activation checkpointing keeps this and
    /// recomputes the rest).
    pub fn into_input(self) -> Rows {
        self.x
    }
}

/// The head's results: the mean loss and, after a backward, the gradients.
pub struct HeadOut {
    /// Mean cross-entropy over the rows (f64 sum of the rows' f32 losses).
    pub loss: f64,
    /// The gradient of the head's input (backward only).
    pub dx: Option<Rows>,
    /// Gradients of the final norm's weight and bias and of the output
    /// matrix `[vocab, d]` (backward only).
    pub grads: Option<[CudaSlice<f32>; 3]>,
}

/// Layer norm's per-row mean and 1/σ, kept for its backward.
type Stats = (CudaSlice<f32>, CudaSlice<f32>);

/// A layer's backward: its input's gradient and its parameters' (weight,
/// bias).
type Backward = (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<f32>);

/// What attention keeps for its backward: q, k, v head-major (`[b·heads,
/// t, hd]`), the probabilities (`[b·heads, t, t]`) and the output rows
/// (`[b, t, d]`, the output projection's input).
struct Attention {
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    probs: CudaSlice<f32>,
    out: CudaSlice<f32>,
}

/// `count` products of one head each, at strides (a, b, c) apart.
fn per_head(count: usize, strides: [usize; 3]) -> Batch {
    Batch { count, strides }
}

/// A row-major operand: the buffer, its first element, its row stride.
#[derive(Clone, Copy)]
struct Operand<'a> {
    buf: &'a CudaSlice<f32>,
    off: usize,
    ld: usize,
}

fn op<'a>(buf: &'a CudaSlice<f32>, off: usize, ld: usize) -> Operand<'a> {
    Operand { buf, off, ld }
}

/// `count` products at strides (a, b, c) apart.
#[derive(Clone, Copy)]
struct Batch {
    count: usize,
    strides: [usize; 3],
}

const ONE: Batch = Batch {
    count: 1,
    strides: [0; 3],
};

/// Threads per block of the row kernels (multiple of 32).
const ROW_THREADS: u32 = 256;
/// Rows a column-sum thread adds before the chunks are added.
const ROWS_PER_CHUNK: usize = 64;

/// The GPT-2 model's forward and backward on one GPU.
pub struct GptGpu {
    gpu: Gpu,
    blas: CudaBlas,
    shape: GptShape,
}

impl GptGpu {
    /// Opens GPU `ordinal` (kernels compiled, a cuBLAS handle on its stream)
    /// for a model of `shape`.
    pub fn open(ordinal: usize, shape: GptShape) -> Result<GptGpu, CudaError> {
        if shape.n_heads == 0 || !shape.d_model.is_multiple_of(shape.n_heads) {
            return Err(CudaError::Invalid(format!(
                "{} heads do not divide d_model {}",
                shape.n_heads, shape.d_model
            )));
        }
        if !crate::cublas_present() {
            return Err(CudaError::Missing(crate::NO_CUBLAS.into()));
        }
        let gpu = Gpu::open(ordinal)?;
        let blas = CudaBlas::new(gpu.stream().clone()).map_err(|e| {
            CudaError::Missing(format!("cuBLAS did not start on GPU {ordinal}: {e}"))
        })?;
        Ok(GptGpu { gpu, blas, shape })
    }

    /// Runs the f32 products on the tensor cores in TF32 from now on
    /// (cuBLAS's `CUBLAS_TF32_TENSOR_OP_MATH`: inputs rounded to TF32, f32
    /// sums), as PyTorch's `allow_tf32` does; off by default.
    pub fn allow_tf32(&mut self) -> Result<(), CudaError> {
        use cudarc::cublas::sys;
        // SAFETY: the handle is live; the call only sets its math mode.
        let status = unsafe {
            sys::cublasSetMathMode(
                *self.blas.handle(),
                sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
            )
        };
        match status {
            sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
            e => Err(CudaError::Invalid(format!("cuBLAS refused TF32: {e:?}"))),
        }
    }

    /// The GPU underneath.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Uploads a parameter group's tensors, in the group's order.
    pub fn upload(&self, params: &[&[f32]]) -> Result<Weights, CudaError> {
        let p = params
            .iter()
            .map(|v| self.gpu.upload(v))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Weights { p })
    }

    /// `w` as a block's parameters: twelve tensors of the block's shapes.
    fn block_params<'w>(&self, w: &'w Weights) -> Result<&'w [CudaSlice<f32>], CudaError> {
        let (d, f) = (self.shape.d_model, self.shape.ffn);
        let want = [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * f, f, f * d, d];
        let have: Vec<usize> = w.p.iter().map(|p| p.len()).collect();
        if have != want {
            return Err(CudaError::Invalid(format!(
                "a GPT-2 block of d_model {d} has tensors of {want:?} values, got {have:?}"
            )));
        }
        Ok(&w.p)
    }

    /// The embedding of `tokens` `[b, t]`: `wte[token] + wpe[position]`
    /// (`w`: wte, wpe).
    pub fn embed(
        &self,
        tokens: &[u32],
        b: usize,
        t: usize,
        w: &Weights,
    ) -> Result<Rows, CudaError> {
        let [wte, wpe] = w.p.as_slice() else {
            return Err(CudaError::Invalid(format!(
                "embedding: {} tensors, not wte and wpe",
                w.p.len()
            )));
        };
        let GptShape {
            d_model: d,
            vocab,
            seq_len,
            ..
        } = self.shape;
        if tokens.len() != b * t
            || t > seq_len
            || wte.len() != vocab * d
            || wpe.len() != seq_len * d
        {
            return Err(CudaError::Invalid(format!(
                "embedding: {} tokens for [{b}, {t}], wte {} and wpe {} values (vocab {vocab}, seq_len {seq_len}, d {d})",
                tokens.len(),
                wte.len(),
                wpe.len()
            )));
        }
        if let Some((i, tok)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &k)| k as usize >= vocab)
        {
            return Err(CudaError::Invalid(format!(
                "embedding: token {tok} at position {i} is outside the vocabulary of {vocab}"
            )));
        }
        let tok = self.gpu.upload(tokens)?;
        let n = b * t;
        let mut x = self.alloc(n * d)?;
        let (n64, t32, d32) = (n as u64, t as i32, d as i32);
        let mut l = self.gpu.stream().launch_builder(self.gpu.function("embed"));
        l.arg(&tok)
            .arg(wte)
            .arg(wpe)
            .arg(&mut x)
            .arg(&n64)
            .arg(&t32)
            .arg(&d32);
        // SAFETY: embed(tok[n], wte[vocab·d], wpe[seq_len·d], x[n·d], n, t, d),
        // tokens below vocab (checked), positions below t ≤ seq_len.
        self.launched("embed", unsafe { l.launch(grid_stride(n * d)) })?;
        Ok(Rows { buf: x, b, t })
    }

    /// The embedding's backward: the gradients of `wte` `[vocab, d]` and
    /// `wpe` `[seq_len, d]` from the tokens and `dx`, each a sum in row (or
    /// sequence) order from zero: the CPU's scatter-add to the bit.
    pub fn embed_backward(
        &self,
        tokens: &[u32],
        dx: &Rows,
    ) -> Result<[CudaSlice<f32>; 2], CudaError> {
        let GptShape {
            d_model: d,
            vocab,
            seq_len,
            ..
        } = self.shape;
        let (b, t) = dx.dims();
        if tokens.len() != b * t {
            return Err(CudaError::Invalid(format!(
                "embedding backward: {} tokens for [{b}, {t}]",
                tokens.len()
            )));
        }
        if let Some((i, tok)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &k)| k as usize >= vocab)
        {
            return Err(CudaError::Invalid(format!(
                "embedding backward: token {tok} at position {i} is outside the vocabulary of {vocab}"
            )));
        }
        // Rows grouped by token, each group in row order (a stable sort).
        let mut rows: Vec<u32> = (0..tokens.len() as u32).collect();
        rows.sort_by_key(|&r| tokens[r as usize]);
        let (mut present, mut start) = (Vec::new(), Vec::new());
        for (i, &r) in rows.iter().enumerate() {
            let tok = tokens[r as usize];
            if present.last() != Some(&tok) {
                present.push(tok);
                start.push(i as u32);
            }
        }
        start.push(rows.len() as u32);
        let mut dwte = self.gpu.zeros::<f32>(vocab * d)?;
        let mut dwpe = self.gpu.zeros::<f32>(seq_len * d)?;
        if present.is_empty() {
            return Ok([dwte, dwpe]);
        }
        let (present_d, start_d, rows_d) = (
            self.gpu.upload(&present)?,
            self.gpu.upload(&start)?,
            self.gpu.upload(&rows)?,
        );
        let d32 = d as i32;
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("embed_backward_tokens"));
        l.arg(&dx.buf)
            .arg(&present_d)
            .arg(&start_d)
            .arg(&rows_d)
            .arg(&mut dwte)
            .arg(&d32);
        let cfg = LaunchConfig {
            grid_dim: (present.len() as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one block per present token (below vocab, checked), its
        // rows below b·t, dwte of vocab·d, dx of b·t·d.
        self.launched("embed_backward_tokens", unsafe { l.launch(cfg) })?;
        let (b32, t32) = (b as i32, t as i32);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("embed_backward_positions"));
        l.arg(&dx.buf).arg(&mut dwpe).arg(&b32).arg(&t32).arg(&d32);
        // SAFETY: t ≤ seq_len (the embedding checked it): t·d values of
        // dwpe written, dx holds b·t·d.
        self.launched("embed_backward_positions", unsafe {
            l.launch(grid_stride(t * d))
        })?;
        Ok([dwte, dwpe])
    }

    /// A block's forward: its output, and what its backward needs.
    pub fn block_forward(&self, w: &Weights, x: Rows) -> Result<(Rows, BlockActs), CudaError> {
        let d = self.shape.d_model;
        let (b, t) = x.dims();
        let n = b * t;
        let p = self.block_params(w)?;
        let (a1, stats1) = self.layer_norm(&x.buf, &p[0], &p[1], n)?;
        let qkv = self.linear(&a1, n, d, &p[2], &p[3], 3 * d, None)?;
        let attention = self.attention(&qkv, b, t)?;
        drop(qkv);
        let rows1 = self.linear(&attention.out, n, d, &p[4], &p[5], d, Some(&x.buf))?;
        let (a2, stats2) = self.layer_norm(&rows1, &p[6], &p[7], n)?;
        let f = self.shape.ffn;
        let h = self.linear(&a2, n, d, &p[8], &p[9], f, None)?;
        let mut g = self.alloc(n * f)?;
        self.elementwise("gelu", &h, None, &mut g)?;
        let y = self.linear(&g, n, f, &p[10], &p[11], d, Some(&rows1))?;
        let acts = BlockActs {
            x,
            a1,
            stats1,
            attention,
            rows1,
            a2,
            stats2,
            h,
            g,
        };
        Ok((Rows { buf: y, b, t }, acts))
    }

    /// A block's backward from `dy`: its parameters' gradients (zmodel's
    /// flat order) and its input's gradient.
    pub fn block_backward(
        &self,
        w: &Weights,
        acts: &BlockActs,
        dy: &Rows,
    ) -> Result<(Vec<CudaSlice<f32>>, Rows), CudaError> {
        let d = self.shape.d_model;
        let (b, t) = dy.dims();
        let n = b * t;
        let p = self.block_params(w)?;
        let dy = &dy.buf;
        let mut grads: Vec<Option<CudaSlice<f32>>> = (0..BLOCK_PARAMS).map(|_| None).collect();
        // y = rows1 + g·W_out + b_out
        let f = self.shape.ffn;
        let (dg, dw, db) = self.linear_backward(&acts.g, n, f, &p[10], d, dy)?;
        (grads[10], grads[11]) = (Some(dw), Some(db));
        let mut dh = self.alloc(n * f)?;
        self.elementwise("gelu_backward", &acts.h, Some(&dg), &mut dh)?;
        drop(dg);
        let (da2, dw, db) = self.linear_backward(&acts.a2, n, d, &p[8], f, &dh)?;
        (grads[8], grads[9]) = (Some(dw), Some(db));
        drop(dh);
        let (drows1, dw, db) =
            self.layer_norm_backward(&acts.rows1, &p[6], &acts.stats2, &da2, Some(dy), n)?;
        (grads[6], grads[7]) = (Some(dw), Some(db));
        // rows1 = x + att·W_o + b_o
        let (datt, dw, db) = self.linear_backward(&acts.attention.out, n, d, &p[4], d, &drows1)?;
        (grads[4], grads[5]) = (Some(dw), Some(db));
        let dqkv = self.attention_backward(&acts.attention, &datt, b, t)?;
        drop(datt);
        let (da1, dw, db) = self.linear_backward(&acts.a1, n, d, &p[2], 3 * d, &dqkv)?;
        (grads[2], grads[3]) = (Some(dw), Some(db));
        let (dx, dw, db) =
            self.layer_norm_backward(&acts.x.buf, &p[0], &acts.stats1, &da1, Some(&drows1), n)?;
        (grads[0], grads[1]) = (Some(dw), Some(db));
        let grads = grads
            .into_iter()
            .map(|g| g.expect("every gradient set"))
            .collect();
        Ok((grads, Rows { buf: dx, b, t }))
    }

    /// The head: the final norm (`head`'s weight and bias), logits against
    /// the output matrix `[vocab, d]` (`head`'s third tensor, or when tied
    /// the token embedding, `wte`'s first), the mean cross-entropy against
    /// `targets`; with `backward`, the gradients of the loss times `scale`.
    pub fn head(
        &self,
        x: &Rows,
        head: &Weights,
        wte: Option<&Weights>,
        targets: &[u32],
        scale: f64,
        backward: bool,
    ) -> Result<HeadOut, CudaError> {
        let GptShape {
            d_model: d, vocab, ..
        } = self.shape;
        let (b, t) = x.dims();
        let n = b * t;
        let (nw, nb, om) = match (head.p.as_slice(), wte) {
            ([w, b, out], _) => (w, b, out),
            ([w, b], Some(wte)) if !wte.p.is_empty() => (w, b, &wte.p[0]),
            _ => {
                return Err(CudaError::Invalid(format!(
                    "head: {} tensors and {} output matrix",
                    head.p.len(),
                    if wte.is_some() { "a tied" } else { "no" }
                )))
            }
        };
        if nw.len() != d || nb.len() != d || om.len() != vocab * d || targets.len() != n {
            return Err(CudaError::Invalid(format!(
                "head: norm {} and {}, output matrix {}, {} targets (d {d}, vocab {vocab}, {n} rows)",
                nw.len(),
                nb.len(),
                om.len(),
                targets.len()
            )));
        }
        if let Some((i, tok)) = targets
            .iter()
            .enumerate()
            .find(|(_, &k)| k as usize >= vocab)
        {
            return Err(CudaError::Invalid(format!(
                "cross-entropy: target {tok} at position {i} is outside the vocabulary of {vocab}"
            )));
        }
        let tg = self.gpu.upload(targets)?;
        let (normed, stats) = self.layer_norm(&x.buf, nw, nb, n)?;
        // logits [n, vocab] = normed · outᵀ
        let mut logits = self.alloc(n * vocab)?;
        self.gemm(
            false,
            true,
            (n, vocab, d),
            op(&normed, 0, d),
            op(om, 0, d),
            (&mut logits, 0, vocab),
            ONE,
        )?;
        let mut losses = self.alloc(n)?;
        let (v32, coef, grad) = (vocab as i32, (scale / n as f64) as f32, backward as i32);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("cross_entropy"));
        l.arg(&mut logits)
            .arg(&tg)
            .arg(&mut losses)
            .arg(&v32)
            .arg(&coef)
            .arg(&grad);
        // SAFETY: cross_entropy(logits[n·vocab], targets[n] < vocab (checked),
        // loss[n], vocab, coef, grad), one block per row.
        self.launched("cross_entropy", unsafe { l.launch(rows_config(n)) })?;
        let loss = self
            .gpu
            .download(&losses)?
            .iter()
            .map(|&v| f64::from(v))
            .sum::<f64>()
            / n as f64;
        if !backward {
            return Ok(HeadOut {
                loss,
                dx: None,
                grads: None,
            });
        }
        // dnormed [n, d] = dlogits · out; dout [vocab, d] = dlogitsᵀ · normed
        let mut dnormed = self.alloc(n * d)?;
        self.gemm(
            false,
            false,
            (n, d, vocab),
            op(&logits, 0, vocab),
            op(om, 0, d),
            (&mut dnormed, 0, d),
            ONE,
        )?;
        let mut dout = self.alloc(vocab * d)?;
        self.gemm(
            true,
            false,
            (vocab, d, n),
            op(&logits, 0, vocab),
            op(&normed, 0, d),
            (&mut dout, 0, d),
            ONE,
        )?;
        let (dx, dw, db) = self.layer_norm_backward(&x.buf, nw, &stats, &dnormed, None, n)?;
        Ok(HeadOut {
            loss,
            dx: Some(Rows { buf: dx, b, t }),
            grads: Some([dw, db, dout]),
        })
    }

    /// Rows `[b, t, d]` from host values (tests, and callers that start from
    /// the host).
    pub fn rows_from_host(&self, values: &[f32], b: usize, t: usize) -> Result<Rows, CudaError> {
        if values.len() != b * t * self.shape.d_model {
            return Err(CudaError::Invalid(format!(
                "{} values for rows [{b}, {t}, {}]",
                values.len(),
                self.shape.d_model
            )));
        }
        Ok(Rows {
            buf: self.gpu.upload(values)?,
            b,
            t,
        })
    }

    /// Copies rows back to the host (`[b·t·d]`).
    pub fn download(&self, rows: &Rows) -> Result<Vec<f32>, CudaError> {
        self.gpu.download(&rows.buf)
    }

    /// Copies gradients back to the host, in order.
    pub fn download_all(&self, grads: &[CudaSlice<f32>]) -> Result<Vec<Vec<f32>>, CudaError> {
        grads.iter().map(|g| self.gpu.download(g)).collect()
    }

    fn alloc(&self, len: usize) -> Result<CudaSlice<f32>, CudaError> {
        // SAFETY: every caller writes all `len` values before any is read.
        unsafe { self.gpu.stream().alloc::<f32>(len) }.map_err(|source| CudaError::Driver {
            what: format!("allocating {len} floats on the GPU"),
            source,
        })
    }

    fn launched<T>(
        &self,
        what: &str,
        r: Result<T, cudarc::driver::DriverError>,
    ) -> Result<(), CudaError> {
        r.map(|_| ()).map_err(|source| CudaError::Driver {
            what: format!("launching {what}"),
            source,
        })
    }

    /// `y = x·W + b` (+ `residual`): x `[n, k]`, W `[k, width]`.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        k: usize,
        w: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        width: usize,
        residual: Option<&CudaSlice<f32>>,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let mut y = self.alloc(n * width)?;
        self.gemm(
            false,
            false,
            (n, width, k),
            op(x, 0, k),
            op(w, 0, width),
            (&mut y, 0, width),
            ONE,
        )?;
        let (n64, w32, null) = (n as u64, width as i32, 0u64);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("bias_residual"));
        l.arg(&mut y).arg(bias);
        match residual {
            Some(r) => l.arg(r),
            None => l.arg(&null),
        };
        l.arg(&n64).arg(&w32);
        // SAFETY: bias_residual(y[n·width], b[width], res[n·width] or null, n, width).
        self.launched("bias_residual", unsafe { l.launch(grid_stride(n * width)) })?;
        Ok(y)
    }

    /// The backward of [`GptGpu::linear`]: (dx `[n, k]`, dW and db on the host).
    fn linear_backward(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        k: usize,
        w: &CudaSlice<f32>,
        width: usize,
        dy: &CudaSlice<f32>,
    ) -> Result<Backward, CudaError> {
        let mut dw = self.alloc(k * width)?;
        self.gemm(
            true,
            false,
            (k, width, n),
            op(x, 0, k),
            op(dy, 0, width),
            (&mut dw, 0, width),
            ONE,
        )?;
        let mut dx = self.alloc(n * k)?;
        self.gemm(
            false,
            true,
            (n, k, width),
            op(dy, 0, width),
            op(w, 0, width),
            (&mut dx, 0, k),
            ONE,
        )?;
        let db = self.column_sums(dy, n, width)?;
        Ok((dx, dw, db))
    }

    /// `Σ_r a[r, ·]` over `rows` rows of `width`: per chunk of rows, then
    /// over the chunks, each in order.
    fn column_sums(
        &self,
        a: &CudaSlice<f32>,
        rows: usize,
        width: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let chunks = rows.div_ceil(ROWS_PER_CHUNK).max(1);
        let mut part = self.alloc(chunks * width)?;
        self.column_sums_into(a, rows, width, ROWS_PER_CHUNK, &mut part)?;
        let mut out = self.alloc(width)?;
        self.column_sums_into(&part, chunks, width, chunks, &mut out)?;
        Ok(out)
    }

    fn column_sums_into(
        &self,
        a: &CudaSlice<f32>,
        rows: usize,
        width: usize,
        rows_per: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (r32, w32, per32) = (rows as i32, width as i32, rows_per as i32);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("column_sums"));
        l.arg(a).arg(&mut *out).arg(&r32).arg(&w32).arg(&per32);
        let cfg = LaunchConfig {
            grid_dim: (
                width.div_ceil(ROW_THREADS as usize) as u32,
                rows.div_ceil(rows_per).max(1) as u32,
                1,
            ),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: column_sums(a[rows·width], out[chunks·width], rows, width,
        // rows_per): chunk y writes out[y·width + c] for c < width.
        self.launched("column_sums", unsafe { l.launch(cfg) })
    }

    /// Layer norm of `n` rows: the output and (mean, rstd) per row.
    fn layer_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(CudaSlice<f32>, Stats), CudaError> {
        let d = self.shape.d_model;
        let (mut y, mut mean, mut rstd) = (self.alloc(n * d)?, self.alloc(n)?, self.alloc(n)?);
        let (d32, eps) = (d as i32, self.shape.eps);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("layer_norm"));
        l.arg(x)
            .arg(w)
            .arg(b)
            .arg(&mut y)
            .arg(&mut mean)
            .arg(&mut rstd)
            .arg(&d32)
            .arg(&eps);
        // SAFETY: layer_norm(x[n·d], w[d], b[d], y[n·d], mean[n], rstd[n], d,
        // eps), one block per row.
        self.launched("layer_norm", unsafe { l.launch(rows_config(n)) })?;
        Ok((y, (mean, rstd)))
    }

    /// Layer norm's backward: (dx [+ dres], dw and db on the host).
    fn layer_norm_backward(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        stats: &Stats,
        dy: &CudaSlice<f32>,
        dres: Option<&CudaSlice<f32>>,
        n: usize,
    ) -> Result<Backward, CudaError> {
        let d = self.shape.d_model;
        let mut dx = self.alloc(n * d)?;
        let (d32, n32, null) = (d as i32, n as i32, 0u64);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("layer_norm_backward"));
        l.arg(x).arg(w).arg(&stats.0).arg(&stats.1).arg(dy);
        match dres {
            Some(r) => l.arg(r),
            None => l.arg(&null),
        };
        l.arg(&mut dx).arg(&d32);
        // SAFETY: layer_norm_backward(x, w, mean, rstd, dy, dres or null, dx,
        // d) over n rows of d, one block per row.
        self.launched("layer_norm_backward", unsafe { l.launch(rows_config(n)) })?;
        let chunks = n.div_ceil(ROWS_PER_CHUNK).max(1);
        let (mut dw_part, mut db_part) = (self.alloc(chunks * d)?, self.alloc(chunks * d)?);
        let per32 = ROWS_PER_CHUNK as i32;
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("layer_norm_param_partials"));
        l.arg(x)
            .arg(&stats.0)
            .arg(&stats.1)
            .arg(dy)
            .arg(&mut dw_part)
            .arg(&mut db_part)
            .arg(&n32)
            .arg(&d32)
            .arg(&per32);
        let cfg = LaunchConfig {
            grid_dim: (d.div_ceil(ROW_THREADS as usize) as u32, chunks as u32, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: chunk y writes dw_part/db_part[y·d + c], c < d, from rows
        // of its chunk below n.
        self.launched("layer_norm_param_partials", unsafe { l.launch(cfg) })?;
        let (mut dw, mut db) = (self.alloc(d)?, self.alloc(d)?);
        self.column_sums_into(&dw_part, chunks, d, chunks, &mut dw)?;
        self.column_sums_into(&db_part, chunks, d, chunks, &mut db)?;
        Ok((dx, dw, db))
    }

    /// `out = f(a)` (`gelu`) or `out = f'(a)·b` (`gelu_backward`).
    fn elementwise(
        &self,
        kernel: &'static str,
        a: &CudaSlice<f32>,
        b: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let n = a.len();
        let n64 = n as u64;
        let mut l = self.gpu.stream().launch_builder(self.gpu.function(kernel));
        l.arg(a);
        if let Some(b) = b {
            l.arg(b);
        }
        l.arg(&mut *out).arg(&n64);
        // SAFETY: gelu(h, g, n) / gelu_backward(h, dg, dh, n), every buffer
        // of n values.
        self.launched(kernel, unsafe { l.launch(grid_stride(n)) })
    }

    /// Causal attention over `qkv` `[b, t, 3d]`: (q, k, v as `[b·heads, t,
    /// hd]`, probabilities `[b·heads, t, t]`, output `[b, t, d]` with head h
    /// in columns h·hd..). In the head-major layout every head of every
    /// sequence is one entry of a single strided batched product.
    fn attention(&self, qkv: &CudaSlice<f32>, b: usize, t: usize) -> Result<Attention, CudaError> {
        let (d, heads) = (self.shape.d_model, self.shape.n_heads);
        let hd = d / heads;
        let q = self.to_heads(qkv, 3 * d, 0, b, t)?;
        let k = self.to_heads(qkv, 3 * d, d, b, t)?;
        let v = self.to_heads(qkv, 3 * d, 2 * d, b, t)?;
        let bh = b * heads;
        let mut probs = self.alloc(bh * t * t)?;
        // S = Q · Kᵀ
        self.gemm(
            false,
            true,
            (t, t, hd),
            op(&q, 0, hd),
            op(&k, 0, hd),
            (&mut probs, 0, t),
            per_head(bh, [t * hd, t * hd, t * t]),
        )?;
        self.softmax(&mut probs, None, bh * t, t)?;
        // O = P · V
        let mut o = self.alloc(bh * t * hd)?;
        self.gemm(
            false,
            false,
            (t, hd, t),
            op(&probs, 0, t),
            op(&v, 0, hd),
            (&mut o, 0, hd),
            per_head(bh, [t * t, t * hd, t * hd]),
        )?;
        let mut att = self.alloc(b * t * d)?;
        self.heads_into_rows(&o, &mut att, d, 0, b, t)?;
        Ok(Attention {
            q,
            k,
            v,
            probs,
            out: att,
        })
    }

    /// Attention's backward: dqkv `[b, t, 3d]` from the output's gradient.
    fn attention_backward(
        &self,
        a: &Attention,
        datt: &CudaSlice<f32>,
        b: usize,
        t: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let (d, heads) = (self.shape.d_model, self.shape.n_heads);
        let hd = d / heads;
        let bh = b * heads;
        let dout = self.to_heads(datt, d, 0, b, t)?;
        let (th, tt) = (t * hd, t * t);
        // dP = dO · Vᵀ, then dS in place.
        let mut ds = self.alloc(bh * tt)?;
        self.gemm(
            false,
            true,
            (t, t, hd),
            op(&dout, 0, hd),
            op(&a.v, 0, hd),
            (&mut ds, 0, t),
            per_head(bh, [th, th, tt]),
        )?;
        // dV = Pᵀ · dO
        let mut dv = self.alloc(bh * th)?;
        self.gemm(
            true,
            false,
            (t, hd, t),
            op(&a.probs, 0, t),
            op(&dout, 0, hd),
            (&mut dv, 0, hd),
            per_head(bh, [tt, th, th]),
        )?;
        drop(dout);
        self.softmax(&mut ds, Some(&a.probs), bh * t, t)?;
        // dQ = dS · K; dK = dSᵀ · Q
        let mut dq = self.alloc(bh * th)?;
        self.gemm(
            false,
            false,
            (t, hd, t),
            op(&ds, 0, t),
            op(&a.k, 0, hd),
            (&mut dq, 0, hd),
            per_head(bh, [tt, th, th]),
        )?;
        let mut dk = self.alloc(bh * th)?;
        self.gemm(
            true,
            false,
            (t, hd, t),
            op(&ds, 0, t),
            op(&a.q, 0, hd),
            (&mut dk, 0, hd),
            per_head(bh, [tt, th, th]),
        )?;
        let mut dqkv = self.alloc(b * t * 3 * d)?;
        self.heads_into_rows(&dq, &mut dqkv, 3 * d, 0, b, t)?;
        self.heads_into_rows(&dk, &mut dqkv, 3 * d, d, b, t)?;
        self.heads_into_rows(&dv, &mut dqkv, 3 * d, 2 * d, b, t)?;
        Ok(dqkv)
    }

    /// Columns `col0..col0 + d` of `rows` (rows of `ld`) as `[b·heads, t, hd]`.
    fn to_heads(
        &self,
        rows: &CudaSlice<f32>,
        ld: usize,
        col0: usize,
        b: usize,
        t: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let mut heads = self.alloc(b * t * self.shape.d_model)?;
        self.relayout("rows_to_heads", rows, &mut heads, ld, col0, b, t)?;
        Ok(heads)
    }

    /// `[b·heads, t, hd]` into columns `col0..col0 + d` of `rows` (rows of `ld`).
    #[allow(clippy::too_many_arguments)]
    fn heads_into_rows(
        &self,
        heads: &CudaSlice<f32>,
        rows: &mut CudaSlice<f32>,
        ld: usize,
        col0: usize,
        b: usize,
        t: usize,
    ) -> Result<(), CudaError> {
        self.relayout("heads_to_rows", heads, rows, ld, col0, b, t)
    }

    #[allow(clippy::too_many_arguments)]
    fn relayout(
        &self,
        kernel: &'static str,
        src: &CudaSlice<f32>,
        dst: &mut CudaSlice<f32>,
        ld: usize,
        col0: usize,
        b: usize,
        t: usize,
    ) -> Result<(), CudaError> {
        let (d, heads) = (self.shape.d_model, self.shape.n_heads);
        let rows_len = if kernel == "rows_to_heads" {
            src.len()
        } else {
            dst.len()
        };
        if col0 + d > ld || rows_len < b * t * ld || src.len().min(dst.len()) < b * t * d {
            return Err(CudaError::Invalid(format!(
                "{kernel}: [{b}, {t}] rows of {ld} from column {col0}, buffers {} and {}",
                src.len(),
                dst.len()
            )));
        }
        let ints = [ld, col0, b, t, heads, d / heads].map(|x| x as i32);
        let mut l = self.gpu.stream().launch_builder(self.gpu.function(kernel));
        match kernel {
            "rows_to_heads" => l.arg(src).arg(&ints[0]).arg(&ints[1]).arg(&mut *dst),
            _ => l.arg(src).arg(&mut *dst).arg(&ints[0]).arg(&ints[1]),
        };
        l.arg(&ints[2]).arg(&ints[3]).arg(&ints[4]).arg(&ints[5]);
        // SAFETY: rows_to_heads(rows, ld, col0, heads, b, t, h, hd) /
        // heads_to_rows(heads, rows, ld, col0, b, t, h, hd): b·t rows of ld
        // with col0 + d ≤ ld, and b·t·d head values (checked above).
        self.launched(kernel, unsafe { l.launch(grid_stride(b * t * d)) })
    }

    /// The causal softmax of `rows` rows of `t` in place, or with `probs`
    /// its backward (dP in, dS out).
    fn softmax(
        &self,
        s: &mut CudaSlice<f32>,
        probs: Option<&CudaSlice<f32>>,
        rows: usize,
        t: usize,
    ) -> Result<(), CudaError> {
        let scale = 1.0 / ((self.shape.d_model / self.shape.n_heads) as f32).sqrt();
        let (rows64, t32) = (rows as u64, t as i32);
        let kernel = match probs {
            None => "causal_softmax",
            Some(_) => "causal_softmax_backward",
        };
        let mut l = self.gpu.stream().launch_builder(self.gpu.function(kernel));
        if let Some(p) = probs {
            l.arg(p);
        }
        l.arg(&mut *s).arg(&rows64).arg(&t32).arg(&scale);
        let warps = ROW_THREADS as usize / 32;
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(warps) as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one warp per row of t, rows·t values in s (and probs).
        self.launched(kernel, unsafe { l.launch(cfg) })
    }

    /// Row-major `C = op(A)·op(B)` of (m, n, k), `count` times at the
    /// batch's strides, on cuBLAS (column-major, so it computes `Cᵀ =
    /// op(B)ᵀ·op(A)ᵀ`). Every operand's extent is checked against its buffer.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        ta: bool,
        tb: bool,
        (m, n, k): (usize, usize, usize),
        a: Operand<'_>,
        b: Operand<'_>,
        c: (&mut CudaSlice<f32>, usize, usize),
        batch: Batch,
    ) -> Result<(), CudaError> {
        let (c, c_off, ldc) = c;
        let extent = |rows: usize, cols: usize, off: usize, ld: usize, stride: usize| {
            off + (batch.count - 1) * stride + (rows - 1) * ld + cols
        };
        let (ar, ac) = if ta { (k, m) } else { (m, k) };
        let (br, bc) = if tb { (n, k) } else { (k, n) };
        let checks = [
            (
                "A",
                extent(ar, ac, a.off, a.ld, batch.strides[0]),
                a.buf.len(),
                a.ld < ac,
            ),
            (
                "B",
                extent(br, bc, b.off, b.ld, batch.strides[1]),
                b.buf.len(),
                b.ld < bc,
            ),
            (
                "C",
                extent(m, n, c_off, ldc, batch.strides[2]),
                c.len(),
                ldc < n,
            ),
        ];
        for (name, need, have, bad_ld) in checks {
            if need > have || bad_ld {
                return Err(CudaError::Invalid(format!(
                    "gemm ({m}×{n}×{k}, {} times): operand {name} needs {need} values, has {have}",
                    batch.count
                )));
            }
        }
        let t = |x: bool| match x {
            true => cublasOperation_t::CUBLAS_OP_T,
            false => cublasOperation_t::CUBLAS_OP_N,
        };
        let gemm = GemmConfig {
            transa: t(tb),
            transb: t(ta),
            m: n as i32,
            n: m as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: b.ld as i32,
            ldb: a.ld as i32,
            beta: 0.0f32,
            ldc: ldc as i32,
        };
        let (av, bv) = (a.buf.slice(a.off..), b.buf.slice(b.off..));
        let mut cv = c.slice_mut(c_off..);
        // SAFETY: every operand's extent lies inside its buffer (checked
        // above); C does not alias A or B (distinct buffers by borrow).
        let r = unsafe {
            match batch.count {
                1 => self.blas.gemm(gemm, &bv, &av, &mut cv),
                count => self.blas.gemm_strided_batched(
                    StridedBatchedConfig {
                        gemm,
                        batch_size: count as i32,
                        stride_a: batch.strides[1] as i64,
                        stride_b: batch.strides[0] as i64,
                        stride_c: batch.strides[2] as i64,
                    },
                    &bv,
                    &av,
                    &mut cv,
                ),
            }
        };
        r.map_err(|e| CudaError::Invalid(format!("cuBLAS gemm ({m}×{n}×{k}): {e}")))
    }
}

/// One block of [`ROW_THREADS`] per row.
fn rows_config(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}
