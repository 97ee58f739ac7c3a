//! `--enable-each-rank-log DIR` (DeepSpeed's `--enable_each_rank_log`):
//! each worker's output, stdout and stderr together, in a file of its own,
//! `DIR/{launch time}_rank{R}.log` as DeepSpeed names them, instead of on
//! the console, where a large job's ranks would drown zrun's own lines.
//! Every launcher's worker lines reach zrun (pipes, SSH channels, `srun
//! --label`, `mpirun --tag-output`, per-node relays), so all of a job's
//! files are where zrun runs. Each launch (a restart is one) names its
//! files by its own time.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::Failure;

/// The open files of a run's ranks.
#[derive(Debug)]
pub struct RankLogs {
    dir: PathBuf,
    /// The launch's local time, `20261207221500`.
    started: String,
    files: HashMap<usize, File>,
}

impl RankLogs {
    /// Logs in `dir`, made if missing: bad input (exit 2) where it is a
    /// file or cannot be made or written.
    pub fn open(dir: &Path) -> Result<RankLogs> {
        let bad = |why: String| {
            Failure::bad_input(format!("--enable-each-rank-log {}: {why}", dir.display()))
        };
        if dir.is_file() {
            return Err(bad("is a file; it must be a directory".into()));
        }
        std::fs::create_dir_all(dir).map_err(|e| bad(format!("cannot be made: {e}")))?;
        let probe = tempfile::NamedTempFile::new_in(dir);
        probe.map_err(|e| bad(format!("cannot be written: {e}")))?;
        Ok(RankLogs {
            dir: dir.to_path_buf(),
            started: chrono::Local::now().format("%Y%m%d%H%M%S").to_string(),
            files: HashMap::new(),
        })
    }

    /// Rank `rank`'s file.
    pub fn path(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("{}_rank{rank}.log", self.started))
    }

    /// Appends a line of rank `rank`'s output to its file.
    pub fn write(&mut self, rank: usize, line: &str) -> std::io::Result<()> {
        let file = match self.files.get_mut(&rank) {
            Some(f) => f,
            None => {
                let f = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.path(rank))?;
                self.files.entry(rank).or_insert(f)
            }
        };
        writeln!(file, "{line}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_appends_to_its_own_file_and_a_file_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let mut logs = RankLogs::open(&d.path().join("logs")).unwrap();
        logs.write(1, "one").unwrap();
        logs.write(0, "zero").unwrap();
        logs.write(1, "two").unwrap();
        assert_eq!(std::fs::read_to_string(logs.path(1)).unwrap(), "one\ntwo\n");
        assert_eq!(std::fs::read_to_string(logs.path(0)).unwrap(), "zero\n");
        let name = logs
            .path(0)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(
            name.len() == "20261207221500_rank0.log".len() && name.ends_with("_rank0.log"),
            "{name}"
        );
        let file = d.path().join("f");
        std::fs::write(&file, "").unwrap();
        let e = RankLogs::open(&file).unwrap_err();
        assert!(format!("{e:#}").contains("is a file"), "{e:#}");
    }
}
