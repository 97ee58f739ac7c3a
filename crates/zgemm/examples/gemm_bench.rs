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
//! `GEMM_SHAPE=tn,384,2048,1152` times that one shape instead (`A`
//! transposed, `M × K · K × N`),
//! `GEMM_ONLY=tn_384` times only the shapes whose name contains it,
//! `GEMM_KERNELS=Avx512,AmxBf16` only those kernels (as the lines name them), and
//! `GEMM_REPS=500` calls each that many times (a loop to profile).
//! `GEMM_SUMS=1` times the f32 products whose `B` is row-major with `B`'s
//! column sums taken as it packs (`gemm_summing_b`): what a biased linear's
//! weight gradient runs in the model (`gemm` packs `B` differently on
//! several threads, see PERFORMANCE.md's thirty-seventh sitting).
//!
//! `OPENBLAS_LIB=/path/to/libopenblas.so` (numpy's: `numpy.libs/` in its
//! site-packages) times zgemm's fastest kernel (or the first f32 one
//! `GEMM_KERNELS` names: `GEMM_KERNELS=Avx2` beside
//! `OPENBLAS_CORETYPE=Haswell` sets AVX2 against AVX2) against OpenBLAS's
//! `cblas_sgemm` instead, the two alternated call by call in this one
//! process, so that a noisy neighbour's drift falls on both alike (separate
//! processes minutes apart swung 0.5-1.2x on a shared 2-core host). Prints
//! each side's best and median and the ratios. Set
//! `OPENBLAS_THREAD_TIMEOUT=4` with it, or OpenBLAS's idle threads spin
//! through the next zgemm call.
//! `GEMM_VERSUS=Avx512Bf16,PortableBf16` alternates two of zgemm's kernels
//! (two f32 ones or two bf16 ones) the same way: how a change to a kernel
//! is measured against the kernel it would replace. It also counts the
//! elements whose bits the two products do not share.
//! `GEMM_DUMP=1` with either prints every call's rate of both, in the order
//! they ran: a shared host's quiet and noisy stretches show there, where a
//! median hides them.

use zgemm::{gemm_with, Kernel, MatMut, MatRef, Start};

/// The shapes timed: `GEMM_SHAPE`'s one, else [`SHAPES`].
fn shapes() -> Vec<(&'static str, usize, usize, usize)> {
    let Ok(spec) = std::env::var("GEMM_SHAPE") else {
        return SHAPES.to_vec();
    };
    let usage = "GEMM_SHAPE: nn|tn|nt|tt,M,K,N (e.g. tn,384,2048,1152)";
    let fields: Vec<&str> = spec.split(',').collect();
    let op = match fields.first() {
        Some(&"nn") => "nn",
        Some(&"tn") => "tn",
        Some(&"nt") => "nt",
        Some(&"tt") => "tt",
        _ => panic!("{usage}"),
    };
    let dims: Vec<usize> = fields[1..]
        .iter()
        .map(|f| f.parse().expect(usage))
        .collect();
    let [m, k, n] = dims[..] else {
        panic!("{usage}")
    };
    vec![(op, m, k, n)]
}

