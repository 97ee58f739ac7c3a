//! Differentiable building blocks composed from candle primitives.
//!
//! candle-nn's `ops::layer_norm`, `ops::softmax_last_dim` and the `LayerNorm`
//! module run as custom ops without a backward, so parameters behind them get no
//! gradient and no error. These versions use primitive ops only; the max
//! subtracted for stability is detached (softmax does not depend on it), which
//! also spares backward the work of differentiating through it.

use candle_core::{Result, Tensor, D};

/// Layer norm over the last dimension with weight and bias.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xn = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    xn.broadcast_mul(w)?.broadcast_add(b)
}

/// Softmax over the last dimension.
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&s)
}

/// Mean cross-entropy of `logits` `[n, vocab]` against `targets` `[n]` (u32).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let logp = shifted.broadcast_sub(&lse)?;
    let picked = logp.gather(&targets.unsqueeze(1)?, 1)?;
    let n = targets.dim(0)? as f64;
    picked.sum_all()?.affine(-1.0 / n, 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Central finite differences of `f` at `x`, against candle's gradient.
    fn check_grad(f: impl Fn(&Tensor) -> Result<Tensor>, x: Vec<f32>, shape: &[usize]) {
        let dev = Device::Cpu;
        let v = Var::from_vec(x.clone(), shape, &dev).unwrap();
        let g = f(v.as_tensor()).unwrap().backward().unwrap();
        let g = g
            .get(v.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let h = 1e-2f32;
        for i in 0..x.len() {
            let eval = |d: f32| {
                let mut y = x.clone();
                y[i] += d;
                let t = Tensor::from_vec(y, shape, &dev).unwrap();
                f(&t).unwrap().to_scalar::<f32>().unwrap()
            };
            let fd = (eval(h) - eval(-h)) / (2.0 * h);
            assert!(
                (fd - g[i]).abs() < 2e-2 * (1.0 + fd.abs()),
                "element {i}: fd {fd} vs grad {}",
                g[i]
            );
        }
    }

    fn weights(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) / 4.0).collect()
    }

    #[test]
    fn layer_norm_grads_match_finite_differences() {
        let dev = Device::Cpu;
        let w = Tensor::new(&[0.5f32, 1.5, -1.0, 2.0], &dev).unwrap();
        let b = Tensor::new(&[0.1f32, 0.2, 0.3, 0.4], &dev).unwrap();
        let probe = Tensor::from_vec(weights(12), (3, 4), &dev).unwrap();
        check_grad(
            |x| layer_norm(x, &w, &b, 1e-5)?.mul(&probe)?.sum_all(),
            weights(12),
            &[3, 4],
        );
        // And with respect to the weight.
        let x = Tensor::from_vec(weights(12), (3, 4), &dev).unwrap();
        check_grad(
            |w| layer_norm(&x, w, &b, 1e-5)?.mul(&probe)?.sum_all(),
            vec![0.5, 1.5, -1.0, 2.0],
            &[4],
        );
    }

    #[test]
    fn softmax_and_cross_entropy_grads_match_finite_differences() {
        let dev = Device::Cpu;
        let probe = Tensor::from_vec(weights(10), (2, 5), &dev).unwrap();
        check_grad(|x| softmax(x)?.mul(&probe)?.sum_all(), weights(10), &[2, 5]);
        let t = Tensor::new(&[3u32, 0], &dev).unwrap();
        check_grad(|x| cross_entropy(x, &t), weights(10), &[2, 5]);
    }

    #[test]
    fn cross_entropy_of_uniform_logits_is_log_vocab() {
        let dev = Device::Cpu;
        let logits = Tensor::zeros((4, 8), candle_core::DType::F32, &dev).unwrap();
        let t = Tensor::new(&[1u32, 2, 3, 7], &dev).unwrap();
        let l = cross_entropy(&logits, &t)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!((l - 8f32.ln()).abs() < 1e-6);
    }
}
