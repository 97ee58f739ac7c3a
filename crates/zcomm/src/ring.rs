//! Ring reduce-scatter and all-gather, and all-reduce as the two fused.
//!
//! The ring wins for large buffers: each rank sends and receives (n-1)/n of the
//! buffer once per phase, which is bandwidth-optimal, and only talks to its two
//! neighbours. Chunk c's sum starts at rank c+1 and travels the ring, each rank
//! adding its own contribution to what it received, ending at rank c. So the order
//! of additions for an element depends only on which chunk holds it: every rank
//! and every later all-gather sees the same bits.
//!
//! Chunks travel in pieces of at most [`PIECE_FLOATS`], and each piece moves on
//! as soon as it is ready: a rank adds a received piece and sends it to its
//! right neighbour while the rest of the chunk is still arriving, so reducing,
//! sending and receiving overlap instead of taking turns a whole chunk at a time,
//! and the receive buffer is one piece that stays in cache (not a fresh
//! chunk-sized allocation per call). In an all-reduce the gather starts with
//! the first finished piece of the reduction. Pieces change when work is done,
//! never what is added to what.
//!
//! Pieces are sent in place (`Links::send_in_place`): the transport's writer
//! reads them from the buffer, no copy on this thread (which also receives
//! and adds: without that copy a TCP all-reduce of 256 MiB between two ranks
//! on two cores ran 1.4x as fast, an all-gather 1.3x). So before the ring
//! writes a piece of the buffer it waits until the sends that read those
//! bytes are done, and it returns only once every send is done (or, after an
//! error, abandoned). These waits find the send done already where the ring
//! receives data that its neighbour could only send after reading ours.
//! A reduce-scatter writes its finished chunk to the front of the buffer,
//! where its caller wants it, instead of copying it there afterwards.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::chunk_range;
use crate::links::{recv_f32, Links};
use crate::CommError;

/// The largest message of a ring step, in floats (1 MiB): big enough that a
/// message's fixed costs (header, queueing, a wake-up) vanish, small enough
/// to stay in L2 between the socket and the addition.
const PIECE_FLOATS: usize = 1 << 18;

/// In place: afterwards the front of `buf` (as many elements as chunk
/// `rank` has) holds the sum over ranks of chunk `rank`.
pub(crate) fn reduce_scatter(l: &mut dyn Links, buf: &mut [f32]) -> Result<(), CommError> {
    ring(l, buf, true, false)
}

/// In place: chunk `rank` of `buf` is this rank's contribution; afterwards every
/// chunk holds its owner's contribution.
pub(crate) fn all_gather(l: &mut dyn Links, buf: &mut [f32]) -> Result<(), CommError> {
    ring(l, buf, false, true)
}

/// In place: afterwards every element of `buf` holds the sum over ranks, the
/// same bits as [`reduce_scatter`] then [`all_gather`].
pub(crate) fn all_reduce(l: &mut dyn Links, buf: &mut [f32]) -> Result<(), CommError> {
    ring(l, buf, true, true)
}

/// The pieces of `range`, in order: every rank cuts a chunk the same way.
fn pieces(range: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    range
        .clone()
        .step_by(PIECE_FLOATS)
        .map(move |start| start..(start + PIECE_FLOATS).min(range.end))
}

fn ring(l: &mut dyn Links, buf: &mut [f32], reduce: bool, gather: bool) -> Result<(), CommError> {
    let (w, r) = (l.world_size(), l.rank());
    if w == 1 {
        return Ok(());
    }
    let right = (r + 1) % w;
    let mut ring = Ring {
        base: buf.as_mut_ptr(),
        len: buf.len(),
        right,
        sent: BTreeMap::new(),
        last: 0,
    };
    let done = ring
        .steps(l, reduce, gather)
        .and_then(|()| l.wait_sent(right, ring.last));
    if done.is_err() {
        l.abandon_sends();
    }
    done
}

/// The buffer of one ring collective, as raw parts: the right neighbour's
/// writer reads pieces of it while the ring writes others, so each access
/// takes only its own piece, never a borrow of the whole buffer.
struct Ring {
    base: *mut f32,
    len: usize,
    right: usize,
    /// Pieces sent in place: first element → (end, ticket).
    sent: BTreeMap<usize, (usize, u64)>,
    /// The ticket of the last send.
    last: u64,
}

