"""The engine loop: ``schedule() -> runner.execute() -> update_from_output()`` plus detokenization and stops."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence as Sequence_
from typing import Any
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.models.default_model import resolve_model
from engine.completion_progress import CompletionProgress
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.engine_tokenizer import EngineTokenizer
from engine.device import num_kv_blocks, resolve_device, resolve_dtype
from engine.sampling.grammar import GrammarCompiler, GrammarError
from engine.scheduling.kv_cache_manager import KVCacheManager, cdiv
from engine.models.model import DecoderModel
from engine.models.model_config import load_model_config
from engine.kv.tiers.keys import ModelIdentity
from engine.models.model_loader import load_shard, load_state_dict, model_fingerprint
from engine.model_runner import DTYPES, KV_DTYPES, ModelRunner, kv_block_bytes
from engine.request.outputs import RequestOutput
from engine.sampling.philox import derive_seed
from engine.kv.prefix_events import PrefixEventLog
from engine.sampling.sampling_grammar import GrammarMasks
from engine.request.sampling_params import SamplingParams
from engine.scheduling.scheduler import SampledToken, Scheduler, SchedulerConfig, SchedulerOutput
from engine.request.sequence import Sequence, seq_id_counter
from engine.spec.spec_decode import SpeculativeDecoder
from engine.spec.spec_draft_model import DraftModelDrafter, resolve_draft
from engine.spec.spec_mtp import MTPDrafter, MTPLayer
from engine.parallel.tp_group import TPGroup, check_device, start_group, visible_gpus


def captures_decode_graphs(device: torch.device, config: EngineConfig) -> bool:
    """Whether an engine captures decode CUDA graphs at start: on CUDA, unless ``enforce_eager`` or a prefill-only
    engine (``decode_graphs=False``). Pure."""
    return (device.type == "cuda" and not config.enforce_eager and config.decode_graphs
            and config.tensor_parallel_size == 1)


def _token_indices(updated: list[Sequence]) -> list[tuple[Sequence, int]]:
    """``(sequence, output index)`` of each token a step appended: ``updated`` names a sequence once per token, in
    order (a speculative step appends several). Pure."""
    left: dict[int, int] = {}
    for seq in updated:
        left[seq.seq_id] = left.get(seq.seq_id, 0) + 1
    out = []
    for seq in updated:
        out.append((seq, len(seq.output_token_ids) - left[seq.seq_id]))
        left[seq.seq_id] -= 1
    return out


def _prompt_logprobs(seq: Sequence) -> list[dict[int, float] | None] | None:
    """What an output says of the prompt's logprobs: all of them (the first None) once computed here, else None.
    Pure (a new list each time: O(prompt), and only for requests that ask)."""
    if seq.params.prompt_logprobs is None or seq.needs_prompt_logprobs:
        return None
    return [None, *seq.prompt_logprobs]


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    progress: list[CompletionProgress] = field(default_factory=list)  # per completion: text, what outputs handed out
    prompt_logprobs_out: bool = False  # an output has carried the prompt logprobs (later running ones do not)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    """A single-process engine. ``add_request`` / ``abort_request`` / ``step`` mutate; nothing runs in the background."""

    def __init__(self, config: EngineConfig, progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        path = resolve_model(config.model, config.cache_dir, progress)
        self.model_path = path
        self.model_config = mc = load_model_config(path)
        self._tokens = EngineTokenizer(path, config.cache_dir)  # transformers' tokenizer only where needed
        self._decoder = self._tokens.decoder  # the detokenizers' decode: the Rust backend where equal
        self.bind_threads()
        self.device = resolve_device(config.device)
        dtype_name = resolve_dtype(config.dtype, self.device)
        dtype = DTYPES[dtype_name]
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.fingerprint = model_fingerprint(path, dtype_name)
        # tensor parallel: this process drives rank 0 of a group it starts (engine/parallel/tp_group.py); every rank reads
        # only its part of the checkpoint
        self.tp_group: TPGroup | None = None
        if config.tensor_parallel_size > 1:
            # refused before any weight is read
            check_device(self.device, config.tensor_parallel_size, config.tp_kv_cache, visible_gpus())
            shard = load_shard(path, mc, dtype, 0, config.tensor_parallel_size, self.device)
            self.tp_group, model = start_group(mc, shard, path, dtype, self.max_model_len, config, self.device, progress)
        else:
            state = load_state_dict(path, dtype, self.device)
            model = DecoderModel(mc, state, dtype, self.max_model_len)
        spec = config.speculative_config
        # method "mtp": the checkpoint's next-token layer (what the model left of the state), its K/V one more layer
        mtp = MTPLayer.load(model, state) if spec is not None and spec.method == "mtp" else None
        mtp_layers = 0 if mtp is None else 1
        # method "draft_model": its own K/V beside the pool's, on the same block tables (sized with it)
        draft = resolve_draft(spec.model, config.cache_dir, progress) if spec and spec.method == "draft_model" \
            else None
        kv_dtype = KV_DTYPES.get(config.kv_cache_dtype, dtype)
        graphs = captures_decode_graphs(self.device, config) and mtp is None  # its pass reads the eager hidden
        num_blocks = config.num_kv_blocks or num_kv_blocks(
            self.device, model, config.kv_cache_gib, config.gpu_memory_utilization, config.max_num_batched_tokens,
            config.max_num_seqs, self.max_model_len, config.block_size, kv_dtype,
            kv_block_bytes(model.local if config.tp_kv_cache == "per_rank"
                           else dataclasses.replace(mc, num_layers=mc.num_layers + mtp_layers), config.block_size,
                           kv_dtype) + (0 if draft is None else kv_block_bytes(load_model_config(draft),
                                                                              config.block_size, dtype)),
            graphs, config.reserved_device_bytes)
        # the key binds the model's identity (engine/kv/tiers/keys.py): another checkpoint, dtype, K/V dtype, block
        # size or TP layout never shares a block
        extra = ModelIdentity(self.fingerprint, dtype_name, config.kv_cache_dtype, config.block_size,
                              config.tensor_parallel_size, config.tp_kv_cache).extra()
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, extra)
        self.prefix_hash_extra = extra  # what block hashes bind besides tokens: a router hashes prompts with it
        # what the prefix cache gains and loses, for routers in other processes
        self.prefix_events = PrefixEventLog()
        self.kv.pool.events = self.prefix_events
        eos = self._tokens.eos_token_id
        self.eos_token_ids = frozenset(mc.eos_token_ids) | frozenset(() if eos is None else (eos,))
        sched_cfg = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.scheduler = Scheduler(sched_cfg, self.kv, self.eos_token_ids)
        tp = self.tp_group
        per_rank = tp is not None and config.tp_kv_cache == "per_rank"
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.seed, kv_dtype,
                                  config.shared_kv or (tp is not None and not per_rank),
                                  model.local.cache_heads if per_rank else None,
                                  tp.copy_blocks if tp is not None and per_rank else None, mtp_layers)
        self.runner.sampling.eos_token_ids = self.eos_token_ids  # what a row short of its min_tokens may not draw
        if per_rank:  # each follower allocates its own heads' cache, laid out as rank 0's
            tp.own_caches(self.runner.layout)
        elif tp is not None:  # the followers map the cache file (each rank's model attends over its heads of it)
            tp.share_cache(self.runner.shared_kv)
        if graphs:
            self.enable_decode_graphs()
        self._ids = seq_id_counter()
        self._num_unseeded = 0  # unseeded requests so far: the counter derive_seed mixes with config.seed
        self._requests: dict[str, _Request] = {}
        self.last_preempted: list[str] = []  # request ids the last step preempted (to recompute later)
        self._grammars: GrammarCompiler | None = None  # see grammar_compiler()
        # speculative decoding (engine/spec/spec_decode.py): drafts proposed before each step, verified in it
        drafter: MTPDrafter | DraftModelDrafter | None = None
        if mtp is not None:
            drafter = MTPDrafter(mtp, self.runner)
            self.runner.after_sample = drafter.after_step
        elif draft is not None:
            drafter = DraftModelDrafter(draft, self.tokenizer, mc.vocab_size, self.runner, self.max_model_len)
        self.spec = SpeculativeDecoder(spec, drafter) if spec else None

    @property
    def tokenizer(self) -> Any:
        """``AutoTokenizer``'s tokenizer, loaded at first use where the engine started without it (engine_tokenizer)."""
        return self._tokens.hf

    def enable_decode_graphs(self) -> bool:
        """Mutates: capture the decode CUDA graphs now, if this engine decodes with graphs (CUDA, not
        ``enforce_eager``) and has none yet: a prefill-role engine skipped them at start, and a flexible actor that
        becomes a decoder calls this. Its KV cache is sized already, so they take what is left; if that is too little
        the capture fails and decode runs eagerly (``runner.decode_graphs.capture_error`` says why). Returns whether
        graphs are (now) in use."""
        if not captures_decode_graphs(self.device, dataclasses.replace(self.config, decode_graphs=True)):
            return False
        if self.runner.decode_graphs is None:
            self.runner.enable_decode_graphs(self.config.max_num_seqs, self.max_model_len, capture=True)
        graphs = self.runner.decode_graphs
        return graphs is not None and not getattr(graphs, "capture_error", None)

    # -- requests -----------------------------------------------------------------------------------------------
    def bind_threads(self) -> None:
        """Apply ``config.num_threads`` (when set) to the calling thread. OpenMP keeps its thread count per thread, and
        oneDNN's matmuls read the calling thread's: a thread other than the one that built the engine (a worker's
        engine loop) must call this before it steps, or its matmuls run on ``OMP_NUM_THREADS`` threads (Ray sets the
        actor's CPUs) while torch's own parallel loops use ``num_threads``."""
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids for a prompt given as text or ids; raises ``ValueError`` on an empty or invalid prompt. Pure."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt: token id {bad[0]!r} outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("prompt: must not be empty")
        return ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the field and the limit if this request can never run. Pure."""
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens, but the model's context is {self.max_model_len} tokens "
                "(including at least one generated token)"
            )
        need = cdiv(n + 1, self.config.block_size)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"prompt: needs {need} KV blocks, the cache has {self.kv.pool.num_blocks}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n: {params.n} exceeds max_num_seqs {self.config.max_num_seqs}")
        if params.grammar is not None:
            try:
                self.grammar_compiler().grammar(params.grammar)
            except GrammarError as e:
                raise ValueError(f"grammar: {params.grammar.kind} does not compile: {e}") from None

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler (built at the first constrained request: ~1 s for a large vocabulary), its
        matchers installed in the runner's sampling state. Mutates on first call."""
        if self._grammars is None:
            compiler = GrammarCompiler(self.tokenizer, self.runner.sampling.vocab_size, self.eos_token_ids)
            self.runner.sampling.grammars = GrammarMasks(compiler)
            self._grammars = compiler
        return self._grammars

    def effective_seed(self, params: SamplingParams) -> int:
        """The seed a request samples with: ``params.seed``, or for an unseeded request one derived from
        ``config.seed`` and a count of unseeded requests (so a whole offline run reproduces). Mutates that count.

        Sampling draws are keyed by (seed, completion index, token position) only: to continue a request elsewhere
        with the same draws (prefill actor -> decode actor), give both the same ``SamplingParams.seed``."""
        if params.seed is not None:
            return params.seed
        self._num_unseeded += 1
        return derive_seed(self.config.seed, self._num_unseeded - 1)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
        arrival: float | None = None, block_ids: list[int] | None = None, output_prefix: list[int] | None = None,
        prefix_logprobs: list[dict[int, float]] | None = None, choice_index: int = 0,
    ) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises ``ValueError`` (changing nothing) if it is invalid.

        ``block_ids``: blocks already allocated for this request in this engine's pool (a committed reservation);
        the request takes them over and computes its prompt into them, except for the longest cached prefix, whose
        cached blocks replace the first reserved ones (those go back to the pool). With
        ``n > 1`` the children fork from these blocks and allocate their own as they grow.
        ``output_prefix``: tokens already generated elsewhere (a completion resumed off a dead decode actor): they
        count as output, are recomputed with the prompt, and generation continues after them; ``prefix_logprobs``
        are their logprobs, kept so the logprobs stay aligned with the tokens. ``choice_index``: which completion of
        the client's request this one is (``n == 1``): its outputs carry that index and its draws are keyed by it,
        so a resumed seeded completion draws exactly what it would have drawn where it started.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        self.validate(ids, params)
        params = params.for_prompt(len(ids), self.max_model_len)  # max_tokens None: the rest of the context
        arrival = time.monotonic() if arrival is None else arrival
        seed = self.effective_seed(params)  # one per request: its completions differ by their index in the key
        if (output_prefix or choice_index) and params.n != 1:
            raise ValueError(f"n: a resumed completion (output_prefix, choice_index) has n == 1, got {params.n}")
        if output_prefix and len(output_prefix) >= params.max_tokens:
            raise ValueError(f"output_prefix: {len(output_prefix)} tokens leave nothing of max_tokens "
                             f"{params.max_tokens}")
        if not isinstance(choice_index, int) or choice_index < 0:
            raise ValueError(f"choice_index: must be an int >= 0, got {choice_index!r}")
        seqs = [
            Sequence(
                seq_id=next(self._ids), request_id=request_id, index=choice_index + i, prompt_token_ids=ids,
                params=params, arrival=arrival, priority=priority, seed=seed,
            )
            for i in range(params.n)
        ]
        seqs[0].pending_children = seqs[1:]
        if output_prefix:
            seqs[0].output_token_ids = list(output_prefix)
            if params.logprobs is not None:
                seqs[0].output_logprobs = list(prefix_logprobs or [{} for _ in output_prefix])
        if block_ids is not None:
            self._adopt_reserved(seqs[0], block_ids, 0)
        detoks = [IncrementalDetokenizer(self._decoder, ids, params.skip_special_tokens) for _ in seqs]
        # a resumed completion's prefix is output like new tokens: its first output hands the prefix out again
        prefix_text = "".join(detoks[0].add_token(t) for t in (output_prefix or []))
        progress = [CompletionProgress(params.stop_strings, prefix_text if i == 0 else "") for i in range(len(seqs))]
        self._requests[request_id] = _Request(request_id, ids, seqs, detoks, progress)
        self.scheduler.add(seqs[0])
        return ids

    def add_prefilled_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, first_tokens: list[int],
        block_ids: list[int], first_logprobs: list[dict[int, float]] | None = None, arrival: float | None = None,
        pinned: int = 0, draft_state: Sequence_[float] | None = None,
    ) -> RequestOutput:
        """Decode side of disaggregation: join a request whose prompt K/V already sits in ``block_ids`` (allocated
        in this engine's pool, e.g. a committed reservation) and whose first tokens were sampled by a prefill actor:
        one per completion (``params.n``), with their logprobs when asked for.

        Takes ownership of the blocks; with ``n > 1`` the completions share the prompt's blocks copy-on-write and the
        blocks past the prompt go back to the pool (each completion allocates its own as it grows). Returns the
        output after the first tokens (finished if they already stop). Raises ``ValueError`` (changing nothing) if
        the request is invalid. ``pinned``: the first blocks are this engine's prefix-cache blocks (held with one
        reference each, which passes to the request), the rest fresh. ``draft_state``: what a next-token (MTP)
        drafter drafts from at the first step (:meth:`draft_state` on the prefill side; ignored without one).
        """
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if len(first_tokens) != params.n:
            raise ValueError(f"first_tokens: {len(first_tokens)} for n = {params.n} completions")
        if first_logprobs is not None and len(first_logprobs) != params.n:
            raise ValueError(f"first_logprobs: {len(first_logprobs)} for n = {params.n} completions")
        ids = list(prompt_token_ids)
        self.validate(ids, params)
        params = params.for_prompt(len(ids), self.max_model_len)
        seed = self.effective_seed(params)
        arrival = time.monotonic() if arrival is None else arrival
        seqs = [Sequence(seq_id=next(self._ids), request_id=request_id, index=i, prompt_token_ids=ids, params=params,
                         arrival=arrival, seed=seed) for i in range(params.n)]
        self._adopt_reserved(seqs[0], block_ids, len(ids), pinned)
        drafter = None if self.spec is None else self.spec.drafter
        if drafter is not None and draft_state is not None and params.n == 1:
            drafter.adopt(seqs[0], draft_state)
        req = _Request(request_id, ids, seqs,
                       [IncrementalDetokenizer(self._decoder, ids, params.skip_special_tokens) for _ in seqs],
                       [CompletionProgress(params.stop_strings) for _ in seqs])
        self._requests[request_id] = req
        self.scheduler.add_running(seqs[0])
        for child in seqs[1:]:
            self.kv.fork(seqs[0], child)
            self.scheduler.add_running(child)
        for i, seq in enumerate(seqs):
            self.scheduler.append_token(seq, SampledToken(first_tokens[i], None if first_logprobs is None
                                                          else first_logprobs[i]))
            self._detokenize(req, seq)
        out = self._output(req)
        if req.finished:
            del self._requests[request_id]
        return out

    def _adopt_reserved(self, parent: Sequence, block_ids: list[int], num_computed_tokens: int,
                        pinned: int = 0) -> None:
        """Mutates: ``parent`` takes over blocks reserved for its request. With ``n > 1`` it keeps only the prompt's:
        its children will share every block it holds, and copy-on-write copies only a table's last block, so a
        shared block past the prompt would be written by every completion; the rest go back to the pool."""
        n = parent.params.n
        keep = len(block_ids) if n == 1 else cdiv(len(parent.prompt_token_ids), self.config.block_size)
        if num_computed_tokens:  # K/V received for the whole prompt (its head maybe from this prefix cache)
            self.kv.adopt(parent, block_ids[:keep], num_computed_tokens, pinned)
        else:  # computed here (colocated, recompute): a cached prefix still counts
            self.kv.adopt_with_prefix(parent, block_ids[:keep])
        self.kv.pool.free(self.kv.pool.blocks[b] for b in reversed(block_ids[keep:]))

    def draft_state(self, request_id: str) -> tuple[float, ...] | None:
        """What a decode owner's drafter needs to draft at its first step for ``request_id`` (just prefilled here):
        the MTP layer's last output (engine/spec/spec_mtp.py), or None without one. Pure."""
        drafter = None if self.spec is None else self.spec.drafter
        return None if drafter is None else drafter.handoff(request_id)

    @property
    def num_cache_layers(self) -> int:
        """Layers of the K/V pool: the model's, and a next-token (MTP) layer's (a prefill actor streams them all)."""
        return self.runner.layout.num_layers

    def kv_layer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s KV cache ``[2, num_blocks, block_size, kv_heads, head_dim]``, every head (a view: writes
        go through; a tensor-parallel group's ranks each use their heads' slice of it)."""
        return self.runner.kv_caches[layer]

    def close(self) -> None:
        """Mutates: stops a tensor-parallel group's follower ranks (nothing else holds processes). Idempotent."""
        if self.tp_group is not None:
            self.tp_group.close()

    def kv_memory(self) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """``(kv, scales, shared)``: the whole KV cache ``[layers, 2, blocks, block_size, kv_heads, head_dim]``, an
        FP8 cache's scales, and the :class:`engine.kv.kv_memory.SharedKVMemory` holding them (``shared_kv`` on the CPU)
        or None: what an in-place KV backend exports to same-node writers."""
        return self.runner.kv, self.runner.kv_scales, self.runner.shared_kv

    def kv_layer_scales(self, layer: int) -> torch.Tensor | None:
        """Layer ``layer``'s scales (a view: FP8 ``[2, num_blocks, kv_heads]``, int8 ``[2, num_blocks, block_size,
        kv_heads]``), or None for an unquantized cache."""
        return None if self.runner.kv_scale_layers is None else self.runner.kv_scale_layers[layer]

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks. Unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # -- the loop -----------------------------------------------------------------------------------------------
    def step(self, after_kv_store: Callable[[int, SchedulerOutput], None] | None = None) -> list[RequestOutput]:
        """Run one scheduler step; return the outputs of requests that advanced (finished ones are dropped). Each output
        carries what is new since the request's previous one, and whole completions once finished (``engine.request.outputs``).

        ``after_kv_store(layer, scheduler_output)`` runs as soon as each layer's K/V of this step is stored (a
        prefill worker streams it to the decode actor from there).
        """
        drafts = None if self.spec is None else self.spec.propose(self.scheduler.running)
        out = self.scheduler.schedule(drafts)
        if self.spec is not None:
            self.spec.complete(out)
        self.last_preempted = [s.request_id for s in out.preempted]
        hook = None if after_kv_store is None else (lambda layer: after_kv_store(layer, out))
        sampled = self.runner.execute(out, hook)
        ends = self.runner.sampling.grammar_ends()  # their tokens of this step are dropped: they end here
        for seq_id in ends:
            sampled.pop(seq_id, None)
        if self.spec is not None:
            self.spec.observe(out, sampled)
        updated, finished = self.scheduler.update_from_output(out, sampled)
        finished += self._end_at_grammar(out, ends)
        touched: dict[str, _Request] = {}
        for seq, i in _token_indices(updated):
            req = self._requests[seq.request_id]
            if i < len(seq.output_token_ids):  # else cut off by a stop string earlier in this step's run
                self._detokenize(req, seq, i)
            touched[req.request_id] = req
        for seq in finished:
            touched.setdefault(seq.request_id, self._requests[seq.request_id])
        results = []
        for req in touched.values():
            results.append(self._output(req))
            if req.finished:
                del self._requests[req.request_id]
        return results

    def _end_at_grammar(self, out: SchedulerOutput, ends: dict[int, Any]) -> list[Sequence]:
        """Mutates: retire the scheduled sequences whose grammar let them go no further (``ends``: seq id ->
        ``GrammarEnd``), with its finish reason and error (a parent's unforked children too). Returns them."""
        done = []
        for s in out.scheduled:
            end = ends.get(s.seq.seq_id)
            if end is None or s.seq.is_finished:
                continue
            for seq in (s.seq, *s.seq.pending_children):
                seq.finish_error = end.error
                done.append(seq)
            self.scheduler.finish(s.seq, end.finish_reason)
        return done

    def _detokenize(self, req: _Request, seq: Sequence, at: int = -1) -> None:
        """Mutates: output token ``at`` (the last by default; a speculative step appends several, detokenized in
        order) goes through the detokenizer and the stop strings. A stop string ends the completion there: tokens
        after ``at`` are dropped, as if never sampled."""
        i = seq.index - req.seqs[0].index  # position in the request (a resumed completion keeps its client index)
        detok = req.detoks[i]
        at = at % len(seq.output_token_ids)
        last = at == len(seq.output_token_ids) - 1
        tok, p = seq.output_token_ids[at], seq.params
        stopped_by_token = last and seq.finish_reason == "stop" and (
            tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids))
        # a stop token ends the text without adding its own (as vLLM's server does); its id stays in token_ids
        delta = "" if stopped_by_token else detok.add_token(tok)
        if seq.is_finished and last:
            delta += detok.finish()
        # within min_tokens no stop string ends (vLLM's rule: that text is not searched, later text may complete one);
        # token ``at`` is output token at + 1
        if req.progress[i].append(delta, check_stops=at + 1 > p.min_tokens):  # a stop string: cut where it begins
            if not last:
                del seq.output_token_ids[at + 1:]
                del seq.output_logprobs[at + 1:]
            self.scheduler.finish(seq, "stop")
            seq.finish_reason = "stop"  # also when the same token hit max_tokens: the stop string wins

    def _output(self, req: _Request) -> RequestOutput:
        """Mutates what ``req``'s outputs have handed out: each completion's output carries what is new since its
        previous one (O(new tokens)), and the whole completion once finished; the prompt logprobs (when asked) come
        with the first output after the prompt is computed and with the finished one."""
        outs = [req.progress[k].output(s) for k, s in enumerate(req.seqs)]
        prompt_lps = None if req.prompt_logprobs_out and not req.finished else _prompt_logprobs(req.seqs[0])
        req.prompt_logprobs_out = req.prompt_logprobs_out or prompt_lps is not None
        return RequestOutput(req.request_id, req.prompt_token_ids, outs, req.finished, req.seqs[0].num_cached_tokens,
                             prompt_lps)

    def snapshot(self, request_id: str) -> RequestOutput | None:
        """The whole output so far of an unfinished request (its visible text), or None for an unknown or finished
        one: O(its length), for a caller that asks; step outputs carry only what is new. Pure."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        outs = [req.progress[k].snapshot(s) for k, s in enumerate(req.seqs)]
        return RequestOutput(req.request_id, req.prompt_token_ids, outs, req.finished, req.seqs[0].num_cached_tokens,
                             _prompt_logprobs(req.seqs[0]))

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if block accounting is inconsistent. Pure."""
        self.scheduler.check_integrity()
