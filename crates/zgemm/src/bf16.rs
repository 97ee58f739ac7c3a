//! bf16 products with f32 accumulation: `C = start ⊕ α·bf16(A)·bf16(B)`, the
//! GEMM of mixed-precision training (PyTorch's autocast rounds a matmul's
//! inputs to bf16 the same way and accumulates in f32).
//!
//! An operand is f32 values, rounded to bf16 (to nearest even) as it is laid
//! out, or bf16 values (`MatRef<u16>`, their bits: an activation that its
//! producer wrote in bf16, half the bytes to read and nothing to round),
//! laid out the way AMX's `tdpbf16ps` and AVX512_BF16's
//! `vdpbf16ps` read them: each 4-byte element a pair of bf16 values adjacent
//! in `k`. `A` becomes a row-major `m × ⌈k/2⌉` matrix of pairs in one pass
//! (read in place by the kernels); `B` is a `⌈k/2⌉ × n` one, which the
//! driver rounds as it packs its panels where `B` is row-major (a second
//! pass over a paired copy cost up to a sixth of a weight gradient's time).
//! The f32 driver multiplies them with a kernel that takes each element for
//! a pair: its blocking, threads and epilogues (bias, residual) are the f32
//! product's. A weight that is already bf16 (the working copy of
//! `train.dtype: bf16`) is rounded exactly.
//!
//! **Results.** The AVX512_BF16 kernel adds each pair odd value first, as
//! Intel's manual defines `vdpbf16ps`; the portable kernel does that
//! arithmetic in plain Rust and is tested against it bit for bit. AMX sums
//! inside a tile in an order of its own, so its results are tested against
//! an f64 product of the rounded operands within the f32 rounding bound,
//! and against themselves at every thread count (bit for bit: threads split
//! only `M` and `N`). On a CPU with neither, the portable kernel is the only
//! one, and slow: callers check [`has_native_bf16`] and multiply in f32
//! there.
//!
//! **Depth splits.** With α = 1 and no residual, AMX's tiles start in their
//! tile registers from C (or the bias) and are stored back, and the
//! AVX512_BF16 and portable kernels start their registers from C's values
//! as the f32 kernels do (`vdpbf16ps` reads them with denormals as zero),
//! so a product cut in depth at multiples of 32 into products that add
//! into C ([`Start::Keep`]) gives the bits of the one product: a caller
//! that must add in fixed chunks (a linear layer's input gradient, tiled
//! or not) can make one product of them with any bf16 kernel.

use std::cell::RefCell;

use rayon::prelude::*;

use crate::{aligned, drive, Kernel, MatMut, MatRef, Packs, Rounded, SendPtr, ShapeError, Start};

// Pairs are written as 16-bit halves where the even value is the low half.
#[cfg(target_endian = "big")]
compile_error!("zgemm's bf16 pairs assume a little-endian CPU");

/// Whether this CPU multiplies bf16 faster than f32: AMX-BF16, or
/// AVX512_BF16 on AMD's cores, where `vdpbf16ps` retires at
/// `vfmadd231ps`'s rate with twice its FLOPs (a 2-core Zen 4 guest,
/// `zrun bench kernels`: the AVX512_BF16 kernel 1.6-1.9x the AVX-512 f32
/// kernel on the model's shapes, one thread). On Intel's cores without AMX
/// it does not: on the Sapphire Rapids measured, `vdpbf16ps` retires one
/// every two cycles, half `vfmadd231ps`'s FLOPs. Every bf16 kernel splits
/// in depth exactly (module doc).
pub fn has_native_bf16() -> bool {
    match Kernel::best_bf16() {
        Kernel::AmxBf16 => true,
        Kernel::Avx512Bf16 => amd_cpu(),
        _ => false,
    }
}

/// Whether CPUID's vendor string is AMD's.
fn amd_cpu() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // "AuthenticAMD" in EBX, EDX, ECX.
        let id = std::arch::x86_64::__cpuid(0);
        [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes) == [*b"Auth", *b"enti", *b"cAMD"]
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The row stride, in values, at which a producer should lay out bf16 rows
/// of `cols` values for [`gemm_bf16`] to read them in place (see
/// `pairs_in_place`): whole 64-byte lines, and not a multiple of 512 bytes
/// (1536 columns become 1568). The rows must also start on a 64-byte line
/// ([`bf16_line_start`]).
pub fn bf16_row_stride(cols: usize) -> usize {
    let stride = cols.div_ceil(32) * 32;
    if (2 * stride).is_multiple_of(512) {
        stride + 32
    } else {
        stride
    }
}

/// The first index of `v` at a 64-byte boundary (under 32): where a
/// producer starts its bf16 rows in a buffer 32 values longer than they
/// need.
pub fn bf16_line_start<T>(v: &[T]) -> usize {
    v.as_ptr().align_offset(64).min(v.len())
}

/// What a bf16 product's operand holds: f32 values (rounded as they are
/// laid out) or `u16`, bf16 values as their bits (taken as they are).
pub trait Bf16Operand: Copy + Default + Send + Sync + sealed::Sealed {
    /// The bf16 bits of this value, in the low half.
    fn bits(self) -> u32;

    /// `dst[j]` = the bits of `src[j]`.
    fn bits_into(src: &[Self], dst: &mut [u16]);

    /// The row-major matrix `m` as what the driver packs pairs of rows from.
    fn rows_of(m: MatRef<Self>) -> RowSource;

    /// `m` read in place as the matrix of pairs along its rows that
    /// `pair_columns` would write, where its layout already is that.
    fn pairs_in_place(_m: MatRef<Self>) -> Option<MatRef<f32>> {
        None
    }

    /// `m` read in place as pairs along its rows for the driver to pack
    /// `B`'s panels from ([`Bf16Operand::pairs_in_place`] without what only
    /// a kernel reading `A` in place needs: whole 32-row tiles, cache-line
    /// rows, rows spread over L1's sets).
    fn pairs_to_pack(_m: MatRef<Self>) -> Option<MatRef<f32>> {
        None
    }

    /// The bits of the 16 values from `p`, each in the low half of its lane.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F and BW, and 16 values from `p` are readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn bits16(p: *const Self) -> std::arch::x86_64::__m512i;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u16 {}
}

impl Bf16Operand for f32 {
    #[inline(always)]
    fn bits(self) -> u32 {
        round(self)
    }

    fn bits_into(src: &[f32], dst: &mut [u16]) {
        bf16_bits_into(src, dst);
    }

