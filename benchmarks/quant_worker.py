"""One engine on one checkpoint, for benchmarks/bench_quant.py: run as a subprocess under our python or vLLM's venv.

    python benchmarks/quant_worker.py JOB.json RESULT.json

JOB holds ``engine`` ("ours" or "vllm"), ``model`` (a folder), ``dtype``, the teacher-forcing ``windows`` (token
ids), the task ``prompts`` (chat-templated token ids) and ``task_tokens``, the throughput ``workload`` ([prompt ids,
output length] pairs), ``max_model_len``, ``kv_gib``, ``threads`` (0: the engine's default; vLLM's is set
through its environment by the orchestrator). RESULT gets ``load_s``, ``teacher`` (per window, per position
after the first: [top-1 id, log-probability of the real token]), ``greedy`` (token ids per task), ``tok_s``,
``out_tokens``, ``wall_s``, or ``error`` (the exception, when the checkpoint does not load or run). Both engines get
the same token ids, so one tokenizer (the orchestrator's) decides every text. Only the standard library is imported
at the top: vLLM's venv has no pdcluster dependencies, and ours has no vLLM.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


def _entry(d: dict[int, Any] | None) -> dict[int, float] | None:
    """A prompt-logprobs entry as {token id: logprob} (vLLM's values are Logprob objects, ours floats)."""
    if d is None:
        return None
    return {int(t): float(getattr(v, "logprob", v)) for t, v in d.items()}


def _teacher(entries: list[dict[int, float] | None], ids: list[int]) -> list[list[float]]:
    out = []
    for pos in range(1, len(ids)):
        entry = entries[pos]
        if entry is None or ids[pos] not in entry:
            raise RuntimeError(f"no prompt logprob for position {pos}")
        top1 = min(entry, key=lambda t: (-entry[t], t))
        out.append([top1, entry[ids[pos]]])
    return out


def run_vllm(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job["kv_gib"]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
              max_num_seqs=job["max_num_seqs"])
    res: dict[str, Any] = {"load_s": time.perf_counter() - t0}

    def gen(prompts: list[list[int]], params: list[Any]) -> list[Any]:
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    tf = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = gen(job["windows"], [tf] * len(job["windows"]))
    res["teacher"] = [_teacher([_entry(e) for e in o.prompt_logprobs], w) for o, w in zip(outs, job["windows"])]
    g = SamplingParams(max_tokens=job["task_tokens"], temperature=0.0)
    res["greedy"] = [list(o.outputs[0].token_ids) for o in gen(job["prompts"], [g] * len(job["prompts"]))]
    return {**res, **_throughput(lambda ps, ns: gen(ps, [SamplingParams(max_tokens=n, temperature=0.0,
                                                                        ignore_eos=True) for n in ns]),
                                 job["workload"])}


def run_ours(job: dict[str, Any]) -> dict[str, Any]:
    from engine import LLM
    from engine.request.sampling_params import SamplingParams

    t0 = time.perf_counter()
    threads = {"num_threads": job["threads"]} if job.get("threads") else {}
    llm = LLM(job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], kv_cache_gib=job["kv_gib"],
              max_num_seqs=job["max_num_seqs"], **threads)
    res: dict[str, Any] = {"load_s": time.perf_counter() - t0}
    tf = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate(job["windows"], tf)
    res["teacher"] = [_teacher([_entry(e) for e in o.prompt_logprobs], w) for o, w in zip(outs, job["windows"])]
    g = SamplingParams(max_tokens=job["task_tokens"], temperature=0.0)
    res["greedy"] = [list(o.outputs[0].token_ids) for o in llm.generate(job["prompts"], g)]

    def gen(prompts: list[list[int]], ns: list[int]) -> list[Any]:
        return llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in ns])

    return {**res, **_throughput(gen, job["workload"])}


def _throughput(gen: Any, workload: list[list[Any]]) -> dict[str, Any]:
    """Offline tok/s: all requests submitted at once, after a two-request warm-up."""
    if not workload:
        return {"tok_s": None, "out_tokens": 0, "wall_s": 0.0}
    gen([workload[0][0], workload[-1][0]], [4, 4])
    prompts, ns = [w[0] for w in workload], [int(w[1]) for w in workload]
    t0 = time.perf_counter()
    outs = gen(prompts, ns)
    wall = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": produced / wall, "out_tokens": produced, "wall_s": wall}


def main(argv: list[str]) -> int:
    job = json.loads(open(argv[1]).read())
    try:
        result = run_vllm(job) if job["engine"] == "vllm" else run_ours(job)
    except Exception as e:  # a checkpoint that does not load (or run) is a row that says why, not a crash
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
