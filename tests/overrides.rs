//! Random overrides of a job, as a user might combine or mistype them: each
//! run trains (exit 0) or is refused before anything starts (exit 2, naming a
//! key it set, leaving no metrics behind); never a panic, a hang or another
//! exit code. Values come from each key's own kind (sizes, rates, choices,
//! paths) and from a list of wrong ones (negative, fractional, out of range,
//! wrong type). The seed is fixed, so a failure reproduces; every failing
//! case is printed whole.

use std::path::Path;
use std::time::Duration;

use e2e::{metrics, small_job, Zrun};

/// Each key with values of its own kind, right and wrong.
const KEYS: &[(&str, &[&str])] = &[
    ("aio.block_size", &["4096", "1048576", "512", "0", "3"]),
    ("aio.queue_depth", &["1", "8", "0", "64"]),
    ("aio.thread_count", &["1", "2", "0"]),
    ("comm.backend", &["tcp", "shm", "auto", "mpi", "nccl"]),
    ("comm.timeout_s", &["1", "0", "0.1", "30"]),
    ("comm.heartbeat_s", &["1", "0", "0.1", "30"]),
    (
        "model.d_model",
        &["16", "32", "48", "64", "0", "1", "16777217"],
    ),
    ("model.ffn_hidden", &["64", "100", "0", "1"]),
    ("model.kind", &["gpt", "llama"]),
    ("model.n_heads", &["1", "2", "4", "3", "0"]),
    ("model.n_kv_heads", &["1", "2", "4", "3"]),
    (
        "model.n_layers",
        &["1", "2", "0", "3", "65537", "4294967297"],
    ),
    ("model.norm_eps", &["1e-5", "0", "1", "1e39"]),
    ("model.rope_theta", &["10000", "1", "0"]),
    (
        "model.seq_len",
        &["1", "2", "16", "31", "32", "33", "99999999999"],
    ),
    ("model.tie_embeddings", &["true", "false"]),
    ("model.qkv_bias", &["true", "false"]),
    ("model.qk_norm", &["true", "false"]),
    ("model.head_dim", &["4", "8", "12", "3", "0"]),
    (
        "model.hidden_dropout",
        &["0", "0.1", "0.99", "1", "-0.1", "nan"],
    ),
    ("model.attention_dropout", &["0", "0.1", "0.5", "1", "2"]),
    ("train.early_stopping.patience", &["1", "0", "3"]),
    (
        "train.freeze",
        &[
            "[wte.weight]",
            "[\"h.{0-0}.*\"]",
            "[\"*norm*\"]",
            "[nothing]",
            "wte.weight",
        ],
    ),
    ("train.label_smoothing", &["0", "0.1", "1", "-0.5"]),
    ("train.warmup_ratio", &["0", "0.1", "1", "2"]),
    ("train.epochs", &["0.01", "1", "0", "-1"]),
    ("train.neftune_noise_alpha", &["0", "5", "-1"]),
    ("model.tile_size", &["1", "256", "1000", "0"]),
    ("model.vocab_size", &["64", "63", "256", "1"]),
    ("train.activation_checkpointing", &["true", "false"]),
    ("train.decay_fraction", &["0", "0.5", "1"]),
    ("train.dtype", &["f32", "bf16", "f16"]),
    ("train.grad_accum_dtype", &["f32", "bf16", "f16"]),
    ("train.reduce_dtype", &["f32", "bf16", "f16"]),
    ("train.eval_every", &["0", "1", "2", "epoch"]),
    ("train.eval_steps", &["0", "1", "3"]),
    ("train.grad_accum", &["1", "2", "3", "0"]),
    ("train.grad_clip", &["0", "1", "1e-6"]),
    ("train.log_every", &["1", "2", "0"]),
    ("train.lr", &["0", "1e-3", "1e-2", "1e39"]),
    ("train.micro_batch_size", &["1", "2", "3", "0"]),
    ("train.min_lr", &["0", "1e-4", "1"]),
    (
        "train.optimizer.betas",
        &["[0.9, 0.95]", "[0, 0]", "[1, 1]", "[0.9]"],
    ),
    ("train.optimizer.eps", &["1e-8", "0", "1", "1e-50"]),
    (
        "train.optimizer.type",
        &["adamw", "adam", "lion", "lamb", "adagrad", "sgd"],
    ),
    ("train.optimizer.lr_decay", &["0", "0.1", "-1"]),
    ("train.optimizer.min_coeff", &["0.01", "0.5", "0", "20"]),
    ("train.optimizer.max_coeff", &["10", "1", "0.001"]),
    (
        "train.schedule",
        &[
            "cosine",
            "wsd",
            "linear",
            "constant",
            "cosine_with_restarts",
            "polynomial",
            "inverse_sqrt",
            "one_cycle",
            "lr_range_test",
            "reduce_lr_on_plateau",
        ],
    ),
    ("train.plateau.factor", &["0.5", "0.1", "1", "0"]),
    ("train.plateau.patience", &["0", "3"]),
    ("train.lr_range_test.step_size", &["1", "100", "0"]),
    ("train.lr_range_test.staircase", &["true", "false", "2"]),
    ("train.one_cycle.cycle_first_step_size", &["1", "3", "0"]),
    ("train.one_cycle.decay_mom_rate", &["0", "0.5", "-1"]),
    ("train.num_cycles", &["1", "3", "0"]),
    ("train.power", &["1", "0.5", "0", "-1"]),
    ("train.timescale", &["1", "1000", "0"]),
    ("train.seed", &["0", "1", "18446744073709551615"]),
    ("train.steps", &["1", "2", "3", "0"]),
    ("train.warmup_start_lr", &["0", "1e-4"]),
    ("train.warmup_steps", &["0", "1", "100"]),
    ("train.warmup_type", &["linear", "log"]),
    ("train.weight_decay", &["0", "0.1", "1"]),
    ("train.loss_scale.initial_scale_power", &["0", "16", "200"]),
    ("train.loss_scale.hysteresis", &["1", "2", "0"]),
    ("train.loss_scale.loss_scale_window", &["1", "1000", "0"]),
    ("train.loss_scale.min_loss_scale", &["1", "0", "1e-9"]),
    ("train.loss_scale.static_scale", &["128", "1", "0", "1e40"]),
    ("zero.stage", &["0", "1", "2", "3"]),
    ("zero.hpz_partition_size", &["1", "2", "3"]),
    ("zero.offload_optimizer.device", &["none", "cpu", "nvme"]),
    ("zero.offload_param.device", &["none", "cpu", "nvme"]),
    ("zero.offload_optimizer.buffer_count", &["1", "4", "0"]),
    ("zero.offload_param.buffer_count", &["1", "5", "0"]),
    ("zero.overlap_comm", &["true", "false"]),
    ("zero.param_persistence_threshold", &["0", "100", "100000"]),
    ("zero.prefetch_bucket_size", &["0", "1", "1000", "1e9"]),
    ("zero.quantization.block_size", &["1", "32", "100", "2048"]),
    ("zero.quantization.gradient_bits", &["4", "8", "2"]),
    ("zero.quantization.weight_bits", &["4", "8", "2"]),
    ("zero.quantized_gradients", &["true", "false"]),
    ("zero.quantized_weights", &["true", "false"]),
    ("zero.reduce_bucket_size", &["1", "1000", "1e9", "0"]),
    ("zero.sub_group_size", &["1", "1000", "1e9", "0"]),
    ("data.val_fraction", &["0", "0.1", "0.5", "1"]),
    ("data.format", &["synthetic", "text", "tokens", "csv"]),
    ("checkpoint.every", &["0", "1", "5", "epoch"]),
    ("checkpoint.keep", &["0", "1", "2"]),
    ("device", &["cpu", "cuda", "tpu"]),
    ("name", &["x", "\"\"", "a/b"]),
];

