//! Hugging Face's names and layouts for GPT-2 and LLaMA, both ways: `zrun
//! export --format hf` writes a directory that `transformers` loads
//! (`config.json` + `model.safetensors`), and `model.init_from` reads such a
//! directory, or a published safetensors file, into zrun's parameters.
//!
//! One table serves both directions: every zrun parameter is a list of
//! [`Piece`]s, each a run of its output columns that is one Hugging Face
//! tensor, stored transposed or not. GPT-2's `Conv1D` weights are `[in, out]`
//! like zrun's, so each parameter is one untransposed piece under its own
//! name (with `transformer.` in front). LLaMA's `nn.Linear` weights are
//! `[out, in]`: zrun's fused `qkv_proj` becomes `q_proj`, `k_proj`, `v_proj`,
//! `gate_up_proj` becomes `gate_proj`, `up_proj`, each transposed. The
//! rotary embedding uses Hugging Face's layout already (halves of each head),
//! so q and k need no permutation. Qwen3's q and k norms are vectors under
//! their own names. A model that turns only part of each head is written as
//! Phi-3, whose `qkv_proj` and `gate_up_proj` are zrun's, transposed whole.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

use zconfig::hf_config;
use zconfig::spec::{ModelKind, ModelSpec, RopeScaling};

use crate::hf_files::HfFiles;
use crate::stream::StreamWriter;
use crate::{invalid, io, CkptError};

/// The weights file of a Hugging Face model directory.
pub const HF_WEIGHTS: &str = "model.safetensors";
/// The index of one written in shards: `{"weight_map": {tensor: file}}`.
pub const HF_WEIGHTS_INDEX: &str = "model.safetensors.index.json";
/// Its configuration.
pub const HF_CONFIG: &str = zconfig::hf_config::CONFIG_JSON;

/// A run of a zrun parameter's output columns that is one Hugging Face tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// The Hugging Face name.
    pub name: String,
    /// The columns of the zrun parameter (all of a 1-D one).
    pub columns: Range<usize>,
    /// Stored `[out, in]` (`nn.Linear`) rather than `[in, out]`.
    pub transposed: bool,
}

impl Piece {
    /// The Hugging Face tensor's shape, from the zrun parameter's.
    pub fn shape(&self, zrun_shape: &[usize]) -> Vec<usize> {
        match (zrun_shape, self.transposed) {
            ([inputs, _], true) => vec![self.columns.len(), *inputs],
            ([inputs, _], false) => vec![*inputs, self.columns.len()],
            ([_], _) => vec![self.columns.len()],
            _ => zrun_shape.to_vec(),
        }
    }

    /// This piece's values out of the whole zrun parameter.
    fn cut<T: Copy + Default>(&self, shape: &[usize], values: &[T]) -> Vec<T> {
        let c = &self.columns;
        let [inputs, outputs] = *shape else {
            // A vector: its run (Qwen2's q, k and v biases are one).
            return values[c.clone()].to_vec();
        };
        let mut out = vec![T::default(); c.len() * inputs];
        if self.transposed {
            transpose_into(
                &values[c.start..],
                outputs,
                &mut out,
                inputs,
                inputs,
                c.len(),
            );
        } else {
            for (i, row) in out.chunks_exact_mut(c.len()).enumerate() {
                row.copy_from_slice(&values[i * outputs + c.start..i * outputs + c.end]);
            }
        }
        out
    }

    /// Writes this piece's values back into the whole zrun parameter.
    fn put<T: Copy>(&self, shape: &[usize], piece: &[T], values: &mut [T]) {
        let c = &self.columns;
        let [inputs, outputs] = *shape else {
            values[c.clone()].copy_from_slice(piece);
            return;
        };
        if self.transposed {
            transpose_into(
                piece,
                inputs,
                &mut values[c.start..],
                outputs,
                c.len(),
                inputs,
            );
        } else {
            for (i, row) in piece.chunks_exact(c.len()).enumerate() {
                values[i * outputs + c.start..i * outputs + c.end].copy_from_slice(row);
            }
        }
    }
}

/// `dst[j·dst_rs + i] = src[i·src_rs + j]` for `i < rows`, `j < cols`: a
/// `[out, in]` tensor into `[in, out]` columns or back. A square tile of
/// [`TILE`] at a time: its rows of `src` copied whole into a buffer that L1
/// holds, then each of its rows of `dst` written whole from the buffer's
/// column. Element by element, the strided side took a cache line (and,
/// thousands of columns apart, a page walk) per element; tiles transposed
/// in place still lost their lines before using them whole, since rows a
/// power of two apart share L1's sets. The transposes were two thirds of
/// loading a 1.2B-parameter LLaMA (15 of 23 s, perf), and 8 s in place.
fn transpose_into<T: Copy>(
    src: &[T],
    src_rs: usize,
    dst: &mut [T],
    dst_rs: usize,
    rows: usize,
    cols: usize,
) {
    let mut tile: Vec<T> = Vec::with_capacity(TILE * TILE);
    for i0 in (0..rows).step_by(TILE) {
        let r = TILE.min(rows - i0);
        for j0 in (0..cols).step_by(TILE) {
            let c = TILE.min(cols - j0);
            tile.clear();
            for i in i0..i0 + r {
                tile.extend_from_slice(&src[i * src_rs + j0..][..c]);
            }
            for jj in 0..c {
                let out = &mut dst[(j0 + jj) * dst_rs + i0..][..r];
                for (ii, o) in out.iter_mut().enumerate() {
                    *o = tile[ii * c + jj];
                }
            }
        }
    }
}

/// `values` (`rows × cols`, row-major) transposed: `cols × rows`. A sampler
/// holds its head's `[vocab, d]` matrix so, whose one-row product then
/// streams rows rather than columns.
pub fn transposed<T: Copy + Default>(values: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut out = vec![T::default(); rows * cols];
    transpose_into(values, cols, &mut out, rows, rows, cols);
    out
}

/// [`transpose_into`]'s tile side: 32 rows of 32 f32 values, 4 KB.
const TILE: usize = 32;

/// The Hugging Face tensors that zrun parameter `name` of shape `shape` is.
pub fn pieces(m: &ModelSpec, name: &str, shape: &[usize]) -> Vec<Piece> {
    let whole = 0..shape.last().copied().unwrap_or(0);
    let one = |name: String, transposed: bool| {
        vec![Piece {
            name,
            columns: whole.clone(),
            transposed,
        }]
    };
    match m.kind {
        ModelKind::Gpt => one(format!("transformer.{name}"), false),
        ModelKind::Llama => {
            if name == "lm_head.weight" {
                return one(name.into(), false);
            }
            let hf = format!("model.{name}");
            // zrun's fused projection `fused` as Hugging Face's `parts`, side by side.
            let split = |fused: &str, parts: &[(&str, usize)]| {
                let mut at = 0;
                parts
                    .iter()
                    .map(|&(part, width)| {
                        at += width;
                        Piece {
                            name: hf.replace(fused, part),
                            columns: at - width..at,
                            transposed: true,
                        }
                    })
                    .collect()
            };
            let (q, kv) = (m.n_heads * m.head_dim(), m.kv_heads() * m.head_dim());
            let fused = name.ends_with("self_attn.qkv_proj.weight")
                || name.ends_with("mlp.gate_up_proj.weight");
            if fused && exported_as_phi3(m) {
                // Phi-3's own fused tensors: the parts' rows one after the
                // other, as zrun's columns are.
                one(hf, true)
            } else if name.ends_with("self_attn.qkv_proj.weight") {
                split("qkv_proj", &[("q_proj", q), ("k_proj", kv), ("v_proj", kv)])
            } else if name.ends_with("self_attn.qkv_proj.bias") {
                // Qwen2's biases: vectors, cut as the weight's columns.
                let mut parts = split("qkv_proj", &[("q_proj", q), ("k_proj", kv), ("v_proj", kv)]);
                parts.iter_mut().for_each(|p| p.transposed = false);
                parts
            } else if name.ends_with("mlp.gate_up_proj.weight") {
                split(
                    "gate_up_proj",
                    &[("gate_proj", m.ffn()), ("up_proj", m.ffn())],
                )
            } else {
                // Matrices are nn.Linear's; norms and the embedding are as is.
                let linear = name.ends_with("_proj.weight");
                one(hf, linear)
            }
        }
    }
}