    fn rows_of(m: MatRef<f32>) -> RowSource {
        RowSource::F32(m)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn bits16(p: *const f32) -> std::arch::x86_64::__m512i {
        // SAFETY: AVX-512F present, 16 floats readable (caller).
        unsafe { x86::round16(std::arch::x86_64::_mm512_loadu_ps(p)) }
    }
}

impl Bf16Operand for u16 {
    #[inline(always)]
    fn bits(self) -> u32 {
        u32::from(self)
    }

    fn bits_into(src: &[u16], dst: &mut [u16]) {
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
    }

    fn rows_of(m: MatRef<u16>) -> RowSource {
        RowSource::Bf16(m)
    }

    /// Row-major bf16 values are pairs along their rows already: read in
    /// place where the rows are whole steps of 16 pairs, whole 32-row
    /// tiles, each row starting a cache line (a tile row of 64 bytes across
    /// two lines is two loads: AMX's kernel ran 6% slower reading an
    /// activation from the heap's 16-byte-aligned memory than from the
    /// aligned copy), and spread over L1's sets (rows a multiple of 512
    /// bytes apart put a tile's 16 rows in 8 sets or fewer; see
    /// `pair_columns`). Elsewhere the copy is a plain one, no rounding.
    fn pairs_in_place(m: MatRef<u16>) -> Option<MatRef<f32>> {
        let fits = m.rows.is_multiple_of(32)
            && (2 * m.rs).is_multiple_of(64)
            && !(2 * m.rs).is_multiple_of(512)
            && m.data.as_ptr().align_offset(64) == 0;
        fits.then(|| Self::pairs_to_pack(m)).flatten()
    }

    /// Row-major bf16 values whose rows are whole steps of 16 pairs, each
    /// starting a pair: a weight stored `[out, in]` in bf16 (a tied head's
    /// token table, `B` transposed in the logits' product), read where it
    /// lies. Its paired copy (`pair_columns`, kept between products) was
    /// `vocab × d × 2` bytes more for as long as the thread lived: 29 MB at
    /// GPT-2's vocabulary and d 256, 321 MB at Qwen3's and d 1024.
    fn pairs_to_pack(m: MatRef<u16>) -> Option<MatRef<f32>> {
        let fits = m.cs == 1
            && m.cols.is_multiple_of(32)
            && m.rs.is_multiple_of(2)
            && m.data.as_ptr().align_offset(4) == 0;
        fits.then(|| {
            // SAFETY: 4-byte aligned (checked), and the floats cover the
            // first even number of halves of `data`.
            let data = unsafe {
                std::slice::from_raw_parts(m.data.as_ptr().cast::<f32>(), m.data.len() / 2)
            };
            MatRef {
                data,
                rows: m.rows,
                cols: m.cols / 2,
                rs: m.rs / 2,
                cs: 1,
            }
        })
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn bits16(p: *const u16) -> std::arch::x86_64::__m512i {
        use std::arch::x86_64::*;
        // SAFETY: AVX-512F present, 16 halves readable (caller).
        unsafe { _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())) }
    }
}

/// A row-major `B` whose rows the driver pairs as it packs them
/// ([`Packs::RowPairs`]).
#[derive(Clone, Copy)]
pub enum RowSource<'a> {
    /// f32 values, rounded as they are packed.
    F32(MatRef<'a>),
    /// bf16 values as their bits.
    Bf16(MatRef<'a, u16>),
}

impl RowSource<'_> {
    /// Columns.
    pub(crate) fn cols(&self) -> usize {
        match self {
            RowSource::F32(m) => m.cols,
            RowSource::Bf16(m) => m.cols,
        }
    }
}

/// `C = start ⊕ α·bf16(A)·bf16(B)` with the fastest bf16 kernel, on up to
/// `threads` threads of the current rayon pool.
pub fn gemm_bf16<A: Bf16Operand, B: Bf16Operand>(
    c: MatMut,
    a: MatRef<A>,
    b: MatRef<B>,
    alpha: f32,
    start: Start,
    threads: usize,
) -> Result<(), ShapeError> {
    gemm_bf16_with(Kernel::best_bf16(), c, a, b, alpha, start, threads)
}

/// [`gemm_bf16`] with a given bf16 kernel (tests and benchmarks compare them).
///
/// # Panics
///
/// If `kernel` is not in [`Kernel::available_bf16`].
pub fn gemm_bf16_with<A: Bf16Operand, B: Bf16Operand>(
    kernel: Kernel,
    c: MatMut,
    a: MatRef<A>,
    b: MatRef<B>,
    alpha: f32,
    start: Start,
    threads: usize,
) -> Result<(), ShapeError> {
    assert_runs_here(kernel);
    if a.rows != c.rows || a.cols != b.rows || b.cols != c.cols {
        return Err(ShapeError::mismatch(&c, &a, b.rows, b.cols));
    }
    multiply(kernel, c, a, b, alpha, start, threads, None)
}

/// Panics unless `kernel` is a bf16 kernel this CPU runs.
fn assert_runs_here(kernel: Kernel) {
    assert!(
        Kernel::detected_bf16().contains(&kernel),
        "{kernel:?} is not a bf16 kernel this CPU can run"
    );
}

/// `C = start ⊕ α·A·bf16(B)` where `A` is given as pairs already: an
/// `m × kp` matrix whose element `(i, q)` holds `A`'s values `(i, 2q)` and
/// `(i, 2q + 1)` as bf16 bits (the even one in the low half), as
/// [`pair_rows_both_ways`] writes them. `B` has at most `2·kp` rows; the
/// pairs past them must be zeros. `kp` must be a multiple of 16 and, where
/// the pairs' rows are contiguous, `m` a multiple of 32 with the pairs'
/// memory readable that far (AMX reads 16 pairs of 32 rows at a time, as
/// `gemm_bf16`'s own paired copies are laid out). The bits are
/// [`gemm_bf16`]'s with `A`'s f32 values: a producer that pairs its output
/// as it writes it saves the product a pass over `A` (and a buffer of it).
pub fn gemm_bf16_pairs<B: Bf16Operand>(
    c: MatMut,
    a: MatRef<f32>,
    b: MatRef<B>,
    alpha: f32,
    start: Start,
    threads: usize,
) -> Result<(), ShapeError> {
    gemm_bf16_pairs_with(Kernel::best_bf16(), c, a, b, alpha, start, threads)
}

