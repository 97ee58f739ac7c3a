#!/usr/bin/env python3
"""DeepSpeed beside `zrun train configs/gpt-anchor.yaml --set zero.stage=N`:
the GPT of torch_peer.py (beside this file) through deepspeed.initialize on
its CPU accelerator, ZeRO stage 0-3, 2 ranks of 1 thread over gloo,
micro-batch 8 per rank, AdamW lr 3e-4 weight decay 0.1 (torch's AdamW:
`"torch_adam": true`), random bytes. `--dtype bf16` adds `"bf16": {"enabled":
true}` (DeepSpeed casts the model to bf16 and keeps f32 master weights in its
optimizer). Prints one JSON line per stage: its name and the median job-wide
tokens/s after 3 warm-up steps.

    python3 scripts/peers/ds_peer.py z0 z1 z2 z3 --dtype f32     # needs torch and deepspeed
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_peer import GPT, B, V, report, spawn, train  # noqa: E402


def run(rank, world, stage, bf16, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1, "torch_adam": True}},
           "bf16": {"enabled": bf16}, "zero_optimization": {"stage": stage},
           "steps_per_print": 10**9, "wall_clock_breakdown": False}
    model = GPT()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(x, y):
        loss = F.cross_entropy(engine(x).reshape(-1, V).float(), y.reshape(-1))
        engine.backward(loss)
        engine.step()  # zeroes the gradients too

    rates = train(step, rank, world)
    if rank == 0:
        report(f"deepspeed z{stage} {'bf16' if bf16 else 'f32'} 2 ranks", rates)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stages", nargs="*", default=["z0", "z1", "z2", "z3"], choices=["z0", "z1", "z2", "z3"])
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    args = ap.parse_args()
    for stage in args.stages:
        spawn(run, 2, int(stage[1]), args.dtype == "bf16", 29710)
