//! zengine: ZeRO data-parallel training of a [`zmodel::Gpt`] over a
//! [`zcomm::Communicator`].
//!
//! Layout:
//! - [`flat`]: per-block flat f32 buffers and their partition over ranks, and the
//!   bucket layout that makes a bucket's chunk r exactly rank r's slices.
//! - [`engine`]: the step: block-by-block forward and backward, gradients reduced in
//!   buckets while backward continues, global-norm clipping, AdamW, accounting.
//! - [`gather`]: stage 3's parameter all-gathers, in planned order, with prefetch.
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

pub mod adam;
pub mod engine;
pub mod flat;
pub mod gather;
pub mod precision;
pub mod schedule;
pub mod state;

pub use engine::{Engine, EngineError, StepStats};
pub use flat::{Bucket, GroupLayout};
