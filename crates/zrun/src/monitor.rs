//! Where a run's step scalars go beside `metrics.jsonl`, which stays the
//! record: TensorBoard's event files ([`crate::tensorboard`]) and CSV files
//! ([`crate::csv_monitor`]), as the job asks. Each takes a step's line as
//! it is made and, when a resumed or restarted run runs steps again, drops
//! what it holds of them; neither stops the run when it cannot write.

use std::path::Path;

use anyhow::Result;
use zconfig::spec::JobSpec;

use crate::csv_monitor::CsvFiles;
use crate::metrics::StepLine;
use crate::tensorboard::EventFile;
use crate::Failure;

/// A destination of the run's step scalars.
pub trait Monitor: Send {
    /// A step's scalars.
    fn step(&mut self, line: &StepLine);
    /// `step` is the first the run will write again (after `--resume` or a
    /// restart from a checkpoint): what it holds from there on goes.
    fn restart_at(&mut self, step: u64);
}

impl Monitor for EventFile {
    fn step(&mut self, line: &StepLine) {
        EventFile::step(self, line)
    }
    fn restart_at(&mut self, step: u64) {
        EventFile::restart_at(self, step)
    }
}

impl Monitor for CsvFiles {
    fn step(&mut self, line: &StepLine) {
        CsvFiles::step(self, line)
    }
    fn restart_at(&mut self, step: u64) {
        CsvFiles::restart_at(self, step)
    }
}

/// Refuses (exit 2), before launch, directories the monitors cannot use
/// (see [`crate::tensorboard::check_dir`], [`crate::csv_monitor::check_dir`]).
pub fn check(spec: &JobSpec, resuming: bool) -> Result<()> {
    crate::tensorboard::check_dir(spec)?;
    crate::csv_monitor::check_dir(spec, resuming)
}

/// Refuses (exit 2) job key `key`'s directory `dir` where it, or the
/// nearest part of its path that exists, is not a directory (it is made at
/// the run's start).
pub(crate) fn can_be_a_directory(key: &str, dir: &str) -> Result<()> {
    let existing = Path::new(dir).ancestors().find(|p| p.exists());
    match existing {
        Some(p) if !p.is_dir() => Err(Failure::bad_input(format!(
            "{key}: {dir}: {} is not a directory",
            p.display()
        ))),
        _ => Ok(()),
    }
}

/// The job's monitors, created, each announced through `say`.
pub fn open(spec: &JobSpec, say: impl Fn(&str)) -> Result<Vec<Box<dyn Monitor>>> {
    let bad = |e: anyhow::Error| Failure::bad_input(format!("{e:#}"));
    let mut monitors: Vec<Box<dyn Monitor>> = Vec::new();
    if let Some(dir) = &spec.tensorboard {
        let tb = EventFile::create(Path::new(dir)).map_err(bad)?;
        say(&format!(
            "zrun: TensorBoard scalars in {}",
            tb.path().display()
        ));
        monitors.push(Box::new(tb));
    }
    if let Some(dir) = &spec.csv_monitor {
        let csv = CsvFiles::create(Path::new(dir)).map_err(bad)?;
        say(&format!(
            "zrun: CSV scalars in {}, a file each",
            csv.dir().display()
        ));
        monitors.push(Box::new(csv));
    }
    Ok(monitors)
}
