"""The gpt-anchor job (configs/gpt-anchor.yaml) in PyTorch on one GPU, f32 (no
TF32), AdamW, the peer that `zrun train configs/gpt-anchor.yaml --set
device=cuda --workers-per-node 1` is measured beside. Same model as zrun's
GPT-2 family: 6 layers, d 384, 6 heads, seq 256, byte vocab, learned positions,
pre-LN, GELU (tanh) MLP 4x, biases, LM head tied to the token embedding,
micro-batch 8, random bytes (LAYERS, D_MODEL, HEADS, SEQ, VOCAB, BATCH change the
shape, as `--set model.…` does for zrun; TF32=1 allows TF32 products, as
`--set train.allow_tf32=true` does; BF16=1 runs the forward and the loss under
bf16 autocast, PyTorch's mixed precision beside `--set train.dtype=bf16`). Prints the median tokens/s over STEPS steps after
WARMUP (each step synchronised: zero_grad + forward + backward + AdamW).

    python3 scripts/torch_gpu_peer.py [eager|compile]
"""
import json, os, statistics, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

env = lambda k, v: int(os.environ.get(k, v))
L, D, H, S, V, B = env("LAYERS", 6), env("D_MODEL", 384), env("HEADS", 6), env("SEQ", 256), env("VOCAB", 256), env("BATCH", 8)
WARMUP, STEPS = int(os.environ.get("WARMUP", "5")), int(os.environ.get("STEPS", "30"))
TF32 = os.environ.get("TF32", "0") == "1"  # zrun's train.allow_tf32
torch.backends.cuda.matmul.allow_tf32 = TF32
torch.backends.cudnn.allow_tf32 = TF32
BF16 = os.environ.get("BF16", "0") == "1"  # zrun's train.dtype: bf16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D); self.qkv = nn.Linear(D, 3 * D); self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D); self.fc = nn.Linear(D, 4 * D); self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, H, D // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, D))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D); self.wpe = nn.Embedding(S, D)
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.ln_f = nn.LayerNorm(D)
        for m in self.modules():  # GPT-2's initialisation, as zrun's
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.wte.weight.t()


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "eager"
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT().to(dev)
    step_model = torch.compile(model) if mode == "compile" else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    g = torch.Generator(device="cpu").manual_seed(1234)
    data = torch.randint(0, V, (WARMUP + STEPS, B, S + 1), generator=g).to(dev)
    times, losses = [], []
    for i in range(WARMUP + STEPS):
        x, y = data[i, :, :-1], data[i, :, 1:]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=BF16):
            logits = step_model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0); losses.append(loss.item())
    print(json.dumps({"name": f"torch_gpu_{mode}", "tokens_per_s": round(B * S / statistics.median(times)),
                      "step_ms": round(1e3 * statistics.median(times), 2), "loss_last": losses[-1],
                      "device": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
