// The GPT-2 and LLaMA blocks' kernels that are not matrix products (those
// run on cuBLAS): the embedding, layer norm and RMSNorm and their backward,
// bias and residual adds, GELU and SwiGLU and their backward, rotary
// positions, the causal softmax of attention and its backward, grouped-query
// attention's key/value heads, cross-entropy, and the column sums that
// parameter gradients need.
//
// These compute the same functions as zrun's CPU model (crates/zmodel) in
// f32, not the same bits: exp, tanh and log come from CUDA's math library
// and sums run in other orders. Each is deterministic, though: every sum in
// a fixed order (a gradient's column sums first per chunk of rows, then
// over the chunks in order; the one atomic counts finished blocks and
// orders no sum), so a GPU run repeats to the bit and
// ZeRO's stages stay bit-identical to each other on the GPU. The CPU model
// is the oracle of the tests (crates/zcuda/src/tests.rs).

#define WARP 32
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024);
// every thread gets the total. `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = blockDim.x / WARP;
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = blockDim.x / WARP;
    v = lane < warps ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

// An output a product reads next: f32 into y[i], or with 16-bit products
// (y16 not null) its bits in format fmt16 (half16.cuh: bf16 or f16, to
// nearest even) into y16[i] instead, written where it is made.
__device__ __forceinline__ void put(float* y, unsigned short* y16, int fmt16, unsigned long long i,
                                    float v) {
    if (y16) {
        y16[i] = round16(v, fmt16);
    } else {
        y[i] = v;
    }
}

// A token's position: row r of [b, t] counted from its sequence's start,
// or, where packed documents are kept apart (first not null: per token,
// where its document begins in its sequence), from its document's.
__device__ __forceinline__ unsigned long long position(const unsigned int* first,
                                                       unsigned long long r, int t) {
    return r % t - (first ? first[r] : 0u);
}

// x[r, c] = wte[tok[r], c] + wpe[position(r), c] (LLaMA: wpe null, no
// positions added); tokens and firsts were checked on the host.
extern "C" __global__ void embed(const unsigned int* tok, const float* wte, const float* wpe,
                                 const unsigned int* first, float* x, unsigned long long n, int t,
                                 int d)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n * d; i += stride) {
        unsigned long long r = i / d, c = i % d;
        float v = wte[(unsigned long long)tok[r] * d + c];
        x[i] = wpe ? v + wpe[position(first, r, t) * d + c] : v;
    }
}

// The embedding's backward, token part: for the present token j (block j),
// dwte[token, c] = the sum of dx[r, c] over its rows r, added in row order
// from zero (rows[start[j] .. start[j + 1]], listed in order by the host) —
// the CPU's scatter-add, the same bits, without atomics. With documents
// kept apart, the position part too (positions for tokens, dwpe for dwte).
extern "C" __global__ void embed_backward_tokens(const float* dx, const unsigned int* present,
                                                 const unsigned int* start,
                                                 const unsigned int* rows, float* dwte, int d)
{
    unsigned int tok = present[blockIdx.x];
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (unsigned int i = start[blockIdx.x]; i < start[blockIdx.x + 1]; i++) {
            acc = __fadd_rn(acc, dx[(unsigned long long)rows[i] * d + c]);
        }
        dwte[(unsigned long long)tok * d + c] = acc;
    }
}

// The position part: dwpe[p, c] = the sum over sequences s of dx[s, p, c],
// in sequence order from zero (the CPU's order); without documents kept
// apart, where position p is row p of every sequence.
extern "C" __global__ void embed_backward_positions(const float* dx, float* dwpe, int b, int t,
                                                    int d)
{
    unsigned long long n = (unsigned long long)t * d;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        float acc = 0.0f;
        for (int s = 0; s < b; s++) acc = __fadd_rn(acc, dx[(unsigned long long)s * n + i]);
        dwpe[i] = acc;
    }
}

