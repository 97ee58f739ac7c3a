//! Checkpoints end to end: bit-exact resume, resume at another world size and
//! stage, export, init from an export, damaged checkpoints, a crash mid-save.

mod gpt2_reference;
mod reference_common;

use std::path::Path;
use std::time::Duration;

use e2e::{children_of, ckpt_job, export_ckpt, losses_by_step, wait_until, zrun, TrainArgs};
use gpt2_reference::{Gpt2, Gpt2Shape};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

fn train(dir: &Path, job: &Path, metrics: &str, extra: &[&str]) -> e2e::Finished {
    let args = TrainArgs::new(job, dir.join(metrics)).args(extra);
    let f = args.run(dir);
    assert_eq!(f.code(), 0, "{args:?}: {f:?}");
    f
}

/// f32 at stages 0 and 3, bf16 at stage 1, and f16 at stage 3 started at a loss
/// scale of 2^24 so that its first steps overflow: the resumed run must restore
/// the master weights, the scaler and the count of skipped steps to match. The
/// loss scale of every resumed step is compared too. For f16 the checkpoint
/// (step 8, window 2) falls after the last of the first overflows (step 7) and
/// before the scale grows (step 9's update, `(iter - last_overflow) % window`):
/// a resumed scaler that forgot `last_overflow` grows a step late, or never.
///
/// With `model.hidden_dropout` and `model.attention_dropout` (stage 2,
/// f32) too: the resumed steps drop the elements the uninterrupted ones
/// dropped. And with Lion (stage 3, bf16) and Adagrad (stage 2, f32):
/// the one state each keeps carries over (Lion's moment `exp_avg`,
/// Adagrad's sum of squares `sum`), their shards hold no second moment; a
/// run with AdamW refuses their checkpoints (exit 2, naming both rules),
/// as Lion refuses AdamW's.
#[test]
fn resume_continues_bit_identically_in_every_precision() {
    for (stage, dtype, every, dropout, rule) in [
        ("0", "f32", 6, "0", "adamw"),
        ("3", "f32", 6, "0", "adamw"),
        ("1", "bf16", 6, "0", "adamw"),
        ("3", "f16", 4, "0", "adamw"),
        ("2", "f32", 6, "0.2", "adamw"),
        ("3", "bf16", 6, "0", "lion"),
        ("2", "f32", 6, "0", "adagrad"),
    ] {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        let job = ckpt_job(dir, "resume", 12, every);
        let set = format!("zero.stage={stage}");
        let dt = format!("train.dtype={dtype}");
        let hidden = format!("model.hidden_dropout={dropout}");
        let attention = format!("model.attention_dropout={dropout}");
        let optimizer = format!("train.optimizer.type={rule}");
        // Adagrad's sums start at 0.1: added at the first update only, so
        // a resumed run that added it again would leave the straight one.
        let first = match rule {
            "adagrad" => "train.optimizer.initial_accumulator_value=0.1",
            _ => "train.seed=42",
        };
        let set = &[
            "--set",
            &optimizer,
            "--set",
            first,
            "--set",
            &set,
            "--set",
            &dt,
            "--set",
            "train.loss_scale.initial_scale_power=24",
            "--set",
            "train.loss_scale.loss_scale_window=2",
            "--set",
            &hidden,
            "--set",
            &attention,
        ];
        train(dir, &job, "straight.jsonl", set);
        let straight = losses_by_step(&dir.join("straight.jsonl"));
        // Lose the final checkpoint, keep the one before, and resume from it.
        std::fs::remove_dir_all(dir.join("ckpt/step-00000012")).unwrap();
        let from = 12 - every as usize;
        let f = train(
            dir,
            &job,
            "resumed.jsonl",
            &[set.as_slice(), &["--resume", "auto"]].concat(),
        );
        assert!(
            f.stdout.contains("resuming from") && f.stdout.contains(&format!("step-{from:08}")),
            "{}",
            f.stdout
        );
        let resumed = losses_by_step(&dir.join("resumed.jsonl"));
        assert_eq!(
            resumed.iter().map(|x| x.0).collect::<Vec<_>>(),
            (from as u64 + 1..=12).collect::<Vec<_>>()
        );
        assert_eq!(
            resumed,
            straight[from..].to_vec(),
            "stage {stage} {dtype} {rule}"
        );
        // A shard holds the state the rule keeps: Lion has no exp_avg_sq,
        // Adagrad only its sum.
        let shard =
            std::fs::read(dir.join(format!("ckpt/step-{from:08}/rank-00000.safetensors"))).unwrap();
        let names = safetensors::SafeTensors::deserialize(&shard)
            .unwrap()
            .names()
            .len();
        let groups = names / if rule == "adamw" { 3 } else { 2 };
        let has = |kind: &str| {
            let file = safetensors::SafeTensors::deserialize(&shard).unwrap();
            (0..groups).all(|g| file.tensor(&format!("g{g}.{kind}")).is_ok())
        };
        assert!(has("params"), "{rule}: {names} tensors");
        assert_eq!(has("exp_avg"), rule != "adagrad", "{rule}: {names} tensors");
        assert_eq!(has("sum"), rule == "adagrad", "{rule}: {names} tensors");
        assert_eq!(
            has("exp_avg_sq"),
            rule == "adamw",
            "{rule}: {names} tensors"
        );
        let other = match rule {
            "adamw" => "lion",
            _ => "adamw",
        };
        if rule != "adamw" || stage == "0" {
            let swapped = format!("train.optimizer.type={other}");
            let mut args = set.to_vec();
            args[1] = &swapped;
            args[3] = "train.seed=42";
            let f = TrainArgs::new(&job, dir.join("swapped.jsonl"))
                .args(&args)
                .args(&["--resume", "auto"])
                .run(dir);
            assert_eq!(f.code(), 2, "{f:?}");
            assert!(
                f.stderr.contains(&format!(
                    "its optimizer state is {rule}'s, and the job's train.optimizer.type is {other}"
                )),
                "{}",
                f.stderr
            );
        }
        let scales = |f: &str| -> Vec<(u64, Option<f64>, bool)> {
            e2e::metrics(&dir.join(f))
                .iter()
                .filter(|l| l.get("step").is_some() && l.get("loss").is_some())
                .map(|l| {
                    (
                        l["step"].as_u64().unwrap(),
                        l["loss_scale"].as_f64(),
                        l["grad_norm"].is_null(),
                    )
                })
                .collect()
        };
        let straight_scales = scales("straight.jsonl");
        assert_eq!(
            scales("resumed.jsonl"),
            straight_scales[from..].to_vec(),
            "stage {stage} {dtype}: loss scales"
        );
        if dtype == "f16" {
            // The shape this test relies on: steps 1-7 overflow, step 8 does not,
            // and the scale grows right after the checkpoint.
            let skipped: Vec<bool> = straight_scales.iter().map(|s| s.2).collect();
            assert_eq!(
                &skipped[..8],
                &[true, true, true, true, true, true, true, false],
                "{straight_scales:?}"
            );
            assert!(
                straight_scales[9].1 > straight_scales[8].1,
                "no growth at step 10 to observe: {straight_scales:?}"
            );
        }
    }
}

