//! Reduce-scatter, all-reduce, all-gather and barrier straight through a node's
//! shared segment, used when every rank of the group is on this node.
//!
//! The rings of `shm.rs` carry the TCP transport's messages, so a ring step costs
//! three copies (into a message, into the ring, out of it) and a thread hand-off.
//! Here each rank copies its contribution into its own slot once and the others
//! read it in place, the way DeepSpeed's CPU shared-memory all-reduce works.
//! Buffers go through in steps of one slot (1 MiB, so a step's traffic stays in
//! cache); slots come in two sets used in alternate steps, so one barrier per
//! step (two for all-reduce) keeps writers from overwriting what a slower rank
//! still reads.
//!
//! A step of reduce-scatter: rank q writes, for every chunk j, the next part of
//! its chunk j into part j of its slot; barrier; rank r sums part r of every slot
//! in rank order (its own contribution read from its buffer). All-reduce then
//! publishes each rank's sum in its slot and, after a second barrier, every rank
//! copies the others' sums. All-gather: each rank writes the next part of its own
//! chunk; barrier; everyone copies. Every rank adds in rank order, so an element's
//! sum has the same bits whichever collective computed it.
//!
//! Before its first barrier a collective publishes (sequence number, op, length)
//! in one of four per-rank flag slots (a rank is never more than one collective
//! ahead, since every collective has a barrier), and after the barrier every rank
//! checks that all agree, the rings' mismatch check in this path.
//!
//! **Single copy.** Through the slots an all-gather copies every byte twice
//! (its owner into the slot, each reader out of it). Where the system lets
//! one process read another's memory (`process_vm_readv`: same user, and no
//! Yama or seccomp policy against it), an all-gather whose chunks span at
//! least a slot, and whose buffers fit in the cache together
//! ([`DIRECT_MAX_BYTES`]), instead reads every peer's chunk straight from
//! that peer's buffer into its own after the first barrier (`begin`
//! publishes each buffer's address with the sequence number): one copy, in
//! the kernel. A second barrier keeps every buffer in place until its
//! readers are done. An all-reduce that size leaves its sums in place and
//! gathers them the same way. Whether the system allows it is found out
//! once, by the first such gather, and all ranks agree on the outcome (any
//! refusal: everyone uses the slots from then on, and the refused rank says
//! why at `ZRUN_LOG=info`).
//!
//! An all-gather into uninitialised memory (`all_gather_into`: stage 3's
//! gathers, into a buffer the caller's thread allocated) does not zero it
//! first: the gather writes every element, its own chunk before `begin`
//! and every other one from its owner either way (a zeroed buffer of
//! reused memory was a `memset` as long as the gather's own copies, 0.9%
//! of a stage-3 worker's samples).

use std::io;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::shm::{backoff, Segment, SLOT_BYTES};
use crate::{chunk_range, CommError, Op};

/// Floats per slot.
const SLOT: usize = SLOT_BYTES / 4;
/// The most bytes, all ranks' buffers together, that an all-gather reads
/// from its peers directly. The kernel's copy stores through the cache, so
/// once the buffers no longer fit in it every line it writes is first read
/// from memory, where the slots' streaming stores are not: measured with 2
/// ranks, `zrun bench comm` all-gathers of 4-24 MiB ran 1.3-1.6x as fast
/// read directly, 32 MiB level, 48-256 MiB 0.9-1.0x.
const DIRECT_MAX_BYTES: usize = 48 << 20;
/// Elements summed at a time through a stack buffer.
const BLOCK: usize = 2048;

/// Who is asking, for errors and hang diagnosis.
pub(crate) struct Call<'a> {
    pub(crate) op: Op,
    pub(crate) seq: u64,
    pub(crate) group: &'a str,
    pub(crate) started: Instant,
    pub(crate) deadline: Instant,
    /// Told the rank being waited for once a wait is no longer short.
    pub(crate) waiting_for: &'a dyn Fn(usize),
}

