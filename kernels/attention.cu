// Causal attention fused into three kernels for the tensor cores' products
// (put after half16.cuh): the forward and the two halves of its backward,
// each reading q, k and v straight from the qkv projection's rows and never
// writing the t × t probabilities, in the manner of FlashAttention-2 (Dao,
// 2023). Three kinds of products, as the model multiplies: bf16 and f16
// (16-bit products: mma.sync m16n8k16) and TF32 (`train.allow_tf32`:
// m16n8k8).
//
// Why: the unfused attention (gpt.cu's softmax between cuBLAS products)
// writes and reads the [b·heads, t, t] scores, their probabilities and their
// gradients several times a layer and multiplies the whole square; here each
// block keeps a tile of 64 query rows in registers, walks the key tiles up
// to the diagonal only (the masked triangle is never multiplied) and keeps a
// running maximum and sum per row (the online softmax), so memory traffic is
// the inputs and outputs alone.
//
// Products run on the tensor cores through mma.sync (f32 sums; compute
// capability 8.0 and newer): each warp owns 16 rows. Operands are rounded to
// bf16, f16 or TF32 as they are loaded, as the unfused path's products round
// them; the probabilities and their gradient are rounded so as the operands
// of the second products, the running sums stay f32. A product's result
// fragment becomes the next product's operand fragment in registers: for
// 16 bits a pair of result columns is a pair of operand columns; for TF32 the
// depth index is permuted instead (operand column q is result column 2q,
// q + 4 is 2q + 1), and the other operand's rows are read in that order.
// No atomics: the backward's two kernels each own what they write (one the
// keys' and values' gradients, summed over a grouped-query group's heads in
// order; the other the queries'), so a run repeats to the bit.
//
// Packed documents kept apart (`data.separate_documents`): with `first` (per
// token of [b, t], where its document begins in its sequence; else null) a
// query row i sees keys first[i] ..= i. Documents are contiguous, so first
// never falls along a sequence: a block's (or warp's) first row has the
// least first of its rows, and the walks start at its tile instead of key
// 0; the key/value kernel stops at the first query tile whose rows all
// begin after the block's last key. A row that sees no key of a tile has a
// running maximum of −∞ there, which the online softmax steps over (its
// corrections would be exp(−∞ + ∞)).
//
// Attention's dropout (`model.attention_dropout`), in the `_dropout`
// kernels: the forward sums the undropped terms into each row's softmax
// denominator and multiplies V by the dropped ones (dropout.cuh's mask of
// element ((b·heads + h)·t + i)·t + j, gpt.cu's causal_softmax's, so the
// same probabilities drop as on the unfused path and the CPU); the backward
// drops dP = dO·Vᵀ by the same mask before dS = P ⊙ (dP − delta) and
// multiplies dO by the dropped P for dV. delta = Σ out ⊙ dout is Σ P ⊙ dP
// unchanged (out is the dropped P's product). The kernels without dropout
// are instances of the same templates with it compiled out, so their
// registers and machine code stay what they were.
//
// crates/zcuda-emu runs these on the CPU (mma.sync emulated from PTX's
// fragment layouts) against an f64 reference.

#define FA_WARP 32
#define FA_ROWS 64    // query rows (or keys) of a block: 4 warps × 16
#define FA_THREADS 128
#define FA_NEG_INF __int_as_float(0xff800000)

// Keys (or query rows) per tile walked: 64 up to head width 64; at 128,
// 32 for the forward and the query kernel and 16 for the key/value kernel
// (which holds two accumulators), so that the walk's fragments fit beside
// the accumulators (twice as wide there) in 255 registers. Either way a
// 16-row warp that sees any key of a tile sees the tile's first.
template <int HD>
struct FaWalk {
    static constexpr int KEYS = HD <= 64 ? 64 : 32;
    static constexpr int KV_KEYS = HD <= 64 ? 64 : 16;
};

// The parts a tile's fetch is split into (load_tiles): one, or at head
// width 128 two where a part would hold more than four 16-byte pieces a
// thread, so that the fetch's registers fit beside the accumulators too.
template <int HD, int KT>
struct FaFetch {
    static constexpr int PARTS = HD > 64 && KT * HD / 4 / FA_THREADS > 4 ? 2 : 1;
};

// Two values rounded to 16 bits (format fmt) in one register, the first in
// the low half (the lower-indexed element of an mma fragment's pair).
__device__ __forceinline__ unsigned pack16(float lo, float hi, int fmt) {
    return (unsigned)round16(lo, fmt) | ((unsigned)round16(hi, fmt) << 16);
}

// Two adjacent 16-bit values of shared memory (4-byte aligned) in one register.
__device__ __forceinline__ unsigned load_pair(const unsigned short* p) {
#ifdef ZRUN_CPU_EMULATION
    unsigned v;
    std::memcpy(&v, p, sizeof v);
    return v;
#else
    return *(const unsigned*)p;
#endif
}