/// [`gemm_bf16_pairs`] with a given bf16 kernel.
///
/// # Panics
///
/// If `kernel` is not in [`Kernel::available_bf16`].
pub fn gemm_bf16_pairs_with<B: Bf16Operand>(
    kernel: Kernel,
    c: MatMut,
    a: MatRef<f32>,
    b: MatRef<B>,
    alpha: f32,
    start: Start,
    threads: usize,
) -> Result<(), ShapeError> {
    assert_runs_here(kernel);
    let unpadded = !a.cols.is_multiple_of(16) || (a.cs == 1 && !a.rows.is_multiple_of(32));
    // A `B` not row-major is paired whole: its pairs must be `A`'s depth.
    let deep = b.cs == 1 || padded_pairs(b.rows) == a.cols;
    if a.rows != c.rows || b.rows > 2 * a.cols || b.cols != c.cols || unpadded || !deep {
        return Err(ShapeError::mismatch(&c, &a, b.rows, b.cols));
    }
    let mut pa = PAIRS_A.take();
    // AMX reads `A`'s pairs in place, row by row: pairs given by column are
    // copied into rows first.
    let a2 = match kernel == Kernel::AmxBf16 && a.cs != 1 {
        true => pairs_into_rows(a, &mut pa),
        false => a,
    };
    let result = multiply_pairs(kernel, c, a2, b, alpha, start, threads, None);
    PAIRS_A.set(pa);
    result
}

/// The pairs matrix `a` copied into `buf` row by row, its rows padded to a
/// multiple of 32 with zero pairs (the layout `pair_columns` writes).
pub(crate) fn pairs_into_rows<'b>(a: MatRef<f32>, buf: &'b mut Vec<f32>) -> MatRef<'b> {
    let (rows, stride) = (a.rows.div_ceil(32) * 32, a.cols + 16);
    let out = aligned(buf, rows * stride);
    for (i, row) in out.chunks_exact_mut(stride).enumerate() {
        for (q, v) in row.iter_mut().enumerate() {
            *v = if i < a.rows && q < a.cols {
                a.at(i, q)
            } else {
                0.0
            };
        }
    }
    MatRef {
        data: out,
        rows: a.rows,
        cols: a.cols,
        rs: stride,
        cs: 1,
    }
}

/// The product of [`gemm_bf16_with`] (shapes checked), `C` rounded as it
/// stores where `rounded` says where to.
#[allow(clippy::too_many_arguments)]
fn multiply<A: Bf16Operand, B: Bf16Operand>(
    kernel: Kernel,
    c: MatMut,
    a: MatRef<A>,
    b: MatRef<B>,
    alpha: f32,
    start: Start,
    threads: usize,
    rounded: Option<Rounded>,
) -> Result<(), ShapeError> {
    // Taken, not borrowed: rayon may run another product on this thread
    // while it waits.
    let mut pa = PAIRS_A.take();
    let a2 = pair_columns(a, &mut pa, threads);
    let result = multiply_pairs(kernel, c, a2, b, alpha, start, threads, rounded);
    PAIRS_A.set(pa);
    result
}

/// [`multiply`] of `A` paired already (`a2`).
#[allow(clippy::too_many_arguments)]
fn multiply_pairs<B: Bf16Operand>(
    kernel: Kernel,
    c: MatMut,
    a2: MatRef<f32>,
    b: MatRef<B>,
    alpha: f32,
    start: Start,
    threads: usize,
    rounded: Option<Rounded>,
) -> Result<(), ShapeError> {
    let mut pb = PAIRS_B.take();
    let result = {
        // A row-major B is rounded as the driver packs it; any other
        // through a paired copy of its transpose.
        let b2 = if b.cs == 1 {
            Packs::RowPairs {
                of: B::rows_of(b),
                rows: a2.cols,
            }
        } else {
            let pairs = B::pairs_to_pack(b.t());
            Packs::Values(
                pairs
                    .unwrap_or_else(|| pair_columns(b.t(), &mut pb, threads))
                    .t(),
            )
        };
        drive(
            kernel, c, a2, b2, alpha, start, threads, None, rounded, None,
        )
    };
    PAIRS_B.set(pb);
    result
}

/// The output of [`gemm_bf16_rounded`]: `rows × cols` bf16 values (their
/// bits) at row stride `rs`, columns adjacent, over memory that the product
/// writes whole.
#[derive(Debug)]
pub struct BitsMut<'a> {
    ptr: *mut u16,
    rows: usize,
    cols: usize,
    rs: usize,
    _data: std::marker::PhantomData<&'a mut [u16]>,
}

impl<'a> BitsMut<'a> {
    /// A view with row stride `rs`, checked against `data`.
    pub fn new(
        data: &'a mut [std::mem::MaybeUninit<u16>],
        rows: usize,
        cols: usize,
        rs: usize,
    ) -> Result<BitsMut<'a>, ShapeError> {
        crate::fits(rows, cols, rs, data.len())?;
        Ok(BitsMut {
            ptr: data.as_mut_ptr().cast(),
            rows,
            cols,
            rs,
            _data: std::marker::PhantomData,
        })
    }

    /// Row `i`'s `cols` values, not yet written.
    fn row(&mut self, i: usize) -> &mut [std::mem::MaybeUninit<u16>] {
        // SAFETY: row i < rows of the checked view, which this borrows.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * self.rs).cast(), self.cols) }
    }
}

/// `C = bias + bf16(A)·bf16(B)` (without a bias, `bf16(A)·bf16(B)`) with the
/// fastest bf16 kernel, stored rounded to bf16: the bits of
/// [`bf16_bits_into`] of [`gemm_bf16`]'s f32 `C`, for a product whose every
/// reader would round it anyway (attention's q, k and v). Each tile is
/// rounded from L1 as it is finished: half the bytes of an f32 `C` to
/// write, no read for ownership of them, and no pass of its own to round.
/// A product deeper than one block of depth (`k` over 768) makes its f32
/// `C` first, then rounds it.
pub fn gemm_bf16_rounded<A: Bf16Operand, B: Bf16Operand>(
    c: BitsMut,
    a: MatRef<A>,
    b: MatRef<B>,
    bias: Option<&[f32]>,
    threads: usize,
) -> Result<(), ShapeError> {
    gemm_bf16_rounded_with(Kernel::best_bf16(), c, a, b, bias, threads)
}

