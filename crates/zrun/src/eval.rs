//! `zrun eval CHECKPOINT|HF_DIR --data FILE`: the model's loss and
//! perplexity on held-out data, the figure a fine-tune is compared with its
//! base by. zrun checks the model, the data and the arguments (exit 2 on
//! bad input, before any forward), turns a text file into ids where a
//! tokenizer is needed, and runs `zworker eval` (see its module for how the
//! windows score each target once), which prints the sum of the losses.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use zconfig::manifest::DataManifest;
use zconfig::DataFormat;

use crate::cli::EvalArgs;
use crate::{bench, child, prepare, Failure};

/// `zrun eval`.
pub fn eval(args: EvalArgs) -> anyhow::Result<ExitCode> {
    let hf_dir = args.checkpoint.join(zckpt::hf::HF_CONFIG).is_file();
    let (dir, model) = match hf_dir {
        true => {
            let dir = args.checkpoint.clone();
            let m = zckpt::hf::model_spec(&dir).map_err(|e| Failure::bad_input(e.to_string()))?;
            zckpt::InitWeights::open(&dir, &m, &m.param_shapes())
                .map_err(|e| Failure::bad_input(e.to_string()))?;
            (dir, m)
        }
        false => {
            let ckpt = crate::open_checkpoint(&args.checkpoint)?;
            (ckpt.dir.clone(), ckpt.manifest.model)
        }
    };
    // The model's whole context, as `zworker` loads it (a checkpoint's
    // `max_position_embeddings` where it trained on shorter sequences).
    let (vocab, seq_len) = (model.vocab_size, model.context());
    let stride = args.stride.unwrap_or(seq_len);
    if !(1..=seq_len).contains(&stride) {
        return Err(Failure::bad_input(format!(
            "--stride {stride}: must be in 1..={seq_len} (the model's context)"
        )));
    }
    if let Some(n @ (0 | 1)) = args.max_tokens {
        return Err(Failure::bad_input(format!(
            "--max-tokens {n}: nothing to score (a target needs a token before it)"
        )));
    }
    let data = &args.data;
    let bad = |why: String| Failure::bad_input(format!("--data {}: {why}", data.display()));
    match std::fs::metadata(data) {
        Ok(m) if m.is_file() => {}
        Ok(_) => return Err(bad("not a file".into())),
        Err(e) => return Err(bad(e.to_string())),
    }
    let eos = document_eos(&args, vocab)?;
    let format = data_format(&args, vocab)?;
    // A text file through a tokenizer becomes a file of u32 ids, in a
    // directory of its own (no manifest beside it to be read as this one's).
    let ids_dir = tempfile::tempdir()?;
    let (file, format) = match (format, tokenizer_of(&args, &dir, hf_dir)) {
        (DataFormat::Text, Some(path)) => {
            let t = prepare::load_tokenizer(&path, vocab)?;
            let text = std::fs::read_to_string(data)
                .map_err(|e| bad(format!("{e} (a text file is read as UTF-8)")))?;
            let ids = prepare::encode(&t, &text)?;
            too_few(ids.len(), &bad)?;
            let file = ids_dir.path().join("ids.bin");
            let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
            std::fs::write(&file, bytes)?;
            (file, DataFormat::TokensU32)
        }
        (DataFormat::Text, None) if vocab != 256 => {
            return Err(bad(format!(
                "a text file, and a model of {vocab} tokens: give --tokenizer (without one, text is read as bytes, for byte-level models of vocab_size 256)"
            )))
        }
        (DataFormat::Text, None) => {
            too_few(std::fs::metadata(data)?.len() as usize, &bad)?;
            (data.clone(), DataFormat::Text)
        }
        (format, _) => {
            let tokens = ids_below(data, format, vocab)?;
            too_few(tokens, &bad)?;
            // The loss mask the manifest names must be this file's.
            let bytes = std::fs::metadata(data)?.len();
            DataManifest::mask_of(data, bytes).map_err(Failure::bad_input)?;
            (data.clone(), format)
        }
    };
    let format_name = serde_json::to_value(format)?;
    let worker = bench::worker_bin(args.worker_bin.clone())?;
    let mut command = std::process::Command::new(&worker);
    command
        .arg("eval")
        .arg(&dir)
        .arg(&file)
        .arg(format_name.as_str().unwrap_or_default())
        .arg(stride.to_string())
        .arg(args.max_tokens.unwrap_or(0).to_string())
        .arg(eos.map_or("-".into(), |id| id.to_string()));
    let out = child::stdout_of(command, "the evaluation")?;
    if !out.status.success() {
        return Ok(ExitCode::from(1));
    }
    let said: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| anyhow::anyhow!("zworker eval's answer: {e}"))?;
    let tokens = said["tokens"].as_u64().unwrap_or(0);
    let windows = said["windows"].as_u64().unwrap_or(0);
    if tokens == 0 {
        return Err(bad(
            "its loss mask leaves every target out: nothing was scored".into(),
        ));
    }
    let loss = said["loss_sum"].as_f64().unwrap_or(f64::NAN) / tokens as f64;
    let apart = match eos {
        Some(id) => format!(", each document alone (ended by id {id})"),
        None => String::new(),
    };
    eprintln!(
        "zrun: {} on {}: loss {loss:.6} nats a token, perplexity {:.4} ({tokens} targets scored, {windows} windows of up to {seq_len} tokens, stride {stride}{apart})",
        dir.display(),
        data.display(),
        loss.exp()
    );
    println!(
        "{}",
        serde_json::json!({
            "loss": loss, "perplexity": loss.exp(), "tokens": tokens,
            "windows": windows, "seq_len": seq_len, "stride": stride,
            "separate_documents": eos.is_some(),
        })
    );
    Ok(ExitCode::SUCCESS)
}

