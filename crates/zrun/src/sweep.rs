//! `zrun bench JOB.yaml --sweep KEY=V1,V2 ...`: every combination of the swept
//! keys trained for `--steps` steps, one after the other, as ordinary jobs.
//!
//! Each configuration writes its own metrics file under `--out`; a row takes the
//! median of the steps after the first (the first pays for page faults and
//! warm-up), the peak RSS over all steps, and the median bytes sent per step.
//! The table is printed and written as `bench.csv`, `bench.json` and
//! `bench.svg` (tokens/s, MFU and peak memory per configuration).
//!
//! The key `workers` sweeps `--workers-per-node` (e.g. `--sweep workers=1,2`:
//! one worker with every core against one worker per core). MFU is the job's
//! model FLOP/s over this host's GEMM peak (`zrun bench kernels`' `gemm_f32`
//! row: zgemm at 2048³ on all cores), measured once before the first
//! configuration; with a hostfile it is over the peak times the nodes used.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use plotters::prelude::*;
use serde::Serialize;

use crate::cli::BenchJobArgs;
use crate::Failure;

/// One configuration's measurements.
#[derive(Debug, Clone, Serialize)]
pub struct SweepRow {
    /// The swept keys and their values, in `--sweep` order.
    pub config: Vec<(String, String)>,
    /// Median whole-job tokens per second.
    pub tokens_per_s: f64,
    /// Median whole-job model TFLOP/s.
    pub tflops: f64,
    /// `tflops` over the GEMM peak of the nodes used.
    pub mfu: f64,
    /// Median step time.
    pub step_ms: f64,
    /// Peak RSS of the largest worker.
    pub peak_rss_bytes: u64,
    /// Median bytes one rank sent per step to its own node.
    pub intra_node_bytes: u64,
    /// Median bytes one rank sent per step to other nodes.
    pub inter_node_bytes: u64,
    /// The last validation loss of the run, when the job computes one.
    pub val_loss: Option<f64>,
}

