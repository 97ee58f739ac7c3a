// Runs of one flat index space in one launch, shared by adamw.cu's and
// reduce.cu's kernels that update a parameter group's or a block's tensors
// at once (zcuda puts this text before each): one launch a tensor cost
// some 4 µs of GPU time each on an H200, however few its values.

// Calls f(i, r) for every index i of run r, [start[r], end[r]), over the
// count runs (sorted, apart or touching), grid-stride from the first run's
// start; indices between runs are skipped.
template <class F>
__device__ __forceinline__ void for_each_in_runs(const unsigned long long* start,
                                                 const unsigned long long* end,
                                                 unsigned int count, F f)
{
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long n = end[count - 1];
    // A thread's i only grows, so its run index only moves forward.
    unsigned int r = 0;
    for (unsigned long long i = start[0] + (unsigned long long)blockIdx.x * blockDim.x +
                                threadIdx.x;
         i < n; i += stride) {
        while (i >= end[r]) {
            r++;
        }
        if (i >= start[r]) {
            f(i, r);
        }
    }
}

