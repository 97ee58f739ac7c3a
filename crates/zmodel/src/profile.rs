//! The clock of `flops_profiler` (DeepSpeed's name): how long one step
//! spent in each module, on the thread that runs the model.
//!
//! The engine marks the modules it calls (the embedding, each block, the
//! head) with [`module`]; inside a block, zmodel marks its parts (norms,
//! the attention's products and core, the MLP's) with [`part`]. Nothing is
//! recorded unless [`start`] was called on this thread, and then only
//! until [`finish`]: an unprofiled step pays one thread-local read a span.
//! Spans measure wall time on the calling thread, so a part's figure
//! includes the rayon workers it waits for, and nothing else runs on it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Which pass a module's time belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Forward.
    Forward,
    /// Backward.
    Backward,
    /// Forward again inside backward (activation checkpointing).
    Recompute,
}

/// A module the engine calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Module {
    /// Token (and position) tables.
    Embedding,
    /// Block `i` (0-based).
    Block(usize),
    /// Final norm, output matrix and loss (forward and backward in one
    /// call, recorded as backward).
    Head,
}

/// A part of a block, in forward order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// The first norm.
    Norm1,
    /// q, k and v's product.
    Qkv,
    /// Qwen3's per-head q and k norms.
    QkNorm,
    /// The rotary embedding (LLaMA's family).
    Rotary,
    /// Attention itself: scores, softmax, their product with v.
    Attention,
    /// Attention's output product (with the residual add).
    AttnOut,
    /// The second norm.
    Norm2,
    /// The MLP's first product (GELU's forward inside it where fused).
    MlpIn,
    /// The MLP's activation (GELU or SwiGLU).
    Activation,
    /// The MLP's second product (with the residual add).
    MlpOut,
}

/// A module as a whole (`None`) or one of its parts, in a pass.
pub type Key = (Module, Option<Part>, Pass);

/// Time recorded by [`Key`].
pub type Times = HashMap<Key, Duration>;

struct Recorder {
    /// The module [`part`] spans belong to.
    scope: Option<(Module, Pass)>,
    times: Times,
}

thread_local! {
    static RECORDER: RefCell<Option<Recorder>> = const { RefCell::new(None) };
}

/// Starts recording on this thread (what was recorded before is dropped).
pub fn start() {
    RECORDER.with(|r| {
        *r.borrow_mut() = Some(Recorder {
            scope: None,
            times: Times::new(),
        })
    });
}

/// Stops recording on this thread; what was recorded since [`start`].
pub fn finish() -> Option<Times> {
    RECORDER.with(|r| r.borrow_mut().take().map(|rec| rec.times))
}

/// A running span: adds its time when dropped.
#[must_use = "a span measures until it is dropped"]
pub struct Span {
    /// What it times and since when; none where nothing is recorded.
    timing: Option<(Key, Instant)>,
    /// The scope before a module span, put back when it ends.
    outer: Option<(Module, Pass)>,
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some((key, started)) = self.timing else {
            return;
        };
        let took = started.elapsed();
        RECORDER.with(|r| {
            if let Some(rec) = r.borrow_mut().as_mut() {
                *rec.times.entry(key).or_default() += took;
                if key.1.is_none() {
                    rec.scope = self.outer;
                }
            }
        });
    }
}

/// Times `module` in `pass` until the span drops; [`part`] spans inside
/// it are its parts.
pub fn module(module: Module, pass: Pass) -> Span {
    let outer = RECORDER.with(|r| {
        r.borrow_mut()
            .as_mut()
            .map(|rec| rec.scope.replace((module, pass)))
    });
    Span {
        timing: outer.map(|_| ((module, None, pass), Instant::now())),
        outer: outer.flatten(),
    }
}

/// Times `part` of the module being timed until the span drops (nothing
/// outside a [`module`] span).
pub fn part(part: Part) -> Span {
    let scope = RECORDER.with(|r| r.borrow().as_ref().and_then(|rec| rec.scope));
    Span {
        timing: scope.map(|(m, pass)| ((m, Some(part), pass), Instant::now())),
        outer: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn busy(ms: u64) {
        let until = Instant::now() + Duration::from_millis(ms);
        while Instant::now() < until {
            std::hint::spin_loop();
        }
    }

    #[test]
    fn parts_land_in_their_module_and_pass_and_nothing_is_kept_unasked() {
        // Not recording: spans leave nothing behind.
        drop(module(Module::Block(0), Pass::Forward));
        assert!(finish().is_none());

        start();
        {
            let _b = module(Module::Block(1), Pass::Forward);
            let _q = part(Part::Qkv);
            busy(3);
        }
        {
            let _b = module(Module::Block(1), Pass::Backward);
            drop(part(Part::MlpOut));
            let _q = part(Part::Qkv);
            busy(2);
        }
        // Outside a module a part is not kept.
        drop(part(Part::Norm1));
        let times = finish().expect("recording");
        assert!(finish().is_none(), "finish ends the recording");
        let at = |m, p, pass| times.get(&(m, p, pass)).copied();
        let fwd_qkv = at(Module::Block(1), Some(Part::Qkv), Pass::Forward).unwrap();
        let fwd = at(Module::Block(1), None, Pass::Forward).unwrap();
        assert!(fwd_qkv >= Duration::from_millis(3) && fwd >= fwd_qkv);
        let bwd_qkv = at(Module::Block(1), Some(Part::Qkv), Pass::Backward).unwrap();
        assert!(bwd_qkv >= Duration::from_millis(2));
        assert!(at(Module::Block(1), Some(Part::MlpOut), Pass::Backward).is_some());
        assert!(at(Module::Block(1), Some(Part::Norm1), Pass::Backward).is_none());
        assert_eq!(times.len(), 5, "{times:?}");
    }
}
