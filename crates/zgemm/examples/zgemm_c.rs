//! zgemm's products behind a C interface, for `scripts/gemm_torch.py`, which
//! loads this library beside PyTorch and alternates zgemm and `torch.mm` call
//! by call in one process (separate processes on a shared host land on
//! levels up to 2x apart):
//!
//!     cargo build --release -p zgemm --example zgemm_c
//!     python3 scripts/gemm_torch.py 1
//!
//! Operands are dense: `A` is `m × k` row-major, or `k × m` where `ta` is
//! set (read transposed); `B` likewise `k × n` or `n × k`. Each call runs on
//! a rayon pool of `threads` threads, made once per thread count.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use zgemm::{BitsMut, MatMut, MatRef, Start};

/// A rayon pool of `threads` threads, kept for the next call.
fn pool(threads: usize) -> Arc<rayon::ThreadPool> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<rayon::ThreadPool>>>> = OnceLock::new();
    let mut pools = POOLS.get_or_init(Default::default).lock().expect("pools");
    pools
        .entry(threads)
        .or_insert_with(|| {
            Arc::new(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("a thread pool"),
            )
        })
        .clone()
}

/// `data` as a `rows × cols` operand, stored transposed where `t`.
fn operand<T: Copy>(data: &[T], rows: usize, cols: usize, t: bool) -> Option<MatRef<'_, T>> {
    if t {
        MatRef::row_major(data, cols, rows).ok().map(MatRef::t)
    } else {
        MatRef::row_major(data, rows, cols).ok()
    }
}

/// `C = A·B` on f32 values, `C` row-major `m × n`. Returns 0, or -1 where
/// the shapes are refused.
///
/// # Safety
///
/// `a`, `b` and `c` must hold `m·k`, `k·n` and `m·n` values.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn zgemm_f32(
    ta: i32,
    tb: i32,
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    threads: usize,
) -> i32 {
    // SAFETY: the lengths the caller vouches for.
    let (a, b, c) = unsafe {
        (
            std::slice::from_raw_parts(a, m * k),
            std::slice::from_raw_parts(b, k * n),
            std::slice::from_raw_parts_mut(c, m * n),
        )
    };
    let (Some(a), Some(b)) = (operand(a, m, k, ta != 0), operand(b, k, n, tb != 0)) else {
        return -1;
    };
    let done = pool(threads)
        .install(|| zgemm::gemm(MatMut::row_major(c, m, n)?, a, b, 1.0, Start::Zero, threads));
    if done.is_ok() {
        0
    } else {
        -1
    }
}

/// `C = A·B` on bf16 operands (their bits), with f32 accumulation: `C` f32
/// (`c32`), or rounded to bf16 as it stores where `c32` is null (`c16`,
/// as `torch.mm` of two bf16 tensors gives). Returns 0, or -1 where the
/// shapes are refused.
///
/// # Safety
///
/// `a` and `b` must hold `m·k` and `k·n` values, and `c32` or (when it is
/// null) `c16` `m·n`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn zgemm_bf16(
    ta: i32,
    tb: i32,
    m: usize,
    n: usize,
    k: usize,
    a: *const u16,
    b: *const u16,
    c32: *mut f32,
    c16: *mut u16,
    threads: usize,
) -> i32 {
    // SAFETY: the lengths the caller vouches for.
    let (a, b) = unsafe {
        (
            std::slice::from_raw_parts(a, m * k),
            std::slice::from_raw_parts(b, k * n),
        )
    };
    let (Some(a), Some(b)) = (operand(a, m, k, ta != 0), operand(b, k, n, tb != 0)) else {
        return -1;
    };
    let out = if c32.is_null() {
        // SAFETY: `c16` holds m·n values (caller).
        Err(unsafe { std::slice::from_raw_parts_mut(c16.cast(), m * n) })
    } else {
        // SAFETY: `c32` holds m·n values (caller).
        Ok(unsafe { std::slice::from_raw_parts_mut(c32, m * n) })
    };
    let done = pool(threads).install(|| match out {
        Err(bits) => zgemm::gemm_bf16_rounded(BitsMut::new(bits, m, n, n)?, a, b, None, threads),
        Ok(c) => zgemm::gemm_bf16(MatMut::row_major(c, m, n)?, a, b, 1.0, Start::Zero, threads),
    });
    if done.is_ok() {
        0
    } else {
        -1
    }
}
