"""One engine on one checkpoint, for benchmarks/bench_quant.py: run as a subprocess under our python or vLLM's venv.

    python benchmarks/quant_worker.py JOB.json RESULT.json

JOB holds ``engine`` ("ours", "vllm", or "sim": the scheme's float32 simulation in transformers, under a python with
llmcompressor), ``model`` (a folder), ``dtype``, the teacher-forcing ``windows`` (token
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


def run_sim(job: dict[str, Any]) -> dict[str, Any]:
    """The scheme's exact float32 simulation, neutral to both engines: transformers' float32 model with the
    checkpoint's weights dequantized by compressed-tensors itself (``run_compressed=False``; run under a python with
    llmcompressor), and, where the scheme quantizes activations (W8A8: int8 per token, symmetric, dynamic), every
    quantized linear's input fake-quantized in float32 as both inference engines define it: ``s = max|x| / 127``,
    ``clamp(round_half_even(x / s), -128, 127) * s`` (compressed-tensors' own fake quantization divides by 127.5, its
    calibration-time range; vLLM's and our kernels use 127). No tok/s (not an engine)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    torch.set_num_threads(1)  # not timed: one thread spins less on the shared machine
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(run_compressed=False))
    model.eval()
    hooked = 0

    def fake_quant_int8(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        s = x.abs().amax(dim=-1, keepdim=True) / 127.0
        s = torch.where(s == 0, torch.ones_like(s), s)
        return (torch.clamp(torch.round(x / s), -128, 127) * s, *args[1:])

    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        acts = getattr(scheme, "input_activations", None)
        if acts is None:
            continue
        if not (acts.type == "int" and acts.num_bits == 8 and acts.symmetric and acts.dynamic
                and acts.strategy == "token"):
            raise ValueError(f"sim: activations {acts} not simulated (only int8 per token, symmetric, dynamic)")
        module.register_forward_pre_hook(fake_quant_int8)
        hooked += 1
    res: dict[str, Any] = {"load_s": time.perf_counter() - t0, "act_quant_linears": hooked}
    teacher = []
    with torch.no_grad():
        for w in job["windows"]:
            logp = model(torch.tensor([w])).logits[0].float().log_softmax(-1)
            top1 = logp[:-1].argmax(-1).tolist()
            real = logp[:-1].gather(1, torch.tensor(w[1:])[:, None])[:, 0].tolist()
            teacher.append([[t, lp] for t, lp in zip(top1, real)])
        res["teacher"] = teacher
        greedy = []
        eos = job.get("eos")
        for p in job["prompts"]:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=job["task_tokens"],
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
            toks = out[0, len(p):].tolist()
            if eos is not None and eos in toks:  # the engines return up to and including EOS
                toks = toks[: toks.index(eos) + 1]
            greedy.append(toks)
        res["greedy"] = greedy
    return {**res, "tok_s": None, "out_tokens": 0, "wall_s": 0.0}


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
        run = {"vllm": run_vllm, "sim": run_sim}.get(job["engine"], run_ours)
        result = run(job)
    except Exception as e:  # a checkpoint that does not load (or run) is a row that says why, not a crash
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
