//! `zrun prepare INPUT… --tokenizer tokenizer.json --out DIR`: text files,
//! JSONL records or Parquet rows (Hugging Face's `datasets` files: a row is
//! a record, its columns the keys) to token files (`train.bin`, `val.bin`,
//! nanoGPT's layout: little-endian u16 ids, or u32 for vocabularies above
//! 65,536) and a manifest that `zrun check` / `zrun train` hold the job
//! against.
//!
//! Tokenization is Hugging Face's `tokenizers` crate on a local
//! `tokenizer.json` (nothing is downloaded), in batches encoded on every
//! core. The unit of work is a *piece*: a record, or up to
//! 64 KiB of a text file cut at a line end. Every 1/f-th piece goes to
//! `val.bin` (f = `--val-fraction`), the rest to `train.bin`, so both spread
//! over the whole corpus and the split does not depend on the thread count.
//! The end-of-text id follows each document (a record, a whole text file).
//! Outputs are written under temporary names and renamed when complete;
//! existing ones are kept unless `--overwrite`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;
use zconfig::manifest::{DataManifest, ManifestFile, MaskFile, MANIFEST_NAME};
use zconfig::DataFormat;

use crate::chat::{self, ChatTemplate, Renderer};
use crate::cli::PrepareArgs;
use crate::Failure;

/// The most text one piece of a text file holds.
const PIECE_BYTES: usize = 64 << 10;
/// Text encoded in one parallel batch.
const BATCH_BYTES: usize = 8 << 20;
/// End-of-text tokens looked for when `--eos` is not given.
pub(crate) const EOS_NAMES: [&str; 4] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"];

/// One piece of text to encode, whether a document ends with it, and the
/// part of it the loss is kept to (none: all of it).
struct Piece {
    text: String,
    ends_document: bool,
    kept: Option<Kept>,
}

/// The part of a piece that is trained on, where the loss is kept to the
/// assistant's turns or to a completion.
struct Kept {
    /// The byte ranges of the piece's text that are trained on.
    spans: Vec<Range<usize>>,
    /// Whether the end-of-text id after it is (after a text completion,
    /// where it is the only stop the model can learn; a conversation's
    /// template ends each turn).
    eos: bool,
}

impl Kept {
    /// The one span of a completion.
    fn from_span(span: Range<usize>, eos: bool) -> Option<Kept> {
        let spans = std::iter::once(span).collect();
        Some(Kept { spans, eos })
    }
}

impl Piece {
    /// A piece of a document, or a whole one, trained on throughout.
    fn whole(text: String, ends_document: bool) -> Piece {
        Piece {
            text,
            ends_document,
            kept: None,
        }
    }

    /// A document trained on where `kept` says, if it says.
    fn kept(text: String, kept: Option<Kept>) -> Piece {
        Piece {
            text,
            ends_document: true,
            kept,
        }
    }
}

/// Where `name` is written in `dir` until it is whole.
fn partial_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!(".{name}.partial"))
}

/// A file being written under a temporary name, removed unless it was
/// renamed into place: a run that fails (a full disk, a bad input file)
/// leaves no hidden `.NAME.partial` holding the space it took.
struct Partial(PathBuf);

