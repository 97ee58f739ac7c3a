//! zcomm: collective communication for zrun.
//!
//! Layout:
//! - this file: the [`Communicator`] trait (torch.distributed's names), [`Work`]
//!   handles, byte [`Counters`], and [`chunk_range`], the one rule for
//!   splitting a buffer over ranks that every algorithm and the engine share.
//! - `error`: [`CommError`] and [`SetupError`].
//! - `opthread`: the thread each communicator runs its collectives on, in
//!   issue order.
//! - `links`: the point-to-point layer the algorithms run on (framed messages with
//!   a sequence number, per-op deadlines, byte accounting).
//! - `ring`, `pairwise`, `star`: one file per algorithm family; `quantized`:
//!   the two-hop reduce-scatter whose data crosses the links narrowed (ZeRO++
//!   qgZ's quantization, or 16-bit floats); `loco`: LoCo's error feedback
//!   for the quantized one.
//! - `tcp`: the communicator: one authenticated TCP connection per peer, and
//!   `shm` rings instead of sockets between ranks of one node when asked.
//! - `mpi` (cargo feature `mpi`): the communicator for jobs started by
//!   `mpirun`, on the cluster's own MPI.
//!
//! The design decision to know: every collective runs on the communicator's own
//! thread, in the order it was issued. Callers hand over owned buffers and get a
//! [`Work`] handle back, so compute continues while bytes move (overlap), and
//! because every rank issues the same collectives in the same order, FIFO
//! execution is all the matching there is. Reductions add in an order that depends
//! only on which rank owns a chunk, so every rank gets bit-identical results and an
//! all-reduce equals a reduce-scatter followed by an all-gather, bit for bit.

#![deny(missing_docs)]

mod direct;
mod error;
mod links;
mod loco;
#[cfg(feature = "mpi")]
pub mod mpi;
mod opthread;
mod pairwise;
mod quantized;
mod ring;
mod shm;
mod star;
mod tcp;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

pub use error::{CommError, SetupError};
pub use loco::ErrorFeedback;
pub use quantized::Quantization;
pub use tcp::{TcpCommunicator, TcpOptions};
pub use zproto::Op;
pub use zquant::Half;

/// One bucket's LoCo errors ([`ErrorFeedback`]), shared by the engine,
/// which resets, rescales and checkpoints them between steps, and the
/// communicator's thread, which holds the lock while it reduces the bucket.
pub type SharedFeedback = Arc<Mutex<ErrorFeedback>>;

/// A pending collective. `wait` returns its result, or an error at the deadline.
pub struct Work<T> {
    rx: mpsc::Receiver<Result<T, CommError>>,
    op: Op,
    group: String,
    deadline: Instant,
    /// Where the time `wait` blocks is added up.
    counters: Arc<Counters>,
}

impl<T> Work<T> {
    pub(crate) fn new(
        rx: mpsc::Receiver<Result<T, CommError>>,
        op: Op,
        group: String,
        deadline: Instant,
        counters: Arc<Counters>,
    ) -> Self {
        Work {
            rx,
            op,
            group,
            deadline,
            counters,
        }
    }

    /// The result if the collective has finished, else the handle back.
    pub fn try_wait(self) -> Result<Result<T, CommError>, Work<T>> {
        match self.rx.try_recv() {
            Ok(r) => Ok(r),
            Err(mpsc::TryRecvError::Empty) => Err(self),
            Err(mpsc::TryRecvError::Disconnected) => Ok(Err(CommError::Closed {
                op: self.op.name(),
                group: self.group,
            })),
        }
    }

    /// Blocks until the collective finishes or its deadline passes; the
    /// time blocked counts in the communicator's [`CounterSnapshot::waited_ns`].
    pub fn wait(self) -> Result<T, CommError> {
        let started = Instant::now();
        let left = self.deadline.saturating_duration_since(started);
        let got = self.rx.recv_timeout(left);
        self.counters.waited(self.op, started.elapsed());
        match got {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(CommError::Timeout {
                op: self.op.name(),
                group: self.group,
                peer: None,
                waited_s: left.as_secs_f64(),
            }),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(CommError::Closed {
                op: self.op.name(),
                group: self.group,
            }),
        }
    }
}

/// Bytes sent by this rank: by operation, and to peers on this node or others;
/// and the time its callers blocked waiting for each operation.
/// And every collective run, tallied by kind and size for `comms_logger`.
#[derive(Debug, Default)]
pub struct Counters {
    by_op: [AtomicU64; Op::ALL.len()],
    intra_node: AtomicU64,
    inter_node: AtomicU64,
    waited_ns: [AtomicU64; Op::ALL.len()],
    /// Since the last [`Counters::take_log`]; a handful of kinds and sizes
    /// (a job's buckets and parameter groups), so a log nobody takes stays
    /// small.
    log: Mutex<Vec<OpTally>>,
}

