//! The job's event loop: from start to the last process gone.
//!
//! Inputs: control-server events (joins, reports, failures, lost connections),
//! process events (output lines, exits), a one-second tick (heartbeat and
//! rendezvous deadlines) and SIGINT / SIGTERM / SIGHUP (all three tear down alike). The first failure decides the
//! outcome; then every worker is told to abort, given a few seconds, and its
//! process group killed. zrun returns only when every worker it started has been
//! reaped, so nothing is left running whichever way the job ends.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use anyhow::Result;
use nix::sys::signal::Signal;
use tokio::net::TcpListener;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use zproto::{Task, ToServer, ToWorker, Token};

use crate::cli::Launcher;
use crate::exit;
use crate::launch::{spawn_local, spawn_mpirun, spawn_slurm, spawn_ssh, Handle, WorkerProc};
use crate::plan::LaunchPlan;
use crate::rank_log::RankLogs;
use crate::server::{Event, JobInfo, NodeEvent, Server};
use crate::sink::Sink;
use crate::worker::{JobEnv, ProcEvent, SshOptions};
use crate::Failure;

/// Grace period between `Abort` and SIGKILL.
const ABORT_GRACE: Duration = Duration::from_secs(3);
/// A rank whose control connection dropped without an exit is declared dead after this.
const LOST_GRACE: Duration = Duration::from_secs(2);
/// A gap this long between the event loop's 200 ms ticks means zrun was stopped.
const STALL_GAP: Duration = Duration::from_secs(2);
/// Linux's longest interval between zero-window probes (`TCP_RTO_MAX`).
///
/// While zrun is stopped, a worker's reports fill its control socket and the
/// worker's kernel probes the closed window with exponential backoff. When zrun
/// drains the socket, the window update that should wake the sender is not
/// always sent (seen on loopback: a worker's socket in `persist`, backoff 4,
/// 2 MB unsent and zrun's side empty, for the 3.6 s to its next probe). So after
/// a stall of `gap`, zrun pings every rank each tick for a while (the ping's
/// acknowledgement carries the open window), and each rank may stay silent for
/// `heartbeat + min(gap, PROBE_MAX)`, the longest its next probe can take.
const PROBE_MAX: Duration = Duration::from_secs(120);
/// After a rank reports a failure, how long to wait for a crash that caused it:
/// when a worker dies, its peers' collectives fail first, but the dead rank is
/// the one to name.
const CAUSE_GRACE: Duration = Duration::from_millis(1000);

/// How a job ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Every rank finished.
    Success,
    /// `train.early_stopping` ended training after `step` on every rank:
    /// the validation loss had not improved on `best_val_loss` (at
    /// `best_step`) for its patience. A success.
    EarlyStopped {
        /// The last step trained.
        step: u64,
        /// The step of the best validation loss.
        best_step: u64,
        /// The best validation loss.
        best_val_loss: f64,
    },
    /// Asked to stop (SIGUSR1), every rank saved the checkpoint of `step`
    /// and ended early.
    Stopped {
        /// The last step trained.
        step: u64,
    },
    /// Something failed; exit with `code`.
    Failed {
        /// Exit code.
        code: u8,
        /// What happened, naming rank and host.
        message: String,
        /// The rank whose process failed (crashed, was killed, exited early,
        /// fell silent), where one is to blame; not one that only reported
        /// an error caused by another.
        culprit: Option<usize>,
    },
}

#[derive(Debug, Clone)]
struct RankState {
    host: String,
    pid: u32,
    joined: bool,
    done: bool,
    exited: Option<(ExitStatus, Instant)>,
    last_seen: Instant,
    /// When and why its control connection ended.
    lost: Option<(Instant, String)>,
    /// The collective it said it was in at its last heartbeat.
    op: Option<String>,
}

/// Where another node's zrun is (per-node mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeState {
    /// Not joined yet.
    Expected,
    /// Joined and connected.
    Joined,
    /// Its connection ended.
    Gone,
}

