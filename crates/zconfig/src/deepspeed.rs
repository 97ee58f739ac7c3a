//! DeepSpeed config import: `zrun train JOB --deepspeed ds_config.json`, or a
//! `deepspeed:` key in the job, sets the job's keys from a DeepSpeed config.
//!
//! Every key of a ds_config is one of three kinds:
//! - **mapped**: it sets a zrun key (docs/DEEPSPEED.md has the table);
//! - **ignored by design**: it tunes something zrun does its own way or always
//!   does (`contiguous_gradients`, `wall_clock_breakdown`); listed once in a
//!   warning;
//! - **refused**: a value whose meaning zrun cannot honour (a 1-bit
//!   optimizer, CPU activation checkpointing, a partial offload), or a key
//!   zrun does not know: exit 2 naming the JSON path and its line.
//!
//! `"auto"` resolves as Hugging Face's integration resolves it, with the job
//! in the trainer's place: the job's value of the key it maps to (the batch
//! sizes, learning rate, betas, warmup, steps, dtype, clipping), and for
//! ZeRO's bucket sizes the hidden size's formulas (`d²`, `0.9·d²`, `10·d`).
//! Where a key has no `"auto"` in that integration, `"auto"` is refused.
//!
//! Keys a ds_config omits keep the job's values, except where DeepSpeed's
//! default changes the arithmetic: `gradient_clipping` (0: none), and the
//! parameters of an `optimizer` or `scheduler` section it has (DeepSpeed's
//! Adam: lr 1e-3, weight decay 0; its schedulers: 1000 warmup steps on a
//! logarithmic ramp). Those implied defaults yield to a value the job file
//! writes; a value both files write must agree (exit 2 naming both places).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::elastic::{ElasticVersion, Elasticity};
use crate::error::{did_you_mean, ConfigError};

/// How a mapped key got its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Written in the ds_config.
    Written,
    /// `"auto"` in the ds_config.
    Auto,
    /// Omitted: DeepSpeed's default, which yields to the job file's value.
    Default,
}

/// The value a mapped key takes.
#[derive(Debug, Clone, PartialEq)]
pub enum MappedValue {
    /// This value.
    Set(Value),
    /// The job's own value (`"auto"`).
    Job,
    /// This share of the resolved `train.lr` (`WarmupCosineLR`'s ratios).
    TimesLr(f64),
}

/// One zrun key set from the ds_config.
#[derive(Debug, Clone, PartialEq)]
pub struct Mapped {
    /// The zrun key (dotted).
    pub key: &'static str,
    /// Its value.
    pub value: MappedValue,
    /// The ds_config key it came from (dotted JSON path).
    pub source: String,
    /// 1-based line and column of `source` (of its section for a default).
    pub at: (usize, usize),
    /// Written, `"auto"` or implied.
    pub origin: Origin,
}

/// A ds_config read and sorted into mapped, ignored and checked keys.
#[derive(Debug, Clone)]
pub struct DeepSpeedConfig {
    /// The file.
    pub path: PathBuf,
    /// Keys that set the job's, in the order they apply.
    pub mapped: Vec<Mapped>,
    /// Keys ignored by design: (JSON path, line).
    pub ignored: Vec<(String, usize)>,
    /// Things to tell the user that are not errors (a superseded value).
    pub notes: Vec<String>,
    /// `train_batch_size` when written: checked against micro-batch ×
    /// accumulation × world size once the world size is known.
    pub train_batch_size: Option<(u64, (usize, usize))>,
    /// An enabled `elasticity` section and where it is: it settles the
    /// batch once the world size is known, in place of the batch keys.
    pub elasticity: Option<(Elasticity, (usize, usize))>,
}

impl DeepSpeedConfig {
    /// `file:line:col` of a JSON path's key.
    pub fn location(&self, at: (usize, usize)) -> String {
        format!("{}:{}:{}", self.path.display(), at.0, at.1)
    }

    /// The mapping that sets `key`, if one does.
    pub fn source_of(&self, key: &str) -> Option<&Mapped> {
        self.mapped.iter().rev().find(|m| m.key == key)
    }

    /// The warning that lists the keys ignored by design, if any.
    pub fn ignored_warning(&self) -> Option<String> {
        if self.ignored.is_empty() {
            return None;
        }
        let keys: Vec<String> = self
            .ignored
            .iter()
            .map(|(k, line)| format!("{k} (line {line})"))
            .collect();
        Some(format!(
            "{}: ignored by design (zrun does this its own way; see docs/DEEPSPEED.md): {}",
            self.path.display(),
            keys.join(", ")
        ))
    }
}

/// Reads the ds_config at `path`. `d_model` resolves the `"auto"` bucket sizes.
pub fn read(path: &Path, d_model: usize) -> Result<DeepSpeedConfig, ConfigError> {
    let text = crate::read_config(path)?;
    let root: Value = serde_json::from_str(&text).map_err(|e| ConfigError::Syntax {
        path: path.to_path_buf(),
        line: e.line() as u64,
        column: e.column().max(1) as u64,
        message: format!("not a DeepSpeed config (JSON): {e}"),
    })?;
    let mut r = Reader {
        path: path.to_path_buf(),
        positions: key_positions(&text),
        root,
        d_model,
        out: DeepSpeedConfig {
            path: path.to_path_buf(),
            mapped: Vec::new(),
            ignored: Vec::new(),
            notes: Vec::new(),
            train_batch_size: None,
            elasticity: None,
        },
    };
    if !r.root.is_object() {
        return Err(r.error("(root)", "a DeepSpeed config is a JSON object"));
    }
    r.top_level()?;
    Ok(r.out)
}

