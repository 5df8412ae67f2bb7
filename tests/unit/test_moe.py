"""engine/models/moe.py: the grouped expert compute against a per-token loop over every (token, slot), the router's
weights against Hugging Face's semantics, and the arguments refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.moe import ExpertWeights, experts_forward, softmax_topk

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _experts(e: int, h: int, i: int, dtype: torch.dtype, seed: int) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return ExpertWeights(torch.randn(e, 2 * i, h, generator=g).to(dtype) * 0.2,
                         torch.randn(e, h, i, generator=g).to(dtype) * 0.2)


def _per_token(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, ex: ExpertWeights, act: str) -> torch.Tensor:
    """The definition, one (token, slot) at a time, in float32."""
    f = F.silu if act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (ex.gate_up[e].float() @ x[t].float()).chunk(2)
            out[t] += float(w[t, k]) * (ex.down[e].float() @ (f(gate) * up))
    return out


def _route(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return softmax_topk(torch.randn(t, e, generator=g), k, renormalize=bool(seed % 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,e,k,h,i,act", [(1, 5, 2, 24, 20, "silu"), (13, 7, 3, 33, 17, "silu"),
                                           (40, 8, 8, 16, 12, "gelu_pytorch_tanh"), (3, 6, 1, 9, 5, "silu")])
def test_experts_forward_matches_the_per_token_definition(dtype: torch.dtype, t: int, e: int, k: int, h: int, i: int,
                                                          act: str) -> None:
    ex = _experts(e, h, i, dtype, seed=t + e)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(dtype)
    ids, w = _route(t, e, k, seed=t * 7 + k)
    out = experts_forward(x, ids, w, ex, act)
    assert out.dtype == dtype and out.shape == (t, h)
    torch.testing.assert_close(out.float(), _per_token(x, ids, w, ex, act), atol=TOL[dtype], rtol=TOL[dtype])


def test_experts_forward_with_unused_experts_and_int32_ids() -> None:
    ex = _experts(6, 10, 7, torch.float32, seed=3)
    x = torch.randn(4, 10)
    ids = torch.tensor([[5, 0], [0, 5], [5, 0], [0, 5]], dtype=torch.int32)
    w = torch.rand(4, 2)
    torch.testing.assert_close(experts_forward(x, ids, w, ex, "silu"), _per_token(x, ids, w, ex, "silu"))
    assert experts_forward(x[:0], ids[:0], w[:0], ex, "silu").shape == (0, 10)


def test_softmax_topk_weights() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    ids, w = softmax_topk(logits, 2, renormalize=False)
    p = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, p[:, [1, 2]])
    _, wn = softmax_topk(logits.to(torch.bfloat16), 2, renormalize=True)
    assert wn.dtype == torch.float32
    torch.testing.assert_close(wn.sum(-1), torch.ones(1))


def test_arguments_refused_by_name() -> None:
    ex = _experts(4, 8, 6, torch.float32, seed=0)
    x = torch.randn(2, 8)
    ids, w = _route(2, 4, 2, seed=1)
    with pytest.raises(ValueError, match="ExpertWeights: down"):
        ExpertWeights(ex.gate_up, ex.down[:, :, :5])
    with pytest.raises(ValueError, match="activation"):
        experts_forward(x, ids, w, ex, "relu")
    with pytest.raises(ValueError, match="topk_ids"):
        experts_forward(x, ids.float(), w, ex, "silu")
    with pytest.raises(ValueError, match="topk_weights"):
        experts_forward(x, ids, w[:, :1], ex, "silu")
    with pytest.raises(ValueError, match="x"):
        experts_forward(torch.randn(2, 9), ids, w, ex, "silu")
    stacked = ExpertWeights.stack([ex.gate_up[j, :6] for j in range(4)], [ex.gate_up[j, 6:] for j in range(4)],
                                  [ex.down[j] for j in range(4)])
    assert torch.equal(stacked.gate_up, ex.gate_up) and torch.equal(stacked.down, ex.down)
    assert stacked.num_experts == 4 and stacked.intermediate_size == 6
