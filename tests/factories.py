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
# K/V blocks for an engine on a tiny test model that must hold a test's prompts without preempting: 512 blocks (4,096
# tokens at block size 8). Not the engine's 2 GiB default: on these models (8 KiB a block) that is ~262,000 blocks,
# ~3 s of CPU per engine to build (a Python object per block, 2 GiB zeroed) for K/V nobody uses.
ROOMY_KV_BLOCKS = 512

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
    # 7 experts of 28, top-3 without renormalising; layer 2 dense by mlp_only_layers (88 wide); q/k norms, head_dim
    # 20 over hidden 48, GQA 6:2; every layer sliding over 56 tokens
    "qwen3_moe": {"hidden_size": 48, "num_attention_heads": 6, "head_dim": 20, "num_hidden_layers": 4,
                  "intermediate_size": 88, "moe_intermediate_size": 28, "num_experts": 7, "num_experts_per_tok": 3,
                  "norm_topk_prob": False, "mlp_only_layers": [2], "decoder_sparse_step": 1,
                  "use_sliding_window": True, "sliding_window": 56, "tie_word_embeddings": False},
    # 5 experts of 52, top-2 (renormalised), GQA 5:1, head_dim 12 over hidden 40, every layer sliding over 48 tokens
    "mixtral": {"hidden_size": 40, "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 12,
                "intermediate_size": 52, "num_local_experts": 5, "num_experts_per_tok": 2, "sliding_window": 48,
                "tie_word_embeddings": False},
}
# the other MoE layouts of Qwen3-MoE, as overrides of "qwen3_moe": sparse every second layer (1 and 3, 3 dense by
# mlp_only_layers: layer 1 alone), top-2 of 5 renormalised (norm_topk_prob)
QWEN3_MOE_STEP2 = {"decoder_sparse_step": 2, "mlp_only_layers": [3], "num_experts": 5, "num_experts_per_tok": 2,
                   "norm_topk_prob": True}
# DeepSeek-V3: q through a q_lora_rank of 28, an odd latent (kv_lora_rank 21 + rope 8: the cache pads one value), 3
# heads of nope 12 + rope 8 and v 10, YaRN with mscale_all_dim (cos/sin and the softmax scale both scaled); layer 0
# dense, layers 1-2 routed: 8 experts in 4 groups, the best 2 groups kept, top-3 + one shared expert, sigmoid scores
# with a correction bias. DeepSeek-V2 in V2-Lite's shape: q as one projection (q_lora_rank null), complex-pair RoPE,
# a softmax router over 6 experts in 3 groups (group_limited_greedy keeping 2), top-2 + two shared; layers 0-1 dense.
ARCH_OVERRIDES.update({
    "deepseek_v3": {"hidden_size": 40, "num_attention_heads": 3, "num_key_value_heads": 3, "num_hidden_layers": 3,
                    "intermediate_size": 56, "moe_intermediate_size": 24, "kv_lora_rank": 21, "q_lora_rank": 28,
                    "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "n_routed_experts": 8,
                    "n_shared_experts": 1, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
                    "first_k_dense_replace": 1, "routed_scaling_factor": 1.7, "tie_word_embeddings": False,
                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                     "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}},
    "deepseek_v2": {"hidden_size": 36, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 3,
                    "intermediate_size": 48, "moe_intermediate_size": 20, "kv_lora_rank": 16, "q_lora_rank": None,
                    "qk_nope_head_dim": 10, "qk_rope_head_dim": 6, "v_head_dim": 14, "n_routed_experts": 6,
                    "n_shared_experts": 2, "num_experts_per_tok": 2, "n_group": 3, "topk_group": 2,
                    "topk_method": "group_limited_greedy", "first_k_dense_replace": 2, "routed_scaling_factor": 1.3,
                    "tie_word_embeddings": False},
})

_NORM_SUFFIXES = ("norm.weight", "layernorm.weight")
_NORMS_PERTURBED = ("qwen3", "gemma3", "qwen3_moe", "mixtral", "deepseek_v3",
                    "deepseek_v2")  # the older archs keep the weights their tests were written against
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
           "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
           "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
           "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
           "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
           "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM)}[arch]
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
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's: a zero bias would not show a lost one
                buf.uniform_(0.0, 0.3)
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


def add_mtp_layer(folder: Path, seed: int = 1, predictive: bool = False) -> Path:
    """Give a tiny DeepSeek-V3 checkpoint (``build_checkpoint(..., "deepseek_v3")``) its next-token (MTP) layer as
    DeepSeek-V3 ships it: ``num_nextn_predict_layers: 1`` and ``model.layers.N.*`` (N = num_hidden_layers):
    ``embed_tokens`` and ``shared_head.head`` (copies of the main model's), ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.norm`` and a decoder layer (an MoE one, shaped like the main model's last layer); random weights
    (float32). ``predictive``: trains nothing but makes the layer predict the model's next-but-one token: the main
    model becomes a bigram model (every attention output projection and every MLP but layer 1's zero, embedding rows
    of RMS 1: its next token is a function of the current one) and the MTP layer a copy of layer 1 reading only the
    next token's embedding (``eh_proj = [I | 0]``), normed and projected as the main model's last step. Rewrites
    ``folder`` in place; returns it."""
    import json

    from safetensors.torch import load_file, save_file

    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 1, files
    state = load_file(str(files[0]))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm() -> torch.Tensor:
        return 1.0 + torch.rand(hidden, generator=gen) * 0.6 - 0.3

    if predictive:
        e = state["model.embed_tokens.weight"]
        state["model.embed_tokens.weight"] = e / e.pow(2).mean(-1, keepdim=True).sqrt()
        for name in list(state):
            if name.endswith("o_proj.weight") or ("down_proj" in name and not name.startswith("model.layers.1.")):
                state[name] = torch.zeros_like(state[name])
    src, new = f"model.layers.{1 if predictive else n - 1}.", f"model.layers.{n}."
    for name, t in list(state.items()):
        if name.startswith(src):
            state[new + name[len(src):]] = t.clone() if predictive or "e_score_correction_bias" in name else \
                rand(*t.shape) if t.dim() > 1 else 1.0 + rand(*t.shape, std=0.3)
    state[new + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[new + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    if predictive:
        state[new + "eh_proj.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
        state[new + "enorm.weight"] = torch.ones(hidden)
        state[new + "hnorm.weight"] = torch.ones(hidden)
        state[new + "shared_head.norm.weight"] = state["model.norm.weight"].clone()
    else:
        state[new + "eh_proj.weight"] = rand(hidden, 2 * hidden)
        for name in ("enorm", "hnorm", "shared_head.norm"):
            state[f"{new}{name}.weight"] = norm()
    save_file({k: v.contiguous() for k, v in state.items()}, str(files[0]), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return folder
