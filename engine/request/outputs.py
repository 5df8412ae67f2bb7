"""What the engine hands back for each request.

Every output carries what is *new* since that completion's previous output (``new_token_ids``, ``new_logprobs``,
``new_text``: what a stream sends), so a step's outputs cost O(new tokens), not O(completion). The whole completion
(``token_ids``, ``logprobs``, ``text``) comes with a finished completion's outputs, and with a running one's only
when asked for (``LLMEngine.snapshot``); reading it from a running completion's step output raises ``ValueError``
rather than answering with a part.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WholeCompletion:
    """A completion's whole output: built once when it finishes (or for a snapshot), never per step."""

    token_ids: list[int]  # generated ids only
    text: str  # detokenized generated text (stop string excluded); a running snapshot's: the visible part
    logprobs: list[dict[int, float]] | None  # per token {id: logprob}: sampled token + top k, raw distribution


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    new_token_ids: list[int]  # generated since this completion's previous output
    new_text: str  # visible text since the previous output (held back while it may begin a stop string)
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    new_logprobs: list[dict[int, float]] | None = None  # one per new token, when the request asked for logprobs
    num_tokens: int = 0  # generated so far, the new ones included
    whole: WholeCompletion | None = None  # set when finished (and in a snapshot)
    error: str | None = None  # finish_reason "error": why (its grammar let the output go no further)

    def _whole(self) -> WholeCompletion:
        if self.whole is None:
            raise ValueError(f"completion {self.index} is running: a step's output carries new_token_ids, new_text "
                             "and new_logprobs only (LLMEngine.snapshot(request_id) has the whole so far)")
        return self.whole

    @property
    def token_ids(self) -> list[int]:
        """All generated ids (finished or snapshot outputs only)."""
        return self._whole().token_ids

    @property
    def text(self) -> str:
        """All generated text (finished or snapshot outputs only)."""
        return self._whole().text

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        """All logprobs, or None when not asked for (finished or snapshot outputs only)."""
        return self._whole().logprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.prompt_logprobs, once the prompt is computed: per prompt token {id: logprob} of that token and the
    # top-k, the first None (nothing precedes it), as vLLM gives them. None: not asked, or computed elsewhere (a
    # prefill actor's, which its PrefillResult carries)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    # the first completion's fields, for the common n == 1 case
    @property
    def new_token_ids(self) -> list[int]:
        return self.outputs[0].new_token_ids

    @property
    def new_text(self) -> str:
        return self.outputs[0].new_text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs
