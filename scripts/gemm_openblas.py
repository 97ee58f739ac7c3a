#!/usr/bin/env python3
"""OpenBLAS (through numpy) on the GEMM shapes of `zrun bench kernels`, to set
beside its zgemm rows in one sitting:

    OPENBLAS_NUM_THREADS=1 python3 scripts/gemm_openblas.py
    OPENBLAS_NUM_THREADS=2 python3 scripts/gemm_openblas.py

On a CPU with AVX-512, OPENBLAS_CORETYPE=Haswell makes OpenBLAS run its
AVX2 kernel: the figure to set beside zgemm's `Avx2` column on the same
machine.

Shapes are m x k x n; "tn" reads A transposed (a weight gradient x^T.dy), "nt"
reads B transposed (an input gradient dy.W^T), as the model does. Prints the
best of several calls in GFLOP/s. Needs numpy (pip install numpy).
"""
import os
import time

import numpy as np

SHAPES = [("nn", 2048, 2048, 2048), ("nn", 2048, 384, 1152), ("nn", 2048, 384, 1536),
          ("nn", 2048, 1536, 384), ("tn", 384, 2048, 1152), ("nt", 2048, 1152, 384),
          ("tn", 1536, 2048, 384), ("tn", 128, 512, 384)]

threads = os.environ.get("OPENBLAS_NUM_THREADS", "all")
for op, m, k, n in SHAPES:
    rng = np.random.default_rng(0)
    a = rng.random((k, m), np.float32).T if op[0] == "t" else rng.random((m, k), np.float32)
    b = rng.random((n, k), np.float32).T if op[1] == "t" else rng.random((k, n), np.float32)
    a @ b
    best = float("inf")
    for _ in range(max(3, min(50, int(2e10 / (2 * m * k * n))))):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    print(f"openblas_{op}_{m}x{k}x{n}  threads {threads}  {2 * m * k * n / best / 1e9:.1f} GFLOP/s")