/// What a ds_config key is to zrun.
#[derive(Clone, Copy)]
enum Kind {
    /// Handled by its section's code.
    Section,
    /// Ignored by design.
    Ignored,
    /// Ignored when it has one of these values, refused otherwise (why).
    Only(&'static [Accept], &'static str),
    /// A section with `enabled`: ignored when off, refused when on (why).
    OffOnly(&'static str),
}

/// A value a key may keep.
#[derive(Clone, Copy)]
enum Accept {
    Bool(bool),
    Num(f64),
}

impl Accept {
    fn matches(self, v: &Value) -> bool {
        match self {
            Accept::Bool(b) => v.as_bool() == Some(b),
            Accept::Num(n) => v.as_f64() == Some(n),
        }
    }
}

/// The batch keys, which an enabled `elasticity` replaces.
const BATCH_KEYS: [&str; 3] = [
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
];

const TOP_LEVEL: &[(&str, Kind)] = &[
    ("train_batch_size", Kind::Section),
    ("train_micro_batch_size_per_gpu", Kind::Section),
    ("gradient_accumulation_steps", Kind::Section),
    ("steps_per_print", Kind::Section),
    ("optimizer", Kind::Section),
    ("scheduler", Kind::Section),
    ("fp16", Kind::Section),
    ("bf16", Kind::Section),
    ("bfloat16", Kind::Section),
    ("gradient_clipping", Kind::Section),
    ("zero_optimization", Kind::Section),
    ("aio", Kind::Section),
    ("activation_checkpointing", Kind::Section),
    ("data_types", Kind::Section),
    ("wall_clock_breakdown", Kind::Ignored),
    ("memory_breakdown", Kind::Ignored),
    ("flops_profiler", Kind::Section),
    ("tensorboard", Kind::Section),
    ("wandb", Kind::Ignored),
    ("csv_monitor", Kind::Section),
    ("comet", Kind::Ignored),
    ("comms_logger", Kind::Section),
    ("dump_state", Kind::Ignored),
    ("timers", Kind::Ignored),
    ("checkpoint", Kind::Ignored),
    ("zero_allow_untested_optimizer", Kind::Ignored),
    ("zero_force_ds_cpu_optimizer", Kind::Ignored),
    ("disable_allgather", Kind::Ignored),
    // torch.compile and DeepCompile: zrun's kernels are compiled ahead of
    // time, and neither changes what a step computes.
    ("compile", Kind::Ignored),
    ("graph_harvesting", Kind::Ignored),
    // Read only with experts, sequence parallelism, pipeline stages or
    // DeepSpeed's own data loader, none of which a zrun job has.
    ("use_data_before_expert_parallelism", Kind::Ignored),
    ("seq_parallel_communication_data_type", Kind::Ignored),
    ("pipeline", Kind::Ignored),
    ("dataloader_drop_last", Kind::Ignored),
    // Checked in `top_level`: a size of 1 is data parallelism.
    ("tensor_parallel", Kind::Section),
    ("prescale_gradients", Kind::Section),
    ("gradient_predivide_factor", Kind::Section),
    (
        "sparse_gradients",
        Kind::Only(
            &[Accept::Bool(false)],
            "zrun's embedding gradients are dense",
        ),
    ),
    ("communication_data_type", Kind::Section),
    ("amp", Kind::OffOnly("NVIDIA Apex AMP: use fp16 or bf16")),
    ("elasticity", Kind::Section),
    ("autotuning", Kind::OffOnly("the autotuner")),
    ("curriculum_learning", Kind::Section),
    ("data_efficiency", Kind::OffOnly("data efficiency")),
    (
        "compression_training",
        Kind::OffOnly("compression training"),
    ),
    ("sparse_attention", Kind::OffOnly("sparse attention")),
    ("progressive_layer_drop", Kind::Section),
    (
        "quantize_training",
        Kind::OffOnly("MoQ quantization-aware training"),
    ),
    ("eigenvalue", Kind::OffOnly("eigenvalue-based MoQ")),
    (
        "hybrid_engine",
        Kind::OffOnly("the hybrid engine (generation for RLHF)"),
    ),
    (
        "nebula",
        Kind::OffOnly("Nebula checkpointing (zrun writes its own checkpoints)"),
    ),
    (
        "weight_quantization",
        Kind::OffOnly("weight quantization at initialisation"),
    ),
];

const ZERO: &[(&str, Kind)] = &[
    ("stage", Kind::Section),
    ("overlap_comm", Kind::Section),
    ("reduce_bucket_size", Kind::Section),
    ("stage3_prefetch_bucket_size", Kind::Section),
    ("stage3_param_persistence_threshold", Kind::Section),
    // DeepSpeed's field names for the two above (either spelling is read).
    ("prefetch_bucket_size", Kind::Section),
    ("param_persistence_threshold", Kind::Section),
    ("sub_group_size", Kind::Section),
    ("offload_optimizer", Kind::Section),
    ("offload_param", Kind::Section),
    ("zero_quantized_weights", Kind::Section),
    ("zero_hpz_partition_size", Kind::Section),
    ("zero_quantized_gradients", Kind::Section),
    ("contiguous_gradients", Kind::Ignored),
    ("reduce_scatter", Kind::Ignored),
    ("allgather_partitions", Kind::Ignored),
    ("allgather_bucket_size", Kind::Ignored),
    ("round_robin_gradients", Kind::Ignored),
    ("stage3_max_live_parameters", Kind::Ignored),
    ("stage3_max_reuse_distance", Kind::Ignored),
    ("max_live_parameters", Kind::Ignored),
    ("max_reuse_distance", Kind::Ignored),
    ("stage3_model_persistence_threshold", Kind::Ignored),
    ("model_persistence_threshold", Kind::Ignored),
    ("stage3_module_granularity_threshold", Kind::Ignored),
    ("module_granularity_threshold", Kind::Ignored),
    ("stage3_use_all_reduce_for_fetch_params", Kind::Ignored),
    ("use_all_reduce_for_fetch_params", Kind::Ignored),
    ("cpu_offload_use_pin_memory", Kind::Ignored),
    ("pipeline_loading_checkpoint", Kind::Ignored),
    ("override_module_apply", Kind::Ignored),
    ("log_trace_cache_warnings", Kind::Ignored),
    ("stage3_gather_16bit_weights_on_model_save", Kind::Ignored),
    ("stage3_gather_fp16_weights_on_model_save", Kind::Ignored),
    ("gather_16bit_weights_on_model_save", Kind::Ignored),
    ("ignore_unused_parameters", Kind::Ignored),
    ("load_from_fp32_weights", Kind::Ignored),
    ("elastic_checkpoint", Kind::Ignored),
    ("memory_efficient_linear", Kind::Ignored),
    ("use_multi_rank_bucket_allreduce", Kind::Ignored),
    ("legacy_stage1", Kind::Ignored),
    (
        "cpu_offload",
        Kind::Only(
            &[Accept::Bool(false)],
            "the old spelling of offload_optimizer: write offload_optimizer: {device: cpu}",
        ),
    ),
    (
        "cpu_offload_param",
        Kind::Only(
            &[Accept::Bool(false)],
            "the old spelling of offload_param: write offload_param: {device: cpu}",
        ),
    ),
    (
        "mics_shard_size",
        Kind::Only(&[Accept::Num(-1.0)], "MiCS sharding"),
    ),
    (
        "mics_hierarchical_params_gather",
        Kind::Only(&[Accept::Bool(false)], "MiCS sharding"),
    ),
    ("zeropp_loco_param", Kind::Section),
    (
        "zero_quantized_nontrainable_weights",
        Kind::Only(
            &[Accept::Bool(false)],
            "zrun holds frozen parameters (train.freeze) in the working type, not quantized",
        ),
    ),
];

const OFFLOAD: &[(&str, Kind)] = &[
    ("device", Kind::Section),
    ("nvme_path", Kind::Section),
    ("buffer_count", Kind::Section),
    ("pin_memory", Kind::Ignored),
    ("pipeline_read", Kind::Ignored),
    ("pipeline_write", Kind::Ignored),
    ("pipeline", Kind::Ignored),
    ("fast_init", Kind::Ignored),
    ("buffer_size", Kind::Ignored),
    ("max_in_cpu", Kind::Ignored),
    (
        "ratio",
        Kind::Only(
            &[Accept::Num(1.0)],
            "a partial offload: zrun offloads all of a rank's states",
        ),
    ),
];

const FP16: &[(&str, Kind)] = &[
    ("enabled", Kind::Section),
    ("loss_scale", Kind::Section),
    ("initial_scale_power", Kind::Section),
    ("loss_scale_window", Kind::Section),
    ("hysteresis", Kind::Section),
    ("min_loss_scale", Kind::Section),
    (
        "consecutive_hysteresis",
        Kind::Only(
            &[Accept::Bool(false)],
            "zrun restores the hysteresis only when the scale grows (DeepSpeed's default)",
        ),
    ),
    ("auto_cast", Kind::Ignored),
    (
        "fp16_master_weights_and_grads",
        Kind::Only(&[Accept::Bool(false)], "zrun keeps f32 master weights"),
    ),
];

const BF16: &[(&str, Kind)] = &[
    ("enabled", Kind::Section),
    ("immediate_grad_update", Kind::Ignored),
    ("check_grad_overflow", Kind::Ignored),
];

const DATA_TYPES: &[(&str, Kind)] = &[("grad_accum_dtype", Kind::Section)];

const OPTIMIZER: &[(&str, Kind)] = &[("type", Kind::Section), ("params", Kind::Section)];

const ADAM_PARAMS: &[(&str, Kind)] = &[
    ("lr", Kind::Section),
    ("betas", Kind::Section),
    ("eps", Kind::Section),
    ("weight_decay", Kind::Section),
    ("adam_w_mode", Kind::Section),
    ("torch_adam", Kind::Ignored),
    ("fused", Kind::Ignored),
    ("bias_correction", Kind::Section),
    ("amsgrad", Kind::Only(&[Accept::Bool(false)], "AMSGrad")),
];

/// DeepSpeed's Lamb (FusedLamb) takes these.
const LAMB_PARAMS: &[(&str, Kind)] = &[
    ("lr", Kind::Section),
    ("betas", Kind::Section),
    ("eps", Kind::Section),
    ("weight_decay", Kind::Section),
    ("max_coeff", Kind::Section),
    ("min_coeff", Kind::Section),
    ("bias_correction", Kind::Section),
    (
        "eps_inside_sqrt",
        Kind::Only(
            &[Accept::Bool(false)],
            "zrun's LAMB adds eps outside the square root, FusedLamb's default",
        ),
    ),
    (
        "max_grad_norm",
        Kind::Only(
            &[Accept::Num(0.0)],
            "FusedLamb's own clipping, which DeepSpeed's engine leaves off; clip with gradient_clipping",
        ),
    ),
    ("amsgrad", Kind::Only(&[Accept::Bool(false)], "AMSGrad")),
];

/// DeepSpeed's Adagrad takes these: PyTorch's `Adagrad`, which it runs
/// (its CPU Adagrad, under offload, takes lr, eps and weight_decay).
const ADAGRAD_PARAMS: &[(&str, Kind)] = &[
    ("lr", Kind::Section),
    ("eps", Kind::Section),
    ("weight_decay", Kind::Section),
    ("lr_decay", Kind::Section),
    ("initial_accumulator_value", Kind::Section),
    ("amsgrad", Kind::Only(&[Accept::Bool(false)], "AMSGrad")),
    (
        "maximize",
        Kind::Only(&[Accept::Bool(false)], "zrun minimises the loss"),
    ),
    ("foreach", Kind::Ignored),
    ("fused", Kind::Ignored),
    ("differentiable", Kind::Ignored),
    (
        "fp32_optimizer_states",
        Kind::Only(&[Accept::Bool(true)], "zrun keeps optimizer state in f32"),
    ),
];

/// DeepSpeed's Lion takes these (no eps).
const LION_PARAMS: &[(&str, Kind)] = &[
    ("lr", Kind::Section),
    ("betas", Kind::Section),
    ("weight_decay", Kind::Section),
];

/// The legacy `curriculum_learning` section (Megatron-DeepSpeed's): on the
/// sequence length, `train.curriculum`.
const CURRICULUM: &[(&str, Kind)] = &[
    ("enabled", Kind::Section),
    ("curriculum_type", Kind::Section),
    ("min_difficulty", Kind::Section),
    ("max_difficulty", Kind::Section),
    ("schedule_type", Kind::Section),
    ("schedule_config", Kind::Section),
];

const CURRICULUM_SCHEDULE: &[(&str, Kind)] = &[
    ("total_curriculum_step", Kind::Section),
    ("difficulty_step", Kind::Section),
    ("root_degree", Kind::Section),
    ("difficulty", Kind::Section),
    ("max_step", Kind::Section),
];

/// `progressive_layer_drop`: `train.progressive_layer_drop`.
const LAYER_DROP: &[(&str, Kind)] = &[
    ("enabled", Kind::Section),
    ("theta", Kind::Section),
    ("gamma", Kind::Section),
];

const SCHEDULER: &[(&str, Kind)] = &[("type", Kind::Section), ("params", Kind::Section)];

const AIO: &[(&str, Kind)] = &[
    ("block_size", Kind::Section),
    ("queue_depth", Kind::Section),
    ("thread_count", Kind::Section),
    ("intra_op_parallelism", Kind::Section),
    ("single_submit", Kind::Ignored),
    ("overlap_events", Kind::Ignored),
    (
        "use_gds",
        Kind::Only(&[Accept::Bool(false)], "GPUDirect Storage"),
    ),
];

const ACTIVATION_CHECKPOINTING: &[(&str, Kind)] = &[
    ("partition_activations", Kind::Ignored),
    (
        "cpu_checkpointing",
        Kind::Only(
            &[Accept::Bool(false)],
            "checkpointed activations offloaded to the CPU: zrun keeps each block's input where it computes",
        ),
    ),
    ("contiguous_memory_optimization", Kind::Ignored),
    ("number_checkpoints", Kind::Ignored),
    ("synchronize_checkpoint_boundary", Kind::Ignored),
    ("profile", Kind::Ignored),
];

struct Reader {
    path: PathBuf,
    positions: HashMap<String, (usize, usize)>,
    root: Value,
    d_model: usize,
    out: DeepSpeedConfig,
}

/// A parameter of a schedule: (DeepSpeed's name, its default).
type Param = (&'static str, f64);

impl Reader {
    fn at(&self, path: &str) -> (usize, usize) {
        // A key's own position, else its section's.
        let mut p = path;
        loop {
            if let Some(at) = self.positions.get(p) {
                return *at;
            }
            match p.rsplit_once('.') {
                Some((parent, _)) => p = parent,
                None => return (1, 1),
            }
        }
    }

    fn error(&self, path: &str, message: impl Into<String>) -> ConfigError {
        let (line, col) = self.at(path);
        ConfigError::Invalid {
            location: format!("{}:{line}:{col}", self.path.display()),
            key: path.to_string(),
            message: message.into(),
        }
    }

    fn get(&self, path: &str) -> Option<&Value> {
        if path.is_empty() {
            return Some(&self.root);
        }
        path.split('.').try_fold(&self.root, |v, k| v.get(k))
    }

    fn map(&mut self, key: &'static str, value: MappedValue, source: &str, origin: Origin) {
        let at = self.at(source);
        self.out.mapped.push(Mapped {
            key,
            value,
            source: source.to_string(),
            at,
            origin,
        });
    }

    /// Checks the keys of the object at `path` against `known`: ignored keys
    /// are listed, refused ones and unknown ones are errors.
    fn sort_keys(&mut self, path: &str, known: &[(&str, Kind)]) -> Result<(), ConfigError> {
        let obj = match self.get(path) {
            Some(Value::Object(o)) => o.clone(),
            Some(Value::Null) | None => return Ok(()),
            Some(_) => return Err(self.error(path, "must be a JSON object")),
        };
        for (k, v) in &obj {
            let full = join(path, k);
            let Some((_, kind)) = known.iter().find(|(name, _)| name == k) else {
                let names = known.iter().map(|(n, _)| *n);
                let hint = match did_you_mean(k, names) {
                    Some(s) => format!(", did you mean `{s}`?"),
                    None => String::new(),
                };
                return Err(self.error(
                    &full,
                    format!("unknown DeepSpeed key `{k}`{hint} (zrun cannot tell what it would change, so it refuses it)"),
                ));
            };
            match *kind {
                Kind::Section => {}
                Kind::Ignored => self.out.ignored.push((full.clone(), self.at(&full).0)),
                Kind::Only(accepted, why) => {
                    if !accepted.iter().any(|a| a.matches(v)) {
                        return Err(self.error(&full, format!("{v} cannot be honoured: {why}")));
                    }
                    self.out.ignored.push((full.clone(), self.at(&full).0));
                }
                Kind::OffOnly(what) => {
                    let on = match v {
                        Value::Object(o) => {
                            o.get("enabled").and_then(Value::as_bool) != Some(false)
                        }
                        Value::Null => false,
                        _ => true,
                    };
                    if on {
                        return Err(self.error(
                            &full,
                            format!("{what} is not something zrun does (set `enabled: false` or remove the section)"),
                        ));
                    }
                    self.out.ignored.push((full.clone(), self.at(&full).0));
                }
            }
        }
        Ok(())
    }

    /// Maps `source` to `key` through `convert` when present; `"auto"` maps to
    /// the job's value where `auto` allows it.
    fn simple(
        &mut self,
        source: &str,
        key: &'static str,
        auto: bool,
        convert: fn(&Value) -> Result<Value, String>,
    ) -> Result<bool, ConfigError> {
        let Some(v) = self.get(source).cloned() else {
            return Ok(false);
        };
        if v.is_null() {
            return Ok(false);
        }
        if is_auto(&v) {
            if !auto {
                return Err(self.error(
                    source,
                    "\"auto\" has no value to take here (Hugging Face's integration fills it for no key of this name); write the value",
                ));
            }
            self.map(key, MappedValue::Job, source, Origin::Auto);
            return Ok(true);
        }
        let value = convert(&v).map_err(|m| self.error(source, m))?;
        self.map(key, MappedValue::Set(value), source, Origin::Written);
        Ok(true)
    }

    fn top_level(&mut self) -> Result<(), ConfigError> {
        self.sort_keys("", TOP_LEVEL)?;
        self.tensor_parallel()?;
        if self.elasticity()? {
            // Elasticity settles the batch; its keys were allowed only
            // with `ignore_non_elastic_batch_info`.
            for key in BATCH_KEYS {
                if self.get(key).is_some() {
                    self.out.ignored.push((key.to_string(), self.at(key).0));
                }
            }
        } else {
            self.batch()?;
        }
        self.simple("steps_per_print", "train.log_every", false, count_value)?;
        if !self.simple("gradient_clipping", "train.grad_clip", true, non_negative)? {
            self.map(
                "train.grad_clip",
                MappedValue::Set(json!(0.0)),
                "gradient_clipping",
                Origin::Default,
            );
        }
        self.optimizer()?;
        self.scheduler()?;
        self.precision()?;
        self.zero()?;
        self.data_types()?;
        self.communication_data_type()?;
        self.simple(
            "prescale_gradients",
            "train.prescale_gradients",
            false,
            boolean,
        )?;
        self.simple(
            "gradient_predivide_factor",
            "train.gradient_predivide_factor",
            false,
            positive,
        )?;
        self.aio()?;
        self.monitor("tensorboard")?;
        self.monitor("csv_monitor")?;
        self.flops_profiler()?;
        self.comms_logger()?;
        self.curriculum()?;
        self.layer_drop()?;
        if self.get("activation_checkpointing").is_some() {
            self.sort_keys("activation_checkpointing", ACTIVATION_CHECKPOINTING)?;
            self.map(
                "train.activation_checkpointing",
                MappedValue::Set(json!(true)),
                "activation_checkpointing",
                Origin::Written,
            );
        }
        Ok(())
    }

    /// The batch keys: `train_batch_size` (checked later against the world
    /// size), the micro-batch and the accumulation.
    fn batch(&mut self) -> Result<(), ConfigError> {
        if let Some(v) = self.get("train_batch_size").cloned() {
            if !is_auto(&v) {
                let n = count(&v).map_err(|m| self.error("train_batch_size", m))?;
                if n == 0 {
                    return Err(self.error("train_batch_size", "must be at least 1"));
                }
                self.out.train_batch_size = Some((n, self.at("train_batch_size")));
            }
        }
        self.simple(
            "train_micro_batch_size_per_gpu",
            "train.micro_batch_size",
            true,
            positive_count,
        )?;
        self.simple(
            "gradient_accumulation_steps",
            "train.grad_accum",
            true,
            positive_count,
        )?;
        Ok(())
    }

    /// `elasticity` ([`crate::elastic`]), read and checked as DeepSpeed's
    /// `ElasticityConfig` does; whether it is enabled.
    fn elasticity(&mut self) -> Result<bool, ConfigError> {
        const E: &str = "elasticity";
        const KEYS: &[(&str, Kind)] = &[
            ("enabled", Kind::Section),
            ("max_train_batch_size", Kind::Section),
            ("micro_batch_sizes", Kind::Section),
            ("min_gpus", Kind::Section),
            ("max_gpus", Kind::Section),
            ("version", Kind::Section),
            ("prefer_larger_batch", Kind::Section),
            ("ignore_non_elastic_batch_info", Kind::Section),
            ("num_gpus_per_node", Kind::Section),
            // For a scheduler choosing when to scale: nothing in a run.
            ("min_time", Kind::Ignored),
            (
                "model_parallel_size",
                Kind::Only(&[Accept::Num(1.0)], "model parallelism"),
            ),
        ];
        if self.get(E).is_none_or(Value::is_null) {
            return Ok(false);
        }
        self.sort_keys(E, KEYS)?;
        let key = |k: &str| join(E, k);
        let flag = |r: &Self, k: &str, default: bool| -> Result<bool, ConfigError> {
            match r.get(&key(k)) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| r.error(&key(k), format!("{v}: must be true or false"))),
            }
        };
        if !flag(self, "enabled", false)? {
            self.out.ignored.push((E.to_string(), self.at(E).0));
            return Ok(false);
        }
        let number = |r: &Self, k: &str, default: Option<u64>| -> Result<u64, ConfigError> {
            match r.get(&key(k)) {
                None | Some(Value::Null) => default.ok_or_else(|| {
                    r.error(
                        E,
                        format!("needs `{k}` (DeepSpeed's elasticity has no default for it)"),
                    )
                }),
                Some(v) => match count(v) {
                    Ok(0) | Err(_) => Err(r.error(
                        &key(k),
                        format!("{v}: must be a whole number of at least 1"),
                    )),
                    Ok(n) => Ok(n),
                },
            }
        };
        let max_train_batch_size = number(self, "max_train_batch_size", None)?;
        let micro_batch_sizes = match self.get(&key("micro_batch_sizes")) {
            None | Some(Value::Null) => {
                return Err(self.error(
                    E,
                    "needs `micro_batch_sizes` (DeepSpeed's elasticity has no default for it)",
                ))
            }
            Some(Value::Array(a)) if !a.is_empty() => a
                .iter()
                .map(|v| v.as_u64().filter(|&n| n > 0))
                .collect::<Option<Vec<u64>>>(),
            Some(_) => None,
        }
        .ok_or_else(|| {
            self.error(
                &key("micro_batch_sizes"),
                "must be a list of whole numbers of at least 1",
            )
        })?;
        let min_gpus = number(self, "min_gpus", Some(1))?;
        let max_gpus = number(self, "max_gpus", Some(10000))?;
        if max_gpus < min_gpus {
            return Err(self.error(
                &key("max_gpus"),
                format!("{max_gpus} is below min_gpus {min_gpus}"),
            ));
        }
        let version = match self.get(&key("version")) {
            None | Some(Value::Null) => Some(ElasticVersion::V02),
            Some(v) => match v
                .as_f64()
                .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            {
                Some(0.1) => Some(ElasticVersion::V01),
                Some(0.2) => Some(ElasticVersion::V02),
                _ => None,
            },
        }
        .ok_or_else(|| {
            let v = self.get(&key("version")).cloned().unwrap_or_default();
            self.error(
                &key("version"),
                format!("{v}: DeepSpeed's elasticity has versions 0.1 and 0.2"),
            )
        })?;
        let num_gpus_per_node = number(self, "num_gpus_per_node", Some(1))?;
        // DeepSpeed's check: no micro-batch above the batch it may reach
        // (version 0.2 counts nodes, whose batch is a node's share).
        let reach = match version {
            ElasticVersion::V01 => max_train_batch_size,
            ElasticVersion::V02 => max_train_batch_size / num_gpus_per_node,
        };
        if let Some(m) = micro_batch_sizes.iter().find(|&&m| m > reach) {
            return Err(self.error(
                &key("micro_batch_sizes"),
                format!("{m} is above the largest batch, {reach} (max_train_batch_size, a node's share under version 0.2)"),
            ));
        }
        if !flag(self, "ignore_non_elastic_batch_info", false)? {
            if let Some(k) = BATCH_KEYS.iter().find(|k| self.get(k).is_some()) {
                return Err(self.error(
                    k,
                    "elasticity sets the batch, so this key would not be used (DeepSpeed refuses it too): leave it out, or set elasticity.ignore_non_elastic_batch_info: true",
                ));
            }
        }
        let prefer_larger = flag(self, "prefer_larger_batch", true)?;
        self.out.elasticity = Some((
            Elasticity {
                max_train_batch_size,
                micro_batch_sizes,
                min_gpus,
                max_gpus,
                version,
                prefer_larger,
                num_gpus_per_node,
            },
            self.at(E),
        ));
        Ok(true)
    }

