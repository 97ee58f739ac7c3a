//! The checks of a job's data before launch: the files exist and are whole,
//! there are enough tokens for a sequence per worker (and for one validation
//! sequence), and every token id fits the model's vocabulary (else a worker
//! would fail after launch).

use std::path::{Path, PathBuf};

use crate::error::ConfigError;
use crate::load::LoadedJob;
use crate::manifest::DataManifest;
use crate::spec::{DataFormat, DataSpec};

impl DataSpec {
    /// The end-of-text id that ends a document (`data.separate_documents`):
    /// `data.eos_id`, else the `eos_id` of the `zrun prepare` manifest beside
    /// the first data file. A manifest that records another id than
    /// `data.eos_id` is an error: one of them describes other data.
    pub fn document_eos(&self) -> Result<u32, String> {
        let (_, path, _) = self.sources().swap_remove(0);
        let files = data_files(&path, self.format)?;
        let manifest = match files.first() {
            Some(f) => DataManifest::beside(f)?,
            None => None,
        };
        match (self.eos_id, manifest) {
            (Some(id), Some((at, m))) if m.eos_id.is_some_and(|e| e != id) => Err(format!(
                "data.eos_id {id}, but {} says the data's end-of-text id is {}",
                at.display(),
                m.eos_id.unwrap_or(id)
            )),
            (Some(id), _) => Ok(id),
            (None, Some((_, DataManifest { eos_id: Some(id), .. }))) => Ok(id),
            (None, Some((at, _))) => Err(format!(
                "{} records no end-of-text id (prepared with --eos none): set data.eos_id",
                at.display()
            )),
            (None, None) => Err(
                "needs the end-of-text id that ends a document: set data.eos_id, or use data from zrun prepare (its manifest.json records the id)"
                    .into(),
            ),
        }
    }
}

impl LoadedJob {
    pub(crate) fn validate_data(&self, world_size: usize) -> Result<(), ConfigError> {
        let s = &self.spec;
        let d = &s.data;
        if d.format == DataFormat::Text && s.model.vocab_size < 256 {
            return Err(self.invalid(
                "model.vocab_size",
                format!(
                    "text data (`data.format: text`) uses bytes as tokens: vocab_size must be at least 256, got {}",
                    s.model.vocab_size
                ),
            ));
        }
        if d.val_path.is_some() && d.val_fraction > 0.0 {
            return Err(self.invalid(
                "data.val_path",
                "give validation data as data.val_path or as data.val_fraction, not both",
            ));
        }
        let Some(width) = d.format.bytes_per_token() else {
            if d.val_path.is_some() {
                return Err(self.invalid(
                    "data.val_path",
                    "synthetic data has no files: hold out data.val_fraction instead",
                ));
            }
            if !d.blend.is_empty() {
                return Err(self.invalid("data.blend", "synthetic data has no files to blend"));
            }
            return self.validate_documents();
        };
        self.validate_blend()?;
        self.validate_documents()?;
        let seq = s.model.seq_len as u64 + 1;
        // Each source's tokens: its training part, and its held-out tail
        // under data.val_fraction (each source holds out its own).
        let mut train = 0;
        let mut val = 0;
        for (i, (key, path, _)) in d.sources().into_iter().enumerate() {
            let tokens = self.check_files(key, &path, width as u64)?;
            let held_out = (tokens as f64 * d.val_fraction) as u64;
            let what = match d.blend.is_empty() {
                true => "the data".to_string(),
                false => format!("data.blend[{i}] ({})", path.unwrap_or_default()),
            };
            if !d.blend.is_empty() && tokens - held_out < seq {
                return Err(self.invalid(
                    key,
                    format!(
                        "{what} has {} tokens to train on, less than one sequence of seq_len + 1 = {seq}",
                        tokens - held_out
                    ),
                ));
            }
            if !d.blend.is_empty() && d.val_fraction > 0.0 && held_out < seq {
                return Err(self.invalid(
                    "data.val_fraction",
                    format!(
                        "{what} holds out {held_out} tokens, less than one sequence of seq_len + 1 = {seq}"
                    ),
                ));
            }
            train += tokens - held_out;
            val += held_out;
        }
        let val_key = match &d.val_path {
            Some(_) => {
                val = self.check_files("data.val_path", &d.val_path, width as u64)?;
                "data.val_path"
            }
            None => "data.val_fraction",
        };
        let validating = d.val_path.is_some() || d.val_fraction > 0.0;
        if validating && val < seq {
            return Err(self.invalid(
                val_key,
                format!(
                    "the validation data has {val} tokens, less than one sequence of seq_len + 1 = {seq}"
                ),
            ));
        }
        let need = seq * world_size.max(1) as u64;
        if train < need {
            return Err(self.invalid(
                "model.seq_len",
                format!(
                    "the data has {train} tokens, fewer than one sequence of seq_len + 1 = {} per worker for {world_size} workers",
                    s.model.seq_len + 1
                ),
            ));
        }
        Ok(())
    }

