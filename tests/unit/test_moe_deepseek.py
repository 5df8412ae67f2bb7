"""DeepSeek's grouped top-k router (engine/models/moe_deepseek.py) against transformers' DeepseekV3TopkRouter and
DeepseekV2TopkRouter on random logits: the same experts per token and the same weights (float32), for V3's
noaux_tc with and without norm_topk_prob, V2's greedy and group_limited_greedy."""

from __future__ import annotations

import pytest
import torch

from engine.models.deepseek_config import DeepseekMoEConfig
from engine.models.moe_deepseek import grouped_topk


def _sorted(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize(("experts", "groups", "keep", "k", "norm"), [(32, 8, 3, 6, True), (12, 4, 2, 3, False),
                                                                      (9, 3, 1, 2, True)])
def test_v3_noaux_tc_matches_transformers(experts: int, groups: int, keep: int, k: int, norm: bool) -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_cfg = DeepseekV3Config(hidden_size=24, n_routed_experts=experts, n_group=groups, topk_group=keep,
                              num_experts_per_tok=k, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(hf_cfg)
    g = torch.Generator().manual_seed(experts)
    with torch.no_grad():
        router.weight.normal_(generator=g)
        router.e_score_correction_bias.uniform_(-0.5, 0.5, generator=g)
    x = torch.randn(50, 24, generator=g)
    _, hf_w, hf_ids = router(x)
    cfg = DeepseekMoEConfig(experts, 1, k, 8, groups, keep, "noaux_tc", 2.5, norm, 0)
    ids, w = grouped_topk(x @ router.weight.detach().t(), cfg, router.e_score_correction_bias)
    (a, wa), (b, wb) = _sorted(ids, w), _sorted(hf_ids, hf_w.detach())
    assert torch.equal(a, b)
    torch.testing.assert_close(wa, wb, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("method", "groups", "keep"), [("greedy", 1, 1), ("group_limited_greedy", 4, 2)])
def test_v2_softmax_routers_match_transformers(method: str, groups: int, keep: int) -> None:
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    hf_cfg = DeepseekV2Config(hidden_size=24, num_attention_heads=4, n_routed_experts=16, n_group=groups, topk_group=keep,
                              num_experts_per_tok=3, topk_method=method, routed_scaling_factor=1.3)
    router = DeepseekV2TopkRouter(hf_cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.normal_(generator=g)
    x = torch.randn(40, 24, generator=g)
    _, hf_w, hf_ids = router(x)
    cfg = DeepseekMoEConfig(16, 2, 3, 8, groups, keep, method, 1.3, False, 0)
    ids, w = grouped_topk(x @ router.weight.detach().t(), cfg, None)
    (a, wa), (b, wb) = _sorted(ids, w), _sorted(hf_ids, hf_w.detach())
    assert torch.equal(a, b)
    torch.testing.assert_close(wa, wb, rtol=1e-6, atol=1e-7)
