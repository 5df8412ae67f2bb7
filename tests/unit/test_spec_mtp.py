"""MTP drafts (engine/spec/spec_mtp.py) on a tiny DeepSeek-V3-shaped checkpoint with its next-token layer (random
weights, float32): the layer's weights are loaded and its drafts are the ones a reference computation of DeepSeek's
MTP gives (Hugging Face's decoder layer over the main model's hidden states); output with MTP drafts equals output
without (greedy, seeded sampling); a prefill engine hands a decode engine the MTP K/V (one more pool layer) and the
layer's last output, and the decode engine drafts exactly as one engine does."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import pdkernels
from engine import LLM, SamplingParams
from engine.scheduling.kv_cache_manager import cdiv
from engine.scheduling.scheduler import SchedulerOutput
from tests.factories import add_mtp_layer

COMMON: dict[str, Any] = dict(dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=64)
K = 3
# every request drafts K at every step (no adaptive k, no load switch): both paths of verification run
MTP = {"method": "mtp", "num_speculative_tokens": K, "draft_token_cost": 0.0, "verify_budget_tokens": 4096}
PROMPTS = [list(range(5, 25)) * 2 + [5, 6, 7], [30, 31, 32, 33] * 5, [50 + (i * 7) % 40 for i in range(30)], [9]]


@pytest.fixture(scope="module")
def mtp_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return add_mtp_layer(shutil.copytree(tiny_checkpoint("deepseek_v3"), tmp_path_factory.mktemp("mtp") / "m"))


def _spy_drafts(llm: LLM) -> list[dict[tuple[int, ...], tuple[int, ...]]]:
    """Per engine step, prompt -> the drafts its request verified (recorded after the drafter filled them)."""
    steps: list[dict[tuple[int, ...], tuple[int, ...]]] = []
    spec = llm.engine.spec
    complete = spec.complete

    def spy(out: SchedulerOutput) -> None:
        complete(out)
        steps.append({tuple(s.seq.prompt_token_ids): s.draft for s in out.scheduled if s.draft})

    spec.complete = spy  # type: ignore[method-assign]
    return steps


def _reference_drafts(folder: Path, prompt: list[int], first: int, k: int) -> list[int]:
    """DeepSeek's MTP computed directly: Hugging Face's main model gives the final hidden states ``h``; its decoder
    layer N (the checkpoint's next-token layer, loaded as a decoder layer) runs over ``eh_proj([enorm(emb(t_(i+1)));
    hnorm(h_i)])`` with full causal attention, and each draft appends a row reading the previous row's output."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    main = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    n = main.config.num_hidden_layers
    big = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, num_hidden_layers=n + 1,
                                               attn_implementation="eager").eval()
    layer, rotary = big.model.layers[n], big.model.rotary_emb
    w = {k_[len(f"model.layers.{n}."):]: v for k_, v in load_file(str(next(folder.glob("*.safetensors")))).items()
         if k_.startswith(f"model.layers.{n}.")}
    eps = main.config.rms_norm_eps

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w[name], eps)

    with torch.no_grad():
        ids = torch.tensor([prompt])
        hidden = main.model(input_ids=ids).last_hidden_state[0]  # after the final norm
        nxt = prompt[1:] + [first]
        drafts: list[int] = []
        for _ in range(k):
            x = torch.cat((norm(w["embed_tokens.weight"][nxt], "enorm.weight"), norm(hidden, "hnorm.weight")), -1)
            x = (x @ w["eh_proj.weight"].T)[None]
            t = x.shape[1]
            pos = torch.arange(t)[None]
            mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
            g = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))[0]
            tok = int((norm(g[-1], "shared_head.norm.weight") @ w["shared_head.head.weight"].T).argmax())
            drafts.append(tok)
            nxt, hidden = nxt + [tok], torch.cat((hidden, g[-1:]))
    return drafts


def test_mtp_layer_is_loaded_and_drafts_as_deepseek_mtp(mtp_checkpoint: Path) -> None:
    llm = LLM(str(mtp_checkpoint), speculative_config=MTP, **COMMON)
    steps = _spy_drafts(llm)
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=8, ignore_eos=True))
    first_drafts = {r: d for step in reversed(steps) for r, d in step.items()}  # each request's first verify
    assert len(first_drafts) == 3
    for p, o in zip(PROMPTS, outs):
        assert list(first_drafts[tuple(p)]) == _reference_drafts(mtp_checkpoint, p, o.outputs[0].token_ids[0], K)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=16, ignore_eos=True),
    SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3, logprobs=2),
], ids=["greedy", "seeded"])
def test_mtp_output_equals_without_speculation(mtp_checkpoint: Path, params: SamplingParams) -> None:
    want = LLM(str(mtp_checkpoint), **COMMON).generate(PROMPTS, params)
    spec = LLM(str(mtp_checkpoint), speculative_config=MTP, **COMMON)
    got = spec.generate(PROMPTS, params)
    again = spec.generate(PROMPTS, params)
    ids = [[o.outputs[0].token_ids for o in r] for r in (want, got, again)]
    assert ids[0] == ids[1] == ids[2]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    stats = spec.engine.spec.stats
    assert stats.proposed_tokens > 0 and stats.verified_requests > 0
    spec.engine.check_integrity()
    assert spec.engine.kv.pool.counts()["used"] == 0


