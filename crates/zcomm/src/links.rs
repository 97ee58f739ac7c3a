//! The point-to-point layer under every algorithm.
//!
//! An algorithm sees numbered peers, a non-blocking `send` (the transport copies
//! the payload and a writer drains it) and a blocking `recv` bounded by the current
//! operation's deadline. Transports stamp each message with the operation's
//! sequence number and length, so ranks that disagree about the next collective
//! get a [`crate::CommError::Mismatch`] instead of silently exchanging wrong bytes.

use std::sync::Mutex;
use std::time::Instant;

use crate::{CommError, Op};

/// What a communicator's operation thread is doing, shared for
/// [`crate::Communicator::in_flight`].
#[derive(Debug, Clone)]
pub(crate) struct Current {
    pub(crate) op: Op,
    pub(crate) bytes: usize,
    pub(crate) started: Instant,
    pub(crate) peer: Option<usize>,
}

/// Records, for hang diagnosis, the peer the operation thread waits for.
pub(crate) fn note_waiting_for(current: &Mutex<Option<Current>>, peer: usize) {
    if let Ok(mut g) = current.lock() {
        if let Some(c) = g.as_mut() {
            c.peer = Some(peer);
        }
    }
}

/// Messages to and from the other ranks of a group, during one operation.
pub(crate) trait Links {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// Queues `payload` for `peer` and returns.
    fn send(&mut self, peer: usize, payload: &[u8]) -> Result<(), CommError>;
    /// Receives the next message from `peer`; it must be exactly `out.len()` bytes.
    fn recv_into(&mut self, peer: usize, out: &mut [u8]) -> Result<(), CommError>;
    /// Receives the next message from `peer`, of any length.
    fn recv(&mut self, peer: usize) -> Result<Vec<u8>, CommError>;
}

/// Sends `data` as bytes.
pub(crate) fn send_f32(l: &mut dyn Links, peer: usize, data: &[f32]) -> Result<(), CommError> {
    l.send(peer, bytemuck::cast_slice(data))
}

/// Receives exactly `out.len()` floats.
pub(crate) fn recv_f32(l: &mut dyn Links, peer: usize, out: &mut [f32]) -> Result<(), CommError> {
    l.recv_into(peer, bytemuck::cast_slice_mut(out))
}
