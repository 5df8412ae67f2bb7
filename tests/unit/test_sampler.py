"""Sampler: filters, penalties and logprobs against hand-computed answers; counter-based draws
(Philox known answers, same key -> same token in any batch, uniformity); sampled frequencies
against softmax probabilities."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from engine.sampling.philox import derive_seed, philox4x32, philox4x32_int, sample_uniform_int, sample_uniforms, seed_as_int64
from engine.sampling.sampler import Sampler, SamplingMetadata, TokenHistory, _inverse_cdf, apply_penalties, apply_top_k_top_p_min_p
from engine.sampling.sampling_plan import RowFacts

NEG_INF = float("-inf")


def make_meta(n: int, vocab_size: int | None = None, **fields: Any) -> SamplingMetadata:
    """Builds metadata for n rows; each field is a scalar (broadcast) or a per-row list. Rows with a penalty get
    their token history from ``prompt_token_ids``/``output_token_ids`` (checked against ``vocab_size``). No host facts: the
    sampler reads the settings from the tensors (the engine passes them: see test_host_facts_change_nothing)."""
    defaults: dict[str, Any] = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                                    presence_penalty=0.0, frequency_penalty=0.0,
                                    repetition_penalty=1.0)
    tensors = {}
    for name, default in defaults.items():
        value = fields.pop(name, default)
        rows = value if isinstance(value, list) else [value] * n
        tensors[name] = torch.tensor(rows, dtype=torch.int64 if name == "top_k" else torch.float32)
    keys = {}
    for name, default in (("seeds", 0), ("choices", 0), ("positions", None)):
        value = fields.pop(name, default)
        # by default every row is its own key: row i samples position i of seed 0
        rows = list(range(n)) if value is None else value if isinstance(value, list) else [value] * n
        keys[name] = torch.tensor([seed_as_int64(v) for v in rows], dtype=torch.int64)
    prompts = fields.pop("prompt_token_ids", [[] for _ in range(n)])
    outputs = fields.pop("output_token_ids", [[] for _ in range(n)])
    penalized = [i for i in range(n) if float(tensors["repetition_penalty"][i]) != 1.0
                 or float(tensors["presence_penalty"][i]) != 0.0 or float(tensors["frequency_penalty"][i]) != 0.0]
    penalties = None
    if penalized:
        assert vocab_size is not None, "a penalty needs vocab_size"
        penalties = TokenHistory.from_lists(penalized, [prompts[i] for i in penalized],
                                           [outputs[i] for i in penalized], vocab_size)
    meta = SamplingMetadata(**tensors, **keys, num_logprobs=fields.pop("num_logprobs", [None] * n),
                            penalties=penalties)
    assert not fields, f"unknown fields {fields}"
    return meta


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().squeeze(1).tolist())


# ---------------------------------------------------------------- filters

def test_top_k_keeps_exactly_the_k_largest() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=g)
    ks = [1, 2, 7, 64, 300, 0]
    out = apply_top_k_top_p_min_p(logits, torch.tensor(ks), torch.ones(6), torch.zeros(6))
    for row, k in enumerate(ks):
        expected = set(logits[row].topk(k).indices.tolist()) if k > 0 else set(range(500))
        assert kept(out[row]) == expected
        assert torch.equal(out[row][torch.isfinite(out[row])],
                           logits[row][torch.isfinite(out[row])])


def test_top_k_with_ties_keeps_exactly_k() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 3.0, 0.0, 2.0]])
    out = apply_top_k_top_p_min_p(logits, torch.tensor([2]), torch.ones(1), torch.zeros(1))
    assert len(kept(out[0])) == 2 and kept(out[0]) <= {1, 2, 3, 4}


@pytest.mark.parametrize("top_p, expected", [
    (0.0, {2}), (0.3, {2}), (0.49, {2}), (0.6, {2, 0}), (0.75, {2, 0}), (0.85, {2, 0, 3}),
    (0.99, {2, 0, 3, 1}),
])
def test_top_p_keeps_the_smallest_nucleus(top_p: float, expected: set[int]) -> None:
    # probabilities 0.5 (id 2), 0.3 (id 0), 0.15 (id 3), 0.05 (id 1)
    logits = logits_from_probs([0.3, 0.05, 0.5, 0.15]).unsqueeze(0)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([0]), torch.tensor([top_p]),
                                  torch.zeros(1))
    assert kept(out[0]) == expected


@pytest.mark.parametrize("vocab, top_p", [(300, 0.3), (3000, 0.2), (3000, 0.9)])
def test_top_p_wide_nucleus_matches_a_sorted_reference(vocab: int, top_p: float) -> None:
    # Flat logits: nuclei of hundreds to thousands of tokens, past the first candidate widths.
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab)) * 0.5
    out = apply_top_k_top_p_min_p(logits, torch.zeros(3, dtype=torch.int64),
                                  torch.full((3,), top_p), torch.zeros(3))
    for row in range(3):
        probs, order = logits[row].double().softmax(-1).sort(descending=True)
        size = int((probs.cumsum(0) < top_p).sum()) + 1
        assert kept(out[row]) == set(order[:size].tolist())


@pytest.mark.parametrize("min_p, expected", [(0.2, {0, 1, 2, 3}), (0.3, {0, 1, 2}),
                                             (0.6, {0, 1}), (0.8, {0})])
def test_min_p_keeps_tokens_above_the_scaled_max(min_p: float, expected: set[int]) -> None:
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1]).unsqueeze(0)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([0]), torch.ones(1), torch.tensor([min_p]))
    assert kept(out[0]) == expected


@pytest.mark.parametrize("top_k, top_p, min_p, expected", [
    (3, 0.75, 0.0, {0, 1}),      # top-p on the top-3 renormalized: 0.44, 0.78 >= 0.75
    (0, 0.75, 0.0, {0, 1, 2}),   # without top-k: 0.4, 0.7 < 0.75, 0.9
    (3, 0.95, 0.6, {0, 1}),      # min-p floor 0.24 removes id 2
    (2, 1.0, 0.9, {0}),
    (4, 0.5, 0.0, {0, 1}),
])
def test_filter_combinations(top_k: int, top_p: float, min_p: float,
                             expected: set[int]) -> None:
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1]).unsqueeze(0)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([top_k]), torch.tensor([top_p]),
                                  torch.tensor([min_p]))
    assert kept(out[0]) == expected


def test_filters_are_per_row_and_pure() -> None:
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1]).repeat(4, 1)
    before = logits.clone()
    out = apply_top_k_top_p_min_p(logits, torch.tensor([1, 0, 0, 0]),
                                  torch.tensor([1.0, 0.5, 1.0, 1.0]),
                                  torch.tensor([0.0, 0.0, 0.6, 0.0]))
    assert [kept(r) for r in out] == [{0}, {0, 1}, {0, 1}, {0, 1, 2, 3}]
    assert torch.equal(logits, before)


def test_sampling_only_draws_kept_tokens() -> None:
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1]).repeat(400, 1)
    meta = make_meta(400, temperature=1.0, top_k=3, top_p=0.75)
    tokens = Sampler()(logits, meta).token_ids
    assert set(tokens) == {0, 1}


# ---------------------------------------------------------------- penalties

LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
PROMPT, OUTPUT = [[0]], [[1, 1, 3]]


@pytest.mark.parametrize("fields, expected", [
    (dict(repetition_penalty=2.0), [1.0, -2.0, 0.5, 1.5, -2.0]),
    (dict(presence_penalty=0.5), [2.0, -1.5, 0.5, 2.5, -2.0]),
    (dict(frequency_penalty=0.25), [2.0, -1.5, 0.5, 2.75, -2.0]),
    (dict(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
     [1.0, -3.0, 0.5, 0.75, -2.0]),
    (dict(presence_penalty=-1.0, frequency_penalty=-0.5), [2.0, 1.0, 0.5, 4.5, -2.0]),
])
def test_penalties_change_logits_exactly(fields: dict[str, float],
                                         expected: list[float]) -> None:
    meta = make_meta(1, 5, prompt_token_ids=PROMPT, output_token_ids=OUTPUT, **fields)
    before = LOGITS.clone()
    out = apply_penalties(LOGITS, meta)
    assert torch.equal(out, torch.tensor([expected]))
    assert torch.equal(LOGITS, before)


def test_penalties_only_touch_their_rows() -> None:
    logits = LOGITS.repeat(3, 1)
    meta = make_meta(3, 5, repetition_penalty=[1.0, 2.0, 1.0], presence_penalty=[0.0, 0.0, 0.5],
                     prompt_token_ids=PROMPT * 3, output_token_ids=OUTPUT * 3)
    out = apply_penalties(logits, meta)
    assert torch.equal(out[0], LOGITS[0])
    assert torch.equal(out[1], torch.tensor([1.0, -2.0, 0.5, 1.5, -2.0]))
    assert torch.equal(out[2], torch.tensor([2.0, -1.5, 0.5, 2.5, -2.0]))


def test_penalties_reject_out_of_vocab_tokens() -> None:
    with pytest.raises(ValueError, match="token ids"):
        make_meta(1, 5, presence_penalty=0.5, output_token_ids=[[5]])


def test_greedy_is_argmax_of_penalized_logits() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(3))
    assert Sampler()(logits, make_meta(8)).token_ids == logits.argmax(-1).tolist()
    top = logits.argmax(-1).tolist()
    meta = make_meta(8, 100, presence_penalty=100.0, output_token_ids=[[t] for t in top])
    second = logits.topk(2).indices[:, 1].tolist()
    assert Sampler()(logits, meta).token_ids == second


# ---------------------------------------------------------------- reproducibility

ROW_SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                dict(temperature=1.3, top_p=0.6), dict(temperature=1.0, min_p=0.1),
                dict(temperature=0.0), dict(temperature=1.0, top_k=2000, top_p=0.9)]


def run_rows(order: list[int], seeds: list[int], logits: torch.Tensor,
             steps: int = 4) -> dict[int, list[int]]:
    """Samples positions 0..steps-1 with rows in `order`; returns each original row's tokens."""
    n = len(order)
    fields = {key: [ROW_SETTINGS[i % len(ROW_SETTINGS)].get(key, default) for i in order]
              for key, default in [("temperature", 0.0), ("top_k", 0), ("top_p", 1.0),
                                   ("min_p", 0.0)]}
    sampler, tokens = Sampler(), {i: [] for i in order}
    for step in range(steps):
        meta = make_meta(n, seeds=[seeds[i] for i in order], choices=[i % 3 for i in order],
                         positions=step + 40, **fields)
        for pos, tok in enumerate(sampler(logits[order], meta).token_ids):
            tokens[order[pos]].append(tok)
    return tokens


