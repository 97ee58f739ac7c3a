//! The MPI transport (cargo feature `mpi`): collectives over the fabric a
//! cluster's MPI already drives (InfiniBand, Omni-Path, Slingshot, or shared
//! memory and TCP where that is all there is), for jobs started by `mpirun`.
//!
//! Which operation runs how:
//! - all-reduce, reduce-scatter and the quantized reduce-scatter run zrun's own
//!   ring and two-hop algorithms over MPI point-to-point messages (`MPI_Isend`,
//!   `MPI_Improbe` / `MPI_Imrecv`). MPI's reductions add in an order the standard
//!   leaves open; zrun's add in an order fixed by chunk ownership, which keeps
//!   ZeRO stages 0-3 bit-identical to each other (and to the TCP transport).
//! - all-gather, broadcast and barrier use MPI's own nonblocking collectives
//!   (`MPI_Iallgatherv`, `MPI_Ibcast`, `MPI_Ibarrier`): they only move bytes,
//!   so MPI's tuned algorithms change the speed and nothing else.
//! - all-to-all runs zrun's pairwise exchange over point-to-point: Open MPI's
//!   `MPI_Ialltoallv` moved 64 MiB between 2 ranks at a quarter of its speed
//!   here (0.24 against 0.94 GB/s bus bandwidth).
//! - Every collective first exchanges (sequence number, operation, length) with
//!   `MPI_Iallgather`, so ranks that call different collectives, or the same one
//!   with different lengths, get [`CommError::Mismatch`] naming the rank and
//!   what it called, where MPI itself would hang or mix up buffers.
//!
//! As on TCP, one operation thread per communicator runs the collectives in
//! issue order (so compute overlaps communication) and every wait polls against
//! the operation's deadline (`wire.rs`). Several communicators (the world, hpZ's
//! groups) call MPI from their own threads, so MPI must grant
//! `MPI_THREAD_MULTIPLE`; [`Runtime::init`] refuses to go on otherwise. A
//! collective that times out cannot be cancelled in MPI: its buffers are left
//! to it, the communicator fails every later call, and the job ends.

mod wire;

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::environment::{Threading, Universe};
use mpi::ffi;

use crate::links::{Links, OpClock};
use crate::opthread::OpThread;
use crate::quantized::Coding;
use crate::{
    chunk_range, pairwise, quantized, ring, CommError, Communicator, CounterSnapshot, Counters,
    Half, InFlight, Op, Quantization, SetupError, SharedFeedback, Work,
};
use wire::{bytes_type, count, error_text, test_until, Comm, Finish, MpiLinks, PIECE};

/// True when this process was started by an MPI launcher (`mpirun`, `srun
/// --mpi=pmix`): the variables Open MPI, PMIx and MPICH's Hydra set.
pub fn launched_under_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"]
        .iter()
        .any(|k| std::env::var_os(k).is_some())
}

/// Set when any collective of this process has failed: its requests may still
/// be pending, and `MPI_Finalize` would wait for them.
static FAILED: AtomicBool = AtomicBool::new(false);

/// MPI, initialised for the life of the process: `MPI_Finalize` runs when it
/// drops, which must be on the thread that made it and after every
/// [`MpiCommunicator`] has dropped. After a failed collective it does not run
/// (it could wait forever for a peer that is gone): the process exits without
/// it, and `mpirun` reports that exit.
pub struct Runtime {
    universe: Option<Universe>,
    rank: usize,
    size: usize,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if FAILED.load(Ordering::SeqCst) {
            std::mem::forget(self.universe.take());
        }
    }
}

impl Runtime {
    /// `MPI_Init_thread` asking for `MPI_THREAD_MULTIPLE`.
    pub fn init() -> Result<Runtime, CommError> {
        let fail = |m: String| CommError::Setup {
            group: "world".into(),
            cause: SetupError::Mpi(m),
        };
        let (universe, level) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| fail("MPI is already initialised in this process".into()))?;
        if level != Threading::Multiple {
            return Err(fail(format!(
                "the MPI library grants {level:?} threading; zrun needs MPI_THREAD_MULTIPLE \
                 (Open MPI 4 and MPICH provide it)"
            )));
        }
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: MPI is initialised; the world communicator's errors return
        // codes instead of aborting.
        unsafe {
            ffi::MPI_Comm_set_errhandler(ffi::RSMPI_COMM_WORLD, ffi::RSMPI_ERRORS_RETURN);
            ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank);
            ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size);
        }
        Ok(Runtime {
            universe: Some(universe),
            rank: rank as usize,
            size: size as usize,
        })
    }

    /// This process's rank in `MPI_COMM_WORLD`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Processes in `MPI_COMM_WORLD`.
    pub fn size(&self) -> usize {
        self.size
    }
}