#[test]
fn resume_anywhere_moves_nothing_and_continues_smoothly() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let job = ckpt_job(dir, "anywhere", 20, 10);
    // 2 workers at stage 3, checkpoint at step 10, then on to 20.
    train(
        dir,
        &job,
        "orig.jsonl",
        &[
            "--set",
            "zero.stage=3",
            "--set",
            "zero.param_persistence_threshold=0",
        ],
    );
    let orig = losses_by_step(&dir.join("orig.jsonl"));
    let ck10 = dir.join("ckpt/step-00000010");
    let exp_orig = dir.join("orig.safetensors");
    let f = zrun(
        dir,
        &[
            "export",
            ck10.to_str().unwrap(),
            "--out",
            exp_orig.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    // Resume on 3 workers at stage 2 with train.steps = 10: no step, a new checkpoint.
    let moved_root = dir.join("moved");
    let moved_set = format!("checkpoint.dir={}", moved_root.display());
    let f = train(
        dir,
        &job,
        "moved.jsonl",
        &[
            "--workers-per-node",
            "3",
            "--set",
            "zero.stage=2",
            "--set",
            "train.steps=10",
            "--set",
            &moved_set,
            "--resume",
            ck10.to_str().unwrap(),
        ],
    );
    assert!(losses_by_step(&dir.join("moved.jsonl")).is_empty(), "{f:?}");
    // Said as such, not as a final loss of NaN.
    assert!(
        f.stdout
            .contains("zrun: done: 10 steps, no step left to run"),
        "{}",
        f.stdout
    );
    let moved = moved_root.join("step-00000010");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(moved.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(
        (manifest["world_size"].as_u64(), manifest["stage"].as_u64()),
        (Some(3), Some(2))
    );
    let exp_moved = dir.join("moved.safetensors");
    assert_eq!(
        zrun(
            dir,
            &[
                "export",
                moved.to_str().unwrap(),
                "--out",
                exp_moved.to_str().unwrap()
            ]
        )
        .code(),
        0
    );
    assert!(
        std::fs::read(&exp_orig).unwrap() == std::fs::read(&exp_moved).unwrap(),
        "exports differ"
    );
    // And training goes on from there on 3 workers without a jump in the loss.
    train(
        dir,
        &job,
        "after.jsonl",
        &[
            "--workers-per-node",
            "3",
            "--set",
            "zero.stage=2",
            "--set",
            &moved_set,
            "--resume",
            moved.to_str().unwrap(),
        ],
    );
    let after = losses_by_step(&dir.join("after.jsonl"));
    assert_eq!(after[0].0, 11);
    let (fresh, before, next) = (orig[0].1, orig[9].1, after[0].1);
    assert!(
        (next - before).abs() < 0.25 * (fresh - before).abs(),
        "loss jumped: fresh {fresh:.4}, at the checkpoint {before:.4}, after resuming {next:.4}"
    );
    // The optimizer state survives the round trip 2 → 3 workers → 2 exactly:
    // resumed from the moved checkpoint on the original 2 workers at stage 3,
    // steps 11-20 are bit-identical to the uninterrupted run's, which needs
    // Adam's moments, its step count and the schedule's position intact
    // (the exports above compare only parameters).
    let back_set = format!("checkpoint.dir={}", dir.join("back").display());
    train(
        dir,
        &job,
        "back.jsonl",
        &[
            "--set",
            "zero.stage=3",
            "--set",
            "zero.param_persistence_threshold=0",
            "--set",
            &back_set,
            "--resume",
            moved.to_str().unwrap(),
        ],
    );
    assert_eq!(
        losses_by_step(&dir.join("back.jsonl")),
        orig[10..].to_vec(),
        "steps 11-20 after a round trip through 3 workers differ from the uninterrupted run"
    );
}

#[test]
fn export_feeds_init_from_and_reproduces_the_next_loss() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    // A corpus of exactly one global batch (4 windows of 32 + 1 tokens), so every
    // step sees the same sequences and "the next loss" means the same thing to both runs.
    let text: Vec<u8> = (0..4 * 32 + 1)
        .map(|i| b"the quick brown fox jumps over the lazy dog. "[i % 45])
        .collect();
    std::fs::write(dir.join("one-batch.txt"), &text).unwrap();
    let job = ckpt_job(dir, "export", 5, 4);
    let data = format!("data.path={}/one-batch.txt", dir.display());
    let common = [
        "--set",
        &data,
        "--set",
        "data.format=text",
        "--set",
        "model.vocab_size=256",
        "--set",
        "train.micro_batch_size=2",
    ];
    let mut args = common.to_vec();
    args.extend(["--set", "zero.stage=3"]);
    train(dir, &job, "src.jsonl", &args);
    let src = losses_by_step(&dir.join("src.jsonl"));
    // An export into the checkpoint it reads could replace a shard: refused.
    let shard = dir.join("ckpt/step-00000004/rank-00000.safetensors");
    let before = std::fs::read(&shard).unwrap();
    let f = zrun(
        dir,
        &[
            "export",
            "ckpt/step-00000004",
            "--out",
            shard.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("inside the checkpoint"), "{}", f.stderr);
    assert_eq!(std::fs::read(&shard).unwrap(), before);
    // A directory for the one-file export: refused before anything is
    // written, even with --overwrite (it failed at the rename, after the
    // whole export), and the directory is as it was.
    let existing = dir.join("exports");
    std::fs::create_dir(&existing).unwrap();
    std::fs::write(existing.join("keep.txt"), "mine").unwrap();
    let f = zrun(
        dir,
        &[
            "export",
            "ckpt/step-00000004",
            "--out",
            existing.to_str().unwrap(),
            "--overwrite",
        ],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("a directory; the export is one file"),
        "{}",
        f.stderr
    );
    let left: Vec<_> = std::fs::read_dir(&existing)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["keep.txt"]);
    let out = dir.join("w.safetensors");
    let f = zrun(
        dir,
        &[
            "export",
            dir.join("ckpt/step-00000004").to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    // Every parameter, under its own name.
    let params = e2e::metrics(&dir.join("src.jsonl"))[0]["params"]
        .as_u64()
        .unwrap();
    assert!(
        f.stdout.contains(&format!("wrote {params} parameters")),
        "{}",
        f.stdout
    );
    // A second export to the same file keeps the first (an export may be
    // the only copy of weights whose checkpoint has rotated away); with
    // --overwrite it is replaced. The same for a Hugging Face directory.
    let first = std::fs::read(&out).unwrap();
    std::fs::write(&out, b"an earlier export").unwrap();
    let again = |extra: &[&str]| {
        let ck = dir.join("ckpt/step-00000004");
        let args = [&["export", ck.to_str().unwrap()][..], extra].concat();
        zrun(dir, &args)
    };
    let f = again(&["--out", out.to_str().unwrap()]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("exists; it is kept"), "{}", f.stderr);
    assert_eq!(std::fs::read(&out).unwrap(), b"an earlier export");
    let f = again(&["--out", out.to_str().unwrap(), "--overwrite"]);
    assert_eq!(f.code(), 0, "{f:?}");
    assert_eq!(std::fs::read(&out).unwrap(), first);
    let hf = dir.join("hf");
    assert_eq!(
        again(&["--format", "hf", "--out", hf.to_str().unwrap()]).code(),
        0
    );
    let f = again(&["--format", "hf", "--out", hf.to_str().unwrap()]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("config.json exists"), "{}", f.stderr);
    // An independent reader of GPT-2 files computes the same next loss from
    // the export: its names, shapes and layout are GPT-2's. Measured: within
    // 6e-8 relative of zrun's f32 loss; the bound is 2e-6.
    let reference = Gpt2::load(
        &out,
        Gpt2Shape {
            vocab: 256,
            d: 32,
            layers: 2,
            heads: 4,
            max_seq: 32,
        },
    );
    let windows: Vec<Vec<u32>> = (0..4)
        .map(|w| {
            text[w * 32..w * 32 + 33]
                .iter()
                .map(|&b| u32::from(b))
                .collect()
        })
        .collect();
    let independent = reference.loss(&windows);
    let next = src[4].1;
    assert!(
        (independent - next).abs() <= 2e-6 * next,
        "zrun's step-5 loss {next}; a GPT-2 reader of the export computes {independent}"
    );
    let one_step = e2e::one_step_from(&out);
    // The first loss of one step from the export.
    let first_loss = |metrics: &str, extra: &[&str]| {
        let mut args = common.to_vec();
        args.extend(one_step.iter().map(String::as_str));
        args.extend(extra);
        train(dir, &job, metrics, &args);
        losses_by_step(&dir.join(metrics))[0].1
    };
    let one_worker = [
        "--workers-per-node",
        "1",
        "--set",
        "train.micro_batch_size=4",
    ];
    let init_loss = first_loss("init.jsonl", &one_worker);
    assert!(
        (init_loss - next).abs() <= 1e-5 * next,
        "export's next loss {next}, from init_from {init_loss}"
    );
    // With each word a document (`data.separate_documents`, ended by the
    // space) on two workers, the first loss is the reader's mean over the
    // words each scored alone from position 0, the target after each space
    // left out: what GPT-2's position rows, restarted, and attention kept
    // to the word give.
    let apart = [
        "--set",
        "data.separate_documents=true",
        "--set",
        "data.eos_id=32",
    ];
    let words_loss = first_loss("words.jsonl", &apart);
    let independent = reference.loss_of_documents(&windows, u32::from(b' '));
    assert!(
        (words_loss - independent).abs() <= 1e-5 * independent,
        "words kept apart: zrun's loss {words_loss}, the reader's {independent}"
    );
    // From the Hugging Face directory at sequences of 16 (`model:` naming
    // nothing else): the model keeps its 32 positions, of which the job
    // uses the first 16, so one batch of all eight windows of 17 tokens
    // starts at the reader's mean over them; its export declares 32
    // positions again.
    let bare = dir.join("bare.yaml");
    let job_text = std::fs::read_to_string(&job).unwrap();
    let model_at = job_text.find("model:").unwrap();
    let model_end = model_at + job_text[model_at..].find('\n').unwrap();
    let hf_model = format!("model: {{init_from: {}, seq_len: 16}}", hf.display());
    std::fs::write(
        &bare,
        job_text.replace(&job_text[model_at..model_end], &hf_model),
    )
    .unwrap();
    let sixteen: Vec<Vec<u32>> = (0..8)
        .map(|w| {
            text[w * 16..w * 16 + 17]
                .iter()
                .map(|&b| u32::from(b))
                .collect()
        })
        .collect();
    let shorter_ckpt = format!("checkpoint.dir={}/ckpt-shorter", dir.display());
    let shorter = [
        "--set",
        &data,
        "--set",
        "data.format=text",
        "--set",
        "train.steps=1",
        "--set",
        "train.micro_batch_size=8",
        "--set",
        &shorter_ckpt,
        "--set",
        "checkpoint.every=1",
        "--workers-per-node",
        "1",
    ];
    train(dir, &bare, "shorter.jsonl", &shorter);
    let loss = losses_by_step(&dir.join("shorter.jsonl"))[0].1;
    let want = reference.loss(&sixteen);
    assert!(
        (loss - want).abs() <= 1e-5 * want,
        "from the directory at seq_len 16: zrun's first loss {loss}, the reader's {want}"
    );
    let shorter_hf = dir.join("hf-shorter");
    e2e::export_hf(dir, &dir.join("ckpt-shorter"), &shorter_hf);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(shorter_hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (&config["n_positions"], &config["n_ctx"]),
        (&32.into(), &32.into())
    );
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("ckpt-shorter/step-00000001/manifest.json")).unwrap(),
    )
    .unwrap();
    // The checkpoint samples and evaluates with the model's whole context,
    // as its export does (a 20-byte prompt and 30 more: past 16 tokens).
    let ckpt_shorter = dir.join("ckpt-shorter/step-00000001");
    for command in [
        vec![
            "sample",
            "--prompt",
            "the quick brown fox ",
            "--tokens",
            "30",
            "--temperature",
            "0",
        ],
        vec!["eval", "--data", "one-batch.txt"],
    ] {
        let on = |model: &Path| {
            let f = zrun(
                dir,
                &[&command[..1], &[model.to_str().unwrap()], &command[1..]].concat(),
            );
            assert_eq!(f.code(), 0, "{f:?}");
            f.stdout
        };
        assert_eq!(on(&ckpt_shorter), on(&shorter_hf), "{command:?}");
    }
    let model = &manifest["model"];
    assert_eq!(
        (&model["seq_len"], &model["max_position_embeddings"]),
        (&16.into(), &32.into()),
        "{model}"
    );
    // Sharp attention: the q and k columns of each c_attn times 16 (the
    // scores 256 times larger), v's times 8. A model trained five steps
    // attends almost uniformly, so that the step-5 check barely feels the
    // attention; here the first loss from the rescaled export is the
    // reader's within 1e-6, and the reader's loss with scores 1% larger
    // moves by more than ten times that.
    let shape = || Gpt2Shape {
        vocab: 256,
        d: 32,
        layers: 2,
        heads: 4,
        max_seq: 32,
    };
    let sharp = attention_rescaled(&out, &dir.join("sharp.safetensors"), [16.0, 16.0, 8.0], 32);
    let off = attention_rescaled(&out, &dir.join("off.safetensors"), [16.16, 16.0, 8.0], 32);
    let want = Gpt2::load(&sharp, shape()).loss(&windows);
    let moved = (Gpt2::load(&off, shape()).loss(&windows) - want).abs();
    let mut args = common.to_vec();
    let from_sharp = e2e::one_step_from(&sharp);
    args.extend(from_sharp.iter().map(String::as_str));
    args.extend(one_worker);
    train(dir, &job, "sharp.jsonl", &args);
    let loss = losses_by_step(&dir.join("sharp.jsonl"))[0].1;
    assert!(
        (loss - want).abs() <= 1e-6 * want && moved > 1e-5 * want,
        "sharp attention: zrun's first loss {loss}, the reader's {want}, {moved} from scores 1% larger"
    );
}

/// A copy of the GPT-2 export `from` at `to` with the q, k and v columns of
/// each layer's `c_attn` (weight `[d, 3d]` and bias) multiplied by
/// `factors`.
fn attention_rescaled(from: &Path, to: &Path, factors: [f32; 3], d: usize) -> std::path::PathBuf {
    e2e::rescaled_safetensors(from, to, |name, _, i| {
        match name.ends_with("attn.c_attn.weight") || name.ends_with("attn.c_attn.bias") {
            true => factors[i % (3 * d) / d],
            false => 1.0,
        }
    });
    to.to_path_buf()
}

/// Documents kept apart and packed whole (`data.separate_documents`,
/// `data.packing: bfd`, lines of text ended by their newline): a run at
/// stage 3 gives stage 0's losses to the bit, and one resumed from its
/// step-6 checkpoint continues them to the bit (the packed sequences and
/// their order are the same after the restart).
#[test]
fn packed_documents_resume_and_agree_across_stages() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let text: String = (0..400)
        .map(|i| format!("{}\n", "line of text ".repeat(1 + i % 5)))
        .collect();
    std::fs::write(dir.join("lines.txt"), text).unwrap();
    let job = ckpt_job(dir, "packed", 12, 6);
    let data = format!("data.path={}/lines.txt", dir.display());
    let common = [
        "--set",
        &data,
        "--set",
        "data.format=text",
        "--set",
        "model.vocab_size=256",
        "--set",
        "data.separate_documents=true",
        "--set",
        "data.eos_id=10",
        "--set",
        "data.packing=bfd",
    ];
    let run = |metrics: &str, extra: &[&str]| {
        train(dir, &job, metrics, &[&common[..], extra].concat());
        losses_by_step(&dir.join(metrics))
    };
    let straight = run("straight.jsonl", &["--set", "zero.stage=0"]);
    assert_eq!(straight.len(), 12);
    std::fs::remove_dir_all(dir.join("ckpt")).unwrap();
    let stage3 = run("stage3.jsonl", &["--set", "zero.stage=3"]);
    assert_eq!(stage3, straight, "stage 3 against stage 0");
    std::fs::remove_dir_all(dir.join("ckpt/step-00000012")).unwrap();
    let resumed = run(
        "resumed.jsonl",
        &["--set", "zero.stage=3", "--resume", "auto"],
    );
    assert_eq!(resumed, straight[6..].to_vec(), "resumed at step 6");
}