def test_same_key_same_token_in_any_batch() -> None:
    n = 12
    logits = torch.randn(n, 3000, generator=torch.Generator().manual_seed(5)) * 1.5
    seeds = list(range(100, 100 + n))
    baseline = run_rows(list(range(n)), seeds, logits)
    assert run_rows(list(range(n)), seeds, logits) == baseline
    shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(6)).tolist()
    assert run_rows(shuffled, seeds, logits) == baseline
    subset = [7, 3, 9, 0]
    assert run_rows(subset, seeds, logits) == {i: baseline[i] for i in subset}
    for i in (0, 5):
        assert run_rows([i], seeds, logits) == {i: baseline[i]}
    other = run_rows(list(range(n)), [s + 1000 for s in seeds], logits)
    random_rows = [i for i in range(n) if ROW_SETTINGS[i % len(ROW_SETTINGS)]["temperature"]]
    assert sum(other[i] != baseline[i] for i in random_rows) >= len(random_rows) - 1


def test_a_row_token_is_a_function_of_its_key_and_logits() -> None:
    """Rows of one batch with the same key and logits sample the same token; the batch's other
    rows (greedy, other settings, other keys) change nothing."""
    logits = torch.randn(1, 2000, generator=torch.Generator().manual_seed(1)).repeat(6, 1)
    meta = make_meta(6, temperature=[1.0, 1.0, 0.0, 0.5, 1.0, 1.0], top_k=[0, 0, 0, 9, 0, 50],
                     seeds=[3, 3, 3, 4, 3, 3], choices=[2, 2, 0, 0, 2, 0], positions=17)
    tokens = Sampler()(logits, meta).token_ids
    assert tokens[0] == tokens[1] == tokens[4]
    alone = Sampler()(logits[:1], make_meta(1, temperature=1.0, seeds=3, choices=2, positions=17))
    assert alone.token_ids[0] == tokens[0]


