//! The micro-kernels: one `mr × nr` tile of `C` from a packed `A` panel and
//! a packed `B` panel, `k` rank-1 updates held in registers.
//!
//! Each element is a fused multiply-add chain over `p`, then `c = r + c`
//! where a residual is given (crate doc). An f32 or AVX512_BF16 tile
//! with α = 1 starts its chain from `C` (where it adds into `C`) or the bias
//! and stores it as it ends ([`Tile::chains`]); otherwise the chain starts from zero and is
//! stored as `c = α·acc` or `c = c + α·acc` with a separate multiply and
//! add. The SIMD kernels and the portable one agree bit for bit. Tiles at
//! the right and bottom edges of `C` are computed whole (the packing padded
//! them with zeros) and only their live part is stored, with the same
//! arithmetic; except where AVX2's chaining tiles end a row block with 1-3
//! rows, which run across several panels at a time ([`ShortRows`]), each
//! element the same chain.

/// One tile's work.
pub(crate) struct Tile {
    /// Rank-1 updates (a block's depth, `≤ DEEP_KC`).
    pub(crate) k: usize,
    /// The `A` panel: element `(i, p)` at `a + i·a_rs + p·a_cs` (packed:
    /// `(1, mr)`; read in place from a row-major `A`: `(row stride, 1)`, or
    /// from a transposed one: `(1, column stride)`).
    pub(crate) a: *const f32,
    pub(crate) a_rs: usize,
    pub(crate) a_cs: usize,
    /// The packed `B` panel: `k` rows of `nr` values.
    pub(crate) b: *const f32,
    pub(crate) alpha: f32,
    /// `C += …` instead of `C = …`.
    pub(crate) add: bool,
    /// If not null (and not `add`): the tile's columns of the bias, where
    /// the chain starts (α = 1) or `c = bias[j] + α·acc`.
    pub(crate) bias: *const f32,
    /// If not null: `c = r + c` as the tile is stored, `r` the tile's
    /// element (0, 0) of the residual, whose rows are `residual_rs` apart.
    pub(crate) residual: *const f32,
    pub(crate) residual_rs: usize,
    /// Element (0, 0) of the tile in `C`.
    pub(crate) c: *mut f32,
    /// `C`'s row stride.
    pub(crate) rs: usize,
    /// Live rows (`≤ mr`) and columns (`≤ nr`) of the tile.
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// Which operand streams past this tile (AMX loads it without
    /// keeping it in L1).
    pub(crate) streams: Streams,
}

/// Which of a tile's operands is read once for it, where the other is
/// read again by the tiles that follow (`Kernel::a_rows_outside`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Streams {
    /// `A`'s rows (a panel of `B` stays for a column of tiles).
    A,
    /// `B`'s panel (`A`'s rows stay for a row of tiles).
    B,
}

/// A run of whole tiles that chain (α = 1) with nothing done after each, one
/// after another down a column of tiles or along a row of them: tile `i` reads
/// `A` at `a.nth(i)` (at strides `a_strides`), `B` at `b.nth(i)` and writes `C`
/// at `c.nth(i)` (rows `rs` apart), starting from `C` where `add`, else from
/// the bias at `bias.nth(i)` unless it is null, else zero, and adding the
/// residual at `residual.nth(i)` (rows `residual_rs` apart) unless it is null.
/// The driver hands a kernel a strip rather than a call a tile: building each
/// tile's arguments and calling through the kernel match took 2-3% of a weight
/// gradient's time on a Zen 2 EPYC (perf), the kernel's own setup around its
/// updates another 6%. With both gone (strips, and `avx2_chain`), alternated
/// against OpenBLAS call by call on that machine (medians, two rounds each):
/// the model's seven shapes went from 0.92-1.00x to 0.95-1.02x at one thread
/// (the 384-row weight gradient, the lowest, from 0.92-0.94x to 0.95-0.97x) and
/// from 0.89-1.00x to 0.89-1.08x at two (that gradient 0.86-0.90x before,
/// 0.89-0.96x after over five runs); a transformer block +3% (`block_bench`,
/// one thread), a training step +2-3% (`scripts/ab.sh`, the same bits).
pub(crate) struct Strip {
    pub(crate) tiles: usize,
    pub(crate) k: usize,
    pub(crate) a: Walk,
    pub(crate) a_strides: (usize, usize),
    pub(crate) b: Walk,
    pub(crate) c: Walk,
    pub(crate) rs: usize,
    pub(crate) add: bool,
    pub(crate) bias: Walk,
    pub(crate) residual: Walk,
    pub(crate) residual_rs: usize,
}

/// Where each tile of a [`Strip`] finds one of its operands: `at` for the
/// first, `step` floats further for each next one; null for all of them
/// where `at` is null (no bias, no residual).
#[derive(Clone, Copy)]
pub(crate) struct Walk {
    pub(crate) at: *const f32,
    pub(crate) step: usize,
}

impl Walk {
    /// Tile `i`'s pointer.
    pub(crate) fn nth(self, i: usize) -> *const f32 {
        if self.at.is_null() {
            self.at
        } else {
            self.at.wrapping_add(i * self.step)
        }
    }
}

/// The last rows of a row block, fewer than a tile's six (1-3: what a
/// block whose rows are not a multiple of six leaves), across `panels`
/// whole panels of `B`, chaining (α = 1) with nothing done after (as a
/// [`Strip`]'s tiles): `C`'s rows `0..rows` and columns `0..16·panels` from
/// `c` (rows `rs` apart), starting from `C` where `add`, else from the bias
/// unless null, else zero, adding the residual unless null. `A` is packed
/// (element `(i, p)` at `a + 6p + i`), panel `w` of `B` at `b + w·panel_stride`.
pub(crate) struct ShortRows {
    pub(crate) rows: usize,
    pub(crate) panels: usize,
    pub(crate) k: usize,
    pub(crate) a: *const f32,
    pub(crate) b: *const f32,
    pub(crate) panel_stride: usize,
    pub(crate) c: *mut f32,
    pub(crate) rs: usize,
    pub(crate) add: bool,
    pub(crate) bias: *const f32,
    pub(crate) residual: *const f32,
    pub(crate) residual_rs: usize,
}

impl Tile {
    /// Whether a tile's sums (f32, AVX512_BF16) continue the chain that `C` (where it
    /// adds into `C`) or the bias holds: with α = 1 each element of a
    /// product is one fused multiply-add chain over all of `k`, whatever its
    /// blocks of depth (crate doc).
    pub(crate) fn chains(&self) -> bool {
        self.alpha == 1.0
    }

    /// Whether a chaining tile starts from values (`C`'s or the bias's)
    /// rather than zero.
    fn starts_from_values(&self) -> bool {
        self.chains() && (self.add || !self.bias.is_null())
    }
}

/// Writes what a chaining tile's sums start from into the live part of
/// `acc` (`mr × nr`, row after row): `C`'s elements where the tile adds into
/// `C`, else the bias's columns.
///
/// # Safety
///
/// As [`store_edge`]'s.
unsafe fn chain_starts(t: &Tile, acc: &mut [f32], nr: usize) {
    for i in 0..t.rows {
        for j in 0..t.cols {
            // SAFETY: (i, j) is a live element of the tile, and j a live
            // column of the bias (caller).
            acc[i * nr + j] = unsafe {
                if t.add {
                    *t.c.add(i * t.rs + j)
                } else {
                    *t.bias.add(j)
                }
            };
        }
    }
}

/// Stores the live part of a finished tile held in `acc` (`mr × nr`, row
/// after row).
///
/// # Safety
///
/// `t.c` must be valid for `t.rows` rows of `t.cols` floats at stride `t.rs`,
/// `t.bias`, unless null, for `t.cols` floats, and `t.residual`, unless
/// null, for the tile's live part at stride `t.residual_rs`.
unsafe fn store_edge(t: &Tile, acc: &[f32], nr: usize, chained: bool) {
    for i in 0..t.rows {
        for j in 0..t.cols {
            let v = t.alpha * acc[i * nr + j];
            // SAFETY: (i, j) is a live element of the tile (caller).
            let c = unsafe { &mut *t.c.add(i * t.rs + j) };
            let v = if chained {
                acc[i * nr + j]
            } else if t.add {
                *c + v
            } else if !t.bias.is_null() {
                // SAFETY: the bias holds the tile's live columns (caller).
                unsafe { *t.bias.add(j) + v }
            } else {
                v
            };
            *c = if t.residual.is_null() {
                v
            } else {
                // SAFETY: the residual holds the tile's live part (caller).
                unsafe { *t.residual.add(i * t.residual_rs + j) + v }
            };
        }
    }
}

