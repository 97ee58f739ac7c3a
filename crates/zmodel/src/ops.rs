//! Differentiable building blocks with a backward that is really there.
//!
//! candle-nn's `ops::layer_norm`, `ops::softmax_last_dim` and the `LayerNorm`
//! module run as custom ops without a backward, so parameters behind them get no
//! gradient and no error. Here layer norm and GELU are fused custom ops that carry
//! their own backward (one pass each way instead of candle's many element-wise
//! ops; they were found hot with callgrind and perf), vectorised and split over
//! threads, and cross-entropy is composed from primitive ops. The max subtracted
//! for stability is detached (the result does not depend on it), which spares
//! backward that work. Every one of them is checked against finite differences,
//! and the fused ones against the composed reference.

use std::mem::MaybeUninit;

use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Storage, Tensor, D,
};
use rayon::prelude::*;

use crate::simd::{
    assume_init, bf16_rows_buffer, par_rows, par_rows_bf16, par_rows_bf16_mapped, par_rows_summed,
    sigmoid, uninit_floats, vectorised, ROWS_PER_TASK,
};

/// GELU (GPT-2's tanh approximation) as one fused pass forward and one backward.
///
/// candle's own `gelu` is right but slow on the CPU: its backward alone runs
/// about ten element-wise passes including two `powf`, and with `tanhf` and
/// `expm1f` that was a fifth of all instructions in a training step (callgrind).
/// Here `0.5·v·(1 + tanh(u)) = v·σ(2u)`, the sigmoid from the vectorised
/// `exp` and a reciprocal without a division (a 16-lane divide held GELU to
/// half its speed), split over threads: one pass each way.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Gelu)
}

/// [`gelu`] without autograd, and its slope `gelu'(x)` beside it, in one
/// pass: what the block's own backward reads instead of GELU's input
/// ([`gelu_backward_by_slope`]: a multiply, where recomputing the slope from
/// the input, an exponential and a reciprocal an element, was 1.6% of a
/// step). The two share the exponential, so the forward pass costs a few
/// multiply-adds more and the slope takes the input's place in memory.
pub fn gelu_and_slope(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let x = x.contiguous()?;
    let (s, l) = x.storage_and_layout();
    let xs = cpu_f32("gelu", &s, l)?;
    let (mut y, mut slope) = (uninit_floats(xs.len()), uninit_floats(xs.len()));
    y.par_chunks_mut(ELEMS_PER_TASK)
        .zip(slope.par_chunks_mut(ELEMS_PER_TASK))
        .zip(xs.par_chunks(ELEMS_PER_TASK))
        .with_max_len(1)
        .for_each(|((y, slope), x)| gelu_and_slope_into(x, y, slope));
    // SAFETY: the chunks of y and slope match those of x; each element got a value.
    let (y, slope) = unsafe { (assume_init(y), assume_init(slope)) };
    let shape = l.shape().clone();
    Ok((
        Tensor::from_vec(y, shape.clone(), x.device())?,
        Tensor::from_vec(slope, shape, x.device())?,
    ))
}

/// GELU of `h` given in bf16 (the MLP expansion's output, stored rounded
/// as it is made, as PyTorch's autocast stores a bf16 matmul's), written
/// in bf16 as a `[rows, width]` tensor laid out for zgemm to read in place
/// (`simd::par_rows_bf16`): the MLP's projection is its only reader. Its
/// backward recomputes the slope from `h`
/// ([`gelu_backward_bf16_of_input`]), so forward and backward move 2 bytes
/// an element of `h` where an f32 `h` and a kept f32 slope moved 4 + 4 + 4
/// (the bf16 step 0.99-1.04x, 1.02x in the median of eight alternated
/// rounds, and a worker's peak memory 7-9% lower: PERFORMANCE's
/// fifty-second session). Each result is looked up by the input's bits
/// (`gelu_bits_of_bf16`: GELU of the widened value rounded, the bits the
/// computed op gave): 2.2x as fast as computing it, and the bf16 step
/// about 1.03x (the sixty-first session).
pub fn gelu_bf16_of_bf16(h: &Tensor) -> Result<Tensor> {
    let (s, l) = h.storage_and_layout();
    let (bits, rows, stride, width) = bf16_rows("gelu", &s, l)?;
    par_rows_bf16_mapped(bits, rows, stride, width, gelu_bits_of_bf16())
}

/// GELU of every bf16 value rounded to bf16, indexed by the input's bits
/// (each result in the low half of its word, as gathers read words): the
/// bits that rounding [`gelu_of`] of the widened value gives, made once.
fn gelu_bits_of_bf16() -> &'static [u32; 1 << 16] {
    static TABLE: std::sync::OnceLock<Box<[u32; 1 << 16]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        table_of_bf16(
            #[inline(always)]
            |v| u32::from(zgemm::bf16_bits(gelu_of(v))),
        )
    })
}

/// `f` of every bf16 value (widened), indexed by its bits, in the CPU's
/// widest build (the scalar code's bits on every path).
fn table_of_bf16<T: Copy + Default>(f: impl Fn(f32) -> T) -> Box<[T; 1 << 16]> {
    let mut table: Box<[T; 1 << 16]> = vec![T::default(); 1 << 16]
        .try_into()
        .unwrap_or_else(|_| unreachable!("2^16 values"));
    vectorised(
        #[inline(always)]
        || {
            for (b, out) in (0..=u16::MAX).zip(table.iter_mut()) {
                *out = f(zgemm::bf16_value(b));
            }
        },
    );
    table
}

/// GELU's backward for a layer whose products are bf16, from GELU's bf16
/// input `h`: `dx = dy · gelu'(h)` of `[n, k]` inputs, the slope looked up
/// by `h`'s bits (`gelu_slope_of_bf16`; the bits of [`gelu_backward`] on
/// the widened values), as
/// a [`RoundedGrad`] (the bits and column sums of rounding it with
/// [`bf16_with_column_sums`]), in one pass that leaves the layer's backward
/// nothing to round or sum.
pub fn gelu_backward_bf16_of_input(h: &Tensor, dy: &Tensor) -> Result<RoundedGrad> {
    let dy = dy.contiguous()?;
    let (hs, hl) = h.storage_and_layout();
    let (bits, rows, stride, k) = bf16_rows("gelu backward", &hs, hl)?;
    let (ds, dl) = dy.storage_and_layout();
    let dv = match &*ds {
        Storage::Cpu(ds) => f32_input("gelu backward", ds, dl)?,
        _ => candle_core::bail!("gelu backward: CPU tensors only"),
    };
    if dv.len() != rows * k {
        candle_core::bail!("gelu backward: {rows}x{k} inputs, {} gradients", dv.len());
    }
    let slope = gelu_slope_of_bf16();
    Ok(rounded_rows(
        rows,
        k,
        None,
        #[inline(always)]
        |i, out| {
            let (h, dy) = (&bits[i * stride..][..k], &dv[i * k..][..k]);
            #[cfg(target_arch = "x86_64")]
            if crate::lanes::times_looked_up(h, dy, out, slope) {
                return;
            }
            for ((o, &b), &g) in out.iter_mut().zip(h).zip(dy) {
                *o = g * slope[usize::from(b)];
            }
        },
    ))
}

