//! The GPT-2 and LLaMA models on one GPU: the embedding, the blocks and the
//! head, forward and backward, in f32, with the matrix products on cuBLAS
//! and the rest on `kernels/gpt.cu`. Both families are one chain of blocks
//! with two norms and four linears in the same places (zconfig's `arch`),
//! so one forward and one backward serve both: a [`Family`] picks the norm
//! (layer norm or RMSNorm), the MLP's activation (GELU or SwiGLU on gate and
//! up side by side), the positions (learned, or rotary on q and k), biases
//! (GPT-2's on every part; LLaMA's none, or Qwen2's on q, k and v alone)
//! and grouped-query attention's key/value heads.
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
//! without TF32 or 16-bit products, the kernels' f32 arithmetic), not the same bits; the tests
//! hold each gradient to the CPU model's within a stated relative error.
//! Deterministic: cuBLAS on one stream and kernels whose sums run in a
//! fixed order repeat to the bit (the column kernels' one atomic counts
//! finished blocks; it does not order any sum). Attention keeps its probabilities `[b·heads, t, t]` for the
//! backward (no recomputation yet), t² floats per head and sequence.

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{
    CudaSlice, CudaViewMut, DevicePtr, DevicePtrMut, LaunchArgs, LaunchConfig, PushKernelArg,
};

use crate::gpu::{grid_stride, FormatCode};
use crate::{CudaError, Gpu, Half16};

/// The target of a row the loss leaves out: zmodel's `head::IGNORED` (the
/// kernel's `IGNORED`), which a loss mask's batches carry.
pub const IGNORED: u32 = u32::MAX;

/// The decoder family: what a block's norms, MLP, positions and biases are.
#[derive(Debug, Clone, PartialEq)]
pub enum Family {
    /// GPT-2: layer norms and linears with biases, GELU, learned positions.
    Gpt2,
    /// LLaMA: RMSNorm, SwiGLU, rotary positions, no biases (but Qwen2's on
    /// q, k and v, `qkv_bias`), `kv_heads` key/value heads (dividing the
    /// query heads).
    Llama {
        /// Key/value heads.
        kv_heads: usize,
        /// Whether the q, k and v projection has a bias (Qwen2 and Qwen2.5;
        /// zconfig's `model.qkv_bias`), added before the rotation.
        qkv_bias: bool,
        /// Whether each head's q and k are RMS-normalised before the
        /// rotation (Qwen3; zconfig's `model.qk_norm`), a weight of
        /// `head_dim` each after the q, k and v projection's parameters.
        qk_norm: bool,
        /// The rotary embeddings' base.
        rope_theta: f64,
        /// Their scaling for a longer context, if any.
        rope_scaling: Option<zconfig::spec::RopeScaling>,
        /// The columns of each q and k head they turn where not all
        /// (zconfig's `model.partial_rotary_factor`): the first ones.
        rotary_dim: Option<usize>,
        /// The most keys a token attends to, itself included (zconfig's
        /// `model.sliding_window`): attention's rows bounded from below as
        /// by a document, the positions left as they are.
        window: Option<usize>,
    },
}

/// The shape of a GPT-2 or LLaMA model, as far as the GPU needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct GptShape {
    /// The decoder family.
    pub family: Family,
    /// Model width.
    pub d_model: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// The width of a head (`d_model / n_heads` but in Qwen3's wider
    /// heads, zconfig's `model.head_dim`).
    pub head_dim: usize,
    /// The MLP's hidden width.
    pub ffn: usize,
    /// Vocabulary (rows of the token embedding).
    pub vocab: usize,
    /// Positions (rows of GPT-2's position embedding; LLaMA's rotary table).
    pub seq_len: usize,
    /// The norms' epsilon.
    pub eps: f32,
}

impl GptShape {
    fn llama(&self) -> bool {
        matches!(self.family, Family::Llama { .. })
    }

    /// The sliding window where it is shorter than sequences of `t`.
    fn window(&self, t: usize) -> Option<usize> {
        match self.family {
            Family::Llama { window, .. } => window.filter(|&w| w < t),
            Family::Gpt2 => None,
        }
    }

    /// Key/value heads (all heads but in grouped-query attention).
    fn kv_heads(&self) -> usize {
        match self.family {
            Family::Gpt2 => self.n_heads,
            Family::Llama { kv_heads, .. } => kv_heads,
        }
    }

    fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The columns of each q and k head the rotary embedding turns.
    fn rotary_dim(&self) -> usize {
        match self.family {
            Family::Llama {
                rotary_dim: Some(r),
                ..
            } => r,
            _ => self.head_dim,
        }
    }

    /// Width of attention's output: the query heads side by side.
    fn attn_width(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Whether the block has Qwen3's norms of q and k.
    fn qk_norm(&self) -> bool {
        matches!(self.family, Family::Llama { qk_norm: true, .. })
    }

    /// Whether each of a block's [`PARTS`] has a bias (zconfig's
    /// `norm_biases` and `linear_biases` in the parts' order): GPT-2's all,
    /// LLaMA's none but the q, k and v projection's under `qkv_bias`.
    fn part_biases(&self) -> [bool; PARTS] {
        match self.family {
            Family::Gpt2 => [true; PARTS],
            Family::Llama { qkv_bias, .. } => [false, qkv_bias, false, false, false, false],
        }
    }

    /// Width of the fused projection's output: q, k and v side by side.
    fn qkv_width(&self) -> usize {
        (self.n_heads + 2 * self.kv_heads()) * self.head_dim()
    }

    /// Width of the MLP's first linear: GPT-2's hidden layer, or LLaMA's
    /// gate and up side by side.
    fn mlp_in_width(&self) -> usize {
        match self.family {
            Family::Gpt2 => self.ffn,
            Family::Llama { .. } => 2 * self.ffn,
        }
    }
}

/// Parameters of a GPT-2 block: norm 1 (w, b), qkv (w, b), attention
/// output (w, b), norm 2 (w, b), MLP in (w, b), MLP out (w, b): zmodel's
/// flat order. A LLaMA block has the six weights alone, in the same order
/// (Qwen2's with qkv's bias after its weight).
pub const BLOCK_PARAMS: usize = 12;

/// A block's six parts in forward order: norm 1, qkv, attention output,
/// norm 2, MLP in, MLP out.
const PARTS: usize = 6;

/// A tensor's gradient, or none where it is frozen and not made.
type MaybeGrad = Option<CudaSlice<f32>>;

/// A part's gradients: its weight's (none where it is frozen), and its
/// bias's where it has one.
type PartGrads = (MaybeGrad, Option<CudaSlice<f32>>);

/// A part's weight and bias, where it has one.
type Part<'w> = (Weight<'w>, Option<&'w CudaSlice<f32>>);

/// A block's parameters by part: each part's weight and bias, where it has one.
struct BlockWeights<'w> {
    parts: [Part<'w>; PARTS],
    /// Each part's weight's place among the block's tensors.
    first: [usize; PARTS],
    /// Qwen3's norms of q and k: their weights.
    qk_norms: Option<[&'w CudaSlice<f32>; 2]>,
}

/// A weight tensor as the model reads it: its f32 values, and where the
/// products are 16-bit and the optimizer keeps a 16-bit working copy
/// ([`Weights::with_half`]), that copy's buffer and the element the tensor
/// starts at, which products read in place of rounding the f32 values (the
/// same bits: the f32 values are the working copy's, widened).
#[derive(Clone, Copy)]
struct Weight<'w> {
    /// None where the tensor is held in 16 bits alone.
    f32: Option<&'w CudaSlice<f32>>,
    half: Option<(&'w CudaSlice<u16>, usize)>,
    len: usize,
}

impl<'w> Weight<'w> {
    /// The f32 values, which every reader but a product needs.
    fn values(&self) -> Result<&'w CudaSlice<f32>, CudaError> {
        self.f32
            .ok_or_else(|| CudaError::Invalid("a tensor held in 16 bits alone read as f32".into()))
    }
}

/// A dropout's mask, as zmodel's `Dropout` makes it (gpt.cu's `dropped`
/// hashes each element's index under `key` as zmodel's does): an element
/// whose hash is below `threshold` (p·2³²) is dropped, the rest multiplied
/// by `scale` (1/(1 − p)). The keys (step, micro-batch, rank, block, site)
/// are zmodel's, made on the host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mask {
    /// Hashes below it are dropped.
    pub threshold: u32,
    /// What the kept elements are multiplied by.
    pub scale: f32,
    /// The tensor's key.
    pub key: u32,
}

/// NEFTune's noise on the embeddings' output, as zmodel's `Noise` draws it:
/// uniform in `[−magnitude, magnitude)` from the hash of each element's
/// index under `key`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Noise {
    /// Half the draws' range.
    pub magnitude: f32,
    /// The tensor's key.
    pub key: u32,
}

/// A block's dropouts: of its attention's and MLP's outputs
/// (`model.hidden_dropout`) and of its attention's probabilities
/// (`model.attention_dropout`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Dropouts {
    /// The attention's and the MLP's outputs' masks.
    pub hidden: Option<[Mask; 2]>,
    /// The probabilities' mask.
    pub attention: Option<Mask>,
}

/// (threshold, scale, key) of gpt.cu's dropping kernels: a threshold of 0
/// drops nothing.
fn mask_args(mask: Option<Mask>) -> (u32, f32, u32) {
    mask.map_or((0, 1.0, 0), |m| (m.threshold, m.scale, m.key))
}

/// Rows `[b, t, d]` of activations (or their gradient) in device memory,
/// and where packed documents are kept apart, where each token's document
/// begins (per token, its index in its sequence), which the blocks' rotary
/// positions read, and the first key each token's attention sees (`first`
/// narrowed by a sliding window; `first` itself without one).
pub struct Rows {
    buf: CudaSlice<f32>,
    b: usize,
    t: usize,
    first: Option<Firsts>,
    bounds: Option<Firsts>,
}

/// Per token of `[b, t]`, where its document begins in its sequence, on the
/// device (checked by [`check_documents`]); shared by a forward's rows.
type Firsts = Arc<CudaSlice<u32>>;

impl Rows {
    /// Sequences and positions.
    pub fn dims(&self) -> (usize, usize) {
        (self.b, self.t)
    }
}

/// A parameter group's tensors in device memory, in the group's order
/// (embedding: wte and GPT-2's wpe; block: zmodel's flat order, see
/// [`BLOCK_PARAMS`]; head: the final norm's weight and GPT-2's bias, and an
/// untied output matrix).
pub struct Weights {
    /// Each tensor's f32 values; `None` where a tensor that only products
    /// read is held in the 16-bit working copy alone ([`Weights::with_half`]).
    p: Vec<Option<CudaSlice<f32>>>,
    half: Option<HalfWeights>,
}

/// A group's 16-bit working copy, flat in the group's layout: what 16-bit
/// products read of its weights.
struct HalfWeights {
    format: Half16,
    flat: CudaSlice<u16>,
    /// Where each tensor lies in `flat`.
    ranges: Vec<std::ops::Range<usize>>,
}

impl Weights {
    /// Tensors already on the device, in the group's order.
    pub fn from_parts(p: Vec<CudaSlice<f32>>) -> Weights {
        Weights {
            p: p.into_iter().map(Some).collect(),
            half: None,
        }
    }

    /// Tensors with the 16-bit working copy whose widened values they are
    /// (`flat`, in format `format`, tensor `i` at `ranges[i]`): products in
    /// that format read their weights from it instead of rounding the f32
    /// tensors, a pass over each weight at every product saved. A tensor
    /// given as `None` is held in the copy alone: only for tensors that only
    /// products read (the blocks' and an untied head's matrices: zmodel's
    /// `product_operand`, outside the embedding, whose rows the embedding
    /// gathers in f32), with products in `format`
    /// ([`GptGpu::use_half_products`]).
    pub fn with_half(
        p: Vec<Option<CudaSlice<f32>>>,
        format: Half16,
        flat: CudaSlice<u16>,
        ranges: Vec<std::ops::Range<usize>>,
    ) -> Result<Weights, CudaError> {
        let misfit = p.iter().zip(&ranges).any(|(t, r)| {
            r.start > r.end || r.end > flat.len() || t.as_ref().is_some_and(|t| t.len() != r.len())
        });
        if ranges.len() != p.len() || misfit {
            return Err(CudaError::Invalid(format!(
                "a 16-bit working copy of {} values with {} tensor ranges {ranges:?} for {} tensors of {:?} values",
                flat.len(),
                ranges.len(),
                p.len(),
                p.iter().map(|t| t.as_ref().map(|t| t.len())).collect::<Vec<_>>()
            )));
        }
        Ok(Weights {
            p,
            half: Some(HalfWeights {
                format,
                flat,
                ranges,
            }),
        })
    }

    /// The f32 tensors (`None` where held in 16 bits alone) and the 16-bit
    /// working copy, if any, to update in place (the optimizer writes the
    /// copy, then widens it into the f32 tensors).
    pub fn parts_and_half_mut(
        &mut self,
    ) -> (&mut [Option<CudaSlice<f32>>], Option<&mut CudaSlice<u16>>) {
        (&mut self.p, self.half.as_mut().map(|h| &mut h.flat))
    }