// Two 16-bit values of shared memory at `p` and `p + stride` in one register.
__device__ __forceinline__ unsigned pair16(const unsigned short* p, int stride) {
    return (unsigned)p[0] | ((unsigned)p[stride] << 16);
}

// Four adjacent f32 of global memory (16-byte aligned) in one load.
struct Quad {
    float x, y, z, w;
};

__device__ __forceinline__ Quad load_quad(const float* p) {
#ifdef ZRUN_CPU_EMULATION
    Quad v;
    std::memcpy(&v, p, sizeof v);
    return v;
#else
    float4 v = *(const float4*)p;
    return Quad{v.x, v.y, v.z, v.w};
#endif
}

// Two 32-bit words to shared memory (8-byte aligned) in one store, and four
// (16-byte aligned).
__device__ __forceinline__ void store_words(void* p, unsigned a, unsigned b) {
#ifdef ZRUN_CPU_EMULATION
    unsigned v[2] = {a, b};
    std::memcpy(p, v, sizeof v);
#else
    *(uint2*)p = make_uint2(a, b);
#endif
}

__device__ __forceinline__ void store_words(void* p, unsigned a, unsigned b, unsigned c, unsigned d) {
#ifdef ZRUN_CPU_EMULATION
    unsigned v[4] = {a, b, c, d};
    std::memcpy(p, v, sizeof v);
#else
    *(uint4*)p = make_uint4(a, b, c, d);
#endif
}

// f32 rounded to TF32 (10 significand bits; to nearest, ties away from
// zero, as cvt.rna.tf32.f32) as f32 bits; infinities and NaN as they are.
__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned b = __float_as_uint(x);
    if ((b & 0x7f800000u) == 0x7f800000u) return b;
    return (b + 0x1000u) & 0xffffe000u;
}

#ifndef ZRUN_CPU_EMULATION
// c += a · b on the tensor cores, one warp's mma.sync of the form given,
// accumulating in place (before compute capability 8.0, which has neither
// form, a trap: GptGpu refuses fused attention there).
#if __CUDA_ARCH__ >= 800
#define FA_MMA(form)                                                           \
    asm volatile("mma.sync.aligned." form                                      \
                 " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"    \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])              \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
#else
#define FA_MMA(form) __trap()
#endif

// a 16×16 bf16 (row), b 16×8 bf16 (col), c 16×8 f32, in PTX's fragment
// layout for lane l, g = l / 4, q = l % 4: a[r] holds row g + 8·(r % 2),
// columns 2q, 2q+1 (+ 8 for r ≥ 2); b0 rows 2q, 2q+1 and b1 rows 2q+8,
// 2q+9 of column g; c[r] row g + 8·(r / 2), column 2q + r % 2. (The CPU
// emulation brings its own.)
__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    FA_MMA("m16n8k16.row.col.f32.bf16.bf16.f32");
}

// The same for f16 (the same fragment layout).
__device__ __forceinline__ void mma_f16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    FA_MMA("m16n8k16.row.col.f32.f16.f16.f32");
}

// The same for TF32, m16n8k8: a[r] holds row g + 8·(r % 2), column q (+ 4
// for r ≥ 2); b0 row q and b1 row q + 4 of column g; c as above.
__device__ __forceinline__ void mma_tf32(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    FA_MMA("m16n8k8.row.col.f32.tf32.tf32.f32");
}
#endif

// The two kinds of products: their depth K, how shared memory holds a
// tile's values (Elem), and how fragments are made. `q` is the lane's index
// in its group of 4. b_row: the b registers of a depth step whose depth
// runs along a tile row (`row` at the step's first column; the scores'
// Q·Kᵀ). b_keys: those of a step over keys (or query rows) whose depth runs
// down a row-major tile (`col` at the step's first row, rows `stride`
// apart). a_from_c: the a registers of depth step ks from a result
// fragment over a tile's keys (NT groups of 8). store4: four rounded
// values of a tile row in one store. Half16<FMT_BF16> and Half16<FMT_F16>:
// the 16-bit kinds.
template <int FMT>
struct Half16 {
    static constexpr int K = 16;
    typedef unsigned short Elem;
    static __device__ __forceinline__ Elem elem(float x) { return round16(x, FMT); }
    // Register r of a row's A fragment at `p` (the step's first column).
    static __device__ __forceinline__ unsigned a_word(const float* p, int r, int q) {
        p += 2 * q + 8 * (r / 2);
        return pack16(p[0], p[1], FMT);
    }
    static __device__ __forceinline__ void b_row(const Elem* row, int q, unsigned& b0, unsigned& b1) {
        b0 = load_pair(row + 2 * q);
        b1 = load_pair(row + 2 * q + 8);
    }
    static __device__ __forceinline__ void b_keys(const Elem* col, int stride, int q, unsigned& b0,
                                                  unsigned& b1) {
        b0 = pair16(col + 2 * q * stride, stride);
        b1 = pair16(col + (2 * q + 8) * stride, stride);
    }
    template <int NT>
    static __device__ __forceinline__ void a_from_c(const float (&p)[NT][4], int ks, unsigned (&a)[4]) {
        a[0] = pack16(p[2 * ks][0], p[2 * ks][1], FMT);
        a[1] = pack16(p[2 * ks][2], p[2 * ks][3], FMT);
        a[2] = pack16(p[2 * ks + 1][0], p[2 * ks + 1][1], FMT);
        a[3] = pack16(p[2 * ks + 1][2], p[2 * ks + 1][3], FMT);
    }
    static __device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
        if (FMT == FMT_BF16) {
            mma_bf16(c, a, b0, b1);
        } else {
            mma_f16(c, a, b0, b1);
        }
    }
    static __device__ __forceinline__ void store4(Elem* p, Quad v) {
        store_words(p, pack16(v.x, v.y, FMT), pack16(v.z, v.w, FMT));
    }
};
typedef Half16<FMT_BF16> Bf16;
typedef Half16<FMT_F16> F16;