// One block per row: y = (x - mean) * rstd * w + b (or its 16-bit value in
// y16, see put), keeping mean and rstd for the backward. Variance in two
// passes, as the CPU's.
extern "C" __global__ void layer_norm(const float* x, const float* w, const float* b,
                                      float* y, unsigned short* y16, int fmt16,
                                      float* mean_out, float* rstd_out, int d, float eps)
{
    __shared__ float scratch[WARP];
    const float* row = x + (unsigned long long)blockIdx.x * d;
    unsigned long long out = (unsigned long long)blockIdx.x * d;
    float s = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) s += row[c];
    float mean = block_sum(s, scratch) / d;
    float q = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float v = row[c] - mean;
        q += v * v;
    }
    float var = block_sum(q, scratch) / d;
    float rstd = 1.0f / sqrtf(var + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        put(y, y16, fmt16, out + c, (row[c] - mean) * rstd * w[c] + b[c]);
    }
    if (threadIdx.x == 0) {
        mean_out[blockIdx.x] = mean;
        rstd_out[blockIdx.x] = rstd;
    }
}

// One block per row: dx = rstd * (w·dy - mean(w·dy) - x̂ · mean(w·dy · x̂)),
// plus the residual's gradient `dres` where there is one (may be null).
extern "C" __global__ void layer_norm_backward(const float* x, const float* w,
                                               const float* mean, const float* rstd,
                                               const float* dy, const float* dres,
                                               float* dx, int d)
{
    __shared__ float scratch[WARP];
    unsigned long long off = (unsigned long long)blockIdx.x * d;
    float mu = mean[blockIdx.x], rs = rstd[blockIdx.x];
    float sg = 0.0f, sgx = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float g = w[c] * dy[off + c];
        sg += g;
        sgx += g * (x[off + c] - mu) * rs;
    }
    float mg = block_sum(sg, scratch) / d;
    float mgx = block_sum(sgx, scratch) / d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float xh = (x[off + c] - mu) * rs;
        float v = rs * (w[c] * dy[off + c] - mg - xh * mgx);
        dx[off + c] = dres ? v + dres[off + c] : v;
    }
}

// Loads a column sum issues before adding them (in order, so the same sum):
// one load an add left each thread waiting on memory's latency row by row,
// with too few threads to hide it where the width is 1024 (an H200, 152M
// bf16 step: the bias gradients' 146 calls 1.68 -> 1.42 ms).
#define IN_FLIGHT 8

// Σ a[r·width + c] over rows [r0, r1), in row order; `cg` reads past the
// SM's own cache (values other blocks of this launch wrote). With `a16`,
// each value read is also written there rounded to the 16-bit format
// (a bias gradient's pass that rounds the output gradient for 16-bit
// products as it sums: one read of it instead of two).
__device__ __forceinline__ float column_sum(const float* a, int r0, int r1, int width, int c,
                                            bool cg, unsigned short* a16 = nullptr,
                                            int fmt16 = 0)
{
    float s = 0.0f;
    int r = r0;
    for (; r + IN_FLIGHT <= r1; r += IN_FLIGHT) {
        float v[IN_FLIGHT];
#pragma unroll
        for (int j = 0; j < IN_FLIGHT; j++) {
            const float* at = &a[(unsigned long long)(r + j) * width + c];
            v[j] = cg ? __ldcg(at) : *at;
        }
        if (a16) {
#pragma unroll
            for (int j = 0; j < IN_FLIGHT; j++)
                a16[(unsigned long long)(r + j) * width + c] = round16(v[j], fmt16);
        }
#pragma unroll
        for (int j = 0; j < IN_FLIGHT; j++) s += v[j];
    }
    for (; r < r1; r++) {
        const float* at = &a[(unsigned long long)r * width + c];
        float v = cg ? __ldcg(at) : *at;
        if (a16) a16[(unsigned long long)r * width + c] = round16(v, fmt16);
        s += v;
    }
    return s;
}