/// [`gemm_bf16_rounded`] with a given bf16 kernel.
///
/// # Panics
///
/// If `kernel` is not in [`Kernel::available_bf16`].
pub fn gemm_bf16_rounded_with<A: Bf16Operand, B: Bf16Operand>(
    kernel: Kernel,
    mut c: BitsMut,
    a: MatRef<A>,
    b: MatRef<B>,
    bias: Option<&[f32]>,
    threads: usize,
) -> Result<(), ShapeError> {
    let start = bias.map_or(Start::Zero, Start::Bias);
    let (m, n) = (c.rows, c.cols);
    if a.cols.div_ceil(2) > crate::KC || m == 0 || n == 0 || a.cols == 0 {
        // Deep (or empty): the f32 product, then its rounding.
        let mut f = vec![0f32; m * n];
        gemm_bf16_with(
            kernel,
            MatMut::row_major(&mut f, m, n)?,
            a,
            b,
            1.0,
            start,
            threads,
        )?;
        for (i, row) in f.chunks_exact(n.max(1)).take(m).enumerate() {
            bf16_bits_write(row, c.row(i));
        }
        return Ok(());
    }
    assert_runs_here(kernel);
    // The f32 `C` the driver checks shapes against is never written: every
    // tile goes to its scratch and is stored rounded.
    // SAFETY: the view is never read or written (`rounded` is given) and
    // has C's shape at a stride that fits it.
    let shape =
        unsafe { MatMut::from_raw(std::ptr::NonNull::dangling().as_ptr(), m, n, n, false)? };
    if a.rows != m || a.cols != b.rows || b.cols != n {
        return Err(ShapeError::mismatch(&shape, &a, b.rows, b.cols));
    }
    let out = Rounded {
        ptr: c.ptr,
        rs: c.rs,
    };
    multiply(kernel, shape, a, b, 1.0, start, threads, Some(out))
}

/// Runs `f` on the calling thread's buffer for paired `A`s (taken for the
/// call: rayon may run another product on this thread while it waits).
pub(crate) fn with_pairs<R>(f: impl FnOnce(&mut Vec<f32>) -> R) -> R {
    let mut buf = PAIRS_A.take();
    let r = f(&mut buf);
    PAIRS_A.set(buf);
    r
}

thread_local! {
    /// The calling thread's paired operands, reused from call to call.
    static PAIRS_A: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static PAIRS_B: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// bf16 bits of `x`, rounded to nearest even, NaN kept a quiet NaN (as
/// `half::bf16::from_f32`); branch-free, so that the loops vectorise.
#[inline(always)]
pub(crate) fn round(x: f32) -> u32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    if x.is_nan() {
        (b >> 16) | 0x40
    } else {
        rounded
    }
}

/// The exact f32 value of bf16 bits `b` (what [`bf16_bits`] rounded to),
/// in loops that the compiler vectorises.
#[inline(always)]
pub fn bf16_value(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// `x` rounded to bf16 as every f32 operand of [`gemm_bf16`] is: for a
/// producer that writes its output in bf16 for bf16 products to read
/// (`MatRef<u16>`), which then multiply exactly as they would the f32.
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    round(x) as u16
}

/// Two values' bf16 bits as one pair element: `lo` is the one of even `k`.
#[inline(always)]
fn pair(lo: u32, hi: u32) -> f32 {
    f32::from_bits(lo | (hi << 16))
}

/// `x` (`r × k`) as a row-major `r × kp` matrix of pairs along its rows,
/// written into `buf`: `kp` is `⌈k/2⌉` rounded up to a multiple of 16 and
/// the rows to a multiple of 32, the padding zero (AMX's kernel reads
/// 16 pairs of 32 whole rows at a time; zero pairs add `+0`, which every
/// kernel does alike). Each task fills a run of output rows, reading along
/// `x`'s rows where they are contiguous and along its columns where those
/// are.
pub(crate) fn pair_columns<'b, T: Bf16Operand>(
    x: MatRef<'b, T>,
    buf: &'b mut Vec<f32>,
    threads: usize,
) -> MatRef<'b> {
    if let Some(pairs) = T::pairs_in_place(x) {
        return pairs;
    }
    let (r, k) = (x.rows, x.cols);
    let kp = padded_pairs(k);
    let rows = r.div_ceil(32) * 32;
    // Rows 16 pairs longer than they need be: at a multiple of 4 KiB apart,
    // the 16 rows of an AMX tile load shared one L1 set (measured: k = 2048
    // ran at half the rate of k = 384).
    let stride = kp + 16;
    let out = aligned(buf, rows * stride);
    if x.rs == 1 && x.cs != 1 {
        pair_transposed(x, out, stride, kp, threads);
    } else {
        // A pair is two values adjacent in a row: an output row is the
        // input row rounded, value by value, as 16-bit halves (the even
        // value in the low half: little-endian).
        let rows_per_task = (16 * 1024 / stride).max(1);
        let fill = |(t, dst): (usize, &mut [f32])| {
            for (l, row) in dst.chunks_exact_mut(stride).enumerate() {
                let i = t * rows_per_task + l;
                // SAFETY: 2·kp halves are the row's first kp floats
                // (u16 needs less alignment than f32).
                let halves = unsafe {
                    std::slice::from_raw_parts_mut(row.as_mut_ptr().cast::<u16>(), 2 * kp)
                };
                if i < r && x.cs == 1 {
                    T::bits_into(&x.data[i * x.rs..][..k], &mut halves[..k]);
                    halves[k..].fill(0);
                } else if i < r {
                    for (p, h) in halves.iter_mut().enumerate() {
                        *h = if p < k { x.at(i, p).bits() as u16 } else { 0 };
                    }
                } else {
                    halves.fill(0);
                }
            }
        };
        if threads > 1 {
            out.par_chunks_mut(rows_per_task * stride)
                .enumerate()
                .for_each(fill);
        } else {
            out.chunks_mut(rows_per_task * stride)
                .enumerate()
                .for_each(fill);
        }
    }
    MatRef {
        data: out,
        rows: r,
        cols: kp,
        rs: stride,
        cs: 1,
    }
}

