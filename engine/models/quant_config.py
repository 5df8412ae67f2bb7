"""Which quantized-weight scheme each module of a checkpoint carries, read from ``config.json``'s
``quantization_config`` and checked against the safetensors headers, before a weight is read. Pure (no torch).

Runs (``SUPPORTED``):

- compressed-tensors ``int-quantized`` W8A8: int8 weights per output channel (or per tensor), symmetric; int8
  activations per token, dynamic, symmetric. Tensors ``weight`` (I8 [N, K]), ``weight_scale`` ([N, 1] / [1]).
- compressed-tensors ``pack-quantized`` W4A16: 4-bit integer weights in groups along K (``group_size``) or per
  channel, symmetric or asymmetric, activations unquantized. ``weight_packed`` (I32 [N, K / 8]: element k in bits
  ``4 * (k % 8)`` of word ``k // 8``, stored as ``q + 8``), ``weight_scale`` ([N, K / g]), ``weight_shape``
  ([2]: N, K), ``weight_zero_point`` (asymmetric: I32 [ceil(N / 8), K / g], packed the same way along N).
- compressed-tensors ``float-quantized`` (or ``naive-quantized``) FP8: float8_e4m3fn weights per tensor, per
  channel or in blocks (``block_structure``); activations FP8 per token dynamic, per tensor static
  (``input_scale``), per token-group dynamic for block weights (group = the block's columns), or none.
- native block FP8 (``quant_method: fp8``, ``weight_block_size``, ``activation_scheme: dynamic``), as DeepSeek-V3
  and Qwen3-*-FP8 ship it: ``weight`` (F8_E4M3 [N, K]) and ``weight_scale_inv`` (float32 [ceil(N/bn), ceil(K/bk)],
  multiplied, despite its name: ``w = weight * scale_inv[block]``).

Everything else is refused by :func:`plan_quantization` with a ``ValueError`` naming the method, the scheme and this
list: another ``quant_method`` (GPTQ, AWQ, bitsandbytes, ...), another format / bit width / strategy / activation
kind, a KV-cache scheme, sparsity or transforms, quantized tensors a config does not explain (or a checkpoint with
no ``quantization_config`` at all), and malformed modules (a missing scale, a wrong shape or dtype, a group size that
does not divide the in-features). Matching follows compressed-tensors: a target or ``ignore`` entry is a module name
(exact), ``re:<regex>`` (``re.match`` from the start of the module name) or the class name ``Linear`` (every linear
projection of the Hugging Face model: :func:`is_linear`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED = (
    "compressed-tensors int-quantized W8A8 (int8 weights per channel or tensor, symmetric; int8 activations per "
    "token, dynamic)",
    "compressed-tensors pack-quantized W4A16 (4-bit weights per group or channel, symmetric or asymmetric)",
    "compressed-tensors float-quantized FP8 (e4m3 weights per tensor, channel or block; activations dynamic per "
    "token, static per tensor, dynamic per token-group for blocks, or none)",
    "fp8 block-scaled (weight_block_size, weight_scale_inv, dynamic activations: DeepSeek-V3, Qwen3-FP8)",
)
_SUPPORTED_TEXT = "supported: " + "; ".join(SUPPORTED)

_FLOATS = ("F16", "BF16", "F32", "F64")
_SCALE_DTYPES = ("F16", "BF16", "F32")
# the parameter names a quantized module may carry beside (or instead of) its weight; any of them marks a module
# quantized in the files
QUANT_PARAMS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_scale_inv",
                "input_scale", "input_zero_point", "weight_g_idx", "weight_global_scale", "input_global_scale",
                "output_scale", "qweight", "qzeros", "scales", "g_idx", "k_scale", "v_scale", "SCB", "absmax",
                "quant_map", "quant_state")


@dataclass(frozen=True)
class TensorInfo:
    """What a safetensors header says of one tensor (and, for a few tiny int tensors such as ``weight_shape``,
    its values)."""

    dtype: str  # the header's dtype string: "BF16", "I8", "I32", "F8_E4M3", ...
    shape: tuple[int, ...]
    values: tuple[int, ...] | None = None


@dataclass(frozen=True)
class QuantScheme:
    """One quantized-weight scheme, as the loader converts it into a ``pdkernels.quant`` weight class."""

    kind: str  # "int8" (Int8Weight), "int4" (Int4Weight) or "fp8" (Fp8Weight)
    method: str  # "compressed-tensors" or "fp8"
    format: str  # compressed-tensors' format ("int-quantized", ...), or "fp8"
    strategy: str  # the weights': "tensor", "channel", "group" or "block"
    group_size: int | None = None  # int4 groups along K (None: per channel)
    symmetric: bool = True
    block: tuple[int, int] | None = None  # FP8 block (rows, cols)
    activations: str = "none"  # "none", "dynamic" (per token, or per token-group of block[1]) or "static"

    def describe(self) -> str:
        """A one-line name of the scheme, for errors and logs. Pure."""
        bits = {"int8": "int8", "int4": "int4", "fp8": "fp8-e4m3"}[self.kind]
        parts = [f"{self.method} {self.format}", f"weights {bits} per {self.strategy}"]
        if self.group_size:
            parts.append(f"group_size {self.group_size}")
        if self.block:
            parts.append(f"block {self.block[0]}x{self.block[1]}")
        if self.kind == "int4":
            parts.append("symmetric" if self.symmetric else "asymmetric")
        parts.append(f"activations {self.activations}")
        return ", ".join(parts)


def _target_matches(target: str, module: str, linear: bool) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module or (target == "Linear" and linear)


def is_linear(module: str, architecture: str) -> bool:
    """Whether ``module`` (a checkpoint module name) is an ``nn.Linear`` in the Hugging Face model: the projections
    (``*_proj*``, Mixtral's experts ``w1`` / ``w2`` / ``w3``), ``lm_head`` and the routers of Qwen3-MoE and Mixtral
    (``gate``; DeepSeek's router is its own module class, not a Linear). Pure."""
    last = module.rsplit(".", 1)[-1]
    if "_proj" in last or last in ("lm_head", "w1", "w2", "w3"):  # DeepSeek's kv_a_proj_with_mqa too
        return True
    return last == "gate" and not architecture.startswith("Deepseek")


@dataclass(frozen=True)
class QuantConfig:
    """A parsed ``quantization_config``: the schemes and the modules each applies to."""

    method: str
    groups: tuple[tuple[str, tuple[str, ...], QuantScheme], ...]  # (group name, targets, scheme)
    ignore: tuple[str, ...]
    # native fp8: no targets, every module whose files hold a weight_scale_inv is quantized (those in ignore must not)
    native: QuantScheme | None = None

    def scheme_for(self, module: str, linear: bool) -> QuantScheme | None:
        """The scheme ``module`` is quantized with by the config (None: left unquantized). ``linear``: whether it is
        an ``nn.Linear`` (class-name targets). Pure; ``ValueError`` if two groups of different schemes claim it."""
        if any(_target_matches(t, module, linear) for t in self.ignore):
            return None
        if self.native is not None:
            return self.native
        found = {s for _, targets, s in self.groups if any(_target_matches(t, module, linear) for t in targets)}
        if len(found) > 1:
            raise ValueError(f"quantization_config: module {module} is targeted by {len(found)} config groups with "
                             "different schemes")
        return next(iter(found), None)


def _refuse(method: str, what: str) -> ValueError:
    return ValueError(f"model: quantization_config {method!r}: {what} is not supported ({_SUPPORTED_TEXT})")


def _args_text(args: Mapping[str, Any] | None) -> str:
    if not args:
        return "none"
    keys = ("type", "num_bits", "strategy", "group_size", "block_structure", "symmetric", "dynamic", "actorder")
    return "{" + ", ".join(f"{k}={args.get(k)!r}" for k in keys if args.get(k) is not None) + "}"


def _strategy(args: Mapping[str, Any]) -> str:
    """compressed-tensors' strategy, derived from group_size where the config leaves it out (as QuantizationArgs)."""
    if args.get("strategy"):
        return str(args["strategy"]).lower()
    g = args.get("group_size")
    return "tensor" if g is None else "channel" if g == -1 else "group"


def _ct_scheme(name: str, fmt: str, group: Mapping[str, Any]) -> QuantScheme:
    """One compressed-tensors config group as a :class:`QuantScheme`, or ``ValueError`` naming what is not run."""
    w, a = group.get("weights"), group.get("input_activations")
    desc = f"config group {name!r} (format {fmt}, weights {_args_text(w)}, input_activations {_args_text(a)})"
    method = "compressed-tensors"
    if group.get("output_activations"):
        raise _refuse(method, f"{desc} with output_activations {_args_text(group['output_activations'])}")
    if not w:
        raise _refuse(method, f"{desc} (activations quantized without weights)")
    wtype, bits, strat = str(w.get("type", "int")).lower(), int(w.get("num_bits", 8)), _strategy(w)
    if w.get("dynamic"):
        raise _refuse(method, f"{desc}: dynamic weights")
    if w.get("actorder") not in (None, "weight", "static"):  # "group" reorders columns through weight_g_idx
        raise _refuse(method, f"{desc}: actorder {w.get('actorder')!r}")
    atype = str(a.get("type", "int")).lower() if a else None
    abits = int(a.get("num_bits", 8)) if a else None
    astrat = _strategy(a) if a else None
    adyn = bool(a.get("dynamic")) if a else False
    asym = bool(a.get("symmetric", True)) if a else True
    if fmt in ("int-quantized", "naive-quantized") and wtype == "int" and bits == 8:
        if strat in ("channel", "tensor") and w.get("symmetric", True) and a and atype == "int" and abits == 8 \
                and astrat == "token" and adyn and asym:
            return QuantScheme("int8", method, fmt, strat, activations="dynamic")
    elif fmt == "pack-quantized" and wtype == "int" and bits == 4 and not a:
        if strat == "group" and int(w.get("group_size") or 0) > 0:
            return QuantScheme("int4", method, fmt, "group", group_size=int(w["group_size"]),
                               symmetric=bool(w.get("symmetric", True)))
        if strat == "channel":
            return QuantScheme("int4", method, fmt, "channel", symmetric=bool(w.get("symmetric", True)))
    elif fmt in ("float-quantized", "naive-quantized") and wtype == "float" and bits == 8 \
            and w.get("symmetric", True):
        block = None
        if strat == "block":
            bs = w.get("block_structure")
            if isinstance(bs, str):
                bs = [int(x) for x in bs.split("x")]
            if not (isinstance(bs, list) and len(bs) == 2 and all(int(x) > 0 for x in bs)):
                raise ValueError(f"model: quantization_config {method!r}: {desc}: malformed block_structure {bs!r}")
            block = (int(bs[0]), int(bs[1]))
        if strat in ("tensor", "channel", "block"):
            acts = None
            if not a:
                acts = "none"
            elif atype == "float" and abits == 8 and asym:
                if adyn and ((block is None and astrat == "token") or
                             (block is not None and astrat == "group" and a.get("group_size") == block[1])):
                    acts = "dynamic"
                elif not adyn and astrat == "tensor" and block is None:
                    acts = "static"
            if acts is not None:
                return QuantScheme("fp8", method, fmt, strat, block=block, activations=acts)
    raise _refuse(method, desc)


def _native_fp8(q: Mapping[str, Any]) -> QuantScheme:
    desc = (f"fmt {q.get('fmt', 'e4m3')!r}, activation_scheme {q.get('activation_scheme', 'dynamic')!r}, "
            f"weight_block_size {q.get('weight_block_size')!r}")
    if str(q.get("fmt", "e4m3")) != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("fp8", desc)
    bs = q.get("weight_block_size")
    if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(x, int) and x > 0 for x in bs)):
        raise _refuse("fp8", desc + " (per-tensor fp8 without weight_block_size)")
    return QuantScheme("fp8", "fp8", "fp8", "block", block=(bs[0], bs[1]), activations="dynamic")


