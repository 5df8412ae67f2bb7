"""``KVTierConfig``: which tiers an engine keeps below its device pool, and how big they are."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVTierConfig:
    """Frozen, validated. All tiers off by default (``host_bytes == 0`` and no ``disk_dir``)."""

    host_bytes: int = 0  # L2: host-DRAM bytes for demoted full blocks (pinned on CUDA); 0: no L2
    disk_dir: str | None = None  # L3: a directory of block files (shared by the actors of one node); None: no L3
    disk_bytes: int = 0  # L3: the most bytes of block files this engine writes before it evicts its oldest
    write_back: bool = False  # a finished request's full blocks (prompt and answer) go to the tiers (decode actors)
    disk_integrity: str = "blake2b"  # how L3 files are checked: "blake2b" or "payload_mac" (kv_transfer/tiers)
    # the prefill speed (tokens/s) a fetch must beat: a tier whose measured bandwidth loads a block slower than this
    # computes it is not read (engine/kv/tiers/fetch_or_recompute.py); 0: always fetch
    prefill_tokens_per_s: float = 0.0
    max_pending_writes: int = 256  # L3 writes queued off the serving thread; more are dropped (a miss later)

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes", "max_pending_writes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {v!r}")
        if self.disk_dir is not None and self.disk_bytes <= 0:
            raise ValueError("disk_bytes: must be > 0 when disk_dir is set")
        if self.disk_dir is None and self.disk_bytes:
            raise ValueError("disk_dir: must be set when disk_bytes is")
        if self.prefill_tokens_per_s < 0:
            raise ValueError(f"prefill_tokens_per_s: must be >= 0, got {self.prefill_tokens_per_s}")
        if self.disk_integrity not in ("payload_mac", "blake2b"):
            raise ValueError(f"disk_integrity: must be 'payload_mac' or 'blake2b', got {self.disk_integrity!r}")
        if self.max_pending_writes < 1:
            raise ValueError("max_pending_writes: must be >= 1")

    @property
    def enabled(self) -> bool:
        """Whether any tier below the device pool exists. Pure."""
        return self.host_bytes > 0 or self.disk_dir is not None