/// [`pair_columns`] of an `x` whose columns are contiguous (`xᵀ` in a weight
/// gradient), into `out` (whole padded rows of `stride`): each task takes 16
/// pairs of columns, that is 32 contiguous runs of memory, and writes a
/// 64-byte block of every output row. Tasks over runs of output rows
/// instead re-read every row of `x` for each run, twice the bytes of `x`
/// from L3 (measured: a fifth of a bf16 training step). With AVX-512 a task
/// pairs 16 rows of its 16 columns in registers and transposes them there,
/// so that it writes whole 64-byte blocks instead of 4-byte pieces.
fn pair_transposed<T: Bf16Operand>(
    x: MatRef<T>,
    out: &mut [f32],
    stride: usize,
    kp: usize,
    threads: usize,
) {
    let (r, k) = (x.rows, x.cols);
    let rows = out.len() / stride;
    let at = SendPtr(out.as_mut_ptr());
    // The columns past k (the last block's, when k is not a multiple of
    // 32) read as zeros: every block then pairs 32 whole columns, with no
    // branch in its loop.
    let zeros = vec![T::default(); if k.is_multiple_of(32) { 0 } else { r }];
    let block = |b: usize| {
        let column = |p: usize| {
            if p < k {
                &x.data[p * x.cs..][..r]
            } else {
                &zeros[..]
            }
        };
        let columns: [&[T]; 32] = std::array::from_fn(|l| column(32 * b + l));
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if has_avx512bw() {
            // SAFETY: AVX-512F/BW present; the columns hold r values, and
            // pairs b·16..b·16+16 of rows below r are inside `out` (q < kp
            // ≤ stride) and this task's alone.
            done = unsafe { x86::pair_block_transposed(&columns, r, at.get().add(16 * b), stride) };
        }
        for (l, pairs) in columns.chunks_exact(2).enumerate() {
            let q = 16 * b + l;
            for i in done..rows {
                let v = |c: &[T]| c.get(i).map_or(0, |v| v.bits());
                // SAFETY: row i < rows, pair q < kp ≤ stride: inside
                // `out`, and this task alone writes pairs b·16..b·16+16.
                unsafe {
                    at.get()
                        .add(i * stride + q)
                        .write(pair(v(pairs[0]), v(pairs[1])))
                };
            }
        }
    };
    if threads > 1 {
        (0..kp / 16).into_par_iter().for_each(block);
    } else {
        (0..kp / 16).for_each(block);
    }
}

/// Pairs of a depth of `k` values as `gemm_bf16` lays them out: `⌈k/2⌉`
/// rounded up to a multiple of 16 (AMX reads 16 pairs at a time; the
/// padding pairs are zeros).
pub fn padded_pairs(k: usize) -> usize {
    k.div_ceil(2).div_ceil(16) * 16
}

/// The row stride, in floats, of rows that [`pair_rows_both_ways`] pairs in
/// place for `cols` values: whole steps of 64 values, so that each half
/// row holds whole steps of 16 pairs, and not a multiple of 512 bytes, so
/// that a kernel reading 16 rows of pairs in place spreads them over L1's
/// sets (`bf16_row_stride`'s reasons).
pub fn pairs_row_stride(cols: usize) -> usize {
    let stride = cols.div_ceil(64) * 64;
    match stride.is_multiple_of(128) {
        true => stride + 64,
        false => stride,
    }
}

/// Rounds two rows of f32 values (`rows`: the first `cols` values of each
/// of its two rows, `stride` apart; `stride` from [`pairs_row_stride`])
/// to bf16 and writes them back in place as the pairs that products with
/// either layout read ([`gemm_bf16_pairs`]), each with the bits
/// `gemm_bf16` would have paired the f32 values into:
///
/// - **along**: each row's first `⌈cols/2⌉` floats (then zero pairs to a
///   multiple of 16) are its pairs `(x[2q], x[2q + 1])`: the rows of the
///   two-row matrix as `A` (`m × kp`, row stride `stride`);
/// - **across**: the pairs `(x₀[j], x₁[j])` of the two rows' values,
///   `j < stride/2` at `rows[stride/2 + j]` and the rest at `rows[stride +
///   j]`: row `j` of the matrix's transpose as `A`, its depth the two rows
///   (cut at `stride/2` into two matrices of rows `1` apart, a pair of rows
///   `2·stride` apart from the next).
///
/// A loss that makes its gradient in place (the head's logits) pairs it so
/// for both of its products, with no paired copy of its own. `scratch`
/// holds the rows' values while they are rewritten.
///
/// # Panics
///
/// If `stride` is not a multiple of 64, `cols` is over it, or `rows`
/// holds fewer than two rows.
pub fn pair_rows_both_ways(rows: &mut [f32], stride: usize, cols: usize, scratch: &mut Vec<f32>) {
    #[cfg(target_arch = "x86_64")]
    let simd = has_avx512bw();
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    pair_rows_in(rows, stride, cols, scratch, simd);
}

/// [`pair_rows_both_ways`] with AVX-512 (`simd`, where the CPU has it) or
/// without (tests run both).
pub(crate) fn pair_rows_in(
    rows: &mut [f32],
    stride: usize,
    cols: usize,
    scratch: &mut Vec<f32>,
    simd: bool,
) {
    assert!(
        stride.is_multiple_of(64) && cols <= stride && rows.len() >= 2 * stride,
        "pairing {cols} values of two rows {stride} apart in {} floats",
        rows.len()
    );
    let half = stride / 2;
    #[cfg(target_arch = "x86_64")]
    if simd && has_avx512bw() {
        // Only row 0's values past `half` are written over (by the pairs
        // across) before they are read: those alone are copied.
        scratch.clear();
        scratch.extend_from_slice(&rows[half.min(cols)..cols]);
        // SAFETY: AVX-512F/BW present; `rows` holds two rows of `stride`
        // floats (asserted), `scratch` row 0's values from `half` on.
        return unsafe { x86::pair_rows_both_ways(rows, stride, cols, scratch) };
    }
    let _ = simd;
    let width = cols.div_ceil(32) * 32;
    scratch.clear();
    scratch.resize(2 * width, 0.0);
    let (x0, x1) = scratch.split_at_mut(width);
    x0[..cols].copy_from_slice(&rows[..cols]);
    x1[..cols].copy_from_slice(&rows[stride..stride + cols]);
    let (x0, x1) = (&*x0, &*x1);
    let (r0, r1) = rows.split_at_mut(stride);
    for q in 0..width / 2 {
        r0[q] = pair(round(x0[2 * q]), round(x0[2 * q + 1]));
        r1[q] = pair(round(x1[2 * q]), round(x1[2 * q + 1]));
    }
    for j in 0..width {
        let across = pair(round(x0[j]), round(x1[j]));
        match j < half {
            true => r0[half + j] = across,
            false => r1[j] = across,
        }
    }
}

