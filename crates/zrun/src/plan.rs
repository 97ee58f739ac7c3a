//! Turning flags, job spec and hostfile into a [`LaunchPlan`], with every check
//! that can fail before a process starts. `zrun check` prints the plan.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use zconfig::deepspeed::{MappedValue, Origin};
use zconfig::{load_job_with, JobSpec, LoadedJob, Topology, TopologyOptions};

use crate::cli::{CheckArgs, LaunchArgs, Launcher};
use crate::pernode::PerNode;
use crate::worker::SshOptions;
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
    /// SSH settings when workers start over SSH.
    pub ssh: Option<SshOptions>,
    /// How workers start.
    pub launcher: Launcher,
    /// Every worker runs on this host (local launch, or mpirun on local hosts):
    /// the memory, swap and clean-up checks that look at this host apply.
    pub here: bool,
    /// Extra environment for every worker: `.zrun_env` files, then the spec's `env`.
    pub env: Vec<(String, String)>,
    /// Per-node mode: this zrun starts one node's workers only.
    pub per_node: Option<PerNode>,
    /// `device: cuda` on this host: the bytes of its smallest GPU, where the
    /// driver says (for the check that a worker's estimate fits).
    pub gpu_memory: Option<f64>,
    /// `--bind-cores-to-rank`: the cores each host's workers share out
    /// (`all`: the host's physical cores; else `--bind-core-list`'s), passed
    /// as `ZRUN_BIND_CORES`.
    pub bind_cores: Option<String>,
    /// `--enable-each-rank-log`: the directory of each rank's output file
    /// (checked: a directory zrun can write).
    pub rank_log: Option<PathBuf>,
    /// `--launcher-args`, split: `srun`'s or `mpirun`'s, before the worker.
    pub launcher_args: Vec<String>,
}

/// Validates `job` for `topo` ([`LoadedJob::validate_on`]) and settles
/// `train.epochs` into steps for its world, counting an epoch's sequences
/// with the workers' own data code (`zdata`). Returns that count where the
/// job has `train.epochs`.
pub fn validate(job: &mut LoadedJob, topo: &Topology) -> Result<Option<u64>> {
    job.validate_on(topo)?;
    let sequences = job.settle_epochs(topo.world_size(), None, zdata::job::sequences_per_epoch)?;
    Ok(sequences)
}

/// What `train.epochs` came to, for zrun's first lines.
pub fn describe_epochs(spec: &JobSpec, sequences: u64, world: usize) -> String {
    let t = &spec.train;
    format!(
        "train.epochs {}: {} steps of {} sequences over an epoch of {sequences} sequences",
        t.epochs.unwrap_or_default(),
        t.steps,
        t.micro_batch_size * t.grad_accum * world
    )
}

/// Resolves hostfile and launch flags into a topology (bad input: exit 2).
/// Under `--launcher slurm` the allocation gives the nodes: `--num-nodes` or
/// `SLURM_JOB_NUM_NODES`, and `--workers-per-node` or `SLURM_NTASKS_PER_NODE`.
pub fn topology(args: &LaunchArgs) -> Result<Topology> {
    if args.launcher == Some(Launcher::Slurm) {
        return slurm_topology(args);
    }
    Ok(Topology::resolve(&TopologyOptions {
        hostfile: args.hostfile.clone(),
        include: args.include.clone(),
        exclude: args.exclude.clone(),
        num_nodes: args.num_nodes,
        workers_per_node: args.workers_per_node,
        default_local_slots: DEFAULT_CPU_WORKERS,
    })?)
}

fn slurm_topology(args: &LaunchArgs) -> Result<Topology> {
    if args.hostfile.is_some() || args.include.is_some() || args.exclude.is_some() {
        return Err(Failure::bad_input(
            "--launcher slurm takes its nodes from the allocation; drop --hostfile/--include/--exclude",
        ));
    }
    let env_num = |k: &str| -> Result<Option<usize>> {
        match std::env::var(k) {
            Ok(v) => {
                // SLURM_NTASKS_PER_NODE may read "2(x3)": the count is what matters.
                let n = v.split(['(', ',']).next().unwrap_or("").trim();
                n.parse()
                    .map(Some)
                    .map_err(|_| Failure::bad_input(format!("{k} = `{v}` is not a number")))
            }
            Err(_) => Ok(None),
        }
    };
    let nodes = args
        .num_nodes
        .or(env_num("SLURM_JOB_NUM_NODES")?)
        .unwrap_or(1);
    let per_node = args
        .workers_per_node
        .or(env_num("SLURM_NTASKS_PER_NODE")?)
        .unwrap_or(DEFAULT_CPU_WORKERS);
    if nodes == 0 || per_node == 0 {
        return Err(Failure::bad_input(
            "--launcher slurm: nodes and workers per node must be at least 1",
        ));
    }
    Ok(Topology {
        nodes: (0..nodes)
            .map(|i| zconfig::Node {
                host: format!("slurm-node-{i}"),
                slots: (0..per_node).collect(),
                port: None,
                user: None,
            })
            .collect(),
    })
}