// The column kernels' second part in the same launch: true in the last of
// a column stripe's blocks (blockIdx.x; its blocks blockIdx.y take chunks
// of rows) to finish its chunk's parts, once every chunk's parts are
// visible to it; that block then adds the chunks' parts in chunk order.
// done[blockIdx.x] counts the stripe's finished blocks; the last sets it
// back to 0 for the next launch. (Two launches, chunks then their sums,
// cost ~4 µs of GPU time each on an H200 whatever their size: 146 of
// them a 152M step.) Every thread of the block must call it.
__device__ bool last_of_stripe(unsigned int* done)
{
    __shared__ unsigned int finished;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        finished = atomicAdd(&done[blockIdx.x], 1u);
        if (finished == gridDim.y - 1) done[blockIdx.x] = 0;
    }
    __syncthreads();
    return finished == gridDim.y - 1;
}

// Layer norm's parameter gradients: for rows [chunk·rows_per,
// (chunk+1)·rows_per) of blockIdx.y's chunk, one thread per column adds
// dy·x̂ and dy down the rows in order into the parts; the stripe's last
// block adds the chunks' parts in order into dw and db.
extern "C" __global__ void layer_norm_param_partials(const float* x, const float* mean,
                                                     const float* rstd, const float* dy,
                                                     float* dw_part, float* db_part, float* dw,
                                                     float* db, unsigned int* done, int n, int d,
                                                     int rows_per)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < d) {
        int r0 = blockIdx.y * rows_per, r1 = min(n, r0 + rows_per);
        float sw = 0.0f, sb = 0.0f;
        for (int r = r0; r < r1; r++) {
            unsigned long long i = (unsigned long long)r * d + c;
            float g = dy[i];
            sw += g * (x[i] - mean[r]) * rstd[r];
            sb += g;
        }
        dw_part[(unsigned long long)blockIdx.y * d + c] = sw;
        db_part[(unsigned long long)blockIdx.y * d + c] = sb;
    }
    if (last_of_stripe(done) && c < d) {
        dw[c] = column_sum(dw_part, 0, gridDim.y, d, c, true);
        db[c] = column_sum(db_part, 0, gridDim.y, d, c, true);
    }
}

// LLaMA's RMSNorm, one block per row: y = x · r · w (or its 16-bit value in
// y16, see put) with r = 1/sqrt(mean(x²) + eps), keeping r for the backward.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* y, unsigned short* y16,
                                    int fmt16, float* rstd_out, int d, float eps)
{
    __shared__ float scratch[WARP];
    const float* row = x + (unsigned long long)blockIdx.x * d;
    unsigned long long out = (unsigned long long)blockIdx.x * d;
    float q = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) q += row[c] * row[c];
    float r = 1.0f / sqrtf(block_sum(q, scratch) / d + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) put(y, y16, fmt16, out + c, row[c] * r * w[c]);
    if (threadIdx.x == 0) rstd_out[blockIdx.x] = r;
}

// One block per row: dx = r · (g − x̂ · mean(g · x̂)) with g = dy · w and x̂ =
// x · r, plus the residual's gradient `dres` where there is one (may be null).
extern "C" __global__ void rms_norm_backward(const float* x, const float* w, const float* rstd,
                                             const float* dy, const float* dres, float* dx,
                                             int d)
{
    __shared__ float scratch[WARP];
    unsigned long long off = (unsigned long long)blockIdx.x * d;
    float r = rstd[blockIdx.x];
    float sgx = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) sgx += dy[off + c] * w[c] * (x[off + c] * r);
    float mgx = block_sum(sgx, scratch) / d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float v = r * (dy[off + c] * w[c] - x[off + c] * r * mgx);
        dx[off + c] = dres ? v + dres[off + c] : v;
    }
}

