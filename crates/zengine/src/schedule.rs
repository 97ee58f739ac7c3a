//! Learning-rate schedules: linear warmup from 0, then constant, linear or cosine
//! decay towards 0 over the remaining steps.

use zconfig::Schedule;

/// The learning rate of 1-based optimizer `step` out of `total` steps.
pub fn lr_at(step: u64, total: u64, peak: f64, warmup: u64, schedule: Schedule) -> f64 {
    if step <= warmup && warmup > 0 {
        return peak * step as f64 / warmup as f64;
    }
    let decay_steps = total.saturating_sub(warmup).max(1) as f64;
    // Progress is 0 on the first step after warmup and below 1 on the last, so
    // every step has a non-zero rate.
    let progress = ((step - warmup.min(step)).saturating_sub(1) as f64 / decay_steps).min(1.0);
    match schedule {
        Schedule::Constant => peak,
        Schedule::Linear => peak * (1.0 - progress),
        Schedule::Cosine => peak * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_decay() {
        let c = |s| lr_at(s, 110, 1.0, 10, Schedule::Cosine);
        assert!((c(5) - 0.5).abs() < 1e-12);
        assert_eq!(c(10), 1.0);
        assert_eq!(c(11), 1.0);
        assert!((c(61) - 0.5).abs() < 1e-12);
        assert!(c(110) > 0.0 && c(110) < 1e-3);
        assert!((lr_at(61, 110, 1.0, 10, Schedule::Linear) - 0.5).abs() < 1e-12);
        assert_eq!(lr_at(100, 110, 2.0, 10, Schedule::Constant), 2.0);
        assert_eq!(lr_at(1, 5, 2.0, 0, Schedule::Linear), 2.0);
    }
}
