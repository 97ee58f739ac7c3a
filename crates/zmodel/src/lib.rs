//! zmodel: the model and the data, nothing about distribution.
//!
//! Layout:
//! - [`gpt`]: a decoder of either family, GPT-2 or LLaMA, as a chain of blocks
//!   (embedding, N transformer blocks, final norm + head + loss). Every block's forward takes its
//!   parameter tensors as arguments: the engine owns the parameters and decides
//!   where they live (replicated, partitioned, gathered on demand). A block's
//!   backward is written by hand from the activations its forward saved (no
//!   autograd graph, which would also hold the parameters).
//! - [`params`]: a block's parameters by slot (`BlockParams { norm_1, qkv,
//!   ... }`), generic over values, gradients and specs; the one place their flat
//!   order is written.
//! - [`head`]: the final norm, output product and cross-entropy with their
//!   backward in one call (no autograd in a training step's head).
//! - [`linear`]: a block's linear layers whole or in column tiles
//!   (memory-centric tiling) behind one [`BlockSource`], with a backward whose
//!   input gradient adds in the same order either way.
//! - [`attention`]: causal self-attention, multi-head or grouped-query, as one
//!   custom op (strided GEMMs on the projection, softmax in cache, a
//!   recomputing backward).
//! - [`llama_ops`]: fused RMSNorm, SwiGLU and rotary embeddings with their
//!   own backward.
//! - [`ops`]: fused layer norm and GELU with their own backward; cross-entropy
//!   composed from candle primitives, the autograd reference that [`head`]'s
//!   fused one is tested against (candle-nn's fused versions silently have no
//!   backward).
//! - `simd`: a vectorisable `exp`, AVX-512 / AVX2 dispatch and thread-count-independent
//!   row splitting for the fused ops.
//! - [`dropout`]: dropout of hidden states and attention's probabilities
//!   whose masks are a hash of each element's index, made again in
//!   backward instead of kept.
//! - the data (corpora, packed documents, blends, each rank's batches) lives
//!   in `zdata`, which the launcher reads too; its modules are re-exported
//!   here, where the model's code has always found them.

#![deny(missing_docs)]

pub mod attention;
pub mod dropout;
pub mod embedding;
pub mod gpt;
pub mod head;
#[cfg(target_arch = "x86_64")]
mod lanes;
pub mod linear;
pub mod llama_ops;
pub mod ops;
pub mod params;
pub mod profile;
mod simd;

pub use dropout::{BlockDropout, Dropout, Noise};
pub use embedding::{EmbeddingGrads, TokenRows};
pub use gpt::{BlockActs, Gpt, GroupSpec, Init, Initializer, KvCache, ParamSpec};
pub use head::HeadBackward;
pub use linear::{BlockLinear, BlockNorm, BlockSource, Products};
pub use params::{BlockParams, EmbeddingParams, HeadParams, ParamLayout, WeightBias};
pub use simd::vectorised;
pub use zconfig::tiles::{ColumnTile, TileError};
pub use zdata::{blend, data, documents, packing};
pub use zdata::{Batch, Batcher, Corpus, DataError, Documents};