/// How to build an [`MpiCommunicator`].
#[derive(Debug, Clone)]
pub struct MpiOptions {
    /// Deadline of setup and of every collective.
    pub timeout: Duration,
    /// Node index of every rank of the group (intra/inter-node accounting).
    pub node_of_rank: Vec<usize>,
    /// Group name for messages.
    pub group: String,
}

/// A [`Communicator`] over MPI.
pub struct MpiCommunicator {
    rank: usize,
    world: usize,
    node_of_rank: Vec<usize>,
    counters: Arc<Counters>,
    /// Dropping it lets queued collectives finish (each has waited for its
    /// sends), then frees the MPI communicator.
    ops: OpThread<MpiLinks>,
}

impl MpiCommunicator {
    /// Every rank of `MPI_COMM_WORLD`, on a duplicate of it (`MPI_Comm_idup`,
    /// bounded by the timeout). Collective: every rank calls it.
    pub fn world(_rt: &Runtime, opts: MpiOptions) -> Result<MpiCommunicator, CommError> {
        let deadline = Instant::now() + opts.timeout;
        // SAFETY: null handles for MPI to fill in.
        let (mut comm, mut req) = unsafe { (ffi::RSMPI_COMM_NULL, ffi::RSMPI_REQUEST_NULL) };
        // SAFETY: MPI is initialised (`_rt`); `comm` lives until the request ends.
        let code = unsafe { ffi::MPI_Comm_idup(ffi::RSMPI_COMM_WORLD, &mut comm, &mut req) };
        setup_wait(&opts.group, "MPI_Comm_idup", code, &mut req, deadline)?;
        Self::start(Comm(comm), opts)
    }

    /// The ranks of `MPI_COMM_WORLD` that pass the same `color`, ordered by
    /// world rank (`MPI_Comm_split`). Collective over the whole world: every
    /// rank calls it. An `MPI_Ibarrier` bounded by the timeout goes first, so a
    /// rank that never comes is a timeout here rather than a hang inside the split.
    pub fn split(
        rt: &Runtime,
        color: usize,
        opts: MpiOptions,
    ) -> Result<MpiCommunicator, CommError> {
        let deadline = Instant::now() + opts.timeout;
        // SAFETY: a null handle for MPI to fill in.
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: MPI is initialised.
        let code = unsafe { ffi::MPI_Ibarrier(ffi::RSMPI_COMM_WORLD, &mut req) };
        setup_wait(&opts.group, "MPI_Ibarrier", code, &mut req, deadline)?;
        // SAFETY: a null handle for MPI to fill in.
        let mut comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: every rank has arrived (the barrier), so the split completes.
        let code = unsafe {
            ffi::MPI_Comm_split(
                ffi::RSMPI_COMM_WORLD,
                color as c_int,
                rt.rank() as c_int,
                &mut comm,
            )
        };
        if code != ffi::MPI_SUCCESS as c_int {
            return Err(setup_error(&opts.group, "MPI_Comm_split", code));
        }
        Self::start(Comm(comm), opts)
    }

    fn start(comm: Comm, opts: MpiOptions) -> Result<MpiCommunicator, CommError> {
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: `comm` is a valid communicator just made.
        unsafe {
            ffi::MPI_Comm_set_errhandler(comm.0, ffi::RSMPI_ERRORS_RETURN);
            ffi::MPI_Comm_rank(comm.0, &mut rank);
            ffi::MPI_Comm_size(comm.0, &mut size);
        }
        let (rank, world) = (rank as usize, size as usize);
        if opts.node_of_rank.len() != world {
            return Err(CommError::Setup {
                group: opts.group,
                cause: SetupError::BadTopology {
                    rank,
                    world,
                    node_entries: opts.node_of_rank.len(),
                },
            });
        }
        let counters = Arc::new(Counters::default());
        let current = Arc::new(Mutex::new(None));
        let links = MpiLinks {
            comm,
            rank,
            world,
            group: opts.group.clone(),
            same_node: (0..world)
                .map(|p| opts.node_of_rank[p] == opts.node_of_rank[rank])
                .collect(),
            counters: counters.clone(),
            clock: OpClock::new(opts.timeout, current.clone()),
            sends: Vec::new(),
            spare: Vec::new(),
        };
        let free = |l: &mut MpiLinks| {
            if l.clock.poisoned.is_none() {
                let mut c = l.comm.0;
                // SAFETY: no request of this communicator is pending.
                unsafe { ffi::MPI_Comm_free(&mut c) };
            }
        };
        let ops = OpThread::spawn(
            "zcomm-mpi",
            links,
            free,
            opts.group.clone(),
            opts.timeout,
            current,
            counters.clone(),
        )
        .map_err(|e| CommError::Setup {
            group: opts.group.clone(),
            cause: SetupError::Thread(Arc::new(e)),
        })?;
        Ok(MpiCommunicator {
            rank,
            world,
            node_of_rank: opts.node_of_rank,
            counters,
            ops,
        })
    }

