//! The TCP transport: one authenticated connection per pair of ranks.
//!
//! Threads: one operation thread runs the collectives in issue order and does all
//! the reading; one writer thread per peer drains that peer's send queue, so a
//! rank can send to its right neighbour while it receives from its left (a ring
//! with blocking writes on both sides would deadlock once socket buffers fill).
//! Each message carries a 16-byte header: the operation's sequence number and the
//! payload length. After any error the communicator is poisoned: later operations
//! fail at once with the first error, instead of reading a half-finished stream.

mod handshake;
mod peers;

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use zproto::Token;

use crate::direct::Direct;
use crate::links::{Links, OpClock};

use crate::opthread::OpThread;
use crate::quantized::Coding;
use crate::{
    chunk_range, CommError, Communicator, CounterSnapshot, Counters, Op, SetupError, Work,
};
use crate::{pairwise, quantized, ring, star, Half, Quantization, SharedFeedback};
use peers::{writer_loop, Outgoing, Peer, TcpLinks, Wire, WriterState};

/// How to build a [`TcpCommunicator`].
#[derive(Debug, Clone)]
pub struct TcpOptions {
    /// The job token; peers must prove it.
    pub token: Token,
    /// Deadline of connection setup and of every collective.
    pub timeout: Duration,
    /// Node index of every rank (for intra/inter-node accounting).
    pub node_of_rank: Vec<usize>,
    /// Group name for messages.
    pub group: String,
    /// Name of this node's shared-memory segment: when set, peers on the same
    /// node talk through shared memory instead of TCP.
    pub shm: Option<String>,
    /// Within a node, whether all-gathers may read each peer's chunk straight
    /// from its memory (one copy, `process_vm_readv`) where the system allows
    /// it, instead of copying through the segment (two). The same on every
    /// rank of the group.
    pub single_copy: bool,
}

/// A [`Communicator`] over TCP sockets.
pub struct TcpCommunicator {
    rank: usize,
    world: usize,
    node_of_rank: Vec<usize>,
    counters: Arc<Counters>,
    /// Dropping it waits until every queued message is on the wire: a rank that
    /// exits right after its last collective must not take the bytes its peers
    /// are still waiting for with it. (Writes time out after the
    /// communicator's timeout, so this wait is bounded.)
    ops: OpThread<TcpLinks>,
}

impl TcpCommunicator {
    /// Binds the data-plane listener on `host` (any free port). Publish its
    /// `local_addr()` to the other ranks, then call [`TcpCommunicator::connect`].
    pub fn bind(host: &str) -> std::io::Result<TcpListener> {
        TcpListener::bind((host, 0))
    }

