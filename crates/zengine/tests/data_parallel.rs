//! Data parallelism must not change the maths: 2 ranks × 1 micro-batch equal
//! 1 rank × 2 micro-batches with the same global batch, and every rank holds the
//! same parameters after every step.

mod common;

use common::{comms, spec, train, train_leg, train_observed, typed_spec, worst_move_apart, Leg};
use zconfig::estimate::Kept;
use zengine::Engine;

#[test]
fn two_ranks_equal_one_rank_with_the_same_global_batch() {
    let solo = train(spec(2, 2000, true), 1);
    let duo = train(spec(1, 2000, true), 2);
    assert!(duo[0].params == duo[1].params, "ranks diverged");
    let solo_loss = &solo[0].losses;
    // Each rank reports its own micro-batch's loss; their mean is the global loss.
    for (s, want) in solo_loss.iter().enumerate() {
        let got = (duo[0].losses[s] + duo[1].losses[s]) / 2.0;
        assert!(
            (got - want).abs() <= 1e-5 * want.abs(),
            "step {}: {got} vs {want}",
            s + 1
        );
    }
    for (a, b) in solo[0]
        .params
        .iter()
        .flatten()
        .zip(duo[0].params.iter().flatten())
    {
        assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{a} vs {b}");
    }
    assert!(
        solo_loss[5] < solo_loss[0],
        "loss did not fall: {solo_loss:?}"
    );
}

#[test]
fn bucket_size_and_overlap_do_not_change_a_bit() {
    let base = train(spec(1, 50_000_000, true), 3);
    for (bucket, overlap) in [(1, true), (3000, false)] {
        let other = train(spec(1, bucket, overlap), 3);
        for r in 0..3 {
            assert_eq!(
                base[r], other[r],
                "bucket {bucket} overlap {overlap} rank {r}"
            );
        }
    }
}

/// Stages 0-3, overlap on or off, checkpointing on or off: the same bits, at a
/// world size that divides nothing evenly (3, so every group is padded) and at 2.
#[test]
fn every_stage_gives_bit_identical_losses_and_parameters() {
    for world in [2, 3] {
        let base = train(typed_spec("f32", 0, 1, 2000, true, false, 8), world);
        for stage in 0..=3u8 {
            for (overlap, ckpt) in [(true, false), (false, false), (true, true), (false, true)] {
                if stage == 0 && overlap && !ckpt {
                    continue;
                }
                let got = train(typed_spec("f32", stage, 1, 2000, overlap, ckpt, 8), world);
                for r in 0..world {
                    assert_eq!(got[r].losses, base[r].losses, "losses: world {world} stage {stage} overlap {overlap} checkpointing {ckpt} rank {r}");
                    assert!(
                        got[r].params == base[r].params,
                        "parameters: world {world} stage {stage} overlap {overlap} checkpointing {ckpt} rank {r}"
                    );
                }
            }
        }
        assert!(base[0].losses[7] < base[0].losses[0]);
    }
}

/// Dropout (`model.hidden_dropout` and `model.attention_dropout`) and
/// NEFTune's noise keep every stage, with and without activation
/// checkpointing (whose recomputed forward must drop the same elements),
/// to the bits of stage 0, in f32 and bf16; they change the run.
#[test]
fn dropout_keeps_the_stages_bit_identical() {
    let dropped = |dtype, stage, ckpt| {
        let mut spec = typed_spec(dtype, stage, 1, 2000, true, ckpt, 4);
        spec.model.hidden_dropout = Some(0.2);
        spec.model.attention_dropout = Some(0.1);
        spec.train.neftune_noise_alpha = 5.0;
        spec
    };
    for dtype in ["f32", "bf16"] {
        let base = train(dropped(dtype, 0, false), 2);
        let plain = train(typed_spec(dtype, 0, 1, 2000, true, false, 4), 2);
        assert_ne!(base[0].losses, plain[0].losses, "{dtype}: nothing dropped");
        for stage in 0..=3u8 {
            for ckpt in [false, true] {
                if stage == 0 && !ckpt {
                    continue;
                }
                let got = train(dropped(dtype, stage, ckpt), 2);
                for r in 0..2 {
                    let what = format!("{dtype} stage {stage} checkpointing {ckpt} rank {r}");
                    assert_eq!(got[r].losses, base[r].losses, "losses: {what}");
                    assert!(got[r].params == base[r].params, "parameters: {what}");
                }
            }
        }
    }
}

/// Progressive layer dropping (`train.progressive_layer_drop`) keeps every
/// stage, with and without activation checkpointing, to the bits of stage
/// 0 at 2 ranks, with hidden dropout and without: the ranks skip the same
/// blocks, whose stage-3 gathers are left out and whose groups still
/// complete their buckets (the planned gathers are all used: the engine
/// asserts it). Over 2 micro-batches a step (where stages 2-3 reduce each
/// micro-batch and so add in another order than 0-1), stage 1 keeps to
/// stage 0's bits and stage 3 to stage 2's, a skipped block's gradient
/// left as it was on a micro-batch that does not reduce. Blocks are
/// skipped, more as θ falls, and the run is not the one without.
#[test]
fn progressive_layer_drop_keeps_the_stages_bit_identical() {
    use zconfig::layer_drop::LayerDropSpec;
    let dropped = |stage, accum, ckpt, hidden: Option<f64>| {
        let mut spec = typed_spec("f32", stage, accum, 2000, true, ckpt, 8);
        spec.model.n_layers = 4;
        spec.model.hidden_dropout = hidden;
        spec.train.progressive_layer_drop = Some(LayerDropSpec {
            theta: 0.2,
            gamma: 0.5,
        });
        spec
    };
    for hidden in [None, Some(0.1)] {
        let base = train(dropped(0, 1, false, hidden), 2);
        let run: Vec<f64> = base[0].blocks_run.iter().map(|b| b.unwrap()).collect();
        // θ is 1 for the first two steps (every block runs), then falls.
        assert_eq!(run[..2], [4.0, 4.0], "{run:?}");
        assert!(run[2..].iter().sum::<f64>() < 4.0 * 5.0, "{run:?}");
        let mut plain_spec = dropped(0, 1, false, hidden);
        plain_spec.train.progressive_layer_drop = None;
        let plain = train(plain_spec, 2);
        assert_eq!(plain[0].blocks_run[0], None);
        assert_eq!(plain[0].losses[..2], base[0].losses[..2]);
        assert_ne!(plain[0].losses, base[0].losses, "nothing dropped");
        let same = |got: &[common::Run], want: &[common::Run], what: &str| {
            for r in 0..2 {
                assert_eq!(got[r].losses, want[r].losses, "losses: {what} rank {r}");
                assert!(
                    got[r].params == want[r].params,
                    "parameters: {what} rank {r}"
                );
            }
        };
        for stage in 0..=3u8 {
            for ckpt in [false, true] {
                if stage == 0 && !ckpt {
                    continue;
                }
                let got = train(dropped(stage, 1, ckpt, hidden), 2);
                same(
                    &got,
                    &base,
                    &format!("{hidden:?} stage {stage} checkpointing {ckpt}"),
                );
            }
        }
        for (stage, like) in [(1, 0), (3, 2)] {
            let want = train(dropped(like, 2, false, hidden), 2);
            let got = train(dropped(stage, 2, true, hidden), 2);
            same(
                &got,
                &want,
                &format!("{hidden:?} 2 micro-batches stage {stage}"),
            );
        }
    }
}

/// DeepSpeed's `gradient_predivide_factor` and `prescale_gradients`:
/// gradients divided before the ranks add them and multiplied back after.
/// A power of two divides exactly, so the run keeps the bits of one
/// without; prescaling at 2 ranks is a factor of 2; a factor of 3 rounds
/// (the parameters' bits move, within f32's rounding of the run without)
/// and keeps the stages bit-identical, in f32 and under f16's loss scale
/// with 16-bit gradients.
#[test]
fn predivided_gradients_are_multiplied_back_after_the_reduction() {
    let with = |dtype, stage, factor: f64, prescale: bool| {
        let mut spec = typed_spec(dtype, stage, 2, 2000, true, false, 5);
        spec.train.gradient_predivide_factor = factor;
        spec.train.prescale_gradients = prescale;
        spec
    };
    let plain = train(with("f32", 0, 1.0, false), 2);
    let exact = train(with("f32", 0, 4.0, false), 2);
    assert!(exact[0] == plain[0], "a factor of 4 moved a bit");
    let prescaled = train(with("f32", 0, 1.0, true), 2);
    let two = train(with("f32", 0, 2.0, false), 2);
    assert!(prescaled[0] == two[0] && two[0] == plain[0]);
    let three = train(with("f32", 0, 3.0, false), 2);
    assert!(
        three[0].params != plain[0].params,
        "a factor of 3 rounded nothing"
    );
    for (a, b) in three[0]
        .params
        .iter()
        .flatten()
        .zip(plain[0].params.iter().flatten())
    {
        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
    }
    // Stages 2-3 reduce each micro-batch, so add in another order than
    // 0-1: stage 1 keeps to stage 0's bits, stage 3 to stage 2's.
    for dtype in ["f32", "f16"] {
        for (stage, like) in [(1, 0), (3, 2)] {
            let want = train(with(dtype, like, 3.0, false), 2);
            let got = train(with(dtype, stage, 3.0, false), 2);
            for r in 0..2 {
                assert!(got[r] == want[r], "{dtype} stage {stage} rank {r}");
            }
        }
    }
}

