//! DeepSpeed config import against real configs: the shapes published in
//! DeepSpeed's and Hugging Face's documentation and examples (the fixtures in
//! `tests/deepspeed/`), every mapped key checked in the resolved job, and
//! every refusal checked for the JSON path and line it names.

use std::path::{Path, PathBuf};

use zconfig::spec::{OffloadDevice, OptimizerKind, WarmupType};
use zconfig::{load_job, load_job_with, Dtype, LoadedJob, Schedule, ZeroStage};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/deepspeed")
        .join(name)
}

/// A job that leaves the batch, optimizer and schedule to the ds_config.
const BARE: &str = "name: ds\nmodel: {d_model: 64, n_heads: 4, n_layers: 2, seq_len: 16}\ndata: {format: synthetic}\ntrain:\n  seed: 7\n";

/// A job that plays the Hugging Face trainer's arguments for `"auto"`.
const TRAINER: &str = "name: ds\nmodel: {d_model: 64, n_heads: 4, n_layers: 2, seq_len: 16}\ndata: {format: synthetic}\ntrain:\n  steps: 30\n  micro_batch_size: 3\n  grad_accum: 2\n  lr: 5.0e-4\n  warmup_steps: 6\n  optimizer: {betas: [0.9, 0.98], eps: 1.0e-6}\n  weight_decay: 0.05\n";

