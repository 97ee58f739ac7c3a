//! zdata: a job's training data, without the model.
//!
//! The workers read their batches through it, and zrun reads it before launch
//! where `train.epochs` asks how many sequences an epoch is: both count the
//! same windows, packed sequences and blends, because they run the same code.
//!
//! Layout:
//! - [`data`]: corpora (text bytes, u16/u32 tokens, synthetic) and the batcher
//!   that gives each rank a disjoint, deterministic share of every global
//!   batch.
//! - [`job`]: a job spec's sources, held-out tails and batcher, built the one
//!   way the workers and zrun both use.
//! - [`documents`]: where each packed document begins in its sequence, for
//!   attention, positions and loss that stop at document ends.
//! - [`packing`]: whole documents packed into sequences, best fit decreasing
//!   (TRL's `bfd`).
//! - [`blend`]: which source of a data blend each global sample comes from,
//!   each source its weight's share of every prefix of the samples.

#![deny(missing_docs)]

pub mod blend;
pub mod data;
pub mod documents;
pub mod job;
pub mod packing;

pub use data::{Batch, Batcher, Corpus, DataError};
pub use documents::Documents;

/// The target of a position that the loss leaves out (a prompt's token under
/// an assistant-only loss): PyTorch's `ignore_index`, as an id no
/// vocabulary reaches.
pub const IGNORED: u32 = u32::MAX;
