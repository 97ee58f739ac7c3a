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
//! [`ErrorFeedback`] serves one bucket: its positions are the bucket's, and
//! the two hops of [`crate::quantized`] send disjoint positions (the chunks
//! that local peers reduce, then the partial sums of the chunks this rank
//! reduces for other nodes' owners), so one buffer holds both hops' errors.

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
    /// The errors over the bucket, 8-bit blockwise; `None`: all zero.
    errors: Option<Quantized>,
}

/// Values per scale of the kept errors.
const BLOCK: usize = 2048;

impl ErrorFeedback {
    /// No errors yet; `beta` in `[0, 1)`, `reset_after` at least 1.
    pub fn new(beta: f32, reset_after: u64) -> ErrorFeedback {
        ErrorFeedback {
            beta,
            reset_after: reset_after.max(1),
            reductions: 0,
            errors: None,
        }
    }

    /// Forgets the errors (a step skipped for an overflow: they were
    /// taken from gradients that are thrown away).
    pub fn reset(&mut self) {
        self.errors = None;
        self.reductions = 0;
    }

    /// Multiplies the errors by `factor` (the loss scale changed: the
    /// gradients they compensate are scaled by it from now on).
    pub fn rescale(&mut self, factor: f32) {
        if let Some(q) = &mut self.errors {
            q.scales.iter_mut().for_each(|s| *s *= factor);
        }
    }

    /// The errors to add before a reduction of `len` values: zeros at the
    /// start, after a reset, every `reset_after` reductions, or where the
    /// bucket's length is not the one the errors were kept for.
    pub(crate) fn take(&mut self, len: usize) -> Vec<f32> {
        let mut errors = vec![0f32; len];
        if self.reductions >= self.reset_after {
            self.reset();
        }
        match &self.errors {
            Some(q) if q.len == len => zquant::dequantize(q, &mut errors),
            _ => self.reductions = 0,
        }
        errors
    }

    /// Keeps `errors` after a reduction ([`ErrorFeedback::take`]'s, updated
    /// where values were sent).
    pub(crate) fn keep(&mut self, errors: &[f32]) {
        // Errors are finite (a non-finite piece leaves its errors as they
        // were); a sum that overflowed f32 restarts them.
        self.errors = zquant::quantize(errors, Bits::Int8, BLOCK).ok();
        self.reductions += 1;
    }

    /// `beta`.
    pub(crate) fn beta(&self) -> f32 {
        self.beta
    }

    /// The state for a checkpoint: reductions since the last restart (8
    /// bytes, little-endian), the number of values (8 bytes), then the
    /// errors' wire form ([`Quantized::to_bytes`]; nothing where they are
    /// zero).
    pub fn to_bytes(&self) -> Vec<u8> {
        let len = self.errors.as_ref().map_or(0, |q| q.len);
        let mut out = Vec::new();
        out.extend_from_slice(&self.reductions.to_le_bytes());
        out.extend_from_slice(&(len as u64).to_le_bytes());
        if let Some(q) = &self.errors {
            out.extend_from_slice(&q.to_bytes());
        }
        out
    }

    /// Restores what [`ErrorFeedback::to_bytes`] wrote, into a feedback of
    /// this run's `beta` and `reset_after`; `None` where the bytes are not
    /// such a state.
    pub fn restore(&mut self, bytes: &[u8]) -> Option<()> {
        let word = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
        };
        let (reductions, len) = (word(0)?, usize::try_from(word(8)?).ok()?);
        let errors = match len {
            0 if bytes.len() == 16 => None,
            _ => Some(Quantized::from_bytes(Bits::Int8, BLOCK, len, &bytes[16..]).ok()?),
        };
        self.reductions = reductions;
        self.errors = errors;
        Some(())
    }
}

/// `errors ← beta · errors + (1 - beta) · (values - sent)`: `values` were
/// quantized, `sent` is what they dequantize to.
pub(crate) fn update(errors: &mut [f32], values: &[f32], sent: &[f32], beta: f32) {
    for ((e, v), s) in errors.iter_mut().zip(values).zip(sent) {
        *e = beta * *e + (1.0 - beta) * (v - s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state survives its bytes, and the errors come back as they were
    /// kept (8 bits: within half a step of the block's largest).
    #[test]
    fn state_round_trips_and_resets_on_schedule() {
        let mut f = ErrorFeedback::new(0.8, 3);
        let errors: Vec<f32> = (0..5000).map(|i| ((i % 97) as f32 - 48.0) * 1e-3).collect();
        assert_eq!(f.take(5000), vec![0.0; 5000]);
        f.keep(&errors);
        let mut g = ErrorFeedback::new(0.8, 3);
        g.restore(&f.to_bytes()).unwrap();
        assert_eq!(f, g);
        let back = g.take(5000);
        for (a, b) in back.iter().zip(&errors) {
            assert!((a - b).abs() <= 0.048 / 127.0 * 0.51, "{a} vs {b}");
        }
        g.keep(&back);
        g.keep(&back);
        assert_eq!(g.reductions, 3);
        assert_eq!(g.take(5000), vec![0.0; 5000], "not reset after 3");
        assert!(g.restore(&[1, 2, 3]).is_none());
        let mut zero = ErrorFeedback::new(0.5, 10);
        zero.restore(&ErrorFeedback::new(0.5, 10).to_bytes())
            .unwrap();
        assert_eq!(zero.take(4), vec![0.0; 4]);
    }
}
