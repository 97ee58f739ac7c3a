#!/usr/bin/env python3
"""PyTorch beside `zrun train configs/gpt-anchor.yaml`: the same GPT-2-shaped
model (6 layers, d_model 384, 6 heads, seq 256, byte vocabulary, a head
without bias; GELU in torch's default erf form where zrun's is GPT-2's tanh
form, of like cost), micro-batch 8 per process, AdamW lr 3e-4 weight decay
0.1, random bytes. Two ways to run it:

    single   one process on THREADS threads (default 2)
    ddp      2 processes of 1 thread, DistributedDataParallel over gloo

and two precisions (`--dtype f32`, the default, or `bf16`: f32 weights and
optimizer with the forward and backward under torch.autocast("cpu",
dtype=torch.bfloat16), as mixed-precision CPU training runs in PyTorch; its
matmuls go to oneDNN, which uses AMX where the CPU has it). Prints one JSON
line per run: its name and the median job-wide tokens/s after 3 warm-up
steps (`values`: every measured step's).

    python3 scripts/peers/torch_peer.py single ddp --dtype f32     # needs torch
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# PEER_SHAPE=layers,d_model,heads,seq (in the environment, which the DDP
# ranks inherit) trains another shape of the same family, beside zrun's
# `--set model.n_layers=… --set model.d_model=… --set model.n_heads=… --set model.seq_len=…`.
L, D, H, S = (int(x) for x in os.environ.get("PEER_SHAPE", "6,384,6,256").split(","))
# PEER_VOCAB=50304 (GPT-2's vocabulary, padded) beside zrun's
# `--set model.vocab_size=50304`: random tokens from that many.
V, B = int(os.environ.get("PEER_VOCAB", "256")), 8
WARMUP, STEPS = 3, 10


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln2, self.fc, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, H, D // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, D))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(S, D)
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def batches(rank):
    """Each rank's own random bytes: WARMUP + STEPS micro-batches of B × (S + 1)."""
    g = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(0, V, (WARMUP + STEPS, B, S + 1), generator=g)


def train(step, rank, world):
    """Runs the steps; the job-wide tokens/s of each measured one."""
    rates = []
    for i, batch in enumerate(batches(rank)):
        x, y = batch[:, :-1], batch[:, 1:]
        t0 = time.perf_counter()
        step(x, y)
        if i >= WARMUP:
            rates.append(world * B * S / (time.perf_counter() - t0))
    return rates


def report(name, rates):
    print(json.dumps({"name": name, "tokens_per_s": round(statistics.median(rates)),
                      "values": [round(r, 1) for r in rates]}), flush=True)


def run(rank, world, bf16, port):
    torch.manual_seed(0)
    if world > 1:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        model = DDP(GPT())
    else:
        model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x).reshape(-1, V).float(), y.reshape(-1))
        loss.backward()
        opt.step()

    rates = train(step, rank, world)
    dtype = "bf16" if bf16 else "f32"
    if rank == 0:
        name = f"torch ddp {dtype} 2 ranks" if world > 1 else f"torch single {dtype} {torch.get_num_threads()} threads"
        report(name, rates)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def spawn(target, world, *args):
    """`target(rank, world, *args)` in `world` fresh processes; exit codes checked."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        print(json.dumps({"name": target.__module__, "error": f"worker exit codes {codes}"}), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modes", nargs="*", default=["single", "ddp"], choices=["single", "ddp"])
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    args = ap.parse_args()
    for mode in args.modes:
        if mode == "single":
            torch.set_num_threads(int(os.environ.get("THREADS", "2")))
            run(0, 1, args.dtype == "bf16", 0)
        else:
            spawn(run, 2, args.dtype == "bf16", 29600)
