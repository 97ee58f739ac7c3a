//! The job spec (docs/CONFIG.md) as typed structs.
//!
//! Every struct denies unknown keys, and every key except `model` and `data` has
//! the default docs/CONFIG.md lists. Sizes (`reduce_bucket_size: 5e7`, `64MiB`) parse through
//! [`Size`]. The structs serialize too: the launcher sends the resolved spec to
//! every worker as JSON, and `zrun check` prints it.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A whole job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Job name; `${name}` in `run_dir` expands to it.
    #[serde(default = "default_name")]
    pub name: String,
    /// The model to train.
    pub model: ModelSpec,
    /// Where the tokens come from.
    pub data: DataSpec,
    /// Optimisation settings.
    #[serde(default)]
    pub train: TrainSpec,
    /// ZeRO settings.
    #[serde(default)]
    pub zero: ZeroSpec,
    /// Collective-communication settings.
    #[serde(default)]
    pub comm: CommSpec,
    /// Checkpointing.
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    /// NVMe swap I/O (offload to `nvme`).
    #[serde(default)]
    pub aio: AioSpec,
    /// `cpu` or `cuda`.
    #[serde(default)]
    pub device: Device,
    /// Where metrics and checkpoints go.
    #[serde(default = "default_run_dir")]
    pub run_dir: String,
    /// A directory for TensorBoard event files of each step's scalars
    /// (null: none); `${name}` expands to the job's name, as in `run_dir`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensorboard: Option<String>,
    /// A directory for CSV files of each step's scalars, one file a scalar
    /// (DeepSpeed's `csv_monitor`; null: none); `${name}` expands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csv_monitor: Option<String>,
    /// DeepSpeed's flops profiler: one step timed module by module, each
    /// module's parameters and model FLOPs beside its time (null: off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flops_profiler: Option<FlopsProfilerSpec>,
    /// DeepSpeed's comms logger: every collective of the run timed and
    /// tallied by operation and size, with its bandwidth (null: off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comms_logger: Option<CommsLoggerSpec>,
    /// Extra environment for every worker (numbers and booleans become strings).
    #[serde(default, deserialize_with = "env_map")]
    pub env: BTreeMap<String, String>,
    /// A DeepSpeed config (JSON) whose keys set this job's (see
    /// [`crate::deepspeed`]); relative to zrun's working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deepspeed: Option<String>,
}

fn env_map<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    use serde::de::Error;
    let raw: BTreeMap<String, serde_json::Value> = BTreeMap::deserialize(d)?;
    raw.into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => Ok((k, s)),
            serde_json::Value::Number(n) => Ok((k, n.to_string())),
            serde_json::Value::Bool(b) => Ok((k, b.to_string())),
            other => Err(D::Error::custom(format!(
                "env.{k} must be a string, number or boolean, got {other}"
            ))),
        })
        .collect()
}

fn default_name() -> String {
    "zrun-job".into()
}
fn default_run_dir() -> String {
    "runs/${name}".into()
}

/// The model architecture.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The decoder family: `gpt` (GPT-2) or `llama`.
    #[serde(default)]
    pub kind: ModelKind,
    /// Token vocabulary (256 for byte-level text).
    #[serde(default = "default_vocab")]
    pub vocab_size: usize,
    /// Residual width.
    #[serde(default = "default_d_model")]
    pub d_model: usize,
    /// Transformer blocks.
    #[serde(default = "default_n_layers")]
    pub n_layers: usize,
    /// Attention heads; must divide `d_model` unless `head_dim` is given.
    #[serde(default = "default_n_heads")]
    pub n_heads: usize,
    /// LLaMA: the width of one attention head (default `d_model /
    /// n_heads`); q is `n_heads × head_dim` wide, the output projection
    /// `[n_heads × head_dim, d_model]` (Qwen3's and Mistral-Nemo's heads
    /// are wider than `d_model / n_heads`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// LLaMA: key/value heads for grouped-query attention; must divide
    /// `n_heads` (default `n_heads`: plain multi-head attention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_kv_heads: Option<usize>,
    /// The MLP's hidden width (default GPT-2's `4 × d_model`, LLaMA's
    /// `8/3 × d_model` rounded up to a multiple of 256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ffn_hidden: Option<usize>,
    /// LLaMA: whether the output head is the token embedding (default false:
    /// a head of its own). GPT-2's is always tied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_embeddings: Option<bool>,
    /// LLaMA: whether the q, k and v projections have biases (Qwen2's
    /// attention; default false). The other linears and the norms have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qkv_bias: Option<bool>,
    /// LLaMA: whether each head's q and k are RMS-normalised (a weight of
    /// `head_dim` each, shared by the heads) before the rotary embedding:
    /// Qwen3's attention; default false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qk_norm: Option<bool>,
    /// LLaMA: the rotary embeddings' base (default 10000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub rope_theta: Option<f64>,
    /// LLaMA: the rotary embeddings' frequencies scaled for a longer context
    /// (Hugging Face's `rope_scaling`; default none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// LLaMA: the share of each q and k head the rotary embedding turns
    /// (Phi-4-mini's `partial_rotary_factor`, 0.75; default 1): its first
    /// `head_dim · factor` columns, halves of that turned as pairs, the
    /// rest passed through. Exported as Phi-3, the family that has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub partial_rotary_factor: Option<f64>,
    /// LLaMA: each token attends to at most this many tokens, itself
    /// included (Mistral's and Phi-3's `sliding_window`, Qwen2's and
    /// Qwen3's with `use_sliding_window`); default none: every earlier
    /// token of its sequence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// The norms' epsilon (default 1e-5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub norm_eps: Option<f64>,
    /// The length of the sequences the job trains on, in tokens.
    #[serde(default = "default_seq_len")]
    pub seq_len: usize,
    /// The longest sequence the model takes (Hugging Face's
    /// `max_position_embeddings`, GPT-2's `n_positions`; default
    /// `seq_len`): the rows of GPT-2's position table, of which a job uses
    /// the first `seq_len`, and the context an export declares. A published
    /// GPT-2 (1024) fine-tunes on shorter sequences and exports as 1024
    /// positions again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_position_embeddings: Option<usize>,
    /// Weights to start from: a `zrun export` file, a Hugging Face model
    /// directory (`config.json` + `model.safetensors`), or a published
    /// GPT-2 / LLaMA safetensors file.
    #[serde(default)]
    pub init_from: Option<String>,
    /// Memory-centric tiling: every block linear of more elements is split
    /// into output-column tiles of at most this many, gathered and computed one
    /// at a time (see [`crate::tiles`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tile_size: Option<Size>,
    /// The share of hidden-state elements training zeroes (the rest scaled
    /// by `1 / (1 - p)`): the embeddings' output and each block's attention
    /// and MLP outputs before their residual adds, as Megatron's
    /// `hidden_dropout` (GPT-2's `embd_pdrop` and `resid_pdrop`); default
    /// 0. Evaluation, validation and generation drop nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub hidden_dropout: Option<f64>,
    /// The share of attention's probabilities training zeroes (the rest
    /// scaled by `1 / (1 - p)`), as GPT-2's `attn_pdrop`, LLaMA's
    /// `attention_dropout` and Megatron's `attention_dropout`; default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub attention_dropout: Option<f64>,
}

