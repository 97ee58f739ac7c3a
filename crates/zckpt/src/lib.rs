//! zckpt: the on-disk checkpoint format, shared by the workers (save, load) and
//! the launcher (verify before launching, export).
//!
//! A checkpoint is a directory `step-NNNNNNNN/` holding one safetensors shard per
//! rank (`rank-NNNNN.safetensors`) and a `manifest.json` written last. A shard
//! holds, for every parameter group g, this rank's slice of the group's flat
//! buffers: `g{g}.params`, `g{g}.exp_avg`, and `g{g}.exp_avg_sq` where the
//! optimizer keeps a second moment (AdamW; not Lion), or `g{g}.params` and
//! `g{g}.sum` (Adagrad's sum of squared gradients, PyTorch's name). The manifest records
//! the model, the layout of every group (parameter names, shapes, offsets; the
//! padded length and world size that define the slices), the step, the data
//! position, each shard's size and CRC-32C, and its own CRC-32C: a damaged or
//! edited manifest would otherwise resume from the wrong step or data
//! position, or read parameters from the wrong offsets, without a word.
//!
//! The design decision to know: slices are cut from a flat buffer whose unpadded
//! content does not depend on the world size, so a checkpoint written by N ranks
//! at any stage can be reassembled and re-cut for M ranks at any stage, online,
//! with plain copies (no offline conversion, no arithmetic, so no rounding).
//! Every file is written to a temporary name, fsynced, and renamed; the manifest
//! goes last, so a directory without a manifest is an unfinished save and is
//! never resumed from.

#![deny(missing_docs)]

pub mod hf;
mod hf_files;
mod stream;
mod whole;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use zconfig::spec::{ModelSpec, OptimizerKind, PlateauSpec, ThresholdMode};
use zconfig::Dtype;

/// Manifest file name.
pub const MANIFEST: &str = "manifest.json";
/// Manifest format version.
pub const FORMAT: u32 = 1;

pub use stream::{checksum, StreamWriter, TensorFile};
pub use whole::{whole_params, whole_shape, Assembler, ParamReader, WholeParam};
pub use zconfig::tiles::ColumnTile;

/// What can go wrong with a checkpoint. Every message names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CkptError {
    /// Reading or writing failed.
    #[error("{path}: {cause}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause (shown in the message, so not also a `source`).
        cause: std::io::Error,
    },
    /// The checkpoint is incomplete, corrupt or does not fit the job.
    #[error("{path}: {message}")]
    Invalid {
        /// File.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CkptError + '_ {
    move |cause| CkptError::Io {
        path: path.to_path_buf(),
        cause,
    }
}

impl From<zconfig::hf_config::HfConfigError> for CkptError {
    fn from(e: zconfig::hf_config::HfConfigError) -> Self {
        use zconfig::hf_config::HfConfigError;
        match e {
            HfConfigError::Io { path, cause } => CkptError::Io { path, cause },
            HfConfigError::Invalid { path, message } => CkptError::Invalid { path, message },
        }
    }
}

pub(crate) fn invalid(path: &Path, message: impl Into<String>) -> CkptError {
    CkptError::Invalid {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// One parameter inside a group's flat buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamEntry {
    /// Model name, e.g. `h.0.attn.c_attn.weight`.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// `model.tile_size`: the columns this piece holds of parameter `name`
    /// (whose whole last dimension is `tile.of`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tile: Option<ColumnTile>,
}

/// One parameter group's layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupEntry {
    /// Group name.
    pub name: String,
    /// Elements used.
    pub numel: usize,
    /// Padded length at the checkpoint's world size.
    pub padded: usize,
    /// Its parameters.
    pub params: Vec<ParamEntry>,
}

/// One shard file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the checkpoint directory.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// CRC-32C of the whole file.
    pub crc32c: u32,
}

/// f16's dynamic loss-scaler state at a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScaleState {
    /// The current scale.
    pub scale: f64,
    /// Overflows tolerated before the next halving.
    pub hysteresis: u32,
    /// The 0-based step of the last overflow (-1 before any).
    pub last_overflow: i64,
    /// Steps skipped on overflow (the optimizer made `step - skipped` updates).
    pub skipped: u64,
}

/// The checkpoint's table of contents, written last.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version.
    pub format: u32,
    /// The model the checkpoint belongs to.
    pub model: ModelSpec,
    /// Ranks that wrote it.
    pub world_size: usize,
    /// Nodes they ran on.
    pub nodes: usize,
    /// ZeRO stage it was written at.
    pub stage: u8,
    /// Training dtype.
    pub dtype: Dtype,
    /// Optimizer steps done.
    pub step: u64,
    /// Global samples consumed (the data position).
    pub samples_consumed: u64,
    /// f16's dynamic loss scale (null otherwise).
    pub loss_scale: Option<LossScaleState>,
    /// The validation loss at its step, where the run validated then
    /// (what `checkpoint.keep_best` keeps the lowest of).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// `train.early_stopping`'s count at its step, which a resumed run
    /// goes on from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopState>,
    /// `train.schedule: reduce_lr_on_plateau`'s state at its step, which a
    /// resumed run goes on from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plateau: Option<PlateauState>,
    /// The update rule whose state the shards hold (`train.optimizer.type`;
    /// absent: AdamW, as in every checkpoint written before Lion). A run
    /// with another rule refuses to resume from it: Lion leaves AdamW's
    /// second moment at zero, which AdamW would divide by.
    #[serde(default, skip_serializing_if = "is_adamw")]
    pub optimizer: OptimizerKind,
    /// Group layouts, in model order.
    pub groups: Vec<GroupEntry>,
    /// One shard per rank, in rank order.
    pub files: Vec<FileEntry>,
    /// LoCo's kept quantization errors (`zero.loco`): one file per rank,
    /// in rank order ([`feedback_name`]); empty without LoCo.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub feedback: Vec<FileEntry>,
}

