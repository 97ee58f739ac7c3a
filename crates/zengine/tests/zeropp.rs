//! ZeRO++ against plain stage 3. qwZ: the same job with its forward gathers
//! quantized trains along the same curve, and its all-gathers send exactly the
//! bytes the quantized format takes (checked exactly, per rank). hpZ: bit for
//! bit stage 3, with the backward gathers moved inside the node (bytes and
//! memory checked exactly, per rank). qgZ: within a stated bound of stage 3;
//! with LoCo's error feedback nearer it, and resumed bit for bit.

mod common;

use common::{train, train_leg, typed_spec, Leg, Run};
use zconfig::JobSpec;
use zquant::{Bits, Quantized};

/// Bytes that qwZ saves a rank per micro-batch: each forward gather of the
/// embedding and the blocks (every group but the head, all partitioned here)
/// sends its slice to N-1 ranks as codes and scales instead of working-type words.
fn saved_per_micro_batch(
    run: &Run,
    world: usize,
    word_bytes: usize,
    bits: Bits,
    block: usize,
) -> u64 {
    let forward = &run.padded[..run.padded.len() - 1];
    forward
        .iter()
        .map(|&padded| {
            let slice = padded / world;
            let plain = slice * word_bytes;
            let quantized = Quantized::wire_len(bits, block, slice).div_ceil(4) * 4;
            ((world - 1) * (plain - quantized)) as u64
        })
        .sum()
}

/// The largest relative difference between two runs' per-step losses.
fn worst_loss_diff(a: &Run, b: &Run) -> f64 {
    a.losses
        .iter()
        .zip(&b.losses)
        .map(|(x, y)| ((x - y) / y).abs())
        .fold(0f64, f64::max)
}

/// 8 steps of 2 micro-batches, blocks of 64 values (a slice here holds
/// 400-1300 values, so several blocks). Measured: losses within 6.7e-5
/// (int8) / 5.9e-4 (int4) of plain stage 3 at 2 ranks, 1.6e-3 / 2.2e-3 at 3,
/// f32 and bf16 alike; the bound, 1e-2, is 4.5x the worst. Bytes are exact.
#[test]
fn qwz_tracks_stage_3_and_sends_the_quantized_bytes() {
    for (dtype, word_bytes) in [("f32", 4), ("bf16", 2)] {
        for world in [2, 3] {
            for (bits, count) in [(Bits::Int8, 8), (Bits::Int4, 4)] {
                let plain_spec = typed_spec(dtype, 3, 2, 2000, true, false, 8);
                let mut spec = plain_spec.clone();
                spec.zero.quantized_weights = true;
                spec.zero.quantization.weight_bits = count;
                spec.zero.quantization.block_size = 64;
                let plain = train(plain_spec, world);
                let got = train(spec, world);
                let what = format!("{dtype} world {world} {bits:?}");
                let worst = worst_loss_diff(&got[0], &plain[0]);
                assert!(worst < 1e-2, "{what}: losses differ by {worst:e}");
                assert!(worst > 0.0, "{what}: quantization changed nothing");
                for (r, run) in got.iter().enumerate() {
                    let saved = saved_per_micro_batch(run, world, word_bytes, bits, 64) * 8 * 2;
                    assert_eq!(
                        run.all_gather_bytes,
                        plain[r].all_gather_bytes - saved,
                        "{what} rank {r}: bytes sent in all-gathers"
                    );
                }
                assert!(
                    got[0].params == got[world - 1].params,
                    "{what}: ranks diverged"
                );
            }
        }
    }
}

/// On one rank every gather is the rank's own slice, which qwZ uses at full
/// precision: nothing is quantized, so the run equals plain stage 3 bit for bit.
#[test]
fn qwz_uses_the_own_slice_at_full_precision() {
    let plain_spec = typed_spec("f32", 3, 1, 2000, true, false, 4);
    let mut spec = plain_spec.clone();
    spec.zero.quantized_weights = true;
    assert_eq!(train(spec, 1), train(plain_spec, 1));
}

