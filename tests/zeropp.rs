//! ZeRO++ through `zrun` on the loopback 2-node hostfile (2 workers on
//! 127.0.0.2, 2 on 127.0.0.3: shared memory inside a node, TCP between): the
//! bytes that cross nodes against the paper's volume model, and the loss
//! curve of `configs/tiny.yaml` with each part against plain stage 3.

use std::path::Path;

use e2e::{losses, metrics, repo_root, TrainArgs};

/// The 2 x 2 loopback hostfile, written into `dir`.
fn two_nodes(dir: &Path) -> std::path::PathBuf {
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "127.0.0.2 slots=2\n127.0.0.3 slots=2\n").unwrap();
    hosts
}

/// The step lines of a metrics file.
fn steps(path: &Path) -> Vec<serde_json::Value> {
    metrics(path)
        .into_iter()
        .filter(|l| l.get("loss").is_some())
        .collect()
}

const QWZ: &str = "zero.zero_quantized_weights=true";
const HPZ: &str = "zero.zero_hpz_partition_size=2";
const QGZ: &str = "zero.zero_quantized_gradients=true";

/// The paper's volume model, per step and per rank, for the rank whose ring
/// neighbour is on the other node (it sends the most across): a ring
/// collective over a buffer of T bytes sends (W-1)/W·T, all of it across;
/// qgZ sends each other node one int4 partial of the rank's chunk, 0.5 Ψ/W
/// bytes. Stage 3 gathers the working type (b bytes) for forward, for the
/// tied head's embedding and for backward, which gathers neither the head
/// nor the embedding (whose gradient reads no weight): 2Ψ - head values.
/// It reduce-scatters f32 gradients (4Ψ), or under `train.reduce_dtype:
/// bf16` sends each other node one bf16 partial of its chunk (2Ψ/W).
/// ZeRO++ sends the forward gathers as int8 (1 byte) but the head's at b,
/// keeps backward gathers inside the node (hpZ), and the gradients as
/// above. Scales (4 bytes per 2048 values) and padding are what the 1%
/// allows for: measured within 0.25% (2026-12-07; the model counted a
/// third gather of the embedding until then, 1.6% above, under a 5%
/// bound).
#[test]
fn cross_node_bytes_follow_the_paper_model_within_1_percent() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = two_nodes(dir.path());
    // configs/tiny.yaml's model on synthetic data.
    let job = dir.path().join("vol.yaml");
    std::fs::write(
        &job,
        format!(
            "name: vol\nmodel: {{vocab_size: 256, d_model: 128, n_layers: 4, n_heads: 4, seq_len: 64}}\n\
             data: {{format: synthetic}}\ntrain: {{steps: 2, micro_batch_size: 8}}\n\
             zero: {{stage: 3, param_persistence_threshold: 0}}\nrun_dir: {}/runs\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let (w, n) = (4.0, 2.0);
    // What the head gathers: the final norm's weight and bias, d_model each.
    let head = 2.0 * 128.0;
    for (dtype, b) in [("bf16", 2.0), ("f32", 4.0)] {
        let run = |name: &str, parts: &[&str]| {
            let m = dir.path().join(format!("{dtype}-{name}.jsonl"));
            let mut args = TrainArgs::new(&job, &m)
                .args(&["--hostfile", hosts.to_str().unwrap()])
                .set(format!("train.dtype={dtype}"));
            for p in parts {
                args = args.set(*p);
            }
            let f = args.run(dir.path());
            assert_eq!(f.code(), 0, "{dtype} {name}: {f:?}");
            let last = steps(&m).pop().unwrap();
            let psi = last["params"].as_f64().unwrap();
            (last["comm_bytes"]["inter_node"].as_f64().unwrap(), psi)
        };
        let (plain, psi) = run("stage3", &[]);
        let (plus, _) = run("zeropp", &[QWZ, HPZ, QGZ]);
        let ring = (w - 1.0) / w;
        let want_plain = ring * (b * (2.0 * psi - head) + 4.0 * psi);
        let want_plus = ring * ((psi - head) + b * head) + (n - 1.0) * 0.5 * psi / w;
        eprintln!(
            "{dtype}: cross-node bytes per step and rank: stage 3 {plain} (model {want_plain:.0}), \
             ZeRO++ {plus} (model {want_plus:.0}): {:.2}x less",
            plain / plus
        );
        let mut checks = vec![("stage 3", plain, want_plain), ("ZeRO++", plus, want_plus)];
        // Gradients reduced in bf16 (`train.reduce_dtype`, the paper's
        // 16-bit gradients) take qgZ's two hops: each other node gets one
        // 2-byte partial of the rank's chunk.
        if dtype == "bf16" {
            let (half, _) = run("reduce-bf16", &["train.reduce_dtype=bf16"]);
            let want_half = ring * b * (2.0 * psi - head) + (n - 1.0) * 2.0 * psi / w;
            eprintln!(
                "bf16, gradients reduced in bf16: {half} (model {want_half:.0}): {:.2}x less than stage 3",
                plain / half
            );
            checks.push(("stage 3, bf16 reductions", half, want_half));
        }
        for (what, got, want) in checks {
            assert!(
                (got / want - 1.0).abs() < 0.01,
                "{dtype} {what}: {got} bytes across nodes, the model says {want:.0}"
            );
        }
    }
}

/// What users run: `configs/tiny.yaml` (its own Rust sources as data) for
/// 200 steps at stage 3 on two nodes, micro-batches of 4 so that the four
/// workers take the tokens a step that its two take by default (and CI half
/// the time: 8 ran 37 s a curve); each lossy part of ZeRO++ alone and all
/// three together end within 1.05x of plain stage 3's loss (the mean of the
/// last 10 steps; DeepSpeed's own test accepts 1.1x). (hpZ, which is not
/// lossy, gives stage 3's curve exactly: tests/zero.rs holds it to that
/// through zrun on the same two nodes, and CI's 30 minutes do not run the
/// same 200 steps twice.) Measured: qwZ 0.998x, qgZ 1.015x, all three
/// 1.013x; later qgZ 1.021x with no change to qgZ: the corpus is the
/// repository's sources, so the curves move with every commit, and a bound
/// of 1.02 failed on that drift alone. At micro-batches of 4 (2026-11-30):
/// qwZ 1.001x, qgZ 1.004x, all three 1.003x. qgZ with LoCo's error
/// feedback (DeepSpeed's spelling of the key) too.
#[test]
fn tiny_ends_200_steps_within_5_percent_of_stage_3_with_each_part() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = two_nodes(dir.path());
    let root = repo_root();
    let curve = |name: &str, parts: &[&str]| {
        let m = dir.path().join(format!("{name}.jsonl"));
        let mut args = TrainArgs::new(root.join("configs/tiny.yaml"), &m)
            .args(&["--hostfile", hosts.to_str().unwrap()])
            .set("zero.stage=3")
            .set("train.micro_batch_size=4")
            .set(format!("run_dir={}/runs", dir.path().display()));
        for p in parts {
            args = args.set(*p);
        }
        let f = args.run(&root);
        assert_eq!(f.code(), 0, "{name}: {f:?}");
        let l = losses(&metrics(&m));
        assert_eq!(l.len(), 200, "{name}");
        l
    };
    let tail = |l: &[f64]| l[190..].iter().sum::<f64>() / 10.0;
    let plain = tail(&curve("stage3", &[]));
    for (name, parts) in [
        ("qwZ", &[QWZ][..]),
        ("qgZ", &[QGZ]),
        (
            "qgZ+LoCo",
            &[QGZ, "zero.zeropp_loco_param={err_beta: 0.8, reset_T: 1024}"],
        ),
        ("qwZ+hpZ+qgZ", &[QWZ, HPZ, QGZ]),
    ] {
        let got = tail(&curve(name, parts));
        eprintln!(
            "{name}: 200-step loss {got:.4} vs stage 3 {plain:.4}: {:.4}x",
            got / plain
        );
        assert!(
            got / plain < 1.05 && plain / got < 1.05,
            "{name}: {got} vs stage 3's {plain}"
        );
    }
}
