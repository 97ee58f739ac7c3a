//! `zrun prepare` with a Hugging Face tokenizer.json, and training on what it
//! writes: the token files hold exactly the tokenizer's ids (against a word
//! lookup written here), split evenly into train and val; the manifest keeps a
//! model with too small a vocabulary from launching; `zrun sample` speaks
//! through the tokenizer; a vocabulary above 65,536
//! gets u32 files that train; an id outside the vocabulary in a file without a
//! manifest is exit 2 naming the file and the offset.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use e2e::{assert_gone, metrics, zrun, zrun_into_head, TrainArgs};

/// A word-level tokenizer.json (whitespace pre-tokenizer, so that a word is a
/// token): `<|endoftext|>` is 0, `[UNK]` 1, then `words`.
fn tokenizer(dir: &Path, words: &[String]) -> (PathBuf, HashMap<String, u32>) {
    let mut vocab: HashMap<String, u32> = HashMap::new();
    vocab.insert("<|endoftext|>".into(), 0);
    vocab.insert("[UNK]".into(), 1);
    for (i, w) in words.iter().enumerate() {
        vocab.insert(w.clone(), i as u32 + 2);
    }
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": 0, "content": "<|endoftext|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    let p = dir.join("tokenizer.json");
    std::fs::write(&p, serde_json::to_string(&json).unwrap()).unwrap();
    (p, vocab)
}

/// `zrun prepare INPUTS --tokenizer TOK --out OUT EXTRA…` in `d`.
fn prepare(d: &Path, inputs: &[&str], tok: &Path, out: &Path, extra: &[&str]) -> e2e::Finished {
    let mut args = vec!["prepare".to_string()];
    args.extend(inputs.iter().map(|i| d.join(i).display().to_string()));
    args.extend(["--tokenizer".into(), tok.display().to_string()]);
    args.extend(["--out".into(), out.display().to_string()]);
    args.extend(extra.iter().map(|e| e.to_string()));
    zrun(d, &args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Asserts that a failed prepare left nothing in `out`.
fn assert_empty(out: &Path, when: &str) {
    let left: Vec<_> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{when}left in --out: {left:?}");
}

fn words(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("w{i}")).collect()
}

/// Ids of a little-endian token file.
fn ids(p: &Path, width: usize) -> Vec<u32> {
    std::fs::read(p)
        .unwrap()
        .chunks_exact(width)
        .map(|c| match width {
            2 => u32::from(u16::from_le_bytes([c[0], c[1]])),
            _ => u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        })
        .collect()
}

/// A pseudo-random sentence of `n` words from the first `of` words.
fn sentence(seed: usize, n: usize, of: usize) -> String {
    (0..n)
        .map(|i| format!("w{}", (seed * 31 + i * 7 + i * i) % of))
        .collect::<Vec<_>>()
        .join(" ")
}

fn job(dir: &Path, vocab: usize, data: &str) -> PathBuf {
    let p = dir.join("job.yaml");
    std::fs::write(
        &p,
        format!(
            "name: prepared\nmodel: {{vocab_size: {vocab}, d_model: 32, n_layers: 1, n_heads: 4, seq_len: 16}}\ndata: {data}\ntrain: {{steps: 4, micro_batch_size: 2, lr: 3.0e-3, warmup_steps: 1, eval_every: 2, eval_steps: 1}}\nrun_dir: {}/runs\n",
            dir.display()
        ),
    )
    .unwrap();
    p
}

#[test]
fn prepared_tokens_are_the_tokenizers_and_train() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (tok, vocab) = tokenizer(d, &words(40));
    // A text file (one document, one piece) and 39 JSONL records.
    let text: String = (0..50).map(|i| sentence(i, 12, 40) + "\n").collect();
    std::fs::write(d.join("a.txt"), &text).unwrap();
    let records: Vec<String> = (0..39).map(|i| sentence(100 + i, 9, 40)).collect();
    let jsonl: String = records
        .iter()
        .map(|r| serde_json::json!({"text": r, "id": 7}).to_string() + "\n")
        .collect();
    std::fs::write(d.join("b.jsonl"), jsonl).unwrap();
    let out = d.join("data");
    let f = prepare(
        d,
        &["a.txt", "b.jsonl"],
        &tok,
        &out,
        &["--val-fraction", "0.1"],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    // The reference: each word's id, then the end-of-text id per document.
    let encode = |s: &str| -> Vec<u32> {
        let mut v: Vec<u32> = s.split_whitespace().map(|w| vocab[w]).collect();
        v.push(0);
        v
    };
    // 40 pieces, every tenth to val: pieces 9, 19, 29, 39 (records 8, 18, 28, 38).
    let mut train = encode(&text);
    let mut val = Vec::new();
    for (i, r) in records.iter().enumerate() {
        if (i + 2) % 10 == 0 {
            val.extend(encode(r));
        } else {
            train.extend(encode(r));
        }
    }
    assert_eq!(ids(&out.join("train.bin"), 2), train);
    assert_eq!(ids(&out.join("val.bin"), 2), val);
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["vocab_size"], 42);
    assert_eq!(m["format"], "tokens_u16");
    assert_eq!(m["eos_id"], 0);
    assert_eq!(m["files"]["train.bin"]["tokens"], train.len());
    assert_eq!(m["files"]["val.bin"]["documents"], 4);
    assert_eq!(m["files"]["train.bin"]["max_token_id"], 41);
    assert_eq!(m["tokenizer_sha256"].as_str().unwrap().len(), 64);
    // A second run keeps the first's output.
    let again = prepare(d, &["a.txt"], &tok, &out, &[]);
    assert_eq!(again.code(), 2, "{again:?}");
    assert!(again.stderr.contains("exists"), "{}", again.stderr);
    assert_eq!(ids(&out.join("train.bin"), 2), train);
    // The directory that holds the tokenizer.json gives the same files.
    let from_dir = d.join("data-from-dir");
    let f = prepare(
        d,
        &["a.txt", "b.jsonl"],
        d,
        &from_dir,
        &["--val-fraction", "0.1"],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    for file in ["train.bin", "val.bin", "manifest.json"] {
        let read = |dir: &Path| std::fs::read(dir.join(file)).unwrap();
        assert_eq!(read(&from_dir), read(&out), "{file}");
    }

    // Train on it, validating on val.bin.
    let data = format!(
        "{{path: {}, val_path: {}, format: tokens_u16}}",
        out.join("train.bin").display(),
        out.join("val.bin").display()
    );
    let j = job(d, 42, &data);
    let m = d.join("m.jsonl");
    let ckpt = d.join("ckpt");
    let f = TrainArgs::new(&j, &m)
        .set(format!("checkpoint.dir={}", ckpt.display()))
        .run(d);
    assert_eq!(f.code(), 0, "{f:?}");
    let vals: Vec<f64> = metrics(&m)
        .iter()
        .filter_map(|l| l.get("val_loss")?.as_f64())
        .collect();
    assert_eq!(vals.len(), 2, "validation at steps 2 and 4");
    // Sampling through the tokenizer: the prompt, then words of the
    // vocabulary (past the end-of-text id, which decodes to nothing), the
    // same for a seed.
    let sample = || {
        zrun(
            d,
            &[
                "sample",
                ckpt.to_str().unwrap(),
                "--tokenizer",
                tok.to_str().unwrap(),
                "--prompt",
                "w3 w10",
                "--tokens",
                "12",
                "--seed",
                "5",
                "--ignore-eos",
            ],
        )
    };
    let s = sample();
    assert_eq!(s.code(), 0, "{s:?}");
    let text = s.stdout.trim_end();
    assert!(text.starts_with("w3 w10 "), "{text}");
    let drawn: Vec<&str> = text.split_whitespace().skip(2).collect();
    assert!(!drawn.is_empty() && drawn.len() <= 12, "{text}");
    assert!(drawn.iter().all(|w| vocab.contains_key(*w)), "{text}");
    assert_eq!(sample().stdout, s.stdout);
    // `--tokenizer` also takes the directory that holds the tokenizer.json,
    // as `AutoTokenizer.from_pretrained` does; one without is exit 2.
    let from_dir = |dir: &Path| {
        let (ckpt, dir) = (ckpt.to_str().unwrap(), dir.to_str().unwrap());
        let args = ["--prompt", "w3 w10", "--tokens", "12", "--seed", "5"];
        let f = zrun(
            d,
            &[
                &["sample", ckpt, "--tokenizer", dir][..],
                &args,
                &["--ignore-eos"],
            ]
            .concat(),
        );
        (f.code(), f.stdout, f.stderr)
    };
    let (code, stdout, _) = from_dir(tok.parent().unwrap());
    assert_eq!((code, stdout), (0, s.stdout.clone()));
    let (code, _, stderr) = from_dir(&ckpt);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("a directory without a tokenizer.json"),
        "{stderr}"
    );
    // `… | head -c 12` through the tokenizer: zrun stops reading, which
    // stops the generator behind it; both quietly.
    let args = [
        "sample",
        ckpt.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--prompt",
        "w3 w10",
        "--tokens",
        "100000000",
        "--ignore-eos",
    ];
    let (head, code, stderr, children) = zrun_into_head(d, &args, 12);
    assert!(head.starts_with("w3 w10 "), "{head:?}");
    assert_eq!((code, stderr.as_str()), (0, ""));
    assert_gone(&children, Duration::from_secs(10), "after the pipe closed");
    // Without the tokenizer, a model of 42 tokens cannot take a byte prompt.
    let f = zrun(d, &["sample", ckpt.to_str().unwrap(), "--prompt", "w3"]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("give --tokenizer"), "{}", f.stderr);
    // A tokenizer smaller than the model launches (vocabularies get padded),
    // but the ids it has no token for are counted, not silently dropped.
    std::fs::create_dir(d.join("small")).unwrap();
    let (small, _) = tokenizer(&d.join("small"), &words(8));
    let s = zrun(
        d,
        &[
            "sample",
            ckpt.to_str().unwrap(),
            "--tokenizer",
            small.to_str().unwrap(),
            "--prompt",
            "w3",
            "--tokens",
            "12",
            "--seed",
            "5",
        ],
    );
    assert_eq!(s.code(), 0, "{s:?}");
    let unknown: usize = (s.stderr.split("warning: ").nth(1))
        .and_then(|w| w.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let shown = s.stdout.split_whitespace().count() - 1;
    assert!(unknown > 0, "ids 10..41 drawn from 12: {s:?}");
    assert!(shown + unknown <= 12, "{s:?}");
    assert!(
        s.stderr.contains("(10 tokens; the model has 42)"),
        "{}",
        s.stderr
    );
    // A model smaller than the tokenizer's vocabulary does not launch.
    let f = TrainArgs::new(&j, &m)
        .set("model.vocab_size=40")
        .args(&["--overwrite"])
        .run(d);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("40 is smaller than the vocabulary of the tokenizer")
            && f.stderr.contains("manifest.json"),
        "{}",
        f.stderr
    );
}

