// CUDA's kernel dialect on the CPU, as much of it as kernels/gpt.cu,
// quantize.cu, and reduce.cu, adamw.cu and attention.cu (with half16.cuh)
// use: a launch runs the grid's blocks on a few OS threads, each block's
// CUDA threads as fibers of one OS thread (emu_fiber.h), so that
// __syncthreads is a barrier of the block's fibers, a warp shuffle (or a
// tensor-core product) an exchange through memory with a barrier of the
// warp's 32 fibers, and
// __shared__ memory a thread-local static (the OS thread runs one block at
// a time). Arithmetic is the CPU's IEEE f32 without contraction into FMA
// (build.rs: -ffp-contract=off), as NVRTC compiles zrun's kernels
// (--fmad=false); expf, tanhf, logf and sqrtf come from the C library,
// not CUDA's, so results agree with the GPU's to the math library's ulps.
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "emu_fiber.h"


// half16.cuh's f16 conversions take the C++ compiler's _Float16 here.
#define ZRUN_CPU_EMULATION 1

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static thread_local
#define __align__(n) __attribute__((aligned(n)))

inline void __syncthreads() { emu_self->block.arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    auto& lanes = emu_self->lanes[emu_self->warps[warp].generation & 1][warp];
    lanes[lane] = v;
    emu_self->warps[warp].arrive_and_wait();
    float other = lanes[lane ^ (unsigned)lane_mask];
    return other;
}

// The shuffle reduce.cu's norm uses: lane `src` of the warp's `width`.
inline double __shfl_sync(unsigned, double v, int src, int width) {
    unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    auto& lanes = emu_self->lanes_f64[emu_self->warps[warp].generation & 1][warp];
    lanes[lane] = v;
    emu_self->warps[warp].arrive_and_wait();
    double other = lanes[(lane / width) * width + (unsigned)src % width];
    return other;
}

// attention.cu's tensor-core products: mma.sync.aligned.m16n8k16.row.col
// .f32.bf16.bf16.f32, c += a·b for one warp: each lane's fragments gathered
// through memory by PTX's layout (lane l, g = l / 4, q = l % 4: A register r
// holds row g + 8·(r % 2), columns 2q, 2q+1 (+8 for r ≥ 2), low half first;
// B register r rows 2q, 2q+1 (+8 for r = 1) of column g; C register r row
// g + 8·(r / 2), column 2q + r % 2). Products of bf16 values are exact in
// f32; the 16 terms are summed in order, then added to c (the hardware's
// order and intermediate rounding are its own).

inline float emu_bf16_half(unsigned word, unsigned high) {
    unsigned bits = high ? word & 0xffff0000u : word << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// c += a·b for one warp at depth K: every lane's registers gathered into
// the warp's slot, then each lane's four results from `a_at(slot, row, k)`
// and `b_at(slot, k, col)`, which read an element where the form's layout
// puts it.
template <unsigned K, class A, class B>
inline void emu_mma(float* c, const unsigned* a, unsigned b0, unsigned b1, A a_at, B b_at) {
    unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // The warp's slot in this generation's set (see EmuThread::lanes).
    unsigned slot = (emu_self->warps[warp].generation & 1) * 32 + warp;
    for (int r = 0; r < 4; r++) emu_self->mma_a[slot][lane][r] = a[r];
    emu_self->mma_b[slot][lane][0] = b0;
    emu_self->mma_b[slot][lane][1] = b1;
    emu_self->warps[warp].arrive_and_wait();
    unsigned g = lane / 4, q = lane % 4;
    float out[4];
    for (unsigned r = 0; r < 4; r++) {
        unsigned row = g + 8 * (r / 2), col = 2 * q + r % 2;
        float sum = 0.0f;
        for (unsigned k = 0; k < K; k++) sum += a_at(slot, row, k) * b_at(slot, k, col);
        out[r] = sum;
    }
    for (int r = 0; r < 4; r++) c[r] += out[r];
}

inline void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    emu_mma<16>(
        c, a, b0, b1,
        [](unsigned slot, unsigned row, unsigned k) {
            return emu_bf16_half(emu_self->mma_a[slot][(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)],
                                 k % 2);
        },
        [](unsigned slot, unsigned k, unsigned col) {
            return emu_bf16_half(emu_self->mma_b[slot][col * 4 + (k % 8) / 2][k >= 8], k % 2);
        });
}

