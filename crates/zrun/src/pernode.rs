//! Per-node mode: one `zrun train --nnodes N --node-rank R` per node, started by
//! the cluster (a Kubernetes JobSet or PyTorchJob, `mpirun`, PBS, LSF), the way
//! `torchrun` runs.
//!
//! Node 0's zrun is the job: it serves the control socket on a known port
//! (`--master-port`, default 29500) that every worker connects to, writes the
//! metrics and decides the outcome, exactly as when one zrun starts everything.
//! Each other node's zrun ([`join`]) authenticates to it with the shared job
//! token (`ZRUN_TOKEN` or `--token-file`: every node must know it beforehand,
//! and it never appears on a command line), checks that its own job file says
//! what node 0's does, starts its local workers pointed at node 0, and relays
//! their output and exits. It stops its workers when node 0 says so, when
//! node 0 goes away, or on a signal of its own (which stops the whole job), and
//! exits with the job's exit code.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use tokio::net::TcpStream;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use zconfig::hostfile::{MAX_SLOTS, MAX_WORLD};
use zconfig::{JobSpec, Node, Topology};
use zproto::auth::nonce;
use zproto::frame::{read_frame_async, write_frame_async, HANDSHAKE_MAX, MAX_FRAME};
use zproto::{NodeWelcome, Task, ToServer, ToWorker, Token, NODE_CONTEXT, NODE_SERVER_CONTEXT};

use crate::cli::{LaunchArgs, PerNodeArgs};
use crate::exit;
use crate::launch::{signal_group, spawn_local};
use crate::plan::{LaunchPlan, DEFAULT_CPU_WORKERS};
use crate::worker::{JobEnv, ProcEvent};
use crate::Failure;

/// torchrun's default rendezvous port.
pub const DEFAULT_PORT: u16 = 29500;

/// Grace between node 0's `Abort` and SIGKILL of this node's workers (node 0
/// waits a little longer for their exits).
const ABORT_GRACE: Duration = Duration::from_secs(2);

/// How long a node waits for node 0's verdict once its own workers are gone.
const VERDICT_WAIT: Duration = Duration::from_secs(30);

/// Where this zrun stands in a per-node job.
#[derive(Debug, Clone)]
pub struct PerNode {
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node.
    pub node_rank: usize,
    /// Workers on every node.
    pub workers_per_node: usize,
    /// Node 0's address.
    pub master_addr: String,
    /// Node 0's control port.
    pub master_port: u16,
    /// The job token every node shares.
    pub token: Token,
}

/// The environment's answer for a per-node value: the first of `names` set.
fn from_env(names: &[&str]) -> Result<Option<(usize, String)>> {
    for n in names {
        if let Ok(v) = std::env::var(n) {
            return v
                .trim()
                .parse()
                .map(|x| Some((x, n.to_string())))
                .map_err(|_| Failure::bad_input(format!("{n} = `{v}` is not a number")));
        }
    }
    Ok(None)
}

