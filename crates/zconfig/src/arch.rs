//! What a job's `model:` section implies for each decoder family: parameter
//! names, shapes and counts. One place for the validator, the estimator, the
//! model and the exporter, so that they cannot disagree.
//!
//! Both families are a chain of blocks with two norms and four linears in the
//! same places, which is what lets one engine, one tiling rule and one
//! backward serve both:
//!
//! | slot | GPT-2 (`h.{i}.`) | LLaMA (`layers.{i}.`) |
//! |---|---|---|
//! | norm 1 | `ln_1` (weight, bias) | `input_layernorm` (RMSNorm weight) |
//! | linear 1 | `attn.c_attn` `[d, 3d]` | `self_attn.qkv_proj` `[d, (h + 2·kv)·hd]` |
//! | (q, k norms) | | Qwen3's `self_attn.q_norm`, `self_attn.k_norm` `[hd]` |
//! | linear 2 | `attn.c_proj` `[d, d]` | `self_attn.o_proj` `[h·hd, d]` |
//! | norm 2 | `ln_2` | `post_attention_layernorm` |
//! | linear 3 | `mlp.c_fc` `[d, ffn]` | `mlp.gate_up_proj` `[d, 2·ffn]` (gate, then up) |
//! | linear 4 | `mlp.c_proj` `[ffn, d]` | `mlp.down_proj` `[ffn, d]` |
//!
//! Weights are `[in, out]` in both (one GEMM on `[rows, in]`); LLaMA's q, k, v
//! and gate, up projections are stored side by side so that each is one GEMM,
//! and split (and transposed to `[out, in]`) only on export to Hugging Face's
//! names.

use crate::spec::{ModelKind, ModelSpec, RopeScaling};

