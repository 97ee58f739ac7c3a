//! Every kernel against the portable one bit for bit, the portable one
//! against an f64 reference within the rounding bound, and thread counts
//! against each other.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

fn random(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Says which kernels this run covers, so that a run on an AVX2-only CPU
/// does not pass for a test of the AVX-512 kernel.
/// `f` run in a rayon pool of `threads` threads (a product's tasks run in
/// the caller's pool).
fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

fn covered() -> Vec<Kernel> {
    let k = Kernel::available();
    eprintln!("zgemm kernels covered on this CPU: {k:?}");
    if !k.contains(&Kernel::Avx512) {
        eprintln!("zgemm: the Avx512 kernel is NOT covered here (no avx512f on this CPU)");
    }
    k
}

/// Operand layouts: A and B row-major or read through a transpose.
#[derive(Debug, Clone, Copy)]
struct Case {
    m: usize,
    n: usize,
    k: usize,
    a_t: bool,
    b_t: bool,
}

/// Storage of an `rows × cols` operand, row-major or as its transpose.
fn operand<T: Copy>(data: &[T], rows: usize, cols: usize, transposed: bool) -> MatRef<'_, T> {
    if transposed {
        MatRef::row_major(data, cols, rows).unwrap().t()
    } else {
        MatRef::row_major(data, rows, cols).unwrap()
    }
}

const CASES: [Case; 11] = [
    Case {
        m: 1,
        n: 1,
        k: 1,
        a_t: false,
        b_t: false,
    },
    Case {
        m: 7,
        n: 5,
        k: 3,
        a_t: false,
        b_t: false,
    },
    Case {
        m: 13,
        n: 33,
        k: 300,
        a_t: false,
        b_t: false,
    },
    Case {
        m: 25,
        n: 47,
        k: 513,
        a_t: true,
        b_t: false,
    },
    Case {
        m: 30,
        n: 17,
        k: 257,
        a_t: false,
        b_t: true,
    },
    Case {
        m: 12,
        n: 64,
        k: 40,
        a_t: true,
        b_t: true,
    },
    Case {
        m: 100,
        n: 70,
        k: 96,
        a_t: false,
        b_t: false,
    },
    Case {
        m: 3,
        n: 2100,
        k: 9,
        a_t: false,
        b_t: true,
    },
    // Several blocks of columns, each a run of whole panels (an AVX2
    // strip) and the last one ending in a part of a panel.
    Case {
        m: 13,
        n: 2100,
        k: 40,
        a_t: false,
        b_t: false,
    },
    Case {
        m: 200,
        n: 48,
        k: 256,
        a_t: true,
        b_t: false,
    },
    // A transposed `A` of few row blocks and `B` of several panels: on two
    // threads the tasks split the panels and share one packing of `A`.
    Case {
        m: 200,
        n: 150,
        k: 400,
        a_t: true,
        b_t: false,
    },
];

/// The starts the tests run: `R` is a residual of C's shape.
const STARTS: [&str; 5] = ["zero", "keep", "bias", "residual", "residual_nobias"];

fn start_of<'a>(name: &str, bias: &'a [f32], r: MatRef<'a>) -> Start<'a> {
    match name {
        "zero" => Start::Zero,
        "keep" => Start::Keep,
        "bias" => Start::Bias(bias),
        "residual" => Start::Residual {
            bias: Some(bias),
            r,
        },
        "residual_nobias" => Start::Residual { bias: None, r },
        _ => unreachable!("no start {name}"),
    }
}

/// Runs `case` with `kernel` on `threads`, C as a block of columns of a wider
/// matrix (row stride n + 3) whose other columns must stay untouched.
fn run(kernel: Kernel, case: Case, start: &str, alpha: f32, threads: usize) -> Vec<f32> {
    let Case { m, n, k, a_t, b_t } = case;
    let a = random(1, m * k);
    let b = random(2, k * n);
    let bias = random(3, n);
    let rs = n + 3;
    let mut c = random(4, m * rs);
    let res = random(5, m * (n + 5));
    let start = start_of(start, &bias, MatRef::new(&res, m, n, n + 5, 1).unwrap());
    let product = if kernel.is_bf16() {
        gemm_bf16_with
    } else {
        gemm_with
    };
    in_pool(threads, || {
        product(
            kernel,
            MatMut::new(&mut c, m, n, rs).unwrap(),
            operand(&a, m, k, a_t),
            operand(&b, k, n, b_t),
            alpha,
            start,
            threads,
        )
    })
    .unwrap();
    let untouched = random(4, m * rs);
    for i in 0..m {
        assert_eq!(
            c[i * rs + n..(i + 1) * rs],
            untouched[i * rs + n..(i + 1) * rs]
        );
    }
    c
}

#[test]
fn every_kernel_and_thread_count_gives_the_portable_kernels_bits() {
    for kernel in covered() {
        for case in CASES {
            for start in STARTS {
                assert_portable_bits(kernel, case, start, &[1, 2, 3]);
            }
        }
    }
}

/// `kernel` on each of `threads` gives the portable kernel's bits on one.
fn assert_portable_bits(kernel: Kernel, case: Case, start: &str, threads: &[usize]) {
    let want = run(Kernel::Portable, case, start, 0.75, 1);
    for &threads in threads {
        let got = run(kernel, case, start, 0.75, threads);
        let same = want
            .iter()
            .zip(&got)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{kernel:?} {case:?} {start} on {threads} threads");
    }
}

/// On several threads the f32 kernels cut `A`'s rows into a multiple of
/// the threads' number of blocks of whole tiles, so that a thread given
/// whole row blocks is not left with a short one (128 rows on two threads
/// were 96 + 32); the model's larger shapes keep `mc`, and one thread
/// always does.
#[test]
fn f32_row_blocks_come_in_a_multiple_of_the_threads() {
    let k = Kernel::Avx2;
    assert_eq!((k.mr(), k.mc()), (6, 96));
    assert_eq!(k.row_block(128, 2), 66);
    assert_eq!(k.row_block(256, 2), 66);
    for m in [384, 1536, 2048] {
        assert_eq!(k.row_block(m, 2), 96, "{m} rows");
    }
    // AMX's blocks are its own (Kernel::row_block): more of them, for the
    // threads to share, where the rows allow.
    let amx = Kernel::AmxBf16;
    assert_eq!(amx.row_block(384, 2), 192);
    assert_eq!(amx.row_block(1536, 2), 128);
    assert_eq!(amx.row_block(2048, 2), 128);
    for kernel in [Kernel::Avx2, Kernel::Avx512, Kernel::Portable] {
        for m in 1..700 {
            assert_eq!(kernel.row_block(m, 1), kernel.mc());
            for threads in 2..=4 {
                let (mr, mc) = (kernel.mr(), kernel.row_block(m, threads));
                assert!(mc.is_multiple_of(mr) && mc > 0, "{kernel:?} {m} {threads}");
                let fewest = m.div_ceil(kernel.mc());
                let blocks = m.div_ceil(mc);
                assert!(blocks >= fewest, "{kernel:?} {m} rows on {threads}: {mc}");
                assert!(
                    blocks <= fewest.next_multiple_of(threads),
                    "{kernel:?} {m} rows on {threads}: {mc}"
                );
            }
        }
    }
}

/// AMX takes deep blocks on every product, whatever `C`'s size or `A`'s
/// layout (one pass where the depth allows: its tiles start from `C`, so
/// no bits depend on it); the AVX512_BF16 kernel keeps [`KC`] pairs.
#[test]
fn amx_takes_deep_blocks_and_avx512_bf16_keeps_kc() {
    // A weight gradient: small C, transposed A, 1024 pairs deep.
    assert_eq!(depth_block(Kernel::AmxBf16, 1024, false), 1024);
    assert_eq!(depth_block(Kernel::AmxBf16, 768, true), 768);
    assert_eq!(depth_block(Kernel::AmxBf16, 192, true), 192);
    // Deeper than DEEP_KC: even blocks, whole steps of 16 pairs.
    assert_eq!(depth_block(Kernel::AmxBf16, 3000, true), 1008);
    assert_eq!(depth_block(Kernel::Avx512Bf16, 1024, false), KC);
}

/// AMX on one thread packs a block of `DEEP_KC` pairs at most half of L2
/// wide (`Kernel::col_block`), and the product's bits are those of two
/// threads, which take the whole width: which columns share a block
/// changes no element's sums.
#[test]
fn amx_cuts_deep_blocks_of_b_to_l2_on_one_thread_without_changing_a_bit() {
    let wide = 2048;
    let cut = Kernel::AmxBf16.col_block(wide, 1, DEEP_KC, false);
    assert!(cut < wide && cut.is_multiple_of(32) && cut * DEEP_KC * 4 <= l2_bytes() / 2);
    assert_eq!(Kernel::AmxBf16.col_block(wide, 2, DEEP_KC, false), NC);
    assert_eq!(Kernel::AmxBf16.col_block(wide, 1, 768, false), NC);
    if !Kernel::available_bf16().contains(&Kernel::AmxBf16) {
        eprintln!("zgemm: no AMX here; its cut blocks' products NOT covered");
        return;
    }
    // Wider than any L2's half up to 9 MiB at 1024 pairs deep.
    let (m, k, n) = (40, 2048, 1200);
    assert!(Kernel::AmxBf16.col_block(n, 1, DEEP_KC, true) < n);
    let (a, b) = (random(11, m * k), random(12, k * n));
    for a_t in [false, true] {
        let run = |threads: usize| {
            let mut c = vec![0f32; m * n];
            in_pool(threads, || {
                gemm_bf16_with(
                    Kernel::AmxBf16,
                    MatMut::row_major(&mut c, m, n).unwrap(),
                    operand(&a, m, k, a_t),
                    MatRef::row_major(&b, k, n).unwrap(),
                    1.0,
                    Start::Zero,
                    threads,
                )
            })
            .unwrap();
            c
        };
        let (one, two) = (run(1), run(2));
        assert!(
            one.iter()
                .zip(&two)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "A transposed: {a_t}"
        );
        // And the product itself: within the f64 bound of the rounded
        // operands (as `within_the_f64_bound`).
        let q = |x: f32| {
            let b = x.to_bits();
            f64::from(f32::from_bits((b + 0x7fff + ((b >> 16) & 1)) & 0xffff_0000))
        };
        let av = operand(&a, m, k, a_t);
        for (i, j) in [(0, 0), (17, 640), (39, 1199), (31, 1000)] {
            let (exact, mag) = (0..k).fold((0f64, 0f64), |(e, g), p| {
                let t = q(av.at(i, p)) * q(b[p * n + j]);
                (e + t, g + t.abs())
            });
            let bound = (k as f64 + 3.0) * f64::from(f32::EPSILON) / 2.0 * mag;
            assert!(
                (f64::from(one[i * n + j]) - exact).abs() <= bound,
                "({i}, {j})"
            );
        }
    }
}

