//! The checks of a job's data before launch: the files exist and are whole,
//! there are enough tokens for a sequence per worker, and every token id fits
//! the model's vocabulary (else a worker would fail after launch).

use std::path::{Path, PathBuf};

use crate::error::ConfigError;
use crate::load::LoadedJob;
use crate::spec::DataFormat;

impl LoadedJob {
    pub(crate) fn validate_data(&self, world_size: usize) -> Result<(), ConfigError> {
        let s = &self.spec;
        if s.data.format == DataFormat::Text && s.model.vocab_size < 256 {
            return Err(self.invalid(
                "model.vocab_size",
                format!(
                    "text data uses bytes as tokens: vocab_size must be at least 256, got {}",
                    s.model.vocab_size
                ),
            ));
        }
        let bytes_per_token = match s.data.format {
            DataFormat::Synthetic => return Ok(()),
            DataFormat::Text => 1,
            DataFormat::TokensU16 => 2,
        };
        let files =
            data_files(&s.data.path, s.data.format).map_err(|m| self.invalid("data.path", m))?;
        let mut tokens = 0u64;
        for f in &files {
            let len = std::fs::metadata(f)
                .map_err(|e| self.invalid("data.path", format!("{}: {e}", f.display())))?
                .len();
            if len == 0 {
                return Err(self.invalid("data.path", format!("{} is empty", f.display())));
            }
            if len % bytes_per_token != 0 {
                return Err(self.invalid(
                    "data.path",
                    format!(
                        "{} has {len} bytes, not a whole number of u16 tokens",
                        f.display()
                    ),
                ));
            }
            tokens += len / bytes_per_token;
            if s.data.format == DataFormat::TokensU16 {
                self.check_token_ids(f)?;
            }
        }
        let held_out = (tokens as f64 * s.data.val_fraction) as u64;
        let seq = s.model.seq_len as u64 + 1;
        if s.data.val_fraction > 0.0 && held_out < seq {
            return Err(self.invalid(
                "data.val_fraction",
                format!(
                    "{} of the data's {tokens} tokens is {held_out}, less than one sequence of seq_len + 1 = {seq}",
                    s.data.val_fraction
                ),
            ));
        }
        let tokens = tokens - held_out;
        let need = seq * world_size.max(1) as u64;
        if tokens < need {
            return Err(self.invalid(
                "model.seq_len",
                format!(
                    "the data has {tokens} tokens, fewer than one sequence of seq_len + 1 = {} per worker for {world_size} workers",
                    s.model.seq_len + 1
                ),
            ));
        }
        Ok(())
    }
    /// Every token id of a u16 token file must be below `model.vocab_size`
    /// (else the embedding lookup fails inside a worker, after launch).
    fn check_token_ids(&self, f: &Path) -> Result<(), ConfigError> {
        let vocab = self.spec.model.vocab_size;
        let bytes = std::fs::read(f)
            .map_err(|e| self.invalid("data.path", format!("{}: {e}", f.display())))?;
        let max = bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .max()
            .unwrap_or(0);
        if usize::from(max) >= vocab {
            return Err(self.invalid(
                "model.vocab_size",
                format!(
                    "{} holds token id {max}, which needs vocab_size of at least {}, got {vocab}",
                    f.display(),
                    usize::from(max) + 1
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
        return Err(format!("no file matches `{pattern}`"));
    }
    Ok(files)
}
