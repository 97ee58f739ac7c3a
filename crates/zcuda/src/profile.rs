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

use std::collections::HashMap;

use cudarc::driver::{sys::CUevent_flags, CudaEvent, CudaStream, DriverError};

/// Events not yet read before the profile reads them (and waits).
const BATCH: usize = 4096;

/// The events of one stream since its profile began, read in batches.
pub(crate) struct Profile {
    /// Events recorded since the last read, each after the operation named.
    pending: Vec<(String, CudaEvent)>,
    /// The last event read: where the next operation's time starts.
    last: CudaEvent,
    totals: Totals,
}

impl Profile {
    /// A profile of `stream` from now on.
    pub(crate) fn start(stream: &CudaStream) -> Result<Profile, DriverError> {
        Ok(Profile {
            pending: Vec::new(),
            last: timed_event(stream)?,
            totals: Totals::default(),
        })
    }

    /// Marks the end of operation `name`, just enqueued on `stream`.
    pub(crate) fn mark(&mut self, stream: &CudaStream, name: String) -> Result<(), DriverError> {
        self.pending.push((name, timed_event(stream)?));
        if self.pending.len() >= BATCH {
            self.read()?;
        }
        Ok(())
    }

    /// Waits for the pending events and adds their times.
    fn read(&mut self) -> Result<(), DriverError> {
        for (name, event) in std::mem::take(&mut self.pending) {
            event.synchronize()?;
            self.totals
                .add(&name, f64::from(self.last.elapsed_ms(&event)?));
            self.last = event;
        }
        Ok(())
    }

    /// Forgets the times so far (waiting for them): the first steps'
    /// one-time costs (allocations, cuBLAS's choices) are not the step's.
    pub(crate) fn restart(&mut self) -> Result<(), DriverError> {
        self.read()?;
        self.totals = Totals::default();
        Ok(())
    }

    /// Everything so far (waiting for it), as [`Totals::table`] over `steps`.
    pub(crate) fn report(&mut self, steps: u64) -> Result<String, DriverError> {
        self.read()?;
        Ok(self.totals.table(steps))
    }
}

/// An event with timing, recorded on `stream` now.
fn timed_event(stream: &CudaStream) -> Result<CudaEvent, DriverError> {
    stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
}

/// Milliseconds and calls per operation name.
#[derive(Default)]
pub(crate) struct Totals {
    by_name: HashMap<String, (f64, u64)>,
}

impl Totals {
    /// Adds one call of `name` that took `ms`.
    pub(crate) fn add(&mut self, name: &str, ms: f64) {
        let slot = match self.by_name.get_mut(name) {
            Some(slot) => slot,
            None => self.by_name.entry(name.to_string()).or_default(),
        };
        slot.0 += ms;
        slot.1 += 1;
    }

    /// One line per operation, the most time first (ties by name): its
    /// milliseconds per step (of `steps`), its share of all, its calls per
    /// step; then the total.
    pub(crate) fn table(&self, steps: u64) -> String {
        let steps = steps.max(1) as f64;
        let total: f64 = self.by_name.values().map(|v| v.0).sum();
        let mut rows: Vec<_> = self.by_name.iter().collect();
        rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0).then(a.0.cmp(b.0)));
        let mut out = String::from("  ms/step   share  calls/step  operation\n");
        for (name, (ms, calls)) in rows {
            let share = if total > 0.0 { 100.0 * ms / total } else { 0.0 };
            out += &format!(
                "{:>9.3}  {share:>5.1}%  {:>10.1}  {name}\n",
                ms / steps,
                *calls as f64 / steps
            );
        }
        out += &format!(
            "{:>9.3}  100.0%              all marked operations\n",
            total / steps
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::Totals;

    #[test]
    fn the_table_puts_the_most_time_first_per_step_with_shares() {
        let mut t = Totals::default();
        for (name, ms) in [("gemm", 3.0), ("softmax", 1.0), ("gemm", 5.0), ("add", 1.0)] {
            t.add(name, ms);
        }
        // gemm: 8 ms over 2 steps, 80% of 10 ms, 1 call a step; the 1 ms
        // ties by name.
        let want = [
            "  ms/step   share  calls/step  operation",
            "    4.000   80.0%         1.0  gemm",
            "    0.500   10.0%         0.5  add",
            "    0.500   10.0%         0.5  softmax",
            "    5.000  100.0%              all marked operations",
        ];
        assert_eq!(t.table(2), want.map(|l| format!("{l}\n")).concat());
    }
}
