//! `zrun bench comm`: collective bandwidth between local workers, per transport;
//! `zrun bench kernels`: the CPU kernels; `zrun bench io`: the swap layer.
//!
//! Comm and kernel measuring happens in the workers (see zworker's `bench`);
//! this starts them like a training job, with a task, and prints their rows.
//! The I/O benchmark needs no worker: it runs `zswap::bench` here.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use zconfig::{Node, Topology};
use zproto::{BenchCommTask, BenchRow, KernelRow, Op, Task};

use crate::cli::{BenchCommArgs, BenchIoArgs, BenchKernelsArgs};
use crate::plan::{default_worker_bin, LaunchPlan};
use crate::sink::Sink;
use crate::supervise::{run_job, Outcome};
use crate::Failure;

/// Measured when `--transports` is not given.
const TRANSPORTS: [&str; 2] = ["tcp", "shm"];

/// The collectives NCCL times (on device buffers, as nccl-tests does).
const NCCL_OPS: [Op; 3] = [Op::AllReduce, Op::ReduceScatter, Op::AllGather];

/// The collectives `transport` times when `--ops` is not given.
fn default_ops(transport: &str) -> Vec<String> {
    let ops: &[Op] = match transport {
        "nccl" => &NCCL_OPS,
        _ => &Op::DATA,
    };
    ops.iter().map(|o| o.name().to_string()).collect()
}

/// Parses a message size (zconfig's units: `64MiB` binary, `64M` decimal) that
/// is a positive multiple of 4 bytes (f32 elements).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let bytes = zconfig::spec::Size::parse(s)
        .map_err(|e| format!("--sizes: {e}"))?
        .0;
    if bytes < 4 || !bytes.is_multiple_of(4) {
        return Err(format!(
            "--sizes: `{s}` must be a positive multiple of 4 bytes (f32 elements)"
        ));
    }
    Ok(bytes)
}

/// A plan for `workers` local workers with a minimal spec (the task says what
/// to do).
fn local_plan(workers: usize, worker_bin: &std::path::Path) -> Result<LaunchPlan> {
    let spec = serde_json::from_value(serde_json::json!({
        "model": {}, "data": {"format": "synthetic"}, "name": "bench"
    }))?;
    Ok(LaunchPlan {
        spec,
        topology: Topology {
            nodes: vec![Node {
                host: "localhost".into(),
                slots: (0..workers).collect(),
                port: None,
                user: None,
            }],
        },
        node_addrs: vec!["127.0.0.1".into()],
        master_addr: "127.0.0.1".into(),
        master_port: 0,
        worker_bin: worker_bin.to_path_buf(),
        ssh: None,
        launcher: crate::cli::Launcher::Local,
        here: true,
        env: Vec::new(),
        per_node: None,
        gpu_memory: None,
        bind_cores: None,
        rank_log: None,
        launcher_args: Vec::new(),
    })
}

/// The zworker binary: `given`, or the one next to zrun.
pub(crate) fn worker_bin(given: Option<std::path::PathBuf>) -> Result<std::path::PathBuf> {
    let p = match given {
        Some(p) => p,
        None => default_worker_bin()?,
    };
    if !p.is_file() {
        return Err(Failure::launch(format!(
            "zworker not found at {}",
            p.display()
        )));
    }
    Ok(p)
}

/// Runs `bench kernels` in one local worker and returns its rows.
pub fn measure_kernels(elements: usize, worker_bin: &std::path::Path) -> Result<Vec<KernelRow>> {
    kernel_rows(elements, false, worker_bin)
}

/// This host's GEMM peak in GFLOP/s (the `gemm_f32` row), measured by a
/// local worker: what MFU is computed against.
pub fn measure_gemm_peak(worker_bin: &std::path::Path) -> Result<f64> {
    let rows = kernel_rows(0, true, worker_bin)?;
    rows.iter()
        .find(|r| r.kernel == "gemm_f32")
        .map(|r| r.gflops)
        .ok_or_else(|| anyhow::anyhow!("the worker measured no gemm_f32 row"))
}

