"""Kernel micro-benchmarks against the device's own copy bandwidth, measured in the same run.

    python benchmarks/bench_kernels.py [--out docs/gpu-results.md] [--batch 64] [--context 2048]
    python benchmarks/bench_kernels.py --smoke      # CPU, Triton interpreter, tiny shapes: the script itself (< 20 s)

On a CUDA device: the device's copy bandwidth (a large ``copy_``, read + write), then each kernel's achieved
bandwidth as a share of it. Paged decode attention (batch x context tokens, GQA, bfloat16 and float16, FP8 and int8
caches beside bfloat16, and split-K at a small batch with a long context), torch SDPA on the same KV laid out contiguously
(the speed to match); varlen prefill attention (packed chunks, with and without a cached prefix) in TFLOP/s beside
SDPA's causal attention on contiguous K/V; store_kv at 1k and 16k tokens, the FP8 and int8 stores, pack/unpack of
blocks, FP8 quantize/dequantize. Each kernel is timed as CUDA-graph replays of ``GRAPH_CALLS`` calls (so the host's launch
cost is left out, as in the engine's decode graphs), falling back to eager calls where capture fails (marked).

``--smoke`` runs every row on the CPU through the Triton kernels under ``TRITON_INTERPRET=1`` with tiny shapes, so
the script cannot rot without a GPU; ``--allow-cpu --small`` runs the torch reference path instead. Their numbers
mean nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GRAPH_CALLS = 10
# launch settings the sweep tries (each a dict of module constants of pdkernels.triton_kv / pdkernels.triton_prefill); the
# report lists them so that one GPU run shows which to make the default
DECODE_SWEEP = [dict(DECODE_TILE=t, DECODE_WARPS=w, DECODE_STAGES=s) for t in (32, 64, 128) for w in (4, 8)
                for s in (2, 3)]
FP8_SWEEP = [dict(DECODE_TILE_FP8=t, DECODE_WARPS_FP8=w, DECODE_STAGES_FP8=s) for t in (64, 128, 256) for w in (4, 8)
             for s in (2, 3)]
PREFILL_SWEEP = [dict(PREFILL_ROWS=r, PREFILL_TILE_N=n, PREFILL_STAGES=s) for r in (64, 128) for n in (32, 64, 128)
                 for s in (2, 3)]
COPY_SWEEP = [dict(COPY_CHUNK=c, COPY_WARPS=w) for c in (4096, 8192, 16384) for w in (4, 8)]
STORE_SWEEP = [dict(STORE_ELEMS=e, STORE_WARPS=w) for e in (2048, 4096, 8192) for w in (4, 8)]


@dataclass(frozen=True)
class Shapes:
    batch: int  # decode sequences
    context: int  # decode context tokens per sequence
    small_batch: int  # split-K decode: few sequences ...
    long_context: int  # ... with long contexts
    prefill_seqs: int  # varlen prefill: sequences packed in one call
    prefill_len: int  # tokens per sequence (prefix + chunk)
    chunk: int  # the chunked case's chunk (the rest is a cached prefix)
    store_tokens: tuple[int, ...]  # store_kv batch sizes
    kv_heads: int = 8
    group: int = 4
    head_dim: int = 128
    block_size: int = 16
    iters: int = 20
    copy_bytes: int = 1 << 30
    # fused MoE: (experts, hidden, expert intermediate, top-k) as one Qwen3-30B-A3B layer, and the tokens routed
    # (a decode batch, a prefill chunk)
    moe_shape: tuple[int, int, int, int] = (128, 2048, 768, 8)
    moe_tokens: tuple[int, ...] = (64, 4096)


def shapes_for(args: argparse.Namespace) -> Shapes:
    if args.smoke:
        return Shapes(2, 40, 1, 64, 2, 24, 8, (24,), kv_heads=2, group=2, head_dim=64, iters=1, copy_bytes=1 << 20,
                      moe_shape=(6, 40, 24, 2), moe_tokens=(3, 70))
    if args.small:
        return Shapes(4, 64, 1, 256, 2, 64, 16, (64,), iters=3, copy_bytes=16 << 20)
    return Shapes(args.batch, args.context, 4, 8192, 8, 2048, 512, (1024, 16384))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the markdown report here")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--allow-cpu", action="store_true", help="run the torch reference on the CPU (tests the script)")
    ap.add_argument("--small", action="store_true", help="tiny sizes")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny sizes (tests the script)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-settings sweep")
    args = ap.parse_args(argv)
    if args.smoke:  # before anything imports triton: the interpreter is chosen at import
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not (args.allow_cpu or args.smoke):
        print("error: no CUDA device: this benchmark measures GPU kernels (--smoke exercises the script on the CPU "
              "through the Triton interpreter, --allow-cpu --small through the torch reference)", file=sys.stderr)
        return 2
    bench = Bench(device, shapes_for(args))
    bench.run()
    if not args.no_sweep and (device == "cuda" or args.smoke):
        bench.sweep(smoke=args.smoke)
    report = bench.report(argv if argv is not None else sys.argv[1:])
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


class Bench:
    """Runs the rows; each row is (what, seconds, bytes moved or None, note)."""

    def __init__(self, device: str, shapes: Shapes) -> None:
        import torch

        import pdkernels

        self.torch, self.kernels, self.device, self.s = torch, pdkernels, device, shapes
        self.rows: list[tuple[str, float, float | None, str]] = []
        self.sweep_rows: list[tuple[str, dict[str, int], float | None, float | str]] = []
        self.bw = self.copy_bandwidth()

    # -- timing --------------------------------------------------------------------------------------------------
    def timeit(self, fn: Callable[[], object]) -> tuple[float, str]:
        """Median seconds per call after warm-up: CUDA-graph replays on a GPU (eager when capture fails)."""
        torch = self.torch
        for _ in range(0 if self.s.iters == 1 else 3):  # --smoke: one call per row
            fn()
        if self.device != "cuda":
            times = []
            for _ in range(self.s.iters):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return sorted(times)[len(times) // 2], ""
        torch.cuda.synchronize()
        run, calls, how = fn, 1, " (eager)"
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(GRAPH_CALLS):
                    fn()
            run, calls, how = graph.replay, GRAPH_CALLS, ""
        except Exception:  # noqa: BLE001 -- a kernel that cannot be captured is timed eagerly
            torch.cuda.synchronize()
        times = []
        for _ in range(self.s.iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        return sorted(times)[len(times) // 2], how

    def row(self, what: str, fn: Callable[[], object], nbytes: float | None, note: str = "") -> float:
        t, how = self.timeit(fn)
        self.rows.append((what + how, t, nbytes, note))
        return t

    def copy_bandwidth(self) -> float:
        src = self.torch.empty(self.s.copy_bytes, dtype=self.torch.uint8, device=self.device).random_()
        dst = self.torch.empty_like(src)
        return 2 * src.numel() / self.timeit(lambda: dst.copy_(src))[0]  # read + write

    # -- rows ----------------------------------------------------------------------------------------------------
    def run(self) -> None:
        torch = self.torch
        bf16 = torch.bfloat16 if self.device == "cuda" else torch.float32  # the interpreter computes bf16 wrongly
        self.decode(bf16, with_fp8=True)
        if self.device == "cuda":
            self.decode(torch.float16, with_fp8=False)
        self.split_k(bf16)
        self.prefill(bf16)
        self.stores_and_copies(bf16)
        self.moe(bf16)

    def _paged(self, dtype, seqs: int, ctx: int):  # type: ignore[no-untyped-def]
        """A cache holding ``seqs`` contexts of ``ctx`` tokens in shuffled blocks, and their block tables."""
        torch, s = self.torch, self.s
        width = -(-ctx // s.block_size)
        nb = seqs * width + 8
        kv = torch.randn(2, nb, s.block_size, s.kv_heads, s.head_dim, device=self.device).to(dtype)
        tables = torch.randperm(nb - 8, device=self.device)[: seqs * width].view(seqs, width).int()
        return kv[0], kv[1], tables

    def _contiguous(self, cache, tables, ctx: int):  # type: ignore[no-untyped-def]
        """The same KV as ``[seqs, kv_heads, ctx, head_dim]`` (what SDPA reads)."""
        seqs = tables.shape[0]
        kc = cache[tables.long()].reshape(seqs, -1, self.s.kv_heads, self.s.head_dim)[:, :ctx]
        return kc.transpose(1, 2).contiguous()

    def decode(self, dtype, with_fp8: bool) -> None:  # type: ignore[no-untyped-def]
        torch, k, s = self.torch, self.kernels, self.s
        F = torch.nn.functional
        b, ctx, kvh, hd = s.batch, s.context, s.kv_heads, s.head_dim
        kc, vc, tables = self._paged(dtype, b, ctx)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=self.device)
        q = torch.randn(b, kvh * s.group, hd, device=self.device).to(dtype)
        kv_bytes = 2 * b * ctx * kvh * hd * kc.element_size()
        name = str(dtype).removeprefix("torch.")
        t_dec = self.row(f"paged decode attention, {name}, {b} x {ctx} tokens",
                         lambda: k.paged_decode_attention(q, kc, vc, tables, lens, hd**-0.5), kv_bytes)
        kcont, vcont = self._contiguous(kc, tables, ctx), self._contiguous(vc, tables, ctx)
        qs = q.view(b, kvh * s.group, 1, hd)
        self.row(f"torch SDPA, contiguous KV, {name}, {b} x {ctx} tokens",
                 lambda: F.scaled_dot_product_attention(qs, kcont, vcont, enable_gqa=True), kv_bytes)
        if with_fp8:
            (k8, ks), (v8, vs) = k.quantize_kv_fp8(kc), k.quantize_kv_fp8(vc)
            t8 = self.row(f"paged decode attention, fp8 cache, {b} x {ctx} tokens",
                          lambda: k.paged_decode_attention(q, k8, v8, tables, lens, hd**-0.5, None, ks, vs),
                          kv_bytes // 2)
            self.rows[-1] = (*self.rows[-1][:3], f"{t8 / t_dec:.2f}x the {name} decode's time (goal <= 1)")
            (ki, kis), (vi, vis) = self._int8(kc), self._int8(vc)
            t8 = self.row(f"paged decode attention, int8 cache, {b} x {ctx} tokens",
                          lambda: k.paged_decode_attention(q, ki, vi, tables, lens, hd**-0.5, None, kis, vis),
                          kv_bytes // kc.element_size() + 2 * b * ctx * kvh * 4)  # values + per-token scales
            self.rows[-1] = (*self.rows[-1][:3], f"{t8 / t_dec:.2f}x the {name} decode's time")

    def _int8(self, cache):  # type: ignore[no-untyped-def]
        """An int8 cache ``(values, per-token scales)`` holding ``cache``'s K or V, rounded as the store rounds."""
        from pdkernels import reference

        values, scales = reference.quantize_rows_int8(cache.reshape(-1, *cache.shape[2:]))
        return values.view(cache.shape), scales.view(cache.shape[:3])

    def split_k(self, dtype) -> None:  # type: ignore[no-untyped-def]
        torch, k, s = self.torch, self.kernels, self.s
        b, ctx, kvh, hd = s.small_batch, s.long_context, s.kv_heads, s.head_dim
        kc, vc, tables = self._paged(dtype, b, ctx)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=self.device)
        q = torch.randn(b, kvh * s.group, hd, device=self.device).to(dtype)
        kv_bytes = 2 * b * ctx * kvh * hd * kc.element_size()
        splits = max(2, k.decode_num_splits(b, kvh, ctx, self._sms()))  # what decode picks here (2 at least)
        t1 = self.row(f"paged decode attention, 1 split, {b} x {ctx} tokens",
                      lambda: k.paged_decode_attention(q, kc, vc, tables, lens, hd**-0.5, num_splits=1), kv_bytes)
        tn = self.row(f"paged decode attention, {splits} splits, {b} x {ctx} tokens",
                      lambda: k.paged_decode_attention(q, kc, vc, tables, lens, hd**-0.5, num_splits=splits), kv_bytes)
        self.rows[-1] = (*self.rows[-1][:3], f"{t1 / tn:.2f}x faster than 1 split")

    def _sms(self) -> int:
        return self.torch.cuda.get_device_properties(0).multi_processor_count if self.device == "cuda" else 132

    def prefill(self, dtype) -> None:  # type: ignore[no-untyped-def]
        torch, k, s = self.torch, self.kernels, self.s
        F = torch.nn.functional
        n, L, kvh, hd, hq = s.prefill_seqs, s.prefill_len, s.kv_heads, s.head_dim, s.kv_heads * s.group
        kc, vc, tables = self._paged(dtype, n, L)
        kcont, vcont = self._contiguous(kc, tables, L), self._contiguous(vc, tables, L)
        for chunk in (L, s.chunk):  # a whole prompt; then a chunk after a cached prefix of L - chunk tokens
            start = L - chunk
            q = torch.randn(n * chunk, hq, hd, device=self.device).to(dtype)
            cu = torch.arange(0, n * chunk + 1, chunk, dtype=torch.int32, device=self.device)
            starts = torch.full((n,), start, dtype=torch.int32, device=self.device)
            flops = 4 * n * hq * hd * sum(start + i + 1 for i in range(chunk))
            io = (2 * q.numel() + 2 * n * L * kvh * hd) * kc.element_size()  # q, out, K/V once: the least it reads
            at = len(self.rows)
            t = self.row(f"varlen prefill attention, {dtype_name(dtype)}, {n} x {chunk} tokens after {start} cached",
                         lambda: k.paged_prefill_attention_varlen(q, kc, vc, tables, cu, starts, hd**-0.5,
                                                                  max_seqlen_q=chunk), io)
            note = f"{flops / t / 1e12:.1f} TFLOP/s"
            if start == 0:
                qs = q.view(n, chunk, hq, hd).transpose(1, 2)
                t_sdpa = self.row(f"torch SDPA causal, contiguous KV, {n} x {chunk} tokens",
                                  lambda: F.scaled_dot_product_attention(qs, kcont, vcont, is_causal=True,
                                                                         enable_gqa=True), io)
                self.rows[-1] = (*self.rows[-1][:3], f"{flops / t_sdpa / 1e12:.1f} TFLOP/s")
                note += f", {t_sdpa / t:.2f}x SDPA's speed"
            self.rows[at] = (*self.rows[at][:3], note)

    def stores_and_copies(self, dtype) -> None:  # type: ignore[no-untyped-def]
        torch, k, s = self.torch, self.kernels, self.s
        kc, vc, tables = self._paged(dtype, s.batch, s.context)
        nb, kvh, hd, bs = kc.shape[0], s.kv_heads, s.head_dim, s.block_size
        for tokens in s.store_tokens:
            key = torch.randn(tokens, kvh, hd, device=self.device).to(dtype)
            blocks = torch.randperm(nb, device=self.device)[: -(-tokens // bs)]  # a prefill's shuffled blocks
            slots = (blocks[:, None] * bs + torch.arange(bs, device=self.device)).reshape(-1)[:tokens]
            self.row(f"store_kv, {tokens} tokens", lambda: k.store_kv(key, key, kc, vc, slots),
                     2 * 2 * key.numel() * key.element_size())
        (k8, ks), (v8, vs) = k.quantize_kv_fp8(kc), k.quantize_kv_fp8(vc)
        touched = 2 * 2 * slots.numel() * kvh * hd  # read + write each touched fp8 block, K and V
        self.row(f"store_kv_quantized (fp8), {tokens} tokens", lambda: k.store_kv_quantized(key, key, k8, v8, ks, vs,
                                                                                            slots),
                 2 * key.numel() * key.element_size() + touched)
        ki, kis = self._int8(kc)
        vi, vis = ki.clone(), kis.clone()
        self.row(f"store_kv_quantized (int8), {tokens} tokens",
                 lambda: k.store_kv_quantized(key, key, ki, vi, kis, vis, slots),
                 2 * key.numel() * key.element_size() + 2 * slots.numel() * kvh * (hd + 4))  # rows in, int8 + scale out
        ids = tables.reshape(-1)[: nb // 2].long()
        blk_bytes = 2 * ids.numel() * bs * kvh * hd * kc.element_size()
        self.row(f"pack_blocks, {ids.numel()} blocks", lambda: k.pack_blocks(kc, vc, ids), 2 * blk_bytes)
        buf = k.pack_blocks(kc, vc, ids)
        self.row(f"unpack_blocks, {ids.numel()} blocks", lambda: k.unpack_blocks(buf, kc, vc, ids), 2 * blk_bytes)
        self.row(f"quantize_kv_fp8, {nb} blocks", lambda: k.quantize_kv_fp8(kc), kc.numel() * (kc.element_size() + 1))
        self.row(f"dequantize_kv_fp8, {nb} blocks", lambda: k.dequantize_kv_fp8(k8, ks, dtype),
                 kc.numel() * (kc.element_size() + 1))

    def moe(self, dtype) -> None:  # type: ignore[no-untyped-def]
        """The fused MoE kernel against the copy bandwidth of the expert weights it reads (each expert that got a
        token, read once), and the torch grouped path beside it."""
        from pdkernels import grouped_moe

        torch, k = self.torch, self.kernels
        e, h, i, top_k = self.s.moe_shape
        gate_up = (torch.randn(e, 2 * i, h, device=self.device) * h**-0.5).to(dtype)
        down = (torch.randn(e, h, i, device=self.device) * i**-0.5).to(dtype)
        for t in self.s.moe_tokens:
            x = torch.randn(t, h, device=self.device).to(dtype)
            w, ids = torch.topk(torch.softmax(torch.randn(t, e, device=self.device), -1), top_k, dim=-1)
            hit = int(torch.unique(ids).numel())  # the benchmark reads it once, outside the timed calls
            weight_bytes = hit * 3 * i * h * gate_up.element_size()
            io = weight_bytes + 2 * x.numel() * x.element_size()
            at = len(self.rows)
            t_fused = self.row(f"fused MoE, {dtype_name(dtype)}, {t} tokens, {e} experts top-{top_k} ({hit} hit)",
                               lambda: k.fused_moe(x, gate_up, down, ids, w, "silu"), io)
            flops = 2 * t * top_k * 3 * i * h
            t_torch = self.row(f"torch grouped MoE, {t} tokens",
                               lambda: grouped_moe.grouped_moe(x, gate_up, down, ids, w, "silu"), io)
            self.rows[at] = (*self.rows[at][:3], f"{flops / t_fused / 1e12:.1f} TFLOP/s, "
                                                 f"{t_torch / t_fused:.2f}x the torch path's speed")

    def sweep(self, smoke: bool) -> None:
        """Decode (bf16, FP8) and prefill under each launch setting of the sweeps; the module constants are
        restored after each. A setting that fails to compile (too much shared memory) is reported, not fatal."""
        from pdkernels import triton_kv, triton_prefill

        torch, k, s = self.torch, self.kernels, self.s
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        b, ctx, hd = s.batch, s.context, s.head_dim
        kc, vc, tables = self._paged(dtype, b, ctx)
        (k8, ks), (v8, vs) = k.quantize_kv_fp8(kc), k.quantize_kv_fp8(vc)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=self.device)
        q = torch.randn(b, s.kv_heads * s.group, hd, device=self.device).to(dtype)
        kv_bytes = 2 * b * ctx * s.kv_heads * hd * kc.element_size()
        n, L = s.prefill_seqs, s.prefill_len
        pc, pv, ptables = self._paged(dtype, n, L)
        pq = torch.randn(n * L, s.kv_heads * s.group, hd, device=self.device).to(dtype)
        cu = torch.arange(0, n * L + 1, L, dtype=torch.int32, device=self.device)
        starts = torch.zeros(n, dtype=torch.int32, device=self.device)
        flops = 4 * n * s.kv_heads * s.group * hd * L * (L + 1) // 2
        ids = tables.reshape(-1)[: kc.shape[0] // 2].long()
        blk_bytes = 2 * ids.numel() * kc[0].numel() * kc.element_size()
        key = torch.randn(s.store_tokens[-1], s.kv_heads, hd, device=self.device).to(dtype)
        slots = torch.randperm(kc.shape[0] * s.block_size, device=self.device)[: key.shape[0]]
        cases = [
            ("decode " + dtype_name(dtype), triton_kv, DECODE_SWEEP, kv_bytes,
             lambda: k.paged_decode_attention(q, kc, vc, tables, lens, hd**-0.5, num_splits=1)),
            ("decode fp8 cache", triton_kv, FP8_SWEEP, kv_bytes // 2,
             lambda: k.paged_decode_attention(q, k8, v8, tables, lens, hd**-0.5, None, ks, vs, num_splits=1)),
            ("varlen prefill (TFLOP/s)", triton_prefill, PREFILL_SWEEP, -flops,
             lambda: k.paged_prefill_attention_varlen(pq, pc, pv, ptables, cu, starts, hd**-0.5, max_seqlen_q=L)),
            (f"pack_blocks, {ids.numel()} blocks", triton_kv, COPY_SWEEP, 2 * blk_bytes,
             lambda: k.pack_blocks(kc, vc, ids)),
            (f"store_kv, {key.shape[0]} tokens, random slots", triton_kv, STORE_SWEEP,
             4 * key.numel() * key.element_size(), lambda: k.store_kv(key, key, kc, vc, slots)),
        ]
        for label, mod, configs, amount, fn in cases:
            for cfg in configs[:1] if smoke else configs:
                saved = {name: getattr(mod, name) for name in cfg}
                try:
                    for name, value in cfg.items():
                        setattr(mod, name, value)
                    self.sweep_rows.append((label, cfg, self.timeit(fn)[0], amount))
                except Exception as e:  # noqa: BLE001 -- e.g. out of shared memory: reported
                    self.sweep_rows.append((label, cfg, None, f"{type(e).__name__}: {str(e)[:80]}"))
                    if self.device == "cuda":
                        torch.cuda.synchronize()
                finally:
                    for name, value in saved.items():
                        setattr(mod, name, value)

    # -- report --------------------------------------------------------------------------------------------------
    def report(self, argv: list[str]) -> str:
        torch = self.torch
        gpu = torch.cuda.get_device_name() if self.device == "cuda" else platform.processor() or "cpu"
        try:
            import triton

            tv = triton.__version__
        except ImportError:
            tv = "none"
        lines = [
            "# Kernel results",
            "",
            f"Device: {gpu}; torch {torch.__version__}; triton {tv}; "
            f"Triton path: {self.kernels.uses_triton(torch.empty(1, device=self.device))}.",
            f"Command: `python {' '.join(['benchmarks/bench_kernels.py', *argv])}`",
            "",
            f"Copy bandwidth (read + write, same run): {self.bw / 1e9:.0f} GB/s.",
            "",
            "| kernel | time | GB/s | share of copy bandwidth | note |",
            "|---|---|---|---|---|",
        ]
        for what, t, nbytes, note in self.rows:
            gbs = f"{nbytes / t / 1e9:.0f}" if nbytes else "-"
            share = f"{nbytes / t / self.bw:.0%}" if nbytes else "-"
            lines.append(f"| {what} | {t * 1e6:.1f} us | {gbs} | {share} | {note} |")
        if self.sweep_rows:
            lines += ["", "## Launch-settings sweep", "",
                      "Each kernel under each setting (module constants of `pdkernels/triton_kv.py` and "
                      "`pdkernels/triton_prefill.py`); * marks the fastest, (current) the default in the code.", "",
                      "| kernel | settings | time | share of copy bandwidth or TFLOP/s |", "|---|---|---|---|"]
            from pdkernels import triton_kv, triton_prefill

            best: dict[str, float] = {}
            for label, _, t, _ in self.sweep_rows:
                if t is not None:
                    best[label] = min(best.get(label, t), t)
            for label, cfg, t, amount in self.sweep_rows:
                mod = triton_prefill if "prefill" in label else triton_kv
                current = all(getattr(mod, name) == value for name, value in cfg.items())
                settings = ", ".join(f"{name}={value}" for name, value in cfg.items())
                settings += " (current)" if current else ""
                if t is None:
                    lines.append(f"| {label} | {settings} | failed | {amount} |")
                    continue
                assert isinstance(amount, (int, float))
                value = f"{-amount / t / 1e12:.1f}" if amount < 0 else f"{amount / t / self.bw:.0%}"
                lines.append(f"| {label} | {settings} | {t * 1e6:.1f} us{' *' if t == best[label] else ''} | {value} |")
        return "\n".join(lines) + "\n"


def dtype_name(dtype) -> str:  # type: ignore[no-untyped-def]
    return str(dtype).removeprefix("torch.")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
