//! Reductions whose data crosses the links narrowed, in two hops: ZeRO++
//! qgZ's blockwise quantization, as the ZeRO++ paper does it, or 16-bit
//! floats (`train.reduce_dtype`, DeepSpeed's `communication_data_type`).
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
//!    pieces and adds them in f32 to its own (unquantized), in local-rank order.
//! 2. Across nodes, the handler sends each partial sum it holds, quantized
//!    again, to the rank that owns the chunk (a rank handles its own chunk, so
//!    its own node's partial never leaves it); the owner dequantizes and adds
//!    the other nodes' partials to its own, in node order.
//!
//! Every hop dequantizes before it adds, so quantization error does not
//! compound through a chain of reductions: a chunk carries the errors of one
//! quantization per other rank of each node plus one per other node. Nodes of
//! any size work (uniform nodes give the paper's groups of equal local index).
//! A piece with a NaN or infinity is sent as NaN, so that the sum is NaN and
//! an f16 overflow is seen as one (a quantizer refuses such values).
//!
//! 16-bit floats go the same way, each piece rounded to nearest even where a
//! quantized one is quantized (an infinity stays one, and a partial sum
//! beyond f16's range becomes one, as it would in an f16 reduction). Their
//! result is rounded to the wire type too, so that an all-reduce, whose
//! second half gathers the owners' sums in 16 bits, gives every rank the
//! values a reduce-scatter gives the owner: the stages stay bit-identical.

use std::ops::Range;

use zquant::{Bits, Half, QuantError, Quantized};

use crate::links::Links;
use crate::loco::ErrorFeedback;
use crate::{chunk_range, CommError, Op, SharedFeedback};

/// How qgZ quantizes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantization {
    /// Bits per value.
    pub bits: Bits,
    /// Values per scale (a positive even number).
    pub block_size: usize,
}

/// What a two-hop reduction sends in place of f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Coding {
    /// qgZ's blocks.
    Quantized(Quantization),
    /// 16-bit floats; the result is rounded to them too.
    Half(Half),
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
/// length) in the front of `buf`'s allocation, as `reduce_scatter` does.
/// `node_of[r]` is rank r's node; `op` names the collective in errors.
/// With `feedback` (LoCo, quantized only) each value sent carries the error
/// kept from the last time, and what quantizing loses now is kept.
pub(crate) fn reduce_scatter(
    l: &mut dyn Links,
    who: (&str, Op),
    node_of: &[usize],
    mut buf: Vec<f32>,
    wire: Coding,
    feedback: Option<&mut ErrorFeedback>,
) -> Result<Vec<f32>, CommError> {
    reduce_scatter_in_place(l, who, node_of, &mut buf, wire, feedback)?;
    let own = chunk_range(buf.len(), l.world_size(), l.rank());
    let len = own.len();
    buf.copy_within(own, 0);
    buf.truncate(len);
    Ok(buf)
}

/// [`reduce_scatter`] with qgZ's quantization, LoCo's `feedback` (where
/// the job has it) locked for the reduction: what every transport's
/// `quantized_reduce_scatter_async` runs on its operation thread.
pub(crate) fn quantized_reduce_scatter(
    l: &mut dyn Links,
    group: &str,
    node_of: &[usize],
    buf: Vec<f32>,
    q: Quantization,
    feedback: Option<&SharedFeedback>,
) -> Result<Vec<f32>, CommError> {
    let mut feedback = feedback.map(|f| f.lock().unwrap_or_else(|e| e.into_inner()));
    let op = Op::QuantizedReduceScatter;
    let coding = Coding::Quantized(q);
    reduce_scatter(
        l,
        (group, op),
        node_of,
        buf,
        coding,
        feedback.as_deref_mut(),
    )
}

