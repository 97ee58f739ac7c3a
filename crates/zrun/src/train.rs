//! `zrun train`: the job, its checks before launch (resume point, initial
//! weights, the memory estimate), the metrics file, and the final `done` line.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Result;
use zconfig::{load_job_with, Topology};
use zproto::{MemBytes, Task, TrainTask};

use crate::cli::TrainArgs;
use crate::comms::CommsLog;
use crate::exit;
use crate::metrics::{Aggregator, DoneLine};
use crate::plan::{plan_launch, plan_per_node, topology, LaunchPlan};
use crate::progress::Progress;
use crate::rundir::{self, CheckpointDirLock, MetricsWriter, ResumeLine, RunLock, Start};
use crate::sink::Sink;
use crate::supervise::{run_job, Outcome};
use crate::Failure;

/// `zrun train`.
pub fn train(args: TrainArgs) -> Result<ExitCode> {
    let mut job = load_job_with(&args.job, &args.set, args.deepspeed.as_deref())?;
    crate::plan::warn_deepspeed(&job);
    let per_node = crate::pernode::resolve(&args.launch, &args.per_node)?;
    let epoch;
    let plan = match per_node {
        Some(p) => {
            if args.max_restarts > 0 {
                return Err(Failure::bad_input(
                    "--max-restarts: in per-node mode the cluster restarts the nodes (Kubernetes restartPolicy, JobSet failurePolicy); run with `--resume auto` to continue from the newest checkpoint",
                ));
            }
            epoch = crate::plan::validate(&mut job, &crate::pernode::topology(&p))?;
            let plan = plan_per_node(
                &args.launch,
                args.per_node.node_addr.as_deref(),
                job.spec.clone(),
                p,
            )?;
            if plan.per_node.as_ref().is_some_and(|p| p.node_rank > 0) {
                // Metrics, checkpoint locks, resume and the outcome are node
                // 0's: this node starts and relays its workers.
                check_memory(&plan)?;
                crate::swap_check::check_offload(&plan)?;
                return crate::pernode::join(plan);
            }
            plan
        }
        None => {
            let launch = crate::plan::with_gpu_defaults(&args.launch, &job.spec);
            let topo = topology(&launch)?;
            epoch = crate::plan::validate(&mut job, &topo)?;
            plan_launch(&launch, job.spec.clone(), topo)?
        }
    };
    check_memory(&plan)?;
    crate::swap_check::check_offload(&plan)?;
    let m = &plan.spec.model;
    if let Some((config, _)) = job.model_from() {
        say!(
            "zrun: the model as {} describes it: {}, {} layers of width {}, {} heads, a vocabulary of {}, sequences of {} (`zrun check` lists each key taken)",
            config.display(),
            format!("{:?}", m.kind).to_lowercase(),
            m.n_layers,
            m.d_model,
            m.n_heads,
            m.vocab_size,
            m.seq_len
        );
    }
    if let Some(t) = zconfig::tiles::describe_tiling(m) {
        say!("zrun: {t}");
    }
    check_init_from(&plan.spec)?;
    let resume = resolve_resume(args.resume.as_deref(), &plan.spec)?;
    let mut plan = plan;
    if let Some(sequences) = epoch {
        if let Some((dir, step)) = &resume {
            resume_epochs(&mut job, &mut plan, sequences, dir, *step)?;
        }
        let world = plan.topology.world_size();
        say!(
            "zrun: {}",
            crate::plan::describe_epochs(&plan.spec, sequences, world)
        );
    }
    crate::monitor::check(&plan.spec, resume.is_some())?;
    if args.max_restarts > 0 && plan.spec.checkpoint.dir.is_none() {
        return Err(Failure::bad_input(
            "--max-restarts: a restart resumes from a checkpoint; the job has no checkpoint.dir",
        ));
    }
    let mut steps = plan.spec.train.steps;
    if let Some((dir, step)) = &resume {
        if *step > steps {
            say!("zrun: {dir} is at step {step}, past train.steps = {steps}: nothing to do (raise train.steps to train on)");
            return Ok(ExitCode::SUCCESS);
        }
    }
    let run_dir = PathBuf::from(&plan.spec.run_dir);
    let metrics_path = args
        .metrics
        .clone()
        .unwrap_or_else(|| run_dir.join("metrics.jsonl"));
    rundir::check_metrics_path(&metrics_path)?;
    // Held until zrun returns: no second job writes these files meanwhile.
    let _metrics_lock = RunLock::take(&rundir::metrics_lock(&metrics_path), "metrics")?;
    let _checkpoint_lock = match &plan.spec.checkpoint.dir {
        Some(d) => {
            let lock = CheckpointDirLock::take(Path::new(d))?;
            // With the lock held no live job writes here: a save without a
            // manifest is a dead run's, never resumable; free its space.
            for p in zckpt::remove_unfinished(Path::new(d))
                .map_err(|e| Failure::bad_input(format!("checkpoint.dir: {e}")))?
            {
                say!(
                    "zrun: removed {}, an unfinished save of an earlier run",
                    p.display()
                );
            }
            // A fresh run would save over an earlier run's checkpoints of
            // the same steps: refused, before anything is written.
            if resume.is_none() {
                if let Some(newest) = zckpt::list(Path::new(d)).pop() {
                    return Err(Failure::bad_input(format!(
                        "checkpoint.dir: {d} holds an earlier run's checkpoints (newest {}); \
                         `--resume auto` continues from it, or give the job another checkpoint.dir",
                        newest.display()
                    )));
                }
            }
            Some(lock)
        }
        None => None,
    };
    let start = match &resume {
        Some((dir, step)) => Start::Resume(ResumeLine {
            event: "resume",
            from: dir.clone(),
            step: *step,
            world_size: plan.topology.world_size(),
        }),
        None => Start::Fresh {
            overwrite: args.overwrite,
        },
    };
    let writer = MetricsWriter::new(&metrics_path, start);
    let progress = Progress::new(
        steps,
        args.no_progress || !std::io::stdout().is_terminal(),
        plan.spec.train.log_every,
    );
    progress.println(&format!(
        "zrun: job {}: {} workers on {} node(s), ZeRO stage {}, {} steps; metrics {}",
        plan.spec.name,
        plan.topology.world_size(),
        plan.topology.nodes.len(),
        plan.spec.zero.stage,
        steps,
        metrics_path.display()
    ));
    if let Some(frozen) = zconfig::freeze::summary(&plan.spec.model, &plan.spec.train.freeze) {
        progress.println(&format!("zrun: {frozen}"));
    }
    let mut monitors = crate::monitor::open(&plan.spec, |s| progress.println(s))?;
    for m in &mut monitors {
        if let Some((_, step)) = &resume {
            m.restart_at(step + 1);
        }
    }
    if let Some((r, _)) = &resume {
        progress.println(&format!("zrun: resuming from {r}"));
    }
    let mut world = plan.topology.world_size();
    let heartbeat = Duration::from_secs_f64(plan.spec.comm.heartbeat_s);
    let rendezvous = Duration::from_secs_f64(plan.spec.comm.timeout_s);
    let started = Instant::now();
    let (mut writer, mut progress) = (writer, progress);
    let (mut resume, mut restarts_left, mut peak) =
        (resume, args.max_restarts, MemBytes::default());
    let mut comms = plan
        .spec
        .comms_logger
        .as_ref()
        .map(|c| CommsLog::new(crate::comms::path(c, &run_dir)));
    loop {
        let sink = Sink::Train {
            agg: Aggregator::new(world),
            writer,
            monitors,
            progress,
            last_loss: f64::NAN,
            peak: MemBytes::default(),
            steps,
            profile: plan.spec.flops_profiler.clone().map(|f| {
                let at = crate::profile::path(&f, &run_dir);
                (f, at)
            }),
            comms,
        };
        let task = Task::Train(Box::new(TrainTask {
            spec: plan.spec.clone(),
            resume: resume.as_ref().map(|(dir, _)| dir.clone()),
        }));
        let (outcome, sink) = run_job(plan.clone(), task, sink, heartbeat, rendezvous)?;
        let Sink::Train {
            writer: w,
            monitors: m,
            progress: p,
            last_loss,
            peak: run_peak,
            comms: c,
            ..
        } = sink
        else {
            unreachable!("train uses the train sink")
        };
        (writer, progress, monitors, comms) = (w, p, m, c);
        // Rewritten after each attempt, so that a failed run's collectives
        // are there too.
        if let Some(log) = comms.as_mut() {
            match log.write() {
                Ok(()) => progress.println(&format!(
                    "zrun: the comms log is in {}",
                    log.path().display()
                )),
                Err(e) => progress.println(&format!("zrun: the comms log was not written: {e:#}")),
            }
        }
        peak = peak.max(run_peak);
        match outcome {
            Outcome::Success | Outcome::EarlyStopped { .. } => {
                progress.finish();
                if let Outcome::EarlyStopped {
                    step,
                    best_step,
                    best_val_loss,
                } = outcome
                {
                    let checkpoint = checkpoint_of(&plan.spec, step);
                    writer.write(&EarlyStopLine {
                        event: "early_stop",
                        step,
                        best_step,
                        best_val_loss,
                        checkpoint: checkpoint.clone(),
                    })?;
                    let patience = plan
                        .spec
                        .train
                        .early_stopping
                        .as_ref()
                        .map_or(0, |e| e.patience);
                    say!(
                        "zrun: stopped early after step {step} of {steps}: the validation loss has not improved on {best_val_loss:.4} (step {best_step}) for {patience} validations{}",
                        checkpoint.map(|d| format!("; its checkpoint: {d}")).unwrap_or_default()
                    );
                }
                // The steps the run reached (all, but where it ended early).
                let steps = match outcome {
                    Outcome::EarlyStopped { step, .. } => step,
                    _ => steps,
                };
                let wall_s = started.elapsed().as_secs_f64();
                writer.write(&DoneLine {
                    event: "done",
                    steps,
                    final_loss: last_loss,
                    wall_s,
                    peak_rss_bytes: peak.peak_rss,
                    nvme_bytes: peak.nvme,
                })?;
                // No step line: resumed at the last step (to save it again
                // at another world size or stage), or restarted there.
                let loss = if last_loss.is_nan() {
                    "no step left to run".to_string()
                } else {
                    format!("final loss {last_loss:.4}")
                };
                say!(
                    "zrun: done: {steps} steps, {loss}, {wall_s:.1}s, peak RSS {} MiB per worker{}",
                    peak.peak_rss >> 20,
                    peak.nvme
                        .map(|b| format!(", {} MiB of swap files per worker", b >> 20))
                        .unwrap_or_default()
                );
                let root = plan.spec.checkpoint.dir.as_deref().map(Path::new);
                if let Some((dir, loss)) = root
                    .filter(|_| plan.spec.checkpoint.keep_best)
                    .and_then(zckpt::best)
                {
                    say!(
                        "zrun: the best checkpoint by validation loss: {} (val_loss {loss:.4})",
                        dir.display()
                    );
                }
                return Ok(ExitCode::SUCCESS);
            }
            Outcome::Stopped { step } => {
                progress.finish();
                let checkpoint = checkpoint_of(&plan.spec, step);
                writer.write(&StoppedLine {
                    event: "stopped",
                    step,
                    checkpoint: checkpoint.clone(),
                })?;
                match checkpoint {
                    Some(dir) => say!(
                        "zrun: stopped on SIGUSR1 after step {step} of {steps}; saved {dir}; run again with --resume auto to go on"
                    ),
                    None => shout!(
                        "zrun: stopped on SIGUSR1 after step {step} of {steps}, but its checkpoint is not complete"
                    ),
                }
                return Ok(ExitCode::from(exit::STOPPED));
            }
            Outcome::Failed {
                code,
                message,
                culprit,
            } => {
                let from = match (code, restarts_left) {
                    (1, 1..) => {
                        let (from, passed_over) = newest_intact(&plan.spec);
                        for why in passed_over {
                            shout!("zrun: not restarting from a damaged checkpoint: {why}");
                        }
                        from
                    }
                    _ => None,
                };
                let Some((dir, step)) = from else {
                    progress.finish();
                    shout!("zrun: {message}");
                    if code == 1 && args.max_restarts > 0 && restarts_left > 0 {
                        shout!("zrun: no complete checkpoint to restart from");
                    }
                    return Ok(ExitCode::from(code));
                };
                // Told to stop while this attempt failed or its checkpoint
                // was being found: no restart.
                if let Some(sig) = crate::stop::stop_signal() {
                    progress.finish();
                    shout!("zrun: {message}");
                    shout!("zrun: {sig} before the restart from {dir}: not restarting");
                    return Ok(ExitCode::from(exit::INTERRUPTED));
                }
                restarts_left -= 1;
                if args.restart_exclude_failed {
                    if let Some(rest) = culprit.and_then(|r| without_node_of(&plan.topology, r)) {
                        let epoch = crate::plan::validate(&mut job, &rest)?;
                        plan = plan_launch(&args.launch, job.spec.clone(), rest)?;
                        world = plan.topology.world_size();
                        if let Some(sequences) = epoch {
                            resume_epochs(&mut job, &mut plan, sequences, &dir, step)?;
                            steps = plan.spec.train.steps;
                            progress.set_steps(steps);
                        }
                    }
                }
                // The dead run's unfinished save (if any) can never be resumed
                // from; with the lock held and its workers gone, free it.
                if let Some(root) = &plan.spec.checkpoint.dir {
                    let _ = zckpt::remove_unfinished(Path::new(root));
                }
                progress.println(&format!(
                    "zrun: {message}\nzrun: restarting from {dir} (step {step}) on {world} worker(s), {} node(s); {restarts_left} restart(s) left",
                    plan.topology.nodes.len()
                ));
                writer.write(&RestartLine {
                    event: "restart",
                    reason: message,
                    from: dir.clone(),
                    step,
                    world_size: world,
                    restarts_left,
                })?;
                for m in &mut monitors {
                    m.restart_at(step + 1);
                }
                resume = Some((dir, step));
            }
        }
    }
}

