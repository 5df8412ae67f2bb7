"""A steady decode step reads the device once and builds a bounded number of tensors from Python values (issue 27).

Counted on the CPU, where nothing actually waits: every call that would block the host on a CUDA device (``.item()``,
``.tolist()``, ``.cpu()``, ``bool()``/``int()``/``float()``/``__index__`` of a tensor, ``nonzero``, ``unique``,
``repeat_interleave`` with tensor repeats) and every tensor built from Python values (``torch.tensor``,
``as_tensor``, ``from_numpy``, ...), made from the engine's own code (``engine/`` and ``kernels/``), during the
decode-only steps of a real engine over a mixed batch: greedy, seeded top-p and top-k, min-p, the three penalties,
logprobs, ``n = 2`` and stop strings. The budgets hold at 8 and at 32 sequences: they must not grow with the batch.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine.scheduler import SchedulerOutput

ROOT = Path(__file__).resolve().parents[2]
OWN = tuple(str(ROOT / pkg) + "/" for pkg in ("engine", "kernels"))
# The kernels' torch paths for CPU tensors read values on the host by design (``kernels/__init__.py``: value checks
# "run on CPU tensors only"): on a GPU the Triton kernels serve and these never run. Counted apart, not budgeted.
CPU_ONLY_FILES = tuple(str(ROOT / "kernels" / f) for f in ("reference.py", "cpu_decode.py", "cpu_prefill.py"))
CPU_ONLY_FUNCTIONS = {(str(ROOT / "kernels" / "__init__.py"), "_check_lens")}
# the sampled ids with their logprobs: one read; a second only in a step that redoes a top-p nucleus grown past its
# candidates (engine/sampling_plan.py)
MAX_SYNCS_PER_STEP = 2
MAX_CONSTRUCTIONS_PER_STEP = 12  # host -> device copies of Python values, whatever the batch size

# methods of torch.Tensor that wait for the device on CUDA (a device tensor's value reaches the host)
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "unique", "__bool__", "__int__", "__float__",
                "__index__")
SYNC_FUNCTIONS = ("nonzero", "unique", "unique_consecutive", "argwhere", "masked_select")
CONSTRUCTORS = ("tensor", "as_tensor", "from_numpy", "frombuffer", "asarray")


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


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counts]:
    """Installs the counting wrappers for the ``with`` block; counts only while ``Counts.on``."""
    counts = Counts()
    for name in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, _wrap(counts, counts.syncs, name, getattr(torch.Tensor, name)))
    for name in SYNC_FUNCTIONS:
        monkeypatch.setattr(torch, name, _wrap(counts, counts.syncs, name, getattr(torch, name)))
    monkeypatch.setattr(torch, "repeat_interleave", _wrap(counts, counts.syncs, "repeat_interleave",
                                                          torch.repeat_interleave, _tensor_repeats))
    monkeypatch.setattr(torch.Tensor, "repeat_interleave",
                        _wrap(counts, counts.syncs, "repeat_interleave", torch.Tensor.repeat_interleave,
                              _tensor_repeats))
    for name in CONSTRUCTORS:
        monkeypatch.setattr(torch, name, _wrap(counts, counts.constructions, name, getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "new_tensor", _wrap(counts, counts.constructions, "new_tensor",
                                                          torch.Tensor.new_tensor))
    yield counts


def mixed_params(i: int) -> SamplingParams:
    """The i-th request of the mixed batch: every sampling feature the sampler has, in turn."""
    kinds = [
        dict(),  # greedy
        dict(temperature=0.8, top_p=0.9, seed=11 + i),
        dict(temperature=1.0, top_k=20, seed=23 + i),
        dict(temperature=1.0, min_p=0.1),
        dict(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, seed=5 + i),
        dict(logprobs=3),
        dict(temperature=1.0, top_p=0.95, top_k=50, seed=7 + i, n=2, logprobs=1),
        dict(temperature=0.5, stop=["zq", "xv"], repetition_penalty=1.1),
    ]
    return SamplingParams(max_tokens=40, ignore_eos=True, **kinds[i % len(kinds)])


def run_counted(eng: LLMEngine, num_seqs: int, monkeypatch: pytest.MonkeyPatch, steps: int = 6
                ) -> tuple[list[tuple[int, int]], Counts]:
    """Adds a mixed batch of ``num_seqs`` sequences, runs it until every prompt is prefilled and every child forked,
    then counts ``steps`` decode-only steps. Returns ((reads, constructions) of each step counted, the counts by
    call site). Mutates the engine."""
    added, i = 0, 0
    while added < num_seqs:
        p = mixed_params(i)
        if added + p.n > num_seqs:
            p = SamplingParams(max_tokens=40, ignore_eos=True)
        eng.add_request(f"r{num_seqs}-{i}", [(7 * i + j) % 300 + 1 for j in range(5 + i % 9)], p)
        added, i = added + p.n, i + 1
    real_execute = eng.runner.execute
    per_step: list[tuple[int, int]] = []
    with counting(monkeypatch) as counts:
        def execute(out: SchedulerOutput, *a: Any) -> Any:
            steady = not out.prefills and len(out.decodes) == num_seqs
            before = sum(counts.syncs.values()), sum(counts.constructions.values())
            counts.on = steady
            try:
                return real_execute(out, *a)
            finally:
                counts.on = False
                if steady:
                    per_step.append((sum(counts.syncs.values()) - before[0],
                                     sum(counts.constructions.values()) - before[1]))

        monkeypatch.setattr(eng.runner, "execute", execute)
        eng.step()  # the prefill: parents sample their first tokens, children fork
        eng.step()  # the children's first decode (their slots join)
        per_step.clear()
        counts.clear()
        for _ in range(steps):
            eng.step()
        monkeypatch.setattr(eng.runner, "execute", real_execute)
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_integrity()
    return per_step, counts


@pytest.fixture(scope="module", params=["grouped", "padded"])
def engine(request: pytest.FixtureRequest, tiny_checkpoint: Any) -> LLMEngine:
    """The CPU's grouped decode path, and the padded persistent buffers of the CUDA-graph path run eagerly."""
    eng = LLM(str(tiny_checkpoint("llama")), dtype="float32", block_size=16, num_kv_blocks=256,
              max_num_seqs=32).engine
    if request.param == "padded":
        eng.runner.enable_decode_graphs(32, eng.max_model_len, capture=False)
    return eng


@pytest.mark.parametrize("num_seqs", [8, 32])
def test_a_steady_decode_step_reads_the_device_once(engine: LLMEngine, num_seqs: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    per_step, counts = run_counted(engine, num_seqs, monkeypatch)
    assert len(per_step) >= 4, "the batch must stay whole for the counted steps"
    report = (f"{num_seqs} seqs, (reads, constructions) per step {per_step}: reads {dict(counts.syncs)}; "
              f"constructions {dict(counts.constructions)}; CPU-only kernel reads {dict(counts.cpu_only)}")
    print(report)
    assert min(r for r, _ in per_step) >= 1, "the sampled ids are read every step: the counter must see it\n" + report
    assert max(r for r, _ in per_step) <= MAX_SYNCS_PER_STEP, report
    assert max(c for _, c in per_step) <= MAX_CONSTRUCTIONS_PER_STEP, report


def test_the_counter_sees_engine_calls_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read from a test frame is not counted; one from engine code is (through the sampler's one read)."""
    from engine.sampler import _to_host

    with counting(monkeypatch) as counts:
        counts.on = True
        torch.ones(3).tolist()
        assert not counts.syncs
        _to_host(torch.zeros(3, dtype=torch.float64))
        assert sum(counts.syncs.values()) == 1
