//! The SSH launcher against a real sshd on 127.0.0.2 and 127.0.0.3 (each hostfile
//! line one node): training across "hosts", a killed remote worker, Ctrl-C, and
//! host-key and authentication failures.

use std::time::{Duration, Instant};

use e2e::{descendants_named, metrics, small_job, wait_until, zrun, Sshd, TrainArgs, Zrun};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Across two "hosts", each remote worker pinned by `--bind-core-list`
/// where it runs (zrun checks a remote host's cores there, not here).
#[test]
fn a_two_host_job_trains_and_sends_bytes_between_nodes() {
    let sshd = e2e::sshd_or_skip!();
    let d = tempfile::tempdir().unwrap();
    let job = small_job(d.path(), "ssh", 5);
    let m = d.path().join("m.jsonl");
    let core = *zconfig::cores::physical_cores().unwrap().last().unwrap();
    let f = TrainArgs::new(&job, &m)
        .args(&sshd.launch_args())
        .args(&["--bind-core-list", &core.to_string()])
        .run(d.path());
    assert_eq!(f.code(), 0, "{f:?}");
    for rank in 0..2 {
        let said = format!("rank {rank} (local rank 0 of 1 on ");
        let pinned = f.stdout.lines().any(|l| {
            // "... bound to cores 1" or "... bound to cores 1, memory on NUMA node 0"
            let cores = l
                .split_once("bound to cores ")
                .map(|(_, c)| c.split(',').next());
            l.contains(&said) && cores == Some(Some(core.to_string().as_str()))
        });
        assert!(pinned, "rank {rank}: {}", f.stdout);
    }
    let lines = metrics(&m);
    assert_eq!(lines[1]["world_size"], 2);
    assert!(lines[1]["comm_bytes"]["inter_node"].as_u64().unwrap() > 0);
    assert_eq!(lines[1]["comm_bytes"]["intra_node"], 0);
    assert!(descendants_named(sshd.pid(), "zworker").is_empty());
}

fn start_long(sshd: &Sshd, d: &std::path::Path) -> (Zrun, Vec<u32>) {
    let job = small_job(d, "long", 100_000);
    let m = d.join("m.jsonl");
    let z = TrainArgs::new(&job, &m).args(&sshd.launch_args()).start(d);
    assert!(
        wait_until(Duration::from_secs(60), || metrics(&m).len() >= 2),
        "{}",
        z.stdout_so_far()
    );
    let workers = descendants_named(sshd.pid(), "zworker");
    assert_eq!(workers.len(), 2, "{workers:?}");
    (z, workers)
}

#[test]
fn a_remote_worker_killed_fails_the_job_fast_and_leaves_nothing_on_either_host() {
    let sshd = e2e::sshd_or_skip!();
    let d = tempfile::tempdir().unwrap();
    let (z, workers) = start_long(&sshd, d.path());
    let t0 = Instant::now();
    kill(Pid::from_raw(workers[0] as i32), Signal::SIGKILL).unwrap();
    let f = z.wait(Duration::from_secs(30));
    assert_eq!(f.code(), 1, "{f:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
    assert!(
        f.stderr.contains(&format!("pid {}", workers[0])),
        "{}",
        f.stderr
    );
    assert!(
        sshd.workers_gone(Duration::from_secs(5)),
        "zworkers left under sshd"
    );
}

#[test]
fn sigint_stops_remote_workers_with_exit_130() {
    let sshd = e2e::sshd_or_skip!();
    let d = tempfile::tempdir().unwrap();
    let (z, _) = start_long(&sshd, d.path());
    z.signal(Signal::SIGINT);
    let f = z.wait(Duration::from_secs(30));
    assert_eq!(f.code(), 130, "{f:?}");
    assert!(
        sshd.workers_gone(Duration::from_secs(5)),
        "zworkers left under sshd"
    );
}

#[test]
fn a_wrong_host_key_or_a_refused_key_is_exit_3_before_training() {
    let sshd = e2e::sshd_or_skip!();
    let d = tempfile::tempdir().unwrap();
    let job = small_job(d.path(), "refused", 3);
    let m = d.path().join("m.jsonl");
    let h = sshd.hostfile().display().to_string();
    // A known_hosts file with another key for the hosts.
    let other = d.path().join("other_key");
    assert!(std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&other)
        .status()
        .unwrap()
        .success());
    let pubkey = std::fs::read_to_string(other.with_extension("pub")).unwrap();
    let key_part: Vec<&str> = pubkey.split_whitespace().take(2).collect();
    let wrong = d.path().join("known_hosts");
    std::fs::write(
        &wrong,
        format!(
            "[127.0.0.2]:{p} {k}\n[127.0.0.3]:{p} {k}\n",
            p = sshd.port,
            k = key_part.join(" ")
        ),
    )
    .unwrap();
    let run = |known: &str, key: &str| {
        TrainArgs::new(&job, &m)
            .args(&["--hostfile", &h, "--launcher", "ssh"])
            .args(&["--ssh-key", key, "--known-hosts", known])
            .run(d.path())
    };
    let f = run(wrong.to_str().unwrap(), &sshd.file("client_key"));
    assert_eq!(f.code(), 3, "{f:?}");
    assert!(f.stderr.contains("does not match"), "{}", f.stderr);
    // An empty known_hosts: the key is unknown.
    let empty = d.path().join("empty_known_hosts");
    std::fs::write(&empty, "").unwrap();
    let f = run(empty.to_str().unwrap(), &sshd.file("client_key"));
    assert_eq!(f.code(), 3, "{f:?}");
    assert!(
        f.stderr.contains("is not in") && f.stderr.contains("--ssh-accept-new"),
        "{}",
        f.stderr
    );
    // A key the server does not accept.
    let f = run(&sshd.file("known_hosts"), other.to_str().unwrap());
    assert_eq!(f.code(), 3, "{f:?}");
    assert!(f.stderr.contains("refused the key"), "{}", f.stderr);
    assert!(metrics(&m).is_empty(), "nothing may train");
}

