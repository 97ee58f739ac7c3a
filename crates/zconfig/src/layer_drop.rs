//! `train.progressive_layer_drop`: DeepSpeed's progressive layer dropping
//! (PLD; Zhang and He 2020, "Accelerating Training of Transformer-Based
//! Language Models with Progressive Layer Dropping"). Each micro-batch
//! skips some of the blocks: a skipped block passes its input through,
//! costs no FLOPs and, at ZeRO stage 3, no gathers; a block that runs
//! scales its two residual branches by `1 / p`, its chance to run, so
//! that the expected output is the full model's and evaluation runs every
//! block unscaled.
//!
//! The chance falls with the step and with depth. DeepSpeed's engine keeps
//! `θ(t) = (1 − θ̄)·exp(−γ·t) + θ̄` (`theta` θ̄, `gamma` γ), updated at the
//! end of step `t` (its `global_steps`) for the step after, so that zrun's
//! 0-based step `s` runs with `θ(max(s − 1, 0))` as DeepSpeed's step `s`
//! does. DeepSpeed hands θ to the model, whose blocks draw their fate;
//! zrun's blocks take stochastic depth's linear rule along depth, as PLD's
//! paper does: block `l` of `L` (from 1) runs with chance
//! `p_l = 1 − l/L·(1 − θ)`, the last block with θ itself.
//!
//! A micro-batch's draws are a pure function of the seed, the step, the
//! micro-batch and the block — not of the rank — so every rank skips the
//! same blocks (their gathers and reductions are collectives), and ZeRO
//! stages, thread counts and resumed runs agree.

use serde::{Deserialize, Serialize};

use crate::spec::finite;

/// `train.progressive_layer_drop`'s keys, DeepSpeed's names.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerDropSpec {
    /// θ̄: the last block's chance to run once the schedule has settled,
    /// in (0, 1]; lower trains faster (DeepSpeed's tutorial takes 0.5).
    #[serde(deserialize_with = "finite::number")]
    pub theta: f64,
    /// γ: how fast θ falls from 1 to θ̄, at least 0 (DeepSpeed's default
    /// 0.001: θ is halfway there after about 700 steps).
    #[serde(default = "default_gamma", deserialize_with = "finite::number")]
    pub gamma: f64,
}

/// DeepSpeed's `PLD_GAMMA_DEFAULT`.
pub fn default_gamma() -> f64 {
    0.001
}

impl LayerDropSpec {
    /// θ for zrun's 0-based step `s` (see the module's doc).
    pub fn theta_at(&self, s: u64) -> f64 {
        let t = s.saturating_sub(1) as f64;
        (1.0 - self.theta) * (-self.gamma * t).exp() + self.theta
    }

    /// The chance that block `l` (1-based) of `n_layers` runs at step `s`.
    pub fn keep_probability(&self, s: u64, l: usize, n_layers: usize) -> f64 {
        1.0 - l as f64 / n_layers as f64 * (1.0 - self.theta_at(s))
    }

    /// The share of its blocks' passes a run of `steps` steps of
    /// `n_layers` blocks is expected to make: the mean chance over steps
    /// and blocks, `1 − (L + 1)/(2L)·(1 − θ)` a step.
    pub fn expected_share(&self, steps: u64, n_layers: usize) -> f64 {
        let (l, n) = (n_layers as f64, steps.max(1));
        (0..n)
            .map(|s| 1.0 - (l + 1.0) / (2.0 * l) * (1.0 - self.theta_at(s)))
            .sum::<f64>()
            / n as f64
    }

    /// One line on what dropping does to a run of `steps` steps of
    /// `n_layers` blocks (`zrun check` prints it): θ at the last step, and
    /// the share of the blocks' passes the run is expected to make (the
    /// mean chance over steps and blocks, `1 − (L + 1)/(2L)·(1 − θ)` a
    /// step).
    pub fn summary(&self, steps: u64, n_layers: usize) -> String {
        let n = steps.max(1);
        let share = self.expected_share(steps, n_layers);
        format!(
            "progressive layer drop: θ from 1 to {:.3} at step {steps} (theta {}, gamma {}); the run is expected to make {:.1}% of its blocks' passes",
            self.theta_at(n - 1),
            self.theta,
            self.gamma,
            100.0 * share
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// θ starts at 1 (the first two steps run every block, as DeepSpeed's
    /// first two do), falls as `(1 − θ̄)·e^(−γt) + θ̄` and settles at θ̄;
    /// the chances fall linearly with depth to θ at the last block.
    #[test]
    fn theta_falls_with_the_step_and_the_chance_with_depth() {
        let pld = LayerDropSpec {
            theta: 0.5,
            gamma: 0.01,
        };
        assert_eq!((pld.theta_at(0), pld.theta_at(1)), (1.0, 1.0));
        // Step 101 runs with DeepSpeed's θ(100) = 0.5·e^(−1) + 0.5.
        let want = 0.5 * (-1.0f64).exp() + 0.5;
        assert!((pld.theta_at(101) - want).abs() < 1e-15);
        assert!((pld.theta_at(100_000) - 0.5).abs() < 1e-12);
        let theta = pld.theta_at(101);
        let p: Vec<f64> = (1..=4).map(|l| pld.keep_probability(101, l, 4)).collect();
        assert!((p[3] - theta).abs() < 1e-15, "{p:?}");
        assert!((p[1] - (1.0 - 0.5 * (1.0 - theta))).abs() < 1e-15);
        assert!(p.windows(2).all(|w| w[0] > w[1]), "{p:?}");
        assert_eq!(pld.keep_probability(1, 4, 4), 1.0);
        // The summary's share is the mean of the chances: at γ = 0 every
        // step's θ is 1 (nothing dropped); a long run at θ̄ = 0.5 on 4
        // blocks nears 1 − 5/8·0.5.
        let none = LayerDropSpec {
            theta: 0.5,
            gamma: 0.0,
        };
        assert!(none
            .summary(10, 4)
            .ends_with("make 100.0% of its blocks' passes"));
        let long = LayerDropSpec {
            theta: 0.5,
            gamma: 1.0,
        };
        let line = long.summary(100_000, 4);
        assert!(line.contains("to 0.500 at step 100000"), "{line}");
        assert!(line.ends_with("make 68.8% of its blocks' passes"), "{line}");
        let mean = |s: u64| (1..=4).map(|l| long.keep_probability(s, l, 4)).sum::<f64>() / 4.0;
        assert!((mean(50) - (1.0 - 5.0 / 8.0 * (1.0 - long.theta_at(50)))).abs() < 1e-12);
    }
}
