"""Engine configuration (frozen, validated)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine.spec.spec_config import SpeculativeConfig

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
TP_KV_CACHES = ("shared", "per_rank")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine instance. Invalid values raise ``ValueError`` naming the field."""

    model: str = "default"  # "default" (the embedded SmolLM2-135M-Instruct) or a Hugging Face folder
    # where weights, activations, KV cache and sampling live: "auto" (CUDA when available, else the CPU), "cpu",
    # "cuda" (the current CUDA device) or "cuda:N"
    device: str = "auto"
    # weights, activations and KV cache: auto (bfloat16 on CUDA and on CPUs with native bf16, else float32) | float32 |
    # bfloat16
    dtype: str = "auto"
    # KV cache storage: "auto" (= dtype), "fp8" (float8_e4m3fn with one float32 scale per block and kv head) or "int8"
    # (one float32 scale per token and kv head: 6% more bytes than fp8 at head_dim 64, half fp8's rounding error for K
    # and a quarter for V; docs/kernels.md). Either is about half of bfloat16's bytes in memory and on the wire;
    # attention dequantizes
    kv_cache_dtype: str = "auto"
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # total KV blocks; None: sized from kv_cache_gib
    # memory for the KV cache when num_kv_blocks is None; None: 2 GiB on the CPU, and on CUDA whatever
    # gpu_memory_utilization leaves after the weights and a profiled peak of activations
    kv_cache_gib: float | None = None
    # CUDA: the fraction of the device's total memory this engine may take (weights + activations + KV cache). An
    # actor holding a fractional GPU share passes its share here (e.g. two actors per GPU: 0.45 each). Ignored on CPU.
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying CUDA graphs
    # CUDA: capture decode CUDA graphs at start (unless enforce_eager), their memory measured before the KV cache is
    # sized. A prefill-only engine never decodes: False skips both (LLMEngine.enable_decode_graphs captures later, e.g.
    # when a flexible actor becomes a decoder)
    decode_graphs: bool = True
    # CUDA: device bytes the engine's host allocates after the engine (KV transfer receive buffers, communicators),
    # kept out of a KV cache sized from gpu_memory_utilization
    reserved_device_bytes: int = 0
    # CPU: the KV cache lives in an anonymous shared-memory file, so a KV writer on this node can map it and write
    # blocks in place (the shm KV backend). CUDA memory is always shareable (CUDA IPC); ignored there.
    shared_kv: bool = False
    max_num_seqs: int = 64  # most sequences in one step
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits prompts to fit)
    max_model_len: int | None = None  # context limit; None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    # ranks the model is sharded over (Megatron-style: heads, MLP columns/rows, experts' intermediate, vocabulary):
    # this process drives rank 0 and starts size - 1 follower processes (engine/parallel/tp_group.py); on the CPU the ranks
    # meet over gloo and share one K/V cache file (each rank a head-slice view), on CUDA over NCCL, rank r on cuda:r
    tensor_parallel_size: int = 1
    # where a group's K/V cache lives: "shared" (the CPU: one file of every head, each rank a head-slice view of it)
    # or "per_rank" (each rank allocates its own heads' cache, the layout CUDA ranks need: block copies go to every
    # rank, and a K/V transfer goes rank to rank by head range, kv_transfer/wire/head_routes.py)
    tp_kv_cache: str = "shared"
    seed: int = 0  # seeds unseeded sampling, so a run as a whole is reproducible
    cache_dir: str | None = None  # where the default model is converted; None: ~/.cache/pdcluster
    # speculative decoding (docs/speculative.md): a SpeculativeConfig, or its dict / JSON as vLLM spells it
    # ({"method": "ngram", "num_speculative_tokens": 4}); None: off
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise bad("device", 'must be "auto", "cpu", "cuda" or "cuda:N"')
        if self.dtype not in SUPPORTED_DTYPES:
            raise bad("dtype", f"must be one of {SUPPORTED_DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise bad("block_size", "must be a power of two in [1, 128]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise bad("num_kv_blocks", "must be >= 2")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise bad("kv_cache_gib", "must be > 0 or None")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", "must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", "must be >= 2")
        if isinstance(self.reserved_device_bytes, bool) or not isinstance(self.reserved_device_bytes, int) \
                or self.reserved_device_bytes < 0:
            raise bad("reserved_device_bytes", "must be an int >= 0")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or not 1 <= self.tensor_parallel_size <= 64:
            raise bad("tensor_parallel_size", "must be an int in [1, 64]")
        if self.tp_kv_cache not in TP_KV_CACHES:
            raise bad("tp_kv_cache", f"must be one of {TP_KV_CACHES}")
        if self.num_threads is not None and self.num_threads < 1:
            raise bad("num_threads", "must be >= 1")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config: not supported with tensor_parallel_size > 1 yet")
