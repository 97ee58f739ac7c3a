//! `zrun bench kernels`: the CPU kernels zrun relies on, against this machine's
//! memory bandwidth measured in the same run.
//!
//! The yardstick is the STREAM triad `a = b + s·c` (12 bytes per element) at the
//! same thread count. Streaming kernels report the bytes they must read and write
//! per second and their ratio to the triad: AdamW moves 28 bytes per element
//! (p, g, m, v in; p, m, v out), the reduction `dst += src` 12. A ratio near 1
//! means the kernel runs at the memory's speed, the bound for such kernels. The
//! GEMM row (zgemm at 2048³ on all cores, what the model's linear layers run)
//! gives the FLOP/s peak that MFU is computed against; the rows after it time
//! the model's own GEMM shapes with each zgemm kernel and with the `gemm` crate
//! (candle's matmul) at 1 thread and all cores, each with its ratio to the
//! `fma_peak` row at its thread count: the cores doing nothing but fused
//! multiply-adds on zgemm's vectors, the ceiling no product passes. ZeRO++'s quantization kernels move 4
//! bytes a value one way and their code (1 byte, or half) plus block scales the
//! other. Generation's one-row products read each weight once: 4 bytes a
//! value in f32, 2 for weights kept in bf16. Each figure is the best of
//! several runs.

use std::time::Instant;

use anyhow::Result;
use zengine::adam::{adamw_with, AdamStep, Buffers, Grads, OptimizerKind, Path};
use zengine::precision::Half;
use zproto::KernelRow;

/// LAMB's two passes ([`zengine::adam::lamb`]) as the engine runs them:
/// the first over cells of `NORM_CELL` elements (its unit on threads), the
/// ratio, the second. 40 bytes an element in all: p, g, m, v in and m, v out,
/// then p, m, v in and p out (mixed precision likewise: a 2-byte gradient
/// in, a 2-byte working copy out); about 24 flops.
#[allow(clippy::too_many_arguments)]
fn lamb_rows(
    p: &mut [f32],
    g: &[f32],
    g16: &[u16],
    m: &mut [f32],
    v: &mut [f32],
    w16: &mut [u16],
    hp: &AdamStep,
    threads: usize,
    triad_gbps: f64,
) -> Vec<KernelRow> {
    use zengine::adam::{lamb_apply_with, lamb_moments_with, trust_ratio, SquareSums};
    use zengine::flat::NORM_CELL;
    let hp = AdamStep {
        rule: OptimizerKind::Lamb,
        ..*hp
    };
    let n = p.len();
    let mut rows = Vec::new();
    for path in Path::available() {
        for mixed in [false, true] {
            let mut sums = vec![SquareSums::default(); n.div_ceil(NORM_CELL)];
            let s = best_secs(5, || {
                let mut segments = Vec::new();
                let mut rest = lamb_buffers(mixed, p, (g, g16), m, v, w16);
                for (k, sums) in sums.iter_mut().enumerate() {
                    let (seg, tail) = rest.split_at(NORM_CELL.min(n - k * NORM_CELL));
                    segments.push((seg, true, k * NORM_CELL, sums));
                    rest = tail;
                }
                lamb_moments_with(path, threads, segments, &hp);
                let [w2, u2] = sums
                    .iter()
                    .map(SquareSums::totals)
                    .fold([0.0; 2], |[a, b], [x, y]| [a + x, b + y]);
                let ratio = trust_ratio(w2, u2, [0.01, 10.0]);
                let b = lamb_buffers(mixed, p, (g, g16), m, v, w16);
                lamb_apply_with(path, threads, vec![(b, (true, ratio))], &hp);
            });
            let gbps = 40.0 * n as f64 / s / 1e9;
            rows.push(KernelRow {
                kernel: format!(
                    "lamb_{}{}",
                    path_name(path),
                    if mixed { "_bf16" } else { "" }
                ),
                elements: n,
                threads,
                gbps,
                gflops: 24.0 * n as f64 / s / 1e9,
                ratio: gbps / triad_gbps,
            });
        }
    }
    rows
}

