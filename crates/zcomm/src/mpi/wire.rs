//! MPI calls as zcomm needs them: requests polled against the operation's
//! deadline, errors turned into [`CommError`]s, and the point-to-point
//! [`Links`] the ring and two-hop algorithms run on.
//!
//! Why poll: a blocking `MPI_Wait` has no deadline, and zrun's rule is that every
//! wait has one. `MPI_Test` also drives Open MPI's progress engine, so the
//! operation thread spins briefly (latency of small messages) and then sleeps
//! between tests (so that a rank waiting for a slow peer does not take a core
//! from the compute threads beside it).

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::ffi;

use crate::links::{Links, OpClock};
use crate::{CommError, Counters, Op};

/// Messages longer than this go as several MPI messages (MPI counts are `int`).
pub(super) const PIECE: usize = 1 << 30;
/// The one tag zcomm uses: every group has a communicator of its own, and
/// MPI keeps messages between two ranks of one communicator and tag in order.
const TAG: c_int = 7;

/// An `MPI_Comm` handle.
#[derive(Clone, Copy)]
pub(super) struct Comm(pub(super) ffi::MPI_Comm);

/// MPI's text for an error code.
pub(super) fn error_text(code: c_int) -> String {
    let mut buf = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: MPI_Error_string writes at most MPI_MAX_ERROR_STRING (256) bytes.
    unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(len.max(0) as usize);
    String::from_utf8_lossy(&buf).into_owned()
}

/// `MPI_UINT8_T`: zcomm moves bytes.
pub(super) fn bytes_type() -> ffi::MPI_Datatype {
    // SAFETY: a constant of the MPI library, valid after MPI_Init.
    unsafe { ffi::RSMPI_UINT8_T }
}

/// A byte count as MPI's `int`.
pub(super) fn count(n: usize) -> c_int {
    c_int::try_from(n).expect("pieces are at most PIECE bytes")
}

/// How the operation thread waits for a request.
pub(super) enum Finish {
    /// Done; the status, when one was asked for.
    Done(ffi::MPI_Status),
    /// The deadline passed first; the request is still pending.
    Expired,
}

/// The state of the operation thread: the group's communicator, the current
/// operation (sequence number, deadline, the peer waited for), byte counters and
/// the sends still in flight (with their buffers).
pub(crate) struct MpiLinks {
    pub(super) comm: Comm,
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) group: String,
    pub(super) same_node: Vec<bool>,
    pub(super) counters: Arc<Counters>,
    pub(super) clock: OpClock,
    /// Sends in flight and the buffers they read from.
    pub(super) sends: Vec<(ffi::MPI_Request, Vec<u8>)>,
    /// Buffers of finished sends, for reuse (a fresh multi-megabyte buffer per
    /// message costs a page fault per 4 KiB).
    pub(super) spare: Vec<Vec<u8>>,
}

// SAFETY: Open MPI's handles (communicator, requests) are pointers, which Rust
// will not move between threads by itself. MPI is initialised with
// MPI_THREAD_MULTIPLE (checked in `Runtime::init`), and the links are built on
// one thread and then used by the operation thread alone.
unsafe impl Send for MpiLinks {}

impl MpiLinks {
    /// Runs one operation: its sequence number and deadline, the record for hang
    /// diagnosis, and at the end every send on its way (a rank that goes off to
    /// compute with a large send pending would stall its peer: Open MPI moves
    /// large messages only while the sender calls into MPI).
    pub(super) fn run<T>(
        &mut self,
        op: Op,
        bytes: usize,
        f: impl FnOnce(&mut MpiLinks) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        self.clock.begin(op, bytes)?;
        let r = f(self).and_then(|v| self.drain_sends().map(|()| v));
        self.clock.end(&r);
        if r.is_ok() {
            self.counters.ran(op, bytes, self.clock.started.elapsed());
        }
        r
    }

    /// An error from an MPI call of this operation.
    pub(super) fn mpi_error(&self, peer: Option<usize>, call: &str, code: c_int) -> CommError {
        CommError::Link {
            op: self.clock.op.name(),
            group: self.group.clone(),
            peer: peer.unwrap_or(self.rank),
            message: format!("{call}: {}", error_text(code)),
        }
    }