/// The rotary embedding's frequency for each pair `i` of a head of width
/// `hd` (`[hd/2]`, in radians a position): `theta^(−2i/hd)`, scaled as
/// `scaling` says (Hugging Face's formulas, in f64) for sequences whose
/// longest position is `len - 1` (LongRoPE's factors switch there).
pub fn rope_inv_freq(theta: f64, scaling: Option<&RopeScaling>, hd: usize, len: usize) -> Vec<f64> {
    let plain = (0..hd / 2).map(|i| theta.powf(-((2 * i) as f64) / hd as f64));
    match scaling {
        Some(&RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: old,
            beta_fast,
            beta_slow,
            truncate,
            ..
        }) => {
            // transformers' `_compute_yarn_parameters`: the dimension at
            // which a frequency turns `rotations` times over the original
            // context, the ramp's ends there (rounded out unless
            // `truncate: false`), kept within the head.
            let dim = hd as f64;
            let at = |rotations: f64| {
                dim * (old as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (at(beta_fast.unwrap_or(32.0)), at(beta_slow.unwrap_or(1.0)));
            if truncate.unwrap_or(true) {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
            if low == high {
                high += 0.001;
            }
            plain
                .enumerate()
                .map(|(i, f)| {
                    // 0 keeps the frequency, 1 divides it by `factor`.
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    f / factor * ramp + f * (1.0 - ramp)
                })
                .collect()
        }
        None | Some(RopeScaling::Dynamic { .. }) => plain.collect(),
        Some(&RopeScaling::Linear { factor }) => plain.map(|f| f / factor).collect(),
        Some(RopeScaling::Longrope {
            original_max_position_embeddings: old,
            short_factor,
            long_factor,
            ..
        }) => {
            let divisors = match len > *old {
                true => long_factor,
                false => short_factor,
            };
            plain.zip(divisors).map(|(f, d)| f / d).collect()
        }
        Some(&RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: old,
        }) => {
            let old = old as f64;
            plain
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < old / high {
                        f
                    } else if wavelen > old / low {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// What the rotated q and k are multiplied by (the cosines and sines of
/// the table): YaRN's and LongRoPE's attention factors, else 1.
pub fn rope_attention_factor(scaling: Option<&RopeScaling>) -> f64 {
    // The YaRN paper's `0.1·scale·ln(factor) + 1`, 1 where nothing is
    // stretched.
    let mscale = |factor: f64, scale: f64| match factor <= 1.0 {
        true => 1.0,
        false => 0.1 * scale * factor.ln() + 1.0,
    };
    match scaling {
        Some(&RopeScaling::Longrope {
            factor,
            original_max_position_embeddings: old,
            attention_factor,
            ..
        }) => attention_factor.unwrap_or(match factor <= 1.0 {
            true => 1.0,
            false => (1.0 + factor.ln() / (old as f64).ln()).sqrt(),
        }),
        Some(&RopeScaling::Yarn {
            factor,
            attention_factor,
            mscale: numerator,
            mscale_all_dim: denominator,
            ..
        }) => match (attention_factor, numerator, denominator) {
            (Some(a), ..) => a,
            // transformers asks both to be given and nonzero.
            (None, Some(n), Some(d)) if n != 0.0 && d != 0.0 => {
                mscale(factor, n) / mscale(factor, d)
            }
            _ => mscale(factor, 1.0),
        },
        _ => 1.0,
    }
}

/// A head's rotary embedding as the models apply it: at position `p` pair
/// `i` turns by `p · inv_freq[i]`, and the turned values are multiplied by
/// `scale` (the cosines and sines are).
#[derive(Debug, Clone, PartialEq)]
pub struct Rotary {
    /// `[hd/2]` frequencies ([`rope_inv_freq`]).
    pub inv_freq: Vec<f64>,
    /// [`rope_attention_factor`].
    pub scale: f64,
}

impl Rotary {
    /// The rotary embedding of base `theta`, scaled as `scaling` says, for
    /// heads of `hd` and sequences of `len` tokens at most.
    pub fn new(theta: f64, scaling: Option<&RopeScaling>, hd: usize, len: usize) -> Rotary {
        Rotary {
            inv_freq: rope_inv_freq(theta, scaling, hd, len),
            scale: rope_attention_factor(scaling),
        }
    }
}

/// LLaMA's MLP width rounds `8/3 · d` up to a multiple of this.
const LLAMA_FFN_MULTIPLE: usize = 256;

impl ModelSpec {
    /// Key/value heads (all heads unless grouped-query attention).
    pub fn kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads.max(1))
    }

    /// Width of attention's output, the query heads side by side (`d_model`
    /// unless `head_dim` widens the heads).
    pub fn attn_width(&self) -> usize {
        self.n_heads * self.head_dim()
    }

    /// The MLP's hidden width.
    pub fn ffn(&self) -> usize {
        let d = self.d_model;
        self.ffn_hidden.unwrap_or(match self.kind {
            ModelKind::Gpt => 4 * d,
            ModelKind::Llama => (8 * d / 3).div_ceil(LLAMA_FFN_MULTIPLE) * LLAMA_FFN_MULTIPLE,
        })
    }

    /// Whether the output head is the token embedding.
    pub fn tied(&self) -> bool {
        match self.kind {
            ModelKind::Gpt => true,
            ModelKind::Llama => self.tie_embeddings.unwrap_or(false),
        }
    }

    /// Whether the norms have biases (GPT-2's layer norms).
    pub fn norm_biases(&self) -> bool {
        self.kind == ModelKind::Gpt
    }

    /// Whether LLaMA's q, k and v projections have biases (Qwen2's).
    pub fn qkv_biased(&self) -> bool {
        self.kind == ModelKind::Llama && self.qkv_bias.unwrap_or(false)
    }

    /// Whether each head's q and k are RMS-normalised before the rotary
    /// embedding (Qwen3's).
    pub fn qk_normed(&self) -> bool {
        self.kind == ModelKind::Llama && self.qk_norm.unwrap_or(false)
    }

    /// Whether each of a block's linears ([`ModelSpec::block_linears`]'
    /// order) has a bias: GPT-2's all, LLaMA's none but q, k and v with
    /// `qkv_bias`.
    pub fn linear_biases(&self) -> [bool; 4] {
        match self.kind {
            ModelKind::Gpt => [true; 4],
            ModelKind::Llama => [self.qkv_biased(), false, false, false],
        }
    }

    /// The longest sequence the model takes: `max_position_embeddings`,
    /// else `seq_len`.
    pub fn context(&self) -> usize {
        self.max_position_embeddings.unwrap_or(self.seq_len)
    }

    /// The sliding window where it is shorter than the job's sequences:
    /// each token attends to at most this many tokens, itself included.
    /// `None` where every earlier token of a sequence is within it.
    pub fn window(&self) -> Option<usize> {
        self.sliding_window.filter(|&w| w < self.seq_len)
    }

    /// Whether positions are learned (`wpe`) rather than rotary.
    pub fn learned_positions(&self) -> bool {
        self.kind == ModelKind::Gpt
    }

    /// The rotary embeddings' base.
    pub fn rope_theta(&self) -> f64 {
        self.rope_theta.unwrap_or(10_000.0)
    }

    /// The rotary embedding of this model's base, scaling and turned width
    /// for sequences of `len` tokens at most.
    pub fn rotary(&self, len: usize) -> Rotary {
        Rotary::new(
            self.rope_theta(),
            self.rope_scaling.as_ref(),
            self.rotary_dim(),
            len,
        )
    }

    /// The columns of each q and k head the rotary embedding turns: the
    /// head's width times `partial_rotary_factor`, rounded down as
    /// transformers' `int()` does.
    pub fn rotary_dim(&self) -> usize {
        match self.partial_rotary_factor {
            Some(f) => (self.head_dim() as f64 * f) as usize,
            None => self.head_dim(),
        }
    }

    /// The sequence length beyond which the rotary frequencies change
    /// (LongRoPE's original context), if they do: a generation that grows
    /// past it turns every position again, as transformers' Phi-3 does.
    pub fn rotary_switches_after(&self) -> Option<usize> {
        match self.rope_scaling {
            Some(RopeScaling::Longrope {
                original_max_position_embeddings,
                ..
            }) => Some(original_max_position_embeddings),
            _ => None,
        }
    }

    /// The norms' epsilon.
    pub fn norm_eps(&self) -> f64 {
        self.norm_eps.unwrap_or(1e-5)
    }

    /// The share of hidden-state elements training drops (`hidden_dropout`,
    /// default 0).
    pub fn hidden_dropout(&self) -> f64 {
        self.hidden_dropout.unwrap_or(0.0)
    }

    /// The share of attention's probabilities training drops
    /// (`attention_dropout`, default 0).
    pub fn attention_dropout(&self) -> f64 {
        self.attention_dropout.unwrap_or(0.0)
    }

    /// Width of the fused attention projection's output: q, k and v side by side.
    pub fn qkv_width(&self) -> usize {
        (self.n_heads + 2 * self.kv_heads()) * self.head_dim()
    }

    /// A block's linears in forward order: name inside the block and `[in, out]`.
    pub fn block_linears(&self) -> [(&'static str, usize, usize); 4] {
        let (d, f) = (self.d_model, self.ffn());
        match self.kind {
            ModelKind::Gpt => [
                ("attn.c_attn", d, self.qkv_width()),
                ("attn.c_proj", d, d),
                ("mlp.c_fc", d, f),
                ("mlp.c_proj", f, d),
            ],
            ModelKind::Llama => [
                ("self_attn.qkv_proj", d, self.qkv_width()),
                ("self_attn.o_proj", self.attn_width(), d),
                ("mlp.gate_up_proj", d, 2 * f),
                ("mlp.down_proj", f, d),
            ],
        }
    }

    /// A block's two norms' names, in forward order.
    pub fn block_norms(&self) -> [&'static str; 2] {
        match self.kind {
            ModelKind::Gpt => ["ln_1", "ln_2"],
            ModelKind::Llama => ["input_layernorm", "post_attention_layernorm"],
        }
    }

    /// Qwen3's per-head q and k norms' names inside a block, in forward
    /// order (see [`ModelSpec::qk_normed`]).
    pub const QK_NORMS: [&'static str; 2] = ["self_attn.q_norm", "self_attn.k_norm"];

    /// The name prefix of block `i` (0-based), e.g. `h.3`.
    pub fn block_prefix(&self, i: usize) -> String {
        match self.kind {
            ModelKind::Gpt => format!("h.{i}"),
            ModelKind::Llama => format!("layers.{i}"),
        }
    }

    /// The block a parameter's name is in and the rest of the name after
    /// the block's prefix and its dot (`h.3.attn.c_attn.weight` →
    /// `(3, "attn.c_attn.weight")`); `None` outside the blocks.
    pub fn block_of<'a>(&self, name: &'a str) -> Option<(usize, &'a str)> {
        let base = match self.kind {
            ModelKind::Gpt => "h.",
            ModelKind::Llama => "layers.",
        };
        let (index, rest) = name.strip_prefix(base)?.split_once('.')?;
        let i: usize = index.parse().ok()?;
        (i < self.n_layers && self.block_prefix(i) == name[..base.len() + index.len()])
            .then_some((i, rest))
    }

    /// The token table's name (also the tied head), without `.weight`.
    pub fn token_table_name(&self) -> &'static str {
        match self.kind {
            ModelKind::Gpt => "wte",
            ModelKind::Llama => "embed_tokens",
        }
    }

    /// The final norm's name, without `.weight`.
    pub fn final_norm_name(&self) -> &'static str {
        match self.kind {
            ModelKind::Gpt => "ln_f",
            ModelKind::Llama => "norm",
        }
    }

    /// Every parameter's name and whole shape, in the model's order
    /// (embedding, blocks, head). zmodel's parameter groups hold exactly
    /// these (tested there).
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (v, d) = (self.vocab_size, self.d_model);
        let mut out = vec![(format!("{}.weight", self.token_table_name()), vec![v, d])];
        if self.learned_positions() {
            out.push(("wpe.weight".into(), vec![self.context(), d]));
        }
        let weight_bias =
            |out: &mut Vec<(String, Vec<usize>)>, name: String, shape: Vec<usize>, bias: bool| {
                let width = *shape.last().unwrap_or(&0);
                out.push((format!("{name}.weight"), shape));
                if bias {
                    out.push((format!("{name}.bias"), vec![width]));
                }
            };
        let [norm_1, norm_2] = self.block_norms();
        let [qkv, attn_out, mlp_in, mlp_out] = self.block_linears();
        let [qkv_b, attn_out_b, mlp_in_b, mlp_out_b] = self.linear_biases();
        let norm_b = self.norm_biases();
        for i in 0..self.n_layers {
            let p = self.block_prefix(i);
            let linear = |out: &mut Vec<_>, (name, inputs, outputs): (&str, usize, usize), bias| {
                weight_bias(out, format!("{p}.{name}"), vec![inputs, outputs], bias)
            };
            weight_bias(&mut out, format!("{p}.{norm_1}"), vec![d], norm_b);
            linear(&mut out, qkv, qkv_b);
            if self.qk_normed() {
                for name in Self::QK_NORMS {
                    out.push((format!("{p}.{name}.weight"), vec![self.head_dim()]));
                }
            }
            linear(&mut out, attn_out, attn_out_b);
            weight_bias(&mut out, format!("{p}.{norm_2}"), vec![d], norm_b);
            linear(&mut out, mlp_in, mlp_in_b);
            linear(&mut out, mlp_out, mlp_out_b);
        }
        weight_bias(&mut out, self.final_norm_name().into(), vec![d], norm_b);
        if !self.tied() {
            out.push(("lm_head.weight".into(), vec![v, d]));
        }
        out
    }

    /// Parameters in one block.
    pub fn block_params(&self) -> usize {
        let linears: usize = self
            .block_linears()
            .iter()
            .zip(self.linear_biases())
            .map(|(&(_, i, o), bias)| (i + usize::from(bias)) * o)
            .sum();
        let qk_norms = 2 * usize::from(self.qk_normed()) * self.head_dim();
        linears + 2 * (1 + usize::from(self.norm_biases())) * self.d_model + qk_norms
    }

    /// Parameters of the embedding (token table, and GPT-2's position table).
    pub fn embedding_params(&self) -> usize {
        let positions = if self.learned_positions() {
            self.seq_len
        } else {
            0
        };
        (self.vocab_size + positions) * self.d_model
    }

    /// Parameters of the head: the final norm, and an untied output matrix.
    pub fn head_params(&self) -> usize {
        let norm = (1 + usize::from(self.norm_biases())) * self.d_model;
        let matrix = if self.tied() {
            0
        } else {
            self.vocab_size * self.d_model
        };
        norm + matrix
    }

    /// Parameters of the whole model.
    pub fn param_count(&self) -> usize {
        self.embedding_params() + self.n_layers * self.block_params() + self.head_params()
    }

    /// How `other` differs from this model's architecture (what a checkpoint
    /// or a weight file must match): `(key, this, other)` per field; empty if
    /// the same. `init_from` and `tile_size` are not architecture.
    pub fn architecture_differences(
        &self,
        other: &ModelSpec,
    ) -> Vec<(&'static str, String, String)> {
        let fields = |m: &ModelSpec| {
            [
                ("kind", format!("{:?}", m.kind).to_lowercase()),
                ("vocab_size", m.vocab_size.to_string()),
                ("d_model", m.d_model.to_string()),
                ("n_layers", m.n_layers.to_string()),
                ("n_heads", m.n_heads.to_string()),
                ("head_dim", m.head_dim().to_string()),
                ("n_kv_heads", m.kv_heads().to_string()),
                ("ffn_hidden", m.ffn().to_string()),
                ("seq_len", m.seq_len.to_string()),
                ("tie_embeddings", m.tied().to_string()),
                ("qkv_bias", m.qkv_biased().to_string()),
                ("qk_norm", m.qk_normed().to_string()),
                ("rope_theta", m.rope_theta().to_string()),
                ("rope_scaling", format!("{:?}", m.rope_scaling)),
                ("norm_eps", m.norm_eps().to_string()),
            ]
        };
        fields(self)
            .into_iter()
            .zip(fields(other))
            .filter(|(a, b)| a.1 != b.1)
            .map(|((k, a), (_, b))| (k, a, b))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3's scaled frequencies against `transformers` 5.24's own
    /// (`ROPE_INIT_FUNCTIONS["llama3"]` of a LlamaConfig with head width 16,
    /// base 500, factor 8, low 1, high 4, original context 32: pair 0 kept,
    /// 1 and 2 blended, the rest divided), which it computes in f32: within
    /// f32's rounding.
    #[test]
    fn llama3_frequencies_are_transformers() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        };
        let transformers = [
            1.0,
            0.23748968541622162,
            0.031185457482933998,
            0.01215615589171648,
            0.005590170156210661,
            0.0025707141030579805,
            0.0011821769876405597,
            0.0005436398205347359,
        ];
        let ours = rope_inv_freq(500.0, Some(&scaling), 16, 32);
        // And with low_freq_factor 2 (the low band from wavelength 16).
        let low_2 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 2.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        };
        let mut transformers_low_2 = transformers;
        (transformers_low_2[1], transformers_low_2[2]) = (0.12630289793014526, 0.0264342799782753);
        for (ours, theirs) in [
            (&ours, transformers),
            (
                &rope_inv_freq(500.0, Some(&low_2), 16, 32),
                transformers_low_2,
            ),
        ] {
            assert_eq!(ours.len(), theirs.len());
            for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
                assert!((a - b).abs() <= 1e-6 * b, "pair {i}: {a} vs {b}");
            }
        }
        // Unscaled: theta^(-2i/hd); linear: each over the factor.
        let plain = rope_inv_freq(500.0, None, 16, 32);
        assert_eq!(plain[0], 1.0);
        assert!((plain[1] - 500f64.powf(-2.0 / 16.0)).abs() < 1e-15);
        let linear = rope_inv_freq(500.0, Some(&RopeScaling::Linear { factor: 4.0 }), 16, 32);
        assert!(linear.iter().zip(&plain).all(|(l, p)| *l == p / 4.0));
        // The bands: pair 0 (wavelength 2π, under 32/4) kept, pair 3 on
        // (wavelength 65, over 32/1) divided by 8, those between neither.
        assert_eq!(ours[0], plain[0]);
        assert!(ours[1] != plain[1] && ours[1] != plain[1] / 8.0);
        assert!((3..8).all(|i| ours[i] == plain[i] / 8.0));
    }

    /// YaRN's frequencies and attention factor against `transformers`
    /// 5.25's own (`ROPE_INIT_FUNCTIONS["yarn"]` of LlamaConfigs, computed
    /// in f32): Qwen2.5's form (factor 4, original context 16: the ramp
    /// from pair 0 to 1), DeepSeek's (factor 40, original 4096, `mscale` 1
    /// over `mscale_all_dim` 0.707, `truncate: false`: a ramp over pairs
    /// 10-23) and one with its own betas and attention factor.
    #[test]
    fn yarn_frequencies_and_attention_factor_are_transformers() {
        type Pair = Option<(f64, f64)>;
        let yarn = |factor, old, betas: Pair, attention, mscales: Pair, truncate| {
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: old,
                beta_fast: betas.map(|b| b.0),
                beta_slow: betas.map(|b| b.1),
                attention_factor: attention,
                mscale: mscales.map(|m| m.0),
                mscale_all_dim: mscales.map(|m| m.1),
                truncate,
            })
        };
        let qwen = yarn(4.0, 16, None, None, None, None);
        let deepseek = yarn(
            40.0,
            4096,
            Some((32.0, 1.0)),
            None,
            Some((1.0, 0.707)),
            Some(false),
        );
        let own = yarn(2.0, 32, Some((8.0, 2.0)), Some(1.5), None, None);
        let cases: [(_, f64, usize, &[f64], f64); 3] = [
            (
                qwen,
                10000.0,
                16,
                &[
                    1.0,
                    0.07905694097280502,
                    0.02500000037252903,
                    0.007905694656074047,
                    0.0024999999441206455,
                    0.0007905694656074047,
                    0.0002500000118743628,
                    7.905694656074047e-05,
                ],
                1.138629436111989,
            ),
            (
                deepseek,
                10000.0,
                64,
                &[
                    1.0,
                    0.7498942017555237,
                    0.5623413324356079,
                    0.4216965138912201,
                    0.3162277638912201,
                    0.23713736236095428,
                    0.17782793939113617,
                    0.1333521455526352,
                    0.10000000149011612,
                    0.07498941570520401,
                    0.05623412877321243,
                    0.04036758467555046,
                    0.02771085873246193,
                    0.01886006072163582,
                    0.012703143060207367,
                    0.008446235209703445,
                    0.005524062551558018,
                    0.0035352581180632114,
                    0.0021957308053970337,
                    0.0013051095884293318,
                    0.0007226381567306817,
                    0.0003498873848002404,
                    0.00011838764476124197,
                    3.333803397254087e-05,
                    2.499999936844688e-05,
                    1.8747354260995053e-05,
                    1.4058532542549074e-05,
                    1.0542412383074407e-05,
                    7.905694474175107e-06,
                    5.928434347879374e-06,
                    4.445698323252145e-06,
                    3.3338035336782923e-06,
                ],
                1.0857263992561355,
            ),
            (
                own,
                100.0,
                8,
                &[
                    1.0,
                    0.15811388194561005,
                    0.05000000074505806,
                    0.015811389312148094,
                ],
                1.5,
            ),
        ];
        for (n, (scaling, theta, hd, transformers, attention)) in cases.into_iter().enumerate() {
            let ours = Rotary::new(theta, scaling.as_ref(), hd, 64);
            assert_is_transformers(n, &ours, transformers, attention);
        }
        // The others multiply by 1.
        assert_eq!(Rotary::new(500.0, None, 16, 32).scale, 1.0);
    }

    /// Case `n`'s frequencies within f32's rounding of transformers', its
    /// attention factor to 1e-12.
    fn assert_is_transformers(n: usize, ours: &Rotary, transformers: &[f64], attention: f64) {
        assert_eq!(ours.inv_freq.len(), transformers.len(), "case {n}");
        for (i, (a, b)) in ours.inv_freq.iter().zip(transformers).enumerate() {
            assert!((a - b).abs() <= 1e-6 * b, "case {n}, pair {i}: {a} vs {b}");
        }
        assert!(
            (ours.scale - attention).abs() <= 1e-12,
            "case {n}: attention factor {} vs {attention}",
            ours.scale
        );
    }

    /// LongRoPE's frequencies and attention factor against `transformers`
    /// 5.25's own (`ROPE_INIT_FUNCTIONS["longrope"]`, in f32), short and
    /// long: Phi-3.5's form (a `Phi3Config` of base 500, context 128 over
    /// an original 16, so factor 8, the attention factor
    /// `sqrt(1 + ln 8 / ln 16)`), a LLaMA's with its own factor (3,
    /// original 32) and one with its own attention factor. The factors
    /// switch past the original context: at 16 tokens the short, at 17 the
    /// long.
    #[test]
    fn longrope_frequencies_and_attention_factor_are_transformers() {
        let short = vec![1.0, 1.05, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0];
        let long = vec![1.0, 1.3, 2.0, 3.5, 6.0, 9.0, 12.0, 16.0];
        let longrope = |factor, old, attention_factor| RopeScaling::Longrope {
            factor,
            original_max_position_embeddings: old,
            short_factor: short.clone(),
            long_factor: long.clone(),
            attention_factor,
        };
        let phi3 = longrope(8.0, 16, None);
        let llama = longrope(3.0, 32, None);
        let own = longrope(3.0, 32, Some(1.25));
        let llama_short: &[f64] = &[
            1.0,
            0.3011693060398102,
            0.09090909361839294,
            0.02635231241583824,
            0.006666666828095913,
            0.0015811389312148094,
            0.00033333332976326346,
            7.905694656074047e-05,
        ];
        let cases: [(_, f64, usize, &[f64], f64); 5] = [
            (
                &phi3,
                500.0,
                16,
                &[
                    1.0,
                    0.4379650354385376,
                    0.19224931299686432,
                    0.08104103058576584,
                    0.029814239591360092,
                    0.010282856412231922,
                    0.0031524719670414925,
                    0.0010872796410694718,
                ],
                1.3228756555322954,
            ),
            (
                &phi3,
                500.0,
                17,
                &[
                    1.0,
                    0.35374101996421814,
                    0.1057371199131012,
                    0.027785496786236763,
                    0.007453559897840023,
                    0.002285079099237919,
                    0.0007881179917603731,
                    0.00027181991026736796,
                ],
                1.3228756555322954,
            ),
            (&llama, 10_000.0, 32, llama_short, 1.1476029366223455),
            (
                &llama,
                10_000.0,
                33,
                &[
                    1.0,
                    0.24325212836265564,
                    0.05000000074505806,
                    0.009035078808665276,
                    0.0016666667070239782,
                    0.00035136420046910644,
                    8.333333244081587e-05,
                    1.9764236640185118e-05,
                ],
                1.1476029366223455,
            ),
            (&own, 10_000.0, 32, llama_short, 1.25),
        ];
        for (n, (scaling, theta, len, transformers, attention)) in cases.into_iter().enumerate() {
            let ours = Rotary::new(theta, Some(scaling), 16, len);
            assert_is_transformers(n, &ours, transformers, attention);
        }
        let spec = |scaling| ModelSpec {
            rope_scaling: scaling,
            ..serde_json::from_value(serde_json::json!({"kind": "llama"})).unwrap()
        };
        assert_eq!(spec(Some(phi3)).rotary_switches_after(), Some(16));
        assert_eq!(spec(None).rotary_switches_after(), None);
    }

    /// Dynamic NTK scaling within the model's context: transformers'
    /// `_compute_dynamic_ntk_parameters` scales the base by `(factor · len /
    /// max_position_embeddings − (factor − 1))^(hd / (hd − 2))`, which is 1
    /// at a sequence as long as the context (and it recomputes only past
    /// it): the unscaled frequencies, no attention factor.
    #[test]
    fn dynamic_scaling_within_the_context_is_unscaled() {
        let dynamic = Some(RopeScaling::Dynamic { factor: 2.0 });
        assert_eq!(
            Rotary::new(10_000.0, dynamic.as_ref(), 16, 32),
            Rotary::new(10_000.0, None, 16, 32)
        );
    }

    fn spec(json: serde_json::Value) -> ModelSpec {
        serde_json::from_value(json).unwrap()
    }

    /// Every parameter of a block is placed in it, nothing else is, and a
    /// name that only looks like a block's is not (an index written with a
    /// sign or a leading zero, one past the last block).
    #[test]
    fn block_of_places_each_parameter_in_its_block() {
        for kind in ["gpt", "llama"] {
            let m = spec(serde_json::json!({
                "kind": kind, "vocab_size": 16, "d_model": 8, "n_layers": 12, "n_heads": 2, "seq_len": 4
            }));
            for (name, _) in m.param_shapes() {
                let want = (0..m.n_layers).find_map(|i| {
                    let prefix = format!("{}.", m.block_prefix(i));
                    name.strip_prefix(&prefix).map(|rest| (i, rest))
                });
                assert_eq!(m.block_of(&name), want, "{name}");
            }
            let base = m.block_prefix(0).replace(".0", "");
            for name in ["+3", "03", "12", "3"].map(|i| format!("{base}.{i}.x")) {
                let want = name.ends_with(".3.x").then_some((3, "x"));
                assert_eq!(m.block_of(&name), want, "{name}");
            }
        }
    }

    #[test]
    fn gpt2_small_and_llama_shapes_count_as_published() {
        // GPT-2 small: 124,439,808 parameters (tied head).
        let gpt2 = spec(serde_json::json!({
            "vocab_size": 50257, "d_model": 768, "n_layers": 12, "n_heads": 12, "seq_len": 1024
        }));
        assert_eq!(gpt2.param_count(), 124_439_808);
        // LLaMA-2 7B: 6,738,415,616 parameters, ffn 11008 by LLaMA's rounding.
        let llama = spec(serde_json::json!({
            "kind": "llama", "vocab_size": 32000, "d_model": 4096, "n_layers": 32,
            "n_heads": 32, "seq_len": 4096
        }));
        assert_eq!(llama.ffn(), 11008);
        assert_eq!(llama.param_count(), 6_738_415_616);
        // Grouped-query attention narrows k and v: 8 of 32 heads.
        let gqa = spec(serde_json::json!({
            "kind": "llama", "d_model": 4096, "n_heads": 32, "n_kv_heads": 8
        }));
        assert_eq!(gqa.qkv_width(), 4096 + 2 * 1024);
        assert_eq!(
            llama.architecture_differences(&gqa)[0],
            ("vocab_size", "32000".to_string(), "256".to_string())
        );
        assert!(llama.architecture_differences(&llama).is_empty());
        // Qwen2.5-0.5B: 494,032,768 parameters (tied; q, k and v biased).
        let qwen2 = spec(serde_json::json!({
            "kind": "llama", "vocab_size": 151936, "d_model": 896, "n_layers": 24,
            "n_heads": 14, "n_kv_heads": 2, "ffn_hidden": 4864, "tie_embeddings": true,
            "qkv_bias": true
        }));
        assert_eq!(qwen2.param_count(), 494_032_768);
        assert_eq!(qwen2.linear_biases(), [true, false, false, false]);
        assert_eq!(
            qwen2.param_shapes()[3],
            ("layers.0.self_attn.qkv_proj.bias".to_string(), vec![1152])
        );
        let unbiased = ModelSpec {
            qkv_bias: None,
            ..qwen2.clone()
        };
        assert_eq!(
            qwen2.architecture_differences(&unbiased),
            [("qkv_bias", "true".to_string(), "false".to_string())]
        );
        // Qwen3-0.6B: 596,049,920 parameters (tied); heads of 128 wider
        // than 1024 / 16, so q is 2048 wide and o_proj [2048, 1024]; each
        // block's q and k norms 128 each, after q, k and v.
        let qwen3 = spec(serde_json::json!({
            "kind": "llama", "vocab_size": 151936, "d_model": 1024, "n_layers": 28,
            "n_heads": 16, "n_kv_heads": 8, "head_dim": 128, "ffn_hidden": 3072,
            "tie_embeddings": true, "qk_norm": true
        }));
        assert_eq!(qwen3.param_count(), 596_049_920);
        assert_eq!((qwen3.qkv_width(), qwen3.attn_width()), (4096, 2048));
        let names: Vec<_> = qwen3.param_shapes()[1..6].to_vec();
        assert_eq!(
            names,
            [
                ("layers.0.input_layernorm.weight".to_string(), vec![1024]),
                (
                    "layers.0.self_attn.qkv_proj.weight".to_string(),
                    vec![1024, 4096]
                ),
                ("layers.0.self_attn.q_norm.weight".to_string(), vec![128]),
                ("layers.0.self_attn.k_norm.weight".to_string(), vec![128]),
                (
                    "layers.0.self_attn.o_proj.weight".to_string(),
                    vec![2048, 1024]
                ),
            ]
        );
        let shapes: usize = qwen3
            .param_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        assert_eq!(shapes, qwen3.param_count());
        let plain = ModelSpec {
            qk_norm: None,
            head_dim: None,
            ..qwen3.clone()
        };
        assert_eq!(
            qwen3.architecture_differences(&plain),
            [
                ("head_dim", "128".to_string(), "64".to_string()),
                ("qk_norm", "true".to_string(), "false".to_string())
            ]
        );
    }
}
