//! Causal self-attention as one custom op with its own backward.
//!
//! Composed from candle ops, attention was the largest cost of a block that is
//! not a GEMM: three head copies, the scale, the mask add, a five-op softmax and
//! the backward of each (16 ms a block for softmax alone at 4×6×128×128). Here
//! one task per (sequence, head) runs on rayon's threads: `S = Q·Kᵀ/√d` by
//! zgemm on the task's thread straight from the `[b, t, 3d]` projection
//! (strides, no copies; each task packs its K, V, Q and dY once for all its
//! blocks), the causal softmax row by row, then `Y = P·V` written
//! into the `[b, t, d]` layout the output projection reads. Every product runs
//! in blocks of 24 query rows (or key columns; 64 with bf16 products), each
//! seeing only the keys (or queries) the mask lets through: at t = 256 that
//! skips 45% of the work of the full t × t products (blocks of 64: 3/8).
//! zgemm adds each element's terms in one fixed order
//! (one FMA chain over the depth), and the terms the full products would add
//! on top are exact zeros, so up to zgemm's depth block (t ≤ 384) the blocking
//! changes no bit (tested); beyond it only the rounding differs, and the bits
//! still do not depend on the thread count. Backward recomputes P
//! (FlashAttention's trade: a 128×128 GEMM instead of keeping P for every block)
//! and computes dV = Pᵀ·dY, dP = dY·Vᵀ, dS = P ⊙ (dP − rowsum(dP ⊙ P)),
//! dQ = dS·K/√d, dK = dSᵀ·Q/√d into one `[b, t, 3d]` gradient. The tests check
//! both ways against the composed version. A task holds P and dS for a
//! chunk of query rows at a time
//! ([`zconfig::estimate::ATTENTION_CHUNK_ROWS`], 768), never `t × t`: the
//! memory of long sequences stays linear in `t`.
//!
//! With bf16 products (`train.dtype: bf16` with native bf16) every product rounds its
//! operands to bf16 and accumulates in f32 (`zgemm::gemm_packed_bf16`, the
//! packed operands rounded once a task); the softmax and dS stay f32, and
//! each of their rows is rounded into a bf16 copy as it is finished, which
//! the products read in place (`Rows16`: the same bits as rounding each
//! product's part of the f32 matrix, without those passes; attention's
//! backward 5.5 → 5.2 ms in `attention_bench`, one thread). A
//! block writes its output in bf16 there ([`causal_attention_bf16`]): its
//! only reader is the output projection, which would round it. And it
//! takes `qkv` in bf16 (GPT's projection stores it rounded,
//! `zgemm::gemm_bf16_rounded`): every use of q, k and v is a product that
//! would round them to those bits, so the results are the same, with half
//! the bytes to read and nothing to round per task (attention's rounding
//! and pairing of q, k and v was 4-5% of a bf16 step). The
//! blocking changes no bit there either: a shorter block's depth ends in
//! zero pairs, which every bf16 kernel adds exactly.
//!
//! Dropout of the probabilities (`model.attention_dropout`): the forward
//! drops each head's `P` in place as its softmax finishes (before the
//! bf16 copy is rounded), `Y = P̃·V`. Backward recomputes `P`, drops `dP̃ =
//! dY·Vᵀ` by the same mask into `dP` (then `dS` as without dropout, its
//! row sums over `dP ⊙ P`), and only then drops `P` for `dV = P̃ᵀ·dY`,
//! which is why dV comes after dS here. The mask is
//! [`crate::dropout`]'s hash of each probability's index, nothing stored.
//!
//! Grouped-query attention (LLaMA's `n_kv_heads`): the projection is
//! `[b, t, (heads + 2·kv)·hd]`, and query head `h` reads key/value head
//! `h / (heads / kv)`. Backward runs one task per (sequence, key/value head)
//! that goes through its query heads in order, adding their dK and dV in that
//! order (no two tasks write the same columns; the bits do not depend on the
//! threads). With `kv = heads` it is the plain multi-head case, unchanged.
//!
//! Documents kept apart (`data.separate_documents`, [`Documents`]): row `i`
//! sees keys from its document's first on, a lower bound per row on top of
//! the causal upper one. The softmax and dS rows run over those keys only
//! (the rest zero), and the products skip what a whole block masks: a block
//! of query rows starts its keys at its first row's document (the score
//! products at the panel holding it, the others exactly, or at 32 rows
//! for bf16 pairs), and a block of keys ends its queries where the next
//! document begins. With documents of 64 tokens in sequences of 256 (a
//! quarter of the triangle live, so at best 4x), `DOCUMENTS=64
//! attention_bench` on one thread: forward 1.6-1.7x and backward 1.8x
//! faster than the same masks without the skipping (bf16 in and out:
//! 1.5x and 1.65x); the rest is the per-task packing of K, V, Q and dY
//! and the zeros before each row's document, which stay whole, and the
//! score products' 64-column panels (AVX-512 f32). Skipping terms that are exact zeros changes no bit
//! while a product's depth fits one of zgemm's depth blocks.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use zgemm::{MatMut, MatRef, PackedB, Start};

use crate::documents::Documents;
use crate::dropout::Dropout;
use crate::linear::Products;

use crate::ops::{f32_input, max_lanes, sum_lanes};
use crate::simd::{assume_init, exp_minus, uninit_floats, vectorised};

/// The heads of one attention: `heads` query heads sharing `kv` key/value heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; divides `heads`.
    pub kv: usize,
}

/// What attention's input holds: f32 values (for either products) or, for
/// bf16 products only, bf16 values as their bits (a projection that wrote
/// its output rounded, `zgemm::gemm_bf16_rounded`: the bits every product
/// here would round the f32 values to, so the same results).
trait Values: zgemm::Bf16Operand {
    /// The values as f32, which f32 products need; `None` for bits.
    fn f32s(m: MatRef<Self>) -> Option<MatRef<f32>>;
}

impl Values for f32 {
    fn f32s(m: MatRef<f32>) -> Option<MatRef<f32>> {
        Some(m)
    }
}

impl Values for u16 {
    fn f32s(_: MatRef<u16>) -> Option<MatRef<f32>> {
        None
    }
}

/// bf16 bits `Values` are only ever given to bf16 products (the entry
/// points check it).
const BITS_NEED_BF16: &str = "attention: bf16 inputs multiply with bf16 products only";

/// The values of a contiguous CPU tensor's storage: f32, or bf16 as bits.
enum Input<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

fn input<'a>(name: &str, s: &'a CpuStorage, l: &Layout) -> Result<Input<'a>> {
    use half::slice::HalfFloatSliceExt;
    match s {
        CpuStorage::BF16(v) => {
            let Some((start, end)) = l.contiguous_offsets() else {
                candle_core::bail!("{name}: input must be contiguous");
            };
            Ok(Input::Bf16(v[start..end].reinterpret_cast()))
        }
        _ => f32_input(name, s, l).map(Input::F32),
    }
}

/// `y[b, t, heads·hd]` of causal attention over `qkv[b, t, (heads + 2·kv)·hd]`
/// (q, k and v side by side), its products on f32 values or on bf16-rounded
/// ones (AMX: the four tile steps of a 64×64 block at head size 64 in the
/// time of one f32 one; autocast rounds attention's inputs alike). With
/// `docs`, each row sees only the keys of its own document; with `dropout`
/// the probabilities are dropped (the element of sequence `b`, head `h`,
/// row `i`, key `j` at index `((b·heads + h)·t + i)·t + j` of the mask).
pub fn causal_attention(
    qkv: &Tensor,
    heads: Heads,
    products: Products,
    docs: Option<&Documents>,
    dropout: Option<Dropout>,
) -> Result<Tensor> {
    let blocks = Blocks::new(heads, block_rows(products), products).with_dropout(dropout);
    forward_in_blocks(qkv, blocks, docs)
}

fn forward_in_blocks(qkv: &Tensor, blocks: Blocks, docs: Option<&Documents>) -> Result<Tensor> {
    qkv.contiguous()?
        .apply_op1(CausalAttention(blocks, docs.cloned()))
}

