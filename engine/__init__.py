"""The paged-KV inference engine shared by prefill and decode workers.

``from engine import LLM, SamplingParams`` is the offline API. Imports are lazy so that torch-free modules
(``engine.block_hash``) stay importable from the proxy without loading torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "EngineConfig", "LLMEngine", "RequestOutput", "CompletionOutput"]

_WHERE = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "EngineConfig": "engine.config",
    "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
