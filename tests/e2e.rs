//! End to end through the built binaries: training, equivalence across world
//! sizes, `zrun check`, bad input, a killed worker, Ctrl-C, and strangers on the
//! control socket. Every test checks that the workers it caused are gone.

use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use e2e::{
    alive, assert_gone, children_of, free_port, losses, metrics, repo_root, small_job,
    start_long_job, wait_until, zrun, TrainArgs,
};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

#[test]
fn tiny_config_trains_and_its_loss_falls() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("metrics.jsonl");
    let root = repo_root();
    let f = TrainArgs::new("configs/tiny.yaml", &m)
        .set("train.steps=60")
        .run(&root);
    assert_eq!(f.code(), 0, "{f:?}");
    let lines = metrics(&m);
    let l = losses(&lines);
    assert_eq!(l.len(), 60);
    // The oracle: the unigram entropy of the training bytes, computed here from
    // the files the config names. A model that learned only byte frequencies
    // (or not even those) ends at or above it; one that predicts from its input
    // ends below. Measured at 60 steps: 2.70 nats against an entropy of 3.27,
    // and 2.77 with the learning rate halved. The data are this repository's
    // sources, so every edit to them changes the batches: a step's loss moves
    // by ±0.2 from batch to batch, and on 2026-11-30 the last 5 steps' mean
    // was 2.99 against an entropy of 3.29 (the last 10 steps': 2.88). So the
    // mean of the last 10 steps, asked to be 0.25 below: a unigram model
    // cannot go below the entropy at all.
    let entropy = unigram_entropy(&root.join("crates"));
    let last = l[50..].iter().sum::<f64>() / 10.0;
    assert!(
        last < entropy - 0.25,
        "the last 10 steps' loss {last:.3} is not 0.25 nats below the data's unigram entropy {entropy:.3}: {l:?}"
    );
    // the metrics line shape of docs/CONFIG.md, with real accounting.
    let s = &lines[10];
    assert_eq!(s["world_size"], 2);
    assert_eq!(s["zero_stage"], 0);
    let params = s["params"].as_u64().unwrap();
    assert!(s["tokens_per_s"].as_f64().unwrap() > 0.0 && s["tflops"].as_f64().unwrap() > 0.0);
    let mem = &s["mem_bytes"];
    // Stage 0 in f32: 4 bytes of params, 4 of grads, 8 of Adam moments per parameter (plus padding).
    let p = mem["params"].as_u64().unwrap();
    assert!(
        p >= 4 * params && p < 4 * params + 4 * 16 * 2 * 7,
        "params bytes {p} for {params}"
    );
    assert_eq!(mem["grads"].as_u64().unwrap(), p);
    assert_eq!(mem["optimizer"].as_u64().unwrap(), 2 * p);
    assert!(mem["peak_rss"].as_u64().unwrap() > p);
    // A ring all-reduce of the gradients sends 2(n-1)/n of them: n = 2, all of them.
    let c = &s["comm_bytes"];
    assert_eq!(c["by_op"]["all_reduce"].as_u64().unwrap(), p);
    assert_eq!(c["inter_node"], 0);
    // Where each step went: the slowest rank's phases add up to step_ms, and
    // its waits for collectives fall inside them, each under its op.
    let ms = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    let mut forward = Vec::new();
    let mut backward = Vec::new();
    for s in &lines[..60] {
        let t = &s["time_ms"];
        assert!(t["rank"].as_u64().unwrap() < 2, "{t}");
        let phases: f64 = ["forward", "backward", "optimizer", "other"]
            .iter()
            .map(|k| ms(t, k))
            .sum();
        let step = ms(s, "step_ms");
        assert!(
            (phases - step).abs() <= 1e-6 * step,
            "{phases} ms of {step}: {t}"
        );
        assert!(ms(t, "forward") > 0.0 && ms(t, "optimizer") > 0.0, "{t}");
        let by_op: f64 = t["comm_wait_by_op"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .sum();
        let wait = ms(t, "comm_wait");
        assert!((by_op - wait).abs() <= 1e-6 * step && wait <= step, "{t}");
        forward.push(ms(t, "forward"));
        backward.push(ms(t, "backward"));
    }
    // Backward does about twice forward's FLOPs (and the head's forward).
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (f, b) = (median(&mut forward), median(&mut backward));
    assert!(b > 1.3 * f, "median backward {b} ms, forward {f} ms");
    let done = lines.last().unwrap();
    assert_eq!(done["event"], "done");
    assert_eq!(done["steps"], 60);
}

/// Entropy (nats) of the byte distribution of every `crates/*/src/**/*.rs`.
fn unigram_entropy(crates: &std::path::Path) -> f64 {
    fn walk(dir: &std::path::Path, counts: &mut [u64; 256]) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, counts);
            } else if path.extension().is_some_and(|e| e == "rs") {
                for b in std::fs::read(&path).unwrap() {
                    counts[b as usize] += 1;
                }
            }
        }
    }
    let mut counts = [0u64; 256];
    for krate in std::fs::read_dir(crates).unwrap() {
        let src = krate.unwrap().path().join("src");
        if src.is_dir() {
            walk(&src, &mut counts);
        }
    }
    let total = counts.iter().sum::<u64>() as f64;
    assert!(total > 10_000.0, "only {total} bytes of sources");
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / total;
            -p * p.ln()
        })
        .sum()
}

#[test]
fn two_workers_equal_one_worker_with_the_same_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "equiv", 10);
    let run = |workers: &str, mb: &str, out: &str| {
        let m = dir.path().join(out);
        let f = zrun(
            dir.path(),
            &[
                "train",
                job.to_str().unwrap(),
                "--workers-per-node",
                workers,
                "--set",
                &format!("train.micro_batch_size={mb}"),
                "--metrics",
                m.to_str().unwrap(),
            ],
        );
        assert_eq!(f.code(), 0, "{f:?}");
        losses(&metrics(&m))
    };
    let one = run("1", "8", "one.jsonl");
    let two = run("2", "4", "two.jsonl");
    assert_eq!(one.len(), 10);
    for (s, (a, b)) in one.iter().zip(&two).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs(),
            "step {}: 1 worker {a}, 2 workers {b}",
            s + 1
        );
    }
    assert!(one[9] < one[0]);
}

/// Validation: with `data.val_fraction` held out and `train.eval_every: 2`,
/// steps 2 and 4 (and only those) carry `val_loss`; it falls, and 1 worker
/// with micro-batch 8 and 2 workers with 4 evaluate the same held-out
/// sequences to the same loss.
#[test]
fn validation_loss_is_reported_and_does_not_depend_on_the_split() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "val", 4);
    let run = |workers: &str, mb: &str| {
        let m = dir.path().join(format!("val{workers}.jsonl"));
        let f = TrainArgs::new(&job, &m)
            .args(&["--workers-per-node", workers])
            .set(format!("train.micro_batch_size={mb}"))
            .set("data.val_fraction=0.1")
            .set("train.eval_every=2")
            .run(dir.path());
        assert_eq!(f.code(), 0, "{f:?}");
        metrics(&m)
            .iter()
            .filter(|l| l.get("loss").is_some())
            .map(|l| l.get("val_loss").and_then(|v| v.as_f64()))
            .collect::<Vec<_>>()
    };
    let one = run("1", "8");
    let two = run("2", "4");
    let at = |v: &[Option<f64>]| v.iter().map(Option::is_some).collect::<Vec<_>>();
    assert_eq!(at(&one), [false, true, false, true]);
    assert_eq!(at(&two), at(&one));
    let (a, b) = (one[3].unwrap(), two[3].unwrap());
    assert!((a - b).abs() <= 1e-5 * a, "1 worker {a}, 2 workers {b}");
    assert!(
        one[3].unwrap() < one[1].unwrap(),
        "validation loss did not fall: {one:?}"
    );
}

