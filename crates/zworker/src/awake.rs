//! Keeps the compute pool's other threads awake while a worker trains.
//!
//! A step of one worker on several threads is a few hundred parallel regions
//! (each GEMM, each fused op, AdamW's groups) with short stretches on one
//! thread between them. A rayon thread that finds no work sleeps after a few
//! dozen rounds of looking (microseconds) and is woken through a futex when
//! the next region starts: a bf16 step on a 2-core KVM guest made about 600
//! such sleeps in 270 ms, and each region ran on one thread until the other
//! had woken. OpenMP runtimes wait far longer before they sleep (Intel's
//! 200 ms by default), which PyTorch's CPU threads get for free.
//!
//! [`KeepAwake`] runs one job on each other thread of the pool for as long as
//! it lives. The job takes work as an idle rayon thread would
//! (`rayon::yield_now` runs one job of the pool, stolen if need be) and, when
//! there is none, gives its core to any other runnable thread of the system
//! (`sched_yield`) instead of sleeping; only after `NAP_AFTER` (5 ms)
//! without work (a checkpoint, a collective waiting on slower peers) does it
//! sleep, in naps of `NAP` (200 µs), so that a waiting worker does not hold
//! a core busy. The thread that trains is never asked (its job would spin
//! where the step should run), and nothing here changes what any thread
//! computes: the bits are the same. On 1 worker × 2 threads the bf16 step
//! ran 1.04-1.07x as fast and the f32 step 1.04x (medians of alternated
//! rounds; docs/PERFORMANCE.md); a worker of one thread is left alone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Time without work after which the other threads sleep in naps.
const NAP_AFTER: Duration = Duration::from_millis(5);

/// One nap: the longest a region then runs on fewer threads than it could.
const NAP: Duration = Duration::from_micros(200);

/// While alive, the pool's other threads wait for work awake; dropping it
/// (also by unwinding) lets them go, and the scope it was started in ends
/// once they have.
pub struct KeepAwake<'s> {
    stop: &'s AtomicBool,
}

impl<'s> KeepAwake<'s> {
    /// Starts the waiting jobs in `scope` on every thread of the current pool
    /// but this one (none on a pool of one thread).
    pub fn start(scope: &rayon::Scope<'s>, stop: &'s AtomicBool) -> KeepAwake<'s> {
        stop.store(false, Ordering::Release);
        let caller = rayon::current_thread_index();
        if rayon::current_num_threads() > 1 {
            scope.spawn_broadcast(move |_, ctx| {
                if Some(ctx.index()) != caller {
                    wait_awake(stop);
                }
            });
        }
        KeepAwake { stop }
    }
}

impl Drop for KeepAwake<'_> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// Threads inside [`wait_awake`] (the test watches its job start and end).
#[cfg(test)]
static WAITING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Runs the pool's jobs as they come until `stop`.
fn wait_awake(stop: &AtomicBool) {
    #[cfg(test)]
    WAITING.fetch_add(1, Ordering::SeqCst);
    let mut idle_since = Instant::now();
    while !stop.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle_since = Instant::now();
        } else if idle_since.elapsed() < NAP_AFTER {
            std::thread::yield_now();
        } else {
            std::thread::sleep(NAP);
        }
    }
    #[cfg(test)]
    WAITING.fetch_sub(1, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// The other thread of a 2-thread pool enters the waiting job (and the
    /// training thread does not), regions still reach that thread, which
    /// only `yield_now` inside the job can give it, and the job ends once
    /// the guard is dropped, also by a panic (a job left waiting would hang
    /// the worker). Run on a thread of its own with a deadline, so that a
    /// hang fails the test instead of stalling the run.
    #[test]
    fn the_other_thread_waits_in_its_job_takes_regions_and_ends_with_the_guard() {
        let (done, finished) = std::sync::mpsc::channel();
        let exercising = std::thread::spawn(move || {
            exercise();
            done.send(()).unwrap();
        });
        match finished.recv_timeout(Duration::from_secs(60)) {
            Ok(()) => {}
            // The exercise panicked: report its own message.
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                std::panic::resume_unwind(exercising.join().unwrap_err())
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                panic!("the pool's scope did not end within 60 s of the guard's drop")
            }
        }
    }

    fn exercise() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let on_other = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        pool.install(|| {
            let me = rayon::current_thread_index();
            rayon::scope(|s| {
                let _awake = KeepAwake::start(s, &stop);
                let deadline = Instant::now() + Duration::from_secs(10);
                while WAITING.load(Ordering::SeqCst) != 1 {
                    assert!(Instant::now() < deadline, "no thread entered the job");
                    std::thread::sleep(Duration::from_millis(1));
                }
                for _ in 0..200 {
                    rayon::join(
                        || std::thread::sleep(Duration::from_micros(300)),
                        || {
                            if rayon::current_thread_index() != me {
                                on_other.fetch_add(1, Ordering::Relaxed);
                            }
                        },
                    );
                }
            })
        });
        assert!(stop.load(Ordering::Acquire));
        assert_eq!(
            WAITING.load(Ordering::SeqCst),
            0,
            "the job outlived its scope"
        );
        assert!(
            on_other.load(Ordering::Relaxed) > 0,
            "the waiting thread never took a region's work"
        );

        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                rayon::scope(|s| {
                    let _awake = KeepAwake::start(s, &stop);
                    panic!("a step failed");
                })
            })
        }));
        assert!(unwound.is_err(), "the panic went through");
        assert!(stop.load(Ordering::Acquire));
        assert_eq!(WAITING.load(Ordering::SeqCst), 0);
    }
}
