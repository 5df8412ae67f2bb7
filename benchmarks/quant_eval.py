"""The pure parts of benchmarks/bench_quant.py: the task set, its scoring, teacher-forced agreement and perplexity,
the throughput workload, and the side-by-side verdicts. No I/O, no torch: tests/unit/test_bench_quant.py runs them
on fake logits.

Teacher forcing: the fixed text is cut into windows; each window is one prompt, and at every position after the first
an engine reports the log-probability of the text's real next token and its own top-1 token (vLLM's and our
``prompt_logprobs=1`` both give exactly these: the prompt token's entry plus the top-1). Top-1 agreement is the share
of positions whose top-1 equals the float32 reference's; perplexity is exp of the mean negative log-probability of
the real tokens.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

# (question, accepted answers): short facts a 135M chat model gets right in float32 often enough that a quantized
# model's losses show; an answer counts when any accepted form appears in the greedy output as a whole word
TASKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("What is the capital of France?", ("Paris",)),
    ("What is the capital of Germany?", ("Berlin",)),
    ("What is the capital of Italy?", ("Rome",)),
    ("What is the capital of Spain?", ("Madrid",)),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("What is the capital of the United Kingdom?", ("London",)),
    ("What is the capital of Russia?", ("Moscow",)),
    ("What is the capital of China?", ("Beijing",)),
    ("What is the capital of Egypt?", ("Cairo",)),
    ("What is the capital of Canada?", ("Ottawa",)),
    ("What is 2 + 2?", ("4", "four")),
    ("What is 3 + 5?", ("8", "eight")),
    ("What is 10 - 3?", ("7", "seven")),
    ("What is 6 times 7?", ("42", "forty-two")),
    ("What is 9 + 10?", ("19", "nineteen")),
    ("What is 12 divided by 4?", ("3", "three")),
    ("How many days are in a week?", ("7", "seven")),
    ("How many legs does a spider have?", ("8", "eight")),
    ("How many months are in a year?", ("12", "twelve")),
    ("How many hours are in a day?", ("24", "twenty-four")),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What color are bananas when they are ripe?", ("yellow",)),
    ("What is the largest planet in our solar system?", ("Jupiter",)),
    ("What planet is known as the Red Planet?", ("Mars",)),
    ("What is the chemical symbol for water?", ("H2O", "H₂O")),
    ("What gas do plants absorb from the air?", ("carbon dioxide", "CO2", "CO₂")),
    ("What is the freezing point of water in degrees Celsius?", ("0", "zero")),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("What is the largest ocean on Earth?", ("Pacific",)),
    ("What is the opposite of hot?", ("cold",)),
    ("What animal is known as the king of the jungle?", ("lion",)),
    ("In which continent is Kenya?", ("Africa",)),
)


def task_correct(output: str, accepted: Sequence[str]) -> bool:
    """True when any accepted answer appears in ``output`` as a whole word or number, case-insensitively (``4`` is not
    found in ``42`` or ``4.5``). Pure."""
    for answer in accepted:
        pattern = rf"(?<![\w.]){re.escape(answer)}(?![\w]|\.\d)"
        if re.search(pattern, output, flags=re.IGNORECASE):
            return True
    return False


@dataclass(frozen=True)
class Position:
    """One teacher-forced prediction: the engine's top-1 token and its log-probability of the real next token."""
    top1: int
    logprob: float


def position_from_logprobs(entry: dict[int, float], actual: int) -> Position:
    """A ``prompt_logprobs`` entry (top-k plus the real token) -> Position. The top-1 is the highest entry, the
    lowest token id among equals (both engines list the top-k; ties are vanishingly rare in practice). Pure."""
    if actual not in entry:
        raise ValueError(f"the prompt logprobs entry lacks the real token {actual}: {sorted(entry)}")
    top1 = min(entry, key=lambda t: (-entry[t], t))
    return Position(top1, float(entry[actual]))