struct Job {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn job(text: &str) -> Job {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.yaml");
    std::fs::write(&path, text).unwrap();
    Job { _dir: dir, path }
}

fn load(text: &str, ds: &str, world: usize) -> LoadedJob {
    let j = job(text);
    let mut loaded = load_job_with(&j.path, &[], Some(&fixture(ds))).unwrap();
    loaded.validate(world).unwrap();
    loaded
}

fn ds_error(text: &str, ds_text: &str, world: usize) -> String {
    let j = job(text);
    let ds = j._dir.path().join("ds.json");
    std::fs::write(&ds, ds_text).unwrap();
    let mut loaded = match load_job_with(&j.path, &[], Some(&ds)) {
        Ok(l) => l,
        Err(e) => return e.to_string(),
    };
    match loaded.validate(world) {
        Ok(()) => panic!("{ds_text} was accepted"),
        Err(e) => e.to_string(),
    }
}

fn ignored(job: &LoadedJob) -> Vec<String> {
    job.deepspeed()
        .unwrap()
        .ignored
        .iter()
        .map(|(k, _)| k.clone())
        .collect()
}

#[test]
fn hugging_face_zero2_takes_auto_from_the_job() {
    let j = load(TRAINER, "hf_zero2.json", 2);
    let t = &j.spec.train;
    assert_eq!((t.micro_batch_size, t.grad_accum), (3, 2));
    assert_eq!(t.lr, 5e-4);
    assert_eq!(t.optimizer.betas, [0.9, 0.98]);
    assert_eq!(t.optimizer.eps(), 1e-6);
    assert_eq!(t.weight_decay, 0.05);
    assert_eq!(
        t.grad_clip, 1.0,
        "gradient_clipping auto: the job's (default)"
    );
    // WarmupLR: the peak after warmup, on DeepSpeed's default log ramp.
    assert_eq!(t.schedule, Schedule::Constant);
    assert_eq!(t.warmup_steps, 6);
    assert_eq!(t.warmup_type, WarmupType::Log);
    assert_eq!(t.warmup_start_lr, 0.0);
    assert_eq!(t.dtype, Dtype::F32, "fp16.enabled auto: the job's dtype");
    assert_eq!(t.loss_scale.initial_scale_power, 16);
    assert_eq!(t.loss_scale.loss_scale_window, 1000);
    assert_eq!(t.loss_scale.hysteresis, 2);
    assert_eq!(t.loss_scale.min_loss_scale, 1.0);
    assert_eq!(t.log_every, 2000);
    let z = &j.spec.zero;
    assert_eq!(z.stage, ZeroStage::Gradients);
    assert!(z.overlap_comm);
    assert_eq!(z.reduce_bucket_size.0, 200_000_000);
    assert_eq!(z.offload_optimizer.device, OffloadDevice::Cpu);
    let ig = ignored(&j);
    for k in [
        "zero_optimization.allgather_partitions",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.reduce_scatter",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.offload_optimizer.pin_memory",
        "wall_clock_breakdown",
    ] {
        assert!(ig.iter().any(|i| i == k), "{k} not listed in {ig:?}");
    }
    let warning = j.deepspeed().unwrap().ignored_warning().unwrap();
    assert!(
        warning.contains("wall_clock_breakdown (line 49)"),
        "{warning}"
    );
}

#[test]
fn hugging_face_zero3_sizes_auto_buckets_from_the_hidden_size() {
    let j = load(TRAINER, "hf_zero3_offload.json", 2);
    let z = &j.spec.zero;
    assert_eq!(z.stage, ZeroStage::Weights);
    // Hugging Face's formulas for d = 64.
    assert_eq!(z.reduce_bucket_size.0, 64 * 64);
    assert_eq!(z.prefetch_bucket_size.0, 3686);
    assert_eq!(z.param_persistence_threshold.0, 640);
    assert_eq!(z.sub_group_size.0, 1_000_000_000);
    assert_eq!(z.offload_optimizer.device, OffloadDevice::Cpu);
    assert_eq!(z.offload_param.device, OffloadDevice::Cpu);
    let t = &j.spec.train;
    assert_eq!(t.schedule, Schedule::Linear, "WarmupDecayLR");
    assert_eq!(t.steps, 30, "total_num_steps auto: the job's steps");
    assert_eq!(t.min_lr, 0.0);
    assert_eq!(t.dtype, Dtype::F32);
}

#[test]
fn getting_started_derives_the_micro_batch_from_train_batch_size() {
    // train_batch_size 8, accumulation 1: 4 sequences on each of 2 workers.
    let j = load(BARE, "getting_started.json", 2);
    let t = &j.spec.train;
    assert_eq!((t.micro_batch_size, t.grad_accum), (4, 1));
    assert_eq!(t.dtype, Dtype::F16);
    assert_eq!(t.lr, 1.5e-4);
    // DeepSpeed's Adam defaults inside a written optimizer section, and no
    // clipping when gradient_clipping is absent.
    assert_eq!(t.weight_decay, 0.0);
    assert_eq!(t.optimizer.betas, [0.9, 0.999]);
    assert_eq!(t.grad_clip, 0.0);
    assert_eq!(j.spec.zero.stage, ZeroStage::OptimizerStates);
    // On 3 workers 8 sequences do not divide.
    let jb = job(BARE);
    let mut l = load_job_with(&jb.path, &[], Some(&fixture("getting_started.json"))).unwrap();
    let e = l.validate(3).unwrap_err().to_string();
    assert!(
        e.contains("getting_started.json:2:3: train_batch_size"),
        "{e}"
    );
    assert!(
        e.contains("8 is not a whole number of micro-batches"),
        "{e}"
    );
}

#[test]
fn megatron_gpt2_maps_every_written_key() {
    let j = load(BARE, "megatron_gpt2.json", 2);
    let t = &j.spec.train;
    // 16 = micro × 2 (written) × 2 workers.
    assert_eq!((t.micro_batch_size, t.grad_accum), (4, 2));
    assert_eq!(t.log_every, 1);
    assert_eq!(t.lr, 1.5e-4);
    assert_eq!(t.optimizer.betas, [0.9, 0.95]);
    assert_eq!(t.optimizer.eps(), 1e-8);
    assert_eq!(t.weight_decay, 0.01);
    assert_eq!(t.schedule, Schedule::Linear);
    assert_eq!(t.warmup_steps, 100);
    assert_eq!(t.steps, 1000, "total_num_steps");
    assert_eq!(t.warmup_type, WarmupType::Linear);
    assert_eq!((t.warmup_start_lr, t.min_lr), (0.0, 0.0));
    assert_eq!(t.grad_clip, 1.0);
    assert_eq!(t.dtype, Dtype::F16);
    assert_eq!(t.loss_scale.loss_scale_window, 500);
    assert_eq!(t.loss_scale.initial_scale_power, 12);
    assert!(t.activation_checkpointing);
    assert_eq!(j.spec.zero.stage, ZeroStage::Gradients);
    assert_eq!(j.spec.zero.reduce_bucket_size.0, 50_000_000);
    let ig = ignored(&j);
    assert!(ig.contains(&"activation_checkpointing.partition_activations".to_string()));
    assert!(ig.contains(&"activation_checkpointing.cpu_checkpointing".to_string()));
    // A key set by the ds_config is located there.
    let at = j.locate("train.warmup_steps");
    assert!(
        at.ends_with("megatron_gpt2.json:28:7 (scheduler.params.warmup_num_steps)"),
        "{at}"
    );
}

/// DeepSpeed's BERT SQuAD fine-tuning config: Adam without bias
/// correction (DeepSpeed's BERT recipes), fp16, clipping, ZeRO-1.
#[test]
fn bert_squad_trains_adam_without_bias_correction() {
    let j = load(BARE, "bert_squad.json", 2);
    let t = &j.spec.train;
    // 24 = micro 3 × 4 × 2 workers.
    assert_eq!((t.micro_batch_size, t.grad_accum), (3, 4));
    assert_eq!((t.lr, t.weight_decay, t.grad_clip), (3e-5, 0.0, 1.0));
    assert_eq!(t.optimizer.kind, OptimizerKind::Adamw);
    assert_eq!(t.optimizer.bias_correction, Some(false));
    assert!(!t.optimizer.bias_correction());
    assert_eq!(t.dtype, Dtype::F16);
    assert_eq!(j.spec.zero.stage, ZeroStage::OptimizerStates);
    let at = j.locate("train.optimizer.bias_correction");
    assert!(
        at.ends_with("bert_squad.json:10:7 (optimizer.params.bias_correction)"),
        "{at}"
    );
    // Lion keeps no moment to correct: the key is not Lion's.
    let jb = job(BARE);
    let ds = jb._dir.path().join("ds.json");
    std::fs::write(
        &ds,
        r#"{"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "bias_correction": false}}}"#,
    )
    .unwrap();
    let e = load_job_with(&jb.path, &[], Some(&ds))
        .unwrap_err()
        .to_string();
    assert!(e.contains("optimizer.params.bias_correction"), "{e}");
}

/// DeepSpeed's PLD tutorial config (BERT pre-training): gradients divided
/// by the world size before the reduction (its `gradient_predivide_factor`
/// kept but, under `prescale_gradients`, not used), Adam without bias
/// correction, f16 with a dynamic scale, progressive layer dropping.
#[test]
fn the_pld_tutorial_config_maps_every_written_key() {
    let j = load(BARE, "bert_pld.json", 2);
    let t = &j.spec.train;
    // 4096 = micro 16 × 128 × 2 workers.
    assert_eq!((t.micro_batch_size, t.grad_accum), (16, 128));
    assert!(t.prescale_gradients);
    assert_eq!(t.gradient_predivide_factor, 8.0);
    assert_eq!(t.predivide(2), 2.0);
    assert_eq!((t.lr, t.weight_decay, t.grad_clip), (1e-3, 0.01, 1.0));
    assert!(!t.optimizer.bias_correction());
    assert_eq!((t.dtype, t.loss_scale.static_scale), (Dtype::F16, None));
    let p = t.progressive_layer_drop.expect("PLD");
    assert_eq!((p.theta, p.gamma), (0.5, 0.001));
    let at = j.locate("train.gradient_predivide_factor");
    assert!(
        at.ends_with("bert_pld.json:6:3 (gradient_predivide_factor)"),
        "{at}"
    );
    // Without prescale_gradients the factor divides.
    let jb = job(BARE);
    let ds = jb._dir.path().join("ds.json");
    std::fs::write(&ds, r#"{"gradient_predivide_factor": 4.0}"#).unwrap();
    let mut l = load_job_with(&jb.path, &[], Some(&ds)).unwrap();
    l.validate(2).unwrap();
    assert_eq!(l.spec.train.predivide(2), 4.0);
    std::fs::write(&ds, r#"{"gradient_predivide_factor": 0}"#).unwrap();
    let e = load_job_with(&jb.path, &[], Some(&ds))
        .unwrap_err()
        .to_string();
    assert!(e.contains("gradient_predivide_factor"), "{e}");
}

/// `progressive_layer_drop` as DeepSpeed's PLD tutorial writes it is
/// `train.progressive_layer_drop`; omitted, gamma takes DeepSpeed's 0.001
/// and theta its 1.0; off, the section is listed as ignored; a theta
/// outside (0, 1] is refused where the ds_config wrote it.
#[test]
fn progressive_layer_drop_maps_to_train_progressive_layer_drop() {
    let jb = job(BARE);
    let ds = jb._dir.path().join("ds.json");
    let load = |text: &str| {
        std::fs::write(&ds, text).unwrap();
        load_job_with(&jb.path, &[], Some(&ds)).and_then(|mut j| j.validate(2).map(|()| j))
    };
    let j = load(r#"{"progressive_layer_drop": {"enabled": true, "theta": 0.5, "gamma": 0.001}}"#)
        .unwrap();
    let p = j.spec.train.progressive_layer_drop.expect("mapped");
    assert_eq!((p.theta, p.gamma), (0.5, 0.001));
    // The GPU's flow runs every block.
    let mut gpu = j.spec.clone();
    gpu.device = zconfig::spec::Device::Cuda;
    let why = gpu.gpu_unsupported().expect("refused on a GPU");
    assert!(why.contains("train.progressive_layer_drop"), "{why}");
    let j = load(r#"{"progressive_layer_drop": {"enabled": true}}"#).unwrap();
    let p = j.spec.train.progressive_layer_drop.expect("mapped");
    assert_eq!((p.theta, p.gamma), (1.0, 0.001));
    let j = load(r#"{"progressive_layer_drop": {"enabled": false, "theta": 0.5}}"#).unwrap();
    assert_eq!(j.spec.train.progressive_layer_drop, None);
    assert!(ignored(&j).contains(&"progressive_layer_drop".to_string()));
    let e = load("{\"progressive_layer_drop\": {\"enabled\": true,\n  \"theta\": 1.5}}")
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.progressive_layer_drop.theta"), "{e}");
    assert!(e.contains("ds.json:2:3"), "{e}");
}

#[test]
fn zero_infinity_nvme_and_aio() {
    let j = load(BARE, "infinity_nvme.json", 2);
    let z = &j.spec.zero;
    assert_eq!(z.stage, ZeroStage::Weights);
    for o in [&z.offload_optimizer, &z.offload_param] {
        assert_eq!(o.device, OffloadDevice::Nvme);
        assert_eq!(o.nvme_path.as_deref(), Some("/local_nvme"));
    }
    assert_eq!(z.offload_optimizer.buffer_count, Some(4));
    assert_eq!(z.offload_param.buffer_count, Some(5));
    assert_eq!(z.reduce_bucket_size.0, 10_000_000);
    assert_eq!(z.prefetch_bucket_size.0, 5_000_000);
    assert_eq!(z.param_persistence_threshold.0, 100_000);
    assert_eq!(z.sub_group_size.0, 100_000_000);
    let a = &j.spec.aio;
    assert_eq!(
        (a.block_size.0, a.queue_depth, a.thread_count),
        (262_144, 16, 1)
    );
    let t = &j.spec.train;
    assert_eq!(t.dtype, Dtype::Bf16);
    assert_eq!(t.optimizer.betas, [0.8, 0.999]);
    assert_eq!(t.weight_decay, 3e-7);
    assert_eq!((t.micro_batch_size, t.grad_accum), (1, 1));
    let ig = ignored(&j);
    for k in [
        "zero_optimization.offload_param.buffer_size",
        "zero_optimization.offload_param.max_in_cpu",
        "zero_optimization.offload_optimizer.fast_init",
        "aio.single_submit",
        "aio.overlap_events",
    ] {
        assert!(ig.iter().any(|i| i == k), "{k} not listed in {ig:?}");
    }
}

#[test]
fn zero_plus_plus_keys() {
    let j = load(BARE, "zeropp.json", 2);
    let z = &j.spec.zero;
    assert!(z.quantized_weights && z.quantized_gradients);
    assert_eq!(z.hpz_partition_size, 2);
    let loco = z
        .loco
        .as_ref()
        .expect("zeropp_loco_param maps to zero.loco");
    assert_eq!((loco.err_beta, loco.reset_t), (0.6, 512));
    assert_eq!(j.spec.train.micro_batch_size, 4);
}

#[test]
fn warmup_cosine_ratios_scale_the_rate() {
    let j = load(BARE, "cosine.json", 2);
    let t = &j.spec.train;
    assert_eq!(t.schedule, Schedule::Cosine);
    assert_eq!(t.lr, 0.002);
    assert!((t.warmup_start_lr - 0.0002).abs() < 1e-15);
    assert!((t.min_lr - 0.0001).abs() < 1e-15);
    assert_eq!((t.warmup_steps, t.steps), (4, 12));
    assert_eq!(t.warmup_type, WarmupType::Linear);
    assert_eq!(t.grad_clip, 0.5);
    assert_eq!(j.spec.zero.reduce_bucket_size.0, 50_000);
}

#[test]
fn a_deepspeed_key_in_the_job_reads_the_same_file() {
    let text = format!("{BARE}deepspeed: {}\n", fixture("cosine.json").display());
    let j = job(&text);
    let mut a = load_job(&j.path, &[]).unwrap();
    a.validate(2).unwrap();
    let b = load(BARE, "cosine.json", 2);
    let mut sb = b.spec.clone();
    sb.deepspeed = a.spec.deepspeed.clone();
    assert_eq!(a.spec, sb);
}

#[test]
fn set_has_the_last_word_and_the_job_keeps_implied_defaults() {
    let j = job(BARE);
    let mut l = load_job_with(
        &j.path,
        &["zero.stage=3".into(), "train.lr=1e-2".into()],
        Some(&fixture("megatron_gpt2.json")),
    )
    .unwrap();
    l.validate(2).unwrap();
    assert_eq!(l.spec.zero.stage, ZeroStage::Weights);
    assert_eq!(l.spec.train.lr, 1e-2);
    assert_eq!(l.locate("train.lr"), "--set train.lr");
    // getting_started's optimizer omits weight_decay (DeepSpeed's 0): the
    // job's written 0.2 stays.
    let j = job(&format!("{BARE}  weight_decay: 0.2\n"));
    let mut l = load_job_with(&j.path, &[], Some(&fixture("getting_started.json"))).unwrap();
    l.validate(2).unwrap();
    assert_eq!(l.spec.train.weight_decay, 0.2);
}

#[test]
fn both_files_writing_one_key_must_agree() {
    let text = format!("{BARE}  lr: 5.0e-4\n");
    let e = ds_error(
        &text,
        "{\n  \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-3}}\n}",
        2,
    );
    assert!(e.contains("ds.json:2:45: optimizer.params.lr"), "{e}");
    assert!(e.contains("sets train.lr to 0.001"), "{e}");
    assert!(e.contains("job.yaml:6:3 sets it to 0.0005"), "{e}");
    // The same value is no conflict.
    let ok = job(&text);
    let ds = ok._dir.path().join("same.json");
    std::fs::write(
        &ds,
        "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 5e-4}}}",
    )
    .unwrap();
    load_job_with(&ok.path, &[], Some(&ds)).unwrap();
}

/// DeepSpeed's `Lion` (case-blind) is `train.optimizer.type: lion`, its
/// lr, betas and weight decay mapped as Adam's are; `Adam` sets AdamW back
/// over a job that said lion.
#[test]
fn lion_maps_to_the_lion_rule() {
    let j = job(BARE);
    let ds = j._dir.path().join("ds.json");
    std::fs::write(
        &ds,
        r#"{"optimizer": {"type": "lion", "params": {"lr": 1e-4, "betas": [0.95, 0.98], "weight_decay": 0.5}}}"#,
    )
    .unwrap();
    let mut loaded = load_job_with(&j.path, &[], Some(&ds)).unwrap();
    loaded.validate(2).unwrap();
    let t = &loaded.spec.train;
    assert_eq!(t.optimizer.kind, OptimizerKind::Lion);
    assert_eq!(
        (t.lr, t.optimizer.betas, t.weight_decay),
        (1e-4, [0.95, 0.98], 0.5)
    );
    std::fs::write(
        &ds,
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}"#,
    )
    .unwrap();
    let lion_job = job(&BARE.replace("train:\n", "train:\n  optimizer: {type: lion}\n"));
    assert!(
        std::fs::read_to_string(&lion_job.path)
            .unwrap()
            .contains("type: lion"),
        "the job says lion"
    );
    let e = match load_job_with(&lion_job.path, &[], Some(&ds)) {
        Ok(mut l) => l.validate(2).map(|()| l.spec.train.optimizer.kind),
        Err(e) => Err(e),
    };
    // The two files disagree on the rule: refused as any key both write.
    let e = e.expect_err("both files set the optimizer").to_string();
    assert!(e.contains("train.optimizer.type"), "{e}");
}

/// DeepSpeed's `Adam` with `adam_w_mode: false` is PyTorch's Adam
/// (`train.optimizer.type: adam`, L2 decay); without it, or as `AdamW`
/// whatever it says, AdamW.
#[test]
fn adam_w_mode_false_maps_to_adam() {
    let j = job(BARE);
    let ds = j._dir.path().join("ds.json");
    for (kind, mode, want) in [
        ("Adam", Some(false), OptimizerKind::Adam),
        ("adam", Some(true), OptimizerKind::Adamw),
        ("Adam", None, OptimizerKind::Adamw),
        ("AdamW", Some(false), OptimizerKind::Adamw),
    ] {
        let mode = mode.map_or(String::new(), |m| format!(r#", "adam_w_mode": {m}"#));
        std::fs::write(
            &ds,
            format!(
                r#"{{"optimizer": {{"type": "{kind}", "params": {{"weight_decay": 0.01{mode}}}}}}}"#
            ),
        )
        .unwrap();
        let mut loaded = load_job_with(&j.path, &[], Some(&ds)).unwrap();
        loaded.validate(2).unwrap();
        let t = &loaded.spec.train;
        assert_eq!(
            (t.optimizer.kind, t.weight_decay),
            (want, 0.01),
            "{kind} {mode}"
        );
    }
}

/// DeepSpeed's `Adagrad` (PyTorch's Adagrad) is `train.optimizer.type:
/// adagrad`: its lr, eps, weight decay and lr_decay mapped, PyTorch's
/// defaults where unwritten (lr 1e-2, eps 1e-10, lr_decay 0, initial
/// accumulator 0; no betas), and `maximize` refused.
#[test]
fn adagrad_maps_to_the_adagrad_rule() {
    let j = job(BARE);
    let ds = j._dir.path().join("ds.json");
    let load = |text: &str| {
        std::fs::write(&ds, text).unwrap();
        let mut loaded = load_job_with(&j.path, &[], Some(&ds))?;
        loaded.validate(2)?;
        Ok::<_, zconfig::ConfigError>(loaded.spec.train)
    };
    let t = load(
        r#"{"optimizer": {"type": "Adagrad", "params": {"lr": 0.05, "eps": 1e-9, "weight_decay": 0.01, "lr_decay": 0.001, "initial_accumulator_value": 0.1}}}"#,
    )
    .unwrap();
    assert_eq!(t.optimizer.kind, OptimizerKind::Adagrad);
    let o = &t.optimizer;
    assert_eq!(
        (
            t.lr,
            o.eps(),
            t.weight_decay,
            o.lr_decay,
            o.initial_accumulator_value
        ),
        (0.05, 1e-9, 0.01, Some(0.001), Some(0.1))
    );
    let t = load(r#"{"optimizer": {"type": "adagrad"}}"#).unwrap();
    let o = &t.optimizer;
    assert_eq!(
        (
            t.lr,
            o.eps(),
            t.weight_decay,
            o.lr_decay,
            o.initial_accumulator_value
        ),
        (1e-2, 1e-10, 0.0, Some(0.0), Some(0.0))
    );
    // OneCycle's momentum cycle: Adagrad keeps no betas to cycle.
    std::fs::write(
        &ds,
        r#"{"optimizer": {"type": "Adagrad"}, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01}}}"#,
    )
    .unwrap();
    let imported = zconfig::deepspeed::read(&ds, 64).unwrap();
    assert!(
        imported
            .notes
            .iter()
            .any(|n| n.contains("does nothing to Adagrad")),
        "{:?}",
        imported.notes
    );
    assert!(
        !imported
            .mapped
            .iter()
            .any(|m| m.key == "train.optimizer.betas"),
        "betas set for Adagrad"
    );
    for (text, want) in [
        (
            r#"{"optimizer": {"type": "Adagrad", "params": {"initial_accumulator_value": -0.1}}}"#,
            "optimizer.params.initial_accumulator_value",
        ),
        (
            r#"{"optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.99]}}}"#,
            "optimizer.params.betas: unknown DeepSpeed key `betas`",
        ),
        (
            r#"{"optimizer": {"type": "Adagrad", "params": {"lr_decay": -1}}}"#,
            "optimizer.params.lr_decay",
        ),
        (
            r#"{"optimizer": {"type": "Adagrad", "params": {"maximize": true}}}"#,
            "optimizer.params.maximize: true cannot be honoured",
        ),
    ] {
        let e = load(text).expect_err(text).to_string();
        assert!(
            e.contains(want),
            "{text}
  gave: {e}
  want: {want}"
        );
    }
}

/// `communication_data_type` is `train.reduce_dtype` under DeepSpeed's
/// names. Where it is absent the job's default stands (f32), and a file
/// that trains in bf16 or fp16, where DeepSpeed reduces in that type, gets
/// a note naming the key that does the same; an f32 file does not.
#[test]
fn communication_data_type_maps_to_reduce_dtype_and_its_absence_in_16_bits_gets_a_note() {
    let j = job(BARE);
    let ds = j._dir.path().join("ds.json");
    for (text, want, noted) in [
        (
            r#"{"bf16": {"enabled": true}, "communication_data_type": "bf16"}"#,
            Some(Dtype::Bf16),
            None,
        ),
        (
            r#"{"communication_data_type": "bfloat16"}"#,
            Some(Dtype::Bf16),
            None,
        ),
        (
            r#"{"fp16": {"enabled": true}, "communication_data_type": "fp16"}"#,
            Some(Dtype::F16),
            None,
        ),
        (
            r#"{"bf16": {"enabled": true}, "communication_data_type": "fp32"}"#,
            Some(Dtype::F32),
            None,
        ),
        (r#"{"communication_data_type": null}"#, None, None),
        (
            r#"{"bf16": {"enabled": true}}"#,
            None,
            Some("reduces gradients in bf16 here"),
        ),
        (
            r#"{"fp16": {"enabled": true}}"#,
            None,
            Some("reduces gradients in fp16 here"),
        ),
        (r#"{"bf16": {"enabled": false}}"#, None, None),
    ] {
        std::fs::write(&ds, text).unwrap();
        let mut loaded = load_job_with(&j.path, &[], Some(&ds)).unwrap();
        loaded.validate(2).unwrap();
        assert_eq!(loaded.spec.train.reduce_dtype, want, "{text}");
        let notes = &loaded.deepspeed().unwrap().notes;
        let note = notes.iter().find(|n| n.contains("communication_data_type"));
        match noted {
            Some(says) => {
                let note = note.unwrap_or_else(|| panic!("{text}: no note in {notes:?}"));
                assert!(
                    note.contains(says) && note.contains("train.reduce_dtype"),
                    "{note}"
                );
            }
            None => assert!(note.is_none(), "{text}: {notes:?}"),
        }
    }
}

/// `fp16.loss_scale` above 0 is a static scale
/// (`train.loss_scale.static_scale`); 0 is dynamic scaling, the default.
/// `data_types.grad_accum_dtype` is `train.grad_accum_dtype` under
/// DeepSpeed's names. Where it is absent the job's default stands (the
/// working type), and a file that says bf16 without ZeRO (stage 0), where
/// DeepSpeed's `BF16_Optimizer` sums in fp32, gets a note saying how to
/// ask for that; no other file does.
#[test]
fn grad_accum_dtype_maps_and_stage_0_bf16_gets_a_note() {
    let j = job(BARE);
    let ds = j._dir.path().join("ds.json");
    for (text, want, noted) in [
        (
            r#"{"bf16": {"enabled": true}, "zero_optimization": {"stage": 2}, "data_types": {"grad_accum_dtype": "fp32"}}"#,
            Some(Dtype::F32),
            false,
        ),
        (
            r#"{"fp16": {"enabled": true}, "data_types": {"grad_accum_dtype": "float"}}"#,
            Some(Dtype::F32),
            false,
        ),
        (
            r#"{"bf16": {"enabled": true}, "zero_optimization": {"stage": 0}, "data_types": {"grad_accum_dtype": "bfloat16"}}"#,
            Some(Dtype::Bf16),
            false,
        ),
        (
            r#"{"bf16": {"enabled": true}, "zero_optimization": {"stage": 0}}"#,
            None,
            true,
        ),
        (
            r#"{"bf16": {"enabled": true}, "zero_optimization": {"stage": 1}}"#,
            None,
            false,
        ),
        (r#"{"bf16": {"enabled": true}}"#, None, false),
        (
            r#"{"fp16": {"enabled": true}, "zero_optimization": {"stage": 0}}"#,
            None,
            false,
        ),
    ] {
        std::fs::write(&ds, text).unwrap();
        let mut loaded = load_job_with(&j.path, &[], Some(&ds)).unwrap();
        loaded.validate(2).unwrap();
        assert_eq!(loaded.spec.train.grad_accum_dtype, want, "{text}");
        let notes = &loaded.deepspeed().unwrap().notes;
        assert_eq!(
            notes
                .iter()
                .any(|n| n.contains("BF16_Optimizer sums gradients in fp32")),
            noted,
            "{text}: {notes:?}"
        );
    }
}

#[test]
fn a_static_fp16_loss_scale_maps_to_static_scale() {
    let j = job(BARE);
    let ds = j._dir.path().join("ds.json");
    for (scale, want) in [("128", Some(128.0)), ("0", None)] {
        std::fs::write(
            &ds,
            format!(r#"{{"fp16": {{"enabled": true, "loss_scale": {scale}, "initial_scale_power": 16}}}}"#),
        )
        .unwrap();
        let mut loaded = load_job_with(&j.path, &[], Some(&ds)).unwrap();
        loaded.validate(2).unwrap();
        let t = &loaded.spec.train;
        assert_eq!(
            (t.dtype, t.loss_scale.static_scale),
            (Dtype::F16, want),
            "{scale}"
        );
    }
}

/// DeepSpeed's `Lamb` is `train.optimizer.type: lamb` with its rate,
/// betas, eps, weight decay and trust-ratio bounds; omitted, they take
/// FusedLamb's defaults (lr 1e-3, weight decay 0, bounds 0.01 and 10).
#[test]
fn lamb_maps_to_the_lamb_rule_with_its_bounds() {
    let j = job(BARE);
    let ds = j._dir.path().join("ds.json");
    std::fs::write(
        &ds,
        r#"{"optimizer": {"type": "LAMB", "params": {"lr": 1e-2, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01, "max_coeff": 5.0, "min_coeff": 0.1, "bias_correction": true}}}"#,
    )
    .unwrap();
    let mut loaded = load_job_with(&j.path, &[], Some(&ds)).unwrap();
    loaded.validate(2).unwrap();
    let t = &loaded.spec.train;
    assert_eq!(t.optimizer.kind, OptimizerKind::Lamb);
    assert_eq!(
        (t.lr, t.optimizer.betas, t.optimizer.eps(), t.weight_decay),
        (1e-2, [0.9, 0.98], 1e-6, 0.01)
    );
    assert_eq!(t.optimizer.trust_bounds(), [0.1, 5.0]);
    std::fs::write(&ds, r#"{"optimizer": {"type": "Lamb"}}"#).unwrap();
    let mut loaded = load_job_with(&j.path, &[], Some(&ds)).unwrap();
    loaded.validate(2).unwrap();
    let t = &loaded.spec.train;
    assert_eq!(
        (
            t.lr,
            t.weight_decay,
            t.optimizer.min_coeff,
            t.optimizer.max_coeff
        ),
        (1e-3, 0.0, Some(0.01), Some(10.0))
    );
}

/// DeepSpeed's `OneCycle`: its rates become `train.min_lr` and `train.lr`,
/// its shape `train.one_cycle`, its stair counts (which DeepSpeed ignores)
/// are listed as ignored; with momentum cycling β2 becomes DeepSpeed's 0.99,
/// and without it the optimizer's betas stay; the warmup is none.
#[test]
fn one_cycle_maps_its_rates_and_shape() {
    let j = job(BARE);
    let ds = j._dir.path().join("ds.json");
    std::fs::write(
        &ds,
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "betas": [0.9, 0.95]}},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 2e-3,
              "cycle_first_step_size": 30, "cycle_second_step_size": 40, "cycle_first_stair_count": 3,
              "decay_step_size": 5, "decay_lr_rate": 0.1, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95,
              "decay_mom_rate": 0.001}}}"#,
    )
    .unwrap();
    let mut loaded = load_job_with(&j.path, &[], Some(&ds)).unwrap();
    loaded.validate(2).unwrap();
    let t = &loaded.spec.train;
    assert_eq!(t.schedule, Schedule::OneCycle);
    assert_eq!((t.min_lr, t.lr, t.warmup_steps), (1e-4, 2e-3, 0));
    let c = t.one_cycle.as_ref().expect("train.one_cycle");
    assert_eq!(
        (
            c.cycle_first_step_size,
            c.cycle_second_step_size,
            c.decay_step_size
        ),
        (30, Some(40), 5)
    );
    assert_eq!(
        (
            c.decay_lr_rate,
            c.cycle_min_mom,
            c.cycle_max_mom,
            c.decay_mom_rate
        ),
        (0.1, 0.85, 0.95, 0.001)
    );
    assert!(c.cycle_momentum);
    assert_eq!(t.optimizer.betas[1], 0.99);
    assert!(ignored(&loaded)
        .iter()
        .any(|k| k == "scheduler.params.cycle_first_stair_count"));
    std::fs::write(
        &ds,
        r#"{"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1e-3,
              "cycle_momentum": false}}}"#,
    )
    .unwrap();
    let mut loaded = load_job_with(&j.path, &[], Some(&ds)).unwrap();
    loaded.validate(2).unwrap();
    let t = &loaded.spec.train;
    assert_eq!(t.optimizer.betas, [0.9, 0.95]);
    assert_eq!(
        t.one_cycle.as_ref().map(|c| c.cycle_first_step_size),
        Some(2000)
    );
}

/// DeepSpeed's `LRRangeTest`: its minimum rate becomes `train.lr`, its
/// growth `train.lr_range_test`; the optimizer's betas stay.
#[test]
fn lr_range_test_maps_its_rate_and_growth() {
    let j = job(BARE);
    let ds = j._dir.path().join("ds.json");
    std::fs::write(
        &ds,
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "betas": [0.9, 0.95]}},
            "scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-5,
              "lr_range_test_step_size": 50, "lr_range_test_step_rate": 0.5,
              "lr_range_test_staircase": true}}}"#,
    )
    .unwrap();
    let mut loaded = load_job_with(&j.path, &[], Some(&ds)).unwrap();
    loaded.validate(2).unwrap();
    let t = &loaded.spec.train;
    assert_eq!(t.schedule, Schedule::LrRangeTest);
    assert_eq!(
        (t.lr, t.warmup_steps, t.optimizer.betas),
        (1e-5, 0, [0.9, 0.95])
    );
    let c = t.lr_range_test.as_ref().expect("train.lr_range_test");
    assert_eq!((c.step_size, c.step_rate, c.staircase), (50, 0.5, true));
    std::fs::write(&ds, r#"{"scheduler": {"type": "LRRangeTest"}}"#).unwrap();
    let mut loaded = load_job_with(&j.path, &[], Some(&ds)).unwrap();
    loaded.validate(2).unwrap();
    assert_eq!(loaded.spec.train.lr, 1e-3, "DeepSpeed's default minimum");
}

#[test]
fn what_cannot_be_honoured_is_refused_where_it_is_written() {
    for (ds, want) in [
        (
            "{\n  \"optimizer\": {\n    \"type\": \"OneBitLamb\",\n    \"params\": {\"lr\": 1e-3}\n  }\n}",
            "ds.json:3:5: optimizer.type: `OneBitLamb` cannot be honoured",
        ),
        (
            "{\"optimizer\": {\"type\": \"Lamb\",\n \"params\": {\"eps_inside_sqrt\": true}}}",
            "ds.json:2:13: optimizer.params.eps_inside_sqrt: true cannot be honoured: zrun's LAMB adds eps outside",
        ),
        (
            "{\"optimizer\": {\"type\": \"Lamb\",\n \"params\": {\"max_grad_norm\": 1.0}}}",
            "ds.json:2:13: optimizer.params.max_grad_norm: 1.0 cannot be honoured: FusedLamb's own clipping",
        ),
        (
            "{\"fp16\": {\"enabled\": true,\n \"loss_scale\": -1}}",
            "ds.json:2:2: fp16.loss_scale: -1: must be a positive number",
        ),
        (
            "{\"zero_optimisation\": {\"stage\": 2}}",
            "ds.json:1:2: zero_optimisation: unknown DeepSpeed key `zero_optimisation`, did you mean `zero_optimization`?",
        ),
        (
            "{\"zero_optimization\": {\"stage\": 3,\n  \"stage3_prefetch_bucket\": 5e7}}",
            "ds.json:2:3: zero_optimization.stage3_prefetch_bucket: unknown DeepSpeed key `stage3_prefetch_bucket`, did you mean `stage3_prefetch_bucket_size`?",
        ),
        (
            "{\"zero_optimization\": {\"stage\": \"auto\"}}",
            "zero_optimization.stage: \"auto\" has no value to take here",
        ),
        (
            "{\"zero_optimization\": {\"stage\": 4}}",
            "zero_optimization.stage: 4: must be 0, 1, 2 or 3",
        ),
        (
            "{\"fp16\": {\"enabled\": true}, \"bf16\": {\"enabled\": true}}",
            "fp16 and bf16 are both enabled",
        ),
        (
            "{\"amp\": {\"enabled\": true}}",
            "amp: NVIDIA Apex AMP: use fp16 or bf16 is not something zrun does",
        ),
        (
            "{\"scheduler\": {\"type\": \"OneCycle\", \"params\": {\"cycle_max_lr\": 1e-3}}}",
            "scheduler.params.cycle_min_lr: DeepSpeed's OneCycle needs it",
        ),
        (
            "{\"scheduler\": {\"type\": \"OneCycle\", \"params\": {\"cycle_min_lr\": 1e-4,\n \"cycle_max_lr\": 1e-3, \"cycle_max_mom\": 1.5}}}",
            "train.one_cycle.cycle_max_mom: must be in [0, 1), got 1.5",
        ),
        (
            "{\"scheduler\": {\"type\": \"OneCycle\", \"params\": {\"cycle_min_lr\": 1e-4,\n \"cycle_max_lr\": 1e-3, \"cycle_stair_count\": 2}}}",
            "ds.json:2:24: scheduler.params.cycle_stair_count: unknown DeepSpeed key",
        ),
        (
            "{\"scheduler\": {\"type\": \"OneCyclic\", \"params\": {}}}",
            "scheduler.type: `OneCyclic` cannot be honoured",
        ),
        (
            "{\"scheduler\": {\"type\": \"LRRangeTest\", \"params\": {\"lr_range_test_step_size\": 0}}}",
            "scheduler.params.lr_range_test_step_size",
        ),
        (
            "{\"activation_checkpointing\": {\"cpu_checkpointing\": true}}",
            "activation_checkpointing.cpu_checkpointing: true cannot be honoured",
        ),
        (
            "{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"cpu\", \"ratio\": 0.3}}}",
            "zero_optimization.offload_optimizer.ratio: 0.3 cannot be honoured: a partial offload",
        ),
        (
            "{\"prescale_gradients\": 1}",
            "prescale_gradients: 1: must be true or false",
        ),
        (
            "{\"data_types\": {\"grad_accum_dtype\": \"int8\"}}",
            "ds.json:1:17: data_types.grad_accum_dtype: \"int8\": must be \"fp32\", \"bf16\" or \"fp16\"",
        ),
        (
            "{\"bf16\": {\"enabled\": true},\n \"data_types\": {\"grad_accum_dtype\": \"fp16\"}}",
            "ds.json:2:17 (data_types.grad_accum_dtype): train.grad_accum_dtype: must be f32 or train.dtype (bf16)",
        ),
        (
            "{\"communication_data_type\": \"int8\"}",
            "ds.json:1:2: communication_data_type: \"int8\": must be \"fp32\", \"bf16\" or \"fp16\"",
        ),
        (
            "{\"bf16\": {\"enabled\": true},\n \"communication_data_type\": \"fp16\"}",
            "ds.json:2:2 (communication_data_type): train.reduce_dtype: f16 needs train.dtype: f16",
        ),
        (
            "{\"data_types\": {\"grad_acum_dtype\": \"fp32\"}}",
            "unknown DeepSpeed key `grad_acum_dtype`, did you mean `grad_accum_dtype`?",
        ),
        (
            "{\"scheduler\": {\"type\": \"WarmupLR\", \"params\": {\"warmup_num_steps\": 1e30}}}",
            "scheduler.params.warmup_num_steps: must be a whole number of steps",
        ),
        (
            "{\"optimizer\": {\"type\": \"Lion\",\n \"params\": {\"lr\": 1e-4, \"eps\": 1e-8}}}",
            "ds.json:2:25: optimizer.params.eps: unknown DeepSpeed key `eps`",
        ),
        (
            "{\"tensor_parallel\": {\"autotp_size\": 2}}",
            "ds.json:1:22: tensor_parallel.autotp_size: 2: tensor parallelism is not something zrun does",
        ),
        (
            "{\"tensor_parallel\": {\"tp\": {\"tp_size\": 4}}}",
            "tensor_parallel.tp.tp_size: 4: tensor parallelism is not something zrun does",
        ),
        (
            "{\"eigenvalue\": {\"enabled\": true, \"verbose\": true}}",
            "eigenvalue: eigenvalue-based MoQ is not something zrun does",
        ),
        (
            "{\"weight_quantization\": {\"post_init_quant\": {}}}",
            "weight_quantization: weight quantization at initialisation is not something zrun does",
        ),
        (
            "{\"zero_optimization\": {\"stage\": 3, \"zero_quantized_gradients\": true,\n \"zeropp_loco_param\": {\"err_beta\": 0.8}}}",
            "ds.json:2:2: zero_optimization.zeropp_loco_param: needs `reset_T` (DeepSpeed reads both",
        ),
        (
            "{\"zero_optimization\": {\"stage\": 3, \"zeropp_loco_param\": {\"err_beta\": 1,\n \"reset_T\": 8}}}",
            "zero_optimization.zeropp_loco_param.err_beta: 1: must be a number at least 0 and below 1",
        ),
        (
            "{\"zero_optimization\": {\"stage\": 3, \"zeropp_loco_param\": {\"err_beta\": 0.5,\n \"reset_T\": 8}}}",
            "zero.loco: needs zero.quantized_gradients: true",
        ),
        (
            "{\"zero_optimization\": {\"stage\": 3, \"stage3_prefetch_bucket_size\": 100,\n \"prefetch_bucket_size\": 200}}",
            "ds.json:2:2: zero_optimization.prefetch_bucket_size: `stage3_prefetch_bucket_size` says the same: write one of the two",
        ),
        (
            "{\"zero_optimization\": {\"stage\": 3, \"param_persistence_threshold\": \"auto\"}}",
            "zero_optimization.param_persistence_threshold: \"auto\" has no value to take here",
        ),
        (
            "{\"zero_optimization\": {\"cpu_offload_param\": true}}",
            "zero_optimization.cpu_offload_param: true cannot be honoured: the old spelling of offload_param",
        ),
        ("{\"train_batch_size\": 8,\n", "ds.json:2:1: not a DeepSpeed config (JSON)"),
        ("[1, 2]", "a DeepSpeed config is a JSON object"),
    ] {
        let e = ds_error(BARE, ds, 2);
        assert!(e.contains(want), "{ds}\n  gave: {e}\n  want: {want}");
    }
}

/// DeepSpeed's rarer and newer keys (its `runtime/config.py` and
/// `zero/config.py`, 0.16-0.17): those that change nothing a zrun job
/// computes are listed as ignored, DeepSpeed's field names for the stage-3
/// sizes are read as their `stage3_` aliases are, and features zrun lacks
/// load only while off (the refusals are in the test above).
#[test]
fn rarer_keys_are_read_ignored_or_held_to_off() {
    let ds = r#"{
      "compile": {"deepcompile": true, "offload_activation": false},
      "graph_harvesting": true,
      "pipeline": {"stages": "auto", "partition": "best"},
      "dataloader_drop_last": true,
      "seq_parallel_communication_data_type": "bf16",
      "use_data_before_expert_parallelism": false,
      "tensor_parallel": {"autotp_size": 1, "tp": {"tp_size": 1}},
      "progressive_layer_drop": {"enabled": false, "theta": 0.5, "gamma": 0.001},
      "quantize_training": {"enabled": false},
      "eigenvalue": {"enabled": false},
      "hybrid_engine": {"enabled": false},
      "nebula": {"enabled": false},
      "zero_optimization": {
        "stage": 3,
        "prefetch_bucket_size": 1000,
        "param_persistence_threshold": 10,
        "max_live_parameters": 1e9,
        "max_reuse_distance": 1e9,
        "model_persistence_threshold": 1e12,
        "stage3_module_granularity_threshold": 0,
        "use_all_reduce_for_fetch_params": true,
        "cpu_offload_use_pin_memory": true,
        "cpu_offload_param": false,
        "pipeline_loading_checkpoint": false,
        "override_module_apply": true,
        "log_trace_cache_warnings": false,
        "mics_hierarchical_params_gather": false,
        "zeropp_loco_param": null
      }
    }"#;
    let j = job(BARE);
    let path = j._dir.path().join("ds.json");
    std::fs::write(&path, ds).unwrap();
    let mut loaded = load_job_with(&j.path, &[], Some(&path)).unwrap();
    loaded.validate(2).unwrap();
    assert_eq!(loaded.spec.zero.prefetch_bucket_size.0, 1000);
    assert_eq!(loaded.spec.zero.param_persistence_threshold.0, 10);
    let ignored = ignored(&loaded);
    for key in [
        "compile",
        "graph_harvesting",
        "pipeline",
        "dataloader_drop_last",
        "seq_parallel_communication_data_type",
        "use_data_before_expert_parallelism",
        "tensor_parallel",
        "progressive_layer_drop",
        "quantize_training",
        "eigenvalue",
        "hybrid_engine",
        "nebula",
        "zero_optimization.max_live_parameters",
        "zero_optimization.model_persistence_threshold",
        "zero_optimization.stage3_module_granularity_threshold",
        "zero_optimization.use_all_reduce_for_fetch_params",
        "zero_optimization.cpu_offload_param",
    ] {
        assert!(ignored.iter().any(|k| k == key), "{key} not in {ignored:?}");
    }
    assert!(
        !ignored.iter().any(|k| k.ends_with("prefetch_bucket_size")),
        "read, not ignored: {ignored:?}"
    );
}