/// How the rotary embeddings' frequencies are scaled for a context longer
/// than the one a model was first trained at: Hugging Face's `rope_scaling`
/// (`rope_parameters` in transformers 5).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case", deny_unknown_fields)]
pub enum RopeScaling {
    /// Every frequency divided by `factor` (positions interpolated).
    Linear {
        /// The divisor (at least 1).
        #[serde(deserialize_with = "finite::number")]
        factor: f64,
    },
    /// Llama 3.1's: frequencies whose wavelength is longer than
    /// `original_max_position_embeddings / low_freq_factor` divided by
    /// `factor`, those shorter than `… / high_freq_factor` kept, those
    /// between moved smoothly from one to the other.
    Llama3 {
        /// The divisor of the low frequencies (at least 1).
        #[serde(deserialize_with = "finite::number")]
        factor: f64,
        /// Where the low frequencies end.
        #[serde(deserialize_with = "finite::number")]
        low_freq_factor: f64,
        /// Where the high frequencies begin (above `low_freq_factor`).
        #[serde(deserialize_with = "finite::number")]
        high_freq_factor: f64,
        /// The context the model was first trained at.
        original_max_position_embeddings: usize,
    },
    /// Dynamic NTK scaling, which transformers applies only to sequences
    /// longer than the model's context (`max_position_embeddings`, zrun's
    /// `seq_len`): a job's never are, so its frequencies are the unscaled
    /// ones, as transformers computes them for every such sequence; kept so
    /// that a model that has it reads and exports with it.
    Dynamic {
        /// The context's multiple at which the base is scaled (at least 1).
        #[serde(deserialize_with = "finite::number")]
        factor: f64,
    },
    /// YaRN (Peng et al., 2023; Qwen2.5's and Qwen3's long contexts, as
    /// transformers computes it): frequencies that turn more than
    /// `beta_fast` times over the original context kept, those that turn
    /// fewer than `beta_slow` times divided by `factor`, a linear ramp over
    /// the dimensions between; and the rotated q and k times an attention
    /// factor (`attention_factor`, else DeepSeek's ratio from `mscale` and
    /// `mscale_all_dim` where both are given, else `0.1·ln(factor) + 1`).
    Yarn {
        /// The divisor of the low frequencies (at least 1).
        #[serde(deserialize_with = "finite::number")]
        factor: f64,
        /// The context the model was first trained at.
        original_max_position_embeddings: usize,
        /// Rotations over the original context above which a frequency is
        /// kept (32).
        #[serde(
            default,
            deserialize_with = "finite::optional",
            skip_serializing_if = "Option::is_none"
        )]
        beta_fast: Option<f64>,
        /// Rotations below which it is divided by `factor` (1).
        #[serde(
            default,
            deserialize_with = "finite::optional",
            skip_serializing_if = "Option::is_none"
        )]
        beta_slow: Option<f64>,
        /// What cos and sin are multiplied by, where given.
        #[serde(
            default,
            deserialize_with = "finite::optional",
            skip_serializing_if = "Option::is_none"
        )]
        attention_factor: Option<f64>,
        /// DeepSeek's: the attention factor's numerator's scale.
        #[serde(
            default,
            deserialize_with = "finite::optional",
            skip_serializing_if = "Option::is_none"
        )]
        mscale: Option<f64>,
        /// DeepSeek's: its denominator's.
        #[serde(
            default,
            deserialize_with = "finite::optional",
            skip_serializing_if = "Option::is_none"
        )]
        mscale_all_dim: Option<f64>,
        /// Whether the ramp's ends are rounded out to whole dimensions
        /// (true).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        truncate: Option<bool>,
    },
    /// LongRoPE (Phi-3's 128k contexts, Phi-3.5's, Phi-4-mini's): each
    /// frequency divided by its own factor, `short_factor`'s for sequences
    /// of at most `original_max_position_embeddings` tokens and
    /// `long_factor`'s for longer ones (transformers switches on the
    /// longest position of a batch), and the rotated q and k times an
    /// attention factor (`attention_factor`, else
    /// `sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`).
    Longrope {
        /// The context's stretch, which sets the attention factor (at least
        /// 1; transformers' default, the model's `max_position_embeddings`
        /// over the original, is filled in when a `config.json` is read).
        #[serde(deserialize_with = "finite::number")]
        factor: f64,
        /// The context the model was first trained at, where the factors
        /// switch.
        original_max_position_embeddings: usize,
        /// A divisor for each of a head's frequencies (one a turned pair:
        /// `head_dim / 2`, or half the turned columns with
        /// `partial_rotary_factor`) within the original context.
        short_factor: Vec<f64>,
        /// Beyond it.
        long_factor: Vec<f64>,
        /// What cos and sin are multiplied by, where given.
        #[serde(
            default,
            deserialize_with = "finite::optional",
            skip_serializing_if = "Option::is_none"
        )]
        attention_factor: Option<f64>,
    },
}

/// A decoder family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// GPT-2: LayerNorm with biases, learned positions, GELU MLP, biases on
    /// every linear, tied head.
    #[default]
    Gpt,
    /// LLaMA: RMSNorm, rotary positions, SwiGLU MLP, no biases,
    /// grouped-query attention, a head of its own unless tied.
    Llama,
}
fn default_vocab() -> usize {
    256
}
fn default_d_model() -> usize {
    256
}
fn default_n_layers() -> usize {
    4
}
fn default_n_heads() -> usize {
    4
}
fn default_seq_len() -> usize {
    128
}

/// Token source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    /// A file or glob pattern; required unless `format: synthetic`.
    #[serde(default)]
    pub path: Option<String>,
    /// How to read the files.
    #[serde(default)]
    pub format: DataFormat,
    /// The share of the token stream, at its end, held out for validation
    /// (0: none).
    #[serde(default)]
    #[serde(deserialize_with = "finite::number")]
    pub val_fraction: f64,
    /// Validation data of its own (a file or glob, in `format`), in place of
    /// `val_fraction`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_path: Option<String>,
    /// Keep the documents packed into a sequence apart: attention, positions
    /// and the loss stop at each end-of-text id (zmodel's `documents`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub separate_documents: bool,
    /// The end-of-text id that ends a document, for `separate_documents`;
    /// by default the `eos_id` of the `zrun prepare` manifest beside the data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_id: Option<u32>,
    /// How sequences are cut from the data: windows of the token stream,
    /// or whole documents packed best fit decreasing.
    #[serde(default, skip_serializing_if = "Packing::is_wrapped")]
    pub packing: Packing,
    /// Several data sources mixed by weight, in place of `path`: each
    /// sequence comes from one of them, so that the share of sequences
    /// from each follows its weight (Megatron-DeepSpeed's `--data-path
    /// W1 P1 W2 P2`, Hugging Face's `interleave_datasets`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blend: Vec<BlendPart>,
}

/// One source of a data blend (`data.blend`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlendPart {
    /// A file or glob pattern, in the job's `data.format`.
    pub path: String,
    /// Its share of the sequences, relative to the other parts' weights.
    #[serde(deserialize_with = "finite::number")]
    pub weight: f64,
}

impl DataSpec {
    /// The data's sources, each with its weight and the key that names it
    /// in a job: `data.blend`'s parts, or `data.path` alone (weight 1).
    pub fn sources(&self) -> Vec<(&'static str, Option<String>, f64)> {
        match self.blend.is_empty() {
            true => vec![("data.path", self.path.clone(), 1.0)],
            false => self
                .blend
                .iter()
                .map(|p| ("data.blend", Some(p.path.clone()), p.weight))
                .collect(),
        }
    }
}

/// How a job's sequences are cut from its data (`data.packing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Packing {
    /// Windows of `seq_len + 1` tokens of the stream, documents cut where
    /// a window ends (TRL's `wrapped`).
    #[default]
    Wrapped,
    /// Whole documents, longest first, each into the fullest sequence it
    /// fits, the rest padding; longer ones cut (TRL's `bfd`).
    Bfd,
    /// As `bfd`, but a document longer than a sequence is split into
    /// pieces of a sequence each (the last shorter), packed as documents
    /// of their own: no token is left out (TRL's `bfd_split`).
    BfdSplit,
}

impl Packing {
    /// Whether this is the default.
    pub fn is_wrapped(&self) -> bool {
        *self == Packing::Wrapped
    }
}

/// How data files are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataFormat {
    /// Bytes as tokens (vocab 256).
    #[default]
    Text,
    /// Little-endian u16 token ids (nanoGPT's `.bin`).
    TokensU16,
    /// Little-endian u32 token ids, for vocabularies above 65,536.
    TokensU32,
    /// A seeded generated corpus; no files.
    Synthetic,
}

