//! `device: cuda` as a user runs it.
//!
//! Without a GPU (every CI machine): zrun refuses the job before launch (exit
//! 2), naming what this host lacks, from the worker's `--cuda-devices`: "built
//! without the `cuda` feature" for the default build, the missing driver for
//! `--features zworker/cuda` (CI builds that zworker and sets
//! `ZRUN_REQUIRE_CUDA_BUILD=1`, which makes the second case mandatory); and a
//! job the GPU model cannot run (tiles) is refused for that.
//!
//! With a GPU (skipped without one, saying so; `ZRUN_REQUIRE_GPU=1` makes
//! them mandatory): training on the GPU follows the CPU run's loss curve
//! within f32 rounding, a LLaMA too (grouped-query attention, tied and
//! untied heads, its stages 0 and 3 and stage 3 over NCCL to the bit), and
//! so does a bf16 or f16 run (16-bit working parameters and gradients) the
//! CPU's run of the same dtype, its stages 0 and 3 to the bit;
//! ZeRO's stages 0-3 (two workers sharing the GPU)
//! give the same losses to the bit, with activation checkpointing too; Adam
//! on the GPU (one worker's resident flow) gives ZeRO-Offload's bits (Adam on
//! the host), with gradient accumulation and clipping, in f32, bf16 and f16;
//! a resumed GPU run continues the uninterrupted one to the bit (f32, bf16); and two workers reducing
//! their gradients over NCCL (resident, stages 0-3; f32, bf16 and f16) give
//! the bits and the bytes of the host flow's reductions, and a resumed
//! stage-3 NCCL run continues the uninterrupted one to the bit (f32, bf16). With the fused attention
//! (`ZRUN_GPU_ATTENTION=fused`) a bf16, f16 or TF32 run follows the unfused run
//! within that rounding, and the default (`auto`) runs it, to the bit. `comm.backend: nccl` where it cannot run is refused
//! before launch, GPU or not. `ZRUN_GPU_PROFILE=1` prints a table whose rows
//! add up to its totals, each row's GPU idle time within its own time.

use std::collections::HashMap;
use std::process::Command;

use std::path::Path;

use e2e::{
    bin, ckpt_job, export_ckpt, losses, losses_by_step, metrics, repo_root, small_job, zrun,
    TrainArgs, Zrun,
};

fn worker_has_cuda() -> bool {
    let out = Command::new(bin("zworker"))
        .arg("--features")
        .output()
        .expect("running zworker --features");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .any(|f| f == "cuda")
}

/// The GPUs the built zworker trains on, or why none (its answer: the
/// count, then the smallest GPU's bytes).
fn gpus() -> Result<usize, String> {
    let out = Command::new(bin("zworker"))
        .arg("--cuda-devices")
        .output()
        .expect("running zworker --cuda-devices");
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    match out.status.success() {
        true => Ok(first_word(&text).parse().expect("a GPU count")),
        false => Err(text),
    }
}

fn first_word(text: &str) -> &str {
    text.split(' ').next().unwrap_or_default()
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
    // And so does the NCCL benchmark, before any worker starts.
    let f = zrun(dir.path(), &["bench", "comm", "--transports", "nccl"]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains(&format!("--transports nccl: {why}")),
        "{}",
        f.stderr
    );
}

/// A GPU out of memory mid-job: exit 1, and the failure names the
/// allocation, the GPU's memory and what `zrun estimate` says the job holds,
/// with the settings that hold less. Made to happen on zcuda-emu's CPU GPU,
/// whose memory `ZCUDA_EMU_MEMORY_MIB` caps; a real GPU ignores the
/// variable (the job then trains), so there the job is made larger than
/// any GPU: 512 sequences of 4096 tokens, whose unfused attention keeps
/// 128 GiB of f32 probabilities a block (heads of 8 columns, which the
/// fused kernels do not take), two blocks.
#[test]
fn a_gpu_out_of_memory_is_exit_1_naming_the_allocation_and_what_holds_less() {
    let test = "a_gpu_out_of_memory_is_exit_1";
    if gpus_or_skip(test).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "oom", 2);
    let args = TrainArgs::new(&job, dir.path().join("oom.jsonl")).set("device=cuda");
    let capped = [("ZCUDA_EMU_MEMORY_MIB", "1")];
    let f = Zrun::start_with_env(&repo_root(), &args.as_strs(), &capped)
        .wait(std::time::Duration::from_secs(300));
    // The larger job's activations are the GPU's: the host's memory check,
    // which refuses the same job on the CPU, lets it launch.
    let larger = ["model.seq_len=4096", "train.micro_batch_size=512"];
    let job = job.to_str().unwrap();
    let mut check = vec!["check", job, "--set", "device=cuda"];
    for set in larger {
        check.extend(["--set", set]);
    }
    let checked = zrun(&repo_root(), &check);
    assert_eq!(checked.code(), 0, "{checked:?}");
    // It is warned of, as a job larger than its GPUs.
    let warned = "on its GPU, more than the smallest GPU's ";
    assert!(checked.stderr.contains(warned), "{}", checked.stderr);
    let (micro_batch, f) = match f.code() {
        0 => {
            eprintln!("{test}: a real GPU (the cap is zcuda-emu's): a job larger than the GPU");
            let larger = larger.iter().fold(args, |args, set| args.set(*set));
            let f = larger
                .start(&repo_root())
                .wait(std::time::Duration::from_secs(300));
            eprintln!("{test}: the larger job: {f:?}");
            (512, f)
        }
        _ => (4, f),
    };
    assert_eq!(f.code(), 1, "{f:?}");
    let said = |text: &str| f.stderr.contains(text);
    assert!(
        said("failed: out of GPU memory: a worker of this job is estimated to hold ")
            && said(&format!(
                " of activations at train.micro_batch_size {micro_batch} (`zrun estimate`)"
            ))
            && said("zero.stage: 3, train.activation_checkpointing: true")
            && said("on the GPU: the GPU is out of memory (")
            && said(" MiB free of "),
        "{}",
        f.stderr
    );
    assert!(said(warned), "warned of before launch: {}", f.stderr);
    if micro_batch == 4 {
        assert!(said(" free of 1 MiB)"), "{}", f.stderr);
        assert!(said("more than the smallest GPU's 1 MiB;"), "{}", f.stderr);
    }
}

#[test]
fn device_cuda_refuses_what_the_gpu_model_does_not_run() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "gpu-limits", 2);
    let (job, cuda, tiles) = (job.to_str().unwrap(), "device=cuda", "model.tile_size=512");
    let f = zrun(&repo_root(), &["check", job, "--set", cuda, "--set", tiles]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("drop model.tile_size"), "{}", f.stderr);
}

#[test]
fn nccl_and_tf32_are_refused_where_they_cannot_run() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "nccl-limits", 2);
    for (sets, says) in [
        (
            &["train.allow_tf32=true"][..],
            "train.allow_tf32: needs device: cuda",
        ),
        (
            &["comm.backend=nccl"][..],
            "comm.backend: nccl needs device: cuda",
        ),
        (
            &[
                "comm.backend=nccl",
                "device=cuda",
                "zero.stage=1",
                "zero.offload_optimizer.device=cpu",
            ],
            "offload moves it to the host",
        ),
        (
            &[
                "comm.backend=nccl",
                "device=cuda",
                "zero.stage=3",
                "zero.zero_quantized_weights=true",
            ],
            "use comm.backend: auto with ZeRO++",
        ),
    ] {
        let mut args = vec!["check", job.to_str().unwrap()];
        for s in sets {
            args.extend(["--set", s]);
        }
        let f = zrun(&repo_root(), &args);
        assert_eq!(f.code(), 2, "{sets:?}: {f:?}");
        assert!(f.stderr.contains(says), "{sets:?}: {}", f.stderr);
    }
}

