//! LLaMA end to end, and Hugging Face interop both ways: a LLaMA trains at
//! stage 3 on two workers, `zrun export --format hf` writes a directory that
//! an independent LLaMA reader (Hugging Face's conventions, f64) loads and
//! gets zrun's next loss from, `model.init_from` takes that directory back,
//! and a GPT-2 export under Hugging Face's names round-trips too. Mismatched
//! weights are exit 2 naming the tensor.

mod llama_reference;
mod reference_common;

use std::path::{Path, PathBuf};

use e2e::{losses_by_step, zrun, TrainArgs};
use llama_reference::Llama;

/// A corpus of exactly one global batch (4 windows of 32 + 1 tokens), so
/// every step sees the same sequences and "the next loss" means the same
/// thing to every run.
fn one_batch(dir: &Path) -> Vec<u8> {
    let text: Vec<u8> = (0..4 * 32 + 1)
        .map(|i| b"the quick brown fox jumps over the lazy dog. "[i % 45])
        .collect();
    std::fs::write(dir.join("one-batch.txt"), &text).unwrap();
    text
}

/// The one batch's four windows of 32 + 1 tokens.
fn windows_of(text: &[u8]) -> Vec<Vec<u32>> {
    (0..4)
        .map(|w| {
            text[w * 32..=w * 32 + 32]
                .iter()
                .map(|&b| u32::from(b))
                .collect()
        })
        .collect()
}

fn job(dir: &Path, model: &str) -> PathBuf {
    let p = dir.join("job.yaml");
    std::fs::write(
        &p,
        format!(
            "name: interop\nmodel: {model}\n\
             data: {{path: {}/one-batch.txt, format: text}}\n\
             train: {{steps: 5, micro_batch_size: 2, lr: 3.0e-3, warmup_steps: 2}}\n\
             zero: {{stage: 3}}\n\
             checkpoint: {{dir: {}/ckpt, every: 4, keep: 2}}\n\
             run_dir: {}/run\n",
            dir.display(),
            dir.display(),
            dir.display()
        ),
    )
    .unwrap();
    p
}

fn train(dir: &Path, job: &Path, metrics: &str, extra: &[&str]) -> Vec<(u64, f64)> {
    let args = TrainArgs::new(job, dir.join(metrics)).args(extra);
    let f = args.run(dir);
    assert_eq!(f.code(), 0, "{args:?}: {f:?}");
    losses_by_step(&dir.join(metrics))
}

fn export_hf(dir: &Path, out: &str) -> PathBuf {
    let out = dir.join(out);
    e2e::export_hf(dir, &dir.join("ckpt/step-00000004"), &out);
    out
}

/// One step from `from` gives the loss `next` that the export's reader
/// computed, within 1e-5 relative.
fn starts_at(dir: &Path, job: &Path, from: &Path, metrics: &str, next: f64) {
    let init_loss = loss_from(dir, job, from, metrics, &[]);
    assert!(
        (init_loss - next).abs() <= 1e-5 * next,
        "export's next loss {next}, from init_from {} {init_loss}",
        from.display()
    );
}

/// A job whose `model:` names only `init_from` takes every architecture key
/// from the directory's `config.json` (and its context, 32, for the default
/// `seq_len` of 128 it cannot take): `zrun check` resolves the model the job
/// written out in full resolves, lists the keys taken, and the run starts
/// at the export's next loss. A key the job writes stays the job's (and is
/// held to the file); a `config.json` zrun cannot run is exit 2 at
/// `model.init_from`, before launch.
fn takes_its_model_from_the_directory(dir: &Path, job: &Path, hf: &Path, next: f64) {
    let full = std::fs::read_to_string(job).unwrap();
    let model_line = full.lines().find(|l| l.starts_with("model:")).unwrap();
    let bare_of = |from: &Path, more: &str| {
        let bare = dir.join("bare.yaml");
        let model = format!("model: {{init_from: {}{more}}}", from.display());
        std::fs::write(&bare, full.replace(model_line, &model)).unwrap();
        bare
    };
    let bare = bare_of(hf, "");
    let resolved_model = |job: &Path, sets: &[&str]| {
        let f = zrun(dir, &[&["check", job.to_str().unwrap()][..], sets].concat());
        assert_eq!(f.code(), 0, "{f:?}");
        let spec: String = f
            .stdout
            .lines()
            .skip(1)
            .take_while(|l| !l.starts_with('#'))
            .collect();
        let spec: serde_json::Value = serde_json::from_str(&spec).unwrap();
        (spec["model"].clone(), f.stdout)
    };
    let init = format!("model.init_from={}", hf.display());
    let (want, _) = resolved_model(job, &["--set", &init]);
    let (got, said) = resolved_model(&bare, &[]);
    assert_eq!(got, want, "{said}");
    let config = hf.join("config.json");
    assert!(
        said.contains(&format!(
            "# from {}: model.kind, model.vocab_size, model.d_model",
            config.display()
        )) && said.contains("model.norm_eps, model.seq_len\n"),
        "{said}"
    );
    starts_at(dir, &bare, hf, "bare.jsonl", next);
    // The job's own key stays, and is held to the directory.
    let (wider, _) = resolved_model(&bare, &["--set", "model.seq_len=24"]);
    assert_eq!(wider["seq_len"], 24);
    let deeper = bare_of(hf, ", n_layers: 3");
    let f = zrun(dir, &["check", deeper.to_str().unwrap()]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("num_hidden_layers is 2, the job's model has 3 (model.n_layers)"),
        "{}",
        f.stderr
    );
    let bad = dir.join("hf-unrunnable");
    std::fs::create_dir_all(&bad).unwrap();
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    c["hidden_act"] = "gelu".into();
    std::fs::write(bad.join("config.json"), c.to_string()).unwrap();
    let f = TrainArgs::new(bare_of(&bad, ""), dir.join("never.jsonl")).run(dir);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("bare.yaml:2:9: model.init_from: ")
            && f.stderr
                .contains("config.json: hidden_act is \"gelu\": zrun's model has \"silu\""),
        "{}",
        f.stderr
    );
    assert!(!dir.join("never.jsonl").exists());
}

