"""The rotation 8-bit KV caches store K/V in (pdkernels/kv_rotation.py): exact algebra, less int8 error on keys with
outlier channels, and the model writing rotated K/V into an int8 cache and attending through it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdkernels import kv_rotation, reference


@pytest.mark.parametrize(("d", "blocks"), [(1, [1]), (64, [64]), (80, [64, 16]), (96, [64, 32]), (7, [4, 2, 1])])
def test_blocks_are_the_powers_of_two_in_the_head_size(d: int, blocks: list[int]) -> None:
    assert kv_rotation.hadamard_blocks(d) == blocks


def test_a_head_size_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="head size"):
        kv_rotation.hadamard_blocks(0)


@pytest.mark.parametrize("d", [1, 8, 64, 80, 96, 128, 256])
def test_rotation_is_symmetric_orthonormal_and_its_own_inverse(d: int) -> None:
    r = kv_rotation.rotation(d).double()
    assert torch.equal(r, r.T)
    torch.testing.assert_close(r @ r, torch.eye(d, dtype=torch.float64), atol=1e-6, rtol=0)
    assert not torch.equal(r, torch.eye(d, dtype=torch.float64)) or d == 1  # it does move vectors


def test_attention_over_rotated_k_v_equals_attention_over_k_v() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 3, 80, generator=g) for n in (5, 17, 17))
    r = kv_rotation.rotation(80)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = torch.einsum("qhd,khd->hqk", q, k).softmax(-1)
        return torch.einsum("hqk,khd->qhd", p, v)

    plain = attend(q, k, v)
    rotated = kv_rotation.rotate(attend(*(kv_rotation.rotate(t, r) for t in (q, k, v))), r)
    torch.testing.assert_close(rotated, plain, atol=1e-5, rtol=1e-5)


def test_rotate_keeps_the_dtype_and_rounds_once() -> None:
    x = torch.randn(4, 2, 64).to(torch.bfloat16)
    r = kv_rotation.rotation(64)
    y = kv_rotation.rotate(x, r)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (x.float() @ r).to(torch.bfloat16))


def _int8_error(rows: torch.Tensor) -> float:
    q, s = reference.quantize_rows_int8(rows)
    back = q.float() * s[..., None]
    return float((back - rows).norm() / rows.norm())


def test_rotation_cuts_int8_error_on_keys_with_outlier_channels() -> None:
    """Keys whose rows are dominated by two channels (as RoPE's slow pairs make them): the per-row int8 step is
    set by the outlier, so the other channels round coarsely; rotated, the same 8 bits round evenly."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(512, 3, 64, generator=g)
    k[..., 60:62] *= 25.0
    r = kv_rotation.rotation(64)
    plain, rotated = _int8_error(k), _int8_error(kv_rotation.rotate(k, r))
    assert rotated < 0.5 * plain, (plain, rotated)


def _prefill(model: object, runner: object, ids: list[int]) -> None:
    from engine.request.sampling_params import SamplingParams
    from engine.scheduling.scheduler import ScheduledSeq, SchedulerOutput
    from engine.request.sequence import Sequence

    seq = Sequence(0, "p", 0, ids, SamplingParams(), 0.0, block_table=list(range(-(-len(ids) // runner.block_size))))
    out = SchedulerOutput(prefills=[ScheduledSeq(seq, 0, len(ids), sample=False)])
    tok, pos, meta, _, _ = runner.prepare(out)
    with torch.inference_mode():
        hidden = model.forward(tok, pos, meta, runner.kv_caches, None, runner.kv_scale_layers)
    return model.logits(hidden)


def test_the_model_writes_rotated_k_v_into_an_int8_cache_and_attends_through_it(tiny_checkpoint) -> None:
    from engine.models.model import DecoderModel
    from engine.models.model_config import load_model_config
    from engine.models.model_loader import load_state_dict
    from engine.model_runner import ModelRunner

    folder: Path = tiny_checkpoint("qwen2")
    cfg = load_model_config(folder)
    model = DecoderModel(cfg, load_state_dict(folder, torch.float32), torch.float32, 256)
    plain = ModelRunner(model, 8, 16, 0)
    int8 = ModelRunner(model, 8, 16, 0, torch.int8)
    ids = list(range(3, 3 + 40))
    ref_logits, q_logits = _prefill(model, plain, ids), _prefill(model, int8, ids)
    blocks = torch.arange(3)
    r = kv_rotation.rotation(cfg.head_dim)
    for layer in range(cfg.num_layers):
        for which in (0, 1):  # K, V
            want = plain.kv_caches[layer][which].index_select(0, blocks).flatten(0, 1)[:40]
            got = reference.gather_blocks(int8.kv_caches[layer][which], blocks, int8.kv_scale_layers[layer][which],
                                          torch.float32).flatten(0, 1)[:40]
            err = float((kv_rotation.rotate(got, r) - want).norm() / want.norm())
            assert err < 0.02, (layer, which, err)  # int8's rounding, once rotated back
            assert float((got - want).norm() / want.norm()) > 0.2  # what the cache holds is rotated
    # attention reads the rotated cache with rotated queries: the logits stay those of the unquantized cache
    assert float((q_logits - ref_logits).abs().max()) < 0.05 * float(ref_logits.abs().max())
