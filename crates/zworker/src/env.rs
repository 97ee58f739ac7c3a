//! The worker's environment: torchrun's names, or Slurm's when started by `srun`.

use std::collections::HashMap;

use anyhow::{anyhow, Context, Result};
use zproto::Token;

/// Everything a worker learns from its environment.
#[derive(Debug, Clone)]
pub struct WorkerEnv {
    /// Global rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// Rank within the node.
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
    /// Node index.
    pub node_rank: usize,
    /// zrun's control address.
    pub master_addr: String,
    /// zrun's control port.
    pub master_port: u16,
    /// Job id.
    pub job_id: String,
    /// The job token.
    pub token: Token,
    /// The address this worker's data-plane listener binds to.
    pub node_addr: String,
}

impl WorkerEnv {
    /// Reads the process environment.
    pub fn from_process() -> Result<WorkerEnv> {
        WorkerEnv::from_map(&std::env::vars().collect())
    }

    /// Reads a given environment (tests use fake ones).
    pub fn from_map(env: &HashMap<String, String>) -> Result<WorkerEnv> {
        let get = |names: &[&str]| -> Result<String> {
            names
                .iter()
                .find_map(|n| env.get(*n).cloned())
                .ok_or_else(|| {
                    anyhow!(
                        "{} is not set (zworker is started by zrun or srun)",
                        names.join(" or ")
                    )
                })
        };
        let num = |names: &[&str]| -> Result<usize> {
            let v = get(names)?;
            v.trim()
                .parse()
                .with_context(|| format!("{} = `{v}` is not a number", names[0]))
        };
        let rank = num(&["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"])?;
        let world_size = num(&[
            "WORLD_SIZE",
            "SLURM_NTASKS",
            "OMPI_COMM_WORLD_SIZE",
            "PMI_SIZE",
        ])?;
        let (local_rank, local_world_size, node_rank) = match env.get("ZRUN_NODE_OF_RANK") {
            // Under mpirun every rank gets the same environment: zrun's node of
            // every rank, from which each rank finds its own place.
            Some(list) => place_from_list(list, rank, world_size)?,
            None => {
                let local_rank = num(&["LOCAL_RANK", "SLURM_LOCALID"])?;
                let node_rank = num(&["NODE_RANK", "SLURM_NODEID"])?;
                let local_world_size = match get(&["LOCAL_WORLD_SIZE"]) {
                    Ok(v) => v
                        .parse()
                        .with_context(|| format!("LOCAL_WORLD_SIZE = `{v}` is not a number"))?,
                    // Slurm: "2(x3),1" style task counts per node; take this node's.
                    Err(_) => slurm_tasks_on_node(&get(&["SLURM_TASKS_PER_NODE"])?, node_rank)?,
                };
                (local_rank, local_world_size, node_rank)
            }
        };
        if rank >= world_size || local_rank >= local_world_size {
            return Err(anyhow!(
                "rank {rank} / world size {world_size}, local rank {local_rank} / {local_world_size} are inconsistent"
            ));
        }
        let token = Token::from_hex(&get(&["ZRUN_TOKEN"])?)
            .ok_or_else(|| anyhow!("ZRUN_TOKEN is not a valid token"))?;
        let master_port = get(&["MASTER_PORT"])?;
        Ok(WorkerEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            node_rank,
            master_addr: get(&["MASTER_ADDR"])?,
            master_port: master_port
                .parse()
                .with_context(|| format!("MASTER_PORT = `{master_port}` is not a port"))?,
            job_id: get(&["ZRUN_JOB_ID"]).unwrap_or_default(),
            token,
            node_addr: get(&["ZRUN_NODE_ADDR"]).unwrap_or_else(|_| "0.0.0.0".into()),
        })
    }
}

