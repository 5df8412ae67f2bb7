"""The offline API: ``LLM(...).generate(prompts, params)`` and ``.chat(conversations, params)``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request.outputs import RequestOutput
from engine.request.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Batch generation over a paged-KV engine. See :class:`EngineConfig` for the keyword arguments."""

    def __init__(self, model: str | None = "default", progress: Callable[[str], None] | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model or "default", **kwargs)
        self.engine = LLMEngine(self.config, progress)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def close(self) -> None:
        """Stops a tensor-parallel engine's follower ranks (``tensor_parallel_size > 1``); a no-op otherwise."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Every prompt is validated before any runs: one bad prompt raises ``ValueError`` and nothing is generated.
        ``on_output`` sees each output as it advances (for streaming): what is new since the previous one
        (``new_text``, ``new_token_ids``), and the whole completion once finished (:mod:`engine.request.outputs`).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        eng = self.engine
        token_ids = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            try:
                ids = eng.tokenize(p)
                eng.validate(ids, sp)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
            token_ids.append(ids)
        rids = []
        for ids, sp in zip(token_ids, plist):
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            eng.add_request(rid, ids, sp)
            rids.append(rid)
        final: dict[str, RequestOutput] = {}
        done_tokens = 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                if on_output is not None:
                    on_output(out)
                if out.finished:
                    final[out.request_id] = out
                    done_tokens += sum(len(o.token_ids) for o in out.outputs)
                    if use_tqdm:
                        print(f"\r[pdcluster] {len(final)}/{len(rids)} requests, {done_tokens} tokens",
                              end="", file=sys.stderr, flush=True)
        if use_tqdm:
            print(file=sys.stderr)
        return [final[r] for r in rids]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt token ids for one conversation, with the model's chat template and a generation prompt. Pure."""
        if not messages:
            raise ValueError("messages: must not be empty")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat(
        self,
        conversations: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Like :meth:`generate` for conversations (lists of ``{"role", "content"}`` messages)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params, **kwargs)
