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

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use zproto::Token;

use crate::direct::{Call, Direct};
use crate::links::Links;
use crate::{
    chunk_range, CommError, Communicator, CounterSnapshot, Counters, Op, SetupError, Work,
};
use crate::{pairwise, ring, star};

const HEADER: usize = 16;

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
}

/// The receiving half of a link: a socket or a shared-memory ring.
trait Wire: Read + Send {
    /// Makes reads give up with `TimedOut` after `d`.
    fn set_read_deadline(&mut self, d: Duration) -> std::io::Result<()>;
}

impl Wire for TcpStream {
    fn set_read_deadline(&mut self, d: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(d))
    }
}

impl Wire for crate::shm::ShmReader {
    fn set_read_deadline(&mut self, d: Duration) -> std::io::Result<()> {
        self.set_read_timeout(d);
        Ok(())
    }
}

type Job = Box<dyn FnOnce(&mut TcpLinks) + Send>;

/// A [`Communicator`] over TCP sockets.
pub struct TcpCommunicator {
    rank: usize,
    world: usize,
    group: String,
    timeout: Duration,
    jobs: mpsc::Sender<Job>,
    counters: Arc<Counters>,
    op_thread: Option<std::thread::JoinHandle<()>>,
    current: Arc<Mutex<Option<Current>>>,
}

/// What the operation thread is doing, shared for [`Communicator::in_flight`].
#[derive(Debug, Clone)]
struct Current {
    op: Op,
    bytes: usize,
    started: Instant,
    peer: Option<usize>,
}

