//! Whole parameters out of group buffers: a model trained with
//! `model.tile_size` keeps the tiled linears' column tiles in groups of their
//! own, and everything users see (exports, loading into another layout) deals
//! in whole parameters under GPT-2's names.
//!
//! [`Assembler`] takes groups in order and hands back each parameter once all
//! its pieces are there ([`whole_params`] says in which order, so an export
//! can write its header first). [`ParamReader`] reads one parameter of a
//! checkpoint by name, from however many groups hold it, one group in memory
//! at a time.

use std::collections::HashMap;

use crate::{Checkpoint, CkptError, GroupEntry, ParamEntry};

/// A whole parameter: name, shape, values.
pub type WholeParam = (String, Vec<usize>, Vec<f32>);

/// The whole shape of the parameter `p` is (a piece of).
pub fn whole_shape(p: &ParamEntry) -> Vec<usize> {
    p.tile
        .map_or_else(|| p.shape.clone(), |t| t.whole_shape(&p.shape))
}

fn columns(p: &ParamEntry) -> usize {
    p.shape.last().copied().unwrap_or(1)
}

/// Parameters put together from their groups' flat buffers.
#[derive(Default)]
pub struct Assembler {
    /// Tiled parameters still missing columns: shape, values, columns filled.
    pending: HashMap<String, (Vec<usize>, Vec<f32>, usize)>,
}

impl Assembler {
    /// Takes group `entry`'s flat values (unpadded); returns the parameters
    /// this group completes, in its order.
    pub fn add(&mut self, entry: &GroupEntry, flat: &[f32]) -> Result<Vec<WholeParam>, String> {
        let mut done = Vec::new();
        for p in &entry.params {
            let n: usize = p.shape.iter().product();
            let values = flat
                .get(p.offset..p.offset + n)
                .ok_or_else(|| format!("{} lies beyond group {}", p.name, entry.name))?;
            let Some(tile) = p.tile else {
                done.push((p.name.clone(), p.shape.clone(), values.to_vec()));
                continue;
            };
            let shape = whole_shape(p);
            let (_, whole, filled) = self.pending.entry(p.name.clone()).or_insert_with(|| {
                let len = shape.iter().product();
                (shape.clone(), vec![0f32; len], 0)
            });
            if tile.start + columns(p) > tile.of {
                return Err(format!("a tile of {} lies beyond its columns", p.name));
            }
            tile.put(values, columns(p), whole);
            *filled += columns(p);
            if *filled == tile.of {
                let (shape, whole, _) = self.pending.remove(&p.name).expect("inserted above");
                done.push((p.name.clone(), shape, whole));
            }
        }
        Ok(done)
    }

    /// Checks that no parameter was left incomplete.
    pub fn finish(self) -> Result<(), String> {
        match self.pending.keys().next() {
            Some(name) => Err(format!("{name} is missing some of its column tiles")),
            None => Ok(()),
        }
    }
}

/// Every whole parameter's name and shape, in the order an [`Assembler`] fed
/// `groups` in order completes them.
pub fn whole_params(groups: &[GroupEntry]) -> Vec<(String, Vec<usize>)> {
    let mut filled: HashMap<&str, usize> = HashMap::new();
    let mut out = Vec::new();
    for p in groups.iter().flat_map(|g| &g.params) {
        match p.tile {
            None => out.push((p.name.clone(), p.shape.clone())),
            Some(t) => {
                let f = filled.entry(&p.name).or_default();
                *f += columns(p);
                if *f == t.of {
                    out.push((p.name.clone(), whole_shape(p)));
                }
            }
        }
    }
    out
}

/// Reads whole parameters of one kind (`params`, `exp_avg`, `exp_avg_sq`)
/// from a checkpoint by name, keeping the last group read.
pub struct ParamReader<'a> {
    ckpt: &'a Checkpoint,
    kind: &'a str,
    /// Where each parameter's pieces are: (group, entry).
    index: HashMap<String, Vec<(usize, ParamEntry)>>,
    cached: Option<(usize, Vec<f32>)>,
}

impl<'a> ParamReader<'a> {
    /// A reader of `kind` from `ckpt`.
    pub fn new(ckpt: &'a Checkpoint, kind: &'a str) -> ParamReader<'a> {
        let mut index: HashMap<String, Vec<(usize, ParamEntry)>> = HashMap::new();
        for (g, entry) in ckpt.manifest.groups.iter().enumerate() {
            for p in &entry.params {
                index
                    .entry(p.name.clone())
                    .or_default()
                    .push((g, p.clone()));
            }
        }
        ParamReader {
            ckpt,
            kind,
            index,
            cached: None,
        }
    }

    /// The whole shape of every parameter by name.
    pub fn shapes(&self) -> HashMap<String, Vec<usize>> {
        self.index
            .iter()
            .map(|(name, pieces)| (name.clone(), whole_shape(&pieces[0].1)))
            .collect()
    }

    /// Parameter `name`, whole: its shape and values.
    pub fn read(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>), CkptError> {
        let pieces = self.index.get(name).cloned().ok_or_else(|| {
            crate::invalid(
                &self.ckpt.dir,
                format!("the checkpoint has no parameter {name}"),
            )
        })?;
        let shape = whole_shape(&pieces[0].1);
        let mut whole = vec![0f32; shape.iter().product()];
        for (g, p) in &pieces {
            if self.cached.as_ref().is_none_or(|(c, _)| c != g) {
                self.cached = Some((*g, self.ckpt.full_group(*g, self.kind)?));
            }
            let flat = &self.cached.as_ref().expect("just read").1;
            let n: usize = p.shape.iter().product();
            let values = flat.get(p.offset..p.offset + n).ok_or_else(|| {
                crate::invalid(&self.ckpt.dir, format!("{name} lies beyond its group"))
            })?;
            match p.tile {
                None => whole.copy_from_slice(values),
                Some(t) => t.put(values, columns(p), &mut whole),
            }
        }
        Ok((shape, whole))
    }
}