/// (local rank, local world size, node) of `rank` from `ZRUN_NODE_OF_RANK`
/// (`0,0,1,1`: the node of each rank).
fn place_from_list(list: &str, rank: usize, world_size: usize) -> Result<(usize, usize, usize)> {
    let nodes: Vec<usize> = list
        .split(',')
        .map(|n| n.trim().parse())
        .collect::<Result<_, _>>()
        .with_context(|| format!("ZRUN_NODE_OF_RANK = `{list}` is not a list of numbers"))?;
    if nodes.len() != world_size || rank >= world_size {
        return Err(anyhow!(
            "ZRUN_NODE_OF_RANK lists {} ranks; this is rank {rank} of {world_size}",
            nodes.len()
        ));
    }
    let node = nodes[rank];
    let local_rank = nodes[..rank].iter().filter(|&&n| n == node).count();
    let local_world_size = nodes.iter().filter(|&&n| n == node).count();
    Ok((local_rank, local_world_size, node))
}

/// Parses `SLURM_TASKS_PER_NODE` (`2(x3),1`) and returns node `node`'s task count.
fn slurm_tasks_on_node(spec: &str, node: usize) -> Result<usize> {
    let mut per_node = Vec::new();
    for part in spec.split(',') {
        let (n, times) = match part.split_once("(x") {
            Some((n, rest)) => (n, rest.trim_end_matches(')').parse::<usize>()?),
            None => (part, 1),
        };
        let n: usize = n
            .parse()
            .with_context(|| format!("bad SLURM_TASKS_PER_NODE `{spec}`"))?;
        per_node.extend(std::iter::repeat_n(n, times));
    }
    per_node
        .get(node)
        .copied()
        .ok_or_else(|| anyhow!("SLURM_TASKS_PER_NODE `{spec}` has no node {node}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> HashMap<String, String> {
        [
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("ZRUN_TOKEN", &Token::generate().to_hex()),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    #[test]
    fn torchrun_names() {
        let mut e = base();
        for (k, v) in [
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("NODE_RANK", "1"),
        ] {
            e.insert(k.into(), v.into());
        }
        let w = WorkerEnv::from_map(&e).unwrap();
        assert_eq!(
            (
                w.rank,
                w.world_size,
                w.local_rank,
                w.local_world_size,
                w.node_rank
            ),
            (3, 4, 1, 2, 1)
        );
        assert_eq!(w.master_port, 29500);
    }

    #[test]
    fn slurm_names_stand_in() {
        let mut e = base();
        for (k, v) in [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "2"),
            ("SLURM_TASKS_PER_NODE", "3(x2),1"),
        ] {
            e.insert(k.into(), v.into());
        }
        let w = WorkerEnv::from_map(&e).unwrap();
        assert_eq!(
            (
                w.rank,
                w.world_size,
                w.local_rank,
                w.local_world_size,
                w.node_rank
            ),
            (5, 7, 0, 1, 2)
        );
    }

    #[test]
    fn open_mpi_names_and_zruns_node_list_stand_in() {
        let mut e = base();
        for (k, v) in [
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "5"),
            ("ZRUN_NODE_OF_RANK", "0,0,0,1,1"),
        ] {
            e.insert(k.into(), v.into());
        }
        let w = WorkerEnv::from_map(&e).unwrap();
        assert_eq!(
            (
                w.rank,
                w.world_size,
                w.local_rank,
                w.local_world_size,
                w.node_rank
            ),
            (3, 5, 0, 2, 1)
        );
        e.insert("ZRUN_NODE_OF_RANK".into(), "0,1".into());
        assert!(WorkerEnv::from_map(&e)
            .unwrap_err()
            .to_string()
            .contains("lists 2 ranks"));
    }

    #[test]
    fn missing_or_bad_values_say_which() {
        let e = base();
        assert!(WorkerEnv::from_map(&e)
            .unwrap_err()
            .to_string()
            .contains("RANK or SLURM_PROCID"));
        let mut e = base();
        for (k, v) in [
            ("RANK", "x"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("NODE_RANK", "1"),
        ] {
            e.insert(k.into(), v.into());
        }
        assert!(WorkerEnv::from_map(&e)
            .unwrap_err()
            .to_string()
            .contains("RANK = `x`"));
    }
}
