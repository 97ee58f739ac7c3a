//! `zrun bench kernels`: the CPU kernels zrun relies on, against this machine's
//! memory bandwidth measured in the same run.
//!
//! The yardstick is the STREAM triad `a = b + s·c` (12 bytes per element) at the
//! same thread count. Streaming kernels report the bytes they must read and write
//! per second and their ratio to the triad: AdamW moves 28 bytes per element
//! (p, g, m, v in; p, m, v out), the reduction `dst += src` 12. A ratio near 1
//! means the kernel runs at the memory's speed, the bound for such kernels. The
//! GEMM row (candle's f32 matmul, the model's linear layers) gives the FLOP/s
//! peak that MFU is computed against. ZeRO++'s quantization kernels move 4
//! bytes a value one way and their code (1 byte, or half) plus block scales the
//! other. Each figure is the best of several runs.

use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Tensor};
use zengine::adam::{adamw_with, AdamStep, Buffers, Grads, Path};
use zengine::precision::Half;
use zproto::KernelRow;

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
/// the reverse.
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
        }
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
        lr: 1e-4,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 10,
        grad_scale: 1.0,
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
        for path in Path::available() {
            for mixed in [false, true] {
                let s = best_secs(reps, || {
                    let b = if mixed {
                        Buffers {
                            p: &mut p,
                            g: Grads::Half(Half::Bf16, &g16),
                            m: &mut m,
                            v: &mut v,
                            working: Some((Half::Bf16, &mut w16)),
                        }
                    } else {
                        Buffers::f32(&mut p, &g, &mut m, &mut v)
                    };
                    adamw_with(path, t, b, true, &hp)
                });
                let gbps = 28.0 * n as f64 / s / 1e9;
                let name = match path {
                    Path::Avx512 => "adamw_avx512",
                    Path::Avx2 => "adamw_avx2",
                    Path::Portable => "adamw_portable",
                };
                rows.push(KernelRow {
                    kernel: format!("{name}{}", if mixed { "_bf16" } else { "" }),
                    elements: n,
                    threads: t,
                    gbps,
                    gflops: 12.0 * n as f64 / s / 1e9,
                    ratio: gbps / triad_gbps,
                });
            }
        }
        rows.extend(quantization_rows(&b, t, triad_gbps)?);
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
    // GEMM: candle's f32 matmul on large square shapes, with all cores (candle
    // threads by RAYON_NUM_THREADS, which zrun leaves unset for this benchmark).
    let dim = 2048;
    let x = Tensor::ones((dim, dim), candle_core::DType::F32, &Device::Cpu)?;
    let y = Tensor::ones((dim, dim), candle_core::DType::F32, &Device::Cpu)?;
    let mut err = None;
    let s = best_secs(3, || {
        if let Err(e) = x.matmul(&y) {
            err = Some(e);
        }
    });
    if let Some(e) = err {
        return Err(e.into());
    }
    let flops = 2.0 * (dim as f64).powi(3);
    rows.push(KernelRow {
        kernel: "gemm_f32".into(),
        elements: dim,
        threads: candle_core::utils::get_num_threads(),
        gbps: 0.0,
        gflops: flops / s / 1e9,
        ratio: 0.0,
    });
    Ok(rows)
}
