//! A block's linear layers, whole or in column tiles (ZeRO-Infinity's
//! memory-centric tiling), with one forward and one backward for both.
//!
//! A tile is a run of output columns: its weight `[in, w]` and bias `[w]`
//! (LLaMA's linears have none).
//! The forward computes each tile's columns `x·W_t + b_t` one tile at a time, so
//! only one tile's parameters need to be in memory; the backward takes each
//! tile's `dW_t = xᵀ·dy_t` and `db_t` (column sums) and adds `dy_t·W_tᵀ` into the
//! input gradient. Output columns are independent, so forward outputs and
//! parameter gradients of a tile are bit for bit those columns of the whole
//! layer. The input gradient sums over output columns, tile after tile into
//! `dx`: zgemm's f32 products at α = 1 continue the chain of fused
//! multiply-adds that `C` holds, and the bf16 ones a product cut in depth
//! at multiples of 32 (`zgemm::gemm_bf16`), so a tiled layer's `dx` is the whole layer's bit for bit
//! with one product a tile. (The f32 products used to be cut into chunks of
//! 256 output columns, the tiles' granularity, so that the tiled and whole
//! layers shared their blocks: each chunk another pass over `dx`, and depth
//! 256 under the kernels' 384. One product took the 1-worker f32 step about 1.02x.)
//!
//! The GEMMs are zgemm's: the forward's bias is its starting value (no second
//! pass over `y`), tiles write their columns of `y` in place, and `dy_t` and
//! `Wᵀ` are strided views (no copies). The backward runs a tile's two
//! products, `dW_t` and `dx`'s, side by side on the pool, so that a thread
//! waiting inside one works on the other (the f32 step on 1 worker × 2
//! threads 1.04x, median of eight alternated rounds; the second thread's
//! idle samples 6.3% → 4.6% of the step's). Under bf16 products the
//! backward rounds `dy` once, with its column sums (the bias gradient) in the
//! same pass, and both products read that bf16 copy; the norms and GELU before
//! the layers write their outputs in bf16 for the same reason
//! ([`crate::ops::layer_norm_bf16`]). Autograd cannot follow zgemm, so
//! tensors that it tracks (the reference that tests compare the explicit
//! backward with) take candle's matmul instead.
//!
//! Where the parameters come from is a [`BlockSource`]: whole `BlockParams`
//! (tests, the autograd reference), or the engine, which gathers each tile
//! just before its use and hands each tile's gradient to the reduction as
//! soon as it exists.

use std::ops::Range;

use candle_core::{CpuStorage, DType, Device, Layout, Storage, Tensor};

use zgemm::{BitsMut, MatMut, MatRef, Start};

use crate::ops::{bf16_with_column_sums, RoundedGrad};
use crate::params::{BlockParams, WeightBias};
use crate::simd::{assume_init, uninit_floats};

/// A block's linear layers, in forward order (slots; each family's names
/// and shapes are in `zconfig::arch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockLinear {
    /// The q, k, v projection.
    Qkv,
    /// Attention's output projection `[d, d]`.
    AttnOut,
    /// The MLP's expansion (LLaMA: gate and up side by side).
    MlpIn,
    /// The MLP's projection back to `d`.
    MlpOut,
}

impl BlockLinear {
    /// In forward order.
    pub const ALL: [BlockLinear; 4] = [
        BlockLinear::Qkv,
        BlockLinear::AttnOut,
        BlockLinear::MlpIn,
        BlockLinear::MlpOut,
    ];

    /// Its parameters in `p`.
    pub fn of<T>(self, p: &BlockParams<T>) -> &WeightBias<T> {
        match self {
            BlockLinear::Qkv => &p.qkv,
            BlockLinear::AttnOut => &p.attn_out,
            BlockLinear::MlpIn => &p.mlp_in,
            BlockLinear::MlpOut => &p.mlp_out,
        }
    }
}

/// A block's norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockNorm {
    /// Before attention.
    Norm1,
    /// Before the MLP.
    Norm2,
    /// Of each head's q (Qwen3).
    Q,
    /// Of each head's k (Qwen3).
    K,
}

impl BlockNorm {
    /// Its parameters in `p`, if the family has it.
    pub fn of<T>(self, p: &BlockParams<T>) -> Option<&WeightBias<T>> {
        match self {
            BlockNorm::Norm1 => Some(&p.norm_1),
            BlockNorm::Norm2 => Some(&p.norm_2),
            BlockNorm::Q => p.q_norm.as_ref(),
            BlockNorm::K => p.k_norm.as_ref(),
        }
    }
}

/// Where a block's parameters come from during its forward and backward, and
/// where its gradients go. Tiles are asked for in order and each is released
/// before the next is asked for.
pub trait BlockSource {
    /// The source's error (candle's errors convert into it).
    type Error: From<candle_core::Error>;

    /// Norm `which`.
    fn norm(&mut self, which: BlockNorm) -> Result<WeightBias<Tensor>, Self::Error>;

    /// Tile `tile` of `linear`, its output `columns`: weight `[in, w]`, bias
    /// `[w]` if the family has biases.
    fn linear(
        &mut self,
        linear: BlockLinear,
        tile: usize,
        columns: Range<usize>,
    ) -> Result<WeightBias<Tensor>, Self::Error>;

    /// Done with tile `tile` of `linear` until it is asked for again.
    fn release(&mut self, linear: BlockLinear, tile: usize) -> Result<(), Self::Error>;

    /// Norm `which`'s gradient.
    fn norm_grad(&mut self, which: BlockNorm, grad: WeightBias<Tensor>) -> Result<(), Self::Error>;

    /// Whether `linear`'s weight is frozen (`train.freeze`): its backward
    /// then skips `dW = xᵀ·dy`, a third of the layer's products, and hands
    /// over zeros in its place (the bias gradient, which is cheap, is still
    /// taken).
    fn weight_frozen(&self, linear: BlockLinear) -> bool;

    /// Tile `tile` of `linear`'s gradient.
    fn linear_grad(
        &mut self,
        linear: BlockLinear,
        tile: usize,
        grad: WeightBias<Tensor>,
    ) -> Result<(), Self::Error>;
}

/// `y = x·W + b`, or `y = r + (x·W + b)` with a `residual` `r` (the
/// stream a block's branch is added back to), over `tiles` of `linear` from
/// `src`, a tile at a time, each tile's GEMM writing its columns of `y` in
/// place: the bias and the residual are added as the tiles store, not in
/// passes of their own.
///
/// With [`Store::Bf16`] (bf16 products, no residual) `y` is a contiguous
/// `BF16` tensor, each tile's product rounded as its tiles store
/// (`zgemm::gemm_bf16_rounded`): for an output whose every reader rounds
/// it (attention's q, k and v), the bits they would have rounded it to,
/// in half the bytes and without their rounding.
pub(crate) fn forward<S: BlockSource>(
    src: &mut S,
    linear: BlockLinear,
    tiles: &[Range<usize>],
    x: &Tensor,
    residual: Option<&Tensor>,
    products: Products,
    store: Store,
) -> Result<Tensor, S::Error> {
    if x.track_op() || residual.is_some_and(Tensor::track_op) {
        return forward_tracked(src, linear, tiles, x, residual);
    }
    match forward_products(src, linear, tiles, x, residual, products, store, false)? {
        Some((y, _)) => Ok(y),
        None => forward_tracked(src, linear, tiles, &rows_of(x)?, residual),
    }
}