def test_choices_and_positions_draw_different_uniforms() -> None:
    """n choices of one request at one position (a prefill actor samples them from one logits
    row) and successive positions of one choice all get their own draw."""
    choices = torch.arange(128)
    u = sample_uniforms(torch.full((128,), 7), choices, torch.full((128,), 300))
    assert len(set(u.tolist())) == 128
    positions = torch.arange(4096)
    u = sample_uniforms(torch.full((4096,), 7), torch.zeros(4096, dtype=torch.int64), positions)
    assert len(set(u.tolist())) == 4096
    flat = torch.zeros(1, 64)  # uniform over 64 tokens: 32 choices should not all agree
    meta = make_meta(32, temperature=1.0, seeds=9, choices=list(range(32)), positions=5)
    assert len(set(Sampler()(flat.repeat(32, 1), meta).token_ids)) > 16


def test_philox_matches_random123_known_answers() -> None:
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, expected in cases:
        assert philox4x32_int(counter, key) == expected
        words = philox4x32(tuple(torch.tensor([w]) for w in counter), tuple(torch.tensor([w]) for w in key))
        assert tuple(int(w) for w in words) == expected


def test_tensor_uniforms_match_the_int_reference_for_any_seed() -> None:
    seeds = [0, 1, 2**31, 2**32 + 5, 2**63 - 1, 2**63, 2**64 - 1, 2**70 + 3]
    keys = [(s, c, p) for s in seeds for c, p in ((0, 0), (3, 1), (127, 2**31 + 9))]
    u = sample_uniforms(torch.tensor([seed_as_int64(s) for s, _, _ in keys]),
                        torch.tensor([c for _, c, _ in keys]), torch.tensor([p for _, _, p in keys]))
    assert u.tolist() == [sample_uniform_int(s, c, p) for s, c, p in keys]
    assert ((u >= 0) & (u < 1)).all()


