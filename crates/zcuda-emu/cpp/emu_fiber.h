// A block's CUDA threads as fibers of one OS thread: each thread of the
// block gets its own stack, and runs until it waits at a barrier (then the
// next runnable one of its warp runs, else of the block: emu_yield) or
// returns. A barrier releases its waiters when
// the last of its expected threads arrives; that one goes on at once, the
// others when their turn comes round (a waiting fiber switches straight to
// the next runnable one). Switching is a handful of
// register moves (x86-64 assembly below; ucontext elsewhere), where an OS
// thread per CUDA thread cost a thread start per thread per block and a
// futex wake per barrier: the emulation of a GPT step went from minutes to
// seconds.
//
// Everything here is the OS thread's own (thread_local), so that several
// OS threads can each run a block at once.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// Built with ThreadSanitizer (build.rs, ZCUDA_EMU_TSAN=1), the fibers are
// TSan's fibers, switched without synchronising, and what orders a block's
// threads on a GPU is told to TSan as releases and acquires: each barrier,
// and a block's start and end. TSan then reports two threads of a block
// that touch the same memory, one writing, with no barrier between: a race
// on a GPU whatever order the warps run in here.
// The scheduler's own bookkeeping (which fiber runs, who waits on what)
// passes between fibers with no such order and is left out (EMU_NO_TSAN).
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define EMU_TSAN(...) __VA_ARGS__
#define EMU_NO_TSAN __attribute__((no_sanitize_thread, noinline))
#else
#define EMU_TSAN(...)
#define EMU_NO_TSAN
#endif

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

// A barrier of `expected` fibers of the running block: each release starts
// a new generation; a fiber waits until the generation it arrived in ends.
struct EmuBarrier {
    unsigned expected = 0, arrived = 0, generation = 0;

    void expect(unsigned n) {
        expected = n;
        arrived = 0;
    }

    EMU_NO_TSAN inline void arrive_and_wait();
};

struct EmuFiber {
    void* sp = nullptr;  // saved stack pointer while switched out
    char* stack = nullptr;
    const EmuBarrier* waiting_on = nullptr;
    unsigned wait_generation = 0;
    bool done = false;
    void* tsan = nullptr;  // TSan's fiber (see EMU_TSAN)
#if !defined(__x86_64__)
    ucontext_t context;
#endif

    EMU_NO_TSAN bool runnable() const {
        return !done && (!waiting_on || waiting_on->generation != wait_generation);
    }
};

// Each fiber's stack: the kernels keep small per-thread arrays (the fused
// attention's fragments are the largest, a few KiB); a guard page below
// turns an overflow into a fault rather than a neighbour's corruption.
inline constexpr size_t EMU_STACK_BYTES = 256 * 1024;
inline constexpr size_t EMU_GUARD_BYTES = 4096;

// Stacks are mapped once and reused by every launch on every OS thread
// (only the pages a fiber touches become memory). A block takes its
// fibers' stacks, and gives them back, under one lock: a lock a fiber,
// contended by the launch's other OS threads, was 8% of an emulated
// training step.
inline std::mutex emu_stack_pool_lock;
inline std::vector<char*> emu_stack_pool;

inline char* emu_stack_map() {
    void* m = mmap(nullptr, EMU_STACK_BYTES + EMU_GUARD_BYTES, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
        std::fprintf(stderr, "zcuda-emu: mapping a fiber stack failed\n");
        std::abort();
    }
    mprotect(m, EMU_GUARD_BYTES, PROT_NONE);
    return static_cast<char*>(m) + EMU_GUARD_BYTES;
}

// Gives fibers[0..n) a stack each: the pool's, then new ones.
inline void emu_stacks_take(EmuFiber* fibers, unsigned n) {
    unsigned taken = 0;
    {
        std::lock_guard<std::mutex> hold(emu_stack_pool_lock);
        for (; taken < n && !emu_stack_pool.empty(); taken++) {
            fibers[taken].stack = emu_stack_pool.back();
            emu_stack_pool.pop_back();
        }
    }
    for (; taken < n; taken++) fibers[taken].stack = emu_stack_map();
}

inline void emu_stacks_give(const EmuFiber* fibers, unsigned n) {
    std::lock_guard<std::mutex> hold(emu_stack_pool_lock);
    for (unsigned i = 0; i < n; i++) emu_stack_pool.push_back(fibers[i].stack);
}