    /// Tensor `i` as products in `format` (`None`: f32) read it.
    fn weight(&self, i: usize, format: Option<Half16>) -> Weight<'_> {
        let half = self.half.as_ref();
        Weight {
            f32: self.p[i].as_ref(),
            half: half
                .filter(|h| Some(h.format) == format)
                .map(|h| (&h.flat, h.ranges[i].start)),
            len: self.tensor_len(i),
        }
    }

    /// Values of tensor `i`.
    fn tensor_len(&self, i: usize) -> usize {
        match (&self.p[i], &self.half) {
            (Some(t), _) => t.len(),
            (None, Some(h)) => h.ranges[i].len(),
            (None, None) => 0,
        }
    }

    /// Tensor `i`'s f32 values (an error where it is held in 16 bits alone).
    pub fn part(&self, i: usize) -> Result<&CudaSlice<f32>, CudaError> {
        self.p.get(i).and_then(|t| t.as_ref()).ok_or_else(|| {
            CudaError::Invalid(format!(
                "tensor {i} of {} has no f32 values (held in 16 bits alone)",
                self.p.len()
            ))
        })
    }

    /// The tensors' f32 values, to update in place (the optimizer).
    pub fn parts_mut(&mut self) -> &mut [Option<CudaSlice<f32>>] {
        &mut self.p
    }

    /// Tensors held.
    pub fn tensors(&self) -> usize {
        self.p.len()
    }

    /// Values held, over every tensor.
    pub fn len(&self) -> usize {
        (0..self.p.len()).map(|i| self.tensor_len(i)).sum()
    }

    /// Whether it holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.p.is_empty()
    }
}

/// What a block's forward keeps for its backward (`h`: the MLP's first
/// linear's output, `g`: its activation).
pub struct BlockActs {
    x: Rows,
    /// The inputs of the q, k and v projection, the MLP's first and its
    /// last linear: only their weight gradients read them, so none is
    /// kept where its weight is frozen (`train.freeze`), as PyTorch's
    /// autograd saves no input of a product whose weight needs no
    /// gradient. (The attention's output, the fourth linear's input, is
    /// kept whatever: its own backward reads it.)
    a1: Option<Kept>,
    stats1: Stats,
    /// Qwen3: q's and k's heads before their norms, and their 1/rms.
    qk: Option<[(CudaSlice<f32>, Stats); 2]>,
    attention: Attention,
    rows1: CudaSlice<f32>,
    a2: Option<Kept>,
    stats2: Stats,
    h: CudaSlice<f32>,
    g: Option<Kept>,
    /// The masks its outputs were dropped by (the attention keeps its own).
    hidden: Option<[Mask; 2]>,
}

/// An activation that only products read (a norm's output, GELU's or
/// SwiGLU's): f32, or with 16-bit products its bf16 or f16 bits, written by
/// the kernel that makes it and read as they are by the forward's product
/// and the backward's weight gradient (the same bits as rounding the f32
/// values before each product; no rounding pass, half the memory).
enum Kept {
    F32(CudaSlice<f32>),
    Half(CudaSlice<u16>),
}

impl Kept {
    /// The activation as a product's operand, rows of `ld`.
    fn operand(&self, ld: usize) -> Operand<'_> {
        match self {
            Kept::F32(v) => op(v, 0, ld),
            Kept::Half(v) => op16(v, 0, ld),
        }
    }

    /// The (y, y16, fmt16) arguments of the kernel that writes it: this
    /// buffer where its type goes, `null` for the other, and the 16-bit
    /// format (`fmt16`: the model's [`GptGpu::fmt16`]).
    fn push_out<'a>(&'a mut self, l: &mut LaunchArgs<'a>, null: &'a u64, fmt16: &'a i32) {
        match self {
            Kept::F32(v) => l.arg(v).arg(null),
            Kept::Half(v) => l.arg(null).arg(v),
        };
        l.arg(fmt16);
    }
}

/// A kept activation as a product's operand, rows of `ld`: none where it
/// was not kept.
fn kept(a: &Option<Kept>, ld: usize) -> Option<Operand<'_>> {
    a.as_ref().map(|a| a.operand(ld))
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
    /// Gradients (backward only).
    pub grads: Option<HeadGrads>,
}

/// The head's parameter gradients.
pub struct HeadGrads {
    /// The final norm's weight and (GPT-2) bias, in the group's order.
    pub norm: Vec<CudaSlice<f32>>,
    /// The output matrix `[vocab, d]`: the head's own, or the token
    /// embedding's when tied; none where it is frozen.
    pub out: Option<CudaSlice<f32>>,
}

/// What [`GptGpu::head`] computes beyond the loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadPass {
    /// The loss alone.
    Loss,
    /// The gradients of the loss too.
    Backward {
        /// The output matrix's as well: a frozen matrix skips its product,
        /// as large as the logits' own.
        output: bool,
    },
}

/// A norm's per-row statistics, kept for its backward.
enum Stats {
    /// Layer norm's mean and 1/σ.
    Layer(CudaSlice<f32>, CudaSlice<f32>),
    /// RMSNorm's 1/rms.
    Rms(CudaSlice<f32>),
}

/// A layer's backward: its input's gradient and its parameters' (weight,
/// and bias where it has one).
type Backward = (CudaSlice<f32>, CudaSlice<f32>, Option<CudaSlice<f32>>);

/// A linear layer's backward: [`Backward`] with no weight gradient where
/// the weight is frozen.
type LinearBackward = (
    CudaSlice<f32>,
    Option<CudaSlice<f32>>,
    Option<CudaSlice<f32>>,
);

/// What attention keeps for its backward: the output rows (`[b, t, d]`,
/// the output projection's input; also in 16 bits where the fused kernel
/// wrote them so for 16-bit products) and what its way of running needs.
struct Attention {
    out: CudaSlice<f32>,
    out16: Option<CudaSlice<u16>>,
    kept: AttentionKept,
    /// Where documents begin, when they are kept apart.
    first: Option<Firsts>,
    /// The mask its probabilities were dropped by.
    dropout: Option<Mask>,
}

impl Attention {
    /// The output as the output projection's operand (rows of `d`): its
    /// 16-bit values where the kernel wrote them, else the f32 ones (which
    /// a 16-bit product rounds first).
    fn operand(&self, d: usize) -> Operand<'_> {
        match &self.out16 {
            Some(o) => op16(o, 0, d),
            None => op(&self.out, 0, d),
        }
    }
}

enum AttentionKept {
    /// cuBLAS products around gpt.cu's softmax: q, k, v head-major
    /// (`[b·heads, t, hd]`) and the probabilities (`[b·heads, t, t]`).
    Unfused {
        q: CudaSlice<f32>,
        k: CudaSlice<f32>,
        v: CudaSlice<f32>,
        probs: CudaSlice<f32>,
        /// With 16-bit products: the probabilities' 16-bit values, written
        /// by the softmax for the products with v and (backward) with dO.
        probs16: Option<CudaSlice<u16>>,
    },
    /// attention.cu's fused kernels ([`GptGpu::use_fused_attention`]): the
    /// qkv rows themselves and each row's log-sum-exp (`[b·heads, t]`).
    Fused {
        qkv: CudaSlice<f32>,
        lse: CudaSlice<f32>,
    },
}

/// `count` products of one head each, at strides (a, b, c) apart.
fn per_head(count: usize, strides: [usize; 3]) -> Batch {
    Batch { count, strides }
}

/// A row-major operand: the buffer, its first element, its row stride.
#[derive(Clone, Copy)]
pub(crate) struct Operand<'a> {
    buf: Values<'a>,
    off: usize,
    ld: usize,
}

/// An operand's values: f32, or 16-bit values (in the model's format)
/// written by the kernel that made them (for 16-bit products, which would
/// otherwise round a copy).
#[derive(Clone, Copy)]
enum Values<'a> {
    F32(&'a CudaSlice<f32>),
    Half(&'a CudaSlice<u16>),
}

impl Values<'_> {
    fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::Half(v) => v.len(),
        }
    }
}

pub(crate) fn op<'a>(buf: &'a CudaSlice<f32>, off: usize, ld: usize) -> Operand<'a> {
    Operand {
        buf: Values::F32(buf),
        off,
        ld,
    }
}

fn op16(buf: &CudaSlice<u16>, off: usize, ld: usize) -> Operand<'_> {
    Operand {
        buf: Values::Half(buf),
        off,
        ld,
    }
}

