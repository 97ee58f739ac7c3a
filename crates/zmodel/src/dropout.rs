//! Dropout of hidden states (`model.hidden_dropout`) and of attention's
//! probabilities (`model.attention_dropout`, applied inside
//! [`crate::attention`]), with masks that are computed, never stored.
//!
//! Each element's fate is a hash of its index in the tensor and a 32-bit key
//! (a counter-based generator, as Philox is to cuRAND): the key says which
//! step, micro-batch, rank, block and site the tensor is, so the mask can be
//! made again wherever it is needed. Backward multiplies by the mask its
//! forward used without keeping it (no byte an element of memory, as PyTorch
//! keeps), activation checkpointing's recomputed forward drops the same
//! elements, and a run's masks do not depend on its ZeRO stage, its thread
//! count or whether it resumed, so those stay bit-identical to each other.
//!
//! The hash is Chris Wellons' `lowbias32` of the index spread by the golden
//! ratio and mixed with the key: a bijection of 32-bit words for each key,
//! so every key drops the share `p` of all 2³² indices exactly and any run
//! of indices within sampling error of it (tested). A kept element is
//! scaled by `1 / (1 - p)` (PyTorch's inverted dropout), so the expected
//! value is the input's and evaluation needs no rescaling.

use candle_core::{Result, Tensor};
use rayon::prelude::*;

use crate::ops::cpu_f32;
use crate::simd::{assume_init, uninit_floats, vectorised};

/// Elements a rayon task takes.
const ELEMS_PER_TASK: usize = 1 << 15;

/// One tensor's dropout: the share of elements dropped and the key that
/// says which.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    /// Indices whose hash falls below this are dropped: `p · 2³²`.
    threshold: u32,
    /// What the kept elements are multiplied by: `1 / (1 - p)`.
    scale: f32,
    key: u32,
}

impl Dropout {
    /// Dropout of the share `p` (in `[0, 1)`, as `model.hidden_dropout` is
    /// held to) under `key`, or `None` where `p` drops nothing.
    pub fn new(p: f64, key: u64) -> Option<Dropout> {
        debug_assert!(p < 1.0, "dropout of {p}");
        let threshold = (p * 4_294_967_296.0).round();
        if threshold < 1.0 {
            return None;
        }
        Some(Dropout {
            threshold: threshold.min(f64::from(u32::MAX)) as u32,
            scale: (1.0 / (1.0 - p)) as f32,
            key: (mix64(key) >> 32) as u32,
        })
    }

    /// The dropout of another tensor under the same setting: `site` names
    /// it (a block, or a place within one), its key derived from this one's.
    pub fn site(self, site: u64) -> Dropout {
        Dropout {
            key: (mix64(u64::from(self.key) << 32 | site) >> 32) as u32,
            ..self
        }
    }

    /// No element dropped, every one multiplied by `scale`: a residual
    /// branch's scale under progressive layer dropping where the block has
    /// no dropout of its own.
    pub fn scale_only(scale: f32) -> Dropout {
        Dropout {
            threshold: 0,
            scale,
            key: 0,
        }
    }

    /// This dropout with its kept elements multiplied by `by` as well.
    pub fn scaled(self, by: f32) -> Dropout {
        Dropout {
            scale: self.scale * by,
            ..self
        }
    }

    /// Indices whose hash falls below this are dropped (`p · 2³²`).
    pub fn threshold(&self) -> u32 {
        self.threshold
    }

    /// What the kept elements are multiplied by (`1 / (1 - p)`).
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// The 32-bit key the hash mixes in (for a GPU that drops the same).
    pub fn key(&self) -> u32 {
        self.key
    }

    /// Whether element `i` is kept.
    #[inline(always)]
    pub fn keeps(&self, i: usize) -> bool {
        hash(self.key, i) >= self.threshold
    }

