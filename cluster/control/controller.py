"""The prefill:decode controller's pure core: ``decide(observation, config, state) -> (decision, state)``. No I/O.

Stability needs ``λ·E[P] < μP·nP`` and ``λ·E[O] < μD·nD``: the prefill tokens arriving per second (after prefix-cache
hits) below the prefill pool's capacity, the decode tokens below the decode pool's. The ``adaptive`` policy closes the
loop on what is observed:

1. Smooth the arrival rates (EWMA) and take each pool's per-actor capacity as the median of its actors' measurements
   (prefill tokens/s within the TTFT SLO, decode tokens/s within the TPOT SLO).
2. Size each pool for its load plus headroom: ``n = ceil(λ·(1 + headroom) / μ)``; decode's headroom is scaled
   down by how fast a flip toward decode lands (``decode_headroom``: a prefill actor drains in seconds). A load that
   repeats is sized for where it goes next, from one period ago, and a prefill surge gets the split that served it
   then (:mod:`cluster.control.forecast`); actors neither pool needs wait in prefill (``budget.spare``).
3. See queueing, which averages cannot: a prefill backlog that would not drain within a TTFT SLO adds the actors that
   drain it in one; SLO attainment under target adds one actor to the pool that misses. Decode memory (the KV its
   actors hold, reservations for prompts still in prefill included) is a load like the token rate; requests waiting
   at admission for decode KV grow decode, and a TTFT miss goes to the pool whose part of the TTFT dominates
   (``Observation.ttft_cause``). Observations come from :mod:`cluster.control.observe`, live and simulated alike.
4. Respect minimums and the total budget (split in proportion to demand when it binds).
5. Hysteresis: grow at once, shrink only when the smaller pool would still run below ``1 - hysteresis`` of the target
   utilisation; a cooldown after each change; nothing new while a change is pending.
6. Act: when one pool must grow and the other has surplus, flip an actor's role (same weights, no reload) if that is
   faster than starting one; otherwise add new actors within the budget and drain the surplus.

The ``throughput`` policy is a planner in the style of the published Dynamo SLA planner: each interval it sizes both
pools from the last interval's request rate, prompt and output lengths and the profiled per-actor throughput, with
no queue feedback and new actors only. ``fixed`` never changes anything.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from cluster.control import budget, forecast, guard
from cluster.control.observation import ActorObservation, Observation
from cluster.control.split_model import Capacity

ROLES = ("prefill", "decode")
POLICIES = ("fixed", "throughput", "adaptive")
KV_WAIT_SHARE = 0.1  # a mean wait for decode KV blocks over this share of the TTFT SLO means decode is short of memory
STEADY_SHARE = 0.25  # a window's load within this share of its smoothed rate is steady (spare actors may move)


@dataclass(frozen=True)
class ControllerConfig:
    """How the controller decides. Validated on construction (``ValueError`` names the field)."""

    policy: str = "adaptive"  # fixed | throughput | adaptive
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.2
    interval_s: float = 30.0  # how often decide() runs
    headroom: float = 0.25  # size pools for load * (1 + headroom)
    hysteresis: float = 0.2  # shrink only when the smaller pool would run below (1 - hysteresis) of target load
    cooldown_s: float = 60.0  # after a change, no other change for this long (adaptive)
    ewma_alpha: float = 0.5  # weight of the newest rate sample
    attainment_target: float = 0.95  # below this in a window, the missing pool gets one more actor
    min_prefill: int = 1
    min_decode: int = 1
    budget: int = 8  # most ranks in all (cluster.control.budget): actors, when every actor is at TP 1
    ranks: tuple[int, int] = (1, 1)  # ranks (GPUs) each prefill actor and each decode actor holds: their TP sizes
    # adaptive: False keeps every actor of the budget and only moves the ratio (flips, or adds up to the budget);
    # True also shrinks pools below the budget when load drops (saves actors, pays start_s when load returns)
    elastic: bool = False
    start_s: float = 60.0  # time for a new actor to become ready (load weights, join)
    flip_s: float = 5.0  # time for an actor to change role (drained first; same weights)
    default_prefill_tps: float = 1000.0  # per-actor capacity when no actor has measured one yet
    default_decode_tps: float = 300.0
    # output tokens the proxies reserve per request at admission beside its prompt (their --reserve-headroom); the
    # K/V projection counts a request as holding its prompt plus this or its output, whichever is more
    kv_headroom_tokens: float = 256.0
    # adaptive: a load that repeats is met before it arrives (cluster.control.forecast): seconds of each pool's
    # arriving load kept to find its period in (0: no forecasting), and the shortest period looked for
    season_window_s: float = 7200.0
    season_min_s: float = 300.0
    # adaptive: never worse than a fixed split it could have held (cluster.control.guard): the observed mix's window,
    # its newest part, and the least estimated gain that overrides the target (0 window: no guard)
    guard_window_s: float = 600.0
    guard_short_s: float = 60.0
    guard_margin: float = 0.01
    guard_veto: float = 0.0  # a move predicted to lose more than this (plus its cost) is not made
    guard_explained: bool = True  # veto only while the model explains the present split's attainment

    def __post_init__(self) -> None:
        if self.policy not in POLICIES and fixed_sizes(self.policy) is None:
            raise ValueError(f"policy: must be one of {POLICIES} or fixed:P:D, got {self.policy!r}")
        for name in ("slo_ttft_s", "slo_tpot_s", "interval_s", "default_prefill_tps", "default_decode_tps"):
            if not getattr(self, name) > 0 or not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: must be a finite number > 0, got {getattr(self, name)!r}")
        for name in ("headroom", "cooldown_s", "start_s", "flip_s", "kv_headroom_tokens", "season_window_s",
                     "season_min_s", "guard_window_s", "guard_short_s", "guard_margin",
                     "guard_veto"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        for name in ("hysteresis", "attainment_target"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}: must be in [0, 1), got {getattr(self, name)!r}")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError(f"ewma_alpha: must be in (0, 1], got {self.ewma_alpha!r}")
        if self.min_prefill < 1 or self.min_decode < 1:
            raise ValueError(f"min_prefill/min_decode: must be >= 1, got {self.min_prefill}/{self.min_decode}")
        if len(self.ranks) != 2 or min(self.ranks) < 1:
            raise ValueError(f"ranks: (prefill, decode) ranks per actor, each >= 1, got {self.ranks!r}")
        if self.budget < budget.used(self.min_prefill, self.min_decode, self):
            raise ValueError(f"budget: must hold min_prefill and min_decode actors at {self.ranks} ranks each, "
                             f"got {self.budget}")


@dataclass(frozen=True)
class Decision:
    n_prefill: int  # target pool sizes
    n_decode: int
    add: tuple[str, ...] = ()  # roles of new actors to start
    drain: tuple[str, ...] = ()  # actor ids to drain and stop
    flip: tuple[tuple[str, str], ...] = ()  # (actor id, new role): drained, then changes role
    reason: str = ""

    @property
    def changes(self) -> bool:
        return bool(self.add or self.drain or self.flip)


@dataclass(frozen=True)
class ControllerState:
    """What decide() remembers between calls (returned anew each time)."""

    prefill_tps: float | None = None  # smoothed rates
    decode_tps: float | None = None
    prefill_slope: float = 0.0  # smoothed change of the smoothed rates, tokens/s per second
    decode_slope: float = 0.0
    t: float | None = None  # when the rates were last updated
    decode_kv: float = 0.0  # decode KV in use in actors' worth (reservations included): at once up, smoothed down
    last_change_t: float = -math.inf
    history: tuple[Decision, ...] = field(default=())  # the last decisions that changed something (newest last)
    # each window's arriving prefill and decode tokens/s, oldest first, at most season_window_s of them
    prefill_seen: tuple[float, ...] = field(default=())
    decode_seen: tuple[float, ...] = field(default=())
    sizes_seen: tuple[tuple[int, int], ...] = field(default=())  # each window's live (prefill, decode) pool sizes
    # the guard's window (cluster.control.guard): each window's arrivals per prompt class and prefill tokens
    mix_seen: tuple[tuple[float, ...], ...] = field(default=())
    tokens_seen: tuple[float, ...] = field(default=())
    met_seen: tuple[float, ...] = field(default=())  # each window's SLO attainment (nan: it judged nothing)


def attainment(samples: list[tuple[float, float]], slo_ttft_s: float, slo_tpot_s: float) -> tuple[float, float]:
    """Shares of ``(TTFT, TPOT)`` samples within their SLOs; (1, 1) for no samples (nothing missed). Pure."""
    if not samples:
        return 1.0, 1.0
    n = len(samples)
    return (sum(1 for t, _ in samples if t <= slo_ttft_s) / n, sum(1 for _, p in samples if p <= slo_tpot_s) / n)


def kv_projected(obs: Observation, cfg: ControllerConfig, at_slo: bool = False) -> float:
    """Decode K/V the arriving traffic will hold, in actors' worth (Little's law): requests per second x the K/V each
    holds (its prompt plus its output or the reservation headroom, whichever is more: a reservation is granted at
    admission and growth past it is counted as taken) x how long it holds it (admission to last token: the TTFT, at most
    its SLO, plus its output at the window's TPOT, or at the TPOT SLO before any was measured). A mix that turns to
    longer prompts shows here in its first window, while the K/V in use still holds the old mix. 0 when the decode
    actors' size is unknown, or while no output has finished (the arrivals' ask is no projection). ``at_slo``: each
    output token at the TPOT SLO (the longest a request may hold its K/V and meet it: a smaller decode pool runs bigger
    batches, longer steps, and holds each request longer). Pure."""
    if obs.kv_tokens <= 0 or obs.request_rate <= 0 or not obs.output_known:  # an ask is no projection
        return 0.0
    need = obs.mean_prompt_tokens + max(obs.mean_output_tokens, cfg.kv_headroom_tokens)
    ttft = min(obs.ttft_s, cfg.slo_ttft_s) if obs.ttft_s > 0 else cfg.slo_ttft_s / 2
    tpot = cfg.slo_tpot_s if at_slo or obs.tpot_s <= 0 else obs.tpot_s
    hold = ttft + max(0.0, obs.mean_output_tokens - 1) * tpot
    return obs.request_rate * need * hold / obs.kv_tokens


def decode_headroom(obs: Observation, cfg: ControllerConfig) -> float:
    """The headroom decode's token rate is sized with. Headroom covers the load's growth until a change lands, and
    the pools grow at different speeds: decode by flipping a prefill actor (drained within its prompts' TTFT parts),
    prefill by flipping a decode actor (drained only when its sequences have produced their outputs: tens of
    seconds). So decode's headroom is ``headroom`` scaled by a flip toward decode's time over one interval (at most
    1); prefill keeps all of it. On ``bursts`` at 16 workers (a prompt-heavy burst every 15 minutes) decode's full
    headroom held actors that the burst's prefill then waited ~50 s to get. Pure."""
    prefill_drain = obs.prefill_queue_wait_s + obs.prefill_compute_s
    if prefill_drain <= 0:  # nothing measured yet: a prompt at the default rate
        prefill_drain = obs.mean_prompt_tokens / cfg.default_prefill_tps
    return cfg.headroom * min(1.0, (prefill_drain + cfg.flip_s) / cfg.interval_s)


def _capacity(obs: Observation, role: str, default: float) -> float:
    measured = [a.capacity_tps for a in obs.live(role) if a.capacity_tps]
    return statistics.median(measured) if measured else default


def _hysteresis(n: int, want: int, load_actors: float, util: float, band: float) -> int:
    """Keep ``n`` rather than shrink to ``want`` unless one actor fewer would still run below ``(1 - band)`` of the
    target utilisation (``load_actors`` is the load in actors' worth of capacity). Pure."""
    if want < n and n > 1 and load_actors / (n - 1) > util * (1 - band):
        return n
    return want


def _grew_lately(obs: Observation, cfg: ControllerConfig, state: ControllerState, role: str) -> bool:
    """Whether the last change, within one cooldown, grew ``role``'s pool: the finished requests a window judges
    waited under the sizes before it, so their misses say nothing new about that pool. Pure."""
    if role not in ROLES or not state.history or obs.t - state.last_change_t >= cfg.cooldown_s:
        return False
    last = state.history[-1]
    return any(r == role for _, r in last.flip) or role in last.add


def fixed_sizes(policy: str) -> tuple[int, int] | None:
    """``(P, D)`` of a ``fixed:P:D`` policy, else None. Pure."""
    parts = policy.split(":")
    if len(parts) == 3 and parts[0] == "fixed" and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[1]), int(parts[2])
    return None