/// The metrics line of a restart: why, from which checkpoint, on how many
/// workers; the step lines after it start again after the checkpoint's step.
#[derive(serde::Serialize)]
struct RestartLine {
    event: &'static str,
    reason: String,
    from: String,
    step: u64,
    world_size: usize,
    restarts_left: u32,
}

/// The metrics line of a run that `train.early_stopping` ended: after which
/// step, the best validation loss and its step, and the checkpoint of the
/// last step.
#[derive(serde::Serialize)]
struct EarlyStopLine {
    event: &'static str,
    step: u64,
    best_step: u64,
    best_val_loss: f64,
    checkpoint: Option<String>,
}

/// The metrics line of a run stopped on SIGUSR1: after which step, and the
/// checkpoint of it that `--resume auto` will take.
#[derive(serde::Serialize)]
struct StoppedLine {
    event: &'static str,
    step: u64,
    checkpoint: Option<String>,
}

/// `topo` without the node of `rank`, if any node remains.
fn without_node_of(topo: &Topology, rank: usize) -> Option<Topology> {
    let node = topo.placements().get(rank)?.node_rank;
    let mut rest = topo.clone();
    rest.nodes.remove(node);
    (!rest.nodes.is_empty()).then_some(rest)
}

/// The newest of the job's checkpoints that opens and holds this model,
/// and why each newer one did not ([`crate::newest_that_opens`]): a restart
/// goes back past a damaged save rather than give up the run's progress,
/// and `--resume auto` names it.
fn newest_intact(spec: &zconfig::JobSpec) -> (Option<(String, u64)>, Vec<String>) {
    let Some(root) = spec.checkpoint.dir.as_ref() else {
        return (None, Vec::new());
    };
    let (ckpt, passed_over) = crate::newest_that_opens(Path::new(root), |c| {
        c.check_model(&spec.model)
            .and_then(|()| c.check_optimizer(spec.train.optimizer.kind))
            .map_err(|e| e.to_string())
    });
    let found = ckpt.map(|c| (c.dir.display().to_string(), c.manifest.step));
    (found, passed_over)
}

