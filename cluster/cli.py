"""The ``pdcluster`` command line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct) or a HF folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--cache-dir", default=None, help="where the default model is converted (~/.cache/pdcluster)")


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:  # before loading the model, so bad parameters fail at once
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, cache_dir=args.cache_dir, progress=progress)
    print(f"[pdcluster] model ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    printed = 0

    def stream(out) -> None:  # type: ignore[no-untyped-def]
        nonlocal printed
        text = out.text
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)

    t1 = time.perf_counter()
    try:
        if args.raw:
            (out,) = llm.generate([args.prompt], params, on_output=stream)
        else:
            (out,) = llm.chat([[{"role": "user", "content": args.prompt}]], params, on_output=stream)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t1
    n = len(out.token_ids)
    print(f"\n[pdcluster] {n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s), finish_reason={out.finish_reason}",
          file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="offline generation with the engine, streaming text as it comes")
    g.add_argument("prompt")
    _add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.set_defaults(func=_cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
