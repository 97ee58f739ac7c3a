// Dropout's masks as zmodel's dropout.rs makes them, shared by gpt.cu and
// attention.cu (zcuda puts this text before each, after half16.cuh), so
// that the GPU drops what the CPU drops: element i of a tensor is kept
// where mask_hash(key, i) (lowbias32 of the index spread by the golden
// ratio and mixed with the key) is at least `threshold` (p·2³²), then
// scaled by `scale` (1/(1 - p)); a threshold of 0 drops and scales nothing.
// The keys (which step, micro-batch, rank, block and site) are the host's.
// __fmul_rn keeps the compiler from contracting a kept value's scaling into
// a following add (an FMA rounds once where the CPU rounds twice).

__device__ __forceinline__ unsigned mask_hash(unsigned key, unsigned long long i)
{
    unsigned x = (unsigned)i * 0x9E3779B9u ^ key ^ (unsigned)(i >> 32) * 0x85EBCA6Bu;
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

// Whether element i is kept (threshold above 0).
__device__ __forceinline__ bool kept(unsigned long long i, unsigned threshold, unsigned key)
{
    return mask_hash(key, i) >= threshold;
}

__device__ __forceinline__ float dropped(float v, unsigned long long i, unsigned threshold,
                                         float scale, unsigned key)
{
    if (threshold == 0) return v;
    return kept(i, threshold, key) ? __fmul_rn(v, scale) : 0.0f;
}