def parse_quant_config(cfg: Mapping[str, Any]) -> QuantConfig | None:
    """``config.json``'s ``quantization_config`` (or ``compression_config``, its older name) parsed, or None when
    there is none. Pure; raises ``ValueError`` naming the method and scheme for anything :data:`SUPPORTED` lacks."""
    q = cfg.get("quantization_config") or cfg.get("compression_config")
    if not q:
        return None
    if not isinstance(q, Mapping):
        raise ValueError(f"model: quantization_config must be an object, got {type(q).__name__}")
    method = str(q.get("quant_method", "?"))
    if method == "fp8":
        ignore = tuple(str(x) for x in (q.get("modules_to_not_convert") or q.get("ignored_layers") or ()))
        return QuantConfig(method, (), ignore, native=_native_fp8(q))
    if method != "compressed-tensors":
        bits = q.get("bits", q.get("w_bit", q.get("load_in_4bit") and 4 or q.get("load_in_8bit") and 8))
        extra = f" (bits {bits}, group_size {q.get('group_size', q.get('q_group_size'))})" if bits else ""
        raise _refuse(method, f"quant_method {method!r}{extra}")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config"):
        if q.get(key):
            raise _refuse(method, f"{key} {q[key]!r}")
    fmt = str(q.get("format") or "dense")
    groups = []
    for name, group in (q.get("config_groups") or {}).items():
        if not isinstance(group, Mapping):  # a preset name with its targets: not what llmcompressor saves
            raise _refuse(method, f"config group {name!r} given as a preset ({group!r})")
        targets = tuple(str(t) for t in group.get("targets") or ())
        for t in targets:
            if not (t.startswith("re:") or "." in t or t == "Linear" or t == "lm_head"):
                raise _refuse(method, f"config group {name!r}: target {t!r} (only module names, 're:' patterns and "
                                      "the class 'Linear')")
        groups.append((str(name), targets, _ct_scheme(str(name), str(group.get("format") or fmt), group)))
    if not groups:
        raise _refuse(method, "a quantization_config without config_groups")
    return QuantConfig(method, tuple(groups), tuple(str(x) for x in q.get("ignore") or ()))


