//! Per-rank step reports → one `metrics.jsonl` line per step (docs/CONFIG.md).
//!
//! A step's line is written when every rank has reported it. Loss is the mean of
//! the ranks' losses (each the mean over equally sized micro-batches, so this is
//! the global batch's loss); throughput divides all ranks' tokens and FLOPs by
//! the slowest rank's step time; memory and bytes are the maximum over ranks.

use std::collections::BTreeMap;

use serde::Serialize;
use zproto::{CommBytes, MemBytes, StepReport};

/// One `metrics.jsonl` line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepLine {
    /// Step (1-based).
    pub step: u64,
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
    /// f16 loss scale.
    pub loss_scale: Option<f64>,
    /// Global gradient norm (null on a step f16 skipped for overflow).
    pub grad_norm: Option<f64>,
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
    let step_ms = rs.iter().map(|r| r.step_ms).fold(0.0, f64::max);
    let secs = (step_ms / 1e3).max(1e-9);
    let tokens: u64 = rs.iter().map(|r| r.tokens).sum();
    let flops: f64 = rs.iter().map(|r| r.flops).sum();
    StepLine {
        step: rs[0].step,
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
        loss_scale: rs[0].loss_scale,
        grad_norm: rs[0].grad_norm,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(step: u64, loss: f64, ms: f64, rss: u64) -> StepReport {
        StepReport {
            step,
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
            loss_scale: None,
        }
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
        assert!(json["mem_bytes"].get("offload_buffers").is_some());
    }
}
