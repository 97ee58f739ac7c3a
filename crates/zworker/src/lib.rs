//! zworker: one process per device. It joins the job over zrun's control socket,
//! opens the data plane to its peers, and runs its task (training, or the
//! collective benchmark), reporting every step to zrun.
//!
//! Layout:
//! - [`env`](mod@env): the environment zrun (or srun) hands the worker.
//! - [`control`]: the authenticated control connection, key-value store calls,
//!   heartbeats, and the abort path.
//! - [`train`]: the training loop around the engine.
//! - [`checkpoint`]: writing a checkpoint (shards, then the manifest).
//! - [`bench`](mod@bench): `zrun bench comm`'s measurements.
//! - [`kernels`]: `zrun bench kernels`'s measurements.
//! - [`sample`]: `zrun sample`'s text generation (run as `zworker sample`).
//!
//! The design decision to know: a worker never decides how the job ends. Any
//! error is reported to zrun as `Failed` and the process exits 1; zrun stops the
//! others. If zrun goes away, the worker exits on its own.

#![deny(missing_docs)]

pub mod bench;
pub mod checkpoint;
pub mod control;
pub mod env;
pub mod kernels;
pub mod sample;
pub mod train;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use zcomm::{Communicator, TcpCommunicator, TcpOptions};
use zproto::{Task, ToServer};

use crate::control::ControlClient;
use crate::env::WorkerEnv;

/// Runs the worker to completion.
pub fn run() -> Result<()> {
    die_with_parent();
    let env = WorkerEnv::from_process()?;
    let (client, welcome) = ControlClient::connect(&env)?;
    let result = run_task(&env, &client, welcome);
    client.watch_comms(Vec::new());
    match &result {
        Ok(()) => client.send(&ToServer::Done)?,
        Err(e) => {
            let _ = client.send(&ToServer::Failed {
                message: format!("{e:#}"),
            });
        }
    }
    result
}

/// A local worker (zrun sets `ZRUN_PARENT_PID`) asks the kernel to kill it
/// when zrun dies: a second line of defence behind the control connection,
/// whose loss also ends the worker, for a zrun killed before that connection
/// exists. If zrun is already gone, the worker exits at once.
fn die_with_parent() {
    let Some(parent) = std::env::var("ZRUN_PARENT_PID")
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return;
    };
    if nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).is_ok()
        && nix::unistd::getppid().as_raw() != parent
    {
        std::process::exit(1);
    }
}

fn run_task(env: &WorkerEnv, client: &Arc<ControlClient>, welcome: zproto::Welcome) -> Result<()> {
    let (timeout_s, heartbeat_s) = match &welcome.task {
        Task::Train(t) => (t.spec.comm.timeout_s, t.spec.comm.heartbeat_s),
        Task::BenchComm(b) => (b.timeout_s, 30.0),
        Task::BenchKernels { elements } => {
            // One process, no peers: measure and report.
            client.start_heartbeat(Duration::from_secs(2));
            let rows = kernels::bench_kernels(*elements)?;
            return client.send(&ToServer::KernelRows(rows));
        }
    };
    client.start_heartbeat(Duration::from_secs_f64(
        (heartbeat_s / 4.0).clamp(0.2, 10.0),
    ));
    let timeout = Duration::from_secs_f64(timeout_s);
    let node_of_rank = welcome.node_of_rank.clone();
    // comm.backend auto (and shm): shared memory within a node, TCP between nodes.
    let shm = match &welcome.task {
        Task::Train(t) => t.spec.comm.backend != zconfig::spec::Backend::Tcp,
        Task::BenchComm(b) => b.transport == "shm",
        Task::BenchKernels { .. } => false,
    };
    let world = GroupPlan {
        name: "world".into(),
        members: (0..env.world_size).collect(),
        shm: shm.then(|| zproto::shm_segment_name(&env.job_id, env.node_rank)),
    };
    let comm = connect_group(env, client, &node_of_rank, timeout, world)?;
    client.watch_comms(vec![comm.clone()]);
    match welcome.task {
        Task::Train(t) => {
            let p = t.spec.zero.hpz_partition_size;
            let hpz = if p > 1 {
                let plan = hpz_plan(env, &node_of_rank, p, shm)?;
                Some(connect_group(env, client, &node_of_rank, timeout, plan)?)
            } else {
                None
            };
            client.watch_comms(
                [Some(comm.clone()), hpz.clone()]
                    .into_iter()
                    .flatten()
                    .collect(),
            );
            let nodes = node_of_rank.iter().max().map_or(1, |n| n + 1);
            let groups = zengine::ProcessGroups { world: comm, hpz };
            train::train(&t.spec, t.resume.as_deref(), env, nodes, groups, client)
        }
        Task::BenchComm(b) => bench::bench_comm(&b, comm, client),
        Task::BenchKernels { .. } => unreachable!("handled before connecting"),
    }
}

