"""A cost profile measured from a live record, so that its replay simulates the machine it ran on. Pure: no I/O.

A live record's replay through the checked-in CPU profile predicted 100% where the run met 33.2%
(docs/controller.md): that profile was measured on a quiet machine with one engine; three actors sharing two cores
prefill and decode several times slower, and the path around them (RPCs, the decode join, the first delta's trip)
costs time the profile never counted. The record holds what is needed to correct it: every finished request's TTFT
parts and TPOT, and every window's observation (decode actors' queue depths, their K/V size).

:func:`calibrate` returns ``base`` with

- ``prefill_tps``: prompt tokens computed (cache hits left out) over the prefill compute seconds measured;
- ``prefill_overhead_s``: plus the median of what the TTFT parts leave of the TTFT (the unmodelled path), since the
  simulator's TTFT is its admission wait, prefill queue, prefill compute and exposed transfer only;
- ``exposed_transfer``: the measured exposed transfer over the base profile's full transfer time;
- the decode step's three coefficients scaled together, so a step at the batch the decoded tokens saw (the decode
  actors' depths, weighted by the tokens each decodes) and the decoding requests' mean context takes the finished
  requests' median TPOT;
- ``decode_kv_tokens``: the K/V tokens a decode actor holds, as the observations saw it.

With the engine's step budget (``budget_tokens``: the workers' ``max_num_batched_tokens``) the prefill is calibrated
for the simulator's step model instead (:mod:`cluster.control.sim_prefill`), from the measured step costs:

- ``prefill_step_s`` and ``prefill_tps``: a least-squares fit of every finished request's prefill compute seconds
  to ``steps x prefill_step_s + tokens / prefill_tps``, its steps ``ceil(tokens computed / budget)`` (each step's
  fixed cost and its per-token cost; both kept >= 0);
- ``ttft_path_s``: the median of what the TTFT parts leave (RPCs, the decode join), a latency that occupies no
  actor, where the per-request model had to charge it to the prefill actor as ``prefill_overhead_s`` (0 here).

What the record does not show (too few samples: under 8 finished requests with a measured part) is left as ``base``
has it; ``source`` says what was calibrated.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections.abc import Callable

from cluster.control.record import Finished, Recording
from cluster.control.sim_model import CostProfile

MIN_SAMPLES = 8
# an actor's first engine steps in a role are its warm-up (first forward passes at new shapes, allocations): live,
# a flipped decode actor's first two steps took 9 s where later ones took 0.1-0.5 s. A window whose baseline found
# the actor this early in its role measures the warm-up, not the machine, and is left out of the speed over time
WARMUP_STEPS = 4


def calibrate(rec: Recording, base: CostProfile, budget_tokens: int = 0, decode_warmup: bool = False) -> CostProfile:
    """``base`` corrected by what ``rec`` measured (see the module docstring); ``budget_tokens`` > 0: the engine's
    step budget, for the step model of prefill; ``decode_warmup``: with the decode steps' waits, also a new decode
    actor's warm-up (:func:`decode_warmup_s`; off by default: see docs/controller.md, 2026-12-08). Pure."""
    done = [f.sample for f in rec.finished]
    changes: dict[str, float] = {}
    pre = [s for s in done if s.prefill_compute_s > 0 and s.prompt_tokens > s.cached_tokens]
    if len(pre) >= MIN_SAMPLES and budget_tokens > 0:
        step_s, per_token = step_fit([(math.ceil((s.prompt_tokens - s.cached_tokens) / budget_tokens),
                                       s.prompt_tokens - s.cached_tokens, s.prefill_compute_s) for s in pre])
        changes.update(prefill_budget_tokens=budget_tokens, prefill_step_s=step_s, prefill_overhead_s=0.0,
                       prefill_tps=1.0 / per_token if per_token > 0 else 1e9)
    elif len(pre) >= MIN_SAMPLES:
        changes["prefill_tps"] = (sum(s.prompt_tokens - s.cached_tokens for s in pre)
                                  / sum(s.prefill_compute_s for s in pre))
    parts = [f for f in rec.finished if f.sample.prefill_compute_s > 0]
    if len(parts) >= MIN_SAMPLES:
        # with the step model and the decode actors' counters, the waits for a decode step in progress (the reserve
        # call's, the join's) are simulated (decode_step_waits): the path keeps what is left of it on average
        wait = step_wait(rec) if budget_tokens > 0 else None
        if wait:
            changes.update(ttft_path_s=base.ttft_path_s + unwaited_path_s(rec, wait), decode_step_waits=1)
        else:
            rest = statistics.median(max(0.0, s.ttft_s - s.admission_wait_s - s.prefill_queue_s
                                         - s.prefill_compute_s - s.transfer_s) for s in (f.sample for f in parts))
            if budget_tokens > 0:
                changes["ttft_path_s"] = base.ttft_path_s + rest + admission_rpc_s(rec)
            else:
                changes["prefill_overhead_s"] = base.prefill_overhead_s + rest
        full = [f.sample.prompt_tokens * base.kv_bytes_per_token / (base.link_gbps * 1e9) for f in parts]
        if sum(full) > 0:
            changes["exposed_transfer"] = min(1.0, sum(f.sample.transfer_s for f in parts) / sum(full))
    decoded = [s for s in done if s.output_tokens > 1 and s.tpot_s > 0]
    tpots = [s.tpot_s for s in decoded]
    depths = [a.queue_depth for _, o in rec.observations for a in o.live("decode") if a.queue_depth > 0]
    if len(tpots) >= MIN_SAMPLES:
        # the batch a decoded token saw: the actors' depths weighted by the tokens they decode (their depth), and
        # the context of the requests that decoded (a prefill phase's one-token answers never do)
        batch = min(base.max_batch, sum(b * b for b in depths) / sum(depths)) if depths else 1.0
        ctx = statistics.mean(s.prompt_tokens + s.output_tokens / 2 for s in decoded)
        step = base.decode_base_s + base.decode_per_seq_s * batch + base.decode_per_kv_token_s * ctx * batch
        k = statistics.median(tpots) / step
        changes.update(decode_base_s=base.decode_base_s * k, decode_per_seq_s=base.decode_per_seq_s * k,
                       decode_per_kv_token_s=base.decode_per_kv_token_s * k)
    kv = [o.kv_tokens for _, o in rec.observations if o.kv_tokens > 0]
    if kv:
        changes["decode_kv_tokens"] = statistics.median(kv)
    warm = decode_warmup_s(rec) if decode_warmup and changes.get("decode_step_waits") else 0.0
    if warm > 0:  # (the reserve calls and joins wait for it as they wait for any step)
        changes["decode_warmup_s"] = warm
    if not changes:
        return base
    what = ", ".join(f"{k} {v:.4g}" for k, v in changes.items())
    return dataclasses.replace(base, **changes, source=f"{base.source}, calibrated from the record: {what}")


