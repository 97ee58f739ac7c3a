//! ZeRO's arithmetic on real runs of the built binaries: model-state memory
//! and bytes sent per rank against the paper's formulas, mixed precision
//! against f32, and `zrun estimate` against the paper's Table 1.

use e2e::{losses, metrics, repo_root, small_job, zrun, TrainArgs};

/// Real runs at 4 workers: model-state memory and bytes sent per rank follow the
/// ZeRO paper's formulas, within padding: in f32 (4 bytes of params, 4 of grads,
/// 8 of moments) and in bf16 (K = 12: 2 + 2 + 12 with the f32 master copy).
#[test]
fn zero_memory_and_volume_follow_the_paper_at_4_workers() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "formulas", 3);
    let n = 4.0;
    // The small job's model: vocab 64, d 32, 2 layers, seq 32.
    let (d, l) = (32.0, 2.0);
    let groups = l + 2.0;
    for dtype in ["f32", "bf16"] {
        for stage in 0..=3 {
            let m = dir.path().join(format!("{dtype}-s{stage}.jsonl"));
            let f = zrun(
                dir.path(),
                &[
                    "train",
                    job.to_str().unwrap(),
                    "--workers-per-node",
                    "4",
                    "--set",
                    &format!("zero.stage={stage}"),
                    "--set",
                    &format!("train.dtype={dtype}"),
                    "--set",
                    "zero.param_persistence_threshold=0",
                    "--metrics",
                    m.to_str().unwrap(),
                ],
            );
            assert_eq!(f.code(), 0, "{f:?}");
            let lines = metrics(&m);
            let s = &lines[1];
            let psi = s["params"].as_f64().unwrap();
            // Each block's buffer is padded to a multiple of 4 ranks × 16 elements.
            let psi_pad = psi + groups * n * 16.0;
            let mem = &s["mem_bytes"];
            let states: f64 = ["params", "grads", "master", "optimizer"]
                .iter()
                .map(|k| mem[*k].as_f64().unwrap())
                .sum();
            let formula = |p: f64| match (dtype, stage) {
                (_, 0) => 16.0 * p,
                ("f32", 1) => 8.0 * p + 8.0 * p / n,
                ("f32", 2) => 4.0 * p + 12.0 * p / n,
                (_, 1) => 4.0 * p + 12.0 * p / n,
                (_, 2) => 2.0 * p + 14.0 * p / n,
                _ => 16.0 * p / n,
            };
            assert!(
                formula(psi) <= states && states <= formula(psi_pad),
                "{dtype} stage {stage}: model states {states} bytes, formula {} .. {}",
                formula(psi),
                formula(psi_pad)
            );
            if dtype == "bf16" {
                assert!(mem["master"].as_f64().unwrap() > 0.0);
            }
            // Elements sent per rank per step: 2Ψ(N-1)/N for stages 0-2; 3Ψ(N-1)/N at
            // stage 3, where the head's parameters are gathered once for its forward
            // and backward together, the tied embedding group once more for the
            // head, and not for the embedding's backward (which needs no
            // parameter). Gradients are reduced in f32; parameters travel in the
            // dtype.
            let c = &s["comm_bytes"]["by_op"];
            let sent: f64 = ["all_reduce", "reduce_scatter", "all_gather"]
                .iter()
                .map(|k| c[*k].as_f64().unwrap())
                .sum();
            let param_bytes = if dtype == "f32" { 4.0 } else { 2.0 };
            let volume = |p: f64, head: f64| {
                let bytes = match stage {
                    0 => 4.0 * 2.0 * p,
                    1 | 2 => 4.0 * p + param_bytes * p,
                    _ => 4.0 * p + param_bytes * (2.0 * p - head),
                };
                bytes * (n - 1.0) / n
            };
            let head = 2.0 * d;
            // The gradient norm's all-gather: three words a rank (its
            // sum of squares as two, its stop flag).
            let norm_bytes = 12.0 * (n - 1.0);
            let lo = volume(psi, head) + norm_bytes;
            let hi = volume(psi_pad, head + n * 16.0) + norm_bytes;
            assert!(
                lo <= sent && sent <= hi,
                "{dtype} stage {stage}: sent {sent} bytes, formula {lo} .. {hi}"
            );
        }
    }
}

