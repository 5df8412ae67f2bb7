"""Public production LLM traces for the simulator: fetched into a cache outside the repository, parsed, capped, scaled.

    python -m cluster.control.public_traces fetch [--from DIR] [--cache DIR]   # bring the files into the cache
    python -m cluster.control.public_traces show [--cache DIR]                 # what the cache holds, per trace

Traces (none is ever committed; the cache is ``~/.cache/pdcluster/traces`` unless ``--cache`` or
``PDCLUSTER_TRACE_CACHE`` says otherwise):

- ``azure-conv``, ``azure-code``: the Azure LLM inference traces of 2023 (github Azure/AzurePublicDataset,
  ``data/AzureLLMInferenceTrace_{conv,code}.csv``: ``TIMESTAMP,ContextTokens,GeneratedTokens``), one hour each of a
  production chat and a code-completion service;
- ``burstgpt``: BurstGPT (github HPMLL/BurstGPT, ``data/BurstGPT_1.csv``:
  ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``; timestamps in seconds over months; a
  response of 0 tokens is a failed request and is dropped).

``fetch`` copies each file from ``--from DIR`` when it holds it (a machine without internet), else downloads it
from its URL; a file already in the cache is kept. :func:`load` reads one into a
:class:`~cluster.control.sim_model.Trace`: prompts capped at :data:`PROMPT_CAP` tokens, the output capped to what the
context window leaves, the requested ``max_tokens`` set as a proxy would see it (the rest of the context: clients of
these services rarely send one), a window of the trace's time (BurstGPT: which hour), and the arrival rate scaled by
``rate`` (a rate above 1 superposes copies of the window shifted in time, each request kept with the remaining
probability, so the hour and its mix stay and only the rate grows; the seed picks the shifts). :func:`rate_for_load`
is the rate that fills a share of a cluster's capacity at its best split.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shutil
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster.control.sim_model import CostProfile, Trace

PROMPT_CAP = 8000  # prompt tokens kept of a longer prompt (the cap; the model's context is CONTEXT_TOKENS)
CONTEXT_TOKENS = 16384  # context window the requests are served in: max_tokens defaults to what the prompt leaves


@dataclass(frozen=True)
class TraceSource:
    name: str
    filename: str
    url: str
    kind: str  # azure | burstgpt


SOURCES = {s.name: s for s in (
    TraceSource("azure-conv", "AzureLLMInferenceTrace_conv.csv",
                "https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data/AzureLLMInferenceTrace_conv.csv",
                "azure"),
    TraceSource("azure-code", "AzureLLMInferenceTrace_code.csv",
                "https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data/AzureLLMInferenceTrace_code.csv",
                "azure"),
    TraceSource("burstgpt", "BurstGPT_1.csv",
                "https://github.com/HPMLL/BurstGPT/releases/download/v1.1/BurstGPT_1.csv", "burstgpt"),
)}


def cache_dir(override: str | Path | None = None) -> Path:
    """The trace cache: ``override``, else ``$PDCLUSTER_TRACE_CACHE``, else ``~/.cache/pdcluster/traces``. Pure."""
    if override:
        return Path(override)
    env = os.environ.get("PDCLUSTER_TRACE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pdcluster" / "traces"


def fetch(names: list[str], cache: Path, local: Path | None = None, timeout_s: float = 30.0) -> dict[str, str]:
    """Bring each named trace into ``cache``: kept if there, copied from ``local`` if it holds the file, else
    downloaded. Returns ``{name: outcome}`` (``cached``, ``copied``, ``downloaded`` or ``unavailable: why``); never
    raises for one trace that cannot be had. Writes files."""
    cache.mkdir(parents=True, exist_ok=True)
    out: dict[str, str] = {}
    for name in names:
        src = SOURCES[name]
        dest = cache / src.filename
        if dest.is_file() and dest.stat().st_size > 0:
            out[name] = "cached"
            continue
        if local is not None and (local / src.filename).is_file():
            shutil.copyfile(local / src.filename, dest)
            out[name] = "copied"
            continue
        part = dest.with_suffix(".part")
        try:
            with urllib.request.urlopen(src.url, timeout=timeout_s) as resp, open(part, "wb") as f:
                shutil.copyfileobj(resp, f)
            part.replace(dest)
            out[name] = "downloaded"
        except OSError as e:  # URLError is an OSError: no network, 404, refused
            part.unlink(missing_ok=True)
            out[name] = f"unavailable: {e}"
    return out


def path_of(name: str, cache: Path) -> Path:
    """The cached file of trace ``name``; ``FileNotFoundError`` says how to fetch it."""
    if name not in SOURCES:
        raise ValueError(f"trace: must be one of {sorted(SOURCES)}, got {name!r}")
    p = cache / SOURCES[name].filename
    if not p.is_file():
        raise FileNotFoundError(f"{p}: not fetched; run python -m cluster.control.public_traces fetch [--from DIR]")
    return p


def read_azure(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds since the first request, context tokens, generated tokens) of an Azure LLM trace, time-ordered;
    rows with 0 tokens on either side dropped. ``ValueError`` names a bad line."""
    stamps, prompt, output = [], [], []
    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None or [h.strip() for h in header[:3]] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise ValueError(f"{path}: expected the header TIMESTAMP,ContextTokens,GeneratedTokens, got {header!r}")
        for n, row in enumerate(rows, 2):
            try:
                stamps.append(row[0].strip().replace(" ", "T"))
                prompt.append(int(row[1]))
                output.append(int(row[2]))
            except (IndexError, ValueError) as e:
                raise ValueError(f"{path}:{n}: expected TIMESTAMP,ContextTokens,GeneratedTokens: {e}") from None
    if not stamps:
        raise ValueError(f"{path}: no requests")
    try:
        ts = np.array(stamps, dtype="datetime64[ns]")
    except ValueError as e:
        raise ValueError(f"{path}: a TIMESTAMP is not a date and time: {e}") from None
    t = (ts - ts.min()).astype(np.float64) / 1e9
    return _ordered(t, np.asarray(prompt, dtype=np.int64), np.asarray(output, dtype=np.int64))