/// [`reduce_scatter`] leaving this rank's chunk of the sum where it is in
/// `buf`. The chunks this rank handles for its node hold their partial
/// sums as they build up (this rank's own values first, then each local
/// peer's piece in rank order, then each other node's partial in node
/// order), so nothing is allocated but the messages: a fresh buffer of
/// megabytes costs a page fault every 4 KiB.
fn reduce_scatter_in_place(
    l: &mut dyn Links,
    (group, op): (&str, Op),
    node_of: &[usize],
    buf: &mut [f32],
    wire: Coding,
    feedback: Option<&mut ErrorFeedback>,
) -> Result<(), CommError> {
    let (w, me) = (l.world_size(), l.rank());
    let nodes = Nodes::new(node_of);
    let mut loco = feedback.map(|feedback| {
        feedback.begin();
        Loco { feedback, sent: 0 }
    });
    let home = nodes.node_of[me];
    let len = buf.len();
    let chunk = |x: usize| chunk_range(len, w, x);
    let handled_by = |p: usize| -> Vec<Range<usize>> {
        (0..w)
            .filter(|&x| nodes.handler(home, x) == p)
            .map(chunk)
            .collect()
    };

    // Hop 1: inside the node. What is sent is read before any chunk this
    // rank handles is added to (the pieces are other handlers' chunks).
    let peers = &nodes.members[home];
    for &p in peers.iter().filter(|&&p| p != me) {
        send(l, p, buf, &handled_by(p), wire, op, loco.as_mut())?;
    }
    let mine = handled_by(me);
    for &p in peers.iter().filter(|&&p| p != me) {
        receive(l, buf, &mine, Arrive::Add, wire, (group, op, p))?;
    }

    // Hop 2: across nodes, each partial to its chunk's owner.
    for x in (0..w).filter(|&x| x != me && nodes.handler(home, x) == me) {
        send(l, x, buf, &[chunk(x)], wire, op, loco.as_mut())?;
    }
    if let Some(Loco { feedback, sent }) = loco {
        feedback.finish(sent);
    }
    for n in (0..nodes.members.len()).filter(|&n| n != home) {
        if !nodes.members[n].is_empty() {
            let from = nodes.handler(n, me);
            receive(l, buf, &[chunk(me)], Arrive::Add, wire, (group, op, from))?;
        }
    }
    if let Coding::Half(half) = wire {
        half.round_in_place(&mut buf[chunk(me)]);
    }
    Ok(())
}

/// Sums `buf` over ranks in 16-bit pieces, every rank receiving the whole
/// sum: [`reduce_scatter`], then each owner's rounded chunk sent to every
/// other rank in 16 bits. The result is `buf`'s allocation.
pub(crate) fn all_reduce_half(
    l: &mut dyn Links,
    group: &str,
    node_of: &[usize],
    mut buf: Vec<f32>,
    half: Half,
) -> Result<Vec<f32>, CommError> {
    let (w, me) = (l.world_size(), l.rank());
    let (op, coding) = (Op::AllReduce, Coding::Half(half));
    reduce_scatter_in_place(l, (group, op), node_of, &mut buf, coding, None)?;
    let len = buf.len();
    let chunk = |x: usize| chunk_range(len, w, x);
    for p in (0..w).filter(|&p| p != me) {
        send(l, p, &buf, &[chunk(me)], coding, op, None)?;
    }
    for p in (0..w).filter(|&p| p != me) {
        let who = (group, op, p);
        receive(l, &mut buf, &[chunk(p)], Arrive::Set, coding, who)?;
    }
    Ok(buf)
}

/// Values of 16 bits a message carries at most: a piece of more goes as
/// several messages, so that rounding the next overlaps the transport
/// sending this one, and the receiver widens each while the next is on
/// the wire. 512 KiB, a few of the transports' slots.
const PART: usize = 1 << 18;

/// The parts a piece of `n` values travels in (at least one, which may be
/// empty): a quantized piece is one message, its blocks running across
/// the chunks.
fn parts(wire: Coding, n: usize) -> usize {
    match wire {
        Coding::Half(_) => n.div_ceil(PART).max(1),
        Coding::Quantized(_) => 1,
    }
}

/// The ranges of `buf` that values `from..from + n` of the concatenation of
/// `ranges` lie in, in order.
fn spans(ranges: &[Range<usize>], from: usize, n: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut skip, mut left) = (from, n);
    for r in ranges {
        if left == 0 {
            break;
        }
        if skip >= r.len() {
            skip -= r.len();
            continue;
        }
        let take = (r.len() - skip).min(left);
        out.push(r.start + skip..r.start + skip + take);
        left -= take;
        skip = 0;
    }
    out
}

thread_local! {
    /// The operation thread's message buffers, kept between collectives: a
    /// fresh one of megabytes is page-faulted in every call (this VM
    /// charges about 2 µs a fault).
    static MESSAGES: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// LoCo's feedback through one reduction, and the messages sent so far.
struct Loco<'a> {
    feedback: &'a mut ErrorFeedback,
    sent: usize,
}