fn kernel_rows(
    elements: usize,
    gemm_peak_only: bool,
    worker_bin: &std::path::Path,
) -> Result<Vec<KernelRow>> {
    let plan = local_plan(1, worker_bin)?;
    let (outcome, sink) = run_job(
        plan,
        Task::BenchKernels {
            elements,
            gemm_peak_only,
        },
        Sink::Kernels { rows: Vec::new() },
        Duration::from_secs(120),
        Duration::from_secs(60),
    )?;
    if let Outcome::Failed { code, message, .. } = outcome {
        return Err(Failure { code, message }.into());
    }
    let Sink::Kernels { rows } = sink else {
        unreachable!("kernels sink")
    };
    Ok(rows)
}

/// Runs `bench comm` with `workers` local workers over each transport and
/// returns the rows (the memcpy reference once). No `ops`: each transport's
/// own list.
pub fn measure_comm(
    workers: usize,
    ops: &[String],
    sizes: &[u64],
    transports: &[String],
    worker_bin: &std::path::Path,
) -> Result<Vec<BenchRow>> {
    let mut all_rows: Vec<BenchRow> = Vec::new();
    for transport in transports {
        let mut plan = local_plan(workers, worker_bin)?;
        if transport == "mpi" {
            // MPI's ranks come from mpirun.
            plan.launcher = crate::cli::Launcher::Mpirun;
        }
        let task = Task::BenchComm(BenchCommTask {
            ops: match ops.is_empty() {
                true => default_ops(transport),
                false => ops.to_vec(),
            },
            sizes: sizes.to_vec(),
            transport: transport.clone(),
            timeout_s: 120.0,
        });
        let (outcome, sink) = run_job(
            plan,
            task,
            Sink::Bench { rows: Vec::new() },
            Duration::from_secs(60),
            Duration::from_secs(60),
        )?;
        if let Outcome::Failed { code, message, .. } = outcome {
            return Err(Failure { code, message }.into());
        }
        if let Sink::Bench { rows } = sink {
            // Every job measures the memcpy reference; one set of rows is enough.
            let have_reference = all_rows.iter().any(|r| r.op == "memcpy");
            all_rows.extend(
                rows.into_iter()
                    .filter(|r| !(have_reference && r.op == "memcpy")),
            );
        }
    }
    Ok(all_rows)
}

/// A figure of a `bench kernels` row as the table prints it. One a kernel
/// does not have (the GEMMs' bytes, the quantizers' FLOPs) is 0 in the rows:
/// shown as "-" rather than as a measurement.
fn figure(v: f64) -> String {
    match v {
        0.0 => "-".to_string(),
        v => format!("{v:.2}"),
    }
}

/// What `fma_peak` at `n` threads says when it is under this share of `n`
/// times one thread's: the threads did not each have a core.
const SHARED_CORES_BELOW: f64 = 0.75;

/// A warning where the `fma_peak` rows show the machine's cores shared
/// while it was measured: other processes busy on them (a forgotten busy
/// loop pinned to one core of a 2-core guest held `fma_peak` at 2 threads
/// at 1.0x one thread's for an hour and went unnoticed while the
/// two-thread figures of that hour were taken as the host's noise), or a
/// host that runs its vCPUs on fewer cores than they number. Every figure
/// at those thread counts then measures fewer cores than it says.
fn shared_cores_warning(rows: &[KernelRow]) -> Option<String> {
    let one = rows
        .iter()
        .find(|r| r.kernel == "fma_peak" && r.threads == 1)?
        .gflops;
    let shared: Vec<String> = rows
        .iter()
        .filter(|r| r.kernel == "fma_peak" && r.threads > 1)
        .filter(|r| r.gflops < SHARED_CORES_BELOW * r.threads as f64 * one)
        .map(|r| {
            format!(
                "{} threads ran {:.2}x one thread's",
                r.threads,
                r.gflops / one
            )
        })
        .collect();
    (!shared.is_empty()).then(|| {
        format!(
            "fma_peak at {}: the cores were shared while this ran (other \
             processes busy on them, or an oversubscribed host), so the rows at those thread counts measure fewer \
             cores than they say; measure again on a quiet machine before comparing",
            shared.join(", ")
        )
    })
}