struct Tf32 {
    static constexpr int K = 8;
    typedef unsigned Elem;
    static __device__ __forceinline__ Elem elem(float x) { return to_tf32(x); }
    static __device__ __forceinline__ unsigned a_word(const float* p, int r, int q) {
        return to_tf32(p[q + 4 * (r / 2)]);
    }
    static __device__ __forceinline__ void b_row(const Elem* row, int q, unsigned& b0, unsigned& b1) {
        b0 = row[q];
        b1 = row[q + 4];
    }
    // Depth q is result column 2q and q + 4 is 2q + 1 (see a_from_c).
    static __device__ __forceinline__ void b_keys(const Elem* col, int stride, int q, unsigned& b0,
                                                  unsigned& b1) {
        b0 = col[2 * q * stride];
        b1 = col[(2 * q + 1) * stride];
    }
    template <int NT>
    static __device__ __forceinline__ void a_from_c(const float (&p)[NT][4], int ks, unsigned (&a)[4]) {
        a[0] = to_tf32(p[ks][0]);
        a[1] = to_tf32(p[ks][2]);
        a[2] = to_tf32(p[ks][1]);
        a[3] = to_tf32(p[ks][3]);
    }
    static __device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
        mma_tf32(c, a, b0, b1);
    }
    static __device__ __forceinline__ void store4(Elem* p, Quad v) {
        store_words(p, to_tf32(v.x), to_tf32(v.y), to_tf32(v.z), to_tf32(v.w));
    }
};

// Sum and maximum over the 4 lanes that share a fragment row.
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Where things are: qkv rows [b, t, ld] hold the query heads in columns
// 0..d, the key heads from d and the value heads from d + kv·hd (kv
// key/value heads; query head h reads key/value head h / (heads / kv)).
struct FaDrop {
    unsigned threshold;
    float scale;
    unsigned key;
};

struct FaShape {
    int t, heads, kv, ld;
    float scale;
    FaDrop drop;
};

// Whether probability (query, key) of the t × t matrix from `at` (its
// head's first element: head·t·t) is kept by the shape's mask. The offset
// in the matrix is 32-bit (GptGpu keeps t below 2¹⁶ here), so the 64-bit
// sum is one add per element.
__device__ __forceinline__ bool fa_kept(const FaShape& sh, unsigned long long at, int query,
                                        int key) {
    return kept(at + ((unsigned)query * (unsigned)sh.t + (unsigned)key), sh.drop.threshold,
                sh.drop.key);
}

// The first element of head `head`'s t × t probabilities.
__device__ __forceinline__ unsigned long long fa_head_at(const FaShape& sh,
                                                         unsigned long long head) {
    return head * (unsigned)sh.t * (unsigned)sh.t;
}

// A warp's 16 rows × HD of `rows` (rows of `ld` from column `col`, row r0
// first; rows at or past t are zeros) as mma A fragments.
template <class M, int HD>
__device__ __forceinline__ void load_a(unsigned (&a)[HD / M::K][4], const float* rows, int ld,
                                       int col, int r0, int t) {
    int lane = threadIdx.x % FA_WARP, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int kk = 0; kk < HD / M::K; kk++) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int row = r0 + g + 8 * (r % 2);
            a[kk][r] = row < t ? M::a_word(rows + (unsigned long long)row * ld + col + kk * M::K, r, q)
                               : 0u;
        }
    }
}

// A part (FaFetch) of a tile of KT rows × HD f32 from column `col` of
// `rows` (rows of `ld` from r0; rows at or past t zeros), held in a
// block's registers on its way to shared memory: thread i holds the
// 16-byte pieces i, i + FA_THREADS, ... of the part, in row-major order.
// Every load of a part is issued before the first is used (the trip count
// is a constant, so the loop unrolls): one trip to memory a part, not one
// a piece. Needs `rows`, ld and col 16-byte aligned (whole allocations,
// widths of multiples of 16).
template <int HD, int KT>
struct TileLoad {
    static constexpr int N = KT * HD / 4 / FA_THREADS / FaFetch<HD, KT>::PARTS;
    Quad piece[N];
};