/// GELU of [`forward`]'s `x·W + b` (f32 products, no residual), and GELU's
/// slope, which the backward multiplies by ([`backward`]'s `times`): GPT's
/// MLP expansion. GELU is evaluated on each tile of the product as it is
/// finished, in L1 (`zgemm::gemm_finishing`): the output before GELU is
/// never written out and read back, a pass over 12.6 MB read and 25 MB
/// written a block at the anchor's shape; the bits of the product followed
/// by `ops::gelu_and_slope`. `None` where autograd follows `x` or the
/// parameters: the caller composes [`forward`] and GELU.
pub(crate) fn forward_gelu<S: BlockSource>(
    src: &mut S,
    linear: BlockLinear,
    tiles: &[Range<usize>],
    x: &Tensor,
) -> Result<Option<(Tensor, Tensor)>, S::Error> {
    if x.track_op() {
        return Ok(None);
    }
    Ok(
        match forward_products(src, linear, tiles, x, None, Products::F32, Store::F32, true)? {
            Some((g, Some(slope))) => Some((g, slope)),
            Some((_, None)) => unreachable!("a GELU forward makes the slope"),
            None => None,
        },
    )
}

/// [`forward`] on zgemm's products, and with `gelu`, [`forward_gelu`]'s
/// GELU and slope. `None` (nothing kept) where a tile's parameters are
/// followed by autograd, which zgemm's products cannot be.
#[allow(clippy::too_many_arguments)]
fn forward_products<S: BlockSource>(
    src: &mut S,
    linear: BlockLinear,
    tiles: &[Range<usize>],
    x: &Tensor,
    residual: Option<&Tensor>,
    products: Products,
    store: Store,
    gelu: bool,
) -> Result<Option<(Tensor, Option<Tensor>)>, S::Error> {
    if gelu && (products != Products::F32 || store != Store::F32 || residual.is_some()) {
        return Err(candle_core::Error::Msg(format!(
            "{linear:?}: GELU in the products needs f32 products, an f32 output and no residual"
        ))
        .into());
    }
    if store == Store::Bf16 && (products != Products::Bf16 || residual.is_some()) {
        return Err(candle_core::Error::Msg(format!(
            "{linear:?}: a bf16 output needs bf16 products and no residual"
        ))
        .into());
    }
    let x = rows_of(x)?;
    let residual = residual.map(Tensor::contiguous).transpose()?;
    let (rows, inputs) = x.dims2()?;
    let (xs, xl) = x.storage_and_layout();
    let xm = Input::of(&xs, xl, rows, inputs)?;
    let width = tiles.last().map_or(0, |t| t.end);
    if tiles.first().is_some_and(|t| t.start != 0)
        || tiles.windows(2).any(|w| w[0].end != w[1].start)
    {
        return Err(candle_core::Error::Msg(format!(
            "{linear:?}: tiles {tiles:?} do not cover the columns in order"
        ))
        .into());
    }
    // Every element is written by its tile's product (Zero or Bias start).
    let mut y = uninit_floats(if store == Store::F32 { rows * width } else { 0 });
    // GELU's slope, written by each tile's finish.
    let mut slope = uninit_floats::<f32>(if gelu { rows * width } else { 0 });
    // bf16: rows from a 64-byte line (the products read them in place).
    let mut y16 = uninit_floats::<u16>(if store == Store::Bf16 {
        rows * width + 32
    } else {
        0
    });
    let y16_start = zgemm::bf16_line_start(&y16);
    let threads = rayon::current_num_threads();
    for (t, cols) in tiles.iter().enumerate() {
        let p = src.linear(linear, t, cols.clone())?;
        if p.weight.track_op() {
            // Parameters that autograd follows (the reference in tests):
            // the caller starts again on candle's operations.
            drop(p);
            src.release(linear, t)?;
            return Ok(None);
        }
        let weight = p.weight.contiguous()?;
        let bias = p.bias.as_ref().map(Tensor::contiguous).transpose()?;
        {
            let (ws, wl) = weight.storage_and_layout();
            let bias = bias.as_ref().map(Tensor::storage_and_layout);
            let bias = bias.as_ref().map(|(bs, bl)| f32s(bs, bl)).transpose()?;
            let residual = residual.as_ref().map(Tensor::storage_and_layout);
            let start = match (&residual, bias) {
                (Some((rs, rl)), bias) => {
                    let r = f32s(rs, rl)?;
                    if r.len() != rows * width {
                        return Err(candle_core::Error::Msg(format!(
                            "{linear:?}: a residual of {} values for a {rows}x{width} output",
                            r.len()
                        ))
                        .into());
                    }
                    Start::Residual {
                        bias,
                        r: MatRef::new(&r[cols.start..], rows, cols.len(), width, 1)
                            .map_err(shape)?,
                    }
                }
                (None, Some(bias)) => Start::Bias(bias),
                (None, None) => Start::Zero,
            };
            let w = Input::of(&ws, wl, inputs, cols.len())?;
            match store {
                Store::F32 if gelu => {
                    let Input::F32(a) = xm else {
                        return Err(candle_core::Error::Msg(format!(
                            "{linear:?}: GELU in the products needs an f32 input"
                        ))
                        .into());
                    };
                    let slope = SharedFloats(slope[cols.start..].as_mut_ptr().cast());
                    let finish = |tile: zgemm::FinishedTile| {
                        // SAFETY: the tile's rows and columns of the slope
                        // (its columns of this linear's tile, `width`
                        // apart), this call's alone as the tile is.
                        unsafe {
                            let at = slope.get().add(tile.row0 * width + tile.col0);
                            crate::ops::gelu_and_slope_of_tile(&tile, at, width)
                        }
                    };
                    let c = MatMut::uninit(&mut y[cols.start..], rows, cols.len(), width)
                        .map_err(shape)?;
                    match w {
                        Input::F32(b) => zgemm::gemm_finishing(c, a, b, start, threads, &finish),
                        Input::Bf16(b) => {
                            zgemm::gemm_widening_b(c, a, b, start, threads, Some(&finish))
                        }
                    }
                    .map_err(shape)?
                }
                Store::F32 => multiply(
                    products,
                    MatMut::uninit(&mut y[cols.start..], rows, cols.len(), width).map_err(shape)?,
                    xm,
                    w,
                    start,
                    threads,
                )?,
                Store::Bf16 => multiply_rounded(
                    BitsMut::new(&mut y16[y16_start + cols.start..], rows, cols.len(), width)
                        .map_err(shape)?,
                    xm,
                    w,
                    bias,
                    threads,
                )?,
            }
        }
        drop(p);
        src.release(linear, t)?;
    }
    if store == Store::Bf16 {
        use half::vec::HalfBitsVecExt;
        let len = y16.len();
        let (head, body) = y16.split_at_mut(y16_start);
        for v in head.iter_mut().chain(&mut body[rows * width..]) {
            v.write(0);
        }
        // SAFETY: the head and tail are written just now, the rest as below.
        let y16 = unsafe { assume_init(y16) }.reinterpret_into::<half::bf16>();
        let all = Tensor::from_vec(y16, len, &Device::Cpu)?;
        return Ok(Some((
            all.narrow(0, y16_start, rows * width)?
                .reshape((rows, width))?,
            None,
        )));
    }
    // SAFETY: the tiles cover every column (checked above), and each tile's
    // product wrote all its rows; with GELU, each tile's finish wrote the
    // slope of every element it was handed, and a finishing product hands
    // over every element of its output.
    let (y, slope) = unsafe { (assume_init(y), assume_init(slope)) };
    let slope = gelu
        .then(|| Tensor::from_vec(slope, (rows, width), &Device::Cpu))
        .transpose()?;
    Ok(Some((
        Tensor::from_vec(y, (rows, width), &Device::Cpu)?,
        slope,
    )))
}

