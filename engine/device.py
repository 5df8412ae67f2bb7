"""Where an engine runs: resolving ``EngineConfig.device``/``dtype`` and sizing the KV cache on a GPU.

On the CPU the KV cache takes ``kv_cache_gib`` (2 GiB by default). On CUDA it takes what
``gpu_memory_utilization`` of the device's total memory leaves after this engine's weights and a profiled peak of
activations (one forward over a full token budget), never more than is free on the device at that moment: an actor
holding a fractional GPU share passes that share as its utilization, and the other actors' memory is never counted
as its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.model import DecoderModel

# left free on the device beyond the profiled peak: CUDA graphs' private pool, allocator fragmentation, NCCL buffers
CUDA_HEADROOM_BYTES = 512 * 2**20


def resolve_device(spec: str) -> torch.device:
    """The torch device for an ``EngineConfig.device`` string. Raises ``ValueError`` when CUDA is asked for (or the
    index is out of range) and not there. Pure apart from querying CUDA."""
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {spec!r} asked for, but torch {torch.__version__} sees no CUDA device")
    index = torch.cuda.current_device() if spec == "cuda" else int(spec.split(":")[1])
    if index >= torch.cuda.device_count():
        raise ValueError(f"device: {spec!r}, but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", index)


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 natively (the ``avx512_bf16`` or ``amx_bf16`` flag in ``/proc/cpuinfo``;
    ``cpuinfo`` overrides the file's text). False where the file is missing (not Linux). Pure apart from reading it."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """``"auto"`` -> bfloat16 on CUDA, float32 on every CPU; other names unchanged. bfloat16 on a CPU is opt-in
    (``--dtype bfloat16``; ~1.7x float32's speed where the CPU computes it natively), because bf16-rounded logits lose
    near-ties there: on a Xeon with AMX (2026-12-02) the default model answers "What is the capital of France?" with
    "L'Étoile, la Marseillaise, ..." in bfloat16 and "The capital of France is Paris." in float32 (the first token is
    a near-tie, docs/benchmarks.md). Pure."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def kv_cache_bytes(device: torch.device, kv_cache_gib: float | None, gpu_memory_utilization: float,
                   profile: Callable[[], None] | None = None) -> int:
    """Bytes for the KV cache. On CUDA runs ``profile()`` (a forward at the largest step the engine will run), then
    takes ``utilization * total - peak allocated by this process - headroom``, capped by free memory less the
    headroom. Raises ``ValueError`` if nothing is left. ``kv_cache_gib`` set: exactly that (CUDA: if it fits)."""
    if device.type != "cuda":
        return int((kv_cache_gib if kv_cache_gib is not None else 2.0) * 2**30)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    if profile is not None:
        profile()
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    room = free - CUDA_HEADROOM_BYTES - (peak - torch.cuda.memory_allocated(device))
    if kv_cache_gib is not None:
        want = int(kv_cache_gib * 2**30)
        if want > room:
            raise ValueError(f"kv_cache_gib: {kv_cache_gib} GiB does not fit in the {max(room, 0) / 2**30:.2f} GiB "
                             f"free on {device}")
        return want
    budget = min(int(gpu_memory_utilization * total) - peak - CUDA_HEADROOM_BYTES, room)
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves no room for a KV cache "
            f"after {peak / 2**30:.2f} GiB of weights and activations ({free / 2**30:.1f} GiB free on {device})")
    return budget


def profile_forward(model: DecoderModel, num_tokens: int, num_rows: int, block_size: int,
                    kv_dtype: torch.dtype) -> None:
    """One forward of a ``num_tokens`` prefill chunk over a throwaway KV cache, then logits and their log-softmax for
    ``num_rows`` rows: the activation peak of the largest step the engine will run. Writes nothing the engine keeps."""
    from engine.model import AttentionMetadata  # engine.model imports kernels; keep this module light to import
    from kernels.reference import SCALED_DTYPES, scale_dims

    cfg, dev = model.cfg, model.device
    num_blocks = -(-num_tokens // block_size)
    kv = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype,
                     device=dev)
    scales = (list(torch.zeros(cfg.num_layers, 2, *scale_dims(kv_dtype, num_blocks, block_size, cfg.num_kv_heads),
                               device=dev).unbind(0))
              if kv_dtype in SCALED_DTYPES else None)
    table = torch.arange(num_blocks, dtype=torch.int32, device=dev)
    varlen = (table[None], torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
              torch.zeros(1, dtype=torch.int32, device=dev), num_tokens) if dev.type == "cuda" else None
    meta = AttentionMetadata(slot_mapping=torch.arange(num_tokens, device=dev), num_decodes=0, decode_groups=[],
                             prefills=[(num_tokens, 0, table)], prefill_varlen=varlen)
    with torch.inference_mode():
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        hidden = model.forward(ids, torch.arange(num_tokens, device=dev), meta, list(kv.unbind(0)), None, scales)
        model.logits(hidden[-num_rows:]).log_softmax(dim=-1)


def num_kv_blocks(device: torch.device, model: DecoderModel, kv_cache_gib: float | None,
                  gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                  block_size: int, kv_dtype: torch.dtype, block_bytes: int) -> int:
    """KV blocks for an engine (see :func:`kv_cache_bytes`); the profile step is the largest a step can be."""
    tokens = max(1, min(max_num_batched_tokens, max_model_len))
    profile = lambda: profile_forward(model, tokens, min(max_num_seqs, tokens), block_size, kv_dtype)  # noqa: E731
    return max(2, kv_cache_bytes(device, kv_cache_gib, gpu_memory_utilization, profile) // block_bytes)
