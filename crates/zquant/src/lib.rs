//! Blockwise symmetric quantization, the arithmetic of ZeRO++: qwZ sends stage
//! 3's gathered weights as int8 (half of bf16's bytes, a quarter of f32's) and
//! qgZ sends gradients as int4. Beside it, [`Half`]: the 16-bit float types
//! and their rounding, which the working copies of 16-bit training and
//! gradients reduced in 16 bits share.
//!
//! Each block of `block_size` values shares one f32 scale `s = max|x| / qmax`
//! (qmax 127 for int8, 7 for int4, so the code is symmetric around zero and
//! needs no zero point); a value becomes `q = round_half_even(x / s)` and comes
//! back as `q · s`. Rounding to the nearest step bounds every element's error
//! by `s / 2`, plus the f32 rounding of the division and of the product (at
//! most `2 · qmax · 2^-24 · s` together; [`error_bound`]). A block of zeros
//! gets scale 0. A NaN or an infinity is refused: its scale would be NaN or
//! infinite and every value of its block would arrive as garbage on every rank,
//! so quantizing it fails loudly instead.
//!
//! int4 packs two values a byte, the earlier one in the low nibble, as two's
//! complement. Blocks have an even size, so every block starts on a byte.
//!
//! One source, three builds: the same loops compiled with AVX-512, with AVX2 and
//! for the baseline target, chosen at run time ([`Path`]). Division and
//! round-half-even are exact IEEE operations on every path and Rust never forms
//! a fused multiply-add, so every path gives the same bits (tested). Blocks are
//! independent and spread over rayon's threads in tasks of whole blocks, so the
//! thread count does not change a bit either. Called from outside a rayon
//! pool, the calling thread does all the blocks itself (see [`quantize_with`]).
//!
//! [`quantize_compensated`] quantizes with error feedback (LoCo) in one pass.

use std::mem::MaybeUninit;

use rayon::prelude::*;

mod feedback;
mod float16;
pub use feedback::{quantize_compensated, quantize_compensated_with};
pub use float16::Half;

/// Blocks per parallel task.
const BLOCKS_PER_TASK: usize = 16;

/// Bits per quantized value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bits {
    /// Signed 8-bit, -127..=127.
    Int8,
    /// Signed 4-bit, -7..=7, two a byte.
    Int4,
}

impl Bits {
    /// From a bit count as a config writes it (8 or 4).
    pub fn from_count(bits: u32) -> Option<Bits> {
        match bits {
            8 => Some(Bits::Int8),
            4 => Some(Bits::Int4),
            _ => None,
        }
    }

    /// The largest magnitude a value takes.
    pub fn qmax(self) -> f32 {
        match self {
            Bits::Int8 => 127.0,
            Bits::Int4 => 7.0,
        }
    }

    /// Bytes that hold `len` values.
    pub fn data_bytes(self, len: usize) -> usize {
        match self {
            Bits::Int8 => len,
            Bits::Int4 => len.div_ceil(2),
        }
    }
}

/// What can go wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantError {
    /// The input holds a NaN or an infinity.
    #[error("element {index} is {value}: a non-finite value cannot be quantized")]
    NonFinite {
        /// Where in the input.
        index: usize,
        /// The value.
        value: f32,
    },
    /// The block size is zero or odd.
    #[error("quantization block size {0}: must be a positive even number")]
    BlockSize(usize),
    /// Received bytes do not match the length they claim to hold.
    #[error("{got} bytes of quantized data, {want} expected for {len} values")]
    WireLength {
        /// Bytes received.
        got: usize,
        /// Bytes `len` values take.
        want: usize,
        /// Values.
        len: usize,
    },
}

/// Quantized values: one scale per block, then the packed values.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    /// Bits per value.
    pub bits: Bits,
    /// Values per block (even).
    pub block_size: usize,
    /// Values.
    pub len: usize,
    /// One per block.
    pub scales: Vec<f32>,
    /// `bits.data_bytes(len)` bytes.
    pub data: Vec<u8>,
}

impl Quantized {
    /// Bytes that `len` values take on the wire: the scales, then the values.
    pub fn wire_len(bits: Bits, block_size: usize, len: usize) -> usize {
        4 * len.div_ceil(block_size) + bits.data_bytes(len)
    }

