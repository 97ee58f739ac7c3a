//! DeepSpeed's elastic batch sizes (a ds_config's `elasticity` section):
//! one global batch that many world sizes can run, each with a micro-batch
//! from a given list and gradient accumulation making up the rest, so that
//! a job restarted on more or fewer workers (`zrun train --max-restarts`,
//! a resume at another world size) trains with the same batch.
//!
//! The arithmetic is DeepSpeed's (`deepspeed/elasticity/elasticity.py`,
//! versions 0.1 and 0.2), so that a ds_config gives the batch it gives
//! under DeepSpeed: the candidate batches are each micro-batch (and their
//! least common multiple) scaled by the largest highly composite number
//! that keeps them within `max_train_batch_size`; the one that the most
//! worker counts within `[min_gpus, max_gpus]` divide wins (ties to the
//! larger batch, or the smaller); a worker count then takes the largest
//! micro-batch that divides its share. Version 0.2 counts nodes of
//! `num_gpus_per_node` workers, and where this job's worker count is not one
//! of the counts it finds, takes the largest multiple of a micro-batch on
//! every worker that fits (the smallest, with `prefer_larger_batch: false`)
//! for this count alone.

/// The `elasticity` section, read.
#[derive(Debug, Clone, PartialEq)]
pub struct Elasticity {
    /// `max_train_batch_size`.
    pub max_train_batch_size: u64,
    /// `micro_batch_sizes`, in the file's order.
    pub micro_batch_sizes: Vec<u64>,
    /// `min_gpus`.
    pub min_gpus: u64,
    /// `max_gpus`.
    pub max_gpus: u64,
    /// `version`: 0.1 or 0.2 (DeepSpeed's default, the latest).
    pub version: ElasticVersion,
    /// `prefer_larger_batch`.
    pub prefer_larger: bool,
    /// `num_gpus_per_node` (version 0.2).
    pub num_gpus_per_node: u64,
}

/// DeepSpeed's two elasticity algorithms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ElasticVersion {
    /// Worker counts counted one by one.
    V01,
    /// Counted in nodes, with a batch for a count outside them.
    V02,
}

/// What [`Elasticity::batch`] settles for a worker count.
#[derive(Debug, Clone, PartialEq)]
pub struct ElasticBatch {
    /// The global batch (`train_batch_size`).
    pub total: u64,
    /// The worker counts it runs on, ascending.
    pub valid: Vec<u64>,
    /// This count's micro-batch and gradient accumulation, where the count
    /// is valid and a micro-batch divides its share.
    pub micro_and_accum: Option<(u64, u64)>,
}

/// The 38 smallest highly composite numbers (DeepSpeed's list).
const HCN: [u64; 38] = [
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560,
    10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200,
    332640, 498960, 554400, 665280, 720720,
];

impl Elasticity {
    /// The global batch for `world` workers, its valid worker counts, and
    /// `world`'s micro-batch and accumulation. `micro_batch_sizes` must be
    /// non-empty and positive, each at most `max_train_batch_size`.
    pub fn batch(&self, world: u64) -> ElasticBatch {
        let (total, valid) = match self.version {
            ElasticVersion::V01 => {
                self.compatible_v01(self.max_train_batch_size, self.min_gpus, self.max_gpus)
            }
            ElasticVersion::V02 => self.compatible_v02(world),
        };
        // The largest micro-batch that divides a worker's share.
        let mut sizes = self.micro_batch_sizes.clone();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        let micro = valid
            .contains(&world)
            .then(|| {
                sizes
                    .into_iter()
                    .find(|m| (total / world).is_multiple_of(*m))
            })
            .flatten()
            .filter(|_| total > 0);
        ElasticBatch {
            total,
            valid,
            micro_and_accum: micro.map(|m| (m, total / (m * world))),
        }
    }

    /// Version 0.1 (`_get_compatible_gpus_v01`) within `max_batch` and
    /// `[min_gpus, max_gpus]` (0 taken as 1, and as `max_batch` over the
    /// smallest micro-batch, as DeepSpeed's `or` does).
    fn compatible_v01(&self, max_batch: u64, min_gpus: u64, max_gpus: u64) -> (u64, Vec<u64>) {
        let micro = &self.micro_batch_sizes;
        let smallest = micro.iter().copied().min().unwrap_or(1);
        let min_gpus = min_gpus.max(1);
        let max_gpus = match max_gpus {
            0 => max_batch / smallest,
            n => n,
        };
        let lcm = micro.iter().fold(1, |l, &m| l / gcd(l, m) * m);
        let mut candidates: Vec<u64> = micro
            .iter()
            .copied()
            .chain([lcm])
            .map(|base| match base >= max_batch {
                true => base,
                false => {
                    let most = max_batch / base;
                    // The largest highly composite number at most `most`
                    // (the list's last where none is larger).
                    let i = HCN.iter().position(|&h| h > most).unwrap_or(0);
                    HCN[if i == 0 { HCN.len() - 1 } else { i - 1 }] * base
                }
            })
            .collect();
        candidates.sort_unstable();
        candidates.dedup();
        // The most valid counts; ties to the larger batch (or the smaller),
        // starting from the smallest micro-batch with none.
        let (mut best, mut total, mut valid) = (0, smallest, Vec::new());
        for batch in candidates {
            let counts = self.valid_counts(batch, min_gpus, max_gpus);
            let tie_wins = match self.prefer_larger {
                true => batch > total,
                false => batch < total,
            };
            if counts.len() > best || (counts.len() == best && tie_wins) {
                (best, total, valid) = (counts.len(), batch, counts);
            }
        }
        (total, valid)
    }

