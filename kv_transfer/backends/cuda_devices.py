"""Which of this process's CUDA devices holds another process's exported memory: devices matched by UUID, not index.

A CUDA device index names a *visible* device, and each process may see a different set (Ray gives every
``num_gpus`` actor its own ``CUDA_VISIBLE_DEVICES``), so the exporter's ``cuda:0`` may be the reader's ``cuda:1``,
or no device of the reader's at all. The exporter therefore sends its device's UUID (:func:`device_uuid`) with the
IPC handle, and the reader decides with :func:`match_device`, a pure function of that UUID, the UUIDs it sees (in
local index order) and a peer-access predicate:

- the exporter's GPU is the reader's own device: map it there;
- it is another visible device the reader's device can reach (peer access): map it on the reader's device, whose
  context the driver then gives peer access to it (``cudaIpcMemLazyEnablePeerAccess``, which torch passes), so the
  copy kernel, launched on the reader's device and stream, writes peer memory;
- it is visible without peer access, or not visible at all (one actor per GPU under Ray: each sees only its own):
  no mapping. CUDA IPC memory can be opened only in a process that sees its device; the writer falls back to the
  socket backend (``auto``), counted by reason (:data:`NOT_VISIBLE`, :data:`NO_PEER_ACCESS`, ...).

Torch-free apart from :func:`visible_device_uuids`, :func:`device_uuid` and :func:`can_access_peer`, which read CUDA.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# fallback reasons (the ``reason`` label of pdcluster_kv_inplace_fallbacks_total): stable, metric-safe words
NOT_VISIBLE = "device_not_visible"  # the exporter's GPU is not among the reader's visible devices
NO_PEER_ACCESS = "no_peer_access"  # visible, another device than the reader's, and no peer access between them
NO_UUID = "no_device_uuid"  # the exporter sent no device UUID (or one that is not a UUID)

_PREFIXES = ("gpu-", "mig-")


def normalize_uuid(uuid: str | bytes) -> str:
    """One spelling for a device UUID, so NVML's and CUDA's compare equal: lower case, without the ``GPU-`` / ``MIG-``
    prefix (``nvidia-smi -L`` writes ``GPU-1a2b...``, torch's ``get_device_properties(i).uuid`` prints ``1a2b...``),
    dashed 8-4-4-4-12 (from 32 bare hex digits or 16 raw bytes). Anything else (the old ``MIG-GPU-<uuid>/gi/ci``
    form) is lower-cased only, so it equals itself and nothing else. Pure."""
    if isinstance(uuid, bytes):
        uuid = uuid.hex()
    u = uuid.strip().lower()
    for p in _PREFIXES:
        bare = _dashed(u[len(p):]) if u.startswith(p) else None
        if bare is not None:
            return bare
    return _dashed(u) or u


def _dashed(u: str) -> str | None:
    """``u`` as a dashed UUID if it is one (dashed or 32 bare hex digits), else None. Pure."""
    bare = u.replace("-", "")
    if len(bare) != 32 or any(c not in "0123456789abcdef" for c in bare):
        return None
    d = f"{bare[:8]}-{bare[8:12]}-{bare[12:16]}-{bare[16:20]}-{bare[20:]}"
    return d if u in (bare, d) else None


@dataclass(frozen=True)
class Mapped:
    """The exporter's memory can be mapped here."""

    exporter_index: int  # the exporter's GPU as this process numbers it
    open_on: int  # the device to open the IPC handle on (and label the mapping with): always the reader's own
    peer: bool  # the memory is on another device than the reader's: writes cross the peer link


@dataclass(frozen=True)
class Unmappable:
    """The exporter's memory cannot be mapped here: fall back (``reason``: one of the module's reason words)."""

    reason: str
    detail: str  # said plainly, for logs and the ConnectionError


def match_device(exporter_uuid: str | bytes | None, visible: Sequence[str | bytes], reader_index: int,
                 can_access_peer: Callable[[int, int], bool]) -> Mapped | Unmappable:
    """Where to open a handle exported from the GPU ``exporter_uuid``, in a process that sees ``visible`` (UUIDs in
    local index order) and writes from its device ``reader_index``; ``can_access_peer(reader, other)`` says whether
    the reader's device can reach another's memory. Pure."""
    if not exporter_uuid:
        return Unmappable(NO_UUID, "the exporter sent no device UUID: cannot tell which local GPU holds its memory")
    want = normalize_uuid(exporter_uuid)
    local = [normalize_uuid(u) for u in visible]
    if want not in local:
        return Unmappable(NOT_VISIBLE, f"device not visible: the exporter's GPU {want} is not among this process's "
                                       f"{len(local)} visible device(s) (CUDA_VISIBLE_DEVICES differ, e.g. one "
                                       f"actor per GPU); CUDA IPC memory opens only where its device is visible")
    index = local.index(want)
    if index == reader_index:
        return Mapped(index, reader_index, peer=False)
    if not 0 <= reader_index < len(local):
        return Unmappable(NOT_VISIBLE, f"device not visible: this process writes from cuda:{reader_index}, which is "
                                       f"not among its {len(local)} visible device(s)")
    if not can_access_peer(reader_index, index):
        return Unmappable(NO_PEER_ACCESS, f"no peer access: the exporter's GPU is this process's cuda:{index}, it "
                                          f"writes from cuda:{reader_index}, and the two have no peer access")
    return Mapped(index, reader_index, peer=True)


def visible_from_env(cuda_visible_devices: str | None, node_uuids: Sequence[str]) -> list[str]:
    """The UUIDs a process sees, in local index order, given its ``CUDA_VISIBLE_DEVICES`` and the node's GPUs
    (``node_uuids``, in physical order), as the CUDA runtime filters them: unset -> all; entries are indices or UUIDs
    (``GPU-``/``MIG-`` prefixed, a unique prefix is enough); the list stops at the first entry that names no device
    (CUDA's rule), and a device named twice stops it too. Pure."""
    if cuda_visible_devices is None:
        return list(node_uuids)
    norm = [normalize_uuid(u) for u in node_uuids]
    out: list[int] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if re.fullmatch(r"\d+", entry):
            i = int(entry)
            hit = [i] if i < len(node_uuids) else []
        else:
            key = entry.lower()
            key = key[4:] if key.startswith(_PREFIXES) else key
            hit = [i for i, u in enumerate(norm) if key and u.startswith(key)]
        if len(hit) != 1 or hit[0] in out:
            break
        out.append(hit[0])
    return [node_uuids[i] for i in out]


# -- reading CUDA (the injectable inputs of match_device) ------------------------------------------------------------
def device_uuid(index: int) -> str:
    """The UUID of this process's ``cuda:index`` (normalized; "" where it cannot be read: a reader then falls back
    with ``no_device_uuid``). Reads CUDA."""
    uuids = visible_device_uuids()
    return uuids[index] if 0 <= index < len(uuids) else ""


@functools.lru_cache(maxsize=1)
def visible_device_uuids() -> tuple[str, ...]:
    """This process's visible devices' UUIDs in local index order (fixed for a process's life: cached). From torch's
    device properties; where they carry no UUID (an old torch), from ``nvidia-smi -L`` filtered by
    ``CUDA_VISIBLE_DEVICES``; "" for a device whose UUID neither gives (it then matches nothing). Reads CUDA."""
    import torch

    n = torch.cuda.device_count()
    props = [torch.cuda.get_device_properties(i) for i in range(n)]
    if all(hasattr(p, "uuid") for p in props):
        return tuple(normalize_uuid(str(p.uuid)) for p in props)
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""
    node = re.findall(r"UUID: ((?:GPU|MIG)-[^)\s]+)\)", listing)
    found = [normalize_uuid(u) for u in visible_from_env(os.environ.get("CUDA_VISIBLE_DEVICES"), node)][:n]
    return tuple(found + [""] * (n - len(found)))


def can_access_peer(reader: int, other: int) -> bool:
    """Whether this process's ``cuda:reader`` can reach ``cuda:other``'s memory. Reads CUDA."""
    import torch

    return bool(torch.cuda.can_device_access_peer(reader, other))


def reader_index(device: str) -> int:
    """The local index of a writer's ``KVTransferConfig.device`` (``cuda`` means the current device). Reads CUDA."""
    import torch

    return torch.cuda.current_device() if device in ("cuda", "cpu") else int(device.split(":", 1)[1])


def resolve(exported: dict[str, Any], device: str) -> Mapped | Unmappable:
    """:func:`match_device` for an exported handle (:func:`kv_transfer.backends.inplace_channel.export_cuda`'s ``uuid``) and
    this process's CUDA devices. Reads CUDA."""
    return match_device(exported.get("uuid"), visible_device_uuids(), reader_index(device), can_access_peer)