def admission_rpc_s(rec: Recording) -> float:
    """The median admission wait of the requests that arrived while no request waited for decode K/V (the window
    they arrived in saw none waiting and none refused): the reserve call to the decode actor, which waits for the
    step in progress there (live, 0.04-0.18 s while decoding, under 0.02 s with decode idle). The simulator's
    admission wait is the wait for K/V only; this part of it is latency on the path. 0 without samples. Pure."""
    quiet = [f.sample.admission_wait_s for f in _quiet(rec)]
    return statistics.median(quiet) if len(quiet) >= MIN_SAMPLES else 0.0


def unwaited_path_s(rec: Recording, wait: Callable[[float], float]) -> float:
    """The path around the engines that no decode step holds up: over the requests that arrived while none waited
    for decode K/V (as :func:`admission_rpc_s`) with their TTFT's parts measured, the median of their admission wait
    plus the rest of their path (RPCs, the decode join, the first delta's trip) less the mean wait for a decode step
    in progress at their arrival (the reserve call) and at their first token (the join), ``wait``
    (:func:`step_wait`), which the simulator waits itself with ``decode_step_waits``. Kept >= 0; 0 without samples.
    Pure."""
    left = []
    for f in _quiet(rec):
        s = f.sample
        if s.prefill_compute_s <= 0:  # its parts not measured
            continue
        path = s.ttft_s - s.prefill_queue_s - s.prefill_compute_s - s.transfer_s
        left.append(path - wait(f.t - s.decode_s - s.ttft_s) - wait(f.t - s.decode_s))
    return max(0.0, statistics.median(left)) if len(left) >= MIN_SAMPLES else 0.0


