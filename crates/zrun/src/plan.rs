//! Turning flags, job spec and hostfile into a [`LaunchPlan`], with every check
//! that can fail before a process starts. `zrun check` prints the plan.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use zconfig::{load_job, JobSpec, Topology, TopologyOptions};

use crate::cli::{CheckArgs, LaunchArgs, Launcher};
use crate::Failure;

/// Workers per node on the CPU when nothing says otherwise.
pub const DEFAULT_CPU_WORKERS: usize = 2;

/// A validated job, ready to start.
#[derive(Debug, Clone)]
pub struct LaunchPlan {
    /// The resolved spec.
    pub spec: JobSpec,
    /// Nodes and ranks.
    pub topology: Topology,
    /// Per node: the address its workers bind their data-plane listener to.
    pub node_addrs: Vec<String>,
    /// Where workers reach zrun.
    pub master_addr: String,
    /// Control port (0: any free port).
    pub master_port: u16,
    /// The worker binary.
    pub worker_bin: PathBuf,
}

/// Resolves hostfile and launch flags into a topology (bad input: exit 2).
pub fn topology(args: &LaunchArgs) -> Result<Topology> {
    Ok(Topology::resolve(&TopologyOptions {
        hostfile: args.hostfile.clone(),
        include: args.include.clone(),
        exclude: args.exclude.clone(),
        num_nodes: args.num_nodes,
        workers_per_node: args.workers_per_node,
        default_local_slots: DEFAULT_CPU_WORKERS,
    })?)
}

/// Checks that a launch is possible: launcher, hosts, worker binary.
pub fn plan_launch(args: &LaunchArgs, spec: JobSpec, topology: Topology) -> Result<LaunchPlan> {
    if args.launcher != Launcher::Local {
        let name = if args.launcher == Launcher::Ssh {
            "ssh"
        } else {
            "slurm"
        };
        return Err(Failure::bad_input(format!(
            "--launcher {name}: launching over {name} is not supported yet"
        )));
    }
    let mut node_addrs = Vec::new();
    for node in &topology.nodes {
        node_addrs.push(local_address(&node.host).ok_or_else(|| {
            Failure::bad_input(format!(
                "host `{}` is not this machine; starting workers on other hosts (--launcher ssh) is not supported yet",
                node.host
            ))
        })?);
    }
    let worker_bin = match &args.worker_bin {
        Some(p) => p.clone(),
        None => default_worker_bin()?,
    };
    if !worker_bin.is_file() {
        return Err(Failure::launch(format!(
            "zworker not found at {} (build it with `cargo build --release`, or pass --worker-bin)",
            worker_bin.display()
        )));
    }
    Ok(LaunchPlan {
        spec,
        topology,
        node_addrs,
        master_addr: args
            .master_addr
            .clone()
            .unwrap_or_else(|| "127.0.0.1".into()),
        master_port: args.master_port,
        worker_bin,
    })
}

/// `zworker` next to the running `zrun`.
pub fn default_worker_bin() -> Result<PathBuf> {
    let exe = std::env::current_exe()
        .map_err(|e| Failure::launch(format!("cannot locate zrun itself: {e}")))?;
    Ok(exe.with_file_name("zworker"))
}

/// The address to use for a host that must be this machine, if it is.
fn local_address(host: &str) -> Option<String> {
    if host == "localhost" {
        return Some("127.0.0.1".into());
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        return ip.is_loopback().then(|| host.to_string());
    }
    let me = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    (me.trim() == host).then(|| "127.0.0.1".into())
}

/// `zrun check`: validate and print the resolved job and topology.
pub fn check(args: CheckArgs) -> Result<ExitCode> {
    let job = load_job(&args.job, &args.set)?;
    let topo = topology(&args.launch)?;
    job.validate(topo.world_size())?;
    let plan = plan_launch(&args.launch, job.spec.clone(), topo)?;
    println!("# job {} ({}): valid", job.spec.name, args.job.display());
    println!("{}", serde_json::to_string_pretty(&plan.spec)?);
    println!(
        "# topology: {} workers on {} node{}",
        plan.topology.world_size(),
        plan.topology.nodes.len(),
        if plan.topology.nodes.len() == 1 {
            ""
        } else {
            "s"
        }
    );
    let placements = plan.topology.placements();
    for (i, node) in plan.topology.nodes.iter().enumerate() {
        let ranks: Vec<String> = placements
            .iter()
            .filter(|p| p.node_rank == i)
            .map(|p| p.rank.to_string())
            .collect();
        println!(
            "node {i}: {} (address {}) slots {:?} ranks {}",
            node.host,
            plan.node_addrs[i],
            node.slots,
            ranks.join(",")
        );
    }
    println!("# worker binary: {}", plan.worker_bin.display());
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_are_local_others_are_not() {
        assert_eq!(local_address("localhost").as_deref(), Some("127.0.0.1"));
        assert_eq!(local_address("127.0.0.3").as_deref(), Some("127.0.0.3"));
        assert_eq!(local_address("10.1.2.3"), None);
        assert_eq!(local_address("gpu-node-17.invalid"), None);
    }
}
