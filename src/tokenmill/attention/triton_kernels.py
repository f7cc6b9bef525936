"""Triton kernels of the paged attention: K/V store, and attention over the block table.

Imported only by the triton backend (``import tokenmill`` never imports triton).

One attention kernel serves decode and (chunked) prefill. A program owns one sequence,
one KV head and a tile of BLOCK_M *rows*, where row r is new token r // GROUP of the
sequence and query head kvh * GROUP + r % GROUP: the GROUP query heads sharing a KV head
read each K/V tile once. Keys are read in place from the cache through the block table
(no gather into a new tensor), BLOCK_N positions at a time, with an online softmax in
float32. Every loop bound is read from device tensors (seq_lens, query_start_loc), so a
decode launch with fixed shapes can be captured in a CUDA graph.

Split-KV decode: with few (sequence, KV head) pairs for the SMs and a long block table, a
decode step runs as (B, splits, KVH) programs instead, each over one range of whole
BLOCK_N tiles of the context (range length from seq_len on the device; the split count
from shapes only), writing a normalized fp32 partial and its log-sum-exp; a second kernel
combines the ranges of each (token, head). Both attention kernels share the tile loop
(``_attend``).

Compiled variants: a launch on a GPU compiles a new variant whenever its specialization
key changes (every constexpr; for each int argument whether it is 1, a multiple of 16 or
neither; for each pointer whether it is 16-byte aligned), about a second each, mid-run.
So the one int argument that changes from step to step at fixed model shapes, the block
table's row stride ``stride_bt`` (an eager step's table width), is passed unspecialized
(``do_not_specialize``; the other ints are model-fixed head counts and strides), and the
automatic split count is a power of two (``decode_num_splits``), so eager decode steps of
any batch size or context meet at most five NUM_SPLITS variants.
"""

from __future__ import annotations

import functools

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
def _attend(
    q, q_pos, lo, hi, cache_ptr, bt_ptr, kvh,
    scale, softcap, window,
    stride_c_2, stride_c_b, stride_c_s, stride_c_h,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Online softmax of rows q [BLOCK_M, D_PAD] at positions q_pos [BLOCK_M] over the keys
    lo <= pos < hi of one sequence (block-table row bt_ptr) and KV head kvh. Returns
    (acc [BLOCK_M, D_PAD] unnormalized, m [BLOCK_M] running max, l [BLOCK_M] sum), fp32;
    a row that saw no key keeps m = -inf, l = 0, acc = 0."""
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        block = tl.load(bt_ptr + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
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
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    q_ptr, cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale, softcap, window,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_2, stride_c_b, stride_c_s, stride_c_h, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Program (b, tile, kvh): rows tile * BLOCK_M ... of sequence b over all its keys."""
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
    d = tl.arange(0, D_PAD)
    q_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
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

    acc, m_i, l_i = _attend(
        q, first_pos + tok, lo, hi, cache_ptr, block_tables_ptr + b * stride_bt, kvh,
        scale, softcap, window, stride_c_2, stride_c_b, stride_c_s, stride_c_h,
        HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_N, USE_WINDOW, USE_SOFTCAP,
    )  # fmt: skip
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no keys (padding row): zeros
    o_off = (q_start + tok)[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :]
    tl.store(out_ptr + o_off, out, mask=q_mask)


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    q_ptr, cache_ptr, part_ptr, lse_ptr, block_tables_ptr, seq_lens_ptr,
    scale, softcap, window, heads,
    stride_q_t, stride_q_h,
    stride_c_2, stride_c_b, stride_c_s, stride_c_h, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Program (b, split, kvh) of a decode step: the GROUP heads of token b over range
    `split` of its keys -> part [B, NUM_SPLITS, H, HEAD_DIM] (normalized) and
    lse [B, NUM_SPLITS, H] (log-sum-exp of the scores; -inf for an empty range), fp32."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    kvh = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)  # 0 for a padding row: every range empty
    q_pos = seq_len - 1

    # Equal ranges of whole BLOCK_N tiles; the last ones may be short or empty.
    per_split = (seq_len + NUM_SPLITS - 1) // NUM_SPLITS
    split_len = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    if USE_WINDOW:  # skip the tiles wholly before the window (lo stays a tile multiple)
        lo = tl.maximum(lo, tl.maximum(q_pos - window + 1, 0) // BLOCK_N * BLOCK_N)

    rows = tl.arange(0, BLOCK_M)  # row r: query head kvh * GROUP + r of token b
    head = kvh * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, D_PAD)
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q_off = b * stride_q_t + head[:, None] * stride_q_h + d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask, other=0.0)  # [BLOCK_M, D_PAD]
    q_rows_pos = tl.zeros([BLOCK_M], tl.int32) + q_pos

    acc, m_i, l_i = _attend(
        q, q_rows_pos, lo, hi, cache_ptr, block_tables_ptr + b * stride_bt, kvh,
        scale, softcap, window, stride_c_2, stride_c_b, stride_c_s, stride_c_h,
        HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_N, USE_WINDOW, USE_SOFTCAP,
    )  # fmt: skip
    seen = l_i > 0.0  # l >= 1 once a key was visible (its own max contributes exp(0))
    part = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    r = (b * NUM_SPLITS + split) * heads + head  # [BLOCK_M] row of lse, of part / HEAD_DIM
    tl.store(part_ptr + r[:, None] * HEAD_DIM + d[None, :], part, mask=mask)
    tl.store(lse_ptr + r, lse, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    part_ptr, lse_ptr, out_ptr, heads, stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr,
):  # fmt: skip
    """Program (b, h): out[b, h] = sum_s w_s part_s / sum_s w_s with w_s = exp(lse_s - max);
    empty ranges weigh 0, and a token with no key at all (padding row) gets zeros."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    r = (b * NUM_SPLITS + s) * heads + h  # [S_PAD]
    lse = tl.load(lse_ptr + r, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))  # [S_PAD]
    part = tl.load(
        part_ptr + r[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
    )  # [S_PAD, D_PAD]
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_o_t + h * stride_o_h + d, out, mask=d_ok)


MAX_SPLITS = 16
"""Most KV ranges one decode (sequence, KV head) is cut into; bounds the fp32 partials
[B, splits, H, D] and the combine's reads. A guess, not yet tuned on a GPU."""
INTERPRETER_SMS = 16
"""Stands in for the SM count on CPU (the interpreter, in tests), so the choice is testable."""


