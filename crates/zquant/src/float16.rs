//! 16-bit floats, the other way zrun narrows values: the working type of a
//! bf16 or f16 run, and the wire type of gradients reduced in 16 bits
//! (`train.reduce_dtype`). One rounding for both, so that a value rounded for
//! the wire and one rounded for the working copy are the same bits.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

/// A 16-bit float type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    /// bfloat16: f32's range, 8 bits of mantissa.
    Bf16,
    /// IEEE binary16: 11 bits of mantissa, largest finite 65504.
    F16,
}

impl Half {
    /// The type's name, as a job spells it (`bf16`, `f16`).
    pub fn name(self) -> &'static str {
        match self {
            Half::Bf16 => "bf16",
            Half::F16 => "f16",
        }
    }

    /// Rounds to nearest even (NaN stays NaN).
    #[inline]
    pub fn round(self, x: f32) -> u16 {
        match self {
            // zgemm's rounding of bf16 operands: to nearest even, NaN a
            // quiet NaN (`half::bf16::from_f32`'s results; the AdamW
            // kernels do the same in SIMD).
            Half::Bf16 => zgemm::bf16_bits(x),
            Half::F16 => f16::from_f32(x).to_bits(),
        }
    }

    /// Rounds every element of `src` into `dst` (of the same length): bf16
    /// as zgemm rounds its operands (16 at a time with AVX-512; the
    /// compiler's 4-lane loop was 3% of a bf16 step), f16
    /// with F16C where the CPU has it.
    pub fn round_slice(self, src: &[f32], dst: &mut [u16]) {
        match self {
            Half::Bf16 => zgemm::bf16_bits_into(src, dst),
            Half::F16 => dst
                .reinterpret_cast_mut::<f16>()
                .convert_from_f32_slice(src),
        }
    }

    /// Widens every element of `src` into `dst` (of the same length).
    #[inline(always)]
    pub fn widen_slice(self, src: &[u16], dst: &mut [f32]) {
        match self {
            Half::Bf16 => dst
                .iter_mut()
                .zip(src)
                .for_each(|(d, &b)| *d = zgemm::bf16_value(b)),
            Half::F16 => src.reinterpret_cast::<f16>().convert_to_f32_slice(dst),
        }
    }

    /// The exact f32 value of a 16-bit element.
    #[inline]
    pub fn widen(self, b: u16) -> f32 {
        match self {
            Half::Bf16 => zgemm::bf16_value(b),
            Half::F16 => f16::from_bits(b).to_f32(),
        }
    }

    /// Rounds `values` in place to the nearest value of this type (as f32).
    pub fn round_in_place(self, values: &mut [f32]) {
        let mut bits = [0u16; 1024];
        for block in values.chunks_mut(bits.len()) {
            let bits = &mut bits[..block.len()];
            self.round_slice(block, bits);
            self.widen_slice(bits, block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_in_place_is_widening_what_the_rounding_gives() {
        let values: Vec<f32> = (0..3000)
            .map(|i| (i as f32 * 0.37).sin() * 10f32.powi(i % 9 - 4))
            .chain([f32::INFINITY, -0.0, 70000.0, 1e-8])
            .collect();
        for half in [Half::Bf16, Half::F16] {
            let mut rounded = values.clone();
            half.round_in_place(&mut rounded);
            for (x, r) in values.iter().zip(&rounded) {
                let want = half.widen(half.round(*x));
                assert_eq!(r.to_bits(), want.to_bits(), "{half:?} {x}");
            }
        }
        // The types' own roundings, independently.
        assert_eq!(Half::Bf16.widen(Half::Bf16.round(1.0 + 1.0 / 512.0)), 1.0);
        assert_eq!(Half::F16.widen(Half::F16.round(70000.0)), f32::INFINITY);
        assert_eq!(
            Half::Bf16.widen(Half::Bf16.round(70000.0)),
            half::bf16::from_f32(70000.0).to_f32()
        );
    }
}
