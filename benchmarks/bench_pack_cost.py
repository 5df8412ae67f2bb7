"""What packing the KV parts costs the prefill loop (issue 14 item 3: "pack/checksum off the compute thread").

    python benchmarks/bench_pack_cost.py [--model default] [--prompt-tokens 1024] [--repeats 3]

A socket backend (``torch_dist``, ``ucx``) sends each layer's K/V as one contiguous part, packed on the compute
thread right after the layer's K/V is stored (``prefill_worker.worker`` ``_ship``); its checksum and the send run on
the backend's I/O thread. This prefills one prompt on the engine the prefill actor runs, packs every part exactly as
``_ship`` does (checksum off, as there) inside the same ``after_kv_store`` hook, and prints the packing time as a
share of the prefill. In-place backends (``shm``, ``cuda_ipc``) pack nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from engine.llm import LLM
    from engine.request.sampling_params import SamplingParams
    from kv_transfer.wire.layer_parts import pack_layer_part

    llm = LLM(args.model, num_threads=1)
    eng = llm.engine
    bs = eng.config.block_size
    packed = {"s": 0.0, "parts": 0}

    def ship(layer: int, out: Any) -> None:
        kv = eng.kv_layer(layer)
        for s in out.scheduled:
            src = [s.seq.block_table[j] for j in s.export_range(bs)]
            t = time.perf_counter()
            pack_layer_part(kv[0], kv[1], src, src, scales=eng.kv_layer_scales(layer), checksum=False, layer=layer,
                            token_start=s.export_range(bs).start * bs, token_end=s.start + s.num_tokens,
                            request_id="bench", reservation_id="bench", model_fingerprint=eng.fingerprint)
            packed["s"] += time.perf_counter() - t
            packed["parts"] += 1

    shares = []
    for i in range(args.repeats + 1):  # the first run warms up
        packed.update(s=0.0, parts=0)
        prompt = [100 + (i * 7 + j) % 5000 for j in range(args.prompt_tokens)]  # a new prompt: no cache hit
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1))
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step(after_kv_store=ship)
        total = time.perf_counter() - t
        if i:
            shares.append(packed["s"] / total)
            print(f"prefill {args.prompt_tokens} tokens: {total * 1000:.0f} ms; packing {packed['s'] * 1000:.1f} ms "
                  f"in {packed['parts']} parts = {packed['s'] / total:.2%} of it", flush=True)
    print(f"median share of the prefill spent packing: {statistics.median(shares):.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