template <int HD, int KT>
__device__ __forceinline__ void fetch_tile(TileLoad<HD, KT>& f, const float* rows, int ld, int col,
                                           int r0, int t, int part) {
    constexpr int N = TileLoad<HD, KT>::N;
#pragma unroll
    for (int j = 0; j < N; j++) {
        int i = threadIdx.x + (part * N + j) * FA_THREADS;
        int r = i / (HD / 4), c = i % (HD / 4) * 4;
        f.piece[j] = r0 + r < t ? load_quad(rows + (unsigned long long)(r0 + r) * ld + col + c)
                                : Quad{0.0f, 0.0f, 0.0f, 0.0f};
    }
}

// The fetched tile, rounded, into shared memory, row-major with rows of HD
// + 8 (the padding spreads a fragment's reads over the banks).
template <class M, int HD, int KT>
__device__ __forceinline__ void stash_tile(typename M::Elem* tile, const TileLoad<HD, KT>& f, int part) {
    constexpr int N = TileLoad<HD, KT>::N;
#pragma unroll
    for (int j = 0; j < N; j++) {
        int i = threadIdx.x + (part * N + j) * FA_THREADS;
        int r = i / (HD / 4), c = i % (HD / 4) * 4;
        M::store4(tile + r * (HD + 8) + c, f.piece[j]);
    }
}

// Two tiles of KT rows from memory into shared memory, part by part
// (FaFetch), both tiles' part fetched before either is stored, between the
// barriers that guard them (the first, before the first store: the last
// tiles' readers are done); `also` stores whatever else the block shares
// beside them.
template <class M, int HD, int KT, class Also>
__device__ __forceinline__ void load_tiles(typename M::Elem* a, const float* a_rows, int a_ld,
                                           int a_col, typename M::Elem* b, const float* b_rows,
                                           int b_ld, int b_col, int r0, int t, Also also) {
    TileLoad<HD, KT> fa, fb;
#pragma unroll
    for (int part = 0; part < FaFetch<HD, KT>::PARTS; part++) {
        fetch_tile<HD, KT>(fa, a_rows, a_ld, a_col, r0, t, part);
        fetch_tile<HD, KT>(fb, b_rows, b_ld, b_col, r0, t, part);
        if (part == 0) __syncthreads();
        stash_tile<M, HD, KT>(a, fa, part);
        stash_tile<M, HD, KT>(b, fb, part);
    }
    also();
    __syncthreads();
}

// s = a · tileᵀ for a warp's 16 rows against the tile's NT·8 rows (tile
// row-major, rows of HD + 8). Every column is multiplied, masked ones too
// (the callers mask): the 8 column groups are then independent products
// the tensor cores overlap, where skipping some would branch between them.
template <class M, int HD, int NT>
__device__ __forceinline__ void scores(float (&s)[NT][4],
                                       const unsigned (&a)[HD / M::K][4],
                                       const typename M::Elem* tile) {
    int lane = threadIdx.x % FA_WARP, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int r = 0; r < 4; r++) s[nt][r] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < HD / M::K; kk++) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            unsigned b0, b1;
            M::b_row(tile + (nt * 8 + g) * (HD + 8) + kk * M::K, q, b0, b1);
            M::mma(s[nt], a[kk], b0, b1);
        }
    }
}

// acc += p · tile for p, 16 rows × the tile's keys in the C layout of
// `scores` (rounded here as the product's operand), against the tile's rows
// × HD (row-major, rows of HD + 8). Depth steps at or past `span` are
// skipped (p is 0 there).
template <class M, int HD, int NT>
__device__ __forceinline__ void times_tile(float (&acc)[HD / 8][4],
                                           const float (&p)[NT][4],
                                           const typename M::Elem* tile, int span) {
    int lane = threadIdx.x % FA_WARP, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int ks = 0; ks < NT * 8 / M::K; ks++) {
        if (ks * M::K >= span) continue;
        unsigned a[4];
        M::a_from_c(p, ks, a);
#pragma unroll
        for (int nt = 0; nt < HD / 8; nt++) {
            unsigned b0, b1;
            M::b_keys(tile + ks * M::K * (HD + 8) + nt * 8 + g, HD + 8, q, b0, b1);
            M::mma(acc[nt], a, b0, b1);
        }
    }
}

// A warp's 16 rows × HD accumulator (C layout, times `mul`) into columns
// col.. of rows r0.. of `out` (rows of ld; rows at or past t skipped), and
// with `out16` (else null) each value rounded to format `fmt16` at the
// same place there.
template <int HD>
__device__ __forceinline__ void store_rows(float* out, int ld, int col, int r0, int t,
                                           const float (&acc)[HD / 8][4], float mul_lo, float mul_hi,
                                           unsigned short* out16 = nullptr, int fmt16 = 0) {
    int lane = threadIdx.x % FA_WARP, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int nt = 0; nt < HD / 8; nt++) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int row = r0 + g + 8 * (r / 2);
            if (row < t) {
                unsigned long long i = (unsigned long long)row * ld + col + nt * 8 + 2 * q + r % 2;
                float v = acc[nt][r] * (r < 2 ? mul_lo : mul_hi);
                out[i] = v;
                if (out16) out16[i] = round16(v, fmt16);
            }
        }
    }
}

