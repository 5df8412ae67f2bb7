"""The K/V tiers' counters on the wire, in /metrics and in ``pdcluster status`` with their fetch-or-recompute
break-even (issue 45). Pure."""

from __future__ import annotations

from cluster.wire.telemetry import TierCounts, WorkerStats
from proxy.tier_metrics import break_even_tokens_per_s, tier_metric_lines, tier_status_lines

BPT = 46_080  # the default model's float32 K/V bytes per token


def _stats() -> dict[str, WorkerStats]:
    disk = TierCounts("disk", hits=7, misses=2, corrupt=1, bytes_read=7 * 737_280, write_backs=30, pending_writes=3,
                      read_bytes_per_s=46_080_000.0, promoted=7)
    host = TierCounts("host", hits=5, demotions=12, read_bytes_per_s=4.608e9, used_bytes=10, capacity_bytes=100)
    return {"decode-0": WorkerStats("decode-0", "decode", kv_tiers=(disk,), kv_bytes_per_token=BPT),
            "prefill-0": WorkerStats("prefill-0", "prefill", kv_tiers=(host, disk), kv_bytes_per_token=BPT,
                                     prompt_tokens=3000, cached_prompt_tokens=1000, busy_seconds=2.0),
            "prefill-1": WorkerStats("prefill-1", "prefill")}


def test_tier_counts_cross_the_wire_inside_worker_stats() -> None:
    st = _stats()["prefill-0"]
    back = WorkerStats.from_dict(st.to_dict())
    assert back.kv_tiers == st.kv_tiers and back.kv_bytes_per_token == BPT


def test_metrics_name_each_tier_of_each_actor_with_its_break_even() -> None:
    text = "\n".join(tier_metric_lines(_stats()))
    assert 'pdcluster_kv_tier_hits_total{actor="prefill-0",tier="host"} 5' in text
    assert 'pdcluster_kv_tier_corrupt_blocks_total{actor="decode-0",tier="disk"} 1' in text
    assert 'pdcluster_kv_tier_write_backs_total{actor="decode-0",tier="disk"} 30' in text
    assert 'pdcluster_kv_tier_write_queue_depth{actor="decode-0",tier="disk"} 3' in text
    assert 'pdcluster_kv_tier_demotions_total{actor="prefill-0",tier="host"} 12' in text
    assert 'pdcluster_kv_tier_break_even_prefill_tokens_per_second{actor="prefill-0",tier="disk"} 1000.0' in text
    assert "prefill-1" not in text  # no tiers, no lines
    assert tier_metric_lines({"prefill-1": _stats()["prefill-1"]}) == []
    assert break_even_tokens_per_s(0.0, BPT) == 0.0


def test_status_prints_break_even_against_the_measured_prefill_speed() -> None:
    actors = [{**{k: v for k, v in st.to_dict().items() if k != "v"}, "name": name}
              for name, st in _stats().items()]
    lines = tier_status_lines(actors)
    assert "measured prefill 1000 tok/s" in lines[0]  # (3000 - 1000) computed tokens in 2 busy seconds
    host = next(line for line in lines if "prefill-0" in line and " host " in line)
    assert "break-even 100000 tok/s: fetch" in host
    disk = next(line for line in lines if "prefill-0" in line and " disk " in line)
    assert "break-even 1000 tok/s: recompute" in disk  # not slower than the measured prefill: recompute