/// `zrun eval` of the export on held-out text (bytes, not the training
/// sentence): the independent reader's mean loss over the same windows of
/// 32 (+1) tokens, within 1e-5 relative: disjoint (the default stride, 32)
/// and at strides 20 and 1, where each window scores only the targets the
/// one before left (every target once); the checkpoint it came from gives
/// the same (its f32 weights, read as zrun's). A stride past the context,
/// a file of one token, `--max-tokens 1`, a `.bin` nothing describes and an
/// id outside the vocabulary: exit 2, before any forward.
fn evaluates_as_the_reader(dir: &Path, hf: &Path) {
    let text: Vec<u8> = (0..150)
        .map(|i| b"pack my box with five dozen liquor jugs; "[i % 41])
        .collect();
    std::fs::write(dir.join("held-out.txt"), &text).unwrap();
    let ids: Vec<u32> = text.iter().map(|&b| u32::from(b)).collect();
    let reader = Llama::load(hf);
    let eval = |model: &Path, more: &[&str]| {
        let data = dir.join("held-out.txt").display().to_string();
        let f = zrun(
            dir,
            &[&["eval", model.to_str().unwrap(), "--data", &data], more].concat(),
        );
        assert_eq!(f.code(), 0, "{more:?}: {f:?}");
        let said: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
        (
            said["loss"].as_f64().unwrap(),
            said["tokens"].as_u64().unwrap(),
        )
    };
    for stride in [32, 20, 1] {
        // Windows of up to 33 tokens every `stride`, each skipping the
        // targets an earlier one scored.
        let (mut windows, mut begin, mut done) = (Vec::new(), 0, 0);
        loop {
            let end = (begin + 33).min(ids.len());
            windows.push((ids[begin..end].to_vec(), done - begin.min(done)));
            done = end - 1;
            if end == ids.len() {
                break;
            }
            begin += stride;
        }
        let want = reader.loss_skipping(&windows);
        let (loss, tokens) = eval(hf, &["--stride", &stride.to_string()]);
        assert_eq!(tokens, ids.len() as u64 - 1, "stride {stride}");
        assert!(
            (loss - want).abs() <= 1e-5 * want,
            "stride {stride}: zrun eval {loss}, the reader {want}"
        );
    }
    let (hf_loss, _) = eval(hf, &[]);
    let (ckpt_loss, _) = eval(&dir.join("ckpt/step-00000004"), &[]);
    assert!(
        (hf_loss - ckpt_loss).abs() <= 1e-6 * hf_loss,
        "{hf_loss} {ckpt_loss}"
    );
    // Each word alone (`--separate-documents`, ended by its space): the
    // reader's mean over the words, each scored as a text of its own.
    let words: Vec<Vec<u32>> = ids
        .split_inclusive(|&id| id == u32::from(b' '))
        .filter(|w| w.len() >= 2)
        .map(<[u32]>::to_vec)
        .collect();
    let want = reader.loss(&words);
    let scored: usize = words.iter().map(|w| w.len() - 1).sum();
    let (loss, tokens) = eval(hf, &["--separate-documents", "--eos", "32"]);
    assert_eq!(tokens, scored as u64);
    assert!(
        (loss - want).abs() <= 1e-5 * want,
        "each word alone: zrun eval {loss}, the reader {want}"
    );
    std::fs::write(dir.join("ids.bin"), [1u8, 0, 44, 1]).unwrap();
    std::fs::write(dir.join("one.txt"), "a").unwrap();
    for (args, says) in [
        (
            vec!["--stride", "33"],
            "--stride 33: must be in 1..=32".to_string(),
        ),
        (
            vec!["--data", "one.txt"],
            "one.txt: 1 tokens: nothing to score".into(),
        ),
        (
            vec!["--max-tokens", "1"],
            "--max-tokens 1: nothing to score".into(),
        ),
        (
            vec!["--data", "ids.bin"],
            "no manifest.json beside it says how its ids are stored".into(),
        ),
        (
            vec!["--data", "ids.bin", "--format", "tokens_u16"],
            "id 300 at token offset 1 is not below the model's vocab_size 256".into(),
        ),
        (
            vec!["--eos", "32"],
            "--eos: is read only with --separate-documents".into(),
        ),
        (
            vec!["--separate-documents"],
            "no manifest beside held-out.txt gives the end-of-text id: give --eos ID".into(),
        ),
        (
            vec!["--separate-documents", "--eos", "256"],
            "--eos 256: not below the model's vocab_size 256".into(),
        ),
    ] {
        let mut all = vec!["eval", hf.to_str().unwrap()];
        if !args.contains(&"--data") {
            all.extend(["--data", "held-out.txt"]);
        }
        all.extend(args.iter());
        let f = zrun(dir, &all);
        assert_eq!(f.code(), 2, "{args:?}: {f:?}");
        assert!(f.stderr.contains(&says), "{args:?}: {}", f.stderr);
    }
}

