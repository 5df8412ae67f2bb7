"""The per-request K/V tenant (issue 45): the proxy's namespace digest from the operator's source, and the engine's
block keys scoped by it, so another tenant's identical prompt is no prefix-cache hit. Pure, no tensors."""

from __future__ import annotations

import pytest

from cluster.wire.messages import GenerateRequest
from cluster.wire.proxy_settings import ProxySettings
from engine.scheduling.kv_cache_manager import KVCacheManager
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence
from proxy.tenant import kv_namespace

KEY = "sk-very-secret-key"


def test_each_source_names_a_namespace_and_an_api_key_is_never_sent_in_clear() -> None:
    h = {"Authorization": f"Bearer {KEY}", "X-Team": "red"}
    a = kv_namespace("api-key", h, "alice")
    assert a and KEY not in a and len(a) == 32
    assert a != kv_namespace("api-key", {"Authorization": "Bearer other"}, "alice")
    assert kv_namespace("user", h, "alice") != kv_namespace("user", h, "bob")
    assert kv_namespace("header:X-Team", h, None) != kv_namespace("header:X-Team", {"X-Team": "blue"}, None)
    # the same value under another source is another namespace
    assert kv_namespace("header:X-Team", {"X-Team": "alice"}, None) != kv_namespace("user", {}, "alice")
    assert kv_namespace("none", h, "alice") == ""
    assert kv_namespace("user", h, None) == "" and kv_namespace("api-key", {}, None) == ""


@pytest.mark.parametrize("bad", ["apikey", "header:", "header:X Team", "users", ""])
def test_a_bad_tenant_source_is_refused_naming_the_flag(bad: str) -> None:
    with pytest.raises(ValueError, match="kv_tenant_from"):
        ProxySettings(kv_tenant_from=bad)
    with pytest.raises(ValueError, match="kv_tenant_from"):
        kv_namespace(bad, {}, None)


def test_the_namespace_crosses_the_wire_into_the_engine_params() -> None:
    req = GenerateRequest(request_id="r", prompt_token_ids=(1, 2), sampling=SamplingParams(kv_namespace="ab" * 16))
    back = GenerateRequest.from_dict(req.to_dict())
    assert back.sampling.kv_namespace == "ab" * 16
    assert ProxySettings(kv_tenant_from="header:X-Team").argv()[-2:] == ["--kv-tenant-from", "header:X-Team"]


def _seq(i: int, toks: list[int], namespace: str) -> Sequence:
    return Sequence(seq_id=i, request_id=f"r{i}", index=0, prompt_token_ids=list(toks),
                    params=SamplingParams(kv_namespace=namespace), arrival=0.0)


def test_another_namespace_misses_the_device_prefix_cache_and_the_same_one_hits() -> None:
    toks = list(range(70))
    kv = KVCacheManager(16, 16, True, b"model")
    first = _seq(0, toks, "tenant-a")
    assert kv.get_computed_blocks(first) == []
    assert kv.allocate_slots(first, len(toks), []) is not None
    first.num_computed_tokens = len(toks)
    kv.cache_full_blocks(first)
    kv.free(first)
    assert kv.get_computed_blocks(_seq(1, toks, "tenant-b")) == []
    assert kv.get_computed_blocks(_seq(2, toks, "")) == []
    assert kv.lookup_prefix(toks, "tenant-b") == [] and kv.lookup_prefix(toks) == []
    assert len(kv.get_computed_blocks(_seq(3, toks, "tenant-a"))) == 4
    assert len(kv.lookup_prefix(toks, "tenant-a")) == 4
