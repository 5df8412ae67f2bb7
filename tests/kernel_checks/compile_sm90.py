"""Compile every Triton kernel of ``pdkernels/`` for an H100/H200 (sm_90) down to a cubin, without a GPU.

    python tests/kernel_checks/compile_sm90.py          # prints one line per case; exit 1 if any fails

The interpreter runs the kernels' Python, not Triton's compiler, so it accepts what a GPU build rejects (a plain
global inside a kernel, a shape the layout passes refuse). ``triton.compile`` with an explicit target needs no device:
code generation, the MLIR passes and ``ptxas`` (shipped in Triton's wheel) all run on the CPU. It must run in a
process where Triton was never imported under ``TRITON_INTERPRET=1`` (Triton's own library functions would be
interpreted ones), hence a script that ``test_compile_sm90.py`` starts. One launch configuration per kernel, as the
launchers pick them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)
import triton  # noqa: E402

KERNELS = Path(__file__).resolve().parents[2] / "pdkernels"
I32, I32_16 = ("i32", False), ("i32", True)  # an integer argument, and one divisible by 16 (as Triton specializes)


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_sm90_{name}", KERNELS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(fn: Any, args: dict[str, Any], num_warps: int, num_stages: int) -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(fn.arg_names):
        v = args[name]
        if isinstance(v, str):  # a pointer, 16-byte aligned
            sig[name] = v
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, tuple):
            sig[name] = v[0]
            if v[1]:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            sig[name], consts[name] = "constexpr", v
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


CASES = ["decode_bf16_split", "decode_fp8", "decode_int8", "decode_reduce", "prefill_bf16_window", "prefill_fp8",
         "prefill_int8", "store_kv", "store_fp8", "store_int8", "copy_blocks", "copy_between", "fp8_quantize",
         "payload_mac", "moe_gate_up", "moe_down", "mla_decode_bf16", "mla_decode_fp8", "mla_prefill_bf16",
         "mla_prefill_fp8", "quant_int8", "quant_int4", "quant_fp8_block", "quant_fp8_channel",
         "quant_moe_fp8_gate_up", "quant_moe_fp8_down"]
CACHE_TYPES = {"fp8": "*fp8e4nv", "int8": "*i8"}


def compile_case(case: str, kv: ModuleType, pf: ModuleType, i8: ModuleType) -> None:
    """Compile the kernel(s) of one case; raises on any compiler error."""
    if case == "payload_mac":  # the payload MAC's row sums (int8 bytes, int32 weight halves, int64 sums)
        mac = _load("triton_mac")
        _compile(mac._row_sums_kernel, dict(x_ptr="*i8", w_ptr="*i32", out_ptr="*i64", num_rows=I32, pad=I32,
                                            ROW=2048, ROWS=mac.MAC_ROWS, TILE=mac.MAC_TILE), mac.MAC_WARPS, 2)
        return
    if case.startswith("quant_"):  # the quantized-weight GEMMs, bfloat16 activations, as the launchers pick them
        compile_quant(case)
        return
    if case.startswith("mla_prefill"):  # MLA varlen prefill over the latent cache, DeepSeek-V3's shape
        mlp = _load("triton_mla_prefill")
        scaled = case == "mla_prefill_fp8"
        cache = "*fp8e4nv" if scaled else "*bf16"
        heads, block_m = mlp.launch_shape(128, False)
        _compile(mlp._mla_prefill_kernel, dict(
            q_ptr="*bf16", k_ptr=cache, v_ptr=cache, ks_ptr="*fp32", vs_ptr="*fp32", bt_ptr="*i32", cu_ptr="*i32",
            start_ptr="*i32", out_ptr="*bf16", scale_log2=0.1, num_heads=I32, stride_qt=I32_16, stride_qh=I32_16,
            stride_kb=I32_16, stride_kt=I32_16, stride_vb=I32_16, stride_vt=I32_16, stride_sb=I32, stride_st=I32,
            stride_bts=I32, stride_ot=I32_16, stride_oh=I32_16, BLOCK_SIZE=16, RANK=512, RANK_PAD=512, ROPE=64,
            ROPE_PAD=64, PLANE=288, HEADS=heads, BLOCK_M=block_m, TILE=mlp.TILE_N, HAS_SCALES=scaled),
            mlp.WARPS, mlp.STAGES_SCALED if scaled else mlp.STAGES)
        return
    if case.startswith("mla_"):  # MLA decode over the latent cache, DeepSeek-V3's shape (rank 512 + rope 64)
        mla = _load("triton_mla")
        scaled = case == "mla_decode_fp8"
        cache = "*fp8e4nv" if scaled else "*bf16"
        _compile(mla._mla_decode_kernel, dict(
            q_ptr="*bf16", k_ptr=cache, v_ptr=cache, ks_ptr="*fp32", vs_ptr="*fp32", bt_ptr="*i32", lens_ptr="*i32",
            out_ptr="*bf16", scale_log2=0.1, num_heads=I32, stride_qs=I32_16, stride_qh=I32_16, stride_kb=I32_16,
            stride_kt=I32_16, stride_vb=I32_16, stride_vt=I32_16, stride_sb=I32, stride_st=I32, stride_bts=I32,
            stride_os=I32_16, stride_oh=I32_16, BLOCK_SIZE=16, RANK=512, RANK_PAD=512, ROPE=64, ROPE_PAD=64,
            PLANE=288, HEADS=mla.HEAD_TILE, TILE=mla.CTX_TILE, HAS_SCALES=scaled), mla.WARPS, 2)
        return
    if case.startswith("moe_"):  # the fused MoE's two kernels, bfloat16, the tall (prefill) blocks
        moe = _load("triton_moe")
        args = dict(w_ptr="*bf16", out_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32", num_assign=I32,
                    hidden=I32_16, inter=I32_16, stride_we=I32_16, stride_wn=I32_16, stride_ot=I32_16,
                    NUM_EXPERTS=128, PRECISION=triton.language.constexpr("tf32"), BLOCK_M=moe.BLOCK_M_LARGE,
                    BLOCK_N=moe.BLOCK_N, BLOCK_K=moe.BLOCK_K)
        if case == "moe_gate_up":
            _compile(moe._gate_up_kernel, dict(args, x_ptr="*bf16", top_k=I32, stride_xt=I32_16, ACT=0),
                     moe.MOE_WARPS, moe.MOE_STAGES)
        else:
            _compile(moe._down_kernel, dict(args, h_ptr="*bf16", wt_ptr="*fp32", stride_ht=I32_16), moe.MOE_WARPS,
                     moe.MOE_STAGES)
        return
    attn = dict(bt_ptr="*i32", ks_ptr="*fp32", vs_ptr="*fp32", scale_log2=0.1, window=I32, stride_kb=I32_16,
                stride_kt=I32_16, stride_kh=I32_16, stride_vb=I32_16, stride_vt=I32_16, stride_vh=I32_16,
                stride_sb=I32, stride_st=I32, stride_sh=I32, stride_bts=I32, BLOCK_SIZE=16, HEAD_DIM=128,
                DIM_PAD=128)
    if case.startswith("decode_") and case != "decode_reduce":
        fp8 = case in ("decode_fp8", "decode_int8")  # the scaled caches
        cache = CACHE_TYPES.get(case.split("_")[1], "*bf16")
        args = dict(attn, q_ptr="*bf16", k_ptr=cache, v_ptr=cache, lens_ptr="*i32", out_ptr="*bf16",
                    part_ptr="*fp32", ml_ptr="*fp32", stride_qs=I32_16, stride_qh=I32_16, stride_os=I32_16,
                    stride_oh=I32_16, GROUP=4, GROUP_PAD=16, TILE=kv.DECODE_TILE_FP8 if fp8 else kv.DECODE_TILE,
                    NUM_SPLITS=1 if fp8 else 8, HAS_WINDOW=not fp8, HAS_SCALES=fp8)
        _compile(kv._paged_decode_kernel, args, kv.DECODE_WARPS_FP8 if fp8 else kv.DECODE_WARPS,
                 kv.DECODE_STAGES_FP8 if fp8 else kv.DECODE_STAGES)
    elif case == "decode_reduce":
        _compile(kv._decode_reduce_kernel, dict(part_ptr="*fp32", ml_ptr="*fp32", out_ptr="*bf16", stride_os=I32_16,
                                                stride_oh=I32_16, GROUP=4, GROUP_PAD=16, HEAD_DIM=128, DIM_PAD=128,
                                                NUM_SPLITS=9, SPLITS_PAD=16), 4, 2)
    elif case.startswith("prefill_"):
        fp8 = case in ("prefill_fp8", "prefill_int8")
        cache = CACHE_TYPES.get(case.split("_")[1], "*bf16")
        args = dict(attn, q_ptr="*bf16", k_ptr=cache, v_ptr=cache, cu_ptr="*i32", start_ptr="*i32", out_ptr="*bf16",
                    stride_qt=I32_16, stride_qh=I32_16, stride_ot=I32_16, stride_oh=I32_16, GROUP=4, GROUP_PAD=4,
                    BLOCK_M=pf.PREFILL_ROWS // 4, TILE_N=pf.PREFILL_TILE_N, HAS_WINDOW=not fp8, HAS_SCALES=fp8)
        _compile(pf._prefill_varlen_kernel, args, 8, pf.PREFILL_STAGES)
    elif case == "store_kv":
        _compile(kv._store_kv_kernel, dict(key_ptr="*bf16", value_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16",
                                           slot_ptr="*i64", num_tokens=I32, stride_kt=I32_16, stride_vt=I32_16,
                                           stride_kb=I32_16, stride_vb=I32_16, BLOCK_SIZE=16, ROW=1024, TOKENS=4,
                                           COLS=1024), 4, 2)
    elif case == "store_fp8":
        _compile(kv._claim_slots_kernel, dict(slot_ptr="*i64", writer_ptr="*i32", num_tokens=I32, TOKENS=1024), 4, 2)
        scale_strides = dict(stride_ksb=I32, stride_ksh=I32, stride_vsb=I32, stride_vsh=I32)
        _compile(kv._fp8_scales_kernel, dict(
            key_ptr="*bf16", value_ptr="*bf16", ks_ptr="*fp32", vs_ptr="*fp32", slot_ptr="*i64", writer_ptr="*i32",
            num_tokens=I32, stride_kt=I32_16, stride_kh=I32_16, stride_vt=I32_16, stride_vh=I32_16, **scale_strides,
            BLOCK_SIZE=16, BS_PAD=16, HEAD_DIM=128, DIM_PAD=128), 4, 2)
        _compile(kv._store_fp8_rows_kernel, dict(
            key_ptr="*bf16", value_ptr="*bf16", k_ptr="*fp8e4nv", v_ptr="*fp8e4nv", ks_ptr="*fp32", vs_ptr="*fp32",
            slot_ptr="*i64", num_tokens=I32, stride_kt=I32_16, stride_vt=I32_16, stride_kb=I32_16, stride_vb=I32_16,
            **scale_strides, BLOCK_SIZE=16, HEAD_DIM=128, ROW=1024, TOKENS=4, COLS=1024), kv.STORE_WARPS, 2)
    elif case == "store_int8":
        _compile(i8._store_int8_kernel, dict(
            key_ptr="*bf16", value_ptr="*bf16", k_ptr="*i8", v_ptr="*i8", ks_ptr="*fp32", vs_ptr="*fp32",
            slot_ptr="*i64", num_tokens=I32, stride_kt=I32_16, stride_kh=I32_16, stride_vt=I32_16, stride_vh=I32_16,
            stride_kb=I32_16, stride_vb=I32_16, stride_ksb=I32, stride_kst=I32, stride_ksh=I32,
            stride_vsb=I32, stride_vst=I32, stride_vsh=I32, BLOCK_SIZE=16, ROW=1024, HEAD_DIM=128, DIM_PAD=128,
            TOKENS=i8.STORE_INT8_ELEMS // 128), i8.STORE_INT8_WARPS, 2)
    elif case in ("copy_blocks", "copy_between"):  # pack (ids on the source side) / between two caches
        _compile(kv._copy_blocks_kernel, dict(k_src="*bf16", v_src="*bf16", k_dst="*bf16", v_dst="*bf16",
                                              src_ids="*i64", dst_ids="*i64", stride_ks=I32_16, stride_vs=I32_16,
                                              stride_kd=I32_16, stride_vd=I32_16, numel=I32_16, SRC_IDS=True,
                                              DST_IDS=case == "copy_between", CHUNK=kv.COPY_CHUNK), kv.COPY_WARPS, 2)
    else:
        _compile(kv._fp8_kernel, dict(x_ptr="*bf16", y_ptr="*fp8e4nv", s_ptr="*fp32", stride_xb=I32_16,
                                      stride_xt=I32_16, stride_yb=I32_16, stride_yt=I32_16, num_heads=I32,
                                      BLOCK_SIZE=16, HEAD_DIM=128, T_PAD=16, D_PAD=128, QUANTIZE=True), 4, 2)


def compile_quant(case: str) -> None:
    """One of :mod:`pdkernels.triton_quant`'s GEMMs: W8A8, W4A16 (asymmetric), FP8 with DeepSeek's 128 x 128 block
    scales and FP8 per channel (both with FP8 tiles in the dot, as on sm_90)."""
    q = _load("triton_quant")
    if case.startswith("quant_moe"):  # the fused MoE over block-scaled FP8 experts, DeepSeek-V3's 128 x 128
        qm = _load("triton_quant_moe")
        args = dict(w_ptr="*fp8e4nv", ws_ptr="*fp32", out_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32",
                    num_assign=I32, hidden=I32_16, inter=I32_16, stride_we=I32_16, stride_wn=I32_16, stride_wse=I32,
                    stride_wsn=I32, stride_ot=I32_16, BN=I32_16, BK=I32_16, NUM_EXPERTS=256, FP8_DOT=True,
                    BLOCK_M=64, BLOCK_N=qm.BLOCK_N, BLOCK_K=128)
        if case == "quant_moe_fp8_gate_up":
            _compile(qm._fp8_gate_up_kernel, dict(args, x_ptr="*fp8e4nv", xs_ptr="*fp32", top_k=I32,
                                                  stride_xt=I32_16, stride_xst=I32, ACT=0), qm.MOE_WARPS,
                     qm.MOE_STAGES)
        else:
            _compile(qm._fp8_down_kernel, dict(args, h_ptr="*fp8e4nv", hs_ptr="*fp32", wt_ptr="*fp32",
                                               stride_ht=I32_16, stride_hst=I32), qm.MOE_WARPS, qm.MOE_STAGES)
        return
    tiles = dict(BLOCK_M=q.BLOCK_M, BLOCK_N=q.BLOCK_N, BLOCK_K=q.BLOCK_K)
    common = dict(bias_ptr="*bf16", out_ptr="*bf16", M=I32, N=I32_16, K=I32_16, stride_om=I32_16, HAS_BIAS=True)
    if case == "quant_int8":
        _compile(q._int8_gemm_kernel, dict(common, x_ptr="*i8", w_ptr="*i8", xs_ptr="*fp32", ws_ptr="*fp32",
                                           stride_xm=I32_16, stride_wn=I32_16, **tiles), q.QUANT_WARPS, q.QUANT_STAGES)
    elif case == "quant_int4":
        _compile(q._int4_gemm_kernel, dict(common, x_ptr="*bf16", p_ptr="*u8", s_ptr="*fp32", z_ptr="*u8",
                                           group_size=I32_16, stride_xm=I32_16, stride_pn=I32_16, stride_sn=I32,
                                           HAS_ZERO=True, PRECISION=triton.language.constexpr("tf32"), **tiles),
                 q.QUANT_WARPS, q.QUANT_STAGES)
    else:
        blocked = case == "quant_fp8_block"
        _compile(q._fp8_gemm_kernel, dict(
            common, x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", xs_ptr="*fp32", ws_ptr="*fp32", stride_xm=I32_16,
            stride_wn=I32_16, stride_xsm=I32, stride_wsn=I32, BN=I32_16, BK=I32_16, BLOCK_SCALED=blocked,
            FP8_DOT=True, PRECISION=triton.language.constexpr("tf32"),
            **dict(tiles, BLOCK_K=q.fp8_block_k(128) if blocked else q.BLOCK_K)), q.QUANT_WARPS, q.QUANT_STAGES)


def main() -> int:
    if "nvidia" not in triton.backends.backends:
        print("skip: this Triton has no NVIDIA backend")
        return 0
    kv, pf, i8 = _load("triton_kv"), _load("triton_prefill"), _load("triton_int8")
    failed = 0
    for case in CASES:
        try:
            compile_case(case, kv, pf, i8)
            print(f"compiled {case}")
        except Exception:  # noqa: BLE001 -- report every case
            failed += 1
            print(f"FAILED {case}\n{traceback.format_exc()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
