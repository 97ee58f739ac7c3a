//! Loading a job: YAML text, then `--set` overrides, then `${name}` expansion, then
//! the semantic checks that must pass before anything is launched.
//!
//! Errors point at `file:line:col`. Semantic checks find the line of the key they
//! complain about with a small indentation-aware scan of the YAML text (block and
//! flow style), so a user sees where to edit even for errors serde cannot see.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::curriculum::CurriculumSpec;
use crate::deepspeed::{DeepSpeedConfig, MappedValue, Origin};
use crate::error::{improve_serde_message, plain_yaml_message, ConfigError};
use crate::hostfile::Topology;
use crate::spec::{
    Backend, CommsLoggerSpec, Device, Dtype, Every, FlopsProfilerSpec, JobSpec, ModelKind,
    OffloadDevice, OneCycleSpec, OptimizerKind, Schedule, ZeroStage, COMM_OPS,
};

/// A parsed, overridden job spec together with its source text (for locating keys).
#[derive(Debug, Clone)]
pub struct LoadedJob {
    /// The resolved spec.
    pub spec: JobSpec,
    /// The file it came from.
    pub path: PathBuf,
    text: String,
    overridden: Vec<String>,
    deepspeed: Option<DeepSpeedConfig>,
    model_from: Option<ModelFrom>,
}

/// The `config.json` of `model.init_from`'s directory, and the model keys
/// the job took from it.
#[derive(Debug, Clone)]
struct ModelFrom {
    config: PathBuf,
    keys: Vec<String>,
}

/// The keys of `model:` that describe the architecture: what a Hugging Face
/// `config.json` gives (its context aside: `seq_len` is the job's to
/// choose, and `max_position_embeddings` the directory's where it differs).
pub const ARCHITECTURE_KEYS: [&str; 16] = [
    "kind",
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "head_dim",
    "n_kv_heads",
    "ffn_hidden",
    "tie_embeddings",
    "qkv_bias",
    "qk_norm",
    "rope_theta",
    "rope_scaling",
    "partial_rotary_factor",
    "sliding_window",
    "norm_eps",
];

/// Reads `path`, applies `overrides` (`KEY=VALUE`, dotted keys) and expands `${name}`.
pub fn load_job(path: &Path, overrides: &[String]) -> Result<LoadedJob, ConfigError> {
    load_job_with(path, overrides, None)
}

/// [`load_job`] with a DeepSpeed config (`--deepspeed`), which takes the place
/// of the job's `deepspeed:` key. The ds_config's keys apply before the
/// overrides, so that `--set` has the last word.
pub fn load_job_with(
    path: &Path,
    overrides: &[String],
    deepspeed: Option<&Path>,
) -> Result<LoadedJob, ConfigError> {
    let text = crate::read_config(path)?;
    if text.trim().is_empty() {
        return Err(ConfigError::Syntax {
            path: path.to_path_buf(),
            line: 1,
            column: 1,
            message: "the job spec is empty (it needs at least `model` and `data`)".into(),
        });
    }
    // First parse: straight to the typed spec, for located syntax and type errors.
    let typed: JobSpec =
        serde_saphyr::from_str(&text).map_err(|e| syntax_error(path, &text, &e))?;
    // Then as a JSON value with every default filled in, so that overrides
    // apply by dotted path and a ds_config's "auto" finds the job's values.
    let mut value: Value = serde_json::to_value(&typed).expect("a spec serializes");
    // Before the ds_config, whose "auto" sizes follow the model's width.
    let model_from = adopt_model(&mut value, path, &text, overrides)?;
    let mut overridden = Vec::new();
    if let Some(ds) = deepspeed {
        value["deepspeed"] = Value::String(ds.display().to_string());
        overridden.push("deepspeed".to_string());
    }
    // `--set deepspeed=…` first: the ds_config applies before other overrides.
    let (first, rest): (Vec<&String>, Vec<&String>) = overrides.iter().partition(|a| {
        a.split_once('=')
            .is_some_and(|(k, _)| k.trim() == "deepspeed")
    });
    for assignment in first {
        apply_override(&mut value, assignment, &mut overridden)?;
    }
    let deepspeed = import_deepspeed(&mut value, path, &text)?;
    for assignment in rest {
        apply_override(&mut value, assignment, &mut overridden)?;
    }
    let mut spec: JobSpec = serde_json::from_value(value).map_err(|e| ConfigError::Invalid {
        location: path.display().to_string(),
        key: "(spec)".into(),
        message: improve_serde_message(&e.to_string()),
    })?;
    spec.run_dir = spec.run_dir.replace("${name}", &spec.name);
    let profile = spec
        .flops_profiler
        .as_mut()
        .and_then(|p| p.output_file.as_mut());
    let comms = spec
        .comms_logger
        .as_mut()
        .and_then(|c| c.output_file.as_mut());
    for dir in [&mut spec.tensorboard, &mut spec.csv_monitor]
        .into_iter()
        .flatten()
        .chain(profile)
        .chain(comms)
    {
        *dir = dir.replace("${name}", &spec.name);
    }
    Ok(LoadedJob {
        spec,
        path: path.to_path_buf(),
        text,
        overridden,
        deepspeed,
        model_from,
    })
}

/// Where the job's `model.init_from` (`--set` included) is a directory with
/// a `config.json`, sets each of [`ARCHITECTURE_KEYS`] that neither the job
/// file nor an override writes to the directory's, as `from_pretrained`
/// takes the architecture from the file (the keys written stay, and must
/// agree with the file: `zckpt` holds them to it before launch), an
/// unwritten `seq_len` to the default capped at the directory's context,
/// and an unwritten `max_position_embeddings` to that context where the
/// job's sequences are shorter.
/// A `config.json` zrun cannot run is exit 2 at `model.init_from`.
fn adopt_model(
    value: &mut Value,
    path: &Path,
    text: &str,
    overrides: &[String],
) -> Result<Option<ModelFrom>, ConfigError> {
    let set_keys: Vec<&str> = overrides
        .iter()
        .filter_map(|a| a.split_once('=').map(|(k, _)| k.trim()))
        .collect();
    // The directory and the sequences after the overrides (the last that
    // names each wins).
    let mut probe = value.clone();
    for a in overrides.iter().filter(|a| {
        a.split_once('=')
            .is_some_and(|(k, _)| ["model.init_from", "model.seq_len"].contains(&k.trim()))
    }) {
        apply_override(&mut probe, a, &mut Vec::new())?;
    }
    let Some(dir) = probe["model"]["init_from"].as_str().map(PathBuf::from) else {
        return Ok(None);
    };
    let config = dir.join(crate::hf_config::CONFIG_JSON);
    if !config.is_file() {
        return Ok(None);
    }
    let from = crate::hf_config::model_spec(&dir).map_err(|e| ConfigError::Invalid {
        location: match find_key(text, "model.init_from") {
            Some((line, col)) if !set_keys.contains(&"model.init_from") => {
                format!("{}:{line}:{col}", path.display())
            }
            _ => "--set model.init_from".into(),
        },
        key: "model.init_from".into(),
        message: e.to_string(),
    })?;
    let from = serde_json::to_value(&from).expect("a model serializes");
    let untyped = serde_saphyr::from_str::<Value>(text).unwrap_or(Value::Null);
    let written = |key: &str| {
        let dotted = format!("model.{key}");
        get_path(&untyped, &dotted).is_some()
            || set_keys
                .iter()
                .any(|k| *k == "model" || *k == dotted || k.starts_with(&format!("{dotted}.")))
    };
    let model = value["model"]
        .as_object_mut()
        .expect("a spec's model is a mapping");
    let mut keys = Vec::new();
    for key in ARCHITECTURE_KEYS.into_iter().filter(|k| !written(k)) {
        match from.get(key) {
            Some(v) => model.insert(key.into(), v.clone()),
            None => model.remove(key),
        };
        keys.push(format!("model.{key}"));
    }
    let context = from["seq_len"].as_u64().expect("a model has a seq_len");
    if !written("seq_len") && model["seq_len"].as_u64().is_some_and(|n| n > context) {
        model.insert("seq_len".into(), context.into());
        keys.push("model.seq_len".into());
    }
    // The directory's context stays the model's (GPT-2's position table)
    // where the job trains on shorter sequences.
    let seq_len = match written("seq_len") {
        true => probe["model"]["seq_len"].as_u64(),
        false => model["seq_len"].as_u64(),
    };
    if !written("max_position_embeddings") && seq_len != Some(context) {
        model.insert("max_position_embeddings".into(), context.into());
        keys.push("model.max_position_embeddings".into());
    }
    Ok(Some(ModelFrom { config, keys }))
}

/// Applies one `KEY=VALUE` override and checks the spec it leaves.
fn apply_override(
    value: &mut Value,
    assignment: &str,
    overridden: &mut Vec<String>,
) -> Result<(), ConfigError> {
    let (key, raw) = assignment
        .split_once('=')
        .ok_or_else(|| ConfigError::Override {
            assignment: assignment.to_string(),
            message: "expected KEY=VALUE, e.g. --set zero.stage=0".into(),
        })?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(ConfigError::Override {
            assignment: assignment.to_string(),
            message: format!("`{key}` is not a dotted key path"),
        });
    }
    // The spec value holds each key once, under its own name: DeepSpeed's
    // spellings set zrun's (and both count as overridden, for `locate`).
    let key = match ALIASES.iter().find(|(alias, _)| *alias == key) {
        Some((alias, own)) => {
            overridden.push(alias.to_string());
            *own
        }
        None => key,
    };
    let parsed: Value = if raw.trim().is_empty() {
        Value::Null
    } else {
        serde_saphyr::from_str(raw).map_err(|e| ConfigError::Override {
            assignment: assignment.to_string(),
            message: format!(
                "value does not parse: {}",
                plain_yaml_message(&e.without_snippet().to_string())
            ),
        })?
    };
    set_path(value, key, parsed).map_err(|message| ConfigError::Override {
        assignment: assignment.to_string(),
        message,
    })?;
    // Check each override as it lands, so the error names the culprit.
    serde_json::from_value::<JobSpec>(value.clone()).map_err(|e| ConfigError::Override {
        assignment: assignment.to_string(),
        message: improve_serde_message(&e.to_string()),
    })?;
    overridden.push(key.to_string());
    Ok(())
}

/// Keys the spec also accepts under DeepSpeed's names: (alias, own name).
const ALIASES: [(&str, &str); 4] = [
    ("zero.zero_quantized_weights", "zero.quantized_weights"),
    ("zero.zero_hpz_partition_size", "zero.hpz_partition_size"),
    ("zero.zero_quantized_gradients", "zero.quantized_gradients"),
    ("zero.zeropp_loco_param", "zero.loco"),
];

/// Reads the ds_config that `value`'s `deepspeed` key names, if any, and sets
/// the job's keys from it. A key the job file writes too must agree, unless
/// the ds_config only implies it (see [`crate::deepspeed`]).
fn import_deepspeed(
    value: &mut Value,
    job_path: &Path,
    text: &str,
) -> Result<Option<DeepSpeedConfig>, ConfigError> {
    let Some(ds_path) = value.get("deepspeed").and_then(Value::as_str) else {
        return Ok(None);
    };
    let d_model = value["model"]["d_model"].as_u64().unwrap_or(0) as usize;
    let ds = crate::deepspeed::read(Path::new(ds_path), d_model)?;
    for m in &ds.mapped {
        let new = match &m.value {
            MappedValue::Set(v) => v.clone(),
            MappedValue::Job => continue,
            MappedValue::TimesLr(r) => Value::from(
                get_path(value, "train.lr")
                    .and_then(Value::as_f64)
                    .unwrap_or(0.0)
                    * r,
            ),
        };
        if let Some((line, col)) = find_key(text, m.key) {
            let current = get_path(value, m.key).cloned().unwrap_or(Value::Null);
            match m.origin {
                Origin::Default | Origin::Auto => continue,
                Origin::Written if !crate::deepspeed::same_value(&current, &new) => {
                    return Err(ConfigError::Invalid {
                        location: ds.location(m.at),
                        key: m.source.clone(),
                        message: format!(
                            "sets {} to {new}, but {}:{line}:{col} sets it to {current}: remove one of the two",
                            m.key,
                            job_path.display()
                        ),
                    });
                }
                Origin::Written => {}
            }
        }
        set_path(value, m.key, new).map_err(|message| ConfigError::Invalid {
            location: ds.location(m.at),
            key: m.source.clone(),
            message,
        })?;
    }
    // The values were checked one by one; this catches what only the whole
    // spec can say.
    serde_json::from_value::<JobSpec>(value.clone()).map_err(|e| ConfigError::Invalid {
        location: ds.path.display().to_string(),
        key: "(deepspeed)".into(),
        message: improve_serde_message(&e.to_string()),
    })?;
    Ok(Some(ds))
}

fn get_path<'v>(root: &'v Value, key: &str) -> Option<&'v Value> {
    key.split('.').try_fold(root, |v, k| v.get(k))
}

fn syntax_error(path: &Path, text: &str, e: &serde_saphyr::Error) -> ConfigError {
    let (line, column) = e
        .location()
        .map(|l| (l.line(), l.column()))
        .unwrap_or((1, 1));
    let s = e.without_snippet().to_string();
    // plain_yaml_message drops the position serde-saphyr appends: we print
    // our own prefix.
    let mut message = improve_serde_message(&plain_yaml_message(&s));
    let untyped = serde_saphyr::from_str::<Value>(text).ok();
    let json_error = untyped
        .clone()
        .and_then(|v| serde_json::from_value::<JobSpec>(v).err())
        .map(|je| improve_serde_message(&je.to_string()));
    if message.starts_with("unknown key") && !message.contains('(') && !message.contains('?') {
        // serde-saphyr does not always keep serde's list of valid keys; serde_json
        // does, so ask it through the untyped value.
        if let Some(better) = json_error.clone().filter(|m| m.starts_with("unknown key")) {
            message = better;
        }
    }
    // serde-saphyr's type errors name neither the key nor the type wanted
    // (`d_model: [64]` was "expected string scalar", `d_model: abc` "invalid
    // u64"); serde_json's name the type, and the key is the last one the
    // text opens before the error.
    if let (Some(better), Some(v)) = (
        json_error.filter(|m| m.starts_with("invalid type") || m.starts_with("invalid value")),
        &untyped,
    ) {
        if !message.contains("expected one of") {
            let better = ["usize", "u64", "u32"]
                .iter()
                .fold(better, |m, t| {
                    m.replace(&format!("expected {t}"), "expected a whole number ≥ 0")
                })
                .replace("expected f64", "expected a number");
            message = match key_before(text, v, (line as usize, column as usize)) {
                Some(key) => format!("{key}: {better}"),
                None => better,
            };
        }
    }
    ConfigError::Syntax {
        path: path.to_path_buf(),
        line,
        column,
        message,
    }
}

fn set_path(root: &mut Value, key: &str, new: Value) -> Result<(), String> {
    let mut cur = root;
    let parts: Vec<&str> = key.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        if cur.is_null() {
            *cur = Value::Object(Default::default());
        }
        let Value::Object(map) = cur else {
            return Err(format!("`{}` is not a mapping", parts[..i].join(".")));
        };
        if i + 1 == parts.len() {
            map.insert(part.to_string(), new);
            return Ok(());
        }
        cur = map.entry(part.to_string()).or_insert(Value::Null);
    }
    unreachable!("a key path has at least one part")
}

impl LoadedJob {
    /// `file:line:col` of a dotted key, or `--set` if an override set it, or
    /// the ds_config's line that set it, or the file.
    pub fn locate(&self, key: &str) -> String {
        if let Some(from) = self.model_from.as_ref().filter(|f| {
            f.keys
                .iter()
                .any(|k| k == key || key.starts_with(&format!("{k}.")))
        }) {
            return from.config.display().to_string();
        }
        if self
            .overridden
            .iter()
            .any(|k| k == key || key.starts_with(&format!("{k}.")))
        {
            return format!("--set {key}");
        }
        // A table the file leaves out, one of whose keys `--set` wrote.
        if let Some(k) = self
            .overridden
            .iter()
            .find(|k| k.starts_with(&format!("{key}.")) && find_key(&self.text, key).is_none())
        {
            return format!("--set {k}");
        }
        let in_job = find_key(&self.text, key);
        if let Some(m) = self.deepspeed.as_ref().and_then(|ds| {
            ds.source_of(key)
                .filter(|m| m.origin == Origin::Written || in_job.is_none())
                .map(|m| (ds, m))
        }) {
            let (ds, m) = m;
            return format!("{} ({})", ds.location(m.at), m.source);
        }
        match in_job {
            Some((line, col)) => format!("{}:{line}:{col}", self.path.display()),
            None => self.path.display().to_string(),
        }
    }

    /// The `config.json` that gave the job's model the keys it leaves out
    /// (`model.init_from`'s directory), if any, and those keys.
    pub fn model_from(&self) -> Option<(&Path, &[String])> {
        self.model_from
            .as_ref()
            .map(|f| (f.config.as_path(), f.keys.as_slice()))
    }

    /// The DeepSpeed config the job was read with, if any.
    pub fn deepspeed(&self) -> Option<&DeepSpeedConfig> {
        self.deepspeed.as_ref()
    }

    /// Whether the job file, an override or the ds_config (not "auto", not
    /// an implied default) chose `key`'s value.
    fn chosen(&self, key: &str) -> bool {
        self.overridden.iter().any(|k| k == key)
            || find_key(&self.text, key).is_some()
            || self
                .deepspeed
                .as_ref()
                .and_then(|ds| ds.source_of(key))
                .is_some_and(|m| m.origin == Origin::Written)
    }