/// f32 buffers, or (`mixed`) bf16 gradients and working copy.
fn lamb_buffers<'a>(
    mixed: bool,
    p: &'a mut [f32],
    (g, g16): (&'a [f32], &'a [u16]),
    m: &'a mut [f32],
    v: &'a mut [f32],
    w16: &'a mut [u16],
) -> Buffers<'a> {
    match mixed {
        true => Buffers {
            p,
            g: Grads::Half(Half::Bf16, g16),
            m,
            v,
            working: Some((Half::Bf16, w16)),
        },
        false => Buffers::f32(p, g, m, v),
    }
}

fn path_name(path: Path) -> &'static str {
    match path {
        Path::Avx512 => "avx512",
        Path::Avx2 => "avx2",
        Path::Portable => "portable",
    }
}

fn best_secs(reps: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm up: page in, fill caches
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn triad(a: &mut [f32], b: &[f32], c: &[f32], threads: usize) {
    let s = 3.0f32;
    let kernel = |a: &mut [f32], b: &[f32], c: &[f32]| {
        for i in 0..a.len() {
            a[i] = b[i] + s * c[i];
        }
    };
    if threads <= 1 {
        return kernel(a, b, c);
    }
    let per = a.len().div_ceil(threads).div_ceil(16) * 16;
    std::thread::scope(|sc| {
        for ((a, b), c) in a.chunks_mut(per).zip(b.chunks(per)).zip(c.chunks(per)) {
            sc.spawn(move || kernel(a, b, c));
        }
    });
}

fn reduce(dst: &mut [f32], src: &[f32], threads: usize) {
    if threads <= 1 {
        return zcomm::reduce_add(dst, src);
    }
    let per = dst.len().div_ceil(threads).div_ceil(16) * 16;
    std::thread::scope(|sc| {
        for (d, s) in dst.chunks_mut(per).zip(src.chunks(per)) {
            sc.spawn(move || zcomm::reduce_add(d, s));
        }
    });
}

/// ZeRO++'s blockwise quantization on every path this CPU has, at `threads`
/// rayon threads: quantizing reads 4 bytes a value and writes its code (1 byte
/// for int8, half for int4) and a scale per 2048-value block; dequantizing
/// the reverse; LoCo's compensated quantizing (one thread) also reads and
/// writes each value's 8-bit kept error.
fn quantization_rows(x: &[f32], threads: usize, triad_gbps: f64) -> Result<Vec<KernelRow>> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let n = x.len();
    let block = 2048;
    let mut back = vec![0f32; n];
    let mut rows = Vec::new();
    for path in zquant::Path::available() {
        for bits in [zquant::Bits::Int8, zquant::Bits::Int4] {
            let q = zquant::quantize_with(path, x, bits, block)?;
            let bytes = (4 * n + zquant::Quantized::wire_len(bits, block, n)) as f64;
            let name = format!("{bits:?}_{path:?}").to_lowercase();
            let mut err = None;
            let quantize = best_secs(5, || {
                if let Err(e) = pool.install(|| zquant::quantize_with(path, x, bits, block)) {
                    err = Some(e);
                }
            });
            if let Some(e) = err {
                return Err(e.into());
            }
            let dequantize = best_secs(5, || {
                pool.install(|| zquant::dequantize_with(path, &q, &mut back))
            });
            for (op, s) in [("quantize", quantize), ("dequantize", dequantize)] {
                let gbps = bytes / s / 1e9;
                rows.push(KernelRow {
                    kernel: format!("{op}_{name}"),
                    elements: n,
                    threads,
                    gbps,
                    gflops: 0.0,
                    ratio: gbps / triad_gbps,
                });
            }
            // LoCo's step, on the calling thread as a communicator runs it
            // (so in the one-thread pass alone): each value read, its 8-bit
            // kept error read and written, its code written.
            if threads != 1 {
                continue;
            }
            let mut kept = None;
            zquant::quantize_compensated_with(path, x, &mut kept, 0.8, bits, block)?;
            let mut err = None;
            let compensate = best_secs(5, || {
                if let Err(e) =
                    zquant::quantize_compensated_with(path, x, &mut kept, 0.8, bits, block)
                {
                    err = Some(e);
                }
            });
            if let Some(e) = err {
                return Err(e.into());
            }
            let kept_bytes = 2 * zquant::Quantized::wire_len(zquant::Bits::Int8, block, n);
            let gbps = (bytes + kept_bytes as f64) / compensate / 1e9;
            rows.push(KernelRow {
                kernel: format!("compensate_{name}"),
                elements: n,
                threads: 1,
                gbps,
                gflops: 0.0,
                ratio: gbps / triad_gbps,
            });
        }
    }
    Ok(rows)
}