impl Drop for Partial {
    fn drop(&mut self) {
        // Once renamed into place there is nothing at this name.
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A token file being written, with its loss mask where the loss may be
/// kept to parts of documents.
struct Output {
    name: &'static str,
    partial: Partial,
    writer: BufWriter<std::fs::File>,
    width: usize,
    entry: ManifestFile,
    mask: Option<MaskOutput>,
}

/// A file written under its temporary name, and the name it is to take.
type Written = (Partial, String);

/// A loss mask being written: a byte per token, 1 where it is trained on.
struct MaskOutput {
    name: String,
    partial: Partial,
    writer: BufWriter<std::fs::File>,
    trained: u64,
}

/// The loss mask's name beside token file `name` (`train.bin` → `train.mask`).
fn mask_name(name: &str) -> String {
    format!("{}.mask", name.trim_end_matches(".bin"))
}

/// A file under its temporary name in `dir`, buffered.
fn partial_writer(dir: &Path, name: &str) -> Result<(Partial, BufWriter<std::fs::File>)> {
    let partial = Partial(partial_path(dir, name));
    let file = std::fs::File::create(&partial.0)
        .with_context(|| format!("cannot write {}", partial.0.display()))?;
    Ok((partial, BufWriter::with_capacity(1 << 20, file)))
}

/// Flushes a file written under its temporary name to disk.
fn flush_partial(partial: &Partial, writer: BufWriter<std::fs::File>) -> Result<()> {
    let file = writer
        .into_inner()
        .map_err(|e| anyhow::anyhow!("writing {}: {}", partial.0.display(), e.error()))?;
    file.sync_all()
        .with_context(|| format!("writing {}", partial.0.display()))
}

impl Output {
    fn create(dir: &Path, name: &'static str, width: usize, masked: bool) -> Result<Output> {
        let (partial, writer) = partial_writer(dir, name)?;
        let mask = match masked {
            true => {
                let name = mask_name(name);
                let (partial, writer) = partial_writer(dir, &name)?;
                Some(MaskOutput {
                    name,
                    partial,
                    writer,
                    trained: 0,
                })
            }
            false => None,
        };
        Ok(Output {
            name,
            partial,
            writer,
            width,
            entry: ManifestFile {
                tokens: 0,
                bytes: 0,
                max_token_id: 0,
                documents: 0,
                mask: None,
            },
            mask,
        })
    }

    /// Appends `ids`, and under a mask whether each is trained on.
    fn push(&mut self, ids: &[u32], trained: &[bool], ends_document: bool) -> Result<()> {
        let mut bytes = Vec::with_capacity(ids.len() * self.width);
        for &id in ids {
            match self.width {
                2 => bytes.extend_from_slice(&(id as u16).to_le_bytes()),
                _ => bytes.extend_from_slice(&id.to_le_bytes()),
            }
            self.entry.max_token_id = self.entry.max_token_id.max(id);
        }
        self.writer
            .write_all(&bytes)
            .with_context(|| format!("writing {}", self.partial.0.display()))?;
        if let Some(m) = &mut self.mask {
            assert_eq!(trained.len(), ids.len(), "a mask byte per token");
            let bytes: Vec<u8> = trained.iter().map(|&t| u8::from(t)).collect();
            m.writer
                .write_all(&bytes)
                .with_context(|| format!("writing {}", m.partial.0.display()))?;
            m.trained += trained.iter().filter(|&&t| t).count() as u64;
        }
        self.entry.tokens += ids.len() as u64;
        self.entry.bytes += bytes.len() as u64;
        self.entry.documents += u64::from(ends_document);
        Ok(())
    }

    /// Whether its mask leaves some token out of the loss.
    fn leaves_out(&self) -> bool {
        self.mask
            .as_ref()
            .is_some_and(|m| m.trained < self.entry.tokens)
    }

    /// Flushes to disk; returns the name, what it holds and the written
    /// files (the token file, and its mask if `masked`: else its partial
    /// file is removed), still under their temporary names, each with its
    /// name.
    fn finish(self, masked: bool) -> Result<(&'static str, ManifestFile, Vec<Written>)> {
        flush_partial(&self.partial, self.writer)?;
        let mut entry = self.entry;
        let mut written = vec![(self.partial, self.name.to_string())];
        if let Some(m) = self.mask.filter(|_| masked) {
            flush_partial(&m.partial, m.writer)?;
            entry.mask = Some(MaskFile {
                file: m.name.clone(),
                trained: m.trained,
            });
            written.push((m.partial, m.name));
        }
        Ok((self.name, entry, written))
    }
}

/// `zrun prepare`.
pub fn prepare(args: PrepareArgs) -> Result<ExitCode> {
    if !(0.0..1.0).contains(&args.val_fraction) {
        return Err(Failure::bad_input(format!(
            "--val-fraction must be in [0, 1), got {}",
            args.val_fraction
        )));
    }
    let inputs = input_files(&args.inputs)?;
    if let Some((text, _)) = inputs
        .iter()
        .find(|(_, kind)| args.assistant_only_loss && *kind == Input::Text)
    {
        return Err(Failure::bad_input(format!(
            "--assistant-only-loss: {} is a text file; the loss is kept to the assistant's turns of conversations (JSONL or Parquet records), or to completions",
            text.display()
        )));
    }
    // Masks are written where the loss may be kept to parts of documents:
    // under --assistant-only-loss, and where records may be prompt-completion
    // ones (kept only if some token is left out).
    let masked = args.assistant_only_loss
        || (args.completion_only_loss && inputs.iter().any(|(_, kind)| *kind != Input::Text));
    // The chat template of JSONL conversations, if there is one. One given
    // with --chat-template must load; the tokenizer's neighbours matter
    // only to conversations, so that text data is not refused for a
    // `tokenizer_config.json` zrun cannot read.
    let tokenizer_dir = chat::dir_of(&args.tokenizer);
    let template = ChatTemplate::find(args.chat_template.as_deref(), Some(tokenizer_dir));
    let renderer = match &template {
        Ok(t) => t.as_ref().map(ChatTemplate::renderer).transpose(),
        Err(e) => Err(Failure::bad_input(e.to_string())),
    };
    if let (Err(e), Some(_)) = (&renderer, &args.chat_template) {
        return Err(Failure::bad_input(e.to_string()));
    }
    let conversations = Conversations {
        renderer: renderer
            .as_ref()
            .map(Option::as_ref)
            .map_err(|e| e.to_string()),
        looked_in: ChatTemplate::looked_in(tokenizer_dir),
        args: args
            .chat_arg
            .iter()
            .map(|a| chat::chat_arg(a))
            .collect::<Result<_>>()?,
    };
    let tokenizer_bytes = std::fs::read(&args.tokenizer).map_err(|e| {
        Failure::bad_input(format!("--tokenizer {}: {e}", args.tokenizer.display()))
    })?;
    let tokenizer = Tokenizer::from_bytes(&tokenizer_bytes).map_err(|e| {
        Failure::bad_input(format!(
            "--tokenizer {}: not a Hugging Face tokenizer.json: {e}",
            args.tokenizer.display()
        ))
    })?;
    let vocab = tokenizer.get_vocab_size(true);
    let (format, width) = if vocab <= 1 << 16 {
        (DataFormat::TokensU16, 2)
    } else {
        (DataFormat::TokensU32, 4)
    };
    let eos = match args.eos.as_deref() {
        Some("none") => None,
        Some(name) => Some(tokenizer.token_to_id(name).ok_or_else(|| {
            Failure::bad_input(format!(
                "--eos {name}: the tokenizer has no such token (give one it has, or none)"
            ))
        })?),
        None => EOS_NAMES.iter().find_map(|n| tokenizer.token_to_id(n)),
    };
    std::fs::create_dir_all(&args.out)
        .map_err(|e| Failure::bad_input(format!("--out {}: {e}", args.out.display())))?;
    // The masks too: one left from an earlier run is replaced (or, for
    // data without one, removed) only with --overwrite.
    let names = [
        "train.bin",
        "val.bin",
        "train.mask",
        "val.mask",
        MANIFEST_NAME,
    ];
    let outputs = names.map(|n| args.out.join(n));
    crate::keep_existing("--out", &outputs, args.overwrite)?;
    let total: u64 = inputs.iter().map(|(p, kind)| input_bytes(p, *kind)).sum();
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "prepare [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {msg}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    // Ctrl-C, SIGTERM or SIGHUP: exit 130, what was begun removed (as a
    // failure's `Partial`s are; a signal ends the process where it stands).
    let begun = names.map(|n| partial_path(&args.out, n));
    crate::remove_on_interrupt(&begun)?;
    let mut train = Output::create(&args.out, "train.bin", width, masked)?;
    let mut val = Output::create(&args.out, "val.bin", width, masked)?;
    let mut split = Split::new(args.val_fraction);
    let mut batch: Vec<Piece> = Vec::new();
    let mut batch_bytes = 0;
    let mut encode = |batch: &mut Vec<Piece>| -> Result<()> {
        let texts: Vec<&str> = batch.iter().map(|p| p.text.as_str()).collect();
        let encodings = tokenizer
            .encode_batch(texts, false)
            .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
        for (piece, enc) in batch.iter().zip(encodings) {
            let mut ids = enc.get_ids().to_vec();
            let mut trained = match (masked, &piece.kept) {
                (false, _) => Vec::new(),
                (true, None) => vec![true; ids.len()],
                (true, Some(kept)) => trained_tokens(enc.get_offsets(), &kept.spans),
            };
            if piece.ends_document {
                ids.extend(eos);
                // Between conversations the end-of-text id is no turn of
                // the assistant's; after a text completion it is its end.
                let eos_trained = piece.kept.as_ref().is_none_or(|k| k.eos);
                trained.extend(eos.map(|_| eos_trained));
            }
            let out = if split.next_is_val() {
                &mut val
            } else {
                &mut train
            };
            out.push(&ids, &trained, piece.ends_document)?;
        }
        batch.clear();
        Ok(())
    };
    for (path, kind) in &inputs {
        let mut pieces = |piece: Piece| -> Result<()> {
            batch_bytes += piece.text.len();
            bar.inc(piece.text.len() as u64);
            batch.push(piece);
            if batch_bytes >= BATCH_BYTES {
                encode(&mut batch)?;
                batch_bytes = 0;
            }
            Ok(())
        };
        let records = Records {
            field: args.field.as_deref(),
            conversations: &conversations,
            loss: Loss {
                assistant_only: args.assistant_only_loss,
                completion_only: args.completion_only_loss,
            },
        };
        match kind {
            Input::Text => read_text(path, &mut pieces)?,
            Input::Jsonl => read_jsonl(path, &records, &mut pieces)?,
            Input::Parquet => read_parquet(path, &records, &mut pieces)?,
        }
        bar.set_message(path.display().to_string());
    }
    encode(&mut batch)?;
    bar.finish_and_clear();
    // A mask that leaves nothing out (no prompt-completion records came)
    // is dropped: the data trains as it would without one.
    let keep_masks = args.assistant_only_loss || train.leaves_out() || val.leaves_out();
    let mut files = BTreeMap::new();
    let mut written = Vec::new();
    for out in [train, val] {
        let (name, entry, parts) = out.finish(keep_masks)?;
        files.insert(name.to_string(), entry);
        written.extend(parts.into_iter().map(|(p, n)| (p, args.out.join(n))));
    }
    // Empty token files only fail later, at `zrun train`: say so here, where
    // the inputs are at hand (what was written is removed as on any failure).
    if files.values().all(|f| f.tokens == 0) {
        return Err(Failure::bad_input(format!(
            "{}: no text to tokenize (empty files, blank lines, or empty records)",
            inputs
                .iter()
                .map(|(p, _)| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let manifest = DataManifest {
        tokenizer: args.tokenizer.display().to_string(),
        tokenizer_sha256: format!("{:x}", Sha256::digest(&tokenizer_bytes)),
        vocab_size: vocab,
        format,
        eos_id: eos,
        files,
    };
    let partial = Partial(partial_path(&args.out, MANIFEST_NAME));
    std::fs::write(&partial.0, serde_json::to_string_pretty(&manifest)? + "\n")
        .with_context(|| format!("writing {}", partial.0.display()))?;
    // Everything is on disk: into place, the manifest (which vouches for
    // the token files) last.
    written.push((partial, args.out.join(MANIFEST_NAME)));
    for (partial, to) in &written {
        std::fs::rename(&partial.0, to)
            .with_context(|| format!("renaming {} to {}", partial.0.display(), to.display()))?;
    }
    if !keep_masks {
        // --overwrite of data prepared with masks: theirs are not these
        // tokens' (the manifest no longer names them).
        for stale in ["train.mask", "val.mask"].map(|n| args.out.join(n)) {
            match std::fs::remove_file(&stale) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e).with_context(|| format!("removing {}", stale.display()))
                }
                _ => {}
            }
        }
    }
    let (t, v) = (&manifest.files["train.bin"], &manifest.files["val.bin"]);
    let fmt = if format == DataFormat::TokensU16 {
        "tokens_u16"
    } else {
        "tokens_u32"
    };
    say!(
        "zrun: {} documents, {} tokens → {} ({} tokens), {} ({} tokens); {fmt}, vocabulary {vocab}{}",
        t.documents + v.documents,
        t.tokens + v.tokens,
        args.out.join("train.bin").display(),
        t.tokens,
        args.out.join("val.bin").display(),
        v.tokens,
        match eos {
            Some(id) => format!(", end-of-text id {id} after each document"),
            None => ", no end-of-text id".into(),
        }
    );
    say!(
        "zrun: in a job: model: {{vocab_size: {vocab}}} (or more), data: {{path: {}, val_path: {}, format: {fmt}}}",
        args.out.join("train.bin").display(),
        args.out.join("val.bin").display()
    );
    if let (Some(tm), Some(vm)) = (&t.mask, &v.mask) {
        say!(
            "zrun: the loss counts {} of {} tokens, {} ({}, {})",
            tm.trained + vm.trained,
            t.tokens + v.tokens,
            match args.assistant_only_loss {
                true => "the assistant's turns and completions alone",
                false => "prompt-completion records' completions alone (--completion-only-loss false: all)",
            },
            args.out.join(&tm.file).display(),
            args.out.join(&vm.file).display()
        );
    }
    if v.tokens == 0 && args.val_fraction > 0.0 {
        shout!(
            "zrun: warning: val.bin is empty: {} pieces are too few for --val-fraction {}",
            split.seen,
            args.val_fraction
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads a tokenizer.json: the tokenizer and the file's bytes.
fn read_tokenizer(path: &Path) -> Result<(Tokenizer, Vec<u8>)> {
    let bytes = std::fs::read(path)
        .map_err(|e| Failure::bad_input(format!("--tokenizer {}: {e}", path.display())))?;
    let tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| {
        Failure::bad_input(format!(
            "--tokenizer {}: not a Hugging Face tokenizer.json: {e}",
            path.display()
        ))
    })?;
    Ok((tokenizer, bytes))
}

/// The tokenizer for sampling a model of `vocab` tokens (its vocabulary must
/// fit the model's).
pub fn load_tokenizer(path: &Path, vocab: usize) -> Result<Tokenizer> {
    let (t, _) = read_tokenizer(path)?;
    let has = t.get_vocab_size(true);
    if has > vocab {
        return Err(Failure::bad_input(format!(
            "--tokenizer {}: {has} tokens, more than the model's vocab_size {vocab}: not the tokenizer its data was prepared with",
            path.display()
        )));
    }
    Ok(t)
}

/// `text`'s ids, without special tokens (as `zrun prepare` encodes).
pub fn encode(t: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let enc = t
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
    Ok(enc.get_ids().to_vec())
}

/// Prints `prompt`, then the text of the ids `zworker sample --ids` writes
/// (one a line) as they come. Returns how many drawn ids the tokenizer has
/// no token for (they print as nothing). A closed stdout (`zrun sample … |
/// head`) ends it early, quietly: dropping `ids` closes the generator's pipe
/// and it stops too.
pub fn print_decoded(
    t: &Tokenizer,
    prompt: &str,
    prompt_ids: &[u32],
    ids: impl std::io::Read,
    stops: &[String],
) -> Result<usize> {
    let mut out = std::io::stdout().lock();
    stream_decoded(t, prompt, prompt_ids, ids, stops, &mut out)
}

/// Prompt tokens the first decode starts from (vLLM's incremental
/// detokenization takes five).
const DECODE_CONTEXT: usize = 5;

/// [`print_decoded`] into `out`. New ids print as what they add to the
/// decode of the ids printed just before them (the prompt's last
/// [`DECODE_CONTEXT`] at first): decoding a token alone loses the space a
/// SentencePiece or WordPiece decoder puts between words. They are held
/// back while that decode ends in U+FFFD, part of a character whose other
/// bytes are in ids still to come (a byte-level BPE splits most characters
/// outside ASCII). Until the seventieth session the
/// whole text was decoded again for every id, which grew with the square
/// of the length (20,000 ids of a 512-token BPE: 25 s for the decoding,
/// 4.7 s for the model), and a character split across ids printed as
/// U+FFFD and shifted every later piece.
fn stream_decoded(
    t: &Tokenizer,
    prompt: &str,
    prompt_ids: &[u32],
    ids: impl std::io::Read,
    stops: &[String],
    out: &mut impl Write,
) -> Result<usize> {
    let decode = |ids: &[u32]| {
        t.decode(ids, true)
            .map_err(|e| anyhow::anyhow!("decoding: {e}"))
    };
    let mut all = prompt_ids.to_vec();
    // all[context..shown] is text already printed (the prompt as typed, at
    // first); all[shown..], ids not printed yet.
    let (mut context, mut shown) = (all.len().saturating_sub(DECODE_CONTEXT), all.len());
    let mut unknown = 0;
    let mut write = |text: &str| match write!(out, "{text}").and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(anyhow::Error::new(e).context("writing the sample")),
        Ok(()) => Ok(true),
    };
    if !write(prompt)? {
        return Ok(0);
    }
    // The text so far, for the stop strings (the prompt's end included, as
    // `generate`'s `stop_strings` match the sequence's end).
    let mut text = prompt.to_string();
    for line in std::io::BufReader::new(ids).lines() {
        let id: u32 = line?.trim().parse().context("an id from zworker sample")?;
        unknown += usize::from(t.id_to_token(id).is_none());
        all.push(id);
        let (before, now) = (decode(&all[context..shown])?, decode(&all[context..])?);
        if now.len() > before.len()
            && now.is_char_boundary(before.len())
            && !now.ends_with(char::REPLACEMENT_CHARACTER)
        {
            let piece = &now[before.len()..];
            let stop = stop_in(&text, piece, stops);
            if !write(&piece[..stop.unwrap_or(piece.len())])? {
                return Ok(unknown);
            }
            if stop.is_some() {
                // Dropping `ids` ends the generator (its pipe closes).
                break;
            }
            text.push_str(piece);
            (context, shown) = (shown, all.len());
        }
    }
    write("\n")?;
    Ok(unknown)
}

/// Where in `piece`, the text that follows `text`, the first of the
/// `stops` to be completed ends (the text is printed through it, as
/// `generate` ends with its stop string): a stop may begin in `text` but
/// must end in `piece`.
fn stop_in(text: &str, piece: &str, stops: &[String]) -> Option<usize> {
    let longest = stops.iter().map(String::len).max()?;
    let mut from = text.len().saturating_sub(longest);
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    let tail = format!("{}{piece}", &text[from..]);
    let after = text.len() - from;
    stops
        .iter()
        .filter_map(|s| {
            // The first occurrence ending inside the piece.
            tail.match_indices(s.as_str())
                .map(|(at, _)| at + s.len())
                .find(|&end| end > after)
        })
        .min()
        .map(|end| end - after)
}

/// Which pieces go to validation: piece i when ⌊(i+1)·f⌋ > ⌊i·f⌋, so exactly
/// ⌊n·f⌋ of n, evenly spread.
struct Split {
    fraction: f64,
    seen: u64,
}

impl Split {
    fn new(fraction: f64) -> Split {
        Split { fraction, seen: 0 }
    }

    fn next_is_val(&mut self) -> bool {
        let i = self.seen as f64;
        self.seen += 1;
        ((i + 1.0) * self.fraction).floor() > (i * self.fraction).floor()
    }
}

/// What an input file holds, by its extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Input {
    /// Text (any other extension).
    Text,
    /// JSON records a line (`.jsonl`, `.ndjson`).
    Jsonl,
    /// Rows of a Parquet file (`.parquet`).
    Parquet,
}

/// The input files (globs expanded, in order), each with what it holds.
fn input_files(patterns: &[String]) -> Result<Vec<(PathBuf, Input)>> {
    let mut out = Vec::new();
    for p in patterns {
        let mut matched: Vec<PathBuf> = glob::glob(p)
            .map_err(|e| Failure::bad_input(format!("{p}: bad glob pattern: {e}")))?
            .filter_map(Result::ok)
            .filter(|f| f.is_file())
            .collect();
        if matched.is_empty() {
            return Err(Failure::bad_input(format!("{p}: no such file")));
        }
        matched.sort();
        out.extend(matched.into_iter().map(|f| {
            let kind = match f.extension().and_then(|e| e.to_str()) {
                Some("jsonl" | "ndjson") => Input::Jsonl,
                Some("parquet") => Input::Parquet,
                _ => Input::Text,
            };
            (f, kind)
        }));
    }
    Ok(out)
}

/// About how many bytes of text `path` holds, for the progress bar: a
/// file's size, or a Parquet file's uncompressed size (its size where the
/// metadata does not read: the reading then says why).
fn input_bytes(path: &Path, kind: Input) -> u64 {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    if kind != Input::Parquet {
        return size;
    }
    let Ok(reader) = std::fs::File::open(path).map(SerializedFileReader::new) else {
        return size;
    };
    reader.map_or(size, |r| {
        let groups = r.metadata().row_groups();
        groups
            .iter()
            .map(|g| g.total_byte_size().max(0) as u64)
            .sum()
    })
}

/// A text file in pieces of at most [`PIECE_BYTES`] (longer lines whole), cut
/// after a newline; the last piece ends the document.
fn read_text(path: &Path, sink: &mut impl FnMut(Piece) -> Result<()>) -> Result<()> {
    let bad = |e: std::io::Error| Failure::bad_input(format!("{}: {e}", path.display()));
    let mut r = std::io::BufReader::new(std::fs::File::open(path).map_err(bad)?);
    let mut piece = String::new();
    let mut bytes = Vec::new();
    let mut line_no = 0;
    loop {
        bytes.clear();
        let n = r.read_until(b'\n', &mut bytes).map_err(bad)?;
        line_no += 1;
        let line = utf8_line(path, line_no, &bytes)?;
        if n == 0 || (piece.len() + line.len() > PIECE_BYTES && !piece.is_empty()) {
            let ends_document = n == 0;
            sink(Piece::whole(std::mem::take(&mut piece), ends_document))?;
            if ends_document {
                return Ok(());
            }
        }
        piece.push_str(line);
    }
}

/// How JSONL conversations become text: the chat template's renderer, if
/// there is a template, and where it was looked for (for the error where
/// there is none).
struct Conversations<'a> {
    /// The renderer, none, or why the template beside the tokenizer could
    /// not be read.
    renderer: Result<Option<&'a Renderer<'a>>, String>,
    looked_in: String,
    /// `--chat-arg`'s variables, for every record.
    args: Vec<(String, minijinja::Value)>,
}

/// Which parts of records the loss is kept to: `--assistant-only-loss`,
/// `--completion-only-loss`.
#[derive(Clone, Copy)]
struct Loss {
    /// The assistant's turns of conversations.
    assistant_only: bool,
    /// The completions of prompt-completion records.
    completion_only: bool,
}

/// How records become pieces: the field read (`--field`), conversations'
/// layout, and which parts the loss is kept to.
struct Records<'a> {
    field: Option<&'a str>,
    conversations: &'a Conversations<'a>,
    loss: Loss,
}

/// A JSONL file's records, each line one ([`Records::piece`]; blank lines
/// skipped), named `path:line` in errors.
fn read_jsonl(
    path: &Path,
    records: &Records,
    sink: &mut impl FnMut(Piece) -> Result<()>,
) -> Result<()> {
    let bad = |e: std::io::Error| Failure::bad_input(format!("{}: {e}", path.display()));
    let mut r = std::io::BufReader::new(std::fs::File::open(path).map_err(bad)?);
    let mut bytes = Vec::new();
    for line_no in 1.. {
        bytes.clear();
        if r.read_until(b'\n', &mut bytes).map_err(bad)? == 0 {
            break;
        }
        let line = utf8_line(path, line_no, &bytes)?;
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{line_no}", path.display());
        sink(records.piece(line, &at)?)?;
    }
    Ok(())
}

/// Line `line_no` (1-based) of a file as text, an error naming the line and
/// the byte where it is not UTF-8; the first line without the byte order
/// mark Windows editors put at a file's start (behind one a JSONL record
/// was "not JSON", and a text file's first tokens took it in).
fn utf8_line<'a>(path: &Path, line_no: usize, bytes: &'a [u8]) -> Result<&'a str> {
    let line = std::str::from_utf8(bytes).map_err(|e| {
        let at = e.valid_up_to();
        Failure::bad_input(format!(
            "{}:{line_no}: byte {} of the line (0x{:02x}) is not UTF-8 \
             (zrun prepare reads UTF-8 text)",
            path.display(),
            at + 1,
            bytes[at]
        ))
    })?;
    Ok(match line_no {
        1 => line.strip_prefix('\u{feff}').unwrap_or(line),
        _ => line,
    })
}

