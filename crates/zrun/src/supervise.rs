//! The job's event loop: from start to the last process gone.
//!
//! Inputs: control-server events (joins, reports, failures, lost connections),
//! process events (output lines, exits), a one-second tick (heartbeat and
//! rendezvous deadlines) and SIGINT / SIGTERM. The first failure decides the
//! outcome; then every worker is told to abort, given a few seconds, and its
//! process group killed. zrun returns only when every worker it started has been
//! reaped, so nothing is left running whichever way the job ends.

use std::io::IsTerminal;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitCode, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::Result;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use nix::sys::signal::Signal;
use tokio::net::TcpListener;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use zconfig::load_job;
use zproto::{BenchRow, Task, ToServer, Token, TrainTask};

use crate::cli::TrainArgs;
use crate::exit;
use crate::launch::{spawn_local, spawn_slurm, spawn_ssh, JobEnv, ProcEvent, WorkerProc};
use crate::metrics::{Aggregator, DoneLine, MetricsWriter};
use crate::plan::{plan_launch, topology, LaunchPlan};
use crate::server::{Event, JobInfo, Server};
use crate::Failure;

/// Grace period between `Abort` and SIGKILL.
const ABORT_GRACE: Duration = Duration::from_secs(3);
/// A rank whose control connection dropped without an exit is declared dead after this.
const LOST_GRACE: Duration = Duration::from_secs(2);
/// After a rank reports a failure, how long to wait for a crash that caused it:
/// when a worker dies, its peers' collectives fail first, but the dead rank is
/// the one to name.
const CAUSE_GRACE: Duration = Duration::from_millis(1000);

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank finished.
    Success,
    /// Something failed; exit with `code`.
    Failed {
        /// Exit code.
        code: u8,
        /// What happened, naming rank and host.
        message: String,
    },
}

/// `zrun train`.
pub fn train(args: TrainArgs) -> Result<ExitCode> {
    let job = load_job(&args.job, &args.set)?;
    let topo = topology(&args.launch)?;
    job.validate(topo.world_size())?;
    let plan = plan_launch(&args.launch, job.spec.clone(), topo)?;
    warn_if_too_big(&plan);
    check_init_from(&plan.spec)?;
    let resume = resolve_resume(args.resume.as_deref(), &plan.spec)?;
    let run_dir = PathBuf::from(&plan.spec.run_dir);
    let metrics_path = args
        .metrics
        .clone()
        .unwrap_or_else(|| run_dir.join("metrics.jsonl"));
    let writer = MetricsWriter::create(&metrics_path)
        .map_err(|e| Failure::bad_input(format!("--metrics {}: {e}", metrics_path.display())))?;
    let steps = plan.spec.train.steps;
    let progress = Progress::new(steps, args.no_progress || !std::io::stdout().is_terminal());
    progress.println(&format!(
        "zrun: job {}: {} workers on {} node(s), ZeRO stage {}, {} steps; metrics {}",
        plan.spec.name,
        plan.topology.world_size(),
        plan.topology.nodes.len(),
        plan.spec.zero.stage,
        steps,
        metrics_path.display()
    ));
    if let Some(r) = &resume {
        progress.println(&format!("zrun: resuming from {r}"));
    }
    let world = plan.topology.world_size();
    let sink = Sink::Train {
        agg: Aggregator::new(world),
        writer,
        progress,
        last_loss: f64::NAN,
        steps,
    };
    let task = Task::Train(Box::new(TrainTask {
        spec: plan.spec.clone(),
        resume,
    }));
    let heartbeat = Duration::from_secs_f64(plan.spec.comm.heartbeat_s);
    let rendezvous = Duration::from_secs_f64(plan.spec.comm.timeout_s);
    let started = Instant::now();
    let (outcome, sink) = run_job(plan, task, sink, heartbeat, rendezvous)?;
    let Sink::Train {
        mut writer,
        progress,
        last_loss,
        steps,
        ..
    } = sink
    else {
        unreachable!("train uses the train sink")
    };
    progress.finish();
    match outcome {
        Outcome::Success => {
            let wall_s = started.elapsed().as_secs_f64();
            writer.write(&DoneLine {
                event: "done",
                steps,
                final_loss: last_loss,
                wall_s,
            })?;
            println!("zrun: done: {steps} steps, final loss {last_loss:.4}, {wall_s:.1}s");
            Ok(ExitCode::SUCCESS)
        }
        Outcome::Failed { code, message } => {
            eprintln!("zrun: {message}");
            Ok(ExitCode::from(code))
        }
    }
}

