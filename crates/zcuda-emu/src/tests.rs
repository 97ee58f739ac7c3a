//! Each kernel on the CPU emulation against the CPU model (zmodel), as
//! `crates/zcuda/src/tests_gpt.rs` holds the GPU's: relative errors in f32
//! (products and sums in other orders, the C library's exp), or exact
//! where a kernel only moves values; reduce.cu's kernels bit for bit
//! against zengine's host buffers.

use candle_core::{Device, Tensor};
use zmodel::llama_ops;

use crate::*;

/// Relative error bound of f32 results computed in another order.
const BOUND: f64 = 1e-5;

/// Values in [-1, 1) from a fixed sequence.
pub(crate) fn wave(len: usize, salt: u32) -> Vec<f32> {
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

/// The two warp orders, each on a race between warps that the other hides:
/// with warp 0 ahead, thread 0's value is set before the block reads it,
/// but its sum of the warps' slots comes before the other warps set them;
/// with the last warp ahead, the other way round (every kernel test runs
/// in both: `every_kernel_test_passes_with_the_last_warp_ahead`). Built with
/// ThreadSanitizer, the probes' races are reported whatever the order
/// (`scripts/check-races.sh` requires both reports).
#[test]
fn each_warp_order_shows_the_race_the_other_hides() {
    let (blocks, threads) = (3, 128);
    let set = |b: usize| vec![b as i32; threads];
    let want_broadcast: Vec<i32> = (0..blocks).flat_map(set).collect();
    let all_slots = (1..=4).sum::<i32>();
    let (broadcast, gathered) =
        with_warp_order(WarpOrder::Forward, || race_probes(blocks, threads));
    assert_eq!(
        broadcast, want_broadcast,
        "warp 0 ahead: thread 0's value is read after it is set"
    );
    assert!(
        gathered.iter().all(|&s| s != all_slots),
        "warp 0 ahead: thread 0 adds the slots before warps 1-3 set theirs, got {gathered:?}"
    );
    let (broadcast, gathered) =
        with_warp_order(WarpOrder::Reverse, || race_probes(blocks, threads));
    assert!(
        broadcast.iter().filter(|&&v| v == -1).count() >= 3 * 32 * blocks,
        "the last warp ahead: warps 1-3 read thread 0's value before it is set"
    );
    assert_eq!(
        gathered,
        vec![all_slots; blocks],
        "the last warp ahead: every slot set before the sum"
    );
}

/// Every test of this binary again with the last warp of each block ahead
/// (`ZCUDA_EMU_WARP_ORDER=reverse`, a process of its own: the order is read
/// once a process), so that the README's test command runs every kernel in
/// both orders. A barrier that thread 0's write for the whole block needs
/// (`last_of_stripe`'s second one in `kernels/gpt.cu`) passes every test
/// without it in the forward order and fails three in this one.
#[test]
fn every_kernel_test_passes_with_the_last_warp_ahead() {
    const ME: &str = "every_kernel_test_passes_with_the_last_warp_ahead";
    if std::env::var("ZCUDA_EMU_WARP_ORDER").is_ok() {
        // The environment chose the order already (CI, or the child below).
        return;
    }
    let exe = std::env::current_exe().expect("this test binary");
    let out = std::process::Command::new(exe)
        .args(["--skip", ME, "--test-threads", "2"])
        .env("ZCUDA_EMU_WARP_ORDER", "reverse")
        .output()
        .expect("running this test binary again");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "with the last warp ahead:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("test tests_attention::fused_attention_is_the_cpu_models_attention ... ok"),
        "the run in reverse order ran the kernel tests:\n{text}"
    );
}

#[test]
fn the_emulator_gives_layer_norm_as_the_cpu_model() {
    // The kernel that has run on GPUs, as a check of the emulation itself
    // (block sums through shuffles and barriers).
    let (x, w, b) = (wave(ROWS * D, 1), wave(D, 2), wave(D, 3));
    let (y, _, _) = layer_norm(&x, &w, &b, 1e-5, None);
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
    let (y, rstd) = rms_norm(&x, &w, eps as f32, None);
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
        &swiglu(&h, f, None),
        &values(&llama_ops::swiglu(&ht).unwrap()),
    );
    let want = llama_ops::swiglu_backward(&ht, &tensor(&dy, &[ROWS, f])).unwrap();
    close(
        "swiglu backward",
        &swiglu_backward(&h, &dy, f),
        &values(&want),
    );
}

/// Documents packed into `b` sequences of `t`, ending at each id 0 of
/// tokens that are 0 at `ends` (positions in the batch, row-major): where
/// each token's document begins, as zmodel keeps them apart.
pub(crate) fn documents(b: usize, t: usize, ends: &[usize]) -> zmodel::Documents {
    let tokens: Vec<u32> = (0..b * t).map(|i| u32::from(!ends.contains(&i))).collect();
    zmodel::Documents::after_eos(&tokens, t, 0)
}