    /// `x` (f32) with the dropped elements zeroed and the rest scaled:
    /// dropout's forward, and its backward applied to the output's gradient.
    /// Read in place, one pass.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let d = *self;
        map_elements(
            "dropout",
            x,
            #[inline(always)]
            move |i, x| d.apply_one(i, x),
        )
    }

    /// `residual + dropout(branch)` (both f32) in one pass: a block's residual add
    /// with its branch dropped. Its backward passes the gradient to
    /// `residual` as it is and to `branch` through [`Dropout::apply`].
    pub fn add_to(&self, residual: &Tensor, branch: &Tensor) -> Result<Tensor> {
        if residual.dims() != branch.dims() {
            candle_core::bail!(
                "dropout: a residual {:?} and a branch {:?}",
                residual.dims(),
                branch.dims()
            );
        }
        let (residual, branch) = (residual.contiguous()?, branch.contiguous()?);
        let (r_storage, r_layout) = residual.storage_and_layout();
        let (b_storage, b_layout) = branch.storage_and_layout();
        let rs = cpu_f32("dropout", &r_storage, r_layout)?;
        let bs = cpu_f32("dropout", &b_storage, b_layout)?;
        let mut y = uninit_floats(rs.len());
        let d = *self;
        y.par_chunks_mut(ELEMS_PER_TASK)
            .zip(rs.par_chunks(ELEMS_PER_TASK))
            .zip(bs.par_chunks(ELEMS_PER_TASK))
            .enumerate()
            .with_max_len(1)
            .for_each(|(task, ((y, r), b))| {
                let first = task * ELEMS_PER_TASK;
                vectorised(
                    #[inline(always)]
                    || {
                        for (j, ((y, &r), &b)) in y.iter_mut().zip(r).zip(b).enumerate() {
                            y.write(r + d.apply_one(first + j, b));
                        }
                    },
                )
            });
        // SAFETY: the chunks of y match those of rs; every element was written.
        let y = unsafe { assume_init(y) };
        Tensor::from_vec(y, residual.shape(), residual.device())
    }

    /// [`Dropout::apply`] of a run of elements whose first has index `at`,
    /// in place: a row of attention's probabilities (or their gradient).
    #[inline(always)]
    pub fn apply_in_place(&self, xs: &mut [f32], at: usize) {
        for (j, x) in xs.iter_mut().enumerate() {
            *x = self.apply_one(at + j, *x);
        }
    }

    /// Element `i`, of value `x`, after dropout.
    #[inline(always)]
    pub fn apply_one(&self, i: usize, x: f32) -> f32 {
        match self.keeps(i) {
            true => x * self.scale,
            false => 0.0,
        }
    }
}

/// NEFTune's noise (`train.neftune_noise_alpha`, transformers' and TRL's
/// `neftune_noise_alpha`): each element of the embeddings' output plus a
/// uniform draw from `[−mag, mag)`, `mag = alpha / √(t·d)` for sequences of
/// `t` tokens of width `d`, the draw a hash of its index under a key as
/// [`Dropout`]'s. Added in training only; its gradient is the output's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Noise {
    mag: f32,
    key: u32,
}

impl Noise {
    /// NEFTune's noise of `alpha` for sequences of `t` tokens of width `d`
    /// under `key`, or `None` where `alpha` is 0.
    pub fn new(alpha: f64, (t, d): (usize, usize), key: u64) -> Option<Noise> {
        (alpha > 0.0).then(|| Noise {
            mag: (alpha / ((t * d) as f64).sqrt()) as f32,
            key: (mix64(key) >> 32) as u32,
        })
    }

    /// Half the draws' range: `alpha / √(t·d)`.
    pub fn magnitude(&self) -> f32 {
        self.mag
    }

    /// The 32-bit key the hash mixes in.
    pub fn key(&self) -> u32 {
        self.key
    }

    /// Element `i`'s draw, in `[−mag, mag)`.
    #[inline(always)]
    pub fn draw(&self, i: usize) -> f32 {
        // 24 bits: every value exact in f32.
        let unit = (hash(self.key, i) >> 8) as f32 * (1.0 / (1u32 << 24) as f32);
        (2.0 * unit - 1.0) * self.mag
    }

