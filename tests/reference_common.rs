//! What the independent readers of exports (`gpt2_reference`,
//! `llama_reference`) share, and nothing of zrun's: reading a safetensors
//! file that must hold exactly the expected f32 tensors, the mean
//! cross-entropy over windows, and a residual add, all in f64.

use std::collections::HashMap;
use std::path::Path;

/// The tensors of `path`, widened to f64; panics unless the file holds
/// exactly `want` (names and shapes), all f32.
pub fn load_exactly(path: &Path, want: Vec<(String, Vec<usize>)>) -> HashMap<String, Vec<f64>> {
    let bytes = std::fs::read(path).expect("read the export");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    let mut names = file.names();
    names.sort();
    let mut expected: Vec<&String> = want.iter().map(|(n, _)| n).collect();
    expected.sort();
    assert_eq!(names, expected, "the export's tensor names");
    want.into_iter()
        .map(|(name, dims)| {
            let view = file.tensor(&name).expect("listed above");
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}: dtype");
            assert_eq!(view.shape(), dims.as_slice(), "{name}: shape");
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect();
            (name, values)
        })
        .collect()
}

/// Mean next-token cross-entropy over `windows` (each `len + 1` tokens:
/// inputs are the first `len`, targets the last `len`), from a model's
/// `logits` of the inputs.
pub fn mean_loss(windows: &[Vec<u32>], logits: impl Fn(&[u32]) -> Vec<Vec<f64>>) -> f64 {
    let all: Vec<(Vec<u32>, usize)> = windows.iter().map(|w| (w.clone(), 0)).collect();
    mean_loss_skipping(&all, logits)
}

/// [`mean_loss`] over windows each of which leaves its first `skip`
/// targets out (an earlier window scored them).
pub fn mean_loss_skipping(
    windows: &[(Vec<u32>, usize)],
    logits: impl Fn(&[u32]) -> Vec<Vec<f64>>,
) -> f64 {
    let mut total = 0.0;
    let mut count = 0usize;
    for (w, skip) in windows {
        let (inputs, targets) = (&w[..w.len() - 1], &w[1..]);
        for (row, &target) in logits(inputs).iter().zip(targets).skip(*skip) {
            total += cross_entropy(row, target);
            count += 1;
        }
    }
    total / count as f64
}

/// [`mean_loss`] with each window's documents kept apart: a document runs
/// to each `eos` (included), each is scored as a sequence of its own from
/// its first token, and the target after an `eos` (the next document's
/// first token) is left out.
pub fn mean_loss_of_documents(
    windows: &[Vec<u32>],
    eos: u32,
    logits: impl Fn(&[u32]) -> Vec<Vec<f64>>,
) -> f64 {
    let mut total = 0.0;
    let mut count = 0usize;
    for w in windows {
        let (inputs, targets) = (&w[..w.len() - 1], &w[1..]);
        let mut begin = 0;
        while begin < inputs.len() {
            let end = inputs[begin..]
                .iter()
                .position(|&id| id == eos)
                .map_or(inputs.len(), |at| begin + at + 1);
            let rows = logits(&inputs[begin..end]);
            for (at, row) in (begin..end).zip(&rows) {
                if inputs[at] != eos {
                    total += cross_entropy(row, targets[at]);
                    count += 1;
                }
            }
            begin = end;
        }
    }
    total / count as f64
}

fn cross_entropy(row: &[f64], target: u32) -> f64 {
    let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = row.iter().map(|z| (z - max).exp()).sum();
    max + sum.ln() - row[target as usize]
}

/// `x += y`, row by row.
pub fn add_into(x: &mut [Vec<f64>], y: &[Vec<f64>]) {
    for (a, b) in x.iter_mut().flatten().zip(y.iter().flatten()) {
        *a += b;
    }
}
