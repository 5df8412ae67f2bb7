"""The torch_dist rendezvous admits only cluster members (kv_transfer.wire.store_auth): in one process over real TCPStores
and gloo, a join written without the cluster secret, a member's join copied under another ticket, and a pair
rendezvous spoken with another key are refused and counted, while members still pair and move a part. ~15 s here."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import msgpack
import pytest
import torch
import torch.distributed as dist

from cluster.wire.auth import ClusterSecret
from kv_transfer import make_backend
from kv_transfer.wire.base import TransferState
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import KVTransferHeader
from kv_transfer.wire.store_auth import AuthenticatedStore, StoreValueRefused
from kv_transfer.backends.torch_dist_pairs import RECEIVER, SENDER, pair_groups

SECRET = ClusterSecret.generate()
OTHER = ClusterSecret.generate()
TIMEOUT = datetime.timedelta(seconds=5)


def _config(secret: ClusterSecret | None, name: str) -> KVTransferConfig:
    return KVTransferConfig(backend="torch_dist", name=name, host="127.0.0.1", connect_timeout_s=5, io_timeout_s=10,
                            recv_buffer_bytes=1 << 16, num_recv_buffers=2, secret=secret)


def _stores() -> tuple[dist.TCPStore, dist.TCPStore, str]:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=TIMEOUT)
    return master, client, f"127.0.0.1:{master.port}"


def _eventually(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_store_values_are_bound_to_key_address_and_secret() -> None:
    master, client, address = _stores()
    refused: list[str] = []
    store = AuthenticatedStore(master, SECRET, address, refused.append)
    store.set("k", b"value")
    assert store.get("k") == b"value" and client.get("k") != b"value"  # stored with its MAC
    client.set("forged", b"value")  # written without the secret
    client.set("copied", client.get("k"))  # a genuine value under another key
    for key, reader in (("forged", store), ("copied", store),
                        ("k", AuthenticatedStore(client, SECRET, "127.0.0.1:1")),  # another store's address
                        ("k", AuthenticatedStore(client, OTHER, address))):  # another cluster's secret
        with pytest.raises(StoreValueRefused):
            reader.get(key)
    assert refused == ["forged", "copied"]


def _part(n: int) -> tuple[KVTransferHeader, torch.Tensor]:
    payload = torch.arange(2 * n * 16 * 2 * 4, dtype=torch.float32).view(2, n, 16, 2, 4)
    header = KVTransferHeader("req", "res", 0, 0, 16 * n, tuple(range(n)), "float32", tuple(payload.shape), None,
                              "fp")
    return header, payload


def test_a_join_without_the_secret_is_refused_and_members_still_pair() -> None:
    receiver = make_backend(_config(SECRET, "decode"))
    address = receiver.listen()
    raw = dist.TCPStore("127.0.0.1", int(address.rpartition(":")[2]), is_master=False, timeout=TIMEOUT)
    member = make_backend(_config(SECRET, "prefill"))
    outsider = make_backend(_config(OTHER, "mallory"))  # runs the real code, with another cluster's secret
    try:
        ticket = raw.add("pdkv/joins", 1)  # a forged join: a plain write of the join's format
        raw.set(f"pdkv/join/{ticket}", msgpack.packb({"name": "mallory"}))
        _eventually(lambda: receiver.unauthenticated == 1)
        member.connect(address)  # a member pairs (the next ticket) ...
        handle = member.send(address, *_part(2))
        got = receiver.recv(10)
        assert got is not None and got.state is TransferState.DONE and handle.wait(10) is TransferState.DONE
        receiver.release(got)
        genuine = raw.get("pdkv/join/2")  # ... and its join, copied under a fresh ticket, is refused
        raw.set(f"pdkv/join/{raw.add('pdkv/joins', 1)}", genuine)
        _eventually(lambda: receiver.unauthenticated == 2)
        with pytest.raises(ConnectionError):  # another cluster's member: its join is refused, its rendezvous waits
            outsider.connect(address)  # for a receiving end that never comes, and times out
        _eventually(lambda: receiver.unauthenticated == 3)
        assert len(receiver._receivers) == 1  # type: ignore[attr-defined]  # the member's pair only
        assert sum("join refused" in e for e in receiver.peer_errors.values()) == 3, receiver.peer_errors
        handle = member.send(address, *_part(1))  # the member's pair is unaffected
        got = receiver.recv(10)
        assert got is not None and got.state is TransferState.DONE and handle.wait(10) is TransferState.DONE
        receiver.release(got)
    finally:
        for b in (outsider, member, receiver):
            b.close()


def test_a_pair_rendezvous_spoken_without_the_secret_is_not_built() -> None:
    """The receiving end of a pair against a sending end whose store writes carry another key (one that raced a
    member for the pair's keys): each end refuses the other's values and no group is built; members' ends pair."""

    def rendezvous(pair: str, secrets: tuple[ClusterSecret, ClusterSecret]) -> tuple[list[object], list[str]]:
        master, client, address = _stores()
        refused: list[str] = []
        results: list[object] = [None, None]
        ends = [(AuthenticatedStore(master, secrets[0], address, refused.append), RECEIVER),
                (AuthenticatedStore(client, secrets[1], address), SENDER)]

        def run(i: int) -> None:
            try:
                results[i] = pair_groups(ends[i][0], pair, ends[i][1], _config(secrets[i], f"end{i}"))
            except Exception as e:  # gloo's set-up fails on the store's raised error
                results[i] = e
        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return results, refused

    results, refused = rendezvous("pair7", (SECRET, OTHER))
    assert all(isinstance(r, Exception) for r in results), results
    assert "StoreValueRefused" in str(results[0]) or "MAC" in str(results[0]), results[0]
    assert refused and all(k.startswith("pdkv/pair7/") for k in refused)
    results, refused = rendezvous("pair8", (SECRET, SECRET))
    assert all(isinstance(r, tuple) for r in results) and not refused