def _quiet(rec: Recording) -> list[Finished]:
    """The finished requests that arrived in a window whose observation saw none waiting for decode K/V and none
    refused (a request's arrival: its end less its decode and its TTFT). Pure."""
    ends = [t for t, _ in rec.observations]
    out = []
    for f in rec.finished:
        s = f.sample
        k = bisect.bisect_left(ends, f.t - s.decode_s - s.ttft_s)
        o = rec.observations[k][1] if k < len(ends) else None
        if o is not None and o.admission_waiting == 0 and o.rejected_rate == 0:
            out.append(f)
    return out


def step_wait(rec: Recording) -> Callable[[float], float] | None:
    """The mean wait for a decode step in progress at a time, from the record's decode counters: in each window, a
    call that comes at a random moment finds its decode actor mid-step with probability its busy share ``u`` and
    waits half its mean step ``S`` (busy seconds over steps), ``u x S / 2`` (``u`` at most 1), averaged over the
    window's decode actors (the owner is any of them); before the first window the first one's, after the last the
    last one's.
    ``None`` without counters (under two readings, or no decode step in them). Pure."""
    ends: list[float] = []
    means: list[float] = []
    for (t0, before), (t1, now) in zip(rec.counters, rec.counters[1:]):
        prev = {c.actor_id: c for c in before}
        waits = [min(1.0, (c.busy_s - b.busy_s) / (t1 - t0)) * (c.busy_s - b.busy_s) / (c.steps - b.steps) / 2.0
                 for c in now if c.role == "decode" and (b := prev.get(c.actor_id)) is not None
                 and b.role == "decode" and b.epoch == c.epoch and c.steps > b.steps and t1 > t0]
        if waits:
            ends.append(t1)
            means.append(statistics.mean(waits))
    if not ends:
        return None

    def at(t: float) -> float:
        return means[min(len(ends) - 1, bisect.bisect_left(ends, t))]

    return at


def decode_warmup_s(rec: Recording) -> float:
    """How much longer a new decode actor's first engine step took than its later ones (its warm-up, simulated as
    ``decode_warmup_s``: :mod:`cluster.control.sim_warmup`), from the record's counters: for each decode actor the
    record read before its first step, the busy seconds of the window in which it took its first steps less those
    steps at the mean step of its next window (busy seconds over steps); the mean over such actors, kept >= 0. 0 when
    the record read no decode actor before its first step (it stepped before the record began, or flipped from
    prefill between two readings) or has no later window for it. Pure."""
    series: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (actor, epoch) -> (busy, steps) per reading
    for _, actors in rec.counters:
        for c in actors:
            if c.role == "decode":
                series.setdefault((c.actor_id, c.epoch), []).append((c.busy_s, c.steps))
    excess = []
    for readings in series.values():
        if readings[0][1] > 0:  # it had stepped before the record first read it
            continue
        k = next((j for j, (_, steps) in enumerate(readings) if steps > 0), None)
        if k is None or k + 1 >= len(readings):
            continue
        (b0, s0), (b1, s1), (b2, s2) = readings[k - 1], readings[k], readings[k + 1]
        if s2 > s1 and b2 > b1:
            excess.append((b1 - b0) - (s1 - s0) * (b2 - b1) / (s2 - s1))
    return max(0.0, statistics.mean(excess)) if excess else 0.0


