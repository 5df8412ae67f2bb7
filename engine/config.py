"""Engine configuration (frozen, validated)."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_DTYPES = ("float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine instance. Invalid values raise ``ValueError`` naming the field."""

    model: str = "default"  # "default" (the embedded SmolLM2-135M-Instruct) or a Hugging Face folder
    dtype: str = "float32"  # weights, activations and KV cache: float32 | bfloat16
    # KV cache storage: "auto" (= dtype) or "fp8" (float8_e4m3fn with one float32 scale per block and kv head: half
    # of bfloat16's bytes in memory and on the wire; attention dequantizes)
    kv_cache_dtype: str = "auto"
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # total KV blocks; None: sized from kv_cache_gib
    kv_cache_gib: float = 2.0  # memory for the KV cache when num_kv_blocks is None
    max_num_seqs: int = 64  # most sequences in one step
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits prompts to fit)
    max_model_len: int | None = None  # context limit; None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    seed: int = 0  # seeds unseeded sampling, so a run as a whole is reproducible
    cache_dir: str | None = None  # where the default model is converted; None: ~/.cache/pdcluster

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        if self.dtype not in SUPPORTED_DTYPES:
            raise bad("dtype", f"must be one of {SUPPORTED_DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise bad("block_size", "must be a power of two in [1, 128]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise bad("num_kv_blocks", "must be >= 2")
        if not self.kv_cache_gib > 0:
            raise bad("kv_cache_gib", "must be > 0")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", "must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", "must be >= 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise bad("num_threads", "must be >= 1")