def decode_num_splits(batch: int, kv_heads: int, max_context: int, block_n: int, sms: int) -> int:
    """KV ranges per (sequence, KV head) of a decode step: at most enough programs to give
    each SM one, every range at least 2 * block_n of the longest possible context
    (block_tables.shape[1] * block_size), and at most MAX_SPLITS; that count rounded down
    to a power of two (1, 2, 4, 8 or 16). NUM_SPLITS is a constexpr, so each distinct count
    is a compiled variant: rounded, the eager decode steps of a run (batch and table width
    change from step to step) compile at most five instead of up to sixteen. Only shapes go
    in, never seq_lens values, so a CUDA graph captured with the result stays right for any
    lengths."""
    fill = sms // max(batch * kv_heads, 1)  # 0 or 1: the plain grid already fills the GPU
    long_enough = max_context // (2 * block_n)
    splits = max(1, min(MAX_SPLITS, fill, long_enough))
    return 1 << (splits.bit_length() - 1)  # the largest power of two <= splits


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tiles(head_dim: int, group: int, decode: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the attention kernels: the fp32 accumulator
    [BLOCK_M, D] and the K/V tiles must fit in registers and shared memory. Untimed; what is
    known is that no variant spills registers in the sm_90 build (checked on CPU,
    tests/attention/test_triton_attention_compiles.py), whereas e.g. BLOCK_M = BLOCK_N = 64
    with 4 warps at D = 256 spills 312 bytes per thread."""
    block_m = max(16, triton.next_power_of_2(group)) if decode else (64 if head_dim <= 128 else 32)
    block_n = 64 if head_dim <= 128 else 32
    return block_m, block_n, 4 if head_dim <= 128 else 8


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
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of new tokens over K/V already stored in the paged cache.

    q [T, H, D] (last dim contiguous); kv_cache [2, NB, BS, KVH, D]; block_tables
    [B, max_blocks]; seq_lens [B] (context after this step, 0 = padding row).
    Decode (query_start_loc None): T == B, token b belongs to sequence b; capturable in a
    CUDA graph (the launch depends only on shapes). Prefill: query_start_loc [B+1] on the
    device and max_query_len (host int, sizes the grid). Returns out [T, H, D].
    num_splits (decode only): KV ranges per sequence attended in parallel, then combined;
    None chooses from the shapes and the SM count (``decode_num_splits``), 1 never splits.
    """
    tokens, heads, d = q.shape
    _, _, block_size, kvh, _ = kv_cache.shape
    group = heads // kvh
    assert heads == group * kvh and q.stride(2) == 1 and kv_cache.is_contiguous()
    decode = query_start_loc is None
    if num_splits is not None and (num_splits < 1 or (num_splits > 1 and not decode)):
        raise ValueError(f"num_splits={num_splits}: >= 1 when decoding, 1 in prefill (or None)")
    if out is None:
        out = torch.empty((tokens, heads, d), dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    block_m, block_n, num_warps = _tiles(d, group, decode)
    grid = (batch, triton.cdiv(max_query_len * group, block_m), kvh)
    if batch == 0 or grid[1] == 0:
        return out
    # constexprs and warps of both attention kernels
    consts = dict(
        GROUP=group, HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None,
        num_warps=num_warps,
    )  # fmt: skip
    if decode:
        context = block_tables.shape[1] * block_size  # the longest any row can be
        splits = num_splits or decode_num_splits(batch, kvh, context, block_n, _sm_count(q.device))
        if splits > 1:
            _split_decode(q, kv_cache, out, block_tables, seq_lens, scale, sliding_window,
                          softcap, splits=splits, consts=consts)  # fmt: skip
            return out
    _paged_attention_kernel[grid](
        q, kv_cache, out, block_tables, seq_lens,
        seq_lens if decode else query_start_loc,  # unused when decoding
        scale, softcap or 0.0, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *kv_cache.stride()[:4], block_tables.stride(0),
        DECODE=decode, **consts,
    )  # fmt: skip
    return out


def _split_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    *,
    splits: int,
    consts: dict,
) -> None:
    """Decode as (B, splits, KVH) programs over one KV range each, then one combine program
    per (token, head). The fp32 partials come from torch.empty: under a graph capture they
    live in the graph's memory pool."""
    batch, heads, d = q.shape
    part = torch.empty((batch, splits, heads, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, splits, heads), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, splits, kv_cache.shape[3])](
        q, kv_cache, part, lse, block_tables, seq_lens,
        scale, softcap or 0.0, window or 0, heads,
        q.stride(0), q.stride(1), *kv_cache.stride()[:4], block_tables.stride(0),
        NUM_SPLITS=splits, **consts,
    )  # fmt: skip
    _combine_splits_kernel[(batch, heads)](
        part, lse, out, heads, out.stride(0), out.stride(1),
        HEAD_DIM=d, D_PAD=consts["D_PAD"], NUM_SPLITS=splits,
        S_PAD=triton.next_power_of_2(splits), num_warps=1,
    )  # fmt: skip
