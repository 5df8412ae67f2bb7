"""Pure admission control with fake actor stats and an explicit clock."""

from __future__ import annotations

import pytest

from cluster.wire.telemetry import ActorStats
from proxy.admission import Admit, AdmissionConfig, AdmissionController, Queued, Reject, estimate_blocks
from proxy.router import PrefixHits


def decode(actor_id: str, free: int, total: int = 100, running: int = 0, alive: bool = True,
           draining: bool = False) -> ActorStats:
    return ActorStats(actor_id, "decode", alive, draining, kv_blocks_free=free, kv_blocks_used=total - free,
                      kv_blocks_total=total, num_running=running)


def controller(**overrides: object) -> AdmissionController:
    cfg = {"block_size": 16, "max_queue_len": 2, "queue_timeout_s": 10.0, "retry_after_floor_s": 1.0,
           "retry_after_cap_s": 60.0, "release_window_s": 10.0, **overrides}
    return AdmissionController(AdmissionConfig(**cfg))  # type: ignore[arg-type]


def test_estimate_blocks_rounds_up() -> None:
    assert estimate_blocks(16, 0, 16) == 1
    assert estimate_blocks(16, 1, 16) == 2
    assert estimate_blocks(100, 28, 16) == 8
    assert estimate_blocks(100, 28, 16, n=3) == 8 + 2 * (2 + 1)  # each other completion: its output + a CoW copy
    with pytest.raises(ValueError):
        estimate_blocks(-1, 1, 16)


def test_config_is_validated() -> None:
    for bad in ({"block_size": 0}, {"max_queue_len": -1}, {"queue_timeout_s": 0}, {"release_window_s": float("inf")},
                {"retry_after_floor_s": 5.0, "retry_after_cap_s": 1.0}):
        with pytest.raises(ValueError):
            controller(**bad)


def test_admits_to_the_actor_with_most_free_blocks() -> None:
    ac = controller()
    actors = [decode("d0", 10), decode("d1", 40), decode("d2", 90, alive=False), decode("d3", 95, draining=True)]
    assert ac.submit("a", 8, actors, now=0.0) == Admit("a", "d1", 8)
    # blocks this proxy already reserved on d1 (not yet in its stats) count against it
    assert ac.submit("b", 8, actors, now=0.0, pending_blocks={"d1": 35}) == Admit("b", "d0", 8)
    assert len(ac) == 0


def test_queue_then_admit_in_fifo_order() -> None:
    ac = controller(max_queue_len=3)
    full = [decode("d0", 4)]
    assert ac.submit("big", 10, full, now=0.0) == Queued("big", 0, 10.0)
    # a small request that would fit still waits behind the head: no overtaking
    assert ac.submit("small", 2, full, now=1.0) == Queued("small", 1, 11.0)
    assert ac.poll(full, now=2.0) == []
    assert ac.queued_blocks == 12
    freed = [decode("d0", 11), decode("d1", 2)]
    assert ac.poll(freed, now=3.0) == [Admit("big", "d0", 10), Admit("small", "d1", 2)]
    assert len(ac) == 0


def test_poll_does_not_hand_the_same_free_blocks_out_twice() -> None:
    ac = controller(max_queue_len=3)
    ac.submit("a", 6, [decode("d0", 0)], now=0.0)
    ac.submit("b", 6, [decode("d0", 0)], now=0.0)
    assert ac.poll([decode("d0", 10)], now=1.0) == [Admit("a", "d0", 6)]
    assert ac.poll([decode("d0", 10)], now=1.0, pending_blocks={"d0": 6}) == []  # a's blocks are taken
    assert ac.poll([decode("d0", 10)], now=1.0, pending_blocks={"d0": 4}) == [Admit("b", "d0", 6)]


def test_prefix_hits_steer_admission_now_and_after_a_wait() -> None:
    ac = controller(max_queue_len=3)
    prefix = PrefixHits(10, {"d1": 10})  # d1 holds the whole prompt
    assert ac.submit("now", 4, [decode("d0", 50), decode("d1", 45)], now=0.0, prefix=prefix) == Admit("now", "d1", 4)
    full = [decode("d0", 2), decode("d1", 2)]
    assert ac.submit("later", 4, full, now=1.0, prefix=prefix) == Queued("later", 0, 11.0)
    # the hits travel with the waiting request: d1 wins once both have room
    assert ac.poll([decode("d0", 50), decode("d1", 45)], now=2.0) == [Admit("later", "d1", 4)]


def test_queue_full_is_429_with_retry_after() -> None:
    ac = controller(max_queue_len=1)
    busy = [decode("d0", 0)]
    assert isinstance(ac.submit("a", 5, busy, now=0.0), Queued)
    r = ac.submit("b", 5, busy, now=0.0)
    assert isinstance(r, Reject) and r.error.status == 429 and r.error.code == "queue_full"
    assert r.error.headers() == {"Retry-After": "1"}  # no release observed yet: the floor
    assert len(ac) == 1


def test_zero_length_queue_rejects_instead_of_waiting() -> None:
    r = controller(max_queue_len=0).submit("a", 5, [decode("d0", 0)], now=0.0)
    assert isinstance(r, Reject) and r.error.status == 429