/// Lion, Adagrad and PyTorch's Adam (`train.optimizer.type: lion`,
/// `adagrad`, `adam`) keep every
/// stage to the bits of stage 0 at 2 ranks, in f32 and bf16 (each update
/// runs on each rank's slice, in the same vectorised pass whatever the
/// slice bounds); each trains (the loss falls) and is neither AdamW nor
/// the other (other losses; Adagrad's sums starting at 0.1 give other
/// losses than at 0; Adam's L2 decay others than AdamW's decoupled one
/// at the same λ).
/// Lion and Adagrad hold one f32 state an element they update (Lion's
/// moment, Adagrad's sum of squares), where AdamW and Adam hold two: every
/// element at stage 0, the rank's half from stage 1.
#[test]
fn lion_adagrad_and_adam_keep_the_stages_bit_identical() {
    use zconfig::spec::OptimizerKind;
    let rule = |kind, dtype, stage| {
        let mut spec = typed_spec(dtype, stage, 1, 2000, true, false, 8);
        spec.train.optimizer.kind = kind;
        match kind {
            OptimizerKind::Lion => {
                spec.train.optimizer.betas = [0.9, 0.99];
                spec.train.lr /= 3.0;
            }
            OptimizerKind::Adam => {}
            _ => {
                spec.train.optimizer.lr_decay = Some(0.05);
                spec.train.optimizer.initial_accumulator_value = Some(0.1);
                spec.train.lr *= 10.0;
            }
        }
        spec
    };
    for dtype in ["f32", "bf16"] {
        let adamw = train(typed_spec(dtype, 0, 1, 2000, true, false, 8), 2);
        let mut from_zero = rule(OptimizerKind::Adagrad, dtype, 0);
        from_zero.train.optimizer.initial_accumulator_value = None;
        let mut others = vec![
            adamw[0].losses.clone(),
            train(from_zero, 2)[0].losses.clone(),
        ];
        for kind in [
            OptimizerKind::Lion,
            OptimizerKind::Adagrad,
            OptimizerKind::Adam,
        ] {
            let base = train(rule(kind, dtype, 0), 2);
            assert!(
                !others.contains(&base[0].losses),
                "{dtype}: {kind:?} ran as another rule"
            );
            others.push(base[0].losses.clone());
            assert!(
                base[0].losses[7] < base[0].losses[0],
                "{dtype}: {kind:?} did not train: {:?}",
                base[0].losses
            );
            let elements: usize = base[0].padded.iter().sum();
            let states = 1 + u64::from(kind.second_moment());
            assert_eq!(
                base[0].optimizer_held,
                4 * states * elements as u64,
                "{dtype}"
            );
            assert_eq!(adamw[0].optimizer_held, 8 * elements as u64, "{dtype}");
            for stage in 1..=3u8 {
                let got = train(rule(kind, dtype, stage), 2);
                for r in 0..2 {
                    let what = format!("{kind:?} {dtype} stage {stage} rank {r}");
                    assert_eq!(got[r].losses, base[r].losses, "losses: {what}");
                    assert!(got[r].params == base[r].params, "parameters: {what}");
                    assert_eq!(
                        got[r].optimizer_held,
                        2 * states * elements as u64,
                        "{what}"
                    );
                }
            }
        }
    }
}

fn lamb(dtype: &str, stage: u8, accum: usize) -> zconfig::JobSpec {
    let mut spec = typed_spec(dtype, stage, accum, 2000, true, false, 8);
    spec.train.optimizer.kind = zconfig::spec::OptimizerKind::Lamb;
    spec.train.lr *= 3.0;
    spec
}

/// LAMB keeps stage 0's bits at stages 1-3 (each parameter's squares summed
/// cell by cell in the same order at every stage, the slices in rank
/// order), in f32 and bf16; it trains, is not AdamW, and holds AdamW's two
/// moments. In bf16 the model is wider (d_model 160): its MLP weights
/// (102,400 elements) span two cells and both slices, and stage 0's pass
/// over a whole block (311k elements) runs on threads where a slice's runs
/// on one.
#[test]
fn lamb_keeps_the_stages_bit_identical() {
    for dtype in ["f32", "bf16"] {
        let lamb = |dtype: &str, stage, accum| {
            let mut spec = lamb(dtype, stage, accum);
            if dtype == "bf16" {
                spec.model.d_model = 160;
            }
            spec
        };
        let base = train(lamb(dtype, 0, 1), 2);
        let mut adamw = lamb(dtype, 0, 1);
        adamw.train.optimizer.kind = zconfig::spec::OptimizerKind::Adamw;
        let adamw = train(adamw, 2);
        assert_ne!(
            base[0].losses, adamw[0].losses,
            "{dtype}: LAMB ran as AdamW"
        );
        assert!(
            base[0].losses[7] < base[0].losses[0],
            "{dtype}: LAMB did not train: {:?}",
            base[0].losses
        );
        assert_eq!(base[0].optimizer_held, adamw[0].optimizer_held, "{dtype}");
        for stage in 1..=3u8 {
            let got = train(lamb(dtype, stage, 1), 2);
            for r in 0..2 {
                let what = format!("{dtype} stage {stage} rank {r}");
                assert_eq!(got[r].losses, base[r].losses, "losses: {what}");
                assert!(got[r].params == base[r].params, "parameters: {what}");
            }
        }
    }
}

/// One trust ratio per parameter, whatever slices hold it: two ranks at
/// stage 3 (each parameter's squares from two slices) move every parameter
/// where one rank (one slice) moves it with the same global batch, to the
/// rounding that the gradients' sums over ranks differ by. A ratio per
/// slice would move the two halves of a parameter by different factors
/// (by 1e-2 relative and more here).
#[test]
fn lamb_gives_each_parameter_one_ratio_over_its_slices() {
    let mut spec = lamb("f32", 0, 2);
    spec.train.steps = 3;
    // Free ratios: the bounds would clamp most of this small model's.
    spec.train.optimizer.min_coeff = Some(1e-9);
    spec.train.optimizer.max_coeff = Some(1e9);
    let start = train_leg(
        spec.clone(),
        1,
        &Leg {
            until: Some(0),
            ..Leg::default()
        },
    );
    let solo = train(spec.clone(), 1);
    spec.train.grad_accum = 1;
    spec.zero.stage = zconfig::spec::ZeroStage::Weights;
    let duo = train(spec, 2);
    let worst = worst_move_apart(&start[0], &solo[0], &duo[0]);
    assert!(
        worst.0 <= 1e-4,
        "{}: moved {:e} away from one rank's move",
        worst.1,
        worst.0
    );
}

/// Every step moves each parameter by exactly `step_size` times its norm
/// (where neither its norm nor its update's is 0, and the ratio is left
/// free): `r·‖u‖ = ‖w‖`, so ‖Δw‖ = lr·√(1 − β2^t)/(1 − β1^t)·‖w‖: what
/// LAMB is for, independent of the moments, the gradients and the slices.
/// Checked at stage 3 on two ranks with weight decay, step by step.
#[test]
fn lamb_moves_each_parameter_by_the_step_size_times_its_norm() {
    let mut spec = lamb("f32", 3, 1);
    spec.train.optimizer.min_coeff = Some(1e-9);
    spec.train.optimizer.max_coeff = Some(1e9);
    let [b1, b2] = spec.train.optimizer.betas;
    let after = |k: u64| {
        let leg = Leg {
            until: Some(k),
            ..Leg::default()
        };
        train_leg(spec.clone(), 2, &leg).swap_remove(0)
    };
    let runs: Vec<_> = (0..=4).map(after).collect();
    let lrs = &runs[4].lrs;
    let mut checked = 0;
    for t in 1..=4usize {
        let step_size = lrs[t - 1] * (1.0 - b2.powi(t as i32)).sqrt() / (1.0 - b1.powi(t as i32));
        for (name, (_, before)) in &runs[t - 1].named {
            let now = &runs[t].named[name].1;
            let norm = |x: &mut dyn Iterator<Item = f64>| x.map(|v| v * v).sum::<f64>().sqrt();
            let w = norm(&mut before.iter().map(|&v| f64::from(v)));
            let moved = norm(&mut now.iter().zip(before).map(|(a, b)| f64::from(a - b)));
            if w == 0.0 {
                continue; // a zero bias moves by its update (ratio 1)
            }
            let want = step_size * w;
            assert!(
                (moved - want).abs() <= 1e-4 * want,
                "step {t} {name}: moved {moved:e}, step size × norm {want:e}"
            );
            checked += 1;
        }
    }
    assert!(checked > 20, "{checked} parameters checked");
}

/// The step's trust ratios as the statistics report them (smallest, mean,
/// largest over the parameters) are the ones the update used, found
/// without them: a run whose ratios are all clamped to 1 (bounds [1, 1])
/// moves each parameter by `step_size·u`, so its update's norm is
/// `‖Δw‖ / step_size` and its free ratio `‖w‖ / ‖u‖` (1 where `w` is 0);
/// the first step of a run with the bounds left free must report those
/// ratios' smallest, mean and largest.
/// Clamped at [0.5, 2] the report stays within them, and AdamW reports
/// none. Stage 3 on two ranks: each rank holds half of each parameter.
/// (Measured: within 7e-6 relative, the f32 rounding of `Δw`.)
#[test]
fn lamb_reports_the_trust_ratios_its_update_used() {
    let mut spec = lamb("f32", 3, 1);
    spec.train.steps = 1;
    let with_bounds = |lo: f64, hi: f64| {
        let mut s = spec.clone();
        s.train.optimizer.min_coeff = Some(lo);
        s.train.optimizer.max_coeff = Some(hi);
        s
    };
    let start = train_leg(
        spec.clone(),
        2,
        &Leg {
            until: Some(0),
            ..Leg::default()
        },
    )
    .swap_remove(0);
    let clamped = train(with_bounds(1.0, 1.0), 2).swap_remove(0);
    let [b1, b2] = spec.train.optimizer.betas;
    let step_size = clamped.lrs[0] * (1.0 - b2).sqrt() / (1.0 - b1);
    let norm = |x: &mut dyn Iterator<Item = f64>| x.map(|v| v * v).sum::<f64>().sqrt();
    let mut want = Vec::new();
    for (name, (_, before)) in &start.named {
        let after = &clamped.named[name].1;
        let w = norm(&mut before.iter().map(|&v| f64::from(v)));
        let moved = norm(&mut after.iter().zip(before).map(|(a, b)| f64::from(a - b)));
        want.push(if w == 0.0 { 1.0 } else { w * step_size / moved });
    }
    assert!(want.len() > 10, "{} parameters", want.len());
    let free = train(with_bounds(1e-9, 1e9), 2);
    let mean = want.iter().sum::<f64>() / want.len() as f64;
    let least = want.iter().copied().fold(f64::INFINITY, f64::min);
    let most = want.iter().copied().fold(0.0, f64::max);
    assert!(most > 1.5 * least, "ratios all alike: {want:?}");
    for (r, run) in free.iter().enumerate() {
        let got = run.trust_ratios[0].expect("LAMB reports its ratios");
        for (what, g, w) in [
            ("min", got.min, least),
            ("mean", got.mean, mean),
            ("max", got.max, most),
        ] {
            assert!(
                (g - w).abs() <= 1e-4 * w,
                "rank {r} {what}: reported {g}, the update's {w}"
            );
        }
    }
    let bounded = train(with_bounds(0.5, 2.0), 2).swap_remove(0);
    let got = bounded.trust_ratios[0].unwrap();
    assert!(got.min >= 0.5 && got.max <= 2.0, "{got:?}");
    let mut adamw = spec.clone();
    adamw.train.optimizer.kind = zconfig::spec::OptimizerKind::Adamw;
    assert_eq!(train(adamw, 2)[0].trust_ratios, [None]);
}

