//! The training loop: data, engine, one report per optimizer step, checkpoints.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use zckpt::{Checkpoint, EarlyStopState, PlateauState};
use zcomm::{CounterSnapshot, Op};
use zconfig::JobSpec;
use zdata::job::Sources;
use zdata::Batcher;
use zengine::{Engine, MemoryUse, ProcessGroups, StepStats};
use zproto::{
    ByOp, CommBytes, FlopsProfile, IoReport, MemBytes, StepReport, StepTimesMs, ToServer,
};

use crate::checkpoint::{save, Validation};
use crate::control::ControlClient;
use crate::env::WorkerEnv;

/// Trains `spec` on this rank (from `resume` if given) and reports each step.
/// `groups.hpz` is this rank's hpZ group when `zero.hpz_partition_size` > 1.
///
/// A stop request (SIGUSR1 to this worker, or zrun's `Stop` after zrun got
/// one: a preemption notice) ends the run after the step in progress, every
/// rank after the same step (the request rides on the gradient norm's
/// all-gather), with a checkpoint of it; without `checkpoint.dir` there is
/// nothing to save into, and the request is ignored with a warning.
///
/// `train.early_stopping` ends the run after the validation that makes
/// `patience` in a row without improvement, with a checkpoint of it (every
/// rank at the same step: they all see the same all-reduced loss); a run
/// resumed from such a checkpoint trains no further.
pub fn train(
    spec: &JobSpec,
    resume: Option<&str>,
    env: &WorkerEnv,
    nodes: usize,
    groups: ProcessGroups,
    client: &ControlClient,
) -> Result<crate::Ended> {
    let t = &spec.train;
    let Sources { train, held_out } = Sources::open(spec)?;
    let batcher =
        |sources, accum| zdata::job::batcher(spec, sources, accum, env.world_size, env.rank);
    // Validation: the same `eval_steps` micro-batches of the held-out tail at
    // every evaluation, each rank its share.
    let val_batches = match held_out.is_empty() {
        false => {
            let mut b = batcher(held_out, t.eval_steps)?;
            Some(
                (0..t.eval_steps)
                    .map(|m| b.batch(0, m))
                    .collect::<Result<Vec<_>, _>>()?,
            )
        }
        true => None,
    };
    let mut data = batcher(train, t.grad_accum)?.with_curriculum(t.curriculum.clone());
    if env.rank == 0 {
        let packed = data.packed();
        for (i, p) in packed.iter().enumerate() {
            // A blend's sources are named by their place in it.
            let which = match packed.len() {
                1 => String::new(),
                _ => format!(" (data.blend[{i}])"),
            };
            report_packing(p, spec.model.seq_len + 1, &which);
        }
    }
    let comm = groups.world.clone();
    let mut engine = Engine::with_groups(spec, groups, &env.job_id)?;
    if spec.checkpoint.dir.is_some() {
        engine.stop_on(client.stop_flag());
    }
    if spec.device == zconfig::spec::Device::Cuda {
        crate::gpu::attach(&mut engine, spec, env, comm.as_ref())?;
    }
    if let Some(path) = &spec.model.init_from {
        let weights =
            zckpt::InitWeights::open(Path::new(path), &spec.model, &spec.model.param_shapes())?;
        engine.load_weights(&weights)?;
    }
    let mut early = None;
    let mut plateau = None;
    if let Some(dir) = resume {
        let ckpt =
            Checkpoint::open(Path::new(dir)).with_context(|| format!("resuming from {dir}"))?;
        ckpt.check_model(&spec.model)?;
        engine.load(&ckpt)?;
        data.resume_at(ckpt.manifest.step, ckpt.manifest.samples_consumed);
        // The count goes on only where the job still stops early (a job
        // without it records none, as transformers keeps a callback's
        // state only while the callback is there).
        early = ckpt
            .manifest
            .early_stopping
            .filter(|_| t.early_stopping.is_some());
        // Likewise the plateau rule's rate and counts, where the job still
        // has the rule.
        plateau = ckpt
            .manifest
            .plateau
            .filter(|_| t.schedule == zconfig::Schedule::ReduceLrOnPlateau);
        if let Some(p) = plateau {
            engine.set_plateau_lr(p.lr);
        }
    }
    // Whether early stopping ends the run after `step`.
    let stops_early = |early: Option<EarlyStopState>, step: u64| {
        let patience = t.early_stopping.as_ref()?.patience;
        early.filter(|e| e.stale >= patience && step < t.steps)
    };
    if let Some(e) = stops_early(early, engine.steps_done()) {
        return Ok(crate::Ended::EarlyStopped {
            step: engine.steps_done(),
            best: e,
        });
    }
    let params = engine.model().param_count() as u64;
    let every = spec.checkpoint.every;
    let mut saved_at = None;
    // The last validation: its step and loss.
    let mut validated = None;
    let save_now = |engine: &Engine, data: &Batcher, validation: Validation| {
        let consumed = data.samples_consumed(engine.steps_done());
        save(
            engine,
            spec,
            env,
            comm.as_ref(),
            nodes,
            consumed,
            validation,
        )
    };
    // ZRUN_GPU_PROFILE: the profile starts again after the warm-up steps
    // where the run has twice as many.
    let first = engine.steps_done();
    let profile_from = (t.steps.saturating_sub(first) >= 2 * crate::gpu::WARM_STEPS)
        .then_some(first + crate::gpu::WARM_STEPS);
    // `flops_profiler`: rank 0 times this step's modules (DeepSpeed's
    // profiler reports rank 0's too).
    let profiled = spec.flops_profiler.as_ref().map(|p| p.profile_step);
    for s in engine.steps_done()..t.steps {
        let profiling = env.rank == 0 && profiled == Some(s + 1);
        if profiling {
            zmodel::profile::start();
        }
        let started = Instant::now();
        for micro in 0..t.grad_accum {
            engine.forward_backward(&data.batch(s, micro)?)?;
        }
        let st = engine.step()?;
        if st.skipped {
            let now = engine.loss_scaler().map_or(0.0, |s| s.scale);
            tracing::warn!(
                "step {}: gradient overflow at loss scale {}, step skipped, scale now {now}",
                st.step,
                st.loss_scale.unwrap_or(0.0)
            );
        }
        let step_ms = started.elapsed().as_secs_f64() * 1e3;
        let module_times = zmodel::profile::finish();
        // The global sequences this step took, for what happens at each
        // epoch's end.
        let took = (
            data.samples_consumed(st.step - 1),
            data.samples_consumed(st.step),
        );
        let sequences = data.windows() as u64;
        let evaluate = st.step == t.steps || t.eval_every.due(st.step, took, sequences);
        let val_loss = match &val_batches {
            Some(batches) if evaluate => Some(engine.eval_loss(batches)?),
            _ => None,
        };
        validated = val_loss.map(|l| (st.step, l)).or(validated);
        if let (Some(e), Some(l)) = (&t.early_stopping, val_loss) {
            early = Some(EarlyStopState::after(early, st.step, l, e.threshold));
        }
        if let (zconfig::Schedule::ReduceLrOnPlateau, Some(l)) = (t.schedule, val_loss) {
            let rule = t.plateau.clone().unwrap_or_default();
            let p = PlateauState::after(plateau, l, t.lr, t.min_lr, &rule);
            if env.rank == 0 && p.lr < plateau.map_or(t.lr, |before| before.lr) {
                tracing::info!(
                    "step {}: validation loss {l:.4} has not improved on {:.4} for {} validations: learning rate now {:.3e}",
                    st.step,
                    p.best.unwrap_or(f64::NAN),
                    rule.patience + 1,
                    p.lr
                );
            }
            engine.set_plateau_lr(p.lr);
            plateau = Some(p);
        }
        let validation = Validation {
            val_loss,
            early_stopping: early,
            plateau,
        };
        let trained_len = data.step_seq_len(st.step - 1);
        let times = step_times(&st, step_ms);
        let profile = module_times.map(|m| FlopsProfile {
            step: st.step,
            rank: env.rank as u64,
            world_size: env.world_size as u64,
            zero_stage: spec.zero.stage.number(),
            micro_batches: t.grad_accum as u64,
            micro_batch: t.micro_batch_size as u64,
            seq_len: trained_len as u64,
            times,
            step_ms,
            modules: engine.flops_profile(
                &m,
                st.tokens,
                trained_len,
                (times.forward, times.backward),
            ),
        });
        client.send(&ToServer::Report(Box::new(StepReport {
            step: st.step,
            epoch: took.1 as f64 / sequences as f64,
            loss: st.loss,
            lr: st.lr,
            grad_norm: (!st.skipped).then_some(st.grad_norm),
            step_ms,
            tokens: st.tokens,
            flops: st.tokens as f64
                * engine.flops_per_token_ran(
                    trained_len,
                    st.layer_drop.as_ref().map(|l| l.ran.as_slice()),
                ),
            params,
            zero_stage: spec.zero.stage.number(),
            mem: mem_bytes(&st.mem),
            comm: comm_bytes(&st.comm),
            times,
            loss_scale: st.loss_scale,
            io: st.io.map(|io| IoReport {
                read_bytes: io.read_bytes,
                write_bytes: io.write_bytes,
                wait_s: io.wait_s,
                busy_s: io.busy_s,
            }),
            val_loss,
            trust_ratio: st.trust_ratio.map(|r| zproto::TrustRatios {
                min: r.min,
                mean: r.mean,
                max: r.max,
            }),
            seq_len: t.curriculum.as_ref().map(|_| trained_len),
            comms: st.comms,
            layer_drop: st.layer_drop.as_ref().map(|l| zproto::LayerDrop {
                theta: l.theta,
                blocks_run: l.blocks_run,
            }),
        })))?;
        if let Some(p) = profile {
            client.send(&ToServer::Profile(Box::new(p)))?;
        }
        if profile_from == Some(st.step) {
            crate::gpu::profile(&engine, env.rank, crate::gpu::ProfileAt::Restart)?;
        }
        if spec.checkpoint.dir.is_some() && every.due(st.step, took, sequences) {
            save_now(&engine, &data, validation)?;
            saved_at = Some(st.step);
        }
        if spec.checkpoint.dir.is_none() && client.stop_flag().swap(false, Ordering::SeqCst) {
            tracing::warn!(
                "asked to stop (SIGUSR1) at step {}: the job has no checkpoint.dir to save into, so it goes on",
                st.step
            );
        }
        if st.stop && st.step < t.steps {
            if saved_at != Some(st.step) {
                save_now(&engine, &data, validation)?;
            }
            return Ok(crate::Ended::Stopped { step: st.step });
        }
        if let Some(best) = stops_early(early, st.step) {
            if spec.checkpoint.dir.is_some() && saved_at != Some(st.step) {
                save_now(&engine, &data, validation)?;
            }
            return Ok(crate::Ended::EarlyStopped {
                step: st.step,
                best,
            });
        }
    }
    let steps = engine.steps_done() - profile_from.unwrap_or(first);
    crate::gpu::profile(&engine, env.rank, crate::gpu::ProfileAt::Report { steps })?;
    // A run with a checkpoint directory always ends with a checkpoint.
    if spec.checkpoint.dir.is_some() && saved_at != Some(engine.steps_done()) {
        let val_loss = validated
            .filter(|&(step, _)| step == engine.steps_done())
            .map(|(_, l)| l);
        let validation = Validation {
            val_loss,
            early_stopping: early,
            plateau,
        };
        save_now(&engine, &data, validation)?;
    }
    Ok(crate::Ended::Done)
}