    /// Connects to every rank at `addrs` (indexed by rank) and starts the threads.
    pub fn connect(
        rank: usize,
        listener: TcpListener,
        addrs: &[SocketAddr],
        opts: TcpOptions,
    ) -> Result<TcpCommunicator, CommError> {
        let world = addrs.len();
        let setup = |cause: SetupError| CommError::Setup {
            group: opts.group.clone(),
            cause,
        };
        if rank >= world || opts.node_of_rank.len() != world {
            return Err(setup(SetupError::BadTopology {
                rank,
                world,
                node_entries: opts.node_of_rank.len(),
            }));
        }
        let streams = handshake::connect_mesh(rank, listener, addrs, &opts.token, opts.timeout)
            .map_err(setup)?;
        // Ranks on this node, and the segment they share (if asked for).
        let local: Vec<usize> = (0..world)
            .filter(|&r| opts.node_of_rank[r] == opts.node_of_rank[rank])
            .collect();
        let segment = match &opts.shm {
            Some(name) if local.len() > 1 => {
                let me = local
                    .iter()
                    .position(|&r| r == rank)
                    .expect("a rank is on its own node");
                let deadline = Instant::now() + opts.timeout;
                Some((
                    me,
                    crate::shm::Segment::open(name, local.len(), me, deadline).map_err(|e| {
                        setup(SetupError::SharedMemory {
                            name: name.clone(),
                            cause: Arc::new(e),
                        })
                    })?,
                ))
            }
            _ => None,
        };
        let counters = Arc::new(Counters::default());
        let mut peers = Vec::with_capacity(world);
        for (peer, s) in streams.into_iter().enumerate() {
            let Some(socket) = s else {
                peers.push(None);
                continue;
            };
            let (reader, writer): (Box<dyn Wire>, Box<dyn Write + Send>) =
                match (&segment, local.iter().position(|&r| r == peer)) {
                    (Some((me, seg)), Some(them)) => {
                        let (mut w, r) = seg.endpoints(*me, them);
                        w.set_timeout(opts.timeout);
                        (Box::new(r), Box::new(w))
                    }
                    _ => {
                        let writer = socket.try_clone().map_err(|e| setup(e.into()))?;
                        writer
                            .set_write_timeout(Some(opts.timeout))
                            .map_err(|e| setup(e.into()))?;
                        (Box::new(socket), Box::new(writer))
                    }
                };
            let (tx, rx) = mpsc::channel::<Outgoing>();
            let (spent_tx, spent) = mpsc::channel::<Vec<u8>>();
            let state = Arc::new(WriterState::default());
            let state2 = state.clone();
            let thread = std::thread::Builder::new()
                .name(format!("zcomm-send-{peer}"))
                .spawn(move || writer_loop(writer, rx, spent_tx, state2))
                .map_err(|e| setup(e.into()))?;
            peers.push(Some(Peer {
                reader,
                spent,
                queue: tx,
                queued: 0,
                writer: Some(thread),
                state,
                same_node: opts.node_of_rank[peer] == opts.node_of_rank[rank],
            }));
        }
        // Every rank on this node: collectives go through the segment directly.
        let direct = match &segment {
            Some((me, seg)) if local.len() == world => {
                Some(Direct::new(seg.clone(), *me, opts.single_copy))
            }
            _ => None,
        };
        let links = TcpLinks {
            rank,
            world,
            direct,
            group: opts.group.clone(),
            peers,
            counters: counters.clone(),
            clock: OpClock::new(opts.timeout, Arc::new(Mutex::new(None))),
        };
        let current = links.clock.current.clone();
        let ops = OpThread::spawn(
            "zcomm-ops",
            links,
            TcpLinks::flush,
            opts.group.clone(),
            opts.timeout,
            current,
            counters.clone(),
        )
        .map_err(|e| setup(e.into()))?;
        Ok(TcpCommunicator {
            rank,
            world,
            node_of_rank: opts.node_of_rank.clone(),
            counters,
            ops,
        })
    }

    fn submit<T: Send + 'static>(
        &self,
        op: Op,
        bytes: usize,
        f: impl FnOnce(&mut TcpLinks) -> Result<T, CommError> + Send + 'static,
    ) -> Work<T> {
        self.ops.submit(op, move |links| links.run(op, bytes, f))
    }
}