#[test]
fn damaged_checkpoints_are_refused_with_exit_2() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let job = ckpt_job(dir, "damaged", 2, 2);
    train(dir, &job, "m.jsonl", &[]);
    let ck = dir.join("ckpt/step-00000002");
    let shard = ck.join("rank-00001.safetensors");
    // Resumes from `ck` and expects exit 2 with `want` in the message.
    let refused = |extra: &[&str], want: &str| {
        let mut args = vec![
            "train",
            job.to_str().unwrap(),
            "--resume",
            ck.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let f = zrun(dir, &args);
        assert_eq!(f.code(), 2, "{f:?}");
        assert!(
            f.stderr.contains(want),
            "expected `{want}` in:\n{}",
            f.stderr
        );
    };
    // A different model.
    refused(
        &["--set", "model.d_model=64"],
        "manifest.json: a different model: d_model 32 in the checkpoint, 64 in the job",
    );
    // A flipped bit.
    let good = std::fs::read(&shard).unwrap();
    let mut bad = good.clone();
    *bad.last_mut().unwrap() ^= 0x10;
    std::fs::write(&shard, &bad).unwrap();
    refused(&[], "rank-00001.safetensors: checksum mismatch");
    // A missing shard.
    std::fs::remove_file(&shard).unwrap();
    refused(&[], "rank-00001.safetensors: shard is missing");
    let f = zrun(
        dir,
        &[
            "export",
            ck.to_str().unwrap(),
            "--out",
            dir.join("x.safetensors").to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 2, "{f:?}");
}

/// A fresh run into a `checkpoint.dir` that holds an earlier run's
/// checkpoints would save over them at the same steps: it is refused (exit
/// 2, naming the newest and `--resume auto`) before anything is written,
/// and `--resume auto` continues the earlier run there.
#[test]
fn a_fresh_run_refuses_a_checkpoint_dir_with_checkpoints_in_it() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let job = ckpt_job(dir, "twice", 2, 2);
    train(dir, &job, "m.jsonl", &[]);
    let ck = dir.join("ckpt/step-00000002");
    let manifest = std::fs::read(ck.join("manifest.json")).unwrap();
    let args = TrainArgs::new(&job, dir.join("again.jsonl"));
    let f = args.run(dir);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("step-00000002") && f.stderr.contains("--resume auto"),
        "{}",
        f.stderr
    );
    assert_eq!(std::fs::read(ck.join("manifest.json")).unwrap(), manifest);
    let f = zrun(
        dir,
        &[
            "train",
            job.to_str().unwrap(),
            "--resume",
            "auto",
            "--set",
            "train.steps=4",
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(dir.join("ckpt/step-00000004/manifest.json").exists());
}

#[test]
fn a_worker_killed_mid_save_leaves_the_previous_checkpoint_loadable() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let job = ckpt_job(dir, "midsave", 100, 2);
    let m = dir.join("m.jsonl");
    // Every save stalls 2 s between writing a file and renaming it into place.
    let z = TrainArgs::new(&job, &m)
        .set("env.ZRUN_FAULT_SAVE_DELAY_MS=2000")
        .start(dir);
    let ck = dir.join("ckpt");
    assert!(
        wait_until(Duration::from_secs(60), || ck
            .join("step-00000002/manifest.json")
            .exists()),
        "{}",
        z.stdout_so_far()
    );
    assert!(wait_until(Duration::from_secs(60), || ck
        .join("step-00000004")
        .exists()));
    assert!(!ck.join("step-00000004/manifest.json").exists());
    let workers = children_of(z.pid());
    kill(Pid::from_raw(workers[1] as i32), Signal::SIGKILL).unwrap();
    let f = z.wait(Duration::from_secs(30));
    assert_eq!(f.code(), 1, "{f:?}");
    // The run removed its own unfinished step 4 as it ended: the other
    // worker, stopped mid-save, could not remove its partial file.
    assert!(
        f.stdout
            .contains("step-00000004, a save this run left unfinished"),
        "{}",
        f.stdout
    );
    assert!(!ck.join("step-00000004").exists());
    // What a run that could not clean up (zrun itself killed) leaves: a
    // save without a manifest, which the next run removes before it starts.
    std::fs::create_dir_all(ck.join("step-00000004")).unwrap();
    std::fs::write(ck.join("step-00000004/rank-00001.tmp"), b"partial").unwrap();
    // Step 2 resumes.
    let f = zrun(
        dir,
        &[
            "train",
            job.to_str().unwrap(),
            "--resume",
            "auto",
            "--set",
            "train.steps=4",
            "--no-progress",
            "--metrics",
            dir.join("r.jsonl").to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(f.stdout.contains("step-00000002"), "{}", f.stdout);
    // The dead run's partial step-4 was removed before the new run started (it
    // then wrote a complete step 4 of its own).
    assert!(
        f.stdout
            .contains("step-00000004, an unfinished save of an earlier run"),
        "{}",
        f.stdout
    );
    assert!(ck.join("step-00000004/manifest.json").exists());
    assert_eq!(
        losses_by_step(&dir.join("r.jsonl"))
            .iter()
            .map(|x| x.0)
            .collect::<Vec<_>>(),
        vec![3, 4]
    );
}

/// `--max-restarts 1`: a worker killed after the step-10 checkpoint (saves
/// stall 300 ms, so the kill lands mid-run) makes zrun relaunch from the newest
/// complete checkpoint; the job finishes, the metrics record the restart, the
/// steps after it repeat the uninterrupted run's losses bit for bit, and the
/// final weights are the same bytes. Without restarts left the job fails.
/// Its TensorBoard file holds the restart event, after which TensorBoard's
/// reader shows each of the 30 steps once (where the reader is installed:
/// `e2e::tensorboard_scalars`), and its CSV loss file holds each step once,
/// the repeated steps' lines those of the run after the restart.
#[test]
fn a_killed_worker_is_restarted_from_the_newest_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    let (f, restart) = killed_after_step_10(d.path(), "restart", |_| {});
    assert_eq!(f.code(), 0, "{f:?}");
    let from = restart["step"].as_u64().unwrap();
    assert!(from >= 10 && from.is_multiple_of(5), "{restart}");
    assert_eq!(restart["restarts_left"], 0);
    assert!(
        restart["reason"].as_str().unwrap().contains("rank 1"),
        "{restart}"
    );
    let tb = d.path().join("tb");
    let records = e2e::tfrecords(&tb);
    assert_eq!(records.len(), 1, "one file for the run: {records:?}");
    let lines = e2e::metrics(&d.path().join("restarted.jsonl"));
    let step_lines = lines.iter().filter(|l| l.get("loss").is_some()).count();
    assert_eq!(records[0], 1 + step_lines + 1, "version, steps, restart");
    // The last line of each step (the run after the restart's, where it
    // repeated one), to the bit.
    let want: std::collections::BTreeMap<u64, f64> =
        e2e::exact_by_step(&d.path().join("restarted.jsonl"), "loss")
            .into_iter()
            .collect();
    let csv = e2e::csv_by_step(&d.path().join("csv/train_loss.csv"));
    let bits = |v: &[(u64, f64)]| v.iter().map(|(s, x)| (*s, x.to_bits())).collect::<Vec<_>>();
    assert_eq!(want.len(), 30);
    assert_eq!(bits(&csv), bits(&want.into_iter().collect::<Vec<_>>()));
    if let Some(read) = e2e::tensorboard_scalars(&tb) {
        let steps: Vec<u64> = read["train/loss"].iter().map(|s| s.0).collect();
        assert_eq!(steps, (1..=30).collect::<Vec<_>>());
    }
}

/// A restart whose newest checkpoint is damaged (a byte of step 10's rank-1
/// shard flipped after its save completed, before the kill) goes back to the
/// newest one that opens, step 5, says which it passed over, and finishes
/// with the uninterrupted run's losses and final weights.
#[test]
fn a_restart_passes_over_a_damaged_newest_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    let (f, restart) = killed_after_step_10(d.path(), "damaged", |dir| {
        flip_a_byte(&dir.join("ckpt/step-00000010/rank-00001.safetensors"))
    });
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(
        f.stderr
            .contains("not restarting from a damaged checkpoint")
            && f.stderr.contains("step-00000010"),
        "{}",
        f.stderr
    );
    assert_eq!(restart["step"], 5, "{restart}");
}