fn is_adamw(kind: &OptimizerKind) -> bool {
    *kind == OptimizerKind::Adamw
}

/// Where `train.early_stopping` stands after a validation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EarlyStopState {
    /// The lowest validation loss so far, and its step.
    pub best_val_loss: f64,
    /// The step of `best_val_loss`.
    pub best_step: u64,
    /// Validations since the last that improved on the best by more than
    /// the threshold.
    pub stale: u64,
}

impl EarlyStopState {
    /// The state after a validation loss `val` at `step`, from `before`
    /// (none before the first): transformers' `EarlyStoppingCallback`, an
    /// improvement being lower than the best by more than `threshold`.
    pub fn after(before: Option<EarlyStopState>, step: u64, val: f64, threshold: f64) -> Self {
        let Some(b) = before else {
            return EarlyStopState {
                best_val_loss: val,
                best_step: step,
                stale: 0,
            };
        };
        let (best_val_loss, best_step) = match val < b.best_val_loss {
            true => (val, step),
            false => (b.best_val_loss, b.best_step),
        };
        EarlyStopState {
            best_val_loss,
            best_step,
            stale: match val < b.best_val_loss - threshold {
                true => 0,
                false => b.stale + 1,
            },
        }
    }
}

/// Where `train.schedule: reduce_lr_on_plateau` stands after a validation:
/// PyTorch's `ReduceLROnPlateau` state (mode `min`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PlateauState {
    /// The lowest validation loss so far (none before a finite one).
    pub best: Option<f64>,
    /// Validations since the best, less those in a cooldown.
    pub bad: u64,
    /// Validations of the cooldown still to come.
    pub cooldown: u64,
    /// The rate.
    pub lr: f64,
}

impl PlateauState {
    /// The state after a validation loss `val`, from `before` (none before
    /// the first, when the rate is `lr`): `ReduceLROnPlateau.step`, with
    /// `min_lr` as its floor.
    pub fn after(
        before: Option<PlateauState>,
        val: f64,
        lr: f64,
        min_lr: f64,
        rule: &PlateauSpec,
    ) -> PlateauState {
        let mut s = before.unwrap_or(PlateauState {
            best: None,
            bad: 0,
            cooldown: 0,
            lr,
        });
        let best = s.best.unwrap_or(f64::INFINITY);
        let better = match rule.threshold_mode {
            ThresholdMode::Rel => val < best * (1.0 - rule.threshold),
            ThresholdMode::Abs => val < best - rule.threshold,
        };
        if better {
            (s.best, s.bad) = (Some(val), 0);
        } else {
            s.bad += 1;
        }
        if s.cooldown > 0 {
            s.cooldown -= 1;
            s.bad = 0;
        }
        if s.bad > rule.patience {
            let lower = (s.lr * rule.factor).max(min_lr);
            if s.lr - lower > rule.eps {
                s.lr = lower;
            }
            (s.cooldown, s.bad) = (rule.cooldown, 0);
        }
        s
    }
}

/// The flat buffers a shard holds per group: all three for AdamW, the
/// first two for a rule without a second moment ([`kinds`]).
pub const KINDS: [&str; 3] = ["params", "exp_avg", "exp_avg_sq"];

/// The flat buffers a shard of a run with update rule `rule` holds per
/// group: its parameters and the state the rule keeps. (A Lion shard
/// written before 2026-12-05 also holds a zero `exp_avg_sq`, never read.)
pub fn kinds(rule: OptimizerKind) -> &'static [&'static str] {
    match rule {
        OptimizerKind::Adamw | OptimizerKind::Adam | OptimizerKind::Lamb => &KINDS,
        OptimizerKind::Lion => &KINDS[..2],
        OptimizerKind::Adagrad => &["params", "sum"],
    }
}

/// Directory name of the checkpoint of `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Shard file name of `rank`.
pub fn shard_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// File name of `rank`'s LoCo errors.
pub fn feedback_name(rank: usize) -> String {
    format!("loco-rank-{rank:05}.bin")
}

/// Writes `rank`'s LoCo errors (the engine's bytes, as they are) into
/// `dir`, atomically.
pub fn write_feedback(dir: &Path, rank: usize, bytes: &[u8]) -> Result<FileEntry, CkptError> {
    let name = feedback_name(rank);
    write_atomic(&dir.join(&name), bytes)?;
    Ok(FileEntry {
        name,
        bytes: bytes.len() as u64,
        crc32c: crc32c::crc32c(bytes),
    })
}

