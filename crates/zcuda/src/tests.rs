//! Without a GPU: every kernel compiles with NVRTC (where libnvrtc is
//! loadable; `ZRUN_REQUIRE_NVRTC=1` makes it mandatory, as CI does), the cache
//! serves what it stored, and a host without a driver is told so. With a GPU
//! (`ZRUN_REQUIRE_GPU=1` makes them mandatory): each kernel against its CPU
//! oracle, bit for bit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use super::*;
use zquant::Bits;

/// Values made once per test process, by key ([`once`]).
type Memo<T> = OnceLock<Mutex<HashMap<String, Arc<OnceLock<T>>>>>;

/// `make()`'s value for `key`, made once per test process: the NVRTC,
/// ptxas and nvdisasm tests read the same PTX and machine code, and making
/// them (attention.cu's 33 kernels above all) is most of their time. A key
/// being made makes the others asking for it wait, not make it again.
fn once<T: Send + Sync + 'static>(
    memo: &'static Memo<T>,
    key: String,
    make: impl FnOnce() -> T,
) -> Arc<OnceLock<T>> {
    let cell = memo
        .get_or_init(Default::default)
        .lock()
        .unwrap()
        .entry(key)
        .or_default()
        .clone();
    cell.get_or_init(make);
    cell
}

/// NVRTC's output for `k` on `arch`, compiled without the cache, once.
fn ptx_of(k: &KernelSource, arch: &str) -> Arc<OnceLock<Compiled>> {
    static MEMO: Memo<Compiled> = OnceLock::new();
    once(&MEMO, format!("{} {arch}", k.name), || {
        compile_with(k, arch, None).unwrap_or_else(|e| panic!("{e}"))
    })
}

/// ptxas's machine code for `k` on `sm_<sm>` and its `--verbose` log
/// (registers and spills per function), assembled once.
fn cubin_of(
    k: &KernelSource,
    sm: &str,
    ptxas: &std::path::Path,
) -> Arc<OnceLock<(Vec<u8>, String)>> {
    static MEMO: Memo<(Vec<u8>, String)> = OnceLock::new();
    once(&MEMO, format!("{} {sm}", k.name), || {
        let ptx = ptx_of(k, &format!("compute_{sm}"));
        let dir = tempfile::tempdir().unwrap();
        let (src, cubin) = (dir.path().join("k.ptx"), dir.path().join("k.cubin"));
        std::fs::write(&src, &ptx.get().unwrap().ptx).unwrap();
        let out = std::process::Command::new(ptxas)
            .arg(format!("-arch=sm_{sm}"))
            .arg("--verbose")
            .arg(&src)
            .arg("-o")
            .arg(&cubin)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", ptxas.display()));
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "ptxas sm_{sm} {}: {log}", k.name);
        (std::fs::read(&cubin).unwrap(), log)
    })
}

/// NVRTC is here, or the test says it skipped (and fails under
/// `ZRUN_REQUIRE_NVRTC=1`).
fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc_present() {
        return true;
    }
    assert!(
        std::env::var("ZRUN_REQUIRE_NVRTC").as_deref() != Ok("1"),
        "ZRUN_REQUIRE_NVRTC=1 but libnvrtc is not loadable (LD_LIBRARY_PATH?)"
    );
    eprintln!("SKIPPED {test}: libnvrtc.so.12 is not loadable here (pip install nvidia-cuda-nvrtc-cu12 and add its lib/ to LD_LIBRARY_PATH)");
    false
}

/// GPU 0, or `None` after saying the test skipped (see [`gpu_or_skip`]).
fn gpu_for(test: &str) -> Option<Gpu> {
    gpu_or_skip(test, probe().usable_devices()).then(|| Gpu::open(0).expect("opening GPU 0"))
}

#[test]
fn out_of_memory_says_what_was_asked_and_what_the_gpu_had() {
    let e = CudaError::OutOfMemory {
        what: "allocating 3 floats on the GPU".into(),
        bytes: 12,
        free: 5 << 20,
        total: 80 << 30,
    };
    assert_eq!(
        e.to_string(),
        "allocating 3 floats on the GPU: the GPU is out of memory (1 MiB asked, 5 MiB free of 81920 MiB)"
    );
}