/// Checks that a launch is possible: launcher, hosts, worker binary.
pub fn plan_launch(args: &LaunchArgs, spec: JobSpec, topology: Topology) -> Result<LaunchPlan> {
    let all_local = topology
        .nodes
        .iter()
        .all(|n| local_address(&n.host).is_some());
    let launcher = args.launcher.unwrap_or(if all_local {
        Launcher::Local
    } else {
        Launcher::Ssh
    });
    if launcher == Launcher::Ssh {
        check_hosts_resolve(args, &topology)?;
    }
    let mut node_addrs = Vec::new();
    for node in &topology.nodes {
        let addr = match launcher {
            // Each worker finds its own node's address (see zworker).
            Launcher::Slurm => "0.0.0.0".into(),
            Launcher::Mpirun if all_local => "127.0.0.1".into(),
            Launcher::Mpirun => "0.0.0.0".into(),
            Launcher::Local => local_address(&node.host).ok_or_else(|| {
                Failure::bad_input(format!(
                    "--launcher local: host `{}` is not this machine",
                    node.host
                ))
            })?,
            _ if node.host == "localhost" => "127.0.0.1".into(),
            _ => node.host.clone(),
        };
        node_addrs.push(addr);
    }
    let ssh = (launcher == Launcher::Ssh).then(|| {
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_default();
        SshOptions {
            key: args.ssh_key.clone(),
            known_hosts: args
                .known_hosts
                .clone()
                .unwrap_or_else(|| home.join(".ssh/known_hosts")),
            accept_new: args.ssh_accept_new,
            port: args.ssh_port,
        }
    });
    if let Some(k) = &args.ssh_key {
        if !k.is_file() {
            return Err(Failure::bad_input(format!(
                "--ssh-key {}: no such file",
                k.display()
            )));
        }
    }
    let master_addr = match (&args.master_addr, launcher) {
        (Some(a), _) => a.clone(),
        (None, Launcher::Local) => "127.0.0.1".into(),
        (None, Launcher::Ssh) => reachable_local_ip(&topology)?,
        (None, Launcher::Slurm) => this_host_ip(),
        (None, Launcher::Mpirun) if all_local => "127.0.0.1".into(),
        (None, Launcher::Mpirun) => reachable_local_ip(&topology)?,
    };
    // Over SSH the binary must exist there, not here: a missing one fails the
    // launch when the remote shell cannot start it.
    let (env, worker_bin) = worker_setup(args, &spec, launcher != Launcher::Ssh)?;
    check_mpi(&spec, launcher, &worker_bin)?;
    let gpu_memory = check_device(&spec, launcher, &worker_bin)?;
    let here = launcher == Launcher::Local || (launcher == Launcher::Mpirun && all_local);
    let bind_cores = bind_cores(args, &topology, here)?;
    let rank_log = rank_log(args)?;
    let launcher_args = launcher_args(args, launcher)?;
    Ok(LaunchPlan {
        spec,
        topology,
        node_addrs,
        master_addr,
        master_port: args.master_port.unwrap_or(0),
        worker_bin,
        ssh,
        launcher,
        here,
        env,
        per_node: None,
        gpu_memory,
        bind_cores,
        rank_log,
        launcher_args,
    })
}

