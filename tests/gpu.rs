//! `device: cuda` before launch: training on GPUs is not built yet, so zrun
//! refuses the job (exit 2) and says what this host has, from the worker's
//! `--cuda-probe`. With the default build that is "built without the `cuda`
//! feature"; with `--features zworker/cuda` on a host without a GPU it is the
//! missing driver (CI builds that zworker and sets `ZRUN_REQUIRE_CUDA_BUILD=1`,
//! which makes the second case mandatory). Nothing is launched, no run
//! directory is written.

use std::process::Command;

use e2e::{bin, repo_root, zrun, TrainArgs};

fn worker_has_cuda() -> bool {
    let out = Command::new(bin("zworker"))
        .arg("--features")
        .output()
        .expect("running zworker --features");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .any(|f| f == "cuda")
}

#[test]
fn device_cuda_is_refused_before_launch_naming_what_the_host_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let job = e2e::small_job(dir.path(), "gpu", 2);
    let metrics = dir.path().join("m.jsonl");
    let f = TrainArgs::new(&job, &metrics)
        .set("device=cuda")
        .run(&repo_root());
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("device: cuda: training on GPUs is not in zrun yet"),
        "{}",
        f.stderr
    );
    assert!(!metrics.exists(), "a refused job wrote metrics");
    let cuda = worker_has_cuda();
    if cuda {
        // A host without a GPU (every CI machine): the missing driver is named.
        let probe = Command::new(bin("zworker"))
            .arg("--cuda-probe")
            .output()
            .unwrap();
        let report = String::from_utf8_lossy(&probe.stdout).trim().to_string();
        assert!(
            report.starts_with("zworker has the `cuda` feature; "),
            "{report}"
        );
        assert!(
            f.stderr.contains(&format!("on this host: {report}")),
            "{}",
            f.stderr
        );
        if !report.contains("GPU(s)") {
            assert!(
                report.contains("no CUDA driver") || report.contains("sees no GPU"),
                "{report}"
            );
        }
    } else {
        assert!(
            std::env::var("ZRUN_REQUIRE_CUDA_BUILD").as_deref() != Ok("1"),
            "ZRUN_REQUIRE_CUDA_BUILD=1 but zworker was built without the `cuda` feature"
        );
        assert!(
            f.stderr
                .contains("on this host: zworker was built without the `cuda` feature"),
            "{}",
            f.stderr
        );
        eprintln!("(zworker without the `cuda` feature: the feature-enabled refusal is CI's, under ZRUN_REQUIRE_CUDA_BUILD=1)");
    }
    // `zrun check` refuses it the same way.
    let f = zrun(
        &repo_root(),
        &["check", job.to_str().unwrap(), "--set", "device=cuda"],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("device: cuda"), "{}", f.stderr);
}
