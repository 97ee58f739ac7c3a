//! Starting workers on this host, and stopping them.
//!
//! Each worker is a child process in a process group of its own (so a Ctrl-C at
//! the terminal reaches zrun only, and zrun decides), with the environment of
//! docs/CONFIG.md. Its stdout and stderr come back line by line as [`ProcEvent`]s, and its
//! exit as [`ProcEvent::Exited`]. Stopping kills the whole group, so anything the
//! worker started goes too.

use std::process::Stdio;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;

use crate::plan::LaunchPlan;
use crate::ssh::{RemoteProc, Target};
use crate::worker::{JobEnv, ProcEvent, SshOptions};
use crate::Failure;
use zconfig::Placement;

/// How to reach a started worker.
#[derive(Debug, Clone)]
pub enum Handle {
    /// A child of zrun: its pid is also its process group.
    Local {
        /// Process id.
        pid: u32,
    },
    /// A process on another host, started over SSH.
    Remote(RemoteProc),
    /// One rank of a launcher that starts them all (`srun`, `mpirun`); the
    /// pid is the launcher's (one per job).
    Step {
        /// The launcher's process id (and process group).
        pid: u32,
    },
    /// Per-node mode: a worker started by another node's zrun, which stops it
    /// when told `Abort` (or when this zrun goes away).
    Node {
        /// That node's rank.
        node: usize,
    },
}

/// A started worker.
#[derive(Debug, Clone)]
pub struct WorkerProc {
    /// Rank.
    pub rank: usize,
    /// Host it runs on.
    pub host: String,
    /// How to stop it.
    pub handle: Handle,
}

impl WorkerProc {
    /// Its pid, where known.
    pub fn pid(&self) -> u32 {
        match &self.handle {
            Handle::Local { pid } => *pid,
            Handle::Step { .. } | Handle::Node { .. } => 0,
            Handle::Remote(r) => r.pid.lock().map(|p| p.unwrap_or(0)).unwrap_or(0),
        }
    }

    /// Kills it and everything it started (SIGKILL to its process group).
    pub async fn kill(&self, ssh: Option<&SshOptions>) {
        match (&self.handle, ssh) {
            (Handle::Local { pid }, _) => signal_group(*pid, Signal::SIGKILL),
            // srun and mpirun stop every rank on SIGTERM; they cannot pass
            // SIGKILL on, so give them a moment before killing them too.
            (Handle::Step { pid }, _) => {
                signal_group(*pid, Signal::SIGTERM);
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                signal_group(*pid, Signal::SIGKILL);
            }
            (Handle::Remote(r), Some(o)) => {
                let (r, o) = (r.clone(), o.clone());
                let task = tokio::task::spawn_blocking(move || crate::ssh::kill(&r, &o));
                match tokio::time::timeout(crate::ssh::CONNECT_TIMEOUT * 2, task).await {
                    Ok(Ok(Ok(()))) => {}
                    Ok(Ok(Err(e))) => {
                        tracing::error!("killing rank {} on {}: {e}", self.rank, self.host)
                    }
                    _ => tracing::error!("killing rank {} on {}: timed out", self.rank, self.host),
                }
            }
            (Handle::Remote(_), None) | (Handle::Node { .. }, _) => {}
        }
    }
}

/// The environment of one worker (docs/CONFIG.md) (without the token).
fn worker_env(
    plan: &LaunchPlan,
    p: &Placement,
    job: &JobEnv,
    threads: Option<usize>,
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = Vec::new();
    if let Some(t) = threads {
        // Share this host's cores, like torchrun's OMP_NUM_THREADS.
        for k in ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"] {
            if std::env::var_os(k).is_none() {
                env.push((k.into(), t.to_string()));
            }
        }
    }
    for (k, v) in [
        ("RANK", p.rank.to_string()),
        ("WORLD_SIZE", plan.topology.world_size().to_string()),
        ("LOCAL_RANK", p.local_rank.to_string()),
        ("LOCAL_WORLD_SIZE", p.local_world_size.to_string()),
        ("NODE_RANK", p.node_rank.to_string()),
        ("MASTER_ADDR", job.master_addr.clone()),
        ("MASTER_PORT", job.master_port.to_string()),
        ("ZRUN_JOB_ID", job.job_id.clone()),
        ("ZRUN_NODE_ADDR", plan.node_addrs[p.node_rank].clone()),
    ] {
        env.push((k.into(), v));
    }
    if let Some(cores) = &plan.bind_cores {
        env.push(("ZRUN_BIND_CORES".into(), cores.clone()));
    }
    env.extend(plan.env.iter().cloned());
    env
}

