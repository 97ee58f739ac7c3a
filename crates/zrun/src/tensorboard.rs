//! The run's metrics as TensorBoard scalars (`tensorboard: DIR` in the job,
//! or a DeepSpeed config's `tensorboard` section): what DeepSpeed's and
//! Hugging Face's users watch a run in, beside `metrics.jsonl`, which stays
//! the record.
//!
//! An event file is a sequence of TFRecords, each a serialized `Event`
//! protocol buffer: the first says the file's version, each later one holds
//! a step's scalars as `Summary` values. A record is its length (u64, little
//! endian), the masked CRC-32C of those 8 bytes, the data, and the masked
//! CRC-32C of the data. The three messages are written with prost's derive
//! (only the fields zrun sets), so no `.proto` compiler is needed to build.
//!
//! Every zrun run writes a file of its own, named as TensorBoard expects
//! (`events.out.tfevents.SECONDS.HOST.PID.zrun`) and never overwriting one;
//! a resumed run adds another file, which TensorBoard reads as the same
//! run's continuation. A resumed or restarted run first writes TensorBoard's
//! restart event (`SessionLog` START) at the first step it will run again:
//! TensorBoard then drops the steps from there on that an earlier attempt
//! wrote (it reads a directory's files as one stream), as it does for
//! TensorFlow's own restarts, and shows the new attempt's in their place.
//! Each step's record goes to the file as it is made (one `write`,
//! no buffering), so TensorBoard shows a run live. A failed write (a full disk)
//! stops the TensorBoard file with a warning, not the training:
//! `metrics.jsonl` holds the same figures.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use prost::Message;

use crate::metrics::StepLine;

/// TensorBoard's `Event`: when, which step, and what.
#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    what: Option<What>,
}

/// What an [`Event`] holds (of TensorBoard's kinds, the two zrun writes).
#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    /// The first record's: the format's version.
    #[prost(string, tag = "3")]
    FileVersion(String),
    /// A step's scalars.
    #[prost(message, tag = "5")]
    Summary(Summary),
    /// A restart: TensorBoard drops what it has from this event's step on.
    #[prost(message, tag = "7")]
    SessionLog(SessionLog),
}

/// TensorBoard's `SessionLog`, of which zrun writes START alone.
#[derive(Clone, PartialEq, Message)]
struct SessionLog {
    /// `SessionLog.SessionStatus`: START is 1.
    #[prost(int32, tag = "1")]
    status: i32,
}

/// `SessionLog.SessionStatus.START`.
const START: i32 = 1;

/// TensorBoard's `Summary`: named values.
#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// TensorBoard's `Summary.Value` holding a scalar (`simple_value`, which
/// TensorBoard's scalar dashboard reads; written even where it is 0).
#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// One TFRecord around `data`.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// Seconds since the Unix epoch, an event's `wall_time`.
fn now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// TFRecord's masked CRC-32C (Castagnoli) of `data`: rotated right by 15
/// bits and offset, so that a CRC of data holding CRCs stays well mixed.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Refuses (exit 2) a `tensorboard` directory that cannot be one: the path,
/// or the nearest part of it that exists, is not a directory. What
/// `zrun check` and `zrun train` check before launch; the directory is made
/// at the run's start.
pub fn check_dir(spec: &zconfig::spec::JobSpec) -> Result<()> {
    match &spec.tensorboard {
        Some(dir) => crate::monitor::can_be_a_directory("tensorboard", dir),
        None => Ok(()),
    }
}

/// A run's event file, written step by step.
pub struct EventFile {
    path: PathBuf,
    /// None once a write failed (warned about once).
    file: Option<File>,
}