/// Generation's products: one row times a row-major `B` of `x`'s values
/// (2048 rows: a LLaMA-1B block's depth), `B` in f32 and stored as bf16
/// bits (`zgemm::gemm_widening_b`: weights kept as published). A one-row
/// product reads each value of `B` once, so the figure is `B`'s bytes per
/// second, bound by the memory like the triad's (which also writes).
fn gemv_rows(x: &[f32], threads: usize, triad_gbps: f64) -> Result<Vec<KernelRow>> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let depth = 2048.min(x.len());
    let cols = x.len() / depth;
    let b16: Vec<u16> = x[..depth * cols]
        .iter()
        .map(|&v| zgemm::bf16_bits(v))
        .collect();
    let a = vec![0.5f32; depth];
    let mut c = vec![0f32; cols];
    let a_mat = zgemm::MatRef::row_major(&a, 1, depth)?;
    let (b32_mat, b16_mat) = (
        zgemm::MatRef::row_major(&x[..depth * cols], depth, cols)?,
        zgemm::MatRef::row_major(&b16, depth, cols)?,
    );
    let mut err = None;
    let mut rows = Vec::new();
    for (kernel, bytes) in [("gemv_f32", 4), ("gemv_bf16_stored", 2)] {
        let s = best_secs(5, || {
            let done = pool.install(|| {
                let out = zgemm::MatMut::row_major(&mut c, 1, cols)?;
                let zero = zgemm::Start::Zero;
                match bytes {
                    4 => zgemm::gemm(out, a_mat, b32_mat, 1.0, zero, threads),
                    _ => zgemm::gemm_widening_b(out, a_mat, b16_mat, zero, threads, None),
                }
            });
            if let Err(e) = done {
                err = Some(e);
            }
        });
        if let Some(e) = err.take() {
            return Err(e.into());
        }
        let gbps = (bytes * depth * cols) as f64 / s / 1e9;
        rows.push(KernelRow {
            kernel: kernel.into(),
            elements: depth * cols,
            threads,
            gbps,
            gflops: 2.0 * (depth * cols) as f64 / s / 1e9,
            ratio: gbps / triad_gbps,
        });
    }
    Ok(rows)
}

