"""Replay an autoscale record (:mod:`cluster.control.record`) through the simulator in closed loop, and compare.

``pdcluster simulate --replay FILE`` re-runs the recorded arrivals (their times, prompt lengths and output lengths)
through :class:`~cluster.control.simulator.Simulation` with the simulator's own controller deciding: the recorded
controller config and SLOs, the recorded observer config, the recorded initial pool sizes and budget. It then puts
the live decisions (times, reasons, whether applied) beside the simulated ones, and live attainment (the finished
requests the proxies reported, 429s counted as misses) beside simulated attainment.

Output lengths: a simulator's record carries each arrival's; a live record has the requested ``max_tokens`` per
arrival and the finished requests' output lengths with no request id linking the two, so each arrival takes the
output (and prefix-cache hit: its prefill computes only the rest) of the next unmatched finished request from the
same proxy with the same prompt length (in time order), and ``max_tokens x n`` (an upper bound) when there is none (a
refused or unfinished request).

:func:`record_simulation` writes a record of a simulated run (what a replay of it must reproduce exactly: the
simulator is deterministic given its arrivals).
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cluster.control.controller import (ControllerConfig, ControllerState, Decider, Decision, Observation, decide,
                                        plan)
from cluster.control.record import (Finished, Recording, RecordWriter, decision_fields, header_fields, observation_fields)
from cluster.control.sim_model import CostProfile, Trace
from cluster.control.simulator import SimResult, Simulation
from cluster.wire.slo import RequestLatency, SloConfig, judge


def match_finished(rec: Recording) -> list[Finished | None]:
    """Each recorded arrival's finished request, in the record's order (None: refused, unfinished, or a simulator's
    record, whose arrivals carry their outputs): among the unmatched finished requests from the same proxy with the
    same prompt length, the one whose own arrival (its end less its TTFT and its tokens' TPOT) is nearest the
    arrival's time, in a record that times each finished request at its end (its ``age_s``); in an older one (timed
    by the report that carried it, up to ~1 s late) the first in time order. Pure."""
    pool: dict[tuple[str, int], list[Finished]] = defaultdict(list)
    for f in rec.finished:  # in time order
        pool[(f.proxy, f.sample.prompt_tokens)].append(f)
    at_end = any(f.sample.age_s > 0 for f in rec.finished)

    def began(f: Finished) -> float:
        return f.t - f.sample.ttft_s - f.sample.decode_s

    out: list[Finished | None] = []
    for a in rec.arrivals:
        q = pool.get((a.proxy, a.prompt_tokens)) if a.output_tokens is None else None
        if not q:
            out.append(None)
            continue
        out.append(q.pop(min(range(len(q)), key=lambda j: abs(began(q[j]) - a.t)) if at_end else 0))
    return out


def _arrival_order(rec: Recording) -> np.ndarray:
    """The record's arrivals in the order of :func:`trace_from_recording`'s trace (time order, stable). Pure."""
    return np.argsort(np.asarray([max(0.0, a.t) for a in rec.arrivals]), kind="stable")


def trace_from_recording(rec: Recording) -> Trace:
    """The recorded arrivals as a simulator trace (times from the record's start, never negative). Pure."""
    if not rec.arrivals:
        raise ValueError("the record holds no arrivals: nothing to replay")
    t, prompt, output, asked, cached = [], [], [], [], []
    for a, f in zip(rec.arrivals, match_finished(rec)):
        hit = 0
        if a.output_tokens is not None:
            out = a.output_tokens
        else:
            out, hit = (f.sample.output_tokens, f.sample.cached_tokens) if f else (a.max_tokens * a.n, 0)
        t.append(max(0.0, a.t))
        prompt.append(max(1, a.prompt_tokens))
        output.append(max(1, out))
        asked.append(max(1, out, a.max_tokens * a.n))
        cached.append(min(hit, max(0, a.prompt_tokens - 1)))
    order = _arrival_order(rec)
    ts = np.asarray(t, dtype=np.float64)[order]
    return Trace(ts, np.asarray(prompt, dtype=np.int64)[order], np.asarray(output, dtype=np.int64)[order],
                 float(max(rec.end_t, ts[-1])), max_tokens=np.asarray(asked, dtype=np.int64)[order],
                 cached=np.asarray(cached, dtype=np.int64)[order] if any(cached) else None)


def recorded_think(rec: Recording, default_s: float = 0.0) -> np.ndarray:
    """Each arrival's think time as recorded, in the order of :func:`trace_from_recording`'s trace: for a named
    client's request after its first, its arrival less the end of the client's previous request (its finished line's
    time: the request's end in records that stamp it); ``default_s`` for a first request, an unnamed one, or one whose
    previous request has no finished line. Pure."""
    ends = [f.t if f else None for f in match_finished(rec)]
    think = np.full(len(rec.arrivals), float(default_s))
    last: dict[str, int] = {}
    for i in sorted(range(len(rec.arrivals)), key=lambda i: rec.arrivals[i].t):
        a = rec.arrivals[i]
        if not a.client:
            continue
        prev = last.get(a.client)
        if prev is not None and ends[prev] is not None:
            think[i] = max(0.0, a.t - ends[prev])  # type: ignore[operator]
        last[a.client] = i
    order = _arrival_order(rec)
    return think[order]


def live_attainment(rec: Recording) -> dict[str, Any]:
    """Attainment of the recorded (live) run, as ``pdcluster_slo_attainment`` judges: finished requests within both
    SLOs over finished plus refused (429) plus failed. Pure."""
    cfg = rec.controller
    slo = SloConfig(ttft_s=cfg.slo_ttft_s, tpot_s=cfg.slo_tpot_s)
    met = sum(1 for f in rec.finished if judge(RequestLatency(f.sample.ttft_s, f.sample.tpot_s), slo).met)
    refused = sum(n for _, n in rec.rejected)
    failed = sum(n for _, n in rec.failed)
    judged = len(rec.finished) + refused + failed
    return {"requests": judged, "met": met, "refused": refused, "failed": failed,
            "slo_attainment": round(met / judged, 4) if judged else None}


def replay(rec: Recording, profile: CostProfile, speed: Sequence[tuple[float, float, float]] = (),
           pinned: bool = False, actor_speed: Sequence[tuple[float, Sequence[float]]] = (),
           clients: Mapping[int, int] | str | None = None, think_s: float = 0.0) -> tuple[SimResult, Trace]:
    """Run the record's arrivals through the simulator, its controller deciding as the recorded one was configured;
    ``speed``: the machine's speed over the run (:func:`cluster.control.calibrate.speed_over_time`); ``pinned``: the
    pools change as the record's did instead (:func:`as_recorded`), so the replay's latencies are compared on the
    same pools; ``actor_speed``: each decode actor's own speed (:func:`cluster.control.calibrate.actor_speed_over_time`);
    ``clients``: the requests asking ``max_tokens`` m came from ``clients[m]`` clients in closed loop (each sends its
    next request ``think_s`` after its last answer ended), replayed so (:func:`closed_loop`); ``"named"``: each client
    the record's arrivals name is one such client (:func:`named_clients`; unnamed arrivals keep their times), each
    request after the client's recorded think time (:func:`recorded_think`; ``think_s`` where unknown); else
    every arrival at its recorded time. Pure (deterministic)."""
    trace = trace_from_recording(rec)

    def run(tr: Trace) -> SimResult:
        return Simulation(tr, profile, rec.controller, rec.controller.budget, rec.initial, observer=rec.observer,
                          baseline_first=rec.source == "live",  # live, the manager's first step takes baselines only
                          speed=speed, decider=as_recorded(rec) if pinned else decide, actor_speed=actor_speed).run()

    if clients == "named":
        classes = named_clients(rec)
        result, trace, _ = closed_loop(trace, run, {int(k): 1 for k in set(classes.tolist()) if k >= 0},
                                       recorded_think(rec, think_s), profile.queue_timeout_s, classes=classes)
        return result, trace
    if isinstance(clients, str):
        raise ValueError(f"clients: a mapping of max_tokens to client counts or 'named', got {clients!r}")
    if clients:
        result, trace, _ = closed_loop(trace, run, clients, think_s, profile.queue_timeout_s)
        return result, trace
    return run(trace), trace


def named_clients(rec: Recording) -> np.ndarray:
    """Each recorded arrival's client as an index (the same for the same name, -1 unnamed), in the order of
    :func:`trace_from_recording`'s trace (time order). Pure."""
    names: dict[str, int] = {}
    keys = [names.setdefault(a.client, len(names)) if a.client else -1 for a in rec.arrivals]
    order = _arrival_order(rec)
    return np.asarray(keys, dtype=np.int64)[order]


def closed_loop(trace: Trace, run: Callable[[Trace], SimResult], clients: Mapping[int, int],
                think_s: float | np.ndarray = 0.0,
                refused_after_s: float = 0.0, max_rounds: int = 60,
                classes: np.ndarray | None = None) -> tuple[SimResult, Trace, int]:
    """``trace`` replayed as closed-loop clients: the requests asking ``max_tokens`` m (``trace.max_tokens``) come
    from ``clients[m]`` clients, so the first ``clients[m]`` of them arrive at their recorded times and each later
    one (in recorded order) when the first of those clients is free again: ``think_s`` after its last answer's last
    token (a refused one's 429 after ``refused_after_s``); other requests keep their times. Live, a client whose
    answer came late sent its next request late; replayed open loop, a slower replay piles requests up that live
    never had in flight at once. Solved as a fixed point: ``run`` (a simulation of a trace) is repeated with each
    round's arrivals from the last round's answers until no arrival moves (``max_rounds`` at most). Returns the last
    run, its trace (arrivals in time order) and the rounds it took (``max_rounds + 1``: it did not settle);
    ``classes``: each request's class instead of its ``max_tokens`` (:func:`named_clients`); ``think_s`` per request
    (in ``trace``'s order: the think before it) or one for all. Pure when ``run`` is."""
    if any(n < 1 for n in clients.values()) or np.any(np.asarray(think_s) < 0):
        raise ValueError("clients: every count must be >= 1, think_s >= 0")
    asked = trace.max_tokens if trace.max_tokens is not None else trace.asked()
    keys = asked if classes is None else classes
    t = trace.t.copy()
    for rounds in range(1, max_rounds + 1):
        order = np.argsort(t, kind="stable")
        tr = dataclasses.replace(trace, t=t[order], prompt=trace.prompt[order], output=trace.output[order],
                                 max_tokens=asked[order], cached=None if trace.cached is None else trace.cached[order])
        result = run(tr)
        busy = np.empty(len(t))  # each request's arrival to its answer's end, in the last run
        ends = result.ttft + result.tpot * np.maximum(0, tr.output - 1)
        busy[order] = np.where(np.isfinite(ends), ends, np.where(result.refused, refused_after_s,
                                                                   tr.duration - tr.t))
        new = follow(trace.t, keys, clients, busy, think_s)
        if np.max(np.abs(new - t)) <= 1e-6:
            return result, tr, rounds
        t = new
    return result, tr, max_rounds + 1


def follow(recorded_t: np.ndarray, asked: np.ndarray, clients: Mapping[int, int], busy: np.ndarray,
           think_s: float | np.ndarray) -> np.ndarray:
    """Arrival times of closed-loop clients (see :func:`closed_loop`): per ``max_tokens`` class, the first
    ``clients[m]`` requests at their recorded times, each later one when the earliest free client is free (its
    request's arrival plus ``busy`` plus ``think_s``, one for all or each request's own). ``recorded_t`` in time
    order. Pure."""
    out = recorded_t.astype(np.float64, copy=True)
    think = np.broadcast_to(np.asarray(think_s, dtype=np.float64), out.shape)
    for m, n in clients.items():
        free: list[float] = []  # when each of the class's busy clients is free again
        for j, k in enumerate(np.flatnonzero(asked == m)):
            if j >= n:
                out[k] = max(recorded_t[0], heapq.heappop(free) + think[k])
            heapq.heappush(free, out[k] + busy[k])
    return out


def as_recorded(rec: Recording) -> Decider:
    """A decider that changes the pools as the record did: each window takes the target sizes of the last recorded
    change at or before its end (within half an interval: the live windows' times are not the replay's), carried out
    on the simulated actors. Pure (its state is the controller state it is passed)."""
    changes = [(float(d["t"]), int(d["n_prefill"]), int(d["n_decode"])) for d in rec.decisions
               if d.get("changes") and d.get("applied", True)]
    half = rec.controller.interval_s / 2

    def decider(obs: Observation, cfg: ControllerConfig, state: ControllerState) -> tuple[Decision, ControllerState]:
        due = [c for c in changes if c[0] <= obs.t + half]
        if not due or obs.pending_changes:  # nothing recorded yet, or a change still under way
            live = obs.live("prefill"), obs.live("decode")
            return Decision(len(live[0]), len(live[1]), reason="hold: as recorded"), state
        t, p, d = due[-1]
        return plan(obs, cfg, state, p, d, f"as recorded at {t:.1f}s")

    return decider


def redecide(rec: Recording) -> tuple[int, int]:
    """Open-loop check of the record: ``decide()`` re-run on the recorded observations with the recorded config.
    Returns (recorded controller decisions it reproduces, in order and with the same reason; recorded controller
    decisions). A complete record reproduces every one. Pure."""
    state = ControllerState()
    again = []
    for _, obs in rec.observations:
        d, state = decide(obs, rec.controller, state)
        again.append(d.reason)
    recorded = [d["reason"] for d in rec.decisions if not d.get("manual")]
    return sum(1 for a, b in zip(again, recorded) if a == b), len(recorded)


def side_by_side(rec: Recording, result: SimResult, profile: CostProfile) -> dict[str, Any]:
    """The replay report: live and simulated decisions and attainment. Pure."""
    cfg = rec.controller
    live_changes = [d for d in rec.decisions if d.get("changes")]
    return {
        "source": rec.source, "dry_run": rec.dry_run, "policy": cfg.policy, "budget": cfg.budget,
        "initial": list(rec.initial), "interval_s": cfg.interval_s, "slo_ttft_s": cfg.slo_ttft_s,
        "slo_tpot_s": cfg.slo_tpot_s, "profile": profile.source, "duration_s": round(rec.end_t, 3),
        "arrivals": len(rec.arrivals), "truncated": rec.truncated, "redecided": list(redecide(rec)),
        "live": {**live_attainment(rec), "windows": len(rec.observations), "decisions": live_changes,
                 "pools": [{"t": t, "n_prefill": p, "n_decode": d} for t, p, d in rec.pools]},
        "simulated": {"requests": int(len(result.ok)), "met": int(result.ok.sum()),
                      "slo_attainment": round(float(result.ok.mean()), 4) if len(result.ok) else None,
                      "decisions": result.decisions, "timeline": result.timeline},
    }


def format_report(report: dict[str, Any]) -> str:
    """The side-by-side report as text. Pure."""
    live, sim = report["live"], report["simulated"]

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.1%}"

    lines = [f"replay of a {report['source']} record{' (dry run: decisions logged, not applied)' if report['dry_run'] else ''}:"
             f" {report['arrivals']} arrivals over {report['duration_s']:.0f}s, policy {report['policy']}, budget "
             f"{report['budget']}, start {report['initial'][0]}P:{report['initial'][1]}D, interval "
             f"{report['interval_s']:g}s, SLOs TTFT {report['slo_ttft_s']:g}s TPOT {report['slo_tpot_s']:g}s, "
             f"profile {report['profile']}" + ("; its last line was cut off" if report["truncated"] else ""),
             f"{'':10}{'attainment':>12}{'met':>8}{'judged':>8}{'changes':>9}",
             f"{'live':10}{pct(live['slo_attainment']):>12}{live['met']:>8}{live['requests']:>8}"
             f"{len(live['decisions']):>9}",
             f"{'simulated':10}{pct(sim['slo_attainment']):>12}{sim['met']:>8}{sim['requests']:>8}"
             f"{len(sim['decisions']):>9}",
             f"decide() on the recorded observations reproduces {report['redecided'][0]} of "
             f"{report['redecided'][1]} recorded decisions (holds included)",
             "live decisions:"]
    for d in live["decisions"]:
        tag = "" if d.get("applied") else "  (not applied: dry run)" if report["dry_run"] else "  (not applied)"
        lines.append(f"  {d['t']:8.1f}s  {'manual: ' if d.get('manual') else ''}{d['reason']}{tag}")
    lines.append("simulated decisions:")
    lines += [f"  {d['t']:8.1f}s  {d['reason']}" for d in sim["decisions"]]
    return "\n".join(lines)