/// A 30-step job saving every 5 steps (saves stalled 300 ms) run once
/// straight, then again with `--max-restarts 1`, rank 1's worker killed once
/// step 10's checkpoint is complete (`before_kill` runs first). Checks that
/// the steps after the restart repeat the straight run's losses and that
/// the final weights are its bytes; returns how zrun ended and the metrics'
/// restart line.
fn killed_after_step_10(
    dir: &Path,
    name: &str,
    before_kill: impl FnOnce(&Path),
) -> (e2e::Finished, serde_json::Value) {
    let job = ckpt_job(dir, name, 30, 5);
    let slow = ["--set", "env.ZRUN_FAULT_SAVE_DELAY_MS=300"];
    train(dir, &job, "straight.jsonl", &slow);
    let straight_weights = export_ckpt(dir, "straight.safetensors");
    std::fs::remove_dir_all(dir.join("ckpt")).unwrap();
    let m = dir.join("restarted.jsonl");
    let z = TrainArgs::new(&job, &m)
        .args(&slow)
        .args(&["--max-restarts", "1"])
        .set(format!("tensorboard={}", dir.join("tb").display()))
        .set(format!("csv_monitor={}", dir.join("csv").display()))
        .start(dir);
    wait_for_complete_checkpoint(dir, 10, &z);
    before_kill(dir);
    let workers = children_of(z.pid());
    kill(Pid::from_raw(workers[1] as i32), Signal::SIGKILL).unwrap();
    let f = z.wait(Duration::from_secs(120));
    if f.code() != 0 {
        return (f, serde_json::Value::Null);
    }
    let lines = e2e::metrics(&m);
    let at = lines
        .iter()
        .position(|l| l["event"] == "restart")
        .expect("a restart line");
    let from = lines[at]["step"].as_u64().expect("the restart's step") as usize;
    let after: Vec<(u64, f64)> = lines[at + 1..]
        .iter()
        .filter_map(|l| Some((l.get("step")?.as_u64()?, l.get("loss")?.as_f64()?)))
        .collect();
    let straight = losses_by_step(&dir.join("straight.jsonl"));
    assert_eq!(after, straight[from..].to_vec());
    assert!(
        export_ckpt(dir, "restarted.safetensors") == straight_weights,
        "final weights differ"
    );
    (f, lines[at].clone())
}