/// A buffer that a product's tiles write disjoint parts of, from its
/// threads.
#[derive(Clone, Copy)]
struct SharedFloats(*mut f32);
// SAFETY: each tile writes its own elements only (the finishes' contract).
unsafe impl Send for SharedFloats {}
// SAFETY: as above.
unsafe impl Sync for SharedFloats {}

impl SharedFloats {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// How [`forward`] stores its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Store {
    F32,
    /// Rounded to bf16 (bf16 products only).
    Bf16,
}

/// [`forward`] with candle's operations, which autograd can follow: the
/// reference that the explicit backward is tested against.
fn forward_tracked<S: BlockSource>(
    src: &mut S,
    linear: BlockLinear,
    tiles: &[Range<usize>],
    x: &Tensor,
    residual: Option<&Tensor>,
) -> Result<Tensor, S::Error> {
    let mut outs = Vec::with_capacity(tiles.len());
    for (t, cols) in tiles.iter().enumerate() {
        let p = src.linear(linear, t, cols.clone())?;
        let y = x.matmul(&p.weight)?;
        outs.push(match &p.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        });
        drop(p);
        src.release(linear, t)?;
    }
    let y = match outs.len() {
        1 => outs.pop().expect("one tile"),
        _ => Tensor::cat(&outs, 1)?,
    };
    Ok(match residual {
        Some(r) => (r + y)?,
        None => y,
    })
}

/// A layer's input as its backward takes it: the values its forward
/// multiplied, or, where the weight is frozen (no `dW = xᵀ·dy` to take, so
/// the forward kept nothing, as PyTorch's autograd saves no input for a
/// product whose weight needs no gradient), only its shape.
#[derive(Clone, Copy)]
pub(crate) enum LayerInput<'a> {
    Kept(&'a Tensor),
    Dropped { rows: usize, inputs: usize },
}