#[test]
fn rope_with_the_gpus_table_matches_the_cpu_model_and_turns_back() {
    // 4 query heads on 2 key/value heads of 16; sequences of 24 positions
    // of a model of 32; a small base, so that far positions turn a lot;
    // unscaled, scaled as Llama 3's (original context 16), as YaRN's and
    // as LongRoPE's (their attention factor on the turned values);
    // positions from each
    // sequence's start, and from each document's where packed documents
    // are kept apart.
    let (b, t, seq_len, heads, kv, hd, theta) = (3, 24, 32, 4, 2, 16, 100.0);
    let docs = documents(b, t, &[3, 4, 20, 30, 47, 48]);
    let llama3 = zconfig::spec::RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 16,
    };
    let yarn = zconfig::spec::RopeScaling::Yarn {
        factor: 4.0,
        original_max_position_embeddings: 16,
        beta_fast: None,
        beta_slow: None,
        attention_factor: None,
        mscale: None,
        mscale_all_dim: None,
        truncate: None,
    };
    // LongRoPE's long factors (the sequence is longer than its original
    // context of 16), each pair's own.
    let longrope = zconfig::spec::RopeScaling::Longrope {
        factor: 4.0,
        original_max_position_embeddings: 16,
        short_factor: vec![1.0; hd / 2],
        long_factor: (0..hd / 2).map(|i| 1.0 + i as f64 * 0.7).collect(),
        attention_factor: None,
    };
    // And Phi-4-mini's partial rotation: each head's first 12 columns of
    // 16 turned, the other 4 passed through.
    for (scaling, docs, rot) in [
        (None, None, hd),
        (Some(&llama3), None, hd),
        (Some(&llama3), Some(&docs), hd),
        (Some(&yarn), None, hd),
        (Some(&longrope), None, hd),
        (None, None, 12),
        (Some(&yarn), Some(&docs), 12),
    ] {
        let first = docs.map(|d| d.per_token());
        let ld = (heads + 2 * kv) * hd;
        let qkv: Vec<f32> = wave(b * t * ld, 10);
        let (cos, sin) = zcuda::rotary_table(theta, scaling, seq_len, rot);
        let qt = tensor(&qkv, &[b, t, ld]);
        let mut turned = qkv.clone();
        let turn = |x: &mut [f32], sign| {
            rope(x, &cos, &sin, first, ld, heads + kv, (hd, rot / 2), t, sign)
        };
        turn(&mut turned, 1.0);
        let freq = zconfig::arch::Rotary::new(theta, scaling, rot, seq_len);
        let want = llama_ops::rope(&qt, heads, kv, &freq, false, docs).unwrap();
        close("rope", &turned, &values(&want));
        // v passes untouched.
        for r in 0..b * t {
            let v = (heads + kv) * hd..ld;
            assert_eq!(turned[r * ld..][v.clone()], qkv[r * ld..][v], "v moved");
        }
        let mut back = qkv.clone();
        turn(&mut back, -1.0);
        let want = llama_ops::rope(&qt, heads, kv, &freq, true, docs).unwrap();
        close("rope backward", &back, &values(&want));
        turn(&mut turned, -1.0);
        // YaRN's and LongRoPE's factor twice over on the turned columns of
        // q and k.
        let scale2 = (freq.scale * freq.scale) as f32;
        let want: Vec<f32> = (qkv.iter().enumerate())
            .map(
                |(i, &v)| match i % ld < (heads + kv) * hd && i % ld % hd < rot {
                    true => v * scale2,
                    false => v,
                },
            )
            .collect();
        close("turned and back", &turned, &want);
    }
    // The documents moved the positions: a token after an end turns as
    // position 0 does.
    let ld = (heads + 2 * kv) * hd;
    let qkv = wave(b * t * ld, 10);
    let (cos, sin) = zcuda::rotary_table(theta, None, seq_len, hd);
    let (mut whole, mut apart) = (qkv.clone(), qkv.clone());
    rope(
        &mut whole,
        &cos,
        &sin,
        None,
        ld,
        heads + kv,
        (hd, hd / 2),
        t,
        1.0,
    );
    rope(
        &mut apart,
        &cos,
        &sin,
        Some(docs.per_token()),
        ld,
        heads + kv,
        (hd, hd / 2),
        t,
        1.0,
    );
    assert_ne!(
        whole[5 * ld..6 * ld],
        apart[5 * ld..6 * ld],
        "row 5 turned as position 5"
    );
    assert_eq!(
        apart[5 * ld..6 * ld],
        qkv[5 * ld..6 * ld],
        "row 5 is position 0 of its document"
    );
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
    let plain = embed(&tokens, &wte, None, None, t, d);
    let placed = embed(&tokens, &wte, Some(&wpe), None, t, d);
    // Positions from each document's first token where documents are kept
    // apart.
    let docs = documents(3, t, &[2, 3, 9, 20]);
    let apart = embed(&tokens, &wte, Some(&wpe), Some(docs.per_token()), t, d);
    for (r, &tok) in tokens.iter().enumerate() {
        for c in 0..d {
            let v = wte[tok as usize * d + c];
            assert_eq!(plain[r * d + c], v);
            assert_eq!(placed[r * d + c], v + wpe[(r % t) * d + c]);
            assert_eq!(apart[r * d + c], v + wpe[docs.position(r) * d + c]);
        }
    }
    assert_eq!(docs.position(4), 0, "the documents restart positions");
    let (y0, b, res) = (wave(5 * d, 15), wave(d, 16), wave(5 * d, 17));
    for (bias, residual) in [
        (None, Some(&res[..])),
        (Some(&b[..]), None),
        (Some(&b[..]), Some(&res[..])),
    ] {
        let mut y = y0.clone();
        bias_residual(&mut y, bias, residual, d, None);
        for (i, &got) in y.iter().enumerate() {
            let v = bias.map_or(y0[i], |b| y0[i] + b[i % d]);
            let want = residual.map_or(v, |r| r[i] + v);
            assert_eq!(got.to_bits(), want.to_bits(), "value {i}");
        }
    }
}

