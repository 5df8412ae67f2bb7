"""Messages that cross process boundaries (proxy <-> actors), torch-free and msgpack-friendly.

Every message is a frozen, validated dataclass with ``to_dict()`` (only str/int/float/bool/None/list/dict values with
string keys, so msgpack and JSON both carry it) and ``from_dict()`` (unknown keys are ignored so that a newer sender
can talk to an older receiver within one wire version). Every wire form carries ``"v": WIRE_VERSION``; a message of
another version is refused with :class:`WireVersionError`, so a mixed-version cluster in a rolling upgrade fails
cleanly instead of misreading. Sequences are tuples in memory and lists on the wire. Times that cross processes are
durations measured on one process's clock, never timestamps to subtract across hosts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.request.sampling_params import SamplingParams  # torch-free; the one place sampling ranges are defined

T = TypeVar("T", bound="_Wire")

ROLES = ("prefill", "decode", "colocated")
FINISH_REASONS = ("stop", "length", "abort", "error")  # error: the engine ended the completion (its grammar's dead end)
# bump on any change an older peer would misread (3: ReserveGrant.epoch; 4: resume fields, nonce; 5: token-stream
# messages are TokenFrames, numbered per stream; 6: GenerateRequest.grammar, which an older peer would drop; 7:
# prompt logprobs: GenerateRequest.prompt_logprobs, PrefillResult.prompt_logprobs, TokenDelta.prompt_logprobs; 8:
# ReserveGrant.rank_endpoints, which an older prefill actor would drop and send every head to rank 0; 9:
# GenerateRequest.min_tokens, which an older actor would drop and end early; 10: GenerateRequest.kv_namespace, which
# an older actor would drop and so share K/V across tenants; 11: GenerateRequest.sampling, the engine's SamplingParams,
# in place of its flat sampling fields)
WIRE_VERSION = 11


class WireVersionError(ValueError):
    """A message from a peer speaking another wire version (a rolling upgrade mixing versions)."""


class _Wire:
    """Shared ``to_dict``/``from_dict`` for the flat messages below."""

    def to_dict(self) -> dict[str, Any]:
        """Plain wire form (tuples become lists, nested messages become dicts), tagged with the wire version. Pure."""
        d = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        d["v"] = WIRE_VERSION
        return d

    @classmethod
    def from_dict(cls: type[T], d: Mapping[str, Any]) -> T:
        """Rebuild from the wire form; unknown keys are ignored, missing required ones raise ``ValueError``. Pure."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{cls.__name__}.from_dict needs a mapping, got {type(d).__name__}")
        if d.get("v") != WIRE_VERSION:
            raise WireVersionError(f"{cls.__name__}: wire version {d.get('v')!r}, this process speaks {WIRE_VERSION} "
                                   "(a cluster mixing pdcluster versions: finish the rolling upgrade)")
        try:
            return cls(**_known_fields(cls, d))
        except TypeError as e:  # a missing required field
            raise ValueError(f"{cls.__name__}: {e}") from None


