"""``min_tokens`` as vLLM defines it: before that many output tokens no end token is sampled (EOS unless
``ignore_eos``, ``stop_token_ids``), an end token does not end, and no stop string is matched; validated
``0 <= min_tokens <= max_tokens`` in the engine and the proxy (a 400 naming it)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.completion_progress import CompletionProgress
from engine.sampling.min_tokens import end_tokens, suppress, suppressed_pairs
from engine.sampling.sampler import Sampler
from proxy.errors import APIError
from proxy.openai_protocol import ProtocolConfig, parse_chat_request, parse_completion_request, to_generate_request
from tests.factories import EXACT_DTYPE
from tests.unit.test_sampler import make_meta

EOS = 7


def seq(output: list[int], **params) -> SimpleNamespace:
    return SimpleNamespace(params=SamplingParams(max_tokens=8, **params), output_token_ids=output)


def test_rows_short_of_min_tokens_ban_their_end_tokens_only() -> None:
    seqs = [seq([], min_tokens=2), seq([1, 2], min_tokens=2), seq([1], min_tokens=3, stop_token_ids=[4, 99]),
            seq([], min_tokens=2, ignore_eos=True, stop_token_ids=[5]), seq([], min_tokens=0)]
    assert suppressed_pairs(seqs, [EOS], vocab_size=50) == ([0, 2, 2, 3], [EOS, 4, EOS, 5])
    assert end_tokens(SamplingParams(ignore_eos=True), [EOS]) == []


def test_the_sampler_never_draws_a_suppressed_token_and_logprobs_stay_raw() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0], [0.0, 1.0, 9.0, 2.0]])  # token 2 is the argmax of both rows
    pairs = torch.tensor([[0], [2]])
    out = Sampler()(logits, replace(make_meta(2, num_logprobs=[1, None]), suppressed=pairs))
    assert out.token_ids == [3, 2]  # row 0 takes the next best; row 1 is untouched
    assert out.logprobs[0] is not None and 2 in out.logprobs[0]  # the model's top token still in its logprobs
    assert out.logprobs[0][3] == pytest.approx(torch.log_softmax(logits[0], 0)[3].item())
    assert suppress(logits, pairs)[0, 2] == float("-inf") and logits[0, 2] == 9.0  # a new tensor
    for _ in range(20):  # random rows too, whatever the draw
        meta = replace(make_meta(1, temperature=[1.0], seeds=[_]), suppressed=torch.tensor([[0, 0], [2, 3]]))
        assert Sampler()(logits[:1], meta).token_ids[0] in (0, 1)


def test_stop_strings_are_not_matched_in_the_first_tokens_text() -> None:
    p = CompletionProgress(["ab"])
    assert not p.append("xab", check_stops=False)  # within min_tokens: not searched
    assert not p.append("c")
    assert p.append("ab") and p.text() == "xabc"  # a later one is
    q = CompletionProgress(["ab"])
    q.append("xa", check_stops=False)
    assert q.append("b") and q.text() == "x"  # one that ends in later text may begin in earlier text (as vLLM)


@pytest.mark.parametrize("bad", [-1, 9, True, 1.5])
def test_engine_refuses_min_tokens_outside_0_max_tokens(bad) -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=8, min_tokens=bad)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=8, min_tokens=2, grammar=("regex", "a+"))


def test_engine_ends_no_completion_before_min_tokens(tiny_checkpoint) -> None:
    llm = LLM(str(tiny_checkpoint("llama")), dtype=EXACT_DTYPE, kv_cache_gib=0.02)
    prompt = [[5, 17, 33, 9, 12]]
    first = llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True))[0].outputs[0]
    # its own first token as a stop token, a piece of its text as a stop string: each ends it early...
    ends: list[dict] = [{"stop_token_ids": [first.token_ids[0]]}]
    if first.text.strip():
        ends.append({"stop": [first.text.strip()[:2]]})
    for end in ends:
        for extra in ({}, {"n": 2, "temperature": 0.8, "seed": 3}):
            base = {"max_tokens": 16, "ignore_eos": True, **end, **extra}
            outs = llm.generate(prompt, SamplingParams(**base))[0].outputs
            early = min((len(o.token_ids) for o in outs if o.finish_reason == "stop"), default=99)
            assert early < 12, (end, extra, outs)
            # ...and never before min_tokens (n completions and a random draw too)
            for o in llm.generate(prompt, SamplingParams(**base, min_tokens=early + 3))[0].outputs:
                assert len(o.token_ids) >= early + 3, (end, extra, o)
                if "stop_token_ids" in end:
                    assert first.token_ids[0] not in o.token_ids[:early + 3]
    llm.engine.check_integrity()


def test_engine_suppresses_eos_until_min_tokens(tiny_checkpoint) -> None:
    """The model's EOS made the argmax of every step (its logits raised): without min_tokens it ends at once."""
    llm = LLM(str(tiny_checkpoint("llama")), dtype=EXACT_DTYPE, kv_cache_gib=0.02)
    eos = sorted(llm.engine.eos_token_ids)[0]
    head = llm.engine.runner.model
    logits = head.logits

    def eos_first(*a, **k):
        out = logits(*a, **k)
        out[:, eos] = out.max() + 10
        return out

    head.logits = eos_first
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8))[0].outputs[0].token_ids) == 1
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, min_tokens=5))[0].outputs[0]
    assert len(out.token_ids) == 6 and eos not in out.token_ids[:5] and out.token_ids[5] == eos
    assert out.finish_reason == "stop"


# ---- the proxy ----
CFG = ProtocolConfig(served_models=("m",), max_model_len=64)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_proxy_carries_min_tokens_to_the_actor_message() -> None:
    req = parse_chat_request({**CHAT, "min_tokens": 5, "max_completion_tokens": 8}, CFG)
    assert req.sampling.min_tokens == 5
    assert to_generate_request("r", [1, 2], req.sampling, 64).sampling.min_tokens == 5
    assert parse_completion_request({"model": "m", "prompt": "x", "min_tokens": 0}, CFG).sampling.min_tokens == 0


@pytest.mark.parametrize("body", [
    {"min_tokens": 9, "max_tokens": 8}, {"min_tokens": -1}, {"min_tokens": "3"}, {"min_tokens": 1.5},
    {"min_tokens": 2, "response_format": {"type": "json_object"}}, {"min_tokens": 65},
])
def test_proxy_refuses_min_tokens_naming_it(body) -> None:
    with pytest.raises(APIError) as e:
        parse_chat_request({**CHAT, **body}, CFG)
    assert e.value.status == 400 and e.value.param == "min_tokens"


def test_proxy_checks_min_tokens_against_a_chats_resolved_max_tokens() -> None:
    sampling = parse_chat_request({**CHAT, "min_tokens": 60}, CFG).sampling  # no max_tokens: the context's rest
    assert to_generate_request("r", [1] * 4, sampling, 64).sampling.max_tokens == 60
    with pytest.raises(APIError) as e:
        to_generate_request("r", [1] * 5, sampling, 64)
    assert e.value.param == "min_tokens"
