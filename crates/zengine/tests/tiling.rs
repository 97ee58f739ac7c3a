//! Memory-centric tiling (`model.tile_size`) changes which parameters are in
//! memory at once, not one bit of the arithmetic: tiled runs end with the
//! untiled runs' losses and parameters at every stage, and checkpoints move
//! between tiled and untiled runs.

mod common;

use common::{train, train_leg, worst_move_apart, Leg, Run};
use zconfig::spec::Size;
use zconfig::JobSpec;

/// A model whose c_attn (128x384) and c_fc (128x512) split into two tiles of
/// at most 256 columns under `tile_size: 32768`; attn.c_proj fits whole and
/// mlp.c_proj (512x128, one chunk of outputs) cannot be split.
fn spec(dtype: &str, stage: u8, accum: usize, ckpt: bool, steps: u64) -> JobSpec {
    let yaml = format!(
        "model: {{vocab_size: 64, d_model: 128, n_layers: 2, n_heads: 4, seq_len: 16}}\n\
         data: {{format: synthetic}}\n\
         train: {{steps: {steps}, micro_batch_size: 4, grad_accum: {accum}, lr: 3.0e-3, warmup_steps: 2, activation_checkpointing: {ckpt}, dtype: {dtype}, grad_clip: 0.5}}\n\
         zero: {{stage: {stage}, reduce_bucket_size: 60000, overlap_comm: true, prefetch_bucket_size: 100000, param_persistence_threshold: 100}}\n"
    );
    yaml.parse().unwrap()
}

fn tiled(mut spec: JobSpec) -> JobSpec {
    spec.model.tile_size = Some(Size(32768));
    spec
}

/// Same losses every step, same final parameters bit for bit under their
/// names; the norm may differ in its last f64 bits (it adds the groups'
/// squares in another grouping), far below what could change its f32 use.
fn assert_same(got: &[Run], base: &[Run], what: &str) {
    for (r, (g, b)) in got.iter().zip(base).enumerate() {
        assert_eq!(g.losses, b.losses, "{what} rank {r}");
        for (x, y) in g.norms.iter().zip(&b.norms) {
            assert!(
                (x - y).abs() <= 1e-12 * y,
                "{what} rank {r}: norm {x} vs {y}"
            );
        }
        assert_eq!(g.named.len(), b.named.len(), "{what}");
        for (name, value) in &b.named {
            assert!(
                g.named.get(name) == Some(value),
                "{what} rank {r}: {name} differs"
            );
        }
    }
}

/// Trains on `world` ranks of one node talking through shared memory (the
/// direct path: every element's sum over ranks adds in rank order).
fn train_shm(spec: JobSpec, world: usize) -> Vec<Run> {
    train_leg(
        spec,
        world,
        &Leg {
            shared_memory: true,
            ..Leg::default()
        },
    )
}

/// Bit for bit at every stage and dtype. Two ranks over TCP (a sum of two is
/// the same in either order) and three through shared memory, whose sums add
/// in rank order. A ring over TCP adds an element's contributions starting
/// from the rank after its owner, and tiling changes owners, so there three
/// or more ranks agree to rounding only.
#[test]
fn tiled_runs_are_bit_identical_to_untiled_runs() {
    for dtype in ["f32", "bf16"] {
        for world in [2, 3] {
            for stage in [0u8, 1, 2, 3] {
                let run = |spec| match world {
                    2 => train(spec, 2),
                    _ => train_shm(spec, world),
                };
                let base = run(spec(dtype, stage, 1, false, 4));
                let got = run(tiled(spec(dtype, stage, 1, false, 4)));
                let what = format!("{dtype} world {world} stage {stage}");
                assert!(
                    base[0].norms.iter().all(|&n| n > 0.5),
                    "{what}: clipping never bit"
                );
                assert!(
                    base[0].losses[3] < base[0].losses[0],
                    "{what}: training moved"
                );
                assert_same(&got, &base, &what);
                // The tiled model has more, smaller groups.
                assert_eq!(got[0].padded.len(), base[0].padded.len() + 2 * 4, "{what}");
            }
        }
    }
}
/// LAMB scales a tiled linear by one trust ratio, its tiles' squares added
/// together: tiled runs move every parameter as untiled runs do (here to
/// the bit; the tiles' f64 sums add in another grouping, which could move
/// a ratio's last bit), where a ratio per tile moves the tiled linears
/// 1e-3 to 2e-2 apart.
#[test]
fn lamb_gives_a_tiled_linear_one_trust_ratio() {
    let lamb = |mut spec: JobSpec| {
        spec.train.optimizer.kind = zconfig::spec::OptimizerKind::Lamb;
        spec.train.optimizer.min_coeff = Some(1e-9);
        spec.train.lr = 1e-2;
        spec
    };
    let start = train_leg(
        lamb(spec("f32", 3, 1, false, 3)),
        2,
        &Leg {
            until: Some(0),
            ..Leg::default()
        },
    );
    let base = train(lamb(spec("f32", 3, 1, false, 3)), 2);
    let got = train(lamb(tiled(spec("f32", 3, 1, false, 3))), 2);
    assert_eq!(got[0].padded.len(), base[0].padded.len() + 2 * 4, "tiled");
    let (rel, name) = worst_move_apart(&start[0], &base[0], &got[0]);
    assert!(
        rel <= 1e-6,
        "{name}: moved {rel:e} away from the untiled move"
    );
    // The reported ratios count a tiled linear once, as the untiled run's.
    for (t, b) in got[0].trust_ratios.iter().zip(&base[0].trust_ratios) {
        let (t, b) = (t.unwrap(), b.unwrap());
        for (g, w) in [(t.min, b.min), (t.mean, b.mean), (t.max, b.max)] {
            assert!((g - w).abs() <= 1e-6 * w, "tiled {t:?}, untiled {b:?}");
        }
    }
}

