//! A block's parameters by name.
//!
//! The engine keeps a block's parameters in one flat buffer, in a fixed order,
//! and hands them to the model as a list; the model reads them by name through
//! these structs. Each struct's `into_vec` / `from_vec` is the one place that
//! order is written, and [`crate::Gpt::groups`] builds the parameter specs
//! through the same structs, so specs, values and gradients cannot disagree on
//! it. The structs are generic: `BlockParams<Tensor>` holds values or
//! gradients, `BlockParams<ParamSpec>` names and shapes. They name slots, not
//! one family's layers: GPT-2 and LLaMA fill the same slots, LLaMA without
//! biases (but Qwen2's on q, k and v) or a position table and with a head
//! matrix of its own, Qwen3 with norms of each head's q and k
//! ([`ParamLayout`]).

use candle_core::{Error, Result};

/// Which parameters a family's structs hold (the rest are `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamLayout {
    /// The norms have biases (GPT-2).
    pub norm_biases: bool,
    /// Which of a block's linears have biases, in their order (GPT-2's
    /// all; LLaMA's none, or q, k and v with `model.qkv_bias`).
    pub linear_biases: [bool; 4],
    /// A block has norms of each head's q and k (Qwen3).
    pub qk_norms: bool,
    /// The embedding has a position table (GPT-2).
    pub positions: bool,
    /// The head has its own output matrix (an untied LLaMA).
    pub lm_head: bool,
}

impl ParamLayout {
    /// The layout of the model `m` describes.
    pub fn of(m: &zconfig::spec::ModelSpec) -> ParamLayout {
        ParamLayout {
            norm_biases: m.norm_biases(),
            linear_biases: m.linear_biases(),
            qk_norms: m.qk_normed(),
            positions: m.learned_positions(),
            lm_head: !m.tied(),
        }
    }
}

/// A weight and its bias, if the family has biases: a linear layer (weight
/// `[in, out]`) or a norm.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightBias<T> {
    /// Weight.
    pub weight: T,
    /// Bias.
    pub bias: Option<T>,
}

impl<T> WeightBias<T> {
    fn push_into(self, out: &mut Vec<T>) {
        out.push(self.weight);
        out.extend(self.bias);
    }

    fn take(it: &mut impl Iterator<Item = T>, bias: bool) -> Option<WeightBias<T>> {
        Some(WeightBias {
            weight: it.next()?,
            bias: if bias { Some(it.next()?) } else { None },
        })
    }

    /// The weight, then the bias if there is one.
    pub fn into_vec(self) -> Vec<T> {
        let mut v = Vec::with_capacity(2);
        self.push_into(&mut v);
        v
    }

    /// `f` applied to the weight and the bias.
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> WeightBias<U> {
        WeightBias {
            weight: f(self.weight),
            bias: self.bias.map(f),
        }
    }
}

/// Takes exactly `count` items of `what` from `v` through `build`.
fn exactly<T, P>(
    v: Vec<T>,
    count: usize,
    what: &str,
    build: impl FnOnce(&mut std::vec::IntoIter<T>) -> Option<P>,
) -> Result<P> {
    let n = v.len();
    let mut it = v.into_iter();
    match build(&mut it) {
        Some(p) if it.next().is_none() => Ok(p),
        _ => Err(Error::Msg(format!(
            "{what} has {count} parameters, got {n}"
        ))),
    }
}

/// The embedding: the token table (also the head when tied) and GPT-2's
/// position table.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingParams<T> {
    /// Token embedding `[vocab, d]`.
    pub wte: T,
    /// Position embedding `[seq, d]` (GPT-2).
    pub wpe: Option<T>,
}

impl<T> EmbeddingParams<T> {
    /// In the flat order.
    pub fn into_vec(self) -> Vec<T> {
        let mut v = vec![self.wte];
        v.extend(self.wpe);
        v
    }

