#!/usr/bin/env python3
"""zgemm beside PyTorch's matmul in one process, alternated call by call, on
the GEMM shapes of `zrun bench kernels`: the products the PyTorch and
DeepSpeed peers run (MKL's sgemm for f32; oneDNN, on AMX where the CPU has
it, for bf16). Separate processes on a shared host land on levels up to 2x
apart, so only figures taken side by side in one process compare.

    cargo build --release -p zgemm --example zgemm_c
    PEERENV=/tmp/peerenv scripts/peers/setup.sh      # once: torch in a venv
    /tmp/peerenv/venv/bin/python scripts/gemm_torch.py [THREADS] [f32|bf16]

bf16: both take bf16 operands and accumulate in f32; `torch.mm` of two bf16
tensors gives a bf16 result, as zgemm does where the depth is one block (k up
to 768: it rounds each tile as it stores, `gemm_bf16_rounded`, as the model's
q, k, v projection does); deeper products give zgemm's f32 `C` (twice the
bytes torch writes: what the model's deep products take, where a rounded
output would be made whole first and rounded after). f32: both f32. Shapes are m x k x n; "tn" reads A
transposed (a weight gradient x^T.dy), "nt" reads B transposed (an input
gradient dy.W^T), as the model does. Prints each side's median and best of
`GEMM_REPS` (20) calls each, in GFLOP/s, and zgemm / torch. The results are
checked against each other first.
"""
import ctypes
import os
import sys
import time

# PyTorch's OpenMP threads sleep between calls instead of spinning through
# zgemm's (set before torch starts them).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KMP_BLOCKTIME", "0")
import torch  # noqa: E402

SHAPES = [("nn", 2048, 2048, 2048), ("nn", 2048, 384, 1152), ("nn", 2048, 384, 1536),
          ("nn", 2048, 1536, 384), ("tn", 384, 2048, 1152), ("nt", 2048, 1152, 384),
          ("tn", 1536, 2048, 384), ("tn", 128, 512, 384)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = os.environ.get("ZGEMM_LIB", os.path.join(ROOT, "target/release/examples/libzgemm_c.so"))


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    kinds = sys.argv[2:] or ["f32", "bf16"]
    reps = int(os.environ.get("GEMM_REPS", "20"))
    if not os.path.exists(LIB):
        sys.exit(f"{LIB} is missing: cargo build --release -p zgemm --example zgemm_c")
    z = ctypes.CDLL(LIB)
    size, ptr, i32 = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int32
    z.zgemm_f32.argtypes = [i32, i32, size, size, size, ptr, ptr, ptr, size]
    z.zgemm_bf16.argtypes = [i32, i32, size, size, size, ptr, ptr, ptr, ptr, size]
    torch.set_num_threads(threads)
    for kind in kinds:
        if kind == "bf16" and not torch.backends.mkldnn.is_available():
            print("bf16: this torch has no oneDNN; skipped")
            continue
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        for op, m, k, n in SHAPES:
            ta, tb = op[0] == "t", op[1] == "t"
            gen = torch.Generator().manual_seed(0)
            # Stored as the model stores them; the transposed views are what
            # torch.mm reads (no copy).
            a_store = torch.rand((k, m) if ta else (m, k), generator=gen).to(dtype)
            b_store = torch.rand((n, k) if tb else (k, n), generator=gen).to(dtype)
            a = a_store.t() if ta else a_store
            b = b_store.t() if tb else b_store
            rounded = kind == "bf16" and k <= 768
            c = torch.empty((m, n), dtype=dtype if kind == "f32" or rounded else torch.float32)

            def zgemm_call():
                if kind == "bf16":
                    c32, c16 = (None, c.data_ptr()) if rounded else (c.data_ptr(), None)
                    rc = z.zgemm_bf16(ta, tb, m, n, k, a_store.data_ptr(), b_store.data_ptr(),
                                      c32, c16, threads)
                else:
                    rc = z.zgemm_f32(ta, tb, m, n, k, a_store.data_ptr(), b_store.data_ptr(),
                                     c.data_ptr(), threads)
                assert rc == 0, "zgemm refused the shapes"

            zgemm_call()
            want = torch.mm(a, b)
            gap = ((c.float() - want.float()).abs() / want.float().abs().clamp(min=1.0)).max()
            tol = 2e-2 if kind == "bf16" else 1e-4
            assert gap < tol, f"{op} {m}x{k}x{n} {kind}: zgemm and torch differ by {gap}"
            times = ([], [])
            for rep in range(2 * reps):
                for side in (rep % 2, 1 - rep % 2):
                    time.sleep(0.002)
                    t = time.perf_counter()
                    if side == 0:
                        zgemm_call()
                    else:
                        torch.mm(a, b)
                    times[side].append(time.perf_counter() - t)
            flops = 2.0 * m * k * n
            med = [flops / sorted(v)[len(v) // 2] / 1e9 for v in times]
            best = [flops / min(v) / 1e9 for v in times]
            print(f"{kind} {op}_{m}x{k}x{n} threads {threads}: median zgemm {med[0]:.0f} "
                  f"torch {med[1]:.0f} ({med[0] / med[1]:.2f}x)  best zgemm {best[0]:.0f} "
                  f"torch {best[1]:.0f} ({best[0] / best[1]:.2f}x)  GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