impl DataFormat {
    /// Bytes each token takes in a file of this format (none for synthetic).
    pub fn bytes_per_token(self) -> Option<usize> {
        match self {
            DataFormat::Text => Some(1),
            DataFormat::TokensU16 => Some(2),
            DataFormat::TokensU32 => Some(4),
            DataFormat::Synthetic => None,
        }
    }
}

/// The token id of one file token of `bytes.len()` bytes (1, 2 or 4,
/// little-endian): how every reader of token files decodes them.
pub fn token_id(bytes: &[u8]) -> u32 {
    match *bytes {
        [b] => u32::from(b),
        [a, b] => u32::from(u16::from_le_bytes([a, b])),
        [a, b, c, d] => u32::from_le_bytes([a, b, c, d]),
        _ => panic!("a token is 1, 2 or 4 bytes, not {}", bytes.len()),
    }
}

/// Optimisation settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSpec {
    /// Optimizer steps.
    pub steps: u64,
    /// The run's length in passes over the training data (transformers'
    /// `num_train_epochs`): when set, `steps` is `ceil(epochs × sequences
    /// of an epoch / global batch)`, which zrun counts before launch
    /// (`Job::settle_epochs`); not beside a `steps` the job sets.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub epochs: Option<f64>,
    /// Sequences per worker per micro-batch.
    pub micro_batch_size: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Peak learning rate.
    #[serde(deserialize_with = "finite::number")]
    pub lr: f64,
    /// Warmup steps from `warmup_start_lr` to `lr`.
    pub warmup_steps: u64,
    /// The warmup as a share of `steps` (transformers' `warmup_ratio`):
    /// when set, `warmup_steps` is `ceil(ratio × steps)`, as transformers
    /// rounds it; not beside a `warmup_steps` the job sets.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub warmup_ratio: Option<f64>,
    /// The shape of the warmup ramp.
    pub warmup_type: WarmupType,
    /// The rate the warmup starts from.
    #[serde(deserialize_with = "finite::number")]
    pub warmup_start_lr: f64,
    /// Learning-rate schedule after warmup.
    pub schedule: Schedule,
    /// The floor that the decays end at (and that `inverse_sqrt` stays
    /// above).
    #[serde(deserialize_with = "finite::number")]
    pub min_lr: f64,
    /// `schedule: wsd`: the share of all steps spent decaying, at the end.
    #[serde(deserialize_with = "finite::number")]
    pub decay_fraction: f64,
    /// `schedule: cosine_with_restarts`: the cosine decays this many times,
    /// each from the peak (transformers' `num_cycles`; 1 unless set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_cycles: Option<u64>,
    /// `schedule: polynomial`: the decay's power (transformers' `power`; 1
    /// unless set, which is linear).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub power: Option<f64>,
    /// `schedule: inverse_sqrt`: the steps over which the rate falls by
    /// 1/√2 (transformers' `timescale`; unless set, `warmup_steps`, or
    /// 10,000 without a warmup).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timescale: Option<u64>,
    /// `schedule: one_cycle`: its cycle, decay and momentum (DeepSpeed's
    /// `OneCycle` parameters; its rates are `min_lr` and `lr`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub one_cycle: Option<OneCycleSpec>,
    /// `schedule: lr_range_test`: its growth (DeepSpeed's `LRRangeTest`
    /// parameters; its starting rate is `lr`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr_range_test: Option<LrRangeTestSpec>,
    /// `schedule: reduce_lr_on_plateau`: when a validation loss that stopped
    /// improving lowers the rate (PyTorch's `ReduceLROnPlateau` arguments;
    /// its `min_lr` is `train.min_lr`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plateau: Option<PlateauSpec>,
    /// AdamW's betas and epsilon.
    pub optimizer: OptimizerSpec,
    /// Decoupled (AdamW) weight decay on matrices.
    #[serde(deserialize_with = "finite::number")]
    pub weight_decay: f64,
    /// Global-norm gradient clipping; 0 disables.
    #[serde(deserialize_with = "finite::number")]
    pub grad_clip: f64,
    /// Seed of initialisation and data order.
    pub seed: u64,
    /// Working dtype of parameters and gradients.
    pub dtype: Dtype,
    /// DeepSpeed's `data_types.grad_accum_dtype`: the type gradients are
    /// held and summed in between backward and the update (micro-batches
    /// accumulated, reduced slices put away). `None`: `dtype`; `f32` under
    /// a 16-bit `dtype` keeps backward's f32 gradients unrounded, at twice
    /// the gradient memory ([`TrainSpec::grads_dtype`]).
    pub grad_accum_dtype: Option<Dtype>,
    /// DeepSpeed's `communication_data_type` (PyTorch FSDP's
    /// `reduce_dtype`): the type gradients cross the wire in when ranks
    /// reduce them. `None`: f32. A 16-bit type halves the reductions'
    /// bytes: each rank's piece is rounded to it and the pieces are added
    /// in f32, the sum rounded to it too.
    pub reduce_dtype: Option<Dtype>,
    /// DeepSpeed's `gradient_predivide_factor`: gradients are divided by
    /// this before the ranks add them and by `world / factor` after, so
    /// that the sums carried in 16 bits stay further from overflow.
    /// Default 1 (divided by the world size after).
    #[serde(deserialize_with = "finite::number")]
    pub gradient_predivide_factor: f64,
    /// DeepSpeed's `prescale_gradients`: gradients are divided by the
    /// world size before the ranks add them (the factor above is then not
    /// used, as DeepSpeed's engine does). Default false.
    pub prescale_gradients: bool,
    /// f16's dynamic loss scaling (DeepSpeed's `fp16` keys and defaults).
    pub loss_scale: LossScaleSpec,
    /// Recompute each block in backward.
    pub activation_checkpointing: bool,
    /// `device: cuda`: f32 products on the tensor cores in TF32 (inputs
    /// rounded to 10 mantissa bits, f32 sums), as PyTorch's
    /// `torch.backends.cuda.matmul.allow_tf32`.
    pub allow_tf32: bool,
    /// How often to validate: steps between validation losses (0: only
    /// after the last step), or each epoch's end; needs validation data.
    pub eval_every: Every,
    /// Micro-batches each worker evaluates per validation.
    pub eval_steps: usize,
    /// Steps between plain log lines (`--no-progress` or no terminal); 0:
    /// every twentieth of the run.
    pub log_every: u64,
    /// transformers' `label_smoothing_factor` (PyTorch's `CrossEntropyLoss(
    /// label_smoothing=)`): training's loss is `(1 − ε)·cross-entropy + ε·
    /// mean over the vocabulary of −log p`; validation's stays the plain
    /// cross-entropy. Default 0.
    #[serde(deserialize_with = "finite::number")]
    pub label_smoothing: f64,
    /// NEFTune (transformers' and TRL's `neftune_noise_alpha`): uniform
    /// noise of at most `alpha / √(seq_len · d_model)` added to the
    /// embeddings' output in training. Default 0 (none).
    #[serde(deserialize_with = "finite::number")]
    pub neftune_noise_alpha: f64,
    /// Ends training once the validation loss has stopped improving
    /// (transformers' `EarlyStoppingCallback`); none by default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopping>,
    /// Parameters that keep their values ([`crate::freeze`]'s patterns over
    /// the parameter names): left out of the update, the gradient norm and
    /// LAMB's trust ratios, as PyTorch leaves a parameter with
    /// `requires_grad = False`. Default none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub freeze: Vec<String>,
    /// DeepSpeed's sequence-length curriculum ([`crate::curriculum`]):
    /// early steps train on the first tokens of each sequence. None by
    /// default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub curriculum: Option<crate::curriculum::CurriculumSpec>,
    /// DeepSpeed's progressive layer dropping ([`crate::layer_drop`]):
    /// each micro-batch skips blocks, more of them deeper and later. None
    /// by default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub progressive_layer_drop: Option<crate::layer_drop::LayerDropSpec>,
}

