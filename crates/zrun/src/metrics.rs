//! Per-rank step reports → one `metrics.jsonl` line per step (docs/CONFIG.md).
//!
//! A step's line is written when every rank has reported it. Loss is the mean of
//! the ranks' losses (each the mean over equally sized micro-batches, so this is
//! the global batch's loss); throughput divides all ranks' tokens and FLOPs by
//! the slowest rank's step time; memory and bytes are the maximum over ranks.

use std::collections::BTreeMap;

use serde::Serialize;
use zproto::{CommBytes, LayerDrop, MemBytes, StepReport, StepTimesMs, TrustRatios};

/// One `metrics.jsonl` line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepLine {
    /// Step (1-based).
    pub step: u64,
    /// Passes over the training data after the step (fractional).
    pub epoch: f64,
    /// Mean loss over ranks.
    pub loss: f64,
    /// Learning rate.
    pub lr: f64,
    /// Slowest rank's step time.
    pub step_ms: f64,
    /// Whole-job tokens per second.
    pub tokens_per_s: f64,
    /// Whole-job model TFLOP/s.
    pub tflops: f64,
    /// Ranks.
    pub world_size: usize,
    /// ZeRO stage.
    pub zero_stage: u8,
    /// Model parameters.
    pub params: u64,
    /// Maximum over ranks, per category.
    pub mem_bytes: MemBytes,
    /// Maximum over ranks.
    pub comm_bytes: CommBytes,
    /// Where the slowest rank's step went.
    pub time_ms: TimeLine,
    /// f16 loss scale.
    pub loss_scale: Option<f64>,
    /// Global gradient norm (null on a step f16 skipped for overflow).
    pub grad_norm: Option<f64>,
    /// NVMe offload: swap I/O, the maximum over ranks (`hidden`: the least).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io: Option<IoLine>,
    /// Validation loss after the step, on the steps that computed one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// LAMB: the smallest, mean and largest of the step's trust ratios.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trust_ratio: Option<TrustRatios>,
    /// `train.curriculum`: the tokens of each sequence the step trained on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<usize>,
    /// `train.progressive_layer_drop`: θ of the step and the blocks its
    /// micro-batches ran, on average.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layer_drop: Option<LayerDrop>,
}

/// The scalars a run is watched by, beside `metrics.jsonl` (TensorBoard's
/// tags, the CSV monitor's files), in [`StepLine::scalars`]' order: those
/// from the gradient norm on, on the steps that have them.
pub const SCALAR_TAGS: [&str; 16] = [
    "train/loss",
    "train/lr",
    "train/epoch",
    "perf/tokens_per_s",
    "perf/step_ms",
    "perf/tflops",
    "memory/peak_rss_gib",
    "train/grad_norm",
    "train/loss_scale",
    "eval/loss",
    "train/trust_ratio_min",
    "train/trust_ratio_mean",
    "train/trust_ratio_max",
    "train/seq_len",
    "train/pld_theta",
    "train/blocks_run",
];

impl StepLine {
    /// The line's [`SCALAR_TAGS`] and their values, those it has.
    pub fn scalars(&self) -> Vec<(&'static str, f64)> {
        let values = [
            Some(self.loss),
            Some(self.lr),
            Some(self.epoch),
            Some(self.tokens_per_s),
            Some(self.step_ms),
            Some(self.tflops),
            Some(self.mem_bytes.peak_rss as f64 / 1024f64.powi(3)),
            self.grad_norm,
            self.loss_scale,
            self.val_loss,
            self.trust_ratio.map(|r| r.min),
            self.trust_ratio.map(|r| r.mean),
            self.trust_ratio.map(|r| r.max),
            self.seq_len.map(|t| t as f64),
            self.layer_drop.map(|l| l.theta),
            self.layer_drop.map(|l| l.blocks_run),
        ];
        SCALAR_TAGS
            .into_iter()
            .zip(values)
            .filter_map(|(tag, v)| Some((tag, v?)))
            .collect()
    }
}

