"""Issue 11's text invariant as a property over scripted token sequences, in three modes.

For every token sequence, stop string and mode, the concatenated deltas == the offline text == a reference built from
``tokenizer.decode`` alone, and no delta is ever taken back. The model is scripted (``runner.execute`` replaced) so
each case forces an exact sequence: byte tokens that split CJK and emoji characters, invalid bytes, words, EOS and stop
token ids. Modes:

- ``offline``: ``LLMEngine.add_request`` + ``step()`` (what ``LLM.generate`` does);
- ``disaggregated``: a prefill engine samples the first tokens (``max_tokens=1``), they cross as a ``PrefillResult``
  wire dict, a decode engine joins with ``add_prefilled_request`` and steps; deltas from ``DeltaTracker``;
- ``colocated``: the decode engine's ``add_request`` into reserved blocks; deltas from ``DeltaTracker``.

Deltas cross the token-stream wire encoding (``encode_deltas`` / ``decode_deltas``) before they are checked.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import pytest

from cluster.wire.messages import PrefillResult, TokenDelta
from cluster.wire.token_stream import decode_deltas, encode_deltas
from decode_worker.deltas import DeltaTracker
from engine import LLM, SamplingParams
from engine.scheduling.kv_cache_manager import cdiv
from engine.llm_engine import LLMEngine
from engine.scheduling.scheduler import SampledToken, SchedulerOutput

BLOCK = 8
MODES = ("offline", "disaggregated", "colocated")


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet). Pure."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


# -- the scripted model -------------------------------------------------------------------------------------------------
class Script:
    """The model's output for every request: request id -> per completion index, the token ids it samples in order.
    Installed as ``engine.runner.execute``; logprobs are a pure function of (token, position, completion)."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[list[int]]] = {}

    @staticmethod
    def logprobs(tok: int, pos: int, index: int, k: int) -> dict[int, float]:
        lp = {tok: -0.25 - pos / 64 - index / 1024}
        for j in range(k):  # top-k alternatives: other ids, lower logprobs
            lp.setdefault((tok + 1 + j) % 370 + 3, -4.0 - j)
        return lp

    def execute(self, out: SchedulerOutput, after_kv_store: Any = None) -> dict[int, list[SampledToken]]:
        sampled: dict[int, list[SampledToken]] = {}
        for s in out.scheduled:
            if not s.sample:
                continue
            # a parent's first sample also samples for its not-yet-forked children, in completion order
            for seq in (s.seq, *s.seq.pending_children):
                pos = len(seq.output_token_ids)
                tok = self.tokens[seq.request_id][seq.index][pos]
                k = seq.params.logprobs
                sampled.setdefault(s.seq.seq_id, []).append(
                    SampledToken(tok, None if k is None else self.logprobs(tok, pos, seq.index, k)))
        return sampled


@dataclass
class Engines:
    offline: LLMEngine
    prefill: LLMEngine
    decode: LLMEngine  # disaggregated decode side, and colocated (the decode actor computes the prompt itself)
    script: Script
    byte_ids: list[int]  # byte value -> the token id of that single byte
    next_id: int = 0

    def rid(self, mode: str) -> str:
        self.next_id += 1
        return f"{mode}-{self.next_id}"


def load_engines(folder: str) -> Engines:
    common = dict(dtype="float32", block_size=BLOCK, num_kv_blocks=256, max_num_batched_tokens=64)
    script = Script()
    made = [LLM(folder, **common).engine for _ in range(3)]
    for e in made:
        e.runner.execute = script.execute  # type: ignore[method-assign]
    tok = made[0].tokenizer
    b2u = byte_to_unicode()
    byte_ids = [tok.convert_tokens_to_ids(b2u[b]) for b in range(256)]
    assert len(set(byte_ids)) == 256 and None not in byte_ids
    return Engines(*made, script=script, byte_ids=byte_ids)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint) -> dict[str, Engines]:  # type: ignore[no-untyped-def]
    folder = str(tiny_checkpoint("llama"))
    return {"folder": folder, "engines": load_engines(folder)}  # type: ignore[dict-item]


