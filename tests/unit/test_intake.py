"""The decode actor's intake record: the closed state set, its transition table, and part arrivals."""

from __future__ import annotations

import itertools

import pytest

from kv_transfer.connector.intake import FINAL, PENDING, TRANSITIONS, IllegalTransition, IntakeRecord, IntakeState as S


def record(prompt_len: int = 40, num_layers: int = 2) -> IntakeRecord:
    return IntakeRecord("rsv-1", "req-1", (3, 4, 5), ttl_s=5.0, expires_at=10.0, prompt_len=prompt_len,
                        num_layers=num_layers)


def test_table_is_closed_and_final_states_are_final() -> None:
    assert set(TRANSITIONS) == set(S)
    assert all(nxt <= set(S) for nxt in TRANSITIONS.values())
    assert FINAL == {S.DONE, S.ABORTED, S.EXPIRED}
    assert PENDING == {S.RESERVED, S.RECEIVING, S.COMPLETE, S.FAILED}
    # every state can reach a final one; no pending state goes back to RESERVED
    for s in S:
        seen, frontier = {s}, {s}
        while frontier:
            frontier = {n for f in frontier for n in TRANSITIONS[f]} - seen
            seen |= frontier
        assert seen & FINAL or s in FINAL
        assert S.RESERVED not in TRANSITIONS[s]


@pytest.mark.parametrize("a,b", list(itertools.product(list(S), list(S))))
def test_advance_follows_the_table_exactly(a: S, b: S) -> None:
    r = record()
    r.state = a
    if b in TRANSITIONS[a]:
        r.advance(b, "why")
        assert r.state is b and r.failure == "why"
    else:
        with pytest.raises(IllegalTransition):
            r.advance(b)
        assert r.state is a


def test_parts_move_reserved_receiving_complete() -> None:
    r = record(prompt_len=40, num_layers=2)
    r.add_part(0, 0, 32)
    assert r.state is S.RECEIVING and not r.kv_complete and r.missing_layers() == [0, 1]
    r.add_part(1, 0, 32)
    r.add_part(0, 32, 40)
    assert r.state is S.RECEIVING and r.missing_layers() == [1]
    r.add_part(1, 16, 48)  # overlapping chunk still extends the prefix; the range is clipped to the prompt
    assert r.state is S.COMPLETE and r.kv_complete and r.covered == [40, 40]
    assert not r.ready_to_join()
    r.result = object()
    assert r.ready_to_join()
    with pytest.raises(IllegalTransition):  # a late duplicate part cannot land on a complete record
        r.add_part(0, 0, 16)


def test_gap_counts_out_of_order_and_bad_layer_refused() -> None:
    r = record(prompt_len=40, num_layers=1)
    r.add_part(0, 16, 40)
    assert r.out_of_order == 1 and r.covered == [0]
    with pytest.raises(ValueError):
        r.add_part(1, 0, 16)
    r.add_part(0, 0, 40)
    assert r.state is S.COMPLETE


def test_every_slot_must_cover_the_prompt() -> None:
    """A decode group whose 2 ranks each hold a replica of 1 kv head (slots: rank 0's head, rank 1's head): one
    rank's parts complete nothing; the record is complete once every rank's copy of every layer has landed."""
    r = IntakeRecord("rsv-1", "req-1", (3, 4, 5), ttl_s=5.0, expires_at=10.0, prompt_len=40, num_layers=2, heads=2)
    for layer in (0, 1):
        r.add_part(layer, 0, 40, head_start=0, num_heads=1)  # rank 0's slot
    assert r.state is S.RECEIVING and r.missing_layers() == [0, 1]
    r.add_part(0, 0, 40, head_start=1, num_heads=1)
    assert r.missing_layers() == [1] and not r.kv_complete
    r.add_part(1, 0, 24, head_start=1, num_heads=1)
    r.add_part(1, 16, 40, head_start=1, num_heads=1)  # overlapping chunk of the same slot extends it
    assert r.state is S.COMPLETE and r.covered == [40, 40, 40, 40]
    r2 = IntakeRecord("rsv-2", "req-2", (3, 4, 5), ttl_s=5.0, expires_at=10.0, prompt_len=40, num_layers=1, heads=2)
    r2.add_part(0, 0, 40)  # a part of every head (a TP-1 sender to a receiver holding both) covers both slots
    assert r2.state is S.COMPLETE
    with pytest.raises(ValueError, match="heads"):
        record().add_part(0, 0, 40, head_start=1, num_heads=1)  # one slot only
    with pytest.raises(ValueError, match="heads"):
        IntakeRecord("rsv-3", "req-3", (3,), ttl_s=5.0, expires_at=10.0, prompt_len=4, num_layers=1, heads=0)


def test_failed_record_waits_for_result_then_recomputes() -> None:
    r = record()
    r.advance(S.FAILED, "checksum mismatch")
    assert r.pending and not r.ready_to_recompute()
    r.result = object()
    assert r.ready_to_recompute()
    r.advance(S.RUNNING)
    assert not r.pending
    r.advance(S.PREEMPTED)
    r.advance(S.RUNNING)
    r.advance(S.DONE)
    assert r.final


def test_one_layer_one_part_completes_at_once() -> None:
    r = record(prompt_len=5, num_layers=1)
    r.add_part(0, 0, 5)
    assert r.state is S.COMPLETE
