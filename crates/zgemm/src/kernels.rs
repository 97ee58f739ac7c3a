//! The micro-kernels: one `mr × nr` tile of `C` from a packed `A` panel and
//! a packed `B` panel, `k` rank-1 updates held in registers.
//!
//! Each element is a fused multiply-add chain over `p` from zero, then
//! `c = α·acc` or `c = c + α·acc` with a separate multiply and add (crate
//! doc): the SIMD kernels and the portable one agree bit for bit. Tiles at
//! the right and bottom edges of `C` are computed whole (the packing padded
//! them with zeros) and only their live part is stored, with the same
//! arithmetic.

/// One tile's work.
pub(crate) struct Tile {
    /// Rank-1 updates (`≤ KC`).
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
    /// `c = c + α·acc` instead of `c = α·acc`.
    pub(crate) add: bool,
    /// If not null (and not `add`): `c = bias[j] + α·acc`, the tile's
    /// columns of the bias.
    pub(crate) bias: *const f32,
    /// Element (0, 0) of the tile in `C`.
    pub(crate) c: *mut f32,
    /// `C`'s row stride.
    pub(crate) rs: usize,
    /// Live rows (`≤ mr`) and columns (`≤ nr`) of the tile.
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

/// Stores the live part of a finished tile held in `acc` (`mr × nr`, row
/// after row).
///
/// # Safety
///
/// `t.c` must be valid for `t.rows` rows of `t.cols` floats at stride `t.rs`,
/// and `t.bias`, unless null, for `t.cols` floats.
unsafe fn store_edge(t: &Tile, acc: &[f32], nr: usize) {
    for i in 0..t.rows {
        for j in 0..t.cols {
            let v = t.alpha * acc[i * nr + j];
            // SAFETY: (i, j) is a live element of the tile (caller).
            let c = unsafe { &mut *t.c.add(i * t.rs + j) };
            *c = if t.add {
                *c + v
            } else if !t.bias.is_null() {
                // SAFETY: the bias holds the tile's live columns (caller).
                unsafe { *t.bias.add(j) + v }
            } else {
                v
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
/// [`store_edge`]), written by no one else, and `t.bias`, unless null, hold
/// the tile's live columns.
pub(crate) unsafe fn portable(t: &Tile) {
    const MR: usize = 4;
    const NR: usize = 16;
    // SAFETY: the B panel's length (caller).
    let b = unsafe { std::slice::from_raw_parts(t.b, NR * t.k) };
    let mut acc = [0f32; MR * NR];
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
    unsafe { store_edge(t, &acc, NR) }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{avx2, avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{store_edge, Tile};

    /// Asks for the tile's live rows of `C` while the updates run: `C` is
    /// too big for any cache, and its loads and stores at the end would
    /// otherwise stall on memory (measured: a fifth of the time of a
    /// 2048×384·384×1152 product).
    fn prefetch_c(t: &Tile, nr: usize) {
        for i in 0..t.rows {
            let row = t.c.wrapping_add(i * t.rs);
            for j in (0..t.cols.min(nr)).step_by(16).chain([t.cols.min(nr) - 1]) {
                // SAFETY: a prefetch is a hint; it does not fault, and the
                // address is inside the tile's live part anyway.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(j) as *const i8) };
            }
        }
    }

    /// 6×16 with AVX2 and FMA: 12 accumulators, two `B` vectors and one
    /// broadcast of `A` per update.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX2 and FMA; `t.a` must be valid for
    /// `6 × t.k` elements at its strides, `t.b` hold `16·t.k` floats, and
    /// `t.c` be valid for the live part of the tile, written by no one else;
    /// `t.bias`, unless null, must hold the tile's live columns.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn avx2(t: &Tile) {
        const MR: usize = 6;
        const NR: usize = 16;
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        prefetch_c(t, NR);
        let (mut a, mut b, a_rs, a_cs) = (t.a, t.b, t.a_rs, t.a_cs);
        let mut update = || {
            // SAFETY: update p reads A's column p and b[p·16..p·16+16],
            // inside the panels (caller).
            unsafe {
                let b0 = _mm256_loadu_ps(b);
                let b1 = _mm256_loadu_ps(b.add(8));
                for (i, row) in acc.iter_mut().enumerate() {
                    let ai = _mm256_set1_ps(*a.add(i * a_rs));
                    row[0] = _mm256_fmadd_ps(ai, b0, row[0]);
                    row[1] = _mm256_fmadd_ps(ai, b1, row[1]);
                }
                a = a.add(a_cs);
                b = b.add(NR);
            }
        };
        for _ in 0..t.k / 4 {
            update();
            update();
            update();
            update();
        }
        for _ in 0..t.k % 4 {
            update();
        }
        let alpha = _mm256_set1_ps(t.alpha);
        if t.rows == MR && t.cols == NR {
            for (i, row) in acc.iter().enumerate() {
                for (h, v) in row.iter().enumerate() {
                    // SAFETY: a whole tile is live (caller).
                    unsafe {
                        let c = t.c.add(i * t.rs + 8 * h);
                        let v = _mm256_mul_ps(alpha, *v);
                        let v = if t.add {
                            _mm256_add_ps(_mm256_loadu_ps(c), v)
                        } else if !t.bias.is_null() {
                            _mm256_add_ps(_mm256_loadu_ps(t.bias.add(8 * h)), v)
                        } else {
                            v
                        };
                        _mm256_storeu_ps(c, v);
                    }
                }
            }
        } else {
            let mut flat = [0f32; MR * NR];
            for (i, row) in acc.iter().enumerate() {
                for (h, v) in row.iter().enumerate() {
                    // SAFETY: 8 floats inside `flat`.
                    unsafe { _mm256_storeu_ps(flat.as_mut_ptr().add(i * NR + 8 * h), *v) };
                }
            }
            // SAFETY: the live part is valid (caller).
            unsafe { store_edge(t, &flat, NR) }
        }
    }

    /// 12×32 with AVX-512F: 24 accumulators, two `B` vectors and one
    /// broadcast of `A` per update.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX-512F; `t.a` must be valid for
    /// `12 × t.k` elements at its strides, `t.b` hold `32·t.k` floats, and
    /// `t.c` be valid for the live part of the tile, written by no one else;
    /// `t.bias`, unless null, must hold the tile's live columns.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn avx512(t: &Tile) {
        const MR: usize = 12;
        const NR: usize = 32;
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        prefetch_c(t, NR);
        let (mut a, mut b, a_rs, a_cs) = (t.a, t.b, t.a_rs, t.a_cs);
        for _ in 0..t.k {
            // SAFETY: update p reads A's column p and b[p·32..p·32+32],
            // inside the panels (caller).
            unsafe {
                let b0 = _mm512_loadu_ps(b);
                let b1 = _mm512_loadu_ps(b.add(16));
                for (i, row) in acc.iter_mut().enumerate() {
                    let ai = _mm512_set1_ps(*a.add(i * a_rs));
                    row[0] = _mm512_fmadd_ps(ai, b0, row[0]);
                    row[1] = _mm512_fmadd_ps(ai, b1, row[1]);
                }
                a = a.add(a_cs);
                b = b.add(NR);
            }
        }
        let alpha = _mm512_set1_ps(t.alpha);
        if t.rows == MR && t.cols == NR {
            for (i, row) in acc.iter().enumerate() {
                for (h, v) in row.iter().enumerate() {
                    // SAFETY: a whole tile is live (caller).
                    unsafe {
                        let c = t.c.add(i * t.rs + 16 * h);
                        let v = _mm512_mul_ps(alpha, *v);
                        let v = if t.add {
                            _mm512_add_ps(_mm512_loadu_ps(c), v)
                        } else if !t.bias.is_null() {
                            _mm512_add_ps(_mm512_loadu_ps(t.bias.add(16 * h)), v)
                        } else {
                            v
                        };
                        _mm512_storeu_ps(c, v);
                    }
                }
            }
        } else {
            let mut flat = [0f32; MR * NR];
            for (i, row) in acc.iter().enumerate() {
                for (h, v) in row.iter().enumerate() {
                    // SAFETY: 16 floats inside `flat`.
                    unsafe { _mm512_storeu_ps(flat.as_mut_ptr().add(i * NR + 16 * h), *v) };
                }
            }
            // SAFETY: the live part is valid (caller).
            unsafe { store_edge(t, &flat, NR) }
        }
    }
}
