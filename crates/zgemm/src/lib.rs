//! The f32 GEMM `C = α·A·B` (or `C += α·A·B`, or `C = bias + α·A·B`, or
//! `C = R + (bias + α·A·B)`) that zrun's model spends most of a step in,
//! written the way BLIS and OpenBLAS write theirs.
//!
//! **Blocking.** `B` is packed a block of [`KC`] rows × `nc` columns at a time
//! into panels [`Kernel::nr`] wide, and `A` a block of `mc` rows × `KC` into
//! panels [`Kernel::mr`] tall, both laid out in the order the micro-kernel
//! reads them (so transposed operands cost nothing extra: the packing reads
//! through strides once and the kernel always sees the same layout). The
//! micro-kernel keeps an `mr × nr` tile of `C` in registers for `KC` steps of
//! rank-1 updates: the `A` panel (`mr·KC` floats) stays in L1 and the `B`
//! panel streams from L2 (AVX-512's 6×64 tile reads four vectors of `B` and
//! six broadcasts of `A` a step; its 12×32 predecessor, with two and twelve,
//! ran 0.80-0.87x as fast in products on a Sapphire Rapids), the `A` block in
//! L2, and the `B` block in L2 too where the f32 kernels cut its columns to
//! fit (`Kernel::col_block`; the bf16 kernels' blocks, and those of
//! products whose `A` is packed, sit in L3: a cut would pack `A` again for
//! every block; except AMX's on one thread at 1024 pairs deep, cut to half
//! of L2, as its `A` is paired once for the whole product). A product
//! whose `C` outgrows L2 and whose `A` is read in place takes deeper blocks
//! (`depth_block`): each block is a pass over `C`. Where a row block ends in
//! 1-3 rows, the AVX2 kernel runs them across two to six panels at a time
//! (`kernels::ShortRows`) rather than as a tile of mostly zero rows.
//!
//! **One result on every path.** Every f32 kernel computes each element of
//! `C` the same way. With α = 1 (every product of the model's linear layers)
//! it is one fused multiply-add chain over all of `p` in order, starting
//! from `C` (`Start::Keep`), the bias, or zero: each block of depth starts
//! its tile's registers from what the block before stored. Then `c = r + c`
//! where a residual `R` is given. So the blocks change no bit, and a product
//! cut in depth into products that add into `C` gives the whole product's
//! bits: a linear layer's input gradient summed tile by tile is the whole
//! layer's, in one product a tile (cut into 256-column chunks instead, each
//! a pass over `C` at depth 256, the model's input-gradient products ran
//! 0.86-0.89x as fast on two threads). With another α, each block's chain
//! starts from zero and is added: `c = α·acc` (first block, or
//! `bias + α·acc`) or `c = c + α·acc` (a plain multiply and add). Since the
//! blocks depend on the shapes alone and threads split only `M` and `N`, the
//! AVX-512, AVX2 and portable kernels and every thread count give the same
//! bits: a job's numbers do not depend on the CPU it ran on, and the portable
//! kernel is the reference the SIMD ones are tested against bit for bit. (The
//! bf16 kernels chain likewise where α = 1: AMX only where no residual is
//! given, the AVX512_BF16 kernel and its portable reference as the f32 ones.)
//!
//! **Threads** (rayon, in the caller's pool) take blocks of `A`'s rows (and,
//! when there are few, ranges of `B`'s panels); the packed `B` block is
//! shared, and so, on AVX-512, is a packed `A` whose row blocks several
//! tasks read (`Kernel::shares_packed_a`).
//!
//! **`B`'s column sums on the way** ([`gemm_summing_b`]): the packing reads
//! every element of `B` once, so it can add up `B`'s columns as it goes; a
//! linear layer's bias gradient is exactly that for its weight gradient's
//! `B`, and takes no pass of its own over the output gradient.
//!
//! **Rounded as it stores** ([`gemm_bf16_rounded`]): a bf16 product whose
//! every reader rounds `C` to bf16 anyway makes each tile in an L1 scratch
//! tile and stores it as bf16 bits from there (half the bytes of `C`, and
//! no pass of the readers' own to round it), the bits of rounding the f32
//! `C`.
//!
//! **Packed once** ([`PackedB`], [`gemm_packed`]): a caller that multiplies
//! many small `A`s by parts of one `B` (attention: each block of queries by
//! the keys it may see) packs `B` once, whole-depth panels, and each product
//! reads its rows and leading columns from them, with the same bits as
//! [`gemm`] on that part.

use std::cell::RefCell;

use rayon::prelude::*;

mod bf16;
mod gemv;
mod kernels;

use bf16::RowSource;
pub use bf16::{
    bf16_bits, bf16_bits_into, bf16_bits_write, bf16_line_start, bf16_row_stride, bf16_value,
    gemm_bf16, gemm_bf16_pairs, gemm_bf16_pairs_with, gemm_bf16_rounded, gemm_bf16_rounded_with,
    gemm_bf16_with, has_native_bf16, padded_pairs, pair_rows_both_ways, pairs_row_stride,
    Bf16Operand, BitsMut,
};

/// Depth of a packed block: an `A` panel of AVX-512's kernel (`6 × KC`
/// floats, 9 KiB) stays in L1 beside `B`'s stream. Shared by every kernel,
/// so that every path sums in the same blocks (module doc).
pub const KC: usize = 384;

/// Columns of `B` per packed block of the bf16 kernels (the f32 kernels
/// size theirs to L2, and so does AMX on one thread at 1024 pairs deep:
/// [`Kernel::col_block`]); a multiple of every `nr`.
const NC: usize = 2048;

/// The deepest block a product whose `A` is read in place takes (f32
/// kernels; AMX's in pairs on every product).
const DEEP_KC: usize = 1024;

/// The depth of a product's blocks, the same for every f32 kernel and
/// thread count (module doc): it depends on `k` and on whether `A`'s rows
/// are read in place, never on the CPU or the threads. [`KC`], but where
/// `A`'s rows are read in place (no packing that a deeper block would make
/// longer), up to [`DEEP_KC`], split evenly: fewer passes over `C`, and on
/// several threads fewer rounds of packing `B` and joining the tasks.
/// Measured on a Sapphire Rapids for products whose `C` outgrows L2, call
/// by call against `KC` (medians): 2048³ +1-8% on one thread, the 2048 ×
/// 1536 · 1536 × 384 products (an MLP's second layer, and its input
/// gradient read transposed) +4-14% on two, the model's other shapes level;
/// a transposed `A` (packed, the weight gradients) lost 2-22% with deeper
/// blocks, and keeps `KC`. Products with a small `C` kept `KC` until a Zen
/// 2 EPYC measured them (builds run by run against OpenBLAS, medians):
/// 512 × 512 · 512 × 128 and its transposed-`B` twin (a d_model-128
/// model's MLP second layer and input gradient) +2-4% on one thread and
/// +6-9% on two, 512 × 1024 · 1024 × 256 +1-5%, depths of one block
/// level.
///
/// AMX takes blocks of up to [`DEEP_KC`] pairs, split evenly, on every
/// product: its tiles start from `C` in their registers, so a pass that
/// adds into `C` costs a load of every tile before the first step (which
/// the tile's prefetches cannot hide) where one pass stores it only. The
/// model's products of depth 1536 and 2048 (768 and 1024 pairs) run in one
/// pass. The AVX512_BF16 kernel keeps `KC` pairs.
fn depth_block(kernel: Kernel, k: usize, a_rows_in_place: bool) -> usize {
    let deep = k.div_ceil(k.div_ceil(DEEP_KC)).next_multiple_of(SUM_GROUP);
    if kernel == Kernel::AmxBf16 {
        return deep;
    }
    if kernel.is_bf16() || !a_rows_in_place {
        return KC;
    }
    deep
}

/// Bytes of L2 a core has: sysfs's level-2 cache of CPU 0 on Linux, else
/// 1 MiB (most server cores of the last years have 1-2 MiB).
fn l2_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        let dir = "/sys/devices/system/cpu/cpu0/cache";
        (0..8)
            .find_map(|i| {
                let read = |f: &str| std::fs::read_to_string(format!("{dir}/index{i}/{f}")).ok();
                (read("level")?.trim() == "2" && read("type")?.trim() != "Instruction")
                    .then(|| cache_size(&read("size")?))
                    .flatten()
            })
            .unwrap_or(1 << 20)
    })
}

/// A sysfs cache size (`2048K`, `1M`, `512`) in bytes; `None` if it is not one.
fn cache_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let (digits, unit) = text.split_at(text.trim_end_matches(['K', 'M']).len());
    let scale = match unit {
        "K" => 1 << 10,
        "M" => 1 << 20,
        "" => 1,
        _ => return None,
    };
    digits
        .parse::<usize>()
        .ok()
        .map(|d| d * scale)
        .filter(|&b| b > 0)
}

/// Bad shapes or views: which operand and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ShapeError {
    /// A view reaches past its data.
    #[error("{what}: a {rows}x{cols} view with strides ({rs}, {cs}) needs {need} elements, the data has {have}")]
    OutOfBounds {
        what: &'static str,
        rows: usize,
        cols: usize,
        rs: usize,
        cs: usize,
        need: usize,
        have: usize,
    },
    /// The operands do not multiply into `C`.
    #[error(
        "C {c_rows}x{c_cols} = A {a_rows}x{a_cols} · B {b_rows}x{b_cols}: the shapes do not match"
    )]
    Mismatch {
        c_rows: usize,
        c_cols: usize,
        a_rows: usize,
        a_cols: usize,
        b_rows: usize,
        b_cols: usize,
    },
    /// The bias is not one value per column of `C`.
    #[error("bias of {len} values for {cols} columns")]
    Bias { len: usize, cols: usize },
    /// A residual that is not a view of `C`'s shape with adjacent columns.
    #[error("residual: a {rows}x{cols} view with column stride {cs}; C is {c_rows}x{c_cols} and needs column stride 1")]
    Residual {
        rows: usize,
        cols: usize,
        cs: usize,
        c_rows: usize,
        c_cols: usize,
    },
    /// `Start::Keep` on a `C` of uninitialised memory.
    #[error("C is uninitialised memory, which Start::Keep would read")]
    KeepUninit,
    /// Column sums of a length other than `B`'s columns.
    #[error("{len} column sums for a B of {cols} columns")]
    Sums { len: usize, cols: usize },
    /// Column sums of a `B` whose columns are not adjacent.
    #[error("column sums need B's columns adjacent (column stride 1, not {cs})")]
    SumsLayout { cs: usize },
}

impl ShapeError {
    /// [`ShapeError::Mismatch`] of `C`, `A` and a `B` of `b_rows × b_cols`.
    fn mismatch<T>(c: &MatMut, a: &MatRef<T>, b_rows: usize, b_cols: usize) -> ShapeError {
        ShapeError::Mismatch {
            c_rows: c.rows,
            c_cols: c.cols,
            a_rows: a.rows,
            a_cols: a.cols,
            b_rows,
            b_cols,
        }
    }
}

/// A read-only matrix: element `(i, j)` is `data[i·rs + j·cs]`. Of f32
/// values, or (`MatRef<u16>`) of bf16 values as their bits, which
/// [`gemm_bf16`] multiplies as they are, without rounding.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a, T = f32> {
    data: &'a [T],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a, T: Copy> MatRef<'a, T> {
    /// A view with row stride `rs` and column stride `cs`, checked against `data`.
    pub fn new(
        data: &'a [T],
        rows: usize,
        cols: usize,
        rs: usize,
        cs: usize,
    ) -> Result<MatRef<'a, T>, ShapeError> {
        let need = if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * rs + (cols - 1) * cs + 1
        };
        if need > data.len() {
            return Err(ShapeError::OutOfBounds {
                what: "matrix",
                rows,
                cols,
                rs,
                cs,
                need,
                have: data.len(),
            });
        }
        Ok(MatRef {
            data,
            rows,
            cols,
            rs,
            cs,
        })
    }

    /// `rows × cols`, row after row.
    pub fn row_major(data: &'a [T], rows: usize, cols: usize) -> Result<MatRef<'a, T>, ShapeError> {
        MatRef::new(data, rows, cols, cols, 1)
    }

    /// Rows `r0..r1` of the view.
    ///
    /// # Panics
    ///
    /// If `r0 > r1` or `r1 > self.rows()`.
    pub fn sub_rows(self, r0: usize, r1: usize) -> MatRef<'a, T> {
        assert!(
            r0 <= r1 && r1 <= self.rows,
            "rows {r0}..{r1} of {}",
            self.rows
        );
        // Rows below r1 lie in the view, so the start of row r0 does too
        // (an empty view keeps its data).
        let off = if r0 < r1 { r0 * self.rs } else { 0 };
        MatRef {
            data: &self.data[off..],
            rows: r1 - r0,
            ..self
        }
    }

    /// Columns `c0..c1` of the view.
    ///
    /// # Panics
    ///
    /// If `c0 > c1` or `c1 > self.cols()`.
    pub fn sub_cols(self, c0: usize, c1: usize) -> MatRef<'a, T> {
        self.t().sub_rows(c0, c1).t()
    }

    /// The transpose (the same data read the other way).
    pub fn t(self) -> MatRef<'a, T> {
        MatRef {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    fn at(&self, i: usize, j: usize) -> T {
        self.data[i * self.rs + j * self.cs]
    }
}

