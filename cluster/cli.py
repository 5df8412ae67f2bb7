"""The ``pdcluster`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cluster.launcher import check_tp_device  # noqa: F401  (serve's check before start; tests import it here)
from cluster.cli_status import cmd_status
from cluster.placement import PlacementError, landed_lines
from cluster.wire.proxy_settings import ProxySettings
from cluster.wire.proxy_settings import add_flags as add_proxy_flags
from cluster.wire.worker_config import WorkerConfig

if TYPE_CHECKING:
    from cluster.launcher import ServeConfig


def _default(cls: Any, name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name``: a flag takes its default from the config it fills, never
    restates it."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _serve_default(name: str) -> Any:
    from cluster.launcher import ServeConfig

    return _default(ServeConfig, name)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=_default(WorkerConfig, "model"),
                   help="'default' (embedded SmolLM2-135M-Instruct) or a HF folder")
    p.add_argument("--dtype", default=_default(WorkerConfig, "dtype"), choices=["auto", "float32", "bfloat16"],
                   help="weights, activations and KV: auto = bfloat16 on CUDA and on CPUs with native bf16 "
                        "(avx512_bf16/amx_bf16), float32 on other CPUs; float32 is exact (bf16 loses near-ties)")
    p.add_argument("--device", default=_default(WorkerConfig, "device"),
                   help="auto (CUDA when the process sees a GPU; serve: on the GPUs Ray offers, if any) | cpu | "
                        "cuda | cuda:N (serve: the N-th GPU Ray assigns each actor)")
    p.add_argument("--gpu-memory-utilization", type=float, default=_default(WorkerConfig, "gpu_memory_utilization"),
                   help="CUDA: fraction of the device's memory for weights, activations and KV cache (serve scales "
                        "it by a fractional --gpus-per-actor, so actors sharing a GPU split it)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    p.add_argument("--kv-cache-dtype", default=_default(WorkerConfig, "kv_cache_dtype"),
                   choices=["auto", "fp8", "int8"],
                   help="KV storage: auto (= --dtype), fp8 (float8_e4m3fn, a scale per block and kv head) or int8 (a "
                        "scale per token and kv head: closer to the unquantized text); about half of bfloat16's bytes")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (generate: torch's choice; serve, per actor: the machine's cores "
                        "but one shared among the actors a local cluster may run, or --cpus-per-actor on an existing "
                        "Ray cluster)")
    p.add_argument("--cache-dir", default=None, help="where the default model is converted (~/.cache/pdcluster)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding as vLLM spells it, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (docs/speculative.md; ngram only so far)')


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.spec.spec_config import SpeculativeConfig

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:  # before loading the model, so bad parameters fail at once
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        SpeculativeConfig.of(args.speculative_config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, num_threads=args.threads,
              cache_dir=args.cache_dir, progress=progress, device=args.device,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
              speculative_config=args.speculative_config)
    print(f"[pdcluster] model ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

    def stream(out) -> None:  # type: ignore[no-untyped-def]
        sys.stdout.write(out.new_text)  # each output carries the text new since the previous one
        sys.stdout.flush()

    t1 = time.perf_counter()
    try:
        if args.raw:
            (out,) = llm.generate([args.prompt], params, on_output=stream)
        else:
            (out,) = llm.chat([[{"role": "user", "content": args.prompt}]], params, on_output=stream)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t1
    n = len(out.token_ids)
    print(f"\n[pdcluster] {n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s), finish_reason={out.finish_reason}",
          file=sys.stderr)
    return 0


def serve_threads(cfg: ServeConfig) -> int:
    """Torch threads per actor (per rank of a tensor-parallel one) for ``serve`` without ``--threads``: this machine's
    cores shared among the rank processes a local cluster may run (``cfg.max_ranks``), all of them when its actors
    are pinned to their own cores (``pins_cpus``), all but one when not; or ``--cpus-per-actor`` on an existing
    cluster (``cluster.wire.worker_config.default_threads``)."""
    import os

    from cluster.launcher import pins_cpus
    from cluster.wire.worker_config import default_threads

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return default_threads(cpus, cfg.max_ranks, local=not cfg.ray_address, cpus_per_actor=cfg.cpus_per_actor,
                           pinned=pins_cpus(cfg))


def tp_sizes(mode: str, tensor_parallel_size: int | None, prefill_tp: int | None,
             decode_tp: int | None) -> tuple[int, int]:
    """``serve``'s (prefill, decode) tensor-parallel sizes from ``--tensor-parallel-size`` (both pools; the colocated
    actors) and the per-pool ``--prefill-tp`` / ``--decode-tp`` that override it; None: not given (1). ``ValueError``
    naming the flag for a size below 1 or above 64, or ``--prefill-tp`` in colocated mode (it has no prefill pool).
    Pure."""
    from cluster.wire.worker_config import MAX_TP

    for flag, v in (("--tensor-parallel-size", tensor_parallel_size), ("--prefill-tp", prefill_tp),
                    ("--decode-tp", decode_tp)):
        if v is not None and not 1 <= v <= MAX_TP:
            raise ValueError(f"{flag}: ranks per actor must be in [1, {MAX_TP}], got {v}")
    if mode == "colocated" and prefill_tp is not None:
        raise ValueError(f"--prefill-tp: colocated mode has no prefill pool (its actors prefill for themselves): "
                         f"use --tensor-parallel-size or --decode-tp, got --prefill-tp {prefill_tp}")
    both = tensor_parallel_size or 1
    return (1 if mode == "colocated" else prefill_tp or both), decode_tp or both


def serve_config(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServeConfig:
    """``serve``'s :class:`~cluster.launcher.ServeConfig` from its parsed arguments (threads per actor picked by
    :func:`serve_threads` when ``--threads`` is left out; the cluster secret from ``environ``, default
    ``os.environ``). ``ValueError`` naming the field or flag for a bad combination. Reads the machine's CPU count;
    starts nothing."""
    from cluster.launcher import ServeConfig
    from cluster.wire.auth import ENV_VAR, ClusterSecret
    from cluster.wire.worker_config import WorkerConfig

    # the cluster secret: PDCLUSTER_CLUSTER_SECRET when set, else serve makes one for itself and its own proxies
    secret = None if args.no_cluster_auth else ClusterSecret.from_env(environ)
    if secret is None and not args.no_cluster_auth and args.proxies == 0:
        raise ValueError(f"--proxies 0: the proxies started elsewhere need this cluster's secret; set {ENV_VAR} "
                         f"(the same in every proxy) or pass --no-cluster-auth")
    prefill_tp, decode_tp = tp_sizes(args.mode, args.tensor_parallel_size, args.prefill_tp, args.decode_tp)
    cfg = ServeConfig(
        worker=WorkerConfig(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                            num_threads=args.threads or 1, device=args.device,
                            enforce_eager=args.enforce_eager,
                            gpu_memory_utilization=args.gpu_memory_utilization * (
                                args.gpus_per_actor if 0 < (args.gpus_per_actor or 0) < 1 else 1.0),
                            cache_dir=args.cache_dir, kv_cache_gib=args.kv_cache_gib,
                            kv_host_gib=args.kv_host_gib, kv_disk_dir=args.kv_disk_dir, kv_disk_gib=args.kv_disk_gib,
                            kv_disk_integrity=args.kv_disk_integrity,
                            kv_prefill_tokens_per_s=args.kv_prefill_tokens_per_s,
                            prefill_tp=prefill_tp, decode_tp=decode_tp, tp_kv_cache=tp_kv_cache(args),
                            speculative_config=args.speculative_config),
        decode=args.decode, prefill=args.prefill, mode=args.mode, kv_backend=args.kv_backend, host=args.host,
        kv_fallback=args.kv_fallback, kv_inplace_checksum=args.kv_inplace_checksum,
        kv_host=args.kv_host,
        port=args.port, cpus_per_actor=args.cpus_per_actor, gpus_per_actor=args.gpus_per_actor,
        share_node_gpus=not args.no_share_node_gpus,
        pin_cpus=not args.no_pin_cpus,
        on_transfer_failure=args.on_transfer_failure,
        proxies=args.proxies, ray_address=args.ray_address, model_name=args.served_model_name,
        budget=args.budget, controller_interval_s=args.controller_interval,
        season_window_s=args.season_window, role_resources=args.role_resources,
        controller_profile=args.controller_profile or "",
        proxy=ProxySettings.from_args(args), cluster_auth=not args.no_cluster_auth, cluster_secret=secret)
    if not args.threads:
        cfg = dataclasses.replace(cfg, worker=dataclasses.replace(cfg.worker, num_threads=serve_threads(cfg)))
    return cfg


def tp_kv_cache(args: argparse.Namespace) -> str:
    """``--tp-kv-cache``, checked against the K/V backend: ranks holding their own heads send and receive them over
    sockets (``auto`` uses its socket backend for them; ``shm`` writes one full-head cache in place and cannot).
    ``ValueError`` naming both flags. Pure."""
    if args.tp_kv_cache == "per_rank" and args.kv_backend in ("shm", "cuda_ipc"):
        raise ValueError(f"--tp-kv-cache per_rank: each rank sends its own heads over a socket backend; --kv-backend "
                         f"{args.kv_backend} writes one full-head cache in place (use torch_dist, ucx or auto)")
    return str(args.tp_kv_cache)


def check_model_tp(cfg: ServeConfig) -> None:
    """``ValueError`` naming the pool's flag when the model cannot be split over a pool's TP size (heads, kv heads,
    intermediate sizes: ``engine.models.tp.check_tp``), before any actor loads it. A model folder not on this machine (a
    path on the Ray cluster's nodes) is left to the engines. Reads the model's config.json; nothing with TP 1."""
    from pathlib import Path

    if cfg.mode == "disaggregated":
        sizes = {"--prefill-tp": cfg.worker.prefill_tp, "--decode-tp": cfg.worker.decode_tp}
    else:
        sizes = {"--tensor-parallel-size": cfg.worker.decode_tp}  # or --decode-tp: the colocated actors
    if max(sizes.values()) == 1:
        return
    if cfg.worker.model == "default":
        from engine.models.default_model import resolve_model

        folder = resolve_model("default", cfg.worker.cache_dir)
    else:
        folder = Path(cfg.worker.model)
    if not (folder / "config.json").is_file():
        return
    from engine.models.model_config import load_model_config
    from engine.models.tp import check_tp

    model = load_model_config(folder)
    for flag, size in sizes.items():
        try:
            check_tp(model, size)
        except ValueError as e:
            raise ValueError(f"{flag} {size}: {e}") from None


def _cmd_serve(args: argparse.Namespace) -> int:
    import os
    import signal

    from cluster.launcher import Cluster

    try:
        cfg = serve_config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.ask is not None and cfg.proxies == 0:
        print("error: --ask needs a proxy (--proxies >= 1)", file=sys.stderr)
        return 2
    if (args.record or args.dry_run) and not args.autoscale:
        print("error: --record and --dry-run go with --autoscale", file=sys.stderr)
        return 2
    if args.record and not os.path.isdir(os.path.dirname(os.path.abspath(args.record))):
        print(f"error: --record: no such folder for {args.record!r}", file=sys.stderr)
        return 2
    if cfg.worker.model == "default":  # convert the default model once, here, not in every actor at the same time
        from engine.models.default_model import resolve_model

        resolve_model("default", cfg.worker.cache_dir)
    try:
        check_tp_device(cfg)
        check_model_tp(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cluster = Cluster(cfg, progress=lambda msg: print(f"[pdcluster] {msg}", file=sys.stderr, flush=True))
    stop = {"now": False}

    def on_signal(signum: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        pre = f"{cfg.prefill} prefill + " if cfg.mode == "disaggregated" else ""
        print(f"[pdcluster] starting {pre}{cfg.decode} decode actor(s) ({cfg.mode}) and {cfg.proxies} proxy(ies)...",
              file=sys.stderr, flush=True)
        try:
            cluster.start()
        except (ConnectionError, PlacementError) as e:  # --ray-address that does not answer; a placement refused
            print(f"error: {e}", file=sys.stderr)
            return 2
        for line in landed_lines(cluster.landed):  # where each actor runs: node, GPU or CPU, device, K/V backend
            print(f"[pdcluster] actor {line}", flush=True)
        for url in cluster.urls:
            print(f"[pdcluster] ready: {url}/v1  (model name {cfg.model_name!r})", flush=True)
        if args.autoscale:
            if cluster.manager is None:
                print("error: --autoscale needs --mode disaggregated", file=sys.stderr)
                return 2
            import ray

            from pathlib import Path

            record = str(Path(args.record).resolve()) if args.record else None
            ray.get(cluster.manager.autoscale.remote(True, record=record, dry_run=args.dry_run), timeout=60)
            print(f"[pdcluster] autoscale on{' (dry run: decisions logged, not carried out)' if args.dry_run else ''}"
                  f"{f', recording to {record}' if record else ''}", flush=True)
        if not cluster.urls:
            print("[pdcluster] workers ready; no proxies here (--proxies 0): start them with python -m proxy.main",
                  flush=True)
        if args.ask is not None:
            return _ask(cluster.urls[0], cfg.model_name, args.ask)
        while not stop["now"]:
            time.sleep(0.2)
    finally:
        print("[pdcluster] shutting down", file=sys.stderr, flush=True)
        cluster.stop()
    return 0


def _ask(url: str, model: str, question: str) -> int:
    """Send one streaming chat request over HTTP, as any OpenAI client would, and print the answer as it comes."""
    import http.client
    import json
    from urllib.parse import urlparse

    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 128,
                       "temperature": 0, "stream": True})
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        print(f"error: HTTP {resp.status}: {resp.read().decode()}", file=sys.stderr)
        return 1
    print(f"[pdcluster] POST {url}/v1/chat/completions -> 200, streaming:", file=sys.stderr, flush=True)
    for line in resp:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                sys.stdout.write(choice["delta"].get("content") or "")
                sys.stdout.flush()
    print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="offline generation with the engine, streaming text as it comes")
    g.add_argument("prompt")
    _add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.set_defaults(func=_cmd_generate)
    sv = sub.add_parser("serve", help="start a cluster on Ray and serve the OpenAI API")
    _add_engine_args(sv)
    sv.add_argument("--decode", type=int, default=_serve_default("decode"), help="decode actors")
    sv.add_argument("--prefill", type=int, default=_serve_default("prefill"),
                    help="prefill actors (disaggregated mode)")
    sv.add_argument("--mode", default=_serve_default("mode"), choices=["disaggregated", "colocated"])
    sv.add_argument("--kv-backend", default=_serve_default("kv_backend"),
                    choices=["auto", "torch_dist", "ucx", "shm", "cuda_ipc"],
                    help="how K/V moves from prefill to decode actors: auto (per pair: written in place into the "
                         "decode actor's cache on one node, shm on CPU / cuda_ipc on GPU; else --kv-fallback), or one "
                         "backend for every pair")
    sv.add_argument("--kv-fallback", default=_serve_default("kv_fallback"), choices=["torch_dist", "ucx"],
                    help="auto: the socket backend between actors on different nodes (torch_dist: gloo / NCCL)")
    sv.add_argument("--kv-inplace-checksum", action="store_true",
                    help="in-place backends: checksum every written part (socket backends always do)")
    sv.add_argument("--no-cluster-auth", action="store_true",
                    help="do not MAC K/V transfers and token streams (default: every part, in-place handshake and "
                         "token frame carries an HMAC under the cluster secret, PDCLUSTER_CLUSTER_SECRET or one made "
                         "at start; unauthenticated messages are dropped and counted in /metrics)")
    sv.add_argument("--on-transfer-failure", default=_serve_default("on_transfer_failure"),
                    choices=["recompute", "fail"],
                    help="what a decode actor does when a request's KV does not arrive intact")
    sv.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                    help="ranks each actor's model is sharded over, in both pools (colocated: its actors); each rank "
                         "is a process (on GPUs one GPU each: the actor asks Ray for N x --gpus-per-actor)")
    sv.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                    help="the prefill pool's TP size (overrides --tensor-parallel-size; disaggregated mode). Pools "
                         "at different sizes never flip roles in place: scaling starts and drains actors")
    sv.add_argument("--decode-tp", type=int, default=None, metavar="M",
                    help="the decode pool's TP size (overrides --tensor-parallel-size)")
    sv.add_argument("--tp-kv-cache", choices=("shared", "per_rank"), default="shared",
                    help="a TP actor's K/V cache: one file of every head on rank 0 (shared, the CPU) or each rank's "
                         "own heads (per_rank: the layout GPUs need; K/V goes rank to rank over sockets)")
    sv.add_argument("--cpus-per-actor", type=float, default=_serve_default("cpus_per_actor"))
    sv.add_argument("--gpus-per-actor", type=float, default=_serve_default("gpus_per_actor"),
                    help="Ray GPUs per actor, per rank of a tensor-parallel one (0: CPU; 1 with TP > 1; 0.5: two "
                         "actors share a GPU). Default: serve picks from the GPUs Ray offers: one per actor (rank) "
                         "when there are enough, else TP-1 actors share GPUs, the CPU when there are none")
    sv.add_argument("--no-share-node-gpus", action="store_true",
                    help="GPU actors see only their own GPUs (Ray's CUDA_VISIBLE_DEVICES) instead of every GPU of "
                         "their node (each still runs on the one Ray assigned it); actors on different GPUs of one "
                         "node then move K/V over --kv-fallback instead of writing it in place")
    sv.add_argument("--no-pin-cpus", action="store_true",
                    help="leave the worker actors' engine threads unpinned (by default a local CPU cluster pins each "
                         "actor's engine thread to its own cores when they all fit, and without --threads each "
                         "actor computes with all of its cores: one colocated actor on 2 cores with 2 threads on "
                         "CPUs 0-1, a 1P1D pair with 1 each on CPUs 0 and 1; unpinned, serve keeps one core for the "
                         "rest: 1 thread for a colocated actor on 2 cores; pass this when other work shares the "
                         "machine)")
    sv.add_argument("--host", default=_serve_default("host"),
                    help="where the proxies serve HTTP (0.0.0.0: every interface)")
    sv.add_argument("--kv-host", default=None,
                    help="the address every actor's KV endpoint binds and advertises (default: each actor's own node "
                         "address, PDCLUSTER_NODE_IP or Ray's node IP; 127.0.0.1 without --ray-address); one address "
                         "for all actors fits only a cluster on one machine")
    sv.add_argument("--port", type=int, default=_serve_default("port"),
                    help="first proxy's port; proxy i listens on port + i (0: free ports, printed)")
    sv.add_argument("--proxies", type=int, default=_serve_default("proxies"))
    sv.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting a local one")
    sv.add_argument("--kv-cache-gib", type=float, default=None,
                    help="KV cache per actor (default: 1 GiB on the CPU; on CUDA what --gpu-memory-utilization leaves)")
    sv.add_argument("--kv-host-gib", type=float, default=0.0,
                    help="K/V tier L2: host DRAM per actor for blocks the device pool evicts (docs/kv-tiers.md)")
    sv.add_argument("--kv-disk-dir", default=None,
                    help="K/V tier L3: a node-local directory of block files shared by the node's actors")
    sv.add_argument("--kv-disk-gib", type=float, default=0.0, help="K/V tier L3: bytes each actor may write there")
    sv.add_argument("--kv-disk-integrity", choices=("payload_mac", "blake2b"), default="blake2b",
                    help="how L3 block files are checked on read: keyed BLAKE2b (default; ~8x faster on a CPU) or "
                         "the transfer's payload MAC")
    sv.add_argument("--kv-prefill-tokens-per-s", type=float, default=0.0,
                    help="K/V tiers: read a tier only while its measured bandwidth loads a block faster than this "
                         "prefill speed computes it (0: always read)")
    sv.add_argument("--served-model-name", default=_serve_default("model_name"))
    add_proxy_flags(sv)  # each proxy's queue, reservations, resumes, SLOs, tool calls, chat template
    sv.add_argument("--controller-interval", type=float, default=_serve_default("controller_interval_s"),
                    help="seconds between autoscale decisions")
    sv.add_argument("--season-window", type=float, default=None, metavar="SECONDS",
                    help="seconds of load autoscale looks back over for a repeating pattern to move ahead of (0: off; "
                         "default: two hours)")
    sv.add_argument("--controller-profile", default=None,
                    help="a pdcluster profile cost profile (JSON): autoscale's per-actor capacity until measured")
    sv.add_argument("--autoscale", action="store_true", help="start with the controller moving the ratio")
    sv.add_argument("--record", default=None, metavar="FILE",
                    help="with --autoscale: write the control loop's record (arrivals, observations, every decision "
                         "with its reason; JSON lines) for pdcluster simulate --replay")
    sv.add_argument("--dry-run", action="store_true",
                    help="with --autoscale: decide and log every decision without carrying any out")
    sv.add_argument("--role-resources", action="store_true",
                    help="place actors on Ray nodes offering the custom resource pdcluster_prefill / pdcluster_decode")
    sv.add_argument("--budget", type=int, default=_serve_default("budget"),
                    help="most ranks (GPUs) `pdcluster scale` / autoscale may run, a TP-N actor counting N "
                         "(default: what --prefill and --decode start)")
    sv.add_argument("--ask", default=None, metavar="QUESTION",
                    help="send this one chat request over HTTP once ready, print the answer, shut down")
    sv.set_defaults(func=_cmd_serve)
    st = sub.add_parser("status", help="print the pools: each actor's health, KV blocks and token counters")
    st.add_argument("--url", default="http://127.0.0.1:8000", help="a proxy's base URL")
    st.add_argument("--api-key", default=None, help="the proxies' API key, if they have one (default: "
                                                   "$PDCLUSTER_API_KEY)")
    st.set_defaults(func=cmd_status)
    from cluster.profiler import add_parser as add_profile
    from cluster.cli_scale import add_parsers as add_scale
    from cluster.cli_simulate import add_parser as add_simulate
    from cluster.loadgen.cli import add_parser as add_bench

    add_scale(sub)
    add_simulate(sub)
    add_profile(sub)
    add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
