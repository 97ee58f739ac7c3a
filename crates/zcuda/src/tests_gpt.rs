//! The GPU model against the CPU model (zmodel), the oracle: one GPT-2
//! block, and one LLaMA block (grouped-query attention, an untied head),
//! with its embedding and head, forward and backward, every output and
//! gradient within a stated relative error of the CPU's; and the GPU run
//! repeated gives the same bits. bf16 products against an f64 product of
//! the bf16-rounded operands. Skipped without a GPU (mandatory under
//! `ZRUN_REQUIRE_GPU=1`).

use candle_core::{Device, Tensor};
use zmodel::{BlockParams, EmbeddingParams, Gpt, HeadParams};

use super::*;

/// f32 products of depth ≤ 256 in other orders: far below this.
const BOUND: f64 = 1e-4;

fn gpu_model_or_skip(test: &str, shape: GptShape) -> Option<GptGpu> {
    gpu_or_skip(test, probe().training_devices())
        .then(|| GptGpu::open(0, shape).expect("opening GPU 0 for the model"))
}

/// ‖got − want‖ / ‖want‖, after checking that both are finite.
fn rel_err(what: &str, got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    assert!(got.iter().all(|v| v.is_finite()), "{what}: GPU non-finite");
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (f64::from(g) - f64::from(w)).powi(2);
        den += f64::from(w).powi(2);
    }
    assert!(den > 0.0, "{what}: the CPU's values are all zero");
    (num / den).sqrt()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// Every parameter moved off its initial value (norms start at 1 and 0,