#[test]
fn a_vocabulary_above_u16_gets_u32_files_that_train() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let n = 70_000;
    let (tok, vocab) = tokenizer(d, &words(n));
    // Words from the top of the vocabulary, so that ids exceed 65,535.
    let text: String = (0..40)
        .map(|i| {
            (0..10)
                .map(|k| format!("w{}", n - 1 - (i * 13 + k * 101) % 8000))
                .collect::<Vec<_>>()
                .join(" ")
                + "\n"
        })
        .collect();
    let records: String = text
        .lines()
        .map(|l| serde_json::json!({"body": l}).to_string() + "\n")
        .collect();
    std::fs::write(d.join("c.jsonl"), records).unwrap();
    let out = d.join("data32");
    let f = prepare(
        d,
        &["c.jsonl"],
        &tok,
        &out,
        &["--field", "body", "--val-fraction", "0.25"],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(
        f.stdout.contains("; tokens_u32, vocabulary 70002"),
        "{}",
        f.stdout
    );
    let train = ids(&out.join("train.bin"), 4);
    let first: Vec<u32> = text
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .map(|w| vocab[w])
        .collect();
    assert_eq!(train[..first.len()], first[..]);
    assert!(train.iter().any(|&t| t > 65_535));
    let data = format!(
        "{{path: {}, val_path: {}, format: tokens_u32}}",
        out.join("train.bin").display(),
        out.join("val.bin").display()
    );
    let j = job(d, n + 2, &data);
    let f = TrainArgs::new(&j, d.join("m.jsonl")).run(d);
    assert_eq!(f.code(), 0, "{f:?}");
    // The wrong field is exit 2 at its line.
    let f = prepare(d, &["c.jsonl"], &tok, &d.join("other"), &[]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("c.jsonl:1: no string field `text`"),
        "{}",
        f.stderr
    );
}

#[test]
fn an_id_outside_the_vocabulary_is_refused_at_its_offset() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut raw: Vec<u16> = (0..400).map(|i| (i % 200) as u16).collect();
    raw[333] = 300;
    let bytes: Vec<u8> = raw.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(d.join("raw.bin"), bytes).unwrap();
    let data = format!(
        "{{path: {}, format: tokens_u16}}",
        d.join("raw.bin").display()
    );
    let j = job(d, 256, &data);
    let f = zrun(
        d,
        &["check", j.to_str().unwrap(), "--set", "train.eval_every=0"],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("raw.bin holds token id 300 at token offset 333 (byte 666)"),
        "{}",
        f.stderr
    );
}

/// A prepare that fails part-way leaves nothing behind in `--out`: not the
/// token files it had begun (hidden `.NAME.partial` files holding the space
/// they took, before the sixty-ninth session), not a manifest. Failing on a
/// bad record after 2 MB of tokens were written (exit 2, naming the line),
/// and on a 64 KiB filesystem that fills (exit 1, naming the file; a tmpfs
/// in a private mount namespace, skipped where that is refused).
#[test]
fn a_failed_prepare_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (tok, _) = tokenizer(d, &words(40));
    let text: String = (0..60_000).map(|i| sentence(i, 12, 40) + "\n").collect();
    std::fs::write(d.join("a.txt"), &text).unwrap();
    std::fs::write(d.join("b.jsonl"), "{\"text\": \"w1 w2\"}\n{\"text\": 7}\n").unwrap();
    let out = d.join("data");
    let f = prepare(d, &["a.txt", "b.jsonl"], &tok, &out, &[]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("b.jsonl:2: no string field `text`"),
        "{}",
        f.stderr
    );
    assert_empty(&out, "");

    let small = d.join("small");
    std::fs::create_dir(&small).unwrap();
    let script = format!(
        "mount -t tmpfs -o size=64k none {s} || exit 99; \"$0\" \"$@\"; echo \"rc=$?\"; echo left:; ls -A {s}/data; exit 0",
        s = small.display()
    );
    let run = std::process::Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .arg(e2e::bin("zrun"))
        .arg("prepare")
        .arg(d.join("a.txt"))
        .arg("--tokenizer")
        .arg(&tok)
        .arg("--out")
        .arg(small.join("data"))
        .output();
    let Some(run) = run.ok().filter(|o| o.status.success()) else {
        eprintln!("a_failed_prepare_leaves_nothing_behind: skipped the full disk: cannot mount a small tmpfs in a private mount namespace (needs root and unshare)");
        return;
    };
    let (stdout, stderr) = (
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr),
    );
    assert!(stdout.contains("rc=1"), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(".train.bin.partial: No space left on device"),
        "{stderr}"
    );
    let left = stdout.split("left:").nth(1).unwrap_or_default();
    assert!(left.trim().is_empty(), "left in --out: {left}");
}

