//! The point-to-point layer of the TCP communicator: one reader and one
//! writer thread per peer, messages framed with a 16-byte header (sequence
//! number, operation, length), per-operation deadlines, byte accounting, and the record of
//! which peer the operation thread waits for (hang diagnosis).

use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use crate::direct::{Call, Direct};
use crate::links::{note_waiting_for, Links, OpClock};
use crate::{CommError, Counters, Op};

/// A message's header: the collective's sequence number, then one word of
/// the operation (top byte) and the payload length (the rest), so that ranks
/// running different collectives whose pieces happen to have the same length
/// get a mismatch instead of each other's bytes.
pub(super) const HEADER: usize = 16;
/// How long a failed operation lets its writers go on sending what it had
/// queued in place before it drops the rest (`Links::abandon_sends`).
const ABANDON_GRACE: Duration = Duration::from_secs(2);
const OP_SHIFT: u32 = 56;
const LEN_MASK: u64 = (1 << OP_SHIFT) - 1;

/// The receiving half of a link: a socket or a shared-memory ring.
pub(super) trait Wire: Read + Send {
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

/// A message on its way to a peer's writer thread.
pub(super) enum Outgoing {
    /// Header and payload, copied.
    Copied(Vec<u8>),
    /// A header, and a payload the writer reads where the operation thread
    /// keeps it (`Links::send_in_place`): no copy on the operation thread.
    InPlace {
        header: [u8; HEADER],
        payload: InPlace,
    },
}

/// Bytes that the operation thread keeps valid and unchanged until the
/// writer has counted the message as written (`Links::send_in_place`'s
/// contract), or until `abandon_sends` has returned.
pub(super) struct InPlace {
    ptr: *const u8,
    len: usize,
}

// SAFETY: only the writer thread reads through the pointer, within the
// window in which the operation thread promises the bytes stay put (above).
unsafe impl Send for InPlace {}

/// The writer thread's side of a peer, shared with the operation thread.
#[derive(Default)]
pub(super) struct WriterState {
    /// The first error a write met (the writer stops there).
    pub(super) error: Mutex<Option<String>>,
    /// Messages written so far, in queue order: message `t` (counting from
    /// 1) is done with its payload once `written >= t`.
    pub(super) written: AtomicU64,
    /// Set after a failed operation: in-place messages still queued are
    /// dropped unread (their bytes may be gone).
    pub(super) dropping: AtomicBool,
}

pub(super) struct Peer {
    pub(super) reader: Box<dyn Wire>,
    /// Buffers the writer thread has sent, for reuse.
    pub(super) spent: mpsc::Receiver<Vec<u8>>,
    pub(super) queue: mpsc::Sender<Outgoing>,
    /// Messages queued so far (the ticket of the last one).
    pub(super) queued: u64,
    pub(super) writer: Option<std::thread::JoinHandle<()>>,
    pub(super) state: Arc<WriterState>,
    pub(super) same_node: bool,
}

impl Peer {
    fn writer_error(&self) -> Option<String> {
        self.state
            .error
            .lock()
            .map(|e| e.clone())
            .unwrap_or_default()
    }