/// `--launcher-args`, split as a shell splits words: for the launchers
/// that run a program of their own (srun, mpirun), else bad input.
fn launcher_args(args: &LaunchArgs, launcher: Launcher) -> Result<Vec<String>> {
    let Some(text) = &args.launcher_args else {
        return Ok(Vec::new());
    };
    if !matches!(launcher, Launcher::Slurm | Launcher::Mpirun) {
        let name = match launcher {
            Launcher::Local => "local",
            _ => "ssh",
        };
        return Err(Failure::bad_input(format!(
            "--launcher-args: these go to srun or mpirun (--launcher slurm or mpirun); this job's launcher is {name}"
        )));
    }
    shlex::split(text).ok_or_else(|| {
        Failure::bad_input(format!("--launcher-args `{text}`: a quote is not closed"))
    })
}

/// `--enable-each-rank-log DIR`, checked (made if missing, written to).
fn rank_log(args: &LaunchArgs) -> Result<Option<PathBuf>> {
    let Some(dir) = &args.enable_each_rank_log else {
        return Ok(None);
    };
    crate::rank_log::RankLogs::open(dir)?;
    Ok(Some(dir.clone()))
}

/// `--bind-cores-to-rank` / `--bind-core-list`: the value workers get as
/// `ZRUN_BIND_CORES`. The list is checked here (bad input); so, where the
/// workers run on this host, are the cores: online, and one at least for
/// each worker of the busiest node. A remote host's worker checks its own.
fn bind_cores(args: &LaunchArgs, topology: &Topology, here: bool) -> Result<Option<String>> {
    use zconfig::cores::{core_list_text, parse_core_list, physical_cores, share};
    let list = match (&args.bind_core_list, args.bind_cores_to_rank) {
        (None, false) => return Ok(None),
        (None, true) => None,
        (Some(l), _) => Some(
            parse_core_list(l).map_err(|e| Failure::bad_input(format!("--bind-core-list: {e}")))?,
        ),
    };
    if here {
        let flag = match list {
            Some(_) => "--bind-core-list",
            None => "--bind-cores-to-rank",
        };
        let online = std::fs::read_to_string("/sys/devices/system/cpu/online")
            .ok()
            .and_then(|s| parse_core_list(s.trim()).ok());
        if let (Some(l), Some(online)) = (&list, &online) {
            if let Some(c) = l.iter().find(|c| !online.contains(c)) {
                return Err(Failure::bad_input(format!(
                    "{flag}: core {c} is not online on this host (online: {})",
                    core_list_text(online)
                )));
            }
        }
        let cores = match &list {
            Some(l) => l.clone(),
            None => physical_cores().map_err(|e| Failure::bad_input(format!("{flag}: {e}")))?,
        };
        let busiest = topology
            .nodes
            .iter()
            .map(|n| n.slots.len())
            .max()
            .unwrap_or(1);
        share(&cores, busiest, 0).map_err(|e| Failure::bad_input(format!("{flag}: {e}")))?;
    }
    Ok(Some(
        list.map_or_else(|| "all".into(), |l| core_list_text(&l)),
    ))
}

/// `device: cuda` is checked before launch (bad input, exit 2): that the GPU
/// model runs the job (GPT-2's family, f32, whole linears) and, where the
/// workers start on this host, that its zworker finds GPUs to train on (its
/// `--cuda-devices`: the `cuda` feature, the driver, a GPU, NVRTC, cuBLAS;
/// NCCL with `comm.backend: nccl`),
/// so that a user hears what is missing before anything starts. Over SSH
/// each worker checks its own host when it starts. Returns the bytes of
/// this host's smallest GPU, where the driver says.
pub fn check_device(
    spec: &JobSpec,
    launcher: Launcher,
    worker_bin: &std::path::Path,
) -> Result<Option<f64>> {
    if spec.device != zconfig::spec::Device::Cuda {
        return Ok(None);
    }
    if let Some(why) = spec.gpu_unsupported() {
        return Err(Failure::bad_input(format!("device: cuda: {why}")));
    }
    let attention = std::env::var("ZRUN_GPU_ATTENTION").ok();
    if let Some(why) = fused_attention_refused(spec, attention.as_deref()) {
        return Err(Failure::bad_input(why));
    }
    if launcher == Launcher::Ssh {
        return Ok(None);
    }
    let nccl = spec.comm.backend == zconfig::spec::Backend::Nccl;
    local_gpus(worker_bin, nccl)
        .map(|gpus| gpus.smallest_memory)
        .map_err(|why| Failure::bad_input(format!("device: cuda: {why}")))
}