/// `tensorboard: DIR`: an event file that TensorBoard's own reader
/// (`EventAccumulator`, from the `tensorboard` package) reads, with every
/// step's loss, learning rate and validation loss as `metrics.jsonl` has
/// them (in f32); resumed from step 3 after 6 steps, a second file whose
/// restart event makes TensorBoard show steps 4-6 once, the resumed run's.
/// Always checked here: each record's framing and CRC-32Cs. The reader is
/// the Python named by `ZRUN_TENSORBOARD_PYTHON` (default `python3`);
/// without the package the test says it skipped that part, and
/// `ZRUN_REQUIRE_TENSORBOARD=1` (CI, which installs it in a venv) makes
/// that a failure.
/// TensorBoard's event files and the CSV monitor's files, across a resume
/// that runs steps 4-6 again: each step once, the resumed run's values (the
/// CSV files' to the bit of `metrics.jsonl`'s); a fresh run into the CSV
/// directory is refused before launch.
#[test]
fn tensorboard_and_csv_files_read_the_steps_scalars_across_a_resume() {
    use e2e::{tensorboard_scalars, tfrecords};
    let dir = tempfile::tempdir().unwrap();
    let job = e2e::ckpt_job(dir.path(), "tb", 6, 3);
    let (m, tb) = (dir.path().join("tb.jsonl"), dir.path().join("boards/tb"));
    let csv = dir.path().join("csv/tb");
    let args = |resume: bool| {
        let a = TrainArgs::new(&job, &m)
            .set(format!("tensorboard={}", tb.display()))
            .set(format!("csv_monitor={}", csv.display()))
            .set("data.val_fraction=0.1")
            .set("train.eval_every=3");
        match resume {
            true => a.args(&["--resume", "auto"]),
            false => a,
        }
    };
    let run = |resume: bool| {
        let f = args(resume).run(dir.path());
        assert_eq!(f.code(), 0, "{f:?}");
    };
    run(false);
    assert_eq!(tfrecords(&tb), [7], "the version record and one a step");
    // The newest checkpoint gone: the resume starts from step 3.
    std::fs::remove_dir_all(dir.path().join("ckpt/step-00000006")).unwrap();
    run(true);
    assert_eq!(
        tfrecords(&tb),
        [7, 5],
        "then the version, the restart event and steps 4-6"
    );
    let steps: Vec<serde_json::Value> = metrics(&m)
        .into_iter()
        .filter(|l| l.get("loss").is_some())
        .collect();
    assert_eq!(steps.len(), 9, "6 steps, then 4-6 again");
    for (file, key) in [("train_loss", "loss"), ("eval_loss", "val_loss")] {
        // The last line of each step (the resumed run's), to the bit.
        let want: std::collections::BTreeMap<u64, f64> =
            e2e::exact_by_step(&m, key).into_iter().collect();
        let path = csv.join(format!("{file}.csv"));
        let header = std::fs::read_to_string(&path).unwrap();
        assert!(header.starts_with("step,loss\n"), "{file}");
        let bits = |v: Vec<(u64, f64)>| {
            v.into_iter()
                .map(|(s, x)| (s, x.to_bits()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            bits(e2e::csv_by_step(&path)),
            bits(want.into_iter().collect()),
            "{file}: each step once, as metrics.jsonl has it"
        );
    }
    let f = args(false).run(dir.path());
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("holds train_loss.csv"), "{}", f.stderr);
    let Some(read) = tensorboard_scalars(&tb) else {
        return;
    };
    for (tag, key) in [
        ("train/loss", "loss"),
        ("train/lr", "lr"),
        ("train/epoch", "epoch"),
        ("eval/loss", "val_loss"),
    ] {
        // The resumed run's lines replace the first run's from step 4 on.
        let want: std::collections::BTreeMap<u64, f64> = steps
            .iter()
            .filter_map(|l| Some((l["step"].as_u64()?, l.get(key)?.as_f64()?)))
            .collect();
        let got = &read[tag];
        assert_eq!(
            got.iter().map(|g| g.0).collect::<Vec<_>>(),
            want.keys().copied().collect::<Vec<_>>(),
            "{tag}: each step once"
        );
        for ((_, g), (s, w)) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs(),
                "{tag} at step {s}: {g} against {w}"
            );
        }
    }
    assert_eq!(read["eval/loss"].len(), 2, "validations at steps 3 and 6");
}

/// LAMB's trust ratios reach the run's outputs: every step's line has
/// `trust_ratio` (smallest ≤ mean ≤ largest, within `[min_coeff,
/// max_coeff]`) and the CSV monitor a file for each, to the bit of the
/// lines; an AdamW run's lines have none, and it writes no such file.
#[test]
fn lamb_writes_its_trust_ratios_beside_the_loss() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "lamb", 4);
    let run = |name: &str, rule: &str| {
        let m = dir.path().join(format!("{name}.jsonl"));
        let csv = dir.path().join(format!("csv/{name}"));
        let mut args = TrainArgs::new(&job, &m)
            .set(format!("train.optimizer.type={rule}"))
            .set(format!("csv_monitor={}", csv.display()));
        if rule == "lamb" {
            args = args
                .set("train.optimizer.min_coeff=0.01")
                .set("train.optimizer.max_coeff=5");
        }
        let f = args.run(dir.path());
        assert_eq!(f.code(), 0, "{f:?}");
        let lines: Vec<serde_json::Value> = metrics(&m)
            .into_iter()
            .filter(|l| l.get("loss").is_some())
            .collect();
        (lines, csv)
    };
    let (lines, csv) = run("lamb", "lamb");
    assert_eq!(lines.len(), 4);
    for l in &lines {
        let r = &l["trust_ratio"];
        let [min, mean, max] = ["min", "mean", "max"].map(|k| r[k].as_f64().unwrap_or(-1.0));
        // The bounds as the update holds them, in f32.
        assert!(
            f64::from(0.01f32) <= min && min <= mean && mean <= max && max <= 5.0,
            "{l}"
        );
    }
    for key in ["min", "mean", "max"] {
        let want: Vec<(u64, u64)> = lines
            .iter()
            .map(|l| {
                (
                    l["step"].as_u64().unwrap(),
                    l["trust_ratio"][key].as_f64().unwrap().to_bits(),
                )
            })
            .collect();
        let got: Vec<(u64, u64)> =
            e2e::csv_by_step(&csv.join(format!("train_trust_ratio_{key}.csv")))
                .into_iter()
                .map(|(s, v)| (s, v.to_bits()))
                .collect();
        assert_eq!(got, want, "{key}");
    }
    let (lines, csv) = run("adamw", "adamw");
    assert!(
        lines.iter().all(|l| l.get("trust_ratio").is_none()),
        "{lines:?}"
    );
    assert!(!csv.join("train_trust_ratio_min.csv").exists());
}

/// `flops_profiler`: rank 0's profile of the step asked for, once, its
/// summary on the console and the table of every module in the run
/// directory; `module_depth` cuts the table, and a second run keeps the
/// first run's profile beside its own.
#[test]
fn flops_profiler_writes_the_steps_modules_and_keeps_an_earlier_profile() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "prof", 3);
    let m = dir.path().join("m.jsonl");
    let args = TrainArgs::new(&job, &m).set("flops_profiler.profile_step=2");
    let f = args.run(dir.path());
    assert_eq!(f.code(), 0, "{f:?}");
    let said = |f: &e2e::Finished| {
        f.stdout
            .matches("flops profile of step 2, rank 0 of 2")
            .count()
    };
    assert_eq!(said(&f), 1, "{}", f.stdout);
    let path = dir.path().join("runs/prof/flops_profile.txt");
    // The table's rows: each line's first word after the header.
    let rows = |text: &str| -> Vec<String> {
        let lines = text
            .lines()
            .skip_while(|l| !l.starts_with("module "))
            .skip(1);
        lines
            .filter_map(|l| l.split_whitespace().next().map(String::from))
            .collect()
    };
    let first = std::fs::read_to_string(&path).unwrap();
    let mut want = vec!["model", "embedding"];
    for b in ["h.0", "h.1"] {
        let parts = [
            "",
            ".ln_1",
            ".attn",
            ".attn.c_attn",
            ".attn.attention",
            ".attn.c_proj",
            ".ln_2",
            ".mlp",
            ".mlp.c_fc",
            ".mlp.c_proj",
        ];
        want.extend(parts.map(|p| format!("{b}{p}").leak() as &str));
    }
    want.push("head");
    assert_eq!(rows(&first), want, "{first}");
    assert!(first.contains("top modules at each depth"), "{first}");

    let f = args
        .clone()
        .set("flops_profiler.module_depth=1")
        .run(dir.path());
    assert_eq!(f.code(), 0, "{f:?}");
    assert_eq!(said(&f), 1, "{}", f.stdout);
    let kept = dir.path().join("runs/prof/flops_profile.1.txt");
    assert_eq!(std::fs::read_to_string(&kept).unwrap(), first);
    let second = std::fs::read_to_string(&path).unwrap();
    let want = ["model", "embedding", "h.0", "h.1", "head"];
    assert_eq!(rows(&second), want, "{second}");
}

/// `comms_logger`: every collective of the run in a table of op, buffer
/// bytes and count whose volume is, op by op, what the metrics say each
/// rank sent (on 2 ranks a ring's all-reduce sends its buffer once, a
/// reduce-scatter or an all-gather half of it); `prof_ops` keeps only the
/// collectives named, and a second run keeps the first run's table.
#[test]
fn comms_logger_tallies_what_the_metrics_count_and_keeps_an_earlier_log() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "comms", 3);
    let m = dir.path().join("m.jsonl");
    let args = TrainArgs::new(&job, &m)
        .set("zero.stage=3")
        .set("zero.reduce_bucket_size=3000")
        .set("comms_logger={}");
    let f = args.run(dir.path());
    assert_eq!(f.code(), 0, "{f:?}");
    let path = dir.path().join("runs/comms/comms_log.txt");
    assert!(
        f.stdout
            .contains(&format!("the comms log is in {}", path.display())),
        "{}",
        f.stdout
    );
    // (op, bytes, count) of each row of the table.
    let rows = |text: &str| -> Vec<(String, u64, u64)> {
        text.lines()
            .skip_while(|l| !l.starts_with("op "))
            .skip(1)
            .map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                let bytes = w[1].replace(',', "").parse().unwrap();
                (w[0].to_string(), bytes, w[2].parse().unwrap())
            })
            .collect()
    };
    let first = std::fs::read_to_string(&path).unwrap();
    assert!(first.contains("group world, 2 ranks"), "{first}");
    let logged = rows(&first);
    let steps = metrics(&m);
    for op in ["all_reduce", "reduce_scatter", "all_gather"] {
        let share = if op == "all_reduce" { 1.0 } else { 0.5 };
        let volume: f64 = logged
            .iter()
            .filter(|(o, ..)| o == op)
            .map(|(_, bytes, count)| (bytes * count) as f64 * share)
            .sum();
        let sent: f64 = steps
            .iter()
            .filter_map(|l| l["comm_bytes"]["by_op"][op].as_f64())
            .sum();
        assert_eq!(volume, sent, "{op}:\n{first}");
    }
    let kinds = |op: &str| logged.iter().filter(|(o, ..)| o == op).count();
    // Stage 3 gathers every layer's parameters and reduces bucket by bucket.
    assert!(
        kinds("all_gather") >= 1 && kinds("reduce_scatter") >= 2,
        "{first}"
    );

    let f = args
        .clone()
        .set("comms_logger.prof_all=false")
        .set("comms_logger.prof_ops=[all_gather]")
        .run(dir.path());
    assert_eq!(f.code(), 0, "{f:?}");
    let kept = dir.path().join("runs/comms/comms_log.1.txt");
    assert_eq!(std::fs::read_to_string(&kept).unwrap(), first);
    let second = rows(&std::fs::read_to_string(&path).unwrap());
    let gathers: Vec<_> = logged
        .into_iter()
        .filter(|(o, ..)| o == "all_gather")
        .collect();
    assert_eq!(second, gathers);
}

