//! `zrun estimate`: ZeRO's memory arithmetic for a parameter count or a job, and
//! the warning `zrun train` prints when a job will not fit its workers.

use std::process::ExitCode;

use anyhow::Result;
use serde::Serialize;
use zconfig::estimate::{
    gpt_activation_bytes, gpt_largest_group, gpt_params, model_state_rows, worker_states, Row,
    StateBytes, WorkerStates,
};
use zconfig::{load_job, Dtype, JobSpec, Topology, TopologyOptions};

use crate::cli::EstimateArgs;
use crate::plan::DEFAULT_CPU_WORKERS;
use crate::Failure;

#[derive(Debug, Serialize)]
struct Activations {
    micro_batch_size: usize,
    bytes_per_worker: f64,
    bytes_per_worker_checkpointed: f64,
}

#[derive(Debug, Serialize)]
struct Estimate {
    params: f64,
    world_size: usize,
    nodes: usize,
    workers_per_node: usize,
    rows: Vec<Row>,
    #[serde(skip_serializing_if = "Option::is_none")]
    activations: Option<Activations>,
    /// A job's stage.
    #[serde(skip_serializing_if = "Option::is_none")]
    stage: Option<u8>,
    /// A job's model states per CPU worker with its offload settings.
    #[serde(skip_serializing_if = "Option::is_none")]
    this_job: Option<WorkerStates>,
}

/// `zrun estimate`.
pub fn estimate(args: EstimateArgs) -> Result<ExitCode> {
    let (nodes, wpn) = match &args.hostfile {
        Some(h) => {
            let topo = Topology::resolve(&TopologyOptions {
                hostfile: Some(h.clone()),
                workers_per_node: args.workers_per_node,
                num_nodes: args.nodes,
                default_local_slots: DEFAULT_CPU_WORKERS,
                ..Default::default()
            })?;
            let wpn = topo.nodes.iter().map(|n| n.slots.len()).max().unwrap_or(1);
            (topo.nodes.len(), wpn)
        }
        None => (
            args.nodes.unwrap_or(1),
            args.workers_per_node.unwrap_or(DEFAULT_CPU_WORKERS),
        ),
    };
    if nodes == 0 || wpn == 0 {
        return Err(Failure::bad_input(
            "--nodes and --workers-per-node must be at least 1",
        ));
    }
    let est = match (&args.job, &args.params) {
        (Some(job), None) => {
            let job = load_job(job, &args.set)?;
            job.validate(nodes * wpn)?;
            job_estimate(&job.spec, nodes, wpn)
        }
        (None, Some(p)) => {
            let psi = zconfig::spec::parse_quantity(p)
                .map_err(|e| Failure::bad_input(format!("--params: {e}")))?;
            if psi < 1.0 {
                return Err(Failure::bad_input(format!(
                    "--params: `{p}` must be at least 1 parameter"
                )));
            }
            Estimate {
                params: psi,
                world_size: nodes * wpn,
                nodes,
                workers_per_node: wpn,
                rows: model_state_rows(psi, nodes, wpn, StateBytes::for_dtype(Dtype::Bf16), 0.0),
                activations: None,
                stage: None,
                this_job: None,
            }
        }
        _ => {
            return Err(Failure::bad_input(
                "give a job spec or --params N (one of them)",
            ))
        }
    };
    if args.json {
        say!("{}", serde_json::to_string_pretty(&est)?);
        return Ok(ExitCode::SUCCESS);
    }
    say!(
        "{:.3e} parameters on {} node(s) x {} workers ({} ranks); model states per device:",
        est.params,
        est.nodes,
        est.workers_per_node,
        est.world_size
    );
    say!(
        "{:>5}  {:<22} {:>14} {:>16} {:>16}",
        "stage",
        "offload",
        "per device",
        "host per node",
        "nvme per node"
    );
    for r in &est.rows {
        say!(
            "{:>5}  {:<22} {:>14} {:>16} {:>16}",
            r.stage,
            r.offload,
            gb(r.bytes_per_device),
            gb(r.host_bytes_per_node),
            gb(r.nvme_bytes_per_node)
        );
    }
    if let Some(a) = &est.activations {
        say!(
            "activations per worker at micro-batch {}: {} ({} with activation checkpointing)",
            a.micro_batch_size,
            gb(a.bytes_per_worker),
            gb(a.bytes_per_worker_checkpointed)
        );
    }
    if let Some(w) = &est.this_job {
        say!(
            "this job on CPU workers (stage {}, its offload settings): {} of model states in memory and {} in swap files per worker",
            est.stage.unwrap_or_default(),
            gb(w.memory),
            gb(w.nvme)
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn gb(b: f64) -> String {
    if b == 0.0 {
        "-".into()
    } else if b >= 1e9 {
        format!("{:.1} GB", b / 1e9)
    } else {
        format!("{:.1} MB", b / 1e6)
    }
}

fn job_estimate(spec: &JobSpec, nodes: usize, wpn: usize) -> Estimate {
    let psi = gpt_params(&spec.model);
    let bytes = StateBytes::for_dtype(spec.train.dtype);
    let (act, act_ckpt) = gpt_activation_bytes(&spec.model, spec.train.micro_batch_size);
    Estimate {
        params: psi,
        world_size: nodes * wpn,
        nodes,
        workers_per_node: wpn,
        rows: model_state_rows(psi, nodes, wpn, bytes, gpt_largest_group(&spec.model)),
        activations: Some(Activations {
            micro_batch_size: spec.train.micro_batch_size,
            bytes_per_worker: act,
            bytes_per_worker_checkpointed: act_ckpt,
        }),
        stage: Some(spec.zero.stage.number()),
        this_job: Some(worker_states(spec, nodes * wpn)),
    }
}

/// Bytes one worker of this job is expected to hold: its stage's model states
/// plus activations.
pub fn per_worker_bytes(spec: &JobSpec, topo: &Topology) -> f64 {
    let wpn = topo.nodes.iter().map(|n| n.slots.len()).max().unwrap_or(1);
    let est = job_estimate(spec, topo.nodes.len(), wpn);
    let states = worker_states(spec, topo.world_size()).memory;
    let a = est.activations.expect("a job estimate has activations");
    states
        + if spec.train.activation_checkpointing {
            a.bytes_per_worker_checkpointed
        } else {
            a.bytes_per_worker
        }
}

/// A `/proc/meminfo` field in bytes, if known.
fn meminfo(field: &str) -> Option<f64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: f64 = s
        .lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024.0)
}

/// This host's available memory (`MemAvailable`), if known.
pub fn mem_available() -> Option<f64> {
    meminfo("MemAvailable")
}

/// This host's memory and swap together (`MemTotal + SwapTotal`), if known.
pub fn mem_total() -> Option<f64> {
    Some(meminfo("MemTotal")? + meminfo("SwapTotal").unwrap_or(0.0))
}
