//! zproto: what zrun and its workers say to each other, and how.
//!
//! Layout:
//! - [`frame`]: length-prefixed frames (u32 big-endian length, then JSON), blocking
//!   and async, with a maximum size checked *before* anything is allocated.
//! - [`auth`]: the job token, and the HMAC challenge-response that proves knowledge
//!   of it without sending it. The data plane between workers uses the same proofs.
//! - [`msg`]: the control-plane messages.
//! - [`names`]: names both binaries must spell the same (collectives, the
//!   shared-memory segment).
//!
//! The design decision to know: zrun is the only server and it never trusts a
//! connection until the peer has answered a fresh nonce with
//! `HMAC-SHA256(token, context | nonce | rank)`. Before that, frames are capped at
//! [`frame::HANDSHAKE_MAX`] bytes so a stranger cannot make zrun allocate.

#![deny(missing_docs)]

pub mod auth;
pub mod frame;
pub mod msg;
pub mod names;

pub use auth::{Nonce, Proof, Token};
pub use frame::{FrameError, HANDSHAKE_MAX, MAX_FRAME};
pub use msg::{
    BenchCommTask, BenchRow, ByOp, CommBytes, CommRecord, FlopsProfile, IoReport, KernelRow,
    LayerDrop, MemBytes, ModuleProfile, NodeWelcome, OpBytes, StepReport, StepTimesMs, Task,
    ToServer, ToWorker, TrainTask, TrustRatios, Welcome, CONTROL_CONTEXT, NODE_CONTEXT,
    NODE_SERVER_CONTEXT, SERVER_CONTEXT,
};
pub use names::{hpz_segment_name, shm_segment_name, shm_segment_path, Op};
