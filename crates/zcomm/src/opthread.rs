//! The operation thread a communicator runs its collectives on, in issue
//! order, whatever its transport: callers hand over a job and get a [`Work`]
//! back at once, so compute overlaps communication; `in_flight` reports the
//! job running now for hang diagnosis; dropping the thread lets queued jobs
//! finish and then runs the transport's own last step (flushing sends,
//! freeing an MPI communicator).

use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use crate::links::Current;
use crate::{CommError, Counters, InFlight, Op, Work};

type Job<L> = Box<dyn FnOnce(&mut L) + Send>;

/// A thread that owns a transport's links `L` and runs jobs on them.
pub(crate) struct OpThread<L> {
    jobs: mpsc::Sender<Job<L>>,
    thread: Option<std::thread::JoinHandle<()>>,
    group: String,
    timeout: Duration,
    current: Arc<Mutex<Option<Current>>>,
    /// The communicator's counters, where its `Work`s add their waits.
    counters: Arc<Counters>,
}

impl<L: Send + 'static> OpThread<L> {
    /// Starts the thread `name` over `links`; `last` runs on them once every
    /// job has. `current` is what the links record of the running job;
    /// `counters` the communicator's.
    pub(crate) fn spawn(
        name: &str,
        mut links: L,
        last: impl FnOnce(&mut L) + Send + 'static,
        group: String,
        timeout: Duration,
        current: Arc<Mutex<Option<Current>>>,
        counters: Arc<Counters>,
    ) -> std::io::Result<OpThread<L>> {
        let (jobs, rx) = mpsc::channel::<Job<L>>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                for job in rx {
                    job(&mut links);
                }
                last(&mut links);
            })?;
        Ok(OpThread {
            jobs,
            thread: Some(thread),
            group,
            timeout,
            current,
            counters,
        })
    }

    /// Queues `f` as operation `op`.
    pub(crate) fn submit<T: Send + 'static>(
        &self,
        op: Op,
        f: impl FnOnce(&mut L) -> Result<T, CommError> + Send + 'static,
    ) -> Work<T> {
        let (tx, rx) = mpsc::channel();
        let job: Job<L> = Box::new(move |links: &mut L| {
            let _ = tx.send(f(links));
        });
        // If the thread is gone the receiver disconnects and `wait` reports it.
        let _ = self.jobs.send(job);
        // The operation enforces its own deadline once it starts; this bounds the
        // wait for work queued ahead of it too.
        let deadline = Instant::now() + self.timeout * 2 + Duration::from_secs(5);
        Work::new(rx, op, self.group.clone(), deadline, self.counters.clone())
    }

    /// The job running now, if any.
    pub(crate) fn in_flight(&self) -> Option<InFlight> {
        let s = self.current.lock().ok()?.clone()?;
        Some(InFlight {
            op: s.op.name(),
            group: self.group.clone(),
            bytes: s.bytes,
            waiting: s.started.elapsed(),
            peer: s.peer,
        })
    }

    /// The group's name.
    pub(crate) fn group(&self) -> &str {
        &self.group
    }

    /// The deadline of one collective.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl<L> Drop for OpThread<L> {
    /// Lets the queued jobs finish, then the thread's last step.
    fn drop(&mut self) {
        drop(std::mem::replace(&mut self.jobs, mpsc::channel().0));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