/// The threads each of `workers` workers on this host gets: an equal share
/// of its cores (at least one), as torchrun's `OMP_NUM_THREADS` shares them.
pub fn cores_share(workers: usize) -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cpus / workers.max(1)).max(1)
}

/// Starts one local worker per rank of the plan (of node `only_node` alone,
/// when given: per-node mode).
pub fn spawn_local(
    plan: &LaunchPlan,
    job: &JobEnv,
    events: &mpsc::UnboundedSender<ProcEvent>,
    only_node: Option<usize>,
) -> anyhow::Result<Vec<WorkerProc>> {
    let mut procs = Vec::new();
    for p in plan.topology.placements() {
        if only_node.is_some_and(|n| n != p.node_rank) {
            continue;
        }
        let node = &plan.topology.nodes[p.node_rank];
        // Pinned workers run a thread a core of their own share.
        let threads = match plan.bind_cores {
            Some(_) => None,
            None => Some(cores_share(p.local_world_size)),
        };
        let env = worker_env(plan, &p, job, threads);
        let mut child = Command::new(&plan.worker_bin)
            .envs(env)
            .env("ZRUN_TOKEN", &job.token_hex)
            // The worker dies with zrun even before it has a control connection.
            .env("ZRUN_PARENT_PID", std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                Failure::launch(format!(
                    "starting rank {} ({}): {e}",
                    p.rank,
                    plan.worker_bin.display()
                ))
            })?;
        let pid = child.id().unwrap_or(0);
        if let Some(out) = child.stdout.take() {
            forward_lines(out, p.rank, false, events.clone());
        }
        if let Some(err) = child.stderr.take() {
            forward_lines(err, p.rank, true, events.clone());
        }
        let (rank, tx) = (p.rank, events.clone());
        tokio::spawn(async move {
            if let Ok(status) = child.wait().await {
                let _ = tx.send(ProcEvent::Exited { rank, status });
            }
        });
        procs.push(WorkerProc {
            rank: p.rank,
            host: node.host.clone(),
            handle: Handle::Local { pid },
        });
    }
    Ok(procs)
}

/// Variables of an outer launcher that must not leak into srun's tasks: each
/// task takes its rank from Slurm's own variables.
const PER_RANK_VARS: [&str; 5] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
];

/// Starts every worker as one `srun` step (inside an allocation). Tasks read
/// SLURM_PROCID / SLURM_LOCALID / SLURM_NODEID / SLURM_NTASKS; `--label` tells
/// whose output a line is; `--distribution=block` puts consecutive ranks on a node.
pub fn spawn_slurm(
    plan: &LaunchPlan,
    job: &JobEnv,
    events: &mpsc::UnboundedSender<ProcEvent>,
) -> anyhow::Result<Vec<WorkerProc>> {
    let world = plan.topology.world_size();
    let nodes = plan.topology.nodes.len();
    let per_node = world / nodes;
    let mut cmd = Command::new("srun");
    cmd.arg(format!("--ntasks={world}"))
        .arg(format!("--nodes={nodes}"))
        .arg(format!("--ntasks-per-node={per_node}"))
        .arg("--distribution=block")
        .arg("--kill-on-bad-exit=1")
        .arg("--label")
        .args(&plan.launcher_args)
        .arg(&plan.worker_bin);
    for k in PER_RANK_VARS {
        cmd.env_remove(k);
    }
    if let Some(cores) = &plan.bind_cores {
        cmd.env("ZRUN_BIND_CORES", cores);
    }
    cmd.envs(plan.env.iter().cloned())
        .env("MASTER_ADDR", &job.master_addr)
        .env("MASTER_PORT", job.master_port.to_string())
        .env("ZRUN_JOB_ID", &job.job_id)
        .env("ZRUN_TOKEN", &job.token_hex)
        .env("ZRUN_NODE_ADDR", "0.0.0.0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|e| {
        Failure::launch(format!(
            "starting srun: {e} (is this inside a Slurm allocation?)"
        ))
    })?;
    let srun = child.id().unwrap_or(0);
    forward_step(&mut child, world, srun_label, "srun", events);
    watch_step(child, world, events);
    Ok((0..world)
        .map(|rank| WorkerProc {
            rank,
            host: plan.topology.nodes[rank / per_node].host.clone(),
            handle: Handle::Step { pid: srun },
        })
        .collect())
}