def decide(obs: Observation, cfg: ControllerConfig, state: ControllerState) -> tuple[Decision, ControllerState]:
    """One control step. Pure: returns the decision and the new state."""
    n_p, n_d = len(obs.live("prefill")), len(obs.live("decode"))
    a = cfg.ewma_alpha
    sp = obs.prefill_tps if state.prefill_tps is None else a * obs.prefill_tps + (1 - a) * state.prefill_tps
    sd = obs.decode_tps if state.decode_tps is None else a * obs.decode_tps + (1 - a) * state.decode_tps
    slope_p, slope_d = state.prefill_slope, state.decode_slope
    if state.t is not None and obs.t > state.t and state.prefill_tps is not None and state.decode_tps is not None:
        dt = obs.t - state.t
        slope_p = a * (sp - state.prefill_tps) / dt + (1 - a) * slope_p
        slope_d = a * (sd - state.decode_tps) / dt + (1 - a) * slope_d
    state = replace(state, prefill_tps=sp, decode_tps=sd, prefill_slope=slope_p, decode_slope=slope_d, t=obs.t)
    kept = int(cfg.season_window_s // cfg.interval_s)  # windows of load kept
    if kept:  # every window's load, pending changes or not (a gap would shift the season)
        state = replace(state, prefill_seen=(*state.prefill_seen, obs.prefill_tps)[-kept:],
                        decode_seen=(*state.decode_seen, obs.decode_tps)[-kept:],
                        sizes_seen=(*state.sizes_seen, (n_p, n_d))[-kept:])
    if cfg.guard_window_s > 0 and cfg.policy == "adaptive":
        kept = int(cfg.guard_window_s // cfg.interval_s)
        judged = obs.ttft_s > 0 or obs.rejected_rate > 0  # a window where nothing finished or was refused judges none
        state = replace(state, mix_seen=(*state.mix_seen, obs.arrivals_by_class)[-kept:],
                        tokens_seen=(*state.tokens_seen, obs.prefill_tps * cfg.interval_s)[-kept:],
                        met_seen=(*state.met_seen, obs.slo_attainment if judged else math.nan)[-kept:])
    hold = Decision(n_p, n_d)
    if cfg.policy == "fixed" or fixed_sizes(cfg.policy):
        return replace(hold, reason="fixed policy"), state
    if obs.pending_changes:
        return replace(hold, reason=f"waiting for {obs.pending_changes} pending change(s)"), state
    mu_p = _capacity(obs, "prefill", cfg.default_prefill_tps)
    mu_d = _capacity(obs, "decode", cfg.default_decode_tps)

    if cfg.policy == "throughput":
        # Dynamo-style: size from the forecast (last interval's) request rate x lengths and profiled throughput
        want_p = math.ceil(obs.request_rate * obs.mean_prompt_tokens / mu_p) if obs.request_rate else n_p
        want_d = math.ceil(obs.request_rate * obs.mean_output_tokens / mu_d) if obs.request_rate else n_d
        t_p, t_d = budget.fit(want_p, want_d, cfg, want_p * mu_p, want_d * mu_d)
        why = (f"forecast {obs.request_rate:.1f} req/s x ISL {obs.mean_prompt_tokens:.0f} / OSL "
               f"{obs.mean_output_tokens:.0f} over profiled {mu_p:.0f} / {mu_d:.0f} tok/s per actor")
        return _act(obs, cfg, state, t_p, t_d, why, allow_flip=False)

    # adaptive: size up at once on the newest sample, or on where a rising rate will be by the time a change lands
    # (two intervals ahead); size down on the smoothed rate
    util, util_d = 1 / (1 + cfg.headroom), 1 / (1 + decode_headroom(obs, cfg))
    lead = 2 * cfg.interval_s
    why = [f"load {sp:.0f} prefill / {sd:.0f} decode tok/s over {mu_p:.0f} / {mu_d:.0f} per actor"]
    fast_p = max(obs.prefill_tps, sp + max(0.0, slope_p) * lead)  # the newest load, or where it is heading
    fast_d = max(obs.decode_tps, sd + max(0.0, slope_d) * lead)
    # a load that repeats: what it reached one period ago over the time a change takes to land (forecast.py)
    ahead = {role: forecast.expected(seen, cfg.interval_s, cfg.season_min_s, lead + cfg.flip_s) if seen else None
             for role, seen in (("prefill", state.prefill_seen), ("decode", state.decode_seen))}
    raised = {role: s is not None and s[0] > now for (role, s), now in zip(ahead.items(), (fast_p, fast_d))}
    fast_p = max(fast_p, ahead["prefill"][0]) if ahead["prefill"] else fast_p
    fast_d = max(fast_d, ahead["decode"][0]) if ahead["decode"] else fast_d
    lp, ld = max(sp, fast_p), max(sd, fast_d)
    want_p = math.ceil(lp / (mu_p * util)) if lp > 0 else cfg.min_prefill
    want_d = math.ceil(ld / (mu_d * util_d)) if ld > 0 else cfg.min_decode
    # a pool the season grows beyond its present size moves now, even at a binding budget with no pool pressed
    seasonal = (raised["prefill"] and want_p > n_p) or (raised["decode"] and want_d > n_d)
    for role, s in ahead.items():
        if raised[role] and s is not None:
            why.append(f"{role} load repeats every {s[1]:.0f}s: {s[0]:.0f} tok/s ahead")
    # prompts waiting at the admission gates wait for decode KV, not for a prefill actor: prefill's queue is the rest
    kv_short = obs.kv_short()
    queued_p = max(0.0, obs.prefill_backlog_tokens - obs.admission_backlog_tokens)
    clearable = n_p * mu_p * cfg.slo_ttft_s  # prompt tokens the present pool prefills within one TTFT SLO
    if queued_p > clearable:  # queued prompts it cannot clear in time: size for clearing them
        # within one TTFT SLO while new prompts keep arriving at the newest rate
        fast_p = max(fast_p, obs.prefill_tps + queued_p / cfg.slo_ttft_s)
        want_p = max(want_p, math.ceil(fast_p / mu_p))
        why.append(f"prefill backlog {queued_p:.0f} tokens")
    # decode memory: the KV its actors hold is a load in actors' worth, like the token rate; requests waiting for
    # decode blocks mean decode is short of memory whatever its token rate says, and their wait is TTFT
    over_p = n_p * mu_p < max(sp, obs.prefill_tps) or queued_p > clearable  # prefill overloaded now
    kv_run, kv_rsv = obs.kv_in_use()
    # reservations scale with prefill's queue: count those a queue it clears within one TTFT SLO would hold
    kv_now = kv_run + kv_rsv * (min(1.0, clearable / queued_p) if queued_p > 0 else 1.0)
    kv_mem = max(kv_now, a * kv_now + (1 - a) * state.decode_kv)
    state = replace(state, decode_kv=kv_mem)
    # K/V pressure ahead: what the arriving mix will hold once it has replaced the one in flight (a flip or a new
    # actor takes about as long as a request holds its K/V, so decode is sized for it now, before admission waits)
    kv_proj = kv_projected(obs, cfg)
    kv_ahead = kv_proj > n_d * util  # decode's memory will be short of its target share: as pressing as waits
    if kv_proj > kv_mem:
        why.append(f"decode KV projected {kv_proj:.1f} actors' worth (in use {kv_mem:.1f})")
        kv_mem = kv_proj
    # memory is sized like tokens, with headroom: what is in use, reservations included, over the target utilisation
    if math.ceil(kv_mem / util - 1e-9) > want_d:
        want_d = math.ceil(kv_mem / util - 1e-9)
        why.append(f"decode KV in use {kv_mem:.1f} actors' worth")
    # never shrink below the memory in use now, reservations included (they would only wait for it again)
    kv_floor = math.ceil(kv_mem - 1e-9)
    # nor below what the arriving traffic holds when its tokens come at the TPOT SLO: shrinking decode lengthens its
    # steps, and so how long each request holds its K/V (at 1,000 workers a burst's decode shrank to what it held
    # at the present steps, and admission waited within a minute)
    kv_keep = min(n_d, math.ceil(kv_projected(obs, cfg, at_slo=True) - 1e-9))
    if kv_keep > kv_floor:
        kv_floor = kv_keep
        want_d = max(want_d, kv_keep)
    # waits that last (a snapshot's few waiters come and go), or waiters while nothing finished at all; right after
    # decode grew, the finished requests' waits are the old size's: only waiters now count
    waiters = obs.admission_waiting > 0
    if _grew_lately(obs, cfg, state, "decode"):
        kv_wait = kv_short and waiters
    else:
        kv_wait = kv_short and (obs.admission_wait_s > KV_WAIT_SHARE * cfg.slo_ttft_s or (waiters and obs.ttft_s == 0))
    if kv_wait:
        kv_floor = max(kv_floor, n_d + 1)  # one more at a time: memory is wanted by both pools' requests
        want_d = max(want_d, kv_floor)
        why.append(f"{obs.admission_waiting} waiting for decode KV ({obs.admission_wait_s:.1f}s mean wait)")
    clearable_d = n_d * mu_d * cfg.slo_ttft_s  # decode tokens the present pool delivers within one TTFT SLO
    if obs.decode_backlog_tokens > clearable_d:  # sequences waiting for a batch slot that it cannot start soon
        fast_d = max(fast_d, obs.decode_tps + obs.decode_backlog_tokens / cfg.slo_ttft_s)
        want_d = max(want_d, math.ceil(fast_d / mu_d))
        why.append(f"decode backlog {obs.decode_backlog_tokens:.0f} tokens")
    # SLO misses the rates did not explain: grow the missing pool (prefill and TPOT: by the missed share, at least
    # one actor; decode memory: one); a TTFT miss goes to the pool whose part of the TTFT dominates
    # TTFT misses a split could fix: a prompt whose prefill alone exceeds the SLO misses on every split (Azure code's
    # 8,000-token prompts read as prefill's misses and grew prefill to 15P:1D, where decode's K/V then waited)
    fixable = obs.ttft_attainment / (1 - obs.ttft_unfixable) if obs.ttft_unfixable < 1 else 1.0
    ttft_miss, tpot_miss = fixable < cfg.attainment_target, obs.tpot_attainment < cfg.attainment_target
    cause = obs.ttft_cause()
    if ttft_miss and _grew_lately(obs, cfg, state, cause):  # the window's misses are the old sizes' (they lag)
        ttft_miss = False
    if ttft_miss and cause == "prefill":
        want_p = max(want_p, n_p + max(1, math.ceil(n_p * (cfg.attainment_target - obs.ttft_attainment))))
    elif ttft_miss and cause == "decode":
        kv_floor = max(kv_floor, n_d + 1)  # one at a time, as for waits: both pools' requests hold decode memory
        want_d = max(want_d, kv_floor)
    if ttft_miss or tpot_miss:
        why.append(f"goodput {obs.slo_attainment:.0%}")
    if ttft_miss:
        why.append(f"TTFT attainment {obs.ttft_attainment:.0%} (mostly {cause})")
    if tpot_miss:
        want_d = max(want_d, n_d + max(1, math.ceil(n_d * (cfg.attainment_target - obs.tpot_attainment))))
        why.append(f"TPOT attainment {obs.tpot_attainment:.0%}")
    load_d = max(ld / mu_d, kv_mem)
    want_p = _hysteresis(n_p, want_p, lp / mu_p, util, cfg.hysteresis)
    want_d = _hysteresis(n_d, want_d, load_d, util_d, cfg.hysteresis)
    # a binding budget is split by the newest loads (not their smoothed floor), so the growing pool gets its actors
    floors = (math.ceil(obs.prefill_tps / mu_p), max(math.ceil(obs.decode_tps / mu_d), kv_floor))
    # a pool missing its own SLO is never the one a binding budget shrinks (its measured capacity may not show why
    # it misses: a TPOT miss with an unmeasured decode capacity looked like spare decode and fed a see-saw)
    if ttft_miss and cause == "prefill":
        floors = (max(floors[0], n_p), floors[1])
    if tpot_miss or (ttft_miss and cause == "decode"):
        floors = (floors[0], max(floors[1], n_d))
    split_d = max(fast_d / mu_d, kv_mem / util, kv_floor if kv_wait else 0)  # memory with headroom, like tokens
    # both floors cannot fit: the pool the misses name keeps its floor (a TTFT miss names its cause's pool, a TPOT
    # miss decode); a burst's prefill lost an actor to decode's one-at-a-time K/V floor while its TTFT was at 0%
    keep = "decode" if tpot_miss else cause if ttft_miss and cause in ROLES else None
    if keep is None and queued_p > clearable:  # its requests will miss the TTFT SLO; they have not finished yet
        keep = "prefill"
    if keep == "prefill":  # but decode keeps the K/V its actors hold now (fewer would only make admission wait)
        floors = (min(floors[0], (cfg.budget - math.ceil(kv_now - 1e-9) * cfg.ranks[1]) // cfg.ranks[0]), floors[1])
    t_p, t_d = budget.fit(want_p, want_d, cfg, fast_p / mu_p, split_d, floors, keep)
    # overloaded now: the newest load exceeds a pool's capacity, or work queues beyond what it clears in a TTFT SLO
    # (requests caught in that queue have not finished yet, so attainment cannot show them)
    over_d = n_d * mu_d < max(sd, obs.decode_tps) or kv_wait or kv_ahead or obs.decode_backlog_tokens > clearable_d
    if budget.full(t_p, t_d, cfg) and budget.full(n_p, n_d, cfg) and not (over_p or over_d) \
            and not ttft_miss and not tpot_miss and not seasonal:
        t_p, t_d = n_p, n_d  # the budget binds but no pool is overloaded: a noisy re-split would only churn
    elif budget.full(n_p, n_d, cfg) and budget.full(t_p, t_d, cfg) and over_p and kv_wait:
        # both pools pressed at a binding budget: a move only shifts the bottleneck and costs a drain; let the
        # queues drain where they are
        t_p, t_d = n_p, n_d
        why.append("both pools pressed")
    elif not cfg.elastic and not budget.full(t_p, t_d, cfg):
        t_p, t_d = budget.keep_whole((n_p, n_d), (t_p, t_d), (fast_p / mu_p, split_d), cfg)
    # the season's prefill load ahead needs more prefill: move to the split that served it one period ago, a flip
    # time ahead (one interval plus flip_s: decode actors drain as it arrives), decode keeping the K/V it holds now
    surge = ahead["prefill"] is not None and raised["prefill"] and math.ceil(ahead["prefill"][0] / (mu_p * util)) > n_p
    last = forecast.split(state.prefill_seen, state.sizes_seen, cfg.interval_s, cfg.season_min_s,
                          cfg.interval_s + cfg.flip_s) if surge else None
    pressed_d = tpot_miss or kv_wait or obs.decode_backlog_tokens > clearable_d
    if last is not None and not pressed_d:
        to_p = min(last[0], (cfg.budget - max(cfg.min_decode, math.ceil(kv_now - 1e-9)) * cfg.ranks[1]) // cfg.ranks[0])
        if to_p > t_p:
            t_p, t_d = to_p, min(t_d, (cfg.budget - to_p * cfg.ranks[0]) // cfg.ranks[1])
            seasonal = True
            why.append(f"{last[0]}P:{last[1]}D served the prefill load ahead one period ago")
    # a flip keeps the actor's TP size: pools of different sizes change by starts and drains
    flips = cfg.flip_s < cfg.start_s and cfg.ranks[0] == cfg.ranks[1]
    # nothing else moves and both loads are steady (a new mix's first window misleads: its output lengths are the
    # old mix's): spare decode actors wait in prefill, the pool slow to grow (budget.spare); decode keeps what the
    # most it carried over the last cooldown needs. Without the steadiness check ``alternating`` at 1,000 workers
    # fell from 99.2% to 96.2%
    steady = all(abs(x - s) <= STEADY_SHARE * s for x, s in ((obs.prefill_tps, sp), (obs.decode_tps, sd)))
    spared = False
    if (t_p, t_d) == (n_p, n_d) and flips and steady and not (over_p or over_d or ttft_miss or tpot_miss):
        recent = state.decode_seen[-math.ceil(cfg.cooldown_s / cfg.interval_s):] if cfg.cooldown_s > 0 else ()
        spare = budget.spare((n_p, n_d), max([want_d] + [math.ceil(x / (mu_d * util_d)) for x in recent]), cfg,
                             cfg.hysteresis)
        if spare and cfg.guard_window_s > 0 and not guard.judgeable(state.mix_seen, state.tokens_seen,
                                                                     obs.output_by_class, cfg):
            why.append(f"{spare} spare decode actor(s) stay until the guard can judge the move")  # guard.judgeable
        elif spare:
            spared = True
            t_p, t_d = n_p + spare, n_d - spare
            why.append(f"{spare} spare decode actor(s) to prefill")
    # the guard (cluster.control.guard) judges moves on the observed mix; a load past a pool's capacity, a queue, a
    # K/V wait or a season ahead are what the mix has not shown yet (vetoed, aperiodic's surges fell 3-8 points)
    unseen = seasonal or over_p or over_d
    if flips and not cfg.elastic and budget.full(n_p, n_d, cfg) and t_p + t_d == n_p + n_d and obs.output_by_class \
            and not unseen:
        cap = Capacity(mu_p, mu_d, obs.kv_tokens, cfg.kv_headroom_tokens, cfg.slo_ttft_s, cfg.slo_tpot_s,
                       obs.tpot_s or cfg.slo_tpot_s)
        held = guard.check(state.mix_seen, state.tokens_seen, state.met_seen, obs.output_by_class, cap, (n_p, n_d),
                           (t_p, t_d), cfg, discretionary=spared)
        if held is not None:
            (t_p, t_d), why = held[0], [held[1]]
    if (t_p, t_d) != (n_p, n_d) and obs.t - state.last_change_t < cfg.cooldown_s and not seasonal:
        # only the pool whose own SLO is missed may skip the cooldown (growing the other would feed a see-saw)
        pressing = (t_p > n_p and ((ttft_miss and cause == "prefill") or over_p)) or \
            (t_d > n_d and (tpot_miss or (ttft_miss and cause == "decode") or kv_wait or kv_ahead
                            or obs.decode_backlog_tokens > clearable_d))
        if not pressing:
            return replace(hold, reason=f"cooldown ({obs.t - state.last_change_t:.0f}s since the last change)"), state
    return _act(obs, cfg, state, t_p, t_d, "; ".join(why), allow_flip=flips)


def _act(obs: Observation, cfg: ControllerConfig, state: ControllerState, t_p: int, t_d: int, why: str,
         allow_flip: bool) -> tuple[Decision, ControllerState]:
    """Turn target sizes into actions (flips, adds, drains). Pure."""
    live = {r: sorted(obs.live(r), key=lambda x: (x.queue_depth, x.actor_id)) for r in ROLES}
    before = f"{len(live['prefill'])}P:{len(live['decode'])}D"
    delta = {"prefill": t_p - len(live["prefill"]), "decode": t_d - len(live["decode"])}
    if delta["prefill"] == delta["decode"] == 0:
        return Decision(t_p, t_d, reason=f"hold: {why}"), state
    flips: list[tuple[str, str]] = []
    if allow_flip:
        for grow, shrink in (("prefill", "decode"), ("decode", "prefill")):
            while delta[grow] > 0 and delta[shrink] < 0:
                actor = live[shrink].pop(0)  # the least loaded drains fastest
                flips.append((actor.actor_id, grow))
                delta[grow] -= 1
                delta[shrink] += 1
    ranks = dict(zip(ROLES, cfg.ranks))
    total = sum(len(v) * ranks[r] for r, v in live.items()) + sum(ranks[r] for _, r in flips)  # ranks in use
    adds: list[str] = []
    for role in ROLES:
        while delta[role] > 0 and total + ranks[role] <= cfg.budget:
            adds.append(role)
            delta[role] -= 1
            total += ranks[role]
    drains = [live[role].pop(0).actor_id for role in ROLES for _ in range(max(0, -delta[role]))]
    decision = Decision(t_p, t_d, tuple(adds), tuple(drains), tuple(flips),
                        reason=f"{before} -> {t_p}P:{t_d}D: {why}")
    if decision.changes:
        state = replace(state, last_change_t=obs.t, history=(*state.history, decision)[-20:])
    return decision, state


# what decides each window in the simulator: decide() itself, or a replay's recorded decisions (cluster.control.replay)
Decider = Callable[[Observation, ControllerConfig, ControllerState], tuple[Decision, ControllerState]]


def plan(obs: Observation, cfg: ControllerConfig, state: ControllerState, n_prefill: int, n_decode: int,
         why: str) -> tuple[Decision, ControllerState]:
    """The actions (flips first, then adds and drains) that take the pools in ``obs`` to the given sizes, as
    :func:`decide` would carry its own targets out (a replay that follows a record's decisions). Pure."""
    return _act(obs, cfg, state, n_prefill, n_decode, why, allow_flip=True)
