"""Which address endpoints bind and advertise: ``cluster.wire.node`` and ``KVTransferConfig.resolved``."""

from __future__ import annotations

import pytest

from cluster.launcher import ServeConfig
from cluster.wire.node import NODE_IP_ENV, advertised, is_wildcard, node_ip
from cluster.wire.worker_config import WorkerConfig
from kv_transfer.wire.config import KVTransferConfig


def test_node_ip_explicit_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_IP_ENV, "10.1.2.3")
    assert node_ip() == "10.1.2.3"
    assert advertised("0.0.0.0") == "10.1.2.3" and advertised("127.0.0.1") == "127.0.0.1"


@pytest.mark.parametrize("unset", ["", "  "])
def test_node_ip_without_ray_is_loopback(monkeypatch: pytest.MonkeyPatch, unset: str) -> None:
    monkeypatch.setenv(NODE_IP_ENV, unset)  # blank counts as unset
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray is initialized in this test process")
    assert node_ip() == "127.0.0.1"


def test_wildcards() -> None:
    assert all(is_wildcard(h) for h in ("0.0.0.0", "::", "[::]", ""))
    assert not any(is_wildcard(h) for h in ("127.0.0.1", "10.0.0.1", "::1"))


def test_kv_host_resolves_where_the_endpoint_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = KVTransferConfig()
    assert cfg.host is None  # one config for actors on any node
    monkeypatch.setenv(NODE_IP_ENV, "10.9.8.7")
    assert cfg.resolved().host == "10.9.8.7"
    assert cfg.resolved().resolved() == cfg.resolved()
    explicit = KVTransferConfig(host="127.0.0.1")
    assert explicit.resolved() is explicit  # an explicit host wins


@pytest.mark.parametrize("bad", ["", "0.0.0.0", "::"])
def test_kv_host_must_be_dialable(bad: str) -> None:
    with pytest.raises(ValueError, match="host"):
        KVTransferConfig(host=bad)
    with pytest.raises(ValueError, match="kv_host"):
        ServeConfig(kv_host=bad)


@pytest.mark.parametrize("kwargs,field", [
    ({"worker": WorkerConfig(device="cuda"), "gpus_per_actor": 0.0}, "gpus_per_actor"),  # an actor Ray gave no GPU
    ({"worker": WorkerConfig(device="cpu"), "kv_backend": "cuda_ipc"}, "kv_backend"),
    ({"worker": WorkerConfig(device="cuda"), "gpus_per_actor": 0.5, "kv_backend": "shm"}, "kv_backend"),
    ({"corrupt_kv_every": 3, "kv_backend": "shm"}, "corrupt_kv_every"),  # undetectable without the checksum
])
def test_serve_config_refuses_devices_and_backends_that_do_not_fit(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ServeConfig(**kwargs)


def test_serve_config_auto_puts_cpu_caches_in_shared_memory() -> None:
    assert ServeConfig().kv_backend == "auto" and ServeConfig().worker.shared_kv
    assert not ServeConfig(kv_backend="torch_dist").worker.shared_kv
    assert ServeConfig(worker=WorkerConfig(device="cuda"), gpus_per_actor=0.5).kv_backend == "auto"