/// Codes the values of `buf` in `ranges`, one after another, and queues
/// them for `peer` in [`parts`] (the transport copies each payload). With
/// `loco`, quantized values are sent with their kept errors added.
fn send(
    l: &mut dyn Links,
    peer: usize,
    buf: &[f32],
    ranges: &[Range<usize>],
    wire: Coding,
    op: Op,
    loco: Option<&mut Loco>,
) -> Result<(), CommError> {
    if let (Some(loco), Coding::Quantized(q)) = (loco, wire) {
        return send_compensated(l, peer, buf, ranges, (q, op), loco);
    }
    let n: usize = ranges.iter().map(|r| r.len()).sum();
    let count = parts(wire, n);
    let mut bytes = MESSAGES.with(|m| m.borrow_mut().pop()).unwrap_or_default();
    let mut sent = Ok(());
    for k in 0..count {
        let (from, to) = (n * k / count, n * (k + 1) / count);
        let pieces: Vec<&[f32]> = spans(ranges, from, to - from)
            .into_iter()
            .map(|r| &buf[r])
            .collect();
        sent = encode(&pieces, wire, op, &mut bytes).and_then(|()| l.send(peer, &bytes));
        if sent.is_err() {
            break;
        }
    }
    give_back(bytes);
    sent
}

/// [`send`] of quantized values with LoCo's errors added (one message,
/// the reduction's next): the values of `buf` in `ranges`, one after
/// another, each with the error kept for it, quantized, and the errors
/// updated by what quantizing lost ([`zquant::quantize_compensated`]). A
/// piece with a non-finite value goes as NaN and forgets its errors.
fn send_compensated(
    l: &mut dyn Links,
    peer: usize,
    buf: &[f32],
    ranges: &[Range<usize>],
    (q, op): (Quantization, Op),
    loco: &mut Loco,
) -> Result<(), CommError> {
    let values: Vec<f32> = ranges
        .iter()
        .flat_map(|r| &buf[r.clone()])
        .copied()
        .collect();
    let beta = loco.feedback.beta();
    let errors = loco.feedback.message(loco.sent);
    loco.sent += 1;
    let codes = match zquant::quantize_compensated(&values, errors, beta, q.bits, q.block_size) {
        Ok(codes) => codes,
        // NaN scales, as `encode` sends.
        Err(_) => quantize_values(&values, q, op)?,
    };
    l.send(peer, &codes.to_bytes())
}

/// Receives what [`send`] sent for `ranges` from the peer of `who` and
/// lands it on those values of `buf`, a part at a time.
fn receive(
    l: &mut dyn Links,
    buf: &mut [f32],
    ranges: &[Range<usize>],
    arrive: Arrive,
    wire: Coding,
    who: (&str, Op, usize),
) -> Result<(), CommError> {
    let n: usize = ranges.iter().map(|r| r.len()).sum();
    let count = parts(wire, n);
    let mut bytes = MESSAGES.with(|m| m.borrow_mut().pop()).unwrap_or_default();
    for k in 0..count {
        let (from, to) = (n * k / count, n * (k + 1) / count);
        bytes = l.recv_reusing(who.2, bytes)?;
        let spans = spans(ranges, from, to - from);
        match wire {
            // 2 bytes a value: each span's part widened onto it.
            Coding::Half(half) => {
                if bytes.len() != 2 * (to - from) {
                    return Err(mismatch(who, bytes.len(), 2 * (to - from), to - from));
                }
                let mut at = 0;
                for r in spans {
                    let m = r.len();
                    widen(&bytes[2 * at..2 * (at + m)], &mut buf[r], arrive, half);
                    at += m;
                }
            }
            // Blocks run across the spans: dequantized whole, then landed.
            Coding::Quantized(q) => {
                let len = to - from;
                let codes =
                    Quantized::from_bytes(q.bits, q.block_size, len, &bytes).map_err(|_| {
                        let want = Quantized::wire_len(q.bits, q.block_size, len);
                        mismatch(who, bytes.len(), want, len)
                    })?;
                let mut whole = vec![0f32; len];
                zquant::dequantize(&codes, &mut whole);
                let mut at = 0;
                for r in spans {
                    let m = r.len();
                    match arrive {
                        Arrive::Add => crate::reduce_add(&mut buf[r], &whole[at..at + m]),
                        Arrive::Set => buf[r].copy_from_slice(&whole[at..at + m]),
                    }
                    at += m;
                }
            }
        }
    }
    give_back(bytes);
    Ok(())
}

