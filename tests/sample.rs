//! `zrun sample` end to end: a byte-level model trained on a periodic text
//! continues the pattern, a seed repeats its draws, and bad arguments are
//! exit 2 before anything runs.

use std::path::{Path, PathBuf};

use e2e::{assert_gone, zrun, zrun_into_head, TrainArgs};

/// Trains a small byte-level GPT on "0123456789" repeated, with a checkpoint
/// at the end; returns the checkpoint root.
fn trained(dir: &Path) -> PathBuf {
    let data = dir.join("digits.txt");
    std::fs::write(&data, "0123456789".repeat(3000)).unwrap();
    let job = dir.join("digits.yaml");
    std::fs::write(
        &job,
        format!(
            "name: digits\n\
             model: {{vocab_size: 256, d_model: 64, n_layers: 2, n_heads: 4, seq_len: 32}}\n\
             data: {{path: {}, format: text}}\n\
             train: {{steps: 150, micro_batch_size: 8, lr: 3.0e-3, warmup_steps: 10}}\n\
             checkpoint: {{dir: {}/ckpt, every: 150}}\n\
             run_dir: {}/runs\n",
            data.display(),
            dir.display(),
            dir.display()
        ),
    )
    .unwrap();
    let f = TrainArgs::new(&job, dir.join("m.jsonl")).run(dir);
    assert_eq!(f.code(), 0, "{f:?}");
    dir.join("ckpt")
}

/// 40 tokens, greedy.
const GREEDY: [&str; 4] = ["--tokens", "40", "--temperature", "0"];
/// 40 tokens drawn among the top 3 at temperature 1.5, seeded.
const DRAWN: [&str; 8] = [
    "--tokens",
    "40",
    "--top-k",
    "3",
    "--temperature",
    "1.5",
    "--seed",
    "9",
];

fn sample(dir: &Path, ckpt: &Path, more: &[&str]) -> e2e::Finished {
    let mut args = vec!["sample", ckpt.to_str().unwrap()];
    args.extend_from_slice(more);
    zrun(dir, &args)
}