/// gpt.cu's dropout drops what zmodel's `Dropout` drops, to the bit: a
/// block's branch (its bias added) before its residual add, and NEFTune's
/// noise then the mask on the embeddings' output (zmodel's `Noise`), over
/// more values than a grid's stride, under two keys.
#[test]
fn dropout_and_neftune_drop_and_draw_what_the_cpu_model_does() {
    let (n, d) = (37usize, 96usize);
    let cpu = |v: &[f32]| Tensor::from_slice(v, (n, d), &Device::Cpu).unwrap();
    let values = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (y0, b, res) = (wave(n * d, 41), wave(d, 42), wave(n * d, 43));
    for key in [7u64, 0xDEAD_BEEF_0000_0001] {
        let drop = zmodel::Dropout::new(0.3, key).unwrap();
        let args = (drop.threshold(), drop.scale(), drop.key());
        // The branch as the CPU's linear makes it: its bias added.
        let branch: Vec<f32> = (0..n * d).map(|i| y0[i] + b[i % d]).collect();
        let want = values(drop.add_to(&cpu(&res), &cpu(&branch)).unwrap());
        let mut got = y0.clone();
        bias_residual(&mut got, Some(&b), Some(&res), d, Some(args));
        assert_eq!(bits(&got), bits(&want), "a dropped branch, key {key}");
        let kept = got.iter().zip(&res).filter(|(g, r)| g != r).count();
        assert!(
            (0.6..0.8).contains(&(kept as f64 / (n * d) as f64)),
            "{kept} of {} kept",
            n * d
        );
        let noise = zmodel::Noise::new(5.0, (n, d), key ^ 3).unwrap();
        let want = values(drop.apply(&noise.add_to(&cpu(&y0)).unwrap()).unwrap());
        let got = dropout_noise(&y0, Some(args), Some((noise.magnitude(), noise.key())));
        assert_eq!(bits(&got), bits(&want), "noise then dropout, key {key}");
        let want = values(noise.add_to(&cpu(&y0)).unwrap());
        let got = dropout_noise(&y0, None, Some((noise.magnitude(), noise.key())));
        assert_eq!(bits(&got), bits(&want), "noise alone, key {key}");
        assert_ne!(got, y0, "the noise changed nothing");
        let want = values(drop.apply(&cpu(&y0)).unwrap());
        assert_eq!(bits(&dropout_noise(&y0, Some(args), None)), bits(&want));
        let mut in_place = y0.clone();
        dropout_in_place(&mut in_place, args);
        assert_eq!(bits(&in_place), bits(&want), "in place, key {key}");
    }
}

#[test]
fn layer_norm_backward_matches_the_cpu_model() {
    let eps = 1e-5;
    let (x, w, b) = (wave(ROWS * D, 18), wave(D, 19), wave(D, 20));
    let (dy, res) = (wave(ROWS * D, 21), wave(ROWS * D, 22));
    let (_, mean, rstd) = layer_norm(&x, &w, &b, eps as f32, None);
    let (dx, dw, db) = layer_norm_backward(&x, &w, (&mean, &rstd), &dy, Some(&res));
    let (want_dx, want_dw, want_db) = zmodel::ops::layer_norm_backward(
        &tensor(&x, &[ROWS, D]),
        &tensor(&w, &[D]),
        &tensor(&dy, &[ROWS, D]),
        eps,
        Some(&tensor(&res, &[ROWS, D])),
    )
    .unwrap();
    close("layer norm dx + residual", &dx, &values(&want_dx));
    close("layer norm dw", &dw, &values(&want_dw));
    close("layer norm db", &db, &values(&want_db));
}