#[test]
fn train_batch_size_must_add_up() {
    // Micro-batch and accumulation both chosen: DeepSpeed's check.
    let text = format!("{BARE}  micro_batch_size: 3\n  grad_accum: 2\n");
    let e = ds_error(&text, "{\"train_batch_size\": 16}", 2);
    assert!(
        e.contains("16 ≠ micro-batch 3 × gradient accumulation 2 × 2 workers = 12"),
        "{e}"
    );
    // Only the micro-batch chosen: accumulation follows.
    let j = job(&format!("{BARE}  micro_batch_size: 2\n"));
    let ds = j._dir.path().join("tb.json");
    std::fs::write(&ds, "{\"train_batch_size\": 16}").unwrap();
    let mut l = load_job_with(&j.path, &[], Some(&ds)).unwrap();
    l.validate(2).unwrap();
    assert_eq!(
        (l.spec.train.micro_batch_size, l.spec.train.grad_accum),
        (2, 4)
    );
    // The same file on 4 workers settles again.
    l.validate(4).unwrap();
    assert_eq!(
        (l.spec.train.micro_batch_size, l.spec.train.grad_accum),
        (2, 2)
    );
}

/// Every key zrun reads from a ds_config, set to values of every kind
/// (negative, zero, fractional, past u64 and past f64, strings, `"auto"`,
/// booleans, null, lists, objects): the job loads and validates, or it is
/// refused naming the key's file, line and path; never a panic. The campaign
/// this was written from (the seventieth session, 1,564 configs through
/// `zrun check`) found one value taken wrongly: a `warmup_num_steps` past
/// u64 became u64::MAX steps of warmup.
#[test]
fn every_value_of_every_key_loads_or_is_refused_naming_it() {
    let values = [
        "-1",
        "0",
        "1",
        "0.5",
        "3.7",
        "1e30",
        "1e400",
        "-1e400",
        "18446744073709551616",
        "\"x\"",
        "\"auto\"",
        "\"1e3\"",
        "true",
        "false",
        "null",
        "[]",
        "[1, 2]",
        "{}",
        "-0.0",
        "1e-50",
    ];
    // (the key's path, the JSON around it with VALUE where it goes)
    let mut keys: Vec<(String, String)> = Vec::new();
    let mut key = |path: &str, template: &str| keys.push((path.into(), template.into()));
    for k in [
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "steps_per_print",
        "gradient_clipping",
        "prescale_gradients",
        "gradient_predivide_factor",
        "communication_data_type",
        "amp",
        "tensor_parallel",
        "progressive_layer_drop",
        "weight_quantization",
    ] {
        key(k, &format!("{{\"{k}\": VALUE}}"));
    }
    key(
        "tensor_parallel.autotp_size",
        "{\"tensor_parallel\": {\"autotp_size\": VALUE}}",
    );
    key("elasticity", "{\"elasticity\": VALUE}");
    for k in [
        "enabled",
        "max_train_batch_size",
        "micro_batch_sizes",
        "min_gpus",
        "max_gpus",
        "version",
        "prefer_larger_batch",
        "ignore_non_elastic_batch_info",
        "num_gpus_per_node",
        "model_parallel_size",
    ] {
        let mut fields = vec![
            ("enabled", "true"),
            ("max_train_batch_size", "64"),
            ("micro_batch_sizes", "[2, 4]"),
        ];
        fields.retain(|(f, _)| *f != k);
        fields.push((k, "VALUE"));
        let body: Vec<String> = fields
            .iter()
            .map(|(f, v)| format!("\"{f}\": {v}"))
            .collect();
        key(
            &format!("elasticity.{k}"),
            &format!("{{\"elasticity\": {{{}}}}}", body.join(", ")),
        );
    }
    key(
        "tensor_parallel.tp.tp_size",
        "{\"tensor_parallel\": {\"tp\": {\"tp_size\": VALUE}}}",
    );
    for k in [
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "adam_w_mode",
        "amsgrad",
    ] {
        let t =
            format!("{{\"optimizer\": {{\"type\": \"AdamW\", \"params\": {{\"{k}\": VALUE}}}}}}");
        key(&format!("optimizer.params.{k}"), &t);
    }
    key("optimizer.type", "{\"optimizer\": {\"type\": VALUE}}");
    key("scheduler.type", "{\"scheduler\": {\"type\": VALUE}}");
    for (sched, params) in [
        (
            "WarmupLR",
            &[
                "warmup_min_lr",
                "warmup_max_lr",
                "warmup_num_steps",
                "warmup_type",
            ][..],
        ),
        (
            "WarmupDecayLR",
            &[
                "warmup_min_lr",
                "warmup_max_lr",
                "warmup_num_steps",
                "total_num_steps",
            ][..],
        ),
        (
            "WarmupCosineLR",
            &[
                "warmup_min_ratio",
                "cos_min_ratio",
                "warmup_num_steps",
                "total_num_steps",
            ][..],
        ),
    ] {
        for k in params {
            let t = format!(
                "{{\"scheduler\": {{\"type\": \"{sched}\", \"params\": {{\"{k}\": VALUE}}}}}}"
            );
            key(&format!("scheduler.params.{k}"), &t);
        }
    }
    key("fp16.enabled", "{\"fp16\": {\"enabled\": VALUE}}");
    for k in [
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "min_loss_scale",
    ] {
        key(
            &format!("fp16.{k}"),
            &format!("{{\"fp16\": {{\"enabled\": true, \"{k}\": VALUE}}}}"),
        );
    }
    key("bf16.enabled", "{\"bf16\": {\"enabled\": VALUE}}");
    key(
        "zero_optimization.stage",
        "{\"zero_optimization\": {\"stage\": VALUE}}",
    );
    for k in [
        "overlap_comm",
        "reduce_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "prefetch_bucket_size",
        "param_persistence_threshold",
        "zeropp_loco_param",
        "cpu_offload_param",
        "sub_group_size",
        "zero_quantized_weights",
        "zero_hpz_partition_size",
        "zero_quantized_gradients",
        "offload_optimizer",
        "offload_param",
    ] {
        let t = format!("{{\"zero_optimization\": {{\"stage\": 3, \"{k}\": VALUE}}}}");
        key(&format!("zero_optimization.{k}"), &t);
    }
    for section in ["offload_optimizer", "offload_param"] {
        for k in ["device", "buffer_count", "ratio"] {
            let t = format!("{{\"zero_optimization\": {{\"stage\": 3, \"{section}\": {{\"device\": \"cpu\", \"{k}\": VALUE}}}}}}");
            key(&format!("zero_optimization.{section}.{k}"), &t);
        }
    }
    for k in [
        "block_size",
        "queue_depth",
        "thread_count",
        "intra_op_parallelism",
    ] {
        key(
            &format!("aio.{k}"),
            &format!("{{\"aio\": {{\"{k}\": VALUE}}}}"),
        );
    }
    for section in [
        "optimizer",
        "scheduler",
        "fp16",
        "bf16",
        "zero_optimization",
        "aio",
    ] {
        key(section, &format!("{{\"{section}\": VALUE}}"));
    }
    let (mut loaded, mut refused) = (0, 0);
    for (path, template) in &keys {
        for value in values {
            let text = template.replace("VALUE", value);
            let j = job(BARE);
            let ds = j._dir.path().join("ds.json");
            std::fs::write(&ds, &text).unwrap();
            let result = load_job_with(&j.path, &[], Some(&ds)).and_then(|mut l| l.validate(2));
            let Err(e) = result else {
                loaded += 1;
                continue;
            };
            refused += 1;
            let e = e.to_string();
            // Refused at the file and the key (or, for a value no key of its
            // section can take, at the section; for a batch size that does
            // not add up, at the sizes; for a number JSON cannot hold, where
            // the parser stopped).
            let section = path.split('.').next().unwrap();
            let named = e.contains(path.as_str())
                || e.contains(section)
                || e.contains("batch")
                || e.contains("number out of range");
            assert!(e.contains("ds.json") && named, "{text}\n  gave: {e}");
        }
    }
    // Both outcomes happen: a check that refused everything, or nothing,
    // would pass the loop above.
    assert!(
        loaded > 100 && refused > 500,
        "{loaded} loaded, {refused} refused"
    );
}

