//! zworker: one process per device. It joins the job over zrun's control socket,
//! opens the data plane to its peers, and runs its task (training, or the
//! collective benchmark), reporting every step to zrun.
//!
//! Layout:
//! - [`env`](mod@env): the environment zrun (or srun, or mpirun) hands the worker.
//! - [`groups`]: the process groups, on TCP / shared memory or MPI.
//! - [`control`]: the authenticated control connection, key-value store calls,
//!   heartbeats, and the abort path.
//! - [`cores`]: the cores and compute threads a worker runs on, settled
//!   before any thread starts.
//! - [`train`]: the training loop around the engine.
//! - [`awake`]: the compute pool's other threads wait for work awake while
//!   it runs.
//! - [`checkpoint`]: writing a checkpoint (shards, then the manifest).
//! - [`bench`](mod@bench): `zrun bench comm`'s measurements.
//! - [`kernels`]: `zrun bench kernels`'s measurements.
//! - [`large_blocks`]: the allocator, which keeps freed blocks of 32 MiB
//!   and more for the next step.
//! - [`sample`]: `zrun sample`'s text generation (run as `zworker sample`).
//! - [`eval`]: `zrun eval`'s loss of a model on a file (`zworker eval`).
//! - [`gpu`]: what this host offers `device: cuda` (`zworker --cuda-probe`).
//!
//! The design decision to know: a worker never decides how the job ends. Any
//! error is reported to zrun as `Failed` and the process exits 1; zrun stops the
//! others. If zrun goes away, the worker exits on its own.

#![deny(missing_docs)]

pub mod awake;
pub mod bench;
pub mod checkpoint;
pub mod control;
pub mod cores;
pub mod env;
pub mod eval;
pub mod gpu;
pub mod groups;
pub mod kernels;
pub mod large_blocks;
pub mod sample;
pub mod train;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use zproto::{Task, ToServer};

use crate::control::ControlClient;
use crate::env::WorkerEnv;
use crate::groups::{GroupPlan, Groups, Transport};

/// The optional cargo features this binary was built with (`zworker
/// --features` prints them; zrun checks before it launches a job that needs one).
pub fn features() -> Vec<&'static str> {
    let mut f = Vec::new();
    if cfg!(feature = "mpi") {
        f.push("mpi");
    }
    if cfg!(feature = "cuda") {
        f.push("cuda");
    }
    f
}

/// Runs the worker to completion.
pub fn run() -> Result<()> {
    die_with_parent();
    let env = WorkerEnv::from_process()?;
    let (client, welcome) = ControlClient::connect(&env)?;
    // Dropped when `run` returns, after `watch_comms` let go of the
    // communicators: MPI, when used, finalises last.
    let mut groups = None;
    let result = run_task(&env, &client, welcome, &mut groups);
    client.watch_comms(Vec::new());
    match &result {
        Ok(Ended::Done) => client.send(&ToServer::Done)?,
        Ok(Ended::Stopped { step }) => client.send(&ToServer::Stopped { step: *step })?,
        Ok(Ended::EarlyStopped { step, best }) => client.send(&ToServer::EarlyStopped {
            step: *step,
            best_step: best.best_step,
            best_val_loss: best.best_val_loss,
        })?,
        Err(e) => {
            let _ = client.send(&ToServer::Failed {
                message: format!("{e:#}"),
            });
        }
    }
    result.map(drop)
}

/// How a task ended well.
pub enum Ended {
    /// All of it was done.
    Done,
    /// Training was asked to stop (SIGUSR1) and ended after `step`, whose
    /// checkpoint it saved.
    Stopped {
        /// The last step trained.
        step: u64,
    },
    /// `train.early_stopping` ended training after `step` (with its
    /// checkpoint, where the job has a directory).
    EarlyStopped {
        /// The last step trained.
        step: u64,
        /// Where early stopping stood: the best validation and its step.
        best: zckpt::EarlyStopState,
    },
}

