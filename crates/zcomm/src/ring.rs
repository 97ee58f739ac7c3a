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

use std::ops::Range;

use crate::chunk_range;
use crate::links::{recv_f32, send_f32, Links};
use crate::CommError;

/// The largest message of a ring step, in floats (1 MiB): big enough that a
/// message's fixed costs (header, queueing, a wake-up) vanish, small enough
/// to stay in L2 between the socket and the addition.
const PIECE_FLOATS: usize = 1 << 18;

/// In place: afterwards chunk `rank` of `buf` holds the sum over ranks.
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
    let left = (r + w - 1) % w;
    let n = buf.len();
    let chunk = |c: usize| chunk_range(n, w, c % w);
    // The reduction starts by sending chunk r-1, the gather by sending chunk r.
    for piece in pieces(chunk(if reduce { r + w - 1 } else { r })) {
        send_f32(l, right, &buf[piece])?;
    }
    if reduce {
        // Chunk 0 is the longest.
        let mut scratch = vec![0f32; PIECE_FLOATS.min(chunk(0).len())];
        // Step s receives chunk r-s-2 and adds this rank's share; what it
        // finishes is what step s+1 sends on, and the last step finishes chunk
        // r, which the gather sends first.
        for s in 0..w - 1 {
            let send_on = s + 2 < w || gather;
            for piece in pieces(chunk(r + 2 * w - s - 2)) {
                let incoming = &mut scratch[..piece.len()];
                recv_f32(l, left, incoming)?;
                crate::reduce_add(&mut buf[piece.clone()], incoming);
                if send_on {
                    send_f32(l, right, &buf[piece])?;
                }
            }
        }
    }
    if gather {
        // Step s receives chunk r-s-1, which step s+1 sends on.
        for s in 0..w - 1 {
            let send_on = s + 2 < w;
            for piece in pieces(chunk(r + 2 * w - s - 1)) {
                recv_f32(l, left, &mut buf[piece.clone()])?;
                if send_on {
                    send_f32(l, right, &buf[piece])?;
                }
            }
        }
    }
    Ok(())
}
