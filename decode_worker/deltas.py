"""Token deltas of one request, from the engine's step outputs (pure; the decode actor owns one per request).

The engine's :class:`~engine.request.outputs.CompletionOutput` already carries what is new since that completion's previous
output: token ids with their logprobs (always, even while their text is held back) and the newly *visible* text
(held back while a multi-byte character is incomplete or the tail may begin a stop string). :class:`DeltaTracker`
turns each output into the :class:`~cluster.wire.messages.TokenDelta` values to send, in O(new tokens): it drops
completions already finished, skips what a resumed completion's client has already (the engine hands a resumed
prefix out again: its deltas always add up to the whole completion), and puts the usage on the request's last
delta. Text only ever grows, so the concatenated deltas of a completion are its final text and no delta is ever
taken back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cluster.wire.messages import TokenDelta, Usage, prompt_logprob_pairs


@dataclass
class DeltaTracker:
    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (the prefill actor's, when disaggregated)
    sent_tokens: dict[int, int] = field(default_factory=dict)  # completion index -> tokens the client has
    sent_chars: dict[int, int] = field(default_factory=dict)  # completion index -> characters the client has
    # completion index -> tokens / characters of the engine's next deltas the client has already (a resumed prefix)
    skip_tokens: dict[int, int] = field(default_factory=dict)
    skip_chars: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)  # completions whose finish has been sent
    done: bool = False  # the request's last delta (with usage) has been built
    first_index: int = 0  # the client's index of this request's first completion (a resumed one keeps its own)
    prompt_sent: bool = False  # the prompt logprobs (computed here: colocated) went out, on the request's first delta

    @classmethod
    def for_request(cls, req: Any) -> DeltaTracker:
        """A tracker for a :class:`~cluster.wire.messages.GenerateRequest`; for a resumed completion it starts where
        the client is: its tokens and characters count as sent, and are skipped when the engine hands them out
        again, so deltas continue right after them. Pure."""
        j = req.choice_index
        tracker = cls(req.request_id, len(req.prompt_token_ids), first_index=j)
        if req.resumed:
            tracker.sent_tokens[j], tracker.sent_chars[j] = len(req.resume_token_ids), req.resume_chars
            tracker.skip_tokens[j], tracker.skip_chars[j] = len(req.resume_token_ids), req.resume_chars
        return tracker

    def deltas(self, out: Any) -> list[TokenDelta]:
        """Mutates: the deltas that bring the receiver from what was sent to ``out`` (a step output: only its
        ``new_*`` fields are read, O(new tokens)). The last delta of a finished request carries its usage."""
        if self.done:
            return []
        result: list[TokenDelta] = []
        for c in out.outputs:
            i = c.index
            if i in self.finished:
                continue
            new_ids, text, new_lps = c.new_token_ids, c.new_text, c.new_logprobs
            skip = self.skip_tokens.get(i, 0)
            if skip:
                drop = min(skip, len(new_ids))
                new_ids, self.skip_tokens[i] = new_ids[drop:], skip - drop
                new_lps = None if new_lps is None else new_lps[drop:]
            skip = self.skip_chars.get(i, 0)
            if skip:
                drop = min(skip, len(text))
                text, self.skip_chars[i] = text[drop:], skip - drop
            if not new_ids and not text and c.finish_reason is None:
                continue
            lps = None if new_lps is None else tuple(tuple(sorted(lp.items())) for lp in new_lps)
            result.append(TokenDelta(self.request_id, i, tuple(new_ids), text, lps, c.finish_reason,
                                     error=getattr(c, "error", None)))
            self.sent_tokens[i] = self.sent_tokens.get(i, 0) + len(new_ids)
            self.sent_chars[i] = self.sent_chars.get(i, 0) + len(text)
            if c.finish_reason is not None:
                self.finished.add(i)
        if out.finished and result:
            usage = Usage(self.prompt_tokens, sum(c.num_tokens for c in out.outputs),
                          max(self.cached_tokens, out.num_cached_tokens))
            result[-1] = dataclasses.replace(result[-1], usage=usage)
            self.done = True
        if result and not self.prompt_sent and getattr(out, "prompt_logprobs", None) is not None:
            result[0] = dataclasses.replace(result[0], prompt_logprobs=prompt_logprob_pairs(
                out.prompt_token_ids, out.prompt_logprobs))
            self.prompt_sent = True
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
