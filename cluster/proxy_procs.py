"""The proxy processes a cluster starts on this machine: each one ``python -m proxy.main`` on the cluster's Ray, its
bound port reported through a file, ready once its ``/ready`` answers 200."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
import urllib.request

from cluster.wire.auth import ENV_VAR
from cluster.wire.proxy_settings import ProxySettings


def proxy_env(secret: str | None) -> dict[str, str]:
    """This process's environment for a proxy: unbuffered output, and the cluster's secret (``secret``; None:
    authentication off) in the environment, not on the command line (ps shows arguments to every user). Reads the
    environment."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(ENV_VAR, None)
    if secret is not None:
        env[ENV_VAR] = secret
    return env


def spawn_proxy(ray_address: str, host: str, port: int, port_file: str, model_name: str, settings: ProxySettings,
                stream_host: str | None, disaggregated: bool, secret: str | None) -> subprocess.Popen[bytes]:
    """Start one proxy process (``port`` 0: the OS picks; the bound one is written to ``port_file``) holding the
    cluster's ``secret`` (None: authentication off)."""
    return subprocess.Popen(
        [sys.executable, "-m", "proxy.main", "--ray-address", ray_address, "--host", host, "--port", str(port),
         "--port-file", port_file, "--model-name", model_name] + settings.argv()
        + (["--stream-host", stream_host] if stream_host else [])
        + (["--disaggregated"] if disaggregated else [])
        + ([] if secret is not None else ["--no-cluster-auth"]), env=proxy_env(secret))


def wait_listening(proc: subprocess.Popen[bytes], port_file: str, host: str, deadline: float) -> str:
    """The URL of ``proc`` once it has written the port it bound (``time.monotonic()`` ``deadline``);
    ``RuntimeError`` if it exits first, ``TimeoutError`` after the deadline."""
    while not os.path.exists(port_file):
        if proc.poll() is not None:
            raise RuntimeError(f"a proxy exited with {proc.returncode} before listening")
        if time.monotonic() > deadline:
            raise TimeoutError("a proxy did not listen in time")
        time.sleep(0.2)
    with open(port_file) as f:
        return f"http://{host}:{int(f.read())}"


def wait_ready(url: str, proc: subprocess.Popen[bytes], deadline: float) -> None:
    """Return once ``url``'s ``/ready`` answers 200; ``RuntimeError`` if ``proc`` exits, ``TimeoutError`` after
    ``deadline`` (``time.monotonic()``)."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"proxy for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, http.client.HTTPException):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready in time")
        time.sleep(0.3)


def stop_proxies(procs: list[subprocess.Popen[bytes]], grace_s: float = 15.0) -> None:
    """SIGTERM every proxy, then SIGKILL those still up after ``grace_s`` each."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