/// Dropout drops its elements from the tiles' outputs as from the whole
/// linears' (the branch is dropped after its last tile stores): the same
/// bits, f32 and bf16, at stages 0 and 3, attention's dropout on too.
#[test]
fn tiled_runs_drop_what_untiled_runs_drop() {
    for dtype in ["f32", "bf16"] {
        for stage in [0u8, 3] {
            let dropped = |mut spec: JobSpec| {
                spec.model.hidden_dropout = Some(0.2);
                spec.model.attention_dropout = Some(0.1);
                spec
            };
            let base = train(dropped(spec(dtype, stage, 1, false, 4)), 2);
            let got = train(dropped(tiled(spec(dtype, stage, 1, false, 4))), 2);
            let what = format!("dropout {dtype} stage {stage}");
            let plain = train(spec(dtype, stage, 1, false, 4), 2);
            assert_ne!(base[0].losses, plain[0].losses, "{what}: nothing dropped");
            assert_same(&got, &base, &what);
        }
    }
}

/// Progressive layer dropping skips a tiled block's tiles with it (their
/// stage-3 gathers left out, their groups completing their buckets in
/// backward's order) and scales its branches as an untiled block's: the
/// same bits at stages 0 and 3 with 2 micro-batches a step, stage 3 with
/// NVMe offload of the tiles' parameters too.
#[test]
fn tiled_runs_skip_the_blocks_untiled_runs_skip() {
    use zconfig::layer_drop::LayerDropSpec;
    let dropped = |mut spec: JobSpec| {
        spec.model.n_layers = 4;
        spec.train.progressive_layer_drop = Some(LayerDropSpec {
            theta: 0.2,
            gamma: 0.5,
        });
        spec
    };
    for stage in [0u8, 3] {
        let base = train(dropped(spec("f32", stage, 2, false, 6)), 2);
        let skipped = base[0].blocks_run.iter().flatten().any(|&b| b < 4.0);
        assert!(skipped, "no block skipped: {:?}", base[0].blocks_run);
        let got = train(dropped(tiled(spec("f32", stage, 2, false, 6))), 2);
        assert_same(&got, &base, &format!("PLD stage {stage}"));
    }
    let dir = tempfile::tempdir().unwrap();
    let mut offloaded = dropped(tiled(spec("f32", 3, 2, false, 6)));
    offloaded.zero.offload_param = zconfig::spec::OffloadSpec {
        device: zconfig::spec::OffloadDevice::Nvme,
        nvme_path: Some(dir.path().display().to_string()),
        buffer_count: Some(3),
    };
    let base = train(dropped(spec("f32", 3, 2, false, 6)), 2);
    assert_same(
        &train(offloaded, 2),
        &base,
        "PLD stage 3, tiles' parameters on NVMe",
    );
}

