//! `attention.cu`'s fused attention on the CPU emulation, with bf16, f16
//! and TF32 products: against an f64 reference on the same rounded q, k, v and
//! output gradient (what is left is the kernels' own rounding: the
//! probabilities and their gradient rounded as operands of the second
//! products, f32 sums), and against the CPU model's attention in f32
//! (zmodel, the oracle of the layout: which columns hold which head, which
//! key/value head a query head reads), within what rounding the inputs
//! costs.

use candle_core::{Device, Tensor};
use zmodel::attention::{causal_attention, causal_attention_backward, Heads};
use zmodel::linear::Products;
use zmodel::Dropout;

use crate::tests::rounded16;
use crate::{flash_attention, flash_attention_backward, FlashProducts, FlashShape, Fmt16};

/// Values in [-2, 2) from a fixed sequence (scores of a few units, so that
/// the softmax is neither flat nor one-hot).
fn wave(len: usize, salt: u32) -> Vec<f32> {
    crate::tests::wave(len, salt)
        .into_iter()
        .map(|v| 2.0 * v)
        .collect()
}

/// `x` rounded as the products' operands: to bf16 or f16 (nearest, ties to
/// even) or to TF32 (nearest, ties away from zero), as f64.
fn rounded(x: f32, products: FlashProducts) -> f64 {
    let b = x.to_bits();
    f64::from(f32::from_bits(match products {
        FlashProducts::Bf16 => (b.wrapping_add(0x7fff + ((b >> 16) & 1))) & 0xffff_0000,
        FlashProducts::Tf32 => (b + 0x1000) & 0xffff_e000,
        FlashProducts::F16 => return f64::from(half::f16::from_f32(x)),
    }))
}

/// ‖got − want‖ / ‖want‖, after checking that `got` is finite.
fn rel_err(what: &str, got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite");
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (f64::from(g) - w).powi(2);
        den += w * w;
    }
    assert!(den > 0.0, "{what}: the reference is all zero");
    (num / den).sqrt()
}

/// The reference: (out, lse, dqkv) in f64 from the rounded values of q, k,
/// v and dout; with `first`, each row sees keys from its document's first;
/// with `drop`, the probabilities dropped by it (zmodel's mask of element
/// ((b·heads + h)·t + i)·t + j) before V multiplies them, and their
/// gradient dropped by it before the softmax's backward.
fn reference(
    qkv: &[f32],
    first: Option<&[u32]>,
    dout: &[f32],
    sh: FlashShape,
    drop: Option<Dropout>,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let FlashShape {
        b,
        t,
        heads,
        kv,
        hd,
        products,
    } = sh;
    let round = |x: f32| rounded(x, products);
    let (ld, d, group) = ((heads + 2 * kv) * hd, heads * hd, heads / kv);
    let scale = 1.0 / (hd as f64).sqrt();
    let at = |s: usize, i: usize, col: usize| round(qkv[(s * t + i) * ld + col]);
    let mut out = vec![0.0; b * t * d];
    let mut lse = vec![0.0; b * heads * t];
    let mut dqkv = vec![0.0; b * t * ld];
    for s in 0..b {
        for h in 0..heads {
            let (qc, kc, vc) = (h * hd, d + (h / group) * hd, d + (kv + h / group) * hd);
            for i in 0..t {
                let lo = first.map_or(0, |f| f[s * t + i] as usize);
                let score = |j: usize| {
                    (0..hd)
                        .map(|c| at(s, i, qc + c) * at(s, j, kc + c))
                        .sum::<f64>()
                        * scale
                };
                let keys = lo..=i;
                let m = keys.clone().map(score).fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = keys.clone().map(|j| (score(j) - m).exp()).sum();
                lse[(s * heads + h) * t + i] = m + sum.ln();
                // p, its mask's factor (0, or 1 / (1 − rate)) and dp
                // indexed by key − lo.
                let p: Vec<f64> = keys.clone().map(|j| (score(j) - m).exp() / sum).collect();
                let kept: Vec<f64> = keys
                    .clone()
                    .map(|j| {
                        let at = ((s * heads + h) * t + i) * t + j;
                        drop.map_or(1.0, |d| f64::from(d.apply_one(at, 1.0)))
                    })
                    .collect();
                let row = (s * t + i) * d + qc;
                let g: Vec<f64> = (0..hd).map(|c| round(dout[row + c])).collect();
                for c in 0..hd {
                    out[row + c] = keys
                        .clone()
                        .map(|j| p[j - lo] * kept[j - lo] * at(s, j, vc + c))
                        .sum();
                }
                // The undropped probabilities' gradient.
                let dp: Vec<f64> = keys
                    .clone()
                    .map(|j| kept[j - lo] * (0..hd).map(|c| g[c] * at(s, j, vc + c)).sum::<f64>())
                    .collect();
                let dot: f64 = p.iter().zip(&dp).map(|(p, dp)| p * dp).sum();
                for j in keys {
                    let (p, dp, kept) = (p[j - lo], dp[j - lo], kept[j - lo]);
                    let ds = p * (dp - dot) * scale;
                    for c in 0..hd {
                        dqkv[(s * t + i) * ld + qc + c] += ds * at(s, j, kc + c);
                        dqkv[(s * t + j) * ld + kc + c] += ds * at(s, i, qc + c);
                        dqkv[(s * t + j) * ld + vc + c] += p * kept * g[c];
                    }
                }
            }
        }
    }
    (out, lse, dqkv)
}