#[test]
fn column_sums_add_chunks_of_64_rows_then_the_chunks_in_order() {
    let (n, width) = (150, 37);
    let a = wave(n * width, 23);
    let mut want = vec![0f32; width];
    for chunk in a.chunks(64 * width) {
        let mut part = vec![0f32; width];
        for row in chunk.chunks(width) {
            part.iter_mut().zip(row).for_each(|(p, v)| *p += v);
        }
        want.iter_mut().zip(&part).for_each(|(w, p)| *w += p);
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&column_sums(&a, width, None)), bits(&want));
    // Rounding the values for 16-bit products in the same pass: the sums
    // unchanged, every value rounded to nearest even.
    for fmt in [Fmt16::Bf16, Fmt16::F16] {
        let mut a16 = vec![0u16; a.len()];
        let sums = column_sums(&a, width, Some((fmt, &mut a16)));
        assert_eq!(bits(&sums), bits(&want), "{fmt:?}: the sums");
        assert_eq!(a16, rounded16(fmt, &a), "{fmt:?}: the rounded values");
    }
}

#[test]
fn gelu_and_its_backward_match_the_cpu_model() {
    let h: Vec<f32> = wave(ROWS * D, 24).iter().map(|v| 6.0 * v).collect();
    let dg = wave(ROWS * D, 25);
    let (ht, dgt) = (tensor(&h, &[ROWS, D]), tensor(&dg, &[ROWS, D]));
    close(
        "gelu",
        &gelu(&h, None),
        &values(&zmodel::ops::gelu(&ht).unwrap()),
    );
    let want = zmodel::ops::gelu_backward(&ht, &dgt).unwrap();
    close("gelu backward", &gelu_backward(&h, &dg), &values(&want));
}

/// `v` rounded to `fmt` (to nearest, ties to even) as zgemm rounds bf16
/// and the `half` crate f16: the references of the kernels' 16-bit
/// outputs.
pub(crate) fn rounded16(fmt: Fmt16, v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|&x| match fmt {
            Fmt16::Bf16 => zgemm::bf16_bits(x),
            Fmt16::F16 => half::f16::from_f32(x).to_bits(),
        })
        .collect()
}

/// For 16-bit products the norms, GELU and SwiGLU write their output's
/// bf16 or f16 bits instead of its f32 values: the f32 output rounded to
/// nearest even, bit for bit, and no f32 output.
#[test]
fn the_products_inputs_in_16_bits_are_their_f32_outputs_rounded() {
    let zeros = |v: &[f32]| v.iter().all(|&x| x == 0.0);
    for fmt in [Fmt16::Bf16, Fmt16::F16] {
        let (x, w, b) = (wave(ROWS * D, 28), wave(D, 29), wave(D, 30));
        let mut y16 = vec![0u16; ROWS * D];
        let (y, _, _) = layer_norm(&x, &w, &b, 1e-5, None);
        let (none, mean, _) = layer_norm(&x, &w, &b, 1e-5, Some((fmt, &mut y16)));
        assert_eq!(y16, rounded16(fmt, &y), "layer norm, {fmt:?}");
        assert!(
            zeros(&none) && !zeros(&mean),
            "layer norm: {fmt:?} instead, stats kept"
        );
        let (y, _) = rms_norm(&x, &w, 1e-5, None);
        let (none, _) = rms_norm(&x, &w, 1e-5, Some((fmt, &mut y16)));
        assert_eq!(y16, rounded16(fmt, &y), "rms norm, {fmt:?}");
        assert!(zeros(&none), "rms norm: {fmt:?} instead");
        let h: Vec<f32> = wave(ROWS * D, 31).iter().map(|v| 6.0 * v).collect();
        let g = gelu(&h, None);
        assert!(
            zeros(&gelu(&h, Some((fmt, &mut y16)))),
            "gelu: {fmt:?} instead"
        );
        assert_eq!(y16, rounded16(fmt, &g), "gelu, {fmt:?}");
        let f = D / 2;
        let y = swiglu(&h, f, None);
        let mut s16 = vec![0u16; ROWS * f];
        assert!(
            zeros(&swiglu(&h, f, Some((fmt, &mut s16)))),
            "swiglu: {fmt:?} instead"
        );
        assert_eq!(s16, rounded16(fmt, &y), "swiglu, {fmt:?}");
    }
}

#[test]
fn causal_softmax_and_its_backward_match_an_f64_reference() {
    // Rows of 40 (a warp and some), four matrices: four sequences of one
    // head, or two of two heads with documents kept apart (a row sees keys
    // from its document's first).
    let (t, scale) = (40usize, 0.25f32);
    let docs = documents(2, t, &[0, 9, 10, 33, 45, 78]);
    for (first, heads) in [(None, 1), (Some(docs.per_token()), 2)] {
        causal_softmax_against_f64(t, scale, first, heads);
    }
}

