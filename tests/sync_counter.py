"""Counting a decode step's host reads on the CPU, and the mixed batch they are counted over (issue 27).

One copy, shared by ``tests/unit/test_sync_budget.py`` (the budgets, in CI) and ``scripts/gpu_sync_check.py`` (its
``--smoke`` path; on CUDA it counts torch's own sync warnings instead, over the same batch and steps).

On the CPU nothing actually waits, so :func:`counting` wraps every call that would block the host on a CUDA device
(``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``/``int()``/``float()``/``__index__`` of a tensor, ``nonzero``,
``unique``, ``repeat_interleave`` with tensor repeats) and every tensor built from Python values (``torch.tensor``,
``as_tensor``, ``from_numpy``, ...), and counts those made from the engine's own code (``engine/`` and ``pdkernels/``).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from engine import SamplingParams
from engine.llm_engine import LLMEngine
from engine.scheduling.scheduler import SchedulerOutput

ROOT = Path(__file__).resolve().parents[1]
OWN = tuple(str(ROOT / pkg) + "/" for pkg in ("engine", "pdkernels"))
# The kernels' torch paths for CPU tensors read values on the host by design (``pdkernels/__init__.py``: value checks
# "run on CPU tensors only"): on a GPU the Triton kernels serve and these never run. Counted apart, not budgeted.
CPU_ONLY_FILES = tuple(str(ROOT / "pdkernels" / f) for f in ("reference.py", "cpu_decode.py", "cpu_prefill.py"))
CPU_ONLY_FUNCTIONS = {(str(ROOT / "pdkernels" / "__init__.py"), "_check_lens")}
# the sampled ids with their logprobs: one read; a second only in a step that redoes a top-p nucleus grown past its
# candidates (engine/sampling/sampling_plan.py)
MAX_SYNCS_PER_STEP = 2
MAX_CONSTRUCTIONS_PER_STEP = 12  # host -> device copies of Python values, whatever the batch size

# methods of torch.Tensor that wait for the device on CUDA (a device tensor's value reaches the host)
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "unique", "__bool__", "__int__", "__float__",
                "__index__")
SYNC_FUNCTIONS = ("nonzero", "unique", "unique_consecutive", "argwhere", "masked_select")
CONSTRUCTORS = ("tensor", "as_tensor", "from_numpy", "frombuffer", "asarray")

T = TypeVar("T")


class Counts:
    """What one counted stretch of code did, by call name; mutated by the wrappers while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.syncs: Counter[str] = Counter()
        self.constructions: Counter[str] = Counter()
        self.cpu_only: Counter[str] = Counter()  # reads by the kernels' CPU-only paths (see CPU_ONLY_FILES)

    def clear(self) -> None:
        """Mutates: forgets every count."""
        for kind in (self.syncs, self.constructions, self.cpu_only):
            kind.clear()

    def totals(self) -> tuple[int, int]:
        """(reads, constructions) counted so far. Pure."""
        return sum(self.syncs.values()), sum(self.constructions.values())

    def record(self, kind: Counter[str], name: str) -> None:
        """Mutates ``kind`` (or ``cpu_only``) when counting and the caller two frames up (the wrapped call's caller)
        is ours."""
        if not self.on:
            return
        code = sys._getframe(2).f_code
        if not code.co_filename.startswith(OWN):
            return
        where = f"{name} @ {Path(code.co_filename).name}:{sys._getframe(2).f_lineno}"
        cpu_only = code.co_filename in CPU_ONLY_FILES or (code.co_filename, code.co_name) in CPU_ONLY_FUNCTIONS
        (self.cpu_only if cpu_only and kind is self.syncs else kind)[where] += 1


def _wrap(counts: Counts, kind: Counter[str], name: str, real: Callable[..., Any],
          counted: Callable[..., bool] = lambda *a, **k: True) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if counted(*args, **kwargs):
            counts.record(kind, name)
        return real(*args, **kwargs)

    return wrapper


def _tensor_repeats(*args: Any, **kwargs: Any) -> bool:
    """repeat_interleave syncs (to size its output) when the repeats are a tensor of more than one value."""
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
    return isinstance(repeats, torch.Tensor) and repeats.numel() > 1


_MISSING = object()