/// The output: `rows × cols` with row stride `rs` (columns adjacent), so that
/// a block of columns of a wider matrix can be written in place; over
/// initialised floats, or over uninitialised memory that a [`Start::Zero`] or
/// [`Start::Bias`] product fills (a fresh output without a zeroing pass).
#[derive(Debug)]
pub struct MatMut<'a> {
    ptr: *mut f32,
    rows: usize,
    cols: usize,
    rs: usize,
    /// Whether the elements hold values (`Start::Keep` reads them).
    init: bool,
    _data: std::marker::PhantomData<&'a mut [f32]>,
}

/// Checks that `rows × cols` at row stride `rs` fits `len` floats.
fn fits(rows: usize, cols: usize, rs: usize, len: usize) -> Result<(), ShapeError> {
    let need = if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + cols
    };
    if need > len || (rows > 1 && rs < cols) {
        return Err(ShapeError::OutOfBounds {
            what: "C",
            rows,
            cols,
            rs,
            cs: 1,
            need,
            have: len,
        });
    }
    Ok(())
}

impl<'a> MatMut<'a> {
    /// A view with row stride `rs`, checked against `data`.
    pub fn new(
        data: &'a mut [f32],
        rows: usize,
        cols: usize,
        rs: usize,
    ) -> Result<MatMut<'a>, ShapeError> {
        fits(rows, cols, rs, data.len())?;
        Ok(MatMut {
            ptr: data.as_mut_ptr(),
            rows,
            cols,
            rs,
            init: true,
            _data: std::marker::PhantomData,
        })
    }

    /// `rows × cols`, row after row.
    pub fn row_major(
        data: &'a mut [f32],
        rows: usize,
        cols: usize,
    ) -> Result<MatMut<'a>, ShapeError> {
        MatMut::new(data, rows, cols, cols)
    }

    /// A view with row stride `rs` over uninitialised memory: a product with
    /// [`Start::Zero`] or [`Start::Bias`] writes every element of the view
    /// (then the caller may assume them initialised); [`Start::Keep`] is
    /// refused.
    pub fn uninit(
        data: &'a mut [std::mem::MaybeUninit<f32>],
        rows: usize,
        cols: usize,
        rs: usize,
    ) -> Result<MatMut<'a>, ShapeError> {
        fits(rows, cols, rs, data.len())?;
        Ok(MatMut {
            ptr: data.as_mut_ptr().cast(),
            rows,
            cols,
            rs,
            init: false,
            _data: std::marker::PhantomData,
        })
    }
}

impl MatMut<'_> {
    /// Rows of the view.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns of the view.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// A view with row stride `rs` over `rows × cols` elements at `ptr`, for
    /// callers whose threads write disjoint blocks of one buffer (where
    /// `&mut` slices of the interleaved rows could not be split off).
    ///
    /// # Safety
    ///
    /// Every element `ptr[i·rs + j]` (`i < rows`, `j < cols`) must be valid
    /// for writes (and hold a value when `init`, which [`Start::Keep`] reads)
    /// for the view's life, and no one else may read or write those elements
    /// meanwhile.
    pub unsafe fn from_raw(
        ptr: *mut f32,
        rows: usize,
        cols: usize,
        rs: usize,
        init: bool,
    ) -> Result<Self, ShapeError> {
        fits(rows, cols, rs, usize::MAX)?;
        Ok(MatMut {
            ptr,
            rows,
            cols,
            rs,
            init,
            _data: std::marker::PhantomData,
        })
    }
}

/// What `C` starts from.
#[derive(Debug, Clone, Copy)]
pub enum Start<'a> {
    /// `C = α·A·B`.
    Zero,
    /// `C += α·A·B`.
    Keep,
    /// `C = bias + α·A·B`, one bias value per column (a linear layer's
    /// forward, without a second pass over `C`).
    Bias(&'a [f32]),
    /// `C = R + (bias + α·A·B)` (without a bias, `R + α·A·B`): a linear
    /// layer's forward added to the residual stream it branched from, the
    /// sum made as the tiles store (no pass of its own over `C`, and the
    /// same bits as adding `R` to a [`Start::Bias`] product afterwards). `R`
    /// has `C`'s shape and adjacent columns.
    Residual {
        bias: Option<&'a [f32]>,
        r: MatRef<'a>,
    },
}

/// Whether the CPU has AMX-BF16 and Linux lets this process use its tile
/// data (asked once, with `arch_prctl(ARCH_REQ_XCOMP_PERM)`, without which
/// the first tile instruction would be a SIGILL).
#[cfg(target_arch = "x86_64")]
fn amx_bf16_usable() -> bool {
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USABLE.get_or_init(|| {
        // CPUID leaf 7: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
            return false;
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a plain system call with integer arguments.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    })
}

/// A micro-kernel, chosen at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// 6×64 tiles in 24 of the 32 zmm registers.
    Avx512,
    /// 6×16 tiles in 12 of the 16 ymm registers.
    Avx2,
    /// Plain Rust (`f32::mul_add`): every CPU, and the reference.
    Portable,
    /// 32×32 tiles of bf16 products in AMX tile registers ([`gemm_bf16`]).
    AmxBf16,
    /// 12×32 tiles of bf16 products with AVX512_BF16 ([`gemm_bf16`]).
    Avx512Bf16,
    /// The bf16 reference: `vdpbf16ps`'s arithmetic in plain Rust, 4×16.
    PortableBf16,
}