/// Measures every kernel at 1 thread and at all cores.
pub fn bench_kernels(elements: usize) -> Result<Vec<KernelRow>> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut thread_counts = vec![1];
    if cores > 1 {
        thread_counts.push(cores);
    }
    let n = elements;
    let (mut a, b, c) = (vec![0f32; n], vec![1f32; n], vec![2f32; n]);
    let (mut p, g, mut m, mut v) = (
        vec![0.5f32; n],
        vec![0.01f32; n],
        vec![0f32; n],
        vec![0f32; n],
    );
    let hp = AdamStep {
        rule: OptimizerKind::Adamw,
        lr: 1e-4,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 10,
        bias_correction: true,
        grad_scale: 1.0,
        lr_decay: 0.0,
        initial_sum: 0.0,
    };
    // Mixed precision: bf16 gradients in, bf16 working copy out (the same 28
    // bytes an element as f32: 4+2+4+4 read, 4+4+4+2 written).
    let g16 = vec![Half::Bf16.round(0.01); n];
    let mut w16 = vec![0u16; n];
    let mut rows = Vec::new();
    let reps = 5;
    for &t in &thread_counts {
        let triad_s = best_secs(reps, || triad(&mut a, &b, &c, t));
        let triad_gbps = 12.0 * n as f64 / triad_s / 1e9;
        rows.push(KernelRow {
            kernel: "triad".into(),
            elements: n,
            threads: t,
            gbps: triad_gbps,
            gflops: 2.0 * n as f64 / triad_s / 1e9,
            ratio: 1.0,
        });
        // Lion and Adagrad move 20 bytes an element (no second moment;
        // mixed precision likewise: 2+4+4 read, 4+4+2 written).
        let rules = [
            (OptimizerKind::Adamw, "adamw", 28.0, 12.0),
            (OptimizerKind::Adam, "adam", 28.0, 14.0),
            (OptimizerKind::Lion, "lion", 20.0, 10.0),
            (OptimizerKind::Adagrad, "adagrad", 20.0, 10.0),
        ];
        for ((rule, rule_name, bytes, flops), path) in rules
            .into_iter()
            .flat_map(|r| Path::available().into_iter().map(move |p| (r, p)))
        {
            let hp = AdamStep { rule, ..hp };
            let v: &mut [f32] = match rule.second_moment() {
                true => &mut v,
                false => &mut [],
            };
            for mixed in [false, true] {
                let s = best_secs(reps, || {
                    let b = if mixed {
                        Buffers {
                            p: &mut p,
                            g: Grads::Half(Half::Bf16, &g16),
                            m: &mut m,
                            v,
                            working: Some((Half::Bf16, &mut w16)),
                        }
                    } else {
                        Buffers::f32(&mut p, &g, &mut m, v)
                    };
                    adamw_with(path, t, b, true, &hp)
                });
                let gbps = bytes * n as f64 / s / 1e9;
                let name = path_name(path);
                rows.push(KernelRow {
                    kernel: format!("{rule_name}_{name}{}", if mixed { "_bf16" } else { "" }),
                    elements: n,
                    threads: t,
                    gbps,
                    gflops: flops * n as f64 / s / 1e9,
                    ratio: gbps / triad_gbps,
                });
            }
        }
        rows.extend(lamb_rows(
            &mut p, &g, &g16, &mut m, &mut v, &mut w16, &hp, t, triad_gbps,
        ));
        rows.extend(quantization_rows(&b, t, triad_gbps)?);
        rows.extend(gemv_rows(&b, t, triad_gbps)?);
        let s = best_secs(reps, || reduce(&mut a, &b, t));
        let gbps = 12.0 * n as f64 / s / 1e9;
        rows.push(KernelRow {
            kernel: "reduce_add".into(),
            elements: n,
            threads: t,
            gbps,
            gflops: n as f64 / s / 1e9,
            ratio: gbps / triad_gbps,
        });
    }
    // The arithmetic ceiling, then GEMM: the peak MFU is computed against,
    // then the model's own shapes at 1 thread and all cores, zgemm beside
    // the `gemm` crate it replaced; each GEMM row's ratio is its FLOP/s over
    // the ceiling at its thread count. The ceiling is measured before the
    // products and again after them, the faster kept: on a shared host the
    // cores' speed moves over seconds (a Sapphire Rapids guest gave
    // `fma_peak` 89 GFLOP/s at one thread, then products at 130-146, ratios
    // of 1.5 to a ceiling that no product can pass).
    //
    // Where the CPU has AVX512_BF16, that kernel's rows are set against
    // `vdpbf16ps`'s own ceiling (`bf16_peak`, measured the same way), whose
    // ratio is over `fma_peak`: 2.0 where bf16 products are native.
    let peaks = |t: usize| [fma_peak(t), bf16_peak(t)];
    let before: Vec<KernelRow> = thread_counts
        .iter()
        .flat_map(|&t| peaks(t))
        .flatten()
        .collect();
    let mut products = vec![gemm_peak()?];
    for &t in &thread_counts {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
        products.extend(pool.install(|| gemm_shape_rows(t))?);
    }
    let after: Vec<KernelRow> = thread_counts
        .iter()
        .flat_map(|&t| peaks(t))
        .flatten()
        .collect();
    let mut ceilings = faster_of(before, &after);
    set_ratios(&mut ceilings, &mut products);
    rows.extend(ceilings);
    rows.extend(products);
    Ok(rows)
}