/// The collectives of one kind and size that a communicator ran (its
/// `comms_logger` record), each timed on its thread from start to end:
/// the transfer, and the wait for the other ranks to arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OpTally {
    /// The collective, as the communicator counts it (a reduction in 16
    /// bits on the wire under its f32 name).
    pub op: Op,
    /// The caller's buffer: the all-reduce's, the reduce-scatter's input,
    /// the all-gather's output.
    pub bytes: u64,
    /// How many ran.
    pub count: u64,
    /// Their time added up.
    pub total: Duration,
    /// The shortest.
    pub min: Duration,
    /// The longest.
    pub max: Duration,
}

/// A snapshot of [`Counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// Indexed by [`Op`] as declared.
    pub by_op: [u64; Op::ALL.len()],
    /// To ranks on the same node.
    pub intra_node: u64,
    /// To ranks on other nodes.
    pub inter_node: u64,
    /// Nanoseconds callers spent blocked in [`Work::wait`] (every blocking
    /// collective is one), by [`Op`]: communication that compute did not
    /// hide, and time waiting for slower ranks to arrive.
    pub waited_ns: [u64; Op::ALL.len()],
}

impl CounterSnapshot {
    /// Bytes of one operation.
    pub fn op(&self, op: Op) -> u64 {
        self.by_op[op.index()]
    }

    /// Time blocked waiting for one operation.
    pub fn waited(&self, op: Op) -> Duration {
        Duration::from_nanos(self.waited_ns[op.index()])
    }

    /// Time blocked waiting for any operation.
    pub fn waited_total(&self) -> Duration {
        Duration::from_nanos(self.waited_ns.iter().sum())
    }

    /// `self` and `other` together (two groups' counters).
    pub fn plus(&self, other: &CounterSnapshot) -> CounterSnapshot {
        CounterSnapshot {
            by_op: std::array::from_fn(|i| self.by_op[i] + other.by_op[i]),
            intra_node: self.intra_node + other.intra_node,
            inter_node: self.inter_node + other.inter_node,
            waited_ns: std::array::from_fn(|i| self.waited_ns[i] + other.waited_ns[i]),
        }
    }

    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &CounterSnapshot) -> CounterSnapshot {
        CounterSnapshot {
            by_op: std::array::from_fn(|i| self.by_op[i] - earlier.by_op[i]),
            intra_node: self.intra_node - earlier.intra_node,
            inter_node: self.inter_node - earlier.inter_node,
            waited_ns: std::array::from_fn(|i| self.waited_ns[i] - earlier.waited_ns[i]),
        }
    }
}

impl Counters {
    pub(crate) fn add(&self, op: Op, bytes: u64, same_node: bool) {
        self.by_op[op.index()].fetch_add(bytes, Ordering::Relaxed);
        let side = if same_node {
            &self.intra_node
        } else {
            &self.inter_node
        };
        side.fetch_add(bytes, Ordering::Relaxed);
    }

    fn waited(&self, op: Op, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.waited_ns[op.index()].fetch_add(ns, Ordering::Relaxed);
    }

    /// Tallies a collective `op` of `bytes` that took `took`.
    pub(crate) fn ran(&self, op: Op, bytes: usize, took: Duration) {
        let Ok(mut log) = self.log.lock() else { return };
        let bytes = bytes as u64;
        match log.iter_mut().find(|t| t.op == op && t.bytes == bytes) {
            Some(t) => {
                t.count += 1;
                t.total += took;
                t.min = t.min.min(took);
                t.max = t.max.max(took);
            }
            None => log.push(OpTally {
                op,
                bytes,
                count: 1,
                total: took,
                min: took,
                max: took,
            }),
        }
    }

    /// The collectives run since the last call, by operation and size.
    pub fn take_log(&self) -> Vec<OpTally> {
        let mut log = self
            .log
            .lock()
            .map(|mut l| std::mem::take(&mut *l))
            .unwrap_or_default();
        log.sort_by_key(|t| (t.op.index(), t.bytes));
        log
    }

    /// Current totals.
    pub fn snapshot(&self) -> CounterSnapshot {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CounterSnapshot {
            by_op: std::array::from_fn(|i| load(&self.by_op[i])),
            intra_node: load(&self.intra_node),
            inter_node: load(&self.inter_node),
            waited_ns: std::array::from_fn(|i| load(&self.waited_ns[i])),
        }
    }
}

