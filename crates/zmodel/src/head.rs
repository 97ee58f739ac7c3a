//! The head's backward written by hand: the final norm, the output product and
//! the mean cross-entropy, forward and backward in one call, without an
//! autograd graph.
//!
//! Through candle's autograd the head was about 25 ms of a 390 ms bf16 step on
//! one worker with two threads (perf): a dozen element-wise operations over the
//! logits and their backward, each a fresh tensor plus a zeroed gradient
//! buffer, mostly on one thread, and three products through the `gemm` crate.
//! Here the loss and its gradient are one pass over the logits (row by row,
//! in parallel) and the products are zgemm's.
//!
//! Under bf16 products (`train.dtype: bf16` where the CPU multiplies bf16
//! natively) the head's three products round their operands to bf16 and sum
//! in f32, as the blocks' do and as PyTorch's autocast runs `lm_head`; the
//! cross-entropy stays f32, and rounds its gradient into the pairs both
//! backward products read as it finishes each pair of rows
//! (`Dlogits::Paired`). In f32 the head would cost as much as it does in
//! an f32 step: with GPT-2's 50,304-token vocabulary at d_model 384 its
//! products are two thirds of the model's FLOPs, and a bf16 step ran at
//! 1.26x the f32 one (2.7x with the byte vocabulary).

use candle_core::{Result, Tensor};
use rayon::prelude::*;
use zgemm::{MatMut, MatRef, Start};

use crate::linear::{Input, Products};
use crate::ops::{max_lanes, sum_lanes};
use crate::simd::{exp_minus, vectorised};

/// What [`crate::Gpt::head_backward`] returns.
#[derive(Debug)]
pub struct HeadBackward {
    /// The mean cross-entropy (unscaled).
    pub loss: f64,
    /// The gradient of the head's input `[b, t, d]`.
    pub dx: Tensor,
    /// The final norm's gradient (weight, and bias where the family has one).
    pub norm: crate::WeightBias<Tensor>,
    /// The output matrix's gradient `[vocab, d]`: `lm_head`'s, or with a tied
    /// head the share that `wte` gets from the head; `None` where the
    /// output matrix is frozen ([`crate::Gpt::with_frozen_output`]) or its
    /// gradient was added where the caller asked
    /// ([`crate::Gpt::head_backward_into`]).
    pub out: Option<Tensor>,
}

pub use zdata::IGNORED;

