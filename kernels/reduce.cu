// The element-wise f32 sum that zrun's own collectives add chunks with, for
// device buffers moved without NCCL: acc[i] = acc[i] + x[i], rounded as the
// CPU's add (one IEEE addition, in the same operand order), so a reduction is
// the same bits wherever its chunks were added.
extern "C" __global__ void add_f32(float* acc, const float* x, unsigned long long n)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        acc[i] = __fadd_rn(acc[i], x[i]);
    }
}

// x[i] = x[i] * s, one IEEE multiplication each: the CPU's in-place scaling of
// f32 gradients (averaging over micro-batches, clipping).
extern "C" __global__ void scale_f32(float* x, float s, unsigned long long n)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        x[i] = __fmul_rn(x[i], s);
    }
}

// A micro-batch's f32 gradient added into a 16-bit gradient buffer as the
// CPU adds it (zengine's Flat::add_f32): acc[i] = round16(widen16(acc[i]) +
// x[i]), one f32 addition rounded to nearest even.
extern "C" __global__ void add_into16(unsigned short* acc, const float* x,
                                      unsigned long long n, int fmt)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        acc[i] = round16(__fadd_rn(widen16(acc[i], fmt), x[i]), fmt);
    }
}

// Tensors, each its own buffer, added into one flat buffer in one launch
// (a block's gradients into its group's), where a launch a tensor cost
// some 4 µs of GPU time each on an H200 however few its values: run r
// adds src[r][0, end[r] - start[r]) into acc[start[r], end[r]) as add_f32
// (fmt FMT_F32, acc f32) or add_into16 (acc 16-bit) adds it, the same bits.
// Runs are sorted and apart or touching; acc between them is not touched.
#define ADD_MAX_RUNS 16
struct AddRuns {
    unsigned long long src[ADD_MAX_RUNS];
    unsigned long long start[ADD_MAX_RUNS];
    unsigned long long end[ADD_MAX_RUNS];
    unsigned int count;
};

extern "C" __global__ void add_runs(void* acc, AddRuns runs, int fmt)
{
    for_each_in_runs(runs.start, runs.end, runs.count, [&](unsigned long long i, unsigned int r) {
        float x = ((const float*)runs.src[r])[i - runs.start[r]];
        if (fmt == FMT_F32) {
            float* a = (float*)acc;
            a[i] = __fadd_rn(a[i], x);
        } else {
            unsigned short* a = (unsigned short*)acc;
            a[i] = round16(__fadd_rn(widen16(a[i], fmt), x), fmt);
        }
    });
}

// out[i] = the f32 value of the 16-bit x[i] (exact): the model's f32 weights
// from the working copy AdamW wrote.
extern "C" __global__ void widen16_into(float* out, const unsigned short* x,
                                        unsigned long long n, int fmt)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        out[i] = widen16(x[i], fmt);
    }
}

// out[i] = x[i] rounded to the 16-bit format (nearest even): bf16 products'
// operands, rounded as the CPU's bf16 products round theirs.
extern "C" __global__ void round16_into(unsigned short* out, const float* x,
                                        unsigned long long n, int fmt)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        out[i] = round16(x[i], fmt);
    }
}

// x[i] in f32: x holds f32 values (fmt FMT_F32) or 16-bit ones.
__device__ __forceinline__ float load_any(const void* x, unsigned long long i, int fmt) {
    return fmt == FMT_F32 ? ((const float*)x)[i] : widen16(((const unsigned short*)x)[i], fmt);
}