/// `--resume DIR|auto` → a verified checkpoint of this model (bad ones: exit 2).
/// `auto` with no checkpoint yet starts from scratch.
fn resolve_resume(arg: Option<&str>, spec: &zconfig::JobSpec) -> Result<Option<String>> {
    let Some(arg) = arg else { return Ok(None) };
    let dir = if arg == "auto" {
        let Some(root) = &spec.checkpoint.dir else {
            return Err(Failure::bad_input(
                "--resume auto: the job has no checkpoint.dir to look in",
            ));
        };
        match zckpt::list(std::path::Path::new(root)).pop() {
            Some(d) => d,
            None => {
                println!("zrun: --resume auto: no checkpoint in {root} yet; starting from scratch");
                return Ok(None);
            }
        }
    } else {
        zckpt::resolve(std::path::Path::new(arg))
            .map_err(|e| Failure::bad_input(format!("--resume: {e}")))?
    };
    let ckpt =
        zckpt::Checkpoint::open(&dir).map_err(|e| Failure::bad_input(format!("--resume: {e}")))?;
    ckpt.check_model(&spec.model)
        .map_err(|e| Failure::bad_input(format!("--resume: {e}")))?;
    Ok(Some(dir.display().to_string()))
}

/// `model.init_from` must be a safetensors file with the model's parameter count.
fn check_init_from(spec: &zconfig::JobSpec) -> Result<()> {
    let Some(f) = &spec.model.init_from else {
        return Ok(());
    };
    let w = zckpt::read_weights(std::path::Path::new(f))
        .map_err(|e| Failure::bad_input(format!("model.init_from: {e}")))?;
    let have: usize = w.values().map(|(_, v)| v.len()).sum();
    let want = zconfig::estimate::gpt_params(&spec.model) as usize;
    if have != want {
        return Err(Failure::bad_input(format!(
            "model.init_from: {f} holds {have} parameters, the model has {want}"
        )));
    }
    Ok(())
}

/// Warns when the estimate of a worker's memory exceeds its share of this host's.
fn warn_if_too_big(plan: &LaunchPlan) {
    let need = crate::estimate::per_worker_bytes(&plan.spec, &plan.topology);
    let local = plan
        .topology
        .nodes
        .iter()
        .map(|n| n.slots.len())
        .max()
        .unwrap_or(1);
    if let Some(avail) = crate::estimate::mem_available() {
        let share = avail / local as f64;
        if need > share {
            eprintln!(
                "zrun: warning: a worker is estimated to need {:.2} GiB (ZeRO stage {} model states + activations), more than its {:.2} GiB share of this host's available memory ({local} workers); see `zrun estimate`",
                need / f64::from(1 << 30),
                plan.spec.zero.stage,
                share / f64::from(1 << 30)
            );
        }
    }
}

/// Where reports go.
pub enum Sink {
    /// Training: metrics and progress.
    Train {
        /// Per-step aggregation.
        agg: Aggregator,
        /// metrics.jsonl.
        writer: MetricsWriter,
        /// Progress display.
        progress: Progress,
        /// Loss of the newest complete step.
        last_loss: f64,
        /// Steps expected.
        steps: u64,
    },
    /// `bench comm`: rows from rank 0.
    Bench {
        /// Collected rows.
        rows: Vec<BenchRow>,
    },
    /// `bench kernels`: rows from the one worker.
    Kernels {
        /// Collected rows.
        rows: Vec<zproto::KernelRow>,
    },
}