/// Hugging Face's `config.json` for `m` (f32 weights): GPT-2's, LLaMA's,
/// for a LLaMA with a sliding window Mistral's, for one with q, k and v
/// biases Qwen2's (which is that model), for one with q and k norms
/// Qwen3's (both with their window keys), for one turning part of each
/// head Phi-3's.
pub fn config_json(m: &ModelSpec) -> serde_json::Value {
    let mut c = match m.kind {
        ModelKind::Gpt => serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": m.vocab_size,
            "n_positions": m.context(),
            "n_ctx": m.context(),
            "n_embd": m.d_model,
            "n_layer": m.n_layers,
            "n_head": m.n_heads,
            "n_inner": m.ffn(),
            "activation_function": "gelu_new",
            "scale_attn_weights": true,
            "scale_attn_by_inverse_layer_idx": false,
            "add_cross_attention": false,
            "layer_norm_epsilon": m.norm_eps(),
            "tie_word_embeddings": true,
            // transformers' GPT-2 drops where zrun does, in training only.
            "resid_pdrop": m.hidden_dropout(),
            "embd_pdrop": m.hidden_dropout(),
            "attn_pdrop": m.attention_dropout(),
            "torch_dtype": "float32",
        }),
        ModelKind::Llama => serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": m.vocab_size,
            "hidden_size": m.d_model,
            "intermediate_size": m.ffn(),
            "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.kv_heads(),
            "head_dim": m.head_dim(),
            "max_position_embeddings": m.context(),
            "rms_norm_eps": m.norm_eps(),
            "rope_theta": m.rope_theta(),
            "hidden_act": "silu",
            "tie_word_embeddings": m.tied(),
            "attention_bias": false,
            "mlp_bias": false,
            "attention_dropout": m.attention_dropout(),
            "torch_dtype": "float32",
        }),
    };
    // A window within the model's context: Mistral's (a LLaMA windowing
    // every layer), or for the families below their own key.
    let window = m.sliding_window.filter(|&w| w < m.context());
    if let Some(w) = window {
        let obj = c.as_object_mut().expect("an object");
        obj.remove("attention_bias");
        obj.remove("mlp_bias");
        c["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        c["model_type"] = "mistral".into();
        c["sliding_window"] = w.into();
    }
    if m.qkv_biased() {
        // Qwen2's config has no `attention_bias` (its q, k and v always
        // have biases, its output projection none) nor `mlp_bias`.
        let obj = c.as_object_mut().expect("an object");
        obj.remove("attention_bias");
        obj.remove("mlp_bias");
        if m.attn_width() == m.d_model {
            obj.remove("head_dim");
        }
        c["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        c["model_type"] = "qwen2".into();
        qwen_window(&mut c, m, window);
    }
    if m.qk_normed() {
        // Qwen3's `attention_bias` would bias the output projection too
        // (the job refuses q, k and v biases with q and k norms).
        c["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
        c["model_type"] = "qwen3".into();
        qwen_window(&mut c, m, window);
    }
    // transformers 4.x's key, which 5.x reads too (into `rope_parameters`).
    if let Some(scaling) = &m.rope_scaling {
        c["rope_scaling"] = serde_json::to_value(scaling).expect("a scaling serialises");
    }
    if exported_as_phi3(m) {
        // The family whose attention turns part of each head (the job
        // refuses a partial rotation with what Phi-3 lacks).
        let obj = c.as_object_mut().expect("an object");
        obj.remove("attention_bias");
        obj.remove("mlp_bias");
        c["architectures"] = serde_json::json!(["Phi3ForCausalLM"]);
        c["model_type"] = "phi3".into();
        c["partial_rotary_factor"] = m.partial_rotary_factor.into();
        // Phi-3's config defaults its padding and end-of-text ids to
        // Phi-3's own vocabulary's (32000): a smaller model's embedding
        // would not load. LLaMA's defaults name none it lacks.
        for key in ["pad_token_id", "bos_token_id", "eos_token_id"] {
            c[key] = serde_json::Value::Null;
        }
        // Phi-3 takes LongRoPE's original context from beside the scaling
        // (4096 where absent), not from within it.
        if let Some(RopeScaling::Longrope {
            original_max_position_embeddings,
            ..
        }) = m.rope_scaling
        {
            c["original_max_position_embeddings"] = original_max_position_embeddings.into();
        }
    }
    c
}

/// Qwen2's and Qwen3's keys for a window on every layer, or on none.
fn qwen_window(c: &mut serde_json::Value, m: &ModelSpec, window: Option<usize>) {
    c["use_sliding_window"] = window.is_some().into();
    c["max_window_layers"] = if window.is_some() { 0 } else { m.n_layers }.into();
    if let (None, Some(o)) = (window, c.as_object_mut()) {
        o.remove("sliding_window");
    }
}

/// Whether `m` is written as Phi-3 (`Phi3ForCausalLM`, q, k and v, and
/// gate and up, one tensor each): a LLaMA that turns only part of each
/// head, which transformers' LLaMA cannot and its Phi-3 can.
fn exported_as_phi3(m: &ModelSpec) -> bool {
    m.kind == ModelKind::Llama && m.rotary_dim() != m.head_dim()
}

/// The model a Hugging Face directory's `config.json` describes
/// ([`zconfig::hf_config::model_spec`]): what `zrun sample` and `zrun eval`
/// run such a directory with.
pub fn model_spec(dir: &Path) -> Result<ModelSpec, CkptError> {
    Ok(zconfig::hf_config::model_spec(dir)?)
}

/// Writes `params` (zrun names, whole, in order; `values(i)` gives the i-th's
/// values) as a Hugging Face directory `out`. Returns the elements written.
pub fn write_dir(
    m: &ModelSpec,
    params: &[(String, Vec<usize>)],
    out: &Path,
    mut next_values: impl FnMut() -> Result<Option<Vec<f32>>, CkptError>,
) -> Result<u64, CkptError> {
    std::fs::create_dir_all(out).map_err(io(out))?;
    let mut header = Vec::new();
    for (name, shape) in params {
        for p in pieces(m, name, shape) {
            header.push((p.name.clone(), p.shape(shape)));
        }
    }
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let weights = out.join(HF_WEIGHTS);
    let mut w = StreamWriter::create(&weights, &header, Some(meta))?;
    let mut elements = 0u64;
    for (name, shape) in params {
        let values = next_values()?
            .ok_or_else(|| invalid(&weights, format!("{name}: no values to write")))?;
        for p in pieces(m, name, shape) {
            w.write(&p.cut(shape, &values))?;
        }
        elements += values.len() as u64;
    }
    w.finish()?;
    let config = serde_json::to_vec_pretty(&config_json(m)).expect("a JSON value serialises");
    crate::write_atomic(&out.join(HF_CONFIG), &config)?;
    Ok(elements)
}

/// The `config.json` keys that must agree with the job's model, each with
/// the job's key it mirrors: the weights' shapes do not show every
/// difference (heads of another width over the same columns, another norm
/// epsilon or rotary base), and weights read into another architecture
/// train on without a word.
const SAME_KEYS: &[(&str, &str)] = &[
    ("model_type", "model.kind, model.qkv_bias, model.qk_norm"),
    ("vocab_size", "model.vocab_size"),
    ("n_embd", "model.d_model"),
    ("hidden_size", "model.d_model"),
    ("n_layer", "model.n_layers"),
    ("num_hidden_layers", "model.n_layers"),
    ("n_head", "model.n_heads"),
    ("num_attention_heads", "model.n_heads"),
    ("num_key_value_heads", "model.n_kv_heads"),
    ("head_dim", "model.head_dim"),
    ("n_inner", "model.ffn_hidden"),
    ("intermediate_size", "model.ffn_hidden"),
    ("layer_norm_epsilon", "model.norm_eps"),
    ("rms_norm_eps", "model.norm_eps"),
    ("rope_theta", "model.rope_theta"),
    ("tie_word_embeddings", "model.tie_embeddings"),
    ("activation_function", "model.kind"),
    ("scale_attn_weights", "model.kind"),
    ("scale_attn_by_inverse_layer_idx", "model.kind"),
    ("add_cross_attention", "model.kind"),
    ("hidden_act", "model.kind"),
    ("attention_bias", "model.kind"),
    ("mlp_bias", "model.kind"),
];

/// The `config.json` keys that give the longest sequence the model takes:
/// at least the job's `model.seq_len`.
const CONTEXT_KEYS: &[&str] = &["n_positions", "n_ctx", "max_position_embeddings"];

/// The ids that end a text for a Hugging Face directory's model: the
/// `eos_token_id` of its `generation_config.json` (what `generate` stops
/// at), else of its `config.json`; one id or a list (LLaMA 3 lists three).
/// Empty where neither says. A value of another kind is an error naming the
/// file.
pub fn eos_token_ids(dir: &Path) -> Result<Vec<u32>, CkptError> {
    for name in ["generation_config.json", HF_CONFIG] {
        let path = dir.join(name);
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io(&path)(e)),
        };
        let c: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| invalid(&path, format!("not JSON: {e}")))?;
        let id = |v: &serde_json::Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        let ids = match c.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => continue,
            Some(serde_json::Value::Array(list)) => list.iter().map(id).collect(),
            Some(v) => id(v).map(|n| vec![n]),
        };
        return ids.ok_or_else(|| {
            invalid(
                &path,
                format!(
                    "eos_token_id is {}: not a token id or a list of them",
                    c["eos_token_id"]
                ),
            )
        });
    }
    Ok(Vec::new())
}

/// The sampling a Hugging Face directory's `generation_config.json` asks of
/// `generate` (each `None` where the file does not say; its other keys are
/// not sampling's).
#[derive(Debug, Default, Clone, PartialEq, serde::Deserialize)]
pub struct GenerationDefaults {
    /// Whether to sample at all: `generate` is greedy unless it is `true`.
    pub do_sample: Option<bool>,
    /// Softmax temperature.
    pub temperature: Option<f64>,
    /// Draw among the K most likely tokens (0: all).
    pub top_k: Option<usize>,
    /// Nucleus sampling's probability mass.
    pub top_p: Option<f64>,
    /// Draw among the tokens at least this share of the likeliest's
    /// probability.
    pub min_p: Option<f64>,
    /// CTRL's penalty on the tokens already in the text (greedy too).
    pub repetition_penalty: Option<f64>,
    /// Strings that end the text (`stop_strings`: one, or a list).
    #[serde(skip)]
    pub stop_strings: Vec<String>,
    /// The keys that ask `generate` for what `zrun sample` does not do
    /// (beam search, n-gram bans, typical sampling...), each as `key:
    /// value`: said, never dropped silently.
    #[serde(skip)]
    pub unapplied: Vec<String>,
}

/// The `generation_config.json` keys that change what `generate` draws and
/// that `zrun sample` does not do, each with the value that asks for
/// nothing (beyond `null`) and whether it counts only when sampling.
const UNAPPLIED: [(&str, Option<f64>, bool); 15] = [
    ("num_beams", Some(1.0), false),
    ("no_repeat_ngram_size", Some(0.0), false),
    ("typical_p", Some(1.0), true),
    ("epsilon_cutoff", Some(0.0), true),
    ("eta_cutoff", Some(0.0), true),
    ("top_h", None, true),
    ("min_length", Some(0.0), false),
    ("min_new_tokens", Some(0.0), false),
    ("bad_words_ids", None, false),
    ("suppress_tokens", None, false),
    ("begin_suppress_tokens", None, false),
    ("sequence_bias", None, false),
    ("forced_bos_token_id", None, false),
    ("forced_eos_token_id", None, false),
    ("exponential_decay_length_penalty", None, false),
];

/// The directory's `generation_config.json` sampling keys (`None` without
/// the file); a value of another kind is an error naming the file.
pub fn generation_defaults(dir: &Path) -> Result<Option<GenerationDefaults>, CkptError> {
    let path = dir.join("generation_config.json");
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(&path)(e)),
    };
    let bad = |e: serde_json::Error| invalid(&path, format!("not a generation config: {e}"));
    let json: serde_json::Value = serde_json::from_slice(&text).map_err(bad)?;
    let mut defaults: GenerationDefaults = serde_json::from_value(json.clone()).map_err(bad)?;
    defaults.stop_strings = match json.get("stop_strings") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::String(s)) => vec![s.clone()],
        Some(serde_json::Value::Array(list)) if list.iter().all(|s| s.is_string()) => list
            .iter()
            .filter_map(|s| s.as_str().map(String::from))
            .collect(),
        Some(other) => {
            return Err(invalid(
                &path,
                format!("stop_strings is {other}: give a string or a list of strings"),
            ))
        }
    };
    defaults.unapplied = UNAPPLIED
        .iter()
        .filter(|&&(_, _, sampling_only)| !sampling_only || defaults.do_sample == Some(true))
        .filter_map(|&(key, neutral, _)| {
            let v = json.get(key).filter(|v| !v.is_null())?;
            (neutral.is_none() || v.as_f64() != neutral).then(|| format!("{key}: {v}"))
        })
        .collect();
    Ok(Some(defaults))
}

