//! A Hugging Face `config.json` read as a job's model: what `zrun sample`
//! runs a published directory with, and what a job whose `model.init_from`
//! names such a directory takes for every architecture key it leaves out
//! (as `from_pretrained` takes the architecture from the file). It lives
//! here, beside the DeepSpeed reader, because a job's model is this crate's
//! to resolve; the weights' names and layouts are `zckpt`'s.

use std::path::{Path, PathBuf};

use crate::spec::{ModelKind, ModelSpec, RopeScaling};

/// The file a Hugging Face model directory describes its model in.
pub const CONFIG_JSON: &str = "config.json";

/// Why a directory's `config.json` gives no model zrun runs.
#[derive(Debug, thiserror::Error)]
pub enum HfConfigError {
    /// The file could not be read.
    #[error("{path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause (shown in the message, so not also a `source`).
        cause: std::io::Error,
    },
    /// The file is not JSON, or describes a model zrun does not run.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the key.
        message: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> HfConfigError + '_ {
    move |cause| HfConfigError::Io {
        path: path.to_path_buf(),
        cause,
    }
}

fn invalid(path: &Path, message: impl Into<String>) -> HfConfigError {
    HfConfigError::Invalid {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// The model a Hugging Face directory's `config.json` describes: GPT-2
/// (`model_type: gpt2`, tanh GELU) or LLaMA (`llama`: SiLU, no biases,
/// rotary scaling as `rope_scaling` reads it; `qwen2`: with biases on q, k
/// and v; `qwen3`: with norms of each head's q and k; `mistral`: LLaMA with
/// a sliding window ([`sliding_window`]); `phi3`: LLaMA turning part of
/// each head, as `partial_rotary_factor` says; heads as wide as `head_dim`
/// says), the families whose names and layouts `zckpt::hf` maps. What
/// `zrun sample` runs such a directory with, and what a job starting from
/// it takes for the model keys it leaves out. Anything else is refused
/// naming the file and the key.
pub fn model_spec(dir: &Path) -> Result<ModelSpec, HfConfigError> {
    use serde_json::{json, Value};
    let path = dir.join(CONFIG_JSON);
    let text = std::fs::read(&path).map_err(io(&path))?;
    let c: Value = serde_json::from_slice(&text)
        .map_err(|e| invalid(&path, format!("not a Hugging Face config.json: {e}")))?;
    let c = lift_rope_theta(c).map_err(|e| invalid(&path, e))?;
    let bad = |message: String| invalid(&path, message);
    // A key that may be absent or null (Hugging Face's default), else must
    // be one of `allowed`.
    let only = |key: &str, allowed: &[Value]| match c.get(key) {
        Some(v) if !v.is_null() && !allowed.contains(v) => Err(bad(format!(
            "{key} is {v}: zrun's model has {}",
            allowed.first().map_or("none".into(), Value::to_string)
        ))),
        _ => Ok(()),
    };
    let count = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| c.get(*k).filter(|v| !v.is_null()))
            .map(|v| {
                v.as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| bad(format!("{} is {v}, not a positive whole number", keys[0])))
            })
    };
    let need = |keys: &[&str]| {
        count(keys).unwrap_or_else(|| Err(bad(format!("no {}", keys.join(" or ")))))
    };
    let float = |key: &str| c.get(key).and_then(Value::as_f64);
    let model = match c.get("model_type").and_then(Value::as_str) {
        Some("gpt2") => {
            only(
                "activation_function",
                &[json!("gelu_new"), json!("gelu_pytorch_tanh")],
            )?;
            only("scale_attn_weights", &[json!(true)])?;
            only("scale_attn_by_inverse_layer_idx", &[json!(false)])?;
            only("add_cross_attention", &[json!(false)])?;
            only("tie_word_embeddings", &[json!(true)])?;
            json!({
                "kind": "gpt",
                "vocab_size": need(&["vocab_size"])?,
                "d_model": need(&["n_embd", "hidden_size"])?,
                "n_layers": need(&["n_layer", "num_hidden_layers"])?,
                "n_heads": need(&["n_head", "num_attention_heads"])?,
                "seq_len": need(&["n_positions", "n_ctx", "max_position_embeddings"])?,
                "ffn_hidden": count(&["n_inner"]).transpose()?,
                "norm_eps": float("layer_norm_epsilon"),
            })
        }
        Some(kind @ ("llama" | "qwen2" | "qwen3" | "mistral" | "phi3")) => {
            only("hidden_act", &[json!("silu")])?;
            // Phi-4-mini turns only part of each head; transformers' other
            // families turn the whole.
            let partial = partial_rotary_factor(&c).map_err(&bad)?;
            if partial != 1.0 && kind != "phi3" {
                return Err(bad(format!(
                    "partial_rotary_factor is {partial}: transformers' {kind} turns the whole of each head (Phi-3 turns part)"
                )));
            }
            only("attention_bias", &[json!(false)])?;
            only("mlp_bias", &[json!(false)])?;
            let positions = need(&["max_position_embeddings"])?;
            let window = sliding_window(&c).map_err(&bad)?.filter(|&w| w < positions);
            let (d, heads) = (need(&["hidden_size"])?, need(&["num_attention_heads"])?);
            // transformers' Qwen3 defaults the head width to 128, the others
            // to d / heads: a Qwen3 directory must say.
            let head_dim = match kind {
                "qwen3" => Some(need(&["head_dim"])?),
                _ => count(&["head_dim"]).transpose()?,
            };
            let rotary_dim = (head_dim.unwrap_or(d / heads) as f64 * partial) as usize;
            let scaling = rope_scaling(&c, rotary_dim).map_err(&bad)?;
            json!({
                "kind": "llama",
                "vocab_size": need(&["vocab_size"])?,
                "d_model": d,
                "n_layers": need(&["num_hidden_layers"])?,
                "n_heads": heads,
                "head_dim": head_dim.filter(|&hd| hd * heads != d),
                "qk_norm": (kind == "qwen3").then_some(true),
                "n_kv_heads": count(&["num_key_value_heads"]).transpose()?,
                "ffn_hidden": need(&["intermediate_size"])?,
                "tie_embeddings": c.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
                "qkv_bias": (kind == "qwen2").then_some(true),
                "rope_theta": float("rope_theta"),
                "rope_scaling": scaling,
                "partial_rotary_factor": (partial != 1.0).then_some(partial),
                "norm_eps": float("rms_norm_eps"),
                "sliding_window": window,
                "seq_len": positions,
            })
        }
        _ => {
            return Err(bad(format!(
                "model_type is {}: zrun runs gpt2, llama, qwen2, qwen3, mistral and phi3",
                c.get("model_type").unwrap_or(&Value::Null)
            )))
        }
    };
    let model = Value::Object(
        model
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    );
    let m: ModelSpec =
        serde_json::from_value(model).map_err(|e| bad(format!("not a model zrun runs: {e}")))?;
    let uneven = m.head_dim.is_none() && !m.d_model.is_multiple_of(m.n_heads);
    if uneven || !m.n_heads.is_multiple_of(m.kv_heads()) {
        return Err(bad(format!(
            "{} heads ({} key/value) do not divide the width {} into heads",
            m.n_heads,
            m.kv_heads(),
            m.d_model
        )));
    }
    if m.kind == ModelKind::Llama && !m.head_dim().is_multiple_of(2) {
        return Err(bad(format!(
            "the head width {} is odd: rotary embeddings turn pairs",
            m.head_dim()
        )));
    }
    if m.kind == ModelKind::Llama && (m.rotary_dim() < 2 || !m.rotary_dim().is_multiple_of(2)) {
        return Err(bad(format!(
            "partial_rotary_factor turns {} of each head's {} columns: rotary embeddings turn pairs",
            m.rotary_dim(),
            m.head_dim()
        )));
    }
    // The model computes in f32: an epsilon of 1e-50 is 0 there, and one of
    // 1e39 infinite (both ran, until the seventieth session; a job's YAML
    // refuses them as well).
    let in_f32 = |x: f64| (x as f32).is_finite() && (x as f32) > 0.0;
    if !(in_f32(m.norm_eps()) && in_f32(m.rope_theta())) {
        return Err(bad(format!(
            "the norm epsilon ({}) and rotary base ({}) must be positive numbers within f32's range",
            m.norm_eps(),
            m.rope_theta()
        )));
    }
    Ok(m)
}