/// `train.schedule: one_cycle` reaches the optimizer: every step runs at
/// `lr_at`'s rate; with `cycle_min_mom` = `cycle_max_mom` = b its β1 is b,
/// so the run is bit for bit the run without momentum cycling whose betas
/// start with b; moving β1 (0.85 to 0.95) changes the run; and stage 3
/// keeps stage 0's bits with the cycling β1.
#[test]
fn one_cycle_sets_the_rate_and_cycles_beta1() {
    use zconfig::spec::{OneCycleSpec, Schedule};
    let cycled = |stage: u8, min_mom: f64, max_mom: f64, cycles: bool| {
        let mut spec = typed_spec("f32", stage, 1, 2000, true, false, 8);
        spec.train.schedule = Schedule::OneCycle;
        spec.train.warmup_steps = 0;
        spec.train.min_lr = spec.train.lr / 10.0;
        spec.train.one_cycle = Some(OneCycleSpec {
            cycle_first_step_size: 3,
            cycle_second_step_size: Some(2),
            decay_step_size: 1,
            decay_lr_rate: 0.5,
            cycle_momentum: cycles,
            cycle_min_mom: min_mom,
            cycle_max_mom: max_mom,
            ..OneCycleSpec::default()
        });
        spec.train.optimizer.betas[0] = 0.9;
        spec
    };
    let base = train(cycled(0, 0.85, 0.95, true), 2);
    let t = cycled(0, 0.85, 0.95, true).train;
    let want: Vec<f64> = (1..=8).map(|s| zengine::schedule::lr_at(s, &t)).collect();
    assert_eq!(base[0].lrs, want);
    assert!(want[3] > want[0] && want[8 - 1] < want[0], "{want:?}");
    let flat = train(cycled(0, 0.9, 0.9, true), 2);
    let plain = train(cycled(0, 0.85, 0.95, false), 2);
    assert_eq!(
        flat[0].losses, plain[0].losses,
        "β1 0.9 cycled = betas[0] 0.9"
    );
    assert!(flat[0].params == plain[0].params);
    assert!(
        base[0].params != plain[0].params,
        "the cycling β1 did nothing"
    );
    let s3 = train(cycled(3, 0.85, 0.95, true), 2);
    for r in 0..2 {
        assert_eq!(s3[r].losses, base[r].losses, "stage 3 rank {r}");
        assert!(s3[r].params == base[r].params, "stage 3 rank {r}");
    }
}

/// Dropout and NEFTune are training's alone: on one rank a batch's
/// `eval_loss` with `model.hidden_dropout` and `model.attention_dropout`
/// at 0.5, or with `train.neftune_noise_alpha` at 50, is the loss without
/// them, to the bit, while the training forward of that batch drops or
/// adds noise (another loss).
#[test]
fn dropout_drops_in_training_and_never_in_evaluation() {
    let losses = |set: &dyn Fn(&mut zconfig::JobSpec)| {
        let mut spec = typed_spec("f32", 0, 1, 2000, true, false, 1);
        set(&mut spec);
        let comm = comms(1).pop().unwrap();
        let corpus = zmodel::Corpus::synthetic(spec.model.vocab_size, 3);
        let mut data = zmodel::Batcher::new(corpus, spec.model.seq_len, 4, 1, 1, 0, 7).unwrap();
        let batch = data.batch(0, 0).unwrap();
        let mut e = Engine::new(&spec, comm).unwrap();
        let eval = e.eval_loss(std::slice::from_ref(&batch)).unwrap();
        (eval, e.forward_backward(&batch).unwrap())
    };
    let (eval_plain, train_plain) = losses(&|_| {});
    assert_eq!(
        eval_plain, train_plain,
        "without dropout eval is the training forward"
    );
    let dropped: &dyn Fn(&mut zconfig::JobSpec) = &|s| {
        s.model.hidden_dropout = Some(0.5);
        s.model.attention_dropout = Some(0.5);
    };
    let noisy: &dyn Fn(&mut zconfig::JobSpec) = &|s| s.train.neftune_noise_alpha = 50.0;
    for (what, set) in [("dropout", dropped), ("NEFTune", noisy)] {
        let (eval, train) = losses(set);
        assert_eq!(eval, eval_plain, "{what} in evaluation");
        // At initialisation the model is near uniform, so dropping half of
        // its hidden states moves the loss little (7e-4), but not to the bit.
        assert_ne!(train, train_plain, "{what} left training as it was");
    }
}

/// `train.label_smoothing` is training's loss alone: on one rank the
/// training loss of a batch is `(1 − ε)·cross-entropy + ε·uniform term`
/// (it moves), while evaluation of that batch gives the plain
/// cross-entropy, the training loss without smoothing, to the bit.
#[test]
fn label_smoothing_moves_the_training_loss_and_not_evaluation() {
    let losses = |eps: f64| {
        let mut spec = typed_spec("f32", 0, 1, 2000, true, false, 1);
        spec.train.label_smoothing = eps;
        let corpus = zmodel::Corpus::synthetic(spec.model.vocab_size, 3);
        let mut data = zmodel::Batcher::new(corpus, spec.model.seq_len, 4, 1, 1, 0, 7).unwrap();
        let batch = data.batch(0, 0).unwrap();
        let mut e = Engine::new(&spec, comms(1).pop().unwrap()).unwrap();
        let eval = e.eval_loss(std::slice::from_ref(&batch)).unwrap();
        (eval, e.forward_backward(&batch).unwrap())
    };
    let (eval_plain, train_plain) = losses(0.0);
    let (eval, train) = losses(0.2);
    assert_eq!(eval, eval_plain, "evaluation smoothed");
    assert_eq!(eval, train_plain);
    // Near initialisation every −log p is near log 64, so the smoothed
    // loss moves only a little, but it moves.
    assert_ne!(train, train_plain, "training did not smooth");
}

/// The embedding's dropout reaches its backward: after one step with
/// `hidden_dropout: 0.9` (no weight decay, so Adam moves exactly the
/// elements with a gradient), the elements of GPT-2's position table left
/// unchanged are exactly those the embedding's mask dropped in every
/// sequence of the batch (about 0.9⁴ of them; without the mask in
/// backward, none).
#[test]
fn the_embeddings_dropout_masks_its_gradient() {
    let mut spec = typed_spec("f32", 0, 1, 2000, true, false, 1);
    spec.model.hidden_dropout = Some(0.9);
    spec.train.weight_decay = 0.0;
    let (rows, t, d) = (4, spec.model.seq_len, spec.model.d_model);
    let corpus = zmodel::Corpus::synthetic(spec.model.vocab_size, 3);
    let mut data = zmodel::Batcher::new(corpus, t, rows, 1, 1, 0, 7).unwrap();
    let mut e = Engine::new(&spec, comms(1).pop().unwrap()).unwrap();
    let wpe = |e: &Engine| {
        let named = e.named_params().unwrap();
        let (_, (_, values)) = named.iter().find(|(name, _)| name.contains("wpe")).unwrap();
        values.clone()
    };
    let before = wpe(&e);
    let mask = e.dropout().hidden.unwrap().site(0);
    e.forward_backward(&data.batch(0, 0).unwrap()).unwrap();
    e.step().unwrap();
    let after = wpe(&e);
    let mut unchanged = 0;
    for pos in 0..t {
        for j in 0..d {
            let dropped_everywhere = (0..rows).all(|b| !mask.keeps((b * t + pos) * d + j));
            let k = pos * d + j;
            assert_eq!(
                before[k] == after[k],
                dropped_everywhere,
                "wpe[{pos}, {j}]: {} -> {}",
                before[k],
                after[k]
            );
            unchanged += usize::from(dropped_everywhere);
        }
    }
    assert!(unchanged > t * d / 2, "{unchanged} of {} unchanged", t * d);
}

/// The optimizer walks a rank's slice in sub-groups of `zero.sub_group_size`
/// elements; AdamW is element-wise, so any split gives the same bits as one
/// sub-group (sizes that split blocks, span blocks and are 1 element).
#[test]
fn sub_group_size_changes_no_bit() {
    for dtype in ["f32", "bf16"] {
        for stage in [0u8, 3] {
            let base = train(typed_spec(dtype, stage, 1, 2000, true, false, 4), 2);
            for sub in [1u64, 97, 5000] {
                let mut spec = typed_spec(dtype, stage, 1, 2000, true, false, 4);
                spec.zero.sub_group_size = zconfig::spec::Size(sub);
                let got = train(spec, 2);
                for r in 0..2 {
                    assert_eq!(
                        got[r].losses, base[r].losses,
                        "{dtype} stage {stage} sub-group {sub}"
                    );
                    assert!(
                        got[r].params == base[r].params,
                        "{dtype} stage {stage} sub-group {sub}: parameters differ"
                    );
                }
            }
        }
    }
}

/// With gradient accumulation stages 2-3 reduce every micro-batch; the result
/// agrees with stage 0 to rounding.
#[test]
fn accumulation_agrees_across_stages() {
    let base = train(typed_spec("f32", 0, 2, 2000, true, false, 4), 2);
    for stage in 1..=3u8 {
        let got = train(typed_spec("f32", stage, 2, 2000, true, false, 4), 2);
        for (a, b) in base[0]
            .params
            .iter()
            .flatten()
            .zip(got[0].params.iter().flatten())
        {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + a.abs()),
                "stage {stage}: {a} vs {b}"
            );
        }
    }
}

