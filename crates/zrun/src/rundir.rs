//! What zrun promises about the files of a run: nothing a user had is lost,
//! and two live jobs never write the same files.
//!
//! - A run holds a lock (a file with zrun's pid) beside its metrics file and in
//!   its checkpoint directory for as long as it runs. A second job that would
//!   write there is refused before launch (exit 2); the lock of a process that
//!   is gone (zrun was killed) is taken over. Taking the lock also proves,
//!   before launch, that the directory can be written. As it lets go of a
//!   checkpoint directory, the run removes the saves it left unfinished.
//! - The metrics file is opened at the first line, not before: a run that fails
//!   before its first step changes nothing. A fresh run keeps earlier history by
//!   renaming it to `metrics.N.jsonl` (the lowest free N) unless `--overwrite`;
//!   a resumed run appends, after a line naming the checkpoint it resumed from.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::Failure;

/// A held lock; removed when dropped.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
}

impl RunLock {
    /// Takes the lock `path` (creating its directory) for this process;
    /// `what` names what it guards in the refusal (`metrics`, `checkpoint.dir`).
    pub fn take(path: &Path, what: &str) -> Result<RunLock> {
        let shown = path.display();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                Failure::bad_input(format!("{what}: cannot create {}: {e}", dir.display()))
            })?;
        }
        for _ in 0..2 {
            match OpenOptions::new().write(true).create_new(true).open(path) {
                Ok(mut f) => {
                    writeln!(f, "{}", std::process::id())
                        .map_err(|e| Failure::bad_input(format!("{what}: {shown}: {e}")))?;
                    return Ok(RunLock {
                        path: path.to_path_buf(),
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let holder = std::fs::read_to_string(path)
                        .ok()
                        .and_then(|s| s.trim().parse::<i32>().ok());
                    if let Some(pid) = holder.filter(|&p| zrun_alive(p)) {
                        return Err(Failure::bad_input(format!(
                            "{what}: in use by a running job (zrun pid {pid}, lock {shown}); wait for it, or give this job another run_dir / checkpoint.dir"
                        )));
                    }
                    // A dead job's lock: take it over.
                    let _ = std::fs::remove_file(path);
                }
                Err(e) => {
                    return Err(Failure::bad_input(format!(
                        "{what}: cannot write {shown}: {e}"
                    )))
                }
            }
        }
        Err(Failure::bad_input(format!(
            "{what}: another job took {shown} at the same moment"
        )))
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A checkpoint directory's lock that, when the run ends (its workers gone),
/// removes the saves the run left unfinished (`step-*` directories without
/// a manifest): a worker stopped in the middle of writing (another rank's
/// save failed on a full disk, and zrun stopped the job) cannot remove its
/// own partial file, and such a save can never be resumed from; it would
/// only fill the disk further. The next run would remove them too
/// ([`zckpt::remove_unfinished`] as it takes the lock); this does it while
/// the lock is still held, before the user looks.
#[derive(Debug)]
pub struct CheckpointDirLock {
    dir: PathBuf,
    /// Dropped after the sweep.
    _lock: RunLock,
}

impl CheckpointDirLock {
    /// Takes checkpoint directory `dir`'s lock ([`RunLock::take`]).
    pub fn take(dir: &Path) -> Result<CheckpointDirLock> {
        Ok(CheckpointDirLock {
            _lock: RunLock::take(&checkpoint_lock(dir), "checkpoint.dir")?,
            dir: dir.to_path_buf(),
        })
    }
}

impl Drop for CheckpointDirLock {
    fn drop(&mut self) {
        match zckpt::remove_unfinished(&self.dir) {
            Ok(removed) => removed.iter().for_each(|p| {
                say!(
                    "zrun: removed {}, a save this run left unfinished",
                    p.display()
                )
            }),
            Err(e) => shout!("zrun: checkpoint.dir: could not remove an unfinished save: {e}"),
        }
    }
}

/// Whether `pid` is a live zrun process.
fn zrun_alive(pid: i32) -> bool {
    let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok();
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    alive && comm.trim() == "zrun"
}

/// Refuses a metrics path that is a directory: earlier history is renamed
/// aside, and a directory renamed aside (`--metrics runs/` → `runs.1/`)
/// would take everything in it along.
pub fn check_metrics_path(path: &Path) -> Result<()> {
    if path.is_dir() {
        return Err(Failure::bad_input(format!(
            "--metrics: {} is a directory; give a file in it (e.g. {})",
            path.display(),
            path.join("metrics.jsonl").display()
        )));
    }
    Ok(())
}

/// The lock beside a metrics file: `metrics.jsonl` → `metrics.jsonl.lock`.
pub fn metrics_lock(metrics: &Path) -> PathBuf {
    let mut name = metrics.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// The lock of a checkpoint directory.
pub fn checkpoint_lock(dir: &Path) -> PathBuf {
    dir.join(".zrun.lock")
}

/// How a run's metrics file starts.
#[derive(Debug, Clone, PartialEq)]
pub enum Start {
    /// A fresh run: earlier history is renamed aside, or replaced if `overwrite`.
    Fresh {
        /// `--overwrite`.
        overwrite: bool,
    },
    /// A resumed run: append after this marker line.
    Resume(ResumeLine),
}

/// The line a resumed run appends before its own.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResumeLine {
    /// Always `resume`.
    pub event: &'static str,
    /// The checkpoint directory.
    pub from: String,
    /// Its step.
    pub step: u64,
    /// Ranks of this run.
    pub world_size: usize,
}

/// metrics.jsonl, opened at the first line.
pub struct MetricsWriter {
    path: PathBuf,
    start: Start,
    file: Option<File>,
}

impl MetricsWriter {
    /// A writer for `path` that touches nothing until the first line.
    pub fn new(path: &Path, start: Start) -> MetricsWriter {
        MetricsWriter {
            path: path.to_path_buf(),
            start,
            file: None,
        }
    }

    /// Writes one line (opening the file first, see the module doc).
    pub fn write<T: Serialize>(&mut self, line: &T) -> Result<()> {
        if self.file.is_none() {
            self.file = Some(
                self.open()
                    .with_context(|| self.path.display().to_string())?,
            );
        }
        let mut s = serde_json::to_string(line)?;
        s.push('\n');
        let f = self.file.as_mut().context("metrics file")?;
        append_whole(f, s.as_bytes()).with_context(|| {
            format!(
                "writing {} (the lines before this one are kept)",
                self.path.display()
            )
        })
    }

    fn open(&self) -> std::io::Result<File> {
        // A regular file's lines; never a pipe or device (`/dev/stdout`),
        // which is written to as it is.
        let has_history = std::fs::metadata(&self.path).is_ok_and(|m| m.is_file() && m.len() > 0);
        match &self.start {
            Start::Resume(marker) => {
                let mut f = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.path)?;
                let mut s = serde_json::to_string(marker).map_err(std::io::Error::other)?;
                s.push('\n');
                append_whole(&mut f, s.as_bytes())?;
                Ok(f)
            }
            Start::Fresh { overwrite: false } if has_history => {
                std::fs::rename(&self.path, rotated(&self.path))?;
                File::create(&self.path)
            }
            Start::Fresh { .. } => File::create(&self.path),
        }
    }
}

/// Appends `line` to a file whole or not at all: a write cut short (a full
/// disk) is cut back off a regular file, so that every line of metrics.jsonl
/// stays one JSON value for whoever reads it.
fn append_whole(f: &mut File, line: &[u8]) -> std::io::Result<()> {
    let before = f.metadata().ok().filter(|m| m.is_file()).map(|m| m.len());
    let written = f.write_all(line).and_then(|()| f.flush());
    if let (Err(_), Some(len)) = (&written, before) {
        let _ = f.set_len(len);
    }
    written
}

/// Writes `text` to `path` through a temporary file, so that a reader
/// never sees half of it; with `keep_earlier`, a file already there is
/// first renamed to the lowest free `STEM.N.EXT` (as metrics files are).
pub fn write_whole(path: &Path, text: &str, keep_earlier: bool) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if keep_earlier && path.exists() {
        let old = rotated(path);
        std::fs::rename(path, &old).with_context(|| {
            format!("moving the earlier {} to {}", path.display(), old.display())
        })?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// The lowest free `STEM.N.EXT` beside `path` (`metrics.jsonl` → `metrics.1.jsonl`).
pub fn rotated(path: &Path) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = path
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    (1..)
        .map(|n| path.with_file_name(format!("{stem}.{n}{ext}")))
        .find(|p| !p.exists())
        .expect("some N is free")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_is_rotated_appended_or_replaced_never_lost() {
        let d = tempfile::tempdir().unwrap();
        let m = d.path().join("metrics.jsonl");
        std::fs::write(&m, "old\n").unwrap();
        // Nothing changes before the first line.
        drop(MetricsWriter::new(&m, Start::Fresh { overwrite: false }));
        assert_eq!(std::fs::read_to_string(&m).unwrap(), "old\n");
        let mut w = MetricsWriter::new(&m, Start::Fresh { overwrite: false });
        w.write(&1).unwrap();
        assert_eq!(std::fs::read_to_string(&m).unwrap(), "1\n");
        assert_eq!(
            std::fs::read_to_string(d.path().join("metrics.1.jsonl")).unwrap(),
            "old\n"
        );
        let marker = ResumeLine {
            event: "resume",
            from: "ck/step-00000001".into(),
            step: 1,
            world_size: 2,
        };
        let mut w = MetricsWriter::new(&m, Start::Resume(marker));
        w.write(&2).unwrap();
        let text = std::fs::read_to_string(&m).unwrap();
        assert!(text.starts_with("1\n{\"event\":\"resume\""), "{text}");
        assert!(text.ends_with("}\n2\n"), "{text}");
        let mut w = MetricsWriter::new(&m, Start::Fresh { overwrite: false });
        w.write(&3).unwrap();
        assert!(d.path().join("metrics.2.jsonl").exists());
        let mut w = MetricsWriter::new(&m, Start::Fresh { overwrite: true });
        w.write(&4).unwrap();
        assert_eq!(std::fs::read_to_string(&m).unwrap(), "4\n");
        assert!(!d.path().join("metrics.3.jsonl").exists());
    }

    /// A directory given as the metrics file is refused (it was renamed
    /// aside with all it held, `runs/` → `runs.1/`), and a device is written
    /// to as it is, never renamed.
    #[test]
    fn a_directory_is_no_metrics_file_and_a_device_is_not_renamed() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("kept"), "x").unwrap();
        let e = check_metrics_path(d.path()).unwrap_err().to_string();
        assert!(e.contains("is a directory; give a file in it"), "{e}");
        check_metrics_path(&d.path().join("metrics.jsonl")).unwrap();
        let null = Path::new("/dev/null");
        check_metrics_path(null).unwrap();
        let mut w = MetricsWriter::new(null, Start::Fresh { overwrite: false });
        w.write(&5).unwrap();
        assert!(!Path::new("/dev/null.1").exists());
    }

    #[test]
    fn a_live_lock_refuses_and_a_dead_one_is_taken_over() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sub/metrics.jsonl.lock");
        let held = RunLock::take(&p, "metrics").unwrap();
        // (A live holder must be a process named zrun: tests/e2e.rs starts two.)
        drop(held);
        assert!(!p.exists());
        std::fs::write(&p, "999999999\n").unwrap();
        let again = RunLock::take(&p, "metrics").unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap().trim(),
            std::process::id().to_string()
        );
        drop(again);
    }
}