/// What the `config.json` beside a weights file given alone says against
/// the job's model `m`, if it disagrees (where the directory given would
/// be refused): the file alone is read as the job's model says, which
/// is how weights of LLaMA's layout under another `model_type` are given,
/// so this is for a warning, not a refusal.
pub fn config_beside_disagrees(m: &ModelSpec, file: &Path) -> Option<String> {
    let dir = file.parent().filter(|_| file.is_file())?;
    check_config(m, dir).err().map(|e| e.to_string())
}

/// The dropout a Hugging Face `config.json` at or beside `init_from` trains
/// with that the job `m` leaves unset (zrun does not take it, as it takes
/// the architecture): each such key with its value and the zrun key that
/// would set it, `None` where there is none (or no readable file). GPT-2's
/// `resid_pdrop`, `embd_pdrop` and `attn_pdrop` (0.1 in the published
/// model) and LLaMA's, Qwen's and Phi-3's `attention_dropout`.
pub fn dropout_not_taken(m: &ModelSpec, init_from: &Path) -> Option<String> {
    let path = match init_from.is_dir() {
        true => init_from.join(HF_CONFIG),
        false => init_from.parent()?.join(HF_CONFIG),
    };
    let file: serde_json::Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    let keys = [
        ("resid_pdrop", "model.hidden_dropout", m.hidden_dropout),
        ("embd_pdrop", "model.hidden_dropout", m.hidden_dropout),
        ("attn_pdrop", "model.attention_dropout", m.attention_dropout),
        (
            "attention_dropout",
            "model.attention_dropout",
            m.attention_dropout,
        ),
    ];
    let said: Vec<String> = keys
        .iter()
        .filter(|(_, _, job)| job.is_none())
        .filter_map(|(key, ours, _)| {
            let v = file.get(key)?.as_f64().filter(|&v| v > 0.0)?;
            Some(format!("{key} {v} ({ours})"))
        })
        .collect();
    (!said.is_empty()).then(|| said.join(", "))
}

/// Holds a Hugging Face directory's `config.json`, where it has one, to the
/// job's model `m`: each of [`SAME_KEYS`] that both have (and the file does
/// not leave null, Hugging Face's "the default") equal, its context at least
/// the job's sequence, and its rotary scaling the job's. An error names the
/// file, its key and value, and the job's.
fn check_config(m: &ModelSpec, dir: &Path) -> Result<(), CkptError> {
    let path = dir.join(HF_CONFIG);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(&path)(e)),
    };
    let file: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| invalid(&path, format!("not a Hugging Face config.json: {e}")))?;
    let file = hf_config::lift_rope_theta(file).map_err(|e| invalid(&path, e))?;
    // Read before Phi-3's family is set aside below: it says how its
    // scaling reads.
    let scaling = hf_config::rope_scaling(&file, m.rotary_dim());
    let partial = hf_config::partial_rotary_factor(&file).map_err(|e| invalid(&path, e))?;
    let want = m.partial_rotary_factor.unwrap_or(1.0);
    if partial != want {
        return Err(invalid(
            &path,
            format!(
                "partial_rotary_factor is {partial}, the job's model has {want} (model.partial_rotary_factor): set the job's model to the directory's"
            ),
        ));
    }
    // A window the sequences of the job reach (the directory's and the
    // job's: the same, or both beyond them).
    let window = hf_config::sliding_window(&file).map_err(|e| invalid(&path, e))?;
    let reached = |w: Option<usize>| w.filter(|&w| w < m.seq_len);
    if reached(window) != reached(m.sliding_window) {
        let show = |w: Option<usize>| w.map_or("none".to_string(), |w| w.to_string());
        return Err(invalid(
            &path,
            format!(
                "its sliding window is {}, the job's model.sliding_window {} (with model.seq_len {}): \
                 set the job's model to the directory's",
                show(window),
                show(m.sliding_window),
                m.seq_len
            ),
        ));
    }
    let mut job = config_json(m);
    let same = |a: &serde_json::Value, b: &serde_json::Value| match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => (x - y).abs() <= 1e-9 * x.abs().max(y.abs()),
        _ => a == b,
    };
    // Mistral's names and layout are LLaMA's (a window aside, held above),
    // Phi-3's too with q, k and v (and gate and up) in one tensor each.
    let mut file = file;
    for c in [&mut file, &mut job] {
        if c["model_type"] == "mistral" {
            c["model_type"] = "llama".into();
        }
        if let Some(o) = c.as_object_mut() {
            o.remove("use_sliding_window");
        }
    }
    if file["model_type"] == "phi3" && job["model_type"] != "phi3" {
        // As LLaMA, unless the job's model is Phi-3 itself (a partial
        // rotation).
        file["model_type"] = "llama".into();
    }
    for (key, job_key) in SAME_KEYS {
        if let (Some(have), Some(want)) = (file.get(key), job.get(key)) {
            if !have.is_null() && !same(have, want) {
                let advice = match *key {
                    "model_type" => {
                        "zrun reads gpt2, llama, mistral and phi3, qwen2 (model.kind: \
                         llama with model.qkv_bias: true) and qwen3 (with \
                         model.qk_norm: true and model.head_dim); weights of the same \
                         names and layout can be given as the model.safetensors file alone"
                    }
                    _ => "set the job's model to the directory's",
                };
                return Err(invalid(
                    &path,
                    format!("{key} is {have}, the job's model has {want} ({job_key}): {advice}"),
                ));
            }
        }
    }
    for key in CONTEXT_KEYS {
        if let Some(n) = file.get(key).and_then(serde_json::Value::as_u64) {
            if n < m.seq_len as u64 {
                return Err(invalid(
                    &path,
                    format!(
                        "{key} is {n}, shorter than the job's model.seq_len {}",
                        m.seq_len
                    ),
                ));
            }
        }
    }
    let scaling = scaling.map_err(|refusal| invalid(&path, refusal))?;
    if scaling != m.rope_scaling {
        let show = |s: &Option<RopeScaling>| match s {
            Some(s) => serde_json::to_string(s).expect("a scaling serialises"),
            None => "none".into(),
        };
        return Err(invalid(
            &path,
            format!(
                "its rotary scaling is {}, the job's model.rope_scaling {}: set the job's model to the directory's",
                show(&scaling),
                show(&m.rope_scaling)
            ),
        ));
    }
    Ok(())
}

/// Tensors of published checkpoints that hold no parameter: GPT-2's causal
/// mask buffers, old LLaMA conversions' rotary frequencies.
pub(crate) fn is_buffer(name: &str) -> bool {
    name.ends_with(".attn.bias")
        || name.ends_with(".attn.masked_bias")
        || name.ends_with("rotary_emb.inv_freq")
}

/// Hugging Face weights (a directory with `model.safetensors` or the shards
/// of `model.safetensors.index.json`, or a safetensors file) opened for a
/// model: every parameter's pieces found and their shapes checked from the
/// headers, each parameter read only when asked for, so that a worker never
/// holds more of the file than the parameter it is installing.
pub struct HfWeights {
    files: HfFiles,
    /// Parameter name → where its values are.
    mapped: HashMap<String, Mapped>,
}

/// One parameter's shape and its pieces, each with the file's name for it
/// (GPT-2's with or without `transformer.`).
struct Mapped {
    shape: Vec<usize>,
    pieces: Vec<(Piece, String)>,
}

impl HfWeights {
    /// Opens the weights in `path` for the model `m` whose parameters are
    /// `params` (zrun names and shapes). An error names the first missing or
    /// misshapen tensor, or a tensor that belongs to no parameter, and the
    /// file.
    pub fn open(
        m: &ModelSpec,
        params: &[(String, Vec<usize>)],
        path: &Path,
    ) -> Result<HfWeights, CkptError> {
        if path.is_dir() {
            check_config(m, path)?;
        }
        let files = HfFiles::open(path)?;
        let have = files.shapes();
        // GPT-2 files are published with and without the `transformer.` prefix.
        let lookup = |hf: &str| -> Option<String> {
            if have.contains_key(hf) {
                return Some(hf.to_string());
            }
            let bare = hf.strip_prefix("transformer.")?;
            have.contains_key(bare).then(|| bare.to_string())
        };
        let mut used = std::collections::HashSet::new();
        let mut mapped = HashMap::new();
        for (name, shape) in params {
            let mut found_pieces = Vec::new();
            let mut parts = pieces(m, name, shape);
            // Phi-3 keeps q, k and v (and gate and up) in one tensor each,
            // as zrun does: taken whole where the parts are absent.
            let fused = format!("model.{name}");
            if parts.len() > 1 && lookup(&parts[0].name).is_none() && have.contains_key(&fused) {
                parts = vec![Piece {
                    name: fused,
                    columns: 0..shape.last().copied().unwrap_or(0),
                    transposed: parts[0].transposed,
                }];
            }
            for p in parts {
                let want = p.shape(shape);
                let found = lookup(&p.name).ok_or_else(|| {
                    invalid(
                        files.path_of(&p.name),
                        format!("no tensor {} (the model's {name})", p.name),
                    )
                })?;
                if have[&found] != want {
                    return Err(invalid(
                        files.path_of(&found),
                        format!(
                            "{found} has shape {:?}, the model's {name} needs {want:?}",
                            have[&found]
                        ),
                    ));
                }
                used.insert(found.clone());
                found_pieces.push((p, found));
            }
            mapped.insert(
                name.clone(),
                Mapped {
                    shape: shape.clone(),
                    pieces: found_pieces,
                },
            );
        }
        // A tied model's file may carry its head anyway: accepted if it is the
        // embedding, else the file's model was untied.
        if m.tied() && have.contains_key("lm_head.weight") {
            let table = format!("{}.weight", m.token_table_name());
            let embedding = pieces(m, &table, &[m.vocab_size, m.d_model])
                .into_iter()
                .find_map(|p| lookup(&p.name));
            if let Some(embedding) = embedding {
                if files.read("lm_head.weight")? == files.read(&embedding)? {
                    used.insert("lm_head.weight".to_string());
                }
            }
        }
        let mut extra: Vec<&String> = have
            .keys()
            .filter(|n| !used.contains(*n) && !is_buffer(n))
            .collect();
        extra.sort();
        if let Some(first) = extra.first() {
            return Err(invalid(
                files.path_of(first),
                format!(
                    "{first} belongs to no parameter of this model ({} such tensors){}",
                    extra.len(),
                    match first.as_str() {
                        "lm_head.weight" => "; it is not the embedding, so the file's head is untied (model.tie_embeddings: false)",
                        _ => "",
                    }
                ),
            ));
        }
        Ok(HfWeights { files, mapped })
    }

