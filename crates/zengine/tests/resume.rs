//! Saving and loading the engine's state, in process: a run checkpointed
//! midway, moved through another world size and stage (and through swap
//! files), then resumed at the original layout, continues bit for bit like the
//! run that was never interrupted. The continuation observes everything a
//! checkpoint must carry: parameters, both Adam moments (wrong moments change
//! the next update), Adam's step count and the schedule position (the learning
//! rate of every later step), and f16's whole loss-scaler state (the scale,
//! and when it next grows or halves).
//!
//! The end-to-end suite (`tests/checkpoints.rs`) checks the same through
//! `zrun`; this one runs in seconds, so mutation testing can use it.

mod common;

use std::path::Path;

use common::{train, train_leg, typed_spec, Leg, Run};
use zconfig::spec::{OffloadDevice, OffloadSpec, Size, ZeroStage};
use zconfig::JobSpec;

/// `spec` at `stage`, optionally with its optimizer state in swap files
/// under `swap`.
fn at(spec: &JobSpec, stage: u8, swap: Option<&Path>) -> JobSpec {
    let mut s = spec.clone();
    s.zero.stage = ZeroStage::ALL[usize::from(stage)];
    if let Some(dir) = swap {
        s.zero.offload_optimizer = OffloadSpec {
            device: OffloadDevice::Nvme,
            nvme_path: Some(dir.display().to_string()),
            buffer_count: Some(3),
        };
        s.zero.sub_group_size = Size(3000);
    }
    s
}

/// Every step after `from` of `resumed` equals the uninterrupted `whole`.
fn assert_continues(whole: &[Run], resumed: &[Run], from: usize, what: &str) {
    assert_eq!(whole.len(), resumed.len());
    for (r, (w, got)) in whole.iter().zip(resumed).enumerate() {
        assert_eq!(got.losses, w.losses[from..], "{what} rank {r}: losses");
        // An overflowed step's norm is NaN, so compare bits.
        let bits = |n: &[f64]| n.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&got.norms) == bits(&w.norms[from..]),
            "{what} rank {r}: gradient norms {:?} vs {:?}",
            got.norms,
            &w.norms[from..]
        );
        assert_eq!(got.lrs, w.lrs[from..], "{what} rank {r}: learning rates");
        assert_eq!(got.scales, w.scales[from..], "{what} rank {r}: loss scales");
        assert!(
            got.params == w.params,
            "{what} rank {r}: final parameters differ"
        );
    }
}

/// Checkpoints `spec` (`world` ranks at stage `first`) after `cut` steps,
/// loads that at `via_world` ranks and stage `via` with the optimizer in swap
/// and saves it again at once, then resumes from there at `world` ranks and
/// stage `last` to the end. Returns the resumed steps.
fn detour(
    spec: &JobSpec,
    world: usize,
    [first, via, last]: [u8; 3],
    via_world: usize,
    cut: u64,
) -> Vec<Run> {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let swap = dir.path().join("swap");
    for d in [&a, &b, &swap] {
        std::fs::create_dir_all(d).unwrap();
    }
    let leg = Leg {
        until: Some(cut),
        save: Some(&a),
        ..Leg::default()
    };
    train_leg(at(spec, first, None), world, &leg);
    let leg = Leg {
        resume: Some(&a),
        until: Some(cut),
        save: Some(&b),
        ..Leg::default()
    };
    let moved = train_leg(at(spec, via, Some(&swap)), via_world, &leg);
    assert!(moved[0].losses.is_empty(), "the detour trains no step");
    let leg = Leg {
        resume: Some(&b),
        ..Leg::default()
    };
    train_leg(at(spec, last, None), world, &leg)
}

/// f16 at first overflows (scale 2^20, halved on each), then grows after 2
/// clean steps and overflows again: the cut lands after the first clean step,
/// so a resumed scaler that forgot when it last overflowed grows one step
/// early, and one that lost the scale or the count of skipped steps (which
/// Adam's step count and the schedule follow) starts wrong.
#[test]
fn f16_resumes_bit_identically_after_a_detour_through_another_world_size() {
    let mut spec = typed_spec("f16", 1, 1, 2000, true, false, 10);
    spec.train.loss_scale.initial_scale_power = 20;
    spec.train.loss_scale.hysteresis = 1;
    spec.train.loss_scale.loss_scale_window = 2;
    let whole = train(spec.clone(), 2);
    let scales = &whole[0].scales;
    let cut = 1 + scales.iter().position(|s| !s.1).unwrap();
    assert!(cut > 1, "no overflow before the cut: {scales:?}");
    assert!(
        scales[cut..].iter().any(|s| s.0 > scales[cut - 1].0) && scales[cut..].iter().any(|s| !s.1),
        "the scale should grow and steps should count after the cut: {scales:?}"
    );
    let resumed = detour(&spec, 2, [1, 2, 3], 3, cut as u64);
    assert_continues(&whole, &resumed, cut, "f16 world 2 -> 3 -> 2");
}