def step_fit(samples: list[tuple[int, int, float]]) -> tuple[float, float]:
    """``(step seconds, seconds per token)`` fitting ``(steps, tokens, seconds)`` samples to ``seconds = steps x a +
    tokens x b`` by least squares, both kept >= 0 (a negative one is set to 0 and the other refitted alone). Pure."""
    s_nn = sum(n * n for n, _, _ in samples)
    s_nk = sum(n * k for n, k, _ in samples)
    s_kk = sum(k * k for _, k, _ in samples)
    s_ny = sum(n * y for n, _, y in samples)
    s_ky = sum(k * y for _, k, y in samples)
    det = s_nn * s_kk - s_nk * s_nk
    if det > 1e-9 * s_nn * s_kk:  # else steps and tokens move together: one cost explains both
        a, b = (s_ny * s_kk - s_ky * s_nk) / det, (s_ky * s_nn - s_ny * s_nk) / det
        if a >= 0 and b >= 0:
            return a, b
    a_only, b_only = s_ny / s_nn if s_nn else 0.0, s_ky / s_kk if s_kk else 0.0
    err_a = sum((y - n * a_only) ** 2 for n, _, y in samples)
    err_b = sum((y - k * b_only) ** 2 for _, k, y in samples)
    # on a tie (every sample one step of the same size) the step's fixed cost: a small prompt's is all fixed cost
    return (max(0.0, a_only), 0.0) if err_a <= err_b + 1e-12 else (0.0, max(0.0, b_only))