/// Runs `job` with `workers` workers and the `sets`; its metrics file. The
/// attention is the unfused one (`ZRUN_GPU_ATTENTION=unfused`), which the
/// CPU-comparison bounds below are set for; the fused kernels, which jobs
/// with tensor-core products run by default, have their own test.
fn run(
    job: &Path,
    name: &str,
    workers: usize,
    sets: &[String],
    more: &[&str],
) -> std::path::PathBuf {
    let m = job.with_file_name(format!("{name}.jsonl"));
    let w = workers.to_string();
    let mut args = TrainArgs::new(job, &m)
        .args(&["--workers-per-node", &w])
        .args(more);
    for s in sets {
        args = args.set(s.clone());
    }
    let f = Zrun::start_with_env(
        &repo_root(),
        &args.as_strs(),
        &[("ZRUN_GPU_ATTENTION", "unfused")],
    )
    .wait(std::time::Duration::from_secs(300));
    assert_eq!(f.code(), 0, "{name}: {f:?}");
    m
}

/// The largest relative difference of `a`'s losses from `b`'s.
fn worst_relative(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs())
        .fold(0.0, f64::max)
}

/// The step lines of a metrics file.
fn step_lines(m: &Path) -> Vec<serde_json::Value> {
    let mut lines = metrics(m);
    lines.retain(|l| l.get("loss").is_some());
    lines
}

/// A step line's (loss, gradient norm).
fn loss_and_norm(l: &serde_json::Value) -> (f64, f64) {
    (
        l["loss"].as_f64().unwrap(),
        l["grad_norm"].as_f64().unwrap(),
    )
}

/// Trains the small job and returns every step's loss.
fn train(dir: &Path, name: &str, workers: usize, sets: &[String]) -> Vec<f64> {
    let job = small_job(dir, name, 20);
    let l = losses(&metrics(&run(&job, name, workers, sets, &[])));
    assert_eq!(l.len(), 20, "{name}: steps");
    l
}

#[test]
fn training_on_the_gpu_follows_the_cpu_loss_curve() {
    if gpus_or_skip("training_on_the_gpu_follows_the_cpu_loss_curve").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // A position table longer than the sequences (a published GPT-2's 1024
    // rows at a shorter `seq_len`): the GPU's embedding and its gradient
    // read and write the first rows of it.
    let longer = "model.max_position_embeddings=48".to_string();
    let cpu = train(dir.path(), "cpu", 1, std::slice::from_ref(&longer));
    let gpu = train(dir.path(), "cuda", 1, &["device=cuda".into(), longer]);
    follows_the_cpu(&gpu, &cpu);
}

/// The GPU's losses within 1e-3 relative of the CPU's at every step (f32
/// on both: the products and sums differ in order only), and learning.
fn follows_the_cpu(gpu: &[f64], cpu: &[f64]) {
    follows_the_cpu_falling(gpu, cpu, 0.1);
}

/// [`follows_the_cpu`], the loss falling by `fall` over the 20 steps.
fn follows_the_cpu_falling(gpu: &[f64], cpu: &[f64], fall: f64) {
    for (s, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        assert!(
            (g - c).abs() <= 1e-3 * c.abs(),
            "step {}: GPU loss {g}, CPU {c}",
            s + 1
        );
    }
    assert!(gpu[19] < gpu[0] - fall, "no learning on the GPU: {gpu:?}");
    eprintln!(
        "GPU against CPU, 20 steps: largest relative loss difference {:.2e}",
        gpu.iter()
            .zip(cpu)
            .map(|(g, c)| (g - c).abs() / c.abs())
            .fold(0.0, f64::max)
    );
}

/// The settings of a LLaMA with 4 query heads on 2 key/value heads (Qwen2's,
/// with biases on q, k and v, where `qkv_bias`), every group partitioned at
/// stage 3, and `extra`.
fn llama_sets(qkv_bias: bool, extra: &[&str]) -> Vec<String> {
    let bias = format!("model.qkv_bias={qkv_bias}");
    let base = [
        "model.kind=llama",
        &bias,
        "model.n_kv_heads=2",
        "zero.param_persistence_threshold=0",
    ];
    base.iter().chain(extra).map(|s| s.to_string()).collect()
}

#[test]
fn llama_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree() {
    if gpus_or_skip("llama_on_the_gpu_follows_the_cpu_loss_curve").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let llama = |extra: &[&str]| llama_sets(false, extra);
    let cpu = train(dir.path(), "llama-cpu", 1, &llama(&[]));
    let gpu = train(dir.path(), "llama-gpu", 1, &llama(&["device=cuda"]));
    follows_the_cpu(&gpu, &cpu);
    for tied in [false, true] {
        let tie = format!("model.tie_embeddings={tied}");
        let stage = |n: u8, backend: &str| {
            let (s, b) = (format!("zero.stage={n}"), format!("comm.backend={backend}"));
            let sets = llama(&["device=cuda", &tie, &s, &b]);
            train(
                dir.path(),
                &format!("llama-s{n}-{backend}-tied-{tied}"),
                2,
                &sets,
            )
        };
        let stage0 = stage(0, "auto");
        assert_eq!(
            stage(3, "auto"),
            stage0,
            "LLaMA stage 3 against stage 0 ({tie})"
        );
        // Resident on the GPUs over NCCL, stage 3's gathers there: the same.
        assert_eq!(stage(3, "nccl"), stage0, "LLaMA stage 3 over NCCL ({tie})");
    }
}

#[test]
fn qwen2_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree() {
    // Stage 3 partitions the biases too.
    a_variant_on_the_gpu("qwen2", |extra| llama_sets(true, extra));
}

/// A sliding window of 8 over sequences of 32 (`model.sliding_window`):
/// the GPU's attention bounds each row by it as the CPU's does.
#[test]
fn sliding_window_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree() {
    a_variant_on_the_gpu("sliding_window", |extra| {
        llama_sets(false, &[&["model.sliding_window=8"][..], extra].concat())
    });
}

/// Qwen3: each head's q and k RMS-normalised before the rotation, heads of
/// 16 over d_model 32 (q and the output projection's input 64 wide).
#[test]
fn qwen3_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree() {
    a_variant_on_the_gpu("qwen3", |extra| {
        let qwen3 = ["model.qk_norm=true", "model.head_dim=16"];
        llama_sets(false, &[&qwen3[..], extra].concat())
    });
}

/// A LLaMA variant (`sets` given the settings to add) trained on one GPU
/// follows the CPU's loss curve, and stage 3 on two GPUs gives stage 0's
/// losses.
/// A loss mask (`zrun prepare --assistant-only-loss`'s files, written here:
/// ids counting up modulo 64, every third target left out): the GPU's loss
/// kernel leaves those rows out and divides by the step's count as the
/// CPU's does.
#[test]
fn a_loss_mask_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree() {
    let data = tempfile::tempdir().unwrap();
    let n = 6000u32;
    let ids: Vec<u8> = (0..n)
        .flat_map(|i| ((i % 64) as u16).to_le_bytes())
        .collect();
    let mask: Vec<u8> = (0..n).map(|i| u8::from(i % 3 != 0)).collect();
    std::fs::write(data.path().join("train.bin"), &ids).unwrap();
    std::fs::write(data.path().join("train.mask"), &mask).unwrap();
    let manifest = serde_json::json!({
        "tokenizer": "none", "tokenizer_sha256": "", "vocab_size": 64,
        "format": "tokens_u16", "eos_id": null,
        "files": {"train.bin": {"tokens": n, "bytes": ids.len(), "max_token_id": 63,
            "documents": 1, "mask": {"file": "train.mask", "trained": n - n / 3}}}
    });
    std::fs::write(data.path().join("manifest.json"), manifest.to_string()).unwrap();
    let path = format!("data.path={}/train.bin", data.path().display());
    a_variant_on_the_gpu("loss_mask", |extra| {
        let base = [path.as_str(), "data.format=tokens_u16"];
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    });
}

