#!/usr/bin/env python3
"""PyTorch beside `zrun train` on the gpt-anchor job in bf16: the same GPT
(6 layers, d_model 384, 6 heads, seq 256, byte vocab, micro-batch 8, AdamW
lr 3e-4 wd 0.1, random bytes), one process on THREADS threads (default 2),
f32 weights and optimizer with the forward and backward under
torch.autocast("cpu", dtype=torch.bfloat16), as mixed-precision PyTorch
training on CPU runs (its matmuls go to oneDNN, which uses AMX where the
CPU has it). Prints the median tokens/s after 3 warm-up steps, for f32 and
for bf16:

    THREADS=2 python3 scripts/torch_bf16_peer.py      # needs torch
"""
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

L, D, H, S, V, B = 6, 384, 6, 256, 256, 8


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


def tokens_per_s(bf16, warmup=3, steps=10):
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    data = torch.randint(0, V, (warmup + steps, B, S + 1), generator=torch.Generator().manual_seed(1234))
    rates = []
    for i in range(warmup + steps):
        x, y = data[i, :, :-1], data[i, :, 1:]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x).reshape(-1, V).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        if i >= warmup:
            rates.append(B * S / (time.perf_counter() - t0))
    return statistics.median(rates)


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    for bf16 in (False, True):
        print(f"torch {'bf16' if bf16 else 'f32'} threads {torch.get_num_threads()}: "
              f"{tokens_per_s(bf16):.0f} tokens/s")