/// Whether the GPU's workers run `spec`'s attention as the fused kernels,
/// by `ZRUN_GPU_ATTENTION` in zrun's environment (which local workers
/// inherit): [`JobSpec::gpu_attention_fused`].
pub(crate) fn fused_attention_expected(spec: &JobSpec) -> bool {
    spec.gpu_attention_fused(std::env::var("ZRUN_GPU_ATTENTION").ok().as_deref())
}

/// Why `ZRUN_GPU_ATTENTION` (read by local workers, which inherit zrun's
/// environment) cannot run this job, if it cannot: a value other than
/// `auto`, `fused` or `unfused`, or `fused` without tensor-core products
/// (bf16 or f16, or TF32) or at a head width the kernels lack (16, 32, 64,
/// and 128 in 16 bits).
fn fused_attention_refused(spec: &JobSpec, value: Option<&str>) -> Option<String> {
    match value {
        None | Some("auto") | Some("unfused") => None,
        Some("fused") => spec.fused_attention_unsupported(),
        Some(other) => Some(format!(
            "ZRUN_GPU_ATTENTION = `{other}`: use auto, fused or unfused"
        )),
    }
}

/// The GPUs a zworker can train on here: how many, and the smallest one's
/// bytes where the driver says.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LocalGpus {
    pub count: usize,
    pub smallest_memory: Option<f64>,
}

