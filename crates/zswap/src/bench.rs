//! `zrun bench io`: the swap layer's bandwidth against the two plain ways of
//! moving the same bytes, measured in one sitting on one directory, so the
//! ratios say what the swapper adds or loses and the absolute figures say
//! what the disk gives.
//!
//! For every transfer size, each method writes a fresh file of `total` bytes
//! sequentially and reads it back:
//! - `buffered`: `write` through the page cache and one `fsync` (a `dd`-style
//!   copy), then the pages dropped (`POSIX_FADV_DONTNEED`) and read back;
//! - `direct`: a plain `O_DIRECT` loop, one `pwrite`/`pread` at a time;
//! - `zswap-io_uring`, `zswap-threads`: the [`Swapper`] of a job with these
//!   `aio` settings, `in_flight` transfers outstanding (a job's `buffer_count`).
//!
//! Each transfer's first 8 bytes carry its offset and are checked on the way
//! back, so a read that moved nothing cannot pass for a fast one.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::buf::{round_up, AlignedBuf};
use crate::dir::SwapDir;
use crate::error::SwapError;
use crate::swapper::{AioConfig, IoHandle, IoPath, SwapFile, Swapper};

/// What to measure.
#[derive(Debug, Clone)]
pub struct IoBenchConfig {
    /// Directory to write in (a job's `nvme_path`).
    pub dir: PathBuf,
    /// Transfer sizes in bytes (rounded up to whole 4 KiB blocks).
    pub sizes: Vec<usize>,
    /// Bytes each method writes and reads per size.
    pub total: u64,
    /// The swapper's settings.
    pub aio: AioConfig,
    /// Swapper transfers outstanding.
    pub in_flight: usize,
}

/// One measurement.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct IoBenchRow {
    /// `buffered`, `direct`, `zswap-io_uring` or `zswap-threads`.
    pub method: String,
    /// `write` or `read`.
    pub op: &'static str,
    /// Bytes per transfer.
    pub size: usize,
    /// Bytes moved.
    pub bytes: u64,
    /// Seconds taken.
    pub seconds: f64,
    /// Bytes moved per second, in GB (1e9).
    pub gb_per_s: f64,
    /// Against `direct` at the same size and op.
    pub vs_direct: f64,
}

/// An I/O path the benchmark could not run, and why.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Skipped {
    /// The method.
    pub method: String,
    /// Why.
    pub reason: String,
}

/// Runs every method at every size; `progress` sees each row as it is measured.
pub fn run(
    cfg: &IoBenchConfig,
    mut progress: impl FnMut(&IoBenchRow),
) -> Result<(Vec<IoBenchRow>, Vec<Skipped>), SwapError> {
    let dir = SwapDir::create(&cfg.dir, &format!("bench-io-{}", std::process::id()), 0)?;
    let mut swappers = Vec::new();
    let mut skipped = Vec::new();
    for path in [IoPath::Uring, IoPath::Threads] {
        match Swapper::new(cfg.aio, Some(path)) {
            Ok(s) => swappers.push(s),
            Err(e) => skipped.push(Skipped {
                method: format!("zswap-{}", path.name()),
                reason: e.to_string(),
            }),
        }
    }
    let mut rows = Vec::new();
    for &size in &cfg.sizes {
        let size = round_up(size.max(1));
        let count = cfg.total.div_ceil(size as u64).max(1) as usize;
        let bytes = (count * size) as u64;
        let mut measured: Vec<(String, [f64; 2])> = Vec::new();
        let file = dir.path().join("buffered.bin");
        measured.push(("buffered".into(), buffered(&file, size, count)?));
        let _ = std::fs::remove_file(&file);
        let file = dir.file("direct.swp", bytes)?;
        measured.push(("direct".into(), direct(&file, size, count)?));
        for s in &swappers {
            let file = dir.file("zswap.swp", bytes)?;
            let secs = swapped(s, &file, size, count, cfg.in_flight.max(1))?;
            measured.push((format!("zswap-{}", s.path().name()), secs));
        }
        let direct_secs = measured[1].1;
        for (method, secs) in measured {
            for (k, op) in ["write", "read"].into_iter().enumerate() {
                let row = IoBenchRow {
                    method: method.clone(),
                    op,
                    size,
                    bytes,
                    seconds: secs[k],
                    gb_per_s: bytes as f64 / secs[k] / 1e9,
                    vs_direct: direct_secs[k] / secs[k],
                };
                progress(&row);
                rows.push(row);
            }
        }
    }
    Ok((rows, skipped))
}

