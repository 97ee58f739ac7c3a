//! Stage 3's parameter gathers, in a known order, with prefetch.
//!
//! Every rank walks the same sequence of gathers in a micro-batch (forward
//! blocks, the head with the tied embedding, backward blocks in reverse). Knowing
//! the sequence, the prefetcher keeps the next gathers in flight while the
//! current block computes, up to `prefetch_bucket_size` elements ahead (always at
//! least the next one). With `overlap_comm: false` each gather is issued only
//! when needed and waited at once.
//!
//! ZeRO++ qwZ: a gather marked quantized sends this rank's slice as blockwise
//! int8 (or int4) codes with one f32 scale per block, packed into collective
//! words, and dequantizes the other ranks' slices on arrival; the rank's own
//! slice is used as it is. The forward gathers are marked: backward, which
//! computes the gradients, gathers full precision.

use std::collections::VecDeque;

use zcomm::{Communicator, Work};
use zquant::{Bits, Quantized};

use crate::error::EngineError;
use crate::precision::{Flat, Half};

/// How qwZ quantizes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WeightQuant {
    /// Bits per value.
    pub bits: Bits,
    /// Values per scale.
    pub block_size: usize,
}

/// One planned gather.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gather {
    /// Group index.
    pub group: usize,
    /// Sent quantized (qwZ), or in the working precision.
    pub quant: Option<WeightQuant>,
}

/// A gather in flight.
struct Pending {
    gather: Gather,
    work: Work<Vec<f32>>,
    /// This rank's slice as f32, kept to replace its quantized copy.
    own: Option<Vec<f32>>,
}

/// This rank's slice of a group, as collective words.
pub type OwnSlice<'a> = dyn FnMut(usize) -> Result<Vec<f32>, EngineError> + 'a;

/// Pending and future gathers of one micro-batch.
pub struct Prefetcher {
    order: Vec<Gather>,
    /// Per group: its padded length in elements.
    padded: Vec<usize>,
    half: Option<Half>,
    next: usize,
    pending: VecDeque<Pending>,
    budget: usize,
    overlap: bool,
}

impl Prefetcher {
    /// Gathers will be requested in `order`; `padded[g]` is group g's full
    /// length in elements of the working type `half` (f32 if `None`).
    pub fn new(
        order: Vec<Gather>,
        padded: Vec<usize>,
        half: Option<Half>,
        budget: usize,
        overlap: bool,
    ) -> Prefetcher {
        Prefetcher {
            order,
            padded,
            half,
            next: 0,
            pending: VecDeque::new(),
            budget,
            overlap,
        }
    }

    /// Returns group `g`'s full (padded) parameters; `g` must be the next in order.
    /// `own(g)` gives this rank's slice of group g as collective words.
    pub fn fetch(
        &mut self,
        g: usize,
        comm: &dyn Communicator,
        own: &mut OwnSlice<'_>,
    ) -> Result<Flat, EngineError> {
        if self.pending.is_empty() {
            self.launch_one(comm, own)?;
        }
        let p = self.pending.pop_front().expect("launched above");
        assert_eq!(
            p.gather.group, g,
            "stage-3 gathers requested out of the planned order"
        );
        if self.overlap {
            // Keep the next gathers in flight while this block computes.
            let mut ahead: usize = self
                .pending
                .iter()
                .map(|p| self.padded[p.gather.group])
                .sum();
            while self.next < self.order.len() && (self.pending.is_empty() || ahead < self.budget) {
                ahead += self.padded[self.order[self.next].group];
                self.launch_one(comm, own)?;
            }
        }
        let words = p.work.wait()?;
        match (p.gather.quant, p.own) {
            (Some(q), Some(own)) => self.dequantized(g, q, own, words, comm),
            _ => Ok(Flat::from_words(self.half, words)),
        }
    }

    fn launch_one(
        &mut self,
        comm: &dyn Communicator,
        own: &mut OwnSlice<'_>,
    ) -> Result<(), EngineError> {
        let gather = self.order[self.next];
        self.next += 1;
        let g = gather.group;
        let words = own(g)?;
        let pending = match gather.quant {
            None => Pending {
                gather,
                work: comm.all_gather_async(words, Flat::words_for(self.half, self.padded[g])),
                own: None,
            },
            Some(q) => {
                let slice = self.padded[g] / comm.world_size();
                let own = Flat::from_words(self.half, words).to_f32(0..slice);
                let codes = zquant::quantize(&own, q.bits, q.block_size)?;
                let sent = to_words(codes.to_bytes());
                let total = sent.len() * comm.world_size();
                Pending {
                    gather,
                    work: comm.all_gather_async(sent, total),
                    own: Some(own),
                }
            }
        };
        self.pending.push_back(pending);
        Ok(())
    }

    /// Group `g` from every rank's quantized slice in `words`, with this
    /// rank's own slice `own` at full precision.
    fn dequantized(
        &self,
        g: usize,
        q: WeightQuant,
        own: Vec<f32>,
        words: Vec<f32>,
        comm: &dyn Communicator,
    ) -> Result<Flat, EngineError> {
        let (world, rank) = (comm.world_size(), comm.rank());
        let slice = self.padded[g] / world;
        let wire = Quantized::wire_len(q.bits, q.block_size, slice);
        let per_rank = wire.div_ceil(4);
        let mut full = vec![0f32; self.padded[g]];
        for (r, out) in full.chunks_exact_mut(slice).enumerate() {
            if r == rank {
                out.copy_from_slice(&own);
                continue;
            }
            let bytes: Vec<u8> = words[r * per_rank..(r + 1) * per_rank]
                .iter()
                .flat_map(|w| w.to_bits().to_le_bytes())
                .take(wire)
                .collect();
            let codes = Quantized::from_bytes(q.bits, q.block_size, slice, &bytes)?;
            zquant::dequantize(&codes, out);
        }
        Ok(match self.half {
            None => Flat::F32(full),
            half => Flat::from_f32(half, &full),
        })
    }

    /// Whether every planned gather has been fetched.
    pub fn finished(&self) -> bool {
        self.next == self.order.len() && self.pending.is_empty()
    }
}

/// Bytes as collective words (zero-padded to whole words).
fn to_words(bytes: Vec<u8>) -> Vec<f32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            f32::from_bits(u32::from_le_bytes(w))
        })
        .collect()
}