/// The GPUs the zworker at `worker_bin` can train on here (with NCCL, if
/// `nccl`), or why none. Its answer: the count, then the smallest GPU's
/// bytes where the driver says.
pub(crate) fn local_gpus(
    worker_bin: &std::path::Path,
    nccl: bool,
) -> std::result::Result<LocalGpus, String> {
    let out = std::process::Command::new(worker_bin)
        .arg("--cuda-devices")
        .args(nccl.then_some("nccl"))
        .output()
        .map_err(|e| format!("running {} --cuda-devices: {e}", worker_bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let mut words = text.split(' ');
    let count = words.next().and_then(|w| w.parse::<usize>().ok());
    let memory = words.next().map(|w| w.parse::<f64>().ok());
    match (out.status.success(), count, memory) {
        (true, Some(count), None | Some(Some(_))) if words.next().is_none() => Ok(LocalGpus {
            count,
            smallest_memory: memory.flatten(),
        }),
        (false, ..) if !text.is_empty() && !text.contains('\n') => Err(text),
        _ => Err(format!(
            "{} does not answer --cuda-devices (rebuild it)",
            worker_bin.display()
        )),
    }
}

/// `device: cuda` on this host with neither a hostfile nor
/// `--workers-per-node`: one worker per GPU that its zworker finds (as
/// torchrun's `--nproc-per-node gpu`). Anything else is left as given.
pub fn with_gpu_defaults(args: &LaunchArgs, spec: &JobSpec) -> LaunchArgs {
    let mut out = args.clone();
    let local = matches!(args.launcher, None | Some(Launcher::Local));
    if spec.device == zconfig::spec::Device::Cuda
        && local
        && args.hostfile.is_none()
        && args.workers_per_node.is_none()
    {
        let bin = args
            .worker_bin
            .clone()
            .or_else(|| default_worker_bin().ok());
        if let Some(Ok(gpus)) = bin.map(|b| local_gpus(&b, false)) {
            out.workers_per_node = Some(gpus.count);
        }
    }
    out
}

/// `comm.backend: mpi` needs workers started by mpirun and built with MPI;
/// `--launcher mpirun` needs mpirun. Each is bad input (exit 2) before launch.
pub fn check_mpi(spec: &JobSpec, launcher: Launcher, worker_bin: &std::path::Path) -> Result<()> {
    if launcher == Launcher::Mpirun && which("mpirun").is_none() {
        return Err(Failure::bad_input(
            "--launcher mpirun: mpirun is not on PATH (Debian: apt-get install openmpi-bin)",
        ));
    }
    if spec.comm.backend != zconfig::spec::Backend::Mpi {
        return Ok(());
    }
    if launcher != Launcher::Mpirun {
        return Err(Failure::bad_input(
            "comm.backend: mpi: workers join MPI through mpirun; add --launcher mpirun",
        ));
    }
    worker_has_mpi(worker_bin)
}

/// The zworker binary was built with the `mpi` feature (it lists its features
/// when asked), or bad input saying how to build it.
pub fn worker_has_mpi(worker_bin: &std::path::Path) -> Result<()> {
    let out = std::process::Command::new(worker_bin)
        .arg("--features")
        .output()
        .map_err(|e| {
            Failure::launch(format!("running {} --features: {e}", worker_bin.display()))
        })?;
    if String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .any(|f| f == "mpi")
    {
        return Ok(());
    }
    Err(Failure::bad_input(format!(
        "MPI: {} was built without the `mpi` feature (build it with `cargo build --release --features mpi`, which needs libopenmpi-dev and libclang-dev)",
        worker_bin.display()
    )))
}

/// `name` on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|f| f.is_file())
}

/// Every worker's extra environment (`.zrun_env` files, then the spec's
/// `env`) and the zworker binary (`--worker-bin`, else the one next to zrun),
/// checked to exist on this host when `here`.
fn worker_setup(
    args: &LaunchArgs,
    spec: &JobSpec,
    here: bool,
) -> Result<(Vec<(String, String)>, PathBuf)> {
    let mut env = read_zrun_env()?;
    env.extend(spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    let worker_bin = match &args.worker_bin {
        Some(p) => p.clone(),
        None => default_worker_bin()?,
    };
    if here && !worker_bin.is_file() {
        return Err(Failure::launch(format!(
            "zworker not found at {} (build it with `cargo build --release`, or pass --worker-bin)",
            worker_bin.display()
        )));
    }
    Ok((env, worker_bin))
}

/// The plan of one node of a per-node job: every rank in the topology, this
/// node's to start. Workers listen on `--node-addr`, or each on its address on
/// the route to node 0 (as under Slurm).
pub fn plan_per_node(
    args: &LaunchArgs,
    node_addr: Option<&str>,
    spec: JobSpec,
    per_node: PerNode,
) -> Result<LaunchPlan> {
    let topology = crate::pernode::topology(&per_node);
    let mut node_addrs = vec!["0.0.0.0".to_string(); per_node.nnodes];
    if let Some(a) = node_addr {
        node_addrs[per_node.node_rank] = a.to_string();
    }
    let (env, worker_bin) = worker_setup(args, &spec, true)?;
    let gpu_memory = check_device(&spec, Launcher::Local, &worker_bin)?;
    let bind_cores = bind_cores(args, &topology, true)?;
    let rank_log = rank_log(args)?;
    Ok(LaunchPlan {
        spec,
        topology,
        node_addrs,
        master_addr: per_node.master_addr.clone(),
        master_port: per_node.master_port,
        worker_bin,
        ssh: None,
        launcher: Launcher::Local,
        here: true,
        env,
        per_node: Some(per_node),
        gpu_memory,
        bind_cores,
        rank_log,
        launcher_args: launcher_args(args, Launcher::Local)?,
    })
}

/// Every host of an SSH job must resolve, or the job is bad input naming the
/// hostfile line (not a launch failure discovered while connecting).
fn check_hosts_resolve(args: &LaunchArgs, topology: &Topology) -> Result<()> {
    let Some(path) = &args.hostfile else {
        return Ok(());
    };
    let entries = zconfig::Hostfile::read(path)?.entries;
    for node in &topology.nodes {
        if let Err(e) = std::net::ToSocketAddrs::to_socket_addrs(&(node.host.as_str(), 22)) {
            let line = entries
                .iter()
                .find(|h| h.host == node.host)
                .map_or(0, |h| h.line);
            return Err(zconfig::ConfigError::Hostfile {
                path: path.clone(),
                line,
                message: format!("host `{}` does not resolve: {e}", node.host),
            }
            .into());
        }
    }
    Ok(())
}

/// This host's first non-loopback address (what other nodes of an allocation
/// reach), else loopback.
fn this_host_ip() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    std::net::ToSocketAddrs::to_socket_addrs(&(name.trim(), 0))
        .ok()
        .and_then(|mut a| a.find(|a| a.is_ipv4() && !a.ip().is_loopback()))
        .map_or_else(|| "127.0.0.1".into(), |a| a.ip().to_string())
}

/// This host's address on the route to the first remote node (no packet is sent).
fn reachable_local_ip(topology: &Topology) -> Result<String> {
    let Some(remote) = topology
        .nodes
        .iter()
        .find(|n| local_address(&n.host).is_none())
    else {
        return Ok("127.0.0.1".into());
    };
    let probe = std::net::UdpSocket::bind("0.0.0.0:0")
        .and_then(|s| s.connect((remote.host.as_str(), 9)).map(|_| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| {
            Failure::launch(format!(
                "no route to {}: {e} (pass --master-addr)",
                remote.host
            ))
        })?;
    Ok(probe.ip().to_string())
}

/// DeepSpeed's `.deepspeed_env`, as `.zrun_env`: `KEY=VALUE` lines forwarded to
/// every worker, from `~/.zrun_env` and then `./.zrun_env`. Comments (`#`) and
/// blank lines are ignored.
pub fn read_zrun_env() -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let home = std::env::var_os("HOME").map(PathBuf::from);
    for path in home
        .map(|h| h.join(".zrun_env"))
        .into_iter()
        .chain([PathBuf::from(".zrun_env")])
    {
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (k, v) = line.split_once('=').ok_or_else(|| {
                Failure::bad_input(format!(
                    "{}:{}: expected KEY=VALUE, got `{line}`",
                    path.display(),
                    i + 1
                ))
            })?;
            let k = k.trim().trim_start_matches("export ").trim();
            if k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(Failure::bad_input(format!(
                    "{}:{}: `{k}` is not a variable name",
                    path.display(),
                    i + 1
                )));
            }
            out.push((k.to_string(), v.trim().trim_matches('"').to_string()));
        }
    }
    Ok(out)
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
    let mut job = load_job_with(&args.job, &args.set, args.deepspeed.as_deref())?;
    warn_deepspeed(&job);
    let topo = topology(&args.launch)?;
    let epoch = validate(&mut job, &topo)?;
    let plan = plan_launch(&args.launch, job.spec.clone(), topo)?;
    // What `zrun train` refuses before launch, on this host's jobs.
    crate::train::check_memory(&plan)?;
    crate::swap_check::check_offload(&plan)?;
    crate::train::check_init_from(&plan.spec)?;
    crate::monitor::check(&plan.spec, false)?;
    say!("# job {} ({}): valid", job.spec.name, args.job.display());
    say!("{}", serde_json::to_string_pretty(&plan.spec)?);
    if let Some((config, keys)) = job.model_from() {
        say!("# from {}: {}", config.display(), keys.join(", "));
    }
    if let Some(sequences) = epoch {
        let world = plan.topology.world_size();
        say!("# {}", describe_epochs(&plan.spec, sequences, world));
    }
    if let Some(c) = &plan.spec.train.curriculum {
        say!(
            "# {}",
            c.summary(plan.spec.train.steps, plan.spec.model.seq_len)
        );
    }
    if let Some(pld) = &plan.spec.train.progressive_layer_drop {
        say!(
            "# {}",
            pld.summary(plan.spec.train.steps, plan.spec.model.n_layers)
        );
    }
    if let Some(frozen) = zconfig::freeze::summary(&plan.spec.model, &plan.spec.train.freeze) {
        say!("# {frozen}");
    }
    print_deepspeed_sources(&job, plan.topology.world_size())?;
    say!(
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
        say!(
            "node {i}: {} (address {}) slots {:?} ranks {}",
            node.host,
            plan.node_addrs[i],
            node.slots,
            ranks.join(",")
        );
    }
    say!("# worker binary: {}", plan.worker_bin.display());
    if let Some(cores) = &plan.bind_cores {
        let cores = match cores.as_str() {
            "all" => "the host's physical cores",
            list => list,
        };
        say!("# workers pinned: each host's workers share {cores} in local-rank order");
    }
    if let Some(dir) = &plan.rank_log {
        say!(
            "# each rank's output: {}/<launch time>_rank<R>.log",
            dir.display()
        );
    }
    if !plan.launcher_args.is_empty() {
        say!("# launcher arguments: {:?}", plan.launcher_args);
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints, once, the ds_config's keys that zrun ignores by design and what
/// it superseded.
pub fn warn_deepspeed(job: &LoadedJob) {
    let Some(ds) = job.deepspeed() else {
        return;
    };
    if let Some(w) = ds.ignored_warning() {
        shout!("zrun: warning: {w}");
    }
    for note in &ds.notes {
        shout!("zrun: {}: {note}", ds.path.display());
    }
}

/// `zrun check --deepspeed`: every job key the ds_config set, its resolved
/// value beside the ds_config key (and line) it came from.
fn print_deepspeed_sources(job: &LoadedJob, world: usize) -> Result<()> {
    let Some(ds) = job.deepspeed() else {
        return Ok(());
    };
    let resolved = serde_json::to_value(&job.spec)?;
    say!("# from {} (DeepSpeed):", ds.path.display());
    let width = ds.mapped.iter().map(|m| m.key.len()).max().unwrap_or(0);
    for m in &ds.mapped {
        let now = m
            .key
            .split('.')
            .try_fold(&resolved, |v, k| v.get(k))
            .cloned()
            .unwrap_or(serde_json::Value::Null);
        let line = m.at.0;
        let how = match (&m.value, m.origin) {
            (MappedValue::Job, _) => {
                format!("{} = \"auto\" (line {line}): the job's value", m.source)
            }
            (_, Origin::Default) => format!(
                "{} omitted: DeepSpeed's default (section at line {line})",
                m.source
            ),
            (MappedValue::TimesLr(r), _) => format!("{} = {r} (line {line}) × train.lr", m.source),
            _ => format!("{} (line {line})", m.source),
        };
        let kept = match &m.value {
            MappedValue::Set(v)
                if m.origin != Origin::Auto && !zconfig::deepspeed::same_value(v, &now) =>
            {
                " — not taken: the job file or --set gives its own value"
            }
            _ => "",
        };
        say!("#   {:width$} = {now}  ← {how}{kept}", m.key);
    }
    if let Some((total, at)) = ds.train_batch_size {
        let t = &job.spec.train;
        say!(
            "#   train_batch_size {total} (line {}) = micro-batch {} × accumulation {} × {world} workers",
            at.0,
            t.micro_batch_size,
            t.grad_accum
        );
    }
    Ok(())
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

    /// A stand-in zworker that answers `--cuda-devices` with `answer` and
    /// exit status `status`.
    fn fake_worker(dir: &std::path::Path, answer: &str, status: i32) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join(format!("zworker-{status}"));
        std::fs::write(&p, format!("#!/bin/sh\necho '{answer}'\nexit {status}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    fn job(dir: &std::path::Path, device: &str) -> JobSpec {
        job_with(dir, device, &[])
    }

    fn job_with(dir: &std::path::Path, device: &str, sets: &[&str]) -> JobSpec {
        let p = dir.join(format!("{device}.yaml"));
        std::fs::write(
            &p,
            format!("model: {{d_model: 32, n_heads: 4}}\ndata: {{format: synthetic}}\ndevice: {device}\n"),
        )
        .unwrap();
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        zconfig::load::load_job(&p, &sets).unwrap().spec
    }

    #[test]
    fn the_fused_attention_opt_in_is_refused_where_it_cannot_run() {
        let dir = tempfile::tempdir().unwrap();
        let refused = |sets: &[&str], value: Option<&str>| {
            fused_attention_refused(&job_with(dir.path(), "cuda", sets), value)
        };
        let (bf16, tf32, heads16) = (
            "train.dtype=bf16",
            "train.allow_tf32=true",
            "model.n_heads=2",
        );
        assert_eq!(refused(&[bf16, heads16], Some("fused")), None);
        assert_eq!(refused(&["train.dtype=f16", heads16], Some("fused")), None);
        assert_eq!(refused(&[tf32, heads16], Some("fused")), None);
        assert_eq!(refused(&[], None), None);
        assert_eq!(refused(&[], Some("unfused")), None);
        let why = refused(&[heads16], Some("fused")).unwrap();
        assert!(
            why.contains("train.dtype: bf16 (or f16) or train.allow_tf32"),
            "{why}"
        );
        // d_model 32 on 4 heads: width 8.
        let why = refused(&[bf16], Some("fused")).unwrap();
        assert!(
            why.contains("head widths 16, 32, 64 and 128") && why.ends_with("is 8"),
            "{why}"
        );
        // Width 128: 16 bits, not TF32.
        let wide = ["model.d_model=256", "model.n_heads=2"];
        assert_eq!(refused(&[bf16, wide[0], wide[1]], Some("fused")), None);
        let why = refused(&[tf32, wide[0], wide[1]], Some("fused")).unwrap();
        assert!(
            why.contains("head width 128 multiplies in 16 bits"),
            "{why}"
        );
        let why = refused(&[bf16, heads16], Some("flash")).unwrap();
        assert_eq!(
            why,
            "ZRUN_GPU_ATTENTION = `flash`: use auto, fused or unfused"
        );
        assert_eq!(refused(&[], Some("auto")), None);
    }

    #[test]
    fn attention_is_fused_by_default_where_it_runs_at_widths_up_to_64() {
        let dir = tempfile::tempdir().unwrap();
        let fused = |sets: &[&str], value: Option<&str>| {
            job_with(dir.path(), "cuda", sets).gpu_attention_fused(value)
        };
        let (bf16, tf32, heads16) = (
            "train.dtype=bf16",
            "train.allow_tf32=true",
            "model.n_heads=2",
        );
        let wide = ["model.d_model=256", "model.n_heads=2"];
        for default in [None, Some("auto")] {
            assert!(fused(&[bf16, heads16], default));
            assert!(fused(&["train.dtype=f16", heads16], default));
            assert!(fused(&[tf32, heads16], default));
            // f32 products, a width without kernels, and 128 (slower there).
            assert!(!fused(&[heads16], default));
            assert!(!fused(&[bf16], default));
            assert!(!fused(&[bf16, wide[0], wide[1]], default));
        }
        assert!(fused(&[bf16, wide[0], wide[1]], Some("fused")));
        assert!(!fused(&[bf16, heads16], Some("unfused")));
        // Attention's dropout: the unfused path by default (the fused
        // kernels with dropout are not yet timed), `fused` on request.
        let dropped = [bf16, heads16, "model.attention_dropout=0.1"];
        for default in [None, Some("auto")] {
            assert!(!fused(&dropped, default));
        }
        assert!(fused(&dropped, Some("fused")));
        let spec = job_with(dir.path(), "cuda", &dropped);
        assert_eq!(spec.fused_attention_unsupported(), None);
        // The dropout kernels' mask index within a head is 32-bit.
        let long = [dropped[0], dropped[1], dropped[2], "model.seq_len=65536"];
        let why = job_with(dir.path(), "cuda", &long)
            .fused_attention_unsupported()
            .unwrap();
        assert!(why.contains("sequences of up to 65535"), "{why}");
        assert_eq!(
            job_with(dir.path(), "cuda", &long[..3]).fused_attention_unsupported(),
            None
        );
        assert!(fused(&dropped[..2], None));
    }

    fn launch(args: &[&str]) -> LaunchArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            launch: LaunchArgs,
        }
        <Cli as clap::Parser>::parse_from(std::iter::once("zrun").chain(args.iter().copied()))
            .launch
    }

    #[test]
    fn device_cuda_defaults_to_one_worker_per_gpu_the_worker_finds() {
        let dir = tempfile::tempdir().unwrap();
        let three = fake_worker(dir.path(), "3", 0);
        let bin = three.to_str().unwrap();
        let (cuda, cpu) = (job(dir.path(), "cuda"), job(dir.path(), "cpu"));
        let chosen =
            |args: &[&str], spec: &JobSpec| with_gpu_defaults(&launch(args), spec).workers_per_node;
        assert_eq!(chosen(&["--worker-bin", bin], &cuda), Some(3));
        // What the user said stands; a CPU job keeps the CPU default.
        let one = ["--worker-bin", bin, "--workers-per-node", "1"];
        assert_eq!(chosen(&one, &cuda), Some(1));
        assert_eq!(chosen(&["--worker-bin", bin], &cpu), None);
        assert_eq!(check_device(&cuda, Launcher::Local, &three).unwrap(), None);
        // With the smallest GPU's bytes after the count.
        let sized = fake_worker(dir.path(), "3 85899345920", 0);
        let gpus = local_gpus(&sized, false).unwrap();
        assert_eq!((gpus.count, gpus.smallest_memory), (3, Some(85899345920.0)));
        let garbled = fake_worker(dir.path(), "3 lots", 0);
        assert!(local_gpus(&garbled, false).is_err());
        // A worker that finds none leaves the default, and the check says why.
        let none = fake_worker(dir.path(), "no CUDA driver on this host", 1);
        let bin = none.to_str().unwrap();
        assert_eq!(chosen(&["--worker-bin", bin], &cuda), None);
        let err = check_device(&cuda, Launcher::Local, &none).unwrap_err();
        let f = err.downcast_ref::<Failure>().expect("a Failure");
        assert_eq!(f.code, crate::exit::BAD_INPUT);
        assert_eq!(f.message, "device: cuda: no CUDA driver on this host");
    }
}