#[test]
fn every_kernel_compiles_to_ptx_for_volta_ampere_and_hopper() {
    if !nvrtc_or_skip("every_kernel_compiles_to_ptx") {
        return;
    }
    let nvrtc = crate::compile::nvrtc_version();
    let volta = nvrtc.split('.').next().and_then(|m| m.parse::<u32>().ok()) < Some(13);
    if !volta {
        eprintln!("compute_70 skipped: NVRTC {nvrtc} (CUDA 13 and later) has no Volta target");
    }
    let archs = ["compute_70", "compute_80", "compute_90"];
    for arch in &archs[usize::from(!volta)..] {
        for k in &KERNELS {
            let out = ptx_of(k, arch);
            let out = out.get().unwrap();
            let target = format!(".target sm_{}", arch.trim_start_matches("compute_"));
            assert!(
                out.ptx.contains(&target),
                "{} for {arch}: no `{target}`",
                k.name
            );
            for f in k.functions {
                assert!(
                    out.ptx.contains(&format!(".entry {f}(")),
                    "{} for {arch}: no entry `{f}`",
                    k.name
                );
            }
            // --fmad=false: no fused multiply-add, which the CPU kernels
            // these must equal never form.
            assert!(
                !k.same_bits_as_cpu
                    || !(out.ptx.contains("fma.rn.f32") || out.ptx.contains("fma.rn.f64")),
                "{} for {arch}: an FMA",
                k.name
            );
            if k.name == "adamw.cu" {
                // Correctly rounded division and square root, as on the CPU.
                for op in ["div.rn.f32", "sqrt.rn.f32"] {
                    assert!(out.ptx.contains(op), "adamw for {arch}: no {op}");
                }
            }
            assert_eq!(out.cache, CacheUse::Uncached);
        }
    }
}

/// NVIDIA's tool `name` (`ptxas`, `nvdisasm`): the path in `var`
/// (`ZRUN_PTXAS`, `ZRUN_NVDISASM`), else on PATH, or `None` after saying the
/// test skipped, which `ZRUN_REQUIRE_<NAME>=1` makes a failure. `wheel`: the
/// pip package that has it.
fn tool_or_skip(test: &str, name: &str, wheel: &str) -> Option<std::path::PathBuf> {
    let var = format!("ZRUN_{}", name.to_uppercase());
    let named = std::env::var_os(&var)
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from);
    let found = named.or_else(|| {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join(name))
                .find(|p| p.is_file())
        })
    });
    if found.is_none() {
        let require = format!("ZRUN_REQUIRE_{}", name.to_uppercase());
        assert!(
            std::env::var(&require).as_deref() != Ok("1"),
            "{require}=1 but no {name} ({var} or PATH)"
        );
        eprintln!(
            "SKIPPED {test}: no {name} (pip install {wheel} and set {var} to its bin/{name})"
        );
    }
    found
}

/// What NVRTC's PTX check leaves out, ptxas checks: inline assembly (the
/// tensor-core `mma.sync` of attention.cu, half16.cuh's conversions) and
/// register allocation, for the GPUs that run bf16 products. Prints each
/// function's registers and spills (attention.cu's are the ones to watch).
#[test]
fn every_kernel_assembles_with_ptxas_for_ampere_and_hopper() {
    if !nvrtc_or_skip("every_kernel_assembles_with_ptxas") {
        return;
    }
    let Some(ptxas) = tool_or_skip(
        "every_kernel_assembles_with_ptxas",
        "ptxas",
        "nvidia-cuda-nvcc-cu12",
    ) else {
        return;
    };
    for sm in ["80", "90"] {
        for k in &KERNELS {
            let ptx = ptx_of(k, &format!("compute_{sm}"));
            let ptx = &ptx.get().unwrap().ptx;
            if k.name == "attention.cu" {
                for form in [
                    "m16n8k16.row.col.f32.bf16.bf16.f32",
                    "m16n8k16.row.col.f32.f16.f16.f32",
                    "m16n8k8.row.col.f32.tf32.tf32.f32",
                ] {
                    assert!(
                        ptx.contains(&format!("mma.sync.aligned.{form}")),
                        "attention.cu for sm_{sm}: no mma {form}"
                    );
                }
            }
            // Assembled (ptxas fails the test on an error) with its log.
            let cubin = cubin_of(k, sm, &ptxas);
            let log = &cubin.get().unwrap().1;
            if k.name == "attention.cu" {
                let shown = ["entry function", "registers", "spill"];
                for line in log.lines().filter(|l| shown.iter().any(|w| l.contains(w))) {
                    eprintln!("sm_{sm} attention.cu: {}", line.trim());
                }
            }
        }
    }
}