/// The legacy `curriculum_learning` section: enabled on the sequence
/// length, its keys (the schedule's under `schedule_config`) become
/// `train.curriculum`'s; off, it is listed as ignored; a curriculum on
/// anything but the length, a `custom` schedule and a missing required key
/// are refused at their line.
#[test]
fn curriculum_learning_maps_to_the_sequence_length_curriculum() {
    let section = |body: &str| format!("{{\"curriculum_learning\": {{{body}}}}}");
    let j = job(BARE);
    let ds = j._dir.path().join("ds.json");
    std::fs::write(
        &ds,
        section(
            "\"enabled\": true, \"curriculum_type\": \"seqlen\", \"min_difficulty\": 4,\n\
             \"max_difficulty\": 16, \"schedule_type\": \"fixed_root\",\n\
             \"schedule_config\": {\"total_curriculum_step\": 9, \"difficulty_step\": 2, \"root_degree\": 2}",
        ),
    )
    .unwrap();
    let mut loaded = load_job_with(&j.path, &[], Some(&ds)).unwrap();
    loaded.validate(1).unwrap();
    let c = loaded.spec.train.curriculum.clone().expect("a curriculum");
    assert_eq!(
        c.schedule_type,
        zconfig::curriculum::CurriculumSchedule::FixedRoot
    );
    assert_eq!(
        (c.min_difficulty, c.max_difficulty, c.total_curriculum_step),
        (4, Some(16), Some(9))
    );
    assert_eq!((c.difficulty_step, c.root_degree), (Some(2), Some(2.0)));
    std::fs::write(&ds, section("\"enabled\": false, \"min_difficulty\": 4")).unwrap();
    let mut off = load_job_with(&j.path, &[], Some(&ds)).unwrap();
    off.validate(1).unwrap();
    assert!(off.spec.train.curriculum.is_none());
    assert!(ignored(&off).contains(&"curriculum_learning".to_string()));
    let on = "\"enabled\": true, \"min_difficulty\": 4, \"max_difficulty\": 16";
    for (body, want) in [
        (format!("{on}, \"curriculum_type\": \"vocabularyrarity\", \"schedule_type\": \"fixed_linear\""), "ds.json:1:86: curriculum_learning.curriculum_type: \"vocabularyrarity\": zrun's curriculum is on the sequence length"),
        (format!("{on}, \"curriculum_type\": \"seqlen\", \"schedule_type\": \"custom\""), "curriculum_learning.schedule_type: custom is a Python function"),
        ("\"enabled\": true, \"curriculum_type\": \"seqlen\", \"max_difficulty\": 16, \"schedule_type\": \"fixed_linear\"".to_string(), "curriculum_learning: needs min_difficulty"),
        (format!("{on}, \"curriculum_type\": \"seqlen\", \"schedule_type\": \"fixed_linear\", \"schedule_config\": {{\"total_step\": 3}}"), "curriculum_learning.schedule_config.total_step"),
    ] {
        let e = ds_error(BARE, &section(&body), 1);
        assert!(e.contains(want), "{body}: {e}");
    }
}