    /// `x` (f32) plus the noise, in one pass.
    pub fn add_to(&self, x: &Tensor) -> Result<Tensor> {
        let n = *self;
        map_elements(
            "neftune",
            x,
            #[inline(always)]
            move |i, x| x + n.draw(i),
        )
    }
}

/// A block's dropouts: of its residual branches (`model.hidden_dropout`)
/// and of its attention's probabilities (`model.attention_dropout`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BlockDropout {
    /// The residual branches' (and, at site 0, the embeddings').
    pub hidden: Option<Dropout>,
    /// Attention's probabilities.
    pub attention: Option<Dropout>,
}

impl BlockDropout {
    /// Both dropouts at `site` (a block's number): [`Dropout::site`].
    pub fn site(self, site: u64) -> BlockDropout {
        BlockDropout {
            hidden: self.hidden.map(|d| d.site(site)),
            attention: self.attention.map(|d| d.site(site)),
        }
    }
}

/// `f(i, x)` of every element `x` (at index `i`) of the f32 tensor `x`,
/// read in place, in tasks over rayon's threads, each vectorised (`f`
/// marked `#[inline(always)]` by the caller, so that it is compiled into
/// the vectorised loop).
fn map_elements(
    name: &str,
    x: &Tensor,
    f: impl Fn(usize, f32) -> f32 + Sync + Copy,
) -> Result<Tensor> {
    let x = x.contiguous()?;
    let (storage, layout) = x.storage_and_layout();
    let xs = cpu_f32(name, &storage, layout)?;
    let mut y = uninit_floats(xs.len());
    y.par_chunks_mut(ELEMS_PER_TASK)
        .zip(xs.par_chunks(ELEMS_PER_TASK))
        .enumerate()
        .with_max_len(1)
        .for_each(|(task, (y, x))| {
            let first = task * ELEMS_PER_TASK;
            vectorised(
                #[inline(always)]
                || {
                    for (j, (y, &x)) in y.iter_mut().zip(x).enumerate() {
                        y.write(f(first + j, x));
                    }
                },
            )
        });
    // SAFETY: the chunks of y match those of xs; every element was written.
    let y = unsafe { assume_init(y) };
    Tensor::from_vec(y, x.shape(), x.device())
}

/// `lowbias32` (Chris Wellons' hash prospector) of index `i` spread by the
/// golden ratio and mixed with `key`; the bits above 32 of `i` are mixed in
/// too, so tensors of more than 2³² elements repeat no mask.
#[inline(always)]
fn hash(key: u32, i: usize) -> u32 {
    let i = i as u64;
    let mut x =
        (i as u32).wrapping_mul(0x9E37_79B9) ^ key ^ ((i >> 32) as u32).wrapping_mul(0x85EB_CA6B);
    x ^= x >> 16;
    x = x.wrapping_mul(0x7FEB_352D);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846C_A68B);
    x ^ (x >> 16)
}