impl<'a> LayerInput<'a> {
    /// The input its forward kept, or (none kept) its shape, `rows × inputs`.
    pub(crate) fn of(kept: Option<&'a Tensor>, rows: usize, inputs: usize) -> LayerInput<'a> {
        match kept {
            Some(x) => LayerInput::Kept(x),
            None => LayerInput::Dropped { rows, inputs },
        }
    }
}

/// A layer's output gradient as its backward takes it.
pub(crate) enum OutputGrad {
    /// f32 values (which the backward rounds itself under bf16 products).
    F32(Tensor),
    /// Rounded to bf16 by the op that made it, with its column sums: for
    /// bf16 products only.
    Rounded(RoundedGrad),
}

/// The backward of [`forward`]: hands each tile's `(dW, db)` to `src` and
/// returns `dx = dy·Wᵀ`, accumulated a tile at a time.
/// Tiles are read out of `dy` in place (strided views, no copies).
///
/// With `times` (f32 products; `x`'s shape), returns `dx ⊙ times`
/// instead, each tile of the last product multiplied as it is finished
/// (`zgemm::gemm_finishing`): GELU's backward by the slope that
/// [`forward_gelu`] kept, without a pass of its own over `dx` (12.6 MB read
/// twice and written once a block at the anchor's shape); the bits of
/// `ops::gelu_backward_by_slope` after this backward.
pub(crate) fn backward<S: BlockSource>(
    src: &mut S,
    linear: BlockLinear,
    tiles: &[Range<usize>],
    x: LayerInput,
    dy: OutputGrad,
    products: Products,
    times: Option<&Tensor>,
) -> Result<Tensor, S::Error> {
    let frozen = src.weight_frozen(linear);
    let (x, rows, inputs) = match x {
        LayerInput::Kept(x) => {
            let x = rows_of(x)?;
            let (rows, inputs) = x.dims2()?;
            (Some(x), rows, inputs)
        }
        LayerInput::Dropped { .. } if !frozen => {
            return Err(candle_core::Error::Msg(format!(
                "{linear:?}: its weight trains, and its input was not kept"
            ))
            .into())
        }
        LayerInput::Dropped { rows, inputs } => (None, rows, inputs),
    };
    let times = times.map(Tensor::contiguous).transpose()?;
    let times_storage = times.as_ref().map(Tensor::storage_and_layout);
    let times = times_storage
        .as_ref()
        .map(|(ts, tl)| f32s(ts, tl))
        .transpose()?;
    if times.is_some_and(|t| t.len() != rows * inputs)
        || (times.is_some() && products != Products::F32)
    {
        return Err(candle_core::Error::Msg(format!(
            "{linear:?}: a slope to multiply the input gradient by needs f32 products and {rows}x{inputs} values"
        ))
        .into());
    }
    let threads = rayon::current_num_threads();
    // Under bf16 products, dy rounded once with its column sums (the bias
    // gradient's bits) in one pass, by the op that made it or here; both
    // products read the bf16 copy (`dy·Wᵀ` in place), where each rounded dy
    // as it laid it out and the bias took a pass of its own.
    let (dy, rounded) = match (dy, products) {
        (OutputGrad::F32(dy), Products::F32) => (Some(dy.contiguous()?), None),
        (OutputGrad::F32(dy), Products::Bf16) => {
            let dy = dy.contiguous()?;
            let (ds, dl) = dy.storage_and_layout();
            (
                None,
                Some(bf16_with_column_sums(f32s(&ds, dl)?, dy.dim(1)?)?),
            )
        }
        (OutputGrad::Rounded(r), Products::Bf16) => (None, Some(r)),
        (OutputGrad::Rounded(_), Products::F32) => {
            return Err(candle_core::Error::Msg(format!(
                "{linear:?}: a bf16 output gradient needs bf16 products"
            ))
            .into())
        }
    };
    let f32_dy = dy.as_ref().map(Tensor::storage_and_layout);
    let dyv = f32_dy.as_ref().map(|(ds, dl)| f32s(ds, dl)).transpose()?;
    let width = match (&dy, &rounded) {
        (Some(dy), _) => dy.dim(1)?,
        (None, Some(r)) => r.width(),
        (None, None) => unreachable!("dy is f32 or rounded"),
    };
    if let Some(r) = rounded.as_ref().filter(|r| r.rows() != rows) {
        return Err(candle_core::Error::Msg(format!(
            "{linear:?}: an output gradient of {} rows for an input of {rows}",
            r.rows()
        ))
        .into());
    }
    // dy's columns `c0..c0 + c` as an operand.
    let dy_cols = |c0: usize, c: usize| -> candle_core::Result<Input> {
        Ok(match (&rounded, dyv) {
            (Some(r), _) => Input::Bf16(r.columns(c0, c)?),
            (None, Some(dyv)) => {
                Input::F32(MatRef::new(&dyv[c0..], rows, c, width, 1).map_err(shape)?)
            }
            (None, None) => unreachable!("dy is f32 or rounded"),
        })
    };
    // Made by the first chunk's product (a Zero start writes every element).
    let mut dx: Option<Vec<f32>> = None;
    for (t, cols) in tiles.iter().enumerate() {
        let p = src.linear(linear, t, cols.clone())?;
        let weight = p.weight.contiguous()?;
        let w = cols.len();
        let mut dw = uninit_floats(if frozen { 0 } else { inputs * w });
        let bias_sums;
        {
            let x_held = x.as_ref().map(Tensor::storage_and_layout);
            let (ws, wl) = weight.storage_and_layout();
            // f32, or (bf16 products) the working copy's bf16 bits.
            let wm = Input::of(&ws, wl, inputs, w)?;
            // dW = xᵀ·dy_t, and under f32 products the bias gradient (dy_t's
            // column sums) as the product packs dy_t: `column_sums`' bits
            // without a pass of its own over dy.
            let xt = match &x_held {
                Some((xs, xl)) => Some(Input::of(xs, xl, rows, inputs)?.t()),
                None => None,
            };
            let has_bias = p.bias.is_some();
            let weight_grad = || -> candle_core::Result<Option<Vec<f32>>> {
                let dw_c = MatMut::uninit(&mut dw, inputs, w, w).map_err(shape)?;
                let xt = xt.ok_or_else(|| {
                    candle_core::Error::Msg(format!("{linear:?}: no input kept for dW"))
                })?;
                match (has_bias, xt, dy_cols(cols.start, w)?) {
                    (true, Input::F32(xt), Input::F32(dy_t)) if products == Products::F32 => {
                        let mut sums = vec![0f32; w];
                        zgemm::gemm_summing_b(dw_c, xt, dy_t, 1.0, Start::Zero, threads, &mut sums)
                            .map_err(shape)?;
                        Ok(Some(sums))
                    }
                    (_, xt, dy_t) => {
                        multiply(products, dw_c, xt, dy_t, Start::Zero, threads)?;
                        Ok(None)
                    }
                }
            };
            // dx += dy_t·Wᵀ, one product a tile, tiles in order: zgemm's f32
            // products at α = 1 and the bf16 ones continue the sum that `dx` holds
            // (module doc).
            // Side by side: each product still spreads over every thread, and
            // a thread that waits inside one (its packing, its last tasks)
            // takes the other's tasks meanwhile. Neither reads what the other
            // writes, and each product's bits do not depend on its threads.
            // The last tile's product finishes dx: multiplied by `times` there.
            let times = times.filter(|_| t + 1 == tiles.len());
            // The first product's dx is allocated here, on the calling
            // thread: made inside the join on a thread that stole it, it
            // came from that thread's glibc arena, to which it went back
            // when freed, out of reach of the calling thread's allocations
            // (a bf16 gpt-anchor worker of two threads peaked 16 MiB higher).
            let mut fresh = dx.is_none().then(|| uninit_floats(rows * inputs));
            let mut input_grad = || -> candle_core::Result<()> {
                let a = dy_cols(cols.start, w)?;
                let b = wm.t();
                match dx.as_mut() {
                    Some(dx) => multiply_times(
                        products,
                        MatMut::row_major(dx, rows, inputs).map_err(shape)?,
                        a,
                        b,
                        Start::Keep,
                        threads,
                        times,
                    ),
                    None => {
                        let mut fresh = fresh.take().expect("made for the first product");
                        multiply_times(
                            products,
                            MatMut::uninit(&mut fresh, rows, inputs, inputs).map_err(shape)?,
                            a,
                            b,
                            Start::Zero,
                            threads,
                            times,
                        )?;
                        // SAFETY: a Zero start wrote every element.
                        dx = Some(unsafe { assume_init(fresh) });
                        Ok(())
                    }
                }
            };
            let (sums, done) = match (frozen, dyv) {
                (false, _) => rayon::join(weight_grad, input_grad),
                // A frozen weight: the input gradient alone, and the bias
                // gradient that f32 products would have taken with dW.
                (true, Some(dyv)) if has_bias => (
                    Ok(Some(column_sums_in_groups(dyv, width, cols.clone()))),
                    input_grad(),
                ),
                (true, _) => (Ok(None), input_grad()),
            };
            bias_sums = sums?;
            done?;
        }
        let bias = match (&p.bias, &rounded, bias_sums) {
            (Some(_), Some(r), _) => Some(Tensor::from_slice(
                &r.sums()[cols.clone()],
                w,
                &Device::Cpu,
            )?),
            (Some(_), None, Some(sums)) => Some(Tensor::from_vec(sums, w, &Device::Cpu)?),
            (Some(_), None, None) => {
                return Err(candle_core::Error::Msg(format!(
                    "{linear:?}: no bias gradient (f32 products take it with dW)"
                ))
                .into())
            }
            _ => None,
        };
        let weight = match frozen {
            // Zeros that hold no memory (one element, broadcast): the
            // engine keeps no gradient of a frozen weight.
            true => Tensor::zeros((), DType::F32, &Device::Cpu)?.broadcast_as((inputs, w))?,
            // SAFETY: a Zero start wrote every element of dW.
            false => Tensor::from_vec(unsafe { assume_init(dw) }, (inputs, w), &Device::Cpu)?,
        };
        let grad = WeightBias { weight, bias };
        drop(p);
        src.release(linear, t)?;
        src.linear_grad(linear, t, grad)?;
    }
    let dx = dx.unwrap_or_else(|| {
        // No columns, no product: zero, times the slope as the product's
        // finish would have.
        let zeros = vec![0f32; rows * inputs];
        match times {
            Some(by) => zeros.iter().zip(by).map(|(&g, &d)| g * d).collect(),
            None => zeros,
        }
    });
    Ok(Tensor::from_vec(dx, (rows, inputs), &Device::Cpu)?)
}

/// Column sums of columns `cols` of the row-major `dy` (rows `width`
/// apart) as [`zgemm::gemm_summing_b`] adds them while it packs `dy` for
/// the weight gradient, to the bit: rows in groups of [`zgemm::SUM_GROUP`],
/// each group summed from zero in row order, the groups added in order to
/// a sum from zero. A frozen weight's layer takes its bias gradient here,
/// the same bits as where its weight trains.
fn column_sums_in_groups(dy: &[f32], width: usize, cols: Range<usize>) -> Vec<f32> {
    use rayon::prelude::*;
    /// Columns a task sums: its group's partial sums stay in L1.
    const COLUMNS: usize = 256;
    let rows = dy.len() / width;
    let mut sums = vec![0f32; cols.len()];
    sums.par_chunks_mut(COLUMNS)
        .enumerate()
        .for_each(|(i, sums)| {
            let c0 = cols.start + i * COLUMNS;
            let mut group = vec![0f32; sums.len()];
            for first in (0..rows).step_by(zgemm::SUM_GROUP) {
                group.fill(0.0);
                for r in first..(first + zgemm::SUM_GROUP).min(rows) {
                    let row = &dy[r * width + c0..][..sums.len()];
                    group.iter_mut().zip(row).for_each(|(g, v)| *g += v);
                }
                sums.iter_mut().zip(&group).for_each(|(s, g)| *s += g);
            }
        });
    sums
}

/// [`multiply`] into `c` (the layer's input gradient, `rows × inputs` in
/// rows `inputs` apart), and with `times` (f32 products and operands; `c`'s
/// shape, contiguous) each element of the finished `C` multiplied by the
/// same element of `times`.
#[allow(clippy::too_many_arguments)]
fn multiply_times(
    products: Products,
    c: MatMut,
    a: Input,
    b: Input,
    start: Start,
    threads: usize,
    times: Option<&[f32]>,
) -> candle_core::Result<()> {
    let Some(by) = times else {
        return multiply(products, c, a, b, start, threads);
    };
    let (Products::F32, Input::F32(a), Input::F32(b)) = (products, a, b) else {
        return Err(candle_core::Error::Msg(
            "linear layer: a slope multiplied in the products needs f32 products and operands"
                .into(),
        ));
    };
    let width = c.cols();
    if by.len() != c.rows() * width {
        return Err(candle_core::Error::Msg(format!(
            "linear layer: {} values to multiply a {}x{width} input gradient by",
            by.len(),
            c.rows()
        )));
    }
    let finish = |tile: zgemm::FinishedTile| {
        // SAFETY: the tile's rows and columns of `by`, which has C's shape
        // in rows `width` apart (checked above).
        unsafe {
            let at = by.as_ptr().add(tile.row0 * width + tile.col0);
            crate::ops::times_slope_of_tile(&tile, at, width)
        }
    };
    zgemm::gemm_finishing(c, a, b, start, threads, &finish).map_err(shape)
}

/// What the linear layers' products multiply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Products {
    /// f32 values (every `train.dtype` on a CPU without native bf16).
    #[default]
    F32,
    /// The operands rounded to bf16, f32 accumulation ([`zgemm::gemm_bf16`]):
    /// `train.dtype: bf16` where the CPU multiplies bf16 natively
    /// ([`zgemm::has_native_bf16`]); the input gradient relies on the bf16
    /// kernels' exact depth splits.
    Bf16,
}