def test_timeout_is_429_and_leaves_the_queue() -> None:
    ac = controller(max_queue_len=3)
    busy = [decode("d0", 0)]
    ac.submit("a", 5, busy, now=0.0)
    ac.submit("b", 5, busy, now=4.0)
    assert ac.poll(busy, now=9.99) == []
    out = ac.poll(busy, now=10.0)
    assert len(out) == 1 and isinstance(out[0], Reject) and out[0].request_id == "a"
    assert (out[0].error.status, out[0].error.code) == (429, "queue_timeout")
    assert "Retry-After" in out[0].error.headers()
    assert len(ac) == 1
    assert [d.request_id for d in ac.poll(busy, now=14.0)] == ["b"]


def test_retry_after_follows_the_observed_release_rate() -> None:
    ac = controller(max_queue_len=1)
    busy = [decode("d0", 2)]
    for t in range(10):  # 4 blocks/s over the 10 s window
        ac.observe_release(4, now=float(t))
    assert ac.release_rate(now=9.0) == pytest.approx(4.0)
    ac.submit("a", 20, busy, now=9.0)  # queued: 20 blocks ahead
    r = ac.submit("b", 22, busy, now=9.0)
    # (20 ahead + 22 own - 2 free) / 4 blocks/s = 10 s
    assert isinstance(r, Reject) and r.error.retry_after_s == 10
    assert ac.retry_after(10_000, busy, now=9.0) == 60  # capped
    assert ac.retry_after(1, busy, now=9.0) == 1  # already fits: the floor
    assert ac.release_rate(now=100.0) == 0.0  # old releases age out of the window
    ac.observe_release(1, now=100.0)
    assert ac.release_rate(now=100.0) == pytest.approx(0.1)


def test_larger_than_any_actor_is_400_naming_the_limit() -> None:
    ac = controller()
    actors = [decode("d0", 64, total=64), decode("d1", 10, total=80), decode("d2", 500, total=500, alive=False)]
    r = ac.submit("huge", 81, actors, now=0.0)
    assert isinstance(r, Reject) and r.error.status == 400 and r.error.code == "kv_capacity_exceeded"
    assert r.error.param == "max_tokens" and "80 blocks" in r.error.message and "1280 tokens" in r.error.message
    assert isinstance(ac.submit("fits-later", 80, actors, now=0.0), Queued)


def test_no_live_decode_actor_is_503_but_waiting_requests_survive_a_gap() -> None:
    ac = controller()
    r = ac.submit("a", 1, [decode("d0", 10, alive=False)], now=0.0)
    assert isinstance(r, Reject) and r.error.status == 503 and r.error.headers() == {"Retry-After": "1"}
    ac.submit("b", 5, [decode("d0", 0)], now=0.0)
    assert ac.poll([], now=1.0) == []  # every actor gone for a moment: b keeps waiting
    assert ac.poll([decode("d1", 50)], now=2.0) == [Admit("b", "d1", 5)]


def test_head_that_can_never_fit_any_more_is_rejected_not_blocking() -> None:
    ac = controller()
    ac.submit("big", 90, [decode("d0", 0, total=100)], now=0.0)
    ac.submit("small", 2, [decode("d0", 0, total=100)], now=0.0)
    out = ac.poll([decode("d1", 40, total=40)], now=1.0)  # the big actor left the pool
    assert isinstance(out[0], Reject) and out[0].error.status == 400
    assert out[1] == Admit("small", "d1", 2)


def test_cancel_removes_a_waiting_request() -> None:
    ac = controller()
    ac.submit("a", 5, [decode("d0", 0)], now=0.0)
    assert ac.cancel("a") and not ac.cancel("a") and len(ac) == 0
    assert ac.poll([decode("d0", 10)], now=1.0) == []


def test_bad_calls_raise() -> None:
    ac = controller()
    ac.submit("a", 5, [decode("d0", 0)], now=0.0)
    with pytest.raises(ValueError):
        ac.submit("a", 5, [decode("d0", 0)], now=0.0)
    with pytest.raises(ValueError):
        ac.submit("b", 0, [decode("d0", 10)], now=0.0)
    with pytest.raises(ValueError):
        ac.observe_release(-1, now=0.0)


def test_retry_after_treats_an_actor_marked_full_as_having_nothing_free_not_a_huge_deficit() -> None:
    """The gate marks an actor that refused a reservation on stale stats with a huge pending count until the next
    refresh; Retry-After must still come from the release rate (here 20 blocks/s: 165 blocks in ~9 s), not the cap."""
    from proxy.gate import FULL

    ctl = AdmissionController(AdmissionConfig(block_size=16))
    for t in range(30):
        ctl.observe_release(20, float(t))
    actor = ActorStats("d0", "decode", True, kv_blocks_free=0, kv_blocks_used=100, kv_blocks_total=100)
    plain = ctl.retry_after(165, [actor], 30.0)
    assert plain < 60 and ctl.retry_after(165, [actor], 30.0, {"d0": FULL}) == plain
