"""Where an engine runs: resolving ``EngineConfig.device``/``dtype`` and sizing the KV cache on a GPU.

On the CPU the KV cache takes ``kv_cache_gib`` (2 GiB by default). On CUDA it takes what ``gpu_memory_utilization`` of
the device's total memory leaves after what the engine needs besides it, every part measured, never guessed
(:class:`MemoryProfile`): the weights and persistent buffers, the activation peak of the largest step (a forward over a
full token budget, then a top-p sampling pass over its rows), the decode CUDA graphs' memory pool (captured once
against a throwaway cache and released, when graphs are on), and what the engine's host allocates after the engine
(KV transfer receive buffers, communicators: ``EngineConfig.reserved_device_bytes``). The KV cache never takes more
than is free on the device less those needs: an actor holding a fractional GPU share passes that share as its
utilization, and the other actors' memory is never counted as its own. ``kv_cache_gib`` overrides the sizing.
:func:`kv_budget` is the arithmetic, pure: tested with made-up measurements on any machine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.models.model import DecoderModel

log = logging.getLogger(__name__)
GIB = 2**30


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


def resolve_dtype(dtype: str, device: torch.device, native_bf16: bool | None = None) -> str:
    """``"auto"`` -> bfloat16 on CUDA and on a CPU that computes it natively (``avx512_bf16`` or ``amx_bf16``:
    :func:`cpu_has_native_bf16`, or ``native_bf16`` when given), float32 on any other CPU (emulated bfloat16 is slower
    than float32 there); other names unchanged. vLLM's CPU build defaults to bfloat16 too (issue 48).

    The price, measured: bf16-rounded activations lose near-ties, so greedy text may differ from float32's after a
    while (docs/numerics.md; on a Xeon with AMX, 2026-12-02, the default model answered "What is the capital of
    France?" with "L'Étoile, ..." in bfloat16; on an AMD EPYC with AVX512-BF16, 2026-12-06, "Paris" in both). Tests
    that compare text name float32 (``tests/factories.py: EXACT_DTYPE``); ``--dtype float32`` is the exact mode.
    Pure apart from reading ``/proc/cpuinfo`` when ``native_bf16`` is None on a CPU."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        return "bfloat16"
    return "bfloat16" if (cpu_has_native_bf16() if native_bf16 is None else native_bf16) else "float32"


@dataclass(frozen=True)
class MemoryProfile:
    """One engine's device memory besides its KV cache, measured (bytes)."""

    total: int  # the device's memory
    free: int  # free on the device once profiling released what it took (other processes' use excluded)
    resident: int  # this process's allocations that stay: weights and persistent buffers
    activation_peak: int  # above ``resident`` at the largest step's peak: forward, logits and sampling
    decode_graphs: int = 0  # the decode CUDA graphs' buffers and memory pool; 0 when not captured
    reserved: int = 0  # allocated by the engine's host after the engine: KV transfer buffers, communicators

    @property
    def after_kv(self) -> int:
        """What must still be free once the KV cache is allocated. Pure."""
        return self.activation_peak + self.decode_graphs + self.reserved

    def describe(self) -> str:
        """The parts in GiB, for messages. Pure."""
        return (f"{self.resident / GIB:.2f} GiB of weights, {self.activation_peak / GIB:.2f} GiB of activations and "
                f"sampling, {self.decode_graphs / GIB:.2f} GiB of decode graphs, {self.reserved / GIB:.2f} GiB for KV "
                f"transfer ({self.free / GIB:.1f} of {self.total / GIB:.1f} GiB free)")


def kv_budget(p: MemoryProfile, gpu_memory_utilization: float, kv_cache_gib: float | None) -> int:
    """Bytes for the KV cache from measured needs. Pure.

    ``utilization * total - resident - after_kv``, capped by ``free - after_kv`` (what is free now, less what must
    stay free after the cache). ``kv_cache_gib`` overrides both: exactly that many bytes, refused (``ValueError``)
    only when they exceed what is free at all. Raises ``ValueError`` naming the measured parts if nothing is left."""
    if kv_cache_gib is not None:
        want = int(kv_cache_gib * GIB)
        if want > p.free:
            raise ValueError(f"kv_cache_gib: {kv_cache_gib} GiB does not fit: {p.describe()}")
        return want
    budget = min(int(gpu_memory_utilization * p.total) - p.resident - p.after_kv, p.free - p.after_kv)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization: {gpu_memory_utilization} leaves no room for a KV cache after "
                         f"{p.describe()}")
    return budget


