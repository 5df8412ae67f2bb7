"""The proxy's settings, defined once: their defaults, their checks, their command-line flags.

Both ``pdcluster serve`` (which starts the proxies) and ``python -m proxy.main`` (one proxy, as the Helm chart runs it)
take the same flags through :func:`add_flags`, and the launcher hands a :class:`ProxySettings` to each proxy process
as :meth:`ProxySettings.argv`: one definition, so a default cannot drift between them (the admission queue's timeout
once said 30 s in one place and 10 s in three others). The proxy's own pieces (``proxy.admission``,
``proxy.dispatch``, ``proxy.server``) take their defaults from :data:`DEFAULTS`. Torch-free, pure.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from cluster.wire.slo import SloConfig

TOOL_PARSERS = ("hermes", "llama3_json")  # how 'auto' tool calls are read from a completion's text (proxy/tools.py)
DISAGG_MODES = ("auto", "always", "never")  # where a disaggregated cluster's prompts are prefilled (proxy/disagg.py)


@dataclass(frozen=True)
class ProxySettings:
    """What a proxy is told by its operator. Validated on construction (``ValueError`` naming the field)."""

    queue_timeout_s: float = 10.0  # seconds a request may wait (FIFO) for KV blocks before a 429
    max_waiting: int = 256  # requests each proxy lets wait for KV blocks at once; more get a 429 at once
    # output tokens a request reserves up front per completion, beside its prompt's; decode grows past them on demand
    # and preempts by recompute when its cache runs out
    reserve_headroom_tokens: int = 256
    max_resumes: int = 3  # times a prompt's completions may be resumed on another actor before the request fails
    slo_ttft_s: float = 2.0  # the SLOs the proxies count goodput by (/metrics); autoscale aims for the same
    slo_tpot_s: float = 0.2
    slo_window_s: float = 60.0  # pdcluster_slo_attainment covers the requests that ended this recently
    enable_auto_tool_choice: bool = False  # serve tool_choice 'auto', read by tool_call_parser
    tool_call_parser: str = ""  # one of TOOL_PARSERS, or "" (then 'auto' is refused)
    chat_template: str = ""  # a Jinja chat template file replacing the model's ("": the model's)
    # disaggregated clusters: per request on a prefill actor or on the decode owner, from measured costs (auto), or
    # always on a prefill actor, or never (proxy/disagg.py). auto by default: on a quiet 2-core machine 1P1D under
    # auto served 1.36x / 1.15x vLLM's tok/s with TTFT p50 0.90x / 0.77x at 512/96 / 128/96, where always read
    # 1.24x / 0.96x and 1.59x / 1.45x (docs/serving.md); an idle cluster stays disaggregated under auto
    disagg_mode: str = "auto"
    # where a request's K/V tenant comes from (proxy/tenant.py): none, api-key, user or header:NAME; another tenant's
    # prefix is never a cache hit on any tier
    kv_tenant_from: str = "none"
    # MiB of finished chat turns (rendered text -> the token ids served) each proxy keeps, so a conversation's next
    # turn reuses the answer's generated ids and hits its K/V (proxy/chat_token_cache.py); 0 turns it off
    chat_token_cache_mib: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.queue_timeout_s, bool) or not isinstance(self.queue_timeout_s, (int, float)) \
                or not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s: must be a number of seconds > 0, got {self.queue_timeout_s!r}")
        for name, least in (("max_waiting", 0), ("reserve_headroom_tokens", 1), ("max_resumes", 0),
                            ("chat_token_cache_mib", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name}: must be an integer >= {least}, got {v!r}")
        try:
            self.slo
        except ValueError as e:  # named as here: slo_ttft_s, slo_tpot_s, slo_window_s
            raise ValueError(f"slo_{e}") from None
        if self.tool_call_parser not in ("", *TOOL_PARSERS):
            raise ValueError(f"tool_call_parser: must be one of {TOOL_PARSERS} or empty, got {self.tool_call_parser!r}")
        if self.disagg_mode not in DISAGG_MODES:
            raise ValueError(f"disagg_mode: must be one of {DISAGG_MODES}, got {self.disagg_mode!r}")
        tenant_source(self.kv_tenant_from)
        if self.enable_auto_tool_choice != bool(self.tool_call_parser):
            raise ValueError("enable_auto_tool_choice and tool_call_parser go together (--enable-auto-tool-choice "
                             f"--tool-call-parser NAME), got {self.enable_auto_tool_choice} and "
                             f"{self.tool_call_parser!r}")

    @property
    def slo(self) -> SloConfig:
        return SloConfig(self.slo_ttft_s, self.slo_tpot_s, self.slo_window_s)

    def argv(self) -> list[str]:
        """These settings as the flags :func:`add_flags` declares (what the launcher passes a proxy process)."""
        out: list[str] = []
        for flag, name, kind, _ in _FLAGS:
            v = getattr(self, name)
            if kind is bool:
                out += [flag] if v else []
            elif kind is str:
                out += [flag, v] if v else []
            else:
                out += [flag, repr(v)]
        return out

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ProxySettings:
        """From what :func:`add_flags`' flags parsed into; ``ValueError`` naming the field when a value is bad."""
        return cls(**{name: (getattr(args, name) or "") if kind is str else getattr(args, name)
                      for _, name, kind, _ in _FLAGS})