/// A warning where a GEMM row ran faster than its ceiling (`fma_peak`, or
/// `bf16_peak` for the AVX512_BF16 rows) at its thread count, which no
/// product can do: the cores' speed moved while the rows
/// were measured (the ceiling is taken before and after the products, the
/// faster kept, and a product still passed both), so the ratios at those
/// thread counts are not one sitting's.
fn over_ceiling_warning(rows: &[KernelRow]) -> Option<String> {
    let mut over: Vec<String> = rows
        .iter()
        // The GEMM rows: FLOP/s and no bytes (the streaming rows' ratios
        // are over the triad's bandwidth), f32 or AVX512_BF16 (set against
        // its own ceiling), not AMX's (which passes the f32 one by design).
        .filter(|r| {
            let ceiling = r.kernel.ends_with("_peak");
            let amx = r.kernel.contains("amxbf16");
            !ceiling && !amx && r.gbps == 0.0 && r.ratio > 1.0
        })
        .map(|r| format!("{} at {} threads ({:.2}x)", r.kernel, r.threads, r.ratio))
        .collect();
    let count = over.len();
    over.truncate(3);
    (count > 0).then(|| {
        format!(
            "{count} GEMM row(s) ran faster than their ceiling (fma_peak, bf16_peak), which no product passes: {}{}; \
             the machine's speed moved while this ran (a neighbour's load came or went), so \
             those ratios compare figures from different moments; measure again",
            over.join(", "),
            if count > 3 { ", ..." } else { "" }
        )
    })
}

/// `zrun bench kernels`.
pub fn kernels(args: BenchKernelsArgs) -> Result<ExitCode> {
    if args.elements < 1024 {
        return Err(Failure::bad_input("--elements must be at least 1024"));
    }
    let rows = measure_kernels(args.elements, &worker_bin(args.worker_bin.clone())?)?;
    let warning = shared_cores_warning(&rows);
    let drifted = over_ceiling_warning(&rows);
    for w in warning.iter().chain(&drifted) {
        shout!("zrun: warning: {w}");
    }
    if args.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "rows": rows,
                "shared_cores": warning,
                "over_ceiling": drifted
            }))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    let width = rows
        .iter()
        .map(|r| r.kernel.len())
        .max()
        .unwrap_or(0)
        .max(6);
    say!(
        "{:<width$} {:>10} {:>8} {:>10} {:>10} {:>8}",
        "kernel",
        "elements",
        "threads",
        "GB/s",
        "GFLOP/s",
        "ratio"
    );
    for r in &rows {
        say!(
            "{:<width$} {:>10} {:>8} {:>10} {:>10} {:>8.2}",
            r.kernel,
            r.elements,
            r.threads,
            figure(r.gbps),
            figure(r.gflops),
            r.ratio
        );
    }
    say!("(GB/s counts the bytes a kernel must read and write; ratio is GB/s over the triad's at the same threads,");
    say!(" and for the GEMM rows GFLOP/s over fma_peak's: the cores doing nothing but fused multiply-adds;");
    say!(" the AVX512_BF16 rows over bf16_peak's, vdpbf16ps alone, whose own ratio is over fma_peak's)");
    Ok(ExitCode::SUCCESS)
}

