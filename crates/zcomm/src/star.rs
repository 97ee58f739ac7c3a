//! Root-to-all broadcast and a barrier.
//!
//! The root sends its buffer to every other rank directly. That costs the root
//! (n-1) copies of the buffer, which is fine for what zrun broadcasts (small
//! state at start-up); a pipelined ring would win for large buffers at scale.
//! The barrier is a zero-byte all-gather round on the ring, twice around, so no
//! rank leaves before every rank has arrived.

use crate::links::Links;
use crate::CommError;

/// `root`'s buffer on every rank.
pub(crate) fn broadcast(
    l: &mut dyn Links,
    buf: Vec<u8>,
    root: usize,
) -> Result<Vec<u8>, CommError> {
    let (w, r) = (l.world_size(), l.rank());
    if r == root {
        for peer in (0..w).filter(|&p| p != root) {
            l.send(peer, &buf)?;
        }
        Ok(buf)
    } else {
        l.recv(root)
    }
}

/// Returns once every rank has entered.
pub(crate) fn barrier(l: &mut dyn Links) -> Result<(), CommError> {
    let (w, r) = (l.world_size(), l.rank());
    if w == 1 {
        return Ok(());
    }
    // A token goes around the ring twice: after the first lap rank 0 knows all have
    // arrived, the second lap tells everyone.
    let (right, left) = ((r + 1) % w, (r + w - 1) % w);
    for _ in 0..2 {
        if r == 0 {
            l.send(right, &[])?;
            l.recv_into(left, &mut [])?;
        } else {
            l.recv_into(left, &mut [])?;
            l.send(right, &[])?;
        }
    }
    Ok(())
}
