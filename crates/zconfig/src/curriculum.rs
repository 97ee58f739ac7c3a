//! `train.curriculum`: DeepSpeed's sequence-length curriculum
//! (`curriculum_learning` with `curriculum_type: seqlen`, the legacy form
//! Megatron-DeepSpeed's GPT pre-training reads). Early steps train on the
//! first few tokens of each sequence, and the length grows with the step to
//! `model.seq_len`: short sequences are cheaper (attention's cost grows
//! with the length) and, at large batch sizes and learning rates, steadier
//! (Li et al. 2022, "The Stability-Efficiency Dilemma").
//!
//! The length of a step is a pure function of the step, so that every rank,
//! every ZeRO stage and a resumed run agree on it without state: DeepSpeed
//! asks its scheduler at `global_steps + 1` before each step's forward,
//! and keeps the answer once it reaches `max_difficulty`; zrun's 0-based
//! step `s` is DeepSpeed's `global_steps = s`, so [`CurriculumSpec::seq_len`]
//! evaluates DeepSpeed's schedules at `s + 1`:
//!
//! - `fixed_linear`: `floor(g / total_curriculum_step · (max − min) + min)`,
//!   rounded down to a multiple of `difficulty_step`, at most `max`;
//! - `fixed_root`: the same with `(g / total_curriculum_step)^(1 / root_degree)`;
//! - `fixed_discrete`: `difficulty[i]` for the first `i` with `g ≤ max_step[i]`
//!   (the last difficulty after the last `max_step`).
//!
//! As Megatron-DeepSpeed does with the length, the data loader reads each
//! sequence whole and the step trains on its first `seq_len(s)` tokens
//! (inputs, targets, loss mask and documents alike); the rest of the
//! sequence is not trained on, and the run consumes the same sequences as
//! a run without a curriculum.

use serde::{Deserialize, Serialize};

use crate::spec::finite;

/// `train.curriculum`'s keys, DeepSpeed's names (its `schedule_config`'s
/// keys beside the others).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CurriculumSpec {
    /// The tokens of the first step's sequences (before rounding to
    /// `difficulty_step`).
    pub min_difficulty: usize,
    /// The length the curriculum ends at; `model.seq_len` unless set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_difficulty: Option<usize>,
    /// How the length grows.
    pub schedule_type: CurriculumSchedule,
    /// `fixed_linear` / `fixed_root`: the steps from `min_difficulty` to
    /// `max_difficulty`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_curriculum_step: Option<u64>,
    /// `fixed_linear` / `fixed_root`: every length is a multiple of this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub difficulty_step: Option<usize>,
    /// `fixed_root`: the root's degree (2: square root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub root_degree: Option<f64>,
    /// `fixed_discrete`: the lengths, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub difficulty: Vec<usize>,
    /// `fixed_discrete`: the last step of each length but the last (one
    /// fewer than `difficulty`), rising.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub max_step: Vec<u64>,
}

/// DeepSpeed's `schedule_type`s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CurriculumSchedule {
    /// Linear in the step.
    FixedLinear,
    /// A root of the step's share of `total_curriculum_step`.
    FixedRoot,
    /// Lengths by ranges of steps.
    FixedDiscrete,
}

impl CurriculumSchedule {
    /// The name a job writes.
    pub fn name(self) -> &'static str {
        match self {
            CurriculumSchedule::FixedLinear => "fixed_linear",
            CurriculumSchedule::FixedRoot => "fixed_root",
            CurriculumSchedule::FixedDiscrete => "fixed_discrete",
        }
    }
}

impl CurriculumSpec {
    /// `max_difficulty`, or `full` (the model's `seq_len`) where unset.
    pub fn max(&self, full: usize) -> usize {
        self.max_difficulty.unwrap_or(full)
    }