def speed_over_time(rec: Recording, profile: CostProfile, min_samples: int = 3,
                    warmup_steps: float = WARMUP_STEPS) -> list[tuple[float, float, float]]:
    """``(t, decode, prefill)`` from each recorded window on: how much slower than ``profile`` (already calibrated
    from the whole record, or not) the machine ran then, as :class:`~cluster.control.simulator.Simulation`'s
    ``speed`` takes it; a machine whose load changed during the run is replayed as it was. Pure.

    From the record's ``counters`` (what each actor measured each interval) when it has them: decode, the actors'
    busy seconds over the steps' cost in ``profile`` at the batch they ran (tokens per step) and the decoded
    requests' mean context; prefill, busy seconds over ``steps x prefill_step_s + tokens / prefill_tps``, pooled
    over the windows until a prompt's tokens are counted (a prefill actor counts them when the prompt is done); an
    actor's window is left out while its baseline had taken under ``warmup_steps`` steps in its role (its warm-up: a
    flipped actor's slow first steps would read as the whole machine slowing down, 36x in one live window). Else from
    the finished requests, each counted in the window that held the middle of its decode (TPOT: the median over the
    profile's step at the batch the window's observation saw) or of its prefill compute (measured over the
    profile's). A window with nothing measured (or under ``min_samples`` finished requests) keeps the previous
    factor; the first measured one also covers the time before it; none at all: ``[]`` (the profile as it is)."""
    ctx = _decode_context(rec)

    def step(batch: float) -> float:
        return _decode_step(profile, batch, ctx)

    def prefill(steps: float, tokens: float, requests: float) -> float:
        return steps * profile.prefill_step_s + tokens / profile.prefill_tps + requests * profile.prefill_overhead_s

    windows: list[tuple[float, float | None, float | None]] = []  # (start, decode, prefill); None: not measured
    if len(rec.counters) >= 2:
        # a prefill actor counts a prompt's tokens when its last chunk is done, but its busy seconds and steps as
        # they pass: its windows are pooled until tokens come, and the span's factor holds for each of them
        span: list[int] = []
        p_busy = p_steps = p_tokens = 0.0
        for (t0, before), (_, now) in zip(rec.counters, rec.counters[1:]):
            prev = {c.actor_id: c for c in before}
            d_busy = d_model = 0.0
            for c in now:
                b = prev.get(c.actor_id)
                if b is None or b.role != c.role or b.epoch != c.epoch or b.steps < warmup_steps:
                    continue  # a baseline, or its role's first steps (warm-up)
                busy, steps = c.busy_s - b.busy_s, c.steps - b.steps
                if busy <= 0 or steps <= 0:
                    continue
                if c.role == "decode" and c.decode_tokens > b.decode_tokens:
                    d_busy += busy
                    d_model += steps * step((c.decode_tokens - b.decode_tokens) / steps)
                elif c.role == "prefill":
                    p_busy, p_steps = p_busy + busy, p_steps + steps
                    p_tokens += max(0.0, c.prefill_tokens - b.prefill_tokens)
            windows.append((t0, d_busy / d_model if d_model > 0 else None, None))
            if p_busy > 0:
                span.append(len(windows) - 1)
            if p_tokens > 0 and prefill(p_steps, p_tokens, 0.0) > 0:
                k = p_busy / prefill(p_steps, p_tokens, 0.0)
                for j in span:
                    windows[j] = (windows[j][0], windows[j][1], k)
                span, p_busy, p_steps, p_tokens = [], 0.0, 0.0, 0.0
    by_request: list[tuple[float, float | None, float | None]] = []
    if rec.observations:
        edges = [0.0] + [t for t, _ in rec.observations]
        tpots: list[list[float]] = [[] for _ in rec.observations]
        p_meas = [0.0] * len(rec.observations)
        p_mod = [0.0] * len(rec.observations)
        p_n = [0] * len(rec.observations)
        budget = profile.prefill_budget_tokens

        def window(t: float) -> int:
            return min(len(rec.observations) - 1, max(0, bisect.bisect_right(edges, t) - 1))

        for f in rec.finished:
            s = f.sample
            decode_s = s.decode_s
            if s.output_tokens > 1 and s.tpot_s > 0:
                tpots[window(f.t - decode_s / 2)].append(s.tpot_s)
            tokens = s.prompt_tokens - s.cached_tokens
            if s.prefill_compute_s > 0 and tokens > 0:
                mid = f.t - decode_s - s.ttft_s + s.admission_wait_s + s.prefill_queue_s + s.prefill_compute_s / 2
                w = window(mid)
                p_meas[w] += s.prefill_compute_s
                # the compute measured leaves the path out, and the per-request model's overhead is the path
                # (calibrate puts it there): compute alone, as calibrate measured prefill_tps
                p_mod[w] += prefill(math.ceil(tokens / budget) if budget > 0 else 0, tokens, 0.0)
                p_n[w] += 1
        for j, (_, obs) in enumerate(rec.observations):
            depths = [a.queue_depth for a in obs.live("decode") if a.queue_depth > 0]
            batch = sum(d * d for d in depths) / sum(depths) if depths else 1.0
            dk = statistics.median(tpots[j]) / step(batch) if len(tpots[j]) >= min_samples else None
            pk = p_meas[j] / p_mod[j] if p_n[j] >= min(min_samples, 2) and p_mod[j] > 0 else None
            by_request.append((edges[j], dk, pk))
    if not windows:
        return _held(by_request)
    # prefill from the requests' compute seconds even with counters: a prefill actor's loop counts an engine call
    # that scheduled nothing as a step (live: 5 "steps" of 0.67 s and no token in a window; 0.12 s a step where the
    # requests' one-step prompts took 0.2-0.4 s), so its busy seconds per step are no step's cost
    starts = [t for t, _, _ in by_request]

    def prefill_at(t: float) -> float | None:
        return by_request[bisect.bisect_right(starts, t) - 1][2] if starts and t >= starts[0] else None

    return _held([(t, d, p if (q := prefill_at(t)) is None else q) for t, d, p in windows])


