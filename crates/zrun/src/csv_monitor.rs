//! The run's step scalars as CSV files (`csv_monitor: DIR` in the job, or a
//! DeepSpeed config's `csv_monitor` section), laid out as DeepSpeed's CSV
//! monitor lays them out: one file a scalar, named after its tag with `/`
//! as `_` (`train/loss` in `train_loss.csv`), a header `step,NAME` (the
//! tag's last part), then a line `step,value` a step. The tags and steps
//! are zrun's, as its TensorBoard files have them (DeepSpeed's own count
//! samples and say `Train/Samples/train_loss`). Values are written in
//! full (f64's shortest decimal that reads back to the same bits, as in
//! `metrics.jsonl`), each line with one `write` as the step is made.
//!
//! A fresh run refuses a directory that holds one of these files already
//! (its lines would mix with this run's); a resumed or restarted run drops
//! the lines from the step it runs again on (the file rewritten whole and
//! renamed over the old one), so each step is there once, as TensorBoard's
//! restart event makes it for the event files. A failed write stops the
//! CSV files with a warning, not the training: `metrics.jsonl` holds the
//! same figures.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::metrics::{StepLine, SCALAR_TAGS};

/// The file of scalar `tag` (`train/loss`: `train_loss.csv`).
fn file_name(tag: &str) -> String {
    format!("{}.csv", tag.replace('/', "_"))
}

/// Its header: `step` and the tag's last part.
fn header(tag: &str) -> String {
    let name = tag.rsplit('/').next().unwrap_or(tag);
    format!("step,{name}\n")
}

/// Refuses (exit 2) a `csv_monitor` directory that cannot be one (the
/// path, or the nearest part of it that exists, is not a directory) and,
/// unless the run resumes, one that holds a file of these scalars already.
/// What `zrun check` and `zrun train` check before launch.
pub fn check_dir(spec: &zconfig::spec::JobSpec, resuming: bool) -> Result<()> {
    let Some(dir) = &spec.csv_monitor else {
        return Ok(());
    };
    crate::monitor::can_be_a_directory("csv_monitor", dir)?;
    let held: Vec<String> = SCALAR_TAGS
        .iter()
        .map(|t| file_name(t))
        .filter(|f| Path::new(dir).join(f).exists())
        .collect();
    if !resuming && !held.is_empty() {
        return Err(crate::Failure::bad_input(format!(
            "csv_monitor: {dir} holds {} from an earlier run, which this run's steps would mix with: choose another directory, move them away, or --resume",
            held.join(", ")
        )));
    }
    Ok(())
}

/// A run's CSV files, written step by step.
pub struct CsvFiles {
    dir: PathBuf,
    /// The files opened so far, by tag.
    open: BTreeMap<&'static str, File>,
    /// Set once a write failed (warned about once).
    stopped: bool,
}