#[test]
fn a_trained_model_continues_its_pattern_and_a_seed_repeats_its_text() {
    let d = tempfile::tempdir().unwrap();
    let ckpt = trained(d.path());
    let f = sample(
        d.path(),
        &ckpt,
        &["--prompt", "34567", "--tokens", "25", "--temperature", "0"],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    assert_eq!(f.stdout, "345678901234567890123456789012\n");
    // Past seq_len (32) the context slides: each token then runs the last
    // 32 afresh (the kept keys and values sit at old positions).
    let f = sample(
        d.path(),
        &ckpt,
        &["--prompt", "34567", "--tokens", "60", "--temperature", "0"],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let cycle: String = "0123456789".repeat(8);
    assert_eq!(f.stdout, format!("{}\n", &cycle[3..3 + 65]));
    let drawn = |seed: &str| {
        let f = sample(
            d.path(),
            &ckpt,
            &[
                "--prompt",
                "0",
                "--tokens",
                "40",
                "--temperature",
                "1.5",
                "--top-k",
                "3",
                "--seed",
                seed,
            ],
        );
        assert_eq!(f.code(), 0, "{f:?}");
        f.stdout
    };
    // The three likeliest bytes after training are digits, so the text is
    // ASCII and every drawn byte shows.
    let a = drawn("5");
    assert_eq!(a.len(), 1 + 40 + 1, "{a:?}");
    assert_eq!(a, drawn("5"), "the same seed drew other text");
}

/// `zrun sample … | head -c 20`: the drawing stops when the reader has
/// what it wants, quietly (exit 0, nothing on stderr: it ended with
/// "zworker: Broken pipe" and exit 1 before the seventieth session).
#[test]
fn a_closed_stdout_stops_the_drawing_quietly() {
    let d = tempfile::tempdir().unwrap();
    let ckpt = trained(d.path());
    let args = [
        "sample",
        ckpt.to_str().unwrap(),
        "--prompt",
        "0",
        "--tokens",
        "100000000",
    ];
    let (head, code, stderr, children) = zrun_into_head(d.path(), &args, 20);
    assert!(head.starts_with('0'), "{head:?}");
    assert_eq!((code, stderr.as_str()), (0, ""));
    assert_gone(
        &children,
        std::time::Duration::from_secs(10),
        "after the pipe closed",
    );
}

#[test]
fn bad_sampling_arguments_are_exit_2() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("nothing-here");
    let f = sample(d.path(), &missing, &["--prompt", "a"]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("nothing-here"), "{}", f.stderr);
    let ckpt = trained(d.path());
    for (args, says) in [
        (vec!["--prompt", "a", "--temperature=-1"], "--temperature"),
        (vec!["--prompt", ""], "--prompt"),
        (
            vec!["--prompt", "a", "--top-p", "0"],
            "--top-p must be in (0, 1]",
        ),
        (vec!["--prompt", "a", "--top-p", "1.5"], "--top-p"),
        (vec!["--prompt", "a", "--top-p", "NaN"], "--top-p"),
        (
            vec!["--prompt", "a", "--stop-string", "5"],
            "--stop-string: stop strings need a tokenizer",
        ),
    ] {
        let f = sample(d.path(), &ckpt, &args);
        assert_eq!(f.code(), 2, "{args:?}: {f:?}");
        assert!(f.stderr.contains(says), "{}", f.stderr);
    }
}

/// A Hugging Face directory samples as the checkpoint it was exported from:
/// `zrun export --format hf`, then `zrun sample` on the directory draws the
/// checkpoint's text, greedy and seeded, to the byte (the weights map back
/// to the same values). A config.json zrun cannot run is exit 2 naming its
/// key: another model type, another activation, a head width rotary
/// embeddings cannot turn.
#[test]
fn a_hugging_face_directory_samples_as_its_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    let ckpt = trained(d.path());
    let hf = d.path().join("hf");
    e2e::export_hf(d.path(), &ckpt, &hf);
    for args in [
        [&["--prompt", "34567"][..], &GREEDY].concat(),
        [&["--prompt", "0"][..], &DRAWN].concat(),
    ] {
        let args = &args[..];
        let (want, got) = (sample(d.path(), &ckpt, args), sample(d.path(), &hf, args));
        assert_eq!(want.code(), 0, "{want:?}");
        assert_eq!(got.code(), 0, "{got:?}");
        assert_eq!(got.stdout, want.stdout, "{args:?}");
    }
    // Its generation_config.json decides the sampling when no flag does,
    // as it decides `generate`'s: greedy unless `do_sample: true`, then its
    // temperature, top-k and min-p, its repetition penalty either way; a
    // flag overrides it; a bad value is exit 2 naming the file.
    let generation = |json: serde_json::Value| {
        std::fs::write(hf.join("generation_config.json"), json.to_string()).unwrap()
    };
    let prompt = ["--prompt", "34567", "--tokens", "40"];
    let from_ckpt = |more: &[&str]| {
        let f = sample(d.path(), &ckpt, &[&prompt[..], more].concat());
        assert_eq!(f.code(), 0, "{f:?}");
        f.stdout
    };
    let from_hf = |more: &[&str]| sample(d.path(), &hf, &[&prompt[..], more].concat());
    generation(serde_json::json!({"eos_token_id": 300}));
    let f = from_hf(&[]);
    assert_eq!(
        (f.code(), &f.stdout),
        (0, &from_ckpt(&["--temperature", "0"]))
    );
    assert!(
        f.stderr.contains("asks generate to: greedy"),
        "{}",
        f.stderr
    );
    generation(serde_json::json!({"do_sample": true, "temperature": 1.5, "top_k": 3}));
    let f = from_hf(&["--seed", "9"]);
    let drawn = from_ckpt(&["--top-k", "3", "--temperature", "1.5", "--seed", "9"]);
    assert_eq!((f.code(), &f.stdout), (0, &drawn));
    assert!(
        f.stderr.contains("temperature 1.5, top-k 3, top-p 1"),
        "{}",
        f.stderr
    );
    assert_ne!(
        drawn,
        from_ckpt(&["--temperature", "0"]),
        "the draw was greedy"
    );
    let f = from_hf(&["--temperature", "0"]);
    assert_eq!(
        (f.code(), &f.stdout),
        (0, &from_ckpt(&["--temperature", "0"]))
    );
    // Its min_p (1: the likeliest token alone, so the draw is greedy) and
    // its repetition_penalty (the flag's text, greedy and drawn; drawn, not
    // the unpenalised text), said on stderr; what zrun does not do (beams,
    // n-gram bans) warned of.
    generation(
        serde_json::json!({"do_sample": true, "temperature": 1.5, "top_k": 3, "min_p": 1.0}),
    );
    let f = from_hf(&["--seed", "9"]);
    assert_eq!(
        (f.code(), &f.stdout),
        (0, &from_ckpt(&["--temperature", "0"]))
    );
    assert!(f.stderr.contains("top-p 1, min-p 1 "), "{}", f.stderr);
    let penalised = ["--repetition-penalty", "1.3"];
    for (json, flags) in [
        (
            serde_json::json!({"repetition_penalty": 1.3}),
            vec!["--temperature", "0"],
        ),
        (
            serde_json::json!({"do_sample": true, "temperature": 1.5, "top_k": 3, "repetition_penalty": 1.3}),
            vec!["--temperature", "1.5", "--top-k", "3", "--seed", "9"],
        ),
    ] {
        generation(json);
        let f = from_hf(&["--seed", "9"]);
        assert_eq!(
            (f.code(), &f.stdout),
            (0, &from_ckpt(&[&flags[..], &penalised].concat()))
        );
        assert!(
            f.stderr.contains(", repetition penalty 1.3 ("),
            "{}",
            f.stderr
        );
    }
    assert_ne!(
        from_ckpt(&[
            "--repetition-penalty",
            "1.3",
            "--temperature",
            "1.5",
            "--top-k",
            "3",
            "--seed",
            "9"
        ]),
        drawn
    );
    generation(
        serde_json::json!({"num_beams": 4, "no_repeat_ngram_size": 3, "typical_p": 0.9, "min_length": 0}),
    );
    let f = from_hf(&[]);
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(
        f.stderr.contains("also asks generate for num_beams: 4, no_repeat_ngram_size: 3, which zrun sample does not do"),
        "{}",
        f.stderr
    );
    let f = from_hf(&["--min-p", "2"]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("--min-p must be in [0, 1]"),
        "{}",
        f.stderr
    );
    for (json, says) in [
        (
            serde_json::json!({"do_sample": true, "top_p": 2.0}),
            "generation_config.json: top_p must be in (0, 1]",
        ),
        (
            serde_json::json!({"repetition_penalty": 0.0}),
            "generation_config.json: repetition_penalty must be a number > 0",
        ),
        (
            serde_json::json!({"do_sample": true, "temperature": "hot"}),
            "generation_config.json: not a generation config",
        ),
    ] {
        generation(json);
        let f = from_hf(&[]);
        assert_eq!(f.code(), 2, "{f:?}");
        assert!(f.stderr.contains(says), "{}", f.stderr);
    }
    std::fs::remove_file(hf.join("generation_config.json")).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    for (key, value, says) in [
        (
            "model_type",
            serde_json::json!("bert"),
            "model_type is \"bert\": zrun runs gpt2, llama, qwen2, qwen3, mistral and phi3",
        ),
        (
            "activation_function",
            serde_json::json!("relu"),
            "activation_function is \"relu\"",
        ),
        (
            "n_head",
            serde_json::json!(3),
            "3 heads (3 key/value) do not divide the width 64",
        ),
        (
            "n_embd",
            serde_json::json!(-1),
            "n_embd is -1, not a positive whole number",
        ),
    ] {
        let mut edited = config.clone();
        edited[key] = value;
        std::fs::write(hf.join("config.json"), edited.to_string()).unwrap();
        let f = sample(d.path(), &hf, &["--prompt", "1"]);
        assert_eq!(f.code(), 2, "{key}: {f:?}");
        assert!(
            f.stderr.contains("config.json") && f.stderr.contains(says),
            "{key}: {}",
            f.stderr
        );
    }
}

/// `hf`'s weights rounded to bf16 (nearest even), as a Hugging Face
/// directory at `out`: stored in bf16 (`bf16`), or those values in f32.
fn rounded_copy(hf: &Path, out: &Path, bf16: bool) {
    std::fs::create_dir_all(out).unwrap();
    for entry in std::fs::read_dir(hf).unwrap() {
        let from = entry.unwrap().path();
        if from.file_name().unwrap() != "model.safetensors" {
            std::fs::copy(&from, out.join(from.file_name().unwrap())).unwrap();
        }
    }
    let bytes = std::fs::read(hf.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in file.tensors() {
        assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
        let bits: Vec<u16> = view
            .data()
            .chunks_exact(4)
            .map(|b| zgemm::bf16_bits(f32::from_le_bytes(b.try_into().unwrap())))
            .collect();
        let data: Vec<u8> = match bf16 {
            true => bits.iter().flat_map(|b| b.to_le_bytes()).collect(),
            false => bits
                .iter()
                .flat_map(|&b| zgemm::bf16_value(b).to_le_bytes())
                .collect(),
        };
        tensors.push((name, view.shape().to_vec(), data));
    }
    let dtype = match bf16 {
        true => safetensors::Dtype::BF16,
        false => safetensors::Dtype::F32,
    };
    let views = tensors.iter().map(|(name, shape, data)| {
        let view = safetensors::tensor::TensorView::new(dtype, shape.clone(), data).unwrap();
        (name.clone(), view)
    });
    safetensors::serialize_to_file(views, None, &out.join("model.safetensors")).unwrap();
}

/// Weights published in bf16 (as most are) stay bf16 in `zrun sample`,
/// half the memory and bytes a token of f32, and each product widens them
/// exactly as it reads them: the text is that of the same values stored in
/// f32, to the byte, greedy and drawn, from a prompt past the rows a
/// product streams (`zgemm::ROWS_STREAMED`) and from a short one.
#[test]
fn bf16_weights_sample_as_their_values_in_f32() {
    let d = tempfile::tempdir().unwrap();
    let ckpt = trained(d.path());
    let hf = d.path().join("hf");
    e2e::export_hf(d.path(), &ckpt, &hf);
    let (hf16, hf32) = (d.path().join("hf16"), d.path().join("hf32"));
    rounded_copy(&hf, &hf16, true);
    rounded_copy(&hf, &hf32, false);
    let long = "0123456789012".to_string();
    assert!(long.len() > zgemm::ROWS_STREAMED);
    for args in [
        [&["--prompt", &long][..], &GREEDY].concat(),
        [&["--prompt", "3"][..], &DRAWN].concat(),
    ] {
        let args = &args[..];
        let (want, got) = (sample(d.path(), &hf32, args), sample(d.path(), &hf16, args));
        assert_eq!(want.code(), 0, "{want:?}");
        assert_eq!(got.code(), 0, "{got:?}");
        assert_eq!(got.stdout, want.stdout, "{args:?}");
        assert!(
            got.stderr.contains("weight matrices kept in bf16")
                && !want.stderr.contains("kept in bf16"),
            "{}",
            got.stderr
        );
        assert!(want.stdout.len() > 40, "{want:?}");
    }
    // The rounded model still continues its pattern.
    let f = sample(
        d.path(),
        &hf16,
        &["--prompt", "34567", "--tokens", "10", "--temperature", "0"],
    );
    assert_eq!(f.stdout.trim(), "345678901234567", "{f:?}");
}

/// Chat templates of this test's own writing, with what the published
/// ones use: a namespace set in a reversed loop, Python's string methods,
/// `is string`, `{% generation %}` (transformers' own tag), `|trim`,
/// slicing, `strftime_now`, `tojson` with an indent and a dict's key order,
/// `.items()`, loop variables, `raise_exception`, whitespace control.
const CHAT_TEMPLATES: [(&str, &str); 3] = [
    (
        "chatml.jinja",
        "{%- set ns = namespace(last_user=-1) %}
{%- for m in messages[::-1] %}
    {%- if ns.last_user < 0 and m.role == 'user' and not m.content.startswith('<tool>') %}
        {%- set ns.last_user = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- if m.content is string %}{% set text = m.content %}{% else %}{% set text = '' %}{% endif %}
    {%- if m.role == 'system' and not loop.first %}{{ raise_exception('the system message comes first') }}{% endif %}
<|im_start|>{{ m.role }}
{{ text.strip() }}{% if loop.index0 == ns.last_user %} (asked){% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% generation %}
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{% endif %}
{%- endgeneration %}
{%- endif %}",
    ),
    (
        "dated.jinja",
        "{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}{% set date_string = strftime_now('%b %Y') %}{% else %}{% set date_string = 'never' %}{% endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nDate: ' + date_string + '\\n' }}
{%- if schema is defined %}
    {{- schema | tojson(indent=4) + '\\n' }}
    {%- for k, v in schema.items() %}{{ k }}={{ v | tojson }};{% endfor %}
{%- endif %}
{{- system + '<|eot_id|>' }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}
    {% if schema is defined %}
    [schema]
    {% endif %}
",
    ),
    (
        "alternating.jinja",
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}",
    ),
];

