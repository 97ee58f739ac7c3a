//! Where a job's reports go: metrics and progress for training, rows for the
//! benchmarks. The supervisor hands every report here and knows nothing of
//! what is done with it.

use anyhow::Result;
use std::path::PathBuf;

use zconfig::spec::FlopsProfilerSpec;
use zproto::{BenchRow, FlopsProfile, KernelRow, MemBytes, StepReport};

use crate::comms::CommsLog;
use crate::metrics::Aggregator;
use crate::monitor::Monitor;
use crate::progress::Progress;
use crate::rundir::MetricsWriter;

/// Where reports go.
#[allow(clippy::large_enum_variant)] // one per job: its size does not matter
pub enum Sink {
    /// Training: metrics and progress.
    Train {
        /// Per-step aggregation.
        agg: Aggregator,
        /// metrics.jsonl.
        writer: MetricsWriter,
        /// TensorBoard's event file and CSV files, as the job asks.
        monitors: Vec<Box<dyn Monitor>>,
        /// Progress display.
        progress: Progress,
        /// Loss of the newest complete step.
        last_loss: f64,
        /// Memory maxima over the steps so far.
        peak: MemBytes,
        /// Steps expected.
        steps: u64,
        /// `flops_profiler`: its settings and the file the profile goes to.
        profile: Option<(FlopsProfilerSpec, PathBuf)>,
        /// `comms_logger`: every rank's collectives so far.
        comms: Option<CommsLog>,
    },
    /// `bench comm`: rows from rank 0.
    Bench {
        /// Collected rows.
        rows: Vec<BenchRow>,
    },
    /// `bench kernels`: rows from the one worker.
    Kernels {
        /// Collected rows.
        rows: Vec<KernelRow>,
    },
}

impl Sink {
    /// A rank's step report: a metrics line and progress once every rank's
    /// report of the step is in.
    pub fn report(&mut self, rank: usize, mut report: StepReport) -> Result<()> {
        if let Sink::Train {
            agg,
            writer,
            monitors,
            progress,
            last_loss,
            peak,
            comms,
            ..
        } = self
        {
            if let (Some(log), Some(records)) = (comms.as_mut(), report.comms.take()) {
                log.add(rank, report.step, records);
            }
            if let Some(line) = agg.add(rank, report) {
                writer.write(&line)?;
                for m in monitors.iter_mut() {
                    m.step(&line);
                }
                *last_loss = line.loss;
                *peak = peak.max(line.mem_bytes);
                progress.step(&line);
            }
        }
        Ok(())
    }

    /// Rank 0's `flops_profiler` profile: written to its file, its summary
    /// printed.
    pub fn profile(&mut self, p: FlopsProfile) -> Result<()> {
        if let Sink::Train {
            progress,
            profile: Some((spec, path)),
            ..
        } = self
        {
            crate::profile::write(&p, spec, path)?;
            let summary = crate::profile::summary(&p, spec);
            progress.println(&format!("zrun: {}", summary.trim_end()));
            progress.println(&format!("zrun: the profile is in {}", path.display()));
        }
        Ok(())
    }

    /// Rows of `bench kernels`.
    pub fn kernel_rows(&mut self, rows: Vec<KernelRow>) {
        if let Sink::Kernels { rows: all } = self {
            all.extend(rows);
        }
    }

    /// Rows of `bench comm`.
    pub fn bench_rows(&mut self, rows: Vec<BenchRow>) {
        if let Sink::Bench { rows: all } = self {
            all.extend(rows);
        }
    }

    /// Prints a worker's output line.
    pub fn println(&self, line: &str, stderr: bool) {
        match self {
            Sink::Train { progress, .. } => progress.println(line),
            Sink::Bench { .. } | Sink::Kernels { .. } if stderr => shout!("{line}"),
            Sink::Bench { .. } | Sink::Kernels { .. } => say!("{line}"),
        }
    }
}
