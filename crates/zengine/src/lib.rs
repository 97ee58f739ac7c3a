//! zengine: ZeRO data-parallel training of a [`zmodel::Gpt`] over a
//! [`zcomm::Communicator`].
//!
//! Layout:
//! - [`flat`]: per-block flat f32 buffers and their partition over ranks, and the
//!   bucket layout that makes a bucket's chunk r exactly rank r's slices.
//! - [`engine`]: the engine's state, what each stage keeps, and the parameters
//!   each use of a block needs.
//! - `group`: one block's flat buffers and which of them are whole or a slice.
//! - `micro_batch`: forward and backward of one micro-batch, block by block.
//! - `layer_drop`: which blocks a micro-batch runs under progressive layer
//!   dropping, the same on every rank.
//! - `gpu` (feature `cuda`): the same micro-batch on a GPU, the engine's
//!   buffers and optimizer staying on the host.
//! - `reduce`: gradient buckets reduced while backward continues.
//! - `step`: the optimizer step as named phases (norm, loss scale, clipping,
//!   AdamW per sub-group, sharing the updated slices).
//! - `offload`: NVMe offload (ZeRO-Infinity): optimizer state and stage-3
//!   parameter slices in swap files, stashed group by group, read ahead.
//! - [`gather`]: stage 3's parameter all-gathers, in planned order, with
//!   prefetch, and ZeRO++'s qwZ and hpZ.
//! - [`accounting`]: memory by category and bytes sent per step.
//! - [`error`]: why the engine failed.
//! - [`adam`]: the fused AdamW update over a flat slice.
//! - [`schedule`]: warmup and learning-rate schedules.
//! - [`state`]: saving and loading the engine's state (checkpoints, initial weights),
//!   repartitioned for any world size and stage.
//!
//! The design decision to know: every parameter lives in exactly one flat buffer
//! per block, padded so that it splits into equal slices, one per rank. Rank r owns
//! slice r of every block. The stages differ only in what each rank keeps of
//! those buffers, so the arithmetic of every element is the same whatever the
//! stage.

#![deny(missing_docs)]

pub mod accounting;
pub mod adam;
pub mod engine;
pub mod error;
pub mod flat;
pub mod gather;
#[cfg(feature = "cuda")]
pub mod gpu;
mod group;
mod layer_drop;
mod micro_batch;
mod offload;
pub mod precision;
mod profile;
mod reduce;
pub mod schedule;
pub mod state;
mod step;

pub use accounting::{LayerDropStats, MemoryUse, StepStats, StepTimes, TrustRatios};
pub use engine::Engine;
pub use error::EngineError;
pub use flat::{Bucket, GroupLayout};
pub use gather::ProcessGroups;
pub use zswap::IoStats;
