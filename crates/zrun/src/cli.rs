//! Command-line flags (DeepSpeed / torchrun spellings where they exist).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Train transformer models with ZeRO data parallelism.
#[derive(Debug, Parser)]
#[command(name = "zrun", version, about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// zrun's commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a training job.
    Train(TrainArgs),
    /// Validate a job; print the resolved spec and topology.
    Check(CheckArgs),
    /// Measure throughput.
    Bench(BenchArgs),
    /// Predict memory per device for every ZeRO stage and offload choice.
    Estimate(EstimateArgs),
    /// Rank the configurations of a job that fit memory by predicted speed.
    Plan(PlanArgs),
    /// Consolidate a checkpoint into one f32 safetensors file.
    Export(ExportArgs),
    /// Generate text from a checkpoint (byte-level, or with a tokenizer).
    Sample(SampleArgs),
    /// A model's loss and perplexity on held-out data.
    Eval(EvalArgs),
    /// Tokenize text, JSONL or Parquet files into token files for training.
    Prepare(PrepareArgs),
}

/// `zrun prepare`.
#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// Text files, JSONL files (`.jsonl`, `.ndjson`) or Parquet files
    /// (`.parquet`, a row a record), or glob patterns.
    #[arg(value_name = "INPUT", required = true)]
    pub inputs: Vec<String>,
    /// A Hugging Face `tokenizer.json`, or the model directory that holds
    /// one (local; nothing is downloaded).
    #[arg(long, value_name = "tokenizer.json", value_parser = tokenizer_file)]
    pub tokenizer: PathBuf,
    /// Where `train.bin`, `val.bin` and `manifest.json` go.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// The record's field (JSONL key, Parquet column) that holds the text, or a conversation (a list of
    /// messages with a `role` and a `content`: laid out with the chat
    /// template, as `apply_chat_template` lays it out) [default: `text`,
    /// else `messages`, else TRL's `prompt` and `completion`].
    #[arg(long)]
    pub field: Option<String>,
    /// The chat template conversations are laid out with, a Jinja file
    /// (default: the one beside --tokenizer: `chat_template.jinja`,
    /// `chat_template.json` or `tokenizer_config.json`, as `transformers`
    /// looks).
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// A variable for the chat template in every conversation, KEY=VALUE
    /// with VALUE as JSON, else as a string (`enable_thinking=false` for
    /// Qwen3); a record's own `chat_template_kwargs` override it;
    /// repeatable.
    #[arg(long, value_name = "KEY=VALUE")]
    pub chat_arg: Vec<String>,
    /// The share of pieces (records, or 64 KiB stretches of text) that go to
    /// `val.bin`, spread evenly.
    #[arg(long, default_value_t = 0.01)]
    pub val_fraction: f64,
    /// The token put after each document (default: the tokenizer's
    /// `<|endoftext|>`, `</s>`, `<|end_of_text|>` or `<eos>`); `none` for none.
    #[arg(long, value_name = "TOKEN")]
    pub eos: Option<String>,
    /// Train on the assistant's turns alone (TRL's `assistant_only_loss`):
    /// JSONL conversations (the turns where the template's `{% generation
    /// %}` blocks say, else found by prefix renderings) or prompt-completion
    /// records only; writes a loss mask (`train.mask`, `val.mask`: a byte
    /// per token) that `zrun train` applies, the loss averaged over the
    /// step's trained tokens.
    #[arg(long)]
    pub assistant_only_loss: bool,
    /// Whether the loss is kept to the completions of prompt-completion
    /// records (TRL's `completion_only_loss`, on for them by default; the
    /// mask is written only where some token is left out); `false` trains
    /// on their prompts too.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub completion_only_loss: bool,
    /// Replace the output of an earlier `zrun prepare` in DIR.
    #[arg(long)]
    pub overwrite: bool,
}