def test_uniforms_are_uniform_and_uncorrelated() -> None:
    """Chi-square over 64 equal bins for draws across positions, choices and seeds, and the
    serial correlation of successive positions."""
    n = 64 * 400
    i = torch.arange(n)
    for seeds, choices, positions in ((torch.full((n,), 42), torch.zeros_like(i), i),
                                      (torch.full((n,), 42), i, torch.full((n,), 10)),
                                      (i, torch.zeros_like(i), torch.zeros_like(i))):
        u = sample_uniforms(seeds, choices, positions)
        counts = torch.bincount((u * 64).long(), minlength=64).double()
        chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
        assert chi2 < 110.0  # 63 dof: P(chi2 > 110) ~ 2e-4; the keys are fixed, so is the outcome
        x = u - 0.5
        assert abs(float((x[1:] * x[:-1]).mean() / (x * x).mean())) < 0.03


def test_derived_seeds_are_distinct_and_reproducible() -> None:
    seeds = [derive_seed(0, i) for i in range(2000)]
    assert len(set(seeds)) == 2000 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [derive_seed(0, i) for i in range(2000)]
    assert derive_seed(1, 0) != seeds[0]


# ---------------------------------------------------------------- distribution

def chi_square(tokens: list[int], probs: torch.Tensor, support: list[int]) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=max(support) + 1).double()
    expected = probs.double() * len(tokens)
    return sum((counts[t] - expected[t]) ** 2 / expected[t] for t in support).item()