/// Mixed precision keeps the stages bit-identical too: gradients are rounded to
/// the working type as backward produces them in every stage, reduced in f32,
/// and Adam updates the f32 master slices. With and without overlapped
/// reduction and activation checkpointing, against one stage-0 run.
#[test]
fn mixed_precision_stages_are_bit_identical() {
    for dtype in ["bf16", "f16"] {
        for world in [2, 3] {
            let base = train(typed_spec(dtype, 0, 1, 2000, true, false, 6), world);
            for stage in 0..=3u8 {
                for (overlap, ckpt) in [(true, false), (false, false), (true, true), (false, true)]
                {
                    if (stage, overlap, ckpt) == (0, true, false) {
                        continue; // the base itself
                    }
                    let spec = typed_spec(dtype, stage, 1, 2000, overlap, ckpt, 6);
                    let got = train(spec, world);
                    for r in 0..world {
                        assert!(
                            got[r] == base[r],
                            "{dtype} world {world} stage {stage} overlap {overlap} checkpointing {ckpt} rank {r}"
                        );
                    }
                }
            }
            assert!(
                base[0].losses[5] < base[0].losses[0],
                "{dtype}: {:?}",
                base[0].losses
            );
        }
    }
}

/// `train.grad_accum_dtype: f32` under 16-bit weights keeps backward's
/// f32 gradients unrounded: accumulated, reduced and put away in f32. Told
/// apart from 16-bit accumulation where the exact answer is known: two
/// micro-batches summed in f32 are one rounding, `a + b = b + a`, so taking
/// them in either order gives the same bits at every stage; summed in 16
/// bits, `round(round(a) + b)` is not `round(round(b) + a)`, and the order
/// shows. (LLaMA's untied head: each parameter takes one gradient a
/// micro-batch, where GPT-2's tied embedding takes two, the head's and the
/// embedding's, and three terms are not commutative.) Stages 0-3 agree bit
/// for bit at one micro-batch a step, as they do in 16 bits, and the run
/// is not the 16-bit one.
#[test]
fn f32_gradient_accumulation_sums_in_either_order() {
    use zconfig::spec::{Dtype, ModelKind};
    for dtype in ["bf16", "f16"] {
        let spec = |stage, accum, grads| {
            let mut s = typed_spec(dtype, stage, accum, 2000, true, false, 4);
            s.model.kind = ModelKind::Llama;
            s.train.grad_accum_dtype = grads;
            s
        };
        let reversed = Leg {
            reverse_micro_batches: true,
            ..Leg::default()
        };
        let base = train(spec(0, 1, Some(Dtype::F32)), 2);
        let halves = train(spec(0, 1, None), 2);
        assert!(base != halves, "{dtype}: f32 gradients change nothing");
        assert_eq!(
            base[0].grads_held,
            2 * halves[0].grads_held,
            "{dtype}: f32 gradients hold 4 bytes an element"
        );
        assert!(
            base[0].losses[3] < base[0].losses[0],
            "{dtype}: {:?}",
            base[0].losses
        );
        for stage in 0..=3u8 {
            let what = format!("{dtype} stage {stage}");
            if stage > 0 {
                let got = train(spec(stage, 1, Some(Dtype::F32)), 2);
                assert!(got == base, "{what}: not stage 0's bits");
            }
            let forward = train(spec(stage, 2, Some(Dtype::F32)), 2);
            let backward = train_leg(spec(stage, 2, Some(Dtype::F32)), 2, &reversed);
            assert!(forward == backward, "{what}: f32 sums depend on the order");
            let forward = train(spec(stage, 2, None), 2);
            let backward = train_leg(spec(stage, 2, None), 2, &reversed);
            assert!(
                forward != backward,
                "{what}: 16-bit sums do not depend on the order, so the check above tells nothing"
            );
        }
    }
}

/// 16-bit working weights and gradients track f32 training closely on a short
/// run; the loss scale exists for f16 only. The bounds are set from measurement
/// (8 steps, 2 ranks, stage 2): every step's loss within 1e-4 of f32's (bound
/// 5e-4), and the parameters' total update within 1.4% (bf16) and 0.5% (f16)
/// of f32's in relative L2 (bounds 4% and 2%) — so an update that is zeroed or
/// halved (relative error 1 or 0.5) fails, which a bound on parameter values
/// could not promise.
/// `train.dtype: bf16` reaches the model as bf16 products (on a CPU with
/// AMX, which `Gpt::with_bf16_products` decides and zmodel's test checks);
/// f32 and f16 keep f32 products.
#[test]
fn bf16_jobs_ask_the_model_for_bf16_products() {
    let spec = |dtype| typed_spec(dtype, 2, 1, 2000, true, false, 8);
    let products = |dtype| {
        Engine::new(&spec(dtype), comms(1).remove(0))
            .unwrap()
            .model()
            .products()
    };
    let bf16_here = zmodel::Gpt::new(&spec("bf16").model)
        .unwrap()
        .with_bf16_products(true)
        .products();
    assert_eq!(products("bf16"), bf16_here);
    assert_eq!(products("f32"), zmodel::Products::F32);
    assert_eq!(products("f16"), zmodel::Products::F32);
    eprintln!("bf16 jobs multiply here in {bf16_here:?}");
}

#[test]
fn mixed_precision_tracks_f32() {
    let spec = |dtype| typed_spec(dtype, 2, 1, 2000, true, false, 8);
    let f32_run = train(spec("f32"), 2);
    let init = Engine::new(&spec("f32"), comms(1).remove(0))
        .unwrap()
        .full_params()
        .unwrap();
    for (dtype, update_bound) in [("bf16", 0.04), ("f16", 0.02)] {
        let run = train(spec(dtype), 2);
        for (s, (a, b)) in f32_run[0].losses.iter().zip(&run[0].losses).enumerate() {
            assert!(
                (a - b).abs() <= 5e-4,
                "{dtype} step {}: loss {b} vs f32 {a}",
                s + 1
            );
        }
        let (mut diff, mut norm) = (0f64, 0f64);
        let finals = f32_run[0]
            .params
            .iter()
            .flatten()
            .zip(run[0].params.iter().flatten());
        for ((want, got), start) in finals.zip(init.iter().flatten()) {
            let (want, got) = (f64::from(want - start), f64::from(got - start));
            diff += (got - want).powi(2);
            norm += want.powi(2);
        }
        let rel = (diff / norm).sqrt();
        assert!(
            norm > 0.0 && rel <= update_bound,
            "{dtype}: the parameters' update is {rel:.4} (relative L2) away from f32's"
        );
        let scaled = run[0].scales.iter().all(|(s, _)| s.is_some());
        assert_eq!(scaled, dtype == "f16", "{dtype}: {:?}", run[0].scales);
    }
}

/// f16 started at a loss scale of 2^24 overflows on this model's first
/// gradients: those steps are skipped (parameters untouched, every rank
/// agreeing), the scale drops as DeepSpeed's scaler says, and training goes on.
#[test]
fn f16_overflow_skips_the_step_and_lowers_the_scale() {
    let mut spec = typed_spec("f16", 1, 1, 2000, true, false, 12);
    spec.train.loss_scale.initial_scale_power = 24;
    let runs = train_observed(spec.clone(), 2, true);
    let run = &runs[0];
    assert_eq!(runs[1].scales, run.scales, "ranks disagree on overflows");
    let skipped = run.scales.iter().filter(|s| s.1).count();
    assert!(skipped > 0, "no overflow at scale 2^24: {:?}", run.scales);
    assert!(skipped < 12, "every step overflowed: {:?}", run.scales);
    // Replay DeepSpeed's rules on the observed overflows.
    let mut scaler = zengine::precision::LossScaler::new(&spec.train.loss_scale);
    for (s, &(scale, skip)) in run.scales.iter().enumerate() {
        assert_eq!(scale, Some(scaler.scale), "step {}", s + 1);
        scaler.update(s as i64, skip);
    }
    let mut before = Engine::new(&spec, comms(1).remove(0))
        .unwrap()
        .full_params()
        .unwrap();
    for (s, after) in run.history.iter().enumerate() {
        assert_eq!(
            &before == after,
            run.scales[s].1,
            "step {}: skipped steps, and only they, leave parameters alone",
            s + 1
        );
        before = after.clone();
    }
}

/// An overflowed f16 step changes nothing of the optimizer: the schedule does
/// not advance (the step after it runs at the learning rate it would have
/// had), and Adam's step count does not either, which the first real update
/// shows exactly: from untouched zero moments, bias-corrected Adam moves every
/// weight by lr·g/(|g| + eps), i.e. by lr wherever |g| ≫ eps (weight decay off
/// here). Had the count advanced by k skipped steps, the first move would be
/// about 0.74·lr for k = 1.
#[test]
fn f16_skipped_steps_freeze_the_schedule_and_adams_step_count() {
    let mut spec = typed_spec("f16", 1, 1, 2000, true, false, 10);
    spec.train.loss_scale.initial_scale_power = 24;
    spec.train.loss_scale.hysteresis = 1;
    spec.train.weight_decay = 0.0;
    let run = &train_observed(spec.clone(), 2, true)[0];
    let skipped: Vec<bool> = run.scales.iter().map(|s| s.1).collect();
    let k = skipped.iter().take_while(|&&s| s).count();
    assert!(k > 0 && k < 10, "want leading skipped steps: {skipped:?}");
    let t = &spec.train;
    let mut updates = 0;
    for (s, (&lr, &skip)) in run.lrs.iter().zip(&skipped).enumerate() {
        let want = zengine::schedule::lr_at(updates + 1, t);
        assert_eq!(lr, want, "step {}: lr with {updates} updates done", s + 1);
        updates += u64::from(!skip);
    }
    assert_eq!(
        run.lrs[k], run.lrs[0],
        "the schedule advanced on skipped steps"
    );
    let before = &run.history[k - 1];
    let after = &run.history[k];
    let lr = run.lrs[k];
    let moves: Vec<f64> = before
        .iter()
        .flatten()
        .zip(after.iter().flatten())
        .map(|(a, b)| f64::from((b - a).abs()))
        .filter(|&d| d > 0.0)
        .collect();
    let total: usize = before.iter().map(Vec::len).sum();
    assert!(
        moves.len() > total / 2,
        "{} of {total} weights moved",
        moves.len()
    );
    let exact = moves
        .iter()
        .filter(|&&d| (d / lr - 1.0).abs() < 1e-3)
        .count();
    let over = moves.iter().filter(|&&d| d > lr * 1.001).count();
    assert_eq!(over, 0, "a first update moved a weight by more than lr");
    assert!(
        exact * 10 > moves.len() * 9,
        "only {exact} of {} weights moved by lr on the first real update",
        moves.len()
    );
}

