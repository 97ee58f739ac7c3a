//! Writing a checkpoint: every rank its shard, then rank 0 the manifest.
//!
//! Ranks send their shard's size and checksum (and, with LoCo, those of
//! their file of kept quantization errors) to rank 0 with an all-to-all, so
//! the manifest is written only once every shard is safely on disk, and a crash
//! anywhere before that leaves a directory without a manifest, which resume and
//! export ignore. Rank 0 then prunes checkpoints beyond `checkpoint.keep`
//! (keeping the one of the lowest validation loss under
//! `checkpoint.keep_best`, which the manifests record).

use std::path::Path;

use anyhow::{anyhow, Result};
use zckpt::{
    step_dir_name, write_feedback, write_manifest, write_shard, EarlyStopState, FileEntry,
    Manifest, PlateauState, FORMAT,
};
use zcomm::Communicator;
use zconfig::JobSpec;
use zengine::Engine;

use crate::env::WorkerEnv;

/// What a checkpoint records of the run's validation: the loss at its
/// step, if the run validated then, and where early stopping stands.
#[derive(Debug, Clone, Copy, Default)]
pub struct Validation {
    /// The validation loss at the checkpoint's step.
    pub val_loss: Option<f64>,
    /// `train.early_stopping`'s count after the last validation.
    pub early_stopping: Option<EarlyStopState>,
    /// `reduce_lr_on_plateau`'s state after the last validation.
    pub plateau: Option<PlateauState>,
}

/// Saves the engine's state after its last step, with `validation`.
pub fn save(
    engine: &Engine,
    spec: &JobSpec,
    env: &WorkerEnv,
    comm: &dyn Communicator,
    nodes: usize,
    samples: u64,
    validation: Validation,
) -> Result<()> {
    let root = Path::new(
        spec.checkpoint
            .dir
            .as_deref()
            .ok_or_else(|| anyhow!("no checkpoint.dir"))?,
    );
    let step = engine.steps_done();
    let dir = root.join(step_dir_name(step));
    let lens: Vec<usize> = engine
        .manifest_groups()
        .iter()
        .map(|g| g.padded / env.world_size)
        .collect();
    let kinds = engine.checkpoint_kinds();
    let entry = write_shard(&dir, env.rank, kinds, &lens, |g| engine.own_slice(g))?;
    let feedback = match engine.feedback_state() {
        Some(bytes) => Some(write_feedback(&dir, env.rank, &bytes)?),
        None => None,
    };
    let mut pieces = vec![Vec::new(); env.world_size];
    pieces[0] = serde_json::to_vec(&(entry, feedback))?;
    let got = comm.all_to_all(pieces)?;
    if env.rank == 0 {
        let written = got
            .iter()
            .map(|b| serde_json::from_slice::<(FileEntry, Option<FileEntry>)>(b))
            .collect::<Result<Vec<_>, _>>()?;
        let (files, feedback): (Vec<_>, Vec<_>) = written.into_iter().unzip();
        let manifest = Manifest {
            format: FORMAT,
            model: spec.model.clone(),
            world_size: env.world_size,
            nodes,
            stage: spec.zero.stage.number(),
            dtype: spec.train.dtype,
            step,
            samples_consumed: samples,
            loss_scale: engine.loss_scale_state(),
            val_loss: validation.val_loss,
            early_stopping: validation.early_stopping,
            plateau: validation.plateau,
            optimizer: spec.train.optimizer.kind,
            groups: engine.manifest_groups(),
            files,
            feedback: feedback.into_iter().flatten().collect(),
        };
        write_manifest(&dir, &manifest)?;
        zckpt::prune(root, spec.checkpoint.keep, spec.checkpoint.keep_best)?;
    }
    comm.barrier()?;
    Ok(())
}
