"""torch_dist failure isolation, through gloo pairs and real processes: a sending peer killed by its pid in the
middle of a transfer fails only that transfer, within the pair timeout, and the receiving end keeps serving
(kv_transfer/backends/torch_dist_groups.py). The control flow is the NCCL one; on the CPU gloo carries the payload."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kv_transfer.wire.base import TransferState, as_bytes
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.backends.torch_dist import TorchDistBackend
from kv_transfer.backends.torch_dist_groups import pair_groups
from kv_transfer.backends.torch_dist_pairs import RECEIVER, SENDER
from tests.kv_peer import peer_main, sample_part

PAIR_TIMEOUT_S = 2.0


class Peer:
    """A spawned :func:`peer_main` process; killed by its pid (never by name) when the test ends."""

    def __init__(self, address: str, name: str, mode: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=peer_main, args=(address, name, mode, child), daemon=True)
        self.process.start()

    def reply(self, timeout_s: float = 60.0) -> object:
        assert self.conn.poll(timeout_s), f"peer {self.process.pid} did not answer in {timeout_s} s"
        return self.conn.recv()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, sig)

    def end(self) -> None:
        self.kill(signal.SIGKILL)  # also ends a stopped process
        self.process.join(10)


@pytest.fixture
def receiver() -> Iterator[TorchDistBackend]:
    """The surviving end: one receive buffer (so "taken" is observable), a short pair timeout, the default 120 s
    io_timeout_s (what a stalled peer cost before pair_timeout_s)."""
    backend = TorchDistBackend(KVTransferConfig(name="decode", host="127.0.0.1", num_recv_buffers=1,
                                                recv_buffer_bytes=1 << 16, pair_timeout_s=PAIR_TIMEOUT_S))
    backend.listen()
    yield backend
    backend.close()


def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stalled"])
def test_peer_lost_mid_transfer_fails_only_its_pair(receiver: TorchDistBackend, sig: int) -> None:
    """SIGKILL: the peer's sockets close (gloo sees it at once). SIGSTOP: they stay open, as with a peer whose NCCL
    kernel never arrives or whose host vanished: only the pair timeout ends the wait (before it, 120 s)."""
    address = receiver.listen()
    victim = Peer(address, "victim", "stall")
    try:
        assert victim.reply() == "posted"
        wait_until(lambda: not receiver.recv_side.has_free_buffer(), 20, "the announced payload takes the buffer")
        assert receiver.receiving_peers() == ["victim"]
        t0 = time.monotonic()
        victim.kill(sig)
        handle = receiver.recv(PAIR_TIMEOUT_S + 8)
        elapsed = time.monotonic() - t0
        assert handle is not None, f"the transfer did not fail within {PAIR_TIMEOUT_S + 8} s"
        assert handle.state is TransferState.FAILED and "victim" in handle.error
        assert handle.header is not None and handle.header.request_id == "req-6"  # the header had come in
        assert elapsed < PAIR_TIMEOUT_S + 6, elapsed
        assert receiver.recv_side.has_free_buffer()  # the buffer is back in the pool
        wait_until(lambda: receiver.receiving_peers() == [], 5, "the dead pair is dropped")
        assert "victim" in receiver.peer_errors

        # the survivor serves: a new peer connects (a new ticket, a new pair) and its part arrives whole
        fresh = Peer(address, "fresh", "send")
        try:
            got = receiver.recv(60)
            assert got is not None and got.state is TransferState.DONE, got
            header, payload = sample_part(seed=len("fresh"))
            assert got.header.request_id == header.request_id
            assert torch.equal(got.raw.cpu(), as_bytes(payload))
            receiver.release(got)
            assert fresh.reply() == ("done", None)
            assert receiver.recv_side.has_free_buffer() and receiver.receiving_peers() == ["fresh"]
        finally:
            fresh.conn.send("close")
            fresh.process.join(20)
            fresh.end()
    finally:
        victim.end()


def test_pair_groups_carry_the_configured_timeout() -> None:
    """Both ends' groups get config.pair_timeout (pair_timeout_s capped at io_timeout_s), not torch's defaults nor
    connect_timeout_s."""
    timeout = datetime.timedelta(seconds=20)
    master = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    # one store client per end: a blocked store wait of one end must not hold up the other's writes
    stores = {RECEIVER: master,
              SENDER: torch.distributed.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timeout)}
    configs = {RECEIVER: KVTransferConfig(name="r", host="127.0.0.1", pair_timeout_s=7.5, connect_timeout_s=20),
               SENDER: KVTransferConfig(name="s", host="127.0.0.1", pair_timeout_s=50, io_timeout_s=9)}
    groups: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def build(rank: int) -> None:
        try:
            groups[rank] = pair_groups(stores[rank], "pair-t", rank, configs[rank])
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=build, args=(rank,)) for rank in (RECEIVER, SENDER)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert groups[RECEIVER][1].options._timeout == datetime.timedelta(seconds=7.5)
    assert groups[SENDER][1].options._timeout == datetime.timedelta(seconds=9)  # capped at io_timeout_s
    assert groups[RECEIVER][2] is groups[RECEIVER][1]  # on the CPU the control group carries the payload too


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stalled"])
def test_receiver_lost_fails_only_the_senders_pair(sig: int) -> None:
    """The other direction: a decode actor killed or stalled fails the prefill side's sends to it within the pair
    timeout (stalled: before it, io_timeout_s); the sender drops the pair and sends to a new receiver."""
    from kv_transfer.backends.loopback import ReceiverProcess
    from tests.kv_peer import SPEC

    sender = TorchDistBackend(KVTransferConfig(name="prefill", host="127.0.0.1", pair_timeout_s=PAIR_TIMEOUT_S,
                                               connect_timeout_s=10))
    dead = ReceiverProcess(KVTransferConfig(name="decode", host="127.0.0.1", num_recv_buffers=1), SPEC)
    fresh = None
    try:
        header, payload = sample_part(seed=1)
        sender.connect(dead.address)
        assert sender.sending_peers() == [dead.address]
        os.kill(dead.process.pid, sig)
        t0 = time.monotonic()
        # a first send may still land in the kernel's socket buffer of a dead TCP peer: send until one fails
        states = []
        while TransferState.FAILED not in states and time.monotonic() - t0 < PAIR_TIMEOUT_S + 8:
            states.append(sender.send(dead.address, header, payload).wait(PAIR_TIMEOUT_S + 8))
        assert TransferState.FAILED in states, states
        assert time.monotonic() - t0 < PAIR_TIMEOUT_S + 6
        assert sender.sending_peers() == []

        fresh = ReceiverProcess(KVTransferConfig(name="decode-2", host="127.0.0.1"), SPEC)
        assert sender.send(fresh.address, header, payload).wait(30) is TransferState.DONE
        assert fresh.call("drain", 1) == (1, payload.numel() * payload.element_size())
        assert sender.sending_peers() == [fresh.address]
    finally:
        sender.close()
        if dead.process.is_alive():
            os.kill(dead.process.pid, signal.SIGKILL)  # also ends a stopped one
        dead.process.join(10)
        if fresh is not None:
            fresh.close()