/// Flag words of a rank's line: barrier generation, process id, the outcome
/// of its first single-copy read, then four groups of eight words from
/// [`SEQ_WORDS`] (sequence number, op, length, buffer address).
const GENERATION: usize = 0;
const PID: usize = 1;
const SINGLE_COPY_OUTCOME: usize = 2;
const SEQ_WORDS: usize = 8;

/// Whether an all-gather reads its peers' chunks straight from their memory
/// (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SingleCopy {
    /// Not tried yet: the next all-gather that would use it finds out.
    Untried,
    /// Every rank read every peer.
    Works,
    /// Turned off, or some rank was refused: the slots.
    Off,
}

/// This rank's end of the direct area.
pub(crate) struct Direct {
    seg: Arc<Segment>,
    me: usize,
    n: usize,
    /// Barriers passed (the same on every rank).
    generation: u64,
    /// Steps taken (the same on every rank): picks the slot set.
    steps: u64,
    single_copy: SingleCopy,
}

/// Where a reduction leaves each rank's chunk of the sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sums {
    /// At the front of its buffer (reduce-scatter).
    Front,
    /// In its own chunk, for a gather to follow.
    InPlace,
    /// Every chunk on every rank, step by step through the slots.
    Everywhere,
}

/// The chunks of a buffer of `len` elements among `n` ranks.
fn chunks(len: usize, n: usize) -> Vec<Range<usize>> {
    (0..n).map(|j| chunk_range(len, n, j)).collect()
}

/// `r`'s part at offset `o` of at most `cap` elements (empty past its end).
fn part(r: &Range<usize>, o: usize, cap: usize) -> Range<usize> {
    let s = (r.start + o).min(r.end);
    s..(s + cap).min(r.end)
}

impl Direct {
    /// Rank `me` (local index, equal to its rank in the group) of a segment that
    /// every rank of the group maps; `single_copy`: whether all-gathers may
    /// read peers' memory directly (module doc), which every rank of the
    /// group must set alike.
    pub(crate) fn new(seg: Arc<Segment>, me: usize, single_copy: bool) -> Direct {
        let n = seg.local();
        // Read by peers only after a barrier, which orders it.
        seg.flag(me, PID)
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        Direct {
            seg,
            me,
            n,
            generation: 0,
            steps: 0,
            single_copy: if single_copy && cfg!(target_os = "linux") {
                SingleCopy::Untried
            } else {
                SingleCopy::Off
            },
        }
    }

    fn slot(&self, set: usize, rank: usize, at: usize, len: usize) -> &[f32] {
        assert!(at + len <= SLOT);
        // SAFETY: inside the slot; between the barriers that delimit a step no
        // rank writes a slot another rank reads (module doc).
        unsafe { std::slice::from_raw_parts(self.seg.slot(set, rank).add(at), len) }
    }