/// Causal attention of the last `new` of the `t` rows in `rows` (`[t,
/// (heads + 2·kv)·hd]`, q, k and v of positions `0..t`, rotated where the
/// model rotates): `[new, heads·hd]`, each row over the keys up to its own
/// position (the last `window` of them with a sliding window). Generation's attention (`zrun sample`): a new token's row over
/// the keys of every token before it, `O(t·d)` where [`causal_attention`]
/// would redo all `t` rows, `O(t²·d)`. Plain f32 loops: the sums run in
/// another order than the blocked products', so the values agree within
/// rounding, not to the bit.
pub fn attention_of_last_rows(
    rows: &[f32],
    t: usize,
    new: usize,
    heads: Heads,
    window: Option<usize>,
) -> Vec<f32> {
    let w = rows.len() / t.max(1);
    let hd = w / (heads.heads + 2 * heads.kv);
    let group = heads.heads / heads.kv;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; new * heads.heads * hd];
    let mut weights = Vec::with_capacity(t);
    for (i, out_row) in out.chunks_exact_mut(heads.heads * hd).enumerate() {
        let pos = t - new + i;
        // The keys it sees: the last `window` up to its own, or all.
        let from = window.map_or(0, |n| (pos + 1).saturating_sub(n));
        let keys = &rows[from * w..(pos + 1) * w];
        let q_row = &rows[pos * w..][..w];
        for (h, out) in out_row.chunks_exact_mut(hd).enumerate() {
            let q = &q_row[h * hd..][..hd];
            let (k_at, v_at) = (
                (heads.heads + h / group) * hd,
                (heads.heads + heads.kv + h / group) * hd,
            );
            weights.clear();
            weights.extend(keys.chunks_exact(w).map(|r| {
                let k = &r[k_at..][..hd];
                q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale
            }));
            let max = weights.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for e in &mut weights {
                *e = (*e - max).exp();
                sum += *e;
            }
            for (r, &e) in keys.chunks_exact(w).zip(&weights) {
                let p = e / sum;
                for (o, v) in out.iter_mut().zip(&r[v_at..][..hd]) {
                    *o += p * v;
                }
            }
        }
    }
    out
}

/// [`causal_attention`] under bf16 products with its output rounded to
/// bf16: a `BF16` tensor `[b·t, heads·hd]` laid out for the products to read
/// in place, for a block whose only reader of it is the output projection
/// (forward and weight gradient), whose products would round the f32 output
/// to these bits. Each block of rows leaves its product in L1 and is stored
/// rounded from there; the projection's packing rounded, and for the weight
/// gradient transposed, the f32 output from memory (4% of a bf16 step's
/// samples on AMX; the step 1.02-1.04x faster without). Not differentiable (autograd's reference takes the f32 one).
pub fn causal_attention_bf16(
    qkv: &Tensor,
    heads: Heads,
    docs: Option<&Documents>,
    dropout: Option<Dropout>,
) -> Result<Tensor> {
    let qkv = qkv.contiguous()?;
    let (storage, layout) = qkv.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("attention: a CPU tensor");
    };
    let dm = Dims::of(layout, heads)?;
    dm.check(docs)?;
    let rows = dm.b * dm.t;
    let (mut out, start, stride) = crate::simd::bf16_rows_buffer(rows, dm.d);
    let blocks =
        Blocks::new(heads, block_rows(Products::Bf16), Products::Bf16).with_dropout(dropout);
    let bits = SharedBits(out[start..].as_mut_ptr().cast());
    match input("zrun-causal-attention-bf16", cpu, layout)? {
        Input::F32(v) => forward_tasks(v, dm, blocks, docs, Out::Bf16(bits, stride)),
        Input::Bf16(v) => forward_tasks(v, dm, blocks, docs, Out::Bf16(bits, stride)),
    }
    for row in out[start..start + rows * stride].chunks_mut(stride) {
        for pad in &mut row[dm.d..] {
            pad.write(0);
        }
    }
    // The head and tail of the buffer, every row's padding, and (the tasks)
    // every (sequence, head)'s columns of every row are written.
    crate::simd::bf16_tensor(out, start, rows, stride, dm.d)
}

/// Where the forward's tasks store `y`.
#[derive(Clone, Copy)]
enum Out {
    /// f32 `[b, t, d]`.
    F32(Shared),
    /// bf16 bits, rows `stride` apart.
    Bf16(SharedBits, usize),
}

/// bf16 bits that tasks write disjoint columns of.
#[derive(Clone, Copy)]
struct SharedBits(*mut u16);
// SAFETY: every task writes only its own (sequence, head) columns.
unsafe impl Send for SharedBits {}
// SAFETY: as above.
unsafe impl Sync for SharedBits {}

/// The forward's tasks, one per (sequence, head): `y = P·V` of each block of
/// query rows into `out`.
fn forward_tasks<T: Values>(qkv: &[T], dm: Dims, blk: Blocks, docs: Option<&Documents>, out: Out) {
    let (t, d, w, hd) = (dm.t, dm.d, dm.w, dm.hd);
    let rows = blk.rows;
    // One task a leaf (simd's module doc).
    let tasks = (0..dm.b * dm.heads).into_par_iter().with_max_len(1);
    let bf16 = blk.products == Products::Bf16;
    let held = blk.held_rows(t);
    tasks.for_each(|task| {
        with_packs(|[kt, vp, ..]| {
            // The second matrix holds a block's product under bf16 output.
            with_scratch(held * t, rows * hd, |p, y_blk| {
                with_bits(if bf16 { held } else { 0 }, t, |mut p16, _| {
                    let (bi, h) = (task / dm.heads, task % dm.heads);
                    let base = bi * t * w;
                    blk.pack(kt, view(qkv, base + dm.k(h / dm.group), t, hd, w).t());
                    blk.pack(vp, view(qkv, base + dm.v(h / dm.group), t, hd, w));
                    let first = docs.map(|d| d.firsts(bi));
                    for chunk in blk.chunks(t) {
                        let c0 = chunk.0;
                        // Dropped probabilities are rounded after the drop.
                        let rounded = (bf16 && blk.dropout.is_none()).then_some(&mut p16);
                        probabilities(qkv, dm, blk, (bi, h), first, kt, chunk, p, rounded);
                        if let Some(drop) = blk.dropout {
                            let rounded = bf16.then_some(&mut p16);
                            drop_rows(p, dm, blk, (drop, task), first, chunk, rounded);
                        }
                        let (p, bits) = (&*p, bf16.then_some(&p16));
                        for (i0, i1) in blk.blocks_of(chunk) {
                            let (c, c_rs) = match out {
                                Out::F32(y) => (y.at((bi * t + i0) * d + h * hd), d),
                                Out::Bf16(..) => (y_blk.as_mut_ptr(), hd),
                            };
                            let k0 = keys_from(first, i0, blk.depth_start());
                            // SAFETY: y's rows i0..i1 of sequence bi, columns
                            // of head h: this task's alone (or its scratch).
                            unsafe {
                                let at = (i0 - c0, k0);
                                let p_blk = Part::of(p, t, bits, at, (i1 - i0, i1 - k0));
                                let v_part = (k0..i1, 0);
                                product_of_part(
                                    blk.products,
                                    c,
                                    c_rs,
                                    hd,
                                    p_blk,
                                    vp,
                                    v_part,
                                    1.0,
                                    false,
                                )
                            };
                            if let Out::Bf16(bits, stride) = out {
                                for (r, row) in y_blk[..(i1 - i0) * hd].chunks(hd).enumerate() {
                                    // SAFETY: row bi·t + i0 + r, head h's columns of
                                    // the output: this task's alone, inside the buffer.
                                    let dst = unsafe {
                                        std::slice::from_raw_parts_mut(
                                            bits.0
                                                .add((bi * t + i0 + r) * stride + h * hd)
                                                .cast::<std::mem::MaybeUninit<u16>>(),
                                            hd,
                                        )
                                    };
                                    zgemm::bf16_bits_write(row, dst);
                                }
                            }
                        }
                    }
                })
            })
        })
    });
}

/// d qkv of [`causal_attention`] from its input and the gradient of its output.
pub fn causal_attention_backward(
    qkv: &Tensor,
    dy: &Tensor,
    heads: Heads,
    products: Products,
    docs: Option<&Documents>,
    dropout: Option<Dropout>,
) -> Result<Tensor> {
    let blocks = Blocks::new(heads, block_rows(products), products).with_dropout(dropout);
    backward_in_blocks(qkv, dy, blocks, docs)
}

fn backward_in_blocks(
    qkv: &Tensor,
    dy: &Tensor,
    blocks: Blocks,
    docs: Option<&Documents>,
) -> Result<Tensor> {
    qkv.contiguous()?.apply_op2_no_bwd(
        &dy.contiguous()?,
        &CausalAttentionGrad(blocks, docs.cloned()),
    )
}

/// How one attention runs: its heads, the rows of a causal block and of
/// a chunk, what its products multiply and the dropout of its
/// probabilities.
#[derive(Debug, Clone, Copy)]
struct Blocks {
    heads: Heads,
    /// Rows per causal block ([`block_rows`]; tests use others).
    rows: usize,
    /// Query rows whose probabilities (and their gradient) a task holds at
    /// once: a multiple of `rows` ([`CHUNK_ROWS`]; tests use others).
    chunk: usize,
    products: Products,
    dropout: Option<Dropout>,
}