#[test]
fn check_prints_the_resolved_job_and_topology() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "checked", 5);
    let hosts = dir.path().join("hosts");
    std::fs::write(
        &hosts,
        "# two simulated nodes\n127.0.0.1 slots=2\n127.0.0.2 slots=3\n",
    )
    .unwrap();
    let f = zrun(
        dir.path(),
        &[
            "check",
            job.to_str().unwrap(),
            "--hostfile",
            hosts.to_str().unwrap(),
            "--exclude",
            "127.0.0.2:1",
            "--set",
            "train.lr=0.01",
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(f.stdout.contains("\"lr\": 0.01"), "{}", f.stdout);
    assert!(f.stdout.contains("4 workers on 2 nodes"), "{}", f.stdout);
    assert!(
        f.stdout
            .contains("node 1: 127.0.0.2 (address 127.0.0.2) slots [0, 2] ranks 2,3"),
        "{}",
        f.stdout
    );
}

/// `train.freeze` as a user runs it, the embedding and the first block
/// frozen (so backward stops above them): `zrun train` from exported
/// weights (`model.init_from`) says what it froze, and the export after
/// training holds the frozen tensors as they were in the weights it
/// started from, bit for bit, while every other tensor trained.
#[test]
fn frozen_parameters_leave_training_as_they_started() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let job = small_job(d, "frozen", 3);
    let job = job.to_str().unwrap();
    let exported = |name: &str, sets: &[String]| {
        let mut args = vec!["train", job, "--no-progress"];
        let run_dir = format!("run_dir={}/runs/{name}", d.display());
        let ckpt = d.join(format!("checkpoints/{name}"));
        let ckpt_dir = format!("checkpoint.dir={}", ckpt.display());
        for s in sets.iter().chain([&run_dir, &ckpt_dir]) {
            args.extend(["--set", s.as_str()]);
        }
        let f = zrun(d, &args);
        assert_eq!(f.code(), 0, "{f:?}");
        let out = d.join(format!("{name}.safetensors"));
        let e = zrun(
            d,
            &[
                "export",
                ckpt.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ],
        );
        assert_eq!(e.code(), 0, "{e:?}");
        (f.stdout, out)
    };
    let (_, init) = exported("init", &[]);
    let (said, trained) = exported(
        "trained",
        &[
            format!("model.init_from={}", init.display()),
            "train.freeze=[\"h.{0-0}.*\", wpe.weight, wte.weight]".into(),
        ],
    );
    assert!(
        said.contains(
            "frozen (train.freeze: `h.{0-0}.*` 12, `wpe.weight` 1, `wte.weight` 1): 14 of 28 parameters"
        ),
        "{said}"
    );
    // Each tensor's bytes, by name.
    let read = |p: &std::path::Path| {
        let bytes = std::fs::read(p).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let tensors: std::collections::BTreeMap<String, Vec<u8>> = file
            .tensors()
            .into_iter()
            .map(|(name, view)| (name, view.data().to_vec()))
            .collect();
        tensors
    };
    let (start, end) = (read(&init), read(&trained));
    assert_eq!(start.len(), 28);
    assert_eq!(
        start.keys().collect::<Vec<_>>(),
        end.keys().collect::<Vec<_>>()
    );
    for (name, bytes) in &end {
        let frozen = name.starts_with("h.0.") || name.starts_with("wte") || name.starts_with("wpe");
        assert_eq!(bytes == &start[name], frozen, "{name}");
    }
}

/// `zrun check` refuses what `zrun train` refuses before launch on this
/// host, with the same message: an NVMe path that takes no `O_DIRECT`
/// write, workers that cannot fit in memory, weights that do not fit the
/// model (until the sixty-ninth session `zrun check` passed all three).
#[test]
fn check_refuses_what_train_refuses_here() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "refused", 3);
    let job = job.to_str().unwrap();
    let weights = dir.path().join("other.safetensors");
    let f = zrun(
        dir.path(),
        &["train", job, "--set", "checkpoint.dir=ck", "--no-progress"],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let f = zrun(
        dir.path(),
        &["export", "ck", "--out", weights.to_str().unwrap()],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let init = format!("model.init_from={}", weights.display());
    for (sets, says) in [
        (
            vec![
                "zero.stage=3",
                "zero.offload_optimizer.device=nvme",
                "zero.offload_optimizer.nvme_path=/proc",
            ],
            "zero.offload_optimizer.nvme_path: /proc",
        ),
        (
            vec!["model.d_model=65536", "model.n_layers=64"],
            "more than this host's",
        ),
        (vec![init.as_str(), "model.d_model=64"], "model.init_from:"),
    ] {
        let sets: Vec<&str> = sets.iter().flat_map(|s| ["--set", s]).collect();
        for command in ["check", "train"] {
            let args = [&[command, job][..], &sets].concat();
            let f = zrun(dir.path(), &args);
            assert_eq!(f.code(), 2, "{args:?}: {f:?}");
            assert!(f.stderr.contains(says), "{args:?}: {}", f.stderr);
        }
    }
}

/// Every kind of bad input exits 2, before launching, with a message saying where and what.
#[test]
fn bad_input_exits_2_with_a_located_message() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let good = std::fs::read_to_string(small_job(d, "good", 3)).unwrap();
    let write = |name: &str, text: &str| {
        let p = d.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let hosts_dup = write("hosts_dup", "127.0.0.1 slots=1\n\n127.0.0.1 slots=2\n");
    let tiny_data = write("tiny.txt", "abc");
    // u16 tokens 0..=64 for a model of vocab 64: the last id is one too many.
    let big_token = {
        let p = d.join("big.tok");
        let ids: Vec<u8> = (0..=64u16)
            .cycle()
            .take(4000)
            .flat_map(u16::to_le_bytes)
            .collect();
        std::fs::write(&p, ids).unwrap();
        p.display().to_string()
    };
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![write("typo.yaml", &good.replace("  lr:", "  lr_:"))],
            "typo.yaml:7:3: unknown key `lr_`, did you mean `lr`?",
        ),
        (
            vec![write(
                "syntax.yaml",
                &good.replace("train:\n", "train: [\n"),
            )],
            "syntax.yaml:",
        ),
        (
            vec![write(
                "heads.yaml",
                &good.replace("n_heads: 4", "n_heads: 5"),
            )],
            "heads.yaml:2:51: model.n_heads: 5 heads do not divide d_model 32",
        ),
        (
            vec![write("lr.yaml", &good.replace("lr: 3.0e-3", "lr: 0"))],
            "lr.yaml:7:3: train.lr: must be a positive number",
        ),
        (
            vec![write(
                "freeze.yaml",
                &good.replace(
                    "  warmup_steps: 2\n",
                    "  warmup_steps: 2\n  freeze: [layers.0.*]\n",
                ),
            )],
            "freeze.yaml:9:3: train.freeze: `layers.0.*` matches none of the model's parameters: wte.weight, wpe.weight, h.0.ln_1.weight",
        ),
        (
            vec![write(
                "dropout.yaml",
                &good.replace("seq_len: 32}", "seq_len: 32, hidden_dropout: 1}"),
            )],
            "dropout.yaml:2:76: model.hidden_dropout: must be at least 0 and below 1, got 1",
        ),
        (
            vec![write(
                "attention_dropout.yaml",
                &good.replace("seq_len: 32}", "seq_len: 32, attention_dropout: -0.1}"),
            )],
            "attention_dropout.yaml:2:76: model.attention_dropout: must be at least 0 and below 1, got -0.1",
        ),
        (
            vec![write(
                "nodata.yaml",
                &good
                    .replace("{format: synthetic}", "{path: /nonexistent/*.txt}")
                    .replace("vocab_size: 64", "vocab_size: 256"),
            )],
            "nodata.yaml:3:8: data.path: no file matches `/nonexistent/*.txt`",
        ),
        (
            vec![write(
                "vocab.yaml",
                &good.replace("{format: synthetic}", &format!("{{path: {tiny_data}}}")),
            )],
            "vocab.yaml:2:9: model.vocab_size: text data (`data.format: text`) uses bytes as tokens",
        ),
        (
            vec![write(
                "fit.yaml",
                &good
                    .replace("{format: synthetic}", &format!("{{path: {tiny_data}}}"))
                    .replace("vocab_size: 64", "vocab_size: 256"),
            )],
            "model.seq_len: the data has 3 tokens",
        ),
        (
            vec![write(
                "qwz.yaml",
                &format!("{good}zero: {{stage: 2, zero_quantized_weights: true}}\n"),
            )],
            "qwz.yaml:10:18: zero.zero_quantized_weights: needs zero.stage: 3",
        ),
        (
            vec![write(
                "qbits.yaml",
                &format!("{good}zero: {{stage: 3, quantization: {{weight_bits: 6}}}}\n"),
            )],
            "zero.quantization.weight_bits: 6: must be 8 or 4",
        ),
        (
            vec![write(
                "hpz.yaml",
                &format!("{good}zero: {{stage: 2, zero_hpz_partition_size: 2}}\n"),
            )],
            "hpz.yaml:10:18: zero.zero_hpz_partition_size: needs zero.stage: 3",
        ),
        (
            vec![
                write(
                    "hpz3.yaml",
                    &format!("{good}zero: {{stage: 3, hpz_partition_size: 3}}\n"),
                ),
                "--workers-per-node".into(),
                "2".into(),
            ],
            "zero.hpz_partition_size: 3 must divide the workers of every node (a secondary partition lives inside one node); this job's nodes: localhost × 2",
        ),
        (
            vec![write(
                "qgz.yaml",
                &format!("{good}zero: {{stage: 1, zero_quantized_gradients: true}}\n"),
            )],
            "qgz.yaml:10:18: zero.zero_quantized_gradients: needs zero.stage: 3",
        ),
        (
            vec![
                write("evalno.yaml", &good),
                "--set".into(),
                "train.eval_every=5".into(),
            ],
            "train.eval_every: needs validation data: set data.val_path or data.val_fraction",
        ),
        (
            vec![
                write("valfrac.yaml", &good),
                "--set".into(),
                "data.val_fraction=1.5".into(),
            ],
            "data.val_fraction: must be in [0, 1), got 1.5",
        ),
        (
            vec![write("stage.yaml", &format!("{good}zero: {{stage: 4}}\n"))],
            "zero.stage: must be 0, 1, 2 or 3, got 4",
        ),
        (
            vec![
                write("hyst.yaml", &good),
                "--set".into(),
                "train.loss_scale.hysteresis=0".into(),
            ],
            "train.loss_scale.hysteresis: must be at least 1",
        ),
        (
            vec![
                write("g1.yaml", &good),
                "--set".into(),
                "zero.stge=1".into(),
            ],
            "--set zero.stge=1: unknown key `stge`, did you mean `stage`?",
        ),
        (
            vec![
                write("g2.yaml", &good),
                "--set".into(),
                "train.steps=many".into(),
            ],
            "--set train.steps=many",
        ),
        (
            vec![write("g3.yaml", &good), "--hostfile".into(), hosts_dup],
            "hosts_dup:3: host `127.0.0.1` is listed twice (first on line 1)",
        ),
        (
            vec![write("g4.yaml", &good), "--include".into(), "node9".into()],
            "--include: host `node9` is not in the hostfile",
        ),
        (
            vec![d.join("missing.yaml").to_str().unwrap().into()],
            "missing.yaml: No such file",
        ),
        // Values that used to be accepted and then failed (or panicked) after launch.
        (
            vec![write(
                "to.yaml",
                &format!("{good}comm: {{timeout_s: 1e30}}\n"),
            )],
            "comm.timeout_s: must be between 1 and 604800 seconds, got 1000000000000000000000000000000",
        ),
        (
            vec![write(
                "hb.yaml",
                &format!("{good}comm: {{heartbeat_s: 0.01}}\n"),
            )],
            "comm.heartbeat_s: must be between 2 and 86400 seconds, got 0.01",
        ),
        (
            vec![write("rank.yaml", &format!("{good}env: {{RANK: \"5\"}}\n"))],
            "env.RANK: is set by zrun for every worker",
        ),
        (
            vec![
                write("g6.yaml", &good),
                "--hostfile".into(),
                write("hosts_bad", "nosuchhost.invalid slots=1\n"),
            ],
            "hosts_bad:1: host `nosuchhost.invalid` does not resolve",
        ),
        (
            vec![write(
                "ckfile.yaml",
                &format!("{good}checkpoint: {{dir: {tiny_data}}}\n"),
            )],
            "checkpoint.dir: cannot create",
        ),
        (
            vec![
                write("w0.yaml", &good),
                "--workers-per-node".into(),
                "0".into(),
            ],
            "--workers-per-node: must be between 1 and 1024, got 0",
        ),
        (
            vec![write(
                "tok.yaml",
                &good.replace(
                    "{format: synthetic}",
                    &format!("{{path: {big_token}, format: tokens_u16}}"),
                ),
            )],
            "holds token id 64 at token offset 64 (byte 128), which needs vocab_size of at least 65, got 64",
        ),
        (
            vec![write(
                "huge.yaml",
                &good.replace("micro_batch_size: 4", "micro_batch_size: 1000000000"),
            )],
            "more than this host's",
        ),
        (
            // Each fits (3.1 GiB), too many together (3.2 TiB): the total said.
            vec![
                write(
                    "many.yaml",
                    &good.replace("micro_batch_size: 4", "micro_batch_size: 20000"),
                ),
                "--workers-per-node".into(),
                "1024".into(),
            ],
            "GiB in all, ",
        ),
        (
            vec![
                write("more.yaml", &good),
                "--workers-per-node".into(),
                "10000000".into(),
            ],
            "--workers-per-node: must be between 1 and 1024, got 10000000",
        ),
        (
            vec![write("g5.yaml", &good), "--resume".into(), "auto".into()],
            "--resume auto: the job has no checkpoint.dir to look in",
        ),
        (
            vec![write("g6.yaml", &good), "--max-restarts".into(), "1".into()],
            "--max-restarts: a restart resumes from a checkpoint; the job has no checkpoint.dir",
        ),
    ];
    for (args, want) in cases {
        let mut full = vec!["train".to_string()];
        full.extend(args);
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        let f = zrun(d, &refs);
        assert_eq!(f.code(), 2, "{refs:?}: {f:?}");
        assert!(
            f.stderr.contains(want),
            "{refs:?}: expected `{want}` in:\n{}",
            f.stderr
        );
        assert!(!f.stderr.contains("panicked"), "{}", f.stderr);
    }
    // clap's own usage errors are bad input too.
    assert_eq!(zrun(d, &["train"]).code(), 2);
    assert_eq!(zrun(d, &["frobnicate"]).code(), 2);
}

