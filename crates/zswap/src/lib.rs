//! zswap: the far tier of ZeRO-Infinity. Model states that do not fit in memory
//! live in files on local NVMe, one directory per worker, moved in and out in
//! page-aligned buffers with `O_DIRECT` (no page cache: the memory saved stays
//! saved, and the disk's bandwidth is what is measured).
//!
//! Layout:
//! - [`buf`]: page-aligned buffers, the unit every transfer moves.
//! - [`swapper`]: asynchronous reads and writes that return handles, I/O
//!   accounting, and the choice between the two I/O paths.
//! - `uring`: the io_uring path; `threads`: the `pread`/`pwrite` pool used where
//!   io_uring is refused (container sandboxes often forbid it).
//! - [`dir`]: per-worker swap directories, cleanup of dead jobs' files, and the
//!   up-front checks of a swap path.
//! - [`error`]: why swapping failed.
//! - [`bench`](mod@bench): `zrun bench io`, the swapper against buffered and plain
//!   `O_DIRECT` transfers on the same directory.
//!
//! The design decision to know: the swapper moves whole buffers and knows nothing
//! of tensors. The engine lays its flat buffers out in the files at 4 KiB-aligned
//! offsets and splits its work so that no two transfers in flight share a block.

#![deny(missing_docs)]

pub mod bench;
pub mod buf;
pub mod dir;
pub mod error;
pub mod swapper;
mod threads;
mod uring;

pub use buf::{AlignedBuf, ALIGN};
pub use dir::{check_dir, remove_job, remove_stale, DirInfo, SwapDir};
pub use error::SwapError;
pub use swapper::{AioConfig, IoHandle, IoPath, IoStats, SwapFile, Swapper};

#[cfg(test)]
mod tests {
    use super::*;

    /// Both paths move many buffers of uneven piece counts concurrently, and
    /// every byte comes back as written.
    #[test]
    fn writes_read_back_exactly_on_both_paths() {
        let t = tempfile::tempdir().unwrap();
        for path in [IoPath::Uring, IoPath::Threads] {
            let cfg = AioConfig {
                block_size: 8192,
                queue_depth: 4,
                thread_count: 3,
            };
            let swapper = match Swapper::new(cfg, Some(path)) {
                Ok(s) => s,
                Err(e) => {
                    println!("SKIPPED the {} path: {e}", path.name());
                    continue;
                }
            };
            assert_eq!(swapper.path(), path);
            let dir = SwapDir::create(t.path(), "job", 0).unwrap();
            let sizes = [4096usize, 3 * 4096, 8192 * 5 + 4096, 1 << 20];
            let total: usize = sizes.iter().sum();
            let file = dir.file("x.swp", total as u64).unwrap();
            let mut offsets = Vec::new();
            let mut handles = Vec::new();
            let mut at = 0u64;
            for (i, &n) in sizes.iter().enumerate() {
                let mut b = AlignedBuf::zeroed(n);
                for (j, x) in b.bytes_mut().iter_mut().enumerate() {
                    *x = (j * 31 + i * 7 + 1) as u8;
                }
                offsets.push(at);
                handles.push(swapper.write(&file, at, b));
                at += n as u64;
            }
            for h in handles {
                h.wait().unwrap();
            }
            let reads: Vec<_> = sizes
                .iter()
                .zip(&offsets)
                .map(|(&n, &o)| swapper.read(&file, o, AlignedBuf::zeroed(n)))
                .collect();
            for (i, h) in reads.into_iter().enumerate() {
                let b = h.wait().unwrap();
                assert!(
                    b.bytes()
                        .iter()
                        .enumerate()
                        .all(|(j, &x)| x == (j * 31 + i * 7 + 1) as u8),
                    "{}: buffer {i} differs",
                    path.name()
                );
            }
            let st = swapper.stats();
            assert_eq!(st.read_bytes, total as u64);
            assert_eq!(st.write_bytes, total as u64);
            assert!(st.busy_s > 0.0 && (0.0..=1.0).contains(&st.hidden()));
        }
    }

    #[test]
    fn a_read_past_the_end_fails_naming_the_file() {
        let t = tempfile::tempdir().unwrap();
        let dir = SwapDir::create(t.path(), "job", 0).unwrap();
        let file = dir.file("short.swp", 4096).unwrap();
        for path in [IoPath::Uring, IoPath::Threads] {
            let Ok(swapper) = Swapper::new(AioConfig::default(), Some(path)) else {
                continue;
            };
            let err = swapper
                .read(&file, 8192, AlignedBuf::zeroed(4096))
                .wait()
                .unwrap_err();
            let text = err.to_string();
            assert!(
                text.contains("short.swp") && text.contains("read"),
                "{text}"
            );
        }
    }

    #[test]
    fn block_size_must_be_page_multiple() {
        let cfg = AioConfig {
            block_size: 1000,
            ..AioConfig::default()
        };
        let err = Swapper::new(cfg, None).err().unwrap().to_string();
        assert!(err.contains("aio.block_size"), "{err}");
    }
}