def _module_params(tensors: Mapping[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    modules: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        module, _, param = name.rpartition(".")
        modules.setdefault(module, {})[param] = info
    return modules


def quantized_in_files(params: Mapping[str, TensorInfo]) -> bool:
    """Whether a module's tensors are quantized: a quantization parameter's name, or a weight that is no float.
    Pure."""
    weight = params.get("weight")
    return any(p in params for p in QUANT_PARAMS) or (weight is not None and weight.dtype not in _FLOATS)


def _want(module: str, params: Mapping[str, TensorInfo], name: str, dtypes: tuple[str, ...],
          shapes: tuple[tuple[int, ...], ...], scheme: QuantScheme) -> TensorInfo:
    info = params.get(name)
    if info is None:
        raise ValueError(f"model: malformed quantized module {module} ({scheme.describe()}): no {name}")
    if info.dtype not in dtypes:
        raise ValueError(f"model: malformed quantized module {module}: {name} is {info.dtype}, expected "
                         f"{' or '.join(dtypes)}")
    if shapes and info.shape not in shapes:
        raise ValueError(f"model: malformed quantized module {module}: {name} has shape {list(info.shape)}, "
                         f"expected {' or '.join(str(list(s)) for s in shapes)}")
    return info


def check_module(module: str, params: Mapping[str, TensorInfo], scheme: QuantScheme) -> tuple[int, int]:
    """``(N, K)`` of a quantized module after checking its tensors' names, dtypes and shapes against ``scheme``.
    Pure; raises ``ValueError`` naming the module and the defect."""
    allowed = {"weight", "bias", "weight_scale", "input_scale", "weight_packed", "weight_shape",
               "weight_zero_point", "weight_scale_inv"}
    if scheme.kind == "int4":
        sh = _want(module, params, "weight_shape", ("I64", "I32"), ((2,),), scheme)
        packed = _want(module, params, "weight_packed", ("I32",), (), scheme)
        if sh.values is None or len(sh.values) != 2:
            raise ValueError(f"model: malformed quantized module {module}: weight_shape values unread")
        n, k = sh.values
        if k % 8 or packed.shape != (n, k // 8):
            raise ValueError(f"model: malformed quantized module {module}: weight_packed {list(packed.shape)} does "
                             f"not hold weight_shape {[n, k]} (in-features a multiple of 8, [N, K / 8] int32)")
        g = scheme.group_size or k
        if k % g:
            raise ValueError(f"model: malformed quantized module {module}: group_size {g} does not divide the "
                             f"in-features {k}")
        _want(module, params, "weight_scale", _SCALE_DTYPES, ((n, k // g),), scheme)
        if not scheme.symmetric:
            _want(module, params, "weight_zero_point", ("I32",), ((-(-n // 8), k // g),), scheme)
        allowed -= {"weight", "input_scale", "weight_scale_inv"} | ({"weight_zero_point"} if scheme.symmetric else set())
    else:
        wdtype = "I8" if scheme.kind == "int8" else "F8_E4M3"
        weight = _want(module, params, "weight", (wdtype,), (), scheme)
        if len(weight.shape) != 2:
            raise ValueError(f"model: malformed quantized module {module}: weight has shape {list(weight.shape)}")
        n, k = weight.shape
        scale_name = "weight_scale_inv" if scheme.method == "fp8" else "weight_scale"
        if scheme.strategy == "tensor":
            shapes: tuple[tuple[int, ...], ...] = ((), (1,))
        elif scheme.strategy == "channel":
            shapes = ((n, 1), (n,))
        else:
            assert scheme.block is not None
            bn, bk = scheme.block
            shapes = ((-(-n // bn), -(-k // bk)),)
        _want(module, params, scale_name, ("F32",) if scheme.method == "fp8" else _SCALE_DTYPES, shapes, scheme)
        if scheme.activations == "static":
            _want(module, params, "input_scale", _SCALE_DTYPES, ((), (1,)), scheme)
        allowed -= {"weight_packed", "weight_shape", "weight_zero_point",
                    "weight_scale" if scale_name == "weight_scale_inv" else "weight_scale_inv"}
        if scheme.activations != "static":
            allowed.discard("input_scale")
    extra = sorted(set(params) - allowed)
    if extra:
        raise ValueError(f"model: malformed quantized module {module} ({scheme.describe()}): unexpected tensors "
                         f"{', '.join(extra)}")
    if "bias" in params and params["bias"].dtype not in _FLOATS:
        raise ValueError(f"model: malformed quantized module {module}: bias is {params['bias'].dtype}")
    return n, k


def plan_quantization(cfg: Mapping[str, Any], tensors: Mapping[str, TensorInfo],
                      linear: Callable[[str], bool]) -> dict[str, QuantScheme]:
    """Each quantized module of a checkpoint (its name, e.g. ``model.layers.0.self_attn.q_proj``) and its scheme,
    from ``config.json`` (``cfg``) and every tensor's header (``tensors``: name -> :class:`TensorInfo`);
    ``linear(module)`` says whether a module is an ``nn.Linear`` (:func:`is_linear`). ``{}`` for an unquantized
    checkpoint. Pure; raises ``ValueError`` for a scheme :data:`SUPPORTED` lacks, quantized tensors the config does
    not explain (or no config), a module the config quantizes stored unquantized, or a malformed module."""
    qcfg = parse_quant_config(cfg)
    plan: dict[str, QuantScheme] = {}
    for module, params in sorted(_module_params(tensors).items()):
        quantized = quantized_in_files(params)
        if qcfg is None:
            if quantized:
                what = ", ".join(f"{p} ({i.dtype})" for p, i in sorted(params.items()))
                raise ValueError(f"model: {module} holds quantized tensors ({what}) but config.json has no "
                                 f"quantization_config ({_SUPPORTED_TEXT})")
            continue
        is_lin = linear(module)
        scheme = qcfg.scheme_for(module, is_lin) if (is_lin or not qcfg.native) else None
        if scheme is not None and qcfg.native is not None and "weight_scale_inv" not in params and not quantized:
            scheme = None  # native fp8 quantizes what its files say (DeepSeek's lm_head, norms, ... stay bf16)
        if quantized and scheme is None:
            what = ", ".join(f"{p} ({i.dtype})" for p, i in sorted(params.items()))
            raise ValueError(f"model: {module} holds quantized tensors ({what}) that quantization_config "
                             f"{qcfg.method!r} maps to no scheme (ignored, or no group targets it)")
        if scheme is None:
            continue
        if not quantized:
            raise ValueError(f"model: quantization_config {qcfg.method!r} quantizes {module} "
                             f"({scheme.describe()}) but the checkpoint stores it unquantized")
        check_module(module, params, scheme)
        plan[module] = scheme
    return plan