/// 2048³, the anchor model's products (`configs/gpt-anchor.yaml`: forward,
/// input and weight gradients), and a small model's weight gradient
/// (`configs/tiny.yaml`'s, d_model 128), which ran at 0.71x OpenBLAS on two
/// threads unseen while only the anchor's were timed.
const SHAPES: [(&str, usize, usize, usize); 8] = [
    ("nn", 2048, 2048, 2048),
    ("nn", 2048, 384, 1152),
    ("nn", 2048, 384, 1536),
    ("nn", 2048, 1536, 384),
    ("tn", 384, 2048, 1152),
    ("nt", 2048, 1152, 384),
    ("tn", 1536, 2048, 384),
    ("tn", 128, 512, 384),
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
    if let Ok(names) = std::env::var("GEMM_KERNELS") {
        kernels.retain(|k| names.split(',').any(|n| n == format!("{k:?}")));
    }
    let only = std::env::var("GEMM_ONLY").unwrap_or_default();
    let reps_set: Option<usize> = std::env::var("GEMM_REPS")
        .ok()
        .map(|r| r.parse().expect("GEMM_REPS: a number"));
    if let Ok(pair) = std::env::var("GEMM_VERSUS") {
        let named = |name: &str| {
            Kernel::available()
                .into_iter()
                .chain(Kernel::available_bf16())
                .find(|k| format!("{k:?}") == name)
                .unwrap_or_else(|| panic!("GEMM_VERSUS: no kernel {name} on this CPU"))
        };
        let names: Vec<&str> = pair.split(',').collect();
        let [first, second] = names[..] else {
            panic!("GEMM_VERSUS: two kernels, e.g. Avx512,Avx2")
        };
        for &t in &threads {
            versus_kernels(
                [named(first), named(second)],
                t,
                &only,
                reps_set.unwrap_or(30),
            );
        }
        return;
    }
    if let Ok(lib) = std::env::var("OPENBLAS_LIB") {
        let blas = openblas::Sgemm::open(&lib);
        // The first kernel GEMM_KERNELS names, else the fastest.
        let kernel = kernels
            .iter()
            .copied()
            .find(|k| !k.is_bf16())
            .unwrap_or(Kernel::best());
        for &t in &threads {
            versus_openblas(&blas, kernel, t, &only, reps_set.unwrap_or(30));
        }
        return;
    }
    for &t in &threads {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build()
            .expect("a thread pool");
        for (op, m, k, n) in shapes_named(&only) {
            let (a, b) = operands(m, k, n);
            let mut c = vec![0f32; m * n];
            let (av, bv) = views(op, (m, k, n), &a, &b);
            let flops = 2.0 * (m * k * n) as f64;
            let reps = reps_set.unwrap_or(((2e10 / flops) as usize).clamp(3, 50));
            let mut line = format!("{op}_{m}x{k}x{n} threads {t}:");
            for &kernel in &kernels {
                let mut best = f64::MAX;
                pool.install(|| {
                    for _ in 0..reps {
                        let cv = MatMut::row_major(&mut c, m, n).expect("C's shape");
                        let start = std::time::Instant::now();
                        if matches!(kernel, Kernel::AmxBf16 | Kernel::Avx512Bf16) {
                            zgemm::gemm_bf16_with(kernel, cv, av, bv, 1.0, Start::Zero, t)
                                .expect("shapes");
                        } else {
                            f32_product(kernel, cv, av, bv, !op.ends_with('t'), t);
                        }
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

/// One f32 product with `kernel`; with `GEMM_SUMS=1` and a row-major `b`,
/// `gemm_summing_b` instead (its column sums too; the best kernel only).
fn f32_product(kernel: Kernel, c: MatMut, a: MatRef, b: MatRef, row_major_b: bool, threads: usize) {
    static SUMS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let sums = *SUMS.get_or_init(|| std::env::var("GEMM_SUMS").is_ok_and(|v| v == "1"));
    if sums && row_major_b && kernel == Kernel::best() {
        let mut sums = vec![0f32; b.cols()];
        zgemm::gemm_summing_b(c, a, b, 1.0, Start::Zero, threads, &mut sums).expect("shapes");
    } else {
        gemm_with(kernel, c, a, b, 1.0, Start::Zero, threads).expect("shapes");
    }
}

/// zgemm and OpenBLAS on every shape at `t` threads, `reps` calls each,
/// alternated call by call ([`alternate`]).
fn versus_openblas(blas: &openblas::Sgemm, kernel: Kernel, t: usize, only: &str, reps: usize) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(t)
        .build()
        .expect("a thread pool");
    blas.set_threads(t);
    for (op, m, k, n) in shapes_named(only) {
        let (a, b) = operands(m, k, n);
        let (ta, tb) = (op.starts_with('t'), op.ends_with('t'));
        let (av, bv) = views(op, (m, k, n), &a, &b);
        let mut zgemm = |c: &mut [f32]| {
            let cv = MatMut::row_major(c, m, n).expect("C's shape");
            f32_product(kernel, cv, av, bv, !tb, t);
        };
        let mut openblas = |c: &mut [f32]| blas.row_major(ta, tb, m, n, k, &a, &b, c);
        let (times, cs) = alternate(
            &pool,
            m * n,
            reps,
            [&mut zgemm, &mut openblas],
            [true, false],
        );
        let worst_gap = cs[0]
            .iter()
            .zip(&cs[1])
            .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
            .fold(0f32, f32::max);
        assert!(
            worst_gap < 1e-4,
            "zgemm and OpenBLAS disagree by {worst_gap}"
        );
        let flops = 2.0 * (m * k * n) as f64;
        report(
            &format!("{op}_{m}x{k}x{n} threads {t}"),
            ["zgemm", "openblas"],
            flops,
            &times,
        );
    }
}

/// Two zgemm kernels (`GEMM_VERSUS=Avx512Bf16,AmxBf16`: both f32 or both
/// bf16) on every shape at `t` threads, `reps` calls each, alternated call
/// by call ([`alternate`]): what a change to a kernel or its blocking is
/// measured with, the old way and the new one side by side in one process.
/// Their products must agree to the bit where their arithmetic is the same.
fn versus_kernels(kernels: [Kernel; 2], t: usize, only: &str, reps: usize) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(t)
        .build()
        .expect("a thread pool");
    assert_eq!(
        kernels[0].is_bf16(),
        kernels[1].is_bf16(),
        "GEMM_VERSUS: two f32 kernels or two bf16 ones"
    );
    for (op, m, k, n) in shapes_named(only) {
        let (a, b) = operands(m, k, n);
        let tb = op.ends_with('t');
        let (av, bv) = views(op, (m, k, n), &a, &b);
        let product = |kernel: Kernel, c: &mut [f32]| {
            let cv = MatMut::row_major(c, m, n).expect("C's shape");
            if kernel.is_bf16() {
                zgemm::gemm_bf16_with(kernel, cv, av, bv, 1.0, Start::Zero, t).expect("shapes");
            } else {
                f32_product(kernel, cv, av, bv, !tb, t);
            }
        };
        let (mut first, mut second) = (
            |c: &mut [f32]| product(kernels[0], c),
            |c: &mut [f32]| product(kernels[1], c),
        );
        let (times, cs) = alternate(&pool, m * n, reps, [&mut first, &mut second], [true, true]);
        let differ = cs[0]
            .iter()
            .zip(&cs[1])
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        let names = kernels.map(|k| format!("{k:?}"));
        let flops = 2.0 * (m * k * n) as f64;
        report(
            &format!("{op}_{m}x{k}x{n} threads {t} ({differ} elements differ)"),
            [&names[0], &names[1]],
            flops,
            &times,
        );
    }
}

/// One product a side.
type Side<'a> = &'a mut (dyn FnMut(&mut [f32]) + Send);

/// Runs the two sides `reps` times each into `C`s of `c_len` floats,
/// alternated call by call (who goes first alternating too), each call
/// after a pause (`GEMM_PAUSE_MS`, 2 ms) so that both start from idle
/// threads: a noisy neighbour's drift falls on both alike (separate
/// processes minutes apart swung 0.5-1.2x on a shared 2-core host). A side
/// that is zgemm's (`in_pool`) runs on the thread that calls it, as a worker
/// calls it: on one thread, this one; on several, one of `pool`'s, from
/// inside it (the hand-over from this thread to the pool, which a worker
/// does once for a whole step, cost a 0.3 ms product 5-10% of its median).
/// Returns each side's times in seconds and the last `C` each wrote.
fn alternate(
    pool: &rayon::ThreadPool,
    c_len: usize,
    reps: usize,
    mut sides: [Side; 2],
    in_pool: [bool; 2],
) -> ([Vec<f64>; 2], [Vec<f32>; 2]) {
    let pause = std::time::Duration::from_millis(
        std::env::var("GEMM_PAUSE_MS").map_or(2, |v| v.parse().expect("GEMM_PAUSE_MS: a number")),
    );
    // Each side writes each of two `C`s on alternate pairs of calls: where
    // a buffer's pages fall in the caches moved one side's rate by up to
    // 10% against the other's when each kept its own (the same zgemm call
    // on both sides, after other shapes had run).
    let mut cs = [vec![0f32; c_len], vec![0f32; c_len]];
    let mut times = [Vec::new(), Vec::new()];
    for rep in 0..2 * reps {
        for side in [rep % 2, 1 - rep % 2] {
            let c = &mut cs[(side + rep / 2) % 2];
            std::thread::sleep(pause);
            let run = &mut sides[side];
            let mut timed = || {
                let start = std::time::Instant::now();
                run(c);
                start.elapsed()
            };
            let elapsed = if in_pool[side] && pool.current_num_threads() > 1 {
                pool.install(timed)
            } else {
                timed()
            };
            times[side].push(elapsed.as_secs_f64());
        }
    }
    // The last pair of calls left one side's product in each.
    (times, cs)
}

/// Prints each side's best and median rate and their ratios (and, with
/// `GEMM_DUMP=1`, every call's rate in the order they ran: a shared host's
/// quiet and noisy stretches show there, where a median hides them).
fn report(label: &str, names: [&str; 2], flops: f64, times: &[Vec<f64>; 2]) {
    if std::env::var("GEMM_DUMP").is_ok() {
        for (name, v) in names.iter().zip(times) {
            let rates: Vec<String> = v
                .iter()
                .map(|t| format!("{:.0}", flops / t / 1e9))
                .collect();
            println!("  {name}: {}", rates.join(" "));
        }
    }
    let [best, median] = [0, 1].map(|which| {
        times.clone().map(|mut v| {
            v.sort_by(f64::total_cmp);
            flops / if which == 0 { v[0] } else { v[v.len() / 2] } / 1e9
        })
    });
    let [a, b] = names;
    println!(
        "{label}: best {a} {:.1} {b} {:.1} ({:.2}x)  median {a} {:.1} {b} {:.1} ({:.2}x)  GFLOP/s",
        best[0],
        best[1],
        best[0] / best[1],
        median[0],
        median[1],
        median[0] / median[1],
    );
}

/// OpenBLAS's `cblas_sgemm`, found in a shared library at run time: numpy's
/// build (64-bit integers, `scipy_`-prefixed symbols) or a plain one.
mod openblas {
    use std::ffi::{c_int, c_void, CString};

    type Cblas = unsafe extern "C" fn(
        c_int,
        c_int,
        c_int,
        i64,
        i64,
        i64,
        f32,
        *const f32,
        i64,
        *const f32,
        i64,
        f32,
        *mut f32,
        i64,
    );
    type Cblas32 = unsafe extern "C" fn(
        c_int,
        c_int,
        c_int,
        c_int,
        c_int,
        c_int,
        f32,
        *const f32,
        c_int,
        *const f32,
        c_int,
        f32,
        *mut f32,
        c_int,
    );

    enum Entry {
        Ilp64(Cblas),
        Lp64(Cblas32),
    }

    pub struct Sgemm {
        entry: Entry,
        set_threads: unsafe extern "C" fn(c_int),
    }

    fn symbol(lib: *mut c_void, name: &str) -> Option<*mut c_void> {
        let name = CString::new(name).expect("no NUL");
        // SAFETY: a valid handle and a NUL-terminated name.
        let f = unsafe { libc::dlsym(lib, name.as_ptr()) };
        (!f.is_null()).then_some(f)
    }

    impl Sgemm {
        pub fn open(path: &str) -> Sgemm {
            let c = CString::new(path).expect("no NUL in OPENBLAS_LIB");
            // SAFETY: a NUL-terminated path; the library's constructors
            // are OpenBLAS's own.
            let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW) };
            assert!(!lib.is_null(), "cannot dlopen {path}");
            let threads = [
                "scipy_openblas_set_num_threads64_",
                "openblas_set_num_threads",
            ]
            .iter()
            .find_map(|n| symbol(lib, n))
            .expect("no openblas_set_num_threads in the library");
            // SAFETY: the symbols' C signatures (OpenBLAS's cblas.h).
            unsafe {
                let entry = if let Some(f) = symbol(lib, "scipy_cblas_sgemm64_") {
                    Entry::Ilp64(std::mem::transmute::<*mut c_void, Cblas>(f))
                } else {
                    let f = symbol(lib, "cblas_sgemm").expect("no cblas_sgemm in the library");
                    Entry::Lp64(std::mem::transmute::<*mut c_void, Cblas32>(f))
                };
                Sgemm {
                    entry,
                    set_threads: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_int)>(
                        threads,
                    ),
                }
            }
        }

        pub fn set_threads(&self, t: usize) {
            // SAFETY: OpenBLAS's own setter.
            unsafe { (self.set_threads)(t as c_int) }
        }

        /// `c = a·b`, row-major `m × n`; `a` stored `k × m` if `ta`, `b`
        /// stored `n × k` if `tb`.
        #[allow(clippy::too_many_arguments)]
        pub fn row_major(
            &self,
            ta: bool,
            tb: bool,
            m: usize,
            n: usize,
            k: usize,
            a: &[f32],
            b: &[f32],
            c: &mut [f32],
        ) {
            const ROW_MAJOR: c_int = 101;
            let trans = |t: bool| if t { 112 } else { 111 };
            let (lda, ldb) = (if ta { m } else { k }, if tb { k } else { n });
            assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
            // SAFETY: the slices hold the operands at these leading
            // dimensions (asserted).
            unsafe {
                match self.entry {
                    Entry::Ilp64(f) => f(
                        ROW_MAJOR,
                        trans(ta),
                        trans(tb),
                        m as i64,
                        n as i64,
                        k as i64,
                        1.0,
                        a.as_ptr(),
                        lda as i64,
                        b.as_ptr(),
                        ldb as i64,
                        0.0,
                        c.as_mut_ptr(),
                        n as i64,
                    ),
                    Entry::Lp64(f) => f(
                        ROW_MAJOR,
                        trans(ta),
                        trans(tb),
                        m as c_int,
                        n as c_int,
                        k as c_int,
                        1.0,
                        a.as_ptr(),
                        lda as c_int,
                        b.as_ptr(),
                        ldb as c_int,
                        0.0,
                        c.as_mut_ptr(),
                        n as c_int,
                    ),
                }
            }
        }
    }
}

/// The shapes ([`shapes`]) whose name contains `only`.
fn shapes_named(only: &str) -> impl Iterator<Item = (&'static str, usize, usize, usize)> + '_ {
    shapes()
        .into_iter()
        .filter(move |(op, m, k, n)| format!("{op}_{m}x{k}x{n}").contains(only))
}

/// `a` and `b` as the operands of product `op` (`nn`, `tn`, ...) of `m × k
/// · k × n`.
fn views<'a>(
    op: &str,
    (m, k, n): (usize, usize, usize),
    a: &'a [f32],
    b: &'a [f32],
) -> (MatRef<'a>, MatRef<'a>) {
    (
        view(a, m, k, op.starts_with('t')).expect("A's shape"),
        view(b, k, n, op.ends_with('t')).expect("B's shape"),
    )
}

/// `A` (`m × k` values) and `B` (`k × n`) of every product timed.
fn operands(m: usize, k: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    (
        (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect(),
        (0..k * n).map(|i| (i % 13) as f32 * 0.01).collect(),
    )
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