/// GELU's slope at every bf16 value, indexed by its bits: the slope of
/// [`gelu_and_slope_of`] at the widened value, made once. A bf16 input
/// has only 2¹⁶ values, so its backward looks the slope up (gathered 16 at
/// a time from a table whose live part, the values activations take,
/// stays in L1) instead of an exponential and a reciprocal an element.
fn gelu_slope_of_bf16() -> &'static [f32; 1 << 16] {
    static TABLE: std::sync::OnceLock<Box<[f32; 1 << 16]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        table_of_bf16(
            #[inline(always)]
            |v| gelu_and_slope_of(v).1,
        )
    })
}

/// A CPU `BF16` tensor's rows: `(bits, rows, row stride, width)` of a
/// matrix whose last dimension is adjacent (a producer's padded rows).
fn bf16_rows<'a>(
    name: &str,
    s: &'a Storage,
    l: &Layout,
) -> Result<(&'a [u16], usize, usize, usize)> {
    use half::slice::HalfFloatSliceExt;
    let Storage::Cpu(CpuStorage::BF16(v)) = s else {
        candle_core::bail!("{name}: a bf16 CPU tensor expected");
    };
    let (rows, width, stride) = match (l.dims(), l.stride()) {
        ([rows, width], [rs, 1]) => (*rows, *width, *rs),
        _ if l.is_contiguous() => {
            let width = l.dims().last().copied().unwrap_or(1);
            (l.shape().elem_count() / width.max(1), width, width)
        }
        _ => candle_core::bail!("{name}: bf16 rows must have adjacent columns"),
    };
    let bits: &[u16] = v.reinterpret_cast();
    let bits = bits.get(l.start_offset()..).unwrap_or_default();
    if rows > 0 && bits.len() < (rows - 1) * stride + width {
        candle_core::bail!("{name}: {rows} rows of {width} at stride {stride} overrun the storage");
    }
    Ok((bits, rows, stride, width))
}

const GELU_K: f32 = 0.797_884_6; // sqrt(2 / pi)
const GELU_C: f32 = 0.044_715;
pub(crate) const GELU_2K: f32 = 2.0 * GELU_K;
pub(crate) const GELU_2KC: f32 = GELU_2K * GELU_C;
pub(crate) const GELU_6KC: f32 = 3.0 * GELU_2KC;

/// GELU of `x` into `y` and its slope into `slope`, element by element (the
/// bits of [`gelu_and_slope_of`]), in this CPU's widest vectors: on AVX2 and
/// AVX-512 the intrinsics of [`crate::lanes`], which keep several vectors'
/// chains in flight; elsewhere the loop compiled by [`vectorised`].
///
/// It calls [`vectorised`] itself rather than trusting its caller to: passed
/// by name to a row helper, a function is called through a compiler-made
/// `Fn::call` shim without `inline(always)`, and LLVM compiled the loop into
/// that shim as baseline code (a call to libm's `fmaf` for every multiply-add)
/// where the helper's AVX-512 build could not reach it: GELU's bf16 forward
/// was 15x slower than its f32 one, 57% of a bf16 step on a Sapphire Rapids.
#[inline(always)]
fn gelu_and_slope_into(x: &[f32], y: &mut [MaybeUninit<f32>], slope: &mut [MaybeUninit<f32>]) {
    #[cfg(target_arch = "x86_64")]
    if crate::lanes::gelu_and_slope(x, y, slope) {
        return;
    }
    vectorised(
        #[inline(always)]
        || {
            for ((y, d), &v) in y.iter_mut().zip(slope.iter_mut()).zip(x) {
                let (value, dv) = gelu_and_slope_of(v);
                y.write(value);
                d.write(dv);
            }
        },
    )
}

/// [`gelu_and_slope_into`] of a finished tile of a product (`zgemm`'s
/// [`zgemm::FinishedTile`]: the MLP expansion's output, GELU'd while it is
/// in L1 instead of in a pass of its own): GELU written over the tile's
/// values, its slope into `slope` at the same rows and columns (rows `srs`
/// apart). The same bits.
///
/// # Safety
///
/// The tile's elements are initialised and this caller's alone during the
/// call (as a `Finish` is handed them); `slope` is valid to write for the
/// tile's `rows` rows of `cols` at stride `srs`, overlapping nothing else
/// read or written meanwhile.
pub(crate) unsafe fn gelu_and_slope_of_tile(
    tile: &zgemm::FinishedTile,
    slope: *mut f32,
    srs: usize,
) {
    let zgemm::FinishedTile {
        ptr,
        rs,
        rows,
        cols,
        ..
    } = *tile;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the tile and `slope` (caller).
    if unsafe { crate::lanes::gelu_and_slope_tile(ptr, rs, rows, cols, slope, srs) } {
        return;
    }
    for i in 0..rows {
        // SAFETY: row i of the tile and of `slope`'s part (caller).
        let (row, out) = unsafe {
            (
                std::slice::from_raw_parts_mut(ptr.add(i * rs), cols),
                std::slice::from_raw_parts_mut(slope.add(i * srs), cols),
            )
        };
        for (v, d) in row.iter_mut().zip(out) {
            (*v, *d) = gelu_and_slope_of(*v);
        }
    }
}

/// [`gelu_backward_by_slope`] of a finished tile of a product (the MLP
/// projection's input gradient, multiplied by GELU's kept slope while it is
/// in L1): each element times the same element of `slope` (rows `srs`
/// apart), in place. The same bits.
///
/// # Safety
///
/// As [`gelu_and_slope_of_tile`]'s, `slope` valid to read.
pub(crate) unsafe fn times_slope_of_tile(
    tile: &zgemm::FinishedTile,
    slope: *const f32,
    srs: usize,
) {
    for i in 0..tile.rows {
        // SAFETY: row i of the tile and of `slope`'s part (caller).
        let (row, by) = unsafe {
            (
                std::slice::from_raw_parts_mut(tile.ptr.add(i * tile.rs), tile.cols),
                std::slice::from_raw_parts(slope.add(i * srs), tile.cols),
            )
        };
        vectorised(
            #[inline(always)]
            || row.iter_mut().zip(by).for_each(|(g, &d)| *g *= d),
        );
    }
}

/// GELU's tanh form written as a sigmoid: `0.5·v·(1 + tanh(u)) = v·σ(2u)`
/// with `2u = v·(2k + 2kc·v²)` (one exponential, one reciprocal).
#[inline(always)]
fn gelu_of(v: f32) -> f32 {
    gelu_and_slope_of(v).0
}

/// A custom op's contiguous f32 input.
pub(crate) fn f32_input<'a>(name: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{name}: input must be contiguous")))?;
    match s {
        CpuStorage::F32(v) => Ok(&v[start..end]),
        _ => Err(candle_core::Error::Msg(format!(
            "{name}: only f32 is implemented"
        ))),
    }
}

/// A contiguous f32 CPU tensor's values (for the ops that are plain
/// functions, without autograd).
pub(crate) fn cpu_f32<'a>(name: &str, s: &'a Storage, l: &Layout) -> Result<&'a [f32]> {
    match s {
        Storage::Cpu(s) => f32_input(name, s, l),
        _ => candle_core::bail!("{name}: CPU tensors only"),
    }
}

