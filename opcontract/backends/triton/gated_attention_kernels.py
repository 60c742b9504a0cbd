"""Triton kernels of gated_attention's forward.

One program takes a tile of query rows (BLOCK_T tokens of one sequence x the G query heads
sharing a KV head: GQA rows of one tile) and walks its sequence's key blocks (128 positions,
aligned to logical positions: block b is b*128 .. b*128 + 127 wherever the store keeps it)
in ascending order, from the lowest block a row of the tile sees to the highest. Within a
chunk of CHUNK_BLOCKS blocks the usual online softmax runs (a block a row doesn't see is an
exact identity for that row: its max is -inf, its weights 0); at each chunk's end the chunk's
(m, l, o) merges into the running (M, L, O) by the contract's rule, with explicit fmas, so
that a split decode (each chunk in its own program, ``_attn_chunk_kernel``, then
``_attn_merge_kernel``) computes the same partials and the same merge.
"""

# fmt: off
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_max(s):
    """max over axis 1, NaN if a NaN is there (tl.max alone drops it)."""
    nan = tl.sum((s != s).to(tl.int32), axis=1) > 0
    return tl.where(nan, float("nan"), tl.max(s, axis=1))


@triton.jit
def _tile_rows(tile_ptr, positions_ptr, G, T, BLOCK_M: tl.constexpr):
    """(token row of each tile row, its head within the group, its position, the tile's
    first token row, its sequence): rows past the tile's tokens get position -1."""
    tile = tl.program_id(0)
    row0 = tl.load(tile_ptr + tile * 3)
    ntok = tl.load(tile_ptr + tile * 3 + 1)
    s = tl.load(tile_ptr + tile * 3 + 2)
    r = tl.arange(0, BLOCK_M)
    tok = r // G
    live = tok < ntok
    token = row0 + tok
    pos = tl.load(positions_ptr + token, mask=live & (token < T), other=-1).to(tl.int32)
    return token, r % G, pos, live, s


@triton.jit
def _visible(jpos, pos, klen, window, LOCAL: tl.constexpr):
    vis = (jpos[None, :] <= pos[:, None]) & (jpos[None, :] < klen) & (pos[:, None] >= 0)
    if LOCAL:
        vis = vis & (jpos[None, :] > pos[:, None] - window)
    return vis


