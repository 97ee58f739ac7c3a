//! An independent reader of zrun's export: it knows GPT-2 only from GPT-2's
//! own conventions (Hugging Face's `GPT2Model` names, `Conv1D` weights stored
//! `[in, out]`, `c_attn` output laid out as q | k | v with heads contiguous in
//! each, GELU's tanh approximation, layer norm eps 1e-5, the head tied to
//! `wte`), reads the safetensors file with the `safetensors` crate and computes
//! the loss in f64 with plain loops. Nothing here comes from zmodel or zckpt, so
//! a transposed, renamed, reordered or misplaced tensor in the export shows up
//! as a different loss, or as a missing name or a wrong shape.

use std::collections::HashMap;
use std::path::Path;

use crate::reference_common::{add_into, load_exactly, mean_loss, mean_loss_of_documents};

/// GPT-2's hyper-parameters that the file does not hold.
pub struct Gpt2Shape {
    pub vocab: usize,
    pub d: usize,
    pub layers: usize,
    pub heads: usize,
    pub max_seq: usize,
}

/// A GPT-2 loaded from safetensors by name, every tensor checked for shape.
pub struct Gpt2 {
    shape: Gpt2Shape,
    tensors: HashMap<String, Vec<f64>>,
}

impl Gpt2 {
    /// Reads `path`; panics naming the first missing, extra, misshapen or
    /// non-f32 tensor.
    pub fn load(path: &Path, shape: Gpt2Shape) -> Gpt2 {
        let (v, d, t) = (shape.vocab, shape.d, shape.max_seq);
        let mut want: Vec<(String, Vec<usize>)> = vec![
            ("wte.weight".into(), vec![v, d]),
            ("wpe.weight".into(), vec![t, d]),
        ];
        for i in 0..shape.layers {
            for (name, dims) in [
                ("ln_1.weight", vec![d]),
                ("ln_1.bias", vec![d]),
                ("attn.c_attn.weight", vec![d, 3 * d]),
                ("attn.c_attn.bias", vec![3 * d]),
                ("attn.c_proj.weight", vec![d, d]),
                ("attn.c_proj.bias", vec![d]),
                ("ln_2.weight", vec![d]),
                ("ln_2.bias", vec![d]),
                ("mlp.c_fc.weight", vec![d, 4 * d]),
                ("mlp.c_fc.bias", vec![4 * d]),
                ("mlp.c_proj.weight", vec![4 * d, d]),
                ("mlp.c_proj.bias", vec![d]),
            ] {
                want.push((format!("h.{i}.{name}"), dims));
            }
        }
        want.push(("ln_f.weight".into(), vec![d]));
        want.push(("ln_f.bias".into(), vec![d]));
        let tensors = load_exactly(path, want);
        Gpt2 { shape, tensors }
    }

    fn w(&self, name: &str) -> &[f64] {
        &self.tensors[name]
    }

    fn weight_and_bias(&self, name: &str) -> (&[f64], &[f64]) {
        (
            self.w(&format!("{name}.weight")),
            self.w(&format!("{name}.bias")),
        )
    }

    /// Mean next-token cross-entropy over `windows` (each `len + 1` tokens:
    /// inputs are the first `len`, targets the last `len`).
    pub fn loss(&self, windows: &[Vec<u32>]) -> f64 {
        mean_loss(windows, |inputs| self.logits(inputs))
    }

    /// [`Gpt2::loss`] with each window's documents (ended by `eos`) each
    /// scored alone ([`mean_loss_of_documents`]).
    pub fn loss_of_documents(&self, windows: &[Vec<u32>], eos: u32) -> f64 {
        mean_loss_of_documents(windows, eos, |inputs| self.logits(inputs))
    }

    fn logits(&self, tokens: &[u32]) -> Vec<Vec<f64>> {
        let Gpt2Shape {
            vocab, d, layers, ..
        } = self.shape;
        let (wte, wpe) = (self.w("wte.weight"), self.w("wpe.weight"));
        let mut x: Vec<Vec<f64>> = tokens
            .iter()
            .enumerate()
            .map(|(p, &tok)| {
                (0..d)
                    .map(|j| wte[tok as usize * d + j] + wpe[p * d + j])
                    .collect()
            })
            .collect();
        for i in 0..layers {
            let n = |s: &str| format!("h.{i}.{s}");
            let a = self.layer_norm(&x, &n("ln_1"));
            let qkv = self.conv1d(&a, &n("attn.c_attn"));
            let att = self.attention(&qkv);
            let proj = self.conv1d(&att, &n("attn.c_proj"));
            add_into(&mut x, &proj);
            let a = self.layer_norm(&x, &n("ln_2"));
            let mut h = self.conv1d(&a, &n("mlp.c_fc"));
            for v in h.iter_mut().flatten() {
                *v = 0.5
                    * *v
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (*v + 0.044715 * v.powi(3)))
                            .tanh());
            }
            let out = self.conv1d(&h, &n("mlp.c_proj"));
            add_into(&mut x, &out);
        }
        let x = self.layer_norm(&x, "ln_f");
        x.iter()
            .map(|row| {
                (0..vocab)
                    .map(|tok| (0..d).map(|j| row[j] * wte[tok * d + j]).sum())
                    .collect()
            })
            .collect()
    }

    fn layer_norm(&self, x: &[Vec<f64>], name: &str) -> Vec<Vec<f64>> {
        let (g, b) = self.weight_and_bias(name);
        x.iter()
            .map(|row| {
                let mean = row.iter().sum::<f64>() / row.len() as f64;
                let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / row.len() as f64;
                let rstd = 1.0 / (var + 1e-5).sqrt();
                row.iter()
                    .enumerate()
                    .map(|(j, v)| (v - mean) * rstd * g[j] + b[j])
                    .collect()
            })
            .collect()
    }

    /// GPT-2's `Conv1D`: `y = x · W + b` with `W` stored `[in, out]`.
    fn conv1d(&self, x: &[Vec<f64>], name: &str) -> Vec<Vec<f64>> {
        let (w, b) = self.weight_and_bias(name);
        let out = b.len();
        x.iter()
            .map(|row| {
                (0..out)
                    .map(|o| {
                        b[o] + row
                            .iter()
                            .enumerate()
                            .map(|(k, v)| v * w[k * out + o])
                            .sum::<f64>()
                    })
                    .collect()
            })
            .collect()
    }

    /// Causal multi-head attention on `[t, 3d]` rows laid out q | k | v.
    fn attention(&self, qkv: &[Vec<f64>]) -> Vec<Vec<f64>> {
        let (d, heads) = (self.shape.d, self.shape.heads);
        let hd = d / heads;
        let t = qkv.len();
        let mut out = vec![vec![0.0; d]; t];
        for h in 0..heads {
            let (q, k, v) = (h * hd, d + h * hd, 2 * d + h * hd);
            for i in 0..t {
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..hd).map(|c| qkv[i][q + c] * qkv[j][k + c]).sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, p) in e.iter().enumerate() {
                    for c in 0..hd {
                        out[i][h * hd + c] += p / z * qkv[j][v + c];
                    }
                }
            }
        }
        out
    }
}
