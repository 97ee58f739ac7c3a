//! The benchmark commands end to end: `zrun bench comm`, `bench kernels` and
//! sweeps, with the shapes of their rows and files.

use e2e::{small_job, zrun};

/// `r`'s ratio is its GFLOP/s over `ceiling`'s.
fn assert_ratio_over(r: &serde_json::Value, ceiling: &serde_json::Value) {
    let expected = r["gflops"].as_f64().unwrap() / ceiling["gflops"].as_f64().unwrap();
    let ratio = r["ratio"].as_f64().unwrap();
    assert!(
        (ratio - expected).abs() <= 1e-9 * expected,
        "{r} against {ceiling}"
    );
}

/// The benchmarks run end to end and report the documented row shapes.
#[test]
fn bench_commands_report_rows() {
    let dir = tempfile::tempdir().unwrap();
    let f = zrun(
        dir.path(),
        &["bench", "kernels", "--json", "--elements", "65536"],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let v: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    for kernel in [
        "triad",
        "adamw_portable",
        "reduce_add",
        "gemm_f32",
        "quantize_int4_portable",
        "compensate_int4_portable",
    ] {
        assert!(
            rows.iter().any(|r| r["kernel"] == kernel),
            "{kernel} missing"
        );
    }
    for r in rows {
        for key in ["kernel", "elements", "threads", "gbps", "gflops", "ratio"] {
            assert!(r.get(key).is_some(), "{key} missing in {r}");
        }
        if r["kernel"] == "triad" {
            assert_eq!(r["ratio"].as_f64(), Some(1.0));
        }
    }
    // The arithmetic ceiling wherever zgemm has a SIMD kernel, and every
    // GEMM row's ratio over it at the same threads; the AVX512_BF16
    // kernel's rows over its own (`bf16_peak`, whose ratio is over
    // `fma_peak`'s) where the CPU has it.
    let ceiling: Vec<_> = rows.iter().filter(|r| r["kernel"] == "fma_peak").collect();
    let bf16_ceiling: Vec<_> = rows.iter().filter(|r| r["kernel"] == "bf16_peak").collect();
    let bf16_rows = |r: &serde_json::Value| {
        r["kernel"]
            .as_str()
            .unwrap()
            .starts_with("zgemm_avx512bf16_")
    };
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            assert!(!ceiling.is_empty(), "no fma_peak row on a CPU with AVX2");
        }
        let avx512_bf16 = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16");
        assert_eq!(
            !bf16_ceiling.is_empty(),
            avx512_bf16,
            "bf16_peak rows where (and only where) the CPU has AVX512_BF16"
        );
        if !avx512_bf16 {
            eprintln!("bench: bf16_peak is NOT covered here (no avx512bf16 on this CPU)");
        }
    }
    for c in &bf16_ceiling {
        let f = ceiling
            .iter()
            .find(|f| f["threads"] == c["threads"])
            .expect("fma_peak beside bf16_peak");
        assert_ratio_over(c, f);
        let mut seen = 0;
        for r in rows
            .iter()
            .filter(|r| r["threads"] == c["threads"] && bf16_rows(r))
        {
            assert_ratio_over(r, c);
            seen += 1;
        }
        assert!(seen > 0, "no AVX512_BF16 row at {} threads", c["threads"]);
    }
    for c in &ceiling {
        assert!(c["gflops"].as_f64().unwrap() > 0.0, "{c}");
        let gemms = rows.iter().filter(|r| {
            r["threads"] == c["threads"]
                && (bf16_ceiling.is_empty() || !bf16_rows(r))
                && (r["kernel"] == "gemm_f32"
                    || r["kernel"].as_str().unwrap().starts_with("zgemm_"))
        });
        let mut seen = 0;
        for r in gemms {
            assert_ratio_over(r, c);
            seen += 1;
        }
        assert!(seen > 0, "no GEMM row at {} threads", c["threads"]);
    }
    let f = zrun(
        dir.path(),
        &[
            "bench",
            "comm",
            "--workers",
            "3",
            "--sizes",
            "4KiB,1M",
            "--ops",
            "all_reduce,all_gather",
            "--json",
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let v: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    // Every transport by default: TCP and shared memory, side by side, and the
    // references once per size: memcpy, and a plain TCP stream (2 ranks).
    assert_eq!(rows.len(), 12);
    assert_eq!(rows.iter().filter(|r| r["transport"] == "shm").count(), 4);
    for op in ["memcpy", "tcp_stream"] {
        let reference: Vec<_> = rows.iter().filter(|r| r["op"] == op).collect();
        assert_eq!(reference.len(), 2, "{op}");
        assert!(reference.iter().all(|r| {
            let bus = r["busbw_gbps"].as_f64().unwrap();
            bus > 0.0 && bus == r["algbw_gbps"].as_f64().unwrap()
        }));
    }
    assert!(rows
        .iter()
        .filter(|r| r["op"] == "tcp_stream")
        .all(|r| r["workers"] == 2 && r["transport"] == "tcp"));
    for r in rows
        .iter()
        .filter(|r| r["op"] != "memcpy" && r["op"] != "tcp_stream")
    {
        let (alg, bus) = (
            r["algbw_gbps"].as_f64().unwrap(),
            r["busbw_gbps"].as_f64().unwrap(),
        );
        let factor = if r["op"] == "all_reduce" {
            2.0 * 2.0 / 3.0
        } else {
            2.0 / 3.0
        };
        assert!((bus - alg * factor).abs() <= 1e-9 * alg.max(1.0), "{r}");
        assert_eq!(r["workers"], 3);
    }
    // The reductions in 16 bits on the wire (`train.reduce_dtype`): rows
    // named as asked, their bus bandwidth of the f32 bytes reduced; a
    // 16-bit op that is no reduction is refused, naming the valid ones.
    let f = zrun(
        dir.path(),
        &[
            "bench",
            "comm",
            "--transports",
            "tcp",
            "--sizes",
            "1M",
            "--ops",
            "all_reduce_bf16,reduce_scatter_f16",
            "--json",
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let v: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    for (op, factor) in [("all_reduce_bf16", 1.0), ("reduce_scatter_f16", 0.5)] {
        let r = rows
            .iter()
            .find(|r| r["op"] == op)
            .unwrap_or_else(|| panic!("no {op} row: {v}"));
        let (alg, bus) = (
            r["algbw_gbps"].as_f64().unwrap(),
            r["busbw_gbps"].as_f64().unwrap(),
        );
        assert!(alg > 0.0 && (bus - alg * factor).abs() <= 1e-9 * alg, "{r}");
        assert_eq!(r["bytes"], 1_000_000, "{r}");
    }
    let f = zrun(dir.path(), &["bench", "comm", "--ops", "all_gather_bf16"]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("--ops: unknown op `all_gather_bf16`")
            && f.stderr.contains("all_reduce_bf16, reduce_scatter_bf16"),
        "{}",
        f.stderr
    );
    // NCCL needs a zworker with `cuda`, a GPU and NCCL (tests/gpu.rs); an
    // op it does not time is refused before that is asked.
    let f = zrun(
        dir.path(),
        &[
            "bench",
            "comm",
            "--transports",
            "nccl",
            "--ops",
            "all_to_all",
        ],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("--ops all_to_all: not timed over nccl (it times all_reduce, reduce_scatter, all_gather)"),
        "{}",
        f.stderr
    );
    assert_eq!(
        zrun(
            dir.path(),
            &["bench", "comm", "--transports", "carrier-pigeon"]
        )
        .code(),
        2
    );
    // More workers than a node takes (100000 started 6156 before the
    // process table said no).
    let f = zrun(dir.path(), &["bench", "comm", "--workers", "100000"]);
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("--workers must be between 1 and 1024, got 100000"),
        "{}",
        f.stderr
    );
}

#[test]
fn a_sweep_runs_every_combination_and_writes_csv_json_svg() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path(), "sweep", 2);
    // A job's curriculum and layer dropping are left out: the bench times
    // whole sequences and every block; and its flops profiler and comms
    // logger: no profile or comms log lands in the job's run directory.
    let text = std::fs::read_to_string(&job).unwrap().replace(
        "  warmup_steps: 2\n",
        "  warmup_steps: 2\n  curriculum: {min_difficulty: 8, schedule_type: fixed_linear, total_curriculum_step: 100, difficulty_step: 8}\n  progressive_layer_drop: {theta: 0.5}\n",
    );
    let logs = "flops_profiler: {profile_step: 2}\ncomms_logger: {}\n";
    std::fs::write(&job, text + logs).unwrap();
    let out = dir.path().join("out");
    let f = zrun(
        dir.path(),
        &[
            "bench",
            job.to_str().unwrap(),
            "--sweep",
            "zero.stage=0,3",
            "--sweep",
            "workers=1,2",
            "--steps",
            "3",
            "--set",
            "data.val_fraction=0.1",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    assert!(f.stdout.contains("val loss"), "{}", f.stdout);
    assert!(!f.stdout.contains("flops profile"), "{}", f.stdout);
    assert!(!dir.path().join("runs/sweep/flops_profile.txt").exists());
    assert!(!dir.path().join("runs/sweep/comms_log.txt").exists());
    assert!(!f.stdout.contains("comms log"), "{}", f.stdout);
    let csv = std::fs::read_to_string(out.join("bench.csv")).unwrap();
    assert_eq!(csv.lines().count(), 5, "{csv}");
    assert!(
        csv.starts_with("zero.stage,workers,tokens_per_s,tflops,mfu,"),
        "{csv}"
    );
    // `workers` is the launch's, not the job's: one worker, then two.
    for (i, want) in [1, 2, 1, 2].into_iter().enumerate() {
        let metrics = std::fs::read_to_string(out.join(format!("run-{i}.jsonl"))).unwrap();
        let step: serde_json::Value = metrics
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v.get("step").is_some())
            .unwrap();
        assert_eq!(step["world_size"], want, "run {i}");
        assert!(
            step.get("seq_len").is_none(),
            "run {i} ran the job's curriculum"
        );
        assert!(
            step.get("layer_drop").is_none(),
            "run {i} dropped the job's layers"
        );
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("bench.json")).unwrap()).unwrap();
    let rows = json["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    assert!(rows
        .iter()
        .all(|r| r["tokens_per_s"].as_f64().unwrap() > 0.0
            && r["peak_rss_bytes"].as_u64().unwrap() > 0
            // Model FLOP/s over the host's measured GEMM peak: a fraction.
            && r["mfu"].as_f64().is_some_and(|m| m > 0.0 && m < 1.5)
            && r["val_loss"].as_f64().is_some_and(f64::is_finite)));
    let svg = std::fs::read_to_string(out.join("bench.svg")).unwrap();
    assert!(
        svg.starts_with("<svg")
            && svg.contains("tokens/s")
            && svg.contains("MFU")
            && svg.contains("stage=3 workers=2"),
        "svg lacks labels"
    );
    // A bad key fails before anything runs.
    let f = zrun(
        dir.path(),
        &[
            "bench",
            job.to_str().unwrap(),
            "--sweep",
            "zero.stag=0,3",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    // So does a number of workers that is not one.
    let f = zrun(
        dir.path(),
        &[
            "bench",
            job.to_str().unwrap(),
            "--sweep",
            "workers=2,none",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("workers=none"), "{}", f.stderr);
    // A key swept twice (its first values were silently overridden).
    let f = zrun(
        dir.path(),
        &[
            "bench",
            job.to_str().unwrap(),
            "--sweep",
            "zero.stage=0",
            "--sweep",
            "zero.stage=3",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("--sweep zero.stage: given twice"),
        "{}",
        f.stderr
    );
    // A swept value a job cannot take is named as the --sweep it came from
    // (it was named `--set zero.stage=9`, which the user never wrote).
    let f = zrun(
        dir.path(),
        &[
            "bench",
            job.to_str().unwrap(),
            "--sweep",
            "zero.stage=1,9",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr
            .contains("--sweep zero.stage=9: zero.stage: must be 0, 1, 2 or 3"),
        "{}",
        f.stderr
    );
    // A second sweep into the same --out keeps the first one's tables.
    let f = zrun(
        dir.path(),
        &[
            "bench",
            job.to_str().unwrap(),
            "--sweep",
            "zero.stage=1",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(f.stderr.contains("exists; it is kept"), "{}", f.stderr);
    assert_eq!(std::fs::read_to_string(out.join("bench.csv")).unwrap(), csv);
}

/// `zrun bench io` measures every method (both swapper paths, or says why
/// one is missing) at every size, checks every byte it reads (the stamps in
/// zswap's bench), leaves no file behind, and refuses a bad directory or
/// size with exit 2 naming the flag.
#[test]
fn bench_io_measures_every_method_and_refuses_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let swap = dir.path().join("swap");
    std::fs::create_dir(&swap).unwrap();
    let path = swap.to_str().unwrap();
    let f = zrun(
        dir.path(),
        &[
            "bench",
            "io",
            "--path",
            path,
            "--sizes",
            "64KiB,1MiB",
            "--total",
            "4MiB",
            "--block-size",
            "256KiB",
            "--json",
        ],
    );
    assert_eq!(f.code(), 0, "{f:?}");
    let v: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    let skipped: Vec<&str> = v["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["method"].as_str().unwrap())
        .collect();
    for method in ["buffered", "direct", "zswap-io_uring", "zswap-threads"] {
        if skipped.contains(&method) {
            println!(
                "{method}: skipped by zrun (it said why on stderr): {}",
                f.stderr
            );
            continue;
        }
        for size in [65536, 1 << 20] {
            for op in ["write", "read"] {
                let r = rows
                    .iter()
                    .find(|r| r["method"] == method && r["size"] == size && r["op"] == op)
                    .unwrap_or_else(|| panic!("{method} {op} {size} missing"));
                assert!(r["gb_per_s"].as_f64().unwrap() > 0.0, "{r}");
                assert_eq!(r["bytes"].as_u64(), Some(4 << 20), "{r}");
            }
        }
    }
    assert!(
        !skipped.contains(&"zswap-threads"),
        "the thread path always runs"
    );
    assert_eq!(std::fs::read_dir(&swap).unwrap().count(), 0, "files left");

    let missing = dir.path().join("nope");
    for (args, says) in [
        (vec!["--path", missing.to_str().unwrap()], "does not exist"),
        (vec!["--path", path, "--sizes", "0"], "--sizes"),
        (vec!["--path", path, "--block-size", "1000"], "--block-size"),
        (vec!["--path", path, "--in-flight", "0"], "--in-flight"),
    ] {
        let mut all = vec!["bench", "io"];
        all.extend(args);
        let f = zrun(dir.path(), &all);
        assert_eq!(f.code(), 2, "{all:?}: {f:?}");
        assert!(f.stderr.contains(says), "{all:?}: {}", f.stderr);
    }
}