/// srun's `--label` lines read "  3: text".
fn srun_label(line: &str) -> Option<(usize, String)> {
    let (r, t) = line.trim_start().split_once(": ")?;
    Some((r.parse().ok()?, t.to_string()))
}

/// Open MPI's `--tag-output` lines read "[1,3]<stdout>:text".
fn mpirun_label(line: &str) -> Option<(usize, String)> {
    let rest = line.strip_prefix('[')?;
    let (ids, rest) = rest.split_once(']')?;
    let rank = ids.split(',').nth(1)?.parse().ok()?;
    let (_, text) = rest.split_once(">:")?;
    Some((rank, text.to_string()))
}

/// Forwards the lines of a launcher that starts every rank (srun, mpirun) to
/// the rank its label names; unlabelled lines are the launcher's own.
fn forward_step(
    child: &mut tokio::process::Child,
    world: usize,
    label: fn(&str) -> Option<(usize, String)>,
    launcher: &'static str,
    events: &mpsc::UnboundedSender<ProcEvent>,
) {
    for (out, stderr) in [
        (
            child
                .stdout
                .take()
                .map(|o| Box::new(o) as Box<dyn AsyncRead + Unpin + Send>),
            false,
        ),
        (
            child
                .stderr
                .take()
                .map(|e| Box::new(e) as Box<dyn AsyncRead + Unpin + Send>),
            true,
        ),
    ] {
        let Some(out) = out else { continue };
        let tx = events.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(out).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let (rank, text) =
                    label(&line).unwrap_or_else(|| (0, format!("({launcher}) {line}")));
                let _ = tx.send(ProcEvent::Output {
                    rank: rank.min(world - 1),
                    line: text,
                    stderr,
                });
            }
        });
    }
}

/// When the launcher exits, every rank has.
fn watch_step(
    mut child: tokio::process::Child,
    world: usize,
    events: &mpsc::UnboundedSender<ProcEvent>,
) {
    let tx = events.clone();
    tokio::spawn(async move {
        if let Ok(status) = child.wait().await {
            for rank in 0..world {
                let _ = tx.send(ProcEvent::Exited { rank, status });
            }
        }
    });
}