def windows(ids: Sequence[int], size: int, count: int | None = None) -> list[list[int]]:
    """Consecutive, non-overlapping windows of ``size`` tokens (the last partial one dropped), at most ``count``."""
    if size < 2:
        raise ValueError("window size must be >= 2")
    out = [list(ids[i:i + size]) for i in range(0, len(ids) - size + 1, size)]
    return out if count is None else out[:count]


@dataclass(frozen=True)
class Quality:
    agreement: float   # share of positions whose top-1 equals the reference's, 0..1
    perplexity: float  # exp(mean NLL of the real tokens)
    positions: int


def teacher_forced(reference: Sequence[Sequence[Position]], run: Sequence[Sequence[Position]]) -> Quality:
    """Agreement of ``run``'s top-1 with ``reference``'s and ``run``'s perplexity, over windows of positions. Pure."""
    if len(reference) != len(run) or any(len(a) != len(b) for a, b in zip(reference, run)):
        raise ValueError("reference and run must cover the same windows and positions")
    agree = total = 0
    nll = 0.0
    for ref_w, run_w in zip(reference, run):
        for r, p in zip(ref_w, run_w):
            agree += r.top1 == p.top1
            nll -= p.logprob
            total += 1
    if total == 0:
        raise ValueError("no positions")
    return Quality(agree / total, math.exp(nll / total), total)


def window_qualities(reference: Sequence[Sequence[Position]], run: Sequence[Sequence[Position]]) -> list[Quality]:
    """``teacher_forced`` of each window on its own. Pure."""
    if len(reference) != len(run):
        raise ValueError("reference and run must cover the same windows")
    return [teacher_forced([r], [p]) for r, p in zip(reference, run)]


@dataclass(frozen=True)
class Spread:
    """Mean, sample standard deviation, minimum and maximum of per-window values."""
    mean: float
    sd: float
    lo: float
    hi: float

    def text(self, fmt: str = ".4f") -> str:
        return (f"mean {self.mean:{fmt}} sd {self.sd:{fmt}} min {self.lo:{fmt}} max {self.hi:{fmt}}")


def spread(values: Sequence[float]) -> Spread:
    """The Spread of ``values`` (sd 0 for a single value). Pure."""
    if not values:
        raise ValueError("no values")
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return Spread(mean, sd, min(values), max(values))


@dataclass(frozen=True)
class Paired:
    """Two runs over the same windows: the pooled perplexity ratio ``a / b`` (exp of the difference of the mean
    negative log-likelihoods over all positions) and agreement difference ``a - b`` (points), the spread of the
    per-window values, and percentile intervals of the pooled values from resampling whole windows."""
    ppl_ratio: float
    ppl_ratio_windows: Spread
    ppl_ratio_ci: tuple[float, float]
    agree_diff: float
    agree_diff_windows: Spread
    agree_diff_ci: tuple[float, float]
    windows: int


def _pooled(a: Sequence[Sequence[Position]], b: Sequence[Sequence[Position]], ref: Sequence[Sequence[Position]],
            picks: Sequence[int]) -> tuple[float, float]:
    nll_a = nll_b = 0.0
    agree_a = agree_b = total = 0
    for i in picks:
        for r, p, q in zip(ref[i], a[i], b[i]):
            nll_a -= p.logprob
            nll_b -= q.logprob
            agree_a += r.top1 == p.top1
            agree_b += r.top1 == q.top1
            total += 1
    return math.exp((nll_a - nll_b) / total), (agree_a - agree_b) * 100 / total