@pytest.fixture
def engines(loaded: dict[str, Any]) -> Engines:
    """The module's engines, reloaded only if a failed case left a request or a block behind (so one failure does
    not cascade into the next test)."""
    e: Engines = loaded["engines"]
    if any(x.has_unfinished_requests() or x.kv.pool.counts()["used"] for x in (e.offline, e.prefill, e.decode)):
        loaded["engines"] = e = load_engines(loaded["folder"])
    return e


# -- the reference: tokenizer.decode alone ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Expected:
    token_ids: list[int]
    text: str
    finish_reason: str


def reference(tokenizer: Any, ids: list[int], p: SamplingParams, eos: frozenset[int]) -> Expected:
    """What a completion must deliver, from ``tokenizer.decode`` of prefixes of ``ids`` (independent of the engine's
    detokenizer). Token k ends the completion if it is a stop token (its own text excluded), the max_tokens-th token,
    or the first whose *stable* text (the longest decoded prefix not ending in an incomplete character, U+FFFD)
    contains a stop string; then the text is cut at that string's earliest occurrence. Pure."""
    def decode(toks: list[int]) -> str:
        return tokenizer.decode(toks, skip_special_tokens=p.skip_special_tokens)

    stable = ""
    for k in range(1, len(ids) + 1):
        tok = ids[k - 1]
        reason = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in eos):
            reason, text = "stop", decode(ids[: k - 1])
        elif k == p.max_tokens:
            reason, text = "length", decode(ids[:k])
        else:
            full = decode(ids[:k])
            if not full.endswith("\ufffd"):
                stable = full
            text = stable
        hits = [text.find(s) for s in p.stop_strings if s in text]
        if hits:
            return Expected(ids[:k], text[: min(hits)], "stop")
        if reason is not None:
            return Expected(ids[:k], text, reason)
    raise AssertionError("script shorter than max_tokens")


# -- running one case in each mode --------------------------------------------------------------------------------------
@dataclass
class Got:
    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str | None]
    logprobs: list[list[tuple[tuple[int, float], ...]] | None]
    deltas: list[TokenDelta]


def check_growth(seen: dict[int, str], out: Any) -> None:
    """Each completion's step outputs carry only new text, which adds up to its final text (so visible text only
    ever grows and nothing is taken back); a running completion's output has no whole text to read."""
    for c in out.outputs:
        seen[c.index] = seen.get(c.index, "") + c.new_text
        if c.finish_reason is None:
            with pytest.raises(ValueError, match="running"):
                c.text  # noqa: B018
        else:
            assert c.text == seen[c.index], f"[{c.index}] streamed {seen[c.index]!r}, final {c.text!r}"


def drain(engine: LLMEngine, rid: str, tracker: DeltaTracker | None, seen: dict[int, str]) -> tuple[Any, list[TokenDelta]]:
    """Step ``engine`` until ``rid`` finishes; returns its final output and its deltas (through the wire form)."""
    final = None
    deltas: list[TokenDelta] = []
    while final is None:
        assert engine.has_unfinished_requests()
        for out in engine.step():
            assert out.request_id == rid
            check_growth(seen, out)
            if tracker is not None:
                deltas += decode_deltas(encode_deltas(tracker.deltas(out)))
            if out.finished:
                final = out
    return final, deltas


