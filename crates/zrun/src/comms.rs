//! `comms_logger`: every rank's collectives over the run, tallied by group,
//! operation and size (`zproto::CommRecord`, sent with each step's report),
//! as a table like DeepSpeed's `log_summary`: count, time, bandwidth.
//!
//! A collective's time runs on a rank's communication thread from its start
//! to its end, so it includes waiting for the ranks that arrive later. A row
//! shows the rank whose total was least, the last to arrive, whose time is
//! the closest to the transfer itself; how much longer the rank with the
//! largest total spent in the same collectives is the wait for the others
//! (DeepSpeed's "straggler effect", which it finds the same way, call by call).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Result;
use zconfig::spec::{CommsLoggerSpec, COMM_OPS};
use zproto::CommRecord;

/// One rank's collectives of one kind and size.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Tally {
    count: u64,
    total_us: f64,
    max_us: f64,
}

/// What sorts and tells apart the rows: group, its ranks, the operation's
/// place in [`COMM_OPS`], its name, the buffer's bytes.
type Key = (String, u64, usize, String, u64);

/// The run's collectives, rank by rank, and the file they go to.
#[derive(Debug)]
pub struct CommsLog {
    path: PathBuf,
    /// Whether a file of an earlier run at `path` has been set aside.
    kept_earlier: bool,
    rows: BTreeMap<Key, BTreeMap<usize, Tally>>,
    /// The first and last steps whose reports came in.
    steps: Option<(u64, u64)>,
}

/// Where the table goes.
pub fn path(spec: &CommsLoggerSpec, run_dir: &Path) -> PathBuf {
    match &spec.output_file {
        Some(f) => PathBuf::from(f),
        None => run_dir.join("comms_log.txt"),
    }
}

impl CommsLog {
    /// An empty log that [`CommsLog::write`] puts at `path`.
    pub fn new(path: PathBuf) -> CommsLog {
        CommsLog {
            path,
            kept_earlier: false,
            rows: BTreeMap::new(),
            steps: None,
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Rank `rank`'s collectives reported with step `step`.
    pub fn add(&mut self, rank: usize, step: u64, records: Vec<CommRecord>) {
        self.steps = Some(match self.steps {
            Some((first, last)) => (first.min(step), last.max(step)),
            None => (step, step),
        });
        for r in records {
            let place = COMM_OPS
                .iter()
                .position(|o| *o == r.op)
                .unwrap_or(usize::MAX);
            let key = (r.group, r.ranks, place, r.op, r.bytes);
            let t = self
                .rows
                .entry(key)
                .or_default()
                .entry(rank)
                .or_insert(Tally {
                    count: 0,
                    total_us: 0.0,
                    max_us: 0.0,
                });
            t.count += r.count;
            t.total_us += r.total_us;
            t.max_us = t.max_us.max(r.max_us);
        }
    }

    /// The table.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let steps = match self.steps {
            Some((a, b)) if a == b => format!("step {a}"),
            Some((a, b)) => format!("steps {a}-{b}"),
            None => "no step".into(),
        };
        let _ = writeln!(
            out,
            "zrun comms log: the collectives of {steps} (those before a step counted with it)"
        );
        out.push_str(concat!(
            "Each is timed on a rank's communication thread from its start to its end, waiting\n",
            "for later ranks included. A row is the rank whose total was least (the last to\n",
            "arrive: the transfer itself); `waited` is how much longer the rank with the largest\n",
            "total spent in them. Bytes: the collective's buffer (the all-reduce's, the\n",
            "reduce-scatter's input, the all-gather's output); bandwidth in GB/s (1e9 bytes),\n",
            "bus bandwidth by nccl-tests' factors.\n",
        ));
        if self.rows.is_empty() {
            out.push_str("\nNo collective ran.\n");
            return out;
        }
        let mut group = None;
        for ((g, ranks, _, op, bytes), by_rank) in &self.rows {
            if group != Some((g, ranks)) {
                group = Some((g, ranks));
                let _ = writeln!(out, "\ngroup {g}, {ranks} ranks");
                let _ = writeln!(
                    out,
                    "{:<26}{:>14}{:>8}{:>12}{:>10}{:>10}{:>12}{:>12}{:>18}",
                    "op",
                    "bytes",
                    "count",
                    "total ms",
                    "avg ms",
                    "max ms",
                    "algbw GB/s",
                    "busbw GB/s",
                    "waited ms (rank)"
                );
            }
            let least = by_rank
                .values()
                .min_by(|a, b| a.total_us.total_cmp(&b.total_us))
                .expect("a row has a rank");
            let (most_rank, most) = by_rank
                .iter()
                .max_by(|a, b| a.1.total_us.total_cmp(&b.1.total_us))
                .expect("a row has a rank");
            let secs = least.total_us / 1e6;
            let algbw = match secs > 0.0 {
                true => (*bytes * least.count) as f64 / secs / 1e9,
                false => 0.0,
            };
            let factor = zproto::Op::from_name(op).map_or(1.0, |o| o.bus_factor(*ranks as usize));
            let _ = writeln!(
                out,
                "{op:<26}{:>14}{:>8}{:>12.2}{:>10.3}{:>10.3}{:>12.3}{:>12.3}{:>12.2} ({most_rank})",
                size(*bytes),
                least.count,
                least.total_us / 1e3,
                least.total_us / 1e3 / least.count.max(1) as f64,
                least.max_us / 1e3,
                algbw,
                algbw * factor,
                (most.total_us - least.total_us) / 1e3,
            );
        }
        out
    }

