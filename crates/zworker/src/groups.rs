//! The process groups a worker joins (the world, and hpZ's node-local groups)
//! on the transport the job asks for.
//!
//! TCP (with shared memory within a node) rendezvous through zrun's key-value
//! store. MPI (cargo feature `mpi`, workers started by `mpirun`) joins through
//! MPI's own bootstrap; MPI then lives until [`Groups`] drops, after every
//! communicator, because `MPI_Finalize` must come last and on this thread.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use zcomm::{Communicator, TcpCommunicator, TcpOptions};
use zconfig::spec::Backend;
use zproto::Task;

use crate::control::ControlClient;
use crate::env::WorkerEnv;

/// How a job's groups move bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// TCP between ranks, shared memory between ranks of one node when `shm`.
    Tcp {
        /// Use shared memory within a node.
        shm: bool,
    },
    /// MPI.
    Mpi,
}

impl Transport {
    /// The transport `task` asks for on `nodes` nodes. `comm.backend: auto` is
    /// MPI when the job spans nodes, this worker has MPI and `mpirun` started
    /// it (the cluster's fabric between nodes; MPI's own shared memory within
    /// one); otherwise shared memory within a node and TCP between, because
    /// zrun's shared memory is the faster of the two on one node (all-reduce
    /// of 64 MiB on 2 ranks: 5.0 GB/s bus bandwidth against 1.4 over Open MPI here).
    pub fn for_task(task: &Task, nodes: usize) -> Result<Transport> {
        let mpi_here = cfg!(feature = "mpi") && launched_under_mpi() && nodes > 1;
        Ok(match task {
            Task::Train(t) => match t.spec.comm.backend {
                Backend::Tcp => Transport::Tcp { shm: false },
                Backend::Shm => Transport::Tcp { shm: true },
                Backend::Auto if mpi_here => Transport::Mpi,
                Backend::Auto => Transport::Tcp { shm: true },
                Backend::Mpi => Transport::Mpi,
                // NCCL carries the GPUs' gradients; the host's collectives
                // (the norm, stop flags, checkpoints' gathers) stay on the
                // host transport.
                Backend::Nccl => Transport::Tcp { shm: true },
            },
            Task::BenchComm(b) => match b.transport.as_str() {
                "mpi" => Transport::Mpi,
                t => Transport::Tcp { shm: t == "shm" },
            },
            Task::BenchKernels { .. } => Transport::Tcp { shm: false },
        })
    }
}

/// zrun's `--launcher mpirun` started this worker (its mark, and MPI's own
/// variables). Workers of a zrun that itself runs under mpirun (per-node mode)
/// inherit MPI's variables but not the mark: they are not MPI processes.
#[cfg(feature = "mpi")]
fn launched_under_mpi() -> bool {
    std::env::var("ZRUN_LAUNCHER").as_deref() == Ok("mpirun") && zcomm::mpi::launched_under_mpi()
}

#[cfg(not(feature = "mpi"))]
fn launched_under_mpi() -> bool {
    false
}

/// A process group to connect: its name, its members (world ranks, in group
/// rank order) and, for shared memory, the segment its ranks on one node share.
pub struct GroupPlan {
    /// Group name.
    pub name: String,
    /// World ranks, in group rank order.
    pub members: Vec<usize>,
    /// Shared-memory segment (TCP transport with shared memory).
    pub shm: Option<String>,
    /// The same number on every member and a different one per group (MPI's split).
    pub color: usize,
}

/// Builds a worker's groups; holds MPI (when used) until it drops.
pub struct Groups {
    transport: Transport,
    #[cfg(feature = "mpi")]
    mpi: Option<zcomm::mpi::Runtime>,
}

impl Groups {
    /// Groups on `transport`.
    pub fn new(transport: Transport) -> Groups {
        Groups {
            transport,
            #[cfg(feature = "mpi")]
            mpi: None,
        }
    }

    /// Whether shared-memory segments are used (hpZ names one per group).
    pub fn shm(&self) -> bool {
        self.transport == (Transport::Tcp { shm: true })
    }

    /// Connects `plan`'s members.
    pub fn connect(
        &mut self,
        env: &WorkerEnv,
        client: &ControlClient,
        node_of_rank: &[usize],
        timeout: Duration,
        plan: GroupPlan,
    ) -> Result<Arc<dyn Communicator>> {
        match self.transport {
            Transport::Tcp { .. } => connect_tcp(env, client, node_of_rank, timeout, plan),
            Transport::Mpi => self.connect_mpi(env, node_of_rank, timeout, plan),
        }
    }

    #[cfg(feature = "mpi")]
    fn connect_mpi(
        &mut self,
        env: &WorkerEnv,
        node_of_rank: &[usize],
        timeout: Duration,
        plan: GroupPlan,
    ) -> Result<Arc<dyn Communicator>> {
        use zcomm::mpi::{MpiCommunicator, MpiOptions, Runtime};
        if !launched_under_mpi() {
            bail!("comm.backend: mpi: this worker was not started by mpirun (use zrun --launcher mpirun)");
        }
        if self.mpi.is_none() {
            let rt = Runtime::init()?;
            if (rt.rank(), rt.size()) != (env.rank, env.world_size) {
                bail!(
                    "MPI says rank {} of {}, zrun's environment rank {} of {}",
                    rt.rank(),
                    rt.size(),
                    env.rank,
                    env.world_size
                );
            }
            self.mpi = Some(rt);
        }
        let rt = self.mpi.as_ref().expect("initialised above");
        let opts = MpiOptions {
            timeout,
            node_of_rank: plan.members.iter().map(|&r| node_of_rank[r]).collect(),
            group: plan.name,
        };
        let comm = if plan.members.len() == env.world_size {
            MpiCommunicator::world(rt, opts)?
        } else {
            MpiCommunicator::split(rt, plan.color, opts)?
        };
        Ok(Arc::new(comm))
    }

    #[cfg(not(feature = "mpi"))]
    fn connect_mpi(
        &mut self,
        _: &WorkerEnv,
        _: &[usize],
        _: Duration,
        _: GroupPlan,
    ) -> Result<Arc<dyn Communicator>> {
        bail!("comm.backend: mpi: this zworker was built without the `mpi` feature (cargo build --release --features mpi)")
    }
}

/// Rendezvous through zrun's key-value store, then the TCP mesh of `plan`'s
/// members (and shared memory between those of a node when it names a segment).
fn connect_tcp(
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
        single_copy: true,
    };
    Ok(Arc::new(TcpCommunicator::connect(
        me, listener, &addrs, opts,
    )?))
}

/// ZeRO++ hpZ: this rank's group of `size` consecutive ranks, which zrun's
/// checks put on one node.
pub fn hpz_plan(
    env: &WorkerEnv,
    node_of_rank: &[usize],
    size: usize,
    shm: bool,
) -> Result<GroupPlan> {
    let k = env.rank / size;
    let members: Vec<usize> = (k * size..(k + 1) * size).collect();
    if members
        .iter()
        .any(|&r| node_of_rank.get(r) != Some(&env.node_rank))
    {
        bail!(
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
        color: k,
    })
}