    /// `data.blend` stands in for `data.path`, each part with a positive
    /// weight.
    fn validate_blend(&self) -> Result<(), ConfigError> {
        let d = &self.spec.data;
        if d.blend.is_empty() {
            return Ok(());
        }
        if d.path.is_some() {
            return Err(self.invalid(
                "data.blend",
                "give the data as data.path or as data.blend, not both",
            ));
        }
        if let Some((i, p)) = d.blend.iter().enumerate().find(|(_, p)| p.weight <= 0.0) {
            return Err(self.invalid(
                "data.blend",
                format!(
                    "data.blend[{i}] ({}): weight {} must be above 0 (leave a source out to not use it)",
                    p.path, p.weight
                ),
            ));
        }
        Ok(())
    }

    /// `data.separate_documents` has an end-of-text id below the vocabulary,
    /// on data with documents; `data.eos_id` is there only for it.
    fn validate_documents(&self) -> Result<(), ConfigError> {
        let s = &self.spec;
        let d = &s.data;
        if !d.packing.is_wrapped() && !d.separate_documents {
            return Err(self.invalid(
                "data.packing",
                "bfd and bfd_split pack whole documents into each sequence: set data.separate_documents: true too (TRL packs so with padding-free batches)",
            ));
        }
        if !d.separate_documents {
            return match d.eos_id {
                Some(_) => Err(self.invalid(
                    "data.eos_id",
                    "is read only with data.separate_documents: true",
                )),
                None => Ok(()),
            };
        }
        let key = "data.separate_documents";
        if d.format == DataFormat::Synthetic {
            return Err(self.invalid(key, "synthetic data has no documents"));
        }
        // Positions restart at each document: transformers would choose
        // LongRoPE's factors by each batch's longest document, zrun by the
        // sequence.
        if let Some(old) = s.model.rotary_switches_after() {
            if s.model.seq_len > old {
                return Err(self.invalid(
                    key,
                    format!(
                        "model.rope_scaling's longrope factors switch at {old} tokens, below model.seq_len {}: with documents kept apart, which set a batch takes depends on its longest document; train at model.seq_len {old} or less, or without data.separate_documents",
                        s.model.seq_len
                    ),
                ));
            }
        }
        let eos = d.document_eos().map_err(|m| self.invalid(key, m))?;
        if eos as usize >= s.model.vocab_size {
            let key = if d.eos_id.is_some() {
                "data.eos_id"
            } else {
                key
            };
            return Err(self.invalid(
                key,
                format!(
                    "end-of-text id {eos} is not below model.vocab_size {}",
                    s.model.vocab_size
                ),
            ));
        }
        // Validation data's documents, and a blend's other sources', end at
        // the same id: a manifest beside them that records another
        // describes other data.
        let others = d.sources().into_iter().skip(1).chain(std::iter::once((
            "data.val_path",
            d.val_path.clone(),
            0.0,
        )));
        for (key, path, _) in others.filter(|(_, path, _)| path.is_some()) {
            let files = data_files(&path, d.format).map_err(|m| self.invalid(key, m))?;
            let Some(f) = files.first() else { continue };
            let beside = DataManifest::beside(f).map_err(|m| self.invalid(key, m))?;
            if let Some((
                at,
                DataManifest {
                    eos_id: Some(e), ..
                },
            )) = beside
            {
                if e != eos {
                    return Err(self.invalid(
                        key,
                        format!(
                            "{} says its end-of-text id is {e}, the training data's is {eos}",
                            at.display()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The files under `key` are there, whole, and hold only ids below
    /// `model.vocab_size`; returns their tokens.
    fn check_files(
        &self,
        key: &str,
        path: &Option<String>,
        width: u64,
    ) -> Result<u64, ConfigError> {
        let format = self.spec.data.format;
        let files = data_files(path, format).map_err(|m| self.invalid(key, m))?;
        let mut tokens = 0u64;
        for f in &files {
            let len = std::fs::metadata(f)
                .map_err(|e| self.invalid(key, format!("{}: {e}", f.display())))?
                .len();
            if len == 0 {
                return Err(self.invalid(key, format!("{} is empty", f.display())));
            }
            if len % width != 0 {
                return Err(self.invalid(
                    key,
                    format!(
                        "{} has {len} bytes, not a whole number of {width}-byte tokens",
                        f.display()
                    ),
                ));
            }
            tokens += len / width;
            if format != DataFormat::Text {
                self.check_token_ids(key, f, len, width as usize)?;
                self.check_mask(key, f, len)?;
            }
        }
        Ok(tokens)
    }

    /// A loss mask beside a token file (`zrun prepare --assistant-only-loss`)
    /// must be the file's: a byte per token, for a file of the manifest's
    /// length (else it marks other tokens).
    fn check_mask(&self, key: &str, f: &Path, len: u64) -> Result<(), ConfigError> {
        DataManifest::mask_of(f, len).map_err(|m| self.invalid(key, m))?;
        Ok(())
    }

    /// Every token id of a token file must be below `model.vocab_size` (else
    /// the embedding lookup fails inside a worker, after launch). A manifest
    /// from `zrun prepare` beside the file answers for it when it describes a
    /// file of this length; otherwise the file is scanned.
    fn check_token_ids(
        &self,
        key: &str,
        f: &Path,
        len: u64,
        width: usize,
    ) -> Result<(), ConfigError> {
        let vocab = self.spec.model.vocab_size;
        let manifest = DataManifest::beside(f).map_err(|m| self.invalid(key, m))?;
        if let Some((at, m)) = &manifest {
            if m.vocab_size > vocab {
                return Err(self.invalid(
                    "model.vocab_size",
                    format!(
                        "{vocab} is smaller than the vocabulary of the tokenizer that made {} ({}, per {})",
                        f.display(),
                        m.vocab_size,
                        at.display()
                    ),
                ));
            }
            if m.format != self.spec.data.format {
                return Err(self.invalid(
                    "data.format",
                    format!(
                        "{} holds {:?} tokens (per {}), not {:?}",
                        f.display(),
                        m.format,
                        at.display(),
                        self.spec.data.format
                    ),
                ));
            }
            let name = f.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if let Some(entry) = m.files.get(name).filter(|e| e.bytes == len) {
                if (entry.max_token_id as usize) < vocab {
                    return Ok(());
                }
            }
        }
        let file = std::fs::File::open(f)
            .map_err(|e| self.invalid(key, format!("{}: {e}", f.display())))?;
        // SAFETY: read-only, and only for the length of this check.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| self.invalid(key, format!("{}: {e}", f.display())))?;
        if let Some((i, t)) = map
            .chunks_exact(width)
            .map(crate::spec::token_id)
            .enumerate()
            .find(|(_, t)| *t as usize >= vocab)
        {
            return Err(self.invalid(
                "model.vocab_size",
                format!(
                    "{} holds token id {t} at token offset {i} (byte {}), which needs vocab_size of at least {}, got {vocab}",
                    f.display(),
                    i * width,
                    t as u64 + 1
                ),
            ));
        }
        Ok(())
    }
}

/// The files of a data spec, sorted; an error names the pattern when nothing matches.
pub fn data_files(path: &Option<String>, format: DataFormat) -> Result<Vec<PathBuf>, String> {
    let Some(pattern) = path else {
        return Err(format!(
            "a path (file or glob) is required for format {format:?}"
        ));
    };
    let paths = glob::glob(pattern).map_err(|e| format!("bad glob pattern `{pattern}`: {e}"))?;
    let mut files = Vec::new();
    for p in paths {
        let p = p.map_err(|e| format!("{e}"))?;
        if p.is_file() {
            files.push(p);
        }
    }
    files.sort();
    if files.is_empty() {
        // A job file's relative paths are the shell's, as DeepSpeed's and
        // torchrun's are: say from where, for a job run from elsewhere.
        let from = match std::env::current_dir() {
            Ok(cwd) if std::path::Path::new(pattern).is_relative() => format!(
                " (a relative path is looked up from the directory zrun runs in, {})",
                cwd.display()
            ),
            _ => String::new(),
        };
        return Err(format!("no file matches `{pattern}`{from}"));
    }
    Ok(files)
}