    /// Queues `f` as operation `op`; `what` is the length (or root) every rank
    /// must agree on.
    fn submit<T: Send + 'static>(
        &self,
        op: Op,
        bytes: usize,
        what: u64,
        f: impl FnOnce(&mut MpiLinks) -> Result<T, CommError> + Send + 'static,
    ) -> Work<T> {
        self.ops.submit(op, move |l| {
            let r = l.run(op, bytes, |l| {
                agree(l, what)?;
                f(l)
            });
            if r.is_err() {
                FAILED.store(true, Ordering::SeqCst);
            }
            r
        })
    }
}

fn setup_error(group: &str, call: &str, code: c_int) -> CommError {
    CommError::Setup {
        group: group.into(),
        cause: SetupError::Mpi(format!("{call}: {}", error_text(code))),
    }
}

/// Waits for a setup request until `deadline`.
fn setup_wait(
    group: &str,
    call: &str,
    code: c_int,
    req: &mut ffi::MPI_Request,
    deadline: Instant,
) -> Result<(), CommError> {
    if code != ffi::MPI_SUCCESS as c_int {
        return Err(setup_error(group, call, code));
    }
    match test_until(req, deadline) {
        Ok(Finish::Done(_)) => Ok(()),
        Ok(Finish::Expired) => Err(CommError::Setup {
            group: group.into(),
            cause: SetupError::Mpi(format!(
                "{call}: not every rank arrived before the deadline"
            )),
        }),
        Err(code) => Err(setup_error(group, call, code)),
    }
}

/// Starts a nonblocking collective and waits for it. `bufs` holds every buffer
/// it reads or writes: handed back when it finishes, left to MPI (leaked) when
/// it does not, since MPI cannot cancel a collective.
fn collective<B>(
    l: &MpiLinks,
    call: &str,
    mut bufs: B,
    start: impl FnOnce(&mut B, *mut ffi::MPI_Request) -> c_int,
) -> Result<B, CommError> {
    // SAFETY: a null handle for MPI to fill in.
    let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
    l.check(None, call, start(&mut bufs, &mut req))?;
    match l.poll(&mut req, None) {
        Ok(Finish::Done(_)) => Ok(bufs),
        Ok(Finish::Expired) => {
            std::mem::forget(bufs);
            Err(l.timed_out(None))
        }
        Err(e) => {
            std::mem::forget(bufs);
            Err(e)
        }
    }
}

/// Every rank's (sequence number, operation, `what`) must equal this rank's.
fn agree(l: &mut MpiLinks, what: u64) -> Result<(), CommError> {
    let mine = vec![l.clock.seq, l.clock.op.index() as u64, what];
    let all = vec![0u64; 3 * l.world];
    let comm = l.comm.0;
    let (_, all) = collective(l, "MPI_Iallgather", (mine, all), |(m, a), req| {
        // SAFETY: both buffers live in `bufs` until the request ends.
        unsafe {
            ffi::MPI_Iallgather(
                m.as_ptr().cast(),
                24,
                bytes_type(),
                a.as_mut_ptr().cast(),
                24,
                bytes_type(),
                comm,
                req,
            )
        }
    })?;
    let describe = |s: &[u64]| {
        let name = Op::from_index(s[1] as usize).map_or("an unknown operation", Op::name);
        format!("{name} (collective #{}, length/root {})", s[0], s[2])
    };
    let me = [l.clock.seq, l.clock.op.index() as u64, what];
    match all.chunks(3).position(|s| s != me) {
        None => Ok(()),
        Some(peer) => Err(CommError::Mismatch {
            op: l.clock.op.name(),
            group: l.group.clone(),
            peer,
            got: describe(&all[peer * 3..peer * 3 + 3]),
            expected: describe(&me),
        }),
    }
}

/// Byte counts and displacements of a buffer split by [`chunk_range`].
fn chunk_counts(total_len: usize, world: usize) -> (Vec<c_int>, Vec<c_int>) {
    (0..world)
        .map(|i| {
            let r = chunk_range(total_len, world, i);
            (count(r.len() * 4), count(r.start * 4))
        })
        .unzip()
}

