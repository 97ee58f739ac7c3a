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

use crate::attention::{causal_attention, causal_attention_backward};
use crate::ops::{
    column_sums, cross_entropy, gelu, gelu_backward, layer_norm, layer_norm_backward,
};
use crate::params::{BlockParams, EmbeddingParams, HeadParams, WeightBias};

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

/// What a block's forward leaves for its backward (16 floats of d per token;
/// attention probabilities are recomputed).
pub struct BlockActs {
    rows: Tensor,
    a1: Tensor,
    qkv: Tensor,
    att: Tensor,
    rows1: Tensor,
    a2: Tensor,
    h: Tensor,
    g: Tensor,
}

/// `y = x·w + bias` backward: ((dw = xᵀ·dy, dbias = Σ rows of dy), dx = dy·wᵀ).
fn linear_backward(
    x: &Tensor,
    l: &WeightBias<Tensor>,
    dy: &Tensor,
) -> Result<(WeightBias<Tensor>, Tensor)> {
    let grads = WeightBias {
        weight: x.t()?.matmul(dy)?,
        bias: column_sums(dy)?,
    };
    Ok((grads, dy.matmul(&l.weight.t()?)?))
}

/// Layer norm backward: ((dweight, dbias), dx).
fn norm_backward(
    x: &Tensor,
    n: &WeightBias<Tensor>,
    dy: &Tensor,
) -> Result<(WeightBias<Tensor>, Tensor)> {
    let (dx, weight, bias) = layer_norm_backward(x, &n.weight, dy, LN_EPS)?;
    Ok((WeightBias { weight, bias }, dx))
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
        let lin = |name: String, shape_w: &[usize], shape_b: &[usize], std: f32| WeightBias {
            weight: p(format!("{name}.weight"), shape_w, Init::Normal(std), true),
            bias: p(format!("{name}.bias"), shape_b, Init::Zeros, false),
        };
        let norm = |name: String| WeightBias {
            weight: p(format!("{name}.weight"), &[d], Init::Ones, false),
            bias: p(format!("{name}.bias"), &[d], Init::Zeros, false),
        };
        let embedding = EmbeddingParams {
            wte: p("wte.weight".into(), &[v, d], Init::Normal(std), true),
            wpe: p("wpe.weight".into(), &[t, d], Init::Normal(std), true),
        };
        let mut groups = vec![GroupSpec {
            name: "embedding".into(),
            params: embedding.into_vec(),
        }];
        for i in 0..l {
            let n = |s: &str| format!("h.{i}.{s}");
            let block = BlockParams {
                ln_1: norm(n("ln_1")),
                attn_c_attn: lin(n("attn.c_attn"), &[d, 3 * d], &[3 * d], std),
                attn_c_proj: lin(n("attn.c_proj"), &[d, d], &[d], proj_std),
                ln_2: norm(n("ln_2")),
                mlp_c_fc: lin(n("mlp.c_fc"), &[d, 4 * d], &[4 * d], std),
                mlp_c_proj: lin(n("mlp.c_proj"), &[4 * d, d], &[d], proj_std),
            };
            groups.push(GroupSpec {
                name: format!("h.{i}"),
                params: block.into_vec(),
            });
        }
        let head = HeadParams {
            ln_f: norm("ln_f".into()),
        };
        groups.push(GroupSpec {
            name: "head".into(),
            params: head.into_vec(),
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
    pub fn embed(&self, params: &EmbeddingParams<Tensor>, tokens: &Tensor) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let EmbeddingParams { wte, wpe } = params;
        let x = wte
            .index_select(&tokens.flatten_all()?, 0)?
            .reshape((b, t, self.cfg.d_model))?;
        x.broadcast_add(&wpe.narrow(0, 0, t)?)
    }

    /// Groups 1..=L: one pre-LN transformer block, `[b, t, d]` → `[b, t, d]`
    /// (differentiable by candle's autograd through the fused ops).
    pub fn block(&self, params: &BlockParams<Tensor>, x: &Tensor) -> Result<Tensor> {
        Ok(self.block_forward(params, x)?.0)
    }

    /// A block's forward, also returning what [`Gpt::block_backward`] needs.
    pub fn block_forward(
        &self,
        params: &BlockParams<Tensor>,
        x: &Tensor,
    ) -> Result<(Tensor, BlockActs)> {
        let (b, t, d) = x.dims3()?;
        let linear =
            |x: &Tensor, l: &WeightBias<Tensor>| x.matmul(&l.weight)?.broadcast_add(&l.bias);
        let norm = |x: &Tensor, n: &WeightBias<Tensor>| layer_norm(x, &n.weight, &n.bias, LN_EPS);
        let rows = x.reshape((b * t, d))?;

        let a1 = norm(&rows, &params.ln_1)?;
        let qkv = linear(&a1, &params.attn_c_attn)?.reshape((b, t, 3 * d))?;
        let att = causal_attention(&qkv, self.cfg.n_heads)?.reshape((b * t, d))?;
        let rows1 = (&rows + linear(&att, &params.attn_c_proj)?)?;

        let a2 = norm(&rows1, &params.ln_2)?;
        let h = linear(&a2, &params.mlp_c_fc)?;
        let g = gelu(&h)?;
        let y = (&rows1 + linear(&g, &params.mlp_c_proj)?)?.reshape((b, t, d))?;
        let acts = BlockActs {
            rows,
            a1,
            qkv,
            att,
            rows1,
            a2,
            h,
            g,
        };
        Ok((y, acts))
    }

    /// A block's backward by hand: from `dy` `[b, t, d]`, the gradient of every
    /// parameter (in [`Gpt::groups`] order) and of the input. The same
    /// arithmetic as autograd through [`Gpt::block`] (tested), without building a
    /// graph: candle's backward allocates a zeroed gradient and adds into it for
    /// every node, which was a third of a step's time outside the GEMMs.
    pub fn block_backward(
        &self,
        params: &BlockParams<Tensor>,
        acts: &BlockActs,
        dy: &Tensor,
    ) -> Result<(BlockParams<Tensor>, Tensor)> {
        let (b, t, d) = dy.dims3()?;
        let dy = dy.reshape((b * t, d))?;
        // y = rows1 + g·W_fc2 + b_fc2
        let (mlp_c_proj, dg) = linear_backward(&acts.g, &params.mlp_c_proj, &dy)?;
        let dh = gelu_backward(&acts.h, &dg)?;
        let (mlp_c_fc, da2) = linear_backward(&acts.a2, &params.mlp_c_fc, &dh)?;
        let (ln_2, dx2) = norm_backward(&acts.rows1, &params.ln_2, &da2)?;
        let drows1 = (&dy + dx2)?;
        // rows1 = rows + att·W_proj + b_proj
        let (attn_c_proj, datt) = linear_backward(&acts.att, &params.attn_c_proj, &drows1)?;
        let dqkv =
            causal_attention_backward(&acts.qkv, &datt.reshape((b, t, d))?, self.cfg.n_heads)?
                .reshape((b * t, 3 * d))?;
        let (attn_c_attn, da1) = linear_backward(&acts.a1, &params.attn_c_attn, &dqkv)?;
        let (ln_1, dx1) = norm_backward(&acts.rows, &params.ln_1, &da1)?;
        let dx = (drows1 + dx1)?.reshape((b, t, d))?;
        let grads = BlockParams {
            ln_1,
            attn_c_attn,
            attn_c_proj,
            ln_2,
            mlp_c_fc,
            mlp_c_proj,
        };
        Ok((grads, dx))
    }

    /// Group L+1: final norm, tied head, mean cross-entropy against `targets` `[b, t]`.
    pub fn head_loss(
        &self,
        params: &HeadParams<Tensor>,
        wte: &Tensor,
        x: &Tensor,
        targets: &Tensor,
    ) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let ln_f = &params.ln_f;
        let rows = layer_norm(&x.reshape((b * t, d))?, &ln_f.weight, &ln_f.bias, LN_EPS)?;
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
        let mut x = g.embed(&EmbeddingParams::from_vec(vars[0].clone())?, tokens)?;
        for block in &vars[1..=g.cfg.n_layers] {
            x = g.block(&BlockParams::from_vec(block.clone())?, &x)?;
        }
        let head = HeadParams::from_vec(vars[g.cfg.n_layers + 1].clone())?;
        g.head_loss(&head, &vars[0][0], &x, targets)
    }

    /// The hand-written block backward equals autograd through the block.
    #[test]
    fn block_backward_matches_autograd() {
        let g = Gpt::new(GptConfig {
            vocab_size: 11,
            d_model: 12,
            n_layers: 1,
            n_heads: 3,
            seq_len: 40,
        })
        .unwrap();
        let dev = Device::Cpu;
        // 2 × 40 rows: several parallel tasks in every fused op.
        let vars: Vec<Var> = g
            .init_group(1, 3)
            .into_iter()
            .zip(&g.groups()[1].params)
            .enumerate()
            .map(|(pi, (v, ps))| {
                let v: Vec<f32> = v
                    .iter()
                    .enumerate()
                    .map(|(k, x)| x * 10.0 + 0.05 * ((k + pi) % 5) as f32)
                    .collect();
                Var::from_vec(v, ps.shape.as_slice(), &dev).unwrap()
            })
            .collect();
        let n = 2 * 40 * 12;
        let wave =
            |k: usize| -> Vec<f32> { (0..n).map(|i| ((i * k % 17) as f32 - 8.0) / 8.0).collect() };
        let x = Var::from_vec(wave(7), (2, 40, 12), &dev).unwrap();
        let dy = Tensor::from_vec(wave(5), (2, 40, 12), &dev).unwrap();
        let params: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = g
            .block(
                &BlockParams::from_vec(params.clone()).unwrap(),
                x.as_tensor(),
            )
            .unwrap();
        let auto = (y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        let plain = BlockParams::from_vec(params.iter().map(|p| p.detach()).collect()).unwrap();
        let (_, acts) = g.block_forward(&plain, &x.as_tensor().detach()).unwrap();
        let (grads, dx) = g.block_backward(&plain, &acts, &dy).unwrap();
        let grads = grads.into_vec();
        let close = |a: &Tensor, b: &Tensor, what: &str| {
            let (a, b) = (
                a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert_eq!(a.len(), b.len(), "{what}");
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    (x - y).abs() <= 1e-4 * (1.0 + x.abs()),
                    "{what}: {x} vs {y}"
                );
            }
        };
        for ((v, grad), ps) in vars.iter().zip(&grads).zip(&g.groups()[1].params) {
            close(auto.get(v.as_tensor()).unwrap(), grad, &ps.name);
        }
        close(auto.get(x.as_tensor()).unwrap(), &dx, "input");
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
        // Measured with h = 1e-3 (f32 throughout): |fd - grad| up to 1.2e-3 where
        // the gradient is small (rounding of the loss over 2h) and 1.7e-3·|grad|
        // where it is large (truncation); the tolerance is 2.5-3x both.
        let h = 1e-3f32;
        for (gi, gs) in groups.iter().enumerate() {
            for (pi, ps) in gs.params.iter().enumerate() {
                let grad = grads
                    .get(vars[gi][pi].as_tensor())
                    .unwrap_or_else(|| panic!("{} has no gradient", ps.name));
                let grad = grad.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                // The four largest elements of every parameter: where a zeroed or
                // halved gradient cannot hide in the finite differences' noise.
                let mut order: Vec<usize> = (0..grad.len()).collect();
                order.sort_by(|&a, &b| grad[b].abs().total_cmp(&grad[a].abs()));
                for &k in order.iter().take(4) {
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
                    let tol = 3e-3 + 5e-3 * fd.abs();
                    assert!(
                        fd.abs() > 4.0 * tol,
                        "{}[{k}]: |{fd}| is too small for a halved gradient to fail",
                        ps.name
                    );
                    assert!(
                        (fd - grad[k]).abs() <= tol,
                        "{}[{k}]: finite difference {fd}, gradient {}",
                        ps.name,
                        grad[k]
                    );
                }
            }
        }
    }

    /// The fused ops' AVX2 build and their baseline build give the same bits
    /// (no fused multiply-add is ever formed), through a whole block forward and
    /// backward and the head's loss. Says on stderr which paths it compared.
    #[test]
    fn avx2_and_baseline_fused_ops_give_the_same_bits() {
        use std::io::Write;
        use std::sync::atomic::Ordering;
        let g = Gpt::new(GptConfig {
            vocab_size: 11,
            d_model: 16,
            n_layers: 1,
            n_heads: 2,
            seq_len: 40,
        })
        .unwrap();
        let dev = Device::Cpu;
        let tensors = |gi: usize| -> Vec<Tensor> {
            g.init_group(gi, 5)
                .into_iter()
                .zip(&g.groups()[gi].params)
                .map(|(v, ps)| {
                    let v: Vec<f32> = v
                        .iter()
                        .enumerate()
                        .map(|(k, x)| x * 20.0 + 0.01 * (k % 7) as f32)
                        .collect();
                    Tensor::from_vec(v, ps.shape.as_slice(), &dev).unwrap()
                })
                .collect()
        };
        let (block, head, emb) = (tensors(1), tensors(2), tensors(0));
        let wave = |k: usize, n: usize| -> Vec<f32> {
            (0..n).map(|i| ((i * k % 23) as f32 - 11.0) / 7.0).collect()
        };
        let x = Tensor::from_vec(wave(7, 2 * 40 * 16), (2, 40, 16), &dev).unwrap();
        let dy = Tensor::from_vec(wave(5, 2 * 40 * 16), (2, 40, 16), &dev).unwrap();
        let targets = Tensor::from_vec(
            (0..80u32).map(|i| i * 7 % 11).collect::<Vec<_>>(),
            (2, 40),
            &dev,
        )
        .unwrap();
        let run = || -> Vec<Vec<u32>> {
            let p = BlockParams::from_vec(block.clone()).unwrap();
            let (y, acts) = g.block_forward(&p, &x).unwrap();
            let (grads, dx) = g.block_backward(&p, &acts, &dy).unwrap();
            let h = HeadParams::from_vec(head.clone()).unwrap();
            let loss = g.head_loss(&h, &emb[0], &y, &targets).unwrap();
            let mut out: Vec<&Tensor> = vec![&y, &dx, &loss];
            let grads = grads.into_vec();
            out.extend(&grads);
            out.iter()
                .map(|t| {
                    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    v.iter().map(|f| f.to_bits()).collect()
                })
                .collect()
        };
        let best = run();
        crate::simd::FORCE_BASELINE.store(true, Ordering::SeqCst);
        let baseline = run();
        crate::simd::FORCE_BASELINE.store(false, Ordering::SeqCst);
        assert!(best == baseline, "the AVX2 and baseline builds differ");
        #[cfg(target_arch = "x86_64")]
        let avx2 = std::arch::is_x86_feature_detected!("avx2");
        #[cfg(not(target_arch = "x86_64"))]
        let avx2 = false;
        let _ = writeln!(
            std::io::stderr(),
            "fused ops: {}",
            if avx2 {
                "AVX2 and baseline builds compared, same bits"
            } else {
                "no AVX2 on this CPU: only the baseline build ran, nothing compared"
            }
        );
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
        let values = |group: usize| -> Vec<Tensor> {
            g.groups()[group]
                .params
                .iter()
                .zip(g.init_group(group, 1))
                .map(|(ps, v)| Tensor::from_vec(v, ps.shape.as_slice(), &dev).unwrap())
                .collect()
        };
        let params = BlockParams::from_vec(values(1)).unwrap();
        let emb = EmbeddingParams::from_vec(values(0)).unwrap();
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