/// `zrun sample`.
#[derive(Debug, Args)]
pub struct SampleArgs {
    /// A checkpoint directory (`step-N/`), a checkpoint root (its newest),
    /// or a Hugging Face GPT-2, LLaMA, Qwen2, Qwen3, Mistral or Phi-3 directory (`config.json` and
    /// `model.safetensors`, or shards with `model.safetensors.index.json`:
    /// `zrun export --format hf`'s, `save_pretrained`'s, or a published one).
    #[arg(value_name = "CHECKPOINT_DIR")]
    pub checkpoint: PathBuf,
    /// The text to continue (encoded as bytes, or with --tokenizer); with
    /// --chat, the user's message.
    #[arg(long)]
    pub prompt: String,
    /// The Hugging Face tokenizer.json the model's data was prepared with
    /// (needed for any model but a byte-level one; a Hugging Face directory's
    /// own `tokenizer.json` by default), or the directory that holds it.
    #[arg(long, value_name = "tokenizer.json", value_parser = tokenizer_file)]
    pub tokenizer: Option<PathBuf>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    pub tokens: usize,
    /// Softmax temperature; 0 takes the most likely token every time.
    /// Default 0.8, or what a Hugging Face directory's
    /// `generation_config.json` says (its `do_sample: false`: 0).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Draw among the K most likely tokens (0: all). Default 0, or the
    /// directory's `generation_config.json`'s `top_k`.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Nucleus sampling: draw among the fewest most likely tokens whose
    /// probabilities add up to at least P (0 < P ≤ 1; 1: all). Default 1,
    /// or the directory's `generation_config.json`'s `top_p`.
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Min-p sampling: then draw among the tokens at least P times as
    /// likely as the likeliest (0 ≤ P ≤ 1; 0: all). Default 0, or the
    /// directory's `generation_config.json`'s `min_p`.
    #[arg(long)]
    pub min_p: Option<f64>,
    /// Hugging Face's repetition penalty: the logit of each token already
    /// in the text (prompt or drawn) divided by R where positive, times R
    /// where negative, before the draw, greedy too (R > 0; 1: none).
    /// Default 1, or the directory's `generation_config.json`'s
    /// `repetition_penalty`.
    #[arg(long, value_name = "R")]
    pub repetition_penalty: Option<f64>,
    /// End the text where one of these strings is first completed (printed
    /// through it), as `generate`'s `stop_strings`; repeatable. Default:
    /// the directory's `generation_config.json`'s `stop_strings`. Needs a
    /// tokenizer (a byte-level model's bytes are written as drawn).
    #[arg(long, value_name = "TEXT")]
    pub stop_string: Vec<String>,
    /// Seed of the draws (the same seed repeats the text).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Go on past the end-of-text token. By default the text ends there, as
    /// Hugging Face's `generate` ends it: the token a Hugging Face
    /// directory's `generation_config.json` (or `config.json`) names as
    /// `eos_token_id`, else the tokenizer's `<|endoftext|>`, `</s>`,
    /// `<|end_of_text|>` or `<eos>` (what `zrun prepare` put after each
    /// document).
    #[arg(long)]
    pub ignore_eos: bool,
    /// The prompt is a user's message: lay it out with the model's chat
    /// template, as `transformers`' `apply_chat_template(...,
    /// add_generation_prompt=True)` does, and continue from there (the
    /// assistant's reply). The template is a Hugging Face directory's
    /// `chat_template.jinja`, `chat_template.json` or `tokenizer_config.json`
    /// (for a zrun checkpoint: the directory of --tokenizer), or
    /// --chat-template.
    #[arg(long)]
    pub chat: bool,
    /// A system message before the prompt (implies --chat).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// The conversation so far, which the prompt continues as the user's
    /// next message: a JSON file of messages (`[{"role": "user",
    /// "content": ...}, {"role": "assistant", ...}]`, or a `{"messages":
    /// [...]}` record, whose `tools` and `chat_template_kwargs` are taken
    /// too), laid out before it (implies --chat).
    #[arg(long, value_name = "FILE")]
    pub conversation: Option<PathBuf>,
    /// The tools the model may call, a JSON file: a list of their JSON
    /// schemas (`[{"type": "function", "function": {"name": ...,
    /// "parameters": {...}}}]`), laid out where the template lays tools out
    /// (`apply_chat_template(tools=...)`; implies --chat).
    #[arg(long, value_name = "FILE")]
    pub tools: Option<PathBuf>,
    /// The chat template to use, a Jinja file (implies --chat).
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// A variable for the chat template, KEY=VALUE with VALUE as JSON, else
    /// as a string (`enable_thinking=false` for Qwen3); repeatable
    /// (implies --chat).
    #[arg(long, value_name = "KEY=VALUE")]
    pub chat_arg: Vec<String>,
    /// Path of the zworker binary (default: next to zrun).
    #[arg(long, value_name = "PATH")]
    pub worker_bin: Option<PathBuf>,
}