/// A weight gradient's tasks (`A` packed, few row blocks) cut `B`'s panels
/// between the threads where a thread's share stays in L2, and `A`'s rows
/// where it would not (each thread then packs only its own rows); a
/// row-major `A` keeps the panel split, and one thread one task a block.
#[test]
fn tasks_split_rows_where_a_threads_share_of_b_outgrows_l2() {
    // 384 × 2048 · 2048 × 1152 on AVX2: 4 row blocks, 72 panels of 24 KiB.
    let panels = 72;
    let split = |a_packed, m_blocks, threads, l2| {
        task_splits(
            Kernel::Avx2,
            a_packed,
            false,
            m_blocks,
            panels * 16 * KC * 4,
            panels,
            threads,
            l2,
        )
    };
    let (zen3, sapphire_rapids) = (512 << 10, 2 << 20);
    assert_eq!(split(true, 4, 2, zen3), 1);
    assert_eq!(split(true, 4, 2, sapphire_rapids), 2);
    // Row blocks that do not divide among the threads keep the panel split.
    assert_eq!(split(true, 3, 2, zen3), 2);
    assert_eq!(split(false, 4, 2, zen3), 2);
    assert_eq!(split(true, 4, 1, zen3), 1);
    // A packed once for every task: nothing repeated, the panels split.
    let shared = task_splits(Kernel::Avx512, true, true, 4, 18 * 64 * KC * 4, 18, 2, zen3);
    assert_eq!(shared, 2);
    // Never more ranges than panels.
    assert_eq!(
        task_splits(Kernel::Avx2, false, false, 1, 16 * KC * 4, 1, 2, zen3),
        1
    );
}

/// A product whose `A` is read in place takes deeper blocks, and every f32
/// kernel and thread count still gives the portable kernel's bits (A
/// row-major, so the deep rule applies; B read either way; a `C` larger
/// than L2, and one that fits); a transposed `A` keeps [`KC`].
#[test]
fn deep_blocks_give_the_portable_kernels_bits_on_every_kernel() {
    assert_eq!(depth_block(Kernel::Portable, 1100, true), 560);
    assert_eq!(depth_block(Kernel::Avx2, 2048, true), DEEP_KC);
    assert_eq!(depth_block(Kernel::Avx2, 512, true), 512);
    assert_eq!(depth_block(Kernel::Avx2, 300, true), 304);
    assert_eq!(depth_block(Kernel::Portable, 1100, false), KC);
    assert_eq!(depth_block(Kernel::Avx512, 2048, false), KC);
    // The portable kernel, 1 thread, is the reference; it runs here on
    // another thread count only where it is the sole f32 kernel (its calls
    // are most of this test's time on x86, where `mul_add` is a libm call,
    // and `every_kernel_and_thread_count_gives_the_portable_kernels_bits`
    // holds it to its own bits on every thread count, on smaller products).
    let mut f32_kernels: Vec<Kernel> = covered()
        .into_iter()
        .filter(|k| !k.is_bf16() && *k != Kernel::Portable)
        .collect();
    let threads: &[usize] = if f32_kernels.is_empty() {
        f32_kernels.push(Kernel::Portable);
        &[2]
    } else {
        &[1, 2]
    };
    for (m, n, k) in [(1024, 520, 1100), (70, 40, 900)] {
        for b_t in [false, true] {
            let case = Case {
                m,
                n,
                k,
                a_t: false,
                b_t,
            };
            for start in ["keep", "residual"] {
                for &kernel in &f32_kernels {
                    assert_portable_bits(kernel, case, start, threads);
                }
            }
        }
    }
}

#[test]
fn the_portable_kernel_is_within_the_rounding_bound_of_an_f64_product() {
    within_the_f64_bound(Kernel::Portable, |x| x);
}

