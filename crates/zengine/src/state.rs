//! The engine's state in and out: checkpoint shards, loading a checkpoint written
//! at any world size and stage, and initial weights from an export.
//!
//! Loading reassembles each group's whole flat buffer from the checkpoint and
//! keeps what this rank's stage holds (whole, or its slice at the new world size).
//! That costs one group's full buffers of transient memory at a time. A
//! checkpoint whose groups differ only by `model.tile_size` is read parameter
//! by parameter under its names instead (a tiled linear's columns cut from,
//! or put back into, the whole weight), so it moves freely between tiled and
//! untiled runs.

use std::collections::BTreeMap;

use zckpt::{Assembler, Checkpoint, GroupEntry, LossScaleState, ParamEntry, ParamReader};

use crate::engine::Engine;
use crate::error::EngineError;
use crate::offload::OptimizerState;

impl Engine {
    /// The layout of every group, for the manifest.
    pub fn manifest_groups(&self) -> Vec<GroupEntry> {
        self.groups
            .iter()
            .map(|g| GroupEntry {
                name: g.layout.name.clone(),
                numel: g.layout.numel,
                padded: g.layout.padded,
                params: g
                    .layout
                    .params
                    .iter()
                    .map(|p| ParamEntry {
                        name: p.name.clone(),
                        shape: p.shape.clone(),
                        offset: p.range.start,
                        tile: p.tile,
                    })
                    .collect(),
            })
            .collect()
    }