/// The engine's memory accounting as the control protocol reports it.
fn mem_bytes(m: &MemoryUse) -> MemBytes {
    MemBytes {
        params: m.params,
        grads: m.grads,
        master: m.master,
        optimizer: m.optimizer,
        activations: m.activations,
        comm_buffers: m.comm_buffers,
        offload_buffers: m.offload_buffers,
        peak_rss: m.peak_rss,
        nvme: (m.nvme > 0).then_some(m.nvme),
        secondary: (m.secondary > 0).then_some(m.secondary),
    }
}

/// The communicator's byte counters as the control protocol reports them.
fn comm_bytes(d: &CounterSnapshot) -> CommBytes {
    CommBytes {
        intra_node: d.intra_node,
        inter_node: d.inter_node,
        by_op: by_op(|op| d.op(op)),
    }
}

/// Where the step's `step_ms` went, from the engine's phases and the
/// communicator's waits.
fn step_times(st: &StepStats, step_ms: f64) -> StepTimesMs {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (forward, backward, optimizer) = (
        ms(st.times.forward),
        ms(st.times.backward),
        ms(st.times.optimizer),
    );
    StepTimesMs {
        forward,
        backward,
        optimizer,
        other: (step_ms - forward - backward - optimizer).max(0.0),
        comm_wait: ms(st.comm.waited_total()),
        comm_wait_by_op: by_op(|op| ms(st.comm.waited(op))),
    }
}

