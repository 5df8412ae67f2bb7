"""cuda_ipc across GPUs (issue 27): the exporter's GPU is found by UUID in the writer's own numbering, with fake
``CUDA_VISIBLE_DEVICES`` layouts and no CUDA; a writer that cannot map it falls back, counted by reason in /metrics."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cluster.wire.telemetry import WorkerStats
from kv_transfer.backends.cuda_devices import NO_PEER_ACCESS, NO_UUID, NOT_VISIBLE, Mapped, Unmappable, match_device, normalize_uuid, visible_from_env
from kv_transfer.backends.inplace_channel import InPlaceUnavailable, fallback_reason
from proxy.metrics import Metrics

# a node's four GPUs as nvidia-smi -L writes them; torch prints the same UUIDs without "GPU-", in lower case
NODE = [f"GPU-{i}A2B3C4D-0000-1111-2222-33334444555{i}" for i in range(4)]
A, B = normalize_uuid(NODE[0]), normalize_uuid(NODE[1])


def peers(allowed: set[tuple[int, int]] | None = None) -> Callable[[int, int], bool]:
    """A peer-access predicate: every pair (None), or only the listed (reader, other) pairs."""
    return lambda r, o: allowed is None or (r, o) in allowed


def exported_by(cvd: str | None, index: int) -> str:
    """The UUID a process with ``CUDA_VISIBLE_DEVICES=cvd`` sends for its ``cuda:index`` (torch's spelling)."""
    return normalize_uuid(visible_from_env(cvd, NODE)[index])


def test_uuid_spellings_of_nvml_torch_bytes_and_mig_compare_equal() -> None:
    torch_form = "1a2b3c4d-0000-1111-2222-333344445555"
    for spelling in ("GPU-1A2B3C4D-0000-1111-2222-333344445555", torch_form, f" gpu-{torch_form}\n",
                     "1a2b3c4d000011112222333344445555", bytes.fromhex(torch_form.replace("-", ""))):
        assert normalize_uuid(spelling) == torch_form
    assert normalize_uuid("MIG-1a2b3c4d-0000-1111-2222-333344445555") == torch_form  # a MIG instance's own UUID
    old_mig = "MIG-GPU-1a2b3c4d-0000-1111-2222-333344445555/1/0"  # pre-R470 form: equal only to itself
    assert normalize_uuid(old_mig) == old_mig.lower() != torch_form
    assert normalize_uuid("GPU-not-a-uuid") == "gpu-not-a-uuid"


def test_visible_devices_follow_cudas_filter() -> None:
    assert visible_from_env(None, NODE) == NODE  # unset: every GPU
    assert visible_from_env("", NODE) == []  # set empty: none
    assert visible_from_env("2,0", NODE) == [NODE[2], NODE[0]]  # the order given is the local numbering
    assert visible_from_env(f"{NODE[3][:12]},1", NODE) == [NODE[3], NODE[1]]  # a unique UUID prefix names a GPU
    assert visible_from_env("1,9,2", NODE) == [NODE[1]]  # an entry naming no GPU ends the list (CUDA's rule)
    assert visible_from_env("1,1", NODE) == [NODE[1]]
    assert visible_from_env("GPU-", NODE) == []  # ambiguous: names every GPU, so none


def test_same_gpu_under_another_index_maps_onto_the_writers_own_device() -> None:
    uuid = exported_by("1,0", 0)  # the decode actor's cuda:0 is physical GPU 1 ...
    got = match_device(uuid, visible_from_env("0,1", NODE), 1, peers(set()))  # ... the writer's cuda:1
    assert got == Mapped(exporter_index=1, open_on=1, peer=False)  # no peer access needed: one device
    # the old rule (open the exporter's index) would have opened the writer's cuda:0, another GPU


def test_fractional_gpus_share_one_device_at_index_zero() -> None:
    assert match_device(exported_by("2", 0), visible_from_env("2", NODE), 0, peers(set())) == Mapped(0, 0, False)


def test_one_actor_per_gpu_cannot_map_and_says_why() -> None:
    got = match_device(exported_by("0", 0), visible_from_env("1", NODE), 0, peers())
    assert isinstance(got, Unmappable) and got.reason == NOT_VISIBLE
    assert "device not visible" in got.detail and A in got.detail


@pytest.mark.parametrize("allowed, want", [(None, Mapped(2, 0, True)), (set(), Unmappable(NO_PEER_ACCESS, "")),
                                           ({(2, 0)}, Unmappable(NO_PEER_ACCESS, ""))])
def test_both_visible_on_different_gpus_maps_only_with_peer_access(allowed: set[tuple[int, int]] | None,
                                                                    want: Mapped | Unmappable) -> None:
    uuid = exported_by(None, 2)  # an exporter that sees every GPU, its cache on GPU 2
    got = match_device(uuid, visible_from_env("0,3,2", NODE), 0, peers(allowed))  # the writer on GPU 0
    if isinstance(want, Mapped):
        assert got == want  # opened on the writer's device: the driver gives its context peer access to GPU 2
    else:  # access asked from the writer's device (0) to the exporter's (2), not the reverse
        assert isinstance(got, Unmappable) and got.reason == want.reason and "no peer access" in got.detail


def test_mig_instances_are_matched_by_their_own_uuid() -> None:
    mig = ["MIG-aaaaaaaa-0000-1111-2222-333344445555", "MIG-bbbbbbbb-0000-1111-2222-333344445555"]
    exporter = normalize_uuid(visible_from_env(mig[1], mig)[0])
    assert match_device(exporter, visible_from_env(mig[1][:12], mig), 0, peers()) == Mapped(0, 0, False)
    got = match_device(exporter, visible_from_env(mig[0], mig), 0, peers())  # MIG has no peer access: other slice
    assert isinstance(got, Unmappable) and got.reason == NOT_VISIBLE


def test_missing_uuid_and_a_writer_outside_its_visible_set_fall_back() -> None:
    for uuid in (None, ""):
        got = match_device(uuid, [A, B], 0, peers())
        assert isinstance(got, Unmappable) and got.reason == NO_UUID
    got = match_device(B, [A, B], 5, peers())
    assert isinstance(got, Unmappable) and got.reason == NOT_VISIBLE and "cuda:5" in got.detail
    assert match_device(NODE[1], [A, B], 1, peers(set())) == Mapped(1, 1, False)  # nvidia-smi's spelling works too


def test_fallback_reason_reads_the_cause_chain() -> None:
    def wrapped(inner: BaseException) -> ConnectionError:
        try:
            try:
                raise inner
            except (OSError, RuntimeError) as e:  # as InPlaceBackend._dial wraps what went wrong
                raise ConnectionError(f"in-place channel to x: {e}") from e
        except ConnectionError as outer:
            return outer

    assert fallback_reason(wrapped(InPlaceUnavailable(NOT_VISIBLE, "device not visible"))) == NOT_VISIBLE
    assert fallback_reason(InPlaceUnavailable("other_node", "peer is on node n2")) == "other_node"
    assert fallback_reason(wrapped(RuntimeError("CUDA error: invalid resource handle"))) == "map_failed"
    assert fallback_reason(wrapped(ConnectionRefusedError("refused"))) == "unreachable"


def test_auto_counts_a_fallback_by_reason() -> None:
    from kv_transfer.backends.auto import AutoBackend
    from kv_transfer.wire.config import KVTransferConfig

    auto = AutoBackend(KVTransferConfig(backend="auto", host="127.0.0.1"))
    try:
        peer = "auto|inplace+shm://another-node/pdkv-x|127.0.0.1:1"
        assert auto.route(peer)[0] is auto.socket  # another node: the socket backend, decided without dialing
        auto.route(peer)  # cached: decided once per peer, counted once
        assert auto.fallback_counts() == {"other_node": 1}
    finally:
        auto.close()


def test_fallbacks_reach_stats_and_metrics() -> None:
    s = WorkerStats("p0", "prefill", kv_inplace_fallbacks={NOT_VISIBLE: 2})
    assert WorkerStats.from_dict(s.to_dict()).kv_inplace_fallbacks == {NOT_VISIBLE: 2}
    with pytest.raises(ValueError, match="kv_inplace_fallbacks"):
        WorkerStats("p0", "prefill", kv_inplace_fallbacks={NOT_VISIBLE: "2"})  # type: ignore[dict-item]
    text = Metrics().render(0, {}, fallbacks={"p0": {NOT_VISIBLE: 2, "other_node": 1}, "p1": {}})
    assert "# TYPE pdcluster_kv_inplace_fallbacks_total counter" in text
    assert f'pdcluster_kv_inplace_fallbacks_total{{actor="p0",reason="{NOT_VISIBLE}"}} 2' in text
    assert 'pdcluster_kv_inplace_fallbacks_total{actor="p0",reason="other_node"} 1' in text
    assert "fallbacks" not in Metrics().render(0, {})


def test_the_cuda_readers_use_torchs_uuids_or_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    """The injectable inputs, with torch.cuda faked (no GPU here): properties' UUIDs when torch has them, else
    ``nvidia-smi -L`` filtered by CUDA_VISIBLE_DEVICES, else "" (matches nothing: the writer falls back)."""
    import subprocess
    import types

    import torch

    from kv_transfer.backends import cuda_devices

    class Props:
        def __init__(self, uuid: str | None) -> None:
            if uuid is not None:
                self.uuid = uuid

    uuids: list[str | None] = [A, B.upper()]
    for name, fn in (("device_count", lambda: 2), ("get_device_properties", lambda i: Props(uuids[i])),
                     ("current_device", lambda: 1), ("can_device_access_peer", lambda r, o: False)):
        monkeypatch.setattr(torch.cuda, name, fn)
    cuda_devices.visible_device_uuids.cache_clear()
    try:
        assert cuda_devices.visible_device_uuids() == (A, B) and cuda_devices.device_uuid(1) == B
        assert cuda_devices.resolve({"uuid": NODE[1]}, "cuda") == Mapped(1, 1, False)  # "cuda": the current device
        got = cuda_devices.resolve({"uuid": NODE[0]}, "cuda:1")
        assert isinstance(got, Unmappable) and got.reason == NO_PEER_ACCESS
        uuids[:] = [None, None]  # an old torch: no .uuid
        listing = "\n".join(f"GPU {i}: NVIDIA H200 (UUID: {u})" for i, u in enumerate(NODE))
        monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=listing))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
        cuda_devices.visible_device_uuids.cache_clear()
        assert cuda_devices.visible_device_uuids() == (normalize_uuid(NODE[3]), B)

        def missing(*a: object, **k: object) -> None:
            raise FileNotFoundError("nvidia-smi")

        monkeypatch.setattr(subprocess, "run", missing)
        cuda_devices.visible_device_uuids.cache_clear()
        assert cuda_devices.visible_device_uuids() == ("", "") and cuda_devices.device_uuid(0) == ""
        got = match_device(cuda_devices.device_uuid(0), ("", ""), 0, peers())
        assert isinstance(got, Unmappable) and got.reason == NO_UUID
    finally:
        cuda_devices.visible_device_uuids.cache_clear()
