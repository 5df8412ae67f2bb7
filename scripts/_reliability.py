"""What ``scripts/overload.py`` and ``scripts/soak.py`` share: one HTTP request read to its end and classified, the
tally of outcomes, a local cluster with its actors' pids, the RSS of every process the script started, the decode
actors' KV counts.

The pure parts (``classify``, ``tally``, ``parse_proc_status``, ``percentile``) do no I/O; the rest talks to the cluster
or reads ``/proc``. Built on ``scripts/chaos.py`` (``use_this_checkout``, ``machine``, ``check_blocks``, ``Actor``).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos import Actor, check_blocks, machine, use_this_checkout

__all__ = ["KINDS", "Actor", "Outcome", "check_blocks", "classify", "descendants", "error_code", "error_reasons",
           "kv_counts", "labelled_processes", "machine", "mib", "parse_proc_status", "percentile", "process_name",
           "read_rss", "rss_sample", "send", "start_cluster", "tally", "temp_log", "use_this_checkout"]

# every way one request can end; the first two are the only good ones under overload, plus "disconnected" in the soak
KINDS = ("complete", "429", "5xx", "http_other", "incomplete", "conn_error", "disconnected")


@dataclass(frozen=True)
class Outcome:
    """How one request ended, as the client saw it."""

    kind: str  # one of KINDS
    status: int | None  # the HTTP status, None when the connection failed first
    retry_after: str | None  # the Retry-After header of a 429/503, if any
    chunks: int  # SSE data lines (streams) received before the end
    start_s: float  # since the run's start
    elapsed_s: float
    error: str | None = None  # why it did not complete (a refusal's error code), None when it did


def classify(status: int | None, *, done: bool, error_event: bool, disconnected: bool, body_ok: bool = True) -> str:
    """The kind of an ended request. ``done``: a stream's ``[DONE]`` arrived (or a non-stream body was read);
    ``body_ok``: that body had its choices. Pure."""
    if status is None:
        return "conn_error"
    if status == 429:
        return "429"
    if status >= 500:
        return "5xx"
    if status != 200:
        return "http_other"
    if disconnected:
        return "disconnected"
    return "complete" if done and body_ok and not error_event else "incomplete"


def tally(outcomes: Iterable[Outcome]) -> dict[str, int]:
    """Counts per kind (every kind present, zeros included), plus ``429_without_retry_after``. Pure."""
    counts = dict.fromkeys(KINDS, 0)
    counts["429_without_retry_after"] = 0
    for o in outcomes:
        counts[o.kind] += 1
        if o.kind == "429" and not o.retry_after:
            counts["429_without_retry_after"] += 1
    return counts


def error_reasons(outcomes: Iterable[Outcome], limit: int = 120) -> dict[str, int]:
    """The distinct errors and how often each came. Pure."""
    reasons: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            reasons[o.error[:limit]] = reasons.get(o.error[:limit], 0) + 1
    return reasons


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by nearest rank; None for no values. Pure."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


def error_code(text: str) -> str:
    """An OpenAI error body's ``error.code`` (``queue_full``, ``queue_timeout``...), else its start. Pure."""
    try:
        err = json.loads(text).get("error") or {}
    except (ValueError, AttributeError):
        return text[:200]
    return str(err.get("code") or err.get("message") or text)[:200] if isinstance(err, dict) else text[:200]


async def send(session: Any, url: str, path: str, body: dict[str, Any], t0: float, trace: str,
               disconnect_after: int | None = None) -> Outcome:
    """POST one request and read it to its end (or close the connection after ``disconnect_after`` SSE data lines).
    Never raises for the server's or the network's failures."""
    import aiohttp

    from cluster.loadgen.openai_stream import parse_data_line

    start = time.monotonic()
    status: int | None = None
    retry_after: str | None = None
    chunks, done, error_event, disconnected, body_ok = 0, False, False, False, True
    error: str | None = None
    try:
        async with session.post(url + path, json=body, headers={"X-Request-Id": trace}) as resp:
            status, retry_after = resp.status, resp.headers.get("Retry-After")
            if status != 200:
                error = f"HTTP {status}: {error_code(await resp.text())}"
            elif body.get("stream"):
                async for raw in resp.content:
                    chunk = parse_data_line(raw.decode("utf-8", "replace"))
                    if chunk is None:
                        continue
                    if chunk.error is not None:
                        error_event, error = True, f"error event: {chunk.error[:200]}"
                        break
                    if chunk.done:
                        done = True
                        break
                    chunks += 1
                    if disconnect_after is not None and chunks >= disconnect_after:
                        disconnected = True
                        resp.close()  # drops the connection: the proxy sees the client go
                        break
                if not (done or error_event or disconnected):
                    error = "stream ended without [DONE]"
            else:
                out = await resp.json()
                want = int(body.get("n", 1)) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
                body_ok = isinstance(out, dict) and len(out.get("choices") or []) == want
                done = True
                if not body_ok:
                    error = f"unexpected body: {str(out)[:200]}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        if not (done or disconnected):  # the connection failed (status None) or broke mid-response (incomplete)
            error = f"{type(e).__name__}{' mid-response' if status else ''}: {str(e)[:200]}"
            done = False
    kind = classify(status, done=done, error_event=error_event, disconnected=disconnected, body_ok=body_ok)
    return Outcome(kind, status, retry_after, chunks, start - t0, time.monotonic() - start, error)