fn causal_softmax_against_f64(t: usize, scale: f32, first: Option<&[u32]>, heads: usize) {
    let s: Vec<f32> = wave(4 * t * t, 26).iter().map(|v| 8.0 * v).collect();
    let dp = wave(4 * t * t, 27);
    let mut probs = s.clone();
    causal_softmax(&mut probs, None, None, first, heads, t, scale, None);
    let mut want = vec![0f32; s.len()];
    let mut want_ds = vec![0f32; s.len()];
    // Row r's first key: 0, or its document's first.
    let lo = |r: usize| first.map_or(0, |f| f[r / (t * heads) * t + r % t] as usize);
    for (r, row) in s.chunks(t).enumerate() {
        let (lo, i) = (lo(r), r % t);
        let m = row[lo..=i]
            .iter()
            .map(|&v| f64::from(v * scale))
            .fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = row[lo..=i]
            .iter()
            .map(|&v| (f64::from(v * scale) - m).exp())
            .collect();
        let sum: f64 = e.iter().sum();
        let p: Vec<f64> = e.iter().map(|v| v / sum).collect();
        let g = &dp[r * t..][lo..=i];
        let dot: f64 = p.iter().zip(g).map(|(p, &g)| p * f64::from(g)).sum();
        for j in 0..p.len() {
            want[r * t + lo + j] = p[j] as f32;
            want_ds[r * t + lo + j] = (f64::from(scale) * p[j] * (f64::from(g[j]) - dot)) as f32;
        }
    }
    close("causal softmax", &probs, &want);
    let mut ds = dp.clone();
    causal_softmax(&mut ds, Some(&probs), None, first, heads, t, scale, None);
    close("causal softmax backward", &ds, &want_ds);
    for (r, (row, ds)) in probs.chunks(t).zip(ds.chunks(t)).enumerate() {
        let outside = |j: usize| j < lo(r) || j > r % t;
        assert!(
            (0..t)
                .filter(|&j| outside(j))
                .all(|j| row[j] == 0.0 && ds[j] == 0.0),
            "row {r} outside its keys"
        );
    }
    if first.is_some() {
        assert!((0..4 * t).any(|r| lo(r) > 0), "no row began after key 0");
        return;
    }

    // For 16-bit products: the same values, and their bf16 or f16 bits
    // rounded to nearest even (the backward's instead of its f32 values).
    for fmt in [Fmt16::Bf16, Fmt16::F16] {
        let (mut again, mut p16) = (s.clone(), vec![0u16; s.len()]);
        causal_softmax(
            &mut again,
            None,
            Some((fmt, &mut p16)),
            None,
            heads,
            t,
            scale,
            None,
        );
        assert_eq!(again, probs, "the probabilities with their {fmt:?} bits");
        assert_eq!(
            p16,
            rounded16(fmt, &probs),
            "the probabilities' {fmt:?} bits"
        );
        let (mut g, mut ds16) = (dp.clone(), vec![0u16; s.len()]);
        causal_softmax(
            &mut g,
            Some(&probs),
            Some((fmt, &mut ds16)),
            None,
            heads,
            t,
            scale,
            None,
        );
        assert_eq!(g, dp, "dP stays when dS goes to {fmt:?}");
        assert_eq!(ds16, rounded16(fmt, &ds), "dS's {fmt:?} bits");
        // Attention's dropout: the 16-bit values the products read are the
        // dropped probabilities' (zmodel's mask of element row·t + j),
        // rounded; the f32 ones stay undropped for the backward.
        let drop = zmodel::Dropout::new(0.25, 99).unwrap();
        let (mut kept, mut dropped16) = (s.clone(), vec![0u16; s.len()]);
        causal_softmax(
            &mut kept,
            None,
            Some((fmt, &mut dropped16)),
            None,
            heads,
            t,
            scale,
            Some((drop.threshold(), drop.scale(), drop.key())),
        );
        assert_eq!(kept, probs, "{fmt:?}: the f32 probabilities undropped");
        let mut want = probs.clone();
        drop.apply_in_place(&mut want, 0);
        assert_eq!(dropped16, rounded16(fmt, &want), "{fmt:?}: dropped bits");
        assert_ne!(dropped16, p16, "{fmt:?}: the dropout changed nothing");
    }
}

