//! What zrun guarantees when things go wrong around it: a signal or a kill to
//! zrun itself, a closed stdout, a full /dev/shm, two jobs on the same files,
//! a rerun into a run directory with history. Every test starts real
//! processes and checks the files and processes they leave.

use std::path::Path;
use std::time::Duration;

use e2e::{
    alive, assert_gone, children_of, ckpt_job, losses, losses_by_step, metrics, small_job,
    start_long_job, wait_until, zrun, TrainArgs,
};
use nix::sys::signal::Signal;

/// How many lines of a metrics file are `{"event": EVENT}` lines.
fn events(path: &Path, event: &str) -> usize {
    metrics(path).iter().filter(|l| l["event"] == event).count()
}

/// A closed terminal (SIGHUP) or a polite kill (SIGTERM) tears the job down
/// like Ctrl-C.
#[test]
fn sigterm_and_sighup_stop_everything_like_ctrl_c() {
    for (sig, says) in [(Signal::SIGTERM, "SIGTERM"), (Signal::SIGHUP, "SIGHUP")] {
        let dir = tempfile::tempdir().unwrap();
        let (z, m) = start_long_job(dir.path(), "signalled", &[]);
        let workers = children_of(z.pid());
        assert_eq!(workers.len(), 2);
        z.signal(sig);
        let f = z.wait(Duration::from_secs(20));
        assert_eq!(f.code(), 130, "{says}: {f:?}");
        assert!(f.stderr.contains(says), "{}", f.stderr);
        // The metrics end with a whole line: nothing half-written.
        let text = std::fs::read_to_string(&m).unwrap();
        assert!(text.ends_with('\n'), "{says}: the metrics end mid-line");
        for w in workers {
            assert!(!alive(w), "{says}: worker {w} is still running");
        }
    }
}

/// zrun killed outright (no teardown possible): its workers notice the lost
/// control connection (or the kernel's parent-death signal, before they have
/// one) and exit within seconds, not at `comm.timeout_s`. Once while training,
/// once as soon as the workers exist.
#[test]
fn a_killed_zrun_leaves_no_worker_behind() {
    for during_startup in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let z = if during_startup {
            let job = small_job(dir.path(), "startup", 100_000);
            let z = TrainArgs::new(&job, dir.path().join("m.jsonl")).start(dir.path());
            assert!(wait_until(Duration::from_secs(20), || children_of(z.pid())
                .len()
                == 2));
            z
        } else {
            start_long_job(dir.path(), "killed", &[]).0
        };
        let workers = children_of(z.pid());
        assert_eq!(workers.len(), 2);
        z.signal(Signal::SIGKILL);
        let _ = z.wait(Duration::from_secs(10));
        assert_gone(&workers, Duration::from_secs(10), "after zrun was killed");
    }
}

/// A `--worker-bin` that runs zworker as its child instead of replacing
/// itself, as `perf record` and `strace -f` do: the job trains as it does
/// with zworker itself (the same losses), and when zrun is killed the
/// workers under the wrappers still go.
#[test]
fn a_wrapped_worker_trains_and_still_dies_with_zrun() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let wrapper = dir.path().join("wrapped-zworker.sh");
    // The command after zworker keeps the shell from exec-ing it.
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\n'{}' \"$@\"\nstatus=$?\nexit $status\n",
            e2e::bin("zworker").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let wrapped = ["--worker-bin", wrapper.to_str().unwrap()];

    let job = small_job(dir.path(), "wrapped", 4);
    let direct = dir.path().join("direct.jsonl");
    let f = TrainArgs::new(&job, &direct).run(dir.path());
    assert_eq!(f.code(), 0, "{f:?}");
    let through = dir.path().join("through.jsonl");
    let f = TrainArgs::new(&job, &through)
        .args(&wrapped)
        .run(dir.path());
    assert_eq!(f.code(), 0, "through the wrapper: {f:?}");
    let losses_direct = losses(&metrics(&direct));
    assert_eq!(losses_direct.len(), 4);
    assert_eq!(losses(&metrics(&through)), losses_direct);

    let (z, _) = start_long_job(dir.path(), "wrapped-killed", &wrapped);
    let wrappers = children_of(z.pid());
    let workers = e2e::descendants_named(z.pid(), "zworker");
    assert_eq!((wrappers.len(), workers.len()), (2, 2));
    assert!(wrappers.iter().all(|w| !workers.contains(w)));
    z.signal(Signal::SIGKILL);
    let _ = z.wait(Duration::from_secs(10));
    assert_gone(
        &workers,
        Duration::from_secs(10),
        "under wrappers, after zrun was killed",
    );
    assert_gone(
        &wrappers,
        Duration::from_secs(5),
        "the wrappers, after their workers",
    );
}