/// Keeps a message buffer for the next (two at most: one sent, one
/// received).
fn give_back(bytes: Vec<u8>) {
    MESSAGES.with(|m| {
        let mut m = m.borrow_mut();
        if m.len() < 2 {
            m.push(bytes);
        }
    });
}

/// `pieces`, one after another, coded for the wire into `bytes` (its
/// contents replaced); non-finite values make every scale of a quantized
/// piece NaN.
fn encode(pieces: &[&[f32]], wire: Coding, op: Op, bytes: &mut Vec<u8>) -> Result<(), CommError> {
    let q = match wire {
        Coding::Quantized(q) => q,
        // Rounded straight into the message, a piece after another.
        Coding::Half(half) => {
            // Every byte is written below: a kept buffer of the same size
            // (the next bucket's, usually) is not zeroed first.
            let len: usize = pieces.iter().map(|p| p.len()).sum();
            bytes.resize(2 * len, 0);
            let mut at = 0;
            for piece in pieces {
                let out = &mut bytes[2 * at..2 * (at + piece.len())];
                match bytemuck::try_cast_slice_mut::<u8, u16>(out) {
                    Ok(bits) => half.round_slice(piece, bits),
                    // An allocation that does not start on a 2-byte boundary.
                    Err(_) => {
                        for (b, &x) in out.chunks_exact_mut(2).zip(piece.iter()) {
                            b.copy_from_slice(&half.round(x).to_le_bytes());
                        }
                    }
                }
                at += piece.len();
            }
            return Ok(());
        }
    };
    *bytes = quantize_values(&pieces.concat(), q, op)?.to_bytes();
    Ok(())
}

/// `values` quantized as `q` says; where one is not finite, every scale
/// NaN (so that the receiver's sum is NaN).
fn quantize_values(values: &[f32], q: Quantization, op: Op) -> Result<Quantized, CommError> {
    let usage = |e: QuantError| CommError::Usage {
        op: op.name(),
        message: e.to_string(),
    };
    match zquant::quantize(values, q.bits, q.block_size) {
        Ok(codes) => Ok(codes),
        Err(QuantError::NonFinite { .. }) => {
            let mut zeros =
                zquant::quantize(&vec![0f32; values.len()], q.bits, q.block_size).map_err(usage)?;
            zeros.scales.fill(f32::NAN);
            Ok(zeros)
        }
        Err(e) => Err(usage(e)),
    }
}

/// A message of `got` bytes from `peer` where `expected` carry `len` values.
fn mismatch(
    (group, op, peer): (&str, Op, usize),
    got: usize,
    expected: usize,
    len: usize,
) -> CommError {
    CommError::Mismatch {
        op: op.name(),
        group: group.to_string(),
        peer,
        got: format!("{got} bytes"),
        expected: format!("{expected} bytes for {len} values"),
    }
}

/// What a decoded piece does to the values it lands on.
#[derive(Clone, Copy, PartialEq)]
enum Arrive {
    /// Added to them.
    Add,
    /// Written over them.
    Set,
}

/// Widens 16-bit values (`bytes`, 2 a value, as many as `out` holds) onto
/// `out`, a stack block at a time.
fn widen(bytes: &[u8], out: &mut [f32], arrive: Arrive, half: Half) {
    let mut wide = [0f32; 1024];
    for (dst, src) in out.chunks_mut(wide.len()).zip(bytes.chunks(2 * wide.len())) {
        let wide = &mut wide[..dst.len()];
        match bytemuck::try_cast_slice::<u8, u16>(src) {
            Ok(bits) => half.widen_slice(bits, wide),
            // A message that does not start on a 2-byte boundary.
            Err(_) => {
                for (o, b) in wide.iter_mut().zip(src.chunks_exact(2)) {
                    *o = half.widen(u16::from_le_bytes([b[0], b[1]]));
                }
            }
        }
        match arrive {
            Arrive::Add => crate::reduce_add(dst, wide),
            Arrive::Set => dst.copy_from_slice(wide),
        }
    }
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