/// One tile and a partial one (t = 80), more than two tiles with grouped
/// heads (t = 130, 4 on 2), a whole tile at head width 64 with every query
/// head on one key/value head, and a sequence shorter than a warp's rows,
/// each with bf16, f16 and TF32 products; and at head width 128 (tiles of
/// 32 and 16 rows walked, bf16 and f16 only) two blocks' rows and a
/// partial tile with grouped heads (t = 100, 2 on 1) and a short sequence.
fn shapes() -> Vec<FlashShape> {
    let all = [
        (2, 80, 3, 3, 16),
        (1, 130, 4, 2, 32),
        (2, 64, 2, 1, 64),
        (1, 5, 2, 2, 16),
    ];
    let wide = [(1, 100, 2, 1, 128), (2, 9, 1, 1, 128)];
    let shape = |products| {
        move |(b, t, heads, kv, hd)| FlashShape {
            b,
            t,
            heads,
            kv,
            hd,
            products,
        }
    };
    [FlashProducts::Bf16, FlashProducts::F16, FlashProducts::Tf32]
        .into_iter()
        .flat_map(|products| {
            let sixteen = products != FlashProducts::Tf32;
            all.into_iter()
                .chain(wide.into_iter().filter(move |_| sixteen))
                .map(shape(products))
        })
        .collect()
}

#[test]
fn fused_attention_matches_an_f64_reference_of_its_rounded_operands() {
    for (n, sh) in shapes().into_iter().enumerate() {
        let ld = (sh.heads + 2 * sh.kv) * sh.hd;
        let qkv = wave(sh.b * sh.t * ld, 2 * n as u32);
        let dout = wave(sh.b * sh.t * sh.heads * sh.hd, 2 * n as u32 + 1);
        // With 16-bit products the output is written in their format too
        // (the operand of the projection after it): the f32 output rounded.
        let fmt = match sh.products {
            FlashProducts::Bf16 => Some(Fmt16::Bf16),
            FlashProducts::F16 => Some(Fmt16::F16),
            FlashProducts::Tf32 => None,
        };
        let mut out16 = vec![0u16; dout.len()];
        let (out, lse) = flash_attention(&qkv, None, sh, fmt.map(|f| (f, &mut out16[..])), None);
        if let Some(f) = fmt {
            assert_eq!(out16, rounded16(f, &out), "{sh:?}: the 16-bit output");
        }
        let dqkv = flash_attention_backward(&qkv, None, &out, &lse, &dout, sh, None);
        let (want_out, want_lse, want_dqkv) = reference(&qkv, None, &dout, sh, None);
        let e_out = rel_err("out", &out, &want_out);
        let e_lse = rel_err("lse", &lse, &want_lse);
        let e_dqkv = rel_err("dqkv", &dqkv, &want_dqkv);
        eprintln!("{sh:?}: out {e_out:.2e}, lse {e_lse:.2e}, dqkv {e_dqkv:.2e}");
        // The probabilities and their gradient rounded as operands (bf16:
        // 2⁻⁹ relative each; f16 and TF32: 2⁻¹²). The emulation measured,
        // bf16: 0.6-0.9e-3 (out) and 1.9-2.3e-3 (dqkv); f16: 0.5-1.2e-4 and
        // 2.4-3.3e-4; TF32: 0.7-1.2e-4 and 2.4-3.3e-4; the log-sum-exp is
        // f32 throughout (3-5e-8).
        let (out_bound, dqkv_bound) = match sh.products {
            FlashProducts::Bf16 => (2.5e-3, 5e-3),
            FlashProducts::F16 | FlashProducts::Tf32 => (3e-4, 8e-4),
        };
        assert!(e_out < out_bound, "{sh:?}: out off by {e_out:.3e}");
        assert!(e_lse < 1e-6, "{sh:?}: lse off by {e_lse:.3e}");
        assert!(e_dqkv < dqkv_bound, "{sh:?}: dqkv off by {e_dqkv:.3e}");
    }
}