impl SampleArgs {
    /// Whether the prompt goes through a chat template.
    pub fn chats(&self) -> bool {
        self.chat
            || self.system.is_some()
            || self.conversation.is_some()
            || self.tools.is_some()
            || self.chat_template.is_some()
            || !self.chat_arg.is_empty()
    }
}

/// `zrun eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// A checkpoint directory (`step-N/`), a checkpoint root (its newest),
    /// or a Hugging Face model directory.
    #[arg(value_name = "CHECKPOINT|HF_DIR")]
    pub checkpoint: PathBuf,
    /// The held-out data: a token file of `zrun prepare` (its format and
    /// loss mask from the manifest beside it), or a text file (tokenized
    /// with --tokenizer or a Hugging Face directory's `tokenizer.json`;
    /// bytes for a byte-level model).
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// The tokenizer.json a text file is tokenized with, or the directory
    /// that holds it (default: a Hugging Face directory's own).
    #[arg(long, value_name = "tokenizer.json", value_parser = tokenizer_file)]
    pub tokenizer: Option<PathBuf>,
    /// How FILE is stored where no manifest beside it says: `text`,
    /// `tokens_u16` or `tokens_u32`.
    #[arg(long, value_name = "FORMAT")]
    pub format: Option<String>,
    /// Windows start every N tokens (1 ≤ N ≤ the model's seq_len; default
    /// seq_len, training's disjoint windows); each scores the targets the
    /// ones before it did not, so a smaller N gives each more context, for
    /// more forwards (Hugging Face's sliding-window perplexity).
    #[arg(long, value_name = "N")]
    pub stride: Option<usize>,
    /// Score the first N tokens of FILE only.
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<usize>,
    /// Score each document alone, as training with
    /// `data.separate_documents` does: windows start at each document's
    /// first token and the target after an end-of-text id is not scored.
    #[arg(long)]
    pub separate_documents: bool,
    /// The end-of-text id that ends a document, for --separate-documents
    /// (default: the `eos_id` of the manifest beside FILE).
    #[arg(long, value_name = "ID")]
    pub eos: Option<u32>,
    /// Path of the zworker binary (default: next to zrun).
    #[arg(long, value_name = "PATH")]
    pub worker_bin: Option<PathBuf>,
}

/// `zrun export`.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// A checkpoint directory (`step-N/`), or a checkpoint root (its newest).
    #[arg(value_name = "CHECKPOINT_DIR")]
    pub checkpoint: PathBuf,
    /// The safetensors file to write (`--format hf`: the directory).
    #[arg(long, value_name = "PATH")]
    pub out: PathBuf,
    /// `zrun`: one safetensors file under zrun's names (what `init_from` and
    /// `zrun sample` read); `hf`: a Hugging Face model directory
    /// (`config.json` + `model.safetensors`) that `transformers` loads.
    #[arg(long, value_enum, default_value_t = ExportFormat::Zrun)]
    pub format: ExportFormat,
    /// `--format hf`: the Hugging Face directory whose tokenizer
    /// (`tokenizer.json`, `tokenizer_config.json` with its chat template,
    /// the special tokens...) and `generation_config.json` go beside the
    /// weights, so that `transformers` and `zrun sample` take the export as
    /// they took that model (default: the job's `model.init_from`, or the
    /// directory of its weights file; `none`: no files but the model's).
    #[arg(long, value_name = "DIR|none")]
    pub tokenizer_from: Option<PathBuf>,
    /// Replace an earlier export at `--out` (by default an existing file,
    /// or a directory holding `config.json` or `model.safetensors`, is kept
    /// and the command exits 2).
    #[arg(long)]
    pub overwrite: bool,
}

