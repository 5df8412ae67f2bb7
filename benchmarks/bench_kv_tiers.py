#!/usr/bin/env python3
"""Multi-turn chats on a disaggregated cluster (2 prefill, 1 decode), default model, float32, each actor's device
pool too small for the conversations' histories: the same chats on the cluster without tiers and with tiers (host
L2 + a shared disk L3 that the decode actor writes finished requests back to). Prints, side by side: later turns'
``cached_tokens`` as a share of the previous turn's prompt + answer tokens, TTFT p50 of later turns, and whether
every (greedy) answer is equal. Issue 45; docs/kv-tiers.md.

    PYTHONPATH=$PWD python3 benchmarks/bench_kv_tiers.py --chats 4 --turns 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

WORDS = ("river stone lantern orbit violet harbor maple signal cobalt meadow thunder copper galaxy willow ember "
         "falcon prism glacier tundra canyon").split()


def _text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 13 + i * 7 + i * i) % len(WORDS)] for i in range(words))


@dataclass
class ChatRun:
    answers: list[list[str]] = field(default_factory=list)  # per chat, per turn
    ttft_later: list[float] = field(default_factory=list)  # TTFT of turns after the first (s)
    hit_share: list[float] = field(default_factory=list)  # cached_tokens / (previous prompt + answer tokens)
    promoted: dict[str, int] = field(default_factory=dict)  # tier -> blocks promoted from it (every actor)


def run_chats(url: str, chats: int, turns: int, system_words: int, user_words: int, max_tokens: int) -> ChatRun:
    """Round-robin the turns of ``chats`` conversations (so their histories crowd each other out of the pools);
    greedy, streamed with usage. Mutates nothing but the server's caches."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    run = ChatRun(answers=[[] for _ in range(chats)])
    msgs: list[list[dict[str, str]]] = [[{"role": "system", "content": _text(100 + c, system_words)}]
                                        for c in range(chats)]
    prev: list[int] = [0] * chats  # previous turn's prompt + completion tokens
    for t in range(turns):
        for c in range(chats):
            msgs[c].append({"role": "user", "content": _text(10 * c + t, user_words)})
            t0 = time.perf_counter()
            ttft, text, usage = None, [], None
            for chunk in client.chat.completions.create(model="default", messages=msgs[c], max_tokens=max_tokens,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
            answer = "".join(text)
            run.answers[c].append(answer)
            msgs[c].append({"role": "assistant", "content": answer})
            cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
            if t > 0:
                run.ttft_later.append(ttft if ttft is not None else time.perf_counter() - t0)
                run.hit_share.append(cached / prev[c])
            prev[c] = usage.prompt_tokens + usage.completion_tokens
    return run


def _promoted_blocks(url: str) -> dict[str, int]:
    """Blocks promoted from each tier by every actor (the decode actor too: its reserve pins a prefix from its
    tiers), from /metrics."""
    import re
    import urllib.request

    time.sleep(2.0)
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, int] = {}
    for tier, n in re.findall(r'pdcluster_kv_tier_promoted_blocks_total\{actor="[^"]*",tier="(\w+)"\} (\d+)',
                              text):
        out[tier] = out.get(tier, 0) + int(n)
    return out


def serve_and_run(tiers: str | None, args: argparse.Namespace, disk_dir: str) -> ChatRun:
    """``tiers``: None (untiered), or the disk tier's integrity check ("payload_mac", "blake2b")."""
    from cluster.launcher import Cluster, ServeConfig
    from cluster.wire.proxy_settings import ProxySettings
    from cluster.wire.worker_config import WorkerConfig

    extra: dict[str, Any] = dict(kv_host_gib=args.host_gib, kv_disk_dir=disk_dir, kv_disk_gib=args.disk_gib,
                                 kv_disk_integrity=tiers) if tiers else {}
    cluster = Cluster(ServeConfig(worker=WorkerConfig(dtype="float32", num_kv_blocks=args.blocks,
                                                      max_num_batched_tokens=args.batch_tokens, **extra),
                                  decode=1, prefill=2, port=0, mode="disaggregated",
                                  # every turn on a prefill actor: the tiers' hits there are what it measures
                                  proxy=ProxySettings(chat_token_cache_mib=args.chat_token_cache_mib,
                                                      disagg_mode="always")))
    try:
        cluster.start()
        run = run_chats(cluster.urls[0], args.chats, args.turns, args.system_words, args.user_words,
                        args.max_tokens)
        if tiers:
            run.promoted = _promoted_blocks(cluster.urls[0])
        return run
    finally:
        cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-words", type=int, default=150)
    ap.add_argument("--user-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=48, help="device pool per actor, blocks of 16 tokens")
    ap.add_argument("--batch-tokens", type=int, default=512)
    ap.add_argument("--host-gib", type=float, default=0.25)
    ap.add_argument("--disk-gib", type=float, default=1.0)
    ap.add_argument("--integrity", nargs="+", default=["blake2b", "payload_mac"], choices=("payload_mac", "blake2b"),
                    help="the tiered runs: one per disk integrity check")
    ap.add_argument("--chat-token-cache-mib", type=int, default=64,
                    help="every cluster's proxy chat token cache (proxy/chat_token_cache.py); 0: off, as before it")
    ap.add_argument("--answers-out", default=None,
                    help="write every run's answers here (JSON: run -> chat -> turn), to compare runs")
    args = ap.parse_args()
    runs: dict[str, ChatRun] = {}
    for name in ("untiered", *args.integrity):
        with tempfile.TemporaryDirectory(prefix="kv-tiers-") as disk_dir:
            runs[name] = serve_and_run(None if name == "untiered" else name, args, disk_dir)
    if args.answers_out:
        import json

        with open(args.answers_out, "w") as f:
            json.dump({name: run.answers for name, run in runs.items()}, f)
    p50 = statistics.median
    base = runs["untiered"]
    print(f"chats {args.chats} x turns {args.turns}, 2 prefill + 1 decode, {args.blocks} blocks/actor, float32")
    for name, run in runs.items():
        print(f"{name:>12}: later turns' cached share of previous prompt+answer min {min(run.hit_share):.3f} "
              f"mean {statistics.mean(run.hit_share):.3f} (goal >= 0.90) | TTFT p50 {p50(run.ttft_later) * 1e3:.1f} "
              f"ms, ratio to untiered {p50(run.ttft_later) / p50(base.ttft_later):.3f} (goal <= 0.5) | answers "
              f"equal to untiered: {run.answers == base.answers}")
        if run.promoted:
            print(f"{'':>12}  blocks promoted into device pools (every actor), by tier: {run.promoted}")
        print(f"{'':>12}  cached share per later turn (turn by turn, chat by chat): "
              f"{' '.join(f'{x:.3f}' for x in run.hit_share)}")
        print(f"{'':>12}  later turns' TTFT (ms, sorted): {' '.join(f'{t * 1e3:.0f}' for t in sorted(run.ttft_later))}")


if __name__ == "__main__":
    main()