    fn write_slot(&self, set: usize, at: usize, src: &[f32]) {
        assert!(at + src.len() <= SLOT);
        // SAFETY: inside this rank's own slot, which no other rank reads in this
        // phase of the step.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.seg.slot(set, self.me).add(at),
                src.len(),
            )
        }
    }

    fn next_set(&mut self) -> usize {
        self.steps += 1;
        (self.steps % 2) as usize
    }

    /// Waits until every rank has arrived here.
    fn barrier(&mut self, c: &Call) -> Result<(), CommError> {
        self.generation += 1;
        self.seg
            .flag(self.me, GENERATION)
            .store(self.generation, Ordering::Release);
        for j in (0..self.n).filter(|&j| j != self.me) {
            let flag = self.seg.flag(j, GENERATION);
            let mut round = 0;
            while flag.load(Ordering::Acquire) < self.generation {
                if round == 256 {
                    (c.waiting_for)(j);
                }
                let now = Instant::now();
                if now > c.deadline {
                    return Err(CommError::Timeout {
                        op: c.op.name(),
                        group: c.group.to_string(),
                        peer: Some(j),
                        waited_s: (now - c.started).as_secs_f64(),
                    });
                }
                backoff(&mut round);
            }
        }
        Ok(())
    }

    /// The first of collective `seq`'s flag words.
    fn seq_words(seq: u64) -> usize {
        SEQ_WORDS + 8 * (seq % 4) as usize
    }

    /// Publishes what this rank is about to run (and where its buffer is),
    /// waits for everyone, and checks that they all run the same.
    fn begin(&mut self, c: &Call, len: usize, buf: *const f32) -> Result<(), CommError> {
        let at = Direct::seq_words(c.seq);
        let mine = [c.seq, c.op.index() as u64, len as u64];
        for (w, v) in mine.iter().enumerate() {
            self.seg.flag(self.me, at + w).store(*v, Ordering::Relaxed);
        }
        self.seg
            .flag(self.me, at + 3)
            .store(buf as u64, Ordering::Relaxed);
        self.barrier(c)?;
        let describe = |v: [u64; 3]| {
            let name = Op::from_index(v[1] as usize).map_or("?", Op::name);
            format!("collective #{} ({name} of {} elements)", v[0], v[2])
        };
        for j in (0..self.n).filter(|&j| j != self.me) {
            let theirs: [u64; 3] =
                std::array::from_fn(|w| self.seg.flag(j, at + w).load(Ordering::Relaxed));
            if theirs != mine {
                return Err(CommError::Mismatch {
                    op: c.op.name(),
                    group: c.group.to_string(),
                    peer: j,
                    got: describe(theirs),
                    expected: describe(mine),
                });
            }
        }
        Ok(())
    }

    /// Sums every rank's `buf` chunk by chunk through the slots (after
    /// `begin`): each rank's chunk of the sum lands where `to` says.
    /// Returns the bytes other ranks read of this rank's data.
    fn reduce(&mut self, c: &Call, buf: &mut [f32], to: Sums) -> Result<u64, CommError> {
        let (n, me) = (self.n, self.me);
        let chunks = chunks(buf.len(), n);
        let cap = SLOT / n;
        let longest = chunks.iter().map(|r| r.len()).max().unwrap_or(0);
        let mut o = 0;
        while o < longest {
            let set = self.next_set();
            for (j, r) in chunks.iter().enumerate().filter(|(j, _)| *j != me) {
                self.write_slot(set, j * cap, &buf[part(r, o, cap)]);
            }
            self.barrier(c)?;
            let mine = part(&chunks[me], o, cap);
            let k = mine.len();
            let sources: Vec<&[f32]> = (0..n)
                .map(|q| self.slot(set, q, me * cap, if q == me { 0 } else { k }))
                .collect();
            if to != Sums::Front || mine.start == o {
                sum_in_rank_order(&mut buf[mine.clone()], None, me, &sources);
            } else {
                // [o, o + k) lies in chunk 0, before this rank's chunk, and this
                // step has already copied it out.
                let (front, back) = buf.split_at_mut(mine.start);
                sum_in_rank_order(&mut front[o..o + k], Some(&back[..k]), me, &sources);
            }
            if to == Sums::Everywhere {
                self.write_slot(set, me * cap, &buf[mine]);
                self.barrier(c)?;
                for (j, r) in chunks.iter().enumerate().filter(|(j, _)| *j != me) {
                    let p = part(r, o, cap);
                    let len = p.len();
                    copy_streaming(as_slots(&mut buf[p]), self.slot(set, j, j * cap, len));
                }
            }
            o += cap;
        }
        Ok(((buf.len() - chunks[me].len()) * 4) as u64)
    }

    /// Afterwards the first `chunk me`-length elements of `buf` hold this rank's
    /// chunk of the sum over ranks.
    pub(crate) fn reduce_scatter(&mut self, c: &Call, buf: &mut [f32]) -> Result<u64, CommError> {
        self.begin(c, buf.len(), buf.as_ptr())?;
        self.reduce(c, buf, Sums::Front)
    }

    /// In place: afterwards all of `buf` holds the sum over ranks. Where an
    /// all-gather of this length would read its peers directly, the sums stay
    /// in their chunks and are gathered that way; otherwise each step's sums
    /// go through the slots.
    pub(crate) fn all_reduce(&mut self, c: &Call, buf: &mut [f32]) -> Result<u64, CommError> {
        self.begin(c, buf.len(), buf.as_ptr())?;
        if self.reads_directly(buf.len()) {
            let scattered = self.reduce(c, buf, Sums::InPlace)?;
            // Every rank's sums are finished before anyone reads them.
            self.barrier(c)?;
            Ok(scattered + self.gather(c, as_slots(buf))?)
        } else {
            let own = chunk_range(buf.len(), self.n, self.me).len();
            Ok(self.reduce(c, buf, Sums::Everywhere)? + ((self.n - 1) * own * 4) as u64)
        }
    }

    /// Waits for every rank (checking they all called a barrier).
    pub(crate) fn barrier_op(&mut self, c: &Call) -> Result<u64, CommError> {
        self.begin(c, 0, std::ptr::null())?;
        Ok(0)
    }

    /// In place: chunk `me` of `buf` is this rank's; afterwards every chunk holds
    /// its owner's.
    pub(crate) fn all_gather(&mut self, c: &Call, buf: &mut [f32]) -> Result<u64, CommError> {
        self.begin(c, buf.len(), buf.as_ptr())?;
        self.gather(c, as_slots(buf))
    }

    /// An all-gather into `buf`, whose every element it writes: this rank's
    /// chunk from `own`, the others from their ranks. Returns the bytes other
    /// ranks read of this rank's data.
    pub(crate) fn all_gather_into(
        &mut self,
        c: &Call,
        own: &[f32],
        buf: &mut [MaybeUninit<f32>],
    ) -> Result<u64, CommError> {
        let mine = chunk_range(buf.len(), self.n, self.me);
        assert_eq!(own.len(), mine.len(), "this rank's chunk of the gather");
        for (d, &v) in buf[mine].iter_mut().zip(own) {
            d.write(v);
        }
        self.begin(c, buf.len(), buf.as_ptr().cast())?;
        // Every other chunk is written by `gather` (its whole length, from
        // the peer or through the slots).
        self.gather(c, buf)
    }

    /// Whether a gather of `len` elements reads its peers directly (or tries
    /// to): single copy not off, chunks of at least a slot, and every rank's
    /// buffer together within [`DIRECT_MAX_BYTES`]. The same on every rank.
    fn reads_directly(&self, len: usize) -> bool {
        let longest = chunk_range(len, self.n, 0).len();
        self.single_copy != SingleCopy::Off
            && longest >= SLOT
            && self.n * len * 4 <= DIRECT_MAX_BYTES
    }

    /// The all-gather after `begin`: every chunk of `buf` from its owner,
    /// this rank's chunk holding its values already (the others are only
    /// written). Returns the bytes other ranks read of this rank's data.
    fn gather(&mut self, c: &Call, buf: &mut [MaybeUninit<f32>]) -> Result<u64, CommError> {
        let (n, me) = (self.n, self.me);
        let chunks = chunks(buf.len(), n);
        let longest = chunks.iter().map(|r| r.len()).max().unwrap_or(0);
        let shared = ((n - 1) * chunks[me].len() * 4) as u64;
        if self.reads_directly(buf.len()) {
            let read = self.read_peers(c, buf, &chunks);
            if self.single_copy == SingleCopy::Untried {
                // Everyone's outcome, after a barrier that also keeps every
                // buffer in place until its readers are done.
                let outcome = if read.is_ok() { 2 } else { 1 };
                self.seg
                    .flag(me, SINGLE_COPY_OUTCOME)
                    .store(outcome, Ordering::Relaxed);
                self.barrier(c)?;
                let all = (0..n).all(|j| {
                    self.seg
                        .flag(j, SINGLE_COPY_OUTCOME)
                        .load(Ordering::Relaxed)
                        == 2
                });
                if all {
                    self.single_copy = SingleCopy::Works;
                    return Ok(shared);
                }
                // Some rank was refused: the slots, now and from now on
                // (rewriting what this rank may have read already).
                if let Err(e) = read {
                    tracing::info!("shared-memory gathers go through the segment: {e}");
                }
                self.single_copy = SingleCopy::Off;
            } else {
                read?;
                self.barrier(c)?;
                return Ok(shared);
            }
        }
        let mut o = 0;
        while o < longest {
            let set = self.next_set();
            // SAFETY: this rank's chunk holds its values (caller).
            self.write_slot(set, 0, unsafe {
                assume_init_ref(&buf[part(&chunks[me], o, SLOT)])
            });
            self.barrier(c)?;
            for (j, r) in chunks.iter().enumerate().filter(|(j, _)| *j != me) {
                let p = part(r, o, SLOT);
                let len = p.len();
                copy_streaming(&mut buf[p], self.slot(set, j, 0, len));
            }
            o += SLOT;
        }
        Ok(shared)
    }

    /// Reads every peer's chunk of collective `c` from that peer's buffer
    /// (published by `begin`) into the same chunk of `buf`.
    fn read_peers(
        &self,
        c: &Call,
        buf: &mut [MaybeUninit<f32>],
        chunks: &[Range<usize>],
    ) -> Result<(), CommError> {
        let at = Direct::seq_words(c.seq);
        for (j, r) in chunks.iter().enumerate().filter(|(j, _)| *j != self.me) {
            let pid = self.seg.flag(j, PID).load(Ordering::Relaxed);
            let base = self.seg.flag(j, at + 3).load(Ordering::Relaxed);
            let from = base + 4 * r.start as u64;
            read_process(pid, from, &mut buf[r.clone()]).map_err(|e| CommError::Link {
                op: c.op.name(),
                group: c.group.to_string(),
                peer: j,
                message: format!("reading its buffer directly (process {pid}): {e}"),
            })?;
        }
        Ok(())
    }
}