/// A text ends where the model draws the end-of-text token its data put
/// after every document, as Hugging Face's `generate` ends it, unless
/// `--ignore-eos` (until the seventieth session zrun drew on past it, into
/// the next document, for every --tokens asked).
#[test]
fn sampling_stops_at_the_end_of_text_unless_told_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (tok, _) = tokenizer(d, &words(6));
    let records: String = (0..400).map(|_| "{\"text\": \"w2 w3 w4\"}\n").collect();
    std::fs::write(d.join("docs.jsonl"), records).unwrap();
    let out = d.join("data");
    let f = prepare(d, &["docs.jsonl"], &tok, &out, &["--val-fraction", "0"]);
    assert_eq!(f.code(), 0, "{f:?}");
    let data = format!("{{path: {}/train.bin, format: tokens_u16}}", out.display());
    let j = job(d, 8, &data);
    let ckpt = d.join("ckpt");
    let f = TrainArgs::new(&j, d.join("m.jsonl"))
        .set("train.steps=150")
        .set("train.eval_every=0")
        .set(format!("checkpoint.dir={}", ckpt.display()))
        .run(d);
    assert_eq!(f.code(), 0, "{f:?}");
    let sample_from = |model: &Path, more: &[&str]| {
        let mut args = vec![
            "sample",
            model.to_str().unwrap(),
            "--prompt",
            "w2 w3 w4",
            "--temperature",
            "0",
            "--tokens",
            "7",
        ];
        args.extend_from_slice(more);
        zrun(d, &args)
    };
    let sample = |more: &[&str]| {
        let mut args = vec!["--tokenizer", tok.to_str().unwrap()];
        args.extend_from_slice(more);
        let f = sample_from(&ckpt, &args);
        assert_eq!(f.code(), 0, "{f:?}");
        f.stdout
    };
    // Every document is "w2 w3 w4" and then the end-of-text id.
    assert_eq!(sample(&[]), "w2 w3 w4\n");
    assert_eq!(sample(&["--ignore-eos"]), "w2 w3 w4 w2 w3 w4 w2 w3\n");
    // A stop string ends it through the string: one wholly in the prompt
    // stops nothing; one begun in the prompt stops where it is completed.
    let stopped = |stop: &str| sample(&["--ignore-eos", "--stop-string", stop]);
    assert_eq!(stopped("w3 w4"), "w2 w3 w4 w2 w3 w4\n");
    assert_eq!(stopped("w4 w2"), "w2 w3 w4 w2\n");

    // Exported for Hugging Face: without its tokenizer the directory needs
    // --tokenizer; with `tokenizer.json` beside its weights (as published
    // models have it) that one is taken, as `transformers` takes it.
    let hf = d.join("hf");
    e2e::export_hf(d, &ckpt, &hf);
    let f = sample_from(&hf, &[]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("give --tokenizer"), "{}", f.stderr);
    std::fs::copy(&tok, hf.join("tokenizer.json")).unwrap();
    for more in [&[][..], &["--ignore-eos"]] {
        let f = sample_from(&hf, more);
        assert_eq!(f.code(), 0, "{f:?}");
        assert_eq!(f.stdout, sample(more), "{more:?}");
    }
    // Its generation_config.json's stop_strings, as generate's; not a
    // string nor a list of them: exit 2 naming the file.
    let generation = hf.join("generation_config.json");
    std::fs::write(&generation, r#"{"stop_strings": ["w3 w4"]}"#).unwrap();
    let f = sample_from(&hf, &["--ignore-eos"]);
    assert_eq!(
        (f.code(), f.stdout.as_str()),
        (0, "w2 w3 w4 w2 w3 w4\n"),
        "{f:?}"
    );
    assert!(f.stderr.contains("stop at [\"w3 w4\"]"), "{}", f.stderr);
    std::fs::write(&generation, r#"{"stop_strings": 3}"#).unwrap();
    let f = sample_from(&hf, &[]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("generation_config.json: stop_strings is 3"),
        "{}",
        f.stderr
    );
}

/// A UTF-8 byte-order mark (what Windows editors write first) is not text:
/// a JSONL file behind one was "not JSON" at 1:1, and a text file's first
/// tokens took it in. And inputs with no text at all are exit 2 at prepare,
/// not empty token files that `zrun train` refuses later.
#[test]
fn a_byte_order_mark_is_skipped_and_no_text_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (tok, _) = tokenizer(d, &words(40));
    let bom = "\u{feff}";
    std::fs::write(d.join("a.txt"), "w1 w2 w3\n").unwrap();
    std::fs::write(d.join("bom-a.txt"), format!("{bom}w1 w2 w3\n")).unwrap();
    std::fs::write(d.join("a.jsonl"), "{\"text\": \"w4 w5\"}\n").unwrap();
    std::fs::write(
        d.join("bom-a.jsonl"),
        format!("{bom}{{\"text\": \"w4 w5\"}}\n"),
    )
    .unwrap();
    let tokens = |inputs: &[&str], out: &str| {
        let f = prepare(d, inputs, &tok, &d.join(out), &["--val-fraction", "0"]);
        assert_eq!(f.code(), 0, "{f:?}");
        ids(&d.join(out).join("train.bin"), 2)
    };
    let plain = tokens(&["a.txt", "a.jsonl"], "plain");
    assert_eq!(
        plain.len(),
        3 + 1 + 2 + 1,
        "three words, two words, an end-of-text after each"
    );
    assert_eq!(tokens(&["bom-a.txt", "bom-a.jsonl"], "bom"), plain);
    std::fs::write(d.join("empty.txt"), "").unwrap();
    std::fs::write(d.join("blank.jsonl"), "\n\n").unwrap();
    let out = d.join("nothing");
    let f = prepare(
        d,
        &["empty.txt", "blank.jsonl"],
        &tok,
        &out,
        &["--eos", "none"],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("no text to tokenize"), "{}", f.stderr);
    assert_empty(&out, "");
}

/// A byte that is not UTF-8, in a text or a JSONL file, is exit 2 naming
/// the file, the line and the byte (the message said only "stream did not
/// contain valid UTF-8"), and nothing is written.
#[test]
fn text_that_is_not_utf8_is_refused_at_its_line_and_byte() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (tok, _) = tokenizer(d, &words(40));
    std::fs::write(d.join("a.txt"), b"w1 w2\nw3 \xff w4\n").unwrap();
    std::fs::write(
        d.join("a.jsonl"),
        b"{\"text\": \"w1\"}\n\n{\"text\": \"w2\xc3\"}\n",
    )
    .unwrap();
    for (input, want) in [
        ("a.txt", "a.txt:2: byte 4 of the line (0xff) is not UTF-8"),
        (
            "a.jsonl",
            "a.jsonl:3: byte 13 of the line (0xc3) is not UTF-8",
        ),
    ] {
        let out = d.join(format!("out-{input}"));
        let f = prepare(d, &[input], &tok, &out, &[]);
        assert_eq!(f.code(), 2, "{f:?}");
        assert!(f.stderr.contains(want), "{input}: {}", f.stderr);
        assert_empty(&out, "");
    }
}

/// Ctrl-C (or SIGTERM) during a prepare stops it with exit 130 and leaves
/// `--out` as it was: the token files it had begun are removed (until the
/// sixty-ninth session the signal ended it where it stood, with its hidden
/// `.train.bin.partial` of megabytes left behind).
#[test]
fn an_interrupted_prepare_leaves_nothing_behind() {
    use nix::sys::signal::Signal;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (tok, _) = tokenizer(d, &words(40));
    // About 27 MB: a few seconds of work, signalled once it has written.
    let text: String = (0..600_000).map(|i| sentence(i, 12, 40) + "\n").collect();
    let big = d.join("big.txt");
    std::fs::write(&big, &text).unwrap();
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        let out = d.join(format!("data-{signal:?}"));
        let args = [
            "prepare",
            big.to_str().unwrap(),
            "--tokenizer",
            tok.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        let z = e2e::Zrun::start(d, &args);
        let partial = out.join(".train.bin.partial");
        let begun = e2e::wait_until(Duration::from_secs(30), || {
            std::fs::metadata(&partial).is_ok_and(|m| m.len() > 0)
        });
        assert!(begun, "{signal:?}: no tokens written");
        z.signal(signal);
        let f = z.wait(Duration::from_secs(30));
        assert_eq!(f.code(), 130, "{signal:?}: {f:?}");
        assert!(f.stderr.contains("interrupted"), "{}", f.stderr);
        assert_empty(&out, &format!("{signal:?}: "));
    }
}