/// `zrun export --format hf` of a run that started from a Hugging Face
/// directory: the directory's tokenizer, chat template and generation
/// settings go beside the weights, byte for byte, so that the export is
/// taken as that model was (`zrun sample` of it through its own
/// tokenizer); `--tokenizer-from none` leaves them out, a directory that is
/// not there is exit 2, and so is a tokenizer of more tokens than the
/// model's 256.
fn exports_with_its_tokenizer(dir: &Path, job: &Path, hf: &Path) {
    let words = |n: usize| -> serde_json::Value {
        let mut vocab = serde_json::Map::new();
        vocab.insert("[UNK]".into(), 0.into());
        for i in 1..n {
            vocab.insert(format!("w{i}"), i.into());
        }
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        })
    };
    let files = [
        ("tokenizer.json", words(40).to_string()),
        (
            "chat_template.jinja",
            "{% for m in messages %}{{ m.content }}{% endfor %}".into(),
        ),
        ("generation_config.json", r#"{"eos_token_id": 7}"#.into()),
    ];
    for (name, text) in &files {
        std::fs::write(hf.join(name), text).unwrap();
    }
    let ckpt = dir.join("tuned-ckpt");
    train(
        dir,
        job,
        "tuned.jsonl",
        &[
            "--workers-per-node",
            "1",
            "--set",
            &format!("model.init_from={}", hf.display()),
            "--set",
            "train.steps=1",
            "--set",
            &format!("checkpoint.dir={}", ckpt.display()),
        ],
    );
    let export = |out: &str, more: &[&str]| {
        let args = [
            &[
                "export",
                ckpt.to_str().unwrap(),
                "--format",
                "hf",
                "--out",
                out,
            ][..],
            more,
        ]
        .concat();
        zrun(dir, &args)
    };
    let f = export("tuned-hf", &[]);
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(
        f.stdout.contains(&format!(
            "with tokenizer.json, chat_template.jinja, generation_config.json from {}",
            hf.display()
        )),
        "{}",
        f.stdout
    );
    let tuned = dir.join("tuned-hf");
    for (name, text) in &files {
        assert_eq!(
            &std::fs::read_to_string(tuned.join(name)).unwrap(),
            text,
            "{name}"
        );
    }
    let s = zrun(
        dir,
        &[
            "sample",
            tuned.to_str().unwrap(),
            "--prompt",
            "w3 w4",
            "--tokens",
            "3",
        ],
    );
    assert_eq!(s.code(), 0, "{s:?}");
    let f = export("bare-hf", &["--tokenizer-from", "none"]);
    assert_eq!(f.code(), 0, "{f:?}");
    let mut names: Vec<String> = std::fs::read_dir(dir.join("bare-hf"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["config.json", "model.safetensors"]);
    std::fs::write(hf.join("tokenizer.json"), words(300).to_string()).unwrap();
    for (more, says) in [
        (
            vec!["--tokenizer-from", "nowhere"],
            "--tokenizer-from nowhere: not a directory",
        ),
        (vec![], "300 tokens, more than the model's vocab_size 256"),
    ] {
        let f = export("refused-hf", &more);
        assert_eq!(f.code(), 2, "{more:?}: {f:?}");
        assert!(f.stderr.contains(says), "{more:?}: {}", f.stderr);
    }
    for (name, _) in &files {
        std::fs::remove_file(hf.join(name)).unwrap();
    }
}

/// Training from `init` with `set` exits 2, its message holding `needles`.
fn refused_from(dir: &Path, job: &Path, init: &Path, set: &str, needles: &[&str]) {
    let f = TrainArgs::new(job, dir.join("refused.jsonl"))
        .set(format!("model.init_from={}", init.display()))
        .set(set)
        .run(dir);
    assert_eq!(f.code(), 2, "{set}: {f:?}");
    for needle in needles {
        assert!(f.stderr.contains(needle), "{set}: {}", f.stderr);
    }
}

/// Trains one step from `init` on the same batch: its loss.
fn loss_from(dir: &Path, job: &Path, init: &Path, metrics: &str, extra: &[&str]) -> f64 {
    let one_step = e2e::one_step_from(init);
    let mut args = vec![
        "--workers-per-node",
        "1",
        "--set",
        "train.micro_batch_size=4",
    ];
    args.extend(one_step.iter().map(String::as_str));
    args.extend(extra);
    let losses = train(dir, job, metrics, &args);
    losses[0].1
}

/// With each word a document (`data.separate_documents`, ended by the
/// space), the first loss from the export is the reader's mean over the
/// words of the one batch each scored alone from position 0, the target
/// after each space left out: LLaMA's attention kept to the word.
fn trains_words_apart_as_the_reader(dir: &Path, job: &Path, hf: &Path) {
    let text = std::fs::read(dir.join("one-batch.txt")).unwrap();
    let windows = windows_of(&text);
    let want = Llama::load(hf).loss_of_documents(&windows, u32::from(b' '));
    let apart = [
        "--set",
        "data.separate_documents=true",
        "--set",
        "data.eos_id=32",
    ];
    let got = loss_from(dir, job, hf, "words.jsonl", &apart);
    assert!(
        (got - want).abs() <= 1e-5 * want,
        "words kept apart: zrun's loss {got}, the reader's {want}"
    );
    // Packed whole (`data.packing: bfd`): twelve words of 11, 10, 8 and 7
    // tokens (their spaces included) go into four sequences of 33, three
    // of them padded; the one step of four sequences scores every word
    // alone, so its loss is the reader's mean over the words.
    let words: Vec<Vec<u8>> = [11, 11, 11, 10, 10, 10, 8, 8, 8, 7, 7, 7]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let mut w: Vec<u8> = (0..len - 1)
                .map(|j| b"etaoinshrdlu"[(i + 3 * j) % 12])
                .collect();
            w.push(b' ');
            w
        })
        .collect();
    std::fs::write(dir.join("words.txt"), words.concat()).unwrap();
    let windows: Vec<Vec<u32>> = words
        .iter()
        .map(|w| w.iter().map(|&b| u32::from(b)).collect())
        .collect();
    let want = Llama::load(hf).loss(&windows);
    let path = format!("data.path={}", dir.join("words.txt").display());
    let packed = [&apart[..], &["--set", &path, "--set", "data.packing=bfd"]].concat();
    let got = loss_from(dir, job, hf, "packed.jsonl", &packed);
    assert!(
        (got - want).abs() <= 1e-5 * want,
        "words packed whole: zrun's loss {got}, the reader's {want}"
    );
    // Split where too long (`data.packing: bfd_split`): a word of 45
    // tokens becomes pieces of 33 and 12, each scored alone from position
    // 0; with words of 11, 11, 10, 10, 10, 8, 8 and 7 the pieces fill four
    // sequences, and the step's loss is the reader's mean over the pieces
    // and words.
    let words: Vec<Vec<u8>> = [45, 11, 11, 10, 10, 10, 8, 8, 7]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let mut w: Vec<u8> = (0..len - 1)
                .map(|j| b"etaoinshrdlu"[(i + 5 * j) % 12])
                .collect();
            w.push(b' ');
            w
        })
        .collect();
    std::fs::write(dir.join("long-words.txt"), words.concat()).unwrap();
    let windows: Vec<Vec<u32>> = words
        .iter()
        .flat_map(|w| w.chunks(33))
        .map(|piece| piece.iter().map(|&b| u32::from(b)).collect())
        .collect();
    assert_eq!(windows.len(), words.len() + 1, "one word split in two");
    let want = Llama::load(hf).loss(&windows);
    let path = format!("data.path={}", dir.join("long-words.txt").display());
    let split = [
        &apart[..],
        &["--set", &path, "--set", "data.packing=bfd_split"],
    ]
    .concat();
    let got = loss_from(dir, job, hf, "split.jsonl", &split);
    assert!(
        (got - want).abs() <= 1e-5 * want,
        "words split where too long: zrun's loss {got}, the reader's {want}"
    );
}

