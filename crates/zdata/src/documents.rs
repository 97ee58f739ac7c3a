//! Documents packed into one sequence, kept apart (`data.separate_documents`).
//!
//! zrun packs its corpus: a sequence is a window of the token stream, and a
//! short document shares it with the end of one before and the start of one
//! after. By default a token attends to every earlier token of its window,
//! documents before its own included. Kept apart, a document's tokens attend
//! only to their own document's earlier tokens, count positions from its
//! first token (rotary angles, GPT-2's position rows), and the target after
//! an end-of-text id (the next document's first token, which nothing of its
//! own document comes before) is not trained on: what TRL's padding-free
//! packing (`position_ids` restarting per sequence, Hugging Face's
//! `DataCollatorWithFlattening`) and Megatron's `reset_attention_mask`,
//! `reset_position_ids` and `eod_mask_loss` compute. A window's first
//! tokens, the tail of a document that began in an earlier window, are a
//! document of their own from position 0.
//!
//! Attention with documents is causal attention whose query row `i` sees
//! keys `first(i)..=i` (a lower bound per row on top of the causal upper
//! one), so one number a token says all: where its document begins in its
//! sequence.

use std::sync::Arc;

/// Where each token's document begins, for every sequence of a batch.
/// Cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Documents {
    /// Tokens per sequence.
    seq_len: usize,
    /// Per token of the batch (`[rows · seq_len]`, row-major): the index in
    /// its sequence of its document's first token.
    first: Arc<[u32]>,
}

impl Documents {
    /// The documents of `inputs` (`[rows, seq_len]`, row-major): a document
    /// ends with each `eos` (included) and the next one begins after it.
    ///
    /// # Panics
    ///
    /// `inputs` that are not whole sequences of `seq_len` tokens.
    pub fn after_eos(inputs: &[u32], seq_len: usize, eos: u32) -> Documents {
        assert!(
            seq_len > 0 && inputs.len().is_multiple_of(seq_len),
            "documents: {} tokens are not whole sequences of {seq_len}",
            inputs.len()
        );
        let mut first = Vec::with_capacity(inputs.len());
        for seq in inputs.chunks_exact(seq_len) {
            let mut begins = 0u32;
            for (i, &id) in seq.iter().enumerate() {
                first.push(begins);
                if id == eos {
                    begins = i as u32 + 1;
                }
            }
        }
        Documents {
            seq_len,
            first: first.into(),
        }
    }

    /// Documents from `first`: per token of whole sequences of `seq_len`
    /// (row-major), where its document begins in its sequence.
    ///
    /// # Panics
    ///
    /// `first` that is not whole sequences, or a token whose document
    /// begins after it.
    pub fn from_firsts(first: Vec<u32>, seq_len: usize) -> Documents {
        assert!(
            seq_len > 0 && first.len().is_multiple_of(seq_len),
            "documents: {} tokens are not whole sequences of {seq_len}",
            first.len()
        );
        for (i, &f) in first.iter().enumerate() {
            assert!(
                f as usize <= i % seq_len,
                "documents: token {i}'s document begins at {f}, after it"
            );
        }
        Documents {
            seq_len,
            first: first.into(),
        }
    }

    /// The bounds of sliding-window attention (`model.sliding_window`) for
    /// `rows` sequences of `seq_len`: token `i` of a sequence sees keys from
    /// `i + 1 − window` on (at most `window` keys, itself included), and not
    /// before its document's first where `docs` keeps documents apart.
    /// Attention's bounds only: positions stay those of `docs`. A window
    /// narrows each row from below as a document does, and the bounds still
    /// rise down a sequence, which is all that attention's skipping of
    /// masked blocks assumes.
    ///
    /// # Panics
    ///
    /// A `window` of 0, or `docs` of another batch shape.
    pub fn windowed(
        docs: Option<&Documents>,
        rows: usize,
        seq_len: usize,
        window: usize,
    ) -> Documents {
        assert!(window > 0, "documents: a window of 0 keys");
        if let Some(d) = docs {
            assert!(
                d.seq_len == seq_len && d.tokens() == rows * seq_len,
                "documents: {} tokens in sequences of {} for [{rows}, {seq_len}]",
                d.tokens(),
                d.seq_len
            );
        }
        let first = (0..rows * seq_len)
            .map(|i| {
                let from = (i % seq_len + 1).saturating_sub(window) as u32;
                docs.map_or(from, |d| d.first[i].max(from))
            })
            .collect();
        Documents { seq_len, first }
    }

    /// Tokens per sequence.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Tokens in the batch.
    pub fn tokens(&self) -> usize {
        self.first.len()
    }

    /// Per token of the batch (row-major): where its document begins in
    /// its sequence.
    pub fn per_token(&self) -> &[u32] {
        &self.first
    }

    /// Per token of sequence `row`: where its document begins.
    pub fn firsts(&self, row: usize) -> &[u32] {
        &self.first[row * self.seq_len..][..self.seq_len]
    }

    /// The position of the batch's token `i` (row-major) in its document.
    pub fn position(&self, i: usize) -> usize {
        i % self.seq_len - self.first[i] as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_document_runs_to_its_eos_and_positions_restart_after_it() {
        // Two sequences of 5; eos = 9.
        let d = Documents::after_eos(&[1, 9, 2, 3, 9, 9, 4, 9, 5, 6], 5, 9);
        assert_eq!(d.firsts(0), [0, 0, 2, 2, 2]);
        assert_eq!(d.firsts(1), [0, 1, 1, 3, 3]);
        let positions: Vec<usize> = (0..10).map(|i| d.position(i)).collect();
        assert_eq!(positions, [0, 1, 0, 1, 2, 0, 0, 1, 0, 1]);
        assert_eq!(d.tokens(), 10);
    }

    #[test]
    fn a_window_bounds_each_row_from_below_and_keeps_the_documents_positions() {
        let w = Documents::windowed(None, 2, 5, 2);
        assert_eq!(w.firsts(0), [0, 0, 1, 2, 3]);
        assert_eq!(w.firsts(1), [0, 0, 1, 2, 3]);
        // With documents the later bound wins: [0, 0, 2, 2, 2] and
        // [0, 1, 1, 3, 3] narrowed to 3 keys.
        let d = Documents::after_eos(&[1, 9, 2, 3, 9, 9, 4, 9, 5, 6], 5, 9);
        let w = Documents::windowed(Some(&d), 2, 5, 3);
        assert_eq!(w.firsts(0), [0, 0, 2, 2, 2]);
        assert_eq!(w.firsts(1), [0, 1, 1, 3, 3]);
        let w = Documents::windowed(Some(&d), 2, 5, 1);
        assert_eq!(w.firsts(0), [0, 1, 2, 3, 4]);
        // A window as long as the sequence changes nothing.
        assert_eq!(Documents::windowed(Some(&d), 2, 5, 5), d);
    }
}
