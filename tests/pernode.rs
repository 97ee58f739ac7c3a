//! Per-node mode end to end: two `zrun train --nnodes 2` on loopback form one
//! job (node 1 configured from the environment, as Kubeflow and torchrun set
//! it), train bit-identically to the same job started by one zrun, and stop
//! together whichever node's zrun dies or is interrupted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use e2e::{
    assert_gone, children_of, ckpt_job, export_ckpt, free_port, losses_by_step, metrics, small_job,
    wait_until, zrun, TrainArgs, Zrun,
};
use nix::sys::signal::Signal;

/// A job token both nodes share (any 64 hex digits).
const TOKEN: &str = "6b1f0c2d9e8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c";

/// The two nodes of a per-node job on `port`: node 0 takes everything from
/// flags (the token from a file), node 1 from the environment.
struct Nodes {
    head: Zrun,
    node1: Zrun,
}

fn start_nodes(dir: &Path, job: &Path, metrics: &Path, port: u16, extra: &[&str]) -> Nodes {
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let port_s = port.to_string();
    let node1 = Zrun::start_with_env(
        dir,
        &[
            &["train", job.to_str().unwrap(), "--nnodes", "2"][..],
            &["--workers-per-node", "1"],
            extra,
        ]
        .concat(),
        &[
            ("RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", &port_s),
            ("ZRUN_TOKEN", TOKEN),
        ],
    );
    let head = TrainArgs::new(job, metrics)
        .args(&[
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "127.0.0.1",
        ])
        .args(&["--master-port", &port_s, "--workers-per-node", "1"])
        .args(&["--token-file", token_file.to_str().unwrap()])
        .args(extra)
        .start(dir);
    Nodes { head, node1 }
}

/// The same job started by one zrun on two loopback "nodes" and by one zrun
/// per node: the same losses and the same final weights, bit for bit.
#[test]
fn two_per_node_zruns_train_like_one_zrun() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let job = ckpt_job(dir, "pernode", 8, 8);
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "127.0.0.1 slots=1\n127.0.0.2 slots=1\n").unwrap();
    let f = TrainArgs::new(&job, dir.join("one.jsonl"))
        .args(&["--hostfile", hosts.to_str().unwrap()])
        .run(dir);
    assert_eq!(f.code(), 0, "{f:?}");
    let one_zrun = export_ckpt(dir, "one.safetensors");
    std::fs::remove_dir_all(dir.join("ckpt")).unwrap();

    let m = dir.join("pernode.jsonl");
    let nodes = start_nodes(dir, &job, &m, free_port(), &[]);
    let head = nodes.head.wait(Duration::from_secs(120));
    let node1 = nodes.node1.wait(Duration::from_secs(60));
    assert_eq!(head.code(), 0, "{head:?}");
    assert_eq!(
        node1.code(),
        0,
        "node 1 exits with the job's code: {node1:?}"
    );
    assert!(
        node1
            .stdout
            .contains("node 1 of 2 joined node 0 at 127.0.0.1"),
        "{}",
        node1.stdout
    );
    assert!(
        head.stdout.contains("2 workers on 2 node(s)"),
        "{}",
        head.stdout
    );
    let steps = losses_by_step(&m);
    assert_eq!(steps.len(), 8);
    assert_eq!(steps, losses_by_step(&dir.join("one.jsonl")));
    assert!(
        export_ckpt(dir, "pernode.safetensors") == one_zrun,
        "final weights differ"
    );
}

/// The workers a node's zrun started.
fn workers_of(z: &Zrun) -> Vec<u32> {
    let pids = children_of(z.pid());
    assert!(!pids.is_empty(), "no workers under zrun {}", z.pid());
    pids
}

/// A long per-node job in `dir`, training.
fn training_nodes(dir: &Path, name: &str) -> (Nodes, PathBuf) {
    let job = small_job(dir, name, 100_000);
    let m = dir.join(format!("{name}.jsonl"));
    let nodes = start_nodes(dir, &job, &m, free_port(), &[]);
    assert!(
        wait_until(Duration::from_secs(60), || metrics(&m).len() >= 2),
        "the job did not start training: {}\nnode 1: {}",
        nodes.head.stdout_so_far(),
        nodes.node1.stdout_so_far()
    );
    (nodes, m)
}