/// A Parquet file's rows (Hugging Face's `datasets` writes its splits so;
/// any codec the `parquet` crate reads), each one record whose keys are the
/// row's columns in the file's order, nested lists and structs as JSON
/// arrays and objects ([`Records::piece`]); named `path: row N` (from 1)
/// in errors.
fn read_parquet(
    path: &Path,
    records: &Records,
    sink: &mut impl FnMut(Piece) -> Result<()>,
) -> Result<()> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let not_parquet =
        |e: parquet::errors::ParquetError| Failure::bad_input(format!("{}: {e}", path.display()));
    let file = std::fs::File::open(path)
        .map_err(|e| Failure::bad_input(format!("{}: {e}", path.display())))?;
    let reader = SerializedFileReader::new(file).map_err(not_parquet)?;
    let rows = reader.get_row_iter(None).map_err(not_parquet)?;
    for (i, row) in rows.enumerate() {
        let at = format!("{}: row {}", path.display(), i + 1);
        let row = row.map_err(|e| Failure::bad_input(format!("{at}: {e}")))?;
        let mut line = String::new();
        crate::parquet_json::row(&row, &mut line);
        sink(records.piece(&line, &at)?)?;
    }
    Ok(())
}

impl Records<'_> {
    /// One record (a JSON object, as text), named `at` in errors: under
    /// the field (by default `text`, else `messages`, else a `prompt` with
    /// its `completion`), a string, or a conversation laid out by the chat
    /// template as `apply_chat_template` lays out a whole conversation (no
    /// generation prompt, the record's `tools` and `chat_template_kwargs`
    /// passed on, as TRL passes them); each record is a document. Under
    /// `loss.assistant_only`, a record must be a conversation or a prompt
    /// with its completion, and its piece keeps the loss to the
    /// assistant's turns (or the completion).
    fn piece(&self, line: &str, at: &str) -> Result<Piece> {
        let (field, conversations, loss) = (self.field, self.conversations, self.loss);
        let record: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| Failure::bad_input(format!("{at}: not JSON: {e}")))?;
        let has = |key: &str| record.get(key).is_some();
        if field.is_none() && !has("text") && !has("messages") && has("prompt") && has("completion")
        {
            return prompt_completion(&record, line, conversations, loss)
                .map_err(|e| Failure::bad_input(format!("{at}: {e}")));
        }
        let name = match field {
            Some(f) => f,
            None if !has("text") && has("messages") => "messages",
            None => "text",
        };
        match record.get(name) {
            Some(serde_json::Value::String(_)) if loss.assistant_only => Err(Failure::bad_input(format!(
                "{at}: `{name}` is text, not a conversation: --assistant-only-loss keeps the loss to the assistant's turns of conversations (or to the completions of prompt-completion records)"
            ))),
            Some(serde_json::Value::String(text)) => Ok(Piece::whole(text.clone(), true)),
            Some(serde_json::Value::Array(_)) => {
                conversation(line, name, conversations, loss.assistant_only)
                    .map_err(|e| Failure::bad_input(format!("{at}: {e}")))
            }
            _ => Err(Failure::bad_input(format!(
                "{at}: no string field `{name}`, nor a conversation there (choose the field with --field)"
            ))),
        }
    }
}

