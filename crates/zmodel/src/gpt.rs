//! A GPT-2-style decoder (pre-LayerNorm, causal multi-head attention, GELU MLP,
//! learned positions, tied embeddings) as a chain of parameter groups.
//!
//! Groups, in forward order: `0` embedding (`wte`, `wpe`), `1..=L` transformer
//! blocks, `L+1` the head (final layer norm). The head also reads `wte` (tied
//! embeddings), so the engine must add the head's `wte` gradient into group 0.
//! Weights are stored `[in, out]` (GPT-2's Conv1D layout) so a linear layer is one
//! 2-D GEMM on `[batch*seq, in]` rows, the shape the CPU GEMM likes best.
//! Initialisation is seeded per parameter, so every rank builds the same model
//! without communicating.

use candle_core::{Result, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use crate::attention::causal_attention;
use crate::ops::{cross_entropy, gelu, layer_norm};

const LN_EPS: f64 = 1e-5;

/// Model shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual width.
    pub d_model: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// Maximum sequence length.
    pub seq_len: usize,
}

/// How a parameter starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Normal with mean 0 and this standard deviation.
    Normal(f32),
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
}

/// One parameter tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// GPT-2 name, e.g. `h.0.attn.c_attn.weight`.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Initialisation.
    pub init: Init,
    /// Whether AdamW's weight decay applies (matrices yes; biases, norms no).
    pub decay: bool,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The parameters of one block.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupSpec {
    /// Block name.
    pub name: String,
    /// Its parameters, in the order its forward takes them.
    pub params: Vec<ParamSpec>,
}

/// The model: shapes and forward functions; it holds no parameters.
#[derive(Debug, Clone)]
pub struct Gpt {
    cfg: GptConfig,
}

fn p(name: String, shape: &[usize], init: Init, decay: bool) -> ParamSpec {
    ParamSpec {
        name,
        shape: shape.to_vec(),
        init,
        decay,
    }
}

impl Gpt {
    /// A model of this shape on the CPU.
    pub fn new(cfg: GptConfig) -> Result<Gpt> {
        Ok(Gpt { cfg })
    }

    /// The shape.
    pub fn config(&self) -> GptConfig {
        self.cfg
    }

    /// Every group's parameters, in forward order.
    pub fn groups(&self) -> Vec<GroupSpec> {
        let GptConfig {
            vocab_size: v,
            d_model: d,
            n_layers: l,
            seq_len: t,
            ..
        } = self.cfg;
        let std = 0.02f32;
        let proj_std = std / (2.0 * l as f32).sqrt();
        let mut groups = vec![GroupSpec {
            name: "embedding".into(),
            params: vec![
                p("wte.weight".into(), &[v, d], Init::Normal(std), true),
                p("wpe.weight".into(), &[t, d], Init::Normal(std), true),
            ],
        }];
        for i in 0..l {
            let n = |s: &str| format!("h.{i}.{s}");
            groups.push(GroupSpec {
                name: format!("h.{i}"),
                params: vec![
                    p(n("ln_1.weight"), &[d], Init::Ones, false),
                    p(n("ln_1.bias"), &[d], Init::Zeros, false),
                    p(
                        n("attn.c_attn.weight"),
                        &[d, 3 * d],
                        Init::Normal(std),
                        true,
                    ),
                    p(n("attn.c_attn.bias"), &[3 * d], Init::Zeros, false),
                    p(
                        n("attn.c_proj.weight"),
                        &[d, d],
                        Init::Normal(proj_std),
                        true,
                    ),
                    p(n("attn.c_proj.bias"), &[d], Init::Zeros, false),
                    p(n("ln_2.weight"), &[d], Init::Ones, false),
                    p(n("ln_2.bias"), &[d], Init::Zeros, false),
                    p(n("mlp.c_fc.weight"), &[d, 4 * d], Init::Normal(std), true),
                    p(n("mlp.c_fc.bias"), &[4 * d], Init::Zeros, false),
                    p(
                        n("mlp.c_proj.weight"),
                        &[4 * d, d],
                        Init::Normal(proj_std),
                        true,
                    ),
                    p(n("mlp.c_proj.bias"), &[d], Init::Zeros, false),
                ],
            });
        }
        groups.push(GroupSpec {
            name: "head".into(),
            params: vec![
                p("ln_f.weight".into(), &[d], Init::Ones, false),
                p("ln_f.bias".into(), &[d], Init::Zeros, false),
            ],
        });
        groups
    }