/// `train.early_stopping`: transformers' `EarlyStoppingCallback` on the
/// validation loss. A validation improves on the best before it when it is
/// lower by more than `threshold`; after `patience` validations in a row
/// that do not, training ends (with a checkpoint of that step).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopping {
    /// Validations in a row without improvement that end training
    /// (`early_stopping_patience`).
    pub patience: u64,
    /// How much lower than the best a validation loss must be to count as
    /// better (`early_stopping_threshold`; default 0).
    #[serde(default, deserialize_with = "finite::number")]
    pub threshold: f64,
}

/// f16's loss scaling, with DeepSpeed's key names and defaults: dynamic,
/// or a static scale.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossScaleSpec {
    /// A static scale (DeepSpeed's `fp16.loss_scale` above 0): the scale
    /// never changes, and a step whose gradients overflow is skipped, as
    /// DeepSpeed skips it; the dynamic knobs below then do nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub static_scale: Option<f64>,
    /// The first scale is 2^this.
    pub initial_scale_power: u32,
    /// Steps without overflow before the scale doubles.
    pub loss_scale_window: u64,
    /// Overflows tolerated before the scale halves.
    pub hysteresis: u32,
    /// The scale never goes below this.
    #[serde(deserialize_with = "finite::number")]
    pub min_loss_scale: f64,
}

impl Default for LossScaleSpec {
    fn default() -> Self {
        Self {
            static_scale: None,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            min_loss_scale: 1.0,
        }
    }
}

impl TrainSpec {
    /// Bytes a gradient element takes on the wire when ranks reduce it:
    /// 2 under a 16-bit `reduce_dtype`, else 4.
    pub fn reduce_bytes(&self) -> f64 {
        match self.reduce_dtype {
            Some(Dtype::Bf16 | Dtype::F16) => 2.0,
            _ => 4.0,
        }
    }

    /// What gradients are divided by before ranks add them, at `world`
    /// ranks: the world size under `prescale_gradients`, else
    /// `gradient_predivide_factor`.
    pub fn predivide(&self, world: usize) -> f64 {
        match self.prescale_gradients {
            true => world as f64,
            false => self.gradient_predivide_factor,
        }
    }

    /// The type gradients are held and summed in: `grad_accum_dtype`, else
    /// the working `dtype`.
    pub fn grads_dtype(&self) -> Dtype {
        self.grad_accum_dtype.unwrap_or(self.dtype)
    }
}

impl Default for TrainSpec {
    fn default() -> Self {
        Self {
            steps: 200,
            micro_batch_size: 8,
            grad_accum: 1,
            lr: 3.0e-4,
            warmup_steps: 20,
            warmup_ratio: None,
            epochs: None,
            warmup_type: WarmupType::Linear,
            warmup_start_lr: 0.0,
            schedule: Schedule::Cosine,
            min_lr: 0.0,
            decay_fraction: 0.2,
            num_cycles: None,
            power: None,
            timescale: None,
            one_cycle: None,
            lr_range_test: None,
            plateau: None,
            optimizer: OptimizerSpec::default(),
            weight_decay: 0.1,
            grad_clip: 1.0,
            seed: 42,
            dtype: Dtype::F32,
            grad_accum_dtype: None,
            reduce_dtype: None,
            gradient_predivide_factor: 1.0,
            prescale_gradients: false,
            loss_scale: LossScaleSpec::default(),
            activation_checkpointing: false,
            allow_tf32: false,
            eval_every: Every::Steps(0),
            eval_steps: 4,
            log_every: 0,
            label_smoothing: 0.0,
            neftune_noise_alpha: 0.0,
            early_stopping: None,
            freeze: Vec::new(),
            curriculum: None,
            progressive_layer_drop: None,
        }
    }
}

/// `schedule: one_cycle`'s shape, under DeepSpeed's `OneCycle` names and
/// defaults. Counting `i` = the steps before this one: the cycle's first
/// `cycle_first_step_size` steps rise from `min_lr` to `lr`, the next
/// `cycle_second_step_size` fall back; after the cycle the rate is
/// `min_lr / (1 + decay_lr_rate·d/decay_step_size)`, d steps past it. With
/// `cycle_momentum`, β1 moves from `cycle_max_mom` down to `cycle_min_mom`
/// and back, then becomes `cycle_max_mom·(1 + decay_mom_rate·d/decay_step_size)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OneCycleSpec {
    /// Steps of the rising half (≥ 1).
    pub cycle_first_step_size: u64,
    /// Steps of the falling half (the rising half's unless set).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cycle_second_step_size: Option<u64>,
    /// The decay's interval in steps; 0: no decay after the cycle.
    pub decay_step_size: u64,
    /// The rate's decay per interval; 0: none.
    #[serde(deserialize_with = "finite::number")]
    pub decay_lr_rate: f64,
    /// Whether β1 cycles (DeepSpeed's default).
    pub cycle_momentum: bool,
    /// β1 at the cycle's peak rate.
    #[serde(deserialize_with = "finite::number")]
    pub cycle_min_mom: f64,
    /// β1 at its ends.
    #[serde(deserialize_with = "finite::number")]
    pub cycle_max_mom: f64,
    /// β1's growth per decay interval after the cycle; 0: none.
    #[serde(deserialize_with = "finite::number")]
    pub decay_mom_rate: f64,
}

impl Default for OneCycleSpec {
    fn default() -> Self {
        Self {
            cycle_first_step_size: 2000,
            cycle_second_step_size: None,
            decay_step_size: 0,
            decay_lr_rate: 0.0,
            cycle_momentum: true,
            cycle_min_mom: 0.8,
            cycle_max_mom: 0.9,
            decay_mom_rate: 0.0,
        }
    }
}

/// `schedule: lr_range_test`'s growth, under DeepSpeed's `LRRangeTest`
/// names (less their `lr_range_test_` prefix) and defaults: after `i` steps
/// the rate is `lr·(1 + step_rate·i/step_size)`, `i/step_size` rounded down
/// with `staircase`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LrRangeTestSpec {
    /// Steps per unit of growth (≥ 1).
    pub step_size: u64,
    /// The growth per `step_size` steps, as a share of `lr` (≥ 0).
    #[serde(deserialize_with = "finite::number")]
    pub step_rate: f64,
    /// Grow in stairs of `step_size` steps rather than continuously.
    pub staircase: bool,
}

impl Default for LrRangeTestSpec {
    fn default() -> Self {
        Self {
            step_size: 2000,
            step_rate: 1.0,
            staircase: false,
        }
    }
}

/// `schedule: reduce_lr_on_plateau`'s rule, under PyTorch's
/// `ReduceLROnPlateau` names and defaults (mode `min`, on the validation
/// loss): a loss better than the best by more than `threshold` (a share of
/// the best under `rel`, an amount under `abs`) resets the count of bad
/// validations; past `patience` of them the rate becomes
/// `max(rate·factor, min_lr)` (kept where that moves it by no more than
/// `eps`), and the next `cooldown` validations count none.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlateauSpec {
    /// The rate's multiplier at each reduction, in (0, 1).
    #[serde(deserialize_with = "finite::number")]
    pub factor: f64,
    /// Bad validations tolerated before a reduction.
    pub patience: u64,
    /// How much better a loss must be to count as better (≥ 0).
    #[serde(deserialize_with = "finite::number")]
    pub threshold: f64,
    /// `rel` (a share of the best) or `abs`.
    pub threshold_mode: ThresholdMode,
    /// Validations after a reduction that count no bad one.
    pub cooldown: u64,
    /// A reduction smaller than this is not made (≥ 0).
    #[serde(deserialize_with = "finite::number")]
    pub eps: f64,
}

impl Default for PlateauSpec {
    fn default() -> Self {
        Self {
            factor: 0.1,
            patience: 10,
            threshold: 1e-4,
            threshold_mode: ThresholdMode::Rel,
            cooldown: 0,
            eps: 1e-8,
        }
    }
}

/// How `PlateauSpec::threshold` measures an improvement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ThresholdMode {
    /// Better than `best·(1 − threshold)`.
    #[default]
    Rel,
    /// Better than `best − threshold`.
    Abs,
}

