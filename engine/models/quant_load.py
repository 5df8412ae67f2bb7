"""Quantized checkpoints: check them from their headers before a byte of weight is read, then turn each quantized
module's tensors into the ``pdkernels.quant`` weight class its scheme runs on.

:func:`check_checkpoint` reads ``config.json`` and the safetensors headers (plus the few bytes of each
``weight_shape``) and returns :func:`engine.models.quant_config.plan_quantization`'s module -> scheme map, or raises
``ValueError`` (a quantized module that is no ``nn.Linear``, e.g. the embedding, is one no scheme maps). Quantized
MoE experts load per expert, like any projection, and are grouped by engine/models/moe_quant.py.
:func:`convert` replaces a module's tensors in a loaded state dict with one weight object under ``<module>.weight``:

- W8A8 (``int-quantized``): ``Int8Weight(weight, weight_scale)``, a per-tensor scale broadcast to every channel.
- W4A16 (``pack-quantized``): ``Int4Weight``: each int32 word of ``weight_packed`` holds 8 levels (``q + 8``),
  element k in bits ``4 * (k % 8)``; read as little-endian bytes that is the class's layout already (byte j: k = 2j
  low nibble, 2j + 1 high). ``weight_zero_point`` is packed the same way along the output dim (N) and stored
  offset by 8 as well, so its unpacked nibbles are the zero levels.
- FP8: ``Fp8Weight(weight, scale, block, act_scale, act_dynamic)`` from ``weight_scale`` (compressed-tensors) or
  ``weight_scale_inv`` (native block FP8, a multiplier despite its name).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import torch

from engine.models.quant_config import QuantScheme, TensorInfo, is_linear, plan_quantization


def read_manifest(files: list[Path]) -> dict[str, TensorInfo]:
    """Every tensor's dtype and shape from the safetensors headers of ``files``, with the values of the small
    integer ``*.weight_shape`` tensors (a few bytes each). Reads no other tensor data."""
    out: dict[str, TensorInfo] = {}
    for path in files:
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header: dict[str, Any] = json.loads(f.read(n))
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                values = None
                if name.endswith(".weight_shape") and meta["dtype"] in ("I64", "I32") and len(meta["shape"]) == 1:
                    a, b = meta["data_offsets"]
                    f.seek(8 + n + a)
                    width = 8 if meta["dtype"] == "I64" else 4
                    raw = f.read(b - a)
                    values = struct.unpack(f"<{len(raw) // width}{'q' if width == 8 else 'i'}", raw)
                out[name] = TensorInfo(meta["dtype"], tuple(meta["shape"]), values)
    return out


def check_checkpoint(folder: Path, files: list[Path]) -> dict[str, QuantScheme]:
    """The quantized modules of the checkpoint in ``folder`` and their schemes (``{}`` for an unquantized one),
    decided from ``config.json`` and the headers of ``files`` before any weight is read. Raises ``ValueError`` naming
    the method, the scheme and the supported list, or a malformed module."""
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    arch = (cfg.get("architectures") or [""])[0]
    manifest = read_manifest(files)
    return plan_quantization(cfg, manifest, lambda m: is_linear(m, arch))


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """The 4-bit values of int32 words ``[R, C]`` as uint8 ``[R, 8 C]`` (element k of a row: bits ``4 (k % 8)`` of
    word ``k // 8``). Pure."""
    b = words.contiguous().view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(words.shape[0], -1)


def _take(state: dict[str, torch.Tensor], module: str, name: str) -> torch.Tensor:
    return state.pop(f"{module}.{name}")


def build_weight(state: dict[str, torch.Tensor], module: str, scheme: QuantScheme) -> Any:
    """Pop ``module``'s quantized tensors from ``state`` and return its ``pdkernels.quant`` weight. Mutates
    ``state``. Raises ``ValueError`` (the class's validation) for a malformed module."""
    from pdkernels.quant import Fp8Weight, Int4Weight, Int8Weight

    if sys.byteorder != "little":  # the int32 words are read as bytes
        raise ValueError("model: quantized checkpoints need a little-endian host")
    if scheme.kind == "int8":
        q = _take(state, module, "weight")
        scale = _take(state, module, "weight_scale").float().reshape(-1)
        if scale.numel() == 1:
            scale = scale.expand(q.shape[0]).contiguous()
        return Int8Weight(q.contiguous(), scale.contiguous())
    if scheme.kind == "int4":
        packed = _take(state, module, "weight_packed")
        n, k = (int(v) for v in _take(state, module, "weight_shape").tolist())
        scale = _take(state, module, "weight_scale").float().contiguous()
        zero = None
        if not scheme.symmetric:
            zp = _take(state, module, "weight_zero_point")  # [ceil(N / 8), G], packed along N
            zero = _nibbles(zp.t())[:, :n].t().contiguous()
        levels = packed.contiguous().view(torch.uint8).reshape(n, k // 2)
        return Int4Weight(levels.contiguous(), scale, zero, scheme.group_size or k)
    weight = _take(state, module, "weight")
    scale = _take(state, module, "weight_scale_inv" if scheme.method == "fp8" else "weight_scale").float()
    if scheme.strategy == "tensor":
        scale = scale.reshape(())
    elif scheme.strategy == "channel":
        scale = scale.reshape(-1)
    act_scale = state.pop(f"{module}.input_scale").float().reshape(()) if scheme.activations == "static" else None
    return Fp8Weight(weight.contiguous(), scale.contiguous(), scheme.block, act_scale,
                     scheme.activations == "dynamic")


def convert(state: dict[str, Any], plan: dict[str, QuantScheme]) -> None:
    """Replace every planned module's tensors in ``state`` by its weight object under ``<module>.weight`` (its bias,
    if any, stays a tensor). Mutates ``state``; ``ValueError`` as :func:`build_weight`."""
    for module, scheme in plan.items():
        state[f"{module}.weight"] = build_weight(state, module, scheme)
