"""A cluster that fails to start cleans up after itself: no Ray left running, so the next cluster can start."""

from __future__ import annotations

from pathlib import Path

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


def test_a_cluster_on_a_local_ray_leaves_it_up_and_refuses_one_with_anothers_actors(tmp_path: Path) -> None:
    """``Cluster(cfg, local_ray=True)`` (tests: one Ray per module) runs on this process's Ray: a failed start ends
    its own actors but leaves Ray up with every pdcluster name free for the next cluster; a cluster whose actors are
    still there (here, one named like a worker) is refused before anything starts, and nothing of it is ended."""
    from cluster.local_ray import named_actors, start_local_ray
    from cluster.wire.names import NAMESPACE, WORKER_PREFIX

    cfg = ServeConfig(worker=WorkerConfig(model=str(tmp_path / "no-model-here"), kv_cache_gib=0.1), decode=1,
                      prefill=1, port=0)
    with pytest.raises(RuntimeError, match="start this process's Ray first"):
        Cluster(cfg, local_ray=True).start(timeout_s=120)
    start_local_ray(num_cpus=4)
    try:
        with pytest.raises(Exception, match="no-model-here"):
            Cluster(cfg, local_ray=True).start(timeout_s=120)
        assert ray.is_initialized() and named_actors() == []

        @ray.remote(num_cpus=0)
        class Other:
            def ping(self) -> str:
                return "up"

        other = Other.options(name=f"{WORKER_PREFIX}0", namespace=NAMESPACE).remote()  # type: ignore[attr-defined]
        assert ray.get(other.ping.remote()) == "up"
        with pytest.raises(RuntimeError, match=f"another cluster's actors still run on this Ray: .*{WORKER_PREFIX}0"):
            Cluster(cfg, local_ray=True).start(timeout_s=120)
        assert ray.get(other.ping.remote()) == "up"  # the refused cluster ended nothing of the other's
        ray.kill(other)
    finally:
        ray.shutdown()