/// The intact checkpoint of `step`, if the run saved one (where a stopped
/// run's lines point).
fn checkpoint_of(spec: &zconfig::JobSpec, step: u64) -> Option<String> {
    newest_intact(spec)
        .0
        .filter(|(_, at)| *at == step)
        .map(|(dir, _)| dir)
}

/// `train.epochs` for a run resumed from `dir` at `step`: the steps that
/// finish the epochs from the sequences that checkpoint had consumed, at
/// this launch's global batch (another world size than the checkpoint's
/// changes how many steps are left, not how many epochs).
fn resume_epochs(
    job: &mut zconfig::LoadedJob,
    plan: &mut LaunchPlan,
    sequences: u64,
    dir: &str,
    step: u64,
) -> Result<()> {
    let consumed = crate::open_checkpoint(Path::new(dir))?
        .manifest
        .samples_consumed;
    let world = plan.topology.world_size();
    job.settle_epochs(world, Some((step, consumed)), |_| {
        Ok::<_, String>(sequences)
    })?;
    plan.spec.train.steps = job.spec.train.steps;
    plan.spec.train.warmup_steps = job.spec.train.warmup_steps;
    Ok(())
}

/// `--resume DIR|auto` → a verified checkpoint of this model (bad ones: exit 2).
/// `auto` with no checkpoint yet starts from scratch.
/// Returns the checkpoint directory and its step.
fn resolve_resume(arg: Option<&str>, spec: &zconfig::JobSpec) -> Result<Option<(String, u64)>> {
    let Some(arg) = arg else { return Ok(None) };
    if arg == "auto" {
        let Some(root) = &spec.checkpoint.dir else {
            return Err(Failure::bad_input(
                "--resume auto: the job has no checkpoint.dir to look in",
            ));
        };
        if zckpt::list(std::path::Path::new(root)).is_empty() {
            say!("zrun: --resume auto: no checkpoint in {root} yet; starting from scratch");
            return Ok(None);
        }
        // Not a silent step back: a damaged newest checkpoint stops the run,
        // and the message names the one to resume from instead.
        let (intact, passed_over) = newest_intact(spec);
        let Some(why) = passed_over.first() else {
            return Ok(intact);
        };
        let instead = match intact {
            Some((dir, step)) => format!(
                "the newest that opens and holds this model is {dir} (step {step}): \
                 `--resume {dir}` continues from it"
            ),
            None => format!("no checkpoint in {root} opens and holds this model"),
        };
        return Err(Failure::bad_input(format!(
            "--resume auto: {why}; {instead}"
        )));
    }
    let ckpt = crate::open_checkpoint(Path::new(arg))
        .map_err(|e| Failure::bad_input(format!("--resume: {e}")))?;
    ckpt.check_model(&spec.model)
        .and_then(|()| ckpt.check_optimizer(spec.train.optimizer.kind))
        .map_err(|e| Failure::bad_input(format!("--resume: {e}")))?;
    Ok(Some((ckpt.dir.display().to_string(), ckpt.manifest.step)))
}