def _known_fields(cls: type, d: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``d`` that name an init field of dataclass ``cls`` (unknown keys are ignored on the wire). Pure."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return {k: v for k, v in d.items() if k in names}


def _plain(v: Any) -> Any:
    if isinstance(v, _Wire):
        return v.to_dict()
    if isinstance(v, SamplingParams):
        return sampling_to_dict(v)
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


def _set(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # normalizing a frozen dataclass field in __post_init__


def _check_int(owner: str, name: str, value: Any, lo: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{owner}.{name}: must be an integer >= {lo}, got {value!r}")


def _logprob_pairs(owner: str, values: Any, n: int) -> tuple[tuple[tuple[int, float], ...], ...]:
    """Per token, ``(token_id, logprob)`` pairs (msgpack refuses integer map keys, so no dicts); ``n`` tokens."""
    try:
        lps = tuple(tuple((int(t), float(lp)) for t, lp in tok) for tok in values)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}.logprobs: must be, per token, [token_id, logprob] pairs") from None
    if len(lps) != n:
        raise ValueError(f"{owner}.logprobs: {len(lps)} entries for {n} tokens")
    return lps


def _prompt_pairs(owner: str, values: Any) -> tuple[tuple[tuple[int, float], ...], ...]:
    """Per prompt token after the first, ``(token_id, logprob)`` pairs: that token's first, then the top-k."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise ValueError(f"{owner}.prompt_logprobs: must be a list, got {type(values).__name__}")
    lps = _logprob_pairs(owner, values, len(values))
    if any(not pairs for pairs in lps):
        raise ValueError(f"{owner}.prompt_logprobs: every position needs its own token's pair")
    return lps


def prompt_logprob_pairs(prompt_token_ids: Any, prompt_logprobs: Any) -> tuple[tuple[tuple[int, float], ...], ...]:
    """An engine output's prompt logprobs (per prompt token ``{id: logprob}``, the first None) in wire form: per token
    after the first, its own pair, then the others by id. Pure."""
    return tuple(((int(t), float(lps[t])), *sorted((int(o), float(lp)) for o, lp in lps.items() if o != t))
                 for t, lps in zip(list(prompt_token_ids)[1:], list(prompt_logprobs)[1:]))


def _check_seconds(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{owner}.{name}: must be a finite number >= 0, got {value!r}")


def _check_ids(owner: str, name: str, values: tuple[Any, ...]) -> None:
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in values):
        raise ValueError(f"{owner}.{name}: must be non-negative integers")


@dataclass(frozen=True)
class Usage(_Wire):
    """Token accounting for one request (all n completions together)."""

    prompt_tokens: int  # prompt length in tokens, counted once even when n > 1
    completion_tokens: int  # generated tokens over all n completions
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (OpenAI's prompt_tokens_details.cached_tokens)

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            _check_int("Usage", name, getattr(self, name))

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def sampling_to_dict(p: SamplingParams) -> dict[str, Any]:
    """A ``SamplingParams`` in wire form: its fields by name (tuples as lists, the grammar as its ``[kind, text]``
    pair). Pure."""
    d = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    d["grammar"] = None if p.grammar is None else p.grammar.wire()
    return {k: _plain(v) for k, v in d.items()}


def sampling_from_dict(d: Mapping[str, Any]) -> SamplingParams:
    """The ``SamplingParams`` of its wire form (unknown keys ignored, as for every message); its own checks run.
    Pure; raises ``ValueError`` naming the field."""
    return SamplingParams(**_known_fields(SamplingParams, d))


@dataclass(frozen=True)
class GenerateRequest(_Wire):
    """One tokenized request as the proxy hands it to a prefill or decode actor.

    ``sampling`` is the engine's own :class:`SamplingParams`, built once by the proxy from the HTTP body and handed to
    the engine as it is (a prefill actor narrows it to its one token); its ``max_tokens`` is already resolved against
    the context (never None here).
    """

    request_id: str  # unique per proxy request; every actor message about this request carries it
    prompt_token_ids: tuple[int, ...]  # the tokenized prompt (chat template already applied)
    # how to sample, validated by its own type; its kv_namespace is the tenant's K/V namespace (a digest made by the
    # proxy, proxy/tenant.py; never an API key in clear): block keys bind it on every tier
    sampling: SamplingParams = SamplingParams()
    reply_to: str = ""  # the owning proxy's token-stream address: where TokenDeltas go (several proxies may serve)
    trace_id: str = ""  # the client's X-Request-Id (or one the proxy made): every hop logs it
    # A resumed completion (migrated off a dead decode actor, or retried): the tokens of it the client already has.
    # They count as output (so ``max_tokens`` still bounds the whole completion and the remaining budget is
    # ``max_tokens - len(resume_token_ids)``), are recomputed with the prompt, and generation continues after them.
    resume_token_ids: tuple[int, ...] = ()
    resume_chars: int = 0  # characters of this completion's text the client already has (the deltas start after)
    choice_index: int = 0  # which completion of the client's request this is (a resumed one has n == 1)

    def __post_init__(self) -> None:
        for name in ("reply_to", "trace_id"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"GenerateRequest.{name}: must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"GenerateRequest.request_id: must be a non-empty string, got {self.request_id!r}")
        for name in ("prompt_token_ids", "resume_token_ids"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
                raise ValueError(f"GenerateRequest.{name}: must be a list, got {type(value).__name__}")
            _set(self, name, tuple(value))
        if not self.prompt_token_ids:
            raise ValueError("GenerateRequest.prompt_token_ids: must not be empty")
        _check_ids("GenerateRequest", "prompt_token_ids", self.prompt_token_ids)
        _check_ids("GenerateRequest", "resume_token_ids", self.resume_token_ids)
        for name in ("resume_chars", "choice_index"):
            _check_int("GenerateRequest", name, getattr(self, name))
        if isinstance(self.sampling, Mapping):
            try:
                _set(self, "sampling", sampling_from_dict(self.sampling))
            except ValueError as e:
                raise ValueError(f"GenerateRequest.sampling.{e}") from None
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"GenerateRequest.sampling: must be a SamplingParams, got {type(self.sampling).__name__}")
        if self.sampling.max_tokens is None:
            raise ValueError("GenerateRequest.sampling.max_tokens: must be resolved against the context (not None)")
        if (self.resume_token_ids or self.choice_index) and self.sampling.n != 1:
            raise ValueError(f"GenerateRequest.sampling.n: a resumed completion has n == 1, got {self.sampling.n}")
        if len(self.resume_token_ids) >= self.sampling.max_tokens:
            raise ValueError(f"GenerateRequest.resume_token_ids: {len(self.resume_token_ids)} tokens leave nothing of "
                             f"max_tokens {self.sampling.max_tokens} to generate")

    @property
    def resumed(self) -> bool:
        """Whether this continues a completion the client already has tokens of. Pure."""
        return bool(self.resume_token_ids)


@dataclass(frozen=True)
class ReserveRequest(_Wire):
    """Proxy -> decode actor: hold blocks for ``request`` (and, from now on, own it). With ``colocated`` the actor
    prefills the prompt itself and starts at once; otherwise a prefill actor streams the prompt's K/V into the
    granted blocks and its :class:`PrefillResult` follows."""

    request: GenerateRequest  # the whole request: the decode actor owns its text, stops, finish and usage from here on
    num_blocks: int  # blocks to hold: the prompt's plus a headroom for the output
    ttl_s: float = 0.0  # released if no K/V (or start) comes within this many seconds; 0: the actor's default
    colocated: bool = False  # prefill here too (no prefill actor, no PrefillResult)

    def __post_init__(self) -> None:
        if isinstance(self.request, Mapping):
            _set(self, "request", GenerateRequest.from_dict(self.request))
        if not isinstance(self.request, GenerateRequest):
            raise ValueError(f"ReserveRequest.request: must be a GenerateRequest, got {type(self.request).__name__}")
        _check_int("ReserveRequest", "num_blocks", self.num_blocks, 1)
        if isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float)) or not 0 <= self.ttl_s < math.inf:
            raise ValueError(f"ReserveRequest.ttl_s: must be a finite number >= 0, got {self.ttl_s!r}")
        if not isinstance(self.colocated, bool):
            raise ValueError(f"ReserveRequest.colocated: must be a bool, got {self.colocated!r}")
        if (self.request.resumed or self.request.choice_index) and not self.colocated:
            raise ValueError("ReserveRequest.colocated: a resumed completion is computed on its decode actor "
                             "(colocated), never by a prefill actor")


@dataclass(frozen=True)
class ReserveGrant(_Wire):
    """Decode actor -> proxy -> prefill actor: where one request's K/V goes. The decode actor keeps the one record
    of the reservation (``kv_transfer.connector.intake``); this is only what others need to address it."""

    reservation_id: str  # names the reservation in transfer headers and the PrefillResult
    request_id: str
    decode_actor_id: str
    block_ids: tuple[int, ...]  # physical block ids on the decode actor, logical block i -> block_ids[i]
    kv_endpoint: str  # where a prefill actor sends this request's K/V (backend-specific address on D's node)
    ttl_s: float  # how long the decode actor waits for K/V (a duration: clocks are not compared across hosts)
    epoch: int = 0  # the reservation's epoch on the decode actor, carried by every K/V part written for it
    nonce: str = ""  # random per reservation, issued at reserve: bound into every authenticated K/V part (no replay)
    # the first ``cached_blocks`` of ``block_ids`` already hold the prompt's head (the decode actor's own prefix
    # cache, pinned at reserve): a prefill actor sends the K/V of the blocks after them only
    cached_blocks: int = 0
    # a tensor-parallel decode actor whose ranks hold their own heads (``tp_kv_cache="per_rank"``): each rank's
    # socket address, rank 0's first; a prefill rank sends each its heads (kv_transfer/wire/head_routes.py). Empty: the
    # decode actor's rank 0 holds every head at ``kv_endpoint``
    rank_endpoints: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("reservation_id", "request_id", "decode_actor_id"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"ReserveGrant.{name}: must be a non-empty string, got {getattr(self, name)!r}")
        if not isinstance(self.block_ids, (list, tuple)) or not self.block_ids:
            raise ValueError("ReserveGrant.block_ids: must be a non-empty list")
        _set(self, "block_ids", tuple(self.block_ids))
        _check_ids("ReserveGrant", "block_ids", self.block_ids)
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError("ReserveGrant.block_ids: must be distinct")
        if not isinstance(self.nonce, str):
            raise ValueError(f"ReserveGrant.nonce: must be a string, got {self.nonce!r}")
        if not isinstance(self.kv_endpoint, str):
            raise ValueError(f"ReserveGrant.kv_endpoint: must be a string, got {self.kv_endpoint!r}")
        if isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float)) or not 0 < self.ttl_s < math.inf:
            raise ValueError(f"ReserveGrant.ttl_s: must be a finite number > 0, got {self.ttl_s!r}")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise ValueError(f"ReserveGrant.epoch: must be an int >= 0, got {self.epoch!r}")
        _check_int("ReserveGrant", "cached_blocks", self.cached_blocks)
        if not isinstance(self.rank_endpoints, (list, tuple)) or len(self.rank_endpoints) == 1 \
                or not all(isinstance(e, str) and e for e in self.rank_endpoints):
            raise ValueError("ReserveGrant.rank_endpoints: must be empty or two or more non-empty addresses, got "
                             f"{self.rank_endpoints!r}")
        _set(self, "rank_endpoints", tuple(self.rank_endpoints))
        if self.cached_blocks >= len(self.block_ids):
            raise ValueError(f"ReserveGrant.cached_blocks: {self.cached_blocks} of {len(self.block_ids)} blocks "
                             "leaves nothing to send")

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class PrefillRequest(_Wire):
    """Proxy -> prefill actor: compute ``request``'s prompt and stream its K/V into ``grant``'s blocks."""

    request: GenerateRequest
    grant: ReserveGrant

    def __post_init__(self) -> None:
        if isinstance(self.request, Mapping):
            _set(self, "request", GenerateRequest.from_dict(self.request))
        if isinstance(self.grant, Mapping):
            _set(self, "grant", ReserveGrant.from_dict(self.grant))
        if not isinstance(self.request, GenerateRequest) or not isinstance(self.grant, ReserveGrant):
            raise ValueError("PrefillRequest: needs a GenerateRequest and a ReserveGrant")
        if self.grant.request_id != self.request.request_id:
            raise ValueError(f"PrefillRequest.grant: for {self.grant.request_id!r}, not {self.request.request_id!r}")


@dataclass(frozen=True)
class PrefillResult(_Wire):
    """Prefill actor -> proxy -> decode actor: the first token of each of the request's n completions, sampled from
    the prompt's last logits. Never text: the decode actor's one detokenizer owns the text. Whether the K/V arrived
    is the decode actor's own record's business; ``failed_parts`` only lets it stop waiting at once."""

    request_id: str
    reservation_id: str
    first_token_ids: tuple[int, ...]  # one per completion, in completion order
    # per completion, the first token's (token_id, logprob) pairs (sampled first, then the top-k); None: not asked
    first_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    seed: int = 0  # the seed the draws were keyed with, so the decode actor continues with the same stream
    # request.prompt_logprobs: per prompt token after the first, (token_id, logprob) pairs, its own first, then the
    # top-k (the proxy reads them here: the decode actor never computes the prompt)
    prompt_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    cached_tokens: int = 0  # prompt tokens the prefill actor served from its prefix cache
    parts_sent: int = 0  # (layer, chunk) parts handed to the transfer backend
    failed_parts: tuple[str, ...] = ()  # errors of parts that did not reach the decode actor
    bytes_sent: int = 0
    transfer_s: float = 0.0  # summed time of the parts on the wire (for metrics)
    backend: str = ""
    # the parts of this request's TTFT spent on the prefill actor, each a duration on its own clock (the controller
    # attributes TTFT misses by them): waiting in its queue, computing the prompt, then waiting for the last sends
    queue_s: float = 0.0
    compute_s: float = 0.0
    send_wait_s: float = 0.0
    # the prefill actor sent this result to the decode actor over the request's K/V channel, after its last part
    # (kv_transfer.wire.result_message), and the backend reported it sent: the proxy then makes no ``prefilled`` call.
    # False: a backend or peer that could not carry it; the proxy hands it over itself, as before
    delivered: bool = False
    # speculative decoding with a next-token (MTP) layer (engine/spec/spec_mtp.py): that layer's output at the prompt's
    # last position as float32 values, what the decode owner drafts from at its first step (the layer's K/V came
    # with the stream as one more layer); None: nothing to hand over (no MTP, or n > 1)
    draft_state: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.delivered, bool):
            raise ValueError(f"PrefillResult.delivered: must be a bool, got {self.delivered!r}")
        if self.draft_state is not None:
            if not isinstance(self.draft_state, (list, tuple)) or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in self.draft_state):
                raise ValueError("PrefillResult.draft_state: must be a list of numbers or null")
            _set(self, "draft_state", tuple(float(x) for x in self.draft_state))
        for name in ("request_id", "reservation_id"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"PrefillResult.{name}: must be a non-empty string, got {getattr(self, name)!r}")
        for name in ("first_token_ids", "failed_parts"):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise ValueError(f"PrefillResult.{name}: must be a list")
            _set(self, name, tuple(getattr(self, name)))
        if not self.first_token_ids:
            raise ValueError("PrefillResult.first_token_ids: must not be empty")
        _check_ids("PrefillResult", "first_token_ids", self.first_token_ids)
        if self.first_logprobs is not None:
            _set(self, "first_logprobs", _logprob_pairs("PrefillResult", self.first_logprobs, len(self.first_token_ids)))
        if self.prompt_logprobs is not None:
            _set(self, "prompt_logprobs", _prompt_pairs("PrefillResult", self.prompt_logprobs))
        for name in ("seed", "cached_tokens", "parts_sent", "bytes_sent"):
            _check_int("PrefillResult", name, getattr(self, name))
        for name in ("transfer_s", "queue_s", "compute_s", "send_wait_s"):
            _check_seconds("PrefillResult", name, getattr(self, name))

    @property
    def n(self) -> int:
        return len(self.first_token_ids)


@dataclass(frozen=True)
class AbortRequest(_Wire):
    """Proxy -> actors: stop a request now (client gone, error elsewhere); its blocks are freed at once."""

    request_id: str
    reason: str = "client disconnected"

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"AbortRequest.request_id: must be a non-empty string, got {self.request_id!r}")

@dataclass(frozen=True)
class TokenDelta(_Wire):
    """New tokens of one completion since the last delta (decode actor -> proxy, batched per decode step).

    The decode actor's detokenizer is the only source of text: the concatenated deltas of a completion are its final
    text, and no delta is ever taken back. ``token_ids`` and ``logprobs`` go with the text (a token whose text is
    still held back is delivered now, its text later), so a request can be resumed elsewhere from what was delivered.
    """

    request_id: str
    index: int  # which of the request's n completions
    token_ids: tuple[int, ...]  # newly generated ids (may be empty on a final, finish-only delta)
    text: str = ""  # newly detokenized text; may lag token_ids while a multi-byte character is incomplete
    # per new token, (token_id, logprob) pairs: the sampled token first, then the top-k. Pairs rather than a dict
    # because msgpack refuses integer map keys by default.
    logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; only on a completion's last delta
    usage: Usage | None = None  # set on the last delta of the request
    # the request failed on the actor (finish_reason "abort"), or the engine ended this completion ("error": a
    # grammar that admits no token): why, for the client
    error: str | None = None
    # request.prompt_logprobs, computed by this actor (colocated): as PrefillResult.prompt_logprobs, on the request's
    # first delta only
    prompt_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None

    def __post_init__(self) -> None:
        _check_int("TokenDelta", "index", self.index)
        if not isinstance(self.token_ids, (list, tuple)):
            raise ValueError("TokenDelta.token_ids: must be a list")
        _set(self, "token_ids", tuple(self.token_ids))
        _check_ids("TokenDelta", "token_ids", self.token_ids)
        if not isinstance(self.text, str):
            raise ValueError(f"TokenDelta.text: must be a string, got {self.text!r}")
        if self.logprobs is not None:
            _set(self, "logprobs", _logprob_pairs("TokenDelta", self.logprobs, len(self.token_ids)))
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"TokenDelta.finish_reason: must be one of {FINISH_REASONS} or None, "
                             f"got {self.finish_reason!r}")
        if isinstance(self.usage, Mapping):
            _set(self, "usage", Usage.from_dict(self.usage))
        elif self.usage is not None and not isinstance(self.usage, Usage):
            raise ValueError(f"TokenDelta.usage: must be a Usage or None, got {self.usage!r}")
        if self.error is not None and not isinstance(self.error, str):
            raise ValueError(f"TokenDelta.error: must be a string or None, got {self.error!r}")
        if self.prompt_logprobs is not None:
            _set(self, "prompt_logprobs", _prompt_pairs("TokenDelta", self.prompt_logprobs))


@dataclass(frozen=True)
class TokenFrame(_Wire):
    """One token-stream message (decode actor -> proxy): the deltas of one send, numbered within its stream so that
    the proxy drops a frame it has seen, or one that arrives after a later one (``cluster.wire.token_stream``).

    A *stream* is one connection of a decode actor's sender to one proxy; its frames' MAC covers ``stream`` and
    ``seq``, so a replayed frame cannot be renumbered.
    """

    stream: str  # the sending link's random id, fresh each time a link to a proxy opens
    seq: int  # 1, 2, 3, ... within the stream
    deltas: tuple[TokenDelta, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.stream, str):
            raise ValueError(f"TokenFrame.stream: must be a string, got {self.stream!r}")
        _check_int("TokenFrame", "seq", self.seq, lo=1)
        if not isinstance(self.deltas, (list, tuple)):
            raise ValueError("TokenFrame.deltas: must be a list")
        _set(self, "deltas", tuple(d if isinstance(d, TokenDelta) else TokenDelta.from_dict(d) for d in self.deltas))
