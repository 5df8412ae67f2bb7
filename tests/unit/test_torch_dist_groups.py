"""The pure parts of torch_dist failure isolation: the pair timeout a config gives, and the NCCL error-handling mode
under which a dead peer fails only its pair (engine/parallel/nccl_errors.py, kv_transfer/backends/torch_dist_groups.py). The failures themselves, through real
processes: tests/integration/test_torch_dist_failures.py."""

from __future__ import annotations

import datetime

import pytest

from kv_transfer.wire.config import KVTransferConfig
from engine.parallel.nccl_errors import ASYNC_ERROR_HANDLING, CLEAN_UP_ONLY, nccl_error_handling, survive_nccl_failures
from kv_transfer.backends.torch_dist_groups import abort_groups, pair_timeout


def test_pair_timeout_is_short_by_default_and_capped_at_io_timeout() -> None:
    assert pair_timeout(KVTransferConfig()) == datetime.timedelta(seconds=30)  # torch's NCCL default: 10 minutes
    assert KVTransferConfig(pair_timeout_s=2.5).pair_timeout == 2.5
    assert KVTransferConfig(pair_timeout_s=60, io_timeout_s=20).pair_timeout == 20


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_pair_timeout_must_be_finite_and_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="pair_timeout_s"):
        KVTransferConfig(pair_timeout_s=bad)


@pytest.mark.parametrize(("current", "value", "warns"), [
    (None, CLEAN_UP_ONLY, False),  # unset: torch's default is 3 (SkipCleanUp), which tears the process down
    ("", CLEAN_UP_ONLY, False),
    ("0", "0", False),  # NoHandling: the watchdog leaves the process alone too
    ("2", "2", False),
    (" 2 ", "2", False),
    ("1", CLEAN_UP_ONLY, True),  # TearDown
    ("3", CLEAN_UP_ONLY, True),  # SkipCleanUp: tears down without cleaning up
    ("yes", CLEAN_UP_ONLY, True),
])
def test_nccl_error_handling_never_tears_the_process_down(current: str | None, value: str, warns: bool) -> None:
    got, warning = nccl_error_handling(current)
    assert got == value and (warning is not None) == warns
    if warns:
        assert ASYNC_ERROR_HANDLING in warning and repr(current) in warning


def test_survive_nccl_failures_sets_the_environment_once() -> None:
    env: dict[str, str] = {"OTHER": "x"}
    assert survive_nccl_failures(env) == CLEAN_UP_ONLY
    assert env == {"OTHER": "x", ASYNC_ERROR_HANDLING: CLEAN_UP_ONLY}
    env[ASYNC_ERROR_HANDLING] = "0"
    assert survive_nccl_failures(env) == "0" and env[ASYNC_ERROR_HANDLING] == "0"
    env[ASYNC_ERROR_HANDLING] = "3"
    assert survive_nccl_failures(env) == CLEAN_UP_ONLY and env[ASYNC_ERROR_HANDLING] == CLEAN_UP_ONLY


class _Group:
    """Records its abort; ``refuse``: raises from it, as an already broken communicator may."""

    def __init__(self, refuse: bool = False) -> None:
        self.aborted = 0
        self.refuse = refuse

    def abort(self) -> None:
        self.aborted += 1
        if self.refuse:
            raise RuntimeError("communicator already gone")


def test_abort_groups_aborts_each_group_once_and_never_raises() -> None:
    ctrl = _Group()
    assert abort_groups(("store", ctrl, ctrl)) == [] and ctrl.aborted == 1  # the CPU: one group carries both
    ctrl, data = _Group(), _Group(refuse=True)
    errors = abort_groups(("store", ctrl, data))
    assert ctrl.aborted == data.aborted == 1 and len(errors) == 1 and "already gone" in errors[0]
    assert abort_groups(()) == []  # a pair whose connect failed has no groups