/// Starts the job's workers, supervises them to the end, and returns how it ended.
pub fn run_job(
    plan: LaunchPlan,
    task: Task,
    sink: Sink,
    heartbeat: Duration,
    rendezvous: Duration,
) -> Result<(Outcome, Sink)> {
    crate::stop::note_stop_signals();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let per_node = plan.per_node.clone();
        let token = per_node
            .as_ref()
            .map_or_else(Token::generate, |p| p.token.clone());
        let job_id = job_id();
        // Per-node mode: the other nodes know node 0 by a name (a Kubernetes
        // service, a host) that may not be an address of this host to bind.
        let bind = match &per_node {
            Some(p) => format!("0.0.0.0:{}", p.master_port),
            None => format!("{}:{}", plan.master_addr, plan.master_port),
        };
        let listener = TcpListener::bind(&bind).await.map_err(|e| {
            Failure::launch(format!("cannot open the control socket on {bind}: {e}"))
        })?;
        let (ev_tx, ev_rx) = mpsc::unbounded_channel();
        let is_training = matches!(task, Task::Train(_));
        let info = JobInfo {
            token: token.clone(),
            job_id: job_id.clone(),
            world_size: plan.topology.world_size(),
            node_of_rank: plan.topology.node_of_rank(),
            task,
            nodes: per_node
                .as_ref()
                .map_or((0, 0), |p| (p.nnodes, p.workers_per_node)),
        };
        let server = Server::start(listener, info, ev_tx)?;
        // Before any worker starts, so that a failure here leaves none.
        let rank_logs = plan.rank_log.as_deref().map(RankLogs::open).transpose()?;
        let (proc_tx, proc_rx) = mpsc::unbounded_channel();
        let env = JobEnv {
            master_addr: plan.master_addr.clone(),
            master_port: server.addr.port(),
            job_id,
            token_hex: token.to_hex(),
        };
        let procs = if plan.ssh.is_some() {
            spawn_ssh(&plan, &env, &proc_tx).await?
        } else if plan.launcher == Launcher::Slurm {
            spawn_slurm(&plan, &env, &proc_tx)?
        } else if plan.launcher == Launcher::Mpirun {
            spawn_mpirun(&plan, &env, &proc_tx)?
        } else if per_node.is_some() {
            let mut procs = spawn_local(&plan, &env, &proc_tx, Some(0))?;
            procs.extend(
                plan.topology
                    .placements()
                    .into_iter()
                    .filter(|p| p.node_rank > 0)
                    .map(|p| WorkerProc {
                        rank: p.rank,
                        host: plan.topology.nodes[p.node_rank].host.clone(),
                        handle: Handle::Node { node: p.node_rank },
                    }),
            );
            procs
        } else {
            spawn_local(&plan, &env, &proc_tx, None)?
        };
        drop(proc_tx);
        let mut sup = Supervisor::new(
            server,
            &procs,
            sink,
            heartbeat,
            rendezvous,
            plan.ssh.clone(),
        );
        sup.nodes = vec![NodeState::Expected; per_node.as_ref().map_or(0, |p| p.nnodes)];
        sup.can_stop = is_training && plan.spec.checkpoint.dir.is_some();
        sup.rank_logs = rank_logs;
        let outcome = sup.watch(ev_rx, proc_rx).await;
        if per_node.is_some() {
            let code = match &outcome {
                Ok(Outcome::Success | Outcome::EarlyStopped { .. }) => exit::OK,
                Ok(Outcome::Stopped { .. }) => exit::STOPPED,
                Ok(Outcome::Failed { code, .. }) => *code,
                Err(_) => exit::TRAINING_FAILED,
            };
            sup.server.finish_nodes(code, Duration::from_secs(5)).await;
        }
        remove_node_leftovers(&plan, &env.job_id);
        let outcome = outcome?;
        Ok((outcome, sup.sink))
    })
}

/// Removes what this host's workers of job `job_id` could not: shared-memory
/// segments (unlinked by the workers once mapped, left by a failed start) and
/// the swap files of local workers that were killed or crashed (workers are
/// gone now; a rank whose swap is still locked is left alone).
pub fn remove_node_leftovers(plan: &LaunchPlan, job_id: &str) {
    let hpz = plan.spec.zero.hpz_partition_size;
    let hpz_groups = if hpz > 1 {
        plan.topology.world_size() / hpz
    } else {
        0
    };
    let segments = (0..plan.topology.nodes.len())
        .map(|n| zproto::shm_segment_name(job_id, n))
        .chain((0..hpz_groups).map(|k| zproto::hpz_segment_name(job_id, k)));
    for name in segments {
        let _ = std::fs::remove_file(zproto::shm_segment_path(&name));
    }
    if plan.here {
        let z = &plan.spec.zero;
        for t in [&z.offload_optimizer, &z.offload_param] {
            if let (true, Some(path)) = (t.is_nvme(), &t.nvme_path) {
                zswap::remove_job(std::path::Path::new(path), job_id);
            }
        }
    }
}

