"""``pdcluster scale`` and ``pdcluster autoscale``: change a running cluster's pools through its PoolManager actor."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


WAIT_HELP = "seconds to wait for --ray-address to answer before giving up (exit status 2)"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    sc = sub.add_parser("scale", help="resize a running cluster's prefill and decode pools (drains what it removes)")
    sc.add_argument("--prefill", type=int, required=True)
    sc.add_argument("--decode", type=int, required=True)
    sc.add_argument("--ray-address", default="auto", help="the cluster's Ray (default: the local one)")
    sc.add_argument("--wait-s", type=float, default=10.0, help=WAIT_HELP)
    sc.set_defaults(func=_cmd_scale)
    au = sub.add_parser("autoscale", help="let the controller move the prefill:decode ratio (on) or stop it (off)")
    au.add_argument("state", choices=["on", "off"])
    au.add_argument("--record", default=None, metavar="FILE",
                    help="on: write the control loop's record (arrivals, observations, every decision with its reason; "
                         "JSON lines) to FILE on the node the pool manager runs on, for pdcluster simulate --replay")
    au.add_argument("--dry-run", action="store_true",
                    help="on: decide and log every decision (pdcluster status, the record) without carrying any out")
    au.add_argument("--ray-address", default="auto", help="the cluster's Ray (default: the local one)")
    au.add_argument("--wait-s", type=float, default=10.0, help=WAIT_HELP)
    au.set_defaults(func=_cmd_autoscale)


def _manager(address: str, wait_s: float) -> Any:
    """The running cluster's PoolManager actor, or None (the error printed) if there is none at ``address`` (one
    that does not answer within ``wait_s`` seconds)."""
    import ray

    from cluster.wire.ray_address import wait_reachable
    from cluster.wire.names import MANAGER_NAME, NAMESPACE

    try:
        wait_reachable(address, timeout_s=wait_s)
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        return ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)
    except (ConnectionError, ValueError) as e:
        print(f"error: no running pdcluster found at {address}: {e}", file=sys.stderr)
        return None


def _cmd_scale(args: argparse.Namespace) -> int:
    import ray

    manager = _manager(args.ray_address, args.wait_s)
    if manager is None:
        return 2
    done = manager.scale.remote(args.prefill, args.decode)
    seen = {(e["t"], e["event"]) for e in ray.get(manager.status.remote(), timeout=30)["events"]}
    while True:  # progress: the manager's events as they happen
        ready, _ = ray.wait([done], timeout=0.5)
        for e in ray.get(manager.status.remote(), timeout=30)["events"]:
            if (e["t"], e["event"]) not in seen:
                seen.add((e["t"], e["event"]))
                print(f"[pdcluster] {time.strftime('%H:%M:%S', time.localtime(e['t']))} {e['event']}", flush=True)
        if ready:
            break
    try:
        counts = ray.get(done)
    except ray.exceptions.RayTaskError as e:
        print(f"error: {e.cause if hasattr(e, 'cause') else e}", file=sys.stderr)
        return 2
    print(f"[pdcluster] pools now {counts['prefill']} prefill, {counts['decode']} decode")
    return 0


def _cmd_autoscale(args: argparse.Namespace) -> int:
    import ray

    manager = _manager(args.ray_address, args.wait_s)
    if manager is None:
        return 2
    from pathlib import Path

    if args.state == "off" and (args.record or args.dry_run):
        print("error: --record and --dry-run go with autoscale on", file=sys.stderr)
        return 2
    record = str(Path(args.record).resolve()) if args.record else None
    try:
        on = ray.get(manager.autoscale.remote(args.state == "on", record=record, dry_run=args.dry_run), timeout=30)
    except ray.exceptions.RayTaskError as e:  # the record's file could not be opened
        print(f"error: {e.cause if hasattr(e, 'cause') else e}", file=sys.stderr)
        return 2
    extra = (" (dry run: decisions are logged, not carried out)" if on and args.dry_run else "") + \
        (f", recording to {record}" if on and record else "")
    print(f"[pdcluster] autoscale {'on' if on else 'off'}{extra}")
    return 0
