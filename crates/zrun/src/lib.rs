//! zrun: the launcher. It reads the job, starts one `zworker` per slot, serves
//! the control socket they report to, draws progress, writes metrics, and ends
//! the job cleanly (no process left behind) however it ends.
//!
//! Layout:
//! - [`cli`]: clap's flags, as users type them.
//! - [`plan`]: flags + spec + hostfile validated into a [`plan::LaunchPlan`], once,
//!   before anything starts (bad input: exit 2).
//! - [`server`]: the tokio control server: token challenge, key-value store,
//!   per-worker message streams.
//! - [`launch`]: starting local workers in their own process groups and killing
//!   those groups.
//! - [`ssh`]: starting workers on other hosts over SSH, verifying host keys, and
//!   killing them there.
//! - [`worker`]: what launchers and the supervisor share (a worker's job
//!   environment, process events, SSH options); a leaf, so arrows go one way.
//! - [`train`]: `zrun train`: checks before launch, metrics file, `done` line.
//! - [`pernode`]: per-node mode (`--nnodes`, `--node-rank`): node 0's zrun is
//!   the job; every other node's zrun joins it and relays its own workers.
//! - [`supervise`]: the event loop that turns worker messages, exits, heartbeats
//!   and signals into an outcome and an exit code.
//! - [`sink`]: where reports go (metrics and progress, or benchmark rows).
//! - [`progress`]: the progress bar, or plain lines when not on a terminal.
//! - [`rundir`]: run locks and the metrics file (nothing lost, nothing shared).
//! - [`metrics`]: aggregation of per-rank step reports into `metrics.jsonl` lines.
//! - [`bench`](mod@bench): `zrun bench comm` and `bench kernels`.
//! - [`sweep`]: `zrun bench JOB.yaml --sweep`: throughput sweeps, table, CSV, JSON, SVG.
//! - [`estimate`]: `zrun estimate`, and the memory warning before a launch.
//! - [`planner`]: `zrun plan`: stage, offload, ZeRO++, micro-batch and
//!   checkpointing chosen from measured figures of this machine.
//! - [`swap_check`]: NVMe offload's checks before a launch (the swap path, free
//!   space), and removing a finished job's swap files.
//! - `stop`: SIGINT, SIGTERM and SIGHUP noted between jobs, where no job
//!   listens.
//! - `child`: the processes zrun runs under it (a sweep's jobs, `zworker
//!   sample`) end when it does, and a signal to zrun stops them.
//! - [`prepare`]: `zrun prepare`, text or JSONL to token files with a
//!   Hugging Face tokenizer.
//! - `zrun export` and `zrun sample` (below): a checkpoint consolidated, or
//!   continued as text by `zworker sample` after zrun has checked the request.
//!
//! zrun links no model and no transport: everything that computes runs inside
//! `zworker`, so zrun builds fast and is safe to run on a login node.

#![deny(missing_docs)]

/// `println!` that cannot panic: a closed stdout (`zrun train … | head -n 1`, a
/// closed terminal) must not kill the launcher in the middle of a job, so write
/// errors are ignored; metrics.jsonl is the record of a run.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `eprintln!` that cannot panic (see [`say!`]).
#[macro_export]
macro_rules! shout {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

pub mod bench;
pub mod chat;
mod child;
pub mod cli;
pub mod comms;
pub mod csv_monitor;
pub mod estimate;
pub mod eval;
pub mod launch;
pub mod metrics;
pub mod monitor;
mod parquet_json;
pub mod pernode;
pub mod plan;
pub mod planner;
pub mod prepare;
pub mod profile;
pub mod progress;
pub mod rank_log;
pub mod rundir;
pub mod server;
pub mod sink;
pub mod ssh;
mod stop;
pub mod supervise;
pub mod swap_check;
pub mod sweep;
pub mod tensorboard;
pub mod train;
pub mod worker;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;

/// Exit codes (docs/CONFIG.md).
pub mod exit {
    /// Done.
    pub const OK: u8 = 0;
    /// Training failed.
    pub const TRAINING_FAILED: u8 = 1;
    /// Bad input.
    pub const BAD_INPUT: u8 = 2;
    /// Launch failed (spawn, rendezvous, SSH).
    pub const LAUNCH_FAILED: u8 = 3;
    /// Stopped on request (SIGUSR1) after saving a checkpoint: `--resume
    /// auto` continues (sysexits' `EX_TEMPFAIL`, "try again later").
    pub const STOPPED: u8 = 75;
    /// Interrupted.
    pub const INTERRUPTED: u8 = 130;
}

/// An error that knows its exit code.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    /// Exit code.
    pub code: u8,
    /// What happened.
    pub message: String,
}