/// The collective a communicator is inside right now, for hang diagnosis.
#[derive(Debug, Clone, PartialEq)]
pub struct InFlight {
    /// Operation.
    pub op: &'static str,
    /// Group.
    pub group: String,
    /// Bytes of the caller's buffer.
    pub bytes: usize,
    /// Time since the operation started.
    pub waiting: Duration,
    /// The rank it is blocked reading from, if it is.
    pub peer: Option<usize>,
}

impl std::fmt::Display for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "in {} (group {}, {} bytes) for {:.1}s",
            self.op,
            self.group,
            self.bytes,
            self.waiting.as_secs_f64()
        )?;
        if let Some(p) = self.peer {
            write!(f, ", waiting for rank {p}")?;
        }
        Ok(())
    }
}

/// A zeroed buffer of `n` floats; from 4 MiB up its 2 MiB-aligned interior is
/// advised to transparent huge pages, so that first touching it takes one page
/// fault per 2 MiB instead of one per 4 KiB (16,000 for 64 MiB, which this VM
/// charges about 2 µs each). The zeros are the kernel's: a large zeroed
/// allocation is fresh pages, not written here (a memset of 256 MiB would cost
/// a fifth of what the all-gather that fills it takes over loopback).
pub(crate) fn zeroed_large(n: usize) -> Vec<f32> {
    const HUGE: usize = 2 << 20;
    let v = vec![0f32; n];
    if n * 4 >= 2 * HUGE {
        let p = v.as_ptr() as usize;
        let (start, end) = (p.next_multiple_of(HUGE), (p + n * 4) & !(HUGE - 1));
        if end > start {
            // SAFETY: advice on pages of our own allocation, none of which
            // has been touched yet.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    v
}

/// Checks a 16-bit all-gather's arguments ([`Communicator::all_gather16_async`])
/// and returns this rank's chunk of its words.
pub(crate) fn chunk16(
    total_len: usize,
    chunk_len: usize,
    world: usize,
    rank: usize,
) -> Result<std::ops::Range<usize>, CommError> {
    let own = chunk_range(total_len / 2, world, rank);
    if !total_len.is_multiple_of(2) || chunk_len != 2 * own.len() {
        return Err(CommError::Usage {
            op: "all_gather",
            message: format!(
                "rank {rank} holds {chunk_len} 16-bit elements; a gather of {total_len} \
                 (an even count) gives it chunk {rank} of {} words, {} elements",
                total_len / 2,
                2 * own.len()
            ),
        });
    }
    Ok(own)
}

/// Refuses an odd count of 16-bit elements: they travel two a word.
pub(crate) fn even16(len: usize) -> Result<(), CommError> {
    if len.is_multiple_of(2) {
        return Ok(());
    }
    Err(CommError::Usage {
        op: "all_gather",
        message: format!("{len} 16-bit elements: they travel two a word, so an even count"),
    })
}

/// `buf`'s 16-bit elements as collective words in place, where its memory
/// is laid out as words (a little-endian CPU) and aligned to them (every
/// allocation of the system allocator is); else `None`.
pub(crate) fn words_in_place(buf: &mut [u16]) -> Option<&mut [f32]> {
    if cfg!(target_endian = "little") {
        bytemuck::try_cast_slice_mut(buf).ok()
    } else {
        None
    }
}

/// 16-bit elements as collective words: two a word, the first in the low
/// half (on a little-endian CPU, the same memory, borrowed where the halves
/// start on a word). The one layout every 16-bit buffer travels in.
pub fn words_of_halves(halves: &[u16]) -> std::borrow::Cow<'_, [f32]> {
    #[cfg(target_endian = "little")]
    if let Ok(words) = bytemuck::try_cast_slice::<u16, f32>(halves) {
        return std::borrow::Cow::Borrowed(words);
    }
    std::borrow::Cow::Owned(
        halves
            .chunks_exact(2)
            .map(|p| f32::from_bits(u32::from(p[0]) | (u32::from(p[1]) << 16)))
            .collect(),
    )
}

/// The 16-bit elements of collective words ([`words_of_halves`] undone).
pub fn halves_of_words(words: &[f32]) -> Vec<u16> {
    // On a little-endian CPU, a copy of the memory.
    #[cfg(target_endian = "little")]
    return bytemuck::cast_slice(words).to_vec();
    #[cfg(not(target_endian = "little"))]
    words
        .iter()
        .flat_map(|w| {
            let b = w.to_bits();
            [b as u16, (b >> 16) as u16]
        })
        .collect()
}

/// The first `words` collective words of `out`'s spare capacity, where
/// `out`'s memory is laid out as words (a little-endian CPU) and aligned to
/// them (every allocation of the system allocator is); else `None`.
pub(crate) fn word_slots(
    out: &mut Vec<u16>,
    words: usize,
) -> Option<&mut [std::mem::MaybeUninit<f32>]> {
    let spare = &mut out.spare_capacity_mut()[..2 * words];
    let at = spare.as_mut_ptr();
    (cfg!(target_endian = "little") && at.align_offset(std::mem::align_of::<f32>()) == 0).then(
        // SAFETY: `2·words` elements of spare capacity are `words` f32s'
        // bytes, aligned for f32 (checked); MaybeUninit needs no values.
        || unsafe { std::slice::from_raw_parts_mut(at.cast(), words) },
    )
}

/// `dst += src`, element-wise: the reduction every algorithm uses (vectorised by
/// the compiler; `zrun bench kernels` measures it against memory bandwidth).
pub fn reduce_add(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += *s;
    }
}