    fn optimizer(&mut self) -> Result<(), ConfigError> {
        if self.get("optimizer").is_none_or(Value::is_null) {
            return Ok(());
        }
        self.sort_keys("optimizer", OPTIMIZER)?;
        let kind = match self.get("optimizer.type") {
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(self.error("optimizer.type", "must be a string")),
            None => {
                return Err(self.error(
                    "optimizer",
                    "needs a `type` (Adam, AdamW, Lion, Lamb or Adagrad)",
                ))
            }
        };
        // DeepSpeed reads the type case-blind; Adam is AdamW unless
        // adam_w_mode is false (then PyTorch's Adam: L2 decay added to the
        // gradient); AdamW is AdamW whatever adam_w_mode says.
        let lower = kind.to_ascii_lowercase();
        let (rule, params) = match lower.as_str() {
            "lion" => ("lion", LION_PARAMS),
            "lamb" => ("lamb", LAMB_PARAMS),
            "adagrad" => ("adagrad", ADAGRAD_PARAMS),
            "adam" | "adamw" | "fusedadam" | "cpuadam" => ("adamw", ADAM_PARAMS),
            _ => return Err(self.error(
                "optimizer.type",
                format!("`{kind}` cannot be honoured: zrun trains with AdamW (decoupled weight decay), Adam (L2 decay), Lion, LAMB or Adagrad; use Adam, AdamW, Lion, Lamb or Adagrad"),
            )),
        };
        self.sort_keys("optimizer.params", params)?;
        let l2 = match self.get("optimizer.params.adam_w_mode").cloned() {
            Some(m) => {
                let Some(m) = m.as_bool() else {
                    return Err(self.error("optimizer.params.adam_w_mode", "must be true or false"));
                };
                !m && lower != "adamw"
            }
            None => false,
        };
        let rule = if l2 { "adam" } else { rule };
        let (lion, adagrad) = (rule == "lion", rule == "adagrad");
        self.map(
            "train.optimizer.type",
            MappedValue::Set(json!(rule)),
            "optimizer.type",
            Origin::Written,
        );
        for (source, key, default, convert) in [
            (
                "optimizer.params.lr",
                "train.lr",
                json!(1e-3),
                positive as fn(&Value) -> Result<Value, String>,
            ),
            (
                "optimizer.params.betas",
                "train.optimizer.betas",
                json!([0.9, 0.999]),
                betas,
            ),
            (
                "optimizer.params.eps",
                "train.optimizer.eps",
                json!(1e-8),
                positive,
            ),
            (
                "optimizer.params.weight_decay",
                "train.weight_decay",
                json!(0.0),
                non_negative,
            ),
        ] {
            // Lion has no eps, Adagrad no betas; Adagrad's rate and eps
            // default to PyTorch's Adagrad's.
            let default = match (key, lion, adagrad) {
                ("train.optimizer.eps", true, _) | ("train.optimizer.betas", _, true) => continue,
                ("train.lr", _, true) => json!(1e-2),
                ("train.optimizer.eps", _, true) => json!(1e-10),
                _ => default,
            };
            if !self.simple(source, key, true, convert)? {
                self.map(key, MappedValue::Set(default), source, Origin::Default);
            }
        }
        if adagrad {
            for (source, key) in [
                ("optimizer.params.lr_decay", "train.optimizer.lr_decay"),
                (
                    "optimizer.params.initial_accumulator_value",
                    "train.optimizer.initial_accumulator_value",
                ),
            ] {
                if !self.simple(source, key, false, non_negative)? {
                    self.map(key, MappedValue::Set(json!(0.0)), source, Origin::Default);
                }
            }
        }
        // FusedAdam's, CPU Adam's and FusedLamb's; on by default there as
        // in zrun.
        if !lion && !adagrad {
            self.simple(
                "optimizer.params.bias_correction",
                "train.optimizer.bias_correction",
                false,
                boolean,
            )?;
        }
        if rule == "lamb" {
            for (source, key, default) in [
                (
                    "optimizer.params.min_coeff",
                    "train.optimizer.min_coeff",
                    0.01,
                ),
                (
                    "optimizer.params.max_coeff",
                    "train.optimizer.max_coeff",
                    10.0,
                ),
            ] {
                if !self.simple(source, key, false, positive)? {
                    self.map(
                        key,
                        MappedValue::Set(json!(default)),
                        source,
                        Origin::Default,
                    );
                }
            }
        }
        Ok(())
    }