/// What `zrun export` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    /// zrun's names, one file.
    Zrun,
    /// Hugging Face's names and layout, a directory.
    Hf,
}

/// `zrun estimate`.
#[derive(Debug, Args)]
pub struct EstimateArgs {
    /// A job spec: its model, dtype, micro-batch and (with --hostfile) topology.
    #[arg(value_name = "JOB.yaml", conflicts_with = "params")]
    pub job: Option<PathBuf>,
    /// Or a parameter count (`7.5e9`, `1.3B`, `350M`), with mixed-precision
    /// AdamW unless --dtype / --optimizer say otherwise.
    #[arg(long, value_name = "N")]
    pub params: Option<String>,
    /// With --params: the training dtype, bf16 unless set (a job says its
    /// own).
    #[arg(long, value_name = "DTYPE", value_parser = ["f32", "bf16", "f16"])]
    pub dtype: Option<String>,
    /// With --params: the update rule, whose moments the optimizer state
    /// holds: adamw unless set (a job says its own).
    #[arg(long, value_name = "RULE", value_parser = ["adamw", "adam", "lion", "lamb", "adagrad"])]
    pub optimizer: Option<String>,
    /// Nodes (default 1, or the hostfile's).
    #[arg(long, value_name = "N")]
    pub nodes: Option<usize>,
    /// Workers per node (default 2, or the hostfile's).
    #[arg(long, value_name = "N")]
    pub workers_per_node: Option<usize>,
    /// Hosts and slots, for a job's topology.
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// Override a job-spec key (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Also predict stage 3's and ZeRO++'s bytes across nodes and step time.
    #[arg(long)]
    pub comm: bool,
    /// With --comm: each node's inter-node bandwidth, Gbit/s.
    #[arg(long, value_name = "GBPS", default_value_t = 100.0, requires = "comm")]
    pub link_gbps: f64,
    /// With --comm: the compute rate each worker achieves, TFLOP/s (40: a
    /// V100 at a third of its fp16 peak).
    #[arg(long, value_name = "TFLOPS", default_value_t = 40.0, requires = "comm")]
    pub worker_tflops: f64,
    /// With --comm: tokens per worker per step (default: the job's micro-batch
    /// x sequence x accumulation, or 1024 with --params).
    #[arg(long, value_name = "N", requires = "comm")]
    pub tokens_per_worker: Option<f64>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Where and how workers start.
#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// Hosts and slots (DeepSpeed format). Default: this host only.
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// Use only these hosts/slots: `host1:0,1@host2`.
    #[arg(long, value_name = "SPEC")]
    pub include: Option<String>,
    /// Leave out these hosts/slots: `host1:0,1@host2`.
    #[arg(long, value_name = "SPEC")]
    pub exclude: Option<String>,
    /// Use the first N nodes.
    #[arg(long, value_name = "N")]
    pub num_nodes: Option<usize>,
    /// Workers per node (default without a hostfile: 2).
    #[arg(long, value_name = "N")]
    pub workers_per_node: Option<usize>,
    /// How to start workers (default: local for loopback hosts, ssh otherwise).
    #[arg(long, value_enum)]
    pub launcher: Option<Launcher>,
    /// Private key for SSH (default: ssh-agent, then ~/.ssh/id_ed25519, id_rsa).
    #[arg(long, value_name = "FILE")]
    pub ssh_key: Option<PathBuf>,
    /// Host keys to verify against (default ~/.ssh/known_hosts).
    #[arg(long, value_name = "FILE")]
    pub known_hosts: Option<PathBuf>,
    /// Add unknown host keys to the known-hosts file instead of refusing them.
    #[arg(long)]
    pub ssh_accept_new: bool,
    /// The SSH port of hosts whose hostfile line has no `port=` (DeepSpeed's
    /// `--ssh_port`).
    #[arg(long, alias = "ssh_port", value_name = "PORT", default_value_t = 22)]
    pub ssh_port: u16,
    /// Address workers use to reach zrun's control socket (per-node mode:
    /// node 0's address; default `MASTER_ADDR`).
    #[arg(long, value_name = "ADDR")]
    pub master_addr: Option<String>,
    /// Port of the control socket (default: any free port; per-node mode:
    /// `MASTER_PORT`, else 29500).
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,
    /// Path of the zworker binary (default: next to zrun); a wrapper that
    /// runs zworker with the arguments it is given works too (a script
    /// around `perf record -o out.data zworker "$@"`, to profile workers).
    #[arg(long, value_name = "PATH")]
    pub worker_bin: Option<PathBuf>,
    /// Pin each worker to an equal share of its host's physical cores, in
    /// local-rank order, with as many compute threads as cores (DeepSpeed's
    /// `--bind_cores_to_rank`).
    #[arg(long, alias = "bind_cores_to_rank")]
    pub bind_cores_to_rank: bool,
    /// The cores to share out instead of all: `0-3,8-11` (DeepSpeed's
    /// `--bind_core_list`, ascending, without overlaps); implies
    /// `--bind-cores-to-rank`.
    #[arg(long, alias = "bind_core_list", value_name = "LIST")]
    pub bind_core_list: Option<String>,
    /// Each worker's output in a file of its own in DIR
    /// (`{launch time}_rank{R}.log`) instead of on the console (DeepSpeed's
    /// `--enable_each_rank_log`).
    #[arg(long, alias = "enable_each_rank_log", value_name = "DIR")]
    pub enable_each_rank_log: Option<PathBuf>,
    /// More arguments for `srun` or `mpirun`, quoted as one and split as a
    /// shell would: `--launcher-args "--partition=debug --exclusive"`
    /// (DeepSpeed's `--launcher_args`).
    #[arg(
        long,
        alias = "launcher_args",
        value_name = "ARGS",
        allow_hyphen_values = true
    )]
    pub launcher_args: Option<String>,
}