impl Blocks {
    /// # Panics
    ///
    /// bf16 products with blocks of other than a multiple of 32 rows (their
    /// packed parts start at such rows).
    fn new(heads: Heads, rows: usize, products: Products) -> Blocks {
        assert!(products == Products::F32 || rows.is_multiple_of(32));
        Blocks {
            heads,
            rows,
            chunk: (CHUNK_ROWS / rows).max(1) * rows,
            products,
            dropout: None,
        }
    }

    fn with_dropout(self, dropout: Option<Dropout>) -> Blocks {
        Blocks { dropout, ..self }
    }

    /// The chunks `[c0, c1)` of `0..t`: whole causal blocks each.
    fn chunks(&self, t: usize) -> impl Iterator<Item = (usize, usize)> {
        blocks(t, self.chunk)
    }

    /// The causal blocks of chunk `[c0, c1)`.
    fn blocks_of(&self, (c0, c1): (usize, usize)) -> impl Iterator<Item = (usize, usize)> {
        blocks(c1 - c0, self.rows).map(move |(i0, i1)| (c0 + i0, c0 + i1))
    }

    /// Rows of a task's work matrices: a chunk, or the whole sequence
    /// when it is shorter.
    fn held_rows(&self, t: usize) -> usize {
        self.chunk.min(t)
    }

    /// Where a product over keys (or queries) may start its depth: bf16
    /// pairs come in tile steps of 32 rows.
    fn depth_start(&self) -> usize {
        match self.products {
            Products::F32 => 1,
            Products::Bf16 => 32,
        }
    }

    /// Packs `b` for this attention's products.
    fn pack<T: Values>(&self, packed: &mut PackedB, b: MatRef<T>) {
        match self.products {
            Products::F32 => packed.pack(T::f32s(b).expect(BITS_NEED_BF16)),
            Products::Bf16 => packed.pack_bf16(b),
        }
    }
}

/// The op, with the documents of its sequences where they are kept apart.
struct CausalAttention(Blocks, Option<Documents>);

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

    /// Refuses documents of another batch shape.
    fn check(&self, docs: Option<&Documents>) -> Result<()> {
        match docs {
            Some(d) if d.seq_len() != self.t || d.tokens() != self.b * self.t => {
                candle_core::bail!(
                    "attention: documents of {} tokens in sequences of {} for [{}, {}]",
                    d.tokens(),
                    d.seq_len(),
                    self.b,
                    self.t
                )
            }
            _ => Ok(()),
        }
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

/// Rows per block of the causal products: a block of query rows `[i0, i1)`
/// sees keys `[0, i1)` only, so blocking skips the masked upper triangle.
///
/// f32: 24 rows, four of the micro-kernel's 6-row tiles (AVX2 and AVX-512
/// alike). Smaller blocks waste less of the diagonal (a block computes
/// `(i1 - i0)·i1` scores where the triangle needs about half of its last
/// `(i1 - i0)²`) but run more, shorter products. Counting the kernel's tile
/// steps of all seven products at t = 256, head size 64, 6×16 tiles, with a
/// tile's store as 10 steps: blocks of 64 do 1.42x the triangle's work, 24
/// 1.23x, 6 (one tile of rows) 1.17x; on a 2-core EPYC (AVX2) attention
/// forward and backward took 68-70 ms with 64 rows, 60-61 ms with 12, 18 or
/// 24, and 64-65 ms with 6, whose calls cost more than they save.
/// bf16 products keep 64: their packed parts start on multiples of 32 rows
/// (AMX reads 16-row tiles of pairs), and AMX was measured there.
fn block_rows(products: Products) -> usize {
    match products {
        Products::F32 => 24,
        Products::Bf16 => 64,
    }
}

/// Query rows a task computes the probabilities of at once, rounded down
/// to whole blocks ([`Blocks::chunk`]; `zrun estimate` counts them, so the
/// number lives in `zconfig`). A block of query rows needs its scores over
/// every key it sees, and the backward's products over queries (dV, dK)
/// read a block of keys' column of them, so a task held `P` and `dS`
/// whole: two `t × t` matrices a thread (and their bf16 copies), kept
/// between steps, 2 GiB a thread at t = 16384, where the activations of a
/// small model were a quarter of that. In chunks they are `CHUNK_ROWS ×
/// t`, linear in `t`; dV and dK add each chunk's part. dV's α = 1 products
/// continue one chain of fused multiply-adds, the bits of one product;
/// dK's α = 1/√d products add each chunk's sum, so past one chunk its bits
/// depend on the chunk (not on the threads). 768 rows: a multiple of both
/// blocks (24 and 64), longer than the sequences the examples train (whose
/// bits are one chunk's), and a depth at which the products over queries
/// keep the kernels' rate.
const CHUNK_ROWS: usize = zconfig::estimate::ATTENTION_CHUNK_ROWS;

/// The row blocks `[i0, i1)` of `0..t`.
fn blocks(t: usize, rows: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t).step_by(rows).map(move |i0| (i0, (i0 + rows).min(t)))
}

thread_local! {
    /// Each thread's two work matrices (a chunk's rows of P and of dS, or
    /// of P and a block's output), kept between calls (a fresh 256 KiB pair
    /// per task was a memset and page faults per head).
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const {
        std::cell::RefCell::new((Vec::new(), Vec::new()))
    };
}

thread_local! {
    /// Each thread's packed operands, kept between calls: K (both ways), Vᵀ
    /// or V, Q and dY of one task, packed once for every block that reads
    /// them (packing each block's part afresh cost a fifth of attention).
    static PACKS: std::cell::RefCell<Vec<PackedB>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's five packing buffers.
fn with_packs<R>(f: impl FnOnce(&mut [PackedB; 5]) -> R) -> R {
    // Taken out for the call, as the scratch matrices are.
    let mut packs = PACKS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    packs.resize_with(5, PackedB::new);
    let r = f((&mut packs[..]).try_into().expect("five buffers"));
    PACKS.with(|p| *p.borrow_mut() = packs);
    r
}

/// Runs `f` on this thread's two scratch matrices, of `len_a` and `len_b`
/// floats.
fn with_scratch<R>(len_a: usize, len_b: usize, f: impl FnOnce(&mut [f32], &mut [f32]) -> R) -> R {
    // Taken out for the call, so a nested use cannot alias them.
    let (mut a, mut b) = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    for (v, len) in [(&mut a, len_a), (&mut b, len_b)] {
        if v.len() < len {
            v.resize(len, 0.0);
        }
        if cfg!(test) {
            // Poisoned: an entry a product reads without its task writing
            // it first makes the tests' results NaN.
            v[..len].fill(f32::NAN);
        }
    }
    let r = f(&mut a[..len_a], &mut b[..len_b]);
    SCRATCH.with(|s| *s.borrow_mut() = (a, b));
    r
}

thread_local! {
    /// Each thread's two matrices of bf16 bits (a chunk's rows of P and dS
    /// as bf16 products read them), kept between calls as [`SCRATCH`] is.
    static BITS: std::cell::RefCell<(Vec<u16>, Vec<u16>)> = const {
        std::cell::RefCell::new((Vec::new(), Vec::new()))
    };
}

/// bf16 copies of a task's work matrices, for bf16 products to read in
/// place: two matrices of a chunk's rows [`zgemm::bf16_row_stride`] apart,
/// each from a 64-byte line. A row holds what its causal block's products read
/// (columns up to the block's end), rounded as the f32 row is finished,
/// while it is in L1: each product then reads bits where it rounded a
/// copy of its part of the f32 matrix (a pass over `P` for `P·V` and
/// `Pᵀ·dY`, two over `dS`), and the transposed ones read half the bytes.
struct Rows16<'a> {
    data: &'a mut [u16],
    stride: usize,
}

impl Rows16<'_> {
    /// Row `i`'s first `cols` values: `row` (of at least `cols`) rounded.
    fn round_row(&mut self, i: usize, row: &[f32], cols: usize) {
        let dst = &mut self.data[i * self.stride..][..cols];
        zgemm::bf16_bits_into(&row[..cols], dst);
    }

    /// `rows × cols` from row `r0`, column `c0`.
    fn view(&self, r0: usize, c0: usize, rows: usize, cols: usize) -> MatRef<'_, u16> {
        view(self.data, r0 * self.stride + c0, rows, cols, self.stride)
    }
}

