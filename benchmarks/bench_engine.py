"""Engine vs Hugging Face ``generate`` on one mixed workload, side by side in one run, plus a roofline.

    python benchmarks/bench_engine.py [--requests 64] [--dtype bfloat16] [--hf bfloat16:16,bfloat16:64,float32:64]

Workload (fixed seed): prompts of 16-512 random token ids, outputs of 16-256 tokens (``ignore_eos``), greedy.
Hugging Face runs static padded batches (left padding, each batch runs to its longest output); the engine runs
continuous batching. Useful tokens are each request's own output tokens. Also prints the engine's pure-decode step
time against this machine's roofline measured in the same run (copy bandwidth, matmul FLOP/s).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    max_tokens: int


def workload(n: int, vocab: int, seed: int, pmin: int, pmax: int, omin: int, omax: int) -> list[Req]:
    rng = random.Random(seed)
    return [
        Req([rng.randrange(100, vocab) for _ in range(rng.randint(pmin, pmax))], rng.randint(omin, omax))
        for _ in range(n)
    ]


def roofline(dtype: torch.dtype) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, matmul FLOP/s in ``dtype``), best of a few tries."""
    src = torch.empty(256 * 2**20 // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    bw = 2 * src.numel() * 4 / best
    a = torch.randn(2048, 2048).to(dtype)
    b = torch.randn(2048, 2048).to(dtype)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return bw, 2 * 2048**3 / best


def run_engine(model: str, dtype: str, reqs: list[Req], threads: int | None) -> dict:
    from engine import LLM, SamplingParams
    from engine.scheduler import SchedulerOutput

    llm = LLM(model, dtype=dtype, num_threads=threads, enable_prefix_caching=False)
    eng = llm.engine
    decode_steps: list[tuple[float, int, int]] = []  # (seconds, batch, total context tokens)
    mixed_steps: list[float] = []
    real_execute = eng.runner.execute

    def timed_execute(out: SchedulerOutput, *args):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        res = real_execute(out, *args)
        if out.prefills:
            mixed_steps.append(time.perf_counter() - t)
        elif out.decodes:
            decode_steps.append((time.perf_counter() - t, len(out.decodes), sum(s.start + 1 for s in out.decodes)))
        return res

    eng.runner.execute = timed_execute  # type: ignore[method-assign]
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    llm.generate([reqs[0].prompt], SamplingParams(max_tokens=4))  # warm-up
    decode_steps.clear()
    mixed_steps.clear()
    t = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    dt = time.perf_counter() - t
    useful = sum(len(o.token_ids) for o in outs)
    assert useful == sum(r.max_tokens for r in reqs)
    return {"seconds": dt, "useful_tokens": useful, "tok_s": useful / dt, "decode_steps": decode_steps,
            "mixed_steps": mixed_steps, "engine": eng}


def print_breakdown(r: dict) -> None:
    """Where the engine's time went: steps with prefill chunks vs decode-only steps by batch size."""
    rows = [("prefill + decode steps", r["mixed_steps"])]
    for name, lo, hi in (("decode-only, batch > 32", 33, 10**9), ("decode-only, batch 9-32", 9, 32),
                         ("decode-only, batch <= 8", 1, 8)):
        rows.append((name, [t for t, b, _ in r["decode_steps"] if lo <= b <= hi]))
    print(f"{'engine steps':<28}{'steps':>7}{'seconds':>10}{'ms/step':>10}")
    for name, ts in rows:
        if ts:
            print(f"{name:<28}{len(ts):>7}{sum(ts):>10.1f}{sum(ts) / len(ts) * 1e3:>10.0f}")


def run_hf(path: str, dtype: torch.dtype, reqs: list[Req], batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    t = time.perf_counter()
    useful = 0
    with torch.inference_mode():
        for i in range(0, len(reqs), batch):
            group = reqs[i : i + batch]
            width = max(len(r.prompt) for r in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for j, r in enumerate(group):  # left padding
                ids[j, width - len(r.prompt) :] = torch.tensor(r.prompt)
                mask[j, width - len(r.prompt) :] = 1
            model.generate(ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r in group),
                           do_sample=False, pad_token_id=0)
            useful += sum(r.max_tokens for r in group)
            print(f"  hf batch {batch}: {min(i + batch, len(reqs))}/{len(reqs)} requests", file=sys.stderr, flush=True)
    dt = time.perf_counter() - t
    return {"seconds": dt, "useful_tokens": useful, "tok_s": useful / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-range", default="16,512")
    ap.add_argument("--output-range", default="16,256")
    ap.add_argument("--hf", default="bfloat16:16,bfloat16:32,bfloat16:64,float32:64",
                    help="Hugging Face configurations to run, as dtype:batch_size pairs")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    from engine.default_model import resolve_model

    path = str(resolve_model(args.model))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    pmin, pmax = map(int, args.prompt_range.split(","))
    omin, omax = map(int, args.output_range.split(","))
    reqs = workload(args.requests, vocab, args.seed, pmin, pmax, omin, omax)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"workload: {len(reqs)} requests, prompts {pmin}-{pmax}, outputs {omin}-{omax}, "
          f"{sum(r.max_tokens for r in reqs)} output tokens; torch threads {torch.get_num_threads()}", flush=True)

    eng = run_engine(path, args.dtype, reqs, args.threads)
    print(f"engine ({args.dtype}): {eng['useful_tokens']} tokens in {eng['seconds']:.1f}s = {eng['tok_s']:.1f} tok/s",
          flush=True)
    print_breakdown(eng)
    hf_results = {}
    for spec in args.hf.split(","):
        hf_dtype, b = spec.split(":")
        r = run_hf(path, torch.bfloat16 if hf_dtype == "bfloat16" else torch.float32, reqs, int(b))
        hf_results[f"hf generate ({hf_dtype}, static batch {b})"] = r
        print(f"hf generate ({hf_dtype}, static batch {b}): {r['tok_s']:.1f} tok/s ({r['seconds']:.1f}s)", flush=True)
    best_name = max(hf_results, key=lambda k: hf_results[k]["tok_s"])
    best = hf_results[best_name]["tok_s"]
    print(f"\n{'system':<44}{'useful tok/s':>14}{'seconds':>10}")
    print(f"{'engine (' + args.dtype + ', continuous batching)':<44}{eng['tok_s']:>14.1f}{eng['seconds']:>10.1f}")
    for name, r in hf_results.items():
        print(f"{name:<44}{r['tok_s']:>14.1f}{r['seconds']:>10.1f}")
    print(f"ratio engine / best hf ({best_name}): {eng['tok_s'] / best:.2f}x")

    # roofline for pure decode steps at the largest batch seen
    e = eng["engine"]
    mc = e.model_config
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    esize = torch.empty((), dtype=dtype).element_size()
    bw, flops = roofline(dtype)
    steps = eng["decode_steps"]
    top = max(b for _, b, _ in steps)
    sel = [(t, b, c) for t, b, c in steps if b == top]
    t_step = sorted(t for t, _, _ in sel)[len(sel) // 2]
    ctx = sum(c for _, _, c in sel) / len(sel)
    params = sum(w.numel() for w in _weights(e))
    kv_tok = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * esize
    bytes_step = params * esize + ctx * kv_tok
    flops_step = 2 * params * top + 4 * ctx * mc.num_layers * mc.num_heads * mc.head_dim
    t_roof = max(bytes_step / (bw / 2), flops_step / flops)
    print(f"\nroofline: copy bandwidth {bw / 2**30:.1f} GiB/s (read+write), matmul {flops / 1e9:.0f} GFLOP/s ({args.dtype})")
    print(f"decode step at batch {top} (median of {len(sel)}, {ctx:.0f} context tokens in all): {t_step * 1e3:.1f} ms; "
          f"roofline {t_roof * 1e3:.1f} ms (weights {params * esize / 2**20:.0f} MiB + KV {ctx * kv_tok / 2**20:.0f} MiB "
          f"read, {flops_step / 1e9:.1f} GFLOP) -> {t_step / t_roof:.1f}x from the roofline")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine_tok_s": eng["tok_s"], "hf": {k: r["tok_s"] for k, r in hf_results.items()},
                       "ratio": eng["tok_s"] / best, "decode_step_ms": t_step * 1e3,
                       "roofline_ms": t_roof * 1e3}, f, indent=2)


def _weights(e) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    m = e.runner.model
    ws = [m.embed, m.final_norm] + ([] if m.lm_head is m.embed else [m.lm_head])
    for lw in m.layers:
        ws += [lw.input_norm, lw.qkv, lw.o, lw.post_norm, lw.gate_up, lw.down]
    return ws


if __name__ == "__main__":
    main()
