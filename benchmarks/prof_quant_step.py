"""Where a decode step's time goes, per model, side by side in one process (issue 44: the quantized checkpoints
against bfloat16 dense): every decode-only step of an offline batch (``--seqs`` prompts of 32 tokens, ``--tokens``
greedy tokens each) split into the quantized linears, the dense linears, ``lm_head``, paged decode attention, K/V
stores, RMS norms, sampling and the rest of the step, in milliseconds per step; rounds alternate between the models.

Times are the main thread's CPU time (``time.thread_time``: the engine's offline loop runs there; on a shared,
oversubscribed machine the wall clock mostly measures the wait for a core), medians over ``--rounds``; "wall/step"
is the whole ``generate`` (prefill and scheduling included) in the same CPU time, per generated token step.

    PYTHONPATH=$PWD python3 benchmarks/prof_quant_step.py ~/.cache/pdcluster/models/SmolLM2-135M-Instruct \\
        ~/.cache/pdcluster/quant/w8a8 ~/.cache/pdcluster/quant/w4a16 --seqs 8

One torch thread. The timers wrap engine functions (``engine.models.linear.Linear.__call__``,
``pdkernels.paged_decode_attention``, ``pdkernels.store_kv``, ``DecoderModel._norm``, ``ModelRunner._sample``,
``ModelRunner.execute``); each wrap costs ~1 us a call. Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import engine.models.linear as linear_mod
import engine.models.model as model_mod
import engine.model_runner as runner_mod
import pdkernels
from engine import LLM
from engine.request.sampling_params import SamplingParams

PARTS = ("linear.quant", "linear.dense", "lm_head", "attention", "store_kv", "norm", "sample")


class StepTimers:
    """CPU-time totals of the wrapped functions, counted only inside decode-only steps (mutates the wrapped
    classes and module for the process's life)."""

    def __init__(self, vocab: int) -> None:
        self.acc: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.steps = 0
        self._in_decode = False

        def linear_part(args: tuple[Any, ...]) -> str:
            lin = args[0]
            if lin.out_features >= vocab:
                return "lm_head"
            return "linear.quant" if lin.quant is not None else "linear.dense"

        self._wrap(linear_mod.Linear, "__call__", linear_part)
        self._wrap(pdkernels, "paged_decode_attention", lambda a: "attention")
        self._wrap(pdkernels, "store_kv", lambda a: "store_kv")
        self._wrap(model_mod.DecoderModel, "_norm", lambda a: "norm")
        self._wrap(runner_mod.ModelRunner, "_sample", lambda a: "sample")
        execute = runner_mod.ModelRunner.execute

        def timed_execute(runner: Any, out: Any, *args: Any, **kwargs: Any) -> Any:
            if out.prefills:
                return execute(runner, out, *args, **kwargs)
            self._in_decode = True
            t = time.thread_time()
            try:
                return execute(runner, out, *args, **kwargs)
            finally:
                self.acc["step"] += time.thread_time() - t
                self.steps += 1
                self._in_decode = False

        runner_mod.ModelRunner.execute = timed_execute  # type: ignore[method-assign]

    def _wrap(self, owner: Any, name: str, part: Any) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._in_decode:
                return inner(*args, **kwargs)
            t = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.acc[part(args)] += time.thread_time() - t

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.acc.clear()
        self.steps = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    llms = [LLM(m, dtype="bfloat16", max_model_len=32 + args.tokens + 8, kv_cache_gib=1, max_num_seqs=args.seqs,
                num_threads=1) for m in args.models]
    prompts = [[100 + (i * 7 + j * 13) % 3000 for j in range(32)] for i in range(args.seqs)]
    for llm in llms:
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    timers = StepTimers(vocab=json.loads(Path(args.models[0], "config.json").read_text())["vocab_size"])
    rows: list[dict[str, list[float]]] = [collections.defaultdict(list) for _ in llms]
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    for _ in range(args.rounds):
        for llm, row in zip(llms, rows):
            timers.reset()
            t = time.thread_time()
            llm.generate(prompts, sp)
            row["wall/step"].append((time.thread_time() - t) / args.tokens * 1e3)
            for part in ("step", *PARTS):
                row[part].append(timers.acc[part] / max(timers.steps, 1) * 1e3)
    med = [{k: statistics.median(v) for k, v in row.items()} for row in rows]
    for m in med:
        m["rest of step"] = m["step"] - sum(m[p] for p in PARTS)
    print(f"torch {torch.__version__}, 1 thread, {args.seqs} seqs, CPU ms per decode step, medians of {args.rounds}")
    print(f"{'':14}" + "".join(f"{Path(p).name[:16]:>18}" for p in args.models))
    for key in ("wall/step", "step", *PARTS, "rest of step"):
        print(f"{key:14}" + "".join(f"{m[key]:18.2f}" for m in med))
    base = med[0]["step"]
    print(f"{'step x first':14}" + "".join(f"{base / m['step']:18.2f}" for m in med))
    for llm in llms:
        llm.close()


if __name__ == "__main__":
    main()