/// `zrun train … | head -n 1`: the reader goes away after one line; zrun must
/// neither panic nor stop training (its record is metrics.jsonl).
#[test]
fn a_closed_stdout_does_not_stop_the_job() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "piped", 30);
    let m = dir.path().join("m.jsonl");
    let args = TrainArgs::new(&job, &m);
    let mut child = std::process::Command::new(e2e::bin("zrun"))
        .args(args.as_strs())
        .current_dir(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("zrun: job piped"), "{first}");
    // The pipe's read end is closed now; every later line is a failed write.
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let lines = metrics(&m);
    assert_eq!(losses(&lines).len(), 30);
    assert_eq!(lines.last().unwrap()["event"], "done");
}

/// A `/dev/shm` too small for the node's segment is a clear error naming it and
/// the way out, not a SIGBUS in a worker. Needs a private mount namespace
/// (root and `unshare`); skipped with the reason otherwise.
#[test]
fn a_full_dev_shm_is_a_clear_error() {
    let probe = std::process::Command::new("unshare")
        .args(["-m", "sh", "-c", "mount -t tmpfs -o size=64k none /dev/shm"])
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        eprintln!("a_full_dev_shm_is_a_clear_error: skipped: cannot mount a small /dev/shm in a private mount namespace (needs root and unshare)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "shmfull", 3);
    let args = TrainArgs::new(&job, dir.path().join("m.jsonl"));
    // zrun (and so its workers) in a mount namespace with a 64 KiB /dev/shm.
    let in_small_shm = |args: &TrainArgs| {
        std::process::Command::new("unshare")
            .args(["-m", "sh", "-c"])
            .arg("mount -t tmpfs -o size=64k none /dev/shm && exec \"$0\" \"$@\"")
            .arg(e2e::bin("zrun"))
            .args(args.as_strs())
            .current_dir(dir.path())
            .output()
            .unwrap()
    };
    let out = in_small_shm(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("/dev/shm has no room") && err.contains("comm.backend: tcp"),
        "{err}"
    );
    // The same job over TCP only needs no segment.
    let out = in_small_shm(&args.set("comm.backend=tcp"));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two fresh runs into one run_dir: the first run's metrics are kept as
/// metrics.1.jsonl, not truncated; `--overwrite` replaces them on purpose.
#[test]
fn a_rerun_keeps_the_earlier_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "again", 3);
    let m = dir.path().join("runs/again/metrics.jsonl");
    let run = |extra: &[&str]| {
        let f = zrun(
            dir.path(),
            &[&["train", job.to_str().unwrap(), "--no-progress"], extra].concat(),
        );
        assert_eq!(f.code(), 0, "{f:?}");
    };
    run(&[]);
    let first = std::fs::read_to_string(&m).unwrap();
    run(&[]);
    let kept = dir.path().join("runs/again/metrics.1.jsonl");
    assert_eq!(std::fs::read_to_string(&kept).unwrap(), first);
    assert_eq!(losses(&metrics(&m)).len(), 3);
    run(&["--overwrite"]);
    assert!(!dir.path().join("runs/again/metrics.2.jsonl").exists());
    assert_eq!(losses(&metrics(&m)).len(), 3);
    // No lock is left behind.
    assert!(!dir.path().join("runs/again/metrics.jsonl.lock").exists());
}