/// Fills `dst` from the memory of process `pid` at address `from`, with
/// `process_vm_readv` (a kernel copy, no mapping of the other process).
#[cfg(target_os = "linux")]
fn read_process(pid: u64, from: u64, dst: &mut [MaybeUninit<f32>]) -> io::Result<()> {
    let bytes = std::mem::size_of_val(dst);
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not a process id"))?;
    let mut done = 0;
    while done < bytes {
        let local = libc::iovec {
            // SAFETY: `done < bytes`: inside `dst`.
            iov_base: unsafe { dst.as_mut_ptr().cast::<u8>().add(done) }.cast(),
            iov_len: bytes - done,
        };
        let remote = libc::iovec {
            iov_base: (from as usize + done) as *mut libc::c_void,
            iov_len: bytes - done,
        };
        // SAFETY: `local` is writable memory of this process, `bytes - done`
        // long; the kernel checks the remote range and our right to read it.
        let got = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        match got {
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the read returned no bytes",
                ))
            }
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// Only Linux has `process_vm_readv`; elsewhere `Direct::new` never enables
/// single copy.
#[cfg(not(target_os = "linux"))]
fn read_process(_pid: u64, _from: u64, _dst: &mut [MaybeUninit<f32>]) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "no process_vm_readv on this system",
    ))
}