impl Kernel {
    /// Every kernel this CPU can run, fastest first.
    pub fn available() -> Vec<Kernel> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Kernel::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                v.push(Kernel::Avx2);
            }
        }
        v.push(Kernel::Portable);
        v
    }

    /// Every bf16 kernel ([`gemm_bf16`]) this CPU can run, fastest first.
    pub fn available_bf16() -> Vec<Kernel> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            if amx_bf16_usable() {
                v.push(Kernel::AmxBf16);
            }
            if std::arch::is_x86_feature_detected!("avx512bf16") {
                v.push(Kernel::Avx512Bf16);
            }
        }
        v.push(Kernel::PortableBf16);
        v
    }

    /// The fastest bf16 kernel this CPU can run.
    pub fn best_bf16() -> Kernel {
        Kernel::detected_bf16()[0]
    }

    /// [`Kernel::available_bf16`], detected once (every product checks it).
    fn detected_bf16() -> &'static [Kernel] {
        static DETECTED: std::sync::OnceLock<Vec<Kernel>> = std::sync::OnceLock::new();
        DETECTED.get_or_init(Kernel::available_bf16)
    }

    /// The fastest kernel this CPU can run.
    pub fn best() -> Kernel {
        Kernel::detected()[0]
    }

    /// [`Kernel::available`], detected once (every product checks it).
    fn detected() -> &'static [Kernel] {
        static DETECTED: std::sync::OnceLock<Vec<Kernel>> = std::sync::OnceLock::new();
        DETECTED.get_or_init(Kernel::available)
    }

    /// Runs `iterations` steps of twelve independent fused multiply-add
    /// chains on this kernel's vectors and nothing else, and returns the
    /// FLOPs done: timed, the arithmetic ceiling of one core, which a
    /// product's FLOP/s can be set against (`zrun bench kernels`' `fma_peak`
    /// rows). For the AVX512_BF16 kernel, chains of its `vdpbf16ps`, two
    /// products a lane (the `bf16_peak` rows): twice `fma_peak` on Zen 4,
    /// where it retires at an FMA's rate, level with it where it retires
    /// at half that (the Sapphire Rapids measured). `None` for the others
    /// (the portable kernels, AMX).
    pub fn fma_chains(self, iterations: u64) -> Option<u64> {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Bf16 if Kernel::detected_bf16().contains(&self) => {
                // SAFETY: `available_bf16()` offers this kernel only where
                // the CPU has AVX-512F and AVX512_BF16.
                Some(unsafe { kernels::dpbf16_chains_avx512(iterations) })
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 if Kernel::detected().contains(&self) => {
                // SAFETY: `available()` offers this kernel only where the
                // CPU has AVX-512F.
                Some(unsafe { kernels::fma_chains_avx512(iterations) })
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 if Kernel::detected().contains(&self) => {
                // SAFETY: as above, with AVX2 and FMA.
                Some(unsafe { kernels::fma_chains_avx2(iterations) })
            }
            _ => None,
        }
    }

    /// Whether the kernel multiplies bf16 pairs ([`gemm_bf16`]).
    pub fn is_bf16(self) -> bool {
        matches!(
            self,
            Kernel::AmxBf16 | Kernel::Avx512Bf16 | Kernel::PortableBf16
        )
    }

    /// Rows of a register tile.
    pub fn mr(self) -> usize {
        match self {
            Kernel::AmxBf16 => 32,
            Kernel::Avx512 => 6,
            Kernel::Avx512Bf16 => 12,
            Kernel::Avx2 => 6,
            Kernel::Portable | Kernel::PortableBf16 => 4,
        }
    }

    /// Columns of a register tile.
    pub fn nr(self) -> usize {
        match self {
            Kernel::Avx512 => 64,
            Kernel::Avx512Bf16 | Kernel::AmxBf16 => 32,
            Kernel::Avx2 | Kernel::Portable | Kernel::PortableBf16 => 16,
        }
    }

    /// Columns of `B` a packed block takes in a product of `n` columns on
    /// `threads` threads. The f32 kernels read each panel of the block from
    /// L2 for every tile of a row block, and the whole block again at the
    /// next row block, so each thread's share of it is cut to half of L2
    /// (the rest for `A`'s block and `C`'s tiles): 682 columns of a
    /// 384-deep block (1 MiB) a thread on a 2 MiB L2. Blocks of 2048
    /// columns (3 MiB, from L3 at each new row block) ran 0.86-0.95x as fast
    /// on one thread on a Sapphire Rapids (2048³ and the model's products wider than 682); on two
    /// threads, each streaming its half of the panels, the two rules
    /// measured level. `n` is cut evenly, in a multiple of `nr · threads`
    /// columns, so that no block is a sliver and each thread's share of
    /// panels is the same. Which columns share a block changes no
    /// element's sums. (The bf16 kernels keep [`NC`]: cut the same way,
    /// AMX ran 0.90-0.95x as fast on one thread.)
    ///
    /// Except AMX on one thread where a block is [`DEEP_KC`] pairs deep
    /// (products of 2048 and more: the weight gradients of 2048 tokens,
    /// 2048³) and wider than half of L2: there each block takes at most
    /// half of L2, cut evenly. A block of 36 such panels (4.5 MiB) was
    /// packed through misses to L3 and read back from there for every row
    /// block; cut, it is packed into L2 and read from it. Measured on a
    /// Sapphire Rapids-class host (`gemm_bench`, bf16 operands, one thread,
    /// old and new builds alternated): 2048³ 1.45-1.50x, the weight
    /// gradients 384 × 2048 · 2048 × 1152 1.08-1.15x and 1536 × 2048 · 2048
    /// × 384 1.08-1.16x, the others unchanged (no cut); 2048 × 1536 · 1536
    /// × 384 (768 pairs deep, 1.2 MiB) lost 6-10% cut in two, hence the
    /// depth. On two threads cutting lost up to 40% (every block a parallel
    /// packing and a barrier, each core reading the half its neighbour
    /// packed): they keep [`NC`].
    ///
    /// Where `A` is packed (a transposed `A`: the weight gradients `xᵀ·dy`),
    /// every column block packs `A` again, so the block takes all of `n`
    /// while it stays under [`WHOLE_B_BYTES`]: its panels then come from L3
    /// once a row block, and a row of `B` is packed in one contiguous read.
    /// On a Zen 3 EPYC (512 KiB of L2 a core: blocks of 176 columns, `A`
    /// packed seven times in a 384 × 2048 · 2048 × 1152 product) the
    /// weight gradients' shapes ran 1.17-1.32x as fast at one thread and
    /// 1.13-1.27x at two (`gemm_bench`, alternated).
    ///
    /// On a core whose L2 is under [`SMALL_L2_BYTES`], half of it holds
    /// too few columns (Zen 3's 512 KiB: 170 at depth 384, 64 at 1024) for
    /// a block to pay for reading all of `A` again at the next one, and its
    /// L3 serves `B`'s panels fast: the blocks take at least 512 columns a
    /// thread. Alternated call by call on a Zen 3 EPYC (medians of 15),
    /// whole-width blocks against half of L2: the model's untransposed
    /// products 1.09-1.23x at one thread and 1.04-1.08x at two, 2048³
    /// 1.16x and 1.04x; 512 columns a thread against whole widths level
    /// (0.99-1.05x). (The Sapphire Rapids' 2 MiB keeps the rule above:
    /// 2048-column blocks lost there.)
    fn col_block(self, n: usize, threads: usize, depth: usize, a_packed: bool) -> usize {
        if self == Kernel::AmxBf16 && threads == 1 && depth >= DEEP_KC {
            let nr = self.nr();
            let bytes = n.next_multiple_of(nr) * depth * 4;
            let budget = l2_bytes() / 2;
            if bytes > budget {
                return n
                    .div_ceil(bytes.div_ceil(budget))
                    .next_multiple_of(nr)
                    .min(NC);
            }
        }
        if self.is_bf16() {
            return NC;
        }
        let unit = self.nr() * threads.max(1);
        if a_packed && n * depth * 4 <= WHOLE_B_BYTES {
            return n.next_multiple_of(unit);
        }
        let fewest = if l2_bytes() < SMALL_L2_BYTES { 512 } else { 64 };
        let per_thread = (l2_bytes() / 2 / (depth * 4)).clamp(fewest, 1024);
        let most = (per_thread * threads.max(1)).max(unit);
        let blocks = n.div_ceil(most).max(1);
        n.div_ceil(blocks).next_multiple_of(unit)
    }

    /// Whether the tasks of a block of depth share one packing of `A` (all
    /// its rows, packed before the tasks, each row block by one thread)
    /// where `A` is packed (`a_packed`) and more than one task takes each
    /// row block ([`task_splits`]), instead of each task packing its rows
    /// again. That repeated packing was what the weight gradients `xᵀ·dy`
    /// with 384 rows paid for splitting `B`'s panels between the threads;
    /// shared, the split costs nothing extra, and it is taken wherever `A`
    /// has few row blocks. AVX-512 on a Sapphire Rapids, two threads,
    /// alternated call by call (medians of 55 calls, six rounds with and
    /// without column sums): 384 × 2048 · 2048 × 1152 1.02-1.04x, × 384
    /// 1.03-1.11x, × 1536 (which took whole rows before) 1.04-1.07x, the
    /// 1536-row one (one task a row block) level. The AVX2 kernel on the
    /// same cores measured level to 3% slower with it, and packs its own.
    fn shares_packed_a(self, a_packed: bool) -> bool {
        a_packed && self == Kernel::Avx512
    }

    /// Rows of a packed `A` block (`mc × KC` floats stay in L2).
    fn mc(self) -> usize {
        self.mr() * 16
    }

    /// Rows of `A` a task takes in a product of `m` rows on `threads`
    /// threads: [`Kernel::mc`] on one thread. On several, every kernel but
    /// AMX takes as many blocks as `mc` makes, rounded up to a multiple of
    /// `threads`, evened out in whole tiles: where a product with a packed
    /// `A` gives each thread whole row blocks (`task_splits`), a short last
    /// block left one thread idle for most of the product. A weight
    /// gradient with 128 rows (a d_model-128 model's, 128 × 512 · 512 ×
    /// 384) was 96 + 32 rows on two threads, 0.71-0.73x OpenBLAS; as
    /// 66 + 62, 0.88x; 512 × 512 · 512 × 128 0.83-0.85x → 0.87x (AVX2 on a
    /// Zen 2 EPYC, alternated call by call). The anchor model's shapes
    /// (384, 1536 and 2048 rows) keep blocks of 96.
    ///
    /// AMX (which reads `A` in place, so that the block is not a packing
    /// size) cuts them so that the blocks come in a multiple of `threads`,
    /// whole tiles each, and up to [`AMX_TASKS_PER_THREAD`] of them a
    /// thread while each keeps at least [`AMX_TASK_ROWS`] rows: 384 rows on
    /// two threads are two blocks of 192, 1536 twelve of 128, 2048 sixteen
    /// of 128. Which rows share a task changes no element's sums.
    fn row_block(self, m: usize, threads: usize) -> usize {
        let mc = self.mc();
        if threads < 2 {
            return mc;
        }
        if self != Kernel::AmxBf16 {
            let blocks = m.div_ceil(mc).max(1).next_multiple_of(threads);
            return m.div_ceil(self.mr()).div_ceil(blocks) * self.mr();
        }
        let fewest = m.div_ceil(mc).div_ceil(threads) * threads;
        let most = (AMX_TASKS_PER_THREAD * threads).min(m / AMX_TASK_ROWS / threads * threads);
        m.div_ceil(fewest.max(most)).div_ceil(self.mr()) * self.mr()
    }

    /// Whether a task sweeps `B`'s panels for each row of tiles (its rows of
    /// `A` stay in L1, the panels, `panel_bytes` in all, stream from L2)
    /// rather than the block's rows of tiles for each panel (the panel in
    /// L1, `A`'s rows from L2). AMX sweeps the panels wherever they fit in
    /// L2: its `A` rows are read in place 16 at a time, each tile load
    /// pulling 16 lines from 16 rows, where a panel's loads walk one
    /// contiguous stream (a loop of tile steps on one thread: 1.8 TFLOP/s
    /// streaming `A`'s rows, 2.4 streaming `B`'s panel); and the tiles
    /// that follow each other write along `C`'s rows, not down a column of
    /// tiles. Measured on a Sapphire Rapids (`gemm_bench`, bf16 operands,
    /// alternated): 1.08-1.36x on the model's shapes whose panels fit, one
    /// thread; a weight gradient whose 36 panels of 1024 pairs (4.7 MB)
    /// did not lost 8-14% sweeping them, hence the bound. The bf16 step
    /// 1.04-1.10x on one worker, 1.06-1.12x on two (six alternated rounds
    /// each).
    ///
    /// The f32 kernels sweep the panels too where `A`'s rows are read in
    /// place (`a_in_place`: a row-major `A`; a packed one, the weight
    /// gradients' `xᵀ`, keeps a panel in L1 and sweeps its rows): a tile's
    /// six rows of `A` stay in L1 (9-24 KiB at depths 384-1024) and each
    /// panel streams once a row of tiles from L2, where the other order
    /// read `A`'s rows through L1 again for every panel and, at 1024 deep,
    /// kept a panel (64 KiB on AVX2, 96 KiB and more on AVX-512) larger
    /// than L1 anyway. Measured on a Sapphire Rapids-class host, alternated
    /// call by call (medians of 30-40, the same bits): AVX-512 on one
    /// thread 2048³ 1.024-1.035x and the model's untransposed products
    /// 1.011-1.022x, on two threads 0.98-1.02x; AVX2 2048³ 1.066x on one
    /// thread and 1.021x on two, the others 0.99-1.02x; the packed-`A`
    /// products (left out) 0.94-0.97x with it on AVX-512. A transformer
    /// block (f32, alternated in one process): 1.017-1.021x on one thread,
    /// 0.998-1.008x on two. Which tile runs when changes no element's sums.
    fn a_rows_outside(self, panel_bytes: usize, a_in_place: bool) -> bool {
        let sweeps = match self {
            Kernel::AmxBf16 => true,
            Kernel::Avx512 | Kernel::Avx2 | Kernel::Portable => a_in_place,
            Kernel::Avx512Bf16 | Kernel::PortableBf16 => false,
        };
        sweeps && panel_bytes <= l2_bytes()
    }

    /// Runs a strip of whole tiles: see [`kernels::Strip`]. Only the
    /// kernels that [`Pass::rows`] hands strips to.
    fn strip(self, s: &kernels::Strip) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` offered this kernel only where the CPU has
            // AVX2 and FMA; the strip's tiles are whole and valid (driver).
            Kernel::Avx2 => unsafe { kernels::avx2_strip(s) },
            _ => unreachable!("strips go to the AVX2 kernel only"),
        }
    }

    /// Runs the last 1-3 rows of a row block across whole panels: see
    /// [`kernels::ShortRows`]. Only the kernels that [`Pass::rows`] hands
    /// them to.
    fn short_rows(self, s: &kernels::ShortRows) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` offered this kernel only where the CPU has
            // AVX2 and FMA; the rows are 1-3 and valid (driver).
            Kernel::Avx2 => unsafe { kernels::avx2_short_rows(s) },
            _ => unreachable!("short rows go to the AVX2 kernel only"),
        }
    }

    /// Runs one tile: see [`kernels::Tile`].
    fn tile(self, t: &kernels::Tile) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` offered this kernel only where the CPU has
            // AVX-512F; `t` is valid for a 6×64 tile (driver).
            Kernel::Avx512 => unsafe { kernels::avx512(t) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, with AVX2 and FMA; `t` fits a 6×16 tile.
            Kernel::Avx2 => unsafe { kernels::avx2(t) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available_bf16()` offered it only where the CPU has
            // AVX-512F and AVX512_BF16; `t` is valid for a 12×32 tile.
            Kernel::Avx512Bf16 => unsafe { kernels::avx512_bf16(t) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: offered only where the CPU has AMX-BF16 and the kernel
            // granted its tile data; the driver reads A in place (whole
            // padded panels, depth in steps of 16 pairs: gemm_bf16).
            Kernel::AmxBf16 => unsafe { kernels::amx_bf16(t) },
            // SAFETY: `t` fits a 4×16 tile (driver).
            Kernel::PortableBf16 => unsafe { kernels::portable_bf16(t) },
            // SAFETY: `t` fits a 4×16 tile (driver).
            _ => unsafe { kernels::portable(t) },
        }
    }
}

/// The largest packed `B` block that takes all of a product's columns where
/// `A` is packed ([`Kernel::col_block`]): an L3's share, not an L2's.
const WHOLE_B_BYTES: usize = 8 << 20;

/// An L2 under this size makes the f32 kernels' column blocks at least 512
/// columns a thread ([`Kernel::col_block`]).
const SMALL_L2_BYTES: usize = 1 << 20;

/// The most tasks that rayon runs as one leaf of a product's parallel loop:
/// one. Left to itself, rayon splits a loop on two threads into four leaves
/// and runs each leaf whole once begun, so that when one thread falls
/// behind (preempted, or its core slowed by a neighbour's) the other waits
/// for up to a quarter of the product; with leaves of one task it takes
/// every task that has not started, while each thread still begins on its
/// own half of the range (so on its own panels of `B`, see
/// [`task_splits`]). Alternated call by call on a Zen 3 EPYC at 2 threads
/// (medians of 40-50 calls, four runs): the model's products 0.99-1.17x,
/// 2048 × 384 · 384 × 1152 1.11-1.12x in two runs and level in two; with
/// the fused ops' loops cut the same way, one worker × 2 threads trained
/// 1.04-1.23x as fast in seven alternated rounds (docs/PERFORMANCE.md).
/// Which thread runs a task changes no bits.
const TASK_LEAF: usize = 1;

/// Row blocks a thread may get in an AMX product (see
/// [`Kernel::row_block`]). Each thread's run of them is one range of the
/// tasks, handed out by rayon's halving; with two or four blocks a product
/// on two threads waited, whole, for the thread that fell behind (woken
/// late, interrupted) to finish its last quarter or half. With up to eight,
/// the other steals what has not started: the bf16 step on one worker × 2
/// threads 1.02-1.03x (eight alternated rounds, 5 ahead and 3 level), 2048³
/// on its own 1.1-1.5x; cut finer than 128 rows, the weight gradients'
/// 384-row products, which stream all of `B` once a block, lost 2-4%.
/// (Measured with rayon's own leaves, four tasks each; every task is a
/// leaf of its own since [`TASK_LEAF`], unmeasured on AMX.)
const AMX_TASKS_PER_THREAD: usize = 8;

/// The fewest rows of an AMX task that [`AMX_TASKS_PER_THREAD`] cuts to.
const AMX_TASK_ROWS: usize = 128;

/// `C = start ⊕ α·A·B` with the fastest kernel, on up to `threads` threads of
/// the current rayon pool (1: the calling thread only).
pub fn gemm(
    c: MatMut,
    a: MatRef,
    b: MatRef,
    alpha: f32,
    start: Start,
    threads: usize,
) -> Result<(), ShapeError> {
    gemm_with(Kernel::best(), c, a, b, alpha, start, threads)
}

/// [`gemm`] with a given kernel (tests and benchmarks compare them).
///
/// # Panics
///
/// If `kernel` is not in [`Kernel::available`].
pub fn gemm_with(
    kernel: Kernel,
    c: MatMut,
    a: MatRef,
    b: MatRef,
    alpha: f32,
    start: Start,
    threads: usize,
) -> Result<(), ShapeError> {
    assert_f32_kernel(kernel);
    drive(
        kernel,
        c,
        a,
        Packs::Values(b),
        alpha,
        start,
        threads,
        None,
        None,
        None,
    )
}

/// The panic [`gemm_with`] and [`gemm_finishing_with`] document: `kernel`
/// must be an f32 kernel this CPU has.
fn assert_f32_kernel(kernel: Kernel) {
    assert!(
        Kernel::detected().contains(&kernel),
        "the {kernel:?} GEMM kernel needs a CPU feature this one lacks, or is not an f32 kernel"
    );
}

/// What [`gemm_finishing`] hands each finished tile of `C` to. Called from
/// the product's threads, each tile once, tiles side by side.
pub type Finish<'a> = dyn Fn(FinishedTile) + Sync + 'a;