/// Elements per parallel task of the element-wise ops.
const ELEMS_PER_TASK: usize = 1 << 14;

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "zrun-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_input(self.name(), s, l)?;
        let mut y = uninit_floats(x.len());
        par_rows(
            x,
            &mut y,
            ELEMS_PER_TASK / ROWS_PER_TASK,
            #[inline(always)]
            |x, y| {
                for (o, &v) in y.iter_mut().zip(x) {
                    o.write(gelu_of(v));
                }
            },
        );
        // SAFETY: par_rows hands every element of y to the loop above.
        let y = unsafe { assume_init(y) };
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(gelu_backward(arg, grad_res)?))
    }
}

/// dx = dy · gelu'(x), element-wise in one pass (autograd's backward).
pub fn gelu_backward(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    x.contiguous()?
        .apply_op2_no_bwd(&dy.contiguous()?, &GeluGrad(SlopeFrom::Input))
}

/// dx = dy · slope, from the slope [`gelu_and_slope`] kept: the same bits as
/// [`gelu_backward`] on GELU's input, at the cost of a multiply.
pub fn gelu_backward_by_slope(slope: &Tensor, dy: &Tensor) -> Result<Tensor> {
    slope
        .contiguous()?
        .apply_op2_no_bwd(&dy.contiguous()?, &GeluGrad(SlopeFrom::Kept))
}

/// `gelu(v)` and `gelu'(v)`: with `s = σ(2u)`, `gelu(v) = v·s` and
/// `d(v·s)/dv = s + v·s·(1 - s)·(2u)' = s·(1 + v·(1 - s)·(2k + 6kc·v²))`.
/// Every backward multiplies the gradient by this slope, computed here from
/// the input or kept by the forward: the same bits either way.
#[inline(always)]
pub(crate) fn gelu_and_slope_of(v: f32) -> (f32, f32) {
    let v2 = v * v;
    let s = sigmoid(v * v2.mul_add(GELU_2KC, GELU_2K));
    (
        v * s,
        s.mul_add(v * (1.0 - s) * v2.mul_add(GELU_6KC, GELU_2K), s),
    )
}

/// Where [`GeluGrad`]'s first operand's values give the slope.
#[derive(Clone, Copy, PartialEq)]
enum SlopeFrom {
    /// They are GELU's input: the slope is computed.
    Input,
    /// They are the slope, kept by [`gelu_and_slope`].
    Kept,
}

struct GeluGrad(SlopeFrom);

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "zrun-gelu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_input(self.name(), s1, l1)?;
        let dy = f32_input(self.name(), s2, l2)?;
        if x.len() != dy.len() {
            candle_core::bail!("gelu backward: {} inputs, {} gradients", x.len(), dy.len());
        }
        let from = self.0;
        let mut dx = uninit_floats(x.len());
        dx.par_chunks_mut(ELEMS_PER_TASK)
            .zip(
                x.par_chunks(ELEMS_PER_TASK)
                    .zip(dy.par_chunks(ELEMS_PER_TASK)),
            )
            .with_max_len(1)
            .for_each(|(dx, (x, dy))| {
                vectorised(
                    #[inline(always)]
                    || {
                        let pairs = dx.iter_mut().zip(x).zip(dy);
                        if from == SlopeFrom::Input {
                            for ((o, &v), &g) in pairs {
                                o.write(g * gelu_and_slope_of(v).1);
                            }
                        } else {
                            for ((o, &d), &g) in pairs {
                                o.write(g * d);
                            }
                        }
                    },
                )
            });
        // SAFETY: the chunks of dx match those of x, and each element got a value.
        let dx = unsafe { assume_init(dx) };
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}

/// Layer norm over the last dimension with weight and bias, fused: one pass per
/// row forward, one backward that also sums dw and db (the composed version
/// below runs about nine passes forward and twenty backward, each a separate
/// candle op). Rows are split over threads.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op3(
        &w.contiguous()?,
        &b.contiguous()?,
        LayerNorm { eps: eps as f32 },
    )
}

/// [`layer_norm`] with its output rounded to bf16 (a `BF16` tensor
/// `[rows, d]`, laid out for zgemm to read in place), for a
/// norm whose only readers are bf16 products (a block's q, k, v projection
/// and MLP under `train.dtype: bf16` with native bf16): the bits they would have
/// rounded the f32 output to, in half the bytes written, kept and read
/// (forward, and again as the weight gradient's `xᵀ`), and no rounding pass
/// of their own. No backward: the explicit one reads the norm's input.
pub fn layer_norm_bf16(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let (x, w, b) = (x.contiguous()?, w.contiguous()?, b.contiguous()?);
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (bs, bl) = b.storage_and_layout();
    let (x, w, b) = (
        cpu_f32("layer norm", &xs, xl)?,
        cpu_f32("layer norm", &ws, wl)?,
        cpu_f32("layer norm", &bs, bl)?,
    );
    let d = w.len();
    if d == 0 || !x.len().is_multiple_of(d) || b.len() != d {
        candle_core::bail!(
            "layer norm: rows of {} do not match a weight of {d}",
            x.len()
        );
    }
    let eps = eps as f32;
    par_rows_bf16(
        x,
        (d, d),
        #[inline(always)]
        |row, out| {
            let (mean, rstd) = row_stats(row, eps);
            write_row(out, None, [row, w, b], |[v, w, b]| {
                (v - mean) * rstd * w + b
            });
        },
    )
}

/// Σ `f` of the values at each index of `cols` (over the shortest) in a
/// fixed order that the compiler can vectorise and that does not depend on
/// the CPU: 32 interleaved partial sums over whole runs of 32 values, the
/// runs of 8 after them into the first 8, those folded in a fixed tree, then
/// the last few values one by one. One vector of partial sums was one chain
/// of dependent adds, each waiting out the last's latency: half of layer
/// norm's time at d = 384. The columns are read as fixed-size arrays: an
/// index closure (`|i| row[i]`) kept a bounds check per value and compiled
/// to scalar adds.
#[inline(always)]
pub(crate) fn sum_lanes<const N: usize>(cols: [&[f32]; N], f: impl Fn([f32; N]) -> f32) -> f32 {
    let n = cols.iter().map(|c| c.len()).min().unwrap_or(0);
    let mut acc = [0f32; 32];
    let runs: [&[[f32; 32]]; N] = cols.map(|c| c[..n].as_chunks::<32>().0);
    let long = n / 32 * 32;
    (0..n / 32).for_each(|i| {
        let v: [&[f32; 32]; N] = std::array::from_fn(|k| &runs[k][i]);
        for (l, a) in acc.iter_mut().enumerate() {
            *a += f(std::array::from_fn(|k| v[k][l]));
        }
    });
    let eights: [&[[f32; 8]]; N] = cols.map(|c| c[long..n].as_chunks::<8>().0);
    let short = (n - long) / 8;
    (0..short).for_each(|i| {
        let v: [&[f32; 8]; N] = std::array::from_fn(|k| &eights[k][i]);
        for (l, a) in acc[..8].iter_mut().enumerate() {
            *a += f(std::array::from_fn(|k| v[k][l]));
        }
    });
    let a8: [f32; 8] = std::array::from_fn(|l| (acc[l] + acc[l + 16]) + (acc[l + 8] + acc[l + 24]));
    let total = ((a8[0] + a8[4]) + (a8[1] + a8[5])) + ((a8[2] + a8[6]) + (a8[3] + a8[7]));
    (long + 8 * short..n).fold(total, |t, i| t + f(std::array::from_fn(|k| cols[k][i])))
}