/// How workers start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Launcher {
    /// Child processes of zrun on this host.
    Local,
    /// Over SSH.
    Ssh,
    /// With srun inside a Slurm allocation.
    Slurm,
    /// With Open MPI's `mpirun` (hosts from the hostfile); the workers join
    /// through MPI, and `comm.backend: mpi` (or `auto`) moves their bytes over it.
    Mpirun,
}

/// `zrun train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The job spec (YAML).
    #[arg(value_name = "JOB.yaml")]
    pub job: PathBuf,
    /// Launch options.
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// Override a job-spec key: `--set zero.reduce_bucket_size=1e6` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// A DeepSpeed config whose keys set the job's (in place of the job's
    /// `deepspeed:` key; `--set` still has the last word).
    #[arg(long, value_name = "ds_config.json")]
    pub deepspeed: Option<PathBuf>,
    /// Metrics JSONL path (default RUN_DIR/metrics.jsonl).
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
    /// Resume from a checkpoint directory, or `auto`.
    #[arg(long, value_name = "DIR|auto")]
    pub resume: Option<String>,
    /// Plain log lines instead of a progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Replace the metrics of an earlier run instead of keeping them as
    /// `metrics.N.jsonl`.
    #[arg(long)]
    pub overwrite: bool,
    /// When training fails (exit 1: a worker's crash, kill, error or hang),
    /// relaunch from the newest checkpoint, at most N times (needs
    /// `checkpoint.dir`).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub max_restarts: u32,
    /// With --max-restarts: relaunch without the node of the rank that failed
    /// (when the failure names one and other nodes remain).
    #[arg(long, requires = "max_restarts")]
    pub restart_exclude_failed: bool,
    /// Per-node mode (one zrun per node, started by the cluster).
    #[command(flatten)]
    pub per_node: PerNodeArgs,
}

