//! Whole documents packed into sequences, best fit decreasing
//! (`data.packing: bfd`).
//!
//! By default a sequence is a window of the token stream, so a document
//! longer than what is left of a window goes on in the next one: its tail
//! trains without its head (a fine-tuning conversation's answer without
//! its question). Packed, every sequence holds whole documents: each
//! document, longest first, goes into the sequence with the least room
//! that still fits it, or opens a new one; what is left of a sequence is
//! padding that nothing is trained on, and a document longer than a
//! sequence keeps its first tokens only. This is TRL's `pack_dataset(...,
//! strategy="bfd")`, its default for SFT, with the same order: documents by
//! decreasing length (ties in corpus order), the fullest fitting sequence,
//! among equals the first opened, sequences in the order they were opened.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

/// Sequences of whole documents: for each, its documents' token ranges in
/// the corpus, in the order they went in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packed {
    /// Every sequence's documents, one sequence after another.
    pieces: Vec<Range<usize>>,
    /// Where each sequence's documents begin in `pieces` (one more entry
    /// than sequences).
    starts: Vec<usize>,
    /// Documents cut to the capacity, and the tokens they lost.
    cut: (usize, usize),
}

impl Packed {
    /// Packs `documents` (token ranges of the corpus) into sequences of at
    /// most `capacity` tokens, best fit decreasing; a document longer than
    /// `capacity` keeps its first `capacity` tokens.
    ///
    /// # Panics
    ///
    /// A `capacity` of 0.
    pub fn best_fit_decreasing(documents: &[Range<usize>], capacity: usize) -> Packed {
        assert!(capacity > 0, "packing: sequences of no tokens");
        let cut = |d: &Range<usize>| d.start..d.end.min(d.start + capacity);
        let mut order: Vec<usize> = (0..documents.len())
            .filter(|&i| !documents[i].is_empty())
            .collect();
        // Longest first; a stable sort keeps ties in corpus order.
        order.sort_by_key(|&i| std::cmp::Reverse(cut(&documents[i]).len()));
        // Per room left: the sequences with that much, the first opened first.
        let mut by_room: BTreeMap<usize, VecDeque<usize>> = BTreeMap::new();
        let mut sequences: Vec<Vec<usize>> = Vec::new();
        for i in order {
            let len = cut(&documents[i]).len();
            let fitting = by_room.range_mut(len..).next().map(|(&room, seqs)| {
                let s = seqs.pop_front().expect("no empty room lists are kept");
                (room, s, seqs.is_empty())
            });
            let (room, s) = match fitting {
                Some((room, s, emptied)) => {
                    if emptied {
                        by_room.remove(&room);
                    }
                    (room, s)
                }
                None => {
                    sequences.push(Vec::new());
                    (capacity, sequences.len() - 1)
                }
            };
            sequences[s].push(i);
            if room > len {
                by_room.entry(room - len).or_default().push_back(s);
            }
        }
        let mut pieces = Vec::with_capacity(documents.len());
        let mut starts = vec![0];
        for seq in sequences {
            pieces.extend(seq.into_iter().map(|i| cut(&documents[i])));
            starts.push(pieces.len());
        }
        let long = documents.iter().filter(|d| d.len() > capacity);
        let cut = long.fold((0, 0), |(n, lost), d| (n + 1, lost + d.len() - capacity));
        Packed {
            pieces,
            starts,
            cut,
        }
    }

    /// Documents longer than a sequence, which keep their first tokens
    /// only, and the tokens they lose.
    pub fn cut(&self) -> (usize, usize) {
        self.cut
    }

    /// Documents packed.
    pub fn documents(&self) -> usize {
        self.pieces.len()
    }

    /// Tokens of the documents in the sequences.
    pub fn tokens(&self) -> usize {
        self.pieces.iter().map(|d| d.len()).sum()
    }

    /// Sequences.
    pub fn len(&self) -> usize {
        self.starts.len() - 1
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sequence `k`'s documents, in order.
    pub fn sequence(&self, k: usize) -> &[Range<usize>] {
        &self.pieces[self.starts[k]..self.starts[k + 1]]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TRL's documented example of `pack_dataset(..., seq_length=4,
    /// strategy="bfd")`: documents of 5, 2, 3 and 1 tokens become [the 5
    /// cut to 4], [the 3, the 1], [the 2].
    #[test]
    fn packs_as_trl_does() {
        let docs = [0..5, 5..7, 7..10, 10..11];
        let p = Packed::best_fit_decreasing(&docs, 4);
        assert_eq!(p.len(), 3);
        assert_eq!(p.sequence(0), std::slice::from_ref(&(0..4)));
        assert_eq!(p.sequence(1), [7..10, 10..11]);
        assert_eq!(p.sequence(2), std::slice::from_ref(&(5..7)));
        assert_eq!((p.cut(), p.documents(), p.tokens()), ((1, 1), 4, 10));
    }

    /// Every document lands whole in exactly one sequence of at most the
    /// capacity, and each goes where it fits tightest: no sequence opened
    /// later could have taken a document that an earlier one holds.
    #[test]
    fn every_document_lands_whole_where_it_fits_best() {
        let lens = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 1, 3];
        let mut docs = Vec::new();
        let mut at = 0;
        for len in lens {
            docs.push(at..at + len);
            at += len;
        }
        let p = Packed::best_fit_decreasing(&docs, 10);
        let mut seen: Vec<Range<usize>> =
            (0..p.len()).flat_map(|k| p.sequence(k).to_vec()).collect();
        for k in 0..p.len() {
            let used: usize = p.sequence(k).iter().map(|d| d.len()).sum();
            assert!(used <= 10, "sequence {k}: {used}");
        }
        seen.sort_by_key(|d| d.start);
        assert_eq!(seen, docs);
        // 53 tokens in sequences of 10: six at least, and bfd needs no more.
        assert_eq!(p.len(), 6);
        assert_eq!(p.sequence(0), [docs[2].clone(), docs[3].clone()]);
    }
}