/// ChatML, Qwen's layout of a conversation.
const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// [`tokenizer`] of `n` words and the `roles` as words, with ChatML's
/// markers `<|im_start|>` and `<|im_end|>` as added special tokens (single
/// ids wherever they stand in a text).
fn chat_tokenizer(dir: &Path, n: usize, roles: &[&str]) -> (PathBuf, HashMap<String, u32>) {
    let mut vocab_words = words(n);
    vocab_words.extend(roles.iter().map(|r| r.to_string()));
    let (tok, mut vocab) = tokenizer(dir, &vocab_words);
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tok).unwrap()).unwrap();
    for marker in ["<|im_start|>", "<|im_end|>"] {
        let id = vocab.len() as u32;
        vocab.insert(marker.to_string(), id);
        json["model"]["vocab"][marker] = serde_json::json!(id);
        json["added_tokens"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
            "id": id, "content": marker, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}));
    }
    std::fs::write(&tok, json.to_string()).unwrap();
    (tok, vocab)
}

/// [`chat_tokenizer`] of ten words and the `roles`, with the ChatML
/// template in the `tokenizer_config.json` beside it, where `zrun prepare`
/// and `zrun sample` find it.
fn chatml_tokenizer(dir: &Path, roles: &[&str]) -> (PathBuf, HashMap<String, u32>) {
    let made = chat_tokenizer(dir, 10, roles);
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": CHATML}).to_string(),
    )
    .unwrap();
    made
}

/// A JSONL record `{"messages": [...]}` of (role, content) messages.
fn chat_record<'a>(messages: impl Iterator<Item = (&'a str, &'a str)>) -> String {
    let messages: Vec<_> = messages
        .map(|(r, t)| serde_json::json!({"role": r, "content": t}))
        .collect();
    serde_json::json!({ "messages": messages }).to_string()
}

/// JSONL conversations (`{"messages": [...]}`, the layout of TRL's
/// conversational datasets) laid out by the chat template beside the
/// tokenizer and tokenized as one document each: the ids are those of the
/// layout written out here by hand (its markers single special tokens, no
/// generation prompt, the end-of-text id after each), text records beside
/// them unchanged. Without a template: exit 2 naming the line and where it
/// looked; `--chat-template` given; a template's refusal names the record.
#[test]
fn conversations_are_laid_out_by_the_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (tok, vocab) = chat_tokenizer(d, 6, &["system", "user", "assistant"]);
    let conversations = [
        vec![
            ("system", "w5"),
            ("user", "w1 w2"),
            ("assistant", "w3 w3 w4"),
        ],
        vec![
            ("user", "w0"),
            ("assistant", "w1"),
            ("user", "w2 w2"),
            ("assistant", "w5"),
        ],
    ];
    let record = |c: &Vec<(&str, &str)>| chat_record(c.iter().copied());
    std::fs::write(
        d.join("chats.jsonl"),
        format!(
            "{}\n{}\n{}\n",
            record(&conversations[0]),
            serde_json::json!({"text": "w4 w4"}),
            record(&conversations[1])
        ),
    )
    .unwrap();
    let out = d.join("out");
    // No template beside the tokenizer: exit 2 at the first conversation.
    let f = prepare(d, &["chats.jsonl"], &tok, &out, &["--val-fraction", "0"]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("chats.jsonl:1: `messages` is a conversation")
            && f.stderr.contains("has no chat template"),
        "{}",
        f.stderr
    );
    // One zrun cannot read: text still prepares, a conversation says why.
    std::fs::write(d.join("tokenizer_config.json"), r#"{"chat_template": 3}"#).unwrap();
    std::fs::write(d.join("text.jsonl"), "{\"text\": \"w1 w2\"}\n").unwrap();
    let f = prepare(d, &["text.jsonl"], &tok, &out, &["--val-fraction", "0"]);
    assert_eq!(f.code(), 0, "{f:?}");
    let f = prepare(
        d,
        &["chats.jsonl"],
        &tok,
        &out,
        &["--val-fraction", "0", "--overwrite"],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains(
            "chats.jsonl:1: `messages` is a conversation, and its chat template cannot be read"
        ) && f.stderr.contains("chat_template is 3"),
        "{}",
        f.stderr
    );
    std::fs::write(
        d.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": CHATML, "eos_token": "<|endoftext|>"}).to_string(),
    )
    .unwrap();
    let f = prepare(
        d,
        &["chats.jsonl"],
        &tok,
        &out,
        &["--val-fraction", "0", "--overwrite"],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let id = |w: &str| vocab[w];
    let laid_out = |c: &Vec<(&str, &str)>| {
        let mut ids = Vec::new();
        for (role, text) in c {
            ids.push(id("<|im_start|>"));
            ids.push(id(role));
            ids.extend(text.split(' ').map(id));
            ids.push(id("<|im_end|>"));
        }
        ids.push(id("<|endoftext|>"));
        ids
    };
    let want: Vec<u32> = [
        laid_out(&conversations[0]),
        vec![id("w4"), id("w4"), id("<|endoftext|>")],
        laid_out(&conversations[1]),
    ]
    .concat();
    assert_eq!(ids(&out.join("train.bin"), 2), want);
    // --chat-template over the one beside the tokenizer; a template that
    // refuses a record names it.
    std::fs::write(
        d.join("strict.jinja"),
        "{% if messages[0].role != 'system' %}{{ raise_exception('a system message first') }}{% endif %}{{ messages[0].content }}",
    )
    .unwrap();
    let strict = d.join("strict.jinja").display().to_string();
    let extra = [
        "--val-fraction",
        "0",
        "--overwrite",
        "--chat-template",
        &strict,
    ];
    let f = prepare(d, &["chats.jsonl"], &tok, &out, &extra);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("chats.jsonl:3: ")
            && f.stderr
                .contains("strict.jinja: line 1: the template refuses: a system message first"),
        "{}",
        f.stderr
    );
    std::fs::write(d.join("one.jsonl"), record(&conversations[0]) + "\n").unwrap();
    let f = prepare(
        d,
        &["one.jsonl"],
        &tok,
        &out,
        &[&extra[..], &["--field", "messages"]].concat(),
    );
    assert_eq!(f.code(), 0, "{f:?}");
    assert_eq!(
        ids(&out.join("train.bin"), 2),
        vec![id("w5"), id("<|endoftext|>")]
    );
    // --chat-arg: a variable for every record, which a record's own
    // chat_template_kwargs override; a reserved name is exit 2.
    std::fs::write(
        d.join("tagged.jinja"),
        "{% for m in messages %}{{ tag }} {{ m.content }} {% endfor %}",
    )
    .unwrap();
    let tagged = d.join("tagged.jinja").display().to_string();
    let own = serde_json::json!({"messages": [{"role": "user", "content": "w1"}],
        "chat_template_kwargs": {"tag": "w3"}});
    std::fs::write(
        d.join("tags.jsonl"),
        format!("{}\n{own}\n", record(&conversations[1])),
    )
    .unwrap();
    let tags = [
        "--val-fraction",
        "0",
        "--overwrite",
        "--chat-template",
        &tagged,
        "--eos",
        "none",
    ];
    let f = prepare(
        d,
        &["tags.jsonl"],
        &tok,
        &out,
        &[&tags[..], &["--chat-arg", "tag=\"w4\""]].concat(),
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let want: Vec<u32> = [
        "w4", "w0", "w4", "w1", "w4", "w2", "w2", "w4", "w5", "w3", "w1",
    ]
    .map(id)
    .to_vec();
    assert_eq!(ids(&out.join("train.bin"), 2), want);
    let f = prepare(
        d,
        &["tags.jsonl"],
        &tok,
        &out,
        &[&tags[..], &["--chat-arg", "messages=[]"]].concat(),
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("`messages` comes with the conversation"),
        "{}",
        f.stderr
    );
}

/// The chat workflow end to end: conversations prepared with the chat
/// template, a model trained on them, and `zrun sample --chat` (the
/// template found beside `--tokenizer`) answering a new user message as
/// the assistant did in training, ending at the end of the document; from
/// the exported directory, with the end of the turn as its
/// `generation_config.json`'s `eos_token_id` (as instruction-tuned models
/// publish it), ending there.
#[test]
fn a_model_trained_on_conversations_answers_in_turn() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (tok, vocab) = chatml_tokenizer(d, &["user", "assistant"]);
    // Whatever the user says, the assistant answers "w7 w8".
    let records: String = (0..400)
        .map(|i| {
            let messages = serde_json::json!([
                {"role": "user", "content": format!("w{}", i % 6)},
                {"role": "assistant", "content": "w7 w8"}]);
            format!("{}\n", serde_json::json!({ "messages": messages }))
        })
        .collect();
    std::fs::write(d.join("chats.jsonl"), records).unwrap();
    let out = d.join("data");
    let f = prepare(d, &["chats.jsonl"], &tok, &out, &["--val-fraction", "0"]);
    assert_eq!(f.code(), 0, "{f:?}");
    let data = format!("{{path: {}/train.bin, format: tokens_u16}}", out.display());
    let j = job(d, vocab.len(), &data);
    let ckpt = d.join("ckpt");
    let f = TrainArgs::new(&j, d.join("m.jsonl"))
        .set("train.steps=200")
        .set("train.eval_every=0")
        .set(format!("checkpoint.dir={}", ckpt.display()))
        .run(d);
    assert_eq!(f.code(), 0, "{f:?}");
    let prompt = "<|im_start|>user\nw3<|im_end|>\n<|im_start|>assistant\n";
    let answer = |model: &Path, more: &[&str]| {
        let mut args = vec![
            "sample",
            model.to_str().unwrap(),
            "--chat",
            "--prompt",
            "w3",
            "--temperature",
            "0",
            "--tokens",
            "6",
        ];
        args.extend_from_slice(more);
        let f = zrun(d, &args);
        assert_eq!(f.code(), 0, "{f:?}");
        assert!(f.stdout.starts_with(prompt), "{:?}", f.stdout);
        let words: Vec<String> = f.stdout[prompt.len()..]
            .split_whitespace()
            .map(String::from)
            .collect();
        (words, f.stderr)
    };
    // From the checkpoint: "w7 w8", the end of the turn (a special token,
    // which prints as nothing), then the end of the document: three drawn.
    let tokenizer = ["--tokenizer", tok.to_str().unwrap()];
    let (words, said) = answer(&ckpt, &tokenizer);
    assert_eq!(words, ["w7", "w8"]);
    assert!(said.contains("3 tokens drawn"), "{said}");
    // Past the end of the document, the next conversation: a user's turn.
    let (words, _) = answer(&ckpt, &[&tokenizer[..], &["--ignore-eos"]].concat());
    assert_eq!(words[..3], ["w7", "w8", "user"]);
    // As a published instruction-tuned directory: its template and
    // tokenizer beside its weights, the end of a turn its end of text.
    let hf = d.join("hf");
    e2e::export_hf(d, &ckpt, &hf);
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(d.join(name), hf.join(name)).unwrap();
    }
    std::fs::write(
        hf.join("generation_config.json"),
        serde_json::json!({"eos_token_id": vocab["<|im_end|>"]}).to_string(),
    )
    .unwrap();
    let (words, said) = answer(&hf, &[]);
    assert_eq!(words, ["w7", "w8"]);
    assert!(said.contains("2 tokens drawn"), "{said}");
}