/// A tile of `C` that holds its final values, handed to a product's
/// [`Finish`] right after it is stored (while it is in L1): its rows
/// `row0..row0 + rows` and columns `col0..col0 + cols` of `C`, element
/// `(i, j)` of the tile at `ptr + i·rs + j`. The `Finish` may read and
/// write those elements (and only those) during the call: no other thread
/// touches them then.
#[derive(Debug, Clone, Copy)]
pub struct FinishedTile {
    /// `C`'s row of the tile's first row.
    pub row0: usize,
    /// `C`'s column of the tile's first column.
    pub col0: usize,
    /// Rows of the tile.
    pub rows: usize,
    /// Columns of the tile.
    pub cols: usize,
    /// The tile's element (0, 0) in `C`.
    pub ptr: *mut f32,
    /// `C`'s row stride.
    pub rs: usize,
}

/// [`gemm`] at α = 1 that hands every tile of `C`, once it holds its final
/// values, to `finish` (an element-wise function of the product, evaluated
/// on tiles in L1 instead of in a pass of its own over `C`: the MLP's
/// GELU, or its backward's multiply by GELU's slope). The bits of `C` before
/// `finish` are [`gemm`]'s.
pub fn gemm_finishing(
    c: MatMut,
    a: MatRef,
    b: MatRef,
    start: Start,
    threads: usize,
    finish: &Finish,
) -> Result<(), ShapeError> {
    gemm_finishing_with(Kernel::best(), c, a, b, start, threads, finish)
}

/// [`gemm_finishing`] with a given kernel (tests compare them).
///
/// # Panics
///
/// As [`gemm_with`].
pub fn gemm_finishing_with(
    kernel: Kernel,
    c: MatMut,
    a: MatRef,
    b: MatRef,
    start: Start,
    threads: usize,
    finish: &Finish,
) -> Result<(), ShapeError> {
    assert_f32_kernel(kernel);
    drive(
        kernel,
        c,
        a,
        Packs::Values(b),
        1.0,
        start,
        threads,
        None,
        None,
        Some(finish),
    )
}

/// `C = start ⊕ A·B` for a `B` stored as bf16 bits (a model's weights kept
/// as published, half the bytes of f32), each value widened exactly: the
/// bits of [`gemm`] (with `finish`, [`gemm_finishing`]) on the widened `B`,
/// in f32 products. Up to [`ROWS_STREAMED`] rows of `A` (generation's
/// products, a short prompt's) stream `B` as it is stored, once a row; more
/// rows run the blocked product, whose packing widens the values.
pub fn gemm_widening_b(
    c: MatMut,
    a: MatRef,
    b: MatRef<u16>,
    start: Start,
    threads: usize,
    finish: Option<&Finish>,
) -> Result<(), ShapeError> {
    gemm_widening_b_with(Kernel::best(), c, a, b, start, threads, finish)
}

/// Rows of `A` up to which [`gemm_widening_b`] streams `B` once a row: a
/// row's pass over `B` costs its 2 bytes a value at the memory's speed;
/// the blocked product's packing moves 6 bytes a value before FLOPs that
/// cost about a third of a row's pass a row, so streaming wins up to a few
/// rows (eight measured level on a 2-core Zen 2, a 1.2B LLaMA's prompt).
pub const ROWS_STREAMED: usize = 8;

/// [`gemm_widening_b`] with a given kernel (tests compare them).
///
/// # Panics
///
/// As [`gemm_with`].
pub(crate) fn gemm_widening_b_with(
    kernel: Kernel,
    c: MatMut,
    a: MatRef,
    b: MatRef<u16>,
    start: Start,
    threads: usize,
    finish: Option<&Finish>,
) -> Result<(), ShapeError> {
    assert_f32_kernel(kernel);
    let streamed = (1..=ROWS_STREAMED).contains(&c.rows) && c.cols > 0 && a.cols > 0;
    if streamed && (b.cs == 1 || b.rs == 1 || b.cols == 1) {
        let First {
            add,
            bias,
            residual,
        } = begin(&c, &a, b.rows, b.cols, start)?.expect("rows, columns and depth");
        let simd = kernel != Kernel::Portable;
        for i in 0..c.rows {
            // SAFETY: row i of C's checked view, which this call holds.
            let row = unsafe { MatMut::from_raw(c.ptr.add(i * c.rs), 1, c.cols, c.rs, c.init)? };
            let ends = gemv::Ends {
                add,
                bias,
                residual: residual.map(|r| r.sub_rows(i, i + 1)),
            };
            let shifted = |t: FinishedTile| {
                if let Some(finish) = finish {
                    finish(FinishedTile { row0: i, ..t })
                }
            };
            let finish_row = finish.map(|_| &shifted as &Finish);
            gemv::row_times(
                simd,
                &row,
                &a.sub_rows(i, i + 1),
                &b,
                &ends,
                threads,
                finish_row,
            );
        }
        return Ok(());
    }
    let b = Packs::Widened(b);
    drive(kernel, c, a, b, 1.0, start, threads, None, None, finish)
}

/// Rows of `B` that [`gemm_summing_b`]'s column sums add as a group.
pub const SUM_GROUP: usize = 16;
const _: () = assert!(
    KC.is_multiple_of(SUM_GROUP),
    "groups must not straddle depth blocks"
);

/// [`gemm`] that also writes `B`'s column sums, `sums[j] = Σᵢ B[i][j]`,
/// added up as the packing reads `B`: a linear layer's bias gradient is the
/// column sums of the output gradient that its weight gradient multiplies
/// by, and this takes them without a pass of its own over that gradient.
/// Each sum takes `B`'s rows in groups of [`SUM_GROUP`] from the first: a
/// group summed from zero in row order, the groups added in order to a sum
/// from zero, whatever the threads (which split the rows at groups).
/// `B` must be row-major (adjacent columns).
pub fn gemm_summing_b(
    c: MatMut,
    a: MatRef,
    b: MatRef,
    alpha: f32,
    start: Start,
    threads: usize,
    sums: &mut [f32],
) -> Result<(), ShapeError> {
    if sums.len() != b.cols {
        return Err(ShapeError::Sums {
            len: sums.len(),
            cols: b.cols,
        });
    }
    if b.cs != 1 && b.cols > 1 {
        return Err(ShapeError::SumsLayout { cs: b.cs });
    }
    let kernel = Kernel::best();
    drive(
        kernel,
        c,
        a,
        Packs::Values(b),
        alpha,
        start,
        threads,
        Some(sums),
        None,
        None,
    )
}

/// `B`'s column sums in [`gemm_summing_b`]'s groups, for a product with
/// nothing to multiply.
fn sum_columns(b: &MatRef, sums: &mut [f32]) {
    let mut group = vec![0f32; b.cols];
    for i in 0..b.rows {
        for (j, g) in group.iter_mut().enumerate() {
            *g += b.at(i, j);
        }
        if (i + 1) % SUM_GROUP == 0 || i + 1 == b.rows {
            sums.iter_mut().zip(&mut group).for_each(|(s, g)| {
                *s += *g;
                *g = 0.0;
            });
        }
    }
}

/// What the driver packs `B`'s panels from.
#[derive(Clone, Copy)]
pub(crate) enum Packs<'a> {
    /// `B`'s elements as they are.
    Values(MatRef<'a>),
    /// bf16 pairs of a row-major matrix, rounded as they are packed (no
    /// paired copy of `B` first): `B`'s row `q` is its rows `2q` and `2q + 1`
    /// interleaved, `rows` of them (zero past its last row).
    RowPairs { of: RowSource<'a>, rows: usize },
    /// bf16 values as their bits, widened as they are packed
    /// ([`gemm_widening_b`]).
    Widened(MatRef<'a, u16>),
}

impl Packs<'_> {
    /// `B`'s rows and columns.
    fn shape(&self) -> (usize, usize) {
        match self {
            Packs::Values(b) => (b.rows, b.cols),
            Packs::RowPairs { of, rows } => (*rows, of.cols()),
            Packs::Widened(b) => (b.rows, b.cols),
        }
    }
}

/// The blocked product with `kernel`, whose elements are f32 values or
/// (bf16 kernels) pairs of bf16 values; with `sums`, `B`'s column sums too
/// ([`gemm_summing_b`]: f32 values of a row-major `B` only).
#[allow(clippy::too_many_arguments)]
pub(crate) fn drive(
    kernel: Kernel,
    c: MatMut,
    a: MatRef,
    b: Packs,
    alpha: f32,
    start: Start,
    threads: usize,
    mut sums: Option<&mut [f32]>,
    rounded: Option<Rounded>,
    finish: Option<&Finish>,
) -> Result<(), ShapeError> {
    let first = begin(&c, &a, b.shape().0, b.shape().1, start)?;
    if let (Some(sums), Packs::Values(b)) = (sums.as_deref_mut(), &b) {
        sums.fill(0.0);
        if first.is_none() {
            // Nothing to multiply (no rows of A, or no depth): no packing
            // will read B, so the sums read it here.
            sum_columns(b, sums);
        }
    }
    let Some(First {
        add: add_first,
        bias,
        residual,
    }) = first
    else {
        // Nothing to multiply: C holds its final values already.
        if let Some(finish) = finish.filter(|_| c.rows > 0 && c.cols > 0) {
            finish(FinishedTile {
                row0: 0,
                col0: 0,
                rows: c.rows,
                cols: c.cols,
                ptr: c.ptr,
                rs: c.rs,
            });
        }
        return Ok(());
    };
    if let (1, 1.0, None, None, Packs::Values(b)) = (c.rows, alpha, &sums, &rounded, &b) {
        if b.cs == 1 || b.rs == 1 || b.cols == 1 {
            let ends = gemv::Ends {
                add: add_first,
                bias,
                residual,
            };
            match kernel {
                Kernel::Avx512 | Kernel::Avx2 => {
                    gemv::row_times(true, &c, &a, b, &ends, threads, finish);
                    return Ok(());
                }
                Kernel::Portable => {
                    gemv::row_times(false, &c, &a, b, &ends, threads, finish);
                    return Ok(());
                }
                _ => {}
            }
        }
    }
    let (m, n, k) = (c.rows, c.cols, a.cols);
    assert!(
        rounded.is_none() || k <= KC,
        "a product rounded as it stores is one block of depth"
    );
    assert!(
        rounded.is_none() || finish.is_none(),
        "a product rounded as it stores has no f32 tiles to finish"
    );
    let (nr, mc) = (kernel.nr(), kernel.row_block(m, threads));
    let depth = depth_block(kernel, k, a.cs == 1);
    let col_block = kernel.col_block(n, threads, depth, a.cs != 1);
    // Taken, not borrowed: while this thread waits for the tasks, rayon may
    // run another job on it that multiplies too.
    let mut packed_b = PACKED_B.take();
    let mut shared_a_buf = SHARED_A.take();
    // The column sums of the groups that threads other than the first sum
    // (pack_b_rows_split).
    let mut group_sums = Vec::new();
    let mr = kernel.mr();
    for jc in (0..n).step_by(col_block) {
        let nc = col_block.min(n - jc);
        let panels = nc.div_ceil(nr);
        for pc in (0..k).step_by(depth) {
            let kc = depth.min(k - pc);
            let b_block = &mut aligned(&mut packed_b, panels * nr * depth)[..panels * nr * kc];
            // Each thread packs a run of the block's rows across every panel
            // where B is row-major (pack_b_rows_split), else a run of whole
            // panels (pack_b_panels).
            let run = panels.div_ceil(threads) * nr * kc;
            let pack = |((r, dst), sums): ((usize, &mut [f32]), Option<&mut [f32]>)| {
                let j = jc + r * run / kc;
                let j1 = (jc + nc).min(j + dst.len() / kc);
                match &b {
                    Packs::Values(b) => pack_b_panels(b, pc, kc, j, j1, nr, dst, sums),
                    Packs::RowPairs {
                        of: RowSource::F32(m),
                        ..
                    } => bf16::pack_row_pairs(m, pc, kc, j, j1, nr, dst),
                    Packs::RowPairs {
                        of: RowSource::Bf16(m),
                        ..
                    } => bf16::pack_row_pairs(m, pc, kc, j, j1, nr, dst),
                    Packs::Widened(b) => {
                        for (d, j) in dst.chunks_mut(nr * kc).zip((j..j1).step_by(nr)) {
                            pack_b_widened(b, pc, kc, j, nr.min(j1 - j), nr, d);
                        }
                    }
                }
            };
            // The block's columns' sums (module doc: `B`'s column sums).
            let block_sums = sums.as_deref_mut().map(|s| &mut s[jc..jc + nc]);
            let row_major = match &b {
                Packs::Values(b) if b.cs == 1 => Some(b),
                _ => None,
            };
            match (threads > 1, block_sums, row_major) {
                (true, s, Some(b)) => {
                    let s = s.map(|s| (s, &mut group_sums));
                    pack_b_rows_split(b, pc, kc, jc, jc + nc, nr, threads, b_block, s)
                }
                (true, None, None) => b_block
                    .par_chunks_mut(run)
                    .enumerate()
                    .map(|chunk| (chunk, None))
                    .for_each(pack),
                (true, Some(_), None) => unreachable!("column sums need a row-major B"),
                (false, s, _) => pack(((0, b_block), s)),
            }
            let m_blocks = m.div_ceil(mc);
            let share_a = threads > 1 && kernel.shares_packed_a(a.cs != 1);
            let splits = task_splits(
                kernel,
                a.cs != 1,
                share_a,
                m_blocks,
                panels * nr * kc * 4,
                panels,
                threads,
                l2_bytes(),
            );
            // Each row block packed once, by one task, and read by every
            // task of its rows (`Kernel::shares_packed_a`).
            let shared_a = (share_a && splits > 1).then(|| {
                let all = aligned(&mut shared_a_buf, m.div_ceil(mr) * mr * kc);
                all.par_chunks_mut(mc * kc)
                    .enumerate()
                    .with_max_len(TASK_LEAF)
                    .for_each(|(ib, dst)| pack_a_block(&a, ib * mc, pc, kc, mr, dst));
                &*all
            });
            let pass = Pass {
                kernel,
                c: SendPtr(c.ptr),
                c_rs: c.rs,
                m,
                n,
                a,
                shared_a,
                pc,
                kc,
                b: b_block,
                panel_stride: nr * kc,
                jc,
                alpha,
                add: add_first || pc > 0,
                bias: bias.filter(|_| pc == 0),
                residual: residual.filter(|_| pc + kc == k),
                transposed_a_in_place: false,
                rounded,
                finish: finish.filter(|_| pc + kc == k),
            };
            let task = |t: usize| {
                let (s, ib) = (t / m_blocks, t % m_blocks);
                pass.rows(ib * mc, mc.min(m - ib * mc), chunk(panels, splits, s));
            };
            if threads > 1 {
                // One task a leaf (see TASK_LEAF).
                (0..m_blocks * splits)
                    .into_par_iter()
                    .with_max_len(TASK_LEAF)
                    .for_each(task);
            } else {
                (0..m_blocks * splits).for_each(task);
            }
        }
    }
    PACKED_B.set(packed_b);
    SHARED_A.set(shared_a_buf);
    Ok(())
}

/// Into how many ranges of `B`'s `panels` (`panel_bytes` in all) the
/// tasks of one block of depth cut each of `A`'s `m_blocks` row blocks
/// (`a_packed`: `A` is packed, by each task or, `a_shared`, once for all
/// of them: [`Kernel::shares_packed_a`]) on `threads` threads, `l2` bytes
/// of L2 a core. Each task is a row block × a range of panels,
/// enough of them that every thread has two, numbered so that rayon's
/// halving hands each thread its own range of panels (half the packed `B`
/// each to stream) where `A` needs no packing, which a task of each range
/// would otherwise repeat, or where `A` has so few blocks that repeating
/// their packing costs less than every thread streaming all of `B` (a
/// weight gradient xᵀ·dy with 384 rows, on a Sapphire Rapids: 0.91x
/// OpenBLAS at 2 threads before, 1.03-1.09x after).
///
/// That last trade holds where a thread's share of the panels stays in
/// its L2 (there, 864 KiB of 2 MiB) and each range is streamed from there
/// once for each row block. Where the share is over half of L2 it comes
/// from L3 for each row block whichever way the tasks are cut, and only
/// the repeated packing of `A` is left: so where `A` is packed and its
/// row blocks divide evenly among the threads, each thread takes whole
/// rows instead and packs only its own: less work for the same bits. On
/// a Zen 3 EPYC (512 KiB of L2) the model's weight gradients with 384
/// rows (384 × 2048 · 2048 × 384, 1152 and 1536) measured level at 2
/// threads on two idle cores (medians of 30 alternated calls, four
/// rounds: 0.94-1.04x, 384 columns 0.98-1.04x) and 1.01-1.11x with other
/// processes busy on one of the cores (three rounds), where a thread's
/// packing is what the busy core runs slowest. On the Sapphire Rapids it
/// moved one of the model's products, 384 × 2048 · 2048 × 1536 (a share
/// of 1.15 MiB), to whole rows, until its `A` was packed once for both
/// threads: with nothing repeated, the panels are split again there
/// (`a_shared`, 1.04-1.07x).
///
/// AMX's tasks take whole rows of `C` wherever each thread can have its
/// own blocks of them (its row blocks are cut to fit): two threads writing
/// the two halves of every row of `C` ran at 0.6-0.7x the rate of each
/// writing its own rows (2048 rows × 384 columns), though `A`, read in
/// place, costs the same either way. (The f32 kernels measured 3-9% slower
/// with whole rows on the Sapphire Rapids: their `B` block is near L2's
/// size, and half of it each is what they gain.)
///
/// Which tiles share a task changes no element's sums.
#[allow(clippy::too_many_arguments)]
fn task_splits(
    kernel: Kernel,
    a_packed: bool,
    a_shared: bool,
    m_blocks: usize,
    panel_bytes: usize,
    panels: usize,
    threads: usize,
    l2: usize,
) -> usize {
    let share_in_l2 = panel_bytes.div_ceil(threads) <= l2 / 2;
    match threads {
        1 => 1,
        _ if kernel == Kernel::AmxBf16 && m_blocks >= threads => 1,
        _ if a_packed && !a_shared && m_blocks.is_multiple_of(threads) && !share_in_l2 => 1,
        _ if !a_packed || m_blocks <= 2 * threads => threads.max((2 * threads).div_ceil(m_blocks)),
        _ => (2 * threads).div_ceil(m_blocks),
    }
    .clamp(1, panels)
}

/// What the first block of depth starts from.
struct First<'b> {
    /// `C` itself (`Start::Keep`).
    add: bool,
    /// The bias, which the tiles add as they store.
    bias: Option<&'b [f32]>,
    /// What the last block's tiles add as they store.
    residual: Option<MatRef<'b>>,
}