// The sum of squares of x[0..n) in chunks of `chunk` values (a multiple of
// 8), as the CPU's gradient norm adds them: per chunk, eight f64 lanes (lane j
// adds values j, j+8, ... in order, each widened from x·scale rounded in f32
// and squared in f64), the values past the last multiple of 8 added after,
// then ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) + tail. x holds f32
// values, or 16-bit ones (widened first, as the CPU's norm of 16-bit
// gradients reads them) as fmt says; out[c] is chunk c's sum.
//
// One block of 256 threads per chunk. The lanes' adds are eight chains
// of chunk/8 dependent f64 adds each, an order the bits depend on; what can
// run wide is the reading and squaring. So the block's other warps read the
// chunk a tile at a time (coalesced, many loads in flight) and square it
// into shared memory, while the first warp's eight lanes add the tile
// before (two tiles, alternating). Eight threads per chunk reading their
// own values (the first version) kept a few kilobytes in flight per SM:
// 0.28 ms a call on an H200 where the bytes take 0.01. The tiles (second
// version) still ran at ~65 µs a call where ~20 were predicted: a warp
// issues in order, so a loop whose load feeds the same iteration's store
// keeps one load in flight a thread (~3 KB an SM, ~0.4 TB/s over the GPU),
// and an adding lane that reads sq[i] and then adds it waits out the
// shared load's latency before every add. So each reading thread now
// issues SUM_SQ_LOADS loads before it squares any of them, and each adding
// lane reads eight of its values before it adds them, in the same order.
#define SUM_SQ_TILE 2048
#define SUM_SQ_LOADS 10
extern "C" __global__ void sum_sq_chunks(const void* x, unsigned long long n,
                                         unsigned long long chunk, float scale, double* out,
                                         int fmt)
{
    __shared__ double sq[2][SUM_SQ_TILE];
    unsigned long long c = blockIdx.x;
    unsigned long long start = c * chunk;
    unsigned long long len = n - start < chunk ? n - start : chunk;
    unsigned long long full = len - len % 8;
    unsigned long long tiles = (full + SUM_SQ_TILE - 1) / SUM_SQ_TILE;
    unsigned int lane = threadIdx.x;   // an adding lane where < 8
    double acc = 0.0;
    // Tile k's squares into sq[k % 2], by every warp but the first.
    auto fill = [&](unsigned long long k) {
        if (threadIdx.x < 32) return;
        unsigned long long base = k * SUM_SQ_TILE;
        unsigned int m = (unsigned int)(full - base < SUM_SQ_TILE ? full - base : SUM_SQ_TILE);
        unsigned int stride = blockDim.x - 32;
        for (unsigned int i0 = threadIdx.x - 32; i0 < m; i0 += stride * SUM_SQ_LOADS) {
            float v[SUM_SQ_LOADS];
#pragma unroll
            for (int j = 0; j < SUM_SQ_LOADS; j++) {
                unsigned int i = i0 + j * stride;
                v[j] = i < m ? load_any(x, start + base + i, fmt) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < SUM_SQ_LOADS; j++) {
                unsigned int i = i0 + j * stride;
                if (i < m) {
                    double y = (double)__fmul_rn(v[j], scale);
                    sq[k % 2][i] = __dmul_rn(y, y);
                }
            }
        }
    };
    if (tiles > 0) fill(0);
    __syncthreads();
    for (unsigned long long k = 0; k < tiles; k++) {
        if (k + 1 < tiles) fill(k + 1);
        if (lane < 8) {
            unsigned long long base = k * SUM_SQ_TILE;
            unsigned int m = (unsigned int)(full - base < SUM_SQ_TILE ? full - base : SUM_SQ_TILE);
            const double* s = sq[k % 2];
            unsigned int i = lane;
            // Values i, i + 8, ..., i + 56 read, then added in that order.
            for (; i + 56 < m; i += 64) {
                double v[8];
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = s[i + 8 * j];
#pragma unroll
                for (int j = 0; j < 8; j++) acc = __dadd_rn(acc, v[j]);
            }
            for (; i < m; i += 8) acc = __dadd_rn(acc, s[i]);
        }
        __syncthreads();
    }
    if (threadIdx.x < 32) {
        double l[8];
        for (int j = 0; j < 8; j++) l[j] = __shfl_sync(0xffffffffu, acc, j, 32);
        if (lane == 0) {
            double tail = 0.0;
            for (unsigned long long i = full; i < len; i++) {
                double y = (double)__fmul_rn(load_any(x, start + i, fmt), scale);
                tail = __dadd_rn(tail, __dmul_rn(y, y));
            }
            double s = __dadd_rn(__dadd_rn(__dadd_rn(l[0], l[4]), __dadd_rn(l[1], l[5])),
                                 __dadd_rn(__dadd_rn(l[2], l[6]), __dadd_rn(l[3], l[7])));
            out[c] = __dadd_rn(s, tail);
        }
    }
}
