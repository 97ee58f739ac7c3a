//! LoCo's error feedback for qgZ (Xie et al., 2024, "LoCo: Low-Bit
//! Communication Adaptor"; DeepSpeed's `zeropp_loco_param`).
//!
//! qgZ quantizes every value a rank sends to a few bits. Quantizing the
//! same gradient the same way loses the same remainder every step, so the
//! sums carry a bias that does not average out. Error feedback keeps what
//! quantizing lost from each value sent and adds it to that value before it
//! is quantized the next time: over steps the remainders cancel, and the
//! mean of the sums approaches the exact mean (after `T` reductions the
//! mean's error is at most the largest kept error over `T · (1 - beta)`).
//!
//! As DeepSpeed's kernels do, the value quantized is the value plus the
//! kept error, and the kept error then becomes `beta` of itself plus
//! `1 - beta` of the new remainder; between reductions the errors are held
//! as 8-bit blocks (a byte a value, as DeepSpeed keeps them), and they
//! restart from zero every `reset_after` reductions. One
//! [`ErrorFeedback`] serves one bucket. Its errors are kept per message, in
//! the order [`crate::quantized`]'s two hops send them (the chunks each
//! local peer reduces, then the partial sums of the chunks this rank
//! reduces for other nodes' owners): the same positions go in the same
//! message every reduction, so each message's errors lie in its own order,
//! in its quantization blocks, and [`zquant::quantize_compensated`] reads
//! and writes them in the same pass that codes the message.

use zquant::{Bits, Quantized};

/// The kept errors of one bucket's qgZ reductions (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorFeedback {
    /// How much of the kept error stays at each update (`err_beta`).
    beta: f32,
    /// Reductions after which the errors restart from zero (`reset_T`).
    reset_after: u64,
    /// Reductions since they last restarted.
    reductions: u64,
    /// Each message's errors, in sending order, 8-bit blockwise; `None`:
    /// all zero.
    messages: Vec<Option<Quantized>>,
}

impl ErrorFeedback {
    /// No errors yet; `beta` in `[0, 1)`, `reset_after` at least 1.
    pub fn new(beta: f32, reset_after: u64) -> ErrorFeedback {
        ErrorFeedback {
            beta,
            reset_after: reset_after.max(1),
            reductions: 0,
            messages: Vec::new(),
        }
    }

    /// Forgets the errors (a step skipped for an overflow: they were
    /// taken from gradients that are thrown away).
    pub fn reset(&mut self) {
        self.messages.clear();
        self.reductions = 0;
    }

    /// Multiplies the errors by `factor` (the loss scale changed: the
    /// gradients they compensate are scaled by it from now on).
    pub fn rescale(&mut self, factor: f32) {
        for q in self.messages.iter_mut().flatten() {
            q.scales.iter_mut().for_each(|s| *s *= factor);
        }
    }

    /// Starts a reduction: the errors restart from zero every
    /// `reset_after` reductions.
    pub(crate) fn begin(&mut self) {
        if self.reductions >= self.reset_after {
            self.reset();
        }
    }

    /// The kept errors of message `k` of this reduction (those of another
    /// length or block size start from zero:
    /// [`zquant::quantize_compensated`]).
    pub(crate) fn message(&mut self, k: usize) -> &mut Option<Quantized> {
        if self.messages.len() <= k {
            self.messages.resize(k + 1, None);
        }
        &mut self.messages[k]
    }

    /// Ends a reduction that sent `count` messages.
    pub(crate) fn finish(&mut self, count: usize) {
        self.messages.truncate(count);
        self.reductions += 1;
    }

    /// `beta`.
    pub(crate) fn beta(&self) -> f32 {
        self.beta
    }

    /// The state for a checkpoint: reductions since the last restart and
    /// the number of messages (8 bytes each, little-endian), then each
    /// message's errors: 0 for none, or their count and block size (8
    /// bytes each) and their wire form ([`Quantized::to_bytes`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let word = |out: &mut Vec<u8>, n: usize| out.extend_from_slice(&(n as u64).to_le_bytes());
        word(&mut out, self.reductions as usize);
        word(&mut out, self.messages.len());
        for m in &self.messages {
            match m {
                None => word(&mut out, 0),
                Some(q) => {
                    word(&mut out, q.len);
                    word(&mut out, q.block_size);
                    out.extend_from_slice(&q.to_bytes());
                }
            }
        }
        out
    }

    /// Restores what [`ErrorFeedback::to_bytes`] wrote, into a feedback of
    /// this run's `beta` and `reset_after`; `None` (and nothing changed)
    /// where the bytes are not such a state.
    pub fn restore(&mut self, bytes: &[u8]) -> Option<()> {
        let mut rest = bytes;
        let reductions = word(&mut rest)?;
        let count = usize::try_from(word(&mut rest)?).ok()?;
        let mut messages = Vec::new();
        for _ in 0..count {
            let len = usize::try_from(word(&mut rest)?).ok()?;
            if len == 0 {
                messages.push(None);
                continue;
            }
            let block = usize::try_from(word(&mut rest)?).ok()?;
            let wire = Quantized::wire_len(Bits::Int8, block.max(1), len);
            let (codes, tail) = rest.split_at_checked(wire)?;
            messages.push(Some(
                Quantized::from_bytes(Bits::Int8, block, len, codes).ok()?,
            ));
            rest = tail;
        }
        if !rest.is_empty() {
            return None;
        }
        (self.reductions, self.messages) = (reductions, messages);
        Some(())
    }
}

/// The little-endian word at the front of `rest`, which moves past it.
fn word(rest: &mut &[u8]) -> Option<u64> {
    let (w, tail) = rest.split_first_chunk::<8>()?;
    *rest = tail;
    Some(u64::from_le_bytes(*w))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state survives its bytes (messages with errors and without), a
    /// damaged one is refused and changes nothing, and the errors restart
    /// on schedule.
    #[test]
    fn state_round_trips_and_resets_on_schedule() {
        let mut f = ErrorFeedback::new(0.8, 3);
        f.begin();
        let x: Vec<f32> = (0..5000).map(|i| ((i % 97) as f32 - 48.0) * 1e-3).collect();
        zquant::quantize_compensated(&x, f.message(1), 0.8, Bits::Int4, 64).unwrap();
        f.finish(2);
        assert_eq!(f.messages.len(), 2);
        assert!(f.messages[0].is_none() && f.messages[1].is_some());
        let bytes = f.to_bytes();
        let mut g = ErrorFeedback::new(0.8, 3);
        g.restore(&bytes).unwrap();
        assert_eq!(f, g);
        for cut in [1, 8, 17, bytes.len() - 1] {
            assert!(g.restore(&bytes[..cut]).is_none(), "cut at {cut}");
        }
        assert!(g.restore(&[bytes.as_slice(), &[0]].concat()).is_none());
        assert_eq!(f, g, "a refused state changed it");
        g.finish(2);
        g.begin();
        assert_eq!(g.reductions, 2, "reset early");
        g.finish(2);
        g.begin();
        assert!(
            g.messages.is_empty() && g.reductions == 0,
            "not reset after 3"
        );
    }
}