/// Packed documents kept apart (`data.separate_documents`, documents of 3
/// to 45 tokens ended by id 63, so that a sequence of 32 holds several or
/// part of one): the GPU's positions, attention and loss stop at each end
/// as the CPU's do.
#[test]
fn packed_documents_on_the_gpu_follow_the_cpu_loss_curve_and_its_stages_agree() {
    let data = tempfile::tempdir().unwrap();
    let eos = 63u16;
    let mut ids = Vec::new();
    let mut documents = 0;
    while ids.len() < 6000 {
        let len = 3 + (documents * 7) % 43;
        ids.extend((0..len).map(|i| ((i * 5 + documents) % 63) as u16));
        ids.push(eos);
        documents += 1;
    }
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    std::fs::write(data.path().join("train.bin"), &bytes).unwrap();
    let manifest = serde_json::json!({
        "tokenizer": "none", "tokenizer_sha256": "", "vocab_size": 64,
        "format": "tokens_u16", "eos_id": eos,
        "files": {"train.bin": {"tokens": ids.len(), "bytes": bytes.len(), "max_token_id": 63,
            "documents": documents}}
    });
    std::fs::write(data.path().join("manifest.json"), manifest.to_string()).unwrap();
    let path = format!("data.path={}/train.bin", data.path().display());
    a_variant_on_the_gpu("documents", |extra| {
        let base = [
            path.as_str(),
            "data.format=tokens_u16",
            "data.separate_documents=true",
        ];
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    });
}

/// Lion (`train.optimizer.type: lion`, adamw.cu's `c.rule` 1): the GPU's
/// update is the CPU kernel's (held to its bits by zengine's and zcuda-emu's
/// kernel tests), so its losses follow the CPU run's, and its stages agree.
#[test]
fn lion_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree() {
    a_variant_on_the_gpu("lion", |extra| {
        let base = ["train.optimizer.type=lion", "train.lr=1.0e-3"];
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    });
}

/// Adagrad (`train.optimizer.type: adagrad`, adamw.cu's `c.rule` 2, with
/// `lr_decay`): as Lion's, the GPU's update is the CPU kernel's, its
/// losses follow the CPU run's, and its stages agree.
#[test]
fn adagrad_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree() {
    a_variant_on_the_gpu("adagrad", |extra| {
        let base = [
            "train.optimizer.type=adagrad",
            "train.optimizer.lr_decay=0.01",
            "train.lr=1.0e-2",
        ];
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    });
}

/// LAMB (`train.optimizer.type: lamb`) with a GPU keeps its optimizer on
/// the host (`zero.offload_optimizer.device: cpu`, ZeRO-Offload): the GPU's
/// gradients go to the host, LAMB's two passes run there, the parameters
/// come back. Its losses follow the CPU run's with the same offload, and
/// its stages agree. Without the offload it is refused before launch
/// (exit 2, naming the key to set), with or without a GPU.
#[test]
fn lamb_on_the_gpu_runs_on_the_host_and_follows_the_cpu_loss_curve() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "lamb-resident", 2);
    let f = zrun(
        &repo_root(),
        &[
            "check",
            job.to_str().unwrap(),
            "--set",
            "device=cuda",
            "--set",
            "train.optimizer.type=lamb",
        ],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("set zero.offload_optimizer.device: cpu"),
        "{}",
        f.stderr
    );
    if gpus_or_skip("lamb_on_the_gpu_runs_on_the_host").is_none() {
        return;
    }
    let sets = |extra: &[&str]| -> Vec<String> {
        let base = [
            "train.optimizer.type=lamb",
            "train.lr=0.3",
            "train.optimizer.min_coeff=0.001",
            "zero.stage=1",
            "zero.offload_optimizer.device=cpu",
        ];
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let cpu = train(dir.path(), "lamb-cpu", 1, &sets(&[]));
    let gpu = train(dir.path(), "lamb-gpu", 1, &sets(&["device=cuda"]));
    // LAMB learns this small job's synthetic data more slowly than AdamW
    // (4.155 to 4.112 over the 20 steps, where AdamW reaches 3.92).
    follows_the_cpu_falling(&gpu, &cpu, 0.03);
    let stage = |n: u8| {
        let s = format!("zero.stage={n}");
        train(
            dir.path(),
            &format!("lamb-s{n}"),
            2,
            &sets(&["device=cuda", &s]),
        )
    };
    assert_eq!(
        stage(3),
        stage(1),
        "LAMB stage 3 against stage 1 on the GPU"
    );
}

/// Label smoothing (`train.label_smoothing`, in the head's cross-entropy
/// kernel): the GPU's smoothed losses follow the CPU's, and its stages
/// agree.
#[test]
fn label_smoothing_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree() {
    a_variant_on_the_gpu("label_smoothing", |extra| {
        let base = ["train.label_smoothing=0.1"];
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    });
}

/// A sequence-length curriculum (`train.curriculum`): the GPU's steps take
/// the lengths the CPU's take (odd ones among them, 7 to 32 tokens: no
/// multiple of a tile), so its losses follow the CPU run's, and its stages
/// agree.
#[test]
fn a_curriculum_on_the_gpu_follows_the_cpu_loss_curve_and_its_stages_agree() {
    a_variant_on_the_gpu("curriculum", |extra| {
        let base = ["train.curriculum={min_difficulty: 5, schedule_type: fixed_linear, total_curriculum_step: 12, difficulty_step: 1}"];
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    });
}