/// Reads per-node mode from flags and environment: `None` unless `--nnodes`
/// or `--node-rank` is given. Bad or missing values are exit 2.
pub fn resolve(launch: &LaunchArgs, args: &PerNodeArgs) -> Result<Option<PerNode>> {
    if args.nnodes.is_none() && args.node_rank.is_none() {
        if args.token_file.is_some() || args.node_addr.is_some() {
            return Err(Failure::bad_input(
                "--token-file and --node-addr belong to per-node mode: add --nnodes N --node-rank R",
            ));
        }
        return Ok(None);
    }
    if launch.hostfile.is_some()
        || launch.include.is_some()
        || launch.exclude.is_some()
        || launch.num_nodes.is_some()
        || launch.launcher.is_some()
    {
        return Err(Failure::bad_input(
            "per-node mode (--nnodes/--node-rank) starts this node's workers only: drop --hostfile, --include, --exclude, --num-nodes and --launcher",
        ));
    }
    let nnodes = match args.nnodes {
        Some(n) => n,
        None => {
            from_env(&["NNODES", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])?
                .ok_or_else(|| {
                    Failure::bad_input(
                        "per-node mode: the number of nodes is missing (--nnodes, or NNODES / WORLD_SIZE / OMPI_COMM_WORLD_SIZE)",
                    )
                })?
                .0
        }
    };
    let (node_rank, source) = match args.node_rank {
        Some(r) => (r, "--node-rank".to_string()),
        None => from_env(&["NODE_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"])?
            .ok_or_else(|| {
                Failure::bad_input(
                    "per-node mode: this node's rank is missing (--node-rank, or NODE_RANK / RANK / OMPI_COMM_WORLD_RANK)",
                )
            })?,
    };
    if nnodes == 0 || node_rank >= nnodes {
        return Err(Failure::bad_input(format!(
            "per-node mode: node rank {node_rank} (from {source}) is not below the number of nodes, {nnodes}"
        )));
    }
    let workers_per_node = launch.workers_per_node.unwrap_or(DEFAULT_CPU_WORKERS);
    if !(1..=MAX_SLOTS).contains(&workers_per_node) {
        return Err(Failure::bad_input(format!(
            "--workers-per-node: must be between 1 and {MAX_SLOTS}, got {workers_per_node}"
        )));
    }
    if nnodes > MAX_WORLD / workers_per_node {
        return Err(Failure::bad_input(format!(
            "per-node mode: {nnodes} nodes of {workers_per_node} workers are more than {MAX_WORLD} ranks"
        )));
    }
    let master_addr = match &launch.master_addr {
        Some(a) => a.clone(),
        None => std::env::var("MASTER_ADDR").map_err(|_| {
            Failure::bad_input(
                "per-node mode: node 0's address is missing (--master-addr, or MASTER_ADDR)",
            )
        })?,
    };
    let master_port = match launch.master_port {
        Some(p) => p,
        None => match from_env(&["MASTER_PORT"])? {
            Some((p, _)) => u16::try_from(p)
                .map_err(|_| Failure::bad_input(format!("MASTER_PORT = {p} is not a port")))?,
            None => DEFAULT_PORT,
        },
    };
    if master_port == 0 {
        return Err(Failure::bad_input(
            "per-node mode: the other nodes must know node 0's port; --master-port 0 picks one at random",
        ));
    }
    let token = read_token(args.token_file.as_deref())?;
    Ok(Some(PerNode {
        nnodes,
        node_rank,
        workers_per_node,
        master_addr,
        master_port,
        token,
    }))
}

fn read_token(file: Option<&Path>) -> Result<Token> {
    let (text, from) = match file {
        Some(f) => (
            std::fs::read_to_string(f).map_err(|e| {
                Failure::bad_input(format!("--token-file {}: {e}", f.display()))
            })?,
            format!("--token-file {}", f.display()),
        ),
        None => (
            std::env::var("ZRUN_TOKEN").map_err(|_| {
                Failure::bad_input(
                    "per-node mode: every node needs the same job token: set ZRUN_TOKEN (e.g. `export ZRUN_TOKEN=$(openssl rand -hex 32)`, a Kubernetes Secret) or pass --token-file FILE",
                )
            })?,
            "ZRUN_TOKEN".to_string(),
        ),
    };
    Token::from_hex(&text).ok_or_else(|| {
        Failure::bad_input(format!(
            "{from}: not a token (at least 32 hex digits, e.g. from `openssl rand -hex 32`)"
        ))
    })
}

/// The job's topology as every node sees it: `nnodes` nodes of
/// `workers_per_node` ranks, consecutive ranks on a node. Node names are
/// placeholders until their zruns join (this node's is its host name).
pub fn topology(p: &PerNode) -> Topology {
    Topology {
        nodes: (0..p.nnodes)
            .map(|i| Node {
                host: if i == p.node_rank {
                    hostname()
                } else {
                    format!("node-{i}")
                },
                slots: (0..p.workers_per_node).collect(),
                port: None,
                user: None,
            })
            .collect(),
    }
}