fn job_id() -> String {
    let mut b = [0u8; 4];
    let _ = getrandom::fill(&mut b);
    format!("zrun-{:08x}", u32::from_be_bytes(b))
}

struct Supervisor {
    server: Server,
    procs: Vec<WorkerProc>,
    ranks: Vec<RankState>,
    sink: Sink,
    heartbeat: Duration,
    rendezvous_deadline: Instant,
    /// A reported failure waiting for [`CAUSE_GRACE`] in case a crash explains it.
    reported: Option<(Instant, String)>,
    /// How to reach remote workers to kill them.
    ssh: Option<SshOptions>,
    /// When the event loop last ticked: a long gap means zrun itself was
    /// stopped (Ctrl-Z, SIGSTOP, a suspended job or machine), and that time must
    /// not count against the workers' heartbeats.
    last_tick: Instant,
    /// Per-node mode: where each node's zrun is (node 0 is this one).
    nodes: Vec<NodeState>,
    /// When zrun last resumed from a stall, and the extra silence allowed
    /// until `heartbeat` past that (see [`PROBE_MAX`]).
    resumed: Option<(Instant, Duration)>,
    /// A training job with a checkpoint directory: SIGUSR1 can stop it with
    /// a checkpoint.
    can_stop: bool,
    /// SIGUSR1 came and the workers were asked to stop.
    stop_asked: bool,
    /// The step the workers stopped after, once one said so.
    stopped_at: Option<u64>,
    /// `train.early_stopping` ended the run (what the ranks said).
    ended_early: Option<Outcome>,
    /// `--enable-each-rank-log`: where workers' lines go instead of the
    /// console.
    rank_logs: Option<RankLogs>,
}

impl Supervisor {
    fn new(
        server: Server,
        procs: &[WorkerProc],
        sink: Sink,
        heartbeat: Duration,
        rendezvous: Duration,
        ssh: Option<SshOptions>,
    ) -> Supervisor {
        let now = Instant::now();
        let ranks = procs
            .iter()
            .map(|p| RankState {
                host: p.host.clone(),
                pid: p.pid(),
                joined: false,
                done: false,
                exited: None,
                last_seen: now,
                lost: None,
                op: None,
            })
            .collect();
        Supervisor {
            server,
            procs: procs.to_vec(),
            ranks,
            sink,
            heartbeat,
            rendezvous_deadline: now + rendezvous,
            last_tick: now,
            resumed: None,
            nodes: Vec::new(),
            reported: None,
            ssh,
            can_stop: false,
            stop_asked: false,
            stopped_at: None,
            ended_early: None,
            rank_logs: None,
        }
    }

    /// Where every rank was when the job failed: the hang diagnosis.
    fn diagnosis(&self) -> String {
        let now = Instant::now();
        let mut out = String::from("zrun: where each rank was when the job failed:");
        for (rank, r) in self.ranks.iter().enumerate() {
            let state = match (&r.exited, &r.op) {
                (Some((s, _)), _) => describe(*s),
                (None, Some(op)) => op.clone(),
                (None, None) if r.done => "finished".into(),
                (None, None) => "computing (not in a collective)".into(),
            };
            out.push_str(&format!(
                "\n  {}: {state}; last heard {:.1}s ago",
                self.who(rank),
                (now - r.last_seen).as_secs_f64()
            ));
        }
        out
    }

    fn who(&self, rank: usize) -> String {
        let r = &self.ranks[rank];
        match &self.rank_logs {
            Some(logs) => format!(
                "rank {rank} (host {}, pid {}; its output in {})",
                r.host,
                r.pid,
                logs.path(rank).display()
            ),
            None => format!("rank {rank} (host {}, pid {})", r.host, r.pid),
        }
    }