impl Failure {
    /// Bad input (exit 2).
    pub fn bad_input(message: impl Into<String>) -> anyhow::Error {
        Failure {
            code: exit::BAD_INPUT,
            message: message.into(),
        }
        .into()
    }
    /// Launch failure (exit 3).
    pub fn launch(message: impl Into<String>) -> anyhow::Error {
        Failure {
            code: exit::LAUNCH_FAILED,
            message: message.into(),
        }
        .into()
    }
}

/// The exit code for an error: bad input is 2, launch failures 3, the rest 1.
pub fn exit_code_of(e: &anyhow::Error) -> u8 {
    if let Some(f) = e.downcast_ref::<Failure>() {
        return f.code;
    }
    if e.downcast_ref::<zconfig::ConfigError>().is_some() {
        return exit::BAD_INPUT;
    }
    exit::TRAINING_FAILED
}

/// The newest complete checkpoint in `root` that opens (every shard's size
/// and CRC as its manifest says) and that `fits` accepts, if any, and why
/// each newer one did not.
pub(crate) fn newest_that_opens(
    root: &Path,
    fits: impl Fn(&zckpt::Checkpoint) -> Result<(), String>,
) -> (Option<zckpt::Checkpoint>, Vec<String>) {
    let mut passed_over = Vec::new();
    for dir in zckpt::list(root).into_iter().rev() {
        match zckpt::Checkpoint::open(&dir).map_err(|e| e.to_string()) {
            Ok(c) => match fits(&c) {
                Ok(()) => return (Some(c), passed_over),
                Err(why) => passed_over.push(why),
            },
            Err(why) => passed_over.push(why),
        }
    }
    (None, passed_over)
}

/// Opens the checkpoint that `path` names: a checkpoint, or a directory of
/// them (its newest). Bad ones are exit 2; where a directory's newest does
/// not open (a shard's size or checksum, a damaged manifest), the message
/// also names the newest one that does, to be given by name: never a silent
/// step back to older weights.
pub(crate) fn open_checkpoint(path: &Path) -> anyhow::Result<zckpt::Checkpoint> {
    let bad = |e: zckpt::CkptError| Failure::bad_input(e.to_string());
    let dir = zckpt::resolve(path).map_err(bad)?;
    if dir == path {
        return zckpt::Checkpoint::open(&dir).map_err(bad);
    }
    let (ckpt, passed_over) = newest_that_opens(path, |_| Ok(()));
    let why = passed_over
        .first()
        .map(|w| format!("{w}; "))
        .unwrap_or_default();
    match (ckpt, why.is_empty()) {
        (Some(c), true) => Ok(c),
        (Some(c), false) => Err(Failure::bad_input(format!(
            "{why}the newest checkpoint in {} that opens is {}: give it by name to use it",
            path.display(),
            c.dir.display()
        ))),
        (None, _) => Err(Failure::bad_input(format!(
            "{why}no checkpoint in {} opens",
            path.display()
        ))),
    }
}

/// How `zworker sample` draws (the arguments it takes after the token
/// count), and the strings zrun ends the text at.
struct Draw {
    temperature: f64,
    top_k: usize,
    top_p: f64,
    min_p: f64,
    repetition_penalty: f64,
    stops: Vec<String>,
}