/// A run that fails before its first step (its control port is taken: exit 3)
/// leaves the run directory as it was.
#[test]
fn a_run_that_fails_to_start_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "blocked", 3);
    let m = dir.path().join("m.jsonl");
    std::fs::write(&m, "{\"step\": 1}\n").unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let f = TrainArgs::new(&job, &m)
        .args(&["--master-addr", "127.0.0.1", "--master-port", &port])
        .run(dir.path());
    assert_eq!(f.code(), 3, "{f:?}");
    assert_eq!(std::fs::read_to_string(&m).unwrap(), "{\"step\": 1}\n");
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names
            .iter()
            .any(|n| n.starts_with("m.1") || n.ends_with(".lock")),
        "{names:?}"
    );
}

/// A job whose workers cannot fit in this host's memory and swap is refused
/// before anything starts, by `zrun check` and `zrun train` alike: exit 2,
/// what it needs against what the host has and what holds less, no metrics
/// file. (A `device: cuda` job keeps its activations on its GPU, and the
/// host's check leaves them out: tests/gpu.rs runs such a job.)
#[test]
fn a_job_larger_than_the_hosts_memory_is_refused_before_launch() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "huge", 2);
    // 65536 sequences of 4096 tokens a micro-batch: terabytes of
    // activations a worker, more than any host this runs on.
    let huge = ["model.seq_len=4096", "train.micro_batch_size=65536"];
    let m = dir.path().join("huge.jsonl");
    let mut check = vec!["check", job.to_str().unwrap()];
    for set in huge {
        check.extend(["--set", set]);
    }
    let train = huge
        .iter()
        .fold(TrainArgs::new(&job, &m), |args, set| args.set(*set));
    for f in [zrun(dir.path(), &check), train.run(dir.path())] {
        assert_eq!(f.code(), 2, "{f:?}");
        assert!(
            f.stderr.contains("workers are estimated to need ")
                && f.stderr
                    .contains("(ZeRO stage 0 model states + activations), more than this host's ")
                && f.stderr.contains("lower train.micro_batch_size"),
            "{}",
            f.stderr
        );
    }
    assert!(!m.exists(), "a refused job wrote its metrics");
}

/// A second job that would write a live job's metrics or checkpoints is
/// refused up front (exit 2); the first job finishes untouched. A lock left by
/// a dead zrun is taken over.
#[test]
fn a_live_jobs_files_are_refused_to_a_second_job() {
    let dir = tempfile::tempdir().unwrap();
    let (first, m) = start_long_job(dir.path(), "live", &[]);
    let job = small_job(dir.path(), "second", 3);
    let f = TrainArgs::new(&job, &m).run(dir.path());
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("in use by a running job"), "{}", f.stderr);
    // The same checkpoint directory, other metrics.
    let a = ckpt_job(dir.path(), "ck_a", 100_000, 0);
    let b = ckpt_job(dir.path(), "ck_b", 3, 0);
    let ma = dir.path().join("a.jsonl");
    let holder = TrainArgs::new(&a, &ma).start(dir.path());
    assert!(wait_until(Duration::from_secs(60), || !metrics(&ma).is_empty()));
    let f = TrainArgs::new(&b, dir.path().join("b.jsonl")).run(dir.path());
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("checkpoint.dir: in use by a running job"),
        "{}",
        f.stderr
    );
    for z in [first, holder] {
        z.signal(Signal::SIGINT);
        assert_eq!(z.wait(Duration::from_secs(20)).code(), 130);
    }
    // A dead zrun's lock (pid of no process) does not block anyone.
    std::fs::write(dir.path().join("stale.jsonl.lock"), "999999999\n").unwrap();
    let f = TrainArgs::new(&job, dir.path().join("stale.jsonl")).run(dir.path());
    assert_eq!(f.code(), 0, "{f:?}");
}