// An OS thread's emulation state: it runs one block at a time, so that
// these (and __shared__ memory) are its own. Reached through one pointer,
// `emu_self`, so that an emulated instruction looks up one thread-local
// variable, not several (in a library opened with dlopen, each look-up
// may be a call: a quarter of libcuda.so's time when every variable here
// was thread_local).
inline constexpr unsigned EMU_MAX_FIBERS = 1024;
struct EmuThread {
    dim3 thread_idx, block_idx, block_dim, grid_dim;
    // The block's barrier and its warps'.
    EmuBarrier block, warps[32];
    // The warps' exchange slots (emu.h: shuffles, tensor-core fragments),
    // two sets, by the parity of the warp barrier's generation, so that one
    // barrier per exchange suffices: a set is written again only two
    // barriers later, when every lane has read it.
    float lanes[2][32][32];
    double lanes_f64[2][32][32];
    unsigned mma_a[2 * 32][32][4], mma_b[2 * 32][32][2];
    // The block's fibers, which one runs, how many have not returned.
    EmuFiber fibers[EMU_MAX_FIBERS];
    unsigned fiber_count = 0, current = 0, live = 0;
    // The scheduler's saved stack pointer (or context), what fibers run.
    void* scheduler_sp = nullptr;
    EmuFiber* scheduler_fiber = nullptr;
    void* tsan_scheduler = nullptr;  // the OS thread's own TSan fiber
    // TSan's fibers for the block's threads, made as a block first needs
    // them and kept for the OS thread's next blocks: making one clears
    // hundreds of KiB of TSan's state, and a fiber a thread a block was
    // three quarters of a TSan run. Reuse hides nothing: a block's fiber i
    // runs after the OS thread's blocks before it anyway (block start and
    // end, below).
    void* tsan_fibers[EMU_MAX_FIBERS] = {};
    unsigned tsan_fibers_made = 0;
    // What TSan is told a block's start and end synchronise on.
    char tsan_block_start = 0, tsan_block_end = 0;
    const std::function<void()>* body = nullptr;
    // Which warp runs ahead: the first (warp 0, then 1, ...) or, reversed,
    // the last (see emu_yield). Set by each launch for the OS threads it
    // runs blocks on (emu.h: emu_launch).
    bool reverse_warps = false;
    // The order this OS thread's own launches ask for: -1 the process's
    // default (emu_default_warp_order), 0 first warp ahead, 1 last warp
    // ahead (emu_set_warp_order, for tests that run a kernel both ways).
    int launch_warp_order = -1;

#if defined(__SANITIZE_THREAD__)
    EMU_NO_TSAN ~EmuThread() {
        for (unsigned i = 0; i < tsan_fibers_made; i++) __tsan_destroy_fiber(tsan_fibers[i]);
    }
#endif
};
inline thread_local EmuThread emu_thread;
inline thread_local EmuThread* emu_self;

// Points emu_self at this OS thread's state (once per launch per thread).
EMU_NO_TSAN inline void emu_enter_thread() { emu_self = &emu_thread; }

#define threadIdx (emu_self->thread_idx)
#define blockIdx (emu_self->block_idx)
#define blockDim (emu_self->block_dim)
#define gridDim (emu_self->grid_dim)

// emu_fiber.cpp: the switch (x86-64: pushes the callee-saved registers,
// stores the stack pointer in *save, loads `to` and pops the registers
// saved there), the first frame of a new fiber, and a fiber's whole life.
extern "C" void emu_switch(void** save, void* to);
extern "C" void emu_fiber_start();
extern "C" [[noreturn]] __attribute__((visibility("hidden"))) void emu_fiber_main();

// Whether launches run the last warp ahead by default: the environment's
// ZCUDA_EMU_WARP_ORDER, `forward` (or unset: warp 0 first) or `reverse`,
// read once; any other value stops the process, saying so.
EMU_NO_TSAN inline bool emu_default_warp_order() {
    static const bool reverse = [] {
        const char* v = std::getenv("ZCUDA_EMU_WARP_ORDER");
        if (!v || std::string_view(v) == "forward" || std::string_view(v).empty()) return false;
        if (std::string_view(v) == "reverse") return true;
        std::fprintf(stderr, "zcuda-emu: ZCUDA_EMU_WARP_ORDER=%s: expected forward or reverse\n", v);
        std::abort();
    }();
    return reverse;
}