/// How to sample: each flag given, else what `transformers`' `generate`
/// takes from a Hugging Face directory's `generation_config.json` (greedy
/// unless it says `do_sample: true`, then its `temperature`, `top_k`,
/// `top_p`, `min_p`, each defaulting as `generate`'s do: 1, 50, 1, none;
/// its `repetition_penalty` either way, default 1), else zrun's defaults
/// (temperature 0.8, all tokens, no penalty). Each is checked, an error
/// naming where it came from; what the file decided is said on stderr, and
/// so is what it asks that zrun does not do.
fn sampling(args: &cli::SampleArgs, dir: &Path, hf_dir: bool) -> anyhow::Result<Draw> {
    let file = match hf_dir {
        true => {
            zckpt::hf::generation_defaults(dir).map_err(|e| Failure::bad_input(e.to_string()))?
        }
        false => None,
    };
    let config = dir.join("generation_config.json");
    let asked = match &file {
        None => Draw {
            temperature: 0.8,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            stops: Vec::new(),
        },
        Some(g) if g.do_sample != Some(true) => Draw {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: g.repetition_penalty.unwrap_or(1.0),
            stops: g.stop_strings.clone(),
        },
        Some(g) => Draw {
            temperature: g.temperature.unwrap_or(1.0),
            top_k: g.top_k.unwrap_or(50),
            top_p: g.top_p.unwrap_or(1.0),
            min_p: g.min_p.unwrap_or(0.0),
            repetition_penalty: g.repetition_penalty.unwrap_or(1.0),
            stops: g.stop_strings.clone(),
        },
    };
    let greedy_by_file = file.as_ref().is_some_and(|g| g.do_sample != Some(true));
    // Where a value came from, for its error.
    let from = |flag: Option<f64>, name: &str, key: &str| match (flag, &file) {
        (Some(_), _) => name.to_string(),
        (None, Some(_)) if greedy_by_file && key != "repetition_penalty" => {
            format!("{}: do_sample", config.display())
        }
        (None, Some(_)) => format!("{}: {key}", config.display()),
        (None, None) => "zrun's default".to_string(),
    };
    let draw = Draw {
        temperature: args.temperature.unwrap_or(asked.temperature),
        top_k: args.top_k.unwrap_or(asked.top_k),
        top_p: args.top_p.unwrap_or(asked.top_p),
        min_p: args.min_p.unwrap_or(asked.min_p),
        repetition_penalty: args.repetition_penalty.unwrap_or(asked.repetition_penalty),
        stops: match args.stop_string.is_empty() {
            true => asked.stops.clone(),
            false => args.stop_string.clone(),
        },
    };
    let checks = [
        (
            draw.temperature.is_finite() && draw.temperature >= 0.0,
            from(args.temperature, "--temperature", "temperature"),
            "a number ≥ 0 (0: the most likely token)",
            draw.temperature,
        ),
        (
            draw.top_p > 0.0 && draw.top_p <= 1.0,
            from(args.top_p, "--top-p", "top_p"),
            "in (0, 1] (1: every token)",
            draw.top_p,
        ),
        (
            (0.0..=1.0).contains(&draw.min_p),
            from(args.min_p, "--min-p", "min_p"),
            "in [0, 1] (0: every token)",
            draw.min_p,
        ),
        (
            draw.repetition_penalty.is_finite() && draw.repetition_penalty > 0.0,
            from(
                args.repetition_penalty,
                "--repetition-penalty",
                "repetition_penalty",
            ),
            "a number > 0 (1: none)",
            draw.repetition_penalty,
        ),
    ];
    if let Some((_, from, must, got)) = checks.iter().find(|c| !c.0) {
        return Err(Failure::bad_input(format!(
            "{from} must be {must}, got {got}"
        )));
    }
    if let Some(g) = &file {
        let flags = [
            args.temperature.is_some(),
            args.top_k.is_some(),
            args.top_p.is_some(),
            args.min_p.is_some(),
            args.repetition_penalty.is_some(),
        ];
        if !flags.iter().all(|&f| f) {
            let mut said = match greedy_by_file {
                true => "greedy (no do_sample: true)".to_string(),
                false => format!(
                    "temperature {}, top-k {}, top-p {}",
                    asked.temperature, asked.top_k, asked.top_p
                ),
            };
            if asked.min_p > 0.0 {
                said += &format!(", min-p {}", asked.min_p);
            }
            if asked.repetition_penalty != 1.0 {
                said += &format!(", repetition penalty {}", asked.repetition_penalty);
            }
            if !asked.stops.is_empty() {
                said += &format!(", stop at {:?}", asked.stops);
            }
            eprintln!(
                "zrun: sampling as {} asks generate to: {said} (--temperature, --top-k, --top-p, --min-p, --repetition-penalty override it)",
                config.display()
            );
        }
        if !g.unapplied.is_empty() {
            eprintln!(
                "zrun: warning: {} also asks generate for {}, which zrun sample does not do",
                config.display(),
                g.unapplied.join(", ")
            );
        }
    }
    Ok(draw)
}

