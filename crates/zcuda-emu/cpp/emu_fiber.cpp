// The fibers' switch and entry (see emu_fiber.h), compiled once into each
// library that runs kernels.
#include "emu_fiber.h"

#if defined(__x86_64__)
// emu_switch(save, to): pushes the callee-saved registers, stores the stack
// pointer in *save, loads `to` and pops the registers saved there.
asm(R"(
    .text
    .globl emu_switch
    .hidden emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch

    .globl emu_fiber_start
    .hidden emu_fiber_start
    .type emu_fiber_start, @function
emu_fiber_start:
    andq $-16, %rsp
    call emu_fiber_main
    ud2
    .size emu_fiber_start, .-emu_fiber_start
)");
#endif

// A fiber's whole life: the kernel body, then back to the scheduler for
// good.
extern "C" [[noreturn]] EMU_NO_TSAN void emu_fiber_main() {
    EMU_TSAN(__tsan_acquire(&emu_self->tsan_block_start));
    (*emu_self->body)();
    EMU_TSAN(__tsan_release(&emu_self->tsan_block_end));
    EmuFiber& me = emu_self->fibers[emu_self->current];
    me.done = true;
    emu_self->live--;
    EMU_TSAN(__tsan_switch_to_fiber(emu_self->tsan_scheduler, __tsan_switch_to_fiber_no_sync));
#if defined(__x86_64__)
    emu_switch(&me.sp, emu_self->scheduler_sp);
#else
    setcontext(&emu_self->scheduler_fiber->context);
#endif
    std::abort();  // a finished fiber is never switched to
}