/// The conversation under `name` of a record laid out, the loss kept to
/// the assistant's turns if `assistant_only`.
fn conversation(
    line: &str,
    name: &str,
    conversations: &Conversations,
    assistant_only: bool,
) -> anyhow::Result<Piece> {
    let renderer = conversations.renderer(name)?;
    let (record, args) = conversations.record(line)?;
    let messages = record.get_attr(name).unwrap_or_default();
    let text = renderer.render(messages.clone(), false, &args)?;
    let kept = match assistant_only {
        true => Some(Kept {
            spans: assistant_spans(renderer, &messages, &args, &text)?,
            eos: false,
        }),
        false => None,
    };
    Ok(Piece::kept(text, kept))
}

impl Conversations<'_> {
    /// A JSONL line read again as the template's value, each message's
    /// keys in order (a template may iterate them), and the template's
    /// arguments: `--chat-arg`'s, then the record's own (its `tools`, its
    /// `chat_template_kwargs`), which override them.
    fn record(
        &self,
        line: &str,
    ) -> anyhow::Result<(minijinja::Value, Vec<(String, minijinja::Value)>)> {
        let record = chat::json_value(line)?;
        let mut args = self.args.clone();
        args.extend(chat::record_args(&record)?);
        Ok((record, args))
    }

    /// The renderer for the conversation under `name`, or why there is none.
    fn renderer(&self, name: &str) -> anyhow::Result<&Renderer<'_>> {
        match &self.renderer {
            Ok(Some(r)) => Ok(r),
            Ok(None) => anyhow::bail!(
                "`{name}` is a conversation, and {}: give --chat-template FILE",
                self.looked_in
            ),
            Err(why) => anyhow::bail!(
                "`{name}` is a conversation, and its chat template cannot be read: {why}"
            ),
        }
    }
}

