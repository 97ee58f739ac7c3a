// libcuda.so for a host without a GPU: the part of the CUDA driver API that
// cudarc calls for zrun, over host memory, with every kernel launch run at
// once by the CPU emulation (emu.h, emu.cpp's table by name). With it, and
// cublas.cpp and nvrtc.cpp beside it, on LD_LIBRARY_PATH, zcuda's Rust code
// (launch argument lists, buffer sizes, streams and events as it uses them)
// runs end to end on any machine.
//
// The model: ZCUDA_EMU_DEVICES "GPUs" (default 1; CUDA_VISIBLE_DEVICES
// narrows them as it narrows real ones), compute
// capability 9.0, ZCUDA_EMU_MEMORY_MIB of memory (default 4096; an
// allocation past it fails with CUDA_ERROR_OUT_OF_MEMORY, as a full GPU
// does). Device pointers are host addresses; every stream is synchronous
// (an operation is done when its call returns), so events are done when
// recorded and hold the host's clock for cuEventElapsedTime, with one
// exception: nccl.cpp's collectives run on a thread of their own, and
// while one is queued or running the stream is busy: a launch, copy, free
// or synchronize waits for it (up to ZCUDA_EMU_STREAM_TIMEOUT_S, default
// 300, then CUDA_ERROR_LAUNCH_TIMEOUT), and an event or stream query says
// CUDA_ERROR_NOT_READY. Kernels are
// looked up by name when a module's function is asked for; the module's
// image (the CPU NVRTC's output) is not read. A launch with a grid or
// block CUDA would refuse is refused here too.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "emu.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct EmuContext* CUcontext;
typedef struct EmuModule* CUmodule;
typedef struct EmuFunction* CUfunction;
typedef struct EmuStream* CUstream;
typedef struct EmuEvent* CUevent;

struct EmuContext {
    int device;
};
struct EmuModule {
    std::string image;
};
struct EmuFunction {
    std::string name;
    EmuParamLauncher launch;
};
struct EmuStream {};
struct EmuEvent {
    std::chrono::steady_clock::time_point at;
};

namespace {
const CUresult SUCCESS = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3,
               INVALID_DEVICE = 101, INVALID_HANDLE = 400, NOT_FOUND = 500, NOT_READY = 600,
               LAUNCH_OUT_OF_RESOURCES = 701, LAUNCH_TIMEOUT = 702;

const int ATTR_MAX_THREADS_PER_BLOCK = 1, ATTR_MAX_BLOCK_DIM_X = 2, ATTR_MAX_GRID_DIM_X = 5,
          ATTR_MAX_GRID_DIM_Y = 6, ATTR_MAX_SHARED_MEMORY_PER_BLOCK = 8, ATTR_WARP_SIZE = 10,
          ATTR_MULTIPROCESSOR_COUNT = 16, ATTR_CC_MAJOR = 75, ATTR_CC_MINOR = 76;

bool initialized = false;

unsigned long env_number(const char* name, unsigned long fallback) {
    const char* v = std::getenv(name);
    if (!v || !*v) return fallback;
    char* end;
    unsigned long n = std::strtoul(v, &end, 10);
    if (*end) {
        std::fprintf(stderr, "zcuda-emu: %s=%s is not a number\n", name, v);
        std::abort();
    }
    return n;
}

// ZCUDA_EMU_DEVICES "GPUs", narrowed as CUDA narrows them by
// CUDA_VISIBLE_DEVICES: the listed indices, up to the first that is not one
// of them (CUDA ignores the rest of the list from there).
int device_count() {
    int present = (int)env_number("ZCUDA_EMU_DEVICES", 1);
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    if (!visible) return present;
    int n = 0;
    for (const char* at = visible; *at;) {
        char* end;
        long i = std::strtol(at, &end, 10);
        if (end == at || i < 0 || i >= present || (*end && *end != ',')) break;
        n++;
        at = *end ? end + 1 : end;
    }
    return n;
}

size_t total_memory() { return (size_t)env_number("ZCUDA_EMU_MEMORY_MIB", 4096) << 20; }

// Live allocations and their sizes, for cuMemGetInfo and the memory cap.
std::mutex memory_lock;
std::unordered_map<uintptr_t, size_t> allocations;
size_t allocated = 0;

CUresult allocate(CUdeviceptr* out, size_t bytes) {
    if (!out) return INVALID_VALUE;
    std::lock_guard<std::mutex> hold(memory_lock);
    if (bytes == 0) return INVALID_VALUE;
    if (allocated + bytes > total_memory()) return OUT_OF_MEMORY;
    // 256-byte alignment, as cuMemAlloc gives.
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!p) return OUT_OF_MEMORY;
    allocations[(uintptr_t)p] = bytes;
    allocated += bytes;
    *out = (CUdeviceptr)(uintptr_t)p;
    return SUCCESS;
}