/// Per-node mode: each node's zrun starts its own workers and node 0's is the
/// job's control plane (like `torchrun --nnodes --node-rank`). Given either of
/// `--nnodes` / `--node-rank`, the other comes from the environment when absent
/// (`NNODES`, `WORLD_SIZE`, `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`; `NODE_RANK`,
/// `RANK`, `OMPI_COMM_WORLD_RANK`, `PMI_RANK`).
#[derive(Debug, Args, Default)]
pub struct PerNodeArgs {
    /// Number of nodes, each running its own `zrun train` with the same job.
    #[arg(long, value_name = "N")]
    pub nnodes: Option<usize>,
    /// This node's rank (0: the job's control plane).
    #[arg(long, value_name = "R")]
    pub node_rank: Option<usize>,
    /// File holding the job token (hex, e.g. from `openssl rand -hex 32`);
    /// default `ZRUN_TOKEN`. Never on the command line.
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Address this node's workers listen on for their peers (default: each
    /// finds its address on the route to node 0).
    #[arg(long, value_name = "ADDR")]
    pub node_addr: Option<String>,
}

/// `zrun plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The job spec (YAML).
    #[arg(value_name = "JOB.yaml")]
    pub job: PathBuf,
    /// Launch options (the topology to plan for).
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// Override a job-spec key (repeatable), as for `zrun train`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// A DeepSpeed config (JSON) whose keys set the job's.
    #[arg(long, value_name = "ds_config.json")]
    pub deepspeed: Option<PathBuf>,
    /// Write the best configuration as a job file that `zrun train` runs.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Replace an existing `--out` file (by default it is kept, exit 2,
    /// before anything is measured).
    #[arg(long)]
    pub overwrite: bool,
    /// Train the best three for a few steps; print predicted against measured.
    #[arg(long)]
    pub verify: bool,
    /// Steps per configuration with --verify.
    #[arg(long, default_value_t = 8)]
    pub verify_steps: u64,
    /// Rows of the table.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Memory per worker (default: 90% of this host's available memory over
    /// the workers per node).
    #[arg(long, value_name = "GIB")]
    pub memory_gib: Option<f64>,
    /// Bandwidth between nodes in Gbit/s (default: what loopback TCP measured).
    #[arg(long, value_name = "GBPS")]
    pub link_gbps: Option<f64>,
    /// Measure the machine again instead of using the cached figures.
    #[arg(long)]
    pub remeasure: bool,
}

/// `zrun check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The job spec (YAML).
    #[arg(value_name = "JOB.yaml")]
    pub job: PathBuf,
    /// Launch options.
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// Override a job-spec key (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// A DeepSpeed config whose keys set the job's: printed beside the
    /// resolved job, key by key.
    #[arg(long, value_name = "ds_config.json")]
    pub deepspeed: Option<PathBuf>,
}

/// `zrun bench`: `zrun bench JOB.yaml --sweep KEY=V1,V2`, `bench comm`, `bench kernels` or `bench io`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct BenchArgs {
    /// What to measure, if not a job.
    #[command(subcommand)]
    pub what: Option<BenchWhat>,
    /// A throughput sweep of a job.
    #[command(flatten)]
    pub job: BenchJobArgs,
}