/// Dropout and NEFTune (`model.hidden_dropout`,
/// `model.attention_dropout`, `train.neftune_noise_alpha`: gpt.cu's
/// `bias_residual`, `causal_softmax` and `dropout_noise` under zmodel's
/// keys): the GPU drops and draws what the CPU does, so its losses follow
/// the CPU run's; its stages agree (the host flow's embedding backward
/// drops on the host, the resident one's on the GPU); activation
/// checkpointing's recomputed forward drops the same elements, to the bit;
/// and under bf16 (whose products read the probabilities dropped as the
/// softmax writes them in 16 bits) the GPU follows the CPU's bf16 run.
#[test]
fn dropout_and_neftune_on_the_gpu_follow_the_cpu_loss_curve_and_its_stages_agree() {
    let sets = |extra: &[&str]| -> Vec<String> {
        let base = [
            "model.hidden_dropout=0.1",
            "model.attention_dropout=0.1",
            "train.neftune_noise_alpha=0.5",
        ];
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    a_variant_on_the_gpu("dropout", sets);
    if gpus().is_err() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let plain = train(dir.path(), "plain", 1, &sets(&["device=cuda"]));
    // Closer than follows_the_cpu's 1e-3, which a dropout's effect on so
    // small a model can hide under: f32 GPU runs have stayed within 2e-8
    // of the CPU's (an H100, an H200, the CPU GPU).
    let cpu = train(dir.path(), "cpu", 1, &sets(&[]));
    for (s, (g, c)) in plain.iter().zip(&cpu).enumerate() {
        assert!(
            (g - c).abs() <= 1e-6 * c.abs(),
            "step {}: GPU {g}, CPU {c}",
            s + 1
        );
    }
    let recomputed = train(
        dir.path(),
        "recomputed",
        1,
        &sets(&["device=cuda", "train.activation_checkpointing=true"]),
    );
    assert_eq!(recomputed, plain, "activation checkpointing on the GPU");
    let attention_only = train(
        dir.path(),
        "attention-only",
        1,
        &["device=cuda".into(), "model.attention_dropout=0.1".into()],
    );
    let undropped = train(dir.path(), "undropped", 1, &["device=cuda".into()]);
    assert_ne!(
        attention_only, undropped,
        "the attention's dropout changed nothing"
    );
    assert_ne!(plain, attention_only, "the hidden dropout changed nothing");
    // bf16: the bound of the bf16 test (bf16_and_f16_on_the_gpu_...).
    let cpu = train(dir.path(), "bf16-cpu", 1, &sets(&["train.dtype=bf16"]));
    let gpu = train(
        dir.path(),
        "bf16-gpu",
        1,
        &sets(&["train.dtype=bf16", "device=cuda"]),
    );
    let worst = worst_relative(&gpu, &cpu);
    eprintln!("bf16 with dropout, GPU against CPU: largest relative loss difference {worst:.2e}");
    assert!(worst <= 1e-2, "bf16: {gpu:?} against {cpu:?}");
}

/// `train.freeze` on the GPU (the embeddings, block 0 and block 1's
/// attention product frozen): 20 steps following the CPU run, stages 3
/// and 0 agreeing (two workers, the host flow), every stage agreeing over
/// NCCL in f32 and bf16 (BitFit's collectives carrying its trained runs
/// alone), and activation checkpointing's
/// recomputed blocks giving the same bits; then, in f32 and bf16, six steps on the CPU and on the
/// GPU, each exported from its checkpoint: every frozen tensor as the CPU
/// run left it, to the bit (the initial weights: an update that decayed or
/// moved one fails).
#[test]
fn frozen_parameters_on_the_gpu_follow_the_cpu_run_and_keep_their_values() {
    if gpus_or_skip("frozen_parameters_on_the_gpu_follow_the_cpu_run").is_none() {
        return;
    }
    let freeze = r#"train.freeze=["w*.weight", "h.0.*", "h.1.attn.c_attn.weight"]"#;
    let sets = |extra: &[&str]| -> Vec<String> {
        std::iter::once(&freeze)
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "frozen", 20);
    let steps = |name: &str, extra: &[&str]| -> Vec<(f64, f64)> {
        let lines = step_lines(&run(&job, name, 1, &sets(extra), &[]));
        lines.iter().map(loss_and_norm).collect()
    };
    let (cpu, gpu) = (steps("cpu", &[]), steps("gpu", &["device=cuda"]));
    // Two thirds of the model frozen: the loss falls by less in 20 steps
    // (0.07 on the CPU GPU).
    let losses = |s: &[(f64, f64)]| s.iter().map(|x| x.0).collect::<Vec<_>>();
    follows_the_cpu_falling(&losses(&gpu), &losses(&cpu), 0.05);
    // The gradient norm without the frozen parameters' gradients, which
    // the GPU's backward makes.
    for (s, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        assert!(
            (g.1 - c.1).abs() <= 1e-3 * c.1,
            "step {}: GPU gradient norm {}, CPU {}",
            s + 1,
            g.1,
            c.1
        );
    }
    let stage = |n: u8| {
        let s = format!("zero.stage={n}");
        train(dir.path(), &format!("s{n}"), 2, &sets(&["device=cuda", &s]))
    };
    let stage_0 = stage(0);
    assert_eq!(stage(3), stage_0, "frozen: stage 3 against stage 0");
    // Over NCCL (the resident flow) every stage agrees too, in f32 and
    // bf16: stages 1-2 gather the updated parameters after the step, and a
    // partly frozen group's frozen slots, which the gather does not carry,
    // keep their values (they were zeroed before 2026-12-06).
    for dtype in ["f32", "bf16"] {
        let nccl = |n: u8| {
            let (s, d) = (format!("zero.stage={n}"), format!("train.dtype={dtype}"));
            let name = format!("nccl-{dtype}-s{n}");
            let sets = sets(&["device=cuda", "comm.backend=nccl", &s, &d]);
            train(dir.path(), &name, 2, &sets)
        };
        let base = nccl(0);
        for n in 1..=3 {
            assert_eq!(
                nccl(n),
                base,
                "frozen over NCCL, {dtype}: stage {n} against 0"
            );
        }
    }
    // Over NCCL a partly frozen group's collectives carry its trained runs
    // alone, as the host's buckets do: with every weight frozen (BitFit)
    // a step moves a few percent of the unfrozen job's bytes, at stage 2
    // (reduce-scatters, gathers after the step) and stage 0 (all-reduces).
    for stage in ["zero.stage=2", "zero.stage=0"] {
        let bytes = |name: &str, freeze: &str| -> f64 {
            let sets: Vec<String> = ["device=cuda", "comm.backend=nccl", stage, "train.steps=3"]
                .into_iter()
                .chain((!freeze.is_empty()).then_some(freeze))
                .map(String::from)
                .collect();
            let lines = step_lines(&run(&job, name, 2, &sets, &[]));
            let by_op = lines.last().unwrap()["comm_bytes"]["by_op"]
                .as_object()
                .unwrap()
                .clone();
            by_op.values().map(|v| v.as_f64().unwrap()).sum()
        };
        let all = bytes(&format!("bytes-all-{stage}"), "");
        let bitfit = bytes(
            &format!("bytes-bitfit-{stage}"),
            r#"train.freeze=["*.weight"]"#,
        );
        assert!(
            all > 0.0 && bitfit < 0.1 * all,
            "{stage}: BitFit moved {bitfit} bytes a step over NCCL, the unfrozen job {all}"
        );
    }
    // Recomputed blocks (activation checkpointing) keep what the first
    // forward keeps: the same bits.
    let recomputed = ["device=cuda", "train.activation_checkpointing=true"];
    let recomputed = train(dir.path(), "ckpt", 2, &sets(&recomputed));
    assert_eq!(recomputed, stage_0, "frozen: checkpointing against not");
    let is_frozen = |name: &str| {
        name.starts_with("wte.")
            || name.starts_with("wpe.")
            || name.starts_with("h.0.")
            || name == "h.1.attn.c_attn.weight"
    };
    for dtype in ["f32", "bf16"] {
        let exported = |device: &str| {
            let d = tempfile::tempdir().unwrap();
            let job = ckpt_job(d.path(), "frozen", 6, 6);
            let sets = [
                freeze.to_string(),
                format!("train.dtype={dtype}"),
                format!("device={device}"),
            ];
            run(&job, device, 1, &sets, &[]);
            export_ckpt(d.path(), "out.safetensors")
        };
        let (cpu, gpu) = (exported("cpu"), exported("cuda"));
        let cpu = safetensors::SafeTensors::deserialize(&cpu).unwrap();
        let gpu = safetensors::SafeTensors::deserialize(&gpu).unwrap();
        let mut frozen = 0;
        for (name, want) in cpu.tensors() {
            let got = gpu.tensor(&name).unwrap();
            if is_frozen(&name) {
                assert!(
                    got.data() == want.data(),
                    "{dtype}: {name} moved on the GPU"
                );
                frozen += 1;
            }
        }
        // wte, wpe, block 0's twelve tensors and one of block 1's.
        assert_eq!(frozen, 15, "{dtype}: the frozen tensors exported");
    }
    // What the GPU skips, by the profile's calls a step: with the embedding
    // and block h.0 frozen whole, backward stops above h.0 (its four
    // linears' two products each, attention's four, its two norms and the
    // embedding's two scatter-adds not run), and the tied output matrix's
    // product and c_attn's weight product are not made.
    let calls = |sets: &[String]| -> HashMap<String, f64> {
        let sets: Vec<String> = std::iter::once("train.steps=4".to_string())
            .chain(sets.iter().cloned())
            .collect();
        let f = profiled(&job, &sets);
        let table = profile_table(&f.stdout);
        let rows = &table[..table.len().saturating_sub(1)];
        assert!(rows.len() > 5, "no profile table: {}", f.stdout);
        let mut by_kind = HashMap::new();
        for row in rows {
            let name = row.split_whitespace().nth(6).unwrap_or_default();
            *by_kind.entry(name.to_string()).or_default() += profile_field(row, 2, &f.stdout);
        }
        by_kind
    };
    let (all, some) = (calls(&[]), calls(&sets(&[])));
    let fewer =
        |name: &str| all.get(name).copied().unwrap_or(0.0) - some.get(name).copied().unwrap_or(0.0);
    assert_eq!(
        fewer("gemm"),
        8.0 + 4.0 + 2.0,
        "products a step: {all:?} against {some:?}"
    );
    assert_eq!(
        fewer("layer_norm_backward"),
        2.0,
        "{all:?} against {some:?}"
    );
    assert_eq!(
        fewer("embed_backward_tokens") + fewer("embed_backward_positions"),
        2.0
    );
    assert!(!some.contains_key("embed_backward_tokens"), "{some:?}");
}

fn a_variant_on_the_gpu(name: &str, sets: impl Fn(&[&str]) -> Vec<String>) {
    let test = format!("{name}_on_the_gpu_follows_the_cpu_loss_curve");
    if gpus_or_skip(&test).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cpu = train(dir.path(), &format!("{name}-cpu"), 1, &sets(&[]));
    let gpu = train(
        dir.path(),
        &format!("{name}-gpu"),
        1,
        &sets(&["device=cuda"]),
    );
    follows_the_cpu(&gpu, &cpu);
    let stage = |n: u8| {
        let s = format!("zero.stage={n}");
        train(
            dir.path(),
            &format!("{name}-s{n}"),
            2,
            &sets(&["device=cuda", &s]),
        )
    };
    assert_eq!(
        stage(3),
        stage(0),
        "{name} stage 3 against stage 0 on the GPU"
    );
}

#[test]
fn bf16_and_f16_on_the_gpu_follow_the_cpu_run_and_their_stages_agree() {
    if gpus_or_skip("bf16_and_f16_on_the_gpu_follow_the_cpu_run").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let gpu_f32 = train(dir.path(), "f32", 1, &["device=cuda".into()]);
    for dtype in ["bf16", "f16"] {
        let with = |extra: &[&str]| -> Vec<String> {
            [format!("train.dtype={dtype}")]
                .into_iter()
                .chain(extra.iter().map(|s| s.to_string()))
                .collect()
        };
        let cpu = train(dir.path(), &format!("{dtype}-cpu"), 1, &with(&[]));
        let gpu = train(
            dir.path(),
            &format!("{dtype}-gpu"),
            1,
            &with(&["device=cuda"]),
        );
        // The GPU multiplies 16-bit operands (bf16 on compute capability
        // 8.0 and newer, f16 everywhere), the CPU bf16 ones where it has
        // AMX and f32 values of the 16-bit parameters elsewhere (f16
        // always): the activations' rounding sets them apart, f16's 8
        // times less than bf16's. Measured on the CPU GPU (no AMX): bf16
        // 9.1e-5, f16 3.5e-5 (f32 products of the f16 parameters were
        // 1.2e-6 from the CPU on an H100).
        let bound = if dtype == "bf16" { 1e-2 } else { 1e-3 };
        let (from_cpu, from_f32) = (worst_relative(&gpu, &cpu), worst_relative(&gpu, &gpu_f32));
        eprintln!(
            "{dtype} on the GPU, 20 steps: largest relative loss difference from the CPU's {dtype} run {from_cpu:.2e} (the CPU {}), from the GPU's f32 run {from_f32:.2e}",
            match zgemm::has_native_bf16() {
                true => "has AMX",
                false => "has no AMX",
            }
        );
        assert!(
            from_cpu <= bound,
            "{dtype}: the GPU strays from the CPU: {gpu:?} against {cpu:?}"
        );
        assert!(gpu[19] < gpu[0] - 0.1, "no learning in {dtype}: {gpu:?}");
        let stage = |n: u8| {
            let sets = with(&[
                "device=cuda",
                &format!("zero.stage={n}"),
                "zero.param_persistence_threshold=0",
            ]);
            train(dir.path(), &format!("{dtype}-s{n}"), 2, &sets)
        };
        assert_eq!(stage(3), stage(0), "{dtype}: stage 3 against stage 0");
    }
}

/// `train.grad_accum_dtype: f32` on the GPU: bf16 weights with f32
/// gradients, summed over micro-batches unrounded. One worker (the resident
/// flow) follows the CPU's run of the same job and is not the GPU's run
/// with bf16 sums; over NCCL stage 1 gives stage 0's bits and stage 3
/// stage 2's (two micro-batches a step: the pairs sum in two orders), as
/// stages 3 and 2 do in the host flow.
#[test]
fn f32_gradient_sums_on_the_gpu_follow_the_cpu_run_and_their_stages_agree() {
    if gpus_or_skip("f32_gradient_sums_on_the_gpu_follow_the_cpu_run").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let with = |extra: &[&str]| -> Vec<String> {
        [
            "train.dtype=bf16",
            "train.grad_accum=2",
            "train.grad_accum_dtype=f32",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
    };
    let job = small_job(dir.path(), "sums", 20);
    let steps = |name: &str, extra: &[&str]| -> Vec<(f64, f64)> {
        let lines = step_lines(&run(&job, name, 1, &with(extra), &[]));
        lines.iter().map(loss_and_norm).collect()
    };
    let cpu = steps("cpu", &[]);
    let gpu = steps("gpu", &["device=cuda"]);
    let halves = steps(
        "gpu-bf16-sums",
        &["device=cuda", "train.grad_accum_dtype=bf16"],
    );
    let losses = |s: &[(f64, f64)]| s.iter().map(|x| x.0).collect::<Vec<_>>();
    let norms = |s: &[(f64, f64)]| s.iter().map(|x| x.1).collect::<Vec<_>>();
    eprintln!(
        "bf16 with f32 gradient sums on the GPU, 20 steps: largest relative difference from the CPU's run {:.2e} (losses), {:.2e} (gradient norms); from the GPU's bf16 sums {:.2e} (losses)",
        worst_relative(&losses(&gpu), &losses(&cpu)),
        worst_relative(&norms(&gpu), &norms(&cpu)),
        worst_relative(&losses(&gpu), &losses(&halves))
    );
    // Losses within 1e-3 of the CPU's (measured 3.5e-5 on the CPU GPU),
    // gradient norms within 1e-2: the norms read the f32 sums as the
    // averaging in place leaves them.
    follows_the_cpu_falling(&losses(&gpu), &losses(&cpu), 0.1);
    assert!(
        worst_relative(&norms(&gpu), &norms(&cpu)) <= 1e-2,
        "gradient norms: {:?} against {:?}",
        norms(&gpu),
        norms(&cpu)
    );
    assert_ne!(gpu, halves, "f32 sums change nothing on the GPU");
    let stage = |n: u8, nccl: bool| {
        let s = format!("zero.stage={n}");
        let mut extra = vec!["device=cuda", &s];
        if nccl {
            extra.push("comm.backend=nccl");
        }
        train(dir.path(), &format!("s{n}-{nccl}"), 2, &with(&extra))
    };
    // With accumulation stages 0-1 sum locally and reduce once, stages
    // 2-3 reduce each micro-batch and sum the reductions: each pair agrees.
    assert_eq!(
        stage(1, true),
        stage(0, true),
        "over NCCL: stage 1 against 0"
    );
    assert_eq!(
        stage(3, true),
        stage(2, true),
        "over NCCL: stage 3 against 2"
    );
    assert_eq!(
        stage(3, false),
        stage(2, false),
        "host flow: stage 3 against 2"
    );
}

#[test]
fn fused_attention_follows_the_unfused_run_and_repeats_to_the_bit() {
    if gpus_or_skip("fused_attention_follows_the_unfused_run").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // bf16, f16 and TF32 products; heads of 16 (the fused kernels'
    // narrowest) over two tiles of rows. Both paths round q, k, v and the
    // probabilities alike, at other points (the unfused path normalises
    // before rounding, the fused one after): bf16 parts them by up to 1e-2,
    // f16 and TF32 by an eighth of that.
    for (products, set, bound) in [
        ("bf16", "train.dtype=bf16", 1e-2),
        ("f16", "train.dtype=f16", 2e-3),
        ("tf32", "train.allow_tf32=true", 2e-3),
    ] {
        let sets = ["device=cuda", set, "model.n_heads=2", "model.seq_len=80"];
        let train_with = |name: &str, attention: &str| -> Vec<f64> {
            let name = format!("{products}-{name}");
            let job = small_job(dir.path(), &name, 20);
            let m = job.with_file_name(format!("{name}.jsonl"));
            let mut args = TrainArgs::new(&job, &m).args(&["--workers-per-node", "1"]);
            for s in sets {
                args = args.set(s);
            }
            let f = Zrun::start_with_env(
                &repo_root(),
                &args.as_strs(),
                &[("ZRUN_GPU_ATTENTION", attention)],
            )
            .wait(std::time::Duration::from_secs(300));
            assert_eq!(f.code(), 0, "{name}: {f:?}");
            let l = losses(&metrics(&m));
            assert_eq!(l.len(), 20, "{name}: steps");
            l
        };
        let unfused = train_with("unfused", "unfused");
        let fused = train_with("fused", "fused");
        let worst = worst_relative(&fused, &unfused);
        eprintln!("fused attention, 20 {products} steps: largest relative loss difference from the unfused run {worst:.2e}");
        assert!(
            worst < bound,
            "{products}: fused {fused:?} against unfused {unfused:?}"
        );
        assert!(
            worst > 0.0,
            "{products}: the same losses as the unfused run: was the fused path on?"
        );
        assert!(
            fused[19] < fused[0] - 0.1,
            "{products}: no learning: {fused:?}"
        );
        // By default (`auto`) these jobs run the fused kernels: the fused
        // run's losses again, to the bit.
        assert_eq!(
            train_with("auto", "auto"),
            fused,
            "{products}: ZRUN_GPU_ATTENTION=auto"
        );
    }
}

#[test]
fn tf32_follows_the_cpu_loss_curve_within_its_rounding() {
    if gpus_or_skip("tf32_follows_the_cpu_loss_curve_within_its_rounding").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Products large enough that cuBLAS picks its tensor-core kernels.
    let shape = ["model.d_model=256", "model.n_heads=4"].map(String::from);
    let with = |extra: &[&str]| {
        [
            &shape[..],
            &extra.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        ]
        .concat()
    };
    let cpu = train(dir.path(), "cpu", 1, &with(&[]));
    let f32 = train(dir.path(), "f32", 1, &with(&["device=cuda"]));
    let tf32 = train(
        dir.path(),
        "tf32",
        1,
        &with(&["device=cuda", "train.allow_tf32=true"]),
    );
    let worst = |a: &[f64]| worst_relative(a, &cpu);
    eprintln!(
        "largest relative loss difference from the CPU over 20 steps: f32 {:.2e}, TF32 {:.2e}",
        worst(&f32),
        worst(&tf32)
    );
    // TF32 rounds each product's inputs to 2^-11: the losses move by
    // about that much, not by f32's rounding alone.
    assert!(worst(&tf32) <= 1e-2, "TF32 strays from the CPU run");
    assert!(
        worst(&tf32) > worst(&f32),
        "TF32 changed nothing: was it on?"
    );
    assert!(tf32[19] < tf32[0] - 0.1, "no learning in TF32: {tf32:?}");
}

#[test]
fn zero_stages_on_the_gpu_are_bit_identical() {
    if gpus_or_skip("zero_stages_on_the_gpu_are_bit_identical").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = |stage: u8, extra: &[&str]| {
        // Stage 3 partitions every group (the small job's groups are all
        // under the default persistence threshold, which would keep them
        // whole and leave stage 3's gathers untested).
        let mut sets = vec![
            "device=cuda".to_string(),
            format!("zero.stage={stage}"),
            "zero.param_persistence_threshold=0".into(),
        ];
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

/// Trains `job` with the `sets` on one GPU with its profile on
/// (`ZRUN_GPU_PROFILE`); zrun's output.
fn profiled(job: &Path, sets: &[String]) -> e2e::Finished {
    let m = job.with_file_name("profiled.jsonl");
    let mut args = TrainArgs::new(job, &m)
        .args(&["--workers-per-node", "1"])
        .set("device=cuda");
    for s in sets {
        args = args.set(s.clone());
    }
    let f = Zrun::start_with_env(
        &repo_root(),
        &args.as_strs(),
        &[("ZRUN_GPU_PROFILE", "1"), ("ZRUN_GPU_ATTENTION", "unfused")],
    )
    .wait(std::time::Duration::from_secs(300));
    assert_eq!(f.code(), 0, "{f:?}");
    f
}

/// Rank 0's rows of the GPU profile's table in zrun's output
/// (`ZRUN_GPU_PROFILE`): "ms/step share calls/step idle name" rows, then
/// the total (zrun's own lines, a step's, may come between any two).
fn profile_table(stdout: &str) -> Vec<&str> {
    let total_row = |l: &&str| l.ends_with("all marked operations");
    let from_header = || {
        (stdout.lines())
            .skip_while(|l| !l.contains("GPU time by operation"))
            .skip(1)
            .filter(|l| l.starts_with("[rank 0]") && !l.contains("ms/step"))
    };
    let mut table: Vec<&str> = from_header().take_while(|l| !total_row(l)).collect();
    table.extend(from_header().find(total_row));
    table
}

/// Field `i` of a row of [`profile_table`], a number (a share without its
/// `%`).
fn profile_field(row: &str, i: usize, stdout: &str) -> f64 {
    let words: Vec<&str> = row
        .split(']')
        .next_back()
        .unwrap()
        .split_whitespace()
        .collect();
    let word = words.get(i).map(|w| w.trim_end_matches('%'));
    word.and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("field {i} of {row:?} is no number: {stdout}"))
}

#[test]
fn the_gpu_profile_times_each_operation_and_the_gpus_wait_for_the_host() {
    let test = "the_gpu_profile_times_each_operation_and_the_gpus_wait_for_the_host";
    if gpus_or_skip(test).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let f = profiled(&small_job(dir.path(), "profiled", 8), &[]);
    let table = profile_table(&f.stdout);
    let field = |l: &str, i: usize| profile_field(l, i, &f.stdout);
    let (rows, total) = table.split_at(table.len().saturating_sub(1));
    assert!(
        rows.len() > 5 && total.len() == 1 && total[0].ends_with("all marked operations"),
        "no profile table in zrun's output (the workers' stderr): {}",
        f.stdout
    );
    let (ms, idle) = (field(total[0], 0), field(total[0], 2));
    let sum = |i: usize| rows.iter().map(|l| field(l, i)).sum::<f64>();
    assert!(
        ms > 0.0 && (sum(0) - ms).abs() <= 1e-3 * rows.len() as f64,
        "{table:#?}"
    );
    assert!(
        (sum(3) - idle).abs() <= 1e-3 * rows.len() as f64,
        "{table:#?}"
    );
    for l in rows {
        assert!(
            (0.0..=field(l, 0) + 1e-3).contains(&field(l, 3)),
            "idle beyond its time: {l}"
        );
    }
    for name in ["adamw", "embed", "layer_norm", "gemm f32"] {
        assert!(
            rows.iter().any(|l| l.contains(name)),
            "no {name} row: {table:#?}"
        );
    }
    // The CPU GPU runs each kernel inside its launch, so its GPU waits for
    // the host for nearly all of every operation: the host's clock is read.
    // (The table's header names the GPU.)
    if f.stdout.contains("steps of rank 0 on zcuda-emu") {
        assert!(idle > 0.5 * ms, "the CPU GPU idle {idle} of {ms} ms a step");
    }
    eprintln!("{}", table.join("\n"));
}

#[test]
fn adam_on_the_gpu_gives_zero_offloads_bits() {
    if gpus_or_skip("adam_on_the_gpu_gives_zero_offloads_bits").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Stage 1: DeepSpeed's rule, which zrun keeps, is that offloading the
    // optimizer needs a partitioning stage; one worker holds every slice.
    let sets: Vec<String> = [
        "device=cuda",
        "zero.stage=1",
        "train.grad_accum=2",
        "train.grad_clip=0.5",
    ]
    .map(String::from)
    .to_vec();
    let with =
        |extra: &[&str]| [sets.clone(), extra.iter().map(|s| s.to_string()).collect()].concat();
    let steps = |name: &str, extra: &[&str]| -> Vec<(f64, f64)> {
        let job = small_job(dir.path(), name, 12);
        step_lines(&run(&job, name, 1, &with(extra), &[]))
            .iter()
            .map(loss_and_norm)
            .collect()
    };
    // 16 bits: the gradients summed in 16 bits on the GPU, AdamW on the f32
    // master writing the working copy there; f16 with its loss scale.
    for dtype in ["f32", "bf16", "f16"] {
        let d = format!("train.dtype={dtype}");
        let resident = steps(&format!("resident-{dtype}"), &[&d]);
        let offload = steps(
            &format!("offload-{dtype}"),
            &[&d, "zero.offload_optimizer.device=cpu"],
        );
        assert_eq!(resident.len(), 12);
        assert!(
            resident.iter().any(|&(_, norm)| norm > 0.5),
            "{dtype}: no step clipped: {resident:?}"
        );
        assert_eq!(resident, offload, "{dtype}: (loss, grad norm) per step");
    }
}

#[test]
fn a_resumed_gpu_run_continues_the_uninterrupted_one_to_the_bit() {
    if gpus_or_skip("a_resumed_gpu_run_continues_the_uninterrupted_one").is_none() {
        return;
    }
    // bf16: the checkpoint holds the f32 master, from which the resumed
    // run rounds the working copy again.
    for dtype in ["f32", "bf16"] {
        let d = tempfile::tempdir().unwrap();
        let job = ckpt_job(d.path(), "gpu-resume", 12, 6);
        let sets = vec!["device=cuda".to_string(), format!("train.dtype={dtype}")];
        let straight = losses_by_step(&run(&job, "straight", 1, &sets, &[]));
        std::fs::remove_dir_all(d.path().join("ckpt/step-00000012")).unwrap();
        let resumed = losses_by_step(&run(&job, "resumed", 1, &sets, &["--resume", "auto"]));
        assert_eq!(
            resumed.iter().map(|x| x.0).collect::<Vec<_>>(),
            (7..=12).collect::<Vec<u64>>()
        );
        assert_eq!(resumed, straight[6..].to_vec(), "{dtype}");
    }
}

/// Two workers sharing the one GPU a test machine has (NCCL then runs
/// between them over loopback, each its own NCCL_HOSTID) at each of
/// `stages` in `dtype`: over NCCL against the host flow, (loss, gradient
/// norm) per step to the bit and the bytes sent by operation.
fn nccl_against_the_host_flow(dtype: &str, stages: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    // Per step: loss, gradient norm, and the bytes sent by operation.
    type Step = (f64, f64, Vec<(String, u64)>);
    let steps = |name: &str, stage: u8, backend: &str| -> Vec<Step> {
        let sets: Vec<String> = [
            "device=cuda".to_string(),
            format!("train.dtype={dtype}"),
            format!("zero.stage={stage}"),
            "train.grad_accum=2".into(),
            "train.grad_clip=0.5".into(),
            format!("comm.backend={backend}"),
            // Stage 3: the blocks and the embedding partitioned, the final
            // norm (the tied head's only own parameters) whole.
            "zero.param_persistence_threshold=1000".into(),
        ]
        .to_vec();
        let job = small_job(dir.path(), name, 12);
        step_lines(&run(&job, name, 2, &sets, &[]))
            .iter()
            .map(|l| {
                let (loss, norm) = loss_and_norm(l);
                let by_op = l["comm_bytes"]["by_op"].as_object().unwrap();
                let bytes = by_op.iter().map(|(k, v)| (k.clone(), v.as_u64().unwrap()));
                (loss, norm, bytes.collect())
            })
            .collect()
    };
    // Stages 2-3 add each micro-batch's reduced slice, stages 0-1 reduce the
    // accumulated gradient: with two micro-batches their bits differ, on
    // the host as over NCCL, so each stage is held to the host flow's.
    for &stage in stages {
        let host = steps(&format!("host{stage}"), stage, "auto");
        assert_eq!(host.len(), 12);
        assert!(host.iter().any(|s| s.1 > 0.5), "no step clipped: {host:?}");
        let nccl = steps(&format!("nccl{stage}"), stage, "nccl");
        let bits = |v: &[Step]| v.iter().map(|s| (s.0, s.1)).collect::<Vec<_>>();
        assert_eq!(
            bits(&nccl),
            bits(&host),
            "{dtype} stage {stage} over NCCL: (loss, grad norm) per step"
        );
        // NCCL's bytes are counted by the ring factors the host's are (under
        // 16 bits: gradients summed in f32, parameters gathered in 16 bits).
        assert_eq!(
            nccl[5].2, host[5].2,
            "{dtype} stage {stage}: bytes sent by operation, NCCL against the host"
        );
    }
}

#[test]
fn nccl_between_two_workers_gives_the_host_reductions_bits() {
    if gpus_or_skip("nccl_between_two_workers_gives_the_host_reductions_bits").is_none() {
        return;
    }
    nccl_against_the_host_flow("f32", &[0, 1, 2, 3]);
}

/// Two GPUs (on a CPU-only machine, zcuda-emu's CPU GPU asked for two by
/// `ZCUDA_EMU_DEVICES`, which a real driver ignores): without
/// `--workers-per-node`, zrun starts one worker per GPU, each binds its own
/// (`LOCAL_RANK`), and stage 3 over NCCL gives the host flow's bits;
/// `CUDA_VISIBLE_DEVICES` narrows them to one worker.
#[test]
fn two_gpus_get_a_worker_each_bound_to_its_own() {
    let test = "two_gpus_get_a_worker_each_bound_to_its_own";
    if gpus_or_skip(test).is_none() {
        return;
    }
    let two = [("ZCUDA_EMU_DEVICES", "2"), ("ZRUN_LOG", "info")];
    let out = Command::new(bin("zworker"))
        .arg("--cuda-devices")
        .envs(two)
        .output()
        .expect("running zworker --cuda-devices");
    if first_word(String::from_utf8_lossy(&out.stdout).trim()) != "2" {
        eprintln!("SKIPPED {test}: one GPU here (ZCUDA_EMU_DEVICES asks only zcuda-emu's for two)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Stage 3 on the GPU (unless `more` says otherwise); (loss, gradient
    // norm) per step, and zrun's output.
    let train = |name: &str, env: &[(&str, &str)], more: &[&str]| {
        let job = small_job(dir.path(), name, 6);
        let m = dir.path().join(format!("{name}.jsonl"));
        let args = TrainArgs::new(&job, &m)
            .set("device=cuda")
            .set("zero.stage=3")
            .args(more);
        let f = Zrun::start_with_env(&repo_root(), &args.as_strs(), env)
            .wait(std::time::Duration::from_secs(300));
        assert_eq!(f.code(), 0, "{name}: {f:?}");
        let steps: Vec<_> = step_lines(&m).iter().map(loss_and_norm).collect();
        (f, steps)
    };
    let (f, nccl) = train("two-gpus", &two, &["--set", "comm.backend=nccl"]);
    assert!(f.stdout.contains("2 workers on 1 node(s)"), "{}", f.stdout);
    let log = format!("{}{}", f.stdout, f.stderr);
    for rank in 0..2 {
        assert!(
            log.contains(&format!("local rank {rank} on GPU {rank} (")),
            "rank {rank} on its own GPU: {log}"
        );
    }
    // The reference: the host flow, two workers sharing one GPU.
    let (_, host) = train(
        "host",
        &[("ZCUDA_EMU_DEVICES", "1")],
        &["--workers-per-node", "2"],
    );
    assert_eq!(nccl.len(), 6);
    assert_eq!(nccl, host, "two GPUs over NCCL against the host flow");
    // bf16 at stage 2: each rank updates its slice of the 16-bit working
    // copy that the products read, and the slices are gathered in place.
    let bf16 = ["--set", "train.dtype=bf16", "--set", "zero.stage=2"];
    let nccl_bf16 = [
        "--set",
        "comm.backend=nccl",
        bf16[0],
        bf16[1],
        bf16[2],
        bf16[3],
    ];
    let (_, nccl) = train("two-gpus-bf16", &two, &nccl_bf16);
    let host_bf16 = [
        "--workers-per-node",
        "2",
        bf16[0],
        bf16[1],
        bf16[2],
        bf16[3],
    ];
    let (_, host) = train("host-bf16", &[("ZCUDA_EMU_DEVICES", "1")], &host_bf16);
    assert_eq!(
        nccl, host,
        "bf16 at stage 2: two GPUs over NCCL against the host flow"
    );

    let visible = [("ZCUDA_EMU_DEVICES", "2"), ("CUDA_VISIBLE_DEVICES", "1")];
    let (f, _) = train("visible", &visible, &[]);
    assert!(f.stdout.contains("1 workers on 1 node(s)"), "{}", f.stdout);
}

#[test]
fn sixteen_bit_state_over_nccl_gives_the_host_flows_bits() {
    if gpus_or_skip("sixteen_bit_state_over_nccl_gives_the_host_flows_bits").is_none() {
        return;
    }
    // Every stage's code path in bf16; f16 (which differs in the format and
    // its loss scale) at the all-reduce and the partitioned ends.
    nccl_against_the_host_flow("bf16", &[0, 1, 2, 3]);
    nccl_against_the_host_flow("f16", &[0, 3]);
}

#[test]
fn zero_pp_and_nvme_offload_run_in_the_gpus_host_flow() {
    if gpus_or_skip("zero_pp_and_nvme_offload_run_in_the_gpus_host_flow").is_none() {
        return;
    }
    // Two workers sharing the GPU, stage 3 with the blocks and the
    // embedding partitioned: the host flow, whose gathers, reductions and
    // swap files are the CPU path's own code.
    let dir = tempfile::tempdir().unwrap();
    type Step = (f64, f64, u64);
    let steps = |name: &str, extra: &[String]| -> Vec<Step> {
        let mut sets: Vec<String> = [
            "device=cuda",
            "zero.stage=3",
            "zero.param_persistence_threshold=1000",
        ]
        .map(String::from)
        .to_vec();
        sets.extend(extra.iter().cloned());
        let job = small_job(dir.path(), name, 16);
        step_lines(&run(&job, name, 2, &sets, &[]))
            .iter()
            .map(|l| {
                let (loss, norm) = loss_and_norm(l);
                (
                    loss,
                    norm,
                    l["comm_bytes"]["by_op"]["all_gather"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let stage3 = steps("stage3", &[]);
    assert_eq!(stage3.len(), 16);
    // hpZ (one node of two workers: the secondary partition is the node):
    // backward gathers from it, the same values, so the same bits.
    let hpz = steps("hpz", &["zero.zero_hpz_partition_size=2".into()]);
    let bits = |v: &[Step]| v.iter().map(|s| (s.0, s.1)).collect::<Vec<_>>();
    assert_eq!(bits(&hpz), bits(&stage3), "hpZ against stage 3");
    // qwZ (int8 forward gathers), qgZ (int4 gradients; with LoCo too) and gradients
    // reduced in bf16 (`train.reduce_dtype`): fewer bytes gathered or the
    // same, losses near stage 3's but not its bits (so the narrowing ran).
    let tail = |v: &[Step]| v[11..].iter().map(|s| s.0).sum::<f64>() / 5.0;
    let qgz = "zero.zero_quantized_gradients=true";
    for (name, keys) in [
        ("qwz", &["zero.zero_quantized_weights=true"][..]),
        ("qgz", &[qgz]),
        ("qgz-loco", &[qgz, "zero.loco={}"]),
        ("reduce-bf16", &["train.reduce_dtype=bf16"]),
    ] {
        let got = steps(
            name,
            &keys.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
        );
        assert_ne!(bits(&got), bits(&stage3), "{name} changed nothing");
        let ratio = tail(&got) / tail(&stage3);
        eprintln!("{name} on the GPU: loss of steps 12-16 {ratio:.4}x stage 3's");
        assert!(
            (0.95..1.05).contains(&ratio),
            "{name}: {got:?} against {stage3:?}"
        );
        if name == "qwz" {
            assert!(got[5].2 < stage3[5].2, "qwZ gathered no fewer bytes");
        }
    }
    // NVMe offload of the optimizer and the parameters: the swap files
    // hold what memory held, so ZeRO-Offload's bits. The GPU host's
    // temporary filesystem may refuse O_DIRECT (tmpfs; some overlays), as
    // zrun would before launch: that part then says it skipped.
    let swap = dir.path().join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    // One aligned 4 KiB block written with O_DIRECT, as zrun probes.
    let probe = swap.join("probe");
    let direct = {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let buf = vec![7u8; 8192];
        let at = buf.as_ptr().align_offset(4096);
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .custom_flags(nix::libc::O_DIRECT)
            .open(&probe)
            .and_then(|mut f| f.write_all(&buf[at..at + 4096]))
    };
    let _ = std::fs::remove_file(&probe);
    if let Err(e) = direct {
        eprintln!(
            "SKIPPED the NVMe part: {} refuses O_DIRECT ({e})",
            swap.display()
        );
        return;
    }
    let offload = |device: &str| -> Vec<String> {
        let mut s = vec![
            format!("zero.offload_optimizer.device={device}"),
            format!("zero.offload_param.device={device}"),
        ];
        if device == "nvme" {
            let p = swap.display();
            s.push(format!("zero.offload_optimizer.nvme_path={p}"));
            s.push(format!("zero.offload_param.nvme_path={p}"));
        }
        s
    };
    let in_memory = steps("offload-cpu", &offload("cpu"));
    let nvme = steps("offload-nvme", &offload("nvme"));
    assert_eq!(
        bits(&nvme),
        bits(&in_memory),
        "NVMe offload against CPU offload"
    );
    assert!(
        std::fs::read_dir(&swap).unwrap().next().is_none(),
        "swap files left"
    );
}

#[test]
fn bench_comm_times_nccl_on_device_buffers() {
    if gpus_or_skip("bench_comm_times_nccl_on_device_buffers").is_none() {
        return;
    }
    // Two workers sharing the GPU: NCCL over loopback between them. Each
    // size is checked on known values before it is timed (a wrong result
    // fails the run); 1000004 bytes are 250001 f32, rounded down to whole
    // chunks of the two ranks.
    let dir = tempfile::tempdir().unwrap();
    let f = zrun(
        dir.path(),
        &[
            "bench",
            "comm",
            "--workers",
            "2",
            "--transports",
            "nccl",
            "--sizes",
            "64KiB,1000004",
            "--json",
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let v: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    eprintln!("{}", serde_json::to_string_pretty(rows).unwrap());
    let nccl: Vec<_> = rows.iter().filter(|r| r["transport"] == "nccl").collect();
    let mut ops: Vec<(String, u64)> = nccl
        .iter()
        .map(|r| {
            (
                r["op"].as_str().unwrap().to_string(),
                r["bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    ops.sort();
    let want: Vec<(String, u64)> = ["all_gather", "all_reduce", "reduce_scatter"]
        .iter()
        .flat_map(|op| [(op.to_string(), 65536), (op.to_string(), 1_000_000)])
        .collect();
    assert_eq!(ops, want);
    for r in nccl {
        let (alg, bus) = (
            r["algbw_gbps"].as_f64().unwrap(),
            r["busbw_gbps"].as_f64().unwrap(),
        );
        let factor = if r["op"] == "all_reduce" { 1.0 } else { 0.5 };
        assert!(alg > 0.0 && (bus - alg * factor).abs() <= 1e-9 * alg, "{r}");
        assert_eq!(r["workers"], 2);
    }
}

#[test]
fn a_resumed_nccl_stage_3_run_continues_the_uninterrupted_one_to_the_bit() {
    if gpus_or_skip("a_resumed_nccl_stage_3_run_continues_the_uninterrupted_one").is_none() {
        return;
    }
    // Each rank's checkpoint holds Adam's moments and parameters of its
    // slice (under bf16 the f32 master), downloaded from its GPU; the
    // resumed ranks upload them again (and round the working copy).
    for dtype in ["f32", "bf16"] {
        let d = tempfile::tempdir().unwrap();
        let job = ckpt_job(d.path(), "nccl-resume", 12, 6);
        let sets: Vec<String> = [
            "device=cuda".to_string(),
            format!("train.dtype={dtype}"),
            "zero.stage=3".into(),
            "comm.backend=nccl".into(),
            "zero.param_persistence_threshold=1000".into(),
        ]
        .to_vec();
        let straight = losses_by_step(&run(&job, "straight", 2, &sets, &[]));
        std::fs::remove_dir_all(d.path().join("ckpt/step-00000012")).unwrap();
        let resumed = losses_by_step(&run(&job, "resumed", 2, &sets, &["--resume", "auto"]));
        assert_eq!(
            resumed.iter().map(|x| x.0).collect::<Vec<_>>(),
            (7..=12).collect::<Vec<u64>>()
        );
        assert_eq!(resumed, straight[6..].to_vec(), "{dtype}");
    }
}
