// Launchers of kernels/gpt.cu on the CPU emulation of emu.h, with the launch
// configurations crates/zcuda/src/gpt.rs uses: one block of ROW_THREADS per
// row for the row kernels, parameter gradients in chunks of ROWS_PER_CHUNK
// rows then summed over the chunks; the grid-stride kernels get a small grid
// so that their loops take several strides.
#include "emu.h"

namespace k {
#include "gpt_kernels.cu"
}

namespace r {
#include "reduce_kernels.cu"
}

namespace a {
#include "adamw_kernels.cu"
}

namespace fa {
#include "attention_kernels.cu"
}

namespace q {
using std::fmaxf;
using std::isinf;
using std::rintf;
#include "quantize_kernels.cu"
}

// Two kernels with a race between warps, for the emulation's own test of
// its warp orders (tests.rs): thread 0 sets a value that the whole block
// then reads with no barrier between, and each warp's lane 0 sets a slot
// that thread 0 then adds up with none either. Each order shows one race
// and hides the other.
namespace probe {
__global__ void broadcast_unsynced(int* out) {
    __shared__ int value;
    if (threadIdx.x == 0) value = -1;
    __syncthreads();
    if (threadIdx.x == 0) value = (int)blockIdx.x;
    out[blockIdx.x * blockDim.x + threadIdx.x] = value;
}

__global__ void gather_unsynced(int* out) {
    __shared__ int slots[32];
    unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) slots[warp] = -1;
    __syncthreads();
    if (lane == 0) slots[warp] = (int)warp + 1;
    if (threadIdx.x == 0) {
        int sum = 0;
        for (unsigned w = 0; w < blockDim.x / 32; w++) sum += slots[w];
        out[blockIdx.x] = sum;
    }
}
}  // namespace probe

namespace {
const unsigned ROW_THREADS = 256;
const int ROWS_PER_CHUNK = 64;
const dim3 STRIDED_GRID{3}, STRIDED_BLOCK{64};

dim3 rows(int n) { return dim3{(unsigned)n}; }
dim3 threads() { return dim3{ROW_THREADS}; }
dim3 columns(int d, int chunks) { return dim3{(d + ROW_THREADS - 1) / ROW_THREADS, (unsigned)chunks}; }
}  // namespace