/// bf16 and f16 training of configs/tiny.yaml ends within 2% of f32's loss
/// after the same steps (the mean of the last 5, so one batch's noise does not
/// decide it), at a learning rate of 5e-4. At tiny.yaml's own 2e-3 a loss
/// spike near the end of warmup can send f32 and bf16 down different paths:
/// with one version of this repository's sources as data, f32's gradient
/// norm reached 7.5 at step 24 where bf16's stayed at 3.0, and bf16 ended
/// 2.1% below f32, which says nothing about bf16's precision. Measured at
/// 5e-4 on two versions of the sources: bf16 within 0.05%, f16 within 0.01%.
///
/// f16 starts at scale 2^12 so that no step overflows: at the default 2^16 the
/// first two steps overflow and are skipped, the schedule waits for them, and
/// a 60-step run then ends two warmup steps behind f32 (2.4% here) for reasons
/// that have nothing to do with f16's precision. The test asserts that no step
/// was skipped, so it keeps comparing like with like when the data changes
/// (the data is this repository's sources).
#[test]
fn mixed_precision_tiny_run_stays_within_2_percent_of_f32() {
    let dir = tempfile::tempdir().unwrap();
    let root = repo_root();
    let mut tail = Vec::new();
    for dtype in ["f32", "bf16", "f16"] {
        let m = dir.path().join(format!("{dtype}.jsonl"));
        let f = TrainArgs::new("configs/tiny.yaml", &m)
            .set("train.steps=60")
            .set("train.lr=5.0e-4")
            .set(format!("train.dtype={dtype}"))
            .set("train.loss_scale.initial_scale_power=12")
            .run(&root);
        assert_eq!(f.code(), 0, "{f:?}");
        let lines = metrics(&m);
        let l = losses(&lines);
        assert_eq!(l.len(), 60);
        tail.push(l[55..].iter().sum::<f64>() / 5.0);
        let skipped = lines[..60]
            .iter()
            .filter(|x| x["grad_norm"].is_null())
            .count();
        assert_eq!(skipped, 0, "{dtype}: steps skipped for overflow");
        let scales: Vec<bool> = lines[..60]
            .iter()
            .map(|x| x["loss_scale"].is_null())
            .collect();
        assert!(
            scales.iter().all(|&null| null == (dtype != "f16")),
            "{dtype}"
        );
    }
    for (dtype, got) in ["bf16", "f16"].iter().zip(&tail[1..]) {
        assert!(
            (got - tail[0]).abs() <= 0.02 * tail[0],
            "{dtype}: final loss {got:.4} vs f32 {:.4}",
            tail[0]
        );
    }
}