/// A resumed run appends to the metrics after a line naming its checkpoint; a
/// checkpoint already past `train.steps` is "nothing to do" and touches nothing.
#[test]
fn a_resume_appends_and_a_resume_past_the_end_does_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let job = ckpt_job(dir.path(), "appended", 4, 2);
    let m = dir.path().join("m.jsonl");
    assert_eq!(TrainArgs::new(&job, &m).run(dir.path()).code(), 0);
    let f = TrainArgs::new(&job, &m)
        .args(&["--resume", "auto"])
        .set("train.steps=6")
        .run(dir.path());
    assert_eq!(f.code(), 0, "{f:?}");
    let lines = metrics(&m);
    assert_eq!(losses(&lines).len(), 6, "4 steps, then 2 more");
    let marker = lines
        .iter()
        .find(|l| l["event"] == "resume")
        .expect("a resume line");
    assert_eq!(marker["step"], 4);
    assert!(
        marker["from"].as_str().unwrap().ends_with("step-00000004"),
        "{marker}"
    );
    assert_eq!(events(&m, "done"), 2);
    let before = std::fs::read_to_string(&m).unwrap();
    let f = TrainArgs::new(&job, &m)
        .args(&["--resume", "auto"])
        .set("train.steps=3")
        .run(dir.path());
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(f.stdout.contains("nothing to do"), "{}", f.stdout);
    assert_eq!(std::fs::read_to_string(&m).unwrap(), before);
}

/// zrun stopped (Ctrl-Z) or the whole job suspended for longer than the
/// heartbeat period: on resume nobody is blamed, the job trains on.
#[test]
fn a_stopped_zrun_or_a_suspended_job_is_not_a_dead_worker() {
    for whole_job in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        // A 3 s heartbeat (not the minimum, 2 s): on a loaded 2-core CI
        // machine running this binary's tests side by side, a worker has
        // been seen silent for 2 s without anything being stopped.
        let (z, m) = start_long_job(dir.path(), "stopped", &["--set", "comm.heartbeat_s=3"]);
        let workers = children_of(z.pid());
        let mut stopped = vec![z.pid()];
        if whole_job {
            stopped.extend(&workers);
        }
        let send = |sig: Signal| {
            for &p in &stopped {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p as i32), sig);
            }
        };
        send(Signal::SIGSTOP);
        std::thread::sleep(Duration::from_secs(7));
        send(Signal::SIGCONT);
        let before = metrics(&m).len();
        assert!(
            wait_until(Duration::from_secs(20), || metrics(&m).len() > before + 5),
            "whole job {whole_job}: training did not go on: {}",
            z.stdout_so_far()
        );
        z.signal(Signal::SIGINT);
        let f = z.wait(Duration::from_secs(20));
        assert_eq!(f.code(), 130, "whole job {whole_job}: {f:?}");
    }
}