/// A record of TRL's prompt-completion layout: `prompt` and `completion`
/// both text (the document is the one followed by the other) or both
/// conversations (laid out together, as TRL lays them out). As TRL's
/// `completion_only_loss` does by default, the loss is kept to the
/// completion (unless `loss.completion_only` is off): a text completion and
/// the end-of-text id after it; a conversational one from where the prompt
/// laid out with the generation prompt stops agreeing with the whole (the
/// completion's turns, their ends included). With `completion_only` off,
/// `assistant_only` keeps it to the assistant's turns of a conversational
/// record, and refuses a text one.
fn prompt_completion(
    record: &serde_json::Value,
    line: &str,
    conversations: &Conversations,
    loss: Loss,
) -> anyhow::Result<Piece> {
    use serde_json::Value::{Array, String as Text};
    match (&record["prompt"], &record["completion"]) {
        (Text(prompt), Text(completion)) => {
            let text = format!("{prompt}{completion}");
            let kept = match (loss.completion_only, loss.assistant_only) {
                (true, _) => Kept::from_span(prompt.len()..text.len(), true),
                (false, true) => anyhow::bail!(
                    "a text prompt and completion, which have no assistant's turns to keep the loss to (--assistant-only-loss) once --completion-only-loss is false"
                ),
                (false, false) => None,
            };
            Ok(Piece::kept(text, kept))
        }
        (Array(_), Array(_)) => {
            let renderer = conversations.renderer("prompt")?;
            let (record, args) = conversations.record(line)?;
            let prompt = record.get_attr("prompt").unwrap_or_default();
            let completion = record.get_attr("completion").unwrap_or_default();
            let whole: Vec<minijinja::Value> =
                prompt.try_iter()?.chain(completion.try_iter()?).collect();
            let whole = minijinja::Value::from(whole);
            let text = renderer.render(whole.clone(), false, &args)?;
            let kept = match (loss.completion_only, loss.assistant_only) {
                (true, _) => {
                    let asked = renderer.render(prompt, true, &args)?;
                    Kept::from_span(agreeing(&asked, &text)..text.len(), false)
                }
                (false, true) => Some(Kept {
                    spans: assistant_spans(renderer, &whole, &args, &text)?,
                    eos: false,
                }),
                (false, false) => None,
            };
            Ok(Piece::kept(text, kept))
        }
        _ => anyhow::bail!(
            "`prompt` and `completion` must both be text or both conversations (lists of messages)"
        ),
    }
}

