"""K/V written in place (``shm``): a prefill actor maps the decode actor's KV cache and writes each layer's blocks
straight into the reserved ones. Real workers (tiny model) in this process, real writer / receiver processes for the
failure cases:

- the text equals the socket backend's (torch_dist over gloo), K/V bytes are counted, ``auto`` picks in place;
- with the checksum on, a corrupted write is rejected and the owner recomputes: same text;
- a reservation whose writer was killed (kill -9) expires and frees its blocks; one whose writer is stopped
  (SIGSTOP) stays quarantined past its lease until the writer ends it; a stale epoch is refused;
- a decode peer killed mid-transfer fails the writes to it, quickly, and the writer keeps serving another peer.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.actor.worker_actor import WorkerActor
from cluster.wire.messages import GenerateRequest, ReserveGrant, ReserveRequest
from engine.request.sampling_params import SamplingParams
from cluster.wire.worker_config import WorkerConfig
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.backends.loopback import CacheSpec, ReceiverProcess, WriterProcess
from tests.token_inbox import TokenInbox, texts, token_ids
from tests.worker_pair import eventually, run_request
from tests.factories import EXACT_DTYPE  # noqa: E402

PROMPT = tuple(range(40, 110))
SHM = KVTransferConfig(backend="shm", connect_timeout_s=20, io_timeout_s=20)


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture()
def inbox() -> Iterator[TokenInbox]:
    box = TokenInbox()
    yield box
    box.close()


def _pair(model: str, kv: KVTransferConfig, corrupt_every: int = 0, **cfg: Any) -> tuple[WorkerActor, WorkerActor]:
    config = WorkerConfig(dtype=EXACT_DTYPE, model=model, num_kv_blocks=64, shared_kv=True, **cfg)
    return (WorkerActor("pf", "prefill", config, kv, corrupt_every=corrupt_every),
            WorkerActor("dc", "decode", config, kv))


def _run(prefill: WorkerActor, decode: WorkerActor, inbox: TokenInbox, rid: str, **sampling: Any) -> tuple[Any, Any]:
    return run_request(prefill, decode, inbox, rid, PROMPT, 10, **sampling)


def _eventually(cond: Any, timeout_s: float = 10.0) -> None:
    eventually(cond, timeout_s)


def _counts(decode: WorkerActor) -> dict[str, int]:
    return decode.check_integrity()


def test_in_place_text_equals_the_socket_backend_and_auto_picks_it(model: str, inbox: TokenInbox) -> None:
    pairs = {name: _pair(model, kv) for name, kv in (
        ("gloo", KVTransferConfig(backend="torch_dist", connect_timeout_s=20, io_timeout_s=20)), ("shm", SHM),
        ("auto", KVTransferConfig(backend="auto", connect_timeout_s=20, io_timeout_s=20)))}
    try:
        outs = {}
        for name, (p, d) in pairs.items():
            outs[name] = [_run(p, d, inbox, f"{name}{i}", **s)
                          for i, s in enumerate(({}, {"temperature": 1.0, "seed": 3}))]
        for name in ("shm", "auto"):
            for (got, res), (want, _) in zip(outs[name], outs["gloo"]):
                assert token_ids(got) == token_ids(want) and texts(got) == texts(want)
                assert res.parts_sent > 0 and not res.failed_parts
        for name, (p, d) in pairs.items():
            # stats are a snapshot republished every 0.1 s: wait for one taken after both results were counted
            _eventually(lambda p=p, d=d: d.stats()["kv_bytes_received"] == p.stats()["kv_bytes_sent"] > 0
                        and d.stats()["results_via_channel"] + d.stats()["results_via_ray"] == 2)
            st = d.stats()
            assert st["kv_parts_installed"] > 0 and st["kv_parts_rejected"] == 0
            assert st["results_via_channel"] == 2 and st["results_via_ray"] == 0, name  # no prefilled call made
            assert _counts(d)["reserved"] == 0 and _counts(d)["used"] == 0
        p, d = pairs["auto"]
        assert d.info()["kv_address"].startswith("auto|inplace+shm://")
        assert p.impl.connector.backend.in_place(d.info()["kv_address"])  # same node, probe passed: written in place
    finally:
        for p, d in pairs.values():
            p.shutdown()
            d.shutdown()


def test_an_int8_cache_decodes_alike_in_place_over_a_socket_and_offline(model: str, inbox: TokenInbox) -> None:
    """int8 K/V with per-token scales crosses both backends (the scales with the blocks) and decodes like the offline
    engine with the same cache: each token is rounded once, however the prompt was chunked."""
    from engine import LLM, SamplingParams

    pairs = {name: _pair(model, kv, kv_cache_dtype="int8") for name, kv in (
        ("gloo", KVTransferConfig(backend="torch_dist", connect_timeout_s=20, io_timeout_s=20)), ("shm", SHM))}
    try:
        offline = LLM(model, dtype=EXACT_DTYPE, kv_cache_dtype="int8", num_kv_blocks=64)
        want = offline.generate([list(PROMPT)], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
        for name, (p, d) in pairs.items():
            got, res = _run(p, d, inbox, f"{name}-int8")
            assert token_ids(got) == [list(want)], name
            assert res.parts_sent > 0 and not res.failed_parts
            _eventually(lambda d=d: d.stats()["kv_parts_installed"] > 0)
            assert d.stats()["kv_parts_rejected"] == 0 and _counts(d)["reserved"] == 0
    finally:
        for p, d in pairs.values():
            p.shutdown()
            d.shutdown()


def test_checksummed_in_place_write_that_is_corrupted_is_recomputed(model: str, inbox: TokenInbox) -> None:
    checked = KVTransferConfig(backend="shm", inplace_checksum=True, connect_timeout_s=20, io_timeout_s=20)
    clean, bad = _pair(model, checked), _pair(model, checked, corrupt_every=1)
    try:
        good, _ = _run(*clean, inbox, "c1")
        worse, res = _run(*bad, inbox, "c2")
        assert token_ids(good) == token_ids(worse) and texts(good) == texts(worse)
        _eventually(lambda: bad[1].stats()["recomputes"] == 1 and bad[1].stats()["kv_parts_rejected"] >= 1)
        assert clean[1].stats()["recomputes"] == 0
        for _, d in (clean, bad):
            _eventually(lambda d=d: _counts(d)["reserved"] == 0 and _counts(d)["used"] == 0)
    finally:
        for p, d in (clean, bad):
            p.shutdown()
            d.shutdown()


def _writer(decode: WorkerActor) -> WriterProcess:
    """A writer process whose cache has the decode actor's block shape and dtype."""
    k = decode.impl.engine.kv_layer(0)[0]
    spec = CacheSpec(decode.impl.engine.model_config.num_layers, 8, *k.shape[1:], str(k.dtype).removeprefix("torch."))
    return WriterProcess(KVTransferConfig(backend="shm", name="w"), spec)


