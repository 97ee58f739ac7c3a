// The 16-bit formats of mixed precision, shared by adamw.cu, reduce.cu,
// gpt.cu and attention.cu
// (zcuda puts this text before each when it compiles them): widening, and
// rounding to nearest even as the CPU rounds.

// 16-bit formats, as the host names them: 0 = none (f32), 1 = bf16, 2 = f16.
#define FMT_F32 0
#define FMT_BF16 1
#define FMT_F16 2

__device__ __forceinline__ float widen16(unsigned short h, int fmt) {
    if (fmt == FMT_BF16) {
        return __uint_as_float(((unsigned int)h) << 16);
    }
#ifdef ZRUN_CPU_EMULATION
    // crates/zcuda-emu: the C++ compiler's binary16 (exact either way).
    return (float)std::bit_cast<_Float16>(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

// bf16 by integer rounding (ties to even; NaN made quiet), the CPU's formula;
// f16 by the hardware's round-to-nearest-even conversion.
__device__ __forceinline__ unsigned short round16(float x, int fmt) {
    if (fmt == FMT_BF16) {
        unsigned int b = __float_as_uint(x);
        if ((b & 0x7fffffffu) > 0x7f800000u) {
            return (unsigned short)((b >> 16) | 0x40u);
        }
        return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    }
#ifdef ZRUN_CPU_EMULATION
    // crates/zcuda-emu: the C++ compiler's conversion, to nearest even too.
    return std::bit_cast<unsigned short>((_Float16)x);
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#endif
}
