"""benchmarks/bench_cluster.py's TP rows (issue 29): which clusters it runs for --prefill-tp / --decode-tp, and the
table that prints TTFT and the transfer share of each beside the same backend's TP=1 run. Pure: no cluster starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cluster.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_cluster", PATH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tp_sizes_add_a_row_per_backend_beside_tp1(bench: ModuleType) -> None:
    args = bench.parse_args(["--backends", "shm,torch_dist", "--prefill-tp", "2"])
    assert bench.plan(args) == [("colocated", "-", (1, 1), "shared"), ("disaggregated", "shm", (1, 1), "shared"),
                                ("disaggregated", "shm", (2, 1), "shared"),
                                ("disaggregated", "torch_dist", (1, 1), "shared"),
                                ("disaggregated", "torch_dist", (2, 1), "shared")]
    assert len(bench.plan(bench.parse_args(["--backends", "shm"]))) == 2  # no TP asked: today's rows only
    with pytest.raises(ValueError, match="--decode-tp"):
        bench.plan(bench.parse_args(["--decode-tp", "0"]))


def test_the_cluster_of_a_tp_row(bench: ModuleType) -> None:
    args = bench.parse_args(["--prefill-tp", "1", "--decode-tp", "3", "--threads", "2"])
    cfg = bench.serve_config("disaggregated", "shm", args, (1, 3))
    assert (cfg.worker.prefill_tp, cfg.worker.decode_tp, cfg.worker.num_threads, cfg.kv_backend) == (1, 3, 2, "shm")
    assert (cfg.prefill, cfg.decode, cfg.port) == (1, 1, 0)
    col = bench.serve_config("colocated", "-", args, (1, 1))  # plan's colocated row names no backend
    assert col.mode == "colocated" and (col.worker.prefill_tp, col.worker.decode_tp) == (1, 1)


def test_the_table_puts_tp_beside_tp1_with_the_transfer_share(bench: ModuleType) -> None:
    def res(ttft: float, exposed: float | None = None) -> dict:
        r = {"ttft": [ttft] * 4, "tpot": [0.05] * 4}
        if exposed is not None:
            r.update(bytes=2**30, busy_s=2.0, exposed_s=exposed)
        return r

    rows = [("colocated", "-", (1, 1), "shared", res(1.0)), ("disaggregated", "shm", (1, 1), "shared", res(1.2, 0.4)),
            ("disaggregated", "shm", (2, 1), "shared", res(0.6, 0.24)),
            ("disaggregated", "ucx", (2, 1), "shared", {"error": "boom"})]
    head, col, tp1, tp2, bad = bench.table(rows, with_tp=True)
    assert "TTFT/TP1" in head and "KV/TTFT" in head
    assert col.startswith("colocated TP 1") and "1000ms" in col
    assert tp1.startswith("disaggregated/shm TP 1:1") and "1.20x" in tp1 and "1.00x" in tp1
    assert tp2.startswith("disaggregated/shm TP 2:1") and "0.60x" in tp2 and "0.50x" in tp2  # vs colocated, vs TP 1
    assert "wire/TTFT" in head
    assert tp1.split()[-4:] == ["0.50", "80%", "41.7%", "8.3%"]  # GiB/s, hidden, 2 s and 0.4 s of 4.8 s TTFT
    assert tp2.split()[-2:] == ["83.3%", "10.0%"]  # 2 s and 0.24 s of 2.4 s
    assert bad.startswith("disaggregated/ucx TP 2:1") and "failed: boom" in bad
    plain = bench.table(rows[:2], with_tp=False)
    assert "TTFT/TP1" not in plain[0] and plain[2].startswith("disaggregated/shm ")


def test_each_tp_kv_cache_layout_gets_its_own_tp_row(bench: ModuleType) -> None:
    args = bench.parse_args(["--backends", "torch_dist", "--prefill-tp", "3", "--decode-tp", "3",
                             "--tp-kv-cache", "shared,per_rank"])
    assert bench.plan(args) == [("colocated", "-", (1, 1), "shared"),
                                ("disaggregated", "torch_dist", (1, 1), "shared"),
                                ("disaggregated", "torch_dist", (3, 3), "shared"),
                                ("disaggregated", "torch_dist", (3, 3), "per_rank")]
    cfg = bench.serve_config("disaggregated", "torch_dist", args, (3, 3), "per_rank")
    assert (cfg.worker.tp_kv_cache, cfg.worker.prefill_tp, cfg.worker.decode_tp) == ("per_rank", 3, 3)
    assert bench.serve_config("disaggregated", "torch_dist", args, (3, 3)).worker.tp_kv_cache == "shared"
    assert bench.label("disaggregated", "torch_dist", (3, 3), True, "per_rank") == \
        "disaggregated/torch_dist TP 3:3 per_rank"
    assert bench.label("disaggregated", "torch_dist", (3, 3), True, "shared") == "disaggregated/torch_dist TP 3:3"


@pytest.mark.parametrize("flags,match", [
    (["--tp-kv-cache", "shared,per_head"], "--tp-kv-cache: each must be one of"),
    (["--backends", "torch_dist,shm", "--tp-kv-cache", "per_rank"], "--tp-kv-cache per_rank: .* --backends shm"),
])
def test_a_bad_tp_kv_cache_is_refused_before_any_cluster(bench: ModuleType, flags: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bench.plan(bench.parse_args(["--decode-tp", "3", *flags]))
