"""The K/V part header's payload sizes for each cache dtype, and the kv_cache_dtype settings that choose them. Pure."""

from __future__ import annotations

import pytest

from cluster.wire.worker_config import WorkerConfig
from engine.config import EngineConfig
from kv_transfer.wire.header import KVTransferHeader


def _header(dtype: str) -> KVTransferHeader:
    # 3 blocks of 16 tokens, 2 kv heads of 8
    return KVTransferHeader(request_id="r", reservation_id="res", layer=0, token_start=0, token_end=48,
                            block_ids=(4, 5, 6), dtype=dtype, shape=(2, 3, 16, 2, 8), checksum=bytes(16),
                            model_fingerprint="fp")


@pytest.mark.parametrize(("dtype", "values", "scales"), [
    ("bfloat16", 2 * 3 * 16 * 2 * 8 * 2, 0),
    ("float8_e4m3fn", 2 * 3 * 16 * 2 * 8, 2 * 3 * 2 * 4),  # a float32 scale per (K/V, block, kv head)
    ("int8", 2 * 3 * 16 * 2 * 8, 2 * 3 * 16 * 2 * 4),  # a float32 scale per (K/V, block, token, kv head)
])
def test_a_part_carries_its_scales_after_its_values(dtype: str, values: int, scales: int) -> None:
    h = _header(dtype)
    assert h.scales_nbytes == scales and h.payload_nbytes == values + scales


def test_kv_cache_dtype_choices_are_one_list() -> None:
    for choice in ("auto", "fp8", "int8"):
        assert EngineConfig(kv_cache_dtype=choice).kv_cache_dtype == WorkerConfig(kv_cache_dtype=choice).kv_cache_dtype
    for bad in ("int4", "float8"):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineConfig(kv_cache_dtype=bad)
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            WorkerConfig(kv_cache_dtype=bad)
