//! Times causal attention and its backward at the `gpt-anchor` job's shape
//! (8 sequences × 256 tokens, 6 heads of 64), best of 30 calls each, and
//! prints the rate of the products' useful work (the causal triangle), with
//! f32 products and, where the CPU multiplies bf16 natively, bf16 ones, the latter also as a
//! bf16 step runs them (`qkv` in bf16, the output written in bf16):
//!
//!     cargo run --release -p zmodel --example attention_bench
//!     RAYON_NUM_THREADS=1 cargo run --release -p zmodel --example attention_bench
//!
//! (an argument, `F32`, `Bf16` or `"Bf16 in and out"`, runs that one only).
//! `DOCUMENTS=64` keeps documents of 64 tokens apart
//! (`data.separate_documents`): the rate stays the triangle's, so it shows
//! what skipping the masked keys saves. `WINDOW=64` bounds each row to its
//! last 64 keys (`model.sliding_window`) the same way, and `SEQ=1024` runs
//! sequences of that many tokens (2048 tokens in all, as the anchor's 8 ×
//! 256).

use candle_core::{Device, Tensor};
use zmodel::attention::{
    causal_attention, causal_attention_backward, causal_attention_bf16, Heads,
};
use zmodel::{Documents, Products};

fn main() -> candle_core::Result<()> {
    // Unset or empty: the defaults.
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let t: usize = var("SEQ").map_or(256, |n| n.parse().expect("SEQ: tokens"));
    let (b, heads, hd) = ((2048 / t).max(1), 6, 64);
    let w = 3 * heads * hd;
    let qkv: Vec<f32> = (0..b * t * w)
        .map(|i| (i * 37 % 101) as f32 / 50.0 - 1.0)
        .collect();
    let qkv = Tensor::from_vec(qkv, (b, t, w), &Device::Cpu)?;
    let dy: Vec<f32> = (0..b * t * heads * hd)
        .map(|i| (i % 13) as f32 * 0.1 - 0.6)
        .collect();
    let dy = Tensor::from_vec(dy, (b, t, heads * hd), &Device::Cpu)?;
    let h = Heads { heads, kv: heads };
    let docs = var("DOCUMENTS").map(|n| {
        let n: usize = n.parse().expect("DOCUMENTS: tokens per document");
        let ids: Vec<u32> = (0..b * t).map(|i| u32::from(i % n == n - 1)).collect();
        println!("documents of {n} tokens kept apart");
        Documents::after_eos(&ids, t, 1)
    });
    let window = var("WINDOW").map(|n| {
        let n: usize = n.parse().expect("WINDOW: keys per row");
        println!("a sliding window of {n} keys");
        Documents::windowed(docs.as_ref(), b, t, n)
    });
    let docs = window.as_ref().or(docs.as_ref());
    // FLOPs of the causal triangle (row i sees i + 1 keys) per product, as
    // any blocking needs at least: the rate is the useful work's, so block
    // sizes compare by it.
    let per_product = 2.0 * hd as f64 * (t * (t + 1) / 2) as f64 * (b * heads) as f64;
    let mut kinds = vec![Products::F32];
    if zgemm::has_native_bf16() {
        kinds.push(Products::Bf16);
    }
    let qkv16 = on_a_line(&qkv.to_dtype(candle_core::DType::BF16)?)?;
    let mut runs: Vec<(String, Products, bool)> = kinds
        .iter()
        .map(|&p| (format!("{p:?}"), p, false))
        .collect();
    if zgemm::has_native_bf16() {
        runs.push(("Bf16 in and out".into(), Products::Bf16, true));
    }
    let only = std::env::args().nth(1);
    for (name, products, bits) in runs {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let (mut fwd, mut bwd) = (f64::MAX, f64::MAX);
        let input = if bits { &qkv16 } else { &qkv };
        for _ in 0..30 {
            let start = std::time::Instant::now();
            if bits {
                drop(causal_attention_bf16(input, h, docs, None)?);
            } else {
                drop(causal_attention(input, h, products, docs, None)?);
            }
            fwd = fwd.min(start.elapsed().as_secs_f64());
            let start = std::time::Instant::now();
            drop(causal_attention_backward(
                input, &dy, h, products, docs, None,
            )?);
            bwd = bwd.min(start.elapsed().as_secs_f64());
        }
        println!(
            "{name}: forward {:.2} ms ({:.1} GFLOP/s), backward {:.2} ms ({:.1} GFLOP/s), best of 30",
            fwd * 1e3,
            2.0 * per_product / fwd / 1e9,
            bwd * 1e3,
            5.0 * per_product / bwd / 1e9
        );
    }
    Ok(())
}

/// `x` (bf16) copied so that its values start on a 64-byte line, as the
/// model's projection lays `qkv` out (`zgemm::gemm_bf16_rounded` into a
/// line-aligned buffer): the products read its rows in place only then,
/// and a copy from the allocator's 16-byte-aligned memory pairs every block
/// of `Q` afresh.
fn on_a_line(x: &Tensor) -> candle_core::Result<Tensor> {
    let values = x.flatten_all()?.to_vec1::<half::bf16>()?;
    let mut padded = vec![half::bf16::ZERO; values.len() + 32];
    let start = zgemm::bf16_line_start(&padded);
    padded[start..start + values.len()].copy_from_slice(&values);
    let len = padded.len();
    Tensor::from_vec(padded, len, &Device::Cpu)?
        .narrow(0, start, values.len())?
        .reshape(x.shape())
}