/// `zrun bench JOB.yaml --sweep KEY=V1,V2 [--sweep ...]`.
#[derive(Debug, Args)]
pub struct BenchJobArgs {
    /// The job spec to sweep.
    #[arg(value_name = "JOB.yaml")]
    pub job: Option<PathBuf>,
    /// A key and its values (repeatable; every combination runs).
    #[arg(long, value_name = "KEY=V1,V2")]
    pub sweep: Vec<String>,
    /// Steps per configuration (the first is not timed).
    #[arg(long, default_value_t = 5)]
    pub steps: u64,
    /// Where bench.csv, bench.json, bench.svg and the runs' metrics go.
    #[arg(long, value_name = "DIR", default_value = "bench-out")]
    pub out: PathBuf,
    /// Replace an earlier sweep's tables in `--out` (by default they are
    /// kept, exit 2, before anything runs).
    #[arg(long)]
    pub overwrite: bool,
    /// Fixed overrides for every configuration (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Launch options.
    #[command(flatten)]
    pub launch: LaunchArgs,
}

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchWhat {
    /// Collective bandwidth between local workers.
    Comm(BenchCommArgs),
    /// CPU kernels (AdamW, reduction, GEMM) against this machine's memory bandwidth.
    Kernels(BenchKernelsArgs),
    /// The NVMe swap layer's read and write bandwidth against buffered and
    /// plain O_DIRECT transfers in the same directory.
    Io(BenchIoArgs),
}

/// `zrun bench io`.
#[derive(Debug, Args)]
pub struct BenchIoArgs {
    /// Directory to measure (a job's `nvme_path`).
    #[arg(long, value_name = "DIR")]
    pub path: PathBuf,
    /// Bytes per transfer: `64MiB` (binary) or `64M` (decimal), as everywhere.
    #[arg(long, value_delimiter = ',', default_values_t = ["1MiB".to_string(), "8MiB".to_string(), "64MiB".to_string()])]
    pub sizes: Vec<String>,
    /// Bytes each method writes and reads per size.
    #[arg(long, default_value = "1GiB")]
    pub total: String,
    /// The swapper's `aio.block_size`.
    #[arg(long, default_value = "1MiB")]
    pub block_size: String,
    /// The swapper's `aio.queue_depth`.
    #[arg(long, default_value_t = 32)]
    pub queue_depth: usize,
    /// The swapper's `aio.thread_count`.
    #[arg(long, default_value_t = 2)]
    pub thread_count: usize,
    /// Swapper transfers outstanding (a job's `buffer_count`).
    #[arg(long, default_value_t = 4)]
    pub in_flight: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `zrun bench kernels`.
#[derive(Debug, Args)]
pub struct BenchKernelsArgs {
    /// Elements per array (large enough to leave the caches).
    #[arg(long, default_value_t = 1 << 24)]
    pub elements: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Path of the zworker binary (default: next to zrun).
    #[arg(long, value_name = "PATH")]
    pub worker_bin: Option<PathBuf>,
}

/// `zrun bench comm`.
#[derive(Debug, Args)]
pub struct BenchCommArgs {
    /// Workers (local processes).
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Message sizes in bytes: `64MiB` (binary) or `64M` (decimal), as everywhere.
    #[arg(long, value_delimiter = ',', default_values_t = ["1MiB".to_string(), "16MiB".to_string(), "64MiB".to_string()])]
    pub sizes: Vec<String>,
    /// Collectives to time (default: every one the transport runs: all_reduce,
    /// reduce_scatter, all_gather, all_to_all, broadcast; over nccl the first three).
    /// `all_reduce_bf16`, `reduce_scatter_bf16` (or `_f16`): the reductions in
    /// 16 bits on the wire, as `train.reduce_dtype` runs them.
    #[arg(long, value_delimiter = ',')]
    pub ops: Vec<String>,
    /// Transports to measure: tcp, shm, mpi, nccl (default: tcp and shm).
    #[arg(long, value_delimiter = ',')]
    pub transports: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Path of the zworker binary (default: next to zrun).
    #[arg(long, value_name = "PATH")]
    pub worker_bin: Option<PathBuf>,
}

/// `--tokenizer`: a `tokenizer.json`, or a model directory taken as its
/// `tokenizer.json`, as `AutoTokenizer.from_pretrained` takes a directory
/// (the chat template and special tokens are then read beside it).
fn tokenizer_file(given: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(given);
    if !path.is_dir() {
        return Ok(path);
    }
    let file = path.join("tokenizer.json");
    match file.is_file() {
        true => Ok(file),
        false => Err(format!(
            "{given}: a directory without a tokenizer.json (zrun reads Hugging Face's fast tokenizers)"
        )),
    }
}