def from_deltas(deltas: list[TokenDelta], n: int, logprobs: bool) -> Got:
    texts, ids, reasons, lps = [], [], [], []
    for i in range(n):
        mine = [d for d in deltas if d.index == i]
        assert sum(d.finish_reason is not None for d in mine) == 1 and mine[-1].finish_reason is not None
        texts.append("".join(d.text for d in mine))
        ids.append([t for d in mine for t in d.token_ids])
        reasons.append(mine[-1].finish_reason)
        if logprobs:
            assert all(d.logprobs is not None for d in mine)
            lps.append([lp for d in mine for lp in (d.logprobs or ())])
        else:
            assert all(d.logprobs is None for d in mine)
            lps.append(None)
    assert [d.usage is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == sum(map(len, ids))
    return Got(texts, ids, reasons, lps, deltas)


def from_output(out: Any) -> Got:
    outs = sorted(out.outputs, key=lambda c: c.index)
    return Got([c.text for c in outs], [c.token_ids for c in outs], [c.finish_reason for c in outs],
               [None if c.logprobs is None else [tuple(sorted(lp.items())) for lp in c.logprobs] for c in outs], [])


def run(e: Engines, mode: str, prompt: list[int], params: SamplingParams, scripts: list[list[int]]) -> Got:
    rid = e.rid(mode)
    e.script.tokens[rid] = scripts
    seen: dict[int, str] = {}
    if mode == "offline":
        e.offline.add_request(rid, prompt, params)
        final, _ = drain(e.offline, rid, None, seen)
        e.offline.check_integrity()
        return from_output(final)
    decode = e.decode
    tracker = DeltaTracker(rid, len(prompt))
    blocks = [b.block_id for b in decode.kv.pool.allocate(cdiv(len(prompt) + params.max_tokens, BLOCK))]
    deltas: list[TokenDelta] = []
    if mode == "colocated":
        decode.add_request(rid, prompt, params, block_ids=blocks)
    else:
        # the prefill actor's half: max_tokens=1, first tokens (and their logprobs) back as a wire PrefillResult
        e.prefill.add_request(rid, prompt, dataclasses.replace(params, max_tokens=1))
        first, _ = drain(e.prefill, rid, None, {})
        e.prefill.check_integrity()
        outs = sorted(first.outputs, key=lambda c: c.index)
        lps = None if params.logprobs is None else [sorted(c.logprobs[0].items()) for c in outs]
        result = PrefillResult.from_dict(PrefillResult(rid, "rsv", tuple(c.token_ids[0] for c in outs), lps).to_dict())
        out = decode.add_prefilled_request(
            rid, prompt, params, list(result.first_token_ids), blocks,
            None if result.first_logprobs is None else [dict(p) for p in result.first_logprobs])
        check_growth(seen, out)
        deltas += decode_deltas(encode_deltas(tracker.deltas(out)))
    if not tracker.done:
        _, more = drain(decode, rid, tracker, seen)
        deltas += more
    assert not decode.has_unfinished_requests()
    decode.check_integrity()
    assert decode.kv.pool.counts()["used"] == 0
    return from_deltas(deltas, params.n, params.logprobs is not None)


def check_case(e: Engines, prompt: list[int], params: SamplingParams, scripts: list[list[int]]) -> None:
    tok = e.offline.tokenizer
    want = [reference(tok, s, params, e.offline.eos_token_ids) for s in scripts]
    why = f"params={params} scripts={scripts}"
    got = {mode: run(e, mode, prompt, params, scripts) for mode in MODES}
    for mode, g in got.items():
        for i, w in enumerate(want):
            where = f"{mode}[{i}] {why}"
            assert g.texts[i] == w.text, f"{where}: text {g.texts[i]!r} != reference {w.text!r}"
            assert g.token_ids[i] == w.token_ids, f"{where}: tokens {g.token_ids[i]} != {w.token_ids}"
            assert g.finish_reasons[i] == w.finish_reason, f"{where}: finish {g.finish_reasons[i]} != {w.finish_reason}"
            if params.logprobs is None:
                assert g.logprobs[i] is None, where
            else:
                lps = g.logprobs[i]
                assert lps is not None and len(lps) == len(w.token_ids), f"{where}: logprobs for {len(w.token_ids)}"
                for pos, (t, lp) in enumerate(zip(w.token_ids, lps)):
                    assert lp == tuple(sorted(Script.logprobs(t, pos, i, params.logprobs).items())), where
    assert got["disaggregated"].texts == got["colocated"].texts == got["offline"].texts


# -- random cases -------------------------------------------------------------------------------------------------------
PIECES = ["你", "好", "日本語", "🙂", "🌟", "👍🏽", "é", "ö", "naïve", "Привет", "！", "a", " ", "\n", "the", "ab"]
WORDS = ["the", " cat", " dog", "héllo", " wörld", " café", "日本", " 語", "🙂", " мир", " model", "\n"]


def random_tokens(rng: random.Random, e: Engines, length: int, special: list[int]) -> list[int]:
    """A mix of byte tokens splitting multi-byte characters, invalid bytes, whole words and special ids."""
    tok = e.offline.tokenizer
    out: list[int] = []
    while len(out) < length:
        r = rng.random()
        if r < 0.45:  # a character spelled byte by byte (CJK, emoji, accents split across tokens)
            out += [e.byte_ids[b] for b in rng.choice(PIECES).encode()]
        elif r < 0.55:  # invalid: a lone continuation byte, a truncated lead byte, 0xFF
            out.append(e.byte_ids[rng.choice([0x80, 0xBD, 0xA0, 0xE4, 0xF0, 0xC3, 0xFF])])
        elif r < 0.85:  # merged tokens (some hold partial characters: 'ðŁ' is half an emoji)
            out += tok.encode(rng.choice(WORDS))
        elif r < 0.95:
            out.append(rng.randrange(3, len(tok)))
        else:
            out.append(rng.choice(special))
    return out


def random_stops(rng: random.Random, e: Engines, scripts: list[list[int]], skip: bool) -> list[str]:
    """Stop strings: substrings of the decoded text (some starting inside the first token's text, so they span the
    first token boundary), and some that never occur."""
    stops: list[str] = []
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        ids = rng.choice(scripts)
        text = e.offline.tokenizer.decode(ids, skip_special_tokens=skip)
        if rng.random() < 0.25 or len(text) < 2:
            stops.append(rng.choice(["ZZQ", "§§", "\u2603", "xyzzy 日"]))
            continue
        first_len = len(e.offline.tokenizer.decode(ids[:1], skip_special_tokens=skip))
        start = rng.randrange(0, max(1, first_len)) if rng.random() < 0.4 else rng.randrange(0, len(text) - 1)
        start = min(start, len(text) - 1)
        stops.append(text[start : start + rng.randint(1, 5)])
    return stops


def random_case(seed: int, e: Engines) -> tuple[list[int], SamplingParams, list[list[int]]]:
    rng = random.Random(seed)
    tok = e.offline.tokenizer
    special = [0] + [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    n = rng.choice([1, 1, 1, 2, 3])
    max_tokens = rng.randint(1, 14)
    scripts = [random_tokens(rng, e, max_tokens, special)[:max_tokens] for _ in range(n)]
    skip = rng.random() < 0.7
    stop_ids = [rng.choice(scripts[0])] if rng.random() < 0.2 else []
    params = SamplingParams(
        max_tokens=max_tokens, n=n, ignore_eos=rng.random() < 0.3, skip_special_tokens=skip,
        stop=random_stops(rng, e, scripts, skip) or None, stop_token_ids=stop_ids,
        logprobs=rng.choice([None, None, 0, 2]), temperature=rng.choice([0.0, 0.7]), seed=seed)
    prompt = [rng.randrange(3, 370) for _ in range(rng.randint(1, 20))]
    return prompt, params, scripts


@pytest.mark.parametrize("block", range(10))
def test_random_token_sequences_keep_the_invariant(engines: Engines, block: int) -> None:
    """200 random cases (20 per test id, so a failure names a small range of seeds)."""
    for seed in range(block * 20, block * 20 + 20):
        check_case(engines, *random_case(seed, engines))


# -- the regressions of issue 11 ----------------------------------------------------------------------------------------
def bytes_of(e: Engines, text: str) -> list[int]:
    return [e.byte_ids[b] for b in text.encode()]


def test_first_token_holds_half_of_a_cjk_character(engines: Engines) -> None:
    """'你' = E4 BD A0 split as [E4] [BD A0]-ish byte tokens: the first token alone decodes to U+FFFD."""
    e = engines
    ni = bytes_of(e, "你")
    script = [ni[0], ni[1], ni[2]] + bytes_of(e, "好") + bytes_of(e, "！！")
    for skip in (True, False):
        check_case(e, [5, 6, 7], SamplingParams(max_tokens=len(script), skip_special_tokens=skip), [script])
    check_case(e, [5, 6, 7], SamplingParams(max_tokens=len(script), logprobs=1), [script])
    check_case(e, [5, 6, 7], SamplingParams(max_tokens=len(script) + 1), [script + [0]])  # EOS ends it


def test_first_token_holds_half_of_an_emoji(engines: Engines) -> None:
    e = engines
    star = bytes_of(e, "🌟")  # F0 9F 8C 9F
    tok = e.offline.tokenizer
    merged = tok.encode("🌟")  # byte-level BPE merges: ['ðŁ', 'Į', 'Ł'] splits the emoji after two bytes
    for script in ([star[0]] + star[1:] + star * 2, merged * 3, merged[:1] + star[2:] + merged):
        check_case(e, [9], SamplingParams(max_tokens=len(script)), [script])
        check_case(e, [9], SamplingParams(max_tokens=len(script), n=2, temperature=0.8, seed=3),
                   [script, list(reversed(script))])


def test_stop_string_spanning_the_first_two_tokens(engines: Engines) -> None:
    e = engines
    tok = e.offline.tokenizer
    script = tok.encode("the cat") + tok.encode(" dog runs")  # 'the' | ' cat' | ...
    assert tok.decode(script[:1]) == "the"
    for stop in ("he c", "e ca", "the cat", "he"):
        check_case(e, [4, 4], SamplingParams(max_tokens=len(script), stop=stop), [script])
    # a stop string across a split character: 'é' = C3 A9 over the first two tokens
    script = bytes_of(e, "éa") + tok.encode(" cat")
    check_case(e, [4], SamplingParams(max_tokens=len(script), stop="éa"), [script])
    check_case(e, [4], SamplingParams(max_tokens=len(script), stop=["a c", "é"]), [script])


def test_a_character_right_after_the_first_token_is_not_duplicated(engines: Engines) -> None:
    """The old flow sent the first token's text from the prefill actor, then the decode side re-sent it."""
    e = engines
    tok = e.offline.tokenizer
    for script in (tok.encode("héllo") + tok.encode("héllo"), bytes_of(e, "好好好"), tok.encode("日本") * 2):
        check_case(e, [7, 8], SamplingParams(max_tokens=len(script)), [script])
        check_case(e, [7, 8], SamplingParams(max_tokens=len(script), stop="ZZQ"), [script])


def test_first_token_that_stops_at_once(engines: Engines) -> None:
    """The prefill's first token is EOS, a stop token id, the only token allowed, or completes a stop string."""
    e = engines
    tok = e.offline.tokenizer
    word = tok.encode("the")
    check_case(e, [3], SamplingParams(max_tokens=4), [[0, 5, 6, 7]])
    check_case(e, [3], SamplingParams(max_tokens=4, stop_token_ids=[word[0]]), [word + [5, 6, 7]])
    check_case(e, [3], SamplingParams(max_tokens=1, logprobs=0), [word])
    check_case(e, [3], SamplingParams(max_tokens=4, stop="th"), [word + [5, 6, 7]])
    check_case(e, [3], SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=1),
               [[0, 5, 6, 7], word + [5, 6, 7], bytes_of(e, "你") + [0]])


def test_colocated_n_gt_1_into_reserved_blocks_samples_like_offline(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Real (unscripted) sampling: the colocated decode actor's ``add_request`` into a reservation sized like the
    proxy's (``proxy.admission.estimate_blocks`` with ``n``) must give ``LLM.generate``'s n completions."""
    folder = str(tiny_checkpoint("llama"))
    params = SamplingParams(n=3, seed=7, temperature=0.8, max_tokens=12, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    want = LLM(folder, block_size=4, num_kv_blocks=64).generate([prompt], params)[0]
    eng = LLM(folder, block_size=4, num_kv_blocks=64).engine
    need = cdiv(len(prompt) + 12, 4) + (params.n - 1) * (cdiv(12, 4) + 1)
    eng.add_request("r", prompt, params, block_ids=[b.block_id for b in eng.kv.pool.allocate(need)])
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out if out.finished else final
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in want.outputs]