/// attention.cu's 66 fused kernels (33 without dropout, 33 with) as machine code (NVRTC's PTX,
/// ptxas, then nvdisasm; no GPU needed): (name, its lines), or `None` where
/// a tool is missing (the skip printed).
fn attention_sass(test: &str, sm: &str) -> Option<Vec<(String, Vec<String>)>> {
    if !nvrtc_or_skip(test) {
        return None;
    }
    let ptxas = tool_or_skip(test, "ptxas", "nvidia-cuda-nvcc-cu12")?;
    let nvdisasm = tool_or_skip(test, "nvdisasm", "nvidia-cuda-nvdisasm")?;
    static MEMO: Memo<String> = OnceLock::new();
    let k = crate::compile::kernel("attention.cu").unwrap();
    let sass = once(&MEMO, format!("attention.cu sm_{sm}"), || {
        let dir = tempfile::tempdir().unwrap();
        let cubin = dir.path().join("a.cubin");
        std::fs::write(&cubin, &cubin_of(k, sm, &ptxas).get().unwrap().0).unwrap();
        let out = std::process::Command::new(&nvdisasm)
            .arg("-c")
            .arg(&cubin)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{}: {err}", nvdisasm.display());
        String::from_utf8_lossy(&out.stdout).into_owned()
    });
    let sass = sass.get().unwrap();
    let flash: Vec<_> = k
        .functions
        .iter()
        .filter(|f| f.starts_with("flash_"))
        .map(|f| {
            let body = sass
                .split(&format!(".text.{f},"))
                .nth(1)
                .unwrap_or_else(|| panic!("{f} not in nvdisasm's output"));
            let body = body.split(".section\t.text.").next().unwrap();
            (f.to_string(), body.lines().map(String::from).collect())
        })
        .collect();
    assert_eq!(
        flash.len(),
        66,
        "three kernels, three kinds, three widths, and 128 for two kinds; \
         each without dropout and with it"
    );
    Some(flash)
}

/// The head width and the product depth (16 bf16 and f16, 8 TF32) of a
/// fused kernel, from its name.
fn width_and_depth(name: &str) -> (usize, usize) {
    let hd = name.rsplit('_').next().unwrap().parse().unwrap();
    (hd, if name.contains("_tf32_") { 8 } else { 16 })
}

/// attention.cu's `FaWalk` and `FaFetch`: the keys of a tile the fused
/// kernel `name` walks, and the parts its fetch is split into.
fn walk(name: &str) -> (usize, usize) {
    let (hd, _) = width_and_depth(name);
    let keys = match (hd <= 64, name.contains("_kv_")) {
        (true, _) => 64,
        (false, false) => 32,
        (false, true) => 16,
    };
    let parts = if hd > 64 && keys * hd / 4 / 128 > 4 {
        2
    } else {
        1
    };
    (keys, parts)
}

/// The fused attention's tile loads in machine code: each kernel's first
/// tile fetch issues the thread's whole share of both tiles as 16-byte
/// loads (`LDG.E.128`, HD / 8 a tile) before its barrier. Sitting 11 on an
/// H100 found the first version slower than the unfused path: its fetch
/// stayed a loop of two 4-byte loads, a wait and a store, one trip to
/// memory a piece.
#[test]
fn attention_fetches_each_tile_in_one_trip() {
    let Some(flash) = attention_sass("attention_fetches_each_tile_in_one_trip", "90") else {
        return;
    };
    for (f, body) in flash {
        let fetched = body
            .iter()
            .skip_while(|l| !l.contains("LDG.E.128"))
            .take_while(|l| !l.contains("BAR.SYNC"))
            .filter(|l| l.contains("LDG.E.128"))
            .count();
        let (hd, _) = width_and_depth(&f);
        // Two tiles' part: rows × hd floats over 128 threads, 4 a load.
        let (keys, parts) = walk(&f);
        let want = 2 * keys * hd / 4 / 128 / parts;
        assert!(
            fetched >= want,
            "{f}: {fetched} 16-byte loads before the first barrier, want {want}"
        );
    }
}

