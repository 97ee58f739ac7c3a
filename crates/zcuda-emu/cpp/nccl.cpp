// libnccl.so for driver.cpp's CPU "GPU": the communicator and the three
// collectives zcuda uses (all-reduce and reduce-scatter of f32 sums,
// all-gather of any type as bytes) between the processes of one host,
// through a POSIX shared-memory segment named by the unique id.
//
// As on a GPU, a collective is enqueued and runs later: each communicator
// has a thread that runs its operations in order, and while any is queued
// or running driver.cpp's stream is busy (a kernel launch or copy waits
// for it; an event query says "not ready"), so that zcuda's deadline,
// async-error polling and abort are exercised as on a GPU. Joining is
// asynchronous too (ncclCommInitRankConfig returns ncclInProgress until
// every rank has joined).
//
// Sums are taken in rank order (rank 0 + rank 1 + ...), the same on every
// rank; NCCL's rings sum in another fixed order, so results agree with a
// GPU's to f32 rounding, and bit for bit between ranks, as NCCL's do.
// A peer process that exits turns the waiting collective into
// ncclRemoteError naming it; a collective no peer joins waits until
// zcuda's deadline aborts it.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

// driver.cpp's stream: busy while a collective is queued or running.
extern "C" void zcuda_emu_stream_busy(int delta);

typedef int ncclResult_t;
typedef struct EmuComm* ncclComm_t;
struct ncclUniqueId {
    char internal[128];
};

namespace {
const ncclResult_t SUCCESS = 0, SYSTEM_ERROR = 2, INVALID_ARGUMENT = 4, REMOTE_ERROR = 6,
                   IN_PROGRESS = 7;
const int T_INT8 = 0, T_UINT8 = 1, T_INT32 = 2, T_UINT32 = 3, T_INT64 = 4, T_UINT64 = 5,
          T_FLOAT16 = 6, T_FLOAT32 = 7, T_FLOAT64 = 8, T_BFLOAT16 = 9;
const int OP_SUM = 0;
const int MAX_RANKS = 64;
// Each rank's share of the segment that one step of a collective moves.
const size_t CHUNK = 1 << 20;

size_t type_size(int t) {
    switch (t) {
        case T_INT8:
        case T_UINT8: return 1;
        case T_FLOAT16:
        case T_BFLOAT16: return 2;
        case T_INT32:
        case T_UINT32:
        case T_FLOAT32: return 4;
        case T_INT64:
        case T_UINT64:
        case T_FLOAT64: return 8;
        default: return 0;
    }
}

// The segment: counters, the ranks' pids, then a CHUNK per rank.
struct Segment {
    std::atomic<uint64_t> joined;
    std::atomic<uint64_t> arrived;  // barrier arrivals, never reset
    std::atomic<int> pid[MAX_RANKS];
    char data[];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "atomics across processes");

size_t segment_bytes(int n) { return sizeof(Segment) + (size_t)n * CHUNK; }
}  // namespace

struct EmuComm {
    int rank, n;
    std::string name;  // the segment's
    Segment* seg = nullptr;
    uint64_t barriers = 0;  // this rank's barriers passed

    std::mutex lock;
    std::condition_variable wake;
    std::deque<std::function<ncclResult_t()>> queue;
    std::atomic<ncclResult_t> state{IN_PROGRESS};
    std::atomic<bool> aborted{false};
    std::string last_error;
    std::thread worker;
};

