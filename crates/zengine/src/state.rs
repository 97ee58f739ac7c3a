//! The engine's state in and out: checkpoint shards, loading a checkpoint written
//! at any world size and stage, and initial weights from an export.
//!
//! Loading reassembles each group's whole flat buffer from the checkpoint and
//! keeps what this rank's stage holds (whole, or its slice at the new world size).
//! That costs one group's full buffers of transient memory at a time.

use zckpt::{Checkpoint, GroupEntry, ParamEntry};

use crate::engine::{Engine, EngineError};

fn ckpt_err(e: zckpt::CkptError) -> EngineError {
    EngineError::Usage(e.to_string())
}

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
                    })
                    .collect(),
            })
            .collect()
    }

    /// This rank's slices of every group's params, exp_avg and exp_avg_sq, as a
    /// checkpoint shard stores them.
    pub fn own_slices(&self) -> Vec<[Vec<f32>; 3]> {
        let rank = self.comm.rank();
        self.groups
            .iter()
            .map(|g| {
                let own = g.layout.slice(rank);
                let p = if g.partitioned {
                    g.params.clone()
                } else {
                    g.params[own.clone()].to_vec()
                };
                let moment = |m: &Vec<f32>| {
                    if self.stage == 0 {
                        m[own.clone()].to_vec()
                    } else {
                        m.clone()
                    }
                };
                [p, moment(&g.exp_avg), moment(&g.exp_avg_sq)]
            })
            .collect()
    }

    /// Loads a checkpoint written by any number of ranks at any stage.
    pub fn load(&mut self, ckpt: &Checkpoint) -> Result<(), EngineError> {
        let mine = self.manifest_groups();
        let theirs = &ckpt.manifest.groups;
        let same = mine.len() == theirs.len()
            && mine
                .iter()
                .zip(theirs)
                .all(|(a, b)| a.name == b.name && a.numel == b.numel && a.params == b.params);
        if !same {
            return Err(EngineError::Usage(format!(
                "{}: the checkpoint's parameter layout differs from the model's",
                ckpt.dir.display()
            )));
        }
        let rank = self.comm.rank();
        let stage = self.stage;
        for gi in 0..self.groups.len() {
            let padded = self.groups[gi].layout.padded;
            let full = |kind: &str| -> Result<Vec<f32>, EngineError> {
                let mut v = ckpt.full_group(gi, kind).map_err(ckpt_err)?;
                v.resize(padded, 0.0);
                Ok(v)
            };
            let g = &self.groups[gi];
            let own = g.layout.slice(rank);
            let params = full("params")?;
            let m = full("exp_avg")?;
            let v = full("exp_avg_sq")?;
            let partitioned = g.partitioned;
            let g = &mut self.groups[gi];
            g.params = if partitioned {
                params[own.clone()].to_vec()
            } else {
                params
            };
            if stage == 0 {
                g.exp_avg = m;
                g.exp_avg_sq = v;
            } else {
                g.exp_avg = m[own.clone()].to_vec();
                g.exp_avg_sq = v[own].to_vec();
            }
        }
        self.step = ckpt.manifest.step;
        self.vars.iter_mut().for_each(|v| *v = None);
        Ok(())
    }

    /// Replaces the parameters with consolidated weights by name (an export).
    pub fn load_weights(&mut self, weights: &zckpt::Weights) -> Result<(), EngineError> {
        let rank = self.comm.rank();
        let mut used = 0;
        for g in &mut self.groups {
            let mut full = vec![0f32; g.layout.padded];
            for slot in &g.layout.params {
                let (shape, values) = weights.get(&slot.name).ok_or_else(|| {
                    EngineError::Usage(format!("model.init_from: no tensor `{}`", slot.name))
                })?;
                if shape != &slot.shape {
                    return Err(EngineError::Usage(format!(
                        "model.init_from: `{}` has shape {shape:?}, the model needs {:?}",
                        slot.name, slot.shape
                    )));
                }
                full[slot.range.clone()].copy_from_slice(values);
                used += 1;
            }
            g.params = if g.partitioned {
                full[g.layout.slice(rank)].to_vec()
            } else {
                full
            };
        }
        if used != weights.len() {
            return Err(EngineError::Usage(format!(
                "model.init_from: the file has {} tensors, the model {used}",
                weights.len()
            )));
        }
        self.vars.iter_mut().for_each(|v| *v = None);
        Ok(())
    }
}
