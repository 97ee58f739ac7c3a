//! A block's parameters by name.
//!
//! The engine keeps a block's parameters in one flat buffer, in a fixed order,
//! and hands them to the model as a list; the model reads them by name through
//! these structs. Each struct's `into_vec` / `from_vec` is the one place that
//! order is written, and [`crate::Gpt::groups`] builds the parameter specs
//! through the same structs, so specs, values and gradients cannot disagree on
//! it. The structs are generic: `BlockParams<Tensor>` holds values or
//! gradients, `BlockParams<ParamSpec>` names and shapes. A new block kind
//! (RMSNorm, SwiGLU) adds a struct here, not index arithmetic.

use candle_core::{Error, Result};

/// A weight and a bias: a linear layer (weight `[in, out]`) or a layer norm.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightBias<T> {
    /// Weight.
    pub weight: T,
    /// Bias.
    pub bias: T,
}

impl<T> WeightBias<T> {
    fn push_into(self, out: &mut Vec<T>) {
        out.push(self.weight);
        out.push(self.bias);
    }

    fn take(it: &mut impl Iterator<Item = T>) -> Option<WeightBias<T>> {
        Some(WeightBias {
            weight: it.next()?,
            bias: it.next()?,
        })
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

/// The embedding: token and position tables (`wte` is also the tied head).
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingParams<T> {
    /// Token embedding `[vocab, d]`.
    pub wte: T,
    /// Position embedding `[seq, d]`.
    pub wpe: T,
}

impl<T> EmbeddingParams<T> {
    /// In the flat order.
    pub fn into_vec(self) -> Vec<T> {
        vec![self.wte, self.wpe]
    }

    /// From the flat order; an error unless there are exactly 2.
    pub fn from_vec(v: Vec<T>) -> Result<Self> {
        exactly(v, 2, "the embedding", |it| {
            Some(EmbeddingParams {
                wte: it.next()?,
                wpe: it.next()?,
            })
        })
    }
}

/// A pre-LayerNorm transformer block (GPT-2's names).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockParams<T> {
    /// Layer norm before attention.
    pub ln_1: WeightBias<T>,
    /// The q, k, v projection `[d, 3d]`.
    pub attn_c_attn: WeightBias<T>,
    /// Attention's output projection `[d, d]`.
    pub attn_c_proj: WeightBias<T>,
    /// Layer norm before the MLP.
    pub ln_2: WeightBias<T>,
    /// The MLP's expansion `[d, 4d]`.
    pub mlp_c_fc: WeightBias<T>,
    /// The MLP's projection back `[4d, d]`.
    pub mlp_c_proj: WeightBias<T>,
}

impl<T> BlockParams<T> {
    /// Parameters in a block.
    pub const COUNT: usize = 12;

    /// In the flat order.
    pub fn into_vec(self) -> Vec<T> {
        let mut v = Vec::with_capacity(Self::COUNT);
        self.ln_1.push_into(&mut v);
        self.attn_c_attn.push_into(&mut v);
        self.attn_c_proj.push_into(&mut v);
        self.ln_2.push_into(&mut v);
        self.mlp_c_fc.push_into(&mut v);
        self.mlp_c_proj.push_into(&mut v);
        v
    }

    /// From the flat order; an error unless there are exactly [`Self::COUNT`].
    pub fn from_vec(v: Vec<T>) -> Result<Self> {
        exactly(v, Self::COUNT, "a block", |it| {
            // Struct fields are evaluated in the order written.
            Some(BlockParams {
                ln_1: WeightBias::take(it)?,
                attn_c_attn: WeightBias::take(it)?,
                attn_c_proj: WeightBias::take(it)?,
                ln_2: WeightBias::take(it)?,
                mlp_c_fc: WeightBias::take(it)?,
                mlp_c_proj: WeightBias::take(it)?,
            })
        })
    }
}

/// The head: the final layer norm (the output matrix is the tied `wte`).
#[derive(Debug, Clone, PartialEq)]
pub struct HeadParams<T> {
    /// Final layer norm.
    pub ln_f: WeightBias<T>,
}

impl<T> HeadParams<T> {
    /// In the flat order.
    pub fn into_vec(self) -> Vec<T> {
        let mut v = Vec::with_capacity(2);
        self.ln_f.push_into(&mut v);
        v
    }

    /// From the flat order; an error unless there are exactly 2.
    pub fn from_vec(v: Vec<T>) -> Result<Self> {
        exactly(v, 2, "the head", |it| {
            Some(HeadParams {
                ln_f: WeightBias::take(it)?,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_order_round_trips_and_counts_are_checked() {
        let v: Vec<usize> = (0..12).collect();
        let b = BlockParams::from_vec(v.clone()).unwrap();
        assert_eq!(
            (b.ln_1.weight, b.attn_c_attn.bias, b.mlp_c_proj.bias),
            (0, 3, 11)
        );
        assert_eq!(b.into_vec(), v);
        assert!(BlockParams::from_vec((0..11).collect::<Vec<_>>()).is_err());
        assert!(BlockParams::from_vec((0..13).collect::<Vec<_>>()).is_err());
        assert_eq!(EmbeddingParams::from_vec(vec![7, 8]).unwrap().wpe, 8);
        assert!(HeadParams::from_vec(vec![1]).is_err());
        assert_eq!(
            HeadParams::from_vec(vec![1, 2]).unwrap().into_vec(),
            vec![1, 2]
        );
    }
}