def _reserve(decode: WorkerActor, inbox: TokenInbox, rid: str, ttl_s: float) -> ReserveGrant:
    req = GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=4), reply_to=inbox.address)
    return ReserveGrant.from_dict(decode.reserve(ReserveRequest(req, 6, ttl_s=ttl_s).to_dict()))


def _write_one(writer: WriterProcess, grant: ReserveGrant, fingerprint: str) -> None:
    assert writer.call("open", (grant.kv_endpoint, grant.reservation_id, grant.epoch)) is None
    fields = dict(layer=0, token_start=0, token_end=32, request_id=grant.request_id,
                  reservation_id=grant.reservation_id, model_fingerprint=fingerprint, epoch=grant.epoch)
    assert writer.call("write", (grant.kv_endpoint, [0, 1], list(grant.block_ids[:2]), fields))[0] == "done"


def test_quarantine_follows_the_writer_not_the_lease(model: str, inbox: TokenInbox) -> None:
    decode = WorkerActor("dq", "decode", WorkerConfig(dtype=EXACT_DTYPE, model=model, num_kv_blocks=64, shared_kv=True),
                        SHM)
    killed, stopped = _writer(decode), _writer(decode)
    try:
        g1, g2 = _reserve(decode, inbox, "k1", 0.5), _reserve(decode, inbox, "s1", 0.5)
        stale = _reserve(decode, inbox, "e1", 30.0)
        assert "stale" in killed.call("open", (stale.kv_endpoint, stale.reservation_id, stale.epoch - 1))
        _write_one(killed, g1, decode.info()["fingerprint"])
        _write_one(stopped, g2, decode.info()["fingerprint"])
        _eventually(lambda: decode.stats()["kv_parts_installed"] == 2)
        os.kill(killed.process.pid, signal.SIGKILL)
        os.kill(stopped.process.pid, signal.SIGSTOP)
        for rid in ("k1", "s1"):  # both leases run out: their clients get an error
            assert inbox.collect(rid, timeout_s=20)[-1].error
        # the killed writer's blocks are free again; the stopped one's stay held past the lease
        _eventually(lambda: _counts(decode)["quarantined"] == g2.num_blocks)
        assert _counts(decode)["reserved"] == g2.num_blocks + stale.num_blocks
        os.kill(stopped.process.pid, signal.SIGCONT)
        assert stopped.call("end", (g2.kv_endpoint, g2.reservation_id)) is None
        _eventually(lambda: _counts(decode)["quarantined"] == 0)
        assert _counts(decode)["reserved"] == stale.num_blocks
        decode.abort("e1")
        after = _counts(decode)
        assert after["reserved"] == after["used"] == after["quarantined"] == 0
    finally:
        for w in (killed, stopped):
            if w.process.is_alive():
                os.kill(w.process.pid, signal.SIGCONT)
            w.close()
        decode.shutdown()


