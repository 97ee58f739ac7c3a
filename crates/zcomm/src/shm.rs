//! The shared-memory transport between ranks of one host.
//!
//! One segment per node (a file in `/dev/shm`, mapped by every local rank)
//! holds a single-producer single-consumer byte ring for every ordered pair of
//! local ranks. A ring is a write index and a read index on their own cache lines
//! and `RING_BYTES` of data; the writer publishes with a release store of the
//! write index, the reader frees space with a release store of the read index.
//! The rings carry exactly the framed messages the TCP transport carries, behind
//! the same `Read` / `Write` interface, so the operation thread, the per-peer
//! writer threads and every algorithm are shared.
//!
//! After the rings, the segment has a direct area for the collectives of
//! `direct.rs`: per rank a line of flags and two sets of one `SLOT_BYTES` slot.
//!
//! Local rank 0 creates the segment and unlinks it once every local rank has
//! mapped it, so nothing is left in `/dev/shm` even if a worker is killed later
//! (zrun also removes leftovers of a job that failed before that point).

use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memmap2::MmapMut;

/// Data bytes per ring.
pub const RING_BYTES: usize = 4 << 20;
/// Bytes of one rank's slot in one set of the direct area (fits in L2 with room).
pub(crate) const SLOT_BYTES: usize = 1 << 20;
const HEADER: usize = 4096;
const RING_META: usize = 128;
/// Flag bytes per rank in the direct area.
const DIRECT_META: usize = 512;
const MAGIC: u64 = 0x7a72_756e_7368_6d31; // "zrunshm1"