#[test]
fn a_missing_remote_zworker_is_exit_3_naming_the_host() {
    let sshd = e2e::sshd_or_skip!();
    let d = tempfile::tempdir().unwrap();
    let job = small_job(d.path(), "nobin", 3);
    let f = TrainArgs::new(&job, d.path().join("m.jsonl"))
        .args(&["--worker-bin", "/nonexistent/zworker"])
        .args(&sshd.launch_args())
        .run(d.path());
    assert_eq!(f.code(), 3, "{f:?}");
    assert!(
        f.stderr.contains("127.0.0.") && f.stderr.contains("before joining the job"),
        "{}",
        f.stderr
    );
}

#[test]
fn ssh_accept_new_records_unknown_host_keys_and_trains() {
    let sshd = e2e::sshd_or_skip!();
    let d = tempfile::tempdir().unwrap();
    let job = small_job(d.path(), "accept", 2);
    let known = d.path().join("known_hosts");
    std::fs::write(&known, "").unwrap();
    let (h, key) = (
        sshd.hostfile().display().to_string(),
        sshd.file("client_key"),
    );
    let args = [
        "train",
        job.to_str().unwrap(),
        "--hostfile",
        &h,
        "--launcher",
        "ssh",
        "--ssh-key",
        &key,
    ];
    let mut with = args.to_vec();
    with.extend(["--known-hosts", known.to_str().unwrap(), "--ssh-accept-new"]);
    let f = zrun(d.path(), &with);
    assert_eq!(f.code(), 0, "{f:?}");
    let recorded = std::fs::read_to_string(&known).unwrap();
    for host in ["127.0.0.2", "127.0.0.3"] {
        assert!(
            recorded.contains(&format!("[{host}]:{}", sshd.port)),
            "{recorded}"
        );
    }
    // Now known: the same run needs no --ssh-accept-new.
    let mut again = args.to_vec();
    again.extend(["--known-hosts", known.to_str().unwrap()]);
    assert_eq!(zrun(d.path(), &again).code(), 0);
}

/// A worker on a host that zrun cannot see takes its share of that host's
/// cores for its compute threads (until 2026-12-07 it ran one for every
/// core): two workers a "host" on this machine run cores / 2 each, counted
/// as the threads named as the process is (its main thread and rayon's
/// pool; the others have names of their own).
#[test]
fn remote_workers_run_their_share_of_the_hosts_cores() {
    let sshd = e2e::sshd_or_skip!();
    let d = tempfile::tempdir().unwrap();
    let job = small_job(d.path(), "shared", 100_000);
    let m = d.path().join("m.jsonl");
    // Two slots on each host, and sshd's port from `--ssh-port` (DeepSpeed's
    // `--ssh_port`), not the hostfile.
    let mut launch = sshd.launch_args();
    let two = d.path().join("hosts");
    let one = std::fs::read_to_string(&launch[1]).unwrap();
    let port = one
        .split("port=")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    let without = one
        .replace("slots=1", "slots=2")
        .replace(&format!(" port={port}"), "");
    assert!(!without.contains("port="), "{without}");
    std::fs::write(&two, without).unwrap();
    launch[1] = two.display().to_string();
    launch.extend(["--ssh-port".to_string(), port]);
    let z = TrainArgs::new(&job, &m).args(&launch).start(d.path());
    assert!(
        wait_until(Duration::from_secs(60), || metrics(&m).len() >= 2),
        "{}",
        z.stdout_so_far()
    );
    let workers = descendants_named(sshd.pid(), "zworker");
    assert_eq!(workers.len(), 4, "{workers:?}");
    let cores = std::thread::available_parallelism().unwrap().get();
    for w in workers {
        let compute = std::fs::read_dir(format!("/proc/{w}/task"))
            .unwrap()
            .filter(|t| {
                let comm = t.as_ref().unwrap().path().join("comm");
                std::fs::read_to_string(comm).unwrap_or_default().trim() == "zworker"
            })
            .count()
            - 1;
        assert_eq!(compute, (cores / 2).max(1), "worker {w} on {cores} cores");
    }
}