#[test]
fn fused_attention_is_the_cpu_models_attention() {
    for (n, sh) in shapes().into_iter().enumerate() {
        let ld = (sh.heads + 2 * sh.kv) * sh.hd;
        let qkv = wave(sh.b * sh.t * ld, 10 + n as u32);
        let dout = wave(sh.b * sh.t * sh.heads * sh.hd, 20 + n as u32);
        let (out, lse) = flash_attention(&qkv, None, sh, None, None);
        let dqkv = flash_attention_backward(&qkv, None, &out, &lse, &dout, sh, None);
        let (want, want_d) = cpu_attention(&qkv, &dout, sh, None, None);
        let e_out = rel_err("out", &out, &want);
        let e_dqkv = rel_err("dqkv", &dqkv, &want_d);
        eprintln!("{sh:?} against the CPU model: out {e_out:.2e}, dqkv {e_dqkv:.2e}");
        // q, k, v and dout rounded too, as the GPU's unfused products round
        // them: measured 2.6-2.7e-3 (out) and 3.7-3.9e-3 (dqkv) in bf16,
        // 2.4-3.6e-4 and 3.7-4.7e-4 in f16, 3.3e-4 and 4.8e-4 in TF32 (a
        // bf16 rounding in place of f16's fails these bounds).
        let (out_bound, dqkv_bound) = match sh.products {
            FlashProducts::Bf16 => (8e-3, 1e-2),
            FlashProducts::F16 | FlashProducts::Tf32 => (1e-3, 1.5e-3),
        };
        assert!(e_out < out_bound, "{sh:?}: out off by {e_out:.3e}");
        assert!(e_dqkv < dqkv_bound, "{sh:?}: dqkv off by {e_dqkv:.3e}");
    }
}

