//! Corpora and batching.
//!
//! A corpus is one token stream (text files' bytes, u16 token files, or a seeded
//! synthetic stream). It is cut into non-overlapping windows of `seq_len + 1`
//! tokens; each epoch visits the windows in a seeded random order. Global sample
//! `g` of the run is window `perm_epoch[g mod windows]`. Step `s` consumes global
//! samples `s·G .. (s+1)·G` with `G = micro_batch · grad_accum · world`, and rank r's
//! micro-batch a takes the `micro_batch` samples at `(a·world + r)·micro_batch`.
//! So ranks read disjoint samples, and the global batch of a step does not depend
//! on how it is split over ranks and micro-batches: 2 workers × 8 sequences see
//! exactly what 1 worker × 2 micro-batches × 8 sequences sees.

use std::path::PathBuf;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zconfig::{data_files, DataFormat};

/// Why data could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// A file could not be read.
    #[error("{path}: {cause}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause (shown in the message, so not also a `source`).
        cause: std::io::Error,
    },
    /// The data cannot serve this model.
    #[error("data: {0}")]
    Invalid(String),
}

/// A token stream.
#[derive(Debug, Clone)]
pub struct Corpus {
    tokens: Vec<u16>,
}

/// Tokens in the synthetic corpus.
const SYNTHETIC_TOKENS: usize = 1 << 20;

impl Corpus {
    /// Loads the corpus a data spec describes; token ids are checked against `vocab`.
    pub fn load(
        path: &Option<String>,
        format: DataFormat,
        vocab: usize,
        seed: u64,
    ) -> Result<Corpus, DataError> {
        if vocab > usize::from(u16::MAX) + 1 {
            return Err(DataError::Invalid(format!(
                "vocab_size {vocab} exceeds the u16 token range"
            )));
        }
        if format == DataFormat::Synthetic {
            return Ok(Corpus::synthetic(vocab, seed));
        }
        let files = data_files(path, format).map_err(DataError::Invalid)?;
        let mut tokens = Vec::new();
        for f in files {
            let bytes = std::fs::read(&f).map_err(|cause| DataError::Io {
                path: f.clone(),
                cause,
            })?;
            match format {
                DataFormat::Text => tokens.extend(bytes.iter().map(|&b| u16::from(b))),
                DataFormat::TokensU16 => {
                    if bytes.len() % 2 != 0 {
                        return Err(DataError::Invalid(format!(
                            "{}: odd byte count",
                            f.display()
                        )));
                    }
                    for (i, c) in bytes.chunks_exact(2).enumerate() {
                        let t = u16::from_le_bytes([c[0], c[1]]);
                        if usize::from(t) >= vocab {
                            return Err(DataError::Invalid(format!(
                                "{}: token {t} at index {i} is not below vocab_size {vocab}",
                                f.display()
                            )));
                        }
                        tokens.push(t);
                    }
                }
                DataFormat::Synthetic => unreachable!("handled above"),
            }
        }
        Ok(Corpus { tokens })
    }

    /// A learnable stream: each token is followed by one of four seeded successors
    /// 90% of the time, by a uniform token otherwise (about 1.7 nats of entropy
    /// per token for a large vocabulary, against ln(vocab) for a fresh model).
    pub fn synthetic(vocab: usize, seed: u64) -> Corpus {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5EED_DA7A);
        let successors: Vec<[u16; 4]> = (0..vocab)
            .map(|_| std::array::from_fn(|_| rng.random_range(0..vocab) as u16))
            .collect();
        let mut tokens = Vec::with_capacity(SYNTHETIC_TOKENS);
        let mut cur = 0u16;
        for _ in 0..SYNTHETIC_TOKENS {
            tokens.push(cur);
            cur = if rng.random_bool(0.9) {
                successors[usize::from(cur)][rng.random_range(0..4)]
            } else {
                rng.random_range(0..vocab) as u16
            };
        }
        Corpus { tokens }
    }

    /// Splits off the last `fraction` of the tokens (for validation): the
    /// training part, and the held-out part when `fraction` > 0.
    pub fn split_tail(mut self, fraction: f64) -> (Corpus, Option<Corpus>) {
        if fraction <= 0.0 {
            return (self, None);
        }
        let held = (self.tokens.len() as f64 * fraction) as usize;
        let tail = self
            .tokens
            .split_off(self.tokens.len() - held.min(self.tokens.len()));
        (self, Some(Corpus { tokens: tail }))
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// Inputs and next-token targets of one micro-batch, row-major `[rows, seq_len]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Input tokens.
    pub inputs: Vec<u32>,
    /// Targets (inputs shifted by one).
    pub targets: Vec<u32>,
    /// Sequences.
    pub rows: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
}