// RMSNorm's weight gradient: for the rows of blockIdx.y's chunk, one thread
// per column adds dy · x̂ down the rows in order into the part; the
// stripe's last block adds the chunks' parts in order into dw.
extern "C" __global__ void rms_norm_param_partials(const float* x, const float* rstd,
                                                   const float* dy, float* dw_part, float* dw,
                                                   unsigned int* done, int n, int d,
                                                   int rows_per)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < d) {
        int r0 = blockIdx.y * rows_per, r1 = min(n, r0 + rows_per);
        float sw = 0.0f;
        for (int r = r0; r < r1; r++) {
            unsigned long long i = (unsigned long long)r * d + c;
            sw += dy[i] * (x[i] * rstd[r]);
        }
        dw_part[(unsigned long long)blockIdx.y * d + c] = sw;
    }
    if (last_of_stripe(done) && c < d) dw[c] = column_sum(dw_part, 0, gridDim.y, d, c, true);
}

// out[c] = Σ_r a[r, c] over `rows` rows of `width` (a bias gradient):
// blockIdx.y sums its chunk of rows_per rows in row order into
// part[chunk, c], and the stripe's last block adds the chunks' parts in
// chunk order into out. With `a16` (else null) every value of `a` is also
// written there rounded to format `fmt16`, round16_into's bits.
extern "C" __global__ void column_sums(const float* a, unsigned short* a16, int fmt16,
                                       float* part, float* out, unsigned int* done, int rows,
                                       int width, int rows_per)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < width) {
        int r0 = blockIdx.y * rows_per, r1 = min(rows, r0 + rows_per);
        part[(unsigned long long)blockIdx.y * width + c] =
            column_sum(a, r0, r1, width, c, false, a16, fmt16);
    }
    if (last_of_stripe(done) && c < width) out[c] = column_sum(part, 0, gridDim.y, width, c, true);
}

// y = dropout(y [+ b]) [+ res], per row of `width` (b null: LLaMA's
// linears have no bias; the mask as dropped's, none with threshold 0): a
// linear's bias and a block's residual add, its branch dropped first.
extern "C" __global__ void bias_residual(float* y, const float* b, const float* res,
                                         unsigned long long n, int width, unsigned threshold,
                                         float scale, unsigned key)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n * width; i += stride) {
        float v = b ? y[i] + b[i % width] : y[i];
        v = dropped(v, i, threshold, scale, key);
        y[i] = res ? __fadd_rn(res[i], v) : v;
    }
}

// y = dropout(x + noise), element by element (x null: in place on y): NEFTune's noise
// where mag > 0 (a uniform draw from [-mag, mag), 24 bits of the hash under
// noise_key: zmodel's Noise), then the mask (a threshold of 0: none). The
// embeddings' output in training, and a dropped output's gradient (mag 0).
extern "C" __global__ void dropout_noise(const float* x, float* y, unsigned long long n,
                                         unsigned threshold, float scale, unsigned key,
                                         float mag, unsigned noise_key)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float v = x ? x[i] : y[i];
        if (mag > 0.0f) {
            float unit = __fmul_rn((float)(mask_hash(noise_key, i) >> 8), 1.0f / 16777216.0f);
            v = __fadd_rn(v, __fmul_rn(__fadd_rn(2.0f * unit, -1.0f), mag));
        }
        y[i] = dropped(v, i, threshold, scale, key);
    }
}

// Where value i of a head-major [b·heads, t, hd] operand sits in rows of
// `ld` values whose columns col0 + h·hd + c hold head h.
__device__ __forceinline__ unsigned long long row_index(unsigned long long i, int ld, int col0,
                                                       int t, int h, int hd)
{
    unsigned long long c = i % hd, r = i / hd;
    unsigned long long tt = r % t, sh = r / t;
    unsigned long long hh = sh % h, s = sh / h;
    return (s * t + tt) * ld + col0 + hh * hd + c;
}

// heads[s, h, t, c] = rows[s, t, col0 + h·hd + c]: one attention operand (q,
// k or v, or dO) as [b·heads, t, hd], each head's rows contiguous, so that
// every head of every sequence is one batch entry of a single strided cuBLAS
// call.
extern "C" __global__ void rows_to_heads(const float* rows, int ld, int col0, float* heads,
                                         int b, int t, int h, int hd)
{
    unsigned long long n = (unsigned long long)b * t * h * hd;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        heads[i] = rows[row_index(i, ld, col0, t, h, hd)];
    }
}

