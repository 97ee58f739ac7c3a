//! `device: cuda` as a user runs it.
//!
//! Without a GPU (every CI machine): zrun refuses the job before launch (exit
//! 2), naming what this host lacks, from the worker's `--cuda-devices`: "built
//! without the `cuda` feature" for the default build, the missing driver for
//! `--features zworker/cuda` (CI builds that zworker and sets
//! `ZRUN_REQUIRE_CUDA_BUILD=1`, which makes the second case mandatory); and a
//! job the GPU model cannot run (bf16, LLaMA, tiles) is refused for that.
//!
//! With a GPU (skipped without one, saying so; `ZRUN_REQUIRE_GPU=1` makes
//! them mandatory): training on the GPU follows the CPU run's loss curve
//! within f32 rounding, and ZeRO's stages 0-3 (two workers sharing the GPU)
//! give the same losses to the bit, with activation checkpointing too.

use std::process::Command;

use e2e::{bin, losses, metrics, repo_root, small_job, zrun, TrainArgs};

fn worker_has_cuda() -> bool {
    let out = Command::new(bin("zworker"))
        .arg("--features")
        .output()
        .expect("running zworker --features");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .any(|f| f == "cuda")
}

/// The GPUs the built zworker trains on, or why none.
fn gpus() -> Result<usize, String> {
    let out = Command::new(bin("zworker"))
        .arg("--cuda-devices")
        .output()
        .expect("running zworker --cuda-devices");
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    match out.status.success() {
        true => Ok(text.parse().expect("a GPU count")),
        false => Err(text),
    }
}

fn gpus_or_skip(test: &str) -> Option<usize> {
    match gpus() {
        Ok(n) => Some(n),
        Err(why) => {
            assert!(
                std::env::var("ZRUN_REQUIRE_GPU").as_deref() != Ok("1"),
                "ZRUN_REQUIRE_GPU=1 but: {why}"
            );
            eprintln!("SKIPPED {test}: {why}");
            None
        }
    }
}

#[test]
fn device_cuda_without_a_gpu_is_refused_before_launch_naming_what_is_missing() {
    let Err(why) = gpus() else {
        eprintln!("SKIPPED device_cuda_without_a_gpu_is_refused: this host has a GPU");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "gpu", 2);
    let metrics = dir.path().join("m.jsonl");
    let f = TrainArgs::new(&job, &metrics)
        .set("device=cuda")
        .run(&repo_root());
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains(&format!("device: cuda: {why}")),
        "{}",
        f.stderr
    );
    assert!(!metrics.exists(), "a refused job wrote metrics");
    if worker_has_cuda() {
        // A host without a GPU (every CI machine): the missing driver is named.
        assert!(
            why.contains("no CUDA driver") || why.contains("sees no GPU"),
            "{why}"
        );
    } else {
        assert!(
            std::env::var("ZRUN_REQUIRE_CUDA_BUILD").as_deref() != Ok("1"),
            "ZRUN_REQUIRE_CUDA_BUILD=1 but zworker was built without the `cuda` feature"
        );
        assert!(why.contains("built without the `cuda` feature"), "{why}");
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

#[test]
fn device_cuda_refuses_what_the_gpu_model_does_not_run() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "gpu-limits", 2);
    for (set, says) in [
        ("train.dtype=bf16", "f32 only"),
        ("model.kind=llama", "GPT-2's family only"),
        ("model.tile_size=512", "drop model.tile_size"),
    ] {
        let f = zrun(
            &repo_root(),
            &[
                "check",
                job.to_str().unwrap(),
                "--set",
                "device=cuda",
                "--set",
                set,
            ],
        );
        assert_eq!(f.code(), 2, "{set}: {f:?}");
        assert!(f.stderr.contains(says), "{set}: {}", f.stderr);
    }
}

/// Trains the small job and returns every step's loss.
fn train(dir: &std::path::Path, name: &str, workers: usize, sets: &[String]) -> Vec<f64> {
    let job = small_job(dir, name, 20);
    let m = dir.join(format!("{name}.jsonl"));
    let w = workers.to_string();
    let mut args = TrainArgs::new(&job, &m).args(&["--workers-per-node", &w]);
    for s in sets {
        args = args.set(s.clone());
    }
    let f = args.run(&repo_root());
    assert_eq!(f.code(), 0, "{name}: {f:?}");
    let l = losses(&metrics(&m));
    assert_eq!(l.len(), 20, "{name}: steps");
    l
}

#[test]
fn training_on_the_gpu_follows_the_cpu_loss_curve() {
    if gpus_or_skip("training_on_the_gpu_follows_the_cpu_loss_curve").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cpu = train(dir.path(), "cpu", 1, &[]);
    let gpu = train(dir.path(), "cuda", 1, &["device=cuda".into()]);
    for (s, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        // f32 on both: the products and sums differ in order only.
        assert!(
            (g - c).abs() <= 1e-3 * c.abs(),
            "step {}: GPU loss {g}, CPU {c}",
            s + 1
        );
    }
    assert!(gpu[19] < gpu[0] - 0.1, "no learning on the GPU: {gpu:?}");
    eprintln!(
        "GPU against CPU, 20 steps: largest relative loss difference {:.2e}",
        gpu.iter()
            .zip(&cpu)
            .map(|(g, c)| (g - c).abs() / c.abs())
            .fold(0.0, f64::max)
    );
}

#[test]
fn zero_stages_on_the_gpu_are_bit_identical() {
    if gpus_or_skip("zero_stages_on_the_gpu_are_bit_identical").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = |stage: u8, extra: &[&str]| {
        let mut sets = vec!["device=cuda".to_string(), format!("zero.stage={stage}")];
        sets.extend(extra.iter().map(|s| s.to_string()));
        train(dir.path(), &format!("s{stage}{}", extra.len()), 2, &sets)
    };
    let stage0 = run(0, &[]);
    for stage in 1..=3 {
        assert_eq!(run(stage, &[]), stage0, "stage {stage} against stage 0");
    }
    let checkpointed = run(3, &["train.activation_checkpointing=true"]);
    assert_eq!(
        checkpointed, stage0,
        "stage 3 with activation checkpointing"
    );
}
