"""One sampling type from the HTTP body to the sampler (engine/request/sampling_params.py): the proxy builds the engine's
``SamplingParams`` once, ``GenerateRequest`` carries it through the wire form (msgpack), and the engine receives it
equal, every field; its refusals are 400s naming the field; ``max_tokens`` has one default and one resolving rule."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest

from cluster.wire.messages import GenerateRequest, PrefillRequest, ReserveGrant, ReserveRequest
from engine import LLM
from engine.request.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams, resolve_max_tokens
from proxy.errors import APIError
from proxy.openai_protocol import ProtocolConfig, parse_chat_request, parse_completion_request, to_generate_request
from tests.factories import EXACT_DTYPE

CFG = ProtocolConfig(served_models=("m",), max_model_len=256)
PROMPT = (5, 17, 33, 9, 12)
TENANT = "ab" * 16
# every sampling field at a value other than its default; a grammar excludes min_tokens, so two bodies
COMPLETION = {"model": "m", "prompt": list(PROMPT), "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
              "min_p": 0.05, "seed": 11, "stop": ["\n\n", "END"], "stop_token_ids": [3, 4], "ignore_eos": True,
              "min_tokens": 2, "n": 2, "logprobs": 3, "echo": True, "presence_penalty": 0.5,
              "frequency_penalty": -0.5, "repetition_penalty": 1.3, "skip_special_tokens": False}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}}
EXPECTED = [
    SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=11, stop=("\n\n", "END"),
                   stop_token_ids=(3, 4), ignore_eos=True, min_tokens=2, n=2, logprobs=3, prompt_logprobs=3,
                   presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3, skip_special_tokens=False,
                   kv_namespace=TENANT),
    SamplingParams(max_tokens=7, temperature=1.0, grammar=("json_schema", '{"type": "integer"}'), kv_namespace=TENANT),
]


def _over_the_wire(gen: GenerateRequest) -> GenerateRequest:
    """What a decode actor (ReserveRequest) and a prefill actor (PrefillRequest) rebuild from the msgpack bytes."""
    reserve = ReserveRequest.from_dict(msgpack.unpackb(msgpack.packb(ReserveRequest(gen, 4).to_dict()), raw=False))
    grant = ReserveGrant("rsv", gen.request_id, "d0", (1, 2, 3, 4), "tcp://h:1", 30.0)
    prefill = PrefillRequest.from_dict(msgpack.unpackb(msgpack.packb(PrefillRequest(gen, grant).to_dict()), raw=False))
    assert reserve.request == prefill.request == gen
    return reserve.request


def _sent(body: dict[str, Any]) -> GenerateRequest:
    parse = parse_chat_request if "messages" in body else parse_completion_request
    return to_generate_request("r", PROMPT, parse(body, CFG).sampling, CFG.max_model_len, kv_namespace=TENANT)


def test_the_bodies_set_every_sampling_field() -> None:
    """The test below covers a field only if some body sets it away from its default (a new field: add it)."""
    for f in dataclasses.fields(SamplingParams):
        assert any(getattr(p, f.name) != f.default for p in EXPECTED), f"no body sets {f.name}"


@pytest.mark.parametrize("body, expected", zip((COMPLETION, CHAT), EXPECTED), ids=("completion", "chat"))
def test_every_field_arrives_equal_at_the_engine(tiny_checkpoint: Any, body: dict[str, Any],
                                                 expected: SamplingParams) -> None:
    gen = _sent(body)
    assert gen.sampling == expected
    back = _over_the_wire(gen)
    assert type(back.sampling) is SamplingParams and back.sampling == expected
    engine = LLM(str(tiny_checkpoint("llama")), dtype=EXACT_DTYPE, kv_cache_gib=0.02).engine
    engine.add_request("r", list(back.prompt_token_ids), back.sampling)  # what the decode actor hands on
    seqs = engine._requests["r"].seqs
    assert seqs[0].params == expected and seqs[0].params is back.sampling  # not rebuilt: the same object


@pytest.mark.parametrize("field, value", [
    ("temperature", 2.5), ("top_p", 0), ("top_k", -2), ("min_p", 1.5), ("seed", -1), ("n", 0), ("logprobs", 21),
    ("presence_penalty", 3), ("frequency_penalty", -3), ("repetition_penalty", 0), ("stop", [""]),
    ("stop_token_ids", [-1]), ("min_tokens", 10), ("max_tokens", 0), ("ignore_eos", "yes"),
])
def test_a_value_out_of_range_is_a_400_naming_the_field(field: str, value: Any) -> None:
    body = {**COMPLETION, "echo": False, field: value}
    with pytest.raises(APIError) as e:
        parse_completion_request(body, CFG)
    assert (e.value.status, e.value.param) == (400, field)


def test_the_types_own_refusal_becomes_a_400_naming_its_field() -> None:
    """A rule only the type holds (min_tokens with a grammar) reaches the client as a 400 naming the field."""
    with pytest.raises(APIError) as e:
        parse_chat_request({**CHAT, "min_tokens": 1}, CFG)
    assert (e.value.status, e.value.param) == (400, "min_tokens") and "grammar" in e.value.message


def test_max_tokens_one_default_and_the_rest_of_the_context() -> None:
    assert SamplingParams().max_tokens == DEFAULT_MAX_TOKENS == 16  # the offline API's and /v1/completions'
    assert parse_completion_request({"prompt": "x"}, CFG).sampling.max_tokens == DEFAULT_MAX_TOKENS
    chat = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}, CFG).sampling
    assert chat.max_tokens is None  # a chat that omits it: what the context leaves after the prompt (as vLLM)
    assert to_generate_request("r", PROMPT, chat, CFG.max_model_len).sampling.max_tokens == 256 - len(PROMPT)
    assert resolve_max_tokens(None, 250, 256) == 6 and resolve_max_tokens(4, 250, 256) == 4
    assert SamplingParams(max_tokens=None).for_prompt(250, 256).max_tokens == 6
    with pytest.raises(ValueError, match="min_tokens"):  # a min_tokens the rest of the context cannot hold
        SamplingParams(max_tokens=None, min_tokens=9).for_prompt(250, 256)


def test_the_offline_engine_resolves_an_open_max_tokens(tiny_checkpoint: Any) -> None:
    engine = LLM(str(tiny_checkpoint("llama")), dtype=EXACT_DTYPE, kv_cache_gib=0.02, max_model_len=64).engine
    engine.add_request("open", [5] * 61, SamplingParams(max_tokens=None))
    assert engine._requests["open"].seqs[0].params.max_tokens == 3
