//! zconfig: everything a zrun job is told before it starts.
//!
//! Layout:
//! - [`spec`]: the job spec (YAML) as typed structs, with the defaults of docs/CONFIG.md.
//! - [`arch`]: what `model:` implies for each family (GPT-2, LLaMA): parameter
//!   names, shapes and counts.
//! - [`load`]: reading a spec file, applying `--set` overrides, resolving `${name}`,
//!   and the semantic checks that must pass before anything launches.
//! - `data_check`: the data checks before launch (files, token count, ids).
//! - [`deepspeed`]: a DeepSpeed config's keys mapped onto the job's
//!   (`--deepspeed ds_config.json`), with `"auto"` resolved as Hugging Face does.
//! - [`manifest`]: the manifest `zrun prepare` writes beside token files.
//! - [`hostfile`]: DeepSpeed's hostfile format, `--include` / `--exclude`, and the
//!   resolved [`Topology`] (nodes, slots, ranks).
//! - [`estimate`]: ZeRO's memory formulas, offload rows, activation estimates
//!   (`zrun estimate`; arithmetic only, so it lives here, not in the engine).
//! - [`tiles`]: memory-centric tiling's column tiles (`model.tile_size`), one
//!   rule for validation, the estimator and the model.
//! - [`error`]: one error type whose messages say where (file:line:col, key path,
//!   hostfile line) and what.
//!
//! The design decision to know: a spec is parsed twice. First straight into the
//! typed structs from the YAML text, so that syntax errors, wrong types and unknown
//! keys carry `file:line:col`; then through a JSON value, so that `--set` overrides
//! can be applied by dotted path before the final typed parse. zconfig depends on
//! nothing else of zrun's, so the launcher can validate a job without linking the
//! engine.

#![deny(missing_docs)]

pub mod arch;
mod data_check;
pub mod deepspeed;
pub mod error;
pub mod estimate;
pub mod hostfile;
pub mod load;
pub mod manifest;
mod offload_check;
pub mod spec;
pub mod tiles;

pub use data_check::data_files;
pub use error::ConfigError;
pub use hostfile::{HostEntry, Hostfile, Node, Placement, SlotFilter, Topology, TopologyOptions};
pub use load::{load_job, load_job_with, LoadedJob};
pub use spec::{DataFormat, Dtype, JobSpec, LossScaleSpec, ModelKind, Schedule, ZeroStage};
