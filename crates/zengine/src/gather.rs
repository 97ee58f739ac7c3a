//! Stage 3's parameter gathers, in a known order, with prefetch.
//!
//! Every rank walks the same sequence of gathers in a micro-batch (forward
//! blocks, the head with the tied embedding, backward blocks in reverse). Knowing
//! the sequence, the prefetcher keeps the next gathers in flight while the
//! current block computes, up to `prefetch_bucket_size` elements ahead (always at
//! least the next one). With `overlap_comm: false` each gather is issued only
//! when needed and waited at once.
//!
//! A 16-bit working type (bf16, f16) gathers with `all_gather16_async`,
//! straight into the `Vec<u16>` that the group's tensors are made from:
//! gathering collective words and copying them out was 1.8% of a bf16
//! stage-3 worker's samples.
//!
//! ZeRO++ qwZ: a gather marked quantized sends this rank's slice as blockwise
//! int8 (or int4) codes with one f32 scale per block, packed into collective
//! words, and dequantizes the other ranks' slices on arrival; the rank's own
//! slice is used as it is. The forward gathers are marked: backward, which
//! computes the gradients, gathers full precision.
//!
//! ZeRO++ hpZ: a forward gather marked `keep` leaves this rank holding chunk
//! `r` of `P` of the gathered group (r its rank in its hpZ group of P ranks,
//! all on one node): its secondary shard. The group's later gathers in the
//! micro-batch all-gather these shards inside the hpZ group instead of across
//! the world, and the last of them drops the shards. The values are the
//! forward's, so without qwZ the run is stage 3's bit for bit; with qwZ the
//! shard is cut from the values as every rank received them (the own slice
//! dequantized too), so that every replica's backward sees the same weights.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use zcomm::{Communicator, Work};
use zquant::{Bits, Quantized};

use crate::accounting::Transient;
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

/// Where a gather gets its slices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Source {
    /// Every rank's own slice, sent quantized (qwZ) or in the working type.
    World(Option<WeightQuant>),
    /// The hpZ group's secondary shards (kept by an earlier gather).
    Secondary,
}

/// One planned gather.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gather {
    /// Group index.
    pub group: usize,
    /// Where from.
    pub source: Source,
    /// hpZ: keep this rank's secondary shard of the result.
    pub keep: bool,
}

/// A gather in flight.
struct Pending {
    gather: Gather,
    work: Gathering,
    /// qwZ: this rank's slice as f32, kept to replace its quantized copy.
    own: Option<Vec<f32>>,
}

/// What a gather in flight returns.
pub(crate) enum Gathering {
    /// Collective words (f32 values, quantized codes, hpZ's shards).
    Words(Work<Vec<f32>>),
    /// 16-bit values as they are kept: no copy out of words.
    Halves(Half, Work<Vec<u16>>),
}

impl Gathering {
    /// Gathers `buf` in place: this rank's slice of it is its contribution.
    pub(crate) fn in_place(comm: &dyn Communicator, buf: Flat) -> Gathering {
        match buf {
            Flat::F32(v) => Gathering::Words(comm.all_gather_in_place_async(v)),
            Flat::Half(h, v) => Gathering::Halves(h, comm.all_gather16_in_place_async(v)),
        }
    }

    /// The gathered buffer, words read as `half` values (f32 if `None`).
    pub(crate) fn wait(self, half: Option<Half>) -> Result<Flat, EngineError> {
        Ok(match self {
            Gathering::Words(work) => Flat::from_words(half, work.wait()?),
            Gathering::Halves(h, work) => Flat::Half(h, work.wait()?),
        })
    }
}

/// This rank's slice of a group, in the working type.
pub type OwnSlice<'a> = dyn FnMut(usize) -> Result<Flat, EngineError> + 'a;

/// The process groups an engine runs on.
#[derive(Clone)]
pub struct ProcessGroups {
    /// Every rank of the job.
    pub world: Arc<dyn Communicator>,
    /// ZeRO++ hpZ: this rank's secondary-partition group, the
    /// `zero.hpz_partition_size` ranks of its node that share secondary shards
    /// (`None` when hpZ is off).
    pub hpz: Option<Arc<dyn Communicator>>,
}

/// Pending and future gathers of one micro-batch.
pub struct Prefetcher {
    order: Vec<Gather>,
    /// Per group: its padded length in elements.
    padded: Vec<usize>,
    half: Option<Half>,
    groups: ProcessGroups,
    next: usize,
    pending: VecDeque<Pending>,
    budget: usize,
    overlap: bool,
    /// hpZ: per group, this rank's secondary shard while it is kept.
    secondary: Vec<Option<Flat>>,
    /// Bytes of secondary shards held, with their peak.
    secondary_bytes: Transient,
}

impl Prefetcher {
    /// Gathers will be requested in `order`; `padded[g]` is group g's full
    /// length in elements of the working type `half` (f32 if `None`).
    pub fn new(
        order: Vec<Gather>,
        padded: Vec<usize>,
        half: Option<Half>,
        groups: ProcessGroups,
        budget: usize,
        overlap: bool,
    ) -> Prefetcher {
        Prefetcher {
            secondary: padded.iter().map(|_| None).collect(),
            order,
            padded,
            half,
            groups,
            next: 0,
            pending: VecDeque::new(),
            budget,
            overlap,
            secondary_bytes: Transient::default(),
        }
    }