/// A step's time by phase in `metrics.jsonl`: the slowest rank's (its
/// phases add up to the line's `step_ms`; the others waited for it inside
/// their collectives).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TimeLine {
    /// The slowest rank.
    pub rank: usize,
    /// Its phases.
    #[serde(flatten)]
    pub phases: StepTimesMs,
}

/// A step's swap I/O in `metrics.jsonl`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct IoLine {
    /// Bytes read by the rank that read most.
    pub read_bytes: u64,
    /// Bytes written by the rank that wrote most.
    pub write_bytes: u64,
    /// Longest wait for I/O of any rank, seconds.
    pub wait_s: f64,
    /// Longest busy time of any rank's I/O, seconds.
    pub busy_s: f64,
    /// The smallest share of its I/O time that a rank did not wait for.
    pub hidden: f64,
}

/// The last line of a finished run.
#[derive(Debug, Clone, Serialize)]
pub struct DoneLine {
    /// Always `done`.
    pub event: &'static str,
    /// Steps run.
    pub steps: u64,
    /// Loss of the last step.
    pub final_loss: f64,
    /// Wall time of the whole run.
    pub wall_s: f64,
    /// The largest peak resident set (VmHWM) of any worker.
    pub peak_rss_bytes: u64,
    /// NVMe offload: the largest swap footprint of any worker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvme_bytes: Option<u64>,
}

/// Collects reports until a step is complete.
pub struct Aggregator {
    world: usize,
    pending: BTreeMap<u64, Vec<Option<StepReport>>>,
}

impl Aggregator {
    /// For `world` ranks.
    pub fn new(world: usize) -> Aggregator {
        Aggregator {
            world,
            pending: BTreeMap::new(),
        }
    }

    /// Adds one rank's report; returns the step's line once all ranks reported.
    pub fn add(&mut self, rank: usize, r: StepReport) -> Option<StepLine> {
        let step = r.step;
        let slots = self
            .pending
            .entry(step)
            .or_insert_with(|| vec![None; self.world]);
        slots[rank] = Some(r);
        if slots.iter().any(Option::is_none) {
            return None;
        }
        let reports: Vec<StepReport> = self.pending.remove(&step)?.into_iter().flatten().collect();
        Some(combine(&reports))
    }
}

fn combine(rs: &[StepReport]) -> StepLine {
    let n = rs.len() as f64;
    let (slowest, step_ms) = rs
        .iter()
        .map(|r| r.step_ms)
        .enumerate()
        .fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a });
    let secs = (step_ms / 1e3).max(1e-9);
    let tokens: u64 = rs.iter().map(|r| r.tokens).sum();
    let flops: f64 = rs.iter().map(|r| r.flops).sum();
    StepLine {
        step: rs[0].step,
        epoch: rs[0].epoch,
        loss: rs.iter().map(|r| r.loss).sum::<f64>() / n,
        lr: rs[0].lr,
        step_ms,
        tokens_per_s: tokens as f64 / secs,
        tflops: flops / secs / 1e12,
        world_size: rs.len(),
        zero_stage: rs[0].zero_stage,
        params: rs[0].params,
        mem_bytes: rs.iter().fold(MemBytes::default(), |m, r| m.max(r.mem)),
        comm_bytes: rs.iter().fold(CommBytes::default(), |m, r| m.max(r.comm)),
        time_ms: TimeLine {
            rank: slowest,
            phases: rs[slowest].times,
        },
        loss_scale: rs[0].loss_scale,
        grad_norm: rs[0].grad_norm,
        io: combine_io(rs),
        val_loss: rs[0].val_loss,
        trust_ratio: rs[0].trust_ratio,
        seq_len: rs[0].seq_len,
        layer_drop: rs[0].layer_drop,
    }
}

