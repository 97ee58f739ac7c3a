//! `flops_profiler`: one step's module times ([`zmodel::profile`]) with
//! each module's parameters and model FLOPs, as the tree that zrun prints.
//!
//! A module's FLOPs are its share of [`Engine::flops_per_token_at`]: 2 a
//! parameter a token forward, 2 backward for the input gradient where
//! backward reaches its block and 2 more where the parameter trains;
//! attention's scores and their product with v 4·h·hd·T forward and twice
//! that backward; the output matrix 2·V·d forward and 4 backward (2 when
//! frozen). So the modules' FLOPs add up to the metrics line's, and a
//! module's FLOP rate compares with the step's `tflops`.

use std::collections::HashMap;

use zmodel::profile::{Module, Part, Pass, Times};
use zmodel::{BlockLinear, BlockNorm};
use zproto::ModuleProfile;

use crate::engine::Engine;

/// A module's parameters: all of them and those that train.
#[derive(Debug, Default, Clone, Copy)]
struct Params {
    all: u64,
    trained: u64,
}

/// Where a parameter belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Owner {
    Embedding,
    Part(usize, Part),
    Head,
}

impl Engine {
    /// The tree of one step's [`zmodel::profile`] times: the model first
    /// (its forward and backward the step's, `forward_ms` and
    /// `backward_ms`, gathers waited for included), then the embedding,
    /// each block followed by its parts (the attention's and the MLP's
    /// under a row of their own), and the head. `tokens`: those the step
    /// trained on this rank; `seq_len`: the tokens of each sequence.
    pub fn flops_profile(
        &self,
        times: &Times,
        tokens: u64,
        seq_len: usize,
        (forward_ms, backward_ms): (f64, f64),
    ) -> Vec<ModuleProfile> {
        let m = self.model.config();
        let per_token = |(fwd, bwd): (f64, f64)| (fwd * tokens as f64, bwd * tokens as f64);
        let ms = |module, part, pass| {
            times
                .get(&(module, part, pass))
                .map_or(0.0, |d| d.as_secs_f64() * 1e3)
        };
        let row = |path: String, params: Params, flops: (f64, f64), module, part| ModuleProfile {
            path,
            params: params.all,
            forward_flops: flops.0,
            backward_flops: flops.1,
            forward_ms: ms(module, part, Pass::Forward),
            backward_ms: ms(module, part, Pass::Backward),
            recompute_ms: ms(module, part, Pass::Recompute),
        };
        let params = self.params_by_owner();
        let of = |o: Owner| params.get(&o).copied().unwrap_or_default();
        let keys = m.window().map_or(seq_len, |w| w.min(seq_len));
        let attention = 4.0 * (m.attn_width() * keys) as f64;

        let mut out = vec![row(
            "embedding".into(),
            of(Owner::Embedding),
            (0.0, 0.0),
            Module::Embedding,
            None,
        )];
        for i in 0..m.n_layers {
            let reached = i + 1 >= self.backward_reach;
            let block = Module::Block(i);
            let prefix = m.block_prefix(i);
            // The parts the block ran, each with the group it is in.
            let mut leaves: Vec<(Option<&str>, ModuleProfile)> = vec![];
            for (part, group) in self.block_parts() {
                let ran = [Pass::Forward, Pass::Backward, Pass::Recompute]
                    .iter()
                    .any(|&pass| times.contains_key(&(block, Some(part), pass)));
                if !ran {
                    continue;
                }
                let p = of(Owner::Part(i, part));
                let flops = match (part, reached) {
                    (Part::Attention, true) => (attention, 2.0 * attention),
                    (Part::Attention, false) => (attention, 0.0),
                    (_, true) => (2.0 * p.all as f64, 2.0 * (p.all + p.trained) as f64),
                    (_, false) => (2.0 * p.all as f64, 0.0),
                };
                let path = format!("{prefix}.{}", self.part_name(part));
                leaves.push((group, row(path, p, per_token(flops), block, Some(part))));
            }
            let mut whole = row(prefix.clone(), Params::default(), (0.0, 0.0), block, None);
            for (_, leaf) in &leaves {
                whole.params += leaf.params;
                whole.forward_flops += leaf.forward_flops;
                whole.backward_flops += leaf.backward_flops;
            }
            out.push(whole);
            let mut open: Option<(&str, usize)> = None;
            for (group, leaf) in leaves {
                match group {
                    Some(g) if open.map(|(name, _)| name) == Some(g) => {}
                    Some(g) => {
                        open = Some((g, out.len()));
                        out.push(ModuleProfile::empty(format!("{prefix}.{g}")));
                    }
                    None => open = None,
                }
                if let Some((_, at)) = open {
                    add_into(&mut out[at], &leaf);
                }
                out.push(leaf);
            }
        }
        let (v, d) = (m.vocab_size as f64, m.d_model as f64);
        let out_bwd = if self.model.frozen_output() { 2.0 } else { 4.0 };
        let head_flops = per_token((2.0 * v * d, out_bwd * v * d));
        out.push(row(
            "head".into(),
            of(Owner::Head),
            head_flops,
            Module::Head,
            None,
        ));

        // The model's row: the step's phases, and its modules' sums (the
        // top-level rows': the embedding, the blocks, the head).
        let top = out.iter().filter(|r| r.depth() == 1);
        let mut model = ModuleProfile {
            forward_ms,
            backward_ms,
            ..ModuleProfile::empty("model".into())
        };
        for r in top {
            model.params += r.params;
            model.forward_flops += r.forward_flops;
            model.backward_flops += r.backward_flops;
            model.recompute_ms += r.recompute_ms;
        }
        out.insert(0, model);
        out
    }

