"""Pure-torch pieces of the quantized-weight schemes: activation quantization as each scheme defines it, INT4 nibble
packing, scale expansion. The ground truth that :mod:`pdkernels.quant`'s ``reference_linear`` and every fast path
(:mod:`pdkernels.quant_cpu`, :mod:`pdkernels.triton_quant`) share, so a fast path differs from the reference only in
the order of its float32 sums.

- INT8 activations (W8A8): per token (row), symmetric, dynamic: ``scale = max|row| / 127``,
  ``q = clamp(round_half_even(row / scale), -128, 127)`` (vLLM's and compressed-tensors' convention); an all-zero
  row gets scale 0 and zeros.
- FP8 activations: per token dynamic (``scale = max|row| / 448``; with a group size, per token and per group of
  that many columns, as DeepSeek-V3's block-scaled checkpoints quantize them), or per tensor static (the
  checkpoint's ``input_scale``); ``q = float8_e4m3fn(clamp(row / scale, -448, 448))`` (round to nearest even).
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite magnitude
FP8 = torch.float8_e4m3fn
MIN_SCALE = 1e-30  # divides an all-zero row (its values stay zero, its scale 0)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` with zeros replaced by ones, for dividing an all-zero row (its values stay zero). Pure."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_tokens_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` ``[M, K]`` as int8 ``[M, K]`` and float32 scales ``[M]`` (``x ~= q * scale[:, None]``). Pure.

    Few torch ops, as the CPU's W8A8 path calls it per linear: ``max|row|`` in x's own dtype (exact: a maximum of
    values of that dtype), ``x / scale`` promoting x to float32 in the division (so equal to ``x.float() / scale``),
    and no clamp: ``|row / scale| <= 127.00002`` for a scale of ``max|row| / 127`` rounded to float32, or smaller
    when the scale is raised to ``MIN_SCALE``, so the rounded levels are within [-127, 127]."""
    levels, scale = _int8_levels(x)
    return levels.to(torch.int8), scale


def quantize_tokens_uint8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_tokens_int8`'s levels plus 128 as uint8 (unsigned activations at zero point 128, the form
    oneDNN's int8 GEMM takes: the same integers after it subtracts the zero point), and the scales. Pure."""
    levels, scale = _int8_levels(x)
    return levels.add_(128.0).to(torch.uint8), scale


def _int8_levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token INT8 levels of ``x`` ``[M, K]`` as float32 integers in [-127, 127], and the scales. Pure."""
    scale = x.abs().amax(dim=-1).float().div_(INT8_MAX)
    return torch.div(x, scale.clamp_min(MIN_SCALE)[:, None]).round_(), scale


def quantize_tokens_fp8(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` ``[M, K]`` as FP8 ``[M, K]`` and float32 scales: ``[M]`` per token, or ``[M, ceil(K / group)]``
    per token and group of ``group`` columns (the last group may be short). Pure."""
    xf = x.float()
    m, k = xf.shape
    if group is None:
        scale = xf.abs().amax(dim=-1) / E4M3_MAX
        return (xf / _safe(scale)[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8), scale
    groups = -(-k // group)
    padded = torch.nn.functional.pad(xf, (0, groups * group - k)).view(m, groups, group)
    scale = padded.abs().amax(dim=-1) / E4M3_MAX
    q = (padded / _safe(scale)[:, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8).view(m, groups * group)[:, :k]
    return q, scale


def quantize_static_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``[M, K]`` as FP8 with one static float32 scale ``[]`` (the checkpoint's ``input_scale``). Pure."""
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)


def fp8_activations(x: torch.Tensor, act_scale: torch.Tensor | None, dynamic: bool,
                    group: int | None) -> torch.Tensor:
    """``x`` ``[M, K]`` as the FP8 scheme feeds it to the GEMM, back in float32 (quantized then multiplied by its
    scale): dynamic per token (per group of ``group`` columns when given), static per tensor, or unchanged
    (weight-only). Pure."""
    if dynamic:
        q, scale = quantize_tokens_fp8(x, group)
        if group is None:
            return q.float() * scale[:, None]
        return q.float() * scale.repeat_interleave(group, dim=1)[:, : x.shape[1]]
    if act_scale is not None:
        return quantize_static_fp8(x, act_scale).float() * act_scale
    return x.float()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K // 2]`` (k = 2j in byte j's low nibble, 2j + 1 in its high one) -> levels uint8 ``[N, K]``. Pure."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(packed.shape[0], -1)


def pack_int4(levels: torch.Tensor) -> torch.Tensor:
    """Levels 0..15 (any integer dtype) ``[N, K]``, K even -> uint8 ``[N, K // 2]``; inverse of :func:`unpack_int4`.
    Pure."""
    lv = levels.to(torch.uint8)
    return lv[:, 0::2] | (lv[:, 1::2] << 4)


def expand_groups(t: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """Per-group values ``[N, G]`` repeated to ``[N, k]`` (each over ``group`` columns, the last cut at ``k``). Pure."""
    return t.repeat_interleave(group, dim=1)[:, :k]


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """Block scales ``[ceil(n / bn), ceil(k / bk)]`` repeated to ``[n, k]``. Pure."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def check(cond: bool, name: str, msg: str) -> None:
    """Raise ``ValueError`` naming the field ``name`` unless ``cond``."""
    if not cond:
        raise ValueError(f"{name}: {msg}")


def check_scale(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    """A float32 scale tensor of ``shape``, finite (values read on CPU tensors only: a device read would sync)."""
    check(isinstance(t, torch.Tensor), name, f"expected a tensor, got {type(t).__name__}")
    check(t.dtype == torch.float32, name, f"expected float32, got {t.dtype}")
    check(tuple(t.shape) == shape, name, f"expected shape {list(shape)}, got {list(t.shape)}")
    if t.device.type == "cpu" and t.numel():
        check(bool(torch.isfinite(t).all()), name, "has non-finite values")


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def check_input(x: torch.Tensor, bias: torch.Tensor | None, n: int, k: int) -> None:
    """Activations ``[..., k]`` of a float dtype and an optional bias ``[n]`` (on every quantized linear call: the
    messages are formatted only on failure)."""
    if x.dtype not in _FLOATS:
        check(False, "x", f"unsupported dtype {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        check(False, "x", f"expected [..., {k}], got {list(x.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        check(False, "bias", f"expected [{n}], got {list(bias.shape)}")


def finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A float32 GEMM result ``[M, N]`` plus ``bias`` (in float32), cast to x's dtype and shaped ``[..., N]``. Pure."""
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
