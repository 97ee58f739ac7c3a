//! `zrun plan` end to end: the machine is measured once and cached (a
//! 16-bit job's own rates too, the first time one is planned), the
//! configurations that fit are ranked, the best is written as a job file that
//! `zrun train` runs as it is (and kept from a second `--out` unless
//! `--overwrite`), and a memory budget nothing fits, or a GPU job, is exit 2.

use std::time::Duration;

use e2e::{small_job, zrun, Zrun};

#[test]
fn plan_writes_a_job_that_trains_and_refuses_an_impossible_budget() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let job = small_job(dir, "planned", 5);
    let cache = dir.join("cache");
    let best = dir.join("best.yaml");
    let env = [("ZRUN_CACHE_DIR", cache.to_str().unwrap())];
    let plan = |extra: &[&str]| {
        Zrun::start_with_env(
            dir,
            &[&["plan", job.to_str().unwrap()][..], extra].concat(),
            &env,
        )
        .wait(Duration::from_secs(300))
    };
    let f = plan(&["--out", best.to_str().unwrap()]);
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(f.stdout.contains("measuring this machine"), "{}", f.stdout);
    assert!(f.stdout.contains("configurations fit"), "{}", f.stdout);
    // Stages 0-3 × micro-batches 1, 2, 4 (global batch 8 on 2 workers) ×
    // checkpointing on and off, all of which fit a small model.
    assert!(f.stdout.contains("24 configurations fit"), "{}", f.stdout);
    let cached: Vec<_> = std::fs::read_dir(&cache).unwrap().collect();
    assert_eq!(
        cached.len(),
        1,
        "one figures file per host and worker count"
    );

    let again = plan(&[]);
    assert_eq!(again.code(), 0, "{again:?}");
    assert!(
        again.stdout.contains("machine figures from"),
        "{}",
        again.stdout
    );

    // A bf16 job: its own rates are fitted from two bf16 steps the first
    // time, kept in the same figures file, and read from it after.
    let bf16 = plan(&["--set", "train.dtype=bf16"]);
    assert_eq!(bf16.code(), 0, "{bf16:?}");
    assert!(
        bf16.stdout.contains("measuring bf16 steps")
            && bf16.stdout.contains("bf16 steps: products"),
        "{}",
        bf16.stdout
    );
    let again = plan(&["--set", "train.dtype=bf16"]);
    assert!(
        !again.stdout.contains("measuring") && again.stdout.contains("bf16 steps: products"),
        "{}",
        again.stdout
    );

    let text = std::fs::read_to_string(&best).unwrap();
    assert!(text.starts_with("# Written by `zrun plan"), "{text}");
    let f = zrun(
        dir,
        &[
            "train",
            best.to_str().unwrap(),
            "--metrics",
            dir.join("best.jsonl").to_str().unwrap(),
            "--no-progress",
        ],
    );
    assert_eq!(f.code(), 0, "the written job trains as it is: {f:?}");

    // The written job is the user's now (maybe edited): a second --out to
    // it is refused before anything is measured, and --overwrite replaces it.
    std::fs::write(&best, format!("{text}# edited\n")).unwrap();
    let f = plan(&["--out", best.to_str().unwrap()]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("--overwrite"), "{}", f.stderr);
    assert!(!f.stdout.contains("configurations fit"), "{}", f.stdout);
    assert!(std::fs::read_to_string(&best)
        .unwrap()
        .ends_with("# edited\n"));
    let f = plan(&["--out", best.to_str().unwrap(), "--overwrite"]);
    assert_eq!(f.code(), 0, "{f:?}");
    let replaced = std::fs::read_to_string(&best).unwrap();
    assert!(
        replaced.starts_with("# Written by `zrun plan") && !replaced.contains("# edited"),
        "{replaced}"
    );

    // A GPU job: its rates are not measured, so no plan (nothing measured).
    let f = plan(&["--set", "device=cuda"]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("device: cuda: zrun plan prices CPU workers")
            && !f.stdout.contains("measuring"),
        "{f:?}"
    );

    let f = plan(&["--memory-gib", "0.00001"]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("no configuration of this job fits"),
        "{}",
        f.stderr
    );
}