/// Packs pair rows `q0..q0+kc` of the row-major `b`, columns `j0..j1`,
/// into panels of `nr` columns (`dst`, `kc × nr` each, zero right of `j1`):
/// pair row `q` is `b`'s rows `2q` and `2q + 1` rounded and interleaved
/// ([`Packs::RowPairs`]), read along memory.
pub(crate) fn pack_row_pairs<T: Bf16Operand>(
    b: &MatRef<T>,
    q0: usize,
    kc: usize,
    j0: usize,
    j1: usize,
    nr: usize,
    dst: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if pack_whole_row_pairs(b, q0, kc, j0, j1, nr, dst) {
        return;
    }
    let mut panels: Vec<(&mut [f32], usize)> =
        dst.chunks_mut(nr * kc).zip((j0..j1).step_by(nr)).collect();
    for (d, j) in panels.iter_mut() {
        if j1 - *j < nr {
            d.fill(0.0);
        }
    }
    let row = |p: usize| (p < b.rows).then(|| &b.data[p * b.rs..][..b.cols]);
    for q in 0..kc {
        let (r0, r1) = (row(2 * (q0 + q)), row(2 * (q0 + q) + 1));
        for (d, j) in panels.iter_mut() {
            let cols = nr.min(j1 - *j);
            let out = &mut d[q * nr..q * nr + cols];
            match r0 {
                Some(r0) => pair_into(&r0[*j..*j + cols], r1.map(|r| &r[*j..*j + cols]), out),
                None => out.fill(0.0),
            }
        }
    }
}

/// [`pack_row_pairs`] with AVX-512, a pair of rows into all of its panels
/// in one call; `false`, with nothing written, where the CPU lacks AVX-512
/// or the panels or the block are not a multiple of 16 columns wide. A
/// call for each panel's 32 columns (two vectors of work) held the bf16
/// products back by 1-9% (Sapphire Rapids, bf16 operands, alternated call
/// by call with it on the model's shapes: medians 1.01-1.09x at one
/// thread, 0.97-1.44x at two, the same bits).
#[cfg(target_arch = "x86_64")]
fn pack_whole_row_pairs<T: Bf16Operand>(
    b: &MatRef<T>,
    q0: usize,
    kc: usize,
    j0: usize,
    j1: usize,
    nr: usize,
    dst: &mut [f32],
) -> bool {
    let (width, panel) = (j1 - j0, nr * kc);
    let panels = width.div_ceil(nr.max(1));
    if width == 0
        || !nr.is_multiple_of(16)
        || !width.is_multiple_of(16)
        || dst.len() < panels * panel
        || !has_avx512bw()
    {
        return false;
    }
    if !width.is_multiple_of(nr) {
        // The last panel's columns right of j1.
        dst[(panels - 1) * panel..panels * panel].fill(0.0);
    }
    let row = |p: usize| (p < b.rows).then(|| &b.data[p * b.rs..][..b.cols]);
    for q in 0..kc {
        match row(2 * (q0 + q)) {
            Some(r0) => {
                let r1 = row(2 * (q0 + q) + 1);
                // SAFETY: AVX-512F/BW present; both rows hold columns
                // j0..j1, a multiple of 16 of them; from q·nr, `dst` holds
                // (panels − 1)·panel + nr floats, every place that column
                // j0 + c's pair goes to (panel c / nr, row q, column c % nr).
                unsafe {
                    x86::pair_row_into_panels(
                        &r0[j0..j1],
                        r1.map(|r| &r[j0..j1]),
                        dst[q * nr..].as_mut_ptr(),
                        nr,
                        panel,
                    )
                };
            }
            None => {
                for p in 0..panels {
                    dst[p * panel + q * nr..][..nr].fill(0.0);
                }
            }
        }
    }
    true
}

/// [`bf16_bits`] of every value of `src` into `dst` (of the same length),
/// 16 at a time with AVX-512 where the CPU has it.
pub fn bf16_bits_into(src: &[f32], dst: &mut [u16]) {
    // SAFETY: `MaybeUninit<u16>` has the layout of `u16`, and
    // `bf16_bits_write` stores only initialised values.
    bf16_bits_write(src, unsafe {
        &mut *(dst as *mut [u16] as *mut [std::mem::MaybeUninit<u16>])
    });
}

/// [`bf16_bits_into`] a buffer not yet written: a producer rounds its f32
/// row straight into the bf16 rows that products read, with no row of bits
/// in between to copy.
pub fn bf16_bits_write(src: &[f32], dst: &mut [std::mem::MaybeUninit<u16>]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512bw() {
        // SAFETY: the CPU has AVX-512F and BW.
        return unsafe { x86::bf16_bits_write(src, dst) };
    }
    for (h, &v) in dst.iter_mut().zip(src) {
        h.write(round(v) as u16);
    }
}

/// [`bf16_bits_write`] of a tile's live part: `rows` rows of `cols` values
/// from `src` (rows `src_rs` apart) into `dst` (rows `dst_rs` apart).
///
/// # Safety
///
/// `src` must hold the `rows × cols` values (written) and `dst` be valid
/// for writing them, neither overlapping the other.
pub(crate) unsafe fn round_tile(
    src: *const f32,
    src_rs: usize,
    rows: usize,
    cols: usize,
    dst: *mut u16,
    dst_rs: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if cols == 32 && has_avx512bw() {
        // SAFETY: the CPU has AVX-512F and BW; the rows as the caller's.
        return unsafe { x86::round_rows_of_32(src, src_rs, rows, dst, dst_rs) };
    }
    for i in 0..rows {
        // SAFETY: row i of both (caller).
        let (s, d) = unsafe {
            (
                std::slice::from_raw_parts(src.add(i * src_rs), cols),
                std::slice::from_raw_parts_mut(dst.add(i * dst_rs).cast(), cols),
            )
        };
        bf16_bits_write(s, d);
    }
}

/// `dst[i]` = the pair of `c0[i]` and `c1[i]` (zero without `c1`).
fn pair_into<T: Bf16Operand>(c0: &[T], c1: Option<&[T]>, dst: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx512bw() {
        let n = dst.len().min(c0.len()) / 16 * 16;
        // SAFETY: AVX-512F/BW present; rows below n of dst (stride 1) are
        // inside it, and c0, c1 hold n values (same length as c0).
        done = unsafe { x86::pair_column(&c0[..n], c1.map(|c| &c[..n]), dst.as_mut_ptr()) };
    }
    for (i, d) in dst.iter_mut().enumerate().skip(done) {
        *d = pair(c0[i].bits(), c1.map_or(0, |c| c[i].bits()));
    }
}

/// Whether the CPU has AVX-512F and BW, detected once.
#[cfg(target_arch = "x86_64")]
fn has_avx512bw() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| std::arch::is_x86_feature_detected!("avx512bw"))
}

