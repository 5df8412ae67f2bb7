"""The autoscale record: what the control loop saw and decided, as JSON lines, for ``pdcluster simulate --replay``.

One record per line, each a JSON object with a ``kind`` and a time ``t``: seconds on the *recorder's* clock since the
record started (the pool manager's monotonic clock live, simulated time in the simulator). The first line is the
header; every other kind may come in any order (a reader sorts by ``t``). Version :data:`RECORD_VERSION`:

- ``header``: ``version``, ``source`` (``live`` | ``simulator``), ``wall_time`` (when it started, for people only),
  ``controller`` (the :class:`~cluster.control.controller.ControllerConfig` as a dict), ``observer`` (the
  :class:`~cluster.control.observe.ObserverConfig`), ``initial`` (``[prefill, decode]`` actors when it started), ``dry_run``,
  ``profile`` (the cost profile the controller was seeded with, or null);
- ``arrival``: one request (prompt) as it reached a proxy: ``proxy``, ``prompt_tokens``, ``max_tokens``, ``n``,
  ``client`` when the request named one (a digest of its OpenAI ``user``) and, when the recorder knows it (the simulator),
  ``output_tokens``. Live, ``t`` is the manager's receipt time of the
  proxy's report minus the arrival's age on the proxy's clock (durations only: no timestamp crosses hosts);
- ``finished``: one finished request: ``proxy`` and the :class:`~cluster.wire.telemetry.FinishedSample` fields
  (TTFT, TPOT and the TTFT parts, each a duration measured on one process's clock); ``t`` is its end, the report's
  receipt minus its ``age_s`` (records from before 2026-12-07 have no ``age_s``: their ``t`` is the receipt, up to a
  report interval late);
- ``rejected``: ``count`` requests a proxy refused with 429 since its last report, and ``failed`` that failed
  otherwise (5xx, an error mid-stream, 499; absent: 0);
- ``observation``: the :class:`~cluster.control.controller.Observation` the controller decided on (``observation``);
- ``counters``: every actor's :class:`~cluster.control.observe.ActorCounters` as the window read them (``actors``:
  cumulative tokens, busy seconds and steps, and gauges; live only, the first window's baselines included): what
  each actor measured over each interval, so a replay can run the machine at the speed it had then
  (:func:`cluster.control.calibrate.speed_over_time`; a record without them is calibrated from its finished
  requests);
- ``decision``: every decision, holds included: ``n_prefill``, ``n_decode``, ``add``, ``drain``, ``flip``,
  ``reason``, ``changes`` (it changes something), ``applied`` (False in a dry run or for a hold), ``manual``
  (``pdcluster scale``);
- ``pools``: ``prefill``, ``decode``: the live pool sizes after a change was carried out;
- ``end``: the recorder stopped.

:func:`read_record` checks the version (a clear ``ValueError`` for another one) and tolerates a truncated last line
(a recorder killed mid-write). :class:`RecordWriter` is the only I/O here; the rest is pure.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.control.controller import ActorObservation, ControllerConfig, Decision, Observation
from cluster.control.observe import ActorCounters, ObserverConfig
from cluster.wire.telemetry import FinishedSample, ProxyReport

RECORD_VERSION = 1
KINDS = ("header", "arrival", "finished", "rejected", "observation", "decision", "pools", "end", "counters")
_FINISHED_FIELDS = tuple(f.name for f in dataclasses.fields(FinishedSample))


def encode(kind: str, t: float, fields: dict[str, Any]) -> str:
    """One record as a JSON line (no newline). Pure."""
    if kind not in KINDS:
        raise ValueError(f"record kind: must be one of {KINDS}, got {kind!r}")
    return json.dumps({"kind": kind, "t": float(t), **fields}, separators=(",", ":"))  # exact: a replay is too


def header_fields(source: str, controller: ControllerConfig, observer: ObserverConfig, initial: tuple[int, int],
                  dry_run: bool = False, profile: dict[str, Any] | None = None,
                  wall_time: float | None = None) -> dict[str, Any]:
    """The header's fields. Pure (``wall_time`` passed in, or None)."""
    return {"version": RECORD_VERSION, "source": source, "wall_time": wall_time,
            "controller": dataclasses.asdict(controller), "observer": dataclasses.asdict(observer),
            "initial": [int(initial[0]), int(initial[1])], "dry_run": bool(dry_run), "profile": profile}


