"""Tiny quantized checkpoints written as compressed-tensors (and native block FP8) save them, from a float32
checkpoint of tests/factories.py, plus the float32 checkpoint of the same weights dequantized by hand.

The formats follow compressed-tensors 0.20's compressors (read from its source, not guessed):

- ``int-quantized``: ``weight`` int8 ``[N, K]``, ``weight_scale`` ``[N, 1]`` (per channel).
- ``pack-quantized``: ``weight_packed`` int32 ``[N, K / 8]``, element k at bits ``4 (k % 8)`` of word ``k // 8``,
  stored as ``q + 8`` (``pack_to_int32``); ``weight_scale`` ``[N, K / g]``; ``weight_shape`` int64 ``[2]``;
  asymmetric: ``weight_zero_point`` (signed, offset and packed the same way along dim 0: int32 ``[ceil(N/8), G]``).
- ``float-quantized``: ``weight`` float8_e4m3fn, ``weight_scale`` ``[]``/``[N, 1]``/``[ceil(N/bn), ceil(K/bk)]``,
  static ``input_scale`` ``[1]``.
- native ``fp8``: ``weight`` float8_e4m3fn and ``weight_scale_inv`` float32 ``[ceil(N/bn), ceil(K/bk)]``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0


def pack_int32(q: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Signed 4-bit values ``q`` (int, in [-8, 7]) packed as compressed-tensors' ``pack_to_int32(q, 4, dim)``."""
    v = (q.to(torch.int64) + 8)
    if dim == 0:
        v = v.t()
    rows, cols = v.shape
    pad = -cols % 8
    v = torch.nn.functional.pad(v, (0, pad)).view(rows, -1, 8)
    words = (v << (4 * torch.arange(8))).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return (words.t() if dim == 0 else words).contiguous()


