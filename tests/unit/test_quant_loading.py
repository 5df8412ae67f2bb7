"""Quantized checkpoints through the loader and the engine: each scheme loads into the ``pdkernels.quant`` classes
with exactly the hand-dequantized weights, generates token-for-token as the float32 model of those weights, and every
family refuses an unknown or malformed scheme before reading a weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.models.model import DecoderModel
from engine.models.model_config import load_model_config
from engine.models.model_loader import load_state_dict
from factories import ROOMY_KV_BLOCKS
from pdkernels.quant import Fp8Weight, Int4Weight, Int8Weight
from pdkernels.quant_ref import fp8_activations, quantize_tokens_int8
from quant_factory import LOGPROB_TOL, logprob_tol, quantize_checkpoint, scheme_config, with_config

PROMPTS = [[5, 17, 99, 3, 250, 42], [7] * 3, [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 300, 301]]
MAX_NEW = 12
# every ignore list a family needs so that only what the factory quantizes is targeted (llmcompressor's own examples
# ignore the routers and, here, the experts)
MOE_IGNORE = ("lm_head", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$", "re:.*\\.experts\\.")
FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "gemma3", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2")
CLASSES = {"w8a8": Int8Weight, "w4a16": Int4Weight, "w4a16_asym": Int4Weight, "fp8_dynamic": Fp8Weight,
           "fp8_static": Fp8Weight, "fp8_block": Fp8Weight, "fp8_native": Fp8Weight}
# activations as each scheme quantizes them (pdkernels.quant_ref's definitions), applied to Hugging Face's float32
# model of the dequantized weights: the reference the engine's quantized model must equal (weight-only schemes leave
# the activations alone, so there the reference is the plain dense model). Each takes (x, the module's static
# input scale, the FP8 block's columns).
ACTIVATIONS = {"w8a8": lambda x, s, b: _int8_acts(x), "fp8_dynamic": lambda x, s, b: fp8_activations(x, None, True, None),
               "fp8_static": lambda x, s, b: fp8_activations(x, s, False, None),
               "fp8_block": lambda x, s, b: fp8_activations(x, None, True, b),
               "fp8_native": lambda x, s, b: fp8_activations(x, None, True, b)}


def _int8_acts(x: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_tokens_int8(x)
    return q.float() * scale[:, None]


def _hf_model(dense: Path, scheme: str, block: int = 32, act_scales: dict[str, torch.Tensor] | None = None):  # type: ignore[no-untyped-def]
    """Hugging Face's float32 model of ``dense`` with every ``*_proj*`` linear (but the experts, and MLA's
    ``kv_b_proj``, which the engine dequantizes at load and absorbs into q and the output, as vLLM does) quantizing
    its input as ``scheme`` does (FP8 blocks of ``block`` columns; static scales per module from ``act_scales``, else
    the factory's 0.02)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32).eval()
    act = ACTIVATIONS.get(scheme)
    if act is not None:
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and "_proj" in name.rsplit(".", 1)[-1] and ".experts." not in name \
                    and not name.endswith("kv_b_proj"):
                static = (act_scales or {}).get(name, torch.tensor(0.02)).float().reshape(())

                def forward(x: torch.Tensor, mod: torch.nn.Linear = mod, static: torch.Tensor = static) -> torch.Tensor:
                    xa = act(x.reshape(-1, x.shape[-1]), static, block).reshape(x.shape)
                    return torch.nn.functional.linear(xa, mod.weight, mod.bias)
                mod.forward = forward  # type: ignore[method-assign]
    return model


def hf_reference(dense: Path, scheme: str, prompts: list[list[int]], block: int = 32,
                 act_scales: dict[str, torch.Tensor] | None = None) -> list[tuple[list[int], list[float]]]:
    """Greedy ids and logprobs of :func:`_hf_model`."""
    model = _hf_model(dense, scheme, block, act_scales)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids, lps = list(p), []
            for _ in range(MAX_NEW):
                logits = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
                t = int(logits.argmax())
                ids.append(t)
                lps.append(float(logits[t]))
            outs.append((ids[len(p):], lps))
    return outs


def assert_teacher_forced(dense: Path, scheme: str, got: list[tuple[list[int], list[float]]], tol: float,
                          block: int = 32, act_scales: dict[str, torch.Tensor] | None = None) -> None:
    """Each token the engine chose has, under :func:`_hf_model` fed the same tokens, the logprob the engine gave it
    (within ``tol``) and is the reference's top-1 or within ``2 tol`` of it (a near tie)."""
    model = _hf_model(dense, scheme, block, act_scales)
    with torch.no_grad():
        for p, (ids, lps) in zip(PROMPTS, got):
            ref = model(torch.tensor([p + ids])).logits[0, len(p) - 1: -1].float().log_softmax(-1)
            want = [float(ref[i, t]) for i, t in enumerate(ids)]
            assert lps == pytest.approx(want, abs=tol)
            assert all(float(ref[i].max()) - w <= 2 * tol for i, w in enumerate(want))


def _assert_dequantizes_to(q: Path, dense: Path) -> dict[str, object]:
    """Every tensor of the quantized checkpoint ``q`` loads as the dense one's, quantized weights dequantized
    exactly; returns ``q``'s state."""
    state = load_state_dict(q, torch.float32)
    ref = load_state_dict(dense, torch.float32)
    assert set(state) == set(ref)
    for name, t in state.items():
        assert torch.equal(t if isinstance(t, torch.Tensor) else t.dequantize(torch.float32), ref[name]), name
    return state


def _generate(folder: Path) -> list[tuple[list[int], list[float]]]:
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=64, block_size=8, num_kv_blocks=ROOMY_KV_BLOCKS)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=0))
    return [(o.outputs[0].token_ids, [s[t] for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.parametrize("scheme", list(CLASSES))
def test_scheme_loads_and_generates_as_its_dequantized_weights(tiny_checkpoint, tmp_path: Path, scheme: str) -> None:
    src = tiny_checkpoint("llama")
    q, dense = tmp_path / "q", tmp_path / "dense"
    quantize_checkpoint(src, q, scheme, dense=dense)
    # the loaded classes hold exactly the hand-dequantized weights (scales, nibble order, zero points)
    assert isinstance(_assert_dequantizes_to(q, dense)["model.layers.1.self_attn.k_proj.weight"], CLASSES[scheme])
    for (ids, lps), (ref_ids, ref_lps) in zip(_generate(q), hf_reference(dense, scheme, PROMPTS)):
        assert ids == ref_ids
        assert lps == pytest.approx(ref_lps, abs=logprob_tol(scheme))


def test_w4a16_biases_and_an_ignored_projection_fuse(tiny_checkpoint, tmp_path: Path) -> None:
    """Qwen2's q/k/v biases ride along the quantized fused q|k|v; a v_proj left in float by ``ignore`` is fused
    dense with the others dequantized (the same values)."""
    src = tiny_checkpoint("qwen2")
    q, dense = tmp_path / "q", tmp_path / "dense"
    quantize_checkpoint(src, q, "w4a16_asym", dense=dense,
                        ignore=("lm_head", "model.layers.0.self_attn.v_proj"))
    for (ids, lps), (ref_ids, ref_lps) in zip(_generate(q), hf_reference(dense, "w4a16_asym", PROMPTS)):
        assert ids == ref_ids and lps == pytest.approx(ref_lps, abs=LOGPROB_TOL)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2"])
def test_moe_and_mla_families_run_quantized_attention_and_dense_mlps(tiny_checkpoint, tmp_path: Path,
                                                                     arch: str) -> None:
    """Attention (MLA's fused q_a|kv_a_with_mqa, q_b, o; kv_b dequantized at load) and dense / shared MLPs in W8A8;
    the experts and routers stay float."""
    src = tiny_checkpoint(arch)
    q, dense = tmp_path / "q", tmp_path / "dense"
    quantize_checkpoint(src, q, "w8a8", dense=dense, ignore=MOE_IGNORE)
    _assert_dequantizes_to(q, dense)
    # MLA attends in the absorbed form, whose float32 rounding differs from Hugging Face's by ~1e-5: enough to flip
    # an int8 activation's rounding now and then (one step of a 36-wide row), so the tokens are compared
    # teacher-forced, within 3e-2 (the weights themselves are checked exactly above)
    assert_teacher_forced(dense, "w8a8", _generate(q), logprob_tol("w8a8"))


# dims that W4A16 groups of 8 divide (every in-features a multiple of 8)
EXPERT_CASES = {"qwen3_moe": {"moe_intermediate_size": 32}, "mixtral": {"intermediate_size": 48, "head_dim": 16}}


@pytest.mark.parametrize("arch", list(EXPERT_CASES))
def test_quantized_experts_generate_as_their_dequantized_weights(tiny_checkpoint, tmp_path: Path, arch: str) -> None:
    """Every expert in W4A16 (each its own Int4Weight, grouped by pdkernels.quant_moe) beside quantized attention:
    token for token with the float32 model of the dequantized weights (the routers stay float)."""
    src = tiny_checkpoint(arch, **EXPERT_CASES[arch])
    q, dense = tmp_path / "q", tmp_path / "dense"
    quantize_checkpoint(src, q, "w4a16_asym", dense=dense, group=8, experts=True, ignore=MOE_IGNORE[:3])
    state = _assert_dequantizes_to(q, dense)
    assert any(".experts.0." in n and isinstance(t, Int4Weight) for n, t in state.items())
    for (ids, lps), (ref_ids, ref_lps) in zip(_generate(q), hf_reference(dense, "w4a16_asym", PROMPTS)):
        assert ids == ref_ids and lps == pytest.approx(ref_lps, abs=LOGPROB_TOL)


def test_block_fp8_experts_load_stacked(tiny_checkpoint, tmp_path: Path) -> None:
    """Native block FP8 (DeepSeek-V3 / Qwen3-FP8 style, blocks of 8 here) on every projection and expert: the experts
    are stacked into pdkernels.quant_moe.Fp8BlockExperts (the fused Triton MoE on CUDA), holding exactly the
    dequantized weights, and the model generates."""
    from engine.models.moe_quant import QuantExperts

    src = tiny_checkpoint("qwen3_moe", **EXPERT_CASES["qwen3_moe"])
    q, dense = tmp_path / "q", tmp_path / "dense"
    quantize_checkpoint(src, q, "fp8_native", dense=dense, block=(8, 8), experts=True, ignore=MOE_IGNORE[:3])
    _assert_dequantizes_to(q, dense)
    cfg = load_model_config(q)
    model = DecoderModel(cfg, load_state_dict(q, torch.float32), torch.float32, 64)
    moe = model.layers[0].moe
    assert moe is not None and isinstance(moe.experts, QuantExperts) and moe.experts.fused is not None
    assert all(len(ids) == MAX_NEW for ids, _ in _generate(q))


def _truncate_weights(folder: Path) -> None:
    """Keep the safetensors header (and the few bytes of any ``weight_shape``, which the check reads), drop the rest:
    the file is then shorter than its header says, so opening it to read weights fails."""
    f = folder / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    keep = max((m["data_offsets"][1] for k, m in header.items() if k.endswith(".weight_shape")), default=0)
    f.write_bytes(raw[: 8 + n + keep])
    with pytest.raises(Exception):  # noqa: B017  (safetensors' own error type): reading any weight fails
        load_file(str(f))


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_refuses_an_unknown_scheme_before_reading(tiny_checkpoint, tmp_path: Path, arch: str) -> None:
    src = tiny_checkpoint(arch)
    w3 = scheme_config("w4a16", ["lm_head"])
    w3["config_groups"]["group_0"]["weights"]["num_bits"] = 3
    bad = with_config(src, tmp_path / "w3", w3)
    _truncate_weights(bad)
    with pytest.raises(ValueError, match=r"'compressed-tensors': config group 'group_0' \(format pack-quantized, "
                                         r"weights \{type='int', num_bits=3.* is not supported \(supported: "):
        load_model_config(bad)
    with pytest.raises(ValueError, match="num_bits=3"):
        load_state_dict(bad, torch.float32)
    # quantized tensors with no quantization_config: an int8 weight where a float one was
    name = "model.layers.0.self_attn." + ("kv_a_proj_with_mqa" if arch.startswith("deepseek") else "k_proj")
    shape = load_state_dict(src, torch.float32)[f"{name}.weight"].shape
    silent = with_config(src, tmp_path / "silent", None, tensors={f"{name}.weight": torch.ones(shape, dtype=torch.int8)})
    _truncate_weights(silent)
    with pytest.raises(ValueError, match=f"{name} holds quantized tensors .*I8.* but config.json has no "
                                         "quantization_config"):
        load_state_dict(silent, torch.float32)


def test_malformed_checkpoint_refused_before_reading(tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("llama")
    q = quantize_checkpoint(src, tmp_path / "q", "w4a16")
    bad = with_config(q, tmp_path / "bad", scheme_config("w4a16", ["lm_head"]),
                      drop=("model.layers.1.mlp.down_proj.weight_scale",))
    _truncate_weights(bad)
    with pytest.raises(ValueError, match="malformed quantized module model.layers.1.mlp.down_proj .*no weight_scale"):
        load_state_dict(bad, torch.float32)
    g = scheme_config("w4a16", ["lm_head"], group=48)  # 48 does not divide 64 (hidden) or 128 (intermediate)
    bad2 = with_config(q, tmp_path / "bad2", g)
    _truncate_weights(bad2)
    with pytest.raises(ValueError, match="group_size 48 does not divide the in-features 128"):
        load_state_dict(bad2, torch.float32)


def test_linear_holds_no_dense_copy(tiny_checkpoint, tmp_path: Path) -> None:
    q = quantize_checkpoint(tiny_checkpoint("llama"), tmp_path / "q", "w4a16")
    cfg = load_model_config(q)
    model = DecoderModel(cfg, load_state_dict(q, torch.float32), torch.float32, 64)
    lw = model.layers[0]
    assert isinstance(lw.qkv.quant, Int4Weight) and lw.qkv.weight is None  # type: ignore[union-attr]
    assert lw.qkv.out_features == (4 + 2 + 2) * 16  # type: ignore[union-attr]
    assert isinstance(lw.gate_up.quant, Int4Weight) and isinstance(lw.down.quant, Int4Weight)  # type: ignore[union-attr]
