// A block's CUDA threads as fibers of one OS thread: each thread of the
// block gets its own stack, and runs until it waits at a barrier (then the
// next runnable one runs) or returns. A barrier releases its waiters when
// the last of its expected threads arrives; that one goes on at once, the
// others when the scheduler comes round to them. Switching is a handful of
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
#include <mutex>
#include <thread>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

struct EmuFiber {
    void* sp = nullptr;  // saved stack pointer while switched out
    char* stack = nullptr;
    bool runnable = true, done = false;
#if !defined(__x86_64__)
    ucontext_t context;
#endif
};

// Each fiber's stack: the kernels keep small per-thread arrays (the fused
// attention's fragments are the largest, a few KiB); a guard page below
// turns an overflow into a fault rather than a neighbour's corruption.
inline constexpr size_t EMU_STACK_BYTES = 256 * 1024;
inline constexpr size_t EMU_GUARD_BYTES = 4096;

// Stacks are mapped once and reused by every launch on every OS thread
// (only the pages a fiber touches become memory).
inline std::mutex emu_stack_pool_lock;
inline std::vector<char*> emu_stack_pool;

inline char* emu_stack_take() {
    {
        std::lock_guard<std::mutex> hold(emu_stack_pool_lock);
        if (!emu_stack_pool.empty()) {
            char* s = emu_stack_pool.back();
            emu_stack_pool.pop_back();
            return s;
        }
    }
    void* m = mmap(nullptr, EMU_STACK_BYTES + EMU_GUARD_BYTES, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
        std::fprintf(stderr, "zcuda-emu: mapping a fiber stack failed\n");
        std::abort();
    }
    mprotect(m, EMU_GUARD_BYTES, PROT_NONE);
    return static_cast<char*>(m) + EMU_GUARD_BYTES;
}

inline void emu_stack_give(char* s) {
    std::lock_guard<std::mutex> hold(emu_stack_pool_lock);
    emu_stack_pool.push_back(s);
}

// The running block's fibers, which one runs, the scheduler's saved stack
// pointer, and what each fiber runs.
inline thread_local std::vector<EmuFiber> emu_fibers;
inline thread_local unsigned emu_current;
inline thread_local void* emu_scheduler_sp;
inline thread_local EmuFiber* emu_scheduler_fiber;
inline thread_local const std::function<void()>* emu_fiber_body;

// emu_fiber.cpp: the switch (x86-64: pushes the callee-saved registers,
// stores the stack pointer in *save, loads `to` and pops the registers
// saved there), the first frame of a new fiber, and a fiber's whole life.
extern "C" void emu_switch(void** save, void* to);
extern "C" void emu_fiber_start();
extern "C" [[noreturn]] __attribute__((visibility("hidden"))) void emu_fiber_main();

// The running fiber waits: back to the scheduler until released.
inline void emu_yield() {
    EmuFiber& me = emu_fibers[emu_current];
#if defined(__x86_64__)
    emu_switch(&me.sp, emu_scheduler_sp);
#else
    swapcontext(&me.context, &emu_scheduler_fiber->context);
#endif
}

// A barrier of `expected` fibers of the running block.
struct EmuBarrier {
    unsigned expected = 0, arrived = 0;
    std::vector<unsigned> waiting;

    void expect(unsigned n) {
        expected = n;
        arrived = 0;
        waiting.clear();
    }

    void arrive_and_wait() {
        if (++arrived == expected) {
            arrived = 0;
            for (unsigned w : waiting) emu_fibers[w].runnable = true;
            waiting.clear();
            return;
        }
        waiting.push_back(emu_current);
        emu_fibers[emu_current].runnable = false;
        emu_yield();
    }
};

// Runs `body` as `n` fibers, `enter(i)` called each time fiber i is
// switched to (it restores threadIdx); returns when all have returned.
// Fibers that all wait with none to release them are a kernel's deadlock
// (a barrier some threads skip): reported, then abort.
template <class Enter>
void emu_run_fibers(unsigned n, Enter enter, const std::function<void()>& body) {
    emu_fibers.assign(n, EmuFiber{});
    emu_fiber_body = &body;
#if !defined(__x86_64__)
    EmuFiber scheduler;
    emu_scheduler_fiber = &scheduler;
#endif
    for (unsigned i = 0; i < n; i++) {
        EmuFiber& f = emu_fibers[i];
        f.stack = emu_stack_take();
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
    unsigned live = n;
    while (live > 0) {
        bool ran = false;
        for (unsigned i = 0; i < n; i++) {
            EmuFiber& f = emu_fibers[i];
            if (f.done || !f.runnable) continue;
            emu_current = i;
            enter(i);
            ran = true;
#if defined(__x86_64__)
            emu_switch(&emu_scheduler_sp, f.sp);
#else
            swapcontext(&scheduler.context, &f.context);
#endif
            if (f.done) live--;
        }
        if (!ran) {
            std::fprintf(stderr,
                         "zcuda-emu: deadlock: %u of the block's %u threads wait at barriers that "
                         "the others never reach\n",
                         live, n);
            std::abort();
        }
    }
    for (EmuFiber& f : emu_fibers) emu_stack_give(f.stack);
}

// OS threads a launch spreads its blocks over: the CPUs this process may
// use (at least 1).
inline unsigned emu_os_threads() {
    static const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    return n;
}