/// The reference kernel, 4×16, in plain Rust.
///
/// # Safety
///
/// `t.a` must be valid for `4 × t.k` elements at its strides, `t.b` hold
/// `16·t.k` floats, `t.c` be valid for the live part of the tile (as
/// [`store_edge`]), written by no one else, `t.bias`, unless null, hold
/// the tile's live columns, and `t.residual`, unless null, the tile's live
/// part at its stride.
pub(crate) unsafe fn portable(t: &Tile) {
    const MR: usize = 4;
    const NR: usize = 16;
    // SAFETY: the B panel's length (caller).
    let b = unsafe { std::slice::from_raw_parts(t.b, NR * t.k) };
    let mut acc = [0f32; MR * NR];
    if t.starts_from_values() {
        // SAFETY: the tile's live part is valid (caller).
        unsafe { chain_starts(t, &mut acc, NR) };
    }
    for (p, bp) in b.chunks_exact(NR).enumerate() {
        for i in 0..MR {
            // SAFETY: (i, p) is inside the A panel (caller).
            let ai = unsafe { *t.a.add(i * t.a_rs + p * t.a_cs) };
            for (j, &bj) in bp.iter().enumerate() {
                acc[i * NR + j] = ai.mul_add(bj, acc[i * NR + j]);
            }
        }
    }
    // SAFETY: the tile's live part is valid (caller).
    unsafe { store_edge(t, &acc, NR, t.chains()) }
}

