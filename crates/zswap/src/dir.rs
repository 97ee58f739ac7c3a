//! Swap directories: `nvme_path/<job-id>/rank-N/`, one per worker, each held
//! under an advisory lock (`flock` on `rank-N/.lock`) for the worker's life.
//!
//! The lock is what tells a live job from a dead one: the kernel drops it when
//! the worker exits however it exits (SIGKILL included), so the next job on the
//! same path removes every rank directory whose lock it can take, and never one
//! whose lock is held. A worker removes its own directory when it ends; zrun
//! removes the job's directory once its local workers are gone.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::buf::{AlignedBuf, ALIGN};
use crate::error::SwapError;
use crate::swapper::SwapFile;

const LOCK: &str = ".lock";

/// One worker's swap directory; removed with its files when dropped.
pub struct SwapDir {
    path: PathBuf,
    job_dir: PathBuf,
    _lock: File,
}

fn dir_err(path: &Path, problem: impl Into<String>) -> SwapError {
    SwapError::Dir {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

/// Takes `f`'s exclusive lock without blocking; false if another process holds it.
fn try_lock(f: &File) -> bool {
    // SAFETY: flock on a descriptor this File owns; no memory is passed.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

impl SwapDir {
    /// Creates and locks `root/<job_id>/rank-<rank>/`, first removing the
    /// directories that dead jobs left under `root`.
    pub fn create(root: &Path, job_id: &str, rank: usize) -> Result<SwapDir, SwapError> {
        let removed = remove_stale(root, job_id);
        if !removed.is_empty() {
            tracing::info!(
                "removed {} swap director{} left by jobs that are gone",
                removed.len(),
                if removed.len() == 1 { "y" } else { "ies" }
            );
        }
        if job_id.is_empty() || job_id.contains(['/', '\0']) || job_id.starts_with('.') {
            return Err(SwapError::Config(format!(
                "`{job_id}` cannot name a swap directory"
            )));
        }
        let job_dir = root.join(job_id);
        let path = job_dir.join(format!("rank-{rank}"));
        // Built under a name the cleaner of another starting rank ignores, locked,
        // and only then renamed into place: a `rank-N` directory is never seen
        // unlocked while its worker lives. (A cleaner may still remove a
        // half-built one whose lock it won the race for: then build again.)
        let mut last = String::new();
        for attempt in 0..5 {
            let tmp = job_dir.join(format!(".rank-{rank}.{}.{attempt}", std::process::id()));
            match build_locked(&tmp, &path) {
                Ok(lock) => {
                    return Ok(SwapDir {
                        path,
                        job_dir,
                        _lock: lock,
                    })
                }
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&tmp);
                    last = e;
                }
            }
        }
        Err(dir_err(&path, last))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates (or truncates) swap file `name` of `bytes` bytes (sparse until
    /// written), opened for `O_DIRECT`.
    pub fn file(&self, name: &str, bytes: u64) -> Result<SwapFile, SwapError> {
        let path = self.path.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .map_err(|e| dir_err(&path, format!("cannot open for O_DIRECT: {e}")))?;
        file.set_len(bytes.div_ceil(ALIGN as u64) * ALIGN as u64)
            .map_err(|e| dir_err(&path, e.to_string()))?;
        Ok(SwapFile::new(file, path))
    }
}

impl Drop for SwapDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
        // Succeeds only once the job's last rank here is gone.
        let _ = std::fs::remove_dir(&self.job_dir);
    }
}

/// Creates `tmp` with a held lock file inside and renames it to `path`.
fn build_locked(tmp: &Path, path: &Path) -> Result<File, String> {
    fn at<'a>(what: &'a str, p: &'a Path) -> impl Fn(std::io::Error) -> String + 'a {
        move |e| format!("{what} {}: {e}", p.display())
    }
    std::fs::create_dir_all(tmp).map_err(at("cannot create", tmp))?;
    let lock_path = tmp.join(LOCK);
    let lock = File::create(&lock_path).map_err(at("cannot create", &lock_path))?;
    if !try_lock(&lock) {
        return Err(format!(
            "{} is locked by another live process",
            lock_path.display()
        ));
    }
    std::fs::rename(tmp, path).map_err(at("cannot rename into place", tmp))?;
    Ok(lock)
}

/// Removes the rank directories under `root/*/` whose lock nobody holds
/// (their worker is gone), and job directories left empty, except job
/// `keep`'s (the caller's own: its ranks start together and never clean each
/// other up). Returns what it removed.
pub fn remove_stale(root: &Path, keep: &str) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(jobs) = std::fs::read_dir(root) else {
        return removed;
    };
    for job in jobs.flatten() {
        if job.file_name() == keep {
            continue;
        }
        let job_dir = job.path();
        let Ok(ranks) = std::fs::read_dir(&job_dir) else {
            continue;
        };
        for rank in ranks.flatten() {
            let dir = rank.path();
            let is_rank = dir
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("rank-") || n.starts_with(".rank-"));
            let Ok(lock) = File::open(dir.join(LOCK)) else {
                continue;
            };
            if is_rank && try_lock(&lock) && std::fs::remove_dir_all(&dir).is_ok() {
                removed.push(dir);
            }
        }
        let _ = std::fs::remove_dir(&job_dir);
    }
    removed
}