def report_records(report: ProxyReport, received_t: float) -> list[tuple[str, float, dict[str, Any]]]:
    """A proxy's report as records on the receiver's clock: an arrival at ``received_t - age``, a finished request
    at ``received_t - age`` (its end), refusals at ``received_t``. Pure."""
    out: list[tuple[str, float, dict[str, Any]]] = []
    for a in report.arrivals:
        out.append(("arrival", received_t - a.age_s, {"proxy": report.proxy_id, "prompt_tokens": a.prompt_tokens,
                                                       **({"client": a.client} if a.client else {}),
                                                       "max_tokens": a.max_tokens, "n": a.n}))
    for f in report.finished:  # at its end (a report from before finished requests had ages: at the receipt)
        out.append(("finished", received_t - f.age_s, {"proxy": report.proxy_id,
                                                        **{k: getattr(f, k) for k in _FINISHED_FIELDS}}))
    if report.rejected or report.failed:
        out.append(("rejected", received_t, {"proxy": report.proxy_id, "count": report.rejected,
                                              "failed": report.failed}))
    return out


def decision_fields(d: Decision, applied: bool, manual: bool = False) -> dict[str, Any]:
    """A decision as a record's fields (holds too: their reason says why nothing changed). Pure."""
    return {"n_prefill": d.n_prefill, "n_decode": d.n_decode, "add": list(d.add), "drain": list(d.drain),
            "flip": [list(f) for f in d.flip], "reason": d.reason, "changes": d.changes,
            "applied": bool(applied and d.changes), "manual": manual}


def counters_fields(counters: list[ActorCounters]) -> dict[str, Any]:
    """Every actor's counters at one window as a record's fields. Pure."""
    return {"actors": [dataclasses.asdict(c) for c in counters]}


def observation_fields(obs: Observation) -> dict[str, Any]:
    return {"observation": dataclasses.asdict(obs)}


def observation_from_dict(d: dict[str, Any]) -> Observation:
    """The inverse of :func:`observation_fields`' ``observation``. Pure."""
    actors = tuple(ActorObservation(**a) for a in d.get("actors", ()))
    lists = {k: tuple(d[k]) for k in ("arrivals_by_class", "output_by_class") if k in d}  # JSON gives lists
    return Observation(**{**d, "actors": actors, **lists})


@dataclass(frozen=True)
class Arrival:
    t: float
    proxy: str
    prompt_tokens: int
    max_tokens: int
    n: int = 1
    output_tokens: int | None = None  # known only to a simulator's record
    client: str = ""  # the client that sent it, a digest of its ``user`` ("": unnamed, or a record from before 2026-12-07)


@dataclass(frozen=True)
class Finished:
    t: float
    proxy: str
    sample: FinishedSample


@dataclass(frozen=True)
class Recording:
    """A record file, read: every kind in time order."""

    source: str
    controller: ControllerConfig
    observer: ObserverConfig
    initial: tuple[int, int]
    dry_run: bool
    profile: dict[str, Any] | None
    arrivals: tuple[Arrival, ...]
    finished: tuple[Finished, ...]
    rejected: tuple[tuple[float, int], ...]  # (t, count)
    observations: tuple[tuple[float, Observation], ...]
    decisions: tuple[dict[str, Any], ...]  # the decision records as written (``t`` included)
    pools: tuple[tuple[float, int, int], ...]  # (t, prefill, decode)
    end_t: float  # the last time in the record
    truncated: bool = False  # its last line was cut off (ignored)
    failed: tuple[tuple[float, int], ...] = ()  # (t, count): failed otherwise (5xx, mid-stream errors, 499)
    counters: tuple[tuple[float, tuple[ActorCounters, ...]], ...] = ()  # (t, every actor's counters then)