    fn scheduler(&mut self) -> Result<(), ConfigError> {
        if self.get("scheduler").is_none_or(Value::is_null) {
            return Ok(());
        }
        self.sort_keys("scheduler", SCHEDULER)?;
        let kind = match self.get("scheduler.type") {
            Some(Value::String(s)) => s.clone(),
            _ => return Err(self.error(
                "scheduler.type",
                "needs a type: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest",
            )),
        };
        match kind.as_str() {
            "OneCycle" => return self.one_cycle(),
            "LRRangeTest" => return self.lr_range_test(),
            _ => {}
        }
        const WARMUP: [Param; 3] = [
            ("warmup_min_lr", 0.0),
            ("warmup_max_lr", 0.001),
            ("warmup_num_steps", 1000.0),
        ];
        const COSINE: [Param; 3] = [
            ("warmup_min_ratio", 0.0),
            ("cos_min_ratio", 0.0001),
            ("warmup_num_steps", 1000.0),
        ];
        let (schedule, params, steps): (&str, &[Param], bool) = match kind.as_str() {
            "WarmupLR" => ("constant", &WARMUP, false),
            "WarmupDecayLR" => ("linear", &WARMUP, true),
            "WarmupCosineLR" => ("cosine", &COSINE, true),
            other => {
                return Err(self.error(
                    "scheduler.type",
                    format!("`{other}` cannot be honoured: zrun's schedules are DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle and LRRangeTest"),
                ))
            }
        };
        let mut known: Vec<(&str, Kind)> =
            params.iter().map(|(n, _)| (*n, Kind::Section)).collect();
        known.push(("warmup_type", Kind::Section));
        known.push(("last_batch_iteration", Kind::Ignored));
        if steps {
            known.push(("total_num_steps", Kind::Section));
        }
        self.sort_keys("scheduler.params", &known)?;
        self.map(
            "train.schedule",
            MappedValue::Set(json!(schedule)),
            "scheduler.type",
            Origin::Written,
        );
        let base = "scheduler.params";
        for (name, default) in params {
            let source = format!("{base}.{name}");
            let v = self.get(&source).cloned();
            let (origin, number) = match &v {
                None | Some(Value::Null) => (Origin::Default, Some(*default)),
                Some(v) if is_auto(v) => (Origin::Auto, None),
                Some(v) => {
                    let n = v
                        .as_f64()
                        .filter(|n| n.is_finite() && *n >= 0.0)
                        .ok_or_else(|| self.error(&source, "must be a non-negative number"))?;
                    (Origin::Written, Some(n))
                }
            };
            let targets: &[&'static str] = match *name {
                "warmup_num_steps" => &["train.warmup_steps"],
                "warmup_max_lr" => &["train.lr"],
                // Warmup starts there and the linear decay ends there.
                "warmup_min_lr" if schedule == "linear" => {
                    &["train.warmup_start_lr", "train.min_lr"]
                }
                "warmup_min_lr" => &["train.warmup_start_lr"],
                "warmup_min_ratio" => &["train.warmup_start_lr"],
                _ => &["train.min_lr"],
            };
            for &key in targets {
                let value = match (number, *name) {
                    (None, _) => MappedValue::Job,
                    (Some(n), "warmup_min_ratio" | "cos_min_ratio") => MappedValue::TimesLr(n),
                    // A count past u64 was saturated to u64::MAX until the
                    // seventieth session; it is refused as any count is.
                    (Some(n), "warmup_num_steps") => match count(&json!(n)) {
                        Ok(steps) => MappedValue::Set(json!(steps)),
                        Err(_) => {
                            return Err(self.error(&source, "must be a whole number of steps"))
                        }
                    },
                    (Some(n), _) => MappedValue::Set(json!(n)),
                };
                self.map(key, value, &source, origin);
            }
            if *name == "warmup_max_lr" {
                self.note_superseded_lr("warmup_max_lr");
            }
        }
        match self.get(&format!("{base}.warmup_type")).cloned() {
            None | Some(Value::Null) => self.map(
                "train.warmup_type",
                MappedValue::Set(json!("log")),
                &format!("{base}.warmup_type"),
                Origin::Default,
            ),
            Some(Value::String(t)) if t == "log" || t == "linear" => self.map(
                "train.warmup_type",
                MappedValue::Set(json!(t)),
                &format!("{base}.warmup_type"),
                Origin::Written,
            ),
            Some(v) => {
                return Err(self.error(
                    &format!("{base}.warmup_type"),
                    format!("{v}: must be \"log\" or \"linear\""),
                ))
            }
        }
        if steps {
            let source = format!("{base}.total_num_steps");
            if !self.simple(&source, "train.steps", true, positive_count)? {
                // Required by DeepSpeed; the job's steps are the natural reading.
                self.map("train.steps", MappedValue::Job, &source, Origin::Auto);
            }
        }
        Ok(())
    }