/// The rounding loops in AVX-512: the baseline build of them ran four
/// floats at a time and was a fifth of a bf16 training step.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    use super::{round, Bf16Operand};

    /// [`round`] of 16 floats, each result in the low half of its lane.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) fn round16(v: __m512) -> __m512i {
        _mm512_srli_epi32::<16>(round16_high(v))
    }

    /// [`round`] of 16 floats, each result in the high half of its lane (the
    /// low half is what the rounding left there): a quiet NaN keeps its
    /// bits with bit 6 of the high half set, every other value has the
    /// rounding bias added (`0x7fff` plus the kept half's lowest bit).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn round16_high(v: __m512) -> __m512i {
        let b = _mm512_castps_si512(v);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let rounded = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        _mm512_mask_or_epi32(rounded, nan, b, _mm512_set1_epi32(0x40 << 16))
    }

    /// [`super::bf16_bits_write`].
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn bf16_bits_write(src: &[f32], dst: &mut [MaybeUninit<u16>]) {
        let n = src.len().min(dst.len());
        // 32 values a step: each rounded in the high half of its 32 bits,
        // the high halves of two vectors gathered by one word permute into
        // one 64-byte store (a shift and a narrowing store per 16 were 0.09
        // ns a value, three instructions of eleven on the shuffle port).
        let high_halves = _mm512_set_epi16(
            63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21,
            19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
        );
        let pairs = n / 32 * 32;
        for j in (0..pairs).step_by(32) {
            // SAFETY: j + 32 ≤ n, inside both slices.
            unsafe {
                let lo = round16_high(_mm512_loadu_ps(src.as_ptr().add(j)));
                let hi = round16_high(_mm512_loadu_ps(src.as_ptr().add(j + 16)));
                let words = _mm512_permutex2var_epi16(lo, high_halves, hi);
                _mm512_storeu_si512(dst.as_mut_ptr().add(j).cast(), words);
            }
        }
        let whole = n / 16 * 16;
        for j in (pairs..whole).step_by(16) {
            // SAFETY: j + 16 ≤ n, inside both slices.
            unsafe {
                let r = round16(_mm512_loadu_ps(src.as_ptr().add(j)));
                _mm256_storeu_si256(dst.as_mut_ptr().add(j).cast(), _mm512_cvtepi32_epi16(r));
            }
        }
        for j in whole..n {
            dst[j].write(round(src[j]) as u16);
        }
    }

    /// [`super::round_tile`] of rows of 32 values: one 64-byte store a row.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F and BW; the rows as [`super::round_tile`]'s.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn round_rows_of_32(
        src: *const f32,
        src_rs: usize,
        rows: usize,
        dst: *mut u16,
        dst_rs: usize,
    ) {
        let high_halves = _mm512_set_epi16(
            63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21,
            19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
        );
        for i in 0..rows {
            // SAFETY: 32 values of row i of both (caller).
            unsafe {
                let s = src.add(i * src_rs);
                let lo = round16_high(_mm512_loadu_ps(s));
                let hi = round16_high(_mm512_loadu_ps(s.add(16)));
                let words = _mm512_permutex2var_epi16(lo, high_halves, hi);
                _mm512_storeu_si512(dst.add(i * dst_rs).cast(), words);
            }
        }
    }

    /// Pairs 16 pairs of columns (`columns[2l]` with `columns[2l + 1]`)
    /// for the rows below `rows` rounded down to 16, into
    /// `out[i·stride + l]`: 16 rows of the 16 pairs in registers, transposed
    /// there, stored as one 64-byte row each. Returns how many rows.
    ///
    /// The transpose is inlined (as a call it took and returned its 16
    /// vectors through the stack) and every column is present (past `k`
    /// the caller passes a zero column), so a step has no branch: pairing
    /// `xᵀ` went from 6.2% to 5.2% of a bf16 step's samples.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F and BW; each column holds `rows` values, and
    /// `out[i·stride .. i·stride + 16]` is writable for those rows.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn pair_block_transposed<T: Bf16Operand>(
        columns: &[&[T]; 32],
        rows: usize,
        out: *mut f32,
        stride: usize,
    ) -> usize {
        let whole = rows / 16 * 16;
        let starts: [*const T; 32] = std::array::from_fn(|l| columns[l].as_ptr());
        for i in (0..whole).step_by(16) {
            let mut pairs = [_mm512_setzero_si512(); 16];
            for (l, p) in pairs.iter_mut().enumerate() {
                // SAFETY: i + 16 ≤ rows, inside every column (caller).
                *p = unsafe {
                    let lo = T::bits16(starts[2 * l].add(i));
                    let hi = T::bits16(starts[2 * l + 1].add(i));
                    _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi))
                };
            }
            for (l, row) in transpose16(pairs).into_iter().enumerate() {
                // SAFETY: row i + l < rows, 16 floats from `out`'s row start
                // (caller).
                unsafe { _mm512_storeu_si512(out.add((i + l) * stride).cast(), row) };
            }
        }
        whole
    }

    /// [`super::pair_rows_both_ways`] of the two rows from `rows`, in place:
    /// each block of 32 columns is loaded (zero past `cols`) before its
    /// pairs are stored, the pairs along go to floats below the block's
    /// columns (read already), the pairs across of a column under `stride/2`
    /// over row 0's values past it (read from `upper0` instead, their copy)
    /// and of the others over row 1's block itself.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F and BW; `rows` holds two rows of `stride`
    /// floats, `stride` a multiple of 64 and `cols` at most it; `upper0` is
    /// row 0's values from `stride/2` to `cols`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn pair_rows_both_ways(
        rows: &mut [f32],
        stride: usize,
        cols: usize,
        upper0: &[f32],
    ) {
        let half = stride / 2;
        debug_assert!(rows.len() >= 2 * stride && cols <= stride && stride.is_multiple_of(64));
        debug_assert_eq!(upper0.len(), cols.saturating_sub(half));
        let r0 = rows.as_mut_ptr();
        // SAFETY: row 1 starts inside `rows` (caller).
        let r1 = unsafe { r0.add(stride) };
        // The high halves of two vectors of 16 gathered into 32 (as in
        // `bf16_bits_write`): a row's 16 pairs along.
        let high_halves = _mm512_set_epi16(
            63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21,
            19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
        );
        let low = _mm512_set1_epi32(0xffff);
        let lanes = |n: usize| -> __mmask16 { ((1u32 << n.min(16)) - 1) as __mmask16 };
        for j in (0..cols).step_by(32) {
            let live = cols - j;
            let (m0, m1) = (lanes(live), lanes(live.saturating_sub(16)));
            // SAFETY: the masked loads read columns j..cols of row 0 (from
            // `upper0` past `half`, a multiple of 32, so a block lies on
            // one side) and of row 1; the stores go to floats j/2.. of
            // each row (below half: j < cols ≤ 2·half) and to half + j..
            // of row 0 (j + 32 ≤ half) or j.. of row 1 (j + 32 ≤ stride),
            // inside `rows`.
            unsafe {
                let s0 = match j < half {
                    true => r0.add(j).cast_const(),
                    false => upper0.as_ptr().add(j - half),
                };
                let s1 = r1.add(j).cast_const();
                let a = round16_high(_mm512_maskz_loadu_ps(m0, s0));
                let b = round16_high(_mm512_maskz_loadu_ps(m1, s0.add(16)));
                let c = round16_high(_mm512_maskz_loadu_ps(m0, s1));
                let d = round16_high(_mm512_maskz_loadu_ps(m1, s1.add(16)));
                let along0 = _mm512_permutex2var_epi16(a, high_halves, b);
                let along1 = _mm512_permutex2var_epi16(c, high_halves, d);
                _mm512_storeu_si512(r0.add(j / 2).cast(), along0);
                _mm512_storeu_si512(r1.add(j / 2).cast(), along1);
                // Row 0's bits low, row 1's high.
                let lo = _mm512_or_si512(_mm512_srli_epi32::<16>(a), _mm512_andnot_si512(low, c));
                let hi = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_andnot_si512(low, d));
                let at = match j < half {
                    true => r0.add(half + j),
                    false => r1.add(j),
                };
                _mm512_storeu_si512(at.cast(), lo);
                _mm512_storeu_si512(at.add(16).cast(), hi);
            }
        }
    }

    /// The transpose of a 16×16 matrix of 32-bit lanes (`r[l]` its row `l`):
    /// pairs of rows interleaved by 32 and 64 bits within 128-bit lanes
    /// (4×4 blocks transposed in place), then the 128-bit lanes moved.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        let mut t = [_mm512_setzero_si512(); 16];
        for g in 0..8 {
            t[2 * g] = _mm512_unpacklo_epi32(r[2 * g], r[2 * g + 1]);
            t[2 * g + 1] = _mm512_unpackhi_epi32(r[2 * g], r[2 * g + 1]);
        }
        // u[4g + m]: within each 128-bit lane L, column 4L + m of rows
        // 4g..4g+4.
        let mut u = [_mm512_setzero_si512(); 16];
        for g in 0..4 {
            let (a, b, c, d) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
            u[4 * g] = _mm512_unpacklo_epi64(a, c);
            u[4 * g + 1] = _mm512_unpackhi_epi64(a, c);
            u[4 * g + 2] = _mm512_unpacklo_epi64(b, d);
            u[4 * g + 3] = _mm512_unpackhi_epi64(b, d);
        }
        let mut out = [_mm512_setzero_si512(); 16];
        for m in 0..4 {
            // Lanes 0 and 2 (v) and 1 and 3 (w) of rows 0-7 and 8-15.
            let v0 = _mm512_shuffle_i32x4::<0x88>(u[m], u[4 + m]);
            let w0 = _mm512_shuffle_i32x4::<0xdd>(u[m], u[4 + m]);
            let v1 = _mm512_shuffle_i32x4::<0x88>(u[8 + m], u[12 + m]);
            let w1 = _mm512_shuffle_i32x4::<0xdd>(u[8 + m], u[12 + m]);
            out[m] = _mm512_shuffle_i32x4::<0x88>(v0, v1);
            out[8 + m] = _mm512_shuffle_i32x4::<0xdd>(v0, v1);
            out[4 + m] = _mm512_shuffle_i32x4::<0x88>(w0, w1);
            out[12 + m] = _mm512_shuffle_i32x4::<0xdd>(w0, w1);
        }
        out
    }

    /// The pairs of `c0[i..i + 16]` with `c1[i..i + 16]` (zero without
    /// `c1`), the even value in the low half.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F and BW; both hold values `i..i + 16`.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn pair16<T: Bf16Operand>(c0: &[T], c1: Option<&[T]>, i: usize) -> __m512i {
        // SAFETY: 16 values from i (caller).
        unsafe {
            let lo = T::bits16(c0.as_ptr().add(i));
            let hi = match c1 {
                Some(c1) => T::bits16(c1.as_ptr().add(i)),
                None => _mm512_setzero_si512(),
            };
            _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi))
        }
    }

    /// Pairs `r0[j]` with `r1[j]` (zero without `r1`) into the panels at
    /// `out`: column `j` at `out[(j / nr)·panel + j % nr]`.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F and BW; `nr` and `r0.len()` are multiples of
    /// 16, `r1` is as long as `r0`, and `out` is writable at those places.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn pair_row_into_panels<T: Bf16Operand>(
        r0: &[T],
        r1: Option<&[T]>,
        out: *mut f32,
        nr: usize,
        panel: usize,
    ) {
        let (mut dst, mut in_panel) = (out, 0);
        for j in (0..r0.len()).step_by(16) {
            // SAFETY: j + 16 ≤ the rows' length (a multiple of 16); `dst` is
            // column j's place (caller).
            unsafe { _mm512_storeu_si512(dst.cast(), pair16(r0, r1, j)) };
            in_panel += 16;
            dst = if in_panel == nr {
                in_panel = 0;
                dst.wrapping_add(panel - nr + 16)
            } else {
                dst.wrapping_add(16)
            };
        }
    }

    /// Pairs `c0[i]` with `c1[i]` (zero without `c1`) into `out[i]` for the
    /// `i` below `c0.len()` rounded down to 16; returns how many.
    ///
    /// # Safety
    ///
    /// The CPU has AVX-512F and BW; `c1` is as long as `c0`, and `out` is
    /// writable for those values.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn pair_column<T: Bf16Operand>(
        c0: &[T],
        c1: Option<&[T]>,
        out: *mut f32,
    ) -> usize {
        let whole = c0.len() / 16 * 16;
        for i in (0..whole).step_by(16) {
            // SAFETY: i + 16 ≤ whole ≤ the columns' length, and inside `out`
            // (caller).
            unsafe { _mm512_storeu_si512(out.add(i).cast(), pair16(c0, c1, i)) };
        }
        whole
    }
}