/// The sliding window of a `config.json` `c`, the keys each token attends
/// to at most (itself included), as transformers reads it: Mistral's and
/// Phi-3's `sliding_window` on every layer (null: none); Qwen2's and
/// Qwen3's only with `use_sliding_window`, and then on the layers from
/// `max_window_layers` on (28 where absent), which zrun's model runs where
/// that is every layer (0) or none (at least `num_hidden_layers`); other
/// families have none. Anything else is refused, said.
pub fn sliding_window(c: &serde_json::Value) -> Result<Option<usize>, String> {
    use serde_json::Value;
    let window = || match c.get("sliding_window") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64().filter(|&w| w > 0) {
            Some(w) => Ok(Some(w as usize)),
            None => Err(format!(
                "sliding_window is {v}, not a positive whole number"
            )),
        },
    };
    match c.get("model_type").and_then(Value::as_str) {
        Some("mistral" | "phi3") => window(),
        Some("qwen2" | "qwen3") => {
            match c.get("use_sliding_window") {
                None | Some(Value::Null | Value::Bool(false)) => return Ok(None),
                Some(Value::Bool(true)) => {}
                Some(v) => return Err(format!("use_sliding_window is {v}, not true or false")),
            }
            let Some(w) = window()? else {
                return Ok(None);
            };
            let layers = c.get("num_hidden_layers").and_then(Value::as_u64);
            let from = c.get("max_window_layers").filter(|v| !v.is_null());
            match from.map(Value::as_u64) {
                Some(Some(0)) => Ok(Some(w)),
                Some(Some(from)) if layers.is_some_and(|l| from >= l) => Ok(None),
                None if layers.is_some_and(|l| l <= 28) => Ok(None),
                from => Err(format!(
                    "use_sliding_window is true with max_window_layers {}: a window on the layers from there on only; zrun's model windows every layer (max_window_layers 0) or none",
                    from.flatten().map_or("28 (absent)".into(), |n| n.to_string())
                )),
            }
        }
        _ => Ok(None),
    }
}