impl Sink {
    fn println(&self, line: &str, stderr: bool) {
        match self {
            Sink::Train { progress, .. } => progress.println(line),
            Sink::Bench { .. } | Sink::Kernels { .. } if stderr => eprintln!("{line}"),
            Sink::Bench { .. } | Sink::Kernels { .. } => println!("{line}"),
        }
    }
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

/// Starts the job's workers, supervises them to the end, and returns how it ended.
pub fn run_job(
    plan: LaunchPlan,
    task: Task,
    sink: Sink,
    heartbeat: Duration,
    rendezvous: Duration,
) -> Result<(Outcome, Sink)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let token = Token::generate();
        let job_id = job_id();
        let bind = format!("{}:{}", plan.master_addr, plan.master_port);
        let listener = TcpListener::bind(&bind).await.map_err(|e| {
            Failure::launch(format!("cannot open the control socket on {bind}: {e}"))
        })?;
        let (ev_tx, ev_rx) = mpsc::unbounded_channel();
        let info = JobInfo {
            token: token.clone(),
            job_id: job_id.clone(),
            world_size: plan.topology.world_size(),
            node_of_rank: plan.topology.node_of_rank(),
            task,
        };
        let server = Server::start(listener, info, ev_tx)?;
        let (proc_tx, proc_rx) = mpsc::unbounded_channel();
        let env = JobEnv {
            master_addr: plan.master_addr.clone(),
            master_port: server.addr.port(),
            job_id,
            token_hex: token.to_hex(),
        };
        let procs = if plan.ssh.is_some() {
            spawn_ssh(&plan, &env, &proc_tx).await?
        } else if plan.slurm {
            spawn_slurm(&plan, &env, &proc_tx)?
        } else {
            spawn_local(&plan, &env, &proc_tx)?
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
        let outcome = sup.watch(ev_rx, proc_rx).await;
        // Shared-memory segments are unlinked by the workers once mapped; remove
        // any a failed start left behind on this host.
        for n in 0..plan.topology.nodes.len() {
            let _ = std::fs::remove_file(zproto::shm_segment_path(&zproto::shm_segment_name(
                &env.job_id,
                n,
            )));
        }
        let outcome = outcome?;
        Ok((outcome, sup.sink))
    })
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
    ssh: Option<crate::ssh::SshOptions>,
}

impl Supervisor {
    fn new(
        server: Server,
        procs: &[WorkerProc],
        sink: Sink,
        heartbeat: Duration,
        rendezvous: Duration,
        ssh: Option<crate::ssh::SshOptions>,
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
            reported: None,
            ssh,
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
        format!("rank {rank} (host {}, pid {})", r.host, r.pid)
    }

