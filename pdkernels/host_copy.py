"""Host values onto a device without the host waiting: the one way the engine, the kernels' wrappers and the K/V
transfer send Python lists (or CPU tensors) to the device.

On CUDA the values go through pinned memory with a non-blocking copy, ordered on the current stream (the pinned
allocator keeps the host side alive until the copy has run), so the calling thread never waits for the device; on the
CPU the tensor is returned as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(values: Sequence[Any] | torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a host list, or a CPU tensor) as a ``dtype`` tensor on ``device``, without a host sync. Pure."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t if torch.device(device).type == "cpu" else t.pin_memory().to(device, non_blocking=True)