/// A local worker (zrun sets `ZRUN_PARENT_PID`) asks the kernel to kill it
/// when its parent dies: a second line of defence behind the control
/// connection, whose loss also ends the worker, for a zrun killed before that
/// connection exists. If zrun is already gone, the worker exits at once.
///
/// The parent may be a wrapper that `--worker-bin` names (`perf record`,
/// `strace -f`, a script that runs zworker without `exec`): then the signal
/// follows the wrapper, the control connection follows zrun, and the worker
/// goes on while zrun's pid is alive. (It exited there until the
/// fifty-ninth session: a profiled worker ended with code 1 before joining
/// the job, and said nothing.)
fn die_with_parent() {
    let Some(parent) = std::env::var("ZRUN_PARENT_PID")
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return;
    };
    if nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).is_err()
        || nix::unistd::getppid().as_raw() == parent
    {
        return;
    }
    let zrun = nix::unistd::Pid::from_raw(parent);
    if nix::sys::signal::kill(zrun, None) == Err(nix::errno::Errno::ESRCH) {
        std::process::exit(1);
    }
}

fn run_task(
    env: &WorkerEnv,
    client: &Arc<ControlClient>,
    welcome: zproto::Welcome,
    groups: &mut Option<Groups>,
) -> Result<Ended> {
    let (timeout_s, heartbeat_s) = match &welcome.task {
        Task::Train(t) => (t.spec.comm.timeout_s, t.spec.comm.heartbeat_s),
        Task::BenchComm(b) => (b.timeout_s, 30.0),
        Task::BenchKernels {
            elements,
            gemm_peak_only,
        } => {
            // One process, no peers: measure and report.
            client.start_heartbeat(Duration::from_secs(2));
            let rows = if *gemm_peak_only {
                vec![kernels::gemm_peak()?]
            } else {
                kernels::bench_kernels(*elements)?
            };
            client.send(&ToServer::KernelRows(rows))?;
            return Ok(Ended::Done);
        }
    };
    client.start_heartbeat(Duration::from_secs_f64(
        (heartbeat_s / 4.0).clamp(0.2, 10.0),
    ));
    let timeout = Duration::from_secs_f64(timeout_s);
    let node_of_rank = welcome.node_of_rank.clone();
    let nodes = node_of_rank.iter().max().map_or(1, |n| n + 1);
    let groups = groups.insert(Groups::new(Transport::for_task(&welcome.task, nodes)?));
    let shm = groups.shm();
    let world = GroupPlan {
        name: "world".into(),
        members: (0..env.world_size).collect(),
        shm: shm.then(|| zproto::shm_segment_name(&env.job_id, env.node_rank)),
        color: 0,
    };
    let comm = groups.connect(env, client, &node_of_rank, timeout, world)?;
    client.watch_comms(vec![comm.clone()]);
    match welcome.task {
        Task::Train(t) => {
            let p = t.spec.zero.hpz_partition_size;
            let hpz = if p > 1 {
                let plan = groups::hpz_plan(env, &node_of_rank, p, shm)?;
                Some(groups.connect(env, client, &node_of_rank, timeout, plan)?)
            } else {
                None
            };
            client.watch_comms(
                [Some(comm.clone()), hpz.clone()]
                    .into_iter()
                    .flatten()
                    .collect(),
            );
            let groups = zengine::ProcessGroups { world: comm, hpz };
            let stop = std::sync::atomic::AtomicBool::new(false);
            rayon::scope(|s| {
                let _awake = awake::KeepAwake::start(s, &stop);
                train::train(&t.spec, t.resume.as_deref(), env, nodes, groups, client)
            })
            .map_err(|e| gpu::with_memory_hint(e, &t.spec, env.world_size))
        }
        Task::BenchComm(b) => bench::bench_comm(&b, comm, env, client).map(|()| Ended::Done),
        Task::BenchKernels { .. } => unreachable!("handled before connecting"),
    }
}
