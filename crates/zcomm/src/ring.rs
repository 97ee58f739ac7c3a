//! Ring reduce-scatter and all-gather (and all-reduce as the two in sequence).
//!
//! The ring wins for large buffers: each rank sends and receives (n-1)/n of the
//! buffer once per phase, which is bandwidth-optimal, and only talks to its two
//! neighbours. Chunk c's sum starts at rank c+1 and travels the ring, each rank
//! adding its own contribution to what it received, ending at rank c. So the order
//! of additions for an element depends only on which chunk holds it: every rank
//! and every later all-gather sees the same bits.

use crate::chunk_range;
use crate::links::{recv_f32, send_f32, Links};
use crate::CommError;

/// In place: afterwards chunk `rank` of `buf` holds the sum over ranks.
pub(crate) fn reduce_scatter(l: &mut dyn Links, buf: &mut [f32]) -> Result<(), CommError> {
    let (w, r) = (l.world_size(), l.rank());
    if w == 1 {
        return Ok(());
    }
    let right = (r + 1) % w;
    let left = (r + w - 1) % w;
    let mut scratch = vec![0f32; chunk_range(buf.len(), w, 0).len()];
    for s in 0..w - 1 {
        let send_c = (r + 2 * w - s - 1) % w;
        let recv_c = (r + 2 * w - s - 2) % w;
        send_f32(l, right, &buf[chunk_range(buf.len(), w, send_c)])?;
        let range = chunk_range(buf.len(), w, recv_c);
        let incoming = &mut scratch[..range.len()];
        recv_f32(l, left, incoming)?;
        crate::reduce_add(&mut buf[range], incoming);
    }
    Ok(())
}

/// In place: chunk `rank` of `buf` is this rank's contribution; afterwards every
/// chunk holds its owner's contribution.
pub(crate) fn all_gather(l: &mut dyn Links, buf: &mut [f32]) -> Result<(), CommError> {
    let (w, r) = (l.world_size(), l.rank());
    if w == 1 {
        return Ok(());
    }
    let right = (r + 1) % w;
    let left = (r + w - 1) % w;
    for s in 0..w - 1 {
        let send_c = (r + w - s) % w;
        let recv_c = (r + 2 * w - s - 1) % w;
        send_f32(l, right, &buf[chunk_range(buf.len(), w, send_c)])?;
        let range = chunk_range(buf.len(), w, recv_c);
        recv_f32(l, left, &mut buf[range])?;
    }
    Ok(())
}
