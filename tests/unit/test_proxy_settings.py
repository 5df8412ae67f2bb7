"""The proxy's settings are defined once (cluster/wire/proxy_settings.py): `pdcluster serve` and `python -m proxy.main`
declare the same flags with the same defaults, the launcher's argv for a proxy parses back to the settings it was made
from, the proxy's own pieces default to them, and a bad value is refused naming its field."""

from __future__ import annotations

import argparse

import pytest

from cluster.cli import build_parser as serve_parser
from cluster.cli import serve_config
from cluster.wire.proxy_settings import DEFAULTS, TOOL_PARSERS, ProxySettings
from proxy.admission import AdmissionConfig
from proxy.dispatch import DispatchConfig
from proxy.main import build_parser as proxy_parser
from proxy.server import ProxyConfig
from proxy.tools import PARSERS

CHANGED = ProxySettings(queue_timeout_s=2.5, max_waiting=7, reserve_headroom_tokens=64, max_resumes=0, slo_ttft_s=1.25,
                        slo_tpot_s=0.05, slo_window_s=30.0, enable_auto_tool_choice=True, tool_call_parser="hermes",
                        chat_template="/tmp/template.jinja", chat_token_cache_mib=0)
PROXY_REQUIRED = ["--ray-address", "127.0.0.1:1", "--port", "0"]


def _serve_args(*argv: str) -> argparse.Namespace:
    return serve_parser().parse_args(["serve", *argv])


def test_both_commands_default_to_the_one_definition() -> None:
    assert ProxySettings.from_args(_serve_args()) == DEFAULTS
    assert ProxySettings.from_args(proxy_parser().parse_args(PROXY_REQUIRED)) == DEFAULTS
    assert serve_config(_serve_args(), environ={}).proxy == DEFAULTS
    assert DEFAULTS.queue_timeout_s == 10.0  # the admission queue once said 30 s here and 10 s elsewhere
    assert AdmissionConfig(block_size=16).queue_timeout_s == DEFAULTS.queue_timeout_s
    assert AdmissionConfig(block_size=16).max_queue_len == DEFAULTS.max_waiting
    d = DispatchConfig(block_size=16)
    assert (d.max_resumes, d.reserve_headroom_tokens) == (DEFAULTS.max_resumes, DEFAULTS.reserve_headroom_tokens)
    assert ProxyConfig().settings == DEFAULTS
    assert PARSERS == TOOL_PARSERS


def test_the_argv_a_proxy_is_started_with_parses_back_to_its_settings() -> None:
    for s in (DEFAULTS, CHANGED):
        assert ProxySettings.from_args(proxy_parser().parse_args(PROXY_REQUIRED + s.argv())) == s
        assert ProxySettings.from_args(_serve_args(*s.argv())) == s
    assert serve_config(_serve_args(*CHANGED.argv()), environ={}).proxy == CHANGED
    assert CHANGED.slo.ttft_s == 1.25 and CHANGED.slo.window_s == 30.0


@pytest.mark.parametrize("change,field", [
    (dict(queue_timeout_s=0), "queue_timeout_s"), (dict(max_waiting=-1), "max_waiting"),
    (dict(reserve_headroom_tokens=0), "reserve_headroom_tokens"), (dict(max_resumes=1.5), "max_resumes"),
    (dict(slo_tpot_s=float("nan")), "slo_tpot_s"), (dict(slo_window_s=0), "slo_window_s"),
    (dict(tool_call_parser="xml"), "tool_call_parser"),
    (dict(enable_auto_tool_choice=True), "enable_auto_tool_choice and tool_call_parser go together"),
])
def test_a_bad_value_is_refused_naming_its_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ProxySettings(**change)


def test_a_bad_flag_is_a_usage_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.main import main

    with pytest.raises(SystemExit) as e:
        main(PROXY_REQUIRED + ["--queue-timeout", "0"])
    assert e.value.code == 2 and "queue_timeout_s: must be a number of seconds > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(PROXY_REQUIRED + ["--tool-call-parser", "hermes"])
    assert "go together" in capsys.readouterr().err
    with pytest.raises(ValueError, match="slo_ttft_s"):
        serve_config(_serve_args("--slo-ttft", "-1"), environ={})
