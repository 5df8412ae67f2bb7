"""Top-k, top-p and min-p as one candidate set per row, and the two-level inverse-CDF draw over it: the sampler's
filtering stages (``engine/sampling/sampler.py`` runs them in vLLM's order). Pure tensor code; which rows take which path is
a host fact (``engine/sampling/sampling_plan.py``)."""

from __future__ import annotations

import torch

from engine.sampling.sampling_plan import CandidateGroup, RowFacts, plan_rows

# Block width of the two-level inverse-CDF search used for wide rows.
_ICDF_BLOCK = 256


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor, first_is_max: bool = False) -> torch.Tensor:
    """Returns, per row of non-negative `weights` [n, w], the position whose cumulative-weight interval holds
    uniforms[i] * row total. Pure. Weights need not be normalized. `first_is_max`: every row's largest weight is
    its first (a candidate list, sorted), which spares the argmax of the rounding fallback.

    Two levels, so no full-width cumsum is needed: float32 sums of 256-wide blocks, a float64 cumsum over the
    blocks, then a float64 cumsum inside the one chosen block per row. Measured ~1 ms against ~12-25 ms for a
    float64 cumsum over 64 x 49152. The block width is fixed, so trailing zero weights (a wider candidate list)
    never change the result.
    """
    n, w = weights.shape
    block = _ICDF_BLOCK
    num_blocks = -(-w // block)
    padded = weights if num_blocks * block == w else torch.nn.functional.pad(weights, (0, num_blocks * block - w))
    blocks = padded.view(n, num_blocks, block)
    cum_blocks = blocks.sum(dim=-1).double().cumsum(dim=-1)
    targets = (uniforms * cum_blocks[:, -1]).unsqueeze(1)
    # right=True picks the first block/position whose cumulative weight exceeds the target, which has non-zero
    # weight; the clamps and the argmax fallback only guard float rounding (taken without asking the device whether
    # it is needed)
    b = torch.searchsorted(cum_blocks, targets, right=True).clamp_(max=num_blocks - 1)
    before = torch.where(b > 0, cum_blocks.gather(1, (b - 1).clamp_(min=0)), 0.0)
    rows = torch.arange(n, device=weights.device)
    inner = blocks[rows, b.squeeze(1)].cumsum(dim=-1, dtype=torch.float64) + before
    pos = torch.searchsorted(inner, targets, right=True).clamp_(max=block - 1)
    pos = (b * block + pos).squeeze(1).clamp_(max=w - 1)
    impossible = weights.gather(1, pos.unsqueeze(1)).squeeze(1) <= 0
    return torch.where(impossible, 0 if first_is_max else weights.argmax(dim=-1), pos)


_inverse_cdf = inverse_cdf  # the name tests and tools used


def candidates(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
               group: CandidateGroup, p_only: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For rows `x` [n, V] of one candidate group, returns (candidate token ids sorted by descending logit, keep
    mask, candidate weights = exp(logit - max logit), nucleus sizes of the top-p-only rows `p_only` or None). Pure.

    top-p is measured on the distribution renormalized after top-k; min-p compares with the top weight (1.0), a
    ratio that renormalization does not change. A top-p-only row's nucleus size is -1 where the nucleus did not
    close within the group's width (its keep mask is then short of the nucleus).
    """
    vocab_size = x.shape[1]
    if group.width >= vocab_size:
        vals, idx = torch.sort(x, dim=-1, descending=True)
    else:
        vals, idx = x.topk(group.width, dim=-1, sorted=True)
    weights = (vals - vals[:, :1]).exp_()
    k_on = (top_k > 0) & (top_k < vocab_size)
    keep = torch.arange(vals.shape[1], device=x.device).unsqueeze(0) < torch.where(k_on, top_k, vocab_size).unsqueeze(1)
    nucleus = None
    if group.any_top_p:
        p_on = top_p < 1.0
        cum = (weights * keep).cumsum(dim=-1)
        total = cum[:, -1].clone()
        if p_only is not None:  # these renormalize over the whole vocabulary
            total.index_copy_(0, p_only, (x.index_select(0, p_only) - vals.index_select(0, p_only)[:, :1])
                              .exp_().sum(dim=-1))
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
        # The smallest prefix reaching top_p: keep a token while the mass before it falls short.
        threshold = (top_p * total).unsqueeze(1)
        in_nucleus = before < threshold
        in_nucleus[:, 0] = True
        keep &= in_nucleus | ~p_on.unsqueeze(1)
        if p_only is not None:
            nucleus = in_nucleus.index_select(0, p_only).sum(dim=-1)
            if group.width < vocab_size:
                open_ = cum.index_select(0, p_only)[:, -1:] < threshold.index_select(0, p_only)
                nucleus = torch.where(open_.squeeze(1), -1, nucleus)
    if group.any_min_p:
        keep &= weights >= min_p.unsqueeze(1)
    return idx, keep, weights, nucleus


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Returns a new tensor of `logits` [N, V] with filtered-out entries set to -inf. Pure.

    top-k keeps exactly k tokens (ties at the boundary broken arbitrarily); top-p keeps the smallest set of most
    probable tokens whose probability (renormalized after top-k) is >= top_p, at least one; min-p keeps tokens with
    prob >= min_p * max prob. Off: k <= 0, p == 1, min_p 0. Reads the settings and the nucleus sizes on the host: a
    tool for tests, not the engine's path.
    """
    n, vocab_size = logits.shape
    facts = RowFacts([1.0] * n, top_k.tolist(), top_p.tolist(), min_p.tolist())
    plan = plan_rows(facts, vocab_size, [None] * n)
    keep = torch.ones_like(logits, dtype=torch.bool)
    dev = logits.device
    if plan.vocab_order_min_p:
        rows = torch.tensor(plan.vocab_order, device=dev)
        x = logits[rows]
        keep[rows] = (x - x.amax(dim=-1, keepdim=True)).exp_() >= min_p[rows].unsqueeze(1)
    for group in plan.groups:
        rows = torch.tensor(group.rows, device=dev)
        p_only = torch.tensor(group.p_only, device=dev) if group.p_only else None
        idx, kept, _, nucleus = candidates(logits[rows], top_k[rows], top_p[rows], min_p[rows], group, p_only)
        keep[rows] = torch.zeros(len(group.rows), vocab_size, dtype=torch.bool, device=dev).scatter_(1, idx, kept)
        if nucleus is not None and group.width < vocab_size:
            assert p_only is not None
            wide = rows[p_only[nucleus < 0]]  # nuclei wider than the candidates: over the whole sorted vocabulary
            if wide.numel():
                whole = CandidateGroup(vocab_size, list(range(wide.numel())), list(range(wide.numel())), True,
                                       group.any_min_p)
                idx, kept, _, _ = candidates(logits[wide], top_k[wide], top_p[wide], min_p[wide], whole,
                                             torch.arange(wide.numel(), device=dev))
                keep[wide] = torch.zeros_like(kept).scatter_(1, idx, kept)
    return logits.masked_fill(~keep, float("-inf"))