/// `model.init_from` must hold every parameter of the model under zrun's or
/// Hugging Face's names, each of the right shape (read and mapped here, as
/// each worker will, so that a mismatch is exit 2 before launch).
pub(crate) fn check_init_from(spec: &zconfig::JobSpec) -> Result<()> {
    let Some(f) = &spec.model.init_from else {
        return Ok(());
    };
    let m = &spec.model;
    zckpt::InitWeights::open(std::path::Path::new(f), m, &m.param_shapes())
        .map_err(|e| Failure::bad_input(format!("model.init_from: {e}")))?;
    // A forgotten rotary base or epsilon leaves every shape as it is.
    if let Some(says) = zckpt::hf::config_beside_disagrees(m, Path::new(f)) {
        shout!(
            "zrun: warning: model.init_from {f} is read as the job's model, but {says} (give the directory to have the job take its model from it)"
        );
    }
    if let Some(keys) = zckpt::hf::dropout_not_taken(m, Path::new(f)) {
        shout!(
            "zrun: note: model.init_from's config.json trains with dropout, which zrun takes only from the job: {keys}; set those keys to train as transformers' Trainer would, or 0 to say none"
        );
    }
    Ok(())
}

/// Refuses a local job whose workers cannot fit in this host's memory and
/// swap together (it would die of an allocation failure after launch), and
/// warns when they exceed their share of what is available now. Jobs on other
/// hosts only get the warning: their memory is not this host's.
pub(crate) fn check_memory(plan: &LaunchPlan) -> Result<()> {
    let need = crate::estimate::per_worker_bytes(&plan.spec, &plan.topology);
    let local = plan
        .topology
        .nodes
        .iter()
        .map(|n| n.slots.len())
        .max()
        .unwrap_or(1);
    // GiB, or MiB under one (a small worker's need is not "0.00 GiB").
    let size = |b: f64| match b / f64::from(1 << 30) {
        g if g >= 1.0 => format!("{g:.2} GiB"),
        _ => format!("{:.0} MiB", b / f64::from(1 << 20)),
    };
    let (held, holds_less) = match plan.spec.device {
        zconfig::spec::Device::Cpu => (
            "model states + activations",
            "lower train.micro_batch_size, raise zero.stage, enable train.activation_checkpointing or run fewer workers",
        ),
        zconfig::spec::Device::Cuda => (
            "model states in host memory; activations on the GPU",
            "raise zero.stage or run fewer workers",
        ),
    };
    let here = plan.here;
    if let (true, Some(total)) = (here, crate::estimate::mem_total()) {
        if need * local as f64 > total {
            return Err(Failure::bad_input(format!(
                "{local} workers are estimated to need {} in all, {} each (ZeRO stage {} {held}), more than this host's {} of memory and swap; {holds_less} (see `zrun estimate`)",
                size(need * local as f64),
                size(need),
                plan.spec.zero.stage,
                size(total)
            )));
        }
    }
    // A GPU job's worker on its GPU: warned of, not refused (the estimate
    // is an estimate; the worker's own out-of-memory failure says the rest).
    if let Some(gpu) = plan.gpu_memory.filter(|_| here) {
        let fused = crate::plan::fused_attention_expected(&plan.spec);
        let world = plan.topology.world_size();
        let held = zconfig::estimate::gpu_worker_bytes(&plan.spec, world, fused);
        if held.total() > gpu {
            let states = match held.states {
                Some(b) => format!("{} of model states and ", size(b)),
                None => String::new(),
            };
            shout!(
                "zrun: warning: a worker is estimated to hold {states}{} of activations at train.micro_batch_size {} on its GPU, more than the smallest GPU's {}; it will likely run out of GPU memory at its first step (see `zrun estimate`; zero.stage: 3, train.activation_checkpointing: true or a smaller micro-batch hold less)",
                size(held.activations),
                plan.spec.train.micro_batch_size,
                size(gpu)
            );
        }
    }
    if let Some(avail) = crate::estimate::mem_available() {
        let share = avail / local as f64;
        if need > share {
            shout!(
                "zrun: warning: a worker is estimated to need {} (ZeRO stage {} {held}), more than its {} share of this host's available memory ({local} workers); see `zrun estimate`",
                size(need),
                plan.spec.zero.stage,
                size(share)
            );
        }
    }
    Ok(())
}