/// Trains `model` 5 steps on one batch, exports its step-4 checkpoint for
/// Hugging Face, and holds the export to an independent reader of Hugging
/// Face LLaMA directories: it computes zrun's step-5 loss (measured within
/// 8e-9 relative of zrun's f32 loss; the bound is 2e-6). Returns the job,
/// the export and that loss.
fn exported_as_the_reader_computes(dir: &Path, model: &str) -> (PathBuf, PathBuf, f64) {
    let text = one_batch(dir);
    let job = job(dir, model);
    let src = train(dir, &job, "src.jsonl", &[]);
    assert!(src[4].1 < src[0].1, "did not learn: {src:?}");
    let out = export_hf(dir, "hf-llama");
    let windows = windows_of(&text);
    let independent = Llama::load(&out).loss(&windows);
    let next = src[4].1;
    assert!(
        (independent - next).abs() <= 2e-6 * next,
        "zrun's step-5 loss {next}; a LLaMA reader of the export computes {independent}"
    );
    sharp_attention_evaluates_as_the_reader(dir, &out);
    (job, out, next)
}

/// A copy of the Hugging Face directory `hf` as `name` with q, k and v
/// multiplied by `factors` (their projections' weights and biases, Qwen3's
/// norms of each head's q and k, the rows of Phi-3's fused projection).
fn rescaled(dir: &Path, hf: &Path, name: &str, factors: [f32; 3]) -> PathBuf {
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    let config = std::fs::read(hf.join("config.json")).unwrap();
    std::fs::write(out.join("config.json"), &config).unwrap();
    let config: serde_json::Value = serde_json::from_slice(&config).unwrap();
    let n = |k: &str| config[k].as_u64().unwrap() as usize;
    let hd = config["head_dim"]
        .as_u64()
        .map_or(n("hidden_size") / n("num_attention_heads"), |h| h as usize);
    // Phi-3's [(h + 2·kv)·hd, d] projection: q's rows, k's, v's.
    let (q, kv) = (n("num_attention_heads") * hd, n("num_key_value_heads") * hd);
    let [fq, fk, fv] = factors;
    e2e::rescaled_safetensors(
        &hf.join("model.safetensors"),
        &out.join("model.safetensors"),
        |name, shape, i| match (
            name.rsplit('.').nth(1),
            i / shape[1..].iter().product::<usize>(),
        ) {
            (Some("q_proj" | "q_norm"), _) => fq,
            (Some("k_proj" | "k_norm"), _) => fk,
            (Some("v_proj"), _) => fv,
            (Some("qkv_proj"), row) if row < q => fq,
            (Some("qkv_proj"), row) if row < q + kv => fk,
            (Some("qkv_proj"), _) => fv,
            _ => 1.0,
        },
    );
    out
}