#[test]
fn estimate_reproduces_the_zero_paper_and_sizes_a_job() {
    let dir = tempfile::tempdir().unwrap();
    let f = zrun(
        dir.path(),
        &[
            "estimate",
            "--params",
            "7.5e9",
            "--nodes",
            "4",
            "--workers-per-node",
            "16",
            "--json",
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let v: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
    assert_eq!(v["world_size"], 64);
    let gb: Vec<String> = v["rows"].as_array().unwrap()[..4]
        .iter()
        .map(|r| format!("{:.1}", r["bytes_per_device"].as_f64().unwrap() / 1e9))
        .collect();
    assert_eq!(gb, ["120.0", "31.4", "16.6", "1.9"]);
    assert!(v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["offload"] == "optimizer+param:nvme"));
    // --comm: the paper's 384-GPU setting (24 nodes of 16, an 18B model,
    // 1K tokens per GPU, 100 Gbit/s): cross-node bytes per node per step.
    let f = zrun(
        dir.path(),
        &[
            "estimate",
            "--params",
            "18B",
            "--nodes",
            "24",
            "--workers-per-node",
            "16",
            "--comm",
            "--json",
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let v: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
    let c = &v["comm"];
    let (psi, ring) = (18e9, 383.0 / 384.0);
    let close = |x: &serde_json::Value, want: f64| (x.as_f64().unwrap() / want - 1.0).abs() < 1e-9;
    assert!(close(&c["stage3"]["forward"], ring * 2.0 * psi), "{c}");
    assert!(close(&c["stage3"]["gradients"], ring * 4.0 * psi), "{c}");
    assert!(close(&c["zero_pp"]["forward"], ring * psi), "{c}");
    assert_eq!(c["zero_pp"]["backward"], 0.0);
    assert!(
        close(&c["zero_pp"]["gradients"], 23.0 / 24.0 * 0.5 * psi),
        "{c}"
    );
    assert!(close(&c["compute_s"], 6.0 * psi * 1024.0 / 40e12), "{c}");
    let s = c["speedup_serial"].as_f64().unwrap();
    assert!(
        s > 1.0 && s < c["speedup_overlapped"].as_f64().unwrap(),
        "{c}"
    );
    // A job: its own parameter count and activation estimate, with and without checkpointing.
    let job = small_job(dir.path(), "est", 1);
    let f = zrun(dir.path(), &["estimate", job.to_str().unwrap(), "--json"]);
    assert_eq!(f.code(), 0, "{f:?}");
    let v: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
    assert_eq!(v["params"].as_f64().unwrap(), 28544.0);
    let a = &v["activations"];
    assert!(
        a["bytes_per_worker_checkpointed"].as_f64().unwrap()
            < a["bytes_per_worker"].as_f64().unwrap()
    );
    // Its reduce buckets on two workers: the default holds the whole
    // gradient; with a group a bucket (the head's norm, two blocks of
    // 12,704 parameters, the embedding) the two blocks are held at once.
    assert_eq!(v["reduce_buckets"]["count"], 1, "{v}");
    assert_eq!(v["reduce_buckets"]["held_bytes"], 4.0 * 28544.0, "{v}");
    let args = [job.to_str().unwrap(), "--set", "zero.reduce_bucket_size=1"];
    let small = zrun(
        dir.path(),
        &[&["estimate"], &args[..], &["--json"]].concat(),
    );
    assert_eq!(small.code(), 0, "{small:?}");
    let b: serde_json::Value = serde_json::from_str(&small.stdout).unwrap();
    let r = &b["reduce_buckets"];
    assert_eq!(
        (&r["count"], &r["held_at_once"]),
        (&4.into(), &2.into()),
        "{b}"
    );
    assert_eq!(r["held_bytes"], 4.0 * 2.0 * 12704.0, "{b}");
    assert_eq!(
        b["comm_buffers_per_worker"], r["held_bytes"],
        "stage 0: {b}"
    );
    let text = zrun(dir.path(), &[&["estimate"], &args[..]].concat());
    assert!(
        text.stdout
            .contains("(of its 4 reduce buckets a step, 2 held at once: 0.1 MB)"),
        "{}",
        text.stdout
    );
    // Lion keeps one moment: f32 stage 0 is (4 + 4 + 4)Ψ, not (4 + 4 + 8)Ψ.
    let lion = zrun(
        dir.path(),
        &[
            "estimate",
            job.to_str().unwrap(),
            "--set",
            "train.optimizer.type=lion",
            "--json",
        ],
    );
    assert_eq!(lion.code(), 0, "{lion:?}");
    let l: serde_json::Value = serde_json::from_str(&lion.stdout).unwrap();
    assert_eq!(v["bytes_per_param"]["optimizer"], 8.0, "{v}");
    assert_eq!(l["bytes_per_param"]["optimizer"], 4.0, "{l}");
    let stage0 = |v: &serde_json::Value| v["rows"][0]["bytes_per_device"].as_f64().unwrap();
    assert_eq!(stage0(&v), 16.0 * 28544.0);
    assert_eq!(stage0(&l), 12.0 * 28544.0);
    // --params with Lion or Adagrad (one sum of squares) in f32: K = 4;
    // Adam keeps AdamW's two moments: K = 8.
    for (rule, bytes) in [("lion", 12e9), ("adagrad", 12e9), ("adam", 16e9)] {
        let f = zrun(
            dir.path(),
            &[
                "estimate",
                "--params",
                "1B",
                "--dtype",
                "f32",
                "--optimizer",
                rule,
                "--json",
            ],
        );
        assert_eq!(f.code(), 0, "{f:?}");
        let p: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
        assert_eq!(stage0(&p), bytes, "{rule}: {p}");
    }
    // LAMB keeps AdamW's two moments.
    let f = zrun(
        dir.path(),
        &[
            "estimate",
            "--params",
            "1B",
            "--optimizer",
            "lamb",
            "--json",
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let p: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
    assert_eq!(p["bytes_per_param"]["optimizer"], 12.0, "{p}");
    assert_eq!(stage0(&p), 16e9, "{p}");
    let f = zrun(
        dir.path(),
        &["estimate", job.to_str().unwrap(), "--optimizer", "lion"],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("--optimizer goes with --params"),
        "{}",
        f.stderr
    );
    // The same count in both spellings gives the same estimate.
    let rows = |params: &str| {
        let f = zrun(dir.path(), &["estimate", "--params", params, "--json"]);
        assert_eq!(f.code(), 0, "{f:?}");
        serde_json::from_str::<serde_json::Value>(&f.stdout).unwrap()["rows"].clone()
    };
    assert_eq!(rows("1.3B"), rows("1300M"));
    assert_ne!(rows("1.3B"), rows("1.3GiB"));
    assert_eq!(zrun(dir.path(), &["estimate"]).code(), 2);
    assert_eq!(
        zrun(dir.path(), &["estimate", "--params", "lots"]).code(),
        2
    );
}

/// ZeRO++ hpZ through `zrun` on the loopback 2-node hostfile (2 workers on
/// 127.0.0.2, 2 on 127.0.0.3; shared memory inside each, TCP between): every
/// step's loss equals plain stage 3's, fewer bytes cross the nodes, the
/// secondary shards are reported as their own memory category (1/2 of the
/// embedding's and blocks' bf16 weights, within padding), and no shared-memory
/// segment of the hpZ groups is left behind.
#[test]
fn hpz_on_two_loopback_nodes_is_stage_3_with_less_cross_node_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "hpz", 4);
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "127.0.0.2 slots=2\n127.0.0.3 slots=2\n").unwrap();
    let hpz_segments = || {
        std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("zrun-") && n.contains("-hpz"))
                    .count()
            })
            .unwrap_or(0)
    };
    let before = hpz_segments();
    let run = |hpz: usize| {
        let m = dir.path().join(format!("hpz{hpz}.jsonl"));
        let f = zrun(
            dir.path(),
            &[
                "train",
                job.to_str().unwrap(),
                "--hostfile",
                hosts.to_str().unwrap(),
                "--set",
                "zero.stage=3",
                "--set",
                "train.dtype=bf16",
                "--set",
                "zero.param_persistence_threshold=0",
                "--set",
                &format!("zero.zero_hpz_partition_size={hpz}"),
                "--metrics",
                m.to_str().unwrap(),
            ],
        );
        assert_eq!(f.code(), 0, "hpz {hpz}: {f:?}");
        metrics(&m)
    };
    let (plain, hpz) = (run(1), run(2));
    assert_eq!(losses(&hpz), losses(&plain), "hpZ changed the loss curve");
    assert_eq!(losses(&hpz).len(), 4);
    let steps = |lines: &[serde_json::Value]| -> Vec<serde_json::Value> {
        lines
            .iter()
            .filter(|l| l.get("loss").is_some())
            .cloned()
            .collect()
    };
    let (d, l) = (32.0, 2.0);
    // The blocks' shards at their peak: the embedding's (64 + 32 rows) goes
    // with the tied head's gather, which prefetch issues before the last
    // block's forward gather (the embedding's backward gathers nothing).
    let kept = l * (12.0 * d * d + 13.0 * d);
    for (p, h) in steps(&plain).iter().zip(steps(&hpz)) {
        let cross = |s: &serde_json::Value| s["comm_bytes"]["inter_node"].as_f64().unwrap();
        assert!(
            cross(&h) < cross(p),
            "cross-node bytes: hpZ {} vs stage 3 {}",
            cross(&h),
            cross(p)
        );
        assert!(p["mem_bytes"].get("secondary").is_none());
        let secondary = h["mem_bytes"]["secondary"].as_f64().unwrap();
        // bf16 (2 bytes), half per rank; each group padded by < 4 x 16 elements.
        let (lo, hi) = (kept, kept + (l + 1.0) * 64.0);
        assert!(
            lo <= secondary && secondary <= hi,
            "secondary shards {secondary} bytes, expected {lo}..{hi}"
        );
    }
    assert_eq!(
        hpz_segments(),
        before,
        "an hpZ shared-memory segment was left in /dev/shm"
    );
}

