// AdamW over a device-resident slice, in one pass: read p, g, m, v; write p, m,
// v and, with mixed precision, the 16-bit working copy of p; with c.rule
// RULE_ADAM, PyTorch's Adam (adam: the L2 term added to g, p not
// decayed). With RULE_LION, Lion's update instead (lion), with
// RULE_ADAGRAD Adagrad's (adagrad, its sum of squares in m): p, g and m
// read, p and m written; neither keeps a second moment, and v is null.
//
// The same expression in the same order as zrun's CPU kernel
// (crates/zengine/src/adam), every multiply, add, divide and square root
// rounded on its own (the _rn intrinsics; the module is also compiled with
// --fmad=false), 16-bit values rounded to nearest even: the GPU's update
// equals the CPU's bit for bit, which keeps ZeRO-Offload (Adam on the host)
// and in-GPU Adam interchangeable and stages 0-3 equal to each other.

// Per-step scalars, derived on the host exactly as the CPU kernel derives them.
struct AdamConsts {
    float gscale;
    float b1;
    float omb1;
    float b2;
    float omb2;
    float step_size;
    float inv_sqrt_bc2;
    float eps;
    // 1 − lr·weight_decay where decay applies, else 1 (scales p); under
    // Adam and Adagrad weight_decay, else 0 (the multiple of p added to g).
    float decay;
    // Adagrad: added to the sum before the square (its initial value at
    // the first update, else 0).
    float initial_sum;
    // RULE_ADAMW, RULE_LION (step_size is lr itself) or RULE_ADAGRAD
    // (step_size is lr / (1 + (t − 1)·lr_decay)).
    unsigned int rule;
};

#define RULE_ADAMW 0u
#define RULE_LION 1u
#define RULE_ADAGRAD 2u
#define RULE_ADAM 3u

// Lion's direction: PyTorch's sign (±1, the zero itself for ±0, NaN for
// NaN), as the CPU kernel's.
__device__ __forceinline__ float lion_sign(float x)
{
    return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x);
}

// Element i of AdamW, its parameter at pe (p + i in a flat buffer): g is
// f32 when grad_fmt is FMT_F32, else 16-bit; working is written when
// working_fmt is not FMT_F32.
__device__ __forceinline__ void adamw_element(
    unsigned long long i,
    float* pe,
    const void* g,
    float* m,
    float* v,
    unsigned short* working,
    const AdamConsts& c,
    float decay,
    int grad_fmt,
    int working_fmt)
{
    // The parameter read with the gradient and the moments, before any
    // store: below the stores to m and v, which it might alias as far as
    // the compiler knows, it would wait for them, and so for the first
    // three loads' trip, a second trip to memory an element.
    float p0 = *pe;
    float graw = grad_fmt == FMT_F32
        ? ((const float*)g)[i]
        : widen16(((const unsigned short*)g)[i], grad_fmt);
    float gi = __fmul_rn(graw, c.gscale);
    if (c.rule == RULE_ADAGRAD) {
        // g = g + λ·p (where λ is not 0), s = s + g·g,
        // p = p − (lr_t·g) / (√s + eps): PyTorch's Adagrad.
        if (decay != 0.0f) {
            gi = __fadd_rn(gi, __fmul_rn(decay, p0));
        }
        float si = __fadd_rn(__fadd_rn(m[i], c.initial_sum), __fmul_rn(gi, gi));
        m[i] = si;
        float pi = __fsub_rn(p0, __fdiv_rn(__fmul_rn(c.step_size, gi), __fadd_rn(__fsqrt_rn(si), c.eps)));
        *pe = pi;
        if (working_fmt != FMT_F32) {
            working[i] = round16(pi, working_fmt);
        }
        return;
    }
    if (c.rule == RULE_LION) {
        // c = β1·m + (1 − β1)·g, p = p·decay − lr·sign(c), m = β2·m + (1 − β2)·g.
        float m0 = m[i];
        float ci = __fadd_rn(__fmul_rn(c.b1, m0), __fmul_rn(c.omb1, gi));
        m[i] = __fadd_rn(__fmul_rn(c.b2, m0), __fmul_rn(c.omb2, gi));
        float pi = __fsub_rn(__fmul_rn(p0, decay), __fmul_rn(c.step_size, lion_sign(ci)));
        *pe = pi;
        if (working_fmt != FMT_F32) {
            working[i] = round16(pi, working_fmt);
        }
        return;
    }
    if (c.rule == RULE_ADAM) {
        // PyTorch's Adam: the L2 term joins the gradient (where λ is not
        // 0), and the parameter is not decayed.
        if (decay != 0.0f) {
            gi = __fadd_rn(gi, __fmul_rn(decay, p0));
        }
        decay = 1.0f;
    }
    float mi = __fadd_rn(__fmul_rn(c.b1, m[i]), __fmul_rn(c.omb1, gi));
    float vi = __fadd_rn(__fmul_rn(c.b2, v[i]), __fmul_rn(__fmul_rn(c.omb2, gi), gi));
    m[i] = mi;
    v[i] = vi;
    float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(vi), c.inv_sqrt_bc2), c.eps);
    float pi = __fsub_rn(__fmul_rn(p0, decay), __fdiv_rn(__fmul_rn(c.step_size, mi), denom));
    *pe = pi;
    if (working_fmt != FMT_F32) {
        working[i] = round16(pi, working_fmt);
    }
}

// One slice of n elements.
extern "C" __global__ void adamw(
    float* p,
    const void* g,
    float* m,
    float* v,
    unsigned short* working,
    unsigned long long n,
    AdamConsts c,
    int grad_fmt,
    int working_fmt)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        adamw_element(i, p + i, g, m, v, working, c, c.decay, grad_fmt, working_fmt);
    }
}

// Runs of one flat buffer (a parameter group's tensors, each with its own
// weight decay), in one launch where `adamw` takes one a tensor: run r is
// [start[r], end[r]), sorted, apart or touching; decay_mask's bit r says
// whether c.decay (decay) or `plain` (none) is its decay factor. Elements between
// runs (a group's padding) are not touched. The parameters may instead be
// one buffer a run (p_at), the moments and gradients still flat.
#define ADAMW_MAX_RUNS 16
struct AdamRuns {
    unsigned long long start[ADAMW_MAX_RUNS];
    unsigned long long end[ADAMW_MAX_RUNS];
    // Where not 0, run r's parameters are a buffer of their own at this
    // address (a model's tensors, the f32 resident step), its first value
    // the run's start; else they are p's values at the run's indices.
    unsigned long long p_at[ADAMW_MAX_RUNS];
    unsigned int count;
    unsigned int decay_mask;
    float plain;
};

extern "C" __global__ void adamw_runs(
    float* p,
    const void* g,
    float* m,
    float* v,
    unsigned short* working,
    AdamConsts c,
    AdamRuns runs,
    int grad_fmt,
    int working_fmt)
{
    for_each_in_runs(runs.start, runs.end, runs.count, [&](unsigned long long i, unsigned int r) {
        float decay = (runs.decay_mask >> r) & 1u ? c.decay : runs.plain;
        float* pe = runs.p_at[r] ? (float*)runs.p_at[r] + (i - runs.start[r]) : p + i;
        adamw_element(i, pe, g, m, v, working, c, decay, grad_fmt, working_fmt);
    });
}