/// This rank's share of every global batch.
#[derive(Debug)]
pub struct Batcher {
    corpus: Corpus,
    seq_len: usize,
    micro_batch: usize,
    grad_accum: usize,
    world: usize,
    rank: usize,
    seed: u64,
    windows: usize,
    epoch: Option<(u64, Vec<u32>)>,
    /// Resumed runs: the step and global sample the run restarted at.
    base_step: u64,
    base_sample: u64,
}

impl Batcher {
    /// A batcher for `rank` of `world`.
    pub fn new(
        corpus: Corpus,
        seq_len: usize,
        micro_batch: usize,
        grad_accum: usize,
        world: usize,
        rank: usize,
        seed: u64,
    ) -> Result<Batcher, DataError> {
        let windows = corpus.len().saturating_sub(1) / seq_len;
        if windows == 0 {
            return Err(DataError::Invalid(format!(
                "{} tokens cannot fill one sequence of seq_len + 1 = {}",
                corpus.len(),
                seq_len + 1
            )));
        }
        Ok(Batcher {
            corpus,
            seq_len,
            micro_batch,
            grad_accum,
            world,
            rank,
            seed,
            windows,
            epoch: None,
            base_step: 0,
            base_sample: 0,
        })
    }

    /// Windows in one epoch.
    pub fn windows(&self) -> usize {
        self.windows
    }

