"""Greedy identity with Hugging Face ``generate``: tiny random Llama / Qwen2 / Mistral / Qwen3 / Gemma 3 / Qwen3-MoE
(two layouts: mlp_only_layers, decoder_sparse_step 2 with norm_topk_prob) / Mixtral / DeepSeek-V3 / DeepSeek-V2
checkpoints,
batched together, with chunked prefill, prefix-cache hits, preemption and n = 2 each forced in turn; every token's
logprob within 1e-3 of Hugging Face's (float32)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from factories import QWEN3_MOE_STEP2, hf_greedy_logprobs

MAX_NEW = 16
LOGPROB_TOL = 1e-3


def prompts_with_shared_prefixes(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [[rng.randint(3, 399) for _ in range(rng.randint(1, 300))] for _ in range(14)]
    base[0] = [rng.randint(3, 399)]  # a one-token prompt
    shared = [base[1][:64] + [rng.randint(3, 399) for _ in range(20)], base[2][:33] + [7], list(base[3])]
    return base + shared


# a case's name -> (factory arch, overrides)
CASES = {name: (name, {}) for name in ("llama", "qwen2", "mistral", "qwen3", "gemma3", "qwen3_moe", "mixtral")}
CASES["qwen3_moe_step2"] = ("qwen3_moe", QWEN3_MOE_STEP2)
# YaRN on a per-head K/V model (Qwen2.5's long-context setting), beside DeepSeek's YaRN over the latent
CASES["qwen2_yarn"] = ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64}})
# DeepSeek's latent attention (MLA) over the latent cache: V3 with q_lora_rank, YaRN and the noaux_tc router; V2 with
# q as one projection and the softmax group-limited router (factories.ARCH_OVERRIDES)
CASES.update({name: (name, {}) for name in ("deepseek_v3", "deepseek_v2")})


@pytest.fixture(scope="module", params=list(CASES))
def arch_case(request: pytest.FixtureRequest, tiny_checkpoint):  # type: ignore[no-untyped-def]
    arch, overrides = CASES[request.param]
    folder = tiny_checkpoint(arch, **overrides)
    prompts = prompts_with_shared_prefixes()
    return folder, prompts, hf_greedy_logprobs(folder, prompts, MAX_NEW)


# The scenarios other than "preempt" hold every sequence at once: 17 prompts of at most 300 tokens + 16 new, twice for
# n = 2, need ~1,400 blocks of 8 at most. A cache of that order, not the engine's 2 GiB default: on these tiny models
# the default is ~260,000 blocks, ~2.5 s of CPU to build per engine (a Python object per block, 2 GiB zeroed).
ROOMY = 2048  # blocks

SCENARIOS = {
    # a 64-token budget splits every long prompt into chunks mixed with other sequences' decodes
    "chunked": dict(max_num_batched_tokens=64, block_size=16, num_kv_blocks=ROOMY, enable_prefix_caching=False),
    # the shared prefixes hit the prefix cache
    "prefix": dict(max_num_batched_tokens=512, block_size=8, num_kv_blocks=ROOMY, enable_prefix_caching=True),
    # 48 blocks of 8 tokens cannot hold the batch: sequences are preempted and recomputed
    "preempt": dict(max_num_batched_tokens=256, block_size=8, num_kv_blocks=48, enable_prefix_caching=True),
    # two completions per prompt, forked from one prefill: each is the greedy one
    "n2": dict(max_num_batched_tokens=128, block_size=8, num_kv_blocks=ROOMY, enable_prefix_caching=True),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_hf(arch_case, scenario: str) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, expected = arch_case
    n = 2 if scenario == "n2" else 1
    llm = LLM(str(folder), dtype="float32", max_num_seqs=64, **SCENARIOS[scenario])
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, n=n, logprobs=0))
    stats = llm.engine.scheduler.stats
    if scenario == "chunked":
        assert stats.partial_prefills > 0
    elif scenario == "prefix":
        assert stats.prefix_cached_tokens >= 64 + 32 + 8 * (len(prompts[3]) // 8 - 1)
    if scenario == "preempt":
        assert stats.preemptions > 0
    else:  # the cache holds them all: what is forced is the scenario's own
        assert stats.preemptions == 0
    for i, (out, (ref, ref_lps)) in enumerate(zip(outs, expected)):
        assert len(out.outputs) == n
        for c in out.outputs:
            assert c.token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens) completion {c.index} diverged"
            assert c.finish_reason == "length"
            lps = [step[t] for step, t in zip(c.logprobs, c.token_ids)]
            assert lps == pytest.approx(ref_lps, abs=LOGPROB_TOL), f"prompt {i} completion {c.index} logprobs"
    llm.engine.check_integrity()
    assert llm.engine.kv.pool.counts()["used"] == 0