/// With `grad_accum: 2`, stages 2 and 3 (which reduce every micro-batch) are
/// bit-identical to each other, not to stages 0 and 1 (which reduce the sum):
/// the cut leaves Adam's moments far from zero and mid-way through the
/// learning-rate decay.
#[test]
fn f32_resumes_bit_identically_after_a_detour_through_another_world_size() {
    let spec = typed_spec("f32", 2, 2, 2000, true, false, 7);
    let whole = train(spec.clone(), 3);
    assert!(whole[0].losses[6] < whole[0].losses[3], "training moved");
    assert!(
        whole[0].lrs[4] < whole[0].lrs[3],
        "the schedule decays after the cut"
    );
    let resumed = detour(&spec, 3, [2, 1, 3], 2, 4);
    assert_continues(&whole, &resumed, 4, "f32 world 3 -> 2 -> 3");
}

/// LAMB's moments go through a checkpoint as AdamW's do, and its
/// trust ratios need nothing more: a run cut after 3 steps at stage 1,
/// loaded at 3 ranks and saved again, and resumed at stage 3, continues bit
/// for bit (the stages are identical under LAMB too).
#[test]
fn lamb_resumes_bit_identically_after_a_detour_through_another_world_size() {
    let mut spec = typed_spec("bf16", 1, 1, 2000, true, false, 6);
    spec.train.optimizer.kind = zconfig::spec::OptimizerKind::Lamb;
    spec.train.lr = 1e-2;
    let whole = train(spec.clone(), 2);
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let leg = Leg {
        until: Some(3),
        save: Some(&a),
        ..Leg::default()
    };
    train_leg(at(&spec, 1, None), 2, &leg);
    let leg = Leg {
        resume: Some(&a),
        until: Some(3),
        save: Some(&b),
        ..Leg::default()
    };
    train_leg(at(&spec, 2, None), 3, &leg);
    let leg = Leg {
        resume: Some(&b),
        ..Leg::default()
    };
    let resumed = train_leg(at(&spec, 3, None), 2, &leg);
    assert_continues(&whole, &resumed, 3, "LAMB world 2 -> 3 -> 2");
}

/// Frozen layers (`train.freeze`: the embedding and the first block, which
/// then hold no moments and no gradient buffer) go through a checkpoint as
/// zeros: a frozen run cut after 3 steps, moved through 3 ranks at stage 3
/// with its optimizer in swap and resumed at stage 1, continues bit for
/// bit. A run trained unfrozen and resumed frozen keeps the moments the
/// frozen layers had, and saves them again unchanged.
#[test]
fn frozen_layers_resume_bit_identically_and_keep_earlier_moments() {
    let mut spec = typed_spec("f32", 2, 1, 2000, true, false, 6);
    spec.train.freeze = vec!["w*.weight".into(), "h.0.*".into()];
    let whole = train(spec.clone(), 2);
    let resumed = detour(&spec, 2, [2, 3, 1], 3, 3);
    assert_continues(&whole, &resumed, 3, "frozen world 2 -> 3 -> 2");

    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let mut unfrozen = spec.clone();
    unfrozen.train.freeze.clear();
    let first = Leg {
        until: Some(2),
        save: Some(&a),
        ..Leg::default()
    };
    train_leg(unfrozen, 2, &first);
    let then = Leg {
        resume: Some(&a),
        until: Some(4),
        save: Some(&b),
        ..Leg::default()
    };
    train_leg(spec, 2, &then);
    let (before, after) = (
        zckpt::Checkpoint::open(&a).unwrap(),
        zckpt::Checkpoint::open(&b).unwrap(),
    );
    for kind in ["exp_avg", "exp_avg_sq"] {
        // Groups 0 and 1 (embedding, first block) frozen; 2 trains on.
        for g in 0..3 {
            let (m0, m1) = (
                before.full_group(g, kind).unwrap(),
                after.full_group(g, kind).unwrap(),
            );
            assert!(
                m0.iter().any(|&x| x != 0.0),
                "{kind} of group {g} never moved"
            );
            assert_eq!(m0 == m1, g < 2, "{kind} of group {g}");
        }
    }
}

/// `spec` trained on 2 ranks and checkpointed into `dir`.
fn checkpointed(spec: &JobSpec, dir: &Path) -> zckpt::Checkpoint {
    let save = Leg {
        save: Some(dir),
        ..Leg::default()
    };
    train_leg(spec.clone(), 2, &save);
    zckpt::Checkpoint::open(dir).unwrap()
}