/// The largest value of `row` that is not NaN (−∞ when none), in 8
/// interleaved lanes, so that the compiler can vectorise it; a maximum is
/// exact, so the order changes nothing. The compare is `v > m`, one
/// `vmaxps` a vector: `f32::max` also orders NaN and compiled to a max, a
/// compare and a blend in the chain of each lane. (32 lanes, as
/// [`sum_lanes`] has, were slower on attention's rows, 1 to 256 long: a
/// longer tail and a wider fold for each.)
#[inline(always)]
pub(crate) fn max_lanes(row: &[f32]) -> f32 {
    let larger = |m: f32, v: f32| if v > m { v } else { m };
    let mut acc = [f32::NEG_INFINITY; 8];
    let (runs, tail) = row.as_chunks::<8>();
    for run in runs {
        for (a, &v) in acc.iter_mut().zip(run) {
            *a = larger(*a, v);
        }
    }
    tail.iter()
        .fold(acc.into_iter().fold(f32::NEG_INFINITY, larger), |m, &v| {
            larger(m, v)
        })
}

/// Mean and 1/std of one row.
#[inline(always)]
fn row_stats(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = sum_lanes([row], |[v]| v) / n;
    let var = sum_lanes([row], |[v]| (v - mean) * (v - mean)) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

struct LayerNorm {
    eps: f32,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "zrun-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_input(self.name(), s1, l1)?;
        let (w, b) = (
            f32_input(self.name(), s2, l2)?,
            f32_input(self.name(), s3, l3)?,
        );
        let d = w.len();
        if d == 0 || !x.len().is_multiple_of(d) || b.len() != d {
            candle_core::bail!(
                "layer norm: rows of {} do not match a weight of {d}",
                x.len()
            );
        }
        let mut y = uninit_floats(x.len());
        par_rows(
            x,
            &mut y,
            d,
            #[inline(always)]
            |x, y| {
                for (row, out) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
                    let (mean, rstd) = row_stats(row, self.eps);
                    write_row(out, None, [row, w, b], |[v, w, b]| {
                        (v - mean) * rstd * w + b
                    });
                }
            },
        );
        // SAFETY: the rows cover x, and so y (same length), whole.
        let y = unsafe { assume_init(y) };
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = layer_norm_backward(x, w, dy, f64::from(self.eps), None)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// Layer norm's (dx, dw, db) from its input, weight and output gradient;
/// with a `residual` (the gradient that reaches the norm's input around the
/// block's branch), dx is `residual + dx`, summed in the same pass.
pub fn layer_norm_backward(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    eps: f64,
    residual: Option<&Tensor>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let d = w.dim(0)?;
    let rows = x.elem_count() / d;
    let op = LayerNormGrad {
        w: w.flatten_all()?.to_vec1::<f32>()?,
        eps: eps as f32,
    };
    // One op computes [dx rows; dw; db].
    let all = op.apply(x, dy, residual)?;
    let dx = all.narrow(0, 0, rows)?.reshape(x.shape())?;
    let dw = all.narrow(0, rows, 1)?.reshape(d)?;
    let db = all.narrow(0, rows + 1, 1)?.reshape(d)?;
    Ok((dx, dw, db))
}

/// Σ over rows of a `[n, k]` matrix: `[k]`. Tasks of `ROWS_PER_TASK` rows sum
/// their part; the parts are added in order (the same bits for any thread count).
pub fn column_sums(m: &Tensor) -> Result<Tensor> {
    m.contiguous()?.apply_op1_no_bwd(&ColumnSums)
}

struct ColumnSums;

impl CustomOp1 for ColumnSums {
    fn name(&self) -> &'static str {
        "zrun-column-sums"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let m = f32_input(self.name(), s, l)?;
        let (_, k) = l.shape().dims2()?;
        let per = ROWS_PER_TASK * k;
        let parts: Vec<Vec<f32>> = m
            .par_chunks(per)
            .with_max_len(1)
            .map(|rows| {
                vectorised(
                    #[inline(always)]
                    || {
                        let mut acc = vec![0f32; k];
                        for row in rows.chunks_exact(k) {
                            acc.iter_mut().zip(row).for_each(|(a, v)| *a += v);
                        }
                        acc
                    },
                )
            })
            .collect();
        let mut out = vec![0f32; k];
        for p in &parts {
            out.iter_mut().zip(p).for_each(|(o, v)| *o += v);
        }
        Ok((CpuStorage::F32(out), Shape::from_dims(&[k])))
    }
}

/// A layer's output gradient as bf16 products read it: its values rounded
/// to bf16 (zgemm's rounding, as bits), `rows × width` laid out for the
/// products to read in place (rows from a 64-byte line, at
/// [`zgemm::bf16_row_stride`]), and its column sums in f32 as
/// [`column_sums`] adds them (the bias gradient, to the bit).
#[derive(Debug, Clone)]
pub struct RoundedGrad {
    /// The buffer; the values start at `start`, rows `stride` apart.
    bits: Vec<u16>,
    start: usize,
    stride: usize,
    rows: usize,
    width: usize,
    /// Σ over rows of the f32 values, per column.
    sums: Vec<f32>,
}

impl RoundedGrad {
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Columns `c0..c0 + c` of every row, as a product's operand.
    pub fn columns(&self, c0: usize, c: usize) -> Result<zgemm::MatRef<'_, u16>> {
        if c0 + c > self.width {
            candle_core::bail!("columns {c0}..{} of a {}-wide gradient", c0 + c, self.width);
        }
        zgemm::MatRef::new(&self.bits[self.start + c0..], self.rows, c, self.stride, 1)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))
    }

    /// Σ over rows of the f32 values, per column.
    pub fn sums(&self) -> &[f32] {
        &self.sums
    }

    /// Row `i`'s values.
    pub fn row(&self, i: usize) -> &[u16] {
        &self.bits[self.start + i * self.stride..][..self.width]
    }
}

/// `rows` rows of `k` values, row `i` made in f32 by `row(i, out)` (or,
/// with `given`, read from its rows in place), stored rounded, with their
/// column sums: tasks of [`ROWS_PER_TASK`] rows each sum theirs, and the
/// parts are added in task order (the same bits as [`column_sums`], for any
/// thread count).
fn rounded_rows(
    rows: usize,
    k: usize,
    given: Option<&[f32]>,
    row: impl Fn(usize, &mut [f32]) + Sync,
) -> RoundedGrad {
    let (mut bits, start, stride) = bf16_rows_buffer(rows, k);
    let sums = par_rows_summed(
        &mut bits[start..start + rows * stride],
        stride,
        k,
        #[inline(always)]
        |rows, out, acc| {
            let mut made = vec![0f32; if given.is_some() { 0 } else { k }];
            for (i, out) in rows.zip(out.chunks_exact_mut(stride)) {
                let values: &[f32] = match given {
                    Some(m) => &m[i * k..][..k],
                    None => {
                        row(i, &mut made);
                        &made
                    }
                };
                acc.iter_mut().zip(values).for_each(|(a, v)| *a += v);
                let (out, pad) = out.split_at_mut(k);
                zgemm::bf16_bits_write(values, out);
                for o in pad {
                    o.write(0);
                }
            }
        },
    );
    // SAFETY: the head, the tail and every row with its padding were
    // written above.
    let bits = unsafe { assume_init(bits) };
    RoundedGrad {
        bits,
        start,
        stride,
        rows,
        width: k,
        sums,
    }
}

