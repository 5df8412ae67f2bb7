"""Run one proxy process against pools already on a Ray cluster: ``python -m proxy.main --ray-address ADDR``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys

import ray
from aiohttp import web

from cluster.wire.auth import ENV_VAR, ClusterSecret
from cluster.wire.node import advertised, is_wildcard, node_ip
from cluster.wire.ray_address import wait_reachable
from proxy.openai_protocol import ProtocolConfig
from cluster.wire.names import NAMESPACE
from proxy.pools import Pools
from proxy.server import Proxy, ProxyConfig
from cluster.wire.proxy_settings import add_flags, settings_or_exit
from engine.text.tokenization import PromptTokenizer

log = logging.getLogger("pdcluster.proxy")


async def _wait_for_decode(pools: Pools, timeout_s: float) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        await pools.refresh()
        live = pools.live_decode()
        if live:
            return live[0].info
        if loop.time() > deadline:
            raise SystemExit("no decode actor became ready")
        await asyncio.sleep(0.5)


def build_parser() -> argparse.ArgumentParser:
    """The proxy's flags; what it shares with ``pdcluster serve`` comes from :func:`add_flags`. Pure."""
    ap = argparse.ArgumentParser(prog="pdcluster-proxy")
    ap.add_argument("--ray-address", required=True)
    ap.add_argument("--host", default="127.0.0.1", help="where HTTP is served (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, required=True, help="0: let the OS pick a free port")
    ap.add_argument("--port-file", default=None, help="write the port listened on here once bound")
    ap.add_argument("--model-name", default="default")
    add_flags(ap)  # queue, reservations, resumes, SLOs, tool calls, chat template: as `pdcluster serve` takes them
    ap.add_argument("--disaggregated", action="store_true", help="ready only once prefill actors are up too")
    ap.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds in-flight streams get on SIGTERM")
    ap.add_argument("--keepalive-timeout", type=float, default=75.0,
                    help="idle keep-alive seconds; keep it above the load balancer's idle timeout (60 s on most)")
    ap.add_argument("--stream-host", default=None,
                    help="where the token stream (decode actors -> this proxy) binds (default: every interface when "
                         "--host is 0.0.0.0, else this node's address: PDCLUSTER_NODE_IP or Ray's node IP)")
    ap.add_argument("--advertise-host", default=None,
                    help="the address decode actors reach the token stream at (default: --stream-host, or this "
                         "node's address when that is a wildcard)")
    ap.add_argument("--no-cluster-auth", action="store_true",
                    help="accept token-stream messages without a MAC (only for a cluster served with "
                         "--no-cluster-auth); otherwise the secret comes from PDCLUSTER_CLUSTER_SECRET")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    settings = settings_or_exit(ap, args)
    chat_template = None
    if settings.chat_template:
        try:
            with open(settings.chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        except OSError as e:
            ap.error(f"--chat-template: {e}")
    secret = None if args.no_cluster_auth else ClusterSecret.from_env()
    if secret is None and not args.no_cluster_auth:
        raise SystemExit(f"{ENV_VAR} is not set: give this proxy its cluster's secret, or pass --no-cluster-auth")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s proxy %(levelname)s %(message)s")
    wait_reachable(args.ray_address, timeout_s=300.0, progress=log.info)  # a pod's Ray head may still be starting
    ray.init(address=args.ray_address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
    # decode actors on other nodes push tokens here: never a loopback address unless asked for (an embedded Ray)
    stream_host = args.stream_host or (args.host if is_wildcard(args.host) else node_ip())
    stream_advertise = args.advertise_host or advertised(stream_host)
    pools = Pools()
    info = asyncio.run(_wait_for_decode(pools, 300))
    proto = ProtocolConfig(served_models=(args.model_name,), max_model_len=int(info["max_model_len"]),
                           vocab_size=int(info["vocab_size"]), tool_parser=settings.tool_call_parser or None)
    proxy = Proxy(pools, PromptTokenizer(info["model_path"], chat_template), proto, int(info["block_size"]),
                  ProxyConfig(model_name=args.model_name, settings=settings,
                              api_key=os.environ.get("PDCLUSTER_API_KEY") or None),
                  stream_host=stream_host, stream_advertise_host=stream_advertise,
                  disaggregated=args.disaggregated, stream_secret=secret)
    # bind here, so that port 0 gets a port no other process can take between choosing and binding it
    sock = socket.create_server((args.host, args.port), reuse_port=False)
    port = sock.getsockname()[1]
    if args.port_file:
        tmp = f"{args.port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    print(f"[pdcluster] proxy listening on http://{args.host}:{port}", flush=True)
    web.run_app(proxy.app(), sock=sock, handler_cancellation=True, shutdown_timeout=args.shutdown_grace, print=None,
                keepalive_timeout=args.keepalive_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