/// Sizes the segment file and reserves its pages now. tmpfs allocates pages on
/// first touch, and a page it cannot allocate then is a SIGBUS in whichever
/// rank touches it; `posix_fallocate` turns a full `/dev/shm` into an error
/// here, before any rank maps the file.
fn reserve(f: &std::fs::File, len: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain system call on an open file descriptor we own.
    let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len as libc::off_t) };
    match rc {
        0 => Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => f.set_len(len as u64),
        libc::ENOSPC => Err(io::Error::new(
            io::ErrorKind::StorageFull,
            format!(
                "/dev/shm has no room for the {len}-byte segment (free some, enlarge it, or set comm.backend: tcp)"
            ),
        )),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// A mapped segment.
pub(crate) struct Segment {
    map: MmapMut,
    local: usize,
}

// SAFETY: the mapping is only accessed through atomics (indices, header) and
// through byte ranges that the single-producer single-consumer protocol hands to
// exactly one thread at a time.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    fn atomic(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: offsets are 8-byte aligned and inside the mapping (checked by the
        // layout below); the mapping lives as long as `self`; AtomicU64 has the
        // layout of u64.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU64) }
    }

    fn ring_offset(&self, from: usize, to: usize) -> usize {
        HEADER + (from * self.local + to) * (RING_META + RING_BYTES)
    }

    fn direct_offset(local: usize) -> usize {
        HEADER + local * local * (RING_META + RING_BYTES)
    }

    fn len(local: usize) -> usize {
        Segment::direct_offset(local) + local * DIRECT_META + 2 * local * SLOT_BYTES
    }

    /// Local ranks sharing the segment.
    pub(crate) fn local(&self) -> usize {
        self.local
    }

    /// Flag word `word` (0..64) of local rank `rank` in the direct area.
    pub(crate) fn flag(&self, rank: usize, word: usize) -> &AtomicU64 {
        assert!(rank < self.local && word < DIRECT_META / 8);
        self.atomic(Segment::direct_offset(self.local) + rank * DIRECT_META + word * 8)
    }

    /// The slot of local rank `rank` in set `set` (0 or 1) of the direct area:
    /// `SLOT_BYTES / 4` floats, 64-byte aligned.
    pub(crate) fn slot(&self, set: usize, rank: usize) -> *mut f32 {
        assert!(set < 2 && rank < self.local);
        let off = Segment::direct_offset(self.local)
            + self.local * DIRECT_META
            + (set * self.local + rank) * SLOT_BYTES;
        // SAFETY: the offset lies inside the mapping (see `len`).
        unsafe { self.map.as_ptr().add(off) as *mut f32 }
    }

    /// Creates (local rank 0) or waits for and maps the node's segment; returns
    /// once every local rank has mapped it.
    pub(crate) fn open(
        name: &str,
        local: usize,
        local_rank: usize,
        deadline: Instant,
    ) -> io::Result<Arc<Segment>> {
        let path = zproto::shm_segment_path(name);
        let len = Segment::len(local);
        let file = if local_rank == 0 {
            let _ = std::fs::remove_file(&path); // a stale segment of a crashed job with this name
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)?;
            if let Err(e) = reserve(&f, len) {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
            f
        } else {
            loop {
                match OpenOptions::new().read(true).write(true).open(&path) {
                    Ok(f) if f.metadata()?.len() == len as u64 => break f,
                    _ if Instant::now() > deadline => {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("{} did not appear", path.display()),
                        ))
                    }
                    _ => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        };
        // SAFETY: the file is ours (this job's name), sized above, and every rank
        // maps it shared; concurrent access follows the ring protocol.
        let map = unsafe { MmapMut::map_mut(&file)? };
        let seg = Arc::new(Segment { map, local });
        if local_rank == 0 {
            seg.atomic(0).store(MAGIC, Ordering::Release);
        } else {
            while seg.atomic(0).load(Ordering::Acquire) != MAGIC {
                if Instant::now() > deadline {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the shared-memory segment was never initialised",
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        seg.atomic(8).fetch_add(1, Ordering::AcqRel);
        while seg.atomic(8).load(Ordering::Acquire) < local as u64 {
            if Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "not every local rank mapped the shared-memory segment",
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if local_rank == 0 {
            // Everyone has it mapped: the name is no longer needed.
            let _ = std::fs::remove_file(&path);
        }
        Ok(seg)
    }

    /// The writing end of the ring `from → to` and the reading end of `to → from`.
    pub(crate) fn endpoints(self: &Arc<Segment>, me: usize, peer: usize) -> (ShmWriter, ShmReader) {
        (
            ShmWriter {
                seg: self.clone(),
                ring: self.ring_offset(me, peer),
                timeout: Duration::from_secs(300),
            },
            ShmReader {
                seg: self.clone(),
                ring: self.ring_offset(peer, me),
                deadline: None,
            },
        )
    }
}

/// Waits politely: spin briefly, then yield, then sleep (two workers may share
/// two cores with their own compute).
pub(crate) fn backoff(round: &mut u32) {
    *round += 1;
    if *round < 4096 {
        std::hint::spin_loop();
    } else if *round < 8192 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// Copies `len` bytes between a ring and a buffer, wrapping at the end.
fn ring_copy(seg: &Segment, ring: usize, pos: u64, buf: *mut u8, len: usize, into_ring: bool) {
    let data = ring + RING_META;
    let start = (pos % RING_BYTES as u64) as usize;
    let first = len.min(RING_BYTES - start);
    let base = seg.map.as_ptr() as *mut u8;
    // SAFETY: [start, start + first) and [0, len - first) lie inside this ring's
    // data; the protocol gives this thread exclusive use of those bytes now; `buf`
    // has `len` valid bytes.
    unsafe {
        let (a, b) = (base.add(data + start), base.add(data));
        if into_ring {
            std::ptr::copy_nonoverlapping(buf, a, first);
            std::ptr::copy_nonoverlapping(buf.add(first), b, len - first);
        } else {
            std::ptr::copy_nonoverlapping(a, buf, first);
            std::ptr::copy_nonoverlapping(b, buf.add(first), len - first);
        }
    }
}

/// The producer end of a ring.
pub(crate) struct ShmWriter {
    seg: Arc<Segment>,
    ring: usize,
    timeout: Duration,
}

impl ShmWriter {
    /// How long a write may wait for space.
    pub(crate) fn set_timeout(&mut self, t: Duration) {
        self.timeout = t;
    }
}

impl Write for ShmWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let (w_idx, r_idx) = (self.seg.atomic(self.ring), self.seg.atomic(self.ring + 64));
        let deadline = Instant::now() + self.timeout;
        let mut round = 0;
        loop {
            let w = w_idx.load(Ordering::Relaxed);
            let free = RING_BYTES - (w - r_idx.load(Ordering::Acquire)) as usize;
            if free > 0 {
                let n = free.min(buf.len());
                ring_copy(&self.seg, self.ring, w, buf.as_ptr() as *mut u8, n, true);
                w_idx.store(w + n as u64, Ordering::Release);
                return Ok(n);
            }
            if Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the peer stopped reading its shared-memory ring",
                ));
            }
            backoff(&mut round);
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The consumer end of a ring.
pub(crate) struct ShmReader {
    seg: Arc<Segment>,
    ring: usize,
    deadline: Option<Instant>,
}

impl ShmReader {
    /// Reads give up with `TimedOut` after `d` (like a socket's read timeout).
    pub(crate) fn set_read_timeout(&mut self, d: Duration) {
        self.deadline = Some(Instant::now() + d);
    }
}

impl Read for ShmReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let (w_idx, r_idx) = (self.seg.atomic(self.ring), self.seg.atomic(self.ring + 64));
        let mut round = 0;
        loop {
            let r = r_idx.load(Ordering::Relaxed);
            let avail = (w_idx.load(Ordering::Acquire) - r) as usize;
            if avail > 0 {
                let n = avail.min(out.len());
                ring_copy(&self.seg, self.ring, r, out.as_mut_ptr(), n, false);
                r_idx.store(r + n as u64, Ordering::Release);
                return Ok(n);
            }
            if self.deadline.is_some_and(|d| Instant::now() > d) {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "nothing arrived in the shared-memory ring",
                ));
            }
            backoff(&mut round);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The segment is exactly as long as its layout: the last direct slot
    /// ends where the mapping ends, the flag words end where the slots begin,
    /// and the rings end where the flags begin (a shorter segment would put
    /// the last slot past the end of the file).
    #[test]
    fn the_layout_fills_the_segment_exactly() {
        for local in [1, 2, 3] {
            let name = format!("zcomm-layout-{}-{local}", std::process::id());
            let deadline = Instant::now() + Duration::from_secs(10);
            let segs: Vec<Arc<Segment>> = (0..local)
                .map(|r| {
                    let name = name.clone();
                    std::thread::spawn(move || Segment::open(&name, local, r, deadline).unwrap())
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect();
            let _ = std::fs::remove_file(zproto::shm_segment_path(&name));
            let seg = &segs[0];
            let base = seg.map.as_ptr() as usize;
            let at = |p: usize| p - base;
            assert_eq!(
                at(seg.slot(1, local - 1) as usize) + SLOT_BYTES,
                seg.map.len(),
                "{local} ranks"
            );
            let last_flag = seg.flag(local - 1, DIRECT_META / 8 - 1) as *const AtomicU64;
            assert_eq!(at(last_flag as usize) + 8, at(seg.slot(0, 0) as usize));
            assert_eq!(
                seg.ring_offset(local - 1, local - 1) + RING_META + RING_BYTES,
                at(seg.flag(0, 0) as *const AtomicU64 as usize)
            );
        }
    }

    fn timed_out(r: io::Result<Arc<Segment>>) -> String {
        match r {
            Err(e) if e.kind() == io::ErrorKind::TimedOut => e.to_string(),
            Err(e) => panic!("failed otherwise: {e}"),
            Ok(_) => panic!("opened"),
        }
    }

    /// Every wait in `open` ends at its deadline with an error saying what
    /// was missing: a segment that never appears, one that is never
    /// initialised, a rank that never maps it.
    #[test]
    fn every_wait_of_open_ends_at_its_deadline() {
        let soon = || Instant::now() + Duration::from_millis(100);
        let name = format!("zcomm-never-{}", std::process::id());
        let e = timed_out(Segment::open(&name, 2, 1, soon()));
        assert!(e.contains("did not appear"), "{e}");
        // The right size but never initialised by local rank 0.
        let path = zproto::shm_segment_path(&name);
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(Segment::len(2) as u64).unwrap();
        let e = timed_out(Segment::open(&name, 2, 1, soon()));
        let _ = std::fs::remove_file(&path);
        assert!(e.contains("never initialised"), "{e}");
        // Local rank 0 alone of two.
        let e = timed_out(Segment::open(&name, 2, 0, soon()));
        let _ = std::fs::remove_file(&path);
        assert!(e.contains("not every local rank mapped"), "{e}");
    }

    /// A writer whose reader stopped reading gives up at its own timeout:
    /// not never (a rank's exit waits for its writers) and not at the
    /// default five minutes.
    #[test]
    fn a_full_ring_fails_the_write_at_the_writers_timeout() {
        let name = format!("zcomm-full-ring-{}", std::process::id());
        let seg = Segment::open(&name, 1, 0, Instant::now() + Duration::from_secs(10)).unwrap();
        let (mut w, _r) = seg.endpoints(0, 0);
        w.set_timeout(Duration::from_millis(300));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let filled = w.write(&vec![1u8; RING_BYTES]).map_err(|e| e.kind());
            let t = Instant::now();
            let more = w.write(&[1]).map_err(|e| e.kind());
            let _ = tx.send((filled, more, t.elapsed()));
        });
        let (filled, more, waited) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("a write to a full ring gave up within 20 s");
        assert_eq!(filled, Ok(RING_BYTES));
        assert_eq!(more, Err(io::ErrorKind::TimedOut));
        assert!(waited >= Duration::from_millis(300), "{waited:?}");
    }

    /// A read of an empty ring waits for its timeout, then says so.
    #[test]
    fn an_empty_ring_fails_the_read_at_the_readers_timeout() {
        let name = format!("zcomm-empty-ring-{}", std::process::id());
        let seg = Segment::open(&name, 1, 0, Instant::now() + Duration::from_secs(10)).unwrap();
        let (_w, mut r) = seg.endpoints(0, 0);
        r.set_read_timeout(Duration::from_millis(200));
        let t = Instant::now();
        let e = r.read(&mut [0u8; 4]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(200) && waited < Duration::from_secs(10),
            "{waited:?}"
        );
    }

    /// Once every local rank has the segment mapped, its name is gone (a
    /// crashed job leaves nothing behind in /dev/shm).
    #[test]
    fn an_opened_segment_leaves_no_name_behind() {
        let name = format!("zcomm-unlinked-{}", std::process::id());
        let seg = Segment::open(&name, 1, 0, Instant::now() + Duration::from_secs(10)).unwrap();
        assert!(!zproto::shm_segment_path(&name).exists());
        drop(seg);
    }

    /// A rank that finds the segment before local rank 0 has initialised it
    /// waits for the initialisation (and for every rank), then opens it.
    #[test]
    fn a_rank_waits_for_the_segments_initialisation() {
        let name = format!("zcomm-late-init-{}", std::process::id());
        let path = zproto::shm_segment_path(&name);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.set_len(Segment::len(2) as u64).unwrap();
        let waiter = {
            let name = name.clone();
            std::thread::spawn(move || {
                Segment::open(&name, 2, 1, Instant::now() + Duration::from_secs(10))
            })
        };
        std::thread::sleep(Duration::from_millis(200));
        // Play local rank 0: initialise, then count itself in.
        // SAFETY: a test's own file, mapped shared as the ranks map it.
        let map = unsafe { MmapMut::map_mut(&f).unwrap() };
        let seg = Segment { map, local: 2 };
        seg.atomic(0).store(MAGIC, Ordering::Release);
        seg.atomic(8).fetch_add(1, Ordering::AcqRel);
        let opened = waiter.join().unwrap();
        let _ = std::fs::remove_file(&path);
        opened.unwrap();
    }
}
