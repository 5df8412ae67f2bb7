"""GPU actors that see every GPU of their node, and which one each uses. Torch-free; never imports Ray itself.

Ray narrows every ``num_gpus`` actor's ``CUDA_VISIBLE_DEVICES`` to the GPUs it assigned that actor, so with one actor
per GPU a prefill actor cannot open a CUDA IPC handle of the decode actor's GPU (``kv_transfer.backends.cuda_devices``: a
``device_not_visible`` fallback). With :data:`NOSET_ENV` in an actor's ``runtime_env`` (:func:`runtime_env`) Ray
leaves ``CUDA_VISIBLE_DEVICES`` as the node has it: the actor sees all of its node's GPUs, takes the one Ray assigned
it (:func:`assigned_cuda_index` of ``ray.get_gpu_ids()``) and can map a peer's cache on another GPU (peer access
permitting). vLLM's Ray workers do the same. ``ServeConfig.share_node_gpus`` turns it on (the default for GPU actors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"  # read by Ray in the actor's process: leave CVD alone


def runtime_env() -> dict[str, Any]:
    """The ``runtime_env`` actor option that keeps the node's ``CUDA_VISIBLE_DEVICES`` in the actor. Pure."""
    return {"env_vars": {NOSET_ENV: "1"}}


def assigned_cuda_index(ray_gpu_ids: Sequence[str | int], cuda_visible_devices: str | None, ordinal: int = 0) -> int:
    """The CUDA device index, in a process that sees its node's GPUs through ``cuda_visible_devices`` (the node's
    ``CUDA_VISIBLE_DEVICES``; None: unset, every GPU), of the ``ordinal``-th GPU Ray assigned the actor
    (``ray_gpu_ids``, ``ray.get_gpu_ids()``), counted in that process's index order.

    Ray's GPU ids are the node's: the entries of ``CUDA_VISIBLE_DEVICES`` as the node had it when Ray started there
    (strings: indices or ``GPU-``/``MIG-`` UUIDs), or, where it was unset, physical indices (ints). So an id's index is
    its position in ``cuda_visible_devices`` when that is set, else the id itself. The same holds in an actor Ray did
    narrow (``CUDA_VISIBLE_DEVICES`` is then its assigned ids: the first is index 0). Raises ``ValueError`` when Ray
    assigned no GPU (or fewer than ``ordinal + 1``), or an id is not among the visible devices. Pure."""
    ids = [str(i).strip() for i in ray_gpu_ids]
    if not ids:
        raise ValueError("ray_gpu_ids: Ray assigned this actor no GPU (num_gpus 0): it has no device to pick")
    if cuda_visible_devices is None:
        if not all(i.isdigit() for i in ids):
            raise ValueError(f"ray_gpu_ids: {ids} are not device indices, and CUDA_VISIBLE_DEVICES is unset: "
                             f"cannot tell which local device they are")
        indices = [int(i) for i in ids]
    else:
        entries = [e.strip().lower() for e in cuda_visible_devices.split(",")]
        missing = [i for i in ids if i.lower() not in entries]
        if missing:
            raise ValueError(f"ray_gpu_ids: {missing} not in CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: this "
                             f"process does not see the GPU Ray assigned it (its environment is not the node's)")
        indices = [entries.index(i.lower()) for i in ids]
    indices = sorted(set(indices))
    if not 0 <= ordinal < len(indices):
        raise ValueError(f"device: cuda:{ordinal} asked for, but Ray assigned this actor {len(indices)} GPU(s)")
    return indices[ordinal]
