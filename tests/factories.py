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
}


def build_checkpoint(folder: Path, arch: str, tokenizer_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight fp32 ``arch`` checkpoint (2 layers, GQA 4:2) plus the tokenizer into ``folder``."""
    import shutil

    import transformers as tf

    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[arch]
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
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face ``generate`` greedy continuations, one prompt at a time, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs
