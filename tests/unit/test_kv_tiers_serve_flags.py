"""`pdcluster serve --kv-host-gib/--kv-disk-dir/--kv-disk-gib` reach each role's tier config (issue 45). Pure."""

from __future__ import annotations

import pytest

from cluster.cli import build_parser, serve_config
from cluster.loop.engine_loop import engine_kwargs_for, tier_config_for
from engine.config import EngineConfig


def test_tier_flags_reach_the_roles() -> None:
    args = build_parser().parse_args(["serve", "--kv-host-gib", "0.5", "--kv-disk-dir", "/tmp/kvt",
                                      "--kv-disk-gib", "2", "--kv-disk-integrity", "blake2b",
                                      "--kv-prefill-tokens-per-s", "1500"])
    worker = serve_config(args, environ={}).worker
    pre, dec = tier_config_for(worker, "prefill"), tier_config_for(worker, "decode")
    assert pre.host_bytes == dec.host_bytes == 2**29 and pre.disk_bytes == 2 * 2**30 and pre.disk_dir == "/tmp/kvt"
    assert pre.disk_integrity == "blake2b" and pre.prefill_tokens_per_s == 1500.0
    assert dec.write_back and not pre.write_back  # requests finish (and write back) on the decode side
    EngineConfig(**engine_kwargs_for(worker, "prefill", None, "cpu"))  # the tier fields are not the engine's


def test_tiers_are_off_by_default_and_bad_sizes_are_refused() -> None:
    worker = serve_config(build_parser().parse_args(["serve"]), environ={}).worker
    assert tier_config_for(worker, "decode") is None
    bad = serve_config(build_parser().parse_args(["serve", "--kv-host-gib", "-1"]), environ={}).worker
    with pytest.raises(ValueError, match="host_bytes"):
        tier_config_for(bad, "prefill")
