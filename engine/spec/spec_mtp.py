"""Multi-token prediction (MTP) drafts: DeepSeek-V3's next-token layer proposes the drafts the engine verifies.

A checkpoint with ``num_nextn_predict_layers`` ships, after its ``num_hidden_layers`` decoder layers, a layer ``N``
(``model.layers.N.*``): ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, a full decoder layer (MLA attention and
an MoE or dense MLP) and ``shared_head.norm`` / ``shared_head.head``. At position ``i`` it reads the main model's
final hidden state ``h_i`` and the next token ``t_(i+1)``:

    x_i = eh_proj([enorm(emb(t_(i+1))) ; hnorm(h_i)]),  g_i = layer(x_i),  logits = head(norm(g_i)) -> t_(i+2)

as vLLM and SGLang run it (``h`` after the main model's final norm; ``g`` before the shared head's). Drafts past the
first reuse the layer on its own output: row ``i + 1`` reads ``g_i`` in place of ``h_(i+1)`` and the draft it
proposed. Drafts are greedy (the argmax): verification (engine/spec/spec_verify.py) keeps the output exactly the model's
whatever the drafts are.

**Its K/V** is one more layer of the paged pool (index ``N``, the same block tables): position ``i``'s MTP K/V sits
in the slot of position ``i``. It is valid for positions below ``done`` (per sequence), and the engine keeps
``done == num_computed_tokens``: right after each step samples (:meth:`MTPDrafter.after_step`, the runner's
``after_sample`` hook) the layer runs over every position the step computed and kept (a prompt chunk's, a decode's,
a verify's last token and accepted drafts), its next tokens now known (the next prompt token, or the sampled ones).
The last such row's output ``g`` is what the next step drafts from. Drafts past the first (:meth:`complete`) run
after the scheduler allocated the verify's ``k + 1`` positions: chain row ``j`` writes its K/V at position
``p + j - 1``, which the next step's catch-up overwrites with the true one (or leaves beyond ``done``).

**Disaggregated.** A prefill actor runs the catch-up too (its sequences never draft: ``max_tokens`` 1), and its
per-layer K/V stream sends layer ``N`` like the others (``after_kv_store(N)``), so the decode owner receives the
prompt's MTP K/V in its reserved blocks. The decode owner also needs ``g`` of the prompt's last position to draft at
its first step: the prefill actor hands it over in :class:`cluster.wire.messages.PrefillResult` (``draft_state``,
float32 values: exact for float32 and bfloat16), rather than the decode owner recomputing the main model's last
position. A sequence whose MTP history has a gap (``n > 1`` completions after the fork, a result without the state)
simply runs without drafts.

Known approximation (acceptance only, never the output): a prefix-cache hit reuses the cached blocks' MTP K/V,
whose last position was computed with the next token of the request that filled the block.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.linear import Linear
from engine.models.mla import MLAttention
from engine.models.model import DecoderModel, LayerWeights
from engine.scheduling.scheduler import SampledToken, ScheduledSeq, SchedulerOutput
from engine.request.sequence import Sequence
from engine.spec.spec_rows import row_inputs

_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


@dataclass
class MTPLayer:
    """The next-token layer's weights; :meth:`forward` is pure apart from writing its K/V."""

    model: DecoderModel  # its embedding and head where the checkpoint shares them, its RoPE and softmax scale
    embed: torch.Tensor  # embed_tokens [vocab, hidden] (DeepSeek-V3 stores a copy of the main model's)
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: Linear  # [hidden, 2 * hidden]: the normed embedding, then the normed hidden state
    attention: MLAttention  # its one layer's MLA weights
    layer: LayerWeights  # its norms and MLP (dense or routed + shared experts)
    head_norm: torch.Tensor  # shared_head.norm
    head: Linear  # shared_head.head (the main model's lm_head when absent)

    @staticmethod
    def load(model: DecoderModel, state: dict[str, torch.Tensor]) -> MTPLayer:
        """The layer ``N = num_layers`` of ``state`` (what the main model left in it). Mutates ``state`` (pops it).
        Raises ``ValueError`` for a model that is not DeepSeek-shaped or a checkpoint without the layer."""
        cfg = model.cfg
        if cfg.mla is None:
            raise ValueError("speculative_config.method: 'mtp' needs a DeepSeek (MLA) checkpoint with next-token "
                             f"layers; this model's architecture has none ({cfg.architecture})")
        p = f"model.layers.{cfg.num_layers}."
        missing = [n for n in _OWN if p + n not in state]
        if missing:
            raise ValueError(f"speculative_config.method: 'mtp' needs the checkpoint's next-token layer "
                             f"(num_nextn_predict_layers >= 1): {p}{missing[0]} is missing")
        embed = state.pop(f"{p}embed_tokens.weight", None)
        head = state.pop(f"{p}shared_head.head.weight", None)
        own = {n: state.pop(p + n) for n in _OWN}
        return MTPLayer(
            model=model, embed=model.embed if embed is None else embed, enorm=own["enorm.weight"],
            hnorm=own["hnorm.weight"], eh_proj=Linear(own["eh_proj.weight"]),
            attention=MLAttention(cfg, state, cfg.rms_norm_eps, range(cfg.num_layers, cfg.num_layers + 1)),
            layer=model._deepseek_layer(state, cfg.num_layers), head_norm=own["shared_head.norm.weight"],
            head=model.lm_head if head is None else Linear(head))

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: Any,
                kv: torch.Tensor, scales: tuple[torch.Tensor | None, torch.Tensor | None],
                after_store: Callable[[], None] | None) -> torch.Tensor:
        """Outputs ``g [T, hidden]`` (before the shared head's norm) of rows reading ``token_ids`` (each position's
        next token) and ``hidden`` (the main model's final hidden state there, or a chain's previous ``g``). Writes
        the rows' K/V into ``kv`` (the pool's layer N) and then calls ``after_store``. Prefill-layout metadata."""
        m, eps = self.model, self.model.cfg.rms_norm_eps

        def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return F.rms_norm(x, (x.shape[-1],), w, eps)

        h = self.eh_proj(torch.cat((norm(self.embed[token_ids], self.enorm), norm(hidden, self.hnorm)), dim=-1))
        lw = self.layer
        spans: list[Any] = [None] * len(meta.decode_groups)
        h = h + self.attention.forward(0, norm(h, lw.input_norm), m.rope.lookup(positions), meta, kv, scales,
                                       m.scale, spans, after_store)
        x = norm(h, lw.post_norm)
        if lw.moe is not None:
            out = lw.moe(x)
        else:
            assert lw.gate_up is not None and lw.down is not None
            gate, up = lw.gate_up(x).chunk(2, dim=-1)
            out = lw.down(m.act(gate) * up)
        return h + out

    def greedy(self, g: torch.Tensor) -> list[int]:
        """The argmax token of each row's logits ``head(norm(g))``. Pure."""
        x = F.rms_norm(g, (g.shape[-1],), self.head_norm, self.model.cfg.rms_norm_eps)
        return self.head(x).float().argmax(dim=-1).tolist()


