"""What a tiered block's key binds besides its tokens: the model's fingerprint and the tenant's namespace.

A block's key is the prefix cache's chained hash (engine/kv/block_hash.py) with ``extra`` = :func:`model_extra` (+
:func:`tenant_extra`). Two engines share a block only when every field of :class:`ModelIdentity` is equal: weights
and tokenizer (the checkpoint fingerprint of engine/models/model_loader.py, which reads the config, the weight manifest and
the tokenizer files), the compute dtype, the K/V cache dtype (FP8/int8 change the bytes), the block size and the
tensor-parallel layout (a per-rank cache holds only its heads). A tenant namespace is hashed in too, so a block of
one tenant is never found by another (the cache-hit timing side channel the seeds warn of needs a hit). Pure.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelIdentity:
    """Everything that changes the bytes of a K/V block for the same tokens."""

    checkpoint: str  # engine.models.model_loader.model_fingerprint: config, weight manifest, tokenizer, revision's files
    dtype: str  # compute dtype, e.g. "float32"
    kv_dtype: str  # K/V cache dtype ("auto" = the compute dtype, "fp8", "int8"...)
    block_size: int
    tp_size: int = 1
    tp_kv_cache: str = "shared"  # "shared": one cache of every head; "per_rank": each rank its heads

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ValueError("checkpoint: must be a non-empty fingerprint")
        if self.block_size < 1 or self.tp_size < 1:
            raise ValueError(f"block_size/tp_size: must be >= 1, got {self.block_size}/{self.tp_size}")

    def extra(self) -> bytes:
        """The bytes every block hash of this model binds. Pure."""
        fields = (self.checkpoint, self.dtype, self.kv_dtype, str(self.block_size), str(self.tp_size),
                  self.tp_kv_cache)
        return b"model:" + hashlib.sha256("\x1f".join(fields).encode()).digest()[:16]


def tenant_extra(model_extra: bytes, tenant: str | None) -> bytes:
    """``model_extra`` scoped to ``tenant`` (None or "": the shared namespace, ``model_extra`` itself). Pure."""
    if not tenant:
        return model_extra
    return model_extra + b"|tenant:" + hashlib.sha256(tenant.encode()).digest()[:16]


def tenant_of(api_key: str | None, header_value: str | None, user: str | None, source: str) -> str | None:
    """The tenant a request belongs to under the operator's ``source``: "api_key" (the bearer key), "header" (the
    value of the operator-named header), "user" (the OpenAI ``user`` field) or "none" (one shared namespace).
    ``ValueError`` on another source. Pure."""
    if source == "none":
        return None
    if source == "api_key":
        return f"key:{hashlib.sha256((api_key or '').encode()).hexdigest()}" if api_key else None
    if source == "header":
        return f"header:{header_value}" if header_value else None
    if source == "user":
        return f"user:{user}" if user else None
    raise ValueError(f"tenant source: must be one of api_key, header, user, none; got {source!r}")