/// The optimizer and its coefficients (PyTorch's and DeepSpeed's names and
/// defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerSpec {
    /// Which update rule (DeepSpeed's `optimizer.type`).
    #[serde(rename = "type")]
    pub kind: OptimizerKind,
    /// AdamW: decay of the first and second moments; Lion: the
    /// interpolation of the update's direction and the moment's decay.
    #[serde(deserialize_with = "finite::pair")]
    pub betas: [f64; 2],
    /// AdamW and LAMB: added to the second moment's square root; Adagrad:
    /// to the square root of its sum of squares (Lion has none). Unset: the
    /// rule's PyTorch default ([`OptimizerSpec::eps`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub eps: Option<f64>,
    /// Adagrad: the rate of step t is `lr / (1 + (t − 1)·lr_decay)`
    /// (PyTorch's `lr_decay`; unset: 0). Refused beside another rule.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub lr_decay: Option<f64>,
    /// Adagrad: each sum of squares' starting value (PyTorch's
    /// `initial_accumulator_value`; unset: 0). Refused beside another rule.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub initial_accumulator_value: Option<f64>,
    /// LAMB: the trust ratio's bounds, `[min_coeff, max_coeff]`
    /// (DeepSpeed's names; unset: 0.01 and 10). Refused beside another rule.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub min_coeff: Option<f64>,
    /// See `min_coeff`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "finite::optional")]
    pub max_coeff: Option<f64>,
    /// AdamW, Adam and LAMB: whether the moments' bias is corrected
    /// (DeepSpeed's `bias_correction`; unset: true). Off, the step is `lr`
    /// and the second moment's root is used as it is, as DeepSpeed's BERT
    /// recipes train. Refused beside another rule.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bias_correction: Option<bool>,
}

impl OptimizerSpec {
    /// The epsilon the rule adds to its denominator: the job's, else
    /// PyTorch's default for the rule (Adagrad 1e-10, the others 1e-8).
    pub fn eps(&self) -> f64 {
        let default = match self.kind {
            OptimizerKind::Adagrad => 1e-10,
            _ => 1e-8,
        };
        self.eps.unwrap_or(default)
    }

    /// Whether the moments' bias is corrected (true unless written false).
    pub fn bias_correction(&self) -> bool {
        self.bias_correction.unwrap_or(true)
    }

    /// LAMB's trust-ratio bounds (DeepSpeed FusedLamb's defaults where unset).
    pub fn trust_bounds(&self) -> [f64; 2] {
        [
            self.min_coeff.unwrap_or(0.01),
            self.max_coeff.unwrap_or(10.0),
        ]
    }
}

impl Default for OptimizerSpec {
    fn default() -> Self {
        Self {
            kind: OptimizerKind::Adamw,
            betas: [0.9, 0.999],
            eps: None,
            lr_decay: None,
            initial_accumulator_value: None,
            min_coeff: None,
            max_coeff: None,
            bias_correction: None,
        }
    }
}

/// The update rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    /// AdamW (Loshchilov & Hutter): two moments, bias-corrected, decoupled
    /// weight decay.
    #[default]
    Adamw,
    /// Lion (Chen et al., 2023, "Symbolic Discovery of Optimization
    /// Algorithms"): the sign of an interpolation of the moment and the
    /// gradient, one moment, decoupled weight decay; DeepSpeed's `Lion`.
    Lion,
    /// LAMB (You et al., 2020, "Large Batch Optimization for Deep Learning"):
    /// AdamW's moments and decayed update, each parameter's update scaled by
    /// the trust ratio ‖w‖ / ‖update‖ (clamped), as DeepSpeed's `Lamb`
    /// (FusedLamb) computes it.
    Lamb,
    /// Adam (Kingma & Ba) as PyTorch's `Adam` computes it: weight decay
    /// added to the gradient (L2) before AdamW's moments and update, which
    /// then decays nothing; DeepSpeed's `Adam` with `adam_w_mode: false`.
    Adam,
    /// Adagrad (Duchi et al., 2011): each parameter's rate divided by the
    /// square root of the sum of its squared gradients; weight decay added
    /// to the gradient (L2), as PyTorch's `Adagrad`, which DeepSpeed's
    /// `Adagrad` runs. One state, as Lion's.
    Adagrad,
}

impl OptimizerKind {
    /// The name a job writes.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Adamw => "adamw",
            OptimizerKind::Lion => "lion",
            OptimizerKind::Lamb => "lamb",
            OptimizerKind::Adagrad => "adagrad",
            OptimizerKind::Adam => "adam",
        }
    }

    /// Whether the rule keeps a second moment (AdamW's, Adam's and LAMB's
    /// exp_avg_sq). Lion keeps only the first and Adagrad only its sum of
    /// squares, a third less optimizer state.
    pub fn second_moment(self) -> bool {
        matches!(
            self,
            OptimizerKind::Adamw | OptimizerKind::Adam | OptimizerKind::Lamb
        )
    }
}

/// Learning-rate schedule after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// Stay at `lr`.
    Constant,
    /// Linear decay to `min_lr` at the last step.
    Linear,
    /// Half-cosine decay to `min_lr` at the last step.
    Cosine,
    /// Warmup-stable-decay: `lr` until the last `decay_fraction` of the
    /// steps, then linear decay to `min_lr`.
    Wsd,
    /// `num_cycles` half-cosine decays to `min_lr`, each from `lr`
    /// (transformers' `cosine_with_restarts`, its hard restarts).
    CosineWithRestarts,
    /// `(1 − progress)^power` of the way from `min_lr` to `lr`
    /// (transformers' `polynomial`, `min_lr` its `lr_end`).
    Polynomial,
    /// `lr·√(timescale / (timescale + steps since warmup))`, no lower than
    /// `min_lr` (transformers' `inverse_sqrt`).
    InverseSqrt,
    /// DeepSpeed's `OneCycle`: from `min_lr` up to `lr` and back down over
    /// one cycle (no warmup: the cycle's first half is one), then decaying
    /// below `min_lr`; Adam's β1 (Lion's too) cycles the other way
    /// (`train.one_cycle`).
    OneCycle,
    /// DeepSpeed's `LRRangeTest`: from `lr`, growing by `step_rate`·`lr`
    /// every `step_size` steps (continuously, or in stairs), without end: a
    /// sweep for the rate at which the loss stops falling
    /// (`train.lr_range_test`). No warmup.
    LrRangeTest,
    /// transformers' `reduce_lr_on_plateau` (PyTorch's `ReduceLROnPlateau`
    /// on the validation loss): `lr` until validations stop improving, then
    /// lower by `train.plateau.factor` each time they do (down to `min_lr`).
    /// No warmup; needs validation (`train.eval_every`).
    ReduceLrOnPlateau,
}

impl Schedule {
    /// The name a job writes.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::Constant => "constant",
            Schedule::Linear => "linear",
            Schedule::Cosine => "cosine",
            Schedule::Wsd => "wsd",
            Schedule::CosineWithRestarts => "cosine_with_restarts",
            Schedule::Polynomial => "polynomial",
            Schedule::InverseSqrt => "inverse_sqrt",
            Schedule::OneCycle => "one_cycle",
            Schedule::LrRangeTest => "lr_range_test",
            Schedule::ReduceLrOnPlateau => "reduce_lr_on_plateau",
        }
    }

    /// Whether `train.warmup_steps` applies: not to DeepSpeed's `OneCycle`
    /// (its cycle's rising half is its warmup), `LRRangeTest` (a sweep
    /// from `lr` up) or transformers' `reduce_lr_on_plateau` (which its
    /// `get_scheduler` makes without one).
    pub fn has_warmup(self) -> bool {
        !matches!(
            self,
            Schedule::OneCycle | Schedule::LrRangeTest | Schedule::ReduceLrOnPlateau
        )
    }
}

/// The shape of the warmup ramp from `warmup_start_lr` to `lr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WarmupType {
    /// Step s of W is at s/W of the way.
    #[default]
    Linear,
    /// Step s of W is at ln(s)/ln(W) of the way (DeepSpeed's default ramp).
    Log,
}