#[test]
fn a_killed_worker_fails_the_job_fast_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (z, _) = start_long_job(dir.path(), "killed", &[]);
    let workers = children_of(z.pid());
    assert_eq!(workers.len(), 2, "expected 2 workers, found {workers:?}");
    // The workers share a /dev/shm segment, already unlinked while they run
    // (mapped, "(deleted)"), so a killed job cannot leave it behind.
    let environ = std::fs::read(format!("/proc/{}/environ", workers[0])).unwrap();
    let job_id = String::from_utf8_lossy(&environ)
        .split('\0')
        .find_map(|v| v.strip_prefix("ZRUN_JOB_ID=").map(str::to_string))
        .expect("ZRUN_JOB_ID in the worker's environment");
    let segment = zproto::shm_segment_path(&zproto::shm_segment_name(&job_id, 0));
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", workers[0])).unwrap();
    assert!(
        maps.lines()
            .any(|l| l.contains(&*segment.to_string_lossy()) && l.ends_with("(deleted)")),
        "{} is not mapped-and-unlinked in worker {}",
        segment.display(),
        workers[0]
    );
    assert!(
        !segment.exists(),
        "{} exists while the job runs",
        segment.display()
    );
    let victim = workers[1];
    let t0 = Instant::now();
    kill(Pid::from_raw(victim as i32), Signal::SIGKILL).unwrap();
    let f = z.wait(Duration::from_secs(20));
    let took = t0.elapsed();
    assert_eq!(f.code(), 1, "{f:?}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(
        f.stderr.contains("was killed by signal SIGKILL"),
        "{}",
        f.stderr
    );
    assert!(f.stderr.contains(&format!("pid {victim}")), "{}", f.stderr);
    for w in workers {
        assert!(!alive(w), "worker {w} is still running");
    }
    assert!(!segment.exists(), "{} left behind", segment.display());
}