/// Copies `src` into `dst` with stores that bypass the cache: `dst` is a large
/// buffer that nothing reads soon, and a plain store would first read each line
/// of it (a third more memory traffic for a copy). Whole 64-byte lines at a
/// time with AVX-512, 16 bytes with SSE.
fn copy_streaming(dst: &mut [MaybeUninit<f32>], src: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    copy_streaming_with(dst, src, std::arch::is_x86_feature_detected!("avx512f"));
    #[cfg(not(target_arch = "x86_64"))]
    copy_plain(dst, src);
}

/// `dst` as slots to write f32 values into (each holds one already).
fn as_slots(dst: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: MaybeUninit<f32> has f32's layout; the slots are only
    // written with f32 values, so `dst` stays initialised.
    unsafe { &mut *(std::ptr::from_mut(dst) as *mut [MaybeUninit<f32>]) }
}

/// `s`'s values, which the caller knows to be initialised.
///
/// # Safety
///
/// Every element of `s` holds a value.
unsafe fn assume_init_ref(s: &[MaybeUninit<f32>]) -> &[f32] {
    // SAFETY: the caller's; MaybeUninit<f32> has f32's layout.
    unsafe { &*(std::ptr::from_ref(s) as *const [f32]) }
}

/// `src` into `dst` with plain stores.
fn copy_plain(dst: &mut [MaybeUninit<f32>], src: &[f32]) {
    assert_eq!(dst.len(), src.len());
    for (d, &v) in dst.iter_mut().zip(src) {
        d.write(v);
    }
}