/// Runs `f` on this thread's two bf16 matrices of `rows` rows of `t`.
fn with_bits<R>(rows: usize, t: usize, f: impl FnOnce(Rows16, Rows16) -> R) -> R {
    let stride = zgemm::bf16_row_stride(t);
    let len = rows * stride;
    // Taken out for the call, as the f32 scratch matrices are.
    let (mut a, mut b) = BITS.with(|s| std::mem::take(&mut *s.borrow_mut()));
    for v in [&mut a, &mut b] {
        if v.len() < len + 32 {
            v.resize(len + 32, 0);
        }
    }
    let (sa, sb) = (zgemm::bf16_line_start(&a), zgemm::bf16_line_start(&b));
    let r = f(
        Rows16 {
            data: &mut a[sa..sa + len],
            stride,
        },
        Rows16 {
            data: &mut b[sb..sb + len],
            stride,
        },
    );
    BITS.with(|s| *s.borrow_mut() = (a, b));
    r
}

/// The end of the causal block of `rows` rows that row `i` is in (`t` at most).
fn block_end(i: usize, rows: usize, t: usize) -> usize {
    ((i / rows + 1) * rows).min(t)
}

/// The masked entries after row `i`'s own that some product reads, up to
/// the end of its block: the blocks' products over P and dS (and their
/// bf16 copies) read no column of a row past its block's end, so the rest
/// of the row is never zeroed (half of a `t × t` matrix's writes a head;
/// measured within noise, at most 2% of attention's backward: the rows
/// are written in L1, not memory). Tests poison the scratch ([`with_scratch`])
/// so that a read of an entry left unwritten shows.
fn read_after(i: usize, rows: usize, t: usize) -> usize {
    block_end(i, rows, t) - (i + 1)
}

/// Part of a task's `t × t` matrix (P or dS) as a product reads it: the
/// f32 rows, or under bf16 products their bf16 copy ([`Rows16`]).
#[derive(Clone, Copy)]
enum Part<'a> {
    F32(MatRef<'a, f32>),
    Bits(MatRef<'a, u16>),
}

impl<'a> Part<'a> {
    /// `rows × cols` from row `r0`, column `c0` of the work matrix `m`
    /// (rows of `t`), read from `bits` where there is a copy.
    fn of(
        m: &'a [f32],
        t: usize,
        bits: Option<&'a Rows16>,
        at: (usize, usize),
        shape: (usize, usize),
    ) -> Part<'a> {
        let ((r0, c0), (rows, cols)) = (at, shape);
        match bits {
            Some(b) => Part::Bits(b.view(r0, c0, rows, cols)),
            None => Part::F32(view(m, r0 * t + c0, rows, cols, t)),
        }
    }

    /// The transpose.
    fn t(self) -> Part<'a> {
        match self {
            Part::F32(m) => Part::F32(m.t()),
            Part::Bits(m) => Part::Bits(m.t()),
        }
    }
}

/// [`product`] with `A` a [`Part`].
///
/// # Safety
///
/// As [`product`]'s.
#[allow(clippy::too_many_arguments)]
unsafe fn product_of_part(
    products: Products,
    c: *mut f32,
    c_rs: usize,
    cols: usize,
    a: Part,
    b: &PackedB,
    b_part: (std::ops::Range<usize>, usize),
    alpha: f32,
    keep: bool,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match a {
            Part::F32(a) => product(products, c, c_rs, cols, a, b, b_part, alpha, keep),
            Part::Bits(a) => product(products, c, c_rs, cols, a, b, b_part, alpha, keep),
        }
    }
}

/// `C = start ⊕ alpha·A·B` on the calling thread, where `B` is rows
/// `b_part.0` and the `cols` columns from `b_part.1` (where a panel starts)
/// of `b`; `C` at `c` with row stride `c_rs` (unit column stride).
///
/// # Safety
///
/// `C`'s `a.rows() × cols` elements at row stride `c_rs` from `c` must be
/// valid for writes (initialised when `keep`) and written by no one else
/// during the call, and must not overlap `a`.
#[allow(clippy::too_many_arguments)]
unsafe fn product<T: Values>(
    products: Products,
    c: *mut f32,
    c_rs: usize,
    cols: usize,
    a: MatRef<T>,
    b: &PackedB,
    b_part: (std::ops::Range<usize>, usize),
    alpha: f32,
    keep: bool,
) {
    // SAFETY: forwarded from the caller.
    let c = unsafe { MatMut::from_raw(c, a.rows(), cols, c_rs, keep) };
    let start = if keep { Start::Keep } else { Start::Zero };
    c.and_then(|c| match products {
        Products::F32 => {
            let a = T::f32s(a).expect(BITS_NEED_BF16);
            zgemm::gemm_packed(c, a, b, b_part, alpha, start)
        }
        Products::Bf16 => zgemm::gemm_packed_bf16(c, a, b, b_part, alpha, start),
    })
    .expect("attention: GEMM shapes are built from one Dims");
}

/// `rows × cols` of `data` from element `off`, rows `rs` apart, unit columns.
fn view<T: Copy>(data: &[T], off: usize, rows: usize, cols: usize, rs: usize) -> MatRef<'_, T> {
    MatRef::new(&data[off..], rows, cols, rs, 1).expect("attention: views lie in their tensor")
}

/// Rows of `P` (or `dS`) that each step of the row loops takes in turn:
/// a row's max, sum and their folds are short dependent chains (rows are
/// 1 to `t` long, 129 on average at t = 256), so one row at a time left the
/// core waiting on their latency; four rows' chains, each its own row's
/// arithmetic in its own order (the same bits), overlap. `attention_bench`
/// (one thread, alternated with the row-at-a-time build): bf16 in and out
/// forward 2.65-2.87 → 2.45-2.48 ms, backward 5.42-5.61 → 4.93-5.15; f32
/// 0.96-0.98x the time. Two rows a step measured 2.60-2.67 ms forward,
/// eight 2.50-2.59.
const ROW_GROUP: usize = 4;

/// The live entries of row `i` of P: the keys from its document's first
/// (`first`, per row of the sequence; 0 without documents) to its own.
fn live(first: Option<&[u32]>, i: usize) -> std::ops::Range<usize> {
    first.map_or(0, |f| f[i] as usize)..i + 1
}

/// The first key that the block of rows from `i0` sees, rounded down to a
/// multiple of `align` (where a product may start): its first row's
/// document's first (documents follow each other down a sequence, so no
/// later row's begins earlier). The keys before it are masked for every
/// row of the block: its products skip them.
fn keys_from(first: Option<&[u32]>, i0: usize, align: usize) -> usize {
    first.map_or(0, |f| f[i0] as usize / align * align)
}

/// The first column of row `i` of P (or dS) that a product reads: where
/// its block of rows' products start ([`keys_from`]), or where the
/// transposed products over blocks of keys that take the row begin, the
/// block holding the previous row's first key (a block of keys `[j0, j1)`
/// takes the rows whose first key is before `j1`, and one more where
/// [`queries_to`] rounds up). The masked entries before it are read by no
/// product and left unwritten: without it, the zeros before a window (or
/// a document) were written for every row, `t` wide.
fn read_from(first: Option<&[u32]>, i: usize, blk: Blocks) -> usize {
    let Some(f) = first else {
        return 0;
    };
    let own = keys_from(first, i / blk.rows * blk.rows, blk.depth_start());
    let transposed = f[i.saturating_sub(1)] as usize / blk.rows * blk.rows;
    own.min(transposed)
}

/// The end of the rows that see any key before `j1`: the first row whose
/// document begins at `j1` or later, rounded up to an even row (where a
/// bf16 product may end) or `t`. The later rows see none of the keys of
/// a block ending at `j1`: the backward's products over queries skip them.
fn queries_to(first: Option<&[u32]>, j1: usize, t: usize) -> usize {
    first.map_or(t, |f| {
        let end = f.partition_point(|&begins| (begins as usize) < j1);
        end.next_multiple_of(2).min(t)
    })
}