    /// The zrun parameter `name`'s values, put together from its pieces.
    pub fn read(&self, name: &str) -> Result<Vec<f32>, CkptError> {
        let read = |file_name: &str| self.files.read(file_name).map(Some);
        Ok(self.assemble(name, read)?.unwrap_or_default())
    }

    /// [`HfWeights::read`] as bf16 bits where every piece is stored in bf16
    /// (as most published weights are), else `None`.
    pub fn read_bf16(&self, name: &str) -> Result<Option<Vec<u16>>, CkptError> {
        self.assemble(name, |file_name| self.files.read_bf16(file_name))
    }

    /// Parameter `name` put together from its pieces as `read` gives them;
    /// `None` where `read` gives `None` for a piece.
    fn assemble<T: Copy + Default>(
        &self,
        name: &str,
        read: impl Fn(&str) -> Result<Option<Vec<T>>, CkptError>,
    ) -> Result<Option<Vec<T>>, CkptError> {
        let Mapped { shape, pieces } = self.mapped.get(name).ok_or_else(|| {
            invalid(
                self.files.path_of(name),
                format!("the model has no parameter {name}"),
            )
        })?;
        if let [(p, file_name)] = &pieces[..] {
            if !p.transposed && p.columns.len() == shape.last().copied().unwrap_or(0) {
                // The tensor is the parameter (an embedding, a norm): no copy.
                return read(file_name);
            }
        }
        let mut whole = vec![T::default(); shape.iter().product()];
        for (p, file_name) in pieces {
            let Some(piece) = read(file_name)? else {
                return Ok(None);
            };
            p.put(shape, &piece, &mut whole);
        }
        Ok(Some(whole))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens `path` for `m` and, with `values`, reads every parameter
    /// (else every value list is empty).
    fn read(
        m: &ModelSpec,
        params: &[(String, Vec<usize>)],
        path: &Path,
        values: bool,
    ) -> Result<crate::Weights, CkptError> {
        let w = HfWeights::open(m, params, path)?;
        params
            .iter()
            .map(|(n, s)| {
                let v = if values { w.read(n)? } else { Vec::new() };
                Ok((n.clone(), (s.clone(), v)))
            })
            .collect()
    }

    fn llama() -> ModelSpec {
        serde_json::from_value(serde_json::json!({
            "kind": "llama", "vocab_size": 16, "d_model": 8, "n_layers": 1,
            "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 6
        }))
        .unwrap()
    }

    /// [`llama`] as Qwen3: heads of 4 (twice `d / heads`), q and k normed.
    fn qwen3() -> ModelSpec {
        ModelSpec {
            head_dim: Some(4),
            qk_norm: Some(true),
            ..llama()
        }
    }

    /// `m` written as a Hugging Face directory (every value 0.5), and its
    /// parameters' names and shapes.
    fn a_directory_of(m: &ModelSpec) -> (tempfile::TempDir, Vec<(String, Vec<usize>)>) {
        let d = tempfile::tempdir().unwrap();
        let params = m.param_shapes();
        let mut shapes = params.iter();
        write_dir(m, &params, d.path(), || {
            Ok(shapes
                .next()
                .map(|(_, s)| vec![0.5; s.iter().product::<usize>()]))
        })
        .unwrap();
        (d, params)
    }

    /// `m` written as a Hugging Face directory whose values are `value(i)`
    /// for i = 1, 2, ... through its parameters in order (every value
    /// distinct where `value` keeps them so), and its parameters.
    fn a_directory_counting(
        m: &ModelSpec,
        value: impl Fn(u32) -> f32,
    ) -> (tempfile::TempDir, Vec<(String, Vec<usize>)>) {
        let d = tempfile::tempdir().unwrap();
        let params = m.param_shapes();
        let mut next = 0u32;
        let mut shapes = params.iter();
        write_dir(m, &params, d.path(), || {
            Ok(shapes.next().map(|(_, s)| {
                (0..s.iter().product::<usize>())
                    .map(|_| {
                        next += 1;
                        value(next)
                    })
                    .collect()
            }))
        })
        .unwrap();
        (d, params)
    }

    /// Phi-3: LLaMA's layout with q, k and v (and gate and up) stored as
    /// one tensor each, rows of the parts one after the other, its context
    /// capped by its window: read as the LLaMA directory of the same
    /// values, value for value; a partial rotation of heads too narrow for
    /// it refused, and one in a LLaMA's config.
    #[test]
    fn a_phi3_directory_reads_as_the_llama_of_its_values() {
        let m = llama();
        let (d, params) = a_directory_counting(&m, |i| i as f32 / 64.0);
        let wants: Vec<Vec<f32>> = {
            let w = HfWeights::open(&m, &params, d.path()).unwrap();
            params
                .iter()
                .map(|(name, _)| w.read(name).unwrap())
                .collect()
        };
        // The same tensors, the parts of each projection fused.
        let path = d.path().join(HF_WEIGHTS);
        let file = crate::TensorFile::open(&path).unwrap();
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
        for (name, shape) in file.tensors() {
            let values = file.read(&name).unwrap();
            let fused = [
                ("q_proj", "qkv_proj"),
                ("k_proj", "qkv_proj"),
                ("v_proj", "qkv_proj"),
                ("gate_proj", "gate_up_proj"),
                ("up_proj", "gate_up_proj"),
            ]
            .iter()
            .find_map(|(part, whole)| {
                name.contains(&format!(".{part}."))
                    .then(|| name.replace(part, whole))
            });
            match fused.and_then(|f| tensors.iter_mut().find(|t| t.0 == f).map(|t| (f, t))) {
                // A later part: its rows after the earlier parts'.
                Some((_, t)) => {
                    t.1[0] += shape[0];
                    t.2.extend(values);
                }
                None => {
                    let name = [("q_proj", "qkv_proj"), ("gate_proj", "gate_up_proj")]
                        .iter()
                        .fold(name.clone(), |n, (part, whole)| n.replace(part, whole));
                    tensors.push((name, shape, values));
                }
            }
        }
        drop(file);
        assert_eq!(tensors.len(), params.len(), "one tensor a parameter");
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .into_iter()
            .map(|(n, s, v)| (n, s, bytemuck::cast_slice(&v).to_vec()))
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
            .iter()
            .map(|(n, s, b)| {
                let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
                (n.clone(), v.unwrap())
            })
            .collect();
        safetensors::serialize_to_file(views, None, &path).unwrap();
        let mut c = config_json(&m);
        c["model_type"] = "phi3".into();
        c["sliding_window"] = 47.into();
        c["max_position_embeddings"] = 64.into();
        std::fs::write(d.path().join(HF_CONFIG), c.to_string()).unwrap();
        let phi3 = model_spec(d.path()).unwrap();
        assert_eq!(
            (
                phi3.seq_len,
                phi3.sliding_window,
                phi3.n_heads,
                phi3.kv_heads()
            ),
            (64, Some(47), 4, 2)
        );
        let w = HfWeights::open(&phi3, &params, d.path()).unwrap();
        for ((name, _), want) in params.iter().zip(&wants) {
            assert_eq!(&w.read(name).unwrap(), want, "{name}");
        }
        for (key, value) in [
            ("partial_rotary_factor", serde_json::json!(0.75)),
            (
                "rope_parameters",
                serde_json::json!({"partial_rotary_factor": 0.5}),
            ),
        ] {
            let mut c = c.clone();
            c[key] = value;
            std::fs::write(d.path().join(HF_CONFIG), c.to_string()).unwrap();
            // Heads of 2 turn one column: no pair.
            let e = model_spec(d.path()).unwrap_err().to_string();
            assert!(
                e.contains("partial_rotary_factor turns 1 of each head's 2 columns"),
                "{key}: {e}"
            );
            // LLaMA's turns the whole head.
            c["model_type"] = "llama".into();
            std::fs::write(d.path().join(HF_CONFIG), c.to_string()).unwrap();
            let e = model_spec(d.path()).unwrap_err().to_string();
            assert!(
                e.contains("transformers' llama turns the whole of each head"),
                "{key}: {e}"
            );
        }
    }

    /// The keys and shapes of Phi-3.5-mini's and Phi-4-mini's published
    /// `config.json` (their own widths, heads, contexts and 48 factors a
    /// list; the factors' values here are not theirs): read with the
    /// rotary width (96: all of Phi-3.5's heads, 0.75 of Phi-4-mini's 128),
    /// LongRoPE's factor filled in as 131072 / 4096 and its attention
    /// factor `sqrt(1 + ln 32 / ln 4096)`, the context the positions (the
    /// window is longer), Phi-4-mini's head tied.
    #[test]
    fn phi_3_5_and_phi_4_mini_configs_read_as_published() {
        use serde_json::json;
        let factors: Vec<f64> = (0..48).map(|i| 1.0 + i as f64 / 8.0).collect();
        let scaling = json!({"type": "longrope", "short_factor": factors, "long_factor": factors});
        let common = json!({
            "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
            "hidden_size": 3072, "num_hidden_layers": 32, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "sliding_window": 262144, "rope_theta": 10000.0, "rope_scaling": scaling,
            "attention_bias": false, "bos_token_id": 1, "pad_token_id": 32000
        });
        let with = |extra: serde_json::Value| {
            let mut c = common.clone();
            c.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            c
        };
        let phi35 = with(json!({
            "vocab_size": 32064, "num_attention_heads": 32, "num_key_value_heads": 32,
            "intermediate_size": 8192, "tie_word_embeddings": false, "eos_token_id": 32000
        }));
        let phi4_mini = with(json!({
            "vocab_size": 200064, "num_attention_heads": 24, "num_key_value_heads": 8,
            "intermediate_size": 8192, "tie_word_embeddings": true, "eos_token_id": 199999,
            "partial_rotary_factor": 0.75, "pad_token_id": 199999
        }));
        let d = tempfile::tempdir().unwrap();
        for (config, head, kv, tied) in [(phi35, 96, 32, false), (phi4_mini, 128, 8, true)] {
            std::fs::write(d.path().join(HF_CONFIG), config.to_string()).unwrap();
            let m = model_spec(d.path()).unwrap();
            assert_eq!(
                (
                    m.head_dim(),
                    m.rotary_dim(),
                    m.kv_heads(),
                    m.tied(),
                    m.seq_len
                ),
                (head, 96, kv, tied, 131072)
            );
            let Some(RopeScaling::Longrope {
                factor,
                original_max_position_embeddings: 4096,
                ..
            }) = m.rope_scaling
            else {
                panic!("{:?}", m.rope_scaling)
            };
            assert_eq!(factor, 32.0);
            let rotary = m.rotary(4096);
            assert_eq!(rotary.inv_freq.len(), 48);
            let attention = (1.0 + 32f64.ln() / 4096f64.ln()).sqrt();
            assert!((rotary.scale - attention).abs() < 1e-12, "{}", rotary.scale);
        }
    }

    /// A model that turns part of each head (Phi-4-mini's
    /// `partial_rotary_factor`; heads of 8, half turned) is written as
    /// Phi-3, q, k and v and gate and up fused as Phi-3 stores them, and
    /// reads back as itself, value for value; a job that turns the whole
    /// head is refused naming both.
    #[test]
    fn a_partial_rotation_is_written_and_read_as_phi3() {
        let m: ModelSpec = serde_json::from_value(serde_json::json!({
            "kind": "llama", "vocab_size": 16, "d_model": 16, "n_layers": 1,
            "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 6, "partial_rotary_factor": 0.5
        }))
        .unwrap();
        let (d, params) = a_directory_counting(&m, |i| i as f32 / 64.0);
        let c: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.path().join(HF_CONFIG)).unwrap()).unwrap();
        assert_eq!(
            (&c["model_type"], &c["partial_rotary_factor"]),
            (&serde_json::json!("phi3"), &serde_json::json!(0.5))
        );
        // Not Phi-3's defaults, 32000, past this vocabulary (transformers
        // would not build the embedding).
        for key in ["pad_token_id", "eos_token_id"] {
            assert_eq!(c.get(key), Some(&serde_json::Value::Null), "{key}");
        }
        let names = crate::TensorFile::open(&d.path().join(HF_WEIGHTS))
            .unwrap()
            .tensors()
            .into_iter()
            .map(|(n, _)| n)
            .collect::<Vec<_>>();
        assert!(
            names.contains(&"model.layers.0.self_attn.qkv_proj.weight".to_string())
                && names.contains(&"model.layers.0.mlp.gate_up_proj.weight".to_string())
                && !names
                    .iter()
                    .any(|n| n.contains(".q_proj.") || n.contains(".up_proj.")),
            "{names:?}"
        );
        let back = model_spec(d.path()).unwrap();
        assert_eq!(
            (back.partial_rotary_factor, back.param_shapes()),
            (m.partial_rotary_factor, m.param_shapes())
        );
        // Each parameter's values as written: the count on from the last.
        let values = read(&m, &params, d.path(), true).unwrap();
        let mut next = 0u32;
        for (name, shape) in &params {
            let want: Vec<f32> = (0..shape.iter().product::<usize>())
                .map(|_| {
                    next += 1;
                    next as f32 / 64.0
                })
                .collect();
            assert_eq!(values[name].1, want, "{name}");
        }
        let whole = ModelSpec {
            partial_rotary_factor: None,
            ..m.clone()
        };
        let e = read(&whole, &params, d.path(), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("partial_rotary_factor is 0.5, the job's model has 1"),
            "{e}"
        );
    }

    /// LongRoPE read as transformers 5.25 reads it: Phi-3.5's config (4.x's
    /// `rope_scaling` of `type: longrope`, the original context beside it,
    /// no factor: the context over the original, 512 / 16), Phi-3-128k's
    /// older `su`,
    /// transformers 5's `rope_parameters` (the original beside it over the
    /// one within, as transformers' standardisation takes it), a Phi-3 with
    /// no original (its class default, 4096), a LLaMA's with its own
    /// factor; and YaRN's original context defaulting to the model's. Each
    /// written back as transformers reads it, and a job with another
    /// factor refused.
    #[test]
    fn longrope_reads_as_transformers_reads_it() {
        use serde_json::json;
        let m = llama();
        let (d, params) = a_directory_of(&m);
        let phi3 = {
            let mut c = config_json(&m);
            c["model_type"] = "phi3".into();
            c["max_position_embeddings"] = 512.into();
            c
        };
        let longrope = |factor, old| RopeScaling::Longrope {
            factor,
            original_max_position_embeddings: old,
            short_factor: vec![1.5],
            long_factor: vec![4.0],
            attention_factor: None,
        };
        let factors = json!({"short_factor": [1.5], "long_factor": [4.0]});
        let with = |base: &serde_json::Value, fields: &[(&str, serde_json::Value)]| {
            let mut c = base.clone();
            for (k, v) in fields {
                c[*k] = v.clone();
            }
            c
        };
        let scaling = |kind: &str, extra: serde_json::Value| {
            let mut s = factors.clone();
            s["type"] = kind.into();
            s.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            s
        };
        let beside = ("original_max_position_embeddings", json!(16));
        for (config, want) in [
            (
                with(
                    &phi3,
                    &[
                        ("rope_scaling", scaling("longrope", json!({}))),
                        beside.clone(),
                    ],
                ),
                longrope(32.0, 16),
            ),
            (
                with(
                    &phi3,
                    &[("rope_scaling", scaling("su", json!({}))), beside.clone()],
                ),
                longrope(32.0, 16),
            ),
            (
                with(
                    &phi3,
                    &[
                        ("rope_scaling", serde_json::Value::Null),
                        (
                            "rope_parameters",
                            json!({"rope_type": "longrope", "rope_theta": 10000.0,
                                   "original_max_position_embeddings": 32,
                                   "short_factor": [1.5], "long_factor": [4.0]}),
                        ),
                        beside.clone(),
                    ],
                ),
                longrope(32.0, 16),
            ),
            (
                with(
                    &phi3,
                    &[
                        ("rope_scaling", scaling("longrope", json!({}))),
                        ("max_position_embeddings", json!(8192)),
                    ],
                ),
                longrope(2.0, 4096),
            ),
            (
                with(
                    &config_json(&m),
                    &[(
                        "rope_scaling",
                        scaling(
                            "longrope",
                            json!({"factor": 3.0, "original_max_position_embeddings": 8,
                                   "attention_factor": 1.25}),
                        ),
                    )],
                ),
                RopeScaling::Longrope {
                    factor: 3.0,
                    original_max_position_embeddings: 8,
                    short_factor: vec![1.5],
                    long_factor: vec![4.0],
                    attention_factor: Some(1.25),
                },
            ),
            (
                with(
                    &config_json(&m),
                    &[("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0}))],
                ),
                RopeScaling::Yarn {
                    factor: 4.0,
                    original_max_position_embeddings: m.seq_len,
                    beta_fast: None,
                    beta_slow: None,
                    attention_factor: None,
                    mscale: None,
                    mscale_all_dim: None,
                    truncate: None,
                },
            ),
        ] {
            std::fs::write(d.path().join(HF_CONFIG), config.to_string()).unwrap();
            let read_back = model_spec(d.path()).unwrap();
            assert_eq!(read_back.rope_scaling.as_ref(), Some(&want), "{config}");
            // The job of that scaling reads the directory; one of another
            // factor does not.
            let job = ModelSpec {
                rope_scaling: Some(want.clone()),
                ..m.clone()
            };
            read(&job, &params, d.path(), false).unwrap();
            let mut other = want.clone();
            if let RopeScaling::Longrope { factor, .. } | RopeScaling::Yarn { factor, .. } =
                &mut other
            {
                *factor += 1.0;
            }
            let job = ModelSpec {
                rope_scaling: Some(other),
                ..m.clone()
            };
            let e = read(&job, &params, d.path(), false)
                .unwrap_err()
                .to_string();
            assert!(e.contains("its rotary scaling is"), "{e}");
            // Written back, read the same.
            let again = config_json(&read_back);
            std::fs::write(d.path().join(HF_CONFIG), again.to_string()).unwrap();
            assert_eq!(model_spec(d.path()).unwrap(), read_back, "{again}");
        }
    }

    /// Published weights in bf16: each parameter read as its bf16 bits,
    /// put together from its pieces (a LLaMA's q, k and v transposed into
    /// one matrix), is the parameter read as f32, value for value; a file
    /// in f32 gives no bits.
    #[test]
    fn bf16_weights_read_as_their_bits_are_their_f32_values() {
        let m = llama();
        let (d, params) =
            a_directory_counting(&m, |i| half::bf16::from_f32(i as f32 / 64.0 - 3.0).to_f32());
        let f32_file = d.path().join(HF_WEIGHTS);
        let f32_weights = HfWeights::open(&m, &params, d.path()).unwrap();
        assert_eq!(f32_weights.read_bf16(&params[1].0).unwrap(), None);
        let wants: Vec<Vec<f32>> = params
            .iter()
            .map(|(name, _)| f32_weights.read(name).unwrap())
            .collect();
        drop(f32_weights);
        // The same tensors stored in bf16.
        let file = crate::TensorFile::open(&f32_file).unwrap();
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = file
            .tensors()
            .into_iter()
            .map(|(name, shape)| {
                let bits: Vec<u16> = file
                    .read(&name)
                    .unwrap()
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                (name, shape, bytemuck::cast_slice(&bits).to_vec())
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
            .iter()
            .map(|(n, s, b)| {
                let v =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), b);
                (n.clone(), v.unwrap())
            })
            .collect();
        drop(file);
        safetensors::serialize_to_file(views, None, &f32_file).unwrap();
        // Through `init_from`'s reader, which the sampler uses.
        let bf16 = crate::InitWeights::open(d.path(), &m, &params).unwrap();
        for ((name, _), want) in params.iter().zip(wants) {
            let widened: Vec<f32> = bf16
                .read_bf16(name)
                .unwrap()
                .unwrap()
                .iter()
                .map(|&b| half::bf16::from_bits(b).to_f32())
                .collect();
            assert_eq!(widened, want, "{name}");
            assert_eq!(
                crate::WeightSource::read(&bf16, name).unwrap(),
                want,
                "{name}"
            );
        }
    }

    #[test]
    fn tiled_transposes_move_every_element_to_its_place() {
        // Over several tiles each way with partial tiles at the ends, from
        // and into rows wider than the transposed block.
        let (rows, cols, src_rs, dst_rs) = (70, 45, 50, 75);
        let src: Vec<u32> = (0..rows * src_rs).map(|v| v as u32).collect();
        let mut dst = vec![u32::MAX; cols * dst_rs];
        transpose_into(&src, src_rs, &mut dst, dst_rs, rows, cols);
        for j in 0..cols {
            for i in 0..dst_rs {
                let want = if i < rows {
                    src[i * src_rs + j]
                } else {
                    u32::MAX
                };
                assert_eq!(dst[j * dst_rs + i], want, "dst[{j}][{i}]");
            }
        }
        assert_eq!(transposed(&[1, 2, 3, 4, 5, 6], 2, 3), [1, 4, 2, 5, 3, 6]);
        // A LLaMA's q, k and v pieces of a parameter wider than a tile.
        let m: ModelSpec = serde_json::from_value(serde_json::json!({
            "kind": "llama", "vocab_size": 16, "d_model": 40, "n_layers": 1,
            "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 6
        }))
        .unwrap();
        let shape = [40, 80];
        let values: Vec<f32> = (0..40 * 80).map(|v| v as f32).collect();
        let p = pieces(&m, "layers.0.self_attn.qkv_proj.weight", &shape);
        // k_proj (columns 40..60, stored [20, 40]): k[j][i] = W[i][40 + j].
        let k = p[1].cut(&shape, &values);
        assert_eq!((k[0], k[1], k[40], k[799]), (40.0, 120.0, 41.0, 3179.0));
        let mut back = vec![0f32; values.len()];
        for piece in &p {
            piece.put(&shape, &piece.cut(&shape, &values), &mut back);
        }
        assert_eq!(back, values);
        // A run of columns stored as it is ([in, out]): its rows' runs.
        let plain = Piece {
            name: "x".into(),
            columns: 50..70,
            transposed: false,
        };
        let cut = plain.cut(&shape, &values);
        assert_eq!(
            (cut.len(), cut[0], cut[19], cut[20]),
            (800, 50.0, 69.0, 130.0)
        );
        let mut back = vec![0f32; values.len()];
        plain.put(&shape, &cut, &mut back);
        for (i, (b, v)) in back.iter().zip(&values).enumerate() {
            let want = if (50..70).contains(&(i % 80)) {
                *v
            } else {
                0.0
            };
            assert_eq!(*b, want, "{i}");
        }
    }

    #[test]
    fn llama_pieces_split_and_transpose_and_put_back() {
        let m = llama();
        // qkv: q 4 heads × 2, k and v 2 heads × 2 = 8 + 4 + 4 columns.
        let shape = [8, 16];
        let p = pieces(&m, "layers.0.self_attn.qkv_proj.weight", &shape);
        let names: Vec<&str> = p.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.k_proj.weight",
                "model.layers.0.self_attn.v_proj.weight"
            ]
        );
        assert_eq!(p[1].columns, 8..12);
        assert_eq!(p[1].shape(&shape), vec![4, 8]);
        let values: Vec<f32> = (0..128).map(|i| i as f32).collect();
        // k_proj[j][i] = W[i][8 + j]
        let k = p[1].cut(&shape, &values);
        assert_eq!((k[0], k[1], k[8]), (8.0, 24.0, 9.0));
        let mut back = vec![0f32; 128];
        for piece in &p {
            piece.put(&shape, &piece.cut(&shape, &values), &mut back);
        }
        assert_eq!(back, values);
        let gu = pieces(&m, "layers.0.mlp.gate_up_proj.weight", &[8, 12]);
        assert_eq!(gu[1].name, "model.layers.0.mlp.up_proj.weight");
        assert_eq!(gu[1].columns, 6..12);
        let down = pieces(&m, "layers.0.mlp.down_proj.weight", &[6, 8]);
        assert!(down[0].transposed && down[0].shape(&[6, 8]) == vec![8, 6]);
        // Qwen2's q, k and v biases: runs of one vector, as the columns.
        let qkv_bias = pieces(&m, "layers.0.self_attn.qkv_proj.bias", &[16]);
        let names: Vec<&str> = qkv_bias.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.0.self_attn.q_proj.bias",
                "model.layers.0.self_attn.k_proj.bias",
                "model.layers.0.self_attn.v_proj.bias"
            ]
        );
        assert_eq!(
            (qkv_bias[2].columns.clone(), qkv_bias[2].shape(&[16])),
            (12..16, vec![4])
        );
        let bias: Vec<f32> = (0..16).map(|i| i as f32).collect();
        assert_eq!(qkv_bias[1].cut(&[16], &bias), [8.0, 9.0, 10.0, 11.0]);
        let mut back = vec![0f32; 16];
        for piece in &qkv_bias {
            piece.put(&[16], &piece.cut(&[16], &bias), &mut back);
        }
        assert_eq!(back, bias);
        let norm = pieces(&m, "layers.0.input_layernorm.weight", &[8]);
        assert!(!norm[0].transposed);
        assert_eq!(
            pieces(&m, "lm_head.weight", &[16, 8])[0].name,
            "lm_head.weight"
        );
        assert_eq!(config_json(&m)["num_key_value_heads"], 2);
        // Qwen3: q and k norms are vectors under their names; heads of 4 over
        // d 8 make q 16 wide and o_proj [16 → 8], stored [8, 16].
        let q3 = qwen3();
        let q_norm = pieces(&q3, "layers.0.self_attn.q_norm.weight", &[4]);
        assert_eq!(
            (q_norm[0].name.as_str(), q_norm[0].transposed),
            ("model.layers.0.self_attn.q_norm.weight", false)
        );
        let o = pieces(&q3, "layers.0.self_attn.o_proj.weight", &[16, 8]);
        assert_eq!(o[0].shape(&[16, 8]), vec![8, 16]);
        let qkv = pieces(&q3, "layers.0.self_attn.qkv_proj.weight", &[8, 32]);
        let widths: Vec<_> = qkv.iter().map(|p| p.columns.clone()).collect();
        assert_eq!(widths, [0..16, 16..24, 24..32]);
        let c = config_json(&q3);
        assert_eq!(
            (&c["model_type"], &c["head_dim"], &c["attention_bias"]),
            (
                &serde_json::json!("qwen3"),
                &serde_json::json!(4),
                &serde_json::json!(false)
            )
        );
    }

    /// A directory's config.json that disagrees with the job's model where
    /// the weights' shapes cannot show it is refused, naming both keys; its
    /// defaults (null, absent), a longer context and formatting are not.
    /// `model_spec` reads back the model `config_json` wrote, GPT-2 and
    /// LLaMA (tied and not, grouped-query), in every effective value; and
    /// for GPT-2 refuses the attention variants zrun does not compute
    /// (unscaled scores, scores scaled by the layer, cross-attention), as
    /// `init_from`'s check does.
    /// `generation_config.json` first, as `generate` reads it; one id or a
    /// list; none where neither file names one; another kind refused.
    #[test]
    fn eos_token_ids_come_from_the_generation_config_first() {
        let d = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| std::fs::write(d.path().join(name), text).unwrap();
        assert_eq!(eos_token_ids(d.path()).unwrap(), Vec::<u32>::new());
        write(HF_CONFIG, "{\"eos_token_id\": 50256}");
        assert_eq!(eos_token_ids(d.path()).unwrap(), vec![50256]);
        write(
            "generation_config.json",
            "{\"eos_token_id\": [128001, 128009]}",
        );
        assert_eq!(eos_token_ids(d.path()).unwrap(), vec![128001, 128009]);
        write("generation_config.json", "{\"eos_token_id\": null}");
        assert_eq!(eos_token_ids(d.path()).unwrap(), vec![50256]);
        write(HF_CONFIG, "{\"eos_token_id\": \"</s>\"}");
        let e = eos_token_ids(d.path()).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains("not a token id"),
            "{e}"
        );
        // One there but unreadable is not one absent.
        let g = d.path().join("generation_config.json");
        std::fs::remove_file(&g).unwrap();
        std::fs::create_dir(&g).unwrap();
        let e = eos_token_ids(d.path()).unwrap_err().to_string();
        assert!(e.contains("generation_config.json"), "{e}");
    }

    /// Every key of a GPT-2 and a LLaMA `config.json` (and the keys that
    /// transformers' other versions write) set to values of every kind:
    /// read as a model whose norm epsilon and rotary base are usable in f32,
    /// or refused naming the file; never a panic. Written from the
    /// seventieth session's campaign of 1,197 edited configs through `zrun
    /// sample`, which found a rope_parameters that is not an object, and
    /// epsilons of 0 or infinity in f32, taken without a word.
    #[test]
    fn every_value_of_every_key_reads_or_is_refused() {
        use serde_json::json;
        let values = [
            json!(-1),
            json!(0),
            json!(1),
            json!(0.5),
            json!(3.7),
            json!(1e30),
            json!(1e-50),
            json!(1e300),
            json!(u64::MAX),
            json!("x"),
            json!(true),
            json!(false),
            serde_json::Value::Null,
            json!([]),
            json!([1, 2]),
            json!({}),
            json!({"rope_type": "default"}),
            json!(4),
            json!(64),
        ];
        let extra = [
            "n_ctx",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "rope_theta",
            "rope_scaling",
            "rope_parameters",
            "head_dim",
            "num_key_value_heads",
        ];
        let gpt: ModelSpec = serde_json::from_value(json!({
            "vocab_size": 16, "d_model": 8, "n_layers": 2, "n_heads": 2, "seq_len": 12
        }))
        .unwrap();
        let (mut read, mut refused) = (0, 0);
        let qwen2 = ModelSpec {
            qkv_bias: Some(true),
            ..llama()
        };
        for base in [
            config_json(&gpt),
            config_json(&llama()),
            config_json(&qwen2),
            config_json(&qwen3()),
        ] {
            let keys: Vec<String> = base
                .as_object()
                .unwrap()
                .keys()
                .cloned()
                .chain(extra.iter().map(|k| k.to_string()))
                .collect();
            for key in &keys {
                for value in &values {
                    let mut c = base.clone();
                    c[key.as_str()] = value.clone();
                    let d = tempfile::tempdir().unwrap();
                    std::fs::write(d.path().join(HF_CONFIG), c.to_string()).unwrap();
                    match model_spec(d.path()) {
                        Ok(m) => {
                            read += 1;
                            let usable = |x: f64| (x as f32).is_finite() && (x as f32) > 0.0;
                            assert!(usable(m.norm_eps()) && usable(m.rope_theta()), "{c}");
                        }
                        Err(e) => {
                            refused += 1;
                            assert!(e.to_string().contains(HF_CONFIG), "{c}: {e}");
                        }
                    }
                }
            }
        }
        assert!(
            read > 100 && refused > 100,
            "{read} read, {refused} refused"
        );
    }

    #[test]
    fn model_spec_reads_back_what_config_json_writes() {
        let gpt: ModelSpec = serde_json::from_value(serde_json::json!({
            "vocab_size": 16, "d_model": 8, "n_layers": 2, "n_heads": 2, "seq_len": 12,
            "norm_eps": 1e-6
        }))
        .unwrap();
        let tied: ModelSpec = serde_json::from_value(serde_json::json!({
            "kind": "llama", "vocab_size": 16, "d_model": 8, "n_layers": 1, "n_heads": 2,
            "ffn_hidden": 6, "tie_embeddings": true, "rope_theta": 500.0, "seq_len": 20
        }))
        .unwrap();
        let effective = |m: &ModelSpec| {
            (
                m.kind,
                m.param_shapes(),
                m.norm_eps(),
                m.rope_theta(),
                m.kv_heads(),
                m.tied(),
                m.seq_len,
                m.qkv_biased(),
                m.head_dim(),
                m.qk_normed(),
                m.sliding_window,
            )
        };
        let qwen2 = ModelSpec {
            qkv_bias: Some(true),
            ..tied.clone()
        };
        let wide_qwen2 = ModelSpec {
            head_dim: Some(4),
            ..qwen2.clone()
        };
        let wide_llama = ModelSpec {
            head_dim: Some(6),
            ..llama()
        };
        let narrow_qwen3 = ModelSpec {
            head_dim: Some(2),
            ..qwen3()
        };
        // With a window (as Mistral, Qwen2, Qwen3 and Phi-3 write theirs).
        let window = |m: &ModelSpec| ModelSpec {
            sliding_window: Some(16),
            ..m.clone()
        };
        let phi3 = ModelSpec {
            head_dim: Some(4),
            partial_rotary_factor: Some(0.5),
            ..llama()
        };
        for m in [
            gpt.clone(),
            llama(),
            tied.clone(),
            qwen2.clone(),
            wide_qwen2.clone(),
            wide_llama,
            qwen3(),
            narrow_qwen3,
            window(&llama()),
            window(&tied),
            window(&qwen2),
            window(&qwen3()),
            window(&phi3),
        ] {
            let d = tempfile::tempdir().unwrap();
            let c = config_json(&m);
            std::fs::write(d.path().join(HF_CONFIG), c.to_string()).unwrap();
            let back = model_spec(d.path()).unwrap();
            assert_eq!(effective(&back), effective(&m), "{c}");
        }
        // Mistral: a LLaMA with its window where it is within the context
        // (128), Qwen2 and Qwen3 with theirs on every layer or none.
        let windowed = |base: &ModelSpec, edits: &[(&str, serde_json::Value)]| {
            let mut c = config_json(base);
            for (k, v) in edits {
                c[*k] = v.clone();
            }
            let d = tempfile::tempdir().unwrap();
            std::fs::write(d.path().join(HF_CONFIG), c.to_string()).unwrap();
            model_spec(d.path()).map(|m| (m.kind, m.seq_len, m.sliding_window))
        };
        for (window, read) in [
            (json!(16), Some(16)),
            (json!(null), None),
            (json!(128), None),
            (json!(4096), None),
        ] {
            let mistral = [("model_type", json!("mistral")), ("sliding_window", window)];
            let back = windowed(&llama(), &mistral).unwrap();
            assert_eq!(back, (ModelKind::Llama, 128, read), "{mistral:?}");
        }
        for (edits, read) in [
            (vec![("use_sliding_window", json!(false))], None),
            (vec![("max_window_layers", json!(0))], Some(16)),
            (vec![("max_window_layers", json!(2))], None),
            (vec![("max_window_layers", json!(28))], None),
            (vec![("max_window_layers", json!(null))], None),
        ] {
            let mut edits = edits.clone();
            edits.push(("sliding_window", json!(16)));
            if edits[0].0 != "use_sliding_window" {
                edits.push(("use_sliding_window", json!(true)));
            }
            for base in [wide_qwen2.clone(), qwen3()] {
                let back = windowed(&base, &edits).unwrap();
                assert_eq!(back.2, read, "{edits:?}");
            }
        }
        let deeper = ModelSpec {
            n_layers: 3,
            ..qwen3()
        };
        let e = windowed(
            &deeper,
            &[
                ("use_sliding_window", json!(true)),
                ("sliding_window", json!(16)),
                ("max_window_layers", json!(1)),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("use_sliding_window is true with max_window_layers 1"),
            "{e}"
        );
        // What zrun cannot run, refused naming the key.
        let llama_config = config_json(&llama());
        let gpt_config = config_json(&gpt);
        let edit = |base: &serde_json::Value, edits: &[(&str, serde_json::Value)]| {
            let mut c = base.clone();
            for (k, v) in edits {
                c[*k] = v.clone();
            }
            c
        };
        use serde_json::{json, Value};
        for (config, says) in [
            (
                edit(&gpt_config, &[("model_type", json!("bert"))]),
                "model_type is \"bert\": zrun runs gpt2, llama, qwen2, qwen3, mistral and phi3",
            ),
            (
                edit(&gpt_config, &[("n_embd", json!(-1))]),
                "n_embd is -1, not a positive whole number",
            ),
            (
                edit(&gpt_config, &[("n_embd", json!(0))]),
                "n_embd is 0, not a positive whole number",
            ),
            (
                edit(&gpt_config, &[("vocab_size", Value::Null)]),
                "no vocab_size",
            ),
            (
                edit(&gpt_config, &[("n_head", json!(3))]),
                "3 heads (3 key/value) do not divide the width 8",
            ),
            (
                edit(&gpt_config, &[("activation_function", json!("relu"))]),
                "activation_function is \"relu\"",
            ),
            (
                edit(&gpt_config, &[("layer_norm_epsilon", json!(-1.0))]),
                "must be positive numbers",
            ),
            (
                edit(&gpt_config, &[("layer_norm_epsilon", json!(0.0))]),
                "must be positive numbers",
            ),
            (
                edit(&gpt_config, &[("layer_norm_epsilon", json!(1e-50))]),
                "within f32's range",
            ),
            (
                edit(&gpt_config, &[("layer_norm_epsilon", json!(1e39))]),
                "within f32's range",
            ),
            (
                edit(&llama_config, &[("hidden_act", json!("gelu"))]),
                "hidden_act is \"gelu\": zrun's model has \"silu\"",
            ),
            (
                edit(&llama_config, &[("attention_bias", json!(true))]),
                "attention_bias is true",
            ),
            (
                edit(&llama_config, &[("mlp_bias", json!(true))]),
                "mlp_bias is true",
            ),
            (
                edit(&config_json(&qwen2), &[("use_sliding_window", json!("yes"))]),
                "use_sliding_window is \"yes\", not true or false",
            ),
            (
                edit(&llama_config, &[("rope_scaling", json!({"factor": 2.0}))]),
                "rope_scaling is {\"factor\":2.0}: it names no rope_type",
            ),
            (
                edit(
                    &llama_config,
                    &[("rope_parameters", json!({"rope_type": "longrope"}))],
                ),
                "missing field `short_factor`",
            ),
            (
                edit(
                    &llama_config,
                    &[(
                        "rope_scaling",
                        json!({"rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [1.0]}),
                    )],
                ),
                "short_factor has 2 factors: a head 2 wide turns 1 pairs",
            ),
            (
                edit(
                    &llama_config,
                    &[("rope_scaling", json!({"rope_type": "ntk", "factor": 4.0}))],
                ),
                "rope_scaling's rope_type is \"ntk\": zrun scales rotary embeddings as \"linear\", \"dynamic\", \"llama3\", \"yarn\" and \"longrope\" only",
            ),
            (
                edit(
                    &llama_config,
                    &[(
                        "rope_scaling",
                        json!({"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 32, "beta_slow": 0.0}),
                    )],
                ),
                "rope_scaling: beta_slow must be positive, got 0",
            ),
            (
                edit(
                    &llama_config,
                    &[("rope_scaling", json!({"type": "su", "factor": 2.0}))],
                ),
                "rope_scaling's rope_type is \"su\"",
            ),
            (
                edit(
                    &llama_config,
                    &[("rope_scaling", json!({"rope_type": "llama3", "factor": 8.0}))],
                ),
                "missing field `low_freq_factor`",
            ),
            (
                edit(
                    &llama_config,
                    &[("rope_scaling", json!({"rope_type": "linear", "factor": 0.5}))],
                ),
                "rope_scaling: factor must be at least 1, got 0.5",
            ),
            (
                edit(
                    &llama_config,
                    &[(
                        "rope_scaling",
                        json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                               "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
                    )],
                ),
                "low_freq_factor (4) must be positive and below high_freq_factor (1)",
            ),
            (
                edit(
                    &llama_config,
                    &[("rope_scaling", json!({"rope_type": "linear", "factor": "2"}))],
                ),
                "rope_scaling is",
            ),
            (
                edit(&llama_config, &[("rope_parameters", json!(500.0))]),
                "rope_parameters is 500.0, not an object",
            ),
            (
                edit(&llama_config, &[("head_dim", json!(3))]),
                "the head width 3 is odd",
            ),
            (
                edit(&config_json(&qwen3()), &[("head_dim", Value::Null)]),
                "no head_dim",
            ),
            (
                edit(&config_json(&qwen3()), &[("attention_bias", json!(true))]),
                "attention_bias is true",
            ),
            (
                edit(&llama_config, &[("num_key_value_heads", json!(3))]),
                "4 heads (3 key/value) do not divide",
            ),
            (
                edit(
                    &llama_config,
                    &[
                        ("num_attention_heads", json!(8)),
                        ("num_key_value_heads", json!(1)),
                        ("head_dim", Value::Null),
                    ],
                ),
                "the head width 1 is odd",
            ),
            (
                edit(&llama_config, &[("rope_theta", json!(0.0))]),
                "must be positive numbers",
            ),
            (
                edit(&llama_config, &[("rope_theta", json!(1e300))]),
                "within f32's range",
            ),
        ] {
            let d = tempfile::tempdir().unwrap();
            std::fs::write(d.path().join(HF_CONFIG), config.to_string()).unwrap();
            let e = model_spec(d.path()).unwrap_err().to_string();
            assert!(e.contains("config.json") && e.contains(says), "{says}: {e}");
        }
        // transformers 5's rotary base, read from `rope_parameters`; its
        // `default` type is no scaling.
        let mut v5 = edit(
            &llama_config,
            &[(
                "rope_parameters",
                json!({"rope_type": "default", "rope_theta": 250.0}),
            )],
        );
        v5.as_object_mut().unwrap().remove("rope_theta");
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(HF_CONFIG), v5.to_string()).unwrap();
        assert_eq!(model_spec(d.path()).unwrap().rope_theta(), 250.0);
        // Both places, the same base (an integer the same number): read;
        // different bases: refused, transformers 4 and 5 would differ.
        v5["rope_theta"] = json!(250);
        std::fs::write(d.path().join(HF_CONFIG), v5.to_string()).unwrap();
        assert_eq!(model_spec(d.path()).unwrap().rope_theta(), 250.0);
        v5["rope_theta"] = json!(500.0);
        std::fs::write(d.path().join(HF_CONFIG), v5.to_string()).unwrap();
        let e = model_spec(d.path()).unwrap_err().to_string();
        assert!(
            e.contains("rope_theta is 500.0 and rope_parameters.rope_theta 250.0"),
            "{e}"
        );
        v5.as_object_mut().unwrap().remove("rope_theta");
        // And with no rope_type at all.
        v5["rope_parameters"] = json!({"rope_theta": 250.0});
        std::fs::write(d.path().join(HF_CONFIG), v5.to_string()).unwrap();
        let m = model_spec(d.path()).unwrap();
        assert_eq!((m.rope_theta(), m.rope_scaling), (250.0, None));
        // Rotary scaling as Llama 3.1-3.2 publish it (transformers 4.x), as
        // transformers 5 writes it, and 4.x's older `type` for linear.
        let llama3 = json!({"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"});
        let want_llama3 = RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let mut llama3_v5 = llama3.clone();
        llama3_v5["rope_theta"] = json!(500000.0);
        for (key, value, want, theta) in [
            ("rope_scaling", llama3, want_llama3.clone(), 10000.0),
            ("rope_parameters", llama3_v5, want_llama3, 500000.0),
            (
                "rope_scaling",
                json!({"type": "linear", "factor": 2.0}),
                RopeScaling::Linear { factor: 2.0 },
                10000.0,
            ),
            // Keys of other kinds beside a kind's own are not its.
            (
                "rope_scaling",
                json!({"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 64}),
                RopeScaling::Linear { factor: 2.0 },
                10000.0,
            ),
            // Dynamic NTK as older LLaMA fine-tunes publish it.
            (
                "rope_scaling",
                json!({"type": "dynamic", "factor": 2.0}),
                RopeScaling::Dynamic { factor: 2.0 },
                10000.0,
            ),
            // YaRN as Qwen2.5 publishes it (4.x's `type`), and DeepSeek's
            // keys with transformers' nulls.
            (
                "rope_scaling",
                json!({"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}),
                RopeScaling::Yarn {
                    factor: 4.0,
                    original_max_position_embeddings: 32768,
                    beta_fast: None,
                    beta_slow: None,
                    attention_factor: None,
                    mscale: None,
                    mscale_all_dim: None,
                    truncate: None,
                },
                10000.0,
            ),
            (
                "rope_scaling",
                json!({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                       "attention_factor": null, "truncate": false}),
                RopeScaling::Yarn {
                    factor: 40.0,
                    original_max_position_embeddings: 4096,
                    beta_fast: Some(32.0),
                    beta_slow: Some(1.0),
                    attention_factor: None,
                    mscale: Some(1.0),
                    mscale_all_dim: Some(1.0),
                    truncate: Some(false),
                },
                10000.0,
            ),
        ] {
            let mut c = edit(&llama_config, &[(key, value)]);
            if key == "rope_parameters" {
                c.as_object_mut().unwrap().remove("rope_theta");
                // Files that carry both keys leave 4.x's null.
                c["rope_scaling"] = Value::Null;
            }
            std::fs::write(d.path().join(HF_CONFIG), c.to_string()).unwrap();
            let m = model_spec(d.path()).unwrap();
            assert_eq!(
                (m.rope_scaling.clone(), m.rope_theta()),
                (Some(want), theta),
                "{key}"
            );
            // And written back as transformers reads it.
            let again = config_json(&m);
            std::fs::write(d.path().join(HF_CONFIG), again.to_string()).unwrap();
            assert_eq!(model_spec(d.path()).unwrap(), m, "{key} written back");
        }
        let (d, params) = a_directory_of(&gpt);
        let written = config_json(&gpt);
        for (key, value) in [
            ("scale_attn_weights", false),
            ("scale_attn_by_inverse_layer_idx", true),
            ("add_cross_attention", true),
        ] {
            let mut c = written.clone();
            c[key] = serde_json::json!(value);
            std::fs::write(d.path().join(HF_CONFIG), c.to_string()).unwrap();
            let e = model_spec(d.path()).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{key} is {value}: zrun's model has {}", !value)),
                "{e}"
            );
            let e = read(&gpt, &params, d.path(), false)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("{key} is {value}, the job's model has {}", !value)),
                "{e}"
            );
        }
    }

    #[test]
    fn a_directory_of_another_architecture_is_refused() {
        let m = llama();
        let (d, params) = a_directory_of(&m);
        read(&m, &params, d.path(), true).unwrap();
        let written: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.path().join(HF_CONFIG)).unwrap()).unwrap();
        let with = |key: &str, value: serde_json::Value| {
            let mut c = written.clone();
            if key == "rope_parameters" {
                c.as_object_mut().unwrap().remove("rope_theta");
            }
            c[key] = value;
            std::fs::write(d.path().join(HF_CONFIG), c.to_string()).unwrap();
            read(&m, &params, d.path(), false).map(|_| ())
        };
        for (key, value, what) in [
            // Heads of 1 column over the same 8: the same shapes.
            (
                "num_attention_heads",
                serde_json::json!(8),
                "num_attention_heads is 8, the job's model has 4 (model.n_heads)",
            ),
            (
                "rope_theta",
                serde_json::json!(500000.0),
                "(model.rope_theta)",
            ),
            ("rms_norm_eps", serde_json::json!(1e-6), "(model.norm_eps)"),
            (
                "model_type",
                serde_json::json!("gemma"),
                "(model.kind, model.qkv_bias, model.qk_norm): zrun reads gpt2, llama, mistral and phi3, qwen2 (model.kind: llama with model.qkv_bias: true) and qwen3 (with model.qk_norm: true and model.head_dim); weights of the same names and layout can be given as the model.safetensors file alone",
            ),
            (
                "max_position_embeddings",
                serde_json::json!(2),
                "shorter than the job's model.seq_len",
            ),
            (
                "rope_scaling",
                serde_json::json!({"rope_type": "linear", "factor": 8.0}),
                "its rotary scaling is {\"rope_type\":\"linear\",\"factor\":8.0}, the job's model.rope_scaling none",
            ),
            // transformers 5's form: the base inside `rope_parameters`
            // (the written config's own `rope_theta` taken out below).
            (
                "rope_parameters",
                serde_json::json!({"rope_type": "default", "rope_theta": 500000.0}),
                "rope_theta is 500000.0, the job's model has 10000.0 (model.rope_theta)",
            ),
            (
                "rope_parameters",
                serde_json::json!({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}),
                "missing field `low_freq_factor`",
            ),
        ] {
            let e = with(key, value).unwrap_err().to_string();
            assert!(e.contains("config.json") && e.contains(what), "{key}: {e}");
        }
        for (key, value) in [
            ("num_key_value_heads", serde_json::Value::Null),
            ("rope_scaling", serde_json::Value::Null),
            (
                "rope_parameters",
                serde_json::json!({"rope_type": "default", "rope_theta": 10000.0}),
            ),
            ("max_position_embeddings", serde_json::json!(4096)),
            ("rms_norm_eps", serde_json::json!(0.00001)),
            // Numbers compare as numbers: an integer base is the same base.
            ("rope_theta", serde_json::json!(10000)),
            (
                "architectures",
                serde_json::json!(["LlamaForCausalLM", "X"]),
            ),
            // Mistral's names and layout are LLaMA's.
            ("model_type", serde_json::json!("mistral")),
        ] {
            with(key, value).unwrap_or_else(|e| panic!("{key}: {e}"));
        }
        // A Mistral window shorter than the job's sequences (128) must be
        // the job's; windows beyond them change nothing.
        for (window, job_window, refused) in [
            (64, None, true),
            (64, Some(64), false),
            (64, Some(32), true),
            (128, None, false),
            (4096, Some(128), false),
        ] {
            let mut c = written.clone();
            c["model_type"] = "mistral".into();
            c["sliding_window"] = window.into();
            std::fs::write(d.path().join(HF_CONFIG), c.to_string()).unwrap();
            let m = ModelSpec {
                sliding_window: job_window,
                ..m.clone()
            };
            match read(&m, &params, d.path(), false) {
                Ok(_) => assert!(!refused, "{window} {job_window:?}"),
                Err(e) => assert!(
                    refused
                        && e.to_string().contains(&format!(
                            "its sliding window is {window}, the job's model.sliding_window {}",
                            job_window.map_or("none".into(), |w| w.to_string())
                        )),
                    "{window}: {e}"
                ),
            }
        }
        std::fs::write(d.path().join(HF_CONFIG), "{").unwrap();
        let e = read(&m, &params, d.path(), false).unwrap_err().to_string();
        assert!(e.contains("not a Hugging Face config.json"), "{e}");
        // One that cannot be read is an error, not a config.json to skip.
        std::fs::remove_file(d.path().join(HF_CONFIG)).unwrap();
        std::fs::create_dir(d.path().join(HF_CONFIG)).unwrap();
        let e = read(&m, &params, d.path(), false).unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");
        std::fs::remove_dir(d.path().join(HF_CONFIG)).unwrap();
        // Weights alone (no config.json) are held to the shapes only.
        read(&m, &params, d.path(), false).unwrap();
    }
}