/// Each product's ratio: its FLOP/s over its ceiling's at its thread count
/// (`bf16_peak` for the AVX512_BF16 kernel's rows where it was measured,
/// else `fma_peak`), and `bf16_peak`'s over `fma_peak`'s.
fn set_ratios(ceilings: &mut [KernelRow], products: &mut [KernelRow]) {
    let find = |rows: &[KernelRow], name: &str, threads: usize| {
        rows.iter()
            .find(|c| c.kernel == name && c.threads == threads)
            .map(|c| c.gflops)
    };
    for row in products.iter_mut() {
        let bf16 = row.kernel.starts_with(AVX512_BF16_ROWS);
        let ceiling = bf16
            .then(|| find(ceilings, BF16_PEAK, row.threads))
            .flatten()
            .or_else(|| find(ceilings, FMA_PEAK, row.threads));
        if let Some(c) = ceiling {
            row.ratio = row.gflops / c;
        }
    }
    let fma: Vec<KernelRow> = ceilings
        .iter()
        .filter(|c| c.kernel == FMA_PEAK)
        .cloned()
        .collect();
    for c in ceilings.iter_mut().filter(|c| c.kernel == BF16_PEAK) {
        if let Some(f) = find(&fma, FMA_PEAK, c.threads) {
            c.ratio = c.gflops / f;
        }
    }
}

/// The ceilings' row names, and the prefix of the rows set against
/// `bf16_peak`.
const FMA_PEAK: &str = "fma_peak";
const BF16_PEAK: &str = "bf16_peak";
const AVX512_BF16_ROWS: &str = "zgemm_avx512bf16_";

/// Each row of `first` replaced by the row of `second` of the same name at
/// the same thread count where that one ran faster.
fn faster_of(first: Vec<KernelRow>, second: &[KernelRow]) -> Vec<KernelRow> {
    first
        .into_iter()
        .map(|row| {
            second
                .iter()
                .find(|s| {
                    s.kernel == row.kernel && s.threads == row.threads && s.gflops > row.gflops
                })
                .cloned()
                .unwrap_or(row)
        })
        .collect()
}

/// The `fma_peak` row at `threads`: every thread running nothing but
/// independent f32 fused multiply-adds on the widest vectors zgemm uses
/// (`zgemm::Kernel::fma_chains`) at once, in GFLOP/s. No product can pass
/// it, so a GEMM's ratio to it says how much of the machine the kernel
/// uses. `None` where the CPU has no SIMD kernel.
fn fma_peak(threads: usize) -> Option<KernelRow> {
    peak(zgemm::Kernel::best(), FMA_PEAK, threads)
}

/// The `bf16_peak` row at `threads`: as [`fma_peak`] with `vdpbf16ps`, the
/// AVX512_BF16 kernel's instruction. `None` where the CPU lacks it (the
/// kernel then has no chains).
fn bf16_peak(threads: usize) -> Option<KernelRow> {
    peak(zgemm::Kernel::Avx512Bf16, BF16_PEAK, threads)
}

/// `kernel`'s chains ([`zgemm::Kernel::fma_chains`]) on `threads` threads
/// at once, the best of three runs of about a fifth of a second, as the
/// row `name`; `None` where the kernel has no chains.
fn peak(kernel: zgemm::Kernel, name: &str, threads: usize) -> Option<KernelRow> {
    kernel.fma_chains(1)?;
    // A first run sizes the timed ones.
    let t = Instant::now();
    kernel.fma_chains(1 << 20);
    let per_iteration = t.elapsed().as_secs_f64() / f64::from(1 << 20);
    let iterations = ((0.2 / per_iteration.max(1e-12)) as u64).clamp(1 << 20, 1 << 32);
    let gflops = (0..3)
        .map(|_| {
            let t = Instant::now();
            let flops: u64 = std::thread::scope(|sc| {
                let runs: Vec<_> = (0..threads)
                    .map(|_| sc.spawn(move || kernel.fma_chains(iterations).unwrap_or(0)))
                    .collect();
                runs.into_iter().map(|r| r.join().unwrap_or(0)).sum()
            });
            flops as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max);
    Some(peak_row(name, threads, gflops))
}

/// A ceiling's row of `gflops` at `threads` (its ratio 1 until set).
fn peak_row(name: &str, threads: usize, gflops: f64) -> KernelRow {
    KernelRow {
        kernel: name.into(),
        elements: 0,
        threads,
        gbps: 0.0,
        gflops,
        ratio: 1.0,
    }
}

/// The FLOP/s peak that MFU is computed against: zgemm's 2048³ with the
/// fastest kernel on all cores (what the model's linear layers run).
pub fn gemm_peak() -> Result<KernelRow> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = rayon::ThreadPoolBuilder::new().num_threads(cores).build()?;
    // The best of three timings (nine products, about a second): MFU is
    // divided by this, so a dip while it is measured must not inflate it.
    let mut gflops: f64 = 0.0;
    for _ in 0..3 {
        gflops = gflops.max(pool.install(|| {
            time_gemm(
                Impl::Zgemm(zgemm::Kernel::best()),
                "nn",
                (2048, 2048, 2048),
                cores,
            )
        })?);
    }
    Ok(KernelRow {
        kernel: "gemm_f32".into(),
        elements: 2048,
        threads: cores,
        gbps: 0.0,
        gflops,
        ratio: 0.0,
    })
}