/// `zrun bench comm`.
pub fn comm(args: BenchCommArgs) -> Result<ExitCode> {
    let most = zconfig::hostfile::MAX_SLOTS;
    if !(1..=most).contains(&args.workers) {
        return Err(Failure::bad_input(format!(
            "--workers must be between 1 and {most}, got {}",
            args.workers
        )));
    }
    let sizes: Vec<u64> = args
        .sizes
        .iter()
        .map(|s| parse_bytes(s))
        .collect::<Result<_, _>>()
        .map_err(Failure::bad_input)?;
    for op in &args.ops {
        if Op::from_bench_name(op).is_none() {
            let valid: Vec<&str> = Op::DATA.iter().map(|o| o.name()).collect();
            return Err(Failure::bad_input(format!(
                "--ops: unknown op `{op}` (valid: {}; and all_reduce_bf16, reduce_scatter_bf16, all_reduce_f16, reduce_scatter_f16: 16 bits on the wire)",
                valid.join(", ")
            )));
        }
    }
    let transports: Vec<String> = if args.transports.is_empty() {
        TRANSPORTS.iter().map(|s| s.to_string()).collect()
    } else {
        args.transports.clone()
    };
    for t in &transports {
        if !TRANSPORTS.contains(&t.as_str()) && t != "mpi" && t != "nccl" {
            return Err(Failure::bad_input(format!(
                "--transports: unknown transport `{t}` (valid: tcp, shm, mpi, nccl)"
            )));
        }
    }
    let worker_bin = worker_bin(args.worker_bin.clone())?;
    if transports.iter().any(|t| t == "nccl") {
        let theirs: Vec<&str> = NCCL_OPS.iter().map(|o| o.name()).collect();
        if let Some(op) = args.ops.iter().find(|o| !theirs.contains(&o.as_str())) {
            return Err(Failure::bad_input(format!(
                "--ops {op}: not timed over nccl (it times {})",
                theirs.join(", ")
            )));
        }
        crate::plan::local_gpus(&worker_bin, true)
            .map_err(|why| Failure::bad_input(format!("--transports nccl: {why}")))?;
    }
    if transports.iter().any(|t| t == "mpi") {
        if crate::plan::which("mpirun").is_none() {
            return Err(Failure::bad_input(
                "--transports mpi: mpirun is not on PATH (Debian: apt-get install openmpi-bin)",
            ));
        }
        crate::plan::worker_has_mpi(&worker_bin)?;
    }
    let all_rows = measure_comm(args.workers, &args.ops, &sizes, &transports, &worker_bin)?;
    if args.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "rows": all_rows }))?
        );
    } else {
        say!(
            "{:<15} {:>12} {:>8} {:>10} {:>12} {:>12} {:>12}",
            "op",
            "bytes",
            "workers",
            "transport",
            "time_us",
            "algbw_GB/s",
            "busbw_GB/s"
        );
        for r in &all_rows {
            say!(
                "{:<15} {:>12} {:>8} {:>10} {:>12.1} {:>12.3} {:>12.3}",
                r.op,
                r.bytes,
                r.workers,
                r.transport,
                r.time_us,
                r.algbw_gbps,
                r.busbw_gbps
            );
        }
        say!("(memcpy: one thread of a worker copying the same bytes, the reference for bus bandwidth;");
        say!(" tcp_stream: one plain loopback TCP stream from rank 0 to rank 1, the reference for tcp)");
    }
    Ok(ExitCode::SUCCESS)
}

