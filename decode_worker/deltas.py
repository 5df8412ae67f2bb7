"""Token deltas of one request, from the engine's cumulative outputs (pure; the decode actor owns one per request).

The engine's :class:`~engine.outputs.RequestOutput` is cumulative: every completion's token ids, logprobs and its
*visible* text so far (held back while a multi-byte character is incomplete or the tail may begin a stop string).
:class:`DeltaTracker` turns each new output into the :class:`~cluster.wire.messages.TokenDelta` values to send: the
new token ids with their logprobs (always, even while their text is held back) and the new text. Text only ever
grows, so the concatenated deltas of a completion are its final text and no delta is ever taken back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.wire.messages import TokenDelta, Usage


@dataclass
class DeltaTracker:
    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (the prefill actor's, when disaggregated)
    sent_tokens: dict[int, int] = field(default_factory=dict)  # completion index -> tokens already sent
    sent_chars: dict[int, int] = field(default_factory=dict)  # completion index -> characters already sent
    finished: set[int] = field(default_factory=set)  # completions whose finish has been sent
    done: bool = False  # the request's last delta (with usage) has been built
    first_index: int = 0  # the client's index of this request's first completion (a resumed one keeps its own)

    @classmethod
    def for_request(cls, req: Any) -> DeltaTracker:
        """A tracker for a :class:`~cluster.wire.messages.GenerateRequest`; for a resumed completion it starts where
        the client is: its tokens and characters count as sent, so deltas continue right after them. Pure."""
        j = req.choice_index
        tracker = cls(req.request_id, len(req.prompt_token_ids), first_index=j)
        if req.resumed:
            tracker.sent_tokens[j], tracker.sent_chars[j] = len(req.resume_token_ids), req.resume_chars
        return tracker

    def deltas(self, out: Any) -> list[TokenDelta]:
        """Mutates: the deltas that bring the receiver from what was sent to ``out``. The last delta of a finished
        request carries its usage. Raises ``AssertionError`` if the engine's text ever shrank (a bug)."""
        if self.done:
            return []
        result: list[TokenDelta] = []
        for c in out.outputs:
            if c.index in self.finished:
                continue
            n0, t0 = self.sent_tokens.get(c.index, 0), self.sent_chars.get(c.index, 0)
            new_ids = c.token_ids[n0:]
            text = c.text[t0:]
            if len(c.text) < t0:
                raise AssertionError(f"{self.request_id}[{c.index}]: visible text shrank from {t0} to {len(c.text)}")
            if not new_ids and not text and c.finish_reason is None:
                continue
            lps = None
            if c.logprobs is not None:
                lps = tuple(tuple(sorted(lp.items())) for lp in c.logprobs[n0:])
            result.append(TokenDelta(self.request_id, c.index, tuple(new_ids), text, lps, c.finish_reason))
            self.sent_tokens[c.index] = len(c.token_ids)
            self.sent_chars[c.index] = len(c.text)
            if c.finish_reason is not None:
                self.finished.add(c.index)
        if out.finished and result:
            usage = Usage(self.prompt_tokens, sum(len(c.token_ids) for c in out.outputs),
                          max(self.cached_tokens, out.num_cached_tokens))
            last = result[-1]
            result[-1] = TokenDelta(last.request_id, last.index, last.token_ids, last.text, last.logprobs,
                                    last.finish_reason, usage)
            self.done = True
        return result

    def failure(self, error: str, n: int) -> list[TokenDelta]:
        """Mutates: the deltas that end every unfinished completion with ``error`` (finish "abort")."""
        if self.done:
            return []
        self.done = True
        ends = [i for i in range(self.first_index, self.first_index + n) if i not in self.finished]
        return [TokenDelta(self.request_id, i, (), "", None, "abort",
                           Usage(self.prompt_tokens, sum(self.sent_tokens.values()), self.cached_tokens)
                           if i == ends[-1] else None, error) for i in ends]
