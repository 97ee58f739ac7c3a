//! Starting workers on this host, and stopping them.
//!
//! Each worker is a child process in a process group of its own (so a Ctrl-C at
//! the terminal reaches zrun only, and zrun decides), with the environment of
//! SPEC.md. Its stdout and stderr come back line by line as [`ProcEvent`]s, and its
//! exit as [`ProcEvent::Exited`]. Stopping kills the whole group, so anything the
//! worker started goes too.

use std::collections::BTreeMap;
use std::process::{ExitStatus, Stdio};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;

use crate::plan::LaunchPlan;
use crate::Failure;

/// Something a worker process did.
#[derive(Debug)]
pub enum ProcEvent {
    /// A line of output.
    Output {
        /// Rank.
        rank: usize,
        /// The line, without its newline.
        line: String,
        /// From stderr (else stdout).
        stderr: bool,
    },
    /// The process ended.
    Exited {
        /// Rank.
        rank: usize,
        /// How.
        status: ExitStatus,
    },
}

/// A started worker.
#[derive(Debug, Clone)]
pub struct WorkerProc {
    /// Rank.
    pub rank: usize,
    /// Process id (and process-group id).
    pub pid: u32,
    /// Host it runs on.
    pub host: String,
}

/// The environment every worker of a job shares.
pub struct JobEnv {
    /// zrun's control address as workers see it.
    pub master_addr: String,
    /// zrun's control port.
    pub master_port: u16,
    /// Job id.
    pub job_id: String,
    /// Hex token.
    pub token_hex: String,
}

/// Starts one local worker per rank of the plan.
pub fn spawn_local(
    plan: &LaunchPlan,
    job: &JobEnv,
    events: &mpsc::UnboundedSender<ProcEvent>,
) -> anyhow::Result<Vec<WorkerProc>> {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mut procs = Vec::new();
    for p in plan.topology.placements() {
        let node = &plan.topology.nodes[p.node_rank];
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        // Threads per worker: share this host's cores, like torchrun's OMP_NUM_THREADS.
        let threads = (cpus / p.local_world_size).max(1).to_string();
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            env.insert("RAYON_NUM_THREADS".into(), threads.clone());
        }
        if std::env::var_os("OMP_NUM_THREADS").is_none() {
            env.insert("OMP_NUM_THREADS".into(), threads);
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
            ("ZRUN_TOKEN", job.token_hex.clone()),
            ("ZRUN_NODE_ADDR", plan.node_addrs[p.node_rank].clone()),
        ] {
            env.insert(k.into(), v);
        }
        env.extend(plan.spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        let mut child = Command::new(&plan.worker_bin)
            .envs(&env)
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
            pid,
            host: node.host.clone(),
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
