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
