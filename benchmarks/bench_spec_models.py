"""Model drafters (MTP, a draft model) against no speculation, side by side in one run, on tiny checkpoints built
here (docs/speculative.md). No released checkpoint small enough for this machine ships an MTP layer, and the
default model has no smaller sibling sharing its tokenizer, so the numbers are about the engine's mechanics (steps
saved, the drafter's own cost), not a real model's acceptance.

    python benchmarks/bench_spec_models.py [--max-tokens 48] [--k 3] [--threads 1] [--cache DIR]

Four pairs, each a target without and with speculation on two engines in this process, greedy, batch 1 (four
prompts one at a time), float32:

* **mtp random**: a tiny DeepSeek-V3 with a random next-token layer: drafts miss, adaptive k falls to 0 and the
  drafter stops its passes; the cost left is the first steps' drafts and the layer's passes before that.
* **mtp predictive**: the layer built to predict the model (tests/factories.py ``add_mtp_layer(predictive=True)``):
  nearly every draft is accepted.
* **draft 1-layer llama**: a random 1-layer Llama drafting for the tiny Llama (drafts miss).
* **draft = target**: the tiny Llama as its own draft: every draft accepted, but the draft costs what the target does.

Prints one line per pair: equal tokens, engine steps (each a read of the target's weights), output tok/s and the
ratio, acceptance and tokens per verify. Checkpoints go to ``--cache`` (a temporary folder by default).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS = [list(range(5, 25)) * 2, [30, 31, 32, 33] * 5, [50 + (i * 7) % 40 for i in range(30)], [9, 100, 200]]


def _checkpoints(root: Path) -> dict[str, Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's tests.factories, from any folder
    from tests.factories import add_mtp_layer, build_checkpoint, build_tokenizer

    names = {n: root / n for n in ("rand", "pred", "llama", "llama1")}
    if not all((p / "config.json").exists() for p in names.values()):
        tok = root / "tok"
        tok.mkdir(parents=True, exist_ok=True)
        build_tokenizer(tok)
        add_mtp_layer(build_checkpoint(names["rand"], "deepseek_v3", tok))
        add_mtp_layer(build_checkpoint(names["pred"], "deepseek_v3", tok), predictive=True)
        build_checkpoint(names["llama"], "llama", tok)
        build_checkpoint(names["llama1"], "llama", tok, num_hidden_layers=1, hidden_size=32, intermediate_size=48,
                         seed=3)
    return names


def _run(folder: Path, spec: dict[str, Any] | None, max_tokens: int, threads: int
         ) -> tuple[list[list[int]], int, float, dict[str, float]]:
    from engine import LLM, SamplingParams

    llm = LLM(str(folder), speculative_config=spec, dtype="float32", block_size=16, num_kv_blocks=256,
              max_num_batched_tokens=256, num_threads=threads)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    steps, toks = 0, []
    t = time.perf_counter()
    for prompt in PROMPTS:
        llm.engine.add_request("r", prompt, params)
        while llm.engine.has_unfinished_requests():
            toks += [o.outputs[0].token_ids for o in llm.engine.step() if o.finished]
            steps += 1
    dt = time.perf_counter() - t
    stats = llm.engine.spec.stats.as_dict() if llm.engine.spec is not None else {}
    return toks, steps, sum(map(len, toks)) / dt, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", type=Path, default=None, help="where the tiny checkpoints are built (kept)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ck = _checkpoints(args.cache or Path(tmp))
        k = args.k
        pairs = [("mtp random", ck["rand"], {"method": "mtp", "num_speculative_tokens": k}),
                 ("mtp predictive", ck["pred"], {"method": "mtp", "num_speculative_tokens": k}),
                 ("draft 1-layer llama", ck["llama"],
                  {"method": "draft_model", "model": str(ck["llama1"]), "num_speculative_tokens": k}),
                 ("draft = target", ck["llama"],
                  {"method": "draft_model", "model": str(ck["llama"]), "num_speculative_tokens": k})]
        for name, folder, spec in pairs:
            a = _run(folder, None, args.max_tokens, args.threads)
            b = _run(folder, spec, args.max_tokens, args.threads)
            print(f"{name}: equal tokens {a[0] == b[0]}; steps {a[1]} -> {b[1]}; tok/s {a[2]:.1f} -> {b[2]:.1f} "
                  f"({b[2] / a[2]:.2f}x); acceptance {b[3].get('acceptance_rate', 0.0):.2f}, tokens per verify "
                  f"{b[3].get('tokens_per_verify', 0.0):.2f}", flush=True)


if __name__ == "__main__":
    main()