# -- the cluster ------------------------------------------------------------------------------------------------------
def start_cluster(cfg: Any, log_path: str | None = None) -> tuple[Any, list[Actor]]:
    """Start a ``cluster.launcher.Cluster`` for ``cfg`` (a ``ServeConfig``) and return it with its worker actors
    (name, role, pid). With ``log_path``, the processes it starts write their stderr (the proxy's access log: a line
    per request) there instead of this terminal. The caller stops it."""
    import ray

    from cluster.launcher import Cluster

    cluster = Cluster(cfg)
    saved = os.dup(2)
    try:
        if log_path:  # children inherit fd 2 when they are spawned; this process gets it back right after
            with open(log_path, "ab") as log:
                os.dup2(log.fileno(), 2)
        cluster.start()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    try:
        handles = [("decode", h) for h in cluster.decode_actors] + [("prefill", h) for h in cluster.prefill_actors]
        infos = ray.get([h.info.remote() for _, h in handles], timeout=60)
    except BaseException:
        cluster.stop()
        raise
    return cluster, [Actor(i["actor_id"], role, int(i["pid"]), h) for (role, h), i in zip(handles, infos)]


def kv_counts(actors: list[Actor]) -> dict[str, dict[str, Any]]:
    """Each actor's KV counts from ``stats()`` (free, reserved, used, total...), by name; an error string when it did
    not answer. Reads only."""
    import ray

    out: dict[str, dict[str, Any]] = {}
    for a in actors:
        try:
            out[a.name] = dict(ray.get(a.handle.stats.remote(), timeout=30)["kv"])
        except Exception as e:  # noqa: BLE001 - a dead or stuck actor is a finding, not a crash of the script
            out[a.name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    return out


# -- processes and their memory ---------------------------------------------------------------------------------------
RSS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def parse_proc_status(text: str) -> dict[str, int]:
    """The ``RSS_FIELDS`` of a ``/proc/<pid>/status`` text, in KiB (missing ones left out). Pure."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in RSS_FIELDS:
            out[key] = int(value.split()[0])
    return out


def read_rss(pid: int) -> dict[str, int] | None:
    """``parse_proc_status`` of a live process; None once it is gone."""
    try:
        return parse_proc_status(Path(f"/proc/{pid}/status").read_text())
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, their children...), from ``/proc/*/stat``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return sorted(out)


def process_name(pid: int) -> str:
    """A short name: Ray's process title (``ray::IDLE``), else the program and its module or script."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace").split("\0")
    except OSError:
        return "?"
    argv = [a for a in argv if a]
    if not argv:
        return "?"
    if argv[0].startswith("ray::") or " " in argv[0]:  # a title Ray set; it names the running method: drop that
        return argv[0].split()[0].split(".")[0]
    prog = os.path.basename(argv[0])
    rest = next((a for a in argv[1:] if a.endswith(".py") or "." in a and not a.startswith("-")), None)
    if "-m" in argv[1:-1]:
        rest = argv[argv.index("-m") + 1]
    return f"{prog} {os.path.basename(rest)}" if rest else prog


def labelled_processes(cluster: Any, actors: list[Actor]) -> dict[str, int]:
    """label -> pid for every process this script started: ``proxy-<i>``, ``<role> <actor>`` for worker actors, and
    Ray's own (``<name> [pid]``: GCS, raylet, idle workers...). Reads ``/proc`` only."""
    known = {p.pid: f"proxy-{i}" for i, p in enumerate(cluster.proxy_procs)}
    known.update({a.pid: f"{a.role} {a.name}" for a in actors})
    return {known.get(pid) or f"{process_name(pid)} [{pid}]": pid for pid in descendants(os.getpid())}


def rss_sample(cluster: Any, actors: list[Actor]) -> dict[str, dict[str, int]]:
    """label -> RSS fields (KiB) of every live process this script started."""
    out = {}
    for label, pid in labelled_processes(cluster, actors).items():
        rss = read_rss(pid)
        if rss:
            out[label] = {"pid": pid, **rss}
    return out


def temp_log(script: str) -> str:
    """A new, empty file for the cluster's stderr (made now; the caller prints its path)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix=f"pdcluster-{script}-", suffix=".log")
    os.close(fd)
    return path


def mib(kib: float | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f}"
