"""``pdcluster status``: one proxy's ``/status`` printed as the pools, their K/V tiers, goodput, where prompts were
prefilled and the controller's last decisions."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any


def disagg_lines(d: dict[str, Any]) -> list[str]:
    """``pdcluster status``'s prefill-side lines from a proxy's ``/status`` ``disagg`` part. Pure."""
    c = d.get("costs", {})
    by = ", ".join(f"{k} {n}" for k, n in d.get("decisions", {}).items()) or "none yet"
    return [f"prefill side: --disagg-mode {d.get('mode')}: {by}",
            f"  measured: prefill {c.get('prefill_tok_s', 0):.0f} tok/s, decode step "
            f"{1e3 * c.get('decode_step_s', 0):.1f} ms, hand-off {1e3 * c.get('handoff_s', 0):.1f} ms, exposed transfer "
            f"{1e6 * c.get('transfer_s_per_token', 0):.2f} us/token"]


def slo_lines(slo: dict[str, Any]) -> list[str]:
    """``pdcluster status``'s goodput lines from a proxy's ``/status`` ``slo`` part (:meth:`SloTracker.status`).
    Pure."""
    w = slo["window"]
    att = "-" if w["attainment"] is None else f"{w['attainment']:.1%}"
    return [f"slo: TTFT <= {slo['ttft_s']:g} s, TPOT <= {slo['tpot_s']:g} s (this proxy)",
            f"  last {slo['window_s']:g} s: attainment {att}, goodput {w['goodput']} of {w['requests']} requests "
            f"({w['ttft_met']} within TTFT, {w['tpot_met']} within TPOT)",
            f"  since start: goodput {slo['goodput']} of {slo['requests']} requests; missed TTFT "
            f"{slo['misses']['ttft']}, TPOT {slo['misses']['tpot']}; failed {slo['failed']} (429, 5xx, hung up)"]


def cmd_status(args: argparse.Namespace) -> int:
    import json
    import os
    import urllib.error
    import urllib.request

    key = args.api_key or os.environ.get("PDCLUSTER_API_KEY")
    req = urllib.request.Request(f"{args.url.rstrip('/')}/status",
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            st = json.loads(r.read())
    except urllib.error.HTTPError as e:
        why = "the proxy needs its API key: --api-key or PDCLUSTER_API_KEY" if e.code == 401 else str(e)
        print(f"error: {args.url}/status: {why}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    print(f"mode: {st['mode']}   requests waiting for KV blocks: {st['waiting_for_blocks']}")
    # node, device and kv address last: what to look at first when a KV transfer fails (is it the node the actor runs
    # on? the CPU where a GPU was meant?)
    cols = ("actor", "role", "alive", "kv free", "reserved", "used", "total", "running", "waiting", "tokens", "node",
            "device", "kv address")

    def line(cells: Sequence[object]) -> str:
        head, *nums, node, device, addr = (str(c) for c in cells)
        return f"{head:<22}" + "".join(f"{c:>10}" for c in nums) + f"  {node:<16}{device:<9}{addr}"

    print(line(cols))
    for a in st["actors"]:
        kv = a.get("kv", {})
        tokens = a.get("tokens_generated", a.get("prompt_tokens", ""))
        alive = ("draining" if a.get("draining") else "yes") if a["alive"] else "DEAD"
        print(line((a["name"], a["role"], alive, kv.get("free", ""), kv.get("reserved", "-"), kv.get("used", ""),
                    kv.get("total", ""), a.get("running", ""), a.get("waiting", ""), tokens, a.get("node_ip") or "?",
                    a.get("device") or "?", a.get("kv_address") or "-")))
    for a in st["actors"]:  # speculative decoding, for the decode actors that draft
        prop, acc, ver = (a.get(k, 0) for k in ("spec_proposed_tokens", "spec_accepted_tokens",
                                                "spec_verified_requests"))
        if prop:
            print(f"speculative {a['name']}: acceptance {acc / prop:.2f} ({acc}/{prop} drafts), "
                  f"{(acc + ver) / ver:.2f} tokens per verify step")
    from proxy.tier_metrics import tier_status_lines

    tiers = tier_status_lines(st["actors"])  # K/V tiers and their fetch-or-recompute break-even (issue 45)
    if tiers:
        print("\n" + "\n".join(tiers))
    if st.get("slo"):  # a proxy from before goodput has none
        print("\n" + "\n".join(slo_lines(st["slo"])))
    if st.get("disagg"):  # disaggregated: where this proxy prefilled prompts (issue 48)
        print("\n" + "\n".join(disagg_lines(st["disagg"])))
    ctrl = st.get("controller")
    if ctrl:
        mode = " (dry run: decisions are logged, not carried out)" if ctrl.get("dry_run") else ""
        rec = f"   recording to {ctrl['recording']}" if ctrl.get("recording") else ""
        print(f"\nautoscale: {'on' if ctrl['autoscale'] else 'off'}{mode}"
              f"{'   (a change is in progress)' if ctrl['busy'] else ''}{rec}")
        for d in ctrl["decisions"][-5:]:
            note = "  (not carried out)" if d.get("applied") is False else ""
            print(f"  {time.strftime('%H:%M:%S', time.localtime(d['t']))}  {d['reason']}{note}")
    return 0
