"""Triton kernels of the paged attention: K/V store, and attention over the block table.

Imported only by the triton backend (``import tokenmill`` never imports triton).

One attention kernel serves decode and (chunked) prefill. A program owns one sequence,
one KV head and a tile of BLOCK_M *rows*, where row r is new token r // GROUP of the
sequence and query head kvh * GROUP + r % GROUP: the GROUP query heads sharing a KV head
read each K/V tile once. Keys are read in place from the cache through the block table
(no gather into a new tensor), BLOCK_N positions at a time, with an online softmax in
float32. Every loop bound is read from device tensors (seq_lens, query_start_loc), so a
decode launch with fixed shapes can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    kv_ptr, cache_ptr, slot_ptr,
    stride_kv_t, stride_kv_2, stride_cache_2,
    ROW: tl.constexpr, ROW_PAD: tl.constexpr,
):  # fmt: skip
    """Program (t, which): kv[t, which] ([KVH * D] contiguous) -> slot slot_ptr[t] of the
    K (which = 0) or V (1) cache. A negative slot (a padding row) stores nothing."""
    t = tl.program_id(0)
    which = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # slot * ROW may pass 2**31 in a big cache
    i = tl.arange(0, ROW_PAD)
    ok = i < tl.where(slot >= 0, ROW, 0)  # (not `& (slot >= 0)`: the interpreter mistypes it)
    x = tl.load(kv_ptr + t * stride_kv_t + which * stride_kv_2 + i, mask=ok)
    tl.store(cache_ptr + which * stride_cache_2 + slot * ROW + i, x, mask=ok)


def store_kv(kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv [T, 2, KVH, D] (any row stride) -> kv_cache [2, NB, BS, KVH, D] at slot_mapping [T]
    (flat block_id * BS + offset; rows with slot < 0 are skipped)."""
    tokens, _, kvh, d = kv.shape
    if tokens == 0:
        return
    assert kv_cache.is_contiguous() and kv.stride(3) == 1 and kv.stride(2) == d
    row = kvh * d
    _store_kv_kernel[(tokens, 2)](
        kv, kv_cache, slot_mapping, kv.stride(0), kv.stride(1), kv_cache.stride(0),
        ROW=row, ROW_PAD=triton.next_power_of_2(row),
    )  # fmt: skip


@triton.jit
def _tanh(x):
    # exp overflows to inf for large x, giving exactly +-1; no libdevice call needed.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _paged_attention_kernel(
    q_ptr, cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale, softcap, window,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_2, stride_c_b, stride_c_s, stride_c_h, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    if DECODE:  # one new token per sequence: row b of q; no query_start_loc needed
        q_start = b
        q_len = 1
    else:
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)  # 0 for a padding row: no keys, output 0
    first_pos = seq_len - q_len  # absolute position of the first new token

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < q_len
    q_pos = first_pos + tok
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    q_off = (q_start + tok)[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)  # [BLOCK_M, D_PAD]

    # Keys this tile can see: causal up to its last token, window back from its first.
    tile_first = tile * BLOCK_M // GROUP
    tile_last = tl.minimum(((tile + 1) * BLOCK_M - 1) // GROUP, q_len - 1)
    hi = tl.minimum(first_pos + tile_last + 1, seq_len)
    hi = tl.where(tile_first < q_len, hi, 0)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos + tile_first - window + 1, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        block = tl.load(block_tables_ptr + b * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        block = block.to(tl.int64)  # int64 offsets: a layer's cache may pass 2**31 elements
        kv_off = block * stride_c_b + (k_pos % BLOCK_SIZE) * stride_c_s + kvh * stride_c_h  # [N]
        k = tl.load(
            cache_ptr + kv_off[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0
        )  # [D_PAD, BLOCK_N]
        s = tl.dot(q, k.to(q.dtype), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N] fp32
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if USE_WINDOW:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            cache_ptr + stride_c_2 + kv_off[:, None] + d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, D_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no keys (padding row): zeros
    o_off = (q_start + tok)[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :]
    tl.store(out_ptr + o_off, out, mask=q_mask)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new tokens over K/V already stored in the paged cache.

    q [T, H, D] (last dim contiguous); kv_cache [2, NB, BS, KVH, D]; block_tables
    [B, max_blocks]; seq_lens [B] (context after this step, 0 = padding row).
    Decode (query_start_loc None): T == B, token b belongs to sequence b; capturable in a
    CUDA graph (the launch depends only on shapes). Prefill: query_start_loc [B+1] on the
    device and max_query_len (host int, sizes the grid). Returns out [T, H, D].
    """
    tokens, heads, d = q.shape
    _, _, block_size, kvh, _ = kv_cache.shape
    group = heads // kvh
    assert heads == group * kvh and q.stride(2) == 1 and kv_cache.is_contiguous()
    if out is None:
        out = torch.empty((tokens, heads, d), dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    decode = query_start_loc is None
    # Tiles sized so the fp32 accumulator [BLOCK_M, D] and a K/V tile fit in registers.
    block_m = max(16, triton.next_power_of_2(group)) if decode else (64 if d <= 128 else 32)
    block_n = 64 if d <= 128 else 32
    grid = (batch, triton.cdiv(max_query_len * group, block_m), kvh)
    if batch == 0 or grid[1] == 0:
        return out
    _paged_attention_kernel[grid](
        q, kv_cache, out, block_tables, seq_lens,
        seq_lens if decode else query_start_loc,  # unused when decoding
        scale, softcap or 0.0, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        DECODE=decode, USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None,
        num_warps=4 if d <= 128 else 8,
    )  # fmt: skip
    return out
