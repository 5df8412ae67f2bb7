"""Request bodies drawn around the OpenAPI document (hypothesis): mostly a valid request with a few fields drawn on
top (kept, replaced or broken), sometimes anything. Shared by the parser fuzz and the fuzz of a real server."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# a value pool per field: good values, values of the wrong type, out-of-range numbers, nulls
_ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 3000), st.floats(-3, 3, allow_nan=False),
                 st.text(max_size=5), st.lists(st.integers(-1, 1200), max_size=3), st.just({}))
_GOOD: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["default", "other"]),
    "max_tokens": st.integers(0, 3000), "temperature": st.floats(-0.5, 2.5, allow_nan=False),
    "top_p": st.floats(-0.1, 1.1, allow_nan=False), "n": st.integers(0, 3), "seed": st.integers(-1, 10),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stream": st.booleans(), "stream_options": st.sampled_from([{"include_usage": True}, {"bogus": 1}, None]),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)), "top_logprobs": st.integers(-1, 25),
    "ignore_eos": st.booleans(), "stop_token_ids": st.lists(st.integers(-1, 5), max_size=2),
    "logit_bias": st.sampled_from([{}, {"5": 1.0}, None]), "user": st.text(max_size=3),
    "tools": st.sampled_from([[], [{"type": "function"}], None]),
    "prompt": st.one_of(st.text(max_size=8), st.lists(st.integers(-1, 1200), max_size=4),
                        st.lists(st.text(max_size=4), max_size=2)),
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "robot"])},
        optional={"content": st.one_of(st.text(max_size=6), st.none(),
                                       st.just([{"type": "text", "text": "hi"}]), st.just([{"type": "image"}]))}),
        max_size=2),
}
_NAMES = sorted(_GOOD) + ["bogus_field", "echo", "best_of", "frequency_penalty"]


@st.composite
def bodies(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    """Mostly a valid request with a few fields drawn on top (kept, replaced or broken), sometimes anything."""
    base: dict[str, Any] = {}
    if draw(st.integers(0, 9)) < 8:
        base = {"model": "default", **({"messages": [{"role": "user", "content": "hi"}]} if chat else
                                       {"prompt": "hi"})}
    names = draw(st.lists(st.sampled_from(_NAMES), max_size=4, unique=True))
    return {**base, **{n: draw(st.one_of(_GOOD[n], _ANY) if n in _GOOD else _ANY) for n in names}}
