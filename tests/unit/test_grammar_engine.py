"""Constrained decoding in the offline engine (issue 30): every constrained completion of the tiny random model
matches its grammar (JSON validating with ``jsonschema``, regexes, choices), with greedy, seeded and ``n > 1``
sampling and stop strings; ``max_tokens`` inside a structure ends with "length"; a grammar that does not compile is
a ``ValueError`` naming the field; a step with grammars adds one bounded host -> device copy and no read."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling.grammar import GrammarCompiler
from engine.request.grammar_spec import GrammarSpec
from engine.sampling.sampling_bitmask import apply_token_bitmask
from tests.factories import EXACT_DTYPE
from tests.sync_counter import MAX_CONSTRUCTIONS_PER_STEP, MAX_SYNCS_PER_STEP, counting

# bounded strings, numbers, arrays and enums: a random model closes every structure within the budget
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"],
     "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}}, "required": ["color", "ok"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": 0, "maximum": 1}, "tag": {"type": "string", "maxLength": 4}},
        "required": ["x", "tag"], "additionalProperties": False}}, "required": ["inner"],
     "additionalProperties": False},
    {"enum": ["alpha", "beta", 3, None]},
]
PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8], [61, 62, 63, 64, 65, 66, 67]]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Any) -> LLM:
    return LLM(str(tiny_checkpoint("llama")), dtype=EXACT_DTYPE, block_size=8, num_kv_blocks=256, max_num_seqs=16)


def _schema_params(schema: dict[str, Any], **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 80), grammar=GrammarSpec.json_schema(schema), **kw)


@pytest.mark.parametrize("sampling", [
    dict(),
    dict(temperature=1.0, seed=5, n=3),
    dict(temperature=0.8, top_p=0.9, top_k=40, seed=9, repetition_penalty=1.2),
], ids=["greedy", "seeded-n3", "filters-penalty"])
def test_json_schemas_validate(llm: LLM, sampling: dict[str, Any]) -> None:
    outs = llm.generate([p for _ in SCHEMAS for p in PROMPTS],
                        [_schema_params(s, **sampling) for s in SCHEMAS for _ in PROMPTS])
    for k, out in enumerate(outs):
        schema = SCHEMAS[k // len(PROMPTS)]
        assert len(out.outputs) == sampling.get("n", 1)
        for c in out.outputs:
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)
    llm.engine.check_integrity()


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm: LLM) -> None:
    free = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=4)
    alone = llm.generate(PROMPTS, free)
    mixed = llm.generate(PROMPTS * 2, [free] * len(PROMPTS) + [_schema_params(SCHEMAS[0])] * len(PROMPTS))
    assert [o.token_ids for o in alone] == [o.token_ids for o in mixed[:len(PROMPTS)]]


def test_regex_choice_and_lark(llm: LLM) -> None:
    cases = [(GrammarSpec("regex", r"[0-9]{3}-[a-c]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-c]{2}", t)),
             (GrammarSpec.choice(["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
             (GrammarSpec("lark", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'),
              lambda t: re.fullmatch(r"\(\d{1,2}(,\d{1,2})*\)", t))]
    for spec, ok in cases:
        for out in llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=1.0, seed=2, grammar=spec)):
            assert out.finish_reason == "stop" and ok(out.text), (spec, out.text)


def test_max_tokens_inside_a_structure_is_length(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], _schema_params(SCHEMAS[3], max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith("{")


def test_a_stop_string_cuts_a_constrained_completion(llm: LLM) -> None:
    full = llm.generate(PROMPTS[0], _schema_params(SCHEMAS[1]))[0].text
    cut = full[: full.index(":")]  # the text before the first colon: the stop string is ":"
    out = llm.generate(PROMPTS[0], _schema_params(SCHEMAS[1], stop=[":"]))[0]
    assert (out.text, out.finish_reason) == (cut, "stop")


def test_seeded_constrained_output_reproduces(llm: LLM) -> None:
    params = _schema_params(SCHEMAS[2], temperature=1.0, seed=17, n=2)
    a, b = llm.generate(PROMPTS, params), llm.generate(PROMPTS, params)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]


@pytest.mark.parametrize("spec", [GrammarSpec("regex", "[a-"), GrammarSpec.json_schema({"type": "objectx"}),
                                  GrammarSpec("lark", "start: undefined_rule")])
def test_a_grammar_that_does_not_compile_is_refused(llm: LLM, spec: GrammarSpec) -> None:
    with pytest.raises(ValueError, match="grammar"):
        llm.generate(PROMPTS[0], SamplingParams(grammar=spec))
    assert not llm.engine.has_unfinished_requests()


def test_grammars_compile_once_per_distinct_spec(llm: LLM) -> None:
    compiler = llm.engine.grammar_compiler()
    spec = GrammarSpec.json_schema({"type": "string", "maxLength": 3, "pattern": "^[a-z]+$"})
    before = compiler.num_cached
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, grammar=spec))
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, grammar=GrammarSpec(spec.kind, spec.text)))
    assert compiler.num_cached == before + 1
    small = GrammarCompiler(llm.tokenizer, compiler.vocab_size, [0], cache_size=2)
    for k in range(4):
        small.grammar(GrammarSpec("regex", f"a{{{k + 1}}}"))
    assert small.num_cached == 2


def test_fill_rows_writes_what_llguidance_torch_does_and_refuses_a_bad_tensor(llm: LLM) -> None:
    import llguidance
    import llguidance.torch  # the reference only: the engine no longer imports it (torch._dynamo, ~3 s a process)

    from engine.sampling.sampling_bitmask import bitmask_width
    from engine.sampling.sampling_grammar import fill_rows

    compiler = llm.engine.grammar_compiler()
    specs = [GrammarSpec.json_schema(SCHEMAS[0]), GrammarSpec("regex", "ab+"), GrammarSpec.json_schema(SCHEMAS[4])]
    executor = llguidance.LLExecutor(2)
    width = bitmask_width(compiler.vocab_size)
    ours, theirs = (torch.full((4, width), -1, dtype=torch.int32) for _ in range(2))
    fill_rows(executor, [(compiler.matcher(spec), i) for i, spec in enumerate(specs)], ours)
    llguidance.torch.fill_next_token_bitmask_par(executor, [(compiler.matcher(spec), i) for i, spec in
                                                             enumerate(specs)], theirs)
    assert torch.equal(ours, theirs) and not torch.equal(ours[0], ours[1])
    assert (ours[3] == -1).all()  # a row without a matcher is left as it was: every token allowed
    for bad in (torch.zeros((4, width), dtype=torch.int64), torch.zeros((width, 4), dtype=torch.int32).t(),
                torch.zeros(width, dtype=torch.int32)):
        with pytest.raises(ValueError, match="contiguous int32"):
            fill_rows(executor, [], bad)


def test_bitmask_masks_exactly_the_cleared_bits() -> None:
    logits = torch.randn(2, 70)
    mask = torch.zeros(2, 3, dtype=torch.int32)
    mask[0, 0] = 1 << 5
    mask[1, 2] = 1 << 3  # token 67
    mask[1, 1] = -1  # tokens 32..63
    out = apply_token_bitmask(logits, mask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [5]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [*range(32, 64), 67]
    assert torch.equal(out[1, 32:64], logits[1, 32:64])


def test_a_constrained_decode_step_adds_one_copy_and_no_read(llm: LLM) -> None:
    eng = llm.engine
    for i, p in enumerate(PROMPTS * 2):
        eng.add_request(f"sync-{i}", p, _schema_params(SCHEMAS[2 + i % 2], max_tokens=30, temperature=1.0, seed=i))
    eng.step()
    eng.step()
    per_step = []
    with counting() as counts:
        for _ in range(3):
            if not eng.has_unfinished_requests():
                break
            before = counts.totals()
            counts.on = True
            eng.step()
            counts.on = False
            after = counts.totals()
            per_step.append((after[0] - before[0], after[1] - before[1]))
    while eng.has_unfinished_requests():
        eng.step()
    assert per_step, "the constrained batch must still run"
    assert all(1 <= r <= MAX_SYNCS_PER_STEP for r, _ in per_step), (per_step, dict(counts.syncs))
    assert all(c <= MAX_CONSTRUCTIONS_PER_STEP + 1 for _, c in per_step), (per_step, dict(counts.constructions))
    eng.check_integrity()
