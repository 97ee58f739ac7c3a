//! Which source of a data blend (`data.blend`) each global sample comes
//! from, and which of that source's samples it is.
//!
//! Megatron-DeepSpeed's rule (its `build_blending_indices`): sample `g` goes
//! to the source furthest behind its share, the one with the largest
//! `w_i·(g + 1) − c_i`, where `w_i` is its normalized weight and `c_i` the
//! samples it got before `g` (ties to the first). So after any `n` samples
//! every source has had its share to within a sample, not only on average,
//! and the schedule is a function of `g` alone: the same for every rank,
//! world size and batch split, and for a resumed run.
//!
//! A sample's place needs the counts before it. They are kept every
//! 4096 samples (`MARK`), made as far as asked and never again, so any sample is
//! found by at most `MARK` steps of the rule from a mark, and the next one
//! in order by one step from the last.

/// Samples between two kept counts.
const MARK: u64 = 4096;

/// The blend's schedule over its sources.
#[derive(Debug, Clone)]
pub struct BlendSchedule {
    /// Normalized weights, summing to 1.
    weights: Vec<f64>,
    /// `marks[m]`: each source's samples before sample `m · MARK`.
    marks: Vec<Vec<u64>>,
    /// The last sample asked for, and the counts before it.
    cursor: (u64, Vec<u64>),
}

impl BlendSchedule {
    /// A schedule for sources of these weights (each finite and above 0).
    pub fn new(weights: &[f64]) -> BlendSchedule {
        assert!(
            !weights.is_empty() && weights.iter().all(|w| w.is_finite() && *w > 0.0),
            "a blend needs positive weights: {weights:?}"
        );
        let total: f64 = weights.iter().sum();
        let zeros = vec![0; weights.len()];
        BlendSchedule {
            weights: weights.iter().map(|w| w / total).collect(),
            marks: vec![zeros.clone()],
            cursor: (0, zeros),
        }
    }

    /// The source of sample `g`, before counting it: the one furthest
    /// behind its share.
    fn pick(&self, g: u64, counts: &[u64]) -> usize {
        let mut best = 0;
        let mut lag = f64::NEG_INFINITY;
        for (i, (&w, &c)) in self.weights.iter().zip(counts).enumerate() {
            let behind = w * (g + 1) as f64 - c as f64;
            if behind > lag {
                (best, lag) = (i, behind);
            }
        }
        best
    }

    /// Sample `g`'s source, and which of that source's samples it is.
    pub fn place(&mut self, g: u64) -> (usize, u64) {
        let (at, mut counts) = match &self.cursor {
            (c, counts) if *c <= g && g - c < MARK => (*c, counts.clone()),
            _ => {
                let m = g / MARK;
                while self.marks.len() as u64 <= m {
                    let last = self.marks.len() as u64 - 1;
                    let mut counts = self.marks[last as usize].clone();
                    for s in last * MARK..(last + 1) * MARK {
                        let source = self.pick(s, &counts);
                        counts[source] += 1;
                    }
                    self.marks.push(counts);
                }
                (m * MARK, self.marks[m as usize].clone())
            }
        };
        for s in at..g {
            let source = self.pick(s, &counts);
            counts[source] += 1;
        }
        let source = self.pick(g, &counts);
        let nth = counts[source];
        self.cursor = (g, counts);
        (source, nth)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule walked from sample 0, every sample in turn: the reference.
    fn walked(weights: &[f64], n: u64) -> Vec<(usize, u64)> {
        let total: f64 = weights.iter().sum();
        let mut counts = vec![0u64; weights.len()];
        (0..n)
            .map(|g| {
                let lags = weights
                    .iter()
                    .zip(&counts)
                    .map(|(w, &c)| w / total * (g + 1) as f64 - c as f64);
                let mut best = (0, f64::NEG_INFINITY);
                for (i, lag) in lags.enumerate() {
                    if lag > best.1 {
                        best = (i, lag);
                    }
                }
                counts[best.0] += 1;
                (best.0, counts[best.0] - 1)
            })
            .collect()
    }

    #[test]
    fn every_prefix_holds_each_share_to_within_a_sample() {
        for weights in [&[0.7, 0.3][..], &[1.0, 1.0, 1.0], &[5.0, 0.25, 2.0, 1.0]] {
            let mut s = BlendSchedule::new(weights);
            let total: f64 = weights.iter().sum();
            let mut counts = vec![0u64; weights.len()];
            for g in 0..20_000u64 {
                let (source, nth) = s.place(g);
                assert_eq!(
                    nth, counts[source],
                    "sample {g}: its source's samples before it"
                );
                counts[source] += 1;
                for (i, &c) in counts.iter().enumerate() {
                    let share = weights[i] / total * (g + 1) as f64;
                    assert!(
                        (c as f64 - share).abs() < 1.0,
                        "{weights:?} after {} samples: source {i} has {c}, its share {share}",
                        g + 1
                    );
                }
            }
        }
    }

    #[test]
    fn any_sample_in_any_order_is_placed_as_walking_from_the_start_places_it() {
        let weights = [0.5, 0.2, 0.3];
        let n = 5 * MARK + 17;
        let reference = walked(&weights, n);
        let mut s = BlendSchedule::new(&weights);
        // Backwards across marks, forwards, and jumps both ways: a rank's
        // samples, a step's count of all of them, a resumed run.
        let order =
            (0..n)
                .rev()
                .step_by(7)
                .chain(0..n)
                .chain([3 * MARK, 17, n - 1, MARK - 1, MARK, 0]);
        for g in order {
            assert_eq!(s.place(g), reference[g as usize], "sample {g}");
        }
    }

    #[test]
    fn one_source_takes_every_sample_in_order() {
        let mut s = BlendSchedule::new(&[3.0]);
        for g in (0..10_000).chain([5, 2 * MARK + 1]) {
            assert_eq!(s.place(g), (0, g));
        }
    }
}
