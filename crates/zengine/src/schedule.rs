//! Learning-rate schedules: a linear or logarithmic warmup from
//! `warmup_start_lr` (0 unless set), then constant, linear or cosine decay
//! towards `min_lr` over the remaining steps, or warmup-stable-decay (the peak
//! until the last `decay_fraction` of the steps, then linear decay to
//! `min_lr`). DeepSpeed's `WarmupLR`, `WarmupDecayLR` and `WarmupCosineLR`
//! are these shapes (see zconfig's `deepspeed` import). And the rest of
//! transformers' `lr_scheduler_type`s after their warmup:
//! `cosine_with_restarts`, `polynomial` and `inverse_sqrt`, with `min_lr`
//! as their floor (`lr_end` in transformers' polynomial; 0 in its others).
//!
//! DeepSpeed's `OneCycle` is `one_cycle`: a cycle up to `lr` and back
//! instead of a warmup and a decay, β1 cycling against the rate; its
//! `LRRangeTest` is `lr_range_test`, a rate growing from `lr` without end.
//!
//! Step s here (1-based) is transformers' `current_step` s − 1, which is how
//! its `LambdaLR` counts the steps before the one it sets the rate for: the
//! decays agree step for step after the warmup.

use zconfig::spec::{LrRangeTestSpec, OneCycleSpec, TrainSpec, WarmupType};
use zconfig::Schedule;

/// The learning rate of 1-based optimizer `step` under `t`'s schedule.
pub fn lr_at(step: u64, t: &TrainSpec) -> f64 {
    match t.schedule {
        Schedule::OneCycle => return one_cycle(step - 1, t).0,
        Schedule::LrRangeTest => return lr_range_test(step - 1, t),
        _ => {}
    }
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
    let since = step - start - 1;
    let progress = (since as f64 / decay_steps).min(1.0);
    let half_cosine = |x: f64| 0.5 * (1.0 + (std::f64::consts::PI * x).cos());
    match t.schedule {
        // The plateau rule's rate lives in the engine (`Engine::set_plateau_lr`).
        Schedule::Constant | Schedule::ReduceLrOnPlateau => peak,
        Schedule::Linear | Schedule::Wsd => floor + (peak - floor) * (1.0 - progress),
        Schedule::Cosine => floor + (peak - floor) * half_cosine(progress),
        Schedule::CosineWithRestarts if progress >= 1.0 => floor,
        Schedule::CosineWithRestarts => {
            let cycles = t.num_cycles.unwrap_or(1) as f64;
            floor + (peak - floor) * half_cosine((cycles * progress) % 1.0)
        }
        Schedule::Polynomial => {
            floor + (peak - floor) * (1.0 - progress).powf(t.power.unwrap_or(1.0))
        }
        // Returned above, before any warmup.
        Schedule::OneCycle => one_cycle(step - 1, t).0,
        Schedule::LrRangeTest => lr_range_test(step - 1, t),
        Schedule::InverseSqrt => {
            let timescale = inverse_sqrt_timescale(t) as f64;
            floor.max(peak / ((since as f64 + timescale) / timescale).sqrt())
        }
    }
}

/// The β1 of 1-based optimizer `step` where the schedule sets it
/// (`one_cycle` with `cycle_momentum`), else `None`: the optimizer's own.
pub fn beta1_at(step: u64, t: &TrainSpec) -> Option<f64> {
    let cycles = t.one_cycle.as_ref().is_none_or(|c| c.cycle_momentum);
    (t.schedule == Schedule::OneCycle && cycles).then(|| one_cycle(step - 1, t).1)
}

/// What Adagrad adds to each sum before 1-based optimizer `step`'s
/// square: its `initial_accumulator_value` at the first update (the sums
/// start at 0, so that every rule's state starts as zeros), else 0.
pub fn initial_sum_at(step: u64, t: &TrainSpec) -> f64 {
    match step {
        1 => t.optimizer.initial_accumulator_value.unwrap_or(0.0),
        _ => 0.0,
    }
}