/// Removes job `job_id`'s swap directory under `root` (zrun, once the job's
/// workers on this machine are gone). Live ranks' directories are left alone.
pub fn remove_job(root: &Path, job_id: &str) {
    let job_dir = root.join(job_id);
    let Ok(ranks) = std::fs::read_dir(&job_dir) else {
        return;
    };
    for rank in ranks.flatten() {
        let dir = rank.path();
        match File::open(dir.join(LOCK)) {
            Ok(lock) if !try_lock(&lock) => continue,
            _ => {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
    let _ = std::fs::remove_dir(&job_dir);
}

/// What [`check_dir`] learned about a usable swap directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirInfo {
    /// Bytes free for an unprivileged writer.
    pub free_bytes: u64,
    /// The filesystem's name (`ext4`, `xfs`, `tmpfs`...).
    pub filesystem: String,
    /// Whether the filesystem lives in memory (offloading there saves no memory).
    pub in_memory: bool,
}

/// Checks that `path` is an existing, writable directory on a filesystem that
/// takes `O_DIRECT` reads and writes (by writing and reading back one block).
pub fn check_dir(path: &Path) -> Result<DirInfo, String> {
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "does not exist".to_string(),
        _ => e.to_string(),
    })?;
    if !meta.is_dir() {
        return Err("is not a directory".into());
    }
    let (filesystem, in_memory) = filesystem_of(path);
    let probe = path.join(format!(".zrun-probe-{}", std::process::id()));
    let result = probe_direct(&probe).map_err(|e| match e.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => {
            format!("is not writable: {e}")
        }
        Some(libc::EINVAL) => format!("its filesystem ({filesystem}) refuses O_DIRECT"),
        _ => format!("an O_DIRECT write and read of one block failed: {e}"),
    });
    let _ = std::fs::remove_file(&probe);
    result?;
    Ok(DirInfo {
        free_bytes: free_bytes(path).map_err(|e| format!("cannot read free space: {e}"))?,
        filesystem,
        in_memory,
    })
}

fn probe_direct(probe: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(probe)?;
    let mut buf = AlignedBuf::zeroed(ALIGN);
    buf.bytes_mut()[..4].copy_from_slice(b"zrun");
    f.write_all_at(buf.bytes(), 0)?;
    let mut back = AlignedBuf::zeroed(ALIGN);
    f.read_exact_at(back.bytes_mut(), 0)?;
    if back.bytes() != buf.bytes() {
        return Err(std::io::Error::other("read back different bytes"));
    }
    Ok(())
}