/// The loops of a kernel's machine code, innermost only: (first line,
/// last line) of each range from a label to a branch back to it that holds
/// no other such range.
fn innermost_loops(body: &[String]) -> Vec<(usize, usize)> {
    let label = |l: &str| {
        let l = l.trim();
        (l.starts_with(".L_x_") && l.ends_with(':')).then(|| l.trim_end_matches(':').to_string())
    };
    let at: std::collections::HashMap<String, usize> = body
        .iter()
        .enumerate()
        .filter_map(|(i, l)| label(l).map(|name| (name, i)))
        .collect();
    let loops: Vec<(usize, usize)> = body
        .iter()
        .enumerate()
        .filter_map(|(i, l)| {
            let target = l.split("BRA `(").nth(1)?.split(')').next()?;
            at.get(target)
                .filter(|&&start| start < i)
                .map(|&start| (start, i))
        })
        .collect();
    loops
        .iter()
        .copied()
        .filter(|&(a, b)| {
            !loops
                .iter()
                .any(|&(c, d)| (c, d) != (a, b) && a <= c && d <= b)
        })
        .collect()
}

/// The fused kernels' tile walk in machine code: the one innermost loop
/// that multiplies holds every product of a tile step, unrolled (the
/// forward's scores and its P·V; the query kernel's two scores and dS·K;
/// the key/value kernel's two scores, Pᵀ·dO and dSᵀ·Q; keys·HD / 8 / depth
/// `HMMA`s a product of either kind, for tiles of `keys` rows (`walk`): HD
/// / depth steps of keys / 8 column groups for scores, keys / depth steps
/// of HD / 8 for a product by a tile), and no
/// local memory (`LDL`/`STL`, one bounded exception below:
/// spilled registers) inside it: a spill there would cost a trip to memory
/// every step. Fails if a change leaves a product in a loop of its own or
/// pushes the walk's registers past 255.
#[test]
fn attention_tile_walk_is_unrolled_and_keeps_off_local_memory() {
    for sm in ["80", "90"] {
        let Some(flash) = attention_sass("attention_tile_walk_is_unrolled", sm) else {
            return;
        };
        tile_walk_is_unrolled_and_local_free(sm, flash);
    }
}

/// One architecture's tile walks: on sm_90 exactly one innermost loop
/// multiplies, holding every product of a step; on sm_80 ptxas may split
/// a walk into several loops (it did for the forward at width 16), so
/// there each innermost loop that multiplies is only checked for local
/// memory.
fn tile_walk_is_unrolled_and_local_free(sm: &str, flash: Vec<(String, Vec<String>)>) {
    for (f, body) in flash {
        let hmma =
            |(a, b): (usize, usize)| body[a..=b].iter().filter(|l| l.contains("HMMA")).count();
        let walks: Vec<_> = innermost_loops(&body)
            .into_iter()
            .filter(|&r| hmma(r) > 0)
            .collect();
        assert!(!walks.is_empty(), "sm_{sm} {f}: no loop multiplies");
        if sm == "90" {
            assert_eq!(
                walks.len(),
                1,
                "sm_{sm} {f}: {} innermost loops multiply",
                walks.len()
            );
            let (hd, depth) = width_and_depth(&f);
            let products = match f.split('_').nth(2) {
                Some("kv") => 4,
                Some("q") => 3,
                _ => 2, // flash_forward_...
            };
            let per_product = hd * walk(&f).0 / 8 / depth;
            assert_eq!(
                hmma(walks[0]),
                products * per_product,
                "sm_{sm} {f}: mma instructions in the tile walk"
            );
        }
        // One known exception, bounded: on sm_80 the TF32 key/value kernel
        // at width 64 refills four words a step (no stores). A walk that
        // keeps off them there (one flattened loop over heads and tiles)
        // made the 16-bit key/value kernels 1.23x slower on an H200
        // (sitting 18), and what four L1 hits a step cost an A100 is
        // untimed.
        // The dropout kernels' key/value walks (opt-in, not yet timed:
        // `ZRUN_GPU_ATTENTION=fused` with `model.attention_dropout`) hash
        // each probability's index beside two accumulators: at width 128
        // and TF32's 64 they refill up to 7 words a step (sm_80 TF32 64:
        // 7; width 128: 1-2), none stored.
        let refills_allowed = if sm == "80" && f == "flash_backward_kv_tf32_64" {
            4
        } else if f.starts_with("flash_backward_kv_dropout_") {
            8
        } else {
            0
        };
        for (a, b) in walks {
            let local: Vec<_> = body[a..=b]
                .iter()
                .filter(|l| l.contains("LDL") || l.contains("STL"))
                .collect();
            let refills_only = local.iter().all(|l| l.contains("LDL"));
            assert!(
                local.len() <= refills_allowed && (local.is_empty() || refills_only),
                "sm_{sm} {f}: local memory in the tile walk: {local:?}"
            );
        }
    }
}