/// What users run: 200 steps at 4 ranks. The bar is DeepSpeed's
/// (within 1.02x of stage 3's final loss, mean of the last 10 steps);
/// measured here with bf16 and int8: 1.0016x.
#[test]
fn qwz_ends_200_steps_within_2_percent_of_stage_3() {
    let plain_spec = typed_spec("bf16", 3, 1, 2000, true, false, 200);
    let mut spec = plain_spec.clone();
    spec.zero.quantized_weights = true;
    let tail = |run: &Run| run.losses[190..].iter().sum::<f64>() / 10.0;
    let plain = tail(&train(plain_spec, 4)[0]);
    let got = tail(&train(spec, 4)[0]);
    eprintln!("qwZ 200 steps: {got} vs {plain}: ratio {}", got / plain);
    assert!(got / plain < 1.02 && plain / got < 1.02, "{got} vs {plain}");
}

/// `spec` with hpZ groups of `p` ranks, trained on `nodes` (node of each rank).
fn train_hpz(spec: &JobSpec, p: usize, nodes: &[usize]) -> Vec<Run> {
    let mut spec = spec.clone();
    spec.zero.hpz_partition_size = p;
    let leg = Leg {
        nodes: Some(nodes.to_vec()),
        ..Leg::default()
    };
    train_leg(spec, nodes.len(), &leg)
}

/// Per micro-batch, the elements of the gathers hpZ moves into its group (the
/// embedding for the tied head, the blocks' backward; the embedding's
/// backward gathers nothing) and of the shards it keeps (the embedding and
/// every block): the same groups once each. All groups but the head (below
/// the persistence threshold) are partitioned here, and the model is tied.
fn moved_and_kept(run: &Run) -> (usize, usize) {
    let kept: usize = run.padded[..run.padded.len() - 1].iter().sum();
    (kept, kept)
}

/// One hpZ configuration: working type, micro-batches per step, overlap,
/// activation checkpointing, ranks per hpZ group, node of each rank.
struct HpzCase {
    dtype: &'static str,
    accum: usize,
    overlap: bool,
    ckpt: bool,
    p: usize,
    nodes: &'static [usize],
}

/// hpZ only moves where gathers happen: at 2 nodes x 2 ranks and at one node
/// of 4 (groups of 2 and of 4), f32 and bf16, with and without overlap,
/// accumulation and activation checkpointing, every loss, norm and parameter
/// equals stage 3's bit for bit. Bytes, per rank: the hpZ group's all-gathers
/// send (P-1)/P of each moved gather and none of it crosses nodes; the world's
/// all-gathers send (N-1)/N of it less than stage 3's; the shards held peak
/// at 1/P of the kept groups (less the embedding's where prefetch drops it
/// early).
#[test]
fn hpz_is_stage_3_bit_for_bit_with_backward_gathers_inside_the_node() {
    let case = |dtype, accum, overlap, ckpt, p, nodes: &'static [usize]| HpzCase {
        dtype,
        accum,
        overlap,
        ckpt,
        p,
        nodes,
    };
    let cases = [
        case("f32", 1, true, false, 2, &[0, 0, 1, 1]),
        case("bf16", 2, true, true, 2, &[0, 0, 1, 1]),
        case("bf16", 1, false, false, 4, &[0, 0, 0, 0]),
        case("f32", 2, true, true, 2, &[0, 0, 0, 0]),
        case("f16", 1, true, false, 2, &[0, 0, 1, 1]),
    ];
    for HpzCase {
        dtype,
        accum,
        overlap,
        ckpt,
        p,
        nodes,
    } in cases
    {
        let what =
            format!("{dtype} accum {accum} overlap {overlap} ckpt {ckpt} P {p} nodes {nodes:?}");
        let spec = typed_spec(dtype, 3, accum, 2000, overlap, ckpt, 4);
        let world = nodes.len();
        let plain = train_leg(
            spec.clone(),
            world,
            &Leg {
                nodes: Some(nodes.to_vec()),
                ..Leg::default()
            },
        );
        let got = train_hpz(&spec, p, nodes);
        let bytes = if dtype == "f32" { 4 } else { 2 };
        let micro_batches = (4 * accum) as u64;
        for (r, (h, s)) in got.iter().zip(&plain).enumerate() {
            assert!(h == s, "{what} rank {r}: differs from stage 3");
            let (moved, kept) = moved_and_kept(h);
            let hpz = h.hpz_counters.expect("an hpZ group");
            let in_group = ((p - 1) * moved / p * bytes) as u64 * micro_batches;
            let off_world = ((world - 1) * moved / world * bytes) as u64 * micro_batches;
            assert_eq!(
                hpz.inter_node, 0,
                "{what} rank {r}: hpZ bytes crossed nodes"
            );
            assert_eq!(
                hpz.op(zproto::Op::AllGather),
                in_group,
                "{what} rank {r}: hpZ all-gather bytes"
            );
            assert_eq!(
                h.all_gather_bytes - in_group,
                s.all_gather_bytes - off_world,
                "{what} rank {r}: world all-gather bytes"
            );
            // The tied head's gather of the embedding is the last use of its
            // shard: with overlap it is issued (and the shard dropped) while
            // the last block's forward gather is still ahead of it.
            let held = if overlap { kept - h.padded[0] } else { kept };
            assert_eq!(
                h.secondary,
                (held / p * bytes) as u64,
                "{what} rank {r}: shards held"
            );
        }
        if nodes[world - 1] > 0 {
            let cross = |runs: &[Run]| runs.iter().map(|r| r.counters.inter_node).sum::<u64>();
            assert!(
                cross(&got) < cross(&plain),
                "{what}: cross-node bytes {} vs stage 3's {}",
                cross(&got),
                cross(&plain)
            );
        }
    }
}