    /// The tokens of each sequence that 0-based step `step` trains on, for
    /// a model of `full` tokens (module doc): DeepSpeed's difficulty at its
    /// `global_steps + 1`, never above `full`.
    pub fn seq_len(&self, step: u64, full: usize) -> usize {
        let (min, max) = (self.min_difficulty, self.max(full));
        let g = step + 1;
        // DeepSpeed starts at min and updates only while below max.
        let length = if min >= max {
            min
        } else {
            match self.schedule_type {
                CurriculumSchedule::FixedLinear => self.root(g, 1.0, min, max),
                CurriculumSchedule::FixedRoot => {
                    self.root(g, self.root_degree.unwrap_or(1.0), min, max)
                }
                CurriculumSchedule::FixedDiscrete => self.discrete(g, max),
            }
        };
        length.min(full)
    }

    /// One line on what the curriculum does to a run of `steps` steps on a
    /// model of `full` tokens (`zrun check` prints it): the first step's
    /// length, the step from which the length stays at its last, and the
    /// share of the tokens those steps would train without it.
    pub fn summary(&self, steps: u64, full: usize) -> String {
        // Lengths only grow and, once at the last, stay (module doc): walk
        // the steps until then, up to a bound on the walk.
        let last = self.max(full).max(self.min_difficulty).min(full);
        let mut trained = 0u128;
        let mut settled = None;
        for s in 0..steps.min(10_000_000) {
            let t = self.seq_len(s, full);
            if t >= last {
                trained += (steps - s) as u128 * t as u128;
                settled = Some(s);
                break;
            }
            trained += t as u128;
        }
        let first = self.seq_len(0, full);
        let whole = steps as u128 * full as u128;
        match settled {
            Some(s) => format!(
                "curriculum: {first} tokens a sequence at step 1, {last} from step {} of {steps}: {:.1}% of the tokens the steps would train at {full}",
                s + 1,
                100.0 * trained as f64 / whole.max(1) as f64
            ),
            None => format!(
                "curriculum: {first} tokens a sequence at step 1, below {last} for all of the run's first {} steps",
                steps.min(10_000_000)
            ),
        }
    }

    /// `fixed_root`'s length at DeepSpeed's step `g` (`fixed_linear`'s at
    /// degree 1), which grows with `g`: so once it reaches `max` it stays.
    fn root(&self, g: u64, degree: f64, min: usize, max: usize) -> usize {
        let total = self.total_curriculum_step.unwrap_or(1).max(1) as f64;
        let step = self.difficulty_step.unwrap_or(1).max(1);
        let share = (g as f64 / total).powf(1.0 / degree);
        // Past the end the share grows without bound: held at `max + step`,
        // which rounds down to at least `max` as any larger length does.
        let length = (share * (max - min) as f64 + min as f64)
            .floor()
            .min((max + step) as f64) as usize;
        (length - length % step).min(max)
    }

