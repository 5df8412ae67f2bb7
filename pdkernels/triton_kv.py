"""Triton kernels for the KV cache: paged decode attention (optionally split-K, over plain, FP8 or int8 caches), KV
store (plain and FP8), block pack/unpack, FP8 (de)quantization. The varlen prefill attention lives in
:mod:`pdkernels.triton_prefill`, the int8 store in :mod:`pdkernels.triton_int8`.

Run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (exact for float32/float16; the interpreter's
bfloat16 arithmetic is wrong, so bfloat16 is checked on a GPU only). The argument checks live in
:mod:`kernels`; these launchers assume valid arguments. Layouts are those of :mod:`pdkernels.reference`: per layer
``k_cache``/``v_cache`` ``[num_blocks, block_size, kv_heads, head_dim]`` with each block contiguous (the block stride
may be anything, so views of one ``[2, num_blocks, ...]`` tensor work).

Launch settings (tiles, warps, stages) are module constants chosen for an H100/H200-class GPU from first principles;
none has been measured yet (see docs/kernels.md). Every kernel masks instead of returning early, so it compiles
the same way under every Triton version we support (3.6, 3.7).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_HEADROOM = 32.0  # pdkernels.reference.FP8_HEADROOM: a block's opening scale is 32x its first tokens' amax / 448
FP8_OPEN_DIVISOR = tl.constexpr(FP8_MAX / FP8_HEADROOM)  # opening scale = amax / this (14: exact, as in torch)
LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) == exp2(x * LOG2E)
NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so a split that sees no key yields 0, never NaN
# Decode: context tokens per online-softmax step (spanning blocks of any size). An FP8 or int8 tile holds half the
# bytes, so it takes twice the tokens to keep as many bytes in flight per step; both scaled caches share the *_FP8
# settings (int8 loads one scale per column token, as FP8 does; ptxas, sm_90: 128 registers as FP8's, 214 with the
# bf16 settings).
DECODE_TILE = 64
DECODE_TILE_FP8 = 128
# Warps and pipeline stages: ptxas (sm_90) gives bf16 at TILE 64 with 4 warps, 3 stages 122 registers (4 programs per
# SM; 3 stages is Triton's default, what the first H200 run used); FP8 at TILE 128 with 8 warps, 2 stages 128
# registers (2 per SM; 3 stages: 176, 4 warps: 211). Unmeasured: bench_kernels.py sweeps them.
DECODE_WARPS = 4
DECODE_STAGES = 3
DECODE_WARPS_FP8 = 8
DECODE_STAGES_FP8 = 2
STORE_ELEMS = 4096  # store_kv: elements per program (tokens x a row chunk)
STORE_WARPS = 4
COPY_CHUNK = 8192  # pack/unpack: elements per program
COPY_WARPS = 8


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, ml_ptr,
    scale_log2, window,
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st, stride_sh,
    stride_bts,
    stride_os, stride_oh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SCALES: tl.constexpr,
):
    """One program per (sequence, kv head, split): the GROUP query heads sharing that kv head, online softmax over
    TILE-token steps of the split's share of the context. With one split it writes the output; with more it writes
    the unnormalized partial (acc, max, sum) that ``_decode_reduce_kernel`` combines. A scaled cache's scale of a
    column token sits at ``blk * stride_sb + row * stride_st + kvh * stride_sh``: ``stride_st`` is 0 for FP8 (one
    scale per block and head), the token stride for int8 (one per token and head)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    seq_len = tl.load(lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    first = (lo // TILE) * TILE
    begin = first
    end = seq_len
    if NUM_SPLITS > 1:  # whole tiles per split, so no tile straddles two splits
        per = tl.cdiv(tl.cdiv(tl.maximum(seq_len - first, 0), NUM_SPLITS), TILE) * TILE
        begin = first + split * per
        end = tl.minimum(begin + per, seq_len)
    m_i = tl.full([GROUP_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for start in range(begin, end, TILE):
        t = start + tl.arange(0, TILE)
        t_ok = (t < end) & (t >= lo)
        blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bts + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        row = (t % BLOCK_SIZE).to(tl.int64)
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (blk * stride_kb + row * stride_kt + kvh * stride_kh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (blk * stride_vb + row * stride_vt + kvh * stride_vh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        sc_off = blk * stride_sb + row * stride_st + kvh * stride_sh  # scaled caches only
        if HAS_SCALES:
            # FP8 or int8 cache: e4m3 values and integers up to 127 are exact in q's dtype; the column tokens'
            # scales multiply the scores' columns and the probabilities instead of every K/V element
            k = k.to(tl.float32).to(q.dtype)
            v = v.to(tl.float32).to(q.dtype)
            k_sc = tl.load(ks_ptr + sc_off, mask=t_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * (k_sc * scale_log2)[None, :]
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [GROUP_PAD, TILE], fp32 accumulation
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if HAS_SCALES:
            p = p * tl.load(vs_ptr + sc_off, mask=t_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    if NUM_SPLITS > 1:
        # partials laid out [seq, kv head, split, GROUP_PAD, (DIM_PAD | 2)], written whole (padding included)
        cell = (seq.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS + split
        tl.store(part_ptr + cell * GROUP_PAD * DIM_PAD + g[:, None] * DIM_PAD + d[None, :], acc)
        tl.store(ml_ptr + cell * GROUP_PAD * 2 + g * 2, m_i)
        tl.store(ml_ptr + cell * GROUP_PAD * 2 + g * 2 + 1, l_i)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty context (seq_len 0) gives zeros
        tl.store(out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_reduce_kernel(part_ptr, ml_ptr, out_ptr, stride_os, stride_oh,
                          GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                          DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """One program per (sequence, kv head): combine the splits' partials, one [GROUP_PAD, DIM_PAD] tile at a time
    (few registers). A split that saw no key holds max ``NEG_BIG`` and sum 0, so it weighs nothing; a sequence
    with no key at all yields zeros."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    first = (seq.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS
    ml = ml_ptr + (first + sp[None, :]) * GROUP_PAD * 2 + g[:, None] * 2  # [GROUP_PAD, SPLITS_PAD]
    m = tl.load(ml, mask=(sp < NUM_SPLITS)[None, :], other=NEG_BIG)
    l = tl.load(ml + 1, mask=(sp < NUM_SPLITS)[None, :], other=0.0)
    m_all = tl.max(m, axis=1)
    denom = tl.sum(tl.exp2(m - m_all[:, None]) * l, axis=1)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for i in range(NUM_SPLITS):
        m_s = tl.load(ml_ptr + (first + i) * GROUP_PAD * 2 + g * 2)
        part = tl.load(part_ptr + ((first + i) * GROUP_PAD + g[:, None]) * DIM_PAD + d[None, :])
        acc += part * tl.exp2(m_s - m_all)[:, None]
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    heads = kvh * GROUP + g
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] & (d < HEAD_DIM)[None, :])


def attention_scale_strides(scales: torch.Tensor | None) -> tuple[int, int, int]:
    """A scaled cache's scales as (block, token, head) strides for the attention kernels: FP8's ``[num_blocks,
    kv_heads]`` get token stride 0 (every token of a block shares its scale), int8's ``[num_blocks, block_size,
    kv_heads]`` their own; no scales: zeros (never read)."""
    if scales is None:
        return 0, 0, 0
    return scales.stride(0), scales.stride(1) if scales.dim() == 3 else 0, scales.stride(-1)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None, num_splits: int = 1,
) -> torch.Tensor:
    """See :func:`pdkernels.reference.paged_decode_attention`; ``num_splits`` > 1 runs split-K (partials, then a
    reduce). Scales (FP8 ``[num_blocks, kv_heads]``, int8 ``[num_blocks, block_size, kv_heads]``): K's strides
    serve V's too. Pure; no host sync."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    q = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    has_scales = k_scales is not None
    ks = k_scales if has_scales else q  # any tensor: never read
    vs = v_scales if has_scales else q
    group_pad = max(16, triton.next_power_of_2(group))  # tl.dot needs every dimension >= 16
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part = torch.empty((num_seqs, num_kv_heads, num_splits, group_pad, dim_pad), dtype=torch.float32,
                           device=q.device)
        ml = torch.empty((num_seqs, num_kv_heads, num_splits, group_pad, 2), dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # never written
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, out, part, ml,
        float(scale) * LOG2E, int(sliding_window or 0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *attention_scale_strides(k_scales),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        TILE=DECODE_TILE_FP8 if has_scales else DECODE_TILE, NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None, HAS_SCALES=has_scales,
        num_warps=DECODE_WARPS_FP8 if has_scales else DECODE_WARPS,
        num_stages=DECODE_STAGES_FP8 if has_scales else DECODE_STAGES,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_kv_heads)](
            part, ml, out, out.stride(0), out.stride(1), GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
            DIM_PAD=dim_pad, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4)
    return out


@triton.jit
def _slot_tile(slot_ptr, num_tokens, BLOCK_SIZE: tl.constexpr, ROW: tl.constexpr, TOKENS: tl.constexpr,
               COLS: tl.constexpr):
    """This program's (TOKENS tokens x COLS columns) tile of a store: token ids, columns, the mask (slot -1 skips),
    and each token's block and offset of its row inside the block."""
    tok = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    col = tl.program_id(1) * COLS + tl.arange(0, COLS)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0)[:, None] & (col < ROW)[None, :]
    slot = tl.maximum(slot, 0)
    return tok, col, ok, slot // BLOCK_SIZE, (slot % BLOCK_SIZE) * ROW


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_ptr, v_ptr, slot_ptr, num_tokens, stride_kt, stride_vt, stride_kb,
                     stride_vb, BLOCK_SIZE: tl.constexpr, ROW: tl.constexpr, TOKENS: tl.constexpr,
                     COLS: tl.constexpr):
    """One program per (TOKENS tokens, COLS-element chunk of their [kv_heads * head_dim] rows): a 2-D tile written
    into the tokens' slots with contiguous vector stores; slot -1 skips."""
    tok, col, ok, blk, off = _slot_tile(slot_ptr, num_tokens, BLOCK_SIZE, ROW, TOKENS, COLS)
    tok = tok.to(tl.int64)
    k = tl.load(key_ptr + tok[:, None] * stride_kt + col[None, :], mask=ok)
    v = tl.load(value_ptr + tok[:, None] * stride_vt + col[None, :], mask=ok)
    tl.store(k_ptr + (blk * stride_kb + off)[:, None] + col[None, :], k.to(k_ptr.dtype.element_ty), mask=ok)
    tl.store(v_ptr + (blk * stride_vb + off)[:, None] + col[None, :], v.to(v_ptr.dtype.element_ty), mask=ok)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """``[num_tokens, kv_heads, head_dim]`` as ``[num_tokens, row]`` with unit column stride (a view when possible)."""
    x = x.reshape(x.shape[0], -1)
    return x if x.stride(1) == 1 else x.contiguous()


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """See :func:`pdkernels.reference.store_kv`. Mutates the caches."""
    n = key.shape[0]
    if n == 0:
        return
    key, value = _token_rows(key), _token_rows(value)
    row = key.shape[1]
    cols = min(triton.next_power_of_2(row), STORE_ELEMS)
    tokens = max(1, STORE_ELEMS // cols)
    _store_kv_kernel[(triton.cdiv(n, tokens), triton.cdiv(row, cols))](
        key, value, k_cache, v_cache, slot_mapping, n, key.stride(0), value.stride(0), k_cache.stride(0),
        v_cache.stride(0), BLOCK_SIZE=k_cache.shape[1], ROW=row, TOKENS=tokens, COLS=cols, num_warps=STORE_WARPS)




@triton.jit
def _copy_blocks_kernel(k_src, v_src, k_dst, v_dst, src_ids, dst_ids, stride_ks, stride_vs, stride_kd, stride_vd,
                        numel, SRC_IDS: tl.constexpr, DST_IDS: tl.constexpr, CHUNK: tl.constexpr):
    """One program per (block pair, chunk, K or V): copy CHUNK elements of one block; K and V in one launch. A side
    without ids (SRC_IDS / DST_IDS false) is a packed buffer indexed by the pair: pack reads ids, unpack writes them,
    a copy between two caches (a peer's, mapped in place) has ids on both sides."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    is_v = tl.program_id(2) == 1
    src = k_src
    dst = k_dst
    if is_v:
        src = v_src
        dst = v_dst
    stride_src = tl.where(is_v, stride_vs, stride_ks).to(tl.int64)
    stride_dst = tl.where(is_v, stride_vd, stride_kd).to(tl.int64)
    s = b.to(tl.int64)
    d = b.to(tl.int64)
    if SRC_IDS:
        s = tl.load(src_ids + b).to(tl.int64)
    if DST_IDS:
        d = tl.load(dst_ids + b).to(tl.int64)
    i = c * CHUNK + tl.arange(0, CHUNK)
    ok = i < numel
    x = tl.load(src + s * stride_src + i, mask=ok)
    tl.store(dst + d * stride_dst + i, x.to(dst.dtype.element_ty), mask=ok)


def _copy_launch(src_ids: torch.Tensor | None, dst_ids: torch.Tensor | None, numel: int, *args: object) -> None:
    """Launch :func:`_copy_blocks_kernel` for ``args`` = the four caches/buffers and their four block strides."""
    ids = src_ids if src_ids is not None else dst_ids
    assert ids is not None
    chunk = min(COPY_CHUNK, triton.next_power_of_2(numel))
    grid = (ids.shape[0], triton.cdiv(numel, chunk), 2)
    caches, strides = args[:4], args[4:]
    _copy_blocks_kernel[grid](*caches, ids if src_ids is None else src_ids, ids if dst_ids is None else dst_ids,
                              *strides, numel, SRC_IDS=src_ids is not None, DST_IDS=dst_ids is not None,
                              CHUNK=chunk, num_warps=COPY_WARPS)


def pack_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """See :func:`pdkernels.reference.pack_blocks`. Pure."""
    n = block_ids.shape[0]
    buf = torch.empty((2, n, *k_cache.shape[1:]), dtype=k_cache.dtype, device=k_cache.device)
    if n:
        numel = k_cache[0].numel()
        _copy_launch(block_ids, None, numel, k_cache, v_cache, buf[0], buf[1], k_cache.stride(0), v_cache.stride(0),
                     numel, numel)
    return buf


def unpack_blocks(buf: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """See :func:`pdkernels.reference.unpack_blocks`. Mutates the caches."""
    n = block_ids.shape[0]
    if n:
        buf = buf.contiguous()
        numel = k_cache[0].numel()
        _copy_launch(None, block_ids, numel, buf[0], buf[1], k_cache, v_cache, numel, numel, k_cache.stride(0),
                     v_cache.stride(0))


def copy_blocks_between(k_src: torch.Tensor, v_src: torch.Tensor, src_ids: torch.Tensor, k_dst: torch.Tensor,
                        v_dst: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """See :func:`pdkernels.copy_blocks_between`. Mutates the destination caches."""
    if src_ids.shape[0]:
        _copy_launch(src_ids, dst_ids, k_src[0].numel(), k_src, v_src, k_dst, v_dst, k_src.stride(0),
                     v_src.stride(0), k_dst.stride(0), v_dst.stride(0))


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
        s = tl.maximum(tl.div_rn(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 448.0), 1e-12)  # IEEE division, as torch
        y = _to_e4m3_grid(tl.minimum(tl.maximum(tl.div_rn(x, s), -448.0), 448.0))
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
    """See :func:`pdkernels.reference.quantize_kv_fp8`. Pure."""
    x = x if x[0:1].is_contiguous() else x.contiguous()
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((x.shape[0], x.shape[2]), dtype=torch.float32, device=x.device)
    _fp8_launch(x, q, scales, quantize=True)
    return q, scales


def dequantize_kv_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """See :func:`pdkernels.reference.dequantize_kv_fp8`. Pure."""
    q = q if q[0:1].is_contiguous() else q.contiguous()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    _fp8_launch(q, out, scales.contiguous().float(), quantize=False)
    return out


@triton.jit
def _claim_slots_kernel(slot_ptr, writer_ptr, num_tokens, TOKENS: tl.constexpr):
    """``writer[slot] = token`` for every written slot (one winner when a slot repeats)."""
    tok = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    tl.store(writer_ptr + tl.maximum(slot, 0), tok, mask=slot >= 0)


@triton.jit
def _fp8_open_scale(src_ptr, stride_st, stride_sh, sc_ptr, sc_off, writer, written, tile_ok, h, d, opens):
    """One (block, kv head) scale of K or V: kept, or, when ``opens`` or still 0, fixed from the writers' new rows
    exactly as :func:`pdkernels.reference.fresh_fp8_scale`."""
    old = tl.load(sc_ptr + sc_off)
    new = tl.load(src_ptr + writer[:, None] * stride_st + h * stride_sh + d[None, :],
                  mask=tile_ok & written[:, None], other=0.0).to(tl.float32)
    fresh = tl.maximum(tl.div_rn(tl.max(tl.max(tl.abs(new), axis=1), axis=0), FP8_OPEN_DIVISOR), 1e-12)
    tl.store(sc_ptr + sc_off, tl.where(opens | (old == 0.0), fresh, old))


@triton.jit
def _fp8_scales_kernel(key_ptr, value_ptr, ks_ptr, vs_ptr, slot_ptr, writer_ptr, num_tokens,
                       stride_kt, stride_kh, stride_vt, stride_vh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
                       BLOCK_SIZE: tl.constexpr, BS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                       DIM_PAD: tl.constexpr):
    """One program per (token, kv head). Of the tokens writing a block, only the one at its lowest offset (its
    leader) works: when that offset is 0 (the write opens the block) or a scale is still 0, it fixes the block's
    head's scales from the new rows of every token writing the block (found through ``writer``, each entry verified
    against ``slot_mapping``, so the map needs no clearing). Every other program only reads ``writer`` entries.
    (A branch, not an early return: both compile on every Triton version we support.)"""
    tok = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    live = slot >= 0
    slot = tl.maximum(slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    j = tl.arange(0, BS_PAD)
    d = tl.arange(0, DIM_PAD)
    j_ok = (j < BLOCK_SIZE) & live
    w = tl.load(writer_ptr + blk * BLOCK_SIZE + j, mask=j_ok, other=-1)
    w_ok = j_ok & (w >= 0) & (w < num_tokens)
    w = tl.where(w_ok, w, 0).to(tl.int64)
    written = w_ok & (tl.load(slot_ptr + w, mask=w_ok, other=-1).to(tl.int64) == blk * BLOCK_SIZE + j)
    earlier = tl.sum((written & (j < off)).to(tl.int32), axis=0)
    mine = tl.sum((written & (j == off) & (w == tok)).to(tl.int32), axis=0)
    if live & (earlier == 0) & (mine == 1):  # the leader
        tile_ok = j_ok[:, None] & (d < HEAD_DIM)[None, :]
        _fp8_open_scale(key_ptr, stride_kt, stride_kh, ks_ptr, blk * stride_ksb + h * stride_ksh, w, written,
                        tile_ok, h, d, off == 0)
        _fp8_open_scale(value_ptr, stride_vt, stride_vh, vs_ptr, blk * stride_vsb + h * stride_vsh, w, written,
                        tile_ok, h, d, off == 0)


@triton.jit
def _quantize_rows(src_ptr, dst_ptr, sc_ptr, tok, blk, off, col, head, ok, stride_t, stride_b, stride_sb, stride_sh):
    """A [tokens, cols] tile of new rows into an FP8 cache: divided by their (block, kv head) scale, saturated at
    +-448 and rounded as torch rounds to float8_e4m3fn."""
    x = tl.load(src_ptr + tok[:, None] * stride_t + col[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sc_ptr + (blk * stride_sb)[:, None] + head[None, :] * stride_sh, mask=ok, other=1.0)
    y = _to_e4m3_grid(tl.minimum(tl.maximum(tl.div_rn(x, s), -448.0), 448.0))
    tl.store(dst_ptr + (blk * stride_b + off)[:, None] + col[None, :], y.to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_fp8_rows_kernel(key_ptr, value_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slot_ptr, num_tokens,
                           stride_kt, stride_vt, stride_kb, stride_vb, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
                           BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ROW: tl.constexpr,
                           TOKENS: tl.constexpr, COLS: tl.constexpr):
    """:func:`_store_kv_kernel` into an FP8 cache whose scales are already fixed; slot -1 skips."""
    tok, col, ok, blk, off = _slot_tile(slot_ptr, num_tokens, BLOCK_SIZE, ROW, TOKENS, COLS)
    head = col // HEAD_DIM
    tok = tok.to(tl.int64)
    _quantize_rows(key_ptr, k_ptr, ks_ptr, tok, blk, off, col, head, ok, stride_kt, stride_kb, stride_ksb, stride_ksh)
    _quantize_rows(value_ptr, v_ptr, vs_ptr, tok, blk, off, col, head, ok, stride_vt, stride_vb, stride_vsb,
                   stride_vsh)


def store_kv_quantized(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       k_scales: torch.Tensor, v_scales: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """See :func:`pdkernels.reference.store_kv_quantized`: bit-identical to it. Three launches, no host sync: claim
    slots, fix the scales of the blocks this call opens, write the rows. Mutates the caches and scales."""
    n = key.shape[0]
    if n == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    nb, bs, kvh, hd = k_cache.shape
    writer = torch.empty(nb * bs, dtype=torch.int32, device=key.device)  # garbage is fine: entries are verified
    _claim_slots_kernel[(triton.cdiv(n, 1024),)](slot_mapping, writer, n, TOKENS=1024)
    scale_strides = (k_scales.stride(0), k_scales.stride(1), v_scales.stride(0), v_scales.stride(1))
    _fp8_scales_kernel[(n, kvh)](
        key, value, k_scales, v_scales, slot_mapping, writer, n,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), *scale_strides,
        BLOCK_SIZE=bs, BS_PAD=triton.next_power_of_2(bs), HEAD_DIM=hd, DIM_PAD=triton.next_power_of_2(hd),
        num_warps=4)
    key, value = _token_rows(key), _token_rows(value)
    row = kvh * hd
    cols = min(triton.next_power_of_2(row), STORE_ELEMS)
    tokens = max(1, STORE_ELEMS // cols)
    _store_fp8_rows_kernel[(triton.cdiv(n, tokens), triton.cdiv(row, cols))](
        key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping, n, key.stride(0), value.stride(0),
        k_cache.stride(0), v_cache.stride(0), *scale_strides,
        BLOCK_SIZE=bs, HEAD_DIM=hd, ROW=row, TOKENS=tokens, COLS=cols, num_warps=STORE_WARPS)

