"""Turns a batch of next-token logits into sampled token ids, one independent request per row.

Pure tensor code with no engine imports: the runner's persistent sampling state (``engine/sampling/sampling_state.py``) hands
it a `SamplingMetadata` per step, and ``Sampler()(logits, meta)`` samples.

Per row (vLLM's order): raw logits -> logprobs (if asked) -> grammar mask -> repetition penalty -> frequency and presence penalties ->
argmax if greedy, else divide by temperature -> top-k -> top-p -> min-p -> sample. Stages that no row uses are
skipped.

No row's path is decided by reading the device: which rows are greedy or use top-k, top-p, min-p, penalties or
logprobs are host facts (``engine/sampling/sampling_plan.py``), so each branch is taken on the host and each row selection is
a view of one index tensor sent per step. The device is read once per step, in `_to_host`: the sampled ids with
their logprobs and the top-p rows' nucleus sizes, packed into one tensor. A second read happens only in a step where
a top-p row's nucleus outgrew its candidates: those rows are redone over the whole sorted vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from engine.sampling.min_tokens import suppress
from engine.sampling.philox import sample_uniforms, seed_as_int64
from engine.sampling.sampling_bitmask import apply_token_bitmask
from engine.sampling.sampling_filters import _inverse_cdf, apply_top_k_top_p_min_p, candidates, inverse_cdf  # noqa: F401 (re-exported)
from engine.sampling.sampling_plan import CandidateGroup, FilterParams, RowFacts, RowPlan, plan_rows
from pdkernels.host_copy import to_device


class SamplingParamsLike(FilterParams, Protocol):
    """The per-request fields `SamplingMetadata.build` reads (read-only, so frozen dataclasses fit)."""

    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def logprobs(self) -> int | None: ...


def has_penalty(p: SamplingParamsLike) -> bool:
    """Whether a request needs its token history (a repetition, presence or frequency penalty). Pure."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of host values on ``device``, the host never waiting (:func:`pdkernels.host_copy.to_device`)."""
    return to_device(values, torch.int64, device)


@dataclass(frozen=True)
class TokenHistory:
    """The penalized rows' tokens on the device, prompt then output in the order generated, padded to one width:
    the repetition penalty reads both, presence and frequency the output. Held by the engine's sampling state and
    appended to on the device from each step's sampled ids (no list is rebuilt per step)."""

    rows: torch.Tensor  # int64 [P]: the batch rows these histories belong to, in increasing order
    tokens: torch.Tensor  # int32 or int64 [P, L]: each row's prompt then output tokens; past its length, any value
    prompt_lens: torch.Tensor  # int64 [P]
    lengths: torch.Tensor  # int64 [P]: prompt + output tokens held
    max_output: int  # host fact: the longest output among the rows (the width of the output pass)
    repetition: bool = True  # host fact: some row has a repetition penalty (else that pass is skipped)
    presence_frequency: bool = True  # host fact: some row has a presence or frequency penalty

    @staticmethod
    def from_lists(rows: Sequence[int], prompt_token_ids: Sequence[Sequence[int]],
                   output_token_ids: Sequence[Sequence[int]], vocab_size: int,
                   device: torch.device | str = "cpu") -> TokenHistory:
        """Histories of batch rows ``rows`` from their token lists (``prompt_token_ids[j]`` is row ``rows[j]``'s).
        Pure; raises ``ValueError`` for a token outside ``[0, vocab_size)``. For callers that hold lists (tests,
        tools); the engine keeps its histories on the device (``engine/sampling/sampling_state.py``)."""
        device = torch.device(device)
        lengths = [len(p) + len(o) for p, o in zip(prompt_token_ids, output_token_ids, strict=True)]
        tokens = torch.zeros(len(rows), max(lengths, default=0), dtype=torch.int64, device=device)
        write_histories(tokens, list(range(len(rows))), [[*p, *o] for p, o in zip(prompt_token_ids, output_token_ids)],
                        vocab_size)
        flat = host_to_device([*rows, *(len(p) for p in prompt_token_ids), *lengths], device)
        r, prompt_lens, lens = flat.split(len(rows))
        return TokenHistory(r, tokens, prompt_lens, lens, max((len(o) for o in output_token_ids), default=0))