/// `--bind-cores-to-rank`: each worker runs pinned to its local rank's
/// share of the host's physical cores (the kernel's record of the CPUs it
/// may use, read from /proc, against the share computed here), its memory
/// bound to their NUMA node, and says so; a list that cannot give each worker a core, that names a core this
/// host has not got, or that is malformed is exit 2 before launch.
#[test]
fn bound_workers_run_on_their_share_of_the_cores() {
    use zconfig::cores::{core_list_text, physical_cores, share};
    let cores = physical_cores().unwrap();
    if cores.len() < 2 {
        eprintln!(
            "SKIPPED: binding 2 workers needs 2 physical cores; this host has {}",
            cores.len()
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (z, _) = start_long_job(dir.path(), "bound", &["--bind-cores-to-rank"]);
    let workers = children_of(z.pid());
    assert_eq!(workers.len(), 2, "expected 2 workers, found {workers:?}");
    for w in workers {
        let environ = std::fs::read(format!("/proc/{w}/environ")).unwrap();
        let local_rank: usize = String::from_utf8_lossy(&environ)
            .split('\0')
            .find_map(|v| v.strip_prefix("LOCAL_RANK=").map(|r| r.parse().unwrap()))
            .expect("LOCAL_RANK in the worker's environment");
        let status = std::fs::read_to_string(format!("/proc/{w}/status")).unwrap();
        let allowed = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim()
            .to_string();
        let mine = share(&cores, 2, local_rank).unwrap();
        let want = core_list_text(mine);
        assert_eq!(allowed, want, "worker {w}, local rank {local_rank}");
        // Its memory bound to the NUMA node that holds its cores, where
        // one does (the kernel's record of each mapping's policy).
        let node = std::fs::read_dir("/sys/devices/system/node")
            .into_iter()
            .flatten()
            .flatten()
            .find_map(|e| {
                let n: usize = e.file_name().to_str()?.strip_prefix("node")?.parse().ok()?;
                let list = std::fs::read_to_string(e.path().join("cpulist")).ok()?;
                let cpus = zconfig::cores::parse_core_list(list.trim()).ok()?;
                mine.iter().all(|c| cpus.contains(c)).then_some(n)
            });
        let refused = format!("rank {local_rank} (local rank {local_rank} of 2 on ");
        let refused = z
            .stdout_so_far()
            .lines()
            .any(|l| l.contains(&refused) && l.contains("memory not bound"));
        if refused {
            // A container's seccomp refuses set_mempolicy: the worker said so.
            eprintln!("SKIPPED: this host refuses set_mempolicy; rank {local_rank} said so");
        } else if let Some(n) = node {
            let maps = std::fs::read_to_string(format!("/proc/{w}/numa_maps")).unwrap();
            let bound = maps
                .lines()
                .filter(|l| l.contains(&format!(" bind:{n} ")))
                .count();
            assert!(
                bound * 2 > maps.lines().count(),
                "worker {w}: {bound} of its mappings bound to node {n}:\n{maps}"
            );
        }
        let said = format!("(local rank {local_rank} of 2 on ");
        assert!(z.stdout_so_far().contains(&said), "{}", z.stdout_so_far());
    }
    drop(z);
    let job = small_job(dir.path(), "unbound", 2);
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap();
    let past = zconfig::cores::parse_core_list(online.trim())
        .unwrap()
        .last()
        .unwrap()
        + 1;
    for (list, says) in [
        (cores[0].to_string(), "cannot be shared by 2 workers"),
        (
            format!("0-{past}"),
            &format!("core {past} is not online") as &str,
        ),
        ("1,0".to_string(), "ascending order"),
    ] {
        let m = dir.path().join("m.jsonl");
        let f = TrainArgs::new(&job, &m)
            .args(&["--bind-core-list", &list])
            .run(dir.path());
        assert_eq!(f.code(), 2, "{list}: {f:?}");
        assert!(
            f.stderr.contains("--bind-core-list") && f.stderr.contains(says),
            "{list}: {}",
            f.stderr
        );
        assert!(!m.exists(), "{list}: it launched");
    }
}

/// `--enable-each-rank-log DIR` (DeepSpeed's): a worker's lines go to
/// `DIR/{launch time}_rank{R}.log`, not to the console, and a rank's
/// failure names its file; a DIR that is a file is exit 2 before launch.
#[test]
fn each_rank_logs_to_a_file_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let core = zconfig::cores::physical_cores().unwrap()[0].to_string();
    // A pinned worker says where it runs: a line of output to look for.
    let extra = [
        "--workers-per-node",
        "1",
        "--bind-core-list",
        &core,
        "--enable-each-rank-log",
        logs.to_str().unwrap(),
    ];
    let (z, _) = start_long_job(dir.path(), "logged", &extra);
    let files: Vec<_> = std::fs::read_dir(&logs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.ends_with("_rank0.log") && name.len() == "YYYYmmddHHMMSS_rank0.log".len());
    let text = std::fs::read_to_string(&files[0]).unwrap();
    assert!(text.contains("rank 0 (local rank 0 of 1 on "), "{text}");
    assert!(
        !z.stdout_so_far().contains("bound to cores"),
        "{}",
        z.stdout_so_far()
    );
    let worker = children_of(z.pid())[0];
    kill(Pid::from_raw(worker as i32), Signal::SIGKILL).unwrap();
    let f = z.wait(Duration::from_secs(20));
    assert_eq!(f.code(), 1, "{f:?}");
    let named = format!("its output in {})", files[0].display());
    assert!(f.stderr.contains(&named), "{}", f.stderr);

    let job = small_job(dir.path(), "unlogged", 2);
    let m = dir.path().join("m.jsonl");
    let a_file = dir.path().join("m.txt");
    std::fs::write(&a_file, "").unwrap();
    let f = TrainArgs::new(&job, &m)
        .args(&["--enable-each-rank-log", a_file.to_str().unwrap()])
        .run(dir.path());
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("is a file; it must be a directory"),
        "{}",
        f.stderr
    );
    // `zrun check` says where the output goes and where workers run.
    let f = zrun(
        dir.path(),
        &[
            "check",
            job.to_str().unwrap(),
            "--workers-per-node",
            "1",
            "--bind-core-list",
            &core,
            "--enable-each-rank-log",
            logs.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    for says in [
        format!("# workers pinned: each host's workers share {core} in local-rank order"),
        format!(
            "# each rank's output: {}/<launch time>_rank<R>.log",
            logs.display()
        ),
    ] {
        assert!(f.stdout.contains(&says), "{says}: {}", f.stdout);
    }
}

#[test]
fn ctrl_c_stops_everything_with_exit_130() {
    let dir = tempfile::tempdir().unwrap();
    let (z, _) = start_long_job(dir.path(), "interrupted", &[]);
    let workers = children_of(z.pid());
    assert_eq!(workers.len(), 2);
    z.signal(Signal::SIGINT);
    let f = z.wait(Duration::from_secs(20));
    assert_eq!(f.code(), 130, "{f:?}");
    assert!(f.stderr.contains("interrupted"), "{}", f.stderr);
    for w in workers {
        assert!(!alive(w), "worker {w} is still running");
    }
}

#[test]
fn strangers_on_the_control_socket_do_not_disturb_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let job = small_job(dir.path(), "strangers", 30);
    let m = dir.path().join("strangers.jsonl");
    let z = TrainArgs::new(&job, &m)
        .args(&["--master-port", &port.to_string()])
        .start(dir.path());
    let addr = format!("127.0.0.1:{port}");
    assert!(wait_until(Duration::from_secs(20), || TcpStream::connect(
        &addr
    )
    .is_ok()));
    // Garbage, an oversized length prefix, a wrong-token hello, and a silent client.
    let mut garbage = TcpStream::connect(&addr).unwrap();
    let _ = garbage.write_all(b"GET / HTTP/1.1\r\n\r\n");
    let mut huge = TcpStream::connect(&addr).unwrap();
    let _ = huge.write_all(&[0x7f, 0xff, 0xff, 0xff]);
    let mut liar = TcpStream::connect(&addr).unwrap();
    let hello = br#"{"Hello":{"rank":0,"job_id":"x","proof":"00","nonce":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0],"pid":1,"hostname":"evil"}}"#;
    let mut framed = (hello.len() as u32).to_be_bytes().to_vec();
    framed.extend_from_slice(hello);
    let _ = liar.write_all(&framed);
    let _silent = TcpStream::connect(&addr).unwrap();
    let f = z.wait(Duration::from_secs(120));
    assert_eq!(f.code(), 0, "{f:?}");
    assert_eq!(losses(&metrics(&m)).len(), 30);
}

/// A frozen worker (SIGSTOP) is caught by the heartbeat deadline, and zrun says
/// where every rank was: the others waiting in a collective for it.
#[test]
fn a_hang_is_diagnosed_per_rank() {
    let dir = tempfile::tempdir().unwrap();
    let (z, _) = start_long_job(dir.path(), "hang", &["--set", "comm.heartbeat_s=2"]);
    let workers = children_of(z.pid());
    assert_eq!(workers.len(), 2);
    kill(Pid::from_raw(workers[1] as i32), Signal::SIGSTOP).unwrap();
    let f = z.wait(Duration::from_secs(30));
    assert_eq!(f.code(), 1, "{f:?}");
    assert!(
        f.stderr.contains("rank 1 (host localhost") && f.stderr.contains("sent nothing for"),
        "{}",
        f.stderr
    );
    assert!(f.stderr.contains("where each rank was"), "{}", f.stderr);
    assert!(
        f.stderr.contains("(group world, ") && f.stderr.contains("waiting for rank 1"),
        "{}",
        f.stderr
    );
    assert_gone(&workers, Duration::from_secs(5), "after the hang");
}

/// `--launcher slurm` through a stand-in srun (scripts/fake-slurm): the workers
/// take their ranks from SLURM_* variables and reach zrun by MASTER_ADDR/PORT;
/// `--launcher-args` reach srun before the worker, split as a shell splits
/// them, and are refused (exit 2) for a launcher that runs no program of its
/// own, or with a quote left open.
#[test]
fn slurm_launcher_trains_through_srun() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "slurm", 4);
    let m = dir.path().join("m.jsonl");
    let srun_args = dir.path().join("srun.args");
    let path = format!(
        "{}:{}",
        repo_root().join("scripts/fake-slurm").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = std::process::Command::new(e2e::bin("zrun"))
        .args([
            "train",
            job.to_str().unwrap(),
            "--launcher",
            "slurm",
            "--num-nodes",
            "1",
            "--workers-per-node",
            "3",
            "--master-addr",
            "127.0.0.1",
            "--launcher-args",
            "--partition=debug --comment='two words'",
        ])
        .args(["--metrics", m.to_str().unwrap(), "--no-progress"])
        .env("PATH", path)
        .env("FAKE_SRUN_ARGS", &srun_args)
        .env_remove("RANK")
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = metrics(&m);
    assert_eq!(lines[0]["world_size"], 3);
    assert_eq!(losses(&lines).len(), 4);
    let got = std::fs::read_to_string(&srun_args).unwrap();
    let got: Vec<&str> = got.lines().collect();
    let worker = e2e::bin("zworker").display().to_string();
    let at = got
        .iter()
        .position(|a| *a == worker)
        .expect("the worker in srun's arguments");
    assert_eq!(
        got[at - 2..at],
        ["--partition=debug", "--comment=two words"],
        "{got:?}"
    );
    for (launcher_args, says) in [
        ("--exclusive", "this job's launcher is local"),
        ("--comment='open", "a quote is not closed"),
    ] {
        let launcher = if says.contains("local") {
            "local"
        } else {
            "slurm"
        };
        let f = TrainArgs::new(&job, &m)
            .args(&["--launcher", launcher, "--launcher-args", launcher_args])
            .run(dir.path());
        assert_eq!(f.code(), 2, "{launcher_args}: {f:?}");
        assert!(f.stderr.contains(says), "{launcher_args}: {}", f.stderr);
    }
}

/// A flood of silent connections fills zrun's connection limit before the
/// workers arrive; they are dropped at the handshake deadline, the workers retry,
/// and the job trains.
#[test]
fn a_flood_of_idle_connections_cannot_block_rendezvous() {
    let dir = tempfile::tempdir().unwrap();
    // The flood connects before zrun listens: a port no connect takes as
    // its own source.
    let port = e2e::free_port_below_ephemeral();
    // Long enough that the flood is complete while the job still runs.
    let job = small_job(dir.path(), "flood", 40);
    let m = dir.path().join("m.jsonl");
    // Hold the port's connections from the moment it opens.
    let addr = format!("127.0.0.1:{port}");
    let flood = std::thread::spawn(move || {
        let mut held = Vec::new();
        let t0 = Instant::now();
        while held.len() < 150 && t0.elapsed() < Duration::from_secs(60) {
            if let Ok(s) = TcpStream::connect(&addr) {
                held.push(s);
            }
        }
        std::thread::sleep(Duration::from_secs(8));
        held.len()
    });
    let z = TrainArgs::new(&job, &m)
        .args(&["--master-port", &port.to_string()])
        .start(dir.path());
    let f = z.wait(Duration::from_secs(90));
    assert_eq!(f.code(), 0, "{f:?}");
    assert_eq!(losses(&metrics(&m)).len(), 40);
    // zrun accepts at most world + 64 connections at once: the flood held more
    // (150 when the job outlasts it; under a loaded machine the job can end
    // first, and its port with it: 127 was seen).
    let held = flood.join().unwrap();
    assert!(held > 2 + 64, "the flood held only {held} connections");
}