    /// `train.one_cycle`'s values: a cycle of at least a step, rates and
    /// momenta in range, and a β1 that its decay keeps below 1 up to the
    /// last of `steps`.
    fn check_one_cycle(&self, c: &OneCycleSpec, steps: u64) -> Result<(), ConfigError> {
        let key = |k: &str| format!("train.one_cycle.{k}");
        if c.cycle_first_step_size == 0 {
            return Err(self.invalid(&key("cycle_first_step_size"), "must be at least 1, got 0"));
        }
        for (k, v) in [
            ("cycle_min_mom", c.cycle_min_mom),
            ("cycle_max_mom", c.cycle_max_mom),
        ] {
            if !(0.0..1.0).contains(&v) {
                return Err(self.invalid(&key(k), format!("must be in [0, 1), got {v}")));
            }
        }
        for (k, v) in [
            ("decay_lr_rate", c.decay_lr_rate),
            ("decay_mom_rate", c.decay_mom_rate),
        ] {
            if v < 0.0 {
                return Err(self.invalid(&key(k), format!("must be at least 0, got {v}")));
            }
        }
        let first = c.cycle_first_step_size;
        let length = first + c.cycle_second_step_size.unwrap_or(first);
        let past = steps.saturating_sub(1).saturating_sub(length) as f64;
        if c.cycle_momentum && c.decay_step_size > 0 && past > 0.0 {
            let last = c.cycle_max_mom * (1.0 + c.decay_mom_rate * past / c.decay_step_size as f64);
            if last >= 1.0 {
                return Err(self.invalid(
                    &key("decay_mom_rate"),
                    format!(
                        "takes β1 to {last} by step {steps} (cycle_max_mom {} grown {past} steps past the cycle); \
                         Adam's β1 must stay below 1",
                        c.cycle_max_mom
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `train.curriculum`'s values: lengths between 1 and `model.seq_len`,
    /// the keys of its schedule and none of another's, and a first length
    /// that `difficulty_step`'s rounding leaves above 0.
    fn check_curriculum(&self, c: &CurriculumSpec) -> Result<(), ConfigError> {
        use crate::curriculum::CurriculumSchedule as S;
        let key = |k: &str| format!("train.curriculum.{k}");
        let full = self.spec.model.seq_len;
        let in_range = |k: &str, v: usize| {
            if (1..=full).contains(&v) {
                Ok(())
            } else {
                Err(self.invalid(
                    &key(k),
                    format!("must be between 1 and model.seq_len ({full}) tokens, got {v}"),
                ))
            }
        };
        in_range("min_difficulty", c.min_difficulty)?;
        let max = c.max(full);
        in_range("max_difficulty", max)?;
        if c.min_difficulty > max {
            return Err(self.invalid(
                &key("min_difficulty"),
                format!("{} is above max_difficulty ({max})", c.min_difficulty),
            ));
        }
        let discrete = c.schedule_type == S::FixedDiscrete;
        let stray = [
            (
                "total_curriculum_step",
                c.total_curriculum_step.is_some(),
                !discrete,
            ),
            ("difficulty_step", c.difficulty_step.is_some(), !discrete),
            (
                "root_degree",
                c.root_degree.is_some(),
                c.schedule_type == S::FixedRoot,
            ),
            ("difficulty", !c.difficulty.is_empty(), discrete),
            ("max_step", !c.max_step.is_empty(), discrete),
        ];
        for (k, set, belongs) in stray {
            if set && !belongs {
                return Err(self.invalid(
                    &key(k),
                    format!(
                        "has no place beside schedule_type: {}",
                        c.schedule_type.name()
                    ),
                ));
            }
        }
        if discrete {
            if c.difficulty.len() != c.max_step.len() + 1 {
                return Err(self.invalid(
                    &key("difficulty"),
                    format!(
                        "fixed_discrete needs one more difficulty than max_step (the last length holds after the last max_step): {} and {}",
                        c.difficulty.len(),
                        c.max_step.len()
                    ),
                ));
            }
            for &d in &c.difficulty {
                in_range("difficulty", d)?;
            }
            if c.max_step.windows(2).any(|w| w[0] >= w[1]) || c.max_step.first() == Some(&0) {
                return Err(self.invalid(
                    &key("max_step"),
                    format!("must rise from 1 step on, got {:?}", c.max_step),
                ));
            }
            return Ok(());
        }
        if c.total_curriculum_step.is_none_or(|n| n == 0) {
            return Err(self.invalid(
                &key("total_curriculum_step"),
                format!(
                    "{} needs the steps from min_difficulty to max_difficulty, at least 1",
                    c.schedule_type.name()
                ),
            ));
        }
        let step = c.difficulty_step.unwrap_or(0);
        if !(1..=c.min_difficulty).contains(&step) {
            return Err(self.invalid(
                &key("difficulty_step"),
                format!(
                    "must be between 1 and min_difficulty ({}): every length is rounded down to a multiple of it, got {}",
                    c.min_difficulty,
                    c.difficulty_step.map_or("none".to_string(), |s| s.to_string())
                ),
            ));
        }
        if c.schedule_type == S::FixedRoot && !c.root_degree.is_some_and(|r| r > 0.0) {
            return Err(self.invalid(
                &key("root_degree"),
                format!(
                    "fixed_root needs a positive root degree (2: square root), got {}",
                    c.root_degree.map_or("none".to_string(), |r| r.to_string())
                ),
            ));
        }
        Ok(())
    }

    /// `train.warmup_ratio` (transformers' `warmup_ratio`) into
    /// `train.warmup_steps`: `ceil(ratio × steps)`, as transformers rounds
    /// it. Refused beside a `train.warmup_steps` the job chose.
    fn settle_warmup(&mut self) -> Result<(), ConfigError> {
        let schedule = self.spec.train.schedule;
        if !schedule.has_warmup() {
            let why = match schedule {
                Schedule::OneCycle => "whose rising half is its warmup",
                Schedule::LrRangeTest => "a sweep up from train.lr without a warmup",
                _ => "which starts at train.lr without a warmup, as transformers' does",
            };
            // No warmup but 0.
            let t = &self.spec.train;
            for (key, set) in [
                (
                    "train.warmup_ratio",
                    t.warmup_ratio.is_some_and(|r| r != 0.0),
                ),
                ("train.warmup_steps", t.warmup_steps != 0),
            ] {
                if set && self.chosen(key) {
                    return Err(self.invalid(
                        key,
                        format!(
                            "has no place beside train.schedule: {}, {why}",
                            schedule.name()
                        ),
                    ));
                }
            }
            self.spec.train.warmup_steps = 0;
            return Ok(());
        }
        let Some(r) = self.spec.train.warmup_ratio else {
            return Ok(());
        };
        let key = "train.warmup_ratio";
        if !(0.0..=1.0).contains(&r) {
            return Err(self.invalid(key, format!("must be between 0 and 1, got {r}")));
        }
        if self.chosen("train.warmup_steps") {
            return Err(self.invalid(
                key,
                "goes without train.warmup_steps (the warmup is one or the other): set one of them",
            ));
        }
        self.spec.train.warmup_steps = (r * self.spec.train.steps as f64).ceil() as u64;
        Ok(())
    }

    /// `train.epochs` (transformers' `num_train_epochs`) into `train.steps`
    /// for `world_size` workers: `ceil(epochs × sequences / global batch)`,
    /// at least one step, where `count` gives the sequences of one epoch of
    /// the training data (`zdata::job::sequences_per_epoch`: zconfig reads
    /// no data; called only when `train.epochs` is set, its error reported
    /// at that key). The epochs run into each other (no partial batch), so
    /// the last step may take up to one batch of the next. A run resumed
    /// `from` a checkpoint (its step and the global sequences it had
    /// consumed) gets the steps that finish the epochs at this batch, which
    /// another world size than the checkpoint's changes. A `warmup_ratio`
    /// is taken again of the steps. Call after [`Self::validate`], which
    /// checks `epochs` itself. Returns the sequences of an epoch, if counted.
    pub fn settle_epochs<E: std::fmt::Display>(
        &mut self,
        world_size: usize,
        from: Option<(u64, u64)>,
        count: impl FnOnce(&JobSpec) -> Result<u64, E>,
    ) -> Result<Option<u64>, ConfigError> {
        let Some(epochs) = self.spec.train.epochs else {
            return Ok(None);
        };
        let sequences = count(&self.spec).map_err(|e| {
            self.invalid(
                "train.epochs",
                format!("counting the sequences of an epoch: {e}"),
            )
        })?;
        let t = &self.spec.train;
        let global = (t.micro_batch_size * t.grad_accum * world_size) as f64;
        let (step, consumed) = from.unwrap_or((0, 0));
        let left = ((epochs * sequences as f64 - consumed as f64) / global).ceil();
        let steps = step as f64 + left.max(0.0);
        if steps > 1e12 {
            return Err(self.invalid(
                "train.epochs",
                format!("{epochs} epochs of {sequences} sequences are {steps} steps: too many"),
            ));
        }
        self.spec.train.steps = (steps as u64).max(1);
        if let Some(p) = &self.spec.flops_profiler {
            self.check_profile_step(p)?;
        }
        self.settle_warmup()?;
        Ok(Some(sequences))
    }

    /// `train.epochs`'s own checks, before the data is counted: a positive
    /// number, and not beside a `train.steps` the job chose.
    fn validate_epochs(&self) -> Result<(), ConfigError> {
        let Some(e) = self.spec.train.epochs else {
            return Ok(());
        };
        let key = "train.epochs";
        if e <= 0.0 {
            return Err(self.invalid(key, format!("must be above 0, got {e}")));
        }
        if self.chosen("train.steps") {
            return Err(self.invalid(
                key,
                "goes without train.steps (the run's length is one or the other): set one of them",
            ));
        }
        Ok(())
    }

    /// DeepSpeed's batch arithmetic, once the world size is known: a
    /// ds_config's `train_batch_size` must equal micro-batch × accumulation ×
    /// world size, and fills in whichever of the two factors the job left
    /// open (accumulation 1 when both are).
    fn settle_batch(&mut self, world_size: usize) -> Result<(), ConfigError> {
        if let Some((e, at)) = self.deepspeed.as_ref().and_then(|ds| ds.elasticity.clone()) {
            return self.settle_elastic_batch(&e, at, world_size);
        }
        let Some((total, at)) = self.deepspeed.as_ref().and_then(|ds| ds.train_batch_size) else {
            return Ok(());
        };
        let ds = self.deepspeed.as_ref().expect("checked above");
        let location = ds.location(at);
        let fail = |message: String| ConfigError::Invalid {
            location: location.clone(),
            key: "train_batch_size".into(),
            message,
        };
        let w = world_size as u64;
        let t = &self.spec.train;
        let (micro, accum) = (t.micro_batch_size as u64, t.grad_accum as u64);
        let (micro_chosen, accum_chosen) = (
            self.chosen("train.micro_batch_size"),
            self.chosen("train.grad_accum"),
        );
        let divide = |what: &str, by: u64| -> Result<u64, ConfigError> {
            if by > 0 && total.is_multiple_of(by) && total / by > 0 {
                Ok(total / by)
            } else {
                Err(fail(format!(
                    "{total} is not a whole number of {what} ({by} sequences each on {w} workers)"
                )))
            }
        };
        let (micro, accum) = match (micro_chosen, accum_chosen) {
            (true, true) => (micro, accum),
            (true, false) => (micro, divide("accumulation steps", micro * w)?),
            (false, true) => (divide("micro-batches", accum * w)?, accum),
            (false, false) => (divide("micro-batches", w)?, 1),
        };
        if micro * accum * w != total {
            return Err(fail(format!(
                "{total} ≠ micro-batch {micro} × gradient accumulation {accum} × {w} workers = {} (DeepSpeed checks the same)",
                micro * accum * w
            )));
        }
        self.spec.train.micro_batch_size = micro as usize;
        self.spec.train.grad_accum = accum as usize;
        Ok(())
    }

    /// A ds_config's `elasticity` ([`crate::elastic`]), once the world
    /// size is known: DeepSpeed's global batch for it, the largest of its
    /// micro-batches that divides a worker's share, and the accumulation
    /// that makes up the rest. A world size the batch does not run on is
    /// refused with the ones it does; a micro-batch or accumulation the
    /// job chose must be the one elasticity settles.
    fn settle_elastic_batch(
        &mut self,
        e: &crate::elastic::Elasticity,
        at: (usize, usize),
        world_size: usize,
    ) -> Result<(), ConfigError> {
        let ds = self
            .deepspeed
            .as_ref()
            .expect("elasticity comes from a ds_config");
        let fail = |message: String| ConfigError::Invalid {
            location: ds.location(at),
            key: "elasticity".into(),
            message,
        };
        let b = e.batch(world_size as u64);
        let Some((micro, accum)) = b.micro_and_accum else {
            let valid: Vec<String> = b.valid.iter().map(u64::to_string).collect();
            return Err(fail(match b.valid.contains(&(world_size as u64)) && b.total > 0 {
                true => format!(
                    "no micro-batch of {:?} divides {} sequences on each of {world_size} workers",
                    e.micro_batch_sizes,
                    b.total / world_size as u64
                ),
                false => format!(
                    "its batch of {} runs on {} workers, not on {world_size} (DeepSpeed refuses it too)",
                    b.total,
                    valid.join(", ")
                ),
            }));
        };
        for (key, chosen, settled) in [
            (
                "train.micro_batch_size",
                self.spec.train.micro_batch_size,
                micro,
            ),
            ("train.grad_accum", self.spec.train.grad_accum, accum),
        ] {
            if self.chosen(key) && chosen as u64 != settled {
                return Err(self.invalid(
                    key,
                    format!(
                        "{chosen}, where the ds_config's elasticity settles {settled} for {world_size} workers (a batch of {}): leave it out",
                        b.total
                    ),
                ));
            }
        }
        self.spec.train.micro_batch_size = micro as usize;
        self.spec.train.grad_accum = accum as usize;
        Ok(())
    }

    /// `train.freeze`: every pattern well formed and matching a parameter
    /// of the model, and something left to train.
    fn validate_freeze(&self) -> Result<(), ConfigError> {
        use crate::freeze;
        let (m, patterns) = (&self.spec.model, &self.spec.train.freeze);
        if patterns.is_empty() {
            return Ok(());
        }
        let names: Vec<String> = m.param_shapes().into_iter().map(|(n, _)| n).collect();
        for p in patterns {
            if let Some(why) = freeze::pattern_problem(p) {
                return Err(self.invalid("train.freeze", why));
            }
            if !names.iter().any(|n| freeze::matches(p, n)) {
                // The names outside the blocks, and the first block's.
                let later = |n: &&String| {
                    (1..m.n_layers).any(|i| n.starts_with(&format!("{}.", m.block_prefix(i))))
                };
                let shown: Vec<&str> = names
                    .iter()
                    .filter(|n| !later(n))
                    .map(String::as_str)
                    .collect();
                let others = match m.n_layers {
                    0 | 1 => String::new(),
                    2 => " (and block 1's, as block 0's)".into(),
                    n => format!(" (and blocks 1-{}'s, as block 0's)", n - 1),
                };
                return Err(self.invalid(
                    "train.freeze",
                    format!(
                        "`{p}` matches none of the model's parameters: {}{others}",
                        shown.join(", ")
                    ),
                ));
            }
        }
        if names.iter().all(|n| freeze::frozen(patterns, n)) {
            return Err(self.invalid(
                "train.freeze",
                "freezes every parameter: nothing would train",
            ));
        }
        Ok(())
    }

    pub(crate) fn invalid(&self, key: &str, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            location: self.locate(key),
            key: key.into(),
            message: message.into(),
        }
    }

    /// A ZeRO++ key as the file spells it: zrun's short name, or DeepSpeed's
    /// with the `zero_` prefix.
    fn written(&self, short: &'static str, deepspeed: &'static str) -> &'static str {
        if find_key(&self.text, deepspeed).is_some() {
            deepspeed
        } else {
            short
        }
    }

    /// A model within what any machine could hold: each width at most
    /// [`MAX_WIDTH`], at most [`MAX_LAYERS`] blocks and [`MAX_PARAMS`]
    /// parameters. A mistyped exponent is caught here, by its key, and not
    /// as a loop over billions of blocks or an allocation the size of the
    /// address space; within these bounds every size the crates compute
    /// from the model fits a `usize`.
    fn validate_model_size(&self, m: &crate::spec::ModelSpec) -> Result<(), ConfigError> {
        for (key, v, max) in [
            ("model.vocab_size", m.vocab_size, MAX_WIDTH),
            ("model.d_model", m.d_model, MAX_WIDTH),
            ("model.n_layers", m.n_layers, MAX_LAYERS),
            ("model.n_heads", m.n_heads, MAX_WIDTH),
            ("model.n_kv_heads", m.kv_heads(), MAX_WIDTH),
            ("model.head_dim", m.head_dim.unwrap_or(0), MAX_WIDTH),
            ("model.ffn_hidden", m.ffn(), MAX_WIDTH),
            ("model.seq_len", m.seq_len, MAX_WIDTH),
            (
                "model.max_position_embeddings",
                m.max_position_embeddings.unwrap_or(0),
                MAX_WIDTH,
            ),
        ] {
            if v > max {
                return Err(self.invalid(key, format!("must be at most {max}, got {v}")));
            }
        }
        let attention = m.n_heads * m.head_dim();
        if attention > MAX_WIDTH {
            return Err(self.invalid(
                "model.head_dim",
                format!(
                    "{} heads of {} make attention {attention} wide, more than {MAX_WIDTH}",
                    m.n_heads,
                    m.head_dim()
                ),
            ));
        }
        let params = m.embedding_params() as u128
            + m.n_layers as u128 * m.block_params() as u128
            + m.head_params() as u128;
        if params > MAX_PARAMS {
            return Err(self.invalid(
                "model",
                format!(
                    "{params} parameters ({:.1e}), more than the {MAX_PARAMS} ({:.1e}) zrun takes: \
                     some {:.0} TB of f32 weights alone",
                    params as f64,
                    MAX_PARAMS as f64,
                    params as f64 * 4e-12
                ),
            ));
        }
        Ok(())
    }

    /// `model.partial_rotary_factor` turns an even width of at least 2 in
    /// each head, and goes with what transformers' Phi-3 (the family that
    /// has it, as which such a model is exported) has: no q, k and v biases
    /// nor q and k norms, heads `d_model / n_heads` wide, no rotary
    /// scaling but LongRoPE.
    fn validate_partial_rotation(
        &self,
        m: &crate::spec::ModelSpec,
        f: f64,
    ) -> Result<(), ConfigError> {
        let key = "model.partial_rotary_factor";
        if !(f > 0.0 && f <= 1.0) {
            return Err(self.invalid(key, format!("must be above 0 and at most 1, got {f}")));
        }
        let (hd, rot) = (m.head_dim(), m.rotary_dim());
        if rot < 2 || !rot.is_multiple_of(2) {
            return Err(self.invalid(
                key,
                format!("turns {rot} of each head's {hd} columns: rotary embeddings turn pairs, an even width of at least 2"),
            ));
        }
        if rot == hd {
            return Ok(());
        }
        let phi3 = "goes with Phi-3's attention, as which a model of it is exported";
        if m.qkv_bias == Some(true)
            || m.qk_norm == Some(true)
            || m.head_dim.is_some_and(|h| h * m.n_heads != m.d_model)
        {
            return Err(self.invalid(
                key,
                format!(
                    "{phi3}: no model.qkv_bias, no model.qk_norm, heads d_model / n_heads wide"
                ),
            ));
        }
        match &m.rope_scaling {
            None | Some(crate::spec::RopeScaling::Longrope { .. }) => Ok(()),
            Some(_) => Err(self.invalid(
                key,
                format!("{phi3}, whose rotary embedding is scaled as longrope or not at all"),
            )),
        }
    }

    /// `reduce_lr_on_plateau`: validations to watch, and its knobs in range.
    /// `flops_profiler.profile_step` within the run's steps.
    fn check_profile_step(&self, p: &FlopsProfilerSpec) -> Result<(), ConfigError> {
        let steps = self.spec.train.steps;
        if p.profile_step > steps {
            return Err(self.invalid(
                "flops_profiler.profile_step",
                format!(
                    "{} is after the run's last step ({steps}): nothing would be profiled",
                    p.profile_step
                ),
            ));
        }
        Ok(())
    }

    /// `flops_profiler`: a step the run reaches, a depth of -1 or more,
    /// a file named, and a CPU job (a GPU's module times are launches:
    /// `ZRUN_GPU_PROFILE` times its kernels).
    fn check_flops_profiler(&self, p: &FlopsProfilerSpec) -> Result<(), ConfigError> {
        let key = |k: &str| format!("flops_profiler.{k}");
        if p.profile_step == 0 {
            return Err(self.invalid(
                &key("profile_step"),
                "must be at least 1 (steps count from 1)",
            ));
        }
        // A run of `train.epochs` knows its steps once its data is counted
        // (`LoadedJob::settle_epochs`, which checks there).
        if self.spec.train.epochs.is_none() {
            self.check_profile_step(p)?;
        }
        if p.module_depth < -1 {
            return Err(self.invalid(
                &key("module_depth"),
                format!("{}: must be -1 (every depth) or at least 0", p.module_depth),
            ));
        }
        if p.output_file
            .as_deref()
            .is_some_and(|f| f.trim().is_empty())
        {
            return Err(self.invalid(
                &key("output_file"),
                "must name a file (or be null for flops_profile.txt in run_dir)",
            ));
        }
        if self.spec.device == Device::Cuda {
            return Err(self.invalid(
                "flops_profiler",
                "times modules on the CPU path; on a GPU set ZRUN_GPU_PROFILE=1 for the kernels' times",
            ));
        }
        Ok(())
    }

    /// `comms_logger`: collectives by their names, at least one logged, a
    /// file named, and a CPU job (NCCL's collectives run on the GPU's
    /// stream, which the log does not time).
    fn check_comms_logger(&self, c: &CommsLoggerSpec) -> Result<(), ConfigError> {
        if let Some(op) = c.prof_ops.iter().find(|o| !COMM_OPS.contains(&o.as_str())) {
            return Err(self.invalid(
                "comms_logger.prof_ops",
                format!("`{op}` is not a collective; one of {}", COMM_OPS.join(", ")),
            ));
        }
        if !c.prof_all && c.prof_ops.is_empty() {
            return Err(self.invalid(
                "comms_logger.prof_ops",
                "is empty and prof_all is false: nothing would be logged",
            ));
        }
        if c.output_file
            .as_deref()
            .is_some_and(|f| f.trim().is_empty())
        {
            return Err(self.invalid(
                "comms_logger.output_file",
                "must name a file (or be null for comms_log.txt in run_dir)",
            ));
        }
        if self.spec.device == Device::Cuda {
            return Err(self.invalid(
                "comms_logger",
                "times the CPU path's collectives; NCCL's run on the GPU's stream, untimed",
            ));
        }
        Ok(())
    }

    fn check_plateau(&self) -> Result<(), ConfigError> {
        let s = &self.spec;
        if !s.train.eval_every.is_set() {
            return Err(self.invalid(
                "train.schedule",
                "reduce_lr_on_plateau lowers the rate when the validation loss stops improving: set train.eval_every (and validation data: data.val_path or data.val_fraction)",
            ));
        }
        let p = s.train.plateau.clone().unwrap_or_default();
        if !(p.factor > 0.0 && p.factor < 1.0) {
            return Err(self.invalid(
                "train.plateau.factor",
                format!("must be in (0, 1), got {}", p.factor),
            ));
        }
        for (key, v) in [
            ("train.plateau.threshold", p.threshold),
            ("train.plateau.eps", p.eps),
        ] {
            if v < 0.0 {
                return Err(self.invalid(key, format!("must be at least 0, got {v}")));
            }
        }
        Ok(())
    }

    /// The knobs of one rule: LAMB's trust-ratio bounds, written only for
    /// LAMB, `0 < min_coeff <= max_coeff`; Adagrad's `lr_decay` and
    /// `initial_accumulator_value`, written only for Adagrad, at least 0;
    /// `bias_correction`, written only for the rules that correct.
    fn validate_rule_knobs(&self) -> Result<(), ConfigError> {
        let o = &self.spec.train.optimizer;
        for (key, v) in [
            ("train.optimizer.min_coeff", o.min_coeff),
            ("train.optimizer.max_coeff", o.max_coeff),
        ] {
            let Some(v) = v else { continue };
            if o.kind != OptimizerKind::Lamb {
                return Err(self.invalid(
                    key,
                    format!(
                        "bounds LAMB's trust ratio; train.optimizer.type is {}",
                        o.kind.name()
                    ),
                ));
            }
            if !(v > 0.0 && v <= f64::from(f32::MAX)) {
                return Err(self.invalid(key, format!("must be a positive number, got {v}")));
            }
        }
        let corrects = matches!(
            o.kind,
            OptimizerKind::Adamw | OptimizerKind::Adam | OptimizerKind::Lamb
        );
        if o.bias_correction.is_some() && !corrects {
            return Err(self.invalid(
                "train.optimizer.bias_correction",
                format!(
                    "corrects Adam's and LAMB's moments; train.optimizer.type is {}, which keeps none to correct",
                    o.kind.name()
                ),
            ));
        }
        let [lo, hi] = o.trust_bounds();
        if lo > hi {
            return Err(self.invalid(
                "train.optimizer.min_coeff",
                format!("{lo} is above max_coeff {hi}"),
            ));
        }
        for (key, v, what) in [
            (
                "train.optimizer.lr_decay",
                o.lr_decay,
                "decays Adagrad's rate",
            ),
            (
                "train.optimizer.initial_accumulator_value",
                o.initial_accumulator_value,
                "starts Adagrad's sums of squares",
            ),
        ] {
            let Some(v) = v else { continue };
            if o.kind != OptimizerKind::Adagrad {
                return Err(self.invalid(
                    key,
                    format!("{what}; train.optimizer.type is {}", o.kind.name()),
                ));
            }
            if !(v >= 0.0 && v <= f64::from(f32::MAX)) {
                return Err(self.invalid(key, format!("must be a number at least 0, got {v}")));
            }
        }
        Ok(())
    }

    /// `train.reduce_dtype`: f32, or a 16-bit type the gradients fit: bf16
    /// beside any working type, f16 only under f16's loss scaling (a
    /// partial sum of unscaled f32 or bf16 gradients beyond 65504 would
    /// overflow with nothing to catch it). Not beside qgZ, which chooses
    /// the gradients' wire format itself.
    fn validate_reduce_dtype(&self) -> Result<(), ConfigError> {
        let s = &self.spec;
        let why = match s.train.reduce_dtype {
            None | Some(Dtype::F32) => return Ok(()),
            Some(Dtype::F16) if s.train.dtype != Dtype::F16 => format!(
                "f16 needs train.dtype: f16, whose loss scaling catches an overflowing sum (this job is {}): use bf16",
                s.train.dtype
            ),
            Some(_) if s.zero.quantized_gradients => {
                "ZeRO++ qgZ (zero.quantized_gradients) already sends the gradients quantized: leave one of the two out".to_string()
            }
            Some(_) => return Ok(()),
        };
        Err(self.invalid("train.reduce_dtype", why))
    }

    /// `comm.backend: nccl`: ZeRO's collectives between GPUs, every state
    /// on the ranks' GPUs (stages 0-3; f32, bf16 or f16). Offload, which
    /// keeps the optimizer or the parameters on the host, and ZeRO++, whose
    /// quantized and hierarchical collectives run on the host's transports,
    /// are refused, naming the key.
    fn validate_nccl(&self) -> Result<(), ConfigError> {
        let s = &self.spec;
        let z = &s.zero;
        let why = if s.device != Device::Cuda {
            "needs device: cuda (NCCL runs between GPUs; CPU jobs use auto, tcp, shm or mpi)"
        } else if z.offload_optimizer.device != OffloadDevice::None
            || z.offload_param.device != OffloadDevice::None
        {
            "keeps every state on the GPUs, but offload moves it to the host: use comm.backend: auto with offload"
        } else if z.quantized_weights || z.quantized_gradients || z.hpz_partition_size > 1 {
            "runs plain collectives; ZeRO++ (zero_quantized_weights, zero_hpz_partition_size, zero_quantized_gradients) runs its own on the host's transports: use comm.backend: auto with ZeRO++"
        } else if s.train.reduce_dtype.is_some_and(|d| d != Dtype::F32) {
            "reduces the gradients in f32; train.reduce_dtype's 16-bit reductions run on the host's transports: use comm.backend: auto with it"
        } else {
            return Ok(());
        };
        Err(self.invalid("comm.backend", format!("nccl {why}")))
    }

    /// [`Self::validate`] for the nodes of `topo`, plus what depends on their
    /// shapes: hpZ's secondary partitions must tile every node's workers.
    pub fn validate_on(&mut self, topo: &Topology) -> Result<(), ConfigError> {
        self.validate(topo.world_size())?;
        let p = self.spec.zero.hpz_partition_size;
        if p > 1 && topo.nodes.iter().any(|n| !n.slots.len().is_multiple_of(p)) {
            let nodes: Vec<String> = topo
                .nodes
                .iter()
                .map(|n| format!("{} × {}", n.host, n.slots.len()))
                .collect();
            return Err(self.invalid(
                self.written("zero.hpz_partition_size", "zero.zero_hpz_partition_size"),
                format!(
                    "{p} must divide the workers of every node (a secondary partition lives inside one node); this job's nodes: {}",
                    nodes.join(", ")
                ),
            ));
        }
        Ok(())
    }

    /// Semantic checks for a job on `world_size` workers, after settling a
    /// ds_config's `train_batch_size` for it. Reads the data files' sizes.
    pub fn validate(&mut self, world_size: usize) -> Result<(), ConfigError> {
        self.settle_batch(world_size)?;
        self.validate_epochs()?;
        self.settle_warmup()?;
        let s = &self.spec;
        let m = &s.model;
        for (key, v) in [
            ("model.vocab_size", m.vocab_size),
            ("model.d_model", m.d_model),
            ("model.n_layers", m.n_layers),
            ("model.n_heads", m.n_heads),
            ("model.seq_len", m.seq_len),
            ("model.n_kv_heads", m.kv_heads()),
            ("model.ffn_hidden", m.ffn()),
        ] {
            if v == 0 {
                return Err(self.invalid(key, "must be at least 1"));
            }
        }
        if m.head_dim == Some(0) {
            return Err(self.invalid("model.head_dim", "must be at least 1"));
        }
        self.validate_model_size(m)?;
        if m.context() < m.seq_len {
            return Err(self.invalid(
                "model.max_position_embeddings",
                format!(
                    "{} is shorter than model.seq_len {}: the model takes no sequence that long",
                    m.context(),
                    m.seq_len
                ),
            ));
        }
        if m.head_dim.is_none() && !m.d_model.is_multiple_of(m.n_heads) {
            return Err(self.invalid(
                "model.n_heads",
                format!(
                    "{} heads do not divide d_model {} (a LLaMA may set model.head_dim)",
                    m.n_heads, m.d_model
                ),
            ));
        }
        if m.kind == ModelKind::Gpt {
            for (key, set) in [
                ("model.n_kv_heads", m.n_kv_heads.is_some()),
                ("model.rope_theta", m.rope_theta.is_some()),
                ("model.rope_scaling", m.rope_scaling.is_some()),
                ("model.tie_embeddings", m.tie_embeddings == Some(false)),
                ("model.qkv_bias", m.qkv_bias == Some(true)),
                ("model.head_dim", m.head_dim.is_some()),
                ("model.qk_norm", m.qk_norm == Some(true)),
                (
                    "model.partial_rotary_factor",
                    m.partial_rotary_factor.is_some(),
                ),
                ("model.sliding_window", m.sliding_window.is_some()),
            ] {
                if set {
                    return Err(self.invalid(
                        key,
                        "is for `kind: llama`; GPT-2 has plain multi-head attention, learned positions, a tied head and a bias on every linear",
                    ));
                }
            }
        }
        if m.sliding_window == Some(0) {
            return Err(self.invalid(
                "model.sliding_window",
                "must be at least 1 (the keys each token attends to, itself included)",
            ));
        }
        if m.qk_norm == Some(true) && m.qkv_bias == Some(true) {
            return Err(self.invalid(
                "model.qk_norm",
                "goes without model.qkv_bias: Qwen3's attention has norms of q and k and no biases (a bias there would bias the output projection too)",
            ));
        }
        if !m.n_heads.is_multiple_of(m.kv_heads()) {
            return Err(self.invalid(
                "model.n_kv_heads",
                format!(
                    "{} key/value heads do not divide n_heads {}",
                    m.kv_heads(),
                    m.n_heads
                ),
            ));
        }
        if m.kind == ModelKind::Llama && !m.head_dim().is_multiple_of(2) {
            return Err(match m.head_dim {
                Some(hd) => self.invalid(
                    "model.head_dim",
                    format!("rotary embeddings need an even head width, got {hd}"),
                ),
                None => self.invalid(
                    "model.n_heads",
                    format!(
                        "rotary embeddings need an even head width; d_model {} / {} heads is {}",
                        m.d_model,
                        m.n_heads,
                        m.head_dim()
                    ),
                ),
            });
        }
        for (key, v) in [
            ("model.rope_theta", m.rope_theta()),
            ("model.norm_eps", m.norm_eps()),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(self.invalid(key, format!("must be a positive number, got {v}")));
            }
        }
        for (key, p) in [
            ("model.hidden_dropout", m.hidden_dropout),
            ("model.attention_dropout", m.attention_dropout),
            ("train.label_smoothing", Some(s.train.label_smoothing)),
            (
                "train.neftune_noise_alpha",
                Some(s.train.neftune_noise_alpha),
            ),
        ] {
            let Some(p) = p else { continue };
            let neftune = key == "train.neftune_noise_alpha";
            if p < 0.0 || (p >= 1.0 && !neftune) {
                let range = if neftune {
                    "at least 0"
                } else {
                    "at least 0 and below 1"
                };
                return Err(self.invalid(key, format!("must be {range}, got {p}")));
            }
        }
        if let Some(f) = m.partial_rotary_factor {
            self.validate_partial_rotation(m, f)?;
        }
        if let Some(scaling) = &m.rope_scaling {
            if let Some(why) = rope_scaling_problem(scaling, m.rotary_dim()) {
                return Err(self.invalid("model.rope_scaling", why));
            }
        }
        if let Some(n) = m.tile_size {
            if n.0 == 0 {
                return Err(self.invalid("model.tile_size", "must be at least 1"));
            }
            for (layer, inputs, outputs) in m.block_linears() {
                if let Err(e) =
                    crate::tiles::column_tiles(layer, inputs, outputs, Some(n.0 as usize))
                {
                    return Err(self.invalid("model.tile_size", e.to_string()));
                }
            }
        }
        if let Some(f) = &m.init_from {
            if !Path::new(f).exists() {
                return Err(
                    self.invalid("model.init_from", format!("{f}: no such file or directory"))
                );
            }
        }
        let t = &s.train;
        if t.steps == 0 {
            return Err(self.invalid("train.steps", "must be at least 1"));
        }
        if t.micro_batch_size == 0 {
            return Err(self.invalid("train.micro_batch_size", "must be at least 1"));
        }
        if t.grad_accum == 0 {
            return Err(self.invalid("train.grad_accum", "must be at least 1"));
        }
        if !(t.lr.is_finite() && t.lr > 0.0) {
            return Err(self.invalid(
                "train.lr",
                format!("must be a positive number, got {}", t.lr),
            ));
        }
        if !(t.min_lr.is_finite() && (0.0..=t.lr).contains(&t.min_lr)) {
            return Err(self.invalid(
                "train.min_lr",
                format!(
                    "must be between 0 and train.lr ({}), got {}",
                    t.lr, t.min_lr
                ),
            ));
        }
        if !(t.warmup_start_lr.is_finite() && (0.0..=t.lr).contains(&t.warmup_start_lr)) {
            return Err(self.invalid(
                "train.warmup_start_lr",
                format!(
                    "must be between 0 and train.lr ({}), got {}",
                    t.lr, t.warmup_start_lr
                ),
            ));
        }
        if !(t.decay_fraction > 0.0 && t.decay_fraction <= 1.0) {
            return Err(self.invalid(
                "train.decay_fraction",
                format!("must be in (0, 1], got {}", t.decay_fraction),
            ));
        }
        // A schedule's own knob beside another schedule would do nothing.
        let knobs = [
            (
                "num_cycles",
                t.num_cycles.is_some(),
                Schedule::CosineWithRestarts,
            ),
            ("power", t.power.is_some(), Schedule::Polynomial),
            ("timescale", t.timescale.is_some(), Schedule::InverseSqrt),
            ("one_cycle", t.one_cycle.is_some(), Schedule::OneCycle),
            (
                "lr_range_test",
                t.lr_range_test.is_some(),
                Schedule::LrRangeTest,
            ),
            ("plateau", t.plateau.is_some(), Schedule::ReduceLrOnPlateau),
        ];
        for (knob, set, owner) in knobs {
            if set && t.schedule != owner {
                return Err(self.invalid(
                    &format!("train.{knob}"),
                    format!(
                        "belongs to train.schedule: {}, and the schedule is {}",
                        owner.name(),
                        t.schedule.name()
                    ),
                ));
            }
        }
        if t.num_cycles == Some(0) {
            return Err(self.invalid("train.num_cycles", "must be at least 1, got 0"));
        }
        if let Some(p) = t.power.filter(|p| *p <= 0.0) {
            return Err(self.invalid("train.power", format!("must be a positive number, got {p}")));
        }
        if t.timescale == Some(0) {
            return Err(self.invalid("train.timescale", "must be at least 1, got 0"));
        }
        if let Some(c) = &t.one_cycle {
            self.check_one_cycle(c, t.steps)?;
        }
        if t.schedule == Schedule::ReduceLrOnPlateau {
            self.check_plateau()?;
        }
        if let Some(c) = &t.lr_range_test {
            if c.step_size == 0 {
                return Err(
                    self.invalid("train.lr_range_test.step_size", "must be at least 1, got 0")
                );
            }
            if c.step_rate < 0.0 {
                return Err(self.invalid(
                    "train.lr_range_test.step_rate",
                    format!("must be at least 0, got {}", c.step_rate),
                ));
            }
        }
        if let Some(c) = &t.curriculum {
            self.check_curriculum(c)?;
        }
        let f = t.gradient_predivide_factor;
        if !(f > 0.0 && f <= f64::from(f32::MAX)) {
            return Err(self.invalid(
                "train.gradient_predivide_factor",
                format!("must be a positive number, got {f}"),
            ));
        }
        if let Some(pld) = &t.progressive_layer_drop {
            if !(pld.theta > 0.0 && pld.theta <= 1.0) {
                return Err(self.invalid(
                    "train.progressive_layer_drop.theta",
                    format!(
                        "must be above 0 and at most 1 (the last block's chance to run), got {}",
                        pld.theta
                    ),
                ));
            }
            if pld.gamma < 0.0 {
                return Err(self.invalid(
                    "train.progressive_layer_drop.gamma",
                    format!("must be at least 0, got {}", pld.gamma),
                ));
            }
        }
        for (i, b) in t.optimizer.betas.iter().enumerate() {
            if !(0.0..1.0).contains(b) {
                return Err(self.invalid(
                    "train.optimizer.betas",
                    format!("beta{} must be in [0, 1), got {b}", i + 1),
                ));
            }
        }
        self.validate_rule_knobs()?;
        let eps = t.optimizer.eps();
        if !(eps.is_finite() && eps > 0.0) {
            return Err(self.invalid(
                "train.optimizer.eps",
                format!("must be a positive number, got {eps}"),
            ));
        }
        if !(0.0..1.0).contains(&s.data.val_fraction) {
            return Err(self.invalid(
                "data.val_fraction",
                format!("must be in [0, 1), got {}", s.data.val_fraction),
            ));
        }
        if t.eval_every.is_set() && s.data.val_fraction == 0.0 && s.data.val_path.is_none() {
            return Err(self.invalid(
                "train.eval_every",
                "needs validation data: set data.val_path or data.val_fraction (the share held out)",
            ));
        }
        if t.eval_steps == 0 {
            return Err(self.invalid("train.eval_steps", "must be at least 1"));
        }
        if !(t.weight_decay.is_finite() && t.weight_decay >= 0.0) {
            return Err(self.invalid("train.weight_decay", "must be a non-negative number"));
        }
        if !(t.grad_clip.is_finite() && t.grad_clip >= 0.0) {
            return Err(self.invalid(
                "train.grad_clip",
                "must be a non-negative number (0 disables)",
            ));
        }
        let ls = &t.loss_scale;
        if ls.initial_scale_power > 64 {
            return Err(self.invalid(
                "train.loss_scale.initial_scale_power",
                format!("must be at most 64, got {}", ls.initial_scale_power),
            ));
        }
        if let Some(v) = ls
            .static_scale
            .filter(|v| !(*v > 0.0 && *v <= f64::from(f32::MAX)))
        {
            return Err(self.invalid(
                "train.loss_scale.static_scale",
                format!("must be a positive number no larger than f32's 3.4e38, got {v}"),
            ));
        }
        if ls.loss_scale_window == 0 {
            return Err(self.invalid("train.loss_scale.loss_scale_window", "must be at least 1"));
        }
        if ls.hysteresis == 0 {
            return Err(self.invalid("train.loss_scale.hysteresis", "must be at least 1"));
        }
        if !(ls.min_loss_scale.is_finite() && ls.min_loss_scale > 0.0) {
            return Err(self.invalid(
                "train.loss_scale.min_loss_scale",
                "must be a positive number",
            ));
        }
        // The optimizer and the model compute in f32: a value past its range
        // would be infinite there, a positive epsilon below it zero.
        for (key, v, epsilon) in [
            ("train.lr", t.lr, false),
            ("train.min_lr", t.min_lr, false),
            ("train.warmup_start_lr", t.warmup_start_lr, false),
            ("train.weight_decay", t.weight_decay, false),
            ("train.optimizer.eps", t.optimizer.eps(), true),
            ("train.loss_scale.min_loss_scale", ls.min_loss_scale, false),
            ("model.norm_eps", m.norm_eps(), true),
        ] {
            if v > f64::from(f32::MAX) {
                return Err(self.invalid(
                    key,
                    format!(
                        "{v:e} is past f32's largest value (3.4e38), the precision it is used in"
                    ),
                ));
            }
            if epsilon && (v as f32) == 0.0 {
                return Err(self.invalid(
                    key,
                    format!(
                        "{v:e} is 0 in f32, the precision it is used in (the smallest is 1.4e-45)"
                    ),
                ));
            }
        }
        let z = &s.zero;
        if z.reduce_bucket_size.0 == 0 {
            return Err(self.invalid("zero.reduce_bucket_size", "must be at least 1 element"));
        }
        if z.sub_group_size.0 == 0 {
            return Err(self.invalid("zero.sub_group_size", "must be at least 1 element"));
        }
        if z.quantized_weights && z.stage != ZeroStage::Weights {
            return Err(self.invalid(
                self.written("zero.quantized_weights", "zero.zero_quantized_weights"),
                format!(
                    "needs zero.stage: 3 (qwZ quantizes stage 3's weight gathers; this job is stage {})",
                    z.stage
                ),
            ));
        }
        let q = &z.quantization;
        if q.block_size == 0 || !q.block_size.is_multiple_of(2) {
            return Err(self.invalid(
                "zero.quantization.block_size",
                format!("{}: must be a positive even number", q.block_size),
            ));
        }
        for (key, bits) in [
            ("weight_bits", q.weight_bits),
            ("gradient_bits", q.gradient_bits),
        ] {
            if bits != 8 && bits != 4 {
                return Err(self.invalid(
                    &format!("zero.quantization.{key}"),
                    format!("{bits}: must be 8 or 4"),
                ));
            }
        }
        if z.hpz_partition_size == 0 {
            return Err(self.invalid("zero.hpz_partition_size", "must be at least 1 (1 = off)"));
        }
        if z.hpz_partition_size != 1 && z.stage != ZeroStage::Weights {
            return Err(self.invalid(
                self.written("zero.hpz_partition_size", "zero.zero_hpz_partition_size"),
                format!(
                    "needs zero.stage: 3 (hpZ keeps secondary shards of stage 3's gathered weights; this job is stage {})",
                    z.stage
                ),
            ));
        }
        if z.quantized_gradients && z.stage != ZeroStage::Weights {
            return Err(self.invalid(
                self.written("zero.quantized_gradients", "zero.zero_quantized_gradients"),
                format!(
                    "needs zero.stage: 3 (qgZ quantizes stage 3's gradient reduce-scatters; this job is stage {})",
                    z.stage
                ),
            ));
        }
        if let Some(loco) = &z.loco {
            let key = self.written("zero.loco", "zero.zeropp_loco_param");
            if !z.quantized_gradients {
                return Err(self.invalid(
                    key,
                    "needs zero.quantized_gradients: true (LoCo keeps the errors of qgZ's quantized gradients)",
                ));
            }
            if !(0.0..1.0).contains(&loco.err_beta) {
                return Err(self.invalid(
                    &format!("{key}.err_beta"),
                    format!("{}: must be at least 0 and below 1", loco.err_beta),
                ));
            }
            if loco.reset_t == 0 {
                let t = match find_key(&self.text, &format!("{key}.reset_T")) {
                    Some(_) => "reset_T",
                    None => "reset_t",
                };
                return Err(self.invalid(&format!("{key}.{t}"), "must be at least 1"));
            }
        }
        self.validate_offload()?;
        self.validate_freeze()?;
        let c = &s.comm;
        if c.backend == Backend::Nccl {
            self.validate_nccl()?;
        }
        let t = &s.train;
        if ![Dtype::F32, t.dtype].contains(&t.grads_dtype()) {
            return Err(self.invalid(
                "train.grad_accum_dtype",
                format!(
                    "must be f32 or train.dtype ({}): gradients are held in the working type or in f32, got {}",
                    t.dtype,
                    t.grads_dtype()
                ),
            ));
        }
        self.validate_reduce_dtype()?;
        if s.train.allow_tf32 && s.device != Device::Cuda {
            return Err(self.invalid(
                "train.allow_tf32",
                "needs device: cuda (TF32 is the GPU tensor cores' format for f32 products; the CPU computes in f32)",
            ));
        }
        // Bounded, so that every deadline is a valid Duration; the heartbeat at
        // least 2 s, since zrun checks heartbeats once a second and workers send
        // one every quarter of the period (at most every 0.2 s).
        let (lo, hi) = TIMEOUT_RANGE_S;
        if !(c.timeout_s.is_finite() && (lo..=hi).contains(&c.timeout_s)) {
            return Err(self.invalid(
                "comm.timeout_s",
                format!("must be between {lo} and {hi} seconds, got {}", c.timeout_s),
            ));
        }
        let (lo, hi) = HEARTBEAT_RANGE_S;
        if !(c.heartbeat_s.is_finite() && (lo..=hi).contains(&c.heartbeat_s)) {
            return Err(self.invalid(
                "comm.heartbeat_s",
                format!(
                    "must be between {lo} and {hi} seconds, got {}",
                    c.heartbeat_s
                ),
            ));
        }
        if s.checkpoint.keep == 0 {
            return Err(self.invalid("checkpoint.keep", "must be at least 1"));
        }
        if s.checkpoint.every.is_set() && s.checkpoint.dir.is_none() {
            return Err(self.invalid("checkpoint.every", "needs checkpoint.dir"));
        }
        if let Some(e) = &s.train.early_stopping {
            let key = "train.early_stopping";
            if e.patience == 0 {
                return Err(self.invalid(&format!("{key}.patience"), "must be at least 1"));
            }
            if e.threshold < 0.0 {
                return Err(self.invalid(
                    &format!("{key}.threshold"),
                    format!("must be at least 0, got {}", e.threshold),
                ));
            }
            if !s.train.eval_every.is_set() {
                return Err(self.invalid(
                    key,
                    "needs validation: set train.eval_every (and data.val_path or data.val_fraction)",
                ));
            }
        }
        if s.checkpoint.keep_best {
            let (every, eval) = (s.checkpoint.every, s.train.eval_every);
            let why = match () {
                _ if s.checkpoint.dir.is_none() => Some("needs checkpoint.dir".to_string()),
                _ if !eval.is_set() => Some("needs validation: set train.eval_every (and data.val_path or data.val_fraction)".to_string()),
                _ if !on_validation_steps(every, eval) => Some(format!(
                    "checkpoints must fall on validation steps: checkpoint.every ({every}) must be a multiple of train.eval_every ({eval}), or both epoch"
                )),
                _ => None,
            };
            if let Some(why) = why {
                return Err(self.invalid("checkpoint.keep_best", why));
            }
        }
        if s.run_dir.trim().is_empty() {
            return Err(self.invalid("run_dir", "must not be empty"));
        }
        if let Some(p) = &s.flops_profiler {
            self.check_flops_profiler(p)?;
        }
        if let Some(c) = &s.comms_logger {
            self.check_comms_logger(c)?;
        }
        for (key, dir) in [
            ("tensorboard", &s.tensorboard),
            ("csv_monitor", &s.csv_monitor),
        ] {
            if dir.as_deref().is_some_and(|d| d.trim().is_empty()) {
                return Err(self.invalid(key, "must name a directory (or be null for none)"));
            }
        }
        for k in s.env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(
                    self.invalid("env", format!("`{k}` is not an environment variable name"))
                );
            }
            if RESERVED_ENV.contains(&k.as_str()) {
                return Err(self.invalid(
                    &format!("env.{k}"),
                    "is set by zrun for every worker (rank, topology, job token) and cannot be overridden",
                ));
            }
        }
        self.validate_data(world_size)
    }
}

/// The widest model dimension taken (vocabulary, width, heads, feed-forward,
/// sequence, context): 2²⁴, some 16.8 million, 1,365 times GPT-3's width and
/// 65 times the largest vocabularies.
pub const MAX_WIDTH: usize = 1 << 24;
/// The most blocks a model may have: 65,536, 500 times the deepest
/// published LLMs'.
pub const MAX_LAYERS: usize = 1 << 16;
/// The most parameters a model may have: 2⁴⁸, some 2.8·10¹⁴, hundreds of
/// times the largest dense models trained.
pub const MAX_PARAMS: u128 = 1 << 48;

/// `comm.timeout_s` bounds: a second to a week.
pub const TIMEOUT_RANGE_S: (f64, f64) = (1.0, 604_800.0);
/// `comm.heartbeat_s` bounds: two seconds to a day.
pub const HEARTBEAT_RANGE_S: (f64, f64) = (2.0, 86_400.0);

/// Environment variables zrun sets for every worker to place it in the job;
/// `env:` may not set them. (`RAYON_NUM_THREADS` and `OMP_NUM_THREADS` may be
/// set: zrun's are only defaults.)
pub const RESERVED_ENV: [&str; 14] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ZRUN_JOB_ID",
    "ZRUN_TOKEN",
    "ZRUN_NODE_ADDR",
    "ZRUN_PARENT_PID",
    "ZRUN_NODE_OF_RANK",
    "ZRUN_LAUNCHER",
    "ZRUN_BIND_CORES",
];