def read_burstgpt(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds since the first request, request tokens, response tokens) of a BurstGPT CSV, time-ordered; failed
    requests (0 response tokens) dropped. ``ValueError`` names a bad line."""
    t, prompt, output = [], [], []
    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        want = ["Timestamp", "Model", "Request tokens", "Response tokens"]
        if header is None or [h.strip() for h in header[:4]] != want:
            raise ValueError(f"{path}: expected a header starting {','.join(want)}, got {header!r}")
        for n, row in enumerate(rows, 2):
            try:
                t.append(float(row[0]))
                prompt.append(int(row[2]))
                output.append(int(row[3]))
            except (IndexError, ValueError) as e:
                raise ValueError(f"{path}:{n}: expected Timestamp,Model,Request tokens,Response tokens: {e}") from None
    if not t:
        raise ValueError(f"{path}: no requests")
    ta = np.asarray(t, dtype=np.float64)
    return _ordered(ta - ta.min(), np.asarray(prompt, dtype=np.int64), np.asarray(output, dtype=np.int64))


def _ordered(t: np.ndarray, prompt: np.ndarray, output: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    keep = (prompt > 0) & (output > 0) & np.isfinite(t)
    t, prompt, output = t[keep], prompt[keep], output[keep]
    order = np.argsort(t, kind="stable")
    return t[order], prompt[order], output[order]


def shape(t: np.ndarray, prompt: np.ndarray, output: np.ndarray, start_s: float = 0.0, duration_s: float = 3600.0,
          rate: float = 1.0, seed: int = 0, prompt_cap: int = PROMPT_CAP,
          context_tokens: int = CONTEXT_TOKENS) -> Trace:
    """A simulator trace from raw arrivals: the window ``[start_s, start_s + duration_s)`` (times from its start),
    prompts capped at ``prompt_cap``, outputs at what the context leaves, ``max_tokens`` the rest of the context, the
    rate scaled by ``rate`` (above 1: copies shifted in time by the seed, each request kept with the remaining
    probability; below 1: each kept with probability ``rate``). Pure (seeded)."""
    if not (duration_s > 0 and rate > 0 and prompt_cap >= 1 and context_tokens > prompt_cap):
        raise ValueError("duration_s and rate must be > 0, prompt_cap >= 1, context_tokens > prompt_cap")
    sel = (t >= start_s) & (t < start_s + duration_s)
    if not sel.any():
        raise ValueError(f"no request in [{start_s}, {start_s + duration_s}) s of the trace")
    t0, p0 = t[sel] - start_s, np.minimum(prompt[sel], prompt_cap)
    o0 = np.minimum(output[sel], context_tokens - p0)
    rng = np.random.default_rng(seed)
    copies = max(1, math.ceil(rate))
    keep_p = rate / copies
    ts, ps, os_ = [], [], []
    for c in range(copies):
        shift = 0.0 if c == 0 and seed == 0 else float(rng.uniform(0, duration_s))
        kept = rng.random(len(t0)) < keep_p if keep_p < 1 else np.ones(len(t0), dtype=bool)
        ts.append((t0[kept] + shift) % duration_s)
        ps.append(p0[kept])
        os_.append(o0[kept])
    ta, pa, oa = np.concatenate(ts), np.concatenate(ps), np.concatenate(os_)
    order = np.argsort(ta, kind="stable")
    pa = pa[order]
    return Trace(ta[order], pa, oa[order], float(duration_s), max_tokens=context_tokens - pa)


def load(name: str, cache: Path | None = None, **kw: float) -> Trace:
    """Trace ``name`` from the cache, shaped by :func:`shape` (``kw``: its keyword arguments)."""
    c = cache_dir(cache)
    p = path_of(name, c)
    raw = read_azure(p) if SOURCES[name].kind == "azure" else read_burstgpt(p)
    return shape(*raw, **kw)  # type: ignore[arg-type]


def rate_for_load(trace: Trace, workers: int, profile: CostProfile, load: float) -> float:
    """The rate multiplier at which ``trace`` fills ``load`` of ``workers`` at its ideal split: its mean work in
    worker-seconds per second (prompts at the profile's prefill rate, outputs at its decode rate at half its batch
    and the trace's mean context) over ``load x workers``. Pure."""
    ctx = float(trace.prompt.mean() + trace.output.mean() / 2)
    decode_tps = profile.decode_capacity_tps(max(1, profile.max_batch // 2), ctx)
    work = float(trace.prompt.sum()) / profile.prefill_tps + float(trace.output.sum()) / decode_tps
    return load * workers * trace.duration / work


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("fetch", "show"))
    ap.add_argument("--cache", default=None, help="the trace cache (default ~/.cache/pdcluster/traces)")
    ap.add_argument("--from", dest="local", default=None, help="a folder holding the CSV files (no internet)")
    ap.add_argument("--traces", default=",".join(SOURCES), help="which traces (comma-separated)")
    args = ap.parse_args(argv)
    cache = cache_dir(args.cache)
    names = [n for n in args.traces.split(",") if n]
    bad = [n for n in names if n not in SOURCES]
    if bad:
        print(f"error: unknown trace(s) {bad}; known: {sorted(SOURCES)}", file=sys.stderr)
        return 2
    if args.command == "fetch":
        for name, outcome in fetch(names, cache, Path(args.local) if args.local else None).items():
            print(f"{name:<11} {outcome}")
        return 0
    for name in names:
        try:
            tr = load(name, cache, duration_s=1e12)
        except (OSError, ValueError) as e:
            print(f"{name:<11} {e}")
            continue
        print(f"{name:<11} {len(tr)} requests over {tr.t[-1]:.0f} s; prompt mean {tr.prompt.mean():.0f} (capped at "
              f"{PROMPT_CAP}), output mean {tr.output.mean():.0f} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