    /// Total parameters (the tied head adds none).
    pub fn param_count(&self) -> usize {
        self.groups()
            .iter()
            .flat_map(|g| &g.params)
            .map(ParamSpec::numel)
            .sum()
    }

    /// Model FLOPs per trained token, forward and backward: 6 per non-embedding
    /// parameter and per head-matrix weight, plus attention's 12·L·d·T (PaLM's
    /// accounting, which MFU figures use).
    pub fn flops_per_token(&self) -> f64 {
        let GptConfig {
            vocab_size: v,
            d_model: d,
            n_layers: l,
            seq_len: t,
            ..
        } = self.cfg;
        let block_params = 12 * d * d + 13 * d;
        6.0 * (l * block_params + v * d) as f64 + 12.0 * (l * d * t) as f64
    }

    /// Initial values of one group's parameters, identical on every rank for a seed.
    pub fn init_group(&self, group: usize, seed: u64) -> Vec<Vec<f32>> {
        let spec = &self.groups()[group];
        spec.params
            .iter()
            .enumerate()
            .map(|(i, ps)| {
                let stream =
                    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((group as u64) << 20 | i as u64);
                let mut rng = ChaCha8Rng::seed_from_u64(stream);
                match ps.init {
                    Init::Zeros => vec![0.0; ps.numel()],
                    Init::Ones => vec![1.0; ps.numel()],
                    Init::Normal(std) => {
                        let n = Normal::new(0.0f32, std).expect("a positive std");
                        (0..ps.numel()).map(|_| n.sample(&mut rng)).collect()
                    }
                }
            })
            .collect()
    }

