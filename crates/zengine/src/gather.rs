//! Stage 3's parameter gathers, in a known order, with prefetch.
//!
//! Every rank walks the same sequence of gathers in a micro-batch (forward
//! blocks, the head with the tied embedding, backward blocks in reverse). Knowing
//! the sequence, the prefetcher keeps the next gathers in flight while the
//! current block computes, up to `prefetch_bucket_size` elements ahead (always at
//! least the next one). With `overlap_comm: false` each gather is issued only
//! when needed and waited at once.

use std::collections::VecDeque;

use zcomm::{Communicator, Work};

use crate::error::EngineError;

/// This rank's slice of a group, as collective words.
pub type OwnSlice<'a> = dyn FnMut(usize) -> Result<Vec<f32>, EngineError> + 'a;

/// Pending and future gathers of one micro-batch.
pub struct Prefetcher {
    order: Vec<usize>,
    padded: Vec<usize>,
    next: usize,
    pending: VecDeque<(usize, Work<Vec<f32>>)>,
    budget: usize,
    overlap: bool,
}

impl Prefetcher {
    /// Gathers will be requested in `order` (group indices); `padded[g]` is group
    /// g's full length.
    pub fn new(order: Vec<usize>, padded: Vec<usize>, budget: usize, overlap: bool) -> Prefetcher {
        Prefetcher {
            order,
            padded,
            next: 0,
            pending: VecDeque::new(),
            budget,
            overlap,
        }
    }

    /// Returns group `g`'s full (padded) parameters; `g` must be the next in order.
    /// `own(g)` gives this rank's slice of group g.
    pub fn fetch(
        &mut self,
        g: usize,
        comm: &dyn Communicator,
        own: &mut OwnSlice<'_>,
    ) -> Result<Vec<f32>, EngineError> {
        if self.pending.is_empty() {
            self.launch_one(comm, own)?;
        }
        let (got, work) = self.pending.pop_front().expect("launched above");
        assert_eq!(got, g, "stage-3 gathers requested out of the planned order");
        if self.overlap {
            // Keep the next gathers in flight while this block computes.
            let mut ahead: usize = self.pending.iter().map(|(g, _)| self.padded[*g]).sum();
            while self.next < self.order.len() && (self.pending.is_empty() || ahead < self.budget) {
                ahead += self.padded[self.order[self.next]];
                self.launch_one(comm, own)?;
            }
        }
        Ok(work.wait()?)
    }

    fn launch_one(
        &mut self,
        comm: &dyn Communicator,
        own: &mut OwnSlice<'_>,
    ) -> Result<(), EngineError> {
        let g = self.order[self.next];
        self.next += 1;
        let work = comm.all_gather_async(own(g)?, self.padded[g]);
        self.pending.push_back((g, work));
        Ok(())
    }

    /// Whether every planned gather has been fetched.
    pub fn finished(&self) -> bool {
        self.next == self.order.len() && self.pending.is_empty()
    }
}