impl CsvFiles {
    /// Creates `dir` if need be; the files are made as their scalars come.
    pub fn create(dir: &Path) -> Result<CsvFiles> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("csv_monitor: creating {}", dir.display()))?;
        Ok(CsvFiles {
            dir: dir.to_path_buf(),
            open: BTreeMap::new(),
            stopped: false,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A step's scalars, a line added to each one's file.
    pub fn step(&mut self, line: &StepLine) {
        for (tag, value) in line.scalars() {
            let result = self.append(tag, &format!("{},{value}\n", line.step));
            self.stop_on_error(result, line.step);
        }
    }

    /// Drops every line of `step` and after from the files (the first step
    /// a resumed or restarted run runs again).
    pub fn restart_at(&mut self, step: u64) {
        self.open.clear();
        for tag in SCALAR_TAGS {
            let result = self.keep_before(tag, step);
            self.stop_on_error(result, step);
        }
    }

    fn append(&mut self, tag: &'static str, text: &str) -> std::io::Result<()> {
        if self.stopped {
            return Ok(());
        }
        if !self.open.contains_key(tag) {
            let path = self.dir.join(file_name(tag));
            let mut f = OpenOptions::new().append(true).create(true).open(&path)?;
            if f.metadata()?.len() == 0 {
                f.write_all(header(tag).as_bytes())?;
            }
            self.open.insert(tag, f);
        }
        self.open
            .get_mut(tag)
            .expect("opened above")
            .write_all(text.as_bytes())
    }

    /// Rewrites `tag`'s file, if there is one, without its lines of `step`
    /// and after: a new file renamed over it, so that a failure leaves the
    /// old one whole.
    fn keep_before(&self, tag: &str, step: u64) -> std::io::Result<()> {
        if self.stopped {
            return Ok(());
        }
        let path = self.dir.join(file_name(tag));
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        let before = |line: &str| {
            line.split(',')
                .next()
                .and_then(|s| s.parse::<u64>().ok())
                .is_none_or(|s| s < step)
        };
        let kept: String = text
            .split_inclusive('\n')
            .filter(|line| before(line))
            .collect();
        let tmp = self.dir.join(format!(".{}.tmp", file_name(tag)));
        std::fs::write(&tmp, kept)?;
        std::fs::rename(&tmp, &path)
    }

    fn stop_on_error(&mut self, result: std::io::Result<()>, step: u64) {
        if let Err(e) = result {
            shout!(
                "zrun: warning: csv_monitor: writing in {}: {e}; its lines before step {step} are kept, later steps only in metrics.jsonl",
                self.dir.display(),
            );
            self.stopped = true;
            self.open.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::tests::a_step_line;

    fn read(dir: &Path, name: &str) -> String {
        std::fs::read_to_string(dir.join(name)).unwrap()
    }

    /// DeepSpeed's layout: a file a tag, `/` as `_`, a header of `step` and
    /// the tag's last part, a line a step with the value in full; the
    /// scalars a step lacks (no validation) get no line.
    #[test]
    fn each_scalar_has_a_file_of_step_and_value_lines() {
        let d = tempfile::tempdir().unwrap();
        let mut csv = CsvFiles::create(&d.path().join("logs/job")).unwrap();
        let mut line = a_step_line(1);
        line.loss = 5.524098788504489;
        csv.step(&line);
        let mut line = a_step_line(2);
        line.loss = 0.1 + 0.2;
        line.val_loss = Some(4.25);
        csv.step(&line);
        let dir = csv.dir().to_path_buf();
        assert_eq!(
            read(&dir, "train_loss.csv"),
            "step,loss\n1,5.524098788504489\n2,0.30000000000000004\n"
        );
        assert_eq!(read(&dir, "eval_loss.csv"), "step,loss\n2,4.25\n");
        assert!(read(&dir, "perf_tokens_per_s.csv").starts_with("step,tokens_per_s\n1,"));
        assert!(!dir.join("train_loss_scale.csv").exists(), "f32: no scale");
    }

    /// A restart at step 3 drops the lines of steps 3 and on (a file whose
    /// scalar stops before keeps all of its lines), and the run's lines
    /// follow; a fresh run refuses the directory, a resumed one takes it.
    #[test]
    fn a_restart_drops_the_steps_it_runs_again() {
        let d = tempfile::tempdir().unwrap();
        let mut csv = CsvFiles::create(d.path()).unwrap();
        for step in 1..=4 {
            let mut line = a_step_line(step);
            line.loss = step as f64;
            line.val_loss = (step == 2).then_some(0.5);
            csv.step(&line);
        }
        csv.restart_at(3);
        let mut line = a_step_line(3);
        line.loss = 30.0;
        csv.step(&line);
        assert_eq!(
            read(d.path(), "train_loss.csv"),
            "step,loss\n1,1\n2,2\n3,30\n"
        );
        assert_eq!(read(d.path(), "eval_loss.csv"), "step,loss\n2,0.5\n");
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(names.is_empty(), "{names:?}");
        let job = |dir: &Path| -> zconfig::spec::JobSpec {
            format!(
                "model: {{}}\ndata: {{format: synthetic}}\ncsv_monitor: {}\n",
                dir.display()
            )
            .parse()
            .unwrap()
        };
        let e = check_dir(&job(d.path()), false).unwrap_err().to_string();
        assert!(
            e.contains("holds train_loss.csv, train_lr.csv, ") && e.contains("--resume"),
            "{e}"
        );
        check_dir(&job(d.path()), true).unwrap();
        check_dir(&job(&d.path().join("new")), false).unwrap();
        let e = check_dir(&job(&d.path().join("train_loss.csv/x")), true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not a directory"), "{e}");
    }

    /// A write that fails (a directory that went away, as a full disk
    /// would refuse one) stops the files without failing the caller.
    #[test]
    fn a_failed_write_stops_the_files_not_the_run() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("gone");
        let mut csv = CsvFiles::create(&dir).unwrap();
        std::fs::remove_dir(&dir).unwrap();
        csv.step(&a_step_line(1));
        assert!(csv.stopped);
        std::fs::create_dir(&dir).unwrap();
        csv.step(&a_step_line(2));
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    }
}