/// A layer's input or weight as its products read it: f32 values, or the
/// bf16 values that its producer wrote for bf16 products
/// (`layer_norm_bf16`, `gelu_bf16`; a weight: the engine's bf16 working
/// copy, [`crate::ParamSpec::product_operand`]).
#[derive(Clone, Copy)]
pub(crate) enum Input<'a> {
    F32(MatRef<'a>),
    Bf16(MatRef<'a, u16>),
}

impl<'a> Input<'a> {
    /// A CPU tensor's values as `rows × cols`: contiguous f32, or bf16 in
    /// rows with adjacent columns (a producer's padded rows,
    /// `simd::par_rows_bf16`, read where they are).
    pub(crate) fn of(
        storage: &'a Storage,
        layout: &Layout,
        rows: usize,
        cols: usize,
    ) -> candle_core::Result<Input<'a>> {
        use half::slice::HalfFloatSliceExt;
        match storage {
            Storage::Cpu(CpuStorage::BF16(v)) => {
                let rs = match layout.stride() {
                    [rs, 1] => *rs,
                    [_] | [] => cols,
                    _ if layout.is_contiguous() => cols,
                    _ => {
                        return Err(candle_core::Error::Msg(
                            "linear layer: bf16 input rows must have adjacent columns".into(),
                        ))
                    }
                };
                let v: &[u16] = v.reinterpret_cast();
                Ok(Input::Bf16(
                    MatRef::new(&v[layout.start_offset()..], rows, cols, rs, 1).map_err(shape)?,
                ))
            }
            _ => Ok(Input::F32(
                MatRef::row_major(f32s(storage, layout)?, rows, cols).map_err(shape)?,
            )),
        }
    }

    pub(crate) fn t(self) -> Input<'a> {
        match self {
            Input::F32(m) => Input::F32(m.t()),
            Input::Bf16(m) => Input::Bf16(m.t()),
        }
    }

    pub(crate) fn rows(&self) -> usize {
        match self {
            Input::F32(m) => m.rows(),
            Input::Bf16(m) => m.rows(),
        }
    }

    pub(crate) fn cols(&self) -> usize {
        match self {
            Input::F32(m) => m.cols(),
            Input::Bf16(m) => m.cols(),
        }
    }
}

/// `x` as a layer's input: as it is where its values are bf16 rows with
/// adjacent columns (what the products read in place), else contiguous.
fn rows_of(x: &Tensor) -> candle_core::Result<Tensor> {
    let strided_rows = matches!(x.layout().stride(), [_, 1]);
    if x.dtype() == candle_core::DType::BF16 && strided_rows {
        Ok(x.clone())
    } else {
        x.contiguous()
    }
}

/// `C = start ⊕ A·B` with `products`' GEMM.
pub(crate) fn multiply(
    products: Products,
    c: MatMut,
    a: Input,
    b: Input,
    start: Start,
    threads: usize,
) -> candle_core::Result<()> {
    use zgemm::gemm_bf16;
    match (products, a, b) {
        (Products::F32, Input::F32(a), Input::F32(b)) => zgemm::gemm(c, a, b, 1.0, start, threads),
        // A weight stored in bf16 (a sampler's, as published): widened.
        (Products::F32, Input::F32(a), Input::Bf16(b)) => {
            zgemm::gemm_widening_b(c, a, b, start, threads, None)
        }
        (Products::Bf16, Input::F32(a), Input::F32(b)) => gemm_bf16(c, a, b, 1.0, start, threads),
        (Products::Bf16, Input::Bf16(a), Input::F32(b)) => gemm_bf16(c, a, b, 1.0, start, threads),
        (Products::Bf16, Input::F32(a), Input::Bf16(b)) => gemm_bf16(c, a, b, 1.0, start, threads),
        (Products::Bf16, Input::Bf16(a), Input::Bf16(b)) => gemm_bf16(c, a, b, 1.0, start, threads),
        (Products::F32, _, _) => {
            return Err(candle_core::Error::Msg(
                "linear layer: a bf16 input needs bf16 products".into(),
            ))
        }
    }
    .map_err(shape)
}

