//! Times one transformer block's forward and hand-written backward at the
//! `gpt-anchor` job's shape (8 sequences × 256 tokens, d 384, 6 heads),
//! best of 20 calls each, with f32 products and, where the CPU multiplies bf16 natively, bf16
//! ones, and prints the block's model FLOPs per second: a step's work without
//! the engine, the optimizer or the collectives, and far less noisy than a
//! training run (what a change to the block's ops moves shows here first).
//!
//!     RAYON_NUM_THREADS=1 cargo run --release -p zmodel --example block_bench [f32|bf16]
//!
//! (an argument runs one kind of products only). A worker sets glibc's
//! allocator as zworker's `keep_freed_memory` does; without that, fresh
//! large buffers are fresh pages each call, and their faults are part of
//! what this times: `MALLOC_MMAP_THRESHOLD_=33554432
//! MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_ARENA_MAX=1` in the environment
//! times what a one-thread worker runs.

use std::time::Instant;

use candle_core::{Device, Tensor};
use zmodel::{BlockParams, Gpt};

fn main() -> candle_core::Result<()> {
    let (b, t, d) = (8, 256, 384);
    let spec: zconfig::spec::ModelSpec = serde_json::from_value(serde_json::json!({
        "vocab_size": 256, "d_model": d, "n_layers": 6, "n_heads": 6, "seq_len": t
    }))
    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let base = Gpt::new(&spec)?;
    let layout = base.layout();
    let group = &base.groups()[1];
    let params: Vec<Tensor> = base
        .init_group(1, 7)
        .into_iter()
        .zip(&group.params)
        .map(|(v, ps)| Tensor::from_vec(v, ps.shape.as_slice(), &Device::Cpu))
        .collect::<candle_core::Result<_>>()?;
    let params = BlockParams::from_vec(params, layout)?;
    let values = |n: usize, seed: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 + seed * 11) % 101) as f32 / 50.0 - 1.0)
            .collect()
    };
    let x = Tensor::from_vec(values(b * t * d, 1), (b, t, d), &Device::Cpu)?;
    let dy = Tensor::from_vec(values(b * t * d, 2), (b, t, d), &Device::Cpu)?;
    // A block's share of the model FLOPs (`Gpt::flops_per_token` less the head).
    let flops = (b * t) as f64 * (6.0 * spec.block_params() as f64 + 12.0 * (d * t) as f64);
    let only = std::env::args().nth(1);
    for bf16 in [false, true] {
        if only
            .as_deref()
            .is_some_and(|o| o != if bf16 { "bf16" } else { "f32" })
        {
            continue;
        }
        let g = base.clone().with_bf16_products(bf16);
        if bf16 && g.products() != zmodel::Products::Bf16 {
            println!("bf16 products: this CPU has no AMX-BF16; skipped");
            continue;
        }
        let (mut fwd, mut bwd) = (f64::MAX, f64::MAX);
        for _ in 0..20 {
            let start = Instant::now();
            let (_, acts) = g.block_forward(&params, &x)?;
            fwd = fwd.min(start.elapsed().as_secs_f64());
            let start = Instant::now();
            drop(g.block_backward(&params, &acts, &dy)?);
            bwd = bwd.min(start.elapsed().as_secs_f64());
        }
        println!(
            "{:?} products: forward {:.2} ms, backward {:.2} ms, {:.1} model GFLOP/s (best of 20 each)",
            g.products(),
            fwd * 1e3,
            bwd * 1e3,
            flops / (fwd + bwd) / 1e9
        );
    }
    Ok(())
}
