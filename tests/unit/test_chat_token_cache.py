"""The proxy's chat token cache (issue 45): a conversation's next turn takes the ids its earlier turns were served with
for the rendered text's head, the rest tokenized; per tenant and model; bounded; the text never changes. Pure: a toy
tokenizer whose canonical encoding merges "maple" into one id while a model may have generated it as three."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from cluster.wire.proxy_settings import ProxySettings
from proxy.chat_token_cache import ChatTokenCache, answer_ids_for_text

# canonical tokenization: the longest piece first; "m", "ap", "le" exist too (what the "model" generates)
PIECES = ["<end>", "maple", "ap", "le"] + [chr(c) for c in range(32, 127)] + ["\n"]
ID = {p: i for i, p in enumerate(PIECES)}
END = ID["<end>"]


def encode(text: str) -> list[int]:
    out, i = [], 0
    while i < len(text):
        p = max((p for p in PIECES if text.startswith(p, i)), key=len)
        out.append(ID[p])
        i += len(p)
    return out


def decode(ids: Sequence[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def render(turns: list[tuple[str, str]], question: str) -> str:
    """A toy chat template: the end marker after every message, a generation prompt at the end."""
    return "sys<end>\n" + "".join(f"U:{q}<end>\nA:{a}<end>\n" for q, a in turns) + f"U:{question}<end>\nA:"


GENERATED = [ID["T"], ID["h"], ID["e"], ID[" "], ID["m"], ID["ap"], ID["le"], END]  # "The maple" + end of turn
ANSWER = "The maple"
SCOPE = ("fp", "")


def first_turn(cache: ChatTokenCache, scope: tuple[str, str] = SCOPE) -> None:
    turn = cache.prompt(scope, render([], "tree?"), encode)
    assert turn.reused_tokens == 0 and list(turn.ids) == encode(render([], "tree?"))
    assert cache.record(turn, ANSWER, GENERATED, decode)


def test_the_next_turn_reuses_the_generated_ids_and_tokenizes_only_the_rest() -> None:
    cache = ChatTokenCache(1 << 20)
    first_turn(cache)
    rendered = render([("tree?", ANSWER)], "more")
    turn = cache.prompt(SCOPE, rendered, encode)
    head = encode(render([], "tree?")) + GENERATED[:-1]  # the end id left out: the template renders it
    assert list(turn.ids) == head + encode(rendered[len(render([], "tree?")) + len(ANSWER):])
    assert turn.reused_tokens == len(head)
    assert decode(turn.ids) == rendered  # the same text, character for character
    assert list(turn.ids) != encode(rendered)  # where the canonical tokenization differs ("maple" is one id there)
    assert (cache.hits, cache.misses, cache.reused_tokens) == (1, 1, len(head))
    # a third turn chains on the second's record (its prompt ids are the spliced ones)
    assert cache.record(turn, "ok", [ID["o"], ID["k"], END], decode)
    third = cache.prompt(SCOPE, render([("tree?", ANSWER), ("more", "ok")], "bye"), encode)
    assert list(third.ids[:len(turn.ids)]) == list(turn.ids) and third.reused_tokens == len(turn.ids) + 2


def test_another_tenant_or_model_never_reuses_a_record() -> None:
    cache = ChatTokenCache(1 << 20)
    first_turn(cache, ("fp", "tenant-a"))
    rendered = render([("tree?", ANSWER)], "more")
    for scope in (("fp", "tenant-b"), ("fp", ""), ("other-model", "tenant-a"), None):
        turn = cache.prompt(scope, rendered, encode)
        assert turn.reused_tokens == 0 and list(turn.ids) == encode(rendered)
    assert cache.prompt(("fp", "tenant-a"), rendered, encode).reused_tokens > 0


def test_the_longest_recorded_head_wins_and_a_changed_answer_falls_back_to_the_prompt() -> None:
    cache = ChatTokenCache(1 << 20)
    first_turn(cache)
    short = cache.prompt(SCOPE, render([], "tree?"), encode)  # the same prompt again (a regenerate)
    assert short.reused_tokens == len(encode(render([], "tree?")))
    # the client edited the answer: only the prompt's ids are reused, the edited text tokenized canonically
    edited = render([("tree?", "The oak")], "more")
    turn = cache.prompt(SCOPE, edited, encode)
    assert turn.reused_tokens == len(encode(render([], "tree?"))) and decode(turn.ids) == edited
    # two answers of one prompt (n=2): the one the client kept is the one reused
    assert cache.record(short, "Th", [ID["T"], ID["h"], END], decode)
    turn = cache.prompt(SCOPE, render([("tree?", ANSWER)], "more"), encode)
    assert turn.reused_tokens == len(encode(render([], "tree?"))) + len(GENERATED) - 1


def test_nothing_matches_a_different_conversation() -> None:
    cache = ChatTokenCache(1 << 20)
    first_turn(cache)
    other = "other<end>\nU:tree?<end>\nA:"
    turn = cache.prompt(SCOPE, other, encode)
    assert turn.reused_tokens == 0 and list(turn.ids) == encode(other) and cache.misses == 2


def test_answer_ids_are_trimmed_to_the_text_or_not_recorded() -> None:
    assert answer_ids_for_text(GENERATED, ANSWER, decode) == GENERATED[:-1]  # the end of turn dropped
    assert answer_ids_for_text(GENERATED[:-1], ANSWER, decode) == GENERATED[:-1]  # finish "length": nothing dropped
    # a stop string "ap" cut the text "The m": the ids end where the text does
    assert answer_ids_for_text(GENERATED, "The m", decode) == GENERATED[:5]
    # a stop string cutting inside a token ("The ma"): no head decodes to it, so the answer is not recorded
    assert answer_ids_for_text(GENERATED, "The ma", decode) is None
    cache = ChatTokenCache(1 << 20)
    turn = cache.prompt(SCOPE, render([], "tree?"), encode)
    assert not cache.record(turn, "The ma", GENERATED, decode) and cache.unrecorded == 1 and cache.entries == 0
    # a text the ids never said (a detokenizer that hid a special token mid-answer)
    assert answer_ids_for_text([ID["a"], END, ID["b"]], "ab", decode) is None


def test_the_bound_evicts_the_least_recently_used_record() -> None:
    probe = ChatTokenCache(1 << 20)
    first_turn(probe)
    size = probe.bytes
    cache = ChatTokenCache(2 * size + size // 2)  # room for two records of this size
    turns = []
    for q in ("aaaa?", "bbbb?", "cccc?"):
        t = cache.prompt(SCOPE, render([], q), encode)
        turns.append(t)
        assert cache.record(t, ANSWER, GENERATED, decode)
        if q == "bbbb?":  # use the first again: the second is now the least recently used
            assert cache.prompt(SCOPE, render([("aaaa?", ANSWER)], "x"), encode).reused_tokens > 0
    assert cache.entries == 2 and cache.bytes <= cache.max_bytes
    assert cache.prompt(SCOPE, render([("bbbb?", ANSWER)], "x"), encode).reused_tokens == 0
    assert cache.prompt(SCOPE, render([("aaaa?", ANSWER)], "x"), encode).reused_tokens > 0
    # re-recording the same text replaces, not duplicates
    assert cache.record(turns[2], ANSWER, GENERATED, decode) and cache.entries == 2
    # a record larger than the whole bound is not kept
    tiny = ChatTokenCache(size - 1)
    assert not tiny.record(tiny.prompt(SCOPE, render([], "tree?"), encode), ANSWER, GENERATED, decode)
    assert tiny.entries == 0 and tiny.bytes == 0


def test_off_records_nothing_and_tokenizes_as_before() -> None:
    cache = ChatTokenCache(0)
    assert not cache.enabled
    turn = cache.prompt(SCOPE, render([], "tree?"), encode)
    assert not cache.record(turn, ANSWER, GENERATED, decode)
    rendered = render([("tree?", ANSWER)], "more")
    assert list(cache.prompt(SCOPE, rendered, encode).ids) == encode(rendered)
    assert (cache.hits, cache.misses, cache.entries) == (0, 0, 0)


def test_the_flag_and_its_metrics() -> None:
    assert ProxySettings().chat_token_cache_mib == 64
    argv = ProxySettings(chat_token_cache_mib=0).argv()
    assert argv[argv.index("--chat-token-cache-mib") + 1] == "0"
    with pytest.raises(ValueError, match="chat_token_cache_mib"):
        ProxySettings(chat_token_cache_mib=-1)
    with pytest.raises(ValueError, match="max_bytes"):
        ChatTokenCache(-1)
    cache = ChatTokenCache(1 << 20)
    first_turn(cache)
    cache.prompt(SCOPE, render([("tree?", ANSWER)], "more"), encode)
    lines = cache.metric_lines()
    assert "pdcluster_chat_token_cache_hits_total 1" in lines and "pdcluster_chat_token_cache_misses_total 1" in lines
    assert "pdcluster_chat_token_cache_entries 1" in lines
    assert "# TYPE pdcluster_chat_token_cache_bytes gauge" in lines


def test_the_scope_needs_one_fingerprint_and_answers_are_recorded_only_whole_and_from_that_model() -> None:
    import asyncio

    from cluster.wire.messages import GenerateRequest
    from engine.request.sampling_params import SamplingParams
    from proxy.chat_token_cache import chat_scope, record_finished
    from proxy.jobs import Job, Leg
    from types import SimpleNamespace

    assert chat_scope([{"fingerprint": "fp"}, {"fingerprint": "fp"}], "t") == ("fp", "t")
    assert chat_scope([{"fingerprint": "fp"}, {"fingerprint": "new"}], "t") is None  # a rolling model change
    assert chat_scope([], "t") is None

    def job(fingerprint: str, finish: str | None, error: str | None = None) -> Job:
        cache_turn = cache.prompt(SCOPE, render([], "tree?"), encode)
        j = Job(GenerateRequest("r", tuple(cache_turn.ids), SamplingParams(n=2)), 0,
                chat_turn=cache_turn)
        j.legs.append(Leg(j.req, asyncio.Queue(), actor=SimpleNamespace(info={"fingerprint": fingerprint})))
        j.choices[0].text, j.choices[0].token_ids, j.choices[0].finish = ANSWER, list(GENERATED), finish
        j.choices[1].text, j.choices[1].token_ids, j.choices[1].finish = "Th", [ID["T"], ID["h"]], "length"
        j.error = error
        return j

    cache = ChatTokenCache(1 << 20)
    record_finished(cache, [job("other", "stop"), job("fp", "stop", error="boom")], decode)
    assert cache.entries == 0
    record_finished(cache, [job("fp", None)], decode)  # the first completion never finished: the second is kept
    assert cache.entries == 1
    record_finished(cache, [job("fp", "stop")], decode)  # n=2: both answers
    assert cache.entries == 2
    assert cache.prompt(SCOPE, render([("tree?", ANSWER)], "more"), encode).reused_tokens == \
        len(encode(render([], "tree?"))) + len(GENERATED) - 1
