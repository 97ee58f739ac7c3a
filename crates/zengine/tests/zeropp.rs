//! ZeRO++ qwZ against plain stage 3: the same job with its forward gathers
//! quantized trains along the same curve, and its all-gathers send exactly the
//! bytes the quantized format takes (checked exactly, per rank).

mod common;

use common::{train, typed_spec, Run};
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
