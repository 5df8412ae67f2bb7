"""The paged-KV inference engine shared by prefill and decode workers.

``from engine import LLM, SamplingParams`` is the offline API. Imports are lazy so that torch-free modules
(``engine.kv.block_hash``) stay importable from the proxy without loading torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "EngineConfig", "LLMEngine", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    """The public names, each imported on first use (plain imports, so scripts/check_imports.py sees them)."""
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine.request.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from engine.config import EngineConfig

        return EngineConfig
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "RequestOutput":
        from engine.request.outputs import RequestOutput

        return RequestOutput
    if name == "CompletionOutput":
        from engine.request.outputs import CompletionOutput

        return CompletionOutput
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