/// `.zrun_env` in the working directory reaches every worker: here it sets the
/// fault-injection delay of checkpoint saves, which makes the run measurably slower.
/// A malformed line is bad input naming the file and line.
#[test]
fn zrun_env_is_forwarded_to_workers() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "envfwd", 2);
    let ckpt = format!("checkpoint.dir={}/ckpt", dir.path().display());
    std::fs::write(
        dir.path().join(".zrun_env"),
        "# forwarded\nZRUN_FAULT_SAVE_DELAY_MS=1500\n",
    )
    .unwrap();
    let t0 = Instant::now();
    let f = zrun(
        dir.path(),
        &[
            "train",
            job.to_str().unwrap(),
            "--set",
            &ckpt,
            "--set",
            "checkpoint.every=1",
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    // Two saves, each stalled 1.5 s per file rename (shard, then manifest on rank 0).
    assert!(
        t0.elapsed() >= Duration::from_secs(3),
        "took {:?}: the variable did not arrive",
        t0.elapsed()
    );
    std::fs::write(dir.path().join(".zrun_env"), "NOT A VARIABLE\n").unwrap();
    let f = zrun(dir.path(), &["train", job.to_str().unwrap()]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains(".zrun_env:1: expected KEY=VALUE"),
        "{}",
        f.stderr
    );
}

/// `data.blend`: a blend of one source trains to the bits of `data.path`
/// on it, as windows of the stream and as packed documents; two sources
/// blend (validation held out from each); and a wrong blend is exit 2 at
/// its line, before anything starts.
#[test]
fn a_data_blend_trains_and_a_wrong_one_is_refused_at_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Two token files of 64-id vocabularies, each a pattern of its own.
    let write = |name: &str, ids: Vec<u16>| {
        let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        std::fs::write(d.join(name), bytes).unwrap();
        d.join(name).display().to_string()
    };
    let a = write(
        "a.bin",
        (0..4000u16).map(|i| (i * 7 + i / 13) % 32).collect(),
    );
    let b = write(
        "b.bin",
        (0..3000u16)
            .map(|i| match i % 11 {
                10 => 0,
                _ => 32 + (i * 5 + i / 7) % 32,
            })
            .collect(),
    );
    let job = |name: &str, data: &str| {
        let p = d.join(format!("{name}.yaml"));
        std::fs::write(
            &p,
            format!(
                "name: {name}\n\
                 model: {{vocab_size: 64, d_model: 32, n_layers: 2, n_heads: 4, seq_len: 16}}\n\
                 data:\n  format: tokens_u16\n  val_fraction: 0.1\n{data}\
                 train: {{steps: 6, micro_batch_size: 4, lr: 3.0e-3, warmup_steps: 2, eval_every: 3}}\n\
                 run_dir: {}/runs/{name}\n",
                d.display()
            ),
        )
        .unwrap();
        p
    };
    let train = |name: &str, data: &str| {
        let m = d.join(format!("{name}.jsonl"));
        let f = TrainArgs::new(job(name, data), &m).run(d);
        assert_eq!(f.code(), 0, "{name}: {f:?}");
        metrics(&m)
    };
    let plain = train("plain", &format!("  path: {a}\n"));
    let one = train(
        "one",
        &format!("  blend:\n    - {{path: {a}, weight: 2.5}}\n"),
    );
    let val = |run: &[serde_json::Value]| -> Vec<f64> {
        run.iter()
            .filter_map(|l| l.get("val_loss")?.as_f64())
            .collect()
    };
    let plain_losses = losses(&plain);
    assert_eq!(plain_losses.len(), 6);
    assert_eq!(
        losses(&one),
        plain_losses,
        "a blend of one source is that source"
    );
    assert_eq!(val(&one), val(&plain), "and so is its held-out tail");
    let two = train(
        "two",
        &format!("  blend:\n    - {{path: {a}, weight: 3}}\n    - {{path: {b}, weight: 1}}\n"),
    );
    let mixed = losses(&two);
    assert_eq!(mixed.len(), 6);
    assert_ne!(mixed, plain_losses, "the second source changed nothing");
    for run in [&one, &two] {
        let validated = run.iter().filter(|l| l.get("val_loss").is_some()).count();
        assert_eq!(validated, 2, "validation at steps 3 and 6: {run:?}");
    }
    // Whole documents packed (each source apart): one source is its
    // data.path's bits, and two train.
    let packed = "  separate_documents: true\n  eos_id: 0\n  packing: bfd\n";
    let plain = losses(&train("packed", &format!("{packed}  path: {a}\n")));
    let one = losses(&train(
        "packed-one",
        &format!("{packed}  blend:\n    - {{path: {a}, weight: 1}}\n"),
    ));
    assert_eq!(one, plain, "a packed blend of one source is that source");
    let two = losses(&train(
        "packed-two",
        &format!(
            "{packed}  blend:\n    - {{path: {a}, weight: 1}}\n    - {{path: {b}, weight: 1}}\n"
        ),
    ));
    assert_eq!(two.len(), 6);
    assert_ne!(two, plain, "the second source changed nothing");
    for (data, line, says) in [
        (
            format!("  path: {a}\n  blend:\n    - {{path: {b}, weight: 1}}\n"),
            7,
            "give the data as data.path or as data.blend, not both".to_string(),
        ),
        (
            format!("  blend:\n    - {{path: {a}, weight: 1}}\n    - {{path: {b}, weight: 0}}\n"),
            6,
            format!("data.blend[1] ({b}): weight 0 must be above 0"),
        ),
        (
            format!("  blend:\n    - {{path: {a}, weight: 1}}\n    - {{path: {d}/none.bin, weight: 1}}\n", d = d.display()),
            6,
            "none.bin`".to_string(),
        ),
    ] {
        let p = job("wrong", &data);
        let m = d.join("wrong.jsonl");
        let f = TrainArgs::new(&p, &m).run(d);
        assert_eq!(f.code(), 2, "{data}: {f:?}");
        assert!(
            f.stderr.contains(&format!("wrong.yaml:{line}:")) && f.stderr.contains(&says),
            "{data}: {}",
            f.stderr
        );
        assert!(!m.exists(), "a refused job wrote metrics");
    }
}