/// Plain and label smoothed (transformers' `LabelSmoother`: the mean over
/// the vocabulary of −log p weighted ε, the target's (1 − ε)).
#[test]
fn cross_entropy_and_its_gradient_match_an_f64_reference() {
    let (n, vocab) = (30usize, 300usize);
    let logits: Vec<f32> = wave(n * vocab, 28).iter().map(|v| 5.0 * v).collect();
    let targets: Vec<u32> = (0..n as u32)
        .map(|i| (i * 37 + 11) % vocab as u32)
        .collect();
    let coef = 0.5 / n as f32;
    let mut plain_loss = Vec::new();
    for eps in [0.0f32, 0.1] {
        let mut grad = logits.clone();
        let loss = cross_entropy(&mut grad, &targets, vocab, (Some(coef), eps), None);
        let mut plain = logits.clone();
        assert_eq!(
            cross_entropy(&mut plain, &targets, vocab, (None, eps), None),
            loss
        );
        assert_eq!(plain, logits, "without the gradient the logits stay");
        // The gradient's 16-bit values in place of its f32 ones: the f32
        // gradient's rounding, bit for bit, and the logits left as they were.
        for fmt in [Fmt16::Bf16, Fmt16::F16] {
            let (mut kept, mut g16) = (logits.clone(), vec![0u16; n * vocab]);
            let loss16 = cross_entropy(
                &mut kept,
                &targets,
                vocab,
                (Some(coef), eps),
                Some((fmt, &mut g16)),
            );
            assert_eq!(loss16, loss, "{fmt:?}: the losses");
            assert_eq!(
                kept, logits,
                "{fmt:?}: the logits stay when the gradient goes to 16 bits"
            );
            assert_eq!(g16, rounded16(fmt, &grad), "{fmt:?}: the gradient's bits");
        }
        let e = f64::from(eps);
        let (mut want_loss, mut want_grad) = (vec![0f32; n], vec![0f32; n * vocab]);
        for (r, row) in logits.chunks(vocab).enumerate() {
            let m = row
                .iter()
                .map(|&v| f64::from(v))
                .fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = row.iter().map(|&v| (f64::from(v) - m).exp()).sum();
            let mean: f64 = row.iter().map(|&v| f64::from(v) - m).sum::<f64>() / vocab as f64;
            let tgt = targets[r] as usize;
            let nll = sum.ln() - (f64::from(row[tgt]) - m);
            want_loss[r] = ((1.0 - e) * nll + e * (sum.ln() - mean)) as f32;
            for (j, &v) in row.iter().enumerate() {
                let p = (f64::from(v) - m).exp() / sum;
                let onehot = if j == tgt { 1.0 } else { 0.0 };
                let g = p - (1.0 - e) * onehot - e / vocab as f64;
                want_grad[r * vocab + j] = (f64::from(coef) * g) as f32;
            }
        }
        close("cross-entropy losses", &loss, &want_loss);
        close("cross-entropy gradient", &grad, &want_grad);
        plain_loss.push(loss);
    }
    assert_ne!(
        plain_loss[0], plain_loss[1],
        "the smoothing changed nothing"
    );
}

#[test]
fn embedding_backward_is_the_scatter_add_in_row_order_to_the_bit() {
    let (b, t, d, vocab) = (3usize, 20usize, 24usize, 13usize);
    // Repeated tokens, and one id never used.
    let tokens: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 7 + 3) % 12).collect();
    let dx = wave(b * t * d, 29);
    let (present, start, rows) = zcuda::rows_by_token(&tokens);
    let (dwte, dwpe) = embed_backward(&dx, (&present, &start, &rows), vocab, b, t, d);
    let (mut want_te, mut want_pe) = (vec![0f32; vocab * d], vec![0f32; t * d]);
    for (r, &tok) in tokens.iter().enumerate() {
        for c in 0..d {
            want_te[tok as usize * d + c] += dx[r * d + c];
        }
    }
    for s in 0..b {
        for i in 0..t * d {
            want_pe[i] += dx[s * t * d + i];
        }
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // Rows of the id never used are untouched: the GPU zeroes dwte first.
    assert_eq!(bits(&dwte), bits(&want_te), "wte's gradient");
    assert_eq!(bits(&dwpe), bits(&want_pe), "wpe's gradient");
}

#[test]
fn heads_and_rows_relayouts_are_inverse_moves() {
    let (b, t, h, hd) = (2, 6, 3, 8);
    let ld = 3 * h * hd;
    let col0 = h * hd; // the keys of GPT-2's qkv
    let mut rows = wave(b * t * ld, 30);
    let mut heads = vec![0f32; b * h * t * hd];
    relayout_heads(&mut rows, &mut heads, false, ld, col0, b, t, h, hd);
    for s in 0..b {
        for j in 0..h {
            for p in 0..t {
                for c in 0..hd {
                    assert_eq!(
                        heads[((s * h + j) * t + p) * hd + c],
                        rows[(s * t + p) * ld + col0 + j * hd + c]
                    );
                }
            }
        }
    }
    let mut back = vec![f32::NAN; rows.len()];
    relayout_heads(&mut back, &mut heads, true, ld, col0, b, t, h, hd);
    for (i, (&got, &want)) in back.iter().zip(&rows).enumerate() {
        match (col0..col0 + h * hd).contains(&(i % ld)) {
            true => assert_eq!(got, want, "value {i}"),
            false => assert!(got.is_nan(), "value {i} outside the columns moved"),
        }
    }
}