/// `--resume auto` whose newest checkpoint is damaged stops before anything
/// is written (exit 2), naming the damage and the newest checkpoint that
/// opens; so do `--resume` and `zrun export` given the checkpoints'
/// directory; resuming from that one by name goes on.
#[test]
fn resume_auto_names_the_checkpoint_to_use_when_the_newest_is_damaged() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let job = ckpt_job(dir, "auto", 4, 2);
    train(dir, &job, "m.jsonl", &[]);
    let damaged = dir.join("ckpt/step-00000004/rank-00000.safetensors");
    flip_a_byte(&damaged);
    let bytes = std::fs::read(&damaged).unwrap();
    let longer = ["--set", "train.steps=6"];
    let f = TrainArgs::new(&job, dir.join("auto.jsonl"))
        .args(&longer)
        .args(&["--resume", "auto"])
        .run(dir);
    assert_eq!(f.code(), 2, "{f:?}");
    let intact = dir.join("ckpt/step-00000002");
    assert!(
        f.stderr.contains("step-00000004/rank-00000.safetensors")
            && f.stderr
                .contains(&format!("`--resume {}`", intact.display())),
        "{}",
        f.stderr
    );
    let root = dir.join("ckpt");
    let f = TrainArgs::new(&job, dir.join("root.jsonl"))
        .args(&longer)
        .args(&["--resume", root.to_str().unwrap()])
        .run(dir);
    assert_eq!(f.code(), 2, "{f:?}");
    let names_intact = format!("that opens is {}", intact.display());
    assert!(f.stderr.contains(&names_intact), "{}", f.stderr);
    let out = dir.join("x.safetensors");
    let export = |from: &Path| {
        zrun(
            dir,
            &[
                "export",
                from.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ],
        )
    };
    let f = export(&root);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains(&names_intact), "{}", f.stderr);
    assert!(!out.exists());
    assert_eq!(export(&intact).code(), 0);
    assert_eq!(std::fs::read(&damaged).unwrap(), bytes);
    assert!(!dir.join("ckpt/step-00000006").exists());
    let f = TrainArgs::new(&job, dir.join("named.jsonl"))
        .args(&longer)
        .args(&["--resume", intact.to_str().unwrap()])
        .run(dir);
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(dir.join("ckpt/step-00000006/manifest.json").exists());
}

/// Flips one byte in the middle of `file` (its size unchanged: only the
/// manifest's CRC tells).
fn flip_a_byte(file: &Path) {
    let mut bytes = std::fs::read(file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(file, bytes).unwrap();
}

/// `--restart-exclude-failed` on two loopback nodes of one worker each: the
/// worker on 127.0.0.3 is killed after the step-10 checkpoint, and the job
/// restarts on 127.0.0.2 alone (the checkpoint reshards to one rank at load)
/// and finishes; the restart line says so.
#[test]
fn a_restart_can_leave_the_failed_node_out() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let job = ckpt_job(dir, "exclude", 30, 5);
    let m = dir.join("m.jsonl");
    let f = killed_after_step_10_and_restarted(dir, &job, &m);
    let lines = e2e::metrics(&m);
    let restart = lines
        .iter()
        .find(|l| l["event"] == "restart")
        .expect("a restart line");
    assert_eq!(restart["world_size"], 1, "{restart}");
    assert!(
        f.stdout.contains("on 1 worker(s), 1 node(s)"),
        "{}",
        f.stdout
    );
    let last = lines
        .iter()
        .rev()
        .find(|l| l.get("loss").is_some())
        .unwrap();
    assert_eq!(
        (last["step"].as_u64(), last["world_size"].as_u64()),
        (Some(30), Some(1))
    );
}