/// A GEMM implementation to time.
#[derive(Debug, Clone, Copy)]
enum Impl {
    /// zrun's, with one of its kernels (a bf16 kernel: `gemm_bf16`, the
    /// operands rounded to bf16 and the products accumulated in f32).
    Zgemm(zgemm::Kernel),
    /// The `gemm` crate (what candle's matmul calls), for comparison.
    GemmCrate,
}

/// GFLOP/s of `C = A·B` (`op`: `nn`, `tn` = A read transposed, `nt` = B read
/// transposed, as the model reads them) on `threads` threads of the current
/// rayon pool, the best of several calls.
fn time_gemm(imp: Impl, op: &str, (m, k, n): (usize, usize, usize), threads: usize) -> Result<f64> {
    let a = vec![0.5f32; m * k];
    let b = vec![0.25f32; k * n];
    let mut c = vec![0f32; m * n];
    let (a_t, b_t) = (op.starts_with('t'), op.ends_with('t'));
    let flops = 2.0 * (m * k * n) as f64;
    let reps = ((2e10 / flops) as usize).clamp(3, 50);
    let s = match imp {
        Impl::Zgemm(kernel) => {
            let view = |data, rows, cols, t: bool| {
                if t {
                    zgemm::MatRef::row_major(data, cols, rows).map(zgemm::MatRef::t)
                } else {
                    zgemm::MatRef::row_major(data, rows, cols)
                }
            };
            let (av, bv) = (view(&a, m, k, a_t)?, view(&b, k, n, b_t)?);
            let mut err = None;
            let s = best_secs(reps, || {
                let c = zgemm::MatMut::row_major(&mut c, m, n).expect("c is m x n");
                let product = if zgemm::Kernel::available_bf16().contains(&kernel) {
                    zgemm::gemm_bf16_with
                } else {
                    zgemm::gemm_with
                };
                if let Err(e) = product(kernel, c, av, bv, 1.0, zgemm::Start::Zero, threads) {
                    err = Some(e);
                }
            });
            if let Some(e) = err {
                return Err(e.into());
            }
            s
        }
        Impl::GemmCrate => {
            // (column stride, row stride) of A (m x k) and B (k x n) as stored.
            let (a_cs, a_rs) = if a_t { (m, 1) } else { (1, k) };
            let (b_cs, b_rs) = if b_t { (k, 1) } else { (1, n) };
            let par = if threads > 1 {
                gemm::Parallelism::Rayon(threads)
            } else {
                gemm::Parallelism::None
            };
            best_secs(reps, || {
                // SAFETY: c is m x n row-major; a and b hold m*k and k*n
                // floats read with the strides above, all in bounds.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        c.as_mut_ptr(),
                        1,
                        n as isize,
                        false,
                        a.as_ptr(),
                        a_cs as isize,
                        a_rs as isize,
                        b.as_ptr(),
                        b_cs as isize,
                        b_rs as isize,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        par,
                    )
                }
            })
        }
    };
    Ok(flops / s / 1e9)
}