// The running fiber waits: on to the next runnable fiber of its own warp
// (in order, round the warp), else the next runnable one after it (round
// the block; before it, reversed), or back to the scheduler where none is
// (the block is deadlocked, or every other fiber has returned). Its own
// warp first, so that a warp runs ahead of the others as far as it can,
// to the block's next barrier: a kernel that lets one warp overwrite
// shared memory that another has yet to read, or read what another has
// yet to write, without a __syncthreads between them, then reads the
// wrong values here as it could on a GPU (warps in lockstep, as round the
// block alone had them, hid such races: every warp reached each warp-wide
// operation before any went past it). Which warp goes first decides which
// races show: with warp 0 ahead, a value that thread 0 writes for the
// whole block with no barrier before the others read it is there when
// they read; with the last warp ahead, they read before it is written.
// The tests run every kernel both ways (ZCUDA_EMU_WARP_ORDER).
// Switches from the running fiber to fiber `i`, which runs until it
// waits; returns when a fiber switches back to this one.
EMU_NO_TSAN inline void emu_switch_to(unsigned i) {
    EmuFiber& from = emu_self->fibers[emu_self->current];
    EmuFiber& to = emu_self->fibers[i];
    to.waiting_on = nullptr;
    emu_self->current = i;
    threadIdx = {i, 0, 0};
    EMU_TSAN(__tsan_switch_to_fiber(to.tsan, __tsan_switch_to_fiber_no_sync));
#if defined(__x86_64__)
    emu_switch(&from.sp, to.sp);
#else
    swapcontext(&from.context, &to.context);
#endif
}

EMU_NO_TSAN inline void emu_yield() {
    unsigned me = emu_self->current, n = emu_self->fiber_count;
    EmuFiber& from = emu_self->fibers[me];
    // Switches to fiber i if it can run.
    auto run = [&](unsigned i) {
        if (!emu_self->fibers[i].runnable()) return false;
        emu_switch_to(i);
        return true;
    };
    unsigned warp0 = me / 32 * 32, width = std::min(32u, n - warp0);
    for (unsigned k = 1; k < width; k++) {
        if (run(warp0 + (me - warp0 + k) % width)) return;
    }
    bool reverse = emu_self->reverse_warps;
    for (unsigned k = 1; k < n; k++) {
        unsigned i = reverse ? (me >= k ? me - k : me + n - k) : (me + k < n ? me + k : me + k - n);
        if (run(i)) return;
    }
    EMU_TSAN(__tsan_switch_to_fiber(emu_self->tsan_scheduler, __tsan_switch_to_fiber_no_sync));
#if defined(__x86_64__)
    emu_switch(&from.sp, emu_self->scheduler_sp);
#else
    swapcontext(&from.context, &emu_self->scheduler_fiber->context);
#endif
}

// After the block's barrier releases, the next phase starts again from the
// warp that runs ahead (the first runnable fiber in the launch's order), not
// from the fiber that arrived last: in every phase the warps run in one
// order, 0 to the last or the last to 0, so that between the two orders
// every pair of warps runs both ways round.
EMU_NO_TSAN inline void emu_restart_phase() {
    unsigned me = emu_self->current, n = emu_self->fiber_count;
    bool reverse = emu_self->reverse_warps;
    for (unsigned k = 0; k < n; k++) {
        unsigned i = reverse ? n - 1 - k : k;
        if (i == me) return;
        if (!emu_self->fibers[i].runnable()) continue;
        // Back from here when a fiber that waits finds this one runnable.
        emu_switch_to(i);
        return;
    }
}

EMU_NO_TSAN inline void EmuBarrier::arrive_and_wait() {
    EMU_TSAN(__tsan_release(this));
    if (++arrived == expected) {
        arrived = 0;
        generation++;
        EMU_TSAN(__tsan_acquire(this));
        if (this == &emu_self->block) emu_restart_phase();
        return;
    }
    EmuFiber& me = emu_self->fibers[emu_self->current];
    me.waiting_on = this;
    me.wait_generation = generation;
    emu_yield();
    EMU_TSAN(__tsan_acquire(this));
}