/// A `train.epochs` run restarted on fewer workers (`--restart-exclude-failed`)
/// recounts its steps: two loopback nodes of one worker each train 2
/// epochs of a 124-window token file (8 sequences a step: 31 steps); the
/// worker on 127.0.0.3 is killed after the step-10 checkpoint, and the
/// restart on one worker (4 sequences a step) trains until the 2 epochs
/// are done, however many steps that takes from the step it resumed: its
/// last step is the first whose `epoch` reaches 2. Without the recount it
/// would stop at step 31, at 1.3 epochs.
#[test]
fn a_restart_on_fewer_workers_recounts_the_epochs() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let ids: Vec<u16> = (0..2000u16).map(|i| 1 + (i * 5 + i / 7) % 60).collect();
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    std::fs::write(dir.join("ids.bin"), bytes).unwrap();
    let windows = (ids.len() - 1) / 16;
    assert_eq!(windows, 124);
    let job = ckpt_job(dir, "epochs", 1, 5);
    let text = std::fs::read_to_string(&job)
        .unwrap()
        .replace("seq_len: 32", "seq_len: 16")
        .replace(
            "data: {format: synthetic}",
            &format!(
                "data: {{path: {}, format: tokens_u16}}",
                dir.join("ids.bin").display()
            ),
        )
        .replace("  steps: 1\n", "  epochs: 2\n");
    assert!(
        text.contains("epochs: 2") && text.contains("tokens_u16"),
        "{text}"
    );
    std::fs::write(&job, text).unwrap();
    let m = dir.join("m.jsonl");
    let f = killed_after_step_10_and_restarted(dir, &job, &m);
    assert!(
        f.stdout
            .contains("train.epochs 2: 31 steps of 8 sequences over an epoch of 124 sequences"),
        "{}",
        f.stdout
    );
    let lines = e2e::metrics(&m);
    let restart = lines
        .iter()
        .position(|l| l["event"] == "restart")
        .expect("a restart line");
    assert_eq!(lines[restart]["world_size"], 1, "{}", lines[restart]);
    let after: Vec<_> = lines[restart..]
        .iter()
        .filter(|l| l.get("loss").is_some())
        .collect();
    let resumed = after[0]["step"].as_u64().unwrap() - 1;
    assert!(resumed >= 10, "resumed from step {resumed}");
    // Each step after the restart takes 4 sequences.
    for l in &after {
        let step = l["step"].as_u64().unwrap();
        let sequences = 8 * resumed + 4 * (step - resumed);
        assert_eq!(l["world_size"].as_u64(), Some(1), "{l}");
        assert_eq!(
            l["epoch"].as_f64().unwrap(),
            sequences as f64 / windows as f64,
            "step {step}"
        );
    }
    let epoch = |l: &serde_json::Value| l["epoch"].as_f64().unwrap();
    let (last, before) = (after[after.len() - 1], after[after.len() - 2]);
    assert!(
        epoch(last) >= 2.0 && epoch(before) < 2.0,
        "the run ended at step {} (epoch {}), after step {} (epoch {})",
        last["step"],
        epoch(last),
        before["step"],
        epoch(before)
    );
    let steps = resumed + (2 * windows as u64 - 8 * resumed).div_ceil(4);
    assert_eq!(last["step"].as_u64(), Some(steps));
}

/// Runs `job` on two loopback nodes of one worker each (127.0.0.2 and
/// 127.0.0.3), its saves slowed, with one restart that leaves a failed
/// node out; kills rank 1 once the step-10 checkpoint is complete, and
/// returns the finished run (exit 0 asserted).
fn killed_after_step_10_and_restarted(dir: &Path, job: &Path, m: &Path) -> e2e::Finished {
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "127.0.0.2 slots=1\n127.0.0.3 slots=1\n").unwrap();
    let z = TrainArgs::new(job, m)
        .set("env.ZRUN_FAULT_SAVE_DELAY_MS=300")
        .args(&["--hostfile", hosts.to_str().unwrap()])
        .args(&["--max-restarts", "1", "--restart-exclude-failed"])
        .start(dir);
    wait_for_complete_checkpoint(dir, 10, &z);
    kill_rank_1_of_two(&z);
    let f = z.wait(Duration::from_secs(120));
    assert_eq!(f.code(), 0, "{f:?}");
    f
}

/// SIGKILL to rank 1 of the two workers `z` started (on 127.0.0.3, the
/// hostfile's second line).
fn kill_rank_1_of_two(z: &e2e::Zrun) {
    let workers = children_of(z.pid());
    assert_eq!(workers.len(), 2, "{workers:?}");
    let rank1 = workers
        .iter()
        .copied()
        .find(|&p| {
            std::fs::read(format!("/proc/{p}/environ")).is_ok_and(|e| {
                String::from_utf8_lossy(&e)
                    .split('\0')
                    .any(|v| v == "RANK=1")
            })
        })
        .expect("rank 1's worker");
    kill(Pid::from_raw(rank1 as i32), Signal::SIGKILL).unwrap();
}

/// Waits (at most 60 s) until the running job `z` has completed the checkpoint
/// of `step` under `dir/ckpt`.
fn wait_for_complete_checkpoint(dir: &Path, step: u64, z: &e2e::Zrun) {
    let manifest = dir.join(format!("ckpt/step-{step:08}/manifest.json"));
    assert!(
        wait_until(Duration::from_secs(60), || manifest.exists()),
        "no checkpoint of step {step}: {}",
        z.stdout_so_far()
    );
}

/// Ctrl-C, SIGTERM or SIGHUP during `zrun export` ends it with exit 130 and
/// removes the temporary files it was writing (before the sixty-ninth
/// session they stayed, as large as the export); an earlier export at
/// `--out` is kept whole. Each signal arrives while the written file waits
/// to be renamed (`ZRUN_FAULT_SAVE_DELAY_MS`), in both formats.
#[test]
fn an_interrupted_export_leaves_its_temporary_files_nowhere() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let job = ckpt_job(d, "exported", 2, 2);
    let f = TrainArgs::new(&job, d.join("m.jsonl")).run(d);
    assert_eq!(f.code(), 0, "{f:?}");
    let ckpt = d.join("ckpt");
    let earlier = d.join("earlier.safetensors");
    std::fs::write(&earlier, b"an earlier export").unwrap();
    for (signal, out, format) in [
        (Signal::SIGINT, d.join("model.safetensors"), "zrun"),
        (Signal::SIGTERM, earlier.clone(), "zrun"),
        (Signal::SIGHUP, d.join("hf"), "hf"),
    ] {
        let mut args = vec![
            "export",
            ckpt.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend(["--format", format, "--overwrite"]);
        let z = e2e::Zrun::start_with_env(d, &args, &[("ZRUN_FAULT_SAVE_DELAY_MS", "20000")]);
        let tmp = match format {
            "hf" => out.join("model.tmp"),
            _ => out.with_extension("tmp"),
        };
        assert!(
            wait_until(Duration::from_secs(30), || tmp.exists()),
            "{signal:?}: no temporary file"
        );
        kill(Pid::from_raw(z.pid() as i32), signal).unwrap();
        let f = z.wait(Duration::from_secs(10));
        assert_eq!(f.code(), 130, "{signal:?}: {f:?}");
        assert!(f.stderr.contains("interrupted"), "{}", f.stderr);
        assert!(!tmp.exists(), "{signal:?}: {} left", tmp.display());
        match format {
            "hf" => assert!(!out.join("model.safetensors").exists()),
            _ if out == earlier => {
                assert_eq!(std::fs::read(&earlier).unwrap(), b"an earlier export")
            }
            _ => assert!(!out.exists()),
        }
    }
}

