//! ZeRO++ qgZ: a reduce-scatter whose data crosses the links quantized, in
//! two hops, as the ZeRO++ paper does it.
//!
//! A one-hop quantized reduce-scatter would send every rank's whole gradient
//! across the slow links (an all-to-all); the hierarchical one first reduces
//! inside each node, so that only one partial sum per node and chunk crosses
//! nodes:
//!
//! 1. Inside the node, rank `p` handles the chunks of every rank whose local
//!    index (its position on its own node) is `p`'s local index modulo the
//!    node's rank count. Each rank sends each local peer the concatenation of
//!    the chunks that peer handles (so the slices are reordered to be
//!    contiguous per destination), quantized; the handler dequantizes the
//!    pieces and adds them in f32, its own piece unquantized, in local-rank order.
//! 2. Across nodes, the handler sends each partial sum it holds, quantized
//!    again, to the rank that owns the chunk (a rank handles its own chunk, so
//!    its own node's partial never leaves it); the owner dequantizes and adds
//!    the partials in node order.
//!
//! Every hop dequantizes before it adds, so quantization error does not
//! compound through a chain of reductions: a chunk carries the errors of one
//! quantization per other rank of each node plus one per other node. Nodes of
//! any size work (uniform nodes give the paper's groups of equal local index).
//! A piece with a NaN or infinity is sent as NaN, so that the sum is NaN and
//! an f16 overflow is seen as one (a quantizer refuses such values).

use zquant::{Bits, QuantError, Quantized};

use crate::links::Links;
use crate::{chunk_range, CommError, Op};

/// How qgZ quantizes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantization {
    /// Bits per value.
    pub bits: Bits,
    /// Values per scale (a positive even number).
    pub block_size: usize,
}

/// The ranks of one node, in rank order, and where each rank sits on its own.
struct Nodes {
    members: Vec<Vec<usize>>,
    node_of: Vec<usize>,
    local_index: Vec<usize>,
}

impl Nodes {
    fn new(node_of: &[usize]) -> Nodes {
        let count = node_of.iter().max().map_or(0, |n| n + 1);
        let mut members = vec![Vec::new(); count];
        let mut local_index = Vec::with_capacity(node_of.len());
        for (r, &n) in node_of.iter().enumerate() {
            local_index.push(members[n].len());
            members[n].push(r);
        }
        Nodes {
            members,
            node_of: node_of.to_vec(),
            local_index,
        }
    }

    /// The rank of node `n` that reduces the chunk of rank `x` there.
    fn handler(&self, n: usize, x: usize) -> usize {
        let m = &self.members[n];
        m[self.local_index[x] % m.len()]
    }
}

/// Sums `buf` over ranks; returns this rank's chunk (`chunk_range` of the
/// length), as `reduce_scatter` does. `node_of[r]` is rank r's node.
pub(crate) fn reduce_scatter(
    l: &mut dyn Links,
    group: &str,
    node_of: &[usize],
    buf: &[f32],
    q: Quantization,
) -> Result<Vec<f32>, CommError> {
    let (w, me) = (l.world_size(), l.rank());
    let nodes = Nodes::new(node_of);
    let home = nodes.node_of[me];
    let chunk = |x: usize| chunk_range(buf.len(), w, x);
    let handled_by =
        |p: usize| -> Vec<usize> { (0..w).filter(|&x| nodes.handler(home, x) == p).collect() };
    let gather = |xs: &[usize]| -> Vec<f32> {
        xs.iter()
            .flat_map(|&x| buf[chunk(x)].iter().copied())
            .collect()
    };

    // Hop 1: inside the node.
    let peers = &nodes.members[home];
    for &p in peers.iter().filter(|&&p| p != me) {
        l.send(p, &encode(&gather(&handled_by(p)), q)?)?;
    }
    let mine = handled_by(me);
    let mut partial = vec![0f32; mine.iter().map(|&x| chunk(x).len()).sum()];
    for &p in peers {
        if p == me {
            crate::reduce_add(&mut partial, &gather(&mine));
        } else {
            let bytes = l.recv(p)?;
            let piece = decode(&bytes, partial.len(), q, (group, p))?;
            crate::reduce_add(&mut partial, &piece);
        }
    }

    // Hop 2: across nodes, each partial to its chunk's owner.
    let mut own = Vec::new();
    let mut at = 0;
    for &x in &mine {
        let part = &partial[at..at + chunk(x).len()];
        at += part.len();
        if x == me {
            own = part.to_vec();
        } else {
            l.send(x, &encode(part, q)?)?;
        }
    }
    let mut out = vec![0f32; chunk(me).len()];
    for n in 0..nodes.members.len() {
        if n == home {
            crate::reduce_add(&mut out, &own);
        } else if !nodes.members[n].is_empty() {
            let from = nodes.handler(n, me);
            let bytes = l.recv(from)?;
            let piece = decode(&bytes, out.len(), q, (group, from))?;
            crate::reduce_add(&mut out, &piece);
        }
    }
    Ok(out)
}

/// `values` quantized on the wire; non-finite values make every scale NaN.
fn encode(values: &[f32], q: Quantization) -> Result<Vec<u8>, CommError> {
    let usage = |e: QuantError| CommError::Usage {
        op: Op::QuantizedReduceScatter.name(),
        message: e.to_string(),
    };
    let codes = match zquant::quantize(values, q.bits, q.block_size) {
        Ok(codes) => codes,
        Err(QuantError::NonFinite { .. }) => {
            let mut zeros =
                zquant::quantize(&vec![0f32; values.len()], q.bits, q.block_size).map_err(usage)?;
            zeros.scales.fill(f32::NAN);
            zeros
        }
        Err(e) => return Err(usage(e)),
    };
    Ok(codes.to_bytes())
}

/// `len` values from the quantized piece of `peer` (of `group`).
fn decode(
    bytes: &[u8],
    len: usize,
    q: Quantization,
    (group, peer): (&str, usize),
) -> Result<Vec<f32>, CommError> {
    let codes = Quantized::from_bytes(q.bits, q.block_size, len, bytes).map_err(|_| {
        CommError::Mismatch {
            op: Op::QuantizedReduceScatter.name(),
            group: group.to_string(),
            peer,
            got: format!("{} bytes", bytes.len()),
            expected: format!(
                "{} bytes for {len} values",
                Quantized::wire_len(q.bits, q.block_size, len)
            ),
        }
    })?;
    let mut out = vec![0f32; len];
    zquant::dequantize(&codes, &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_has_one_handler_per_node_and_own_chunks_stay_home() {
        for node_of in [
            vec![0, 0, 1, 1],
            vec![0, 0, 0, 1, 1],
            vec![0, 1, 2],
            vec![0, 0, 0, 0],
            vec![0, 0, 0, 1, 1, 1, 2, 2],
        ] {
            let nodes = Nodes::new(&node_of);
            for x in 0..node_of.len() {
                for (n, m) in nodes.members.iter().enumerate() {
                    let h = nodes.handler(n, x);
                    assert!(m.contains(&h), "{node_of:?}: handler of {x} off node {n}");
                    if n == node_of[x] {
                        assert_eq!(h, x, "{node_of:?}: rank {x} does not handle its own chunk");
                    }
                }
            }
        }
    }
}
