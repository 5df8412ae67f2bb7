"""Which K/V namespace a request belongs to: the operator names the source (``--kv-tenant-from``), this module turns a
request into the namespace's digest, which ``GenerateRequest.sampling.kv_namespace`` carries to the prefill and decode
actors and which every block key binds (engine/scheduling/kv_cache_manager.py, engine/kv/tiers/keys.py). Another tenant's identical
prompt is then a miss on every tier, so a cache hit's shorter TTFT (the seeds' timing side channel) never tells one
tenant what another asked.

Sources: ``none`` (one shared namespace), ``api-key`` (the ``Authorization: Bearer`` key), ``user`` (the OpenAI
``user`` field), ``header:NAME`` (an operator-named header, e.g. one a gateway sets). The value is hashed (SHA-256,
domain-separated, 128 bits kept): an API key never leaves the proxy in clear. A request without a value under its
source falls in the shared namespace. Pure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from cluster.wire.proxy_settings import tenant_source


def kv_namespace(source: str, headers: Mapping[str, str], user: str | None) -> str:
    """The K/V namespace digest of a request under ``source`` ("" = shared). ``headers``: the request's, looked up
    case-insensitively by the caller's mapping (aiohttp's is). ``ValueError`` on a bad source. Pure."""
    kind, header = tenant_source(source)
    if kind == "none":
        return ""
    if kind == "api-key":
        auth = headers.get("Authorization", "")
        value = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    elif kind == "user":
        value = user or ""
    else:
        value = headers.get(header, "")
    if not value:
        return ""
    return hashlib.sha256(f"pdcluster-kv-tenant\x1f{kind}\x1f{header}\x1f{value}".encode()).hexdigest()[:32]