/// Packed documents kept apart: each row attends from its document's first
/// row. Documents of one token, a tile's boundary inside a document and at
/// one (keys 63 | 64), a document over three tiles of 32, a block whose rows all
/// begin after its first tile (the walks start later), one whose keys no
/// later query sees (the key/value walk stops early) and one whose last
/// key begins a document that later queries see; against the f64
/// reference with the same documents and against the CPU model's attention
/// with them (zmodel), at head widths 32 and 128 (tiles of 64, and of 32
/// and 16), with every kind of product.
#[test]
fn fused_attention_keeps_packed_documents_apart() {
    let t = 136;
    let ends = [0, 1, 2, 63, 64, 70, 100, t + 5, t + 62, t + 120];
    let docs = crate::tests::documents(2, t, &ends);
    let first = docs.per_token();
    assert_eq!((first[64], first[65], first[128]), (64, 65, 101));
    assert_eq!((first[t + 63], first[t + 64]), (63, 63));
    let mut shapes = Vec::new();
    for products in [FlashProducts::Bf16, FlashProducts::F16, FlashProducts::Tf32] {
        shapes.push(FlashShape {
            b: 2,
            t,
            heads: 4,
            kv: 2,
            hd: 32,
            products,
        });
        if products != FlashProducts::Tf32 {
            shapes.push(FlashShape {
                b: 2,
                t,
                heads: 2,
                kv: 1,
                hd: 128,
                products,
            });
        }
    }
    for (n, sh) in shapes.into_iter().enumerate() {
        let ld = (sh.heads + 2 * sh.kv) * sh.hd;
        let qkv = wave(sh.b * sh.t * ld, 40 + n as u32);
        let dout = wave(sh.b * sh.t * sh.heads * sh.hd, 50 + n as u32);
        let (out, lse) = flash_attention(&qkv, Some(first), sh, None, None);
        let dqkv = flash_attention_backward(&qkv, Some(first), &out, &lse, &dout, sh, None);
        let (want_out, want_lse, want_dqkv) = reference(&qkv, Some(first), &dout, sh, None);
        let e_out = rel_err("out", &out, &want_out);
        let e_lse = rel_err("lse", &lse, &want_lse);
        let e_dqkv = rel_err("dqkv", &dqkv, &want_dqkv);
        // The CPU model's attention with the same documents, in f32.
        let (cpu, cpu_d) = cpu_attention(&qkv, &dout, sh, Some(&docs), None);
        let e_cpu = rel_err("out against the CPU", &out, &cpu);
        let e_cpu_d = rel_err("dqkv against the CPU", &dqkv, &cpu_d);
        eprintln!(
            "{sh:?} with documents: out {e_out:.2e}, lse {e_lse:.2e}, dqkv {e_dqkv:.2e}; against the CPU model {e_cpu:.2e}, {e_cpu_d:.2e}"
        );
        within_bounds(sh, [e_out, e_lse, e_dqkv], [e_cpu, e_cpu_d]);
        // A one-token document attends to itself alone: its output is its
        // own value row.
        let (d, vc) = (sh.heads * sh.hd, sh.heads * sh.hd + sh.kv * sh.hd);
        let (row, head) = (1, 1);
        let kvh = head / (sh.heads / sh.kv);
        for c in 0..sh.hd {
            let v = rounded(qkv[row * ld + vc + kvh * sh.hd + c], sh.products);
            let got = f64::from(out[row * d + head * sh.hd + c]);
            assert!(
                (got - v).abs() <= 1e-6 * v.abs().max(1.0),
                "row 1, column {c}: {got} for {v}"
            );
        }
    }
}

/// The bounds of the whole-sequence tests above on (out, lse, dqkv) from
/// the f64 reference and (out, dqkv) from the CPU model.
fn within_bounds(sh: FlashShape, [e_out, e_lse, e_dqkv]: [f64; 3], [e_cpu, e_cpu_d]: [f64; 2]) {
    let (out_bound, dqkv_bound, cpu_bounds) = match sh.products {
        FlashProducts::Bf16 => (2.5e-3, 5e-3, (8e-3, 1e-2)),
        FlashProducts::F16 | FlashProducts::Tf32 => (3e-4, 8e-4, (1e-3, 1.5e-3)),
    };
    assert!(e_out < out_bound, "{sh:?}: out off by {e_out:.3e}");
    assert!(e_lse < 1e-6, "{sh:?}: lse off by {e_lse:.3e}");
    assert!(e_dqkv < dqkv_bound, "{sh:?}: dqkv off by {e_dqkv:.3e}");
    assert!(
        e_cpu < cpu_bounds.0,
        "{sh:?}: out off the CPU's by {e_cpu:.3e}"
    );
    assert!(
        e_cpu_d < cpu_bounds.1,
        "{sh:?}: dqkv off the CPU's by {e_cpu_d:.3e}"
    );
}

