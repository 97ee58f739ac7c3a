//! An independent reader of a Hugging Face LLaMA directory (what `zrun export
//! --format hf` writes; or Qwen2's, which adds biases to q, k and v; or
//! Qwen3's, whose heads are `head_dim` wide and whose q and k heads are each
//! RMS-normalised before the rotation): it
//! knows LLaMA only from `transformers`' `LlamaForCausalLM` conventions (`config.json`'s keys, `model.` names,
//! `nn.Linear` weights stored `[out, in]`, RMSNorm, rotary embeddings with
//! `rotate_half` on the two halves of each head, SwiGLU as
//! `down(silu(gate(x)) * up(x))`, key/value heads repeated for grouped-query
//! attention), reads the safetensors file with the `safetensors` crate and
//! computes the loss in f64 with plain loops. Nothing here comes from zmodel
//! or zckpt, so a transposed, split, renamed or misplaced tensor in the
//! export shows up as a different loss, or as a missing name or a wrong shape.

use std::collections::HashMap;
use std::path::Path;

use crate::reference_common::{
    add_into, load_exactly, mean_loss, mean_loss_of_documents, mean_loss_skipping,
};

/// The shape, from `config.json`.
struct Config {
    vocab: usize,
    d: usize,
    ffn: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    eps: f64,
    theta: f64,
    /// The `rope_scaling`.
    scaling: Scaling,
    tied: bool,
    /// Qwen2: q, k and v projections with biases.
    qkv_bias: bool,
    /// The width of a head: `head_dim` where the config says (Qwen3 must).
    hd: usize,
    /// Qwen3: each head of q and k RMS-normalised (`q_norm`, `k_norm`).
    qk_norm: bool,
    /// The columns of each q and k head that turn (Phi-3's
    /// `partial_rotary_factor` of the head's width; all elsewhere).
    rot: usize,
    /// Phi-3: q, k and v stored as one `qkv_proj`, gate and up as one
    /// `gate_up_proj`, the parts' rows one after the other.
    fused: bool,
    /// The most keys a token attends to, itself included (Mistral's and
    /// Phi-3's `sliding_window`; Qwen's with `use_sliding_window` on every
    /// layer); none: every earlier token.
    window: Option<usize>,
}

/// A `rope_scaling` the reader computes.
enum Scaling {
    None,
    /// Llama 3's: factor, low and high frequency factors, original context.
    Llama3([f64; 4]),
    /// YaRN's: factor, original context, beta_fast, beta_slow, whether the
    /// ramp's ends are rounded out, and the attention factor.
    Yarn {
        factor: f64,
        old: f64,
        betas: [f64; 2],
        truncate: bool,
        attention: f64,
    },
    /// LongRoPE's: the original context, a divisor of each pair's
    /// frequency within it and past it, and the attention factor.
    Longrope {
        old: usize,
        short: Vec<f64>,
        long: Vec<f64>,
        attention: f64,
    },
}

impl Config {
    /// Pair `i`'s frequency (radians a position) for head width `hd` in a
    /// sequence of `len` tokens. LongRoPE's divides by the pair's short
    /// factor up to the original context, by its long one past it. Llama
    /// 3's bands by frequency rather than wavelength (the same cuts, written
    /// the other way round from zrun's): above `2π·high/old` kept, below
    /// `2π·low/old` over the factor, between a blend by where the pair's
    /// turns over the original context fall. YaRN's as the paper puts it:
    /// the pair index at which a frequency turns `β` times over the original
    /// context is `hd·ln(old / 2πβ) / 2·ln θ`; pairs below β_fast's index
    /// are kept, above β_slow's divided, a straight line between.
    fn frequency(&self, i: usize, hd: usize, len: usize) -> f64 {
        let f = self.theta.powf(-((2 * i) as f64) / hd as f64);
        match self.scaling {
            Scaling::None => f,
            Scaling::Longrope {
                old,
                ref short,
                ref long,
                ..
            } => match len > old {
                true => f / long[i],
                false => f / short[i],
            },
            Scaling::Llama3([factor, low, high, old]) => {
                let turns = old * f / std::f64::consts::TAU;
                if turns > high {
                    f
                } else if turns < low {
                    f / factor
                } else {
                    let w = (turns - low) / (high - low);
                    f * (w + (1.0 - w) / factor)
                }
            }
            Scaling::Yarn {
                factor,
                old,
                betas: [fast, slow],
                truncate,
                ..
            } => {
                let index = |beta: f64| {
                    hd as f64 * (old / (std::f64::consts::TAU * beta)).ln()
                        / (2.0 * self.theta.ln())
                };
                let (mut from, mut to) = (index(fast), index(slow));
                if truncate {
                    (from, to) = (from.floor(), to.ceil());
                }
                let from = from.max(0.0);
                let to = to.min(hd as f64 - 1.0).max(from + 0.001);
                let divided = ((i as f64 - from) / (to - from)).clamp(0.0, 1.0);
                (1.0 - divided) * f + divided * f / factor
            }
        }
    }