/// `train.epochs` sets the run's length from the data, counted as the
/// workers count it: `ceil(epochs × sequences / global batch)` steps for
/// one worker and for two, the windows of a token file or its packed
/// documents; each metrics line's `epoch` is the sequences consumed over an
/// epoch's; `warmup_ratio` is taken of those steps; and beside
/// `train.steps`, or at 0, it is refused at its key.
#[test]
fn epochs_set_the_run_length_from_the_data() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // 2000 ids; every eleventh is 0, so the documents are 11 ids long.
    let ids: Vec<u16> = (0..2000u16)
        .map(|i| match i % 11 {
            10 => 0,
            _ => 1 + (i * 5 + i / 7) % 60,
        })
        .collect();
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    std::fs::write(d.join("ids.bin"), bytes).unwrap();
    let (seq_len, micro) = (16usize, 4usize);
    let job = d.join("epochs.yaml");
    std::fs::write(
        &job,
        format!(
            "name: epochs\n\
             model: {{vocab_size: 64, d_model: 32, n_layers: 2, n_heads: 4, seq_len: {seq_len}}}\n\
             data: {{path: {}, format: tokens_u16}}\n\
             train:\n  epochs: 1.5\n  micro_batch_size: {micro}\n  lr: 3.0e-3\n  warmup_ratio: 0.1\n\
             run_dir: {}/runs/epochs\n",
            d.join("ids.bin").display(),
            d.display()
        ),
    )
    .unwrap();
    // Windows of seq_len + 1 tokens that do not overlap but by one.
    let windows = (ids.len() - 1) / seq_len;
    let steps_for =
        |epochs: f64, global: usize| (epochs * windows as f64 / global as f64).ceil() as u64;
    for workers in [1usize, 2] {
        let m = d.join(format!("epochs-{workers}.jsonl"));
        let f = TrainArgs::new(&job, &m)
            .args(&["--workers-per-node", &workers.to_string()])
            .run(d);
        assert_eq!(f.code(), 0, "{f:?}");
        let global = micro * workers;
        let steps = steps_for(1.5, global);
        assert!(
            f.stdout.contains(&format!(
                "train.epochs 1.5: {steps} steps of {global} sequences over an epoch of {windows} sequences"
            )),
            "{}",
            f.stdout
        );
        let lines: Vec<_> = metrics(&m)
            .into_iter()
            .filter(|l| l.get("loss").is_some())
            .collect();
        assert_eq!(lines.len() as u64, steps, "{workers} worker(s)");
        for l in &lines {
            let step = l["step"].as_u64().unwrap();
            let want = (step as usize * global) as f64 / windows as f64;
            assert_eq!(l["epoch"].as_f64().unwrap(), want, "step {step}");
        }
        let last = lines.last().unwrap()["epoch"].as_f64().unwrap();
        assert!(
            (1.5..1.5 + global as f64 / windows as f64).contains(&last),
            "{last}"
        );
        // warmup_ratio 0.1 of these steps: the peak rate first on step
        // ceil(0.1 × steps).
        let warmup = (0.1 * steps as f64).ceil() as usize;
        let lr = |s: usize| lines[s - 1]["lr"].as_f64().unwrap();
        // (within rounding: the decay's first step reads the peak)
        assert!((lr(warmup) - 3.0e-3).abs() < 1e-15, "{workers} worker(s)");
        assert!(lr(warmup - 1) < 0.95 * 3.0e-3, "{workers} worker(s)");
    }
    // Packed documents (bfd): an 11-id document leaves no room for another
    // in 17, so an epoch is a sequence a document (the last, without its
    // end-of-text id, one too).
    let documents = ids.len().div_ceil(11);
    let packed = [
        "--set",
        "data.separate_documents=true",
        "--set",
        "data.packing=bfd",
        "--set",
        "data.eos_id=0",
        "--set",
        "train.epochs=2",
    ];
    let mut args = vec!["check", job.to_str().unwrap(), "--workers-per-node", "1"];
    args.extend(packed);
    let f = zrun(d, &args);
    assert_eq!(f.code(), 0, "{f:?}");
    let steps = (2.0 * documents as f64 / micro as f64).ceil() as u64;
    assert!(
        f.stdout.contains(&format!(
            "train.epochs 2: {steps} steps of {micro} sequences over an epoch of {documents} sequences"
        )),
        "{}",
        f.stdout
    );
    assert!(
        f.stdout.contains(&format!("\"steps\": {steps},")),
        "{}",
        f.stdout
    );
    // Resumed on another number of workers: the steps that finish the
    // epochs from the sequences the checkpoint had consumed, at the new
    // batch.
    let ckpt = d.join("ckpt");
    let run = |m: &str, workers: &str, epochs: &str, more: &[&str]| {
        let f = TrainArgs::new(&job, d.join(m))
            .set(format!("checkpoint.dir={}", ckpt.display()))
            .set(format!("train.epochs={epochs}"))
            .args(&["--workers-per-node", workers])
            .args(more)
            .run(d);
        assert_eq!(f.code(), 0, "{m}: {f:?}");
        let lines: Vec<_> = metrics(&d.join(m))
            .into_iter()
            .filter(|l| l.get("loss").is_some())
            .collect();
        (f, lines)
    };
    let (_, first) = run("first.jsonl", "2", "0.5", &[]);
    let first_steps = steps_for(0.5, 8);
    assert_eq!(first.len() as u64, first_steps);
    let consumed = first_steps as usize * 8;
    let left = ((1.5 * windows as f64 - consumed as f64) / 4.0).ceil() as u64;
    let (f, resumed) = run("resumed.jsonl", "1", "1.5", &["--resume", "auto"]);
    let total = first_steps + left;
    assert!(
        f.stdout.contains(&format!(
            "train.epochs 1.5: {total} steps of 4 sequences over an epoch of {windows} sequences"
        )),
        "{}",
        f.stdout
    );
    let steps: Vec<u64> = resumed
        .iter()
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (first_steps + 1..=total).collect::<Vec<_>>());
    for l in &resumed {
        let step = l["step"].as_u64().unwrap();
        let sequences = consumed + (step - first_steps) as usize * 4;
        assert_eq!(
            l["epoch"].as_f64().unwrap(),
            sequences as f64 / windows as f64
        );
    }
    // Checkpoints and validation at each epoch's end (transformers'
    // save_strategy and eval_strategy "epoch"): after the steps that take
    // an epoch's last sequence, and the last.
    let ends = d.join("ends");
    let m = d.join("ends.jsonl");
    let f = TrainArgs::new(&job, &m)
        .set("train.epochs=2.5")
        .set(format!("checkpoint.dir={}", ends.display()))
        .set("checkpoint.every=epoch")
        .set("checkpoint.keep=10")
        .set("train.eval_every=epoch")
        .set(format!("data.val_path={}", d.join("ids.bin").display()))
        .args(&["--workers-per-node", "1"])
        .run(d);
    assert_eq!(f.code(), 0, "{f:?}");
    let mut want: Vec<u64> = (1..=2)
        .map(|k| (k * windows).div_ceil(micro) as u64)
        .collect();
    want.push(steps_for(2.5, micro));
    let validated: Vec<u64> = metrics(&m)
        .iter()
        .filter(|l| l.get("val_loss").is_some())
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(validated, want);
    let mut saved: Vec<u64> = std::fs::read_dir(&ends)
        .unwrap()
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_prefix("step-")?
                .parse()
                .ok()
        })
        .collect();
    saved.sort();
    assert_eq!(saved, want);
    for (set, says) in [
        ("train.steps=5", "train.epochs: goes without train.steps"),
        ("train.epochs=0", "train.epochs: must be above 0, got 0"),
    ] {
        let f = zrun(d, &["check", job.to_str().unwrap(), "--set", set]);
        assert_eq!(f.code(), 2, "{set}: {f:?}");
        assert!(f.stderr.contains(says), "{set}: {}", f.stderr);
    }
}

/// Trains `args` (whose metrics go to `metrics_path`) with `threads`
/// compute threads a worker; returns the worker's peak RSS in bytes.
fn peak_rss_of(dir: &Path, args: &TrainArgs, metrics_path: &Path, threads: &str) -> f64 {
    let env = [("RAYON_NUM_THREADS", threads)];
    let f = e2e::Zrun::start_with_env(dir, &args.as_strs(), &env).wait(Duration::from_secs(180));
    assert_eq!(f.code(), 0, "{f:?}");
    metrics(metrics_path).pop().unwrap()["peak_rss_bytes"]
        .as_f64()
        .unwrap()
}

/// What `zrun estimate --json` (with `options`, after the job) says a
/// worker of `threads` compute threads holds at its peak: the process, its
/// model states, its collectives' buffers, its activations and backward's
/// passing gradients, and the attention's work matrices of each thread.
fn estimated_worker_bytes(dir: &Path, job: &Path, options: &[&str], threads: &str) -> f64 {
    let job = job.display().to_string();
    let mut args = vec!["estimate", &job, "--json"];
    args.extend(options);
    let env = [("RAYON_NUM_THREADS", threads)];
    let e = e2e::Zrun::start_with_env(dir, &args, &env).wait(Duration::from_secs(30));
    assert_eq!(e.code(), 0, "{e:?}");
    let e: serde_json::Value = serde_json::from_str(&e.stdout).unwrap();
    e["peak_per_worker"].as_f64().unwrap()
}

/// A long sequence's memory grows with it as `zrun estimate` says, linearly:
/// a GPT of width 32 at 8192 tokens, one worker of two threads, against
/// the same job at 64 tokens. The attention's work matrices are a chunk of
/// query rows each (`attention work per thread`, counted with the
/// activations); they were `t × t`, 1.1 GB here where the estimate said
/// 0.13.
#[test]
fn a_long_sequence_holds_about_what_the_estimate_says() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "long", 1);
    let at = |t: usize| {
        let sets = [
            format!("model.seq_len={t}"),
            "train.micro_batch_size=1".into(),
            "model.n_layers=1".into(),
        ];
        let m = dir.path().join(format!("{t}.jsonl"));
        let mut args = TrainArgs::new(&job, &m).args(&["--workers-per-node", "1"]);
        let mut options = vec!["--workers-per-node", "1"];
        for s in &sets {
            args = args.set(s.as_str());
            options.extend(["--set", s.as_str()]);
        }
        (
            peak_rss_of(dir.path(), &args, &m, "2"),
            estimated_worker_bytes(dir.path(), &job, &options, "2"),
        )
    };
    let (short, short_predicted) = at(64);
    let (long, long_predicted) = at(8192);
    let (grew, predicted) = (long - short, long_predicted - short_predicted);
    println!("peak RSS {short:.0} → {long:.0} bytes: {grew:.0} more, predicted {predicted:.0}");
    // Measured 1.2x (2026-12-06) while the estimate left out backward's
    // passing gradients; 1.15x with them (2026-12-07).
    assert!(
        grew <= 1.35 * predicted && grew >= 0.8 * predicted,
        "peak RSS grew by {grew:.0} bytes from 64 to 8192 tokens; the estimate says {predicted:.0}"
    );
}

/// `zrun estimate`'s figure for a worker (model states, the collectives'
/// buffers, activations, attention's work) against the worker's peak RSS,
/// on gpt-anchor's model at 2 workers: stage 0 and stage 3 with the
/// default reduce bucket (the whole gradient), and stage 0 with small
/// buckets. The figures differ between the three as the peaks do: stage 3
/// holds a sixth of stage 0's states but gathers the parameters (what an
/// estimate of states alone put at twice the peaks' difference), and a
/// whole-gradient bucket is kept between steps at stages 0-2.
#[test]
fn the_estimate_moves_with_the_stage_and_the_bucket_as_peak_memory_does() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "anchor", 2);
    let model = "model={vocab_size: 256, d_model: 384, n_layers: 6, n_heads: 6, seq_len: 256}";
    let at = |stage: u8, bucket: &str| {
        let sets = [
            model.to_string(),
            "train.micro_batch_size=8".into(),
            format!("zero.stage={stage}"),
            format!("zero.reduce_bucket_size={bucket}"),
        ];
        let m = dir.path().join(format!("{stage}-{bucket}.jsonl"));
        let mut args = TrainArgs::new(&job, &m).args(&["--workers-per-node", "2"]);
        let mut options = vec!["--workers-per-node", "2"];
        for s in &sets {
            args = args.set(s.as_str());
            options.extend(["--set", s.as_str()]);
        }
        let rss = peak_rss_of(dir.path(), &args, &m, "1");
        let predicted = estimated_worker_bytes(dir.path(), &job, &options, "1");
        println!("stage {stage}, bucket {bucket}: peak RSS {rss:.0}, estimate {predicted:.0}");
        // Measured 1.09-1.12x (2026-12-06) while backward's passing
        // gradients and the process's own memory were left out; 1.05x
        // with them (2026-12-07): what is left is glibc's, the threads'
        // GEMM packing buffers and the synthetic data (1.02x with small
        // buckets, of which the estimate counts the two backward may hold).
        assert!(
            (0.95..1.2).contains(&(rss / predicted)),
            "stage {stage}, bucket {bucket}: peak RSS {rss:.0} bytes, the estimate {predicted:.0}"
        );
        (rss, predicted)
    };
    let whole = at(0, "5e7");
    let stage3 = at(3, "5e7");
    let small = at(0, "1e6");
    for (what, a, b) in [
        ("stage 0 over 3", whole, stage3),
        ("5e7 over 1e6", whole, small),
    ] {
        let (grew, predicted) = (a.0 - b.0, a.1 - b.1);
        println!("{what}: peak RSS {grew:.0} bytes more, the estimate {predicted:.0}");
        // Measured 0.89x and 0.93x alone (0.84x and 0.97x on 2026-12-07);
        // 0.57x for the small buckets once in CI, beside the other tests,
        // while the buckets in flight were unbounded (16 MB more than
        // alone). Now backward holds two at most, which the estimate
        // counts (one block's 7 MB each): 0.86-0.94x and 1.32-1.42x
        // alone, the second as one bucket is held where the reductions
        // keep up (1.24x by that alone, the rest the peaks' few MB of
        // noise); the same under two busy loops beside it (2026-12-07).
        assert!(
            predicted > 0.0 && (0.5..1.6).contains(&(grew / predicted)),
            "{what}: peak RSS {grew:.0} bytes more, the estimate {predicted:.0}"
        );
    }
}