/// Values of the wrong kind for any key.
const WRONG: &[&str] = &[
    "-1", "abc", "1e400", ".nan", "[1]", "{a: 1}", "\"\"", "null", "true", "0.5",
];

/// splitmix64: a fixed stream of cases from a seed.
struct Cases(u64);

impl Cases {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// 1 to 4 `KEY=VALUE` overrides (a wrong-kind value one time in
    /// `wrong_one_in`; never with 0), and the keys they set.
    fn overrides(&mut self, wrong_one_in: usize, swap: &Path) -> (Vec<String>, Vec<&'static str>) {
        let (mut sets, mut keys) = (Vec::new(), Vec::new());
        for _ in 0..1 + self.below(4) {
            let (key, values) = KEYS[self.below(KEYS.len())];
            let value = if wrong_one_in > 0 && self.below(wrong_one_in) == 0 {
                WRONG[self.below(WRONG.len())]
            } else {
                values[self.below(values.len())]
            };
            sets.extend(assignments(key, value, swap));
            keys.push(key);
        }
        (sets, keys)
    }
}

/// `KEY=VALUE`, and where the value offloads to NVMe, where its swap files go.
fn assignments(key: &str, value: &str, swap: &Path) -> Vec<String> {
    let mut sets = vec![format!("{key}={value}")];
    if value == "nvme" {
        let path = key.replace(".device", ".nvme_path");
        sets.push(format!("{path}={}", swap.display()));
    }
    sets
}

/// What a refused case must show: exit 2, a message naming one of the keys
/// it set (the one at fault, or the one a rule ties it to), and no panic.
fn refused_clearly(out: &e2e::Finished, keys: &[&str]) -> bool {
    out.code() == 2
        && !out.stderr.contains("panicked")
        && out.stderr.contains("zrun: error:")
        && keys
            .iter()
            .any(|k| out.stderr.contains(k) || named_by_rule(k, &out.stderr))
}

/// Keys whose error names the key a rule ties them to: a model's width
/// against its heads, and the heads against the width.
fn named_by_rule(key: &str, stderr: &str) -> bool {
    match key {
        "model.d_model" => stderr.contains("model.n_heads") || stderr.contains("d_model"),
        _ => false,
    }
}

