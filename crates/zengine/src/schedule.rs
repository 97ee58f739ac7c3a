//! Learning-rate schedules: a linear or logarithmic warmup from
//! `warmup_start_lr` (0 unless set), then constant, linear or cosine decay
//! towards `min_lr` over the remaining steps, or warmup-stable-decay (the peak
//! until the last `decay_fraction` of the steps, then linear decay to
//! `min_lr`). DeepSpeed's `WarmupLR`, `WarmupDecayLR` and `WarmupCosineLR`
//! are these shapes (see zconfig's `deepspeed` import).

use zconfig::spec::{TrainSpec, WarmupType};
use zconfig::Schedule;

/// The learning rate of 1-based optimizer `step` under `t`'s schedule.
pub fn lr_at(step: u64, t: &TrainSpec) -> f64 {
    let (peak, warmup, total, floor) = (t.lr, t.warmup_steps, t.steps, t.min_lr);
    if step <= warmup && warmup > 0 {
        return warmup_lr(step, t);
    }
    // Decay runs from `start` to the last step. Progress is 0 on the first
    // step after `start` and below 1 on the last, so every step has a rate
    // above the floor.
    let start = match t.schedule {
        Schedule::Wsd => {
            let decay = ((t.decay_fraction * total as f64).ceil() as u64).max(1);
            total.saturating_sub(decay).max(warmup)
        }
        _ => warmup,
    };
    if step <= start {
        return peak;
    }
    let decay_steps = total.saturating_sub(start).max(1) as f64;
    let progress = ((step - start - 1) as f64 / decay_steps).min(1.0);
    match t.schedule {
        Schedule::Constant => peak,
        Schedule::Linear | Schedule::Wsd => floor + (peak - floor) * (1.0 - progress),
        Schedule::Cosine => {
            floor + (peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        }
    }
}

/// The rate of `step` (1..=warmup_steps) on the ramp to the peak.
fn warmup_lr(step: u64, t: &TrainSpec) -> f64 {
    let (start, peak, warmup) = (t.warmup_start_lr, t.lr, t.warmup_steps);
    let way = match t.warmup_type {
        // Written as before the start rate existed, so that runs from 0 keep
        // their bits.
        WarmupType::Linear if start == 0.0 => return peak * step as f64 / warmup as f64,
        WarmupType::Linear => step as f64 / warmup as f64,
        // ln(1) / ln(1) is no number: a one-step warmup is the peak.
        WarmupType::Log if warmup == 1 => 1.0,
        WarmupType::Log => (step as f64).ln() / (warmup as f64).ln(),
    };
    start + (peak - start) * way
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(steps: u64, lr: f64, warmup: u64, schedule: Schedule) -> TrainSpec {
        TrainSpec {
            steps,
            lr,
            warmup_steps: warmup,
            schedule,
            ..TrainSpec::default()
        }
    }

    /// DeepSpeed's ramps: log(s)/log(W) of the way from the start rate, or
    /// linearly from it; both reach the peak on step W.
    #[test]
    fn warmups_ramp_from_the_start_rate() {
        let mut t = spec(100, 1.0, 10, Schedule::Constant);
        t.warmup_start_lr = 0.1;
        assert!((lr_at(5, &t) - (0.1 + 0.9 * 0.5)).abs() < 1e-12);
        assert_eq!(lr_at(10, &t), 1.0);
        t.warmup_type = WarmupType::Log;
        assert_eq!(lr_at(1, &t), 0.1);
        let want = 0.1 + 0.9 * 5f64.ln() / 10f64.ln();
        assert!((lr_at(5, &t) - want).abs() < 1e-12);
        assert!((lr_at(10, &t) - 1.0).abs() < 1e-12);
        assert!((2..=10).all(|s| lr_at(s, &t) > lr_at(s - 1, &t)));
        t.warmup_steps = 1;
        assert_eq!(lr_at(1, &t), 1.0);
    }

    #[test]
    fn warmup_then_decay() {
        let cos = spec(110, 1.0, 10, Schedule::Cosine);
        let c = |s| lr_at(s, &cos);
        assert!((c(5) - 0.5).abs() < 1e-12);
        assert_eq!(c(10), 1.0);
        assert_eq!(c(11), 1.0);
        assert!((c(61) - 0.5).abs() < 1e-12);
        assert!(c(110) > 0.0 && c(110) < 1e-3);
        assert!((lr_at(61, &spec(110, 1.0, 10, Schedule::Linear)) - 0.5).abs() < 1e-12);
        assert_eq!(lr_at(100, &spec(110, 2.0, 10, Schedule::Constant)), 2.0);
        assert_eq!(lr_at(1, &spec(5, 2.0, 0, Schedule::Linear)), 2.0);
    }

    /// Today's formulas, written out: with `min_lr: 0` the decays give the
    /// same bits as before the floor existed (runs stay bit-identical).
    #[test]
    fn a_zero_floor_changes_no_bit() {
        for s in 1..=110u64 {
            let progress = (s.saturating_sub(11) as f64 / 100.0).min(1.0);
            let old_cos = 1.5 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
            let old_lin = 1.5 * (1.0 - progress);
            if s > 10 {
                assert_eq!(
                    lr_at(s, &spec(110, 1.5, 10, Schedule::Cosine)).to_bits(),
                    old_cos.to_bits()
                );
                assert_eq!(
                    lr_at(s, &spec(110, 1.5, 10, Schedule::Linear)).to_bits(),
                    old_lin.to_bits()
                );
            }
        }
    }

    #[test]
    fn decays_end_at_the_floor() {
        for schedule in [Schedule::Linear, Schedule::Cosine, Schedule::Wsd] {
            let mut t = spec(100, 1.0, 10, schedule);
            t.min_lr = 0.1;
            // The last step is one decay step short of the floor: wsd decays
            // over 20 steps, the others over 90.
            let last = lr_at(100, &t);
            let step = if schedule == Schedule::Wsd {
                0.9 / 20.0
            } else {
                0.9 / 90.0
            };
            assert!(
                last > 0.1 && last <= 0.1 + step + 1e-12,
                "{schedule:?}: {last}"
            );
            assert!((1..=100).all(|s| lr_at(s, &t) <= 1.0));
            assert!((11..=100).all(|s| lr_at(s, &t) >= 0.1), "{schedule:?}");
        }
    }

    /// wsd: warmup, the peak until the last 20% of the steps, then linear
    /// decay to the floor.
    #[test]
    fn wsd_is_stable_then_decays() {
        let mut t = spec(100, 2.0, 10, Schedule::Wsd);
        t.min_lr = 0.2;
        assert_eq!(lr_at(5, &t), 1.0);
        assert!((11..=81).all(|s| lr_at(s, &t) == 2.0));
        assert!(lr_at(82, &t) < 2.0);
        assert!((lr_at(91, &t) - (0.2 + 1.8 * 0.5)).abs() < 1e-12);
        assert!((82..=100).all(|s| lr_at(s, &t) < lr_at(s - 1, &t)));
        // Decay never starts inside the warmup.
        t.decay_fraction = 1.0;
        assert_eq!(lr_at(10, &t), 2.0);
        assert!(lr_at(12, &t) < 2.0);
    }
}
