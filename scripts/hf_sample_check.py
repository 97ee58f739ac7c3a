#!/usr/bin/env python3
"""`zrun sample` on a model that `transformers` wrote (not run in CI).

The other way round from `hf_crosscheck.py`: builds a small GPT-2, LLaMA, Qwen2, Qwen3, Mistral or Phi-3
with `transformers` itself (its own config.json keys, its own tensor names;
weights drawn at std 0.3 so that the logits are far from uniform), saves it
with `save_pretrained`, continues a byte prompt greedily with the model's
own forward (the last `max_position_embeddings` bytes at each step; Mistral
and Phi-3 with a sliding window shorter than that, and Qwen2 and Qwen3 with
`--sliding-window N`), and
compares with `zrun sample DIR --temperature 0`. A key zrun reads wrongly
(the rotary base transformers 5 keeps under `rope_parameters` was one, until
the sixty-ninth session) changes the continuation within a few bytes.

    /tmp/peerenv/venv/bin/pip install transformers
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py gpt2 --zrun target/release/zrun
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py llama --zrun target/release/zrun
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py llama --max-shard-size 40KB
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py llama --rope-scaling llama3
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py llama --rope-scaling yarn
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py llama --bf16
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py qwen2
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py qwen3
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py qwen3 --sliding-window 20
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py mistral
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py phi3
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py phi3 --rope-scaling longrope
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py phi3 --partial-rotary-factor 0.75 --rope-scaling longrope
    /tmp/peerenv/venv/bin/python scripts/hf_sample_check.py llama --repetition-penalty 1.3

`--max-shard-size` saves the model in shards with an index
(`model.safetensors.index.json`), as published models past a few GB are.
`--bf16` rounds the weights to bf16 and saves them so, as most published
models are; transformers continues the prompt with those values in f32,
which is what zrun computes (it keeps the bf16 weights and widens them as
it multiplies). `--repetition-penalty R` penalises the tokens already in the
text with transformers' own `RepetitionPenaltyLogitsProcessor` at each
step, and writes `{"repetition_penalty": R}` as the directory's
`generation_config.json`, which zrun is to read and apply.

Exit status 0 when the continuations are the same, 1 otherwise.
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch
from transformers import RepetitionPenaltyLogitsProcessor
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)


SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    # Each pair's own divisors, the long ones past 16 tokens (the prompt and
    # the continuation cross it); the attention factor from 64 over 16.
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 16,
                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.6, 3.3, 4.0],
                 "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]},
}


def build(kind: str, rope_scaling=None, partial_rotary_factor=None, window=None):
    if kind == "gpt2":
        return GPT2LMHeadModel(
            GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64)
        )
    # The LLaMA family's shape, grouped-query attention (4 heads on 2).
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 rope_theta=500.0, rope_scaling=rope_scaling)
    # Qwen's window on every layer (max_window_layers 0), where asked for.
    qwen_window = dict(use_sliding_window=True, sliding_window=window,
                       max_window_layers=0) if window else {}
    if kind == "qwen2":
        # LLaMA with biases on q, k and v (Qwen2.5's small models are tied).
        return Qwen2ForCausalLM(Qwen2Config(**shape, **qwen_window, tie_word_embeddings=True))
    if kind == "qwen3":
        # Heads of 24, wider than 64 / 4, and each head's q and k normed.
        return Qwen3ForCausalLM(Qwen3Config(**shape, **qwen_window, head_dim=24,
                                            tie_word_embeddings=True))
    if kind == "mistral":
        # LLaMA's layout with a sliding window (24 unless asked) shorter
        # than its positions (64): the continuation slides past it.
        return MistralForCausalLM(MistralConfig(**shape, sliding_window=window or 24))
    if kind == "phi3":
        # LLaMA's model, q, k and v (and gate and up) stored as one tensor
        # each; its window (47 unless asked) shorter than its positions
        # (64).
        # Phi-3.5 publishes LongRoPE's original context beside the scaling
        # (transformers' Phi-3 defaults it to 4096), not within it.
        extra = {}
        if rope_scaling and rope_scaling["rope_type"] == "longrope":
            rope_scaling = dict(rope_scaling, type="longrope")
            extra["original_max_position_embeddings"] = rope_scaling.pop("original_max_position_embeddings")
            del rope_scaling["rope_type"]
            shape["rope_scaling"] = rope_scaling
        if partial_rotary_factor:
            extra["partial_rotary_factor"] = partial_rotary_factor
            if rope_scaling:
                # One factor for each turned pair.
                pairs = int(16 * partial_rotary_factor) // 2
                for key in ("short_factor", "long_factor"):
                    rope_scaling[key] = rope_scaling[key][:pairs]
        return Phi3ForCausalLM(Phi3Config(**shape, **extra, sliding_window=window or 47,
                                          pad_token_id=0, bos_token_id=1, eos_token_id=2))
    return LlamaForCausalLM(LlamaConfig(**shape))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["gpt2", "llama", "qwen2", "qwen3", "mistral", "phi3"])
    ap.add_argument("--zrun", default="target/release/zrun")
    ap.add_argument("--prompt", default="fn main() {")
    ap.add_argument("--tokens", type=int, default=80)
    ap.add_argument("--max-shard-size", help="save in shards of at most this size (e.g. 40KB)")
    ap.add_argument("--rope-scaling", choices=sorted(SCALINGS),
                    help="scale the rotary embedding (LLaMA: Llama 3.1's llama3, linear, YaRN, dynamic NTK "
                         "or LongRoPE; Phi-3: LongRoPE, as Phi-3.5 publishes it)")
    ap.add_argument("--partial-rotary-factor", type=float,
                    help="Phi-3: turn only this share of each head (Phi-4-mini's 0.75)")
    ap.add_argument("--sliding-window", type=int,
                    help="Mistral, Phi-3: this window instead of 24 / 47; Qwen2, Qwen3: this window "
                         "on every layer (use_sliding_window, max_window_layers 0)")
    ap.add_argument("--bf16", action="store_true", help="weights rounded to bf16 and saved so")
    ap.add_argument("--repetition-penalty", type=float,
                    help="greedy under this repetition penalty (generation_config.json's)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.partial_rotary_factor and args.kind != "phi3":
        ap.error("--partial-rotary-factor is Phi-3's")
    if args.sliding_window and args.kind not in ("mistral", "phi3", "qwen2", "qwen3"):
        ap.error("--sliding-window is Mistral's, Phi-3's, Qwen2's and Qwen3's")
    model = build(args.kind, SCALINGS.get(args.rope_scaling), args.partial_rotary_factor,
                  args.sliding_window)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Biases too (zero at initialisation, they would test nothing).
            if p.dim() > 1 or name.endswith(".bias"):
                p.normal_(0, 0.3)
            elif "norm" in name:
                # Norm weights away from their ones (Qwen3's q and k norms'
                # would otherwise test only that they are there).
                p.normal_(1, 0.3)
            if args.bf16:
                p.copy_(p.to(torch.bfloat16).float())
    model.eval()
    # The model's context: zrun samples from a window of its last 64 bytes
    # too, each layer's attention bounded by the sliding window within it.
    context = 64
    ids = torch.tensor([list(args.prompt.encode())])
    with torch.no_grad():
        for _ in range(args.tokens):
            logits = model(ids[:, -context:]).logits[0, -1]
            if args.repetition_penalty:
                penalty = RepetitionPenaltyLogitsProcessor(args.repetition_penalty)
                logits = penalty(ids, logits[None])[0]
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    want = bytes(ids[0].tolist())
    with tempfile.TemporaryDirectory() as out:
        shards = {"max_shard_size": args.max_shard_size} if args.max_shard_size else {}
        if args.bf16:
            model = model.to(torch.bfloat16)
        model.save_pretrained(out, safe_serialization=True, **shards)
        if args.repetition_penalty:
            with open(os.path.join(out, "generation_config.json"), "w") as f:
                f.write('{"repetition_penalty": %r}' % args.repetition_penalty)
        if args.max_shard_size:
            files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
            print(f"saved in {len(files)} shards: {files[0]} ... {files[-1]}")
        run = subprocess.run(
            [args.zrun, "sample", out, "--prompt", args.prompt,
             "--tokens", str(args.tokens), "--temperature", "0"],
            capture_output=True,
        )
    got = run.stdout.rstrip(b"\n")
    print(f"transformers -> {want!r}")
    print(f"zrun sample  -> {got!r}")
    if run.returncode != 0:
        print(run.stderr.decode(), file=sys.stderr)
        return 1
    same = got == want
    print("OK: the same greedy continuation" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