/// The reference for the bf16 kernels, 4×16, in plain Rust: each 4-byte
/// element of `A` and `B` holds two bf16 values along `k` (the even one in
/// the low half), and each update is AVX512_BF16's `vdpbf16ps` as Intel's
/// manual defines it: `acc += a₁·b₁`, then `acc += a₀·b₀`, each product
/// exact in f32 and each sum rounded to nearest even, bf16 inputs below
/// f32's normal range read as zero and sums below it flushed to zero.
///
/// # Safety
///
/// As [`portable`], counting elements in 4-byte pairs.
pub(crate) unsafe fn portable_bf16(t: &Tile) {
    const MR: usize = 4;
    const NR: usize = 16;
    fn halves(pair: u32) -> [f32; 2] {
        let widen = |h: u32| {
            let v = f32::from_bits(h << 16);
            if v.is_subnormal() {
                0.0f32.copysign(v)
            } else {
                v
            }
        };
        [widen(pair & 0xffff), widen(pair >> 16)]
    }
    fn flush(v: f32) -> f32 {
        if v.is_subnormal() {
            0.0f32.copysign(v)
        } else {
            v
        }
    }
    // SAFETY: the B panel's length (caller).
    let b = unsafe { std::slice::from_raw_parts(t.b.cast::<u32>(), NR * t.k) };
    let mut acc = [0f32; MR * NR];
    if t.starts_from_values() {
        // SAFETY: the tile's live part is valid (caller).
        unsafe { chain_starts(t, &mut acc, NR) };
        // `vdpbf16ps` reads its accumulator with denormals as zero.
        for c in acc.iter_mut() {
            *c = flush(*c);
        }
    }
    for (p, bp) in b.chunks_exact(NR).enumerate() {
        for i in 0..MR {
            // SAFETY: (i, p) is inside the A panel (caller).
            let [a0, a1] = halves(unsafe { *t.a.cast::<u32>().add(i * t.a_rs + p * t.a_cs) });
            for (j, &bj) in bp.iter().enumerate() {
                let [b0, b1] = halves(bj);
                let c = &mut acc[i * NR + j];
                *c = flush(a1.mul_add(b1, *c));
                *c = flush(a0.mul_add(b0, *c));
            }
        }
    }
    // SAFETY: the tile's live part is valid (caller).
    unsafe { store_edge(t, &acc, NR, t.chains()) }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{
    amx_bf16, avx2, avx2_short_rows, avx2_strip, avx512, avx512_bf16, dpbf16_chains_avx512,
    fma_chains_avx2, fma_chains_avx512,
};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{chain_starts, store_edge, ShortRows, Streams, Strip, Tile};

    /// Asks for the tile's live rows of `C` while the updates run: `C` is
    /// too big for any cache, and its loads and stores at the end would
    /// otherwise stall on memory (measured: a fifth of the time of a
    /// 2048×384·384×1152 product).
    fn prefetch_c(t: &Tile, nr: usize) {
        prefetch_c_rows(t, 0..t.rows, nr);
    }

    /// [`prefetch_c`] for the tile's rows `rows`.
    fn prefetch_c_rows(t: &Tile, rows: std::ops::Range<usize>, nr: usize) {
        for i in rows {
            let row = t.c.wrapping_add(i * t.rs);
            for j in (0..t.cols.min(nr)).step_by(16).chain([t.cols.min(nr) - 1]) {
                // SAFETY: a prefetch is a hint; it does not fault, and the
                // address is inside the tile's live part anyway.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(j) as *const i8) };
            }
        }
    }

    /// `iterations` steps of twelve independent chains of `vfmadd231ps` on
    /// 256-bit registers, nothing else: the most FLOPs this core's FMA units
    /// can do (twelve chains cover the latency times the ports of every
    /// AVX2 CPU so far). Returns the FLOPs done.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn fma_chains_avx2(iterations: u64) -> u64 {
        if iterations == 0 {
            return 0;
        }
        // SAFETY: registers only; the CPU has AVX2 and FMA (caller).
        unsafe {
            std::arch::asm!(
                "vxorps ymm0, ymm0, ymm0", "vxorps ymm1, ymm1, ymm1",
                "vxorps ymm2, ymm2, ymm2", "vxorps ymm3, ymm3, ymm3",
                "vxorps ymm4, ymm4, ymm4", "vxorps ymm5, ymm5, ymm5",
                "vxorps ymm6, ymm6, ymm6", "vxorps ymm7, ymm7, ymm7",
                "vxorps ymm8, ymm8, ymm8", "vxorps ymm9, ymm9, ymm9",
                "vxorps ymm10, ymm10, ymm10", "vxorps ymm11, ymm11, ymm11",
                "vxorps ymm12, ymm12, ymm12", "vxorps ymm13, ymm13, ymm13",
                ".p2align 5",
                "2:",
                "vfmadd231ps ymm0, ymm12, ymm13", "vfmadd231ps ymm1, ymm12, ymm13",
                "vfmadd231ps ymm2, ymm12, ymm13", "vfmadd231ps ymm3, ymm12, ymm13",
                "vfmadd231ps ymm4, ymm12, ymm13", "vfmadd231ps ymm5, ymm12, ymm13",
                "vfmadd231ps ymm6, ymm12, ymm13", "vfmadd231ps ymm7, ymm12, ymm13",
                "vfmadd231ps ymm8, ymm12, ymm13", "vfmadd231ps ymm9, ymm12, ymm13",
                "vfmadd231ps ymm10, ymm12, ymm13", "vfmadd231ps ymm11, ymm12, ymm13",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) iterations => _,
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                out("ymm12") _, out("ymm13") _,
                options(nostack, nomem),
            );
        }
        iterations * 12 * 8 * 2
    }

    /// Twelve independent chains of `$op` (`zmm_i += zmm12 ⊙ zmm13`) on
    /// 512-bit registers for `$n` steps, and nothing else: an instruction's
    /// throughput, the arithmetic ceiling its kernels are set against.
    macro_rules! chains_zmm {
        ($op:literal, $n:expr) => {
            std::arch::asm!(
                "vxorps zmm0, zmm0, zmm0", "vxorps zmm1, zmm1, zmm1",
                "vxorps zmm2, zmm2, zmm2", "vxorps zmm3, zmm3, zmm3",
                "vxorps zmm4, zmm4, zmm4", "vxorps zmm5, zmm5, zmm5",
                "vxorps zmm6, zmm6, zmm6", "vxorps zmm7, zmm7, zmm7",
                "vxorps zmm8, zmm8, zmm8", "vxorps zmm9, zmm9, zmm9",
                "vxorps zmm10, zmm10, zmm10", "vxorps zmm11, zmm11, zmm11",
                "vxorps zmm12, zmm12, zmm12", "vxorps zmm13, zmm13, zmm13",
                ".p2align 5",
                "2:",
                concat!($op, " zmm0, zmm12, zmm13"), concat!($op, " zmm1, zmm12, zmm13"),
                concat!($op, " zmm2, zmm12, zmm13"), concat!($op, " zmm3, zmm12, zmm13"),
                concat!($op, " zmm4, zmm12, zmm13"), concat!($op, " zmm5, zmm12, zmm13"),
                concat!($op, " zmm6, zmm12, zmm13"), concat!($op, " zmm7, zmm12, zmm13"),
                concat!($op, " zmm8, zmm12, zmm13"), concat!($op, " zmm9, zmm12, zmm13"),
                concat!($op, " zmm10, zmm12, zmm13"), concat!($op, " zmm11, zmm12, zmm13"),
                "dec {n}",
                "jnz 2b",
                n = inout(reg) $n => _,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                out("zmm12") _, out("zmm13") _,
                options(nostack, nomem),
            )
        };
    }

    /// [`fma_chains_avx2`] on 512-bit registers.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn fma_chains_avx512(iterations: u64) -> u64 {
        if iterations == 0 {
            return 0;
        }
        // SAFETY: registers only; the CPU has AVX-512F (caller).
        unsafe { chains_zmm!("vfmadd231ps", iterations) };
        iterations * 12 * 16 * 2
    }

    /// [`fma_chains_avx512`] with `vdpbf16ps`: two products and two adds a
    /// lane, twice an FMA's FLOPs, so that the AVX512_BF16 kernel has a
    /// ceiling of its own (`zrun bench kernels`' `bf16_peak`).
    ///
    /// # Safety
    ///
    /// The CPU must have AVX-512F and AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(crate) unsafe fn dpbf16_chains_avx512(iterations: u64) -> u64 {
        if iterations == 0 {
            return 0;
        }
        // SAFETY: registers only; the CPU has AVX512_BF16 (caller).
        unsafe { chains_zmm!("vdpbf16ps", iterations) };
        iterations * 12 * 16 * 4
    }

    /// 6×16 with AVX2 and FMA: 12 accumulators, two `B` vectors and six
    /// broadcasts of `A` per update, all in [`avx2_chain`]; whole tiles that
    /// chain go there directly (and the driver hands runs of them over as
    /// [`avx2_strip`]s), the others are made in an L1 scratch tile and
    /// stored with their α, bias, residual and edges from there.
    ///
    /// The updates are assembly for the same reason as [`avx512`]'s: the six
    /// rows of `A` are reached from two base pointers (rows 0 and 3) with the
    /// row stride scaled by 1 and 2, three pointer adds a step. Compiled Rust
    /// walked the rows with a chain of dependent adds as long as the step's
    /// twelve FMAs (0.87-0.97x OpenBLAS's Haswell kernel on this crate's
    /// shapes). The order of every update is that of the Rust it replaced.
    ///
    /// Each step also prefetches `B` 16 steps (1 KiB) ahead. The driver runs
    /// all of a block's `A` panels against one `B` panel before the next, so
    /// every 16 tiles the panel changes and its 24 KiB come from L3 a line a
    /// step, which the hardware prefetcher did not hide: on a 2-core EPYC
    /// with half-width FMA units the loop alone, A and B in L1, ran at 0.99
    /// of `fma_peak`, cycling 72 panels at 0.955, and 0.97 with the
    /// prefetch; zgemm's shapes +0.6-1% (21 and 14 alternated pairs, 1 and 2
    /// threads), a transformer block (`block_bench`) unchanged within its 1%
    /// noise. A prefetch never changes a value.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX2 and FMA; `t.a` must be valid for
    /// `6 × t.k` elements at its strides, `t.b` hold `16·t.k` floats, and
    /// `t.c` be valid for the live part of the tile, written by no one else;
    /// `t.bias`, unless null, must hold the tile's live columns, and
    /// `t.residual`, unless null, the tile's live part at its stride.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn avx2(t: &Tile) {
        const MR: usize = 6;
        const NR: usize = 16;
        let whole = t.rows == MR && t.cols == NR;
        if whole && t.chains() {
            let ends = ChainEnds {
                bias: t.bias,
                residual: t.residual,
                residual_rs: t.residual_rs,
            };
            // SAFETY: as this function's (caller): a whole tile.
            unsafe { avx2_chain(t.k, t.a, (t.a_rs, t.a_cs), t.b, (t.c, t.rs), t.add, &ends) };
            return;
        }
        // The rest (edge tiles, and whole ones with α ≠ 1) are made in an
        // L1 scratch tile, from what a chain starts from or from zero, and
        // stored from there.
        prefetch_c(t, NR);
        let mut flat = SmallTile([0.0; MR * NR]);
        let from_values = t.starts_from_values();
        if from_values {
            // SAFETY: the tile's live part is valid (caller).
            unsafe { chain_starts(t, &mut flat.0, NR) };
        }
        let none = ChainEnds {
            bias: std::ptr::null(),
            residual: std::ptr::null(),
            residual_rs: 0,
        };
        // SAFETY: A and B as this function's (caller); the scratch tile is
        // six rows of sixteen floats, this call's own.
        unsafe {
            avx2_chain(
                t.k,
                t.a,
                (t.a_rs, t.a_cs),
                t.b,
                (flat.0.as_mut_ptr(), NR),
                from_values,
                &none,
            )
        };
        if !whole {
            // SAFETY: the live part is valid (caller).
            unsafe { store_edge(t, &flat.0, NR, t.chains()) };
            return;
        }
        let alpha = _mm256_set1_ps(t.alpha);
        for i in 0..MR {
            for h in 0..2 {
                // SAFETY: a whole tile of C is live, and so are the bias's
                // tile columns and the residual's tile where given (caller);
                // 8 floats inside `flat`.
                unsafe {
                    let c = t.c.add(i * t.rs + 8 * h);
                    let v =
                        _mm256_mul_ps(alpha, _mm256_loadu_ps(flat.0.as_ptr().add(i * NR + 8 * h)));
                    let v = if t.add {
                        _mm256_add_ps(_mm256_loadu_ps(c), v)
                    } else if !t.bias.is_null() {
                        _mm256_add_ps(_mm256_loadu_ps(t.bias.add(8 * h)), v)
                    } else {
                        v
                    };
                    let v = if t.residual.is_null() {
                        v
                    } else {
                        let r = t.residual.add(i * t.residual_rs + 8 * h);
                        _mm256_add_ps(_mm256_loadu_ps(r), v)
                    };
                    _mm256_storeu_ps(c, v);
                }
            }
        }
    }

    /// A 6×16 tile in L1, aligned for vector loads and stores.
    #[repr(C, align(32))]
    struct SmallTile([f32; 96]);

    /// The tiles of a [`Strip`], each with [`avx2_chain`].
    ///
    /// # Safety
    ///
    /// The CPU must have AVX2 and FMA, and every tile of `s` must be valid
    /// as [`avx2`] requires of a whole 6×16 tile.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn avx2_strip(s: &Strip) {
        for i in 0..s.tiles {
            let ends = ChainEnds {
                bias: s.bias.nth(i),
                residual: s.residual.nth(i),
                residual_rs: s.residual_rs,
            };
            // SAFETY: tile i of the strip is a whole valid tile (caller).
            unsafe {
                avx2_chain(
                    s.k,
                    s.a.nth(i),
                    s.a_strides,
                    s.b.nth(i),
                    (s.c.nth(i).cast_mut(), s.rs),
                    s.add,
                    &ends,
                )
            };
        }
    }

    /// The rows of a [`ShortRows`] with AVX2 and FMA, two or more panels at
    /// a time: one row across six panels, two across three, three across
    /// two, so that each step has twelve accumulators, as many independent
    /// chains as a whole tile's. Computed as a six-row tile (the packing's
    /// zero rows multiplied too), two rows took the time of six, and one
    /// panel at a time their four chains could not cover the FMA's latency.
    /// Each element is the same chain as in [`avx2_chain`]: the same start,
    /// the same fused multiply-adds in the order of `k`, the same residual
    /// added, so the bits are a whole tile's.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX2 and FMA, `s.rows` be 1-3, and every pointer of
    /// `s` valid as [`ShortRows`] describes it, `C`'s rows written by no one
    /// else.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn avx2_short_rows(s: &ShortRows) {
        let mut p = 0;
        while p < s.panels {
            let w = (s.panels - p).min(6 / s.rows);
            // SAFETY: panels p..p + w of s are valid (caller).
            unsafe {
                match (s.rows, w) {
                    (1, 6) => short_rows::<1, 6>(s, p),
                    (1, 5) => short_rows::<1, 5>(s, p),
                    (1, 4) => short_rows::<1, 4>(s, p),
                    (1, 3) => short_rows::<1, 3>(s, p),
                    (1, 2) => short_rows::<1, 2>(s, p),
                    (1, _) => short_rows::<1, 1>(s, p),
                    (2, 3) => short_rows::<2, 3>(s, p),
                    (2, 2) => short_rows::<2, 2>(s, p),
                    (2, _) => short_rows::<2, 1>(s, p),
                    (3, 2) => short_rows::<3, 2>(s, p),
                    (3, _) => short_rows::<3, 1>(s, p),
                    _ => unreachable!("short rows are 1-3 rows"),
                }
            }
            p += w;
        }
    }

    /// `R` rows of a [`ShortRows`] across its panels `p0..p0 + W`: `2·R·W`
    /// accumulators (at most twelve), `R` broadcasts of `A` a step and one
    /// vector of `B` at a time, sixteen registers at most.
    ///
    /// # Safety
    ///
    /// As [`avx2_short_rows`], for those panels.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn short_rows<const R: usize, const W: usize>(s: &ShortRows, p0: usize) {
        const MR: usize = 6;
        let j0 = 16 * p0;
        let (b, c) = (s.b.wrapping_add(p0 * s.panel_stride), s.c.wrapping_add(j0));
        let mut acc = [[_mm256_setzero_ps(); 12]; R];
        // SAFETY: the loads and stores are of rows 0..R and columns
        // j0..j0 + 16W of C, the bias's columns and the residual's where not
        // null, A's k packed steps and B's panels p0..p0 + W (caller).
        unsafe {
            for (i, row) in acc.iter_mut().enumerate() {
                for (v, x) in row.iter_mut().take(2 * W).enumerate() {
                    if s.add {
                        *x = _mm256_loadu_ps(c.add(i * s.rs + 8 * v));
                    } else if !s.bias.is_null() {
                        *x = _mm256_loadu_ps(s.bias.add(j0 + 8 * v));
                    }
                }
            }
            for p in 0..s.k {
                let a: [__m256; R] =
                    std::array::from_fn(|i| _mm256_broadcast_ss(&*s.a.add(p * MR + i)));
                // Vector v of a row: panel v / 2, its half v % 2.
                for v in 0..2 * W {
                    let bv =
                        _mm256_loadu_ps(b.add((v / 2) * s.panel_stride + 16 * p + 8 * (v % 2)));
                    for (row, &a) in acc.iter_mut().zip(&a) {
                        row[v] = _mm256_fmadd_ps(bv, a, row[v]);
                    }
                }
            }
            for (i, row) in acc.iter().enumerate() {
                for (v, &x) in row.iter().take(2 * W).enumerate() {
                    let x = if s.residual.is_null() {
                        x
                    } else {
                        let r = s.residual.add(i * s.residual_rs + j0 + 8 * v);
                        _mm256_add_ps(_mm256_loadu_ps(r), x)
                    };
                    _mm256_storeu_ps(c.add(i * s.rs + 8 * v), x);
                }
            }
        }
    }

    /// What a chaining tile starts from besides `C` and adds as it stores.
    struct ChainEnds {
        /// The tile's sixteen columns of the bias, or null.
        bias: *const f32,
        /// The tile's element (0, 0) of the residual, or null.
        residual: *const f32,
        /// The residual's row stride.
        residual_rs: usize,
    }

    /// One whole 6×16 tile that chains (α = 1, module doc) in one block of
    /// assembly, the accumulators never leaving their registers: the start
    /// (`C` where `add`, else the bias unless null, else zero), the `k`
    /// updates of [`avx2`], then `c = r + c` where a residual is given, and
    /// the store. (Built up in Rust around the updates' assembly, as
    /// [`avx2`] does for the other tiles, the accumulators went through the
    /// stack and each store through four branches: 6.7% of a weight
    /// gradient's time in the kernel was outside its updates, 3% with
    /// this.)
    ///
    /// # Safety
    ///
    /// The CPU must have AVX2 and FMA; `a` valid for `6 × k` elements at
    /// strides `a_strides` (rows, columns), `b` for `16·k` floats, `c.0` for
    /// six rows of sixteen floats `c.1` apart, written by no one else; the
    /// bias, unless null, for sixteen floats, and the residual, unless null,
    /// for six rows of sixteen at its stride.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_chain(
        k: usize,
        a: *const f32,
        a_strides: (usize, usize),
        b: *const f32,
        c: (*mut f32, usize),
        add: bool,
        ends: &ChainEnds,
    ) {
        let ((a_rs, a_cs), (c, rs)) = (a_strides, c);
        // 0: from C, 1: from the bias, 2: from zero.
        let start: usize = match (add, ends.bias.is_null()) {
            (true, _) => 0,
            (false, false) => 1,
            (false, true) => 2,
        };
        let c3 = c.wrapping_add(3 * rs);
        // What the assembly reads at [ends], [ends + 8], [ends + 16].
        let ends = [ends.bias as usize, ends.residual as usize, ends.residual_rs];
        // SAFETY: the tile's six rows of sixteen floats of C, the bias's
        // sixteen columns and the residual's six rows where not null, A's
        // columns 0..k at its strides and b[..16·k] are valid (caller);
        // the CPU has AVX2 and FMA.
        unsafe {
            std::arch::asm!(
                "cmp {start}, 1",
                "jae 8f",
                "vmovups ymm0, [{c}]",
                "vmovups ymm1, [{c} + 32]",
                "vmovups ymm2, [{c} + {crs}]",
                "vmovups ymm3, [{c} + {crs} + 32]",
                "vmovups ymm4, [{c} + {crs}*2]",
                "vmovups ymm5, [{c} + {crs}*2 + 32]",
                "vmovups ymm6, [{c3}]",
                "vmovups ymm7, [{c3} + 32]",
                "vmovups ymm8, [{c3} + {crs}]",
                "vmovups ymm9, [{c3} + {crs} + 32]",
                "vmovups ymm10, [{c3} + {crs}*2]",
                "vmovups ymm11, [{c3} + {crs}*2 + 32]",
                "jmp 7f",
                // Not from C: ask for C's lines now, which the stores at
                // the end would otherwise wait for (2048 × 384 · 384 × 1536
                // on two threads, C far larger than L2: 0.92-0.93x
                // OpenBLAS without, 1.03-1.05x with).
                "8:",
                "prefetcht0 [{c}]",
                "prefetcht0 [{c} + 60]",
                "prefetcht0 [{c} + {crs}]",
                "prefetcht0 [{c} + {crs} + 60]",
                "prefetcht0 [{c} + {crs}*2]",
                "prefetcht0 [{c} + {crs}*2 + 60]",
                "prefetcht0 [{c3}]",
                "prefetcht0 [{c3} + 60]",
                "prefetcht0 [{c3} + {crs}]",
                "prefetcht0 [{c3} + {crs} + 60]",
                "prefetcht0 [{c3} + {crs}*2]",
                "prefetcht0 [{c3} + {crs}*2 + 60]",
                "ja 6f",
                "mov {tmp}, [{ends}]",
                "vmovups ymm0, [{tmp}]",
                "vmovups ymm1, [{tmp} + 32]",
                "vmovaps ymm2, ymm0", "vmovaps ymm3, ymm1",
                "vmovaps ymm4, ymm0", "vmovaps ymm5, ymm1",
                "vmovaps ymm6, ymm0", "vmovaps ymm7, ymm1",
                "vmovaps ymm8, ymm0", "vmovaps ymm9, ymm1",
                "vmovaps ymm10, ymm0", "vmovaps ymm11, ymm1",
                "jmp 7f",
                "6:",
                "vxorps ymm0, ymm0, ymm0", "vxorps ymm1, ymm1, ymm1",
                "vxorps ymm2, ymm2, ymm2", "vxorps ymm3, ymm3, ymm3",
                "vxorps ymm4, ymm4, ymm4", "vxorps ymm5, ymm5, ymm5",
                "vxorps ymm6, ymm6, ymm6", "vxorps ymm7, ymm7, ymm7",
                "vxorps ymm8, ymm8, ymm8", "vxorps ymm9, ymm9, ymm9",
                "vxorps ymm10, ymm10, ymm10", "vxorps ymm11, ymm11, ymm11",
                "7:",
                "test {k}, {k}",
                "jz 3f",
                ".p2align 5",
                "2:",
                "prefetcht0 [{b} + 1024]",
                "vmovups ymm12, [{b}]",
                "vmovups ymm13, [{b} + 32]",
                "vbroadcastss ymm14, dword ptr [{a0}]",
                "vbroadcastss ymm15, dword ptr [{a0} + {rs}]",
                "vfmadd231ps ymm0, ymm12, ymm14",
                "vfmadd231ps ymm1, ymm13, ymm14",
                "vbroadcastss ymm14, dword ptr [{a0} + {rs}*2]",
                "vfmadd231ps ymm2, ymm12, ymm15",
                "vfmadd231ps ymm3, ymm13, ymm15",
                "vbroadcastss ymm15, dword ptr [{a3}]",
                "vfmadd231ps ymm4, ymm12, ymm14",
                "vfmadd231ps ymm5, ymm13, ymm14",
                "vbroadcastss ymm14, dword ptr [{a3} + {rs}]",
                "vfmadd231ps ymm6, ymm12, ymm15",
                "vfmadd231ps ymm7, ymm13, ymm15",
                "vbroadcastss ymm15, dword ptr [{a3} + {rs}*2]",
                "vfmadd231ps ymm8, ymm12, ymm14",
                "vfmadd231ps ymm9, ymm13, ymm14",
                "vfmadd231ps ymm10, ymm12, ymm15",
                "vfmadd231ps ymm11, ymm13, ymm15",
                "add {a0}, {cs}",
                "add {a3}, {cs}",
                "add {b}, 64",
                "dec {k}",
                "jnz 2b",
                "3:",
                // c = r + c, the residual's rows reached as C's are (its
                // stride in `rs`, row 3 in `a3`: both done with above).
                "mov {tmp}, [{ends} + 8]",
                "test {tmp}, {tmp}",
                "jz 4f",
                "mov {rs}, [{ends} + 16]",
                "shl {rs}, 2",
                "lea {a3}, [{tmp} + {rs}*2]",
                "add {a3}, {rs}",
                "vaddps ymm0, ymm0, [{tmp}]",
                "vaddps ymm1, ymm1, [{tmp} + 32]",
                "vaddps ymm2, ymm2, [{tmp} + {rs}]",
                "vaddps ymm3, ymm3, [{tmp} + {rs} + 32]",
                "vaddps ymm4, ymm4, [{tmp} + {rs}*2]",
                "vaddps ymm5, ymm5, [{tmp} + {rs}*2 + 32]",
                "vaddps ymm6, ymm6, [{a3}]",
                "vaddps ymm7, ymm7, [{a3} + 32]",
                "vaddps ymm8, ymm8, [{a3} + {rs}]",
                "vaddps ymm9, ymm9, [{a3} + {rs} + 32]",
                "vaddps ymm10, ymm10, [{a3} + {rs}*2]",
                "vaddps ymm11, ymm11, [{a3} + {rs}*2 + 32]",
                "4:",
                "vmovups [{c}], ymm0",
                "vmovups [{c} + 32], ymm1",
                "vmovups [{c} + {crs}], ymm2",
                "vmovups [{c} + {crs} + 32], ymm3",
                "vmovups [{c} + {crs}*2], ymm4",
                "vmovups [{c} + {crs}*2 + 32], ymm5",
                "vmovups [{c3}], ymm6",
                "vmovups [{c3} + 32], ymm7",
                "vmovups [{c3} + {crs}], ymm8",
                "vmovups [{c3} + {crs} + 32], ymm9",
                "vmovups [{c3} + {crs}*2], ymm10",
                "vmovups [{c3} + {crs}*2 + 32], ymm11",
                start = in(reg) start,
                c = in(reg) c,
                c3 = in(reg) c3,
                crs = in(reg) rs * 4,
                ends = in(reg) ends.as_ptr(),
                tmp = out(reg) _,
                k = inout(reg) k => _,
                a0 = inout(reg) a => _,
                a3 = inout(reg) a.wrapping_add(3 * a_rs) => _,
                b = inout(reg) b => _,
                rs = inout(reg) a_rs * 4 => _,
                cs = in(reg) a_cs * 4,
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                options(nostack),
            );
        }
    }

    /// One broadcast of row `$row`'s element of A (at `$addr`), multiplied
    /// by `$op` with the two `B` vectors in zmm24/25 into the accumulators
    /// `$lo`, `$hi`.
    macro_rules! update_row {
        ($op:literal, $lo:literal, $hi:literal, $z:literal, $addr:literal) => {
            concat!(
                "vbroadcastss zmm",
                $z,
                ", dword ptr ",
                $addr,
                "\n",
                $op,
                " zmm",
                $lo,
                ", zmm24, zmm",
                $z,
                "\n",
                $op,
                " zmm",
                $hi,
                ", zmm25, zmm",
                $z,
            )
        };
    }

    /// The 12×32 kernels' `t.k` updates with instruction `$op`, added to
    /// `$acc` (`[[__m512; 2]; 12]`, taken and returned by value: in
    /// registers).
    ///
    /// Written in assembly for its addressing: the twelve rows of `A` are
    /// reached from two base pointers (rows 0 and 6) with the row stride
    /// scaled by 1, 2, 4 or held ×3 and ×5, so a step advances two pointers.
    /// Compiled Rust walked the rows with a chain of eleven dependent adds
    /// per step, as long as the step's 24 FMAs, and reached 0.8 of the
    /// FMA peak. The order of every update is that of the Rust it replaced.
    macro_rules! updates_12x32 {
        ($op:literal, $t:expr, $acc:expr) => {{
            let t: &Tile = $t;
            let rs = t.a_rs * 4;
            let [[mut c0, mut c1], [mut c2, mut c3], [mut c4, mut c5], [mut c6, mut c7], [mut c8, mut c9], [mut c10, mut c11], [mut c12, mut c13], [mut c14, mut c15], [mut c16, mut c17], [mut c18, mut c19], [mut c20, mut c21], [mut c22, mut c23]] =
                $acc;
            std::arch::asm!(
                "test {k}, {k}",
                "jz 3f",
                ".p2align 5",
                "2:",
                "vmovups zmm24, [{b}]",
                "vmovups zmm25, [{b} + 64]",
                update_row!($op, "0", "1", "26", "[{a0}]"),
                update_row!($op, "2", "3", "27", "[{a0} + {rs}]"),
                update_row!($op, "4", "5", "28", "[{a0} + {rs}*2]"),
                update_row!($op, "6", "7", "29", "[{a0} + {r3}]"),
                update_row!($op, "8", "9", "26", "[{a0} + {rs}*4]"),
                update_row!($op, "10", "11", "27", "[{a0} + {r5}]"),
                update_row!($op, "12", "13", "28", "[{a6}]"),
                update_row!($op, "14", "15", "29", "[{a6} + {rs}]"),
                update_row!($op, "16", "17", "26", "[{a6} + {rs}*2]"),
                update_row!($op, "18", "19", "27", "[{a6} + {r3}]"),
                update_row!($op, "20", "21", "28", "[{a6} + {rs}*4]"),
                update_row!($op, "22", "23", "29", "[{a6} + {r5}]"),
                "add {a0}, {cs}",
                "add {a6}, {cs}",
                "add {b}, 128",
                "dec {k}",
                "jnz 2b",
                "3:",
                k = inout(reg) t.k => _,
                a0 = inout(reg) t.a => _,
                a6 = inout(reg) t.a.wrapping_add(6 * t.a_rs) => _,
                b = inout(reg) t.b => _,
                rs = in(reg) rs,
                r3 = in(reg) 3 * rs,
                r5 = in(reg) 5 * rs,
                cs = in(reg) t.a_cs * 4,
                inout("zmm0") c0, inout("zmm1") c1, inout("zmm2") c2, inout("zmm3") c3,
                inout("zmm4") c4, inout("zmm5") c5, inout("zmm6") c6, inout("zmm7") c7,
                inout("zmm8") c8, inout("zmm9") c9, inout("zmm10") c10, inout("zmm11") c11,
                inout("zmm12") c12, inout("zmm13") c13, inout("zmm14") c14, inout("zmm15") c15,
                inout("zmm16") c16, inout("zmm17") c17, inout("zmm18") c18, inout("zmm19") c19,
                inout("zmm20") c20, inout("zmm21") c21, inout("zmm22") c22, inout("zmm23") c23,
                out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _,
                out("zmm28") _, out("zmm29") _,
                options(nostack, readonly),
            );
            [[c0, c1], [c2, c3], [c4, c5], [c6, c7], [c8, c9], [c10, c11], [c12, c13], [c14, c15], [c16, c17], [c18, c19], [c20, c21], [c22, c23]]
        }};
    }

    /// 6×64 with AVX-512F: 24 accumulators, four `B` vectors and six
    /// broadcasts of `A` per step (the 12×32 shape, two vectors and twelve
    /// broadcasts, ran 0.80-0.87x as fast in whole products). `B`'s panel
    /// streams from L2 at 256 bytes a step, which the hardware's prefetch
    /// alone left the kernel waiting on: asked for 8 steps ahead, the
    /// products ran 1.00-1.07x as fast on a Sapphire Rapids (the seven
    /// shapes of `gemm_bench`, 1 and 2 threads, alternated call by call;
    /// 2 to 6 steps ahead measured the same). The AVX2 kernel already asked.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX-512F; `t.a` must be valid for
    /// `6 × t.k` elements at its strides, `t.b` hold `64·t.k` floats, and
    /// `t.c` be valid for the live part of the tile, written by no one else;
    /// `t.bias`, unless null, must hold the tile's live columns, and
    /// `t.residual`, unless null, the tile's live part at its stride.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn avx512(t: &Tile) {
        const NR: usize = 64;
        prefetch_c(t, NR);
        let rs = t.a_rs * 4;
        // SAFETY: as this function's.
        let [[mut c0, mut c1, mut c2, mut c3], [mut c4, mut c5, mut c6, mut c7], [mut c8, mut c9, mut c10, mut c11], [mut c12, mut c13, mut c14, mut c15], [mut c16, mut c17, mut c18, mut c19], [mut c20, mut c21, mut c22, mut c23]] =
            unsafe { starts::<4, 6>(t) };
        // SAFETY: the updates read A's columns 0..k at its strides and
        // b[..64·k], inside the panels (caller); the CPU has AVX-512F.
        unsafe {
            std::arch::asm!(
                "test {k}, {k}",
                "jz 3f",
                ".p2align 5",
                "2:",
                // B's panel 8 steps ahead, into L1 (4 lines a step).
                "prefetcht0 [{b} + 2048]",
                "prefetcht0 [{b} + 2112]",
                "prefetcht0 [{b} + 2176]",
                "prefetcht0 [{b} + 2240]",
                "vmovups zmm24, [{b}]",
                "vmovups zmm25, [{b} + 64]",
                "vmovups zmm26, [{b} + 128]",
                "vmovups zmm27, [{b} + 192]",
                "vbroadcastss zmm28, dword ptr [{a0}]",
                "vbroadcastss zmm29, dword ptr [{a0} + {rs}]",
                "vfmadd231ps zmm0, zmm24, zmm28",
                "vfmadd231ps zmm1, zmm25, zmm28",
                "vfmadd231ps zmm2, zmm26, zmm28",
                "vfmadd231ps zmm3, zmm27, zmm28",
                "vbroadcastss zmm30, dword ptr [{a0} + {rs}*2]",
                "vfmadd231ps zmm4, zmm24, zmm29",
                "vfmadd231ps zmm5, zmm25, zmm29",
                "vfmadd231ps zmm6, zmm26, zmm29",
                "vfmadd231ps zmm7, zmm27, zmm29",
                "vbroadcastss zmm31, dword ptr [{a3}]",
                "vfmadd231ps zmm8, zmm24, zmm30",
                "vfmadd231ps zmm9, zmm25, zmm30",
                "vfmadd231ps zmm10, zmm26, zmm30",
                "vfmadd231ps zmm11, zmm27, zmm30",
                "vbroadcastss zmm28, dword ptr [{a3} + {rs}]",
                "vfmadd231ps zmm12, zmm24, zmm31",
                "vfmadd231ps zmm13, zmm25, zmm31",
                "vfmadd231ps zmm14, zmm26, zmm31",
                "vfmadd231ps zmm15, zmm27, zmm31",
                "vbroadcastss zmm29, dword ptr [{a3} + {rs}*2]",
                "vfmadd231ps zmm16, zmm24, zmm28",
                "vfmadd231ps zmm17, zmm25, zmm28",
                "vfmadd231ps zmm18, zmm26, zmm28",
                "vfmadd231ps zmm19, zmm27, zmm28",
                "vfmadd231ps zmm20, zmm24, zmm29",
                "vfmadd231ps zmm21, zmm25, zmm29",
                "vfmadd231ps zmm22, zmm26, zmm29",
                "vfmadd231ps zmm23, zmm27, zmm29",
                "add {a0}, {cs}",
                "add {a3}, {cs}",
                "add {b}, 256",
                "dec {k}",
                "jnz 2b",
                "3:",
                k = inout(reg) t.k => _,
                a0 = inout(reg) t.a => _,
                a3 = inout(reg) t.a.wrapping_add(3 * t.a_rs) => _,
                b = inout(reg) t.b => _,
                rs = in(reg) rs,
                cs = in(reg) t.a_cs * 4,
                inout("zmm0") c0, inout("zmm1") c1, inout("zmm2") c2, inout("zmm3") c3,
                inout("zmm4") c4, inout("zmm5") c5, inout("zmm6") c6, inout("zmm7") c7,
                inout("zmm8") c8, inout("zmm9") c9, inout("zmm10") c10, inout("zmm11") c11,
                inout("zmm12") c12, inout("zmm13") c13, inout("zmm14") c14, inout("zmm15") c15,
                inout("zmm16") c16, inout("zmm17") c17, inout("zmm18") c18, inout("zmm19") c19,
                inout("zmm20") c20, inout("zmm21") c21, inout("zmm22") c22, inout("zmm23") c23,
                out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _,
                out("zmm28") _, out("zmm29") _, out("zmm30") _, out("zmm31") _,
                options(nostack, readonly),
            );
        }
        let acc = [
            [c0, c1, c2, c3],
            [c4, c5, c6, c7],
            [c8, c9, c10, c11],
            [c12, c13, c14, c15],
            [c16, c17, c18, c19],
            [c20, c21, c22, c23],
        ];
        // SAFETY: as this function's.
        unsafe { store_wide(t, &acc, t.chains()) }
    }

    /// What a tile of `R` rows of `16·W` columns starts from: zero, or
    /// where it chains ([`chain_starts`]) `C`'s rows or the bias, loaded
    /// straight into the registers for a whole tile. Inlined and returned
    /// by value, so that a tile that starts from zero zeroes its registers:
    /// an array filled in through a reference was zeroed in memory, by a
    /// call to `memset` at every tile, and loaded from there.
    ///
    /// # Safety
    ///
    /// As [`store_wide`]'s.
    #[inline(always)]
    unsafe fn starts<const W: usize, const R: usize>(t: &Tile) -> [[__m512; W]; R] {
        // SAFETY: the CPU has AVX-512F (caller).
        let zero = unsafe { _mm512_setzero_ps() };
        if !t.starts_from_values() {
            return [[zero; W]; R];
        }
        let nr = 16 * W;
        if t.rows == R && t.cols == nr {
            return std::array::from_fn(|i| {
                std::array::from_fn(|h| {
                    // SAFETY: a whole tile of C, and the bias's tile
                    // columns, are valid (caller).
                    unsafe {
                        if t.add {
                            _mm512_loadu_ps(t.c.add(i * t.rs + 16 * h))
                        } else {
                            _mm512_loadu_ps(t.bias.add(16 * h))
                        }
                    }
                })
            });
        }
        // At most 6 rows of 64 (or 12 of 32).
        let mut flat = [0f32; 6 * 64];
        // SAFETY: the tile's live part is valid (caller).
        unsafe { chain_starts(t, &mut flat, nr) };
        std::array::from_fn(|i| {
            // SAFETY: 16 floats inside `flat` (6 rows of 64).
            std::array::from_fn(|h| unsafe { _mm512_loadu_ps(flat.as_ptr().add(i * nr + 16 * h)) })
        })
    }

    /// 12×32 bf16 products with AVX512_BF16: as [`avx512`], with each
    /// 4-byte element of `A` and `B` a pair of bf16 values (see
    /// [`portable_bf16`]) and `vdpbf16ps` for the FMA.
    ///
    /// # Safety
    ///
    /// As [`avx512`], and the CPU must have AVX512_BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(crate) unsafe fn avx512_bf16(t: &Tile) {
        prefetch_c(t, 32);
        // SAFETY: as this function's.
        let acc = unsafe { starts::<2, 12>(t) };
        // SAFETY: as avx512's; the CPU has AVX512_BF16.
        let acc = unsafe { updates_12x32!("vdpbf16ps", t, acc) };
        // SAFETY: as this function's.
        unsafe { store_wide(t, &acc, t.chains()) }
    }

    /// Stores a finished tile of `16·W` columns (α, then bias or `C`, then
    /// the residual); a tile cut at `C`'s edge from `acc` itself (its rows
    /// one after the other), not from a zeroed copy. Inlined into each
    /// kernel (a function with `target_feature` cannot be): called, it took
    /// the AVX512_BF16 and AMX kernels' registers through memory.
    ///
    /// With [`starts`], measured on a Zen 4 (`gemm_bench`'s `GEMM_VERSUS`,
    /// one thread, the old kernel and the new alternated call by call in one
    /// process, the same bits): the AVX-512 f32 kernel 1.01-1.03x on the
    /// model's shapes and 1.03-1.08x on 64³ blocks (attention's), the
    /// AVX512_BF16 kernel 1.00-1.03x.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX-512F, and the caller enables it; `t.c`,
    /// `t.bias` and `t.residual` as for [`avx512`].
    #[inline(always)]
    unsafe fn store_wide<const W: usize>(t: &Tile, acc: &[[__m512; W]], chained: bool) {
        let mr = acc.len();
        let nr = 16 * W;
        // SAFETY: the CPU has AVX-512F (caller).
        let alpha = unsafe { _mm512_set1_ps(t.alpha) };
        if t.rows == mr && t.cols == nr {
            for (i, row) in acc.iter().enumerate() {
                for (h, v) in row.iter().enumerate() {
                    // SAFETY: a whole tile is live (caller).
                    unsafe {
                        let c = t.c.add(i * t.rs + 16 * h);
                        let v = if chained {
                            *v
                        } else if t.add {
                            _mm512_add_ps(_mm512_loadu_ps(c), _mm512_mul_ps(alpha, *v))
                        } else if !t.bias.is_null() {
                            let b = _mm512_loadu_ps(t.bias.add(16 * h));
                            _mm512_add_ps(b, _mm512_mul_ps(alpha, *v))
                        } else {
                            _mm512_mul_ps(alpha, *v)
                        };
                        let v = if t.residual.is_null() {
                            v
                        } else {
                            let r = t.residual.add(i * t.residual_rs + 16 * h);
                            _mm512_add_ps(_mm512_loadu_ps(r), v)
                        };
                        _mm512_storeu_ps(c, v);
                    }
                }
            }
        } else {
            // SAFETY: `acc` is `mr` rows of `nr` floats, one after the
            // other; the live part is valid (caller).
            unsafe {
                let flat = std::slice::from_raw_parts(acc.as_ptr().cast::<f32>(), mr * nr);
                store_edge(t, flat, nr, chained)
            }
        }
    }

    /// The tile configuration of [`amx_bf16`]: palette 1, eight tiles of
    /// 16 rows × 64 bytes (C: tmm0-3, A: tmm4-5, B: tmm6-7).
    #[repr(C, align(64))]
    struct TileConfig([u8; 64]);

    const TILE_CONFIG: TileConfig = {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            c[16 + 2 * t] = 64;
            c[48 + t] = 16;
            t += 1;
        }
        TileConfig(c)
    };

    /// A 32×32 tile of C in memory, for tiles that C holds only part of.
    #[repr(C, align(64))]
    struct ScratchTile([f32; 32 * 32]);

    thread_local! {
        /// Whether this thread has loaded [`TILE_CONFIG`] (the tile
        /// registers are per-thread state, kept across context switches).
        static TILES_CONFIGURED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// [`amx_bf16`]'s loop over the depth: `t.k / 16` steps of two `A`
    /// tiles (loaded with `$load_a`), two `B` tiles (`$load_b`) and four
    /// tile products into tmm0-3, the first `$asking` steps each asking
    /// for three rows of `C`'s lines. `tileloaddt1` loads the operand that
    /// streams past (read once for this tile) without keeping it in L1.
    macro_rules! amx_steps {
        ($t:expr, $asking:expr, $load_a:literal, $load_b:literal) => {
            std::arch::asm!(
                "test {k}, {k}",
                "jz 3f",
                "2:",
                concat!($load_a, " tmm4, [{a0} + {rs}*1]"),
                concat!($load_b, " tmm6, [{b} + {bs}*1]"),
                concat!($load_b, " tmm7, [{b} + {bs}*1 + 64]"),
                "tdpbf16ps tmm0, tmm4, tmm6",
                "test {asking}, {asking}",
                "jz 4f",
                "prefetcht0 [{c}]",
                "prefetcht0 [{c} + 64]",
                "prefetcht0 [{c} + 124]",
                "prefetcht0 [{c} + {cs}*1]",
                "prefetcht0 [{c} + {cs}*1 + 64]",
                "prefetcht0 [{c} + {cs}*1 + 124]",
                "prefetcht0 [{c} + {cs}*2]",
                "prefetcht0 [{c} + {cs}*2 + 64]",
                "prefetcht0 [{c} + {cs}*2 + 124]",
                "lea {c}, [{c} + {cs}*2]",
                "add {c}, {cs}",
                "dec {asking}",
                "4:",
                concat!($load_a, " tmm5, [{a16} + {rs}*1]"),
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a0}, 64",
                "add {a16}, 64",
                "add {b}, 2048",
                "sub {k}, 16",
                "jnz 2b",
                "3:",
                k = inout(reg) $t.k => _,
                a0 = inout(reg) $t.a => _,
                a16 = inout(reg) $t.a.wrapping_add(16 * $t.a_rs) => _,
                b = inout(reg) $t.b => _,
                asking = inout(reg) $asking => _,
                c = inout(reg) $t.c => _,
                rs = in(reg) $t.a_rs * 4,
                bs = in(reg) 128usize,
                cs = in(reg) $t.rs * 4,
                options(nostack, readonly),
            )
        };
    }

    /// 32×32 bf16 products with AMX: four 16×16 tiles of `C` in tile
    /// registers, each step of 16 pairs two `A` tiles (16 rows × 16 pairs,
    /// read in place at `A`'s row stride) and two `B` tiles (16 pairs × 16
    /// columns of the packed panel, whose rows are 128 bytes apart) and four
    /// `tdpbf16ps` (16·16·32 products each, 16 times `vdpbf16ps`'s work).
    ///
    /// A tile that only stores `C` asks for `C`'s lines three rows a step
    /// over the loop's first eleven steps rather than all 64-96 at once
    /// before it: the misses then wait for memory beside the products
    /// instead of holding the loop back until the line fill buffers drain.
    /// Measured on a Sapphire Rapids (`gemm_bench`, bf16 operands,
    /// alternated with the one-shot prefetch, with the deeper blocks of
    /// `depth_block`): 2048 × 384 · 384 × 1152 1.17-1.20x on one thread,
    /// 1.05-1.10x on two; the model's other shapes 0.96-1.29x, 2048³
    /// 1.09-1.22x. Without `C`'s stores and prefetches at all the one-thread
    /// products ran 1.3-1.8x as fast: `C`'s traffic to memory is what bounds
    /// AMX at depth 384, not its tiles. Streaming stores (`vmovntps` from a
    /// tile in L1) ran at half the rate.
    ///
    /// The operand that streams past (`t.streams`: a row of tiles reads
    /// each panel of `B` once and keeps its 32 rows of `A`) is loaded with
    /// `tileloaddt1`, the hint not to keep it. At a depth of 192 pairs
    /// (the model's q/k/v and MLP products at d_model 384) those rows are
    /// 24 KiB and a panel 24 KiB more: with plain loads the panels pushed
    /// `A`'s rows (and the tile's scratch) out of the 48 KiB L1, and both
    /// came from L2 again, 64 bytes a cycle where the tile steps need 32.
    /// Measured on a Sapphire Rapids, alternated call by call (medians of
    /// 20-40): 2048 × 384 · 384 × 1152 1.14-1.26x on one thread and 1.14x
    /// on two, × 1536 1.09-1.15x and 1.04x, the same rounded to bf16
    /// 1.09-1.18x and 1.11-1.13x; the deeper products (their rows of `A`
    /// are larger than L1 either way) 0.98-1.04x.
    ///
    /// # Safety
    ///
    /// The CPU must have AMX-BF16 and the process the kernel's leave to use
    /// its tile data (`Kernel::available_bf16` asked for it); `t.a_cs` is 1,
    /// `t.k` a multiple of 16, `t.a` valid for 32 whole rows of `t.k` pairs
    /// at stride `t.a_rs` (past `t.rows` too), `t.b` for `32·t.k` pairs;
    /// `t.c`, `t.bias` and `t.residual` as for [`avx512`].
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn amx_bf16(t: &Tile) {
        debug_assert!(t.a_cs == 1 && t.k.is_multiple_of(16));
        if !TILES_CONFIGURED.get() {
            // SAFETY: a valid palette-1 configuration (AMX is present: caller).
            unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) &TILE_CONFIG, options(nostack)) };
            TILES_CONFIGURED.set(true);
        }
        // A tile that only stores C asks for its lines a few rows a step
        // while it multiplies; one that starts from C needs them first.
        let whole = t.rows == 32 && t.cols == 32;
        let spread = whole && !t.add;
        if !spread {
            prefetch_c(t, 32);
        }
        // A tile without α or residual starts from C (`add`), from the bias
        // or from zero, and ends stored in C: no pass of AVX-512 over the
        // finished tile (it was a third of the tile's time at k = 384), and
        // C + (products in blocks) is C's tile register accumulated, so
        // splitting the depth at multiples of 16 pairs gives the same bits.
        // A partial tile does the same through a whole one in `scratch`.
        let direct = t.alpha == 1.0 && t.residual.is_null();
        let mut scratch = std::mem::MaybeUninit::<ScratchTile>::uninit();
        let (c, c_rs) = if whole {
            (t.c, t.rs)
        } else {
            (scratch.as_mut_ptr().cast::<f32>(), 32)
        };
        if direct && !whole {
            // SAFETY: `scratch` is 32 rows of 32 floats; C's live part and
            // the bias's live columns are valid (caller).
            unsafe {
                c.write_bytes(0, 32 * 32);
                for i in 0..t.rows {
                    let from = match (t.add, t.bias.is_null()) {
                        (true, _) => t.c.add(i * t.rs),
                        (false, false) => t.bias,
                        (false, true) => break,
                    };
                    c.add(i * 32).copy_from_nonoverlapping(from, t.cols);
                }
            }
        }
        let c16 = c.wrapping_add(16 * c_rs);
        // SAFETY: C's (or the scratch's) 32×32 tile and, for a whole tile,
        // the bias's 32 columns are valid when `direct` (caller); tile
        // registers are this function's alone.
        unsafe {
            if direct && (t.add || (!whole && !t.bias.is_null())) {
                std::arch::asm!(
                    "tileloadd tmm0, [{c} + {s}*1]",
                    "tileloadd tmm1, [{c} + {s}*1 + 64]",
                    "tileloadd tmm2, [{c16} + {s}*1]",
                    "tileloadd tmm3, [{c16} + {s}*1 + 64]",
                    c = in(reg) c, c16 = in(reg) c16, s = in(reg) c_rs * 4,
                    options(nostack, readonly),
                );
            } else if direct && !t.bias.is_null() {
                // Each row loaded from the bias (stride 0).
                std::arch::asm!(
                    "tileloadd tmm0, [{bias} + {zero}*1]",
                    "tileloadd tmm1, [{bias} + {zero}*1 + 64]",
                    "tileloadd tmm2, [{bias} + {zero}*1]",
                    "tileloadd tmm3, [{bias} + {zero}*1 + 64]",
                    bias = in(reg) t.bias, zero = in(reg) 0usize,
                    options(nostack, readonly),
                );
            } else {
                std::arch::asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem),
                );
            }
        }
        // Steps that ask for three rows of C each (every line a row of 32
        // floats touches, aligned or not), the first ones of the loop.
        let steps_to_ask = 32usize.div_ceil(3);
        let asking = if spread {
            (t.k / 16).min(steps_to_ask)
        } else {
            0
        };
        // SAFETY: the loads read 32 rows × t.k pairs of A and t.k rows of
        // the B panel (caller); a prefetch is a hint that does not fault.
        unsafe {
            match t.streams {
                Streams::A => amx_steps!(t, asking, "tileloaddt1", "tileloadd"),
                Streams::B => amx_steps!(t, asking, "tileloadd", "tileloaddt1"),
            }
        }
        if spread && t.k / 16 < steps_to_ask {
            // Too short a loop to ask for all of C's rows: the rest now.
            prefetch_c_rows(t, 3 * (t.k / 16)..32, 32);
        }
        if direct {
            // SAFETY: C's (or the scratch's) whole 32×32 tile is valid and
            // this tile's alone; the live part of C too.
            unsafe {
                std::arch::asm!(
                    "tilestored [{c} + {s}*1], tmm0",
                    "tilestored [{c} + {s}*1 + 64], tmm1",
                    "tilestored [{c16} + {s}*1], tmm2",
                    "tilestored [{c16} + {s}*1 + 64], tmm3",
                    c = in(reg) c, c16 = in(reg) c16, s = in(reg) c_rs * 4,
                    options(nostack),
                );
                if !whole {
                    for i in 0..t.rows {
                        t.c.add(i * t.rs)
                            .copy_from_nonoverlapping(c.add(i * 32), t.cols);
                    }
                }
            }
            return;
        }
        // Not zeroed first: the tile stores write all of it (zeroing its
        // 4 KiB was a `memset` call a tile, 0.5% of a bf16 stage-3 step's
        // samples, from attention's scaled `Q·Kᵀ`; `attention_bench` level).
        let mut acc = std::mem::MaybeUninit::<[[__m512; 2]; 32]>::uninit();
        // SAFETY: the stores write acc's 32 rows of 128 bytes, all of it.
        let acc = unsafe {
            std::arch::asm!(
                "tilestored [{c} + {bs}*1], tmm0",
                "tilestored [{c} + {bs}*1 + 64], tmm1",
                "tilestored [{c} + {bs}*1 + 2048], tmm2",
                "tilestored [{c} + {bs}*1 + 2112], tmm3",
                bs = in(reg) 128usize,
                c = in(reg) acc.as_mut_ptr(),
                options(nostack),
            );
            acc.assume_init()
        };
        // SAFETY: as this function's.
        unsafe { store_wide(t, &acc, false) }
    }
}