/// Fault injection for tests: `ZRUN_FAULT_SAVE_DELAY_MS` stalls every save between
/// writing a temporary file and renaming it, so a test can kill a worker mid-save.
fn fault_delay() {
    if let Some(ms) = std::env::var("ZRUN_FAULT_SAVE_DELAY_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// The temporary name a file is written under before it is renamed to
/// `path` ([`write_atomic`], the streamed exports): `path` with the
/// extension `tmp`.
pub fn temporary_path(path: &Path) -> PathBuf {
    path.with_extension("tmp")
}

/// Writes `bytes` to `path` atomically: a temporary name, fsync, rename, fsync of
/// the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CkptError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = temporary_path(path);
    let written = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(bytes).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        fault_delay();
        std::fs::rename(&tmp, path).map_err(io(path))
    })();
    if written.is_err() {
        // A failed save (a full disk, most often) must not leave its partial
        // file behind to fill the disk further.
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Writes one rank's shard, a group at a time: group g's slices have
/// `slice_lens[g]` elements and `slices(g)` returns one for each of
/// `kinds` ([`kinds`]), in its order, so only one group's slices are ever
/// in memory.
pub fn write_shard<E: From<CkptError>>(
    dir: &Path,
    rank: usize,
    kinds: &[&str],
    slice_lens: &[usize],
    mut slices: impl FnMut(usize) -> Result<Vec<Vec<f32>>, E>,
) -> Result<FileEntry, E> {
    let name = shard_name(rank);
    let path = dir.join(&name);
    let tensors: Vec<(String, Vec<usize>)> = slice_lens
        .iter()
        .enumerate()
        .flat_map(|(g, &n)| kinds.iter().map(move |k| (format!("g{g}.{k}"), vec![n])))
        .collect();
    let mut w = StreamWriter::create(&path, &tensors, None)?;
    for g in 0..slice_lens.len() {
        for buf in slices(g)? {
            w.write(&buf)?;
        }
    }
    let (bytes, crc32c) = w.finish()?;
    Ok(FileEntry {
        name,
        bytes,
        crc32c,
    })
}

/// The manifest's key that holds its own checksum: the CRC-32C of the rest
/// of the manifest as a JSON value, written compactly (`serde_json`'s
/// form of the value, not the file's text or [`Manifest`]'s fields: a
/// manifest keeps its checksum through reformatting, and through a later
/// zrun that knows more fields). `write_manifest`'s `Stamped` names its
/// field after it.
const MANIFEST_CRC: &str = "crc32c";

/// The checksum of a manifest's JSON value (without [`MANIFEST_CRC`]).
fn manifest_crc(value: &serde_json::Value) -> Result<u32, serde_json::Error> {
    Ok(crc32c::crc32c(&serde_json::to_vec(value)?))
}

/// Writes the manifest (last, atomically), with its checksum.
pub fn write_manifest(dir: &Path, m: &Manifest) -> Result<(), CkptError> {
    let path = dir.join(MANIFEST);
    let json = |e: serde_json::Error| invalid(&path, e.to_string());
    let crc32c = manifest_crc(&serde_json::to_value(m).map_err(json)?).map_err(json)?;
    /// The manifest's fields in their order, then its checksum.
    #[derive(Serialize)]
    struct Stamped<'a> {
        #[serde(flatten)]
        manifest: &'a Manifest,
        crc32c: u32,
    }
    let stamped = Stamped {
        manifest: m,
        crc32c,
    };
    write_atomic(&path, &serde_json::to_vec_pretty(&stamped).map_err(json)?)
}

/// The manifest in `text` (from `path`), its checksum verified. A manifest
/// without one (written before 2026-12-02) is read as it is.
fn read_manifest(path: &Path, text: &[u8]) -> Result<Manifest, CkptError> {
    let not_ours = |e: serde_json::Error| invalid(path, format!("not a zrun manifest: {e}"));
    let mut value: serde_json::Value = serde_json::from_slice(text).map_err(not_ours)?;
    let stated = match &mut value {
        serde_json::Value::Object(fields) => fields.remove(MANIFEST_CRC),
        _ => None,
    };
    if let Some(stated) = stated {
        let crc = manifest_crc(&value).map_err(not_ours)?;
        if stated.as_u64() != Some(u64::from(crc)) {
            return Err(invalid(
                path,
                format!(
                    "checksum mismatch: the manifest's contents have CRC-32C {crc}, it says {stated}: \
                     damaged or edited after it was written"
                ),
            ));
        }
    }
    serde_json::from_value(value).map_err(not_ours)
}

/// Checkpoint directories under `root` that have a manifest, oldest first.
pub fn list(root: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.join(MANIFEST).is_file()
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
        })
        .collect();
    dirs.sort();
    dirs
}

/// Removes all but the newest `keep` complete checkpoints (and, with
/// `keep_best`, the [`best`] one), and unfinished saves older than the
/// newest complete one.
pub fn prune(root: &Path, keep: usize, keep_best: bool) -> Result<(), CkptError> {
    let complete = list(root);
    let Some(newest) = complete.last().cloned() else {
        return Ok(());
    };
    let best = match keep_best {
        true => best(root).map(|(dir, _)| dir),
        false => None,
    };
    for old in &complete[..complete.len().saturating_sub(keep.max(1))] {
        if Some(old) != best.as_ref() {
            std::fs::remove_dir_all(old).map_err(io(old))?;
        }
    }
    for e in std::fs::read_dir(root).map_err(io(root))?.flatten() {
        let p = e.path();
        let unfinished = p.is_dir()
            && !p.join(MANIFEST).exists()
            && p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("step-"));
        if unfinished && p < newest {
            std::fs::remove_dir_all(&p).map_err(io(&p))?;
        }
    }
    Ok(())
}

/// The complete checkpoint under `root` of the lowest validation loss, and
/// that loss: the earliest of equals, as Hugging Face's trainer keeps the
/// first to reach its best. None where none recorded one (or none opens).
pub fn best(root: &Path) -> Option<(PathBuf, f64)> {
    let mut best: Option<(PathBuf, f64)> = None;
    for dir in list(root) {
        let path = dir.join(MANIFEST);
        let Some(loss) = std::fs::read(&path)
            .ok()
            .and_then(|text| read_manifest(&path, &text).ok())
            .and_then(|m| m.val_loss)
        else {
            continue;
        };
        if best.as_ref().is_none_or(|(_, b)| loss < *b) {
            best = Some((dir, loss));
        }
    }
    best
}

/// Removes every unfinished save (a `step-*` directory without a manifest)
/// under `root` and returns what it removed. Only for a caller that knows no
/// live job writes there (zrun holds the directory's lock): such a save can
/// never be resumed from, and only fills the disk.
pub fn remove_unfinished(root: &Path) -> Result<Vec<PathBuf>, CkptError> {
    let mut removed = Vec::new();
    for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let p = e.path();
        let unfinished = p.is_dir()
            && !p.join(MANIFEST).exists()
            && p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("step-"));
        if unfinished {
            std::fs::remove_dir_all(&p).map_err(io(&p))?;
            removed.push(p);
        }
    }
    removed.sort();
    Ok(removed)
}