CUresult wait_idle();

CUresult release(CUdeviceptr p) {
    if (CUresult r = wait_idle()) return r;
    std::lock_guard<std::mutex> hold(memory_lock);
    auto it = allocations.find((uintptr_t)p);
    if (it == allocations.end()) return INVALID_VALUE;
    allocated -= it->second;
    allocations.erase(it);
    std::free((void*)(uintptr_t)p);
    return SUCCESS;
}

// Collectives queued or running (nccl.cpp), which the stream's next
// operation waits for.
std::mutex busy_lock;
std::condition_variable idle;
int busy = 0;

bool stream_busy() {
    std::lock_guard<std::mutex> hold(busy_lock);
    return busy > 0;
}

CUresult wait_idle() {
    std::unique_lock<std::mutex> hold(busy_lock);
    auto limit = std::chrono::seconds(env_number("ZCUDA_EMU_STREAM_TIMEOUT_S", 300));
    return idle.wait_for(hold, limit, [] { return busy == 0; }) ? SUCCESS : LAUNCH_TIMEOUT;
}

EmuContext primary{0};
EmuStream streams_made;

CUresult device_ok(CUdevice d) {
    if (!initialized) return NOT_INITIALIZED;
    return d >= 0 && d < device_count() ? SUCCESS : INVALID_DEVICE;
}
}  // namespace

extern "C" {

void zcuda_emu_stream_busy(int delta) {
    std::lock_guard<std::mutex> hold(busy_lock);
    busy += delta;
    if (busy == 0) idle.notify_all();
}

CUresult cuInit(unsigned) {
    initialized = true;
    return SUCCESS;
}

CUresult cuDeviceGetCount(int* n) {
    if (!initialized) return NOT_INITIALIZED;
    *n = device_count();
    return SUCCESS;
}

CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (CUresult r = device_ok(ordinal)) return r;
    *d = ordinal;
    return SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    if (CUresult r = device_ok(d)) return r;
    std::snprintf(name, (size_t)len, "zcuda-emu (the CPU emulation of crates/zcuda-emu)");
    return SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    if (CUresult r = device_ok(d)) return r;
    *bytes = total_memory();
    return SUCCESS;
}

CUresult cuDeviceGetAttribute(int* v, int attribute, CUdevice d) {
    if (CUresult r = device_ok(d)) return r;
    switch (attribute) {
        case ATTR_MAX_THREADS_PER_BLOCK:
        case ATTR_MAX_BLOCK_DIM_X: *v = 1024; break;
        case ATTR_MAX_GRID_DIM_X: *v = 2147483647; break;
        case ATTR_MAX_GRID_DIM_Y: *v = 65535; break;
        case ATTR_MAX_SHARED_MEMORY_PER_BLOCK: *v = 48 * 1024; break;
        case ATTR_WARP_SIZE: *v = 32; break;
        case ATTR_MULTIPROCESSOR_COUNT: *v = (int)emu_os_threads(); break;
        case ATTR_CC_MAJOR: *v = 9; break;
        case ATTR_CC_MINOR: *v = 0; break;
        // Memory pools (cuMemAllocAsync) and everything else: not offered.
        default: *v = 0; break;
    }
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice d) {
    if (CUresult r = device_ok(d)) return r;
    *ctx = &primary;
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { return device_ok(d); }

thread_local CUcontext current = nullptr;

CUresult cuCtxSetCurrent(CUcontext ctx) {
    current = ctx;
    return SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext* ctx) {
    *ctx = current;
    return SUCCESS;
}

CUresult cuCtxSynchronize() { return wait_idle(); }

CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    if (least) *least = 0;
    if (greatest) *greatest = 0;
    return SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
    std::lock_guard<std::mutex> hold(memory_lock);
    *total_bytes = total_memory();
    *free_bytes = total_memory() - allocated;
    return SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) { return allocate(p, bytes); }
CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, CUstream) { return allocate(p, bytes); }
CUresult cuMemFree_v2(CUdeviceptr p) { return release(p); }
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream) { return release(p); }

// Pinned host memory is host memory; it is not counted against the GPU's.
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) {
    *p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    return *p ? SUCCESS : OUT_OF_MEMORY;
}
CUresult cuMemAllocHost_v2(void** p, size_t bytes) { return cuMemHostAlloc(p, bytes, 0); }
CUresult cuMemFreeHost(void* p) {
    std::free(p);
    return SUCCESS;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    if (CUresult r = wait_idle()) return r;
    std::memcpy((void*)(uintptr_t)dst, src, n);
    return SUCCESS;
}
CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    if (CUresult r = wait_idle()) return r;
    std::memcpy(dst, (const void*)(uintptr_t)src, n);
    return SUCCESS;
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    if (CUresult r = wait_idle()) return r;
    std::memmove((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n);
    return SUCCESS;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream) {
    return cuMemcpyHtoD_v2(dst, src, n);
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream) {
    return cuMemcpyDtoH_v2(dst, src, n);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream) {
    return cuMemcpyDtoD_v2(dst, src, n);
}
CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    if (CUresult r = wait_idle()) return r;
    std::memset((void*)(uintptr_t)dst, v, n);
    return SUCCESS;
}
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream) {
    return cuMemsetD8_v2(dst, v, n);
}