/// Weight `w` (rows of `ld`) as a product's operand: its 16-bit working
/// copy where it has one for the product's format, else its f32 values.
fn weight_operand(w: Weight<'_>, ld: usize) -> Result<Operand<'_>, CudaError> {
    match w.half {
        Some((flat, start)) => Ok(op16(flat, start, ld)),
        None => Ok(op(w.values()?, 0, ld)),
    }
}

/// `count` products at strides (a, b, c) apart.
#[derive(Clone, Copy)]
pub(crate) struct Batch {
    pub(crate) count: usize,
    pub(crate) strides: [usize; 3],
}

const ONE: Batch = Batch {
    count: 1,
    strides: [0; 3],
};

/// Threads per block of the row kernels (multiple of 32).
const ROW_THREADS: u32 = 256;
/// Rows a column-sum thread adds before the chunks are added.
const ROWS_PER_CHUNK: usize = 64;

/// The model's forward and backward on one GPU.
pub struct GptGpu {
    gpu: Gpu,
    blas: CudaBlas,
    shape: GptShape,
    /// LLaMA's rotary table `[seq_len, hd/2]`: cosines and sines.
    rotary: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// The 16-bit format the products multiply, if any
    /// ([`GptGpu::use_half_products`]).
    half_products: Option<Half16>,
    /// Its number in the kernels (`half16.cuh`'s `FMT_*`; 0 for none), the
    /// argument of the kernels that write products' operands.
    fmt16: i32,
    /// Whether the f32 products run in TF32 ([`GptGpu::allow_tf32`]).
    tf32: bool,
    /// Whether attention runs attention.cu's fused kernels
    /// ([`GptGpu::use_fused_attention`]).
    fused_attention: bool,
    /// Training's label smoothing ([`GptGpu::use_label_smoothing`]).
    label_smoothing: f32,
    /// The column kernels' finished-block counts, one a stripe of
    /// [`ROW_THREADS`] columns, zero between launches (gpt.cu's
    /// `last_of_stripe`); grown to the widest use.
    stripes_done: Mutex<Option<CudaSlice<u32>>>,
}

impl GptGpu {
    /// Opens GPU `ordinal` (kernels compiled, a cuBLAS handle on its stream)
    /// for a model of `shape`.
    pub fn open(ordinal: usize, shape: GptShape) -> Result<GptGpu, CudaError> {
        if shape.n_heads == 0 || shape.head_dim == 0 {
            return Err(CudaError::Invalid(format!(
                "{} heads of {}: no attention",
                shape.n_heads, shape.head_dim
            )));
        }
        let kv = shape.kv_heads();
        if kv == 0
            || !shape.n_heads.is_multiple_of(kv)
            || (shape.llama() && !shape.head_dim().is_multiple_of(2))
        {
            return Err(CudaError::Invalid(format!(
                "{kv} key/value heads do not divide {} heads of even width",
                shape.n_heads
            )));
        }
        if !crate::cublas_present() {
            return Err(CudaError::Missing(crate::NO_CUBLAS.into()));
        }
        let gpu = Gpu::open(ordinal)?;
        let blas = CudaBlas::new(gpu.stream().clone()).map_err(|e| {
            CudaError::Missing(format!("cuBLAS did not start on GPU {ordinal}: {e}"))
        })?;
        let rotary = match &shape.family {
            Family::Gpt2 => None,
            Family::Llama {
                rope_theta,
                rope_scaling,
                ..
            } => {
                let (cos, sin) = rotary_table(
                    *rope_theta,
                    rope_scaling.as_ref(),
                    shape.seq_len,
                    shape.rotary_dim(),
                );
                Some((gpu.upload(&cos)?, gpu.upload(&sin)?))
            }
        };
        Ok(GptGpu {
            gpu,
            blas,
            shape,
            rotary,
            half_products: None,
            fmt16: 0,
            tf32: false,
            fused_attention: false,
            label_smoothing: 0.0,
            stripes_done: Mutex::new(None),
        })
    }

    /// Multiplies `format` from now on: every product's operands rounded
    /// to bf16 or f16 (to nearest even, as the CPU rounds them), the sums in
    /// f32 on the tensor cores (`cublasGemmStridedBatchedEx`,
    /// `CUBLAS_COMPUTE_32F`), as PyTorch's bf16 and f16 autocast multiply.
    /// bf16 is an error on a GPU older than compute capability 8.0, whose
    /// tensor cores have no bf16; f16 has tensor cores from 7.0 and runs
    /// (without them) on every GPU cuBLAS supports.
    pub fn use_half_products(&mut self, format: Half16) -> Result<(), CudaError> {
        if format == Half16::Bf16 && self.compute_capability() < 80 {
            return Err(CudaError::Invalid(format!(
                "bf16 products need compute capability 8.0 or newer; this GPU is {}",
                self.gpu.arch()
            )));
        }
        self.half_products = Some(format);
        self.fmt16 = format.code();
        Ok(())
    }

    /// Smooths training's labels by `epsilon` from now on (`train.label_smoothing`,
    /// transformers' `LabelSmoother`, as zmodel's head does): the loss of a
    /// [`GptGpu::head`] with `backward` is `(1 − ε)·(−log p(target)) + ε·mean over the
    /// vocabulary of −log p`, and its gradient that loss's. A head without
    /// `backward` (validation) stays the plain cross-entropy.
    pub fn use_label_smoothing(&mut self, epsilon: f64) -> Result<(), CudaError> {
        if !(0.0..1.0).contains(&epsilon) {
            return Err(CudaError::Invalid(format!(
                "label smoothing must be in [0, 1), got {epsilon}"
            )));
        }
        self.label_smoothing = epsilon as f32;
        Ok(())
    }

    /// The 16-bit format the products multiply, if any.
    pub fn half_products(&self) -> Option<Half16> {
        self.half_products
    }

    /// The GPU's compute capability as major·10 + minor (0 if unknown).
    fn compute_capability(&self) -> u32 {
        self.gpu
            .arch()
            .trim_start_matches("compute_")
            .parse()
            .unwrap_or(0)
    }

    /// Runs attention as attention.cu's fused kernels from now on, its
    /// products as the model's: after [`GptGpu::use_half_products`] in
    /// bf16 or f16, after [`GptGpu::allow_tf32`] in TF32 (compute capability 8.0
    /// and newer; head widths 16, 32 and 64, and 128 with 16-bit products): on the tensor cores with the
    /// probabilities never written, the masked triangle never multiplied.
    /// An error otherwise, naming what is missing.
    pub fn use_fused_attention(&mut self) -> Result<(), CudaError> {
        let hd = self.shape.head_dim();
        if self.half_products.is_none() && !self.tf32 {
            return Err(CudaError::Invalid(
                "fused attention multiplies on the tensor cores: it needs 16-bit products \
                 (train.dtype: bf16 or f16) or TF32 (train.allow_tf32: true)"
                    .into(),
            ));
        }
        if self.compute_capability() < 80 {
            return Err(CudaError::Invalid(format!(
                "fused attention needs compute capability 8.0 or newer; this GPU is {}",
                self.gpu.arch()
            )));
        }
        if hd == 128 && self.half_products.is_none() {
            return Err(CudaError::Invalid(
                "fused attention at head width 128 multiplies in 16 bits (train.dtype: bf16 \
                 or f16), not TF32"
                    .into(),
            ));
        }
        if ![16, 32, 64, 128].contains(&hd) {
            return Err(CudaError::Invalid(format!(
                "fused attention has kernels for head widths 16, 32, 64 and 128, not {hd}"
            )));
        }
        self.fused_attention = true;
        Ok(())
    }

    /// Whether attention runs the fused kernels.
    pub fn fused_attention(&self) -> bool {
        self.fused_attention
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
            sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => {
                self.tf32 = true;
                Ok(())
            }
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
        Ok(Weights::from_parts(p))
    }

    /// `w` as a block's parameters, checked against the block's shapes:
    /// each part's weight and its bias where it has one ([`GptShape::part_biases`]).
    fn block_params<'w>(&self, w: &'w Weights) -> Result<BlockWeights<'w>, CudaError> {
        let (d, f, q) = (self.shape.d_model, self.shape.ffn, self.shape.qkv_width());
        let (fi, aw, hd) = (
            self.shape.mlp_in_width(),
            self.shape.attn_width(),
            self.shape.head_dim(),
        );
        // Each part's weight and output width (its bias's length).
        let parts = [
            (d, d),
            (d * q, q),
            (aw * d, d),
            (d, d),
            (d * fi, fi),
            (f * d, d),
        ];
        let biases = self.shape.part_biases();
        // Each part's first tensor, and Qwen3's q and k norms after qkv's.
        let qk_norms = usize::from(self.shape.qk_norm()) * 2;
        let mut first = [0; PARTS];
        let mut want = Vec::new();
        for (k, (&(w, b), biased)) in parts.iter().zip(biases).enumerate() {
            first[k] = want.len();
            want.push(w);
            want.extend(biased.then_some(b));
            if k == 1 {
                want.extend(std::iter::repeat_n(hd, qk_norms));
            }
        }
        let have: Vec<usize> = (0..w.tensors()).map(|i| w.tensor_len(i)).collect();
        if have != want {
            return Err(CudaError::Invalid(format!(
                "a block of d_model {d} ({:?}) has tensors of {want:?} values, got {have:?}",
                self.shape.family
            )));
        }
        let qk_at = first[2] - qk_norms;
        Ok(BlockWeights {
            parts: std::array::from_fn(|k| {
                let weight = w.weight(first[k], self.half_products);
                let bias = biases[k]
                    .then(|| w.p.get(first[k] + 1).and_then(|b| b.as_ref()))
                    .flatten();
                (weight, bias)
            }),
            first,
            qk_norms: match qk_norms {
                0 => None,
                _ => Some([w.part(qk_at)?, w.part(qk_at + 1)?]),
            },
        })
    }

    /// The embedding of `tokens` `[b, t]`: `wte[token] + wpe[position]`
    /// (`w`: wte, wpe), or LLaMA's `wte[token]` (`w`: wte).
    pub fn embed(
        &self,
        tokens: &[u32],
        b: usize,
        t: usize,
        w: &Weights,
    ) -> Result<Rows, CudaError> {
        self.embed_documents(tokens, None, b, t, w)
    }

    /// [`GptGpu::embed`] with packed documents kept apart where `first`
    /// (per token, where its document begins in its sequence: zmodel's
    /// `Documents`) is given: positions count from each document's first
    /// token, and the rows carry `first` to the blocks' attention.
    pub fn embed_documents(
        &self,
        tokens: &[u32],
        first: Option<&[u32]>,
        b: usize,
        t: usize,
        w: &Weights,
    ) -> Result<Rows, CudaError> {
        let (wte, wpe) = match (w.tensors(), self.shape.llama()) {
            (2, false) => (w.part(0)?, Some(w.part(1)?)),
            (1, true) => (w.part(0)?, None),
            (tensors, _) => {
                return Err(CudaError::Invalid(format!(
                    "embedding: {tensors} tensors, not {}",
                    if self.shape.llama() {
                        "wte"
                    } else {
                        "wte and wpe"
                    }
                )))
            }
        };
        let GptShape {
            d_model: d,
            vocab,
            seq_len,
            ..
        } = self.shape;
        let wpe_len = wpe.map_or(seq_len * d, |p| p.len());
        if tokens.len() != b * t || t > seq_len || wte.len() != vocab * d || wpe_len != seq_len * d
        {
            return Err(CudaError::Invalid(format!(
                "embedding: {} tokens for [{b}, {t}], wte {} and wpe {wpe_len} values (vocab {vocab}, seq_len {seq_len}, d {d})",
                tokens.len(),
                wte.len(),
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
        let uploaded = match first {
            Some(f) => {
                check_documents(f, b, t)?;
                Some(Arc::new(self.gpu.upload(f)?))
            }
            None => None,
        };
        let bounds = self.attention_bounds(first, &uploaded, b, t)?;
        let first = uploaded;
        let tok = self.gpu.upload(tokens)?;
        let n = b * t;
        let mut x = self.alloc(n * d)?;
        let (n64, t32, d32, null) = (n as u64, t as i32, d as i32, 0u64);
        let mut l = self.gpu.stream().launch_builder(self.gpu.function("embed"));
        l.arg(&tok).arg(wte);
        match wpe {
            Some(p) => l.arg(p),
            None => l.arg(&null),
        };
        match &first {
            Some(f) => l.arg(&**f),
            None => l.arg(&null),
        };
        l.arg(&mut x).arg(&n64).arg(&t32).arg(&d32);
        // SAFETY: embed(tok[n], wte[vocab·d], wpe[seq_len·d] or null,
        // first[n] or null, x[n·d], n, t, d), tokens below vocab (checked),
        // positions below t ≤ seq_len (first[r] ≤ r % t: checked).
        self.launched("embed", unsafe { l.launch(grid_stride(n * d)) })?;
        Ok(Rows {
            buf: x,
            b,
            t,
            first,
            bounds,
        })
    }

    /// The first key each token of `b` sequences of `t` attends to: where
    /// its document begins (`first` on the host, `uploaded` on the device;
    /// 0 without documents), narrowed by the sliding window where it is
    /// shorter than the sequences, as zmodel's `Documents::windowed` does
    /// (uploaded); without a window, `uploaded` itself. The bounds rise
    /// down a sequence as documents' do, all that attention's kernels
    /// assume of them.
    fn attention_bounds(
        &self,
        first: Option<&[u32]>,
        uploaded: &Option<Firsts>,
        b: usize,
        t: usize,
    ) -> Result<Option<Firsts>, CudaError> {
        let Some(w) = self.shape.window(t) else {
            return Ok(uploaded.clone());
        };
        let bounds: Vec<u32> = (0..b * t)
            .map(|i| {
                let from = (i % t + 1).saturating_sub(w) as u32;
                first.map_or(from, |f| f[i].max(from))
            })
            .collect();
        Ok(Some(Arc::new(self.gpu.upload(&bounds)?)))
    }

    /// NEFTune's `noise` added to the embeddings' output `x`, then `mask`
    /// dropping it (`model.hidden_dropout`'s first site), in place, in one
    /// pass, as the CPU model's training forward does.
    pub fn noise_and_dropout(
        &self,
        x: &mut Rows,
        noise: Option<Noise>,
        mask: Option<Mask>,
    ) -> Result<(), CudaError> {
        if noise.is_none() && mask.is_none() {
            return Ok(());
        }
        self.dropout_noise(None, &mut x.buf, mask, noise)
    }

    /// `x` dropped by `mask` into a new buffer, or `None` without one.
    fn dropped(
        &self,
        x: &CudaSlice<f32>,
        mask: Option<Mask>,
    ) -> Result<Option<CudaSlice<f32>>, CudaError> {
        let Some(m) = mask else { return Ok(None) };
        let mut out = self.alloc(x.len())?;
        self.dropout_noise(Some(x), &mut out, Some(m), None)?;
        Ok(Some(out))
    }

    /// `x` dropped by `mask` in place.
    fn drop_in_place(&self, x: &mut CudaSlice<f32>, mask: Mask) -> Result<(), CudaError> {
        self.dropout_noise(None, x, Some(mask), None)
    }

    /// gpt.cu's `dropout_noise`: `y = drop(x + noise)`, element by element
    /// (`x` `None`: in place on `y`).
    fn dropout_noise(
        &self,
        x: Option<&CudaSlice<f32>>,
        y: &mut CudaSlice<f32>,
        mask: Option<Mask>,
        noise: Option<Noise>,
    ) -> Result<(), CudaError> {
        let n = y.len();
        if x.is_some_and(|x| x.len() != n) {
            return Err(CudaError::Invalid(format!(
                "dropout: {} values into {n}",
                x.map_or(0, |x| x.len())
            )));
        }
        let (threshold, scale, key) = mask_args(mask);
        let (mag, noise_key) = noise.map_or((0.0f32, 0u32), |z| (z.magnitude, z.key));
        let n64 = n as u64;
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("dropout_noise"));
        let null = 0u64;
        match x {
            Some(x) => l.arg(x),
            None => l.arg(&null),
        };
        l.arg(y)
            .arg(&n64)
            .arg(&threshold)
            .arg(&scale)
            .arg(&key)
            .arg(&mag)
            .arg(&noise_key);
        // SAFETY: dropout_noise(x[n] or null, y[n] (checked above), n,
        // threshold, scale, key, mag, noise_key).
        self.launched("dropout_noise", unsafe { l.launch(grid_stride(n)) })
    }

    /// The embedding's backward: the gradients of `wte` `[vocab, d]` and
    /// GPT-2's `wpe` `[seq_len, d]` from the tokens (and `first`, where
    /// documents are kept apart: [`GptGpu::embed_documents`]) and `dx`,
    /// each a sum in row (or sequence) order from zero: the CPU's
    /// scatter-add to the bit.
    pub fn embed_backward(
        &self,
        tokens: &[u32],
        first: Option<&[u32]>,
        dx: &Rows,
    ) -> Result<Vec<CudaSlice<f32>>, CudaError> {
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
        if let Some(f) = first {
            check_documents(f, b, t)?;
        }
        let mut dwte = self.gpu.zeros::<f32>(vocab * d)?;
        let mut dwpe = match self.shape.llama() {
            true => None,
            false => Some(self.gpu.zeros::<f32>(seq_len * d)?),
        };
        if tokens.is_empty() {
            return Ok([Some(dwte), dwpe].into_iter().flatten().collect());
        }
        self.sum_rows_by_key(&dx.buf, tokens, &mut dwte)?;
        if let (Some(dwpe), Some(first)) = (dwpe.as_mut(), first) {
            // Each position's rows are scattered over the sequences: summed
            // as the tokens' are (the CPU's order, row by row).
            let positions: Vec<u32> = (first.iter().enumerate())
                .map(|(i, &f)| (i % t) as u32 - f)
                .collect();
            self.sum_rows_by_key(&dx.buf, &positions, dwpe)?;
        } else if let Some(dwpe) = dwpe.as_mut() {
            let (b32, t32, d32) = (b as i32, t as i32, d as i32);
            let mut l = self
                .gpu
                .stream()
                .launch_builder(self.gpu.function("embed_backward_positions"));
            l.arg(&dx.buf).arg(dwpe).arg(&b32).arg(&t32).arg(&d32);
            // SAFETY: t ≤ seq_len (the embedding checked it): t·d values of
            // dwpe written, dx holds b·t·d.
            self.launched("embed_backward_positions", unsafe {
                l.launch(grid_stride(t * d))
            })?;
        }
        Ok([Some(dwte), dwpe].into_iter().flatten().collect())
    }

    /// `out[key]` = the sum of `dx`'s rows (of d) whose key (`keys`, one a
    /// row, each below out's rows: checked by the callers) is `key`, in row
    /// order from zero; rows of keys no row has are left as they are.
    fn sum_rows_by_key(
        &self,
        dx: &CudaSlice<f32>,
        keys: &[u32],
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let d = self.shape.d_model;
        let (present, start, rows) = rows_by_token(keys);
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
        l.arg(dx)
            .arg(&present_d)
            .arg(&start_d)
            .arg(&rows_d)
            .arg(out)
            .arg(&d32);
        let cfg = LaunchConfig {
            grid_dim: (present.len() as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one block per present key (each below out's rows: the
        // callers' checks), its rows below keys.len() = b·t, dx of b·t·d.
        self.launched("embed_backward_tokens", unsafe { l.launch(cfg) })
    }

    /// A block's forward: its output, and what its backward needs. With
    /// `dropouts.hidden`, the attention's and the MLP's outputs dropped by
    /// its masks before their residual adds (`model.hidden_dropout`), with
    /// `dropouts.attention` the attention's probabilities
    /// (`model.attention_dropout`); the backward drops their gradients by
    /// the same masks.
    ///
    /// `frozen` says, in zmodel's flat order, which of the block's tensors
    /// are frozen: no input of a frozen linear weight is kept (empty: every
    /// tensor trains).
    pub fn block_forward(
        &self,
        w: &Weights,
        x: Rows,
        dropouts: Dropouts,
        frozen: &[bool],
    ) -> Result<(Rows, BlockActs), CudaError> {
        let hidden = dropouts.hidden;
        let (d, q, fi) = (
            self.shape.d_model,
            self.shape.qkv_width(),
            self.shape.mlp_in_width(),
        );
        let (b, t) = x.dims();
        let (n, aw) = (b * t, self.shape.attn_width());
        let weights = self.block_params(w)?;
        if !frozen.is_empty() && frozen.len() != w.tensors() {
            return Err(CudaError::Invalid(format!(
                "block forward: {} frozen flags for {} tensors",
                frozen.len(),
                w.tensors()
            )));
        }
        let keep = weights.first.map(|i| frozen.get(i) != Some(&true));
        let [norm1, qkv_w, out_w, norm2, in_w, mlp_out] = weights.parts;
        let (a1, stats1) = self.norm(&x.buf, norm1, n)?;
        let mut qkv = self.linear(a1.operand(d), n, d, qkv_w, q, None)?;
        let qk = match weights.qk_norms {
            Some(w) => Some(self.qk_norm(&mut qkv, w, b, t)?),
            None => None,
        };
        let (first, bounds) = (x.first.clone(), x.bounds.clone());
        self.rotate(&mut qkv, b, t, first.as_deref(), 1.0)?;
        let attention = self.attention(qkv, b, t, bounds.clone(), dropouts.attention)?;
        let [drop_attention, drop_mlp] = hidden.map_or([None; 2], |m| m.map(Some));
        let residual = Some((&x.buf, drop_attention));
        let rows1 = self.linear(attention.operand(aw), n, aw, out_w, d, residual)?;
        let (a2, stats2) = self.norm(&rows1, norm2, n)?;
        let f = self.shape.ffn;
        // The MLP's first bias goes into GELU (and its backward), not into
        // a pass of its own: `h` is kept without it.
        let h = self.linear(a2.operand(d), n, d, (in_w.0, None), fi, None)?;
        let g = self.activation(&h, in_w.1, n)?;
        let y = self.linear(g.operand(f), n, f, mlp_out, d, Some((&rows1, drop_mlp)))?;
        let acts = BlockActs {
            x,
            a1: keep[1].then_some(a1),
            stats1,
            qk,
            attention,
            rows1,
            a2: keep[4].then_some(a2),
            stats2,
            h,
            g: keep[5].then_some(g),
            hidden,
        };
        Ok((
            Rows {
                buf: y,
                b,
                t,
                first,
                bounds,
            },
            acts,
        ))
    }

    /// A block's backward from `dy`: its parameters' gradients (zmodel's
    /// flat order) and its input's gradient. `frozen` says, in that order,
    /// which tensors are frozen (`train.freeze`): a frozen linear weight's
    /// gradient, a product of the forward's size, is not made (`None` in
    /// its place); every other tensor's is, to the same bits.
    pub fn block_backward(
        &self,
        w: &Weights,
        acts: &BlockActs,
        dy: &Rows,
        frozen: &[bool],
    ) -> Result<(Vec<MaybeGrad>, Rows), CudaError> {
        let (d, q, fi) = (
            self.shape.d_model,
            self.shape.qkv_width(),
            self.shape.mlp_in_width(),
        );
        let (b, t) = dy.dims();
        let (n, aw) = (b * t, self.shape.attn_width());
        let weights = self.block_params(w)?;
        if frozen.len() != w.tensors() {
            return Err(CudaError::Invalid(format!(
                "block backward: {} frozen flags for {} tensors",
                frozen.len(),
                w.tensors()
            )));
        }
        let trains = weights.first.map(|i| !frozen[i]);
        let [norm1, qkv_w, out_w, norm2, in_w, mlp_out] = weights.parts;
        let dy = &dy.buf;
        // Each part's (weight, bias) gradients, filled from the last part.
        let mut grads: [Option<PartGrads>; PARTS] = Default::default();
        // y = rows1 + drop(g·W_out (+ b_out)): the branch's gradient is dy
        // through the same mask.
        let [drop_attention, drop_mlp] = acts.hidden.map_or([None; 2], |m| m.map(Some));
        let dropped = self.dropped(dy, drop_mlp)?;
        let f = self.shape.ffn;
        let branch = dropped.as_ref().unwrap_or(dy);
        let (dg, dw, db) =
            self.linear_backward(kept(&acts.g, f), n, f, mlp_out, d, branch, trains[5])?;
        drop(dropped);
        grads[5] = Some((dw, db));
        let mut dh = self.alloc(n * fi)?;
        match self.shape.family {
            Family::Gpt2 => self.gelu_backward(&acts.h, in_w.1, &dg, &mut dh)?,
            Family::Llama { .. } => self.swiglu_backward(&acts.h, &dg, &mut dh, n)?,
        }
        drop(dg);
        let (da2, dw, db) =
            self.linear_backward(kept(&acts.a2, d), n, d, in_w, fi, &dh, trains[4])?;
        grads[4] = Some((dw, db));
        drop(dh);
        let (drows1, dw, db) =
            self.norm_backward(&acts.rows1, norm2, &acts.stats2, &da2, Some(dy), n)?;
        grads[3] = Some((Some(dw), db));
        // rows1 = x + drop(att·W_o (+ b_o))
        let att = acts.attention.operand(aw);
        let dropped = self.dropped(&drows1, drop_attention)?;
        let branch = dropped.as_ref().unwrap_or(&drows1);
        let (datt, dw, db) = self.linear_backward(Some(att), n, aw, out_w, d, branch, trains[2])?;
        drop(dropped);
        grads[2] = Some((dw, db));
        let mut dqkv = self.attention_backward(&acts.attention, &datt, b, t)?;
        drop(datt);
        // The rotation's backward is the rotation back.
        self.rotate(&mut dqkv, b, t, acts.x.first.as_deref(), -1.0)?;
        let qk_grads = match (&acts.qk, weights.qk_norms) {
            (Some(kept), Some(w)) => self.qk_norm_backward(&mut dqkv, w, kept, b, t)?,
            _ => Vec::new(),
        };
        let (da1, dw, db) =
            self.linear_backward(kept(&acts.a1, d), n, d, qkv_w, q, &dqkv, trains[1])?;
        grads[1] = Some((dw, db));
        let (dx, dw, db) =
            self.norm_backward(&acts.x.buf, norm1, &acts.stats1, &da1, Some(&drows1), n)?;
        grads[0] = Some((Some(dw), db));
        let mut grads: Vec<MaybeGrad> = grads
            .into_iter()
            .flat_map(|g| {
                let (w, b) = g.expect("every part's gradient set");
                std::iter::once(w).chain(b.map(Some))
            })
            .collect();
        // Qwen3's norms of q and k follow the q, k and v projection's.
        let after_qkv =
            2 + usize::from(self.shape.part_biases()[0]) + usize::from(self.shape.part_biases()[1]);
        grads.splice(after_qkv..after_qkv, qk_grads.into_iter().map(Some));
        Ok((
            grads,
            Rows {
                buf: dx,
                b,
                t,
                first: None,
                bounds: None,
            },
        ))
    }

    /// The head: the final norm (`head`'s weight and GPT-2's bias), logits
    /// against the output matrix `[vocab, d]` (`head`'s last tensor, or when
    /// tied the token embedding, `wte`'s first), the cross-entropy against
    /// `targets` summed over the rows whose target is not `IGNORED` (a loss
    /// mask's, `u32::MAX`) and divided by `divisor` (the row count for the
    /// mean; zmodel's `Batch::divisor`); with [`HeadPass::Backward`], the
    /// gradients of that loss times `scale`.
    #[allow(clippy::too_many_arguments)]
    pub fn head(
        &self,
        x: &Rows,
        head: &Weights,
        wte: Option<&Weights>,
        targets: &[u32],
        scale: f64,
        divisor: f64,
        pass: HeadPass,
    ) -> Result<HeadOut, CudaError> {
        let backward = matches!(pass, HeadPass::Backward { .. });
        let GptShape {
            d_model: d, vocab, ..
        } = self.shape;
        let (b, t) = x.dims();
        let n = b * t;
        let norm_len = 2 - usize::from(self.shape.llama());
        let h = self.half_products;
        let tied = wte.filter(|w| !w.p.is_empty()).map(|w| w.weight(0, h));
        let om = match (head.p.len().checked_sub(norm_len), tied) {
            (Some(1), _) => head.weight(norm_len, h),
            (Some(0), Some(wte)) => wte,
            _ => {
                return Err(CudaError::Invalid(format!(
                    "head: {} tensors and {} output matrix",
                    head.p.len(),
                    if wte.is_some() { "a tied" } else { "no" }
                )))
            }
        };
        let (nw, nb) = (
            head.weight(0, h),
            (norm_len == 2).then(|| head.part(1)).transpose()?,
        );
        if nw.len != d
            || nb.is_some_and(|b| b.len() != d)
            || om.len != vocab * d
            || targets.len() != n
        {
            return Err(CudaError::Invalid(format!(
                "head: norm {} values, output matrix {}, {} targets (d {d}, vocab {vocab}, {n} rows)",
                nw.len,
                om.len,
                targets.len()
            )));
        }
        if let Some((i, tok)) = targets
            .iter()
            .enumerate()
            .find(|(_, &k)| k as usize >= vocab && k != IGNORED)
        {
            return Err(CudaError::Invalid(format!(
                "cross-entropy: target {tok} at position {i} is outside the vocabulary of {vocab}"
            )));
        }
        let tg = self.gpu.upload(targets)?;
        let (normed, stats) = self.norm(&x.buf, (nw, nb), n)?;
        // logits [n, vocab] = normed · outᵀ
        let mut logits = self.alloc(n * vocab)?;
        self.gemm(
            false,
            true,
            (n, vocab, d),
            normed.operand(d),
            weight_operand(om, d)?,
            (&mut logits, 0, vocab),
            ONE,
        )?;
        let mut losses = self.alloc(n)?;
        // With 16-bit products the kernel writes dlogits in 16 bits, which
        // is all the two products read: no f32 gradient, no rounding pass.
        let mut dlogits16 = match (backward, self.half_products) {
            (true, Some(_)) => Some(self.alloc16(n * vocab)?),
            _ => None,
        };
        if divisor.is_nan() || divisor <= 0.0 {
            return Err(CudaError::Invalid(format!(
                "cross-entropy: divided by {divisor}"
            )));
        }
        let (v32, coef, grad) = (vocab as i32, (scale / divisor) as f32, backward as i32);
        let smoothing = match backward {
            true => self.label_smoothing,
            false => 0.0,
        };
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("cross_entropy"));
        let null = 0u64;
        l.arg(&mut logits).arg(&tg).arg(&mut losses);
        match dlogits16.as_mut() {
            Some(g) => l.arg(g),
            None => l.arg(&null),
        };
        l.arg(&self.fmt16)
            .arg(&v32)
            .arg(&coef)
            .arg(&smoothing)
            .arg(&grad);
        // SAFETY: cross_entropy(logits[n·vocab], targets[n] < vocab or
        // IGNORED (checked),
        // loss[n], g16[n·vocab] or null, fmt16, vocab, coef, smoothing,
        // grad), one block per row.
        self.launched("cross_entropy", unsafe { l.launch(rows_config(n, vocab)) })?;
        let loss = self
            .gpu
            .download(&losses)?
            .iter()
            .map(|&v| f64::from(v))
            .sum::<f64>()
            / divisor;
        if !backward {
            return Ok(HeadOut {
                loss,
                dx: None,
                grads: None,
            });
        }
        // dnormed [n, d] = dlogits · out; dout [vocab, d] = dlogitsᵀ · normed
        // (In 16 bits, the f32 logits are read no more: freed before the
        // backward's buffers are allocated.)
        let f32_grad;
        let dlogits = match &dlogits16 {
            Some(g) => {
                drop(logits);
                op16(g, 0, vocab)
            }
            None => {
                f32_grad = logits;
                op(&f32_grad, 0, vocab)
            }
        };
        let mut dnormed = self.alloc(n * d)?;
        self.gemm(
            false,
            false,
            (n, d, vocab),
            dlogits,
            weight_operand(om, d)?,
            (&mut dnormed, 0, d),
            ONE,
        )?;
        let dout = match pass {
            HeadPass::Backward { output: true } => {
                let mut dout = self.alloc(vocab * d)?;
                self.gemm(
                    true,
                    false,
                    (vocab, d, n),
                    dlogits,
                    normed.operand(d),
                    (&mut dout, 0, d),
                    ONE,
                )?;
                Some(dout)
            }
            _ => None,
        };
        let (dx, dw, db) = self.norm_backward(&x.buf, (nw, nb), &stats, &dnormed, None, n)?;
        Ok(HeadOut {
            loss,
            dx: Some(Rows {
                buf: dx,
                b,
                t,
                first: None,
                bounds: None,
            }),
            grads: Some(HeadGrads {
                norm: std::iter::once(dw).chain(db).collect(),
                out: dout,
            }),
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
            first: None,
            bounds: self.attention_bounds(None, &None, b, t)?,
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
        unsafe { self.gpu.stream().alloc::<f32>(len) }.map_err(|source| {
            let what = format!("allocating {len} floats on the GPU");
            self.gpu.alloc_failed(what, 4 * len, source)
        })
    }

    fn alloc16(&self, len: usize) -> Result<CudaSlice<u16>, CudaError> {
        // SAFETY: every caller has all `len` values written before any is
        // read.
        unsafe { self.gpu.stream().alloc::<u16>(len) }.map_err(|source| {
            let what = format!("allocating {len} 16-bit values on the GPU");
            self.gpu.alloc_failed(what, 2 * len, source)
        })
    }

    fn launched<T>(
        &self,
        what: &str,
        r: Result<T, cudarc::driver::DriverError>,
    ) -> Result<(), CudaError> {
        self.gpu.launched(what, r)
    }

    /// `y = x·W (+ b) (+ residual)`: x `[n, k]`, `(W, b)`: W `[k, width]`
    /// and its bias if it has one.
    fn linear(
        &self,
        x: Operand<'_>,
        n: usize,
        k: usize,
        (w, bias): Part<'_>,
        width: usize,
        residual: Option<(&CudaSlice<f32>, Option<Mask>)>,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let mut y = self.alloc(n * width)?;
        self.gemm(
            false,
            false,
            (n, width, k),
            x,
            weight_operand(w, width)?,
            (&mut y, 0, width),
            ONE,
        )?;
        if bias.is_none() && residual.is_none() {
            return Ok(y);
        }
        let (n64, w32, null) = (n as u64, width as i32, 0u64);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("bias_residual"));
        l.arg(&mut y);
        match bias {
            Some(b) => l.arg(b),
            None => l.arg(&null),
        };
        let (threshold, scale, key) = mask_args(residual.and_then(|(_, m)| m));
        match residual {
            Some((r, _)) => l.arg(r),
            None => l.arg(&null),
        };
        l.arg(&n64).arg(&w32).arg(&threshold).arg(&scale).arg(&key);
        // SAFETY: bias_residual(y[n·width], b[width] or null, res[n·width]
        // or null, n, width, the mask's threshold, scale and key).
        self.launched("bias_residual", unsafe { l.launch(grid_stride(n * width)) })?;
        Ok(y)
    }

    /// The backward of [`GptGpu::linear`]: (dx `[n, k]`, dW where
    /// `weight_trains`, and db where the layer has a bias). `x`, the
    /// forward's input, only dW reads: none where the forward kept none.
    #[allow(clippy::too_many_arguments)]
    fn linear_backward(
        &self,
        x: Option<Operand<'_>>,
        n: usize,
        k: usize,
        (w, bias): Part<'_>,
        width: usize,
        dy: &CudaSlice<f32>,
        weight_trains: bool,
    ) -> Result<LinearBackward, CudaError> {
        // With 16-bit products and a bias, the pass that sums the bias
        // gradient's columns also rounds dy for both products (one read of
        // dy instead of two, one launch instead of two; the same bits).
        let mut dy16 = None;
        let db = match bias {
            Some(_) => {
                if self.half_products.is_some() {
                    dy16 = Some(self.alloc16(n * width)?);
                }
                Some(self.column_sums(dy, n, width, dy16.as_mut())?)
            }
            None => None,
        };
        let dy_op = match dy16 {
            Some(ref rounded) => op16(rounded, 0, width),
            None => self.operand_twice(dy, n * width, width, &mut dy16)?,
        };
        let dw = match weight_trains {
            true => {
                let x = x.ok_or_else(|| {
                    CudaError::Invalid(format!(
                        "linear backward: the forward kept no input of a weight that trains ([{n}, {k}] · [{k}, {width}])"
                    ))
                })?;
                let mut dw = self.alloc(k * width)?;
                self.gemm(
                    true,
                    false,
                    (k, width, n),
                    x,
                    dy_op,
                    (&mut dw, 0, width),
                    ONE,
                )?;
                Some(dw)
            }
            false => None,
        };
        let mut dx = self.alloc(n * k)?;
        self.gemm(
            false,
            true,
            (n, k, width),
            dy_op,
            weight_operand(w, width)?,
            (&mut dx, 0, k),
            ONE,
        )?;
        Ok((dx, dw, db))
    }

    /// `Σ_r a[r, ·]` over `rows` rows of `width`: per chunk of rows, then
    /// over the chunks, each in order, in one launch; with `a16`, every
    /// value of `a` also rounded into it to the products' format
    /// ([`GptGpu::fmt16`]) as it is read.
    fn column_sums(
        &self,
        a: &CudaSlice<f32>,
        rows: usize,
        width: usize,
        a16: Option<&mut CudaSlice<u16>>,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let chunks = rows.div_ceil(ROWS_PER_CHUNK).max(1);
        let mut part = self.alloc(chunks * width)?;
        let mut out = self.alloc(width)?;
        let mut done = self.stripes_done(width)?;
        let done = done.as_mut().expect("stripes_done fills it");
        let (r32, w32, per32) = (rows as i32, width as i32, ROWS_PER_CHUNK as i32);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("column_sums"));
        let null = 0u64;
        l.arg(a);
        match a16 {
            Some(a16) => {
                if a16.len() < rows * width {
                    return Err(CudaError::Invalid(format!(
                        "column_sums: {} 16-bit values for {rows} rows of {width}",
                        a16.len()
                    )));
                }
                l.arg(a16)
            }
            None => l.arg(&null),
        };
        l.arg(&self.fmt16)
            .arg(&mut part)
            .arg(&mut out)
            .arg(done)
            .arg(&r32)
            .arg(&w32)
            .arg(&per32);
        let cfg = columns_config(width, chunks);
        // SAFETY: column_sums(a[rows·width], a16[rows·width] or null, fmt16,
        // part[chunks·width], out[width], done[stripes], rows, width,
        // rows_per): chunk y writes part[y·width + c] for c < width (and
        // a16 at its rows' values), a stripe's last block out[c] of its
        // columns; done holds a zero for each of the grid's stripes.
        self.launched("column_sums", unsafe { l.launch(cfg) })?;
        Ok(out)
    }

    /// The column kernels' counts for `width` columns, zeros (each launch
    /// leaves them so), held while a launch is queued.
    fn stripes_done(
        &self,
        width: usize,
    ) -> Result<MutexGuard<'_, Option<CudaSlice<u32>>>, CudaError> {
        let stripes = width.div_ceil(ROW_THREADS as usize).max(1);
        let mut done = self.stripes_done.lock().unwrap_or_else(|e| e.into_inner());
        if done.as_ref().is_none_or(|d| d.len() < stripes) {
            *done = Some(self.gpu.zeros::<u32>(stripes)?);
        }
        Ok(done)
    }

    /// The block's norm of `n` rows, `(w, b)`: layer norm (GPT-2, with its
    /// bias) or RMSNorm (LLaMA); the output and what its backward needs.
    fn norm(
        &self,
        x: &CudaSlice<f32>,
        (w, b): Part<'_>,
        n: usize,
    ) -> Result<(Kept, Stats), CudaError> {
        let w = w.values()?;
        match b {
            Some(b) => self.layer_norm(x, w, b, n),
            None => {
                let d = self.shape.d_model;
                self.rms_norm(x, w, n, d, self.kept_output(n * d)?)
            }
        }
    }

    /// [`GptGpu::norm`]'s backward: (dx [+ dres], dw, db where there is a
    /// bias).
    fn norm_backward(
        &self,
        x: &CudaSlice<f32>,
        (w, _): Part<'_>,
        stats: &Stats,
        dy: &CudaSlice<f32>,
        dres: Option<&CudaSlice<f32>>,
        n: usize,
    ) -> Result<Backward, CudaError> {
        let w = w.values()?;
        match stats {
            Stats::Layer(mean, rstd) => self.layer_norm_backward(x, w, (mean, rstd), dy, dres, n),
            Stats::Rms(rstd) => self.rms_norm_backward(x, w, rstd, dy, dres, n, self.shape.d_model),
        }
    }

    /// RMSNorm of `n` rows of `d` into `y`: the output and 1/rms per row.
    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        n: usize,
        d: usize,
        mut y: Kept,
    ) -> Result<(Kept, Stats), CudaError> {
        let mut rstd = self.alloc(n)?;
        let (d32, eps, null) = (d as i32, self.shape.eps, 0u64);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("rms_norm"));
        l.arg(x).arg(w);
        y.push_out(&mut l, &null, &self.fmt16);
        l.arg(&mut rstd).arg(&d32).arg(&eps);
        // SAFETY: rms_norm(x[n·d], w[d], y[n·d] or null, y16[n·d] or null,
        // rstd[n], d, eps), one block per row.
        self.launched("rms_norm", unsafe { l.launch(rows_config(n, d)) })?;
        Ok((y, Stats::Rms(rstd)))
    }

    /// RMSNorm's backward over `n` rows of `d`: (dx [+ dres], dw).
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_backward(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        dy: &CudaSlice<f32>,
        dres: Option<&CudaSlice<f32>>,
        n: usize,
        d: usize,
    ) -> Result<Backward, CudaError> {
        let mut dx = self.alloc(n * d)?;
        let (d32, n32, null) = (d as i32, n as i32, 0u64);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("rms_norm_backward"));
        l.arg(x).arg(w).arg(rstd).arg(dy);
        match dres {
            Some(r) => l.arg(r),
            None => l.arg(&null),
        };
        l.arg(&mut dx).arg(&d32);
        // SAFETY: rms_norm_backward(x, w, rstd, dy, dres or null, dx, d)
        // over n rows of d, one block per row.
        self.launched("rms_norm_backward", unsafe { l.launch(rows_config(n, d)) })?;
        let chunks = n.div_ceil(ROWS_PER_CHUNK).max(1);
        let mut dw_part = self.alloc(chunks * d)?;
        let per32 = ROWS_PER_CHUNK as i32;
        let mut dw = self.alloc(d)?;
        let mut done = self.stripes_done(d)?;
        let done = done.as_mut().expect("stripes_done fills it");
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("rms_norm_param_partials"));
        l.arg(x)
            .arg(rstd)
            .arg(dy)
            .arg(&mut dw_part)
            .arg(&mut dw)
            .arg(done)
            .arg(&n32)
            .arg(&d32)
            .arg(&per32);
        let cfg = columns_config(d, chunks);
        // SAFETY: chunk y writes dw_part[y·d + c], c < d, from rows of its
        // chunk below n, a stripe's last block dw[c] of its columns; done
        // holds a zero for each of the grid's stripes.
        self.launched("rms_norm_param_partials", unsafe { l.launch(cfg) })?;
        Ok((dx, dw, None))
    }

    /// Qwen3's norms of each head's q and k in `qkv` (b·t rows of the q, k
    /// and v width), in place: q's heads and k's gathered as rows of the
    /// head width (`[b·heads, t, hd]`, `[b·kv, t, hd]`), RMSNorm of each
    /// row with `wq` or `wk` (gpt.cu's `rms_norm` at width hd), the result
    /// written back. Returns the gathered heads and their 1/rms, what the
    /// backward reads.
    fn qk_norm(
        &self,
        qkv: &mut CudaSlice<f32>,
        [wq, wk]: [&CudaSlice<f32>; 2],
        b: usize,
        t: usize,
    ) -> Result<[(CudaSlice<f32>, Stats); 2], CudaError> {
        let (ld, hd) = (self.shape.qkv_width(), self.shape.head_dim());
        let (h, kv) = (self.shape.n_heads, self.shape.kv_heads());
        let mut norm = |w, col0: usize, heads: usize| {
            let x = self.to_heads(qkv, ld, col0, b, t, heads, 1)?;
            let rows = b * heads * t;
            let y = Kept::F32(self.alloc(rows * hd)?);
            let (y, stats) = self.rms_norm(&x, w, rows, hd, y)?;
            let Kept::F32(y) = y else {
                unreachable!("written in f32");
            };
            self.heads_into_rows(&y, qkv, ld, col0, b, t, heads, 1)?;
            Ok::<_, CudaError>((x, stats))
        };
        Ok([norm(wq, 0, h)?, norm(wk, h * hd, kv)?])
    }

    /// [`GptGpu::qk_norm`]'s backward, in place on `dqkv` (after the
    /// rotation's backward): each head's gradient through its norm. Returns
    /// the weights' gradients, q's then k's.
    fn qk_norm_backward(
        &self,
        dqkv: &mut CudaSlice<f32>,
        [wq, wk]: [&CudaSlice<f32>; 2],
        kept: &[(CudaSlice<f32>, Stats); 2],
        b: usize,
        t: usize,
    ) -> Result<Vec<CudaSlice<f32>>, CudaError> {
        let (ld, hd) = (self.shape.qkv_width(), self.shape.head_dim());
        let (h, kv) = (self.shape.n_heads, self.shape.kv_heads());
        let mut backward = |w, (x, stats): &(CudaSlice<f32>, Stats), col0: usize, heads: usize| {
            let Stats::Rms(rstd) = stats else {
                unreachable!("RMSNorm's statistics");
            };
            let dy = self.to_heads(dqkv, ld, col0, b, t, heads, 1)?;
            let rows = b * heads * t;
            let (dx, dw, _) = self.rms_norm_backward(x, w, rstd, &dy, None, rows, hd)?;
            self.heads_into_rows(&dx, dqkv, ld, col0, b, t, heads, 1)?;
            Ok::<_, CudaError>(dw)
        };
        let dwq = backward(wq, &kept[0], 0, h)?;
        let dwk = backward(wk, &kept[1], h * hd, kv)?;
        Ok(vec![dwq, dwk])
    }

    /// Layer norm of `n` rows: the output and (mean, rstd) per row.
    fn layer_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(Kept, Stats), CudaError> {
        let d = self.shape.d_model;
        let (mut y, mut mean, mut rstd) =
            (self.kept_output(n * d)?, self.alloc(n)?, self.alloc(n)?);
        let (d32, eps, null) = (d as i32, self.shape.eps, 0u64);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("layer_norm"));
        l.arg(x).arg(w).arg(b);
        y.push_out(&mut l, &null, &self.fmt16);
        l.arg(&mut mean).arg(&mut rstd).arg(&d32).arg(&eps);
        // SAFETY: layer_norm(x[n·d], w[d], b[d], y[n·d] or null, y16[n·d]
        // or null, mean[n], rstd[n], d, eps), one block per row.
        self.launched("layer_norm", unsafe { l.launch(rows_config(n, d)) })?;
        Ok((y, Stats::Layer(mean, rstd)))
    }

    /// Layer norm's backward from its (mean, rstd): (dx [+ dres], dw, db).
    fn layer_norm_backward(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        stats: (&CudaSlice<f32>, &CudaSlice<f32>),
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
        l.arg(x).arg(w).arg(stats.0).arg(stats.1).arg(dy);
        match dres {
            Some(r) => l.arg(r),
            None => l.arg(&null),
        };
        l.arg(&mut dx).arg(&d32);
        // SAFETY: layer_norm_backward(x, w, mean, rstd, dy, dres or null, dx,
        // d) over n rows of d, one block per row.
        self.launched("layer_norm_backward", unsafe {
            l.launch(rows_config(n, d))
        })?;
        let chunks = n.div_ceil(ROWS_PER_CHUNK).max(1);
        let (mut dw_part, mut db_part) = (self.alloc(chunks * d)?, self.alloc(chunks * d)?);
        let per32 = ROWS_PER_CHUNK as i32;
        let (mut dw, mut db) = (self.alloc(d)?, self.alloc(d)?);
        let mut done = self.stripes_done(d)?;
        let done = done.as_mut().expect("stripes_done fills it");
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("layer_norm_param_partials"));
        l.arg(x)
            .arg(stats.0)
            .arg(stats.1)
            .arg(dy)
            .arg(&mut dw_part)
            .arg(&mut db_part)
            .arg(&mut dw)
            .arg(&mut db)
            .arg(done)
            .arg(&n32)
            .arg(&d32)
            .arg(&per32);
        let cfg = columns_config(d, chunks);
        // SAFETY: chunk y writes dw_part/db_part[y·d + c], c < d, from rows
        // of its chunk below n, a stripe's last block dw[c] and db[c] of its
        // columns; done holds a zero for each of the grid's stripes.
        self.launched("layer_norm_param_partials", unsafe { l.launch(cfg) })?;
        Ok((dx, dw, Some(db)))
    }

    /// The MLP's activation of `h + bias` (`n` rows of the up projection,
    /// the bias over its columns; LLaMA's have none): GPT-2's GELU or
    /// LLaMA's SwiGLU (on `[gate | up]`), an output only the next product
    /// reads.
    fn activation(
        &self,
        h: &CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        n: usize,
    ) -> Result<Kept, CudaError> {
        let (f, width) = (self.shape.ffn, self.shape.mlp_in_width());
        if h.len() != n * width || bias.is_some_and(|b| b.len() != width) {
            return Err(CudaError::Invalid(format!(
                "activation: {} values for {n} rows of width {width}, bias {:?}",
                h.len(),
                bias.map(|b| b.len())
            )));
        }
        if bias.is_some() && self.shape.llama() {
            return Err(CudaError::Invalid(
                "activation: SwiGLU takes no bias".into(),
            ));
        }
        let kernel = match self.shape.family {
            Family::Gpt2 => "gelu",
            Family::Llama { .. } => "swiglu",
        };
        let mut g = self.kept_output(n * f)?;
        let (values, rows, f32_, null) = ((n * f) as u64, n as u64, f as i32, 0u64);
        let mut l = self.gpu.stream().launch_builder(self.gpu.function(kernel));
        l.arg(h);
        if let Family::Gpt2 = self.shape.family {
            match bias {
                Some(b) => l.arg(b),
                None => l.arg(&null),
            };
            l.arg(&f32_);
        }
        g.push_out(&mut l, &null, &self.fmt16);
        match self.shape.family {
            Family::Gpt2 => l.arg(&values),
            Family::Llama { .. } => l.arg(&rows).arg(&f32_),
        };
        // SAFETY: gelu(h[n·f], b[f] or null, f, g[n·f] or null, g16[n·f] or
        // null, n·f) /
        // swiglu(h[n·2f], y[n·f] or null, y16[n·f] or null, n, f): h's
        // length checked above, the output allocated for n·f.
        self.launched(kernel, unsafe { l.launch(grid_stride(n * f)) })?;
        Ok(g)
    }

    /// GELU's backward: `dh = gelu'(h + bias)·dg`, every buffer of
    /// `h.len()`, the bias over the MLP's width.
    fn gelu_backward(
        &self,
        h: &CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        dg: &CudaSlice<f32>,
        dh: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (n, width) = (h.len(), self.shape.ffn);
        if dg.len() != n || dh.len() != n || bias.is_some_and(|b| b.len() != width) {
            return Err(CudaError::Invalid(format!(
                "gelu_backward: {n}, {} and {} values, bias {:?} of width {width}",
                dg.len(),
                dh.len(),
                bias.map(|b| b.len())
            )));
        }
        let (n64, w32, null) = (n as u64, width as i32, 0u64);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("gelu_backward"));
        l.arg(h);
        match bias {
            Some(b) => l.arg(b),
            None => l.arg(&null),
        };
        l.arg(&w32).arg(dg).arg(&mut *dh).arg(&n64);
        // SAFETY: gelu_backward(h, b[width] or null, width, dg, dh, n),
        // every buffer but b of n values (checked above).
        self.launched("gelu_backward", unsafe { l.launch(grid_stride(n)) })
    }

    /// SwiGLU's backward: `[gate | up]` gradients `dh` from `h` and `dy`,
    /// over `n` rows.
    fn swiglu_backward(
        &self,
        h: &CudaSlice<f32>,
        dy: &CudaSlice<f32>,
        dh: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        let f = self.shape.ffn;
        if h.len() != n * 2 * f || dy.len() != n * f || dh.len() != n * 2 * f {
            return Err(CudaError::Invalid(format!(
                "swiglu_backward: {}, {} and {} values for {n} rows of width {f}",
                h.len(),
                dy.len(),
                dh.len()
            )));
        }
        let (n64, f32_) = (n as u64, f as i32);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("swiglu_backward"));
        l.arg(h).arg(dy).arg(&mut *dh).arg(&n64).arg(&f32_);
        // SAFETY: swiglu_backward(h[n·2f], dy[n·f], dh[n·2f], n, f) (lengths
        // checked above).
        self.launched("swiglu_backward", unsafe { l.launch(grid_stride(n * f)) })
    }

    /// LLaMA's rotary positions on q and k of `qkv` `[b, t, qkv_width]` in
    /// place (`sign` −1: the rotation back, which is its backward); GPT-2
    /// has none.
    fn rotate(
        &self,
        qkv: &mut CudaSlice<f32>,
        b: usize,
        t: usize,
        first: Option<&CudaSlice<u32>>,
        sign: f32,
    ) -> Result<(), CudaError> {
        let Some((cos, sin)) = &self.rotary else {
            return Ok(());
        };
        let (ld, hd) = (self.shape.qkv_width(), self.shape.head_dim());
        let half = self.shape.rotary_dim() / 2;
        let heads = self.shape.n_heads + self.shape.kv_heads();
        if t > self.shape.seq_len || qkv.len() != b * t * ld || 2 * half > hd {
            return Err(CudaError::Invalid(format!(
                "rope: {} values for [{b}, {t}] rows of {ld}, {half} frequencies for heads of {hd}",
                qkv.len()
            )));
        }
        let rows = (b * t) as u64;
        let ints = [ld, heads, hd, half, t].map(|x| x as i32);
        let null = 0u64;
        let mut l = self.gpu.stream().launch_builder(self.gpu.function("rope"));
        l.arg(&mut *qkv).arg(cos).arg(sin);
        match first {
            Some(f) => l.arg(f),
            None => l.arg(&null),
        };
        l.arg(&rows);
        l.arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(&ints[4])
            .arg(&sign);
        // SAFETY: rope(x[rows·ld], cos/sin[seq_len·half], first[rows] or
        // null, rows, ld, heads, hd, half, t, sign): heads·hd ≤ ld, 2·half
        // ≤ hd, positions below t ≤ seq_len (checked; first checked by the
        // embedding).
        self.launched("rope", unsafe {
            l.launch(grid_stride(b * t * heads * half))
        })
    }

    /// Causal attention over `qkv` `[b, t, qkv_width]`: (q, k, v as
    /// `[b·heads, t, hd]`, probabilities `[b·heads, t, t]`, output `[b, t,
    /// d]` with head h in columns h·hd..). In the head-major layout every
    /// head of every sequence is one entry of a single strided batched
    /// product; with grouped-query attention each query head gets its
    /// key/value head's values.
    fn attention(
        &self,
        qkv: CudaSlice<f32>,
        b: usize,
        t: usize,
        first: Option<Firsts>,
        dropout: Option<Mask>,
    ) -> Result<Attention, CudaError> {
        if self.fused_attention {
            return self.fused_attention_forward(qkv, b, t, first, dropout);
        }
        let qkv = &qkv;
        let (aw, heads, hd) = (
            self.shape.attn_width(),
            self.shape.n_heads,
            self.shape.head_dim(),
        );
        let (ld, kv_cols, group) = (
            self.shape.qkv_width(),
            self.shape.kv_heads() * hd,
            self.group(),
        );
        let q = self.to_heads(qkv, ld, 0, b, t, heads, 1)?;
        let k = self.to_heads(qkv, ld, aw, b, t, heads, group)?;
        let v = self.to_heads(qkv, ld, aw + kv_cols, b, t, heads, group)?;
        let bh = b * heads;
        let mut probs = self.alloc(bh * t * t)?;
        let mut probs16 = match self.half_products {
            Some(_) => Some(self.alloc16(bh * t * t)?),
            None => None,
        };
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
        // With dropout, the 16-bit probabilities the products read are
        // dropped as the kernel writes them; the f32 ones stay undropped
        // (the softmax's backward reads them), so an f32 product reads a
        // dropped copy.
        self.softmax(
            &mut probs,
            None,
            probs16.as_mut(),
            first.as_deref(),
            (bh * t, t),
            dropout,
        )?;
        let dropped = match probs16 {
            Some(_) => None,
            None => self.dropped(&probs, dropout)?,
        };
        // O = drop(P) · V
        let mut o = self.alloc(bh * t * hd)?;
        let p = match (&probs16, &dropped) {
            (Some(p16), _) => op16(p16, 0, t),
            (None, Some(pd)) => op(pd, 0, t),
            (None, None) => op(&probs, 0, t),
        };
        self.gemm(
            false,
            false,
            (t, hd, t),
            p,
            op(&v, 0, hd),
            (&mut o, 0, hd),
            per_head(bh, [t * t, t * hd, t * hd]),
        )?;
        drop(dropped);
        let mut att = self.alloc(b * t * aw)?;
        self.heads_into_rows(&o, &mut att, aw, 0, b, t, heads, 1)?;
        Ok(Attention {
            out: att,
            out16: None,
            kept: AttentionKept::Unfused {
                q,
                k,
                v,
                probs,
                probs16,
            },
            first,
            dropout,
        })
    }

    /// attention.cu's forward: one block of 4 warps per 64 query rows of
    /// each head of each sequence; with `dropout`, its `_dropout` kernel.
    fn fused_attention_forward(
        &self,
        qkv: CudaSlice<f32>,
        b: usize,
        t: usize,
        first: Option<Firsts>,
        dropout: Option<Mask>,
    ) -> Result<Attention, CudaError> {
        let (d, heads) = (self.shape.attn_width(), self.shape.n_heads);
        let ld = self.shape.qkv_width();
        if qkv.len() < b * t * ld {
            return Err(CudaError::Invalid(format!(
                "fused attention: [{b}, {t}] rows of {ld} in a buffer of {}",
                qkv.len()
            )));
        }
        if dropout.is_some() && t > zconfig::spec::FUSED_DROPOUT_MAX_T {
            return Err(CudaError::Invalid(format!(
                "fused attention with dropout: sequences of up to {}, not {t}",
                zconfig::spec::FUSED_DROPOUT_MAX_T
            )));
        }
        let mut out = self.alloc(b * t * d)?;
        // With 16-bit products the kernel also writes the output in their
        // format, for the output projection's two products (forward and
        // weight gradient), which rounded it in a pass each before.
        let mut out16 = match self.half_products {
            Some(_) => Some(self.alloc16(b * t * d)?),
            None => None,
        };
        let mut lse = self.alloc(b * heads * t)?;
        let kernel = self.fused_kernel("flash_forward", dropout);
        let args = self.fused_args(t, dropout);
        let null = 0u64;
        let mut l = self.gpu.stream().launch_builder(self.gpu.function(kernel));
        l.arg(&qkv);
        match &first {
            Some(f) => l.arg(&**f),
            None => l.arg(&null),
        };
        l.arg(&mut out);
        match out16.as_mut() {
            Some(o) => l.arg(o),
            None => l.arg(&null),
        };
        l.arg(&self.fmt16).arg(&mut lse);
        args.push(&mut l);
        // SAFETY: flash_forward[_dropout]_<kind>_<hd>(qkv, first, out,
        // out16, fmt16, lse, t, heads, kv, ld, scale, the mask's threshold,
        // scale and key): b·t rows of ld in qkv (checked
        // above), first b·t values or null (checked by the embedding),
        // b·t·d values in out (and out16, or null) and b·heads·t in lse
        // (allocated above); qkv is a whole allocation and ld a multiple of
        // the head width (16, 32 or 64), so the kernel's 16-byte loads are
        // aligned; the grid covers ⌈t/64⌉ tiles of b·heads heads, blocks of
        // 128 threads as the kernel assumes.
        self.launched(kernel, unsafe { l.launch(fused_config(t, b * heads)) })?;
        Ok(Attention {
            out,
            out16,
            kept: AttentionKept::Fused { qkv, lse },
            first,
            dropout,
        })
    }

    /// attention.cu's backward: each row's Σ out ⊙ dout, then the keys' and
    /// values' gradients (a block per 64 keys of each key/value head) and
    /// the queries' (a block per 64 query rows of each head), each written
    /// into its own columns of dqkv.
    fn fused_attention_backward(
        &self,
        a: &Attention,
        (qkv, lse): (&CudaSlice<f32>, &CudaSlice<f32>),
        datt: &CudaSlice<f32>,
        b: usize,
        t: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let out = &a.out;
        let (d, heads) = (self.shape.attn_width(), self.shape.n_heads);
        let ld = self.shape.qkv_width();
        if datt.len() < b * t * d || out.len() < b * t * d {
            return Err(CudaError::Invalid(format!(
                "fused attention backward: [{b}, {t}] rows of {d} in buffers of {} and {}",
                datt.len(),
                out.len()
            )));
        }
        let mut delta = self.alloc(b * heads * t)?;
        let (rows64, t32, heads32, hd32) =
            ((b * t) as u64, t as i32, heads as i32, (d / heads) as i32);
        let mut l = self
            .gpu
            .stream()
            .launch_builder(self.gpu.function("attention_delta"));
        l.arg(out)
            .arg(datt)
            .arg(&mut delta)
            .arg(&rows64)
            .arg(&t32)
            .arg(&heads32)
            .arg(&hd32);
        let warps = ROW_THREADS as usize / 32;
        let cfg = LaunchConfig {
            grid_dim: ((b * t * heads).div_ceil(warps) as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: attention_delta(out, dout, delta, rows, t, heads, hd): one
        // warp per (row, head) of b·t rows of d = heads·hd (checked above),
        // b·heads·t values in delta (allocated above).
        self.launched("attention_delta", unsafe { l.launch(cfg) })?;
        let mut dqkv = self.alloc(b * t * ld)?;
        let args = self.fused_args(t, a.dropout);
        for (name, grid_heads) in [
            ("flash_backward_kv", self.shape.kv_heads()),
            ("flash_backward_q", heads),
        ] {
            let kernel = self.fused_kernel(name, a.dropout);
            let null = 0u64;
            let mut l = self.gpu.stream().launch_builder(self.gpu.function(kernel));
            l.arg(qkv);
            match &a.first {
                Some(f) => l.arg(&**f),
                None => l.arg(&null),
            };
            l.arg(datt).arg(lse).arg(&delta).arg(&mut dqkv);
            args.push(&mut l);
            // SAFETY: flash_backward_{kv,q}[_dropout]_<kind>_<hd>(qkv,
            // first, dout, lse, delta, dqkv, t, heads, kv, ld, scale, the
            // mask's threshold, scale and key): qkv and dqkv b·t rows of
            // ld, first b·t values or null (checked by the embedding),
            // dout b·t rows of d, lse and delta b·heads·t values (the
            // forward's and above); qkv and dout whole allocations with
            // rows of multiples of the head width (aligned 16-byte loads);
            // the kv kernel's grid covers the
            // key/value heads, the q kernel's the query heads, blocks of
            // 128 threads.
            self.launched(kernel, unsafe { l.launch(fused_config(t, b * grid_heads)) })?;
        }
        Ok(dqkv)
    }

    /// The fused kernel `name` for this model's products and head width,
    /// its `_dropout` kernel where the probabilities are dropped.
    fn fused_kernel(&self, name: &str, dropout: Option<Mask>) -> &'static str {
        let kind = match self.half_products {
            Some(h) => h.name(),
            None => "tf32",
        };
        let dropped = if dropout.is_some() { "_dropout" } else { "" };
        let want = format!("{name}{dropped}_{kind}_{}", self.shape.head_dim());
        crate::compile::kernel("attention.cu")
            .and_then(|k| k.functions.iter().find(|f| **f == want))
            .expect("use_fused_attention admits widths with kernels")
    }

    /// The fused kernels' trailing arguments: t, heads, kv heads, the qkv
    /// rows' width, the scores' scale and the dropout's mask (threshold,
    /// scale, key; none: 0, 1, 0).
    fn fused_args(&self, t: usize, dropout: Option<Mask>) -> FusedArgs {
        let hd = self.shape.head_dim();
        FusedArgs {
            mask: mask_args(dropout),
            ints: [
                t,
                self.shape.n_heads,
                self.shape.kv_heads(),
                self.shape.qkv_width(),
            ]
            .map(|x| x as i32),
            scale: 1.0 / (hd as f32).sqrt(),
        }
    }

    /// Attention's backward: dqkv `[b, t, 3d]` from the output's gradient.
    fn attention_backward(
        &self,
        a: &Attention,
        datt: &CudaSlice<f32>,
        b: usize,
        t: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let (q, k, v, probs, probs16) = match &a.kept {
            AttentionKept::Fused { qkv, lse } => {
                return self.fused_attention_backward(a, (qkv, lse), datt, b, t)
            }
            AttentionKept::Unfused {
                q,
                k,
                v,
                probs,
                probs16,
            } => (q, k, v, probs, probs16),
        };
        let (aw, heads, hd) = (
            self.shape.attn_width(),
            self.shape.n_heads,
            self.shape.head_dim(),
        );
        let bh = b * heads;
        let dout = self.to_heads(datt, aw, 0, b, t, heads, 1)?;
        let (th, tt) = (t * hd, t * t);
        let mut dout16 = None;
        let dout_op = self.operand_twice(&dout, bh * th, hd, &mut dout16)?;
        // dP = dO · Vᵀ (dropped by the forward's mask, in place), then dS
        // in place.
        let mut ds = self.alloc(bh * tt)?;
        self.gemm(
            false,
            true,
            (t, t, hd),
            dout_op,
            op(v, 0, hd),
            (&mut ds, 0, t),
            per_head(bh, [th, th, tt]),
        )?;
        if let Some(m) = a.dropout {
            self.drop_in_place(&mut ds, m)?;
        }
        // dV = drop(P)ᵀ · dO: the 16-bit probabilities are dropped already.
        let mut dv = self.alloc(bh * th)?;
        let dropped = match probs16 {
            Some(_) => None,
            None => self.dropped(probs, a.dropout)?,
        };
        let p = match (probs16, &dropped) {
            (Some(p16), _) => op16(p16, 0, t),
            (None, Some(pd)) => op(pd, 0, t),
            (None, None) => op(probs, 0, t),
        };
        self.gemm(
            true,
            false,
            (t, hd, t),
            p,
            dout_op,
            (&mut dv, 0, hd),
            per_head(bh, [tt, th, th]),
        )?;
        drop((dout16, dout, dropped));
        // With 16-bit products, dS goes straight to 16 bits (its only
        // readers).
        let mut ds16 = match self.half_products {
            Some(_) => Some(self.alloc16(bh * tt)?),
            None => None,
        };
        let first = a.first.as_deref();
        self.softmax(
            &mut ds,
            Some(probs),
            ds16.as_mut(),
            first,
            (bh * t, t),
            None,
        )?;
        let ds_op = || match &ds16 {
            Some(d16) => op16(d16, 0, t),
            None => op(&ds, 0, t),
        };
        // dQ = dS · K; dK = dSᵀ · Q
        let mut dq = self.alloc(bh * th)?;
        self.gemm(
            false,
            false,
            (t, hd, t),
            ds_op(),
            op(k, 0, hd),
            (&mut dq, 0, hd),
            per_head(bh, [tt, th, th]),
        )?;
        let mut dk = self.alloc(bh * th)?;
        self.gemm(
            true,
            false,
            (t, hd, t),
            ds_op(),
            op(q, 0, hd),
            (&mut dk, 0, hd),
            per_head(bh, [tt, th, th]),
        )?;
        let (ld, kv_cols, group) = (
            self.shape.qkv_width(),
            self.shape.kv_heads() * hd,
            self.group(),
        );
        let mut dqkv = self.alloc(b * t * ld)?;
        self.heads_into_rows(&dq, &mut dqkv, ld, 0, b, t, heads, 1)?;
        self.heads_into_rows(&dk, &mut dqkv, ld, aw, b, t, heads, group)?;
        self.heads_into_rows(&dv, &mut dqkv, ld, aw + kv_cols, b, t, heads, group)?;
        Ok(dqkv)
    }

    /// Query heads per key/value head (1 but in grouped-query attention).
    fn group(&self) -> usize {
        self.shape.n_heads / self.shape.kv_heads()
    }

    /// The `h / group` heads in columns `col0..` of `rows` (rows of `ld`)
    /// as `[b·h, t, hd]`, each of a group's `h` heads getting its
    /// key/value head.
    #[allow(clippy::too_many_arguments)]
    fn to_heads(
        &self,
        rows: &CudaSlice<f32>,
        ld: usize,
        col0: usize,
        b: usize,
        t: usize,
        h: usize,
        group: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let mut heads = self.alloc(b * t * h * self.shape.head_dim())?;
        let kernel = if group == 1 {
            "rows_to_heads"
        } else {
            "kv_rows_to_heads"
        };
        self.relayout(kernel, rows, &mut heads, ld, col0, b, t, h, group)?;
        Ok(heads)
    }

    /// `[b·h, t, hd]` into the `h / group` heads in columns `col0..` of
    /// `rows` (rows of `ld`), a group's heads summed in order.
    #[allow(clippy::too_many_arguments)]
    fn heads_into_rows(
        &self,
        heads: &CudaSlice<f32>,
        rows: &mut CudaSlice<f32>,
        ld: usize,
        col0: usize,
        b: usize,
        t: usize,
        h: usize,
        group: usize,
    ) -> Result<(), CudaError> {
        let kernel = if group == 1 {
            "heads_to_rows"
        } else {
            "heads_to_kv_rows"
        };
        self.relayout(kernel, heads, rows, ld, col0, b, t, h, group)
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
        heads: usize,
        group: usize,
    ) -> Result<(), CudaError> {
        let hd = self.shape.head_dim();
        let d = heads * hd;
        let to_heads = kernel.ends_with("to_heads");
        let (rows_len, heads_len) = match to_heads {
            true => (src.len(), dst.len()),
            false => (dst.len(), src.len()),
        };
        // Columns of `rows` read or written: heads / group heads of hd.
        let cols = d / group;
        if col0 + cols > ld || rows_len < b * t * ld || heads_len < b * t * d {
            return Err(CudaError::Invalid(format!(
                "{kernel}: [{b}, {t}] rows of {ld} from column {col0}, buffers {} and {}",
                src.len(),
                dst.len()
            )));
        }
        let ints = [ld, col0, b, t, heads, hd, group].map(|x| x as i32);
        let mut l = self.gpu.stream().launch_builder(self.gpu.function(kernel));
        match to_heads {
            true => l.arg(src).arg(&ints[0]).arg(&ints[1]).arg(&mut *dst),
            false => l.arg(src).arg(&mut *dst).arg(&ints[0]).arg(&ints[1]),
        };
        l.arg(&ints[2]).arg(&ints[3]).arg(&ints[4]).arg(&ints[5]);
        if group > 1 {
            l.arg(&ints[6]);
        }
        let n = if to_heads || group == 1 {
            b * t * d
        } else {
            b * t * cols
        };
        // SAFETY: rows_to_heads(rows, ld, col0, heads, b, t, h, hd) /
        // heads_to_rows(heads, rows, ld, col0, b, t, h, hd), and the
        // kv_ forms with `group` last: b·t rows of ld with col0 + d/group ≤
        // ld, and b·t·d head values (checked above).
        self.launched(kernel, unsafe { l.launch(grid_stride(n)) })
    }

    /// The causal softmax of `rows` rows of `t` in place, or with `probs`
    /// its backward (dP in, dS out); with `out16`, the result's 16-bit
    /// values written there too (the backward's instead of into `s`).
    fn softmax(
        &self,
        s: &mut CudaSlice<f32>,
        probs: Option<&CudaSlice<f32>>,
        out16: Option<&mut CudaSlice<u16>>,
        first: Option<&CudaSlice<u32>>,
        (rows, t): (usize, usize),
        dropout: Option<Mask>,
    ) -> Result<(), CudaError> {
        if s.len() < rows * t
            || probs.is_some_and(|p| p.len() < rows * t)
            || out16.as_ref().is_some_and(|o| o.len() < rows * t)
        {
            return Err(CudaError::Invalid(format!(
                "softmax: {rows} rows of {t} in buffers of {}",
                s.len()
            )));
        }
        let scale = 1.0 / (self.shape.head_dim() as f32).sqrt();
        let (rows64, t32, heads32) = (rows as u64, t as i32, self.shape.n_heads as i32);
        let kernel = match probs {
            None => "causal_softmax",
            Some(_) => "causal_softmax_backward",
        };
        let mut l = self.gpu.stream().launch_builder(self.gpu.function(kernel));
        if let Some(p) = probs {
            l.arg(p);
        }
        l.arg(&mut *s);
        let null = 0u64;
        match out16 {
            Some(o) => l.arg(o),
            None => l.arg(&null),
        };
        l.arg(&self.fmt16);
        match first {
            Some(f) => l.arg(f),
            None => l.arg(&null),
        };
        l.arg(&rows64).arg(&t32).arg(&heads32).arg(&scale);
        let (threshold, dscale, key) = mask_args(dropout);
        if probs.is_none() {
            l.arg(&threshold).arg(&dscale).arg(&key);
        }
        let warps = ROW_THREADS as usize / 32;
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(warps) as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: causal_softmax(s, s16, fmt16, first, rows, t, heads, scale,
        // threshold, dscale, key)
        // / causal_softmax_backward(p, dp, ds16, fmt16, first, rows, t,
        // heads, scale): one warp per row of t, rows·t values in s (and
        // probs, and out16 or null; checked above); rows = b·heads·t, so
        // first (or null) holds b·t (the embedding checked it).
        self.launched(kernel, unsafe { l.launch(cfg) })
    }

    /// A buffer for `len` values of an output that only products read
    /// ([`Kept`]): 16 bits with 16-bit products, else f32.
    fn kept_output(&self, len: usize) -> Result<Kept, CudaError> {
        match self.half_products {
            Some(_) => Ok(Kept::Half(self.alloc16(len)?)),
            None => Ok(Kept::F32(self.alloc(len)?)),
        }
    }

    /// The first `len` values of `buf` (rows of `ld`) as the operand of more
    /// than one product: with 16-bit products rounded once, into `copy`,
    /// not at each product (the same bits: the same rounding).
    fn operand_twice<'s>(
        &self,
        buf: &'s CudaSlice<f32>,
        len: usize,
        ld: usize,
        copy: &'s mut Option<CudaSlice<u16>>,
    ) -> Result<Operand<'s>, CudaError> {
        match self.half_products {
            Some(h) => Ok(op16(copy.insert(self.rounded16(h, buf, 0..len)?), 0, ld)),
            None => Ok(op(buf, 0, ld)),
        }
    }

    /// `buf[range]` rounded to `h`, in a fresh buffer.
    fn rounded16(
        &self,
        h: Half16,
        buf: &CudaSlice<f32>,
        range: std::ops::Range<usize>,
    ) -> Result<CudaSlice<u16>, CudaError> {
        // round16 writes every value before any is read.
        let mut out = self.alloc16(range.len())?;
        self.gpu
            .round16(h, &buf.slice(range), &mut out.slice_mut(..))?;
        Ok(out)
    }

    /// A 16-bit product's operand (format `h`): its 16-bit buffer and the
    /// element its first row starts at. Values in 16 bits already are read
    /// in place; f32 ones (up to `end`) are rounded into `copy` from their
    /// offset.
    fn half_source<'s>(
        &self,
        h: Half16,
        o: &Operand<'s>,
        end: usize,
        copy: &'s mut Option<CudaSlice<u16>>,
    ) -> Result<(&'s CudaSlice<u16>, usize), CudaError> {
        match o.buf {
            Values::Half(v) => Ok((v, o.off)),
            Values::F32(v) => Ok((copy.insert(self.rounded16(h, v, o.off..end)?), 0)),
        }
    }

    /// [`GptGpu::gemm`]'s product on 16-bit operands of format `h` (`a16`,
    /// `b16`: buffers and the elements the operands start at), f32 sums and
    /// result.
    fn gemm_half(
        &self,
        h: Half16,
        g: GemmConfig<f32>,
        batch: Batch,
        a16: (&CudaSlice<u16>, usize),
        b16: (&CudaSlice<u16>, usize),
        c: &mut CudaViewMut<f32>,
    ) -> Result<(), CudaError> {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType};
        use std::ffi::c_void;
        let stream = self.gpu.stream();
        let (ap, _a) = a16.0.device_ptr(stream);
        let (bp, _b) = b16.0.device_ptr(stream);
        let (ap, bp) = (ap + 2 * a16.1 as u64, bp + 2 * b16.1 as u64);
        let (cp, _c) = c.device_ptr_mut(stream);
        let dtype = match h {
            Half16::Bf16 => cudaDataType::CUDA_R_16BF,
            Half16::F16 => cudaDataType::CUDA_R_16F,
        };
        // SAFETY: cuBLAS's A is our B and its B our A (column-major, see
        // `gemm`), each operand's extent checked by `gemm` against its
        // buffer and held from the start given (a rounded copy from the
        // operand's offset, or the 16-bit buffer at it); C's view starts at its offset;
        // alpha and beta are f32 for CUBLAS_COMPUTE_32F, and live until the
        // call returns (cuBLAS reads host scalars before it returns).
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                g.transa,
                g.transb,
                g.m,
                g.n,
                g.k,
                (&g.alpha) as *const f32 as *const c_void,
                bp as *const c_void,
                dtype,
                g.lda,
                batch.strides[1] as i64,
                ap as *const c_void,
                dtype,
                g.ldb,
                batch.strides[0] as i64,
                (&g.beta) as *const f32 as *const c_void,
                cp as *mut c_void,
                cudaDataType::CUDA_R_32F,
                g.ldc,
                batch.strides[2] as i64,
                batch.count as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| {
            let (name, n, m, k) = (h.name(), g.n, g.m, g.k);
            CudaError::Invalid(format!("cuBLAS {name} gemm ({n}×{m}×{k}): {e}"))
        })
    }

    /// Row-major `C = op(A)·op(B)` of (m, n, k), `count` times at the
    /// batch's strides, on cuBLAS (column-major, so it computes `Cᵀ =
    /// op(B)ᵀ·op(A)ᵀ`). Every operand's extent is checked against its buffer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm(
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
        if let Some(h) = self.half_products {
            let (mut a_copy, mut b_copy) = (None, None);
            let a16 = self.half_source(h, &a, checks[0].1, &mut a_copy)?;
            let b16 = self.half_source(h, &b, checks[1].1, &mut b_copy)?;
            self.gemm_half(h, gemm, batch, a16, b16, &mut c.slice_mut(c_off..))?;
            return self
                .gpu
                .mark(|| gemm_name(h.name(), (ta, tb), (m, n, k), batch.count));
        }
        let (Values::F32(abuf), Values::F32(bbuf)) = (a.buf, b.buf) else {
            return Err(CudaError::Invalid(
                "gemm: 16-bit operands without 16-bit products".into(),
            ));
        };
        let (av, bv) = (abuf.slice(a.off..), bbuf.slice(b.off..));
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
        r.map_err(|e| CudaError::Invalid(format!("cuBLAS gemm ({m}×{n}×{k}): {e}")))?;
        let kind = if self.tf32 { "tf32" } else { "f32" };
        self.gpu
            .mark(|| gemm_name(kind, (ta, tb), (m, n, k), batch.count))
    }
}