/// `--assistant-only-loss` (TRL's `assistant_only_loss`): prepare writes a
/// byte per token marking the assistant's turns (their words and end of
/// turn; not the role, which the generation prompt holds, nor the
/// end-of-text id), as written out here by hand; text is refused. Trained
/// on, the step divides by its own count of trained targets: one worker
/// with four sequences and two workers with two each give the same
/// gradient norms and validation losses (a mean per micro-batch would
/// not), and two workers at stage 3 give stage 0's bits. A mask that is
/// not the token file's is refused before launch.
#[test]
fn an_assistant_only_loss_trains_on_the_assistants_turns_alone() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (tok, vocab) = chatml_tokenizer(d, &["system", "user", "assistant"]);
    // Turns of uneven length, so micro-batches count uneven numbers of
    // trained targets.
    let conversation = |i: usize| -> Vec<(String, String)> {
        let mut c = Vec::new();
        if i.is_multiple_of(3) {
            c.push(("system".to_string(), sentence(i, 1 + i % 2, 10)));
        }
        for turn in 0..1 + i % 2 {
            c.push((
                "user".into(),
                sentence(i + turn, 1 + (i * 7 + turn) % 6, 10),
            ));
            c.push(("assistant".into(), sentence(i * 3 + turn, 1 + i % 4, 10)));
        }
        c
    };
    let record = |c: &[(String, String)]| {
        chat_record(c.iter().map(|(r, t)| (r.as_str(), t.as_str()))) + "\n"
    };
    let records: String = (0..300).map(|i| record(&conversation(i))).collect();
    std::fs::write(d.join("chats.jsonl"), records).unwrap();
    let out = d.join("data");
    let masked = ["--assistant-only-loss", "--val-fraction", "0.1"];
    let f = prepare(d, &["chats.jsonl"], &tok, &out, &masked);
    assert_eq!(f.code(), 0, "{f:?}");
    // The first ten records (the split sends every tenth to val.bin, from
    // the tenth on) as laid out by hand, each token with its mask byte.
    let id = |w: &str| vocab[w];
    let mut want = (Vec::new(), Vec::new());
    for i in 0..9 {
        for (role, text) in conversation(i) {
            let on = u8::from(role == "assistant");
            for (t, m) in [("<|im_start|>", 0), (role.as_str(), 0)] {
                want.0.push(id(t));
                want.1.push(m);
            }
            for w in text.split(' ') {
                want.0.push(id(w));
                want.1.push(on);
            }
            want.0.push(id("<|im_end|>"));
            want.1.push(on);
        }
        want.0.push(id("<|endoftext|>"));
        want.1.push(0);
    }
    let n = want.0.len();
    let mask = std::fs::read(out.join("train.mask")).unwrap();
    assert_eq!(ids(&out.join("train.bin"), 2)[..n], want.0);
    assert_eq!(mask[..n], want.1);
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    let entry = &manifest["files"]["train.bin"];
    assert_eq!(entry["mask"]["file"], "train.mask");
    assert_eq!(
        entry["mask"]["trained"].as_u64(),
        Some(mask.iter().filter(|&&m| m == 1).count() as u64)
    );
    assert_eq!(entry["tokens"].as_u64(), Some(mask.len() as u64));
    // Text, a record or a file, has no assistant's turns.
    std::fs::write(d.join("text.jsonl"), "{\"text\": \"w1 w2\"}\n").unwrap();
    std::fs::write(d.join("text.txt"), "w1 w2\n").unwrap();
    let other = d.join("other");
    for (input, says) in [
        (
            "text.jsonl",
            "text.jsonl:1: `text` is text, not a conversation",
        ),
        ("text.txt", "text.txt is a text file"),
    ] {
        let f = prepare(d, &[input], &tok, &other, &masked);
        assert_eq!(f.code(), 2, "{f:?}");
        assert!(f.stderr.contains(says), "{}", f.stderr);
    }
    // A template that lays out an earlier turn otherwise once later ones
    // follow (here: empties it) cannot be split into turns.
    std::fs::write(
        d.join("rewrite.jinja"),
        CHATML.replace(
            "{{ m.content }}",
            "{% if m.role != 'assistant' or loop.last %}{{ m.content }}{% endif %}",
        ),
    )
    .unwrap();
    let rewrite = d.join("rewrite.jinja").display().to_string();
    let f = prepare(
        d,
        &["chats.jsonl"],
        &tok,
        &other,
        &[&masked[..], &["--chat-template", &rewrite]].concat(),
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("chats.jsonl:2: message 2: the chat template lays out"),
        "{}",
        f.stderr
    );
    // Trained: 1 worker × 4 sequences, 2 workers × 2 (stages 0 and 3).
    let data = format!(
        "{{path: {0}/train.bin, val_path: {0}/val.bin, format: tokens_u16}}",
        out.display()
    );
    let j = job(d, vocab.len(), &data);
    let run = |name: &str, sets: &[&str], extra: &[&str]| {
        let m = d.join(format!("{name}.jsonl"));
        let mut args = TrainArgs::new(&j, &m)
            .set("train.steps=12")
            .set("train.eval_every=4")
            .args(extra);
        for s in sets {
            args = args.set(*s);
        }
        let f = args.run(d);
        assert_eq!(f.code(), 0, "{name}: {f:?}");
        let lines = metrics(&m);
        let column = |key: &str| -> Vec<f64> {
            lines
                .iter()
                .filter_map(|l| l.get(key).and_then(|v| v.as_f64()))
                .collect()
        };
        (column("grad_norm"), column("val_loss"), column("loss"))
    };
    let two = ["--workers-per-node", "2"];
    let ckpt = format!("checkpoint.dir={}", d.join("ckpt").display());
    let one = run(
        "one",
        &["train.micro_batch_size=4", &ckpt, "checkpoint.every=12"],
        &["--workers-per-node", "1"],
    );
    // `zrun eval` on the validation file scores the targets its mask keeps
    // (found through the manifest), and every target of the same ids
    // without one.
    let val_mask = std::fs::read(out.join("val.mask")).unwrap();
    let kept = val_mask[1..].iter().filter(|&&m| m == 1).count() as u64;
    assert!(kept > 0 && kept < val_mask.len() as u64 - 1);
    let bare = d.join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    std::fs::copy(out.join("val.bin"), bare.join("val.bin")).unwrap();
    let eval = |data: &Path, more: &[&str]| {
        let ckpt = d.join("ckpt");
        let args = [
            &[
                "eval",
                ckpt.to_str().unwrap(),
                "--data",
                data.to_str().unwrap(),
            ],
            more,
        ]
        .concat();
        let f = zrun(d, &args);
        assert_eq!(f.code(), 0, "{f:?}");
        let said: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
        said["tokens"].as_u64().unwrap()
    };
    assert_eq!(eval(&out.join("val.bin"), &[]), kept);
    assert_eq!(
        eval(&bare.join("val.bin"), &["--format", "tokens_u16"]),
        val_mask.len() as u64 - 1
    );
    // A text file through the tokenizer: a token a word; none: exit 2.
    std::fs::write(d.join("held.txt"), "w1 w2 w3 w1 w2").unwrap();
    let tok_arg = ["--tokenizer", tok.to_str().unwrap()];
    assert_eq!(eval(&d.join("held.txt"), &tok_arg), 4);
    let f = zrun(d, &["eval", "ckpt", "--data", "held.txt"]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("give --tokenizer"), "{}", f.stderr);
    let stage0 = run("stage0", &[], &two);
    let stage3 = run("stage3", &["zero.stage=3"], &two);
    assert_eq!((one.0.len(), one.1.len()), (12, 3));
    for (what, a, b) in [
        ("grad norm", &one.0, &stage0.0),
        ("val loss", &one.1, &stage0.1),
    ] {
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-5 * x.abs(),
                "{what}: 1 worker {a:?}\n2 workers {b:?}"
            );
        }
    }
    assert_eq!(stage0, stage3, "stage 3 against stage 0");
    // Prepared again without the flag: the old mask goes with the old data.
    let f = prepare(
        d,
        &["chats.jsonl"],
        &tok,
        &out,
        &["--val-fraction", "0.1", "--overwrite"],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(!out.join("train.mask").exists(), "a stale mask left");
    // A mask that is not a byte per token is refused before launch.
    let f = prepare(
        d,
        &["chats.jsonl"],
        &tok,
        &out,
        &[&masked[..], &["--overwrite"]].concat(),
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let mut mask = std::fs::read(out.join("train.mask")).unwrap();
    mask.pop();
    std::fs::write(out.join("train.mask"), mask).unwrap();
    let f = zrun(d, &["check", j.to_str().unwrap()]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("train.mask") && f.stderr.contains("not one per token"),
        "{}",
        f.stderr
    );
}

/// The assistant's tokens as `transformers` marks them: a ChatML template
/// with transformers' `{% generation %}` marks around each answer and its
/// end of turn, and `apply_chat_template(return_assistant_tokens_mask=True)`
/// (which maps the marked characters to tokens) gives the same ids and the
/// same mask as `zrun prepare --assistant-only-loss` with that template
/// (its marks) and with the same template unmarked (prefix renderings),
/// each mapping bytes to tokens: over system messages, several turns, and
/// a two-byte character before a word. CI requires the reference;
/// elsewhere it may skip, saying so.
#[test]
fn assistant_masks_are_the_ones_transformers_finds_from_generation_marks() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (tok, _) = chat_tokenizer(d, 10, &["system", "user", "assistant"]);
    let template = "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    std::fs::write(d.join("marked.jinja"), template).unwrap();
    let unmarked = template
        .replace("{% generation %}", "")
        .replace("{% endgeneration %}", "");
    std::fs::write(d.join("unmarked.jinja"), unmarked).unwrap();
    let conversations = serde_json::json!([
        [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}],
        [{"role": "system", "content": "w9"}, {"role": "user", "content": "w4"},
         {"role": "assistant", "content": "w5 w6 w7"}, {"role": "user", "content": "w8 w0"},
         {"role": "assistant", "content": "w1"}],
        [{"role": "user", "content": "é w2"}, {"role": "assistant", "content": "ü w3 w4"}],
    ]);
    let records: String = conversations
        .as_array()
        .unwrap()
        .iter()
        .map(|c| serde_json::json!({ "messages": c }).to_string() + "\n")
        .collect();
    std::fs::write(d.join("chats.jsonl"), records).unwrap();
    // Prepared with the template marked, and unmarked.
    let prepared = |name: &str| {
        let out = d.join(name);
        let template = d.join(format!("{name}.jinja")).display().to_string();
        let flags = [
            "--assistant-only-loss",
            "--chat-template",
            &template,
            "--val-fraction",
            "0",
            "--eos",
            "none",
        ];
        let f = prepare(d, &["chats.jsonl"], &tok, &out, &flags);
        assert_eq!(f.code(), 0, "{f:?}");
        ids_and_mask(&out)
    };
    let marked = prepared("marked");
    let unmarked = prepared("unmarked");
    let reference = r#"