    /// `fixed_discrete`'s length at DeepSpeed's step `g`: the first length
    /// that reached `max` stays, as DeepSpeed stops updating there.
    fn discrete(&self, g: u64, max: usize) -> usize {
        let now = self
            .max_step
            .iter()
            .position(|&last| g <= last)
            .unwrap_or(self.max_step.len());
        let lengths = &self.difficulty[..=now.min(self.difficulty.len().saturating_sub(1))];
        match lengths.iter().find(|&&l| l >= max) {
            Some(&stuck) => stuck,
            None => *lengths.last().unwrap_or(&max),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn linear(min: usize, max: usize, total: u64, step: usize) -> CurriculumSpec {
        CurriculumSpec {
            min_difficulty: min,
            max_difficulty: Some(max),
            schedule_type: CurriculumSchedule::FixedLinear,
            total_curriculum_step: Some(total),
            difficulty_step: Some(step),
            root_degree: None,
            difficulty: Vec::new(),
            max_step: Vec::new(),
        }
    }

    /// The lengths DeepSpeed's `CurriculumScheduler` gives, worked out by
    /// hand from its formulas at `global_steps = step + 1`: DeepSpeed's
    /// tutorial shape (8 to 1024 in steps of 8 over 15,000 steps) and a
    /// `max_difficulty` that is no multiple of the step.
    #[test]
    fn fixed_linear_follows_deepspeeds_formula() {
        let c = linear(8, 1024, 15_000, 8);
        // g = 1: floor(1/15000·1016 + 8) = 8.
        assert_eq!(c.seq_len(0, 1024), 8);
        // g = 119: floor(119·1016/15000 + 8) = floor(16.06) = 16.
        assert_eq!(c.seq_len(118, 1024), 16);
        // g = 118: floor(15.99) = 15 → 8.
        assert_eq!(c.seq_len(117, 1024), 8);
        // g = 7500: floor(508 + 8) = 516 → 512.
        assert_eq!(c.seq_len(7499, 1024), 512);
        // g = 15,000 and after: 1024.
        assert_eq!(c.seq_len(14_999, 1024), 1024);
        assert_eq!(c.seq_len(40_000, 1024), 1024);
        // max 100 in steps of 8: at g = total, floor(100) → 96, then 100
        // once the formula passes it (DeepSpeed caps at max).
        let c = linear(16, 100, 10, 8);
        assert_eq!(c.seq_len(9, 100), 96);
        assert_eq!(c.seq_len(10, 100), 100);
        // Never past the model's sequence.
        assert_eq!(linear(8, 64, 4, 8).seq_len(100, 32), 32);
    }

    /// The summary `zrun check` prints: 8, 16, 24 then 32 tokens over 6
    /// steps is 8 + 16 + 24 + 3·32 = 144 of 192 tokens a sequence, 75%.
    #[test]
    fn the_summary_says_where_the_length_settles_and_the_tokens_kept() {
        let c = linear(8, 32, 4, 8);
        assert_eq!(
            c.summary(6, 32),
            "curriculum: 8 tokens a sequence at step 1, 32 from step 4 of 6: 75.0% of the tokens the steps would train at 32"
        );
        assert!(c
            .summary(2, 32)
            .contains("below 32 for all of the run's first 2 steps"));
    }

    /// `fixed_root` at degree 2 rises faster early: g = 25 of 100 is
    /// a share of 0.5.
    #[test]
    fn fixed_root_takes_the_root_of_the_share() {
        let c = CurriculumSpec {
            schedule_type: CurriculumSchedule::FixedRoot,
            root_degree: Some(2.0),
            ..linear(16, 272, 100, 16)
        };
        // g = 25: sqrt(0.25)·256 + 16 = 144 → 144.
        assert_eq!(c.seq_len(24, 272), 144);
        // g = 1: 0.1·256 + 16 = 41.6 → 41 → 32.
        assert_eq!(c.seq_len(0, 272), 32);
        assert_eq!(c.seq_len(99, 272), 272);
    }

    /// `fixed_discrete`: difficulty[i] up to and including max_step[i];
    /// and once a length reaches max it stays, as DeepSpeed's does.
    #[test]
    fn fixed_discrete_steps_through_its_lengths() {
        let c = CurriculumSpec {
            schedule_type: CurriculumSchedule::FixedDiscrete,
            total_curriculum_step: None,
            difficulty_step: None,
            difficulty: vec![16, 32, 64],
            max_step: vec![5, 10],
            ..linear(16, 64, 1, 1)
        };
        let lengths: Vec<usize> = (0..12).map(|s| c.seq_len(s, 64)).collect();
        assert_eq!(lengths, [16, 16, 16, 16, 16, 32, 32, 32, 32, 32, 64, 64]);
        // A length at max before the list ends stays there.
        let stuck = CurriculumSpec {
            difficulty: vec![16, 64, 32],
            ..c.clone()
        };
        let lengths: Vec<usize> = (0..12).map(|s| stuck.seq_len(s, 64)).collect();
        assert_eq!(lengths, [16, 16, 16, 16, 16, 64, 64, 64, 64, 64, 64, 64]);
        // min at max: DeepSpeed never updates.
        let flat = CurriculumSpec {
            min_difficulty: 64,
            ..c
        };
        assert!((0..12).all(|s| flat.seq_len(s, 64) == 64));
    }
}