def record_simulation(path: str | Path, trace: Trace, profile: CostProfile, cfg: ControllerConfig, workers: int,
                      initial: tuple[int, int] | None = None) -> SimResult:
    """Run a simulation and write its record (arrivals with their output lengths, every window's observation and
    decision, the finished requests). Mutates: writes ``path``."""
    windows: list[tuple[float, Observation, Decision]] = []
    sim = Simulation(trace, profile, cfg, workers, initial, on_control=lambda t, o, d: windows.append((t, o, d)))
    sizes = (sum(1 for a in sim.actors if a.role == "prefill"), sum(1 for a in sim.actors if a.role == "decode"))
    result = sim.run()
    writer = RecordWriter(path, header_fields("simulator", cfg, sim.obs_cfg, sizes, profile=dataclasses.asdict(profile),
                                              wall_time=time.time()))
    asked = trace.asked()
    try:
        for i in range(len(trace)):
            writer.write("arrival", float(trace.t[i]), {"proxy": "sim", "prompt_tokens": int(trace.prompt[i]),
                                                        "max_tokens": int(asked[i]), "n": 1,
                                                        "output_tokens": int(trace.output[i])})
        for t, obs, decision in windows:
            writer.write("observation", t, observation_fields(obs))
            writer.write("decision", t, decision_fields(decision, applied=True))
        for i in np.flatnonzero(np.isfinite(result.tpot)):
            end = float(trace.t[i] + result.ttft[i] + result.tpot[i] * max(1, int(trace.output[i]) - 1))
            writer.write("finished", end, {
                "proxy": "sim", "prompt_tokens": int(trace.prompt[i]), "cached_tokens": 0,
                "output_tokens": int(trace.output[i]), "ttft_s": float(result.ttft[i]),
                "tpot_s": float(result.tpot[i]), "admission_wait_s": float(max(0.0, result.admission_wait[i]))})
    finally:
        writer.close(result.duration)
    return result
