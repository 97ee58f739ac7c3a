//! The progress display: an indicatif bar on a terminal, plain log lines
//! otherwise (every `train.log_every` steps, by default every twentieth of the
//! run), so that logs of batch jobs stay short.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::metrics::StepLine;

/// The progress display: a bar on a terminal, plain lines otherwise.
pub struct Progress {
    bar: Option<ProgressBar>,
    every: u64,
    steps: u64,
}

impl Progress {
    /// For a run of `steps`; `plain` forces log lines, one every `log_every`
    /// steps (0: every twentieth of the run).
    pub fn new(steps: u64, plain: bool, log_every: u64) -> Progress {
        let bar = (!plain).then(|| {
            let b = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stdout());
            b.set_style(
                ProgressStyle::with_template(
                    "{spinner} step {pos}/{len} [{bar:30}] {msg} ETA {eta}",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            );
            b
        });
        Progress {
            bar,
            every: if log_every > 0 {
                log_every
            } else {
                (steps / 20).max(1)
            },
            steps,
        }
    }

    /// The run's length changed (a restart on fewer workers recounted
    /// `train.epochs`).
    pub fn set_steps(&mut self, steps: u64) {
        if let Some(b) = &self.bar {
            b.set_length(steps);
        }
        self.steps = steps;
    }

    /// Prints a line without disturbing the bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(b) => b.println(line),
            None => say!("{line}"),
        }
    }

    /// Shows a finished step.
    pub fn step(&self, line: &StepLine) {
        let val = line
            .val_loss
            .map(|v| format!(" · val loss {v:.4}"))
            .unwrap_or_default();
        // A curriculum's length: how far into it the run is.
        let length = line
            .seq_len
            .map(|t| format!(" · {t} tokens a sequence"))
            .unwrap_or_default();
        let msg = format!(
            "loss {:.4}{val} · {:.0} tok/s · {:.1} ms/step{length}",
            line.loss, line.tokens_per_s, line.step_ms
        );
        match &self.bar {
            Some(b) => {
                b.set_position(line.step);
                b.set_message(format!("{msg} · epoch {:.2}", line.epoch));
            }
            None if line.step == 1
                || line.step.is_multiple_of(self.every)
                || line.step == self.steps
                || line.val_loss.is_some() =>
            {
                let norm = match line.grad_norm {
                    Some(n) => format!("grad norm {n:.3}"),
                    None => "gradients overflowed, step skipped".into(),
                };
                say!(
                    "step {}/{} {msg} · lr {:.2e} · {norm} · epoch {:.2}",
                    line.step,
                    self.steps,
                    line.lr,
                    line.epoch
                );
            }
            None => {}
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