    /// The worker counts within `[min, max]` that run `batch` with one of
    /// the micro-batches (`get_valid_gpus`): `batch / m` for each
    /// micro-batch `m` that divides it, and its divisors up to half of it.
    fn valid_counts(&self, batch: u64, min: u64, max: u64) -> Vec<u64> {
        let mut out = Vec::new();
        for &m in &self.micro_batch_sizes {
            if !batch.is_multiple_of(m) {
                continue;
            }
            let most = batch / m;
            if (min..=max).contains(&most) {
                out.push(most);
            }
            for i in (min.max(1)..=(most / 2).min(max)).filter(|i| most.is_multiple_of(*i)) {
                out.push(i);
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Version 0.2 (`_get_compatible_gpus_v02`, no model parallelism):
    /// version 0.1 over nodes, scaled back to workers; for a worker count
    /// that is not among them, the best multiple of one micro-batch on
    /// every worker within `max_train_batch_size`, for that count alone.
    fn compatible_v02(&self, world: u64) -> (u64, Vec<u64>) {
        let per_node = self.num_gpus_per_node.max(1);
        let (total, nodes) = self.compatible_v01(
            self.max_train_batch_size / per_node,
            self.min_gpus / per_node,
            self.max_gpus / per_node,
        );
        let valid: Vec<u64> = nodes.iter().map(|n| n * per_node).collect();
        if valid.contains(&world) {
            return (total * per_node, valid);
        }
        // In floating point, as DeepSpeed computes it.
        let workers = world as f64 / per_node as f64 * per_node as f64;
        let fits = self.micro_batch_sizes.iter().map(|&m| {
            let one = m as f64 * workers;
            (self.max_train_batch_size as f64 / one).floor() * one
        });
        let total = match self.prefer_larger {
            true => fits.fold(f64::MIN, f64::max),
            false => fits.fold(f64::MAX, f64::min),
        };
        (total.max(0.0) as u64, vec![workers as u64])
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    match b {
        0 => a,
        _ => gcd(b, a % b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(micro: &[u64], max: u64, gpus: (u64, u64), v: ElasticVersion) -> Elasticity {
        Elasticity {
            max_train_batch_size: max,
            micro_batch_sizes: micro.to_vec(),
            min_gpus: gpus.0,
            max_gpus: gpus.1,
            version: v,
            prefer_larger: true,
            num_gpus_per_node: 1,
        }
    }

    /// Against DeepSpeed: its unit tests' figures (`test_basic_10k`: 9792
    /// and 23 counts; 64 workers take micro-batch 17, 128 are refused;
    /// `test_proper_mbsz`: 7 workers take 3), and cases computed by
    /// DeepSpeed's own `elasticity.py` functions (run under Python with
    /// numpy, 2026-12-07): (total, valid counts, micro-batch, accumulation).
    #[test]
    fn batches_are_deepspeeds() {
        use ElasticVersion::{V01, V02};
        let ten_k = config(&[8, 12, 16, 17], 10000, (32, 1500), V01);
        let b = ten_k.batch(64);
        assert_eq!(
            (b.total, b.valid.len(), b.micro_and_accum),
            (9792, 23, Some((17, 9)))
        );
        assert_eq!(
            b.valid,
            [
                32, 34, 36, 48, 51, 64, 68, 72, 96, 102, 136, 144, 153, 192, 204, 272, 288, 306,
                408, 576, 612, 816, 1224
            ]
        );
        assert_eq!(ten_k.batch(128).micro_and_accum, None);
        let proper = config(&[1, 2, 3, 7], 32, (1, 1500), V01);
        let b = proper.batch(7);
        assert_eq!(b.total, 42);
        assert_eq!(b.valid, [1, 2, 3, 6, 7, 14, 21, 42]);
        assert_eq!(b.micro_and_accum, Some((3, 2)));
        let up_to_840: Vec<u64> = vec![
            1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15, 20, 21, 24, 28, 30, 35, 40, 42, 56, 60, 70, 84,
            105, 120, 140, 168, 210, 280, 420, 840,
        ];
        let defaults = config(&[2, 4, 6], 2000, (1, 10000), V01);
        let b = defaults.batch(2);
        assert_eq!(
            (b.total, &b.valid, b.micro_and_accum),
            (1680, &up_to_840, Some((6, 140)))
        );
        let smaller = Elasticity {
            prefer_larger: false,
            ..defaults.clone()
        };
        let b = smaller.batch(3);
        assert_eq!(
            (b.total, &b.valid, b.micro_and_accum),
            (1680, &up_to_840, Some((4, 140)))
        );
        let v02 = Elasticity {
            version: V02,
            ..defaults
        };
        let b = v02.batch(4);
        assert_eq!(
            (b.total, &b.valid, b.micro_and_accum),
            (1680, &up_to_840, Some((6, 70)))
        );
        assert_eq!(v02.batch(7).micro_and_accum, Some((6, 40)));
        let nodes = Elasticity {
            num_gpus_per_node: 2,
            ..config(&[1, 2, 4], 64, (1, 8), V02)
        };
        let b = nodes.batch(4);
        assert_eq!(
            (b.total, b.valid, b.micro_and_accum),
            (48, vec![2, 4, 6, 8], Some((4, 3)))
        );
        // 3 workers are not whole nodes: their own batch.
        let b = nodes.batch(3);
        assert_eq!(
            (b.total, b.valid, b.micro_and_accum),
            (63, vec![3], Some((1, 21)))
        );
        let odd = Elasticity {
            prefer_larger: false,
            ..config(&[3, 5], 100, (1, 16), V02)
        };
        let b = odd.batch(2);
        assert_eq!(
            (b.total, b.valid, b.micro_and_accum),
            (60, vec![1, 2, 3, 4, 5, 6, 10, 12], Some((5, 6)))
        );
    }
}