// The forward: out[b, t, heads·hd] (head h in columns h·hd..) and each
// row's log-sum-exp of its scaled scores, lse[b·heads, t], for the
// backward; with `out16` (else null), out rounded to format `fmt16` there
// too, the operand of the 16-bit product that reads it. Grid (⌈t / 64⌉,
// b·heads), 128 threads.
template <class M, int HD, bool DROP>
__device__ void fa_forward(const float* qkv, const unsigned* first, float* out,
                           unsigned short* out16, int fmt16, float* lse, FaShape sh) {
    constexpr int KT = FaWalk<HD>::KEYS;
    __shared__ __align__(16) typename M::Elem k_tile[KT * (HD + 8)];
    __shared__ __align__(16) typename M::Elem v_tile[KT * (HD + 8)];
    int warp = threadIdx.x / FA_WARP, lane = threadIdx.x % FA_WARP, g = lane / 4, q = lane % 4;
    int bh = blockIdx.y, s = bh / sh.heads, h = bh % sh.heads, kvh = h / (sh.heads / sh.kv);
    int d = sh.heads * HD, k_col = d + kvh * HD, v_col = d + (sh.kv + kvh) * HD;
    int q0 = blockIdx.x * FA_ROWS + warp * 16;
    const float* rows = qkv + (unsigned long long)s * sh.t * sh.ld;
    unsigned qa[HD / M::K][4];
    load_a<M, HD>(qa, rows, sh.ld, h * HD, q0, sh.t);
    float acc[HD / 8][4] = {};
    float m[2] = {FA_NEG_INF, FA_NEG_INF}, l[2] = {0.0f, 0.0f};
    // The first key of each of the thread's two rows, and of the warp's
    // and the block's first rows (the least of theirs).
    const unsigned* firsts = first ? first + (unsigned long long)s * sh.t : nullptr;
    int lo[2], row0 = q0 + g;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        lo[i] = firsts && row0 + 8 * i < sh.t ? (int)firsts[row0 + 8 * i] : 0;
    }
    int warp_lo = firsts && q0 < sh.t ? (int)firsts[q0] : 0;
    int block_lo = firsts ? (int)firsts[blockIdx.x * FA_ROWS] : 0;
    int keys = min(sh.t, (int)(blockIdx.x + 1) * FA_ROWS);
    unsigned long long at = DROP ? fa_head_at(sh, bh) : 0;
    for (int k0 = block_lo / KT * KT; k0 < keys; k0 += KT) {
        load_tiles<M, HD, KT>(k_tile, rows, sh.ld, k_col, v_tile, rows, sh.ld, v_col, k0, sh.t, [] {});
        // Keys this warp's rows can see in the tile: warp_lo.. q0 + 15.
        int span = min(KT, q0 + 16 - k0);
        if (span <= 0 || k0 + KT <= warp_lo) continue;
        float sc[KT / 8][4];
        scores<M, HD>(sc, qa, k_tile);
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
#pragma unroll
            for (int r = 0; r < 4; r++) {
                int key = k0 + nt * 8 + 2 * q + r % 2, row = q0 + g + 8 * (r / 2);
                bool seen = key <= row && key < sh.t && key >= lo[r / 2];
                float v = seen ? sc[nt][r] * sh.scale : FA_NEG_INF;
                sc[nt][r] = v;
                mx[r / 2] = fmaxf(mx[r / 2], v);
            }
        }
        // Without documents every row sees key k0 here, so the maxima are
        // finite; with them a row may have seen no key yet (−∞), and then
        // its terms are 0 against 0 rather than exp(−∞ + ∞).
        float corr[2], base[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mx[i] = quad_max(mx[i]);
            base[i] = mx[i] == FA_NEG_INF ? 0.0f : mx[i];
            corr[i] = expf(m[i] - base[i]);
            m[i] = mx[i];
            l[i] *= corr[i];
        }
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
#pragma unroll
            for (int r = 0; r < 4; r++) {
                float p = expf(sc[nt][r] - base[r / 2]);
                l[r / 2] += p;
                // The denominator sums the undropped terms; V is
                // multiplied by the dropped ones.
                if (DROP) {
                    int key = k0 + nt * 8 + 2 * q + r % 2, row = q0 + g + 8 * (r / 2);
                    p = fa_kept(sh, at, row, key) ? __fmul_rn(p, sh.drop.scale) : 0.0f;
                }
                sc[nt][r] = p;
            }
        }
#pragma unroll
        for (int nt = 0; nt < HD / 8; nt++) {
#pragma unroll
            for (int r = 0; r < 4; r++) acc[nt][r] *= corr[r / 2];
        }
        times_tile<M, HD>(acc, sc, v_tile, span);
    }
    float sum_lo = quad_sum(l[0]), sum_hi = quad_sum(l[1]);
    unsigned long long at_row = (unsigned long long)s * sh.t * d;
    store_rows<HD>(out + at_row, d, h * HD, q0, sh.t, acc, 1.0f / sum_lo, 1.0f / sum_hi,
                   out16 ? out16 + at_row : nullptr, fmt16);
    if (q == 0) {
        float* at = lse + (unsigned long long)bh * sh.t;
        if (q0 + g < sh.t) at[q0 + g] = m[0] + logf(sum_lo);
        if (q0 + g + 8 < sh.t) at[q0 + g + 8] = m[1] + logf(sum_hi);
    }
}