    /// `OneCycle`: its two rates are `train.min_lr` and `train.lr`
    /// (required, as DeepSpeed's constructor requires them), the rest
    /// `train.one_cycle`'s keys of the same names. Its stair counts are
    /// accepted and ignored, as DeepSpeed ignores them; with
    /// `cycle_momentum` (its default) DeepSpeed sets Adam's betas to
    /// (momentum, 0.99), so β2 becomes 0.99 here too.
    fn one_cycle(&mut self) -> Result<(), ConfigError> {
        const SHAPE: &[(&str, &str, Converter)] = &[
            (
                "cycle_first_step_size",
                "train.one_cycle.cycle_first_step_size",
                positive_count,
            ),
            (
                "cycle_second_step_size",
                "train.one_cycle.cycle_second_step_size",
                positive_count,
            ),
            (
                "decay_step_size",
                "train.one_cycle.decay_step_size",
                count_value,
            ),
            (
                "decay_lr_rate",
                "train.one_cycle.decay_lr_rate",
                non_negative,
            ),
            ("cycle_momentum", "train.one_cycle.cycle_momentum", boolean),
            (
                "cycle_min_mom",
                "train.one_cycle.cycle_min_mom",
                non_negative,
            ),
            (
                "cycle_max_mom",
                "train.one_cycle.cycle_max_mom",
                non_negative,
            ),
            (
                "decay_mom_rate",
                "train.one_cycle.decay_mom_rate",
                non_negative,
            ),
        ];
        let ignored = ["cycle_first_stair_count", "cycle_second_stair_count"];
        self.scheduler_params(
            "one_cycle",
            &["cycle_min_lr", "cycle_max_lr"],
            &ignored,
            SHAPE,
        )?;
        for (name, key) in [
            ("cycle_min_lr", "train.min_lr"),
            ("cycle_max_lr", "train.lr"),
        ] {
            let source = format!("scheduler.params.{name}");
            if !self.simple(&source, key, true, non_negative)? {
                return Err(self.error(
                    &source,
                    "DeepSpeed's OneCycle needs it (cycle_min_lr and cycle_max_lr have no default)",
                ));
            }
        }
        self.note_superseded_lr("cycle_max_lr");
        let cycles = match self.get("scheduler.params.cycle_momentum") {
            Some(Value::Bool(b)) => *b,
            _ => true,
        };
        let adagrad = self
            .get("optimizer.type")
            .and_then(Value::as_str)
            .is_some_and(|t| t.eq_ignore_ascii_case("adagrad"));
        if cycles && adagrad {
            self.out.notes.push(
                "scheduler OneCycle's momentum cycle does nothing to Adagrad, which keeps no momentum (DeepSpeed's OneCycle turns it off for an optimizer without betas)".into(),
            );
        } else if cycles {
            let beta1 = match self.get("scheduler.params.cycle_min_mom") {
                Some(v) => v.clone(),
                None => json!(0.8),
            };
            self.map(
                "train.optimizer.betas",
                MappedValue::Set(json!([beta1, 0.99])),
                "scheduler.params.cycle_momentum",
                Origin::Default,
            );
            self.out.notes.push(
                "scheduler OneCycle cycles Adam's beta1 and sets its beta2 to 0.99, as DeepSpeed's OneCycle does".into(),
            );
        }
        Ok(())
    }

    /// `LRRangeTest`: its starting rate is `train.lr` (DeepSpeed's default
    /// 1e-3 where unwritten), its growth `train.lr_range_test`.
    fn lr_range_test(&mut self) -> Result<(), ConfigError> {
        const GROWTH: &[(&str, &str, Converter)] = &[
            (
                "lr_range_test_step_size",
                "train.lr_range_test.step_size",
                positive_count,
            ),
            (
                "lr_range_test_step_rate",
                "train.lr_range_test.step_rate",
                non_negative,
            ),
            (
                "lr_range_test_staircase",
                "train.lr_range_test.staircase",
                boolean,
            ),
        ];
        let rate = "lr_range_test_min_lr";
        self.scheduler_params("lr_range_test", &[rate], &[], GROWTH)?;
        let source = format!("scheduler.params.{rate}");
        if !self.simple(&source, "train.lr", true, non_negative)? {
            self.map(
                "train.lr",
                MappedValue::Set(json!(1e-3)),
                &source,
                Origin::Default,
            );
        }
        self.note_superseded_lr(rate);
        Ok(())
    }