#[test]
fn random_overrides_are_valid_or_refused_with_the_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    let job = small_job(dir.path(), "fuzz", 2);
    let swap = dir.path().join("swap");
    std::fs::create_dir(&swap).expect("swap dir");
    let job = job.display().to_string();
    let mut cases = Cases(0x5eed_0001);
    let (mut valid, mut refused) = (0, 0);
    for case in 0..600 {
        let (sets, keys) = cases.overrides(3, &swap);
        let mut args = vec!["check".to_string(), job.clone()];
        for s in &sets {
            args.extend(["--set".to_string(), s.clone()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = Zrun::start(dir.path(), &args).wait(Duration::from_secs(60));
        match out.code() {
            0 => valid += 1,
            _ if refused_clearly(&out, &keys) => refused += 1,
            _ => panic!("case {case}: zrun {}: {out:?}", args.join(" ")),
        }
    }
    println!("600 cases: {valid} valid, {refused} refused");
    // A fuzz that refuses everything (or nothing) tests nothing.
    assert!(
        valid >= 60 && refused >= 60,
        "{valid} valid, {refused} refused"
    );
}

/// Trains `job` with `sets` on `workers` workers (a run directory and
/// metrics file of `case`'s own under `dir`), and checks that it trained to
/// its `done` line or was refused clearly, before writing anything, with
/// no swap file left in `swap` either way, and that `zrun check` of the job
/// said so before (exit 0 where it trained). Whether it trained.
fn trains_or_is_refused(
    dir: &Path,
    job: &str,
    case: &str,
    workers: usize,
    sets: &[String],
    keys: &[&str],
    swap: &Path,
) -> bool {
    let metrics_path = dir.join(format!("{case}.jsonl"));
    let mut args = vec![
        "train".to_string(),
        job.to_string(),
        "--no-progress".into(),
        "--workers-per-node".into(),
        workers.to_string(),
        "--metrics".into(),
        metrics_path.display().to_string(),
        "--set".into(),
        format!("run_dir={}", dir.join(format!("run-{case}")).display()),
    ];
    for s in sets {
        args.extend(["--set".to_string(), s.clone()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // `zrun check` of the same job first: what it passes must train, what
    // it refuses must be refused.
    let mut check = vec!["check", job, "--workers-per-node"];
    let workers = workers.to_string();
    check.push(&workers);
    check.extend(args[7..].iter().copied());
    let checked = Zrun::start(dir, &check).wait(Duration::from_secs(60));
    let out = Zrun::start(dir, &args).wait(Duration::from_secs(120));
    let what = || format!("{case}: zrun {}: {out:?}", args.join(" "));
    assert_eq!(
        checked.code() == 0,
        out.code() == 0,
        "zrun check and zrun train disagree: {}; check: {checked:?}",
        what()
    );
    let trained = match out.code() {
        0 => {
            let lines = metrics(&metrics_path);
            let done = lines
                .last()
                .and_then(|l| l.get("event"))
                .and_then(|e| e.as_str());
            assert_eq!(done, Some("done"), "{}", what());
            true
        }
        _ if refused_clearly(&out, keys) => {
            assert!(
                !metrics_path.exists(),
                "a refused run wrote metrics: {}",
                what()
            );
            false
        }
        _ => panic!("{}", what()),
    };
    let left: Vec<_> = std::fs::read_dir(swap).expect("swap dir").collect();
    assert!(left.is_empty(), "swap files left behind: {}", what());
    trained
}

#[test]
fn every_value_of_every_key_trains_or_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let job = small_job(dir.path(), "each", 2).display().to_string();
    let swap = dir.path().join("swap");
    std::fs::create_dir(&swap).expect("swap dir");
    let (mut trained, mut refused) = (0, 0);
    for (key, values) in KEYS {
        for (i, value) in values.iter().enumerate() {
            let sets = assignments(key, value, &swap);
            let case = format!("{key}-{i}");
            if trains_or_is_refused(dir.path(), &job, &case, 2, &sets, &[key], &swap) {
                trained += 1;
            } else {
                refused += 1;
            }
        }
    }
    println!("each value alone: {trained} trained, {refused} refused");
    assert!(
        trained >= 100 && refused >= 40,
        "{trained} trained, {refused} refused"
    );
}

#[test]
fn random_overrides_train_or_are_refused_before_anything_starts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let job = small_job(dir.path(), "fuzz", 2).display().to_string();
    let swap = dir.path().join("swap");
    std::fs::create_dir(&swap).expect("swap dir");
    let mut cases = Cases(0x5eed_0002);
    let (mut trained, mut refused) = (0, 0);
    for case in 0..30 {
        let (sets, keys) = cases.overrides(0, &swap);
        let workers = 1 + cases.below(3);
        let case = format!("case-{case}");
        if trains_or_is_refused(dir.path(), &job, &case, workers, &sets, &keys, &swap) {
            trained += 1;
        } else {
            refused += 1;
        }
    }
    println!("30 combinations: {trained} trained, {refused} refused");
    assert!(
        trained >= 5 && refused >= 5,
        "{trained} trained, {refused} refused"
    );
}