/// A process group to connect: its name, its members (world ranks, in group
/// rank order) and the shared-memory segment its ranks on one node share.
struct GroupPlan {
    name: String,
    members: Vec<usize>,
    shm: Option<String>,
}

/// Rendezvous through zrun's key-value store, then the TCP mesh of `plan`'s
/// members (and shared memory between those of a node when it names a segment).
fn connect_group(
    env: &WorkerEnv,
    client: &ControlClient,
    node_of_rank: &[usize],
    timeout: Duration,
    plan: GroupPlan,
) -> Result<Arc<dyn Communicator>> {
    let me = plan
        .members
        .iter()
        .position(|&r| r == env.rank)
        .with_context(|| format!("rank {} is not in group {}", env.rank, plan.name))?;
    let listener = TcpCommunicator::bind(&env.node_addr)
        .with_context(|| format!("binding the data-plane listener on {}", env.node_addr))?;
    let mut addr = listener.local_addr()?;
    if addr.ip().is_unspecified() {
        // Bound to every interface (srun tasks do not know their node's address):
        // publish the one on the route to zrun.
        let probe = std::net::UdpSocket::bind("0.0.0.0:0")?;
        probe.connect((env.master_addr.as_str(), env.master_port))?;
        addr.set_ip(probe.local_addr()?.ip());
    }
    let key = |i: usize| format!("zcomm/{}/addr/{i}", plan.name);
    client.kv_set(&key(me), &addr.to_string())?;
    let values = client.kv_wait((0..plan.members.len()).map(key).collect(), timeout)?;
    let addrs: Vec<SocketAddr> = values
        .iter()
        .map(|v| v.parse().with_context(|| format!("bad peer address `{v}`")))
        .collect::<Result<_>>()?;
    let opts = TcpOptions {
        token: env.token.clone(),
        timeout,
        node_of_rank: plan.members.iter().map(|&r| node_of_rank[r]).collect(),
        group: plan.name,
        shm: plan.shm,
    };
    Ok(Arc::new(TcpCommunicator::connect(
        me, listener, &addrs, opts,
    )?))
}

/// ZeRO++ hpZ: this rank's group of `size` consecutive ranks, which zrun's
/// checks put on one node.
fn hpz_plan(env: &WorkerEnv, node_of_rank: &[usize], size: usize, shm: bool) -> Result<GroupPlan> {
    let k = env.rank / size;
    let members: Vec<usize> = (k * size..(k + 1) * size).collect();
    if members
        .iter()
        .any(|&r| node_of_rank.get(r) != Some(&env.node_rank))
    {
        anyhow::bail!(
            "zero.hpz_partition_size {size}: ranks {}..{} are not all on node {}",
            members[0],
            members[size - 1],
            env.node_rank
        );
    }
    Ok(GroupPlan {
        name: format!("hpz{k}"),
        members,
        shm: shm.then(|| zproto::hpz_segment_name(&env.job_id, k)),
    })
}