    /// Writes the table to its file: the first time, a file there from an
    /// earlier run is kept as `comms_log.N.txt`; after that it is replaced.
    pub fn write(&mut self) -> Result<()> {
        crate::rundir::write_whole(&self.path, &self.table(), !self.kept_earlier)?;
        self.kept_earlier = true;
        Ok(())
    }
}

/// Bytes with thousands separated: `793,088`.
fn size(bytes: u64) -> String {
    let digits = bytes.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(op: &str, bytes: u64, count: u64, total_us: f64) -> CommRecord {
        CommRecord {
            group: "world".into(),
            ranks: 2,
            op: op.into(),
            bytes,
            count,
            total_us,
            min_us: total_us / count as f64 / 2.0,
            max_us: total_us / count as f64 * 2.0,
        }
    }

    /// The row's fields after its op, split on runs of spaces.
    fn row<'a>(table: &'a str, op: &str, bytes: &str) -> Vec<&'a str> {
        let line = table
            .lines()
            .find(|l| l.starts_with(op) && l.split_whitespace().nth(1) == Some(bytes))
            .unwrap_or_else(|| panic!("no row {op} {bytes} in\n{table}"));
        line.split_whitespace().skip(2).collect()
    }

    /// Steps add up per rank; a row is the rank of the least total, with
    /// its bandwidth (2 ranks: the all-reduce's bus factor 1, the
    /// all-gather's 1/2) and the largest total's excess, naming its rank;
    /// rows come in the collectives' order, then by size.
    #[test]
    fn a_row_is_the_least_waiting_rank_and_the_others_excess() {
        let mut log = CommsLog::new(PathBuf::from("unused"));
        for step in [1, 2] {
            // 1 MB all-gathers: rank 0 spends 4 ms a step, rank 1 1 ms.
            log.add(0, step, vec![record("all_gather", 1_000_000, 2, 4_000.0)]);
            log.add(1, step, vec![record("all_gather", 1_000_000, 2, 1_000.0)]);
        }
        log.add(1, 3, vec![record("all_reduce", 4_000, 5, 50.0)]);
        let t = log.table();
        assert!(
            t.starts_with("zrun comms log: the collectives of steps 1-3"),
            "{t}"
        );
        // 4 gathers of 1 MB in 2 ms: 2 GB/s, busbw 1 GB/s; rank 0 spent 6 ms more.
        assert_eq!(
            row(&t, "all_gather", "1,000,000"),
            ["4", "2.00", "0.500", "1.000", "2.000", "1.000", "6.00", "(0)"]
        );
        assert_eq!(
            row(&t, "all_reduce", "4,000"),
            ["5", "0.05", "0.010", "0.020", "0.400", "0.400", "0.00", "(1)"]
        );
        assert!(t.find("all_reduce ").unwrap() < t.find("all_gather ").unwrap());
        assert_eq!(t.matches("group world, 2 ranks").count(), 1);
    }

    #[test]
    fn an_empty_log_says_so_and_sizes_read_in_thousands() {
        let t = CommsLog::new(PathBuf::from("unused")).table();
        assert!(
            t.contains("of no step") && t.ends_with("No collective ran.\n"),
            "{t}"
        );
        assert_eq!(
            [0, 999, 1000, 793_088, 12_345_678].map(size),
            ["0", "999", "1,000", "793,088", "12,345,678"]
        );
    }

    /// The first write keeps an earlier run's file as `comms_log.1.txt`;
    /// later writes of the same run replace their own.
    #[test]
    fn the_first_write_keeps_an_earlier_runs_file() {
        let d = tempfile::tempdir().unwrap();
        let at = d.path().join("comms_log.txt");
        std::fs::write(&at, "earlier").unwrap();
        let mut log = CommsLog::new(at.clone());
        log.add(0, 1, vec![record("barrier", 0, 1, 5.0)]);
        log.write().unwrap();
        log.add(0, 2, vec![record("barrier", 0, 1, 5.0)]);
        log.write().unwrap();
        let kept = std::fs::read_to_string(d.path().join("comms_log.1.txt")).unwrap();
        assert_eq!(kept, "earlier");
        assert!(!d.path().join("comms_log.2.txt").exists());
        let now = std::fs::read_to_string(&at).unwrap();
        assert_eq!(row(&now, "barrier", "0")[0], "2", "{now}");
    }
}