@pytest.mark.parametrize("vocab, support", [(4, [0, 1, 2, 3]), (1000, [5, 300, 555, 999])])
def test_temperature_sampling_matches_softmax(vocab: int, support: list[int]) -> None:
    n, temperature = 20000, 0.7
    logits = torch.full((vocab,), NEG_INF)
    logits[support] = torch.tensor([1.0, 0.5, 0.0, -1.0])
    expected = (logits / temperature).softmax(-1)
    tokens = Sampler()(logits.repeat(n, 1), make_meta(n, temperature=temperature)).token_ids
    assert set(tokens) <= set(support)
    # 3 degrees of freedom: P(chi2 > 16.27) = 0.001; the seed makes the outcome fixed.
    assert chi_square(tokens, expected, support) < 16.27


def test_top_p_sampling_matches_renormalized_nucleus() -> None:
    n = 20000
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05]).repeat(n, 1)
    tokens = Sampler()(logits, make_meta(n, temperature=1.0, top_p=0.9)).token_ids
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert set(tokens) == {0, 1, 2}
    assert chi_square(tokens, expected, [0, 1, 2]) < 13.82  # 2 dof, p = 0.001


@pytest.mark.parametrize("width", [3, 700])
def test_inverse_cdf_never_picks_a_zero_weight(width: int) -> None:
    weights = torch.zeros(4, width)
    weights[:, 1], weights[:, width - 2] = 1.0, 2.0
    uniforms = torch.tensor([0.0, 1 / 3 - 1e-9, 1 / 3 + 1e-9, 1 - 1e-16], dtype=torch.float64)
    assert _inverse_cdf(weights, uniforms).tolist() == [1, 1, width - 2, width - 2]


# ---------------------------------------------------------------- logprobs

def test_logprobs_come_from_raw_logits() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(9))
    meta = make_meta(4, 50, temperature=[0.0, 0.5, 2.0, 1.0], top_k=[0, 3, 0, 0],
                     repetition_penalty=1.5, presence_penalty=1.0,
                     prompt_token_ids=[[1, 2]] * 4, output_token_ids=[[3, 4, 4]] * 4,
                     num_logprobs=[3, 0, None, 5], seeds=[1, 2, 3, 4])
    out = Sampler()(logits, meta)
    raw = logits.log_softmax(-1)
    assert out.logprobs[2] is None
    for row, k in [(0, 3), (1, 0), (3, 5)]:
        entry = out.logprobs[row]
        assert entry is not None
        expected_ids = set(raw[row].topk(k).indices.tolist()) | {out.token_ids[row]}
        assert set(entry) == expected_ids
        for tok, lp in entry.items():
            assert math.isclose(lp, raw[row, tok].item(), rel_tol=1e-6, abs_tol=1e-6)


def test_metadata_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError):
        SamplingMetadata(*(torch.zeros(2) for _ in range(7)), seeds=torch.zeros(1, dtype=torch.int64),
                         choices=torch.zeros(2, dtype=torch.int64),
                         positions=torch.zeros(2, dtype=torch.int64), num_logprobs=[None, None])


# ---------------------------------------------------------------- host facts, one read

