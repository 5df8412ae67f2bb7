"""Where ``pdcluster serve`` puts its worker actors: on the CPU, one per GPU, or sharing GPUs. Decided once, before
any actor starts, by :func:`plan_placement`, a pure function of what was asked (:class:`PlacementRequest`: ``--device``,
``--gpus-per-actor``, the pools' sizes and TP sizes, ``--kv-backend``, ``--mode``) and the GPUs each Ray node offers;
it returns a frozen :class:`Placement` or raises :class:`PlacementError` (a ``ValueError``) naming the fix.

The policy:

- ``--device cpu``, or no GPU in the cluster with ``--device auto``: the CPU, as before (``num_gpus`` 0; Ray hides the
  GPUs from such an actor).
- GPUs in the cluster, ``--device auto`` or ``cuda[:N]``, no ``--gpus-per-actor``: on the GPUs. One GPU per actor (per
  rank of a tensor-parallel one) when there are enough; else, with TP 1, actors share GPUs, each asking Ray for
  ``1/k`` of one (``k`` actors per GPU, the fewest that fit: a 1P1D pair on one GPU gets 0.5 each). A TP actor needs
  whole GPUs on one node, so a TP pool that does not fit is refused.
- ``--gpus-per-actor G``: G GPUs per actor (per rank), as asked, where it can work.

What cannot work is refused before any actor starts, instead of a silent fallback or a wait for Ray:

- more GPUs than the cluster has (C6: ``--gpus-per-actor 1`` for a 1P1D pair on one GPU waited 300 s for Ray to place
  the second actor, then failed). On a cluster serve joined (``elastic``: an autoscaler may add nodes, as KubeRay's does
  for the chart's role pods) the shortfall is a warning instead, and Ray waits as before;
- ``--kv-backend torch_dist`` where a prefill and a decode actor may share a GPU (C5: NCCL refuses two ranks on one
  device, so every request would be recomputed);
- ``--device cuda`` with ``--gpus-per-actor 0`` or no GPU, ``cuda_ipc`` on the CPU and ``shm`` on GPUs.

The in-place K/V backend on one node is ``cuda_ipc`` on GPUs (actors sharing a GPU map each other's cache there; with
one actor per GPU the actors see every GPU of their node, ``cluster.wire.node_gpus``), ``shm`` on the CPU;
``--kv-backend auto`` picks it per pair (``kv_transfer.backends.auto``).

:func:`landed_lines` formats where each actor actually landed, for serve to print once they are up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DEVICES_HINT = "auto | cpu | cuda | cuda:N"
_FRACTION_STEP = 10_000  # Ray keeps fractional resources to 1e-4


class PlacementError(ValueError):
    """A placement that cannot work; the message names the flag to change."""


@dataclass(frozen=True)
class PlacementRequest:
    """What serve was asked for (its flags), before looking at the cluster."""

    device: str = "auto"  # --device: auto | cpu | cuda | cuda:N
    gpus_per_actor: float | None = None  # --gpus-per-actor, per rank; None: the plan picks
    prefill: int = 1  # prefill actors (ignored in colocated mode)
    decode: int = 1  # decode actors (colocated: every actor)
    prefill_tp: int = 1  # ranks per prefill actor
    decode_tp: int = 1  # ranks per decode actor
    mode: str = "disaggregated"  # or "colocated": no K/V moves between actors
    kv_backend: str = "auto"  # --kv-backend
    kv_fallback: str = "torch_dist"  # --kv-fallback: what auto uses between nodes
    elastic: bool = False  # the cluster may grow (serve joined it): a GPU shortfall warns instead of refusing

    def __post_init__(self) -> None:
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device: {DEVICES_HINT}, got {self.device!r}")
        g = self.gpus_per_actor
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0):
            raise ValueError(f"gpus_per_actor: a number >= 0 or None, got {g!r}")
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode: 'disaggregated' or 'colocated', got {self.mode!r}")
        for name in ("prefill", "decode", "prefill_tp", "decode_tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: an int >= 0, got {v!r}")

    @property
    def actor_tps(self) -> tuple[int, ...]:
        """Every actor serve starts, as its TP size (decode ones first). Pure."""
        prefill = self.prefill if self.mode == "disaggregated" else 0
        return (self.decode_tp,) * self.decode + (self.prefill_tp,) * prefill

    @property
    def gpus_one_each(self) -> int:
        """GPUs the actors need at one GPU per rank. Pure."""
        return sum(self.actor_tps)


@dataclass(frozen=True)
class RolePlacement:
    """Where each actor of one role runs."""

    num_gpus: float  # Ray GPUs per actor (gpus_per_actor x the role's TP size); 0: the CPU
    device: str  # the engine's device: "cpu", or "cuda" / "cuda:N" (the N-th GPU Ray assigned the actor)
    kv_backend: str  # how its K/V moves (disaggregated), "none" (colocated)


@dataclass(frozen=True)
class Placement:
    """The decision: GPUs per rank and the device for every actor, the K/V backend, and what was weighed."""

    gpus_per_actor: float  # per rank, what every actor asks Ray for (x its TP size)
    device: str  # "cpu", or the CUDA device string the engines get
    kv_backend: str  # --kv-backend as it stands (auto: per pair, inplace_backend on one node)
    inplace_backend: str  # what moves K/V in place on one node: "cuda_ipc" on GPUs, "shm" on the CPU
    kv_fallback: str  # auto: between nodes
    prefill: RolePlacement | None  # None in colocated mode
    decode: RolePlacement
    actors: int  # actors placed
    gpus_needed: float  # GPUs the actors take (fractions summed)
    gpus_seen: int  # whole GPUs in the cluster when decided
    chosen: bool  # the plan picked gpus_per_actor (no --gpus-per-actor)
    warnings: tuple[str, ...] = ()  # what may not work as asked (an elastic cluster short of GPUs now)

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_actor > 0 and self.device != "cpu"

    @property
    def shares_gpus(self) -> bool:
        """Two actors may land on one GPU (each asks for half of one or less). Pure."""
        return self.on_gpu and self.gpus_per_actor <= 0.5

    def role(self, role: str) -> RolePlacement:
        """``role``'s placement ("prefill" or "decode"). ``ValueError`` for a role with no actors. Pure."""
        got = {"prefill": self.prefill, "decode": self.decode}.get(role)
        if got is None:
            raise ValueError(f"role: no {role} actors in this placement")
        return got

    def summary(self) -> str:
        """One line for serve's log: where the actors go and how K/V moves. Pure."""
        if not self.on_gpu:
            where = f"{self.actors} actor(s) on the CPU"
            if self.gpus_per_actor > 0:
                where += f", each holding {self.gpus_per_actor:g} GPU it does not use (--device cpu)"
        elif self.shares_gpus:
            where = (f"{self.actors} actor(s) sharing {math.ceil(self.gpus_needed - 1e-9)} GPU(s), "
                     f"{self.gpus_per_actor:g} GPU each, device {self.device}")
        else:
            where = f"{self.actors} actor(s) on {self.gpus_needed:g} GPU(s), {self.gpus_per_actor:g} per rank, " \
                    f"device {self.device}"
        how = "by the flag" if not self.chosen else f"picked for the {self.gpus_seen} GPU(s) Ray offers"
        return f"placement: {where} ({how}); K/V: {kv_words(self)}"


