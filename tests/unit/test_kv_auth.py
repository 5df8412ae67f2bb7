"""The cluster MAC (cluster.wire.auth): what it binds, that it never prints, and the K/V header and token-frame seals
built on it. Pure: no sockets, no torch tensors."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from cluster.wire import auth
from cluster.wire.auth import ClusterSecret
from cluster.wire.token_stream import seal, unseal
from cluster.wire.worker_config import WorkerConfig
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import WIRE_VERSION, KVTransferHeader, MalformedHeaderError, header_authentic, sign_header

SECRET = ClusterSecret("s" * 64)
OTHER = ClusterSecret("t" * 64)


def _header(**overrides: object) -> KVTransferHeader:
    fields: dict[str, object] = dict(request_id="req", reservation_id="res-1", layer=2, token_start=16, token_end=40,
                                     block_ids=(7, 8), dtype="float32", shape=(2, 2, 16, 2, 8), checksum=b"t" * 16,
                                     model_fingerprint="fp", epoch=3, nonce="n-1")
    return KVTransferHeader(**{**fields, **overrides})  # type: ignore[arg-type]


def test_the_secret_never_prints_and_survives_pickling() -> None:
    text = "x" * 40
    s = ClusterSecret(text)
    for shown in (repr(s), str(s), f"{s}", repr(WorkerConfig(cluster_secret=s)), repr(KVTransferConfig(secret=s))):
        assert text not in shown and "redacted" in shown
    assert pickle.loads(pickle.dumps(s)) == s and s.reveal() == text
    assert "cluster_secret" not in WorkerConfig(cluster_secret=s).engine_kwargs()


@pytest.mark.parametrize("bad", ["", "short", " " + "a" * 40, "a" * 40 + "\n", "a" * 31 + "\x00"])
def test_weak_or_unprintable_secrets_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="cluster secret"):
        ClusterSecret(bad)


def test_from_env_strips_a_files_newline_and_treats_empty_as_unset() -> None:
    assert ClusterSecret.from_env({auth.ENV_VAR: "k" * 64 + "\n"}) == ClusterSecret("k" * 64)
    assert ClusterSecret.from_env({auth.ENV_VAR: ""}) is None and ClusterSecret.from_env({}) is None
    with pytest.raises(ValueError):
        ClusterSecret.from_env({auth.ENV_VAR: "too short"})
    a, b = ClusterSecret.generate(), ClusterSecret.generate()
    assert a != b and len(a.reveal()) == 64


def test_a_mac_binds_purpose_values_and_key() -> None:
    mac = auth.sign(SECRET, "kv-open", "res-1", "n-1", 3)
    assert len(mac) == auth.MAC_BYTES and auth.verify(SECRET, mac, "kv-open", "res-1", "n-1", 3)
    assert not auth.verify(OTHER, mac, "kv-open", "res-1", "n-1", 3)  # another cluster's key
    assert not auth.verify(SECRET, mac, "kv-join", "res-1", "n-1", 3)  # another purpose
    assert not auth.verify(SECRET, mac, "kv-open", "res-1", "n-2", 3)  # another nonce
    assert not auth.verify(SECRET, mac, "kv-open", "res-1", "n-1", 4)  # another epoch
    assert not auth.verify(SECRET, mac, "kv-open", "res-1", "n-1")  # a value left out
    for bad in (None, b"", mac[:-1], "ab" * 32, mac + b"\x00"):
        assert not auth.verify(SECRET, bad, "kv-open", "res-1", "n-1", 3)
    with pytest.raises(ValueError, match="purpose"):
        auth.sign(SECRET, "anything", 1)
    # the encoding keeps value boundaries: ("ab", "c") and ("a", "bc") differ
    assert auth.sign(SECRET, "kv-hi", "ab", "c") != auth.sign(SECRET, "kv-hi", "a", "bc")


def test_a_signed_header_round_trips_and_any_changed_field_fails() -> None:
    signed = sign_header(_header(), SECRET)
    wire = KVTransferHeader.decode(signed.encode())
    assert wire == signed and header_authentic(wire, SECRET) and not header_authentic(wire, OTHER)
    assert sign_header(_header(), None) == _header()  # authentication off: no MAC
    assert not header_authentic(_header(), SECRET)  # no MAC at all
    changed = dict(reservation_id="res-2", nonce="n-2", epoch=4, layer=3, token_start=0, token_end=41,
                   block_ids=(8, 7), checksum=b"u" * 16, request_id="other", model_fingerprint="fp2", dtype="float16")
    for name, value in changed.items():
        forged = dataclasses.replace(signed, **{name: value})
        assert not header_authentic(forged, SECRET), name
    none_sum = sign_header(_header(checksum=None), SECRET)  # an in-place part without a checksum is still bound
    assert header_authentic(none_sum, SECRET) and not header_authentic(dataclasses.replace(none_sum, checksum=bytes(16)),
                                                                       SECRET)


def test_the_header_wire_version_moved_and_a_bad_mac_field_is_malformed() -> None:
    # 6: the payload's 16-byte MAC tag replaces its CRC-32; 7: kv_layout; 8: 8-bit payloads hold rotated K/V;
    # 9: kind (a part, or the prefill result after the last part); 10: head_start (a TP rank's share of the heads)
    assert WIRE_VERSION == 10
    with pytest.raises(ValueError, match="mac"):
        _header(mac=b"\x00" * 5)
    import msgpack

    body = msgpack.unpackb(_header().encode())
    body["mac"] = "not bytes"
    with pytest.raises(MalformedHeaderError, match="mac"):
        KVTransferHeader.decode(msgpack.packb(body, use_bin_type=True))


def test_token_frames_are_bound_to_their_body_and_proxy() -> None:
    body, there = b"\x91\x80", "tcp://10.0.0.1:5000"
    raw = seal(SECRET, there, body)
    assert unseal(SECRET, there, raw) == body
    assert unseal(SECRET, "tcp://10.0.0.2:5000", raw) is None  # replayed to another proxy
    assert unseal(OTHER, there, raw) is None
    assert unseal(SECRET, there, raw[:-1] + b"\x81") is None  # tampered body
    assert unseal(SECRET, there, body) is None and unseal(SECRET, there, b"") is None  # unsealed, empty
    assert seal(None, there, body) == body and unseal(None, there, body) == body  # authentication off


def test_metrics_show_both_unauthenticated_counts() -> None:
    from types import SimpleNamespace

    from proxy.metrics import Metrics, unauthenticated_counts

    stream = SimpleNamespace(messages_unauthenticated=3, messages_replayed=2)  # the proxy's TokenStreamServer's
    reported = SimpleNamespace(kv_parts_unauthenticated=5)  # a decode actor's last WorkerStats
    pools = SimpleNamespace(decode={"dc-0": SimpleNamespace(name="dc-0", stats=reported),
                                    "dc-1": SimpleNamespace(name="dc-1", stats=None)})
    text = Metrics(unauthenticated=lambda: unauthenticated_counts(stream, pools)).render(0, {})
    assert "pdcluster_token_frames_unauthenticated_total 3" in text.splitlines()
    assert "pdcluster_token_frames_replayed_total 2" in text.splitlines()
    assert 'pdcluster_kv_parts_unauthenticated_total{actor="dc-0"} 5' in text.splitlines()
    assert "dc-1" not in text and "unauthenticated" not in Metrics().render(0, {})


def test_serve_refuses_proxies_elsewhere_without_a_shared_secret(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli import main
    from cluster.launcher import ServeConfig

    monkeypatch.delenv(auth.ENV_VAR, raising=False)
    assert main(["serve", "--proxies", "0"]) == 2
    assert auth.ENV_VAR in capsys.readouterr().err
    monkeypatch.setenv(auth.ENV_VAR, "short")
    assert main(["serve"]) == 2 and "cluster secret" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cluster_auth"):
        ServeConfig(cluster_auth=False, cluster_secret=SECRET)
    with pytest.raises(ValueError, match="ServeConfig.cluster_secret"):
        ServeConfig(worker=WorkerConfig(cluster_secret=SECRET))