def write_histories(tokens: torch.Tensor, rows: Sequence[int], histories: Sequence[Sequence[int]],
                    vocab_size: int) -> None:
    """Mutates ``tokens`` (``[R, L]``, L at least each history's length): row ``rows[j]`` starts with
    ``histories[j]``. One host -> device copy. Raises ``ValueError`` (changing nothing) for a token outside the
    vocabulary: checked on the host, where the lists are (on the device it would be an out-of-bounds write)."""
    for toks in histories:
        if toks and (min(toks) < 0 or max(toks) >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
    flat = host_to_device([*(r for r, toks in zip(rows, histories) for _ in toks),
                           *(i for toks in histories for i in range(len(toks))),
                           *(t for toks in histories for t in toks)], tokens.device)
    r, pos, values = flat.view(3, -1)
    tokens.index_put_((r, pos), values.to(tokens.dtype))


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling settings for one batch; row i describes logits row i."""

    temperature: torch.Tensor  # float32 [N]; < 1e-5 means greedy for that row
    top_k: torch.Tensor  # int64 [N]; <= 0 (or >= vocab) means disabled
    top_p: torch.Tensor  # float32 [N]; 1.0 means disabled
    min_p: torch.Tensor  # float32 [N]; 0.0 means disabled
    presence_penalty: torch.Tensor  # float32 [N]; subtract p once if the token is in the output
    frequency_penalty: torch.Tensor  # float32 [N]; subtract f * (count of the token in the output)
    repetition_penalty: torch.Tensor  # float32 [N]; prompt+output tokens: logit>0 -> /r, else *r
    # the counter-based draw's key (engine/sampling/philox.py): a random row's uniform is a pure function of these three
    seeds: torch.Tensor  # int64 [N]; the request's seed (low 64 bits, as a signed value)
    choices: torch.Tensor  # int64 [N]; which of the request's n completions the row samples for
    positions: torch.Tensor  # int64 [N]; absolute position of the token being sampled (prompt + output so far)
    num_logprobs: list[int | None]  # how many top logprobs to return per row; None -> none
    # the filter settings as host values (from the requests' parameters): the sampler routes rows by these and never
    # reads the device to do so. None: read from the tensors above (one host read, for callers without them)
    facts: RowFacts | None = None
    # the penalized rows' tokens; None: no row has a penalty (the penalty tensors are then not read)
    penalties: TokenHistory | None = None
    # int32 [N, ceil(V / 32)]: the tokens each row's grammar allows (engine/sampling/sampling_grammar.py), applied before any
    # other stage; logprobs stay the model's (raw logits). None: no row is constrained
    token_bitmask: torch.Tensor | None = None
    # int64 [2, K]: (row, token id) pairs never sampled this step: end tokens of rows short of their min_tokens
    # (engine/sampling/min_tokens.py), applied with the grammar mask. None: no row is
    suppressed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.temperature.shape[0]
        for name in ("top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "seeds", "choices", "positions", "num_logprobs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"SamplingMetadata.{name} has {len(getattr(self, name))} rows, "
                                 f"temperature has {n}")
        for name in ("seeds", "choices", "positions"):
            if getattr(self, name).dtype != torch.int64:
                raise ValueError(f"SamplingMetadata.{name} must be int64, got {getattr(self, name).dtype}")
        if any(k is not None and k < 0 for k in self.num_logprobs):
            raise ValueError(f"num_logprobs must be None or >= 0, got {self.num_logprobs}")
        if self.facts is not None and self.facts.num_rows != n:
            raise ValueError(f"SamplingMetadata.facts has {self.facts.num_rows} rows, temperature has {n}")

    @property
    def num_rows(self) -> int:
        """Number of rows (requests) in the batch. Pure."""
        return self.temperature.shape[0]

    @staticmethod
    def build(params: Sequence[SamplingParamsLike], prompt_token_ids: Sequence[Sequence[int]],
              output_token_ids: Sequence[Sequence[int]], seeds: Sequence[int], choices: Sequence[int],
              positions: Sequence[int], device: torch.device | str = "cpu",
              vocab_size: int | None = None) -> SamplingMetadata:
        """Packs per-request parameters and token lists into batch tensors on `device`. Pure.

        The seeds are passed in, not read from `params`: an unseeded request still samples with a seed, the one its
        engine gave it when it was added (see `LLMEngine.add_request`). Seeds may be any non-negative int; the draw
        uses their low 64 bits. `vocab_size` is needed when a request has a penalty (its tokens are checked against
        it). For callers holding lists; the engine's rows come from its persistent state.
        """
        device = torch.device(device)
        floats = torch.tensor([[p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                                p.repetition_penalty] for p in params], dtype=torch.float32).view(-1, 6)
        ints = torch.tensor([[p.top_k, seed_as_int64(s), c, q] for p, s, c, q in
                             zip(params, seeds, choices, positions, strict=True)], dtype=torch.int64).view(-1, 4)
        floats, ints = to_device(floats, torch.float32, device), to_device(ints, torch.int64, device)
        rows = [i for i, p in enumerate(params) if has_penalty(p)]
        penalties = None
        if rows:
            if vocab_size is None:
                raise ValueError("vocab_size: needed to check the token history of a penalty")
            penalties = TokenHistory.from_lists(rows, [prompt_token_ids[i] for i in rows],
                                                [output_token_ids[i] for i in rows], vocab_size, device)
        return SamplingMetadata(
            temperature=floats[:, 0], top_k=ints[:, 0], top_p=floats[:, 1], min_p=floats[:, 2],
            presence_penalty=floats[:, 3], frequency_penalty=floats[:, 4], repetition_penalty=floats[:, 5],
            seeds=ints[:, 1], choices=ints[:, 2], positions=ints[:, 3], num_logprobs=[p.logprobs for p in params],
            facts=RowFacts.of(params), penalties=penalties)


@dataclass
class SamplerOutput:
    """What the sampler decided for each row."""

    token_ids: list[int]  # sampled token per row
    logprobs: list[dict[int, float] | None]  # raw-logit logprobs of sampled + top-k; None if unasked
    sampled: torch.Tensor | None = None  # the same ids on the device (int64 [N]): what token histories append
    # per row, the nucleus size of a top-p row without top-k (0 for other rows): picks its candidates next step
    nucleus_sizes: list[int] = field(default_factory=list)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Returns a new tensor: `logits` [N, V] with the repetition, then the presence and frequency penalties applied
    to the rows of `meta.penalties`. Pure: `logits` is not modified.

    Works on the (row, token) entries of the rows' histories, never on dense [N, V] count tensors: measured 4 ms
    against 42 ms dense for 64 x 49152 with 256 output tokens per row. A token seen twice is written twice with the
    same value, so duplicates need no deduplication; the frequency penalty is added once per occurrence. Entries
    past a row's length are sent to one scratch element past the logits, so no shape depends on the values.
    """
    n, vocab_size = logits.shape
    buf = torch.empty(n * vocab_size + 1, dtype=logits.dtype, device=logits.device)  # the last element: scratch
    out = buf[:-1].view(n, vocab_size)
    out.copy_(logits)
    pen = meta.penalties
    if pen is None:
        return out
    scratch = n * vocab_size
    base = (pen.rows * vocab_size).unsqueeze(1)
    if pen.repetition:
        width = pen.tokens.shape[1]
        held = torch.arange(width, device=buf.device).unsqueeze(0) < pen.lengths.unsqueeze(1)
        seen = torch.where(held, base + pen.tokens, scratch)
        rep = meta.repetition_penalty.index_select(0, pen.rows).to(buf.dtype).unsqueeze(1)
        vals = buf[seen]
        buf[seen] = torch.where(vals > 0, vals / rep, vals * rep)
    if pen.presence_frequency and pen.max_output:
        at = pen.prompt_lens.unsqueeze(1) + torch.arange(pen.max_output, device=buf.device).unsqueeze(0)
        held = at < pen.lengths.unsqueeze(1)
        toks = pen.tokens.gather(1, at.clamp(max=pen.tokens.shape[1] - 1))
        seen = torch.where(held, base + toks, scratch)
        presence = meta.presence_penalty.index_select(0, pen.rows).to(buf.dtype).unsqueeze(1)
        frequency = meta.frequency_penalty.index_select(0, pen.rows).to(buf.dtype).unsqueeze(1)
        buf[seen] = buf[seen] - presence  # once per distinct token
        buf.index_add_(0, seen.flatten(), (-frequency).expand(seen.shape).flatten())  # once per occurrence
    return out


@dataclass(frozen=True)
class _StepIndex:
    """Device views of the one index tensor a step sends: the rows of each path of a plan."""

    greedy: torch.Tensor
    vocab_order: torch.Tensor
    groups: list[tuple[torch.Tensor, torch.Tensor | None]]  # per candidate group: its rows, its top-p-only rows
    logprob_rows: torch.Tensor

    @staticmethod
    def of(plan: RowPlan, device: torch.device) -> _StepIndex:
        """One host -> device copy for the whole plan. Pure."""
        parts = [plan.greedy, plan.vocab_order]
        for g in plan.groups:
            parts += [g.rows, g.p_only]
        parts.append(plan.logprob_rows)
        views = host_to_device([i for part in parts for i in part], device).split([len(p) for p in parts])
        groups = [(views[2 + 2 * j], views[3 + 2 * j] if g.p_only else None) for j, g in enumerate(plan.groups)]
        return _StepIndex(views[0], views[1], groups, views[-1])


def _rows(t: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """t's rows ``index`` (``count`` increasing rows); t itself when that is every row. Pure."""
    return t if count == t.shape[0] else t.index_select(0, index)


def _scatter(out: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out`` with rows ``index`` set to ``values`` (mutated in place), or ``values`` when they are every row."""
    return values if values.shape[0] == out.shape[0] else out.index_copy_(0, index, values)


def _to_host(packed: torch.Tensor) -> list[float]:
    """The step's device read: ``packed`` (float64) as host floats. On CUDA through pinned memory: a non-blocking
    copy, then a wait on an event recorded after it, and the host reads its own memory."""
    if packed.device.type != "cuda":
        return packed.tolist()
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)  # queued on the current stream of packed's device
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(packed.device))
    done.synchronize()
    return host.tolist()


def _rows_tokens(x: torch.Tensor, meta: SamplingMetadata, uniforms: torch.Tensor, rows: torch.Tensor, count: int,
                 group: CandidateGroup | None, p_only: torch.Tensor | None, min_p_on: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draws the random rows ``rows`` of penalized logits ``x``: over their candidate ``group``, or over the
    vocabulary in id order when ``group`` is None. Returns (tokens, nucleus sizes of ``p_only`` or None). Pure.

    Inverse-CDF sampling with one counter-based uniform per row, keyed by (seed, choice, position): a row's token
    depends only on its logits and its key, never on its batch neighbours, their order or the device. An
    Exponential(1) race would need V draws per row: ~60 ms per 64 x 49152 batch on this CPU.
    """
    scaled = _rows(x, rows, count) / _rows(meta.temperature, rows, count).unsqueeze(1)
    u = _rows(uniforms, rows, count)
    if group is None:
        weights = (scaled - scaled.amax(dim=-1, keepdim=True)).exp_()
        if min_p_on:
            weights = weights * (weights >= _rows(meta.min_p, rows, count).unsqueeze(1))
        return inverse_cdf(weights, u), None
    idx, keep, weights, nucleus = candidates(scaled, _rows(meta.top_k, rows, count), _rows(meta.top_p, rows, count),
                                             _rows(meta.min_p, rows, count), group, p_only)
    # the first candidate (weight 1) is always kept: k >= 1, it opens the nucleus, and min_p <= 1
    pos = inverse_cdf(weights * keep, u, first_is_max=True)
    return idx.gather(1, pos.unsqueeze(1)).squeeze(1), nucleus


class Sampler:
    """Samples one token per row. Stateless: every random draw comes from the row's key."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Samples a token per row of `logits` [N, V]. Pure: the same logits and metadata give the same tokens,
        whatever the device or the other rows. Reads the device once (twice in a step that redoes a wide nucleus).
        """
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits must be [{meta.num_rows}, vocab], got {tuple(logits.shape)}")
        n, vocab_size = logits.shape
        facts = meta.facts if meta.facts is not None else RowFacts(
            meta.temperature.tolist(), meta.top_k.tolist(), meta.top_p.tolist(), meta.min_p.tolist())
        plan = plan_rows(facts, vocab_size, meta.num_logprobs)
        index = _StepIndex.of(plan, logits.device)
        x = logits.float()
        if meta.token_bitmask is not None:
            x = apply_token_bitmask(x, meta.token_bitmask)
        if meta.suppressed is not None:
            x = suppress(x, meta.suppressed)
        if meta.penalties is not None:
            x = apply_penalties(x, meta)
        uniforms = (sample_uniforms(meta.seeds, meta.choices, meta.positions).to(x.device)
                    if len(plan.greedy) < n else x.new_zeros(0, dtype=torch.float64))
        token_ids, nuclei = self._draw(x, meta, uniforms, plan, index)
        parts = [token_ids.double(), *(nu.double() for nu in nuclei)]
        lp = None
        num_lp = len(plan.logprob_rows)
        if num_lp:  # from the raw logits
            lp = _rows(logits, index.logprob_rows, num_lp).float().log_softmax(dim=-1)
            sampled = lp.gather(1, _rows(token_ids, index.logprob_rows, num_lp).unsqueeze(1))
            top_vals, top_idx = lp.topk(plan.max_logprobs, dim=-1)
            parts += [sampled.double().flatten(), top_vals.double().flatten(), top_idx.double().flatten()]
        # the one read: float64 holds every id (< 2**53) and logprob exactly
        host = iter(_to_host(torch.cat(parts)))
        ids = [int(next(host)) for _ in range(n)]
        sizes = {row: int(next(host)) for row in plan.p_only_rows}
        sampled_lp = {row: next(host) for row in plan.logprob_rows}
        k = plan.max_logprobs
        top = [[next(host) for _ in range(k)] for _ in range(num_lp)]
        top_ids = [[int(next(host)) for _ in range(k)] for _ in range(num_lp)]
        redo = sorted(row for row, size in sizes.items() if size < 0)
        if redo:
            self._redo(x, meta, uniforms, plan, redo, token_ids, lp, ids, sizes, sampled_lp)
        logprobs: list[dict[int, float] | None] = [None] * n
        for j, row in enumerate(plan.logprob_rows):
            entry = {top_ids[j][c]: top[j][c] for c in range(meta.num_logprobs[row] or 0)}
            entry[ids[row]] = sampled_lp[row]
            logprobs[row] = entry
        nucleus_sizes = [sizes.get(row, 0) for row in range(n)]
        return SamplerOutput(token_ids=ids, logprobs=logprobs, sampled=token_ids, nucleus_sizes=nucleus_sizes)

    @staticmethod
    def _draw(x: torch.Tensor, meta: SamplingMetadata, uniforms: torch.Tensor, plan: RowPlan, index: _StepIndex
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every row's token on the device (int64 [N]), and the nucleus sizes of each candidate group's top-p-only
        rows (in plan order). Pure."""
        token_ids = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        if plan.greedy:
            token_ids = _scatter(token_ids, index.greedy, _rows(x, index.greedy, len(plan.greedy)).argmax(dim=-1))
        if plan.vocab_order:
            tokens, _ = _rows_tokens(x, meta, uniforms, index.vocab_order, len(plan.vocab_order), None, None,
                                     plan.vocab_order_min_p)
            token_ids = _scatter(token_ids, index.vocab_order, tokens)
        nuclei = []
        for group, (rows, p_only) in zip(plan.groups, index.groups):
            tokens, nucleus = _rows_tokens(x, meta, uniforms, rows, len(group.rows), group, p_only, group.any_min_p)
            token_ids = _scatter(token_ids, rows, tokens)
            if nucleus is not None:
                nuclei.append(nucleus)
        return token_ids, nuclei

    def _redo(self, x: torch.Tensor, meta: SamplingMetadata, uniforms: torch.Tensor, plan: RowPlan,
              redo: list[int], token_ids: torch.Tensor, lp: torch.Tensor | None, ids: list[int],
              sizes: dict[int, int], sampled_lp: dict[int, float]) -> None:
        """Resamples the top-p rows ``redo`` whose nucleus outgrew their candidates over the whole sorted
        vocabulary, and reads their ids, nucleus sizes and new sampled logprobs: the step's second and last read.
        Mutates ``token_ids`` and the host values. Gives the token a wide enough list would have given: the inverse
        CDF ignores candidates past the nucleus."""
        vocab_size, m = x.shape[1], len(redo)
        lp_pos = {r: j for j, r in enumerate(plan.logprob_rows)}
        with_lp = [j for j, r in enumerate(redo) if r in lp_pos]
        flat = host_to_device([*redo, *range(m), *with_lp, *(lp_pos[redo[j]] for j in with_lp)], x.device)
        rows, p_only, local, lp_rows = flat.split([m, m, len(with_lp), len(with_lp)])
        group = CandidateGroup(width=vocab_size, rows=redo, p_only=list(range(m)), any_top_p=True,
                               any_min_p=any(plan.min_p_on[r] for r in redo))
        tokens, nucleus = _rows_tokens(x, meta, uniforms, rows, m, group, p_only, group.any_min_p)
        assert nucleus is not None
        token_ids.index_copy_(0, rows, tokens)
        parts = [tokens.double(), nucleus.double()]
        if with_lp and lp is not None:
            new = lp.index_select(0, lp_rows).gather(1, tokens.index_select(0, local).unsqueeze(1))
            parts.append(new.double().flatten())
        host = _to_host(torch.cat(parts))
        for j, row in enumerate(redo):
            ids[row], sizes[row] = int(host[j]), int(host[m + j])
        for value, j in zip(host[2 * m :], with_lp):
            sampled_lp[redo[j]] = value