/// `checkpoint.keep_best` (Hugging Face's `load_best_model_at_end` on the
/// validation loss): beside the newest `keep: 1`, the checkpoint of the
/// lowest validation loss stays through every later prune, its manifest
/// holds that loss (which reads back: its checksum covers it), zrun names
/// it at the end, and it loads (`zrun eval`). A rate high enough that
/// validation gets worse after step 6 (measured: 6.22, 2.95, 2.83, 3.05 at
/// steps 2-8), so that the best is not the newest, on one worker and on
/// two. Without validation on the checkpoint steps: exit 2 naming the key.
#[test]
fn the_best_validated_checkpoint_is_kept() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    std::fs::write(dir.join("digits.txt"), "0123456789".repeat(3000)).unwrap();
    std::fs::write(dir.join("held.txt"), "0123456789".repeat(20)).unwrap();
    let job = dir.join("best.yaml");
    std::fs::write(
        &job,
        format!(
            "name: best\n\
             model: {{vocab_size: 256, d_model: 64, n_layers: 2, n_heads: 4, seq_len: 32}}\n\
             data: {{path: {0}/digits.txt, format: text, val_fraction: 0.1}}\n\
             train: {{steps: 8, micro_batch_size: 8, lr: 0.1, warmup_steps: 10, eval_every: 2}}\n\
             checkpoint: {{dir: {0}/ckpt, every: 2, keep: 1, keep_best: true}}\n\
             run_dir: {0}/runs\n",
            dir.display()
        ),
    )
    .unwrap();
    for (workers, batch) in [("1", "8"), ("2", "4")] {
        let ckpt = dir.join("ckpt");
        let _ = std::fs::remove_dir_all(&ckpt);
        let metrics = format!("best-{workers}.jsonl");
        let micro = format!("train.micro_batch_size={batch}");
        let f = train(
            dir,
            &job,
            &metrics,
            &["--workers-per-node", workers, "--set", &micro],
        );
        let validated: Vec<(u64, f64)> = e2e::exact_by_step(&dir.join(&metrics), "val_loss");
        assert_eq!(validated.len(), 4, "{validated:?}");
        let (best_step, best) =
            validated
                .iter()
                .copied()
                .fold((0, f64::INFINITY), |b, v| if v.1 < b.1 { v } else { b });
        assert_ne!(best_step, 8, "the newest is the best: {validated:?}");
        let kept: Vec<String> = std::fs::read_dir(&ckpt)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let best_dir = format!("step-{best_step:08}");
        assert_eq!(
            kept,
            [best_dir.clone(), "step-00000008".into()],
            "{validated:?}"
        );
        let manifest: serde_json::Value = serde_json::from_slice(
            &std::fs::read(ckpt.join(&best_dir).join("manifest.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(manifest["val_loss"].as_f64(), Some(best));
        assert!(
            f.stdout.contains(&format!(
                "the best checkpoint by validation loss: {} (val_loss {best:.4})",
                ckpt.join(&best_dir).display()
            )),
            "{}",
            f.stdout
        );
        let e = zrun(
            dir,
            &[
                "eval",
                ckpt.join(&best_dir).to_str().unwrap(),
                "--data",
                "held.txt",
            ],
        );
        assert_eq!(e.code(), 0, "{e:?}");
    }
    for (set, says) in [
        ("train.eval_every=0", "needs validation"),
        (
            "checkpoint.every=3",
            "must be a multiple of train.eval_every (2)",
        ),
    ] {
        let f = TrainArgs::new(&job, dir.join("refused.jsonl"))
            .set(set)
            .run(dir);
        assert_eq!(f.code(), 2, "{set}: {f:?}");
        assert!(
            f.stderr.contains("checkpoint.keep_best") && f.stderr.contains(says),
            "{set}: {}",
            f.stderr
        );
    }
}

/// A run with dropout exports it as transformers' GPT-2 keys
/// (`resid_pdrop`, `embd_pdrop`, `attn_pdrop`); a job that starts from that
/// directory without saying its own dropout is told what the directory
/// trains with and which keys would set it (zrun takes only the
/// architecture from a `config.json`); a job that says both hears nothing.
#[test]
fn dropout_goes_out_with_an_export_and_a_job_from_it_is_told() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let job = ckpt_job(dir, "dropped", 2, 2);
    train(
        dir,
        &job,
        "dropped.jsonl",
        &[
            "--set",
            "model.hidden_dropout=0.1",
            "--set",
            "model.attention_dropout=0.2",
        ],
    );
    let hf = dir.join("hf");
    e2e::export_hf(dir, &dir.join("ckpt/step-00000002"), &hf);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
    for (key, want) in [
        ("resid_pdrop", 0.1),
        ("embd_pdrop", 0.1),
        ("attn_pdrop", 0.2),
    ] {
        assert_eq!(config[key].as_f64(), Some(want), "{key}: {config}");
    }
    let init = format!("model.init_from={}", hf.display());
    let check = |more: &[&str]| {
        let args = [&["check", job.to_str().unwrap(), "--set", &init], more].concat();
        let f = zrun(dir, &args);
        assert_eq!(f.code(), 0, "{f:?}");
        format!("{}{}", f.stdout, f.stderr)
    };
    let told = check(&[]);
    for says in [
        "resid_pdrop 0.1 (model.hidden_dropout)",
        "embd_pdrop 0.1 (model.hidden_dropout)",
        "attn_pdrop 0.2 (model.attention_dropout)",
    ] {
        assert!(told.contains(says), "{says}: {told}");
    }
    let quiet = check(&[
        "--set",
        "model.hidden_dropout=0.1",
        "--set",
        "model.attention_dropout=0",
    ]);
    assert!(!quiet.contains("trains with dropout"), "{quiet}");
}

/// `train.early_stopping` (transformers' `EarlyStoppingCallback`): on a
/// rate high enough that validation gets worse after a few steps, the run
/// ends after the validation that makes `patience` in a row without
/// improvement, where the rule applied to the run's own validation losses
/// says (exit 0, an `early_stop` line naming the best, a checkpoint of the
/// last step recording the count); `--resume auto` from it trains nothing
/// more, and with more patience goes on from the count it recorded;
/// resumed without early stopping, it records no count. A
/// threshold no loss can beat ends it at the `patience + 1`-th validation.
/// Without validation, or with a patience of 0: exit 2 naming the key.
#[test]
fn early_stopping_ends_the_run_where_the_rule_says() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    std::fs::write(dir.join("digits.txt"), "0123456789".repeat(3000)).unwrap();
    let job = dir.join("early.yaml");
    std::fs::write(
        &job,
        format!(
            "name: early\n\
             model: {{vocab_size: 256, d_model: 64, n_layers: 2, n_heads: 4, seq_len: 32}}\n\
             data: {{path: {0}/digits.txt, format: text, val_fraction: 0.1}}\n\
             train: {{steps: 40, micro_batch_size: 8, lr: 0.1, warmup_steps: 10, eval_every: 2, early_stopping: {{patience: 2}}}}\n\
             checkpoint: {{dir: {0}/ckpt, every: 2, keep: 2}}\n\
             run_dir: {0}/runs\n",
            dir.display()
        ),
    )
    .unwrap();
    let f = train(dir, &job, "early.jsonl", &[]);
    let lines = e2e::metrics(&dir.join("early.jsonl"));
    let validated = e2e::exact_by_step(&dir.join("early.jsonl"), "val_loss");
    // The rule, on the run's own losses: the first validation that is the
    // second in a row not below the best.
    let (mut best, mut best_step, mut stale, mut ends) = (f64::INFINITY, 0, 0, None);
    for &(step, loss) in &validated {
        if loss < best {
            (best, best_step, stale) = (loss, step, 0);
        } else {
            stale += 1;
        }
        if stale == 2 {
            ends = Some(step);
            break;
        }
    }
    let ends = ends.expect("validation never stopped improving: raise the rate");
    assert!(ends < 40, "{validated:?}");
    let early = lines
        .iter()
        .find(|l| l["event"] == "early_stop")
        .unwrap_or_else(|| panic!("no early_stop line: {}", f.stdout));
    assert_eq!(early["step"].as_u64(), Some(ends), "{validated:?}");
    assert_eq!(early["best_step"].as_u64(), Some(best_step));
    assert_eq!(early["best_val_loss"].as_f64(), Some(best));
    assert_eq!(e2e::losses(&lines).len() as u64, ends, "steps trained");
    assert!(
        f.stdout
            .contains(&format!("stopped early after step {ends} of 40")),
        "{}",
        f.stdout
    );
    let last = dir.join(format!("ckpt/step-{ends:08}/manifest.json"));
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&last).unwrap()).unwrap();
    assert_eq!(manifest["early_stopping"]["stale"].as_u64(), Some(2));
    assert_eq!(
        manifest["early_stopping"]["best_step"].as_u64(),
        Some(best_step)
    );

    // Resumed as it is: nothing more to train.
    let again = train(dir, &job, "again.jsonl", &["--resume", "auto"]);
    let again_lines = e2e::metrics(&dir.join("again.jsonl"));
    assert!(e2e::losses(&again_lines).is_empty(), "{}", again.stdout);
    assert!(again_lines.iter().any(|l| l["event"] == "early_stop"));
    // With more patience, on from the recorded count: the steps after it.
    let more = train(
        dir,
        &job,
        "more.jsonl",
        &[
            "--resume",
            "auto",
            "--set",
            "train.early_stopping.patience=30",
        ],
    );
    let steps: Vec<u64> = e2e::exact_by_step(&dir.join("more.jsonl"), "loss")
        .iter()
        .map(|s| s.0)
        .collect();
    assert_eq!(
        steps,
        (ends + 1..=40).collect::<Vec<_>>(),
        "{}",
        more.stdout
    );
    // Resumed without early stopping: its checkpoints record no count.
    train(
        dir,
        &job,
        "off.jsonl",
        &[
            "--resume",
            "auto",
            "--set",
            "train.early_stopping=null",
            "--set",
            "train.steps=44",
        ],
    );
    let off: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("ckpt/step-00000044/manifest.json")).unwrap(),
    )
    .unwrap();
    assert!(off.get("early_stopping").is_none(), "{off}");

    // No loss beats the best by 100: the third validation ends it.
    let _ = std::fs::remove_dir_all(dir.join("ckpt"));
    train(
        dir,
        &job,
        "strict.jsonl",
        &["--set", "train.early_stopping.threshold=100"],
    );
    let strict = e2e::metrics(&dir.join("strict.jsonl"));
    let line = strict.iter().find(|l| l["event"] == "early_stop").unwrap();
    assert_eq!(line["step"].as_u64(), Some(6), "{line}");

    for (set, key) in [
        ("train.eval_every=0", "train.early_stopping"),
        (
            "train.early_stopping.patience=0",
            "train.early_stopping.patience",
        ),
        (
            "train.early_stopping.threshold=-1",
            "train.early_stopping.threshold",
        ),
    ] {
        let f = TrainArgs::new(&job, dir.join("refused.jsonl"))
            .set(set)
            .run(dir);
        assert_eq!(f.code(), 2, "{set}: {f:?}");
        assert!(f.stderr.contains(key), "{set}: {}", f.stderr);
    }
}