impl Communicator for TcpCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn group_name(&self) -> &str {
        self.ops.group()
    }
    fn counters(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }
    fn take_op_log(&self) -> Vec<crate::OpTally> {
        self.counters.take_log()
    }
    fn timeout(&self) -> Duration {
        self.ops.timeout()
    }
    fn in_flight(&self) -> Option<crate::InFlight> {
        self.ops.in_flight()
    }

    fn all_reduce_async(&self, mut buf: Vec<f32>) -> Work<Vec<f32>> {
        let bytes = buf.len() * 4;
        self.submit(Op::AllReduce, bytes, move |l| {
            match l.direct(|d, c| d.all_reduce(c, &mut buf)) {
                Some(r) => r?,
                None => {
                    ring::all_reduce(l, &mut buf)?;
                }
            }
            Ok(buf)
        })
    }

    fn reduce_scatter_async(&self, mut buf: Vec<f32>) -> Work<Vec<f32>> {
        let bytes = buf.len() * 4;
        self.submit(Op::ReduceScatter, bytes, move |l| {
            // The result goes to the front of the input's allocation (a fresh
            // one would cost a page fault every 4 KiB).
            let own = chunk_range(buf.len(), l.world_size(), l.rank());
            match l.direct(|d, c| d.reduce_scatter(c, &mut buf)) {
                Some(r) => r?,
                None => {
                    ring::reduce_scatter(l, &mut buf)?;
                }
            }
            // Truncated, not shrunk: the caller packs its next bucket into
            // this allocation (a shrink maps the tail away, and the next
            // bucket faults it in again).
            buf.truncate(own.len());
            Ok(buf)
        })
    }

    fn quantized_reduce_scatter_async(
        &self,
        buf: Vec<f32>,
        q: Quantization,
        feedback: Option<SharedFeedback>,
    ) -> Work<Vec<f32>> {
        if buf.len() / self.world < q.block_size.max(1) {
            return self.reduce_scatter_async(buf);
        }
        let (bytes, node_of) = (buf.len() * 4, self.node_of_rank.clone());
        self.submit(Op::QuantizedReduceScatter, bytes, move |l| {
            let group = l.group.clone();
            quantized::quantized_reduce_scatter(l, &group, &node_of, buf, q, feedback.as_ref())
        })
    }

    fn half_reduce_scatter_async(&self, buf: Vec<f32>, half: Half) -> Work<Vec<f32>> {
        let (bytes, node_of) = (buf.len() * 4, self.node_of_rank.clone());
        self.submit(Op::ReduceScatter, bytes, move |l| {
            let group = l.group.clone();
            let op = Op::ReduceScatter;
            quantized::reduce_scatter(l, (&group, op), &node_of, buf, Coding::Half(half), None)
        })
    }

    fn half_all_reduce_async(&self, buf: Vec<f32>, half: Half) -> Work<Vec<f32>> {
        let (bytes, node_of) = (buf.len() * 4, self.node_of_rank.clone());
        self.submit(Op::AllReduce, bytes, move |l| {
            let group = l.group.clone();
            quantized::all_reduce_half(l, &group, &node_of, buf, half)
        })
    }

    /// Within a node the gathered buffer is allocated here, on the caller's
    /// thread, and filled on the links' thread: glibc serves each thread
    /// from an arena of its own and a freed block goes back to the arena it
    /// came from, so stage 3's gathered parameters, made on the links'
    /// thread and freed by the compute thread, sat in an arena the compute
    /// thread does not allocate from (gpt-anchor at stage 3, one worker of
    /// two threads: 620 MiB peak RSS for 568 MB of heap at its most).
    fn all_gather_async(&self, chunk: Vec<f32>, total_len: usize) -> Work<Vec<f32>> {
        let mut out: Vec<f32> = Vec::with_capacity(total_len);
        self.submit(Op::AllGather, total_len * 4, move |l| {
            let own = chunk_range(total_len, l.world_size(), l.rank());
            if chunk.len() != own.len() {
                return Err(CommError::Usage {
                    op: "all_gather",
                    message: format!(
                        "rank {} holds {} elements, chunk {} of {total_len} has {}",
                        l.rank(),
                        chunk.len(),
                        l.rank(),
                        own.len()
                    ),
                });
            }
            // Through the node's shared segment, which fills the buffer
            // whole; else a zeroed one of the kernel's (fresh pages, not
            // written here) through the links.
            let slots = &mut out.spare_capacity_mut()[..total_len];
            match l.direct(|d, c| d.all_gather_into(c, &chunk, slots)) {
                Some(r) => {
                    r?;
                    // SAFETY: the gather wrote every element.
                    unsafe { out.set_len(total_len) };
                    Ok(out)
                }
                // One rank: its chunk is the whole (made on the caller's thread).
                None if l.world_size() == 1 => Ok(chunk),
                None => {
                    let mut buf = crate::zeroed_large(total_len);
                    buf[own].copy_from_slice(&chunk);
                    ring::all_gather(l, &mut buf)?;
                    Ok(buf)
                }
            }
        })
    }

    fn all_gather_in_place_async(&self, buf: Vec<f32>) -> Work<Vec<f32>> {
        self.submit(Op::AllGather, buf.len() * 4, move |l| {
            gather_in_place(l, buf)
        })
    }

    /// Allocated on the caller's thread, as [`Communicator::all_gather_async`]'s.
    fn all_gather16_async(&self, chunk: Vec<u16>, total_len: usize) -> Work<Vec<u16>> {
        let mut out: Vec<u16> = Vec::with_capacity(total_len);
        self.submit(Op::AllGather, total_len * 2, move |l| {
            let own = crate::chunk16(total_len, chunk.len(), l.world_size(), l.rank())?;
            if l.world_size() == 1 {
                // Its chunk is the whole (made on the caller's thread).
                return Ok(chunk);
            }
            let words = total_len / 2;
            let own_words = crate::words_of_halves(&chunk);
            let Some(slots) = crate::word_slots(&mut out, words) else {
                // Memory not laid out as words: gathered as words, then
                // copied out.
                let mut buf = crate::zeroed_large(words);
                buf[own].copy_from_slice(&own_words);
                return Ok(crate::halves_of_words(&gather_in_place(l, buf)?));
            };
            // Through the node's shared segment straight into `out`; else
            // zeroed, through the links.
            if let Some(r) = l.direct(|d, c| d.all_gather_into(c, &own_words, slots)) {
                r?;
            } else {
                for w in slots.iter_mut() {
                    w.write(0.0);
                }
                // SAFETY: every word of the spare capacity was just written.
                unsafe { out.set_len(total_len) };
                let buf: &mut [f32] = bytemuck::cast_slice_mut(&mut out);
                buf[own].copy_from_slice(&own_words);
                ring::all_gather(l, buf)?;
                return Ok(out);
            }
            // SAFETY: the gather wrote every word of the spare capacity.
            unsafe { out.set_len(total_len) };
            Ok(out)
        })
    }

    fn all_gather16_in_place_async(&self, mut buf: Vec<u16>) -> Work<Vec<u16>> {
        let len = buf.len();
        self.submit(Op::AllGather, len * 2, move |l| {
            crate::even16(len)?;
            match crate::words_in_place(&mut buf) {
                Some(words) => {
                    match l.direct(|d, c| d.all_gather(c, words)) {
                        Some(r) => r?,
                        None => ring::all_gather(l, words)?,
                    };
                    Ok(buf)
                }
                // Memory not laid out as words: gathered as words, then
                // copied back.
                None => Ok(crate::halves_of_words(&gather_in_place(
                    l,
                    crate::words_of_halves(&buf).into_owned(),
                )?)),
            }
        })
    }

    fn all_to_all_async(&self, pieces: Vec<Vec<u8>>) -> Work<Vec<Vec<u8>>> {
        let bytes = pieces.iter().map(Vec::len).sum();
        self.submit(Op::AllToAll, bytes, move |l| {
            if pieces.len() != l.world_size() {
                return Err(CommError::Usage {
                    op: "all_to_all",
                    message: format!("{} pieces for {} ranks", pieces.len(), l.world_size()),
                });
            }
            pairwise::all_to_all(l, pieces)
        })
    }

    fn broadcast_async(&self, buf: Vec<u8>, root: usize) -> Work<Vec<u8>> {
        let bytes = buf.len();
        self.submit(Op::Broadcast, bytes, move |l| {
            if root >= l.world_size() {
                return Err(CommError::Usage {
                    op: "broadcast",
                    message: format!("root {root} with {} ranks", l.world_size()),
                });
            }
            star::broadcast(l, buf, root)
        })
    }

    fn barrier_async(&self) -> Work<()> {
        self.submit(Op::Barrier, 0, |l| match l.direct(|d, c| d.barrier_op(c)) {
            Some(r) => r,
            None => star::barrier(l),
        })
    }
}

/// Every chunk of `buf` filled from its owner, through the node's shared
/// segment where the whole group is on it, else the ring.
fn gather_in_place(l: &mut TcpLinks, mut buf: Vec<f32>) -> Result<Vec<f32>, CommError> {
    match l.direct(|d, c| d.all_gather(c, &mut buf)) {
        Some(r) => r?,
        None => ring::all_gather(l, &mut buf)?,
    };
    Ok(buf)
}
