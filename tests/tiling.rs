//! Memory-centric tiling (`model.tile_size`) through `zrun`: a tiled run of
//! configs/tiny.yaml's model trains to the untiled run's losses at stage 3
//! with its parameters in NVMe swap, its checkpoints resume untiled, its
//! export holds the same tensors, and a tile size below one tile is exit 2.

use std::collections::HashMap;
use std::path::Path;

use e2e::{losses_by_step, zrun, TrainArgs};

/// configs/tiny.yaml's model (d 128: c_attn 128x384 and c_fc 128x512 split
/// into 2 tiles each at tile_size 32768) on synthetic data, stage 3,
/// checkpoints at steps 4 and 8.
fn job(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("tiles.yaml");
    std::fs::write(
        &p,
        format!(
            "name: tiles\n\
             model: {{vocab_size: 256, d_model: 128, n_layers: 2, n_heads: 4, seq_len: 32}}\n\
             data: {{format: synthetic}}\n\
             train: {{steps: 8, micro_batch_size: 4, lr: 3.0e-3, warmup_steps: 2, dtype: bf16}}\n\
             zero: {{stage: 3, param_persistence_threshold: 0}}\n\
             checkpoint: {{every: 4, keep: 2}}\n\
             run_dir: {}/runs\n",
            dir.display()
        ),
    )
    .unwrap();
    p
}

/// An export's tensors by name.
fn tensors(path: &Path) -> HashMap<String, (Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, t)| (name, (t.shape().to_vec(), t.data().to_vec())))
        .collect()
}

#[test]
fn tiled_training_matches_untiled_and_checkpoints_move_between_them() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let swap = dir.join("swap");
    std::fs::create_dir(&swap).unwrap();
    let job = job(dir);
    let run = |name: &str, tiled: bool, resume: Option<&Path>| {
        let metrics = dir.join(format!("{name}.jsonl"));
        let mut a = TrainArgs::new(&job, &metrics)
            .set(format!("checkpoint.dir={}/{name}", dir.display()))
            .set("zero.offload_param.device=nvme")
            .set(format!("zero.offload_param.nvme_path={}", swap.display()));
        if tiled {
            a = a.set("model.tile_size=32768");
        }
        if let Some(r) = resume {
            a = a.args(&["--resume", r.to_str().unwrap()]);
        }
        let f = a.run(dir);
        assert_eq!(f.code(), 0, "{name}: {f:?}");
        (losses_by_step(&metrics), f)
    };
    let (whole, _) = run("whole", false, None);
    let (tiled, f) = run("tiled", true, None);
    assert_eq!(whole.len(), 8);
    assert_eq!(tiled, whole, "tiled vs untiled losses");
    assert!(
        f.stdout.contains(
            "model.tile_size 32768: every block's attn.c_attn in 2 tiles, mlp.c_fc in 2 tiles"
        ),
        "{}",
        f.stdout
    );
    // The tiled run's step-4 checkpoint resumed untiled, and the other way.
    let (after, _) = run(
        "tiled-then-whole",
        false,
        Some(&dir.join("tiled/step-00000004")),
    );
    assert_eq!(after, whole[4..], "tiled checkpoint resumed untiled");
    let (after, _) = run(
        "whole-then-tiled",
        true,
        Some(&dir.join("whole/step-00000004")),
    );
    assert_eq!(after, whole[4..], "untiled checkpoint resumed tiled");
    // Exports: the same tensors under GPT-2's names.
    let export = |name: &str| {
        let out = dir.join(format!("{name}.safetensors"));
        let ckpt = dir.join(format!("{name}/step-00000008"));
        let f = zrun(
            dir,
            &[
                "export",
                ckpt.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ],
        );
        assert_eq!(f.code(), 0, "{f:?}");
        tensors(&out)
    };
    let (a, b) = (export("whole"), export("tiled"));
    assert_eq!(a["h.1.mlp.c_fc.weight"].0, vec![128, 512]);
    assert!(a == b, "the tiled run's export differs");
    assert_eq!(
        std::fs::read_dir(&swap).unwrap().count(),
        0,
        "swap files left"
    );
}

#[test]
fn a_tile_size_below_one_tile_is_refused_naming_the_key() {
    let d = tempfile::tempdir().unwrap();
    let job = job(d.path());
    let f = TrainArgs::new(&job, d.path().join("m.jsonl"))
        .set("model.tile_size=1000")
        .run(d.path());
    assert_eq!(f.code(), 2, "{f:?}");
    assert!(
        f.stderr.contains("model.tile_size") && f.stderr.contains("at least 256 output columns"),
        "{}",
        f.stderr
    );
}