def tenant_source(spec: str) -> tuple[str, str]:
    """``--kv-tenant-from``'s value as (kind, header name): ``none``, ``api-key``, ``user`` or ``header:NAME``
    (``ValueError`` naming the field otherwise). Pure."""
    if spec in ("none", "api-key", "user"):
        return spec, ""
    if isinstance(spec, str) and spec.startswith("header:"):
        name = spec[7:]
        if name and all(c.isalnum() or c in "-_" for c in name):
            return "header", name
    raise ValueError(f"kv_tenant_from: must be none, api-key, user or header:NAME (a header name), got {spec!r}")


DEFAULTS = ProxySettings()

# (flag, field, type, help): the order is --help's
_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--queue-timeout", "queue_timeout_s", float, "seconds a request may wait (FIFO) for KV blocks before a 429"),
    ("--max-waiting", "max_waiting", int,
     "requests each proxy lets wait for KV blocks at once; more get a 429 at once"),
    ("--reserve-headroom", "reserve_headroom_tokens", int,
     "output tokens a request reserves up front per completion, beside its prompt's; decode grows past them on "
     "demand and preempts by recompute when its cache runs out"),
    ("--max-resumes", "max_resumes", int,
     "times a prompt's completions may be resumed on another actor (a decode actor died or hung, a prefill actor "
     "died) before the request fails"),
    ("--slo-ttft", "slo_ttft_s", float,
     "TTFT SLO (seconds): the proxies count goodput by it (/metrics); under serve, autoscale aims for it"),
    ("--slo-tpot", "slo_tpot_s", float, "TPOT SLO (seconds), as --slo-ttft"),
    ("--slo-window", "slo_window_s", float, "seconds of finished requests pdcluster_slo_attainment covers"),
    ("--enable-auto-tool-choice", "enable_auto_tool_choice", bool,
     "serve tool_choice 'auto' (the default with tools): completions read for calls by --tool-call-parser"),
    ("--tool-call-parser", "tool_call_parser", str,
     "how 'auto' tool calls are read from the text (needs --enable-auto-tool-choice)"),
    ("--chat-template", "chat_template", str,
     "a Jinja chat template FILE replacing the model's (e.g. one that renders tools)"),
    ("--disagg-mode", "disagg_mode", str,
     "disaggregated clusters: where each prompt is prefilled: auto (a prefill actor or its decode owner, whichever "
     "the measured costs favour), always (a prefill actor), never (the decode owner)"),
    ("--chat-token-cache-mib", "chat_token_cache_mib", int,
     "MiB of finished chat turns each proxy remembers (rendered text -> the token ids served, per tenant), so a "
     "conversation's next turn reuses its answers' generated ids and hits their cached K/V; 0 turns it off"),
    ("--kv-tenant-from", "kv_tenant_from", str,
     "where a request's K/V tenant comes from: none (one shared namespace), api-key (the Bearer key, hashed), user "
     "(the OpenAI user field) or header:NAME; another tenant's prefix is never a cache hit"),
)
_CHOICES = {"tool_call_parser": TOOL_PARSERS, "disagg_mode": DISAGG_MODES}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Mutates ``parser``: declares the proxy's flags, defaults from :data:`DEFAULTS`."""
    for flag, name, kind, help_ in _FLAGS:
        if kind is bool:
            parser.add_argument(flag, dest=name, action="store_true", help=help_)
        elif kind is str:
            extra = {"choices": _CHOICES[name]} if name in _CHOICES else {
                "metavar": "SOURCE" if name == "kv_tenant_from" else "FILE"}
            default = getattr(DEFAULTS, name) or None
            parser.add_argument(flag, dest=name, default=default, help=help_ if default is None
                                else f"{help_} (default {default})", **extra)
        else:
            parser.add_argument(flag, dest=name, type=kind, default=getattr(DEFAULTS, name),
                                metavar="SECONDS" if kind is float else "N",
                                help=f"{help_} (default {getattr(DEFAULTS, name)})")


def settings_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ProxySettings:
    """:meth:`ProxySettings.from_args`, a bad value reported as the parser's usage error (exit 2)."""
    try:
        return ProxySettings.from_args(args)
    except ValueError as e:
        parser.error(str(e))  # exits (NoReturn)