    /// From the flat order; an error unless there are exactly as many as
    /// `layout` says.
    pub fn from_vec(v: Vec<T>, layout: ParamLayout) -> Result<Self> {
        exactly(
            v,
            1 + usize::from(layout.positions),
            "the embedding",
            |it| {
                Some(EmbeddingParams {
                    wte: it.next()?,
                    wpe: if layout.positions {
                        Some(it.next()?)
                    } else {
                        None
                    },
                })
            },
        )
    }
}

/// A pre-norm transformer block by slot (see `zconfig::arch` for each
/// family's names and shapes).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockParams<T> {
    /// The norm before attention.
    pub norm_1: WeightBias<T>,
    /// The q, k, v projection.
    pub qkv: WeightBias<T>,
    /// The norm of each head's q (Qwen3), its weight `[head_dim]`.
    pub q_norm: Option<WeightBias<T>>,
    /// The norm of each head's k (Qwen3).
    pub k_norm: Option<WeightBias<T>>,
    /// Attention's output projection `[heads·head_dim, d]`.
    pub attn_out: WeightBias<T>,
    /// The norm before the MLP.
    pub norm_2: WeightBias<T>,
    /// The MLP's expansion (LLaMA: gate and up side by side).
    pub mlp_in: WeightBias<T>,
    /// The MLP's projection back to `d`.
    pub mlp_out: WeightBias<T>,
}

impl<T> BlockParams<T> {
    /// In the flat order.
    pub fn into_vec(self) -> Vec<T> {
        let mut v = Vec::with_capacity(12);
        self.norm_1.push_into(&mut v);
        self.qkv.push_into(&mut v);
        for n in [self.q_norm, self.k_norm].into_iter().flatten() {
            n.push_into(&mut v);
        }
        self.attn_out.push_into(&mut v);
        self.norm_2.push_into(&mut v);
        self.mlp_in.push_into(&mut v);
        self.mlp_out.push_into(&mut v);
        v
    }

    /// From the flat order; an error unless there are exactly as many as
    /// `layout` says (6 weights, Qwen3's 2 norms, and each bias: GPT-2 12).
    pub fn from_vec(v: Vec<T>, layout: ParamLayout) -> Result<Self> {
        let n = layout.norm_biases;
        let [qkv, attn_out, mlp_in, mlp_out] = layout.linear_biases;
        let biases = 2 * usize::from(n) + layout.linear_biases.iter().filter(|&&b| b).count();
        let qk_norms = 2 * usize::from(layout.qk_norms);
        let qk_norm = |it: &mut std::vec::IntoIter<T>| match layout.qk_norms {
            true => WeightBias::take(it, false).map(Some),
            false => Some(None),
        };
        exactly(v, 6 + qk_norms + biases, "a block", |it| {
            // Struct fields are evaluated in the order written.
            Some(BlockParams {
                norm_1: WeightBias::take(it, n)?,
                qkv: WeightBias::take(it, qkv)?,
                q_norm: qk_norm(it)?,
                k_norm: qk_norm(it)?,
                attn_out: WeightBias::take(it, attn_out)?,
                norm_2: WeightBias::take(it, n)?,
                mlp_in: WeightBias::take(it, mlp_in)?,
                mlp_out: WeightBias::take(it, mlp_out)?,
            })
        })
    }
}

/// The head: the final norm and, untied, its own output matrix `[vocab, d]`
/// (otherwise the output matrix is `wte`).
#[derive(Debug, Clone, PartialEq)]
pub struct HeadParams<T> {
    /// Final norm.
    pub norm: WeightBias<T>,
    /// The untied output matrix.
    pub lm_head: Option<T>,
}

impl<T> HeadParams<T> {
    /// In the flat order.
    pub fn into_vec(self) -> Vec<T> {
        let mut v = Vec::with_capacity(2);
        self.norm.push_into(&mut v);
        v.extend(self.lm_head);
        v
    }

