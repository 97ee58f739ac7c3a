//! The CPU GPU's driver and cuBLAS (`cpp/driver.cpp`, `cublas.cpp`) called
//! as cudarc calls them: what zrun's GPU tests rely on them to share with
//! NVIDIA's (refusals, memory accounting, a kernel run from its argument
//! array, column-major GEMMs and TF32's rounding).

use std::ffi::c_void;

use libloading::Library;

use crate::tests::wave;

fn open(name: &str) -> Library {
    let path = std::path::Path::new(env!("ZCUDA_EMU_GPU_DIR")).join(name);
    // SAFETY: the emulation's own library; its initialisers only set statics.
    unsafe { Library::new(&path) }.unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The symbol `name` of `lib` as a function of type `F`.
fn sym<F: Copy>(lib: &Library, name: &str) -> F {
    // SAFETY: each caller names the C signature the library defines.
    unsafe { *lib.get::<F>(name.as_bytes()).unwrap() }
}

type Alloc = unsafe extern "C" fn(*mut u64, usize) -> i32;
type Free = unsafe extern "C" fn(u64) -> i32;
type Launch = unsafe extern "C" fn(
    *mut c_void,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> i32;

#[test]
fn the_driver_refuses_what_cuda_refuses_and_runs_a_kernel_from_its_arguments() {
    let cuda = open("libcuda.so");
    let init: unsafe extern "C" fn(u32) -> i32 = sym(&cuda, "cuInit");
    let alloc: Alloc = sym(&cuda, "cuMemAlloc_v2");
    let free: Free = sym(&cuda, "cuMemFree_v2");
    let info: unsafe extern "C" fn(*mut usize, *mut usize) -> i32 = sym(&cuda, "cuMemGetInfo_v2");
    let load: unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> i32 =
        sym(&cuda, "cuModuleLoadData");
    let function: unsafe extern "C" fn(
        *mut *mut c_void,
        *mut c_void,
        *const std::ffi::c_char,
    ) -> i32 = sym(&cuda, "cuModuleGetFunction");
    let launch: Launch = sym(&cuda, "cuLaunchKernel");
    // SAFETY: each call gets the pointers its C signature asks for, alive
    // through the call; device pointers are host addresses here.
    unsafe {
        assert_eq!(init(0), 0);
        let mut p = 0u64;
        assert_eq!(alloc(&mut p, 0), 1, "0 bytes: CUDA_ERROR_INVALID_VALUE");
        let (mut free0, mut total) = (0, 0);
        assert_eq!(info(&mut free0, &mut total), 0);
        assert_eq!(
            alloc(&mut p, total + 1),
            2,
            "past the memory: CUDA_ERROR_OUT_OF_MEMORY"
        );
        assert_eq!(alloc(&mut p, 1 << 20), 0);
        let mut free1 = 0;
        assert_eq!(info(&mut free1, &mut total), 0);
        assert_eq!(free0 - free1, 1 << 20, "the allocation counted");
        assert_eq!(free(p), 0);
        assert_eq!(free(p), 1, "a pointer freed twice");

        let mut module = std::ptr::null_mut();
        assert_eq!(load(&mut module, c"// any image".as_ptr().cast()), 0);
        let mut f = std::ptr::null_mut();
        assert_eq!(function(&mut f, module, c"no_such_kernel".as_ptr()), 500);
        assert_eq!(function(&mut f, module, c"add_f32".as_ptr()), 0);

        // add_f32(acc, x, n) over a grid smaller than n: every element once.
        let n = 1000u64;
        let (mut acc, x) = (wave(n as usize, 1), wave(n as usize, 2));
        let want: Vec<f32> = acc.iter().zip(&x).map(|(a, b)| a + b).collect();
        let (mut acc_p, mut x_p, mut n_v) = (acc.as_mut_ptr(), x.as_ptr(), n);
        let mut params: [*mut c_void; 3] = [
            (&mut acc_p as *mut *mut f32).cast(),
            (&mut x_p as *mut *const f32).cast(),
            (&mut n_v as *mut u64).cast(),
        ];
        let null = std::ptr::null_mut();
        let run = |block: u32, shared: u32, params: &mut [*mut c_void; 3]| {
            launch(
                f,
                3,
                1,
                1,
                block,
                1,
                1,
                shared,
                null,
                params.as_mut_ptr(),
                null.cast(),
            )
        };
        assert_eq!(run(2048, 0, &mut params), 701, "a block past 1024 threads");
        assert_eq!(
            run(64, 16, &mut params),
            1,
            "dynamic shared memory (none here)"
        );
        assert_eq!(acc, wave(n as usize, 1), "a refused launch ran");
        assert_eq!(run(64, 0, &mut params), 0);
        assert_eq!(acc, want);
    }
}

type Sgemm = unsafe extern "C" fn(
    *mut c_void,
    i32,
    i32,
    i32,
    i32,
    i32,
    *const f32,
    *const f32,
    i32,
    *const f32,
    i32,
    *const f32,
    *mut f32,
    i32,
) -> i32;

/// TF32's rounding of `x` (10 mantissa bits, to nearest, ties away).
fn tf32(x: f32) -> f32 {
    f32::from_bits((x.to_bits() + 0x1000) & 0xffff_e000)
}

#[test]
fn sgemm_is_column_major_with_transposes_and_rounds_to_tf32_in_its_math_mode() {
    let blas = open("libcublas.so");
    let create: unsafe extern "C" fn(*mut *mut c_void) -> i32 = sym(&blas, "cublasCreate_v2");
    let mode: unsafe extern "C" fn(*mut c_void, i32) -> i32 = sym(&blas, "cublasSetMathMode");
    let sgemm: Sgemm = sym(&blas, "cublasSgemm_v2");
    let (m, n, k) = (5usize, 3usize, 7usize);
    // op(A) is m×k, op(B) k×n, all column-major; stored transposed where
    // the op is T, with leading dimensions one larger than needed.
    for (ta, tb) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
        for tf32_mode in [false, true] {
            let (ar, ac) = if ta == 0 { (m, k) } else { (k, m) };
            let (br, bc) = if tb == 0 { (k, n) } else { (n, k) };
            let (lda, ldb, ldc) = (ar + 1, br + 1, m + 1);
            let a = wave(lda * ac, 3);
            let b = wave(ldb * bc, 4);
            let c0 = wave(ldc * n, 5);
            let round = |x: f32| if tf32_mode { tf32(x) } else { x };
            let op_a = |i: usize, p: usize| {
                round(if ta == 0 {
                    a[i + p * lda]
                } else {
                    a[p + i * lda]
                })
            };
            let op_b = |p: usize, j: usize| {
                round(if tb == 0 {
                    b[p + j * ldb]
                } else {
                    b[j + p * ldb]
                })
            };
            let (alpha, beta) = (0.5f32, 2.0f32);
            let mut c = c0.clone();
            // SAFETY: operands of the sizes the leading dimensions promise.
            unsafe {
                let mut h = std::ptr::null_mut();
                assert_eq!(create(&mut h), 0);
                assert_eq!(mode(h, if tf32_mode { 3 } else { 0 }), 0);
                let r = sgemm(
                    h,
                    ta,
                    tb,
                    m as i32,
                    n as i32,
                    k as i32,
                    &alpha,
                    a.as_ptr(),
                    lda as i32,
                    b.as_ptr(),
                    ldb as i32,
                    &beta,
                    c.as_mut_ptr(),
                    ldc as i32,
                );
                assert_eq!(r, 0);
            }
            for j in 0..n {
                for i in 0..m {
                    let want: f64 = (0..k)
                        .map(|p| op_a(i, p) as f64 * op_b(p, j) as f64)
                        .sum::<f64>()
                        * 0.5
                        + 2.0 * c0[i + j * ldc] as f64;
                    let got = c[i + j * ldc] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{ta}{tb} tf32 {tf32_mode} ({i}, {j}): {got} vs {want}"
                    );
                }
                // The padding row of C is untouched.
                assert_eq!(c[m + j * ldc].to_bits(), c0[m + j * ldc].to_bits());
            }
        }
    }
}
