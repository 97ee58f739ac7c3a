//! Times zgemm (and its bf16 products where the CPU has AMX or AVX512_BF16;
//! where it has AMX, also `bf16-in`: operands that are bf16 already, as a
//! bf16 model feeds them, the figure to set beside another library's bf16
//! GEMM, and `bf16-out`: those with `C` rounded to bf16 as it stores) on the shapes of `zrun bench kernels` (and of
//! `scripts/gemm_openblas.py`), every kernel this CPU has, best of several
//! calls, in GFLOP/s: a quick loop for work on the kernels, without
//! building the whole workspace.
//!
//!     cargo run --release -p zgemm --example gemm_bench            # 1 and 2 threads
//!     cargo run --release -p zgemm --example gemm_bench -- 2       # 2 threads only
//!
//! `GEMM_ONLY=tn_384` times only the shapes whose name contains it, and
//! `GEMM_REPS=500` calls each that many times (a loop to profile).

use zgemm::{gemm_with, Kernel, MatMut, MatRef, Start};

const SHAPES: [(&str, usize, usize, usize); 7] = [
    ("nn", 2048, 2048, 2048),
    ("nn", 2048, 384, 1152),
    ("nn", 2048, 384, 1536),
    ("nn", 2048, 1536, 384),
    ("tn", 384, 2048, 1152),
    ("nt", 2048, 1152, 384),
    ("tn", 1536, 2048, 384),
];

fn main() {
    let threads: Vec<usize> = match std::env::args().nth(1) {
        Some(t) => vec![t.parse().expect("threads: a number")],
        None => vec![1, 2],
    };
    let mut kernels: Vec<Kernel> = Kernel::available()
        .into_iter()
        .filter(|&k| k != Kernel::Portable || Kernel::best() == k)
        .collect();
    // The bf16 products this CPU has in hardware (not the portable one).
    let bf16: Vec<Kernel> = Kernel::available_bf16()
        .into_iter()
        .filter(|&k| k != Kernel::PortableBf16)
        .collect();
    kernels.splice(0..0, bf16);
    let only = std::env::var("GEMM_ONLY").unwrap_or_default();
    let reps_set: Option<usize> = std::env::var("GEMM_REPS")
        .ok()
        .map(|r| r.parse().expect("GEMM_REPS: a number"));
    for &t in &threads {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build()
            .expect("a thread pool");
        for (op, m, k, n) in SHAPES {
            if !format!("{op}_{m}x{k}x{n}").contains(&only) {
                continue;
            }
            let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
            let b: Vec<f32> = (0..k * n).map(|i| (i % 13) as f32 * 0.01).collect();
            let mut c = vec![0f32; m * n];
            let (av, bv) = (
                view(&a, m, k, op.starts_with('t')).expect("A's shape"),
                view(&b, k, n, op.ends_with('t')).expect("B's shape"),
            );
            let flops = 2.0 * (m * k * n) as f64;
            let reps = reps_set.unwrap_or(((2e10 / flops) as usize).clamp(3, 50));
            let mut line = format!("{op}_{m}x{k}x{n} threads {t}:");
            for &kernel in &kernels {
                let mut best = f64::MAX;
                pool.install(|| {
                    for _ in 0..reps {
                        let cv = MatMut::row_major(&mut c, m, n).expect("C's shape");
                        let start = std::time::Instant::now();
                        let product = if matches!(kernel, Kernel::AmxBf16 | Kernel::Avx512Bf16) {
                            zgemm::gemm_bf16_with
                        } else {
                            gemm_with
                        };
                        product(kernel, cv, av, bv, 1.0, Start::Zero, t).expect("shapes");
                        best = best.min(start.elapsed().as_secs_f64());
                    }
                });
                line += &format!("  {kernel:?} {:.1}", flops / best / 1e9);
            }
            // What a bf16 model feeds the products: operands already bf16.
            if zgemm::has_native_bf16() {
                let (a16, b16): (Vec<u16>, Vec<u16>) = (
                    a.iter().map(|&v| zgemm::bf16_bits(v)).collect(),
                    b.iter().map(|&v| zgemm::bf16_bits(v)).collect(),
                );
                let (av, bv) = (
                    view(&a16, m, k, op.starts_with('t')).expect("A's shape"),
                    view(&b16, k, n, op.ends_with('t')).expect("B's shape"),
                );
                let mut best = f64::MAX;
                pool.install(|| {
                    for _ in 0..reps {
                        let cv = MatMut::row_major(&mut c, m, n).expect("C's shape");
                        let start = std::time::Instant::now();
                        zgemm::gemm_bf16(cv, av, bv, 1.0, Start::Zero, t).expect("shapes");
                        best = best.min(start.elapsed().as_secs_f64());
                    }
                });
                line += &format!("  bf16-in {:.1}", flops / best / 1e9);
                // And its output rounded to bf16 as the tiles store.
                let mut out = vec![std::mem::MaybeUninit::<u16>::uninit(); m * n];
                let mut best = f64::MAX;
                pool.install(|| {
                    for _ in 0..reps {
                        let cv = zgemm::BitsMut::new(&mut out, m, n, n).expect("C's shape");
                        let start = std::time::Instant::now();
                        zgemm::gemm_bf16_rounded(cv, av, bv, None, t).expect("shapes");
                        best = best.min(start.elapsed().as_secs_f64());
                    }
                });
                line += &format!("  bf16-out {:.1}", flops / best / 1e9);
            }
            println!("{line}  GFLOP/s");
        }
    }
}

/// `d` as a `rows × cols` operand, stored transposed if `t`.
fn view<T: Copy>(
    d: &[T],
    rows: usize,
    cols: usize,
    t: bool,
) -> Result<MatRef<'_, T>, zgemm::ShapeError> {
    if t {
        MatRef::row_major(d, cols, rows).map(MatRef::t)
    } else {
        MatRef::row_major(d, rows, cols)
    }
}
