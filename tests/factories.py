"""Test factories: a tiny trained tokenizer and random-weight Hugging Face checkpoints of each architecture."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

# Tests that compare a served text with the offline engine's run both in float32: in bfloat16 (the CPU default where
# the CPU computes it natively) another batch shape or prefill chunking can round a logit differently and a greedy
# completion can take another word; float32 keeps the engine's answers equal across them (docs/architecture.md).
EXACT_DTYPE = "float32"

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(n: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ("the cat dog runs fast slow model token cache block prefill decode serve request reply "
             "héllo wörld naïve café 日本 語 🙂 Привет мир").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def build_tokenizer(folder: Path, vocab_size: int = 400) -> Any:
    """Train a small byte-level BPE and save it as a Hugging Face fast tokenizer in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return fast


ARCH_OVERRIDES: dict[str, dict[str, Any]] = {
    # llama3 RoPE scaling and tied embeddings
    "llama": {
        "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    },
    # q/k/v biases, untied head
    "qwen2": {"tie_word_embeddings": False},
    # a sliding window shorter than the longest prompts
    "mistral": {"sliding_window": 48, "tie_word_embeddings": False},
    # q/k norms, head_dim (24) unlike hidden / heads, GQA 6:2, layers 1 and 2 sliding over 40 tokens
    "qwen3": {"hidden_size": 56, "num_attention_heads": 6, "head_dim": 24, "num_hidden_layers": 3,
              "intermediate_size": 96, "use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1,
              "tie_word_embeddings": False, "rope_theta": 5000.0},
    # local, local, global layers (window 24, RoPE bases 500 and 20000, the global one linearly scaled), GQA 4:1,
    # head_dim 32 over hidden 40, query_pre_attn_scalar 24, tied embeddings, a final logit soft-cap
    "gemma3": {"hidden_size": 40, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
               "num_hidden_layers": 3, "intermediate_size": 72, "sliding_window": 24, "sliding_window_pattern": 3,
               "rope_local_base_freq": 500.0, "rope_theta": 20000.0,
               "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "query_pre_attn_scalar": 24,
               "final_logit_softcapping": 30.0, "pad_token_id": 0},
}

_NORM_SUFFIXES = ("norm.weight", "layernorm.weight")
_NORMS_PERTURBED = ("qwen3", "gemma3")  # the older archs keep the weights their tests were written against
# Gemma 3's scaled, tied embedding dominates the residual at the common std: greedy repeats the input token. A
# smaller embedding, larger layers and a sharper final norm give varied text with top-2 logprob gaps above 4e-3.
_GEMMA3_INIT = {"embed_std": 0.04, "layer_std": 0.2, "final_norm_add": 4.0}


def build_checkpoint(folder: Path, arch: str, tokenizer_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight fp32 ``arch`` checkpoint (2 layers, GQA 4:2, unless ARCH_OVERRIDES says otherwise) plus
    the tokenizer into ``folder``."""
    import shutil

    import transformers as tf

    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "mistral": (tf.MistralConfig, tf.MistralForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
           "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM)}[arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0,
        rope_theta=10000.0,
    )
    kwargs.update(ARCH_OVERRIDES[arch])
    kwargs.update(overrides)
    config = cls[0](**kwargs)
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    with torch.no_grad():  # larger weights than the default init: peaked logits, so greedy has no near-ties
        gemma = arch == "gemma3"
        for name, p in model.named_parameters():
            if p.dim() > 1:
                std = 0.15 if not gemma else _GEMMA3_INIT["embed_std" if "embed" in name else "layer_std"]
                p.normal_(0.0, std)
            elif arch in _NORMS_PERTURBED and name.endswith(_NORM_SUFFIXES):
                # norms away from their init (1, or Gemma's 0), so that a misplaced or missing one shows
                p.add_(torch.empty_like(p).uniform_(-0.3, 0.3))
        if gemma:
            model.model.norm.weight.add_(_GEMMA3_INIT["final_norm_add"])
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face ``generate`` greedy continuations, one prompt at a time, EOS ignored."""
    return [ids for ids, _ in hf_greedy_logprobs(folder, prompts, max_new_tokens)]


def hf_greedy_logprobs(folder: Path, prompts: list[list[int]], max_new_tokens: int
                       ) -> list[tuple[list[int], list[float]]]:
    """Hugging Face ``generate`` greedy continuations in float32, one prompt at a time, EOS ignored, each with the
    log-softmax of the model's raw logits at every chosen token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            toks = g.sequences[0, len(p):].tolist()
            lps = [float(lg[0].float().log_softmax(-1)[t]) for lg, t in zip(g.logits, toks)]
            outs.append((toks, lps))
    return outs
