"""A test-only tensor-parallel group in one process: one thread per rank, collectives over shared lists.

:class:`ThreadComm` implements :class:`engine.models.tp.Communicator` with a ``threading.Barrier``: each rank puts its tensor
in its slot, waits for the others, and every rank computes the same sum (in rank order) or concatenation; a second
wait keeps a slot from being overwritten before every rank has read it. :func:`run_ranks` runs one function per rank
on its own thread and re-raises the first failure (a failing rank breaks the barrier, so the others stop too).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class ThreadGroup:
    """The shared state of ``size`` ranks' :class:`ThreadComm` (mutated by their collectives)."""

    def __init__(self, size: int, timeout_s: float = 60.0) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.calls = [0] * size  # collectives each rank made

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)


class ThreadComm:
    """Rank ``rank``'s side of a :class:`ThreadGroup`."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self.rank = rank

    def _exchange(self, x: torch.Tensor, join: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        g = self.group
        g.calls[self.rank] += 1
        g.slots[self.rank] = x
        g.barrier.wait()
        parts = [t for t in g.slots if t is not None]
        assert len(parts) == g.size and all(t.shape == x.shape for t in parts), [tuple(t.shape) for t in parts]
        out = join(parts)
        g.barrier.wait()
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        def total(parts: list[torch.Tensor]) -> torch.Tensor:
            acc = parts[0].clone()
            for t in parts[1:]:
                acc += t
            return acc

        return self._exchange(x, total)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return self._exchange(x, lambda parts: torch.cat(parts, dim=-1))


def run_ranks(group: ThreadGroup, fn: Callable[[int], T]) -> list[T]:
    """``[fn(0), ..., fn(size - 1)]``, each on its own thread at once; a failing rank aborts the group's barrier (the
    others stop at their next collective); re-raises the first exception."""
    size = group.size
    results: list[T | None] = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"tp-rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return results  # type: ignore[return-value]
