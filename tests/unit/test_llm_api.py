"""The offline API on the embedded default model: chat identity with HF, sampling features, bad input."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("default", dtype="float32", max_num_seqs=16, kv_cache_gib=0.5)


def test_default_model_chat_matches_hf(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    outs = llm.chat(CHATS, SamplingParams(max_tokens=24))
    hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_path), dtype=torch.float32).eval()
    for conv, out in zip(CHATS, outs):
        ids = torch.tensor([llm.apply_chat_template(conv)])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        ref_ids = ref[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref_ids
        assert out.text == llm.tokenizer.decode(ref_ids, skip_special_tokens=True)
    assert "Paris" in outs[0].text
    assert outs[0].finish_reason == "stop"  # <|im_end|> ends the answer
    llm.engine.check_integrity()


def test_seeded_sampling_reproduces_and_n_forks(llm: LLM) -> None:
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, n=3, ignore_eos=True)
    a = llm.generate(["Once upon a time"], p)[0]
    b = llm.generate(["The weather today", "Once upon a time"], [SamplingParams(max_tokens=5), p])[1]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # the n completions differ
    c = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert c.token_ids != a.outputs[0].token_ids
    llm.engine.check_integrity()
    assert llm.engine.kv.pool.counts()["used"] == 0


def test_logprobs_stop_strings_and_stop_ids(llm: LLM) -> None:
    base = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, logprobs=3, ignore_eos=True))[0]
    assert len(base.logprobs) == 16
    for tok, lp in zip(base.token_ids, base.logprobs):
        assert tok in lp and len(lp) in (3, 4) and max(lp.values()) == lp[tok]  # greedy: sampled = top-1
    word = base.text.split()[1]
    partial: list[str] = []
    stopped = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, stop=[word], ignore_eos=True),
                           on_output=lambda o: partial.append(o.new_text))[0]
    assert stopped.finish_reason == "stop" and word not in stopped.text
    assert partial and "".join(partial) == stopped.text  # the streamed deltas add up to the text: a stop string is
    # never streamed, even in part
    assert base.text.startswith(stopped.text)
    by_id = llm.generate(["The capital of France is"],
                         SamplingParams(max_tokens=16, stop_token_ids=[base.token_ids[3]], ignore_eos=True))[0]
    first = base.token_ids.index(base.token_ids[3])
    assert by_id.token_ids == base.token_ids[: first + 1] and by_id.finish_reason == "stop"


def test_bad_input_raises_and_runs_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], SamplingParams())
    with pytest.raises(ValueError, match="8192"):
        llm.generate([[5] * 9000], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 2, 10**9]], SamplingParams())
    assert not llm.engine.has_unfinished_requests()
    ok = llm.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(ok.token_ids) == 3


def test_abort_frees_blocks(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request("a", "Tell me a long story about dragons.", SamplingParams(max_tokens=200, ignore_eos=True))
    eng.add_request("b", "Count to ten.", SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.kv.pool.counts()["used"] > 0
    eng.abort_request("a")
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_integrity()
    assert eng.kv.pool.counts()["used"] == 0
