//! Pairwise-exchange all-to-all.
//!
//! In step k (1..n) rank r sends to r+k and receives from r-k, so every link
//! carries exactly one message per step and no rank is a hot spot. Pieces may
//! have different lengths; the receiver learns each length from the message.

use crate::links::Links;
use crate::CommError;

/// `pieces[j]` goes to rank j; returns the piece from each rank in rank order.
pub(crate) fn all_to_all(
    l: &mut dyn Links,
    mut pieces: Vec<Vec<u8>>,
) -> Result<Vec<Vec<u8>>, CommError> {
    let (w, r) = (l.world_size(), l.rank());
    let mut out: Vec<Vec<u8>> = vec![Vec::new(); w];
    out[r] = std::mem::take(&mut pieces[r]);
    for k in 1..w {
        let to = (r + k) % w;
        let from = (r + w - k) % w;
        l.send(to, &pieces[to])?;
        out[from] = l.recv(from)?;
    }
    Ok(out)
}
