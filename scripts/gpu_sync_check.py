"""Host syncs of a steady decode step on a GPU (issue 27), one prepared run on a CUDA machine, about a minute:

1. A random-weight engine (SmolLM2-135M shape in bfloat16 by default, built on the device; CUDA graphs) runs the mixed
   batch of ``tests/sync_counter.py`` (greedy, seeded top-p and top-k, min-p, the three penalties, logprobs,
   ``n = 2``, stop strings) at batch 8 and 32: prefill, then steady decode steps, each under
   ``torch.cuda.set_sync_debug_mode("warn")``. A step's host reads are the sampler's deliberate ones (calls of
   ``engine.sampling.sampler._to_host``: a pinned copy, then ``Event.synchronize``, which torch does not flag) plus every other
   wait: each "called a synchronizing CUDA operation" warning (torch flags a copy to or from pageable memory, so
   ``.item()``, ``.tolist()``, ``.cpu()`` and ``bool()`` of device tensors, ``nonzero``, ``Stream.synchronize``, a
   pageable host -> device copy) and each ``torch.cuda.synchronize`` or ``Event.synchronize`` outside the deliberate
   read (not flagged by torch, so counted here). Budget: 2 per step (the CPU test's, ``tests/unit/test_sync_budget``).
2. The CPU runs ahead: every other step first queues ~200 ms of GPU work (``torch.cuda._sleep``) on the engine's
   stream, and the host must reach the step's read in under half of that: any wait before the read, flagged or not,
   would sit out the queued work.
3. A probe that torch's flagging works here: ``.item()`` and a pageable ``.cpu()`` are flagged, ``Event.synchronize``
   is not.
4. pytest on the device: ``tests/unit/test_stream_discipline.py -k cuda`` and ``tests/unit/test_sync_budget.py``
   (its CUDA engine too).

Prints a table (batch, host reads per step: max over the steps, budget, PASS/FAIL) and appends it to ``--out`` as it
goes; exits 1 on a FAIL. ``--smoke`` runs the same steps on the CPU with a tiny model, counting with the CPU counter
of ``tests/sync_counter.py`` instead of torch's warnings (no queued GPU work, no pytest): it tests this script in CI
(``scripts/gpu_check.sh --smoke``).

    python scripts/gpu_sync_check.py [--out docs/gpu-results.md]   # on the GPU machine
    python scripts/gpu_sync_check.py --smoke                        # CPU, tiny shape
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

SYNC_WARNING = "called a synchronizing CUDA operation"
BATCHES = (8, 32)
BUSY_MS = 200.0  # GPU work queued before every other step: the host must reach its read well inside it
# the stream discipline's CUDA test and every sync-budget test (its CUDA engine among them)
PYTEST_ARGS = ["tests/unit/test_stream_discipline.py", "tests/unit/test_sync_budget.py", "-k", "cuda or sync_budget"]


@dataclass
class Step:
    """What one steady decode step did on the host."""

    deliberate: int  # the sampler's reads (engine.sampling.sampler._to_host)
    other: list[str]  # every other wait, as "what @ file:line"
    busy: bool  # GPU work was queued ahead of the step
    launch_s: float  # step start -> its first deliberate read (all the step's launches are issued by then)
    wait_s: float  # how long that read waited
    wall_s: float
    events: tuple[Any, Any] | None = None  # CUDA events around the step (GPU time, read after the run)

    @property
    def reads(self) -> int:
        return self.deliberate + len(self.other)


@dataclass
class DeliberateReads:
    """Wraps ``engine.sampling.sampler._to_host`` (:meth:`installed`): counts and times its calls; while one runs, ``inside``
    is True (its own wait is not an "other" one) and the CPU counter, if given, is paused."""

    marks: list[tuple[float, float]] = field(default_factory=list)  # (entered, returned) per call
    inside: bool = False
    counts: Any = None  # tests.sync_counter.Counts on the CPU

    @contextmanager
    def installed(self) -> Iterator[DeliberateReads]:
        import engine.sampling.sampler as sampler

        real = sampler._to_host

        def to_host(packed: torch.Tensor) -> list[float]:
            paused = self.counts is not None and self.counts.on
            if paused:
                self.counts.on = False
            self.inside, t = True, time.perf_counter()
            try:
                return real(packed)
            finally:
                self.inside = False
                self.marks.append((t, time.perf_counter()))
                if paused:
                    self.counts.on = True

        sampler._to_host = to_host
        try:
            yield self
        finally:
            sampler._to_host = real


def _timing(reads: DeliberateReads, t0: float, t1: float) -> tuple[float, float]:
    """(launch, wait) of a step that started at ``t0`` and ended at ``t1``."""
    if not reads.marks:
        return t1 - t0, 0.0
    entered, returned = reads.marks[0]
    return entered - t0, returned - entered


class CudaMeasure:
    """``run_steady``'s measure on CUDA: torch's sync warnings and unflagged explicit waits during the step; every
    other step behind ``busy_cycles`` of queued GPU work."""

    def __init__(self, reads: DeliberateReads, busy_cycles: int) -> None:
        self.reads, self.busy_cycles, self.count = reads, busy_cycles, 0
        self.waits: list[str] = []  # explicit waits seen while measuring
        self.measuring = False

    @contextmanager
    def watching_waits(self) -> Iterator[None]:
        """Wraps ``torch.cuda.synchronize`` and ``torch.cuda.Event.synchronize`` (torch flags neither) to note the
        calls made while measuring, outside the deliberate read."""
        real_sync, real_event = torch.cuda.synchronize, torch.cuda.Event.synchronize

        def note(what: str) -> None:
            if self.measuring and not self.reads.inside:
                caller = sys._getframe(2)
                self.waits.append(f"{what} @ {Path(caller.f_code.co_filename).name}:{caller.f_lineno}")

        def sync(*a: Any, **k: Any) -> None:
            note("torch.cuda.synchronize")
            real_sync(*a, **k)

        def event_sync(ev: Any) -> None:
            note("Event.synchronize")
            real_event(ev)

        torch.cuda.synchronize, torch.cuda.Event.synchronize = sync, event_sync  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.cuda.synchronize, torch.cuda.Event.synchronize = real_sync, real_event  # type: ignore[method-assign]

    def __call__(self, execute: Callable[[], Any]) -> Step:
        busy = self.count % 2 == 1
        self.count += 1
        if busy:
            torch.cuda._sleep(self.busy_cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.reads.marks.clear()
        self.waits.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            self.measuring = True
            t0 = time.perf_counter()
            try:
                execute()
            finally:
                t1 = time.perf_counter()
                self.measuring = False
                torch.cuda.set_sync_debug_mode("default")
        end.record()
        flagged = [f"flagged @ {Path(w.filename).name}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)]
        launch, wait = _timing(self.reads, t0, t1)
        return Step(len(self.reads.marks), flagged + list(self.waits), busy, launch, wait, t1 - t0, (start, end))


class CpuMeasure:
    """``run_steady``'s measure on the CPU (``--smoke``): the CPU counter's reads from engine code (the deliberate
    read's own ``tolist`` left out: the wrapper pauses the counter)."""

    def __init__(self, reads: DeliberateReads, counts: Any) -> None:
        self.reads, self.counts = reads, counts
        reads.counts = counts

    def __call__(self, execute: Callable[[], Any]) -> Step:
        self.reads.marks.clear()
        before = Counter(self.counts.syncs)
        self.counts.on = True
        t0 = time.perf_counter()
        try:
            execute()
        finally:
            t1 = time.perf_counter()
            self.counts.on = False
        other = sorted((Counter(self.counts.syncs) - before).elements())
        launch, wait = _timing(self.reads, t0, t1)
        return Step(len(self.reads.marks), other, False, launch, wait, t1 - t0)


def sleep_cycles(ms: float) -> int:
    """``torch.cuda._sleep`` cycles that keep the current stream busy for about ``ms``, measured here."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles // 10)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * ms / max(start.elapsed_time(end), 1e-3))


def probe() -> tuple[bool, str]:
    """Whether torch's sync flagging works on this device: ``.item()`` and a pageable ``.cpu()`` flagged,
    ``Event.synchronize`` not."""
    x = torch.ones(4, device="cuda")
    seen = {}
    for name, op in (("item()", lambda: x.sum().item()), ("pageable cpu()", lambda: x.cpu()),
                     ("Event.synchronize", lambda: _event_sync())):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                op()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        seen[name] = sum(SYNC_WARNING in str(w.message) for w in caught)
    ok = seen["item()"] >= 1 and seen["pageable cpu()"] >= 1 and seen["Event.synchronize"] == 0
    return ok, (f"probe: warnings for {', '.join(f'{k} {v}' for k, v in seen.items())} -> "
                f"{'PASS' if ok else 'FAIL: the flagging does not work as this check assumes'}")


def _event_sync() -> None:
    ev = torch.cuda.Event()
    ev.record()
    ev.synchronize()


def check_batch(eng: Any, num_seqs: int, measure: Callable[[Callable[[], Any]], Step], cuda: bool, busy_ms: float,
                steps: int, max_tokens: int) -> tuple[bool, str, list[str]]:
    """One batch size: (passed, its table row, the other waits' sites)."""
    from tests.sync_counter import MAX_SYNCS_PER_STEP, run_steady

    got = run_steady(eng, num_seqs, steps, measure, max_tokens=max_tokens)
    if cuda:
        torch.cuda.synchronize()
    if not got:
        return False, f"{num_seqs:>5}  {0:>5}  no steady step of the whole batch: FAIL", []
    plain = [s for s in got if not s.busy]
    busy = [s for s in got if s.busy]
    reads = max((s.reads for s in got), default=0)
    ahead = all(s.launch_s * 1e3 < busy_ms / 2 for s in busy)
    ok = (len(got) >= min(4, steps) and reads <= MAX_SYNCS_PER_STEP and min(s.deliberate for s in got) >= 1
          and (ahead or not cuda))
    gpu = statistics.median(s.events[0].elapsed_time(s.events[1]) for s in plain) if cuda and plain else None
    row = (f"{num_seqs:>5}  {len(got):>5}  {reads:>17}  {max(s.deliberate for s in got):>10}  "
           f"{max(len(s.other) for s in got):>5}  {MAX_SYNCS_PER_STEP:>6}  "
           f"{statistics.median(s.wall_s for s in (plain or got)) * 1e3:>7.2f}  "
           f"{'-' if gpu is None else f'{gpu:.2f}':>6}  "
           f"{max(s.launch_s for s in (busy or plain)) * 1e3:>11.2f}  "
           f"{(f'{busy_ms:.0f}' if busy else 'n/a'):>9}  "
           f"{max(s.wait_s for s in (busy or plain)) * 1e3:>8.2f}  {'PASS' if ok else 'FAIL'}")
    sites = sorted(Counter(site for s in got for site in s.other).items())
    return ok, row, [f"batch {num_seqs}: {site} x{n}" for site, n in sites]


HEADER = ("batch  steps  reads/step (max)  deliberate  other  budget  wall ms  gpu ms  launch->read  queued ms  "
          "wait ms  verdict")


def run_engine_check(args: argparse.Namespace, report: Path | None) -> bool:
    """Stages 1-3: builds the model and engine, measures each batch size; prints and appends the section."""
    from bench_engine import build_random_model
    from engine import LLM

    cuda = not args.smoke
    shape = "tiny" if args.smoke else args.shape
    dtype = torch.float32 if args.smoke else torch.bfloat16
    name = torch.cuda.get_device_name() if cuda else "CPU (smoke)"
    lines = []
    ok = True
    with tempfile.TemporaryDirectory(prefix="pdsync-model-") as folder:
        t = time.perf_counter()
        build_random_model(shape, folder, "cuda" if cuda else "cpu", dtype)
        kw: dict[str, Any] = (dict(kv_cache_gib=1.0, gpu_memory_utilization=0.3) if cuda
                              else dict(num_kv_blocks=256))
        eng = LLM(folder, device="cuda" if cuda else "cpu", dtype=str(dtype).removeprefix("torch."),
                  max_num_seqs=max(BATCHES), max_model_len=256, enable_prefix_caching=False, **kw).engine
        graphs = eng.runner.decode_graphs is not None and not getattr(eng.runner.decode_graphs, "capture_error", None)
        lines.append(f"random-weight {shape} ({dtype}) on {name}, CUDA graphs: {'yes' if graphs else 'no'}; "
                     f"model and engine ready in {time.perf_counter() - t:.1f} s; torch {torch.__version__}")
        if cuda:
            probe_ok, probe_line = probe()
            ok &= probe_ok
            lines.append(probe_line)
        print("\n".join(lines), flush=True)
        table, sites = [HEADER], []
        reads = DeliberateReads()
        with reads.installed(), _counter(args.smoke) as counts:
            if cuda:
                measure: Any = CudaMeasure(reads, sleep_cycles(BUSY_MS))
                waits = measure.watching_waits()
            else:
                measure, waits = CpuMeasure(reads, counts), _nothing()
            with waits:
                for num_seqs in BATCHES:
                    batch_ok, row, batch_sites = check_batch(eng, num_seqs, measure, cuda, BUSY_MS, args.steps,
                                                             args.max_tokens)
                    ok &= batch_ok
                    table.append(row)
                    sites += batch_sites
                    print(row, flush=True)
    text = "\n".join(lines + ["", *table] + ([""] + ["other waits:"] + sites if sites else []))
    print(f"{'PASS' if ok else 'FAIL'}: host reads per steady decode step", flush=True)
    if report is not None:
        with report.open("a") as f:
            f.write(f"\n## Host syncs per decode step (issue 27)\n\n`python scripts/gpu_sync_check.py"
                    f"{' --smoke' if args.smoke else ''}`: {'PASS' if ok else 'FAIL'}. Reads: the sampler's "
                    f"deliberate ones plus every other wait (flagged by torch's sync debug mode, or an explicit "
                    f"synchronize{'; CPU: the CPU counter' if args.smoke else ''}); launch->read: the host's time "
                    f"from the step's start to its read, behind the queued GPU work (max over those steps; the GPU "
                    f"still busy when the host got there: it runs ahead); wall and gpu: medians of the other steps."
                    f"\n\n```\n{text}\n```\n")
    return ok


@contextmanager
def _counter(smoke: bool) -> Iterator[Any]:
    """The CPU counter's wrappers on the CPU (``--smoke``); nothing on CUDA, where torch flags the syncs."""
    if not smoke:
        yield None
        return
    from tests.sync_counter import counting

    with counting() as counts:
        yield counts


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def run_pytest(smoke: bool, timeout_s: float, report: Path | None) -> bool:
    """Stage 4: the stream-discipline and sync-budget tests on this machine. Not in ``--smoke``: on the CPU the CUDA
    tests only skip, CI runs both files itself, and a second torch start would double this script's time there."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PYTEST_ARGS]
    if smoke:
        rc, tail = 0, "skipped in --smoke (CI runs these files; their CUDA tests need the device)"
    else:
        rc, tail = _pytest(cmd, timeout_s)
    print(f"pytest (exit {rc}):\n{tail}", flush=True)
    if report is not None:
        with report.open("a") as f:
            f.write(f"\n`python -m pytest {shlex.join(PYTEST_ARGS)}` (exit {rc}):\n\n```\n{tail}\n```\n")
    return rc == 0


def _pytest(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    """(exit status, the end of the output) of ``cmd``; 124 when it ran past ``timeout_s``."""
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:  # its output so far comes as bytes
        so_far = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        rc, out = 124, f"{so_far}\ntimed out after {timeout_s:.0f} s"
    return rc, "\n".join(out.strip().splitlines()[-8:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, CPU counter: tests the script")
    ap.add_argument("--shape", default="smollm2-135m", help="bench_engine.SHAPES key of the random-weight model")
    ap.add_argument("--steps", type=int, default=0, help="steady steps per batch (default 8; smoke 4)")
    ap.add_argument("--max-tokens", type=int, default=0, help="tokens per sequence (default 40; smoke 8)")
    ap.add_argument("--pytest-timeout", type=float, default=45.0,
                    help="seconds for stage 4 (scripts/gpu_check.sh gives the whole script 80)")
    ap.add_argument("--out", default=None, help="append the markdown section here")
    args = ap.parse_args(argv)
    args.steps = args.steps or (4 if args.smoke else 8)
    args.max_tokens = args.max_tokens or (8 if args.smoke else 40)
    if args.max_tokens < args.steps + 3:
        ap.error("--max-tokens must leave room for the prefill, the children's first step and --steps")
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: this script checks host syncs on a GPU (--smoke runs it on the CPU)", file=sys.stderr)
        return 2
    report = Path(args.out) if args.out else None
    try:
        ok = run_engine_check(args, report)
    except Exception:  # noqa: BLE001 -- report it, and still run the tests
        trace = traceback.format_exc()
        print(trace, file=sys.stderr, flush=True)
        ok = False
        if report is not None:
            with report.open("a") as f:
                f.write(f"\n## Host syncs per decode step (issue 27)\n\nFAIL (exception):\n\n```\n{trace[-3000:]}```\n")
    ok &= run_pytest(args.smoke, args.pytest_timeout, report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