/// `--chat`: each template above, with and without a system message and
/// with template variables (JSON, an object's keys in their order), lays
/// the prompt out as `transformers`' own `apply_chat_template` renderer
/// does (`render_jinja_template`, run here when `ZRUN_TRANSFORMERS_PYTHON`
/// or `python3` has `transformers`; CI installs it and sets
/// `ZRUN_REQUIRE_TRANSFORMERS=1`), to the byte, the model's continuation
/// after it; what it refuses, zrun refuses (exit 2, the template's words
/// and its file). The model continues that text exactly as it continues
/// the same text given as a plain `--prompt`, and a Hugging Face
/// directory's own `chat_template.jinja` and `tokenizer_config.json` are
/// the ones taken without `--chat-template`.
#[test]
fn chat_prompts_are_laid_out_as_transformers_lays_them_out() {
    let d = tempfile::tempdir().unwrap();
    let ckpt = trained(d.path());
    let hf = d.path().join("hf");
    e2e::export_hf(d.path(), &ckpt, &hf);
    std::fs::write(
        hf.join("tokenizer_config.json"),
        r#"{"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": false}, "pad_token": null}"#,
    )
    .unwrap();
    for (name, text) in CHAT_TEMPLATES {
        std::fs::write(d.path().join(name), text).unwrap();
    }
    // (system, prompt, template variables: each a name and its JSON as
    // written, an object's keys in the order given).
    type Case<'a> = (Option<&'a str>, &'a str, &'a [(&'a str, &'a str)]);
    let cases: [Case; 4] = [
        (None, "Hi there", &[]),
        (
            Some("  Be brief.  "),
            "What is 2+2?",
            &[("enable_thinking", "false")],
        ),
        (
            Some("sys"),
            "ünïcode ✓ \"q\"\n  ",
            &[(
                "schema",
                r#"{"zeta": [1, 2.5, null, "a\"b"], "alpha": {"k": true}}"#,
            )],
        ),
        (
            None,
            "34567",
            &[
                ("date_string", r#""01 Jan 2025""#),
                ("enable_thinking", "true"),
            ],
        ),
    ];
    let asks: Vec<(&str, &str, Case)> = CHAT_TEMPLATES
        .iter()
        .flat_map(|&(name, template)| cases.iter().map(move |&case| (name, template, case)))
        .collect();
    // The request as text, each variable's JSON as written (serde_json
    // would sort an object's keys, and tojson shows their order).
    let request = asks
        .iter()
        .map(|(_, template, (system, prompt, extra))| {
            let mut messages = Vec::new();
            if let Some(s) = system {
                messages.push(serde_json::json!({"role": "system", "content": s}));
            }
            messages.push(serde_json::json!({"role": "user", "content": prompt}));
            let extra: Vec<String> = extra.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
            format!(
                r#"{{"template": {}, "messages": {}, "extra": {{{}}}}}"#,
                serde_json::to_string(template).unwrap(),
                serde_json::Value::from(messages),
                extra.join(", ")
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let request = format!("[{request}]");
    let want = transformers_renders(&request);
    let mut refused = 0;
    for ((name, _, (system, prompt, extra)), want) in asks.iter().zip(want.iter().flatten()) {
        let template = d.path().join(name).display().to_string();
        let mut args = vec![
            "--chat-template",
            &template,
            "--prompt",
            prompt,
            "--tokens",
            "3",
            "--temperature",
            "0",
        ];
        if let Some(s) = system {
            args.extend(["--system", s]);
        }
        let vars: Vec<String> = extra.iter().map(|(k, v)| format!("{k}={v}")).collect();
        for v in &vars {
            args.extend(["--chat-arg", v]);
        }
        let f = sample(d.path(), &hf, &args);
        match (want.get("text"), want.get("error")) {
            (Some(text), _) => {
                let text = text.as_str().unwrap();
                assert_eq!(f.code(), 0, "{name} {prompt:?}: {f:?}");
                assert!(
                    f.stdout.starts_with(text) && f.stdout.len() > text.len(),
                    "{name} {prompt:?}:\n transformers {text:?}\n zrun         {:?}",
                    f.stdout
                );
            }
            (None, Some(error)) => {
                refused += 1;
                assert_eq!(
                    f.code(),
                    2,
                    "{name} {prompt:?}: transformers refused ({error}): {f:?}"
                );
                let error = error.as_str().unwrap();
                assert!(
                    f.stderr
                        .contains(&format!("{name}: line 1: the template refuses: {error}")),
                    "{name}: {}",
                    f.stderr
                );
            }
            _ => panic!("{want}"),
        }
    }
    // The alternating template refuses a system message (two of the cases).
    if want.is_some() {
        assert_eq!(refused, 2);
    }

    // The directory's own template and special tokens, without
    // --chat-template; the model continues the laid-out text as it
    // continues that text given plainly.
    std::fs::copy(
        d.path().join("chatml.jinja"),
        hf.join("chat_template.jinja"),
    )
    .unwrap();
    let greedy = ["--tokens", "40", "--temperature", "0"];
    let chat = sample(
        d.path(),
        &hf,
        &[&["--chat", "--prompt", "34567"][..], &greedy].concat(),
    );
    assert_eq!(chat.code(), 0, "{chat:?}");
    let laid_out = "<|im_start|>user\n34567 (asked)<|im_end|>\n<|im_start|>assistant\n";
    assert!(chat.stdout.starts_with(laid_out), "{:?}", chat.stdout);
    let plain = sample(
        d.path(),
        &hf,
        &[&["--prompt", laid_out][..], &greedy].concat(),
    );
    assert_eq!((plain.code(), &plain.stdout), (0, &chat.stdout));
    // Without a template anywhere: exit 2 saying where it looked.
    std::fs::remove_file(hf.join("chat_template.jinja")).unwrap();
    let f = sample(d.path(), &hf, &["--chat", "--prompt", "1"]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("has no chat template"), "{}", f.stderr);
}

/// `--conversation FILE`: the turns so far (a list, or a `{"messages"}`
/// record, each message's keys all passed on) laid out between `--system`
/// and the prompt, as transformers lays the same messages out (its own
/// renderer; CI requires it); a system message in the file beside
/// `--system`, a message without a role, or a file that is not JSON: exit
/// 2 naming the file. Tools and tool calls too: see [`tools`].
#[test]
fn a_conversation_so_far_is_laid_out_before_the_prompt() {
    let d = tempfile::tempdir().unwrap();
    let ckpt = trained(d.path());
    let hf = d.path().join("hf");
    e2e::export_hf(d.path(), &ckpt, &hf);
    let (name, template) = CHAT_TEMPLATES[0];
    std::fs::write(d.path().join(name), template).unwrap();
    let template_file = d.path().join(name).display().to_string();
    let earlier = serde_json::json!([
        {"role": "user", "content": "12"},
        {"role": "assistant", "content": "3456", "reasoning_content": "count"},
        {"role": "user", "content": "78"},
        {"role": "assistant", "content": "9"},
    ]);
    std::fs::write(d.path().join("list.json"), earlier.to_string()).unwrap();
    let record = serde_json::json!({ "messages": earlier }).to_string();
    std::fs::write(d.path().join("record.json"), record).unwrap();
    let mut messages = vec![serde_json::json!({"role": "system", "content": "sys"})];
    messages.extend(earlier.as_array().unwrap().iter().cloned());
    messages.push(serde_json::json!({"role": "user", "content": "0123"}));
    let request = serde_json::json!([{"template": template, "messages": messages, "extra": {}}]);
    let want = transformers_renders(&request.to_string());
    let run = |file: &str, system: Option<&str>| {
        let file = d.path().join(file).display().to_string();
        let mut args = vec![
            "--chat-template",
            &template_file,
            "--conversation",
            &file,
            "--prompt",
            "0123",
            "--tokens",
            "3",
            "--temperature",
            "0",
        ];
        args.extend(system.iter().flat_map(|s| ["--system", s]));
        sample(d.path(), &hf, &args)
    };
    for file in ["list.json", "record.json"] {
        let f = run(file, Some("sys"));
        assert_eq!(f.code(), 0, "{f:?}");
        assert!(
            f.stdout.contains("<|im_start|>assistant\n9<|im_end|>"),
            "{}",
            f.stdout
        );
        if let Some(want) = &want {
            let text = want[0]["text"].as_str().expect("transformers lays it out");
            assert!(
                f.stdout.starts_with(text) && f.stdout.len() > text.len(),
                "{file}:\n transformers {text:?}\n zrun         {:?}",
                f.stdout
            );
        }
    }
    let with_system =
        serde_json::json!([{"role": "system", "content": "s"}, {"role": "user", "content": "1"}]);
    std::fs::write(d.path().join("system.json"), with_system.to_string()).unwrap();
    std::fs::write(d.path().join("norole.json"), r#"[{"content": "1"}]"#).unwrap();
    std::fs::write(d.path().join("broken.json"), "[{").unwrap();
    for (file, says) in [
        (
            "system.json",
            "begins with a system message, and --system gives another",
        ),
        ("norole.json", "message 1: no string `role`"),
        ("broken.json", "not JSON"),
    ] {
        let f = run(file, Some("sys"));
        assert_eq!(f.code(), 2, "{file}: {f:?}");
        assert!(
            f.stderr
                .contains(&format!("--conversation {}", d.path().join(file).display()))
                && f.stderr.contains(says),
            "{file}: {}",
            f.stderr
        );
    }
    // Without --system, the file's own system message is the one.
    let f = run("system.json", None);
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(
        f.stdout.starts_with("<|im_start|>system\ns<|im_end|>"),
        "{}",
        f.stdout
    );
    tools(d.path(), &hf);
}

/// `--tools FILE` (a list of tools' JSON schemas), or a `--conversation`
/// record's own `tools` (a JSON text of the list, as TRL's datasets store
/// it) and `chat_template_kwargs`, which `--chat-arg` overrides: laid out
/// with earlier tool calls, a tool's answer and reasoning under
/// `reasoning` as transformers lays the same out (`tools=...`, its
/// renderer; CI requires it), the schema's keys in their order. `--tools`
/// beside a record's own, a schema that is not an object, or a file that
/// is not a list: exit 2 naming it. (Run by the test above, which has the
/// model.)
fn tools(d: &Path, hf: &Path) {
    let template = d.join("tools.jinja");
    std::fs::write(&template, e2e::TOOLS_TEMPLATE).unwrap();
    let tools = format!("[{}]", e2e::WEATHER_TOOL);
    std::fs::write(d.join("tools.json"), &tools).unwrap();
    let calls = r#"[{"role": "user", "content": "12"},
        {"role": "assistant", "content": "", "reasoning": "look it up", "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"days": 2, "city": "Oslo"}}}]},
        {"role": "tool", "name": "weather", "content": "34"}]"#;
    std::fs::write(d.join("calls.json"), calls).unwrap();
    let record = |tools: &str| {
        format!(
            r#"{{"messages": {calls}, "tools": {tools}, "chat_template_kwargs": {{"enable_thinking": false}}}}"#
        )
    };
    let tools_text = serde_json::to_string(&tools).unwrap();
    std::fs::write(d.join("record.json"), record(&tools_text)).unwrap();
    std::fs::write(d.join("bad_record.json"), record("[1]")).unwrap();
    std::fs::write(d.join("bad_tools.json"), e2e::WEATHER_TOOL).unwrap();
    let case = |enable_thinking: Option<bool>| {
        let mut extra = format!(r#""tools": {tools}"#);
        if let Some(on) = enable_thinking {
            extra += &format!(
                r#", "enable_thinking": {}"#,
                if on { "true" } else { "false" }
            );
        }
        let messages = format!(
            r#"{}, {{"role": "user", "content": "56"}}]"#,
            calls.trim_end_matches(']')
        );
        format!(
            r#"{{"template": {}, "messages": {messages}, "extra": {{{extra}}}}}"#,
            serde_json::to_string(e2e::TOOLS_TEMPLATE).unwrap()
        )
    };
    let request = format!(
        "[{}, {}, {}]",
        case(None),
        case(Some(false)),
        case(Some(true))
    );
    let want = transformers_renders(&request);
    let run = |args: &[&str]| {
        let mut all = vec![
            "--chat-template",
            template.to_str().unwrap(),
            "--prompt",
            "56",
            "--tokens",
            "3",
            "--temperature",
            "0",
        ];
        all.extend_from_slice(args);
        sample(d, hf, &all)
    };
    let file = |name: &str| d.join(name).display().to_string();
    let (calls_file, tools_file, record_file) =
        (file("calls.json"), file("tools.json"), file("record.json"));
    let asks: [&[&str]; 3] = [
        &["--conversation", &calls_file, "--tools", &tools_file],
        &["--conversation", &record_file],
        &[
            "--conversation",
            &record_file,
            "--chat-arg",
            "enable_thinking=true",
        ],
    ];
    for (i, args) in asks.iter().enumerate() {
        let f = run(args);
        assert_eq!(f.code(), 0, "{args:?}: {f:?}");
        for shown in [
            "\"description\": \"Today's weather, ü\", \"parameters\": {\"type\": \"object\", \"required\"",
            "<think>look it up</think>\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"days\": 2, \"city\": \"Oslo\"}}",
            "<tool_response>\n34\n</tool_response>",
        ] {
            assert!(f.stdout.contains(shown), "{args:?}: {shown:?} in {:?}", f.stdout);
        }
        let thinking_off = f
            .stdout
            .contains("<|im_start|>assistant\n<think>\n\n</think>");
        assert_eq!(thinking_off, i == 1, "{args:?}: {:?}", f.stdout);
        if let Some(want) = &want {
            let text = want[i]["text"].as_str().expect("transformers lays it out");
            assert!(
                f.stdout.starts_with(text) && f.stdout.len() > text.len(),
                "{args:?}:\n transformers {text:?}\n zrun         {:?}",
                f.stdout
            );
        }
    }
    let (bad_record, bad_tools) = (file("bad_record.json"), file("bad_tools.json"));
    for (args, says) in [
        (
            vec!["--conversation", &record_file, "--tools", &tools_file],
            format!("--tools {tools_file}: the --conversation record gives its own `tools`"),
        ),
        (
            vec!["--conversation", &bad_record],
            format!("--conversation {bad_record}: `tools` item 1: not an object"),
        ),
        (
            vec!["--tools", &bad_tools],
            format!("--tools {bad_tools}: `tools` must be a list"),
        ),
    ] {
        let f = run(&args);
        assert_eq!(f.code(), 2, "{args:?}: {f:?}");
        assert!(f.stderr.contains(&says), "{args:?}: {}", f.stderr);
    }
}

/// `transformers`' chat template renderer on each case of `request` (a
/// JSON list of `{template, messages, extra}`): `{"text"}` or `{"error"}`
/// each; None (said) where no Python here has `transformers` and
/// `ZRUN_REQUIRE_TRANSFORMERS` is not 1.
fn transformers_renders(request: &str) -> Option<Vec<serde_json::Value>> {
    let renderer = r#"
import json, sys
try:
    import jinja2  # transformers renders with it, and does not install it
    from transformers.utils.chat_template_utils import render_jinja_template
except ImportError as e:
    print("NO_TRANSFORMERS", e)
    sys.exit(0)
out = []
for case in json.load(sys.stdin):
    try:
        text = render_jinja_template([case["messages"]], chat_template=case["template"],
            add_generation_prompt=True, bos_token="<s>", eos_token="</s>", **case["extra"])[0][0]
        out.append({"text": text})
    except Exception as e:
        out.append({"error": str(e)})
print(json.dumps(out))
"#;
    let out = e2e::python_reference("TRANSFORMERS", renderer, &[], request)?;
    Some(serde_json::from_str(&out).unwrap())
}