/// A large vocabulary's head: at GPT-2's 50,304 tokens and width 256 the
/// output matrix's f32 gradient (51.5 MB) is a sixth of what a worker
/// holds. The head adds it into the embedding's gradient buffer itself
/// where that holds none of the micro-batch's yet (measured 1.08x the
/// estimate); with two micro-batches a step at stage 0 the second's is made
/// a run of 16 MiB of rows at a time and added (1.08x; 1.07x while it was
/// made whole, which the estimate counted). At stage 2 the embedding's gradient is staged for its bucket from
/// the head's backward to the embedding's, which the estimate counts (1.10x;
/// 1.43x before, and the bucket's close on one rank copied it again). With
/// the token table frozen a worker holds neither that gradient
/// nor the table's gradient and moments, nor does it make them on the way:
/// the embedding's backward makes only the rows its tokens picked, and a
/// frozen table's pages of gradient and moments are never written
/// (measured 1.19x; 2.04x while the whole table's gradient was made each
/// micro-batch and the zeroed buffers were written through at the start).
/// With bf16 gradients the head hands its f32 gradient over in runs, and
/// under bf16 products its cross-entropy pairs the logits' gradient in
/// place (measured 1.09x on a Zen 4 with AVX512_BF16). Those figures
/// left out the process's own memory and backward's passing gradients;
/// with them the five measured 1.03-1.07x (2026-12-07).
#[test]
fn a_large_vocabularys_head_holds_about_what_the_estimate_says() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "vocab", 2);
    for (case, extra) in [
        ("in place", None),
        ("two micro-batches", Some("train.grad_accum=2")),
        ("stage 2", Some("zero.stage=2")),
        ("frozen table", Some("train.freeze=[wte.weight]")),
        ("bf16", Some("train.dtype=bf16")),
    ] {
        let sets = [
            "model={vocab_size: 50304, d_model: 256, n_layers: 2, n_heads: 4, seq_len: 64}",
            "train.micro_batch_size=2",
        ];
        let m = dir.path().join(format!("{}.jsonl", case.replace(' ', "-")));
        let mut args = TrainArgs::new(&job, &m).args(&["--workers-per-node", "1"]);
        let mut options = vec!["--workers-per-node", "1"];
        for s in sets.into_iter().chain(extra) {
            args = args.set(s);
            options.extend(["--set", s]);
        }
        let rss = peak_rss_of(dir.path(), &args, &m, "2");
        let predicted = estimated_worker_bytes(dir.path(), &job, &options, "2");
        println!("{case}: peak RSS {rss:.0} bytes, the estimate {predicted:.0}");
        // Measured 1.03-1.07x (2026-12-07, Zen 4).
        assert!(
            (0.95..1.15).contains(&(rss / predicted)),
            "{case}: peak RSS {rss:.0} bytes, the estimate {predicted:.0}"
        );
    }
}

/// `train.curriculum` (DeepSpeed's sequence-length curriculum): each step
/// trains on as many tokens of its sequences as DeepSpeed's `fixed_linear`
/// gives at its step (8, 16, 24, then the model's 32: `seq_len` in the
/// metrics and the CSV monitor's `train_seq_len.csv`, and the step's
/// tokens counted at that length); stages 0 and 3
/// agree to the bit, and a run resumed from step 3's checkpoint gives the
/// uninterrupted run's losses and lengths. The same curriculum written as
/// a ds_config's `curriculum_learning` trains to the same bits, and `zrun
/// check` says where the length settles and the share of tokens kept.
#[test]
fn a_sequence_length_curriculum_grows_by_the_step_and_its_stages_and_resume_agree() {
    let dir = tempfile::tempdir().unwrap();
    let job = e2e::ckpt_job(dir.path(), "curriculum", 6, 3);
    let curriculum = "train.curriculum={min_difficulty: 8, schedule_type: fixed_linear, total_curriculum_step: 4, difficulty_step: 8}";
    let run = |out: &str, extra: &[&str]| {
        let m = dir.path().join(out);
        let mut args = vec![
            "train",
            job.to_str().unwrap(),
            "--no-progress",
            "--metrics",
            m.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let f = zrun(dir.path(), &args);
        assert_eq!(f.code(), 0, "{f:?}");
        metrics(&m)
            .into_iter()
            .filter(|l| l.get("loss").is_some())
            .map(|l| {
                let length = l["seq_len"]
                    .as_u64()
                    .expect("a curriculum step has seq_len");
                let rate = l["tokens_per_s"].as_f64().unwrap();
                let tokens = rate * l["step_ms"].as_f64().unwrap() / 1e3;
                let flops_per_token = l["tflops"].as_f64().unwrap() * 1e12 / rate;
                (
                    l["step"].as_u64().unwrap(),
                    l["loss"].as_f64().unwrap(),
                    length,
                    tokens,
                    flops_per_token,
                )
            })
            .collect::<Vec<_>>()
    };
    // Step, loss and length (the tokens, a product of two rounded
    // figures, are checked apart).
    let steps =
        |r: &[(u64, f64, u64, f64, f64)]| r.iter().map(|s| (s.0, s.1, s.2)).collect::<Vec<_>>();
    // `zrun check` says what the curriculum does to the run.
    let f = zrun(
        dir.path(),
        &["check", job.to_str().unwrap(), "--set", curriculum],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(
        f.stdout.contains(
            "# curriculum: 8 tokens a sequence at step 1, 32 from step 4 of 6: 75.0% of the tokens"
        ),
        "{}",
        f.stdout
    );
    let csv = dir.path().join("csv");
    let csv_set = format!("csv_monitor={}", csv.display());
    let stage0 = run("stage0.jsonl", &["--set", curriculum, "--set", &csv_set]);
    let lengths: Vec<u64> = stage0.iter().map(|s| s.2).collect();
    assert_eq!(lengths, [8, 16, 24, 32, 32, 32]);
    // The CSV monitor's file of the scalar says the same.
    let csv_lengths = e2e::csv_by_step(&csv.join("train_seq_len.csv"));
    assert_eq!(
        csv_lengths,
        [
            (1, 8.0),
            (2, 16.0),
            (3, 24.0),
            (4, 32.0),
            (5, 32.0),
            (6, 32.0)
        ]
    );
    // The model FLOPs a token grow with the length by attention's part
    // alone, linearly: 8 → 16 adds what 24 → 32 adds.
    let per_token: Vec<f64> = stage0.iter().map(|s| s.4).collect();
    let (early, late) = (per_token[1] - per_token[0], per_token[3] - per_token[2]);
    assert!(
        early > 0.0 && (early - late).abs() < 1e-6 * early,
        "{per_token:?}"
    );
    assert!(
        (per_token[5] - per_token[3]).abs() < 1e-9 * per_token[3],
        "{per_token:?}"
    );
    for &(step, _, length, tokens, _) in &stage0 {
        // 2 workers × micro-batch 4 sequences of `length` tokens.
        let want = (8 * length) as f64;
        assert!(
            (tokens - want).abs() < 1e-6 * want,
            "step {step}: {tokens} tokens, want {want}"
        );
    }
    let stage3 = run(
        "stage3.jsonl",
        &[
            "--set",
            curriculum,
            "--set",
            "zero.stage=3",
            "--set",
            "checkpoint.every=0",
            "--set",
            "checkpoint.dir=null",
        ],
    );
    assert_eq!(steps(&stage3), steps(&stage0), "stage 3 against stage 0");
    // Resume from step 3: lose the final checkpoint, keep the one before.
    std::fs::remove_dir_all(dir.path().join("ckpt/step-00000006")).unwrap();
    let resumed = run("resumed.jsonl", &["--set", curriculum, "--resume", "auto"]);
    assert_eq!(
        steps(&resumed),
        steps(&stage0[3..]),
        "resumed against uninterrupted"
    );
    // DeepSpeed's section, the same curriculum.
    let ds = dir.path().join("ds.json");
    std::fs::write(
        &ds,
        r#"{"gradient_clipping": 1.0, "curriculum_learning": {"enabled": true, "curriculum_type": "seqlen",
            "min_difficulty": 8, "max_difficulty": 32, "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8}}}"#,
    )
    .unwrap();
    let from_ds = run(
        "ds.jsonl",
        &[
            "--deepspeed",
            ds.to_str().unwrap(),
            "--set",
            "checkpoint.every=0",
            "--set",
            "checkpoint.dir=null",
        ],
    );
    assert_eq!(steps(&from_ds), steps(&stage0), "ds_config against the job");
}