namespace {
// Waits until `done()`; false (with `last_error` set) where the
// communicator was aborted or a peer process is gone.
template <class Done>
ncclResult_t await(EmuComm& c, Done done) {
    auto next_check = std::chrono::steady_clock::now();
    for (unsigned spins = 0; !done(); spins++) {
        if (c.aborted.load()) return SYSTEM_ERROR;
        if (spins < 200) {
            std::this_thread::yield();
            continue;
        }
        auto now = std::chrono::steady_clock::now();
        if (now >= next_check) {
            next_check = now + std::chrono::milliseconds(20);
            for (int r = 0; r < c.n; r++) {
                int pid = c.seg->pid[r].load();
                if (r != c.rank && pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
                    std::lock_guard<std::mutex> hold(c.lock);
                    c.last_error = "rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
                                   ") exited";
                    return REMOTE_ERROR;
                }
            }
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return SUCCESS;
}

ncclResult_t barrier(EmuComm& c) {
    uint64_t target = ++c.barriers * (uint64_t)c.n;
    c.seg->arrived.fetch_add(1);
    return await(c, [&] { return c.seg->arrived.load() >= target; });
}

char* slot(EmuComm& c, int r) { return c.seg->data + (size_t)r * CHUNK; }

// Sums (in rank order) elements [at, at + len) of every rank's buffer,
// `len` at most a chunk, into `out` (this rank's, at the same index).
ncclResult_t sum_step(EmuComm& c, const float* mine, size_t len, float* out) {
    std::memcpy(slot(c, c.rank), mine, len * 4);
    if (ncclResult_t r = barrier(c)) return r;
    for (size_t i = 0; i < len; i++) {
        float s = reinterpret_cast<const float*>(slot(c, 0))[i];
        for (int r = 1; r < c.n; r++) s += reinterpret_cast<const float*>(slot(c, r))[i];
        out[i] = s;
    }
    return barrier(c);
}

ncclResult_t all_reduce(EmuComm& c, const float* send, float* recv, size_t count) {
    for (size_t at = 0; at < count; at += CHUNK / 4) {
        size_t len = std::min(CHUNK / 4, count - at);
        if (ncclResult_t r = sum_step(c, send + at, len, recv + at)) return r;
    }
    return SUCCESS;
}

// Every rank publishes its whole buffer chunk by chunk; each keeps the
// sums of its own part.
ncclResult_t reduce_scatter(EmuComm& c, const float* send, float* recv, size_t count) {
    size_t total = count * (size_t)c.n, own = count * (size_t)c.rank;
    std::vector<float> sums(CHUNK / 4);
    for (size_t at = 0; at < total; at += CHUNK / 4) {
        size_t len = std::min(CHUNK / 4, total - at);
        if (ncclResult_t r = sum_step(c, send + at, len, sums.data())) return r;
        size_t from = std::max(at, own), to = std::min(at + len, own + count);
        for (size_t i = from; i < to; i++) recv[i - own] = sums[i - at];
    }
    return SUCCESS;
}

// The output (n·bytes) in pieces of the segment's size: each rank copies
// its part of a piece in, then every rank copies the piece out.
ncclResult_t all_gather(EmuComm& c, const char* send, char* recv, size_t bytes) {
    size_t total = bytes * (size_t)c.n, own = bytes * (size_t)c.rank, room = CHUNK * c.n;
    for (size_t at = 0; at < total; at += room) {
        size_t len = std::min(room, total - at);
        size_t from = std::max(at, own), to = std::min(at + len, own + bytes);
        if (from < to) std::memcpy(c.seg->data + (from - at), send + (from - own), to - from);
        if (ncclResult_t r = barrier(c)) return r;
        std::memcpy(recv + at, c.seg->data, len);
        if (ncclResult_t r = barrier(c)) return r;
    }
    return SUCCESS;
}

void run_queue(EmuComm* c) {
    for (;;) {
        std::function<ncclResult_t()> op;
        {
            std::unique_lock<std::mutex> hold(c->lock);
            c->wake.wait(hold, [&] { return !c->queue.empty() || c->aborted.load(); });
            if (c->queue.empty()) return;
            op = std::move(c->queue.front());
            c->queue.pop_front();
        }
        // After an error or an abort the rest fail at once, as NCCL's do.
        ncclResult_t now = c->state.load();
        bool failed = now != SUCCESS && now != IN_PROGRESS;
        ncclResult_t r = c->aborted.load() || failed ? SYSTEM_ERROR : op();
        if (r != SUCCESS && !failed) c->state = r;
        zcuda_emu_stream_busy(-1);
    }
}

void enqueue(EmuComm* c, std::function<ncclResult_t()> op) {
    zcuda_emu_stream_busy(+1);
    std::lock_guard<std::mutex> hold(c->lock);
    c->queue.push_back(std::move(op));
    c->wake.notify_one();
}

ncclResult_t join(EmuComm& c) {
    int fd = shm_open(c.name.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd < 0) {
        c.last_error = "shm_open " + c.name + ": " + std::strerror(errno);
        return SYSTEM_ERROR;
    }
    // Every rank sizes it alike; the new pages are zeros (the counters).
    bool ok = ftruncate(fd, (off_t)segment_bytes(c.n)) == 0;
    void* m = ok ? mmap(nullptr, segment_bytes(c.n), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                 : MAP_FAILED;
    close(fd);
    if (m == MAP_FAILED) {
        c.last_error = "mapping " + c.name + ": " + std::strerror(errno);
        shm_unlink(c.name.c_str());
        return SYSTEM_ERROR;
    }
    c.seg = static_cast<Segment*>(m);
    c.seg->pid[c.rank] = getpid();
    c.seg->joined.fetch_add(1);
    ncclResult_t r = await(c, [&] { return c.seg->joined.load() >= (uint64_t)c.n; });
    // Everyone has it mapped (or the join failed): the name can go.
    if (c.rank == 0 || r != SUCCESS) shm_unlink(c.name.c_str());
    return r;
}
}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* v) {
    *v = 22703;  // the 2.27 API zcuda's config is cut to
    return SUCCESS;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    static std::atomic<unsigned> made{0};
    std::memset(id->internal, 0, sizeof id->internal);
    auto t = std::chrono::steady_clock::now().time_since_epoch().count();
    std::snprintf(id->internal, sizeof id->internal, "/zcuda-emu-nccl-%d-%u-%llx", (int)getpid(),
                  made.fetch_add(1), (unsigned long long)t);
    return SUCCESS;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int n, ncclUniqueId id, int rank, void*) {
    if (n < 1 || n > MAX_RANKS || rank < 0 || rank >= n || id.internal[0] != '/') {
        return INVALID_ARGUMENT;
    }
    EmuComm* c = new EmuComm;
    c->rank = rank;
    c->n = n;
    c->name.assign(id.internal, strnlen(id.internal, sizeof id.internal));
    c->worker = std::thread(run_queue, c);
    enqueue(c, [c] {
        ncclResult_t r = join(*c);
        c->state = r;
        return r;
    });
    *comm = c;
    return IN_PROGRESS;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int n, ncclUniqueId id, int rank) {
    return ncclCommInitRankConfig(comm, n, id, rank, nullptr);
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, int type, int op,
                           ncclComm_t c, void*) {
    if (!c || type != T_FLOAT32 || op != OP_SUM) return INVALID_ARGUMENT;
    enqueue(c, [=] {
        return all_reduce(*c, static_cast<const float*>(send), static_cast<float*>(recv), count);
    });
    return SUCCESS;
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, int type, int op,
                               ncclComm_t c, void*) {
    if (!c || type != T_FLOAT32 || op != OP_SUM) return INVALID_ARGUMENT;
    enqueue(c, [=] {
        return reduce_scatter(*c, static_cast<const float*>(send), static_cast<float*>(recv),
                              count);
    });
    return SUCCESS;
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, int type, ncclComm_t c,
                           void*) {
    size_t size = type_size(type);
    if (!c || size == 0) return INVALID_ARGUMENT;
    enqueue(c, [=] {
        return all_gather(*c, static_cast<const char*>(send), static_cast<char*>(recv),
                          count * size);
    });
    return SUCCESS;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t* state) {
    if (!c) return INVALID_ARGUMENT;
    *state = c->state.load();
    return SUCCESS;
}

const char* ncclGetLastError(ncclComm_t c) {
    static thread_local std::string text;
    if (!c) return "";
    std::lock_guard<std::mutex> hold(c->lock);
    text = c->last_error;
    return text.c_str();
}

// Stops the queue (a running collective gives up at its next wait), then
// frees the communicator.
ncclResult_t ncclCommAbort(ncclComm_t c) {
    if (!c) return SUCCESS;
    c->aborted = true;
    {
        std::lock_guard<std::mutex> hold(c->lock);
        c->wake.notify_one();
    }
    c->worker.join();
    for (size_t left = c->queue.size(); left > 0; left--) zcuda_emu_stream_busy(-1);
    if (c->seg) munmap(c->seg, segment_bytes(c->n));
    delete c;
    return SUCCESS;
}

ncclResult_t ncclCommDestroy(ncclComm_t c) { return ncclCommAbort(c); }

const char* ncclGetErrorString(ncclResult_t r) {
    switch (r) {
        case SUCCESS: return "no error";
        case SYSTEM_ERROR: return "unhandled system error";
        case INVALID_ARGUMENT: return "invalid argument";
        case REMOTE_ERROR: return "remote process exited or there was a network error";
        case IN_PROGRESS: return "NCCL operation in progress";
        default: return "unknown result code";
    }
}

}  // extern "C"