impl SweepRow {
    fn label(&self) -> String {
        self.config
            .iter()
            .map(|(k, v)| format!("{}={v}", k.rsplit('.').next().unwrap_or(k)))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Parses `KEY=V1,V2,...`.
fn parse_sweep(s: &str) -> Result<(String, Vec<String>)> {
    let (k, vs) = s.split_once('=').ok_or_else(|| {
        Failure::bad_input(format!(
            "--sweep {s}: expected KEY=V1,V2 (e.g. zero.stage=0,3)"
        ))
    })?;
    let values: Vec<String> = vs
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect();
    if k.trim().is_empty() || values.is_empty() {
        return Err(Failure::bad_input(format!(
            "--sweep {s}: needs a key and at least one value"
        )));
    }
    Ok((k.trim().to_string(), values))
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub(crate) fn row_from_metrics(config: Vec<(String, String)>, path: &Path) -> Result<SweepRow> {
    let text = std::fs::read_to_string(path)?;
    let steps: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("step").is_some())
        .collect();
    let timed = if steps.len() > 1 {
        &steps[1..]
    } else {
        &steps[..]
    };
    let f = |k: &str| median(timed.iter().filter_map(|s| s[k].as_f64()).collect());
    let comm = |k: &str| {
        median(
            timed
                .iter()
                .filter_map(|s| s["comm_bytes"][k].as_f64())
                .collect(),
        ) as u64
    };
    Ok(SweepRow {
        config,
        tokens_per_s: f("tokens_per_s"),
        tflops: f("tflops"),
        mfu: 0.0,
        step_ms: f("step_ms"),
        peak_rss_bytes: steps
            .iter()
            .filter_map(|s| s["mem_bytes"]["peak_rss"].as_u64())
            .max()
            .unwrap_or(0),
        intra_node_bytes: comm("intra_node"),
        inter_node_bytes: comm("inter_node"),
        val_loss: steps.iter().rev().find_map(|s| s["val_loss"].as_f64()),
    })
}

/// `zrun bench JOB.yaml --sweep ...`.
pub fn sweep(args: BenchJobArgs) -> Result<ExitCode> {
    let Some(job) = args.job.clone() else {
        return Err(Failure::bad_input(
            "zrun bench: give JOB.yaml --sweep KEY=V1,V2, or `comm` or `kernels`",
        ));
    };
    let sweeps: Vec<(String, Vec<String>)> = args
        .sweep
        .iter()
        .map(|s| parse_sweep(s))
        .collect::<Result<_>>()?;
    if sweeps.is_empty() {
        return Err(Failure::bad_input("give at least one --sweep KEY=V1,V2"));
    }
    // A key swept twice would run each combination twice, the first
    // values overridden by the second's.
    for (i, (k, _)) in sweeps.iter().enumerate() {
        if sweeps[..i].iter().any(|(earlier, _)| earlier == k) {
            return Err(Failure::bad_input(format!(
                "--sweep {k}: given twice; list all its values in one --sweep {k}=V1,V2"
            )));
        }
    }
    if args.steps == 0 {
        return Err(Failure::bad_input("--steps must be at least 1"));
    }
    // Every combination, the last key varying fastest.
    let mut combos: Vec<Vec<(String, String)>> = vec![Vec::new()];
    for (k, vs) in &sweeps {
        combos = combos
            .into_iter()
            .flat_map(|c| {
                vs.iter()
                    .map(move |v| [c.clone(), vec![(k.clone(), v.clone())]].concat())
            })
            .collect();
    }
    // Check every configuration before running any.
    let mut nodes = Vec::with_capacity(combos.len());
    for c in &combos {
        let sets = sets_for(c, &args);
        // A swept value is passed on as `--set`: an error about it names
        // the --sweep the user wrote.
        let swept = |e: zconfig::ConfigError| {
            let mut message = e.to_string();
            for (k, _) in c.iter().filter(|(k, _)| k != "workers") {
                message = message.replace(&format!("--set {k}"), &format!("--sweep {k}"));
            }
            Failure::bad_input(message)
        };
        let mut loaded = zconfig::load_job(&job, &sets).map_err(swept)?;
        let topology = crate::plan::topology(&launch_for(c, &args)?)?;
        loaded.validate_on(&topology).map_err(swept)?;
        nodes.push(topology.nodes.len());
    }
    let tables = ["bench.csv", "bench.json", "bench.svg"].map(|f| args.out.join(f));
    crate::keep_existing("--out", &tables, args.overwrite)?;
    let worker_bin = crate::bench::worker_bin(args.launch.worker_bin.clone())?;
    let peak_before = crate::bench::measure_gemm_peak(&worker_bin)?;
    std::fs::create_dir_all(&args.out)
        .map_err(|e| Failure::bad_input(format!("--out {}: {e}", args.out.display())))?;
    let bar = ProgressBar::new(combos.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("sweep {pos}/{len} [{bar:30}] {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    if !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let zrun = std::env::current_exe()?;
    let mut rows = Vec::new();
    for (i, c) in combos.into_iter().enumerate() {
        let metrics = args.out.join(format!("run-{i}.jsonl"));
        let label = SweepRow {
            config: c.clone(),
            tokens_per_s: 0.0,
            tflops: 0.0,
            mfu: 0.0,
            step_ms: 0.0,
            peak_rss_bytes: 0,
            intra_node_bytes: 0,
            inter_node_bytes: 0,
            val_loss: None,
        }
        .label();
        bar.set_message(label.clone());
        // Each configuration is an ordinary `zrun train`, in a process of its own
        // so that a failure or Ctrl-C is handled exactly as for a training job.
        let mut cmd = std::process::Command::new(&zrun);
        cmd.arg("train")
            .arg(&job)
            .arg("--no-progress")
            .arg("--metrics")
            .arg(&metrics);
        for s in sets_for(&c, &args) {
            cmd.arg("--set").arg(s);
        }
        cmd.args(launch_flags(&launch_for(&c, &args)?));
        let out = crate::child::output_of(cmd, &format!("configuration {label}"))
            .inspect_err(|_| bar.finish_and_clear())?;
        if !out.status.success() {
            bar.finish_and_clear();
            eprint!("{}", String::from_utf8_lossy(&out.stderr));
            return Err(crate::Failure {
                code: out.status.code().unwrap_or(1) as u8,
                message: format!(
                    "configuration {label} failed (its metrics: {})",
                    metrics.display()
                ),
            }
            .into());
        }
        rows.push(row_from_metrics(c, &metrics)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    // The peak before and after the configurations, the larger counting: a
    // slow moment at either end must not make the MFU look better.
    let peak_after = crate::bench::measure_gemm_peak(&worker_bin)?;
    let peak_gflops = peak_before.max(peak_after);
    say!("GEMM peak of this host (gemm_f32, zgemm 2048³, all cores): {peak_gflops:.1} GFLOP/s (before {peak_before:.1}, after {peak_after:.1})");
    for (row, n) in rows.iter_mut().zip(&nodes) {
        row.mfu = row.tflops * 1e3 / (peak_gflops * *n as f64);
    }
    print_table(&rows);
    write_outputs(&args.out, &rows)?;
    say!(
        "wrote {}",
        ["bench.csv", "bench.json", "bench.svg"]
            .map(|f| args.out.join(f).display().to_string())
            .join(", ")
    );
    Ok(ExitCode::SUCCESS)
}

/// The sweep key that varies `--workers-per-node` instead of the job.
const WORKERS: &str = "workers";

/// The launch options of configuration `c`: the command line's, with
/// `workers` from the sweep if it is swept.
fn launch_for(c: &[(String, String)], args: &BenchJobArgs) -> Result<crate::cli::LaunchArgs> {
    let mut launch = args.launch.clone();
    if let Some((_, v)) = c.iter().find(|(k, _)| k == WORKERS) {
        let n: usize = v.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
            Failure::bad_input(format!(
                "--sweep workers={v}: expected a number of workers per node (1 or more)"
            ))
        })?;
        launch.workers_per_node = Some(n);
    }
    Ok(launch)
}

fn sets_for(c: &[(String, String)], args: &BenchJobArgs) -> Vec<String> {
    let mut sets = args.set.clone();
    sets.extend(
        c.iter()
            .filter(|(k, _)| k != WORKERS)
            .map(|(k, v)| format!("{k}={v}")),
    );
    // A job's curriculum would time its first, short steps: the bench
    // times whole sequences unless the bench's own settings name one.
    if !sets.iter().any(|s| s.starts_with("train.curriculum")) {
        sets.push("train.curriculum=null".into());
    }
    // Progressive layer dropping would skip blocks as θ falls: the bench
    // times every block unless its own settings name it.
    if !(sets.iter()).any(|s| s.starts_with("train.progressive_layer_drop")) {
        sets.push("train.progressive_layer_drop=null".into());
    }
    // The bench's own length, whatever the job's (`train.epochs` too).
    sets.push(format!("train.steps={}", args.steps));
    sets.push("train.epochs=null".into());
    sets.push("checkpoint.dir=null".into());
    // A profile of one of the bench's steps, or its comms log, would land
    // in the job's run directory (and a profile_step past the bench's
    // length is refused).
    sets.push("flops_profiler=null".into());
    sets.push("comms_logger=null".into());
    sets.push("checkpoint.every=0".into());
    sets
}

pub(crate) fn launch_flags(l: &crate::cli::LaunchArgs) -> Vec<String> {
    let mut v = Vec::new();
    let mut push = |k: &str, val: Option<String>| {
        if let Some(x) = val {
            v.push(k.to_string());
            v.push(x);
        }
    };
    push(
        "--hostfile",
        l.hostfile.as_ref().map(|p| p.display().to_string()),
    );
    push("--include", l.include.clone());
    push("--exclude", l.exclude.clone());
    push("--num-nodes", l.num_nodes.map(|n| n.to_string()));
    push(
        "--workers-per-node",
        l.workers_per_node.map(|n| n.to_string()),
    );
    push(
        "--worker-bin",
        l.worker_bin.as_ref().map(|p| p.display().to_string()),
    );
    push("--master-addr", l.master_addr.clone());
    // Each run ends before the next starts: a fixed port (a firewall's
    // opening) serves them all.
    push("--master-port", l.master_port.map(|p| p.to_string()));
    push(
        "--ssh-key",
        l.ssh_key.as_ref().map(|p| p.display().to_string()),
    );
    push(
        "--known-hosts",
        l.known_hosts.as_ref().map(|p| p.display().to_string()),
    );
    if let Some(launcher) = l.launcher {
        let name = match launcher {
            crate::cli::Launcher::Local => "local",
            crate::cli::Launcher::Ssh => "ssh",
            crate::cli::Launcher::Slurm => "slurm",
            crate::cli::Launcher::Mpirun => "mpirun",
        };
        v.push("--launcher".into());
        v.push(name.into());
    }
    if l.ssh_accept_new {
        v.push("--ssh-accept-new".into());
    }
    if l.ssh_port != 22 {
        v.push("--ssh-port".into());
        v.push(l.ssh_port.to_string());
    }
    if l.bind_cores_to_rank {
        v.push("--bind-cores-to-rank".into());
    }
    if let Some(list) = &l.bind_core_list {
        v.push("--bind-core-list".into());
        v.push(list.clone());
    }
    if let Some(a) = &l.launcher_args {
        v.push("--launcher-args".into());
        v.push(a.clone());
    }
    if let Some(dir) = &l.enable_each_rank_log {
        v.push("--enable-each-rank-log".into());
        v.push(dir.display().to_string());
    }
    v
}

fn print_table(rows: &[SweepRow]) {
    let val = rows.iter().any(|r| r.val_loss.is_some());
    say!(
        "{:<36} {:>12} {:>9} {:>6} {:>10} {:>14} {:>14} {:>14}{}",
        "configuration",
        "tokens/s",
        "TFLOP/s",
        "MFU",
        "step_ms",
        "peak RSS MiB",
        "intra B/step",
        "inter B/step",
        if val {
            format!(" {:>10}", "val loss")
        } else {
            String::new()
        }
    );
    for r in rows {
        let v = match (val, r.val_loss) {
            (true, Some(v)) => format!(" {v:>10.4}"),
            (true, None) => format!(" {:>10}", "-"),
            _ => String::new(),
        };
        say!(
            "{:<36} {:>12.0} {:>9.4} {:>6.2} {:>10.1} {:>14} {:>14} {:>14}{v}",
            r.label(),
            r.tokens_per_s,
            r.tflops,
            r.mfu,
            r.step_ms,
            r.peak_rss_bytes >> 20,
            r.intra_node_bytes,
            r.inter_node_bytes
        );
    }
}

fn write_outputs(out: &Path, rows: &[SweepRow]) -> Result<()> {
    let keys: Vec<String> = rows
        .first()
        .map(|r| r.config.iter().map(|(k, _)| k.clone()).collect())
        .unwrap_or_default();
    let mut csv = keys.join(",");
    csv.push_str(
        ",tokens_per_s,tflops,mfu,step_ms,peak_rss_bytes,intra_node_bytes,inter_node_bytes,val_loss\n",
    );
    for r in rows {
        let vals: Vec<String> = r.config.iter().map(|(_, v)| v.clone()).collect();
        csv.push_str(&format!(
            "{},{},{},{},{},{},{},{},{}\n",
            vals.join(","),
            r.tokens_per_s,
            r.tflops,
            r.mfu,
            r.step_ms,
            r.peak_rss_bytes,
            r.intra_node_bytes,
            r.inter_node_bytes,
            r.val_loss.map(|v| v.to_string()).unwrap_or_default()
        ));
    }
    std::fs::write(out.join("bench.csv"), csv)?;
    let json: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            let mut m = serde_json::Map::new();
            for (k, v) in &r.config {
                m.insert(k.clone(), serde_json::Value::String(v.clone()));
            }
            for (k, v) in [
                ("tokens_per_s", serde_json::json!(r.tokens_per_s)),
                ("tflops", serde_json::json!(r.tflops)),
                ("mfu", serde_json::json!(r.mfu)),
                ("step_ms", serde_json::json!(r.step_ms)),
                ("peak_rss_bytes", serde_json::json!(r.peak_rss_bytes)),
                ("intra_node_bytes", serde_json::json!(r.intra_node_bytes)),
                ("inter_node_bytes", serde_json::json!(r.inter_node_bytes)),
                ("val_loss", serde_json::json!(r.val_loss)),
            ] {
                m.insert(k.into(), v);
            }
            serde_json::Value::Object(m)
        })
        .collect();
    std::fs::write(
        out.join("bench.json"),
        serde_json::to_string_pretty(&serde_json::json!({ "rows": json }))?,
    )?;
    draw_svg(&out.join("bench.svg"), rows)
}

/// One bar chart: where, its title, one value per configuration, its colour.
type Panel<'a, 'b> = (
    &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    &'static str,
    Vec<f64>,
    RGBColor,
);

/// Three bar charts, one above the other: tokens/s, MFU and peak RSS per
/// configuration.
fn draw_svg(path: &PathBuf, rows: &[SweepRow]) -> Result<()> {
    let labels: Vec<String> = rows.iter().map(SweepRow::label).collect();
    let width = (160 * rows.len()).max(640) as u32;
    let root = SVGBackend::new(path, (width, 1080)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, rest) = root.split_vertically(360);
    let (middle, bottom) = rest.split_vertically(360);
    let panels: [Panel; 3] = [
        (
            &top,
            "tokens/s (whole job)",
            rows.iter().map(|r| r.tokens_per_s).collect(),
            BLUE,
        ),
        (
            &middle,
            "MFU (model FLOP/s over the host's GEMM peak)",
            rows.iter().map(|r| r.mfu).collect(),
            GREEN,
        ),
        (
            &bottom,
            "peak RSS per worker (MiB)",
            rows.iter()
                .map(|r| (r.peak_rss_bytes >> 20) as f64)
                .collect(),
            RED,
        ),
    ];
    for (area, title, values, color) in panels {
        let max = values.iter().cloned().fold(0.0, f64::max).max(1.0) * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d((0..rows.len()).into_segmented(), 0.0..max)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(rows.len())
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .draw()?;
        chart.draw_series(
            Histogram::vertical(&chart)
                .style(color.mix(0.7).filled())
                .margin(12)
                .data(values.iter().enumerate().map(|(i, v)| (i, *v))),
        )?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::LaunchArgs;

    fn parse(args: &[String]) -> LaunchArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            launch: LaunchArgs,
        }
        let argv = std::iter::once("zrun").chain(args.iter().map(String::as_str));
        <Cli as clap::Parser>::parse_from(argv).launch
    }

    /// A sweep's runs (and `zrun plan --verify`'s) get every launch option
    /// the command line had: each flag set, given back, parses to the same.
    #[test]
    fn every_launch_option_reaches_the_runs() {
        let all: Vec<String> = [
            "--hostfile=h",
            "--include=a:0",
            "--exclude=b",
            "--num-nodes=2",
            "--workers-per-node=3",
            "--launcher=mpirun",
            "--ssh-key=k",
            "--known-hosts=kh",
            "--ssh-accept-new",
            "--ssh-port=2222",
            "--master-addr=10.0.0.1",
            "--master-port=29501",
            "--worker-bin=w",
            "--bind-cores-to-rank",
            "--bind-core-list=0-3",
            "--enable-each-rank-log=logs",
            "--launcher-args=--mca btl tcp,self",
        ]
        .map(String::from)
        .to_vec();
        let given = parse(&all);
        let back = launch_flags(&given);
        assert_eq!(
            format!("{:?}", parse(&back)),
            format!("{given:?}"),
            "{back:?}"
        );
        // Nothing set: nothing passed.
        assert!(launch_flags(&parse(&[])).is_empty());
    }
}