fn combine_io(rs: &[StepReport]) -> Option<IoLine> {
    let ios: Vec<_> = rs.iter().filter_map(|r| r.io).collect();
    (!ios.is_empty()).then(|| IoLine {
        read_bytes: ios.iter().map(|i| i.read_bytes).max().unwrap_or(0),
        write_bytes: ios.iter().map(|i| i.write_bytes).max().unwrap_or(0),
        wait_s: ios.iter().map(|i| i.wait_s).fold(0.0, f64::max),
        busy_s: ios.iter().map(|i| i.busy_s).fold(0.0, f64::max),
        hidden: ios.iter().map(|i| i.hidden()).fold(1.0, f64::min),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A one-rank job's metrics line of `step` (loss 1, no validation).
    pub(crate) fn a_step_line(step: u64) -> StepLine {
        Aggregator::new(1)
            .add(0, report(step, 1.0, 1.0, 1 << 30))
            .expect("one rank's report is the step's")
    }

    fn report(step: u64, loss: f64, ms: f64, rss: u64) -> StepReport {
        StepReport {
            step,
            epoch: step as f64 / 100.0,
            loss,
            lr: 1e-3,
            grad_norm: Some(0.5),
            step_ms: ms,
            tokens: 1000,
            flops: 1e9,
            params: 42,
            zero_stage: 0,
            mem: MemBytes {
                peak_rss: rss,
                ..Default::default()
            },
            comm: CommBytes::default(),
            times: StepTimesMs {
                forward: ms / 4.0,
                ..Default::default()
            },
            loss_scale: None,
            io: None,
            val_loss: None,
            seq_len: None,
            layer_drop: None,
            comms: None,
            trust_ratio: None,
        }
    }

    #[test]
    fn io_takes_the_worst_rank_and_is_absent_without_offload() {
        let mut a = Aggregator::new(2);
        a.add(0, report(1, 1.0, 1.0, 1));
        let plain = a.add(1, report(1, 1.0, 1.0, 1)).unwrap();
        assert!(plain.io.is_none());
        let json = serde_json::to_value(&plain).unwrap();
        assert!(json.get("io").is_none() && json["mem_bytes"].get("nvme").is_none());
        let with = |read, wait_s, busy_s| StepReport {
            io: Some(zproto::IoReport {
                read_bytes: read,
                write_bytes: 2 * read,
                wait_s,
                busy_s,
            }),
            ..report(2, 1.0, 1.0, 1)
        };
        a.add(0, with(10, 0.5, 1.0));
        let line = a.add(1, with(30, 0.1, 2.0)).unwrap();
        let io = line.io.unwrap();
        assert_eq!((io.read_bytes, io.write_bytes), (30, 60));
        assert_eq!((io.wait_s, io.busy_s), (0.5, 2.0));
        assert_eq!(io.hidden, 0.5, "rank 0 hid only half of its I/O");
    }

    #[test]
    fn a_step_is_written_once_every_rank_reported() {
        let mut a = Aggregator::new(2);
        assert!(a.add(0, report(1, 2.0, 100.0, 5)).is_none());
        assert!(a.add(0, report(2, 1.0, 100.0, 5)).is_none());
        let line = a.add(1, report(1, 4.0, 200.0, 9)).unwrap();
        assert_eq!(
            (line.loss, line.step_ms, line.mem_bytes.peak_rss),
            (3.0, 200.0, 9)
        );
        assert!((line.tokens_per_s - 10_000.0).abs() < 1e-9);
        assert!((line.tflops - 0.01).abs() < 1e-12);
        assert_eq!(line.time_ms.rank, 1, "the phases are the slowest rank's");
        assert_eq!(line.time_ms.phases.forward, 50.0);
        let json = serde_json::to_value(&line).unwrap();
        for key in [
            "step",
            "loss",
            "lr",
            "step_ms",
            "tokens_per_s",
            "tflops",
            "world_size",
            "zero_stage",
            "params",
            "mem_bytes",
            "comm_bytes",
            "loss_scale",
            "grad_norm",
        ] {
            assert!(json.get(key).is_some(), "{key} missing");
        }
        assert!(json["comm_bytes"]["by_op"].get("all_reduce").is_some());
        assert_eq!(json["time_ms"]["rank"], 1);
        assert_eq!(json["time_ms"]["forward"], 50.0);
        assert!(json["time_ms"]["comm_wait_by_op"]
            .get("all_gather")
            .is_some());
        assert!(json["mem_bytes"].get("offload_buffers").is_some());
    }
}
