"""A torch_dist sending peer in its own process, for the failure tests: a test starts it (spawned), kills it by its pid
(SIGKILL: dead, its sockets close; SIGSTOP: stalled, they stay open) and checks that the receiving end survives.

``peer_main(address, name, mode, conn)``: ``"stall"`` connects to ``address``, puts one message's envelope on the
wire announcing a payload it never sends (a peer caught mid-transfer), says ``"posted"`` and sleeps until killed;
``"send"`` sends :func:`sample_part` through the public API and reports the handle's state and error, then waits for
anything on ``conn`` before closing."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import torch

from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import KVTransferHeader
from kv_transfer.wire.layer_parts import pack_layer_part
from kv_transfer.backends.loopback import CacheSpec

SPEC = CacheSpec(num_layers=1, num_blocks=4, block_size=16, kv_heads=1, head_dim=8, dtype="float32")


def sample_part(seed: int) -> tuple[KVTransferHeader, torch.Tensor]:
    """One small (layer 0, tokens 0-16) part of a made-up request. Pure."""
    k, v = SPEC.make(seed=seed)[0]
    return pack_layer_part(k, v, [0], [1], layer=0, token_start=0, token_end=16, request_id=f"req-{seed}",
                           reservation_id=f"rsv-{seed}", model_fingerprint="fp")


def peer_main(address: str, name: str, mode: str, conn: Connection) -> None:
    from kv_transfer.wire.base import sealed_header
    from kv_transfer.backends.torch_dist import TorchDistBackend
    from kv_transfer.backends.torch_dist_pairs import RECEIVER, TAG, _envelope

    backend = TorchDistBackend(KVTransferConfig(name=name, host="127.0.0.1", connect_timeout_s=20.0))
    header, payload = sample_part(seed=len(name))
    if mode == "stall":
        backend.connect(address)
        _, ctrl, _ = backend._senders[address]._groups  # the pair the public API built
        envelope, rest = _envelope(sealed_header(header, payload, secret=None), payload.numel() * 4)
        assert rest is None
        ctrl.send([envelope], RECEIVER, TAG).wait()
        conn.send("posted")
        time.sleep(600)
        return
    handle = backend.send(address, header, payload)
    handle.wait(60)
    conn.send((handle.state.value, handle.error))
    conn.poll(60)
    backend.close()
