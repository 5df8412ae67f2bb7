"""The proxy's API key (Bearer) check and its readiness during shutdown, without Ray: the middleware on its own."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from proxy.pools import Pools
from proxy.server import Proxy, ProxyConfig


class _NoTokenizer:
    pass


def make_proxy(api_key: str | None) -> Proxy:
    return Proxy(Pools(), _NoTokenizer(), None, 16, ProxyConfig(api_key=api_key))  # type: ignore[arg-type]


async def _ok(_: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def call(proxy: Proxy, path: str, headers: dict[str, str] | None = None) -> web.Response:
    req = make_mocked_request("POST", path, headers=headers or {})
    return asyncio.run(proxy._auth(req, _ok))  # type: ignore[return-value]


def test_api_key_is_required_on_the_openai_routes_and_status_only() -> None:
    proxy = make_proxy("s3cret")
    for path in ("/v1/chat/completions", "/status"):  # /status names every actor's node and KV address
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = call(proxy, path, headers)
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert json.loads(r.body)["error"]["code"] == "invalid_api_key"
    assert call(proxy, "/v1/models", {"Authorization": "Bearer s3cret"}).status == 200
    assert call(proxy, "/status", {"Authorization": "Bearer s3cret"}).status == 200
    for probe in ("/health", "/ready", "/metrics"):  # load balancers and Prometheus need no key
        assert call(proxy, probe).status == 200


def test_no_api_key_means_open() -> None:
    assert call(make_proxy(None), "/v1/chat/completions").status == 200


def test_ready_turns_503_when_shutting_down() -> None:
    proxy = make_proxy(None)
    asyncio.run(proxy._stopping(web.Application()))
    r = asyncio.run(proxy.ready(make_mocked_request("GET", "/ready")))
    assert r.status == 503 and json.loads(r.body)["shutting_down"] is True


@pytest.mark.parametrize("proxies,ok", [(0, True), (2, True), (-1, False)])
def test_serve_config_allows_workers_only(proxies: int, ok: bool) -> None:
    from cluster.launcher import ServeConfig

    if ok:
        assert ServeConfig(proxies=proxies).proxies == proxies
    else:
        with pytest.raises(ValueError, match="proxies"):
            ServeConfig(proxies=proxies)
