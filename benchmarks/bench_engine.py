"""Engine vs Hugging Face ``generate`` on one mixed workload, side by side in one run, plus a roofline.

    python benchmarks/bench_engine.py [--requests 64] [--dtype bfloat16] [--hf bfloat16:16,bfloat16:64,float32:64]
    python benchmarks/bench_engine.py --device cuda      # the GPU run of issue 12 (defaults below)

On CUDA (``--device cuda``) both sides use a random-weight model of ``--shape`` (default the Llama-3.2-1B shape)
built on the device (no download) and saved once for the engine; defaults there: 256 requests, prompts 32-512,
outputs 16-256, HF at bfloat16 batch 64 and 256, the engine with ``max_num_seqs`` 256 and CUDA graphs. It also
times decode-only steps at the full batch (wall, GPU by CUDA events, and host time until the step waits for its
sampled ids) against the roofline: weight + KV bytes at the copy bandwidth measured in the same run.

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
    # the largest square up to 2048 whose product takes under ~50 ms: a CPU without bf16 matmul units runs 2048^3 in
    # bf16 for a minute (0.3 GFLOP/s, seen on a 2-vCPU EPYC), which would only time the benchmark itself
    n = 256
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        t = time.perf_counter()
        torch.mm(a, b)
        if n >= 2048 or time.perf_counter() - t > 0.05:
            break
        n *= 2
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return bw, 2 * n**3 / best


def run_engine(model: str, dtype: str, reqs: list[Req], threads: int | None, kv_cache_gib: float | None = None
               ) -> dict:
    from engine import LLM, SamplingParams
    from engine.scheduling.scheduler import SchedulerOutput

    llm = LLM(model, dtype=dtype, num_threads=threads, enable_prefix_caching=False, kv_cache_gib=kv_cache_gib)
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
    ap.add_argument("--hf", default=ap_default_hf(),
                    help="Hugging Face configurations to run, as dtype:batch_size pairs")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="K/V cache GiB (default: the engine's, 2 GiB on the CPU)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--device", default="cpu", help="cpu (the default model, as documented) | cuda | cuda:N")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="a random-weight model of this shape built on --device (default on CUDA: llama-3.2-1b)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="engine batch limit for --shape runs")
    ap.add_argument("--out", default=None, help="--shape runs: append a markdown report here")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, a few requests (tests the script)")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.shape, args.requests, args.dtype = "cpu", "tiny", 6, "float32"
        args.prompt_range, args.output_range, args.hf, args.max_num_seqs = "8,24", "4,12", "float32:3", 4
    if args.device != "cpu" or args.shape:
        run_random_model(args)
        return

    from engine.models.default_model import resolve_model

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

    eng = run_engine(path, args.dtype, reqs, args.threads, args.kv_cache_gib)
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
    params = _params(e)
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


# random-weight shapes built on the device (nothing to download): Llama unless "arch" names another family
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True),
    # mixture-of-experts shapes small enough for a CPU run: 16 experts top-4 (Qwen3-30B-A3B's routing, 1/8 of its
    # experts, its 64-wide heads), and 8 experts top-2 as Mixtral
    "qwen3-moe-mini": dict(arch="qwen3_moe", vocab_size=32000, hidden_size=512, intermediate_size=1024,
                           moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                           num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                           max_position_embeddings=4096, rope_theta=1000000.0, tie_word_embeddings=False),
    "mixtral-mini": dict(arch="mixtral", vocab_size=32000, hidden_size=512, intermediate_size=1024,
                         num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1000000.0,
                         tie_word_embeddings=False),
}
# a shape's "arch" -> (transformers config class, model class)
SHAPE_ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
               "mixtral": ("MixtralConfig", "MixtralForCausalLM")}


def write_tokenizer(folder: str, vocab_size: int) -> None:
    """A word-level tokenizer with one made-up word per id (``t0`` .. ``tN``): the engine needs a tokenizer folder,
    and the benchmark feeds token ids, so any tokenizer covering the vocabulary will do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", bos_token="t0", pad_token="t0").save_pretrained(folder)