def measure_cuda(device: torch.device, profile: Callable[[], None] | None,
                 graphs: Callable[[], int] | None, reserved: int) -> MemoryProfile:
    """Run ``profile()`` (the largest step) and ``graphs()`` (captures decode graphs, returns their bytes, releases
    them) and measure this process's memory around them. Mutates only the allocator's cache and peak statistics."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    if profile is not None:
        profile()
        torch.cuda.synchronize(device)
    activation = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    graph_bytes = graphs() if graphs is not None else 0
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryProfile(total, free, torch.cuda.memory_allocated(device), activation, graph_bytes, reserved)


def kv_cache_bytes(device: torch.device, kv_cache_gib: float | None, gpu_memory_utilization: float,
                   profile: Callable[[], None] | None = None, graphs: Callable[[], int] | None = None,
                   reserved: int = 0) -> int:
    """Bytes for the KV cache: on CUDA from a measured :class:`MemoryProfile` (see :func:`kv_budget`); on the CPU
    ``kv_cache_gib`` or 2 GiB. Raises ``ValueError`` if nothing is left."""
    if device.type != "cuda":
        return int((kv_cache_gib if kv_cache_gib is not None else 2.0) * GIB)
    measured = measure_cuda(device, profile, graphs, reserved)
    budget = kv_budget(measured, gpu_memory_utilization, kv_cache_gib)
    if budget > measured.free - measured.after_kv:  # only an explicit kv_cache_gib gets here
        log.warning("kv_cache_gib: %.2f GiB leaves less free than the engine was measured to need: %s", kv_cache_gib,
                    measured.describe())
    log.info("KV cache %.2f GiB after %s", budget / GIB, measured.describe())
    return budget


def profile_forward(model: DecoderModel, num_tokens: int, num_rows: int, block_size: int,
                    kv_dtype: torch.dtype, varlen: bool | None = None) -> torch.Tensor:
    """One forward of a ``num_tokens`` prefill chunk over a throwaway KV cache, then logits for ``num_rows`` rows and
    a top-p sampling pass over them (float32 probabilities sorted with their indices, their cumulative sum: the
    sampler's largest temporaries): the activation peak of the largest step the engine will run. Returns the
    forward's hidden states (what a test compares). Writes nothing the engine keeps. ``varlen``: the chunk as one
    varlen attention call, as the runner sends it; None: as the device's runner would
    (:func:`engine.parallel.step_wire.varlen_prefill`)."""
    # engine.models.model (which step_wire imports) imports kernels; keep this module light to import
    from engine.parallel.step_wire import StepLayout, pack, unpack, varlen_prefill
    from pdkernels.host_copy import to_device
    from pdkernels.reference import SCALED_DTYPES, scale_dims

    cfg, dev = model.cfg, model.device
    if varlen is None:
        varlen = varlen_prefill(dev)
    num_blocks = -(-num_tokens // block_size)
    kv = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.cache_heads, cfg.cache_head_dim, dtype=kv_dtype,
                     device=dev)
    scales = (list(torch.zeros(cfg.num_layers, 2, *scale_dims(kv_dtype, num_blocks, block_size, cfg.cache_heads),
                               device=dev).unbind(0))
              if kv_dtype in SCALED_DTYPES else None)
    # one chunk of token 0 at positions 0.. over blocks 0.., as the runner sends a step (a TP group's ranks each
    # unpack it on their own device)
    table = list(range(num_blocks))
    tables = [table, [0, num_tokens], [0]] if varlen else [table]
    host = pack([[0] * num_tokens, list(range(num_tokens)), list(range(num_tokens)), [], *tables],
                StepLayout((num_tokens, num_tokens, num_tokens, 0, *(len(t) for t in tables)), 0, (),
                           ((num_tokens, 0),), num_blocks if varlen else 0))
    with torch.inference_mode():
        ids, positions, meta, _ = unpack(to_device(host.ints, torch.int32, dev), host)
        hidden = model.forward(ids, positions, meta, list(kv.unbind(0)), None, scales)
        logits = model.logits(hidden, slice(-num_rows, None)).float()
        logprobs = logits.log_softmax(dim=-1)
        probs, order = logprobs.exp().sort(dim=-1, descending=True)
        probs.cumsum(dim=-1).gather(-1, order.argsort(dim=-1))
    return hidden


def profile_decode_graphs(model: DecoderModel, max_num_seqs: int, max_model_len: int, block_size: int,
                          kv_dtype: torch.dtype) -> int:
    """Capture the decode CUDA graphs against a throwaway one-block KV cache (padding rows read no block), release
    them, and return the device memory they held: buffers, the graphs' pool and the warm-ups' allocations (cached on
    the capture's side stream). The graphs do not depend on the cache's size. CUDA only."""
    from engine.cuda_graphs import DecodeGraphRunner
    from pdkernels.reference import SCALED_DTYPES, scale_dims

    cfg, dev = model.cfg, model.device
    kv = torch.zeros(cfg.num_layers, 2, 1, block_size, cfg.cache_heads, cfg.cache_head_dim, dtype=kv_dtype, device=dev)
    scales = (list(torch.zeros(cfg.num_layers, 2, *scale_dims(kv_dtype, 1, block_size, cfg.cache_heads),
                               device=dev).unbind(0))
              if kv_dtype in SCALED_DTYPES else None)
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_reserved(dev)
    runner = DecodeGraphRunner(model, list(kv.unbind(0)), scales, block_size, max_num_seqs, max_model_len, True)
    torch.cuda.synchronize(dev)
    used = torch.cuda.memory_reserved(dev) - before
    del runner
    torch.cuda.empty_cache()
    return max(0, used)


def num_kv_blocks(device: torch.device, model: DecoderModel, kv_cache_gib: float | None,
                  gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                  block_size: int, kv_dtype: torch.dtype, block_bytes: int, decode_graphs: bool = False,
                  reserved_bytes: int = 0) -> int:
    """KV blocks for an engine (see :func:`kv_cache_bytes`); the profile step is the largest a step can be, and
    ``decode_graphs`` (CUDA graphs will be captured) adds their measured memory."""
    tokens = max(1, min(max_num_batched_tokens, max_model_len))
    profile = lambda: profile_forward(model, tokens, min(max_num_seqs, tokens), block_size, kv_dtype)  # noqa: E731
    graphs = (lambda: profile_decode_graphs(model, max_num_seqs, max_model_len, block_size, kv_dtype)) \
        if decode_graphs else None
    return max(2, kv_cache_bytes(device, kv_cache_gib, gpu_memory_utilization, profile, graphs, reserved_bytes)
               // block_bytes)
