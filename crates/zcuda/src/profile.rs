//! GPU time by operation (`ZRUN_GPU_PROFILE=1` in the workers' environment),
//! for finding where a step's time goes on a GPU without a profiler: the
//! lent GPU hosts have minutes, not hours, and no Nsight Systems.
//!
//! An event is recorded on the stream after each marked operation (every
//! kernel launch and cuBLAS product of this crate). Operations run in
//! stream order, so the time between the events after two consecutive
//! operations is the second one's run time, plus any time the GPU waited
//! for the host to enqueue it: a starved GPU shows as time in the operation
//! after the gap. What is enqueued without a mark (copies, NCCL's
//! collectives) counts toward the next marked operation. Events are read in
//! batches (the stream is waited on then, once every few thousand
//! operations), so profiling costs one event a launch.
//!
//! So that a starved GPU need not be inferred, each mark also notes the
//! host's clock, and the two clocks are tied at an anchor: an event recorded
//! on the idle stream (after a synchronize) and the host's time just after.
//! An operation whose launch returned after the operation before it had
//! ended on the GPU found the GPU idle for that long: its "GPU idle" time,
//! what a faster host (fewer launches, CUDA graphs) could take off the step.
//! It counts from the launch's return, so it includes the launch call's own
//! few microseconds where the GPU was already idle. Each batch's read waits
//! for the stream and sets a new anchor, so the clocks never drift apart for
//! long, and the time the read itself takes is nobody's.

use std::collections::HashMap;
use std::time::Instant;

use cudarc::driver::{sys::CUevent_flags, CudaEvent, CudaStream, DriverError};

/// Events not yet read before the profile reads them (and waits).
const BATCH: usize = 4096;

/// The events of one stream since its profile began, read in batches.
pub(crate) struct Profile {
    /// Events recorded since the last read, each after the operation named,
    /// with the host's clock when its launch had returned.
    pending: Vec<(String, CudaEvent, Instant)>,
    /// Where the GPU's and the host's clocks are tied.
    anchor: Anchor,
    /// The last event read since the anchor (`None`: the anchor's): where
    /// the next operation's time starts.
    last: Option<CudaEvent>,
    /// When `last` happened, in milliseconds after the anchor on the GPU.
    last_at: f64,
    totals: Totals,
}

/// An event recorded on an idle stream and the host's clock just after it.
struct Anchor {
    event: CudaEvent,
    at: Instant,
}

impl Anchor {
    /// Waits for `stream` to go idle, then ties the clocks.
    fn new(stream: &CudaStream) -> Result<Anchor, DriverError> {
        stream.synchronize()?;
        let event = timed_event(stream)?;
        Ok(Anchor {
            event,
            at: Instant::now(),
        })
    }
}

impl Profile {
    /// A profile of `stream` from now on.
    pub(crate) fn start(stream: &CudaStream) -> Result<Profile, DriverError> {
        let anchor = Anchor::new(stream)?;
        Ok(Profile {
            pending: Vec::new(),
            last: None,
            last_at: 0.0,
            anchor,
            totals: Totals::default(),
        })
    }

    /// Marks the end of operation `name`, just enqueued on `stream`.
    pub(crate) fn mark(&mut self, stream: &CudaStream, name: String) -> Result<(), DriverError> {
        let launched = Instant::now();
        self.pending.push((name, timed_event(stream)?, launched));
        if self.pending.len() >= BATCH {
            self.read()?;
            self.reanchor(stream)?;
        }
        Ok(())
    }

    /// Waits for the pending events and adds their times.
    fn read(&mut self) -> Result<(), DriverError> {
        for (name, event, launched) in std::mem::take(&mut self.pending) {
            event.synchronize()?;
            let last = self.last.as_ref().unwrap_or(&self.anchor.event);
            let ms = f64::from(last.elapsed_ms(&event)?);
            let launched_at = launched
                .saturating_duration_since(self.anchor.at)
                .as_secs_f64()
                * 1e3;
            self.totals
                .add(&name, ms, gpu_idle(launched_at, self.last_at, ms));
            self.last_at = f64::from(self.anchor.event.elapsed_ms(&event)?);
            self.last = Some(event);
        }
        Ok(())
    }

    /// Ties the clocks again (the stream idle, every event read): the next
    /// operation's time starts here, not at the last event read.
    fn reanchor(&mut self, stream: &CudaStream) -> Result<(), DriverError> {
        self.anchor = Anchor::new(stream)?;
        self.last = None;
        self.last_at = 0.0;
        Ok(())
    }

    /// Forgets the times so far (waiting for them): the first steps'
    /// one-time costs (allocations, cuBLAS's choices) are not the step's.
    pub(crate) fn restart(&mut self, stream: &CudaStream) -> Result<(), DriverError> {
        self.read()?;
        self.reanchor(stream)?;
        self.totals = Totals::default();
        Ok(())
    }

