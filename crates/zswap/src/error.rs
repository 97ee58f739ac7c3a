//! Why swapping failed.

use std::path::PathBuf;

/// A swap-layer failure; every variant names the file or setting at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SwapError {
    /// A read or write of a swap file failed (a full disk most often).
    #[error("swap {op} of {path} failed: {source}")]
    Io {
        /// `read` or `write`.
        op: &'static str,
        /// The swap file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The swap directory cannot be used.
    #[error("swap directory {path}: {problem}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// A setting the swapper cannot run with, or an I/O path it cannot start.
    #[error("{0}")]
    Config(String),
    /// The I/O path stopped before the transfer completed.
    #[error("the swap I/O thread stopped before the transfer completed")]
    Closed,
}
