"""Engine vs Hugging Face on one device (issue 12, item 6), on random-weight models built there.

    python benchmarks/check_identity.py --device cuda [--shape smollm2-135m] [--out docs/gpu-results.md]
    python benchmarks/check_identity.py --device cuda --families dense,moe,mla   # one model of each family
    python benchmarks/check_identity.py --smoke [--families ...]                # CPU, tiny shapes: tests the script

``--families`` (issue 43) checks one model per family in one process, each with its own report section: ``dense``
(SmolLM2-135M's shape; Llama), ``moe`` (a Qwen3-MoE mini: 16 experts top-4) and ``mla`` (a DeepSeek-V3 mini: multi-head
latent attention over a 512 + 64 latent, YaRN, grouped sigmoid routing with a shared expert); ``--smoke`` takes each
family's tiny shape (the unit tests' layouts, tests/factories.py). A family that fails (an exception included) is
reported and the next one still runs.

float32: the engine's greedy ids must equal HF ``generate``'s (a divergence counts as a near-tie when HF's top two
logprobs at that step are within ``--tie`` of each other) and the engine's logprob of each token on the common prefix
must be within 1e-3 of HF's. bfloat16: greedy runs diverge at near-ties on random weights, so the engine's tokens are
scored teacher-forced by HF (one forward over prompt + the engine's output): the logprob differences and how often
HF's argmax is the engine's token are reported. Exits 1 when the float32 check fails.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_engine import SHAPES, build_random_model, write_tokenizer  # noqa: E402

# shapes this check adds to bench_engine's (config class, model class, fields): the MoE and MLA families small enough
# for the CPU smoke run (tests/factories.py's layouts) and an MLA mini for the device
EXTRA_SHAPES: dict[str, tuple[str, str, dict]] = {
    "qwen3-moe-tiny": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=512, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=20,
        num_hidden_layers=4, intermediate_size=88, moe_intermediate_size=28, num_experts=7, num_experts_per_tok=3,
        norm_topk_prob=False, mlp_only_layers=[2], decoder_sparse_step=1, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=False)),
    "deepseek-v3-tiny": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=512, hidden_size=40, num_attention_heads=3, num_key_value_heads=3, num_hidden_layers=3,
        intermediate_size=56, moe_intermediate_size=24, kv_lora_rank=21, q_lora_rank=28, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=1.7, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 1.0,
                      "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})),
    # DeepSeek-V3's attention as it is (a 512-wide latent + 64 rope dims, 128 + 64 query dims, v 128, q through a
    # LoRA rank), 8 heads, 4 layers (the first dense), 16 routed experts in 4 groups (2 kept), top-4 + 1 shared
    "deepseek-v3-mini": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=32000, hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=4,
        intermediate_size=2048, moe_intermediate_size=256, kv_lora_rank=512, q_lora_rank=384, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=16384,
        rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
}
# family -> (its shape on the device, its shape for --smoke)
FAMILIES = {"dense": ("smollm2-135m", "tiny"), "moe": ("qwen3-moe-mini", "qwen3-moe-tiny"),
            "mla": ("deepseek-v3-mini", "deepseek-v3-tiny")}


def shape_fields(shape: str) -> tuple[int, int]:
    """(vocab size, hidden size) of a shape of bench_engine's or :data:`EXTRA_SHAPES`. Pure."""
    fields = EXTRA_SHAPES[shape][2] if shape in EXTRA_SHAPES else SHAPES[shape]
    return fields["vocab_size"], fields["hidden_size"]


def eager_experts(model):  # type: ignore[no-untyped-def]
    """Mutates: HF's plain per-expert loop as the reference where the model has experts (its grouped_mm path wants
    16-byte strides and, on CUDA, may take bfloat16 only); returns ``model``."""
    setter = getattr(model, "set_experts_implementation", None)  # transformers 5.x
    if setter is not None and getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        setter("eager")
    return model


def build_model(shape: str, folder: str, device: str, dtype: torch.dtype, std: float):  # type: ignore[no-untyped-def]
    """A random-weight model of ``shape`` on ``device`` in ``dtype``, saved (safetensors + tokenizer) to ``folder``;
    returns it (bench_engine's builder for its shapes), its experts run by HF's eager loop."""
    if shape not in EXTRA_SHAPES:
        return eager_experts(build_random_model(shape, folder, device, dtype, std=std))
    import transformers

    config_name, model_name, fields = EXTRA_SHAPES[shape]
    cfg = getattr(transformers, config_name)(**fields, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0,
                                             initializer_range=std)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_name)(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # HF's zero bias would not show a lost one
                buf.uniform_(0.0, 0.3)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, cfg.vocab_size)
    return eager_experts(model)


def hf_greedy(model, prompt: list[int], n: int, device: torch.device) -> tuple[list[int], list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    """HF greedy ids and each step's float32 logprobs [vocab]."""
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float().log_softmax(-1) for s in out.scores]


def teacher_forced(model, prompt: list[int], tokens: list[int], device: torch.device) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """HF's float32 logprobs [len(tokens), vocab] for each of ``tokens`` given everything before it."""
    ids = torch.tensor([prompt + tokens], device=device)
    logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1)


