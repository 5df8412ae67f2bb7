"""Engine vs Hugging Face on one device (issue 12, item 6), on a random-weight model built there.

    python benchmarks/check_identity.py --device cuda [--shape smollm2-135m] [--out docs/gpu-results.md]
    python benchmarks/check_identity.py --smoke        # CPU, tiny shape: tests the script

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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_engine import SHAPES, build_random_model  # noqa: E402


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tol", type=float, default=1e-3, help="float32 logprob tolerance")
    ap.add_argument("--tie", type=float, default=1e-3, help="a top-2 logprob gap below this is a near-tie")
    ap.add_argument("--out", default=None, help="append a markdown report here")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, few prompts (tests the script)")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.shape, args.prompts, args.max_tokens = "cpu", "tiny", 3, 8
    from engine import LLM, SamplingParams

    device = torch.device(args.device)
    vocab, hidden = SHAPES[args.shape]["vocab_size"], SHAPES[args.shape]["hidden_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(16, 200 if not args.smoke else 24))]
               for _ in range(args.prompts)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"{args.prompts} random prompts, {args.max_tokens} greedy tokens each, random-weight {args.shape} "
             f"(init std {2 / hidden ** 0.5:.3f}: peaked logits) on {name}, torch {torch.__version__}"]
    ok = True
    with tempfile.TemporaryDirectory() as folder, torch.inference_mode():
        model = build_random_model(args.shape, folder, str(device), torch.float32, std=2 / hidden**0.5)
        sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
        # float32: greedy identity
        llm = LLM(folder, device=args.device, dtype="float32", max_num_seqs=max(4, args.prompts),
                  max_model_len=512, enable_prefix_caching=False, gpu_memory_utilization=0.5)
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
        del llm
        # bfloat16: the engine's tokens scored teacher-forced by HF
        model = model.to(torch.bfloat16)
        llm = LLM(folder, device=args.device, dtype="bfloat16", max_num_seqs=max(4, args.prompts),
                  max_model_len=512, enable_prefix_caching=False, gpu_memory_utilization=0.5)
        diffs: list[float] = []
        agree = total = 0
        for p, o in zip(prompts, llm.generate(prompts, sp)):
            mine = o.outputs[0].token_ids
            ref = teacher_forced(model, p, mine, device)
            for i, t in enumerate(mine):
                diffs.append(abs(o.outputs[0].logprobs[i][t] - float(ref[i, t])))
                agree += int(int(ref[i].argmax()) == t)
                total += 1
        diffs.sort()
        lines.append(f"bfloat16 teacher-forced: HF's argmax is the engine's token at {agree}/{total} positions "
                     f"({100 * agree / total:.1f}%); |logprob diff| median {diffs[len(diffs) // 2]:.3f}, "
                     f"p99 {diffs[int(0.99 * (len(diffs) - 1))]:.3f}, max {diffs[-1]:.3f}")
    report = "\n".join(lines)
    print(report, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n## Engine vs Hugging Face: identity on the device\n\n"
                    f"`python benchmarks/check_identity.py --device {args.device} --shape {args.shape}"
                    f"{' --smoke' if args.smoke else ''}`\n\n```\n{report}\n```\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