// The f16 form, mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: the bf16
// form's layout; products of f16 values are exact in f32 too.
inline void mma_f16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    auto half = [](unsigned word, unsigned high) {
        return (float)std::bit_cast<_Float16>((unsigned short)(high ? word >> 16 : word & 0xffffu));
    };
    emu_mma<16>(
        c, a, b0, b1,
        [&](unsigned slot, unsigned row, unsigned k) {
            return half(emu_self->mma_a[slot][(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k % 2);
        },
        [&](unsigned slot, unsigned k, unsigned col) {
            return half(emu_self->mma_b[slot][col * 4 + (k % 8) / 2][k >= 8], k % 2);
        });
}

// The TF32 form, mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: A
// register r holds row g + 8·(r % 2), column q (+4 for r ≥ 2); B register r
// row q + 4·r of column g; C as above. Products of TF32 values are exact in
// f32; the 8 terms are summed in order, then added to c.
inline void mma_tf32(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    auto f32 = [](unsigned bits) {
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return f;
    };
    emu_mma<8>(
        c, a, b0, b1,
        [&](unsigned slot, unsigned row, unsigned k) {
            return f32(emu_self->mma_a[slot][(row % 8) * 4 + k % 4][(row >= 8) + 2 * (k >= 4)]);
        },
        [&](unsigned slot, unsigned k, unsigned col) { return f32(emu_self->mma_b[slot][col * 4 + k % 4][k >= 4]); });
}

// Each operation rounded on its own, as the _rn intrinsics (no contraction:
// build.rs compiles with -ffp-contract=off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }

inline float __int_as_float(unsigned bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline float __uint_as_float(unsigned bits) { return __int_as_float(bits); }

// quantize.cu's one atomic: the lowest index of a non-finite value.
inline unsigned long long atomicMin(unsigned long long* at, unsigned long long v) {
    std::atomic_ref<unsigned long long> r(*at);
    unsigned long long old = r.load();
    while (v < old && !r.compare_exchange_weak(old, v)) {
    }
    return old;
}

// gpt.cu's column kernels count a stripe's finished blocks (the blocks run
// on several OS threads here, as on a GPU's SMs): the fence and the count
// order each block's parts before the last block reads them.
inline unsigned atomicAdd(unsigned* at, unsigned v) {
    return std::atomic_ref<unsigned>(*at).fetch_add(v);
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline float __ldcg(const float* at) { return *at; }

inline unsigned __float_as_uint(float f) {
    unsigned bits;
    std::memcpy(&bits, &f, sizeof bits);
    return bits;
}

using std::min;

// Runs `kernel` over `grid` blocks of `block.x` threads (at most 1024,
// whole warps): the blocks shared out in order over up to `EMU_OS_THREADS`
// OS threads (blocks of a grid are independent, as on a GPU), each
// block's threads as fibers. Returns when the whole grid has run.
template <class... P, class... A>
void emu_launch(void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
    unsigned blocks = grid.x * grid.y;
    emu_enter_thread();
    int asked = emu_self->launch_warp_order;
    bool reverse = asked < 0 ? emu_default_warp_order() : asked == 1;
    auto run_blocks = [=](unsigned first, unsigned step) {
        emu_enter_thread();
        emu_self->reverse_warps = reverse;
        gridDim = grid;
        blockDim = block;
        for (unsigned i = first; i < blocks; i += step) {
            blockIdx = {i % grid.x, i / grid.x, 0};
            emu_self->block.expect(block.x);
            for (unsigned w = 0; w < (block.x + 31) / 32; w++) emu_self->warps[w].expect(std::min(32u, block.x - 32 * w));
            emu_run_fibers(block.x, [&] { kernel(args...); });
        }
    };
    unsigned os_threads = std::min(blocks, emu_os_threads());
    std::vector<std::thread> helpers;
    for (unsigned t = 1; t < os_threads; t++) helpers.emplace_back(run_blocks, t, os_threads);
    run_blocks(0, os_threads);
    for (auto& h : helpers) h.join();
}

// A kernel launched from cuLaunchKernel's parameter array (emu.cpp's
// table, for driver.cpp).
using EmuParamLauncher = void (*)(dim3 grid, dim3 block, void** params);

// The launcher of the kernel called `name`, or null.
EmuParamLauncher emu_kernel_by_name(const char* name);