/// `zrun eval` of the export with sharp attention (q and k times 16, the
/// scores 256 times larger, but Qwen3's, and v times 8) on the training text's four
/// windows: the reader's loss within 1e-6 (they agree to about 1e-9). A
/// model trained five steps attends almost uniformly, so that its loss
/// barely feels the attention's scale, rotation or frequencies (the
/// reader's score scale off by 1% moved the step-5 loss by less than its
/// bound of 2e-6); the reader shows that here the same 1% moves the loss by
/// more than ten times the bound (about 2e-5: larger factors make the
/// attention one-hot, where its scale matters less again).
fn sharp_attention_evaluates_as_the_reader(dir: &Path, hf: &Path) {
    // Qwen3's q and k are normalised per head: its scores are sharp as
    // they are (times 16, one-hot: the 1% moved its loss by 4e-6).
    let config = std::fs::read_to_string(hf.join("config.json")).unwrap();
    let qk = if config.contains("\"qwen3\"") {
        1.0
    } else {
        16.0
    };
    let sharp = rescaled(dir, hf, "hf-sharp", [qk, qk, 8.0]);
    let off = rescaled(dir, hf, "hf-sharp-off", [qk * 1.01, qk, 8.0]);
    let windows = windows_of(&std::fs::read(dir.join("one-batch.txt")).unwrap());
    let want = Llama::load(&sharp).loss(&windows);
    let moved = (Llama::load(&off).loss(&windows) - want).abs();
    let data = dir.join("one-batch.txt");
    let f = zrun(
        dir,
        &[
            "eval",
            sharp.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let said: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
    let loss = said["loss"].as_f64().unwrap();
    assert!(
        (loss - want).abs() <= 1e-6 * want && moved > 1e-5 * want,
        "sharp attention: zrun eval {loss}, the reader {want}, {moved} from scores 1% larger"
    );
}

/// Llama 3.1's rotary scaling (`model.rope_scaling`, Hugging Face's
/// `rope_scaling`) trains, exports, and an independent reader of the export
/// with its own formula for the scaled frequencies computes zrun's next
/// loss; the directory starts a run at that loss, and a job whose scaling
/// differs from the directory's is refused naming both. (Head width 8, base
/// 100, original context 32: of the four frequencies one is kept, one
/// blended and two divided.)
#[test]
fn a_llama3_scaled_rotary_embedding_trains_exports_and_reads_back() {
    scaled_rotary_round_trips(
        "{rope_type: llama3, factor: 4, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 32}",
        "llama3",
    );
}

/// YaRN's rotary scaling (Qwen2.5's and Qwen3's long contexts) the same
/// way, the reader with its own formula for the frequencies and the
/// attention factor on the turned q and k. (Head width 8, base 100, factor
/// 4, original context 32, betas 4 and 1: the ramp from pair 0 to pair 2,
/// so pair 0 kept, 1 half divided, 2 and 3 divided; attention factor
/// 0.1·ln 4 + 1.)
#[test]
fn a_yarn_scaled_rotary_embedding_trains_exports_and_reads_back() {
    scaled_rotary_round_trips(
        "{rope_type: yarn, factor: 4, original_max_position_embeddings: 32, beta_fast: 4, beta_slow: 1}",
        "yarn",
    );
}

/// Dynamic NTK scaling the same way: unscaled within the model's context
/// (transformers rescales only past it), carried through the export and
/// its `init_from`.
#[test]
fn a_dynamic_scaled_rotary_embedding_trains_exports_and_reads_back() {
    scaled_rotary_round_trips("{rope_type: dynamic, factor: 2}", "dynamic");
}

/// LongRoPE's (Phi-3.5's, Phi-4-mini's long contexts) the same way, past
/// its original context of 16 (sequences of 32: the long factors, each
/// pair's own) and within it (an original of 32: the short ones), the
/// reader dividing each pair's frequency by its factor and multiplying
/// the turned q and k by `sqrt(1 + ln 4 / ln original)`.
/// A generation that grows past the original context turns every kept
/// key again with the long factors, as transformers' Phi-3 does: each
/// token `zrun sample` draws greedily from the export is the reader's most
/// likely one, the reader computing each step's sequence afresh.
#[test]
fn a_longrope_scaled_rotary_embedding_trains_exports_and_reads_back() {
    for old in [16, 32] {
        let (d, out) = scaled_rotary_round_trips(
            &format!("{{rope_type: longrope, factor: 4, original_max_position_embeddings: {old}, short_factor: [1, 1.5, 2, 3], long_factor: [1, 2, 5, 9]}}"),
            "longrope",
        );
        let f = zrun(
            d.path(),
            &[
                "sample",
                out.to_str().unwrap(),
                "--prompt",
                "the quick",
                "--tokens",
                "20",
                "--temperature",
                "0",
            ],
        );
        assert_eq!(f.code(), 0, "{f:?}");
        let tokens: Vec<u32> = f
            .stdout
            .trim_end_matches('\n')
            .bytes()
            .map(u32::from)
            .collect();
        let reader = Llama::load(&out);
        let prompt = "the quick".len();
        assert!(tokens.len() > 17, "the sample crosses 16 tokens: {f:?}");
        for at in prompt..tokens.len() {
            let logits = reader.next_logits(&tokens[..at]);
            let best = logits.iter().cloned().fold(f64::MIN, f64::max);
            assert!(
                logits[tokens[at] as usize] >= best - 1e-4,
                "original {old}: token {at} is {}, of logit {} to the reader's best {best}",
                tokens[at],
                logits[tokens[at] as usize]
            );
        }
    }
}

/// Phi-4-mini's partial rotation (`model.partial_rotary_factor: 0.5`: the
/// first 4 columns of each head of 8 turn, as pairs 2 apart, the other 4
/// pass) trains and exports as Hugging Face's Phi-3 (`Phi3ForCausalLM`,
/// q, k and v in one `qkv_proj`, gate and up in one `gate_up_proj`), from
/// which the reader, with its own split of the fused tensors and its own
/// partial rotation, computes zrun's next loss; alone and under LongRoPE
/// (a factor for each of the 2 turned pairs, past an original context of
/// 16, written beside the scaling as Phi-3 reads it); the directory starts
/// a run at that loss, and a job that turns the whole head is refused
/// naming both.
#[test]
fn a_partial_rotation_trains_and_exports_as_phi3() {
    for scaling in [
        "",
        ", rope_scaling: {rope_type: longrope, factor: 4, original_max_position_embeddings: 16, short_factor: [1, 2], long_factor: [1, 6]}",
    ] {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        let (job, out, next) = exported_as_the_reader_computes(
            dir,
            &format!(
                "{{kind: llama, partial_rotary_factor: 0.5, vocab_size: 256, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_hidden: 48, seq_len: 32, rope_theta: 100{scaling}}}"
            ),
        );
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(
            (&config["model_type"], &config["partial_rotary_factor"]),
            (&serde_json::json!("phi3"), &serde_json::json!(0.5)),
            "{config}"
        );
        starts_at(dir, &job, &out, "init.jsonl", next);
        if !scaling.is_empty() {
            assert_eq!(config["original_max_position_embeddings"], 16, "{config}");
            continue;
        }
        refused_from(
            dir,
            &job,
            &out,
            "model.partial_rotary_factor=null",
            &["partial_rotary_factor is 0.5, the job's model has 1 (model.partial_rotary_factor)"],
        );
    }
}

/// A LLaMA (heads of 8, base 100) with `rope_scaling` (YAML) trains,
/// exports as the reader computes, starts a run at the export's loss, and
/// a job without the scaling is refused naming the directory's `kind`.
/// Returns the directory it ran in and the export.
fn scaled_rotary_round_trips(rope_scaling: &str, kind: &str) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let (job, out, next) = exported_as_the_reader_computes(
        dir,
        &format!(
            "{{kind: llama, vocab_size: 256, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_hidden: 48, seq_len: 32, rope_theta: 100, \
             rope_scaling: {rope_scaling}}}"
        ),
    );
    starts_at(dir, &job, &out, "init.jsonl", next);
    refused_from(
        dir,
        &job,
        &out,
        "model.rope_scaling=null",
        &[
            &format!("its rotary scaling is {{\"rope_type\":\"{kind}\""),
            "the job's model.rope_scaling none",
        ],
    );
    (d, out)
}

/// Qwen2 (`model.qkv_bias: true`: LLaMA with biases on q, k and v) trains
/// at stage 3 on two workers and exports as a Hugging Face `qwen2`
/// directory, from which an independent reader, adding the biases before
/// the rotation, computes zrun's next loss; the directory starts a run at
/// that loss and samples; a job without the biases is refused naming the
/// directory's model type.
#[test]
fn qwen2_trains_exports_and_reads_back() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let (job, out, _) = a_variant_round_trips(
        dir,
        "{kind: llama, qkv_bias: true, vocab_size: 256, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_hidden: 48, seq_len: 32, rope_theta: 100}",
        "Qwen2ForCausalLM",
    );
    refused_from(
        dir,
        &job,
        &out,
        "model.qkv_bias=false",
        &["model_type is \"qwen2\", the job's model has \"llama\""],
    );
}

