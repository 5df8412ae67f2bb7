"""Incremental detokenizer against tokenizer.decode on a tiny in-test byte-level BPE (and on the
cached SmolLM2 tokenizer when present); stop-string search."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.text.detokenizer import BackendDecoder, IncrementalDetokenizer, TokenDecoder, fast_decoder, find_stop

CORPUS = [
    "hello world the quick brown fox jumps over the lazy dog",
    "héllo wörld 日本語 🙂 Привет",
    "naïve café résumé façade über straße",
    "東京 日本語の文章 こんにちは 世界",
    "Привет мир как дела 🙂🙃 😀 👍",
    "def main():\n    return 42  # done",
] * 20
TEXTS = [
    "hello world",
    "héllo wörld 日本語 🙂 Привет",
    "  leading spaces and trailing  ",
    "ñandú 中文 👍🏽 👨‍👩‍👧 ‘quotes’ — dash",
    "line one\nline two\n\ttabbed",
    "ümlaut日本🙂x",
]


def _smol_dir() -> Path:
    """The default model's folder (SmolLM2-135M-Instruct), converted first where this machine has none yet: these
    tests are in the integration tier for that (tests/conftest.py), and never skip for want of it."""
    from engine.models.default_model import resolve_model

    return Path(resolve_model("default", None, None))


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-style: "▁" marks spaces and decode() drops the first token's leading one."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    bpe.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300,
                                                        special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="</s>")


def stream(tok: TokenDecoder, ids: list[int], skip: bool = True) -> tuple[list[str], str]:
    """Feeds ids one by one; returns the deltas (finish() last) and the detokenizer's text."""
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[1, 2, 3], skip_special_tokens=skip)
    deltas = [detok.add_token(i) for i in ids]
    deltas.append(detok.finish())
    return deltas, detok.text


def byte_token_ids(tok: PreTrainedTokenizerFast, data: bytes) -> list[int]:
    """One single-byte token per byte (the ByteLevel alphabet holds all 256)."""
    return [tok.convert_tokens_to_ids(BYTE_CHARS[b]) for b in data]


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by ByteLevel."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_CHARS = _byte_chars()


def random_segmentation(tok: PreTrainedTokenizerFast, text: str, rng: random.Random) -> list[int]:
    """Token ids for `text` cut at random byte offsets (so characters split across tokens),
    using a vocab token for each piece when one exists, single-byte tokens otherwise."""
    data, ids, start = text.encode(), [], 0
    while start < len(data):
        end = min(len(data), start + rng.randint(1, 4))
        piece = "".join(BYTE_CHARS[b] for b in data[start:end])
        piece_id = tok.convert_tokens_to_ids(piece)
        ids += [piece_id] if piece_id != tok.unk_token_id and piece_id is not None \
            else byte_token_ids(tok, data[start:end])
        start = end
    return ids


def test_byte_table_matches_the_tokenizer(tokenizer: PreTrainedTokenizerFast) -> None:
    assert set(BYTE_CHARS.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    for b in range(256):
        (token_id,) = byte_token_ids(tokenizer, bytes([b]))
        assert tokenizer.decode([token_id]) == bytes([b]).decode(errors="replace")


@pytest.mark.parametrize("text", TEXTS)
def test_stream_of_encoded_text_matches_decode(tokenizer: PreTrainedTokenizerFast,
                                               text: str) -> None:
    ids = tokenizer.encode(text)
    deltas, full = stream(tokenizer, ids)
    assert "".join(deltas) == full == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_random_segmentations_never_emit_replacement(tokenizer: PreTrainedTokenizerFast) -> None:
    rng = random.Random(0)
    for trial in range(200):
        text = TEXTS[trial % len(TEXTS)]
        ids = random_segmentation(tokenizer, text, rng)
        deltas, full = stream(tokenizer, ids)
        assert "".join(deltas) == full == tokenizer.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas), (text, ids)


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_decode(tokenizer: PreTrainedTokenizerFast, skip: bool) -> None:
    rng = random.Random(1 + skip)
    vocab = len(tokenizer)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        deltas, full = stream(tokenizer, ids, skip)
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == full == expected, ids
        if "\ufffd" not in expected:
            assert not any("\ufffd" in d for d in deltas)


def test_split_character_is_held_back_until_complete(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    for i in tokenizer.encode("ab"):
        detok.add_token(i)
    first, second, third = byte_token_ids(tokenizer, "日".encode())
    assert detok.add_token(first) == "" and detok.add_token(second) == ""
    assert detok.text == "ab"
    assert detok.add_token(third) == "日" and detok.text == "ab日"
    emoji = byte_token_ids(tokenizer, "🙂".encode())
    assert [detok.add_token(i) for i in emoji] == ["", "", "", "🙂"]


def test_finish_flushes_a_dangling_partial_character(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("ok ") + byte_token_ids(tokenizer, "語".encode())[:2]
    deltas, full = stream(tokenizer, ids)
    assert deltas[-1] == "\ufffd" and full == "ok \ufffd" == tokenizer.decode(ids)
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.finish() == "" and detok.text == ""


def test_special_tokens_skipped_or_kept(tokenizer: PreTrainedTokenizerFast) -> None:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("hi") + [end] + tokenizer.encode(" there")
    assert stream(tokenizer, ids, skip=True)[1] == "hi there"
    assert stream(tokenizer, ids, skip=False)[1] == "hi<|im_end|> there"


def test_leading_spaces_match_decode_for_metaspace(
        metaspace_tokenizer: PreTrainedTokenizerFast) -> None:
    tok = metaspace_tokenizer
    assert tok.decode(tok.encode("hello world")[1:]) == "world"  # the case being guarded
    rng = random.Random(4)
    for text in ["hello world the quick brown fox", "  héllo  wörld 日本語", "Привет мир"]:
        ids = tok.encode(text)
        deltas, full = stream(tok, ids)
        assert "".join(deltas) == full == tok.decode(ids)
        for _ in range(30):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 12))]
            assert stream(tok, ids)[1] == tok.decode(ids, skip_special_tokens=True), ids