@contextmanager
def counting() -> Iterator[Counts]:
    """Installs the counting wrappers on ``torch`` and ``torch.Tensor`` for the ``with`` block (restored after, as
    found: an attribute ``torch.Tensor`` only inherited is deleted again); counts only while ``Counts.on``."""
    counts = Counts()
    patches: list[tuple[Any, str, Callable[..., Any]]] = []
    for name in SYNC_METHODS:
        patches.append((torch.Tensor, name, _wrap(counts, counts.syncs, name, getattr(torch.Tensor, name))))
    for name in SYNC_FUNCTIONS:
        patches.append((torch, name, _wrap(counts, counts.syncs, name, getattr(torch, name))))
    for owner in (torch, torch.Tensor):
        patches.append((owner, "repeat_interleave", _wrap(counts, counts.syncs, "repeat_interleave",
                                                           owner.repeat_interleave, _tensor_repeats)))
    for name in CONSTRUCTORS:
        patches.append((torch, name, _wrap(counts, counts.constructions, name, getattr(torch, name))))
    patches.append((torch.Tensor, "new_tensor", _wrap(counts, counts.constructions, "new_tensor",
                                                      torch.Tensor.new_tensor)))
    saved = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in patches]
    try:
        for owner, name, wrapper in patches:
            setattr(owner, name, wrapper)
        yield counts
    finally:
        for owner, name, old in reversed(saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def mixed_params(i: int, max_tokens: int = 40) -> SamplingParams:
    """The i-th request of the mixed batch: every sampling feature the sampler has, in turn."""
    kinds: list[dict[str, Any]] = [
        dict(),  # greedy
        dict(temperature=0.8, top_p=0.9, seed=11 + i),
        dict(temperature=1.0, top_k=20, seed=23 + i),
        dict(temperature=1.0, min_p=0.1),
        dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, seed=5 + i),
        dict(logprobs=3),
        dict(temperature=1.0, top_p=0.95, top_k=50, seed=7 + i, n=2, logprobs=1),
        dict(temperature=0.5, stop=["zq", "xv"], repetition_penalty=1.1),
    ]
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kinds[i % len(kinds)])


def add_mixed_batch(eng: LLMEngine, num_seqs: int, max_tokens: int = 40) -> None:
    """Mutates ``eng``: adds requests of :func:`mixed_params` (short prompts below id 301) until they make
    ``num_seqs`` sequences (``n = 2`` counts twice; a plain request fills the last place when a pair would not fit)."""
    added, i = 0, 0
    while added < num_seqs:
        p = mixed_params(i, max_tokens)
        if added + p.n > num_seqs:
            p = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        eng.add_request(f"r{num_seqs}-{i}", [(7 * i + j) % 300 + 1 for j in range(5 + i % 9)], p)
        added, i = added + p.n, i + 1


def run_steady(eng: LLMEngine, num_seqs: int, steps: int, measure: Callable[[Callable[[], Any]], T],
               max_tokens: int = 40) -> list[T]:
    """Adds a mixed batch of ``num_seqs`` sequences, runs it until every prompt is prefilled and every child forked,
    then runs ``steps`` more steps, each decode-only step of the whole batch (the runner's ``execute``, where all of
    a step's device work is) through ``measure(execute)``, which must call ``execute()`` once and return what it
    measured. Runs the batch to its end and checks the engine's integrity. Returns the measures, one per steady step
    (fewer than ``steps`` when a stop string ended a sequence). Mutates the engine."""
    add_mixed_batch(eng, num_seqs, max_tokens)
    eng.step()  # the prefill: parents sample their first tokens, children fork
    eng.step()  # the children's first decode (their slots join)
    measures: list[T] = []
    inherited = "execute" not in vars(eng.runner)  # (the class's method: restored by deleting the wrapper)
    real_execute = eng.runner.execute

    def execute(out: SchedulerOutput, *a: Any) -> Any:
        if out.prefills or len(out.decodes) != num_seqs:
            return real_execute(out, *a)
        result: list[Any] = []
        measures.append(measure(lambda: result.append(real_execute(out, *a))))
        assert len(result) == 1, "measure must run the step exactly once"
        return result[0]

    eng.runner.execute = execute  # type: ignore[method-assign]
    try:
        for _ in range(steps):
            eng.step()
    finally:
        if inherited:
            del eng.runner.execute
        else:
            eng.runner.execute = real_execute  # type: ignore[method-assign]
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_integrity()
    return measures