/// `one_cycle`'s rate and β1 after `i` steps (0-based: the steps before
/// this one), as DeepSpeed's `OneCycle` gives them after `i` calls of its
/// `step` (whose `last_batch_iteration` is then i − 1): the cycle while
/// i ≤ its length, the decay d = i − length steps past it. (DeepSpeed's
/// first optimizer step, before any call, takes `cycle_min_mom`; this
/// takes the formula's `cycle_max_mom` there, as at every cycle's start.)
fn one_cycle(i: u64, t: &TrainSpec) -> (f64, f64) {
    let defaults = OneCycleSpec::default();
    let c = t.one_cycle.as_ref().unwrap_or(&defaults);
    let first = c.cycle_first_step_size as f64;
    let length = first + c.cycle_second_step_size.map_or(first, |n| n as f64);
    let rising = first / length;
    let (min_lr, max_lr, min_mom, max_mom) = (t.min_lr, t.lr, c.cycle_min_mom, c.cycle_max_mom);
    let i = i as f64;
    if i <= length {
        let cycle = (1.0 + i / length).floor();
        let x = 1.0 + i / length - cycle;
        let scale = match x <= rising {
            true => x / rising,
            false => (x - 1.0) / (rising - 1.0),
        };
        let lr = min_lr + (max_lr - min_lr) * scale;
        return (lr, max_mom - (max_mom - min_mom) * scale);
    }
    let intervals = (i - length) / c.decay_step_size as f64;
    let decays = |rate: f64| c.decay_step_size > 0 && rate != 0.0;
    let lr = match decays(c.decay_lr_rate) {
        true => min_lr / (1.0 + c.decay_lr_rate * intervals),
        false => min_lr,
    };
    let mom = match decays(c.decay_mom_rate) {
        true => max_mom * (1.0 + c.decay_mom_rate * intervals),
        false => max_mom,
    };
    (lr, mom)
}

/// `lr_range_test`'s rate after `i` steps (0-based), as DeepSpeed's
/// `LRRangeTest` gives it after `i` calls of its `step` (its first step's
/// rate, `lr` itself, is the formula's at 0).
fn lr_range_test(i: u64, t: &TrainSpec) -> f64 {
    let defaults = LrRangeTestSpec::default();
    let c = t.lr_range_test.as_ref().unwrap_or(&defaults);
    let interval = match c.staircase {
        true => (i as f64 / c.step_size as f64).floor(),
        false => i as f64 / c.step_size as f64,
    };
    t.lr * (1.0 + c.step_rate * interval)
}