fn err<'a>(path: &'a Path, op: &'static str) -> impl Fn(std::io::Error) -> SwapError + 'a {
    move |source| SwapError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Stamps transfer `i`'s buffer with its offset.
fn stamp(buf: &mut [u8], offset: u64) {
    buf[..8].copy_from_slice(&offset.to_le_bytes());
}

/// Checks the stamp of the transfer read back from `offset`.
fn check(buf: &[u8], offset: u64, path: &Path) -> Result<(), SwapError> {
    let got = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
    if got != offset {
        return Err(err(path, "read")(std::io::Error::other(format!(
            "bytes at offset {offset} came back stamped {got}"
        ))));
    }
    Ok(())
}

/// [write seconds, read seconds] through the page cache.
fn buffered(path: &Path, size: usize, count: usize) -> Result<[f64; 2], SwapError> {
    let mut buf = vec![0u8; size];
    let t = Instant::now();
    let mut f = File::create(path).map_err(err(path, "write"))?;
    for i in 0..count {
        stamp(&mut buf, (i * size) as u64);
        f.write_all(&buf).map_err(err(path, "write"))?;
    }
    f.sync_all().map_err(err(path, "write"))?;
    let write = t.elapsed().as_secs_f64();
    drop(f);
    let mut f = File::open(path).map_err(err(path, "read"))?;
    // The pages are clean after the fsync, so this empties the cache of them.
    // SAFETY: a plain syscall on a descriptor this function owns.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    let t = Instant::now();
    for i in 0..count {
        f.read_exact(&mut buf).map_err(err(path, "read"))?;
        check(&buf, (i * size) as u64, path)?;
    }
    Ok([write, t.elapsed().as_secs_f64()])
}

/// [write seconds, read seconds] of a plain `O_DIRECT` loop, one transfer at
/// a time.
/// The file is opened and sized as the swapper's are ([`SwapDir::file`]).
fn direct(file: &SwapFile, size: usize, count: usize) -> Result<[f64; 2], SwapError> {
    let (f, path) = (&file.file, file.path());
    let mut buf = AlignedBuf::zeroed(size);
    let t = Instant::now();
    for i in 0..count {
        let at = (i * size) as u64;
        stamp(buf.bytes_mut(), at);
        f.write_all_at(buf.bytes(), at)
            .map_err(err(path, "write"))?;
    }
    f.sync_all().map_err(err(path, "write"))?;
    let write = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for i in 0..count {
        let at = (i * size) as u64;
        f.read_exact_at(buf.bytes_mut(), at)
            .map_err(err(path, "read"))?;
        check(buf.bytes(), at, path)?;
    }
    Ok([write, t.elapsed().as_secs_f64()])
}

/// [write seconds, read seconds] through `swapper`, `in_flight` transfers
/// outstanding.
fn swapped(
    swapper: &Swapper,
    file: &SwapFile,
    size: usize,
    count: usize,
    in_flight: usize,
) -> Result<[f64; 2], SwapError> {
    let mut spare: Vec<AlignedBuf> = (0..in_flight.min(count))
        .map(|_| AlignedBuf::zeroed(size))
        .collect();
    let mut secs = [0.0; 2];
    for (k, writing) in [true, false].into_iter().enumerate() {
        let t = Instant::now();
        let mut pending: std::collections::VecDeque<(u64, IoHandle)> = Default::default();
        for i in 0..count {
            let at = (i * size) as u64;
            let mut buf = match spare.pop() {
                Some(b) => b,
                None => {
                    let (was, h) = pending.pop_front().expect("transfers in flight");
                    let b = h.wait()?;
                    if !writing {
                        check(b.bytes(), was, file.path())?;
                    }
                    b
                }
            };
            if writing {
                stamp(buf.bytes_mut(), at);
                pending.push_back((at, swapper.write(file, at, buf)));
            } else {
                pending.push_back((at, swapper.read(file, at, buf)));
            }
        }
        for (was, h) in pending {
            let b = h.wait()?;
            if !writing {
                check(b.bytes(), was, file.path())?;
            }
            spare.push(b);
        }
        if writing {
            // As the other methods do: the bytes are on the device before the clock stops.
            file.sync()?;
        }
        secs[k] = t.elapsed().as_secs_f64();
    }
    Ok(secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_method_moves_and_checks_every_byte_and_leaves_nothing() {
        let t = tempfile::tempdir().unwrap();
        let cfg = IoBenchConfig {
            dir: t.path().to_path_buf(),
            sizes: vec![4096, 100_000],
            total: 1 << 20,
            aio: AioConfig {
                block_size: 64 << 10,
                queue_depth: 8,
                thread_count: 2,
            },
            in_flight: 3,
        };
        let mut seen = 0;
        let (rows, skipped) = run(&cfg, |_| seen += 1).unwrap();
        let methods = 4 - skipped.len();
        assert_eq!(rows.len(), 2 * 2 * methods);
        assert_eq!(seen, rows.len());
        for r in &rows {
            assert_eq!(r.size % 4096, 0);
            assert!(r.bytes >= 1 << 20 && r.gb_per_s > 0.0, "{r:?}");
            if r.method == "direct" {
                assert_eq!(r.vs_direct, 1.0);
            }
        }
        for s in &skipped {
            println!("SKIPPED {}: {}", s.method, s.reason);
        }
        assert_eq!(std::fs::read_dir(t.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_wrong_stamp_is_an_error_naming_the_file() {
        let e = check(&[0u8; 8], 4096, Path::new("/x/y.bin")).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("/x/y.bin") && text.contains("offset 4096"),
            "{text}"
        );
    }
}