def parse_record(lines: list[str], name: str = "record") -> Recording:
    """Records from lines (see the module docstring). ``ValueError`` names the first bad line; a last line that is
    not valid JSON is taken as cut off mid-write and ignored. Pure."""
    rows: list[tuple[int, dict[str, Any]]] = []
    numbered = [(i, ln) for i, ln in enumerate(lines, 1) if ln.strip()]
    truncated = False
    for k, (i, ln) in enumerate(numbered):
        try:
            row = json.loads(ln)
        except json.JSONDecodeError as e:
            if k == len(numbered) - 1 and k > 0:
                truncated = True
                break
            raise ValueError(f"{name}:{i}: not a JSON line: {e}") from None
        if not isinstance(row, dict) or row.get("kind") not in KINDS or not isinstance(row.get("t"), (int, float)):
            raise ValueError(f"{name}:{i}: expected an object with a kind in {KINDS} and a time t")
        rows.append((i, row))
    if not rows or rows[0][1]["kind"] != "header":
        raise ValueError(f"{name}: the first line must be the record's header (is this a pdcluster record?)")
    head = rows[0][1]
    if head.get("version") != RECORD_VERSION:
        raise ValueError(f"{name}: record format version {head.get('version')!r}; this pdcluster reads version "
                         f"{RECORD_VERSION} (replay it with the pdcluster that wrote it, or record again)")
    try:
        fields = dict(head["controller"])
        if "ranks" in fields:  # a tuple, written as a JSON list
            fields["ranks"] = tuple(fields["ranks"])
        controller = ControllerConfig(**fields)
        observer = ObserverConfig(**head["observer"])
        initial = (int(head["initial"][0]), int(head["initial"][1]))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ValueError(f"{name}:1: a bad header: {e}") from None
    arrivals, finished, rejected, failed, observations, decisions, pools = [], [], [], [], [], [], []
    counters: list[tuple[float, tuple[ActorCounters, ...]]] = []
    end_t = 0.0
    for i, row in sorted(rows[1:], key=lambda r: (r[1]["t"], r[0])):
        kind, t = row["kind"], float(row["t"])
        end_t = max(end_t, t)
        try:
            if kind == "arrival":
                out = row.get("output_tokens")
                arrivals.append(Arrival(t, str(row.get("proxy", "")), int(row["prompt_tokens"]),
                                        int(row["max_tokens"]), int(row.get("n", 1)),
                                        None if out is None else int(out), str(row.get("client", ""))))
            elif kind == "finished":
                finished.append(Finished(t, str(row.get("proxy", "")),
                                         FinishedSample(**{k: row[k] for k in _FINISHED_FIELDS if k in row})))
            elif kind == "rejected":
                rejected.append((t, int(row["count"])))
                failed.append((t, int(row.get("failed", 0))))
            elif kind == "observation":
                observations.append((t, observation_from_dict(row["observation"])))
            elif kind == "decision":
                decisions.append(row)
            elif kind == "pools":
                pools.append((t, int(row["prefill"]), int(row["decode"])))
            elif kind == "counters":
                counters.append((t, tuple(ActorCounters(**a) for a in row["actors"])))
            elif kind == "header":
                raise ValueError("a second header")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{name}:{i}: a bad {kind} record: {e}") from None
    return Recording(str(head.get("source", "")), controller, observer, initial, bool(head.get("dry_run")),
                     head.get("profile"), tuple(arrivals), tuple(finished), tuple(rejected), tuple(observations),
                     tuple(decisions), tuple(pools), end_t, truncated, tuple(failed), tuple(counters))


def read_record(path: str | Path) -> Recording:
    """Read a record file (see :func:`parse_record`); a name ending in ``.gz`` is read through gzip (a record kept as
    test data)."""
    p = Path(path)
    text = gzip.decompress(p.read_bytes()).decode() if p.suffix == ".gz" else p.read_text()
    return parse_record(text.splitlines(), str(path))


class RecordWriter:
    """Mutates: appends records to a file, one JSON line each, flushed per line (a crash loses at most the line being
    written). Thread-safe. Times are seconds since the writer started on ``clock`` unless passed."""

    def __init__(self, path: str | Path, header: dict[str, Any], clock: Any = time.monotonic) -> None:
        self.path = Path(path)
        self.clock = clock
        self.t0 = clock()
        self._lock = threading.Lock()
        self._f = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self.write("header", 0.0, header)

    def now(self) -> float:
        """Seconds since the record started, on its clock."""
        return self.clock() - self.t0

    def write(self, kind: str, t: float | None, fields: dict[str, Any]) -> None:
        line = encode(kind, self.now() if t is None else t, fields)
        with self._lock:
            if not self._f.closed:
                self._f.write(line + "\n")
                self._f.flush()

    def close(self, t: float | None = None) -> None:
        """Mutates: writes the ``end`` record (at ``t``, default now) and closes the file (again: nothing)."""
        with self._lock:
            if self._f.closed:
                return
        self.write("end", t, {})
        with self._lock:
            self._f.close()