/// One value per collective, from `f`.
fn by_op<T>(f: impl Fn(Op) -> T) -> ByOp<T> {
    ByOp {
        all_reduce: f(Op::AllReduce),
        reduce_scatter: f(Op::ReduceScatter),
        all_gather: f(Op::AllGather),
        all_to_all: f(Op::AllToAll),
        broadcast: f(Op::Broadcast),
        quantized_reduce_scatter: f(Op::QuantizedReduceScatter),
    }
}

/// What packing whole documents did (`data.packing: bfd`, `bfd_split`):
/// how much of the sequences is padding, a warning where documents were
/// cut, and how many were split.
fn report_packing(p: &zdata::packing::Packed, capacity: usize, which: &str) {
    let room = p.len() * capacity;
    let padding = 100.0 * (room - p.tokens()) as f64 / room.max(1) as f64;
    tracing::info!(
        "data.packing{which}: {} documents in {} sequences, {padding:.1}% of their tokens padding",
        p.documents(),
        p.len()
    );
    let (cut, lost) = p.cut();
    if cut > 0 {
        tracing::warn!(
            "data.packing bfd{which}: {cut} of {} documents are longer than seq_len + 1 = {capacity} tokens and keep their first {capacity} ({lost} tokens left out); a longer model.seq_len keeps them whole, or data.packing: bfd_split trains every token in pieces",
            p.documents()
        );
    }
    let (split, pieces) = p.split();
    if split > 0 {
        tracing::info!(
            "data.packing bfd_split{which}: {split} documents longer than seq_len + 1 = {capacity} tokens became {pieces} pieces, each packed as a document of its own"
        );
    }
}
