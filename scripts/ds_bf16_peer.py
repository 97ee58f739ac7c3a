#!/usr/bin/env python3
"""DeepSpeed beside `zrun train --set train.dtype=bf16` on the gpt-anchor job:
the GPT of torch_bf16_peer.py (beside this file) through deepspeed.initialize
with "bf16": {"enabled": true} (DeepSpeed casts the model to bf16 and keeps
f32 master weights in its optimizer), ZeRO stage 0-3, 2 ranks of 1 thread over
gloo, micro-batch 8 per rank, AdamW lr 3e-4 wd 0.1, random bytes. Prints the
median job-wide tokens/s after 3 warm-up steps for each stage:

    python3 scripts/ds_bf16_peer.py [z0 z1 z2 z3]        # needs torch and deepspeed
"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_bf16_peer import GPT, B, S, V  # noqa: E402

WARMUP, STEPS = 3, 10


def run(rank, world, stage, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1, "torch_adam": True}},
           "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
           "steps_per_print": 10**9, "wall_clock_breakdown": False}
    model = GPT()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    data = torch.randint(0, V, (WARMUP + STEPS, B, S + 1), generator=torch.Generator().manual_seed(1234 + rank))
    rates = []
    for i in range(WARMUP + STEPS):
        x, y = data[i, :, :-1], data[i, :, 1:]
        t0 = time.perf_counter()
        loss = F.cross_entropy(engine(x).reshape(-1, V).float(), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        if i >= WARMUP:
            rates.append(world * B * S / (time.perf_counter() - t0))
    if rank == 0:
        q.put(f"deepspeed bf16 z{stage} 2 ranks: {statistics.median(rates):.0f} tokens/s (loss {loss.item():.3f})")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp
    for mode in sys.argv[1:] or ["z0", "z1", "z2", "z3"]:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=run, args=(r, 2, int(mode[1]), 29710, q)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        while not q.empty():
            print(q.get(), flush=True)
        if any(p.exitcode for p in procs):
            print(f"deepspeed bf16 {mode}: worker exit codes {[p.exitcode for p in procs]}", flush=True)