/// SIGKILL to either node's zrun: every worker of both nodes is gone within
/// seconds, and the surviving zrun exits 1 naming what happened. SIGINT to
/// node 1's zrun stops the whole job like a Ctrl-C at node 0 (exit 130 on both).
#[test]
fn a_dead_or_interrupted_node_stops_the_whole_job() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();

    let (nodes, _) = training_nodes(dir, "headdies");
    let workers = [workers_of(&nodes.head), workers_of(&nodes.node1)].concat();
    nodes.head.signal(Signal::SIGKILL);
    let node1 = nodes.node1.wait(Duration::from_secs(30));
    assert_gone(&workers, Duration::from_secs(15), "node 0's zrun killed");
    assert_eq!(node1.code(), 1, "{node1:?}");
    assert!(node1.stderr.contains("lost node 0"), "{}", node1.stderr);
    drop(nodes.head);

    let (nodes, _) = training_nodes(dir, "nodedies");
    let workers = [workers_of(&nodes.head), workers_of(&nodes.node1)].concat();
    nodes.node1.signal(Signal::SIGKILL);
    let head = nodes.head.wait(Duration::from_secs(30));
    assert_gone(&workers, Duration::from_secs(15), "node 1's zrun killed");
    assert_eq!(head.code(), 1, "{head:?}");
    assert!(head.stderr.contains("rank 1"), "{}", head.stderr);
    drop(nodes.node1);

    let (nodes, _) = training_nodes(dir, "interrupted");
    let workers = [workers_of(&nodes.head), workers_of(&nodes.node1)].concat();
    nodes.node1.signal(Signal::SIGINT);
    let node1 = nodes.node1.wait(Duration::from_secs(30));
    let head = nodes.head.wait(Duration::from_secs(30));
    assert_gone(&workers, Duration::from_secs(15), "node 1 interrupted");
    assert_eq!(head.code(), 130, "{head:?}");
    assert!(
        head.stderr.contains("node 1 (host") && head.stderr.contains("interrupted (SIGINT)"),
        "{}",
        head.stderr
    );
    assert_eq!(node1.code(), 130, "{node1:?}");
}

