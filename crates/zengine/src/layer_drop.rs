//! Which blocks a micro-batch runs under `train.progressive_layer_drop`
//! ([`zconfig::layer_drop`]): each block's fate drawn from its chance to
//! run, the same on every rank, and the scale a block that runs puts on
//! its residual branches.

use zconfig::layer_drop::LayerDropSpec;
use zmodel::dropout::{mix64, BlockDropout, Dropout};

/// One micro-batch's blocks: per block (1-based, at `b − 1`), `None` where
/// it is skipped, else what its residual branches are multiplied by
/// (`1 / p`, 1 where it always runs).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BlockFates {
    scales: Vec<Option<f32>>,
}

impl BlockFates {
    /// Every one of `n_layers` blocks runs, unscaled.
    pub(crate) fn all(n_layers: usize) -> BlockFates {
        BlockFates {
            scales: vec![Some(1.0); n_layers],
        }
    }

    /// The fates of micro-batch `micro` of 0-based step `step` under `pld`:
    /// block `l` runs where a uniform draw keyed by the seed, the step, the
    /// micro-batch and `l` (not the rank) falls below its chance `p_l`.
    pub(crate) fn draw(
        pld: &LayerDropSpec,
        seed: u64,
        (step, micro): (u64, u64),
        n_layers: usize,
    ) -> BlockFates {
        let key = [step, micro]
            .iter()
            .fold(mix64(seed ^ 0x0050_4C44), |k, &c| mix64(k ^ c));
        let scales = (1..=n_layers)
            .map(|l| {
                let p = pld.keep_probability(step, l, n_layers);
                // 53 bits: a uniform draw in [0, 1).
                let u = (mix64(key ^ l as u64) >> 11) as f64 / (1u64 << 53) as f64;
                (u < p).then(|| (1.0 / p) as f32)
            })
            .collect();
        BlockFates { scales }
    }

    /// Whether block `b` (1-based) runs.
    pub(crate) fn runs(&self, b: usize) -> bool {
        self.scales[b - 1].is_some()
    }

    /// Block `b`'s dropouts, its residual branches' scaled by `1 / p`:
    /// the hidden dropout's kept elements, or, without one, every element
    /// (a dropout that drops nothing).
    pub(crate) fn dropout(&self, b: usize, d: BlockDropout) -> BlockDropout {
        match self.scales[b - 1] {
            Some(s) if s != 1.0 => BlockDropout {
                hidden: Some(match d.hidden {
                    Some(h) => h.scaled(s),
                    None => Dropout::scale_only(s),
                }),
                ..d
            },
            _ => d,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Draws depend on the step and the micro-batch, not on anything else;
    /// over many micro-batches each block runs about as often as its
    /// chance says, and its scale is 1 over that chance.
    #[test]
    fn blocks_run_as_often_as_their_chance_says() {
        let pld = LayerDropSpec {
            theta: 0.5,
            gamma: 0.01,
        };
        let (l, step, n) = (6, 200, 20_000);
        assert_eq!(
            BlockFates::draw(&pld, 7, (step, 3), l),
            BlockFates::draw(&pld, 7, (step, 3), l)
        );
        let mut runs = vec![0usize; l];
        for micro in 0..n {
            let f = BlockFates::draw(&pld, 7, (step, micro), l);
            for b in 1..=l {
                if f.runs(b) {
                    runs[b - 1] += 1;
                    let p = pld.keep_probability(step, b, l);
                    assert_eq!(f.scales[b - 1], Some((1.0 / p) as f32));
                }
            }
        }
        for (b, &r) in (1..=l).zip(&runs) {
            let p = pld.keep_probability(step, b, l);
            let sd = (p * (1.0 - p) / n as f64).sqrt();
            let got = r as f64 / n as f64;
            assert!((got - p).abs() < 5.0 * sd, "block {b}: {got} for {p}");
        }
        // Another step draws other fates.
        let other = (0..50).filter(|&m| {
            BlockFates::draw(&pld, 7, (step, m), l) != BlockFates::draw(&pld, 7, (step + 1, m), l)
        });
        assert!(other.count() > 10);
        // At the start every block runs, unscaled.
        assert_eq!(BlockFates::draw(&pld, 7, (1, 0), l), BlockFates::all(l));
    }

    /// A block that runs with chance p scales its branches by 1/p: through
    /// the hidden dropout where there is one, else through a dropout that
    /// drops nothing.
    #[test]
    fn a_scaled_block_multiplies_its_branches() {
        let f = BlockFates {
            scales: vec![Some(1.0), Some(2.0), None],
        };
        let plain = BlockDropout::default();
        assert_eq!(f.dropout(1, plain), plain);
        let h = f.dropout(2, plain).hidden.expect("a scale");
        assert_eq!((h.threshold(), h.scale()), (0, 2.0));
        let d = Dropout::new(0.2, 9).unwrap();
        let with = BlockDropout {
            hidden: Some(d),
            attention: None,
        };
        let h = f.dropout(2, with).hidden.unwrap();
        assert_eq!((h.threshold(), h.scale()), (d.threshold(), d.scale() * 2.0));
        assert!(f.runs(2) && !f.runs(3));
    }
}