/// A `config.json` with transformers 5's `rope_parameters: {rope_theta,
/// rope_type, …}` read as 4.x's top-level `rope_theta` (where the file has
/// none of its own): the rotary base, wherever the file keeps it. A file
/// with both that differ is refused: transformers 5 takes the one in
/// `rope_parameters`, 4.x the other.
pub fn lift_rope_theta(mut c: serde_json::Value) -> Result<serde_json::Value, String> {
    let theta = c
        .get("rope_parameters")
        .and_then(|r| r.get("rope_theta"))
        .filter(|t| !t.is_null())
        .cloned();
    if let (Some(theta), Some(obj)) = (theta, c.as_object_mut()) {
        match obj.get("rope_theta").filter(|t| !t.is_null()) {
            Some(top) if top.as_f64() != theta.as_f64() || top.as_f64().is_none() => {
                return Err(format!(
                    "rope_theta is {top} and rope_parameters.rope_theta {theta}: \
                     transformers 5 takes the second, 4.x the first; keep one"
                ))
            }
            Some(_) => {}
            None => {
                obj.insert("rope_theta".into(), theta);
            }
        }
    }
    Ok(c)
}

/// How a `config.json` of heads `hd` wide scales the rotary embedding:
/// transformers 4.x's `rope_scaling` or 5.x's `rope_parameters`
/// (`rope_type` `default` or absent there: none), of the kinds zrun
/// computes (`linear`, `dynamic`, `llama3`, `yarn`, `longrope`; 4.x's
/// older `type` key read as `rope_type`, and Phi-3's `su` and `yarn` as
/// `longrope`, as transformers' Phi-3 reads them), with transformers'
/// defaults filled in: an `original_max_position_embeddings` beside the
/// scaling (Phi-3's, 4096 where absent) over the one within it, else the
/// model's `max_position_embeddings`; LongRoPE's `factor` that over the
/// original. Another kind, a field missing or out of bounds, or a value
/// that is not an object (a `rope_parameters` of another kind silently
/// gave the default base until the seventieth session) is refused, said.
pub fn rope_scaling(c: &serde_json::Value, hd: usize) -> Result<Option<RopeScaling>, String> {
    use serde_json::Value;
    let (key, given) = match (c.get("rope_scaling"), c.get("rope_parameters")) {
        (Some(v), _) if !v.is_null() => ("rope_scaling", v),
        (_, Some(v)) if !v.is_null() => ("rope_parameters", v),
        _ => return Ok(None),
    };
    let Some(fields) = given.as_object() else {
        return Err(format!(
            "{key} is {given}, not an object such as {{\"rope_type\": \"llama3\", \"factor\": 8.0, ...}}"
        ));
    };
    let phi3 = c.get("model_type").and_then(Value::as_str) == Some("phi3");
    let kind = fields
        .get("rope_type")
        .filter(|t| !t.is_null())
        .or_else(|| fields.get("type"));
    let kind = match kind.map(|t| (t, t.as_str())) {
        Some((_, Some("default"))) => return Ok(None),
        None if key == "rope_parameters" => return Ok(None),
        Some((_, Some("su" | "yarn"))) if phi3 => "longrope",
        Some((_, Some(k @ ("linear" | "dynamic" | "llama3" | "yarn" | "longrope")))) => k,
        Some((t, _)) => {
            return Err(format!(
                "{key}'s rope_type is {t}: zrun scales rotary embeddings as \"linear\", \"dynamic\", \"llama3\", \"yarn\" and \"longrope\" only"
            ))
        }
        None => return Err(format!("{key} is {given}: it names no rope_type")),
    };
    let mut known = serde_json::Map::new();
    known.insert("rope_type".into(), Value::from(kind));
    let names: &[&str] = match kind {
        "linear" | "dynamic" => &["factor"],
        "yarn" => &[
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ],
        "longrope" => &[
            "factor",
            "original_max_position_embeddings",
            "short_factor",
            "long_factor",
            "attention_factor",
        ],
        _ => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
    };
    for name in names {
        // null is transformers' "the default", as absent.
        if let Some(v) = fields.get(*name).filter(|v| !v.is_null()) {
            known.insert((*name).into(), v.clone());
        }
    }
    if names.contains(&"original_max_position_embeddings") {
        let positions = c.get("max_position_embeddings").filter(|v| !v.is_null());
        let beside = c
            .get("original_max_position_embeddings")
            .filter(|v| !v.is_null());
        let old = match (beside, known.get("original_max_position_embeddings")) {
            (Some(v), _) => Some(v.clone()),
            (None, _) if phi3 => Some(Value::from(4096)),
            (None, Some(v)) => Some(v.clone()),
            (None, None) => positions.cloned(),
        };
        if let Some(old) = old {
            known.insert("original_max_position_embeddings".into(), old);
        }
        if kind == "longrope" && !known.contains_key("factor") {
            let ratio = positions
                .and_then(Value::as_f64)
                .zip(known["original_max_position_embeddings"].as_f64())
                .filter(|(_, old)| *old > 0.0)
                .map(|(n, old)| n / old);
            if let Some(ratio) = ratio {
                known.insert("factor".into(), Value::from(ratio));
            }
        }
    }
    let scaling: RopeScaling = serde_json::from_value(Value::Object(known))
        .map_err(|e| format!("{key} is {given}: {e}"))?;
    match crate::load::rope_scaling_problem(&scaling, hd) {
        Some(problem) => Err(format!("{key}: {problem}")),
        None => Ok(Some(scaling)),
    }
}

/// The share of each head a Hugging Face config's rotary embedding turns
/// (`partial_rotary_factor`, within `rope_parameters` as transformers 5
/// keeps it, else beside it; 1 where neither says), `Err` naming the key
/// where it is not a number.
pub fn partial_rotary_factor(c: &serde_json::Value) -> Result<f64, String> {
    let within = c
        .get("rope_parameters")
        .and_then(|r| r.get("partial_rotary_factor"))
        .filter(|f| !f.is_null())
        .map(|f| ("rope_parameters.partial_rotary_factor", f));
    let beside = c
        .get("partial_rotary_factor")
        .filter(|f| !f.is_null())
        .map(|f| ("partial_rotary_factor", f));
    match within.or(beside) {
        None => Ok(1.0),
        Some((key, f)) => f
            .as_f64()
            .filter(|f| *f > 0.0 && *f <= 1.0)
            .ok_or_else(|| format!("{key} is {f}, not a number above 0 and at most 1")),
    }
}
