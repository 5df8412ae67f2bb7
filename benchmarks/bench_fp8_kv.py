"""8-bit KV caches (FP8, int8) against the model dtype's KV: greedy agreement on a fixed prompt set, beside the
agreement of two correct runs without quantization (the noise floor), and KV bytes per token.

    python benchmarks/bench_fp8_kv.py [--model default] [--dtype bfloat16] [--max-tokens 48]

Four runs of the same 16 chat prompts with the same weights and activations dtype (``--dtype``, bfloat16 by
default, as issue 14 asks: agreement with bfloat16): the reference (all prompts in one batch, KV in ``--dtype``), the
noise floor (each prompt alone, KV in ``--dtype``: the same arithmetic in other batch shapes, so only rounding
differs), FP8 (one batch, KV as float8_e4m3fn, a scale per block and kv head) and int8 (one batch, a scale per token
and kv head). Reports how many completions are identical to the reference, the mean share of each completion
generated before the first differing token, and the KV bytes per token (in memory and on the wire). e4m3's 3 mantissa
bits make FP8's identical count a lottery (docs/kernels.md, "8-bit KV caches"); in bfloat16 the noise floor itself is
far from 16 of 16, so ``--dtype float32`` (noise floor 16/16) isolates the quantization.
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


def agreement(name: str, ref: list[list[int]], other: list[list[int]]) -> None:
    shares = [common_prefix(a, b) / max(1, len(a)) for a, b in zip(ref, other)]
    same = sum(a == b for a, b in zip(ref, other))
    print(f"{name:<44} identical completions: {same}/{len(ref)}; tokens before the first difference: mean "
          f"{statistics.mean(shares):.0%} of each completion, median {statistics.median(shares):.0%}")


def roundtrip_error(kv: "torch.Tensor", kv_dtype: "torch.dtype") -> tuple[float, float]:
    """Relative RMS error of K and V after a store into a ``kv_dtype`` cache and a read back, over the written blocks
    of ``kv`` (an unquantized cache ``[layers, 2, blocks, block_size, kv_heads, head_dim]``); each block is stored in
    one write, as a prefill writes a prompt's full blocks. Pure."""
    import torch

    import kernels
    from kernels import reference

    used = (kv[0, 0].abs().amax(dim=(1, 2, 3)) > 0).nonzero().flatten()
    blocks = kv[:, :, used].float()  # [layers, 2, n, block_size, kv_heads, head_dim]
    n, bs = blocks.shape[2], blocks.shape[3]
    errs = []
    for which in (0, 1):
        err = ref = 0.0
        for layer in blocks:
            rows = layer[which].reshape(n * bs, *layer.shape[-2:])
            cache = torch.zeros(n, *layer.shape[2:], dtype=kv_dtype)
            scales = torch.zeros(reference.scales_shape(cache))
            kernels.store_kv_quantized(rows, rows, cache, cache.clone(), scales, scales.clone(), torch.arange(n * bs))
            back = reference.gather_blocks(cache, torch.arange(n), scales, torch.float32).reshape(rows.shape)
            err += float((back - rows).pow(2).sum())
            ref += float(rows.pow(2).sum())
        errs.append((err / max(ref, 1e-30)) ** 0.5)
    return errs[0], errs[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="weights, activations and the reference's KV")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)

    import torch

    from engine import LLM, SamplingParams
    from engine.model_runner import KV_DTYPES, kv_block_bytes

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    runs = {}
    for kv in ("auto", "fp8", "int8"):
        llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=kv)
        runs[kv] = [o.token_ids for o in llm.chat(chats, params)]
        if kv == "auto":
            runs["alone"] = [llm.chat([c], params)[0].token_ids for c in chats]
            errors = {name: roundtrip_error(llm.engine.runner.kv, KV_DTYPES[name]) for name in ("fp8", "int8")}
        mc, bs = llm.engine.model_config, llm.config.block_size
        per_token = kv_block_bytes(mc, bs, KV_DTYPES.get(kv, getattr(torch, args.dtype))) / bs
        bf16 = kv_block_bytes(mc, bs, torch.bfloat16) / bs
        print(f"kv {(args.dtype if kv == 'auto' else kv):<8} {per_token:8.0f} bytes per token (all layers, K+V"
              f"{', with scales' if kv != 'auto' else ''}): {per_token / bf16:.2f}x of bfloat16's")
    print(f"{len(PROMPTS)} chat prompts, greedy, {args.max_tokens} tokens, {args.dtype} weights; against the "
          f"{args.dtype} KV run of all prompts in one batch:")
    agreement(f"noise floor ({args.dtype} KV, each prompt alone)", runs["auto"], runs["alone"])
    agreement("fp8 KV (one batch)", runs["auto"], runs["fp8"])
    agreement("int8 KV (one batch)", runs["auto"], runs["int8"])
    print("round trip of these prompts' K/V through the cache (relative RMS error; the identical counts above are a "
          "lottery between near-ties, this is not):")
    for name, (k_err, v_err) in errors.items():
        print(f"  {name:<5} K {k_err:.2%}  V {v_err:.2%}")


if __name__ == "__main__":
    main()
