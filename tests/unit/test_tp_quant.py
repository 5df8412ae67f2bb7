"""Tensor parallelism over a quantized checkpoint: each rank's weights are the classes' own row / column slices
(engine/models/tp.py ``take_weight``), and a TP group gives the unsharded quantized model's hidden states and logits
(weight-only W4A16: to reduction-order rounding; W8A8: each row-parallel rank quantizes its slice of the activations
per token, as vLLM does, so within that rounding: ~3-6% of the largest value on these tiny models)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.model_config import load_model_config
from engine.models.model_loader import load_shard, load_state_dict
from engine.models.tp import shard_state
from quant_factory import quantize_checkpoint
from test_tp_shard import _close, _run

# (arch, overrides, TP size)
CASES = {"llama-mha": ("llama", {"num_key_value_heads": 4}, 2), "qwen2-gqa-bias": ("qwen2", {}, 2),
         # quantized experts cut on their intermediate like dense ones (groups of 8 within each rank's 16 columns)
         "qwen3_moe-experts": ("qwen3_moe", {"moe_intermediate_size": 32, "head_dim": 16, "intermediate_size": 96}, 2)}


@pytest.mark.parametrize(("scheme", "rel"), [("w4a16", 1e-4), ("w4a16_asym", 1e-4), ("w8a8", 1e-1)])
@pytest.mark.parametrize("case", list(CASES))
def test_tp_forward_of_a_quantized_checkpoint_equals_tp1(tiny_checkpoint, tmp_path: Path, case: str, scheme: str,
                                                         rel: float) -> None:
    arch, overrides, size = CASES[case]
    moe = arch == "qwen3_moe"
    q = quantize_checkpoint(tiny_checkpoint(arch, **overrides), tmp_path / "q", scheme, group=8 if moe else 16,
                            experts=moe, ignore=("lm_head", "re:.*mlp\\.gate$") if moe else ("lm_head",))
    one, tp = _run(q, 1), _run(q, size)
    assert one.models[0].layers[0].qkv.quant is not None
    assert any(lw.down is not None and lw.down.quant is not None for lw in tp.models[1].layers)
    for step, (want_h, want_l) in enumerate(one.outputs[0]):
        for r in range(size):
            _close(tp.outputs[r][step][0], want_h, rel, f"rank {r} step {step} hidden")
            _close(tp.outputs[r][step][1], want_l, rel, f"rank {r} step {step} logits")


def test_load_shard_of_a_quantized_checkpoint_is_the_cut_of_the_whole(tiny_checkpoint, tmp_path: Path) -> None:
    q = quantize_checkpoint(tiny_checkpoint("qwen2"), tmp_path / "q", "w4a16_asym", group=16)
    cfg = load_model_config(q)
    _, whole = shard_state(cfg, load_state_dict(q, torch.float32), 1, 2)
    part = load_shard(q, cfg, torch.float32, 1, 2)
    assert set(part.tensors) == set(whole)
    for name, t in part.tensors.items():
        w = whole[name]
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, w), name
        else:
            assert torch.equal(t.dequantize(torch.float32), w.dequantize(torch.float32)), name  # type: ignore[attr-defined]
    down = part.tensors["model.layers.0.mlp.down_proj.weight"]
    assert (down.out_features, down.in_features) == (64, 64)  # type: ignore[attr-defined]  # 128 columns halved


def test_a_cut_through_a_quantization_group_is_refused(tiny_checkpoint, tmp_path: Path) -> None:
    # groups of 64 columns: o_proj's 64 inputs (4 heads x 16) split into 2 x 32 would cut every group in two
    q = quantize_checkpoint(tiny_checkpoint("qwen2"), tmp_path / "q", "w4a16", group=64)
    with pytest.raises(ValueError, match="group"):
        load_shard(q, load_model_config(q), torch.float32, 0, 2)