    fn writer_gone(&self) -> bool {
        self.writer.as_ref().is_none_or(|w| w.is_finished())
    }
}

/// Drains a peer's queue onto its link, handing each copied buffer back for
/// reuse (a fresh multi-megabyte buffer per message costs a page fault per
/// 4 KiB) and counting every message written.
pub(super) fn writer_loop(
    mut s: Box<dyn Write + Send>,
    rx: mpsc::Receiver<Outgoing>,
    spent: mpsc::Sender<Vec<u8>>,
    state: Arc<WriterState>,
) {
    for msg in rx {
        let written = match &msg {
            Outgoing::Copied(bytes) => s.write_all(bytes),
            Outgoing::InPlace { .. } if state.dropping.load(Ordering::Acquire) => Ok(()),
            Outgoing::InPlace { header, payload } => {
                // SAFETY: the operation thread keeps these bytes valid and
                // unchanged until `written` counts this message (InPlace).
                let payload = unsafe { std::slice::from_raw_parts(payload.ptr, payload.len) };
                write_both(s.as_mut(), header, payload)
            }
        };
        if let Err(e) = written {
            *state.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
            return;
        }
        state.written.fetch_add(1, Ordering::Release);
        if let Outgoing::Copied(bytes) = msg {
            let _ = spent.send(bytes);
        }
    }
    let _ = s.flush();
}

/// Writes `a` then `b`, gathered into as few writes as the link takes (one
/// header of 16 bytes in a segment of its own would cost a packet).
fn write_both(s: &mut dyn Write, mut a: &[u8], mut b: &[u8]) -> std::io::Result<()> {
    while !a.is_empty() {
        match s.write_vectored(&[IoSlice::new(a), IoSlice::new(b)]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) if n < a.len() => a = &a[n..],
            Ok(n) => {
                b = &b[n - a.len()..];
                a = &[];
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    s.write_all(b)
}

pub(crate) struct TcpLinks {
    pub(super) rank: usize,
    pub(super) world: usize,
    /// The shared-memory path, when every rank of the group is on this node.
    pub(super) direct: Option<Direct>,
    pub(super) group: String,
    pub(super) peers: Vec<Option<Peer>>,
    pub(super) counters: Arc<Counters>,
    pub(super) clock: OpClock,
}

impl TcpLinks {
    /// Closes every send queue and waits for the writers to drain them (not after
    /// a failure: then nobody is waiting for those bytes, and the caller is
    /// waiting to report the error).
    pub(super) fn flush(&mut self) {
        for p in self.peers.iter_mut().flatten() {
            drop(std::mem::replace(&mut p.queue, mpsc::channel().0));
        }
        if self.clock.poisoned.is_some() {
            return;
        }
        for p in self.peers.iter_mut().flatten() {
            if let Some(w) = p.writer.take() {
                let _ = w.join();
            }
        }
    }

    pub(super) fn run<T>(
        &mut self,
        op: Op,
        bytes: usize,
        f: impl FnOnce(&mut TcpLinks) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        self.clock.begin(op, bytes)?;
        let r = f(self);
        self.clock.end(&r);
        if r.is_ok() {
            self.counters.ran(op, bytes, self.clock.started.elapsed());
        }
        r
    }

    /// Runs `f` on the direct shared-memory path if the group has one (`None`
    /// otherwise) and counts the bytes it reports as sent within the node.
    pub(super) fn direct(
        &mut self,
        f: impl FnOnce(&mut Direct, &Call) -> Result<u64, CommError>,
    ) -> Option<Result<(), CommError>> {
        let mut d = self.direct.take()?;
        let current = self.clock.current.clone();
        let waiting = move |peer: usize| note_waiting_for(&current, peer);
        let call = Call {
            op: self.clock.op,
            seq: self.clock.seq,
            group: &self.group,
            started: self.clock.started,
            deadline: self.clock.deadline,
            waiting_for: &waiting,
        };
        let r = f(&mut d, &call);
        self.direct = Some(d);
        Some(r.map(|bytes| self.counters.add(self.clock.op, bytes, true)))
    }

    fn peer(&mut self, peer: usize) -> Result<&mut Peer, CommError> {
        let (op, group) = (self.clock.op.name(), self.group.clone());
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
            op: self.clock.op.name(),
            group: self.group.clone(),
            peer,
            message,
        }
    }

    fn read_exact(&mut self, peer: usize, out: &mut [u8]) -> Result<(), CommError> {
        self.clock.waiting_for(peer);
        let deadline = self.clock.deadline;
        let mut off = 0;
        while off < out.len() {
            let now = Instant::now();
            if now >= deadline {
                if let Some(e) = self.peer(peer)?.writer_error() {
                    return Err(self.link_error(peer, format!("sending failed: {e}")));
                }
                return Err(CommError::Timeout {
                    op: self.clock.op.name(),
                    group: self.group.clone(),
                    peer: Some(peer),
                    waited_s: (now - self.clock.started).as_secs_f64(),
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

    /// The header of this operation's next message of `len` bytes.
    fn header(&self, len: usize) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[..8].copy_from_slice(&self.clock.seq.to_le_bytes());
        let word = (self.clock.op.index() as u64) << OP_SHIFT | len as u64;
        h[8..].copy_from_slice(&word.to_le_bytes());
        h
    }

    /// Hands `msg` (a payload of `len` bytes) to `peer`'s writer; its ticket.
    fn enqueue(&mut self, peer: usize, msg: Outgoing, len: usize) -> Result<u64, CommError> {
        let (op, counters) = (self.clock.op, self.counters.clone());
        let p = self.peer(peer)?;
        if let Some(e) = p.writer_error() {
            return Err(self.link_error(peer, format!("sending failed: {e}")));
        }
        counters.add(op, len as u64, p.same_node);
        if p.queue.send(msg).is_err() {
            return Err(self.link_error(peer, "the sender thread has stopped".into()));
        }
        p.queued += 1;
        Ok(p.queued)
    }

    fn read_header(&mut self, peer: usize) -> Result<usize, CommError> {
        let mut h = [0u8; HEADER];
        self.read_exact(peer, &mut h)?;
        let seq = u64::from_le_bytes(h[..8].try_into().expect("8 bytes"));
        let word = u64::from_le_bytes(h[8..].try_into().expect("8 bytes"));
        let (op, len) = ((word >> OP_SHIFT) as usize, (word & LEN_MASK) as usize);
        if op != self.clock.op.index() {
            let sent = Op::from_index(op).map_or("an unknown operation", Op::name);
            return Err(CommError::Mismatch {
                op: self.clock.op.name(),
                group: self.group.clone(),
                peer,
                got: format!("part of {sent} (collective #{seq})"),
                expected: format!(
                    "part of {} (collective #{})",
                    self.clock.op.name(),
                    self.clock.seq
                ),
            });
        }
        if seq != self.clock.seq {
            return Err(CommError::Mismatch {
                op: self.clock.op.name(),
                group: self.group.clone(),
                peer,
                got: format!("a message of collective #{seq}"),
                expected: format!("collective #{} ({})", self.clock.seq, self.clock.op.name()),
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
        let header = self.header(payload.len());
        let p = self.peer(peer)?;
        // Reuse a buffer the writer has finished with, if one is big enough.
        let need = HEADER + payload.len();
        let mut msg = std::iter::from_fn(|| p.spent.try_recv().ok())
            .find(|b: &Vec<u8>| b.capacity() >= need)
            .unwrap_or_else(|| Vec::with_capacity(need));
        msg.clear();
        msg.extend_from_slice(&header);
        msg.extend_from_slice(payload);
        self.enqueue(peer, Outgoing::Copied(msg), payload.len())
            .map(drop)
    }

    unsafe fn send_in_place(
        &mut self,
        peer: usize,
        ptr: *const u8,
        len: usize,
    ) -> Result<u64, CommError> {
        let header = self.header(len);
        let payload = InPlace { ptr, len };
        self.enqueue(peer, Outgoing::InPlace { header, payload }, len)
    }

    fn wait_sent(&mut self, peer: usize, ticket: u64) -> Result<(), CommError> {
        let mut round = 0u32;
        loop {
            let p = self.peer(peer)?;
            if p.state.written.load(Ordering::Acquire) >= ticket {
                return Ok(());
            }
            if let Some(e) = p.writer_error() {
                return Err(self.link_error(peer, format!("sending failed: {e}")));
            }
            if p.writer_gone() {
                return Err(self.link_error(peer, "the sender thread has stopped".into()));
            }
            let now = Instant::now();
            if now >= self.clock.deadline {
                return Err(CommError::Timeout {
                    op: self.clock.op.name(),
                    group: self.group.clone(),
                    peer: Some(peer),
                    waited_s: (now - self.clock.started).as_secs_f64(),
                });
            }
            // Mostly done at once (a ring waits for bytes its peer has
            // already answered): spin briefly, then sleep in short steps.
            round += 1;
            if round < 256 {
                std::hint::spin_loop();
            } else {
                self.clock.waiting_for(peer);
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    fn abandon_sends(&mut self) {
        // First let the writers send what is queued, as they would a copied
        // message: a peer waiting for those bytes (say, to find that the
        // ranks disagree about the collective) then fails on them, not at
        // its deadline. A peer that is gone fails the writes at once.
        let grace = Instant::now() + ABANDON_GRACE.min(self.clock.timeout);
        let pending = |p: &Peer| p.state.written.load(Ordering::Acquire) < p.queued;
        for p in self.peers.iter().flatten() {
            while pending(p) && !p.writer_gone() && Instant::now() < grace {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // Then drop the rest unread; the write under way ends within the
        // writers' write timeout.
        for p in self.peers.iter().flatten() {
            p.state.dropping.store(true, Ordering::Release);
        }
        for p in self.peers.iter().flatten() {
            while pending(p) && !p.writer_gone() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn recv_into(&mut self, peer: usize, out: &mut [u8]) -> Result<(), CommError> {
        let len = self.read_header(peer)?;
        if len != out.len() {
            return Err(CommError::Mismatch {
                op: self.clock.op.name(),
                group: self.group.clone(),
                peer,
                got: format!("{len} bytes"),
                expected: format!("{} bytes", out.len()),
            });
        }
        self.read_exact(peer, out)
    }

    fn recv(&mut self, peer: usize) -> Result<Vec<u8>, CommError> {
        self.recv_reusing(peer, Vec::new())
    }

    fn recv_reusing(&mut self, peer: usize, mut buf: Vec<u8>) -> Result<Vec<u8>, CommError> {
        let len = self.read_header(peer)?;
        // A buffer that holds the message is cut to it, not filled first.
        if buf.len() >= len {
            buf.truncate(len);
        } else {
            buf = vec![0u8; len];
        }
        self.read_exact(peer, &mut buf)?;
        Ok(buf)
    }
}
