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
//! layer. The input gradient sums over output columns, so its order of
//! addition is fixed for both: `dx` is accumulated over chunks of
//! [`DX_CHUNK`] output columns, in order, whole layer or tiled, and tiles start
//! on chunk boundaries. Measured on GPT-2-small-sized GEMMs (2048 rows, 768
//! and 3072 wide): 0.94-1.07x the time of candle's single `dy·Wᵀ`; a whole
//! step of `configs/bench-25m.yaml` did not slow down (1017-1024 ms against
//! 1023-1048 ms).
//!
//! Where the parameters come from is a [`BlockSource`]: whole `BlockParams`
//! (tests, the autograd reference), or the engine, which gathers each tile
//! just before its use and hands each tile's gradient to the reduction as
//! soon as it exists.

use std::ops::Range;

use candle_core::{CpuStorage, Device, Storage, Tensor};

use crate::ops::column_sums;
use crate::params::{BlockParams, WeightBias};

/// Output columns per step of the input gradient's accumulation: zconfig's
/// tile granularity, so that tiles start on chunk boundaries.
pub const DX_CHUNK: usize = zconfig::tiles::TILE_COLUMNS;

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
}

impl BlockNorm {
    /// Both, in forward order.
    pub const ALL: [BlockNorm; 2] = [BlockNorm::Norm1, BlockNorm::Norm2];

    /// Its parameters in `p`.
    pub fn of<T>(self, p: &BlockParams<T>) -> &WeightBias<T> {
        match self {
            BlockNorm::Norm1 => &p.norm_1,
            BlockNorm::Norm2 => &p.norm_2,
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

    /// Tile `tile` of `linear`'s gradient.
    fn linear_grad(
        &mut self,
        linear: BlockLinear,
        tile: usize,
        grad: WeightBias<Tensor>,
    ) -> Result<(), Self::Error>;
}

/// `y = x·W + b` over `tiles` of `linear` from `src`, a tile at a time.
pub(crate) fn forward<S: BlockSource>(
    src: &mut S,
    linear: BlockLinear,
    tiles: &[Range<usize>],
    x: &Tensor,
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
    match outs.len() {
        1 => Ok(outs.pop().expect("one tile")),
        _ => Ok(Tensor::cat(&outs, 1)?),
    }
}

/// The backward of [`forward`]: hands each tile's `(dW, db)` to `src` and
/// returns `dx = dy·Wᵀ`, accumulated over chunks of [`DX_CHUNK`] columns.
pub(crate) fn backward<S: BlockSource>(
    src: &mut S,
    linear: BlockLinear,
    tiles: &[Range<usize>],
    x: &Tensor,
    dy: &Tensor,
) -> Result<Tensor, S::Error> {
    let (rows, inputs) = x.dims2()?;
    let mut dx = vec![0f32; rows * inputs];
    for (t, cols) in tiles.iter().enumerate() {
        let p = src.linear(linear, t, cols.clone())?;
        let dy_t = if tiles.len() == 1 {
            dy.contiguous()?
        } else {
            dy.narrow(1, cols.start, cols.len())?.contiguous()?
        };
        let grad = WeightBias {
            weight: x.t()?.matmul(&dy_t)?,
            bias: match p.bias {
                Some(_) => Some(column_sums(&dy_t)?),
                None => None,
            },
        };
        add_dy_wt(&mut dx, &dy_t, &p.weight.contiguous()?, cols.start == 0)?;
        drop(p);
        src.release(linear, t)?;
        src.linear_grad(linear, t, grad)?;
    }
    Ok(Tensor::from_vec(dx, (rows, inputs), &Device::Cpu)?)
}

/// A contiguous f32 CPU tensor's values, to `f` without a copy.
fn with_values<T>(t: &Tensor, f: impl FnOnce(&[f32]) -> T) -> candle_core::Result<T> {
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(f(&v[a..b])),
        _ => Err(candle_core::Error::Msg(
            "a linear layer needs contiguous f32 tensors on the CPU".into(),
        )),
    }
}

/// `dx += dy·wᵀ` for `dy` `[rows, w]` and `weight` `[in, w]` (both
/// contiguous), one GEMM per chunk of [`DX_CHUNK`] columns in order; `first`:
/// the chunk at column 0 overwrites `dx` instead of adding.
fn add_dy_wt(dx: &mut [f32], dy: &Tensor, weight: &Tensor, first: bool) -> candle_core::Result<()> {
    let (rows, w) = dy.dims2()?;
    let (inputs, w2) = weight.dims2()?;
    if w != w2 || dx.len() != rows * inputs {
        return Err(candle_core::Error::Msg(format!(
            "dy {rows}x{w} and weight {inputs}x{w2} do not make dx of {}",
            dx.len()
        )));
    }
    let threads = rayon::current_num_threads();
    with_values(dy, |dy| {
        with_values(weight, |wt| {
            for c0 in (0..w).step_by(DX_CHUNK) {
                let c = DX_CHUNK.min(w - c0);
                // SAFETY: dx is rows x inputs (row stride inputs); dy's columns
                // c0..c0+c of rows x w (row stride w); the weight's columns
                // c0..c0+c of inputs x w, read as the c x inputs matrix wᵀ
                // (row stride 1, column stride w). All in bounds.
                unsafe {
                    gemm::gemm(
                        rows,
                        inputs,
                        c,
                        dx.as_mut_ptr(),
                        1,
                        inputs as isize,
                        !(first && c0 == 0),
                        dy.as_ptr().add(c0),
                        1,
                        w as isize,
                        wt.as_ptr().add(c0),
                        w as isize,
                        1,
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::Rayon(threads),
                    )
                }
            }
        })
    })?
}

/// Whole `BlockParams` as a [`BlockSource`] (tiles cut from them), collecting
/// the gradients as whole `BlockParams`.
pub(crate) struct Whole<'a> {
    params: &'a BlockParams<Tensor>,
    /// Per linear: its tiles' gradients so far.
    tiles: [Vec<WeightBias<Tensor>>; 4],
    norms: [Option<WeightBias<Tensor>>; 2],
}

impl<'a> Whole<'a> {
    pub(crate) fn new(params: &'a BlockParams<Tensor>) -> Whole<'a> {
        Whole {
            params,
            tiles: Default::default(),
            norms: [None, None],
        }
    }

    /// The gradients handed over, whole.
    pub(crate) fn grads(self) -> candle_core::Result<BlockParams<Tensor>> {
        let [norm_1, norm_2] = self.norms;
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
        })
    }
}

impl BlockSource for Whole<'_> {
    type Error = candle_core::Error;

    fn norm(&mut self, which: BlockNorm) -> candle_core::Result<WeightBias<Tensor>> {
        Ok(which.of(self.params).clone())
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
