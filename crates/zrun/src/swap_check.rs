//! NVMe offload's up-front checks, so that a bad swap path is exit 2 before
//! anything starts rather than a worker failing after launch: the directory
//! exists, is writable and takes `O_DIRECT` transfers, and its filesystem has
//! room for the swap files this job's workers on this host will write
//! (computed by the estimator). Paths on other hosts (SSH, Slurm) are checked
//! by each worker as it starts.

use std::collections::BTreeMap;

use anyhow::Result;
use zconfig::estimate::worker_states;
use zconfig::spec::{OffloadDevice, OffloadSpec};
use zconfig::JobSpec;

use crate::plan::LaunchPlan;
use crate::Failure;

/// What `offload_*.device: cpu` means for a job on CPU workers: nothing
/// moves (on GPU workers it is ZeRO-Offload, and nothing needs saying).
fn cpu_offload_notes(spec: &JobSpec) -> Vec<String> {
    let z = &spec.zero;
    [
        ("zero.offload_optimizer", &z.offload_optimizer),
        ("zero.offload_param", &z.offload_param),
    ]
    .into_iter()
    .filter(|(_, t)| t.device == OffloadDevice::Cpu && spec.device == zconfig::spec::Device::Cpu)
    .map(|(key, _)| {
        format!("zrun: {key}.device: cpu keeps states in host memory, where CPU workers already hold them: nothing moves")
    })
    .collect()
}

/// Checks the job's NVMe swap paths; says once what `device: cpu` means here.
pub fn check_offload(plan: &LaunchPlan) -> Result<()> {
    let spec = &plan.spec;
    let z = &spec.zero;
    let targets = [
        ("zero.offload_optimizer", &z.offload_optimizer),
        ("zero.offload_param", &z.offload_param),
    ];
    for note in cpu_offload_notes(spec) {
        say!("{note}");
    }
    let local = plan.here;
    if !local {
        return Ok(());
    }
    let workers = plan
        .topology
        .nodes
        .iter()
        .map(|n| n.slots.len())
        .max()
        .unwrap_or(1) as f64;
    let (opt_bytes, param_bytes) = swap_bytes(spec, plan.topology.world_size());
    // Bytes needed per directory, with the key that first named it.
    let mut need: BTreeMap<&str, (&str, f64)> = BTreeMap::new();
    for ((key, t), bytes) in targets.iter().zip([opt_bytes, param_bytes]) {
        if let (true, Some(path)) = (t.is_nvme(), t.nvme_path.as_deref()) {
            need.entry(path).or_insert((key, 0.0)).1 += bytes * workers;
        }
    }
    for (path, (key, bytes)) in need {
        let info = zswap::check_dir(std::path::Path::new(path))
            .map_err(|problem| Failure::bad_input(format!("{key}.nvme_path: {path} {problem}")))?;
        if info.in_memory {
            say!("zrun: warning: {key}.nvme_path {path} is on {} (memory): offloading there saves no memory", info.filesystem);
        }
        if bytes > info.free_bytes as f64 {
            return Err(Failure::bad_input(format!(
                "{key}.nvme_path: {path} has {:.2} GB free, this job's swap files need {:.2} GB ({} workers here)",
                info.free_bytes as f64 / 1e9,
                bytes / 1e9,
                workers
            )));
        }
    }
    Ok(())
}

/// Swap bytes per worker: (optimizer state, parameters).
fn swap_bytes(spec: &JobSpec, world: usize) -> (f64, f64) {
    let all = worker_states(spec, world).nvme;
    let mut opt_only = spec.clone();
    opt_only.zero.offload_param = OffloadSpec::default();
    let opt = worker_states(&opt_only, world).nvme;
    (opt, all - opt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_cpu_workers_are_told_that_offload_to_cpu_moves_nothing() {
        let spec = |device: &str| -> JobSpec {
            serde_json::from_value(serde_json::json!({
                "model": {}, "data": {"format": "synthetic"}, "name": "n", "device": device,
                "zero": {"stage": 3, "offload_optimizer": {"device": "cpu"}}
            }))
            .unwrap()
        };
        assert_eq!(
            cpu_offload_notes(&spec("cpu")),
            vec!["zrun: zero.offload_optimizer.device: cpu keeps states in host memory, where CPU workers already hold them: nothing moves"]
        );
        assert!(cpu_offload_notes(&spec("cuda")).is_empty());
    }
}