// delta[b·heads, t] = Σ_c out ⊙ dout over each head's columns (rows of
// [b, t, heads·hd]): the softmax backward's row term (Σ p ⊙ dp). One warp
// per (row, head), blocks of 256 threads.
extern "C" __global__ void attention_delta(const float* out, const float* dout, float* delta,
                                           unsigned long long rows, int t, int heads, int hd)
{
    unsigned long long i = (unsigned long long)blockIdx.x * (blockDim.x / FA_WARP) + threadIdx.x / FA_WARP;
    if (i >= rows * heads) return;
    int lane = threadIdx.x % FA_WARP;
    unsigned long long row = i / heads;
    int h = (int)(i % heads);
    const float* o = out + row * heads * hd + h * hd;
    const float* g = dout + row * heads * hd + h * hd;
    float v = 0.0f;
    for (int c = lane; c < hd; c += FA_WARP) v += o[c] * g[c];
    for (int off = FA_WARP / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) {
        unsigned long long s = row / t;
        delta[(s * heads + h) * t + row % t] = v;
    }
}

// p = exp(scale·s − lse) (0 where masked), and with dp given, ds = p ⊙ (dp −
// delta), for fragments in the C layout; with DROP, dp dropped by the mask
// of the probabilities of the head whose first element is `at` first and p returned dropped (dV's
// operand) while ds takes the undropped p; `keys_in_rows` says whether the
// fragment's rows are keys (the key/value kernel's transposed products) or
// query rows. `lse`, `delta` and `lo` (the first key each sees: its
// document's first) are the query rows' (indexed by row − lse0); `lo` is
// read only with DOCS, a compile-time choice so that a batch without
// documents pays no shared-memory read a score for it (sitting 19 on an
// H200: 0.2 ms on each backward kernel of a 152M step).
template <bool DOCS, bool DROP, int NT>
__device__ __forceinline__ void probs_and_grads(float (&s)[NT][4], float (&dp)[NT][4],
                                                int row0, int col0, bool keys_in_rows,
                                                const FaShape& sh, unsigned long long at,
                                                const float* lse, const float* delta,
                                                const int* lo, int lse0) {
    int t = sh.t;
    float scale = sh.scale;
    int lane = threadIdx.x % FA_WARP, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int row = row0 + g + 8 * (r / 2), col = col0 + nt * 8 + 2 * q + r % 2;
            int query = keys_in_rows ? col : row, key = keys_in_rows ? row : col;
            float p = 0.0f, ds = 0.0f;
            if (key <= query && query < t && key < t && (!DOCS || key >= lo[query - lse0])) {
                p = expf(s[nt][r] * scale - lse[query - lse0]);
                float g = dp[nt][r];
                if (DROP) {
                    bool keep = fa_kept(sh, at, query, key);
                    g = keep ? __fmul_rn(g, sh.drop.scale) : 0.0f;
                    ds = p * (g - delta[query - lse0]);
                    p = keep ? __fmul_rn(p, sh.drop.scale) : 0.0f;
                } else {
                    ds = p * (g - delta[query - lse0]);
                }
            }
            s[nt][r] = p;
            dp[nt][r] = ds;
        }
    }
}

