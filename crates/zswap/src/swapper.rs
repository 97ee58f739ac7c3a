//! The swapper: asynchronous whole-buffer reads and writes of swap files, with
//! I/O accounting.
//!
//! A read or write takes a buffer by value and returns an [`IoHandle`] that gives
//! it back when the transfer is done, the shape the collectives have: the caller
//! issues the next sub-group's read, computes on this one, and waits only when it
//! needs the bytes. Below it, one of two paths, chosen at start: io_uring (one
//! submission thread keeping `queue_depth` block-sized transfers in flight) or,
//! where the kernel or a sandbox refuses io_uring, `thread_count` threads doing
//! `pread`/`pwrite` of block-sized pieces.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::buf::{AlignedBuf, ALIGN};
use crate::error::SwapError;
use crate::{threads, uring};

/// `aio:` settings (DeepSpeed's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AioConfig {
    /// Bytes per transfer submitted to the kernel (a multiple of 4 KiB).
    pub block_size: usize,
    /// Transfers in flight at once (io_uring).
    pub queue_depth: usize,
    /// I/O threads (the thread path).
    pub thread_count: usize,
}

impl Default for AioConfig {
    fn default() -> Self {
        AioConfig {
            block_size: 1 << 20,
            queue_depth: 32,
            thread_count: 2,
        }
    }
}

/// Which I/O path a swapper runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoPath {
    /// io_uring.
    Uring,
    /// A pool of threads doing `pread` / `pwrite`.
    Threads,
}

impl IoPath {
    /// The name logs and benchmarks print.
    pub fn name(self) -> &'static str {
        match self {
            IoPath::Uring => "io_uring",
            IoPath::Threads => "threads",
        }
    }
}

/// Bytes moved and time spent, since the swapper started.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct IoStats {
    /// Bytes read from swap files.
    pub read_bytes: u64,
    /// Bytes written to swap files.
    pub write_bytes: u64,
    /// Seconds callers spent blocked in [`IoHandle::wait`].
    pub wait_s: f64,
    /// Seconds during which at least one transfer was in flight.
    pub busy_s: f64,
}

impl IoStats {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &IoStats) -> IoStats {
        IoStats {
            read_bytes: self.read_bytes - earlier.read_bytes,
            write_bytes: self.write_bytes - earlier.write_bytes,
            wait_s: (self.wait_s - earlier.wait_s).max(0.0),
            busy_s: (self.busy_s - earlier.busy_s).max(0.0),
        }
    }

    /// The share of I/O time that callers did not wait for: `1 - wait / busy`
    /// (1 when nothing was busy).
    pub fn hidden(&self) -> f64 {
        if self.busy_s <= 0.0 {
            return 1.0;
        }
        (1.0 - self.wait_s / self.busy_s).clamp(0.0, 1.0)
    }
}

/// A swap file opened for `O_DIRECT` transfers.
#[derive(Clone)]
pub struct SwapFile {
    pub(crate) file: Arc<File>,
    pub(crate) path: Arc<PathBuf>,
}

impl SwapFile {
    /// Wraps an open file (opened with `O_DIRECT` by [`crate::SwapDir`]).
    pub(crate) fn new(file: File, path: PathBuf) -> SwapFile {
        SwapFile {
            file: Arc::new(file),
            path: Arc::new(path),
        }
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Flushes the file's data to the device (`fdatasync`).
    pub fn sync(&self) -> Result<(), SwapError> {
        self.file.sync_data().map_err(|source| SwapError::Io {
            op: "write",
            path: self.path.to_path_buf(),
            source,
        })
    }
}

/// Counters shared by the submitting side and the I/O path.
#[derive(Default)]
pub(crate) struct Counters {
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    wait_ns: AtomicU64,
    /// (requests in flight, when the current busy period began, busy time before it).
    busy: Mutex<(usize, Option<Instant>, Duration)>,
}

impl Counters {
    fn begin(&self) {
        let mut b = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        if b.0 == 0 {
            b.1 = Some(Instant::now());
        }
        b.0 += 1;
    }

    pub(crate) fn end(&self, write: bool, bytes: u64) {
        let counter = if write {
            &self.write_bytes
        } else {
            &self.read_bytes
        };
        counter.fetch_add(bytes, Ordering::Relaxed);
        let mut b = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        b.0 -= 1;
        if b.0 == 0 {
            if let Some(since) = b.1.take() {
                b.2 += since.elapsed();
            }
        }
    }