tok = PreTrainedTokenizerFast(tokenizer_file=request["tokenizer"])
ids, mask = [], []
for messages in request["conversations"]:
    r = tok.apply_chat_template(messages, chat_template=request["template"], tokenize=True,
        return_dict=True, return_assistant_tokens_mask=True)
    ids += r["input_ids"]
    mask += r["assistant_masks"]
print(json.dumps({"ids": ids, "mask": mask}))
"#;
    let request = serde_json::json!({
        "tokenizer": tok.display().to_string(),
        "template": template,
        "conversations": conversations,
    });
    let Some(want) = transformers_lists(reference, &request) else {
        return;
    };
    let list = |key: &str| want[key].clone();
    let want = (list("ids"), list("mask"));
    assert!(want.1.contains(&1) && want.1.contains(&0));
    assert_eq!(marked, want, "marked: ids, mask");
    assert_eq!(unmarked, want, "unmarked: ids, mask");
}

/// TRL's prompt-completion records (`{"prompt", "completion"}`, both text
/// or both conversations): one document each, the prompt then the
/// completion, the loss kept to the completion by default (TRL's
/// `completion_only_loss`, on for such records): a text completion and the
/// end-of-text id after it, a conversational one from the end of the
/// generation prompt through its end of turn; a text record beside them
/// trained whole. Ids and mask bytes as written out by hand; the same under
/// `--assistant-only-loss`; `--completion-only-loss false` trains on all of
/// it (no mask written), and with `--assistant-only-loss` on the
/// assistant's turns alone, refusing a text prompt-completion record. A
/// text prompt with a conversational completion is exit 2 naming the line.
#[test]
fn prompt_completion_records_train_on_the_completion() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (tok, vocab) = chatml_tokenizer(d, &["user", "assistant"]);
    let records = [
        serde_json::json!({"prompt": "w1 w2", "completion": " w3 w4"}),
        serde_json::json!({"prompt": [{"role": "user", "content": "w5"}],
            "completion": [{"role": "assistant", "content": "w6 w7"}]}),
        serde_json::json!({"text": "w8 w9"}),
    ];
    let jsonl = |records: &[serde_json::Value]| -> String {
        records.iter().map(|r| r.to_string() + "\n").collect()
    };
    std::fs::write(d.join("pc.jsonl"), jsonl(&records)).unwrap();
    std::fs::write(d.join("both_pc.jsonl"), jsonl(&records[..2])).unwrap();
    std::fs::write(d.join("chat_pc.jsonl"), jsonl(&records[1..2])).unwrap();
    std::fs::write(d.join("text_pc.jsonl"), jsonl(&records[..1])).unwrap();
    let id = |w: &str| vocab[w];
    let want_ids: Vec<u32> = [
        "w1",
        "w2",
        "w3",
        "w4",
        "<|endoftext|>",
        "<|im_start|>",
        "user",
        "w5",
        "<|im_end|>",
        "<|im_start|>",
        "assistant",
        "w6",
        "w7",
        "<|im_end|>",
        "<|endoftext|>",
        "w8",
        "w9",
        "<|endoftext|>",
    ]
    .map(id)
    .to_vec();
    let want_mask = [0u8, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 1, 1];
    let out = d.join("data");
    let prepared = |input: &str, flags: &[&str]| {
        let flags = [&["--val-fraction", "0", "--overwrite"], flags].concat();
        let f = prepare(d, &[input], &tok, &out, &flags);
        assert_eq!(f.code(), 0, "{flags:?}: {f:?}");
        let mask = std::fs::read(out.join("train.mask")).ok();
        (ids(&out.join("train.bin"), 2), mask)
    };
    let masked = (want_ids.clone(), Some(want_mask.to_vec()));
    assert_eq!(prepared("pc.jsonl", &[]), masked, "by default");
    let manifest = std::fs::read_to_string(out.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"trained\": 9"), "{manifest}");
    // Under --assistant-only-loss (which refuses the text record).
    assert_eq!(
        prepared("both_pc.jsonl", &["--assistant-only-loss"]).1,
        Some(want_mask[..15].to_vec())
    );
    let whole = ["--completion-only-loss", "false"];
    assert_eq!(prepared("pc.jsonl", &whole), (want_ids, None), "whole");
    let manifest = std::fs::read_to_string(out.join("manifest.json")).unwrap();
    assert!(!manifest.contains("mask"), "{manifest}");
    // The assistant's turns alone: the conversational record's completion.
    let turns = [&whole[..], &["--assistant-only-loss"]].concat();
    assert_eq!(
        prepared("chat_pc.jsonl", &turns).1,
        Some(want_mask[5..15].to_vec())
    );
    let turns = [&turns[..], &["--overwrite"]].concat();
    let f = prepare(d, &["text_pc.jsonl"], &tok, &out, &turns);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains(
            "text_pc.jsonl:1: a text prompt and completion, which have no assistant's turns"
        ),
        "{}",
        f.stderr
    );
    let flags = ["--val-fraction", "0", "--overwrite"];
    let mixed =
        serde_json::json!({"prompt": "w1", "completion": [{"role": "assistant", "content": "w2"}]});
    std::fs::write(d.join("mixed.jsonl"), format!("\n{mixed}\n")).unwrap();
    let f = prepare(d, &["mixed.jsonl"], &tok, &out, &flags);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("mixed.jsonl:2: `prompt` and `completion` must both be text"),
        "{}",
        f.stderr
    );
}