/// Compute dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        })
    }
}

/// A ZeRO stage: what ranks partition instead of replicating. Written as its
/// number in specs, metrics and checkpoints; code asks it questions by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "u8", into = "u8")]
pub enum ZeroStage {
    /// Stage 0: plain data parallelism, everything replicated.
    Disabled,
    /// Stage 1: optimizer states partitioned.
    OptimizerStates,
    /// Stage 2: optimizer states and gradients partitioned.
    Gradients,
    /// Stage 3: optimizer states, gradients and parameters partitioned.
    Weights,
}

impl ZeroStage {
    /// Every stage, lowest first.
    pub const ALL: [ZeroStage; 4] = [
        ZeroStage::Disabled,
        ZeroStage::OptimizerStates,
        ZeroStage::Gradients,
        ZeroStage::Weights,
    ];

    /// The stage's number (0-3).
    pub fn number(self) -> u8 {
        self as u8
    }

    /// Adam's moments (and mixed precision's master weights) are kept for the
    /// rank's own slice only, and each rank updates only that slice (stages 1-3).
    pub fn partitions_optimizer(self) -> bool {
        self >= ZeroStage::OptimizerStates
    }

    /// Gradients are kept for the rank's own slice only, so they are
    /// reduce-scattered after every micro-batch (stages 2-3).
    pub fn partitions_gradients(self) -> bool {
        self >= ZeroStage::Gradients
    }

    /// Parameters are kept for the rank's own slice only and gathered for each
    /// use (stage 3).
    pub fn partitions_parameters(self) -> bool {
        self == ZeroStage::Weights
    }
}

impl TryFrom<u8> for ZeroStage {
    type Error = String;
    fn try_from(n: u8) -> Result<ZeroStage, String> {
        ZeroStage::ALL
            .get(usize::from(n))
            .copied()
            .ok_or_else(|| format!("zero.stage: must be 0, 1, 2 or 3, got {n}"))
    }
}

impl From<ZeroStage> for u8 {
    fn from(s: ZeroStage) -> u8 {
        s.number()
    }
}

impl fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.number(), f)
    }
}

/// ZeRO settings (DeepSpeed's names and defaults where they exist).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ZeroSpec {
    /// 0 (data parallel), 1, 2 or 3.
    pub stage: ZeroStage,
    /// Run collectives while compute continues.
    pub overlap_comm: bool,
    /// Elements per gradient bucket.
    pub reduce_bucket_size: Size,
    /// Elements gathered ahead at stage 3.
    pub prefetch_bucket_size: Size,
    /// Parameters smaller than this stay replicated at stage 3.
    pub param_persistence_threshold: Size,
    /// Elements of a rank's slice that the optimizer updates at once.
    pub sub_group_size: Size,
    /// ZeRO++ qwZ: stage 3's forward gathers carry quantized weights.
    #[serde(alias = "zero_quantized_weights")]
    pub quantized_weights: bool,
    /// ZeRO++ hpZ: ranks per secondary partition (1 = off).
    #[serde(alias = "zero_hpz_partition_size")]
    pub hpz_partition_size: usize,
    /// ZeRO++ qgZ.
    #[serde(alias = "zero_quantized_gradients")]
    pub quantized_gradients: bool,
    /// LoCo's error feedback for qgZ; off where absent.
    #[serde(alias = "zeropp_loco_param")]
    pub loco: Option<LocoSpec>,
    /// ZeRO++'s quantization: block size and bits.
    pub quantization: QuantizationSpec,
    /// Where optimizer states live.
    pub offload_optimizer: OffloadSpec,
    /// Where parameters live (stage 3).
    pub offload_param: OffloadSpec,
}

impl Default for ZeroSpec {
    fn default() -> Self {
        Self {
            stage: ZeroStage::Disabled,
            overlap_comm: true,
            reduce_bucket_size: Size(50_000_000),
            prefetch_bucket_size: Size(50_000_000),
            param_persistence_threshold: Size(100_000),
            sub_group_size: Size(1_000_000_000),
            quantized_weights: false,
            hpz_partition_size: 1,
            quantized_gradients: false,
            loco: None,
            quantization: QuantizationSpec::default(),
            offload_optimizer: OffloadSpec::default(),
            offload_param: OffloadSpec::default(),
        }
    }
}

/// LoCo (DeepSpeed's `zeropp_loco_param`, its names and defaults): qgZ
/// keeps what quantizing lost from each value it sent and adds it to that
/// value the next time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LocoSpec {
    /// How much of the kept error stays at each update, in [0, 1).
    pub err_beta: f64,
    /// Reductions of a bucket after which its errors restart from zero.
    #[serde(alias = "reset_T")]
    pub reset_t: u64,
}

impl Default for LocoSpec {
    fn default() -> Self {
        LocoSpec {
            err_beta: 0.8,
            reset_t: 1024,
        }
    }
}

/// How ZeRO++ quantizes: blockwise symmetric, one f32 scale per block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuantizationSpec {
    /// Values per scale (even).
    pub block_size: usize,
    /// Bits per weight in qwZ's gathers (8 or 4).
    pub weight_bits: u32,
    /// Bits per gradient value in qgZ (8 or 4).
    pub gradient_bits: u32,
}

impl Default for QuantizationSpec {
    fn default() -> Self {
        Self {
            block_size: 2048,
            weight_bits: 8,
            gradient_bits: 4,
        }
    }
}

/// An offload target.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OffloadSpec {
    /// `none`, `cpu` or `nvme`.
    pub device: OffloadDevice,
    /// Directory for `nvme`.
    pub nvme_path: Option<String>,
    /// Buffers in flight while swapping (DeepSpeed's default: 4 for the
    /// optimizer, 5 for parameters).
    pub buffer_count: Option<usize>,
}

impl OffloadSpec {
    /// Whether this target is files on NVMe.
    pub fn is_nvme(&self) -> bool {
        self.device == OffloadDevice::Nvme
    }
}

/// `aio:`, DeepSpeed's settings of the NVMe swap I/O.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AioSpec {
    /// Bytes per transfer (a multiple of 4 KiB).
    pub block_size: Size,
    /// Transfers in flight (io_uring).
    pub queue_depth: usize,
    /// I/O threads (where io_uring is refused).
    pub thread_count: usize,
}

impl Default for AioSpec {
    fn default() -> Self {
        AioSpec {
            block_size: Size(1 << 20),
            queue_depth: 32,
            thread_count: 2,
        }
    }
}

/// `flops_profiler:` DeepSpeed's flops profiler, its keys and (but for
/// `top_modules`) its defaults:
/// rank 0 times step `profile_step` module by module, and zrun writes the
/// table to `output_file` and prints its summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FlopsProfilerSpec {
    /// The step profiled (1-based; later steps time without the first
    /// step's page faults).
    pub profile_step: u64,
    /// The deepest modules the detailed table lists (1: the embedding,
    /// blocks and head; 2: a block's norms, attention and MLP; 3: their
    /// products); -1 for all.
    pub module_depth: i64,
    /// Modules the summary names at each depth, by parameters, by FLOPs
    /// and by time (DeepSpeed's default names 1; zrun's 3).
    pub top_modules: usize,
    /// Whether the table lists every module (else the summary alone).
    pub detailed: bool,
    /// Where the profile goes (null: `flops_profile.txt` in `run_dir`);
    /// `${name}` expands.
    pub output_file: Option<String>,
}

impl Default for FlopsProfilerSpec {
    fn default() -> Self {
        FlopsProfilerSpec {
            profile_step: 1,
            module_depth: -1,
            top_modules: 3,
            detailed: true,
            output_file: None,
        }
    }
}

/// `comms_logger`: which collectives are tallied, and where the table goes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CommsLoggerSpec {
    /// Every collective (else those of `prof_ops` alone).
    pub prof_all: bool,
    /// The collectives tallied when `prof_all` is false, by
    /// torch.distributed's names ([`COMM_OPS`]).
    pub prof_ops: Vec<String>,
    /// Where the table goes (null: `comms_log.txt` in `run_dir`); `${name}`
    /// expands.
    pub output_file: Option<String>,
}

