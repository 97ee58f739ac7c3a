//! The token table's gradient as the rows a micro-batch's tokens picked.
//!
//! A micro-batch of `n` tokens changes at most `n` rows of the `vocab × d`
//! token table, yet its gradient was made whole: a zeroed `vocab × d` f32
//! buffer a micro-batch, the picked rows added into it, and then the whole
//! buffer added into the group's gradient. At GPT-2's 50,304 tokens and d 256
//! that is 51.5 MB zeroed and read again for 128 tokens' 131 kB of rows (and
//! 622 MB at a Qwen3-0.6B shape), made even where the table is frozen. Here
//! the gradient is the picked rows alone, each summed over its tokens in
//! their order from zero, which are the bits of the whole buffer's rows (the
//! other rows of it were zeros, which add nothing).

use candle_core::{Result, Tensor};
use rayon::prelude::*;

/// The embedding's gradients ([`crate::Gpt::embed_backward`]).
#[derive(Debug)]
pub struct EmbeddingGrads {
    /// The token table's, as its picked rows; `None` where it is frozen
    /// (nothing made).
    pub wte: Option<TokenRows>,
    /// GPT-2's position table's, whole (`[seq, d]`).
    pub wpe: Option<Tensor>,
}

/// The gradient of a `[vocab, width]` table that is zero outside `rows`.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRows {
    /// The rows the tokens picked, ascending, each once.
    pub rows: Vec<u32>,
    /// Their gradients, row after row (`rows.len() × width`).
    pub values: Vec<f32>,
    /// The table's width.
    pub width: usize,
}

impl TokenRows {
    /// The gradient of the table from the `tokens` that picked its rows and
    /// `dy`, the gradient of what they picked (a row of `width` a token):
    /// each picked row the sum of its tokens' rows of `dy`, in the tokens'
    /// order, from zero. An error where a token is not below `vocab` or
    /// `dy` has not a row a token.
    pub fn from_tokens(tokens: &[u32], dy: &[f32], width: usize, vocab: usize) -> Result<Self> {
        if dy.len() != tokens.len() * width {
            candle_core::bail!(
                "embedding backward: {} gradient values for {} tokens of width {width}",
                dy.len(),
                tokens.len()
            );
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            candle_core::bail!("embedding backward: token {t} outside the vocabulary of {vocab}");
        }
        // Each token with its place, by token and then place: a row's
        // tokens in their order.
        let mut picks: Vec<(u32, u32)> = (tokens.iter().enumerate())
            .map(|(i, &t)| (t, i as u32))
            .collect();
        picks.sort_unstable();
        let mut starts = Vec::new();
        let mut rows = Vec::new();
        for (i, &(t, _)) in picks.iter().enumerate() {
            if rows.last() != Some(&t) {
                rows.push(t);
                starts.push(i);
            }
        }
        starts.push(picks.len());
        let mut values = vec![0f32; rows.len() * width];
        values
            .par_chunks_mut(width.max(1))
            .zip(starts.par_windows(2))
            .with_min_len(16)
            .for_each(|(row, run)| {
                for &(_, i) in &picks[run[0]..run[1]] {
                    let src = &dy[i as usize * width..][..width];
                    row.iter_mut().zip(src).for_each(|(g, &x)| *g += x);
                }
            });
        Ok(TokenRows {
            rows,
            values,
            width,
        })
    }

    /// The whole gradient of a table of `height` rows: zeros outside the
    /// picked rows (for comparing with a reference that makes it whole).
    pub fn whole(&self, height: usize) -> Vec<f32> {
        let mut table = vec![0f32; height * self.width];
        for (r, v) in self.iter() {
            table[r * self.width..][..self.width].copy_from_slice(v);
        }
        table
    }

    /// The picked rows with their gradients, ascending.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &[f32])> {
        (self.rows.iter())
            .zip(self.values.chunks_exact(self.width.max(1)))
            .map(|(&r, v)| (r as usize, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows are the whole gradient's to the bit: a table of zeros with
    /// each token's row of `dy` added in order, as the whole buffer was
    /// made; the other rows are zeros and absent.
    #[test]
    fn the_picked_rows_are_the_whole_gradients_rows() {
        let (vocab, width) = (13, 5);
        let tokens: Vec<u32> = (0..40u32).map(|i| (i * i + 3 * i) % 11).collect();
        let dy: Vec<f32> = (0..tokens.len() * width)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut whole = vec![0f32; vocab * width];
        for (&t, row) in tokens.iter().zip(dy.chunks_exact(width)) {
            let at = t as usize * width;
            whole[at..at + width]
                .iter_mut()
                .zip(row)
                .for_each(|(g, &x)| *g += x);
        }
        let got = TokenRows::from_tokens(&tokens, &dy, width, vocab).unwrap();
        let mut picked: Vec<u32> = tokens.clone();
        picked.sort_unstable();
        picked.dedup();
        assert_eq!(got.rows, picked);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got.whole(vocab)), bits(&whole));
    }

    #[test]
    fn a_token_outside_the_vocabulary_or_a_short_gradient_is_an_error() {
        let e = TokenRows::from_tokens(&[1, 13], &[0.0; 4], 2, 13).unwrap_err();
        assert!(
            e.to_string()
                .contains("token 13 outside the vocabulary of 13"),
            "{e}"
        );
        let e = TokenRows::from_tokens(&[1, 2], &[0.0; 3], 2, 13).unwrap_err();
        assert!(
            e.to_string().contains("3 gradient values for 2 tokens"),
            "{e}"
        );
    }
}