    /// What the turned q and k are multiplied by: YaRN's and LongRoPE's
    /// attention factors, else 1.
    fn rotary_scale(&self) -> f64 {
        match self.scaling {
            Scaling::Yarn { attention, .. } | Scaling::Longrope { attention, .. } => attention,
            _ => 1.0,
        }
    }
}

/// A LLaMA loaded from a Hugging Face directory by name, every tensor
/// checked for shape.
pub struct Llama {
    cfg: Config,
    tensors: HashMap<String, Vec<f64>>,
}

impl Llama {
    /// Reads `dir`; panics naming the first missing, extra, misshapen or
    /// non-f32 tensor.
    pub fn load(dir: &Path) -> Llama {
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).expect("config.json"))
                .expect("config.json is JSON");
        let (qkv_bias, qk_norm) = match config["model_type"].as_str() {
            Some("llama" | "mistral" | "phi3") => (false, false),
            Some(kind @ ("qwen2" | "qwen3")) => (kind == "qwen2", kind == "qwen3"),
            _ => panic!("not a LLaMA, Mistral, Qwen2 or Qwen3 config: {config}"),
        };
        let window = match config["model_type"].as_str() {
            Some("qwen2" | "qwen3") if config["use_sliding_window"] == true => {
                // On the layers from max_window_layers on: every one here.
                assert_eq!(config["max_window_layers"], 0, "{config}");
                config["sliding_window"].as_u64()
            }
            Some("mistral" | "phi3") => config["sliding_window"].as_u64(),
            _ => None,
        };
        let n = |k: &str| config[k].as_u64().unwrap_or_else(|| panic!("{k}")) as usize;
        let hd = match (qk_norm, config["head_dim"].as_u64()) {
            (_, Some(hd)) => hd as usize,
            (true, None) => panic!("a Qwen3 config without head_dim: {config}"),
            (false, None) => n("hidden_size") / n("num_attention_heads"),
        };
        let f = |k: &str| config[k].as_f64().unwrap_or_else(|| panic!("{k}"));
        let cfg = Config {
            vocab: n("vocab_size"),
            d: n("hidden_size"),
            ffn: n("intermediate_size"),
            layers: n("num_hidden_layers"),
            heads: n("num_attention_heads"),
            kv_heads: n("num_key_value_heads"),
            eps: f("rms_norm_eps"),
            theta: f("rope_theta"),
            scaling: match &config["rope_scaling"] {
                serde_json::Value::Null => Scaling::None,
                s => {
                    let g = |k: &str| s[k].as_f64().unwrap_or_else(|| panic!("rope_scaling.{k}"));
                    match s["rope_type"].as_str() {
                        Some("llama3") => Scaling::Llama3([
                            g("factor"),
                            g("low_freq_factor"),
                            g("high_freq_factor"),
                            g("original_max_position_embeddings"),
                        ]),
                        Some("yarn") => {
                            let or = |k: &str, default: f64| s[k].as_f64().unwrap_or(default);
                            let factor = g("factor");
                            Scaling::Yarn {
                                factor,
                                old: g("original_max_position_embeddings"),
                                betas: [or("beta_fast", 32.0), or("beta_slow", 1.0)],
                                truncate: s["truncate"].as_bool().unwrap_or(true),
                                // The paper's 0.1·ln(s) + 1 where not given.
                                attention: or("attention_factor", 0.1 * factor.ln() + 1.0),
                            }
                        }
                        // Dynamic NTK rescales only past the model's
                        // context, which the reader never reaches.
                        Some("dynamic") => Scaling::None,
                        Some("longrope") => {
                            let old = g("original_max_position_embeddings");
                            let list = |k: &str| -> Vec<f64> {
                                let v = s[k].as_array().unwrap_or_else(|| panic!("{k}"));
                                v.iter().map(|f| f.as_f64().expect("a factor")).collect()
                            };
                            // The paper's sqrt(1 + ln s / ln L), s the
                            // context's stretch.
                            let stretch = s["factor"]
                                .as_f64()
                                .unwrap_or_else(|| f("max_position_embeddings") / old);
                            Scaling::Longrope {
                                old: old as usize,
                                short: list("short_factor"),
                                long: list("long_factor"),
                                attention: s["attention_factor"]
                                    .as_f64()
                                    .unwrap_or((1.0 + stretch.ln() / old.ln()).sqrt()),
                            }
                        }
                        _ => panic!("a rope_scaling the reader does not compute: {s}"),
                    }
                }
            },
            tied: config["tie_word_embeddings"]
                .as_bool()
                .expect("tie_word_embeddings"),
            qkv_bias,
            hd,
            qk_norm,
            rot: {
                let within = &config["rope_parameters"]["partial_rotary_factor"];
                let share = within
                    .as_f64()
                    .or(config["partial_rotary_factor"].as_f64())
                    .unwrap_or(1.0);
                (hd as f64 * share) as usize
            },
            fused: config["model_type"] == "phi3",
            window: window.map(|w| w as usize),
        };
        let (v, d, f) = (cfg.vocab, cfg.d, cfg.ffn);
        let (q, kv) = (cfg.heads * hd, cfg.kv_heads * hd);
        let mut want: Vec<(String, Vec<usize>)> = vec![
            ("model.embed_tokens.weight".into(), vec![v, d]),
            ("model.norm.weight".into(), vec![d]),
        ];
        if !cfg.tied {
            want.push(("lm_head.weight".into(), vec![v, d]));
        }
        // Each of Phi-3's fused tensors and its parts' rows.
        let fused = [
            (
                "self_attn.qkv_proj",
                vec![
                    ("self_attn.q_proj", q),
                    ("self_attn.k_proj", kv),
                    ("self_attn.v_proj", kv),
                ],
            ),
            (
                "mlp.gate_up_proj",
                vec![("mlp.gate_proj", f), ("mlp.up_proj", f)],
            ),
        ];
        for i in 0..cfg.layers {
            let mut names = vec![
                ("input_layernorm.weight", vec![d]),
                ("self_attn.o_proj.weight", vec![d, q]),
                ("post_attention_layernorm.weight", vec![d]),
                ("mlp.down_proj.weight", vec![d, f]),
            ];
            match cfg.fused {
                true => names.extend([
                    ("self_attn.qkv_proj.weight", vec![q + 2 * kv, d]),
                    ("mlp.gate_up_proj.weight", vec![2 * f, d]),
                ]),
                false => names.extend([
                    ("self_attn.q_proj.weight", vec![q, d]),
                    ("self_attn.k_proj.weight", vec![kv, d]),
                    ("self_attn.v_proj.weight", vec![kv, d]),
                    ("mlp.gate_proj.weight", vec![f, d]),
                    ("mlp.up_proj.weight", vec![f, d]),
                ]),
            }
            for (name, dims) in names {
                want.push((format!("model.layers.{i}.{name}"), dims));
            }
            if cfg.qkv_bias {
                for (name, width) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                    want.push((
                        format!("model.layers.{i}.self_attn.{name}.bias"),
                        vec![width],
                    ));
                }
            }
            if cfg.qk_norm {
                for name in ["q_norm", "k_norm"] {
                    want.push((
                        format!("model.layers.{i}.self_attn.{name}.weight"),
                        vec![hd],
                    ));
                }
            }
        }
        let mut tensors = load_exactly(&dir.join("model.safetensors"), want);
        if cfg.fused {
            for i in 0..cfg.layers {
                for (whole, parts) in &fused {
                    let values = tensors
                        .remove(&format!("model.layers.{i}.{whole}.weight"))
                        .expect("a fused tensor");
                    let mut at = 0;
                    for (part, rows) in parts {
                        let piece = values[at * d..(at + rows) * d].to_vec();
                        tensors.insert(format!("model.layers.{i}.{part}.weight"), piece);
                        at += rows;
                    }
                }
            }
        }
        Llama { cfg, tensors }
    }

    fn w(&self, name: &str) -> &[f64] {
        &self.tensors[name]
    }

    /// Mean next-token cross-entropy over `windows` (each `len + 1` tokens:
    /// inputs are the first `len`, targets the last `len`).
    pub fn loss(&self, windows: &[Vec<u32>]) -> f64 {
        mean_loss(windows, |inputs| self.logits(inputs))
    }

    /// [`Llama::loss`] over windows each leaving its first `skip` targets
    /// out.
    pub fn loss_skipping(&self, windows: &[(Vec<u32>, usize)]) -> f64 {
        mean_loss_skipping(windows, |inputs| self.logits(inputs))
    }

    /// [`Llama::loss`] with each window's documents (ended by `eos`) each
    /// scored alone ([`mean_loss_of_documents`]).
    pub fn loss_of_documents(&self, windows: &[Vec<u32>], eos: u32) -> f64 {
        mean_loss_of_documents(windows, eos, |inputs| self.logits(inputs))
    }

    /// The logits of the token after `tokens`, the whole sequence computed
    /// afresh (as transformers computes every position again where
    /// LongRoPE's factors switch).
    pub fn next_logits(&self, tokens: &[u32]) -> Vec<f64> {
        self.logits(tokens).pop().expect("a token")
    }

    fn logits(&self, tokens: &[u32]) -> Vec<Vec<f64>> {
        let Config {
            vocab, d, layers, ..
        } = self.cfg;
        let emb = self.w("model.embed_tokens.weight");
        let mut x: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&tok| emb[tok as usize * d..(tok as usize + 1) * d].to_vec())
            .collect();
        for i in 0..layers {
            let n = |s: &str| format!("model.layers.{i}.{s}.weight");
            let a = self.rms_norm(&x, &n("input_layernorm"));
            // Qwen2's biases go on before the rotation.
            let projection = |name: &str| {
                let y = self.linear(&a, &n(name));
                match self.cfg.qkv_bias {
                    false => y,
                    true => {
                        let b = self.w(&format!("model.layers.{i}.{name}.bias"));
                        y.into_iter()
                            .map(|row| row.iter().zip(b).map(|(y, b)| y + b).collect())
                            .collect()
                    }
                }
            };
            // Qwen3's norms, of each head on its own, go on before it too.
            let head_norm = |y: Vec<Vec<f64>>, name: &str| match self.cfg.qk_norm {
                false => y,
                true => y
                    .iter()
                    .map(|row| {
                        let heads: Vec<Vec<f64>> =
                            row.chunks(self.cfg.hd).map(|h| h.to_vec()).collect();
                        self.rms_norm(&heads, &n(name)).concat()
                    })
                    .collect(),
            };
            let q = self.rotate(head_norm(
                projection("self_attn.q_proj"),
                "self_attn.q_norm",
            ));
            let k = self.rotate(head_norm(
                projection("self_attn.k_proj"),
                "self_attn.k_norm",
            ));
            let v = projection("self_attn.v_proj");
            let att = self.attention(&q, &k, &v);
            add_into(&mut x, &self.linear(&att, &n("self_attn.o_proj")));
            let a = self.rms_norm(&x, &n("post_attention_layernorm"));
            let gate = self.linear(&a, &n("mlp.gate_proj"));
            let up = self.linear(&a, &n("mlp.up_proj"));
            let h: Vec<Vec<f64>> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| {
                    g.iter()
                        .zip(u)
                        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                        .collect()
                })
                .collect();
            add_into(&mut x, &self.linear(&h, &n("mlp.down_proj")));
        }
        let x = self.rms_norm(&x, "model.norm.weight");
        let head = match self.cfg.tied {
            true => emb,
            false => self.w("lm_head.weight"),
        };
        x.iter()
            .map(|row| {
                (0..vocab)
                    .map(|tok| (0..d).map(|j| row[j] * head[tok * d + j]).sum())
                    .collect()
            })
            .collect()
    }

    fn rms_norm(&self, x: &[Vec<f64>], name: &str) -> Vec<Vec<f64>> {
        let g = self.w(name);
        x.iter()
            .map(|row| {
                let ms = row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64;
                let r = 1.0 / (ms + self.cfg.eps).sqrt();
                row.iter().zip(g).map(|(v, g)| v * r * g).collect()
            })
            .collect()
    }

    /// `nn.Linear` without bias: `y = x · Wᵀ` with `W` stored `[out, in]`.
    fn linear(&self, x: &[Vec<f64>], name: &str) -> Vec<Vec<f64>> {
        let w = self.w(name);
        let inputs = x[0].len();
        let out = w.len() / inputs;
        x.iter()
            .map(|row| {
                (0..out)
                    .map(|o| (0..inputs).map(|k| row[k] * w[o * inputs + k]).sum())
                    .collect()
            })
            .collect()
    }

    /// `apply_rotary_pos_emb` on rows of heads: `x·cos + rotate_half(x)·sin`,
    /// with `rotate_half(x) = [-x2, x1]` on the halves of each head's first
    /// `rot` columns (all but in Phi-3's partial rotation, whose other
    /// columns pass: `q[..., rot:]`).
    fn rotate(&self, x: Vec<Vec<f64>>) -> Vec<Vec<f64>> {
        let (hd, rot) = (self.cfg.hd, self.cfg.rot);
        let half = rot / 2;
        let len = x.len();
        x.into_iter()
            .enumerate()
            .map(|(p, row)| {
                let mut out = row.clone();
                for head in 0..row.len() / hd {
                    for i in 0..rot {
                        let inv_freq = self.cfg.frequency(i % half, rot, len);
                        let angle = p as f64 * inv_freq;
                        let scale = self.cfg.rotary_scale();
                        let (c, s) = (scale * angle.cos(), scale * angle.sin());
                        let x = row[head * hd + i];
                        let rotated = if i < half {
                            -row[head * hd + i + half]
                        } else {
                            row[head * hd + i - half]
                        };
                        out[head * hd + i] = x * c + rotated * s;
                    }
                }
                out
            })
            .collect()
    }

    /// Causal attention; query head `h` uses key/value head `h / (heads / kv)`;
    /// with a window, row `i` over keys `i + 1 − window ..= i` alone.
    fn attention(&self, q: &[Vec<f64>], k: &[Vec<f64>], v: &[Vec<f64>]) -> Vec<Vec<f64>> {
        let (heads, hd) = (self.cfg.heads, self.cfg.hd);
        let group = heads / self.cfg.kv_heads;
        let t = q.len();
        let mut out = vec![vec![0.0; heads * hd]; t];
        for h in 0..heads {
            let g = h / group;
            for i in 0..t {
                let first = self.cfg.window.map_or(0, |w| (i + 1).saturating_sub(w));
                let scores: Vec<f64> = (first..=i)
                    .map(|j| {
                        (0..hd)
                            .map(|c| q[i][h * hd + c] * k[j][g * hd + c])
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, p) in (first..).zip(&e) {
                    for c in 0..hd {
                        out[i][h * hd + c] += p / z * v[j][g * hd + c];
                    }
                }
            }
        }
        out
    }
}
