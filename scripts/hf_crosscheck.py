#!/usr/bin/env python3
"""Cross-check zrun's model against Hugging Face `transformers` (not run in CI).

Exports a zrun checkpoint with `zrun export --format hf`, loads it with
`AutoModelForCausalLM.from_pretrained`, and compares the greedy continuation
of a byte-level prompt (N tokens, each the argmax of the logits after the
ones before) with `zrun sample --temperature 0`. One transposed, split or
permuted tensor, a wrong norm epsilon or rotary layout changes the logits,
and with them the continuation within a few tokens. The smallest margin
between the top two logits along the way is printed, to show how close to a
tie any choice was.

Works for GPT-2 and LLaMA checkpoints of byte-level models (vocab 256), e.g.
after `zrun train configs/tiny-llama.yaml`. Needs torch and transformers:

    python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch transformers safetensors
    /tmp/hfenv/bin/python scripts/hf_crosscheck.py runs/tiny-llama/checkpoints --zrun target/release/zrun

Exit status 0 when the continuations are the same, 1 otherwise.
"""

import argparse
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", help="a zrun checkpoint directory or root")
    ap.add_argument("--zrun", default="target/release/zrun")
    ap.add_argument("--prompt", default="fn main() {\n    let ")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [args.zrun, "export", args.checkpoint, "--format", "hf", "--out", out],
            check=True,
        )
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        model.eval()
        print(f"transformers loaded {type(model).__name__} from the export")

        ids = torch.tensor([list(args.prompt.encode())])
        # zrun samples from a window of the last seq_len tokens; transformers
        # reads the whole context. They agree while everything fits.
        cfg = model.config
        seq_len = getattr(cfg, "max_position_embeddings", None) or cfg.n_positions
        if ids.shape[1] + args.tokens > seq_len:
            args.tokens = seq_len - ids.shape[1]
            print(f"--tokens lowered to {args.tokens}: the context is {seq_len} tokens")
        with torch.no_grad():
            generated = model.generate(
                ids,
                max_new_tokens=args.tokens,
                do_sample=False,
                pad_token_id=0,
            )[0][ids.shape[1]:]
        hf_text = bytes(generated.tolist()).decode("utf-8", errors="replace")

        sample = subprocess.run(
            [
                args.zrun, "sample", args.checkpoint,
                "--prompt", args.prompt,
                "--tokens", str(args.tokens),
                "--temperature", "0",
            ],
            check=True, capture_output=True,
        ).stdout
        zrun_text = sample[len(args.prompt.encode()):].rstrip(b"\n").decode("utf-8", errors="replace")

        # Logits along the continuation, to report how close to a tie each
        # greedy choice was.
        full = torch.tensor([list(args.prompt.encode()) + list(generated.tolist())])
        with torch.no_grad():
            all_logits = model(full).logits[0]
        top2 = torch.topk(all_logits[ids.shape[1] - 1 : -1], 2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()

        print(f"prompt          {args.prompt!r}")
        print(f"transformers -> {hf_text!r}")
        print(f"zrun sample  -> {zrun_text!r}")
        print(f"smallest greedy margin under transformers: {margin:.2e}")
        if hf_text != zrun_text:
            print("MISMATCH: the greedy continuations differ")
            return 1
        print("OK: the same greedy continuation")
        return 0


if __name__ == "__main__":
    sys.exit(main())
