"""pdcluster profile measures a cost profile the simulator accepts."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.cli import main as cli_main
from cluster.control.sim_model import CostProfile


def test_quick_profile_of_a_tiny_model_is_a_usable_cost_profile(tiny_checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    assert cli_main(["profile", "--model", str(tiny_checkpoint("llama")), "--quick", "--link-gbps", "12.5",
                     "--out", str(out)]) == 0
    profile = CostProfile.load(out)
    assert profile.prefill_tps > 0 and profile.link_gbps == 12.5 and "pdcluster profile" in profile.source
    assert profile.decode_base_s + profile.decode_per_seq_s > 0
    assert 0 < profile.start_s < 60 and 0 <= profile.flip_s < profile.start_s  # measured, not the defaults
    assert profile.kv_bytes_per_token == json.loads(out.read_text())["kv_bytes_per_token"] > 0
    sim_out = tmp_path / "sim.json"
    assert cli_main(["simulate", "--workload", "steady", "--duration", "300", "--workers", "4", "--policy", "adaptive",
                     "--slo-ttft", "5", "--slo-tpot", "0.5", "--profile", str(out), "--json", str(sim_out)]) == 0
    assert json.loads(sim_out.read_text())["requests"] > 0