/// A product's name in the GPU profile: its kind, its shape (m×n×k of the
/// row-major `C = op(A)·op(B)`), the operands transposed, and how many at
/// once.
fn gemm_name(
    kind: &str,
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    count: usize,
) -> String {
    let mark = |t: bool, s: &'static str| if t { s } else { "" };
    let batch = match count {
        1 => String::new(),
        _ => format!(" ×{count}"),
    };
    format!(
        "gemm {kind} {m}×{n}×{k}{}{}{batch}",
        mark(ta, " Aᵀ"),
        mark(tb, " Bᵀ")
    )
}

/// Checks that `first` says, for each token of `b` sequences of `t`, where
/// its document begins as the kernels read it: its index in its sequence
/// at most the token's own, and never falling along a sequence (documents
/// are contiguous: zmodel's `Documents`), which the fused attention's walks
/// rely on.
pub fn check_documents(first: &[u32], b: usize, t: usize) -> Result<(), CudaError> {
    if first.len() != b * t {
        return Err(CudaError::Invalid(format!(
            "documents: {} firsts for [{b}, {t}] tokens",
            first.len()
        )));
    }
    for (s, seq) in first.chunks_exact(t.max(1)).enumerate() {
        let mut least = 0;
        for (i, &f) in seq.iter().enumerate() {
            if f as usize > i || f < least {
                return Err(CudaError::Invalid(format!(
                    "documents: token {i} of sequence {s} has its document begin at {f}, after itself or before the previous token's ({least})"
                )));
            }
            least = f;
        }
    }
    Ok(())
}