/// The GEMMs of a GPT block (d_model 384, 2048 rows: micro-batch 8 of 256
/// tokens) as its forward and backward run them, a small model's weight
/// gradient (d_model 128, 512 tokens), and 2048³: zgemm with each
/// SIMD kernel this CPU has, and the `gemm` crate. The same shapes as
/// `scripts/gemm_openblas.py`, so that OpenBLAS can be set beside them.
fn gemm_shape_rows(threads: usize) -> Result<Vec<KernelRow>> {
    const SHAPES: [(&str, (usize, usize, usize)); 8] = [
        ("nn", (2048, 2048, 2048)),
        ("nn", (2048, 384, 1152)),
        ("nn", (2048, 384, 1536)),
        ("nn", (2048, 1536, 384)),
        ("tn", (384, 2048, 1152)),
        ("nt", (2048, 1152, 384)),
        ("tn", (1536, 2048, 384)),
        // A d_model-128 model's weight gradient (configs/tiny.yaml's).
        ("tn", (128, 512, 384)),
    ];
    // bf16 products where the CPU has them in hardware (AMX, AVX512_BF16),
    // then the f32 kernels. The portable kernels are references, not
    // contenders where SIMD exists.
    let mut impls: Vec<Impl> = zgemm::Kernel::available_bf16()
        .into_iter()
        .filter(|&k| k != zgemm::Kernel::PortableBf16)
        .chain(
            zgemm::Kernel::available()
                .into_iter()
                .filter(|&k| k != zgemm::Kernel::Portable || zgemm::Kernel::best() == k),
        )
        .map(Impl::Zgemm)
        .collect();
    impls.push(Impl::GemmCrate);
    let mut rows = Vec::new();
    for (op, (m, k, n)) in SHAPES {
        for imp in &impls {
            let name = match imp {
                Impl::Zgemm(kernel) => format!("zgemm_{kernel:?}").to_lowercase(),
                Impl::GemmCrate => "gemm_crate".into(),
            };
            rows.push(KernelRow {
                kernel: format!("{name}_{op}_{m}x{k}x{n}"),
                elements: m * n,
                threads,
                gbps: 0.0,
                gflops: time_gemm(*imp, op, (m, k, n), threads)?,
                ratio: 0.0,
            });
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_keeps_the_faster_measurement_at_each_thread_count() {
        let before = vec![peak_row(FMA_PEAK, 1, 89.0), peak_row(FMA_PEAK, 2, 180.0)];
        let after = [peak_row(FMA_PEAK, 2, 150.0), peak_row(FMA_PEAK, 1, 135.0)];
        let got: Vec<(usize, f64)> = faster_of(before, &after)
            .iter()
            .map(|r| (r.threads, r.gflops))
            .collect();
        assert_eq!(got, [(1, 135.0), (2, 180.0)]);
        // Nothing measured after (no SIMD kernel): the first stands.
        assert_eq!(
            faster_of(vec![peak_row(FMA_PEAK, 1, 89.0)], &[])[0].gflops,
            89.0
        );
        // Each ceiling is kept against its own kind only.
        let both = faster_of(
            vec![peak_row(FMA_PEAK, 1, 100.0), peak_row(BF16_PEAK, 1, 150.0)],
            &[peak_row(BF16_PEAK, 1, 200.0)],
        );
        let got: Vec<(&str, f64)> = both.iter().map(|r| (r.kernel.as_str(), r.gflops)).collect();
        assert_eq!(got, [(FMA_PEAK, 100.0), (BF16_PEAK, 200.0)]);
    }

    #[test]
    fn avx512_bf16_rows_are_set_against_their_own_ceiling() {
        let product = |name: &str, threads: usize, gflops: f64| KernelRow {
            kernel: name.into(),
            elements: 1,
            threads,
            gbps: 0.0,
            gflops,
            ratio: 0.0,
        };
        let mut ceilings = [
            peak_row(FMA_PEAK, 1, 100.0),
            peak_row(FMA_PEAK, 2, 200.0),
            peak_row(BF16_PEAK, 1, 200.0),
        ];
        let mut products = [
            product("zgemm_avx512bf16_nn_8x8x8", 1, 180.0),
            product("zgemm_avx512_nn_8x8x8", 1, 90.0),
            product("zgemm_amxbf16_nn_8x8x8", 1, 400.0),
            // No bf16_peak at 2 threads: fma_peak's.
            product("zgemm_avx512bf16_nn_8x8x8", 2, 300.0),
        ];
        set_ratios(&mut ceilings, &mut products);
        let ratios: Vec<f64> = products.iter().map(|r| r.ratio).collect();
        assert_eq!(ratios, [0.9, 0.9, 4.0, 1.5]);
        assert_eq!(ceilings[2].ratio, 2.0);
        assert_eq!(ceilings[0].ratio, 1.0);
    }
}