    /// A line of a worker's output: to its file, or the console.
    fn worker_line(&mut self, rank: usize, line: &str, stderr: bool) {
        if let Some(logs) = &mut self.rank_logs {
            match logs.write(rank, line) {
                Ok(()) => return,
                // The console, then, from here on.
                Err(e) => {
                    let at = logs.path(rank);
                    self.rank_logs = None;
                    self.sink.println(
                        &format!(
                            "zrun: writing {}: {e}; workers' output on the console from here",
                            at.display()
                        ),
                        true,
                    );
                }
            }
        }
        self.sink.println(&format!("[rank {rank}] {line}"), stderr);
    }

    async fn watch(
        &mut self,
        mut events: mpsc::UnboundedReceiver<Event>,
        mut procs: mpsc::UnboundedReceiver<ProcEvent>,
    ) -> Result<Outcome> {
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        let mut sighup = signal(SignalKind::hangup())?;
        let mut sigusr1 = signal(SignalKind::user_defined1())?;
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        // One that came before these listeners (while the job was being
        // started, or between two jobs of this zrun) stops it too.
        let before = crate::stop::stop_signal().map(|sig| Outcome::Failed {
            code: exit::INTERRUPTED,
            message: format!("{sig} before the job began; all workers stopped"),
            culprit: None,
        });
        let outcome = match before {
            Some(outcome) => outcome,
            None => loop {
                // Biased, ticks last: silence is judged only once every message
                // already received has been processed (after zrun was stopped or
                // starved, a backlog of reports must not read as a silent rank).
                let decided = tokio::select! {
                    biased;
                    _ = sigint.recv() => Some(Outcome::Failed { code: exit::INTERRUPTED, message: "interrupted (SIGINT); all workers stopped".into(), culprit: None }),
                    _ = sigterm.recv() => Some(Outcome::Failed { code: exit::INTERRUPTED, message: "terminated (SIGTERM); all workers stopped".into(), culprit: None }),
                    _ = sighup.recv() => Some(Outcome::Failed { code: exit::INTERRUPTED, message: "hung up (SIGHUP: the terminal closed); all workers stopped".into(), culprit: None }),
                    _ = sigusr1.recv() => { self.ask_to_stop(); None }
                    Some(ev) = events.recv() => self.on_event(ev)?,
                    Some(ev) = procs.recv() => self.on_proc(ev),
                    _ = tick.tick() => self.on_tick(),
                };
                if let Some(o) = decided {
                    break o;
                }
            },
        };
        if let Outcome::Failed { code, message, .. } = &outcome {
            self.server.abort_all(message);
            if *code == exit::TRAINING_FAILED {
                shout!("{}", self.diagnosis());
            }
        }
        self.reap(&mut procs, &mut events).await;
        Ok(outcome)
    }

    fn on_event(&mut self, ev: Event) -> Result<Option<Outcome>> {
        match ev {
            Event::Joined {
                rank,
                hostname,
                pid,
            } => {
                tracing::info!("rank {rank} joined from {hostname} (pid {pid})");
                let r = &mut self.ranks[rank];
                r.joined = true;
                r.pid = pid;
                r.last_seen = Instant::now();
            }
            Event::Node { node, what } => return Ok(self.on_node(node, what)),
            Event::Lost { rank, reason } => {
                self.ranks[rank].lost = Some((Instant::now(), reason));
                if self.ranks[rank].exited.is_some() {
                    return Ok(self.judge_exit(rank));
                }
            }
            Event::Message { rank, msg } => {
                self.ranks[rank].last_seen = Instant::now();
                match *msg {
                    ToServer::Report(report) => self.sink.report(rank, *report)?,
                    ToServer::Profile(p) => self.sink.profile(*p)?,
                    ToServer::KernelRows(rows) => self.sink.kernel_rows(rows),
                    ToServer::BenchRows(rows) => self.sink.bench_rows(rows),
                    ToServer::Failed { message } => {
                        if self.reported.is_none() {
                            self.reported = Some((
                                Instant::now(),
                                format!("{} failed: {message}", self.who(rank)),
                            ));
                        }
                        self.ranks[rank].done = false;
                    }
                    ToServer::Done => self.ranks[rank].done = true,
                    ToServer::Stopped { step } => {
                        self.ranks[rank].done = true;
                        self.stopped_at = Some(step);
                    }
                    ToServer::EarlyStopped {
                        step,
                        best_step,
                        best_val_loss,
                    } => {
                        self.ranks[rank].done = true;
                        self.ended_early = Some(Outcome::EarlyStopped {
                            step,
                            best_step,
                            best_val_loss,
                        });
                    }
                    ToServer::Heartbeat { op } => self.ranks[rank].op = op,
                    other => tracing::warn!("rank {rank} sent an unexpected message: {other:?}"),
                }
            }
        }
        Ok(self.finished())
    }