def test_handed_over_mtp_state_drafts_as_one_engine(mtp_checkpoint: Path) -> None:
    """Prefill engine -> decode engine in one process: each layer's K/V as it is stored, the MTP layer's (pool layer
    N) included, goes into blocks the decode engine reserved, and the prefill's ``draft_state`` with the first token:
    the decode engine's drafts at every step are the single engine's, its first step's included."""
    folder, bs = str(mtp_checkpoint), COMMON["block_size"]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    one = LLM(folder, speculative_config=MTP, **COMMON)
    want_steps = _spy_drafts(one)
    want = one.generate(PROMPTS[:1], params)
    prefill = LLM(folder, speculative_config=MTP, **COMMON).engine
    decode_llm = LLM(folder, speculative_config=MTP, **COMMON)
    decode = decode_llm.engine
    assert prefill.num_cache_layers == decode.num_cache_layers == decode.model_config.num_layers + 1
    got_steps = _spy_drafts(decode_llm)
    prompt = PROMPTS[0]
    reserved = [b.block_id for b in decode.kv.pool.allocate(cdiv(len(prompt) + params.max_tokens, bs))]
    shipped: set[int] = set()

    def ship(layer: int, out: SchedulerOutput) -> None:
        shipped.add(layer)
        src, dst = prefill.kv_layer(layer), decode.kv_layer(layer)
        for s in out.scheduled:
            logical = s.export_range(bs)
            src_ids = torch.tensor([s.seq.block_table[j] for j in logical])
            dst_ids = torch.tensor([reserved[j] for j in logical])
            pdkernels.unpack_blocks(pdkernels.pack_blocks(src[0], src[1], src_ids), dst[0], dst[1], dst_ids)

    prefill.add_request("0", prompt, dataclasses.replace(params, max_tokens=1))
    first, state = None, None
    while prefill.has_unfinished_requests():
        for o in prefill.step(after_kv_store=ship):
            if o.finished:
                first, state = o.outputs[0].token_ids[0], prefill.draft_state("0")
    assert shipped == set(range(prefill.num_cache_layers))
    assert state is not None and len(state) == prefill.model_config.hidden_size
    decode.add_prefilled_request("0", prompt, params, [first], reserved, draft_state=state)
    tokens = None
    while decode.has_unfinished_requests():
        for o in decode.step():
            tokens = o.outputs[0].token_ids if o.finished else tokens
    assert tokens == want[0].outputs[0].token_ids
    key = tuple(prompt)
    assert [s[key] for s in got_steps if key in s] == [s[key] for s in want_steps if key in s]
    assert got_steps[0].get(key)  # it drafted at its very first step: the handed-over state
    decode.check_integrity()


def test_mtp_needs_a_checkpoint_with_its_next_token_layer(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="model.layers.3.enorm.weight is missing"):
        LLM(str(tiny_checkpoint("deepseek_v3")), speculative_config={"method": "mtp"}, **COMMON)
    with pytest.raises(ValueError, match="needs a DeepSeek"):
        LLM(str(tiny_checkpoint("llama")), speculative_config={"method": "mtp"}, **COMMON)


def test_an_mtp_layer_that_predicts_the_model_has_its_drafts_accepted(  # type: ignore[no-untyped-def]
        tiny_checkpoint, tmp_path) -> None:
    """Nothing trained: a bigram main model and an MTP layer that computes the same bigram step on the next token
    (tests/factories.py ``add_mtp_layer(predictive=True)``): its drafts, the chained ones included, are the model's
    own greedy tokens, so (nearly) all are accepted, and the output still equals the output without drafts."""
    folder = add_mtp_layer(shutil.copytree(tiny_checkpoint("deepseek_v3"), tmp_path / "p"), predictive=True)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = LLM(str(folder), **COMMON).generate(PROMPTS, params)
    spec = LLM(str(folder), speculative_config=MTP, **COMMON)
    got = spec.generate(PROMPTS, params)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in want]
    stats = spec.engine.spec.stats
    assert stats.proposed_tokens > 0 and stats.acceptance_rate > 0.9, stats.as_dict()
    assert stats.tokens_per_verify > K


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=14, ignore_eos=True),
    SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5),
], ids=["greedy", "seeded"])
def test_a_migrated_mtp_completion_drafts_at_once_on_its_new_owner(mtp_checkpoint: Path,
                                                                    params: SamplingParams) -> None:
    """Migration is a resume (proxy/dispatch.py): the new decode owner takes the completion with the tokens the
    client already has (``output_prefix``, into blocks it reserved) and computes prompt + those tokens itself; that
    computation runs the MTP layer's catch-up over every position too, so its MTP K/V and last output are whole and
    the very first decode step after it verifies real drafts (nothing to carry). The output equals the uninterrupted
    completion without speculation, token for token."""
    folder, bs = str(mtp_checkpoint), COMMON["block_size"]
    prompt, have = PROMPTS[0], 5
    want = LLM(folder, **COMMON).generate([prompt], params)[0].outputs[0].token_ids
    new_owner = LLM(folder, speculative_config=MTP, **COMMON)
    steps = _spy_drafts(new_owner)
    engine = new_owner.engine
    reserved = [b.block_id for b in engine.kv.pool.allocate(cdiv(len(prompt) + params.max_tokens, bs))]
    engine.add_request("r.1", prompt, params, block_ids=reserved, output_prefix=list(want[:have]))
    tokens = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens = o.outputs[0].token_ids if o.finished else tokens
    assert tokens == want
    assert not steps[0] and steps[1].get(tuple(prompt)), steps  # prefill + prefix, then drafts at once
    assert engine.spec.stats.proposed_tokens > 0
    engine.check_integrity()
    assert engine.kv.pool.counts()["used"] == 0