impl Ring {
    fn steps(&mut self, l: &mut dyn Links, reduce: bool, gather: bool) -> Result<(), CommError> {
        let (w, r) = (l.world_size(), l.rank());
        let left = (r + w - 1) % w;
        let n = self.len;
        let chunk = |c: usize| chunk_range(n, w, c % w);
        // The reduction starts by sending chunk r-1, the gather by sending chunk r.
        for piece in pieces(chunk(if reduce { r + w - 1 } else { r })) {
            self.send(l, piece)?;
        }
        if reduce {
            // Chunk 0 is the longest.
            let mut scratch = vec![0f32; PIECE_FLOATS.min(chunk(0).len())];
            // Step s receives chunk r-s-2 and adds this rank's share; what it
            // finishes is what step s+1 sends on, and the last step finishes
            // chunk r, which the gather sends first (a reduce-scatter writes
            // it to the front of the buffer instead).
            for s in 0..w - 1 {
                let last = s + 2 == w;
                let c = chunk(r + 2 * w - s - 2);
                for piece in pieces(c.clone()) {
                    let incoming = &mut scratch[..piece.len()];
                    recv_f32(l, left, incoming)?;
                    let to = if last && !gather {
                        piece.start - c.start..piece.end - c.start
                    } else {
                        piece.clone()
                    };
                    self.wait_unsent(l, &to)?;
                    if to == piece {
                        // SAFETY: no send reads `piece` any more (just waited).
                        crate::reduce_add(unsafe { self.piece_mut(&piece) }, incoming);
                    } else {
                        // SAFETY: as above for `to`; `piece` (chunk r) and
                        // `to` (in chunk 0, r > 0) do not overlap.
                        let (own, sum) = unsafe { (self.piece(&piece), self.piece_mut(&to)) };
                        for ((s, a), b) in sum.iter_mut().zip(own).zip(incoming.iter()) {
                            *s = *a + *b;
                        }
                    }
                    if !last || gather {
                        self.send(l, piece)?;
                    }
                }
            }
        }
        if gather {
            // Step s receives chunk r-s-1, which step s+1 sends on.
            for s in 0..w - 1 {
                let send_on = s + 2 < w;
                for piece in pieces(chunk(r + 2 * w - s - 1)) {
                    self.wait_unsent(l, &piece)?;
                    // SAFETY: no send reads `piece` any more (just waited).
                    recv_f32(l, left, unsafe { self.piece_mut(&piece) })?;
                    if send_on {
                        self.send(l, piece)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Queues `piece` for the right neighbour, sent from where it is.
    fn send(&mut self, l: &mut dyn Links, piece: Range<usize>) -> Result<(), CommError> {
        assert!(piece.end <= self.len);
        // SAFETY: inside the buffer; the ring writes these bytes only after
        // `wait_unsent` has seen this send done, and `ring` returns (giving
        // the buffer back) only after every send is done or abandoned.
        let ticket = unsafe {
            l.send_in_place(
                self.right,
                self.base.add(piece.start).cast::<u8>(),
                piece.len() * 4,
            )?
        };
        self.sent.insert(piece.start, (piece.end, ticket));
        self.last = ticket;
        Ok(())
    }

    /// Waits until no send reads any element of `range`.
    fn wait_unsent(&mut self, l: &mut dyn Links, range: &Range<usize>) -> Result<(), CommError> {
        let ticket = self
            .sent
            .range(..range.end)
            .filter(|(_, (end, _))| *end > range.start)
            .map(|(_, (_, t))| *t)
            .max();
        match ticket {
            Some(t) => l.wait_sent(self.right, t),
            None => Ok(()),
        }
    }

    /// # Safety
    ///
    /// Nobody writes `r` while the slice lives.
    unsafe fn piece(&self, r: &Range<usize>) -> &[f32] {
        assert!(r.start <= r.end && r.end <= self.len);
        // SAFETY: inside the buffer, not written meanwhile (caller).
        unsafe { std::slice::from_raw_parts(self.base.add(r.start), r.len()) }
    }

    /// # Safety
    ///
    /// No send reads `r` and no other slice of it lives meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn piece_mut(&self, r: &Range<usize>) -> &mut [f32] {
        assert!(r.start <= r.end && r.end <= self.len);
        // SAFETY: inside the buffer, used by nobody else (caller).
        unsafe { std::slice::from_raw_parts_mut(self.base.add(r.start), r.len()) }
    }
}
