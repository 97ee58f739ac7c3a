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
//!   (`--deepspeed ds_config.json`), with `"auto"` resolved as Hugging Face does;
//!   [`elastic`]: its `elasticity` section's batch arithmetic.
//! - [`freeze`]: `train.freeze`'s patterns over parameter names.
//! - [`hf_config`]: a Hugging Face `config.json` read as a job's model
//!   (`zrun sample` on a directory, and what `model.init_from` fills in).
//! - [`manifest`]: the manifest `zrun prepare` writes beside token files.
//! - [`hostfile`]: DeepSpeed's hostfile format, `--include` / `--exclude`, and the
//!   resolved [`Topology`] (nodes, slots, ranks).
//! - [`cores`]: the CPU cores each worker of a host is pinned to
//!   (`--bind-cores-to-rank`, `--bind-core-list`).
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
pub mod cores;
pub mod curriculum;
mod data_check;
pub mod deepspeed;
pub mod elastic;
pub mod error;
pub mod estimate;
pub mod freeze;
pub mod hf_config;
pub mod hostfile;
pub mod layer_drop;
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

/// A config file's text (a job, a hostfile, a ds_config), without the UTF-8
/// byte-order mark Windows editors write first: unseen in an editor, it made
/// a hostfile's first host `\u{feff}localhost`, which does not resolve, and
/// a ds_config "not JSON" at 1:1.
pub(crate) fn read_config(path: &std::path::Path) -> Result<String, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|cause| ConfigError::Io {
        path: path.to_path_buf(),
        cause,
    })?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    })
}

#[cfg(test)]
mod tests {
    /// A byte-order mark before a job, a hostfile or a ds_config is not
    /// part of what they say.
    #[test]
    fn config_files_read_without_a_byte_order_mark() {
        let d = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let p = d.path().join(name);
            std::fs::write(&p, format!("\u{feff}{text}")).unwrap();
            p
        };
        let hosts = crate::Hostfile::read(&write("hosts", "worker-1 slots=2\n")).unwrap();
        assert_eq!(hosts.entries[0].host, "worker-1");
        let job = write(
            "job.yaml",
            "name: bom\nmodel: {d_model: 64, n_heads: 4, n_layers: 2, seq_len: 16}\ndata: {format: synthetic}\n",
        );
        let ds = write("ds.json", "{\"train_micro_batch_size_per_gpu\": 3}");
        let loaded = crate::load_job_with(&job, &[], Some(&ds)).unwrap();
        assert_eq!(loaded.spec.train.micro_batch_size, 3);
        // Positions stay where an editor shows them.
        let bad = write(
            "bad.json",
            "{\"train_micro_batch_size_per_gpu\": 3, \"bogus\": 1}",
        );
        let e = crate::load_job_with(&job, &[], Some(&bad)).unwrap_err();
        assert!(e.to_string().contains("bad.json:1:39: bogus"), "{e}");
    }
}
