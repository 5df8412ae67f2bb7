"""Grammar compile time (issue 30 item 5): p50 / p99 / max over the JSON schemas and tool grammars of the tests.

    python benchmarks/bench_grammar_compile.py [--model default] [--repeats 5]

For each of the 20 schemas of ``tests/integration/test_structured_serve.py`` (plus the ``required`` and named
tool-call grammars built from its two tools) this times, with the compiler's cache emptied before every sample:
``compile`` (``GrammarCompiler.grammar``: the schema translated to llguidance's grammar and checked against the
tokenizer, what an engine does once per distinct schema) and ``first mask`` (a fresh matcher and its first token
bitmask, what every constrained request pays at its first step). The tokenizer is built once, outside the timing
(~1 s for the default model's 49k vocabulary).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import llguidance
    import llguidance.torch
    import torch
    from transformers import AutoTokenizer

    from engine.models.default_model import resolve_model
    from engine.sampling.grammar import GrammarCompiler
    from engine.request.grammar_spec import GrammarSpec
    from engine.models.model_config import load_model_config
    from engine.sampling.sampling_bitmask import bitmask_width
    from proxy.tools import parse_tools
    from tests.integration.test_structured_serve import SCHEMAS, TIME, WEATHER

    path = resolve_model(args.model, None, None)
    cfg = load_model_config(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    eos = set(cfg.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    compiler = GrammarCompiler(tok, cfg.vocab_size, eos)
    specs = [GrammarSpec.json_schema(s) for s in SCHEMAS]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        specs.append(parse_tools({"tools": [WEATHER, TIME], "tool_choice": choice}, None).grammar())
    compile_ms: list[float] = []
    mask_ms: list[float] = []
    worst = (0.0, "")
    mask = torch.empty((1, bitmask_width(cfg.vocab_size)), dtype=torch.int32)
    for _ in range(args.repeats):
        for spec in specs:
            compiler._cache.clear()  # every sample compiles: the cold cost of a schema not seen before
            t = time.perf_counter()
            compiler.grammar(spec)
            ms = (time.perf_counter() - t) * 1e3
            compile_ms.append(ms)
            worst = max(worst, (ms, spec.text[:60]))
            t = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(compiler.matcher(spec), mask, 0)
            mask_ms.append((time.perf_counter() - t) * 1e3)
    print(f"{len(specs)} grammars x {args.repeats} repeats, model {args.model} (vocab {cfg.vocab_size})")
    for name, xs in (("compile", compile_ms), ("first mask", mask_ms)):
        print(f"{name:>10}: p50 {_percentile(xs, 0.5):7.2f} ms  p99 {_percentile(xs, 0.99):7.2f} ms  "
              f"max {max(xs):7.2f} ms  mean {statistics.fmean(xs):7.2f} ms")
    print(f"slowest compile: {worst[0]:.2f} ms ({worst[1]}...)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