/// Values over many magnitudes for the 16-bit kernels: some that f16 rounds
/// to subnormals or to infinity, signed zeros, and ties.
fn magnitudes(n: usize, salt: u32) -> Vec<f32> {
    let mut state = 0x9E37_79B9u32 ^ salt;
    (0..n)
        .map(|i| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            match i % 61 {
                0 => 0.0,
                1 => -0.0,
                2 => 7e4,                         // past f16's largest
                3 => 3e-6,                        // an f16 subnormal
                4 => f32::from_bits(0x3f80_8000), // a bf16 tie, to even
                _ => {
                    let e = (state >> 27) as i32 - 16; // 2^-16 .. 2^15
                    let m = (state >> 4) as f32 / (1u32 << 28) as f32 - 0.5;
                    m * 2f32.powi(e)
                }
            }
        })
        .collect()
}

/// reduce.cu's 16-bit kernels against the host's 16-bit buffers (zengine's
/// `Flat`), which the resident 16-bit GPU step must equal: a micro-batch
/// added and rounded, the norm of scaled 16-bit values, the working copy
/// widened, an operand rounded; every bit, f16's overflow included.
#[test]
fn the_16_bit_gradient_kernels_equal_the_hosts_buffers_bit_for_bit() {
    use zengine::precision::{Flat, Half};
    let chunk = 32_768; // zengine's TASK, the chunks the norm adds
    for (h, fmt) in [(Half::Bf16, Fmt16::Bf16), (Half::F16, Fmt16::F16)] {
        for (n, salt) in [(5usize, 1u32), (chunk + 13, 2)] {
            let (a, b) = (magnitudes(n, salt), magnitudes(n, salt + 7));
            let mut host = Flat::zeros(Some(h), n);
            let mut dev = vec![0u16; n];
            for x in [&a, &b] {
                host.add_f32(0, x);
                add_into16(fmt, &mut dev, x);
            }
            let Flat::Half(_, want) = &host else {
                unreachable!()
            };
            assert_eq!(&dev, want, "{h:?}: two micro-batches added, n {n}");
            for scale in [1.0f32, 0.37, 3e-5] {
                let want = host.sum_sq(0..n, scale);
                let got: f64 = sum_sq_chunks(Grads::Half(fmt, &dev), chunk, scale)
                    .iter()
                    .sum();
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{h:?} norm, n {n}, scale {scale}"
                );
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&widen16(fmt, &dev)),
                bits(&host.to_f32(0..n)),
                "{h:?} widened"
            );
            let mut rounded = vec![0u16; n];
            h.round_slice(&a, &mut rounded);
            assert_eq!(round16(fmt, &a), rounded, "{h:?} rounded, n {n}");
        }
    }
    // f32 gradients' norm, as the resident f32 step reads it: a last
    // chunk shorter than a tile, and one that ends inside its second tile.
    for n in [chunk + 13, 2 * chunk + 3001] {
        let v = magnitudes(n, 9);
        for scale in [1.0f32, 0.37] {
            let want = Flat::F32(v.clone()).sum_sq(0..v.len(), scale);
            let got: f64 = sum_sq_chunks(Grads::F32(&v), chunk, scale).iter().sum();
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "f32 norm, n {n}, scale {scale}"
            );
        }
    }
}

/// adamw.cu against zengine's CPU AdamW, bit for bit, as the GPU's kernel
/// is held to it: f32, bf16 and f16 gradients (the 16-bit ones with their
/// working copy), with and without decay, a gradient scale that is not a
/// power of two. The kernel gets the CPU's own scalars (`Scalars`), copied
/// field by field as zengine's `device_consts` copies them; that copy
/// itself is held to the CPU by zengine's GPU test
/// (`the_gpu_kernel_equals_the_cpu_bit_for_bit`, which scripts/check-cuda.sh
/// runs on this CPU GPU), so that zengine's tests here build without its
/// `cuda` feature.
#[test]
fn adamw_equals_the_cpu_kernel_bit_for_bit() {
    use zengine::adam::OptimizerKind;
    for rule in [
        OptimizerKind::Adamw,
        OptimizerKind::Lion,
        OptimizerKind::Adagrad,
        OptimizerKind::Adam,
    ] {
        adamw_equals_the_cpu_kernel_bit_for_bit_with(rule);
    }
}