def test_host_facts_and_widths_change_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tokens and logprobs whether the sampler reads the settings from the tensors or gets them as host
    facts, and whatever candidate width a top-p row starts from (its last nucleus size): a nucleus wider than the
    candidates costs one more read, never another token."""
    import engine.sampling.sampler as sampler_mod

    n, vocab = 12, 3000
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(4)) * 0.6  # flat: wide nuclei
    settings = dict(temperature=[0.0, 1.0, 1.2, 0.9] * 3, top_p=[1.0, 0.9, 0.95, 0.5] * 3,
                    top_k=[0, 0, 0, 0] * 2 + [100, 0, 7, 0], min_p=[0.0] * 10 + [0.05, 0.0],
                    num_logprobs=[None, 2, None, 0] * 3, seeds=list(range(n)))
    reads: list[int] = []
    real = sampler_mod._to_host
    monkeypatch.setattr(sampler_mod, "_to_host", lambda packed: reads.append(packed.numel()) or real(packed))
    base = Sampler()(logits, make_meta(n, **settings))
    assert len(reads) == 2  # the flat top-p rows outgrew 64 candidates: redone over the sorted vocabulary
    meta = make_meta(n, **settings)
    facts = RowFacts(meta.temperature.tolist(), meta.top_k.tolist(), meta.top_p.tolist(), meta.min_p.tolist())
    sizes = [s for s in base.nucleus_sizes if s]
    assert len(sizes) == 8 and min(sizes) > 64  # the eight random top-p rows without top-k report their nucleus
    for hint in (0, 20, 100, 600, vocab):
        reads.clear()
        hinted = dataclasses.replace(meta, facts=dataclasses.replace(facts, nucleus_hint=[hint] * n))
        out = Sampler()(logits, hinted)
        assert out.token_ids == base.token_ids and out.logprobs == base.logprobs
        assert out.nucleus_sizes == base.nucleus_sizes
        # nuclei of 700-2700 tokens: only the whole sorted vocabulary (a hint past 1024 / 2) holds them all at once
        assert len(reads) == (1 if 2 * hint > 1024 else 2)


def reference_penalties(logits: torch.Tensor, prompts: list[list[int]], outputs: list[list[int]],
                        rep: list[float], presence: list[float], frequency: list[float]) -> torch.Tensor:
    """The penalties token by token on Python floats (vLLM's definitions)."""
    out = logits.clone()
    for row in range(logits.shape[0]):
        for t in set(prompts[row]) | set(outputs[row]):
            v = float(out[row, t])
            out[row, t] = v / rep[row] if v > 0 else v * rep[row]
        for t in set(outputs[row]):
            out[row, t] -= presence[row] + frequency[row] * outputs[row].count(t)
    return out


def test_penalties_match_the_token_by_token_reference() -> None:
    rng = torch.Generator().manual_seed(8)
    n, vocab = 7, 60
    logits = torch.randn(n, vocab, generator=rng) * 3
    prompts = [torch.randint(0, vocab, (int(k),), generator=rng).tolist() for k in torch.randint(0, 20, (n,))]
    outputs = [torch.randint(0, 12, (int(k),), generator=rng).tolist() for k in torch.randint(0, 40, (n,))]
    rep, presence, frequency = [1.3, 1.0, 0.7, 1.0, 2.0, 1.0, 1.1], [0.5, 0.0, -0.4, 0.0, 1.0, 0.0, 0.3], \
        [0.3, 0.0, 0.2, -0.5, 0.0, 0.0, 0.7]
    meta = make_meta(n, vocab, repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency,
                     prompt_token_ids=prompts, output_token_ids=outputs)
    assert meta.penalties is not None and meta.penalties.rows.tolist() == [0, 2, 3, 4, 6]  # row 1 and 5: none
    out = apply_penalties(logits, meta)
    assert torch.allclose(out, reference_penalties(logits, prompts, outputs, rep, presence, frequency), atol=1e-5)
    assert torch.equal(out[[1, 5]], logits[[1, 5]])
    # rows whose history is padded (shorter than the longest) are unchanged by the padding
    alone = apply_penalties(logits[2:3], make_meta(1, vocab, repetition_penalty=0.7, presence_penalty=-0.4,
                                                   frequency_penalty=0.2, prompt_token_ids=prompts[2:3],
                                                   output_token_ids=outputs[2:3]))
    assert torch.equal(alone[0], out[2])


# ---------------------------------------------------------------- the persistent sampling state

def test_sampling_state_keeps_histories_on_the_device_across_joins_and_leaves() -> None:
    """Sequences join, sample, leave and come back; a penalized one's history always holds its prompt and output
    (appended on the device from the sampled ids, rebuilt from lists only when it rejoins or its output changed
    behind the state's back); parameters, seeds and positions reach the rows; slots are reused and grow."""
    from engine.sampling.sampler import SamplerOutput
    from engine.request.sampling_params import SamplingParams
    from engine.sampling.sampling_state import SamplingState
    from engine.request.sequence import Sequence

    vocab = 50
    state = SamplingState(vocab, torch.device("cpu"), base_seed=3, capacity=2)
    params = [SamplingParams(temperature=0.5, top_k=5, seed=11), SamplingParams(repetition_penalty=1.5),
              SamplingParams(presence_penalty=0.5, frequency_penalty=0.2, top_p=0.8), SamplingParams(min_p=0.1)]
    seqs = [Sequence(seq_id=i, request_id=f"r{i}", index=i % 2, prompt_token_ids=[i, i + 1, 7],
                     params=params[i % 4], arrival=0.0, seed=None if i % 4 == 1 else 100 + i) for i in range(9)]
    rng = torch.Generator().manual_seed(0)
    for step in range(80):  # outputs past the histories' first width (64): they widen
        live = [q for q in seqs if (q.seq_id + step) % 5 != 0]  # each sequence skips some steps: leaves, rejoins
        if step == 6:
            seqs[1].output_token_ids.append(3)  # a token the state did not see: rebuilt from the lists
        batch = state.batch(live, list(range(len(live))))
        assert batch is not None and batch.logit_rows is None and len(state.slots) == len(live)
        meta = batch.meta
        assert meta.temperature.tolist() == [float(torch.tensor(q.params.temperature)) for q in live]
        assert meta.top_k.tolist() == [q.params.top_k for q in live]
        assert meta.positions.tolist() == [q.num_tokens for q in live]
        assert meta.seeds.tolist() == [q.seed if q.seed is not None else derive_seed(3, q.seq_id) for q in live]
        assert meta.choices.tolist() == [q.index for q in live]
        penalized = [i for i, q in enumerate(live) if q.params.repetition_penalty != 1.0
                     or q.params.presence_penalty or q.params.frequency_penalty]
        assert meta.penalties is not None and meta.penalties.rows.tolist() == penalized
        assert meta.penalties.lengths.tolist() == [live[i].num_tokens for i in penalized]
        assert meta.penalties.prompt_lens.tolist() == [3] * len(penalized)
        assert meta.penalties.max_output == max(len(live[i].output_token_ids) for i in penalized)
        for j, i in enumerate(penalized):
            q = live[i]
            assert meta.penalties.tokens[j, : q.num_tokens].tolist() == q.prompt_token_ids + q.output_token_ids
        sampled = torch.randint(0, vocab, (len(live),), generator=rng)
        state.record(batch, SamplerOutput(sampled.tolist(), [None] * len(live), sampled, [0] * len(live)))
        for q, t in zip(live, sampled.tolist()):
            q.output_token_ids.append(t)
    assert state.history is not None and state.history.shape[1] > 64
    assert state.floats.shape[0] >= 8 and len(state.free) + len(state.slots) == state.floats.shape[0]
    assert state.batch([]) is None and not state.slots  # a step without sampling rows frees every slot
    assert sorted(state.free_penalty_rows) == list(range(state.num_penalty_rows))