    /// The ranks another node's zrun started (per-node mode).
    fn ranks_of_node(&self, node: usize) -> Vec<usize> {
        self.procs
            .iter()
            .filter(|p| matches!(p.handle, Handle::Node { node: n } if n == node))
            .map(|p| p.rank)
            .collect()
    }

    /// A relayed worker event, if `rank` is one of `node`'s.
    fn relayed(&self, node: usize, msg: ToServer) -> Option<ProcEvent> {
        let (rank, ev) = match msg {
            ToServer::NodeOutput { rank, line, stderr } => (
                rank as usize,
                ProcEvent::Output {
                    rank: rank as usize,
                    line,
                    stderr,
                },
            ),
            ToServer::NodeExited { rank, status } => (
                rank as usize,
                ProcEvent::Exited {
                    rank: rank as usize,
                    status: ExitStatus::from_raw(status),
                },
            ),
            _ => return None,
        };
        if self.ranks_of_node(node).contains(&rank) {
            Some(ev)
        } else {
            tracing::warn!("node {node} relayed an event of rank {rank}, not one of its own");
            None
        }
    }

    fn on_node(&mut self, node: usize, what: NodeEvent) -> Option<Outcome> {
        let host = |s: &Self| {
            s.ranks_of_node(node)
                .first()
                .map_or_else(String::new, |&r| s.ranks[r].host.clone())
        };
        match what {
            NodeEvent::Joined { hostname, pid } => {
                tracing::info!("node {node} joined from {hostname} (zrun pid {pid})");
                if let Some(n) = self.nodes.get_mut(node) {
                    *n = NodeState::Joined;
                }
                for r in self.ranks_of_node(node) {
                    self.ranks[r].host = hostname.clone();
                }
                None
            }
            NodeEvent::Message(msg) => match *msg {
                ToServer::NodeStopping { reason, code } => Some(Outcome::Failed {
                    code,
                    message: format!(
                        "node {node} (host {}): {reason}; all workers stopped",
                        host(self)
                    ),
                    culprit: None,
                }),
                other => {
                    let ev = self.relayed(node, other)?;
                    self.on_proc(ev)
                }
            },
            NodeEvent::Lost(reason) => {
                if let Some(n) = self.nodes.get_mut(node) {
                    *n = NodeState::Gone;
                }
                Some(Outcome::Failed {
                    code: exit::TRAINING_FAILED,
                    message: format!(
                        "node {node}'s zrun (host {}) lost its connection ({reason})",
                        host(self)
                    ),
                    culprit: self.ranks_of_node(node).first().copied(),
                })
            }
        }
    }

    fn on_proc(&mut self, ev: ProcEvent) -> Option<Outcome> {
        match ev {
            ProcEvent::Output { rank, line, stderr } => {
                self.worker_line(rank, &line, stderr);
                None
            }
            ProcEvent::Exited { rank, status } => {
                self.ranks[rank].exited = Some((status, Instant::now()));
                let r = &self.ranks[rank];
                // Messages the rank sent before exiting (Done, Failed) may still be
                // on their way: its connection's end arrives after them. Judge the
                // exit then (or after LOST_GRACE).
                if r.joined && r.lost.is_none() {
                    return None;
                }
                self.judge_exit(rank)
            }
        }
    }