    /// The wire form: scales (little-endian f32), then the values.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 * self.scales.len() + self.data.len());
        for s in &self.scales {
            out.extend_from_slice(&s.to_le_bytes());
        }
        out.extend_from_slice(&self.data);
        out
    }

    /// Reads the wire form of `len` values.
    pub fn from_bytes(
        bits: Bits,
        block_size: usize,
        len: usize,
        bytes: &[u8],
    ) -> Result<Quantized, QuantError> {
        check_block_size(block_size)?;
        let want = Quantized::wire_len(bits, block_size, len);
        if bytes.len() != want {
            return Err(QuantError::WireLength {
                got: bytes.len(),
                want,
                len,
            });
        }
        let (scales, data) = bytes.split_at(4 * len.div_ceil(block_size));
        Ok(Quantized {
            bits,
            block_size,
            len,
            scales: scales
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            data: data.to_vec(),
        })
    }
}

/// The largest error of a value quantized with scale `s`, rounding included.
pub fn error_bound(bits: Bits, s: f32) -> f64 {
    f64::from(s) * (0.5 + 2.0 * f64::from(bits.qmax()) * f64::from(f32::EPSILON) / 2.0)
}

/// Which build of the kernels runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Compiled for AVX-512 (F, BW, VL, DQ).
    Avx512,
    /// Compiled for AVX2.
    Avx2,
    /// Compiled for the baseline target.
    Portable,
}

impl Path {
    /// Every path, fastest first.
    pub const ALL: [Path; 3] = [Path::Avx512, Path::Avx2, Path::Portable];

    /// Whether this CPU can run it.
    pub fn runs_here(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Path::Avx512 => {
                    has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq")
                }
                Path::Avx2 => has!("avx2"),
                Path::Portable => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Path::Portable
        }
    }

    /// The paths this CPU can run, fastest first.
    pub fn available() -> Vec<Path> {
        Path::ALL.into_iter().filter(|p| p.runs_here()).collect()
    }

    /// The fastest path this CPU can run.
    pub fn best() -> Path {
        Path::available()[0]
    }

    /// Runs `f` in a function built for this path; `f`'s loops are inlined
    /// into it and compiled for its instruction set. Callers mark `f`
    /// `#[inline(always)]`: LLVM left these closures out of line, and an
    /// out-of-line closure is compiled for the baseline, so until then all
    /// three paths ran the same scalar code (`zrun bench kernels`: quantize
    /// went from 5.2 to 7.2 GB/s with the mark).
    #[inline(always)]
    fn run<R>(self, f: impl FnOnce() -> R) -> R {
        assert!(self.runs_here(), "{self:?} does not run on this CPU");
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
            fn avx512<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            #[target_feature(enable = "avx2")]
            fn avx2<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            match self {
                // SAFETY: the CPU has these features (asserted above).
                Path::Avx512 => return unsafe { avx512(f) },
                // SAFETY: as above.
                Path::Avx2 => return unsafe { avx2(f) },
                Path::Portable => {}
            }
        }
        f()
    }
}

fn check_block_size(block_size: usize) -> Result<(), QuantError> {
    if block_size == 0 || !block_size.is_multiple_of(2) {
        return Err(QuantError::BlockSize(block_size));
    }
    Ok(())
}

/// Quantizes `x` on the fastest path.
pub fn quantize(x: &[f32], bits: Bits, block_size: usize) -> Result<Quantized, QuantError> {
    quantize_with(Path::best(), x, bits, block_size)
}

/// Quantizes `x` on `path` (which must run here): on a rayon pool's worker
/// the blocks are spread over that pool, on any other thread this one does them
/// all.
pub fn quantize_with(
    path: Path,
    x: &[f32],
    bits: Bits,
    block_size: usize,
) -> Result<Quantized, QuantError> {
    check_block_size(block_size)?;
    // Written whole by the blocks' tasks (no zeroing pass: a tenth of a
    // quantize's time).
    let mut scales = uninit(x.len().div_ceil(block_size));
    let mut data = uninit(bits.data_bytes(x.len()));
    let per = BLOCKS_PER_TASK * block_size;
    let task = |(task, ((x, scales), data)): QuantizeTask| {
        path.run(
            #[inline(always)]
            || quantize_blocks(x, bits, block_size, scales, data),
        )
        .map_err(|e| match e {
            QuantError::NonFinite { index, value } => QuantError::NonFinite {
                index: task * per + index,
                value,
            },
            e => e,
        })
    };
    let data_per = bits.data_bytes(per);
    if on_pool() {
        x.par_chunks(per)
            .zip(scales.par_chunks_mut(BLOCKS_PER_TASK))
            .zip(data.par_chunks_mut(data_per))
            .enumerate()
            .try_for_each(task)?;
    } else {
        x.chunks(per)
            .zip(scales.chunks_mut(BLOCKS_PER_TASK))
            .zip(data.chunks_mut(data_per))
            .enumerate()
            .try_for_each(task)?;
    }
    // SAFETY: every task wrote all of its blocks' scales and codes (it
    // returned Ok), and the tasks cover both vectors.
    let (scales, data) = unsafe { (assume_init(scales), assume_init(data)) };
    Ok(Quantized {
        bits,
        block_size,
        len: x.len(),
        scales,
        data,
    })
}