/// A sliding window (`model.sliding_window: 8` over sequences of 32, each
/// token attending to itself and the 7 before it) trains at stage 3 on two
/// workers and exports as a Hugging Face `mistral` directory with that
/// window, from which the independent reader, masking each row's keys
/// itself, computes zrun's next loss; the directory starts a run at that
/// loss and samples as its checkpoint; a job with another window is
/// refused naming both.
#[test]
fn a_sliding_window_trains_and_exports_as_mistral() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let (job, out, config) = a_variant_round_trips(
        dir,
        "{kind: llama, sliding_window: 8, vocab_size: 256, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_hidden: 48, seq_len: 32, rope_theta: 100}",
        "MistralForCausalLM",
    );
    assert_eq!(
        (&config["model_type"], &config["sliding_window"]),
        (&serde_json::json!("mistral"), &serde_json::json!(8)),
        "{config}"
    );
    refused_from(
        dir,
        &job,
        &out,
        "model.sliding_window=16",
        &["its sliding window is 8, the job's model.sliding_window 16"],
    );
}

/// Qwen3 (`model.qk_norm: true`, heads of `model.head_dim` 12 over d_model
/// 32: q and the output projection's input 48 wide) trains at stage 3 on
/// two workers and exports as a Hugging Face `qwen3` directory, from which
/// the independent reader, normalising each head of q and k before the
/// rotation, computes zrun's next loss; the directory starts a run at that
/// loss and samples as its checkpoint; a job without the norms, or with
/// narrower heads, is refused naming the directory's key.
#[test]
fn qwen3_trains_exports_and_reads_back() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let (job, out, config) = a_variant_round_trips(
        dir,
        "{kind: llama, qk_norm: true, head_dim: 12, vocab_size: 256, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_hidden: 48, seq_len: 32, rope_theta: 100}",
        "Qwen3ForCausalLM",
    );
    assert_eq!(config["head_dim"], 12, "{config}");
    refused_from(
        dir,
        &job,
        &out,
        "model.qk_norm=false",
        &["model_type is \"qwen3\", the job's model has \"llama\""],
    );
    refused_from(
        dir,
        &job,
        &out,
        "model.head_dim=8",
        &["head_dim is 12, the job's model has 8 (model.head_dim)"],
    );
}