/// Runs `zrun ARGS` in `dir` with a tmpfs of `size` mounted at `at` in a
/// private mount namespace; then prints `rc=CODE`, `left:` and the
/// temporary files left under `at`, and `kept:` and what `keep` (a file
/// under `at`) holds, before the mount goes. `None` where mounting is
/// refused (the reason printed, naming `test`).
fn zrun_on_a_small_tmpfs(
    test: &str,
    dir: &Path,
    at: &Path,
    size: &str,
    keep: &Path,
    args: &TrainArgs,
) -> Option<(String, String)> {
    std::fs::create_dir_all(at).unwrap();
    let script = format!(
        "mount -t tmpfs -o size={size} none {at} || exit 99; \"$0\" \"$@\"; echo \"rc=$?\"; echo left:; find {at} -name '*.tmp'; echo kept:; cat {keep} 2>/dev/null; exit 0",
        at = at.display(),
        keep = keep.display(),
    );
    let out = std::process::Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .arg(e2e::bin("zrun"))
        .args(args.as_strs())
        .current_dir(dir)
        .output();
    let Some(out) = out
        .ok()
        .filter(|o| o.status.code() != Some(99) && o.status.success())
    else {
        eprintln!("{test}: skipped: cannot mount a small tmpfs in a private mount namespace (needs root and unshare)");
        return None;
    };
    Some((
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// A checkpoint directory on a full filesystem: the job fails naming the file
/// and the cause, and leaves no temporary file to fill the disk further. (A
/// 64 KiB tmpfs in a private mount namespace; skipped where that is refused.)
#[test]
fn a_full_disk_fails_the_save_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ckfull");
    let job = small_job(dir.path(), "full", 3);
    let mut text = std::fs::read_to_string(&job).unwrap();
    text.push_str(&format!("checkpoint: {{dir: {}}}\n", ck.display()));
    std::fs::write(&job, text).unwrap();
    let args = TrainArgs::new(&job, dir.path().join("m.jsonl"));
    let Some((stdout, stderr)) = zrun_on_a_small_tmpfs(
        "a_full_disk_fails_the_save_cleanly",
        dir.path(),
        &ck,
        "64k",
        &ck.join("none"),
        &args,
    ) else {
        return;
    };
    assert!(stdout.contains("rc=1"), "{stdout}\n{stderr}");
    assert!(stderr.contains(".tmp: No space left on device"), "{stderr}");
    let left = stdout.split("left:").nth(1).unwrap_or_default();
    let left = left.split("kept:").next().unwrap_or_default();
    assert!(left.trim().is_empty(), "temporary files left: {left}");
}

/// Metrics on a filesystem that fills: the job fails naming the file and the
/// cause, and the file keeps every line written before, each whole (a line
/// cut short by the full disk is cut back off: the file read as JSONL
/// before the sixty-ninth session, it ended in half a line).
#[test]
fn a_full_disk_under_the_metrics_keeps_whole_lines() {
    let dir = tempfile::tempdir().unwrap();
    let at = dir.path().join("mfull");
    let m = at.join("m.jsonl");
    let job = small_job(dir.path(), "full", 400);
    let Some((stdout, stderr)) = zrun_on_a_small_tmpfs(
        "a_full_disk_under_the_metrics_keeps_whole_lines",
        dir.path(),
        &at,
        "16k",
        &m,
        &TrainArgs::new(&job, &m),
    ) else {
        return;
    };
    assert!(stdout.contains("rc=1"), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("m.jsonl (the lines before this one are kept): No space left on device"),
        "{stderr}"
    );
    let kept = stdout.split("kept:\n").nth(1).unwrap_or_default();
    assert!(kept.ends_with('\n'), "{kept}");
    let steps: Vec<u64> = kept
        .lines()
        .map(|l| {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            v["step"].as_u64().unwrap()
        })
        .collect();
    assert!(steps.len() > 5, "{kept}");
    assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<_>>());
}

/// A preemption notice (SIGUSR1, what Slurm's `--signal=B:USR1@90` sends),
/// to zrun or to one worker only: the job ends after the step in progress
/// with a checkpoint of it (exit 75 and a `stopped` line naming it), and
/// `--resume auto` goes on to the uninterrupted run's losses, to the bit.
/// Without a checkpoint directory the job goes on to its end.
#[test]
fn sigusr1_stops_after_a_step_with_its_checkpoint_and_the_resume_matches() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 3000;
    let reference = dir.path().join("whole.jsonl");
    let whole = small_job(dir.path(), "whole", steps);
    assert_eq!(TrainArgs::new(&whole, &reference).run(dir.path()).code(), 0);
    let want = losses_by_step(&reference);
    assert_eq!(want.len(), steps as usize);
    let started = |m: &Path| wait_until(Duration::from_secs(60), || metrics(m).len() >= 20);
    for to_a_worker in [false, true] {
        let sub = dir.path().join(format!("to-a-worker-{to_a_worker}"));
        std::fs::create_dir_all(&sub).unwrap();
        let job = ckpt_job(&sub, "preempted", steps, 100_000);
        let m = sub.join("m.jsonl");
        let z = TrainArgs::new(&job, &m).start(&sub);
        assert!(started(&m), "{}", z.stdout_so_far());
        if to_a_worker {
            let workers = children_of(z.pid());
            assert_eq!(workers.len(), 2);
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(workers[1] as i32),
                Signal::SIGUSR1,
            )
            .unwrap();
        } else {
            z.signal(Signal::SIGUSR1);
        }
        let f = z.wait(Duration::from_secs(60));
        assert_eq!(f.code(), 75, "to a worker: {to_a_worker}: {f:?}");
        let last = metrics(&m).pop().unwrap();
        assert_eq!(last["event"], "stopped", "{last}");
        let step = last["step"].as_u64().unwrap();
        assert!((20..steps).contains(&step), "stopped after step {step}");
        let saved = format!("step-{step:08}");
        assert!(
            last["checkpoint"].as_str().unwrap().ends_with(&saved),
            "{last}"
        );
        assert!(sub.join("ckpt").join(&saved).is_dir());
        assert!(f.stdout.contains("--resume auto"), "{}", f.stdout);
        let f = TrainArgs::new(&job, &m)
            .args(&["--resume", "auto"])
            .run(&sub);
        assert_eq!(f.code(), 0, "{f:?}");
        assert!(
            losses_by_step(&m) == want,
            "to a worker: {to_a_worker}: stopped at {step} and resumed, the losses differ"
        );
    }
    // No checkpoint directory: nothing to save into, so the job goes on.
    let m = dir.path().join("on.jsonl");
    let z = TrainArgs::new(&whole, &m).start(dir.path());
    assert!(started(&m), "{}", z.stdout_so_far());
    z.signal(Signal::SIGUSR1);
    let f = z.wait(Duration::from_secs(60));
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(f.stdout.contains("SIGUSR1 ignored"), "{}", f.stdout);
    assert_eq!(losses_by_step(&m), want);
}