/// The rows of `tokens` grouped by token for the embedding's backward:
/// (the tokens present, ascending; where each one's rows start in the list,
/// and the list's end last; the rows, each token's in row order).
pub fn rows_by_token(tokens: &[u32]) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    // A stable sort keeps each token's rows in row order.
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
    (present, start, rows)
}

/// LLaMA's rotary table `[seq_len, hd/2]` (cosines, sines): position `p`,
/// pair `i` turns by `p · theta^(−2i/hd)` (scaled as `scaling` says for
/// sequences of `seq_len`: `zconfig::arch::Rotary`, whose scale, YaRN's
/// and LongRoPE's attention factor, multiplies both), computed in f64 and
/// rounded, as the CPU model's table (zmodel's `rope`).
pub fn rotary_table(
    theta: f64,
    scaling: Option<&zconfig::spec::RopeScaling>,
    seq_len: usize,
    hd: usize,
) -> (Vec<f32>, Vec<f32>) {
    let rotary = zconfig::arch::Rotary::new(theta, scaling, hd, seq_len);
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for p in 0..seq_len {
        for &f in &rotary.inv_freq {
            let angle = p as f64 * f;
            cos.push((rotary.scale * angle.cos()) as f32);
            sin.push((rotary.scale * angle.sin()) as f32);
        }
    }
    (cos, sin)
}