/// `C = bias + A·B` with bf16 products, stored rounded.
fn multiply_rounded(
    c: BitsMut,
    a: Input,
    b: Input,
    bias: Option<&[f32]>,
    threads: usize,
) -> candle_core::Result<()> {
    use zgemm::gemm_bf16_rounded as rounded;
    match (a, b) {
        (Input::F32(a), Input::F32(b)) => rounded(c, a, b, bias, threads),
        (Input::Bf16(a), Input::F32(b)) => rounded(c, a, b, bias, threads),
        (Input::F32(a), Input::Bf16(b)) => rounded(c, a, b, bias, threads),
        (Input::Bf16(a), Input::Bf16(b)) => rounded(c, a, b, bias, threads),
    }
    .map_err(shape)
}

fn shape(e: zgemm::ShapeError) -> candle_core::Error {
    candle_core::Error::Msg(format!("linear layer: {e}"))
}

/// The values of a contiguous f32 CPU tensor's storage, without a copy.
pub(crate) fn f32s<'a>(storage: &'a Storage, layout: &Layout) -> candle_core::Result<&'a [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(&v[a..b]),
        _ => Err(candle_core::Error::Msg(
            "a linear layer or the head needs contiguous f32 tensors on the CPU".into(),
        )),
    }
}

/// Whole `BlockParams` as a [`BlockSource`] (tiles cut from them), collecting
/// the gradients as whole `BlockParams`.
pub(crate) struct Whole<'a> {
    params: &'a BlockParams<Tensor>,
    /// Per linear: its tiles' gradients so far.
    tiles: [Vec<WeightBias<Tensor>>; 4],
    norms: [Option<WeightBias<Tensor>>; 4],
    /// Per linear: whether its weight is frozen.
    frozen: [bool; 4],
}

impl<'a> Whole<'a> {
    pub(crate) fn new(params: &'a BlockParams<Tensor>) -> Whole<'a> {
        Whole {
            params,
            tiles: Default::default(),
            norms: [None, None, None, None],
            frozen: [false; 4],
        }
    }

    /// With the weights of `linears` frozen.
    #[cfg(test)]
    pub(crate) fn freezing(mut self, linears: &[BlockLinear]) -> Whole<'a> {
        for &l in linears {
            self.frozen[l as usize] = true;
        }
        self
    }

    /// The gradients handed over, whole.
    pub(crate) fn grads(self) -> candle_core::Result<BlockParams<Tensor>> {
        let [norm_1, norm_2, q_norm, k_norm] = self.norms;
        let missing = || candle_core::Error::Msg("a block's backward left a gradient out".into());
        let mut linears = self.tiles.into_iter().map(|t| {
            let (w, b): (Vec<Tensor>, Vec<Option<Tensor>>) =
                t.into_iter().map(|g| (g.weight, g.bias)).unzip();
            let b: Option<Vec<Tensor>> = b.into_iter().collect();
            Ok::<_, candle_core::Error>(WeightBias {
                weight: Tensor::cat(&w, 1)?,
                bias: b.map(|b| Tensor::cat(&b, 0)).transpose()?,
            })
        });
        let mut next = || linears.next().ok_or_else(missing)?;
        Ok(BlockParams {
            qkv: next()?,
            attn_out: next()?,
            mlp_in: next()?,
            mlp_out: next()?,
            norm_1: norm_1.ok_or_else(missing)?,
            norm_2: norm_2.ok_or_else(missing)?,
            q_norm,
            k_norm,
        })
    }
}