    /// Decides what a rank's exit means, once its messages are all in.
    fn judge_exit(&self, rank: usize) -> Option<Outcome> {
        let r = &self.ranks[rank];
        let (status, _) = r.exited?;
        {
            if status.success() && r.done {
                return self.finished();
            }
            let how = describe(status);
            if !r.joined {
                return Some(Outcome::Failed {
                    code: exit::LAUNCH_FAILED,
                    message: format!("{} {how} before joining the job", self.who(rank)),
                    culprit: Some(rank),
                });
            }
            match &self.reported {
                // A rank that reported its failure and then exited 1 is not news.
                Some((_, first)) if first.starts_with(&format!("rank {rank} ")) => {
                    Some(Outcome::Failed {
                        code: exit::TRAINING_FAILED,
                        message: first.clone(),
                        culprit: Some(rank),
                    })
                }
                Some((_, first)) => Some(Outcome::Failed {
                    code: exit::TRAINING_FAILED,
                    message: format!("{} {how} before finishing; then {first}", self.who(rank)),
                    culprit: Some(rank),
                }),
                None => Some(Outcome::Failed {
                    code: exit::TRAINING_FAILED,
                    message: format!("{} {how} before finishing", self.who(rank)),
                    culprit: Some(rank),
                }),
            }
        }
    }

    fn on_tick(&mut self) -> Option<Outcome> {
        let now = Instant::now();
        let gap = now - std::mem::replace(&mut self.last_tick, now);
        if gap > STALL_GAP {
            // zrun was not running: every rank gets a fresh heartbeat window
            // and time for its socket to notice that zrun reads again (see
            // PROBE_MAX), and the rendezvous deadline moves by the time lost.
            tracing::warn!(
                "zrun was stopped for {:.1}s; not counting it against the workers",
                gap.as_secs_f64()
            );
            for r in &mut self.ranks {
                r.last_seen = r.last_seen.max(now);
            }
            self.resumed = Some((now, gap.min(PROBE_MAX)));
            self.rendezvous_deadline += gap;
        }
        let mut patience = Duration::ZERO;
        if let Some((at, grace)) = self.resumed {
            if now - at > self.heartbeat + grace {
                self.resumed = None;
            } else {
                patience = grace;
                for rank in 0..self.ranks.len() {
                    self.server.send(rank, ToWorker::Ping);
                }
            }
        }
        if let Some((at, message)) = &self.reported {
            if now - *at > CAUSE_GRACE {
                return Some(Outcome::Failed {
                    code: exit::TRAINING_FAILED,
                    message: message.clone(),
                    culprit: None,
                });
            }
        }
        for (rank, r) in self.ranks.iter().enumerate() {
            if let Some((_, at)) = r.exited {
                if r.lost.is_none() && now - at > LOST_GRACE {
                    if let Some(o) = self.judge_exit(rank) {
                        return Some(o);
                    }
                }
            }
            if let Some((since, reason)) = &r.lost {
                if r.exited.is_none() && !r.done && now - *since > LOST_GRACE {
                    return Some(Outcome::Failed {
                        code: exit::TRAINING_FAILED,
                        message: format!(
                            "{} lost its control connection ({reason})",
                            self.who(rank)
                        ),
                        culprit: Some(rank),
                    });
                }
            }
            if r.joined
                && !r.done
                && r.lost.is_none()
                && now - r.last_seen > self.heartbeat + patience
            {
                return Some(Outcome::Failed {
                    code: exit::TRAINING_FAILED,
                    message: format!(
                        "{} sent nothing for {:.0}s (comm.heartbeat_s = {:.0})",
                        self.who(rank),
                        (now - r.last_seen).as_secs_f64(),
                        self.heartbeat.as_secs_f64()
                    ),
                    culprit: Some(rank),
                });
            }
        }
        if now > self.rendezvous_deadline && self.ranks.iter().any(|r| !r.joined) {
            let missing: Vec<String> = self
                .ranks
                .iter()
                .enumerate()
                .filter(|(_, r)| !r.joined)
                .map(|(i, _)| i.to_string())
                .collect();
            let absent: Vec<String> = (1..self.nodes.len())
                .filter(|&n| self.nodes[n] == NodeState::Expected)
                .map(|n| n.to_string())
                .collect();
            let nodes = if absent.is_empty() {
                String::new()
            } else {
                format!(
                    " (the zrun of node(s) {} never joined: is it running, with the same ZRUN_TOKEN and --master-addr/--master-port?)",
                    absent.join(", ")
                )
            };
            return Some(Outcome::Failed {
                code: exit::LAUNCH_FAILED,
                message: format!(
                    "rendezvous timed out: ranks {} never joined{nodes}",
                    missing.join(", ")
                ),
                culprit: None,
            });
        }
        None
    }