/// `len` values of fresh memory to be written.
fn uninit<T>(len: usize) -> Vec<MaybeUninit<T>> {
    let mut v = Vec::with_capacity(len);
    // SAFETY: `MaybeUninit` values need no initialisation.
    unsafe { v.set_len(len) };
    v
}

/// The values written into `v`.
///
/// # Safety
///
/// Every element of `v` must have been written.
unsafe fn assume_init<T>(v: Vec<MaybeUninit<T>>) -> Vec<T> {
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: same allocation, layout and length; initialised (caller).
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<T>(), v.len(), v.capacity()) }
}

/// One task of [`quantize_with`]: its index, its values, their blocks' scales
/// and codes.
type QuantizeTask<'a> = (
    usize,
    (
        (&'a [f32], &'a mut [MaybeUninit<f32>]),
        &'a mut [MaybeUninit<u8>],
    ),
);

/// Dequantizes `q` into `out` (of `q.len` values) on the fastest path.
pub fn dequantize(q: &Quantized, out: &mut [f32]) {
    dequantize_with(Path::best(), q, out)
}

/// Dequantizes `q` into `out` (of `q.len` values) on `path` (which must run here).
pub fn dequantize_with(path: Path, q: &Quantized, out: &mut [f32]) {
    assert_eq!(out.len(), q.len, "dequantize: output length");
    let per = BLOCKS_PER_TASK * q.block_size;
    let data_per = q.bits.data_bytes(per);
    let task = |((out, scales), data): ((&mut [f32], &[f32]), &[u8])| {
        path.run(
            #[inline(always)]
            || dequantize_blocks(q.bits, q.block_size, scales, data, out),
        )
    };
    if on_pool() {
        out.par_chunks_mut(per)
            .zip(q.scales.par_chunks(BLOCKS_PER_TASK))
            .zip(q.data.par_chunks(data_per))
            .for_each(task);
    } else {
        out.chunks_mut(per)
            .zip(q.scales.chunks(BLOCKS_PER_TASK))
            .zip(q.data.chunks(data_per))
            .for_each(task);
    }
}

/// Whether this thread is one of a rayon pool's workers, where the blocks are
/// spread over the pool. Any other thread (a communicator's, which the
/// training thread on the pool may be waiting for) quantizes alone: were it to
/// hand blocks to the pool, it could wait for workers that all wait for it.
fn on_pool() -> bool {
    rayon::current_thread_index().is_some()
}

/// The scale of a block whose largest magnitude is `amax` (0 for a zero
/// block): about `amax / qmax`, nudged so that `amax` rounds to a code of at
/// most `qmax` and `qmax · s` stays finite.
fn scale_for(amax: f32, qmax: f32) -> f32 {
    if amax == 0.0 {
        return 0.0;
    }
    // A subnormal amax can make amax / qmax round to 0, or far enough down
    // that amax rounds to a code above qmax: step up until it does not.
    let mut s = (amax / qmax).max(f32::from_bits(1));
    while (amax / s).round_ties_even() > qmax {
        s = s.next_up();
    }
    // Near f32::MAX, a scale rounded up would bring the largest code back
    // as infinity; one step down still rounds amax to qmax.
    if (qmax * s).is_infinite() {
        s = s.next_down();
    }
    s
}

/// 1.5 · 2^23: adding it to an f32 of magnitude below 2^22 rounds it to an
/// integer (half to even, as `round_ties_even`), which then sits in the low
/// mantissa bits in two's complement. Unlike a float-to-int cast, which Rust
/// saturates, this compiles to one vector add.
const ROUNDER: f32 = 12_582_912.0;

#[inline(always)]
fn to_code(v: f32, s: f32) -> u8 {
    // |v| <= amax, which rounds to at most qmax <= 127: the low byte is the code.
    (v / s + ROUNDER).to_bits() as u8
}