/// Free bytes for an unprivileged writer under `path`.
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: statvfs is plain old data; zeroed is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// The filesystem's name, from the longest mount point containing `path`.
fn filesystem_of(path: &Path) -> (String, bool) {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let best = mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, point, fs) = (f.next()?, f.next()?, f.next()?);
            path.starts_with(point)
                .then(|| (point.len(), fs.to_string()))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, fs)| fs)
        .unwrap_or_else(|| "unknown".into());
    let in_memory = matches!(best.as_str(), "tmpfs" | "ramfs");
    (best, in_memory)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_dir_names_what_is_wrong() {
        let t = tempfile::tempdir().unwrap();
        let info = check_dir(t.path()).unwrap();
        assert!(info.free_bytes > 0);
        assert!(!info.filesystem.is_empty());
        assert_eq!(
            check_dir(&t.path().join("nope")).unwrap_err(),
            "does not exist"
        );
        let file = t.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(check_dir(&file).unwrap_err(), "is not a directory");
        assert!(
            std::fs::read_dir(t.path()).unwrap().count() == 1,
            "the probe file is removed"
        );
    }

    #[test]
    fn a_dead_jobs_directory_is_removed_and_a_live_ones_kept() {
        let t = tempfile::tempdir().unwrap();
        let live = SwapDir::create(t.path(), "live", 0).unwrap();
        live.file("m.swp", 8192).unwrap();
        // A dead job: its directory and lock file exist, nobody holds the lock.
        let dead = t.path().join("dead/rank-3");
        std::fs::create_dir_all(&dead).unwrap();
        std::fs::write(dead.join(LOCK), b"").unwrap();
        std::fs::write(dead.join("m.swp"), b"old").unwrap();
        // Not ours: no lock file.
        let other = t.path().join("other/data");
        std::fs::create_dir_all(&other).unwrap();

        let again = SwapDir::create(t.path(), "next", 1).unwrap();
        assert!(!t.path().join("dead").exists(), "dead job removed");
        assert!(live.path().join("m.swp").exists(), "live job untouched");
        assert!(
            other.exists(),
            "a directory without our lock is not touched"
        );
        remove_job(t.path(), "live");
        assert!(live.path().exists(), "a held rank is not removed");
        let live_path = live.path().to_path_buf();
        drop(live);
        assert!(!live_path.exists() && !t.path().join("live").exists());
        drop(again);
        assert!(!t.path().join("next").exists());
    }

    /// zrun's cleanup after a job: the ranks nobody holds go, a held one stays.
    #[test]
    fn remove_job_removes_the_ranks_nobody_holds() {
        let t = tempfile::tempdir().unwrap();
        let held = SwapDir::create(t.path(), "job", 0).unwrap();
        let gone = t.path().join("job/rank-1");
        std::fs::create_dir_all(&gone).unwrap();
        std::fs::write(gone.join(LOCK), b"").unwrap();
        std::fs::write(gone.join("m.swp"), b"old").unwrap();
        remove_job(t.path(), "job");
        assert!(!gone.exists(), "an unheld rank's directory is removed");
        assert!(held.path().join(LOCK).exists(), "a held rank's is kept");
    }

    #[test]
    fn names_that_cannot_be_a_directory_are_refused_and_files_are_whole_blocks() {
        let t = tempfile::tempdir().unwrap();
        for bad in ["", "a/b", ".hidden", "nul\0"] {
            let err = SwapDir::create(t.path(), bad, 0)
                .err()
                .map(|e| e.to_string());
            assert!(
                err.as_deref()
                    .is_some_and(|e| e.contains("cannot name a swap directory")),
                "{bad:?}: {err:?}"
            );
        }
        let dir = SwapDir::create(t.path(), "job", 0).unwrap();
        let file = dir.file("odd.swp", 5000).unwrap();
        assert_eq!(std::fs::metadata(file.path()).unwrap().len(), 8192);
    }

    /// Free bytes and the filesystem's kind, against `statfs`, a call the
    /// code does not make.
    #[test]
    fn free_bytes_and_the_filesystem_agree_with_statfs() {
        let statfs = |p: &Path| {
            use std::os::unix::ffi::OsStrExt;
            let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
            // SAFETY: statfs is plain old data; zeroed is a valid value.
            let mut st: libc::statfs = unsafe { std::mem::zeroed() };
            // SAFETY: a NUL-terminated path and a valid out-pointer.
            assert_eq!(unsafe { libc::statfs(c.as_ptr(), &mut st) }, 0);
            st
        };
        let t = tempfile::tempdir().unwrap();
        let st = statfs(t.path());
        let want = st.f_bavail as u64 * st.f_bsize as u64;
        let got = free_bytes(t.path()).unwrap();
        // Other writers move it between the two calls: within 1%, or 64 MiB
        // on a nearly full disk.
        assert!(
            got.abs_diff(want) <= (want / 100).max(64 << 20),
            "free_bytes {got}, statfs {want}"
        );
        const TMPFS_MAGIC: i64 = 0x0102_1994;
        let shm = Path::new("/dev/shm");
        // `f_type`'s integer type differs between targets.
        #[allow(clippy::unnecessary_cast)]
        let tmpfs = shm.is_dir() && statfs(shm).f_type as i64 == TMPFS_MAGIC;
        if tmpfs {
            assert_eq!(filesystem_of(shm), ("tmpfs".to_string(), true));
        } else {
            println!("skipped the tmpfs case: /dev/shm is not a tmpfs here");
        }
        assert!(!filesystem_of(t.path()).0.is_empty());
    }
}