/// which would hide a swapped weight and bias), by a fixed sequence.
fn perturbed(group: Vec<Vec<f32>>, salt: u32) -> Vec<Vec<f32>> {
    let mut state = 0x9E37_79B9u32 ^ salt;
    group
        .into_iter()
        .map(|p| {
            p.into_iter()
                .map(|v| {
                    state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    v + ((state >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 0.2
                })
                .collect()
        })
        .collect()
}

fn tensors(group: &[Vec<f32>], shapes: &[Vec<usize>]) -> Vec<Tensor> {
    group
        .iter()
        .zip(shapes)
        .map(|(v, s)| Tensor::from_vec(v.clone(), s.as_slice(), &Device::Cpu).unwrap())
        .collect()
}

const VOCAB: usize = 97;

/// `x` rounded to bf16 to nearest even (finite values), as f32.
fn bf16_value(x: f32) -> f32 {
    let b = x.to_bits();
    f32::from_bits(((b + 0x7fff + ((b >> 16) & 1)) >> 16) << 16)
}

/// `x` rounded to f16 to nearest even, as f32 (the `half` crate's).
fn f16_value(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

#[test]
fn bf16_products_multiply_bf16_rounded_operands_in_f32() {
    half_products_multiply_rounded_operands_in_f32(
        "bf16_products_multiply_bf16_rounded_operands_in_f32",
        Half16::Bf16,
    );
}

#[test]
fn f16_products_multiply_f16_rounded_operands_in_f32() {
    half_products_multiply_rounded_operands_in_f32(
        "f16_products_multiply_f16_rounded_operands_in_f32",
        Half16::F16,
    );
}

/// A 16-bit working copy must hold every tensor at its range: a range
/// outside it, one too few, or one that is not its tensor's length is
/// refused with the counts.
#[test]
fn weights_refuse_a_working_copy_that_does_not_hold_their_tensors() {
    let test = "weights_refuse_a_working_copy_that_does_not_hold_their_tensors";
    if !gpu_or_skip(test, probe().usable_devices()) {
        return;
    }
    let gpu = Gpu::open(0).unwrap();
    let parts = |second: bool| {
        let second = second.then(|| gpu.upload(&[2f32; 4]).unwrap());
        vec![Some(gpu.upload(&[1f32; 6]).unwrap()), second]
    };
    let flat = || gpu.zeros::<u16>(12).unwrap();
    for held_alone in [false, true] {
        let ok = Weights::with_half(parts(!held_alone), Half16::Bf16, flat(), vec![0..6, 8..12]);
        assert!(ok.is_ok(), "held alone: {held_alone}");
    }
    // Outside the copy, one range too few, a range shorter than its tensor.
    let one_too_few = std::iter::once(0..6).collect::<Vec<_>>();
    for ranges in [vec![0..6, 9..13], one_too_few, vec![0..5, 8..12]] {
        let err = Weights::with_half(parts(true), Half16::Bf16, flat(), ranges.clone())
            .err()
            .unwrap_or_else(|| panic!("ranges {ranges:?} accepted"))
            .to_string();
        let count = format!("{} tensor ranges", ranges.len());
        assert!(err.contains("12 values") && err.contains(&count), "{err}");
    }
}

fn half_products_multiply_rounded_operands_in_f32(test: &str, h: Half16) {
    let shape = GptShape {
        family: Family::Gpt2,
        d_model: 64,
        n_heads: 4,
        head_dim: 16,
        ffn: 256,
        vocab: VOCAB,
        seq_len: 48,
        eps: 1e-5,
    };
    let Some(mut gpu) = gpu_model_or_skip(test, shape) else {
        return;
    };
    if let Err(e) = gpu.use_half_products(h) {
        eprintln!("{test}: skipped: {e}");
        return;
    }
    // Two products of Aᵀ·B at batch strides, A stored [k, m], B [k, n];
    // values with every mantissa bit set somewhere, which 16 bits cut.
    let (m, n, k, count) = (37, 29, 300, 2);
    let mut s = 12345u32;
    let mut vals = |len: usize| -> Vec<f32> {
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    };
    let (a, b) = (vals(count * k * m), vals(count * k * n));
    let product = |round: fn(f32) -> f32| -> Vec<f32> {
        let mut c = Vec::with_capacity(count * m * n);
        for q in 0..count {
            for i in 0..m {
                for j in 0..n {
                    let sum: f64 = (0..k)
                        .map(|p| {
                            let x = round(a[q * k * m + p * m + i]);
                            let y = round(b[q * k * n + p * n + j]);
                            f64::from(x) * f64::from(y)
                        })
                        .sum();
                    c.push(sum as f32);
                }
            }
        }
        c
    };
    let round: fn(f32) -> f32 = match h {
        Half16::Bf16 => bf16_value,
        Half16::F16 => f16_value,
    };
    let (rounded, exact) = (product(round), product(|x| x));
    let (da, db) = (gpu.gpu().upload(&a).unwrap(), gpu.gpu().upload(&b).unwrap());
    let mut dc = gpu.gpu().zeros::<f32>(count * m * n).unwrap();
    let batch = crate::gpt::Batch {
        count,
        strides: [k * m, k * n, m * n],
    };
    gpu.gemm(
        true,
        false,
        (m, n, k),
        crate::gpt::op(&da, 0, m),
        crate::gpt::op(&db, 0, n),
        (&mut dc, 0, n),
        batch,
    )
    .unwrap();
    let got = gpu.gpu().download(&dc).unwrap();
    let (to_rounded, to_exact) = (
        rel_err("against 16-bit operands", &got, &rounded),
        rel_err("against f32 operands", &got, &exact),
    );
    let name = h.name();
    eprintln!(
        "{name} products, relative error: {to_rounded:.2e} against the f64 product of the rounded operands, {to_exact:.2e} against the unrounded ones"
    );
    // f32 sums of 300 terms: about 2^-24·√300; bf16 operands move the
    // product by about 2^-9 of its terms, f16 ones by 2^-12.
    let least = match h {
        Half16::Bf16 => 3e-4,
        Half16::F16 => 4e-5,
    };
    assert!(to_rounded < 1e-5, "not the rounded operands' product");
    assert!(to_exact > least, "the operands were not rounded to {name}");
}

#[test]
fn gpu_block_embedding_and_head_match_the_cpu_model() {
    matches_the_cpu_model(
        "gpu_block_embedding_and_head_match_the_cpu_model",
        serde_json::json!({"ffn_hidden": 160}),
        Family::Gpt2,
        Products::F32,
    );
}

#[test]
fn gpu_llama_block_embedding_and_head_match_the_cpu_model() {
    // Grouped-query attention (4 query heads on 2 key/value heads), rotary
    // positions at a small base (so that far positions turn a lot), and an
    // untied head.
    let (kv_heads, rope_theta) = (2, 100.0);
    matches_the_cpu_model(
        "gpu_llama_block_embedding_and_head_match_the_cpu_model",
        serde_json::json!({
            "kind": "llama", "n_kv_heads": kv_heads, "ffn_hidden": 96, "rope_theta": rope_theta
        }),
        Family::Llama {
            kv_heads,
            qkv_bias: false,
            qk_norm: false,
            rope_theta,
            rope_scaling: None,
            rotary_dim: None,
            window: None,
        },
        Products::F32,
    );
}

/// Qwen2's block: LLaMA's with a bias on the q, k and v projection (added
/// before the rotation; its gradient taken after the rotation back), here
/// with grouped-query attention (4 query heads on 2 key/value heads).
fn qwen2_block(test: &str, products: Products) {
    matches_the_cpu_model(
        test,
        serde_json::json!({
            "kind": "llama", "n_kv_heads": 2, "ffn_hidden": 96, "rope_theta": 100.0,
            "qkv_bias": true
        }),
        Family::Llama {
            kv_heads: 2,
            qkv_bias: true,
            qk_norm: false,
            rope_theta: 100.0,
            rope_scaling: None,
            rotary_dim: None,
            window: None,
        },
        products,
    );
}

#[test]
fn gpu_qwen2_block_embedding_and_head_match_the_cpu_model() {
    qwen2_block(
        "gpu_qwen2_block_embedding_and_head_match_the_cpu_model",
        Products::F32,
    );
}

#[test]
fn gpu_qwen2_block_with_bf16_products_matches_the_cpu_model_within_bf16_rounding() {
    // The bias's gradient summed in the pass that rounds dqkv to bf16.
    qwen2_block(
        "gpu_qwen2_block_with_bf16_products_matches_the_cpu_model",
        Products::Bf16,
    );
}

/// Qwen3's block: LLaMA's with each head's q and k RMS-normalised before
/// the rotation, heads of `hd` wider than 64 / 4 (q and the output
/// projection's input `4·hd` wide), grouped-query attention (4 query heads
/// on 2).
fn qwen3_block(test: &str, hd: usize, products: Products) {
    matches_the_cpu_model(
        test,
        serde_json::json!({
            "kind": "llama", "n_kv_heads": 2, "ffn_hidden": 96, "rope_theta": 100.0,
            "qk_norm": true, "head_dim": hd
        }),
        Family::Llama {
            kv_heads: 2,
            qkv_bias: false,
            qk_norm: true,
            rope_theta: 100.0,
            rope_scaling: None,
            rotary_dim: None,
            window: None,
        },
        products,
    );
}

#[test]
fn gpu_qwen3_block_embedding_and_head_match_the_cpu_model() {
    qwen3_block(
        "gpu_qwen3_block_embedding_and_head_match_the_cpu_model",
        24,
        Products::F32,
    );
}

#[test]
fn gpu_qwen3_block_with_bf16_products_matches_the_cpu_model_within_bf16_rounding() {
    // The unfused attention at a width the fused kernels do not have, and
    // the fused kernels at one they do (32, twice 64 / 4).
    qwen3_block(
        "gpu_qwen3_block_with_bf16_products_matches_the_cpu_model",
        24,
        Products::Bf16,
    );
    qwen3_block(
        "gpu_qwen3_block_with_bf16_fused_attention_matches_the_cpu_model",
        32,
        Products::Bf16FusedAttention,
    );
}

#[test]
fn gpu_block_with_bf16_products_matches_the_cpu_model_within_bf16_rounding() {
    // Every product (attention's included, whose probabilities and their
    // gradient the softmax kernels write in bf16) on bf16 operands.
    matches_the_cpu_model(
        "gpu_block_with_bf16_products_matches_the_cpu_model",
        serde_json::json!({"ffn_hidden": 160}),
        Family::Gpt2,
        Products::Bf16,
    );
}

#[test]
fn gpu_block_with_f16_products_matches_the_cpu_model_within_f16_rounding() {
    // Every product on f16 operands, the softmax kernels' outputs in f16.
    matches_the_cpu_model(
        "gpu_block_with_f16_products_matches_the_cpu_model",
        serde_json::json!({"ffn_hidden": 160}),
        Family::Gpt2,
        Products::F16,
    );
}

#[test]
fn gpu_llama_block_with_f16_fused_attention_matches_the_cpu_model_within_f16_rounding() {
    // attention.cu's f16 kernels (m16n8k16 on f16), grouped heads, rotary
    // positions and SwiGLU's f16 output.
    llama_block_with_fused_attention(
        "gpu_llama_block_with_f16_fused_attention_matches_the_cpu_model",
        Products::F16FusedAttention,
    );
}

#[test]
fn gpu_block_with_fused_attention_matches_the_cpu_model_within_bf16_rounding() {
    // attention.cu's kernels (bf16 products, probabilities never written)
    // over two tiles of query rows, the second partial (t = 100).
    matches_the_cpu_model(
        "gpu_block_with_fused_attention_matches_the_cpu_model",
        serde_json::json!({"ffn_hidden": 160, "seq_len": 100}),
        Family::Gpt2,
        Products::Bf16FusedAttention,
    );
}

#[test]
fn gpu_llama_block_with_fused_attention_matches_the_cpu_model_within_bf16_rounding() {
    // The fused kernels' grouped-query heads (4 on 2) and rotary positions.
    llama_block_with_fused_attention(
        "gpu_llama_block_with_fused_attention_matches_the_cpu_model",
        Products::Bf16FusedAttention,
    );
}

#[test]
fn gpu_llama_block_with_llama3_rope_scaling_matches_the_cpu_model() {
    // Llama 3's scaled rotary table (head width 16, original context 16:
    // every band has members), built by the same formula as the CPU's.
    llama_block_with_rope_scaling(
        "gpu_llama_block_with_llama3_rope_scaling_matches_the_cpu_model",
        zconfig::spec::RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        },
    );
}

#[test]
fn gpu_llama_block_with_yarn_rope_scaling_matches_the_cpu_model() {
    // YaRN's rotary table (head width 16, original context 32, factor 4:
    // pairs kept, blended and divided) with its attention factor on the
    // turned q and k, by the same formula as the CPU's.
    llama_block_with_rope_scaling(
        "gpu_llama_block_with_yarn_rope_scaling_matches_the_cpu_model",
        zconfig::spec::RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32,
            beta_fast: Some(8.0),
            beta_slow: None,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: None,
        },
    );
}

#[test]
fn gpu_llama_block_with_longrope_rope_scaling_matches_the_cpu_model() {
    // LongRoPE's rotary table (head width 16, sequences of 48 past an
    // original context of 32: the long factors, each pair's own) with its
    // attention factor, by the same formula as the CPU's.
    llama_block_with_rope_scaling(
        "gpu_llama_block_with_longrope_rope_scaling_matches_the_cpu_model",
        zconfig::spec::RopeScaling::Longrope {
            factor: 4.0,
            original_max_position_embeddings: 32,
            short_factor: vec![1.0; 8],
            long_factor: (0..8).map(|i| 1.0 + 2.5 * i as f64).collect(),
            attention_factor: None,
        },
    );
}

#[test]
fn gpu_llama_block_with_a_partial_rotation_matches_the_cpu_model() {
    // Phi-4-mini's partial rotation: each head's first 12 columns of 16
    // turned (a table of 6 frequencies), the other 4 passed through.
    matches_the_cpu_model(
        "gpu_llama_block_with_a_partial_rotation_matches_the_cpu_model",
        serde_json::json!({
            "kind": "llama", "n_kv_heads": 2, "ffn_hidden": 96, "rope_theta": 100.0,
            "partial_rotary_factor": 0.75
        }),
        Family::Llama {
            kv_heads: 2,
            qkv_bias: false,
            qk_norm: false,
            rope_theta: 100.0,
            rope_scaling: None,
            rotary_dim: Some(12),
            window: None,
        },
        Products::F32,
    );
}

/// A LLaMA block (4 query heads on 2 key/value heads, rotary base 100) with
/// its rotary table scaled as `scaling` says, in f32.
fn llama_block_with_rope_scaling(test: &str, scaling: zconfig::spec::RopeScaling) {
    matches_the_cpu_model(
        test,
        serde_json::json!({
            "kind": "llama", "n_kv_heads": 2, "ffn_hidden": 96, "rope_theta": 100.0,
            "rope_scaling": scaling
        }),
        Family::Llama {
            kv_heads: 2,
            qkv_bias: false,
            qk_norm: false,
            rope_theta: 100.0,
            rope_scaling: Some(scaling),
            rotary_dim: None,
            window: None,
        },
        Products::F32,
    );
}

/// A LLaMA block (4 query heads on 2 key/value heads, rotary base 100, t =
/// 100: two tiles of query rows) with the fused attention in `products`.
fn llama_block_with_fused_attention(test: &str, products: Products) {
    llama_block_with_fused_attention_on(test, products, false, None);
}

/// [`llama_block_with_fused_attention`], with packed documents kept apart
/// where `documents` says and the attention's dropout
/// ([`matches_the_cpu_model_with`]).
fn llama_block_with_fused_attention_on(
    test: &str,
    products: Products,
    documents: bool,
    attention_dropout: Option<zmodel::Dropout>,
) {
    let (kv_heads, rope_theta) = (2, 100.0);
    matches_the_cpu_model_with(
        test,
        serde_json::json!({
            "kind": "llama", "n_kv_heads": kv_heads, "ffn_hidden": 96, "rope_theta": rope_theta,
            "seq_len": 100
        }),
        Family::Llama {
            kv_heads,
            qkv_bias: false,
            qk_norm: false,
            rope_theta,
            rope_scaling: None,
            rotary_dim: None,
            window: None,
        },
        products,
        documents,
        attention_dropout,
    );
}

/// A sliding window (`model.sliding_window`) on the GPU: attention's rows
/// bounded from below by the window and, with packed documents, by their
/// documents (the positions the documents' alone), against the CPU model
/// with the same window: gpt.cu's softmax between f32 products, and
/// attention.cu's fused kernels in bf16 over two tiles of rows, where the
/// walks start at the window's tile and the key/value kernel stops past
/// its reach.
#[test]
fn gpu_llama_block_with_a_sliding_window_matches_the_cpu_model() {
    let test = "gpu_llama_block_with_a_sliding_window_matches_the_cpu_model";
    for (products, window) in [(Products::F32, 7), (Products::Bf16FusedAttention, 40)] {
        for documents in [false, true] {
            matches_the_cpu_model_with(
                test,
                serde_json::json!({
                    "kind": "llama", "n_kv_heads": 2, "ffn_hidden": 96, "rope_theta": 100.0,
                    "seq_len": 100, "sliding_window": window
                }),
                Family::Llama {
                    kv_heads: 2,
                    qkv_bias: false,
                    qk_norm: false,
                    rope_theta: 100.0,
                    rope_scaling: None,
                    rotary_dim: None,
                    window: Some(window),
                },
                products,
                documents,
                None,
            );
        }
    }
}

#[test]
fn gpu_llama_block_with_fused_attention_at_head_width_128_matches_the_cpu_model() {
    // attention.cu's widest kernels (tiles of 32 and 16 rows walked, the
    // fetch in two parts) in bf16, two heads of 128 on one key/value head,
    // over two blocks of rows.
    matches_the_cpu_model(
        "gpu_llama_block_with_fused_attention_at_head_width_128",
        serde_json::json!({
            "kind": "llama", "n_kv_heads": 1, "ffn_hidden": 96, "rope_theta": 100.0,
            "seq_len": 100, "d_model": 256, "n_heads": 2
        }),
        Family::Llama {
            kv_heads: 1,
            qkv_bias: false,
            qk_norm: false,
            rope_theta: 100.0,
            rope_scaling: None,
            rotary_dim: None,
            window: None,
        },
        Products::Bf16FusedAttention,
    );
}

#[test]
fn gpu_block_with_tf32_fused_attention_matches_the_cpu_model_within_tf32_rounding() {
    // attention.cu's TF32 kernels (m16n8k8, the depth order permuted so that
    // results feed the next product in registers), the rest in TF32 too.
    matches_the_cpu_model(
        "gpu_block_with_tf32_fused_attention_matches_the_cpu_model",
        serde_json::json!({"ffn_hidden": 160, "seq_len": 100}),
        Family::Gpt2,
        Products::Tf32FusedAttention,
    );
}

#[test]
fn gpu_block_with_packed_documents_kept_apart_matches_the_cpu_model() {
    // GPT-2: positions (and their gradient, to the bit) from each
    // document's first token; the softmax between cuBLAS products.
    matches_the_cpu_model_with(
        "gpu_block_with_packed_documents_kept_apart_matches_the_cpu_model",
        serde_json::json!({"ffn_hidden": 160}),
        Family::Gpt2,
        Products::F32,
        true,
        None,
    );
}

#[test]
fn gpu_llama_block_with_packed_documents_and_fused_attention_matches_the_cpu_model() {
    // LLaMA: rotary positions from each document's first token, the fused
    // attention's walks over two tiles of rows with documents across them.
    llama_block_with_fused_attention_on(
        "gpu_llama_block_with_packed_documents_and_fused_attention_matches_the_cpu_model",
        Products::Bf16FusedAttention,
        true,
        None,
    );
}

#[test]
fn gpu_block_with_attention_dropout_matches_the_cpu_model() {
    // A fifth of the probabilities dropped by zmodel's mask: gpt.cu's
    // causal_softmax and the products around it (f32), and attention.cu's
    // `_dropout` kernels (bf16 and TF32 products; LLaMA's grouped heads
    // with packed documents kept apart in f16), against the CPU model's
    // fused attention dropping the same.
    let drop = zmodel::Dropout::new(0.2, 11).unwrap().site(1);
    let test = "gpu_block_with_attention_dropout_matches_the_cpu_model";
    for products in [
        Products::F32,
        Products::Bf16FusedAttention,
        Products::Tf32FusedAttention,
    ] {
        matches_the_cpu_model_with(
            test,
            serde_json::json!({"ffn_hidden": 160, "seq_len": 100}),
            Family::Gpt2,
            products,
            false,
            Some(drop),
        );
    }
    llama_block_with_fused_attention_on(test, Products::F16FusedAttention, true, Some(drop));
}

/// How the GPU multiplies in [`matches_the_cpu_model`].
#[derive(Clone, Copy, PartialEq)]
enum Products {
    F32,
    Bf16,
    /// bf16 products with attention.cu's fused attention.
    Bf16FusedAttention,
    F16,
    /// f16 products with attention.cu's fused attention.
    F16FusedAttention,
    /// TF32 products with attention.cu's fused attention.
    Tf32FusedAttention,
}

/// One block of the model `extra` describes (on top of a small shape: seq
/// 48, d_model 64 and 4 heads unless `extra` says) on the GPU against the CPU model (f32), the
/// GPU's products in f32, TF32, bf16 or f16.
fn matches_the_cpu_model(test: &str, extra: serde_json::Value, family: Family, products: Products) {
    matches_the_cpu_model_with(test, extra, family, products, false, None);
}

/// [`matches_the_cpu_model`], with (`documents`) packed documents kept
/// apart: the end-of-text id placed where documents end one token, one
/// tile's rows and some tiles in, both models given where they begin; and
/// with `attention_dropout`, both models' attention probabilities dropped
/// by it.
fn matches_the_cpu_model_with(
    test: &str,
    extra: serde_json::Value,
    family: Family,
    products: Products,
    documents: bool,
    attention_dropout: Option<zmodel::Dropout>,
) {
    let half = match products {
        Products::Bf16 | Products::Bf16FusedAttention => Some(Half16::Bf16),
        Products::F16 | Products::F16FusedAttention => Some(Half16::F16),
        Products::F32 | Products::Tf32FusedAttention => None,
    };
    let (vocab, b) = (VOCAB, 3usize);
    let t = extra["seq_len"].as_u64().unwrap_or(48) as usize;
    let d = extra["d_model"].as_u64().unwrap_or(64) as usize;
    let heads = extra["n_heads"].as_u64().unwrap_or(4) as usize;
    let mut json = serde_json::json!({
        "vocab_size": vocab, "d_model": d, "n_layers": 1, "n_heads": heads, "seq_len": t
    });
    json.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let spec: zconfig::spec::ModelSpec = serde_json::from_value(json).unwrap();
    let model = Gpt::new(&spec).unwrap();
    let shape = GptShape {
        family,
        d_model: d,
        n_heads: heads,
        head_dim: spec.head_dim(),
        ffn: spec.ffn(),
        vocab,
        seq_len: t,
        eps: spec.norm_eps() as f32,
    };
    let Some(mut gpu) = gpu_model_or_skip(test, shape) else {
        return;
    };
    if let Some(h) = half {
        if let Err(e) = gpu.use_half_products(h) {
            eprintln!("{test}: skipped: {e}");
            return;
        }
    }
    if products == Products::Tf32FusedAttention {
        gpu.allow_tf32().unwrap();
    }
    if matches!(
        products,
        Products::Bf16FusedAttention | Products::F16FusedAttention | Products::Tf32FusedAttention
    ) {
        gpu.use_fused_attention()
            .expect("fused attention at a width it has kernels for");
    }
    // bf16 operands carry 8 bits: each product moves by about 2^-9 of its
    // terms, and a block chains a few of them; f16's and TF32's 11 bits,
    // 2^-12. The least error says the rounding was on. f16 measured on the
    // CPU GPU 2.9e-4 to 9.0e-4 (bf16 2.3e-3 to 7.2e-3, so its bound also
    // says that f16 was not rounded as bf16).
    let (bound, loss_bound, least) = match products {
        Products::F32 => (BOUND, 1e-6, 0.0),
        Products::Bf16 | Products::Bf16FusedAttention => (5e-2, 1e-2, 1e-4),
        Products::F16 | Products::F16FusedAttention => (2e-3, 2e-3, 1e-6),
        Products::Tf32FusedAttention => (1e-2, 2e-3, 1e-6),
    };
    let tied = spec.tied();
    let layout = model.layout();
    let groups = model.groups();
    let shapes = |g: usize| -> Vec<Vec<usize>> {
        groups[g].params.iter().map(|p| p.shape.clone()).collect()
    };
    let emb = perturbed(model.init_group(0, 3), 1);
    let block = perturbed(model.init_group(1, 3), 2);
    let head = perturbed(model.init_group(2, 3), 3);
    let mut tokens: Vec<u32> = (0..b * t).map(|i| ((i * 31 + 7) % vocab) as u32).collect();
    let eos = vocab as u32 - 1;
    let ends = [0, 1, 20, t - 1, t + 40, 2 * t + 5, 2 * t + 6];
    let docs = documents.then(|| {
        for (i, tok) in tokens.iter_mut().enumerate() {
            if ends.contains(&i) {
                *tok = eos;
            } else if *tok == eos {
                *tok = 0;
            }
        }
        zmodel::Documents::after_eos(&tokens, t, eos)
    });
    let firsts = docs.as_ref().map(|d| d.per_token());
    // Every fifth target left out, as a loss mask leaves a prompt's out,
    // and the sum divided by another count than the rows (a step's).
    let targets: Vec<u32> = (0..b * t)
        .map(|i| match i % 5 {
            4 => zmodel::head::IGNORED,
            _ => ((i * 17 + 3) % vocab) as u32,
        })
        .collect();
    let divisor = (b * t - b * t / 5 + 3) as f64;

    // The CPU model.
    let tok = Tensor::from_vec(tokens.clone(), (b, t), &Device::Cpu).unwrap();
    let tgt = Tensor::from_vec(targets.clone(), (b, t), &Device::Cpu).unwrap();
    let ep = EmbeddingParams::from_vec(tensors(&emb, &shapes(0)), layout).unwrap();
    let bp = BlockParams::from_vec(tensors(&block, &shapes(1)), layout).unwrap();
    let hp = HeadParams::from_vec(tensors(&head, &shapes(2)), layout).unwrap();
    let x = model.embed_documents(&ep, &tok, docs.as_ref()).unwrap();
    let (y, acts) = model
        .block_forward_documents(
            &bp,
            &x,
            docs.as_ref(),
            zmodel::BlockDropout {
                hidden: None,
                attention: attention_dropout,
            },
        )
        .unwrap();
    let hb = model
        .head_backward(&hp, tied.then_some(&ep.wte), &y, &tgt, 1.0, divisor)
        .unwrap();
    let (bgrads, dx) = model.block_backward(&bp, &acts, &hb.dx).unwrap();
    let bgrads: Vec<Vec<f32>> = bgrads.into_vec().iter().map(values).collect();

    // The GPU model, twice: the second run must repeat the first's bits.
    // With `copy` (16-bit products), each group also holds a 16-bit working
    // copy, flat with gaps between its tensors, and the tensors only
    // products read (zmodel's `product_operand`: the linears' weights, an
    // untied head's matrix; not the embedding's table, whose rows the
    // embedding gathers in f32) are held in it alone, with no f32 values: the
    // same bits then say that products read their weights from the copy, at
    // each tensor's start, and that nothing else reads those tensors. The
    // gaps keep each tensor on a 16-byte boundary, as the engine's layouts
    // put them wherever d_model is a multiple of 8: cuBLAS chooses its
    // kernel by the operands' alignment too, and on an H200 (2026-11-30)
    // bf16 products of weights 2 bytes off that boundary (gaps of 5) gave
    // other bits than the same values in a fresh, aligned buffer.
    // With `frozen`, the block's linear weights and the output matrix are
    // frozen: their gradients are not made, and nothing else moves.
    let linear_weights: Vec<bool> = groups[1].params.iter().map(|p| p.product_operand).collect();
    let run = |copy: bool, frozen: bool| {
        let up = |gi: usize| {
            let g = [&emb, &block, &head][gi];
            let refs: Vec<&[f32]> = g.iter().map(|v| v.as_slice()).collect();
            let Some(h) = half.filter(|_| copy) else {
                return gpu.upload(&refs).unwrap();
            };
            let mut ranges = Vec::new();
            let mut flat = Vec::new();
            for v in g {
                flat.extend([0.0; 8]);
                ranges.push(flat.len()..flat.len() + v.len());
                flat.extend(v);
            }
            let mut flat16 = gpu.gpu().zeros(flat.len()).unwrap();
            let flat = gpu.gpu().upload(&flat).unwrap();
            gpu.gpu()
                .round16(h, &flat.slice(..), &mut flat16.slice_mut(..))
                .unwrap();
            let parts = (g.iter().zip(&groups[gi].params))
                .map(|(v, spec)| match gi != 0 && spec.product_operand {
                    true => None,
                    false => Some(gpu.gpu().upload(v).unwrap()),
                })
                .collect::<Vec<_>>();
            assert!(
                gi != 1 || parts.iter().any(Option::is_none),
                "no block matrix held alone"
            );
            Weights::with_half(parts, h, flat16, ranges).unwrap()
        };
        let (ew, w, hw) = (up(0), up(1), up(2));
        let gx = gpu.embed_documents(&tokens, firsts, b, t, &ew).unwrap();
        let frozen_slots = match frozen {
            true => linear_weights.clone(),
            false => vec![false; linear_weights.len()],
        };
        let (gy, gacts) = gpu
            .block_forward(
                &w,
                gx,
                crate::Dropouts {
                    hidden: None,
                    attention: attention_dropout.map(|d| crate::Mask {
                        threshold: d.threshold(),
                        scale: d.scale(),
                        key: d.key(),
                    }),
                },
                &frozen_slots,
            )
            .unwrap();
        let y_host = gpu.download(&gy).unwrap();
        let pass = crate::HeadPass::Backward { output: !frozen };
        let out = gpu
            .head(&gy, &hw, tied.then_some(&ew), &targets, 1.0, divisor, pass)
            .unwrap();
        let gdy = out.dx.as_ref().unwrap();
        let dy_host = gpu.download(gdy).unwrap();
        if frozen {
            // The forward kept no input of a frozen weight: a backward
            // that would take its gradient says so.
            let all = vec![false; linear_weights.len()];
            let err = gpu.block_backward(&w, &gacts, gdy, &all).err();
            let err = err
                .expect("a weight's gradient without its input")
                .to_string();
            assert!(
                err.contains("kept no input of a weight that trains"),
                "{err}"
            );
        }
        let (grads, gdx) = gpu.block_backward(&w, &gacts, gdy, &frozen_slots).unwrap();
        let dx_host = gpu.download(&gdx).unwrap();
        let hg = out.grads.unwrap();
        let head_grads = gpu.download_all(&[hg.norm, hg.out.into_iter().collect()].concat());
        let made: Vec<_> = grads.iter().flatten().cloned().collect();
        let mut made = gpu.download_all(&made).unwrap().into_iter();
        let grads: Vec<Option<Vec<f32>>> = (grads.iter())
            .map(|g| g.as_ref().map(|_| made.next().expect("one for each")))
            .collect();
        (
            y_host,
            out.loss,
            head_grads.unwrap(),
            dy_host,
            grads,
            dx_host,
        )
    };
    let first = run(false, false);
    let (gy, gloss, ghead, gdy, ggrads, gdx) = &first;

    let mut report = Vec::new();
    let mut worst = 0f64;
    let mut check = |what: String, got: &[f32], want: &[f32]| {
        let e = rel_err(&what, got, want);
        report.push(format!("{what}: {e:.2e}"));
        worst = worst.max(e);
        assert!(e < bound, "{what}: relative error {e:.3e} ≥ {bound:e}");
    };
    check("block output".into(), gy, &values(&y));
    check("head dx".into(), gdy, &values(&hb.dx));
    check(
        "final norm weight grad".into(),
        &ghead[0],
        &values(&hb.norm.weight),
    );
    if let Some(bias) = hb.norm.bias.as_ref() {
        check("final norm bias grad".into(), &ghead[1], &values(bias));
    }
    check(
        "output matrix grad".into(),
        ghead.last().unwrap(),
        &values(hb.out.as_ref().expect("a head that trains")),
    );
    assert_eq!(ggrads.len(), bgrads.len(), "the block's gradients");
    for (i, (g, c)) in ggrads.iter().zip(&bgrads).enumerate() {
        let g = g.as_ref().expect("nothing frozen");
        check(format!("block {}", groups[1].params[i].name), g, c);
    }
    check("block dx".into(), gdx, &values(&dx));
    let loss_err = (gloss - hb.loss).abs() / hb.loss.abs();
    assert!(loss_err < loss_bound, "loss {gloss} against {}", hb.loss);
    eprintln!(
        "GPU{} against CPU (relative error):\n  {}",
        match products {
            Products::F32 => "",
            Products::Bf16 => " with bf16 products",
            Products::Bf16FusedAttention => " with bf16 products and fused attention",
            Products::F16 => " with f16 products",
            Products::F16FusedAttention => " with f16 products and fused attention",
            Products::Tf32FusedAttention => " with TF32 products and fused attention",
        },
        report.join("\n  ")
    );
    assert!(
        worst >= least,
        "products within f32's rounding ({worst:.2e}): were 16-bit or TF32 products on?"
    );

    let second = run(false, false);
    assert!(first == second, "the GPU's second run changed bits");
    // Frozen: the same bits for everything made, nothing for the frozen.
    let (fy, floss, fhead, fdy, fgrads, fdx) = run(false, true);
    assert!(
        (fy, floss, fdy, fdx) == (first.0.clone(), first.1, first.3.clone(), first.5.clone()),
        "frozen weights changed the forward or an input's gradient"
    );
    assert!(
        fhead[..] == first.2[..first.2.len() - 1],
        "frozen output matrix: the norm's gradients moved, or the matrix's was made"
    );
    for (i, (f, g)) in fgrads.iter().zip(&first.4).enumerate() {
        let name = &groups[1].params[i].name;
        match linear_weights[i] {
            true => assert!(f.is_none(), "{name}: frozen, yet its gradient was made"),
            false => assert!(f == g, "{name}: its gradient moved when the weights froze"),
        }
    }
    assert!(
        linear_weights.iter().filter(|&&w| w).count() == 4,
        "four linear weights"
    );
    if half.is_some() {
        let from_copy = run(true, false);
        assert!(
            first == from_copy,
            "products reading the weights' 16-bit working copy changed bits"
        );
    }

    // The embedding's backward on the GPU is the CPU's scatter-add to the
    // bit, given the same dx (repeated tokens included: 97 ids over 144 rows).
    let dx_host: Vec<f32> = gdx.clone();
    let dx_cpu = Tensor::from_vec(dx_host.clone(), (b, t, d), &Device::Cpu).unwrap();
    let want = model
        .embed_backward(&tok, docs.as_ref(), &dx_cpu, true)
        .unwrap();
    let table = want.wte.as_ref().expect("the token table trains");
    let dx_dev = gpu.rows_from_host(&dx_host, b, t).unwrap();
    let got = gpu.embed_backward(&tokens, firsts, &dx_dev).unwrap();
    let got = gpu.download_all(&got).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let table = table.whole(model.config().vocab_size);
    assert_eq!(bits(&got[0]), bits(&table), "wte's gradient");
    match want.wpe.as_ref() {
        Some(wpe) => assert_eq!(bits(&got[1]), bits(&values(wpe)), "wpe's gradient"),
        None => assert_eq!(got.len(), 1, "LLaMA has no position table"),
    }
}