/// [`copy_streaming`] with AVX-512 stores (`wide`, which the CPU must have)
/// or SSE ones.
#[cfg(target_arch = "x86_64")]
fn copy_streaming_with(dst: &mut [MaybeUninit<f32>], src: &[f32], wide: bool) {
    assert_eq!(dst.len(), src.len());
    {
        let align = if wide { 64 } else { 16 };
        let lanes = align / 4;
        // Plain stores up to the first aligned address, then a vector a store.
        let head = (dst.as_ptr().align_offset(align)).min(dst.len());
        copy_plain(&mut dst[..head], &src[..head]);
        let body = (dst.len() - head) / lanes * lanes;
        let (d, s) = (dst[head..].as_mut_ptr().cast::<f32>(), src[head..].as_ptr());
        if wide {
            // SAFETY: the CPU has AVX-512F (checked); [head, head + body) is
            // inside both slices and every store's destination is 64-byte
            // aligned.
            unsafe { stream64(d, s, body) };
        } else {
            // SAFETY: SSE is part of x86_64; as above, 16-byte aligned.
            unsafe { stream16(d, s, body) };
        }
        copy_plain(&mut dst[head + body..], &src[head + body..]);
    }
}

/// `n` floats (a multiple of 16) from `s` to the 64-byte aligned `d`, in
/// non-temporal stores of a whole line.
///
/// # Safety
///
/// The CPU has AVX-512F; `d` and `s` are valid for `n` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stream64(d: *mut f32, s: *const f32, n: usize) {
    use std::arch::x86_64::{_mm512_loadu_ps, _mm512_stream_ps, _mm_sfence};
    let mut i = 0;
    while i < n {
        // SAFETY: i + 16 ≤ n (caller), d + i is 64-byte aligned.
        unsafe { _mm512_stream_ps(d.add(i), _mm512_loadu_ps(s.add(i))) };
        i += 16;
    }
    _mm_sfence();
}

/// [`stream64`] with 16-byte SSE stores: `n` a multiple of 4, `d` 16-byte
/// aligned.
///
/// # Safety
///
/// `d` and `s` are valid for `n` floats.
#[cfg(target_arch = "x86_64")]
unsafe fn stream16(d: *mut f32, s: *const f32, n: usize) {
    use std::arch::x86_64::{_mm_loadu_ps, _mm_sfence, _mm_stream_ps};
    let mut i = 0;
    while i < n {
        // SAFETY: i + 4 ≤ n (caller), d + i is 16-byte aligned.
        unsafe { _mm_stream_ps(d.add(i), _mm_loadu_ps(s.add(i))) };
        i += 4;
    }
    // SAFETY: SSE is part of x86_64.
    unsafe { _mm_sfence() };
}