/// The cross-entropy of `logits` (`rows × vocab`, row-major) against
/// `targets`: each row's term pushed onto `losses` (0 for the rows whose
/// target is [`IGNORED`]), which summed in row order (f64) and divided by
/// `divisor` are the loss; and its gradient scaled by `scale`: `dlogits =
/// scale · (softmax(logits) − onehot(target)) / divisor` on a counted row,
/// zero on the others, written over `logits` in place. With every target
/// counted and `divisor` = `rows` that is the mean. Each row's log-sum-exp
/// is taken after subtracting the row's maximum. Each row is one vectorised
/// pass per step (the fused ops' `exp` and lane-wise reductions: the same
/// bits at every vector width).
///
/// With `smoothing` ε > 0 (`train.label_smoothing`) a row's term is
/// transformers' `LabelSmoother`'s: `(1 − ε)·(−log p(target)) + ε·mean over
/// the vocabulary of −log p`, and its gradient `softmax − (1 − ε)·onehot −
/// ε / vocab` (one more pass over the row, for its sum).
///
/// The rows lie `stride` floats apart (`vocab` or more). Where the
/// gradient's products are bf16 ones ([`Dlogits::Paired`], `paired`) the
/// rows are taken two at a time, and each pair's gradient is rounded and
/// rewritten in place as the pairs that both products read
/// (`zgemm::pair_rows_both_ways`: `stride` from `zgemm::pairs_row_stride`,
/// an even number of rows).
pub(crate) fn cross_entropy_in_place(
    logits: &mut [f32],
    targets: &[u32],
    (vocab, stride, paired): (usize, usize, bool),
    (scale, divisor): (f64, f64),
    smoothing: f64,
    losses: &mut Vec<f64>,
) -> Result<()> {
    let rows = targets.len();
    if logits.len() != rows * stride
        || vocab == 0
        || stride < vocab
        || (paired && !rows.is_multiple_of(2))
    {
        candle_core::bail!(
            "cross-entropy: {} logits for {rows} targets over a vocabulary of {vocab}",
            logits.len()
        );
    }
    if let Some((i, &t)) = targets
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab && t != IGNORED)
    {
        // Counted from the first row whose term `losses` holds.
        let i = losses.len() + i;
        candle_core::bail!(
            "cross-entropy: target {t} at position {i} is outside the vocabulary of {vocab}"
        );
    }
    if divisor.is_nan() || divisor <= 0.0 {
        candle_core::bail!("cross-entropy: divided by {divisor}");
    }
    let coef = (scale / divisor) as f32;
    let (uniform, picked_coef) = (
        (scale / divisor * smoothing / vocab as f64) as f32,
        (scale / divisor * (1.0 - smoothing)) as f32,
    );
    let term = |row: &mut [f32], t: u32| -> f64 {
        let row = &mut row[..vocab];
        if t == IGNORED {
            row.fill(0.0);
            return 0.0;
        }
        vectorised(
            #[inline(always)]
            || {
                let max = max_lanes(row);
                let picked = row[t as usize] - max;
                // The mean of x − max over the row, for the smoothing.
                let mean = match smoothing > 0.0 {
                    true => f64::from(sum_lanes([row], |[x]| x)) / vocab as f64 - f64::from(max),
                    false => 0.0,
                };
                exp_minus(row, max);
                let sum = sum_lanes([row], |[x]| x);
                let inv = coef / sum;
                // −log p(target) = log Σ exp(x − max) − (x_t − max).
                let nll = f64::from(sum.ln()) - f64::from(picked);
                if smoothing == 0.0 {
                    row.iter_mut().for_each(|x| *x *= inv);
                    row[t as usize] -= coef;
                    return nll;
                }
                row.iter_mut().for_each(|x| *x = *x * inv - uniform);
                row[t as usize] -= picked_coef;
                // The mean of −log p_j = log Σ exp(x − max) − mean(x − max).
                (1.0 - smoothing) * nll + smoothing * (f64::from(sum.ln()) - mean)
            },
        )
    };
    if !paired {
        let terms = logits
            .par_chunks_mut(stride)
            .zip(targets.par_iter())
            .with_min_len(16)
            .map(|(row, &t)| term(row, t));
        losses.par_extend(terms);
        return Ok(());
    }
    // Both rows of a pair, then their pairs, while they are in L2.
    let terms: Vec<[f64; 2]> = logits
        .par_chunks_mut(2 * stride)
        .zip(targets.par_chunks(2))
        .with_min_len(8)
        .map(|(two, t)| {
            let (r0, r1) = two.split_at_mut(stride);
            let terms = [term(r0, t[0]), term(r1, t[1])];
            SCRATCH.with(|s| zgemm::pair_rows_both_ways(two, stride, vocab, &mut s.borrow_mut()));
            terms
        })
        .collect();
    losses.extend(terms.into_iter().flatten());
    Ok(())
}

