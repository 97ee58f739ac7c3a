//! Quantizing with error feedback in one pass (LoCo, which zcomm's qgZ
//! runs): each value quantized is the value plus the error kept for it,
//! and what quantizing loses updates that error.
//!
//! Done apart, the step reads and writes each value's error about ten
//! times (widened from its 8 bits, added, the sum kept for the update, the
//! codes dequantized, the error updated, narrowed again): 42 bytes a value
//! where plain quantizing moves 4.5. Here a block's errors are widened into
//! a scratch block that stays in L1, the codes and the new errors come out
//! of one loop over it, and the new errors are narrowed in place: the value
//! read once, its error byte read and written once, its code written once.

use crate::{check_block_size, scale_for, to_code, Bits, Path, QuantError, Quantized};

/// Quantizes `x + e` as `bits` in blocks of `block_size`, where `e` is
/// `errors` widened (zeros where `errors` is `None` or was kept for another
/// length or block size), and leaves `beta · e + (1 − beta) · (x + e − q)`
/// in `errors`, 8-bit in the same blocks, `q` being what the codes
/// dequantize to ([`crate::dequantize`] gives the same bits). A non-finite
/// `x + e` is an error and forgets the errors (`None`).
pub fn quantize_compensated(
    x: &[f32],
    errors: &mut Option<Quantized>,
    beta: f32,
    bits: Bits,
    block_size: usize,
) -> Result<Quantized, QuantError> {
    quantize_compensated_with(Path::best(), x, errors, beta, bits, block_size)
}

/// [`quantize_compensated`] on `path` (which must run here), on this
/// thread.
pub fn quantize_compensated_with(
    path: Path,
    x: &[f32],
    errors: &mut Option<Quantized>,
    beta: f32,
    bits: Bits,
    block_size: usize,
) -> Result<Quantized, QuantError> {
    check_block_size(block_size)?;
    let len = x.len();
    let blocks = len.div_ceil(block_size);
    let kept = errors
        .take()
        .filter(|e| e.len == len && e.block_size == block_size && e.bits == Bits::Int8);
    let had = kept.is_some();
    let mut new = kept.unwrap_or_else(|| Quantized {
        bits: Bits::Int8,
        block_size,
        len,
        scales: vec![0.0; blocks],
        data: vec![0; len],
    });
    let mut out = Quantized {
        bits,
        block_size,
        len,
        scales: vec![0.0; blocks],
        data: vec![0; bits.data_bytes(len)],
    };
    let mut scratch = vec![0f32; block_size.min(len)];
    path.run(
        #[inline(always)]
        || {
            for b in 0..blocks {
                let at = b * block_size;
                let x = &x[at..(at + block_size).min(len)];
                let e = &mut scratch[..x.len()];
                let kept = &mut new.data[at..at + x.len()];
                match had {
                    true => widen(kept, new.scales[b], e),
                    false => e.fill(0.0),
                }
                let codes = &mut out.data[bits.data_bytes(at)..bits.data_bytes(at + x.len())];
                out.scales[b] =
                    block(x, e, beta, bits, codes).map_err(|i| QuantError::NonFinite {
                        index: at + i,
                        value: x[i] + e[i],
                    })?;
                new.scales[b] = narrow(e, kept);
            }
            Ok(())
        },
    )?;
    *errors = Some(new);
    Ok(out)
}

/// One block: codes of `x + e` into `codes` and `e` updated; returns the
/// block's scale, or the index of a non-finite sum.
#[inline(always)]
fn block(x: &[f32], e: &mut [f32], beta: f32, bits: Bits, codes: &mut [u8]) -> Result<f32, usize> {
    let amax =
        (x.iter().zip(e.iter())).fold(0u32, |m, (v, e)| m.max((v + e).to_bits() & 0x7fff_ffff));
    if amax >= f32::INFINITY.to_bits() {
        return Err((x.iter().zip(e.iter()))
            .position(|(v, e)| !(v + e).is_finite())
            .unwrap_or(0));
    }
    let s = scale_for(f32::from_bits(amax), bits.qmax());
    let keep = 1.0 - beta;
    if s == 0.0 {
        // Every sum is zero: so is every code, and each error keeps beta
        // of itself and 1 - beta of its sum (0).
        codes.fill(0);
        e.iter_mut()
            .zip(x)
            .for_each(|(e, v)| *e = beta * *e + keep * (v + *e));
        return Ok(0.0);
    }
    // The code of one sum, and its error updated by what the code loses.
    let code = |v: f32, e: &mut f32| -> u8 {
        let c = v + *e;
        let q = to_code(c, s);
        *e = beta * *e + keep * (c - f32::from(q as i8) * s);
        q
    };
    match bits {
        Bits::Int8 => {
            for ((o, &v), e) in codes.iter_mut().zip(x).zip(e.iter_mut()) {
                *o = code(v, e);
            }
        }
        Bits::Int4 => {
            let pairs = x.chunks_exact(2).zip(e.chunks_exact_mut(2));
            for (o, (v, e)) in codes.iter_mut().zip(pairs) {
                let (lo, hi) = e.split_at_mut(1);
                *o = (code(v[0], &mut lo[0]) & 0x0f) | (code(v[1], &mut hi[0]) << 4);
            }
            if x.len() % 2 == 1 {
                let n = x.len() - 1;
                codes[n / 2] = code(x[n], &mut e[n]) & 0x0f;
            }
        }
    }
    Ok(s)
}

/// 8-bit codes of scale `s` widened into `out`.
#[inline(always)]
fn widen(codes: &[u8], s: f32, out: &mut [f32]) {
    for (o, &q) in out.iter_mut().zip(codes) {
        *o = f32::from(q as i8) * s;
    }
}

/// `e` narrowed to 8-bit codes in `codes`; returns their scale.
#[inline(always)]
fn narrow(e: &[f32], codes: &mut [u8]) -> f32 {
    let amax = e.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    // Finite: every error is a mix of finite sums and finite codes.
    let s = scale_for(f32::from_bits(amax), Bits::Int8.qmax());
    match s == 0.0 {
        true => codes.fill(0),
        false => codes
            .iter_mut()
            .zip(e)
            .for_each(|(o, &v)| *o = to_code(v, s)),
    }
    s
}