/// This host's name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The first place two job specs differ, as `key: A vs B`.
fn first_difference(a: &serde_json::Value, b: &serde_json::Value, at: &str) -> Option<String> {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter().find_map(|k| {
                let path = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                first_difference(
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    &path,
                )
            })
        }
        _ if a == b => None,
        _ => Some(format!("{at}: {a} vs {b}")),
    }
}

/// Why this node's job differs from node 0's, if it does.
fn spec_mismatch(mine: &JobSpec, task: &Task) -> Option<String> {
    let Task::Train(t) = task else {
        return Some("node 0 runs something other than `zrun train`".into());
    };
    let (a, b) = (serde_json::to_value(&t.spec), serde_json::to_value(mine));
    match (a, b) {
        (Ok(a), Ok(b)) => first_difference(&a, &b, ""),
        _ => Some("cannot compare the job specs".into()),
    }
}

/// Runs this node (rank 1 or more) of a per-node job to the end; returns the
/// job's exit code as node 0 decided it.
pub fn join(plan: LaunchPlan) -> Result<ExitCode> {
    let p = plan.per_node.clone().expect("join is for per-node plans");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let deadline = Duration::from_secs_f64(plan.spec.comm.timeout_s);
    rt.block_on(async move {
        let (mut stream, welcome) = connect(&p, deadline).await?;
        // Node 0 alone counts what a resumed `train.epochs` has left (it
        // holds the checkpoint): its steps are the job's.
        let mut mine = plan.spec.clone();
        if let (Some(_), Task::Train(t)) = (mine.train.epochs, &welcome.task) {
            mine.train.steps = t.spec.train.steps;
            mine.train.warmup_steps = t.spec.train.warmup_steps;
        }
        if let Some(d) = spec_mismatch(&mine, &welcome.task) {
            let reason = format!(
                "this node's job differs from node 0's at {d} (node 0's first): every node must run the same job file, --set and --deepspeed"
            );
            let stopping = ToServer::NodeStopping {
                reason: reason.clone(),
                code: exit::BAD_INPUT,
            };
            let _ = tokio::time::timeout(
                Duration::from_secs(5),
                write_frame_async(&mut stream, &stopping),
            )
            .await;
            return Err(Failure::bad_input(format!("node {}: {reason}", p.node_rank)));
        }
        say!(
            "zrun: node {} of {} joined node 0 at {}:{} (job {}); starting {} worker(s)",
            p.node_rank,
            p.nnodes,
            p.master_addr,
            p.master_port,
            welcome.job_id,
            p.workers_per_node
        );
        let code = run_node(&plan, &p, stream, &welcome.job_id).await?;
        crate::supervise::remove_node_leftovers(&plan, &welcome.job_id);
        Ok(ExitCode::from(code))
    })
}

