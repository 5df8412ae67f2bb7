"""One rule for devices (engine/parallel/device_threads.py): every thread that launches device work enters its device first.

CUDA's current device is per thread and a new thread starts on device 0, so an actor on GPU N whose engine loop,
K/V I/O threads or Ray call threads did not enter GPU N would launch their kernels on GPU 0 (issue 43, C2 and C3).
On the CPU the threads below are given a :class:`DeviceThreads` for ``cuda:1`` whose ``set_device`` only records
which thread entered which device (their tensors stay on the CPU): the engine loop, the K/V receiver, torch_dist's
accept / send / receive threads, a rank end of either role, the UCX loop, the in-place threads and a worker actor's
Ray calls (a role flip builds the new role on the calling thread). And a static guard: no bare
``threading.Thread(`` in engine/, kv_transfer/, cluster/loop/ or cluster/actor/, so a new thread cannot skip the rule.
"""

from __future__ import annotations

import ast
import queue
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.parallel.device_threads import DeviceThreads
from kv_transfer import make_backend
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.streams import HostStreams

ROOT = Path(__file__).resolve().parents[2]
GPU1 = torch.device("cuda", 1)


class Entered:
    """A ``set_device`` that records (thread name, device) instead of touching CUDA. Thread-safe."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, torch.device]] = []
        self._lock = threading.Lock()

    def __call__(self, device: torch.device) -> None:
        with self._lock:
            self.calls.append((threading.current_thread().name, device))

    def threads(self) -> DeviceThreads:
        return DeviceThreads(GPU1, self)

    def names(self) -> set[str]:
        with self._lock:
            assert {d for _, d in self.calls} <= {GPU1}, self.calls
            return {n for n, _ in self.calls}


def test_a_thread_enters_its_device_before_its_target_runs_and_nothing_on_the_cpu() -> None:
    entered = Entered()
    seen: list[list[tuple[str, torch.device]]] = []
    entered.threads().start(lambda x: seen.append(list(entered.calls) + [x]), "worker", ("ran",)).join(5)
    assert seen == [[("worker", GPU1), "ran"]]  # entered first, on the thread itself
    cpu = Entered()
    DeviceThreads("cpu", cpu).start(lambda: None, "cpu-worker").join(5)
    DeviceThreads("cpu", cpu).enter()
    assert cpu.calls == []  # a CPU actor behaves as before: no CUDA call at all


def test_the_engine_loop_thread_enters_the_engines_device() -> None:
    from cluster.loop.engine_loop import EngineLoop

    class Loop(EngineLoop):
        role = "decode"

        def _step(self) -> bool:
            return False

        def _idle(self) -> bool:
            return True

        def _publish_stats(self) -> None:
            pass

    entered = Entered()
    loop = Loop("a1", SimpleNamespace(device=torch.device("cpu")), threads=entered.threads())
    loop._start_loop()
    try:
        assert loop.call(lambda: threading.current_thread().name) == "decode-a1"
    finally:
        loop.shutdown()
    assert entered.calls[0] == ("decode-a1", GPU1)


def _ctx(notices: queue.Queue[Any]) -> Any:
    """A follower rank's context (engine/parallel/tp_follower.RankContext's fields), its cache on the CPU."""
    return SimpleNamespace(rank=1, size=2, cfg=SimpleNamespace(cache_heads=2), head_start=0,
                           caches=[torch.zeros(2, 4, 4, 2, 8)], scales=None, notify=notices.put, next_command=None)


def test_kv_threads_enter_their_device() -> None:
    """The decode actor's receiver and its torch_dist endpoint, a sender's pair, both rank ends, in-place threads."""
    from kv_transfer.connector.rank_ends import RankEnd
    from kv_transfer.connector.receiver import KVReceiver
    from kv_transfer.wire.layer_parts import pack_layer_part

    entered = Entered()
    streams = HostStreams(entered.threads())
    caches = torch.zeros(1, 2, 4, 4, 2, 8)  # one layer of 4 blocks of 4 tokens, 2 heads of 8
    engine = SimpleNamespace(kv_memory=lambda: (caches, None, None), kv_layer=lambda i: caches[i],
                             kv_layer_scales=lambda i: None, fingerprint="fp",
                             model_config=SimpleNamespace(kv_layout="kv"))
    receiver = KVReceiver(engine, KVTransferConfig(backend="torch_dist", name="d", host="127.0.0.1"),
                          threading.Lock(), SimpleNamespace(get=lambda rid: None), lambda rec: None, streams=streams)
    sender = make_backend(KVTransferConfig(backend="torch_dist", name="p", host="127.0.0.1"), streams=streams)
    notices: queue.Queue[Any] = queue.Queue()
    ends = [RankEnd(_ctx(notices), role, KVTransferConfig(backend="torch_dist", name=f"r-{role}", host="127.0.0.1"),
                    streams=streams) for role in ("decode", "prefill")]
    try:
        header, payload = pack_layer_part(caches[0, 0], caches[0, 1], [0], [1], layer=0, token_start=0, token_end=4,
                                          request_id="r", reservation_id="rsv", model_fingerprint="fp")
        assert sender.send(receiver.address, header, payload).wait(30).name == "DONE"
    finally:
        for end in ends:
            end.close()
        sender.close()
        receiver.close()
    names = entered.names()
    assert {"kv-receiver", "kv-accept", "kv-rank-receiver", "kv-rank-sends"} <= names, names
    assert any(n.startswith("kv-send-") for n in names) and any(n.startswith("kv-recv-") for n in names), names


def test_in_place_threads_enter_their_device() -> None:
    from engine.kv.kv_memory import KVLayout, SharedKVMemory
    from kv_transfer.backends.inplace import InPlaceBackend

    entered = Entered()
    layout = KVLayout(1, 4, 4, 2, 8, "float32")
    mem = SharedKVMemory(layout)
    decode = InPlaceBackend(KVTransferConfig(backend="shm", name="d"), HostStreams(entered.threads()))
    decode.export_cache(mem.kv, mem.scales, mem)
    decode.set_writer_hooks(lambda w, r, e, n: (0, 1, 2, 3), lambda w, r: None, lambda w: None)
    writer = InPlaceBackend(KVTransferConfig(backend="shm", name="w"), HostStreams(entered.threads()))
    try:
        address = decode.listen()
        writer.open(address, "rsv", 0)
        src = torch.randn(2, 4, 4, 2, 8)
        handle = writer.write_part(address, src[0], src[1], [0], [1], None, layer=0, token_start=0, token_end=4,
                                   request_id="r", reservation_id="rsv", model_fingerprint="fp")
        assert handle.wait(10).name == "DONE", handle.error
    finally:
        writer.close()
        decode.close()
        mem.close()
    assert {"kv-inplace-accept", "kv-inplace-writer", "kv-inplace-notify"} <= entered.names()


def test_the_ucx_loop_enters_its_device() -> None:
    from kv_transfer.backends.ucx import ucx_unavailable_reason

    if ucx_unavailable_reason() is not None:
        pytest.skip(ucx_unavailable_reason())
    from kv_transfer.backends.ucx import UCXBackend

    entered = Entered()
    backend = UCXBackend(KVTransferConfig(backend="ucx", name="u", host="127.0.0.1"), HostStreams(entered.threads()))
    backend.close()
    assert "kv-ucx-loop" in entered.names()


def test_a_worker_actors_ray_calls_enter_its_device(tiny_checkpoint: Any) -> None:
    """Ray runs an actor's calls on threads of its own (device 0 on CUDA): each call that may launch device work
    enters the actor's device first; a flip builds the new role (and a decoder's graphs) on that thread."""
    from cluster.actor.worker_actor import WorkerActor
    from cluster.wire.worker_config import WorkerConfig

    entered = Entered()
    config = WorkerConfig(model=str(tiny_checkpoint("llama")), device="cpu", num_kv_blocks=32, max_num_seqs=4)
    actor = WorkerActor("w", "prefill", config, KVTransferConfig(backend="fake", name="w"), threads=entered.threads())
    try:
        def ray_calls() -> None:
            actor.drain()
            actor.flip("decode")  # builds the decode role here (DecodeWorker enables the engine's decode graphs)
            actor.abort("nobody")

        t = threading.Thread(target=ray_calls, name="ray-call")  # what Ray's threaded actor pool is
        t.start()
        t.join(60)
        assert actor.role == "decode"
    finally:
        actor.shutdown()
    calls = [n for n, _ in entered.calls if n == "ray-call"]
    assert len(calls) == 3, entered.calls  # drain, flip, abort: each entered before it ran
    assert entered.calls[0] == ("MainThread", GPU1)  # and the constructing thread, which loads the engine


# -- the static guard -----------------------------------------------------------------------------------------------
THREADED = ("engine", "kv_transfer", "cluster/loop", "cluster/actor")
HELPER = ROOT / "engine" / "parallel" / "device_threads.py"
BARE = {"Thread", "ThreadPoolExecutor", "Timer"}  # a thread started outside the helper would skip its device


def bare_thread_starts(root: Path = ROOT) -> list[str]:
    """``file:line`` of each ``threading.Thread(`` (or ``Thread(``, a ``ThreadPoolExecutor(``, a ``Timer(``) in
    the packages whose threads launch device work, outside engine/parallel/device_threads.py. Pure (reads the files)."""
    found = []
    for folder in THREADED:
        for path in sorted((root / folder).rglob("*.py")):
            if path == HELPER:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name in BARE:
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_thread_starts_outside_the_device_helper() -> None:
    found = bare_thread_starts()
    assert found == [], ("start threads through engine.parallel.device_threads.DeviceThreads (a thread starts on CUDA device "
                         "0): " + ", ".join(found))


def test_the_guard_names_a_bare_thread(tmp_path: Path) -> None:
    (tmp_path / "kv_transfer").mkdir()
    (tmp_path / "kv_transfer" / "x.py").write_text("import threading\n\nthreading.Thread(target=print).start()\n")
    assert bare_thread_starts(tmp_path) == ["kv_transfer/x.py:3"]