/// Two workers in separate processes on one node, where shared-memory
/// all-gathers (and all-reduces) of 2-24 MiB read each peer's buffer
/// directly (`process_vm_readv`, falling back to the segment's slots where
/// the system refuses): every loss at stages 0-3 has the bits of the same job
/// over TCP. The model is sized so that its gathers take that path (a
/// block's parameters, 3 MiB in f32; all of them, 13 MiB).
#[test]
fn shared_memory_between_processes_trains_with_the_bits_of_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("direct.yaml");
    std::fs::write(
        &job,
        format!(
            "name: direct\n\
             model: {{vocab_size: 256, d_model: 256, n_layers: 2, n_heads: 4, seq_len: 32}}\n\
             data: {{format: synthetic}}\n\
             train: {{steps: 3, micro_batch_size: 2, lr: 1.0e-3, warmup_steps: 0}}\n\
             run_dir: {}/runs/direct\n",
            dir.path().display()
        ),
    )
    .unwrap();
    for stage in 0..=3 {
        let run = |backend: &str| {
            let m = dir.path().join(format!("s{stage}-{backend}.jsonl"));
            let f = TrainArgs::new(&job, &m)
                .args(&["--workers-per-node", "2"])
                .set(format!("zero.stage={stage}"))
                .set(format!("comm.backend={backend}"))
                .run(dir.path());
            assert_eq!(f.code(), 0, "stage {stage} {backend}: {f:?}");
            losses(&metrics(&m))
        };
        let (shm, tcp) = (run("shm"), run("tcp"));
        assert_eq!(shm.len(), 3);
        assert_eq!(shm, tcp, "stage {stage}: shared memory differs from TCP");
    }
}