/// The commands that run zrun's own children (a sweep's `zrun train`, and
/// its workers under it; `zrun sample`'s `zworker sample`) take them down
/// when they end: SIGTERM stops a sweep with exit 130 and stops the job it
/// was running (a sweep ignored SIGTERM once it had measured the GEMM peak,
/// until the seventieth session), and a SIGKILLed sweep or a terminated
/// sample leaves nothing running (they were orphaned, and ran to their end).
#[test]
fn sweeps_and_samples_take_their_children_with_them() {
    for sig in [Signal::SIGTERM, Signal::SIGKILL] {
        let dir = tempfile::tempdir().unwrap();
        let job = small_job(dir.path(), "swept", 100_000);
        let out = dir.path().join("out");
        let z = e2e::Zrun::start(
            dir.path(),
            &[
                "bench",
                job.to_str().unwrap(),
                "--sweep",
                "zero.stage=0,1",
                "--steps",
                "100000",
                "--out",
                out.to_str().unwrap(),
            ],
        );
        // The first configuration is training: zrun train and its workers.
        let mut tree = Vec::new();
        assert!(
            wait_until(Duration::from_secs(60), || {
                tree = children_of(z.pid());
                tree.extend(
                    tree.iter()
                        .flat_map(|&c| children_of(c))
                        .collect::<Vec<_>>(),
                );
                tree.len() == 3 && metrics(&out.join("run-0.jsonl")).len() >= 2
            }),
            "{sig:?}: the sweep's first job did not start: {:?}",
            tree
        );
        z.signal(sig);
        let f = z.wait(Duration::from_secs(40));
        if sig == Signal::SIGTERM {
            assert_eq!(f.code(), 130, "{f:?}");
            assert!(
                f.stderr
                    .contains("terminated (SIGTERM): configuration stage=0 stopped"),
                "{}",
                f.stderr
            );
        }
        assert_gone(
            &tree,
            Duration::from_secs(20),
            &format!("after {sig:?} to the sweep"),
        );
    }
    // A byte-level model (zrun sample encodes a prompt as bytes without a
    // tokenizer), checkpointed.
    let dir = tempfile::tempdir().unwrap();
    let job = ckpt_job(dir.path(), "sampled", 4, 4);
    let text = std::fs::read_to_string(&job).unwrap();
    std::fs::write(&job, text.replace("vocab_size: 64", "vocab_size: 256")).unwrap();
    let f = TrainArgs::new(&job, dir.path().join("m.jsonl")).run(dir.path());
    assert_eq!(f.code(), 0, "{f:?}");
    let ckpt = dir.path().join("ckpt");
    let z = e2e::Zrun::start(
        dir.path(),
        &[
            "sample",
            ckpt.to_str().unwrap(),
            "--prompt",
            "a",
            "--tokens",
            "100000000",
        ],
    );
    let mut sampler = Vec::new();
    assert!(wait_until(Duration::from_secs(30), || {
        sampler = children_of(z.pid());
        sampler.len() == 1
    }));
    z.signal(Signal::SIGTERM);
    let _ = z.wait(Duration::from_secs(10));
    assert_gone(
        &sampler,
        Duration::from_secs(10),
        "after SIGTERM to zrun sample",
    );
}