/// Mistakes are exit 2 naming what is wrong: a node rank past the number of
/// nodes, a number of nodes past any cluster's, no token, a hostfile, and a node whose job differs from node 0's
/// (which stops node 0 too, saying why); a node that never comes makes node 0
/// give up at the rendezvous deadline naming it.
#[test]
fn per_node_mistakes_are_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let job = small_job(dir, "mistakes", 3);
    let job_s = job.to_str().unwrap();
    let base = ["train", job_s, "--master-addr", "127.0.0.1"];
    let f = Zrun::start_with_env(
        dir,
        &[&base[..], &["--nnodes", "2", "--node-rank", "2"]].concat(),
        &[("ZRUN_TOKEN", TOKEN)],
    )
    .wait(Duration::from_secs(30));
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("node rank 2 (from --node-rank) is not below the number of nodes, 2"),
        "{}",
        f.stderr
    );
    // A mistyped node count (it was allocated: 2^64 - 1 nodes panicked,
    // 10^11 aborted out of memory).
    for (nnodes, what) in [
        (
            "18446744073709551615",
            "18446744073709551615 nodes of 2 workers are more than 1048576 ranks",
        ),
        (
            "99999999999",
            "99999999999 nodes of 2 workers are more than 1048576 ranks",
        ),
    ] {
        let f = Zrun::start_with_env(
            dir,
            &[&base[..], &["--nnodes", nnodes, "--node-rank", "1"]].concat(),
            &[("ZRUN_TOKEN", TOKEN)],
        )
        .wait(Duration::from_secs(30));
        assert_eq!(f.code(), 2, "{f:?}");
        assert!(f.stderr.contains(what), "{}", f.stderr);
    }
    let f = zrun(
        dir,
        &[&base[..], &["--nnodes", "2", "--node-rank", "1"]].concat(),
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("ZRUN_TOKEN"), "{}", f.stderr);
    let f = Zrun::start_with_env(
        dir,
        &[&base[..], &["--nnodes", "2", "--hostfile", "hosts"]].concat(),
        &[("ZRUN_TOKEN", TOKEN)],
    )
    .wait(Duration::from_secs(30));
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("drop --hostfile"), "{}", f.stderr);

    let quick = ["--set", "comm.timeout_s=8"];
    let m = dir.join("m.jsonl");
    std::fs::write(dir.join("token"), TOKEN).unwrap();
    let port = free_port();
    let port_s = port.to_string();
    let env = [
        ("RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", port_s.as_str()),
        ("ZRUN_TOKEN", TOKEN),
    ];
    let odd = Zrun::start_with_env(
        dir,
        &[
            &["train", job_s, "--nnodes", "2", "--workers-per-node", "1"][..],
            &quick,
            &["--set", "train.lr=0.5"],
        ]
        .concat(),
        &env,
    );
    let token_file = dir.join("token");
    let head = TrainArgs::new(&job, &m)
        .args(&[
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "127.0.0.1",
        ])
        .args(&["--master-port", &port_s, "--workers-per-node", "1"])
        .args(&["--token-file", token_file.to_str().unwrap()])
        .args(&quick)
        .start(dir);
    let odd = odd.wait(Duration::from_secs(30));
    assert_eq!(odd.code(), 2, "{odd:?}");
    assert!(
        odd.stderr
            .contains("this node's job differs from node 0's at train.lr: 0.003 vs 0.5"),
        "{}",
        odd.stderr
    );
    let head = head.wait(Duration::from_secs(60));
    assert_eq!(head.code(), 2, "{head:?}");
    assert!(
        head.stderr.contains("node 1 (host") && head.stderr.contains("differs from node 0's"),
        "{}",
        head.stderr
    );
    let lonely = TrainArgs::new(&job, dir.join("lonely.jsonl"))
        .args(&[
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "127.0.0.1",
        ])
        .args(&[
            "--master-port",
            &free_port().to_string(),
            "--workers-per-node",
            "1",
        ])
        .args(&["--token-file", token_file.to_str().unwrap()])
        .args(&quick)
        .run(dir);
    assert_eq!(lonely.code(), 3, "{lonely:?}");
    assert!(
        lonely
            .stderr
            .contains("ranks 1 never joined (the zrun of node(s) 1 never joined"),
        "{}",
        lonely.stderr
    );
}

/// A preemption notice (SIGUSR1) to node 1's zrun: its workers pass it to
/// every rank, the job ends after one step with a checkpoint of it on both
/// nodes' behalf, and both zruns exit 75.
#[test]
fn sigusr1_to_a_node_stops_the_job_with_a_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let job = ckpt_job(dir, "preempted", 100_000, 100_000);
    let m = dir.join("preempted.jsonl");
    let nodes = start_nodes(dir, &job, &m, free_port(), &[]);
    assert!(
        wait_until(Duration::from_secs(60), || metrics(&m).len() >= 2),
        "the job did not start training: {}",
        nodes.head.stdout_so_far()
    );
    nodes.node1.signal(Signal::SIGUSR1);
    let node1 = nodes.node1.wait(Duration::from_secs(60));
    let head = nodes.head.wait(Duration::from_secs(60));
    assert_eq!(head.code(), 75, "{head:?}");
    assert_eq!(node1.code(), 75, "{node1:?}");
    let last = metrics(&m).pop().unwrap();
    assert_eq!(last["event"], "stopped", "{last}");
    let saved = last["checkpoint"].as_str().unwrap();
    assert!(Path::new(saved).join("manifest.json").is_file(), "{last}");
}