/// `train.reduce_dtype: bf16` (DeepSpeed's `communication_data_type`) on the
/// loopback 2-node hostfile (shared memory inside a node, TCP between),
/// `configs/tiny.yaml` in bf16 for 30 steps: stages 0-3 give one loss curve
/// to the bit (the all-reduce's second half gathers the owners' rounded
/// sums, so every rank holds what a reduce-scatter gives the owner); the
/// gradient reductions send exactly half of f32's bytes (reduce-scatter at
/// stage 2, all-reduce at stage 0) and fewer cross the nodes; the curve
/// differs from f32 reductions' (something was rounded) and ends within 1%
/// of it (the mean of the last 5 steps). f16 reductions under f16's loss
/// scaling likewise end within 1% of f16 with f32 reductions. At 5e-4, as
/// `mixed_precision_tiny_run_stays_within_2_percent_of_f32` and for its
/// reason: at tiny's own 2e-3 the end of warmup can send two runs down
/// different paths whatever their precision (with one version of the
/// sources, bf16 reductions' curve left f32's at step 15 and ended 0.4%
/// above it, f16's 1.1%, where another version had ended 0.007% apart).
#[test]
fn reductions_in_16_bits_halve_the_bytes_keep_the_stages_identical_and_the_curve() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "127.0.0.2 slots=2\n127.0.0.3 slots=2\n").unwrap();
    let root = repo_root();
    let run = |dtype: &str, reduce: &str, stage: u8| {
        let m = dir.path().join(format!("{dtype}-{reduce}-{stage}.jsonl"));
        let f = TrainArgs::new(root.join("configs/tiny.yaml"), &m)
            .args(&["--hostfile", hosts.to_str().unwrap()])
            .set("train.steps=30")
            .set("train.lr=5.0e-4")
            .set(format!("train.dtype={dtype}"))
            .set(format!("train.reduce_dtype={reduce}"))
            .set(format!("zero.stage={stage}"))
            .set("train.loss_scale.initial_scale_power=12")
            .set(format!("run_dir={}/runs", dir.path().display()))
            .run(&root);
        assert_eq!(f.code(), 0, "{dtype} {reduce} stage {stage}: {f:?}");
        let steps: Vec<serde_json::Value> = metrics(&m)
            .into_iter()
            .filter(|l| l.get("loss").is_some())
            .collect();
        assert_eq!(steps.len(), 30, "{dtype} {reduce} stage {stage}");
        steps
    };
    let bytes = |s: &[serde_json::Value], key: &str| -> Vec<f64> {
        s.iter()
            .map(|l| match key {
                "inter_node" => l["comm_bytes"]["inter_node"].as_f64().unwrap(),
                op => l["comm_bytes"]["by_op"][op].as_f64().unwrap(),
            })
            .collect()
    };
    let tail = |s: &[serde_json::Value]| losses(s)[25..].iter().sum::<f64>() / 5.0;
    let half: Vec<Vec<serde_json::Value>> =
        (0..4).map(|stage| run("bf16", "bf16", stage)).collect();
    for (stage, s) in half.iter().enumerate().skip(1) {
        assert_eq!(
            losses(s),
            losses(&half[0]),
            "bf16 reductions: stage {stage} vs stage 0"
        );
    }
    for (stage, op) in [(0, "all_reduce"), (2, "reduce_scatter")] {
        let full = run("bf16", "f32", stage);
        let (got, want) = (bytes(&half[stage as usize], op), bytes(&full, op));
        assert!(want.iter().all(|&b| b > 0.0), "stage {stage}: no {op}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(2.0 * g, *w, "stage {stage}: {op} bytes in bf16 vs f32");
        }
        let (a, b) = (
            bytes(&half[stage as usize], "inter_node"),
            bytes(&full, "inter_node"),
        );
        assert!(
            a.iter().zip(&b).all(|(a, b)| a < b),
            "stage {stage}: cross-node {a:?} vs {b:?}"
        );
        assert_ne!(
            losses(&half[stage as usize]),
            losses(&full),
            "stage {stage}: nothing rounded"
        );
        let (h, f) = (tail(&half[stage as usize]), tail(&full));
        eprintln!("bf16 stage {stage}: bf16 reductions end at {h:.4}, f32 at {f:.4}");
        assert!((h - f).abs() <= 0.01 * f, "stage {stage}: {h} vs {f}");
    }
    let (h, f) = (run("f16", "f16", 2), run("f16", "f32", 2));
    for s in [&h, &f] {
        assert!(
            s.iter().all(|l| !l["grad_norm"].is_null()),
            "f16: a step overflowed"
        );
    }
    let (h, f) = (tail(&h), tail(&f));
    eprintln!("f16 stage 2: f16 reductions end at {h:.4}, f32 at {f:.4}");
    assert!((h - f).abs() <= 0.01 * f, "f16: {h} vs {f}");
}