/// A LLaMA variant `model` through [`exported_as_the_reader_computes`]:
/// its export's `config.json` names `architecture`, the export starts a
/// run at the reader's next loss, and samples as the checkpoint it came
/// from (step 4; the root's newest is step 5, which gave Qwen2 the same 12
/// tokens by chance, and Qwen3 not). Returns the job, the export and its
/// `config.json`.
fn a_variant_round_trips(
    dir: &Path,
    model: &str,
    architecture: &str,
) -> (PathBuf, PathBuf, serde_json::Value) {
    let (job, out, next) = exported_as_the_reader_computes(dir, model);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], architecture, "{config}");
    starts_at(dir, &job, &out, "init.jsonl", next);
    assert_eq!(
        greedy(dir, &out),
        greedy(dir, &dir.join("ckpt/step-00000004"))
    );
    (job, out, config)
}

/// `zrun sample` of 12 greedy tokens after "the quick" from `from` (a
/// checkpoint or a Hugging Face directory): what it printed.
fn greedy(dir: &Path, from: &Path) -> String {
    let args = [
        "--prompt",
        "the quick",
        "--tokens",
        "12",
        "--temperature",
        "0",
    ];
    let f = zrun(
        dir,
        &[&["sample", from.to_str().unwrap()][..], &args].concat(),
    );
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(
        f.stdout.starts_with("the quick") && f.stdout.len() > 12,
        "{f:?}"
    );
    f.stdout
}