impl Communicator for MpiCommunicator {
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
    fn in_flight(&self) -> Option<InFlight> {
        self.ops.in_flight()
    }

    fn all_reduce_async(&self, mut buf: Vec<f32>) -> Work<Vec<f32>> {
        let (bytes, len) = (buf.len() * 4, buf.len() as u64);
        self.submit(Op::AllReduce, bytes, len, move |l| {
            ring::all_reduce(l, &mut buf)?;
            Ok(buf)
        })
    }

    fn reduce_scatter_async(&self, mut buf: Vec<f32>) -> Work<Vec<f32>> {
        let (bytes, len) = (buf.len() * 4, buf.len() as u64);
        self.submit(Op::ReduceScatter, bytes, len, move |l| {
            let own = chunk_range(buf.len(), l.world_size(), l.rank());
            ring::reduce_scatter(l, &mut buf)?;
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
        let (bytes, len, node_of) = (buf.len() * 4, buf.len() as u64, self.node_of_rank.clone());
        self.submit(Op::QuantizedReduceScatter, bytes, len, move |l| {
            let group = l.group.clone();
            quantized::quantized_reduce_scatter(l, &group, &node_of, buf, q, feedback.as_ref())
        })
    }

    fn half_reduce_scatter_async(&self, buf: Vec<f32>, half: Half) -> Work<Vec<f32>> {
        let (bytes, len, node_of) = (buf.len() * 4, buf.len() as u64, self.node_of_rank.clone());
        self.submit(Op::ReduceScatter, bytes, len, move |l| {
            let group = l.group.clone();
            let op = Op::ReduceScatter;
            quantized::reduce_scatter(l, (&group, op), &node_of, buf, Coding::Half(half), None)
        })
    }

    fn half_all_reduce_async(&self, buf: Vec<f32>, half: Half) -> Work<Vec<f32>> {
        let (bytes, len, node_of) = (buf.len() * 4, buf.len() as u64, self.node_of_rank.clone());
        self.submit(Op::AllReduce, bytes, len, move |l| {
            let group = l.group.clone();
            quantized::all_reduce_half(l, &group, &node_of, buf, half)
        })
    }

    fn all_gather_async(&self, chunk: Vec<f32>, total_len: usize) -> Work<Vec<f32>> {
        self.submit(Op::AllGather, total_len * 4, total_len as u64, move |l| {
            let (w, r) = (l.world_size(), l.rank());
            let own = chunk_range(total_len, w, r);
            if chunk.len() != own.len() {
                return Err(CommError::Usage {
                    op: "all_gather",
                    message: format!(
                        "rank {r} holds {} elements, chunk {r} of {total_len} has {}",
                        chunk.len(),
                        own.len()
                    ),
                });
            }
            let mut out = crate::zeroed_large(total_len);
            if total_len * 4 > PIECE {
                out[own].copy_from_slice(&chunk);
                ring::all_gather(l, &mut out)?;
                return Ok(out);
            }
            all_gather_v(l, chunk, out)
        })
    }

    fn all_gather16_async(&self, chunk: Vec<u16>, total_len: usize) -> Work<Vec<u16>> {
        // As words (MPI moves bytes alike), copied in and out.
        self.submit(
            Op::AllGather,
            total_len * 2,
            (total_len / 2) as u64,
            move |l| {
                let own = crate::chunk16(total_len, chunk.len(), l.world_size(), l.rank())?;
                let words = total_len / 2;
                let mut out = crate::zeroed_large(words);
                out[own.clone()].copy_from_slice(&crate::words_of_halves(&chunk));
                let out = if words * 4 > PIECE {
                    ring::all_gather(l, &mut out)?;
                    out
                } else {
                    all_gather_v(l, out[own].to_vec(), out)?
                };
                Ok(crate::halves_of_words(&out))
            },
        )
    }

    fn all_gather16_in_place_async(&self, buf: Vec<u16>) -> Work<Vec<u16>> {
        // As words (MPI moves bytes alike), copied in and out.
        let len = buf.len();
        self.submit(Op::AllGather, len * 2, (len / 2) as u64, move |l| {
            crate::even16(len)?;
            let mut words = crate::words_of_halves(&buf).into_owned();
            let words = if words.len() * 4 > PIECE {
                ring::all_gather(l, &mut words)?;
                words
            } else {
                let chunk = words[chunk_range(words.len(), l.world_size(), l.rank())].to_vec();
                all_gather_v(l, chunk, words)?
            };
            Ok(crate::halves_of_words(&words))
        })
    }

    fn all_gather_in_place_async(&self, mut buf: Vec<f32>) -> Work<Vec<f32>> {
        let len = buf.len();
        self.submit(Op::AllGather, len * 4, len as u64, move |l| {
            if len * 4 > PIECE {
                ring::all_gather(l, &mut buf)?;
                return Ok(buf);
            }
            let chunk = buf[chunk_range(len, l.world_size(), l.rank())].to_vec();
            all_gather_v(l, chunk, buf)
        })
    }

    fn all_to_all_async(&self, pieces: Vec<Vec<u8>>) -> Work<Vec<Vec<u8>>> {
        let bytes = pieces.iter().map(Vec::len).sum();
        self.submit(Op::AllToAll, bytes, 0, move |l| {
            let w = l.world_size();
            if pieces.len() != w {
                return Err(CommError::Usage {
                    op: "all_to_all",
                    message: format!("{} pieces for {w} ranks", pieces.len()),
                });
            }
            pairwise::all_to_all(l, pieces)
        })
    }

    fn broadcast_async(&self, buf: Vec<u8>, root: usize) -> Work<Vec<u8>> {
        let bytes = buf.len();
        self.submit(Op::Broadcast, bytes, root as u64, move |l| {
            let (w, r) = (l.world_size(), l.rank());
            if root >= w {
                return Err(CommError::Usage {
                    op: "broadcast",
                    message: format!("root {root} with {w} ranks"),
                });
            }
            let comm = l.comm.0;
            let ibcast = |b: &mut [u8], req| {
                // SAFETY: `b` lives in `bufs` until the request ends.
                unsafe {
                    ffi::MPI_Ibcast(
                        b.as_mut_ptr().cast(),
                        count(b.len()),
                        bytes_type(),
                        root as c_int,
                        comm,
                        req,
                    )
                }
            };
            let len = (buf.len() as u64).to_le_bytes().to_vec();
            let len = collective(l, "MPI_Ibcast", len, |b, req| ibcast(b, req))?;
            let n = u64::from_le_bytes(len[..8].try_into().expect("8 bytes")) as usize;
            let mut buf = if r == root { buf } else { vec![0u8; n] };
            if r == root {
                for p in (0..w).filter(|&p| p != root) {
                    l.counters.add(Op::Broadcast, n as u64, l.same_node[p]);
                }
            }
            let mut at = 0;
            while at < n {
                let end = (at + PIECE).min(n);
                let piece = std::mem::take(&mut buf);
                buf = collective(l, "MPI_Ibcast", piece, |b, req| {
                    ibcast(&mut b[at..end], req)
                })?;
                at = end;
            }
            Ok(buf)
        })
    }

    fn barrier_async(&self) -> Work<()> {
        self.submit(Op::Barrier, 0, 0, |l| {
            let comm = l.comm.0;
            // SAFETY: a barrier reads and writes no buffer.
            collective(l, "MPI_Ibarrier", (), |(), req| unsafe {
                ffi::MPI_Ibarrier(comm, req)
            })
        })
    }
}

/// `out` with chunk j of it from rank j (this rank's from `chunk`), by
/// MPI_Iallgatherv. Buffers up to [`PIECE`] bytes: MPI counts are ints.
fn all_gather_v(l: &mut MpiLinks, chunk: Vec<f32>, out: Vec<f32>) -> Result<Vec<f32>, CommError> {
    let (w, r, total_len) = (l.world_size(), l.rank(), out.len());
    if total_len == 0 {
        return Ok(out);
    }
    for p in (0..w).filter(|&p| p != r) {
        l.counters
            .add(Op::AllGather, chunk.len() as u64 * 4, l.same_node[p]);
    }
    let (counts, displs) = chunk_counts(total_len, w);
    let comm = l.comm.0;
    let (_, out, _, _) = collective(
        l,
        "MPI_Iallgatherv",
        (chunk, out, counts, displs),
        |(c, o, n, d), req| {
            // SAFETY: every buffer lives in `bufs` until the request ends;
            // counts and displacements fit `out` (chunk_range).
            unsafe {
                ffi::MPI_Iallgatherv(
                    c.as_ptr().cast(),
                    count(c.len() * 4),
                    bytes_type(),
                    o.as_mut_ptr().cast(),
                    n.as_ptr(),
                    d.as_ptr(),
                    bytes_type(),
                    comm,
                    req,
                )
            }
        },
    )?;
    Ok(out)
}