def test_a_decode_peer_killed_mid_transfer_leaves_the_writer_serving() -> None:
    from kv_transfer import make_backend

    spec = CacheSpec(2, 6, 4, 2, 8, "float32")  # the peers grant every block: 0..5
    peers = [ReceiverProcess(SHM, spec) for _ in range(2)]
    writer = make_backend(KVTransferConfig(backend="shm", name="w"))
    k, v = spec.make(seed=2)[0]
    fields = dict(layer=0, token_start=0, token_end=8, request_id="r", reservation_id="r", model_fingerprint="m")
    try:
        for p in peers:
            unopened = writer.write_part(p.address, k, v, [0, 1], [2, 3], None, **fields)
            assert unopened.wait(10).value == "failed" and "not opened" in unopened.error  # nothing written
            writer.open(p.address, "r", 0)
            assert writer.write_part(p.address, k, v, [0, 1], [2, 3], None, **fields).wait(10).value == "done"
        assert not any(c.any() for c in peers[0].call("caches")[1])  # layer 1: never written
        peers[0].process.kill()
        peers[0].process.join(10)
        t0 = time.monotonic()
        failed = writer.write_part(peers[0].address, k, v, [0, 1], [2, 3], None, **fields)
        assert failed.wait(10).value == "failed" and time.monotonic() - t0 < 5
        assert writer.write_part(peers[1].address, k, v, [0, 1], [4, 5], None, **fields).wait(10).value == "done"
        outside = writer.write_part(peers[1].address, k, v, [0], [6], None, **fields)
        assert outside.wait(10).value == "failed" and "outside" in outside.error
        assert peers[1].call("drain", 2)[0] == 2
    finally:
        writer.close()
        for p in peers:
            p.close()


def test_a_part_that_does_not_fit_the_peers_blocks_is_refused_before_writing() -> None:
    from kv_transfer import make_backend

    spec = CacheSpec(1, 6, 4, 2, 8, "float32")
    peer = ReceiverProcess(SHM, spec)
    writer = make_backend(KVTransferConfig(backend="shm", name="w"))
    fields = dict(layer=0, token_start=0, token_end=8, request_id="r", reservation_id="r", model_fingerprint="m")
    try:
        writer.open(peer.address, "r", 0)
        k, v = CacheSpec(1, 6, 8, 2, 8, "float32").make(seed=1)[0]  # blocks twice as long as the peer's
        wrong = writer.write_part(peer.address, k, v, [0, 1], [2, 3], None, **fields)
        assert wrong.wait(10).value == "failed" and "do not fit" in wrong.error
        k, v = spec.make(seed=1)[0]
        beyond = writer.write_part(peer.address, k, v, [0, 99], [2, 3], None, **fields)  # no source block 99
        assert beyond.wait(10).value == "failed"
        assert not any(c.any() for c in peer.call("caches")[0])  # nothing was written
    finally:
        writer.close()
        peer.close()