impl Drop for TcpCommunicator {
    /// Stops the operation thread and waits until every queued message is on the
    /// wire: a rank that exits right after its last collective must not take the
    /// bytes its peers are still waiting for with it. (Writes time out after the
    /// communicator's timeout, so this wait is bounded.)
    fn drop(&mut self) {
        drop(std::mem::replace(&mut self.jobs, mpsc::channel().0));
        if let Some(t) = self.op_thread.take() {
            let _ = t.join();
        }
    }
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
            let (tx, rx) = mpsc::channel::<Vec<u8>>();
            let (spent_tx, spent) = mpsc::channel::<Vec<u8>>();
            let error = Arc::new(Mutex::new(None));
            let err2 = error.clone();
            let thread = std::thread::Builder::new()
                .name(format!("zcomm-send-{peer}"))
                .spawn(move || writer_loop(writer, rx, spent_tx, err2))
                .map_err(|e| setup(e.into()))?;
            peers.push(Some(Peer {
                reader,
                spent,
                queue: tx,
                writer: Some(thread),
                error,
                same_node: opts.node_of_rank[peer] == opts.node_of_rank[rank],
            }));
        }
        // Every rank on this node: collectives go through the segment directly.
        let direct = match &segment {
            Some((me, seg)) if local.len() == world => Some(Direct::new(seg.clone(), *me)),
            _ => None,
        };
        let mut links = TcpLinks {
            rank,
            world,
            direct,
            group: opts.group.clone(),
            peers,
            counters: counters.clone(),
            timeout: opts.timeout,
            op: Op::Barrier,
            seq: 0,
            deadline: Instant::now(),
            started: Instant::now(),
            poisoned: None,
            current: Arc::new(Mutex::new(None)),
        };
        let current = links.current.clone();
        let (jobs, rx) = mpsc::channel::<Job>();
        let op_thread = std::thread::Builder::new()
            .name("zcomm-ops".into())
            .spawn(move || {
                for job in rx {
                    job(&mut links);
                }
                links.flush();
            })
            .map_err(|e| setup(e.into()))?;
        Ok(TcpCommunicator {
            rank,
            world,
            group: opts.group,
            timeout: opts.timeout,
            jobs,
            counters,
            op_thread: Some(op_thread),
            current,
        })
    }

    fn submit<T: Send + 'static>(
        &self,
        op: Op,
        bytes: usize,
        f: impl FnOnce(&mut TcpLinks) -> Result<T, CommError> + Send + 'static,
    ) -> Work<T> {
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move |links: &mut TcpLinks| {
            let _ = tx.send(links.run(op, bytes, f));
        });
        // If the thread is gone the receiver disconnects and `wait` reports it.
        let _ = self.jobs.send(job);
        // The operation enforces its own deadline once it starts; this bounds the
        // wait for work queued ahead of it too.
        let deadline = Instant::now() + self.timeout * 2 + Duration::from_secs(5);
        Work::new(rx, op, self.group.clone(), deadline)
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
        &self.group
    }
    fn counters(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
    fn in_flight(&self) -> Option<crate::InFlight> {
        let s = self.current.lock().ok()?.clone()?;
        Some(crate::InFlight {
            op: s.op.name(),
            group: self.group.clone(),
            bytes: s.bytes,
            waiting: s.started.elapsed(),
            peer: s.peer,
        })
    }

    fn all_reduce_async(&self, mut buf: Vec<f32>) -> Work<Vec<f32>> {
        let bytes = buf.len() * 4;
        self.submit(Op::AllReduce, bytes, move |l| {
            match l.direct(|d, c| d.all_reduce(c, &mut buf)) {
                Some(r) => r?,
                None => {
                    ring::reduce_scatter(l, &mut buf)?;
                    ring::all_gather(l, &mut buf)?;
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
                    buf.copy_within(own.clone(), 0);
                }
            }
            buf.truncate(own.len());
            buf.shrink_to_fit();
            Ok(buf)
        })
    }

    fn all_gather_async(&self, chunk: Vec<f32>, total_len: usize) -> Work<Vec<f32>> {
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
            let mut buf = crate::zeroed_large(total_len);
            buf[own].copy_from_slice(&chunk);
            match l.direct(|d, c| d.all_gather(c, &mut buf)) {
                Some(r) => r?,
                None => ring::all_gather(l, &mut buf)?,
            }
            Ok(buf)
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

struct Peer {
    reader: Box<dyn Wire>,
    /// Buffers the writer thread has sent, for reuse.
    spent: mpsc::Receiver<Vec<u8>>,
    queue: mpsc::Sender<Vec<u8>>,
    writer: Option<std::thread::JoinHandle<()>>,
    error: Arc<Mutex<Option<String>>>,
    same_node: bool,
}

/// Drains a peer's queue onto its link, handing each buffer back for reuse (a
/// fresh multi-megabyte buffer per message costs a page fault per 4 KiB).
fn note_waiting_for(current: &Mutex<Option<Current>>, peer: usize) {
    if let Ok(mut g) = current.lock() {
        if let Some(c) = g.as_mut() {
            c.peer = Some(peer);
        }
    }
}

fn writer_loop(
    mut s: Box<dyn Write + Send>,
    rx: mpsc::Receiver<Vec<u8>>,
    spent: mpsc::Sender<Vec<u8>>,
    error: Arc<Mutex<Option<String>>>,
) {
    for msg in rx {
        if let Err(e) = s.write_all(&msg) {
            *error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
            return;
        }
        let _ = spent.send(msg);
    }
    let _ = s.flush();
}

pub(crate) struct TcpLinks {
    rank: usize,
    world: usize,
    /// The shared-memory path, when every rank of the group is on this node.
    direct: Option<Direct>,
    group: String,
    peers: Vec<Option<Peer>>,
    counters: Arc<Counters>,
    timeout: Duration,
    op: Op,
    seq: u64,
    deadline: Instant,
    started: Instant,
    poisoned: Option<CommError>,
    current: Arc<Mutex<Option<Current>>>,
}

impl TcpLinks {
    /// Closes every send queue and waits for the writers to drain them (not after
    /// a failure: then nobody is waiting for those bytes, and the caller is
    /// waiting to report the error).
    fn flush(&mut self) {
        for p in self.peers.iter_mut().flatten() {
            drop(std::mem::replace(&mut p.queue, mpsc::channel().0));
        }
        if self.poisoned.is_some() {
            return;
        }
        for p in self.peers.iter_mut().flatten() {
            if let Some(w) = p.writer.take() {
                let _ = w.join();
            }
        }
    }

    fn run<T>(
        &mut self,
        op: Op,
        bytes: usize,
        f: impl FnOnce(&mut TcpLinks) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        if let Some(e) = &self.poisoned {
            return Err(e.clone());
        }
        self.op = op;
        self.seq += 1;
        self.started = Instant::now();
        self.deadline = self.started + self.timeout;
        self.set_current(Some(Current {
            op,
            bytes,
            started: self.started,
            peer: None,
        }));
        let r = f(self);
        if let Err(e) = &r {
            self.poisoned = Some(e.clone());
        } else {
            self.set_current(None);
        }
        r
    }

    fn set_current(&self, c: Option<Current>) {
        if let Ok(mut g) = self.current.lock() {
            *g = c;
        }
    }

    fn waiting_for(&self, peer: usize) {
        note_waiting_for(&self.current, peer);
    }

    /// Runs `f` on the direct shared-memory path if the group has one (`None`
    /// otherwise) and counts the bytes it reports as sent within the node.
    fn direct(
        &mut self,
        f: impl FnOnce(&mut Direct, &Call) -> Result<u64, CommError>,
    ) -> Option<Result<(), CommError>> {
        let mut d = self.direct.take()?;
        let current = self.current.clone();
        let waiting = move |peer: usize| note_waiting_for(&current, peer);
        let call = Call {
            op: self.op,
            seq: self.seq,
            group: &self.group,
            started: self.started,
            deadline: self.deadline,
            waiting_for: &waiting,
        };
        let r = f(&mut d, &call);
        self.direct = Some(d);
        Some(r.map(|bytes| self.counters.add(self.op, bytes, true)))
    }

    fn peer(&mut self, peer: usize) -> Result<&mut Peer, CommError> {
        let (op, group) = (self.op.name(), self.group.clone());
        self.peers
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or(CommError::Usage {
                op,
                message: format!("no link to rank {peer} in group {group}"),
            })
    }

    fn link_error(&self, peer: usize, message: String) -> CommError {
        CommError::Link {
            op: self.op.name(),
            group: self.group.clone(),
            peer,
            message,
        }
    }

    fn read_exact(&mut self, peer: usize, out: &mut [u8]) -> Result<(), CommError> {
        self.waiting_for(peer);
        let deadline = self.deadline;
        let mut off = 0;
        while off < out.len() {
            let now = Instant::now();
            if now >= deadline {
                let writer_err = self
                    .peer(peer)?
                    .error
                    .lock()
                    .map(|e| e.clone())
                    .unwrap_or_default();
                if let Some(e) = writer_err {
                    return Err(self.link_error(peer, format!("sending failed: {e}")));
                }
                return Err(CommError::Timeout {
                    op: self.op.name(),
                    group: self.group.clone(),
                    peer: Some(peer),
                    waited_s: (now - self.started).as_secs_f64(),
                });
            }
            let p = self.peer(peer)?;
            p.reader
                .set_read_deadline((deadline - now).max(Duration::from_millis(1)))
                .map_err(|e| CommError::Link {
                    op: "recv",
                    group: String::new(),
                    peer,
                    message: e.to_string(),
                })?;
            match p.reader.read(&mut out[off..]) {
                Ok(0) => {
                    return Err(
                        self.link_error(peer, "connection closed (did that rank exit?)".into())
                    )
                }
                Ok(n) => off += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(self.link_error(peer, e.to_string())),
            }
        }
        Ok(())
    }

    fn read_header(&mut self, peer: usize) -> Result<usize, CommError> {
        let mut h = [0u8; HEADER];
        self.read_exact(peer, &mut h)?;
        let seq = u64::from_le_bytes(h[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(h[8..].try_into().expect("8 bytes")) as usize;
        if seq != self.seq {
            return Err(CommError::Mismatch {
                op: self.op.name(),
                group: self.group.clone(),
                peer,
                got: format!("a message of collective #{seq}"),
                expected: format!("collective #{} ({})", self.seq, self.op.name()),
            });
        }
        Ok(len)
    }
}

impl Links for TcpLinks {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }

    fn send(&mut self, peer: usize, payload: &[u8]) -> Result<(), CommError> {
        let (seq, op) = (self.seq, self.op);
        let counters = self.counters.clone();
        let p = self.peer(peer)?;
        if let Some(e) = p.error.lock().map(|e| e.clone()).unwrap_or_default() {
            return Err(self.link_error(peer, format!("sending failed: {e}")));
        }
        // Reuse a buffer the writer has finished with, if one is big enough.
        let need = HEADER + payload.len();
        let mut msg = std::iter::from_fn(|| p.spent.try_recv().ok())
            .find(|b: &Vec<u8>| b.capacity() >= need)
            .unwrap_or_else(|| Vec::with_capacity(need));
        msg.clear();
        msg.extend_from_slice(&seq.to_le_bytes());
        msg.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        msg.extend_from_slice(payload);
        counters.add(op, payload.len() as u64, p.same_node);
        if p.queue.send(msg).is_err() {
            return Err(self.link_error(peer, "the sender thread has stopped".into()));
        }
        Ok(())
    }

    fn recv_into(&mut self, peer: usize, out: &mut [u8]) -> Result<(), CommError> {
        let len = self.read_header(peer)?;
        if len != out.len() {
            return Err(CommError::Mismatch {
                op: self.op.name(),
                group: self.group.clone(),
                peer,
                got: format!("{len} bytes"),
                expected: format!("{} bytes", out.len()),
            });
        }
        self.read_exact(peer, out)
    }

    fn recv(&mut self, peer: usize) -> Result<Vec<u8>, CommError> {
        let len = self.read_header(peer)?;
        let mut out = vec![0u8; len];
        self.read_exact(peer, &mut out)?;
        Ok(out)
    }
}