/// Values of a block coded between prefetches of the next block: 128, two
/// KiB of them ahead of what the codes read.
const PREFETCH_RUN: usize = 128;

/// Asks for the cache lines of `values[range]` (what of it there is).
#[inline(always)]
fn prefetch(values: &[f32], range: std::ops::Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    {
        let end = range.end.min(values.len());
        for i in (range.start..end).step_by(16) {
            // SAFETY: a prefetch of an address inside `values`; it reads
            // nothing and cannot fault.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    values.as_ptr().add(i).cast(),
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (values, range);
}

/// Codes and scales of `x`'s blocks, written into `scales` and `data`
/// (every element of both, unless a non-finite value stops it).
#[inline(always)]
fn quantize_blocks(
    x: &[f32],
    bits: Bits,
    block_size: usize,
    scales: &mut [MaybeUninit<f32>],
    data: &mut [MaybeUninit<u8>],
) -> Result<(), QuantError> {
    let blocks = x.chunks(block_size).zip(scales.iter_mut());
    for (b, ((block, scale), out)) in blocks
        .zip(data.chunks_mut(bits.data_bytes(block_size)))
        .enumerate()
    {
        let next = x.get((b + 1) * block_size..).unwrap_or_default();
        let next = &next[..next.len().min(block_size)];
        // On the bits, |x| orders like its value, and NaN and ±inf are the
        // patterns at or above +inf's: one integer max finds both.
        let amax = block
            .iter()
            .fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
        if amax >= f32::INFINITY.to_bits() {
            let i = block.iter().position(|v| !v.is_finite()).unwrap_or(0);
            return Err(QuantError::NonFinite {
                index: b * block_size + i,
                value: block[i],
            });
        }
        let s = scale_for(f32::from_bits(amax), bits.qmax());
        scale.write(s);
        if s == 0.0 {
            out.fill(MaybeUninit::new(0));
            continue;
        }
        // The codes in runs of PREFETCH_RUN values, each run asking for
        // as many of the next block's values as it codes: a block's largest
        // magnitude is found at memory's pace, then its codes from L1 at
        // the divider's, one after the other, for the hardware prefetchers
        // stop at the block's end; this overlaps the two. On one thread of
        // a Sapphire Rapids the loops ran 1.40-1.42x as fast (int8, old
        // and new alternated call by call in one process, the same bits).
        let runs = block.chunks(PREFETCH_RUN).enumerate();
        match bits {
            Bits::Int8 => {
                for ((r, run), out) in runs.zip(out.chunks_mut(PREFETCH_RUN)) {
                    prefetch(next, r * PREFETCH_RUN..(r + 1) * PREFETCH_RUN);
                    for (o, &v) in out.iter_mut().zip(run) {
                        o.write(to_code(v, s));
                    }
                }
            }
            Bits::Int4 => {
                for ((r, run), out) in runs.zip(out.chunks_mut(PREFETCH_RUN / 2)) {
                    prefetch(next, r * PREFETCH_RUN..(r + 1) * PREFETCH_RUN);
                    let pairs = run.chunks_exact(2);
                    let odd = pairs.remainder();
                    for (o, p) in out.iter_mut().zip(pairs) {
                        o.write((to_code(p[0], s) & 0x0f) | (to_code(p[1], s) << 4));
                    }
                    if let [v] = odd {
                        out[run.len() / 2].write(to_code(*v, s) & 0x0f);
                    }
                }
            }
        }
    }
    Ok(())
}

#[inline(always)]
fn dequantize_blocks(bits: Bits, block_size: usize, scales: &[f32], data: &[u8], out: &mut [f32]) {
    let blocks = out.chunks_mut(block_size).zip(scales);
    for ((out, &s), d) in blocks.zip(data.chunks(bits.data_bytes(block_size))) {
        match bits {
            Bits::Int8 => {
                for (o, &q) in out.iter_mut().zip(d) {
                    *o = f32::from(q as i8) * s;
                }
            }
            Bits::Int4 => {
                // The nibble's sign bit moved to the byte's, then shifted back.
                let low = |q: u8| f32::from(((q << 4) as i8) >> 4) * s;
                let high = |q: u8| f32::from((q as i8) >> 4) * s;
                let n = out.len();
                let mut pairs = out.chunks_exact_mut(2);
                for (o, &q) in (&mut pairs).zip(d) {
                    o[0] = low(q);
                    o[1] = high(q);
                }
                if let [o] = pairs.into_remainder() {
                    *o = low(d[n / 2]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
