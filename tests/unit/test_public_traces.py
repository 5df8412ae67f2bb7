"""Public traces: parsed, capped and scaled from tiny CSVs written here (never the real data); fetch copies locally."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cluster.control import public_traces as pt
from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile

AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:15:46.6805900,374,44\n"
         "2023-11-16 18:15:50.9951690,9000,109\n"
         "2023-11-16 18:15:48.0000000,20,0\n"  # 0 generated: dropped
         "2023-11-16 18:16:46.6805900,200,17000\n")
BURST = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
         "5,ChatGPT,472,18,490,Conversation log\n"
         "45,ChatGPT,1087,230,1317,Conversation log\n"
         "50,GPT-4,300,0,300,API log\n"  # failed: dropped
         "3700,GPT-4,417,276,693,Conversation log\n")


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / pt.SOURCES[name].filename
    p.write_text(text)
    return p


def test_azure_is_parsed_ordered_capped_and_asks_for_the_rest_of_the_context(tmp_path: Path) -> None:
    write(tmp_path, "azure-conv", AZURE)
    tr = pt.load("azure-conv", tmp_path)
    assert len(tr) == 3
    assert tr.t == pytest.approx([0.0, 4.3145790, 60.0])
    assert tr.prompt.tolist() == [374, pt.PROMPT_CAP, 200]  # 9,000 capped at 8,000
    assert tr.output.tolist() == [44, 109, pt.CONTEXT_TOKENS - 200]  # 17,000 capped to what the context leaves
    assert tr.max_tokens.tolist() == [pt.CONTEXT_TOKENS - p for p in tr.prompt.tolist()]  # never the true output
    assert tr.duration == 3600.0


def test_burstgpt_drops_failures_and_takes_a_window(tmp_path: Path) -> None:
    write(tmp_path, "burstgpt", BURST)
    tr = pt.load("burstgpt", tmp_path, start_s=0, duration_s=100)
    assert tr.t.tolist() == [0.0, 40.0] and tr.output.tolist() == [18, 230]
    late = pt.load("burstgpt", tmp_path, start_s=3600, duration_s=3600)
    assert late.t.tolist() == [95.0]
    with pytest.raises(ValueError, match="no request"):
        pt.load("burstgpt", tmp_path, start_s=10_000, duration_s=10)


def test_a_bad_file_is_refused_with_its_line(tmp_path: Path) -> None:
    write(tmp_path, "azure-code", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,12,x\n")
    with pytest.raises(ValueError, match=":2:"):
        pt.load("azure-code", tmp_path)
    write(tmp_path, "azure-code", "a,b,c\n")
    with pytest.raises(ValueError, match="header"):
        pt.load("azure-code", tmp_path)


def test_rate_scaling_keeps_the_window_and_the_mix(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = 2000
    t = np.sort(rng.uniform(0, 3600, n))
    prompt, output = rng.integers(10, 3000, n), rng.integers(1, 500, n)
    base = pt.shape(t, prompt, output)
    up = pt.shape(t, prompt, output, rate=2.5, seed=1)
    down = pt.shape(t, prompt, output, rate=0.5, seed=1)
    assert len(up) == pytest.approx(2.5 * n, rel=0.05) and len(down) == pytest.approx(0.5 * n, rel=0.1)
    assert up.t.min() >= 0 and up.t.max() < 3600 and np.all(np.diff(up.t) >= 0)
    assert up.prompt.mean() == pytest.approx(base.prompt.mean(), rel=0.05)
    assert not np.array_equal(up.t, pt.shape(t, prompt, output, rate=2.5, seed=2).t)  # the seed moves the copies
    prof = CostProfile.load(DEFAULT_PROFILE)
    r = pt.rate_for_load(base, 16, prof, 0.9)
    assert pt.rate_for_load(pt.shape(t, prompt, output, rate=r), 16, prof, 0.9) == pytest.approx(1.0, rel=0.05)


def test_fetch_copies_from_a_local_folder_and_says_what_it_could_not_get(tmp_path: Path) -> None:
    local, cache = tmp_path / "local", tmp_path / "cache"
    local.mkdir()
    write(local, "azure-conv", AZURE)
    out = pt.fetch(["azure-conv", "burstgpt"], cache, local, timeout_s=0.01)
    assert out["azure-conv"] == "copied" and (cache / "AzureLLMInferenceTrace_conv.csv").read_text() == AZURE
    assert out["burstgpt"] in ("downloaded",) or out["burstgpt"].startswith("unavailable")
    assert pt.fetch(["azure-conv"], cache, None)["azure-conv"] == "cached"
    with pytest.raises(FileNotFoundError, match="fetch"):
        pt.path_of("azure-code", cache)


def test_simulate_runs_a_public_trace_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from cluster.cli import main as cli_main

    rng = np.random.default_rng(1)
    rows = [f"2023-11-16 18:{m:02d}:{s:02d}.0000000,{rng.integers(50, 2000)},{rng.integers(1, 300)}"
            for m in range(10) for s in range(0, 60, 3)]
    write(tmp_path, "azure-conv", "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    monkeypatch.setenv("PDCLUSTER_TRACE_CACHE", str(tmp_path))
    out = tmp_path / "r.json"
    rc = cli_main(["simulate", "--public-trace", "azure-conv", "--duration", "600", "--trace-rate", "2",
                   "--workers", "4", "--policy", "adaptive", "--slo-ttft", "5", "--slo-tpot", "0.25",
                   "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["requests"] == pytest.approx(400, rel=0.15) and "public trace azure-conv" in report["source"]
