"""One rule for devices: every thread that launches device work enters its device first.

CUDA's current device is per thread, and a new thread starts on device 0. ``torch.cuda.set_device`` on an actor's
``__init__`` thread says nothing about the engine loop, a backend's I/O thread or a Ray call thread: on a node where
the actor owns GPU N, those would launch their Triton kernels (and allocate bare ``"cuda"`` tensors, make streams and
events, run NCCL) on GPU 0 with pointers into GPU N. So no module starts a bare ``threading.Thread``: it asks a
:class:`DeviceThreads` (``thread`` / ``start``), whose threads call :meth:`DeviceThreads.enter` before their target
runs, and a Ray call that may launch device work calls ``enter`` first (``cluster/actor/worker_actor.py``). On the
CPU ``enter`` does nothing, so a CPU actor behaves exactly as before. ``tests/unit/test_device_threads.py`` fails on a
bare ``threading.Thread(`` in ``engine/``, ``kv_transfer/``, ``cluster/loop/`` or ``cluster/actor/``.

Who holds one: the stream seam (:class:`kv_transfer.wire.streams.HostStreams` ``.threads``) for every K/V backend and the
connector's threads, the engine loop (:class:`cluster.loop.engine_loop.EngineLoop`), the tensor-parallel group
and the worker actor. A test injects ``set_device`` (called with the device, on the entering thread, instead of
``torch.cuda.set_device``) to record which thread entered which device, with a CUDA device index on a machine that
has no GPU.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

SetDevice = Callable[["torch.device"], None]
F = TypeVar("F", bound=Callable[..., Any])


def cuda_set_device(device: torch.device) -> None:
    """``torch.cuda.set_device``: the calling thread's current CUDA device. Mutates that thread's CUDA state."""
    import torch

    torch.cuda.set_device(device)


class DeviceThreads:
    """Starts threads on ``device`` (each enters it before its target runs) and lets a running thread enter it.

    ``device``: a torch device or its name (``"cuda"`` without an index: the constructing thread's current CUDA
    device). ``set_device``: what entering a CUDA device calls, on the entering thread (default
    ``torch.cuda.set_device``; a test passes a recorder). Immutable after construction; thread-safe."""

    def __init__(self, device: str | torch.device = "cpu", set_device: SetDevice | None = None) -> None:
        import torch  # here, not at import: the modules that start threads stay importable without torch

        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the constructing thread's current one
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._set_device = set_device if set_device is not None else cuda_set_device

    def enter(self) -> None:
        """Mutates the calling thread's current CUDA device: makes it ``device`` (a CUDA device); nothing on the
        CPU. Cheap: call it at the top of any call that may launch device work on a thread it does not own."""
        if self.device.type == "cuda":
            self._set_device(self.device)

    def thread(self, target: Callable[..., Any], name: str, args: tuple[Any, ...] = (),
               daemon: bool = True) -> threading.Thread:
        """A new (not started) thread named ``name`` that enters ``device``, then runs ``target(*args)``."""
        def run() -> None:
            self.enter()
            target(*args)

        return threading.Thread(target=run, name=name, daemon=daemon)

    def start(self, target: Callable[..., Any], name: str, args: tuple[Any, ...] = (),
              daemon: bool = True) -> threading.Thread:
        """:meth:`thread`, started. Returns it."""
        t = self.thread(target, name, args, daemon)
        t.start()
        return t

    def __repr__(self) -> str:
        return f"DeviceThreads({self.device})"


def entering_device(method: F) -> F:
    """Decorates a method of an object with a ``threads`` attribute (a :class:`DeviceThreads`): the calling thread
    enters that device before the method runs (a Ray call thread of an actor on GPU N)."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.threads.enter()
        return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