@triton.jit
def _block_update(q, k_ptr, v_ptr, rowb, b, N, Hkv, kvh, pos, klen, window, c, m, lsum, o,
                  D, LOCAL: tl.constexpr, INTERPRET: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """One key block's online-softmax step for every row of the tile."""
    j = tl.arange(0, BLOCK)
    d = tl.arange(0, BLOCK_D)
    jpos = b * BLOCK + j
    krow = rowb + j
    kmask = (jpos < klen) & (krow < N) & (krow >= j)  # krow >= j: the block is present
    kv_off = (krow.to(tl.int64)[:, None] * Hkv + kvh) * D + d[None, :]
    dmask = d[None, :] < D
    kt = tl.load(k_ptr + kv_off, mask=kmask[:, None] & dmask, other=0.0)
    vt = tl.load(v_ptr + kv_off, mask=kmask[:, None] & dmask, other=0.0)
    if INTERPRET:  # 16-bit floats are raw bits there, and numpy's matmul rounds a row
        # differently with the rows beside it: an explicit product and sum per row
        s = tl.sum(q.to(tl.float32)[:, None, :] * kt.to(tl.float32)[None, :, :], axis=2)
    elif IEEE:
        s = tl.dot(q, tl.trans(kt), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kt))
    s = s * c
    vis = _visible(jpos, pos, klen, window, LOCAL)
    s = tl.where(vis, s, float("-inf"))
    upd = tl.max(vis.to(tl.int32), axis=1) > 0
    m_new = _max_nan(m, _row_max(s))
    m_ref = tl.where((m_new == float("-inf")) & (~upd), 0.0, m_new)
    a = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    lsum = lsum * a + tl.sum(p, axis=1)
    o = o * a[:, None]
    pin = p.to(vt.dtype)
    # a value the row doesn't see must not enter (its weight is 0, and 0 * inf is NaN): the
    # product runs on the finite values, and a row that sees a non-finite one gets NaN in
    # that channel, as the float64 math gives (rare: a block-wide test first)
    v32 = vt.to(tl.float32)
    vfin = v32 - v32 == 0.0  # False for NaN and +-inf
    bad = tl.max((~vfin).to(tl.int32)) > 0
    if bad:
        vt = tl.where(vfin, vt, 0.0)
    if INTERPRET:
        o = o + tl.sum(pin.to(tl.float32)[:, :, None] * vt.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:
        o = tl.dot(pin, vt, o, input_precision="ieee")
    else:
        o = tl.dot(pin, vt, o)
    if bad:
        seen_bad = tl.dot(vis.to(tl.float32), (~vfin).to(tl.float32), input_precision="ieee")
        o = tl.where(seen_bad > 0, float("nan"), o)
    return m_new, lsum, o, upd


@triton.jit
def _merge(run_m, run_l, run_o, m, lsum, o, any_c):
    """The chunk partial (m, l, o) into the running (M, L, O): M' = max(M, m),
    L = L exp2(M - M') + l exp2(m - M'), O likewise; a chunk no row saw changes nothing."""
    run_m_new = _max_nan(run_m, m)
    run_m_ref = tl.where((run_m_new == float("-inf")) & (~any_c), 0.0, run_m_new)
    A = tl.exp2(run_m - run_m_ref)
    C = tl.exp2(m - run_m_ref)
    run_l = tl.math.fma(run_l, A, lsum * C)
    run_o = tl.math.fma(run_o, A[:, None], o * C[:, None])
    return run_m_new, run_l, run_o


@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, gate_ptr, positions_ptr, block_rows_ptr, key_len_ptr,
                     tile_ptr, out_ptr, attn_ptr, lse_ptr, T, N, Hq, Hkv, G, D, NB, window, c,
                     LOCAL: tl.constexpr, INTERPRET: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                     CHUNK_BLOCKS: tl.constexpr):
    kvh = tl.program_id(1)
    token, g, pos, live, s = _tile_rows(tile_ptr, positions_ptr, G, T, BLOCK_M)
    head = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    dmask = d[None, :] < D
    q_off = (token.to(tl.int64)[:, None] * Hq + head[:, None]) * D + d[None, :]
    q = tl.load(q_ptr + q_off, mask=live[:, None] & dmask, other=0.0)
    klen = tl.load(key_len_ptr + s).to(tl.int32)
    hi = tl.max(tl.where(live, pos, -1), axis=0)
    if LOCAL:
        lo = tl.min(tl.where(live & (pos >= 0), tl.maximum(pos - window + 1, 0), hi + 1), axis=0)
    else:
        lo = 0
    b_lo = lo // BLOCK
    b_hi = tl.where(hi >= 0, hi // BLOCK, b_lo - 1)
    ninf = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    zero = tl.zeros((BLOCK_M,), tl.float32)
    run_m, run_l, run_o = ninf, zero, tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    m, lsum, o = ninf, zero, tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    any_c = zero > 0
    for b in range(b_lo, b_hi + 1):
        if (b % CHUNK_BLOCKS == 0) & (b > b_lo):  # a new chunk: the last one merges
            run_m, run_l, run_o = _merge(run_m, run_l, run_o, m, lsum, o, any_c)
            m, lsum, o = ninf, zero, tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
            any_c = zero > 0
        rowb = tl.load(block_rows_ptr + s * NB + b).to(tl.int32)
        m, lsum, o, upd = _block_update(q, k_ptr, v_ptr, rowb, b, N, Hkv, kvh, pos, klen, window,
                                     c, m, lsum, o, D, LOCAL, INTERPRET, IEEE, BLOCK, BLOCK_D)
        any_c = any_c | upd
    run_m, run_l, run_o = _merge(run_m, run_l, run_o, m, lsum, o, any_c)
    seen = run_l != 0.0
    attn = tl.where(seen[:, None], run_o / tl.where(seen, run_l, 1.0)[:, None], 0.0) + 0.0
    lse = tl.where(seen, run_m + tl.log2(tl.where(seen, run_l, 1.0)), float("-inf"))
    gt = tl.load(gate_ptr + q_off, mask=live[:, None] & dmask, other=0.0).to(tl.float32)
    out = attn * tl.sigmoid(gt)
    st = live[:, None] & dmask
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=st)
    tl.store(attn_ptr + q_off, attn, mask=st)
    tl.store(lse_ptr + token.to(tl.int64) * Hq + head, lse, mask=live)