#[test]
fn a_kernel_that_does_not_compile_names_its_file_and_line() {
    if !nvrtc_or_skip("a_kernel_that_does_not_compile") {
        return;
    }
    let bad = KernelSource {
        name: "broken.cu",
        code: "extern \"C\" __global__ void k(float* x) {\n  x[0] = undeclared;\n}\n",
        functions: &["k"],
        same_bits_as_cpu: true,
    };
    let err = compile_with(&bad, "compute_80", None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("kernel broken.cu"), "{err}");
    assert!(err.contains("broken.cu(2)"), "no line in: {err}");
    assert!(err.contains("undeclared"), "{err}");
}

#[test]
fn the_cache_serves_what_it_stored_and_a_changed_kernel_misses() {
    if !nvrtc_or_skip("the_cache_serves_what_it_stored") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let k = kernel("reduce.cu").unwrap();
    let first = compile_with(k, "compute_80", Some(dir.path())).unwrap();
    assert_eq!(first.cache, CacheUse::Stored);
    let second = compile_with(k, "compute_80", Some(dir.path())).unwrap();
    assert_eq!(second.cache, CacheUse::Hit);
    assert_eq!(first.ptx, second.ptx);
    // Another architecture, and another source, are other entries.
    let other = compile_with(k, "compute_90", Some(dir.path())).unwrap();
    assert_eq!(other.cache, CacheUse::Stored);
    let code = format!("{}\n// changed\n", k.code);
    let changed = KernelSource {
        code: Box::leak(code.into_boxed_str()),
        ..*k
    };
    assert_eq!(
        compile_with(&changed, "compute_80", Some(dir.path()))
            .unwrap()
            .cache,
        CacheUse::Stored
    );
    let entries: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(entries.len(), 3, "one file per entry, no temporary left");
}

#[test]
fn a_bad_architecture_is_refused_before_nvrtc() {
    if !nvrtc_or_skip("a_bad_architecture_is_refused") {
        return;
    }
    let err = compile_with(&KERNELS[0], "sm_90; rm -rf", None).unwrap_err();
    assert!(
        err.to_string()
            .contains("not an NVRTC virtual architecture"),
        "{err}"
    );
}

#[test]
fn a_host_without_a_gpu_is_told_what_is_missing() {
    let p = probe();
    match (&p.devices, driver_present()) {
        (Err(why), false) => {
            assert!(why.contains("libcuda.so"), "{why}");
            let err = Gpu::open(0).err().expect("no GPU, yet it opened");
            assert!(err.to_string().contains("no CUDA driver"), "{err}");
        }
        (Err(why), true) => {
            // A driver without a GPU (a container with the library mounted).
            assert!(Gpu::open(0).is_err(), "{why}");
        }
        (Ok(n), _) => {
            assert!(*n > 0);
            eprintln!("this host has {n} GPU(s): the missing-driver path is not reachable here");
        }
    }
}

/// Values that exercise the quantizer's corners: zeros, subnormals, ties,
/// huge values, a block of zeros, an odd tail.
fn quant_inputs(n: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n)
        .map(|i| {
            let t = (i as f32 * 0.618_034).fract() - 0.5;
            t * (1.0 + (i % 7) as f32 * 10.0)
        })
        .collect();
    for (i, v) in [1e-40f32, -3e-39, 0.0, 3.4e38, -3.4e38, 0.5, -0.5]
        .into_iter()
        .enumerate()
    {
        x[(i * 97) % n] = v;
    }
    let zeros = 256.min(n / 4);
    x[n / 2..n / 2 + zeros].fill(0.0);
    x
}

#[test]
fn gpu_quantize_and_dequantize_equal_the_cpu_bit_for_bit() {
    let Some(gpu) = gpu_for("gpu_quantize_and_dequantize") else {
        return;
    };
    for bits in [Bits::Int8, Bits::Int4] {
        for (n, block) in [(10_001, 256), (4096, 2), (777, 2048), (65_536, 64)] {
            let x = quant_inputs(n);
            let cpu = zquant::quantize(&x, bits, block).unwrap();
            let dx = gpu.upload(&x).unwrap();
            let q = gpu.quantize(&dx, bits, block).unwrap();
            let got = q.to_host(&gpu).unwrap();
            assert_eq!(
                got.scales, cpu.scales,
                "{bits:?} n={n} block={block}: scales"
            );
            assert_eq!(got.data, cpu.data, "{bits:?} n={n} block={block}: codes");
            let mut back = gpu.zeros::<f32>(n).unwrap();
            gpu.dequantize(&q, &mut back).unwrap();
            let mut want = vec![0.0; n];
            zquant::dequantize(&cpu, &mut want);
            let got: Vec<u32> = gpu
                .download(&back)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{bits:?} n={n} block={block}: dequantized");
        }
    }
}