    /// Everything so far (waiting for it), as [`Totals::table`] over `steps`.
    pub(crate) fn report(&mut self, steps: u64) -> Result<String, DriverError> {
        self.read()?;
        Ok(self.totals.table(steps))
    }
}

/// How long the GPU sat idle before an operation that took `ms` (from the
/// end of the one before, which ended `prev_end` after the anchor on the
/// GPU's clock) and whose launch returned `launched` after the anchor on the
/// host's: the part of its time before the launch returned.
fn gpu_idle(launched: f64, prev_end: f64, ms: f64) -> f64 {
    (launched - prev_end).clamp(0.0, ms.max(0.0))
}

/// An event with timing, recorded on `stream` now.
fn timed_event(stream: &CudaStream) -> Result<CudaEvent, DriverError> {
    stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
}

/// Per operation name: milliseconds, of them the GPU's idle ones, calls.
#[derive(Default)]
pub(crate) struct Totals {
    by_name: HashMap<String, Row>,
}

#[derive(Default)]
struct Row {
    ms: f64,
    idle_ms: f64,
    calls: u64,
}

impl Totals {
    /// Adds one call of `name` that took `ms`, `idle_ms` of them with the
    /// GPU waiting for the host.
    pub(crate) fn add(&mut self, name: &str, ms: f64, idle_ms: f64) {
        let row = match self.by_name.get_mut(name) {
            Some(row) => row,
            None => self.by_name.entry(name.to_string()).or_default(),
        };
        row.ms += ms;
        row.idle_ms += idle_ms;
        row.calls += 1;
    }

    /// One line per operation, the most time first (ties by name): its
    /// milliseconds per step (of `steps`), its share of all, its calls per
    /// step, the milliseconds per step of it that the GPU sat idle waiting
    /// for the host; then the totals.
    pub(crate) fn table(&self, steps: u64) -> String {
        let steps = steps.max(1) as f64;
        let total: f64 = self.by_name.values().map(|r| r.ms).sum();
        let idle: f64 = self.by_name.values().map(|r| r.idle_ms).sum();
        let mut rows: Vec<_> = self.by_name.iter().collect();
        rows.sort_by(|a, b| b.1.ms.total_cmp(&a.1.ms).then(a.0.cmp(b.0)));
        let mut out = String::from("  ms/step   share  calls/step  GPU idle  operation\n");
        for (name, row) in rows {
            let share = if total > 0.0 {
                100.0 * row.ms / total
            } else {
                0.0
            };
            out += &format!(
                "{:>9.3}  {share:>5.1}%  {:>10.1}  {:>8.3}  {name}\n",
                row.ms / steps,
                row.calls as f64 / steps,
                row.idle_ms / steps
            );
        }
        out += &format!(
            "{:>9.3}  100.0%              {:>8.3}  all marked operations\n",
            total / steps,
            idle / steps
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{gpu_idle, Totals};

    #[test]
    fn the_table_puts_the_most_time_first_per_step_with_shares() {
        let mut t = Totals::default();
        for (name, ms, idle) in [
            ("gemm", 3.0, 0.0),
            ("softmax", 1.0, 0.25),
            ("gemm", 5.0, 1.0),
            ("add", 1.0, 0.0),
        ] {
            t.add(name, ms, idle);
        }
        // gemm: 8 ms over 2 steps, 80% of 10 ms, 1 call a step, 1 ms idle;
        // the 1 ms ties by name.
        let want = [
            "  ms/step   share  calls/step  GPU idle  operation",
            "    4.000   80.0%         1.0     0.500  gemm",
            "    0.500   10.0%         0.5     0.000  add",
            "    0.500   10.0%         0.5     0.125  softmax",
            "    5.000  100.0%                 0.625  all marked operations",
        ];
        assert_eq!(t.table(2), want.map(|l| format!("{l}\n")).concat());
    }

    #[test]
    fn the_gpu_is_idle_from_the_last_operations_end_until_the_launch_returned() {
        // Launched while the operation before still ran: the GPU never waited.
        assert_eq!(gpu_idle(4.0, 5.0, 2.0), 0.0);
        // Launched 1.5 ms after the one before ended: 1.5 of its 2 ms idle.
        assert_eq!(gpu_idle(6.5, 5.0, 2.0), 1.5);
        // Never more than the operation's own time (its launch returned
        // after it had run, as on the CPU GPU, whose launches run at once).
        assert_eq!(gpu_idle(9.0, 5.0, 2.0), 2.0);
        assert_eq!(gpu_idle(9.0, 5.0, -0.001), 0.0);
    }
}
