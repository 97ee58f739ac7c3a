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