/// Connects to node 0 and authenticates, retrying until `limit` (the other
/// nodes' pods may start in any order).
async fn connect(p: &PerNode, limit: Duration) -> Result<(TcpStream, NodeWelcome)> {
    let target = format!("{}:{}", p.master_addr, p.master_port);
    let until = tokio::time::Instant::now() + limit;
    let mut said = false;
    let mut stream = loop {
        match tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(&target)).await {
            Ok(Ok(s)) => break s,
            Ok(Err(e)) if tokio::time::Instant::now() < until => {
                if !said {
                    say!(
                        "zrun: node {}: waiting for node 0 at {target} ({e})",
                        p.node_rank
                    );
                    said = true;
                }
            }
            Err(_) if tokio::time::Instant::now() < until => {}
            Ok(Err(e)) => {
                return Err(Failure::launch(format!(
                    "node {}: cannot reach node 0 at {target} within {:.0}s (comm.timeout_s): {e}",
                    p.node_rank,
                    limit.as_secs_f64()
                )))
            }
            Err(_) => {
                return Err(Failure::launch(format!(
                    "node {}: connecting to node 0 at {target} timed out",
                    p.node_rank
                )))
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let _ = stream.set_nodelay(true);
    let handshake = async {
        let ToWorker::Challenge { nonce: challenge } =
            read_frame_async::<_, ToWorker>(&mut stream, HANDSHAKE_MAX).await?
        else {
            anyhow::bail!("{target} did not open with a challenge (is it node 0's zrun?)");
        };
        let mine = nonce();
        let hello = ToServer::NodeHello {
            node: p.node_rank as u64,
            proof: p.token.prove(NODE_CONTEXT, &challenge, p.node_rank as u64),
            nonce: mine,
            pid: std::process::id(),
            hostname: hostname(),
            workers: p.workers_per_node as u64,
        };
        write_frame_async(&mut stream, &hello).await?;
        match read_frame_async::<_, ToWorker>(&mut stream, MAX_FRAME).await {
            Ok(ToWorker::NodeWelcome(w)) => {
                if !p
                    .token
                    .verify(NODE_SERVER_CONTEXT, &mine, p.node_rank as u64, &w.server_proof)
                {
                    anyhow::bail!("{target} does not know the job token");
                }
                Ok(Ok(*w))
            }
            Ok(ToWorker::Abort { reason }) => Ok(Err(reason)),
            Ok(other) => anyhow::bail!("unexpected answer from node 0: {other:?}"),
            Err(e) => anyhow::bail!(
                "node 0 at {target} closed the handshake ({e}): is ZRUN_TOKEN the same on every node?"
            ),
        }
    };
    match tokio::time::timeout(Duration::from_secs(10), handshake).await {
        Ok(Ok(Ok(w))) => Ok((stream, w)),
        Ok(Ok(Err(reason))) => Err(Failure::bad_input(format!(
            "node {}: node 0 refused this node: {reason}",
            p.node_rank
        ))),
        Ok(Err(e)) => Err(Failure::launch(format!("node {}: {e:#}", p.node_rank))),
        Err(_) => Err(Failure::launch(format!(
            "node {}: node 0 at {target} did not finish the handshake within 10s",
            p.node_rank
        ))),
    }
}

/// What node 0 said, or that it went away.
enum FromHead {
    Said(ToWorker),
    Gone(String),
}

/// Starts this node's workers and relays them until the job is over.
async fn run_node(plan: &LaunchPlan, p: &PerNode, stream: TcpStream, job_id: &str) -> Result<u8> {
    let env = JobEnv {
        master_addr: p.master_addr.clone(),
        master_port: p.master_port,
        job_id: job_id.to_string(),
        token_hex: p.token.to_hex(),
    };
    let (proc_tx, mut procs) = mpsc::unbounded_channel();
    let workers = spawn_local(plan, &env, &proc_tx, Some(p.node_rank))?;
    drop(proc_tx);
    let (mut rd, mut wr) = stream.into_split();
    let (head_tx, mut head) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            match read_frame_async::<_, ToWorker>(&mut rd, MAX_FRAME).await {
                Ok(m) => {
                    if head_tx.send(FromHead::Said(m)).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = head_tx.send(FromHead::Gone(e.to_string()));
                    return;
                }
            }
        }
    });
    let (out_tx, mut outbox) = mpsc::unbounded_channel::<ToServer>();
    tokio::spawn(async move {
        while let Some(m) = outbox.recv().await {
            if write_frame_async(&mut wr, &m).await.is_err() {
                return;
            }
        }
    });
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sighup = signal(SignalKind::hangup())?;
    let mut sigusr1 = signal(SignalKind::user_defined1())?;
    let mut running: Vec<usize> = workers.iter().map(|w| w.rank).collect();
    let kill_all = |running: &[usize]| {
        for w in workers.iter().filter(|w| running.contains(&w.rank)) {
            signal_group(w.pid(), nix::sys::signal::Signal::SIGKILL);
        }
    };
    let far = tokio::time::Instant::now() + Duration::from_secs(365 * 24 * 3600);
    let mut kill_at = far;
    let mut verdict: Option<u8> = None;
    let mut interrupted = false;
    let mut head_gone: Option<String> = None;
    loop {
        if running.is_empty() && (verdict.is_some() || head_gone.is_some()) {
            break;
        }
        let stop = |reason: &str, out_tx: &mpsc::UnboundedSender<ToServer>| {
            shout!("zrun: node {}: {reason}; stopping the job", p.node_rank);
            let _ = out_tx.send(ToServer::NodeStopping {
                reason: reason.to_string(),
                code: exit::INTERRUPTED,
            });
        };
        tokio::select! {
            _ = sigint.recv() => { stop("interrupted (SIGINT)", &out_tx); interrupted = true; kill_at = kill_at.min(tokio::time::Instant::now() + ABORT_GRACE * 2); }
            _ = sigterm.recv() => { stop("terminated (SIGTERM)", &out_tx); interrupted = true; kill_at = kill_at.min(tokio::time::Instant::now() + ABORT_GRACE * 2); }
            _ = sighup.recv() => { stop("hung up (SIGHUP)", &out_tx); interrupted = true; kill_at = kill_at.min(tokio::time::Instant::now() + ABORT_GRACE * 2); }
            // A preemption notice: handed to this node's workers, which
            // agree with every other rank to stop after the same step.
            _ = sigusr1.recv() => {
                say!("zrun: node {}: SIGUSR1: passed to its workers (the job stops after the step in progress)", p.node_rank);
                for w in workers.iter().filter(|w| running.contains(&w.rank)) {
                    signal_group(w.pid(), nix::sys::signal::Signal::SIGUSR1);
                }
            }
            Some(ev) = procs.recv() => match ev {
                ProcEvent::Output { rank, line, stderr } => {
                    if stderr { shout!("[rank {rank}] {line}") } else { say!("[rank {rank}] {line}") }
                    let _ = out_tx.send(ToServer::NodeOutput { rank: rank as u64, line, stderr });
                }
                ProcEvent::Exited { rank, status } => {
                    running.retain(|&r| r != rank);
                    let _ = out_tx.send(ToServer::NodeExited { rank: rank as u64, status: status.into_raw() });
                }
            },
            Some(m) = head.recv(), if head_gone.is_none() => match m {
                FromHead::Said(ToWorker::Abort { reason }) => {
                    shout!("zrun: node {}: node 0 stops the job: {reason}", p.node_rank);
                    kill_at = kill_at.min(tokio::time::Instant::now() + ABORT_GRACE);
                }
                FromHead::Said(ToWorker::Finished { code }) => verdict = Some(code),
                FromHead::Said(_) => {}
                FromHead::Gone(reason) => {
                    if verdict.is_none() {
                        shout!("zrun: node {}: lost node 0 ({reason}); stopping this node's workers", p.node_rank);
                        kill_all(&running);
                    }
                    head_gone = Some(reason);
                }
            },
            _ = tokio::time::sleep_until(kill_at) => {
                kill_all(&running);
                kill_at = far;
            }
            _ = tokio::time::sleep(VERDICT_WAIT), if running.is_empty() => {
                shout!("zrun: node {}: node 0 sent no verdict within {}s of this node's workers ending", p.node_rank, VERDICT_WAIT.as_secs());
                break;
            }
        }
    }
    Ok(match (verdict, interrupted) {
        (Some(code), _) => code,
        (None, true) => exit::INTERRUPTED,
        (None, false) => exit::TRAINING_FAILED,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_difference_names_the_key_and_both_values() {
        let a = serde_json::json!({"train": {"lr": 0.1, "steps": 5}, "name": "x"});
        let b = serde_json::json!({"train": {"lr": 0.2, "steps": 5}, "name": "x"});
        assert_eq!(
            first_difference(&a, &b, "").as_deref(),
            Some("train.lr: 0.1 vs 0.2")
        );
        assert_eq!(first_difference(&a, &a, ""), None);
        let c = serde_json::json!({"train": {"lr": 0.1, "steps": 5}});
        assert_eq!(
            first_difference(&a, &c, "").as_deref(),
            Some("name: \"x\" vs null")
        );
    }
}