#[test]
fn every_bf16_kernel_is_within_the_rounding_bound_of_an_f64_product_of_rounded_operands() {
    for kernel in Kernel::available_bf16() {
        // The operands rounded to bf16 by hand (nearest, ties to even: the
        // low 16 bits dropped after adding 0x7fff plus the kept lowest bit).
        within_the_f64_bound(kernel, |x| {
            let b = x.to_bits();
            f32::from_bits((b + 0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
        });
    }
}

/// `kernel` against an f64 product of the operands as `quantize` rounds
/// them.
fn within_the_f64_bound(kernel: Kernel, quantize: fn(f32) -> f32) {
    // Each element is k fused multiply-adds in blocks of KC, the blocks
    // added to C, and one multiply by alpha: at most k + 2 roundings of
    // relative size u = 2^-24, each bounded by the sum of magnitudes, so
    // |c - exact| <= (k + 2)·u·(|alpha|·Σ|a||b| + |c0| + |bias|) (to first
    // order). A bf16 product of two bf16 values is exact in f32, so the
    // bound holds for it too.
    let u = f64::from(f32::EPSILON) / 2.0;
    // α = 1 as well: AMX stores a whole tile without α straight into C.
    for (case, alpha) in CASES.into_iter().flat_map(|c| [(c, 0.75f32), (c, 1.0)]) {
        for start in STARTS {
            let Case { m, n, k, a_t, b_t } = case;
            let got = run(kernel, case, start, alpha, 1);
            let (a, b, bias, c0, res) = (
                random(1, m * k),
                random(2, k * n),
                random(3, n),
                random(4, m * (n + 3)),
                random(5, m * (n + 5)),
            );
            let (a, b) = (operand(&a, m, k, a_t), operand(&b, k, n, b_t));
            let mut worst = 0f64;
            for i in 0..m {
                for j in 0..n {
                    let (mut exact, mut mag) = (0f64, 0f64);
                    for p in 0..k {
                        let t = f64::from(quantize(a.at(i, p))) * f64::from(quantize(b.at(p, j)));
                        exact += t;
                        mag += t.abs();
                    }
                    let alpha = f64::from(alpha);
                    let (bias, r) = (f64::from(bias[j]), f64::from(res[i * (n + 5) + j]));
                    // What is added to the product, and the sum of its
                    // terms' magnitudes.
                    let (base, base_mag) = match start {
                        "zero" => (0.0, 0.0),
                        "keep" => (
                            f64::from(c0[i * (n + 3) + j]),
                            c0[i * (n + 3) + j].abs().into(),
                        ),
                        "bias" => (bias, bias.abs()),
                        "residual" => (bias + r, bias.abs() + r.abs()),
                        _ => (r, r.abs()),
                    };
                    let want = base + alpha * exact;
                    let bound = (k as f64 + 3.0) * u * (alpha * mag + base_mag) + f64::MIN_POSITIVE;
                    let err = (f64::from(got[i * (n + 3) + j]) - want).abs();
                    assert!(
                        err <= bound,
                        "{kernel:?} {case:?} {start} ({i}, {j}): error {err:e} over bound {bound:e}"
                    );
                    worst = worst.max(err / bound);
                }
            }
            // The bound is loose, but not vacuous: a dropped block of KC or a
            // halved alpha is far outside it (checked below).
            assert!(worst < 1.0);
        }
    }
}

#[test]
fn every_bf16_kernel_and_thread_count_gives_its_references_bits() {
    let kernels = Kernel::available_bf16();
    eprintln!("zgemm bf16 kernels covered on this CPU: {kernels:?}");
    if !kernels.contains(&Kernel::Avx512Bf16) {
        eprintln!("zgemm: the Avx512Bf16 kernel is NOT covered here (no avx512bf16 on this CPU)");
    }
    for kernel in kernels {
        // AMX sums inside a tile in an order of its own: its reference is
        // itself on one thread (and the f64 bound, below).
        let reference = match kernel {
            Kernel::AmxBf16 => Kernel::AmxBf16,
            _ => Kernel::PortableBf16,
        };
        // 600 rows: AMX's tasks then take blocks of 160 rows on 2 threads and
        // of 224 on 3, cut finer than one block a thread (Kernel::row_block).
        let tall = Case {
            m: 600,
            n: 40,
            k: 64,
            a_t: false,
            b_t: true,
        };
        for case in CASES.into_iter().chain([tall]) {
            for start in STARTS {
                for alpha in [0.75, 1.0] {
                    let want = run(reference, case, start, alpha, 1);
                    for threads in [1, 2, 3] {
                        let got = run(kernel, case, start, alpha, threads);
                        let same = want
                            .iter()
                            .zip(&got)
                            .all(|(x, y)| x.to_bits() == y.to_bits());
                        assert!(
                            same,
                            "{kernel:?} {case:?} {start} α {alpha} on {threads} threads"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn bf16_products_of_values_bf16_holds_exactly_equal_the_f32_product() {
    // Small integers are exact in bf16 and their sums exact in f32: every
    // path must give the f32 product's bits, whatever its rounding order.
    let (m, n, k) = (30, 70, 301);
    let a: Vec<f32> = (0..m * k).map(|i| (i * 7 % 17) as f32 - 8.0).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i * 5 % 13) as f32 - 6.0).collect();
    let product = |kernel: Kernel| {
        let mut c = vec![0f32; m * n];
        let cm = MatMut::row_major(&mut c, m, n).unwrap();
        let (am, bm) = (
            MatRef::row_major(&a, m, k).unwrap(),
            MatRef::row_major(&b, k, n).unwrap(),
        );
        if kernel.is_bf16() {
            gemm_bf16_with(kernel, cm, am, bm, 1.0, Start::Zero, 1).unwrap();
        } else {
            gemm_with(kernel, cm, am, bm, 1.0, Start::Zero, 1).unwrap();
        }
        c
    };
    let want = product(Kernel::Portable);
    for kernel in Kernel::available_bf16() {
        assert_eq!(product(kernel), want, "{kernel:?}");
    }
}

#[test]
fn every_epilogue_of_a_bf16_product_is_exact_where_its_terms_are() {
    // Small integers and α = 0.5: every product, sum and epilogue term is
    // exact in f32, so each element must be the exact value whatever the
    // kernel's order: α, C, the bias and the residual of whole tiles (3 × 3
    // of AMX's 32 × 32, three steps of depth each) and of edge ones, on one
    // thread and two.
    let (m, n, k) = (96, 100, 96);
    let small = |seed: usize, len: usize, modulus: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7 + seed * 13) % modulus) as f32 - (modulus / 2) as f32)
            .collect()
    };
    let (a, b) = (small(1, m * k, 9), small(2, k * n, 7));
    let (bias, c0, res) = (small(3, n, 11), small(4, m * n, 15), small(5, m * n, 13));
    for kernel in Kernel::available_bf16() {
        for start in STARTS {
            for alpha in [0.5f32, 1.0] {
                let mut want = vec![0f32; m * n];
                for (i, row) in want.chunks_mut(n).enumerate() {
                    for (j, w) in row.iter_mut().enumerate() {
                        let p: f32 = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
                        let (base, r) = (c0[i * n + j], res[i * n + j]);
                        *w = match start {
                            "zero" => alpha * p,
                            "keep" => base + alpha * p,
                            "bias" => bias[j] + alpha * p,
                            "residual" => r + (bias[j] + alpha * p),
                            _ => r + alpha * p,
                        };
                    }
                }
                for threads in [1, 2] {
                    let mut c = c0.clone();
                    let r = MatRef::row_major(&res, m, n).unwrap();
                    in_pool(threads, || {
                        gemm_bf16_with(
                            kernel,
                            MatMut::row_major(&mut c, m, n).unwrap(),
                            MatRef::row_major(&a, m, k).unwrap(),
                            MatRef::row_major(&b, k, n).unwrap(),
                            alpha,
                            start_of(start, &bias, r),
                            threads,
                        )
                    })
                    .unwrap();
                    assert_eq!(c, want, "{kernel:?} {start} α {alpha} {threads} threads");
                }
            }
        }
    }
}

#[test]
fn bf16_rounding_of_slices_equals_the_scalar_rounding() {
    // The SIMD paths (32 and 16 at a time) and the scalar tail against
    // `round`, on ties, NaN, infinities, zeros, subnormals and random
    // values, the special values moved through every path in turn.
    let mut v = vec![
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        f32::MIN_POSITIVE / 3.0,
        f32::MAX,
        -f32::MAX,
        // NaNs whose rounding would carry into the exponent or sign.
        f32::from_bits(0x7f80_ffff),
        f32::from_bits(0x7fff_ffff),
    ];
    v.extend(random(9, 40));
    // 53 values: 32 at once, then 16, then 5 one by one.
    for turn in 0..v.len() {
        v.rotate_right(1);
        let mut got = vec![0u16; v.len()];
        bf16_bits_into(&v, &mut got);
        for (x, g) in v.iter().zip(&got) {
            assert_eq!(u32::from(*g), bf16::round(*x), "{x:e} (turn {turn})");
        }
    }
}

#[test]
fn bf16_products_split_in_depth_add_up_to_the_whole_bit_for_bit() {
    // With α = 1 and no residual every bf16 kernel continues the sums that
    // C holds (AMX in its tile registers, AVX512_BF16 and the portable
    // kernel from C's values, as the f32 kernels do): a product cut in
    // depth at multiples of 32 into products that add into C (Start::Keep)
    // gives the one product's bits, on whole tiles and on partial ones (a
    // scratch tile), from zero or from the bias, with A and B in the
    // layouts of a linear layer's input gradient.
    let kernels = Kernel::available_bf16();
    if !kernels.contains(&Kernel::AmxBf16) {
        eprintln!("zgemm: AMX not on this CPU; its depth splitting is NOT covered here");
    }
    for (m, n, k) in [(64, 64, 1152), (45, 40, 868), (33, 70, 300)] {
        let (a, b, bias) = (random(1, m * k), random(2, n * k), random(3, n));
        let a = MatRef::row_major(&a, m, k).unwrap();
        // Bᵀ stored row-major, as the weight in dy·Wᵀ.
        let b = MatRef::row_major(&b, n, k).unwrap().t();
        for (&kernel, threads) in kernels.iter().flat_map(|k| [(k, 1), (k, 2)]) {
            for bias in [None, Some(bias.as_slice())] {
                let first = || bias.map_or(Start::Zero, Start::Bias);
                let mut whole = vec![0f32; m * n];
                let c = MatMut::row_major(&mut whole, m, n).unwrap();
                gemm_bf16_with(kernel, c, a, b, 1.0, first(), threads).unwrap();
                let mut split = vec![0f32; m * n];
                for (i, p0) in (0..k).step_by(256).enumerate() {
                    let p1 = (p0 + 256).min(k);
                    let c = MatMut::row_major(&mut split, m, n).unwrap();
                    let (a, b) = (a.t().sub_rows(p0, p1).t(), b.sub_rows(p0, p1));
                    let start = if i == 0 { first() } else { Start::Keep };
                    gemm_bf16_with(kernel, c, a, b, 1.0, start, threads).unwrap();
                }
                let same = whole
                    .iter()
                    .zip(&split)
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "{kernel:?} {m}x{n}x{k}, {threads} threads, bias {}",
                    bias.is_some()
                );
            }
        }
    }
}

#[test]
fn native_bf16_is_amx_or_avx512_bf16_on_amd() {
    // The vendor as Linux names it, read apart from CPUID's leaf 0.
    let Ok(cpuinfo) = std::fs::read_to_string("/proc/cpuinfo") else {
        eprintln!("zgemm: no /proc/cpuinfo; has_native_bf16 NOT checked");
        return;
    };
    let amd = cpuinfo
        .lines()
        .find(|l| l.starts_with("vendor_id"))
        .is_some_and(|l| l.contains("AuthenticAMD"));
    let want = match Kernel::best_bf16() {
        Kernel::AmxBf16 => true,
        Kernel::Avx512Bf16 => amd,
        _ => false,
    };
    eprintln!(
        "zgemm: best bf16 kernel {:?}, AMD: {amd}, native bf16: {want}",
        Kernel::best_bf16()
    );
    assert_eq!(has_native_bf16(), want);
}

#[test]
fn bf16_kernels_read_a_subnormal_start_as_zero() {
    // `vdpbf16ps` takes its accumulator with denormals as zero: 2⁻¹²⁷ in C
    // plus the product 2⁻⁶³·2⁻⁶³ = 2⁻¹²⁶ gives 2⁻¹²⁶, not 1.5·2⁻¹²⁶. The
    // portable reference does the same (checked against the CPU's kernel
    // where it has one), from C and from the bias.
    let tiny = 2f32.powi(-63);
    let (a, b) = ([0.0, tiny], [0.0, tiny]);
    let start_value = 2f32.powi(-127);
    assert!(start_value.is_subnormal());
    let bias = [start_value];
    for kernel in Kernel::available_bf16() {
        for keep in [true, false] {
            let mut c = [start_value];
            let start = if keep {
                Start::Keep
            } else {
                Start::Bias(&bias)
            };
            gemm_bf16_with(
                kernel,
                MatMut::row_major(&mut c, 1, 1).unwrap(),
                MatRef::row_major(&a, 1, 2).unwrap(),
                MatRef::row_major(&b, 2, 1).unwrap(),
                1.0,
                start,
                1,
            )
            .unwrap();
            assert_eq!(c[0], 2f32.powi(-126), "{kernel:?}, from C: {keep}");
        }
    }
}

#[test]
fn f32_products_at_alpha_one_are_one_chain_whatever_their_blocks() {
    // With α = 1 every f32 kernel starts each block from C (or the bias),
    // so an element is one fused multiply-add chain over all of k: the
    // product equals that chain written out here, and a product cut in
    // depth anywhere into products that add into C (Start::Keep) gives the
    // same bits (a linear layer's input gradient in tiles is the whole
    // layer's). Shapes past KC, partial tiles, a transposed A (packed) and
    // a C past 2 MiB (deeper blocks); row blocks that end in 1-3
    // rows (AVX2 runs them across several panels at a time: runs of six,
    // three and two whole panels, a shorter last run, a part of a panel
    // after them, and fewer rows than one tile).
    let kernels = covered();
    let cases = [
        (64, 80, 1152, false, &[1, 2][..]),
        (45, 40, 868, true, &[1, 2]),
        (33, 70, 300, false, &[1]),
        (700, 768, 1040, false, &[2]),
        (20, 130, 500, true, &[1, 2]),
        (19, 112, 300, false, &[1, 2]),
        (2, 50, 40, false, &[1]),
        (25, 230, 200, true, &[1]),
    ];
    for (m, n, k, a_t, threads) in cases {
        let (a_data, b_data, bias) = (random(1, m * k), random(2, n * k), random(3, n));
        let a = operand(&a_data, m, k, a_t);
        // Bᵀ stored row-major, as the weight in dy·Wᵀ.
        let b = MatRef::row_major(&b_data, n, k).unwrap().t();
        for bias in [None, Some(bias.as_slice())] {
            let chain: Vec<u32> = (0..m * n)
                .map(|e| {
                    let (i, j) = (e / n, e % n);
                    let mut acc = bias.map_or(0.0, |b| b[j]);
                    for p in 0..k {
                        acc = a.at(i, p).mul_add(b.at(p, j), acc);
                    }
                    acc.to_bits()
                })
                .collect();
            let first = || bias.map_or(Start::Zero, Start::Bias);
            for &kernel in &kernels {
                for &t in threads {
                    for cut in [k, 256, 100] {
                        let mut c = vec![0f32; m * n];
                        in_pool(t, || {
                            for (i, p0) in (0..k).step_by(cut).enumerate() {
                                let p1 = (p0 + cut).min(k);
                                let cv = MatMut::row_major(&mut c, m, n).unwrap();
                                let (a, b) = (a.t().sub_rows(p0, p1).t(), b.sub_rows(p0, p1));
                                let start = if i == 0 { first() } else { Start::Keep };
                                gemm_with(kernel, cv, a, b, 1.0, start, t).unwrap();
                            }
                        });
                        let bits: Vec<u32> = c.iter().map(|v| v.to_bits()).collect();
                        assert!(
                            bits == chain,
                            "{kernel:?} {m}x{n}x{k} (A transposed: {a_t}), {t} threads, \
                             cut every {cut}, bias {}",
                            bias.is_some()
                        );
                    }
                }
            }
        }
    }
}

/// Values for pairing tests: random, with ties, NaNs that would carry,
/// infinities and signed zeros scattered among them.
fn awkward(seed: u64, n: usize) -> Vec<f32> {
    let special = [
        1.0 + 1.0 / 256.0,
        f32::from_bits(0x7fff_ffff),
        f32::NEG_INFINITY,
        -0.0,
        f32::MIN_POSITIVE / 3.0,
    ];
    let mut v = random(seed, n);
    for (i, x) in v.iter_mut().enumerate().step_by(7) {
        *x = special[i % special.len()];
    }
    v
}

/// The pair element of `lo` (even k) and `hi`, each rounded by `round`.
fn pair_bits(lo: f32, hi: f32) -> u32 {
    bf16::round(lo) | (bf16::round(hi) << 16)
}

#[test]
fn bf16_pairs_of_every_operand_layout_equal_the_scalar_pairs() {
    // A with contiguous columns (xᵀ in a weight gradient: the in-register
    // transpose), and row-major; sizes with row tails short of 16, odd
    // depths and a single column. Padding pairs and rows are zero.
    for (r, k) in [(37, 45), (64, 32), (16, 1), (5, 70), (130, 97)] {
        let data = awkward(r as u64 * 1000 + k as u64, r * k);
        for transposed in [true, false] {
            let x = operand(&data, r, k, transposed);
            for threads in [1, 2] {
                let mut buf = Vec::new();
                let p = bf16::pair_columns(x, &mut buf, threads);
                let kp = k.div_ceil(2).div_ceil(16) * 16;
                assert_eq!((p.rows, p.cols), (r, kp));
                for i in 0..r.div_ceil(32) * 32 {
                    for q in 0..kp {
                        let v = |c: usize| if i < r && c < k { x.at(i, c) } else { 0.0 };
                        let want = pair_bits(v(2 * q), v(2 * q + 1));
                        let got = p.data[i * p.rs + q].to_bits();
                        assert_eq!(got, want, "{r}x{k} transposed {transposed} ({i}, {q})");
                    }
                }
            }
        }
    }
}

#[test]
fn two_rows_paired_both_ways_in_place_hold_the_scalar_pairs() {
    // With AVX-512 and without: odd and short widths, NaNs and infinities,
    // a width filling the row; what lies past the values is not read.
    for cols in [1, 31, 45, 64, 97, 200, 255, 320] {
        let stride = pairs_row_stride(cols);
        let half = stride / 2;
        let x = awkward(cols as u64, 2 * cols);
        let (x0, x1) = x.split_at(cols);
        let v = |r: &[f32], j: usize| if j < cols { r[j] } else { 0.0 };
        for simd in [false, true] {
            let mut rows = vec![f32::NAN; 2 * stride];
            rows[..cols].copy_from_slice(x0);
            rows[stride..stride + cols].copy_from_slice(x1);
            let mut scratch = vec![7.0; 3];
            bf16::pair_rows_in(&mut rows, stride, cols, &mut scratch, simd);
            let kp = padded_pairs(cols);
            assert!(2 * kp <= stride);
            for q in 0..kp {
                for (r, x) in [(0, x0), (1, x1)] {
                    let got = rows[r * stride + q].to_bits();
                    let want = pair_bits(v(x, 2 * q), v(x, 2 * q + 1));
                    assert_eq!(
                        got, want,
                        "along, {cols} values, simd {simd}, row {r} pair {q}"
                    );
                }
            }
            for j in 0..cols {
                let at = if j < half { half + j } else { stride + j };
                let want = pair_bits(x0[j], x1[j]);
                assert_eq!(
                    rows[at].to_bits(),
                    want,
                    "across, {cols} values, simd {simd}, {j}"
                );
            }
        }
    }
    assert_eq!(pairs_row_stride(50_304), 50_368);
    assert_eq!(pairs_row_stride(50_257), 50_304 + 64);
}

#[test]
fn bf16_products_of_a_given_as_pairs_give_the_bits_of_its_values() {
    // The two products of a loss's gradient paired in place (its rows
    // along, and its transpose across, cut in two), against `gemm_bf16` of
    // its f32 values: every kernel, one thread and two, `B` as f32 and as
    // bits, started from zero and from C; a planted wrong pair is caught.
    let (rows, k, n) = (64, 150, 40);
    let stride = pairs_row_stride(k);
    let half = stride / 2;
    let x = random(5, rows * k);
    let mut paired = vec![0f32; rows * stride];
    for i in 0..rows {
        paired[i * stride..][..k].copy_from_slice(&x[i * k..][..k]);
    }
    let mut scratch = Vec::new();
    for pair in paired.chunks_exact_mut(2 * stride) {
        pair_rows_both_ways(pair, stride, k, &mut scratch);
    }
    let kp = padded_pairs(k);
    let along = MatRef::new(&paired, rows, kp, stride, 1).unwrap();
    let across = |lo: bool| {
        let (at, count) = match lo {
            true => (half, half.min(k)),
            false => (stride + half, k - half.min(k)),
        };
        MatRef::new(&paired[at..], count, rows / 2, 1, 2 * stride).unwrap()
    };
    let xm = MatRef::row_major(&x, rows, k).unwrap();
    let w = random(6, k * n);
    let y = random(7, rows * n);
    let w16: Vec<u16> = w.iter().map(|&v| bf16::round(v) as u16).collect();
    let start = random(8, k.max(rows) * n);
    for kernel in Kernel::available_bf16() {
        for threads in [1, 2] {
            for keep in [false, true] {
                let what = format!("{kernel:?}, {threads} threads, keep {keep}");
                let begin = |len: usize| match keep {
                    true => start[..len].to_vec(),
                    false => vec![0f32; len],
                };
                let s = if keep { Start::Keep } else { Start::Zero };
                // dx = dl · W (W as f32 and as bits).
                let mut want = begin(rows * n);
                let cm = MatMut::row_major(&mut want, rows, n).unwrap();
                let wm = MatRef::row_major(&w, k, n).unwrap();
                gemm_bf16_with(kernel, cm, xm, wm, 1.0, s, threads).unwrap();
                for bits in [false, true] {
                    let mut got = begin(rows * n);
                    let cm = MatMut::row_major(&mut got, rows, n).unwrap();
                    match bits {
                        true => {
                            let wm = MatRef::row_major(&w16, k, n).unwrap();
                            gemm_bf16_pairs_with(kernel, cm, along, wm, 1.0, s, threads)
                        }
                        false => gemm_bf16_pairs_with(kernel, cm, along, wm, 1.0, s, threads),
                    }
                    .unwrap();
                    assert!(same_bits(&got, &want), "along, bits {bits}: {what}");
                }
                // dW = dlᵀ · y, its rows in two products.
                let mut want = begin(k * n);
                let cm = MatMut::row_major(&mut want, k, n).unwrap();
                let ym = MatRef::row_major(&y, rows, n).unwrap();
                gemm_bf16_with(kernel, cm, xm.t(), ym, 1.0, s, threads).unwrap();
                let mut got = begin(k * n);
                let (lo, hi) = got.split_at_mut(half.min(k) * n);
                for (c, a) in [(lo, across(true)), (hi, across(false))] {
                    let cm = MatMut::row_major(c, a.rows, n).unwrap();
                    gemm_bf16_pairs_with(kernel, cm, a, ym, 1.0, s, threads).unwrap();
                }
                assert!(same_bits(&got, &want), "across: {what}");
            }
        }
    }
    // A wrong pair in the along rows changes the product.
    let mut wrong = paired.clone();
    wrong[3 * stride + 5] = 1.0;
    let mut got = vec![0f32; rows * n];
    let cm = MatMut::row_major(&mut got, rows, n).unwrap();
    let along = MatRef::new(&wrong, rows, kp, stride, 1).unwrap();
    let wm = MatRef::row_major(&w, k, n).unwrap();
    gemm_bf16_pairs(cm, along, wm, 1.0, Start::Zero, 1).unwrap();
    let mut want = vec![0f32; rows * n];
    let cm = MatMut::row_major(&mut want, rows, n).unwrap();
    gemm_bf16(cm, xm, wm, 1.0, Start::Zero, 1).unwrap();
    assert!(!same_bits(&got, &want));
    // Pairs whose depth is not whole steps of 16, or rows read in place not
    // whole tiles of 32, are refused.
    let short = MatRef::new(&paired, rows, kp - 1, stride, 1).unwrap();
    let mut c = vec![0f32; rows * n];
    let cm = MatMut::row_major(&mut c, rows, n).unwrap();
    assert!(gemm_bf16_pairs(cm, short, wm, 1.0, Start::Zero, 1).is_err());
    let few = MatRef::new(&paired, rows - 2, kp, stride, 1).unwrap();
    let cm = MatMut::row_major(&mut c[..(rows - 2) * n], rows - 2, n).unwrap();
    assert!(gemm_bf16_pairs(cm, few, wm, 1.0, Start::Zero, 1).is_err());
}

#[test]
fn pairs_given_by_column_are_copied_into_padded_rows_for_amx() {
    // AMX reads `A`'s pairs in place by rows of 32: pairs given by column
    // (the head's `dlᵀ`) are copied into whole rows first, zero past them.
    let (rows, kp) = (37, 16);
    let data = random(3, rows * kp * 3);
    let by_column = MatRef::new(&data, rows, kp, 1, 3 * rows).unwrap();
    let mut buf = Vec::new();
    let copied = bf16::pairs_into_rows(by_column, &mut buf);
    assert_eq!((copied.rows, copied.cols, copied.cs), (rows, kp, 1));
    assert_eq!(copied.data.as_ptr().align_offset(64), 0);
    for i in 0..rows.div_ceil(32) * 32 {
        for q in 0..copied.rs {
            let want = if i < rows && q < kp {
                by_column.at(i, q)
            } else {
                0.0
            };
            let got = copied.data[i * copied.rs + q];
            assert_eq!(got.to_bits(), want.to_bits(), "({i}, {q})");
        }
    }
}

/// Whether two products agree to the last bit.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn bf16_operands_given_as_bits_give_the_bits_of_their_f32_originals() {
    // An activation its producer wrote in bf16 (`MatRef<u16>`) multiplies
    // as the f32 values it was rounded from: A and B row-major or
    // transposed (each layout's own pairing path: rows copied or read in
    // place, the in-register transpose, pairs of rows packed with B), odd
    // sizes, both
    // operands or one of them as bits, every bf16 kernel, 1 and 2 threads.
    // 64x64x96: A and Bᵀ read in place as pairs. 37x70x256: Bᵀ's pairs
    // packed from where they lie, though its 70 rows are no whole tiles and
    // lie 512 bytes apart (a tied head's token table at d 256).
    for (m, n, k) in [
        (37, 70, 45),
        (64, 96, 130),
        (5, 33, 1),
        (64, 64, 96),
        (37, 70, 256),
    ] {
        // (Not `awkward`: its NaNs and infinities would reach every element
        // of C and hide a wrong bit.)
        let (a, b) = (random(m as u64, m * k), random(n as u64 + 7, k * n));
        let bits = |v: &[f32]| -> Vec<u16> { v.iter().map(|&x| bf16::round(x) as u16).collect() };
        let (a16, b16) = (bits(&a), bits(&b));
        for kernel in Kernel::available_bf16() {
            for (a_t, b_t, threads) in [
                (false, false, 1),
                (true, false, 2),
                (false, true, 2),
                (true, true, 1),
            ] {
                let want = {
                    let mut c = vec![0f32; m * n];
                    let cm = MatMut::row_major(&mut c, m, n).unwrap();
                    let (am, bm) = (operand(&a, m, k, a_t), operand(&b, k, n, b_t));
                    gemm_bf16_with(kernel, cm, am, bm, 1.0, Start::Zero, threads).unwrap();
                    c
                };
                let (am, bm) = (operand(&a16, m, k, a_t), operand(&b16, k, n, b_t));
                let mut both = vec![0f32; m * n];
                let cm = MatMut::row_major(&mut both, m, n).unwrap();
                gemm_bf16_with(kernel, cm, am, bm, 1.0, Start::Zero, threads).unwrap();
                let mut a_only = vec![0f32; m * n];
                let cm = MatMut::row_major(&mut a_only, m, n).unwrap();
                let bf = operand(&b, k, n, b_t);
                gemm_bf16_with(kernel, cm, am, bf, 1.0, Start::Zero, threads).unwrap();
                let mut b_only = vec![0f32; m * n];
                let cm = MatMut::row_major(&mut b_only, m, n).unwrap();
                let af = operand(&a, m, k, a_t);
                gemm_bf16_with(kernel, cm, af, bm, 1.0, Start::Zero, threads).unwrap();
                let what = format!("{kernel:?} {m}x{n}x{k} a_t {a_t} b_t {b_t} {threads} threads");
                let same = |got: &[f32]| {
                    got.iter()
                        .zip(&want)
                        .all(|(x, y)| x.to_bits() == y.to_bits())
                };
                assert!(same(&both), "both as bits: {what}");
                assert!(same(&a_only), "A as bits: {what}");
                assert!(same(&b_only), "B as bits: {what}");
            }
        }
    }
}

#[test]
fn bf16_row_pairs_are_packed_as_the_scalar_pairs() {
    // A row-major B (f32 values, or bf16 bits) packed straight into pair
    // panels: panel rows from two B rows each, a short last panel zero on
    // the right, pair rows past B's last row zero. Blocks of columns whose
    // width is a multiple of 16 take AVX-512's whole-row path (its place
    // in each panel), others the panel-by-panel one.
    let (k, nr) = (45, 32);
    for (n, j0, j1) in [
        (70usize, 0usize, 70usize),
        (80, 0, 80),
        (96, 32, 96),
        (112, 16, 80),
    ] {
        let data = awkward(11, k * n);
        let bits: Vec<u16> = data.iter().map(|&v| bf16::round(v) as u16).collect();
        let (b, b_bits) = (
            MatRef::row_major(&data, k, n).unwrap(),
            MatRef::row_major(&bits, k, n).unwrap(),
        );
        for (q0, kc) in [(0, 16), (16, 9)] {
            let panels = (j1 - j0).div_ceil(nr);
            let mut dst = vec![f32::NAN; panels * nr * kc];
            let mut dst_bits = dst.clone();
            bf16::pack_row_pairs(&b, q0, kc, j0, j1, nr, &mut dst);
            bf16::pack_row_pairs(&b_bits, q0, kc, j0, j1, nr, &mut dst_bits);
            for (t, (panel, panel_bits)) in dst
                .chunks(nr * kc)
                .zip(dst_bits.chunks(nr * kc))
                .enumerate()
            {
                for q in 0..kc {
                    for j in 0..nr {
                        let col = j0 + t * nr + j;
                        let v = |row: usize| {
                            if row < k && col < j1 {
                                b.at(row, col)
                            } else {
                                0.0
                            }
                        };
                        let p = q0 + q;
                        let want = pair_bits(v(2 * p), v(2 * p + 1));
                        let at = format!("{n} columns {j0}..{j1}: pair row {p}, column {col}");
                        assert_eq!(panel[q * nr + j].to_bits(), want, "f32: {at}");
                        assert_eq!(panel_bits[q * nr + j].to_bits(), want, "bits: {at}");
                    }
                }
            }
        }
    }
}

#[test]
fn bf16_rounding_is_to_nearest_even_and_keeps_nan() {
    let bits = |x: f32| bf16::round(x);
    // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: to the even one, 1.
    assert_eq!(bits(1.0 + 1.0 / 256.0), 0x3f80);
    // 1 + 3·2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: up, to even.
    assert_eq!(bits(1.0 + 3.0 / 256.0), 0x3f82);
    assert_eq!(bits(1.0 + 1.0 / 256.0 + 1.0 / 65536.0), 0x3f81);
    assert_eq!(bits(-2.0), 0xc000);
    assert_eq!(bits(f32::INFINITY), 0x7f80);
    // The largest f32 rounds up to infinity, as in `half`.
    assert_eq!(bits(f32::MAX), 0x7f80);
    let nan = bits(f32::NAN);
    assert!(nan & 0x7f80 == 0x7f80 && nan & 0x7f != 0 && nan & 0x40 != 0);
}

#[test]
fn a_wrong_product_is_outside_the_bound() {
    // The reference test's bound must not admit a result that misses a
    // term: a product over k-1 terms differs from the true one by far more.
    let (m, n, k) = (4, 16, 300);
    let a = random(1, m * k);
    let b = random(2, k * n);
    let mut full = vec![0f32; m * n];
    let mut short = vec![0f32; m * n];
    let am = MatRef::row_major(&a, m, k).unwrap();
    gemm_with(
        Kernel::Portable,
        MatMut::row_major(&mut full, m, n).unwrap(),
        am,
        MatRef::row_major(&b, k, n).unwrap(),
        1.0,
        Start::Zero,
        1,
    )
    .unwrap();
    let a_short = MatRef::new(&a, m, k - 1, k, 1).unwrap();
    gemm_with(
        Kernel::Portable,
        MatMut::row_major(&mut short, m, n).unwrap(),
        a_short,
        MatRef::row_major(&b, k - 1, n).unwrap(),
        1.0,
        Start::Zero,
        1,
    )
    .unwrap();
    let u = f64::from(f32::EPSILON) / 2.0;
    let outside = (0..m * n).filter(|&e| {
        let (i, j) = (e / n, e % n);
        let mag: f64 = (0..k)
            .map(|p| f64::from(a[i * k + p] * b[p * n + j]).abs())
            .sum();
        f64::from((full[e] - short[e]).abs()) > (k as f64 + 2.0) * u * mag
    });
    assert!(outside.count() > m * n * 9 / 10);
}

#[test]
fn an_empty_depth_zeroes_or_keeps_c() {
    for kernel in Kernel::available() {
        let mut c = vec![5f32; 6];
        let a: [f32; 0] = [];
        let (am, bm) = (
            MatRef::new(&a, 2, 0, 0, 1).unwrap(),
            MatRef::new(&a, 0, 3, 3, 1).unwrap(),
        );
        gemm_with(
            kernel,
            MatMut::row_major(&mut c, 2, 3).unwrap(),
            am,
            bm,
            1.0,
            Start::Keep,
            1,
        )
        .unwrap();
        assert_eq!(c, vec![5.0; 6]);
        gemm_with(
            kernel,
            MatMut::row_major(&mut c, 2, 3).unwrap(),
            am,
            bm,
            1.0,
            Start::Zero,
            1,
        )
        .unwrap();
        assert_eq!(c, vec![0.0; 6]);
        gemm_with(
            kernel,
            MatMut::row_major(&mut c, 2, 3).unwrap(),
            am,
            bm,
            1.0,
            Start::Bias(&[1.0, 2.0, 3.0]),
            1,
        )
        .unwrap();
        assert_eq!(c, vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
        let r = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0];
        gemm_with(
            kernel,
            MatMut::row_major(&mut c, 2, 3).unwrap(),
            am,
            bm,
            1.0,
            Start::Residual {
                bias: Some(&[1.0, 2.0, 3.0]),
                r: MatRef::row_major(&r, 2, 3).unwrap(),
            },
            1,
        )
        .unwrap();
        assert_eq!(c, vec![11.0, 22.0, 33.0, 41.0, 52.0, 63.0]);
    }
}

#[test]
fn a_residual_start_gives_the_bits_of_adding_r_after_the_product() {
    // What the model did before the sum moved into the tiles: a Bias (or
    // Zero) product, then R + y in a pass of its own. Depths of one block,
    // several, and a short last one; columns in several blocks of them
    // (more than 1024 on one thread: every L2 size cuts them); every kernel
    // and thread count.
    for kernel in covered() {
        for (m, k, n) in [
            (13, 40, 37),
            (50, 2 * KC + 7, 70),
            (7, KC, 16),
            (9, KC + 5, 1100),
        ] {
            let (a, b, bias, res) = (
                random(21, m * k),
                random(22, k * n),
                random(23, n),
                random(24, m * n),
            );
            let (am, bm) = (
                MatRef::row_major(&a, m, k).unwrap(),
                MatRef::row_major(&b, k, n).unwrap(),
            );
            let r = MatRef::row_major(&res, m, n).unwrap();
            for with_bias in [true, false] {
                let mut want = vec![0f32; m * n];
                let start = if with_bias {
                    Start::Bias(&bias)
                } else {
                    Start::Zero
                };
                gemm_with(
                    kernel,
                    MatMut::row_major(&mut want, m, n).unwrap(),
                    am,
                    bm,
                    1.0,
                    start,
                    1,
                )
                .unwrap();
                want.iter_mut().zip(&res).for_each(|(y, r)| *y += r);
                for threads in [1, 2] {
                    let mut got = vec![0f32; m * n];
                    in_pool(threads, || {
                        gemm_with(
                            kernel,
                            MatMut::row_major(&mut got, m, n).unwrap(),
                            am,
                            bm,
                            1.0,
                            Start::Residual {
                                bias: with_bias.then_some(&bias[..]),
                                r,
                            },
                            threads,
                        )
                    })
                    .unwrap();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{kernel:?} {m}x{k}x{n} bias {with_bias} on {threads} threads"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_shapes_and_views_are_refused() {
    let data = vec![0f32; 12];
    assert!(matches!(
        MatRef::new(&data, 3, 5, 5, 1),
        Err(ShapeError::OutOfBounds {
            need: 15,
            have: 12,
            ..
        })
    ));
    assert!(MatRef::new(&data, 3, 4, 4, 1).is_ok());
    let mut c = vec![0f32; 12];
    assert!(MatMut::new(&mut c, 3, 4, 3).is_err(), "rows overlapping");
    let a = MatRef::row_major(&data, 3, 4).unwrap();
    let b = MatRef::row_major(&data, 3, 4).unwrap();
    let err = gemm(
        MatMut::row_major(&mut c, 3, 4).unwrap(),
        a,
        b,
        1.0,
        Start::Zero,
        1,
    )
    .unwrap_err();
    assert!(err.to_string().contains("A 3x4 · B 3x4"), "{err}");
    let b = MatRef::row_major(&data, 4, 3).unwrap();
    let err = gemm(
        MatMut::row_major(&mut c, 3, 3).unwrap(),
        a,
        b,
        1.0,
        Start::Bias(&[1.0]),
        1,
    )
    .unwrap_err();
    assert!(matches!(err, ShapeError::Bias { len: 1, cols: 3 }));
    // A residual of another shape, or with its columns apart.
    for (r, what) in [
        (MatRef::row_major(&data, 4, 3).unwrap(), "4x3 view"),
        (
            MatRef::new(&data, 3, 3, 3, 1).unwrap().t(),
            "column stride 3",
        ),
    ] {
        let err = gemm(
            MatMut::row_major(&mut c, 3, 3).unwrap(),
            a,
            b,
            1.0,
            Start::Residual { bias: None, r },
            1,
        )
        .unwrap_err();
        assert!(matches!(err, ShapeError::Residual { .. }), "{err}");
        assert!(err.to_string().contains(what), "{err}");
    }
    // Uninitialised memory is written, never read.
    let mut fresh = vec![std::mem::MaybeUninit::<f32>::uninit(); 9];
    let c = MatMut::uninit(&mut fresh, 3, 3, 3).unwrap();
    let err = gemm(c, a, b, 1.0, Start::Keep, 1).unwrap_err();
    assert!(matches!(err, ShapeError::KeepUninit));
}

#[test]
fn operands_read_through_any_strides_give_the_contiguous_bits() {
    // Every other row and column of larger matrices (neither stride 1: the
    // packing's general path) against the same values stored contiguously.
    let (m, n, k) = (19, 35, 400);
    let a_big = random(5, 2 * m * 2 * k);
    let b_big = random(6, 2 * k * 2 * n);
    let a_view = MatRef::new(&a_big, m, k, 4 * k, 2).unwrap();
    let b_view = MatRef::new(&b_big, k, n, 4 * n, 2).unwrap();
    let a_flat: Vec<f32> = (0..m * k).map(|e| a_view.at(e / k, e % k)).collect();
    let b_flat: Vec<f32> = (0..k * n).map(|e| b_view.at(e / n, e % n)).collect();
    for kernel in Kernel::available() {
        let mut strided = vec![0f32; m * n];
        let mut flat = vec![0f32; m * n];
        let c = MatMut::row_major(&mut strided, m, n).unwrap();
        gemm_with(kernel, c, a_view, b_view, 1.0, Start::Zero, 1).unwrap();
        let (a, b) = (
            MatRef::row_major(&a_flat, m, k).unwrap(),
            MatRef::row_major(&b_flat, k, n).unwrap(),
        );
        gemm_with(
            kernel,
            MatMut::row_major(&mut flat, m, n).unwrap(),
            a,
            b,
            1.0,
            Start::Zero,
            1,
        )
        .unwrap();
        assert!(
            strided
                .iter()
                .zip(&flat)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{kernel:?}"
        );
        assert!(flat.iter().any(|&v| v != 0.0));
    }
}

#[test]
fn a_transposed_block_packs_to_the_values_its_panels_hold() {
    // Aᵀ stored row-major (the weight gradients' xᵀ), a block of rows packed
    // a stored row at a time: every panel holds A's rows i0 + q·mr.. down the
    // depth, zero below the block's last row, for blocks that are and are not
    // multiples of mr, at offsets in both dimensions.
    let (m, k) = (40, 70);
    let data = random(8, m * k);
    let a = MatRef::row_major(&data, k, m).unwrap().t();
    for (i0, mlen, p0, kc, mr) in [
        (0usize, 1usize, 0usize, 1usize, 6usize),
        (0, 36, 0, 70, 6),
        (3, 25, 5, 19, 6),
        (8, 32, 64, 6, 4),
        (1, 39, 2, 67, 4),
    ] {
        let tall = mlen.div_ceil(mr);
        let mut dst = vec![f32::NAN; tall * mr * kc];
        pack_a_transposed(&a, i0, mlen, p0, kc, mr, &mut dst);
        for (q, panel) in dst.chunks(mr * kc).enumerate() {
            for p in 0..kc {
                for r in 0..mr {
                    let i = q * mr + r;
                    let want = if i < mlen { a.at(i0 + i, p0 + p) } else { 0.0 };
                    assert_eq!(
                        panel[p * mr + r].to_bits(),
                        want.to_bits(),
                        "i0 {i0} mlen {mlen} p0 {p0} kc {kc} mr {mr}: panel {q} ({p}, {r})"
                    );
                }
            }
        }
    }
}

#[test]
fn panels_pack_to_the_values_they_hold() {
    // A row-major B (packed a group of rows at a time, whole panels of 16
    // and 64 columns with AVX where the CPU has it, the rest in plain Rust)
    // and one whose columns are contiguous (8×8 AVX tiles where the CPU has
    // AVX, scalar edges everywhere; the row-major one also split by rows
    // across threads), against element-by-element reads: several panels,
    // offsets, depths and widths that are and are not multiples of 8, and a
    // last panel narrower than nr.
    let (n, k) = (140, 403);
    let data = random(7, n * k);
    let transposed = MatRef::row_major(&data, n, k).unwrap().t();
    let row_major = MatRef::row_major(&data, k, n).unwrap();
    for b in [row_major, transposed] {
        for (p0, kc, j0, j1, nr) in [
            (0usize, 1usize, 0usize, 1usize, 16usize),
            (0, 384, 0, 16, 16),
            (5, 19, 3, 20, 32),
            (384, 19, 16, 45, 16),
            (1, 7, 0, 7, 16),
            (8, 64, 29, 45, 16),
            (0, 403, 40, 45, 16),
            (2, 400, 13, 45, 32),
            (7, 50, 2, 140, 64),
            (0, 33, 70, 134, 64),
            (16, 17, 60, 140, 16),
        ] {
            let panels = (j1 - j0).div_ceil(nr);
            let mut packings = vec![("one thread", vec![f32::NAN; panels * kc * nr])];
            pack_b_panels(&b, p0, kc, j0, j1, nr, &mut packings[0].1, None);
            // A row-major B on several threads, each packing a run of rows
            // (more threads than rows in some cases), without and with the
            // column sums, which are the written-out grouping's from `p0`
            // whatever the threads.
            if b.cs == 1 {
                let block: Vec<f32> = (p0..p0 + kc)
                    .flat_map(|p| (j0..j1).map(move |j| (p, j)))
                    .map(|(p, j)| b.at(p, j))
                    .collect();
                let want_sums = grouped_column_sums(&block, kc, j1 - j0);
                let mut sums = vec![0f32; j1 - j0];
                let mut dst = vec![f32::NAN; panels * kc * nr];
                pack_b_panels(&b, p0, kc, j0, j1, nr, &mut dst, Some(&mut sums));
                packings.push(("one thread, sums", dst));
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&sums),
                    bits(&want_sums),
                    "one thread: sums of p0 {p0} kc {kc} j0 {j0} j1 {j1}"
                );
                for (threads, name) in [(2, "2 threads"), (3, "3 threads"), (8, "8 threads")] {
                    let mut dst = vec![f32::NAN; panels * kc * nr];
                    pack_b_rows_split(&b, p0, kc, j0, j1, nr, threads, &mut dst, None);
                    packings.push((name, dst));
                    // The buffer as a previous block may leave it.
                    let (mut sums, mut buffer) = (vec![0f32; j1 - j0], vec![f32::NAN; 7]);
                    let mut dst = vec![f32::NAN; panels * kc * nr];
                    let with = Some((&mut sums[..], &mut buffer));
                    pack_b_rows_split(&b, p0, kc, j0, j1, nr, threads, &mut dst, with);
                    packings.push((name, dst));
                    assert_eq!(
                        bits(&sums),
                        bits(&want_sums),
                        "{name}: sums of p0 {p0} kc {kc} j0 {j0} j1 {j1}"
                    );
                }
            }
            for (how, dst) in &packings {
                for (q, panel) in dst.chunks(kc * nr).enumerate() {
                    for p in 0..kc {
                        for c in 0..nr {
                            let j = j0 + q * nr + c;
                            let want = if j < j1 { b.at(p0 + p, j) } else { 0.0 };
                            assert_eq!(
                                panel[p * nr + c].to_bits(),
                                want.to_bits(),
                                "{how}, strides ({}, {}) p0 {p0} kc {kc} j0 {j0} j1 {j1} nr {nr}: panel {q} ({p}, {c})",
                                b.rs,
                                b.cs
                            );
                        }
                    }
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if !std::arch::is_x86_feature_detected!("avx") {
        println!("SKIPPED the AVX tiles: this CPU has no AVX (scalar path checked)");
    }
}

#[test]
fn packed_b_products_give_the_bits_of_gemm_on_that_part_of_b() {
    // Rows of B from an offset (across a depth block boundary in the deep
    // case), leading columns not a multiple of nr, A and B row-major or
    // transposed, every start: against gemm_with on the same part of B.
    let parts = [
        (13, 0, 64, 45),
        (6, 5, 70, 17),
        (64, 300, 900, 32),
        (1, 899, 900, 1),
        (20, 10, 10, 9),
    ];
    for kernel in covered() {
        let pack = |p: &mut PackedB, b: MatRef<'_>| p.pack_for(kernel, b);
        let reference = |c: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, alpha, start: Start<'_>| {
            gemm_with(kernel, c, a, b, alpha, start, 1)
        };
        packed_products_match(
            &format!("{kernel:?}"),
            900,
            pack,
            gemm_packed,
            reference,
            &parts,
        );
    }
}

#[test]
fn packed_bf16_products_give_the_bits_of_gemm_bf16_on_that_part_of_b() {
    // As for f32 (B 899 rows), with the parts a bf16 pack allows: starting at
    // a multiple of 32 rows, ending at an even row or the last (odd here).
    let parts = [
        (13, 0, 64, 45),
        (6, 64, 70, 17),
        (64, 64, 899, 32),
        (1, 896, 899, 1),
        (20, 32, 32, 9),
        (33, 0, 898, 40),
    ];
    let reference = |c: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, alpha, start: Start<'_>| {
        gemm_bf16(c, a, b, alpha, start, 1)
    };
    let name = format!("{:?}", Kernel::best_bf16());
    packed_products_match(
        &name,
        899,
        PackedB::pack_bf16,
        gemm_packed_bf16,
        reference,
        &parts,
    );
}

type Product = fn(
    MatMut,
    MatRef,
    &PackedB,
    (std::ops::Range<usize>, usize),
    f32,
    Start,
) -> Result<(), ShapeError>;

/// `product` on parts `(m, r0, r1, n)` of a `rows`×150 `B` packed by `pack`
/// against `reference` on the same part, bit for bit: `n` columns from
/// the first, second and third panel (where they fit).
fn packed_products_match(
    name: &str,
    rows: usize,
    pack: impl Fn(&mut PackedB, MatRef),
    product: Product,
    reference: impl Fn(MatMut, MatRef, MatRef, f32, Start) -> Result<(), ShapeError>,
    parts: &[(usize, usize, usize, usize)],
) {
    let cols = 150;
    let b_data = random(11, rows * cols);
    for b_t in [false, true] {
        let b = operand(&b_data, rows, cols, b_t);
        let mut packed = PackedB::new();
        pack(&mut packed, b);
        assert_eq!((packed.rows(), packed.cols()), (rows, cols));
        let from_panels = (0..3).map(|p| p * packed.panel_width());
        let parts = parts
            .iter()
            .flat_map(|&part| from_panels.clone().map(move |c0| (part, c0)));
        for ((m, r0, r1, n), c0) in parts.filter(|&((.., n), c0)| c0 + n <= cols) {
            let k = r1 - r0;
            let a_data = random(12, m * k);
            let bias = random(13, n);
            let res = random(15, m * n);
            let r = MatRef::row_major(&res, m, n).unwrap();
            for a_t in [false, true] {
                let a = operand(&a_data, m, k, a_t);
                let b_part =
                    MatRef::new(&b.data[r0 * b.rs + c0 * b.cs..], k, n, b.rs, b.cs).unwrap();
                for (start, alpha) in STARTS.into_iter().flat_map(|s| [(s, 0.5), (s, 1.0)]) {
                    let start_of = |s: &str| start_of(s, &bias, r);
                    let rs = n + 2;
                    let mut want = random(14, m * rs);
                    let mut got = want.clone();
                    let c = MatMut::new(&mut want, m, n, rs).unwrap();
                    reference(c, a, b_part, alpha, start_of(start)).unwrap();
                    let c = MatMut::new(&mut got, m, n, rs).unwrap();
                    product(c, a, &packed, (r0..r1, c0), alpha, start_of(start)).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{name} b_t {b_t} a_t {a_t} m {m} rows {r0}..{r1} n {n} from column {c0} {start} α {alpha}"
                    );
                }
            }
        }
    }
}

#[test]
fn packed_b_products_refuse_parts_it_does_not_hold() {
    let b_data = random(15, 20 * 10);
    let a_data = random(16, 4 * 20);
    let mut c = vec![0.0; 4 * 11];
    let mut packed = PackedB::new();
    let a = MatRef::row_major(&a_data, 4, 20).unwrap();
    let unpacked = gemm_packed(
        MatMut::row_major(&mut c, 4, 10).unwrap(),
        a,
        &packed,
        (0..20, 0),
        1.0,
        Start::Zero,
    );
    assert!(unpacked.is_err());
    packed.pack(MatRef::row_major(&b_data, 20, 10).unwrap());
    // Rows past B's, columns past them, too few rows for A, a column
    // start inside a panel, columns from a panel past B's.
    let cuts = [
        (0..21, 0, 10),
        (0..20, 0, 11),
        (1..20, 0, 10),
        (0..20, 1, 9),
        (0..20, 16, 1),
    ];
    for (rows, col, n) in cuts {
        let r = gemm_packed(
            MatMut::row_major(&mut c, 4, n).unwrap(),
            a.sub_rows(0, 4),
            &packed,
            (rows.clone(), col),
            1.0,
            Start::Zero,
        );
        assert!(
            matches!(r, Err(ShapeError::Mismatch { .. })),
            "rows {rows:?}, {n} columns from {col}: {r:?}"
        );
    }
    gemm_packed(
        MatMut::row_major(&mut c, 4, 10).unwrap(),
        a,
        &packed,
        (0..20, 0),
        1.0,
        Start::Zero,
    )
    .unwrap(); // A bf16 pack takes parts that start at a multiple of 32 rows and do
               // not split a pair; neither kind of product takes the other's pack.
    let b_data = random(17, 100 * 10);
    let a_data = random(18, 4 * 101);
    let b = MatRef::row_major(&b_data, 100, 10).unwrap();
    let mut paired = PackedB::new();
    paired.pack_bf16(b);
    #[allow(clippy::reversed_empty_ranges)]
    for rows in [16..48, 32..65, 0..101, 64..32] {
        let a = MatRef::row_major(&a_data, 4, rows.len()).unwrap();
        let out = MatMut::row_major(&mut c, 4, 10).unwrap();
        let r = gemm_packed_bf16(out, a, &paired, (rows.clone(), 0), 1.0, Start::Zero);
        assert!(
            matches!(r, Err(ShapeError::Mismatch { .. })),
            "rows {rows:?}: {r:?}"
        );
    }
    let a = MatRef::row_major(&a_data, 4, 100).unwrap();
    let out = MatMut::row_major(&mut c, 4, 10).unwrap();
    assert!(gemm_packed(out, a, &paired, (0..100, 0), 1.0, Start::Zero).is_err());
    let out = MatMut::row_major(&mut c, 4, 10).unwrap();
    assert!(
        gemm_packed_bf16(out, a.sub_rows(0, 4), &packed, (0..20, 0), 1.0, Start::Zero).is_err()
    );
    let out = MatMut::row_major(&mut c, 4, 10).unwrap();
    gemm_packed_bf16(out, a, &paired, (0..100, 0), 1.0, Start::Zero).unwrap();
}

#[test]
fn the_fma_ceiling_counts_its_flops_on_simd_kernels_only() {
    for kernel in Kernel::available()
        .into_iter()
        .chain(Kernel::available_bf16())
    {
        let per_step = match kernel {
            Kernel::Avx512 => Some(12 * 16 * 2),
            Kernel::Avx2 => Some(12 * 8 * 2),
            // `vdpbf16ps`: two products and two adds a lane.
            Kernel::Avx512Bf16 => Some(12 * 16 * 4),
            _ => None,
        };
        assert_eq!(kernel.fma_chains(0), per_step.map(|_| 0), "{kernel:?}");
        assert_eq!(
            kernel.fma_chains(1000),
            per_step.map(|f| 1000 * f),
            "{kernel:?}"
        );
    }
    if !Kernel::available_bf16().contains(&Kernel::Avx512Bf16) {
        eprintln!("zgemm: the vdpbf16ps ceiling is NOT covered here (no avx512bf16 on this CPU)");
    }
}

/// `B`'s column sums as `gemm_summing_b` documents them, written out: each
/// column's rows in groups of `SUM_GROUP`, each group from zero in row
/// order, the groups added in order to a sum from zero.
fn grouped_column_sums(b: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut sums = vec![0f32; cols];
    for (j, sum) in sums.iter_mut().enumerate() {
        for group in (0..rows).step_by(SUM_GROUP) {
            let mut g = 0f32;
            for i in group..rows.min(group + SUM_GROUP) {
                g += b[i * cols + j];
            }
            *sum += g;
        }
    }
    sums
}

/// The product of `gemm_summing_b` is `gemm`'s, bit for bit, and its sums
/// are the written-out grouping's bits, at 1-3 threads: depths that end
/// inside a group, cross one and several depth blocks (KC, and deeper
/// ones), none at all; more columns than one block of them; no rows of A;
/// every start.
#[test]
fn column_sums_of_b_come_with_the_product() {
    let starts = |bias: &'static [f32]| [Start::Zero, Start::Bias(bias), Start::Keep];
    let bias: &'static [f32] = Box::leak(random(9, 2100).into_boxed_slice());
    for (m, n, k) in [
        (7, 5, 3),
        (13, 33, 16),
        (6, 40, 17),
        (25, 47, 513),
        (3, 2100, 40),
        (0, 9, 70),
        (5, 9, 0),
        (40, 16, KC * 2 + 35),
        // Deep blocks (a C past 2 MiB): 2 of 560 rows.
        (1024, 520, 1100),
    ] {
        let (a, b) = (random(1, m * k), random(2, k * n));
        let want_sums = grouped_column_sums(&b, k, n);
        for start in starts(&bias[..n]) {
            for threads in 1..=3 {
                let c0 = random(3, m * n);
                let (mut want, mut got) = (c0.clone(), c0.clone());
                let (am, bm) = (
                    MatRef::row_major(&a, m, k).unwrap(),
                    MatRef::row_major(&b, k, n).unwrap(),
                );
                gemm(
                    MatMut::row_major(&mut want, m, n).unwrap(),
                    am,
                    bm,
                    0.75,
                    start,
                    threads,
                )
                .unwrap();
                let mut sums = vec![f32::NAN; n];
                let c = MatMut::row_major(&mut got, m, n).unwrap();
                gemm_summing_b(c, am, bm, 0.75, start, threads, &mut sums).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "C, {m}x{n}x{k}, {threads} threads");
                assert_eq!(
                    bits(&sums),
                    bits(&want_sums),
                    "sums, {m}x{n}x{k}, {threads} threads"
                );
            }
        }
    }
    // Refused: sums of another length, and a B whose columns are not adjacent.
    let (a, b) = (random(1, 12), random(2, 12));
    let mut c = vec![0f32; 9];
    let am = MatRef::row_major(&a, 3, 4).unwrap();
    let run = |b: MatRef, sums: &mut [f32], c: &mut [f32]| {
        let c = MatMut::row_major(c, 3, 3).unwrap();
        gemm_summing_b(c, am, b, 1.0, Start::Zero, 1, sums)
    };
    let bm = MatRef::row_major(&b, 4, 3).unwrap();
    assert!(matches!(
        run(bm, &mut [0.0; 2], &mut c),
        Err(ShapeError::Sums { len: 2, cols: 3 })
    ));
    let bt = MatRef::row_major(&b, 3, 4).unwrap().t();
    assert!(matches!(
        run(bt, &mut [0.0; 3], &mut c),
        Err(ShapeError::SumsLayout { .. })
    ));
}

#[test]
fn bf16_products_rounded_as_they_store_give_the_rounded_bits_of_the_f32_product() {
    // Every bf16 kernel, whole and edge tiles, a bias or none, A as f32 or
    // as bits, 1 and 2 threads, into a strided output; the last shape is
    // deeper than one block (the f32 product, then its rounding). The
    // output's padding columns stay as they were.
    for (m, n, k) in [(64, 96, 384), (70, 45, 130), (5, 33, 1), (33, 40, 1600)] {
        let (a, b, bias) = (
            random(m as u64, m * k),
            random(k as u64, k * n),
            random(9, n),
        );
        let a16: Vec<u16> = a.iter().map(|&x| bf16_bits(x)).collect();
        let rs = n + 3;
        for kernel in Kernel::available_bf16() {
            for (with_bias, a_bits, threads) in
                [(true, false, 1), (false, true, 2), (true, true, 2)]
            {
                let bias = with_bias.then_some(&bias[..]);
                let start = bias.map_or(Start::Zero, Start::Bias);
                let mut f = vec![0f32; m * n];
                let bm = MatRef::row_major(&b, k, n).unwrap();
                let am = MatRef::row_major(&a, m, k).unwrap();
                let cm = MatMut::row_major(&mut f, m, n).unwrap();
                gemm_bf16_with(kernel, cm, am, bm, 1.0, start, threads).unwrap();
                let mut want = vec![0u16; m * n];
                bf16_bits_into(&f, &mut want);

                let mut out = vec![std::mem::MaybeUninit::new(0xdeadu16); m * rs];
                let c = BitsMut::new(&mut out, m, n, rs).unwrap();
                if a_bits {
                    let am = MatRef::row_major(&a16, m, k).unwrap();
                    gemm_bf16_rounded_with(kernel, c, am, bm, bias, threads).unwrap();
                } else {
                    gemm_bf16_rounded_with(kernel, c, am, bm, bias, threads).unwrap();
                }
                // SAFETY: every element was initialised (0xdead or the product).
                let got: Vec<u16> = out.iter().map(|v| unsafe { v.assume_init() }).collect();
                let what = format!(
                    "{kernel:?} {m}x{n}x{k} bias {with_bias} A bits {a_bits} {threads} threads"
                );
                for i in 0..m {
                    assert_eq!(
                        got[i * rs..i * rs + n],
                        want[i * n..(i + 1) * n],
                        "row {i}: {what}"
                    );
                    assert!(
                        got[i * rs + n..(i + 1) * rs].iter().all(|&p| p == 0xdead),
                        "padding of row {i}: {what}"
                    );
                }
            }
        }
    }
}

#[test]
fn sysfs_cache_sizes_read_as_bytes() {
    assert_eq!(cache_size("2048K\n"), Some(2 << 20));
    assert_eq!(cache_size("1M"), Some(1 << 20));
    assert_eq!(cache_size("512"), Some(512));
    for bad in ["", "K", "0K", "2G", "12x4K"] {
        assert_eq!(cache_size(bad), None, "{bad:?}");
    }
    // Whatever this machine says, the figure the blocking uses is a size.
    assert!(l2_bytes() >= 1 << 10);
}

/// A finishing product hands every element of `C` to its `Finish` exactly
/// once, holding the product's final value (the bits of `gemm_with`), and
/// nothing outside `C`: every kernel, case, start and thread count, and an
/// empty depth.
#[test]
fn a_finishing_product_hands_every_final_element_over_once() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let cases = CASES.iter().copied().chain([Case {
        m: 9,
        n: 70,
        k: 0,
        a_t: false,
        b_t: false,
    }]);
    for kernel in covered() {
        for case in cases.clone() {
            for start in ["zero", "keep", "bias", "residual"] {
                for threads in [1, 2] {
                    let Case { m, n, k, a_t, b_t } = case;
                    let (a, b, bias) = (random(1, m * k), random(2, k * n), random(3, n));
                    let res = random(5, m * n);
                    let rs = n + 3;
                    let (mut want, mut got) = (random(4, m * rs), random(4, m * rs));
                    let r = MatRef::new(&res, m, n, n, 1).unwrap();
                    let (av, bv) = (operand(&a, m, k, a_t), operand(&b, k, n, b_t));
                    in_pool(threads, || {
                        let c = MatMut::new(&mut want, m, n, rs).unwrap();
                        gemm_with(kernel, c, av, bv, 1.0, start_of(start, &bias, r), threads)
                    })
                    .unwrap();
                    // The finish doubles and adds one; the seen counts say
                    // how often each element was handed over.
                    let seen: Vec<AtomicU32> = (0..m * n).map(|_| AtomicU32::new(0)).collect();
                    let finish = |t: FinishedTile| {
                        assert_eq!(t.rs, rs);
                        for i in 0..t.rows {
                            for j in 0..t.cols {
                                seen[(t.row0 + i) * n + t.col0 + j].fetch_add(1, Ordering::Relaxed);
                                // SAFETY: inside the tile handed over.
                                unsafe {
                                    let p = t.ptr.add(i * t.rs + j);
                                    *p = *p * 2.0 + 1.0;
                                }
                            }
                        }
                    };
                    in_pool(threads, || {
                        let c = MatMut::new(&mut got, m, n, rs).unwrap();
                        let start = start_of(start, &bias, r);
                        gemm_finishing_with(kernel, c, av, bv, start, threads, &finish)
                    })
                    .unwrap();
                    let what = format!("{kernel:?} {case:?} {start} on {threads} threads");
                    assert!(
                        seen.iter().all(|s| s.load(Ordering::Relaxed) == 1),
                        "{what}"
                    );
                    for i in 0..m {
                        for j in 0..rs {
                            let w = want[i * rs + j];
                            let w = if j < n { w * 2.0 + 1.0 } else { w };
                            assert_eq!(got[i * rs + j].to_bits(), w.to_bits(), "{what} ({i}, {j})");
                        }
                    }
                }
            }
        }
    }
}

/// One row of `A` times a row-major `B` (generation's products) streams `B`
/// without packing it (`gemv`); its bits must be the blocked path's. The
/// reference is row 0 of the same product with a second row of `A`, which
/// the blocked path computes: every f32 kernel, start, α = 1 (the one-row
/// path) and 0.75 (blocked either way), `A` row-major and a row of a
/// transposed `A`, `B` row-major and transposed, depths past `KC`, widths
/// that leave part of a vector and split unevenly over 1-3 threads; a
/// finishing product hands each element of the row over once, after it
/// holds the blocked path's bits. `C`'s other columns stay untouched.
#[test]
fn one_row_products_give_the_blocked_paths_bits() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let kernels: Vec<Kernel> = covered().into_iter().filter(|k| !k.is_bf16()).collect();
    let shapes = [
        (1, 1),
        (7, 3),
        (33, 300),
        (100, KC + 37),
        (1000, 40),
        (2100, 9),
    ];
    for (n, k) in shapes {
        // B row-major, transposed, or neither (every other element of a
        // wider matrix: no adjacent columns or rows, so the blocked path).
        let layouts = [
            (false, false, false),
            (true, false, false),
            (false, true, false),
            (true, true, false),
            (false, false, true),
        ];
        for (a_t, b_t, strided) in layouts {
            let (a_data, bias) = (random(1, 2 * k), random(3, n));
            let b_data = random(2, 2 * k * (2 * n + 1));
            let res = random(5, 2 * (n + 5));
            let r = MatRef::new(&res, 2, n, n + 5, 1).unwrap();
            let a = operand(&a_data, 2, k, a_t);
            let b = match strided {
                true => MatRef::new(&b_data, k, n, 2 * (2 * n + 1), 2).unwrap(),
                false => operand(&b_data, k, n, b_t),
            };
            let rs = n + 3;
            for &kernel in &kernels {
                for start in STARTS {
                    for alpha in [1.0, 0.75] {
                        for threads in [1, 2, 3] {
                            let what = format!(
                                "{kernel:?} 1x{n}x{k} (A transposed {a_t}, B transposed {b_t}, strided {strided}) {start} α {alpha} on {threads} threads"
                            );
                            let (mut two, mut one) = (random(4, 2 * rs), random(4, rs));
                            in_pool(threads, || {
                                let c = MatMut::new(&mut two, 2, n, rs).unwrap();
                                let s = start_of(start, &bias, r);
                                gemm_with(kernel, c, a, b, alpha, s, threads).unwrap();
                                let c = MatMut::new(&mut one, 1, n, rs).unwrap();
                                let s = start_of(start, &bias, r.sub_rows(0, 1));
                                gemm_with(kernel, c, a.sub_rows(0, 1), b, alpha, s, threads)
                                    .unwrap();
                            });
                            let bits =
                                |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(bits(&one[..n]), bits(&two[..n]), "{what}");
                            assert_eq!(bits(&one[n..]), bits(&random(4, rs)[n..]), "{what}");
                            if alpha != 1.0 {
                                continue;
                            }
                            let seen: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                            let finish = |t: FinishedTile| {
                                assert_eq!((t.row0, t.rows), (0, 1));
                                for j in 0..t.cols {
                                    seen[t.col0 + j].fetch_add(1, Ordering::Relaxed);
                                    // SAFETY: inside the tile handed over.
                                    unsafe { *t.ptr.add(j) = *t.ptr.add(j) * 2.0 + 1.0 };
                                }
                            };
                            let mut finished = random(4, rs);
                            in_pool(threads, || {
                                let c = MatMut::new(&mut finished, 1, n, rs).unwrap();
                                let s = start_of(start, &bias, r.sub_rows(0, 1));
                                let a = a.sub_rows(0, 1);
                                gemm_finishing_with(kernel, c, a, b, s, threads, &finish).unwrap();
                            });
                            assert!(
                                seen.iter().all(|s| s.load(Ordering::Relaxed) == 1),
                                "{what}"
                            );
                            let want: Vec<f32> = two[..n].iter().map(|v| v * 2.0 + 1.0).collect();
                            assert_eq!(bits(&finished[..n]), bits(&want), "{what}: finished");
                        }
                    }
                }
            }
        }
    }
}

/// A `B` stored as bf16 bits (a model's weights as published) gives the
/// bits of the same product on the widened `B`: one and three rows of `A`
/// (streamed as stored, `gemv`, once a row) and past [`ROWS_STREAMED`]
/// (widened first, then blocked), `B`
/// row-major, transposed (a head's `x·wteᵀ`) and neither, no depth and no
/// columns, every f32 kernel, start and 1-3 threads, with and without a
/// finish.
#[test]
fn bf16_stored_b_gives_the_bits_of_its_widened_values() {
    let kernels: Vec<Kernel> = covered().into_iter().filter(|k| !k.is_bf16()).collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // With no depth (C is its start) and no columns too.
    for (n, k) in [
        (1, 1),
        (7, 3),
        (33, 300),
        (100, KC + 37),
        (2100, 9),
        (5, 0),
        (0, 4),
    ] {
        for (b_t, strided) in [(false, false), (true, false), (false, true)] {
            let stored: Vec<u16> = random(2, 2 * k * (2 * n + 1))
                .iter()
                .map(|&v| bf16_bits(v * 3.0))
                .collect();
            let widened: Vec<f32> = stored.iter().map(|&b| bf16_value(b)).collect();
            fn view<T: Copy>(data: &[T], k: usize, n: usize, t: bool, s: bool) -> MatRef<'_, T> {
                match s {
                    true => MatRef::new(data, k, n, 2 * (2 * n + 1), 2).unwrap(),
                    false => operand(data, k, n, t),
                }
            }
            let b16 = view(&stored, k, n, b_t, strided);
            let b32 = view(&widened, k, n, b_t, strided);
            let most = ROWS_STREAMED + 2;
            let (a_data, bias) = (random(1, most * k), random(3, n));
            let res = random(5, most * (n + 5));
            for m in [1, 3, most] {
                let a = MatRef::row_major(&a_data, m, k).unwrap();
                let r = MatRef::new(&res, m, n, n + 5, 1).unwrap();
                let rs = n + 3;
                for &kernel in &kernels {
                    for start in STARTS {
                        for threads in [1, 2, 3] {
                            let what = format!(
                                "{kernel:?} {m}x{n}x{k} (B transposed {b_t}, strided {strided}) {start} on {threads} threads"
                            );
                            // Each element's new value depends on where the
                            // tile says it is.
                            let finish = |t: FinishedTile| {
                                for i in 0..t.rows {
                                    for j in 0..t.cols {
                                        let at = ((t.row0 + i) * n + t.col0 + j) as f32;
                                        // SAFETY: inside the tile handed over.
                                        unsafe {
                                            let e = t.ptr.add(i * t.rs + j);
                                            *e = *e * 2.0 + at;
                                        }
                                    }
                                }
                            };
                            for finishing in [false, true] {
                                let (mut want, mut got) = (random(4, m * rs), random(4, m * rs));
                                in_pool(threads, || {
                                    let s = start_of(start, &bias, r);
                                    let c = MatMut::new(&mut want, m, n, rs).unwrap();
                                    match finishing {
                                        true => gemm_finishing_with(
                                            kernel, c, a, b32, s, threads, &finish,
                                        ),
                                        false => gemm_with(kernel, c, a, b32, 1.0, s, threads),
                                    }
                                    .unwrap();
                                    let s = start_of(start, &bias, r);
                                    let c = MatMut::new(&mut got, m, n, rs).unwrap();
                                    let f = finishing.then_some(&finish as &Finish);
                                    gemm_widening_b_with(kernel, c, a, b16, s, threads, f).unwrap();
                                });
                                assert_eq!(bits(&got), bits(&want), "{what} finishing {finishing}");
                            }
                        }
                    }
                }
            }
        }
    }
}