extern "C" {

// The warp order of this OS thread's launches from now on: -1 the
// process's (ZCUDA_EMU_WARP_ORDER), 0 warp 0 ahead, 1 the last warp ahead.
void emu_set_warp_order(int order) {
    emu_enter_thread();
    emu_self->launch_warp_order = order;
}

void emu_probe_broadcast_unsynced(int* out, unsigned blocks, unsigned threads) {
    emu_launch(probe::broadcast_unsynced, dim3{blocks}, dim3{threads}, out);
}

void emu_probe_gather_unsynced(int* out, unsigned blocks, unsigned threads) {
    emu_launch(probe::gather_unsynced, dim3{blocks}, dim3{threads}, out);
}

void emu_layer_norm(const float* x, const float* w, const float* b, float* y, unsigned short* y16,
                    int fmt16, float* mean, float* rstd, int n, int d, float eps) {
    emu_launch(k::layer_norm, rows(n), threads(), x, w, b, y, y16, fmt16, mean, rstd, d, eps);
}

void emu_rms_norm(const float* x, const float* w, float* y, unsigned short* y16, int fmt16,
                  float* rstd, int n, int d, float eps) {
    emu_launch(k::rms_norm, rows(n), threads(), x, w, y, y16, fmt16, rstd, d, eps);
}

// dx (+ dres) and dw, as GptGpu::rms_norm_backward launches them.
void emu_rms_norm_backward(const float* x, const float* w, const float* rstd, const float* dy,
                           const float* dres, float* dx, float* dw, int n, int d) {
    emu_launch(k::rms_norm_backward, rows(n), threads(), x, w, rstd, dy, dres, dx, d);
    int chunks = std::max(1, (n + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK);
    std::vector<float> part((size_t)chunks * d);
    std::vector<unsigned> done(columns(d, 1).x);
    emu_launch(k::rms_norm_param_partials, columns(d, chunks), threads(), x, rstd, dy, part.data(),
               dw, done.data(), n, d, ROWS_PER_CHUNK);
}

void emu_swiglu(const float* h, float* y, unsigned short* y16, int fmt16, unsigned long long n,
                int f) {
    emu_launch(k::swiglu, STRIDED_GRID, STRIDED_BLOCK, h, y, y16, fmt16, n, f);
}

void emu_swiglu_backward(const float* h, const float* dy, float* dh, unsigned long long n, int f) {
    emu_launch(k::swiglu_backward, STRIDED_GRID, STRIDED_BLOCK, h, dy, dh, n, f);
}

void emu_rope(float* x, const float* cos_t, const float* sin_t, const unsigned* first,
              unsigned long long rows, int ld, int heads, int hd, int half, int t, float sign) {
    emu_launch(k::rope, STRIDED_GRID, STRIDED_BLOCK, x, cos_t, sin_t, first, rows, ld, heads, hd,
               half, t, sign);
}

void emu_kv_rows_to_heads(const float* rows, int ld, int col0, float* heads, int b, int t, int h,
                          int hd, int group) {
    emu_launch(k::kv_rows_to_heads, STRIDED_GRID, STRIDED_BLOCK, rows, ld, col0, heads, b, t, h,
               hd, group);
}

void emu_heads_to_kv_rows(const float* heads, float* rows, int ld, int col0, int b, int t, int h,
                          int hd, int group) {
    emu_launch(k::heads_to_kv_rows, STRIDED_GRID, STRIDED_BLOCK, heads, rows, ld, col0, b, t, h,
               hd, group);
}

void emu_embed(const unsigned* tok, const float* wte, const float* wpe, const unsigned* first,
               float* x, unsigned long long n, int t, int d) {
    emu_launch(k::embed, STRIDED_GRID, STRIDED_BLOCK, tok, wte, wpe, first, x, n, t, d);
}

void emu_bias_residual(float* y, const float* b, const float* res, unsigned long long n,
                       int width, unsigned threshold, float scale, unsigned key) {
    emu_launch(k::bias_residual, STRIDED_GRID, STRIDED_BLOCK, y, b, res, n, width, threshold,
               scale, key);
}

void emu_dropout_noise(const float* x, float* y, unsigned long long n, unsigned threshold,
                       float scale, unsigned key, float mag, unsigned noise_key) {
    emu_launch(k::dropout_noise, STRIDED_GRID, STRIDED_BLOCK, x, y, n, threshold, scale, key, mag,
               noise_key);
}

void emu_layer_norm_backward(const float* x, const float* w, const float* mean, const float* rstd,
                             const float* dy, const float* dres, float* dx, float* dw, float* db,
                             int n, int d) {
    emu_launch(k::layer_norm_backward, rows(n), threads(), x, w, mean, rstd, dy, dres, dx, d);
    int chunks = std::max(1, (n + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK);
    std::vector<float> dw_part((size_t)chunks * d), db_part((size_t)chunks * d);
    std::vector<unsigned> done(columns(d, 1).x);
    emu_launch(k::layer_norm_param_partials, columns(d, chunks), threads(), x, mean, rstd, dy,
               dw_part.data(), db_part.data(), dw, db, done.data(), n, d, ROWS_PER_CHUNK);
}

// A bias gradient as GptGpu::column_sums takes it: chunks of rows, then
// the chunks' sums, in one launch; with a16, a rounded into it as well.
void emu_column_sums(const float* a, unsigned short* a16, int fmt16, float* out, int n,
                     int width) {
    int chunks = std::max(1, (n + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK);
    std::vector<float> part((size_t)chunks * width);
    std::vector<unsigned> done(columns(width, 1).x);
    emu_launch(k::column_sums, columns(width, chunks), threads(), a, a16, fmt16, part.data(), out,
               done.data(), n, width, ROWS_PER_CHUNK);
}

void emu_gelu(const float* h, float* g, unsigned short* g16, int fmt16, unsigned long long n) {
    emu_launch(k::gelu, STRIDED_GRID, STRIDED_BLOCK, h, (const float*)nullptr, 1, g, g16, fmt16,
               n);
}

void emu_gelu_backward(const float* h, const float* dg, float* dh, unsigned long long n) {
    emu_launch(k::gelu_backward, STRIDED_GRID, STRIDED_BLOCK, h, (const float*)nullptr, 1, dg, dh,
               n);
}

// One warp per row, ROW_THREADS / 32 rows a block, as GptGpu::softmax.
void emu_causal_softmax(const float* probs, float* s, unsigned short* s16, int fmt16,
                        const unsigned* first, unsigned long long n, int t, int heads,
                        float scale, unsigned threshold, float dscale, unsigned key) {
    unsigned warps = ROW_THREADS / 32;
    dim3 grid{(unsigned)((n + warps - 1) / warps)};
    if (probs) {
        emu_launch(k::causal_softmax_backward, grid, threads(), probs, s, s16, fmt16, first, n, t,
                   heads, scale);
    } else {
        emu_launch(k::causal_softmax, grid, threads(), s, s16, fmt16, first, n, t, heads, scale,
                   threshold, dscale, key);
    }
}

void emu_cross_entropy(float* logits, const unsigned* targets, float* loss, unsigned short* g16,
                       int fmt16, int n, int vocab, float coef, float smoothing, int grad) {
    emu_launch(k::cross_entropy, rows(n), threads(), logits, targets, loss, g16, fmt16, vocab,
               coef, smoothing, grad);
}

void emu_embed_backward(const float* dx, const unsigned* present, const unsigned* start,
                        const unsigned* rows_by_token, int tokens, float* dwte, float* dwpe, int b,
                        int t, int d) {
    emu_launch(k::embed_backward_tokens, dim3{(unsigned)tokens}, threads(), dx, present, start,
               rows_by_token, dwte, d);
    emu_launch(k::embed_backward_positions, STRIDED_GRID, STRIDED_BLOCK, dx, dwpe, b, t, d);
}

void emu_rows_to_heads(const float* rows, int ld, int col0, float* heads, int b, int t, int h,
                       int hd) {
    emu_launch(k::rows_to_heads, STRIDED_GRID, STRIDED_BLOCK, rows, ld, col0, heads, b, t, h, hd);
}

void emu_heads_to_rows(const float* heads, float* rows, int ld, int col0, int b, int t, int h,
                       int hd) {
    emu_launch(k::heads_to_rows, STRIDED_GRID, STRIDED_BLOCK, heads, rows, ld, col0, b, t, h, hd);
}

// reduce.cu's 16-bit kernels, grid-stride as Gpu::launch16 launches them
// (a small grid here, so that the loops take several strides).
void emu_add_into16(unsigned short* acc, const float* x, unsigned long long n, int fmt) {
    emu_launch(r::add_into16, STRIDED_GRID, STRIDED_BLOCK, acc, x, n, fmt);
}

void emu_widen16(float* out, const unsigned short* x, unsigned long long n, int fmt) {
    emu_launch(r::widen16_into, STRIDED_GRID, STRIDED_BLOCK, out, x, n, fmt);
}

void emu_round16(unsigned short* out, const float* x, unsigned long long n, int fmt) {
    emu_launch(r::round16_into, STRIDED_GRID, STRIDED_BLOCK, out, x, n, fmt);
}

// A block of 256 threads per chunk, as Gpu::sum_sq_chunks.
void emu_sum_sq_chunks(const void* x, unsigned long long n, unsigned long long chunk, float scale,
                       double* out, int fmt) {
    unsigned long long chunks = (n + chunk - 1) / chunk;
    dim3 grid{(unsigned)chunks};
    emu_launch(r::sum_sq_chunks, grid, dim3{256}, x, n, chunk, scale, out, fmt);
}

// AdamW over one slice, grid-stride as Gpu::adamw launches it.
void emu_adamw(float* p, const void* g, float* m, float* v, unsigned short* working,
               unsigned long long n, const a::AdamConsts* c, int grad_fmt, int working_fmt) {
    emu_launch(a::adamw, STRIDED_GRID, STRIDED_BLOCK, p, g, m, v, working, n, *c, grad_fmt,
               working_fmt);
}

// One block of 256 threads per quantization block, as Gpu::quantize;
// *bad starts at all ones.
void emu_quantize(const float* x, unsigned long long n, unsigned block_size, int bits, float* scales,
                  unsigned char* data, unsigned long long* bad) {
    unsigned long long blocks = (n + block_size - 1) / block_size;
    emu_launch(q::quantize, dim3{(unsigned)blocks}, dim3{256}, x, n, block_size, bits, scales, data,
               bad);
}

void emu_dequantize(const float* scales, const unsigned char* data, unsigned long long n,
                    unsigned block_size, int bits, float* out) {
    emu_launch(q::dequantize, STRIDED_GRID, STRIDED_BLOCK, scales, data, n, block_size, bits, out);
}

// attention.cu as GptGpu launches it: blocks of 128 threads over
// (⌈t / 64⌉ tiles, b·heads) (the key/value kernel b·kv), one warp per
// (row, head) for the row terms; bf16 (kind 0), TF32 (kind 1) or f16
// (kind 2) products, head widths 16, 32 and 64, and 128 in 16 bits.
#define FA_WIDTH(kernel, KIND, ...)                                  \
    switch (hd) {                                                    \
        case 16: emu_launch(fa::kernel##_##KIND##_16, __VA_ARGS__); break; \
        case 32: emu_launch(fa::kernel##_##KIND##_32, __VA_ARGS__); break; \
        case 64: emu_launch(fa::kernel##_##KIND##_64, __VA_ARGS__); break; \
    }
#define FA_WIDTH16(kernel, KIND, ...)                                 \
    if (hd == 128) {                                                  \
        emu_launch(fa::kernel##_##KIND##_128, __VA_ARGS__);           \
    } else {                                                          \
        FA_WIDTH(kernel, KIND, __VA_ARGS__)                           \
    }
#define FA_BY_KIND(kernel, ...)                         \
    if (kind == 0) {                                    \
        FA_WIDTH16(kernel, bf16, __VA_ARGS__)           \
    } else if (kind == 1) {                             \
        FA_WIDTH(kernel, tf32, __VA_ARGS__)             \
    } else {                                            \
        FA_WIDTH16(kernel, f16, __VA_ARGS__)            \
    }

// With a threshold above 0, the `_dropout` kernels, which drop the
// probabilities by the mask (threshold, dscale, key).
void emu_flash_forward(const float* qkv, const unsigned* first, float* out, unsigned short* out16,
                       int fmt16, float* lse, int b, int t, int heads, int kv, int hd, int ld,
                       float scale, int kind, unsigned threshold, float dscale, unsigned key) {
    dim3 grid{(unsigned)((t + 63) / 64), (unsigned)(b * heads)};
    if (threshold == 0) {
        FA_BY_KIND(flash_forward, grid, dim3{128}, qkv, first, out, out16, fmt16, lse, t, heads, kv,
                   ld, scale, threshold, dscale, key)
    } else {
        FA_BY_KIND(flash_forward_dropout, grid, dim3{128}, qkv, first, out, out16, fmt16, lse, t,
                   heads, kv, ld, scale, threshold, dscale, key)
    }
}

void emu_flash_backward(const float* qkv, const unsigned* first, const float* out,
                        const float* dout, const float* lse, float* delta, float* dqkv, int b,
                        int t, int heads, int kv, int hd, int ld, float scale, int kind,
                        unsigned threshold, float dscale, unsigned key) {
    unsigned long long rows = (unsigned long long)b * t;
    emu_launch(fa::attention_delta, dim3{(unsigned)((rows * heads + 7) / 8)}, dim3{256}, out, dout,
               delta, rows, t, heads, hd);
    unsigned tiles = (t + 63) / 64;
    dim3 kv_grid{tiles, (unsigned)(b * kv)}, q_grid{tiles, (unsigned)(b * heads)};
    if (threshold == 0) {
        FA_BY_KIND(flash_backward_kv, kv_grid, dim3{128}, qkv, first, dout, (const float*)lse,
                   (const float*)delta, dqkv, t, heads, kv, ld, scale, threshold, dscale, key)
        FA_BY_KIND(flash_backward_q, q_grid, dim3{128}, qkv, first, dout, (const float*)lse,
                   (const float*)delta, dqkv, t, heads, kv, ld, scale, threshold, dscale, key)
    } else {
        FA_BY_KIND(flash_backward_kv_dropout, kv_grid, dim3{128}, qkv, first, dout,
                   (const float*)lse, (const float*)delta, dqkv, t, heads, kv, ld, scale,
                   threshold, dscale, key)
        FA_BY_KIND(flash_backward_q_dropout, q_grid, dim3{128}, qkv, first, dout,
                   (const float*)lse, (const float*)delta, dqkv, t, heads, kv, ld, scale,
                   threshold, dscale, key)
    }
}

}  // extern "C"

// Every kernel by its name, launched from cuLaunchKernel's arguments
// (an array of pointers to each parameter's value, in the kernel's
// order), for the CPU driver of driver.cpp: each entry unpacks the array
// by its kernel's own signature.
namespace {
template <class F, F Kernel>
struct ByParams;

template <class... P, void (*Kernel)(P...)>
struct ByParams<void (*)(P...), Kernel> {
    static void launch(dim3 grid, dim3 block, void** params) {
        [&]<size_t... I>(std::index_sequence<I...>) {
            emu_launch(Kernel, grid, block, *static_cast<P*>(params[I])...);
        }(std::index_sequence_for<P...>{});
    }
};

#define EMU_KERNEL(ns, name) {#name, &ByParams<decltype(&ns::name), &ns::name>::launch}
#define EMU_ATTENTION(name) \
    EMU_KERNEL(fa, name##_bf16_16), EMU_KERNEL(fa, name##_bf16_32), EMU_KERNEL(fa, name##_bf16_64), \
    EMU_KERNEL(fa, name##_tf32_16), EMU_KERNEL(fa, name##_tf32_32), EMU_KERNEL(fa, name##_tf32_64), \
    EMU_KERNEL(fa, name##_f16_16), EMU_KERNEL(fa, name##_f16_32), EMU_KERNEL(fa, name##_f16_64), \
    EMU_KERNEL(fa, name##_bf16_128), EMU_KERNEL(fa, name##_f16_128)

struct NamedKernel {
    const char* name;
    EmuParamLauncher launch;
};

const NamedKernel EMU_KERNELS[] = {
    EMU_KERNEL(a, adamw),
    EMU_KERNEL(a, adamw_runs),
    EMU_KERNEL(q, quantize),
    EMU_KERNEL(q, dequantize),
    EMU_KERNEL(r, add_f32),
    EMU_KERNEL(r, scale_f32),
    EMU_KERNEL(r, add_into16),
    EMU_KERNEL(r, add_runs),
    EMU_KERNEL(r, widen16_into),
    EMU_KERNEL(r, round16_into),
    EMU_KERNEL(r, sum_sq_chunks),
    EMU_KERNEL(k, embed),
    EMU_KERNEL(k, embed_backward_tokens),
    EMU_KERNEL(k, embed_backward_positions),
    EMU_KERNEL(k, layer_norm),
    EMU_KERNEL(k, layer_norm_backward),
    EMU_KERNEL(k, layer_norm_param_partials),
    EMU_KERNEL(k, rms_norm),
    EMU_KERNEL(k, rms_norm_backward),
    EMU_KERNEL(k, rms_norm_param_partials),
    EMU_KERNEL(k, column_sums),
    EMU_KERNEL(k, bias_residual),
    EMU_KERNEL(k, dropout_noise),
    EMU_KERNEL(k, gelu),
    EMU_KERNEL(k, gelu_backward),
    EMU_KERNEL(k, causal_softmax),
    EMU_KERNEL(k, causal_softmax_backward),
    EMU_KERNEL(k, rows_to_heads),
    EMU_KERNEL(k, heads_to_rows),
    EMU_KERNEL(k, kv_rows_to_heads),
    EMU_KERNEL(k, heads_to_kv_rows),
    EMU_KERNEL(k, rope),
    EMU_KERNEL(k, swiglu),
    EMU_KERNEL(k, swiglu_backward),
    EMU_KERNEL(k, cross_entropy),
    EMU_ATTENTION(flash_forward),
    EMU_ATTENTION(flash_backward_kv),
    EMU_ATTENTION(flash_backward_q),
    EMU_ATTENTION(flash_forward_dropout),
    EMU_ATTENTION(flash_backward_kv_dropout),
    EMU_ATTENTION(flash_backward_q_dropout),
    EMU_KERNEL(fa, attention_delta),
};
}  // namespace

EmuParamLauncher emu_kernel_by_name(const char* name) {
    for (const NamedKernel& k : EMU_KERNELS) {
        if (std::strcmp(k.name, name) == 0) return k.launch;
    }
    return nullptr;
}
