//! NVMe offload changes where state lives, not one bit of the arithmetic: runs
//! with the optimizer state (stages 1-3) and the parameters (stage 3) in swap
//! files end with the same losses and parameters as the same runs in memory.

mod common;

use common::{train, typed_spec};
use zconfig::spec::{OffloadDevice, OffloadSpec, Size};
use zconfig::JobSpec;

fn nvme(dir: &std::path::Path) -> OffloadSpec {
    OffloadSpec {
        device: OffloadDevice::Nvme,
        nvme_path: Some(dir.display().to_string()),
        buffer_count: None,
    }
}

/// `spec` with its optimizer (and, if `params`, its parameters) in `dir`,
/// updated in sub-groups small enough that every block takes several.
fn offloaded(mut spec: JobSpec, dir: &std::path::Path, params: bool) -> JobSpec {
    spec.zero.offload_optimizer = nvme(dir);
    if params {
        spec.zero.offload_param = nvme(dir);
    }
    spec.zero.sub_group_size = Size(3000);
    spec.zero.offload_optimizer.buffer_count = Some(3);
    spec
}

#[test]
fn offloaded_runs_are_bit_identical_to_runs_in_memory() {
    let swap = tempfile::tempdir().unwrap();
    for dtype in ["f32", "bf16"] {
        for world in [2, 3] {
            for (stage, params) in [(1u8, false), (2, false), (3, false), (3, true)] {
                let spec = typed_spec(dtype, stage, 1, 2000, true, false, 4);
                let base = train(spec.clone(), world);
                let got = train(offloaded(spec, swap.path(), params), world);
                let what = format!("{dtype} world {world} stage {stage} params offloaded {params}");
                for r in 0..world {
                    assert_eq!(got[r].losses, base[r].losses, "{what} rank {r}");
                    assert!(
                        got[r].params == base[r].params,
                        "{what} rank {r}: parameters differ"
                    );
                }
                assert!(
                    base[0].losses[3] < base[0].losses[0],
                    "{what}: training moved"
                );
                assert_eq!(
                    std::fs::read_dir(swap.path()).unwrap().count(),
                    0,
                    "{what}: swap files left behind"
                );
            }
        }
    }
}

/// Lion, Adagrad and PyTorch's Adam offloaded keep their in-memory bits;
/// Lion and Adagrad swap their one state only: at stage 1 (optimizer files
/// alone) their files hold half AdamW's bytes in f32 (one state against
/// exp_avg and exp_avg_sq) and two thirds in bf16 (with the master copy),
/// Adam as many as AdamW; with the parameters offloaded too at stage 3,
/// the bits still hold.
#[test]
fn lion_adagrad_and_adam_offloaded_keep_their_bits() {
    use zconfig::spec::OptimizerKind;
    let swap = tempfile::tempdir().unwrap();
    for kind in [
        OptimizerKind::Lion,
        OptimizerKind::Adagrad,
        OptimizerKind::Adam,
    ] {
        let rule = |spec: JobSpec| {
            let mut spec = spec;
            spec.train.optimizer.kind = kind;
            spec
        };
        for dtype in ["f32", "bf16"] {
            for (stage, params) in [(1u8, false), (3, true)] {
                let spec = typed_spec(dtype, stage, 1, 2000, true, false, 4);
                let base = train(rule(spec.clone()), 2);
                let got = train(offloaded(rule(spec.clone()), swap.path(), params), 2);
                let what = format!("{kind:?} {dtype} stage {stage} params offloaded {params}");
                for r in 0..2 {
                    assert_eq!(got[r].losses, base[r].losses, "{what} rank {r}");
                    assert!(got[r].params == base[r].params, "{what} rank {r}");
                    assert_eq!(got[r].optimizer_held, 0, "{what}: state left in memory");
                }
                if stage == 1 {
                    let adamw = train(offloaded(spec, swap.path(), params), 2);
                    let (files, one_state_files) = match (dtype, kind.second_moment()) {
                        (_, true) => (1, 1),
                        ("f32", false) => (2, 1),
                        _ => (3, 2),
                    };
                    assert_eq!(
                        adamw[0].nvme * one_state_files,
                        got[0].nvme * files,
                        "{what}: swap bytes, AdamW's against {kind:?}'s"
                    );
                }
            }
        }
    }
}

/// LAMB offloaded keeps in-memory LAMB's bits: each of its two passes runs
/// over the sub-groups through the swap pipeline (the first with swapped
/// gradients clipped as it reads them, stage 2, a clip that bites), its
/// cells' sums carried across sub-groups of 3000 elements that cut them;
/// with the parameters offloaded too at stage 3, in f32 and bf16.
#[test]
fn lamb_offloaded_keeps_its_bits_over_two_passes() {
    let swap = tempfile::tempdir().unwrap();
    let lamb = |mut spec: JobSpec| {
        spec.train.optimizer.kind = zconfig::spec::OptimizerKind::Lamb;
        spec.train.lr = 1e-2;
        spec.train.grad_clip = 0.05;
        spec
    };
    for dtype in ["f32", "bf16"] {
        for (stage, params) in [(1u8, false), (2, false), (3, true)] {
            let spec = lamb(typed_spec(dtype, stage, 2, 2000, true, false, 4));
            let base = train(spec.clone(), 2);
            assert!(base[0].norms.iter().all(|&n| n > 0.05), "the clip bites");
            let got = train(offloaded(spec, swap.path(), params), 2);
            let what = format!("{dtype} stage {stage} params offloaded {params}");
            assert!(got[0].nvme > 0, "{what}: nothing swapped");
            for r in 0..2 {
                assert_eq!(got[r].losses, base[r].losses, "{what} rank {r}");
                assert!(got[r].params == base[r].params, "{what} rank {r}");
                assert_eq!(got[r].optimizer_held, 0, "{what}: moments left in memory");
            }
        }
    }
}

