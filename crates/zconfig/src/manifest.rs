//! The manifest `zrun prepare` writes beside its token files: which tokenizer
//! made them (path and SHA-256), its vocabulary size, the token format, and per
//! file its token count, byte length and largest id. `zrun check` and `zrun
//! train` read it to refuse a model whose `vocab_size` is too small for the
//! tokenizer, and to skip scanning a file the manifest vouches for (same byte
//! length).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::spec::DataFormat;

/// The manifest's file name, in the directory of the token files.
pub const MANIFEST_NAME: &str = "manifest.json";

/// What `zrun prepare` wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataManifest {
    /// The tokenizer file, as given to `zrun prepare`.
    pub tokenizer: String,
    /// SHA-256 of the tokenizer file, hex.
    pub tokenizer_sha256: String,
    /// The tokenizer's vocabulary, added tokens included.
    pub vocab_size: usize,
    /// `tokens_u16` or `tokens_u32`.
    pub format: DataFormat,
    /// The id put after every document, if any.
    pub eos_id: Option<u32>,
    /// Per file name: what it holds.
    pub files: BTreeMap<String, ManifestFile>,
}

/// One token file of a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// Tokens in it.
    pub tokens: u64,
    /// Its length in bytes (a file of another length is not the one described).
    pub bytes: u64,
    /// Its largest token id.
    pub max_token_id: u32,
    /// Documents in it.
    pub documents: u64,
    /// Its loss mask, where only some tokens are trained on (`zrun prepare
    /// --assistant-only-loss`): a file in the same directory holding one
    /// byte per token, 1 where the token is a target the loss counts, 0
    /// where it is not (a prompt's tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask: Option<MaskFile>,
}

/// A token file's loss mask.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MaskFile {
    /// Its file name, beside the token file.
    pub file: String,
    /// The tokens it marks as trained on.
    pub trained: u64,
}

impl DataManifest {
    /// The loss mask of token file `file` of `bytes` bytes, if the manifest
    /// beside it gives one: its path and what it says. A manifest that does
    /// not parse, or one that describes a file of another length, is an
    /// error: a mask must never be applied to tokens it was not made for.
    pub fn mask_of(file: &Path, bytes: u64) -> Result<Option<(PathBuf, MaskFile)>, String> {
        let Some((at, m)) = DataManifest::beside(file)? else {
            return Ok(None);
        };
        let name = file
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let Some(entry) = m.files.get(name) else {
            return Ok(None);
        };
        let Some(mask) = &entry.mask else {
            return Ok(None);
        };
        if entry.bytes != bytes {
            return Err(format!(
                "{}: {} bytes, but {} describes it, with a loss mask, as {} bytes: prepare it again",
                file.display(),
                bytes,
                at.display(),
                entry.bytes
            ));
        }
        let path = file.with_file_name(&mask.file);
        let len = std::fs::metadata(&path)
            .map_err(|e| {
                format!(
                    "{} (the loss mask of {}): {e}",
                    path.display(),
                    file.display()
                )
            })?
            .len();
        if len != entry.tokens {
            return Err(format!(
                "{}: {len} bytes, not one per token of {} ({}): prepare it again",
                path.display(),
                file.display(),
                entry.tokens
            ));
        }
        Ok(Some((path, mask.clone())))
    }
}

impl DataManifest {
    /// The manifest in `file`'s directory, if there is one: (its path, it).
    /// One that does not parse is an error naming it.
    pub fn beside(file: &Path) -> Result<Option<(PathBuf, DataManifest)>, String> {
        let path = file.parent().unwrap_or(Path::new(".")).join(MANIFEST_NAME);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        serde_json::from_str(&text)
            .map(|m| Some((path.clone(), m)))
            .map_err(|e| format!("{}: not a zrun prepare manifest: {e}", path.display()))
    }
}
