//! zmodel: the model and the data, nothing about distribution.
//!
//! Layout:
//! - [`gpt`]: a GPT-2-style decoder as a chain of blocks (embedding, N transformer
//!   blocks, final norm + tied head + loss). Every block's forward takes its
//!   parameter tensors as arguments: the engine owns the parameters and decides
//!   where they live (replicated, partitioned, gathered on demand).
//! - [`ops`]: fused layer norm and GELU with their own backward; softmax and
//!   cross-entropy composed from candle primitives
//!   so that they have a backward (candle-nn's fused versions silently have none).
//! - [`data`]: corpora (text bytes, u16 tokens, synthetic) and the batcher that gives
//!   each rank a disjoint, deterministic share of every global batch.

pub mod data;
pub mod gpt;
pub mod ops;

pub use data::{Batch, Batcher, Corpus, DataError};
pub use gpt::{Gpt, GptConfig, GroupSpec, Init, ParamSpec};