class CountingDecoder:
    """Wraps a tokenizer and records the length of every decoded window."""

    def __init__(self, tok: PreTrainedTokenizerFast) -> None:
        self.tok, self.window_lengths = tok, []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.window_lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_does_not_grow(tokenizer: PreTrainedTokenizerFast) -> None:
    counting = CountingDecoder(tokenizer)
    ids = tokenizer.encode(" ".join(TEXTS) * 30)
    deltas, full = stream(counting, ids)
    assert full == tokenizer.decode(ids) and len(ids) > 1000
    assert max(counting.window_lengths) <= 8


# ---------------------------------------------------------------- find_stop

@pytest.mark.parametrize("text, stop, new_chars, expected", [
    ("Hello world!", ["world"], 3, 6),          # "wor" came in one delta, "ld!" in the next
    ("Hello world!", ["world"], 1, None),       # "world" ended before the last char
    ("Hello world", ["world"], 1, 6),
    ("a STOP b END", ["END", "STOP"], 12, 2),   # earliest wins, whatever the list order
    ("a STOP b END", ["END", "STOP"], 4, 9),    # STOP was already checked: not rescanned
    ("xx STOP yy", ["STOP"], 2, None),
    ("STOP", ["STOP", "TOP", "P"], 1, 0),
    ("abcabc", ["ca"], 3, 2),
    ("abc", ["", "zz"], 3, None),
    ("abc", ["abc"], 0, None),
    ("ab", ["abc"], 2, None),
    ("日本語の文", ["語の"], 2, 2),
])
def test_find_stop(text: str, stop: list[str], new_chars: int, expected: int | None) -> None:
    assert find_stop(text, stop, new_chars) == expected


def test_find_stop_on_a_stream(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "the quick brown fox jumps over the lazy dog 日本語 🙂 end"
    stops = ["lazy d", "語 🙂", "fox j"]
    for seed in range(20):
        ids = random_segmentation(tokenizer, text, random.Random(seed))
        detok, hit = IncrementalDetokenizer(tokenizer, []), None
        for i in ids:
            delta = detok.add_token(i)
            hit = find_stop(detok.text, stops, len(delta))
            if hit is not None:
                break
        assert hit == text.index("fox j") and detok.text[:hit] == "the quick brown "


def test_smollm2_tokenizer_matches_decode() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_smol_dir()))
    for text in TEXTS + ["<|im_start|>assistant\nSure! 日本語 🙂<|im_end|>"]:
        ids = tok.encode(text)
        for skip in (True, False):
            deltas, full = stream(tok, ids, skip)
            assert "".join(deltas) == full == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in d for d in deltas)
    rng = random.Random(3)
    for _ in range(100):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 20))]
        assert stream(tok, ids)[1] == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_backend_streams_what_the_tokenizer_decodes(tokenizer: PreTrainedTokenizerFast,
                                                             metaspace_tokenizer: PreTrainedTokenizerFast,
                                                             skip: bool) -> None:
    """fast_decoder picks the backend for a plain fast tokenizer, and a stream through it equals decode()."""
    rng = random.Random(7 + skip)
    for tok in (tokenizer, metaspace_tokenizer):
        fast = fast_decoder(tok)
        assert isinstance(fast, BackendDecoder)
        for _ in range(200):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 30))]
            deltas, full = stream(fast, ids, skip)
            assert "".join(deltas) == full == tok.decode(ids, skip_special_tokens=skip), ids
        for text in TEXTS:
            assert stream(fast, tok.encode(text), skip)[1] == tok.decode(tok.encode(text), skip_special_tokens=skip)


def test_fast_decoder_keeps_the_tokenizer_where_its_decode_differs(tokenizer: PreTrainedTokenizerFast) -> None:
    """A tokenizer that cleans up spaces, or whose class overrides decoding, or that has no Rust backend: its own
    decode runs (never a different text)."""
    cleaning = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>",
                                       clean_up_tokenization_spaces=True)
    assert fast_decoder(cleaning) is cleaning

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, *a, **k):  # type: ignore[no-untyped-def]
            return super()._decode(*a, **k).upper()

    loud = Shouting(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>")
    assert fast_decoder(loud) is loud

    class Plain:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
            return " ".join(map(str, token_ids))

    plain = Plain()
    assert fast_decoder(plain) is plain


def test_smollm2_takes_the_rust_backend_with_the_same_text() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_smol_dir()))
    fast = fast_decoder(tok)
    assert isinstance(fast, BackendDecoder)
    rng = random.Random(5)
    for text in TEXTS + ["<|im_start|>assistant\nSure! 日本語 🙂<|im_end|>"]:
        for skip in (True, False):
            assert stream(fast, tok.encode(text), skip)[1] == tok.decode(tok.encode(text), skip_special_tokens=skip)
    for _ in range(100):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 20))]
        assert stream(fast, ids)[1] == tok.decode(ids, skip_special_tokens=True)