/// Checks a product's operands and does the work of an empty one; what the
/// first block of depth starts from, or `None` when nothing is left to
/// multiply.
fn begin<'b>(
    c: &MatMut,
    a: &MatRef,
    b_rows: usize,
    b_cols: usize,
    start: Start<'b>,
) -> Result<Option<First<'b>>, ShapeError> {
    let (m, n, k) = (c.rows, c.cols, a.cols);
    if a.rows != m || b_cols != n || b_rows != k {
        return Err(ShapeError::mismatch(c, a, b_rows, b_cols));
    }
    if let Start::Bias(bias)
    | Start::Residual {
        bias: Some(bias), ..
    } = start
    {
        if bias.len() != n {
            return Err(ShapeError::Bias {
                len: bias.len(),
                cols: n,
            });
        }
    }
    if let Start::Residual { r, .. } = start {
        if r.rows != m || r.cols != n || (r.cs != 1 && n > 1) {
            return Err(ShapeError::Residual {
                rows: r.rows,
                cols: r.cols,
                cs: r.cs,
                c_rows: m,
                c_cols: n,
            });
        }
    }
    if !c.init && matches!(start, Start::Keep) {
        return Err(ShapeError::KeepUninit);
    }
    if m == 0 || n == 0 {
        return Ok(None);
    }
    // What the first block of KC starts from: C itself (`Keep`), or nothing,
    // or the bias, which the tiles add as they store (not a pass of its own
    // over C: C is often fresh memory, and its first touch belongs in the
    // parallel part).
    let (add_first, bias, residual) = match start {
        Start::Zero => (false, None, None),
        Start::Keep => (true, None, None),
        Start::Bias(bias) => (false, Some(bias), None),
        Start::Residual { bias, r } => (false, bias, Some(r)),
    };
    if k == 0 {
        if !add_first {
            for i in 0..m {
                for j in 0..n {
                    let v = bias.map_or(0.0, |b| b[j]);
                    let v = residual.map_or(v, |r| r.at(i, j) + v);
                    // SAFETY: (i, j) is inside C's checked view.
                    unsafe { c.ptr.add(i * c.rs + j).write(v) };
                }
            }
        }
        return Ok(None);
    }
    Ok(Some(First {
        add: add_first,
        bias,
        residual,
    }))
}

/// `B` packed once for several products that each read a part of it
/// (attention multiplies every block of queries by the same keys): panels of
/// [`Kernel::nr`] columns that run the whole depth, so that any run of rows
/// and any leading columns are a product's `B` without packing it again.
/// Packed as f32 values ([`PackedB::pack`], for [`gemm_packed`]) or as bf16
/// pairs ([`PackedB::pack_bf16`], for [`gemm_packed_bf16`]).
#[derive(Debug, Default)]
pub struct PackedB {
    data: Vec<f32>,
    /// Where the panels start in `data`: a 64-byte boundary ([`aligned`]).
    start: usize,
    rows: usize,
    cols: usize,
    /// Elements down a panel: `rows`, or for pairs `⌈rows/2⌉` rounded up
    /// to 16 (zero below the last).
    depth: usize,
    kernel: Option<Kernel>,
}

impl PackedB {
    /// An empty buffer, to [`PackedB::pack`] into.
    pub fn new() -> PackedB {
        PackedB::default()
    }

    /// Packs `b` for the fastest kernel, reusing this buffer.
    pub fn pack(&mut self, b: MatRef) {
        self.pack_for(Kernel::best(), b);
    }

    /// Packs `b` for `kernel`.
    ///
    /// # Panics
    ///
    /// If `kernel` is not in [`Kernel::available`].
    pub fn pack_for(&mut self, kernel: Kernel, b: MatRef) {
        assert!(
            Kernel::detected().contains(&kernel),
            "the {kernel:?} GEMM kernel needs a CPU feature this one lacks"
        );
        let nr = kernel.nr();
        let len = b.cols.div_ceil(nr) * nr * b.rows;
        let panels = aligned(&mut self.data, len);
        pack_b_panels(&b, 0, b.rows, 0, b.cols, nr, panels, None);
        self.start = self.data.as_ptr().align_offset(64);
        (self.rows, self.cols, self.depth) = (b.rows, b.cols, b.rows);
        self.kernel = Some(kernel);
    }

    /// Packs `b` as bf16 pairs for the fastest bf16 kernel (f32 values
    /// rounded as [`gemm_bf16`] rounds them, bf16 bits as they are; its
    /// layout), reusing this buffer.
    pub fn pack_bf16<T: Bf16Operand>(&mut self, b: MatRef<T>) {
        let kernel = Kernel::best_bf16();
        let nr = kernel.nr();
        let depth = bf16::padded_pairs(b.rows);
        let panels = aligned(&mut self.data, b.cols.div_ceil(nr) * nr * depth);
        if b.cs == 1 {
            bf16::pack_row_pairs(&b, 0, depth, 0, b.cols, nr, panels);
        } else {
            // Pairs along the columns of bᵀ (adjacent values where b's
            // columns are contiguous), then panels of their transpose.
            bf16::with_pairs(|buf| {
                let pairs = bf16::pair_columns(b.t(), buf, 1);
                pack_b_panels(&pairs.t(), 0, depth, 0, b.cols, nr, panels, None);
            });
        }
        self.start = self.data.as_ptr().align_offset(64);
        (self.rows, self.cols, self.depth) = (b.rows, b.cols, depth);
        self.kernel = Some(kernel);
    }

    /// Rows of the packed matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns of the packed matrix.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Columns of a panel: a product may start at any multiple of it
    /// ([`gemm_packed`]'s `b_col`); 1 before anything is packed.
    pub fn panel_width(&self) -> usize {
        self.kernel.map_or(1, Kernel::nr)
    }
}

/// `C = start ⊕ α·A·B'` on the calling thread, where `B'` is rows `b_rows`
/// and the `C.cols` columns of `b` from `b_col` (a multiple of
/// [`PackedB::panel_width`]): the bits of [`gemm_with`] on that part of
/// `B`, with the kernel `b` was packed for. `A` is read in place whether it
/// is stored row-major or transposed (the few panels of `B` that such
/// products have would not repay packing it).
pub fn gemm_packed(
    c: MatMut,
    a: MatRef,
    b: &PackedB,
    (b_rows, b_col): (std::ops::Range<usize>, usize),
    alpha: f32,
    start: Start,
) -> Result<(), ShapeError> {
    let Some(kernel) = b
        .kernel
        .filter(|k| !k.is_bf16() && holds(&c, &a, b, (&b_rows, b_col)))
    else {
        return Err(ShapeError::mismatch(&c, &a, b.rows, b.cols));
    };
    // Panels of nr columns lie `nr · depth` apart.
    let from = b.start + b_col * b.depth + b_rows.start * kernel.nr();
    multiply_packed(kernel, c, a, &b.data[from..], b.depth, alpha, start, true)
}

