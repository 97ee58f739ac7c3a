//! Where a training worker's threads run, settled first thing in `main`,
//! before any thread starts (threads inherit the mask and read the
//! counts when their pools are built).
//!
//! - With `ZRUN_BIND_CORES` (zrun's `--bind-cores-to-rank`: `all`, this
//!   host's physical cores, or `--bind-core-list`'s cores), the worker pins
//!   itself to its local rank's share ([`zconfig::cores::share`]) and, unless
//!   `RAYON_NUM_THREADS` is set, runs as many compute threads as it has
//!   cores. Where its cores lie in one NUMA node, its memory is bound there
//!   too (`set_mempolicy(MPOL_BIND)`, what DeepSpeed's `numactl -m` does);
//!   where they span nodes, first touch by its pinned threads places it.
//! - Without it, a worker that zrun did not give a thread count (a remote
//!   host's, under SSH, Slurm or mpirun, whose cores zrun cannot see) takes
//!   its share of the host's cores as a local launch does: the host's
//!   cores over its workers, or all the CPUs it may run on where its
//!   launcher already gave it a set of its own (Slurm's `--cpu-bind`).

use anyhow::{anyhow, Result};
use zconfig::cores::{core_list_text, parse_core_list, physical_cores, share};

use crate::env::WorkerEnv;

/// Settles the worker's cores and threads; returns a line saying where it
/// was pinned, if it was. Does nothing outside a job's environment (the
/// worker reports that when it reads it again).
pub fn settle() -> Result<Option<String>> {
    let Ok(env) = WorkerEnv::from_process() else {
        return Ok(None);
    };
    let threads_set = std::env::var_os("RAYON_NUM_THREADS").is_some();
    let Ok(bind) = std::env::var("ZRUN_BIND_CORES") else {
        if !threads_set {
            let avail = std::thread::available_parallelism().map_or(1, |n| n.get());
            let whole_host = allowed_cpus().len() >= online_cpus().len();
            set_threads(thread_share(avail, whole_host, env.local_world_size));
        }
        return Ok(None);
    };
    let on = |e: String| {
        anyhow!(
            "--bind-cores-to-rank on rank {} ({}): {e}",
            env.rank,
            crate::control::hostname()
        )
    };
    let cores = match bind.as_str() {
        "all" => physical_cores().map_err(on)?,
        list => parse_core_list(list).map_err(on)?,
    };
    let mine = share(&cores, env.local_world_size, env.local_rank).map_err(on)?;
    pin(mine).map_err(on)?;
    if !threads_set {
        set_threads(mine.len());
    }
    // A policy refused (a container's seccomp) leaves first touch to place
    // the memory: said, not fatal.
    let memory = match node_of(mine) {
        Some(n) => match bind_memory(n) {
            Ok(()) => format!(", memory on NUMA node {n}"),
            Err(e) => format!(" (memory not bound to NUMA node {n}: {e})"),
        },
        None => String::new(),
    };
    Ok(Some(format!(
        "zworker: rank {} (local rank {} of {} on {}) bound to cores {}{memory}",
        env.rank,
        env.local_rank,
        env.local_world_size,
        crate::control::hostname(),
        core_list_text(mine)
    )))
}

/// The NUMA node that holds every one of `cores`, where sysfs says one
/// does.
fn node_of(cores: &[usize]) -> Option<usize> {
    std::fs::read_dir("/sys/devices/system/node")
        .ok()?
        .flatten()
        .find_map(|e| {
            let node: usize = e.file_name().to_str()?.strip_prefix("node")?.parse().ok()?;
            let list = std::fs::read_to_string(e.path().join("cpulist")).ok()?;
            let cpus = parse_core_list(list.trim()).ok()?;
            cores.iter().all(|c| cpus.contains(c)).then_some(node)
        })
}

/// Binds the memory this process allocates from now on to NUMA node `node`.
fn bind_memory(node: usize) -> Result<(), String> {
    const WORDS: usize = 16;
    let bits = std::mem::size_of::<libc::c_ulong>() * 8;
    if node >= WORDS * bits {
        return Err(format!(
            "node {node} is past the {} a mask holds",
            WORDS * bits
        ));
    }
    let mut mask = [0 as libc::c_ulong; WORDS];
    mask[node / bits] |= 1 << (node % bits);
    // SAFETY: set_mempolicy reads `maxnode` bits of the mask it is given,
    // which holds that many.
    let r = unsafe {
        libc::syscall(
            libc::SYS_set_mempolicy,
            libc::MPOL_BIND,
            mask.as_ptr(),
            (WORDS * bits) as libc::c_ulong,
        )
    };
    match r {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error().to_string()),
    }
}

/// The compute threads of one of `local_workers` workers with `avail` CPUs
/// to run on: its share of the host's, or all of its own set's.
fn thread_share(avail: usize, whole_host: bool, local_workers: usize) -> usize {
    match whole_host {
        true => (avail / local_workers.max(1)).max(1),
        false => avail.max(1),
    }
}

fn set_threads(n: usize) {
    for k in ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"] {
        // Single-threaded still: nothing reads the environment concurrently.
        std::env::set_var(k, n.to_string());
    }
}

/// Pins this thread, and so every thread it starts later, to `cores`.
fn pin(cores: &[usize]) -> Result<(), String> {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it
    // for indices below CPU_SETSIZE (checked); sched_setaffinity reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores {
            if c >= libc::CPU_SETSIZE as usize {
                return Err(format!(
                    "core {c} is past the {} a mask holds",
                    libc::CPU_SETSIZE
                ));
            }
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(format!(
                "pinning to cores {}: {} (cores this host has not got, or outside the CPUs this process may use: {})",
                core_list_text(cores),
                std::io::Error::last_os_error(),
                core_list_text(&allowed_cpus())
            ));
        }
    }
    Ok(())
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: sched_getaffinity fills the zeroed set it is given.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// The host's online CPUs (none where sysfs does not say).
fn online_cpus() -> Vec<usize> {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| parse_core_list(s.trim()).ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_free_on_the_host_takes_its_share_one_given_a_set_all_of_it() {
        assert_eq!(thread_share(16, true, 4), 4);
        assert_eq!(thread_share(2, true, 2), 1);
        assert_eq!(thread_share(2, true, 3), 1);
        assert_eq!(thread_share(4, false, 4), 4);
        assert_eq!(thread_share(0, false, 2), 1);
    }
}