/// The CPU model's attention (zmodel, f32 products) of `qkv` and its
/// backward from `dout`, with `docs` where documents are kept apart: (out,
/// dqkv) as f64.
fn cpu_attention(
    qkv: &[f32],
    dout: &[f32],
    sh: FlashShape,
    docs: Option<&zmodel::Documents>,
    drop: Option<Dropout>,
) -> (Vec<f64>, Vec<f64>) {
    let tensor =
        |v: &[f32], w: usize| Tensor::from_vec(v.to_vec(), (sh.b, sh.t, w), &Device::Cpu).unwrap();
    let heads = Heads {
        heads: sh.heads,
        kv: sh.kv,
    };
    let qkv = tensor(qkv, (sh.heads + 2 * sh.kv) * sh.hd);
    let out = causal_attention(&qkv, heads, Products::F32, docs, drop).unwrap();
    let dy = tensor(dout, sh.heads * sh.hd);
    let dqkv = causal_attention_backward(&qkv, &dy, heads, Products::F32, docs, drop).unwrap();
    let f64s = |t: &Tensor| -> Vec<f64> {
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v.into_iter().map(f64::from).collect()
    };
    (f64s(&out), f64s(&dqkv))
}

/// Attention's dropout in the `_dropout` kernels: every shape above, and
/// packed documents kept apart at head widths 32 and 128, with a quarter of
/// the probabilities dropped, against the f64 reference dropping by
/// zmodel's mask and against the CPU model's attention with the same
/// dropout, within the bounds of the runs without it. The dropout changes
/// the output (a kernel that dropped nothing, or dropped other elements,
/// would be a quarter of the terms off).
#[test]
fn fused_attention_drops_the_probabilities_the_cpu_model_drops() {
    let drop = Dropout::new(0.25, 7).unwrap().site(3);
    let mask = Some((drop.threshold(), drop.scale(), drop.key()));
    let t = 136;
    let docs = crate::tests::documents(2, t, &[0, 1, 63, 64, 100, t + 62, t + 120]);
    let with_docs = [(32, 4, 2), (128, 2, 1)]
        .into_iter()
        .flat_map(|(hd, heads, kv)| {
            [FlashProducts::Bf16, FlashProducts::F16, FlashProducts::Tf32]
                .into_iter()
                .filter(move |&p| hd < 128 || p != FlashProducts::Tf32)
                .map(move |products| FlashShape {
                    b: 2,
                    t,
                    heads,
                    kv,
                    hd,
                    products,
                })
        });
    let cases = shapes()
        .into_iter()
        .map(|sh| (sh, false))
        .chain(with_docs.map(|sh| (sh, true)));
    for (n, (sh, documents)) in cases.enumerate() {
        let first = documents.then(|| docs.per_token());
        let ld = (sh.heads + 2 * sh.kv) * sh.hd;
        let qkv = wave(sh.b * sh.t * ld, 60 + n as u32);
        let dout = wave(sh.b * sh.t * sh.heads * sh.hd, 80 + n as u32);
        let (out, lse) = flash_attention(&qkv, first, sh, None, mask);
        let dqkv = flash_attention_backward(&qkv, first, &out, &lse, &dout, sh, mask);
        let (want_out, want_lse, want_dqkv) = reference(&qkv, first, &dout, sh, Some(drop));
        let e_out = rel_err("out", &out, &want_out);
        let e_lse = rel_err("lse", &lse, &want_lse);
        let e_dqkv = rel_err("dqkv", &dqkv, &want_dqkv);
        let (cpu, cpu_d) = cpu_attention(&qkv, &dout, sh, documents.then_some(&docs), Some(drop));
        let e_cpu = rel_err("out against the CPU", &out, &cpu);
        let e_cpu_d = rel_err("dqkv against the CPU", &dqkv, &cpu_d);
        // Undropped, the output is far from the dropped reference.
        let (plain, _) = flash_attention(&qkv, first, sh, None, None);
        let e_plain = rel_err("undropped out", &plain, &want_out);
        eprintln!(
            "{sh:?} dropped{}: out {e_out:.2e}, lse {e_lse:.2e}, dqkv {e_dqkv:.2e}; against the CPU model {e_cpu:.2e}, {e_cpu_d:.2e}; undropped {e_plain:.2e}",
            if documents { ", with documents" } else { "" }
        );
        within_bounds(sh, [e_out, e_lse, e_dqkv], [e_cpu, e_cpu_d]);
        assert!(
            e_plain > 0.05,
            "{sh:?}: dropping changed little ({e_plain:.3e})"
        );
    }
}