/// `m` (`[n, k]`, row-major f32) as a [`RoundedGrad`], in one pass: a
/// linear layer's output gradient under bf16 products, which both of its
/// backward products then read in half the bytes, with nothing left to
/// round and no pass of their own for the bias gradient.
pub fn bf16_with_column_sums(m: &[f32], k: usize) -> Result<RoundedGrad> {
    if k == 0 || !m.len().is_multiple_of(k) {
        candle_core::bail!("bf16 rounding: {} values are not rows of {k}", m.len());
    }
    // Rows read in place: a copy of each first cost 1.1% of a bf16 step.
    Ok(rounded_rows(m.len() / k, k, Some(m), |_, _| {}))
}

/// Layer norm's backward from (x, dy), or (x, dy, residual): `[rows + 2, d]`
/// holding dx (`rstd · (g - mean(g) - xhat · mean(g · xhat))` with
/// `g = dy · w`, plus the residual's row), then dw = Σ dy · xhat and db = Σ dy
/// over rows. Each task of `ROWS_PER_TASK` rows sums its own dw, db; the
/// partial sums are added in task order.
struct LayerNormGrad {
    w: Vec<f32>,
    eps: f32,
}

impl LayerNormGrad {
    const NAME: &'static str = "zrun-layer-norm-grad";

    fn run(&self, x: &[f32], dy: &[f32], residual: Option<&[f32]>) -> Result<(CpuStorage, Shape)> {
        let (w, d) = (&self.w, self.w.len());
        if x.len() != dy.len()
            || d == 0
            || !x.len().is_multiple_of(d)
            || residual.is_some_and(|r| r.len() != x.len())
        {
            candle_core::bail!("layer norm backward: shapes disagree");
        }
        let rows = x.len() / d;
        let mut out = uninit_floats(x.len() + 2 * d);
        let (dx, tail) = out.split_at_mut(x.len());
        // dw then db.
        let sums = par_rows_summed(
            dx,
            d,
            2 * d,
            #[inline(always)]
            |rows, dx, sums| {
                let span = rows.start * d..rows.end * d;
                let (x, dy) = (&x[span.clone()], &dy[span.clone()]);
                let residual = residual.map(|r| &r[span]);
                let (dw, db) = sums.split_at_mut(d);
                let (mut xhat, mut g) = (vec![0f32; d], vec![0f32; d]);
                for (r, (row, out)) in x.chunks_exact(d).zip(dx.chunks_exact_mut(d)).enumerate() {
                    let dyr = &dy[r * d..][..d];
                    let (mean, rstd) = row_stats(row, self.eps);
                    let each = xhat.iter_mut().zip(g.iter_mut());
                    let sums = dw.iter_mut().zip(db.iter_mut());
                    let inputs = row.iter().zip(dyr).zip(w);
                    for (((xh, g), (dw, db)), ((&v, &dy), &w)) in each.zip(sums).zip(inputs) {
                        *xh = (v - mean) * rstd;
                        *g = dy * w;
                        *dw += dy * *xh;
                        *db += dy;
                    }
                    let g_mean = sum_lanes([&g], |[g]| g) / d as f32;
                    let gx_mean = sum_lanes([&g, &xhat], |[g, xh]| g * xh) / d as f32;
                    write_row(
                        out,
                        residual.map(|res| &res[r * d..][..d]),
                        [&g, &xhat],
                        |[g, xh]| rstd * (g - g_mean - xh * gx_mean),
                    );
                }
            },
        );
        write_row(tail, None, [&sums], |[v]| v);
        // SAFETY: the tasks wrote every row of dx, and the sums the tail.
        let out = unsafe { assume_init(out) };
        Ok((CpuStorage::F32(out), Shape::from_dims(&[rows + 2, d])))
    }
}

/// Writes a row of an op's output: `f` of the values at each index of
/// `cols`, or `residual[i] + f(…)` (the order in which a separate add of the
/// residual summed them). The columns are cut to the row's length first, so
/// that the loop has no bounds checks left and vectorises.
#[inline(always)]
pub(crate) fn write_row<const N: usize>(
    out: &mut [MaybeUninit<f32>],
    residual: Option<&[f32]>,
    cols: [&[f32]; N],
    f: impl Fn([f32; N]) -> f32,
) {
    let n = out.len();
    let cols = cols.map(|c| &c[..n]);
    match residual {
        Some(res) => {
            let res = &res[..n];
            for i in 0..n {
                out[i].write(res[i] + f(std::array::from_fn(|k| cols[k][i])));
            }
        }
        None => {
            for i in 0..n {
                out[i].write(f(std::array::from_fn(|k| cols[k][i])));
            }
        }
    }
}

/// A norm's backward as candle ops over its `run(x, dy, residual)`: two
/// inputs `(x, dy)`, or three with the residual gradient added to dx, and
/// `apply`, which picks between them.
macro_rules! norm_backward_ops {
    ($op:ty) => {
        impl $op {
            /// The op over contiguous `x`, `dy` (and `residual`).
            fn apply(
                &self,
                x: &candle_core::Tensor,
                dy: &candle_core::Tensor,
                residual: Option<&candle_core::Tensor>,
            ) -> candle_core::Result<candle_core::Tensor> {
                let (x, dy) = (x.contiguous()?, dy.contiguous()?);
                match residual {
                    Some(r) => x.apply_op3_no_bwd(&dy, &r.contiguous()?, self),
                    None => x.apply_op2_no_bwd(&dy, self),
                }
            }
        }

        impl candle_core::CustomOp2 for $op {
            fn name(&self) -> &'static str {
                Self::NAME
            }

            fn cpu_fwd(
                &self,
                s1: &candle_core::CpuStorage,
                l1: &candle_core::Layout,
                s2: &candle_core::CpuStorage,
                l2: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
                use $crate::ops::f32_input;
                self.run(
                    f32_input(Self::NAME, s1, l1)?,
                    f32_input(Self::NAME, s2, l2)?,
                    None,
                )
            }
        }

        impl candle_core::CustomOp3 for $op {
            fn name(&self) -> &'static str {
                Self::NAME
            }

            fn cpu_fwd(
                &self,
                s1: &candle_core::CpuStorage,
                l1: &candle_core::Layout,
                s2: &candle_core::CpuStorage,
                l2: &candle_core::Layout,
                s3: &candle_core::CpuStorage,
                l3: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
                use $crate::ops::f32_input;
                self.run(
                    f32_input(Self::NAME, s1, l1)?,
                    f32_input(Self::NAME, s2, l2)?,
                    Some(f32_input(Self::NAME, s3, l3)?),
                )
            }
        }
    };
}
pub(crate) use norm_backward_ops;

