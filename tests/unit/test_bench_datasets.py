"""pdcluster bench datasets: seeded, lengths confirmed by the tokenizer they are given (fakes here)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from cluster.loadgen.datasets import DatasetSpec, WordTokenizer, draw_len, make_dataset, text_of_tokens


class CharTokenizer:
    """One token per character; decodes exactly."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 300])
def test_text_has_the_asked_token_count(n: int) -> None:
    for tok in (WordTokenizer(), CharTokenizer()):
        text, count = text_of_tokens(n, random.Random(n), tok)
        assert count == n == len(tok.encode(text))


class MergingTokenizer(CharTokenizer):
    """Encodes "ab" as one token, so a cut between them changes the count on re-encoding."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text.replace("ab", "\x01")]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join("ab" if i == 1 else chr(i) for i in ids)


def test_a_cut_that_changes_the_count_reports_the_count_it_got() -> None:
    tok = MergingTokenizer()
    for seed in range(20):
        text, count = text_of_tokens(50, random.Random(seed), tok)
        assert count == len(tok.encode(text))
        assert abs(count - 50) <= 2


def test_same_seed_same_dataset_other_seed_other_dataset() -> None:
    spec = DatasetSpec(input_len=20, input_range=0.5, output_len=10, output_range=0.5)
    a = make_dataset(spec, 8, seed=1, tok=WordTokenizer())
    assert a == make_dataset(spec, 8, seed=1, tok=WordTokenizer())
    assert a != make_dataset(spec, 8, seed=2, tok=WordTokenizer())
    assert [c.index for c in a] == list(range(8))
    lens = [t.text_tokens for c in a for t in c.turns]
    assert all(10 <= n <= 30 for n in lens) and len(set(lens)) > 1
    assert all(5 <= t.max_tokens <= 15 for c in a for t in c.turns)


def test_shared_prefix_prompts_start_with_one_of_the_prefixes() -> None:
    spec = DatasetSpec(kind="shared-prefix", input_len=5, prefix_len=30, num_prefixes=3, output_len=4)
    tok = WordTokenizer()
    convs = make_dataset(spec, 9, seed=0, tok=tok)
    prefixes = [" ".join(c.turns[0].text.split()[:30]) for c in convs]
    assert len(set(prefixes)) == 3
    assert prefixes[0] == prefixes[3] == prefixes[6] != prefixes[1]
    assert all(t.text_tokens == 35 == len(tok.encode(t.text)) for c in convs for t in c.turns)


def test_chat_conversations_hold_turns_and_the_last_is_cut_to_the_request_count() -> None:
    convs = make_dataset(DatasetSpec(kind="chat", turns=3, input_len=8, output_len=4), 7, seed=0,
                         tok=WordTokenizer())
    assert [len(c.turns) for c in convs] == [3, 3, 1]
    assert len({t.text for c in convs for t in c.turns}) == 7


@pytest.mark.parametrize("kwargs, field", [
    ({"kind": "sharegpt"}, "dataset"), ({"input_len": 0}, "input_len"), ({"output_len": 0}, "output_len"),
    ({"input_range": 1.0}, "input_range"), ({"output_range": -0.1}, "output_range"),
    ({"kind": "shared-prefix"}, "prefix_len"), ({"turns": 2}, "turns"), ({"kind": "chat", "turns": 0}, "turns"),
    ({"prefix_len": -1}, "prefix_len"), ({"num_prefixes": 0}, "num_prefixes"),
])
def test_bad_specs_name_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DatasetSpec(**kwargs)


def test_draw_len_stays_in_range_and_at_least_one() -> None:
    rng = random.Random(0)
    assert {draw_len(10, 0.0, rng) for _ in range(20)} == {10}
    got = [draw_len(10, 0.5, rng) for _ in range(500)]
    assert min(got) == 5 and max(got) == 15
    assert min(draw_len(1, 0.9, rng) for _ in range(50)) == 1


def test_no_requests_is_an_error() -> None:
    with pytest.raises(ValueError, match="num_requests"):
        make_dataset(DatasetSpec(), 0, seed=0, tok=WordTokenizer())


def test_sweep_points_and_warmups_never_share_a_prompt() -> None:
    from cluster.loadgen.cli import point_dataset, warmup_dataset

    spec, tok = DatasetSpec(kind="random", input_len=12, output_len=4), WordTokenizer()
    texts = [{t.text for c in point_dataset(spec, 6, 0, i, tok) for t in c.turns} for i in range(3)]
    warm = [{t.text for c in warmup_dataset(spec, 2, 0, i, tok) for t in c.turns} for i in range(3)]
    every = texts + warm
    assert all(len(s) == (6 if k < 3 else 2) for k, s in enumerate(every))
    assert all(not (a & b) for k, a in enumerate(every) for b in every[k + 1:])
    assert point_dataset(spec, 6, 0, 1, tok) == point_dataset(spec, 6, 0, 1, tok)  # seeded: reproducible