    fn finished(&self) -> Option<Outcome> {
        let all = self
            .ranks
            .iter()
            .all(|r| r.done && r.exited.is_some_and(|(s, _)| s.success()));
        all.then(|| match (self.stopped_at, &self.ended_early) {
            (Some(step), _) => Outcome::Stopped { step },
            (None, Some(early)) => early.clone(),
            (None, None) => Outcome::Success,
        })
    }

    /// SIGUSR1 (a preemption notice: Slurm's `--signal=B:USR1@90`): asks
    /// every worker to end after the step in progress with a checkpoint of
    /// it. The workers agree on the step among themselves (a worker that
    /// got the signal directly asks the same), so that every rank saves
    /// the same one; a job without a checkpoint directory goes on.
    fn ask_to_stop(&mut self) {
        if !self.can_stop {
            self.sink.println(
                "zrun: SIGUSR1 ignored: the job has no checkpoint.dir to save into",
                true,
            );
            return;
        }
        if !self.stop_asked {
            self.stop_asked = true;
            self.sink.println(
                "zrun: SIGUSR1: the workers stop after the step in progress and save a checkpoint of it",
                false,
            );
            for rank in 0..self.ranks.len() {
                self.server.send(rank, ToWorker::Stop);
            }
        }
    }

    /// Waits for every worker to exit; kills the process groups of those that
    /// do not within the grace period.
    /// Other nodes' workers (per-node mode) are stopped by their own zruns,
    /// which relay the exits; a node whose zrun is gone has nothing more to say.
    async fn reap(
        &mut self,
        procs: &mut mpsc::UnboundedReceiver<ProcEvent>,
        events: &mut mpsc::UnboundedReceiver<Event>,
    ) {
        let mut deadline = tokio::time::Instant::now() + ABORT_GRACE;
        let mut killed = false;
        let mut local_done = false;
        for node in 1..self.nodes.len() {
            if self.nodes[node] != NodeState::Joined {
                self.node_gone(node);
            }
        }
        while self.ranks.iter().any(|r| r.exited.is_none()) {
            let ev = tokio::select! {
                ev = procs.recv(), if !local_done => {
                    local_done = ev.is_none();
                    ev
                }
                Some(ev) = events.recv() => match ev {
                    Event::Node { node, what: NodeEvent::Message(msg) } => self.relayed(node, *msg),
                    Event::Node { node, what: NodeEvent::Lost(_) } => {
                        self.node_gone(node);
                        None
                    }
                    _ => None,
                },
                _ = tokio::time::sleep_until(deadline) => {
                    if killed {
                        tracing::error!("some workers did not exit after SIGKILL");
                        break;
                    }
                    for p in &self.procs {
                        if self.ranks[p.rank].exited.is_none() {
                            p.kill(self.ssh.as_ref()).await;
                        }
                    }
                    killed = true;
                    deadline = tokio::time::Instant::now() + Duration::from_secs(5);
                    None
                }
            };
            match ev {
                Some(ProcEvent::Exited { rank, status }) => {
                    self.ranks[rank].exited = Some((status, Instant::now()))
                }
                Some(ProcEvent::Output { rank, line, stderr }) => {
                    self.worker_line(rank, &line, stderr)
                }
                None if local_done && self.nodes.is_empty() => break,
                None => {}
            }
        }
    }

    /// A node whose zrun is gone (or never came) will relay no more exits.
    fn node_gone(&mut self, node: usize) {
        for r in self.ranks_of_node(node) {
            let r = &mut self.ranks[r];
            r.exited = r.exited.or(Some((
                ExitStatus::from_raw(Signal::SIGKILL as i32),
                Instant::now(),
            )));
        }
    }
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => {
            let name = Signal::try_from(s)
                .map(|s| s.as_str().to_string())
                .unwrap_or_else(|_| s.to_string());
            format!("was killed by signal {name}")
        }
        _ => "ended".into(),
    }
}