/// `C = start ⊕ α·bf16(A)·bf16(B')` on the calling thread ([`gemm_bf16`]
/// on the part `B'` of `b` that [`gemm_packed`] takes), where `b` was packed
/// by [`PackedB::pack_bf16`]. `b_rows` starts at a multiple of 32 (a pair of
/// `B`'s rows never straddles it; a tile step of 16 pairs starts there) and
/// ends at an even row or `B`'s last.
pub fn gemm_packed_bf16<A: Bf16Operand>(
    c: MatMut,
    a: MatRef<A>,
    b: &PackedB,
    (b_rows, b_col): (std::ops::Range<usize>, usize),
    alpha: f32,
    start: Start,
) -> Result<(), ShapeError> {
    let (r0, r1) = (b_rows.start, b_rows.end);
    let on_pairs = r0 % 32 == 0 && (r1 % 2 == 0 || r1 == b.rows);
    let Some(kernel) = b
        .kernel
        .filter(|k| k.is_bf16() && on_pairs && holds(&c, &a, b, (&b_rows, b_col)))
    else {
        return Err(ShapeError::mismatch(&c, &a, b.rows, b.cols));
    };
    bf16::with_pairs(|buf| {
        // Pairs of A's columns, zero past the last: depth ⌈len/2⌉ rounded
        // up to 16 reads B's pairs from r0/2 within its zero-padded depth.
        let a2 = bf16::pair_columns(a, buf, 1);
        let from = b.start + b_col * b.depth + r0 / 2 * kernel.nr();
        multiply_packed(kernel, c, a2, &b.data[from..], b.depth, alpha, start, false)
    })
}

/// Whether `b` holds rows `b_rows` and `C`'s columns from `b_col` (where a
/// panel starts), and `A` is as deep.
fn holds<T>(
    c: &MatMut,
    a: &MatRef<T>,
    b: &PackedB,
    (b_rows, b_col): (&std::ops::Range<usize>, usize),
) -> bool {
    b_rows.start <= b_rows.end
        && b_rows.end <= b.rows
        && b_col.is_multiple_of(b.panel_width())
        && b_col + c.cols <= b.cols
        && a.cols == b_rows.len()
}

/// The product of [`gemm_packed`] and [`gemm_packed_bf16`] on `A`'s depth:
/// `b` its part of the panels (from the first row it reads), `depth`
/// elements down each panel.
#[allow(clippy::too_many_arguments)]
fn multiply_packed(
    kernel: Kernel,
    c: MatMut,
    a: MatRef,
    b: &[f32],
    depth: usize,
    alpha: f32,
    start: Start,
    transposed_a_in_place: bool,
) -> Result<(), ShapeError> {
    let Some(First {
        add: add_first,
        bias,
        residual,
    }) = begin(&c, &a, a.cols, c.cols, start)?
    else {
        return Ok(());
    };
    let (m, n, k, nr) = (c.rows, c.cols, a.cols, kernel.nr());
    // The blocks of the unpacked product, whose bits these are.
    let step = depth_block(kernel, k, a.cs == 1);
    for pc in (0..k).step_by(step) {
        let kc = step.min(k - pc);
        let pass = Pass {
            kernel,
            c: SendPtr(c.ptr),
            c_rs: c.rs,
            m,
            n,
            a,
            shared_a: None,
            pc,
            kc,
            b: &b[pc * nr..],
            panel_stride: nr * depth,
            jc: 0,
            alpha,
            add: add_first || pc > 0,
            bias: bias.filter(|_| pc == 0),
            residual: residual.filter(|_| pc + kc == k),
            transposed_a_in_place,
            rounded: None,
            finish: None,
        };
        pass.rows(0, m, 0..n.div_ceil(nr));
    }
    Ok(())
}

/// One block of depth of a product: what its tiles share.
struct Pass<'a> {
    kernel: Kernel,
    c: SendPtr,
    c_rs: usize,
    /// Rows and columns of `C`.
    m: usize,
    n: usize,
    a: MatRef<'a>,
    /// All of `A`'s rows for this block, packed ([`pack_a_block`]) once
    /// for every task, or `None`: each task packs its own rows.
    shared_a: Option<&'a [f32]>,
    /// The block: `A`'s columns (`B`'s rows) `pc..pc + kc`.
    pc: usize,
    kc: usize,
    /// The block's packed `B`: panel `p` holds `kc` rows of `nr` values from
    /// `b[p·panel_stride]`, for `C`'s columns from `jc + p·nr`.
    b: &'a [f32],
    panel_stride: usize,
    jc: usize,
    alpha: f32,
    /// `C += …` rather than `C = …`.
    add: bool,
    bias: Option<&'a [f32]>,
    /// `R`, which this block's tiles add as they store (the last block).
    residual: Option<MatRef<'a>>,
    /// Whether an `A` stored transposed (unit row stride) is read in place
    /// too, rather than packed (a row-major one always is).
    transposed_a_in_place: bool,
    /// Where `C` goes rounded to bf16 instead ([`gemm_bf16_rounded`]): each
    /// tile is made in an L1 scratch tile and stored from there as bits.
    rounded: Option<Rounded>,
    /// What each tile of the last block is handed to once stored.
    finish: Option<&'a Finish<'a>>,
}

/// The bf16 output of [`gemm_bf16_rounded`]: element `(i, j)` at
/// `ptr[i·rs + j]`.
#[derive(Clone, Copy)]
pub(crate) struct Rounded {
    pub(crate) ptr: *mut u16,
    pub(crate) rs: usize,
}
// SAFETY: the tasks of a product write disjoint tiles of the output.
unsafe impl Send for Rounded {}
// SAFETY: as above.
unsafe impl Sync for Rounded {}

/// One tile of `C` in L1 for a product that rounds it as it stores (the
/// widest tile, AMX's, is 32 × 32).
#[repr(C, align(64))]
struct ScratchTile([f32; 32 * 32]);

impl Pass<'_> {
    /// Where the tile at row `i`, column `j` of `C` finds the bias's columns
    /// and the residual's element (null where there is none), and the
    /// residual's row stride.
    fn ends_at(&self, i: usize, j: usize) -> (*const f32, *const f32, usize) {
        (
            self.bias.map_or(std::ptr::null(), |b| b[j..].as_ptr()),
            self.residual
                .map_or(std::ptr::null(), |r| r.data[i * r.rs + j..].as_ptr()),
            self.residual.map_or(0, |r| r.rs),
        )
    }

    /// The tiles of `C`'s rows `i0..i0 + mlen` (at most `mc`) and the
    /// block's panels `panels`.
    fn rows(&self, i0: usize, mlen: usize, panels: std::ops::Range<usize>) {
        let (a, kernel, kc, pc) = (&self.a, self.kernel, self.kc, self.pc);
        let (mr, nr) = (kernel.mr(), kernel.nr());
        let mut packed_a_buf = PACKED_A.take();
        // Written by each tile before it is read (its live part only).
        let mut scratch = std::mem::MaybeUninit::<ScratchTile>::uninit();
        let scratch_ptr = scratch.as_mut_ptr().cast::<f32>();
        let tall = mlen.div_ceil(mr);
        // Whole panels of A are read in place where the kernel can take A's
        // strides; the rest are packed.
        // (AMX's kernel reads whole panels of A, whose rows gemm_bf16 pads.)
        let in_place = |rows: usize| {
            (rows == mr || kernel == Kernel::AmxBf16)
                && (a.cs == 1 || (self.transposed_a_in_place && a.rs == 1))
        };
        let packed_a: &[f32] = match self.shared_a {
            Some(all) => &all[i0 / mr * mr * kc..][..tall * mr * kc],
            None => {
                let packed_a = aligned(&mut packed_a_buf, tall * mr * kc);
                if a.rs == 1 && a.cs != 1 && !in_place(mr) {
                    pack_a_transposed(a, i0, mlen, pc, kc, mr, packed_a);
                } else {
                    for (q, dst) in packed_a.chunks_mut(mr * kc).enumerate() {
                        let rows = mr.min(mlen - q * mr);
                        if !in_place(rows) {
                            pack_a(a, i0 + q * mr, rows, pc, kc, mr, dst);
                        }
                    }
                }
                packed_a
            }
        };
        // Which tiles follow each other: AMX, and the f32 kernels where `A`
        // is read in place, keep a row of tiles (its `A` in L1) and sweep
        // `B`'s panels (from L2) where the task's panels fit in L2, else a
        // kernel keeps a panel and sweeps the block's rows of tiles
        // (`Kernel::a_rows_outside`).
        let rows_outside = kernel.a_rows_outside(panels.len() * nr * kc * 4, a.cs == 1);
        let tile = |p: usize, q: usize| {
            let j = self.jc + p * nr;
            let cols = nr.min(self.n - j);
            let i = i0 + q * mr;
            let rows = mr.min(self.m - i);
            let (a_ptr, a_rs, a_cs) = if in_place(rows) {
                (a.data[i * a.rs + pc * a.cs..].as_ptr(), a.rs, a.cs)
            } else {
                (packed_a[q * mr * kc..].as_ptr(), 1, mr)
            };
            let b = &self.b[p * self.panel_stride..][..kc * nr];
            let (bias, residual, residual_rs) = self.ends_at(i, j);
            let t = kernels::Tile {
                k: kc,
                a: a_ptr,
                a_rs,
                a_cs,
                b: b.as_ptr(),
                alpha: self.alpha,
                add: self.add,
                bias,
                residual,
                residual_rs,
                c: match self.rounded {
                    Some(_) => scratch_ptr,
                    // SAFETY: row i, column j of C are inside its view
                    // (i < m, j < n).
                    None => unsafe { self.c.get().add(i * self.c_rs + j) },
                },
                rs: match self.rounded {
                    Some(_) => nr,
                    None => self.c_rs,
                },
                rows,
                cols,
                streams: if rows_outside {
                    kernels::Streams::B
                } else {
                    kernels::Streams::A
                },
            };
            kernel.tile(&t);
            if let Some(finish) = self.finish {
                finish(FinishedTile {
                    row0: i,
                    col0: j,
                    rows,
                    cols,
                    // SAFETY: as `c` above (no rounded output with a
                    // finish: drive).
                    ptr: unsafe { self.c.get().add(i * self.c_rs + j) },
                    rs: self.c_rs,
                });
            }
            if let Some(out) = self.rounded {
                // SAFETY: rows i.. and columns j.. of the output, this
                // tile's live part, are inside its view (as C's above)
                // and this task's alone.
                unsafe {
                    bf16::round_tile(
                        scratch_ptr,
                        nr,
                        rows,
                        cols,
                        out.ptr.add(i * out.rs + j),
                        out.rs,
                    )
                };
            }
        };
        // Runs of whole tiles that chain (α = 1) with nothing done after
        // each (no finish, no rounding) go to the kernel as one strip
        // (`kernels::Strip`, which has the measurements). Only AVX2's so
        // far: the other kernels' CPUs were not at hand to measure theirs.
        let strips = kernel == Kernel::Avx2
            && self.alpha == 1.0
            && self.rounded.is_none()
            && self.finish.is_none();
        let whole_cols = |p: usize| self.jc + (p + 1) * nr <= self.n;
        let whole_rows = mlen / mr;
        let strip = |q: usize, p: usize, tiles: usize, along_row: bool| {
            let i = i0 + q * mr;
            let j = self.jc + p * nr;
            let (a_ptr, a_rs, a_cs, a_step) = if in_place(mr) {
                (
                    a.data[i * a.rs + pc * a.cs..].as_ptr(),
                    a.rs,
                    a.cs,
                    mr * a.rs,
                )
            } else {
                (packed_a[q * mr * kc..].as_ptr(), 1, mr, mr * kc)
            };
            let walk = |at: *const f32, row_step: usize, col_step: usize| kernels::Walk {
                at,
                step: if along_row { col_step } else { row_step },
            };
            let s = kernels::Strip {
                tiles,
                k: kc,
                a: walk(a_ptr, a_step, 0),
                a_strides: (a_rs, a_cs),
                b: walk(
                    self.b[p * self.panel_stride..].as_ptr(),
                    0,
                    self.panel_stride,
                ),
                // SAFETY: row i, column j of C are inside its view.
                c: walk(
                    unsafe { self.c.get().add(i * self.c_rs + j) },
                    mr * self.c_rs,
                    nr,
                ),
                rs: self.c_rs,
                add: self.add,
                bias: walk(
                    self.bias.map_or(std::ptr::null(), |b| b[j..].as_ptr()),
                    0,
                    nr,
                ),
                residual: match self.residual {
                    Some(r) => walk(r.data[i * r.rs + j..].as_ptr(), mr * r.rs, nr),
                    None => walk(std::ptr::null(), 0, 0),
                },
                residual_rs: self.residual.map_or(0, |r| r.rs),
            };
            kernel.strip(&s);
        };
        // The block's last rows where they are 1-3, fewer than a tile, go
        // across several whole panels at a time (`kernels::ShortRows`) where
        // strips are taken.
        let short = mlen - whole_rows * mr;
        let short = if strips && (1..=3).contains(&short) {
            short
        } else {
            0
        };
        let short_rows = |run: std::ops::Range<usize>| {
            let (i, j) = (i0 + whole_rows * mr, self.jc + run.start * nr);
            let (bias, residual, residual_rs) = self.ends_at(i, j);
            kernel.short_rows(&kernels::ShortRows {
                rows: short,
                panels: run.len(),
                k: kc,
                a: packed_a[whole_rows * mr * kc..].as_ptr(),
                b: self.b[run.start * self.panel_stride..].as_ptr(),
                panel_stride: self.panel_stride,
                // SAFETY: row i, column j of C are inside its view.
                c: unsafe { self.c.get().add(i * self.c_rs + j) },
                rs: self.c_rs,
                add: self.add,
                bias,
                residual,
                residual_rs,
            });
        };
        if rows_outside {
            for q in 0..tall {
                let whole = if strips && (q < whole_rows || short > 0) {
                    panels.clone().take_while(|&p| whole_cols(p)).count()
                } else {
                    0
                };
                if whole > 0 && q < whole_rows {
                    strip(q, panels.start, whole, true);
                } else if whole > 0 {
                    short_rows(panels.start..panels.start + whole);
                }
                (panels.start + whole..panels.end).for_each(|p| tile(p, q));
            }
        } else {
            // The short rows of the whole panels just multiplied, a run of
            // them once it is long enough or the whole panels end.
            // (The kernel's runs: twelve accumulators, two a row and panel.)
            let run = 6usize.checked_div(short).unwrap_or(1);
            let mut waiting = panels.start;
            for p in panels.clone() {
                let whole = if strips && whole_cols(p) {
                    whole_rows
                } else {
                    0
                };
                if whole > 0 {
                    strip(0, p, whole, false);
                }
                if short > 0 && whole_cols(p) {
                    if p + 1 - waiting == run || p + 1 == panels.end || !whole_cols(p + 1) {
                        short_rows(waiting..p + 1);
                        waiting = p + 1;
                    }
                } else {
                    (whole..tall).for_each(|q| tile(p, q));
                    waiting = p + 1;
                }
            }
        }
        PACKED_A.set(packed_a_buf);
    }
}