/// Where the 16-bit wire loses nothing: bf16 training on one node of two
/// ranks. Each rank's gradient is bf16 already (rounded as backward makes
/// it), so its piece crosses exactly, and the owner's f32 sum rounded to
/// bf16 is what the f32 path rounds it to when it puts it away: every loss
/// and gradient norm of `configs/tiny.yaml` at stages 0 and 2 has f32
/// reductions' bits.
#[test]
fn bf16_reductions_between_two_bf16_ranks_are_exact() {
    let dir = tempfile::tempdir().unwrap();
    let root = repo_root();
    for stage in [0, 2] {
        let run = |reduce: &str| {
            let m = dir.path().join(format!("{reduce}-{stage}.jsonl"));
            let f = TrainArgs::new(root.join("configs/tiny.yaml"), &m)
                .set("train.steps=12")
                .set("train.dtype=bf16")
                .set(format!("train.reduce_dtype={reduce}"))
                .set(format!("zero.stage={stage}"))
                .set(format!("run_dir={}/runs", dir.path().display()))
                .run(&root);
            assert_eq!(f.code(), 0, "{reduce} stage {stage}: {f:?}");
            let steps: Vec<serde_json::Value> = metrics(&m)
                .into_iter()
                .filter(|l| l.get("loss").is_some())
                .collect();
            assert_eq!(steps[0]["world_size"], 2);
            steps
        };
        let (half, full) = (run("bf16"), run("f32"));
        assert_eq!(losses(&half), losses(&full), "stage {stage}");
        let norms = |s: &[serde_json::Value]| -> Vec<f64> {
            s.iter().map(|l| l["grad_norm"].as_f64().unwrap()).collect()
        };
        assert_eq!(norms(&half), norms(&full), "stage {stage}: gradient norms");
    }
}
