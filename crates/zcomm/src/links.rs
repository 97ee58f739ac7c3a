//! The point-to-point layer under every algorithm.
//!
//! An algorithm sees numbered peers, a non-blocking `send` (the transport copies
//! the payload and a writer drains it), a non-blocking `send_in_place` (the
//! writer reads the payload where the algorithm keeps it, until `wait_sent`
//! says it is done with it) and a blocking `recv` bounded by the current
//! operation's deadline. Transports stamp each message with the operation's
//! sequence number and length, so ranks that disagree about the next collective
//! get a [`crate::CommError::Mismatch`] instead of silently exchanging wrong bytes.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// The operation a transport's links are running, one at a time (TCP's and
/// MPI's): its sequence number and deadline, the record that hang
/// diagnosis reads ([`Current`]), and the first error, after which every
/// operation fails with it (a communicator that failed mid-operation may
/// hold half a message).
pub(crate) struct OpClock {
    pub(crate) timeout: Duration,
    pub(crate) op: Op,
    pub(crate) seq: u64,
    pub(crate) started: Instant,
    pub(crate) deadline: Instant,
    pub(crate) poisoned: Option<CommError>,
    pub(crate) current: Arc<Mutex<Option<Current>>>,
}

impl OpClock {
    pub(crate) fn new(timeout: Duration, current: Arc<Mutex<Option<Current>>>) -> Self {
        let now = Instant::now();
        OpClock {
            timeout,
            op: Op::Barrier,
            seq: 0,
            started: now,
            deadline: now,
            poisoned: None,
            current,
        }
    }

    /// Starts operation `op` of `bytes`, or returns the error that poisoned
    /// the links.
    pub(crate) fn begin(&mut self, op: Op, bytes: usize) -> Result<(), CommError> {
        if let Some(e) = &self.poisoned {
            return Err(e.clone());
        }
        self.op = op;
        self.seq += 1;
        self.started = Instant::now();
        self.deadline = self.started + self.timeout;
        self.set_current(Some(Current {
            op,
            bytes,
            started: self.started,
            peer: None,
        }));
        Ok(())
    }

    /// Ends the operation begun: cleared from the record, or its error kept.
    pub(crate) fn end<T>(&mut self, r: &Result<T, CommError>) {
        match r {
            Err(e) => self.poisoned = Some(e.clone()),
            Ok(_) => self.set_current(None),
        }
    }

    fn set_current(&self, c: Option<Current>) {
        if let Ok(mut g) = self.current.lock() {
            *g = c;
        }
    }

    /// Notes the peer waited for (hang diagnosis).
    pub(crate) fn waiting_for(&self, peer: usize) {
        note_waiting_for(&self.current, peer);
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
    /// Queues the `len` bytes at `ptr` for `peer`, to be sent from where they
    /// are; returns the message's ticket for [`Links::wait_sent`]. This
    /// default copies them at once, as [`Links::send`] does (ticket 0).
    ///
    /// # Safety
    ///
    /// The bytes must stay valid and unchanged until `wait_sent(peer,
    /// ticket)` has returned `Ok` or [`Links::abandon_sends`] has returned.
    unsafe fn send_in_place(
        &mut self,
        peer: usize,
        ptr: *const u8,
        len: usize,
    ) -> Result<u64, CommError> {
        // SAFETY: valid for `len` bytes (caller).
        self.send(peer, unsafe { std::slice::from_raw_parts(ptr, len) })?;
        Ok(0)
    }
    /// Waits (until the operation's deadline) until the transport is done
    /// with the payload of `peer`'s message `ticket` and every one before it.
    fn wait_sent(&mut self, _peer: usize, _ticket: u64) -> Result<(), CommError> {
        Ok(())
    }
    /// After a failed operation: returns once the transport reads no
    /// payload queued in place any more (those not yet sent are dropped).
    fn abandon_sends(&mut self) {}
    /// Receives the next message from `peer`; it must be exactly `out.len()` bytes.
    fn recv_into(&mut self, peer: usize, out: &mut [u8]) -> Result<(), CommError>;
    /// Receives the next message from `peer`, of any length.
    fn recv(&mut self, peer: usize) -> Result<Vec<u8>, CommError>;
    /// [`Links::recv`] into `buf`'s allocation where it holds the message
    /// (its contents are overwritten, its length becomes the message's).
    /// This default receives into a new buffer.
    fn recv_reusing(&mut self, peer: usize, buf: Vec<u8>) -> Result<Vec<u8>, CommError> {
        drop(buf);
        self.recv(peer)
    }
}

/// Receives exactly `out.len()` floats.
pub(crate) fn recv_f32(l: &mut dyn Links, peer: usize, out: &mut [f32]) -> Result<(), CommError> {
    l.recv_into(peer, bytemuck::cast_slice_mut(out))
}