def kv_words(p: Placement) -> str:
    """How K/V moves, in words: ``auto (cuda_ipc on one node, else torch_dist)``. Pure."""
    if p.decode.kv_backend == "none":
        return "none (colocated)"
    if p.kv_backend == "auto":
        return f"auto ({p.inplace_backend} on one node, else {p.kv_fallback})"
    return p.kv_backend


def _fits(actor_tps: Sequence[int], per_rank: float, node_gpus: Sequence[int]) -> bool:
    """Whether actors of these TP sizes, each rank asking for ``per_rank`` GPUs, fit the nodes' GPUs: an actor asking
    for a fraction takes it of one GPU, one asking for one or more takes that many whole GPUs of one node (as Ray
    places them). First fit, largest actors first. Pure."""
    free = [[1.0] * n for n in node_gpus]
    for tp in sorted(actor_tps, reverse=True):
        count, each = (math.ceil(tp * per_rank - 1e-9), 1.0) if per_rank >= 1 else (tp, per_rank)
        for gpus in free:
            room = [i for i, f in enumerate(gpus) if f + 1e-9 >= each]
            if len(room) >= count:
                for i in room[:count]:
                    gpus[i] -= each
                break
        else:
            return False
    return True


def _share(actors: int, gpus: int) -> float:
    """``1/k`` of a GPU, ``k`` the fewest actors per GPU that put ``actors`` on ``gpus``, rounded down to Ray's 1e-4
    (so ``k`` of them fit one GPU). Pure."""
    k = math.ceil(actors / gpus)
    return 1.0 if k == 1 else math.floor(_FRACTION_STEP / k) / _FRACTION_STEP