/// hpZ with qwZ: the shards come from the quantized forward gathers, so
/// backward sees the dequantized weights, the same on every rank. Measured:
/// losses within 8.8e-4 (int8) and 2.6e-3 (int4) of plain stage 3 at 2 x 2;
/// the bound is the qwZ test's, 1e-2.
#[test]
fn hpz_with_qwz_tracks_stage_3() {
    for bits in [8, 4] {
        let plain_spec = typed_spec("bf16", 3, 1, 2000, true, false, 8);
        let mut spec = plain_spec.clone();
        spec.zero.quantized_weights = true;
        spec.zero.quantization.weight_bits = bits;
        spec.zero.quantization.block_size = 64;
        let nodes = [0, 0, 1, 1];
        let plain = train_leg(
            plain_spec,
            4,
            &Leg {
                nodes: Some(nodes.to_vec()),
                ..Leg::default()
            },
        );
        let got = train_hpz(&spec, 2, &nodes);
        let worst = worst_loss_diff(&got[0], &plain[0]);
        eprintln!("hpZ + qwZ int{bits}: losses within {worst:e} of stage 3");
        assert!(worst < 1e-2, "int{bits}: losses differ by {worst:e}");
        assert!(worst > 0.0, "int{bits}: quantization changed nothing");
    }
}

/// `spec` trained on `nodes` (node of each rank).
fn train_on(spec: &JobSpec, nodes: &[usize]) -> Vec<Run> {
    let leg = Leg {
        nodes: Some(nodes.to_vec()),
        ..Leg::default()
    };
    train_leg(spec.clone(), nodes.len(), &leg)
}

/// qgZ alone: gradient buckets reduced by zcomm's two-hop quantized
/// reduce-scatter, on 2 x 2 nodes, one node of 3 and 3 nodes of 1, int4 and
/// int8, blocks of 64 values, 2 micro-batches a step. Measured: losses within
/// 2.9e-4 (int4) / 3.3e-5 (int8) of plain stage 3; the bound is 1e-2. With
/// blocks larger than any bucket's chunk every bucket falls back to the plain
/// reduce-scatter: bit for bit stage 3, and no quantized bytes.
#[test]
fn qgz_tracks_stage_3_and_falls_back_to_it_for_small_buckets() {
    let plain_spec = typed_spec("bf16", 3, 2, 2000, true, false, 6);
    for nodes in [&[0, 0, 1, 1][..], &[0, 0, 0], &[0, 1, 2]] {
        let plain = train_on(&plain_spec, nodes);
        for bits in [4, 8] {
            let mut spec = plain_spec.clone();
            spec.zero.quantized_gradients = true;
            spec.zero.quantization.gradient_bits = bits;
            spec.zero.quantization.block_size = 64;
            let got = train_on(&spec, nodes);
            let worst = worst_loss_diff(&got[0], &plain[0]);
            eprintln!("qgZ int{bits} nodes {nodes:?}: losses within {worst:e} of stage 3");
            assert!(
                worst < 1e-2,
                "{nodes:?} int{bits}: losses differ by {worst:e}"
            );
            assert!(
                worst > 0.0,
                "{nodes:?} int{bits}: quantization changed nothing"
            );
            for r in &got {
                assert!(r.counters.op(zproto::Op::QuantizedReduceScatter) > 0);
            }
        }
        let mut spec = plain_spec.clone();
        spec.zero.quantized_gradients = true;
        spec.zero.quantization.block_size = 1 << 16;
        let fallback = train_on(&spec, nodes);
        assert!(
            fallback == plain,
            "{nodes:?}: the fallback differs from stage 3"
        );
        for (f, p) in fallback.iter().zip(&plain) {
            let bytes = |c: &zcomm::CounterSnapshot| (c.by_op, c.intra_node, c.inter_node);
            assert_eq!(
                bytes(&f.counters),
                bytes(&p.counters),
                "{nodes:?}: fallback bytes"
            );
        }
    }
}