/// A static loss scale (`train.loss_scale.static_scale`, DeepSpeed's
/// `fp16.loss_scale` above 0) never moves: at 2^24, which overflows this
/// model's gradients, every step runs at 2^24, the overflowed ones are
/// skipped (parameters untouched) and none fails; at 2^12, where nothing
/// overflows, the run is bit for bit the dynamic run started at 2^12 (whose
/// scale would first grow after 1000 clean steps).
#[test]
fn a_static_f16_loss_scale_never_moves_and_skips_what_overflows() {
    let big = 2f64.powi(24);
    let mut spec = typed_spec("f16", 1, 1, 2000, true, false, 8);
    spec.train.loss_scale.static_scale = Some(big);
    let run = &train_observed(spec.clone(), 2, true)[0];
    assert!(
        run.scales.iter().all(|s| s.0 == Some(big)),
        "{:?}",
        run.scales
    );
    let skipped = run.scales.iter().filter(|s| s.1).count();
    assert!(skipped > 0, "no overflow at 2^24: {:?}", run.scales);
    let mut before = Engine::new(&spec, comms(1).remove(0))
        .unwrap()
        .full_params()
        .unwrap();
    for (s, after) in run.history.iter().enumerate() {
        assert_eq!(&before == after, run.scales[s].1, "step {}", s + 1);
        before = after.clone();
    }
    let mut fixed = typed_spec("f16", 1, 1, 2000, true, false, 8);
    fixed.train.loss_scale.static_scale = Some(4096.0);
    let mut dynamic = typed_spec("f16", 1, 1, 2000, true, false, 8);
    dynamic.train.loss_scale.initial_scale_power = 12;
    let (fixed, dynamic) = (train(fixed, 2), train(dynamic, 2));
    assert!(
        fixed[0].scales.iter().all(|s| !s.1),
        "{:?}",
        fixed[0].scales
    );
    assert!(fixed == dynamic, "static 2^12 against dynamic from 2^12");
}

/// An overflow at the minimum loss scale fails the step with an error that
/// says so (the worker turns it into a failed job, exit 1), instead of
/// skipping forever.
#[test]
fn f16_overflow_at_the_minimum_scale_fails_the_step() {
    let mut spec = typed_spec("f16", 0, 1, 2000, true, false, 2);
    spec.train.loss_scale.initial_scale_power = 24;
    spec.train.loss_scale.min_loss_scale = (1u64 << 24) as f64;
    spec.train.loss_scale.hysteresis = 1;
    let t = &spec.train;
    let corpus = zmodel::Corpus::synthetic(spec.model.vocab_size, t.seed);
    let mut data = zmodel::Batcher::new(
        corpus,
        spec.model.seq_len,
        t.micro_batch_size,
        1,
        1,
        0,
        t.seed,
    )
    .unwrap();
    let mut engine = Engine::new(&spec, comms(1).remove(0)).unwrap();
    engine.forward_backward(&data.batch(0, 0).unwrap()).unwrap();
    let e = engine
        .step()
        .expect_err("an overflow at the minimum scale must fail");
    assert!(e.to_string().contains("minimum loss scale"), "{e}");
}

/// The optimizer's knobs reach the update: the defaults written out change
/// no bit; another beta1, beta2 or eps changes the parameters; wsd with a
/// floor shapes the learning rates the steps report (peak, then decay that
/// stays above the floor).
#[test]
fn optimizer_and_schedule_knobs_reach_the_update() {
    let base = typed_spec("f32", 1, 1, 2000, true, false, 6);
    let plain = train(base.clone(), 2);
    let with = |betas: [f64; 2], eps: f64| {
        let mut s = base.clone();
        s.train.optimizer = zconfig::spec::OptimizerSpec {
            betas,
            eps: Some(eps),
            ..Default::default()
        };
        s
    };
    assert!(
        train(with([0.9, 0.999], 1e-8), 2) == plain,
        "explicit defaults differ"
    );
    for (betas, eps) in [
        ([0.8, 0.999], 1e-8),
        ([0.9, 0.9], 1e-8),
        ([0.9, 0.999], 1e-3),
    ] {
        let got = train(with(betas, eps), 2);
        assert!(
            got[0].params != plain[0].params,
            "betas {betas:?} eps {eps}: no effect"
        );
    }
    let mut wsd = base.clone();
    wsd.train.schedule = zconfig::Schedule::Wsd;
    wsd.train.min_lr = wsd.train.lr / 10.0;
    wsd.train.decay_fraction = 0.5;
    let run = &train(wsd.clone(), 2)[0];
    let want: Vec<f64> = (1..=6)
        .map(|s| zengine::schedule::lr_at(s, &wsd.train))
        .collect();
    assert_eq!(run.lrs, want);
    let (peak, floor) = (wsd.train.lr, wsd.train.min_lr);
    assert_eq!(run.lrs[2], peak, "warmup 2, then stable: {:?}", run.lrs);
    assert!(run.lrs[5] < peak && run.lrs[5] > floor, "{:?}", run.lrs);
}