def plan_placement(req: PlacementRequest, node_gpus: Sequence[float]) -> Placement:
    """Where ``req``'s actors run on a cluster whose alive Ray nodes offer ``node_gpus`` GPUs each (Ray's ``GPU``
    resource per node; fractions are dropped). Raises :class:`PlacementError` naming the fix for what cannot work
    (the module docstring lists it). Pure."""
    nodes = [int(math.floor(g + 1e-9)) for g in node_gpus if g > 0]
    seen = sum(nodes)
    tps = req.actor_tps
    tp_max = max(tps) if tps else 1
    disagg = req.mode == "disaggregated"
    cuda = req.device.startswith("cuda")
    warnings: list[str] = []
    asked = req.gpus_per_actor
    if req.device == "cpu":
        per_rank = asked or 0.0
    elif asked is not None:
        if cuda and asked <= 0:
            raise PlacementError(f"--device {req.device} with --gpus-per-actor 0: a CUDA engine needs GPUs from Ray "
                                 f"for its actor; leave --gpus-per-actor out (serve picks), set it (1: one actor per "
                                 f"GPU; 0.5: two share one), or use --device cpu")
        per_rank = asked
    elif seen == 0:
        if cuda:
            raise PlacementError(f"--device {req.device}: Ray offers no GPU in this cluster; use --device cpu (or "
                                 f"auto), or set --gpus-per-actor for GPU nodes that are yet to join")
        per_rank = 0.0
    elif tp_max > 1 or len(tps) <= seen:
        per_rank = 1.0  # one GPU per rank; a TP actor's ranks cannot share one
    else:
        per_rank = _share(len(tps), seen)
    if tp_max > 1 and per_rank not in (0, 1):
        raise PlacementError(f"--gpus-per-actor {per_rank:g}: a tensor-parallel actor (TP {tp_max}) takes one whole "
                             f"GPU per rank: use --gpus-per-actor 1 (or --device cpu)")
    on_gpu = per_rank > 0 and req.device != "cpu"
    device = ("cuda" if req.device == "auto" else req.device) if on_gpu else "cpu"
    ordinal = int(req.device.split(":", 1)[1]) if req.device.startswith("cuda:") else 0
    if on_gpu and tp_max == 1 and ordinal >= max(1, int(per_rank)):
        raise PlacementError(f"--device {req.device}: the GPU at index {ordinal} of those Ray assigns each actor, "
                             f"and each gets {per_rank:g}: use --device cuda (or auto)")
    needed = per_rank * sum(tps)
    if on_gpu and not _fits(tps, per_rank, nodes):
        fixes = []
        share = _share(len(tps), seen) if seen else per_rank
        if tp_max == 1 and share < per_rank:
            fixes.append(f"--gpus-per-actor {share:g}" + (" (actors share a GPU)" if share < 1 else ""))
        fixes += ["fewer actors (--prefill / --decode)"] + (["smaller --prefill-tp / --decode-tp"] if tp_max > 1
                                                                else [])
        fixes.append("--device cpu")
        what = (f"{len(tps)} actor(s) at {per_rank:g} GPU per rank need {needed:g} GPU(s)"
                + (", each actor's on one node" if tp_max > 1 or per_rank > 1 else ""))
        have = f"the cluster has {seen} GPU(s)" + (f" ({' + '.join(map(str, nodes))} per node)" if len(nodes) > 1
                                                      else "")
        msg = f"{what}, but {have}: use {', or '.join(fixes)}"
        if not req.elastic:
            raise PlacementError(msg)
        warnings.append(f"{msg}. Waiting for Ray to find them (a cluster an autoscaler grows)")
    shares = on_gpu and per_rank <= 0.5
    if disagg and shares and req.kv_backend == "torch_dist":
        raise PlacementError(f"--kv-backend torch_dist: NCCL cannot join two ranks on one GPU, and at {per_rank:g} GPU "
                             f"per actor a prefill and a decode actor share one; use --kv-backend cuda_ipc (or auto: "
                             f"in place on one node), or give each actor its own GPU (--gpus-per-actor 1: "
                             f"{req.gpus_one_each} GPUs)")
    if req.kv_backend == "cuda_ipc" and disagg and not on_gpu:
        raise PlacementError("--kv-backend cuda_ipc moves a GPU cache, and these actors run on the CPU (no GPU from "
                             "Ray): use --kv-backend shm (or auto)")
    if req.kv_backend == "shm" and disagg and on_gpu:
        raise PlacementError(f"--kv-backend shm moves a CPU cache, and these actors run on GPUs (device {device}): use "
                             f"--kv-backend cuda_ipc (or auto), or --device cpu")
    backend = req.kv_backend if disagg else "none"

    def role(tp: int) -> RolePlacement:
        return RolePlacement(num_gpus=per_rank * tp, device=device, kv_backend=backend)

    return Placement(gpus_per_actor=per_rank, device=device, kv_backend=req.kv_backend,
                     inplace_backend="cuda_ipc" if on_gpu else "shm", kv_fallback=req.kv_fallback,
                     prefill=role(req.prefill_tp) if disagg else None, decode=role(req.decode_tp), actors=len(tps),
                     gpus_needed=needed if on_gpu else 0.0, gpus_seen=seen, chosen=asked is None,
                     warnings=tuple(warnings))


@dataclass(frozen=True)
class LandedActor:
    """Where one actor landed, as it reported once up."""

    name: str
    role: str
    node_ip: str
    gpu_ids: tuple[str, ...]  # the GPUs Ray assigned it (ray.get_gpu_ids()); () on the CPU
    device: str  # its engine's device, in its own numbering (cuda:N, cpu)
    kv: str  # how its K/V moves (kv_words)


def landed_lines(actors: Sequence[LandedActor]) -> list[str]:
    """serve's lines, one per actor: name, role, node, GPU ids or CPU, device, K/V backend. Pure."""
    width = max((len(a.name) for a in actors), default=0)
    return [f"{a.name:<{width}}  {a.role:<7}  node {a.node_ip or '?'}  "
            f"{'GPU ' + ','.join(a.gpu_ids) if a.gpu_ids else 'CPU'}  device {a.device}  kv {a.kv}" for a in actors]