/// P = causal softmax(Q·Kᵀ·scale) of sequence `bi`, query head `h`, rows
/// `[c0, c1)` into `p` (row `i` at `(i - c0)·t`), from `kt`, its head's Kᵀ
/// packed; the masked entries (column above the row, or before its
/// document's first) are zero; a block's product starts at the panel of
/// keys where its first row's document begins. With `p16`, each row's
/// causal block rounded to bf16 there too ([`Rows16`]).
#[allow(clippy::too_many_arguments)]
fn probabilities<T: Values>(
    qkv: &[T],
    dm: Dims,
    blk: Blocks,
    (bi, h): (usize, usize),
    first: Option<&[u32]>,
    kt: &PackedB,
    (c0, c1): (usize, usize),
    p: &mut [f32],
    mut p16: Option<&mut Rows16>,
) {
    let (t, w, hd) = (dm.t, dm.w, dm.hd);
    let base = bi * t * w;
    let scale = 1.0 / (hd as f32).sqrt();
    let p = &mut p[..(c1 - c0) * t];
    for (i0, i1) in blk.blocks_of((c0, c1)) {
        let q = view(qkv, base + i0 * w + dm.q(h), i1 - i0, hd, w);
        let k0 = keys_from(first, i0, kt.panel_width());
        let c = p[(i0 - c0) * t + k0..].as_mut_ptr();
        // SAFETY: rows i0..i1, columns k0..i1 of p, which only this call
        // holds.
        unsafe {
            product(
                blk.products,
                c,
                t,
                i1 - k0,
                q,
                kt,
                (0..hd, k0),
                scale,
                false,
            )
        };
    }
    vectorised(
        #[inline(always)]
        || {
            for (g, group) in p.chunks_mut(ROW_GROUP * t).enumerate() {
                let i0 = c0 + g * ROW_GROUP;
                let live = |r: usize| live(first, i0 + r);
                let mut max = [0f32; ROW_GROUP];
                for (r, row) in group.chunks_exact(t).enumerate() {
                    max[r] = max_lanes(&row[live(r)]);
                }
                for (r, row) in group.chunks_exact_mut(t).enumerate() {
                    exp_minus(&mut row[live(r)], max[r]);
                }
                let mut inv = [0f32; ROW_GROUP];
                for (r, row) in group.chunks_exact(t).enumerate() {
                    inv[r] = 1.0 / sum_lanes([&row[live(r)]], |[v]| v);
                }
                for (r, row) in group.chunks_exact_mut(t).enumerate() {
                    let l = live(r);
                    let (before, rest) = row.split_at_mut(l.start);
                    let (l, after) = rest.split_at_mut(l.len());
                    l.iter_mut().for_each(|v| *v *= inv[r]);
                    before[read_from(first, i0 + r, blk)..].fill(0.0);
                    after[..read_after(i0 + r, blk.rows, t)].fill(0.0);
                }
                if let Some(p16) = p16.as_deref_mut() {
                    for (r, row) in group.chunks_exact(t).enumerate() {
                        let i = i0 + r;
                        p16.round_row(i - c0, row, block_end(i, blk.rows, t));
                    }
                }
            }
        },
    );
}

/// Dropout of the live entries of rows `[c0, c1)` of a `t × t` matrix of
/// sequence and head `task` (`b·heads + h`), held as [`probabilities`]
/// holds them: attention's probabilities in forward (and in backward before
/// dV), their gradient in backward before dS. With `m16`, each row's causal
/// block rounded to bf16 there after its drop (as [`probabilities`] rounds
/// it without dropout).
fn drop_rows(
    m: &mut [f32],
    dm: Dims,
    blk: Blocks,
    (drop, task): (Dropout, usize),
    first: Option<&[u32]>,
    (c0, c1): (usize, usize),
    mut m16: Option<&mut Rows16>,
) {
    let t = dm.t;
    vectorised(
        #[inline(always)]
        || {
            for (r, row) in m[..(c1 - c0) * t].chunks_exact_mut(t).enumerate() {
                let i = c0 + r;
                let l = live(first, i);
                let at = (task * t + i) * t;
                drop.apply_in_place(&mut row[l.clone()], at + l.start);
                if let Some(m16) = m16.as_deref_mut() {
                    m16.round_row(r, row, block_end(i, blk.rows, t));
                }
            }
        },
    );
}

/// dS = P ⊙ (dP − rowsum(dP ⊙ P)) of rows `[c0, c1)` over the live
/// entries, in place of dP in `ds`; the masked ones that products read
/// zero. With `ds16`, each row's causal block rounded to bf16 there too.
fn score_gradient(
    dm: Dims,
    blk: Blocks,
    first: Option<&[u32]>,
    (c0, c1): (usize, usize),
    p: &[f32],
    ds: &mut [f32],
    mut ds16: Option<&mut Rows16>,
) {
    let t = dm.t;
    let n = (c1 - c0) * t;
    vectorised(
        #[inline(always)]
        || {
            // Rows in groups, as the softmax's.
            let groups = p[..n]
                .chunks(ROW_GROUP * t)
                .zip(ds[..n].chunks_mut(ROW_GROUP * t))
                .enumerate();
            for (g, (p, ds)) in groups {
                let i0 = c0 + g * ROW_GROUP;
                let live = |r: usize| live(first, i0 + r);
                let mut c = [0f32; ROW_GROUP];
                let pairs = p.chunks_exact(t).zip(ds.chunks_exact(t));
                for (r, (prow, dsrow)) in pairs.enumerate() {
                    let l = live(r);
                    let (p, g) = (&prow[l.clone()], &dsrow[l]);
                    c[r] = sum_lanes([p, g], |[p, g]| p * g);
                }
                let pairs = p.chunks_exact(t).zip(ds.chunks_exact_mut(t));
                for (r, (prow, dsrow)) in pairs.enumerate() {
                    let l = live(r);
                    let (before, rest) = dsrow.split_at_mut(l.start);
                    let (live_ds, after) = rest.split_at_mut(l.len());
                    live_ds
                        .iter_mut()
                        .zip(&prow[l])
                        .for_each(|(g, &pv)| *g = pv * (*g - c[r]));
                    before[read_from(first, i0 + r, blk)..].fill(0.0);
                    after[..read_after(i0 + r, blk.rows, t)].fill(0.0);
                }
                if let Some(ds16) = ds16.as_deref_mut() {
                    for (r, dsrow) in ds.chunks_exact(t).enumerate() {
                        let i = i0 + r;
                        ds16.round_row(i - c0, dsrow, block_end(i, blk.rows, t));
                    }
                }
            }
        },
    );
}

impl CustomOp1 for CausalAttention {
    fn name(&self) -> &'static str {
        "zrun-causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let qkv = f32_input(self.name(), s, l)?;
        let dm = Dims::of(l, self.0.heads)?;
        dm.check(self.1.as_ref())?;
        // Every element is written by one product below (no zeroing pass).
        let mut y = uninit_floats(dm.b * dm.t * dm.d);
        let out = Out::F32(Shared(y.as_mut_ptr().cast()));
        forward_tasks(qkv, dm, self.0, self.1.as_ref(), out);
        // SAFETY: the tasks covered every (sequence, head) and each product
        // every row of its head's columns.
        let y = unsafe { assume_init(y) };
        Ok((CpuStorage::F32(y), Shape::from_dims(&[dm.b, dm.t, dm.d])))
    }

    fn bwd(&self, qkv: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(backward_in_blocks(qkv, dy, self.0, self.1.as_ref())?))
    }
}

/// d qkv from (qkv, dy), with the forward's documents.
struct CausalAttentionGrad(Blocks, Option<Documents>);

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
        let dy = f32_input(self.name(), s2, l2)?;
        let dm = Dims::of(l1, self.0.heads)?;
        let docs = self.1.as_ref();
        dm.check(docs)?;
        let dqkv = match input(self.name(), s1, l1)? {
            Input::F32(qkv) => backward_tasks(qkv, dy, dm, self.0, docs)?,
            Input::Bf16(_) if self.0.products == Products::F32 => {
                candle_core::bail!("{BITS_NEED_BF16}")
            }
            Input::Bf16(qkv) => backward_tasks(qkv, dy, dm, self.0, docs)?,
        };
        Ok((CpuStorage::F32(dqkv), l1.shape().clone()))
    }
}