#[test]
fn llama_export_is_hugging_face_llama_and_feeds_init_from() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let (job, out, next) = exported_as_the_reader_computes(
        dir,
        "{kind: llama, vocab_size: 256, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_hidden: 48, seq_len: 32}",
    );
    // The directory starts a run with the next loss, and so does its
    // weights file alone (a published single-file LLaMA: its untied head,
    // `lm_head.weight` under both naming schemes, once had it taken for a
    // zrun file, which then lacked every other tensor).
    let weights = out.join("model.safetensors");
    for (from, metrics) in [(&out, "init.jsonl"), (&weights, "init-file.jsonl")] {
        starts_at(dir, &job, from, metrics, next);
    }
    takes_its_model_from_the_directory(dir, &job, &out, next);
    trains_words_apart_as_the_reader(dir, &job, &out);
    evaluates_as_the_reader(dir, &out);
    exports_with_its_tokenizer(dir, &job, &out);
    // `zrun sample` on the directory draws what it draws from the
    // checkpoint, to the byte; a config.json it cannot run is exit 2.
    let ckpt = dir.join("ckpt/step-00000004");
    let args = [
        "--prompt",
        "the quick",
        "--tokens",
        "30",
        "--temperature",
        "0",
    ];
    let sample = |from: &Path| {
        zrun(
            dir,
            &[&["sample", from.to_str().unwrap()][..], &args].concat(),
        )
    };
    let (want, got) = (sample(&ckpt), sample(&out));
    assert_eq!(want.code(), 0, "{want:?}");
    assert_eq!((got.code(), got.stdout), (0, want.stdout), "{}", got.stderr);
    let config = std::fs::read_to_string(out.join("config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&config).unwrap();
    let null = serde_json::Value::Null;
    for (edits, says) in [
        (
            vec![("hidden_act", serde_json::json!("gelu"))],
            "hidden_act is \"gelu\": zrun's model has \"silu\"",
        ),
        (
            vec![(
                "rope_scaling",
                serde_json::json!({"type": "longrope", "factor": 2.0}),
            )],
            "rope_scaling is {\"factor\":2.0,\"type\":\"longrope\"}: missing field `short_factor`",
        ),
        (
            // Wider heads than the weights have.
            vec![("head_dim", serde_json::json!(16))],
            "model.layers.0.self_attn.q_proj.weight has shape [32, 32], the model's layers.0.self_attn.qkv_proj.weight needs [64, 32]",
        ),
        (
            vec![
                ("num_attention_heads", serde_json::json!(32)),
                ("head_dim", null.clone()),
            ],
            "the head width 1 is odd",
        ),
    ] {
        let mut edited = config.clone();
        let key = edits[0].0;
        for (k, v) in edits {
            edited[k] = v;
        }
        let bad = dir.join("hf-bad");
        std::fs::create_dir_all(&bad).unwrap();
        std::fs::copy(out.join("model.safetensors"), bad.join("model.safetensors")).unwrap();
        std::fs::write(bad.join("config.json"), edited.to_string()).unwrap();
        let f = sample(&bad);
        assert_eq!(f.code(), 2, "{key}: {f:?}");
        assert!(f.stderr.contains(says), "{key}: {}", f.stderr);
    }
    // A model of another architecture is refused before launch: the
    // directory by its config.json, naming both keys; its weights file
    // alone by the first tensor of another shape, or one that belongs to
    // nothing (the directory by its config.json's untied head).
    for (from, set, what) in [
        (
            &out,
            "model.n_kv_heads=4",
            "config.json: num_key_value_heads is 2, the job's model has 4 (model.n_kv_heads)",
        ),
        (
            &weights,
            "model.n_kv_heads=4",
            "model.layers.0.self_attn.k_proj.weight has shape [16, 32], the model's layers.0.self_attn.qkv_proj.weight needs [32, 32]",
        ),
        (
            &weights,
            "model.tie_embeddings=true",
            "lm_head.weight belongs to no parameter",
        ),
        (
            &out,
            "model.tie_embeddings=true",
            "tie_word_embeddings is false, the job's model has true (model.tie_embeddings)",
        ),
    ] {
        let init = format!("model.init_from={}", from.display());
        let f = TrainArgs::new(&job, dir.join("bad.jsonl"))
            .set(&init)
            .set(set)
            .run(dir);
        assert_eq!(f.code(), 2, "{set}: {f:?}");
        assert!(f.stderr.contains(what), "{}", f.stderr);
        // `zrun check` says the same.
        let job = job.to_str().unwrap();
        let f = zrun(dir, &["check", job, "--set", &init, "--set", set]);
        assert_eq!(f.code(), 2, "check {set}: {f:?}");
        assert!(f.stderr.contains(what), "check: {}", f.stderr);
    }
    // The weights file alone is read as the job's model says, even where
    // the config.json beside it disagrees on what no shape shows: a
    // warning names the key.
    let init = format!("model.init_from={}", weights.display());
    let job = job.to_str().unwrap();
    let f = zrun(
        dir,
        &["check", job, "--set", &init, "--set", "model.rope_theta=20"],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(
        f.stderr.contains("warning: model.init_from")
            && f.stderr
                .contains("config.json: rope_theta is 10000.0, the job's model has 20.0"),
        "{}",
        f.stderr
    );
    let f = zrun(dir, &["check", job, "--set", &init]);
    assert!(
        !f.stderr.contains("warning: model.init_from"),
        "{}",
        f.stderr
    );
}

#[test]
fn gpt2_round_trips_through_hugging_face_names() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    one_batch(dir);
    let job = job(
        dir,
        "{vocab_size: 256, d_model: 32, n_layers: 2, n_heads: 4, seq_len: 32}",
    );
    let src = train(dir, &job, "src.jsonl", &[]);
    let out = export_hf(dir, "hf-gpt2");
    // A file where the directory should go is refused, and left as it was.
    std::fs::write(dir.join("taken"), b"mine").unwrap();
    let ckpt = dir.join("ckpt");
    let taken = dir.join("taken");
    let f = zrun(
        dir,
        &[
            "export",
            ckpt.to_str().unwrap(),
            "--format",
            "hf",
            "--out",
            taken.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("--format hf writes a directory"),
        "{}",
        f.stderr
    );
    assert_eq!(std::fs::read(&taken).unwrap(), b"mine");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(config["n_embd"], 32);
    let names = safetensors::SafeTensors::deserialize(
        &std::fs::read(out.join("model.safetensors")).unwrap(),
    )
    .unwrap()
    .names()
    .iter()
    .map(|n| n.to_string())
    .collect::<Vec<_>>();
    assert!(
        names.contains(&"transformer.h.1.attn.c_attn.weight".to_string()),
        "{names:?}"
    );
    starts_at(dir, &job, &out, "init.jsonl", src[4].1);
}