/// qwZ, hpZ and qgZ together at 2 x 2: measured within 1.5e-3 of plain
/// stage 3's per-step losses (bound 1e-2).
#[test]
fn all_of_zero_plus_plus_tracks_stage_3() {
    let plain_spec = typed_spec("bf16", 3, 1, 2000, true, false, 8);
    let mut spec = plain_spec.clone();
    spec.zero.quantized_weights = true;
    spec.zero.quantized_gradients = true;
    spec.zero.quantization.block_size = 64;
    let nodes = [0, 0, 1, 1];
    let plain = train_on(&plain_spec, &nodes);
    let got = train_hpz(&spec, 2, &nodes);
    let worst = worst_loss_diff(&got[0], &plain[0]);
    eprintln!("qwZ + hpZ + qgZ: losses within {worst:e} of stage 3");
    assert!(worst < 1e-2, "losses differ by {worst:e}");
}

/// f16 with a loss scale that overflows at first: under qgZ the infinite
/// gradients arrive as NaN, so the same steps are skipped with the same scales
/// as plain stage 3 until the first clean step, and training goes on; with
/// LoCo too (whose errors are forgotten at each overflow and follow the
/// scale as it changes).
#[test]
fn qgz_reports_f16_overflow_as_overflow() {
    let mut plain_spec = typed_spec("f16", 3, 1, 2000, true, false, 6);
    plain_spec.train.loss_scale.initial_scale_power = 20;
    plain_spec.train.loss_scale.hysteresis = 1;
    let mut spec = plain_spec.clone();
    spec.zero.quantized_gradients = true;
    spec.zero.quantization.block_size = 64;
    let nodes = [0, 0, 1, 1];
    let plain = train_on(&plain_spec, &nodes);
    let mut loco = spec.clone();
    loco.zero.loco = Some(zconfig::spec::LocoSpec::default());
    for spec in [spec, loco] {
        let got = train_on(&spec, &nodes);
        let scales = &plain[0].scales;
        let first_clean = scales.iter().position(|s| !s.1).expect("a clean step");
        assert!(first_clean > 0, "no overflow to test: {scales:?}");
        assert_eq!(got[0].scales[..=first_clean], scales[..=first_clean]);
        assert!(got[0].losses.iter().all(|l| l.is_finite()));
    }
}

/// Dropout under hpZ (backward's gathers from the node's secondary shards,
/// with activation checkpointing): stage 3's bits, dropped alike.
#[test]
fn hpz_drops_what_stage_3_drops() {
    let mut spec = typed_spec("bf16", 3, 1, 2000, true, true, 4);
    spec.model.hidden_dropout = Some(0.2);
    spec.model.attention_dropout = Some(0.1);
    let nodes: &[usize] = &[0, 0, 1, 1];
    let leg = Leg {
        nodes: Some(nodes.to_vec()),
        ..Leg::default()
    };
    let plain = train_leg(spec.clone(), nodes.len(), &leg);
    let got = train_hpz(&spec, 2, nodes);
    for (r, (h, s)) in got.iter().zip(&plain).enumerate() {
        assert_eq!(h.losses, s.losses, "rank {r}");
        assert!(h.params == s.params, "rank {r}: parameters differ");
    }
}