/// The tokenizer file of a Hugging Face model directory.
const HF_TOKENIZER: &str = "tokenizer.json";

/// `zrun sample`: checks the arguments and the checkpoint, then runs
/// `zworker sample`. A byte-level model's output goes straight to the
/// terminal; with `--tokenizer`, zrun encodes the prompt, reads the drawn ids
/// and prints their text as it grows.
fn sample(args: cli::SampleArgs) -> anyhow::Result<ExitCode> {
    let hf_dir = args.checkpoint.join(zckpt::hf::HF_CONFIG).is_file();
    let (dir, vocab) = if hf_dir {
        // A Hugging Face directory: its model, and its weights read through
        // (names and shapes, not values) so that a mismatch is exit 2 here.
        let dir = args.checkpoint.clone();
        let m = zckpt::hf::model_spec(&dir).map_err(|e| Failure::bad_input(e.to_string()))?;
        zckpt::InitWeights::open(&dir, &m, &m.param_shapes())
            .map_err(|e| Failure::bad_input(e.to_string()))?;
        (dir, m.vocab_size)
    } else {
        let ckpt = open_checkpoint(&args.checkpoint)?;
        (ckpt.dir.clone(), ckpt.manifest.model.vocab_size)
    };
    // A Hugging Face directory's own tokenizer, as `transformers` takes it.
    let beside = hf_dir
        .then(|| dir.join(HF_TOKENIZER))
        .filter(|p| p.is_file());
    let tokenizer = match args.tokenizer.as_ref().or(beside.as_ref()) {
        Some(path) => Some((path, prepare::load_tokenizer(path, vocab)?)),
        None if vocab != 256 => {
            return Err(Failure::bad_input(format!(
                "{}: a model of {vocab} tokens: give --tokenizer, the tokenizer.json its data was prepared with (without one, zrun sample encodes the prompt as bytes, for byte-level models of vocab_size 256)",
                dir.display()
            )))
        }
        None => None,
    };
    if args.prompt.is_empty() {
        return Err(Failure::bad_input(
            "--prompt: give at least one character to continue",
        ));
    }
    let text = match args.chats() {
        true => chat_prompt(&args, hf_dir.then_some(dir.as_path()))?,
        false => args.prompt.clone(),
    };
    let draw = sampling(&args, &dir, hf_dir)?;
    if tokenizer.is_none() && !draw.stops.is_empty() {
        let from = match args.stop_string.is_empty() {
            true => format!(
                "{}: stop_strings",
                dir.join("generation_config.json").display()
            ),
            false => "--stop-string".to_string(),
        };
        return Err(Failure::bad_input(format!(
            "{from}: stop strings need a tokenizer (a byte-level model's bytes are written as drawn): give --tokenizer"
        )));
    }
    let prompt_ids = match &tokenizer {
        Some((_, t)) => prepare::encode(t, &text)?,
        None => Vec::new(),
    };
    let prompt = match &tokenizer {
        Some(_) if prompt_ids.is_empty() => {
            return Err(Failure::bad_input(
                "--prompt: the tokenizer makes no tokens of it",
            ))
        }
        Some(_) => prompt_ids
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(","),
        None => text.clone(),
    };
    // Where the text ends (none for a byte-level model: bytes have no
    // end-of-text).
    let stop: Vec<u32> = match &tokenizer {
        _ if args.ignore_eos => Vec::new(),
        None => Vec::new(),
        Some((_, t)) => {
            let named = match hf_dir {
                true => {
                    zckpt::hf::eos_token_ids(&dir).map_err(|e| Failure::bad_input(e.to_string()))?
                }
                false => Vec::new(),
            };
            match named.is_empty() {
                false => named,
                true => prepare::EOS_NAMES
                    .iter()
                    .find_map(|n| t.token_to_id(n))
                    .into_iter()
                    .collect(),
            }
        }
    };
    let worker = bench::worker_bin(args.worker_bin.clone())?;
    let mut command = std::process::Command::new(&worker);
    child::ends_with_this_zrun(&mut command)
        .arg("sample")
        .arg(&dir)
        .arg(&prompt)
        .args([
            args.tokens.to_string(),
            draw.temperature.to_string(),
            draw.top_k.to_string(),
            draw.top_p.to_string(),
            draw.min_p.to_string(),
            draw.repetition_penalty.to_string(),
            args.seed.to_string(),
        ]);
    let launch =
        |e: std::io::Error| Failure::launch(format!("cannot start {}: {e}", worker.display()));
    let status = match &tokenizer {
        None => command.status().map_err(launch)?,
        Some((path, t)) => {
            if !stop.is_empty() {
                let ids: Vec<String> = stop.iter().map(u32::to_string).collect();
                command.args(["--stop", &ids.join(",")]);
            }
            let mut child = command
                .arg("--ids")
                .stdout(std::process::Stdio::piped())
                .spawn()
                .map_err(launch)?;
            let stdout = child.stdout.take().expect("piped");
            let unknown = prepare::print_decoded(t, &text, &prompt_ids, stdout, &draw.stops)?;
            if unknown > 0 {
                // A tokenizer smaller than the model is fine when the model's
                // vocabulary was padded; drawing ids past it says otherwise.
                eprintln!(
                    "zrun: warning: {unknown} drawn ids have no token in --tokenizer {} ({} tokens; the model has {vocab}), so they printed as nothing: is it the tokenizer its training data was prepared with?",
                    path.display(),
                    t.get_vocab_size(true)
                );
            }
            child.wait().map_err(launch)?
        }
    };
    Ok(if status.success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `--chat`'s prompt: the system message (if any) and the prompt as the
/// user's, laid out by the chat template of `hf_dir` (a Hugging Face
/// directory), of the directory of `--tokenizer`, or of `--chat-template`.
fn chat_prompt(args: &cli::SampleArgs, hf_dir: Option<&Path>) -> anyhow::Result<String> {
    let dir = hf_dir.or(args.tokenizer.as_deref().map(chat::dir_of));
    let template = chat::ChatTemplate::find(args.chat_template.as_deref(), dir)?.ok_or_else(|| {
        Failure::bad_input(match dir {
            Some(dir) => format!(
                "--chat: {}: give one with --chat-template FILE",
                chat::ChatTemplate::looked_in(dir)
            ),
            None => "--chat: no chat template: give --chat-template FILE (a Jinja file), or --tokenizer beside the model's tokenizer_config.json".into(),
        })
    })?;
    // The conversation file's own arguments, --tools, then --chat-arg
    // (which overrides the file's).
    let (earlier, mut extra) = match &args.conversation {
        Some(file) => earlier_turns(file, args.system.is_some())?,
        None => (Vec::new(), Vec::new()),
    };
    if let Some(file) = &args.tools {
        if extra.iter().any(|(name, _)| name == "tools") {
            return Err(Failure::bad_input(format!(
                "--tools {}: the --conversation record gives its own `tools`: give one",
                file.display()
            )));
        }
        extra.push(("tools".to_string(), tools_file(file)?));
    }
    for arg in &args.chat_arg {
        extra.push(chat::chat_arg(arg)?);
    }
    let text = template.render(args.system.as_deref(), earlier, &args.prompt, &extra)?;
    if text.is_empty() {
        return Err(Failure::bad_input(format!(
            "{}: the chat template makes an empty prompt",
            template.path().display()
        )));
    }
    Ok(text)
}

/// `--tools FILE`: a JSON list of tools' schemas.
fn tools_file(file: &Path) -> anyhow::Result<minijinja::Value> {
    let bad = |why: String| Failure::bad_input(format!("--tools {}: {why}", file.display()));
    let text = std::fs::read_to_string(file).map_err(|e| bad(e.to_string()))?;
    let value = chat::json_value(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    if value.as_str().is_some() {
        return Err(bad("a JSON string, not a list of tools' schemas".into()));
    }
    chat::tools_value(value)
        .map_err(|e| bad(e.to_string()))?
        .ok_or_else(|| bad("null, not a list of tools' schemas".into()))
}

/// The turns before the prompt, and the template's arguments that came
/// with them.
type Earlier = (Vec<minijinja::Value>, Vec<(String, minijinja::Value)>);

/// `--conversation FILE`: the conversation so far, a JSON list of messages
/// (each an object with a string `role`; every key kept, in order, for the
/// template) or an object holding one under `messages` (a JSONL record of
/// `zrun prepare`'s, whose `tools` and `chat_template_kwargs` come too). A
/// system message in it and `--system` both: exit 2.
fn earlier_turns(file: &Path, system_given: bool) -> anyhow::Result<Earlier> {
    let at = file.display();
    let text = std::fs::read_to_string(file)
        .map_err(|e| Failure::bad_input(format!("--conversation {at}: {e}")))?;
    let bad = |why: String| Failure::bad_input(format!("--conversation {at}: {why}"));
    let value = chat::json_value(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let (list, args) = match value.kind() {
        minijinja::value::ValueKind::Map => (
            value.get_attr("messages").unwrap_or_default(),
            chat::record_args(&value).map_err(|e| bad(e.to_string()))?,
        ),
        _ => (value, Vec::new()),
    };
    if list.kind() != minijinja::value::ValueKind::Seq {
        return Err(bad(
            "not a list of messages, nor an object with one under `messages`".into(),
        ));
    }
    let messages: Vec<minijinja::Value> =
        list.try_iter().map_err(|e| bad(e.to_string()))?.collect();
    let role = |m: &minijinja::Value| {
        m.get_attr("role")
            .ok()
            .and_then(|r| r.as_str().map(String::from))
    };
    if let Some(i) = messages.iter().position(|m| role(m).is_none()) {
        return Err(bad(format!("message {}: no string `role`", i + 1)));
    }
    if system_given && messages.first().and_then(role).as_deref() == Some("system") {
        return Err(bad(
            "it begins with a system message, and --system gives another: give one".into(),
        ));
    }
    Ok((messages, args))
}

/// Refuses (exit 2) to replace files a user already has: `what` names the
/// flag, `paths` what the command would write. An export or a plan's job
/// file may be the only copy (checkpoints rotate; a job file gets edited),
/// so replacing one takes `--overwrite`, as `zrun prepare` does.
pub(crate) fn keep_existing(
    what: &str,
    paths: &[std::path::PathBuf],
    overwrite: bool,
) -> anyhow::Result<()> {
    match paths.iter().find(|p| p.exists()) {
        Some(p) if !overwrite => Err(Failure::bad_input(format!(
            "{what}: {} exists; it is kept (pass --overwrite to replace it)",
            p.display()
        ))),
        _ => Ok(()),
    }
}

/// The files a command (`zrun export`, `zrun prepare`) is writing under
/// temporary names: removed if Ctrl-C, SIGTERM or SIGHUP ends it (exit
/// 130), which would otherwise leave them, as large as the output, beside
/// it. Set once, before the writing starts.
static REMOVE_ON_SIGNAL: std::sync::OnceLock<Vec<std::ffi::CString>> = std::sync::OnceLock::new();

/// The handler: only what a signal handler may do (unlink, write, _exit).
extern "C" fn remove_and_exit(_: std::ffi::c_int) {
    for path in REMOVE_ON_SIGNAL.get().into_iter().flatten() {
        // SAFETY: a NUL-terminated path; unlink is async-signal-safe.
        unsafe { libc::unlink(path.as_ptr()) };
    }
    const SAID: &[u8] = b"zrun: error: interrupted: nothing written (what had begun was removed)\n";
    // SAFETY: write and _exit are async-signal-safe; SAID outlives the call.
    unsafe {
        libc::write(2, SAID.as_ptr().cast(), SAID.len());
        libc::_exit(i32::from(exit::INTERRUPTED));
    }
}

/// Removes `paths` if a signal ends the command ([`REMOVE_ON_SIGNAL`]).
pub(crate) fn remove_on_interrupt(paths: &[std::path::PathBuf]) -> anyhow::Result<()> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    use std::os::unix::ffi::OsStrExt;
    let paths = paths
        .iter()
        .map(|p| std::ffi::CString::new(p.as_os_str().as_bytes()))
        .collect::<Result<Vec<_>, _>>()?;
    if REMOVE_ON_SIGNAL.set(paths).is_err() {
        anyhow::bail!("files to remove on a signal were set twice");
    }
    let action = SigAction::new(
        SigHandler::Handler(remove_and_exit),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: the handler does only async-signal-safe work.
        unsafe { sigaction(signal, &action) }?;
    }
    Ok(())
}

/// `zrun export`: consolidated f32 weights under the model's parameter names.
fn export(args: cli::ExportArgs) -> anyhow::Result<ExitCode> {
    let ckpt = open_checkpoint(&args.checkpoint)?;
    let dir = ckpt.dir.clone();
    // Writing into the checkpoint being read could replace one of its shards.
    let hf = args.format == cli::ExportFormat::Hf;
    if hf && args.out.is_file() {
        return Err(Failure::bad_input(format!(
            "--out {}: a file; --format hf writes a directory",
            args.out.display()
        )));
    }
    // Found only at the rename, after the whole export was written (and
    // with --overwrite, which cannot replace a directory by a file).
    if !hf && args.out.is_dir() {
        return Err(Failure::bad_input(format!(
            "--out {}: a directory; the export is one file (give its path, such as {}), or --format hf for a directory",
            args.out.display(),
            args.out.join("model.safetensors").display()
        )));
    }
    let out_dir = match hf {
        true => args.out.as_path(),
        false => args
            .out
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(std::path::Path::new(".")),
    };
    let out_dir = out_dir.canonicalize().or_else(|_| {
        args.out
            .parent()
            .map_or(Ok(std::path::PathBuf::from(".")), |p| p.canonicalize())
    });
    if let (Ok(out_dir), Ok(ck)) = (out_dir, dir.canonicalize()) {
        if out_dir.starts_with(&ck) {
            return Err(Failure::bad_input(format!(
                "--out {}: inside the checkpoint {} that is being exported; write it elsewhere",
                args.out.display(),
                dir.display()
            )));
        }
    }
    let companions = match hf {
        true => companions(&args, &ckpt.manifest.model)?,
        false if args.tokenizer_from.is_some() => {
            return Err(Failure::bad_input(
                "--tokenizer-from: only with --format hf (a zrun export is the weights alone)",
            ))
        }
        false => Vec::new(),
    };
    let mut written = match hf {
        true => vec![
            args.out.join(zckpt::hf::HF_CONFIG),
            args.out.join(zckpt::hf::HF_WEIGHTS),
        ],
        false => vec![args.out.clone()],
    };
    written.extend(companions.iter().map(|from| args.out.join(file_name(from))));
    keep_existing("--out", &written, args.overwrite)?;
    let temporary: Vec<_> = written.iter().map(|p| zckpt::temporary_path(p)).collect();
    remove_on_interrupt(&temporary)?;
    let n = match hf {
        true => ckpt.export_hf(&args.out),
        false => ckpt.export(&args.out),
    }
    .map_err(|e| Failure::bad_input(e.to_string()))?;
    // The weights are in place; each companion too, whole or not at all.
    for from in &companions {
        let to = args.out.join(file_name(from));
        let partial = zckpt::temporary_path(&to);
        std::fs::copy(from, &partial)
            .and_then(|_| std::fs::rename(&partial, &to))
            .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    }
    say!(
        "zrun: wrote {n} parameters (step {}, {} ranks, stage {}) to {}{}",
        ckpt.manifest.step,
        ckpt.manifest.world_size,
        ckpt.manifest.stage,
        args.out.display(),
        match companions.first() {
            Some(first) => format!(
                ", with {} from {}",
                companions
                    .iter()
                    .map(|c| file_name(c))
                    .collect::<Vec<_>>()
                    .join(", "),
                first.parent().unwrap_or(Path::new(".")).display()
            ),
            None => String::new(),
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// The files beside a Hugging Face model's weights that make it usable as
/// it was: its tokenizer (what `save_pretrained` of one writes: the chat
/// template and special tokens in `tokenizer_config.json` or a template
/// file of their own; a slow tokenizer's vocabulary files) and its
/// generation settings (end-of-text ids, sampling).
const COMPANIONS: [&str; 10] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

/// A path's last part, as a string.
fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The [`COMPANIONS`] `zrun export --format hf` copies: those in
/// `--tokenizer-from DIR`, else in the job's `model.init_from` (a
/// directory, or the one of a weights file; none with `--tokenizer-from
/// none`). A tokenizer of more
/// tokens than the model has is refused (exit 2), as `zrun sample` refuses
/// it.
fn companions(
    args: &cli::ExportArgs,
    model: &zconfig::spec::ModelSpec,
) -> anyhow::Result<Vec<PathBuf>> {
    let dir = match &args.tokenizer_from {
        Some(d) if d.as_os_str() == "none" => return Ok(Vec::new()),
        Some(d) if !d.is_dir() => {
            return Err(Failure::bad_input(format!(
                "--tokenizer-from {}: not a directory (a Hugging Face model's, or none)",
                d.display()
            )))
        }
        Some(d) => d.clone(),
        // A published model's weights file stands in its directory.
        None => match model.init_from.as_deref().map(PathBuf::from) {
            Some(d) if d.is_dir() => d,
            Some(f) if f.is_file() => f.parent().unwrap_or(Path::new(".")).to_path_buf(),
            _ => return Ok(Vec::new()),
        },
    };
    let found: Vec<PathBuf> = COMPANIONS
        .iter()
        .map(|name| dir.join(name))
        .filter(|p| p.is_file())
        .collect();
    if found.is_empty() && args.tokenizer_from.is_some() {
        return Err(Failure::bad_input(format!(
            "--tokenizer-from {}: holds none of {}",
            dir.display(),
            COMPANIONS.join(", ")
        )));
    }
    if let Some(t) = found.iter().find(|p| p.ends_with("tokenizer.json")) {
        prepare::load_tokenizer(t, model.vocab_size)?;
    }
    Ok(found)
}

/// Parses the command line and runs the command.
pub fn run() -> anyhow::Result<ExitCode> {
    let cli = cli::Cli::parse();
    match cli.command {
        cli::Command::Train(args) => train::train(args),
        cli::Command::Check(args) => plan::check(args),
        cli::Command::Bench(b) => match b.what {
            Some(cli::BenchWhat::Comm(args)) => bench::comm(args),
            Some(cli::BenchWhat::Kernels(args)) => bench::kernels(args),
            Some(cli::BenchWhat::Io(args)) => bench::io(args),
            None => sweep::sweep(b.job),
        },
        cli::Command::Estimate(args) => estimate::estimate(args),
        cli::Command::Plan(args) => planner::plan(args),
        cli::Command::Export(args) => export(args),
        cli::Command::Sample(args) => sample(args),
        cli::Command::Eval(args) => eval::eval(args),
        cli::Command::Prepare(args) => prepare::prepare(args),
    }
}