/// Activation checkpointing (backward gathers every tile twice), gradient
/// accumulation, f16 with its loss scale, and NVMe offload of the tiles'
/// parameters and optimizer state.
#[test]
fn tiling_with_checkpointing_accumulation_f16_and_offload() {
    let swap = tempfile::tempdir().unwrap();
    for (dtype, stage, accum, ckpt) in [
        ("f32", 3u8, 2, true),
        ("f16", 3, 1, true),
        ("bf16", 2, 2, false),
    ] {
        let base = train(spec(dtype, stage, accum, ckpt, 3), 2);
        let got = train(tiled(spec(dtype, stage, accum, ckpt, 3)), 2);
        assert_same(&got, &base, &format!("{dtype} stage {stage} accum {accum}"));
    }
    let nvme = zconfig::spec::OffloadSpec {
        device: zconfig::spec::OffloadDevice::Nvme,
        nvme_path: Some(swap.path().display().to_string()),
        buffer_count: None,
    };
    let mut offloaded = tiled(spec("f32", 3, 1, false, 3));
    offloaded.zero.offload_param = nvme.clone();
    offloaded.zero.offload_optimizer = nvme;
    let base = train(spec("f32", 3, 1, false, 3), 2);
    assert_same(&train(offloaded, 2), &base, "stage 3, both offloads");
}

/// At stage 3 a tiled block is never whole in memory: the peak of gathered
/// parameters and gradients in flight falls with the tile size.
#[test]
fn tiles_lower_the_peak_of_gathered_parameters() {
    let mut one_bucket_a_group = spec("f32", 3, 1, false, 2);
    one_bucket_a_group.zero.reduce_bucket_size = Size(1);
    one_bucket_a_group.zero.prefetch_bucket_size = Size(1);
    let base = train(one_bucket_a_group.clone(), 2);
    let got = train(tiled(one_bucket_a_group), 2);
    assert_same(&got, &base, "one bucket a group");
    // Untiled, a block group is 198,272 elements (793 KB in f32); tiled, the
    // block keeps 82,688 and each tile at most 32,768 + 256.
    assert!(
        (got[0].comm_peak as f64) < 0.7 * base[0].comm_peak as f64,
        "tiled peak {} vs untiled {}",
        got[0].comm_peak,
        base[0].comm_peak
    );
}

/// A checkpoint saved by a tiled run resumes untiled, and the other way round,
/// resharded from 2 ranks to 3 on the way (same global batch), with the
/// losses and parameters of the same two legs untiled; the export of a tiled
/// checkpoint holds the untiled one's tensors under the same names.
#[test]
fn checkpoints_move_between_tiled_and_untiled_runs() {
    let leg1 = |tile: bool| {
        let mut s = spec("bf16", 3, 1, false, 5);
        s.train.micro_batch_size = 6;
        if tile {
            s = tiled(s);
        }
        s
    };
    let leg2 = |tile: bool| {
        let s = spec("bf16", 3, 1, false, 5);
        if tile {
            tiled(s)
        } else {
            s
        }
    };
    let two_legs = |first: bool, second: bool| {
        let dir = tempfile::tempdir().unwrap();
        let saved = Leg {
            until: Some(2),
            save: Some(dir.path()),
            shared_memory: true,
            ..Leg::default()
        };
        train_leg(leg1(first), 2, &saved);
        let resumed = Leg {
            resume: Some(dir.path()),
            shared_memory: true,
            ..Leg::default()
        };
        let runs = train_leg(leg2(second), 3, &resumed);
        let out = dir.path().join("export.safetensors");
        zckpt::Checkpoint::open(dir.path())
            .unwrap()
            .export(&out)
            .unwrap();
        (runs, zckpt::read_weights(&out).unwrap())
    };
    let (base, base_export) = two_legs(false, false);
    assert_eq!(base[0].losses.len(), 3);
    for (first, second) in [(true, false), (false, true), (true, true)] {
        let what = format!("tiled {first} then {second}");
        let (got, export) = two_legs(first, second);
        for (r, (g, b)) in got.iter().zip(&base).enumerate() {
            assert_eq!(g.losses, b.losses, "{what} rank {r}");
            assert!(g.named == b.named, "{what} rank {r}: parameters differ");
        }
        assert!(export == base_export, "{what}: the exports differ");
    }
    // `model.init_from` the export (a tiled parameter's tiles are groups in
    // turn, each cut from the parameter read once): the same parameters
    // under their names, tiled or not.
    for tile in [false, true] {
        let mut engine = zengine::Engine::new(&leg2(tile), common::comms(1).remove(0)).unwrap();
        engine.load_weights(&base_export).unwrap();
        let slots: usize = engine
            .manifest_groups()
            .iter()
            .map(|g| g.params.len())
            .sum();
        assert_eq!(slots > base_export.len(), tile, "tiled: {tile}");
        assert!(
            engine.named_params().unwrap() == base_export,
            "tiled: {tile}"
        );
    }
}