/// How far `got`'s parameters moved from `start`'s, against how far
/// `want`'s did, over all of rank 0's: ‖Δgot − Δwant‖ / ‖Δwant‖.
fn moved_apart(start: &Run, want: &Run, got: &Run) -> f64 {
    let (mut off, mut size) = (0f64, 0f64);
    for ((s, w), g) in start.params.iter().zip(&want.params).zip(&got.params) {
        for ((s, w), g) in s.iter().zip(w).zip(g) {
            off += f64::from(g - w).powi(2);
            size += f64::from(w - s).powi(2);
        }
    }
    (off / size).sqrt()
}

/// LoCo on qgZ's int4 reductions, 2 x 2 nodes, blocks of 64 values, a
/// plain gradient descent with steps small enough that the gradients stay
/// nearly the same from step to step (so that each step's quantization
/// loses nearly the same remainder, which feedback cancels): after 40
/// steps the parameters have moved nearer to where plain stage 3 moved
/// them than qgZ's without feedback, by half at least (measured 3.4x:
/// 1.0e-2 of the move apart with LoCo, 3.4e-2 without; 2.2x after 20
/// steps).
#[test]
fn loco_brings_qgz_nearer_stage_3() {
    let mut plain_spec = typed_spec("f32", 3, 1, 2000, true, false, 40);
    // Adam with no first moment and an epsilon far above every gradient's
    // magnitude: plain gradient descent at lr / eps, each step's move the
    // reduced gradient itself.
    let o = &mut plain_spec.train.optimizer;
    (o.betas, o.eps) = ([0.0, 0.999], Some(10.0));
    plain_spec.train.lr = 1e-3;
    plain_spec.train.weight_decay = 0.0;
    let nodes = [0, 0, 1, 1];
    let mut start = plain_spec.clone();
    start.train.steps = 0;
    let start = train_on(&start, &nodes);
    let plain = train_on(&plain_spec, &nodes);
    let mut qgz = plain_spec.clone();
    qgz.zero.quantized_gradients = true;
    qgz.zero.quantization.block_size = 64;
    let mut loco = qgz.clone();
    loco.zero.loco = Some(zconfig::spec::LocoSpec::default());
    let without = moved_apart(&start[0], &plain[0], &train_on(&qgz, &nodes)[0]);
    let with = moved_apart(&start[0], &plain[0], &train_on(&loco, &nodes)[0]);
    eprintln!("moved apart from stage 3: qgZ {without:e}, qgZ + LoCo {with:e}");
    assert!(
        with < 0.5 * without,
        "{with:e} with LoCo, {without:e} without"
    );
}

/// LoCo's kept errors are state: a qgZ + LoCo run at 2 x 2 saved after 3
/// steps (each rank's errors in the checkpoint beside its shard) and
/// resumed goes on bit for bit as the run never interrupted; int8 with
/// errors restarting every 4 reductions, so that the resumed leg crosses
/// a restart.
#[test]
fn loco_resumes_bit_for_bit() {
    let mut spec = typed_spec("bf16", 3, 2, 2000, true, false, 6);
    spec.zero.quantized_gradients = true;
    spec.zero.quantization.block_size = 64;
    spec.zero.quantization.gradient_bits = 8;
    spec.zero.loco = Some(zconfig::spec::LocoSpec {
        err_beta: 0.6,
        reset_t: 4,
    });
    let nodes = vec![0, 0, 1, 1];
    let leg = |resume, until, save| Leg {
        resume,
        until,
        save,
        nodes: Some(nodes.clone()),
        ..Leg::default()
    };
    let whole = train_leg(spec.clone(), 4, &leg(None, None, None));
    let dir = tempfile::tempdir().unwrap();
    train_leg(spec.clone(), 4, &leg(None, Some(3), Some(dir.path())));
    for r in 0..4 {
        let kept = dir.path().join(zckpt::feedback_name(r));
        assert!(kept.exists(), "{} not written", kept.display());
    }
    let resumed = train_leg(spec, 4, &leg(Some(dir.path()), None, None));
    for (r, (w, got)) in whole.iter().zip(&resumed).enumerate() {
        assert_eq!(got.losses, w.losses[3..], "rank {r}: losses");
        assert!(got.params == w.params, "rank {r}: final parameters differ");
    }
}