/// `inverse_sqrt`'s timescale: as set, else the warmup's length, else
/// 10,000 steps (transformers' defaults).
fn inverse_sqrt_timescale(t: &TrainSpec) -> u64 {
    match (t.timescale, t.warmup_steps) {
        (Some(n), _) => n,
        (None, 0) => 10_000,
        (None, w) => w,
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

    /// Adagrad's initial accumulator joins the sums at the first update
    /// only: a resumed run, or the next step, must not add it again.
    #[test]
    fn the_initial_sum_joins_at_the_first_update_only() {
        let mut t = TrainSpec::default();
        assert_eq!(initial_sum_at(1, &t), 0.0);
        t.optimizer.initial_accumulator_value = Some(0.1);
        let at: Vec<f64> = (1..=3).map(|s| initial_sum_at(s, &t)).collect();
        assert_eq!(at, [0.1, 0.0, 0.0]);
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

    /// transformers' `LambdaLR` factors of its three other schedules, as
    /// its optimization.py writes them, at its 0-based `current`, with `n`
    /// training and `w` warmup steps.
    fn transformers_factor(schedule: Schedule, current: u64, n: u64, w: u64, t: &TrainSpec) -> f64 {
        let (current, n, w) = (current as f64, n as f64, w as f64);
        let progress = (current - w) / (n - w).max(1.0);
        match schedule {
            Schedule::CosineWithRestarts => {
                let cycles = t.num_cycles.unwrap() as f64;
                if progress >= 1.0 {
                    return 0.0;
                }
                let turn = std::f64::consts::PI * ((cycles * progress) % 1.0);
                0.0f64.max(0.5 * (1.0 + turn.cos()))
            }
            Schedule::Polynomial => {
                let (lr_init, lr_end) = (t.lr, t.min_lr);
                let remaining = 1.0 - (current - w) / (n - w);
                ((lr_init - lr_end) * remaining.powf(t.power.unwrap()) + lr_end) / lr_init
            }
            Schedule::InverseSqrt => {
                let timescale = t
                    .timescale
                    .map_or(if w > 0.0 { w } else { 10_000.0 }, |x| x as f64);
                let shift = timescale - w;
                1.0 / ((current + shift) / timescale).sqrt()
            }
            _ => unreachable!("not one of the three"),
        }
    }

    /// After the warmup, `cosine_with_restarts`, `polynomial` and
    /// `inverse_sqrt` give transformers' rates step for step (within f64
    /// rounding of the two ways of writing them), with their knobs at
    /// defaults and set; at one cycle, restarts are the cosine to the bit,
    /// and at power 1 the polynomial is the linear decay.
    #[test]
    fn transformers_schedules_agree_after_the_warmup() {
        let (n, w) = (120u64, 10u64);
        let mut cases = Vec::new();
        for cycles in [1, 3] {
            let mut t = spec(n, 2.0, w, Schedule::CosineWithRestarts);
            t.num_cycles = Some(cycles);
            cases.push(t);
        }
        for power in [1.0, 2.0, 0.5] {
            let mut t = spec(n, 2.0, w, Schedule::Polynomial);
            t.power = Some(power);
            t.min_lr = 1e-3;
            cases.push(t);
        }
        for (warmup, timescale) in [(10, None), (0, None), (10, Some(25))] {
            let mut t = spec(n, 2.0, warmup, Schedule::InverseSqrt);
            t.timescale = timescale;
            cases.push(t);
        }
        for t in &cases {
            for step in t.warmup_steps + 1..=n {
                let want = t.lr * transformers_factor(t.schedule, step - 1, n, t.warmup_steps, t);
                let got = lr_at(step, t);
                assert!(
                    (got - want).abs() <= 1e-12 * t.lr,
                    "{:?} cycles {:?} power {:?} timescale {:?} step {step}: {got} for {want}",
                    t.schedule,
                    t.num_cycles,
                    t.power,
                    t.timescale
                );
            }
        }
        let restarts = &cases[0];
        let cosine = spec(n, 2.0, w, Schedule::Cosine);
        let linear = TrainSpec {
            min_lr: 1e-3,
            ..spec(n, 2.0, w, Schedule::Linear)
        };
        for step in 1..=n {
            assert_eq!(
                lr_at(step, restarts).to_bits(),
                lr_at(step, &cosine).to_bits()
            );
            assert!((lr_at(step, &cases[2]) - lr_at(step, &linear)).abs() < 1e-15);
        }
        // Three cycles: the rate rises twice after the warmup, each time
        // to within a step's turn of the peak (a cycle is 110/3 steps).
        let three = &cases[1];
        let rises: Vec<u64> = (w + 2..=n)
            .filter(|&s| lr_at(s, three) > lr_at(s - 1, three))
            .collect();
        assert_eq!(rises.len(), 2, "{rises:?}");
        assert!(rises.iter().all(|&s| lr_at(s, three) > 1.99), "{rises:?}");
        // inverse_sqrt: the peak right after the warmup, halved after
        // three timescales, never below the floor.
        let mut isq = cases[7].clone();
        assert_eq!(lr_at(11, &isq), 2.0);
        assert!((lr_at(11 + 75, &isq) - 1.0).abs() < 1e-12);
        isq.min_lr = 1.5;
        assert!((11..=n).all(|s| lr_at(s, &isq) >= 1.5));
        assert_eq!(lr_at(n, &isq), 1.5);
    }

    /// DeepSpeed's `OneCycle` as its lr_schedules.py runs it: the state is
    /// `last_batch_iteration`, -1 before the first call of `step`; the rate
    /// and momentum are read after each call.
    struct DeepSpeedOneCycle {
        last_batch_iteration: i64,
        min_lr: f64,
        max_lr: f64,
        total_size: f64,
        step_ratio: f64,
        decay_step_size: f64,
        decay_lr_rate: f64,
        min_mom: f64,
        max_mom: f64,
        decay_mom_rate: f64,
    }

    impl DeepSpeedOneCycle {
        fn new(t: &TrainSpec) -> Self {
            let c = t.one_cycle.clone().unwrap();
            let first = c.cycle_first_step_size as f64;
            let second = c.cycle_second_step_size.map_or(first, |n| n as f64);
            DeepSpeedOneCycle {
                last_batch_iteration: -1,
                min_lr: t.min_lr,
                max_lr: t.lr,
                total_size: first + second,
                step_ratio: first / (first + second),
                decay_step_size: c.decay_step_size as f64,
                decay_lr_rate: c.decay_lr_rate,
                min_mom: c.cycle_min_mom,
                max_mom: c.cycle_max_mom,
                decay_mom_rate: c.decay_mom_rate,
            }
        }

        fn scale_factor(&self) -> f64 {
            let batch_iteration = (self.last_batch_iteration + 1) as f64;
            let cycle = (1.0 + batch_iteration / self.total_size).floor();
            let x = 1.0 + batch_iteration / self.total_size - cycle;
            if x <= self.step_ratio {
                x / self.step_ratio
            } else {
                (x - 1.0) / (self.step_ratio - 1.0)
            }
        }

        /// `step()`, then (`get_lr`, `get_mom`'s β1).
        fn step(&mut self) -> (f64, f64) {
            self.last_batch_iteration += 1;
            let lbi = self.last_batch_iteration as f64;
            if lbi < self.total_size {
                let s = self.scale_factor();
                let lr = self.min_lr + (self.max_lr - self.min_lr) * s;
                return (lr, self.max_mom - (self.max_mom - self.min_mom) * s);
            }
            let decay_iteration = lbi - self.total_size + 1.0;
            let skip = self.decay_step_size == 0.0;
            let lr = if skip || self.decay_lr_rate == 0.0 {
                self.min_lr
            } else {
                self.min_lr / (1.0 + self.decay_lr_rate * decay_iteration / self.decay_step_size)
            };
            let mom = if skip || self.decay_mom_rate == 0.0 {
                self.max_mom
            } else {
                self.max_mom * (1.0 + self.decay_mom_rate * decay_iteration / self.decay_step_size)
            };
            (lr, mom)
        }
    }

    /// `one_cycle` gives DeepSpeed's `OneCycle` rates and β1 step for step
    /// (zrun's step s is DeepSpeed's after s − 1 calls of `step`), through
    /// the cycle, the decay and its interval, with equal and unequal
    /// halves; β1 is the optimizer's own without `cycle_momentum`; the
    /// warmup does not apply.
    #[test]
    fn one_cycle_is_deepspeeds_step_for_step() {
        let shapes = [
            (10, None, 0, 0.0, 0.0),
            (10, Some(6), 4, 0.5, 0.01),
            (7, Some(13), 1, 2.0, 0.0),
        ];
        for (first, second, decay, lr_rate, mom_rate) in shapes {
            let mut t = spec(60, 2e-3, 20, Schedule::OneCycle);
            t.min_lr = 1e-4;
            t.one_cycle = Some(OneCycleSpec {
                cycle_first_step_size: first,
                cycle_second_step_size: second,
                decay_step_size: decay,
                decay_lr_rate: lr_rate,
                decay_mom_rate: mom_rate,
                ..OneCycleSpec::default()
            });
            let mut ds = DeepSpeedOneCycle::new(&t);
            let what = format!("{first} {second:?} {decay} {lr_rate} {mom_rate}");
            assert_eq!(lr_at(1, &t), 1e-4, "{what}: the cycle starts at min_lr");
            for step in 2..=60u64 {
                let (lr, mom) = ds.step();
                let close = |a: f64, b: f64| (a - b).abs() <= 1e-15 * b.abs();
                assert!(
                    close(lr_at(step, &t), lr),
                    "{what} step {step}: lr {} for {lr}",
                    lr_at(step, &t)
                );
                let b1 = beta1_at(step, &t).unwrap();
                assert!(close(b1, mom), "{what} step {step}: β1 {b1} for {mom}");
            }
            // The peak at the top of the rising half, min_lr back at its end.
            let length = first + second.unwrap_or(first);
            assert!((lr_at(first + 1, &t) - 2e-3).abs() < 1e-15, "{what}");
            assert!((lr_at(length + 1, &t) - 1e-4).abs() < 1e-15, "{what}");
            assert!(
                (beta1_at(first + 1, &t).unwrap() - 0.8).abs() < 1e-15,
                "{what}"
            );
            t.one_cycle.as_mut().unwrap().cycle_momentum = false;
            assert_eq!(beta1_at(5, &t), None);
        }
        assert_eq!(beta1_at(5, &spec(60, 2e-3, 20, Schedule::Cosine)), None);
    }

    /// DeepSpeed's `LRRangeTest` as its lr_schedules.py runs it: the rate
    /// after the `step` call that sets `last_batch_iteration`.
    fn deepspeed_lr_range_test(last_batch_iteration: i64, c: &LrRangeTestSpec, min_lr: f64) -> f64 {
        let x = (last_batch_iteration + 1) as f64 / c.step_size as f64;
        let interval = if c.staircase { x.floor() } else { x };
        min_lr * (1.0 + c.step_rate * interval)
    }

    /// `lr_range_test` gives DeepSpeed's `LRRangeTest` rates step for step
    /// (zrun's step s is DeepSpeed's after s − 1 calls of `step`; its first
    /// step, before any call, runs at the minimum rate, as here),
    /// continuous and in stairs, and ignores the warmup.
    #[test]
    fn lr_range_test_is_deepspeeds_step_for_step() {
        for (size, rate, staircase) in [(10, 1.0, false), (4, 0.5, true), (1, 2.0, false)] {
            let c = LrRangeTestSpec {
                step_size: size,
                step_rate: rate,
                staircase,
            };
            let mut t = spec(50, 1e-4, 20, Schedule::LrRangeTest);
            t.lr_range_test = Some(c.clone());
            assert_eq!(lr_at(1, &t), 1e-4);
            for step in 2..=50u64 {
                let want = deepspeed_lr_range_test(step as i64 - 2, &c, 1e-4);
                let got = lr_at(step, &t);
                assert!(
                    (got - want).abs() <= 1e-15 * want,
                    "{c:?} step {step}: {got} for {want}"
                );
            }
            let last = lr_at(50, &t);
            assert!(last > 1e-4 * (1.0 + rate * (48.0 / size as f64).floor()) - 1e-18);
        }
        // Stairs: flat within a stair, up at each stair's first step.
        let mut t = spec(50, 1.0, 0, Schedule::LrRangeTest);
        t.lr_range_test = Some(LrRangeTestSpec {
            step_size: 4,
            step_rate: 0.5,
            staircase: true,
        });
        assert_eq!(
            [1, 4, 5, 8, 9].map(|s| lr_at(s, &t)),
            [1.0, 1.0, 1.5, 1.5, 2.0]
        );
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
