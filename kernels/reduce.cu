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
// then ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) + tail. Eight
// threads per chunk, one per lane; out[c] is chunk c's sum. x holds f32
// values, or 16-bit ones (widened first, as the CPU's norm of 16-bit
// gradients reads them) as fmt says.
extern "C" __global__ void sum_sq_chunks(const void* x, unsigned long long n,
                                         unsigned long long chunk, float scale, double* out,
                                         int fmt)
{
    unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long c = t / 8;
    unsigned int lane = (unsigned int)(t % 8);
    unsigned long long chunks = (n + chunk - 1) / chunk;
    double acc = 0.0;
    unsigned long long start = c * chunk;
    unsigned long long len = 0, full = 0;
    if (c < chunks) {
        len = n - start < chunk ? n - start : chunk;
        full = len - len % 8;
#pragma unroll 8
        for (unsigned long long i = lane; i < full; i += 8) {
            double y = (double)__fmul_rn(load_any(x, start + i, fmt), scale);
            acc = __dadd_rn(acc, __dmul_rn(y, y));
        }
    }
    // Lanes of one chunk are eight consecutive threads of one warp.
    unsigned int base = threadIdx.x & ~7u;
    unsigned int mask = 0xffu << (threadIdx.x % 32 & ~7u);
    double l[8];
    for (int j = 0; j < 8; j++) l[j] = __shfl_sync(mask, acc, base % 32 + j, 32);
    if (c < chunks && lane == 0) {
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
