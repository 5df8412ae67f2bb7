"""``echo`` on ``/v1/completions``: the prompt as the start of each choice, and with ``logprobs`` the prompt's logprobs
before the completion's (torch-free, pure).

As OpenAI's legacy completions and vLLM return them: ``logprobs.tokens`` / ``token_logprobs`` / ``top_logprobs`` /
``text_offset`` list the prompt's tokens first, then the completion's; the first prompt token has no logprob (nothing
precedes it), so its ``token_logprobs`` and ``top_logprobs`` entries are ``null``; ``text_offset`` runs from 0 over
the tokens' own texts. ``max_tokens: 0`` (allowed only with ``echo``) asks for the prompt alone: the engine still
makes one token (it cannot stop before its first), which the response leaves out of the text, the logprobs and the
usage, with ``finish_reason: "length"``.

The prompt's (token id, logprob) pairs come from whoever computed the prompt: the prefill actor's
:class:`~cluster.wire.messages.PrefillResult` (disaggregated) or the decode actor's first
:class:`~cluster.wire.messages.TokenDelta` (colocated); :class:`proxy.jobs.Job` keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from proxy.errors import internal_error
from proxy.openai_responses import TokenLogprob, token_logprob

Pairs = Sequence[Sequence[tuple[int, float]]]


def echo_only(parsed: Any) -> bool:
    """Whether a parsed request asks for its prompt alone (completions, ``echo`` with ``max_tokens: 0``). Pure."""
    return bool(getattr(parsed, "prompt_only", False))


def prompt_entries(prompt_ids: Sequence[int], pairs: Pairs | None, k: int,
                   decode_token: Callable[[int], str]) -> tuple[TokenLogprob, ...]:
    """The logprob entries of the prompt's tokens: the first with none, then each from its pairs (its own logprob and
    the ``k`` best alternatives). Pure; raises a 500 ``APIError`` when the pairs that were asked for are missing or
    do not cover the prompt (never a response without them)."""
    if pairs is None or len(pairs) != len(prompt_ids) - 1:
        got = "none" if pairs is None else f"{len(pairs)} positions"
        raise internal_error(f"The prompt's logprobs did not come back from the worker ({got} for a "
                             f"{len(prompt_ids)}-token prompt).")
    first = TokenLogprob(decode_token(prompt_ids[0]), None, None)
    return (first, *(token_logprob(t, p, k, decode_token) for t, p in zip(prompt_ids[1:], pairs)))
