"""A cluster that fails to start cleans up after itself: no Ray left running, so the next cluster can start."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402


def test_failed_start_stops_ray_and_names_the_cause(tmp_path) -> None:  # type: ignore[no-untyped-def]
    missing = tmp_path / "no-model-here"
    c = Cluster(ServeConfig(worker=WorkerConfig(model=str(missing), kv_cache_gib=0.1), decode=1, prefill=1, port=0))
    with pytest.raises(Exception) as err:
        c.start(timeout_s=120)
    assert "no-model-here" in str(err.value) or "model" in str(err.value).lower()
    assert not ray.is_initialized()


def test_port_must_leave_room_for_every_proxy() -> None:
    with pytest.raises(ValueError, match="port"):
        ServeConfig(port=65535, proxies=2)
    assert ServeConfig(port=0, proxies=3).port == 0