    fn window_of(&mut self, sample: u64) -> usize {
        let epoch = sample / self.windows as u64;
        if self.epoch.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let mut perm: Vec<u32> = (0..self.windows as u32).collect();
            perm.shuffle(&mut ChaCha8Rng::seed_from_u64(
                self.seed.wrapping_add(epoch.wrapping_mul(0x1000_0001)),
            ));
            self.epoch = Some((epoch, perm));
        }
        let (_, perm) = self.epoch.as_ref().expect("set above");
        perm[(sample % self.windows as u64) as usize] as usize
    }

    fn per_step(&self) -> u64 {
        (self.micro_batch * self.grad_accum * self.world) as u64
    }

    /// Continues a run that had consumed `samples` global samples after `step`
    /// steps (perhaps with another world size or batch split).
    pub fn resume_at(&mut self, step: u64, samples: u64) {
        self.base_step = step;
        self.base_sample = samples;
    }

    /// Global samples consumed once `steps` steps are done.
    pub fn samples_consumed(&self, steps: u64) -> u64 {
        self.base_sample + steps.saturating_sub(self.base_step) * self.per_step()
    }

    /// This rank's micro-batch `micro` of optimizer step `step` (both 0-based).
    pub fn batch(&mut self, step: u64, micro: usize) -> Batch {
        let first = self.samples_consumed(step)
            + ((micro * self.world + self.rank) * self.micro_batch) as u64;
        let t = self.seq_len;
        let mut inputs = Vec::with_capacity(self.micro_batch * t);
        let mut targets = Vec::with_capacity(self.micro_batch * t);
        for i in 0..self.micro_batch as u64 {
            let start = self.window_of(first + i) * t;
            let w = &self.corpus.tokens[start..start + t + 1];
            inputs.extend(w[..t].iter().map(|&x| u32::from(x)));
            targets.extend(w[1..].iter().map(|&x| u32::from(x)));
        }
        Batch {
            inputs,
            targets,
            rows: self.micro_batch,
            seq_len: t,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counting(n: usize) -> Corpus {
        Corpus {
            tokens: (0..n).map(|i| i as u16).collect(),
        }
    }

    #[test]
    fn ranks_read_disjoint_samples_and_the_split_does_not_change_the_global_batch() {
        let one = |accum, world, rank| {
            Batcher::new(counting(10_000), 16, 4, accum, world, rank, 9).unwrap()
        };
        // 1 worker, 2 micro-batches == 2 workers, 1 micro-batch each.
        let mut solo = one(2, 1, 0);
        let (mut r0, mut r1) = (one(1, 2, 0), one(1, 2, 1));
        for step in 0..5 {
            assert_eq!(solo.batch(step, 0), r0.batch(step, 0));
            assert_eq!(solo.batch(step, 1), r1.batch(step, 0));
            assert_ne!(r0.batch(step, 0).inputs, r1.batch(step, 0).inputs);
        }
        let b = r0.batch(0, 0);
        assert_eq!(b.inputs.len(), 64);
        for row in 0..4 {
            // Targets are inputs shifted by one.
            assert_eq!(b.targets[row * 16], b.inputs[row * 16] + 1);
        }
    }

    #[test]
    fn a_resumed_batcher_continues_at_the_same_sample_with_another_split() {
        let two = Batcher::new(counting(10_000), 16, 4, 1, 2, 0, 9).unwrap();
        let consumed = two.samples_consumed(3);
        assert_eq!(consumed, 24);
        // Resume on 1 rank with 8 sequences: its step 3 is what ranks 0 and 1 would have read.
        let mut one = Batcher::new(counting(10_000), 16, 8, 1, 1, 0, 9).unwrap();
        one.resume_at(3, consumed);
        let mut r0 = Batcher::new(counting(10_000), 16, 4, 1, 2, 0, 9).unwrap();
        let mut r1 = Batcher::new(counting(10_000), 16, 4, 1, 2, 1, 9).unwrap();
        let mut want = r0.batch(3, 0).inputs;
        want.extend(r1.batch(3, 0).inputs);
        assert_eq!(one.batch(3, 0).inputs, want);
    }

    #[test]
    fn an_epoch_visits_every_window_once() {
        let mut b = Batcher::new(counting(1601), 16, 1, 1, 1, 0, 3).unwrap();
        assert_eq!(b.windows(), 100);
        let mut seen: Vec<u32> = (0..100).map(|s| b.batch(s, 0).inputs[0]).collect();
        seen.sort();
        assert_eq!(seen, (0..100).map(|w| w * 16).collect::<Vec<_>>());
    }

    #[test]
    fn text_and_token_files_load_and_bad_ids_are_refused() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a.txt"), b"hello").unwrap();
        std::fs::write(d.path().join("b.txt"), b" world").unwrap();
        let pat = Some(format!("{}/*.txt", d.path().display()));
        let c = Corpus::load(&pat, DataFormat::Text, 256, 0).unwrap();
        assert_eq!(c.len(), 11);
        std::fs::write(d.path().join("t.bin"), [1u8, 0, 200, 0]).unwrap();
        let pat = Some(format!("{}/t.bin", d.path().display()));
        assert_eq!(
            Corpus::load(&pat, DataFormat::TokensU16, 256, 0)
                .unwrap()
                .len(),
            2
        );
        let e = Corpus::load(&pat, DataFormat::TokensU16, 100, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("token 200 at index 1"), "{e}");
    }

    #[test]
    fn synthetic_corpus_is_seeded() {
        assert_eq!(
            Corpus::synthetic(50, 1).tokens,
            Corpus::synthetic(50, 1).tokens
        );
        assert_ne!(
            Corpus::synthetic(50, 1).tokens,
            Corpus::synthetic(50, 2).tokens
        );
    }

    #[test]
    fn the_held_out_tail_is_disjoint_from_training_data() {
        let (train, val) = counting(1000).split_tail(0.1);
        let val = val.unwrap();
        assert_eq!((train.len(), val.len()), (900, 100));
        assert_eq!((train.tokens[899], val.tokens[0]), (899, 900));
        let (all, none) = counting(10).split_tail(0.0);
        assert!(none.is_none() && all.len() == 10);
    }
}
