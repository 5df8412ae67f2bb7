"""Triton store into an int8 KV cache: each token's K and V row (per kv head) rounded to 255 levels of its own
largest magnitude, with that float32 scale beside it (``scales[block, offset, head]``), bit-identical to
:func:`pdkernels.reference.store_kv_int8`.

Run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (exact for float32/float16 inputs). The argument
checks live in :mod:`kernels`; the launcher assumes valid arguments. Layouts are those of :mod:`pdkernels.reference`:
``k_cache``/``v_cache`` int8 ``[num_blocks, block_size, kv_heads, head_dim]`` with each block contiguous (any block
stride), scales float32 ``[num_blocks, block_size, kv_heads]`` (any strides). Kept apart from
:mod:`pdkernels.triton_kv` for size; :func:`pdkernels.store_kv_quantized` dispatches an int8 cache here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of one kv head's rows per program (tokens x padded head_dim), for K and for V: a decode step's tokens in
# one program per head, a prefill chunk in a few. Unmeasured first choice, like pdkernels.triton_kv.STORE_ELEMS.
STORE_INT8_ELEMS = 4096
STORE_INT8_WARPS = 4


@triton.jit
def _int8_rows(src_ptr, dst_ptr, sc_ptr, src_off, dst_off, sc_off, live, d, HEAD_DIM: tl.constexpr):
    """One kv head's rows of TOKENS new tokens into an int8 cache, each with its own scale, as
    :func:`pdkernels.reference.quantize_rows_int8` computes them (IEEE divisions, as torch's)."""
    ok = live[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(src_ptr + src_off[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), 127.0), 1e-12)
    y = tl.minimum(tl.maximum(tl.floor(tl.div_rn(x, s[:, None]) + 0.5), -127.0), 127.0)
    tl.store(dst_ptr + dst_off[:, None] + d[None, :], y.to(tl.int8), mask=ok)
    tl.store(sc_ptr + sc_off, s, mask=live)


@triton.jit
def _store_int8_kernel(key_ptr, value_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slot_ptr, num_tokens,
                       stride_kt, stride_kh, stride_vt, stride_vh, stride_kb, stride_vb,
                       stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                       BLOCK_SIZE: tl.constexpr, ROW: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                       TOKENS: tl.constexpr):
    """One program per (TOKENS tokens, kv head): quantize the tokens' K and V rows of that head, each row with its
    own scale, into their slots (value rows and ``scales[block, offset, head]``); slot -1 skips."""
    tok = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    live = slot >= 0
    slot = tl.maximum(slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    tok = tok.to(tl.int64)
    d = tl.arange(0, DIM_PAD)
    cell = off * ROW + h * HEAD_DIM  # the row's place inside its (contiguous) block
    _int8_rows(key_ptr, k_ptr, ks_ptr, tok * stride_kt + h * stride_kh, blk * stride_kb + cell,
               blk * stride_ksb + off * stride_kst + h * stride_ksh, live, d, HEAD_DIM)
    _int8_rows(value_ptr, v_ptr, vs_ptr, tok * stride_vt + h * stride_vh, blk * stride_vb + cell,
               blk * stride_vsb + off * stride_vst + h * stride_vsh, live, d, HEAD_DIM)


def store_kv_int8(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k_scales: torch.Tensor, v_scales: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """See :func:`pdkernels.reference.store_kv_int8`: bit-identical to it. One launch, no host sync. Mutates the
    caches and scales (only the written slots; a slot written twice in one call keeps one writer's row and scale
    per head and K/V, not necessarily the same writer's, as the reference's ``index_copy_`` leaves it open)."""
    n = key.shape[0]
    if n == 0:
        return
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    _, bs, kvh, hd = k_cache.shape
    dim_pad = triton.next_power_of_2(hd)
    tokens = max(1, STORE_INT8_ELEMS // dim_pad)
    _store_int8_kernel[(triton.cdiv(n, tokens), kvh)](
        key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping, n,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0), v_cache.stride(0),
        *k_scales.stride(), *v_scales.stride(),
        BLOCK_SIZE=bs, ROW=kvh * hd, HEAD_DIM=hd, DIM_PAD=dim_pad, TOKENS=tokens, num_warps=STORE_INT8_WARPS)