impl EventFile {
    /// Creates `dir` if need be and a new event file in it, with the
    /// version record.
    pub fn create(dir: &Path) -> Result<EventFile> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("tensorboard: creating {}", dir.display()))?;
        let now = now_s();
        // TensorBoard reads a directory's files in the order of their names,
        // and a restart event purges only what was read before it: this
        // file's name sorts after every event file already there, its
        // seconds (ten digits, zero-padded) past theirs where the clock has
        // not moved on (a resume within the second of the run before).
        let newest = std::fs::read_dir(dir)
            .with_context(|| format!("tensorboard: reading {}", dir.display()))?
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                let rest = name.strip_prefix("events.out.tfevents.")?;
                rest.split('.').next()?.parse::<u64>().ok()
            })
            .max();
        let secs = match newest {
            Some(n) if n >= now as u64 => n + 1,
            _ => now as u64,
        };
        let (host, pid) = (crate::pernode::hostname(), std::process::id());
        // A name taken already (a copied directory) gets a suffix.
        let mut n = 0;
        let (path, file) = loop {
            let suffix = if n == 0 {
                String::new()
            } else {
                format!(".{n}")
            };
            let name = format!("events.out.tfevents.{secs:010}.{host}.{pid}.zrun{suffix}");
            let path = dir.join(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(f) => break (path, f),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => n += 1,
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("tensorboard: creating {}", path.display()))
                }
            }
        };
        let mut events = EventFile {
            path,
            file: Some(file),
        };
        let version = Event {
            wall_time: now,
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        };
        events
            .write(&version)
            .with_context(|| events.path.display().to_string())?;
        Ok(events)
    }

    /// TensorBoard's restart event at `step`, the first step the run will
    /// write again (after `--resume` or a restart from a checkpoint).
    pub fn restart_at(&mut self, step: u64) {
        let event = Event {
            wall_time: now_s(),
            step: step as i64,
            what: Some(What::SessionLog(SessionLog { status: START })),
        };
        self.write_or_warn(&event, step);
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A step's scalars, written to the file. A failed write is warned
    /// about and ends the file (the run goes on).
    pub fn step(&mut self, line: &StepLine) {
        let event = Event {
            wall_time: now_s(),
            step: line.step as i64,
            what: Some(What::Summary(Summary {
                value: line
                    .scalars()
                    .into_iter()
                    .map(|(tag, v)| SummaryValue {
                        tag: tag.into(),
                        simple_value: Some(v as f32),
                    })
                    .collect(),
            })),
        };
        self.write_or_warn(&event, line.step);
    }

    /// Writes `event` (of step `step`); a failure is warned about and ends
    /// the file.
    fn write_or_warn(&mut self, event: &Event, step: u64) {
        if self.file.is_some() {
            if let Err(e) = self.write(event) {
                shout!(
                    "zrun: warning: tensorboard: writing {}: {e}; its records before step {step} are kept, later steps only in metrics.jsonl",
                    self.path.display(),
                );
                self.file = None;
            }
        }
    }

    fn write(&mut self, event: &Event) -> std::io::Result<()> {
        let Some(f) = self.file.as_mut() else {
            return Ok(());
        };
        // One write a record, so that a record is never split by a
        // failure after part of it.
        f.write_all(&record(&event.encode_to_vec()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_and_its_mask_are_tfrecords() {
        // CRC-32C's check value, and the mask TensorFlow's crc32c.h defines
        // (`((crc >> 15) | (crc << 17)) + 0xa282ead8`) worked out apart.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
    }

    #[test]
    fn an_event_is_the_protocol_buffer_tensorboard_reads() {
        // Encoded by hand from TensorFlow's event.proto and summary.proto:
        // wall_time (1, double), step (2, varint), summary (5, message) of
        // one value: tag (1, string) and simple_value (2, float), even 0.
        let event = Event {
            wall_time: 1.5,
            step: 300,
            what: Some(What::Summary(Summary {
                value: vec![SummaryValue {
                    tag: "a".into(),
                    simple_value: Some(0.0),
                }],
            })),
        };
        let mut want = vec![0x09];
        want.extend_from_slice(&1.5f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 0xac, 0x02]); // 300 as a varint
        want.extend_from_slice(&[0x2a, 10, 0x0a, 8, 0x0a, 1, b'a', 0x15]);
        want.extend_from_slice(&0f32.to_le_bytes());
        assert_eq!(event.encode_to_vec(), want);
        let version = Event {
            wall_time: 0.0,
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        };
        let mut want = vec![0x1a, 13];
        want.extend_from_slice(b"brain.Event:2");
        assert_eq!(version.encode_to_vec(), want);
        // session_log (7, message) of status (1, enum) START = 1.
        let restart = Event {
            wall_time: 0.0,
            step: 5,
            what: Some(What::SessionLog(SessionLog { status: START })),
        };
        assert_eq!(restart.encode_to_vec(), [0x10, 5, 0x3a, 2, 0x08, 1]);
    }

    #[test]
    fn a_record_frames_its_data_with_length_and_checksums() {
        let data = b"some event";
        let r = record(data);
        assert_eq!(r.len(), 8 + 4 + data.len() + 4);
        assert_eq!(u64::from_le_bytes(r[..8].try_into().unwrap()), 10);
        let len_crc = u32::from_le_bytes(r[8..12].try_into().unwrap());
        assert_eq!(len_crc, masked_crc(&r[..8]));
        assert_eq!(&r[12..22], data);
        assert_eq!(
            u32::from_le_bytes(r[22..].try_into().unwrap()),
            masked_crc(data)
        );
    }

    /// A write that fails (here: a file opened read-only, as a full disk
    /// would refuse it) ends the event file without failing the caller,
    /// and later records are dropped rather than written after a gap.
    #[test]
    fn a_failed_write_ends_the_file_not_the_run() {
        let dir = tempfile::tempdir().unwrap();
        let events = EventFile::create(dir.path()).unwrap();
        let path = events.path().to_path_buf();
        let before = std::fs::read(&path).unwrap();
        let mut events = EventFile {
            path: path.clone(),
            file: Some(File::open(&path).unwrap()),
        };
        events.restart_at(3);
        assert!(
            events.file.is_none(),
            "the file is given up after the failure"
        );
        events.restart_at(4);
        assert_eq!(
            std::fs::read(&path).unwrap(),
            before,
            "nothing half-written"
        );
    }

    #[test]
    fn a_path_through_a_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "x").unwrap();
        let spec = |tb: &Path| {
            let mut s: zconfig::spec::JobSpec = serde_json::from_value(serde_json::json!({
                "model": {"vocab_size": 256, "d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 8},
                "data": {"path": "x"}
            }))
            .unwrap();
            s.tensorboard = Some(tb.display().to_string());
            s
        };
        for bad in [file.clone(), file.join("tb")] {
            let e = check_dir(&spec(&bad)).unwrap_err().to_string();
            assert!(e.contains("is not a directory"), "{e}");
        }
        check_dir(&spec(&dir.path().join("new/tb"))).unwrap();
    }

    #[test]
    fn each_file_is_new_and_never_replaces_another() {
        let dir = tempfile::tempdir().unwrap();
        let a = EventFile::create(&dir.path().join("tb")).unwrap();
        let b = EventFile::create(&dir.path().join("tb")).unwrap();
        // Within the same second and process: a later name, which
        // TensorBoard reads after the first.
        assert!(b.path() > a.path(), "{:?} then {:?}", a.path(), b.path());
        for f in [a.path(), b.path()] {
            let name = f.file_name().unwrap().to_string_lossy().into_owned();
            assert!(name.starts_with("events.out.tfevents."), "{name}");
            // The version record: 8 + 4 + (9 + 15) + 4 bytes.
            assert_eq!(std::fs::metadata(f).unwrap().len(), 40);
        }
    }
}
