"""Settings every worker actor shares (frozen, validated, torch-free)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from cluster.wire.auth import ClusterSecret
from engine.config import KV_CACHE_DTYPES, TP_KV_CACHES
from engine.spec.spec_config import SpeculativeConfig


TP_ROLES = {"prefill": "prefill_tp", "decode": "decode_tp"}  # a worker role -> the WorkerConfig field of its TP size
MAX_TP = 64  # EngineConfig.tensor_parallel_size's bound


def default_threads(cpus: int, actors: int, local: bool, cpus_per_actor: float, pinned: bool = False) -> int:
    """Torch threads per worker actor (per rank process of a tensor-parallel actor) when ``serve --threads`` is left
    out. Pure.

    A local cluster whose actors are pinned to their own cores (``pinned``: ``cluster.launcher.pins_cpus``) splits
    every core among the ``actors`` it may run, at least one thread each, and each actor computes with as many
    threads as it has cores: one colocated actor on 2 cores gets 2 (pinned to CPUs 0-1), on 16 cores 16; a 1P1D pair
    on 2 cores 1 each, on 16 cores 8 each; three actors on 2 cores 1 each (not pinned: they do not fit). The proxies
    and Ray's processes, a few percent of the CPU (docs/serving.md), share the actors' cores. Unpinned, a local
    cluster keeps one core for everything else and shares the rest: an unpinned engine thread that another process
    preempts stalls its siblings at every matmul (OpenMP waits for all of them), and the scheduler moves it between
    cores (measured on 2 cores before pinning, with Ray's nice 15: one colocated actor served 1.26x the output tok/s
    with 1 thread than with 2, docs/benchmarks.md). On an existing Ray cluster an actor gets the CPUs Ray reserves for
    it (``--cpus-per-actor``, at least 1)."""
    if local:
        return max(1, (cpus if pinned else cpus - 1) // max(1, actors))
    return max(1, int(cpus_per_actor))


@dataclass(frozen=True)
class WorkerConfig:
    model: str = "default"
    device: str = "auto"  # the engine's device: auto (CUDA when the actor sees a GPU) | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with native bf16, else float32
    # or "fp8" / "int8": KV stored and sent as float8_e4m3fn with per-(block, kv head) scales / int8 with per-(token,
    # kv head) scales
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    # KV cache per actor, GiB; None: 1 GiB on the CPU, on CUDA what gpu_memory_utilization leaves
    kv_cache_gib: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    num_threads: int = 1  # torch threads per actor (serve picks default_threads when --threads is left out)
    # tensor-parallel ranks of a prefill / a decode actor (a colocated actor is a decode one): the actor's engine
    # drives rank 0 and starts the other ranks itself (EngineConfig.tensor_parallel_size); on GPUs the actor holds
    # one GPU per rank. A flexible actor keeps its size, so with different sizes roles are never flipped in place
    prefill_tp: int = 1
    decode_tp: int = 1
    # where a TP actor's K/V cache lives (EngineConfig.tp_kv_cache): "shared" (the CPU: one file of every head on rank
    # 0) or "per_rank" (each rank its own heads, the layout CUDA ranks need; K/V goes rank to rank over sockets)
    tp_kv_cache: str = "shared"
    # CUDA: the share of the device's memory this actor's engine may take (weights + activations + KV cache); actors
    # sharing one GPU (a fractional --gpus-per-actor) get their share of it
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # CUDA: decode steps without CUDA graphs
    # the actor sees every GPU of its node (Ray left CUDA_VISIBLE_DEVICES as the node has it: cluster.wire.node_gpus)
    # and runs on the one Ray assigned it, cuda:N naming the N-th of those; serve sets it (ServeConfig.share_node_gpus)
    share_node_gpus: bool = False
    # CPU: the KV cache in shared memory same-node KV writers can map (set by serve for --kv-backend shm / auto)
    shared_kv: bool = False
    # a reservation with no KV and no start by then is released (orphan cleanup); each KV part that arrives renews it.
    # Long enough to cover a busy prefill queue.
    reservation_ttl_s: float = 120.0
    # once the prefill actor reports its sends done, how long the decode actor still waits for missing K/V parts
    # before it treats the transfer as failed (recompute or fail, by policy)
    kv_wait_s: float = 30.0
    cache_dir: str | None = None
    # the per-cluster MAC key (cluster.wire.auth) this worker signs and checks K/V parts, in-place handshakes and
    # token-stream frames with; serve sets it. None: authentication off. Never shown by repr.
    cluster_secret: ClusterSecret | None = None
    # K/V tiers below each actor's device pool (docs/kv-tiers.md): host DRAM (L2), a node-local directory (L3; decode
    # actors write finished requests' blocks back there). 0 / None: off
    kv_host_gib: float = 0.0
    kv_disk_dir: str | None = None
    kv_disk_gib: float = 0.0
    kv_disk_integrity: str = "blake2b"  # how L3 files are checked: blake2b (keyed, ~8x faster on a CPU) | payload_mac
    kv_prefill_tokens_per_s: float = 0.0  # fetch from a tier only when it loads faster than this computes; 0: always
    # speculative decoding (EngineConfig.speculative_config), as vLLM's dict or its JSON text; held as the validated
    # dict (JSON-able, crosses to the actors as is). None: off
    speculative_config: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        spec = SpeculativeConfig.of(self.speculative_config)  # ValueError naming the bad key or value
        object.__setattr__(self, "speculative_config", None if spec is None else spec.as_dict())
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {self.num_threads}")
        for name in TP_ROLES.values():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_TP:
                raise ValueError(f"{name}: must be an int in [1, {MAX_TP}], got {v!r}")
        if self.tp_kv_cache not in TP_KV_CACHES:
            raise ValueError(f"tp_kv_cache: must be one of {TP_KV_CACHES}, got {self.tp_kv_cache!r}")
        for name in ("reservation_ttl_s", "kv_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.cluster_secret is not None and not isinstance(self.cluster_secret, ClusterSecret):
            raise ValueError(f"cluster_secret: must be a ClusterSecret or None, got "
                             f"{type(self.cluster_secret).__name__}")

    def tp_for(self, role: str) -> int:
        """The tensor-parallel size of an actor of ``role`` ("prefill" or "decode"; a colocated actor is a decode
        one). ``ValueError`` for another role. Pure."""
        if role not in TP_ROLES:
            raise ValueError(f"role: must be one of {tuple(TP_ROLES)}, got {role!r}")
        return int(getattr(self, TP_ROLES[role]))

    @property
    def flips_keep_tp(self) -> bool:
        """Whether a role flip in place keeps the actor's TP size (both roles' sizes are equal). Pure."""
        return self.prefill_tp == self.decode_tp

    def engine_kwargs(self) -> dict[str, Any]:
        """The EngineConfig keyword arguments this config sets (the TP size is the role's: ``load_engine``). Pure."""
        d = asdict(self)
        for name in ("reservation_ttl_s", "kv_wait_s", "share_node_gpus", "cluster_secret", *TP_ROLES.values(),
                     "kv_host_gib", "kv_disk_dir", "kv_disk_gib", "kv_disk_integrity",
                     "kv_prefill_tokens_per_s"):
            d.pop(name)
        return d
