// Blockwise symmetric int8 / int4 quantization (ZeRO++ qwZ and qgZ) on the
// device, in the CPU's format and with the CPU's rounding (crates/zquant):
// one f32 scale per block of block_size values, s = max|x| / qmax nudged so
// that max|x| rounds to a code of at most qmax; a value becomes
// round_half_even(x / s), int4 two a byte with the earlier value in the low
// nibble. Every division and addition is rounded on its own, subnormals are
// kept (--ftz=false), so a GPU's bytes equal the CPU's bit for bit.

// 1.5 * 2^23: added to a value of magnitude below 2^22 it rounds it to an
// integer (half to even), left in the low mantissa bits as two's complement.
#define ROUNDER 12582912.0f
#define THREADS 256

__device__ __forceinline__ float scale_for(float amax, float qmax) {
    if (amax == 0.0f) {
        return 0.0f;
    }
    // A subnormal amax can make amax / qmax round to 0, or so far down that
    // amax rounds to a code above qmax: step up until it does not.
    float s = fmaxf(__fdiv_rn(amax, qmax), __uint_as_float(1u));
    while (rintf(__fdiv_rn(amax, s)) > qmax) {
        s = __uint_as_float(__float_as_uint(s) + 1u);
    }
    // Near FLT_MAX a scale rounded up brings the largest code back as
    // infinity; one step down still rounds amax to qmax.
    if (isinf(__fmul_rn(qmax, s))) {
        s = __uint_as_float(__float_as_uint(s) - 1u);
    }
    return s;
}

__device__ __forceinline__ unsigned int to_code(float v, float s) {
    return __float_as_uint(__fadd_rn(__fdiv_rn(v, s), ROUNDER)) & 0xffu;
}

// One thread block per quantization block (launch with THREADS threads and
// one block per quantization block). bits is 8 or 4. A NaN or an infinity
// leaves the block's outputs unwritten and lowers *bad to its index (the host
// sets *bad to all ones first and refuses the result if it changed).
extern "C" __global__ void quantize(
    const float* x,
    unsigned long long n,
    unsigned int block_size,
    int bits,
    float* scales,
    unsigned char* data,
    unsigned long long* bad)
{
    __shared__ unsigned int amax_of[THREADS];
    __shared__ float scale;
    unsigned long long start = (unsigned long long)blockIdx.x * block_size;
    unsigned long long end = start + block_size < n ? start + block_size : n;

    // On the bits, |x| orders like its value, and NaN and infinities are the
    // patterns at or above infinity's: one integer max finds both.
    unsigned int m = 0;
    for (unsigned long long i = start + threadIdx.x; i < end; i += THREADS) {
        unsigned int b = __float_as_uint(x[i]) & 0x7fffffffu;
        m = b > m ? b : m;
    }
    amax_of[threadIdx.x] = m;
    __syncthreads();
    for (unsigned int half = THREADS / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            unsigned int o = amax_of[threadIdx.x + half];
            amax_of[threadIdx.x] = o > amax_of[threadIdx.x] ? o : amax_of[threadIdx.x];
        }
        __syncthreads();
    }
    unsigned int amax = amax_of[0];
    if (amax >= 0x7f800000u) {
        for (unsigned long long i = start + threadIdx.x; i < end; i += THREADS) {
            if ((__float_as_uint(x[i]) & 0x7fffffffu) >= 0x7f800000u) {
                atomicMin(bad, i);
                break;
            }
        }
        return;
    }
    if (threadIdx.x == 0) {
        scale = scale_for(__uint_as_float(amax), bits == 8 ? 127.0f : 7.0f);
        scales[blockIdx.x] = scale;
    }
    __syncthreads();
    float s = scale;
    if (bits == 8) {
        for (unsigned long long i = start + threadIdx.x; i < end; i += THREADS) {
            data[i] = s == 0.0f ? 0 : (unsigned char)to_code(x[i], s);
        }
    } else {
        // Blocks have an even size, so value i sits in byte i / 2.
        for (unsigned long long i = start + 2 * threadIdx.x; i < end; i += 2 * THREADS) {
            unsigned int lo = s == 0.0f ? 0 : to_code(x[i], s) & 0x0fu;
            unsigned int hi = (s == 0.0f || i + 1 >= end) ? 0 : (to_code(x[i + 1], s) & 0x0fu) << 4;
            data[i / 2] = (unsigned char)(lo | hi);
        }
    }
}

// Back to f32: value i is code * scale of its block.
extern "C" __global__ void dequantize(
    const float* scales,
    const unsigned char* data,
    unsigned long long n,
    unsigned int block_size,
    int bits,
    float* out)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        float s = scales[i / block_size];
        int q;
        if (bits == 8) {
            q = (signed char)data[i];
        } else {
            unsigned char b = data[i / 2];
            // The nibble's sign bit moved to the byte's, then shifted back.
            q = (i & 1) ? ((signed char)b >> 4) : ((signed char)(unsigned char)(b << 4) >> 4);
        }
        out[i] = __fmul_rn((float)q, s);
    }
}