    /// Returns group `g`'s full (padded) parameters; `g` must be the next in order.
    /// `own(g)` gives this rank's slice of group g.
    pub fn fetch(&mut self, g: usize, own: &mut OwnSlice<'_>) -> Result<Flat, EngineError> {
        if self.pending.is_empty() {
            assert!(
                self.launchable(),
                "an hpZ gather planned before the gather that keeps its shards"
            );
            self.launch_one(own)?;
        }
        let p = self.pending.pop_front().expect("launched above");
        assert_eq!(
            p.gather.group, g,
            "stage-3 gathers requested out of the planned order"
        );
        // Keep the next gathers in flight while this block computes.
        self.launch_ahead(own)?;
        let full = match (p.gather.source, p.own, p.work) {
            (Source::World(Some(q)), Some(own), Gathering::Words(work)) => {
                self.dequantized(g, q, own, work.wait()?, p.gather.keep)?
            }
            (_, _, work) => {
                let full = work.wait(self.half)?;
                if p.gather.keep {
                    let shard = Flat::from_words(self.half, full.words(self.shard_range(g)));
                    self.keep(g, shard);
                }
                full
            }
        };
        // A gather of the shards just kept may start now.
        self.launch_ahead(own)?;
        Ok(full)
    }

    /// With overlap, launches the next gathers up to the budget ahead (at
    /// least one), as far as their shards are there.
    fn launch_ahead(&mut self, own: &mut OwnSlice<'_>) -> Result<(), EngineError> {
        if !self.overlap {
            return Ok(());
        }
        let mut ahead: usize = self
            .pending
            .iter()
            .map(|p| self.padded[p.gather.group])
            .sum();
        while self.next < self.order.len()
            && (self.pending.is_empty() || ahead < self.budget)
            && self.launchable()
        {
            ahead += self.padded[self.order[self.next].group];
            self.launch_one(own)?;
        }
        Ok(())
    }

    /// Whether the next planned gather has what it sends.
    fn launchable(&self) -> bool {
        let gather = &self.order[self.next];
        gather.source != Source::Secondary || self.secondary[gather.group].is_some()
    }

    fn launch_one(&mut self, own: &mut OwnSlice<'_>) -> Result<(), EngineError> {
        let gather = self.order[self.next];
        self.next += 1;
        let g = gather.group;
        let total = Flat::words_for(self.half, self.padded[g]);
        let pending = match gather.source {
            Source::World(None) => Pending {
                gather,
                work: match own(g)? {
                    Flat::F32(own) => {
                        Gathering::Words(self.groups.world.all_gather_async(own, total))
                    }
                    Flat::Half(h, own) => Gathering::Halves(
                        h,
                        self.groups.world.all_gather16_async(own, self.padded[g]),
                    ),
                },
                own: None,
            },
            Source::World(Some(q)) => {
                let world = self.groups.world.world_size();
                let slice = self.padded[g] / world;
                let own = own(g)?.to_f32(0..slice);
                let codes = zquant::quantize(&own, q.bits, q.block_size)?;
                let sent = to_words(codes.to_bytes());
                let total = sent.len() * world;
                Pending {
                    gather,
                    work: Gathering::Words(self.groups.world.all_gather_async(sent, total)),
                    own: Some(own),
                }
            }
            Source::Secondary => {
                let later = self.order[self.next..]
                    .iter()
                    .any(|o| o.group == g && o.source == Source::Secondary);
                let shard = if later {
                    self.secondary[g].clone()
                } else {
                    self.secondary[g]
                        .take()
                        .inspect(|s| self.secondary_bytes.sub(s.bytes()))
                };
                let shard = shard.expect("checked by launchable");
                let hpz = self
                    .groups
                    .hpz
                    .as_ref()
                    .expect("hpZ gathers have an hpZ group");
                Pending {
                    gather,
                    work: Gathering::Words(
                        hpz.all_gather_async(shard.words(0..shard.len()), total),
                    ),
                    own: None,
                }
            }
        };
        self.pending.push_back(pending);
        Ok(())
    }

    /// Elements of group `g` in this rank's secondary shard.
    fn shard_range(&self, g: usize) -> Range<usize> {
        let hpz = self.groups.hpz.as_ref().expect("only hpZ keeps shards");
        let len = self.padded[g] / hpz.world_size();
        hpz.rank() * len..(hpz.rank() + 1) * len
    }

    fn keep(&mut self, g: usize, shard: Flat) {
        self.secondary_bytes.add(shard.bytes());
        if let Some(old) = self.secondary[g].replace(shard) {
            self.secondary_bytes.sub(old.bytes());
        }
    }

    /// Group `g` from every rank's quantized slice in `words`, with this
    /// rank's own slice `own` at full precision. With `keep`, the secondary
    /// shard is cut first, from the values every rank received.
    fn dequantized(
        &mut self,
        g: usize,
        q: WeightQuant,
        own: Vec<f32>,
        words: Vec<f32>,
        keep: bool,
    ) -> Result<Flat, EngineError> {
        let comm = &self.groups.world;
        let (world, rank) = (comm.world_size(), comm.rank());
        let slice = self.padded[g] / world;
        let wire = Quantized::wire_len(q.bits, q.block_size, slice);
        let per_rank = wire.div_ceil(4);
        let mut full = vec![0f32; self.padded[g]];
        for (r, out) in full.chunks_exact_mut(slice).enumerate() {
            if r == rank && !keep {
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
        if keep {
            let range = self.shard_range(g);
            self.keep(g, Flat::from_f32(self.half, &full[range]));
        }
        full[rank * slice..(rank + 1) * slice].copy_from_slice(&own);
        Ok(match self.half {
            None => Flat::F32(full),
            half => Flat::from_f32(half, &full),
        })
    }

    /// Whether every planned gather has been fetched.
    pub fn finished(&self) -> bool {
        self.next == self.order.len() && self.pending.is_empty()
    }

    /// hpZ: the most bytes of secondary shards held at once.
    pub fn secondary_peak(&self) -> u64 {
        self.secondary_bytes.peak
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