// The backward's keys and values: dk and dv of key/value head kvh written
// into their columns of dqkv [b, t, ld] (dk times scale), summed over the
// group's query heads in order. Grid (⌈t / 64⌉, b·kv), 128 threads; each
// warp owns 16 keys and walks the query tiles from the diagonal on.
template <class M, int HD, bool DROP>
__device__ void fa_backward_kv(const float* qkv, const unsigned* first, const float* dout,
                               const float* lse, const float* delta, float* dqkv, FaShape sh) {
    constexpr int KT = FaWalk<HD>::KV_KEYS;
    __shared__ __align__(16) typename M::Elem q_tile[KT * (HD + 8)];
    __shared__ __align__(16) typename M::Elem do_tile[KT * (HD + 8)];
    __shared__ float lse_tile[KT], delta_tile[KT];
    __shared__ int lo_tile[KT];
    int warp = threadIdx.x / FA_WARP;
    int s = blockIdx.y / sh.kv, kvh = blockIdx.y % sh.kv, group = sh.heads / sh.kv;
    int d = sh.heads * HD, k_col = d + kvh * HD, v_col = d + (sh.kv + kvh) * HD;
    int k0 = blockIdx.x * FA_ROWS, kw = k0 + warp * 16;
    const float* rows = qkv + (unsigned long long)s * sh.t * sh.ld;
    const float* drows = dout + (unsigned long long)s * sh.t * d;
    unsigned ka[HD / M::K][4], va[HD / M::K][4];
    load_a<M, HD>(ka, rows, sh.ld, k_col, kw, sh.t);
    load_a<M, HD>(va, rows, sh.ld, v_col, kw, sh.t);
    float dk[HD / 8][4] = {}, dv[HD / 8][4] = {};
    const unsigned* firsts = first ? first + (unsigned long long)s * sh.t : nullptr;
    int last_key = min(sh.t, k0 + FA_ROWS) - 1;
    for (int j = 0; j < group; j++) {
        int h = kvh * group + j;
        const float* head_lse = lse + (unsigned long long)(s * sh.heads + h) * sh.t;
        const float* head_delta = delta + (unsigned long long)(s * sh.heads + h) * sh.t;
        for (int r0 = k0; r0 < sh.t; r0 += KT) {
            // Rows from here on all begin their documents after the block's
            // keys (the same test in every thread: the block stays together).
            if (firsts && (int)firsts[r0] > last_key) break;
            // The tile's rows' log-sum-exp, delta and first key, fetched
            // with the tiles.
            int i = threadIdx.x;
            float row_lse = 0.0f, row_delta = 0.0f;
            int row_lo = 0;
            if (i < KT && r0 + i < sh.t) {
                row_lse = head_lse[r0 + i];
                row_delta = head_delta[r0 + i];
                row_lo = firsts ? (int)firsts[r0 + i] : 0;
            }
            load_tiles<M, HD, KT>(q_tile, rows, sh.ld, h * HD, do_tile, drows, d, h * HD, r0, sh.t,
                              [&] {
                                  if (i < KT) {
                                      lse_tile[i] = row_lse;
                                      delta_tile[i] = row_delta;
                                      lo_tile[i] = row_lo;
                                  }
                              });
            float st[KT / 8][4], dpt[KT / 8][4];
            // Sᵀ = K · Qᵀ and dPᵀ = V · dOᵀ, 16 keys × KT query rows.
            scores<M, HD>(st, ka, q_tile);
            scores<M, HD>(dpt, va, do_tile);
            unsigned long long at = DROP ? fa_head_at(sh, (unsigned long long)s * sh.heads + h) : 0;
            if (firsts) {
                probs_and_grads<true, DROP>(st, dpt, kw, r0, true, sh, at, lse_tile, delta_tile,
                                            lo_tile, r0);
            } else {
                probs_and_grads<false, DROP>(st, dpt, kw, r0, true, sh, at, lse_tile, delta_tile,
                                             lo_tile, r0);
            }
            // dV += Pᵀ · dO, dK += dSᵀ · Q (row-major tiles).
            times_tile<M, HD>(dv, st, do_tile, KT);
            times_tile<M, HD>(dk, dpt, q_tile, KT);
        }
    }
    float* out = dqkv + (unsigned long long)s * sh.t * sh.ld;
    store_rows<HD>(out, sh.ld, k_col, kw, sh.t, dk, sh.scale, sh.scale);
    store_rows<HD>(out, sh.ld, v_col, kw, sh.t, dv, 1.0f, 1.0f);
}

// The backward's queries: dq of query head h (times scale) into its columns
// of dqkv. Grid (⌈t / 64⌉, b·heads), 128 threads; each warp owns 16 query
// rows and walks the key tiles up to the diagonal.
template <class M, int HD, bool DROP>
__device__ void fa_backward_q(const float* qkv, const unsigned* first, const float* dout,
                              const float* lse, const float* delta, float* dqkv, FaShape sh) {
    constexpr int KT = FaWalk<HD>::KEYS;
    __shared__ __align__(16) typename M::Elem k_tile[KT * (HD + 8)];
    __shared__ __align__(16) typename M::Elem v_tile[KT * (HD + 8)];
    __shared__ float lse_rows[FA_ROWS], delta_rows[FA_ROWS];
    __shared__ int lo_rows[FA_ROWS];
    int warp = threadIdx.x / FA_WARP;
    int bh = blockIdx.y, s = bh / sh.heads, h = bh % sh.heads, kvh = h / (sh.heads / sh.kv);
    int d = sh.heads * HD, k_col = d + kvh * HD, v_col = d + (sh.kv + kvh) * HD;
    int q0 = blockIdx.x * FA_ROWS + warp * 16;
    const float* rows = qkv + (unsigned long long)s * sh.t * sh.ld;
    unsigned qa[HD / M::K][4], da[HD / M::K][4];
    load_a<M, HD>(qa, rows, sh.ld, h * HD, q0, sh.t);
    load_a<M, HD>(da, dout + (unsigned long long)s * sh.t * d, d, h * HD, q0, sh.t);
    // The block's rows' log-sum-exp, delta and first key, shared from the
    // first tile's barrier on.
    int top = blockIdx.x * FA_ROWS;
    const unsigned* firsts = first ? first + (unsigned long long)s * sh.t : nullptr;
    if (threadIdx.x < FA_ROWS && top + (int)threadIdx.x < sh.t) {
        lse_rows[threadIdx.x] = lse[(unsigned long long)bh * sh.t + top + threadIdx.x];
        delta_rows[threadIdx.x] = delta[(unsigned long long)bh * sh.t + top + threadIdx.x];
        lo_rows[threadIdx.x] = firsts ? (int)firsts[top + threadIdx.x] : 0;
    }
    int warp_lo = firsts && q0 < sh.t ? (int)firsts[q0] : 0;
    int block_lo = firsts ? (int)firsts[top] : 0;
    float dq[HD / 8][4] = {};
    unsigned long long at = DROP ? fa_head_at(sh, bh) : 0;
    int keys = min(sh.t, top + FA_ROWS);
    for (int k0 = block_lo / KT * KT; k0 < keys; k0 += KT) {
        load_tiles<M, HD, KT>(k_tile, rows, sh.ld, k_col, v_tile, rows, sh.ld, v_col, k0, sh.t, [] {});
        int span = min(KT, q0 + 16 - k0);
        if (span <= 0 || k0 + KT <= warp_lo) continue;
        float sc[KT / 8][4], dp[KT / 8][4];
        scores<M, HD>(sc, qa, k_tile);
        scores<M, HD>(dp, da, v_tile);
        if (firsts) {
            probs_and_grads<true, DROP>(sc, dp, q0, k0, false, sh, at, lse_rows, delta_rows,
                                        lo_rows, top);
        } else {
            probs_and_grads<false, DROP>(sc, dp, q0, k0, false, sh, at, lse_rows, delta_rows,
                                         lo_rows, top);
        }
        // dQ += dS · K (K row-major).
        times_tile<M, HD>(dq, dp, k_tile, span);
    }
    store_rows<HD>(dqkv + (unsigned long long)s * sh.t * sh.ld, sh.ld, h * HD, q0, sh.t, dq,
                   sh.scale, sh.scale);
}