impl BlockSource for Whole<'_> {
    type Error = candle_core::Error;

    fn norm(&mut self, which: BlockNorm) -> candle_core::Result<WeightBias<Tensor>> {
        which
            .of(self.params)
            .cloned()
            .ok_or_else(|| candle_core::Error::Msg(format!("the block has no {which:?} norm")))
    }

    fn linear(
        &mut self,
        linear: BlockLinear,
        _tile: usize,
        columns: Range<usize>,
    ) -> candle_core::Result<WeightBias<Tensor>> {
        let p = linear.of(self.params);
        if columns.start == 0 && columns.end == p.weight.dim(1)? {
            return Ok(p.clone());
        }
        Ok(WeightBias {
            weight: p
                .weight
                .narrow(1, columns.start, columns.len())?
                .contiguous()?,
            bias: p
                .bias
                .as_ref()
                .map(|b| b.narrow(0, columns.start, columns.len()))
                .transpose()?,
        })
    }

    fn release(&mut self, _linear: BlockLinear, _tile: usize) -> candle_core::Result<()> {
        Ok(())
    }

    fn norm_grad(&mut self, which: BlockNorm, grad: WeightBias<Tensor>) -> candle_core::Result<()> {
        self.norms[which as usize] = Some(grad);
        Ok(())
    }

    fn weight_frozen(&self, linear: BlockLinear) -> bool {
        self.frozen[linear as usize]
    }

    fn linear_grad(
        &mut self,
        linear: BlockLinear,
        tile: usize,
        grad: WeightBias<Tensor>,
    ) -> candle_core::Result<()> {
        let tiles = &mut self.tiles[linear as usize];
        if tiles.len() != tile {
            return Err(candle_core::Error::Msg(format!(
                "{linear:?}: gradient of tile {tile} after {} tiles",
                tiles.len()
            )));
        }
        tiles.push(grad);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::{bf16_bits_of, rounded};
    use crate::ops::{gelu_backward, gelu_backward_bf16_of_input, gelu_bf16_of_bf16};
    use crate::Gpt;

    fn bits(t: &Tensor) -> Vec<u32> {
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v.into_iter().map(f32::to_bits).collect()
    }

    fn values(n: usize, k: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * k % 23) as f32 - 11.0) / 9.0).collect()
    }

    /// A one-block GPT's block parameters, initialised, at width `d_model`.
    fn block_params(d_model: usize) -> BlockParams<Tensor> {
        let spec: zconfig::spec::ModelSpec = serde_json::from_value(serde_json::json!({
            "vocab_size": 11, "d_model": d_model, "n_layers": 1, "n_heads": 2, "seq_len": 64
        }))
        .unwrap();
        let g = Gpt::new(&spec).unwrap();
        let params: Vec<Tensor> = g
            .init_group(1, 3)
            .into_iter()
            .zip(&g.groups()[1].params)
            .map(|(v, ps)| Tensor::from_vec(v, ps.shape.as_slice(), &Device::Cpu).unwrap())
            .collect();
        BlockParams::from_vec(params, g.layout()).unwrap()
    }

    /// Under f32 products the bias gradient comes with dW's product (zgemm
    /// sums dy's columns as it packs them) and has `column_sums`' bits: its
    /// groups of rows are the tasks' rows, at one tile and at several, over
    /// row counts that end inside a group; dW is `xᵀ·dy`'s.
    #[test]
    fn f32_bias_gradients_are_column_sums_to_the_bit() {
        assert_eq!(zgemm::SUM_GROUP, crate::simd::ROWS_PER_TASK);
        let params = block_params(32);
        let dev = Device::Cpu;
        let (d, wide) = (32, 128);
        for rows in [1, 16, 37, 400] {
            let x = Tensor::from_vec(values(rows * d, 7), (rows, d), &dev).unwrap();
            let dy = Tensor::from_vec(values(rows * wide, 5), (rows, wide), &dev).unwrap();
            let whole = 0..wide;
            let two = [0..48, 48..wide];
            for tiles in [std::slice::from_ref(&whole), &two] {
                let mut src = Whole::new(&params);
                let out = OutputGrad::F32(dy.clone());
                backward(
                    &mut src,
                    BlockLinear::MlpIn,
                    tiles,
                    LayerInput::Kept(&x),
                    out,
                    Products::F32,
                    None,
                )
                .unwrap();
                for (t, cols) in tiles.iter().enumerate().rev() {
                    let grad = src.tiles[BlockLinear::MlpIn as usize].pop().unwrap();
                    let dy_t = dy.narrow(1, cols.start, cols.len()).unwrap();
                    let want = crate::ops::column_sums(&dy_t).unwrap();
                    let db = grad.bias.expect("the MLP's input layer has a bias");
                    assert_eq!(bits(&db), bits(&want), "{rows} rows, tile {t}");
                    let dw = x.t().unwrap().matmul(&dy_t.contiguous().unwrap()).unwrap();
                    let diff = (grad.weight - dw).unwrap().abs().unwrap();
                    let worst = diff.max_all().unwrap().to_scalar::<f32>().unwrap();
                    assert!(worst < 1e-4, "dW off by {worst}, {rows} rows, tile {t}");
                }
            }
        }
    }

    /// GELU run in the MLP's products, forward (`forward_gelu`) and backward
    /// (`backward`'s `times`), gives the bits of the product followed by
    /// `ops::gelu_and_slope` and of the backward followed by
    /// `ops::gelu_backward_by_slope`: whole and in tiles (the backward's
    /// last tile finishing `dx`), rows that leave partial tiles, tiles whose
    /// widths leave columns past the last whole vector, and values on every
    /// branch of GELU (past its clamps, tiny, negative).
    #[test]
    fn gelu_in_the_products_gives_the_composed_ops_bits() {
        use crate::ops::{gelu_and_slope, gelu_backward_by_slope};
        let dev = Device::Cpu;
        let params = block_params(32);
        let (d, wide) = (32, 128);
        for rows in [1, 7, 100] {
            // Inputs spread so that x·W reaches past GELU's clamps.
            let big: Vec<f32> = values(rows * d, 7).iter().map(|v| v * 40.0).collect();
            let x = Tensor::from_vec(big, (rows, d), &dev).unwrap();
            let whole = 0..wide;
            let three = [0..45, 45..64, 64..wide];
            for tiles in [std::slice::from_ref(&whole), &three] {
                let l = BlockLinear::MlpIn;
                let mut src = Whole::new(&params);
                let (g, slope) = forward_gelu(&mut src, l, tiles, &x).unwrap().unwrap();
                let mut src = Whole::new(&params);
                let h = forward(&mut src, l, tiles, &x, None, Products::F32, Store::F32).unwrap();
                let (want_g, want_slope) = gelu_and_slope(&h).unwrap();
                let what = format!("{rows} rows, {} tiles", tiles.len());
                assert_eq!(bits(&g), bits(&want_g), "GELU, {what}");
                assert_eq!(bits(&slope), bits(&want_slope), "slope, {what}");

                // The projection back from `wide` to d, whose input gradient
                // (rows × wide) is multiplied by the slope.
                let l = BlockLinear::MlpOut;
                let dy = Tensor::from_vec(values(rows * d, 5), (rows, d), &dev).unwrap();
                let (two, one) = ([0..16, 16..d], 0..d);
                for out_tiles in [&two[..], std::slice::from_ref(&one)] {
                    let mut src = Whole::new(&params);
                    let out = OutputGrad::F32(dy.clone());
                    let got = backward(
                        &mut src,
                        l,
                        out_tiles,
                        LayerInput::Kept(&g),
                        out,
                        Products::F32,
                        Some(&slope),
                    )
                    .unwrap();
                    let mut src = Whole::new(&params);
                    let out = OutputGrad::F32(dy.clone());
                    let dg = backward(
                        &mut src,
                        l,
                        out_tiles,
                        LayerInput::Kept(&g),
                        out,
                        Products::F32,
                        None,
                    )
                    .unwrap();
                    let want = gelu_backward_by_slope(&slope, &dg).unwrap();
                    assert_eq!(bits(&got), bits(&want), "backward, {what}, {out_tiles:?}");
                }
            }
        }
    }

    /// With bf16 products a weight may come as a `BF16` tensor (the engine's
    /// working copy, `ParamSpec::product_operand`): forward and backward,
    /// whole and in tiles, it gives the bits of the same values in f32 (and
    /// under f32 products, widened: a sampled model kept in bf16).
    #[test]
    fn bf16_weights_give_the_bits_of_their_values_in_f32() {
        if !zgemm::has_native_bf16() {
            eprintln!("skipped: no native bf16 here, so weights are never handed over in bf16");
            return;
        }
        let dev = Device::Cpu;
        let (rows, d, wide) = (96, 64, 256);
        let exact = |t: &Tensor| t.to_dtype(candle_core::DType::BF16).unwrap();
        let with_weights = |p: &BlockParams<Tensor>, f: &dyn Fn(&Tensor) -> Tensor| {
            let mut q = p.clone();
            for wb in [&mut q.qkv, &mut q.attn_out, &mut q.mlp_in, &mut q.mlp_out] {
                wb.weight = f(&wb.weight);
            }
            q
        };
        // Weights that bf16 holds exactly, in f32 and as bf16.
        let f32_params = with_weights(&block_params(d), &|w| {
            exact(w).to_dtype(candle_core::DType::F32).unwrap()
        });
        let bf16_params = with_weights(&f32_params, &exact);
        let x = Tensor::from_vec(values(rows * d, 3), (rows, d), &dev).unwrap();
        let dy = Tensor::from_vec(values(rows * wide, 11), (rows, wide), &dev).unwrap();
        let whole = 0..wide;
        let two = [0..96, 96..wide];
        for tiles in [std::slice::from_ref(&whole), &two] {
            let run = |params: &BlockParams<Tensor>| {
                let mut src = Whole::new(params);
                let l = BlockLinear::MlpIn;
                let y = forward(&mut src, l, tiles, &x, None, Products::Bf16, Store::F32).unwrap();
                let out = OutputGrad::F32(dy.clone());
                let dx = backward(
                    &mut src,
                    l,
                    tiles,
                    LayerInput::Kept(&x),
                    out,
                    Products::Bf16,
                    None,
                )
                .unwrap();
                let grads: Vec<_> = std::mem::take(&mut src.tiles[l as usize])
                    .into_iter()
                    .map(|g| (bits(&g.weight), bits(&g.bias.unwrap())))
                    .collect();
                (bits(&y), bits(&dx), grads)
            };
            assert_eq!(run(&bf16_params), run(&f32_params), "{} tiles", tiles.len());
        }
        // Under f32 products a bf16 weight (a sampled model's kept in bf16)
        // is widened exactly: the f32 weight's bits.
        let f32_forward = |params: &BlockParams<Tensor>| {
            let mut src = Whole::new(params);
            let l = BlockLinear::MlpIn;
            let y = forward(
                &mut src,
                l,
                std::slice::from_ref(&whole),
                &x,
                None,
                Products::F32,
                Store::F32,
            );
            bits(&y.unwrap())
        };
        assert_eq!(f32_forward(&bf16_params), f32_forward(&f32_params));
    }

    /// An output stored in bf16 is the f32 output rounded, bit for bit,
    /// whole and in two tiles, from an f32 or a bf16 input; refused under
    /// f32 products and with a residual (which the rounding would lose).
    #[test]
    fn outputs_stored_in_bf16_are_the_f32_outputs_rounded() {
        if !zgemm::has_native_bf16() {
            eprintln!("skipped: no native bf16 here, so outputs are never stored in bf16");
            return;
        }
        let dev = Device::Cpu;
        let (rows, d, wide) = (70, 64, 256);
        let params = block_params(d);
        let x = Tensor::from_vec(values(rows * d, 3), (rows, d), &dev).unwrap();
        let x16 = x.to_dtype(candle_core::DType::BF16).unwrap();
        let (whole, two) = (0..wide, [0..96, 96..wide]);
        let l = BlockLinear::MlpIn;
        for tiles in [std::slice::from_ref(&whole), &two] {
            for x in [&x, &x16] {
                let run = |store| {
                    let mut src = Whole::new(&params);
                    forward(&mut src, l, tiles, x, None, Products::Bf16, store).unwrap()
                };
                let want = rounded(&run(Store::F32));
                let got = run(Store::Bf16);
                assert_eq!(got.dims(), &[rows, wide]);
                assert!(got.is_contiguous());
                assert_eq!(
                    bf16_bits_of(&got),
                    want,
                    "{} tiles, input {:?}",
                    tiles.len(),
                    x.dtype()
                );
            }
        }
        let mut src = Whole::new(&params);
        let y = Tensor::zeros((rows, wide), candle_core::DType::F32, &dev).unwrap();
        let out = forward(
            &mut src,
            l,
            std::slice::from_ref(&whole),
            &x,
            None,
            Products::F32,
            Store::Bf16,
        );
        assert!(out.is_err());
        let mut src = Whole::new(&params);
        let out = forward(
            &mut src,
            l,
            &[whole],
            &x,
            Some(&y),
            Products::Bf16,
            Store::Bf16,
        );
        assert!(out.unwrap_err().to_string().contains("no residual"));
    }

    /// With bf16 products, a layer reads a producer's padded bf16 rows in
    /// place (GELU's 256 columns laid out 288 apart) with the bits it gets
    /// from a contiguous copy of them (which zgemm copies again to read),
    /// forward and backward; and an output gradient rounded by its producer
    /// (GELU's backward) gives the bits of the f32 one rounded here.
    #[test]
    fn bf16_layers_read_padded_rows_and_rounded_gradients_with_the_bits_of_copies() {
        if !zgemm::has_native_bf16() {
            eprintln!("skipped: no native bf16 here, so there are no bf16 products to check");
            return;
        }
        let params = block_params(64);
        let dev = Device::Cpu;
        let (rows, d, wide) = (64, 64, 256);
        let h = Tensor::from_vec(values(rows * wide, 7), (rows, wide), &dev)
            .unwrap()
            .to_dtype(candle_core::DType::BF16)
            .unwrap();
        let padded = gelu_bf16_of_bf16(&h).unwrap();
        assert_eq!(padded.layout().stride(), &[288, 1]);
        let copy = padded.contiguous().unwrap();
        let dy = Tensor::from_vec(values(rows * d, 5), (rows, d), &dev).unwrap();
        let bf16 = Products::Bf16;
        // One tile each: the whole layer.
        let (out_cols, in_cols) = (0..d, 0..wide);
        let (out_tiles, in_tiles) = (
            std::slice::from_ref(&out_cols),
            std::slice::from_ref(&in_cols),
        );

        // The MLP's projection: forward, and backward with an f32 dy.
        let run_out = |x: &Tensor| {
            let mut src = Whole::new(&params);
            let y = forward(
                &mut src,
                BlockLinear::MlpOut,
                out_tiles,
                x,
                None,
                bf16,
                Store::F32,
            )
            .unwrap();
            let out = OutputGrad::F32(dy.clone());
            let dx = backward(
                &mut src,
                BlockLinear::MlpOut,
                out_tiles,
                LayerInput::Kept(x),
                out,
                bf16,
                None,
            )
            .unwrap();
            let grad = src.tiles[BlockLinear::MlpOut as usize].pop().unwrap();
            (
                bits(&y),
                bits(&dx),
                bits(&grad.weight),
                bits(&grad.bias.unwrap()),
            )
        };
        assert_eq!(run_out(&padded), run_out(&copy));

        // The MLP's expansion, its output gradient from GELU's backward.
        let x = Tensor::from_vec(values(rows * d, 3), (rows, d), &dev).unwrap();
        let dg = Tensor::from_vec(values(rows * wide, 11), (rows, wide), &dev).unwrap();
        let run_in = |out: OutputGrad| {
            let mut src = Whole::new(&params);
            let dx = backward(
                &mut src,
                BlockLinear::MlpIn,
                in_tiles,
                LayerInput::Kept(&x),
                out,
                bf16,
                None,
            )
            .unwrap();
            let grad = src.tiles[BlockLinear::MlpIn as usize].pop().unwrap();
            (bits(&dx), bits(&grad.weight), bits(&grad.bias.unwrap()))
        };
        let rounded = run_in(OutputGrad::Rounded(
            gelu_backward_bf16_of_input(&h, &dg).unwrap(),
        ));
        let widened = h.to_dtype(candle_core::DType::F32).unwrap();
        assert_eq!(
            rounded,
            run_in(OutputGrad::F32(gelu_backward(&widened, &dg).unwrap()))
        );
        // A rounded gradient asks for bf16 products.
        let mut src = Whole::new(&params);
        let out = OutputGrad::Rounded(gelu_backward_bf16_of_input(&h, &dg).unwrap());
        assert!(backward(
            &mut src,
            BlockLinear::MlpIn,
            in_tiles,
            LayerInput::Kept(&x),
            out,
            Products::F32,
            None
        )
        .is_err());
    }
}
