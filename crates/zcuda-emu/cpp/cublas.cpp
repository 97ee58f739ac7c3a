// libcublas.so for driver.cpp's CPU "GPU": the GEMMs zcuda's model calls
// (cublasSgemm and its strided batches, their operands rounded to TF32 in
// TF32 math mode, and cublasGemmStridedBatchedEx on bf16 or f16 operands
// with f32 results), column-major as cuBLAS defines them:
// C = alpha·op(A)·op(B) + beta·C. Each product is summed over k in order
// in f32 (16-bit operands widened first: their products are exact in f32,
// as on tensor cores); cuBLAS sums in its own order, so results agree
// with a GPU's to f32 rounding, which is what zcuda's GPU tests allow.
// Streams are synchronous (driver.cpp): a call is done when it returns.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <vector>

typedef int cublasStatus_t;
typedef struct EmuBlas* cublasHandle_t;
struct EmuBlas {
    int math_mode = 0;
};

namespace {
const cublasStatus_t SUCCESS = 0, NOT_INITIALIZED = 1, INVALID_VALUE = 7, NOT_SUPPORTED = 15;
const int OP_N = 0, OP_T = 1;
const int R_32F = 0, R_16F = 2, R_16BF = 14;
const int COMPUTE_32F = 68, COMPUTE_32F_FAST_TF32 = 77;

const int TF32_TENSOR_OP_MATH = 3;

// TF32's operand rounding (cvt.rna.tf32.f32: 10 mantissa bits, to nearest,
// ties away from zero), which cuBLAS applies in TF32 math mode.
float round_tf32(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7f800000u) != 0x7f800000u) bits = (bits + 0x1000u) & 0xffffe000u;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}

float widen_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

float widen_f16(uint16_t h) {
    return (float)std::bit_cast<_Float16>(h);
}

// op(X)'s element (row, col) of a column-major X with leading dimension ld.
template <class Load>
float at(Load load, int op, long long ld, long long row, long long col) {
    return op == OP_N ? load(row + col * ld) : load(col + row * ld);
}

// One product: op(A) m×k, op(B) k×n, C m×n (f32). Each column of C is
// summed as Σ_p op(A)(:, p)·op(B)(p, j) in p order, op(A) first laid out
// column by column so that the inner loop is contiguous.
template <class LoadA, class LoadB>
void gemm_one(int ta, int tb, int m, int n, int k, float alpha, LoadA a, long long lda, LoadB b,
              long long ldb, float beta, float* c, long long ldc) {
    std::vector<float> opa((size_t)m * k), sum((size_t)m);
    for (long long p = 0; p < k; p++)
        for (long long i = 0; i < m; i++) opa[p * m + i] = at(a, ta, lda, i, p);
    for (long long j = 0; j < n; j++) {
        std::fill(sum.begin(), sum.end(), 0.0f);
        for (long long p = 0; p < k; p++) {
            float bpj = at(b, tb, ldb, p, j);
            const float* col = &opa[p * m];
            for (long long i = 0; i < m; i++) sum[i] += col[i] * bpj;
        }
        float* cj = c + j * ldc;
        for (long long i = 0; i < m; i++) {
            cj[i] = beta == 0.0f ? alpha * sum[i] : alpha * sum[i] + beta * cj[i];
        }
    }
}

bool shape_ok(int ta, int tb, int m, int n, int k, long long lda, long long ldb, long long ldc) {
    if ((ta != OP_N && ta != OP_T) || (tb != OP_N && tb != OP_T)) return false;
    if (m < 0 || n < 0 || k < 0) return false;
    long long a_rows = ta == OP_N ? m : k, b_rows = tb == OP_N ? k : n;
    return lda >= std::max(1ll, a_rows) && ldb >= std::max(1ll, b_rows) && ldc >= std::max(1, m);
}
}  // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* h) {
    *h = new EmuBlas;
    return SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
    delete h;
    return SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t h, void*) { return h ? SUCCESS : NOT_INITIALIZED; }

cublasStatus_t cublasSetMathMode(cublasHandle_t h, int mode) {
    if (!h) return NOT_INITIALIZED;
    h->math_mode = mode;
    return SUCCESS;
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, int ta, int tb, int m, int n, int k,
                                         const float* alpha, const float* a, int lda,
                                         long long stride_a, const float* b, int ldb,
                                         long long stride_b, const float* beta, float* c, int ldc,
                                         long long stride_c, int count) {
    if (!h) return NOT_INITIALIZED;
    if (!shape_ok(ta, tb, m, n, k, lda, ldb, ldc) || count < 0) return INVALID_VALUE;
    bool tf32 = h->math_mode == TF32_TENSOR_OP_MATH;
    for (int i = 0; i < count; i++) {
        const float* ai = a + i * stride_a;
        const float* bi = b + i * stride_b;
        gemm_one(
            ta, tb, m, n, k, *alpha, [=](long long x) { return tf32 ? round_tf32(ai[x]) : ai[x]; },
            lda, [=](long long x) { return tf32 ? round_tf32(bi[x]) : bi[x]; }, ldb, *beta,
            c + i * stride_c, ldc);
    }
    return SUCCESS;
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t h, int ta, int tb, int m, int n, int k,
                              const float* alpha, const float* a, int lda, const float* b, int ldb,
                              const float* beta, float* c, int ldc) {
    return cublasSgemmStridedBatched(h, ta, tb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc,
                                     0, 1);
}

// bf16 × bf16 or f16 × f16 → f32 with f32 compute, the forms zcuda asks
// for; anything else is refused as unsupported.
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, int ta, int tb, int m, int n, int k,
                                          const void* alpha, const void* a, int a_type, int lda,
                                          long long stride_a, const void* b, int b_type, int ldb,
                                          long long stride_b, const void* beta, void* c,
                                          int c_type, int ldc, long long stride_c, int count,
                                          int compute, int /*algo*/) {
    if (!h) return NOT_INITIALIZED;
    if ((a_type != R_16BF && a_type != R_16F) || b_type != a_type || c_type != R_32F) {
        return NOT_SUPPORTED;
    }
    if (compute != COMPUTE_32F && compute != COMPUTE_32F_FAST_TF32) return NOT_SUPPORTED;
    if (!shape_ok(ta, tb, m, n, k, lda, ldb, ldc) || count < 0) return INVALID_VALUE;
    float (*widen)(uint16_t) = a_type == R_16BF ? widen_bf16 : widen_f16;
    for (int i = 0; i < count; i++) {
        const uint16_t* ai = static_cast<const uint16_t*>(a) + i * stride_a;
        const uint16_t* bi = static_cast<const uint16_t*>(b) + i * stride_b;
        gemm_one(
            ta, tb, m, n, k, *static_cast<const float*>(alpha),
            [ai, widen](long long x) { return widen(ai[x]); }, lda,
            [bi, widen](long long x) { return widen(bi[x]); }, ldb,
            *static_cast<const float*>(beta), static_cast<float*>(c) + i * stride_c, ldc);
    }
    return SUCCESS;
}

}  // extern "C"