/// SplitMix64's finaliser: keys from counters (step, rank, block) that
/// differ in a few low bits become unrelated words.
pub fn mix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn ones(n: usize) -> Tensor {
        Tensor::ones(n, candle_core::DType::F32, &Device::Cpu).unwrap()
    }

    /// Every key drops its share: over a million elements within 5 standard
    /// deviations of `p`, and the kept ones scaled so the mean stays 1.
    #[test]
    fn each_key_drops_its_share_and_keeps_the_mean() {
        let n = 1 << 20;
        for (p, key) in [(0.1, 0), (0.1, 1), (0.5, 77), (0.9, u64::MAX)] {
            let d = Dropout::new(p, key).unwrap();
            let y = d.apply(&ones(n)).unwrap().to_vec1::<f32>().unwrap();
            let dropped = y.iter().filter(|&&v| v == 0.0).count() as f64 / n as f64;
            let sd = (p * (1.0 - p) / n as f64).sqrt();
            assert!(
                (dropped - p).abs() < 5.0 * sd,
                "p {p} key {key}: dropped {dropped}"
            );
            let kept = y.iter().find(|&&v| v != 0.0).unwrap();
            assert_eq!(*kept, (1.0 / (1.0 - p)) as f32);
            let mean = y.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
            assert!(
                (mean - 1.0).abs() < 5.0 * sd / (1.0 - p),
                "p {p}: mean {mean}"
            );
        }
    }

    /// Neighbouring elements, and the same element under neighbouring keys
    /// or sites, fall independently: the share of pairs both dropped is
    /// `p²` within sampling error.
    #[test]
    fn neighbours_and_neighbouring_keys_fall_independently() {
        let (n, p) = (1 << 20, 0.3);
        let a = Dropout::new(p, 5).unwrap();
        let pairs = [
            (a, a, 1),
            (a, Dropout::new(p, 6).unwrap(), 0),
            (a.site(1), a.site(2), 0),
            (a, a.site(0), 0),
        ];
        for (x, y, shift) in pairs {
            let both = (0..n)
                .filter(|&i| !x.keeps(i) && !y.keeps(i + shift))
                .count() as f64
                / n as f64;
            let sd = (p * p * (1.0 - p * p) / n as f64).sqrt();
            assert!((both - p * p).abs() < 5.0 * sd, "{x:?} {y:?}: both {both}");
        }
    }

    /// The same key gives the same mask in every call and over any split of
    /// the elements into tasks; `add_to` is the residual plus `apply`.
    #[test]
    fn a_key_gives_one_mask_and_add_to_is_apply_added() {
        let n = 17 * 5800; // three tasks and part of a fourth
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let r: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let x = Tensor::from_vec(x, (n / 17, 17), &Device::Cpu).unwrap();
        let r = Tensor::from_vec(r, (n / 17, 17), &Device::Cpu).unwrap();
        let d = Dropout::new(0.25, 9).unwrap().site(3);
        let y = d
            .apply(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(
            y,
            d.apply(&x)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        );
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (i, (&y, &x)) in y.iter().zip(&xs).enumerate() {
            let want = if d.keeps(i) {
                x * (1.0 / 0.75f64) as f32
            } else {
                0.0
            };
            assert_eq!(y.to_bits(), want.to_bits(), "element {i}");
        }
        let sum = d
            .add_to(&r, &x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let rs = r.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (i, s) in sum.iter().enumerate() {
            assert_eq!(s.to_bits(), (rs[i] + y[i]).to_bits(), "element {i}");
        }
    }

    /// NEFTune's draws stay within `±alpha/√(t·d)`, average 0 and spread as
    /// a uniform draw does (variance mag²/3), within sampling error.
    #[test]
    fn neftune_draws_are_uniform_within_their_bound() {
        let n = Noise::new(5.0, (256, 64), 7).unwrap();
        let mag = 5.0 / (256.0f64 * 64.0).sqrt();
        let count = 1 << 20;
        let draws: Vec<f64> = (0..count).map(|i| f64::from(n.draw(i))).collect();
        assert!(draws.iter().all(|&v| v >= -mag - 1e-7 && v < mag + 1e-7));
        let mean = draws.iter().sum::<f64>() / count as f64;
        let var = draws.iter().map(|v| v * v).sum::<f64>() / count as f64;
        let sd = mag / (3.0 * count as f64).sqrt();
        assert!(mean.abs() < 5.0 * sd, "mean {mean}");
        assert!(
            (var / (mag * mag / 3.0) - 1.0).abs() < 0.01,
            "variance {var}"
        );
        assert!(Noise::new(0.0, (256, 64), 7).is_none());
        let x = ones(1000);
        let y = n.add_to(&x).unwrap().to_vec1::<f32>().unwrap();
        for (i, y) in y.iter().enumerate() {
            assert_eq!(y.to_bits(), (1.0 + n.draw(i)).to_bits());
        }
    }

    /// A share that drops nothing is no dropout.
    #[test]
    fn a_share_that_drops_nothing_is_none() {
        assert!(Dropout::new(0.0, 1).is_none());
        assert!(Dropout::new(1e-12, 1).is_none());
        assert!(Dropout::new(0.5, 1).is_some());
    }
}