/// The byte ranges of `whole` (the conversation `messages` laid out) that
/// the assistant's turns take. A template with `{% generation %}` blocks
/// says where they are, as `transformers`' `return_assistant_tokens_mask`
/// (and TRL's `assistant_only_loss`) reads them. Otherwise by prefix
/// renderings, as TRL and LLaMA-Factory find the turns of templates
/// without such blocks: for each assistant message, from where the
/// conversation before it, laid out with the generation prompt, stops
/// agreeing with the conversation up to it (the prompt is the template's,
/// not the assistant's), to the end of the conversation up to it (its end
/// of turn included, which teaches the model to stop). A template that
/// lays an earlier turn out differently once later ones follow (Qwen3's
/// drops earlier reasoning) cannot be split so, and is refused.
fn assistant_spans(
    renderer: &Renderer,
    messages: &minijinja::Value,
    args: &[(String, minijinja::Value)],
    whole: &str,
) -> anyhow::Result<Vec<Range<usize>>> {
    if let Some(marked) = renderer.generation_spans(messages.clone(), args) {
        let (text, spans) = marked?;
        if text != whole {
            anyhow::bail!(
                "the chat template's {{% generation %}} blocks cannot be told apart in this conversation (it holds the private-use characters U+E000 or U+E001 that mark them)"
            );
        }
        return Ok(spans);
    }
    let list: Vec<minijinja::Value> = messages
        .try_iter()
        .map_err(|e| anyhow::anyhow!("the conversation is not a list: {e}"))?
        .collect();
    let mut spans = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let role = m
            .get_attr("role")
            .ok()
            .filter(|r| r.as_str() == Some("assistant"));
        if role.is_none() {
            continue;
        }
        let prompt = renderer.render(minijinja::Value::from(list[..i].to_vec()), true, args)?;
        let upto = renderer.render(minijinja::Value::from(list[..=i].to_vec()), false, args)?;
        if !whole.starts_with(&upto) {
            anyhow::bail!(
                "message {}: the chat template lays out the conversation up to this assistant turn otherwise than as the start of the whole conversation, so its turns cannot be told apart for --assistant-only-loss (a template with {{% generation %}} blocks around the assistant's text can be)",
                i + 1
            );
        }
        let start = agreeing(&prompt, &upto);
        if start < upto.len() {
            spans.push(start..upto.len());
        }
    }
    Ok(spans)
}

