"""Triton kernels for the KV cache: paged decode attention, KV store, block pack/unpack, FP8 (de)quantization.

Run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (exact for float32/float16; the interpreter's
bfloat16 arithmetic is wrong, so bfloat16 is checked on a GPU only). The argument checks live in
:mod:`kernels`; these launchers assume valid arguments. Layouts are those of :mod:`kernels.reference`: per layer
``k_cache``/``v_cache`` ``[num_blocks, block_size, kv_heads, head_dim]`` with each block contiguous (the block stride
may be anything, so views of one ``[2, num_blocks, ...]`` tensor work).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # largest finite float8_e4m3fn
TOKEN_TILE = 32  # context tokens per step of the decode kernel's online softmax (spans blocks of any size)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr,
    scale, window,
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_sb,
    stride_bts,
    stride_os, stride_oh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, TILE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SCALES: tl.constexpr,
):
    """One program per (sequence, kv head): the GROUP query heads sharing that kv head, online softmax over tiles."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    seq_len = tl.load(lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for start in range((lo // TILE) * TILE, seq_len, TILE):
        t = start + tl.arange(0, TILE)
        t_ok = (t < seq_len) & (t >= lo)
        blk = tl.load(bt_ptr + seq * stride_bts + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        base = blk * stride_kb + (t % BLOCK_SIZE) * stride_kt + kvh * stride_kh
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if HAS_SCALES:  # FP8 cache: one scale per (block, kv head)
            k = (k.to(tl.float32) * tl.load(ks_ptr + blk * stride_sb + kvh, mask=t_ok, other=0.0)[:, None])
            v = (v.to(tl.float32) * tl.load(vs_ptr + blk * stride_sb + kvh, mask=t_ok, other=0.0)[:, None])
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [GROUP_PAD, TILE], fp32 accumulation
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`kernels.reference.paged_decode_attention`; ``k_scales``/``v_scales`` for an FP8 cache."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    has_scales = k_scales is not None
    ks = k_scales if has_scales else q  # any tensor: never read
    vs = v_scales if has_scales else q
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, out,
        float(scale), int(sliding_window or 0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0) if has_scales else 0,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        # tl.dot needs every dimension >= 16
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)), TILE=TOKEN_TILE,
        HAS_WINDOW=sliding_window is not None, HAS_SCALES=has_scales,
    )
    return out


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_ptr, v_ptr, slot_ptr, stride_kt, stride_vt, stride_kb,
                     BLOCK_SIZE: tl.constexpr, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    """One program per token: its [kv_heads * head_dim] row into its slot, unless the slot is -1."""
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    i = tl.arange(0, ROW_PAD)
    ok = (i < ROW) & (slot >= 0)
    dst = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * ROW + i
    k = tl.load(key_ptr + tok * stride_kt + i, mask=ok)
    v = tl.load(value_ptr + tok * stride_vt + i, mask=ok)
    tl.store(k_ptr + dst, k.to(k_ptr.dtype.element_ty), mask=ok)
    tl.store(v_ptr + dst, v.to(v_ptr.dtype.element_ty), mask=ok)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """See :func:`kernels.reference.store_kv`. Mutates the caches."""
    if key.shape[0] == 0:
        return
    key = key.reshape(key.shape[0], -1)
    value = value.reshape(value.shape[0], -1)
    if key.stride(1) != 1:
        key = key.contiguous()
    if value.stride(1) != 1:
        value = value.contiguous()
    row = key.shape[1]
    _store_kv_kernel[(key.shape[0],)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
                                      k_cache.stride(0), BLOCK_SIZE=k_cache.shape[1], ROW=row,
                                      ROW_PAD=triton.next_power_of_2(row))


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, ids_ptr, stride_src, stride_dst, numel, PACK: tl.constexpr,
                        CHUNK: tl.constexpr):
    """One program per (block, chunk): copy CHUNK elements of a block between the cache and the packed buffer."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    blk = tl.load(ids_ptr + b).to(tl.int64)
    i = c * CHUNK + tl.arange(0, CHUNK)
    ok = i < numel
    if PACK:
        x = tl.load(src_ptr + blk * stride_src + i, mask=ok)
        tl.store(dst_ptr + b * stride_dst + i, x.to(dst_ptr.dtype.element_ty), mask=ok)
    else:
        x = tl.load(src_ptr + b * stride_src + i, mask=ok)
        tl.store(dst_ptr + blk * stride_dst + i, x.to(dst_ptr.dtype.element_ty), mask=ok)


def _copy_grid(block_ids: torch.Tensor, numel: int) -> tuple[tuple[int, int], int]:
    chunk = min(4096, triton.next_power_of_2(numel))
    return (block_ids.shape[0], triton.cdiv(numel, chunk)), chunk


def pack_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """See :func:`kernels.reference.pack_blocks`. Pure."""
    n = block_ids.shape[0]
    buf = torch.empty((2, n, *k_cache.shape[1:]), dtype=k_cache.dtype, device=k_cache.device)
    numel = k_cache[0].numel()
    if n == 0:
        return buf
    grid, chunk = _copy_grid(block_ids, numel)
    for i, cache in enumerate((k_cache, v_cache)):
        _copy_blocks_kernel[grid](cache, buf[i], block_ids, cache.stride(0), numel, numel, PACK=True, CHUNK=chunk)
    return buf


def unpack_blocks(buf: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """See :func:`kernels.reference.unpack_blocks`. Mutates the caches."""
    n = block_ids.shape[0]
    numel = k_cache[0].numel()
    if n == 0:
        return
    buf = buf.contiguous()
    grid, chunk = _copy_grid(block_ids, numel)
    for i, cache in enumerate((k_cache, v_cache)):
        _copy_blocks_kernel[grid](buf[i], cache, block_ids, numel, cache.stride(0), numel, PACK=False, CHUNK=chunk)


@triton.jit
def _round_mantissa_3(a):
    """Non-negative float32 ``a`` rounded half-to-even to 3 mantissa bits, in float32 (integer bit arithmetic)."""
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3_grid(y):
    """``y`` (float32, within +-448) rounded half-to-even onto float8_e4m3fn's values, still in float32.

    The cast that follows is then exact everywhere; the Triton interpreter's own float32 -> fp8 cast truncates.
    Below 2**-6 (subnormals: multiples of 2**-9) the same 3-bit rounding runs on ``|y| + 2**-6``.
    """
    a = tl.abs(y)
    r = tl.where(a < 0.015625, _round_mantissa_3(a + 0.015625) - 0.015625, _round_mantissa_3(a))
    sign = y.to(tl.int32, bitcast=True) & -0x80000000
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_kernel(x_ptr, y_ptr, s_ptr, stride_xb, stride_xt, stride_yb, stride_yt, num_heads,
                BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, T_PAD: tl.constexpr, D_PAD: tl.constexpr,
                QUANTIZE: tl.constexpr):
    """One program per (block, kv head): quantize with a fresh scale, or dequantize with the stored one."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.arange(0, T_PAD)
    d = tl.arange(0, D_PAD)
    ok = (t[:, None] < BLOCK_SIZE) & (d[None, :] < HEAD_DIM)
    src = x_ptr + b.to(tl.int64) * stride_xb + t[:, None] * stride_xt + h * HEAD_DIM + d[None, :]
    dst = y_ptr + b.to(tl.int64) * stride_yb + t[:, None] * stride_yt + h * HEAD_DIM + d[None, :]
    x = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    if QUANTIZE:
        s = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0) / 448.0, 1e-12)
        y = _to_e4m3_grid(tl.minimum(tl.maximum(x / s, -448.0), 448.0))
        tl.store(s_ptr + b * num_heads + h, s)
    else:
        y = x * tl.load(s_ptr + b * num_heads + h)
    tl.store(dst, y.to(y_ptr.dtype.element_ty), mask=ok)


def _fp8_launch(x: torch.Tensor, y: torch.Tensor, scales: torch.Tensor, quantize: bool) -> None:
    nb, bs, nh, hd = x.shape
    if nb == 0:
        return
    _fp8_kernel[(nb, nh)](x, y, scales, x.stride(0), x.stride(1), y.stride(0), y.stride(1), nh,
                          BLOCK_SIZE=bs, HEAD_DIM=hd, T_PAD=triton.next_power_of_2(bs),
                          D_PAD=triton.next_power_of_2(hd), QUANTIZE=quantize)


def quantize_kv_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`kernels.reference.quantize_kv_fp8`. Pure."""
    x = x if x[0:1].is_contiguous() else x.contiguous()
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((x.shape[0], x.shape[2]), dtype=torch.float32, device=x.device)
    _fp8_launch(x, q, scales, quantize=True)
    return q, scales


def dequantize_kv_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """See :func:`kernels.reference.dequantize_kv_fp8`. Pure."""
    q = q if q[0:1].is_contiguous() else q.contiguous()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    _fp8_launch(q, out, scales.contiguous().float(), quantize=False)
    return out
