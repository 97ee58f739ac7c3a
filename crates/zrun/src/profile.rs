//! `flops_profiler`: rank 0's module-by-module account of one step
//! (`zproto::FlopsProfile`) as DeepSpeed's profiler prints it: a summary of
//! the step, the modules that take the most parameters, FLOPs and time at
//! each depth (summed over the blocks), and a table of every module. The
//! table goes to a file, the summary to the console too.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Result;
use zconfig::spec::FlopsProfilerSpec;
use zproto::{FlopsProfile, ModuleProfile};

/// A module's time in the step: forward, backward and the forward
/// recomputed in backward (the model's: its forward and backward phases,
/// which hold the recomputation already).
fn time_ms(m: &ModuleProfile) -> f64 {
    match m.depth() {
        0 => m.forward_ms + m.backward_ms,
        _ => m.forward_ms + m.backward_ms + m.recompute_ms,
    }
}

fn flops(m: &ModuleProfile) -> f64 {
    m.forward_flops + m.backward_flops
}

/// `h.3.mlp.c_fc` → `h.*.mlp.c_fc`: the same module of every block.
fn kind(path: &str) -> String {
    let mut parts: Vec<&str> = path.split('.').collect();
    if parts.len() >= 2 && parts[1].parse::<usize>().is_ok() {
        parts[1] = "*";
    }
    parts.join(".")
}

/// `x` with an SI prefix and three significant digits: `24.2 M`, `1.23 T`.
fn si(x: f64) -> String {
    let (scaled, prefix) = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]
        .into_iter()
        .find(|&(unit, _)| x >= unit)
        .map_or((x, ""), |(unit, p)| (x / unit, p));
    let digits = match scaled {
        s if s >= 100.0 => 0,
        s if s >= 10.0 => 1,
        _ => 2,
    };
    match (x, prefix) {
        (0.0, _) => "0".into(),
        (_, "") => format!("{x:.0}"),
        _ => format!("{scaled:.digits$} {prefix}"),
    }
}

/// FLOPs over milliseconds, in FLOP/s ("-" without time or FLOPs).
fn rate(flops: f64, ms: f64) -> String {
    match ms > 0.0 && flops > 0.0 {
        true => si(flops / ms * 1e3),
        false => "-".into(),
    }
}