    async fn watch(
        &mut self,
        mut events: mpsc::UnboundedReceiver<Event>,
        mut procs: mpsc::UnboundedReceiver<ProcEvent>,
    ) -> Result<Outcome> {
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let outcome = loop {
            let decided = tokio::select! {
                Some(ev) = events.recv() => self.on_event(ev)?,
                Some(ev) = procs.recv() => self.on_proc(ev),
                _ = sigint.recv() => Some(Outcome::Failed { code: exit::INTERRUPTED, message: "interrupted (SIGINT); all workers stopped".into() }),
                _ = sigterm.recv() => Some(Outcome::Failed { code: exit::INTERRUPTED, message: "terminated (SIGTERM); all workers stopped".into() }),
                _ = tick.tick() => self.on_tick(),
            };
            if let Some(o) = decided {
                break o;
            }
        };
        if let Outcome::Failed { code, message } = &outcome {
            self.server.abort_all(message);
            if *code == exit::TRAINING_FAILED {
                eprintln!("{}", self.diagnosis());
            }
        }
        self.reap(&mut procs).await;
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
            Event::Lost { rank, reason } => {
                self.ranks[rank].lost = Some((Instant::now(), reason));
                if self.ranks[rank].exited.is_some() {
                    return Ok(self.judge_exit(rank));
                }
            }
            Event::Message { rank, msg } => {
                self.ranks[rank].last_seen = Instant::now();
                match msg {
                    ToServer::Report(report) => {
                        if let Sink::Train {
                            agg,
                            writer,
                            progress,
                            last_loss,
                            ..
                        } = &mut self.sink
                        {
                            if let Some(line) = agg.add(rank, report) {
                                writer.write(&line)?;
                                *last_loss = line.loss;
                                progress.step(&line);
                            }
                        }
                    }
                    ToServer::KernelRows(rows) => {
                        if let Sink::Kernels { rows: all } = &mut self.sink {
                            all.extend(rows);
                        }
                    }
                    ToServer::BenchRows(rows) => {
                        if let Sink::Bench { rows: all } = &mut self.sink {
                            all.extend(rows);
                        }
                    }
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
                    ToServer::Heartbeat { op } => self.ranks[rank].op = op,
                    other => tracing::warn!("rank {rank} sent an unexpected message: {other:?}"),
                }
            }
        }
        Ok(self.finished())
    }

    fn on_proc(&mut self, ev: ProcEvent) -> Option<Outcome> {
        match ev {
            ProcEvent::Output { rank, line, stderr } => {
                self.sink.println(&format!("[rank {rank}] {line}"), stderr);
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
                });
            }
            match &self.reported {
                // A rank that reported its failure and then exited 1 is not news.
                Some((_, first)) if first.starts_with(&format!("rank {rank} ")) => {
                    Some(Outcome::Failed {
                        code: exit::TRAINING_FAILED,
                        message: first.clone(),
                    })
                }
                Some((_, first)) => Some(Outcome::Failed {
                    code: exit::TRAINING_FAILED,
                    message: format!("{} {how} before finishing; then {first}", self.who(rank)),
                }),
                None => Some(Outcome::Failed {
                    code: exit::TRAINING_FAILED,
                    message: format!("{} {how} before finishing", self.who(rank)),
                }),
            }
        }
    }

    fn on_tick(&mut self) -> Option<Outcome> {
        let now = Instant::now();
        if let Some((at, message)) = &self.reported {
            if now - *at > CAUSE_GRACE {
                return Some(Outcome::Failed {
                    code: exit::TRAINING_FAILED,
                    message: message.clone(),
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
                    });
                }
            }
            if r.joined && !r.done && r.lost.is_none() && now - r.last_seen > self.heartbeat {
                return Some(Outcome::Failed {
                    code: exit::TRAINING_FAILED,
                    message: format!(
                        "{} sent nothing for {:.0}s (comm.heartbeat_s = {:.0})",
                        self.who(rank),
                        (now - r.last_seen).as_secs_f64(),
                        self.heartbeat.as_secs_f64()
                    ),
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
            return Some(Outcome::Failed {
                code: exit::LAUNCH_FAILED,
                message: format!(
                    "rendezvous timed out: ranks {} never joined",
                    missing.join(", ")
                ),
            });
        }
        None
    }

    fn finished(&self) -> Option<Outcome> {
        let all = self
            .ranks
            .iter()
            .all(|r| r.done && r.exited.is_some_and(|(s, _)| s.success()));
        all.then_some(Outcome::Success)
    }

    /// Waits for every worker to exit; kills the process groups of those that
    /// do not within the grace period.
    async fn reap(&mut self, procs: &mut mpsc::UnboundedReceiver<ProcEvent>) {
        let mut deadline = tokio::time::Instant::now() + ABORT_GRACE;
        let mut killed = false;
        while self.ranks.iter().any(|r| r.exited.is_none()) {
            tokio::select! {
                ev = procs.recv() => match ev {
                    Some(ProcEvent::Exited { rank, status }) => self.ranks[rank].exited = Some((status, Instant::now())),
                    Some(ProcEvent::Output { rank, line, stderr }) => self.sink.println(&format!("[rank {rank}] {line}"), stderr),
                    None => break,
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
                }
            }
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

/// The progress display: a bar on a terminal, plain lines otherwise.
pub struct Progress {
    bar: Option<ProgressBar>,
    every: u64,
    steps: u64,
}

impl Progress {
    /// For a run of `steps`; `plain` forces log lines.
    pub fn new(steps: u64, plain: bool) -> Progress {
        let bar = (!plain).then(|| {
            let b = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stdout());
            b.set_style(
                ProgressStyle::with_template(
                    "{spinner} step {pos}/{len} [{bar:30}] {msg} ETA {eta}",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            );
            b
        });
        Progress {
            bar,
            every: (steps / 20).max(1),
            steps,
        }
    }

    /// Prints a line without disturbing the bar.
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(b) => b.println(line),
            None => println!("{line}"),
        }
    }

    fn step(&self, line: &crate::metrics::StepLine) {
        let msg = format!(
            "loss {:.4} · {:.0} tok/s · {:.1} ms/step",
            line.loss, line.tokens_per_s, line.step_ms
        );
        match &self.bar {
            Some(b) => {
                b.set_position(line.step);
                b.set_message(msg);
            }
            None if line.step == 1
                || line.step.is_multiple_of(self.every)
                || line.step == self.steps =>
            {
                let norm = match line.grad_norm {
                    Some(n) => format!("grad norm {n:.3}"),
                    None => "gradients overflowed, step skipped".into(),
                };
                println!(
                    "step {}/{} {msg} · lr {:.2e} · {norm}",
                    line.step, self.steps, line.lr
                );
            }
            None => {}
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