impl Default for CommsLoggerSpec {
    fn default() -> Self {
        CommsLoggerSpec {
            prof_all: true,
            prof_ops: Vec::new(),
            output_file: None,
        }
    }
}

impl CommsLoggerSpec {
    /// Whether collective `op` (a name of [`COMM_OPS`]) is tallied.
    pub fn logs(&self, op: &str) -> bool {
        self.prof_all || self.prof_ops.iter().any(|o| o == op)
    }
}

/// The collectives a job runs, by the names that `comms_logger.prof_ops`
/// and the metrics' `by_op` use (zproto's `Op::name`, which a test holds
/// to this list).
pub const COMM_OPS: [&str; 7] = [
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "broadcast",
    "barrier",
    "quantized_reduce_scatter",
];

/// Offload target device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OffloadDevice {
    /// Keep in place.
    #[default]
    None,
    /// Host memory.
    Cpu,
    /// Files.
    Nvme,
}

/// Collective-communication settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CommSpec {
    /// Transport choice.
    pub backend: Backend,
    /// Deadline of every collective, in seconds.
    #[serde(deserialize_with = "finite::number")]
    pub timeout_s: f64,
    /// A worker silent for this long fails the job.
    #[serde(deserialize_with = "finite::number")]
    pub heartbeat_s: f64,
}

impl Default for CommSpec {
    fn default() -> Self {
        Self {
            backend: Backend::Auto,
            timeout_s: 300.0,
            heartbeat_s: 30.0,
        }
    }
}

/// Transport choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// The best available.
    Auto,
    /// TCP sockets.
    Tcp,
    /// Shared memory within a host.
    Shm,
    /// MPI (zworker built with the `mpi` feature, started by `--launcher mpirun`).
    Mpi,
    /// NCCL on GPUs.
    Nccl,
}

/// Checkpointing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSpec {
    /// Directory; `null` disables checkpoints.
    pub dir: Option<String>,
    /// How often to save: every this many steps (0: only at the end), or
    /// each epoch's end.
    pub every: Every,
    /// Newest checkpoints kept.
    pub keep: usize,
    /// Also keep the checkpoint of the lowest validation loss (Hugging
    /// Face's `load_best_model_at_end` with `metric_for_best_model: loss`).
    pub keep_best: bool,
}

impl Default for CheckpointSpec {
    fn default() -> Self {
        Self {
            dir: None,
            every: Every::Steps(0),
            keep: 2,
            keep_best: false,
        }
    }
}

/// Where compute runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    /// The CPU.
    #[default]
    Cpu,
    /// NVIDIA GPUs.
    Cuda,
}

/// A job spec from YAML text as it stands: no `${name}` expansion, no
/// overrides, no validation ([`crate::load_job`] does those for a file).
/// For programs and tests that write their specs in memory; one
/// deserializer compiled here, not one in every crate that parses.
impl std::str::FromStr for JobSpec {
    type Err = serde_saphyr::Error;

    fn from_str(yaml: &str) -> Result<JobSpec, serde_saphyr::Error> {
        serde_saphyr::from_str(yaml)
    }
}

impl JobSpec {
    /// What of this job the GPU path (`device: cuda`) cannot run, or
    /// `None`: the GPU model is GPT-2's or LLaMA's family (Qwen2's q, k and
    /// v biases included, Qwen3's q and k norms and wider heads too) with
    /// whole linears
    /// (its products in f32 or TF32, on 16-bit working parameters under
    /// bf16/f16). NVMe offload and ZeRO++ run in the GPU's host flow, on
    /// the host code the CPU path runs.
    pub fn gpu_unsupported(&self) -> Option<String> {
        if self.model.tile_size.is_some() {
            return Some("the GPU model keeps linears whole: drop model.tile_size".into());
        }
        if self.train.progressive_layer_drop.is_some() {
            return Some(
                "train.progressive_layer_drop skips blocks on CPU workers; the GPU's resident flow runs every block: leave it out to train with the GPU"
                    .into(),
            );
        }
        if self.train.optimizer.kind == OptimizerKind::Lamb
            && self.zero.offload_optimizer.device == OffloadDevice::None
        {
            return Some(
                "train.optimizer.type: lamb runs its two passes on the host (the GPU has AdamW's and Lion's kernels): set zero.offload_optimizer.device: cpu, ZeRO-Offload, to train it with the GPU"
                    .into(),
            );
        }
        None
    }

    /// Whether the GPU runs this job's attention as attention.cu's fused
    /// kernels, `setting` being `ZRUN_GPU_ATTENTION`'s value: with `fused`
    /// always (refused where it cannot run), with `unfused` never, and
    /// unset (or `auto`) where the job can run them at a head width up to
    /// 64, where an H200 timed them 1.05-1.09x faster than the unfused
    /// path; at 128 (LLaMA's width, timed 0.97x) they stay opt-in, and so
    /// with `model.attention_dropout` (the `_dropout` kernels hash each
    /// probability's index in each of the three kernels, where the unfused
    /// path's hashes ride in passes bound by memory: not yet timed on a
    /// GPU). A GPU older than compute capability 8.0 runs the unfused path
    /// whatever this says.
    pub fn gpu_attention_fused(&self, setting: Option<&str>) -> bool {
        let hd = self.model.head_dim();
        match setting {
            Some("fused") => true,
            None | Some("auto") => {
                self.fused_attention_unsupported().is_none()
                    && hd <= 64
                    && self.model.attention_dropout() == 0.0
            }
            Some(_) => false,
        }
    }

    /// Why the GPU's fused attention (`ZRUN_GPU_ATTENTION=fused`) cannot
    /// run this job, if it cannot: it multiplies on the tensor cores
    /// (bf16 or f16, or TF32) and has kernels for head widths 16, 32 and
    /// 64, and 128 in 16 bits.
    pub fn fused_attention_unsupported(&self) -> Option<String> {
        let hd = self.model.head_dim();
        let f32 = self.train.dtype == Dtype::F32;
        if f32 && !self.train.allow_tf32 {
            Some(
                "ZRUN_GPU_ATTENTION=fused multiplies on the tensor cores: set \
                 train.dtype: bf16 (or f16) or train.allow_tf32: true"
                    .into(),
            )
        } else if hd == 128 && f32 {
            Some(
                "ZRUN_GPU_ATTENTION=fused at head width 128 multiplies in 16 bits: set \
                 train.dtype: bf16 (or f16); TF32 has kernels for widths up to 64"
                    .into(),
            )
        } else if ![16, 32, 64, 128].contains(&hd) {
            Some(format!(
                "ZRUN_GPU_ATTENTION=fused has kernels for head widths 16, 32, 64 and 128; \
                 the model's is {hd}"
            ))
        } else if self.model.attention_dropout() > 0.0 && self.model.seq_len > FUSED_DROPOUT_MAX_T {
            Some(format!(
                "ZRUN_GPU_ATTENTION=fused with model.attention_dropout takes sequences of up to \
                 {FUSED_DROPOUT_MAX_T} (the mask's index within a head is 32-bit); \
                 model.seq_len is {}",
                self.model.seq_len
            ))
        } else {
            None
        }
    }
}

/// The longest sequence attention.cu's dropout kernels take: a probability's
/// index within its head's `t × t` matrix is 32-bit there.
pub const FUSED_DROPOUT_MAX_T: usize = 65_535;

/// How often a run validates or saves: every so many steps (0: only after
/// the last step), or `epoch`: after each step that finishes a pass over
/// the training data (transformers' `eval_strategy` / `save_strategy:
/// "epoch"`). The epochs run into each other (no partial batch), so an
/// epoch ends inside the step that takes its last sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Every {
    /// Every this many steps (0: none but after the last).
    Steps(u64),
    /// After each step that finishes an epoch.
    Epoch,
}

