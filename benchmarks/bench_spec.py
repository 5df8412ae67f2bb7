"""Speculative decoding (n-gram) against none, side by side in one run, on the default model (docs/speculative.md).

    python benchmarks/bench_spec.py [--dtype float32] [--max-tokens 160] [--open-requests 24] [--k 4]

Two workloads, each run with and without ``speculative_config={"method": "ngram", ...}`` on two engines built in
the same process, alternated per unit (a prompt at batch 1, the whole batch otherwise) and round: (without, with),
then (with, without), so that a shared machine's drifting load hits both alike:

* **copy-heavy, batch 1**: chat prompts whose answer copies the prompt (a code edit, "copy this paragraph"), one
  request at a time, greedy. Output tokens per second of wall time. Goal: >= 1.8x.
* **open-ended, 24 at once**: short open questions, all submitted together, greedy. Output tokens per second.
  Goal: >= 0.95x (the load switch steps back when the batch is large).

Prints one JSON line per measurement and a summary with the ratios and the engines' acceptance counters; also
checks that both engines produced the same tokens (greedy: they must).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''
PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass lamp "
             "and a notebook in which he recorded the weather, the ships that passed, and the birds that rested on "
             "the railing. Over forty years the notebook grew into a shelf of volumes, and the village library now "
             "keeps them in a glass case beside the harbour map.")
COPY_PROMPTS = [
    f"Rename the variable `total` to `running_sum` in this function and output the whole function:\n\n{CODE}",
    f"Copy this paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Rewrite this function with type hints added, keeping everything else the same:\n\n{CODE}",
    f"Repeat the following text twice:\n\n{PARAGRAPH}",
]
OPEN_PROMPTS = [
    "Tell me a short story about a dragon.", "What is the capital of France?", "Give me three tips for sleeping well.",
    "Why is the sky blue?", "Write a haiku about autumn.", "Explain photosynthesis simply.",
    "What should I cook tonight?", "Describe a sunset at the beach.", "How do airplanes fly?",
    "What is a black hole?", "Suggest a name for a cat.", "Why do we dream?",
    "What is machine learning?", "Write a limerick about a frog.", "How do I learn to swim?",
    "What are the planets of the solar system?", "Describe your ideal weekend.", "What is the meaning of kindness?",
    "How does a rainbow form?", "Invent a new holiday.", "What makes music enjoyable?", "How do bees make honey?",
    "Give advice to a new student.", "What is the tallest mountain?",
]


def count_steps(llm: Any, meter: dict[str, float]) -> None:
    """Mutates ``llm.engine``: its steps are counted in ``meter["steps"]`` and, when it speculates, the seconds spent
    proposing in ``meter["propose_s"]`` (noise-free facts beside the wall-clock ratios)."""
    eng = llm.engine
    step = eng.step

    def counted(*a: Any, **kw: Any) -> Any:
        meter["steps"] += 1
        return step(*a, **kw)

    eng.step = counted
    if eng.spec is not None:
        propose = eng.spec.propose

        def timed(running: Any) -> Any:
            t = time.perf_counter()
            try:
                return propose(running)
            finally:
                meter["propose_s"] += time.perf_counter() - t

        eng.spec.propose = timed


def run(llm: Any, prompts: list[list[int]], params: Any, batch: bool) -> tuple[float, int, list[list[int]]]:
    """(seconds, output tokens, token ids per prompt): all prompts at once, or one after the other."""
    t = time.perf_counter()
    outs = llm.generate(prompts, params) if batch else [llm.generate([p], params)[0] for p in prompts]
    dt = time.perf_counter() - t
    ids = [o.outputs[0].token_ids for o in outs]
    return dt, sum(len(i) for i in ids), ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--open-max-tokens", type=int, default=64)
    ap.add_argument("--open-requests", type=int, default=24)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of (without, with) per workload")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    import torch

    from engine import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    common = dict(dtype=args.dtype, kv_cache_gib=1.0, max_num_seqs=64)
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    base, fast = LLM(**common), LLM(speculative_config=spec, **common)
    meters = {"off": {"steps": 0.0, "propose_s": 0.0}, "on": {"steps": 0.0, "propose_s": 0.0}}
    count_steps(base, meters["off"])
    count_steps(fast, meters["on"])
    copy = [base.apply_chat_template([{"role": "user", "content": p}]) for p in COPY_PROMPTS]
    opened = [base.apply_chat_template([{"role": "user", "content": p}])
              for p in (OPEN_PROMPTS * 4)[:args.open_requests]]
    summary: dict[str, Any] = {"machine": "this one (shared)", "dtype": args.dtype, "k": args.k,
                               "threads": torch.get_num_threads()}
    for name, prompts, max_tokens, batch in (("copy_batch1", copy, args.max_tokens, False),
                                             ("open_batch", opened, args.open_max_tokens, True)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        run(base, prompts[:1], SamplingParams(max_tokens=4), batch)  # warm-up both
        run(fast, prompts[:1], SamplingParams(max_tokens=4), batch)
        before = dict(fast.engine.spec.stats.as_dict())
        for m in meters.values():
            m.update(steps=0.0, propose_s=0.0)
        totals = {"off": [0.0, 0], "on": [0.0, 0]}
        same = True
        # units: each prompt alone (batch 1) or the whole batch; per unit and round the order alternates (off, on),
        # (on, off): a shared machine's load drifting during the run hits both sides alike
        units = [[p] for p in prompts] if not batch else [prompts]
        for r in range(args.rounds):
            for u, unit in enumerate(units):
                order = (("off", base), ("on", fast)) if (r + u) % 2 == 0 else (("on", fast), ("off", base))
                got = {}
                for side, llm in order:
                    dt, n, ids = run(llm, unit, params, True)
                    totals[side][0] += dt
                    totals[side][1] += n
                    got[side] = (dt, n, ids)
                same &= got["off"][2] == got["on"][2]
                print(json.dumps({"workload": name, "round": r, "unit": u, "tokens": got["off"][1],
                                  "off_tok_s": round(got["off"][1] / got["off"][0], 2),
                                  "on_tok_s": round(got["on"][1] / got["on"][0], 2)}), flush=True)
        after = fast.engine.spec.stats.as_dict()
        off = totals["off"][1] / totals["off"][0]
        on = totals["on"][1] / totals["on"][0]
        summary[name] = {"requests": len(prompts), "max_tokens": max_tokens, "off_tok_s": round(off, 2),
                         "on_tok_s": round(on, 2), "ratio": round(on / off, 3), "same_tokens": same,
                         "proposed": after["proposed_tokens"] - before["proposed_tokens"],
                         "accepted": after["accepted_tokens"] - before["accepted_tokens"],
                         "verified_requests": after["verified_requests"] - before["verified_requests"],
                         "stepped_back_steps": after["stepped_back"] - before["stepped_back"],
                         # noise-free: engine steps (weight reads) without / with, and the proposer's share of time
                         "steps_off": int(meters["off"]["steps"]), "steps_on": int(meters["on"]["steps"]),
                         "propose_share_of_on_time": round(meters["on"]["propose_s"] / totals["on"][0], 4)}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
