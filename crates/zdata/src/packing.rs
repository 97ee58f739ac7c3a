//! Whole documents packed into sequences, best fit decreasing
//! (`data.packing: bfd`, `bfd_split`).
//!
//! By default a sequence is a window of the token stream, so a document
//! longer than what is left of a window goes on in the next one: its tail
//! trains without its head (a fine-tuning conversation's answer without
//! its question). Packed, every sequence holds whole documents: each
//! document, longest first, goes into the sequence with the least room
//! that still fits it, or opens a new one; what is left of a sequence is
//! padding that nothing is trained on. A document longer than a sequence
//! keeps its first tokens only ([`Overflow::Truncate`]), or is split into
//! pieces of a sequence each, the last shorter, each packed as a document
//! of its own ([`Overflow::Split`]: no token is lost, but a piece does not
//! see the one before it). This is TRL's `pack_dataset(...,
//! strategy="bfd")`, its default for SFT, and `strategy="bfd_split"`, with
//! the same order: documents (or pieces) by decreasing length (ties in
//! corpus order), the fullest fitting sequence, among equals the first
//! opened, sequences in the order they were opened.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

/// What becomes of a document longer than a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    /// It keeps its first `capacity` tokens (TRL's `bfd`).
    Truncate,
    /// It becomes pieces of `capacity` tokens, the last shorter, each
    /// packed as a document of its own (TRL's `bfd_split`).
    Split,
}

/// Sequences of whole documents: for each, its documents' token ranges in
/// the corpus, in the order they went in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packed {
    /// Every sequence's documents (or pieces), one sequence after another.
    pieces: Vec<Range<usize>>,
    /// Where each sequence's documents begin in `pieces` (one more entry
    /// than sequences).
    starts: Vec<usize>,
    /// Documents longer than the capacity, and the tokens they lost
    /// ([`Overflow::Truncate`]) or the pieces they became
    /// ([`Overflow::Split`]).
    long: (usize, usize),
    overflow: Overflow,
}

impl Packed {
    /// Packs `documents` (token ranges of the corpus) into sequences of at
    /// most `capacity` tokens, best fit decreasing; a document longer than
    /// `capacity` is cut or split as `overflow` says.
    ///
    /// # Panics
    ///
    /// A `capacity` of 0.
    pub fn best_fit_decreasing(
        documents: &[Range<usize>],
        capacity: usize,
        overflow: Overflow,
    ) -> Packed {
        assert!(capacity > 0, "packing: sequences of no tokens");
        let long = documents.iter().filter(|d| d.len() > capacity);
        let (items, long) = match overflow {
            Overflow::Truncate => {
                let cut = |d: &Range<usize>| d.start..d.end.min(d.start + capacity);
                let lost = long.fold((0, 0), |(n, lost), d| (n + 1, lost + d.len() - capacity));
                (documents.iter().map(cut).collect::<Vec<_>>(), lost)
            }
            Overflow::Split => {
                let pieces = |d: &Range<usize>| {
                    let end = d.end;
                    (d.start..end)
                        .step_by(capacity)
                        .map(move |at| at..end.min(at + capacity))
                };
                let made = long.fold((0, 0), |(n, made), d| (n + 1, made + pieces(d).count()));
                (documents.iter().flat_map(pieces).collect(), made)
            }
        };
        let mut order: Vec<usize> = (0..items.len()).filter(|&i| !items[i].is_empty()).collect();
        // Longest first; a stable sort keeps ties in corpus order.
        order.sort_by_key(|&i| std::cmp::Reverse(items[i].len()));
        // Per room left: the sequences with that much, the first opened first.
        let mut by_room: BTreeMap<usize, VecDeque<usize>> = BTreeMap::new();
        let mut sequences: Vec<Vec<usize>> = Vec::new();
        for i in order {
            let len = items[i].len();
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
        let mut pieces = Vec::with_capacity(items.len());
        let mut starts = vec![0];
        for seq in sequences {
            pieces.extend(seq.into_iter().map(|i| items[i].clone()));
            starts.push(pieces.len());
        }
        Packed {
            pieces,
            starts,
            long,
            overflow,
        }
    }

    /// Documents longer than a sequence that kept their first tokens only
    /// ([`Overflow::Truncate`]), and the tokens they lost.
    pub fn cut(&self) -> (usize, usize) {
        match self.overflow {
            Overflow::Truncate => self.long,
            Overflow::Split => (0, 0),
        }
    }

    /// Documents longer than a sequence that were split
    /// ([`Overflow::Split`]), and the pieces they became.
    pub fn split(&self) -> (usize, usize) {
        match self.overflow {
            Overflow::Split => self.long,
            Overflow::Truncate => (0, 0),
        }
    }

    /// Documents (and pieces of split ones) packed.
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

    /// Sequence `k`'s documents (or pieces), in order.
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
        let p = Packed::best_fit_decreasing(&docs, 4, Overflow::Truncate);
        assert_eq!(p.len(), 3);
        assert_eq!(p.sequence(0), std::slice::from_ref(&(0..4)));
        assert_eq!(p.sequence(1), [7..10, 10..11]);
        assert_eq!(p.sequence(2), std::slice::from_ref(&(5..7)));
        assert_eq!((p.cut(), p.documents(), p.tokens()), ((1, 1), 4, 10));
        assert_eq!(p.split(), (0, 0));
    }

    /// TRL's documented example of `pack_dataset(..., seq_length=4,
    /// strategy="bfd_split")` on the same documents: the 5 becomes pieces
    /// of 4 and 1, and the sequences are [the 4], [the 3, the 1 of the
    /// 5], [the 2, the 1]: every token kept.
    #[test]
    fn splits_as_trl_does() {
        let docs = [0..5, 5..7, 7..10, 10..11];
        let p = Packed::best_fit_decreasing(&docs, 4, Overflow::Split);
        assert_eq!(p.len(), 3);
        assert_eq!(p.sequence(0), std::slice::from_ref(&(0..4)));
        assert_eq!(p.sequence(1), [7..10, 4..5]);
        assert_eq!(p.sequence(2), [5..7, 10..11]);
        assert_eq!((p.split(), p.documents(), p.tokens()), ((1, 2), 5, 11));
        assert_eq!(p.cut(), (0, 0));
        // A document of three capacities and a bit: pieces of 4, 4, 4, 1.
        let p = Packed::best_fit_decreasing(std::slice::from_ref(&(0..13)), 4, Overflow::Split);
        let pieces: Vec<_> = (0..p.len()).flat_map(|k| p.sequence(k).to_vec()).collect();
        assert_eq!(pieces, [0..4, 4..8, 8..12, 12..13]);
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
        let p = Packed::best_fit_decreasing(&docs, 10, Overflow::Truncate);
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
