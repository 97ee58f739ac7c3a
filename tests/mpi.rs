//! Training over MPI: zworker built with `--features mpi`, started by
//! `zrun train --launcher mpirun` on the loopback 2-node hostfile (2 workers on
//! 127.0.0.2, 2 on 127.0.0.3; mpirun runs them all on this host, zrun keeps
//! the nodes apart in its accounting). The ring adds in zrun's order on MPI as
//! on TCP, so every loss must be bit-identical: stages 0-3 and hpZ on MPI, and
//! stage 0 over TCP.
//!
//! Without an MPI-enabled zworker or without mpirun the training test prints
//! that it skipped; CI builds one and sets `ZRUN_REQUIRE_MPI=1`, and then it
//! fails instead. The refusals are checked on every build.

use std::path::{Path, PathBuf};
use std::process::Command;

use e2e::{bin, losses, metrics, repo_root, zrun, TrainArgs};

/// True when zworker was built with MPI and mpirun is here; otherwise says
/// why the test skips (or fails, under `ZRUN_REQUIRE_MPI=1`).
fn mpi_ready() -> bool {
    let features = Command::new(bin("zworker"))
        .arg("--features")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let mpirun = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("mpirun").is_file()));
    let missing = match (features.split_whitespace().any(|f| f == "mpi"), mpirun) {
        (true, true) => return true,
        (false, _) => "zworker was built without the `mpi` feature (cargo build --release --features zworker/mpi)",
        (true, false) => "mpirun is not on PATH (apt-get install openmpi-bin)",
    };
    assert!(
        std::env::var("ZRUN_REQUIRE_MPI").as_deref() != Ok("1"),
        "ZRUN_REQUIRE_MPI=1 but {missing}"
    );
    eprintln!("SKIPPED: {missing}");
    false
}

fn two_nodes(dir: &Path) -> PathBuf {
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "127.0.0.2 slots=2\n127.0.0.3 slots=2\n").unwrap();
    hosts
}

/// configs/tiny.yaml's model on synthetic data, 4 steps.
fn job(dir: &Path) -> PathBuf {
    let job = dir.join("job.yaml");
    std::fs::write(
        &job,
        format!(
            "name: mpi\nmodel: {{vocab_size: 256, d_model: 128, n_layers: 4, n_heads: 4, seq_len: 64}}\n\
             data: {{format: synthetic}}\ntrain: {{steps: 4, micro_batch_size: 4}}\nrun_dir: {}/runs\n",
            dir.display()
        ),
    )
    .unwrap();
    job
}

#[test]
fn stages_0_to_3_and_hpz_on_mpi_match_tcp_bit_for_bit_on_two_loopback_nodes() {
    if !mpi_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (hosts, job) = (two_nodes(dir.path()), job(dir.path()));
    // The losses of a run, and what zrun printed.
    let run_with = |name: &str, launcher: &str, sets: &[&str], extra: &[&str]| {
        let m = dir.path().join(format!("{name}.jsonl"));
        let mut args = TrainArgs::new(&job, &m)
            .args(&[
                "--hostfile",
                hosts.to_str().unwrap(),
                "--launcher",
                launcher,
            ])
            .args(extra);
        for s in sets {
            args = args.set(*s);
        }
        let f = args.run(&repo_root());
        assert_eq!(f.code(), 0, "{name}: {f:?}");
        let lines = metrics(&m);
        let l = losses(&lines);
        assert_eq!(l.len(), 4, "{name}");
        assert!(
            lines.iter().any(|x| x["world_size"] == 4),
            "{name}: not 4 workers"
        );
        (l, f.stdout)
    };
    let run = |name: &str, launcher: &str, sets: &[&str]| run_with(name, launcher, sets, &[]).0;
    let tcp = run("tcp", "local", &["comm.backend=tcp", "zero.stage=0"]);
    for stage in 0..=3 {
        let got = run(
            &format!("mpi{stage}"),
            "mpirun",
            &["comm.backend=mpi", &format!("zero.stage={stage}")],
        );
        assert_eq!(got, tcp, "stage {stage} on MPI differs from stage 0 on TCP");
    }
    let hpz = run(
        "hpz",
        "mpirun",
        &[
            "comm.backend=mpi",
            "zero.stage=3",
            "zero.zero_hpz_partition_size=2",
        ],
    );
    assert_eq!(
        hpz, tcp,
        "hpZ on MPI (its node groups split from the world)"
    );
    // auto on two nodes under mpirun is MPI: the same bits again; and
    // `--launcher-args` reach mpirun (its map of the job, on its stdout).
    let (auto, said) = run_with(
        "auto",
        "mpirun",
        &["zero.stage=2"],
        &["--launcher-args", "--display-map"],
    );
    assert_eq!(auto, tcp, "comm.backend auto under mpirun");
    assert!(
        said.contains("(mpirun)") && said.contains("JOB MAP"),
        "{said}"
    );
}

#[test]
fn mpi_is_refused_before_launch_where_it_cannot_run() {
    let dir = tempfile::tempdir().unwrap();
    let job = job(dir.path());
    let m = dir.path().join("m.jsonl");
    // Not started by mpirun.
    let f = TrainArgs::new(&job, &m)
        .set("comm.backend=mpi")
        .run(&repo_root());
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("comm.backend: mpi") && f.stderr.contains("--launcher mpirun"),
        "{}",
        f.stderr
    );
    // A zworker without the feature (one that lists no features).
    let fake = dir.path().join("zworker");
    std::fs::write(&fake, "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let f = zrun(
        &repo_root(),
        &[
            "bench",
            "comm",
            "--transports",
            "mpi",
            "--worker-bin",
            fake.to_str().unwrap(),
        ],
    );
    if f.stderr.contains("mpirun is not on PATH") {
        assert_eq!(f.code(), 2, "{f:?}");
        eprintln!("SKIPPED the feature check: mpirun is not on PATH");
        return;
    }
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("without the `mpi` feature"),
        "{}",
        f.stderr
    );
}

/// A worker killed under mpirun fails the job (exit 1) within seconds, and
/// neither mpirun nor any worker outlives zrun.
#[test]
fn a_killed_worker_under_mpirun_fails_the_job_and_leaves_nothing() {
    if !mpi_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let hosts = two_nodes(dir.path());
    let (z, _) = e2e::start_long_job(
        dir.path(),
        "killed",
        &[
            "--hostfile",
            hosts.to_str().unwrap(),
            "--launcher",
            "mpirun",
            "--set",
            "comm.backend=mpi",
        ],
    );
    let workers = e2e::descendants_named(z.pid(), "zworker");
    assert_eq!(
        workers.len(),
        4,
        "expected 4 workers under mpirun, found {workers:?}"
    );
    let launcher = e2e::descendants_named(z.pid(), "mpirun");
    assert_eq!(launcher.len(), 1, "{launcher:?}");
    let t0 = std::time::Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(workers[2] as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let f = z.wait(std::time::Duration::from_secs(30));
    assert_eq!(f.code(), 1, "{f:?}");
    assert!(t0.elapsed().as_secs() < 15, "took {:?}", t0.elapsed());
    for p in workers.iter().chain(&launcher) {
        assert!(!e2e::alive(*p), "process {p} outlived zrun");
    }
}
