"""Route ``pdkernels`` to Triton for a kernel test module: the device when there is one, else the interpreter.

Triton decorates a kernel when its module is imported; a module imported before ``TRITON_INTERPRET=1`` was set is
decorated for a device that is not here, so it is imported again under the variable. The check at the end keeps a
test from comparing the torch reference with itself when Triton did not take the call."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import pdkernels


@contextmanager
def triton_route(*modules: str) -> Iterator[None]:
    """While open, ``pdkernels`` runs ``modules`` (dotted names) through Triton on this machine's device."""
    pytest.importorskip("triton")
    cuda = torch.cuda.is_available()
    with pytest.MonkeyPatch.context() as mp:
        if not cuda:
            mp.setenv("TRITON_INTERPRET", "1")
            for name in modules:
                if name in sys.modules:  # decorated without the interpreter: decorate again
                    importlib.reload(sys.modules[name])
        device = "cuda" if cuda else "cpu"
        assert pdkernels.uses_triton(torch.empty(1, device=device)), "the test would compare the reference with itself"
        yield