#if defined(__SANITIZE_THREAD__)
// This OS thread's TSan fiber for thread `i` of its blocks (EmuThread::tsan_fibers).
EMU_NO_TSAN inline void* emu_tsan_fiber(unsigned i) {
    if (i == emu_self->tsan_fibers_made) emu_self->tsan_fibers[emu_self->tsan_fibers_made++] = __tsan_create_fiber(0);
    return emu_self->tsan_fibers[i];
}
#endif

// Runs `body` as `n` fibers (threadIdx.x = 0..n-1); returns when all have
// returned. Fibers that all wait with none to release them are a
// kernel's deadlock (a barrier some threads skip): reported, then abort.
EMU_NO_TSAN inline void emu_run_fibers(unsigned n, const std::function<void()>& body) {
    if (n > EMU_MAX_FIBERS) {
        std::fprintf(stderr, "zcuda-emu: a block of %u threads (at most %u)\n", n, EMU_MAX_FIBERS);
        std::abort();
    }
    emu_self->fiber_count = n;
    emu_self->body = &body;
#if !defined(__x86_64__)
    EmuFiber scheduler;
    emu_self->scheduler_fiber = &scheduler;
#endif
    EMU_TSAN(emu_self->tsan_scheduler = __tsan_get_current_fiber());
    for (unsigned i = 0; i < n; i++) {
        emu_self->fibers[i] = EmuFiber{};
        EMU_TSAN(emu_self->fibers[i].tsan = emu_tsan_fiber(i));
    }
    emu_stacks_take(emu_self->fibers, n);
    for (unsigned i = 0; i < n; i++) {
        EmuFiber& f = emu_self->fibers[i];
#if defined(__x86_64__)
        // The frame emu_switch pops: six registers, then emu_fiber_start
        // as the return address, above it a word of padding.
        void** top = reinterpret_cast<void**>(f.stack + EMU_STACK_BYTES);
        *--top = nullptr;
        *--top = reinterpret_cast<void*>(&emu_fiber_start);
        for (int r = 0; r < 6; r++) *--top = nullptr;
        f.sp = top;
#else
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack;
        f.context.uc_stack.ss_size = EMU_STACK_BYTES;
        f.context.uc_link = nullptr;
        makecontext(&f.context, reinterpret_cast<void (*)()>(&emu_fiber_main), 0);
#endif
    }
    // After the stacks are taken (their last fibers' accesses come before
    // their return to the pool, which a lock orders): every fiber starts
    // after all that came before the block on this OS thread.
    EMU_TSAN(__tsan_release(&emu_self->tsan_block_start));
    emu_self->live = n;
    // The first fiber to run is of the warp that runs ahead (emu_yield).
    bool reverse = emu_self->reverse_warps;
    unsigned next = reverse ? n - 1 : 0;
    while (emu_self->live > 0) {
        unsigned i = 0, k = 0;
        for (; k < n; k++) {
            i = reverse ? (next >= k ? next - k : next + n - k) : (next + k < n ? next + k : next + k - n);
            if (emu_self->fibers[i].runnable()) break;
        }
        if (k == n) {
            std::fprintf(stderr,
                         "zcuda-emu: deadlock: %u of the block's %u threads wait at barriers that "
                         "the others never reach\n",
                         emu_self->live, n);
            std::abort();
        }
        EmuFiber& f = emu_self->fibers[i];
        f.waiting_on = nullptr;
        emu_self->current = i;
        threadIdx = {i, 0, 0};
        next = reverse ? (i > 0 ? i - 1 : n - 1) : (i + 1 < n ? i + 1 : 0);
        EMU_TSAN(__tsan_switch_to_fiber(f.tsan, __tsan_switch_to_fiber_no_sync));
#if defined(__x86_64__)
        emu_switch(&emu_self->scheduler_sp, f.sp);
#else
        swapcontext(&scheduler.context, &f.context);
#endif
    }
    EMU_TSAN(__tsan_acquire(&emu_self->tsan_block_end));
    emu_stacks_give(emu_self->fibers, n);
}

// OS threads a launch spreads its blocks over: the CPUs this process may
// use (at least 1).
inline unsigned emu_os_threads() {
    static const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    return n;
}