/// A byte-level tokenizer.json (GPT-2's: every byte a token, id = the
/// byte, no merges), with `<|endoftext|>` (256), `<|im_start|>` and
/// `<|im_end|>` as added special tokens: its ids spell the text out, so
/// that ids compared are texts compared, to the byte.
fn byte_tokenizer(dir: &Path) -> PathBuf {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut next = 256;
    let mut vocab: serde_json::Map<String, serde_json::Value> = (0..256u32)
        .map(|b| {
            let c = match printable(b) {
                true => b,
                false => (next, next += 1).0,
            };
            (char::from_u32(c).unwrap().to_string(), b.into())
        })
        .collect();
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut added = Vec::new();
    for (i, s) in specials.iter().enumerate() {
        vocab.insert(s.to_string(), (256 + i).into());
        added.push(
            serde_json::json!({"id": 256 + i, "content": s, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
        );
    }
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": false, "use_regex": false});
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": byte_level, "model": {"type": "BPE", "vocab": vocab, "merges": []},
    });
    let p = dir.join("tokenizer.json");
    std::fs::write(&p, json.to_string()).unwrap();
    p
}

/// Records with tools, as TRL's SFTTrainer prepares them: a record's
/// `tools` (a list, or a JSON text of one) and `chat_template_kwargs` reach
/// the template for every rendering of it: a conversation with tool calls,
/// a tool's answer and reasoning under `reasoning` (trained whole), a
/// conversational prompt-completion record with `enable_thinking: false`
/// (whose empty think block the generation prompt holds: the loss from
/// where the prompt with its generation prompt stops agreeing, as TRL's
/// `common_prefix_length` finds it), and a text one (its completion and
/// end-of-text). The ids (bytes: the text) and the mask are
/// those of TRL's tokenization written out with transformers'
/// `apply_chat_template` (each document ended by the end-of-text id, zrun's
/// layout). And under `--assistant-only-loss`, with the template's
/// assistant text marked by `{% generation %}` and unmarked (prefix
/// renderings), the mask is transformers' `return_assistant_tokens_mask`
/// with the tools. CI requires the reference.
#[test]
fn tools_and_template_arguments_reach_the_template_as_trl_passes_them() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tok = byte_tokenizer(d);
    let template = e2e::TOOLS_TEMPLATE;
    let marked = template
        .replace(
            "{{- '<|im_start|>assistant\\n' }}\n{%- if message.reasoning_content",
            "{{- '<|im_start|>assistant\\n' }}{% generation %}\n{%- if message.reasoning_content",
        )
        .replace(
            "{{- '<|im_end|>\\n' }}\n{%- elif message.role == 'tool'",
            "{{- '<|im_end|>\\n' }}{% endgeneration %}\n{%- elif message.role == 'tool'",
        );
    assert_eq!(marked.matches("generation %}").count(), 2, "{marked}");
    for (name, text) in [("unmarked.jinja", template), ("marked.jinja", &marked)] {
        std::fs::write(d.join(name), text).unwrap();
    }
    let tools = format!("[{}]", e2e::WEATHER_TOOL);
    let call = |city: &str| {
        format!(
            r#"{{"role": "assistant", "content": "", "tool_calls": [{{"type": "function", "function": {{"name": "weather", "arguments": {{"city": "{city}", "days": 1}}}}}}]}}"#
        )
    };
    let chat = format!(
        r#"{{"messages": [{{"role": "user", "content": "Weather in Oslo?"}}, {}, {{"role": "tool", "content": "Sunny, 21°C"}}, {{"role": "assistant", "content": "Sunny.", "reasoning": "It said so."}}], "tools": {tools}}}"#,
        call("Oslo").replacen(
            r#""content": """#,
            r#""content": "", "reasoning": "Ask.""#,
            1
        )
    );
    let tools_text = serde_json::to_string(&tools).unwrap();
    let chat_pc = format!(
        r#"{{"prompt": [{{"role": "system", "content": "Be brief."}}, {{"role": "user", "content": "Bergen?"}}], "completion": [{}], "tools": {tools_text}, "chat_template_kwargs": {{"enable_thinking": false}}}}"#,
        // Qwen3's layout of an answer without thinking: the empty think
        // block that `enable_thinking: false` puts in the prompt.
        call("Bergen").replacen(
            r#""content": """#,
            r#""content": "\n\n", "reasoning": "\n\n""#,
            1
        )
    );
    let text_pc = r#"{"prompt": "Q: 2+2?\nA:", "completion": " 4"}"#;
    let records = [chat.as_str(), &chat_pc, text_pc];
    std::fs::write(d.join("sft.jsonl"), records.join("\n") + "\n").unwrap();
    std::fs::write(d.join("chat.jsonl"), chat.clone() + "\n").unwrap();
    let prepared = |input: &str, out: &str, flags: &[&str]| {
        let out = d.join(out);
        let flags = [&["--val-fraction", "0"], flags].concat();
        let f = prepare(d, &[input], &tok, &out, &flags);
        assert_eq!(f.code(), 0, "{flags:?}: {f:?}");
        ids_and_mask(&out)
    };
    let unmarked = d.join("unmarked.jinja").display().to_string();
    let marked_file = d.join("marked.jinja").display().to_string();
    let sft = prepared("sft.jsonl", "sft", &["--chat-template", &unmarked]);
    let assistant_only = |template: &str, out: &str| {
        let flags = [
            "--chat-template",
            template,
            "--assistant-only-loss",
            "--eos",
            "none",
        ];
        prepared("chat.jsonl", out, &flags)
    };
    let turns_marked = assistant_only(&marked_file, "marked");
    let turns_unmarked = assistant_only(&unmarked, "unmarked");
    // Without the reference, what zrun wrote still holds the tools' layout.
    let text: String = sft
        .0
        .iter()
        .filter(|&&i| i < 256)
        .map(|&i| i as u8 as char)
        .collect();
    assert!(
        text.contains("\"name\": \"weather\", \"description\""),
        "{text}"
    );
    let reference = r#"