/// Makes `out` the sum of every rank's contribution, added in rank order:
/// `sources[q]` for q ≠ me, and rank `me`'s from `own` (or `out` itself if
/// `None`), through a small stack buffer.
fn sum_in_rank_order(out: &mut [f32], own: Option<&[f32]>, me: usize, sources: &[&[f32]]) {
    let mut acc = [0f32; BLOCK];
    let mut at = 0;
    while at < out.len() {
        let k = BLOCK.min(out.len() - at);
        let acc = &mut acc[..k];
        let dst = &mut out[at..at + k];
        for (q, src) in sources.iter().enumerate() {
            let src = match (q == me, own) {
                (true, Some(own)) => &own[at..at + k],
                (true, None) => &*dst,
                (false, _) => &src[at..at + k],
            };
            if q == 0 {
                acc.copy_from_slice(src);
            } else {
                crate::reduce_add(acc, src);
            }
        }
        dst.copy_from_slice(acc);
        at += k;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_order_sum_matches_a_left_fold() {
        let n = 5000;
        let srcs: Vec<Vec<f32>> = (0..4)
            .map(|q| {
                (0..n)
                    .map(|i| ((i * 7 + q * 13) % 97) as f32 * 0.1)
                    .collect()
            })
            .collect();
        for me in 0..4 {
            let views: Vec<&[f32]> = srcs.iter().map(Vec::as_slice).collect();
            let mut in_place = srcs[me].clone();
            sum_in_rank_order(&mut in_place, None, me, &views);
            let mut elsewhere = vec![0f32; n];
            sum_in_rank_order(&mut elsewhere, Some(&srcs[me]), me, &views);
            for i in 0..n {
                let want = ((srcs[0][i] + srcs[1][i]) + srcs[2][i]) + srcs[3][i];
                assert_eq!(in_place[i].to_bits(), want.to_bits());
                assert_eq!(elsewhere[i].to_bits(), want.to_bits());
            }
        }
    }

    /// A fresh segment for two ranks, mapped twice.
    fn segment_of_two(name: &str) -> Vec<Arc<Segment>> {
        let name = format!("zcomm-{name}-{}", std::process::id());
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        let segs = (0..2)
            .map(|r| {
                let name = name.clone();
                std::thread::spawn(move || Segment::open(&name, 2, r, deadline).unwrap())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        let _ = std::fs::remove_file(zproto::shm_segment_path(&name));
        segs
    }

    /// Two ranks of one segment, each on its own thread, running `f` with a
    /// call of `op` and sequence number `seq`; results by rank.
    fn on_two<T: Send + 'static>(
        directs: &mut [Option<Direct>],
        seq: u64,
        f: impl Fn(&mut Direct, &Call) -> T + Send + Sync + Copy + 'static,
    ) -> Vec<(Direct, T)> {
        let handles: Vec<_> = directs
            .iter_mut()
            .map(|d| {
                let mut d = d.take().unwrap();
                std::thread::spawn(move || {
                    let now = Instant::now();
                    let call = Call {
                        op: Op::AllGather,
                        seq,
                        group: "test",
                        started: now,
                        deadline: now + std::time::Duration::from_secs(20),
                        waiting_for: &|_| {},
                    };
                    let out = f(&mut d, &call);
                    (d, out)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// A rank refused the direct read (here: a peer's process id that names
    /// no process): every rank falls back to the slots, agreeing, the gather
    /// is still right, and later ones use the slots from the start.
    #[test]
    fn a_refused_direct_read_falls_back_to_the_slots_on_every_rank() {
        let segs = segment_of_two("direct-refused");
        let mut directs: Vec<Option<Direct>> = segs
            .iter()
            .enumerate()
            .map(|(r, s)| Some(Direct::new(s.clone(), r, true)))
            .collect();
        // Rank 1 claims a process id beyond Linux's largest: rank 0 cannot
        // read it, rank 1 reads rank 0 fine.
        segs[0].flag(1, PID).store(1 << 23, Ordering::Relaxed);
        let len = 2 * SLOT + 7;
        for seq in 0..2 {
            let out = on_two(&mut directs, seq, move |d, c| {
                let own = chunk_range(len, 2, d.me);
                let mut buf = vec![f32::NAN; len];
                for i in own {
                    buf[i] = (i * 3 + d.me) as f32;
                }
                d.all_gather(c, &mut buf).unwrap();
                buf
            });
            for (r, (d, buf)) in out.into_iter().enumerate() {
                assert_eq!(
                    d.single_copy,
                    SingleCopy::Off,
                    "rank {r} after gather {seq}"
                );
                for (i, v) in buf.iter().enumerate() {
                    let owner = usize::from(i >= chunk_range(len, 2, 0).end);
                    assert_eq!(*v, (i * 3 + owner) as f32, "rank {r} element {i}");
                }
                directs[r] = Some(d);
            }
        }
    }

    /// Where both ranks can read each other, the first large gather turns
    /// direct reads on for both, and an all-reduce through them gives the
    /// bits of one through the slots.
    #[test]
    fn direct_reads_are_agreed_and_give_the_slots_bits() {
        let len = 3 * SLOT + 5;
        let input = move |r: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.37)
                .collect()
        };
        let mut sums = Vec::new();
        for single_copy in [false, true] {
            // A fresh segment each time: barriers count from zero.
            let segs = segment_of_two(&format!("direct-agreed-{single_copy}"));
            let mut directs: Vec<Option<Direct>> = segs
                .iter()
                .enumerate()
                .map(|(r, s)| Some(Direct::new(s.clone(), r, single_copy)))
                .collect();
            let out = on_two(&mut directs, 0, move |d, c| {
                let mut buf = input(d.me);
                d.all_reduce(c, &mut buf).unwrap();
                buf
            });
            let want = if single_copy {
                SingleCopy::Works
            } else {
                SingleCopy::Off
            };
            for (d, _) in &out {
                assert_eq!(d.single_copy, want);
            }
            assert_eq!(
                out[0].1, out[1].1,
                "ranks differ (single copy {single_copy})"
            );
            sums.push(out.into_iter().next().unwrap().1);
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&sums[0]), bits(&sums[1]));
        let a = input(0);
        let b = input(1);
        assert!(sums[0]
            .iter()
            .zip(a.iter().zip(&b))
            .all(|(s, (x, y))| *s == x + y));
    }

    #[test]
    fn parts_clip_to_their_chunk() {
        assert_eq!(part(&(10..25), 0, 8), 10..18);
        assert_eq!(part(&(10..25), 8, 8), 18..25);
        assert_eq!(part(&(10..25), 16, 8), 25..25);
    }

    /// Every start alignment and length, the unaligned head and the tail
    /// around the vector body included, copies exactly `src` and nothing
    /// past it, with SSE stores and (where the CPU has them) AVX-512 ones.
    #[test]
    fn streaming_copy_copies_every_element_at_any_alignment() {
        let src: Vec<f32> = (0..200).map(|i| i as f32 * 0.5 + 1.0).collect();
        #[cfg(target_arch = "x86_64")]
        let paths: Vec<bool> = [false, true]
            .into_iter()
            .filter(|&wide| !wide || std::arch::is_x86_feature_detected!("avx512f"))
            .collect();
        #[cfg(not(target_arch = "x86_64"))]
        let paths = [false];
        for (offset, wide) in (0..17).flat_map(|o| paths.iter().map(move |&w| (o, w))) {
            for len in [0, 1, 3, 4, 15, 16, 17, 31, 64, 65, 130, 183 - offset] {
                let mut buf = vec![-1f32; 200];
                #[cfg(target_arch = "x86_64")]
                copy_streaming_with(as_slots(&mut buf[offset..offset + len]), &src[..len], wide);
                #[cfg(not(target_arch = "x86_64"))]
                let _ = (
                    wide,
                    copy_streaming(as_slots(&mut buf[offset..offset + len]), &src[..len]),
                );
                assert_eq!(
                    &buf[offset..offset + len],
                    &src[..len],
                    "offset {offset} len {len} wide {wide}"
                );
                assert!(buf[..offset].iter().all(|&v| v == -1.0));
                assert!(buf[offset + len..].iter().all(|&v| v == -1.0));
            }
        }
    }
}
