"""The live connector: a Ray actor that adds and drains worker actors, by hand (``pdcluster scale``) or driven by
the controller core (``pdcluster autoscale on``).

Adding starts a named actor (``pdcluster-worker-<i>``, a :class:`cluster.actor.worker_actor.WorkerActor`); proxies find it on
their next pool refresh (every second) once its model is loaded. Draining tells the actor to take no new work (a
decode actor refuses new reservations; both report ``draining``, so proxies stop routing to them), waits until it is
idle (every request it holds has finished), then stops it: no request is lost. Flipping drains the same way, then
changes the actor's role in place: the loaded engine stays, only the role's threads and sockets are rebuilt (a fraction
of a second against a model load), and proxies move it to its new pool on their next refresh. When a resize grows one
pool and shrinks the other, the manager flips rather than drains and starts, unless actors are pinned to role-specific
Ray resources (``role_resources``: the pools live on different node groups), where a flip is a drain plus a start.

Observations for the controller are built by :func:`cluster.control.observe.build`, the builder the simulator uses too, from
two sources: every actor's cumulative counters (:class:`~cluster.wire.telemetry.WorkerStats`: tokens computed and
generated, busy seconds, queued prompt tokens, KV blocks), differenced per actor so flips and departures never distort
a rate, and the proxies' :class:`~cluster.wire.telemetry.ProxyReport` values, which each proxy hands to :meth:`report`
every pool refresh (demand as it arrives, 429s, what waits for decode KV, finished requests with their TTFT parts).
Per-actor capacity is measured under load, seeded from a ``pdcluster profile`` cost profile when one is given.

``autoscale(True, record=FILE)`` writes the loop's record (:mod:`cluster.control.record`: every arrival and finished request
the proxies report, on this actor's clock, every observation and every decision with its reason) for ``pdcluster
simulate --replay``; ``dry_run=True`` decides and logs every decision without carrying any out.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from dataclasses import replace
from typing import Any

import ray

from cluster.control import budget
from cluster.control.controller import ControllerConfig, ControllerState, Decision, Observation, decide
from cluster.control.observe import (ActorCounters, ObserverConfig, ObserverState, build, demand_from_reports,
                             observation_summary)
from cluster.control.record import (RecordWriter, counters_fields, decision_fields, header_fields, observation_fields,
                                   report_records)
from cluster.wire.worker_config import WorkerConfig
from cluster.wire.telemetry import ProxyReport, WorkerStats
from cluster.wire.names import NAMESPACE, WORKER_PREFIX, worker_names


def flips_allowed(worker: WorkerConfig | None, resources: dict[str, dict[str, Any]]) -> bool:
    """Whether the manager may flip an actor's role in place: not when actors are pinned to role-specific Ray
    resources (the other role's pool lives elsewhere), nor when the roles' tensor-parallel sizes differ (the engine's
    ranks, and on GPUs the actor's GPU count, are fixed when it loads). Otherwise a flip is a drain plus a start.
    ``worker`` None (a manager built to test its decisions alone): one TP size. Pure."""
    same_tp = worker is None or worker.flips_keep_tp
    return same_tp and not any(r.get("resources") for r in resources.values())


class PoolManager:
    """One per cluster (a named Ray actor). Changes run one at a time; ``status`` answers while they run."""

    def __init__(self, worker: WorkerConfig, kv: Any, resources: dict[str, dict[str, Any]], on_transfer_failure: str,
                 controller: ControllerConfig, drain_timeout_s: float = 600.0,
                 profile: dict[str, Any] | None = None) -> None:
        """``profile``: a ``pdcluster profile`` cost profile (its JSON as a dict) to seed each actor's capacity with
        until it is measured under load; None: unknown until measured (the controller's defaults apply)."""
        self.worker, self.kv, self.resources = worker, kv, resources
        self.on_transfer_failure = on_transfer_failure
        self.controller = controller
        self.drain_timeout_s = drain_timeout_s
        self._lock = threading.Lock()  # guards the fields below
        self._change = threading.Lock()  # one change at a time
        self.handles: dict[str, Any] = {}
        self.roles: dict[str, str] = {}
        self.draining: set[str] = set()
        # pinned to role-specific resources, an actor cannot serve the other role where it runs; with different TP
        # sizes per role, it would keep the wrong size (its engine's ranks and GPUs are fixed at load)
        self.flip_in_place = flips_allowed(worker, resources)
        for name in worker_names():
            self.handles[name] = ray.get_actor(name, namespace=NAMESPACE)
            self.roles[name] = ray.get(self.handles[name].info.remote(), timeout=600)["role"]
        self.next_index = 1 + max([int(n.removeprefix(WORKER_PREFIX)) for n in self.roles] or [-1])
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=200)
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(maxlen=50)
        self.decision_count = 0  # decisions that changed something, since start
        self._autoscale = threading.Event()
        self._auto_thread: threading.Thread | None = None
        self._state = ControllerState()
        self.observer = ObserverConfig(slo_ttft_s=controller.slo_ttft_s, slo_tpot_s=controller.slo_tpot_s)
        if profile is not None:
            from cluster.control.sim_model import CostProfile

            self.observer = CostProfile(**profile).observer_config(controller)
        # the live actors count K/V in blocks of the workers' block size (the simulator, in tokens)
        if worker is not None:  # (a manager built without workers, as a test's dry run is, keeps the default)
            self.observer = dataclasses.replace(self.observer, kv_unit_tokens=worker.block_size)
        self._observed = ObserverState()
        self._reports: list[ProxyReport] = []  # reported by proxies since the last window
        self.latency_samples = 0  # finished requests reported since start
        self.last_observation: dict[str, Any] | None = None  # what the controller saw last (status)
        self.profile = profile
        self.dry_run = False  # autoscale decides and logs, but changes nothing
        self._recorder: RecordWriter | None = None  # autoscale's record (autoscale(True, record=...)), while on

    # -- queries ----------------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._lock:
            actors = [{"name": n, "role": r, "draining": n in self.draining} for n, r in sorted(self.roles.items())]
            return {"actors": actors, "autoscale": self._autoscale.is_set(), "dry_run": self.dry_run,
                    "recording": str(self._recorder.path) if self._recorder else None, "busy": self._change.locked(),
                    "decision_count": self.decision_count, "latency_samples": self.latency_samples,
                    "decisions": list(self.decisions)[-10:], "events": list(self.events)[-20:],
                    "observation": self.last_observation}

    def report(self, message: dict[str, Any]) -> None:
        """Mutates: a proxy's :class:`ProxyReport` (wire form), for the next window's observation. Raises
        ``ValueError`` for a malformed one."""
        report = ProxyReport.from_dict(message)
        with self._lock:
            # kept only while autoscale runs (its windows read them); bounded: a stuck loop must not grow it
            if self._autoscale.is_set() and len(self._reports) < 10_000:
                self._reports.append(report)
            self.latency_samples += len(report.finished)
            recorder = self._recorder if self._autoscale.is_set() else None
        if recorder is not None:  # arrival times: this clock's receipt minus the proxy's measured age
            for kind, t, fields in report_records(report, recorder.now()):
                recorder.write(kind, t, fields)

    def counts(self) -> dict[str, int]:
        with self._lock:
            live = [r for n, r in self.roles.items() if n not in self.draining]
            return {"prefill": live.count("prefill"), "decode": live.count("decode")}

    # -- changes ----------------------------------------------------------------------------------------------------
    def scale(self, n_prefill: int, n_decode: int) -> dict[str, Any]:
        """Mutates: add or drain actors until the pools have these sizes. Blocks until done; returns the counts."""
        if n_prefill < 1 or n_decode < 1:
            raise ValueError(f"n_prefill/n_decode: need at least one of each, got {n_prefill}/{n_decode}")
        if budget.used(n_prefill, n_decode, self.controller) > self.controller.budget:
            rp, rd = self.controller.ranks
            raise ValueError(f"n_prefill + n_decode: {n_prefill}P x {rp} + {n_decode}D x {rd} ranks exceed the budget "
                             f"{self.controller.budget}")
        with self._change:
            now = self.counts()
            adds = ["prefill"] * max(0, n_prefill - now["prefill"]) + ["decode"] * max(0, n_decode - now["decode"])
            drains = self._least_loaded("prefill", now["prefill"] - n_prefill) + \
                self._least_loaded("decode", now["decode"] - n_decode)
            flips: list[tuple[str, str]] = []
            while self.flip_in_place and adds and any(self.roles[d] != adds[0] for d in drains):
                name = next(d for d in drains if self.roles[d] != adds[0])  # one pool's surplus becomes the other's
                drains.remove(name)
                flips.append((name, adds.pop(0)))
            reason = f"manual scale {now['prefill']}P:{now['decode']}D -> {n_prefill}P:{n_decode}D"
            self._record(Decision(n_prefill, n_decode, tuple(adds), tuple(drains), tuple(flips), reason=reason),
                         applied=True, manual=True)
            self._apply(adds, drains, flips)
        self._record_pools()
        return self.counts()

    def set_flip_in_place(self, on: bool) -> bool:
        """Mutates: flip roles in place (True) or carry flips out as a drain plus a start (False). Returns it.
        ``ValueError`` for True when the pools' TP sizes differ (an actor cannot change its size in a flip)."""
        if on and not flips_allowed(self.worker, {}):
            raise ValueError(f"on: no role flips in place between TP sizes (prefill_tp {self.worker.prefill_tp}, "
                             f"decode_tp {self.worker.decode_tp}): the pools change by starting and draining actors")
        self.flip_in_place = bool(on)
        return self.flip_in_place

    def autoscale(self, on: bool, record: str | None = None, dry_run: bool = False) -> bool:
        """Mutates: start or stop the control loop (every ``interval_s``). ``record``: a file (on the node this actor
        runs on) for the loop's record, written until autoscale goes off (a loop already on starts a new one);
        ``dry_run``: decide and log every decision, carry none out. Returns the new setting. ``OSError`` when the
        record cannot be written."""
        if on:
            self.dry_run = bool(dry_run)
            if record:
                writer = RecordWriter(record, header_fields(
                    "live", self.controller, self.observer, self._sizes(), dry_run=self.dry_run, profile=self.profile,
                    wall_time=time.time()))
                with self._lock:
                    old, self._recorder = self._recorder, writer
                if old is not None:
                    old.close()
        if on and not self._autoscale.is_set():
            with self._lock:  # windows start afresh: the first one takes baselines
                self._observed, self._reports = ObserverState(), []
            self._autoscale.set()
            self._auto_thread = threading.Thread(target=self._auto_loop, name="autoscale", daemon=True)
            self._auto_thread.start()
        elif not on:
            self._autoscale.clear()
            with self._lock:
                old, self._recorder = self._recorder, None
            if old is not None:
                old.close()
        extra = (" (dry run: decisions are logged, not carried out)" if on and self.dry_run else "") + \
            (f", recording to {record}" if on and record else "")
        self._event(f"autoscale {'on' if on else 'off'}{extra}")
        return self._autoscale.is_set()

    def _sizes(self) -> tuple[int, int]:
        c = self.counts()
        return c["prefill"], c["decode"]

    def _record_pools(self) -> None:
        recorder = self._recorder
        if recorder is not None:
            p, d = self._sizes()
            recorder.write("pools", None, {"prefill": p, "decode": d})

    def _least_loaded(self, role: str, n: int) -> list[str]:
        if n <= 0:
            return []
        with self._lock:
            names = [name for name, r in self.roles.items() if r == role and name not in self.draining]
        stats = [WorkerStats.from_dict(s) for s in ray.get([self.handles[n].stats.remote() for n in names], timeout=30)]
        load = {name: s.running + s.waiting for name, s in zip(names, stats)}
        return sorted(names, key=lambda name: (load[name], name))[:n]

    def _apply(self, adds: list[str], drains: list[str], flips: list[tuple[str, str]] | None = None) -> None:
        """Start ``adds`` (roles), drain and stop ``drains`` (names), drain and flip ``flips`` ((name, new role))."""
        flips = flips or []
        started = [self._start(role) for role in adds]  # start first: capacity before removal
        for name in started:
            ray.get(self.handles[name].info.remote(), timeout=600)
            self._event(f"{name} ready")
        for name in drains + [name for name, _ in flips]:
            with self._lock:
                self.draining.add(name)
            ray.get(self.handles[name].drain.remote(), timeout=30)
            self._event(f"{name} draining")
        for name, role in flips:
            self._wait_idle(name)
            self._flip(name, role)
        for name in drains:
            self._wait_idle(name)
            self._stop(name)

    def _flip(self, name: str, role: str) -> None:
        """The drained, idle actor ``name`` becomes ``role`` in place (stopped and replaced if that fails)."""
        old = self.roles[name]
        try:
            out = ray.get(self.handles[name].flip.remote(role), timeout=120)
        except Exception as e:  # a request arrived after all, or the actor is gone: do it the slow way
            self._event(f"{name} could not flip ({type(e).__name__}: {e}); stopping it and starting a {role} actor")
            self._wait_idle(name)
            self._stop(name)
            ray.get(self.handles[self._start(role)].info.remote(), timeout=600)
            return
        with self._lock:
            self.roles[name] = role
            self.draining.discard(name)
        self._event(f"{name} flipped {old} -> {role} in {out['seconds']:.2f}s (same weights)")

    def _start(self, role: str) -> str:
        from cluster.actor.worker_actor import WorkerActor

        with self._lock:
            name = f"{WORKER_PREFIX}{self.next_index}"
            self.next_index += 1
        cls = ray.remote(**self.resources[role])(WorkerActor)
        handle = cls.options(name=name).remote(name, role, self.worker, self.kv, self.on_transfer_failure)
        with self._lock:
            self.handles[name], self.roles[name] = handle, role
        self._event(f"{name} starting")
        return name

    def _wait_idle(self, name: str, quiet_s: float = 3.0) -> None:
        """Until the actor has been idle for ``quiet_s`` on end: longer than a proxy's pool refresh (1 s), so a
        request routed just before the proxy saw ``draining`` has reached the actor and is counted."""
        deadline = time.monotonic() + self.drain_timeout_s
        idle_since: float | None = None
        while time.monotonic() < deadline:
            try:
                idle = WorkerStats.from_dict(ray.get(self.handles[name].stats.remote(), timeout=30)).idle
            except Exception:  # already gone
                return
            now = time.monotonic()
            idle_since = (idle_since or now) if idle else None
            if idle_since is not None and now - idle_since >= quiet_s:
                return
            time.sleep(0.25)
        self._event(f"{name} still busy after {self.drain_timeout_s:.0f}s: stopping it anyway")

    def _stop(self, name: str) -> None:
        handle = self.handles[name]
        try:
            ray.get(handle.shutdown.remote(), timeout=30)
        except Exception:
            pass
        ray.kill(handle)
        with self._lock:
            self.handles.pop(name, None)
            self.roles.pop(name, None)
            self.draining.discard(name)
        self._event(f"{name} stopped")

    def _event(self, what: str) -> None:
        with self._lock:
            self.events.append({"t": round(time.time(), 3), "event": what})

    def _record(self, d: Decision, applied: bool, manual: bool = False) -> None:
        """Mutates: a decision that changes something goes to ``status`` (its reason, what it does, whether it is
        carried out); every decision, holds included, goes to the record when one is written."""
        recorder = self._recorder
        if recorder is not None:
            recorder.write("decision", None, decision_fields(d, applied, manual))
        if not d.changes:
            return
        with self._lock:
            if applied:
                self.decision_count += 1
            self.decisions.append({"t": round(time.time(), 3), "reason": d.reason, "add": list(d.add),
                                   "drain": list(d.drain), "flip": [list(f) for f in d.flip],
                                   "target": [d.n_prefill, d.n_decode], "applied": applied, "manual": manual})

    # -- the control loop -------------------------------------------------------------------------------------------
    def _observe(self) -> Observation | None:
        """Mutates the observer's state: this window's observation (None on the first call: baselines only)."""
        with self._lock:
            names, draining = list(self.roles), set(self.draining)
        refs = [self.handles[n].stats.remote() for n in names]
        counters = []
        for name, ref in zip(names, refs):
            try:
                c = ActorCounters.from_stats(WorkerStats.from_dict(ray.get(ref, timeout=30)))
            except Exception:  # stopped meanwhile (a drain finished): it just drops out of the window
                continue
            counters.append(replace(c, actor_id=name, draining=c.draining or name in draining))
        now = time.monotonic()
        with self._lock:
            reports, self._reports = self._reports, []
        demand = demand_from_reports(reports, self.controller.slo_ttft_s, self.controller.slo_tpot_s)
        obs, self._observed = build(now, counters, demand, self.observer, self._observed)
        recorder = self._recorder
        if recorder is not None:  # what each actor measured this window: a replay calibrates each interval from it
            recorder.write("counters", now - recorder.t0, counters_fields(counters))
        return obs

    def _auto_loop(self) -> None:
        while self._autoscale.is_set():
            time.sleep(self.controller.interval_s)
            if not self._autoscale.is_set():
                return
            try:
                self._step()
            except Exception as e:  # keep controlling; the error shows in status
                self._event(f"autoscale step failed: {type(e).__name__}: {e}")

    def _step(self) -> Decision | None:
        """Mutates: one control window: observe, decide, log (and record) the decision, carry it out unless this is a
        dry run. Returns the decision (None for the first window: baselines only)."""
        obs = self._observe()
        if obs is None:
            return None
        recorder = self._recorder
        if recorder is not None:
            recorder.write("observation", None, observation_fields(replace(obs, t=obs.t - recorder.t0)))
        with self._lock:
            self.last_observation = observation_summary(obs)
        decision, self._state = decide(obs, self.controller, self._state)
        self._record(decision, applied=not self.dry_run)
        if not decision.changes:
            return decision
        if self.dry_run:
            self._event(f"dry run, not carried out: {decision.reason}")
            return decision
        adds, drains, flips = list(decision.add), list(decision.drain), list(decision.flip)
        if not self.flip_in_place:  # pinned actors: a flip is a drain plus a start
            adds += [role for _, role in flips]
            drains += [name for name, _ in flips]
            flips = []
        with self._change:
            self._apply(adds, drains, flips)
        self._record_pools()
        return decision