    /// A block's parts in forward order, each with the group it is in
    /// (`attn`, `mlp`; none for the norms).
    fn block_parts(&self) -> Vec<(Part, Option<&'static str>)> {
        let m = self.model.config();
        let group = |l: BlockLinear| self.model.linear_name(l).split('.').next();
        let (attn, mlp) = (group(BlockLinear::Qkv), group(BlockLinear::MlpIn));
        let mut parts = vec![(Part::Norm1, None), (Part::Qkv, attn)];
        if m.qk_normed() {
            parts.push((Part::QkNorm, attn));
        }
        if !m.learned_positions() {
            parts.push((Part::Rotary, attn));
        }
        parts.extend([
            (Part::Attention, attn),
            (Part::AttnOut, attn),
            (Part::Norm2, None),
            (Part::MlpIn, mlp),
            (Part::Activation, mlp),
            (Part::MlpOut, mlp),
        ]);
        parts
    }

    /// A part's name inside its block: the model's own parameter names
    /// where it has parameters (`attn.c_attn`, `ln_2`), else the name
    /// Hugging Face gives the module (`mlp.act`, `self_attn.rotary_emb`).
    fn part_name(&self, part: Part) -> String {
        let model = &self.model;
        let linear = |l| model.linear_name(l).to_string();
        let attn = model.linear_name(BlockLinear::Qkv).split('.').next();
        let attn = attn.unwrap_or("attn");
        match part {
            Part::Norm1 => model.norm_name(BlockNorm::Norm1).into(),
            Part::Norm2 => model.norm_name(BlockNorm::Norm2).into(),
            Part::Qkv => linear(BlockLinear::Qkv),
            Part::AttnOut => linear(BlockLinear::AttnOut),
            Part::MlpIn => linear(BlockLinear::MlpIn),
            Part::MlpOut => linear(BlockLinear::MlpOut),
            Part::QkNorm => format!("{attn}.qk_norm"),
            Part::Rotary => format!("{attn}.rotary_emb"),
            Part::Attention => format!("{attn}.attention"),
            Part::Activation if !model.config().learned_positions() => "mlp.act_fn".into(),
            Part::Activation => "mlp.act".into(),
        }
    }

    /// Every parameter's elements (tiles summed into their parameter) by
    /// the module that reads it.
    fn params_by_owner(&self) -> HashMap<Owner, Params> {
        let m = self.model.config();
        let named = |rest: &str, name: &str| {
            rest.strip_prefix(name)
                .is_some_and(|after| after.starts_with('.'))
        };
        let mut out: HashMap<Owner, Params> = HashMap::new();
        for p in self.groups.iter().flat_map(|g| &g.layout.params) {
            let owner = match m.block_of(&p.name) {
                Some((i, rest)) => {
                    let part = [
                        (Part::Norm1, self.model.norm_name(BlockNorm::Norm1)),
                        (Part::Norm2, self.model.norm_name(BlockNorm::Norm2)),
                        (Part::QkNorm, self.model.norm_name(BlockNorm::Q)),
                        (Part::QkNorm, self.model.norm_name(BlockNorm::K)),
                        (Part::Qkv, self.model.linear_name(BlockLinear::Qkv)),
                        (Part::AttnOut, self.model.linear_name(BlockLinear::AttnOut)),
                        (Part::MlpIn, self.model.linear_name(BlockLinear::MlpIn)),
                        (Part::MlpOut, self.model.linear_name(BlockLinear::MlpOut)),
                    ]
                    .into_iter()
                    .find(|(_, name)| named(rest, name))
                    .map(|(part, _)| part);
                    // Every block parameter is a part's (the profile's
                    // test counts them against the model's).
                    match part {
                        Some(part) => Owner::Part(i, part),
                        None => continue,
                    }
                }
                None if p.name.starts_with(m.token_table_name()) || p.name.starts_with("wpe.") => {
                    Owner::Embedding
                }
                None => Owner::Head,
            };
            let n = p.range.len() as u64;
            let e = out.entry(owner).or_default();
            e.all += n;
            e.trained += if p.frozen { 0 } else { n };
        }
        out
    }
}

/// Adds `part`'s figures into its group's row.
fn add_into(group: &mut ModuleProfile, part: &ModuleProfile) {
    group.params += part.params;
    group.forward_flops += part.forward_flops;
    group.backward_flops += part.backward_flops;
    group.forward_ms += part.forward_ms;
    group.backward_ms += part.backward_ms;
    group.recompute_ms += part.recompute_ms;
}