tok = PreTrainedTokenizerFast(tokenizer_file=request["tokenizer"], eos_token="<|endoftext|>")
eos = tok.convert_tokens_to_ids("<|endoftext|>")
def chat(messages, **kwargs):
    return tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
def common_prefix_length(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
# TRL's SFTTrainer (tokenize_fn, 1.x): its completion mask, and every token
# of a language-modelling record; then zrun's end-of-text after each document.
ids, mask = [], []
for line in request["records"]:
    example = json.loads(line)
    tools = example.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    kwargs = {"chat_template": request["template"], "tools": tools, **example.get("chat_template_kwargs", {})}
    if "prompt" in example:
        if isinstance(example["prompt"], list):
            prompt = chat(example["prompt"], add_generation_prompt=True, **kwargs)["input_ids"]
            whole = chat(example["prompt"] + example["completion"], **kwargs)["input_ids"]
            end = [0]
        else:
            # TRL ends a text completion with the end-of-text token.
            prompt = tok(example["prompt"])["input_ids"]
            whole = tok(example["prompt"] + example["completion"] + tok.eos_token)["input_ids"]
            end = []
        n = common_prefix_length(prompt, whole)
        ids += whole + [eos] * len(end)
        mask += [0] * n + [1] * (len(whole) - n) + end
    else:
        whole = chat(example["messages"], **kwargs)["input_ids"]
        ids += whole + [eos]
        mask += [1] * (len(whole) + 1)
example = json.loads(request["records"][0])
turns = chat(example["messages"], chat_template=request["marked"], tools=example["tools"],
    return_assistant_tokens_mask=True)
print(json.dumps({"ids": ids, "mask": mask, "turn_ids": turns["input_ids"], "turn_mask": turns["assistant_masks"]}))
"#;
    let request = serde_json::json!({
        "tokenizer": tok.display().to_string(),
        "template": template,
        "marked": marked,
        "records": records,
    });
    let Some(want) = transformers_lists(reference, &request) else {
        return;
    };
    let list = |key: &str| want[key].clone();
    // Shown as text (a special token by its id) and a string of mask bits.
    let shown = |(ids, mask): &(Vec<u64>, Vec<u64>)| -> (String, String) {
        let text = ids
            .iter()
            .map(|&i| match i < 256 {
                true => char::from(i as u8).to_string(),
                false => format!("<{i}>"),
            })
            .collect();
        (text, mask.iter().map(|m| m.to_string()).collect())
    };
    assert_eq!(shown(&sft), shown(&(list("ids"), list("mask"))), "sft");
    let turns = (list("turn_ids"), list("turn_mask"));
    assert!(turns.1.contains(&0) && turns.1.contains(&1));
    assert_eq!(shown(&turns_marked), shown(&turns), "marked");
    assert_eq!(shown(&turns_unmarked), shown(&turns), "unmarked");
}

/// The u16 ids of `out/train.bin` and the bytes of its mask, as the
/// integers a Python reference answers with.
fn ids_and_mask(out: &Path) -> (Vec<u64>, Vec<u64>) {
    let mask = std::fs::read(out.join("train.mask")).unwrap();
    let ids = ids(&out.join("train.bin"), 2);
    (
        ids.into_iter().map(u64::from).collect(),
        mask.into_iter().map(u64::from).collect(),
    )
}

/// A reference script's `transformers` at hand: `request` read from stdin,
/// or `NO_TRANSFORMERS` printed where it is missing.
const TRANSFORMERS_PRELUDE: &str = r#"
import json, sys
try:
    import jinja2  # transformers renders with it, and does not install it
    from transformers import PreTrainedTokenizerFast
except ImportError as e:
    print("NO_TRANSFORMERS", e)
    sys.exit(0)
request = json.load(sys.stdin)
"#;

/// `script` after [`TRANSFORMERS_PRELUDE`], given `request`: the lists of
/// integers of the JSON object it prints, by key; None (said) where no
/// Python here has `transformers` and it is not required.
fn transformers_lists(
    script: &str,
    request: &serde_json::Value,
) -> Option<HashMap<String, Vec<u64>>> {
    let script = format!("{TRANSFORMERS_PRELUDE}{script}");
    let answer = e2e::python_reference("TRANSFORMERS", &script, &[], &request.to_string())?;
    let want: HashMap<String, Vec<u64>> = serde_json::from_str(&answer).unwrap();
    Some(want)
}

/// Parquet rows (`tests/fixtures/parquet/`, written by pyarrow as Hugging
/// Face's `datasets` writes its files: `scripts/parquet_fixtures.py`)
/// prepare to the bytes of the JSONL file of the same records: text rows
/// beside an integer column, conversations (a list of structs) laid out by
/// the chat template, with and without `--assistant-only-loss` (the mask
/// files too), the same conversations compressed with zstd in row groups
/// of two, and prompt-completion rows (the loss kept to the completions).
/// A row without the field is exit 2 naming the file and the row; a file
/// named `.parquet` that is not one, exit 2 naming the file.
#[test]
fn parquet_rows_prepare_as_their_jsonl_records() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/parquet");
    let fixture = |name: &str| fixtures.join(name).display().to_string();
    let (tok, _) = chatml_tokenizer(d, &["system", "user", "assistant"]);
    let cases: [(&str, &str, &[&str]); 5] = [
        ("texts.parquet", "texts.jsonl", &[]),
        ("chats.parquet", "chats.jsonl", &[]),
        ("chats.parquet", "chats.jsonl", &["--assistant-only-loss"]),
        (
            "chats_zstd.parquet",
            "chats.jsonl",
            &["--assistant-only-loss"],
        ),
        ("pairs.parquet", "pairs.jsonl", &[]),
    ];
    for (n, (parquet, jsonl, extra)) in cases.into_iter().enumerate() {
        let args = [&["--val-fraction", "0.34"], extra].concat();
        let outputs = [parquet, jsonl].map(|input| {
            let out = d.join(format!("out-{n}-{input}"));
            let f = prepare(d, &[&fixture(input)], &tok, &out, &args);
            assert_eq!(f.code(), 0, "{input} {extra:?}: {f:?}");
            let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&out)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.file_name().unwrap() != "manifest.json")
                .map(|p| {
                    let name = p.file_name().unwrap().to_string_lossy().into_owned();
                    (name, std::fs::read(&p).unwrap())
                })
                .collect();
            files.sort();
            files
        });
        let names: Vec<&str> = outputs[0].iter().map(|(n, _)| n.as_str()).collect();
        assert!(
            names.contains(&"train.bin") && names.contains(&"val.bin"),
            "{parquet}: {names:?}"
        );
        if extra.contains(&"--assistant-only-loss") || parquet == "pairs.parquet" {
            assert!(
                names.iter().any(|n| n.contains("mask")),
                "{parquet}: {names:?}"
            );
        }
        assert!(
            outputs[0].iter().all(|(_, bytes)| !bytes.is_empty()),
            "{parquet}: an empty file"
        );
        assert_eq!(
            outputs[0], outputs[1],
            "{parquet} {extra:?} against {jsonl}"
        );
    }
    // Errors name the file and the row.
    let out = d.join("refused");
    let f = prepare(
        d,
        &[&fixture("texts.parquet")],
        &tok,
        &out,
        &["--field", "body"],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("texts.parquet: row 1: no string field `body`"),
        "{}",
        f.stderr
    );
    std::fs::write(d.join("fake.parquet"), "w1 w2\n").unwrap();
    let f = prepare(d, &["fake.parquet"], &tok, &out, &[]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("fake.parquet: "), "{}", f.stderr);
}