thread_local! {
    /// This thread's packed `A` block, reused from call to call.
    static PACKED_A: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The calling thread's packed `B` block.
    static PACKED_B: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The calling thread's packed `A` shared by a block's tasks.
    static SHARED_A: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Makes `v` at least `len` long. Never shorter: products of alternating
/// sizes (attention's blocks) would otherwise zero the difference on every
/// call, and packing overwrites whatever it reads.
fn grow(v: &mut Vec<f32>, len: usize) {
    if v.len() < len {
        v.resize(len, 0.0);
    }
}

/// The first `len` floats of `v` from a 64-byte boundary (`v` grown to hold
/// them): packed panels start on a cache line, so that no 64-byte vector or
/// AMX tile row straddles two (measured: an AMX tile step ran at half the
/// rate on buffers only 4-byte aligned).
fn aligned(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    grow(v, len + 15);
    let off = v.as_ptr().align_offset(64);
    &mut v[off..off + len]
}

/// `C`'s base pointer, shared by tasks that write disjoint tiles.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint tiles of C (each (row block, panel range) once).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Range `i` of `len` items split into `parts`.
fn chunk(len: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let (base, extra) = (len / parts, len % parts);
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// Packs the rows of `a` from `i0` that `dst` has panels for (`dst.len() /
/// (mr·kc)` panels, the last cut at `a`'s last row), columns `pc..pc+kc`, as
/// a task that packs its own rows would (`Pass::rows`): the same layout and
/// values, for a block's tasks to share. `a` is not row-major (every panel
/// is packed).
fn pack_a_block(a: &MatRef, i0: usize, pc: usize, kc: usize, mr: usize, dst: &mut [f32]) {
    let mlen = (dst.len() / kc).min(a.rows - i0);
    if a.rs == 1 {
        pack_a_transposed(a, i0, mlen, pc, kc, mr, dst);
    } else {
        for (q, dst) in dst.chunks_mut(mr * kc).enumerate() {
            pack_a(a, i0 + q * mr, mr.min(mlen - q * mr), pc, kc, mr, dst);
        }
    }
}

/// Packs rows `i0..i0+rows` (`rows ≤ mr`), columns `p0..p0+kc` of `a` into
/// `dst` as `kc` groups of `mr` values (column `p` of the panel after column
/// `p-1`), zero below the last row.
fn pack_a(a: &MatRef, i0: usize, rows: usize, p0: usize, kc: usize, mr: usize, dst: &mut [f32]) {
    if rows < mr {
        dst.fill(0.0);
    }
    if a.cs == 1 {
        // Rows of A are contiguous: read each along, write with stride mr.
        for i in 0..rows {
            let src = &a.data[(i0 + i) * a.rs + p0..][..kc];
            for (p, &v) in src.iter().enumerate() {
                dst[p * mr + i] = v;
            }
        }
    } else if a.rs == 1 {
        // Aᵀ stored row-major (xᵀ·dy): a panel's column is contiguous.
        for (p, d) in dst.chunks_exact_mut(mr).take(kc).enumerate() {
            copy_short(&mut d[..rows], &a.data[(p0 + p) * a.cs + i0..][..rows]);
        }
    } else {
        for p in 0..kc {
            for i in 0..rows {
                dst[p * mr + i] = a.at(i0 + i, p0 + p);
            }
        }
    }
}

/// How many stored rows ahead [`pack_a_transposed`] prefetches.
const PREFETCH_ROWS: usize = 8;

/// [`pack_a`] for all the panels of a block of `mlen` rows of a transposed
/// `a` (`Aᵀ` stored row-major, the weight gradients' `xᵀ`) at once, a stored
/// row at a time: each is `mlen` contiguous values that the panels take `mr`
/// each. Packed a panel at a time, the same block read `mr` values from
/// each of `kc` rows a stored row apart (6 KiB in a 1536-wide `xᵀ`), every
/// read waiting on its line: 11% of a 1536 × 2048 · 2048 × 384 product on
/// a Zen 3 EPYC. Each stored row is a page of its own to the hardware
/// prefetchers (rows of `xᵀ` are kilobytes apart), so the rows
/// [`PREFETCH_ROWS`] ahead are asked for in software: the weight gradients'
/// shapes 1.03-1.10x (medians of 20 calls alternated with the build
/// without, one and two threads, Zen 3; 4 and 16 rows ahead measured
/// alike). Each panel's copy is a fixed move of `mr` values (the kernels'
/// 6 or 4): a copy of a length known only at run time went through a jump
/// table and its bounds checks for every 24 bytes.
fn pack_a_transposed(
    a: &MatRef,
    i0: usize,
    mlen: usize,
    p0: usize,
    kc: usize,
    mr: usize,
    dst: &mut [f32],
) {
    match mr {
        6 => pack_a_transposed_by::<6>(a, i0, mlen, p0, kc, dst),
        4 => pack_a_transposed_by::<4>(a, i0, mlen, p0, kc, dst),
        // AVX512_BF16's, of pairs given by column (`gemm_bf16_pairs`).
        12 => pack_a_transposed_by::<12>(a, i0, mlen, p0, kc, dst),
        _ => unreachable!("the kernels' packed panels are 12, 6 or 4 rows, not {mr}"),
    }
}

/// [`pack_a_transposed`] for panels of `MR` rows.
fn pack_a_transposed_by<const MR: usize>(
    a: &MatRef,
    i0: usize,
    mlen: usize,
    p0: usize,
    kc: usize,
    dst: &mut [f32],
) {
    let (full, rest) = (mlen / MR, mlen % MR);
    let (panels, last) = dst.split_at_mut(full * MR * kc);
    if rest > 0 {
        last.fill(0.0);
    }
    for p in 0..kc {
        let row = &a.data[(p0 + p) * a.cs + i0..][..mlen];
        #[cfg(target_arch = "x86_64")]
        if p + PREFETCH_ROWS < kc {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let ahead = &a.data[(p0 + p + PREFETCH_ROWS) * a.cs + i0..][..mlen];
            for line in ahead.chunks(16) {
                // SAFETY: a prefetch is a hint, its address inside `a`.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
            }
        }
        for (panel, src) in panels.chunks_exact_mut(MR * kc).zip(row.chunks_exact(MR)) {
            let d: &mut [f32; MR] = (&mut panel[p * MR..p * MR + MR])
                .try_into()
                .expect("MR floats");
            *d = src.try_into().expect("MR floats");
        }
        if rest > 0 {
            last[p * MR..][..rest].copy_from_slice(&row[full * MR..]);
        }
    }
}

/// Packs rows `p0..p0+kc`, columns `j0..j1` of `b` into consecutive panels
/// of `nr` columns (`dst` holds them: `kc·nr` values each).
///
/// A row-major `B` is read [`SUM_GROUP`] rows at a time across all the
/// panels ([`pack_rows_into`]): packing one panel at a time down all `kc`
/// rows reads 64 bytes from each row, each row on another page for any `B`
/// wider than 1024 columns, which the hardware prefetchers do not follow
/// across, so every line waited on memory (a tenth of a 384×2048×1152
/// product); a group's sixteen rows are each read along their length as
/// its panels are packed one after another. Other layouts go a panel at a
/// time.
#[allow(clippy::too_many_arguments)]
fn pack_b_panels(
    b: &MatRef,
    p0: usize,
    kc: usize,
    j0: usize,
    j1: usize,
    nr: usize,
    dst: &mut [f32],
    sums: Option<&mut [f32]>,
) {
    let panels = dst.chunks_mut(nr * kc).zip((j0..j1).step_by(nr));
    if b.cs != 1 {
        assert!(
            sums.is_none(),
            "column sums need a row-major B (gemm_summing_b)"
        );
        for (d, j) in panels {
            pack_b(b, p0, kc, j, nr.min(j1 - j), nr, d);
        }
        return;
    }
    let mut panels: Vec<(&mut [f32], usize)> = panels.collect();
    pack_rows_into(b, p0, kc, j1, nr, &mut panels, sums.map(GroupSums::Add));
}

/// Packs a row-major `B`'s block of depth (rows `p0..p0+kc`, columns
/// `j0..j1`) into `dst`'s panels (as [`pack_b_panels`]) on `threads`
/// threads, each taking a run of the rows across every panel, so that each
/// thread reads one contiguous stretch of `B` (where `B` is no wider than
/// the block). Threads that each took a run of panels read a part of every
/// row, stretches of 2.3 KiB from rows 4.5 KiB apart in the weight
/// gradient below, and packed at a third of one thread's rate per thread.
/// Alternated call by call on a Zen 3 EPYC, 2 threads (medians of
/// 30): the weight gradients 384 × 2048 · 2048 × 384, 1152 and 1536
/// 1.05-1.12x, the other shapes level (1.00-1.02x); perf of the 1152 one
/// put packing at 7% of its samples, from 14%. A later sitting on the same
/// kind of machine measured those three at 0.94-0.98x of the runs of
/// panels in six rounds of seven (PERFORMANCE.md): which wins moves with
/// the host.
///
/// With `sums` ([`gemm_summing_b`]: the sums of `B`'s columns `j0..j1`,
/// and a buffer), the runs start at groups of [`SUM_GROUP`] rows: the
/// first thread adds its groups' sums into `sums` as it goes, the others
/// keep each group's in a row of the buffer, added in order once all are
/// packed, so every sum is made in the same order as on one thread. (The
/// sums took runs of panels before: on a Zen 2 EPYC, 2 threads, the
/// packing of the weight gradient 384 × 2048 · 2048 × 1152 took 1.6 times
/// one thread's samples that way, against 1.1 times for the rows.)
#[allow(clippy::too_many_arguments)]
fn pack_b_rows_split(
    b: &MatRef,
    p0: usize,
    kc: usize,
    j0: usize,
    j1: usize,
    nr: usize,
    threads: usize,
    dst: &mut [f32],
    sums: Option<(&mut [f32], &mut Vec<f32>)>,
) {
    let groups = kc.div_ceil(SUM_GROUP);
    let rows = |t: usize| {
        let g = chunk(groups, threads, t);
        g.start * SUM_GROUP..(g.end * SUM_GROUP).min(kc)
    };
    // Each thread's part of each panel: the panel's rows of its run.
    let mut parts: Vec<Vec<(&mut [f32], usize)>> = (0..threads).map(|_| Vec::new()).collect();
    for (panel, j) in dst.chunks_mut(nr * kc).zip((j0..j1).step_by(nr)) {
        let mut rest = panel;
        for (t, part) in parts.iter_mut().enumerate() {
            let (mine, after) = rest.split_at_mut(rows(t).len() * nr);
            part.push((mine, j));
            rest = after;
        }
    }
    let width = j1 - j0;
    let later = (groups - chunk(groups, threads, 0).len()) * width;
    let (mut sums, mut buffer) = match sums {
        Some((sums, buffer)) => {
            grow(buffer, later);
            (Some(sums), Some(&mut buffer[..later]))
        }
        None => (None, None),
    };
    // Where each thread's groups' sums go.
    let mut outs = vec![sums.as_deref_mut().map(GroupSums::Add)];
    let mut rest = buffer.as_deref_mut();
    for t in 1..threads {
        outs.push(match rest.take() {
            Some(r) => {
                let (mine, after) = r.split_at_mut(chunk(groups, threads, t).len() * width);
                rest = Some(after);
                Some(GroupSums::Rows(mine))
            }
            None => None,
        });
    }
    parts
        .into_par_iter()
        .zip(outs)
        .enumerate()
        .for_each(|(t, (mut part, out))| {
            let rows = rows(t);
            pack_rows_into(b, p0 + rows.start, rows.len(), j1, nr, &mut part, out);
        });
    if let (Some(sums), Some(buffer)) = (sums, buffer) {
        for group in buffer.chunks(width) {
            sums.iter_mut().zip(group).for_each(|(s, g)| *s += g);
        }
    }
}

/// Where [`pack_rows_into`] puts the column sums of each group of
/// [`SUM_GROUP`] rows it packs.
enum GroupSums<'s> {
    /// Added into these, group by group: the rows packed are the next
    /// groups of the sums.
    Add(&'s mut [f32]),
    /// Each group's in its own row of these, for the caller to add in order.
    Rows(&'s mut [f32]),
}

/// Copies rows `p0..p0+rows` of a row-major `b` into `panels`: each
/// `(dst, j)` takes columns `j..j+nr` (those before `j1`) as `rows` groups
/// of `nr` values, zero right of `j1`. With `sums`, sums the rows' columns
/// `panels[0].j..j1` in groups of [`SUM_GROUP`] rows (`p0` starts a group;
/// a group ends at the last row) into it ([`GroupSums`]).
///
/// The rows go a group at a time, and within a group a panel at a time
/// ([`pack_row_group`]): each of a group's rows is read along its length
/// as its panels are written, one contiguous run (a kilobyte of a 16-wide
/// panel) after another, and a panel's column sums stay in registers. Row
/// after row across every
/// panel, with the sums a second pass over each row, the packing of a
/// small weight gradient, 128 × 512 · 512 × 384, took 9% of its time, a
/// third of that the sums; now 6.7%, and the products with their sums run
/// as fast as without. Builds run by run against OpenBLAS on a Zen 2 EPYC
/// (medians): that product 0.89x → 0.92x at one thread and 0.90-0.91x →
/// 0.93-0.95x at two, the anchor's 384 × 2048 · 2048 × 1152 0.93-0.94x →
/// 0.96-0.97x at two; the products without sums level.
fn pack_rows_into(
    b: &MatRef,
    p0: usize,
    rows: usize,
    j1: usize,
    nr: usize,
    panels: &mut [(&mut [f32], usize)],
    mut sums: Option<GroupSums>,
) {
    let j0 = panels.first().map_or(j1, |(_, j)| *j);
    let width = j1 - j0;
    // The sums of the group being packed.
    let mut group = vec![0f32; if sums.is_some() { width } else { 0 }];
    for (d, j) in panels.iter_mut() {
        if j1 - *j < nr {
            d.fill(0.0);
        }
    }
    for (ended, g0) in (0..rows).step_by(SUM_GROUP).enumerate() {
        let group_rows = SUM_GROUP.min(rows - g0);
        for (d, j) in panels.iter_mut() {
            let cols = nr.min(j1 - *j);
            let first = (p0 + g0) * b.rs + *j;
            let last = (p0 + g0 + group_rows - 1) * b.rs + *j + cols;
            let block = RowGroup {
                src: &b.data[first..last],
                rs: b.rs,
                rows: group_rows,
                cols,
            };
            let dst = &mut d[g0 * nr..(g0 + group_rows) * nr];
            let panel_sums = (!group.is_empty()).then(|| &mut group[*j - j0..][..cols]);
            pack_row_group(&block, nr, dst, panel_sums);
        }
        match sums.as_mut() {
            Some(GroupSums::Add(s)) => s.iter_mut().zip(&group).for_each(|(s, g)| *s += g),
            Some(GroupSums::Rows(r)) => r[ended * width..][..width].copy_from_slice(&group),
            None => {}
        }
    }
}

/// Up to [`SUM_GROUP`] rows of a panel's columns of a row-major `B`: row
/// `i`'s values at `src[i·rs..i·rs + cols]`.
struct RowGroup<'b> {
    src: &'b [f32],
    rs: usize,
    rows: usize,
    cols: usize,
}

/// Copies `g`'s rows into `dst` (`nr` floats a row, the columns right of
/// `g.cols` left as they are) and, with `sums`, writes each column's sum
/// over the rows into it, added in row order from zero (so that every bit
/// is what a row-by-row sum makes). Whole panels of 16 or 64 columns go
/// through AVX where the CPU has it, the sums in registers (the plain
/// path's go through memory).
fn pack_row_group(g: &RowGroup, nr: usize, dst: &mut [f32], sums: Option<&mut [f32]>) {
    #[cfg(target_arch = "x86_64")]
    if g.cols == nr && matches!(nr, 16 | 64) && has_avx() {
        // SAFETY: the CPU has AVX (the function checks the slices' bounds).
        unsafe {
            match (nr == 16, sums) {
                (true, None) => pack_row_group_avx::<2, false>(g, dst, &mut []),
                (true, Some(s)) => pack_row_group_avx::<2, true>(g, dst, s),
                (false, None) => pack_row_group_avx::<8, false>(g, dst, &mut []),
                (false, Some(s)) => pack_row_group_avx::<8, true>(g, dst, s),
            }
        }
        return;
    }
    pack_row_group_plain(g, nr, dst, sums);
}

/// [`pack_row_group`] in plain Rust.
fn pack_row_group_plain(g: &RowGroup, nr: usize, dst: &mut [f32], mut sums: Option<&mut [f32]>) {
    if let Some(s) = sums.as_deref_mut() {
        s.fill(0.0);
    }
    for i in 0..g.rows {
        let row = &g.src[i * g.rs..][..g.cols];
        copy_short(&mut dst[i * nr..][..g.cols], row);
        if let Some(s) = sums.as_deref_mut() {
            s.iter_mut().zip(row).for_each(|(s, v)| *s += v);
        }
    }
}

/// [`pack_row_group`] of a whole panel of `8·V` columns with AVX; the sums
/// where `SUMS`.
///
/// # Safety
///
/// The CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn pack_row_group_avx<const V: usize, const SUMS: bool>(
    g: &RowGroup,
    dst: &mut [f32],
    sums: &mut [f32],
) {
    use std::arch::x86_64::*;
    let nr = 8 * V;
    assert!(g.rows > 0 && g.src.len() >= (g.rows - 1) * g.rs + nr);
    assert!(dst.len() >= g.rows * nr && (!SUMS || sums.len() >= nr));
    let mut acc = [_mm256_setzero_ps(); V];
    for i in 0..g.rows {
        for (v, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row i's values 8v..8v+8 of the group and of the
            // panel, inside the slices (asserted above).
            unsafe {
                let x = _mm256_loadu_ps(g.src.as_ptr().add(i * g.rs + 8 * v));
                _mm256_storeu_ps(dst.as_mut_ptr().add(i * nr + 8 * v), x);
                if SUMS {
                    *acc = _mm256_add_ps(*acc, x);
                }
            }
        }
    }
    if SUMS {
        for (v, acc) in acc.into_iter().enumerate() {
            // SAFETY: sums holds nr floats (asserted above).
            unsafe { _mm256_storeu_ps(sums.as_mut_ptr().add(8 * v), acc) };
        }
    }
}

/// Packs rows `p0..p0+kc`, columns `j0..j0+cols` (`cols ≤ nr`) of a `b`
/// whose rows are not contiguous (row-major ones go through
/// [`pack_b_panels`]) into `dst` as `kc` rows of `nr` values, zero right of
/// the last column.
fn pack_b(b: &MatRef, p0: usize, kc: usize, j0: usize, cols: usize, nr: usize, dst: &mut [f32]) {
    if cols < nr {
        dst.fill(0.0);
    }
    if b.rs == 1 {
        // Bᵀ stored row-major (dy·Wᵀ, q·kᵀ): columns of B are contiguous,
        // so the panel is a transpose.
        pack_transposed(b, p0, kc, j0, cols, nr, dst);
    } else {
        for p in 0..kc {
            for j in 0..cols {
                dst[p * nr + j] = b.at(p0 + p, j0 + j);
            }
        }
    }
}

/// [`pack_b`] of a `B` stored as bf16 bits, each value widened as it is
/// packed: the panels [`pack_b`] makes of the widened `B`.
fn pack_b_widened(
    b: &MatRef<u16>,
    p0: usize,
    kc: usize,
    j0: usize,
    cols: usize,
    nr: usize,
    dst: &mut [f32],
) {
    if cols < nr {
        dst.fill(0.0);
    }
    for (p, panel_row) in dst.chunks_exact_mut(nr).take(kc).enumerate() {
        let out = &mut panel_row[..cols];
        if b.cs == 1 {
            let row = &b.data[(p0 + p) * b.rs + j0..][..cols];
            for (d, &v) in out.iter_mut().zip(row) {
                *d = bf16_value(v);
            }
        } else {
            for (j, d) in out.iter_mut().enumerate() {
                *d = bf16_value(b.at(p0 + p, j0 + j));
            }
        }
    }
}

/// [`pack_b`] for a `B` whose columns are contiguous: 8×8 tiles transposed in
/// AVX registers where the CPU has AVX (eight loads, 24 shuffles, eight
/// stores for 64 values; one scalar store a value cost a quarter of the
/// attention score products, whose panels are packed afresh for every block
/// of 64 queries), the edges one value at a time.
fn pack_transposed(
    b: &MatRef,
    p0: usize,
    kc: usize,
    j0: usize,
    cols: usize,
    nr: usize,
    dst: &mut [f32],
) {
    let (mut cols8, mut kc8) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if has_avx() {
        (cols8, kc8) = (cols / 8 * 8, kc / 8 * 8);
        let need = (j0 + cols8.max(1) - 1) * b.cs + p0 + kc8;
        assert!(dst.len() >= kc * nr && b.data.len() >= need);
        // SAFETY: AVX is present; every load reads columns j0..j0+cols8,
        // rows p0..p0+kc8 of B (inside its data, checked above) and every
        // store rows 0..kc8, columns 0..cols8 of the panel (inside dst).
        unsafe {
            transpose_tiles_avx(
                b.data.as_ptr(),
                b.cs,
                p0,
                kc8,
                j0,
                cols8,
                nr,
                dst.as_mut_ptr(),
            )
        };
    }
    for j in 0..cols {
        let src = &b.data[(j0 + j) * b.cs + p0..][..kc];
        let from = if j < cols8 { kc8 } else { 0 };
        for (p, &v) in src.iter().enumerate().skip(from) {
            dst[p * nr + j] = v;
        }
    }
}

/// Whether the CPU has AVX, detected once.
#[cfg(target_arch = "x86_64")]
fn has_avx() -> bool {
    static AVX: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX.get_or_init(|| std::arch::is_x86_feature_detected!("avx"))
}

/// `dst[p·nr + j] = b[(j0 + j)·cs + p0 + p]` for p < kc8, j < cols8 (both
/// multiples of 8), in 8×8 tiles.
///
/// # Safety
/// The CPU has AVX; those reads and writes are inside their buffers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[allow(clippy::too_many_arguments)]
unsafe fn transpose_tiles_avx(
    b: *const f32,
    cs: usize,
    p0: usize,
    kc8: usize,
    j0: usize,
    cols8: usize,
    nr: usize,
    dst: *mut f32,
) {
    use std::arch::x86_64::*;
    for j in (0..cols8).step_by(8) {
        for p in (0..kc8).step_by(8) {
            // SAFETY: (caller) row i of the tile is column j0 + j + i of B,
            // values p0 + p .. p0 + p + 8; the stores are rows p..p+8 of the
            // panel, values j..j+8.
            unsafe {
                let r: [__m256; 8] =
                    std::array::from_fn(|i| _mm256_loadu_ps(b.add((j0 + j + i) * cs + p0 + p)));
                let rows = transpose8(r);
                for (q, row) in rows.into_iter().enumerate() {
                    _mm256_storeu_ps(dst.add((p + q) * nr + j), row);
                }
            }
        }
    }
}

/// The transpose of an 8×8 block held as eight rows of 256 bits: row `q`
/// of the result holds element `q` of each row, in row order.
///
/// # Safety
/// The CPU has AVX (the callers' `target_feature`, into which this inlines).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn transpose8(
    r: [std::arch::x86_64::__m256; 8],
) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    // SAFETY: register operations only; AVX (caller).
    unsafe {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }
}

/// `dst.copy_from_slice(src)` for the lengths packing copies (a panel's
/// height or width) as fixed-size moves: at 24 or 64 bytes, a call to
/// `memcpy` per row cost more than the copy (3% of a training step).
#[inline(always)]
fn copy_short(dst: &mut [f32], src: &[f32]) {
    #[inline(always)]
    fn fixed<const N: usize>(dst: &mut [f32], src: &[f32]) {
        let d: &mut [f32; N] = dst.try_into().expect("N floats");
        *d = src.try_into().expect("N floats");
    }
    match dst.len() {
        4 => fixed::<4>(dst, src),
        6 => fixed::<6>(dst, src),
        12 => fixed::<12>(dst, src),
        16 => fixed::<16>(dst, src),
        32 => fixed::<32>(dst, src),
        _ => dst.copy_from_slice(src),
    }
}

#[cfg(test)]
mod tests;