    /// A scheduler whose parameters map to its own section of `train`:
    /// checks `scheduler.params` (its `rates`, which the caller maps, the
    /// `ignored` ones, and `table`'s), sets `train.schedule`, and maps each
    /// `(DeepSpeed name, zrun key, converter)` of `table` written.
    fn scheduler_params(
        &mut self,
        schedule: &'static str,
        rates: &[&str],
        ignored: &[&str],
        table: &[(&str, &'static str, Converter)],
    ) -> Result<(), ConfigError> {
        let mut known: Vec<(&str, Kind)> = rates.iter().map(|r| (*r, Kind::Section)).collect();
        known.extend(ignored.iter().map(|n| (*n, Kind::Ignored)));
        known.push(("last_batch_iteration", Kind::Ignored));
        known.extend(table.iter().map(|(n, _, _)| (*n, Kind::Section)));
        self.sort_keys("scheduler.params", &known)?;
        self.map(
            "train.schedule",
            MappedValue::Set(json!(schedule)),
            "scheduler.type",
            Origin::Written,
        );
        for (name, key, convert) in table {
            self.simple(&format!("scheduler.params.{name}"), key, false, *convert)?;
        }
        Ok(())
    }

    /// The note that `scheduler.params.<rate>` supersedes a written
    /// `optimizer.params.lr`, as DeepSpeed's scheduler does.
    fn note_superseded_lr(&mut self, rate: &str) {
        if let Some(lr) = self.get("optimizer.params.lr").filter(|v| !is_auto(v)) {
            self.out.notes.push(format!(
                "optimizer.params.lr ({lr}) is superseded by scheduler.params.{rate}, as in DeepSpeed, where the scheduler sets the rate"
            ));
        }
    }

    fn precision(&mut self) -> Result<(), ConfigError> {
        self.sort_keys("fp16", FP16)?;
        let bf16_key = if self.get("bfloat16").is_some() {
            "bfloat16"
        } else {
            "bf16"
        };
        self.sort_keys(bf16_key, BF16)?;
        let fp16 = self.enabled("fp16.enabled")?;
        let bf16 = self.enabled(&format!("{bf16_key}.enabled"))?;
        match (fp16, bf16) {
            (Some(true), Some(true)) => {
                return Err(self.error("bf16.enabled", "fp16 and bf16 are both enabled: pick one"))
            }
            (Some(true), _) => self.map(
                "train.dtype",
                MappedValue::Set(json!("f16")),
                "fp16.enabled",
                Origin::Written,
            ),
            (_, Some(true)) => self.map(
                "train.dtype",
                MappedValue::Set(json!("bf16")),
                &format!("{bf16_key}.enabled"),
                Origin::Written,
            ),
            (Some(false), None | Some(false)) => self.map(
                "train.dtype",
                MappedValue::Set(json!("f32")),
                "fp16.enabled",
                Origin::Written,
            ),
            (None, Some(false)) => self.map(
                "train.dtype",
                MappedValue::Set(json!("f32")),
                &format!("{bf16_key}.enabled"),
                Origin::Written,
            ),
            // Absent or "auto": the job's dtype.
            (None, None) => {}
        }
        // 0 is dynamic scaling; above it, a static scale.
        if let Some(scale) = self.get("fp16.loss_scale").cloned() {
            match scale.as_f64() {
                Some(0.0) => {}
                Some(_) => {
                    self.simple(
                        "fp16.loss_scale",
                        "train.loss_scale.static_scale",
                        false,
                        positive,
                    )?;
                }
                None => {
                    return Err(self.error("fp16.loss_scale", format!("{scale}: must be a number")))
                }
            }
        }
        self.simple(
            "fp16.initial_scale_power",
            "train.loss_scale.initial_scale_power",
            false,
            count_value,
        )?;
        self.simple(
            "fp16.loss_scale_window",
            "train.loss_scale.loss_scale_window",
            false,
            count_value,
        )?;
        self.simple(
            "fp16.hysteresis",
            "train.loss_scale.hysteresis",
            false,
            count_value,
        )?;
        self.simple(
            "fp16.min_loss_scale",
            "train.loss_scale.min_loss_scale",
            false,
            positive,
        )?;
        Ok(())
    }

    /// The legacy `curriculum_learning` section into `train.curriculum`
    /// (its `schedule_config`'s keys beside the others): only with
    /// `enabled: true` (DeepSpeed's default is off, and an off section is
    /// listed as ignored), only on the sequence length, and only the fixed
    /// schedules (`custom` is a Python function).
    fn curriculum(&mut self) -> Result<(), ConfigError> {
        const SECTION: &str = "curriculum_learning";
        if self.get(SECTION).is_none_or(Value::is_null) {
            return Ok(());
        }
        self.sort_keys(SECTION, CURRICULUM)?;
        if self.enabled("curriculum_learning.enabled")? != Some(true) {
            self.out
                .ignored
                .push((SECTION.to_string(), self.at(SECTION).0));
            return Ok(());
        }
        match self.get("curriculum_learning.curriculum_type") {
            Some(Value::String(t)) if t == "seqlen" => {}
            Some(t) => {
                return Err(self.error(
                    "curriculum_learning.curriculum_type",
                    format!("{t}: zrun's curriculum is on the sequence length: \"seqlen\""),
                ))
            }
            None => return Err(self.error(
                SECTION,
                "needs curriculum_type: \"seqlen\" (zrun's curriculum is on the sequence length)",
            )),
        }
        self.sort_keys("curriculum_learning.schedule_config", CURRICULUM_SCHEDULE)?;
        let keys: [(&str, &'static str, Converter); 8] = [
            (
                "min_difficulty",
                "train.curriculum.min_difficulty",
                positive_count,
            ),
            (
                "max_difficulty",
                "train.curriculum.max_difficulty",
                positive_count,
            ),
            (
                "schedule_type",
                "train.curriculum.schedule_type",
                curriculum_schedule,
            ),
            (
                "schedule_config.total_curriculum_step",
                "train.curriculum.total_curriculum_step",
                positive_count,
            ),
            (
                "schedule_config.difficulty_step",
                "train.curriculum.difficulty_step",
                positive_count,
            ),
            (
                "schedule_config.root_degree",
                "train.curriculum.root_degree",
                positive,
            ),
            (
                "schedule_config.difficulty",
                "train.curriculum.difficulty",
                counts,
            ),
            (
                "schedule_config.max_step",
                "train.curriculum.max_step",
                counts,
            ),
        ];
        for (name, key, convert) in keys {
            let source = format!("{SECTION}.{name}");
            let written = self.simple(&source, key, false, convert)?;
            if !written && ["min_difficulty", "max_difficulty", "schedule_type"].contains(&name) {
                return Err(self.error(SECTION, format!("needs {name}, as DeepSpeed's does")));
            }
        }
        Ok(())
    }

    /// `progressive_layer_drop` into `train.progressive_layer_drop`, only
    /// with `enabled: true` (DeepSpeed's default is off; an off section is
    /// listed as ignored); `theta` and `gamma` take DeepSpeed's defaults,
    /// 1.0 (no block skipped) and 0.001, where omitted.
    fn layer_drop(&mut self) -> Result<(), ConfigError> {
        const SECTION: &str = "progressive_layer_drop";
        if self.get(SECTION).is_none_or(Value::is_null) {
            return Ok(());
        }
        self.sort_keys(SECTION, LAYER_DROP)?;
        if self.enabled("progressive_layer_drop.enabled")? != Some(true) {
            self.out
                .ignored
                .push((SECTION.to_string(), self.at(SECTION).0));
            return Ok(());
        }
        for (name, key, convert, default) in [
            (
                "theta",
                "train.progressive_layer_drop.theta",
                positive as Converter,
                1.0,
            ),
            (
                "gamma",
                "train.progressive_layer_drop.gamma",
                non_negative,
                crate::layer_drop::default_gamma(),
            ),
        ] {
            let source = format!("{SECTION}.{name}");
            if !self.simple(&source, key, false, convert)? {
                self.map(
                    key,
                    MappedValue::Set(json!(default)),
                    SECTION,
                    Origin::Default,
                );
            }
        }
        Ok(())
    }

    /// An `enabled` flag: Some(bool) when written, None when absent or "auto".
    fn enabled(&self, path: &str) -> Result<Option<bool>, ConfigError> {
        match self.get(path) {
            None | Some(Value::Null) => Ok(None),
            Some(v) if is_auto(v) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.error(path, format!("{v}: must be true, false or \"auto\""))),
        }
    }

    /// `data_types.grad_accum_dtype`. Where it is absent and the file says
    /// bf16 without ZeRO (stage 0), DeepSpeed's `BF16_Optimizer` sums
    /// gradients in fp32 where zrun's default sums them in bf16: a note says
    /// so, and how to ask for f32 (not implied: zrun's default stays the
    /// working type).
    /// `communication_data_type`: `train.reduce_dtype`. Where it is absent
    /// under bf16 or fp16, DeepSpeed reduces in the working type and zrun
    /// in f32: a note names the key that does the same.
    fn communication_data_type(&mut self) -> Result<(), ConfigError> {
        let key = "train.reduce_dtype";
        if self.simple("communication_data_type", key, false, dtype_name)? {
            return Ok(());
        }
        let dtype = match self.out.source_of("train.dtype") {
            Some(Mapped {
                value: MappedValue::Set(v),
                ..
            }) => v.as_str().map(str::to_string),
            _ => None,
        };
        if let Some(d @ ("bf16" | "f16")) = dtype.as_deref() {
            let ds = if d == "bf16" { "bf16" } else { "fp16" };
            self.out.notes.push(format!(
                "{d}: DeepSpeed reduces gradients in {ds} here (communication_data_type defaults to the working type), zrun in f32 unless communication_data_type is \"{ds}\" ({key}: {d}, half the bytes)"
            ));
        }
        Ok(())
    }

    fn data_types(&mut self) -> Result<(), ConfigError> {
        self.sort_keys("data_types", DATA_TYPES)?;
        let key = "train.grad_accum_dtype";
        if self.simple("data_types.grad_accum_dtype", key, false, dtype_name)? {
            return Ok(());
        }
        let set = |key: &str| match self.out.source_of(key) {
            Some(Mapped {
                value: MappedValue::Set(v),
                ..
            }) => Some(v.clone()),
            _ => None,
        };
        if set("train.dtype") == Some(json!("bf16")) && set("zero.stage") == Some(json!(0)) {
            self.out.notes.push(
                "bf16 at ZeRO stage 0: DeepSpeed's BF16_Optimizer sums gradients in fp32 here, zrun in bf16 unless data_types.grad_accum_dtype is \"fp32\" (train.grad_accum_dtype: f32)".into(),
            );
        }
        Ok(())
    }

    /// `tensor_parallel` (AutoTP training): ignored where it splits the
    /// model over one device (`autotp_size` 0, off, or 1; `tp_size` 1),
    /// which is the data parallelism zrun trains with; refused otherwise.
    fn tensor_parallel(&mut self) -> Result<(), ConfigError> {
        let tp = "tensor_parallel";
        match self.get(tp) {
            None | Some(Value::Null) => return Ok(()),
            Some(Value::Object(_)) => {}
            Some(_) => return Err(self.error(tp, "must be a JSON object")),
        }
        for (size, off) in [
            ("autotp_size", &[0.0, 1.0][..]),
            ("tp.tp_size", &[1.0][..]),
            ("tensor_parallel.tp_size", &[1.0][..]),
        ] {
            let path = format!("{tp}.{size}");
            if let Some(v) = self.get(&path) {
                if !v.as_f64().is_some_and(|n| off.contains(&n)) {
                    return Err(self.error(
                        &path,
                        format!("{v}: tensor parallelism is not something zrun does (it trains data parallel): write 1 or remove the key"),
                    ));
                }
            }
        }
        self.out.ignored.push((tp.to_string(), self.at(tp).0));
        Ok(())
    }

    fn zero(&mut self) -> Result<(), ConfigError> {
        let z = "zero_optimization";
        // The old spelling: `"zero_optimization": true` is stage 1.
        if let Some(on) = self.get(z).and_then(Value::as_bool) {
            self.map(
                "zero.stage",
                MappedValue::Set(json!(u8::from(on))),
                z,
                Origin::Written,
            );
            return Ok(());
        }
        self.sort_keys(z, ZERO)?;
        self.simple(
            "zero_optimization.stage",
            "zero.stage",
            false,
            |v| match v.as_u64() {
                Some(n @ 0..=3) => Ok(json!(n)),
                _ => Err(format!("{v}: must be 0, 1, 2 or 3")),
            },
        )?;
        self.simple(
            "zero_optimization.overlap_comm",
            "zero.overlap_comm",
            false,
            boolean,
        )?;
        let d = self.d_model as f64;
        for (stage3, field) in [
            ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
            (
                "stage3_param_persistence_threshold",
                "param_persistence_threshold",
            ),
        ] {
            let (a, b) = (format!("{z}.{stage3}"), format!("{z}.{field}"));
            if self.get(&a).is_some() && self.get(&b).is_some() {
                return Err(self.error(
                    &b,
                    format!("`{stage3}` says the same: write one of the two"),
                ));
            }
        }
        for (source, key, auto) in [
            ("reduce_bucket_size", "zero.reduce_bucket_size", d * d),
            (
                "stage3_prefetch_bucket_size",
                "zero.prefetch_bucket_size",
                0.9 * d * d,
            ),
            (
                "stage3_param_persistence_threshold",
                "zero.param_persistence_threshold",
                10.0 * d,
            ),
            // Hugging Face fills `"auto"` for the stage3_ spellings only.
            (
                "prefetch_bucket_size",
                "zero.prefetch_bucket_size",
                f64::NAN,
            ),
            (
                "param_persistence_threshold",
                "zero.param_persistence_threshold",
                f64::NAN,
            ),
            ("sub_group_size", "zero.sub_group_size", f64::NAN),
        ] {
            let source = format!("{z}.{source}");
            match self.get(&source).cloned() {
                None | Some(Value::Null) => {}
                Some(v) if is_auto(&v) && !auto.is_nan() => {
                    // Hugging Face's formulas from the hidden size.
                    self.map(
                        key,
                        MappedValue::Set(json!(auto as u64)),
                        &source,
                        Origin::Auto,
                    );
                }
                Some(_) => {
                    self.simple(&source, key, false, count_value)?;
                }
            }
        }
        for (part, [device, nvme_path, buffer_count]) in [
            (
                "offload_optimizer",
                [
                    "zero.offload_optimizer.device",
                    "zero.offload_optimizer.nvme_path",
                    "zero.offload_optimizer.buffer_count",
                ],
            ),
            (
                "offload_param",
                [
                    "zero.offload_param.device",
                    "zero.offload_param.nvme_path",
                    "zero.offload_param.buffer_count",
                ],
            ),
        ] {
            let source = format!("{z}.{part}");
            if self.get(&source).is_none_or(Value::is_null) {
                continue;
            }
            self.sort_keys(&source, OFFLOAD)?;
            self.simple(&format!("{source}.device"), device, false, |v| {
                match v.as_str() {
                    Some("none" | "cpu" | "nvme") => Ok(v.clone()),
                    _ => Err(format!("{v}: must be \"none\", \"cpu\" or \"nvme\"")),
                }
            })?;
            self.simple(&format!("{source}.nvme_path"), nvme_path, false, |v| {
                v.as_str()
                    .map(|s| json!(s))
                    .ok_or_else(|| "must be a path".to_string())
            })?;
            self.simple(
                &format!("{source}.buffer_count"),
                buffer_count,
                false,
                positive_count,
            )?;
        }
        self.simple(
            "zero_optimization.zero_quantized_weights",
            "zero.quantized_weights",
            false,
            boolean,
        )?;
        self.simple(
            "zero_optimization.zero_hpz_partition_size",
            "zero.hpz_partition_size",
            false,
            positive_count,
        )?;
        self.simple(
            "zero_optimization.zero_quantized_gradients",
            "zero.quantized_gradients",
            false,
            boolean,
        )?;
        self.loco()
    }

    /// `zeropp_loco_param: {err_beta, reset_T}` (LoCo for qgZ), both
    /// needed as DeepSpeed reads both; null is off.
    fn loco(&mut self) -> Result<(), ConfigError> {
        const SECTION: &str = "zero_optimization.zeropp_loco_param";
        const KEYS: &[(&str, Kind)] = &[("err_beta", Kind::Section), ("reset_T", Kind::Section)];
        if self.get(SECTION).is_none_or(Value::is_null) {
            return Ok(());
        }
        self.sort_keys(SECTION, KEYS)?;
        for (key, _) in KEYS {
            if self.get(&join(SECTION, key)).is_none_or(Value::is_null) {
                return Err(self.error(
                    SECTION,
                    format!("needs `{key}` (DeepSpeed reads both err_beta and reset_T)"),
                ));
            }
        }
        let beta = |v: &Value| match v.as_f64() {
            Some(b) if (0.0..1.0).contains(&b) => Ok(json!(b)),
            _ => Err(format!("{v}: must be a number at least 0 and below 1")),
        };
        self.simple(
            &join(SECTION, "err_beta"),
            "zero.loco.err_beta",
            false,
            beta,
        )?;
        self.simple(
            &join(SECTION, "reset_T"),
            "zero.loco.reset_t",
            false,
            positive_count,
        )?;
        Ok(())
    }

    /// `flops_profiler`, when enabled: the job's `flops_profiler` with the
    /// section's keys (DeepSpeed's defaults for those missing).
    /// `recompute_fwd_factor` scales DeepSpeed's backward FLOPs for the
    /// forward that checkpointing recomputes, which zrun times apart.
    fn flops_profiler(&mut self) -> Result<(), ConfigError> {
        const KEYS: &[(&str, Kind)] = &[
            ("enabled", Kind::Section),
            ("profile_step", Kind::Section),
            ("module_depth", Kind::Section),
            ("top_modules", Kind::Section),
            ("detailed", Kind::Section),
            ("output_file", Kind::Section),
            ("recompute_fwd_factor", Kind::Ignored),
        ];
        const SECTION: &str = "flops_profiler";
        if !self.enabled_section(SECTION, KEYS)? {
            return Ok(());
        }
        self.set_section(
            SECTION,
            &[
                ("profile_step", positive_count),
                ("module_depth", depth),
                ("top_modules", positive_count),
                ("detailed", boolean),
                ("output_file", file_name),
            ],
        )
    }

    /// Sorts `section`'s keys by `keys`, and says whether it is there and
    /// enabled.
    fn enabled_section(
        &mut self,
        section: &str,
        keys: &[(&str, Kind)],
    ) -> Result<bool, ConfigError> {
        if self.get(section).is_none() {
            return Ok(false);
        }
        self.sort_keys(section, keys)?;
        Ok(self.enabled(&format!("{section}.enabled"))? == Some(true))
    }

    /// Sets the job's key `section` to the section's keys that
    /// `converters` name, each converted (those missing or null left to
    /// the job's defaults).
    fn set_section(
        &mut self,
        section: &'static str,
        converters: &[(&str, Converter)],
    ) -> Result<(), ConfigError> {
        let mut out = serde_json::Map::new();
        for (key, convert) in converters {
            let path = format!("{section}.{key}");
            match self.get(&path) {
                None | Some(Value::Null) => {}
                Some(v) => {
                    let v = convert(v).map_err(|m| self.error(&path, m))?;
                    out.insert((*key).into(), v);
                }
            }
        }
        self.map(
            section,
            MappedValue::Set(Value::Object(out)),
            section,
            Origin::Written,
        );
        Ok(())
    }

    /// `comms_logger`, when enabled: the job's `comms_logger`, its
    /// `prof_ops` in zrun's names (DeepSpeed's `all_gather_into_tensor`,
    /// `reduce_scatter_tensor`, `all_to_all_single` and
    /// `all_reduce_coalesced` name the collectives zrun runs in their
    /// place). `verbose` (a line for every collective) and `debug` (the
    /// caller's name in each record) are ignored: zrun writes the table.
    fn comms_logger(&mut self) -> Result<(), ConfigError> {
        const KEYS: &[(&str, Kind)] = &[
            ("enabled", Kind::Section),
            ("prof_all", Kind::Section),
            ("prof_ops", Kind::Section),
            ("verbose", Kind::Ignored),
            ("debug", Kind::Ignored),
        ];
        const SECTION: &str = "comms_logger";
        if !self.enabled_section(SECTION, KEYS)? {
            return Ok(());
        }
        self.set_section(SECTION, &[("prof_all", boolean), ("prof_ops", comm_ops)])
    }

    /// `tensorboard` or `csv_monitor`: `{enabled, output_path, job_name}`:
    /// when enabled, the job's key of that name is the directory
    /// `output_path/job_name`, where DeepSpeed writes its event files or
    /// CSV files (its defaults: the working directory and
    /// `DeepSpeedJobName`).
    fn monitor(&mut self, section: &'static str) -> Result<(), ConfigError> {
        const KEYS: &[(&str, Kind)] = &[
            ("enabled", Kind::Section),
            ("output_path", Kind::Section),
            ("job_name", Kind::Section),
        ];
        if !self.enabled_section(section, KEYS)? {
            return Ok(());
        }
        let text = |r: &Self, key: &str, default: &str| -> Result<String, ConfigError> {
            let path = format!("{section}.{key}");
            match r.get(&path) {
                None | Some(Value::Null) => Ok(default.to_string()),
                Some(Value::String(s)) => Ok(s.clone()),
                Some(v) => Err(r.error(&path, format!("{v}: must be a string"))),
            }
        };
        let (out, name) = (
            text(self, "output_path", "")?,
            text(self, "job_name", "DeepSpeedJobName")?,
        );
        let dir = Path::new(&out).join(name);
        self.map(
            section,
            MappedValue::Set(json!(dir.display().to_string())),
            section,
            Origin::Written,
        );
        Ok(())
    }

    fn aio(&mut self) -> Result<(), ConfigError> {
        self.sort_keys("aio", AIO)?;
        self.simple("aio.block_size", "aio.block_size", false, count_value)?;
        self.simple("aio.queue_depth", "aio.queue_depth", false, positive_count)?;
        // DeepSpeed renamed thread_count to intra_op_parallelism.
        self.simple(
            "aio.thread_count",
            "aio.thread_count",
            false,
            positive_count,
        )?;
        self.simple(
            "aio.intra_op_parallelism",
            "aio.thread_count",
            false,
            positive_count,
        )?;
        Ok(())
    }
}

/// Equal as the spec reads them: numbers by value (`5e8` is 500000000).
pub fn same_value(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => match (a.as_array(), b.as_array()) {
            (Some(x), Some(y)) => {
                x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same_value(p, q))
            }
            _ => a == b,
        },
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn is_auto(v: &Value) -> bool {
    v.as_str() == Some("auto")
}

/// A whole non-negative number, written as an integer or as `5e8`.
fn count(v: &Value) -> Result<u64, String> {
    if let Some(n) = v.as_u64() {
        return Ok(n);
    }
    match v.as_f64() {
        Some(f) if f >= 0.0 && f.fract() == 0.0 && f < 1.8e19 => Ok(f as u64),
        _ => Err(format!("{v}: must be a whole non-negative number")),
    }
}

/// Checks and converts one ds_config value for its zrun key.
type Converter = fn(&Value) -> Result<Value, String>;

fn count_value(v: &Value) -> Result<Value, String> {
    count(v).map(|n| json!(n))
}

fn positive_count(v: &Value) -> Result<Value, String> {
    match count(v)? {
        0 => Err("must be at least 1".into()),
        n => Ok(json!(n)),
    }
}

fn positive(v: &Value) -> Result<Value, String> {
    match v.as_f64() {
        Some(f) if f.is_finite() && f > 0.0 => Ok(json!(f)),
        _ => Err(format!("{v}: must be a positive number")),
    }
}

fn non_negative(v: &Value) -> Result<Value, String> {
    match v.as_f64() {
        Some(f) if f.is_finite() && f >= 0.0 => Ok(json!(f)),
        _ => Err(format!("{v}: must be a non-negative number")),
    }
}

/// DeepSpeed's dtype names (its `DtypeEnum`) as zrun's.
fn dtype_name(v: &Value) -> Result<Value, String> {
    match v.as_str() {
        Some("fp32" | "float32" | "float") => Ok(json!("f32")),
        Some("bf16" | "bfloat16" | "bfloat") => Ok(json!("bf16")),
        Some("fp16" | "float16" | "half") => Ok(json!("f16")),
        _ => Err(format!("{v}: must be \"fp32\", \"bf16\" or \"fp16\"")),
    }
}

/// A list of whole non-negative numbers.
fn counts(v: &Value) -> Result<Value, String> {
    match v.as_array() {
        Some(a) => a
            .iter()
            .map(count)
            .collect::<Result<Vec<u64>, String>>()
            .map(|n| json!(n)),
        None => Err(format!("{v}: must be a list of whole numbers")),
    }
}

/// DeepSpeed's curriculum `schedule_type`s that zrun runs.
fn curriculum_schedule(v: &Value) -> Result<Value, String> {
    match v.as_str() {
        Some(s @ ("fixed_linear" | "fixed_root" | "fixed_discrete")) => Ok(json!(s)),
        Some("custom") => Err("custom is a Python function DeepSpeed calls; zrun runs fixed_linear, fixed_root or fixed_discrete".into()),
        _ => Err(format!("{v}: must be \"fixed_linear\", \"fixed_root\" or \"fixed_discrete\"")),
    }
}

/// `flops_profiler.module_depth`: -1 (every depth) or a depth.
fn depth(v: &Value) -> Result<Value, String> {
    match v.as_i64() {
        Some(d) if d >= -1 => Ok(json!(d)),
        _ => Err(format!(
            "{v}: must be -1 (every depth) or a whole number from 0"
        )),
    }
}

fn file_name(v: &Value) -> Result<Value, String> {
    match v.as_str() {
        Some(s) if !s.trim().is_empty() => Ok(json!(s)),
        _ => Err(format!("{v}: must name a file")),
    }
}

/// `comms_logger.prof_ops`: a list of collectives, DeepSpeed's names
/// turned into zrun's.
fn comm_ops(v: &Value) -> Result<Value, String> {
    let names = v
        .as_array()
        .ok_or_else(|| format!("{v}: must be a list of collectives"))?;
    let mut ops = Vec::new();
    for n in names {
        let name = match n.as_str() {
            Some("all_gather_into_tensor" | "all_gather_base") => "all_gather",
            Some("reduce_scatter_tensor" | "reduce_scatter_base") => "reduce_scatter",
            Some("all_to_all_single") => "all_to_all",
            Some("all_reduce_coalesced" | "inference_all_reduce") => "all_reduce",
            Some(s) if crate::spec::COMM_OPS.contains(&s) => s,
            _ => {
                return Err(format!(
                    "{n}: not a collective zrun runs; one of {}",
                    crate::spec::COMM_OPS.join(", ")
                ))
            }
        };
        ops.push(json!(name));
    }
    Ok(Value::Array(ops))
}

fn boolean(v: &Value) -> Result<Value, String> {
    v.as_bool()
        .map(|b| json!(b))
        .ok_or_else(|| format!("{v}: must be true or false"))
}

fn betas(v: &Value) -> Result<Value, String> {
    match v
        .as_array()
        .map(|a| a.iter().map(Value::as_f64).collect::<Vec<_>>())
    {
        Some(b) if b.len() == 2 && b.iter().all(Option::is_some) => Ok(json!([b[0], b[1]])),
        _ => Err(format!("{v}: must be two numbers, [beta1, beta2]")),
    }
}

/// The 1-based (line, column) of every object key in JSON `text`, by dotted
/// path (an array element's index is its path component). serde_json keeps
/// no positions, and an error should point at the line to edit.
fn key_positions(text: &str) -> HashMap<String, (usize, usize)> {
    enum Frame {
        Object(Option<String>),
        Array(usize),
    }
    let component = |f: &Frame| match f {
        Frame::Object(k) => k.clone().unwrap_or_default(),
        Frame::Array(i) => i.to_string(),
    };
    let mut out = HashMap::new();
    let mut stack: Vec<Frame> = Vec::new();
    let chars: Vec<char> = text.chars().collect();
    let (mut line, mut col) = (1usize, 0usize);
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        col += 1;
        match c {
            '\n' => {
                line += 1;
                col = 0;
            }
            '{' => stack.push(Frame::Object(None)),
            '[' => stack.push(Frame::Array(0)),
            '}' | ']' => {
                stack.pop();
            }
            ',' => {
                if let Some(Frame::Array(n)) = stack.last_mut() {
                    *n += 1;
                }
            }
            '"' => {
                let (start_line, start_col) = (line, col);
                let mut s = String::new();
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    if chars[i] == '\\' && i + 1 < chars.len() {
                        i += 1;
                        col += 1;
                    }
                    s.push(chars[i]);
                    col += 1;
                    i += 1;
                }
                col += 1;
                let next = chars[i + 1..].iter().find(|c| !c.is_whitespace());
                if next == Some(&':') {
                    if let Some(Frame::Object(key)) = stack.last_mut() {
                        *key = Some(s.clone());
                        let mut parts: Vec<String> = stack.iter().map(component).collect();
                        parts.pop();
                        parts.push(s);
                        out.insert(parts.join("."), (start_line, start_col));
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_located_by_path() {
        let text = "{\n  \"a\": 1,\n  \"zero_optimization\": {\n    \"stage\": 3,\n    \"x\": [{\"y\": \"s\\\"\"}]\n  }\n}";
        let p = key_positions(text);
        assert_eq!(p["a"], (2, 3));
        assert_eq!(p["zero_optimization"], (3, 3));
        assert_eq!(p["zero_optimization.stage"], (4, 5));
        assert_eq!(p["zero_optimization.x.0.y"], (5, 12));
        assert_eq!(p.len(), 5);
    }

    #[test]
    fn counts_accept_exponents() {
        assert_eq!(count(&json!(5e8)).unwrap(), 500_000_000);
        assert_eq!(count(&json!(12)).unwrap(), 12);
        assert!(count(&json!(1.5)).is_err());
        assert!(count(&json!(1e30)).is_err());
        assert!(count(&json!(-1)).is_err());
        assert!(count(&json!("many")).is_err());
    }
}