def check_shape(args: argparse.Namespace, shape: str) -> tuple[bool, str]:
    """Engine vs HF on one random-weight ``shape``: (float32 check passed, the report's text)."""
    from engine import LLM, SamplingParams

    device = torch.device(args.device)
    vocab, hidden = shape_fields(shape)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(16, 200 if not args.smoke else 24))]
               for _ in range(args.prompts)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"{args.prompts} random prompts, {args.max_tokens} greedy tokens each, random-weight {shape} "
             f"(init std {2 / hidden ** 0.5:.3f}: peaked logits) on {name}, torch {torch.__version__}"]
    ok = True
    with tempfile.TemporaryDirectory() as folder, torch.inference_mode():
        model = build_model(shape, folder, str(device), torch.float32, std=2 / hidden**0.5)
        sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
        # --smoke (CPU, tiny shapes): a cache for the prompts at once (3 x 2 blocks of 16), not the CPU's 2 GiB default:
        # ~100,000s of blocks on a tiny model, seconds of CPU per engine for K/V nobody uses
        cache = {"num_kv_blocks": 64} if args.smoke else {}
        # float32: greedy identity
        llm = LLM(folder, device=args.device, dtype="float32", max_num_seqs=max(4, args.prompts),
                  max_model_len=512, enable_prefix_caching=False, gpu_memory_utilization=0.5, **cache)
        outs = llm.generate(prompts, sp)
        equal = ties = 0
        worst = 0.0
        for p, o in zip(prompts, outs):
            ids, lps = hf_greedy(model, p, args.max_tokens, device)
            mine = o.outputs[0].token_ids
            same = next((i for i, (a, b) in enumerate(zip(ids, mine)) if a != b), len(ids))
            for i in range(same):
                worst = max(worst, abs(o.outputs[0].logprobs[i][mine[i]] - float(lps[i][ids[i]])))
            if same == len(ids):
                equal += 1
            else:
                top2 = lps[same].topk(2).values
                if float(top2[0] - top2[1]) < args.tie:
                    ties += 1
                else:
                    ok = False
                    lines.append(f"  MISMATCH at token {same} (gap {float(top2[0] - top2[1]):.2e}): hf {ids[same]}, "
                                 f"engine {mine[same]}")
        ok &= worst <= args.tol
        lines.append(f"float32 greedy: {equal}/{len(prompts)} identical, {ties} diverged at a near-tie "
                     f"(top-2 gap < {args.tie}); max |logprob diff| on the common prefix {worst:.2e} "
                     f"(tolerance {args.tol}) -> {'PASS' if ok else 'FAIL'}")
        llm.close()
        del llm
        # bfloat16: the engine's tokens scored teacher-forced by HF
        model = model.to(torch.bfloat16)
        llm = LLM(folder, device=args.device, dtype="bfloat16", max_num_seqs=max(4, args.prompts),
                  max_model_len=512, enable_prefix_caching=False, gpu_memory_utilization=0.5, **cache)
        diffs: list[float] = []
        agree = total = 0
        for p, o in zip(prompts, llm.generate(prompts, sp)):
            mine = o.outputs[0].token_ids
            ref = teacher_forced(model, p, mine, device)
            for i, t in enumerate(mine):
                diffs.append(abs(o.outputs[0].logprobs[i][t] - float(ref[i, t])))
                agree += int(int(ref[i].argmax()) == t)
                total += 1
        llm.close()
        del llm, model
        diffs.sort()
        lines.append(f"bfloat16 teacher-forced: HF's argmax is the engine's token at {agree}/{total} positions "
                     f"({100 * agree / total:.1f}%); |logprob diff| median {diffs[len(diffs) // 2]:.3f}, "
                     f"p99 {diffs[int(0.99 * (len(diffs) - 1))]:.3f}, max {diffs[-1]:.3f}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ok, "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES) + sorted(EXTRA_SHAPES),
                    help="one model of this shape (default: smollm2-135m; --smoke: tiny)")
    ap.add_argument("--families", default=None,
                    help=f"instead of --shape, one model of each of these families ({','.join(FAMILIES)})")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tol", type=float, default=1e-3, help="float32 logprob tolerance")
    ap.add_argument("--tie", type=float, default=1e-3, help="a top-2 logprob gap below this is a near-tie")
    ap.add_argument("--out", default=None, help="append a markdown report here")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, few prompts (tests the script)")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.prompts, args.max_tokens = "cpu", 3, 8
    if args.families is not None and args.shape is not None:
        ap.error("--shape or --families, not both")
    if args.families is not None:
        unknown = [f for f in args.families.split(",") if f not in FAMILIES]
        if unknown:
            ap.error(f"--families: unknown {unknown}; known: {','.join(FAMILIES)}")
        shapes = [(f, FAMILIES[f][1 if args.smoke else 0]) for f in args.families.split(",")]
    else:
        shapes = [("", args.shape or ("tiny" if args.smoke else "smollm2-135m"))]
    rc = 0
    for family, shape in shapes:
        try:
            ok, report = check_shape(args, shape)
        except Exception:  # noqa: BLE001 -- report the family and go on to the next
            ok, report = False, f"{shape}: FAIL (exception)\n{traceback.format_exc()[-2500:]}"
        rc |= int(not ok)
        print(report, flush=True)
        if args.out:
            title = f" ({family}: {shape})" if family else ""
            with open(args.out, "a") as f:
                f.write(f"\n## Engine vs Hugging Face: identity on the device{title}\n\n"
                        f"`python benchmarks/check_identity.py --device {args.device} --shape {shape}"
                        f"{' --smoke' if args.smoke else ''}`\n\n```\n{report}\n```\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