@dataclass
class _Draft:
    request_id: str
    done: int  # MTP K/V is this sequence's true one below this position
    g: torch.Tensor | None = None  # [hidden]: the output at position done - 1 (what the next draft reads)
    first: int | None = None  # the draft it proposes: the token after the sequence's last one


class MTPDrafter:
    """Per running sequence: how far its MTP K/V is valid, its last output and first draft. ``after_step``,
    ``complete``, ``adopt`` and ``handoff`` mutate (and write the pool's layer ``N``)."""

    def __init__(self, layer: MTPLayer, runner: Any) -> None:
        self.layer = layer
        self.runner = runner  # engine.model_runner.ModelRunner: its pool, its step inputs
        self.index = layer.model.cfg.num_layers  # the pool layer holding the MTP K/V
        self._states: dict[int, _Draft] = {}

    # -- what the speculative decoder asks -------------------------------------------------------------------------
    def first(self, seq: Sequence) -> int | None:
        """The first draft for a decoding ``seq``, or None when its MTP history is incomplete. Pure."""
        st = self._states.get(seq.seq_id)
        if st is None or st.done != seq.num_computed_tokens or seq.num_tokens != st.done + 1:
            return None
        return st.first

    def forget(self, live: set[int]) -> None:
        """Mutates: drop the state of sequences not in ``live``."""
        for gone in [s for s in self._states if s not in live]:
            del self._states[gone]

    def drop(self, seq_id: int) -> None:
        """Mutates: ``seq_id`` will never draft; its state goes and the layer's pass skips it from now on (a gap)."""
        self._states.pop(seq_id, None)

    def handoff(self, request_id: str) -> tuple[float, ...] | None:
        """The state a decode owner needs to draft at its first step for ``request_id``'s (one) completion: its
        last output ``g`` as float32 values, or None. Pure."""
        for st in self._states.values():
            if st.request_id == request_id and st.g is not None:
                return tuple(st.g.float().tolist())
        return None

    @torch.inference_mode()
    def adopt(self, seq: Sequence, values: tuple[float, ...] | list[float]) -> None:
        """Mutates: a prefilled ``seq`` (prompt K/V, the MTP layer's too, received) drafts from the handed-over
        ``g`` (:meth:`handoff`) at its first step. Raises ``ValueError`` on a wrong width."""
        model = self.layer.model
        if len(values) != model.cfg.hidden_size:
            raise ValueError(f"draft_state: {len(values)} values, the model's hidden size is {model.cfg.hidden_size}")
        g = torch.tensor(values, dtype=torch.float32, device=model.device).to(model.dtype)
        self._states[seq.seq_id] = _Draft(seq.request_id, seq.num_computed_tokens, g, self.layer.greedy(g[None])[0])

    # -- the layer's passes ----------------------------------------------------------------------------------------
    def _run(self, rows: list[tuple[Sequence, int, int]], token_ids: list[int], hidden: torch.Tensor,
             after_store: Callable[[], None] | None) -> torch.Tensor:
        """The layer over chunks ``(seq, start, count)`` (positions laid out as prefill chunks over their block
        tables), reading ``token_ids`` and ``hidden`` row by row; returns its outputs. Writes their K/V."""
        step = row_inputs(self.runner, rows)
        kv = self.runner.kv_caches[self.index]
        sc = self.runner.kv_scale_layers
        scales = (sc[self.index][0], sc[self.index][1]) if sc is not None else (None, None)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=hidden.device)
        return self.layer.forward(ids, hidden, step.positions, step.attention, kv, scales, after_store)

    @torch.inference_mode()
    def after_step(self, order: list[ScheduledSeq], hidden: torch.Tensor, sampled: dict[int, list[SampledToken]],
                   after_kv_store: Callable[[int], None] | None) -> None:
        """The runner's ``after_sample`` hook: the MTP layer over every position this step computed and kept
        (``order``: the step's sequences in batch order, ``hidden`` their final hidden states, ``sampled`` what they
        emitted), then ``after_kv_store(N)`` (a prefill actor streams layer ``N`` from there). Mutates the states."""
        rows: list[tuple[Sequence, int, int]] = []
        token_ids: list[int] = []
        picks: list[int] = []
        off = 0
        for s in order:
            seq, n, off = s.seq, s.num_tokens, off + s.num_tokens
            base = n - len(s.draft)  # the known tokens' rows (then the drafts')
            st = self._states.get(seq.seq_id)
            # a first chunk starts afresh (after a prefix hit the cached blocks carry their MTP K/V); any other
            # must continue where the last pass ended, or the sequence runs without drafts from now on
            if s.start > seq.num_cached_tokens and (st is None or st.done != s.start):
                self._states.pop(seq.seq_id, None)
                continue
            nxt = seq.token_slice(s.start + 1, s.start + base + (0 if s.sample else 1))
            if s.sample:
                toks = sampled.get(seq.seq_id)
                if toks is None:
                    self._states.pop(seq.seq_id, None)
                    continue
                if not seq.pending_children:  # else one token per completion: its last row waits (never drafts)
                    nxt += [t.token_id for t in toks]  # the run a verify emitted, or the one sampled token
            if not nxt:
                continue
            rows.append((seq, s.start, len(nxt)))
            token_ids += nxt
            picks += range(off - n, off - n + len(nxt))
            self._states[seq.seq_id] = _Draft(seq.request_id, s.start + len(nxt))
        index = self.index
        stored = None if after_kv_store is None else functools.partial(after_kv_store, index)
        if not rows:
            if stored is not None:
                stored()
            return
        g = self._run(rows, token_ids, hidden[picks], stored)
        ends, end = [], 0
        for _, _, n in rows:
            end += n
            ends.append(end - 1)
        last = g[ends]
        firsts = self.layer.greedy(last)
        for (seq, _, _), row, tok in zip(rows, last, firsts):
            st = self._states[seq.seq_id]
            st.g, st.first = row, tok

    @torch.inference_mode()
    def complete(self, out: SchedulerOutput) -> None:
        """Mutates ``out``: each scheduled sequence with more than one draft gets drafts 2.. from the layer run on its
        own output (placeholders until now), one chained row per draft, its K/V written at the verify's positions."""
        work = [(i, s) for i, s in enumerate(out.prefills) if len(s.draft) > 1 and s.seq.seq_id in self._states]
        if not work:
            return
        drafts = {i: [s.draft[0]] for i, s in work}
        g = torch.stack([self._states[s.seq.seq_id].g for _, s in work])  # type: ignore[misc]
        for j in range(1, max(len(s.draft) for _, s in work)):
            live = [(w, i, s) for w, (i, s) in enumerate(work) if len(s.draft) > j]
            rows = [(s.seq, s.start + j - 1, 1) for _, _, s in live]
            h = self._run(rows, [drafts[i][-1] for _, i, _ in live], g[[w for w, _, _ in live]], None)
            for (w, i, _), tok, row in zip(live, self.layer.greedy(h), h):
                drafts[i].append(tok)
                g[w] = row
        for i, s in work:
            out.prefills[i] = dataclasses.replace(s, draft=tuple(drafts[i]))