/// The dotted key of `root` (the text's untyped value) that `text` opens
/// last before `at` (1-based line and column): the key whose value holds a
/// located error.
fn key_before(text: &str, root: &Value, at: (usize, usize)) -> Option<String> {
    fn keys(v: &Value, prefix: &str, out: &mut Vec<String>) {
        if let Value::Object(map) = v {
            for (k, child) in map {
                let key = match prefix {
                    "" => k.clone(),
                    _ => format!("{prefix}.{k}"),
                };
                keys(child, &key, out);
                out.push(key);
            }
        }
    }
    let mut all = Vec::new();
    keys(root, "", &mut all);
    all.into_iter()
        .filter_map(|k| find_key(text, &k).map(|pos| (pos, k)))
        .filter(|(pos, _)| *pos <= at)
        .max()
        .map(|(_, k)| k)
}

/// Finds the 1-based (line, column) of a dotted key in YAML text, block or flow style.
fn find_key(text: &str, key: &str) -> Option<(usize, usize)> {
    let want: Vec<&str> = key.split('.').collect();
    let mut stack: Vec<(usize, String)> = Vec::new();
    for (ln, line) in text.lines().enumerate() {
        let content = line.split(" #").next().unwrap_or(line);
        let trimmed = content.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let indent = content.len() - trimmed.len();
        let Some((k, rest)) = trimmed.split_once(':') else {
            continue;
        };
        let k = k.trim().trim_matches('"');
        if k.is_empty()
            || !k
                .chars()
                .all(|c| c.is_alphanumeric() || c == '_' || c == '-')
        {
            continue;
        }
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        stack.push((indent, k.to_string()));
        let path: Vec<&str> = stack.iter().map(|(_, k)| k.as_str()).collect();
        if path == want {
            return Some((ln + 1, indent + 1));
        }
        // Flow style on this line: `model: {d_model: 256, n_heads: 4}`,
        // nested too: `train: {curriculum: {min_difficulty: 8}}`.
        if want.len() > path.len() && want[..path.len()] == path[..] && rest.contains('{') {
            if let Some(at) = find_in_flow(rest, &want[path.len()..]) {
                return Some((ln + 1, content.len() - rest.len() + at + 1));
            }
        }
    }
    None
}