// The inverse: rows[s, t, col0 + h·hd + c] = heads[s, h, t, c].
extern "C" __global__ void heads_to_rows(const float* heads, float* rows, int ld, int col0,
                                         int b, int t, int h, int hd)
{
    unsigned long long n = (unsigned long long)b * t * h * hd;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        rows[row_index(i, ld, col0, t, h, hd)] = heads[i];
    }
}

// Grouped-query attention's keys or values for every query head:
// heads[s, h, t, c] = rows[s, t, col0 + (h / group)·hd + c], each of the
// `group` query heads of a key/value head reading that head's columns.
extern "C" __global__ void kv_rows_to_heads(const float* rows, int ld, int col0, float* heads,
                                            int b, int t, int h, int hd, int group)
{
    unsigned long long n = (unsigned long long)b * t * h * hd;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        unsigned long long c = i % hd, r = i / hd;
        unsigned long long tt = r % t, sh = r / t;
        unsigned long long hh = sh % h, s = sh / h;
        heads[i] = rows[(s * t + tt) * ld + col0 + (hh / group) * hd + c];
    }
}

// Its backward: rows[s, t, col0 + k·hd + c] = the sum over the group's query
// heads j = k·group .. k·group + group − 1, in that order from zero, of
// heads[s, j, t, c] (h/group key/value heads).
extern "C" __global__ void heads_to_kv_rows(const float* heads, float* rows, int ld, int col0,
                                            int b, int t, int h, int hd, int group)
{
    int kv = h / group;
    unsigned long long n = (unsigned long long)b * t * kv * hd;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        unsigned long long c = i % hd, r = i / hd;
        unsigned long long k = r % kv, st = r / kv;
        unsigned long long tt = st % t, s = st / t;
        float acc = 0.0f;
        for (int j = 0; j < group; j++) {
            unsigned long long head = s * h + k * group + j;
            acc = __fadd_rn(acc, heads[(head * t + tt) * hd + c]);
        }
        rows[(s * t + tt) * ld + col0 + k * hd + c] = acc;
    }
}

// LLaMA's rotary positions in place on rows of `ld` values (q's and k's
// `heads` heads of hd from column 0; v's columns untouched), Hugging Face's
// layout: in each head the pair (i, i + half) at position p = position(first,
// row, t) turns by the angle whose cosine and sine are cos[p, i], sin[p, i]
// (a table [t, half] the host computes in f64, as the CPU model does), times
// `sign` for the sine: −1 turns back, which is the backward. `half` is hd / 2,
// or less where only a head's first 2·half columns turn (Phi-4-mini's
// partial rotation; the others stay).
extern "C" __global__ void rope(float* x, const float* cos_t, const float* sin_t,
                                const unsigned int* first, unsigned long long rows, int ld,
                                int heads, int hd, int half, int t, float sign)
{
    unsigned long long n = rows * heads * half;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        unsigned long long k = i % half, rh = i / half;
        unsigned long long hh = rh % heads, r = rh / heads;
        unsigned long long p = position(first, r, t);
        float c = cos_t[p * half + k], s = sign * sin_t[p * half + k];
        float* head = x + r * ld + hh * hd;
        float a = head[k], b = head[k + half];
        head[k] = a * c - b * s;
        head[k + half] = b * c + a * s;
    }
}

#define GELU_K 0.7978845608f
#define GELU_C 0.044715f

// GPT-2's GELU, tanh form: 0.5·v·(1 + tanh(k·(v + c·v³))) (or its 16-bit
// value in g16, see put) of v = h + b, b the MLP's first bias over rows of
// `width` (null: none), added here and in the backward as bias_residual
// adds it (the same v), not in a pass of its own over the layer's widest
// output (read and written: 1.6 GB a 152M step).
extern "C" __global__ void gelu(const float* h, const float* b, int width, float* g,
                                unsigned short* g16, int fmt16, unsigned long long n)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        float v = b ? h[i] + b[i % width] : h[i];
        put(g, g16, fmt16, i, 0.5f * v * (1.0f + tanhf(GELU_K * (v + GELU_C * v * v * v))));
    }
}

