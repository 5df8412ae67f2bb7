"""Prompt logprobs (``SamplingParams.prompt_logprobs``, echo with logprobs): every prompt token's logprob within 1e-3
of Hugging Face's (float32, a tiny random Llama), the top-k alternatives with it; chunked prefill gives the numbers
one chunk gives; a request that asks skips the prefix cache (its positions are computed), one that does not still
hits it; a preempted request keeps what it computed."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from factories import ROOMY_KV_BLOCKS

TOL = 1e-3


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randint(3, 399)] + [rng.randint(3, 399) for _ in range(n - 1)] for n in (1, 2, 37, 150)]


def _hf_prompt_logprobs(folder, prompts: list[list[int]]) -> list[list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Per prompt, per position 1.., Hugging Face's float32 log-softmax row predicting that token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return [list(model(torch.tensor([p])).logits[0, :-1].float().log_softmax(-1)) for p in prompts]


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):  # type: ignore[no-untyped-def]
    folder = tiny_checkpoint("llama")
    prompts = _prompts()
    return folder, prompts, _hf_prompt_logprobs(folder, prompts)


def _run(folder, prompts, k: int | None, max_tokens: int = 2,  # type: ignore[no-untyped-def]
         **engine) -> tuple[list, LLM]:
    llm = LLM(str(folder), dtype="float32", max_num_seqs=8, **{"num_kv_blocks": ROOMY_KV_BLOCKS, **engine})
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=k))
    llm.engine.check_integrity()
    assert llm.engine.kv.pool.counts()["used"] == 0
    return outs, llm


@pytest.fixture(scope="module")
def one_chunk(llama) -> list:  # type: ignore[no-untyped-def]
    folder, prompts, _ = llama
    return _run(folder, prompts, 3, max_num_batched_tokens=512, block_size=16)[0]


def test_prompt_logprobs_match_hf(llama, one_chunk) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, ref = llama
    outs = one_chunk
    for p, out, rows in zip(prompts, outs, ref):
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(p) and lps[0] is None
        for pos in range(1, len(p)):
            entry, row = lps[pos], rows[pos - 1]
            assert entry[p[pos]] == pytest.approx(float(row[p[pos]]), abs=TOL), f"{len(p)}-token prompt, pos {pos}"
            top = row.topk(3).indices.tolist()
            assert set(top) <= set(entry) and len(entry) <= 4
            assert [entry[t] for t in top] == pytest.approx([float(row[t]) for t in top], abs=TOL)


def test_chunked_equals_one_chunk_and_prefix_cache_is_bypassed(llama, one_chunk) -> None:  # type: ignore
    folder, prompts, _ = llama
    whole = one_chunk
    # 24-token chunks beside other prompts' chunks; every prompt twice, the second time a prefix-cache hit but for
    # prompt_logprobs; a tiny cache preempts
    llm = LLM(str(folder), dtype="float32", max_num_seqs=8, max_num_batched_tokens=24, block_size=8,
              num_kv_blocks=ROOMY_KV_BLOCKS, enable_prefix_caching=True)
    first = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=3))
    again = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=3))
    assert llm.engine.scheduler.stats.partial_prefills > 0
    assert llm.engine.scheduler.stats.prefix_cached_tokens == 0  # asked: computed, not cached
    plain = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    assert llm.engine.scheduler.stats.prefix_cached_tokens > 0  # not asked: the cache serves
    assert all(o.prompt_logprobs is None for o in plain)
    for a, b, c in zip(whole, first, again):
        for got in (b.prompt_logprobs, c.prompt_logprobs):
            assert got[0] is None and len(got) == len(a.prompt_logprobs)
            for x, y in zip(a.prompt_logprobs[1:], got[1:]):
                assert x.keys() == y.keys()
                assert [y[t] for t in x] == pytest.approx([x[t] for t in x], abs=1e-4)


def test_preempted_request_keeps_its_prompt_logprobs(llama) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, ref = llama
    p = prompts[3][:40]
    outs, llm = _run(folder, [p] * 3, 0, 40, max_num_batched_tokens=32, block_size=8, num_kv_blocks=16,
                     enable_prefix_caching=False)
    assert llm.engine.scheduler.stats.preemptions > 0
    for out in outs:
        assert len(out.prompt_logprobs) == len(p)
        assert [out.prompt_logprobs[i][p[i]] for i in range(1, len(p))] == pytest.approx(
            [float(ref[3][i - 1][p[i]]) for i in range(1, len(p))], abs=TOL)


def test_prompt_logprobs_range_is_checked() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)