/// The end-of-text id that --separate-documents ends documents at: --eos,
/// else the manifest's beside --data; none without the flag (and --eos
/// alone is refused, as `data.eos_id` alone is).
fn document_eos(args: &EvalArgs, vocab: usize) -> anyhow::Result<Option<u32>> {
    if !args.separate_documents {
        return match args.eos {
            Some(_) => Err(Failure::bad_input(
                "--eos: is read only with --separate-documents",
            )),
            None => Ok(None),
        };
    }
    let id = match args.eos {
        Some(id) => id,
        None => match DataManifest::beside(&args.data).map_err(Failure::bad_input)? {
            Some((_, DataManifest { eos_id: Some(id), .. })) => id,
            _ => {
                return Err(Failure::bad_input(format!(
                    "--separate-documents: no manifest beside {} gives the end-of-text id: give --eos ID",
                    args.data.display()
                )))
            }
        },
    };
    if id as usize >= vocab {
        return Err(Failure::bad_input(format!(
            "--eos {id}: not below the model's vocab_size {vocab}"
        )));
    }
    Ok(Some(id))
}

/// How `--data` is stored: `--format`, else what the manifest beside it
/// says (its tokenizer's vocabulary held to the model's), else text; a
/// `.bin` file that nothing describes is refused rather than read as text.
fn data_format(args: &EvalArgs, vocab: usize) -> anyhow::Result<DataFormat> {
    let data = &args.data;
    if let Some(f) = &args.format {
        return match serde_json::from_value(serde_json::Value::String(f.clone())) {
            Ok(DataFormat::Synthetic) | Err(_) => Err(Failure::bad_input(format!(
                "--format {f}: give text, tokens_u16 or tokens_u32"
            ))),
            Ok(format) => Ok(format),
        };
    }
    let beside = DataManifest::beside(data).map_err(Failure::bad_input)?;
    let name = data
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    match beside {
        Some((at, m)) if m.files.contains_key(name) => {
            if m.vocab_size > vocab {
                return Err(Failure::bad_input(format!(
                    "--data {}: {} gives its tokenizer {} tokens, more than the model's vocab_size {vocab}: not the tokenizer the model was trained with",
                    data.display(),
                    at.display(),
                    m.vocab_size
                )));
            }
            Ok(m.format)
        }
        _ if data.extension().is_some_and(|e| e == "bin") => Err(Failure::bad_input(format!(
            "--data {}: no manifest.json beside it says how its ids are stored: give --format tokens_u16 or tokens_u32",
            data.display()
        ))),
        _ => Ok(DataFormat::Text),
    }
}

/// The tokenizer for a text file: `--tokenizer`, else a Hugging Face
/// directory's own `tokenizer.json`.
fn tokenizer_of(args: &EvalArgs, dir: &Path, hf_dir: bool) -> Option<PathBuf> {
    let beside = dir.join("tokenizer.json");
    args.tokenizer
        .clone()
        .or_else(|| (hf_dir && beside.is_file()).then_some(beside))
}

/// Refuses data of fewer than two tokens: nothing to score.
fn too_few(tokens: usize, bad: &impl Fn(String) -> anyhow::Error) -> anyhow::Result<()> {
    match tokens {
        0 | 1 => Err(bad(format!(
            "{tokens} tokens: nothing to score (a target needs a token before it)"
        ))),
        _ => Ok(()),
    }
}

/// Refuses (exit 2) a token file that is not a whole number of ids or
/// holds one outside the vocabulary, naming its offset: before launch, as
/// `zrun train` refuses one. Returns how many ids it holds.
fn ids_below(path: &Path, format: DataFormat, vocab: usize) -> anyhow::Result<usize> {
    let width = format.bytes_per_token().unwrap_or(1);
    let bad = |why: String| Failure::bad_input(format!("--data {}: {why}", path.display()));
    let mut file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut buf = vec![0u8; (1 << 20) / width * width];
    let mut at = 0usize;
    loop {
        let mut filled = 0;
        while filled < buf.len() {
            match file
                .read(&mut buf[filled..])
                .map_err(|e| bad(e.to_string()))?
            {
                0 => break,
                n => filled += n,
            }
        }
        if filled % width != 0 {
            return Err(bad(format!(
                "{} bytes are not a whole number of {width}-byte ids",
                at * width + filled
            )));
        }
        for (i, id) in buf[..filled].chunks_exact(width).enumerate() {
            let id = zconfig::spec::token_id(id);
            if id as usize >= vocab {
                return Err(bad(format!(
                    "id {id} at token offset {} is not below the model's vocab_size {vocab}",
                    at + i
                )));
            }
        }
        at += filled / width;
        if filled < buf.len() {
            return Ok(at);
        }
    }
}
