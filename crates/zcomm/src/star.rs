//! Root-to-all broadcast and a barrier.
//!
//! The root sends its buffer to every other rank directly. That costs the root
//! (n-1) sends of the buffer, which is fine for what zrun broadcasts (small
//! state at start-up); a pipelined ring would win for large buffers at scale.
//! The root's buffer is sent in place (`Links::send_in_place`) and the others
//! receive into the buffer they passed in where it is large enough
//! (`Links::recv_reusing`): a broadcast of 256 MiB between two ranks on two
//! cores had copied it into a message and received into a fresh allocation,
//! whose pages faulted in as they came, 0.15-0.3 of one plain loopback
//! stream (`zrun bench comm`'s `tcp_stream`).
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
    if r != root {
        return l.recv_reusing(root, buf);
    }
    let mut tickets = Vec::with_capacity(w);
    let mut sent = Ok(());
    for peer in (0..w).filter(|&p| p != root) {
        // SAFETY: `buf` is neither written nor dropped before every ticket is
        // waited for or the sends are abandoned, below.
        match unsafe { l.send_in_place(peer, buf.as_ptr(), buf.len()) } {
            Ok(ticket) => tickets.push((peer, ticket)),
            Err(e) => {
                sent = Err(e);
                break;
            }
        }
    }
    let sent = sent.and_then(|()| {
        tickets
            .iter()
            .try_for_each(|&(peer, ticket)| l.wait_sent(peer, ticket))
    });
    if sent.is_err() {
        l.abandon_sends();
    }
    sent.map(|()| buf)
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
