//! `--deepspeed ds_config.json` through the built zrun: a ds_config trains
//! exactly as the job it maps to, `zrun check` shows each key's source, and a
//! key zrun cannot honour stops the launch with exit 2 at its line.

use std::path::Path;

use e2e::{metrics, small_job, zrun, TrainArgs};

/// Every mapped family at once: batch arithmetic, AdamW's parameters,
/// WarmupCosineLR's ratios on a log ramp, clipping, bf16 with fp32 gradient
/// sums, ZeRO-2's bucket.
const DS_CONFIG: &str = r#"{
  "train_batch_size": 16,
  "gradient_accumulation_steps": 2,
  "steps_per_print": 1,
  "optimizer": {
    "type": "AdamW",
    "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.05}
  },
  "scheduler": {
    "type": "WarmupCosineLR",
    "params": {"total_num_steps": 6, "warmup_num_steps": 3, "warmup_min_ratio": 0.1,
               "cos_min_ratio": 0.1}
  },
  "gradient_clipping": 0.5,
  "bf16": {"enabled": true},
  "zero_optimization": {"stage": 2, "reduce_bucket_size": 5000, "contiguous_gradients": true},
  "data_types": {"grad_accum_dtype": "fp32"},
  "wall_clock_breakdown": false
}
"#;

/// A job that leaves what the ds_config sets to it.
fn bare_job(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("bare.yaml");
    std::fs::write(
        &p,
        format!(
            "name: bare\nmodel: {{vocab_size: 64, d_model: 32, n_layers: 2, n_heads: 4, seq_len: 32}}\ndata: {{format: synthetic}}\nrun_dir: {}/runs/bare\n",
            dir.display()
        ),
    )
    .unwrap();
    p
}

#[test]
fn a_ds_config_trains_bit_identically_to_the_job_it_maps_to() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dir.path().join("ds_config.json");
    std::fs::write(&ds, DS_CONFIG).unwrap();
    let job = bare_job(dir.path());
    let from_ds = dir.path().join("ds.jsonl");
    let f = TrainArgs::new(&job, &from_ds)
        .args(&[
            "--workers-per-node",
            "2",
            "--deepspeed",
            ds.to_str().unwrap(),
        ])
        .run(dir.path());
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(
        f.stderr.contains("ignored by design")
            && f.stderr
                .contains("zero_optimization.contiguous_gradients (line 16)"),
        "{}",
        f.stderr
    );
    // The same job written out by hand, in zrun's own keys.
    let start = 0.1 * 3e-3;
    let hand = small_job(dir.path(), "hand", 6);
    let by_hand = dir.path().join("hand.jsonl");
    let f = TrainArgs::new(&hand, &by_hand)
        .args(&["--workers-per-node", "2"])
        .set("train.micro_batch_size=4")
        .set("train.grad_accum=2")
        .set("train.lr=3e-3")
        .set("train.optimizer.betas=[0.9, 0.95]")
        .set("train.weight_decay=0.05")
        .set("train.schedule=cosine")
        .set("train.warmup_steps=3")
        .set("train.warmup_type=log")
        .set(format!("train.warmup_start_lr={start}"))
        .set(format!("train.min_lr={start}"))
        .set("train.grad_clip=0.5")
        .set("train.dtype=bf16")
        .set("train.grad_accum_dtype=f32")
        .set("zero.stage=2")
        .set("zero.reduce_bucket_size=5000")
        .run(dir.path());
    assert_eq!(f.code(), 0, "{f:?}");
    let steps = |p: &Path| -> Vec<(f64, f64)> {
        metrics(p)
            .iter()
            .filter_map(|l| Some((l.get("loss")?.as_f64()?, l.get("lr")?.as_f64()?)))
            .collect()
    };
    let (a, b) = (steps(&from_ds), steps(&by_hand));
    assert_eq!(a.len(), 6, "total_num_steps sets the run's length");
    for (s, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x.0.to_bits(), y.0.to_bits(), "loss of step {}", s + 1);
        assert_eq!(x.1.to_bits(), y.1.to_bits(), "lr of step {}", s + 1);
    }
    // DeepSpeed's log ramp from warmup_min_ratio × lr: ln(s)/ln(3) of the way.
    assert!((a[0].1 - start).abs() < 1e-12, "{a:?}");
    let want = start + (3e-3 - start) * 2f64.ln() / 3f64.ln();
    assert!((a[1].1 - want).abs() < 1e-12, "{a:?}");
    assert!(a[5].0 < a[0].0);
}

#[test]
fn check_shows_each_key_beside_its_source() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dir.path().join("ds_config.json");
    std::fs::write(&ds, DS_CONFIG).unwrap();
    let job = bare_job(dir.path());
    let f = zrun(
        dir.path(),
        &[
            "check",
            job.to_str().unwrap(),
            "--workers-per-node",
            "2",
            "--deepspeed",
            ds.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    for want in [
        "train.grad_accum",
        "= 2  ← gradient_accumulation_steps (line 3)",
        "= 0.00030000000000000003  ← scheduler.params.cos_min_ratio = 0.1 (line 12) × train.lr",
        "train.warmup_type",
        "scheduler.params.warmup_type omitted: DeepSpeed's default",
        "train_batch_size 16 (line 2) = micro-batch 4 × accumulation 2 × 2 workers",
        "= \"f32\"  ← data_types.grad_accum_dtype (line 17)",
    ] {
        assert!(f.stdout.contains(want), "missing {want:?} in\n{}", f.stdout);
    }
}

#[test]
fn a_key_zrun_cannot_honour_exits_2_at_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dir.path().join("lamb.json");
    std::fs::write(
        &ds,
        "{\n  \"train_micro_batch_size_per_gpu\": 2,\n  \"optimizer\": {\"type\": \"OneBitLamb\", \"params\": {\"lr\": 1e-3}}\n}\n",
    )
    .unwrap();
    let job = bare_job(dir.path());
    let m = dir.path().join("m.jsonl");
    let f = TrainArgs::new(&job, &m)
        .args(&["--deepspeed", ds.to_str().unwrap()])
        .run(dir.path());
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("lamb.json:3:17: optimizer.type: `OneBitLamb` cannot be honoured"),
        "{}",
        f.stderr
    );
    assert!(!m.exists(), "nothing was launched, so no metrics");
}