// Entry points per kind of product and head width (16, 32 and 64, and 128
// for the 16-bit kinds, whose tiles fit the 48 KB of static shared memory
// there and whose fragments half the registers TF32's take; other widths
// take the unfused path), each without dropout and with it (`_dropout`);
// both take the mask's threshold, scale and key (the first ignores them).
#define FA_KERNELS(KIND, M, HD, DROPOUT, DROP)                                                 \
    extern "C" __global__ void flash_forward##DROPOUT##_##KIND##_##HD(                         \
        const float* qkv, const unsigned* first, float* out, unsigned short* out16, int fmt16, \
        float* lse, int t, int heads, int kv, int ld, float scale, unsigned drop_threshold,    \
        float drop_scale, unsigned drop_key)                                                   \
    {                                                                                          \
        fa_forward<M, HD, DROP>(qkv, first, out, out16, fmt16, lse,                            \
                                FaShape{t, heads, kv, ld, scale,                               \
                                        FaDrop{drop_threshold, drop_scale, drop_key}});        \
    }                                                                                          \
    extern "C" __global__ void flash_backward_kv##DROPOUT##_##KIND##_##HD(                     \
        const float* qkv, const unsigned* first, const float* dout, const float* lse,          \
        const float* delta, float* dqkv, int t, int heads, int kv, int ld, float scale,        \
        unsigned drop_threshold, float drop_scale, unsigned drop_key)                          \
    {                                                                                          \
        fa_backward_kv<M, HD, DROP>(qkv, first, dout, lse, delta, dqkv,                        \
                                    FaShape{t, heads, kv, ld, scale,                           \
                                            FaDrop{drop_threshold, drop_scale, drop_key}});    \
    }                                                                                          \
    extern "C" __global__ void flash_backward_q##DROPOUT##_##KIND##_##HD(                      \
        const float* qkv, const unsigned* first, const float* dout, const float* lse,          \
        const float* delta, float* dqkv, int t, int heads, int kv, int ld, float scale,        \
        unsigned drop_threshold, float drop_scale, unsigned drop_key)                          \
    {                                                                                          \
        fa_backward_q<M, HD, DROP>(qkv, first, dout, lse, delta, dqkv,                         \
                                   FaShape{t, heads, kv, ld, scale,                            \
                                           FaDrop{drop_threshold, drop_scale, drop_key}});     \
    }
#define FA_ENTRIES(KIND, M, HD)            \
    FA_KERNELS(KIND, M, HD, , false)       \
    FA_KERNELS(KIND, M, HD, _dropout, true)

FA_ENTRIES(bf16, Bf16, 16)
FA_ENTRIES(bf16, Bf16, 32)
FA_ENTRIES(bf16, Bf16, 64)
FA_ENTRIES(f16, F16, 16)
FA_ENTRIES(f16, F16, 32)
FA_ENTRIES(f16, F16, 64)
FA_ENTRIES(bf16, Bf16, 128)
FA_ENTRIES(f16, F16, 128)
FA_ENTRIES(tf32, Tf32, 16)
FA_ENTRIES(tf32, Tf32, 32)
FA_ENTRIES(tf32, Tf32, 64)