def _int8(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def _int4(w: torch.Tensor, group: int, symmetric: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n, k = w.shape
    g = w.view(n, k // group, group)
    if symmetric:
        scale = g.abs().amax(-1, keepdim=True) * 2 / 15
        zp = torch.zeros_like(scale, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
        scale = (hi - lo) / 15
        zp = (torch.round(-lo / scale) - 8).clamp(-8, 7).to(torch.int64)
    q = (torch.round(g / scale) + zp).clamp(-8, 7).to(torch.int64)
    deq = ((q - zp).float() * scale).view(n, k)
    out = {"weight_packed": pack_int32(q.view(n, k)), "weight_scale": scale.view(n, -1),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not symmetric:
        out["weight_zero_point"] = pack_int32(zp.view(n, -1), dim=0)
    return out, deq


def _fp8(w: torch.Tensor, strategy: str, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """(float8 weight, scale as stored, dequantized weight)."""
    n, k = w.shape
    if strategy == "tensor":
        scale = w.abs().amax() / E4M3_MAX
        full = scale.expand(n, k)
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        full = scale.expand(n, k)
    else:
        assert block is not None
        bn, bk = block
        assert n % bn == 0 and k % bk == 0
        scale = w.view(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3)) / E4M3_MAX
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def _act(num_bits: int, typ: str, strategy: str, dynamic: bool, group_size: int | None = None) -> dict[str, Any]:
    return {"num_bits": num_bits, "type": typ, "strategy": strategy, "symmetric": True, "dynamic": dynamic,
            "group_size": group_size}


SCHEMES = ("w8a8", "w4a16", "w4a16_asym", "fp8_dynamic", "fp8_static", "fp8_block", "fp8_native")


def scheme_config(scheme: str, ignore: list[str], group: int = 32, block: tuple[int, int] = (32, 32)
                  ) -> dict[str, Any]:
    """The ``quantization_config`` llmcompressor (or DeepSeek, for ``fp8_native``) writes for ``scheme``."""
    if scheme == "fp8_native":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    weights: dict[str, Any]
    acts: dict[str, Any] | None
    if scheme == "w8a8":
        fmt, weights = "int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True,
                                         "dynamic": False}
        acts = _act(8, "int", "token", True)
    elif scheme.startswith("w4a16"):
        fmt, weights = "pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group,
                                          "symmetric": scheme == "w4a16", "dynamic": False}
        acts = None
    else:
        strategy = {"fp8_dynamic": "channel", "fp8_static": "tensor", "fp8_block": "block"}[scheme]
        fmt, weights = "float-quantized", {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                                           "dynamic": False}
        if scheme == "fp8_block":
            weights["block_structure"] = list(block)
            acts = _act(8, "float", "group", True, block[1])
        elif scheme == "fp8_static":
            acts = _act(8, "float", "tensor", False)
        else:
            acts = _act(8, "float", "token", True)
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None, "format": fmt}},
            "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {}}


def _quantized_modules(state: dict[str, torch.Tensor], ignore: list[str], experts: bool) -> list[str]:
    return [n[: -len(".weight")] for n in state if n.endswith(".weight")
            and ("_proj" in n.rsplit(".", 2)[-2] or (experts and n.rsplit(".", 2)[-2] in ("w1", "w2", "w3")))
            and n[: -len(".weight")] not in ignore and (experts or ".experts." not in n)]


def quantize_checkpoint(src: Path, dst: Path, scheme: str, dense: Path | None = None, group: int = 32,
                        block: tuple[int, int] = (32, 32), ignore: tuple[str, ...] = ("lm_head",),
                        experts: bool = False) -> Path:
    """Write ``src`` (a float32 checkpoint folder) quantized by ``scheme`` into ``dst``; with ``dense``, also the
    float32 checkpoint of the dequantized weights there (the reference the quantized model must equal). Every
    ``*_proj*`` weight but ``ignore`` and (unless ``experts``) the MoE experts is quantized."""
    state = load_file(str(src / "model.safetensors"))
    out = dict(state)
    deq_state = dict(state)
    torch.manual_seed(1)
    for m in _quantized_modules(state, list(ignore), experts):
        w = out.pop(f"{m}.weight").float()
        if scheme == "w8a8":
            tensors, deq = _int8(w)
        elif scheme.startswith("w4a16"):
            tensors, deq = _int4(w, group, scheme == "w4a16")
        else:
            strategy = {"fp8_dynamic": "channel", "fp8_static": "tensor"}.get(scheme, "block")
            q, scale, deq = _fp8(w, strategy, block)
            tensors = {"weight": q, ("weight_scale_inv" if scheme == "fp8_native" else "weight_scale"): scale}
            if scheme == "fp8_static":
                tensors["input_scale"] = torch.tensor([0.02])
        out.update({f"{m}.{k}": v.contiguous() for k, v in tensors.items()})
        deq_state[f"{m}.weight"] = deq.contiguous()
    cfg = json.loads((src / "config.json").read_text())
    for folder, tensors, qc in ((dst, out, scheme_config(scheme, list(ignore), group, block)),
                                (dense, deq_state, None)):
        if folder is None:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                shutil.copy(f, folder / f.name)
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": qc} if qc else {})}))
    return dst


def with_config(src: Path, dst: Path, quantization_config: dict[str, Any] | None,
                tensors: dict[str, torch.Tensor] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of ``src`` with another ``quantization_config`` (None: none) and, with ``tensors``, those tensors added
    or replaced (``drop``: removed)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    state = load_file(str(src / "model.safetensors"))
    state.update(tensors or {})
    for name in drop:
        state.pop(name)
    save_file(state, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


LOGPROB_TOL = 2e-3  # weight-only schemes against the dense dequantized model (float32 rounding; measured ~3e-6)
# schemes that quantize activations: an input within float32 rounding of a rounding boundary may land on the
# other quantization level than the reference's (the float32 sums before it differ in order: oneDNN vs Hugging
# Face, thread count), moving a logprob by ~1e-2 (seen in CI: 0.0101 for W8A8); the ids must still be equal
ACT_QUANT_LOGPROB_TOL = 3e-2


def logprob_tol(scheme: str) -> float:
    """The logprob tolerance of ``scheme`` against its reference. Pure."""
    return LOGPROB_TOL if scheme.startswith("w4a16") else ACT_QUANT_LOGPROB_TOL