extern "C" __global__ void gelu_backward(const float* h, const float* b, int width,
                                         const float* dg, float* dh, unsigned long long n)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        float v = b ? h[i] + b[i % width] : h[i];
        float th = tanhf(GELU_K * (v + GELU_C * v * v * v));
        float dudv = GELU_K * (1.0f + 3.0f * GELU_C * v * v);
        dh[i] = dg[i] * (0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * dudv);
    }
}

// LLaMA's SwiGLU on h [n, 2f] holding gate and up side by side: y[r, c] =
// silu(gate) · up, silu(v) = v · σ(v) (or its 16-bit value in y16, see put).
extern "C" __global__ void swiglu(const float* h, float* y, unsigned short* y16, int fmt16,
                                  unsigned long long n, int f)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n * f; i += stride) {
        unsigned long long r = i / f, c = i % f;
        float g = h[r * 2 * f + c], u = h[r * 2 * f + f + c];
        float s = 1.0f / (1.0f + expf(-g));
        put(y, y16, fmt16, i, g * s * u);
    }
}

// Its backward: dh [n, 2f] from h and dy [n, f]: dgate = dy · up · (σ +
// silu · (1 − σ)), dup = dy · silu.
extern "C" __global__ void swiglu_backward(const float* h, const float* dy, float* dh,
                                           unsigned long long n, int f)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n * f; i += stride) {
        unsigned long long r = i / f, c = i % f;
        float g = h[r * 2 * f + c], u = h[r * 2 * f + f + c];
        float s = 1.0f / (1.0f + expf(-g));
        float silu = g * s;
        dh[r * 2 * f + c] = dy[i] * u * (s + silu * (1.0f - s));
        dh[r * 2 * f + f + c] = dy[i] * silu;
    }
}

// The first key that row `row` of [b·heads, t] scores (each row i of a
// t × t matrix, i = row % t) sees: 0, or where packed documents are kept
// apart (first not null: per token of [b, t], where its document begins),
// the first of its own document.
__device__ __forceinline__ int first_key(const unsigned int* first, unsigned long long row, int t,
                                         int heads) {
    return first ? (int)first[row / ((unsigned long long)t * heads) * t + row % t] : 0;
}