/// A thread per column of `width` (blocks of [`ROW_THREADS`]) for each of
/// `chunks` chunks of rows (the grid's y).
fn columns_config(width: usize, chunks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            width.div_ceil(ROW_THREADS as usize) as u32,
            chunks as u32,
            1,
        ),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The fused attention kernels' trailing arguments ([`GptGpu::fused_args`]).
struct FusedArgs {
    ints: [i32; 4],
    scale: f32,
    mask: (u32, f32, u32),
}

impl FusedArgs {
    fn push<'a>(&'a self, l: &mut LaunchArgs<'a>) {
        for x in &self.ints {
            l.arg(x);
        }
        l.arg(&self.scale)
            .arg(&self.mask.0)
            .arg(&self.mask.1)
            .arg(&self.mask.2);
    }
}

/// The fused attention kernels' grid: ⌈t / 64⌉ tiles of rows for each of
/// `heads` (sequence, head) pairs, blocks of 4 warps.
fn fused_config(t: usize, heads: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (t.div_ceil(64) as u32, heads as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row of `width`: [`ROW_THREADS`] threads, or as many warps
/// as cover the row where it is narrower (a test model's 32 columns: one
/// warp, not eight, seven of them idle at every barrier of the block's
/// sums, which the CPU emulation of the kernels pays for in full). Every
/// row kernel strides its row by blockDim.x, and block_sum and block_max
/// take any whole number of warps; a published model's rows (768 columns
/// and more) get the 256 threads they always had.
fn rows_config(rows: usize, width: usize) -> LaunchConfig {
    let threads = width.next_multiple_of(32).clamp(32, ROW_THREADS as usize) as u32;
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_gets_the_warps_that_cover_it_up_to_row_threads() {
        for (width, threads) in [(1, 32), (32, 32), (33, 64), (100, 128), (256, 256)] {
            assert_eq!(rows_config(7, width).block_dim, (threads, 1, 1), "{width}");
        }
        // Published models' rows: the 256 threads they always had.
        for width in [768, 4096, 50257] {
            assert_eq!(rows_config(7, width).block_dim, (ROW_THREADS, 1, 1));
        }
        assert_eq!(rows_config(7, 32).grid_dim, (7, 1, 1));
    }
}