/// The index range of chunk `i` when `len` elements are split over `parts` ranks:
/// the first `len % parts` chunks hold one element more.
pub fn chunk_range(len: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let base = len / parts;
    let extra = len % parts;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// Collectives over one process group, with torch.distributed's names.
///
/// `*_async` methods take ownership of their buffers and return at once; the
/// others wait. Buffers of any length work on any world size (chunks follow
/// [`chunk_range`]). The trait is object safe: the engine holds `Arc<dyn Communicator>`.
pub trait Communicator: Send + Sync {
    /// This rank within the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// The group's name, for messages.
    fn group_name(&self) -> &str;
    /// Bytes sent so far.
    fn counters(&self) -> CounterSnapshot;
    /// The deadline of one collective.
    fn timeout(&self) -> Duration;
    /// The collective running now, if any.
    fn in_flight(&self) -> Option<InFlight>;
    /// The collectives run since the last call, tallied by operation and
    /// size ([`Counters::take_log`]).
    fn take_op_log(&self) -> Vec<OpTally>;

    /// Element-wise sum over ranks; every rank receives the whole sum.
    fn all_reduce_async(&self, buf: Vec<f32>) -> Work<Vec<f32>>;
    /// Element-wise sum over ranks; this rank receives chunk `rank` of the sum.
    fn reduce_scatter_async(&self, buf: Vec<f32>) -> Work<Vec<f32>>;
    /// [`Communicator::reduce_scatter_async`] with the data quantized on the
    /// wire (ZeRO++ qgZ): reduced inside each node first, then across nodes,
    /// each hop quantizing what it sends and adding in f32 (see `quantized.rs`).
    /// Buffers with chunks shorter than one quantization block run as a plain
    /// reduce-scatter (and count as one). With `feedback` (LoCo), each value
    /// sent carries the error kept for it from the last reduction, and what
    /// quantizing loses is kept for the next.
    fn quantized_reduce_scatter_async(
        &self,
        buf: Vec<f32>,
        q: Quantization,
        feedback: Option<SharedFeedback>,
    ) -> Work<Vec<f32>>;
    /// [`Communicator::reduce_scatter_async`] with each rank's data rounded
    /// to `half` on the wire (`train.reduce_dtype`), in qgZ's two hops and
    /// added in f32; the result is rounded to `half` too. Counts as a
    /// reduce-scatter.
    fn half_reduce_scatter_async(&self, buf: Vec<f32>, half: Half) -> Work<Vec<f32>>;
    /// [`Communicator::all_reduce_async`] in 16 bits on the wire:
    /// [`Communicator::half_reduce_scatter_async`], then each rank's rounded
    /// chunk gathered in 16 bits, so that every rank receives, bit for bit,
    /// what the reduce-scatter gives each chunk's owner.
    fn half_all_reduce_async(&self, buf: Vec<f32>, half: Half) -> Work<Vec<f32>>;
    /// Every rank contributes chunk `rank` of a `total_len` buffer; all receive the whole.
    fn all_gather_async(&self, chunk: Vec<f32>, total_len: usize) -> Work<Vec<f32>>;
    /// [`Communicator::all_gather_async`] into a buffer the caller already
    /// holds (torch's `all_gather_into_tensor`, NCCL's in-place mode): chunk
    /// `rank` of `buf` is this rank's contribution, the other chunks are
    /// overwritten with their owners'. No output is allocated, so a caller that
    /// reuses its buffers pays no page faults and no zeroing per call.
    fn all_gather_in_place_async(&self, buf: Vec<f32>) -> Work<Vec<f32>>;
    /// [`Communicator::all_gather_async`] of `total_len` 16-bit elements
    /// (bf16 or f16 bits; an even count), which travel as collective words,
    /// two a word with the first in the low half: this rank's chunk is chunk
    /// `rank` of the `total_len / 2` words. The result comes in the type
    /// that 16-bit values are kept in, where gathering words and copying
    /// them out cost stage 3's bf16 parameters a copy of every gather (1.8%
    /// of a worker's samples).
    fn all_gather16_async(&self, chunk: Vec<u16>, total_len: usize) -> Work<Vec<u16>>;
    /// [`Communicator::all_gather16_async`] into a buffer the caller already
    /// holds ([`Communicator::all_gather_in_place_async`]'s 16-bit form):
    /// this rank's chunk of `buf`'s words is its contribution.
    fn all_gather16_in_place_async(&self, buf: Vec<u16>) -> Work<Vec<u16>>;
    /// `pieces[j]` goes to rank j; the result's element i came from rank i.
    fn all_to_all_async(&self, pieces: Vec<Vec<u8>>) -> Work<Vec<Vec<u8>>>;
    /// `root`'s buffer everywhere (other ranks' input is ignored).
    fn broadcast_async(&self, buf: Vec<u8>, root: usize) -> Work<Vec<u8>>;
    /// Returns when every rank has called it.
    fn barrier_async(&self) -> Work<()>;

    /// Blocking [`Communicator::all_reduce_async`].
    fn all_reduce(&self, buf: Vec<f32>) -> Result<Vec<f32>, CommError> {
        self.all_reduce_async(buf).wait()
    }
    /// Blocking [`Communicator::reduce_scatter_async`].
    fn reduce_scatter(&self, buf: Vec<f32>) -> Result<Vec<f32>, CommError> {
        self.reduce_scatter_async(buf).wait()
    }
    /// Blocking [`Communicator::quantized_reduce_scatter_async`].
    fn quantized_reduce_scatter(
        &self,
        buf: Vec<f32>,
        q: Quantization,
        feedback: Option<SharedFeedback>,
    ) -> Result<Vec<f32>, CommError> {
        self.quantized_reduce_scatter_async(buf, q, feedback).wait()
    }
    /// Blocking [`Communicator::all_gather_async`].
    fn all_gather(&self, chunk: Vec<f32>, total_len: usize) -> Result<Vec<f32>, CommError> {
        self.all_gather_async(chunk, total_len).wait()
    }
    /// Blocking [`Communicator::all_gather16_async`].
    fn all_gather16(&self, chunk: Vec<u16>, total_len: usize) -> Result<Vec<u16>, CommError> {
        self.all_gather16_async(chunk, total_len).wait()
    }
    /// Blocking [`Communicator::all_gather16_in_place_async`].
    fn all_gather16_in_place(&self, buf: Vec<u16>) -> Result<Vec<u16>, CommError> {
        self.all_gather16_in_place_async(buf).wait()
    }
    /// Blocking [`Communicator::all_gather_in_place_async`].
    fn all_gather_in_place(&self, buf: Vec<f32>) -> Result<Vec<f32>, CommError> {
        self.all_gather_in_place_async(buf).wait()
    }
    /// Blocking [`Communicator::all_to_all_async`].
    fn all_to_all(&self, pieces: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, CommError> {
        self.all_to_all_async(pieces).wait()
    }
    /// Blocking [`Communicator::broadcast_async`].
    fn broadcast(&self, buf: Vec<u8>, root: usize) -> Result<Vec<u8>, CommError> {
        self.broadcast_async(buf, root).wait()
    }
    /// Blocking [`Communicator::barrier_async`].
    fn barrier(&self) -> Result<(), CommError> {
        self.barrier_async().wait()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_come_zeroed_at_their_length() {
        for n in [0, 5, (3 << 20) + 7] {
            let v = zeroed_large(n);
            assert_eq!(v.len(), n);
            assert!(v.iter().all(|&x| x == 0.0));
        }
    }

    #[test]
    fn chunks_cover_the_buffer_in_order() {
        for len in 0..40 {
            for parts in 1..7 {
                let mut next = 0;
                for i in 0..parts {
                    let r = chunk_range(len, parts, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == len / parts || r.len() == len / parts + 1);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn communicator_is_object_safe() {
        fn takes(_: Option<&dyn Communicator>) {}
        takes(None);
    }
}