/// DeepSpeed's `elasticity`: the batch DeepSpeed's arithmetic gives
/// (computed by its own `elasticity.py`), settled for each world size: at
/// version 0.1, 2, 3, 4 and 7 workers share 1680 sequences (micro-batches
/// 6, 4, 6, 6), 9 workers are refused naming the counts that run it; at
/// version 0.2 (DeepSpeed's default) 9 workers get a batch of their own,
/// 1998. The batch keys are refused beside it unless
/// `ignore_non_elastic_batch_info` says to ignore them (then listed as
/// ignored), and a micro-batch the job chose must be elasticity's.
#[test]
fn elasticity_settles_the_batch_for_each_world_size() {
    let ds = |version: &str, extra: &str| {
        format!(
            "{{\"elasticity\": {{\"enabled\": true, \"max_train_batch_size\": 2000,\n \"micro_batch_sizes\": [2, 4, 6], \"min_gpus\": 1, \"max_gpus\": 10000, \"min_time\": 20{version}}}{extra}}}"
        )
    };
    let settled = |ds_text: &str, text: &str, world: usize| {
        let j = job(text);
        let path = j._dir.path().join("ds.json");
        std::fs::write(&path, ds_text).unwrap();
        let mut loaded = load_job_with(&j.path, &[], Some(&path)).unwrap();
        loaded.validate(world).unwrap();
        let t = &loaded.spec.train;
        (t.micro_batch_size, t.grad_accum, ignored(&loaded))
    };
    let v01 = ds(", \"version\": 0.1", "");
    for (world, micro, accum) in [(2, 6, 140), (3, 4, 140), (4, 6, 70), (7, 6, 40)] {
        let (m, a, _) = settled(&v01, BARE, world);
        assert_eq!((m, a), (micro, accum), "{world} workers");
        assert_eq!(m * a * world, 1680);
    }
    let e = ds_error(BARE, &v01, 9);
    assert!(
        e.contains(
            "ds.json:1:2: elasticity: its batch of 1680 runs on 1, 2, 3, 4, 5, 6, 7, 8, 10,"
        ) && e.contains("not on 9"),
        "{e}"
    );
    let v02 = ds("", "");
    assert_eq!(settled(&v02, BARE, 9).0, 6);
    assert_eq!(settled(&v02, BARE, 9).1, 37);
    assert_eq!(settled(&v02, BARE, 2).1, 140);
    let with_batch = ds("", ",\n \"train_batch_size\": 64");
    let e = ds_error(BARE, &with_batch, 2);
    assert!(
        e.contains("ds.json:3:2: train_batch_size: elasticity sets the batch"),
        "{e}"
    );
    let ignoring = ds(
        ", \"ignore_non_elastic_batch_info\": true",
        ",\n \"train_batch_size\": 64",
    );
    let (m, a, ignored) = settled(&ignoring, BARE, 2);
    assert_eq!((m, a), (6, 140));
    assert!(
        ignored.iter().any(|k| k == "train_batch_size"),
        "{ignored:?}"
    );
    let chosen = format!("{BARE}  micro_batch_size: 4\n");
    let e = ds_error(&chosen, &v02, 2);
    assert!(
        e.contains("train.micro_batch_size: 4, where the ds_config's elasticity settles 6"),
        "{e}"
    );
    for (bad, want) in [
        (
            "{\"elasticity\": {\"enabled\": true, \"micro_batch_sizes\": [2]}}",
            "elasticity: needs `max_train_batch_size`",
        ),
        (
            "{\"elasticity\": {\"enabled\": true, \"max_train_batch_size\": 8, \"micro_batch_sizes\": [2, 0.5]}}",
            "elasticity.micro_batch_sizes: must be a list of whole numbers",
        ),
        (
            "{\"elasticity\": {\"enabled\": true, \"max_train_batch_size\": 8, \"micro_batch_sizes\": [16]}}",
            "elasticity.micro_batch_sizes: 16 is above the largest batch, 8",
        ),
        (
            "{\"elasticity\": {\"enabled\": true, \"max_train_batch_size\": 8, \"micro_batch_sizes\": [2], \"version\": 0.3}}",
            "elasticity.version: 0.3: DeepSpeed's elasticity has versions 0.1 and 0.2",
        ),
        (
            "{\"elasticity\": {\"enabled\": true, \"max_train_batch_size\": 8, \"micro_batch_sizes\": [2], \"model_parallel_size\": 2}}",
            "elasticity.model_parallel_size: 2 cannot be honoured: model parallelism",
        ),
        (
            "{\"elasticity\": {\"enabled\": true, \"max_train_batch_size\": 8, \"micro_batch_sizes\": [2], \"min_gpus\": 4, \"max_gpus\": 2}}",
            "elasticity.max_gpus: 2 is below min_gpus 4",
        ),
    ] {
        let e = ds_error(BARE, bad, 2);
        assert!(e.contains(want), "{bad}\n  gave: {e}\n  want: {want}");
    }
    // Disabled: ignored, and the batch keys apply.
    let off = "{\"elasticity\": {\"enabled\": false}, \"train_micro_batch_size_per_gpu\": 3}";
    let (m, _, ignored) = settled(off, BARE, 2);
    assert_eq!(m, 3);
    assert!(ignored.iter().any(|k| k == "elasticity"), "{ignored:?}");
}