def build_random_model(shape: str, folder: str, device: str, dtype: torch.dtype, std: float | None = None,
                       seed: int = 0):  # type: ignore[no-untyped-def]
    """A random-weight model of ``shape`` (``LlamaForCausalLM`` unless the shape names its arch) built on ``device``
    in ``dtype`` and saved (safetensors + tokenizer) to ``folder``; returns the model. ``std``: weight init scale
    (HF's 0.02 when None)."""
    import transformers

    fields = dict(SHAPES[shape])
    config_cls, model_cls = (getattr(transformers, n) for n in SHAPE_ARCHS[fields.pop("arch", "llama")])
    cfg = config_cls(**fields, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0, initializer_range=std or 0.02)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, cfg.vocab_size)
    return model


def device_copy_bandwidth(device: torch.device, mib: int | None = None) -> float:
    """Bytes/s moved by a 1 GiB (CPU: 256 MiB; or ``mib``) device-to-device copy, read + write counted, best of 5."""
    n = (mib * 2**20 if mib else 2**30 if device.type == "cuda" else 2**28) // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n * 4 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hf_device(model, reqs: list[Req], batch: int, device: torch.device) -> dict:  # type: ignore[no-untyped-def]
    """Hugging Face ``generate`` (greedy, static left-padded batches) on the device; useful tok/s."""
    def go(group: list[Req]) -> None:
        width = max(len(r.prompt) for r in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for j, r in enumerate(group):
            ids[j, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[j, width - len(r.prompt):] = 1
        model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(r.max_tokens for r in group),
                       min_new_tokens=max(r.max_tokens for r in group), do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        go([Req(r.prompt, 4) for r in reqs[:batch]])  # warm-up, excluded
        _sync(device)
        t = time.perf_counter()
        for i in range(0, len(reqs), batch):
            go(reqs[i : i + batch])
        _sync(device)
    dt = time.perf_counter() - t
    useful = sum(r.max_tokens for r in reqs)
    return {"seconds": dt, "useful_tokens": useful, "tok_s": useful / dt}


def run_engine_device(folder: str, dtype: str, reqs: list[Req], device: str, max_num_seqs: int,
                      max_model_len: int, num_kv_blocks: int | None = None, steady: tuple[int, int] = (256, 48)
                      ) -> dict:
    """The engine on the workload (after a warm-up), then decode-only steps at the full batch timed three ways.
    ``num_kv_blocks``: the cache's size (None: the device's default sizing). ``steady``: the full-batch decode's
    prompt length and tokens per request."""
    import engine.sampling.sampler as sampler_mod
    from engine import LLM, SamplingParams
    from engine.scheduling.scheduler import SchedulerOutput

    llm = LLM(folder, device=device, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
              max_num_batched_tokens=max(2048, min(8192, max_num_seqs * 32)), enable_prefix_caching=False,
              num_kv_blocks=num_kv_blocks)
    eng = llm.engine
    dev = eng.device
    steps: list[dict] = []
    real_execute, real_to_host = eng.runner.execute, sampler_mod._to_host
    mark: dict[str, float] = {}

    def to_host(*a):  # type: ignore[no-untyped-def]
        mark["host_done"] = time.perf_counter()  # the step's launches are all issued: it now waits for the ids
        return real_to_host(*a)

    def timed_execute(out: SchedulerOutput, *a):  # type: ignore[no-untyped-def]
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if dev.type == "cuda" else None
        t = time.perf_counter()
        if ev:
            ev[0].record()
        res = real_execute(out, *a)
        if ev:
            ev[1].record()
        wall = time.perf_counter() - t
        if ev:
            ev[1].synchronize()
        steps.append({"decode_only": not out.prefills, "batch": len(out.decodes), "wall": wall,
                      "gpu": ev[0].elapsed_time(ev[1]) / 1e3 if ev else wall,
                      "host": mark.get("host_done", t + wall) - t,
                      "ctx": sum(s.start + 1 for s in out.decodes)})
        mark.clear()
        return res

    eng.runner.execute = timed_execute  # type: ignore[method-assign]
    sampler_mod._to_host = to_host
    try:
        llm.generate([r.prompt for r in reqs[:8]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        steps.clear()
        t = time.perf_counter()
        outs = llm.generate([r.prompt for r in reqs], [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
                                                      for r in reqs])
        dt = time.perf_counter() - t
        useful = sum(len(o.outputs[0].token_ids) for o in outs)
        assert useful == sum(r.max_tokens for r in reqs)
        workload_steps = list(steps)
        # steady decode at the full batch: every request the same length, so each step runs max_num_seqs rows
        steps.clear()
        length, tokens = steady
        prompt = reqs[0].prompt[:length] * (length // len(reqs[0].prompt[:length]) + 1)
        llm.generate([prompt[:length]] * max_num_seqs, SamplingParams(max_tokens=tokens, ignore_eos=True))
        full = [s for s in steps if s["decode_only"] and s["batch"] == max_num_seqs]
    finally:
        sampler_mod._to_host = real_to_host
    return {"seconds": dt, "useful_tokens": useful, "tok_s": useful / dt, "steps": workload_steps,
            "full_batch_steps": full, "engine": eng}


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def run_random_model(args: argparse.Namespace) -> None:
    """The ``--device``/``--shape`` run: HF and the engine on one random-weight model, roofline of the decode step."""
    import gc
    import tempfile

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = args.shape or "llama-3.2-1b"
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    pmin, pmax = map(int, (args.prompt_range if args.prompt_range != "16,512" else "32,512").split(","))
    omin, omax = map(int, args.output_range.split(","))
    n = args.requests if args.requests != 64 else 256
    hf_specs = args.hf if args.hf != ap_default_hf() else "bfloat16:64,bfloat16:256"
    reqs = workload(n, SHAPES[shape]["vocab_size"], args.seed, pmin, pmax, omin, omax)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"workload: {n} requests, prompts {pmin}-{pmax}, outputs {omin}-{omax}, "
             f"{sum(r.max_tokens for r in reqs)} output tokens; random-weight {shape} in {args.dtype} on {name}; "
             f"torch {torch.__version__}"]
    print(lines[0], flush=True)
    bw = device_copy_bandwidth(device, 32 if args.smoke else None)  # --smoke: the number is not read
    with tempfile.TemporaryDirectory() as folder:
        t = time.perf_counter()
        model = build_random_model(shape, folder, str(device), dtype)
        print(f"model built and saved in {time.perf_counter() - t:.1f}s", flush=True)
        hf_results = {}
        for spec in hf_specs.split(","):
            hf_dtype, b = spec.split(":")
            if hf_dtype != args.dtype:
                continue
            r = run_hf_device(model, reqs, int(b), device)
            hf_results[f"hf generate ({hf_dtype}, static batch {b})"] = r
            print(f"hf generate ({hf_dtype}, static batch {b}): {r['tok_s']:.1f} tok/s ({r['seconds']:.1f}s)", flush=True)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        t = time.perf_counter()
        max_len = pmax + omax + 16
        # --smoke: a cache for the full batch (4 x 320 tokens = 80 blocks of 16), not the CPU's 2 GiB default (~130,000
        # blocks on the tiny shape, seconds to build); the full-batch decode 8 tokens from 32-token prompts, not 48
        # from 256 (what it times is not read: most of the stage's engine seconds)
        eng = run_engine_device(folder, args.dtype, reqs, str(device), args.max_num_seqs, max(max_len, 320),
                                128 if args.smoke else None, (32, 8) if args.smoke else (256, 48))
        print(f"engine ({args.dtype}, continuous batching{', CUDA graphs' if device.type == 'cuda' else ''}): "
              f"{eng['tok_s']:.1f} tok/s ({eng['seconds']:.1f}s; started and ran in {time.perf_counter() - t:.1f}s)",
              flush=True)
    best_name = max(hf_results, key=lambda k: hf_results[k]["tok_s"])
    ratio = eng["tok_s"] / hf_results[best_name]["tok_s"]
    table = [f"{'system':<48}{'useful tok/s':>14}{'seconds':>10}",
             f"{'engine (' + args.dtype + ', continuous batching)':<48}{eng['tok_s']:>14.1f}{eng['seconds']:>10.1f}"]
    table += [f"{k:<48}{r['tok_s']:>14.1f}{r['seconds']:>10.1f}" for k, r in hf_results.items()]
    table.append(f"ratio engine / best hf ({best_name}): {ratio:.2f}x")
    e = eng["engine"]
    mc = e.model_config
    kv_tok = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * torch.empty((), dtype=dtype).element_size()
    full = eng["full_batch_steps"]
    step_lines = []
    for label, sel in (("workload decode-only steps", [s for s in eng["steps"] if s["decode_only"]]),
                       ("workload steps with prefill", [s for s in eng["steps"] if not s["decode_only"]]),
                       (f"decode-only at batch {args.max_num_seqs}", full)):
        if sel:
            step_lines.append(f"{label:<34}{len(sel):>6}  wall {_median([s['wall'] for s in sel]) * 1e3:7.2f} ms  "
                              f"gpu {_median([s['gpu'] for s in sel]) * 1e3:7.2f} ms  "
                              f"host {_median([s['host'] for s in sel]) * 1e3:7.2f} ms (medians)")
    roof = ""
    if full:
        ctx = _median([s["ctx"] for s in full])
        t_roof = (weight_bytes + ctx * kv_tok) / bw
        t_step = _median([s["wall"] for s in full])
        roof = (f"roofline: copy bandwidth {bw / 1e12:.2f} TB/s (read + write); decode step at batch "
                f"{args.max_num_seqs} ({ctx:.0f} context tokens in all): {t_step * 1e3:.2f} ms wall, "
                f"{_median([s['gpu'] for s in full]) * 1e3:.2f} ms GPU; roofline {t_roof * 1e3:.2f} ms (weights "
                f"{weight_bytes / 2**30:.2f} GiB + KV {ctx * kv_tok / 2**30:.2f} GiB read) -> "
                f"{t_step / t_roof:.2f}x the roofline")
    report = "\n".join(lines + [""] + table + [""] + step_lines + [roof])
    print("\n" + report, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n## Engine vs Hugging Face ({shape}, {args.dtype}, {name})\n\n"
                    f"`python benchmarks/bench_engine.py --device {args.device}"
                    f"{' --shape ' + args.shape if args.shape else ''}{' --smoke' if args.smoke else ''}`\n\n"
                    f"```\n{report}\n```\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine_tok_s": eng["tok_s"], "hf": {k: r["tok_s"] for k, r in hf_results.items()},
                       "ratio": ratio, "roofline": roof}, f, indent=2)


def ap_default_hf() -> str:
    return "bfloat16:16,bfloat16:32,bfloat16:64,float32:64"


def _params(e) -> int:  # type: ignore[no-untyped-def]
    """The model's parameter count (a tied head counted once)."""
    m = e.runner.model
    n = m.embed.numel() + m.final_norm.numel() + (0 if m.cfg.tie_word_embeddings else m.lm_head.numel)
    for lw in m.layers:
        n += lw.input_norm.numel() + lw.post_norm.numel() + lw.qkv.numel + lw.o.numel
        n += lw.gate_up.numel + lw.down.numel if lw.moe is None else lw.moe.router.numel + lw.moe.experts.numel
    return n


if __name__ == "__main__":
    main()