norm_backward_ops!(LayerNormGrad);

/// Layer norm composed from candle primitives (the reference the fused op is
/// tested against).
pub fn layer_norm_composed(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xn = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    xn.broadcast_mul(w)?.broadcast_add(b)
}

/// Mean cross-entropy of `logits` `[n, vocab]` against `targets` `[n]` (u32).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let logp = shifted.broadcast_sub(&lse)?;
    let picked = logp.gather(&targets.unsqueeze(1)?, 1)?;
    let n = targets.dim(0)? as f64;
    picked.sum_all()?.affine(-1.0 / n, 0.0)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Central finite differences of `f` at `x`, against candle's gradient.
    fn check_grad(f: impl Fn(&Tensor) -> Result<Tensor>, x: Vec<f32>, shape: &[usize]) {
        let dev = Device::Cpu;
        let v = Var::from_vec(x.clone(), shape, &dev).unwrap();
        let g = f(v.as_tensor()).unwrap().backward().unwrap();
        let g = g
            .get(v.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let h = 1e-2f32;
        for i in 0..x.len() {
            let eval = |d: f32| {
                let mut y = x.clone();
                y[i] += d;
                let t = Tensor::from_vec(y, shape, &dev).unwrap();
                f(&t).unwrap().to_scalar::<f32>().unwrap()
            };
            let fd = (eval(h) - eval(-h)) / (2.0 * h);
            assert!(
                (fd - g[i]).abs() < 2e-2 * (1.0 + fd.abs()),
                "element {i}: fd {fd} vs grad {}",
                g[i]
            );
        }
    }

    fn weights(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) / 4.0).collect()
    }

    #[test]
    fn fused_layer_norm_matches_the_composed_one() {
        let dev = Device::Cpu;
        // 50 rows: several parallel tasks, whose dw and db partial sums add up.
        let xs: Vec<f32> = (0..600)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.3)
            .collect();
        let w = Var::from_vec(
            (0..12).map(|i| 0.5 + i as f32 * 0.1).collect::<Vec<_>>(),
            (12,),
            &dev,
        )
        .unwrap();
        let b = Var::from_vec(
            (0..12).map(|i| i as f32 * 0.05 - 0.2).collect::<Vec<_>>(),
            (12,),
            &dev,
        )
        .unwrap();
        let x = Var::from_vec(xs, (50, 12), &dev).unwrap();
        let probe = Tensor::from_vec(weights(600), (50, 12), &dev).unwrap();
        let run = |f: &dyn Fn(&Tensor, &Tensor, &Tensor, f64) -> Result<Tensor>| {
            let y = f(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
            let g = y
                .mul(&probe)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (
                v(&y),
                v(g.get(x.as_tensor()).unwrap()),
                v(g.get(w.as_tensor()).unwrap()),
                v(g.get(b.as_tensor()).unwrap()),
            )
        };
        let (a, b2) = (run(&layer_norm), run(&layer_norm_composed));
        for (u, v) in [(a.0, b2.0), (a.1, b2.1), (a.2, b2.2), (a.3, b2.3)] {
            for (p, q) in u.iter().zip(&v) {
                assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
            }
        }
    }

    #[test]
    fn a_residual_in_the_norm_backward_gives_the_bits_of_adding_it_after() {
        // 50 rows (several tasks), 12 wide (a run of 8 and a tail): dx with
        // the residual summed in must be r + dx of the plain backward, bit
        // for bit, and dw, db unchanged.
        let dev = Device::Cpu;
        let t = |seed: usize, n: usize, shape: &[usize]| {
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 37 + seed * 11) % 23) as f32 * 0.3 - 3.1)
                .collect();
            Tensor::from_vec(v, shape, &dev).unwrap()
        };
        let (x, dy, r) = (
            t(1, 600, &[50, 12]),
            t(2, 600, &[50, 12]),
            t(3, 600, &[50, 12]),
        );
        let w = t(4, 12, &[12]);
        let bits = |t: &Tensor| {
            t.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        let (dx, dw, db) = layer_norm_backward(&x, &w, &dy, 1e-5, None).unwrap();
        let (dx_r, dw_r, db_r) = layer_norm_backward(&x, &w, &dy, 1e-5, Some(&r)).unwrap();
        assert_eq!(bits(&dx_r), bits(&(&r + &dx).unwrap()));
        assert_eq!((bits(&dw_r), bits(&db_r)), (bits(&dw), bits(&db)));
        assert_ne!(bits(&dx_r), bits(&dx));
        let (dx, dw) = crate::llama_ops::rms_norm_backward(&x, &w, &dy, 1e-5, None).unwrap();
        let (dx_r, dw_r) =
            crate::llama_ops::rms_norm_backward(&x, &w, &dy, 1e-5, Some(&r)).unwrap();
        assert_eq!(bits(&dx_r), bits(&(&r + &dx).unwrap()));
        assert_eq!(bits(&dw_r), bits(&dw));
        // A residual of another size is refused, not read past.
        let short = t(5, 12, &[1, 12]);
        assert!(layer_norm_backward(&x, &w, &dy, 1e-5, Some(&short)).is_err());
        assert!(crate::llama_ops::rms_norm_backward(&x, &w, &dy, 1e-5, Some(&short)).is_err());
    }

    /// Layer norm's backward is its formula row by row, each sum in
    /// `sum_lanes`' order, to the bit: widths of whole runs of 32, with
    /// runs of 8 after them, with a tail, and shorter than a run; rows past
    /// a task (dw and db add the tasks' parts in order); with and without
    /// the residual.
    #[test]
    fn layer_norm_backward_is_its_formula_row_by_row_to_the_bit() {
        let dev = Device::Cpu;
        let eps = 1e-5f32;
        for d in [384usize, 100, 77, 5] {
            let rows = 2 * ROWS_PER_TASK + 3;
            let vals = |salt: usize, n: usize| -> Vec<f32> {
                (0..n)
                    .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 - 1001.0) / 337.0)
                    .collect()
            };
            let (x, dy, w, res) = (
                vals(1, rows * d),
                vals(2, rows * d),
                vals(3, d),
                vals(4, rows * d),
            );
            let tensor = |v: &[f32], n: usize| Tensor::from_vec(v.to_vec(), (n, d), &dev).unwrap();
            let wt = Tensor::from_vec(w.clone(), d, &dev).unwrap();
            for with_res in [false, true] {
                let residual = with_res.then(|| tensor(&res, rows));
                let (dx, dw, db) = layer_norm_backward(
                    &tensor(&x, rows),
                    &wt,
                    &tensor(&dy, rows),
                    f64::from(eps),
                    residual.as_ref(),
                )
                .unwrap();
                let mut want_dx = vec![0f32; rows * d];
                let (mut want_dw, mut want_db) = (vec![0f32; d], vec![0f32; d]);
                for task in (0..rows).step_by(ROWS_PER_TASK) {
                    let (mut pw, mut pb) = (vec![0f32; d], vec![0f32; d]);
                    for r in task..(task + ROWS_PER_TASK).min(rows) {
                        let row = &x[r * d..][..d];
                        let dyr = &dy[r * d..][..d];
                        let (mean, rstd) = row_stats(row, eps);
                        let xhat: Vec<f32> = row.iter().map(|&v| (v - mean) * rstd).collect();
                        let g: Vec<f32> = dyr.iter().zip(&w).map(|(&dy, &w)| dy * w).collect();
                        for c in 0..d {
                            pw[c] += dyr[c] * xhat[c];
                            pb[c] += dyr[c];
                        }
                        let g_mean = sum_lanes([&g], |[g]| g) / d as f32;
                        let gx_mean = sum_lanes([&g, &xhat], |[g, xh]| g * xh) / d as f32;
                        for c in 0..d {
                            let v = rstd * (g[c] - g_mean - xhat[c] * gx_mean);
                            want_dx[r * d + c] = if with_res { res[r * d + c] + v } else { v };
                        }
                    }
                    want_dw.iter_mut().zip(&pw).for_each(|(t, v)| *t += v);
                    want_db.iter_mut().zip(&pb).for_each(|(t, v)| *t += v);
                }
                let bits = |t: &Tensor| -> Vec<u32> {
                    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    v.into_iter().map(f32::to_bits).collect()
                };
                let want = |v: &[f32]| -> Vec<u32> { v.iter().map(|x| x.to_bits()).collect() };
                assert_eq!(bits(&dx), want(&want_dx), "dx, d {d}, residual {with_res}");
                assert_eq!(bits(&dw), want(&want_dw), "dw, d {d}");
                assert_eq!(bits(&db), want(&want_db), "db, d {d}");
            }
        }
    }

    #[test]
    fn layer_norm_grads_match_finite_differences() {
        let dev = Device::Cpu;
        let w = Tensor::new(&[0.5f32, 1.5, -1.0, 2.0], &dev).unwrap();
        let b = Tensor::new(&[0.1f32, 0.2, 0.3, 0.4], &dev).unwrap();
        let probe = Tensor::from_vec(weights(12), (3, 4), &dev).unwrap();
        check_grad(
            |x| layer_norm(x, &w, &b, 1e-5)?.mul(&probe)?.sum_all(),
            weights(12),
            &[3, 4],
        );
        // And with respect to the weight.
        let x = Tensor::from_vec(weights(12), (3, 4), &dev).unwrap();
        check_grad(
            |w| layer_norm(&x, w, &b, 1e-5)?.mul(&probe)?.sum_all(),
            vec![0.5, 1.5, -1.0, 2.0],
            &[4],
        );
    }

    #[test]
    fn cross_entropy_grads_match_finite_differences() {
        let dev = Device::Cpu;
        let t = Tensor::new(&[3u32, 0], &dev).unwrap();
        check_grad(|x| cross_entropy(x, &t), weights(10), &[2, 5]);
    }

    #[test]
    fn gelu_in_bf16_is_gelu_of_the_bf16_input_rounded_as_bf16_products_round() {
        // Lengths past a task and with a tail of its 256-value blocks;
        // NaN, ±inf and values whose GELU rounds on a tie among them.
        let n = (1 << 14) + 300;
        let mut xs: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 2001) as f32 / 100.0 - 10.0)
            .collect();
        for (i, special) in [
            f32::from_bits(0x7fff_ffff),
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
        ]
        .into_iter()
        .enumerate()
        {
            xs[257 * i + 3] = special;
        }
        // And every bf16 value (the forward looks its result up by the
        // input's bits): NaNs, infinities, subnormals, both zeros.
        xs.extend((0..=u16::MAX).map(zgemm::bf16_value));
        let h = Tensor::from_vec(xs.clone(), (xs.len(),), &Device::Cpu)
            .unwrap()
            .to_dtype(candle_core::DType::BF16)
            .unwrap();
        let widened = h.to_dtype(candle_core::DType::F32).unwrap();
        // NaN stays NaN, its sign as the compiler orders the operands.
        let nan_as_one = |b: u16| if b & 0x7fff > 0x7f80 { 0x7fc0 } else { b };
        let want: Vec<u16> = gelu(&widened)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(|v| nan_as_one(zgemm::bf16_bits(v)))
            .collect();
        let values =
            |t: &Tensor| -> Vec<u16> { bf16_bits_of(t).into_iter().map(nan_as_one).collect() };
        assert_eq!(values(&gelu_bf16_of_bf16(&h).unwrap()), want);
        // Rows of 1536 (3072 bytes) are laid out 1568 apart, from a line,
        // for the products to read in place; the input's rows are read
        // where they are (here 1568 apart too): the values are the same.
        let rows = h
            .narrow(0, 0, 3 * 1536)
            .unwrap()
            .reshape((3, 1536))
            .unwrap();
        let got = gelu_bf16_of_bf16(&rows).unwrap();
        assert_eq!(got.dims(), &[3, 1536]);
        assert_eq!(got.layout().stride(), &[1568, 1]);
        assert_eq!(values(&got), want[..3 * 1536]);
        let strided = gelu_bf16_of_bf16(&got).unwrap();
        assert_eq!(strided.dims(), &[3, 1536]);
        let again = gelu_bf16_of_bf16(&got.contiguous().unwrap()).unwrap();
        assert_eq!(values(&strided), values(&again));
        // Only bf16 input.
        assert!(gelu_bf16_of_bf16(&widened).is_err());
    }

    /// The bits of a BF16 tensor.
    pub(crate) fn bf16_bits_of(t: &Tensor) -> Vec<u16> {
        assert_eq!(t.dtype(), candle_core::DType::BF16);
        t.flatten_all()
            .unwrap()
            .to_vec1::<half::bf16>()
            .unwrap()
            .into_iter()
            .map(half::bf16::to_bits)
            .collect()
    }

    /// `t`'s f32 values rounded as bf16 products round them.
    pub(crate) fn rounded(t: &Tensor) -> Vec<u16> {
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v.into_iter().map(zgemm::bf16_bits).collect()
    }

    #[test]
    fn layer_norm_in_bf16_is_layer_norm_rounded_as_bf16_products_round() {
        let dev = Device::Cpu;
        // 37 rows of 44: several tasks, a last short one, rows with a tail
        // after the runs of 32 and 8.
        let (rows, d) = (37, 44);
        let x = Tensor::from_vec(weights(rows * d), (rows, d), &dev).unwrap();
        let w = Tensor::from_vec(weights(d + 3)[3..].to_vec(), d, &dev).unwrap();
        let b = Tensor::from_vec(weights(d + 1)[1..].to_vec(), d, &dev).unwrap();
        let want = rounded(&layer_norm(&x, &w, &b, 1e-5).unwrap());
        assert_eq!(
            bf16_bits_of(&layer_norm_bf16(&x, &w, &b, 1e-5).unwrap()),
            want
        );
    }

    #[test]
    fn a_gradient_in_bf16_keeps_the_bits_and_the_column_sums() {
        let dev = Device::Cpu;
        let (rows, k) = (53, 40);
        let mut m: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 7919) % 2001) as f32 / 300.0 - 3.3)
            .collect();
        m[5] = f32::NAN;
        m[77] = f32::INFINITY;
        let got = bf16_with_column_sums(&m, k).unwrap();
        assert_eq!((got.rows(), got.width()), (rows, k));
        let bits: Vec<u16> = (0..rows).flat_map(|i| got.row(i).to_vec()).collect();
        let sums = got.sums().to_vec();
        assert!(got.columns(0, k + 1).is_err());
        assert_eq!(
            bits,
            m.iter().map(|&v| zgemm::bf16_bits(v)).collect::<Vec<_>>()
        );
        let t = Tensor::from_vec(m, (rows, k), &dev).unwrap();
        let want = column_sums(&t).unwrap().to_vec1::<f32>().unwrap();
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same(&sums, &want), "{sums:?} vs {want:?}");
        assert!(bf16_with_column_sums(&[1.0; 10], 3).is_err());
    }

    /// GELU's bf16 backward looks its slope up by the input's bits: for
    /// every bf16 value (NaNs, infinities, subnormals and both zeros among
    /// them) it is the f32 backward's on the widened value, rounded with
    /// its column sums, bit for bit (NaNs as NaNs).
    #[test]
    fn bf16_gelu_backward_gives_the_f32_ops_bits_for_every_bf16_value() {
        let dev = Device::Cpu;
        let all: Vec<half::bf16> = (0..=u16::MAX).map(half::bf16::from_bits).collect();
        let h = Tensor::from_vec(all, (256, 256), &dev).unwrap();
        let nan_as_one = |b: u16| if b & 0x7fff > 0x7f80 { 0x7fc0 } else { b };
        // The backward's rows on every value; its column sums (f32, where
        // one NaN or infinite slope would hide every other term) on every
        // bf16 value under 1e4 in magnitude, 128 a row.
        let backward = |h: &Tensor| gelu_backward_bf16_and_f32(h).0;
        let rows = |g: &RoundedGrad| -> Vec<u16> {
            (0..g.rows())
                .flat_map(|i| g.row(i).to_vec())
                .map(nan_as_one)
                .collect()
        };
        let (got, want) = backward(&h);
        assert_eq!(rows(&got), rows(&want));
        let moderate: Vec<half::bf16> = (0..=u16::MAX)
            .map(half::bf16::from_bits)
            .filter(|v| v.to_f32().abs() < 1e4)
            .collect();
        let whole = moderate.len() / 128 * 128;
        let h = Tensor::from_vec(moderate[..whole].to_vec(), (whole / 128, 128), &dev).unwrap();
        let (got, want) = backward(&h);
        assert_eq!(rows(&got), rows(&want));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(got.sums().iter().all(|v| v.is_finite()));
        assert_eq!(bits(got.sums()), bits(want.sums()));
    }

    /// GELU's bf16 backward from `h` (`[rows, k]`, bf16) and the f32
    /// backward on the widened `h` rounded with its column sums, for the
    /// same `dy` (returned too).
    fn gelu_backward_bf16_and_f32(h: &Tensor) -> ((RoundedGrad, RoundedGrad), Tensor) {
        let (rows, k) = h.dims2().unwrap();
        let dy: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 13) % 17) as f32 / 7.0 - 1.1)
            .collect();
        let dy = Tensor::from_vec(dy, (rows, k), &Device::Cpu).unwrap();
        let widened = h.to_dtype(candle_core::DType::F32).unwrap();
        let f32_grad = gelu_backward(&widened, &dy).unwrap().flatten_all().unwrap();
        let want = bf16_with_column_sums(&f32_grad.to_vec1::<f32>().unwrap(), k).unwrap();
        ((gelu_backward_bf16_of_input(h, &dy).unwrap(), want), dy)
    }

    #[test]
    fn gelu_backward_in_bf16_is_the_rounded_backward_with_its_column_sums() {
        // 37 rows: several tasks and a short last one; rows of 101 (every
        // width's loops and a scalar tail).
        let (rows, k) = (37, 101);
        let h: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 7919) % 2001) as f32 / 300.0 - 3.3)
            .collect();
        let h = Tensor::from_vec(h, (rows, k), &Device::Cpu)
            .unwrap()
            .to_dtype(candle_core::DType::BF16)
            .unwrap();
        let ((got, want), dy) = gelu_backward_bf16_and_f32(&h);
        let values = |g: &RoundedGrad| {
            (0..rows)
                .flat_map(|i| g.row(i).to_vec())
                .collect::<Vec<_>>()
        };
        assert_eq!(values(&got), values(&want));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(got.sums()), bits(want.sums()));
        assert!(gelu_backward_bf16_of_input(&h, &dy.narrow(0, 1, rows - 1).unwrap()).is_err());
    }

    #[test]
    fn fused_gelu_matches_candle_and_finite_differences() {
        let dev = Device::Cpu;
        let xs: Vec<f32> = (0..41).map(|i| (i as f32 - 20.0) * 0.37).collect();
        let x = Tensor::from_vec(xs.clone(), (41,), &dev).unwrap();
        let ours = gelu(&x).unwrap().to_vec1::<f32>().unwrap();
        let theirs = x.gelu().unwrap().to_vec1::<f32>().unwrap();
        for (a, b) in ours.iter().zip(&theirs) {
            assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{a} vs {b}");
        }
        // Its gradient against candle's, and against finite differences.
        let v = Var::from_vec(xs.clone(), (41,), &dev).unwrap();
        let g_ours = gelu(v.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g_theirs = v
            .as_tensor()
            .gelu()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (a, b) = (
            g_ours.get(v.as_tensor()).unwrap().to_vec1::<f32>().unwrap(),
            g_theirs
                .get(v.as_tensor())
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
        );
        for (a, b) in a.iter().zip(&b) {
            assert!((a - b).abs() <= 1e-5, "{a} vs {b}");
        }
        let probe = Tensor::from_vec(weights(41), (41,), &dev).unwrap();
        check_grad(|x| gelu(x)?.mul(&probe)?.sum_all(), xs, &[41]);
    }

    #[test]
    fn gelu_with_its_slope_kept_gives_autograds_bits() {
        // Past a task of 2^14 elements, with a short last one.
        let n = (1 << 14) + 1000;
        let x = Tensor::from_vec(
            (0..n).map(|i| (i as f32 - 8000.0) * 1.3e-3).collect(),
            (n,),
            &Device::Cpu,
        )
        .unwrap();
        let dy = Tensor::from_vec(weights(n), (n,), &Device::Cpu).unwrap();
        let bits = |t: &Tensor| {
            let v = t.to_vec1::<f32>().unwrap();
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        let (y, slope) = gelu_and_slope(&x).unwrap();
        assert_eq!(bits(&y), bits(&gelu(&x).unwrap()));
        assert_eq!(
            bits(&gelu_backward_by_slope(&slope, &dy).unwrap()),
            bits(&gelu_backward(&x, &dy).unwrap())
        );
    }

    #[test]
    fn cross_entropy_of_uniform_logits_is_log_vocab() {
        let dev = Device::Cpu;
        let logits = Tensor::zeros((4, 8), candle_core::DType::F32, &dev).unwrap();
        let t = Tensor::new(&[1u32, 2, 3, 7], &dev).unwrap();
        let l = cross_entropy(&logits, &t)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!((l - 8f32.ln()).abs() < 1e-6);
    }
}
