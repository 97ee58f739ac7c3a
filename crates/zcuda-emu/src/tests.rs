//! Each kernel on the CPU emulation against the CPU model (zmodel), as
//! `crates/zcuda/src/tests_gpt.rs` holds the GPU's: relative errors in f32
//! (products and sums in other orders, the C library's exp), or exact
//! where a kernel only moves values.

use candle_core::{Device, Tensor};
use zmodel::llama_ops;

use super::*;

/// Relative error bound of f32 results computed in another order.
const BOUND: f64 = 1e-5;

/// Values in [-1, 1) from a fixed sequence.
fn wave(len: usize, salt: u32) -> Vec<f32> {
    let mut state = 0x2545_F491u32 ^ salt.wrapping_mul(0x9E37_79B9);
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (state >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

fn tensor(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// ‖got − want‖ / ‖want‖, after checking both are finite and `want` is not
/// all zero.
fn rel_err(what: &str, got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite");
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (f64::from(g) - f64::from(w)).powi(2);
        den += f64::from(w).powi(2);
    }
    assert!(den > 0.0, "{what}: the CPU's values are all zero");
    (num / den).sqrt()
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    let e = rel_err(what, got, want);
    assert!(e < BOUND, "{what}: relative error {e:.3e} ≥ {BOUND:e}");
}

// Rows that do not fill a block's 256 threads, and more rows than one chunk
// of the parameter gradients (64).
const ROWS: usize = 70;
const D: usize = 96;

#[test]
fn the_emulator_gives_layer_norm_as_the_cpu_model() {
    // The kernel that has run on GPUs, as a check of the emulation itself
    // (block sums through shuffles and barriers).
    let (x, w, b) = (wave(ROWS * D, 1), wave(D, 2), wave(D, 3));
    let (y, _, _) = layer_norm(&x, &w, &b, 1e-5);
    let want = zmodel::ops::layer_norm(
        &tensor(&x, &[ROWS, D]),
        &tensor(&w, &[D]),
        &tensor(&b, &[D]),
        1e-5,
    )
    .unwrap();
    close("layer norm", &y, &values(&want));
}

#[test]
fn rms_norm_and_its_backward_match_the_cpu_model() {
    let eps = 1e-5;
    let (x, w, dy, res) = (
        wave(ROWS * D, 4),
        wave(D, 5),
        wave(ROWS * D, 6),
        wave(ROWS * D, 7),
    );
    let (y, rstd) = rms_norm(&x, &w, eps as f32);
    let (xt, wt) = (tensor(&x, &[ROWS, D]), tensor(&w, &[D]));
    close(
        "rms norm",
        &y,
        &values(&llama_ops::rms_norm(&xt, &wt, eps).unwrap()),
    );
    let (dx, dw) = rms_norm_backward(&x, &w, &rstd, &dy, Some(&res));
    let (want_dx, want_dw) = llama_ops::rms_norm_backward(
        &xt,
        &wt,
        &tensor(&dy, &[ROWS, D]),
        eps,
        Some(&tensor(&res, &[ROWS, D])),
    )
    .unwrap();
    close("rms norm dx + residual", &dx, &values(&want_dx));
    close("rms norm dw", &dw, &values(&want_dw));
    let (dx, _) = rms_norm_backward(&x, &w, &rstd, &dy, None);
    let (want_dx, _) =
        llama_ops::rms_norm_backward(&xt, &wt, &tensor(&dy, &[ROWS, D]), eps, None).unwrap();
    close("rms norm dx", &dx, &values(&want_dx));
}

#[test]
fn swiglu_and_its_backward_match_the_cpu_model() {
    let f = 40;
    // Gates from -8 to 8, where σ saturates both ways.
    let h: Vec<f32> = wave(ROWS * 2 * f, 8).iter().map(|v| 8.0 * v).collect();
    let dy = wave(ROWS * f, 9);
    let ht = tensor(&h, &[ROWS, 2 * f]);
    close(
        "swiglu",
        &swiglu(&h, f),
        &values(&llama_ops::swiglu(&ht).unwrap()),
    );
    let want = llama_ops::swiglu_backward(&ht, &tensor(&dy, &[ROWS, f])).unwrap();
    close(
        "swiglu backward",
        &swiglu_backward(&h, &dy, f),
        &values(&want),
    );
}

#[test]
fn rope_with_the_gpus_table_matches_the_cpu_model_and_turns_back() {
    // 4 query heads on 2 key/value heads of 16; sequences of 24 positions
    // of a model of 32; a small base, so that far positions turn a lot.
    let (b, t, seq_len, heads, kv, hd, theta) = (3, 24, 32, 4, 2, 16, 100.0);
    let ld = (heads + 2 * kv) * hd;
    let qkv: Vec<f32> = wave(b * t * ld, 10);
    let (cos, sin) = zcuda::rotary_table(theta, seq_len, hd);
    let qt = tensor(&qkv, &[b, t, ld]);
    let mut turned = qkv.clone();
    rope(&mut turned, &cos, &sin, ld, heads + kv, hd, t, 1.0);
    let want = llama_ops::rope(&qt, heads, kv, theta, false).unwrap();
    close("rope", &turned, &values(&want));
    // v passes untouched.
    for r in 0..b * t {
        let v = (heads + kv) * hd..ld;
        assert_eq!(turned[r * ld..][v.clone()], qkv[r * ld..][v], "v moved");
    }
    let mut back = qkv.clone();
    rope(&mut back, &cos, &sin, ld, heads + kv, hd, t, -1.0);
    let want = llama_ops::rope(&qt, heads, kv, theta, true).unwrap();
    close("rope backward", &back, &values(&want));
    rope(&mut turned, &cos, &sin, ld, heads + kv, hd, t, -1.0);
    close("turned and back", &turned, &qkv);
}

#[test]
fn grouped_heads_gather_and_their_backward_adds_each_group_in_order() {
    let (b, t, h, kv, hd) = (2, 5, 6, 2, 8);
    let group = h / kv;
    let ld = (h + 2 * kv) * hd;
    let col0 = h * hd; // the keys
    let rows = wave(b * t * ld, 11);
    let heads = kv_rows_to_heads(&rows, ld, col0, b, t, h, hd, group);
    for s in 0..b {
        for j in 0..h {
            for p in 0..t {
                for c in 0..hd {
                    let want = rows[(s * t + p) * ld + col0 + (j / group) * hd + c];
                    assert_eq!(heads[((s * h + j) * t + p) * hd + c], want, "head {j}");
                }
            }
        }
    }
    let grads = wave(b * h * t * hd, 12);
    let mut out = vec![f32::NAN; b * t * ld];
    heads_to_kv_rows(&grads, &mut out, ld, col0, b, t, h, hd, group);
    for s in 0..b {
        for p in 0..t {
            for (col, &got) in out[(s * t + p) * ld..][..ld].iter().enumerate() {
                if !(col0..col0 + kv * hd).contains(&col) {
                    assert!(got.is_nan(), "column {col} outside the keys written");
                    continue;
                }
                let (k, c) = ((col - col0) / hd, (col - col0) % hd);
                let want = (0..group).fold(0f32, |acc, j| {
                    acc + grads[((s * h + k * group + j) * t + p) * hd + c]
                });
                assert_eq!(got.to_bits(), want.to_bits(), "key head {k}, column {c}");
            }
        }
    }
}

#[test]
fn embedding_without_positions_and_linears_without_bias() {
    let (t, d, vocab) = (7, 12, 9);
    let tokens: Vec<u32> = (0..3 * t as u32).map(|i| (i * 5 + 2) % vocab).collect();
    let (wte, wpe) = (wave(vocab as usize * d, 13), wave(t * d, 14));
    let plain = embed(&tokens, &wte, None, t, d);
    let placed = embed(&tokens, &wte, Some(&wpe), t, d);
    for (r, &tok) in tokens.iter().enumerate() {
        for c in 0..d {
            let v = wte[tok as usize * d + c];
            assert_eq!(plain[r * d + c], v);
            assert_eq!(placed[r * d + c], v + wpe[(r % t) * d + c]);
        }
    }
    let (y0, b, res) = (wave(5 * d, 15), wave(d, 16), wave(5 * d, 17));
    for (bias, residual) in [
        (None, Some(&res[..])),
        (Some(&b[..]), None),
        (Some(&b[..]), Some(&res[..])),
    ] {
        let mut y = y0.clone();
        bias_residual(&mut y, bias, residual, d);
        for (i, &got) in y.iter().enumerate() {
            let v = bias.map_or(y0[i], |b| y0[i] + b[i % d]);
            let want = residual.map_or(v, |r| r[i] + v);
            assert_eq!(got.to_bits(), want.to_bits(), "value {i}");
        }
    }
}