/// The logits' gradient as the head's two products take it.
#[derive(Clone, Copy)]
pub(crate) enum Dlogits<'a> {
    /// f32 values, `rows × vocab`.
    F32(MatRef<'a>),
    /// Paired in place by [`cross_entropy_in_place`] for bf16 products
    /// (`zgemm::gemm_bf16_pairs`): `along`, the rows' pairs (`A` of the
    /// input's gradient, `dlogits · out`); `across`, the transpose's pairs
    /// in two runs of the vocabulary (`A` of the output matrix's gradient,
    /// `dlogitsᵀ · x`, its first rows and the rest).
    Paired {
        along: MatRef<'a>,
        across: [MatRef<'a>; 2],
    },
}

impl<'a> Dlogits<'a> {
    /// The gradient of `rows` rows over `vocab` in `logits` (rows `stride`
    /// apart), paired or not.
    pub(crate) fn of(
        logits: &'a [f32],
        (rows, vocab, stride): (usize, usize, usize),
        paired: bool,
    ) -> Result<Dlogits<'a>> {
        if !paired {
            return Ok(Dlogits::F32(
                MatRef::new(logits, rows, vocab, stride, 1).map_err(shape)?,
            ));
        }
        let half = stride / 2;
        let kp = zgemm::padded_pairs(vocab);
        let lo = half.min(vocab);
        let along = MatRef::new(logits, rows, kp, stride, 1).map_err(shape)?;
        let across = |at: usize, count: usize| {
            MatRef::new(&logits[at..], count, rows / 2, 1, 2 * stride).map_err(shape)
        };
        Ok(Dlogits::Paired {
            along,
            across: [across(half, lo)?, across(stride + half, vocab - lo)?],
        })
    }
}

/// `C = A·B` or `C += A·B` into `c` with `A` as pairs
/// ([`Dlogits::Paired`]) and `B` f32 or bf16 bits; nothing where `A` has
/// no rows.
pub(crate) fn pairs_product_into(c: &mut [f32], a: MatRef, b: Input, start: Start) -> Result<()> {
    if a.rows() == 0 {
        return Ok(());
    }
    let c = MatMut::row_major(c, a.rows(), b.cols()).map_err(shape)?;
    let threads = rayon::current_num_threads();
    match b {
        Input::F32(b) => zgemm::gemm_bf16_pairs(c, a, b, 1.0, start, threads),
        Input::Bf16(b) => zgemm::gemm_bf16_pairs(c, a, b, 1.0, start, threads),
    }
    .map_err(shape)
}

thread_local! {
    /// The thread's logits buffer, kept between calls ([`with_logits`]).
    static LOGITS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A pair of rows' values while [`cross_entropy_in_place`] pairs them.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's logits buffer, `len` floats, kept from call to
/// call. A micro-batch's logits are large (2048 rows of GPT-2's 50,304-token
/// vocabulary: 412 MB), and glibc maps any allocation over 32 MiB afresh
/// from the kernel: in a fresh buffer every page faulted at the product's
/// first write, and was cleared by the kernel first (13% of a bf16 step's
/// samples at that vocabulary). Taken out for the call, so a nested use
/// cannot alias it.
/// The buffer starts on a 64-byte line (paired rows are read in place).
pub(crate) fn with_logits<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut buf = LOGITS.with(|l| std::mem::take(&mut *l.borrow_mut()));
    if buf.len() < len + 15 {
        buf.resize(len + 15, 0.0);
    }
    let at = buf.as_ptr().align_offset(64).min(15);
    let r = f(&mut buf[at..at + len]);
    LOGITS.with(|l| *l.borrow_mut() = buf);
    r
}

/// `C = A·B` (`Start::Zero`) or `C += A·B` (`Start::Keep`) into `c`
/// (`rows × cols`, row-major), the operands f32 or (bf16 products only)
/// bf16 bits.
pub(crate) fn product_into(
    c: &mut [f32],
    a: Input,
    b: Input,
    start: Start,
    products: Products,
) -> Result<()> {
    let (rows, cols) = (a.rows(), b.cols());
    let c_mat = MatMut::row_major(c, rows, cols).map_err(shape)?;
    let threads = rayon::current_num_threads();
    crate::linear::multiply(products, c_mat, a, b, start, threads)
}

pub(crate) fn shape(e: zgemm::ShapeError) -> candle_core::Error {
    candle_core::Error::Msg(format!("head: {e}"))
}