/// Resolves `--resume`: a checkpoint directory, or a root whose newest complete
/// checkpoint is taken.
pub fn resolve(path: &Path) -> Result<PathBuf, CkptError> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(invalid(path, "no such checkpoint directory"));
    }
    list(path).pop().ok_or_else(|| {
        invalid(
            path,
            "holds no complete checkpoint (no step-*/manifest.json)",
        )
    })
}

/// An opened, verified checkpoint.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// Its directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Each rank's shard, its header parsed once (a group's read takes a
    /// slice from each: parsing every header again for each group made
    /// reading a checkpoint quadratic in the groups).
    shards: std::sync::Arc<[TensorFile]>,
}

impl Checkpoint {
    /// Reads the manifest and checks every shard's presence, size and checksum.
    pub fn open(dir: &Path) -> Result<Checkpoint, CkptError> {
        let mpath = dir.join(MANIFEST);
        let text = std::fs::read(&mpath).map_err(io(&mpath))?;
        let manifest = read_manifest(&mpath, &text)?;
        if manifest.format != FORMAT {
            return Err(invalid(
                &mpath,
                format!("format {} (this zrun reads {FORMAT})", manifest.format),
            ));
        }
        if manifest.files.len() != manifest.world_size {
            return Err(invalid(
                &mpath,
                format!(
                    "{} shards listed for {} ranks",
                    manifest.files.len(),
                    manifest.world_size
                ),
            ));
        }
        let feedback = &manifest.feedback;
        if !feedback.is_empty() && feedback.len() != manifest.world_size {
            return Err(invalid(
                &mpath,
                format!(
                    "{} LoCo error files listed for {} ranks",
                    feedback.len(),
                    manifest.world_size
                ),
            ));
        }
        let listed = (manifest.files.iter().map(|f| ("shard", f)))
            .chain(feedback.iter().map(|f| ("LoCo error file", f)));
        for (what, f) in listed {
            let p = dir.join(&f.name);
            let size = match std::fs::metadata(&p) {
                Ok(m) => m.len(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(invalid(&p, format!("{what} is missing")))
                }
                Err(e) => return Err(CkptError::Io { path: p, cause: e }),
            };
            if size != f.bytes {
                return Err(invalid(
                    &p,
                    format!("{size} bytes, the manifest says {}", f.bytes),
                ));
            }
            let (_, crc) = checksum(&p)?;
            if crc != f.crc32c {
                return Err(invalid(
                    &p,
                    format!(
                        "checksum mismatch: CRC-32C {crc:08x}, the manifest says {:08x}",
                        f.crc32c
                    ),
                ));
            }
        }
        let shards = (manifest.files.iter())
            .map(|f| TensorFile::open(&dir.join(&f.name)))
            .collect::<Result<_, _>>()?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            manifest,
            shards,
        })
    }

    /// `rank`'s LoCo errors as the engine wrote them, where the checkpoint
    /// holds them (checked against the manifest when it was opened).
    pub fn feedback(&self, rank: usize) -> Result<Option<Vec<u8>>, CkptError> {
        let Some(f) = self.manifest.feedback.get(rank) else {
            return Ok(None);
        };
        let p = self.dir.join(&f.name);
        std::fs::read(&p).map(Some).map_err(io(&p))
    }

    /// Whether a run with the update rule `rule` can resume from this
    /// checkpoint: the rule its state was written by.
    pub fn check_optimizer(&self, rule: OptimizerKind) -> Result<(), CkptError> {
        let held = self.manifest.optimizer;
        match held == rule {
            true => Ok(()),
            false => Err(invalid(
                &self.dir.join(MANIFEST),
                format!(
                    "its optimizer state is {}'s, and the job's train.optimizer.type is {}: \
                     the state would not carry over (set train.optimizer.type: {} to resume)",
                    held.name(),
                    rule.name(),
                    held.name()
                ),
            )),
        }
    }

    /// Checks that the checkpoint belongs to `model`.
    pub fn check_model(&self, model: &ModelSpec) -> Result<(), CkptError> {
        let diffs: Vec<String> = self
            .manifest
            .model
            .architecture_differences(model)
            .into_iter()
            .map(|(key, a, b)| format!("{key} {a} in the checkpoint, {b} in the job"))
            .collect();
        if diffs.is_empty() {
            Ok(())
        } else {
            Err(invalid(
                &self.dir.join(MANIFEST),
                format!("a different model: {}", diffs.join(", ")),
            ))
        }
    }

    /// Group `g`'s whole flat buffer of `kind` (unpadded), reassembled from every shard.
    pub fn full_group(&self, g: usize, kind: &str) -> Result<Vec<f32>, CkptError> {
        let m = &self.manifest;
        let entry = m
            .groups
            .get(g)
            .ok_or_else(|| invalid(&self.dir.join(MANIFEST), format!("no group {g}")))?;
        let slice = entry.padded / m.world_size;
        let mut out = Vec::with_capacity(entry.numel);
        for (r, shard) in self.shards.iter().enumerate() {
            let start = r * slice;
            if start >= entry.numel {
                break;
            }
            let name = format!("g{g}.{kind}");
            let vals = shard.read(&name)?;
            if vals.len() != slice {
                return Err(invalid(
                    shard.path(),
                    format!("{name} has {} elements, expected {slice}", vals.len()),
                ));
            }
            let take = slice.min(entry.numel - start);
            out.extend_from_slice(&vals[..take]);
        }
        Ok(out)
    }

    /// Every group's parameters, whole, in model order.
    pub fn all_params(&self) -> Result<Vec<Vec<f32>>, CkptError> {
        (0..self.manifest.groups.len())
            .map(|g| self.full_group(g, "params"))
            .collect()
    }

    /// Writes consolidated f32 weights under the model's parameter names, a
    /// group at a time (a tiled linear's columns put back together).
    pub fn export(&self, out: &Path) -> Result<u64, CkptError> {
        let groups = &self.manifest.groups;
        let manifest = self.dir.join(MANIFEST);
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        let mut w = StreamWriter::create(out, &whole_params(groups), Some(meta))?;
        let mut elements = 0u64;
        let mut assembler = Assembler::default();
        for (g, entry) in groups.iter().enumerate() {
            let flat = self.full_group(g, "params")?;
            for (_, _, values) in assembler
                .add(entry, &flat)
                .map_err(|m| invalid(&manifest, m))?
            {
                w.write(&values)?;
                elements += values.len() as u64;
            }
        }
        assembler.finish().map_err(|m| invalid(&manifest, m))?;
        w.finish()?;
        Ok(elements)
    }
}