/// A checkpoint of another model is refused by the engine itself (zworker
/// also compares the model spec first), whichever part of the layout differs:
/// the embedding's shape at the same size (vocab and context swapped), every
/// size (d_model), or the number of blocks.
#[test]
fn a_checkpoint_of_another_layout_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let spec = typed_spec("f32", 1, 1, 2000, true, false, 1);
    let ckpt = checkpointed(&spec, dir.path());
    let (v, t, d) = (
        spec.model.vocab_size,
        spec.model.seq_len,
        spec.model.d_model,
    );
    let mut swapped = spec.clone();
    (swapped.model.vocab_size, swapped.model.seq_len) = (t, v);
    let mut wider = spec.clone();
    wider.model.d_model = d + 16;
    let mut deeper = spec.clone();
    deeper.model.n_layers += 1;
    for (what, other) in [
        ("vocab/context swapped", swapped),
        ("d_model", wider),
        ("n_layers", deeper),
    ] {
        let comm = common::comms(1).pop().unwrap();
        let mut engine = zengine::Engine::new(&other, comm).unwrap();
        match engine.load(&ckpt) {
            Err(zengine::EngineError::LayoutMismatch { .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
}

/// `model.init_from`: weights exported from a checkpoint become a fresh
/// engine's parameters by name, at another world size and stage; a missing,
/// misshapen or unknown tensor is refused.
#[test]
fn exported_weights_are_installed_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let spec = typed_spec("f32", 1, 1, 2000, true, false, 2);
    let ckpt = checkpointed(&spec, dir.path());
    let file = dir.path().join("model.safetensors");
    ckpt.export(&file).unwrap();
    let weights = zckpt::read_weights(&file).unwrap();
    fn installed(
        spec: &JobSpec,
        weights: &impl zckpt::WeightSource,
    ) -> Result<Vec<Vec<f32>>, zengine::EngineError> {
        let comm = common::comms(1).pop().unwrap();
        let mut engine = zengine::Engine::new(&at(spec, 3, None), comm).unwrap();
        engine
            .load_weights(weights)
            .map(|()| engine.full_params().unwrap())
    }
    assert!(installed(&spec, &weights).unwrap() == ckpt.all_params().unwrap());
    // Read from the file a parameter at a time, as a worker does.
    let params = spec.model.param_shapes();
    let streamed = zckpt::InitWeights::open(&file, &spec.model, &params).unwrap();
    assert!(installed(&spec, &streamed).unwrap() == ckpt.all_params().unwrap());

    let name = "h.0.mlp.c_fc.weight";
    let mut missing = weights.clone();
    missing.remove(name);
    let mut misshapen = weights.clone();
    misshapen.get_mut(name).unwrap().0.reverse();
    let mut extra = weights.clone();
    extra.insert("h.9.mlp.c_fc.weight".into(), weights[name].clone());
    for (what, w) in [
        ("missing", missing),
        ("misshapen", misshapen),
        ("extra", extra),
    ] {
        match installed(&spec, &w) {
            Err(zengine::EngineError::InitWeights { .. }) => {}
            other => panic!("{what}: {:?}", other.map(|_| ())),
        }
    }
}

/// hpZ's secondary shards live only inside a micro-batch, so a checkpoint
/// needs nothing of them: an hpZ run at 2 nodes x 2 saved midway and resumed
/// with hpZ and its parameters and optimizer in swap files continues exactly
/// like plain stage 3 never interrupted.
#[test]
fn hpz_resumes_bit_identically_with_nvme_offload() {
    let spec = typed_spec("bf16", 3, 1, 2000, true, false, 6);
    let nodes = vec![0, 0, 1, 1];
    let on_nodes = |resume, until, save| Leg {
        resume,
        until,
        save,
        nodes: Some(nodes.clone()),
        ..Leg::default()
    };
    let whole = train_leg(spec.clone(), 4, &on_nodes(None, None, None));
    let dir = tempfile::tempdir().unwrap();
    let (saved, swap) = (dir.path().join("ckpt"), dir.path().join("swap"));
    std::fs::create_dir_all(&saved).unwrap();
    std::fs::create_dir_all(&swap).unwrap();
    let mut hpz = spec.clone();
    hpz.zero.hpz_partition_size = 2;
    train_leg(hpz.clone(), 4, &on_nodes(None, Some(3), Some(&saved)));
    let mut offloaded = at(&hpz, 3, Some(&swap));
    offloaded.zero.offload_param = offloaded.zero.offload_optimizer.clone();
    let resumed = train_leg(offloaded, 4, &on_nodes(Some(&saved), None, None));
    assert_continues(&whole, &resumed, 3, "hpZ bf16 2 x 2 through NVMe offload");
}

/// Progressive layer dropping's draws are a function of the step, not of
/// the run: a run cut after 4 steps (its blocks already being skipped),
/// moved through 3 ranks and stage 1, and resumed at stage 3 skips the
/// blocks the uninterrupted run skips and continues bit for bit.
#[test]
fn progressive_layer_drop_resumes_bit_identically() {
    let mut spec = typed_spec("f32", 3, 1, 2000, true, false, 8);
    spec.model.n_layers = 4;
    spec.train.progressive_layer_drop = Some(zconfig::layer_drop::LayerDropSpec {
        theta: 0.2,
        gamma: 0.5,
    });
    let whole = train(spec.clone(), 2);
    let run: Vec<f64> = whole[0].blocks_run.iter().map(|b| b.unwrap()).collect();
    assert!(
        run[2..4].iter().any(|&b| b < 4.0),
        "nothing skipped before the cut: {run:?}"
    );
    assert!(
        run[4..].iter().any(|&b| b < 4.0),
        "nothing skipped after the cut: {run:?}"
    );
    let resumed = detour(&spec, 2, [3, 1, 3], 3, 4);
    assert_continues(&whole, &resumed, 4, "PLD world 2 -> 3 -> 2");
}
