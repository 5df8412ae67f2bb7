"""How NCCL process groups in this process fail: a dead or stalled peer fails the group's work, never the process.

torch 2.13's ``ProcessGroupNCCL`` reads ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` once per group, in its constructor
(``getCvarInt(TORCH_NCCL_ASYNC_ERROR_HANDLING, 3 /*SkipCleanUp*/)`` in ProcessGroupNCCL.cpp); the modes are in
``torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp`` (``enum ErrorHandlingMode { NoHandling = 0,
TearDown = 1, CleanUpOnly = 2, SkipCleanUp = 3 }`` and ``#define SHOULD_TEAR_DOWN(a) (a != NoHandling && a !=
CleanUpOnly)``). The default, 3, makes the watchdog thread rethrow a failed or timed-out work's error, which ends the
process ("To avoid data inconsistency, we are taking the entire process down", ``WorkNCCL::handleException``); a work
whose communicator was aborted is such a work. :func:`survive_nccl_failures` sets 2 (``CleanUpOnly``: the watchdog
aborts that work's communicator and leaves the process alone) before a group is built, unless the variable already
says 0 or 2; any other value is overridden with a warning. Used by the K/V transfer pairs
(kv_transfer/backends/torch_dist_groups.py) and the tensor-parallel group (engine/parallel/tp_group.py): in both, the caller learns of
the failure (a failed wait, :class:`engine.parallel.tp_group.TPGroupError`) and decides, instead of the process ending.
``TORCH_NCCL_BLOCKING_WAIT=1`` is left alone: it starts no watchdog, and ``wait`` raises in the caller.

Sources: the header is the one this torch (2.13.0) installs; ProcessGroupNCCL.cpp is not installed, and the lines
quoted from it are pytorch's on GitHub (the constructor and ``WorkNCCL::wait`` / ``handleException`` as of 2025),
not checked against the 2.13 tag. Not yet run on a GPU.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = "2"  # abort the failed work's communicator, keep the process
_SURVIVING_MODES = ("0", CLEAN_UP_ONLY)  # NoHandling, CleanUpOnly: neither tears the process down
_env_lock = threading.Lock()


def nccl_error_handling(current: str | None) -> tuple[str, str | None]:
    """The ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` value under which a dead peer fails only its group's work, given the
    one set now (None: unset), and a warning when an operator's value is overridden. Pure."""
    value = None if current is None else current.strip()
    if value in _SURVIVING_MODES:
        return value, None
    if not value:
        return CLEAN_UP_ONLY, None
    return CLEAN_UP_ONLY, (f"{ASYNC_ERROR_HANDLING}={current!r} would end this process when an NCCL peer dies "
                           f"(torch's watchdog tears down on a failed NCCL work); using {CLEAN_UP_ONLY} (CleanUpOnly)")


def survive_nccl_failures(environ: MutableMapping[str, str] | None = None) -> str:
    """Mutates ``environ`` (None: this process's environment, which ProcessGroupNCCL's constructor reads): make it say
    a mode that does not tear the process down. Call before building an NCCL group. Returns the value in force."""
    env = os.environ if environ is None else environ
    with _env_lock:
        value, warning = nccl_error_handling(env.get(ASYNC_ERROR_HANDLING))
        if env.get(ASYNC_ERROR_HANDLING) != value:
            if warning is not None:
                log.warning(warning)
            env[ASYNC_ERROR_HANDLING] = value
    return value