/// The summary: the step's phases and rates, then the top modules.
pub fn summary(p: &FlopsProfile, spec: &FlopsProfilerSpec) -> String {
    let mut out = String::new();
    let model = &p.modules[0];
    let t = &p.times;
    let tokens = p.micro_batches * p.micro_batch * p.seq_len;
    let w = &mut out;
    let _ = writeln!(
        w,
        "flops profile of step {}, rank {} of {} (ZeRO stage {}): {} micro-batch(es) × {} sequences × {} tokens = {tokens} tokens",
        p.step, p.rank, p.world_size, p.zero_stage, p.micro_batches, p.micro_batch, p.seq_len
    );
    let _ = writeln!(w, "  params                 {}", si(model.params as f64));
    let _ = writeln!(
        w,
        "  forward                {:>9.1} ms  {:>9}FLOP  {:>9}FLOP/s",
        t.forward,
        si(model.forward_flops),
        rate(model.forward_flops, t.forward)
    );
    let _ = writeln!(
        w,
        "  backward               {:>9.1} ms  {:>9}FLOP  {:>9}FLOP/s  (the head's forward, fused with its backward, included; {:.1} ms recomputing checkpointed blocks)",
        t.backward,
        si(model.backward_flops),
        rate(model.backward_flops, t.backward),
        model.recompute_ms
    );
    let _ = writeln!(w, "  optimizer step         {:>9.1} ms", t.optimizer);
    let _ = writeln!(w, "  other (batches)        {:>9.1} ms", t.other);
    let _ = writeln!(
        w,
        "  step                   {:>9.1} ms  {:>9}FLOP  {:>9}FLOP/s  ({:.1} ms of it blocked on collectives)",
        p.step_ms,
        si(flops(model)),
        rate(flops(model), p.step_ms),
        t.comm_wait
    );
    let outside = time_ms(model)
        - p.modules
            .iter()
            .filter(|m| m.depth() == 1)
            .map(time_ms)
            .sum::<f64>();
    let _ = writeln!(
        w,
        "  forward and backward outside the modules (stage-3 gathers waited for, buckets handed to reductions): {:.1} ms",
        outside.max(0.0)
    );

    let _ = writeln!(
        w,
        "top modules at each depth (a block's modules summed over the blocks):"
    );
    let deepest = p
        .modules
        .iter()
        .map(ModuleProfile::depth)
        .max()
        .unwrap_or(0);
    for depth in 1..=deepest {
        let mut kinds: BTreeMap<String, (u64, f64, f64)> = BTreeMap::new();
        for m in p.modules.iter().filter(|m| m.depth() == depth) {
            let k = kinds.entry(kind(&m.path)).or_default();
            k.0 += m.params;
            k.1 += flops(m);
            k.2 += time_ms(m);
        }
        let top = |key: &dyn Fn(&(u64, f64, f64)) -> f64,
                   show: &dyn Fn(&(u64, f64, f64)) -> String| {
            let mut v: Vec<_> = kinds.iter().collect();
            v.sort_by(|a, b| key(b.1).total_cmp(&key(a.1)).then(a.0.cmp(b.0)));
            v.iter()
                .take(spec.top_modules)
                .map(|(name, k)| format!("{name} {}", show(k)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let whole = time_ms(model).max(f64::MIN_POSITIVE);
        let _ = writeln!(w, "  depth {depth}:");
        let _ = writeln!(
            w,
            "    params  {}",
            top(&|k| k.0 as f64, &|k| si(k.0 as f64))
        );
        let _ = writeln!(w, "    FLOPs   {}", top(&|k| k.1, &|k| si(k.1)));
        let _ = writeln!(
            w,
            "    time    {}",
            top(&|k| k.2, &|k| format!(
                "{:.1} ms ({:.1}%)",
                k.2,
                100.0 * k.2 / whole
            ))
        );
    }
    out
}

/// The table of every module to `module_depth`, each under its parent.
pub fn table(p: &FlopsProfile, spec: &FlopsProfilerSpec) -> String {
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(
        w,
        "every module (its micro-batches' forward and backward; FLOP/s: the module's model FLOPs over its time; share: of the forward and backward phases):"
    );
    let _ = writeln!(
        w,
        "{:<44} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "module", "params", "FLOPs", "fwd ms", "bwd ms", "recomp ms", "FLOP/s", "share"
    );
    let whole = time_ms(&p.modules[0]).max(f64::MIN_POSITIVE);
    for m in &p.modules {
        let depth = m.depth();
        if spec.module_depth >= 0 && depth as i64 > spec.module_depth {
            continue;
        }
        let name = format!("{}{}", "  ".repeat(depth), m.path);
        let _ = writeln!(
            w,
            "{name:<44} {:>9} {:>9} {:>9.2} {:>9.2} {:>9.2} {:>9} {:>6.1}%",
            si(m.params as f64),
            si(flops(m)),
            m.forward_ms,
            m.backward_ms,
            m.recompute_ms,
            rate(flops(m), time_ms(m)),
            100.0 * time_ms(m) / whole
        );
    }
    out
}

/// Where the profile goes: `output_file`, or `flops_profile.txt` in the run
/// directory.
pub fn path(spec: &FlopsProfilerSpec, run_dir: &Path) -> PathBuf {
    match &spec.output_file {
        Some(f) => PathBuf::from(f),
        None => run_dir.join("flops_profile.txt"),
    }
}

/// Writes the summary and the table (`detailed`) to `path`, keeping a file
/// already there as the lowest free `STEM.N.EXT` (as metrics files are).
pub fn write(p: &FlopsProfile, spec: &FlopsProfilerSpec, path: &Path) -> Result<()> {
    let mut text = summary(p, spec);
    if spec.detailed {
        text.push('\n');
        text.push_str(&table(p, spec));
    }
    crate::rundir::write_whole(path, &text, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use zproto::StepTimesMs;

    fn module(path: &str, params: u64, flops: f64, ms: f64) -> ModuleProfile {
        ModuleProfile {
            path: path.into(),
            params,
            forward_flops: flops / 3.0,
            backward_flops: 2.0 * flops / 3.0,
            forward_ms: ms / 3.0,
            backward_ms: 2.0 * ms / 3.0,
            recompute_ms: 0.0,
        }
    }

    fn profile() -> FlopsProfile {
        FlopsProfile {
            step: 2,
            rank: 0,
            world_size: 1,
            zero_stage: 0,
            micro_batches: 1,
            micro_batch: 4,
            seq_len: 8,
            times: StepTimesMs {
                forward: 10.0,
                backward: 20.0,
                ..StepTimesMs::default()
            },
            step_ms: 31.0,
            modules: vec![
                module("model", 300, 3e9, 30.0),
                module("embedding", 100, 0.0, 1.0),
                module("h.0", 90, 1.4e9, 13.0),
                module("h.0.ln_1", 10, 1e6, 1.0),
                module("h.0.mlp", 80, 1.2e9, 12.0),
                module("h.1", 90, 1.4e9, 14.0),
                module("h.1.ln_1", 10, 1e6, 1.5),
                module("h.1.mlp", 80, 1.2e9, 12.5),
                module("head", 20, 0.2e9, 1.5),
            ],
        }
    }

    /// The summary sums a block's modules over the blocks and names
    /// `top_modules` of them, the largest first; the table lists the
    /// modules to `module_depth`.
    #[test]
    fn the_summary_ranks_modules_over_the_blocks_and_the_table_stops_at_the_depth() {
        let p = profile();
        let mut spec = FlopsProfilerSpec {
            top_modules: 2,
            ..FlopsProfilerSpec::default()
        };
        let s = summary(&p, &spec);
        assert!(s.contains("params  h.* 180, embedding 100\n"), "{s}");
        assert!(
            s.contains("time    h.* 27.0 ms (90.0%), head 1.5 ms (5.0%)\n"),
            "{s}"
        );
        assert!(
            s.contains("time    h.*.mlp 24.5 ms (81.7%), h.*.ln_1 2.5 ms (8.3%)\n"),
            "{s}"
        );
        // 30 ms of forward and backward, 29.5 of them in the modules.
        assert!(s.contains("outside the modules (stage-3 gathers waited for, buckets handed to reductions): 0.5 ms"), "{s}");
        spec.top_modules = 1;
        assert!(summary(&p, &spec).contains("params  h.* 180\n"));
        let rows = |t: &str| -> Vec<String> {
            t.lines()
                .skip(2)
                .filter_map(|l| l.split_whitespace().next().map(String::from))
                .collect()
        };
        assert_eq!(rows(&table(&p, &spec)).len(), 9);
        spec.module_depth = 1;
        assert_eq!(
            rows(&table(&p, &spec)),
            ["model", "embedding", "h.0", "h.1", "head"]
        );
        assert_eq!(si(1.234e9), "1.23 G");
        assert_eq!(si(24_200_000.0), "24.2 M");
        assert_eq!(si(768.0), "768");
    }

    /// `detailed: false` writes the summary alone; a second profile keeps
    /// the first as `flops_profile.1.txt`.
    #[test]
    fn a_profile_file_never_replaces_an_earlier_one() {
        let dir = tempfile::tempdir().unwrap();
        let spec = FlopsProfilerSpec::default();
        let at = path(&spec, &dir.path().join("run"));
        write(&profile(), &spec, &at).unwrap();
        let first = std::fs::read_to_string(&at).unwrap();
        assert!(first.contains("every module"), "{first}");
        let brief = FlopsProfilerSpec {
            detailed: false,
            ..spec
        };
        write(&profile(), &brief, &at).unwrap();
        let second = std::fs::read_to_string(&at).unwrap();
        assert!(!second.contains("every module") && second.contains("top modules"));
        let kept = dir.path().join("run/flops_profile.1.txt");
        assert_eq!(std::fs::read_to_string(kept).unwrap(), first);
    }
}