/// Validation loss, forward only: on 2 ranks and every stage, `eval_loss` of
/// each rank's batch equals the mean of the losses `forward_backward` then
/// returns for the same batches (the same forward; on 1 rank bit for bit), is
/// bit-identical across stages, and leaves no trace: the parameters after the
/// step equal those of a run that never evaluated.
#[test]
fn eval_loss_is_the_training_forward_without_a_trace() {
    let run = |stage: u8, world: usize, evaluate: bool| {
        let spec = typed_spec("bf16", stage, 1, 2000, true, false, 2);
        let hs: Vec<_> = comms(world)
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let spec = spec.clone();
                std::thread::spawn(move || {
                    let corpus = zmodel::Corpus::synthetic(spec.model.vocab_size, 3);
                    let seq = spec.model.seq_len;
                    let mut data = zmodel::Batcher::new(corpus, seq, 4, 1, world, rank, 7).unwrap();
                    let mut e = Engine::new(&spec, comm.clone()).unwrap();
                    let batch = data.batch(0, 0).unwrap();
                    let eval = if evaluate {
                        e.eval_loss(std::slice::from_ref(&batch)).unwrap()
                    } else {
                        f64::NAN
                    };
                    let loss = e.forward_backward(&batch).unwrap();
                    let sum = comm.all_reduce(vec![loss as f32]).unwrap()[0];
                    e.step().unwrap();
                    (
                        eval,
                        loss,
                        f64::from(sum) / world as f64,
                        e.full_params().unwrap(),
                    )
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    };
    let mut evals = Vec::new();
    for stage in 0..=3u8 {
        let one = &run(stage, 1, true)[0];
        assert_eq!(
            one.0, one.1,
            "stage {stage}: eval differs from the training forward"
        );
        let with = run(stage, 2, true);
        let without = run(stage, 2, false);
        for (r, (w, wo)) in with.iter().zip(&without).enumerate() {
            assert!(
                (w.0 - w.2).abs() < 1e-6,
                "stage {stage}: eval {} vs training {}",
                w.0,
                w.2
            );
            assert_eq!(w.0, with[0].0, "stage {stage}: ranks disagree");
            assert!(
                w.3 == wo.3,
                "stage {stage} rank {r}: evaluating changed the step"
            );
        }
        evals.push(with[0].0);
    }
    assert!(
        evals.iter().all(|g| *g == evals[0]),
        "stages disagree: {evals:?}"
    );
}

/// A LLaMA (RMSNorm, rotary positions, SwiGLU, 4 query heads on 2 key/value
/// heads, no biases, an untied head): stages 0-3, with and without
/// activation checkpointing, give the same bits at world size 3, in f32 and
/// bf16, and it learns. Stage 3 with its gate/up projection in two column
/// tiles (tiles without biases) too, at world size 2 (over TCP a sum of two
/// adds in either order; tiling moves owners, see `tiling.rs`). And the
/// same as Qwen3: heads of 12 over d_model 32, each head's q and k normed.
#[test]
fn llama_stages_are_bit_identical() {
    llama_stages_are_bit_identical_with("");
    llama_stages_are_bit_identical_with("qk_norm: true, head_dim: 12, ");
}

fn llama_stages_are_bit_identical_with(extra: &str) {
    let llama = |dtype: &str, stage: u8, ckpt: bool, tile: u64| {
        let yaml = format!(
            "model: {{kind: llama, {extra}vocab_size: 64, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_hidden: 256, seq_len: 16, tile_size: {tile}}}\n\
             data: {{format: synthetic}}\n\
             train: {{steps: 8, micro_batch_size: 4, lr: 3.0e-3, warmup_steps: 2, activation_checkpointing: {ckpt}, dtype: {dtype}}}\n\
             zero: {{stage: {stage}, reduce_bucket_size: 2000, prefetch_bucket_size: 3000, param_persistence_threshold: 100}}\n"
        );
        yaml.parse::<zconfig::JobSpec>().unwrap()
    };
    for dtype in ["f32", "bf16"] {
        // 8192 elements: gate_up_proj (32 x 512) in two tiles of 256 columns.
        let whole = 1 << 20;
        let base = train(llama(dtype, 0, false, whole), 3);
        for (stage, ckpt, tile) in [
            (1, false, whole),
            (2, true, whole),
            (3, false, whole),
            (3, true, whole),
        ] {
            let got = train(llama(dtype, stage, ckpt, tile), 3);
            for r in 0..3 {
                assert_eq!(
                    got[r].losses, base[r].losses,
                    "{extra}{dtype} stage {stage} checkpointing {ckpt} tile {tile} rank {r}"
                );
                assert!(
                    got[r].params == base[r].params,
                    "{dtype} stage {stage} checkpointing {ckpt} tile {tile} rank {r}: parameters"
                );
            }
        }
        assert!(
            base[0].losses[7] < base[0].losses[0],
            "{extra}{dtype}: {:?}",
            base[0].losses
        );
        let untiled = train(llama(dtype, 3, false, whole), 2);
        let tiled = train(llama(dtype, 3, false, 8192), 2);
        // Two tile groups per block.
        assert_eq!(tiled[0].padded.len(), untiled[0].padded.len() + 2 * 2);
        for r in 0..2 {
            assert_eq!(tiled[r].losses, untiled[r].losses, "{dtype} tiled rank {r}");
            assert!(
                !untiled[r].named.is_empty() && tiled[r].named == untiled[r].named,
                "{dtype} tiled rank {r}: parameters"
            );
        }
    }
}

/// `train.freeze`'s patterns for the tests' GPT: the token table (and so
/// the tied head) and the second block.
fn frozen_patterns() -> Vec<String> {
    vec!["wte.weight".into(), "h.{1-1}.*".into()]
}

/// The embedding and the first block frozen: backward stops after the
/// second block, and neither the embedding's nor the first block's
/// gradients are made or reduced.
fn frozen_below() -> Vec<String> {
    vec!["w*.weight".into(), "h.0.*".into()]
}

/// With the layers below frozen (backward stopping above them), every
/// stage, with activation checkpointing or not, keeps stage 0's bits; the
/// frozen parameters keep theirs, and one unclipped step moves the others
/// as a run without freezing moves them (2 ranks: a sum of two is the same
/// in any order, so the buckets' other cut changes no bit).
#[test]
fn backward_stops_above_the_frozen_layers() {
    let make = |stage, ckpt, steps| {
        let mut spec = typed_spec("f32", stage, 1, 2000, true, ckpt, steps);
        spec.train.freeze = frozen_below();
        spec
    };
    let until_0 = Leg {
        until: Some(0),
        ..Leg::default()
    };
    let start = train_leg(make(0, false, 4), 2, &until_0);
    let base = train(make(0, false, 4), 2);
    for (name, (_, values)) in &base[0].named {
        let frozen = zconfig::freeze::frozen(&frozen_below(), name);
        assert_eq!(values == &start[0].named[name].1, frozen, "{name}");
    }
    for (stage, ckpt) in [(0u8, true), (1, false), (2, true), (3, false), (3, true)] {
        let got = train(make(stage, ckpt, 4), 2);
        for r in 0..2 {
            let at = format!("stage {stage} checkpointing {ckpt} rank {r}");
            assert_eq!(got[r].losses, base[r].losses, "losses: {at}");
            assert!(got[r].params == base[r].params, "parameters: {at}");
        }
    }
    let unclipped = |freeze: Vec<String>| {
        let mut spec = typed_spec("f32", 2, 1, 2000, true, false, 1);
        spec.train.grad_clip = 0.0;
        spec.train.freeze = freeze;
        train(spec, 2)
    };
    let (all, some) = (unclipped(Vec::new()), unclipped(frozen_below()));
    for (name, (_, values)) in &some[0].named {
        if !zconfig::freeze::frozen(&frozen_below(), name) {
            assert!(values == &all[0].named[name].1, "{name} moved otherwise");
        }
    }
    // Only the trained groups' gradients are reduced: the second block and
    // the final norm, 46% of the parameters (padding aside).
    let numel = |n: &(String, Vec<usize>)| n.1.iter().product::<usize>() as f64;
    let params = make(0, false, 1).model.param_shapes();
    let total: f64 = params.iter().map(numel).sum();
    let trained: f64 = params
        .iter()
        .filter(|p| !zconfig::freeze::frozen(&frozen_below(), &p.0))
        .map(numel)
        .sum();
    // The frozen groups (54% of the parameters) hold no moments and no
    // gradients, and the first block keeps no activations: backward does
    // not go there.
    for (what, got, of) in [
        ("moments", some[0].optimizer_held, all[0].optimizer_held),
        ("gradients", some[0].grads_held, all[0].grads_held),
        // Nor are they gathered after the step: they did not change.
        (
            "parameters gathered",
            some[0].all_gather_bytes,
            all[0].all_gather_bytes,
        ),
    ] {
        assert!(got * 10 < of * 6, "{what}: {got} of {of}");
    }
    assert!(
        some[0].activations < all[0].activations,
        "activations {} of {}",
        some[0].activations,
        all[0].activations
    );
    let reduced = |run: &[common::Run]| run[0].counters.op(zproto::Op::ReduceScatter) as f64;
    let share = reduced(&some) / reduced(&all);
    assert!(
        (share - trained / total).abs() < 0.05,
        "reduced {share:.3} of the gradient bytes for {:.3} of the parameters",
        trained / total
    );
}

/// Groups that train only in part reduce only what trains: with every
/// weight frozen (BitFit: the biases train), buckets carry no frozen
/// element, and every stage on 3 ranks (where the order of a sum of three
/// matters, and each element must stay in its owner's chunk), in f32 and
/// bf16, keeps stage 0's bits, the reductions shrinking to the trained
/// share; and so do stages 1-2's gathers of the updated parameters.
#[test]
fn partly_frozen_groups_reduce_only_what_trains() {
    let bitfit = vec!["*.weight".to_string()];
    let spec = |dtype, stage, freeze: &[String]| {
        let mut spec = typed_spec(dtype, stage, 1, 2000, true, false, 3);
        spec.train.freeze = freeze.to_vec();
        spec
    };
    for dtype in ["f32", "bf16"] {
        let base = train(spec(dtype, 0, &bitfit), 3);
        for stage in 1..4u8 {
            let got = train(spec(dtype, stage, &bitfit), 3);
            for r in 0..3 {
                let at = format!("{dtype} stage {stage} rank {r}");
                assert_eq!(got[r].losses, base[r].losses, "losses: {at}");
                assert!(got[r].params == base[r].params, "parameters: {at}");
            }
        }
    }
    let shapes = spec("f32", 0, &[]).model.param_shapes();
    let numel = |s: &Vec<usize>| s.iter().product::<usize>() as f64;
    let total: f64 = shapes.iter().map(|(_, s)| numel(s)).sum();
    let trained: f64 = (shapes.iter())
        .filter(|(n, _)| !zconfig::freeze::frozen(&bitfit, n))
        .map(|(_, s)| numel(s))
        .sum();
    for (stage, op) in [
        (0, zproto::Op::AllReduce),
        (2, zproto::Op::ReduceScatter),
        (1, zproto::Op::AllGather),
        (2, zproto::Op::AllGather),
    ] {
        let bytes =
            |freeze: &[String]| train(spec("f32", stage, freeze), 3)[0].counters.op(op) as f64;
        let share = bytes(&bitfit) / bytes(&[]);
        // Each rank's chunk of a bucket is as long as the longest: the
        // biases fall unevenly on the ranks' slices.
        assert!(
            share > 0.0 && share < 3.0 * trained / total,
            "stage {stage} {op:?}: {share:.4} of the bytes for {:.4} of the parameters",
            trained / total
        );
    }
}

/// The engine's gradient is the model's backward: one step's gradient
/// norm on one rank equals the norm of the gradient that zmodel's forward
/// and backward, called on whole parameters, give for the same batch
/// (GPT-2 with its tied head; LLaMA untied), to f32 rounding. A skipped
/// weight or head product where nothing is frozen would change it.
#[test]
fn the_engines_gradient_is_the_models_backward() {
    use candle_core::{Device, Tensor};
    use zmodel::{BlockParams, EmbeddingParams, Gpt, HeadParams};
    let llama: zconfig::JobSpec =
        "model: {kind: llama, vocab_size: 64, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_hidden: 96, seq_len: 16}\n\
         data: {format: synthetic}\n\
         train: {steps: 1, micro_batch_size: 4, lr: 3.0e-3}\n"
            .parse()
            .unwrap();
    for spec in [typed_spec("f32", 0, 1, 2000, true, false, 1), llama] {
        let engine_norm = train(spec.clone(), 1)[0].norms[0];
        let (m, t) = (&spec.model, &spec.train);
        let g = Gpt::new(m).unwrap();
        let (layout, dev, l) = (g.layout(), Device::Cpu, m.n_layers);
        let group = |i: usize| -> Vec<Tensor> {
            let shapes = g.groups()[i].params.clone();
            let values = g.init_group(i, t.seed).into_iter().zip(shapes);
            values
                .map(|(v, ps)| Tensor::from_vec(v, ps.shape.as_slice(), &dev).unwrap())
                .collect()
        };
        let corpus = zmodel::Corpus::synthetic(m.vocab_size, t.seed);
        let mut data =
            zmodel::Batcher::new(corpus, m.seq_len, t.micro_batch_size, 1, 1, 0, t.seed).unwrap();
        let batch = data.batch(0, 0).unwrap();
        let shape = (batch.rows, batch.seq_len);
        let tokens = Tensor::from_slice(&batch.inputs, shape, &dev).unwrap();
        let targets = Tensor::from_slice(&batch.targets, shape, &dev).unwrap();
        let emb = EmbeddingParams::from_vec(group(0), layout).unwrap();
        let mut x = g.embed(&emb, &tokens).unwrap();
        let mut kept = Vec::new();
        for b in 1..=l {
            let bp = BlockParams::from_vec(group(b), layout).unwrap();
            let (y, acts) = g.block_forward(&bp, &x).unwrap();
            kept.push((bp, acts));
            x = y;
        }
        let head = HeadParams::from_vec(group(l + 1), layout).unwrap();
        let wte = head.lm_head.is_none().then_some(&emb.wte);
        let back = g
            .head_backward(&head, wte, &x, &targets, 1.0, batch.divisor)
            .unwrap();
        let out = back.out.unwrap();
        let mut grads = back.norm.into_vec();
        let mut dx = back.dx;
        for (bp, acts) in kept.iter().rev() {
            let (bg, d) = g.block_backward(bp, acts, &dx).unwrap();
            grads.extend(bg.into_vec());
            dx = d;
        }
        // The token table's rows put in a whole table of zeros.
        let embedding = g.embed_backward(&tokens, None, &dx, true).unwrap();
        let table = embedding.wte.unwrap().whole(m.vocab_size);
        let table = Tensor::from_vec(table, (m.vocab_size, m.d_model), &dev).unwrap();
        match wte.is_some() {
            true => grads.push((table + out).unwrap()),
            false => grads.extend([table, out]),
        }
        grads.extend(embedding.wpe);
        let squares: f64 = grads
            .iter()
            .flat_map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .map(|v| f64::from(v) * f64::from(v))
            .sum();
        let want = squares.sqrt();
        assert!(
            (engine_norm - want).abs() < 1e-5 * want,
            "{:?}: engine {engine_norm}, model {want}",
            m.kind
        );
    }
}

/// Weights frozen inside blocks that train, and the tied head's matrix
/// (`wte`), skip their gradient products: one unclipped step moves every
/// other parameter as a run without freezing moves it, at every stage
/// (2 ranks), with their biases; and the same for LLaMA's untied
/// `lm_head` and its gate/up projection in two column tiles at stage 3.
/// The model FLOPs that MFU is figured from leave the skipped products out.
#[test]
fn frozen_weights_inside_blocks_leave_every_other_gradient_as_it_was() {
    let inside: Vec<String> = [
        "wte.weight",
        "h.*.attn.c_attn.weight",
        "h.1.mlp.c_fc.weight",
    ]
    .map(String::from)
    .to_vec();
    let one_step = |stage, freeze: &[String]| {
        let mut spec = typed_spec("f32", stage, 1, 2000, true, false, 1);
        spec.train.grad_clip = 0.0;
        spec.train.freeze = freeze.to_vec();
        train(spec, 2)
    };
    let llama = |freeze: &[String]| {
        let mut spec: zconfig::JobSpec =
            "model: {kind: llama, vocab_size: 64, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_hidden: 256, seq_len: 16, tile_size: 8192}\n\
             data: {format: synthetic}\n\
             train: {steps: 1, micro_batch_size: 4, lr: 3.0e-3, warmup_steps: 0, grad_clip: 0}\n\
             zero: {stage: 3, reduce_bucket_size: 2000, prefetch_bucket_size: 3000, param_persistence_threshold: 100}\n"
                .parse()
                .unwrap();
        spec.train.freeze = freeze.to_vec();
        train(spec, 2)
    };
    let untied: Vec<String> = ["lm_head.weight", "layers.*.mlp.gate_up_proj.weight"]
        .map(String::from)
        .to_vec();
    let runs = (0..4u8)
        .map(|stage| {
            (
                format!("stage {stage}"),
                one_step(stage, &inside),
                one_step(stage, &[]),
                &inside,
            )
        })
        .chain([(
            "llama tiled".to_string(),
            llama(&untied),
            llama(&[]),
            &untied,
        )]);
    for (what, some, all, frozen) in runs {
        for r in 0..2 {
            let mut counted = [0, 0];
            for (name, (_, values)) in &some[r].named {
                let is_frozen = zconfig::freeze::frozen(frozen, name);
                counted[usize::from(is_frozen)] += 1;
                assert_eq!(
                    values == &all[r].named[name].1,
                    !is_frozen,
                    "{what} rank {r}: {name} (frozen {is_frozen}) moved as without freezing"
                );
            }
            assert!(counted[0] > 0 && counted[1] > 0, "{what}: {counted:?}");
        }
    }
    // FLOPs: the tied head's weight gradient (2·v·d) and each frozen
    // block weight's (2 per element) are left out.
    let spec = typed_spec("f32", 0, 1, 2000, true, false, 1);
    let model = zmodel::Gpt::new(&spec.model).unwrap().flops_per_token();
    let numel = |freeze: &[String]| -> f64 {
        let shapes = spec.model.param_shapes();
        let frozen = shapes
            .iter()
            .filter(|(n, _)| n.starts_with("h.") && zconfig::freeze::frozen(freeze, n));
        frozen
            .map(|(_, s)| s.iter().product::<usize>() as f64)
            .sum()
    };
    let (v, d) = (spec.model.vocab_size as f64, spec.model.d_model as f64);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b;
    let all = one_step(0, &[]);
    assert!(
        close(all[0].flops_per_token, model),
        "{} {model}",
        all[0].flops_per_token
    );
    let some = one_step(0, &inside);
    let want = model - 2.0 * v * d - 2.0 * numel(&inside);
    assert!(
        close(some[0].flops_per_token, want),
        "{} {want}",
        some[0].flops_per_token
    );
    // Below the lowest block that trains, no backward at all: of the frozen
    // first block's 6 per parameter and 12·h·hd·T, 2 and 4·h·hd·T are left.
    let below = train(
        {
            let mut spec = typed_spec("f32", 0, 1, 2000, true, false, 1);
            spec.train.freeze = frozen_below();
            spec
        },
        1,
    );
    let m = &spec.model;
    let attention = 4.0 * (m.attn_width() * m.seq_len) as f64;
    let want = model - 2.0 * v * d - 4.0 * m.block_params() as f64 - 2.0 * attention;
    assert!(
        close(below[0].flops_per_token, want),
        "{} {want}",
        below[0].flops_per_token
    );
    // `zrun estimate` and `zrun plan` count by parameter names what the
    // engine counts by its groups: the same figure, the untied and tiled
    // LLaMA's too.
    let by_names = |spec: &zconfig::JobSpec, freeze: &[String]| {
        zconfig::estimate::frozen_flops_per_token(&spec.model, freeze)
    };
    assert!(close(some[0].flops_per_token, by_names(&spec, &inside)));
    assert!(close(
        below[0].flops_per_token,
        by_names(&spec, &frozen_below())
    ));
    let tiled = llama(&untied);
    let llama_spec: zconfig::JobSpec = "model: {kind: llama, vocab_size: 64, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_hidden: 256, seq_len: 16, tile_size: 8192}\ndata: {format: synthetic}\n"
        .parse()
        .unwrap();
    let want = by_names(&llama_spec, &untied);
    assert!(
        close(tiled[0].flops_per_token, want),
        "{} {want}",
        tiled[0].flops_per_token
    );
}

/// Blocks keep no input of a linear whose weight is frozen, and nothing
/// below the lowest block that trains: the activations a step keeps are
/// what `zrun estimate` counts for the job (its arithmetic by parameter
/// names, the engine's by its groups), with checkpointing too; BitFit's
/// blocks (every block weight frozen) keep 9 of 16 values a token.
#[test]
fn frozen_weights_keep_no_inputs_for_their_gradients() {
    let patterns = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let bitfit = patterns(&["h.*.*.*.weight"]);
    let cases = [
        Vec::new(),
        bitfit.clone(),
        patterns(&["h.*.attn.*"]),
        frozen_below(),
        patterns(&["w*.weight", "h.0.*", "h.1.mlp.c_proj.weight"]),
    ];
    let mut kept = Vec::new();
    for freeze in cases {
        for (dtype, ckpt) in [("f32", false), ("f32", true), ("bf16", false)] {
            let mut spec = typed_spec(dtype, 0, 1, 2000, true, ckpt, 1);
            spec.train.freeze = freeze.clone();
            let got = train(spec.clone(), 1)[0].activations as f64;
            // bf16 values where the products take bf16.
            let types = Kept::for_job(&spec, zgemm::has_native_bf16());
            let (plain, checkpointed) =
                zconfig::estimate::job_activation_bytes(&spec, false, types);
            let want = if ckpt { checkpointed } else { plain };
            match types {
                Kept::F32 => assert_eq!(got, want, "{freeze:?} {dtype} checkpointing {ckpt}"),
                // A bf16 buffer starts on a 64-byte line (32 values more)
                // and may pad its rows to whole lines: slack the estimate
                // leaves out.
                Kept::Bf16Products => assert!(
                    got >= want && got <= 1.03 * want,
                    "{freeze:?} {dtype}: kept {got} bytes, estimated {want}"
                ),
            }
            if dtype == "f32" && !ckpt {
                kept.push(got);
            }
        }
    }
    // BitFit: of GPT-2's 16·d a token a block keeps, the inputs of the four
    // linears (d, d, d and 4·d) go; 2 blocks, 4 × 16 tokens, d = 32.
    assert_eq!(kept[0] - kept[1], 2.0 * 7.0 * 32.0 * 4.0 * 64.0);
    assert!(
        kept[2] < kept[0] && kept[4] < kept[3] && kept[3] < kept[0],
        "{kept:?}"
    );
}

/// Frozen weights inside groups that train hold no optimizer moments: the
/// pages of the moments wholly inside them go back to the kernel (zeros
/// that nothing writes), at stage 0 (whole moments) and stage 2 (each
/// rank's slice), and the job keeps stage 0's bits at stage 2.
#[test]
fn frozen_weights_inside_trained_groups_hold_no_moments() {
    let frozen: Vec<String> = vec!["h.*.weight".into()];
    let run = |stage, freeze: &[String]| {
        let mut spec = typed_spec("f32", stage, 1, 2000, true, false, 3);
        spec.model.d_model = 64;
        spec.train.freeze = freeze.to_vec();
        train(spec, 2)
    };
    let base = run(0, &frozen);
    for stage in [0u8, 2] {
        let (some, all) = (run(stage, &frozen), run(stage, &[]));
        for r in 0..2 {
            assert_eq!(some[r].losses, base[r].losses, "stage {stage} rank {r}");
            assert!(some[r].params == base[r].params, "stage {stage} rank {r}");
            // The blocks' weights are 93% of the parameters; whole pages of
            // their moments, at least 78%.
            let (held, of) = (some[r].optimizer_held, all[r].optimizer_held);
            assert!(
                held * 100 < of * 35,
                "stage {stage} rank {r}: {held} of {of}"
            );
        }
    }
    // What `zrun estimate` counts (8 bytes a trained element under AdamW
    // in f32) within two pages of each frozen parameter's two moments:
    // 12 frozen parameters here.
    let mut spec = typed_spec("f32", 0, 1, 2000, true, false, 3);
    spec.model.d_model = 64;
    let trained = zconfig::estimate::trained_elements(&spec.model, &frozen).trained;
    let held = base[0].optimizer_held as f64;
    assert!(
        held >= 8.0 * trained && held <= 8.0 * trained + (12 * 2 * 2 * 4096) as f64,
        "held {held} bytes of moments for {trained} trained elements"
    );
}

/// Frozen parameters hold no gradient memory, in the whole gradients that
/// stages 0-1 keep or the own slices of stages 2-3: their pages go back to
/// the kernel when the buffer is made and nothing writes them again (the metrics' gradient
/// bytes leave out the pages `mincore` finds unmapped after the step, so a
/// writer that touched them shows), in f32 and bf16. (Clipping, which this
/// job's norms trigger, at stage 1 with the embedding frozen whole
/// panicked before: it scaled the missing gradients of that group.)
#[test]
fn frozen_parameters_hold_no_gradient_pages() {
    let bitfit: Vec<String> = vec!["*.weight".into()];
    let run = |dtype, stage, freeze: &[String]| {
        let mut spec = typed_spec(dtype, stage, 2, 2000, true, false, 3);
        spec.model.d_model = 64;
        spec.train.freeze = freeze.to_vec();
        train(spec, 2)
    };
    // Each rank's bytes against the unfrozen run's, and all ranks' against
    // what `zrun estimate` counts (the bytes of each trained element on
    // every rank at stages 0-1, on one at stages 2-3), within two pages
    // each side of each frozen parameter (and of the slices' border at
    // stages 2-3, which may cut one).
    let spec = typed_spec("f32", 0, 2, 2000, true, false, 3);
    let model = zconfig::spec::ModelSpec {
        d_model: 64,
        ..spec.model
    };
    let trained = zconfig::estimate::trained_elements(&model, &bitfit).trained as usize;
    let frozen = (model.param_shapes().iter())
        .filter(|(n, _)| zconfig::freeze::frozen(&bitfit, n))
        .count();
    for (dtype, bytes) in [("f32", 4), ("bf16", 2)] {
        for stage in 0u8..=3 {
            let (some, all) = (run(dtype, stage, &bitfit), run(dtype, stage, &[]));
            for r in 0..2 {
                let (held, of) = (some[r].grads_held, all[r].grads_held);
                assert!(
                    held * 100 < of * 30,
                    "{dtype} stage {stage} rank {r}: {held} of {of} gradient bytes"
                );
                // Stages 2-3 stage each micro-batch's gradient for its
                // bucket: only what trains, so at stage 2 the buffers for
                // reductions hold a few percent of the unfrozen job's (at
                // stage 3 its parameter gathers set that peak).
                let (staged, of) = (some[r].comm_peak, all[r].comm_peak);
                assert!(
                    stage != 2 || staged * 100 < of * 5,
                    "{dtype} stage {stage} rank {r}: {staged} of {of} bytes staged and packed"
                );
            }
            let held: usize = some.iter().map(|r| r.grads_held as usize).sum();
            let (copies, borders) = if stage < 2 { (2, 1) } else { (1, 2) };
            let least = bytes * trained * copies;
            assert!(
                held >= least && held <= least + frozen * borders * 2 * 4096 * copies,
                "{dtype} stage {stage}: {held} bytes of gradients held for {trained} trained elements"
            );
        }
    }
}

/// Frozen parameters (`train.freeze`) keep their initial bits at every
/// stage, under AdamW in f32 and bf16 and under LAMB, while the others
/// train; stages 1-3 keep stage 0's bits, as without freezing.
#[test]
fn frozen_parameters_keep_their_bits_at_every_stage() {
    use zconfig::spec::OptimizerKind;
    for (dtype, rule) in [
        ("f32", OptimizerKind::Adamw),
        ("bf16", OptimizerKind::Adamw),
        ("f32", OptimizerKind::Lamb),
    ] {
        let make = |stage| {
            let mut spec = match rule {
                OptimizerKind::Lamb => lamb(dtype, stage, 1),
                _ => typed_spec(dtype, stage, 1, 2000, true, false, 4),
            };
            spec.train.freeze = frozen_patterns();
            spec
        };
        let what = format!("{dtype} {rule:?}");
        let until_0 = Leg {
            until: Some(0),
            ..Leg::default()
        };
        let start = train_leg(make(0), 2, &until_0);
        let saved = tempfile::tempdir().unwrap();
        let save = Leg {
            save: Some(saved.path()),
            ..Leg::default()
        };
        let base = train_leg(make(0), 2, &save);
        // Frozen parameters' moments stay as they started: the token table
        // (the first 64 × 32 of group 0) and all of block 1 (group 2).
        let ckpt = zckpt::Checkpoint::open(saved.path()).unwrap();
        let m = |g| ckpt.full_group(g, "exp_avg").unwrap();
        let (embedding, block_0, block_1) = (m(0), m(1), m(2));
        let moved = |x: &[f32]| x.iter().any(|&v| v != 0.0);
        assert!(
            !moved(&embedding[..64 * 32]) && moved(&embedding[64 * 32..]),
            "{what}: the token table's moments moved, or the positions' did not"
        );
        assert!(moved(&block_0) && !moved(&block_1), "{what}: block moments");
        let mut counted = [0, 0];
        for (name, (_, values)) in &base[0].named {
            let frozen = zconfig::freeze::frozen(&frozen_patterns(), name);
            let kept = values == &start[0].named[name].1;
            assert_eq!(kept, frozen, "{what}: {name} frozen {frozen}, kept {kept}");
            counted[usize::from(frozen)] += 1;
        }
        assert!(counted[0] > 0 && counted[1] > 1, "{what}: {counted:?}");
        for stage in 1..=3u8 {
            let got = train(make(stage), 2);
            for r in 0..2 {
                let at = format!("{what} stage {stage} rank {r}");
                assert_eq!(got[r].losses, base[r].losses, "losses: {at}");
                assert!(got[r].params == base[r].params, "parameters: {at}");
            }
        }
    }
}

/// The gradient norm leaves frozen parameters out, as PyTorch's clipping
/// does (they have no gradient there): on the first step, where all runs
/// see the same gradients, the squared norm with a set frozen plus the one
/// with every other parameter frozen is the squared norm of all. And with
/// clipping off, one step moves every parameter left to train exactly as
/// a run without freezing moves it.
#[test]
fn the_gradient_norm_leaves_frozen_parameters_out() {
    let one_step = |stage, freeze: Vec<String>| {
        let mut spec = typed_spec("f32", stage, 1, 2000, true, false, 1);
        spec.train.grad_clip = 0.0;
        spec.train.freeze = freeze;
        train(spec, 2)
    };
    let names: Vec<String> = typed_spec("f32", 0, 1, 2000, true, false, 1)
        .model
        .param_shapes()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let others: Vec<String> = names
        .iter()
        .filter(|n| !zconfig::freeze::frozen(&frozen_patterns(), n))
        .cloned()
        .collect();
    for stage in [0u8, 2] {
        let all = one_step(stage, Vec::new());
        let some = one_step(stage, frozen_patterns());
        let rest = one_step(stage, others.clone());
        let sq = |run: &[common::Run]| run[0].norms[0] * run[0].norms[0];
        let (whole, parts) = (sq(&all), sq(&some) + sq(&rest));
        assert!(
            (parts - whole).abs() <= 1e-12 * whole && sq(&some) < whole && sq(&rest) < whole,
            "stage {stage}: {} + {} against {whole}",
            sq(&some),
            sq(&rest)
        );
        for name in &others {
            assert!(
                some[0].named[name].1 == all[0].named[name].1,
                "stage {stage}: {name} moved otherwise than without freezing"
            );
        }
    }
}

/// LAMB's step statistics count only the parameters it moves: on the first
/// step (every run's ratios the same), a run with a set frozen and one with
/// every other parameter frozen split the unfrozen run's ratios between
/// them, so their extremes and their means weighted by the parameters each
/// moves give the whole run's.
#[test]
fn lamb_ratios_leave_frozen_parameters_out() {
    let one_step = |freeze: Vec<String>| {
        let mut spec = lamb("f32", 1, 1);
        spec.train.steps = 1;
        // Unclipped: the norms, and so a clipped run's gradients, differ.
        spec.train.grad_clip = 0.0;
        spec.train.freeze = freeze;
        train(spec, 2)[0].trust_ratios[0].expect("LAMB's ratios")
    };
    let names: Vec<String> = lamb("f32", 1, 1)
        .model
        .param_shapes()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let (frozen, moved): (Vec<String>, Vec<String>) = names
        .iter()
        .cloned()
        .partition(|n| zconfig::freeze::frozen(&frozen_patterns(), n));
    let all = one_step(Vec::new());
    let a = one_step(frozen_patterns());
    let b = one_step(moved.clone());
    let (na, nb) = (moved.len() as f64, frozen.len() as f64);
    assert_eq!(all.min, a.min.min(b.min));
    assert_eq!(all.max, a.max.max(b.max));
    let mean = (a.mean * na + b.mean * nb) / (na + nb);
    assert!(
        (mean - all.mean).abs() <= 1e-12 * all.mean,
        "{mean} against {}",
        all.mean
    );
}

/// Where one rank launches its reductions late, the other's backward runs
/// ahead of them: it holds at most two buckets packed or in flight (as
/// DeepSpeed's two IPG buffers), waiting for the oldest before it packs the
/// next, rather than the whole gradient; and it trains to the same bits.
/// Every group is a bucket here (six blocks, the two largest buckets a
/// third of the gradient).
#[test]
fn backward_holds_at_most_two_buckets_while_the_reductions_lag() {
    for stage in [0u8, 1] {
        let mut spec = typed_spec("f32", stage, 1, 1, true, false, 2);
        spec.model.n_layers = 6;
        let even = train(spec.clone(), 2);
        let leg = Leg {
            lagging: Some((1, std::time::Duration::from_millis(30))),
            ..Leg::default()
        };
        let lagged = train_leg(spec, 2, &leg);
        assert!(lagged == even, "stage {stage}: the lag changed the bits");
        let mut buckets = even[0].padded.clone();
        buckets.sort_unstable_by(|a, b| b.cmp(a));
        let (two, all) = (
            buckets[..2].iter().sum::<usize>(),
            buckets.iter().sum::<usize>(),
        );
        assert!(3 * two < all, "{buckets:?}");
        let held = lagged[0].comm_peak as usize;
        assert!(
            held >= 4 * buckets[0] && held <= 4 * two,
            "stage {stage}: {held} bytes of buckets held at once, two buckets {} bytes",
            4 * two
        );
    }
}