// Causal softmax of scores s[rows, t] (each row i of a t × t matrix, i =
// row % t, of `heads` heads a sequence), in place: p[j] = exp(scale·s[j] -
// m) / Σ for first_key ≤ j ≤ i, 0 elsewhere; with s16, each probability's
// 16-bit value (fmt16) there too, dropped first by the mask (threshold,
// dscale, key; attention's dropout, element row·t + j; a threshold of 0:
// none), which is what the products read, while s keeps the undropped
// probabilities the backward needs. One warp per row.
extern "C" __global__ void causal_softmax(float* s, unsigned short* s16, int fmt16,
                                          const unsigned int* first, unsigned long long rows, int t,
                                          int heads, float scale, unsigned threshold, float dscale,
                                          unsigned key)
{
    unsigned long long row = (unsigned long long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (row >= rows) return;
    int lane = threadIdx.x % WARP, i = (int)(row % t), lo = first_key(first, row, t, heads);
    float* p = s + row * t;
    float m = NEG_INF;
    for (int j = lo + lane; j <= i; j += WARP) m = fmaxf(m, p[j] * scale);
    m = warp_max(m);
    float sum = 0.0f;
    for (int j = lo + lane; j <= i; j += WARP) {
        float e = expf(p[j] * scale - m);
        p[j] = e;
        sum += e;
    }
    sum = warp_sum(sum);
    float inv = 1.0f / sum;
    for (int j = lane; j < t; j += WARP) {
        float v = lo <= j && j <= i ? p[j] * inv : 0.0f;
        p[j] = v;
        if (s16) s16[row * t + j] = round16(dropped(v, row * t + j, threshold, dscale, key), fmt16);
    }
}

// The softmax's backward, in place on dp: ds = scale · p ⊙ (dp - Σ dp ⊙ p),
// 0 where the forward's p is (first as there); with ds16, ds's 16-bit
// value (fmt16) written there instead (dp is then left as it was). One warp
// per row.
extern "C" __global__ void causal_softmax_backward(const float* p, float* dp, unsigned short* ds16,
                                                   int fmt16, const unsigned int* first,
                                                   unsigned long long rows, int t, int heads,
                                                   float scale)
{
    unsigned long long row = (unsigned long long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (row >= rows) return;
    int lane = threadIdx.x % WARP, i = (int)(row % t), lo = first_key(first, row, t, heads);
    const float* pr = p + row * t;
    float* g = dp + row * t;
    float dot = 0.0f;
    for (int j = lo + lane; j <= i; j += WARP) dot += g[j] * pr[j];
    dot = warp_sum(dot);
    for (int j = lane; j < t; j += WARP) {
        float v = lo <= j && j <= i ? scale * pr[j] * (g[j] - dot) : 0.0f;
        if (ds16) {
            ds16[row * t + j] = round16(v, fmt16);
        } else {
            g[j] = v;
        }
    }
}

// One block per row of logits [rows, vocab]: loss[r] = log Σ exp(x - max) -
// (x_target - max); with `grad`, the row becomes coef·(softmax - onehot), the
// gradient of the loss summed over the rows and divided by the divisor,
// times the loss scale (coef = scale / divisor: rows, for the mean). With
// label smoothing ε > 0 (transformers' LabelSmoother, as zmodel's head):
// loss[r] = (1 - ε)·that + ε·(log Σ exp(x - max) - mean(x - max)), the mean
// over the vocabulary of -log p, and the gradient coef·(softmax - (1 -
// ε)·onehot - ε/vocab). With
// g16 too, that gradient's 16-bit values (fmt16) are written there instead
// (the logits are then left as they were): the head's 16-bit products read
// them, and no pass rounds them. A row whose target is IGNORED (a loss
// mask's) has loss 0 and a zero gradient.
#define IGNORED 0xFFFFFFFFu
extern "C" __global__ void cross_entropy(float* logits, const unsigned int* targets,
                                         float* loss, unsigned short* g16, int fmt16,
                                         int vocab, float coef, float smoothing, int grad)
{
    __shared__ float scratch[WARP];
    float* x = logits + (unsigned long long)blockIdx.x * vocab;
    unsigned int tgt = targets[blockIdx.x];
    if (tgt == IGNORED) {  // the whole block's row: no thread waits on another
        if (threadIdx.x == 0) loss[blockIdx.x] = 0.0f;
        if (!grad) return;
        unsigned short* y16 = g16 ? g16 + (unsigned long long)blockIdx.x * vocab : 0;
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            if (y16) {
                y16[j] = round16(0.0f, fmt16);
            } else {
                x[j] = 0.0f;
            }
        }
        return;
    }
    float m = NEG_INF;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, x[j]);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) s += expf(x[j] - m);
    s = block_sum(s, scratch);
    float picked = x[tgt] - m;
    float nll = logf(s) - picked, uniform = 0.0f, picked_coef = coef;
    if (smoothing > 0.0f) {
        float sx = 0.0f;
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) sx += x[j];
        float mean = block_sum(sx, scratch) / vocab - m;
        nll = (1.0f - smoothing) * nll + smoothing * (logf(s) - mean);
        uniform = coef * smoothing / vocab;
        picked_coef = coef * (1.0f - smoothing);
    }
    __syncthreads();
    if (threadIdx.x == 0) loss[blockIdx.x] = nll;
    if (!grad) return;
    float inv = coef / s;
    unsigned short* y16 = g16 ? g16 + (unsigned long long)blockIdx.x * vocab : 0;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float p = expf(x[j] - m) * inv - uniform;
        float v = j == (int)tgt ? p - picked_coef : p;
        if (y16) {
            y16[j] = round16(v, fmt16);
        } else {
            x[j] = v;
        }
    }
}