#[test]
fn gpu_quantize_refuses_a_non_finite_value_naming_the_first() {
    let Some(gpu) = gpu_for("gpu_quantize_refuses_a_non_finite_value") else {
        return;
    };
    let mut x = quant_inputs(5000);
    x[4321] = f32::INFINITY;
    x[1234] = f32::NAN;
    let err = gpu
        .quantize(&gpu.upload(&x).unwrap(), Bits::Int8, 256)
        .unwrap_err();
    match err {
        CudaError::Quant(zquant::QuantError::NonFinite { index, value }) => {
            assert_eq!(index, 1234);
            assert!(value.is_nan());
        }
        e => panic!("{e}"),
    }
}

#[test]
fn gpu_add_equals_the_cpu_sum() {
    let Some(gpu) = gpu_for("gpu_add_equals_the_cpu_sum") else {
        return;
    };
    let a = quant_inputs(100_003);
    let b: Vec<f32> = a.iter().rev().map(|v| v * 0.3).collect();
    let mut acc = gpu.upload(&a).unwrap();
    gpu.add(&mut acc.slice_mut(..), &gpu.upload(&b).unwrap().slice(..))
        .unwrap();
    let got = gpu.download(&acc).unwrap();
    for (i, ((g, x), y)) in got.iter().zip(&a).zip(&b).enumerate() {
        assert_eq!(g.to_bits(), (x + y).to_bits(), "element {i}");
    }
}

#[test]
fn a_copy_to_pinned_memory_is_waited_for_before_it_is_read() {
    let Some(gpu) = gpu_for("a_copy_to_pinned_memory_is_waited_for") else {
        return;
    };
    // Large enough that the copy is still in flight when `values` is called,
    // queued behind a kernel that rewrites every value first.
    let n = 1 << 24;
    let x: Vec<f32> = (0..n).map(|i| (i % 1013) as f32).collect();
    let mut d = gpu.upload(&x).unwrap();
    let mut pinned = gpu.pinned(n).unwrap();
    for round in 0..3 {
        gpu.scale(&mut d.slice_mut(..), 2.0).unwrap();
        gpu.copy_to_pinned(&d, &mut pinned).unwrap();
        let got = pinned.values().unwrap();
        let k = 2f32.powi(round + 1);
        assert!(
            got.iter().zip(&x).all(|(g, v)| *g == v * k),
            "round {round}: read before the copy landed"
        );
    }
}

/// Uploads ahead of use ([`Gpu::upload_ahead`], on a stream of their own):
/// a kernel on the compute stream reads what was uploaded, not what was
/// there before, and a staging buffer refilled three times over, while the
/// compute stream is busy with a kernel queued first, hands each round its
/// own values (a refill before the last copy had run would mix rounds).
#[test]
fn an_upload_ahead_is_read_after_it_lands_and_its_staging_refilled_after_the_copy() {
    let Some(gpu) = gpu_for("an_upload_ahead_is_read_after_it_lands") else {
        return;
    };
    let n = 1 << 22;
    let mut busy = gpu.upload(&vec![1.0f32; 1 << 24]).unwrap();
    let mut staging = crate::Staging::default();
    let mut uploaded = Vec::new();
    for round in 0..3u32 {
        gpu.scale(&mut busy.slice_mut(..), 1.5).unwrap();
        let a: Vec<f32> = (0..n).map(|i| (i % 977 + round as usize) as f32).collect();
        let b: Vec<f32> = (0..n / 3)
            .map(|i| -((i % 31) as f32) - round as f32)
            .collect();
        let parts = gpu.upload_ahead(&[&a, &b], &mut staging).unwrap();
        uploaded.push((parts, a, b));
    }
    for (round, (parts, a, b)) in uploaded.iter_mut().enumerate() {
        // A kernel on the compute stream reads the upload in place.
        gpu.scale(&mut parts[0].slice_mut(..), 2.0).unwrap();
        let got = gpu.download(&parts[0]).unwrap();
        assert!(
            got.iter().zip(a.iter()).all(|(g, v)| *g == 2.0 * v),
            "round {round}: the first part"
        );
        assert_eq!(
            gpu.download(&parts[1]).unwrap(),
            *b,
            "round {round}: the second part"
        );
    }
}