    /// Group 0: token + position embeddings of `tokens` `[b, t]` (u32) → `[b, t, d]`.
    pub fn embed(&self, params: &[Tensor], tokens: &Tensor) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let (wte, wpe) = (&params[0], &params[1]);
        let x = wte
            .index_select(&tokens.flatten_all()?, 0)?
            .reshape((b, t, self.cfg.d_model))?;
        x.broadcast_add(&wpe.narrow(0, 0, t)?)
    }

    /// Groups 1..=L: one pre-LN transformer block, `[b, t, d]` → `[b, t, d]`.
    pub fn block(&self, params: &[Tensor], x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let linear = |x: &Tensor, w: &Tensor, bias: &Tensor| x.matmul(w)?.broadcast_add(bias);
        let rows = x.reshape((b * t, d))?;

        let a = layer_norm(&rows, &params[0], &params[1], LN_EPS)?;
        let qkv = linear(&a, &params[2], &params[3])?.reshape((b, t, 3 * d))?;
        let y = causal_attention(&qkv, self.cfg.n_heads)?.reshape((b * t, d))?;
        let rows = (rows + linear(&y, &params[4], &params[5])?)?;

        let m = layer_norm(&rows, &params[6], &params[7], LN_EPS)?;
        let m = gelu(&linear(&m, &params[8], &params[9])?)?;
        let rows = (&rows + linear(&m, &params[10], &params[11])?)?;
        rows.reshape((b, t, d))
    }

    /// Group L+1: final norm, tied head, mean cross-entropy against `targets` `[b, t]`.
    pub fn head_loss(
        &self,
        params: &[Tensor],
        wte: &Tensor,
        x: &Tensor,
        targets: &Tensor,
    ) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let rows = layer_norm(&x.reshape((b * t, d))?, &params[0], &params[1], LN_EPS)?;
        let logits = rows.matmul(&wte.t()?)?;
        cross_entropy(&logits, &targets.flatten_all()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn tiny() -> Gpt {
        Gpt::new(GptConfig {
            vocab_size: 11,
            d_model: 8,
            n_layers: 2,
            n_heads: 2,
            seq_len: 5,
        })
        .unwrap()
    }

    /// The whole model as one function of every parameter, for gradient checks.
    fn loss(g: &Gpt, vars: &[Vec<Tensor>], tokens: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let mut x = g.embed(&vars[0], tokens)?;
        for block in &vars[1..=g.cfg.n_layers] {
            x = g.block(block, &x)?;
        }
        g.head_loss(&vars[g.cfg.n_layers + 1], &vars[0][0], &x, targets)
    }

    #[test]
    fn every_parameter_gets_the_finite_difference_gradient() {
        let g = tiny();
        let dev = Device::Cpu;
        let tokens = Tensor::new(&[[1u32, 4, 2, 9, 3], [0, 10, 5, 5, 7]], &dev).unwrap();
        let targets = Tensor::new(&[[4u32, 2, 9, 3, 1], [10, 5, 5, 7, 2]], &dev).unwrap();
        let groups = g.groups();
        // Perturb the init so biases and norms are not at special points.
        let values: Vec<Vec<Vec<f32>>> = (0..groups.len())
            .map(|gi| {
                g.init_group(gi, 7)
                    .into_iter()
                    .enumerate()
                    .map(|(pi, v)| {
                        v.iter()
                            .enumerate()
                            .map(|(k, x)| x * 10.0 + 0.05 * ((k + pi) % 5) as f32)
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let vars: Vec<Vec<Var>> = groups
            .iter()
            .zip(&values)
            .map(|(gs, vs)| {
                gs.params
                    .iter()
                    .zip(vs)
                    .map(|(ps, v)| Var::from_vec(v.clone(), ps.shape.as_slice(), &dev).unwrap())
                    .collect()
            })
            .collect();
        let tensors: Vec<Vec<Tensor>> = vars
            .iter()
            .map(|g| g.iter().map(|v| v.as_tensor().clone()).collect())
            .collect();
        let grads = loss(&g, &tensors, &tokens, &targets)
            .unwrap()
            .backward()
            .unwrap();
        let h = 1e-3f32;
        for (gi, gs) in groups.iter().enumerate() {
            for (pi, ps) in gs.params.iter().enumerate() {
                let grad = grads
                    .get(vars[gi][pi].as_tensor())
                    .unwrap_or_else(|| panic!("{} has no gradient", ps.name));
                let grad = grad.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                // Check a few elements of every parameter.
                for k in [0, ps.numel() / 2, ps.numel() - 1] {
                    let eval = |delta: f32| {
                        let mut t = tensors.clone();
                        let mut v = values[gi][pi].clone();
                        v[k] += delta;
                        t[gi][pi] = Tensor::from_vec(v, ps.shape.as_slice(), &dev).unwrap();
                        loss(&g, &t, &tokens, &targets)
                            .unwrap()
                            .to_scalar::<f32>()
                            .unwrap()
                    };
                    let fd = (eval(h) - eval(-h)) / (2.0 * h);
                    assert!(
                        (fd - grad[k]).abs() < 3e-2 * (1.0 + fd.abs()),
                        "{}[{k}]: finite difference {fd}, gradient {}",
                        ps.name,
                        grad[k]
                    );
                }
            }
        }
    }

    #[test]
    fn param_count_matches_the_estimator() {
        let g = tiny();
        let c = g.config();
        let m = zconfig::spec::ModelSpec {
            kind: "gpt".into(),
            vocab_size: c.vocab_size,
            d_model: c.d_model,
            n_layers: c.n_layers,
            n_heads: c.n_heads,
            seq_len: c.seq_len,
            init_from: None,
        };
        assert_eq!(g.param_count() as f64, zconfig::estimate::gpt_params(&m));
        let largest = g
            .groups()
            .iter()
            .map(|gs| gs.params.iter().map(ParamSpec::numel).sum::<usize>())
            .max()
            .unwrap();
        assert_eq!(largest as f64, zconfig::estimate::gpt_largest_group(&m));
    }

    #[test]
    fn init_is_deterministic_and_param_count_matches() {
        let g = tiny();
        assert_eq!(g.init_group(1, 3), g.init_group(1, 3));
        assert_ne!(g.init_group(1, 3)[2], g.init_group(1, 4)[2]);
        let (v, d, l, t) = (11, 8, 2, 5);
        assert_eq!(
            g.param_count(),
            v * d + t * d + l * (12 * d * d + 13 * d) + 2 * d
        );
    }

    #[test]
    fn causal_mask_hides_the_future() {
        // Changing a later token must not change earlier positions' block output.
        let g = tiny();
        let dev = Device::Cpu;
        let params: Vec<Tensor> = g.groups()[1]
            .params
            .iter()
            .zip(g.init_group(1, 1))
            .map(|(ps, v)| Tensor::from_vec(v, ps.shape.as_slice(), &dev).unwrap())
            .collect();
        let emb: Vec<Tensor> = g.groups()[0]
            .params
            .iter()
            .zip(g.init_group(0, 1))
            .map(|(ps, v)| Tensor::from_vec(v, ps.shape.as_slice(), &dev).unwrap())
            .collect();
        let run = |last: u32| {
            let tok = Tensor::new(&[[1u32, 2, 3, 4, last]], &dev).unwrap();
            let y = g.block(&params, &g.embed(&emb, &tok).unwrap()).unwrap();
            y.narrow(1, 0, 4)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(run(5), run(9));
    }
}