/// d qkv (f32, qkv's shape) from qkv and dy: one task per (sequence,
/// key/value head).
fn backward_tasks<T: Values>(
    qkv: &[T],
    dy: &[f32],
    dm: Dims,
    blk: Blocks,
    docs: Option<&Documents>,
) -> Result<Vec<f32>> {
    let (t, d, w, hd) = (dm.t, dm.d, dm.w, dm.hd);
    let rows = blk.rows;
    if dy.len() != dm.b * t * d {
        candle_core::bail!("attention backward: dy has {} elements", dy.len());
    }
    let scale = 1.0 / (hd as f32).sqrt();
    // Every element is written: dQ by each query head, dK and dV first by
    // each group's first head (no zeroing pass).
    let mut dqkv = uninit_floats(qkv.len());
    let out = Shared(dqkv.as_mut_ptr().cast());
    let kv_heads = dm.heads / dm.group;
    // One task a leaf (simd's module doc).
    let tasks = (0..dm.b * kv_heads).into_par_iter().with_max_len(1);
    let bf16 = blk.products == Products::Bf16;
    let held = blk.held_rows(t);
    tasks.for_each(|task| {
        with_packs(|[kt, kp, vt, qp, dyp]| {
            with_scratch(held * t, held * t, |p, ds| {
                with_bits(if bf16 { held } else { 0 }, t, |mut p16, mut ds16| {
                    let (bi, g) = (task / kv_heads, task % kv_heads);
                    let base = bi * t * w;
                    let first = docs.map(|d| d.firsts(bi));
                    let k = view(qkv, base + dm.k(g), t, hd, w);
                    blk.pack(kt, k.t());
                    blk.pack(kp, k);
                    blk.pack(vt, view(qkv, base + dm.v(g), t, hd, w).t());
                    for (nth, h) in (g * dm.group..(g + 1) * dm.group).enumerate() {
                        blk.pack(qp, view(qkv, base + dm.q(h), t, hd, w));
                        let dy_h = view(dy, bi * t * d + h * hd, t, hd, d);
                        blk.pack(dyp, dy_h);
                        // The mask's (sequence, head) as the forward's task.
                        let drop = blk.dropout.map(|d| (d, bi * dm.heads + h));
                        for chunk in blk.chunks(t) {
                            let (c0, c1) = chunk;
                            let rounded = (bf16 && blk.dropout.is_none()).then_some(&mut p16);
                            probabilities(qkv, dm, blk, (bi, h), first, kt, chunk, p, rounded);
                            // dP = dY · Vᵀ, the live blocks only, into ds.
                            for (i0, i1) in blk.blocks_of(chunk) {
                                let dy_blk = dy_h.sub_rows(i0, i1);
                                let k0 = keys_from(first, i0, vt.panel_width());
                                // SAFETY: rows i0..i1, columns k0..i1 of ds.
                                unsafe {
                                    product(
                                        blk.products,
                                        ds[(i0 - c0) * t + k0..].as_mut_ptr(),
                                        t,
                                        i1 - k0,
                                        dy_blk,
                                        vt,
                                        (0..hd, k0),
                                        1.0,
                                        false,
                                    )
                                };
                            }
                            // With dropout that is the dropped probabilities'
                            // gradient: the undropped ones' is it dropped alike.
                            if let Some(drop) = drop {
                                drop_rows(ds, dm, blk, drop, first, chunk, None);
                            }
                            let rounded = bf16.then_some(&mut ds16);
                            score_gradient(dm, blk, first, chunk, p, ds, rounded);
                            // dV reads the probabilities the forward multiplied
                            // V by: dropped, where they are, from here on.
                            if let Some(drop) = drop {
                                let rounded = bf16.then_some(&mut p16);
                                drop_rows(p, dm, blk, drop, first, chunk, rounded);
                            }
                            let (p, ds) = (&*p, &*ds);
                            let (p_bits, ds_bits) = (bf16.then_some(&p16), bf16.then_some(&ds16));
                            // Blocks of key columns [j0, j1) see query rows
                            // [j0, t), this chunk's of them here. The first
                            // query head writes dK and dV, in the chunk that
                            // holds their first query; later chunks and heads
                            // add to them, in order.
                            for (j0, j1) in blocks(c1, rows) {
                                let (q0, q1) = (j0.max(c0), queries_to(first, j1, t).min(c1));
                                if q0 >= q1 {
                                    continue;
                                }
                                let add = nth > 0 || j0 < c0;
                                let (at, shape) = ((q0 - c0, j0), (q1 - q0, j1 - j0));
                                // SAFETY: dV and dK rows j0..j1 of this task's
                                // key/value head: its alone (as are dQ's rows
                                // of its query heads).
                                unsafe {
                                    // dV (+)= Pᵀ · dY
                                    let dv = out.at(base + j0 * w + dm.v(g));
                                    let p_t = Part::of(p, t, p_bits, at, shape).t();
                                    let rows = (q0..q1, 0);
                                    product_of_part(
                                        blk.products,
                                        dv,
                                        w,
                                        hd,
                                        p_t,
                                        dyp,
                                        rows.clone(),
                                        1.0,
                                        add,
                                    );
                                    // dK (+)= dSᵀ · Q · scale
                                    let dk = out.at(base + j0 * w + dm.k(g));
                                    let ds_t = Part::of(ds, t, ds_bits, at, shape).t();
                                    product_of_part(
                                        blk.products,
                                        dk,
                                        w,
                                        hd,
                                        ds_t,
                                        qp,
                                        rows,
                                        scale,
                                        add,
                                    )
                                };
                            }
                            for (i0, i1) in blk.blocks_of(chunk) {
                                // SAFETY: dQ rows i0..i1 of query head h: this
                                // task's.
                                unsafe {
                                    // dQ = dS · K · scale
                                    let dq = out.at(base + i0 * w + dm.q(h));
                                    let k0 = keys_from(first, i0, blk.depth_start());
                                    let at = (i0 - c0, k0);
                                    let ds_blk = Part::of(ds, t, ds_bits, at, (i1 - i0, i1 - k0));
                                    product_of_part(
                                        blk.products,
                                        dq,
                                        w,
                                        hd,
                                        ds_blk,
                                        kp,
                                        (k0..i1, 0),
                                        scale,
                                        false,
                                    )
                                };
                            }
                        }
                    }
                })
            })
        })
    });
    // SAFETY: as the comment above says.
    Ok(unsafe { assume_init(dqkv) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::{bf16_bits_of, rounded};
    use candle_core::{Device, Var, D};

    /// The composed reference: heads (each key/value head repeated for its
    /// query heads), scaled scores, causal mask (and with `docs`, the keys
    /// before each row's document's first masked too; with `window`, the
    /// keys `window` or more before the row), softmax, P·V.
    fn composed(
        qkv: &Tensor,
        heads: Heads,
        docs: Option<&Documents>,
        window: Option<usize>,
        dropout: Option<Dropout>,
    ) -> Result<Tensor> {
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
        let mask: Vec<f32> = (0..b * t * t)
            .map(|n| {
                let (seq, i, j) = (n / (t * t), n / t % t, n % t);
                let first = docs.map_or(0, |d| d.firsts(seq)[i] as usize);
                let far = window.is_some_and(|w| i - j >= w);
                if j > i || j < first || far {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (b, 1, t, t), &Device::Cpu)?;
        let s = s.broadcast_add(&mask)?;
        let max = s.max_keepdim(D::Minus1)?.detach();
        let e = s.broadcast_sub(&max)?.exp()?;
        let mut p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        if let Some(d) = dropout {
            // The mask as a constant: 0 or 1 / (1 - p) per probability.
            let n = b * heads.heads * t * t;
            let kept: Vec<f32> = (0..n).map(|i| d.apply_one(i, 1.0)).collect();
            p = (p * Tensor::from_vec(kept, (b, heads.heads, t, t), &Device::Cpu)?)?;
        }
        p.matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, t, heads.heads * hd))
    }

    /// A qkv input `[b, t, (heads + 2·kv)·hd]` and an output gradient, of
    /// deterministic values within 1 in magnitude.
    fn inputs(heads: Heads, b: usize, t: usize, hd: usize) -> (Tensor, Tensor) {
        let n = b * t * (heads.heads + 2 * heads.kv) * hd;
        let vals: Vec<f32> = (0..n)
            .map(|i| ((i * 53 % 211) as f32 / 97.0) - 1.0)
            .collect();
        let x = Tensor::from_vec(vals, (b, t, n / (b * t)), &Device::Cpu).unwrap();
        let dy: Vec<f32> = (0..b * t * heads.heads * hd)
            .map(|i| (i % 17) as f32 * 0.07 - 0.5)
            .collect();
        let dy = Tensor::from_vec(dy, (b, t, heads.heads * hd), &Device::Cpu).unwrap();
        (x, dy)
    }

    /// Documents in two sequences of `t`: the first cut after tokens 2, 3
    /// (a document of one token) and 20 (when `t` reaches it), the second
    /// after token 4.
    fn documents(t: usize) -> Documents {
        let mut ids = vec![0u32; 2 * t];
        let first = [2, 3, 20].into_iter().filter(|&at| at < t);
        for at in first.chain((4 < t).then_some(t + 4)) {
            ids[at] = 1;
        }
        Documents::after_eos(&ids, t, 1)
    }

    /// The blocking skips masked work without changing a bit: forward and
    /// backward in blocks of 1, 5 and 24 rows (two blocks over 37 tokens)
    /// are equal, element for element, with documents or without.
    #[test]
    fn the_block_size_does_not_change_a_bit() {
        let heads = Heads { heads: 4, kv: 2 };
        let (b, t, hd) = (2, 37, 8);
        let (x, dy) = inputs(heads, b, t, hd);
        let bits = |t: Tensor| -> Vec<u32> {
            t.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        let docs = documents(t);
        for docs in [None, Some(&docs)] {
            let y = |rows| bits(forward_in_blocks(&x, f32_blocks(heads, rows), docs).unwrap());
            let dx = |rows| {
                let blk = f32_blocks(heads, rows);
                bits(backward_in_blocks(&x, &dy, blk, docs).unwrap())
            };
            for rows in [1, 5] {
                let f32_rows = block_rows(Products::F32);
                assert!(y(rows) == y(f32_rows), "forward, blocks of {rows}");
                assert!(dx(rows) == dx(f32_rows), "backward, blocks of {rows}");
            }
        }
    }

    fn f32_blocks(heads: Heads, rows: usize) -> Blocks {
        Blocks::new(heads, rows, Products::F32)
    }

    /// The output written in bf16 has the bits of the f32 output (of the same
    /// bf16 products) rounded as the output projection rounds it, in rows
    /// laid out for the products, with grouped heads and a ragged last block.
    #[test]
    fn attention_written_in_bf16_is_its_f32_output_rounded() {
        if !zgemm::has_native_bf16() {
            eprintln!("zmodel: no native bf16 here; attention's bf16 output NOT covered");
            return;
        }
        let heads = Heads { heads: 4, kv: 2 };
        // Sequences longer than a head and shorter than one (a block's
        // product then needs more scratch than the probabilities).
        for (b, t, hd) in [(2, 77, 16), (2, 5, 32)] {
            let (x, _) = inputs(heads, b, t, hd);
            let docs = documents(t);
            for docs in [None, Some(&docs)] {
                let want = causal_attention(&x, heads, Products::Bf16, docs, None).unwrap();
                let got = causal_attention_bf16(&x, heads, docs, None).unwrap();
                assert_eq!(got.dims(), &[b * t, heads.heads * hd]);
                let stride = zgemm::bf16_row_stride(heads.heads * hd);
                assert_eq!(got.layout().stride()[0], stride);
                let what = format!("t {t}, head size {hd}, documents {}", docs.is_some());
                assert_eq!(bf16_bits_of(&got), rounded(&want), "{what}");
            }
        }
    }

    /// A bf16 `qkv` (a projection that rounded its output as it stored)
    /// gives the bits of the f32 one under bf16 products, forward and
    /// backward: every product rounds its operands to those bits anyway.
    /// f32 products refuse it.
    #[test]
    fn bf16_inputs_give_the_bits_of_their_f32_values() {
        if !zgemm::has_native_bf16() {
            eprintln!("zmodel: no native bf16 here; attention's bf16 inputs NOT covered");
            return;
        }
        let heads = Heads { heads: 4, kv: 2 };
        let bits = |t: Tensor| -> Vec<u32> {
            let t = t.to_dtype(candle_core::DType::F32).unwrap();
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.into_iter().map(f32::to_bits).collect()
        };
        // Whole 32-row tiles of head size 32 (read in place) and ragged ones.
        for (b, t, hd) in [(2, 77, 16), (2, 5, 32), (1, 64, 32)] {
            let (x, dy) = inputs(heads, b, t, hd);
            let x16 = x.to_dtype(candle_core::DType::BF16).unwrap();
            let what = format!("b {b}, t {t}, head size {hd}");
            assert_eq!(
                bits(causal_attention_bf16(&x16, heads, None, None).unwrap()),
                bits(causal_attention_bf16(&x, heads, None, None).unwrap()),
                "forward: {what}"
            );
            let grad =
                |x: &Tensor| causal_attention_backward(x, &dy, heads, Products::Bf16, None, None);
            assert_eq!(
                bits(grad(&x16).unwrap()),
                bits(grad(&x).unwrap()),
                "backward: {what}"
            );
            let refused = causal_attention_backward(&x16, &dy, heads, Products::F32, None, None);
            assert!(refused
                .unwrap_err()
                .to_string()
                .contains("bf16 products only"));
        }
    }

    /// bf16 products (where the CPU multiplies bf16 natively): within bf16's rounding of the
    /// f32 attention forward and backward, not its bits (they are used), and
    /// the same bits in blocks of 32 and 64 rows (the extra depth of a
    /// longer block is zero pairs).
    #[test]
    fn bf16_products_stay_near_f32_and_their_blocking_changes_no_bit() {
        if !zgemm::has_native_bf16() {
            eprintln!("zmodel: no native bf16 here; attention's bf16 products NOT covered");
            return;
        }
        let heads = Heads { heads: 4, kv: 2 };
        let (b, t, hd) = (2, 77, 16);
        let (x, dy) = inputs(heads, b, t, hd);
        let values = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let run = |products, rows| {
            let blk = Blocks::new(heads, rows, products);
            let y = values(forward_in_blocks(&x, blk, None).unwrap());
            let dx = values(backward_in_blocks(&x, &dy, blk, None).unwrap());
            (y, dx)
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let (y32, dx32) = run(Products::F32, block_rows(Products::F32));
        let (y, dx) = run(Products::Bf16, block_rows(Products::Bf16));
        let (y_32, dx_32) = run(Products::Bf16, 32);
        assert!(bits(&y) == bits(&y_32) && bits(&dx) == bits(&dx_32));
        assert!(bits(&y) != bits(&y32) && bits(&dx) != bits(&dx32));
        // Inputs within 1 in magnitude, rounded to 8 significant bits: the
        // outputs (averages of V) and gradients move by well under 2%.
        for (name, got, want) in [("y", &y, &y32), ("dqkv", &dx, &dx32)] {
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = got
                .iter()
                .zip(want)
                .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
            assert!(
                worst <= 0.02 * scale,
                "{name}: off by {worst}, scale {scale}"
            );
        }
    }

    /// Long sequences of many documents, where the products skip whole
    /// panels of keys before a block's documents and the backward's skip
    /// the queries after them: f32 products within 1e-5 of the composed
    /// reference forward and backward, bf16 ones within 2% (of the largest
    /// value; where the CPU has native bf16).
    #[test]
    fn documents_skip_what_they_mask_and_match_the_composed_version() {
        let (heads, x, dy, docs) = long_sequences_of_documents();
        let (want, want_dx) = composed_and_grad(&x, &dy, heads, Some(&docs), None, None);
        for products in products_here("attention of documents") {
            let tol = if products == Products::F32 {
                1e-5
            } else {
                0.02
            };
            let y = causal_attention(&x, heads, products, Some(&docs), None).unwrap();
            close_to(&y, &want, tol, &format!("{products:?} forward"));
            let dx =
                causal_attention_backward(&x, &dy, heads, products, Some(&docs), None).unwrap();
            close_to(&dx, &want_dx, tol, &format!("{products:?} backward"));
        }
    }

    /// A sliding window (`model.sliding_window`) is a lower bound per row as
    /// a document is: windows of 1, 7, 64 and 199 keys over sequences of
    /// 200, alone and with documents, against the composed reference, which
    /// masks the keys `window` or more before each row itself: f32 products
    /// within 1e-5 forward and backward, bf16 ones within 2% (where the CPU
    /// has native bf16).
    #[test]
    fn a_sliding_window_matches_the_composed_version() {
        let (heads, x, dy, docs) = long_sequences_of_documents();
        let (b, t, _) = x.dims3().unwrap();
        let products = products_here("windowed attention");
        for (w, docs) in [1, 7, 64, 199]
            .into_iter()
            .flat_map(|w| [(w, None), (w, Some(&docs))])
        {
            let (want, want_dx) = composed_and_grad(&x, &dy, heads, docs, Some(w), None);
            let bounds = Documents::windowed(docs, b, t, w);
            for &products in &products {
                let tol = if products == Products::F32 {
                    1e-5
                } else {
                    0.02
                };
                let what = format!("{products:?} window {w} documents {}", docs.is_some());
                let y = causal_attention(&x, heads, products, Some(&bounds), None).unwrap();
                close_to(&y, &want, tol, &format!("{what} forward"));
                let dx = causal_attention_backward(&x, &dy, heads, products, Some(&bounds), None)
                    .unwrap();
                close_to(&dx, &want_dx, tol, &format!("{what} backward"));
            }
        }
    }

    /// A task holds a chunk of query rows' probabilities at a time, not
    /// all `t` ([`CHUNK_ROWS`]). In chunks of one block and more (and a
    /// short last one), with documents (a window's among them) and
    /// dropout: the forward, dQ and dV have the bits of one chunk (each
    /// row's own products; dV's α = 1 chain continued), dK is within
    /// rounding of it (each chunk's sum added), and every result is within
    /// the composed reference's bounds.
    #[test]
    fn chunks_of_queries_keep_the_bits_but_dks_and_match_the_composed_version() {
        let (heads, x, dy, docs) = long_sequences_of_documents();
        let (b, t, w) = x.dims3().unwrap();
        let d = heads.heads * (w / (heads.heads + 2 * heads.kv));
        let windowed = Documents::windowed(Some(&docs), b, t, 50);
        let drop = Dropout::new(0.25, 3).unwrap();
        let values = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for products in products_here("attention in chunks") {
            let (rows, tol) = match products {
                Products::F32 => (24, 1e-5),
                Products::Bf16 => (64, 0.02),
            };
            for (docs, dropout) in [
                (None, None),
                (Some(&docs), None),
                (Some(&windowed), Some(drop)),
            ] {
                let blk = Blocks::new(heads, rows, products).with_dropout(dropout);
                assert!(blk.chunk >= t, "the default is one chunk here");
                let whole_y = values(forward_in_blocks(&x, blk, docs).unwrap());
                let whole_dx = values(backward_in_blocks(&x, &dy, blk, docs).unwrap());
                let (want, want_dx) = composed_and_grad(&x, &dy, heads, docs, None, dropout);
                for chunk in [rows, 2 * rows, 3 * rows] {
                    let what = format!(
                        "{products:?}, chunks of {chunk}, documents {}, dropout {}",
                        docs.is_some(),
                        dropout.is_some()
                    );
                    let blk = Blocks { chunk, ..blk };
                    let y = forward_in_blocks(&x, blk, docs).unwrap();
                    assert!(
                        bits(&values(y.clone())) == bits(&whole_y),
                        "{what}: forward"
                    );
                    let dx = backward_in_blocks(&x, &dy, blk, docs).unwrap();
                    let got = values(dx.clone());
                    // Each row of dqkv: dQ (d columns), dK, dV (d·kv/heads each).
                    let dk_cols = d..d + d * heads.kv / heads.heads;
                    let (mut dk_max, mut dk_off) = (0f32, 0f32);
                    for (g, e) in got.chunks(w).zip(whole_dx.chunks(w)) {
                        let (q_v, k) = (
                            |r: &[f32]| {
                                let mut v = r[..d].to_vec();
                                v.extend_from_slice(&r[dk_cols.end..]);
                                v
                            },
                            |r: &[f32]| r[dk_cols.clone()].to_vec(),
                        );
                        assert!(bits(&q_v(g)) == bits(&q_v(e)), "{what}: dQ and dV");
                        for (a, b) in k(g).iter().zip(k(e)) {
                            dk_max = dk_max.max(b.abs());
                            dk_off = dk_off.max((a - b).abs());
                        }
                    }
                    assert!(
                        dk_off <= 1e-6 * dk_max,
                        "{what}: dK off by {dk_off} of {dk_max}"
                    );
                    close_to(&y, &want, tol, &format!("{what}: forward"));
                    close_to(&dx, &want_dx, tol, &format!("{what}: backward"));
                }
            }
        }
    }

    /// Two sequences of 200 tokens (4 heads of 16 on 2 key/value heads, an
    /// input and an output gradient) and documents in them: one of a
    /// single token, others across blocks of rows.
    fn long_sequences_of_documents() -> (Heads, Tensor, Tensor, Documents) {
        let heads = Heads { heads: 4, kv: 2 };
        let (b, t, hd) = (2, 200, 16);
        let (x, dy) = inputs(heads, b, t, hd);
        let mut ids = vec![0u32; b * t];
        for at in [40, 41, 100, 170, t + 64, t + 130] {
            ids[at] = 1;
        }
        (heads, x, dy, Documents::after_eos(&ids, t, 1))
    }

    /// f32 products, and bf16 ones where the CPU has native bf16 (else it
    /// says that `what` in bf16 is not covered here).
    fn products_here(what: &str) -> Vec<Products> {
        let mut products = vec![Products::F32];
        if zgemm::has_native_bf16() {
            products.push(Products::Bf16);
        } else {
            eprintln!("zmodel: no native bf16 here; bf16 {what} NOT covered");
        }
        products
    }

    /// Multi-head (3 of 3) and grouped-query (4 query heads on 2), in causal
    /// blocks of 1, 3 and 24 rows (one block, several with a short last
    /// one), with documents kept apart and without.
    #[test]
    fn matches_the_composed_version_forward_and_backward() {
        let cases = [(3, 3), (4, 2), (4, 1)]
            .into_iter()
            .flat_map(|h| [1, 3, block_rows(Products::F32)].map(|r| (h, r)));
        for (((heads, kv), rows), with_documents) in cases.flat_map(|c| [(c, false), (c, true)]) {
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
            let docs = documents(t);
            let docs = with_documents.then_some(&docs);
            let fused = forward_in_blocks(x.as_tensor(), f32_blocks(heads, rows), docs).unwrap();
            let reference = composed(x.as_tensor(), heads, docs, None, None).unwrap();
            let diff = (&fused - &reference)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap();
            assert!(
                diff.to_scalar::<f32>().unwrap() < 1e-5,
                "{heads:?} rows {rows} documents {with_documents}"
            );
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
                "{heads:?} rows {rows} documents {with_documents}: gradient differs by {diff}"
            );
        }
    }

    /// Dropped probabilities against the composed reference with the same
    /// mask as a constant (autograd's backward of it): f32 within 1e-5 and
    /// bf16 products within 2% (where the CPU multiplies bf16), multi-head
    /// and grouped-query, in causal blocks of 1, 3 and 24 rows (and bf16's
    /// 64), with documents kept apart and without; the dropout changes the
    /// output.
    #[test]
    fn dropped_attention_matches_the_composed_version() {
        let d = Dropout::new(0.25, 3).unwrap();
        let mut runs: Vec<(Products, usize)> = [1, 3, block_rows(Products::F32)]
            .map(|r| (Products::F32, r))
            .to_vec();
        if zgemm::has_native_bf16() {
            runs.push((Products::Bf16, block_rows(Products::Bf16)));
        } else {
            eprintln!("zmodel: no native bf16 here; bf16 attention dropout NOT covered");
        }
        for (heads, kv) in [(3, 3), (4, 2)] {
            let heads = Heads { heads, kv };
            let (b, t, hd) = (2, 37, 8);
            let (x, dy) = inputs(heads, b, t, hd);
            for with_documents in [false, true] {
                let docs = documents(t);
                let docs = with_documents.then_some(&docs);
                let (want, want_dx) = composed_and_grad(&x, &dy, heads, docs, None, Some(d));
                let plain = composed(&x, heads, docs, None, None).unwrap();
                let moved = (&plain - &want).unwrap().abs().unwrap().max_all().unwrap();
                assert!(moved.to_scalar::<f32>().unwrap() > 0.01, "nothing dropped");
                for &(products, rows) in &runs {
                    let blk = Blocks::new(heads, rows, products).with_dropout(Some(d));
                    let what =
                        format!("{heads:?} {products:?} rows {rows} documents {with_documents}");
                    let tol = match products {
                        Products::F32 => 1e-5,
                        Products::Bf16 => 0.02,
                    };
                    let y = forward_in_blocks(&x, blk, docs).unwrap();
                    close_to(&y, &want, tol, &format!("{what} forward"));
                    let dx = backward_in_blocks(&x, &dy, blk, docs).unwrap();
                    close_to(&dx, &want_dx, tol, &format!("{what} backward"));
                }
            }
        }
    }

    /// [`composed`]'s output of `x` and, by autograd, the gradient of its
    /// product with `dy` with respect to `x`.
    fn composed_and_grad(
        x: &Tensor,
        dy: &Tensor,
        heads: Heads,
        docs: Option<&Documents>,
        window: Option<usize>,
        dropout: Option<Dropout>,
    ) -> (Tensor, Tensor) {
        let x_var = Var::from_tensor(x).unwrap();
        let y = composed(x_var.as_tensor(), heads, docs, window, dropout).unwrap();
        let grads = (&y * dy).unwrap().sum_all().unwrap().backward().unwrap();
        let dx = grads.get(x_var.as_tensor()).unwrap().clone();
        (y, dx)
    }

    /// Every element of `got` within `tol` times the largest of `want`.
    fn close_to(got: &Tensor, want: &Tensor, tol: f32, what: &str) {
        let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (got, want) = (values(got), values(want));
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
        assert!(
            worst <= tol * scale,
            "{what}: off by {worst}, scale {scale}"
        );
    }
}