impl Every {
    /// Whether it happens after `step` (1-based), which took the global
    /// sequences `before..after` of epochs of `sequences`.
    pub fn due(self, step: u64, (before, after): (u64, u64), sequences: u64) -> bool {
        match self {
            Every::Steps(n) => n > 0 && step.is_multiple_of(n),
            Every::Epoch => sequences > 0 && after / sequences > before / sequences,
        }
    }

    /// Whether it happens before the end at all (not `Steps(0)`).
    pub fn is_set(self) -> bool {
        self != Every::Steps(0)
    }
}

impl std::fmt::Display for Every {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Every::Steps(n) => write!(f, "{n}"),
            Every::Epoch => f.write_str("epoch"),
        }
    }
}

impl Serialize for Every {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Every::Steps(n) => s.serialize_u64(*n),
            Every::Epoch => s.serialize_str("epoch"),
        }
    }
}

impl<'de> Deserialize<'de> for Every {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Every, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Every;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a whole number ≥ 0 or \"epoch\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Every, E> {
                Ok(Every::Steps(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Every, E> {
                u64::try_from(v)
                    .map(Every::Steps)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Every, E> {
                if v >= 0.0 && v.fract() == 0.0 && v < 2f64.powi(64) {
                    Ok(Every::Steps(v as u64))
                } else {
                    Err(E::invalid_value(serde::de::Unexpected::Float(v), &self))
                }
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Every, E> {
                match v {
                    "epoch" => Ok(Every::Epoch),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// A count that accepts `5e7`, `50000000`, `"64MiB"`, `"2k"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Size(pub u64);

/// Parses a quantity: a number (`5e7`, `1.5`) with an optional unit. Letter
/// units are decimal, as in parameter counts (`k` 1e3, `M` 1e6, `G` or `B`
/// 1e9, `T` 1e12); `KiB`, `MiB`, `GiB`, `TiB` are binary. The one parser for
/// every size and count zrun accepts (spec keys, `--sizes`, `--params`).
pub fn parse_quantity(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: f64 = match unit.trim() {
        "" => 1.0,
        "k" | "K" => 1e3,
        "M" => 1e6,
        "G" | "B" => 1e9,
        "T" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        u => {
            return Err(format!(
            "unknown unit `{u}` in `{s}` (use k, M, G, T (decimal) or KiB, MiB, GiB, TiB (binary))"
        ))
        }
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number with an optional unit, like 5e7 or 64MiB"))?;
    let q = v * mult;
    if !(q.is_finite() && q >= 0.0) {
        return Err(format!("`{s}` must be a non-negative number"));
    }
    Ok(q)
}

impl Size {
    /// Parses a whole, non-negative size ([`parse_quantity`]'s units).
    pub fn parse(s: &str) -> Result<Size, String> {
        Size::from_f64(parse_quantity(s)?)
            .ok_or_else(|| format!("`{s}` is not a non-negative whole size"))
    }

    fn from_f64(v: f64) -> Option<Size> {
        (v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v < 1.8e19).then_some(Size(v as u64))
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Size;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size such as 5e7, 50000000 or \"64MiB\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Size, E> {
                Ok(Size(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Size, E> {
                u64::try_from(v)
                    .map(Size)
                    .map_err(|_| E::custom("a size cannot be negative"))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Size, E> {
                Size::from_f64(v).ok_or_else(|| E::custom(format!("{v} is not a whole size")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Size, E> {
                Size::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// The float keys take finite numbers only. YAML's `.nan` and `.inf` parse
/// as floats, but JSON, which every spec passes through for `--set` and
/// ds_config imports, has neither: they would become `null` there and fail
/// with no line to point at.
pub(crate) mod finite {
    use serde::{de::Error, Deserialize, Deserializer};

    /// A finite `f64`.
    pub fn number<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        check(f64::deserialize(d)?)
    }

    /// An absent or finite `f64`.
    pub fn optional<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        Option::<f64>::deserialize(d)?.map(check).transpose()
    }

    /// Two finite `f64`s.
    pub fn pair<'de, D: Deserializer<'de>>(d: D) -> Result<[f64; 2], D::Error> {
        let [a, b] = <[f64; 2]>::deserialize(d)?;
        Ok([check(a)?, check(b)?])
    }

    fn check<E: Error>(v: f64) -> Result<f64, E> {
        if v.is_finite() {
            Ok(v)
        } else {
            Err(E::custom(format!("expected a finite number, got {v}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `checkpoint.every` and `train.eval_every` read a count or `epoch`,
    /// write it back the same, and fall due every so many steps or on the
    /// step that takes an epoch's last sequence.
    #[test]
    fn every_is_steps_or_each_epochs_end() {
        let read = |v: &str| -> Result<Every, String> {
            let text =
                format!("model: {{}}\ndata: {{format: synthetic}}\ncheckpoint: {{every: {v}}}\n");
            text.parse::<JobSpec>()
                .map(|j| j.checkpoint.every)
                .map_err(|e| e.to_string())
        };
        assert_eq!(read("4"), Ok(Every::Steps(4)));
        assert_eq!(read("0"), Ok(Every::Steps(0)));
        assert_eq!(read("epoch"), Ok(Every::Epoch));
        for bad in ["-1", "2.5", "epochs", "[1]"] {
            let e = read(bad).unwrap_err();
            assert!(
                e.contains("expected a whole number ≥ 0 or \"epoch\""),
                "{bad}: {e}"
            );
        }
        for every in [Every::Steps(3), Every::Epoch] {
            let json = serde_json::to_value(every).unwrap();
            assert_eq!(serde_json::from_value::<Every>(json).unwrap(), every);
        }
        // 10 sequences an epoch, 4 a step: epochs end inside steps 3, 5, 8.
        let took = |s: u64| ((s - 1) * 4, s * 4);
        let due = |e: Every| {
            (1..=10)
                .filter(|&s| e.due(s, took(s), 10))
                .collect::<Vec<_>>()
        };
        assert_eq!(due(Every::Epoch), [3, 5, 8, 10]);
        assert_eq!(due(Every::Steps(4)), [4, 8]);
        assert!(due(Every::Steps(0)).is_empty());
        assert!(!Every::Steps(0).is_set() && Every::Epoch.is_set());
    }

    #[test]
    fn env_values_may_be_scalars() {
        let j: JobSpec = "model: {}\ndata: {format: synthetic}\nenv: {A: 4, B: true, C: x}\n"
            .parse()
            .unwrap();
        assert_eq!(j.env.get("A").map(String::as_str), Some("4"));
        assert_eq!(j.env.get("B").map(String::as_str), Some("true"));
        let err = "model: {}\ndata: {}\nenv: {A: [1]}\n"
            .parse::<JobSpec>()
            .unwrap_err();
        assert!(err.to_string().contains("line 3"), "{err}");
    }

    #[test]
    fn sizes_parse_in_every_spelling() {
        assert_eq!(Size::parse("5e7").unwrap(), Size(50_000_000));
        assert_eq!(Size::parse("64MiB").unwrap(), Size(64 << 20));
        assert_eq!(Size::parse("2k").unwrap(), Size(2000));
        assert_eq!(Size::parse("64M").unwrap(), Size(64_000_000));
        assert_eq!(Size::parse("2G").unwrap(), Size(2_000_000_000));
        assert_eq!(Size::parse("2GiB").unwrap(), Size(2 << 30));
        assert_eq!(Size::parse("3KiB").unwrap(), Size(3072));
        assert_eq!(Size::parse("1TiB").unwrap(), Size(1 << 40));
        assert_eq!(parse_quantity("1.3B").unwrap(), 1.3e9);
        assert!(
            Size::parse("64Mi").is_err(),
            "only the full binary spelling"
        );
        assert!(Size::parse("64mb").is_err());
        assert_eq!(Size::parse("1.5GiB").unwrap(), Size(3 << 29));
        assert!(Size::parse("12 parsecs").is_err());
        assert!(Size::parse("-3").is_err());
        assert!(Size::parse("0.5").is_err());
    }
}