/// `train.schedule: reduce_lr_on_plateau` (transformers' name for
/// PyTorch's `ReduceLROnPlateau` on the validation loss): every step's rate
/// is what the rule, applied here by hand to the run's own validation
/// losses, sets (patience 1, factor 0.5, a loss counting as better only
/// 5% below the best), and it falls at least twice; a run resumed from its
/// step-10 checkpoint goes on with the same rates and losses (the rule's
/// state rides in the manifest); without validation, with a warmup written,
/// or beside another schedule: exit 2 naming the key.
#[test]
fn reduce_lr_on_plateau_lowers_the_rate_where_the_rule_says() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    std::fs::write(dir.join("digits.txt"), "0123456789".repeat(3000)).unwrap();
    let job = dir.join("plateau.yaml");
    std::fs::write(
        &job,
        format!(
            "name: plateau\n\
             model: {{vocab_size: 256, d_model: 64, n_layers: 2, n_heads: 4, seq_len: 32}}\n\
             data: {{path: {0}/digits.txt, format: text, val_fraction: 0.1}}\n\
             train: {{steps: 24, micro_batch_size: 8, lr: 0.1, schedule: reduce_lr_on_plateau, eval_every: 2, plateau: {{patience: 1, factor: 0.5, threshold: 0.05}}}}\n\
             checkpoint: {{dir: {0}/ckpt, every: 10, keep: 3}}\n\
             run_dir: {0}/runs\n",
            dir.display()
        ),
    )
    .unwrap();
    train(dir, &job, "plateau.jsonl", &[]);
    let lrs = e2e::exact_by_step(&dir.join("plateau.jsonl"), "lr");
    let validated = e2e::exact_by_step(&dir.join("plateau.jsonl"), "val_loss");
    assert_eq!(validated.len(), 12, "{validated:?}");
    // The rule by hand: a step's rate is what the validations before it set.
    let (mut best, mut bad, mut lr) = (f64::INFINITY, 0, 0.1);
    let mut want = Vec::new();
    for step in 1..=24u64 {
        want.push((step, lr));
        if let Some(&(_, loss)) = validated.iter().find(|v| v.0 == step) {
            if loss < best * 0.95 {
                (best, bad) = (loss, 0);
            } else {
                bad += 1;
            }
            if bad > 1 {
                (lr, bad) = (lr * 0.5, 0);
            }
        }
    }
    assert_eq!(lrs, want, "validations {validated:?}");
    assert!(
        want[23].1 <= 0.025,
        "the rate fell less than twice: {want:?}"
    );
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("ckpt/step-00000010/manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        manifest["plateau"]["lr"].as_f64(),
        Some(want[10].1),
        "{manifest}"
    );

    // Resumed from step 10: the same rates and losses after it.
    let from = dir.join("ckpt/step-00000010");
    train(
        dir,
        &job,
        "resumed.jsonl",
        &[
            "--resume",
            from.to_str().unwrap(),
            "--set",
            &format!("checkpoint.dir={}/ckpt2", dir.display()),
        ],
    );
    let after = |name: &str, key: &str| -> Vec<(u64, f64)> {
        e2e::exact_by_step(&dir.join(name), key)
            .into_iter()
            .filter(|s| s.0 > 10)
            .collect()
    };
    assert_eq!(after("resumed.jsonl", "lr"), after("plateau.jsonl", "lr"));
    assert_eq!(
        after("resumed.jsonl", "loss"),
        after("plateau.jsonl", "loss")
    );

    for (set, key) in [
        ("train.eval_every=0", "train.schedule"),
        ("train.warmup_steps=5", "train.warmup_steps"),
        ("train.plateau.factor=1", "train.plateau.factor"),
        ("train.schedule=cosine", "train.plateau"),
    ] {
        let f = TrainArgs::new(&job, dir.join("refused.jsonl"))
            .set(set)
            .run(dir);
        assert_eq!(f.code(), 2, "{set}: {f:?}");
        assert!(f.stderr.contains(key), "{set}: {}", f.stderr);
    }
}

/// LoCo's kept quantization errors (`zero.loco`, with ZeRO++ qgZ at stage
/// 3) are state a resume needs: each rank writes its file beside its shard,
/// the manifest lists them with their sizes and checksums, and a run
/// resumed from step 3 continues the straight one to the bit (without them
/// its errors would start from zero and its losses leave the straight
/// run's at once).
#[test]
fn loco_errors_are_checkpointed_and_the_resume_matches() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let job = ckpt_job(dir, "loco", 6, 3);
    let set = &[
        "--set",
        "zero.stage=3",
        "--set",
        "zero.quantized_gradients=true",
        "--set",
        "zero.quantization.block_size=16",
        "--set",
        "zero.loco={err_beta: 0.8, reset_T: 1000}",
    ];
    train(dir, &job, "straight.jsonl", set);
    let straight = losses_by_step(&dir.join("straight.jsonl"));
    let at3 = dir.join("ckpt/step-00000003");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(at3.join("manifest.json")).unwrap()).unwrap();
    let listed = manifest["feedback"].as_array().expect("feedback listed");
    assert_eq!(listed.len(), 2, "{manifest}");
    for (r, entry) in listed.iter().enumerate() {
        let name = format!("loco-rank-{r:05}.bin");
        assert_eq!(entry["name"], name.as_str());
        let bytes = std::fs::metadata(at3.join(&name)).unwrap().len();
        assert_eq!(entry["bytes"].as_u64(), Some(bytes));
    }
    std::fs::remove_dir_all(dir.join("ckpt/step-00000006")).unwrap();
    let resumed = [set.as_slice(), &["--resume", "auto"]].concat();
    train(dir, &job, "resumed.jsonl", &resumed);
    let resumed = losses_by_step(&dir.join("resumed.jsonl"));
    assert_eq!(resumed, straight[3..].to_vec());
}