    /// The buffers a checkpoint shard of this run holds per group
    /// ([`zckpt::kinds`] of its update rule).
    pub fn checkpoint_kinds(&self) -> &'static [&'static str] {
        zckpt::kinds(self.spec.train.optimizer.kind)
    }

    /// This rank's slices of group `gi`'s f32 params (the master copy under
    /// mixed precision), exp_avg and (AdamW) exp_avg_sq, as a checkpoint
    /// shard stores them ([`Engine::checkpoint_kinds`]; read from swap where
    /// offloaded).
    pub fn own_slice(&self, gi: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        let g = &self.groups[gi];
        let own = g.layout.slice(self.comm.rank());
        let own_of = |region: Vec<f32>| {
            if region.len() == g.layout.padded {
                region[own.clone()].to_vec()
            } else {
                region
            }
        };
        let [p, m, v] = self.updated_state(gi)?;
        let mut slices = vec![own_of(p), own_of(m)];
        if self.spec.train.optimizer.kind.second_moment() {
            slices.push(own_of(v));
        }
        Ok(slices)
    }

    /// The f32 parameters of the region this rank updates in group `gi` (the
    /// master copy under mixed precision), from memory or swap.
    pub(crate) fn updated_params(&self, gi: usize) -> Result<Vec<f32>, EngineError> {
        #[cfg(feature = "cuda")]
        if let Some(p) = self.gpu_params(gi)? {
            return Ok(p);
        }
        let (rank, stage) = (self.comm.rank(), self.stage);
        let g = &self.groups[gi];
        let Some(o) = &self.offload else {
            return Ok(g.updated_params(rank, stage));
        };
        if self.half.is_some() {
            if let Some(OptimizerState {
                master: Some(master),
                ..
            }) = o.read_optimizer(gi)?
            {
                return Ok(master);
            }
        } else if let Some((h, words)) = o.read_params(gi) {
            return Ok(h.wait()?.f32s()[..words].to_vec());
        }
        Ok(g.updated_params(rank, stage))
    }

    /// Group `gi`'s updated region: [f32 parameters, exp_avg, exp_avg_sq
    /// (empty under Lion)].
    fn updated_state(&self, gi: usize) -> Result<[Vec<f32>; 3], EngineError> {
        #[cfg(feature = "cuda")]
        if let Some(state) = self.gpu_state(gi)? {
            return Ok(state);
        }
        let g = &self.groups[gi];
        let moments = match self.offload.as_ref().map(|o| o.read_optimizer(gi)) {
            Some(read) => read?.map(|s| (s.exp_avg, s.exp_avg_sq)),
            None => None,
        };
        let second = self.spec.train.optimizer.kind.second_moment();
        let (m, v) =
            moments.unwrap_or_else(|| g.checkpoint_moments(self.comm.rank(), self.stage, second));
        Ok([self.updated_params(gi)?, m, v])
    }

    /// Moves group `gi`'s offloaded state from memory to its swap files after
    /// it was installed.
    fn stash(&mut self, gi: usize) -> Result<(), EngineError> {
        if let Some(o) = &self.offload {
            o.stash(gi, &mut self.groups[gi], false)?;
        }
        Ok(())
    }

    /// Loads a checkpoint written by any number of ranks at any stage and dtype
    /// (its f32 parameters become the master copy; the working copy is rounded
    /// from them, as after an update), tiled or not, by this run's update rule.
    pub fn load(&mut self, ckpt: &Checkpoint) -> Result<(), EngineError> {
        ckpt.check_optimizer(self.spec.train.optimizer.kind)?;
        // The GPU's resident state is made again from the loaded buffers.
        #[cfg(feature = "cuda")]
        {
            self.gpu_resident = None;
        }
        let mine = self.manifest_groups();
        let theirs = &ckpt.manifest.groups;
        let same = mine.len() == theirs.len()
            && mine
                .iter()
                .zip(theirs)
                .all(|(a, b)| a.name == b.name && a.numel == b.numel && a.params == b.params);
        if same {
            for gi in 0..self.groups.len() {
                let padded = self.groups[gi].layout.padded;
                let full = |kind: &str| -> Result<Vec<f32>, EngineError> {
                    let mut v = ckpt.full_group(gi, kind)?;
                    v.resize(padded, 0.0);
                    Ok(v)
                };
                let bufs: Result<Vec<_>, _> =
                    self.checkpoint_kinds().iter().map(|k| full(k)).collect();
                self.install_group(gi, bufs?)?;
            }
        } else {
            self.load_by_name(ckpt, &mine)?;
        }
        self.restore_feedback(ckpt)?;
        let state = ckpt.manifest.loss_scale.as_ref();
        self.step = ckpt.manifest.step;
        self.updates = self.step - state.map_or(0, |s| s.skipped);
        if let Some(scaler) = &mut self.scaler {
            if let Some(s) = state {
                // A static scale is the job's, whatever the checkpoint's was.
                if scaler.config.static_scale.is_none() {
                    scaler.scale = s.scale;
                }
                scaler.hysteresis = s.hysteresis;
                scaler.last_overflow = s.last_overflow;
                scaler.skipped = s.skipped;
            }
        }
        self.params_changed();
        Ok(())
    }

    /// Installs group `gi`'s full (padded) buffers of
    /// [`Engine::checkpoint_kinds`] (params, exp_avg and, AdamW, exp_avg_sq)
    /// as this rank's stage keeps them.
    fn install_group(&mut self, gi: usize, bufs: Vec<Vec<f32>>) -> Result<(), EngineError> {
        let (rank, stage, half) = (self.comm.rank(), self.stage, self.half);
        let mut bufs = bufs.into_iter();
        let mut next = || bufs.next().unwrap_or_default();
        let (params, m, v) = (next(), next(), next());
        let g = &mut self.groups[gi];
        g.install(params, rank, stage, half);
        g.install_moments(m, v, rank, stage);
        self.stash(gi)
    }

    /// [`Engine::load`] of a checkpoint laid out in other groups (another
    /// `model.tile_size`): every parameter read whole by name and cut as this
    /// model's groups hold it. An error unless both have the same parameters.
    fn load_by_name(&mut self, ckpt: &Checkpoint, mine: &[GroupEntry]) -> Result<(), EngineError> {
        let mismatch = || EngineError::LayoutMismatch {
            dir: ckpt.dir.clone(),
        };
        let mut readers: Vec<ParamReader> = (self.checkpoint_kinds().iter())
            .map(|kind| ParamReader::new(ckpt, kind))
            .collect();
        let theirs = readers[0].shapes();
        let ours: BTreeMap<String, Vec<usize>> = mine
            .iter()
            .flat_map(|g| &g.params)
            .map(|p| (p.name.clone(), zckpt::whole_shape(p)))
            .collect();
        if ours.len() != theirs.len() || ours.iter().any(|(n, s)| theirs.get(n) != Some(s)) {
            return Err(mismatch());
        }
        for (gi, entry) in mine.iter().enumerate() {
            let padded = self.groups[gi].layout.padded;
            let mut bufs = vec![vec![0f32; padded]; readers.len()];
            for (buf, reader) in bufs.iter_mut().zip(&mut readers) {
                for p in &entry.params {
                    let (_, whole) = reader.read(&p.name)?;
                    let n: usize = p.shape.iter().product();
                    let piece = match p.tile {
                        None => whole,
                        Some(t) => t.cut(&whole, p.shape.last().copied().unwrap_or(1)),
                    };
                    buf[p.offset..p.offset + n].copy_from_slice(&piece);
                }
            }
            self.install_group(gi, bufs)?;
        }
        Ok(())
    }

    /// Every parameter whole (tiles put back together) by name, f32 (the
    /// master copy under mixed precision). A collective: every rank must call
    /// it.
    pub fn named_params(&self) -> Result<zckpt::Weights, EngineError> {
        let mut assembler = Assembler::default();
        let mut out = zckpt::Weights::new();
        for (entry, flat) in self.manifest_groups().iter().zip(self.full_params()?) {
            let done = assembler
                .add(entry, &flat)
                .map_err(|problem| EngineError::Tiling { problem })?;
            out.extend(done.into_iter().map(|(n, shape, v)| (n, (shape, v))));
        }
        assembler
            .finish()
            .map_err(|problem| EngineError::Tiling { problem })?;
        Ok(out)
    }

    /// LoCo's kept errors, as a checkpoint stores them: each bucket's
    /// state ([`zcomm::ErrorFeedback::to_bytes`]) after its length (8
    /// bytes, little-endian), in bucket order; `None` without LoCo. Read
    /// between steps (no reduction in flight).
    pub fn feedback_state(&self) -> Option<Vec<u8>> {
        if self.reducer.feedback.is_empty() {
            return None;
        }
        let mut out = Vec::new();
        for f in &self.reducer.feedback {
            let bytes = f.lock().unwrap_or_else(|e| e.into_inner()).to_bytes();
            out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            out.extend_from_slice(&bytes);
        }
        Some(out)
    }

    /// Takes LoCo's kept errors from `ckpt` where it holds them for this
    /// rank of a run like this one: the same world size, stage and
    /// buckets (the errors sit at positions of the rank-major buckets).
    /// Elsewhere they start from zero, as they do every `reset_T`
    /// reductions anyway.
    fn restore_feedback(&mut self, ckpt: &Checkpoint) -> Result<(), EngineError> {
        let m = &ckpt.manifest;
        let (world, rank) = (self.comm.world_size(), self.comm.rank());
        if self.reducer.feedback.is_empty()
            || m.world_size != world
            || m.stage != self.stage.number()
        {
            return Ok(());
        }
        let Some(bytes) = ckpt.feedback(rank)? else {
            return Ok(());
        };
        let mut states = Vec::new();
        let mut rest = bytes.as_slice();
        while let Some((len, tail)) = rest.split_first_chunk::<8>() {
            let len = usize::try_from(u64::from_le_bytes(*len)).unwrap_or(usize::MAX);
            let Some((state, tail)) = tail.split_at_checked(len) else {
                return Ok(());
            };
            states.push(state);
            rest = tail;
        }
        if !rest.is_empty() || states.len() != self.reducer.feedback.len() {
            return Ok(());
        }
        for (f, state) in self.reducer.feedback.iter().zip(states) {
            let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
            if f.restore(state).is_none() {
                f.reset();
            }
        }
        Ok(())
    }

    /// f16's loss-scaler state, as a manifest stores it.
    pub fn loss_scale_state(&self) -> Option<LossScaleState> {
        self.scaler.as_ref().map(|s| LossScaleState {
            scale: s.scale,
            hysteresis: s.hysteresis,
            last_overflow: s.last_overflow,
            skipped: s.skipped,
        })
    }

    /// Replaces the parameters with consolidated weights by name (an export,
    /// Hugging Face weights), read a parameter at a time: a group is put
    /// together, installed and dropped before the next, so the worker never
    /// holds more of the file than one group and one parameter.
    pub fn load_weights(&mut self, weights: &impl zckpt::WeightSource) -> Result<(), EngineError> {
        // The GPU's resident state is made again from the loaded buffers
        // (this runs before training: the moments are the host's zeros).
        #[cfg(feature = "cuda")]
        {
            self.gpu_resident = None;
        }
        let rank = self.comm.rank();
        let (stage, half) = (self.stage, self.half);
        let mut used = 0;
        // A tiled parameter's tiles are consecutive groups: read once.
        let mut last: Option<(String, Vec<f32>)> = None;
        for gi in 0..self.groups.len() {
            let g = &mut self.groups[gi];
            let mut full = vec![0f32; g.layout.padded];
            for slot in &g.layout.params {
                let shape = weights
                    .shape(&slot.name)
                    .ok_or_else(|| EngineError::InitWeights {
                        problem: format!("no tensor `{}`", slot.name),
                    })?;
                let want = slot
                    .tile
                    .map_or_else(|| slot.shape.clone(), |t| t.whole_shape(&slot.shape));
                if shape != want {
                    return Err(EngineError::InitWeights {
                        problem: format!(
                            "`{}` has shape {shape:?}, the model needs {want:?}",
                            slot.name
                        ),
                    });
                }
                if last.as_ref().is_none_or(|(n, _)| *n != slot.name) {
                    last = Some((slot.name.clone(), weights.read(&slot.name)?));
                }
                let values = &last.as_ref().expect("just read").1;
                match slot.tile {
                    None => full[slot.range.clone()].copy_from_slice(values),
                    Some(t) => full[slot.range.clone()]
                        .copy_from_slice(&t.cut(values, slot.shape.last().copied().unwrap_or(1))),
                }
                // A tiled parameter counts once, with its first tile.
                used += usize::from(slot.tile.is_none_or(|t| t.start == 0));
            }
            g.install(full, rank, stage, half);
            self.stash(gi)?;
        }
        if used != weights.tensor_count() {
            return Err(EngineError::InitWeights {
                problem: format!(
                    "the file has {} tensors, the model {used}",
                    weights.tensor_count()
                ),
            });
        }
        self.params_changed();
        Ok(())
    }
}