    /// Checks an MPI return code.
    pub(super) fn check(
        &self,
        peer: Option<usize>,
        call: &str,
        code: c_int,
    ) -> Result<(), CommError> {
        if code == ffi::MPI_SUCCESS as c_int {
            Ok(())
        } else {
            Err(self.mpi_error(peer, call, code))
        }
    }

    /// The timeout error of this operation.
    pub(super) fn timed_out(&self, peer: Option<usize>) -> CommError {
        CommError::Timeout {
            op: self.clock.op.name(),
            group: self.group.clone(),
            peer,
            waited_s: self.clock.started.elapsed().as_secs_f64(),
        }
    }

    /// Tests `req` until it completes or the deadline passes.
    pub(super) fn poll(
        &self,
        req: &mut ffi::MPI_Request,
        peer: Option<usize>,
    ) -> Result<Finish, CommError> {
        test_until(req, self.clock.deadline).map_err(|code| self.mpi_error(peer, "MPI_Test", code))
    }

    /// Waits for a request whose buffer the caller lends: on timeout the
    /// request is cancelled and waited for (a receive nobody has matched cancels
    /// at once), so MPI never writes into a buffer after we return. A request
    /// that does not finish within a further minute ends the process through
    /// `MPI_Abort`: better than memory written behind our back.
    pub(super) fn finish_borrowed(
        &self,
        req: &mut ffi::MPI_Request,
        peer: Option<usize>,
    ) -> Result<ffi::MPI_Status, CommError> {
        if let Some(p) = peer {
            self.clock.waiting_for(p);
        }
        match self.poll(req, peer)? {
            Finish::Done(status) => Ok(status),
            Finish::Expired => {
                // SAFETY: `req` is live; cancel then complete it.
                unsafe { ffi::MPI_Cancel(req) };
                let limit = Instant::now() + Duration::from_secs(60);
                let mut spins = 0u32;
                loop {
                    let mut flag: c_int = 0;
                    // SAFETY: as in `poll`.
                    let code = unsafe { ffi::MPI_Test(req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
                    if code != ffi::MPI_SUCCESS as c_int || flag != 0 {
                        break;
                    }
                    if Instant::now() >= limit {
                        eprintln!(
                            "zcomm: {} in group {}: a timed-out receive cannot be cancelled; aborting",
                            self.clock.op.name(),
                            self.group
                        );
                        // SAFETY: ends the process.
                        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
                    }
                    back_off(&mut spins);
                }
                Err(self.timed_out(peer))
            }
        }
    }

    /// Waits for every send of this operation (their buffers are ours: on
    /// timeout they are kept, pending, until the process ends).
    fn drain_sends(&mut self) -> Result<(), CommError> {
        while let Some((mut req, buf)) = self.sends.pop() {
            match self.poll(&mut req, None)? {
                Finish::Done(_) => self.spare.push(buf),
                Finish::Expired => {
                    std::mem::forget(buf);
                    return Err(self.timed_out(None));
                }
            }
        }
        Ok(())
    }

    /// Sends `payload` (one piece) from a buffer of our own.
    fn isend(&mut self, peer: usize, payload: &[u8]) -> Result<(), CommError> {
        let mut buf = match self
            .spare
            .iter()
            .position(|b| b.capacity() >= payload.len())
        {
            Some(i) => self.spare.swap_remove(i),
            None => Vec::with_capacity(payload.len()),
        };
        buf.clear();
        buf.extend_from_slice(payload);
        // SAFETY: a null handle for MPI to fill in.
        let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: `buf` stays alive (in `self.sends`) until the request completes.
        let code = unsafe {
            ffi::MPI_Isend(
                buf.as_ptr().cast(),
                count(buf.len()),
                bytes_type(),
                peer as c_int,
                TAG,
                self.comm.0,
                &mut req,
            )
        };
        self.check(Some(peer), "MPI_Isend", code)?;
        self.sends.push((req, buf));
        Ok(())
    }

    /// The length of the next piece from `peer`, matched so that it can be
    /// received into a buffer of that size.
    fn probe(&self, peer: usize) -> Result<(ffi::MPI_Message, usize), CommError> {
        self.clock.waiting_for(peer);
        let mut spins = 0u32;
        loop {
            let mut flag: c_int = 0;
            // SAFETY: a null handle for MPI to fill in.
            let mut msg: ffi::MPI_Message = unsafe { ffi::RSMPI_MESSAGE_NULL };
            // SAFETY: an all-zero status is a valid place for MPI to write one.
            let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            // SAFETY: a probe on our communicator.
            let code = unsafe {
                ffi::MPI_Improbe(
                    peer as c_int,
                    TAG,
                    self.comm.0,
                    &mut flag,
                    &mut msg,
                    &mut status,
                )
            };
            self.check(Some(peer), "MPI_Improbe", code)?;
            if flag != 0 {
                let mut n: c_int = 0;
                // SAFETY: the status of a matched message.
                unsafe { ffi::MPI_Get_count(&status, bytes_type(), &mut n) };
                return Ok((msg, n.max(0) as usize));
            }
            if Instant::now() >= self.clock.deadline {
                return Err(self.timed_out(Some(peer)));
            }
            back_off(&mut spins);
        }
    }

    /// Receives a matched message into `out` (exactly its length).
    fn mrecv(
        &self,
        peer: usize,
        mut msg: ffi::MPI_Message,
        out: &mut [u8],
    ) -> Result<(), CommError> {
        // SAFETY: a null handle for MPI to fill in.
        let mut req: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: `out` outlives the request (see `finish_borrowed`).
        let code = unsafe {
            ffi::MPI_Imrecv(
                out.as_mut_ptr().cast(),
                count(out.len()),
                bytes_type(),
                &mut msg,
                &mut req,
            )
        };
        self.check(Some(peer), "MPI_Imrecv", code)?;
        self.finish_borrowed(&mut req, Some(peer)).map(|_| ())
    }
}

/// Tests `req` until it completes or `deadline` passes; an MPI error code if
/// the test itself fails.
pub(super) fn test_until(req: &mut ffi::MPI_Request, deadline: Instant) -> Result<Finish, c_int> {
    let mut spins = 0u32;
    loop {
        let mut flag: c_int = 0;
        // SAFETY: an all-zero status is a valid place for MPI to write one.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: `req` is a live request of the calling thread.
        let code = unsafe { ffi::MPI_Test(req, &mut flag, &mut status) };
        if code != ffi::MPI_SUCCESS as c_int {
            return Err(code);
        }
        if flag != 0 {
            return Ok(Finish::Done(status));
        }
        if Instant::now() >= deadline {
            return Ok(Finish::Expired);
        }
        back_off(&mut spins);
    }
}

/// Spins for the first thousand tests (about the latency of a small message),
/// then sleeps 20 µs between tests.
pub(super) fn back_off(spins: &mut u32) {
    if *spins < 1000 {
        *spins += 1;
        std::hint::spin_loop();
    } else {
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// A message is one MPI message per [`PIECE`] bytes; one shorter than a
/// piece (possibly empty) ends it, so the receiver needs no header to know
/// where a message stops.
impl Links for MpiLinks {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }

    fn send(&mut self, peer: usize, payload: &[u8]) -> Result<(), CommError> {
        self.counters
            .add(self.clock.op, payload.len() as u64, self.same_node[peer]);
        let mut rest = payload;
        loop {
            let n = rest.len().min(PIECE);
            self.isend(peer, &rest[..n])?;
            rest = &rest[n..];
            if n < PIECE {
                return Ok(());
            }
        }
    }

    fn recv_into(&mut self, peer: usize, out: &mut [u8]) -> Result<(), CommError> {
        let mut off = 0;
        loop {
            let want = (out.len() - off).min(PIECE);
            let (msg, n) = self.probe(peer)?;
            if n != want {
                return Err(self.wrong_length(peer, off + n, out.len()));
            }
            self.mrecv(peer, msg, &mut out[off..off + n])?;
            off += n;
            if n < PIECE {
                return Ok(());
            }
        }
    }

    fn recv(&mut self, peer: usize) -> Result<Vec<u8>, CommError> {
        let mut out = Vec::new();
        loop {
            let (msg, n) = self.probe(peer)?;
            let at = out.len();
            out.resize(at + n, 0);
            self.mrecv(peer, msg, &mut out[at..])?;
            if n < PIECE {
                return Ok(out);
            }
        }
    }
}

impl MpiLinks {
    fn wrong_length(&self, peer: usize, got: usize, expected: usize) -> CommError {
        CommError::Mismatch {
            op: self.clock.op.name(),
            group: self.group.clone(),
            peer,
            got: format!("{got} bytes"),
            expected: format!("{expected} bytes"),
        }
    }
}