/// `zrun bench io`.
pub fn io(args: BenchIoArgs) -> Result<ExitCode> {
    let size = |flag: &str, s: &str| -> Result<u64> {
        match zconfig::spec::Size::parse(s) {
            Ok(b) if b.0 > 0 => Ok(b.0),
            Ok(_) => Err(Failure::bad_input(format!(
                "{flag}: `{s}` must be positive"
            ))),
            Err(e) => Err(Failure::bad_input(format!("{flag}: {e}"))),
        }
    };
    let sizes = args
        .sizes
        .iter()
        .map(|s| size("--sizes", s).map(|b| b as usize))
        .collect::<Result<Vec<_>>>()?;
    let total = size("--total", &args.total)?;
    let block_size = size("--block-size", &args.block_size)? as usize;
    if !block_size.is_multiple_of(zswap::ALIGN) {
        return Err(Failure::bad_input(format!(
            "--block-size: {block_size} bytes is not a multiple of {} (O_DIRECT transfers whole blocks)",
            zswap::ALIGN
        )));
    }
    for (flag, v) in [
        ("--queue-depth", args.queue_depth),
        ("--thread-count", args.thread_count),
        ("--in-flight", args.in_flight),
    ] {
        if v == 0 {
            return Err(Failure::bad_input(format!("{flag} must be at least 1")));
        }
    }
    let info = zswap::check_dir(&args.path)
        .map_err(|e| Failure::bad_input(format!("--path {}: {e}", args.path.display())))?;
    let need = total * 2;
    if info.free_bytes < need {
        return Err(Failure::bad_input(format!(
            "--path {}: {} bytes free, the benchmark writes files of {need} bytes",
            args.path.display(),
            info.free_bytes
        )));
    }
    if info.in_memory {
        shout!(
            "zrun: note: {} is on {} (memory): the figures are memory's, not a disk's",
            args.path.display(),
            info.filesystem
        );
    }
    let cfg = zswap::bench::IoBenchConfig {
        dir: args.path.clone(),
        sizes,
        total,
        aio: zswap::AioConfig {
            block_size,
            queue_depth: args.queue_depth,
            thread_count: args.thread_count,
        },
        in_flight: args.in_flight,
    };
    if !args.json {
        say!(
            "{} ({}), {} MB per method and size",
            args.path.display(),
            info.filesystem,
            total / 1_000_000
        );
        say!(
            "{:<16} {:>6} {:>10} {:>8} {:>10}",
            "method",
            "op",
            "size",
            "GB/s",
            "vs direct"
        );
    }
    let json = args.json;
    let (rows, skipped) = zswap::bench::run(&cfg, |r| {
        if !json {
            say!(
                "{:<16} {:>6} {:>10} {:>8.2} {:>9.2}x",
                r.method,
                r.op,
                r.size,
                r.gb_per_s,
                r.vs_direct
            );
        }
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    for s in &skipped {
        shout!("zrun: {} not measured: {}", s.method, s.reason);
    }
    if json {
        say!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({ "filesystem": info.filesystem, "rows": rows, "skipped": skipped })
            )?
        );
    } else {
        say!("(direct: one O_DIRECT pwrite/pread at a time; buffered: through the page cache, fsync before the clock stops, cache dropped before reading; writes are timed to a completed sync)");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_binary() {
        assert_eq!(parse_bytes("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_bytes("64M").unwrap(), 64_000_000);
        assert_eq!(parse_bytes("1KiB").unwrap(), 1024);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert!(parse_bytes("3").is_err());
        assert!(parse_bytes("lots").is_err());
    }

    #[test]
    fn an_fma_peak_that_does_not_scale_with_threads_warns() {
        let row = |kernel: &str, threads, gflops| KernelRow {
            kernel: kernel.into(),
            elements: 0,
            threads,
            gbps: 0.0,
            gflops,
            ratio: 1.0,
        };
        let scaled = [row("fma_peak", 1, 94.5), row("fma_peak", 2, 186.6)];
        assert_eq!(shared_cores_warning(&scaled), None);
        let shared = [
            row("fma_peak", 1, 94.5),
            row("fma_peak", 2, 94.1),
            row("gemm_f32", 2, 80.0),
        ];
        let w = shared_cores_warning(&shared).expect("a warning");
        assert!(w.contains("2 threads ran 1.00x one thread's"), "{w}");
        // No one-thread row to compare with: nothing to say.
        assert_eq!(shared_cores_warning(&shared[1..]), None);
    }

    #[test]
    fn a_gemm_row_past_the_fma_ceiling_warns() {
        let row = |kernel: &str, threads, gflops, ratio| KernelRow {
            kernel: kernel.into(),
            elements: 0,
            threads,
            gbps: 0.0,
            gflops,
            ratio,
        };
        let steady = [
            row("fma_peak", 1, 135.0, 1.0),
            row("gemm_f32", 2, 240.0, 0.89),
            row("zgemm_avx512_nn_2048x384x1152", 1, 120.0, 0.89),
            KernelRow {
                gbps: 23.9,
                ..row("adamw_avx512", 1, 10.0, 1.55)
            },
            row("zgemm_amxbf16_nn_2048x384x1152", 1, 800.0, 5.9),
            // bf16_peak's ratio is over fma_peak's; the AVX512_BF16 rows' over
            // bf16_peak's.
            row("bf16_peak", 1, 270.0, 2.0),
            row("zgemm_avx512bf16_nn_2048x384x1152", 1, 240.0, 0.89),
        ];
        assert_eq!(over_ceiling_warning(&steady), None);
        let mut drifted = steady.to_vec();
        drifted.push(row("zgemm_avx512_tn_384x2048x1152", 1, 140.0, 1.04));
        drifted.push(row("zgemm_avx512bf16_tn_384x2048x1152", 1, 280.0, 1.04));
        let w = over_ceiling_warning(&drifted).expect("a warning");
        assert!(w.starts_with("2 GEMM row(s)"), "{w}");
        assert!(
            w.contains("zgemm_avx512_tn_384x2048x1152 at 1 threads (1.04x)"),
            "{w}"
        );
        assert!(
            w.contains("zgemm_avx512bf16_tn_384x2048x1152 at 1 threads"),
            "{w}"
        );
    }

    #[test]
    fn a_figure_a_kernel_lacks_prints_as_a_dash() {
        assert_eq!(figure(0.0), "-");
        assert_eq!(figure(12.345), "12.35");
        assert_eq!(figure(0.004), "0.00");
    }
}