/// Parameter offload alone (optimizer state in memory) and gradient
/// accumulation with activation checkpointing, f16 with its loss scale.
#[test]
fn parameter_offload_alone_and_f16_with_accumulation() {
    let swap = tempfile::tempdir().unwrap();
    let spec = typed_spec("f16", 3, 2, 2000, true, true, 4);
    let base = train(spec.clone(), 2);
    let mut only_params = spec.clone();
    only_params.zero.offload_param = nvme(swap.path());
    let got = train(only_params, 2);
    assert!(got == base, "parameter offload alone");
    let got = train(offloaded(spec, swap.path(), true), 2);
    assert!(
        got == base,
        "both offloads, f16, accumulation, checkpointing"
    );
}

/// Stages 2-3 keep the reduced gradient slices in swap too: accumulated over
/// micro-batches (read back, added, written), averaged and normed as the last
/// one lands, clipped as the step reads them. Clipping is forced (a tiny
/// `grad_clip`) and checked to have bitten, so that the swapped path of every
/// factor is exercised; one worker takes the unreduced path. bf16 with
/// `grad_accum_dtype: f32` swaps f32 slices under 16-bit weights.
#[test]
fn swapped_gradients_accumulate_and_clip_bit_identically() {
    use zconfig::spec::Dtype;
    let swap = tempfile::tempdir().unwrap();
    for (dtype, grads) in [("f32", None), ("bf16", None), ("bf16", Some(Dtype::F32))] {
        for (world, stage, overlap) in [(1, 2u8, true), (2, 2, false), (2, 3, true), (3, 3, false)]
        {
            let mut spec = typed_spec(dtype, stage, 3, 2000, overlap, false, 3);
            spec.train.grad_clip = 0.05;
            spec.train.grad_accum_dtype = grads;
            let base = train(spec.clone(), world);
            let got = train(offloaded(spec.clone(), swap.path(), stage == 3), world);
            if grads.is_some() {
                spec.train.grad_accum_dtype = None;
                let halves = train(offloaded(spec, swap.path(), stage == 3), world);
                let slice = halves[0].padded.iter().sum::<usize>() / world;
                // (Each group's region starts on a whole disk block.)
                assert!(
                    got[0].nvme >= halves[0].nvme + 2 * slice as u64,
                    "f32 gradient slices swap 4 bytes an element: {} against {}",
                    got[0].nvme,
                    halves[0].nvme
                );
            }
            let what = format!(
                "{dtype} gradients {grads:?} world {world} stage {stage} overlap {overlap}"
            );
            assert!(
                base[0].norms.iter().all(|&n| n > 0.05),
                "{what}: clipping never bit"
            );
            assert!(
                base[0].grads_held > 0,
                "{what}: the in-memory run holds gradients"
            );
            for r in 0..world {
                assert!(
                    got[r] == base[r],
                    "{what} rank {r}: {:?} vs {:?}",
                    got[r].norms,
                    base[r].norms
                );
                assert_eq!(
                    got[r].grads_held, 0,
                    "{what} rank {r}: gradients held in memory"
                );
            }
        }
    }
}

/// Dropout (hidden and attention) under NVMe offload of the optimizer
/// state and the parameters, with activation checkpointing (whose
/// recompute reads the parameters from swap again): the bits of the same
/// dropped run in memory.
#[test]
fn offloaded_runs_drop_what_runs_in_memory_drop() {
    let swap = tempfile::tempdir().unwrap();
    let mut spec = typed_spec("f32", 3, 1, 2000, true, true, 4);
    spec.model.hidden_dropout = Some(0.2);
    spec.model.attention_dropout = Some(0.1);
    let base = train(spec.clone(), 2);
    let got = train(offloaded(spec, swap.path(), true), 2);
    for r in 0..2 {
        assert_eq!(got[r].losses, base[r].losses, "rank {r}");
        assert!(
            got[r].params == base[r].params,
            "rank {r}: parameters differ"
        );
    }
}

/// Frozen parameters (`train.freeze`) under NVMe offload: swapped
/// gradients' norms leave them out and the swapped update skips them, to
/// the bits of the same run in memory (clipping forced, as above, so the
/// norm decides every step), for AdamW and LAMB, stages 2 and 3; with the
/// layers below frozen too (no gradient swapped for them at all).
#[test]
fn frozen_parameters_offloaded_keep_their_bits() {
    let swap = tempfile::tempdir().unwrap();
    let (some, below) = (["wte.weight", "h.1.mlp.*"], ["w*.weight", "h.0.*"]);
    for (dtype, stage, lamb, freeze) in [
        ("f32", 2u8, false, some),
        ("bf16", 3, false, some),
        ("f32", 3, true, some),
        ("bf16", 2, false, below),
        ("f32", 3, true, below),
    ] {
        let mut spec = typed_spec(dtype, stage, 2, 2000, true, false, 3);
        spec.train.grad_clip = 0.05;
        spec.train.freeze = freeze.map(String::from).to_vec();
        if lamb {
            spec.train.optimizer.kind = zconfig::spec::OptimizerKind::Lamb;
        }
        let base = train(spec.clone(), 2);
        let got = train(offloaded(spec, swap.path(), stage == 3), 2);
        let what = format!("{dtype} stage {stage} lamb {lamb} {freeze:?}");
        for r in 0..2 {
            assert!(
                got[r] == base[r],
                "{what} rank {r}: {:?} vs {:?}",
                got[r].norms,
                base[r].norms
            );
        }
    }
}