CUresult cuStreamCreate(CUstream* s, unsigned) {
    *s = &streams_made;
    return SUCCESS;
}
CUresult cuStreamCreateWithPriority(CUstream* s, unsigned, int) { return cuStreamCreate(s, 0); }
CUresult cuStreamDestroy_v2(CUstream) { return SUCCESS; }
CUresult cuStreamSynchronize(CUstream) { return wait_idle(); }
CUresult cuStreamQuery(CUstream) { return stream_busy() ? NOT_READY : SUCCESS; }
CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned) { return SUCCESS; }

CUresult cuEventCreate(CUevent* e, unsigned) {
    *e = new EmuEvent{std::chrono::steady_clock::now()};
    return SUCCESS;
}
CUresult cuEventDestroy_v2(CUevent e) {
    delete e;
    return SUCCESS;
}
CUresult cuEventRecord(CUevent e, CUstream) {
    e->at = std::chrono::steady_clock::now();
    return SUCCESS;
}
CUresult cuEventQuery(CUevent) { return stream_busy() ? NOT_READY : SUCCESS; }
CUresult cuEventSynchronize(CUevent) { return wait_idle(); }
CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
    *ms = std::chrono::duration<float, std::milli>(end->at - start->at).count();
    return SUCCESS;
}
CUresult cuEventElapsedTime_v2(float* ms, CUevent start, CUevent end) {
    return cuEventElapsedTime(ms, start, end);
}

CUresult cuLaunchHostFunc(CUstream, void (*fn)(void*), void* data) {
    fn(data);
    return SUCCESS;
}

CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    if (!image) return INVALID_VALUE;
    *m = new EmuModule{static_cast<const char*>(image)};
    return SUCCESS;
}
CUresult cuModuleUnload(CUmodule m) {
    delete m;
    return SUCCESS;
}

// Any kernel the emulation has (the module's image is not read).
CUresult cuModuleGetFunction(CUfunction* f, CUmodule, const char* name) {
    EmuParamLauncher launch = emu_kernel_by_name(name);
    if (!launch) return NOT_FOUND;
    *f = new EmuFunction{name, launch};
    return SUCCESS;
}

CUresult cuFuncGetAttribute(int* v, int, CUfunction) {
    *v = 0;
    return SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction, int, int) { return SUCCESS; }
CUresult cuFuncSetCacheConfig(CUfunction, int) { return SUCCESS; }

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared_bytes, CUstream, void** params,
                        void** extra) {
    if (!f) return INVALID_HANDLE;
    // Dynamic shared memory, 3-D blocks and grids, and `extra`: none of
    // zrun's kernels use them, and the emulation has none.
    if (extra || shared_bytes || bz != 1 || by != 1 || gz != 1) return INVALID_VALUE;
    if (gx == 0 || gy == 0 || gy > 65535 || bx == 0) return INVALID_VALUE;
    if (bx > 1024) return LAUNCH_OUT_OF_RESOURCES;
    if (CUresult r = wait_idle()) return r;
    f->launch(dim3{gx, gy, 1}, dim3{bx, 1, 1}, params);
    return SUCCESS;
}

CUresult cuGetErrorName(CUresult r, const char** s) {
    switch (r) {
        case SUCCESS: *s = "CUDA_SUCCESS"; break;
        case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
        case OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
        case NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
        case INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
        case INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
        case NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; break;
        case NOT_READY: *s = "CUDA_ERROR_NOT_READY"; break;
        case LAUNCH_OUT_OF_RESOURCES: *s = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"; break;
        case LAUNCH_TIMEOUT: *s = "CUDA_ERROR_LAUNCH_TIMEOUT"; break;
        default: *s = "CUDA_ERROR_UNKNOWN"; return INVALID_VALUE;
    }
    return SUCCESS;
}

CUresult cuGetErrorString(CUresult r, const char** s) {
    switch (r) {
        case OUT_OF_MEMORY: *s = "out of memory"; return SUCCESS;
        case NOT_FOUND: *s = "named symbol not found"; return SUCCESS;
        case INVALID_VALUE: *s = "invalid argument"; return SUCCESS;
        default: return cuGetErrorName(r, s);
    }
}

}  // extern "C"