def _held(windows: list[tuple[float, float | None, float | None]]) -> list[tuple[float, float, float]]:
    """Fill the unmeasured (None) factors: the previous window's, before the first measured one that one's; drop
    windows that change nothing. Pure."""
    first_d = next((d for _, d, _ in windows if d is not None), None)
    first_p = next((p for _, _, p in windows if p is not None), None)
    if first_d is None and first_p is None:
        return []
    d, p = first_d or 1.0, first_p or 1.0
    out: list[tuple[float, float, float]] = []
    for k, (t, dk, pk) in enumerate(windows):
        d, p = dk if dk is not None else d, pk if pk is not None else p
        if not out or (out[-1][1], out[-1][2]) != (d, p):
            out.append((0.0 if k == 0 else t, d, p))
    return out


def actor_speed_over_time(rec: Recording, profile: CostProfile,
                          warmup_steps: float = WARMUP_STEPS) -> list[tuple[float, tuple[float, ...]]]:
    """``(t, factors)`` from each recorded window on, as :class:`~cluster.control.simulator.Simulation`'s
    ``actor_speed`` takes it: how much slower than the window's machine-wide decode factor (:func:`speed_over_time`)
    each decode actor stepped, the actor longest in its role first (then by id). Live, actors sharing two cores ran at
    their own speeds (0.2 s and 0.056 s a step in one window): one machine-wide factor gives every decode actor the
    mean. From the record's ``counters`` (``[]`` without them); an actor left out of a window (warm-up, no step) gets 1.
    Pure."""
    ctx = _decode_context(rec)
    out: list[tuple[float, tuple[float, ...]]] = []
    since: dict[tuple[str, str, int], float] = {}  # (actor, role, epoch) -> when the record first saw it so
    for (t0, before), (_, now) in zip(rec.counters, rec.counters[1:]):
        prev = {c.actor_id: c for c in before}
        for c in before:
            since.setdefault((c.actor_id, c.role, c.epoch), t0)
        rows: list[tuple[float, str, float, float]] = []  # (role start, actor, busy, modelled busy)
        for c in now:
            b = prev.get(c.actor_id)
            if c.role != "decode" or c.draining:  # (a draining actor takes no new requests, and ranks with none)
                continue
            start = since.setdefault((c.actor_id, c.role, c.epoch), t0)
            busy = model = 0.0
            if b is not None and b.role == c.role and b.epoch == c.epoch and b.steps >= warmup_steps:
                steps = c.steps - b.steps
                if steps > 0 and c.busy_s > b.busy_s and c.decode_tokens > b.decode_tokens:
                    busy = c.busy_s - b.busy_s
                    model = steps * _decode_step(profile, (c.decode_tokens - b.decode_tokens) / steps, ctx)
            rows.append((start, c.actor_id, busy, model))
        rows.sort()
        total_busy, total_model = sum(r[2] for r in rows), sum(r[3] for r in rows)
        machine = total_busy / total_model if total_model > 0 else 0.0
        factors = tuple((busy / model) / machine if model > 0 and machine > 0 else 1.0 for _, _, busy, model in rows)
        if not out or out[-1][1] != factors:
            out.append((0.0 if not out else t0, factors))
    return out


def _decode_context(rec: Recording) -> float:
    """The decoding requests' mean context (prompt + half the output), the step model's context. Pure."""
    decoded = [f.sample for f in rec.finished if f.sample.output_tokens > 1 and f.sample.tpot_s > 0]
    return statistics.mean(s.prompt_tokens + s.output_tokens / 2 for s in decoded) if decoded else 0.0


def _decode_step(profile: CostProfile, batch: float, ctx: float) -> float:
    """The profile's decode step at ``batch`` (clamped to 1..max_batch) and context ``ctx``. Pure."""
    b = min(float(profile.max_batch), max(1.0, batch))
    return profile.decode_base_s + profile.decode_per_seq_s * b + profile.decode_per_kv_token_s * ctx * b