def paired(reference: Sequence[Sequence[Position]], a: Sequence[Sequence[Position]], b: Sequence[Sequence[Position]],
           resamples: int = 2000, level: float = 0.95, seed: int = 0) -> Paired:
    """Compare runs ``a`` and ``b`` (each judged against ``reference``) over the same windows: pooled perplexity
    ratio and agreement difference, their per-window spread, and a bootstrap interval (windows drawn with
    replacement ``resamples`` times, seeded) at ``level``. Pure."""
    if not (len(reference) == len(a) == len(b)) or any(
            not (len(r) == len(p) == len(q)) for r, p, q in zip(reference, a, b)):
        raise ValueError("reference and runs must cover the same windows and positions")
    n = len(reference)
    if n == 0:
        raise ValueError("no windows")
    ratio, diff = _pooled(a, b, reference, range(n))
    per = [_pooled(a, b, reference, [i]) for i in range(n)]
    rng = random.Random(seed)
    boot = [_pooled(a, b, reference, [rng.randrange(n) for _ in range(n)]) for _ in range(resamples)]
    lo_i, hi_i = int((1 - level) / 2 * resamples), min(resamples - 1, int((1 + level) / 2 * resamples))
    rs, ds = sorted(x for x, _ in boot), sorted(y for _, y in boot)
    return Paired(ratio, spread([x for x, _ in per]), (rs[lo_i], rs[hi_i]), diff, spread([y for _, y in per]),
                  (ds[lo_i], ds[hi_i]), n)


@dataclass(frozen=True)
class Greedy:
    correct: int         # tasks whose expected answer appears in the greedy output
    same_as_ref: int     # tasks whose greedy tokens equal the float32 reference's
    tasks: int


def greedy_scores(outputs: Sequence[str], output_ids: Sequence[Sequence[int]], ref_ids: Sequence[Sequence[int]],
                  tasks: Sequence[tuple[str, Sequence[str]]] = TASKS) -> Greedy:
    """Score greedy completions of ``tasks``: exact-match of the expected answer, and equality with the reference's
    tokens. Pure."""
    if not len(outputs) == len(output_ids) == len(ref_ids) == len(tasks):
        raise ValueError("one output, its ids and a reference per task")
    correct = sum(task_correct(o, t[1]) for o, t in zip(outputs, tasks))
    same = sum(list(a) == list(b) for a, b in zip(output_ids, ref_ids))
    return Greedy(correct, same, len(tasks))


def workload(n: int, vocab: int, seed: int = 0, prompt: tuple[int, int] = (16, 256),
             output: tuple[int, int] = (16, 128)) -> list[tuple[list[int], int]]:
    """``n`` mixed requests (random prompt tokens of a length in ``prompt``, an output length in ``output``), the
    same for every engine and scheme with the same seed. Pure."""
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output))
            for _ in range(n)]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def compare(ours: dict[str, float], vllm: dict[str, float], our_bf16_tok_s: float | None) -> list[str]:
    """The issue's goals for one scheme, as lines: agreement no worse than vLLM's minus 0.5 points, perplexity within
    1% of vLLM's, offline tok/s >= vLLM's, and tok/s >= 1.3x our own bfloat16 dense (W8A8 and W4A16). ``ours`` and
    ``vllm`` hold ``agreement`` (0..1), ``perplexity``, ``tok_s`` (None or missing in either: no speed lines). No number is rounded before it is judged. Pure."""
    lines = []
    diff = (ours["agreement"] - vllm["agreement"]) * 100
    lines.append(f"agreement {diff:+.2f} points vs vLLM (goal >= -0.50): {verdict(diff >= -0.5)}")
    ratio = ours["perplexity"] / vllm["perplexity"]
    lines.append(f"perplexity {ratio:.4f}x vLLM's (goal within 1%): {verdict(abs(ratio - 1) <= 0.01)}")
    if not ours.get("tok_s") or not vllm.get("tok_s"):  # a quality-only run (--requests 0)
        return lines
    speed = ours["tok_s"] / vllm["tok_s"]
    lines.append(f"offline tok/s {speed:.2f}x vLLM's (goal >= 1.00): {verdict(speed >= 1.0)}")
    if our_bf16_tok_s:
        own = ours["tok_s"] / our_bf16_tok_s
        lines.append(f"offline tok/s {own:.2f}x our bfloat16 dense (goal >= 1.30 for W8A8, W4A16): "
                     f"{verdict(own >= 1.3)}")
    return lines