    fn snapshot(&self) -> IoStats {
        let b = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        let busy = b.2 + b.1.map_or(Duration::ZERO, |s| s.elapsed());
        IoStats {
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
            write_bytes: self.write_bytes.load(Ordering::Relaxed),
            wait_s: self.wait_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            busy_s: busy.as_secs_f64(),
        }
    }
}

/// One whole-buffer transfer while its pieces are in flight.
pub(crate) struct Request {
    pub(crate) file: SwapFile,
    pub(crate) write: bool,
    /// The buffer, until the last piece completes; pieces point into it (its
    /// heap bytes do not move while it sits here).
    buf: Mutex<Option<AlignedBuf>>,
    remaining: AtomicUsize,
    error: Mutex<Option<SwapError>>,
    done: Sender<Result<AlignedBuf, SwapError>>,
    counters: Arc<Counters>,
}

/// A block-sized piece of a request.
pub(crate) struct Piece {
    pub(crate) req: Arc<Request>,
    /// File offset.
    pub(crate) offset: u64,
    /// Address inside the request's buffer.
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

impl Request {
    /// Splits `buf` into pieces of `block` bytes for `file` at `offset`.
    fn pieces(
        file: SwapFile,
        offset: u64,
        mut buf: AlignedBuf,
        write: bool,
        block: usize,
        counters: Arc<Counters>,
        done: Sender<Result<AlignedBuf, SwapError>>,
    ) -> Vec<Piece> {
        let (base, len) = (buf.as_mut_ptr() as usize, buf.len());
        let count = len.div_ceil(block);
        let req = Arc::new(Request {
            file,
            write,
            buf: Mutex::new(Some(buf)),
            remaining: AtomicUsize::new(count),
            error: Mutex::new(None),
            done,
            counters,
        });
        (0..count)
            .map(|i| {
                let at = i * block;
                Piece {
                    req: req.clone(),
                    offset: offset + at as u64,
                    addr: base + at,
                    len: block.min(len - at),
                }
            })
            .collect()
    }

    /// Records that a piece failed (the first error is the one reported).
    pub(crate) fn fail(&self, e: std::io::Error) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(SwapError::Io {
                op: if self.write { "write" } else { "read" },
                path: self.file.path.to_path_buf(),
                source: e,
            });
        }
    }

    /// Marks one piece done; the last one hands the buffer back.
    pub(crate) fn piece_done(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let buf = self.buf.lock().unwrap_or_else(|p| p.into_inner()).take();
        let error = self.error.lock().unwrap_or_else(|p| p.into_inner()).take();
        let bytes = buf.as_ref().map_or(0, |b| b.len() as u64);
        self.counters
            .end(self.write, if error.is_none() { bytes } else { 0 });
        let result = match (error, buf) {
            (Some(e), _) => Err(e),
            (None, Some(b)) => Ok(b),
            (None, None) => Err(SwapError::Closed),
        };
        // The caller may have dropped its handle; then nobody wants the buffer.
        let _ = self.done.send(result);
    }
}

/// The I/O path behind a swapper: takes pieces, completes them.
pub(crate) enum Backend {
    Uring(uring::Ring),
    Threads(threads::Pool),
}

/// Asynchronous reads and writes of swap files.
pub struct Swapper {
    backend: Backend,
    block: usize,
    counters: Arc<Counters>,
}

/// A transfer in flight; [`IoHandle::wait`] gives the buffer back.
#[must_use = "a transfer's buffer and error come back through wait()"]
pub struct IoHandle {
    rx: Receiver<Result<AlignedBuf, SwapError>>,
    counters: Arc<Counters>,
}

impl IoHandle {
    /// Blocks until the transfer is done; returns the buffer (filled, for a read).
    pub fn wait(self) -> Result<AlignedBuf, SwapError> {
        let t = Instant::now();
        let got = self.rx.recv().unwrap_or(Err(SwapError::Closed));
        self.counters
            .wait_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        got
    }
}

impl Swapper {
    /// A swapper on `path`, or the best path this machine allows when `None`:
    /// io_uring where the kernel lets this process set up a ring, else threads.
    pub fn new(cfg: AioConfig, path: Option<IoPath>) -> Result<Swapper, SwapError> {
        if cfg.block_size == 0 || !cfg.block_size.is_multiple_of(ALIGN) {
            return Err(SwapError::Config(format!(
                "aio.block_size must be a positive multiple of {ALIGN} bytes, got {}",
                cfg.block_size
            )));
        }
        let depth = cfg.queue_depth.max(1);
        let backend = match path {
            Some(IoPath::Threads) => Backend::Threads(threads::Pool::new(cfg.thread_count.max(1))?),
            Some(IoPath::Uring) => Backend::Uring(uring::Ring::new(depth)?),
            None => match uring::Ring::new(depth) {
                Ok(r) => Backend::Uring(r),
                Err(e) => {
                    tracing::info!("io_uring unavailable ({e}); swap I/O uses threads");
                    Backend::Threads(threads::Pool::new(cfg.thread_count.max(1))?)
                }
            },
        };
        Ok(Swapper {
            backend,
            block: cfg.block_size,
            counters: Arc::default(),
        })
    }