    /// From the flat order; an error unless there are exactly as many as
    /// `layout` says.
    pub fn from_vec(v: Vec<T>, layout: ParamLayout) -> Result<Self> {
        exactly(
            v,
            1 + usize::from(layout.norm_biases) + usize::from(layout.lm_head),
            "the head",
            |it| {
                Some(HeadParams {
                    norm: WeightBias::take(it, layout.norm_biases)?,
                    lm_head: if layout.lm_head {
                        Some(it.next()?)
                    } else {
                        None
                    },
                })
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPT: ParamLayout = ParamLayout {
        norm_biases: true,
        linear_biases: [true; 4],
        qk_norms: false,
        positions: true,
        lm_head: false,
    };
    const LLAMA: ParamLayout = ParamLayout {
        norm_biases: false,
        linear_biases: [false; 4],
        qk_norms: false,
        positions: false,
        lm_head: true,
    };

    #[test]
    fn flat_order_round_trips_and_counts_are_checked() {
        let v: Vec<usize> = (0..12).collect();
        let b = BlockParams::from_vec(v.clone(), GPT).unwrap();
        assert_eq!(
            (b.norm_1.weight, b.qkv.bias, b.mlp_out.bias),
            (0, Some(3), Some(11))
        );
        assert_eq!(b.into_vec(), v);
        assert!(BlockParams::from_vec((0..11).collect::<Vec<_>>(), GPT).is_err());
        let e = BlockParams::from_vec((0..13).collect::<Vec<_>>(), GPT).unwrap_err();
        assert!(
            e.to_string().contains("a block has 12 parameters, got 13"),
            "{e}"
        );
        assert_eq!(
            EmbeddingParams::from_vec(vec![7, 8], GPT).unwrap().wpe,
            Some(8)
        );
        assert!(HeadParams::from_vec(vec![1], GPT).is_err());
        assert_eq!(
            HeadParams::from_vec(vec![1, 2], GPT).unwrap().into_vec(),
            vec![1, 2]
        );
        // LLaMA: weights only, no position table, a head matrix of its own.
        let l = BlockParams::from_vec((0..6).collect::<Vec<_>>(), LLAMA).unwrap();
        assert_eq!(
            (l.attn_out.weight, l.mlp_out.weight, l.qkv.bias),
            (2, 5, None)
        );
        assert_eq!(l.into_vec(), (0..6).collect::<Vec<_>>());
        assert!(BlockParams::from_vec((0..12).collect::<Vec<_>>(), LLAMA).is_err());
        assert!(EmbeddingParams::from_vec(vec![7, 8], LLAMA).is_err());
        let h = HeadParams::from_vec(vec![1, 2], LLAMA).unwrap();
        assert_eq!((h.norm.bias, h.lm_head), (None, Some(2)));
        // Qwen2: LLaMA with biases on q, k and v alone.
        let qwen2 = ParamLayout {
            linear_biases: [true, false, false, false],
            ..LLAMA
        };
        let q = BlockParams::from_vec((0..7).collect::<Vec<_>>(), qwen2).unwrap();
        assert_eq!(
            (q.qkv.weight, q.qkv.bias, q.attn_out.weight, q.attn_out.bias),
            (1, Some(2), 3, None)
        );
        assert_eq!(q.into_vec(), (0..7).collect::<Vec<_>>());
        assert!(BlockParams::from_vec((0..6).collect::<Vec<_>>(), qwen2).is_err());
        // Qwen3: LLaMA with q and k norms after the q, k, v projection.
        let qwen3 = ParamLayout {
            qk_norms: true,
            ..LLAMA
        };
        let q = BlockParams::from_vec((0..8).collect::<Vec<_>>(), qwen3).unwrap();
        let norm = |n: Option<WeightBias<usize>>| n.map(|n| (n.weight, n.bias));
        assert_eq!(
            (q.qkv.weight, norm(q.q_norm.clone()), norm(q.k_norm.clone())),
            (1, Some((2, None)), Some((3, None)))
        );
        assert_eq!(q.attn_out.weight, 4);
        assert_eq!(q.into_vec(), (0..8).collect::<Vec<_>>());
        assert!(BlockParams::from_vec((0..7).collect::<Vec<_>>(), qwen3).is_err());
    }
}
