"""Turns a batch of next-token logits into sampled token ids, one independent request per row.

Pure tensor code with no engine imports: the scheduler packs per-request settings into a
`SamplingMetadata`, the model runner calls `Sampler(...)(logits, meta)`.

Order of operations for a row (vLLM's order): raw logits -> logprobs (if asked) ->
repetition penalty -> frequency/presence penalties -> greedy argmax, or divide by temperature ->
top-k -> top-p -> min-p -> sample. Stages no row uses are skipped entirely.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Protocol, Sequence

import torch

# Temperatures below this are treated as greedy: dividing by ~0 would overflow to inf/nan.
_GREEDY_EPS = 1e-5
# top-p first looks for the nucleus among this many highest logits; only rows whose nucleus is
# wider (very flat distributions) pay for a full sort, which costs ~3.5 ms per 49k-vocab CPU row.
_TOP_P_CANDIDATES = 256


class SamplingParamsLike(Protocol):
    """What `SamplingMetadata.build` reads from each request's sampling parameters."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def logprobs(self) -> int | None: ...


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
    generators: list[torch.Generator | None]  # CPU generators; None -> the sampler's default
    prompt_token_ids: list[list[int]]  # read only by the repetition penalty
    output_token_ids: list[list[int]]  # tokens generated so far, for all three penalties
    num_logprobs: list[int | None]  # top-k logprobs to return per row; None -> no logprobs

    def __post_init__(self) -> None:
        n = self.temperature.shape[0]
        for name in ("top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "generators", "prompt_token_ids",
                     "output_token_ids", "num_logprobs"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"SamplingMetadata.{name} has {len(getattr(self, name))} rows, "
                                 f"temperature has {n}")
        for g in self.generators:
            if g is not None and g.device.type != "cpu":
                raise ValueError("per-row generators must be CPU generators (only one uniform "
                                 f"per row is drawn, on the CPU); got one on {g.device}")
        for k in self.num_logprobs:
            if k is not None and k < 0:
                raise ValueError(f"num_logprobs must be None or >= 0, got {k}")

    @property
    def num_rows(self) -> int:
        """Number of rows (requests) in the batch. Pure."""
        return self.temperature.shape[0]

    @staticmethod
    def build(
        params: Sequence[SamplingParamsLike],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Packs per-request parameters into batch tensors on `device`. Pure.

        `generators` must persist across steps (a seeded request owns its generator), so they
        are passed in rather than created here; None means every row uses the default.
        """
        def col(name: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)

        return SamplingMetadata(
            temperature=col("temperature", torch.float32),
            top_k=col("top_k", torch.int64),
            top_p=col("top_p", torch.float32),
            min_p=col("min_p", torch.float32),
            presence_penalty=col("presence_penalty", torch.float32),
            frequency_penalty=col("frequency_penalty", torch.float32),
            repetition_penalty=col("repetition_penalty", torch.float32),
            generators=list(generators) if generators is not None else [None] * len(params),
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            num_logprobs=[p.logprobs for p in params],
        )


@dataclass
class SamplerOutput:
    """What the sampler decided for each row."""

    token_ids: list[int]  # sampled token per row
    logprobs: list[dict[int, float] | None]  # raw-logit logprobs: sampled token + top-k; or None


def _token_counts(rows: Sequence[Sequence[int]], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """Returns float32 [len(rows), vocab_size] counts of each token id per row. Pure.

    One flat index_add_ over all rows: measured faster than per-row bincount or a padded
    scatter_add, and it needs no padding value.
    """
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    lengths = [len(r) for r in rows]
    if sum(lengths) == 0:
        return counts
    flat = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.int64, device=device)
    if int(flat.min()) < 0 or int(flat.max()) >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got "
                         f"[{int(flat.min())}, {int(flat.max())}]")
    row_ids = torch.repeat_interleave(torch.arange(len(rows), device=device),
                                      torch.tensor(lengths, device=device))
    counts.view(-1).index_add_(0, row_ids * vocab_size + flat,
                               torch.ones(flat.shape[0], dtype=torch.float32, device=device))
    return counts


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Returns a new tensor of `logits` [N, V] with repetition, frequency and presence penalties
    applied (in that order). Pure: `logits` is not modified. Only rows using a penalty are touched.
    """
    out = logits.clone()
    rep_on = meta.repetition_penalty != 1.0
    fp_on = (meta.frequency_penalty != 0.0) | (meta.presence_penalty != 0.0)
    rows = (rep_on | fp_on).nonzero().squeeze(1)
    if rows.numel() == 0:
        return out
    row_list = rows.tolist()
    vocab_size = logits.shape[1]
    sub = out[rows]
    output_counts = _token_counts([meta.output_token_ids[i] for i in row_list], vocab_size,
                                  logits.device)
    in_output = output_counts > 0
    if bool(rep_on.any()):
        rep_rows = rep_on.tolist()
        prompt_seen = _token_counts(
            [meta.prompt_token_ids[i] if rep_rows[i] else [] for i in row_list],
            vocab_size, logits.device) > 0
        r = meta.repetition_penalty[rows].unsqueeze(1).to(sub.dtype)
        # Rows with r == 1 come out unchanged: x / 1 == x * 1 == x.
        sub = torch.where(prompt_seen | in_output, torch.where(sub > 0, sub / r, sub * r), sub)
    if bool(fp_on.any()):
        f = meta.frequency_penalty[rows].unsqueeze(1).to(sub.dtype)
        p = meta.presence_penalty[rows].unsqueeze(1).to(sub.dtype)
        sub = sub - f * output_counts - p * in_output
    out[rows] = sub
    return out


def _top_k_top_p_keep(logits: torch.Tensor, probs: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, candidates: int) -> torch.Tensor:
    """Returns the bool keep-mask [n, V] of top-k then top-p (top-p measured on the distribution
    renormalized over the top-k). Pure. Rows whose nucleus is not closed within the `candidates`
    highest logits are recomputed with a full sort.
    """
    n, vocab_size = logits.shape
    k_on = (top_k > 0) & (top_k < vocab_size)
    p_on = top_p < 1.0
    k_cap = torch.where(k_on, top_k, vocab_size)
    width = min(vocab_size, max(candidates, int(k_cap[k_on].max()) if bool(k_on.any()) else 0))
    if width == vocab_size:
        top_vals, top_idx = torch.sort(logits, dim=-1, descending=True)
    else:
        top_vals, top_idx = logits.topk(width, dim=-1, sorted=True)
    keep = torch.arange(width, device=logits.device).unsqueeze(0) < k_cap.unsqueeze(1)
    unresolved = torch.zeros(n, dtype=torch.bool, device=logits.device)
    if bool(p_on.any()):
        kept_probs = probs.gather(1, top_idx) * keep
        # Top-k rows hold their whole (renormalizing) mass inside the candidates.
        total = torch.where(k_on, kept_probs.sum(-1), probs.sum(-1))
        cum = kept_probs.cumsum(-1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
        # Smallest prefix reaching top_p: keep a token while the mass before it is short of it.
        in_nucleus = before < (top_p * total).unsqueeze(1)
        in_nucleus[:, 0] = True
        keep &= in_nucleus | ~p_on.unsqueeze(1)
        if width < vocab_size:
            unresolved = p_on & ~k_on & (cum[:, -1] < top_p * total)
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top_idx, keep)
    redo = unresolved.nonzero().squeeze(1)
    if redo.numel():
        mask[redo] = _top_k_top_p_keep(logits[redo], probs[redo], top_k[redo], top_p[redo],
                                       vocab_size)
    return mask


def _filter_keep_mask(logits: torch.Tensor, probs: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor | None:
    """Returns the bool mask [N, V] of tokens that survive top-k, top-p and min-p, or None when
    no row filters anything. Pure. `probs` must be softmax(logits).
    """
    vocab_size = logits.shape[1]
    kp_rows = (((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0)).nonzero().squeeze(1)
    m_on = min_p > 0.0
    if kp_rows.numel() == 0 and not bool(m_on.any()):
        return None
    keep = torch.ones_like(logits, dtype=torch.bool)
    if kp_rows.numel():
        keep[kp_rows] = _top_k_top_p_keep(logits[kp_rows], probs[kp_rows], top_k[kp_rows],
                                          top_p[kp_rows], _TOP_P_CANDIDATES)
    m_rows = m_on.nonzero().squeeze(1)
    if m_rows.numel():
        # min-p compares to the top token's probability; that ratio does not change when top-k
        # or top-p renormalize, so it can be measured on the unfiltered probabilities.
        p = probs[m_rows]
        floor = (min_p[m_rows] * p.max(dim=-1).values).unsqueeze(1)
        keep[m_rows] &= p >= floor
    return keep


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Returns a new tensor of `logits` [N, V] with filtered-out entries set to -inf. Pure.

    top-k keeps exactly k tokens (ties at the boundary broken arbitrarily); top-p keeps the
    smallest set of most probable tokens whose mass (renormalized after top-k) is >= top_p, at
    least one; min-p keeps tokens with prob >= min_p * max prob. Disabled: k <= 0, p == 1, min_p 0.
    """
    keep = _filter_keep_mask(logits, logits.softmax(dim=-1), top_k, top_p, min_p)
    if keep is None:
        return logits.clone()
    return logits.masked_fill(~keep, float("-inf"))


def _raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                  num_logprobs: list[int | None]) -> list[dict[int, float] | None]:
    """Returns per-row {token: logprob} (sampled token + top-k) from the raw logits. Pure."""
    result: list[dict[int, float] | None] = [None] * len(num_logprobs)
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    if not rows:
        return result
    lp = logits[rows].float().log_softmax(dim=-1)
    sampled = lp.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1).tolist()
    max_k = min(logits.shape[1], max(num_logprobs[i] or 0 for i in rows))
    top_vals, top_idx = (lp.topk(max_k, dim=-1) if max_k else (lp[:, :0], lp[:, :0].long()))
    top_vals_l, top_idx_l = top_vals.tolist(), top_idx.tolist()
    sampled_ids = token_ids[rows].tolist()
    for j, i in enumerate(rows):
        k = num_logprobs[i] or 0
        entry = dict(zip(top_idx_l[j][:k], top_vals_l[j][:k]))
        entry[sampled_ids[j]] = sampled[j]
        result[i] = entry
    return result


class Sampler:
    """Samples one token per row; stateless apart from the default generator for unseeded rows."""

    def __init__(self, seed: int | None = None) -> None:
        self._default_generator = torch.Generator()
        if seed is None:
            self._default_generator.seed()
        else:
            self._default_generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Samples a token per row of `logits` [N, V]. Does not modify `logits` or `meta`;
        advances the generators of the random rows (one uniform draw per row).
        """
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits must be [{meta.num_rows}, vocab], got {tuple(logits.shape)}")
        x = logits.float()
        if bool((meta.repetition_penalty != 1.0).any() | (meta.frequency_penalty != 0.0).any()
                | (meta.presence_penalty != 0.0).any()):
            x = apply_penalties(x, meta)
        greedy = meta.temperature < _GREEDY_EPS
        if bool(greedy.all()):
            token_ids = x.argmax(dim=-1)
        else:
            token_ids = torch.empty(meta.num_rows, dtype=torch.int64, device=x.device)
            greedy_rows = greedy.nonzero().squeeze(1)
            if greedy_rows.numel():
                token_ids[greedy_rows] = x[greedy_rows].argmax(dim=-1)
            random_rows = (~greedy).nonzero().squeeze(1)
            token_ids[random_rows] = self._sample(x[random_rows], meta, random_rows)
        return SamplerOutput(token_ids=token_ids.tolist(),
                             logprobs=_raw_logprobs(logits, token_ids, meta.num_logprobs))

    def _generator_for(self, meta: SamplingMetadata, row: int) -> torch.Generator:
        """Returns the row's own generator, or the default one for unseeded rows. Pure."""
        generator = meta.generators[row]
        return self._default_generator if generator is None else generator

    def _sample(self, x: torch.Tensor, meta: SamplingMetadata,
                rows: torch.Tensor) -> torch.Tensor:
        """Returns a token per row of penalized logits `x` [n, V] for batch rows `rows`.
        Advances each row's generator by one float64 uniform.

        Inverse-CDF sampling: one uniform per row from that row's own generator, so a seeded
        row's token depends only on its logits and its generator, not on its batch neighbours.
        Measured on CPU (64 x 49152): an Exponential(1) race needs V draws per row (~60 ms per
        batch); this needs a float64 cumsum (~4 ms).
        """
        probs = (x / meta.temperature[rows].unsqueeze(1)).softmax(dim=-1)
        keep = _filter_keep_mask(x, probs, meta.top_k[rows], meta.top_p[rows], meta.min_p[rows])
        if keep is not None:
            probs = probs.masked_fill(~keep, 0.0)
        uniforms = [
            torch.rand(1, dtype=torch.float64, generator=self._generator_for(meta, i)).item()
            for i in rows.tolist()
        ]
        cum = probs.cumsum(dim=-1, dtype=torch.float64)
        targets = torch.tensor(uniforms, dtype=torch.float64, device=x.device) * cum[:, -1]
        # right=True: the first index whose cumulative mass exceeds the target, which always has
        # non-zero probability; the clamp and the fallback only guard float rounding at the end.
        token_ids = torch.searchsorted(cum, targets.unsqueeze(1), right=True).squeeze(1)
        token_ids.clamp_(max=x.shape[1] - 1)
        impossible = probs.gather(1, token_ids.unsqueeze(1)).squeeze(1) <= 0
        return torch.where(impossible, probs.argmax(dim=-1), token_ids)
