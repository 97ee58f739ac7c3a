//! Times the fused element-wise ops at the `gpt-anchor` job's shapes (2048
//! rows of d = 384, the MLP's 1536), best of 30 calls each, and prints each
//! op's rate in the bytes it must move (inputs read once, outputs written
//! once) beside a triad (`a = b + s·c`) over arrays as large, timed in the
//! same run: a ratio near 1 is an op bound by memory, far below it one bound
//! by its arithmetic or its code.
//!
//!     RAYON_NUM_THREADS=1 cargo run --release -p zmodel --example ops_bench
//!     cargo run --release -p zmodel --example ops_bench

use std::time::Instant;

use candle_core::{Device, Tensor};
use zmodel::ops;

fn best_of(f: &mut dyn FnMut() -> candle_core::Result<()>) -> candle_core::Result<f64> {
    let mut best = f64::MAX;
    for _ in 0..30 {
        let start = Instant::now();
        f()?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// `n` values in [-2, 2) spread over about a million distinct ones, as a
/// layer's activations are: GELU's bf16 ops look their results up by the
/// input's bits, and inputs of a hundred values (as these were until
/// 2026-12-02) keep every lookup in L1 (measured 4-6% faster).
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + seed * 104_729) % 1_000_003) as f32 / 250_000.75 - 2.0)
        .collect()
}

fn main() -> candle_core::Result<()> {
    let (rows, d, wide) = (2048, 384, 1536);
    let cpu = &Device::Cpu;
    let t = |n: usize, cols: usize, seed: usize| {
        Tensor::from_vec(values(n * cols, seed), (n, cols), cpu)
    };
    let (x, dy, res) = (t(rows, d, 1)?, t(rows, d, 2)?, t(rows, d, 3)?);
    let (h, dh) = (t(rows, wide, 4)?, t(rows, wide, 5)?);
    let w = Tensor::from_vec(values(d, 6), d, cpu)?;
    let b = Tensor::from_vec(values(d, 7), d, cpu)?;

    // The triad over arrays of the MLP's size, 12 bytes an element.
    let n = rows * wide;
    let (tb, tc) = (values(n, 8), values(n, 9));
    let mut ta = vec![0f32; n];
    let triad = best_of(&mut || {
        use rayon::prelude::*;
        ta.par_chunks_mut(1 << 14)
            .zip(tb.par_chunks(1 << 14).zip(tc.par_chunks(1 << 14)))
            .for_each(|(a, (b, c))| {
                for ((a, b), c) in a.iter_mut().zip(b).zip(c) {
                    *a = b + 1.5 * c;
                }
            });
        Ok(())
    })?;
    let triad_rate = 12.0 * n as f64 / triad;
    println!("{:<32} {:>9} {:>8} {:>6}", "op", "ms", "GB/s", "ratio");
    println!(
        "{:<32} {:>9.3} {:>8.2} {:>6.2}",
        "triad (a = b + s*c)",
        triad * 1e3,
        triad_rate / 1e9,
        1.0
    );
    let row = |name: &str, bytes: f64, f: &mut dyn FnMut() -> candle_core::Result<()>| {
        let s = best_of(f)?;
        let rate = bytes / s;
        println!(
            "{name:<32} {:>9.3} {:>8.2} {:>6.2}",
            s * 1e3,
            rate / 1e9,
            rate / triad_rate
        );
        Ok::<_, candle_core::Error>(())
    };
    let e = (rows * d) as f64;
    let m = (rows * wide) as f64;
    row("layer_norm", 8.0 * e, &mut || {
        ops::layer_norm(&x, &w, &b, 1e-5).map(drop)
    })?;
    row("layer_norm_backward + residual", 16.0 * e, &mut || {
        ops::layer_norm_backward(&x, &w, &dy, 1e-5, Some(&res)).map(drop)
    })?;
    row("gelu (autograd's)", 8.0 * m, &mut || {
        ops::gelu(&h).map(drop)
    })?;
    row("gelu_and_slope", 12.0 * m, &mut || {
        ops::gelu_and_slope(&h).map(drop)
    })?;
    let h16 = h.to_dtype(candle_core::DType::BF16)?;
    row("gelu_bf16_of_bf16", 4.0 * m, &mut || {
        ops::gelu_bf16_of_bf16(&h16).map(drop)
    })?;
    row("gelu_backward (from the input)", 12.0 * m, &mut || {
        ops::gelu_backward(&h, &dh).map(drop)
    })?;
    let (_, slope) = ops::gelu_and_slope(&h)?;
    row("gelu_backward_by_slope", 12.0 * m, &mut || {
        ops::gelu_backward_by_slope(&slope, &dh).map(drop)
    })?;
    row(
        "gelu_backward_bf16_of_input (rounded, sums)",
        8.0 * m,
        &mut || ops::gelu_backward_bf16_of_input(&h16, &dh).map(drop),
    )?;
    row("column_sums (1536 wide)", 4.0 * m, &mut || {
        ops::column_sums(&dh).map(drop)
    })?;
    let dhv = dh.flatten_all()?.to_vec1::<f32>()?;
    row("bf16_with_column_sums (1536 wide)", 6.0 * m, &mut || {
        ops::bf16_with_column_sums(&dhv, wide).map(drop)
    })?;
    // LLaMA's norm and rotary embedding (6 heads of 64 for q, k and v: qkv
    // as wide as 3·d).
    row("rms_norm (LLaMA)", 8.0 * e, &mut || {
        zmodel::llama_ops::rms_norm(&x, &w, 1e-5).map(drop)
    })?;
    row("rms_norm_backward + residual", 16.0 * e, &mut || {
        zmodel::llama_ops::rms_norm_backward(&x, &w, &dy, 1e-5, Some(&res)).map(drop)
    })?;
    let qkv = t(rows, 3 * d, 10)?.reshape((8, rows / 8, 3 * d))?;
    row("rope (q and k)", 8.0 * e * 3.0, &mut || {
        zmodel::llama_ops::rope(
            &qkv,
            6,
            6,
            &zconfig::arch::Rotary::new(10000.0, None, d / 6, rows / 8),
            false,
            None,
        )
        .map(drop)
    })?;
    // LLaMA's SwiGLU over gate and up side by side (each half as wide as h).
    let (gu, half) = (
        h.narrow(1, 0, wide / 2 * 2)?.contiguous()?,
        (rows * (wide / 2)) as f64,
    );
    let dy_half = dh.narrow(1, 0, wide / 2)?.contiguous()?;
    row("swiglu (LLaMA)", 12.0 * half, &mut || {
        zmodel::llama_ops::swiglu(&gu).map(drop)
    })?;
    row("swiglu_backward", 20.0 * half, &mut || {
        zmodel::llama_ops::swiglu_backward(&gu, &dy_half).map(drop)
    })?;
    println!(
        "(GB/s: the bytes an op must read and write; ratio: over the triad's GB/s in this run)"
    );
    Ok(())
}
