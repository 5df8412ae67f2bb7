"""The output-length predictor: per prompt-length class, from finished requests only; a new mix shows at once."""

from __future__ import annotations

import pytest

from cluster.control.observe import demand_from_reports
from cluster.control.predict import CLASSES, MIN_SAMPLES, OutputModel, error, prompt_class
from cluster.wire.telemetry import ArrivalSample, FinishedSample, ProxyReport


def counts(**by_prompt: float) -> list[float]:
    out = [0.0] * CLASSES
    for p, n in by_prompt.items():
        out[prompt_class(int(p[1:]))] += n
    return out


def test_classes_are_powers_of_two_capped() -> None:
    assert [prompt_class(p) for p in (1, 2, 3, 4, 1000, 1023, 1024, 8192, 10**6)] == [0, 1, 1, 2, 9, 9, 10, 13, 13]


def test_a_new_mix_is_predicted_from_its_prompts_before_its_answers_finish() -> None:
    m = OutputModel()
    assert m.predict(counts(p1600=5)) is None  # nothing finished: no prediction (the ask bounds it)
    long_prompt, short_prompt = counts(p1600=10), counts(p200=10)
    m = m.learn(long_prompt, [40.0 * 10 if k else 0.0 for k in long_prompt])
    m = m.learn(short_prompt, [400.0 * 10 if k else 0.0 for k in short_prompt])
    assert m.predict(counts(p1600=8)) == pytest.approx(40.0)
    assert m.predict(counts(p200=8)) == pytest.approx(400.0)
    assert m.predict(counts(p1600=1, p200=1)) == pytest.approx(220.0)
    unseen = m.predict(counts(p5000=3))  # a class with no finished request takes the overall mean
    assert unseen == pytest.approx(m.overall()) and MIN_SAMPLES > 0


def test_reports_fill_the_classes_and_error_is_relative() -> None:
    rep = ProxyReport("p", arrivals=(ArrivalSample(100, 4000), ArrivalSample(3000, 4000)),
                      finished=(FinishedSample(100, 0, 7, 0.1, 0.01),))
    d = demand_from_reports([rep], 5.0, 0.25)
    assert d.arrivals_by_class[prompt_class(100)] == 1 and d.arrivals_by_class[prompt_class(3000)] == 1
    assert d.finished_output_by_class[prompt_class(100)] == 7 and sum(d.finished_by_class) == 1
    e = error([110.0, 90.0, float("nan")], [100.0, 100.0, 50.0])
    assert e["windows"] == 2 and e["mae_tokens"] == pytest.approx(10.0) and e["relative"] == pytest.approx(0.1)