    /// The path this swapper runs.
    pub fn path(&self) -> IoPath {
        match self.backend {
            Backend::Uring(_) => IoPath::Uring,
            Backend::Threads(_) => IoPath::Threads,
        }
    }

    /// Reads `buf.len()` bytes of `file` at `offset` (a multiple of 4 KiB) into `buf`.
    pub fn read(&self, file: &SwapFile, offset: u64, buf: AlignedBuf) -> IoHandle {
        self.submit(file, offset, buf, false)
    }

    /// Writes all of `buf` to `file` at `offset` (a multiple of 4 KiB).
    pub fn write(&self, file: &SwapFile, offset: u64, buf: AlignedBuf) -> IoHandle {
        self.submit(file, offset, buf, true)
    }

    fn submit(&self, file: &SwapFile, offset: u64, buf: AlignedBuf, write: bool) -> IoHandle {
        assert_eq!(
            offset % ALIGN as u64,
            0,
            "swap offsets are multiples of 4 KiB"
        );
        let (tx, rx) = mpsc::channel();
        self.counters.begin();
        let pieces = Request::pieces(
            file.clone(),
            offset,
            buf,
            write,
            self.block,
            self.counters.clone(),
            tx,
        );
        match &self.backend {
            Backend::Uring(r) => r.submit(pieces),
            Backend::Threads(p) => p.submit(pieces),
        }
        IoHandle {
            rx,
            counters: self.counters.clone(),
        }
    }

    /// Bytes moved and time spent so far.
    pub fn stats(&self) -> IoStats {
        self.counters.snapshot()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_subtract_and_say_what_share_was_hidden() {
        let earlier = IoStats {
            read_bytes: 100,
            write_bytes: 40,
            wait_s: 0.5,
            busy_s: 2.0,
        };
        let later = IoStats {
            read_bytes: 350,
            write_bytes: 90,
            wait_s: 0.75,
            busy_s: 3.0,
        };
        let want = IoStats {
            read_bytes: 250,
            write_bytes: 50,
            wait_s: 0.25,
            busy_s: 1.0,
        };
        assert_eq!(later.since(&earlier), want);
        let hidden = |wait_s, busy_s| {
            IoStats {
                wait_s,
                busy_s,
                ..IoStats::default()
            }
            .hidden()
        };
        assert_eq!(hidden(3.0, 4.0), 0.25);
        assert_eq!(hidden(0.0, 0.0), 1.0, "nothing busy: nothing to hide");
        assert_eq!(hidden(2.0, 1.0), 0.0, "waits longer than the I/O");
    }

    /// Busy time is the union of the transfers' spans: counted once where
    /// two overlap, and not while nothing is in flight.
    #[test]
    fn busy_time_is_the_union_of_the_transfers_in_flight() {
        let c = Counters::default();
        let ms = Duration::from_millis;
        c.begin();
        std::thread::sleep(ms(20));
        c.begin();
        std::thread::sleep(ms(20));
        c.end(false, 10);
        let during = c.snapshot();
        assert!(
            during.busy_s >= 0.04,
            "busy {} s with one in flight",
            during.busy_s
        );
        std::thread::sleep(ms(20));
        c.end(true, 4096);
        let after = c.snapshot();
        assert!(
            after.busy_s >= 0.06 && after.busy_s < during.busy_s + 5.0,
            "busy {} s after both",
            after.busy_s
        );
        std::thread::sleep(ms(30));
        assert_eq!(c.snapshot().busy_s, after.busy_s, "idle time counted busy");
        assert_eq!((after.read_bytes, after.write_bytes), (10, 4096));
        c.wait_ns.fetch_add(1_500_000_000, Ordering::Relaxed);
        assert_eq!(c.snapshot().wait_s, 1.5);
    }

    /// An I/O error on either path fails the transfer, naming the file; it is
    /// never reported done: here writes to a file opened read-only.
    #[test]
    fn a_refused_write_fails_naming_the_file_on_both_paths() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("read-only.swp");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let file = SwapFile::new(File::open(&path).unwrap(), path.clone());
        for io in [IoPath::Uring, IoPath::Threads] {
            let swapper = match Swapper::new(AioConfig::default(), Some(io)) {
                Ok(s) => s,
                Err(e) => {
                    println!("skipped the {} path: {e}", io.name());
                    continue;
                }
            };
            let err = swapper
                .write(&file, 0, AlignedBuf::zeroed(8192))
                .wait()
                .err()
                .map(|e| e.to_string());
            // The system's own reason: EBADF, a descriptor not open for writing.
            let named = |e: &str| e.contains("read-only.swp") && e.contains("os error 9");
            assert!(err.as_deref().is_some_and(named), "{}: {err:?}", io.name());
        }
    }
}
