"""Prometheus lines for the K/V tiers below each actor's device pool (issue 45; ``WorkerStats.kv_tiers``): per actor
and tier, hits, misses, damaged blocks, bytes read, demotions, write-backs, drops, the write queue's depth, bytes held,
the measured read bandwidth and the fetch-or-recompute break-even prefill speed it implies. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cluster.wire.telemetry import WorkerStats

_COUNTERS = (("hits", "hits"), ("misses", "misses"), ("corrupt", "corrupt_blocks"), ("bytes_read", "read_bytes"),
             ("demotions", "demotions"), ("write_backs", "write_backs"), ("dropped", "dropped_blocks"),
             ("promoted", "promoted_blocks"))
_GAUGES = (("pending_writes", "write_queue_depth"), ("used_bytes", "used_bytes"),
           ("capacity_bytes", "capacity_bytes"), ("read_bytes_per_s", "read_bytes_per_second"))


def break_even_tokens_per_s(read_bytes_per_s: float, bytes_per_token: int) -> float:
    """The prefill speed (tokens/s) above which recomputing beats reading at ``read_bytes_per_s`` (0: unknown, no
    read measured yet). Pure."""
    return read_bytes_per_s / bytes_per_token if read_bytes_per_s > 0 and bytes_per_token > 0 else 0.0


def tier_metric_lines(stats: Mapping[str, WorkerStats]) -> list[str]:
    """``stats``: actor -> its latest stats; actors without tiers add nothing. Pure."""
    rows = [(a, st, t) for a, st in sorted(stats.items()) for t in st.kv_tiers]
    if not rows:
        return []
    lines: list[str] = []
    for field, name in _COUNTERS:
        lines += [f"# TYPE pdcluster_kv_tier_{name}_total counter"]
        lines += [f'pdcluster_kv_tier_{name}_total{{actor="{a}",tier="{t.tier}"}} {getattr(t, field)}'
                  for a, _, t in rows]
    for field, name in _GAUGES:
        lines += [f"# TYPE pdcluster_kv_tier_{name} gauge"]
        lines += [f'pdcluster_kv_tier_{name}{{actor="{a}",tier="{t.tier}"}} {getattr(t, field)}' for a, _, t in rows]
    lines += ["# TYPE pdcluster_kv_tier_break_even_prefill_tokens_per_second gauge"]
    lines += [f'pdcluster_kv_tier_break_even_prefill_tokens_per_second{{actor="{a}",tier="{t.tier}"}} '
              f'{break_even_tokens_per_s(t.read_bytes_per_s, st.kv_bytes_per_token)}' for a, st, t in rows]
    return lines


def tier_status_lines(actors: list[Mapping[str, Any]]) -> list[str]:
    """``pdcluster status``'s lines on the tiers: ``actors`` as ``/status`` lists them. Per actor and tier its
    counters, measured read bandwidth and the break-even prefill speed, against the prefill speed measured on the
    prefill actors (prompt tokens computed, not cached, per busy second): fetch while prefill is slower. Pure."""
    rows = [(a, t) for a in actors for t in a.get("kv_tiers") or ()]
    if not rows:
        return []
    prefill = [a for a in actors if a.get("role") == "prefill"]
    computed = sum(int(a.get("prompt_tokens", 0)) - int(a.get("cached_prompt_tokens", 0)) for a in prefill)
    busy = sum(float(a.get("busy_seconds", 0.0)) for a in prefill)
    speed = computed / busy if busy > 0 else 0.0
    lines = [f"kv tiers: measured prefill {speed:.0f} tok/s ({computed} prompt tokens computed in {busy:.1f} busy s); "
             "a tier is worth reading while prefill is slower than its break-even"]
    for a, t in rows:
        bw = float(t.get("read_bytes_per_s", 0.0))
        even = break_even_tokens_per_s(bw, int(a.get("kv_bytes_per_token", 0)))
        verdict = "no read yet" if not even else ("fetch" if not speed or speed < even else "recompute")
        lines.append(f"  {a['name']:<22}{t['tier']:<5} hits {t['hits']} misses {t['misses']} corrupt {t['corrupt']}"
                     f"  read {int(t['bytes_read']) / 2**20:.1f} MiB at {bw / 1e6:.0f} MB/s  demoted {t['demotions']}"
                     f" written back {t['write_backs']} dropped {t['dropped']} queued {t['pending_writes']}"
                     f"  break-even {even:.0f} tok/s: {verdict}")
    return lines