/// The length of the longest common prefix of `a` and `b`, in bytes, at a
/// character boundary: where a prompt laid out with the generation prompt
/// stops agreeing with the conversation that answers it.
fn agreeing(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((at, _), _)| at)
}

/// Whether each token is trained on: whether its bytes (`offsets`, into the
/// text) meet one of the `trained` ranges (an empty range, an empty
/// completion's, meets none). A token of no bytes (an offset trimmed to
/// nothing) counts where it stands.
fn trained_tokens(offsets: &[(usize, usize)], trained: &[Range<usize>]) -> Vec<bool> {
    offsets
        .iter()
        .map(|&(s, e)| {
            trained
                .iter()
                .filter(|r| !r.is_empty())
                .any(|r| match s < e {
                    true => s < r.end && e > r.start,
                    false => r.contains(&s),
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tokenizer from its JSON `model` and `decoder`.
    fn tokenizer(model: serde_json::Value, decoder: serde_json::Value) -> Tokenizer {
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": decoder, "model": model,
        });
        json.to_string().parse().unwrap()
    }

    /// GPT-2's byte-level BPE with no merges: every byte a token of its own
    /// (id = the byte), written as GPT-2 writes bytes (printable ones as
    /// themselves, the others from U+0100 on).
    fn bytes_tokenizer() -> Tokenizer {
        let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        let mut next = 256;
        let vocab: serde_json::Map<String, serde_json::Value> = (0..256u32)
            .map(|b| {
                let c = match printable(b) {
                    true => b,
                    false => (next, next += 1).0,
                };
                (char::from_u32(c).unwrap().to_string(), b.into())
            })
            .collect();
        let model = serde_json::json!({"type": "BPE", "vocab": vocab, "merges": []});
        tokenizer(
            model,
            serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}),
        )
    }

    /// What [`stream_decoded`] writes of `drawn` after `prompt_ids`.
    fn streamed(t: &Tokenizer, prompt: &str, prompt_ids: &[u32], drawn: &[u32]) -> String {
        streamed_to(t, prompt, prompt_ids, drawn, &[])
    }

    /// [`streamed`] with stop strings.
    fn streamed_to(
        t: &Tokenizer,
        prompt: &str,
        prompt_ids: &[u32],
        drawn: &[u32],
        stops: &[&str],
    ) -> String {
        let ids: String = drawn.iter().map(|i| format!("{i}\n")).collect();
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut out = Vec::new();
        stream_decoded(t, prompt, prompt_ids, ids.as_bytes(), &stops, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    /// A stop string ends the text where it is completed, printed through
    /// it: spanning several ids, begun in the prompt, the first of several
    /// to end; one wholly in the prompt stops nothing.
    #[test]
    fn stop_strings_end_the_text_through_them() {
        let t = bytes_tokenizer();
        let ids = |s: &str| s.bytes().map(u32::from).collect::<Vec<_>>();
        let run = |prompt: &str, drawn: &str, stops: &[&str]| {
            streamed_to(&t, prompt, &ids(prompt), &ids(drawn), stops)
        };
        assert_eq!(
            run("Q: hi", "\nA: yo\nQ: more", &["\nQ:"]),
            "Q: hi\nA: yo\nQ:\n"
        );
        assert_eq!(run("ab", "cdef", &["bc"]), "abc\n");
        assert_eq!(run("ab", "cdef", &["ab"]), "abcdef\n");
        assert_eq!(run("x", "123456", &["45", "23"]), "x123\n");
        assert_eq!(run("x", "café ok", &["é"]), "xcafé\n");
        assert_eq!(run("x", "123", &[]), "x123\n");
    }

    #[test]
    fn characters_split_across_ids_print_whole() {
        let t = bytes_tokenizer();
        let (prompt, rest) = ("naïve ", "café — 日本語 ✓ 🦀 done");
        let ids = |s: &str| s.bytes().map(u32::from).collect::<Vec<_>>();
        let out = streamed(&t, prompt, &ids(prompt), &ids(rest));
        assert_eq!(out, format!("{prompt}{rest}\n"));
        // A byte that starts no character stays U+FFFD, and what follows it
        // still prints.
        let mut drawn = ids("a");
        drawn.extend([0xE6, 0x97, b'b' as u32]);
        assert_eq!(streamed(&t, "x", &ids("x"), &drawn), "xa\u{FFFD}b\n");
    }

    #[test]
    fn word_starts_keep_their_spaces() {
        // SentencePiece's way: "▁" marks a word's start, and a decode drops
        // the space of its first word.
        let vocab = serde_json::json!({"▁the": 0, "▁cat": 1, "s": 2, "▁sat": 3, "<unk>": 4});
        let model = serde_json::json!({"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"});
        let decoder = serde_json::json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true});
        let t = tokenizer(model, decoder);
        assert_eq!(
            streamed(&t, "the", &[0], &[1, 2, 3, 0, 1]),
            "the cats sat the cat\n"
        );
    }

    /// A stdout whose reader has gone, or whose disk is full.
    struct Failing(std::io::ErrorKind);

    impl std::io::Write for Failing {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(self.0.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_stdout_ends_it_quietly_and_a_full_disk_is_an_error() {
        let t = bytes_tokenizer();
        let ids = "98\n".repeat(1000);
        let mut reader = std::io::Cursor::new(ids.as_bytes());
        let mut gone = Failing(std::io::ErrorKind::BrokenPipe);
        stream_decoded(&t, "a", &[97], &mut reader, &[], &mut gone).unwrap();
        assert!(reader.position() < ids.len() as u64, "it read every id");
        let mut full = Failing(std::io::ErrorKind::StorageFull);
        let e = stream_decoded(&t, "a", &[97], ids.as_bytes(), &[], &mut full).unwrap_err();
        assert!(format!("{e:#}").contains("writing the sample"), "{e:#}");
    }

    /// The assistant's spans are byte ranges of the text, and so are the
    /// offsets `encode_batch` gives (not characters): a token is trained
    /// where its bytes meet a span, after a two-byte character too.
    #[test]
    fn tokens_are_trained_where_their_bytes_meet_a_span() {
        let mut t = tokenizer(
            serde_json::json!({"type": "WordLevel", "unk_token": "?",
                "vocab": {"?": 0, "w1": 1, "w2": 2, "w3": 3}}),
            serde_json::Value::Null,
        );
        t.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::Whitespace {}));
        let text = "ü w1 w2 w3";
        let enc = t.encode_batch(vec![text], false).unwrap();
        let offsets = enc[0].get_offsets();
        assert_eq!(offsets[1], (3, 5), "byte offsets");
        // w1; w2 and the gap before w3 (not w3).
        assert_eq!(
            trained_tokens(offsets, &[3..5, 6..9]),
            [false, true, true, false]
        );
        assert_eq!(
            trained_tokens(&[(4, 4), (5, 5)], &[4..5, 7..9]),
            [true, false]
        );
    }

    #[test]
    fn the_split_takes_every_nth_piece() {
        let mut s = Split::new(0.1);
        let picks: Vec<bool> = (0..30).map(|_| s.next_is_val()).collect();
        assert_eq!(picks.iter().filter(|&&v| v).count(), 3);
        assert!(picks[9] && picks[19] && picks[29]);
        let mut none = Split::new(0.0);
        assert!((0..100).all(|_| !none.next_is_val()));
    }
}