/// [`adamw_equals_the_cpu_kernel_bit_for_bit`] for one update rule: AdamW's
/// Adam's, or Lion's or Adagrad's (`c.rule`), which keep no v: the kernel
/// gets null for it.
fn adamw_equals_the_cpu_kernel_bit_for_bit_with(rule: zengine::adam::OptimizerKind) {
    use zengine::adam::OptimizerKind;
    use zengine::adam::{adamw as cpu_adamw, AdamStep, Buffers, Grads as CpuGrads, Scalars};
    use zengine::precision::Half;
    let s = AdamStep {
        rule,
        lr: 3e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 3,
        bias_correction: true,
        grad_scale: 0.37,
        lr_decay: 0.05,
        initial_sum: 0.25,
    };
    for n in [1usize, 1001, 70_001] {
        let p0 = magnitudes(n, 11);
        let g = magnitudes(n, 12);
        let v0: Vec<f32> = magnitudes(n, 14).iter().map(|x| x.abs() * 0.01).collect();
        // Adagrad's state is a sum of squares: never negative.
        let m0: Vec<f32> = match rule {
            OptimizerKind::Adagrad => v0.clone(),
            _ => magnitudes(n, 13).iter().map(|x| x * 0.1).collect(),
        };
        for kind in [
            None,
            Some((Half::Bf16, Fmt16::Bf16)),
            Some((Half::F16, Fmt16::F16)),
        ] {
            let gh: Vec<u16> =
                kind.map_or(Vec::new(), |(h, _)| g.iter().map(|&x| h.round(x)).collect());
            for decay in [true, false] {
                let (mut p, mut m) = (p0.clone(), m0.clone());
                let mut v = match rule.second_moment() {
                    true => v0.clone(),
                    false => Vec::new(),
                };
                let mut w = vec![0u16; if kind.is_some() { n } else { 0 }];
                cpu_adamw(
                    Buffers {
                        p: &mut p,
                        g: match kind {
                            None => CpuGrads::F32(&g),
                            Some((h, _)) => CpuGrads::Half(h, &gh),
                        },
                        m: &mut m,
                        v: &mut v,
                        working: kind.map(|(h, _)| (h, w.as_mut_slice())),
                    },
                    decay,
                    &s,
                );
                let (mut ep, mut em) = (p0.clone(), m0.clone());
                let mut ev = match rule.second_moment() {
                    true => v0.clone(),
                    false => Vec::new(),
                };
                let mut ew = vec![0u16; w.len()];
                adamw(
                    &mut ep,
                    match kind {
                        None => Grads::F32(&g),
                        Some((_, f)) => Grads::Half(f, &gh),
                    },
                    &mut em,
                    &mut ev,
                    kind.map(|(_, f)| (f, ew.as_mut_slice())),
                    &{
                        let c = Scalars::new(&s, decay);
                        zcuda::AdamConsts {
                            gscale: c.gscale,
                            b1: c.b1,
                            omb1: c.omb1,
                            b2: c.b2,
                            omb2: c.omb2,
                            step_size: c.step_size,
                            inv_sqrt_bc2: c.inv_sqrt_bc2,
                            eps: c.eps,
                            decay: c.decay,
                            initial_sum: c.initial_sum,
                            rule: match c.rule {
                                OptimizerKind::Lion => zcuda::RULE_LION,
                                OptimizerKind::Adagrad => zcuda::RULE_ADAGRAD,
                                OptimizerKind::Adam => zcuda::RULE_ADAM,
                                OptimizerKind::Adamw | OptimizerKind::Lamb => zcuda::RULE_ADAMW,
                            },
                        }
                    },
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let what = format!("{rule:?} {kind:?}, decay {decay}, n {n}");
                assert_eq!(bits(&ep), bits(&p), "p, {what}");
                assert_eq!(bits(&em), bits(&m), "m, {what}");
                assert_eq!(bits(&ev), bits(&v), "v, {what}");
                assert_eq!(ew, w, "working copy, {what}");
            }
        }
    }
}

/// quantize.cu against zquant's CPU quantizer, bit for bit (ZeRO++'s wire
/// format): int8 and int4, a last block that is short (and odd for int4), a
/// block of zeros, one of subnormals, one near f32's largest; dequantized
/// against zquant's too; a NaN and an infinity refused at the lowest index,
/// as zquant names the first.
#[test]
fn quantize_equals_the_cpu_quantizer_bit_for_bit() {
    let block = 64;
    let mut x = magnitudes(5 * block + 13, 21);
    x[block..2 * block].fill(0.0);
    for (i, v) in x[2 * block..3 * block].iter_mut().enumerate() {
        *v = f32::from_bits(1 + 7 * i as u32) * if i % 2 == 0 { 1.0 } else { -1.0 };
    }
    x[3 * block] = f32::MAX;
    x[3 * block + 1] = -3e38;
    for (bits, zbits) in [(8, zquant::Bits::Int8), (4, zquant::Bits::Int4)] {
        let want = zquant::quantize(&x, zbits, block).unwrap();
        let (scales, data) = quantize(&x, bits, block).unwrap();
        let fbits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
        assert_eq!(fbits(&scales), fbits(&want.scales), "{bits}-bit scales");
        assert_eq!(data, want.data, "{bits}-bit data");
        let mut back = vec![0f32; x.len()];
        zquant::dequantize(&want, &mut back);
        assert_eq!(
            fbits(&dequantize(&scales, &data, x.len(), bits, block)),
            fbits(&back),
            "{bits}-bit dequantized"
        );
    }
    let mut y = x.clone();
    y[4 * block + 3] = f32::INFINITY;
    y[2 * block + 9] = f32::NAN;
    let Err(zquant::QuantError::NonFinite { index, .. }) =
        zquant::quantize(&y, zquant::Bits::Int8, block)
    else {
        panic!("zquant took a NaN")
    };
    assert_eq!(
        quantize(&y, 8, block),
        Err(index as u64),
        "the first non-finite value"
    );
}