impl Checkpoint {
    /// Writes the consolidated weights as a Hugging Face model directory
    /// (`config.json` + `model.safetensors` under Hugging Face's names), a
    /// group at a time. Returns the parameters written.
    pub fn export_hf(&self, out: &Path) -> Result<u64, CkptError> {
        let groups = &self.manifest.groups;
        let manifest = self.dir.join(MANIFEST);
        let mut assembler = Assembler::default();
        let mut pending = std::collections::VecDeque::new();
        let mut next_group = 0;
        let n = hf::write_dir(&self.manifest.model, &whole_params(groups), out, || {
            while pending.is_empty() && next_group < groups.len() {
                let flat = self.full_group(next_group, "params")?;
                pending.extend(
                    assembler
                        .add(&groups[next_group], &flat)
                        .map_err(|m| invalid(&manifest, m))?
                        .into_iter()
                        .map(|(_, _, values)| values),
                );
                next_group += 1;
            }
            Ok(pending.pop_front())
        })?;
        assembler.finish().map_err(|m| invalid(&manifest, m))?;
        Ok(n)
    }
}

/// Consolidated weights by name: shape and values.
pub type Weights = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// Where a run's initial weights come from, a parameter at a time: the
/// engine installs one group after another and holds one parameter of the
/// file at a time, never the whole file.
pub trait WeightSource {
    /// How many parameters the source holds.
    fn tensor_count(&self) -> usize;
    /// Parameter `name`'s shape, if the source holds it.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// Parameter `name`'s values.
    fn read(&self, name: &str) -> Result<Vec<f32>, CkptError>;
}

impl WeightSource for Weights {
    fn tensor_count(&self) -> usize {
        self.len()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.get(name).map(|(s, _)| s.clone())
    }

    fn read(&self, name: &str) -> Result<Vec<f32>, CkptError> {
        self.get(name)
            .map(|(_, v)| v.clone())
            .ok_or_else(|| invalid(Path::new(name), "no such tensor"))
    }
}

/// The weights `model.init_from` names, opened and checked against the
/// model (from the files' headers) under zrun's names: a zrun export (`zrun
/// export`), or Hugging Face weights (a directory from `zrun export --format
/// hf` or `transformers`' `save_pretrained`, in one file or in shards, or a
/// published safetensors file), mapped by [`hf::HfWeights`]. Values are
/// read a parameter at a time ([`WeightSource::read`]).
pub struct InitWeights {
    params: HashMap<String, Vec<usize>>,
    file: InitFile,
}

enum InitFile {
    /// A file under zrun's own names.
    Zrun(TensorFile),
    Hf(hf::HfWeights),
}

impl InitWeights {
    /// Opens `path` for `model`, whose whole parameters are `params` (names
    /// and shapes): every parameter there under some name, of its shape,
    /// and nothing else. An error names the file and the first mismatch.
    pub fn open(
        path: &Path,
        model: &ModelSpec,
        params: &[(String, Vec<usize>)],
    ) -> Result<InitWeights, CkptError> {
        let file = match path.is_dir() {
            true => InitFile::Hf(hf::HfWeights::open(model, params, path)?),
            false => {
                let file = TensorFile::open(path)?;
                match zrun_named(&file, params)? {
                    true => InitFile::Zrun(file),
                    false => InitFile::Hf(hf::HfWeights::open(model, params, path)?),
                }
            }
        };
        Ok(InitWeights {
            params: params.iter().cloned().collect(),
            file,
        })
    }

    /// Parameter `name`'s values as bf16 bits where the file stores all of
    /// it in bf16, else `None` ([`WeightSource::read`] widens them).
    pub fn read_bf16(&self, name: &str) -> Result<Option<Vec<u16>>, CkptError> {
        match &self.file {
            InitFile::Zrun(f) => f.read_bf16(name),
            InitFile::Hf(w) => w.read_bf16(name),
        }
    }
}

impl WeightSource for InitWeights {
    fn tensor_count(&self) -> usize {
        self.params.len()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.params.get(name).cloned()
    }

    fn read(&self, name: &str) -> Result<Vec<f32>, CkptError> {
        match &self.file {
            InitFile::Zrun(f) => f.read(name),
            InitFile::Hf(w) => w.read(name),
        }
    }
}

/// Whether `file` holds the model's parameters under zrun's names (checked:
/// every parameter, its shape, nothing else but buffers), or is to be read
/// under Hugging Face's. Most of the parameters under zrun's names decide
/// it: zrun's own file, or a GPT-2 one published without `transformer.`,
/// whose names are zrun's. One or two names in common are not enough: a
/// LLaMA file's untied head is `lm_head.weight` under both.
fn zrun_named(file: &TensorFile, params: &[(String, Vec<usize>)]) -> Result<bool, CkptError> {
    let path = file.path();
    let have: HashMap<String, Vec<usize>> = file.tensors().into_iter().collect();
    let in_common = params.iter().filter(|(n, _)| have.contains_key(n)).count();
    if in_common * 2 <= params.len() {
        return Ok(false);
    }
    for (name, shape) in params {
        match have.get(name) {
            None => return Err(invalid(path, format!("no tensor {name}"))),
            Some(s) if s != shape => {
                return Err(invalid(
                    path,
                    format!("{name} has shape {s:?}, the model needs {shape:?}"),
                ))
            }
            Some(_) => {}
        }
    }
    let tensors = have.keys().filter(|n| !hf::is_buffer(n)).count();
    if tensors != params.len() {
        return Err(invalid(
            path,
            format!("{tensors} tensors, the model has {}", params.len()),
        ));
    }
    Ok(true)
}