/// Starts every worker with Open MPI's `mpirun`: ranks fill each host's slots
/// in turn (the topology's order), and every rank gets the same environment,
/// including `ZRUN_NODE_OF_RANK`, from which it finds its node. Hosts that are
/// all this machine run as `--host localhost:N` (the nodes are then zrun's
/// simulation, as with the local launcher); others are passed by name, and
/// mpirun reaches them its own way (its ssh agent, or the batch allocation).
pub fn spawn_mpirun(
    plan: &LaunchPlan,
    job: &JobEnv,
    events: &mpsc::UnboundedSender<ProcEvent>,
) -> anyhow::Result<Vec<WorkerProc>> {
    let world = plan.topology.world_size();
    let hosts = if plan.here {
        format!("localhost:{world}")
    } else {
        plan.topology
            .nodes
            .iter()
            .map(|n| format!("{}:{}", n.host, n.slots.len()))
            .collect::<Vec<_>>()
            .join(",")
    };
    let nodes: Vec<String> = plan
        .topology
        .node_of_rank()
        .iter()
        .map(usize::to_string)
        .collect();
    let mut env: Vec<(String, String)> = vec![
        ("MASTER_ADDR".into(), job.master_addr.clone()),
        ("MASTER_PORT".into(), job.master_port.to_string()),
        ("ZRUN_JOB_ID".into(), job.job_id.clone()),
        ("ZRUN_TOKEN".into(), job.token_hex.clone()),
        ("ZRUN_NODE_ADDR".into(), plan.node_addrs[0].clone()),
        ("ZRUN_NODE_OF_RANK".into(), nodes.join(",")),
        ("ZRUN_LAUNCHER".into(), "mpirun".into()),
    ];
    if let Some(cores) = &plan.bind_cores {
        env.push(("ZRUN_BIND_CORES".into(), cores.clone()));
    } else if plan.here {
        // Every rank on this host: share its cores, as the local launcher does.
        for k in ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"] {
            if std::env::var_os(k).is_none() {
                env.push((k.into(), cores_share(world).to_string()));
            }
        }
    }
    env.extend(plan.env.iter().cloned());
    let mut cmd = Command::new("mpirun");
    cmd.args(["-np", &world.to_string(), "--host", &hosts, "--tag-output"]);
    // Open MPI refuses root unless told; zrun running as root has decided.
    if nix::unistd::geteuid().is_root() {
        cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
    // `-x NAME` passes the variable by name: the token stays out of argv.
    for (k, v) in &env {
        cmd.arg("-x").arg(k).env(k, v);
    }
    for k in PER_RANK_VARS {
        cmd.env_remove(k);
    }
    cmd.args(&plan.launcher_args)
        .arg(&plan.worker_bin)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = cmd
        .spawn()
        .map_err(|e| Failure::launch(format!("starting mpirun: {e}")))?;
    let mpirun = child.id().unwrap_or(0);
    forward_step(&mut child, world, mpirun_label, "mpirun", events);
    watch_step(child, world, events);
    Ok(plan
        .topology
        .placements()
        .into_iter()
        .map(|p| WorkerProc {
            rank: p.rank,
            host: plan.topology.nodes[p.node_rank].host.clone(),
            handle: Handle::Step { pid: mpirun },
        })
        .collect())
}

/// Starts every worker over SSH: all hosts are connected and verified first.
pub async fn spawn_ssh(
    plan: &LaunchPlan,
    job: &JobEnv,
    events: &mpsc::UnboundedSender<ProcEvent>,
) -> anyhow::Result<Vec<WorkerProc>> {
    let o = plan
        .ssh
        .as_ref()
        .ok_or_else(|| Failure::launch("ssh launch without ssh settings"))?;
    let me = std::env::var("USER").unwrap_or_else(|_| "root".into());
    let placements = plan.topology.placements();
    let targets: Vec<Target> = placements
        .iter()
        .map(|p| {
            let n = &plan.topology.nodes[p.node_rank];
            Target {
                host: n.host.clone(),
                port: n.port.unwrap_or(o.port),
                user: n.user.clone().unwrap_or_else(|| me.clone()),
            }
        })
        .collect();
    let sessions = crate::ssh::connect_all(&targets, o).await?;
    let cwd = std::env::current_dir()?;
    let mut procs = Vec::new();
    for ((p, t), s) in placements.iter().zip(targets).zip(sessions) {
        let env = worker_env(plan, p, job, None);
        let remote = crate::ssh::start_worker(
            s,
            t.clone(),
            p.rank,
            &cwd,
            &plan.worker_bin,
            &env,
            job,
            events.clone(),
        )
        .map_err(|e| Failure::launch(format!("rank {} on {}: {e}", p.rank, t.host)))?;
        procs.push(WorkerProc {
            rank: p.rank,
            host: t.host,
            handle: Handle::Remote(remote),
        });
    }
    Ok(procs)
}

fn forward_lines(
    r: impl AsyncRead + Unpin + Send + 'static,
    rank: usize,
    stderr: bool,
    tx: mpsc::UnboundedSender<ProcEvent>,
) {
    tokio::spawn(async move {
        let mut lines = BufReader::new(r).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let _ = tx.send(ProcEvent::Output { rank, line, stderr });
        }
    });
}

/// Sends `signal` to a worker's process group; a group that is gone is not an error.
pub fn signal_group(pid: u32, signal: Signal) {
    if pid == 0 {
        return;
    }
    if let Err(e) = killpg(Pid::from_raw(pid as i32), signal) {
        if e != nix::errno::Errno::ESRCH {
            tracing::warn!("signalling process group {pid}: {e}");
        }
    }
}
