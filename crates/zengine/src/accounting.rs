//! What a step cost: memory by category and bytes sent, from the engine's own
//! bookkeeping (not sampled), so that the ZeRO formulas can be checked exactly.
//! The worker converts these to the control protocol's report types.

use std::time::Duration;

use zcomm::CounterSnapshot;

/// Where a step's time went on this rank (DeepSpeed's
/// `wall_clock_breakdown`). Blocking waits for collectives fall inside these
/// phases and are counted apart in [`StepStats::comm`]'s `waited_ns`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// The micro-batches' forward passes: embedding and blocks, waits for
    /// stage-3 gathers included. On a GPU the time to queue them: their
    /// kernels finish inside `backward`, which waits for the loss.
    pub forward: Duration,
    /// Their backward passes: the head (its loss and gradient are one fused
    /// pass), the blocks and the embedding, reductions started on the way.
    pub backward: Duration,
    /// The optimizer step: the last reductions, the gradient norm, clipping,
    /// AdamW and sharing the updated parameters.
    pub optimizer: Duration,
}

/// Memory by category on this rank, in bytes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemoryUse {
    /// Working parameters held (full or the own slice).
    pub params: u64,
    /// Gradients held.
    pub grads: u64,
    /// Mixed precision's f32 master weights.
    pub master: u64,
    /// Adam's moments.
    pub optimizer: u64,
    /// Peak activations of the step (estimated from the shapes kept).
    pub activations: u64,
    /// Peak of gathered parameters, staged gradients and buckets in flight.
    pub comm_buffers: u64,
    /// ZeRO++ hpZ: peak of the secondary shards held between forward and
    /// backward.
    pub secondary: u64,
    /// Peak of the buffers of swapped state in flight (NVMe offload).
    pub offload_buffers: u64,
    /// Bytes of this rank's swap files (NVMe offload).
    pub nvme: u64,
    /// Peak resident set size of the process.
    pub peak_rss: u64,
}

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepStats {
    /// 1-based step.
    pub step: u64,
    /// Mean loss over this rank's micro-batches.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping (infinite on an f16 overflow).
    pub grad_norm: f64,
    /// f16: the loss scale this step's gradients were computed with.
    pub loss_scale: Option<f64>,
    /// f16: the gradients overflowed, so no update was made.
    pub skipped: bool,
    /// Tokens this rank trained on.
    pub tokens: u64,
    /// Memory by category at the end of the step (activations and buffers: peak).
    pub mem: MemoryUse,
    /// Bytes this rank sent during the step, by op and by link, and the time
    /// it waited for collectives.
    pub comm: CounterSnapshot,
    /// Where the step's time went.
    pub times: StepTimes,
    /// NVMe offload: the step's swap I/O.
    pub io: Option<zswap::IoStats>,
    /// Some rank was asked to stop ([`crate::Engine::stop_on`]) before this
    /// step's gradient norm: every rank sees the same value, so all end the
    /// job after this step.
    pub stop: bool,
    /// LAMB: the step's trust ratios (none for the other rules, or on a
    /// step an f16 overflow skipped).
    pub trust_ratio: Option<TrustRatios>,
    /// `comms_logger`: the collectives this rank ran since the last step's
    /// statistics (the first step's include those before it), by group,
    /// operation and size.
    pub comms: Option<Vec<zproto::CommRecord>>,
    /// `train.progressive_layer_drop`: θ this step ran with and the blocks
    /// its micro-batches ran, on average.
    pub layer_drop: Option<LayerDropStats>,
}

/// A step under progressive layer dropping: the same on every rank (the
/// fates are drawn alike).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerDropStats {
    /// θ: the last block's chance to run this step.
    pub theta: f64,
    /// Blocks run per micro-batch, the mean over the step's.
    pub blocks_run: f64,
    /// Per block, the share of the step's micro-batches that ran it.
    pub ran: Vec<f64>,
}

/// The smallest, mean and largest of a LAMB step's trust ratios, one per
/// parameter (DeepSpeed's `Lamb.get_lamb_coeffs()`, summarised), as the
/// update used them: clamped to `[min_coeff, max_coeff]`, 1 where a
/// parameter's or its update's norm is 0. Every rank computes every
/// parameter's ratio, so every rank's are these.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrustRatios {
    /// The smallest.
    pub min: f64,
    /// The mean over parameters.
    pub mean: f64,
    /// The largest.
    pub max: f64,
}

impl TrustRatios {
    /// Of `ratios` (`None` where there are none).
    pub fn of(ratios: impl IntoIterator<Item = f32>) -> Option<TrustRatios> {
        let (mut n, mut sum) = (0usize, 0f64);
        let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
        for r in ratios.into_iter().map(f64::from) {
            n += 1;
            sum += r;
            min = min.min(r);
            max = max.max(r);
        }
        (n > 0).then(|| TrustRatios {
            min,
            mean: sum / n as f64,
            max,
        })
    }
}

/// Bytes of memory transiently held, with the peak since the last step.
#[derive(Default)]
pub(crate) struct Transient {
    now: u64,
    pub(crate) peak: u64,
}

impl Transient {
    pub(crate) fn add(&mut self, b: u64) {
        self.now += b;
        self.peak = self.peak.max(self.now);
    }
    pub(crate) fn sub(&mut self, b: u64) {
        self.now = self.now.saturating_sub(b);
    }
}

/// Peak resident set size of this process (Linux `VmHWM`), 0 where unknown.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}