/// Reads consolidated weights (an export).
pub fn read_weights(path: &Path) -> Result<Weights, CkptError> {
    let file = TensorFile::open(path)?;
    file.tensors()
        .into_iter()
        .map(|(name, shape)| {
            let values = file.read(&name)?;
            Ok((name, (shape, values)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ReduceLROnPlateau`'s rule, by hand: a rate of 1 halved (factor 0.5)
    /// after more than one bad validation (patience 1), an improvement being
    /// a loss below 0.9 of the best (threshold 0.1, `rel`), one validation
    /// of cooldown after each reduction, never below 0.3; a reduction under
    /// eps is not made.
    #[test]
    fn plateau_lowers_the_rate_as_reduce_lr_on_plateau_does() {
        let rule = PlateauSpec {
            factor: 0.5,
            patience: 1,
            threshold: 0.1,
            cooldown: 1,
            ..PlateauSpec::default()
        };
        let (min_lr, mut s) = (0.3, None);
        // (loss, best after, bad after, cooldown after, rate after)
        let want = [
            (10.0, Some(10.0), 0, 0, 1.0),    // the first is better than nothing
            (9.5, Some(10.0), 1, 0, 1.0),     // not below 9: bad
            (8.0, Some(8.0), 0, 0, 1.0),      // below 9: the best
            (7.5, Some(8.0), 1, 0, 1.0),      // not below 7.2
            (7.5, Some(8.0), 0, 1, 0.5),      // a second bad: halved, cooldown
            (7.9, Some(8.0), 0, 0, 0.5),      // bad, but the cooldown counts none
            (7.9, Some(8.0), 1, 0, 0.5),      // bad
            (7.9, Some(8.0), 0, 1, 0.3),      // halved to 0.25, floored at 0.3
            (7.9, Some(8.0), 0, 0, 0.3),      // cooldown
            (7.9, Some(8.0), 1, 0, 0.3),      // bad
            (7.9, Some(8.0), 0, 1, 0.3),      // at the floor: no reduction
            (f64::NAN, Some(8.0), 0, 0, 0.3), // NaN is no improvement
        ];
        for (i, &(loss, best, bad, cooldown, lr)) in want.iter().enumerate() {
            let after = PlateauState::after(s, loss, 1.0, min_lr, &rule);
            assert_eq!(
                (after.best, after.bad, after.cooldown, after.lr),
                (best, bad, cooldown, lr),
                "validation {i} ({loss})"
            );
            s = Some(after);
        }
        // `abs`: better means below the best less the threshold.
        let abs = PlateauSpec {
            threshold_mode: ThresholdMode::Abs,
            threshold: 0.5,
            patience: 0,
            ..PlateauSpec::default()
        };
        let s = PlateauState::after(None, 2.0, 1.0, 0.0, &abs);
        let s = PlateauState::after(Some(s), 1.6, 1.0, 0.0, &abs);
        assert_eq!((s.best, s.lr), (Some(2.0), 0.1), "1.6 is not below 1.5");
        let s = PlateauState::after(Some(s), 1.4, 1.0, 0.0, &abs);
        assert_eq!((s.best, s.bad, s.lr), (Some(1.4), 0, 0.1));
        // A reduction no larger than eps is not made.
        let tiny = PlateauSpec {
            patience: 0,
            eps: 0.6,
            factor: 0.5,
            ..PlateauSpec::default()
        };
        let s = PlateauState::after(None, 1.0, 1.0, 0.0, &tiny);
        let s = PlateauState::after(Some(s), 1.0, 1.0, 0.0, &tiny);
        assert_eq!(s.lr, 1.0, "0.5 less is under eps 0.6");
    }

    fn model() -> ModelSpec {
        serde_json::from_value(serde_json::json!({"d_model": 8, "n_heads": 2, "n_layers": 1, "vocab_size": 16, "seq_len": 4})).unwrap()
    }

    /// Writes a 2-rank checkpoint of one group of 10 elements padded to 32.
    fn write(dir: &Path) -> Manifest {
        write_validated(dir, None)
    }

    /// [`write`], its validation loss `val_loss`.
    fn write_validated(dir: &Path, val_loss: Option<f64>) -> Manifest {
        let full: Vec<f32> = (0..32)
            .map(|i| if i < 10 { i as f32 } else { 0.0 })
            .collect();
        let mut files = Vec::new();
        for r in 0..2 {
            let s = &full[r * 16..(r + 1) * 16];
            let slices = |_| Ok::<_, CkptError>(vec![s.to_vec(); 3]);
            files.push(write_shard(dir, r, &KINDS, &[16], slices).unwrap());
        }
        let m = Manifest {
            format: FORMAT,
            model: model(),
            world_size: 2,
            nodes: 1,
            stage: 3,
            dtype: Dtype::F32,
            step: 5,
            samples_consumed: 40,
            loss_scale: None,
            val_loss,
            early_stopping: None,
            plateau: None,
            optimizer: OptimizerKind::Adamw,
            groups: vec![GroupEntry {
                name: "g".into(),
                numel: 10,
                padded: 32,
                params: vec![ParamEntry {
                    name: "w".into(),
                    shape: vec![2, 5],
                    offset: 0,
                    tile: None,
                }],
            }],
            files,
            feedback: Vec::new(),
        };
        write_manifest(dir, &m).unwrap();
        m
    }

    #[test]
    fn round_trip_reassembles_and_exports() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(step_dir_name(5));
        write(&dir);
        let c = Checkpoint::open(&resolve(d.path()).unwrap()).unwrap();
        assert_eq!(
            c.full_group(0, "exp_avg").unwrap(),
            (0..10).map(|i| i as f32).collect::<Vec<_>>()
        );
        c.check_model(&model()).unwrap();
        let mut other = model();
        other.d_model = 16;
        assert!(c
            .check_model(&other)
            .unwrap_err()
            .to_string()
            .contains("d_model 8 in the checkpoint, 16 in the job"));
        let out = d.path().join("w.safetensors");
        assert_eq!(c.export(&out).unwrap(), 10);
        let w = read_weights(&out).unwrap();
        assert_eq!(w["w"].0, vec![2, 5]);
        assert_eq!(w["w"].1[9], 9.0);
    }

    /// A group that spans both ranks' slices comes back whole and without
    /// its padding, every group in model order.
    #[test]
    fn all_params_reassembles_groups_across_slices_without_padding() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(step_dir_name(5));
        let mut m = write(&dir);
        // A second group of 20 elements padded to 32: 16 on rank 0, 4 on rank 1.
        let full: Vec<f32> = (0..32)
            .map(|i| if i < 20 { 100.0 + i as f32 } else { -7.0 })
            .collect();
        let first: Vec<f32> = (0..32)
            .map(|i| if i < 10 { i as f32 } else { 0.0 })
            .collect();
        let mut files = Vec::new();
        for r in 0..2 {
            let own = |g: usize| {
                let v = if g == 0 { &first } else { &full };
                let s = v[r * 16..(r + 1) * 16].to_vec();
                Ok::<_, CkptError>(vec![s; 3])
            };
            files.push(write_shard(&dir, r, &KINDS, &[16, 16], own).unwrap());
        }
        m.files = files;
        m.groups.push(GroupEntry {
            name: "h".into(),
            numel: 20,
            padded: 32,
            params: vec![ParamEntry {
                name: "v".into(),
                shape: vec![20],
                offset: 0,
                tile: None,
            }],
        });
        write_manifest(&dir, &m).unwrap();
        let c = Checkpoint::open(&dir).unwrap();
        let want: Vec<Vec<f32>> = vec![(0..10).map(|i| i as f32).collect(), full[..20].to_vec()];
        assert_eq!(c.all_params().unwrap(), want);
    }

    /// Every field of the manifest is covered by its checksum: a changed
    /// step, data position, stage or offset is refused, not resumed from.
    /// One without a checksum (an older zrun's) still opens.
    #[test]
    fn a_changed_manifest_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(step_dir_name(5));
        write(&dir);
        let path = dir.join(MANIFEST);
        let written = std::fs::read_to_string(&path).unwrap();
        Checkpoint::open(&dir).unwrap();
        for (from, to) in [
            ("\"step\": 5", "\"step\": 4"),
            ("\"samples_consumed\": 40", "\"samples_consumed\": 41"),
            ("\"stage\": 3", "\"stage\": 2"),
            ("\"offset\": 0", "\"offset\": 1"),
            ("\"numel\": 10", "\"numel\": 11"),
        ] {
            assert!(written.contains(from), "{from}: {written}");
            std::fs::write(&path, written.replace(from, to)).unwrap();
            let e = Checkpoint::open(&dir).unwrap_err().to_string();
            assert!(e.contains("manifest.json: checksum mismatch"), "{to}: {e}");
        }
        // The checksum itself changed.
        let mut value: serde_json::Value = serde_json::from_str(&written).unwrap();
        let crc = value["crc32c"].as_u64().unwrap();
        value["crc32c"] = (crc ^ 1).into();
        std::fs::write(&path, value.to_string()).unwrap();
        assert!(Checkpoint::open(&dir).is_err());
        // Formatting is not content: the same manifest on one line opens.
        value["crc32c"] = crc.into();
        std::fs::write(&path, value.to_string()).unwrap();
        Checkpoint::open(&dir).unwrap();
        // The checksum covers the value, not `Manifest`'s fields: a field
        // that a later zrun writes (and this one ignores) is covered too,
        // and a checkpoint this zrun wrote stays readable by a later one
        // that knows more fields.
        let mut later = value.clone();
        later.as_object_mut().unwrap().remove("crc32c");
        later["written_by"] = "zrun 2".into();
        later["crc32c"] = manifest_crc(&later).unwrap().into();
        std::fs::write(&path, later.to_string()).unwrap();
        Checkpoint::open(&dir).unwrap();
        later["written_by"] = "zrun 3".into();
        std::fs::write(&path, later.to_string()).unwrap();
        assert!(Checkpoint::open(&dir).is_err());
        // An older zrun's manifest, without a checksum, opens as it is.
        value.as_object_mut().unwrap().remove("crc32c");
        std::fs::write(&path, value.to_string().replace("\"step\":5", "\"step\":4")).unwrap();
        assert_eq!(Checkpoint::open(&dir).unwrap().manifest.step, 4);
    }

    /// A GPT-2 file published without `transformer.` has zrun's names and
    /// the attention's mask buffers: read as zrun's, buffers left out (a
    /// LLaMA file whose only name in common is its head is read as Hugging
    /// Face's: `tests/llama.rs`).
    #[test]
    fn init_weights_are_told_apart_by_most_names() {
        let d = tempfile::tempdir().unwrap();
        let m = model();
        let params = m.param_shapes();
        let path = d.path().join("gpt2.safetensors");
        // The model's tensors and one more, every value 0.25.
        let write_with = |extra: (&str, Vec<usize>)| {
            let mut header = params.clone();
            header.push((extra.0.into(), extra.1));
            let mut w = StreamWriter::create(&path, &header, None).unwrap();
            for (_, shape) in &header {
                w.write(&vec![0.25; shape.iter().product::<usize>()])
                    .unwrap();
            }
            w.finish().unwrap();
        };
        write_with(("h.0.attn.bias", vec![1, 1, 4, 4]));
        let read = InitWeights::open(&path, &m, &params).unwrap();
        assert_eq!(read.tensor_count(), params.len());
        assert_eq!(read.shape("h.0.attn.bias"), None);
        for (name, shape) in &params {
            let want = vec![0.25; shape.iter().product::<usize>()];
            assert_eq!(read.shape(name).as_ref(), Some(shape), "{name}");
            assert_eq!(read.read(name).unwrap(), want, "{name}");
        }
        // A parameter of another shape under its own name: refused, named.
        let mut misshapen = params.clone();
        misshapen[1].1.reverse();
        let mut w = StreamWriter::create(&path, &misshapen, None).unwrap();
        for (_, shape) in &misshapen {
            w.write(&vec![0.25; shape.iter().product::<usize>()])
                .unwrap();
        }
        w.finish().unwrap();
        let e = InitWeights::open(&path, &m, &params).err().unwrap();
        let (name, shape) = &misshapen[1];
        assert!(
            e.to_string()
                .contains(&format!("{name} has shape {shape:?}")),
            "{e}"
        );
        // One tensor more that is no buffer: refused, counted.
        write_with(("h.0.extra", vec![2]));
        let e = InitWeights::open(&path, &m, &params).err().unwrap();
        assert!(
            e.to_string().contains(&format!(
                "{} tensors, the model has {}",
                params.len() + 1,
                params.len()
            )),
            "{e}"
        );
    }

    #[test]
    fn damage_is_reported_with_the_file() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(step_dir_name(5));
        write(&dir);
        let shard = dir.join(shard_name(1));
        let mut bytes = std::fs::read(&shard).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&shard, &bytes).unwrap();
        let e = Checkpoint::open(&dir).unwrap_err().to_string();
        assert!(
            e.contains("rank-00001.safetensors: checksum mismatch"),
            "{e}"
        );
        std::fs::remove_file(&shard).unwrap();
        let e = Checkpoint::open(&dir).unwrap_err().to_string();
        assert!(
            e.contains("rank-00001.safetensors: shard is missing"),
            "{e}"
        );
        // Any other failure to look is reported as itself, not as missing.
        std::os::unix::fs::symlink(&shard, &shard).unwrap();
        let e = Checkpoint::open(&dir).unwrap_err().to_string();
        assert!(
            e.contains("rank-00001.safetensors") && !e.contains("missing"),
            "{e}"
        );
    }

    #[test]
    fn unfinished_saves_are_never_resumed_and_pruning_keeps_the_newest() {
        let d = tempfile::tempdir().unwrap();
        for s in [1, 2, 3] {
            write(&d.path().join(step_dir_name(s)));
        }
        for s in [0, 4] {
            std::fs::create_dir_all(d.path().join(step_dir_name(s))).unwrap();
        }
        assert_eq!(resolve(d.path()).unwrap(), d.path().join(step_dir_name(3)));
        prune(d.path(), 2, false).unwrap();
        let left: Vec<_> = list(d.path())
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().to_string())
            .collect();
        assert_eq!(left, ["step-00000002", "step-00000003"]);
        // The unfinished step-4 is newer than the newest complete one: kept (it
        // may be in progress); the unfinished step-0 is older: removed.
        assert!(d.path().join(step_dir_name(4)).exists());
        assert!(!d.path().join(step_dir_name(0)).exists());
    }

    /// `keep_best`: the checkpoint of the lowest validation loss stays
    /// beside the newest `keep` (the earliest of equal ones; one without a
    /// validation loss is no candidate); without it, it goes.
    #[test]
    fn pruning_can_keep_the_best_validated_checkpoint() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        let losses = [Some(3.0), Some(1.0), None, Some(1.0), Some(2.5)];
        for (s, loss) in losses.iter().enumerate() {
            write_validated(&root.join(step_dir_name(s as u64 + 1)), *loss);
        }
        assert_eq!(best(root), Some((root.join(step_dir_name(2)), 1.0)));
        let left = || -> Vec<String> {
            list(root)
                .iter()
                .map(|p| p.file_name().unwrap().to_string_lossy().to_string())
                .collect()
        };
        prune(root, 1, true).unwrap();
        assert_eq!(left(), ["step-00000002", "step-00000005"]);
        // Kept again at the next prune; gone without keep_best.
        prune(root, 1, true).unwrap();
        assert_eq!(left(), ["step-00000002", "step-00000005"]);
        prune(root, 1, false).unwrap();
        assert_eq!(left(), ["step-00000005"]);
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(best(empty.path()), None);
    }

    /// Only `step-*` directories without a manifest go, old or new; complete
    /// checkpoints, a file named like a step and other directories stay.
    #[test]
    fn remove_unfinished_takes_only_manifestless_step_directories() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        write(&root.join(step_dir_name(5)));
        for s in [2, 7] {
            std::fs::create_dir_all(root.join(step_dir_name(s))).unwrap();
        }
        std::fs::write(root.join(step_dir_name(9)), b"a file").unwrap();
        std::fs::create_dir_all(root.join("notes")).unwrap();
        let removed = remove_unfinished(root).unwrap();
        assert_eq!(
            removed,
            [root.join(step_dir_name(2)), root.join(step_dir_name(7))]
        );
        let mut left: Vec<String> = std::fs::read_dir(root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["notes", "step-00000005", "step-00000009"]);
        assert!(root.join(step_dir_name(5)).join(MANIFEST).is_file());
        assert_eq!(remove_unfinished(root).unwrap(), Vec::<PathBuf>::new());
    }

    #[test]
    fn a_failed_atomic_write_leaves_no_temporary_file() {
        let d = tempfile::tempdir().unwrap();
        // The rename fails: the target is a directory that is not empty.
        let target = d.path().join("shard.safetensors");
        std::fs::create_dir_all(target.join("occupied")).unwrap();
        assert!(write_atomic(&target, b"bytes").is_err());
        assert!(!target.with_extension("tmp").exists());
        write_atomic(&d.path().join("ok.safetensors"), b"bytes").unwrap();
        assert!(!d.path().join("ok.tmp").exists());
    }
}
