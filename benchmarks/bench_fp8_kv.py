"""FP8 KV cache against float32 KV: greedy agreement on a fixed prompt set, and KV bytes per token.

    python benchmarks/bench_fp8_kv.py [--model default] [--max-tokens 48]

Both runs use float32 weights and activations on the same prompts; only the KV cache's storage differs. Reports how
many completions are identical, the mean share of each completion generated before the first differing token, and
the KV bytes per token (in memory and on the wire). e4m3's 3 mantissa bits make the identical count a lottery: any
scales land between about 3 and 10 of 16 here (docs/kernels.md, "FP8 KV cache").
"""

from __future__ import annotations

import argparse
import statistics

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "What is 12 times 12?",
    "Give me a short tip for learning to cook.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "List the planets of the solar system.",
    "Why is the sky blue?",
    "Describe a cat in one sentence.",
    "What does HTTP stand for?",
    "Suggest a name for a friendly robot.",
    "How many days are in a leap year?",
    "Write one sentence about autumn.",
    "What is the boiling point of water in Celsius?",
]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)

    import torch

    from engine import LLM, SamplingParams
    from engine.model_runner import FP8, kv_block_bytes

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(args.model, dtype="float32", kv_cache_dtype=kv)
        runs[kv] = [o.token_ids for o in llm.chat(chats, params)]
        mc, bs = llm.engine.model_config, llm.config.block_size
        per_token = kv_block_bytes(mc, bs, FP8 if kv == "fp8" else torch.float32) / bs
        print(f"kv {('float32' if kv == 'auto' else 'fp8'):<8} {per_token:8.0f} bytes per token (all layers, K+V"
              f"{', with scales' if kv == 'fp8' else ''})")
    bf16 = kv_block_bytes(mc, bs, torch.bfloat16) / bs
    print(f"kv bfloat16 {bf16:6.0f} bytes per token: fp8 is {per_token / bf16:.2f}x of bfloat16")
    shares = [common_prefix(a, b) / max(1, len(a)) for a, b in zip(runs["auto"], runs["fp8"])]
    same = sum(a == b for a, b in zip(runs["auto"], runs["fp8"]))
    print(f"{len(PROMPTS)} chat prompts, greedy, {args.max_tokens} tokens, float32 weights")
    print(f"identical completions: {same}/{len(PROMPTS)}")
    print(f"tokens before the first difference: mean {statistics.mean(shares):.0%} of each completion, "
          f"median {statistics.median(shares):.0%}")


if __name__ == "__main__":
    main()