/// The byte offset in `flow` (the text after a key's colon, a flow
/// mapping on one line) of the key at dotted path `want` inside it: keys
/// are names followed by a colon after `{`, `,` or a space, each `{`
/// after a key opens that key's mapping, and quoted text is skipped.
fn find_in_flow(flow: &str, want: &[&str]) -> Option<usize> {
    let mut inside: Vec<&str> = Vec::new();
    let (mut depth, mut pending, mut quote) = (0usize, None, None);
    let bytes = flow.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        match (quote, c) {
            (Some(q), _) if c == q => quote = None,
            (Some(_), _) => {}
            (None, b'"' | b'\'') => quote = Some(c),
            (None, b'{') => {
                depth += 1;
                // The outermost mapping is the line key's own.
                if depth > 1 {
                    inside.push(pending.unwrap_or(""));
                }
                pending = None;
            }
            (None, b'}') => {
                if depth > 1 {
                    inside.pop();
                }
                depth = depth.saturating_sub(1);
            }
            (None, _) if c.is_ascii_alphanumeric() || c == b'_' || c == b'-' => {
                let start = i;
                while i < bytes.len()
                    && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_' || bytes[i] == b'-')
                {
                    i += 1;
                }
                let before = flow[..start].trim_end().bytes().last();
                let is_key = bytes.get(i) == Some(&b':') && matches!(before, Some(b'{' | b','));
                if is_key && depth > 0 {
                    let key = &flow[start..i];
                    if inside.len() + 1 == want.len()
                        && inside.iter().zip(want).all(|(a, b)| a == b)
                        && key == want[want.len() - 1]
                    {
                        return Some(start);
                    }
                    pending = Some(key);
                }
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// What is wrong with a rotary scaling of heads `hd` wide, if anything:
/// the bounds `transformers` holds its `rope_scaling` to (a factor of at
/// least 1; Llama 3's low-frequency factor positive and below the high
/// one, an original context of at least one token; YaRN's betas and
/// attention factor positive; LongRoPE's a positive factor for each of a
/// head's `hd / 2` frequencies, in each list).
pub fn rope_scaling_problem(s: &crate::spec::RopeScaling, hd: usize) -> Option<String> {
    use crate::spec::RopeScaling;
    let factor = match *s {
        RopeScaling::Linear { factor }
        | RopeScaling::Dynamic { factor }
        | RopeScaling::Llama3 { factor, .. }
        | RopeScaling::Yarn { factor, .. }
        | RopeScaling::Longrope { factor, .. } => factor,
    };
    if factor < 1.0 {
        return Some(format!("factor must be at least 1, got {factor}"));
    }
    if let RopeScaling::Longrope {
        original_max_position_embeddings: old,
        short_factor,
        long_factor,
        attention_factor,
        ..
    } = s
    {
        // ln(1) is 0: transformers' attention factor would divide by it.
        if *old < 2 {
            return Some("original_max_position_embeddings must be at least 2".into());
        }
        for (key, factors) in [("short_factor", short_factor), ("long_factor", long_factor)] {
            if factors.len() != hd / 2 {
                return Some(format!(
                    "{key} has {} factors: a head {hd} wide turns {} pairs, one factor each",
                    factors.len(),
                    hd / 2
                ));
            }
            if let Some((i, f)) = factors
                .iter()
                .enumerate()
                .find(|(_, f)| !(f.is_finite() && **f > 0.0))
            {
                return Some(format!("{key}[{i}] is {f}: each must be a positive number"));
            }
        }
        if attention_factor.is_some_and(|a| a <= 0.0) {
            return Some(format!(
                "attention_factor must be positive, got {}",
                attention_factor.unwrap_or(0.0)
            ));
        }
    }
    if let RopeScaling::Yarn {
        original_max_position_embeddings: old,
        beta_fast,
        beta_slow,
        attention_factor,
        ..
    } = *s
    {
        if old == 0 {
            return Some("original_max_position_embeddings must be at least 1".into());
        }
        for (key, v) in [
            ("beta_fast", beta_fast),
            ("beta_slow", beta_slow),
            ("attention_factor", attention_factor),
        ] {
            if v.is_some_and(|v| v <= 0.0) {
                return Some(format!("{key} must be positive, got {}", v.unwrap_or(0.0)));
            }
        }
    }
    if let RopeScaling::Llama3 {
        low_freq_factor: low,
        high_freq_factor: high,
        original_max_position_embeddings: old,
        ..
    } = *s
    {
        if !(low > 0.0 && high > low) {
            return Some(format!(
                "low_freq_factor ({low}) must be positive and below high_freq_factor ({high})"
            ));
        }
        if old == 0 {
            return Some("original_max_position_embeddings must be at least 1".into());
        }
    }
    None
}

/// Whether every checkpoint step (`every`) is a validation step (`eval`):
/// a multiple of it, both each epoch's end, or epochs validated every step.
fn on_validation_steps(every: Every, eval: Every) -> bool {
    match (every, eval) {
        (Every::Steps(c), Every::Steps(v)) => c > 0 && v > 0 && c.is_multiple_of(v),
        (Every::Epoch, Every::Epoch) | (Every::Epoch, Every::Steps(1)) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::File::create(&p)
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        p
    }

    /// Every key of `model:` is an architecture key but the job's own three:
    /// a key added to the model without a place here would keep zrun's
    /// default where the directory says otherwise.
    #[test]
    fn the_architecture_keys_are_every_model_key_but_the_jobs_own() {
        let e = serde_json::from_value::<crate::spec::ModelSpec>(serde_json::json!({"none": 1}))
            .unwrap_err()
            .to_string();
        let listed = e.split("expected one of").nth(1).expect(&e);
        let mut every: Vec<&str> = listed
            .split(['`', ',', ' '])
            .filter(|k| !k.is_empty())
            .collect();
        every.retain(|k| {
            ![
                "seq_len",
                "max_position_embeddings",
                "init_from",
                "tile_size",
                "hidden_dropout",
                "attention_dropout",
            ]
            .contains(k)
        });
        assert_eq!(every, ARCHITECTURE_KEYS, "{e}");
    }

    /// A directory's `config.json` gives the model keys the job leaves out
    /// (the default `seq_len` capped at its context), before the ds_config's
    /// `"auto"` bucket sizes read the width; keys the job file or `--set`
    /// write stay, and each key is located where it came from.
    #[test]
    fn init_from_a_directory_gives_the_model_keys_the_job_leaves_out() {
        let d = tempfile::tempdir().unwrap();
        let hf = d.path().join("hf");
        std::fs::create_dir(&hf).unwrap();
        write(
            &hf,
            "config.json",
            r#"{"model_type": "qwen2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 96, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                "tie_word_embeddings": true, "hidden_act": "silu"}"#,
        );
        let job = write(
            d.path(),
            "job.yaml",
            &format!(
                "model:\n  init_from: {}\n  n_layers: 3\ndata: {{path: x.bin}}\n",
                hf.display()
            ),
        );
        let ds = write(
            d.path(),
            "ds.json",
            r#"{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}"#,
        );
        let l = load_job_with(&job, &["model.norm_eps=1e-5".into()], Some(&ds)).unwrap();
        let m = &l.spec.model;
        assert_eq!(
            (
                m.kind,
                m.vocab_size,
                m.d_model,
                m.n_heads,
                m.kv_heads(),
                m.ffn()
            ),
            (ModelKind::Llama, 300, 64, 4, 2, 96)
        );
        assert_eq!(
            (m.tied(), m.qkv_biased(), m.rope_theta()),
            (true, true, 1e6)
        );
        assert_eq!((m.n_layers, m.norm_eps, m.seq_len), (3, Some(1e-5), 96));
        assert_eq!(l.spec.zero.reduce_bucket_size.0, 64 * 64);
        let config = hf.join("config.json").display().to_string();
        assert_eq!(l.locate("model.d_model"), config);
        assert_eq!(l.locate("model.seq_len"), config);
        assert_eq!(l.locate("model.n_layers"), format!("{}:3:3", job.display()));
        assert_eq!(l.locate("model.norm_eps"), "--set model.norm_eps");
        assert_eq!(m.max_position_embeddings, None);
        // A seq_len written is the job's; the directory's context stays the
        // model's where they differ (and a context shorter is refused).
        let l = load_job(&job, &["model.seq_len=32".into()]).unwrap();
        let m = &l.spec.model;
        assert_eq!((m.seq_len, m.max_position_embeddings), (32, Some(96)));
        assert_eq!(l.locate("model.max_position_embeddings"), config);
        let mut l = load_job(&job, &["model.seq_len=200".into()]).unwrap();
        assert_eq!(l.spec.model.seq_len, 200);
        let e = l.validate(1).unwrap_err().to_string();
        assert!(
            e.contains("model.max_position_embeddings: 96 is shorter than model.seq_len 200"),
            "{e}"
        );
        // What the directory cannot be is said at `model.init_from`.
        write(&hf, "config.json", r#"{"model_type": "bert"}"#);
        let e = load_job(&job, &[]).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "{}:2:3: model.init_from: {config}: model_type is \"bert\"",
                job.display()
            )),
            "{e}"
        );
        // A directory without one, or a file, leaves the job as it is.
        std::fs::remove_file(hf.join("config.json")).unwrap();
        assert_eq!(load_job(&job, &[]).unwrap().spec.model.d_model, 256);
        assert!(load_job(&job, &[]).unwrap().model_from().is_none());
    }

    const GOOD: &str = "name: t\nmodel: {d_model: 64, n_heads: 4, n_layers: 2, seq_len: 16}\ndata:\n  format: synthetic\ntrain:\n  steps: 5\n  lr: 1.0e-3\n";

    /// `train.reduce_dtype`: bf16 beside any working type, f16 only beside
    /// f16 (loss-scaled), neither beside qgZ nor NCCL; each refusal at the
    /// line that writes the key, saying why.
    #[test]
    fn reduce_dtype_is_refused_where_its_reductions_cannot_run() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("job.yaml");
        let job = |train: &str, rest: &str| {
            std::fs::write(&path, format!("{GOOD}{train}{rest}")).unwrap();
            load_job(&path, &[]).and_then(|mut j| j.validate(2).map(|()| j))
        };
        for (train, want) in [
            ("  reduce_dtype: bf16\n", Some(Dtype::Bf16)),
            ("  dtype: bf16\n  reduce_dtype: bf16\n", Some(Dtype::Bf16)),
            ("  dtype: f16\n  reduce_dtype: f16\n", Some(Dtype::F16)),
            ("  dtype: bf16\n  reduce_dtype: f32\n", Some(Dtype::F32)),
            ("", None),
        ] {
            let j = job(train, "").unwrap_or_else(|e| panic!("{train}: {e}"));
            assert_eq!(j.spec.train.reduce_dtype, want, "{train}");
        }
        let p = path.display();
        for (train, rest, want) in [
            (
                "  dtype: bf16\n  reduce_dtype: f16\n",
                "",
                format!("{p}:9:3: train.reduce_dtype: f16 needs train.dtype: f16"),
            ),
            (
                "  reduce_dtype: f16\n",
                "",
                format!("{p}:8:3: train.reduce_dtype: f16 needs train.dtype: f16"),
            ),
            (
                "  reduce_dtype: bf16\n",
                "zero: {stage: 3, zero_quantized_gradients: true}\n",
                format!(
                    "{p}:8:3: train.reduce_dtype: ZeRO++ qgZ (zero.quantized_gradients) already"
                ),
            ),
            (
                "  reduce_dtype: bf16\n",
                "device: cuda\ncomm: {backend: nccl}\n",
                format!(
                    "{p}:10:8: comm.backend: nccl reduces the gradients in f32; train.reduce_dtype"
                ),
            ),
        ] {
            let e = job(train, rest).unwrap_err().to_string();
            assert!(e.starts_with(&want), "{train}{rest}: {e}");
        }
    }

    /// `zero.loco` (also `zero.zeropp_loco_param`, with DeepSpeed's
    /// `reset_T`) takes DeepSpeed's defaults, and is refused without qgZ
    /// or with a beta outside [0, 1) or no reductions between resets, at
    /// the key that says so.
    #[test]
    fn loco_needs_qgz_and_sane_settings() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("job.yaml");
        let job = |zero: &str| {
            std::fs::write(&path, format!("{GOOD}zero: {zero}\n")).unwrap();
            load_job(&path, &[]).and_then(|mut j| j.validate(2).map(|()| j))
        };
        let qgz = "{stage: 3, quantized_gradients: true, ";
        let j = job(&format!("{qgz}loco: {{}}}}")).unwrap();
        assert_eq!(j.spec.zero.loco, Some(crate::spec::LocoSpec::default()));
        let j = job(&format!(
            "{qgz}zeropp_loco_param: {{err_beta: 0.5, reset_T: 9}}}}"
        ))
        .unwrap();
        let loco = j.spec.zero.loco.unwrap();
        assert_eq!((loco.err_beta, loco.reset_t), (0.5, 9));
        let p = path.display();
        for (zero, want) in [
            (
                "{stage: 3, loco: {}}".to_string(),
                format!("{p}:8:18: zero.loco: needs zero.quantized_gradients: true"),
            ),
            (
                format!("{qgz}loco: {{err_beta: 1.0}}}}"),
                format!("{p}:8:52: zero.loco.err_beta: 1: must be at least 0 and below 1"),
            ),
            (
                format!("{qgz}zeropp_loco_param: {{reset_T: 0}}}}"),
                format!("{p}:8:65: zero.zeropp_loco_param.reset_T: must be at least 1"),
            ),
        ] {
            let e = job(&zero).unwrap_err().to_string();
            assert!(e.starts_with(&want), "{zero}: {e}");
        }
    }

    /// `train.grad_accum_dtype` is f32 or the working type (the job's
    /// default), refused at the line that writes it otherwise; estimates
    /// count f32 gradients at 4 bytes.
    #[test]
    fn grad_accum_dtype_is_f32_or_the_working_type() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("job.yaml");
        let job = |extra: &str| {
            std::fs::write(&path, format!("{GOOD}  dtype: bf16\n{extra}")).unwrap();
            load_job(&path, &[]).and_then(|mut j| j.validate(1).map(|()| j))
        };
        let j = job("").unwrap();
        assert_eq!(j.spec.train.grads_dtype(), Dtype::Bf16);
        assert_eq!(crate::estimate::StateBytes::for_job(&j.spec).grad, 2.0);
        let j = job("  grad_accum_dtype: f32\n").unwrap();
        assert_eq!(j.spec.train.grads_dtype(), Dtype::F32);
        assert_eq!(crate::estimate::StateBytes::for_job(&j.spec).grad, 4.0);
        assert_eq!(
            job("  grad_accum_dtype: bf16\n")
                .unwrap()
                .spec
                .train
                .grads_dtype(),
            Dtype::Bf16
        );
        let e = job("  grad_accum_dtype: f16\n").unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "{}:9:3: train.grad_accum_dtype: must be f32 or train.dtype (bf16)",
                path.display()
            )),
            "{e}"
        );
    }

    /// `train.warmup_ratio` becomes `ceil(ratio × steps)` warmup steps, as
    /// transformers' `get_warmup_steps` rounds it (`--set` of the steps
    /// counts); it is refused outside [0, 1] and beside `warmup_steps`
    /// written in the file or by `--set`.
    #[test]
    fn warmup_ratio_is_a_share_of_the_steps_rounded_up() {
        let d = tempfile::tempdir().unwrap();
        let job = |train: &str| GOOD.replace("  steps: 5\n", train);
        for (train, sets, want) in [
            ("  steps: 1000\n  warmup_ratio: 0.03\n", vec![], Ok(30)),
            ("  steps: 100\n  warmup_ratio: 0.03\n", vec![], Ok(3)),
            ("  steps: 10\n  warmup_ratio: 0.25\n", vec![], Ok(3)),
            ("  steps: 10\n  warmup_ratio: 0\n", vec![], Ok(0)),
            (
                "  steps: 10\n  warmup_ratio: 0.25\n",
                vec!["train.steps=41"],
                Ok(11),
            ),
            (
                "  steps: 10\n  warmup_ratio: 1.5\n",
                vec![],
                Err("must be between 0 and 1, got 1.5"),
            ),
            (
                "  steps: 10\n  warmup_ratio: 0.1\n  warmup_steps: 2\n",
                vec![],
                Err("goes without train.warmup_steps"),
            ),
            (
                "  steps: 10\n  warmup_ratio: 0.1\n",
                vec!["train.warmup_steps=2"],
                Err("goes without train.warmup_steps"),
            ),
        ] {
            let p = write(d.path(), "j.yaml", &job(train));
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            let got = load_job(&p, &sets).and_then(|mut j| j.validate(2).map(|_| j));
            match want {
                Ok(steps) => assert_eq!(got.unwrap().spec.train.warmup_steps, steps, "{train}"),
                Err(says) => {
                    let Err(e) = got else {
                        panic!("{train}: accepted")
                    };
                    let e = e.to_string();
                    assert!(
                        e.contains("train.warmup_ratio") && e.contains(says),
                        "{says}: {e}"
                    );
                }
            }
        }
    }

    /// `train.epochs` becomes `ceil(epochs × sequences / global batch)`
    /// steps (at least one), a resumed run's the steps that finish the
    /// epochs from what it consumed, and `warmup_ratio` is of those steps;
    /// the count is asked only where epochs are set, and its error, beside
    /// `train.steps` and at 0 or below are refused at the key.
    #[test]
    fn epochs_become_steps_of_the_counted_sequences() {
        let d = tempfile::tempdir().unwrap();
        // GOOD's micro-batch is 8: 16 sequences a step on 2 workers.
        let job = |train: &str| GOOD.replace("  steps: 5\n", train);
        let settle = |train: &str, from, sequences: Result<u64, &str>| {
            let p = write(d.path(), "j.yaml", &job(train));
            let mut j = load_job(&p, &[])?;
            j.validate(2)?;
            let counted = j.settle_epochs(2, from, |_| sequences)?;
            Ok::<_, ConfigError>((j.spec.train.steps, j.spec.train.warmup_steps, counted))
        };
        let ok = |train, from, n| settle(train, from, Ok(n)).unwrap();
        assert_eq!(ok("  epochs: 3\n", None, 100), (19, 20, Some(100)));
        assert_eq!(ok("  epochs: 3\n", None, 96), (18, 20, Some(96)));
        assert_eq!(ok("  epochs: 0.001\n", None, 100), (1, 20, Some(100)));
        assert_eq!(
            ok("  epochs: 2\n  warmup_ratio: 0.1\n", None, 800),
            (100, 10, Some(800))
        );
        // Resumed at step 10 having consumed 80 sequences (one worker's
        // batches): 3 × 100 − 80 = 220 left, 14 steps of 16.
        assert_eq!(
            ok("  epochs: 3\n", Some((10, 80)), 100),
            (24, 20, Some(100))
        );
        // Past the epochs already: no step left.
        assert_eq!(
            ok("  epochs: 1\n", Some((10, 160)), 100),
            (10, 20, Some(100))
        );
        // Without epochs the count is not asked for.
        let p = write(d.path(), "j.yaml", GOOD);
        let mut j = load_job(&p, &[]).unwrap();
        j.validate(2).unwrap();
        let asked = j
            .settle_epochs(2, None, |_| -> Result<u64, String> { panic!("counted") })
            .unwrap();
        assert_eq!((asked, j.spec.train.steps), (None, 5));
        for (train, sequences, says) in [
            (
                "  epochs: 1\n",
                Err("no such file"),
                "train.epochs: counting the sequences of an epoch: no such file",
            ),
            (
                "  epochs: 0\n",
                Ok(10),
                "train.epochs: must be above 0, got 0",
            ),
            ("  epochs: -2\n", Ok(10), "must be above 0, got -2"),
            (
                "  epochs: 1\n  steps: 4\n",
                Ok(10),
                "train.epochs: goes without train.steps",
            ),
        ] {
            let e = settle(train, None, sequences).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("j.yaml:"), "{train}: {e}");
        }
    }

    /// Qwen2's q, k and v biases are a LLaMA's option; GPT-2 has a bias on
    /// every linear already.
    #[test]
    fn qkv_bias_is_for_llama() {
        let d = tempfile::tempdir().unwrap();
        for (model, refused) in [
            ("model: {kind: llama, qkv_bias: true, ", false),
            ("model: {kind: llama, qkv_bias: false, ", false),
            ("model: {qkv_bias: true, ", true),
        ] {
            let p = write(d.path(), "j.yaml", &GOOD.replace("model: {", model));
            let got = load_job(&p, &[]).and_then(|mut j| j.validate(2));
            match refused {
                false => got.unwrap(),
                true => {
                    let e = got.unwrap_err().to_string();
                    assert!(
                        e.contains("model.qkv_bias") && e.contains("is for `kind: llama`"),
                        "{e}"
                    );
                }
            }
        }
    }

    /// Qwen3's wider heads and q, k norms are a LLaMA's options: with
    /// `head_dim` the heads need not divide d_model, but the width must be
    /// even (the rotary embedding's pairs) and at least 1.
    #[test]
    fn head_dim_and_qk_norm_are_for_llama() {
        let d = tempfile::tempdir().unwrap();
        let llama = "model: {kind: llama, d_model: 66, head_dim: 32, qk_norm: true, ";
        for (model, refused) in [
            (llama, None),
            (
                "model: {head_dim: 16, ",
                Some(("model.head_dim", "is for `kind: llama`")),
            ),
            (
                "model: {qk_norm: true, ",
                Some(("model.qk_norm", "is for `kind: llama`")),
            ),
            (
                "model: {kind: llama, d_model: 66, ",
                Some(("model.n_heads", "(a LLaMA may set model.head_dim)")),
            ),
            (
                "model: {kind: llama, qk_norm: true, qkv_bias: true, ",
                Some(("model.qk_norm", "goes without model.qkv_bias")),
            ),
            (
                "model: {kind: llama, head_dim: 0, ",
                Some(("model.head_dim", "must be at least 1")),
            ),
            (
                "model: {kind: llama, head_dim: 15, ",
                Some(("model.head_dim", "even head width, got 15")),
            ),
        ] {
            let text = GOOD.replace("model: {d_model: 64, ", model);
            let p = write(d.path(), "j.yaml", &text);
            let got = load_job(&p, &[]).and_then(|mut j| j.validate(2));
            match refused {
                None => {
                    let j = got.map(|_| load_job(&p, &[]).unwrap()).unwrap();
                    let m = &j.spec.model;
                    assert_eq!(
                        (m.head_dim(), m.attn_width(), m.qk_normed()),
                        (32, 128, true)
                    );
                }
                Some((key, why)) => {
                    let e = got.unwrap_err().to_string();
                    assert!(e.contains(key) && e.contains(why), "{model}: {e}");
                }
            }
        }
    }

    /// A model beyond any machine is refused at the key that makes it so,
    /// with its line: a width past 2²⁴, more than 65,536 blocks, attention
    /// wider than 2²⁴, more than 2⁴⁸ parameters; the bounds themselves are
    /// taken, and the estimate of the deepest model allowed is computed.
    #[test]
    fn a_model_beyond_any_machine_is_refused_at_its_key() {
        let d = tempfile::tempdir().unwrap();
        for (model, refused) in [
            ("n_layers: 65536, seq_len: 16", None),
            ("n_layers: 2, seq_len: 16777216", None),
            (
                "n_layers: 65537, seq_len: 16",
                Some(("model.n_layers", "must be at most 65536, got 65537")),
            ),
            (
                "n_layers: 18446744073709551615, seq_len: 16",
                Some(("model.n_layers", "must be at most 65536")),
            ),
            (
                "n_layers: 2, seq_len: 16777217",
                Some(("model.seq_len", "must be at most 16777216, got 16777217")),
            ),
            (
                "n_layers: 2, seq_len: 16, vocab_size: 4294967296",
                Some(("model.vocab_size", "must be at most 16777216")),
            ),
            (
                "n_layers: 2, seq_len: 16, kind: llama, ffn_hidden: 16777217",
                Some(("model.ffn_hidden", "must be at most")),
            ),
            (
                "n_layers: 2, seq_len: 16, kind: llama, head_dim: 16777216",
                Some((
                    "model.head_dim",
                    "4 heads of 16777216 make attention 67108864 wide",
                )),
            ),
            (
                "n_layers: 2048, seq_len: 16, d_model: 4194304",
                Some((
                    "model",
                    "parameters (4.3e17), more than the 281474976710656",
                )),
            ),
        ] {
            let text = GOOD.replace(
                "model: {d_model: 64, n_heads: 4, n_layers: 2, seq_len: 16}",
                &format!("model: {{n_heads: 4, {model}}}"),
            );
            let text = match model.contains("d_model") {
                true => text,
                false => text.replace("model: {", "model: {d_model: 64, "),
            };
            let p = write(d.path(), "j.yaml", &text);
            let got = load_job(&p, &[]).and_then(|mut j| j.validate(2).map(|()| j));
            match refused {
                None => {
                    let j = got.unwrap_or_else(|e| panic!("{model}: {e}"));
                    let e = crate::estimate::trained_elements(&j.spec.model, &[]);
                    assert_eq!(e.trained, j.spec.model.param_count() as f64, "{model}");
                }
                Some((key, why)) => {
                    let e = got.err().unwrap_or_else(|| panic!("{model}: taken"));
                    let e = e.to_string();
                    assert!(
                        e.contains("j.yaml:2:")
                            && e.contains(&format!("{key}: "))
                            && e.contains(why),
                        "{model}: {e}"
                    );
                }
            }
        }
    }

    /// `train.freeze`: each pattern well formed and matching a parameter
    /// of this model (the error lists the names), something left to train,
    /// and not on the GPU path.
    #[test]
    fn freeze_patterns_must_match_the_models_parameters() {
        let d = tempfile::tempdir().unwrap();
        let job = |freeze: &str| {
            GOOD.replace("  steps: 5\n", &format!("  steps: 5\n  freeze: {freeze}\n"))
        };
        for (freeze, refused) in [
            ("[wte.weight, \"h.{0-0}.*\"]", None),
            ("[\"*ln_*\"]", None),
            (
                "[layers.0.*]",
                Some("`layers.0.*` matches none of the model's parameters: wte.weight, wpe.weight, h.0.ln_1.weight"),
            ),
            ("[\"h.{1-0}.*\"]", Some("is not a range of whole numbers")),
            ("[\"\"]", Some("an empty pattern")),
            ("[\"*\"]", Some("freezes every parameter")),
            ("[wte.weight, wpe.weight, \"h.*\", \"ln_f.*\"]", Some("freezes every parameter")),
        ] {
            let p = write(d.path(), "j.yaml", &job(freeze));
            let got = load_job(&p, &[]).and_then(|mut j| j.validate(2));
            match refused {
                None => assert!(got.is_ok(), "{freeze}: {got:?}"),
                Some(why) => {
                    let e = got.unwrap_err().to_string();
                    assert!(e.contains("j.yaml:7:") && e.contains("train.freeze") && e.contains(why), "{freeze}: {e}");
                }
            }
        }
        let mut j = load_job(&write(d.path(), "j.yaml", &job("[wte.weight]")), &[]).unwrap();
        j.validate(2).unwrap();
        // The GPU path freezes too (tests/gpu.rs).
        j.spec.device = crate::spec::Device::Cuda;
        assert_eq!(j.spec.gpu_unsupported(), None);
    }

    /// `model.sliding_window`: a LLaMA's, at least 1; bounding attention
    /// only where it is shorter than the sequences (`window()`).
    #[test]
    fn a_sliding_window_is_a_llamas_and_bounds_only_shorter_sequences() {
        let d = tempfile::tempdir().unwrap();
        for (model, refused) in [
            ("model: {kind: llama, sliding_window: 4, ", None),
            (
                "model: {sliding_window: 4, ",
                Some(("j.yaml:2:9: model.sliding_window", "is for `kind: llama`")),
            ),
            (
                "model: {kind: llama, sliding_window: 0, ",
                Some(("j.yaml:2:22: model.sliding_window", "must be at least 1")),
            ),
        ] {
            let text = GOOD.replace("model: {d_model: 64, ", model);
            let p = write(d.path(), "j.yaml", &text);
            let got = load_job(&p, &[]).and_then(|mut j| j.validate(2).map(|()| j));
            match refused {
                None => assert_eq!(got.unwrap().spec.model.window(), Some(4)),
                Some((at, why)) => {
                    let e = got.unwrap_err().to_string();
                    assert!(e.contains(at) && e.contains(why), "{model}: {e}");
                }
            }
        }
        let text = GOOD.replace(
            "model: {d_model: 64, ",
            "model: {kind: llama, d_model: 64, ",
        );
        let p = write(d.path(), "j.yaml", &text);
        for (window, reaches) in [(15, true), (16, false), (1000, false)] {
            let spec = load_job(&p, &[format!("model.sliding_window={window}")])
                .unwrap()
                .spec;
            assert_eq!(spec.model.window().is_some(), reaches, "{window}");
        }
    }

    /// `flops_profiler`: DeepSpeed's defaults, a step within the run, a
    /// depth from -1, a CPU job; a DeepSpeed config's enabled section sets
    /// it (its `recompute_fwd_factor` ignored), a disabled one does not.
    #[test]
    fn flops_profiler_is_checked_and_comes_from_a_ds_config() {
        let d = tempfile::tempdir().unwrap();
        let job = write(d.path(), "j.yaml", &format!("{GOOD}flops_profiler: {{}}\n"));
        let mut j = load_job(&job, &[]).unwrap();
        j.validate(1).unwrap();
        let p = j.spec.flops_profiler.clone().unwrap();
        assert_eq!((p.profile_step, p.module_depth, p.detailed), (1, -1, true));
        assert_eq!(p.output_file, None);
        for (set, key, says) in [
            (
                "flops_profiler.profile_step=0",
                "profile_step",
                "at least 1",
            ),
            (
                "flops_profiler.profile_step=6",
                "profile_step",
                "after the run's last step (5)",
            ),
            (
                "flops_profiler.module_depth=-2",
                "module_depth",
                "-1 (every depth)",
            ),
            (
                "flops_profiler.output_file=' '",
                "output_file",
                "must name a file",
            ),
            ("device=cuda", "flops_profiler", "ZRUN_GPU_PROFILE"),
        ] {
            let mut j = load_job(&job, &[set.to_string()]).unwrap();
            let e = j.validate(1).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(says), "{set}: {e}");
        }
        let late = write(
            d.path(),
            "late.yaml",
            &format!("{GOOD}flops_profiler: {{profile_step: 9}}\n"),
        );
        let e = load_job(&late, &[])
            .unwrap()
            .validate(1)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!("{}:8:", late.display())),
            "where: {e}"
        );
        let plain = write(d.path(), "plain.yaml", GOOD);
        let ds = write(
            d.path(),
            "ds.json",
            r#"{"flops_profiler": {"enabled": true, "profile_step": 3, "module_depth": 2, "top_modules": 4, "detailed": false, "output_file": "p.txt", "recompute_fwd_factor": 1.0}}"#,
        );
        let mut j = load_job_with(&plain, &[], Some(&ds)).unwrap();
        j.validate(1).unwrap();
        let p = j.spec.flops_profiler.clone().unwrap();
        assert_eq!(
            (p.profile_step, p.module_depth, p.top_modules, p.detailed),
            (3, 2, 4, false)
        );
        assert_eq!(p.output_file.as_deref(), Some("p.txt"));
        let ds = write(
            d.path(),
            "ds.json",
            r#"{"flops_profiler": {"enabled": false, "profile_step": 3}}"#,
        );
        let j = load_job_with(&plain, &[], Some(&ds)).unwrap();
        assert_eq!(j.spec.flops_profiler, None);
        let ds = write(
            d.path(),
            "ds.json",
            r#"{"flops_profiler": {"enabled": true, "module_depth": -3}}"#,
        );
        let e = load_job_with(&plain, &[], Some(&ds))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("flops_profiler.module_depth") && e.contains("ds.json:1:"),
            "{e}"
        );
    }

    /// `comms_logger`: every collective by default; `prof_ops` by
    /// torch.distributed's names, not empty when `prof_all` is off; a CPU
    /// job; a DeepSpeed config's enabled section sets it with DeepSpeed's
    /// names turned into zrun's, `verbose` and `debug` listed as ignored,
    /// a disabled one not at all.
    #[test]
    fn comms_logger_is_checked_and_comes_from_a_ds_config() {
        let d = tempfile::tempdir().unwrap();
        let job = write(d.path(), "j.yaml", &format!("{GOOD}comms_logger: {{}}\n"));
        let mut j = load_job(&job, &[]).unwrap();
        j.validate(1).unwrap();
        let c = j.spec.comms_logger.clone().unwrap();
        assert!(c.prof_all && c.prof_ops.is_empty() && c.output_file.is_none());
        assert!(c.logs("barrier"));
        for (set, key, says) in [
            (
                "comms_logger.prof_ops=[all_reduce, allreduce]",
                "prof_ops",
                "`allreduce` is not a collective",
            ),
            (
                "comms_logger.prof_all=false",
                "prof_ops",
                "nothing would be logged",
            ),
            (
                "comms_logger.output_file=' '",
                "output_file",
                "must name a file",
            ),
            ("device=cuda", "comms_logger", "NCCL"),
        ] {
            let mut j = load_job(&job, &[set.to_string()]).unwrap();
            let e = j.validate(1).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(says), "{set}: {e}");
        }
        let some = [
            "comms_logger.prof_all=false",
            "comms_logger.prof_ops=[all_gather]",
        ];
        let mut j = load_job(&job, &some.map(String::from)).unwrap();
        j.validate(1).unwrap();
        let c = j.spec.comms_logger.clone().unwrap();
        assert!(c.logs("all_gather") && !c.logs("all_reduce"));
        let plain = write(d.path(), "plain.yaml", GOOD);
        let ds = write(
            d.path(),
            "ds.json",
            r#"{"comms_logger": {"enabled": true, "verbose": true, "debug": false, "prof_all": false,
                "prof_ops": ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]}}"#,
        );
        let mut j = load_job_with(&plain, &[], Some(&ds)).unwrap();
        j.validate(1).unwrap();
        let c = j.spec.comms_logger.clone().unwrap();
        assert!(!c.prof_all);
        assert_eq!(c.prof_ops, ["all_reduce", "all_gather", "reduce_scatter"]);
        let warning = j.deepspeed().unwrap().ignored_warning().unwrap();
        assert!(
            warning.contains("comms_logger.verbose") && warning.contains("comms_logger.debug"),
            "{warning}"
        );
        let ds = write(
            d.path(),
            "ds.json",
            r#"{"comms_logger": {"enabled": false, "prof_all": false}}"#,
        );
        let j = load_job_with(&plain, &[], Some(&ds)).unwrap();
        assert_eq!(j.spec.comms_logger, None);
        let ds = write(
            d.path(),
            "ds.json",
            r#"{"comms_logger": {"enabled": true, "prof_ops": ["send"]}}"#,
        );
        let e = load_job_with(&plain, &[], Some(&ds))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("comms_logger.prof_ops")
                && e.contains("ds.json:1:")
                && e.contains("\"send\""),
            "{e}"
        );
    }

    /// `tensorboard` and `csv_monitor`: `${name}` expands; a DeepSpeed
    /// config's enabled section sets it to `output_path/job_name`
    /// (DeepSpeed's defaults for either missing), a disabled one not at
    /// all; an empty one is refused.
    #[test]
    fn monitors_come_from_the_job_or_the_ds_config() {
        let d = tempfile::tempdir().unwrap();
        let dir_of = |j: &LoadedJob, key: &str| match key {
            "tensorboard" => j.spec.tensorboard.clone(),
            _ => j.spec.csv_monitor.clone(),
        };
        for key in ["tensorboard", "csv_monitor"] {
            let job = write(d.path(), "j.yaml", &format!("{GOOD}{key}: out/${{name}}\n"));
            let mut j = load_job(&job, &[]).unwrap();
            assert_eq!(dir_of(&j, key).as_deref(), Some("out/t"));
            j.validate(1).unwrap();
            let plain = write(d.path(), "plain.yaml", GOOD);
            for (section, want) in [
                (
                    r#"{"enabled": true, "output_path": "logs", "job_name": "gpt"}"#,
                    Some("logs/gpt"),
                ),
                (r#"{"enabled": true}"#, Some("DeepSpeedJobName")),
                (r#"{"enabled": false, "output_path": "logs"}"#, None),
            ] {
                let ds = write(d.path(), "ds.json", &format!(r#"{{"{key}": {section}}}"#));
                let j = load_job_with(&plain, &[], Some(&ds)).unwrap();
                assert_eq!(dir_of(&j, key).as_deref(), want, "{key}: {section}");
            }
            let ds = write(
                d.path(),
                "ds.json",
                &format!(r#"{{"{key}": {{"enabled": true, "path": "x"}}}}"#),
            );
            let e = load_job_with(&plain, &[], Some(&ds))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("{key}.path")) && e.contains("unknown DeepSpeed key"),
                "{e}"
            );
            let mut j = load_job(&plain, &[format!("{key}= ")]).unwrap();
            assert_eq!(dir_of(&j, key), None, "an empty value is null");
            j.validate(1).unwrap();
            let mut j = load_job(&plain, &[format!("{key}='  '")]).unwrap();
            let e = j.validate(1).unwrap_err().to_string();
            assert!(
                e.contains(key) && e.contains("must name a directory"),
                "{e}"
            );
        }
    }

    #[test]
    fn loads_defaults_and_expands_name() {
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), "j.yaml", GOOD);
        let mut job = load_job(&p, &[]).unwrap();
        assert_eq!(job.spec.run_dir, "runs/t");
        assert_eq!(job.spec.train.micro_batch_size, 8);
        assert_eq!(job.spec.zero.reduce_bucket_size.0, 50_000_000);
        job.validate(2).unwrap();
    }

    /// `model.rope_scaling` within the bounds transformers holds it to, on
    /// LLaMA only; each refusal at the key.
    #[test]
    fn rope_scaling_is_held_to_its_bounds() {
        let d = tempfile::tempdir().unwrap();
        let llama3 = |fields: &str| {
            GOOD.replace(
                "model: {",
                &format!("model: {{kind: llama, rope_scaling: {{rope_type: llama3, {fields}}}, "),
            )
        };
        let good = "factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8";
        // Heads of 64 / 4 = 16: 8 pairs, a factor each.
        let longrope = |fields: &str| {
            GOOD.replace(
                "model: {",
                &format!("model: {{kind: llama, rope_scaling: {{rope_type: longrope, {fields}}}, "),
            )
        };
        let longrope_good = "factor: 4, original_max_position_embeddings: 8, short_factor: [1, 1, 1, 1, 1, 1, 1, 1], long_factor: [1, 2, 3, 4, 5, 6, 7, 8]".to_string();
        for (text, says) in [
            (llama3(good), None),
            (
                GOOD.replace(
                    "model: {",
                    "model: {kind: llama, rope_scaling: {rope_type: linear, factor: 1}, ",
                ),
                None,
            ),
            (
                llama3(&good.replace("factor: 8", "factor: 0.5")),
                Some("factor must be at least 1, got 0.5"),
            ),
            (
                llama3(&good.replace("low_freq_factor: 1", "low_freq_factor: 4")),
                Some("low_freq_factor (4) must be positive and below high_freq_factor (4)"),
            ),
            (
                llama3(&good.replace("low_freq_factor: 1", "low_freq_factor: 0")),
                Some("low_freq_factor (0) must be positive"),
            ),
            (
                llama3(&good.replace("embeddings: 8", "embeddings: 0")),
                Some("original_max_position_embeddings must be at least 1"),
            ),
            (
                GOOD.replace(
                    "model: {",
                    "model: {rope_scaling: {rope_type: linear, factor: 2}, ",
                ),
                Some("is for `kind: llama`"),
            ),
            (longrope(&longrope_good), None),
            (
                longrope(&longrope_good.replace("short_factor: [1, ", "short_factor: [")),
                Some("short_factor has 7 factors: a head 16 wide turns 8 pairs, one factor each"),
            ),
            (
                longrope(&longrope_good.replace("long_factor: [1, 2, 3", "long_factor: [1, 2, 0")),
                Some("long_factor[2] is 0: each must be a positive number"),
            ),
            (
                longrope(&longrope_good.replace("embeddings: 8", "embeddings: 1")),
                Some("original_max_position_embeddings must be at least 2"),
            ),
            (
                longrope(&format!("{longrope_good}, attention_factor: -1")),
                Some("attention_factor must be positive, got -1"),
            ),
        ] {
            let p = write(d.path(), "j.yaml", &text);
            let got = load_job(&p, &[]).and_then(|mut j| j.validate(2));
            match says {
                None => got.unwrap(),
                Some(says) => {
                    let e = got.unwrap_err().to_string();
                    assert!(e.contains("model.rope_scaling") && e.contains(says), "{e}");
                }
            }
        }
    }

    /// `model.partial_rotary_factor`: a LLaMA's, turning an even width of
    /// each head (of 16 here), with what Phi-3 (as which it is exported)
    /// has; each refusal at the key.
    #[test]
    fn partial_rotary_factor_is_held_to_what_phi3_has() {
        let d = tempfile::tempdir().unwrap();
        let with =
            |fields: &str| GOOD.replace("model: {", &format!("model: {{kind: llama, {fields}, "));
        let ones = "short_factor: [1, 1, 1, 1, 1, 1], long_factor: [1, 1, 1, 1, 1, 1]";
        for (text, says) in [
            (with("partial_rotary_factor: 0.75"), None),
            // int(16 · 0.8) = 12.
            (with("partial_rotary_factor: 0.8"), None),
            (with("partial_rotary_factor: 1"), None),
            (
                with(&format!("partial_rotary_factor: 0.75, rope_scaling: {{rope_type: longrope, factor: 4, original_max_position_embeddings: 8, {ones}}}")),
                None,
            ),
            (
                with("partial_rotary_factor: 0.1"),
                Some("turns 1 of each head's 16 columns: rotary embeddings turn pairs"),
            ),
            (
                with("partial_rotary_factor: 0.33"),
                Some("turns 5 of each head's 16 columns"),
            ),
            (
                with("partial_rotary_factor: 1.5"),
                Some("must be above 0 and at most 1, got 1.5"),
            ),
            (
                with("partial_rotary_factor: 0.75, qkv_bias: true"),
                Some("goes with Phi-3's attention, as which a model of it is exported: no model.qkv_bias"),
            ),
            (
                with("partial_rotary_factor: 0.75, rope_scaling: {rope_type: linear, factor: 2}"),
                Some("whose rotary embedding is scaled as longrope or not at all"),
            ),
            (
                with(&format!("partial_rotary_factor: 0.75, rope_scaling: {{rope_type: longrope, factor: 4, original_max_position_embeddings: 8, {}}}", ones.replace("1, 1, 1, 1, 1, 1]", "1, 1, 1, 1, 1, 1, 1, 1]"))),
                Some("short_factor has 8 factors: a head 12 wide turns 6 pairs"),
            ),
            (
                GOOD.replace("model: {", "model: {partial_rotary_factor: 0.5, "),
                Some("is for `kind: llama`"),
            ),
        ] {
            let p = write(d.path(), "j.yaml", &text);
            let got = load_job(&p, &[]).and_then(|mut j| j.validate(2));
            match says {
                None => got.unwrap(),
                Some(says) => {
                    let e = got.unwrap_err().to_string();
                    assert!(e.contains("model.") && e.contains(says), "{says}: {e}");
                }
            }
        }
    }

    #[test]
    fn unknown_key_is_located_with_a_hint() {
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), "j.yaml", &GOOD.replace("  lr:", "  lrr:"));
        let e = load_job(&p, &[]).unwrap_err().to_string();
        assert!(e.contains("j.yaml:7:"), "{e}");
        assert!(e.contains("unknown key `lrr`, did you mean `lr`?"), "{e}");
    }

    #[test]
    fn non_finite_numbers_are_located_not_turned_into_null() {
        // `.nan` and `.inf` are YAML floats; JSON, which every spec passes
        // through, has neither. Each float key, and each spelling.
        let d = tempfile::tempdir().unwrap();
        let cases = [
            ("  lr: 1.0e-3", "  lr: .nan", "j.yaml:7:7", "got NaN"),
            (
                "  lr: 1.0e-3",
                "  grad_clip: -.inf",
                "j.yaml:7:14",
                "got -inf",
            ),
            (
                "  lr: 1.0e-3",
                "  optimizer: {betas: [0.9, .NaN]}",
                "j.yaml:7:",
                "got NaN",
            ),
            (
                "  lr: 1.0e-3",
                "  loss_scale: {min_loss_scale: .inf}",
                "j.yaml:7:",
                "got inf",
            ),
            (
                "seq_len: 16}",
                "seq_len: 16, norm_eps: .inf}",
                "j.yaml:2:",
                "got inf",
            ),
            (
                "  format: synthetic",
                "  format: synthetic\n  val_fraction: .nan",
                "j.yaml:5:",
                "got NaN",
            ),
        ];
        for (from, to, at, what) in cases {
            let p = write(d.path(), "j.yaml", &GOOD.replace(from, to));
            let e = load_job(&p, &[]).unwrap_err().to_string();
            assert!(e.contains(at), "{to}: {e}");
            assert!(
                e.contains(&format!("expected a finite number, {what}")),
                "{to}: {e}"
            );
        }
        let p = write(d.path(), "j.yaml", GOOD);
        let e = load_job(&p, &["comm.timeout_s=.inf".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--set comm.timeout_s=.inf"), "{e}");
        assert!(e.contains("expected a finite number, got `.inf`"), "{e}");
    }

    /// A "billion laughs" file (aliases of aliases, 9^9 strings) is refused
    /// at its line by the parser's budget, in the job's words, without
    /// expanding it.
    #[test]
    fn a_yaml_bomb_is_refused_at_its_line() {
        let d = tempfile::tempdir().unwrap();
        let mut text = format!("{GOOD}env:\n  A: &a [\"lol\", \"lol\", \"lol\"]\n");
        let mut prev = 'a';
        for name in "bcdefghijk".chars() {
            let refs = vec![format!("*{prev}"); 9].join(", ");
            text.push_str(&format!(
                "  {}: &{name} [{refs}]\n",
                name.to_ascii_uppercase()
            ));
            prev = name;
        }
        let p = write(d.path(), "j.yaml", &text);
        let e = load_job(&p, &[]).unwrap_err().to_string();
        assert!(e.contains("j.yaml:"), "{e}");
        assert!(e.contains("through aliases of aliases"), "{e}");
    }

    #[test]
    fn values_outside_f32_are_refused_where_f32_uses_them() {
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), "j.yaml", GOOD);
        for (set, what) in [
            ("train.lr=1e39", "1e39 is past f32's largest value"),
            (
                "train.weight_decay=4e38",
                "4e38 is past f32's largest value",
            ),
            (
                "train.loss_scale.min_loss_scale=1e300",
                "1e300 is past f32's",
            ),
            ("model.norm_eps=1e39", "1e39 is past f32's"),
            ("train.optimizer.eps=1e-50", "1e-50 is 0 in f32"),
            ("model.norm_eps=5e-324", "5e-324 is 0 in f32"),
        ] {
            let mut job = load_job(&p, &[set.into()]).unwrap();
            let e = job.validate(2).unwrap_err().to_string();
            let key = set.split('=').next().unwrap();
            assert!(e.contains(&format!("--set {key}")), "{set}: {e}");
            assert!(e.contains(what), "{set}: {e}");
        }
        // The edges themselves are f32 values.
        for set in [
            "train.lr=3.4e38",
            "train.weight_decay=3.4028234663852886e38",
            "train.optimizer.eps=1.5e-45",
            "model.norm_eps=1e-40",
        ] {
            let mut job = load_job(&p, &[set.into()]).unwrap();
            job.validate(2).unwrap_or_else(|e| panic!("{set}: {e}"));
        }
    }

    /// A value of the wrong type names its key and the type wanted, at its
    /// place (serde-saphyr alone said "expected string scalar" for a list
    /// and "invalid u64" for a word, naming neither), in flow and block
    /// style; a wrong name among a closed set keeps serde's list.
    #[test]
    fn a_value_of_the_wrong_type_names_its_key_and_the_type() {
        let d = tempfile::tempdir().unwrap();
        for (from, to, at, says) in [
            (
                "d_model: 64",
                "d_model: [64]",
                "j.yaml:2:",
                "model.d_model: invalid type: sequence, expected a whole number ≥ 0",
            ),
            (
                "d_model: 64",
                "d_model: abc",
                "j.yaml:2:",
                "model.d_model: invalid type: string \"abc\", expected a whole number ≥ 0",
            ),
            (
                "  lr: 1.0e-3",
                "  lr:\n    - 1",
                "j.yaml:8:",
                "train.lr: invalid type: sequence, expected a number",
            ),
            (
                "  steps: 5",
                "  steps: -5",
                "j.yaml:6:",
                "train.steps: invalid value: integer `-5`, expected a whole number ≥ 0",
            ),
            (
                "  format: synthetic",
                "  format: csv",
                "j.yaml:4:",
                "expected one of",
            ),
        ] {
            let p = write(d.path(), "j.yaml", &GOOD.replace(from, to));
            let e = load_job(&p, &[]).unwrap_err().to_string();
            assert!(e.contains(at) && e.contains(says), "{to}: {e}");
        }
    }

    #[test]
    fn a_duplicate_key_is_located_and_named() {
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), "j.yaml", &format!("{GOOD}  steps: 6\n"));
        let e = load_job(&p, &[]).unwrap_err().to_string();
        assert!(e.contains("j.yaml:8:"), "{e}");
        assert!(e.contains("duplicate key `steps`"), "{e}");
        assert!(!e.contains("DuplicateKeyPolicy"), "{e}");
    }

    #[test]
    fn overrides_are_typed_and_checked() {
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), "j.yaml", GOOD);
        let job = load_job(
            &p,
            &[
                "train.steps=9".into(),
                "zero.reduce_bucket_size=1MiB".into(),
            ],
        )
        .unwrap();
        assert_eq!(job.spec.train.steps, 9);
        assert_eq!(job.spec.zero.reduce_bucket_size.0, 1 << 20);
        // Both spellings, for every size key: letters decimal, `…iB` binary.
        for key in [
            "reduce_bucket_size",
            "prefetch_bucket_size",
            "param_persistence_threshold",
            "sub_group_size",
        ] {
            for (text, want) in [("3M", 3_000_000), ("3MiB", 3 << 20), ("2e3", 2000)] {
                let job = load_job(&p, &[format!("zero.{key}={text}")]).unwrap();
                let z = &job.spec.zero;
                let got = match key {
                    "reduce_bucket_size" => z.reduce_bucket_size,
                    "prefetch_bucket_size" => z.prefetch_bucket_size,
                    "param_persistence_threshold" => z.param_persistence_threshold,
                    _ => z.sub_group_size,
                };
                assert_eq!(got.0, want, "zero.{key}={text}");
            }
        }
        assert_eq!(job.locate("train.steps"), "--set train.steps");
        // DeepSpeed's spelling of a key sets zrun's, whatever the file wrote.
        let job = load_job(&p, &["zero.zero_hpz_partition_size=2".into()]).unwrap();
        assert_eq!(job.spec.zero.hpz_partition_size, 2);
        let e = load_job(&p, &["zero.stge=1".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean `stage`"), "{e}");
        let e = load_job(&p, &["train.steps=many".into()])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--set train.steps=many"), "{e}");
        assert!(load_job(&p, &["novalue".into()]).is_err());
    }

    #[test]
    fn semantic_errors_point_at_the_key() {
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            "j.yaml",
            &GOOD.replace("n_heads: 4", "n_heads: 5"),
        );
        let e = load_job(&p, &[])
            .unwrap()
            .validate(1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("j.yaml:2:"), "{e}");
        assert!(e.contains("do not divide"), "{e}");
        let p = write(d.path(), "k.yaml", &GOOD.replace("lr: 1.0e-3", "lr: -1"));
        let e = load_job(&p, &[])
            .unwrap()
            .validate(1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("k.yaml:7:3: train.lr"), "{e}");
    }

    /// `train.curriculum`: DeepSpeed's schedules parse, and each value a
    /// schedule cannot run is refused naming its key (the model here has
    /// 16 tokens).
    #[test]
    fn a_curriculum_is_checked_against_the_model_and_its_schedule() {
        let d = tempfile::tempdir().unwrap();
        let p = write(d.path(), "c.yaml", GOOD);
        let linear = "train.curriculum={min_difficulty: 8, schedule_type: fixed_linear, total_curriculum_step: 4, difficulty_step: 4}";
        let mut job = load_job(&p, &[linear.into()]).unwrap();
        job.validate(1).unwrap();
        let c = job.spec.train.curriculum.as_ref().unwrap();
        assert_eq!(
            (0..5).map(|s| c.seq_len(s, 16)).collect::<Vec<_>>(),
            [8, 12, 12, 16, 16]
        );
        let discrete = "train.curriculum={min_difficulty: 4, schedule_type: fixed_discrete, difficulty: [4, 8, 16], max_step: [2, 5]}";
        load_job(&p, &[discrete.into()])
            .unwrap()
            .validate(1)
            .unwrap();
        // The error of a curriculum with one key set over it (printed).
        let refused = |base: &str, extra: &str| {
            let e = load_job(&p, &[base.into(), extra.into()])
                .and_then(|mut j| j.validate(1))
                .unwrap_err()
                .to_string();
            eprintln!("{extra}: {e}");
            e
        };
        for (extra, want) in [
            (
                "train.curriculum.min_difficulty=0",
                "min_difficulty: must be between 1 and model.seq_len (16) tokens, got 0",
            ),
            (
                "train.curriculum.max_difficulty=17",
                "max_difficulty: must be between 1 and model.seq_len (16)",
            ),
            (
                "train.curriculum.max_difficulty=4",
                "min_difficulty: 8 is above max_difficulty (4)",
            ),
            (
                "train.curriculum.difficulty_step=9",
                "difficulty_step: must be between 1 and min_difficulty (8)",
            ),
            (
                "train.curriculum.total_curriculum_step=0",
                "total_curriculum_step: fixed_linear needs the steps",
            ),
            (
                "train.curriculum.root_degree=2",
                "root_degree: has no place beside schedule_type: fixed_linear",
            ),
            (
                "train.curriculum.schedule_type=fixed_root",
                "root_degree: fixed_root needs a positive root degree",
            ),
            (
                "train.curriculum.max_step=[3]",
                "max_step: has no place beside schedule_type: fixed_linear",
            ),
        ] {
            assert!(refused(linear, extra).contains(want), "{extra}");
        }
        for (extra, want) in [
            (
                "train.curriculum.max_step=[2]",
                "difficulty: fixed_discrete needs one more difficulty than max_step",
            ),
            (
                "train.curriculum.max_step=[5, 5]",
                "max_step: must rise from 1 step on",
            ),
            (
                "train.curriculum.difficulty=[4, 8, 32]",
                "difficulty: must be between 1 and model.seq_len (16) tokens, got 32",
            ),
            (
                "train.curriculum.difficulty_step=4",
                "difficulty_step: has no place beside schedule_type: fixed_discrete",
            ),
        ] {
            assert!(refused(discrete, extra).contains(want), "{extra}");
        }
    }

    /// The optimizer's and schedule's knobs: parsed from YAML and `--set`,
    /// each out-of-range value refused naming its key.
    #[test]
    fn optimizer_and_schedule_knobs_parse_and_are_checked() {
        let d = tempfile::tempdir().unwrap();
        let text = GOOD.replace(
            "  lr: 1.0e-3\n",
            "  lr: 1.0e-3\n  min_lr: 1.0e-4\n  schedule: wsd\n  decay_fraction: 0.3\n  optimizer: {betas: [0.9, 0.95], eps: 1.0e-6}\n",
        );
        let p = write(d.path(), "o.yaml", &text);
        let mut job = load_job(&p, &[]).unwrap();
        job.validate(1).unwrap();
        let t = &job.spec.train;
        assert_eq!((t.min_lr, t.decay_fraction), (1e-4, 0.3));
        assert_eq!(t.schedule, crate::Schedule::Wsd);
        assert_eq!((t.optimizer.betas, t.optimizer.eps()), ([0.9, 0.95], 1e-6));
        let p = write(d.path(), "g.yaml", GOOD);
        for (set, want) in [
            (
                "train.min_lr=0.01",
                "train.min_lr: must be between 0 and train.lr",
            ),
            (
                "train.decay_fraction=0",
                "train.decay_fraction: must be in (0, 1]",
            ),
            (
                "train.num_cycles=3",
                "train.num_cycles: belongs to train.schedule: cosine_with_restarts, and the schedule is cosine",
            ),
            (
                "train.power=2",
                "train.power: belongs to train.schedule: polynomial, and the schedule is cosine",
            ),
            (
                "train.timescale=100",
                "train.timescale: belongs to train.schedule: inverse_sqrt",
            ),
            (
                "train.optimizer.betas=[0.9, 1.0]",
                "train.optimizer.betas: beta2 must be in [0, 1)",
            ),
            (
                "train.optimizer.eps=0",
                "train.optimizer.eps: must be a positive number",
            ),
        ] {
            let e = load_job(&p, &[set.into()])
                .unwrap()
                .validate(1)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{set}: {e}");
        }
        // Each schedule's knob, set beside its schedule: in range, or refused.
        for (schedule, knob, good, bad, want) in [
            (
                "cosine_with_restarts",
                "num_cycles",
                "4",
                "0",
                "must be at least 1",
            ),
            (
                "polynomial",
                "power",
                "0.5",
                "0",
                "must be a positive number",
            ),
            (
                "inverse_sqrt",
                "timescale",
                "500",
                "0",
                "must be at least 1",
            ),
        ] {
            let schedule = format!("train.schedule={schedule}");
            let set = |v: &str| vec![schedule.clone(), format!("train.{knob}={v}")];
            load_job(&p, &set(good)).unwrap().validate(1).unwrap();
            let e = load_job(&p, &set(bad))
                .unwrap()
                .validate(1)
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("train.{knob}: {want}")), "{knob}: {e}");
        }
        // LAMB's trust-ratio bounds: its own, positive, ordered; and LAMB
        // on GPUs only with its optimizer on the host.
        let lamb = |extra: &[&str]| {
            let mut sets = vec!["train.optimizer.type=lamb".to_string()];
            sets.extend(extra.iter().map(|s| s.to_string()));
            load_job(&p, &sets).and_then(|mut j| j.validate(1).map(|()| j))
        };
        let j = lamb(&["train.optimizer.min_coeff=0.1"]).unwrap();
        assert_eq!(j.spec.train.optimizer.trust_bounds(), [0.1, 10.0]);
        for (extra, want) in [
            (
                &["train.optimizer.min_coeff=0"][..],
                "train.optimizer.min_coeff: must be a positive number, got 0",
            ),
            (
                &["train.optimizer.max_coeff=0.001"],
                "train.optimizer.min_coeff: 0.01 is above max_coeff 0.001",
            ),
        ] {
            let e = lamb(extra).unwrap_err().to_string();
            assert!(e.contains(want), "{extra:?}: {e}");
        }
        let e = load_job(&p, &["train.optimizer.max_coeff=5".into()])
            .unwrap()
            .validate(1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train.optimizer.max_coeff: bounds LAMB's trust ratio; train.optimizer.type is adamw"),
            "{e}"
        );
        let mut gpu = lamb(&[]).unwrap().spec;
        gpu.device = crate::spec::Device::Cuda;
        let why = gpu
            .gpu_unsupported()
            .expect("LAMB refused on resident GPUs");
        assert!(
            why.contains("set zero.offload_optimizer.device: cpu"),
            "{why}"
        );
        gpu.zero.offload_optimizer.device = crate::spec::OffloadDevice::Cpu;
        assert_eq!(gpu.gpu_unsupported(), None, "LAMB on the host beside a GPU");
        // Adagrad: PyTorch's eps unless written, lr_decay its alone.
        let adagrad = |extra: &[&str]| {
            let mut sets = vec!["train.optimizer.type=adagrad".to_string()];
            sets.extend(extra.iter().map(|s| s.to_string()));
            load_job(&p, &sets).and_then(|mut j| j.validate(1).map(|()| j))
        };
        let o = adagrad(&["train.optimizer.lr_decay=0.01"])
            .unwrap()
            .spec
            .train
            .optimizer;
        assert_eq!((o.eps(), o.lr_decay), (1e-10, Some(0.01)));
        let o = adagrad(&["train.optimizer.eps=1e-6"])
            .unwrap()
            .spec
            .train
            .optimizer;
        assert_eq!(o.eps(), 1e-6);
        let o = adagrad(&["train.optimizer.initial_accumulator_value=0.1"])
            .unwrap()
            .spec
            .train
            .optimizer;
        assert_eq!(o.initial_accumulator_value, Some(0.1));
        let e = adagrad(&["train.optimizer.initial_accumulator_value=-1"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train.optimizer.initial_accumulator_value: must be a number at least 0"),
            "{e}"
        );
        // bias_correction: Adam's, AdamW's and LAMB's, not Adagrad's.
        let e = adagrad(&["train.optimizer.bias_correction=false"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train.optimizer.bias_correction: corrects Adam's and LAMB's moments; train.optimizer.type is adagrad"),
            "{e}"
        );
        for rule in ["adamw", "adam", "lamb"] {
            let o = load_job(
                &p,
                &[
                    format!("train.optimizer.type={rule}"),
                    "train.optimizer.bias_correction=false".into(),
                ],
            )
            .and_then(|mut j| j.validate(1).map(|()| j))
            .unwrap()
            .spec
            .train
            .optimizer;
            assert!(!o.bias_correction(), "{rule}");
        }
        let e = adagrad(&["train.optimizer.lr_decay=-0.5"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train.optimizer.lr_decay: must be a number at least 0, got -0.5"),
            "{e}"
        );
        let e = load_job(&p, &["train.optimizer.lr_decay=0.1".into()])
            .unwrap()
            .validate(1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "train.optimizer.lr_decay: decays Adagrad's rate; train.optimizer.type is adamw"
            ),
            "{e}"
        );
        let e = load_job(
            &p,
            &["train.optimizer.initial_accumulator_value=0.1".into()],
        )
        .unwrap()
        .validate(1)
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("train.optimizer.initial_accumulator_value: starts Adagrad's sums of squares; train.optimizer.type is adamw"),
            "{e}"
        );
        let mut gpu = adagrad(&[]).unwrap().spec;
        gpu.device = crate::spec::Device::Cuda;
        assert_eq!(gpu.gpu_unsupported(), None, "Adagrad runs on resident GPUs");
        // one_cycle: its keys, its refusals; no warmup beside it but 0.
        let one = |extra: &[&str]| {
            let mut sets = vec!["train.schedule=one_cycle".to_string()];
            sets.extend(extra.iter().map(|s| s.to_string()));
            load_job(&p, &sets).and_then(|mut j| j.validate(1).map(|()| j))
        };
        one(&["train.warmup_steps=0"]).unwrap();
        let j = one(&["train.one_cycle.cycle_first_step_size=5"]).unwrap();
        let t = &j.spec.train;
        assert_eq!(t.warmup_steps, 0, "the cycle is the warmup");
        assert_eq!(t.one_cycle.as_ref().unwrap().cycle_first_step_size, 5);
        for (extra, want) in [
            (
                &["train.warmup_steps=10"][..],
                "train.warmup_steps: has no place beside train.schedule: one_cycle",
            ),
            (
                &["train.warmup_ratio=0.1"],
                "train.warmup_ratio: has no place beside train.schedule: one_cycle",
            ),
            (
                &["train.one_cycle.cycle_first_step_size=0"],
                "train.one_cycle.cycle_first_step_size: must be at least 1",
            ),
            (
                &["train.one_cycle.cycle_max_mom=1"],
                "train.one_cycle.cycle_max_mom: must be in [0, 1)",
            ),
            (
                &[
                    "train.one_cycle.cycle_first_step_size=2",
                    "train.one_cycle.decay_step_size=1",
                    "train.one_cycle.decay_mom_rate=0.1",
                    "train.steps=20",
                ],
                "train.one_cycle.decay_mom_rate: takes β1 to",
            ),
        ] {
            let e = one(extra).map(|_| ()).unwrap_err().to_string();
            assert!(e.contains(want), "{extra:?}: {e}");
        }
        let range = |extra: &str| {
            let sets = vec!["train.schedule=lr_range_test".into(), extra.into()];
            load_job(&p, &sets).and_then(|mut j| j.validate(1).map(|()| j))
        };
        let j = range("train.lr_range_test.staircase=true").unwrap();
        assert!(j.spec.train.lr_range_test.as_ref().unwrap().staircase);
        assert_eq!(j.spec.train.warmup_steps, 0);
        for (extra, want) in [
            (
                "train.lr_range_test.step_size=0",
                "train.lr_range_test.step_size: must be at least 1",
            ),
            (
                "train.lr_range_test.step_rate=-1",
                "train.lr_range_test.step_rate: must be at least 0",
            ),
            (
                "train.warmup_steps=5",
                "train.warmup_steps: has no place beside train.schedule: lr_range_test",
            ),
        ] {
            let e = range(extra).map(|_| ()).unwrap_err().to_string();
            assert!(e.contains(want), "{extra}: {e}");
        }
        let e = load_job(&p, &["train.one_cycle.decay_lr_rate=0.5".into()])
            .unwrap()
            .validate(1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train.one_cycle: belongs to train.schedule: one_cycle"),
            "{e}"
        );
    }

    #[test]
    fn data_must_exist_and_fit() {
        let d = tempfile::tempdir().unwrap();
        // The validation error of the good job with `data` given this path.
        let error_with_path = |path: &str| {
            let spec = GOOD.replace("  format: synthetic", &format!("  path: {path}"));
            let p = write(d.path(), "j.yaml", &spec);
            load_job(&p, &[])
                .unwrap()
                .validate(1)
                .unwrap_err()
                .to_string()
        };
        let text = write(d.path(), "small.txt", "0123456789");
        let e = error_with_path(&text.display().to_string());
        assert!(e.contains("fewer than one sequence"), "{e}");
        let e = error_with_path("/nonexistent/*.txt");
        assert!(e.contains("no file matches"), "{e}");
        assert!(
            !e.contains("looked up from"),
            "an absolute path needs no hint: {e}"
        );
        // A relative pattern says where it was looked up from.
        let e = error_with_path("no-such-dir/*.txt");
        let cwd = std::env::current_dir().unwrap();
        assert!(
            e.contains("no file matches `no-such-dir/*.txt` (a relative path is looked up from the directory zrun runs in")
                && e.contains(&cwd.display().to_string()),
            "{e}"
        );
    }

    /// `data.separate_documents` needs an end-of-text id below the
    /// vocabulary (`data.eos_id`, else the manifest's), data with documents
    /// and the CPU; `data.eos_id` alone, or one the manifest contradicts,
    /// is refused naming the key.
    #[test]
    fn separate_documents_needs_an_end_of_text_id() {
        let d = tempfile::tempdir().unwrap();
        // 40 u16 tokens (ids below 8), with a manifest recording eos 5.
        let ids: Vec<u8> = (0..40u16).flat_map(|i| (i % 8).to_le_bytes()).collect();
        std::fs::create_dir(d.path().join("prepared")).unwrap();
        std::fs::write(d.path().join("prepared/train.bin"), &ids).unwrap();
        let manifest = serde_json::json!({
            "tokenizer": "t.json", "tokenizer_sha256": "0", "vocab_size": 8,
            "format": "tokens_u16", "eos_id": 5,
            "files": {"train.bin": {"tokens": 40, "bytes": 80, "max_token_id": 7, "documents": 5}}
        });
        write(d.path(), "prepared/manifest.json", &manifest.to_string());
        // Validation data prepared with another end-of-text id.
        std::fs::create_dir(d.path().join("other")).unwrap();
        std::fs::write(d.path().join("other/val.bin"), &ids).unwrap();
        let mut other = manifest.clone();
        other["eos_id"] = 6.into();
        other["files"] = serde_json::json!({"val.bin": other["files"]["train.bin"].clone()});
        write(d.path(), "other/manifest.json", &other.to_string());
        let other_val = format!("\n  val_path: {}", d.path().join("other/val.bin").display());
        let text = write(d.path(), "plain.txt", &"words and more words. ".repeat(4));
        let tokens = format!(
            "  path: {}\n  format: tokens_u16",
            d.path().join("prepared/train.bin").display()
        );
        let outcome = |data: &str, extra: &str| {
            let spec = GOOD
                .replace("  format: synthetic", &format!("{data}{extra}"))
                .replace("seq_len: 16}", "seq_len: 16, vocab_size: 256}");
            let p = write(d.path(), "j.yaml", &spec);
            load_job(&p, &[])
                .unwrap()
                .validate(1)
                .map_err(|e| e.to_string())
        };
        let on = "\n  separate_documents: true";
        let plain = format!("  path: {}", text.display());
        assert_eq!(outcome(&tokens, on), Ok(()));
        for packing in ["bfd", "bfd_split"] {
            let packed = format!("{on}\n  packing: {packing}");
            assert_eq!(outcome(&tokens, &packed), Ok(()), "{packing}");
        }
        assert_eq!(outcome(&plain, &format!("{on}\n  eos_id: 46")), Ok(()));
        for (data, extra, key, says) in [
            (
                "  format: synthetic",
                on.to_string(),
                "data.separate_documents",
                "synthetic data has no documents",
            ),
            (
                plain.as_str(),
                on.to_string(),
                "data.separate_documents",
                "set data.eos_id, or use data from zrun prepare",
            ),
            (
                plain.as_str(),
                format!("{on}\n  eos_id: 256"),
                "data.eos_id",
                "end-of-text id 256 is not below model.vocab_size 256",
            ),
            (
                plain.as_str(),
                "\n  eos_id: 46".into(),
                "data.eos_id",
                "is read only with data.separate_documents: true",
            ),
            (
                tokens.as_str(),
                format!("{on}\n  eos_id: 7"),
                "data.separate_documents",
                "data.eos_id 7, but ",
            ),
            (
                tokens.as_str(),
                format!("{on}{other_val}"),
                "data.val_path",
                "says its end-of-text id is 6, the training data's is 5",
            ),
            (
                tokens.as_str(),
                "\n  packing: bfd".into(),
                "data.packing",
                "set data.separate_documents: true too",
            ),
            (
                tokens.as_str(),
                "\n  packing: bfd_split".into(),
                "data.packing",
                "set data.separate_documents: true too",
            ),
        ] {
            let e = outcome(data, &extra).unwrap_err();
            assert!(e.contains(key) && e.contains(says), "{extra}: {e}");
        }
        // LongRoPE's factors switch past its original context: a sequence
        // longer than that, of documents kept apart, is refused.
        for (old, refused) in [(16, false), (8, true)] {
            let ones = ["1"; 8].join(", ");
            let spec = GOOD
                .replace("  format: synthetic", &format!("{tokens}{on}"))
                .replace(
                    "seq_len: 16}",
                    &format!(
                        "seq_len: 16, vocab_size: 256, kind: llama, rope_scaling: {{rope_type: longrope, factor: 2, original_max_position_embeddings: {old}, short_factor: [{ones}], long_factor: [{ones}]}}}}"
                    ),
                );
            let p = write(d.path(), "j.yaml", &spec);
            let got = load_job(&p, &[]).unwrap().validate(1);
            match refused {
                false => got.unwrap(),
                true => {
                    let e = got.unwrap_err().to_string();
                    assert!(
                        e.contains("data.separate_documents")
                            && e.contains(
                                "longrope factors switch at 8 tokens, below model.seq_len 16"
                            ),
                        "{e}"
                    );
                }
            }
        }
    }

    #[test]
    fn finds_keys_in_block_and_flow_style() {
        let t = "model: {d_model: 64, n_heads: 4}\ntrain:\n  # c\n  steps: 3\nzero:\n  offload_optimizer:\n    device: cpu\ndevice: cpu\n";
        assert_eq!(find_key(t, "model.n_heads"), Some((1, 22)));
        assert_eq!(find_key(t, "train.steps"), Some((4, 3)));
        assert_eq!(find_key(t, "zero.offload_optimizer.device"), Some((7, 5)));
        assert_eq!(find_key(t, "device"), Some((8, 1)));
        assert_eq!(find_key(t, "train.lr"), None);
        // Flow mappings inside flow mappings, quoted colons skipped, and a
        // name at another level (or a value) not taken for the key.
        let t = "train: {steps: 3, one_cycle: {steps: 5, x: \"a, steps: 1\"}, curriculum: {min_difficulty: 8}}\n";
        assert_eq!(find_key(t, "train.steps"), Some((1, 9)));
        assert_eq!(find_key(t, "train.one_cycle.steps"), Some((1, 31)));
        assert_eq!(
            find_key(t, "train.curriculum.min_difficulty"),
            Some((1, 73))
        );
        assert_eq!(find_key(t, "train.curriculum.steps"), None);
        assert_eq!(
            find_key("data: {format: text, path: x}\n", "data.text"),
            None
        );
    }
}
