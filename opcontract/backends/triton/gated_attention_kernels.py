"""Triton kernels of gated_attention: the forward (fused, or split into chunk partials and
an ordered merge) and the backward.

One program takes a tile of query rows (BLOCK_T tokens of one sequence x the G query heads
sharing a KV head: GQA rows of one tile) and walks its sequence's key blocks (128 positions,
aligned to logical positions: block b is b*128 .. b*128 + 127 wherever the store keeps it)
in ascending order, from the lowest block a row of the tile sees to the highest. Within a
chunk of CHUNK_BLOCKS blocks the usual online softmax runs (a block a row doesn't see is an
exact identity for that row: its max is -inf, its weights 0); at each chunk's end the chunk's
(m, l, o) merges into the running (M, L, O) by the contract's rule, with explicit fmas, so
that a split decode (each chunk in its own program, ``_attn_chunk_kernel``, then
``_attn_merge_kernel``) computes the same partials (``_chunk``) and the same merge
(``_merge``, ascending): its bits are the fused kernel's by construction.
"""

# fmt: off
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from opcontract.backends.triton.rounding import cast


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_max(s):
    """max over axis 1, NaN if a NaN is there (tl.max alone drops it)."""
    nan = tl.sum((s != s).to(tl.int32), axis=1) > 0
    return tl.where(nan, float("nan"), tl.max(s, axis=1))


@triton.jit
def _lo_hi(x):
    """[M, R, 2n] -> its first and last n along the last axis."""
    M: tl.constexpr = x.shape[0]
    R: tl.constexpr = x.shape[1]
    N: tl.constexpr = x.shape[2]
    return tl.split(tl.permute(tl.reshape(x, [M, R, 2, N // 2]), (0, 1, 3, 2)))


@triton.jit
def _chain2(acc, x, FIRST: tl.constexpr):
    """acc + x[..., 0] + x[..., 1], one after another (FIRST: x[..., 0] + x[..., 1])."""
    a, b = tl.split(x)
    if FIRST:
        return a + b
    else:
        return (acc + a) + b


@triton.jit
def _chain4(acc, x, FIRST: tl.constexpr):
    lo, hi = _lo_hi(x)
    return _chain2(_chain2(acc, lo, FIRST), hi, False)


@triton.jit
def _chain8(acc, x, FIRST: tl.constexpr):
    lo, hi = _lo_hi(x)
    return _chain4(_chain4(acc, lo, FIRST), hi, False)


@triton.jit
def _chain16(acc, x, FIRST: tl.constexpr):
    lo, hi = _lo_hi(x)
    return _chain8(_chain8(acc, lo, FIRST), hi, False)


@triton.jit
def _chain32(x):
    lo, hi = _lo_hi(x)
    return _chain16(_chain16(x, lo, True), hi, False)


@triton.jit
def _block_sum(p, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """Each row's sum of its BLOCK (128) weights (>= 0 or NaN) in one fixed order, whatever
    the tile's layout: key j = 8 u + 2 w + v (u < 16, w < 4, v < 2); for each w, the 32
    keys (u, v) = (0, 0), (0, 1), (1, 0), ... added one after another; then the four w sums
    as (S0 + S2) + (S1 + S3). (This is the order Triton 3.6 gives ``tl.sum`` over a wgmma
    accumulator's rows, written out, so 16-row tiles on ``mma.sync`` sum the same way.)
    Interpreting, the chain is numpy's cumsum (sequential, the same additions; its last
    element picked by a sum with zeros, exact): a few array operations, not a hundred."""
    tl.static_assert(BLOCK == 128)
    BLOCK_M: tl.constexpr = p.shape[0]
    x = tl.permute(tl.reshape(p, [BLOCK_M, 16, 4, 2]), (0, 2, 1, 3))  # [rows, w, u, v]
    x = tl.reshape(x, [BLOCK_M, 4, 32])
    if INTERPRET:
        last = tl.arange(0, 32)[None, None, :] == 31
        s = tl.sum(tl.where(last, tl.cumsum(x, axis=2), 0.0), axis=2)
    else:
        s = _chain32(x)  # [rows, w]
    s = tl.sum(tl.reshape(s, [BLOCK_M, 2, 2]), axis=1)  # S_w + S_(w+2): a sum of two
    return tl.sum(s, axis=1)  # (S0 + S2) + (S1 + S3)


@triton.jit
def _mm_nt(a, b, INTERPRET: tl.constexpr, IEEE: tl.constexpr):
    """a [M, K] . b [N, K]^T, float32 accumulation. Interpreting, 16-bit floats are raw bits
    and numpy's matmul rounds a row differently with the rows beside it: explicit products
    and sums per row there."""
    if INTERPRET:
        return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)
    elif IEEE:
        return tl.dot(a, tl.trans(b), input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b))


@triton.jit
def _mm_acc(a, b, acc, INTERPRET: tl.constexpr, IEEE: tl.constexpr):
    """acc + a [M, K] . b [K, N], float32 accumulation."""
    if INTERPRET:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


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
                  SAFE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                  MASK: tl.constexpr = True):
    """One key block's online-softmax step for every row of the tile. SAFE: values a row
    doesn't see are kept out of its product (needed only where a value is non-finite: the
    fast pass leaves a non-finite accumulator, which flags the tile for the SAFE pass; with
    finite values both passes compute the same products). MASK False (fast pass only): a
    block every live row of the tile sees whole (``_interior``), where the visibility mask
    selects every score and "saw a key" is true: the same operations on the same values
    without building the mask (rows past the tile's tokens compute what is never stored)."""
    j = tl.arange(0, BLOCK)
    d = tl.arange(0, BLOCK_D)
    jpos = b * BLOCK + j
    krow = rowb + j
    kmask = (jpos < klen) & (krow < N) & (krow >= j)  # krow >= j: the block is present
    # the block's rows are consecutive: a 64-bit scalar base and 32-bit offsets within it
    base = (tl.maximum(rowb, 0).to(tl.int64) * Hkv + kvh) * D
    kv_off = j[:, None] * (Hkv * D) + d[None, :]
    dmask = d[None, :] < D
    if MASK:
        kt = tl.load(k_ptr + base + kv_off, mask=kmask[:, None] & dmask, other=0.0)
        vt = tl.load(v_ptr + base + kv_off, mask=kmask[:, None] & dmask, other=0.0)
    else:
        kt = tl.load(k_ptr + base + kv_off)
        vt = tl.load(v_ptr + base + kv_off)
    qk = _mm_nt(q, kt, INTERPRET, IEEE)
    if MASK:
        vis = _visible(jpos, pos, klen, window, LOCAL)
        s = tl.where(vis, qk * c, float("-inf"))
        upd = tl.max(vis.to(tl.int32), axis=1) > 0
    else:
        # every live row sees the whole block. The score must stay a rounded product: a bare
        # product feeding the subtraction below is contracted into an fma on the GPU
        # (measured: other bits than the masked path's, whose select keeps two roundings)
        s = _mul_rn(qk, c, INTERPRET)
        upd = pos == pos
    if SAFE:
        m_new = _max_nan(m, _row_max(s))
    else:
        # tl.max drops a NaN score, but that score's weight is NaN: o turns NaN and flags the
        # tile for the SAFE pass, which redoes it with the NaN-propagating max
        m_new = tl.maximum(m, tl.max(s, axis=1))
    if MASK:
        m_ref = tl.where((m_new == float("-inf")) & (~upd), 0.0, m_new)
    else:
        m_ref = m_new
    a = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    lsum = lsum * a + _block_sum(p, BLOCK, INTERPRET)
    o = o * a[:, None]
    pin = cast(p, vt.dtype, INTERPRET)
    if SAFE:
        # a value the row doesn't see must not enter (its weight is 0, and 0 * inf is NaN):
        # the product runs on the finite values, and a row that sees a non-finite one gets
        # NaN in that channel, as the float64 math gives
        v32 = vt.to(tl.float32)
        vfin = v32 - v32 == 0.0  # False for NaN and +-inf
        vt = tl.where(vfin, vt, 0.0)
        o = _mm_acc(pin, vt, o, INTERPRET, IEEE)
        seen_bad = _count_seen(vis, ~vfin, INTERPRET)
        o = tl.where(seen_bad > 0, float("nan"), o)
    else:
        o = _mm_acc(pin, vt, o, INTERPRET, IEEE)
    return m_new, lsum, o, upd


@triton.jit
def _mul_rn(x, c, INTERPRET: tl.constexpr):
    """x * c rounded to float32, never contracted with a following add into an fma
    (``mul.rn``; numpy's product under the interpreter is never contracted)."""
    if INTERPRET:
        return x * c
    else:
        return libdevice.mul_rn(x, c)


@triton.jit
def _count_seen(vis, bad, INTERPRET: tl.constexpr):
    """[rows, channels]: how many keys a row sees whose value is non-finite in a channel
    (only its sign is read). 0 and 1 are exact in bfloat16 and counts up to 2^24 in the
    float32 accumulator, so the tensor cores count exactly; a float32 "ieee" dot here ran
    on the FMA units with its operands in registers and spilled 10 KB a thread (the split
    decode's chunk kernel, sm_90: 255 registers, 10096 bytes of stack; 1008 with this)."""
    if INTERPRET:  # the interpreter keeps bfloat16 as raw bits: count in float32 there
        return tl.dot(vis.to(tl.float32), bad.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(vis.to(tl.bfloat16), bad.to(tl.bfloat16))


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
def _tile_keys(tile_ptr, positions_ptr, key_len_ptr, G, T, window, LOCAL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """The tile's rows and the key blocks b_lo .. b_hi its rows see (b_hi < b_lo: none)."""
    token, g, pos, live, s = _tile_rows(tile_ptr, positions_ptr, G, T, BLOCK_M)
    klen = tl.load(key_len_ptr + s).to(tl.int32)
    b_lo, b_hi = _key_blocks(pos, live, window, LOCAL, BLOCK)
    return token, g, pos, live, s, klen, b_lo, b_hi


@triton.jit
def _key_blocks(pos, live, window, LOCAL: tl.constexpr, BLOCK: tl.constexpr):
    """(b_lo, b_hi): the key blocks the tile's live rows see (b_hi < b_lo: none)."""
    hi = tl.max(tl.where(live, pos, -1), axis=0)
    if LOCAL:
        lo = tl.min(tl.where(live & (pos >= 0), tl.maximum(pos - window + 1, 0), hi + 1), axis=0)
    else:
        lo = 0
    b_lo = lo // BLOCK
    b_hi = tl.where(hi >= 0, hi // BLOCK, b_lo - 1)
    return b_lo, b_hi


@triton.jit
def _interior(pos, live, klen, window, LOCAL: tl.constexpr, BLOCK: tl.constexpr):
    """(ilo, ihi): the key blocks every live row of the tile sees whole (causal, below
    key_len, inside the window); empty (ihi < ilo) when a live row has no query (-1)."""
    pmin = tl.min(tl.where(live, pos, 1 << 30), axis=0)
    pmax = tl.max(tl.where(live, pos, -1), axis=0)
    ihi = tl.minimum((pmin + 1) // BLOCK - 1, klen // BLOCK - 1)
    if LOCAL:
        first_key = pmax - window + 1  # the lowest key every row still sees
        ilo = tl.where(first_key > 0, (first_key + BLOCK - 1) // BLOCK, 0)
    else:
        ilo = ihi * 0
    return ilo, ihi


@triton.jit
def _segments(first, last, ilo, ihi):
    """Blocks first .. last cut at the interior ilo .. ihi, in ascending order: (below's
    last, interior's first, interior's last, above's first); masked blocks first .. below,
    interior lo .. hi, masked above .. last (an empty interior leaves below .. above whole)."""
    below = tl.minimum(last, ilo - 1)
    lo = tl.maximum(first, ilo)
    hi = tl.minimum(last, ihi)
    above = tl.maximum(first, tl.maximum(ilo, ihi + 1))
    return below, lo, hi, above


@triton.jit
def _chunk_blocks(q, k_ptr, v_ptr, block_rows_ptr, s, NB, first, last, N, Hkv, kvh, pos, klen,
                  window, c, m, lsum, o, any_c, D, LOCAL: tl.constexpr,
                  INTERPRET: tl.constexpr, IEEE: tl.constexpr, SAFE: tl.constexpr,
                  BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr,
                  rows=None, ROWS_FIRST: tl.constexpr = False):
    """Blocks first .. last of a chunk onto (m, l, o, any), ascending. ROWS_FIRST: each
    block's row from ``rows`` (``_chunk_rows``), not a load of its own."""
    if SAFE:
        # unpipelined whatever the kernel's stages: the masked products need the shared
        # memory a second stage would take
        for b in tl.range(first, last + 1, num_stages=1):
            rowb = tl.load(block_rows_ptr + s * NB + b).to(tl.int32)
            m, lsum, o, upd = _block_update(q, k_ptr, v_ptr, rowb, b, N, Hkv, kvh, pos, klen,
                                            window, c, m, lsum, o, D, LOCAL, INTERPRET, IEEE,
                                            SAFE, BLOCK, BLOCK_D)
            any_c = any_c | upd
    else:
        for b in range(first, last + 1):
            if ROWS_FIRST:
                r0, r1, r2, r3 = rows
                i = b % 4
                rowb = tl.where(i == 0, r0, tl.where(i == 1, r1, tl.where(i == 2, r2, r3)))
            else:
                rowb = tl.load(block_rows_ptr + s * NB + b).to(tl.int32)
            m, lsum, o, upd = _block_update(q, k_ptr, v_ptr, rowb, b, N, Hkv, kvh, pos, klen,
                                            window, c, m, lsum, o, D, LOCAL, INTERPRET, IEEE,
                                            SAFE, BLOCK, BLOCK_D, MASK)
    return m, lsum, o, any_c


@triton.jit
def _chunk_rows(block_rows_ptr, s, NB, b0):
    """The block rows of sequence s's chunk of four blocks (512 positions of 128) from
    block b0, as four independent loads issued together (a block past the table: -1). The
    caller reads only the rows of the blocks it runs."""
    at = block_rows_ptr + s * NB + b0
    r0 = tl.load(at, mask=b0 < NB, other=-1).to(tl.int32)
    r1 = tl.load(at + 1, mask=b0 + 1 < NB, other=-1).to(tl.int32)
    r2 = tl.load(at + 2, mask=b0 + 2 < NB, other=-1).to(tl.int32)
    r3 = tl.load(at + 3, mask=b0 + 3 < NB, other=-1).to(tl.int32)
    return r0, r1, r2, r3


@triton.jit
def _chunk(q, k_ptr, v_ptr, block_rows_ptr, s, NB, first, last, N, Hkv, kvh, pos, klen,
           window, c, D, ilo, ihi, LOCAL: tl.constexpr, INTERPRET: tl.constexpr,
           IEEE: tl.constexpr, SAFE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
           BLOCK_D: tl.constexpr, INTERIOR: tl.constexpr, ROWS_FIRST: tl.constexpr = 0,
           rows=None, HAVE_ROWS: tl.constexpr = False):
    """One chunk's partial (m, l, o, any row saw a key): blocks first .. last, from the
    empty state. The fused and the split kernels both call this, with the same bounds.
    INTERIOR (fast pass): the blocks ilo .. ihi that every live row sees whole run without
    the visibility mask (``_block_update``'s MASK False), the rest with it, in the same
    ascending order: the same bits. ROWS_FIRST (with INTERIOR, fast pass, a chunk of four
    blocks): the chunk's block rows read together before its blocks (``_chunk_rows``), so no
    block waits on a load of its row before its keys' loads can start; HAVE_ROWS: the
    caller read them already (``rows``)."""
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    lsum = tl.zeros((BLOCK_M,), tl.float32)
    o = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    any_c = lsum > 0
    if INTERIOR and not SAFE:
        if ROWS_FIRST and not HAVE_ROWS:
            tl.static_assert(BLOCK == 128)
            rows = _chunk_rows(block_rows_ptr, s, NB, first - first % 4)
        below, lo, hi, above = _segments(first, last, ilo, ihi)
        m, lsum, o, any_c = _chunk_blocks(q, k_ptr, v_ptr, block_rows_ptr, s, NB, first, below,
                                          N, Hkv, kvh, pos, klen, window, c, m, lsum, o, any_c,
                                          D, LOCAL, INTERPRET, IEEE, SAFE, BLOCK, BLOCK_D, True,
                                          rows, ROWS_FIRST)  # fmt: skip
        m, lsum, o, any_c = _chunk_blocks(q, k_ptr, v_ptr, block_rows_ptr, s, NB, lo, hi, N,
                                          Hkv, kvh, pos, klen, window, c, m, lsum, o, any_c, D,
                                          LOCAL, INTERPRET, IEEE, SAFE, BLOCK, BLOCK_D, False,
                                          rows, ROWS_FIRST)  # fmt: skip
        m, lsum, o, any_c = _chunk_blocks(q, k_ptr, v_ptr, block_rows_ptr, s, NB, above, last,
                                          N, Hkv, kvh, pos, klen, window, c, m, lsum, o, any_c,
                                          D, LOCAL, INTERPRET, IEEE, SAFE, BLOCK, BLOCK_D, True,
                                          rows, ROWS_FIRST)  # fmt: skip
    else:
        m, lsum, o, any_c = _chunk_blocks(q, k_ptr, v_ptr, block_rows_ptr, s, NB, first, last,
                                          N, Hkv, kvh, pos, klen, window, c, m, lsum, o, any_c,
                                          D, LOCAL, INTERPRET, IEEE, SAFE, BLOCK, BLOCK_D, True)
    if not SAFE:
        # a row saw a key iff its max is finite: a row whose visible scores are all -inf or
        # NaN has a NaN accumulator here, which sends the tile to the SAFE pass
        any_c = m > float("-inf")
    return m, lsum, o, any_c


@triton.jit
def _merge_into_attn(run_m, run_l, m, lsum, o, any_c, attn_ptr, q_off, st, later):
    """A chunk's partial merged into the running state, whose O waits in the attn output
    between chunks (float32, this program's rows only; stored and loaded exactly; read
    only after the tile's first chunk, ``later``)."""
    prev = tl.load(attn_ptr + q_off, mask=st & later, other=0.0)
    run_m, run_l, prev = _merge(run_m, run_l, prev, m, lsum, o, any_c)
    tl.store(attn_ptr + q_off, prev, mask=st)
    tl.debug_barrier()
    return run_m, run_l


@triton.jit
def _nonfinite(x):
    """1 if any element of the tile is NaN or infinite, else 0."""
    return tl.max(tl.max((x - x != 0.0).to(tl.int32), axis=1), axis=0)


@triton.jit
def _finish(run_m, run_l, run_o, gate_ptr, out_ptr, attn_ptr, lse_ptr, q_off, token, head, live,
            dmask, Hq, INTERPRET: tl.constexpr, lse_live):
    """attn = O / L + 0, lse = M + log2 L, out = input_dtype(attn * sigmoid(gate)); lse
    stored for the rows of lse_live (a program holding some channels of a row stores it
    once, from its first block)."""
    seen = run_l != 0.0
    attn = tl.where(seen[:, None], run_o / tl.where(seen, run_l, 1.0)[:, None], 0.0) + 0.0
    lse = tl.where(seen, run_m + tl.log2(tl.where(seen, run_l, 1.0)), float("-inf"))
    gt = tl.load(gate_ptr + q_off, mask=live[:, None] & dmask, other=0.0).to(tl.float32)
    out = attn * tl.sigmoid(gt)
    st = live[:, None] & dmask
    tl.store(out_ptr + q_off, cast(out, out_ptr.dtype.element_ty, INTERPRET), mask=st)
    tl.store(attn_ptr + q_off, attn, mask=st)
    tl.store(lse_ptr + token.to(tl.int64) * Hq + head, lse, mask=lse_live)


@triton.jit
def _q_offsets(token, g, kvh, G, Hq, D, BLOCK_D: tl.constexpr):
    """(offsets of the tile's rows in q-shaped tensors, each row's head, the channel mask)."""
    head = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    dmask = d[None, :] < D
    q_off = (token.to(tl.int64)[:, None] * Hq + head[:, None]) * D + d[None, :]
    return q_off, head, dmask


@triton.jit
def _load_q(q_ptr, token, g, live, kvh, G, Hq, D, BLOCK_D: tl.constexpr):
    q_off, head, dmask = _q_offsets(token, g, kvh, G, Hq, D, BLOCK_D)
    q = tl.load(q_ptr + q_off, mask=live[:, None] & dmask, other=0.0)
    return q, q_off, head, dmask


@triton.jit
def _flat_blocks(q, k_ptr, v_ptr, block_rows_ptr, attn_ptr, q_off, st, s, NB, lo, hi, b_hi,
                 ch_lo, N, Hkv, kvh, pos, klen, window, c, m, lsum, o, run_m, run_l, D,
                 LOCAL: tl.constexpr, INTERPRET: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                 CHUNK_BLOCKS: tl.constexpr, MASK: tl.constexpr):
    """Blocks lo .. hi in one loop (the fast pass of FLAT): each block onto the chunk's
    (m, l, o); at a chunk's last block (or the tile's) the chunk merges into the running
    state (``_merge_into_attn``, as the nested loop does) and starts again empty."""
    for b in range(lo, hi + 1):
        rowb = tl.load(block_rows_ptr + s * NB + b).to(tl.int32)
        m, lsum, o, upd = _block_update(q, k_ptr, v_ptr, rowb, b, N, Hkv, kvh, pos, klen,
                                        window, c, m, lsum, o, D, LOCAL, INTERPRET, IEEE,
                                        False, BLOCK, BLOCK_D, MASK)
        if (b % CHUNK_BLOCKS == CHUNK_BLOCKS - 1) | (b == b_hi):
            later = tl.full((BLOCK_M, 1), b // CHUNK_BLOCKS, tl.int32) > ch_lo
            run_m, run_l = _merge_into_attn(run_m, run_l, m, lsum, o, m > float("-inf"),
                                            attn_ptr, q_off, st, later)
            m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            lsum = tl.zeros((BLOCK_M,), tl.float32)
            o = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    return m, lsum, o, run_m, run_l


@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, gate_ptr, positions_ptr, block_rows_ptr, key_len_ptr,
                     tile_ptr, out_ptr, attn_ptr, lse_ptr, go_ptr, redo_ptr, T, N, Hq, Hkv, G, D,
                     NB, window, c, LOCAL: tl.constexpr, INTERPRET: tl.constexpr,
                     IEEE: tl.constexpr, SAFE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_BLOCKS: tl.constexpr,
                     INTERIOR: tl.constexpr = False, FLAT: tl.constexpr = False,
                     REG_O: tl.constexpr = False):
    """The fused forward: a tile's chunks in ascending order, each merged as it ends. A
    program runs where go is non-zero (the fast pass: all; the SAFE pass: the tiles the fast
    pass flagged in redo because their accumulator came out non-finite). FLAT (fast pass):
    the blocks in one loop, the merge at each chunk's end inside it (``_flat_blocks``: the
    same blocks, states and merges in the same order as the loop over chunks; the loads can
    run ahead across a chunk's end). REG_O (fast pass, not FLAT): the running O stays in
    registers beside the chunk's o (two accumulators) instead of waiting in the attn output;
    the float32 store and load are exact, so the same bits."""
    kvh = tl.program_id(1)
    slot = tl.program_id(0) * tl.num_programs(1) + kvh
    if tl.load(go_ptr + slot) != 0:
        token, g, pos, live, s, klen, b_lo, b_hi = _tile_keys(
            tile_ptr, positions_ptr, key_len_ptr, G, T, window, LOCAL, BLOCK_M, BLOCK)
        q, q_off, head, dmask = _load_q(q_ptr, token, g, live, kvh, G, Hq, D, BLOCK_D)
        ilo, ihi = _interior(pos, live, klen, window, LOCAL, BLOCK)
        run_m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        run_l = tl.zeros((BLOCK_M,), tl.float32)
        st = live[:, None] & dmask
        ch_lo = b_lo // CHUNK_BLOCKS
        ch_hi = b_hi // CHUNK_BLOCKS
        # between chunks the running O waits in the attn output (``_merge_into_attn``): one
        # accumulator in registers, not two
        if FLAT and not SAFE:
            m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            lsum = tl.zeros((BLOCK_M,), tl.float32)
            o = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
            if INTERIOR:
                below, lo, hi, above = _segments(b_lo, b_hi, ilo, ihi)
                m, lsum, o, run_m, run_l = _flat_blocks(
                    q, k_ptr, v_ptr, block_rows_ptr, attn_ptr, q_off, st, s, NB, b_lo,
                    below, b_hi, ch_lo, N, Hkv, kvh, pos, klen, window, c, m, lsum, o,
                    run_m, run_l, D, LOCAL, INTERPRET, IEEE, BLOCK_M, BLOCK, BLOCK_D,
                    CHUNK_BLOCKS, True)
                m, lsum, o, run_m, run_l = _flat_blocks(
                    q, k_ptr, v_ptr, block_rows_ptr, attn_ptr, q_off, st, s, NB, lo,
                    hi, b_hi, ch_lo, N, Hkv, kvh, pos, klen, window, c, m, lsum, o,
                    run_m, run_l, D, LOCAL, INTERPRET, IEEE, BLOCK_M, BLOCK, BLOCK_D,
                    CHUNK_BLOCKS, False)
                m, lsum, o, run_m, run_l = _flat_blocks(
                    q, k_ptr, v_ptr, block_rows_ptr, attn_ptr, q_off, st, s, NB, above,
                    b_hi, b_hi, ch_lo, N, Hkv, kvh, pos, klen, window, c, m, lsum, o, run_m,
                    run_l, D, LOCAL, INTERPRET, IEEE, BLOCK_M, BLOCK, BLOCK_D, CHUNK_BLOCKS,
                    True)
            else:
                m, lsum, o, run_m, run_l = _flat_blocks(
                    q, k_ptr, v_ptr, block_rows_ptr, attn_ptr, q_off, st, s, NB, b_lo, b_hi,
                    b_hi, ch_lo, N, Hkv, kvh, pos, klen, window, c, m, lsum, o, run_m, run_l,
                    D, LOCAL, INTERPRET, IEEE, BLOCK_M, BLOCK, BLOCK_D, CHUNK_BLOCKS, True)
            any_chunk = tl.full((BLOCK_M, 1), b_hi, tl.int32) >= b_lo
        elif REG_O and not SAFE:
            run_o = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
            # chunks c1 .. c2 - 1 lie whole in the interior (every block one every live row
            # sees whole): one unmasked loop of CHUNK_BLOCKS blocks each, the same update
            # and merge as ``_chunk``'s; the chunks before and after take ``_chunk``
            c1 = ch_lo
            c2 = ch_lo
            if INTERIOR:
                c1 = tl.maximum(ch_lo, (ilo + CHUNK_BLOCKS - 1) // CHUNK_BLOCKS)
                c2 = tl.maximum(c1, tl.minimum(ch_hi + 1, (ihi + 1) // CHUNK_BLOCKS))
            for ch in range(ch_lo, c1):
                first = tl.maximum(ch * CHUNK_BLOCKS, b_lo)
                last = tl.minimum(ch * CHUNK_BLOCKS + CHUNK_BLOCKS - 1, b_hi)
                m, lsum, o, any_c = _chunk(q, k_ptr, v_ptr, block_rows_ptr, s, NB, first, last,
                                           N, Hkv, kvh, pos, klen, window, c, D, ilo, ihi, LOCAL,
                                           INTERPRET, IEEE, SAFE, BLOCK_M, BLOCK, BLOCK_D,
                                           INTERIOR)
                run_m, run_l, run_o = _merge(run_m, run_l, run_o, m, lsum, o, any_c)
            for ch in range(c1, c2):
                m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
                lsum = tl.zeros((BLOCK_M,), tl.float32)
                o = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
                for b in range(ch * CHUNK_BLOCKS, ch * CHUNK_BLOCKS + CHUNK_BLOCKS):
                    rowb = tl.load(block_rows_ptr + s * NB + b).to(tl.int32)
                    m, lsum, o, upd = _block_update(q, k_ptr, v_ptr, rowb, b, N, Hkv, kvh, pos,
                                                    klen, window, c, m, lsum, o, D, LOCAL,
                                                    INTERPRET, IEEE, False, BLOCK, BLOCK_D,
                                                    False)
                run_m, run_l, run_o = _merge(run_m, run_l, run_o, m, lsum, o,
                                             m > float("-inf"))
            for ch in range(c2, ch_hi + 1):
                first = tl.maximum(ch * CHUNK_BLOCKS, b_lo)
                last = tl.minimum(ch * CHUNK_BLOCKS + CHUNK_BLOCKS - 1, b_hi)
                m, lsum, o, any_c = _chunk(q, k_ptr, v_ptr, block_rows_ptr, s, NB, first, last,
                                           N, Hkv, kvh, pos, klen, window, c, D, ilo, ihi, LOCAL,
                                           INTERPRET, IEEE, SAFE, BLOCK_M, BLOCK, BLOCK_D,
                                           INTERIOR)
                run_m, run_l, run_o = _merge(run_m, run_l, run_o, m, lsum, o, any_c)
            any_chunk = tl.full((BLOCK_M, 1), ch_hi, tl.int32) >= ch_lo
            # the [rows, channels] offsets again, not held in registers across the loop
            q_off, head, dmask = _q_offsets(token, g, kvh, G, Hq, D, BLOCK_D)
            st = live[:, None] & dmask
        else:
            for ch in range(ch_lo, ch_hi + 1):
                first = tl.maximum(ch * CHUNK_BLOCKS, b_lo)
                last = tl.minimum(ch * CHUNK_BLOCKS + CHUNK_BLOCKS - 1, b_hi)
                m, lsum, o, any_c = _chunk(q, k_ptr, v_ptr, block_rows_ptr, s, NB, first, last,
                                           N, Hkv, kvh, pos, klen, window, c, D, ilo, ihi, LOCAL,
                                           INTERPRET, IEEE, SAFE, BLOCK_M, BLOCK, BLOCK_D,
                                           INTERIOR)
                later = tl.full((BLOCK_M, 1), ch, tl.int32) > ch_lo
                run_m, run_l = _merge_into_attn(run_m, run_l, m, lsum, o, any_c, attn_ptr,
                                                q_off, st, later)
            any_chunk = tl.full((BLOCK_M, 1), ch_hi, tl.int32) >= ch_lo
        if REG_O and not SAFE and not FLAT:
            # what the attn output would hold: the live rows' O (0 where no chunk ran); rows
            # past the tile's tokens never enter the flag or a store
            run_o = tl.where(st & any_chunk, run_o, 0.0)
        else:
            run_o = tl.load(attn_ptr + q_off, mask=st & any_chunk, other=0.0)
        if not SAFE:
            tl.store(redo_ptr + slot, _nonfinite(run_o))
        _finish(run_m, run_l, run_o, gate_ptr, out_ptr, attn_ptr, lse_ptr, q_off, token, head,
                live, dmask, Hq, INTERPRET, live)


@triton.jit
def _attn_chunk_kernel(q_ptr, k_ptr, v_ptr, positions_ptr, block_rows_ptr, key_len_ptr,
                       tile_ptr, part_m_ptr, part_l_ptr, part_o_ptr, gate_ptr, out_ptr, attn_ptr,
                       lse_ptr, count_ptr, T, N, Hq, Hkv, G, D, NB, NC, window, c,
                       LOCAL: tl.constexpr, INTERPRET: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                       CHUNK_BLOCKS: tl.constexpr, INTERIOR: tl.constexpr = False,
                       MERGE_IN: tl.constexpr = False, AHEAD: tl.constexpr = False,
                       ROWS_FIRST: tl.constexpr = 0):
    """Split decode, part 1: program (tile, i, kv head) computes the tile's i-th chunk's
    partial (the fused kernel's, from the same ``_chunk``) into the workspace, l stored as
    -1 for a row that saw no key of the chunk (a real l is >= 0 or NaN, never -1). The fast
    pass first; a partial that comes out non-finite is computed again by the SAFE pass in
    the same program (one launch; a chunk with finite values never takes the second).
    MERGE_IN: the tile's last chunk program to finish (a per tile and KV head arrival count,
    which it sets back to 0) then merges every partial of the tile in ascending order and
    finishes, as ``_attn_merge_kernel`` does (the same per-element arithmetic: the same
    bits), so a decode step is one launch; a tile none of whose rows has a query is
    finished empty by its program 0. ROWS_FIRST 1: a chunk's block rows read together
    before its blocks (``_chunk``); 2: on a global layer at the program's start, beside the
    tile's positions (EARLY; a local layer's as 1). Addresses only: the same bits."""
    tile = tl.program_id(0)
    i = tl.program_id(1)
    kvh = tl.program_id(2)
    slot = (tile.to(tl.int64) * NC + i) * Hkv + kvh
    # EARLY: on a global layer chunk i of a tile is blocks 4i .. 4i + 3 whatever its
    # positions (b_lo is 0), so its block rows and the tile's q are read beside the
    # positions and the key length, not after the key bounds computed from them
    EARLY: tl.constexpr = (ROWS_FIRST == 2) and INTERIOR and (not LOCAL)
    rows = None
    if EARLY:
        tl.static_assert(BLOCK * CHUNK_BLOCKS == 512)
        token, g, pos, live, s = _tile_rows(tile_ptr, positions_ptr, G, T, BLOCK_M)
        klen = tl.load(key_len_ptr + s).to(tl.int32)
        rows = _chunk_rows(block_rows_ptr, s, NB, i * CHUNK_BLOCKS)
        q, q_off, head, dmask = _load_q(q_ptr, token, g, live, kvh, G, Hq, D, BLOCK_D)
        b_lo, b_hi = _key_blocks(pos, live, window, LOCAL, BLOCK)
    else:
        token, g, pos, live, s, klen, b_lo, b_hi = _tile_keys(
            tile_ptr, positions_ptr, key_len_ptr, G, T, window, LOCAL, BLOCK_M, BLOCK)
    ch = b_lo // CHUNK_BLOCKS + i
    n = b_hi // CHUNK_BLOCKS - b_lo // CHUNK_BLOCKS + 1
    if MERGE_IN:
        if (n <= 0) & (i == 0):
            r = tl.arange(0, BLOCK_M)
            d = tl.arange(0, BLOCK_D)
            _merge_and_finish(part_m_ptr, part_l_ptr, part_o_ptr, gate_ptr, out_ptr, attn_ptr,
                              lse_ptr, tile, 0, NC, Hkv, kvh, token, g, live, Hq, G, D, r, d,
                              INTERPRET, BLOCK_M, BLOCK_D, True, AHEAD)
    if ch <= b_hi // CHUNK_BLOCKS:
        if not EARLY:
            q, q_off, head, dmask = _load_q(q_ptr, token, g, live, kvh, G, Hq, D, BLOCK_D)
        first = tl.maximum(ch * CHUNK_BLOCKS, b_lo)
        last = tl.minimum(ch * CHUNK_BLOCKS + CHUNK_BLOCKS - 1, b_hi)
        ilo, ihi = _interior(pos, live, klen, window, LOCAL, BLOCK)
        m, lsum, o, any_c = _chunk(q, k_ptr, v_ptr, block_rows_ptr, s, NB, first, last, N, Hkv,
                                   kvh, pos, klen, window, c, D, ilo, ihi, LOCAL, INTERPRET, IEEE,
                                   False, BLOCK_M, BLOCK, BLOCK_D, INTERIOR, ROWS_FIRST, rows,
                                   EARLY)  # fmt: skip
        if _nonfinite(o) != 0:
            m, lsum, o, any_c = _chunk(q, k_ptr, v_ptr, block_rows_ptr, s, NB, first, last, N,
                                       Hkv, kvh, pos, klen, window, c, D, ilo, ihi, LOCAL,
                                       INTERPRET, IEEE, True, BLOCK_M, BLOCK, BLOCK_D, INTERIOR)
        r = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        tl.store(part_m_ptr + slot * BLOCK_M + r, m)
        tl.store(part_l_ptr + slot * BLOCK_M + r, tl.where(any_c, lsum, -1.0))
        tl.store(part_o_ptr + (slot * BLOCK_M + r)[:, None] * BLOCK_D + d[None, :], o)
        if MERGE_IN:
            # every thread's stores issued, then one release/acquire count at GPU scope: the
            # last to arrive sees every partial of the tile
            tl.debug_barrier()
            counter = count_ptr + tile * Hkv + kvh
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == n - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # for the next call
                tl.debug_barrier()
                _merge_and_finish(part_m_ptr, part_l_ptr, part_o_ptr, gate_ptr, out_ptr,
                                  attn_ptr, lse_ptr, tile, n, NC, Hkv, kvh, token, g, live, Hq,
                                  G, D, r, d, INTERPRET, BLOCK_M, BLOCK_D, True, AHEAD)


@triton.jit
def _merge_loaded(run_m, run_l, run_o, m, lraw, o, ok):
    """``_merge`` of a loaded partial; a partial past the tile's last chunk leaves the
    running state as it is (selected, not computed: no bit moves)."""
    any_c = lraw != -1.0
    lsum = tl.where(any_c, lraw, 0.0)
    new_m, new_l, new_o = _merge(run_m, run_l, run_o, m, lsum, o, any_c)
    return (tl.where(ok, new_m, run_m), tl.where(ok, new_l, run_l),
            tl.where(ok[:, None], new_o, run_o))  # fmt: skip


@triton.jit
def _load_partial(part_m_ptr, part_l_ptr, part_o_ptr, tile, i, n, NC, Hkv, kvh, r, d,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, CG: tl.constexpr):
    """Chunk i's partial (m, l, o, any row saw a key) of ``_attn_chunk_kernel`` for rows r,
    channels d; past the tile's last chunk (i >= n) nothing is read and any is False. CG:
    loaded past the SM's L1 (other programs of the same launch wrote them)."""
    slot = (tile.to(tl.int64) * NC + i) * Hkv + kvh
    ok = (r * 0 + i) < n  # per row: the interpreter masks with tensors only
    cm: tl.constexpr = ".cg" if CG else ""
    m = tl.load(part_m_ptr + slot * BLOCK_M + r, mask=ok, other=float("-inf"), cache_modifier=cm)
    lraw = tl.load(part_l_ptr + slot * BLOCK_M + r, mask=ok, other=-1.0, cache_modifier=cm)
    o = tl.load(part_o_ptr + (slot * BLOCK_M + r)[:, None] * BLOCK_D + d[None, :],
                mask=ok[:, None], other=0.0, cache_modifier=cm)  # fmt: skip
    return m, lraw, o, ok


@triton.jit
def _load_four(part_m_ptr, part_l_ptr, part_o_ptr, tile, i, n, NC, Hkv, kvh, r, d,
               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, CG: tl.constexpr):
    """Chunks i .. i + 3's partials of rows r, channels d as one load each of m [4, rows],
    l [4, rows] and o [4, rows, channels]; past the tile's last chunk (i >= n) nothing is
    read: m -inf, l -1 (no key seen), o 0. CG: past the SM's L1 (other programs of the same
    launch wrote them)."""
    c4 = i + tl.arange(0, 4)
    slot = (tile.to(tl.int64) * NC + c4) * Hkv + kvh
    row = slot[:, None] * BLOCK_M + r[None, :]
    ok = c4[:, None] < n
    cm: tl.constexpr = ".cg" if CG else ""
    m = tl.load(part_m_ptr + row, mask=ok, other=float("-inf"), cache_modifier=cm)
    lraw = tl.load(part_l_ptr + row, mask=ok, other=-1.0, cache_modifier=cm)
    o = tl.load(part_o_ptr + row[:, :, None] * BLOCK_D + d[None, None, :], mask=ok[:, :, None],
                other=0.0, cache_modifier=cm)  # fmt: skip
    return m, lraw, o


@triton.jit
def _split4(y):
    """y [..., 2, 2] (the last two axes chunk // 2, chunk % 2) -> its four chunks."""
    even, odd = tl.split(y)
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _rows4(x):
    """x [4, rows] -> x[0], x[1], x[2], x[3] (exact: data moves only)."""
    return _split4(tl.reshape(tl.permute(x, (1, 0)), [x.shape[1], 2, 2]))


@triton.jit
def _tiles4(x):
    """x [4, rows, channels] -> x[0], x[1], x[2], x[3] (exact: data moves only)."""
    return _split4(tl.reshape(tl.permute(x, (1, 2, 0)), [x.shape[1], x.shape[2], 2, 2]))


@triton.jit
def _merge_four(run_m, run_l, run_o, m4, l4, o4, i, n, r):
    """Chunks i .. i + 3 (loaded by ``_load_four``) onto the running state, one after
    another, ascending (``_merge_loaded``; one past the tile's last leaves it as it is)."""
    m0, m1, m2, m3 = _rows4(m4)
    l0, l1, l2, l3 = _rows4(l4)
    o0, o1, o2, o3 = _tiles4(o4)
    run_m, run_l, run_o = _merge_loaded(run_m, run_l, run_o, m0, l0, o0, (r * 0 + i) < n)
    run_m, run_l, run_o = _merge_loaded(run_m, run_l, run_o, m1, l1, o1, (r * 0 + i + 1) < n)
    run_m, run_l, run_o = _merge_loaded(run_m, run_l, run_o, m2, l2, o2, (r * 0 + i + 2) < n)
    run_m, run_l, run_o = _merge_loaded(run_m, run_l, run_o, m3, l3, o3, (r * 0 + i + 3) < n)
    return run_m, run_l, run_o


@triton.jit
def _merge_chunks(part_m_ptr, part_l_ptr, part_o_ptr, tile, n, NC, Hkv, kvh, r, d,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                  COLS: tl.constexpr, CG: tl.constexpr, AHEAD: tl.constexpr = False):
    """The tile's n chunk partials (rows r, channels d) merged in ascending order from the
    empty state, four chunks an iteration, all four loads in flight before the first of
    their merges (the merges stay one after another): the chain waits on memory once per
    four. AHEAD: read four chunks a load, eight chunks ahead of the merges (the same merges
    in the same order): the chain waits on memory once."""
    run_m = tl.full((ROWS,), float("-inf"), tl.float32)
    run_l = tl.zeros((ROWS,), tl.float32)
    run_o = tl.zeros((ROWS, COLS), tl.float32)
    if not AHEAD:
        for i in range(0, n, 4):
            m0, l0, o0, ok0 = _load_partial(part_m_ptr, part_l_ptr, part_o_ptr, tile, i, n, NC,
                                            Hkv, kvh, r, d, BLOCK_M, BLOCK_D, CG)
            m1, l1, o1, ok1 = _load_partial(part_m_ptr, part_l_ptr, part_o_ptr, tile, i + 1, n,
                                            NC, Hkv, kvh, r, d, BLOCK_M, BLOCK_D, CG)
            m2, l2, o2, ok2 = _load_partial(part_m_ptr, part_l_ptr, part_o_ptr, tile, i + 2, n,
                                            NC, Hkv, kvh, r, d, BLOCK_M, BLOCK_D, CG)
            m3, l3, o3, ok3 = _load_partial(part_m_ptr, part_l_ptr, part_o_ptr, tile, i + 3, n,
                                            NC, Hkv, kvh, r, d, BLOCK_M, BLOCK_D, CG)
            run_m, run_l, run_o = _merge_loaded(run_m, run_l, run_o, m0, l0, o0, ok0)
            run_m, run_l, run_o = _merge_loaded(run_m, run_l, run_o, m1, l1, o1, ok1)
            run_m, run_l, run_o = _merge_loaded(run_m, run_l, run_o, m2, l2, o2, ok2)
            run_m, run_l, run_o = _merge_loaded(run_m, run_l, run_o, m3, l3, o3, ok3)
        return run_m, run_l, run_o
    ma, la, oa = _load_four(part_m_ptr, part_l_ptr, part_o_ptr, tile, 0, n, NC, Hkv, kvh, r, d,
                            BLOCK_M, BLOCK_D, CG)
    mb, lb, ob = _load_four(part_m_ptr, part_l_ptr, part_o_ptr, tile, 4, n, NC, Hkv, kvh, r, d,
                            BLOCK_M, BLOCK_D, CG)
    for i in range(0, n, 4):
        mc, lc, oc = _load_four(part_m_ptr, part_l_ptr, part_o_ptr, tile, i + 8, n, NC, Hkv,
                                kvh, r, d, BLOCK_M, BLOCK_D, CG)
        run_m, run_l, run_o = _merge_four(run_m, run_l, run_o, ma, la, oa, i, n, r)
        ma, la, oa = mb, lb, ob
        mb, lb, ob = mc, lc, oc
    return run_m, run_l, run_o


@triton.jit
def _merge_and_finish(part_m_ptr, part_l_ptr, part_o_ptr, gate_ptr, out_ptr, attn_ptr, lse_ptr,
                      tile, n, NC, Hkv, kvh, token, g, live, Hq, G, D, r, d,
                      INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                      CG: tl.constexpr, AHEAD: tl.constexpr):
    """A whole tile's merge and finish (rows r = every tile row, channels d = all)."""
    run_m, run_l, run_o = _merge_chunks(part_m_ptr, part_l_ptr, part_o_ptr, tile, n, NC, Hkv,
                                        kvh, r, d, BLOCK_M, BLOCK_D, BLOCK_M, BLOCK_D, CG,
                                        AHEAD)
    q_off, head, dmask = _q_offsets(token, g, kvh, G, Hq, D, BLOCK_D)
    _finish(run_m, run_l, run_o, gate_ptr, out_ptr, attn_ptr, lse_ptr, q_off, token, head, live,
            dmask, Hq, INTERPRET, live)


@triton.jit
def _attn_merge_kernel(gate_ptr, positions_ptr, key_len_ptr, tile_ptr, part_m_ptr, part_l_ptr,
                       part_o_ptr, out_ptr, attn_ptr, lse_ptr, T, Hq, Hkv, G, D, NC, window,
                       LOCAL: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_BLOCKS: tl.constexpr,
                       ROWS: tl.constexpr, COLS: tl.constexpr, AHEAD: tl.constexpr = False):
    """Split decode, part 2: program (tile, kv head, part) merges the chunk partials of ROWS
    rows x COLS channels of the tile (part = row group * channel blocks + channel block) in
    ascending chunk order by ``_merge`` and finishes them as the fused kernel does. The
    merge is per element (each row's factors from its own m), so how the tile is cut into
    programs changes no bit; a row group without a query row exits (``_merge_chunks``)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    n_cols = BLOCK_D // COLS
    r0 = (part // n_cols) * ROWS
    c0 = (part % n_cols) * COLS
    token, g, pos, live, s, klen, b_lo, b_hi = _tile_keys(
        tile_ptr, positions_ptr, key_len_ptr, G, T, window, LOCAL, BLOCK_M, BLOCK)
    ntok = tl.load(tile_ptr + tile * 3 + 1)
    if r0 < ntok * G:
        row0 = tl.load(tile_ptr + tile * 3)
        r = r0 + tl.arange(0, ROWS)
        tok_r = r // G
        live_r = tok_r < ntok
        token_r = row0 + tok_r
        head = kvh * G + r % G
        d = c0 + tl.arange(0, COLS)
        dmask = d[None, :] < D
        q_off = (token_r.to(tl.int64)[:, None] * Hq + head[:, None]) * D + d[None, :]
        n = b_hi // CHUNK_BLOCKS - b_lo // CHUNK_BLOCKS + 1
        run_m, run_l, run_o = _merge_chunks(part_m_ptr, part_l_ptr, part_o_ptr, tile, n, NC,
                                            Hkv, kvh, r, d, BLOCK_M, BLOCK_D, ROWS, COLS, False,
                                            AHEAD)
        _finish(run_m, run_l, run_o, gate_ptr, out_ptr, attn_ptr, lse_ptr, q_off, token_r, head,
                live_r, dmask, Hq, INTERPRET, live_r & (r * 0 + c0 == 0))


# ----------------------------------------------------------------------------- backward
@triton.jit
def _attn_bwd_pre_kernel(g_ptr, gate_ptr, attn_ptr, dgate_ptr, da_ptr, delta_ptr, R, D,
                         INTERPRET: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per (token, head) row: s = sigmoid(gate); d gate = g attn s (1 - s); A = dA = g s in
    the input dtype; delta = sum_d dA attn (float32 dA, one tree per row)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    off = r.to(tl.int64)[:, None] * D + d[None, :]
    msk = (r[:, None] < R) & (d[None, :] < D)
    g = tl.load(g_ptr + off, mask=msk, other=0.0).to(tl.float32)
    gt = tl.load(gate_ptr + off, mask=msk, other=0.0).to(tl.float32)
    attn = tl.load(attn_ptr + off, mask=msk, other=0.0)
    s = tl.sigmoid(gt)
    dgate = g * attn * s * (1.0 - s)
    da = g * s
    tl.store(dgate_ptr + off, cast(dgate, dgate_ptr.dtype.element_ty, INTERPRET), mask=msk)
    tl.store(da_ptr + off, cast(da, da_ptr.dtype.element_ty, INTERPRET), mask=msk)
    tl.store(delta_ptr + r, tl.sum(da * attn, axis=1), mask=r < R)


@triton.jit
def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, da_ptr, delta_ptr, lse_ptr, positions_ptr,
                        block_rows_ptr, key_len_ptr, tile_ptr, dq_ptr, T, N, Hq, Hkv, G, D, NB,
                        window, c, scale, LOCAL: tl.constexpr, INTERPRET: tl.constexpr,
                        IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """dq of a tile of GQA rows (the forward's tiles): its key blocks in ascending order,
    P recomputed from lse, dS rounded to the input dtype, dq = scale * sum_j dS k."""
    kvh = tl.program_id(1)
    token, g, pos, live, s, klen, b_lo, b_hi = _tile_keys(
        tile_ptr, positions_ptr, key_len_ptr, G, T, window, LOCAL, BLOCK_M, BLOCK)
    q, q_off, head, dmask = _load_q(q_ptr, token, g, live, kvh, G, Hq, D, BLOCK_D)
    lmask = live[:, None] & dmask
    da = tl.load(da_ptr + q_off, mask=lmask, other=0.0)
    r_off = token.to(tl.int64) * Hq + head
    delta = tl.load(delta_ptr + r_off, mask=live, other=0.0)
    lse = tl.load(lse_ptr + r_off, mask=live, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    j = tl.arange(0, BLOCK)
    d = tl.arange(0, BLOCK_D)
    for b in range(b_lo, b_hi + 1):
        rowb = tl.load(block_rows_ptr + s * NB + b).to(tl.int32)
        jpos = b * BLOCK + j
        krow = rowb + j
        kmask = (jpos < klen) & (krow < N) & (krow >= j)
        kv_off = (krow.to(tl.int64)[:, None] * Hkv + kvh) * D + d[None, :]
        kt = tl.load(k_ptr + kv_off, mask=kmask[:, None] & dmask, other=0.0)
        vt = tl.load(v_ptr + kv_off, mask=kmask[:, None] & dmask, other=0.0)
        s2 = _mm_nt(q, kt, INTERPRET, IEEE) * c
        vis = _visible(jpos, pos, klen, window, LOCAL)
        p = tl.where(vis, tl.exp2(s2 - lse[:, None]), 0.0)
        dp = _mm_nt(da, vt, INTERPRET, IEEE)
        ds = cast(tl.where(vis, p * (dp - delta[:, None]), 0.0), kt.dtype, INTERPRET)
        acc = _mm_acc(ds, kt, acc, INTERPRET, IEEE)
    dq = acc * scale
    tl.store(dq_ptr + q_off, cast(dq, dq_ptr.dtype.element_ty, INTERPRET), mask=lmask)


@triton.jit
def _dkv_heads(q_ptr, da_ptr, lse_ptr, delta_ptr, kt, vt, tok, has, vis, kvh, G, Hq, D, d,
               dmask, c, dk, dv, INTERPRET: tl.constexpr, IEEE: tl.constexpr):
    """One query block's terms of dk and dv, the group's heads ascending: S [slot, key] =
    q k^T, P, dP = dA v^T, dS; dv += P^T dA, dk += dS^T q."""
    for g in range(G):
        head = kvh * G + g
        r_off = tok.to(tl.int64) * Hq + head
        q_off = r_off[:, None] * D + d[None, :]
        qm = has[:, None] & dmask
        qt = tl.load(q_ptr + q_off, mask=qm, other=0.0)
        da = tl.load(da_ptr + q_off, mask=qm, other=0.0)
        lse = tl.load(lse_ptr + r_off, mask=has, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        delta = tl.load(delta_ptr + r_off, mask=has, other=0.0)
        s2 = _mm_nt(qt, kt, INTERPRET, IEEE) * c  # [query slot, key]
        p = tl.where(vis, tl.exp2(s2 - lse[:, None]), 0.0)
        dp = _mm_nt(da, vt, INTERPRET, IEEE)
        ds = cast(tl.where(vis, p * (dp - delta[:, None]), 0.0), kt.dtype, INTERPRET)
        dv = _mm_acc(tl.trans(cast(p, kt.dtype, INTERPRET)), da, dv, INTERPRET, IEEE)
        dk = _mm_acc(tl.trans(ds), qt, dk, INTERPRET, IEEE)
    return dk, dv


@triton.jit
def _dkv_block_t(q_ptr, da_ptr, lse_ptr, delta_ptr, qrow_ptr, kt, vt, s, NB, qb, jpos, kmask,
                 window, kvh, G, Hq, D, d, dmask, c, dk, dv, LOCAL: tl.constexpr,
                 INTERPRET: tl.constexpr, IEEE: tl.constexpr, BLOCK: tl.constexpr):
    """Query block qb's terms of dk and dv, the group's heads ascending, key-major:
    S^T [key, slot] = k q^T, P^T, dP^T = v dA^T, dS^T; dv += P^T dA, dk += dS^T q."""
    jq = tl.arange(0, BLOCK)
    qpos = qb * BLOCK + jq
    tok = tl.load(qrow_ptr + (s * NB + qb).to(tl.int64) * BLOCK + jq)
    has = tok >= 0
    # vis_t[key, i]: key j is seen by query slot i (never past key_len here)
    vis_t = (jpos[:, None] <= qpos[None, :]) & has[None, :] & kmask[:, None]
    if LOCAL:
        vis_t = vis_t & (jpos[:, None] > qpos[None, :] - window)
    for g in range(G):
        head = kvh * G + g
        r_off = tok.to(tl.int64) * Hq + head
        q_off = r_off[:, None] * D + d[None, :]
        qm = has[:, None] & dmask
        qt = tl.load(q_ptr + q_off, mask=qm, other=0.0)
        da = tl.load(da_ptr + q_off, mask=qm, other=0.0)
        lse = tl.load(lse_ptr + r_off, mask=has, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        delta = tl.load(delta_ptr + r_off, mask=has, other=0.0)
        s2 = _mm_nt(kt, qt, INTERPRET, IEEE) * c  # [key, query slot]
        p = tl.where(vis_t, tl.exp2(s2 - lse[None, :]), 0.0)
        dp = _mm_nt(vt, da, INTERPRET, IEEE)
        ds = cast(tl.where(vis_t, p * (dp - delta[None, :]), 0.0), kt.dtype, INTERPRET)
        dv = _mm_acc(cast(p, kt.dtype, INTERPRET), da, dv, INTERPRET, IEEE)
        dk = _mm_acc(ds, qt, dk, INTERPRET, IEEE)
    return dk, dv


@triton.jit
def _attn_bwd_dkv_kernel(q_ptr, k_ptr, v_ptr, da_ptr, delta_ptr, lse_ptr, block_rows_ptr,
                         key_len_ptr, qrow_ptr, dk_ptr, dv_ptr, N, Hq, Hkv, G, D, NB, window, c,
                         scale, LOCAL: tl.constexpr, INTERPRET: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, KEYS: tl.constexpr,
                         TRANS: tl.constexpr = False):
    """dk and dv of key block b of sequence s (program (s * NB + b, kv head)): the
    sequence's queries in blocks of BLOCK positions, ascending, each block's query slots
    indexed by position (qrow: the token row at each position of each sequence, -1 where
    none), the heads of the group ascending within a block; one float32 accumulator each,
    scale applied once. Nothing from another sequence enters, and nothing is added twice.
    KEYS (a divisor of BLOCK): the key rows a program takes, program
    ((s * NB + b) * (BLOCK // KEYS) + part, kv head) the part-th KEYS rows of block b. Every
    part walks the whole block's query range, so a key meets the same query blocks, with
    the same (zero where unseen) terms, whatever KEYS is: the same bits. TRANS: the
    products computed key-major (S^T = k q^T, dP^T = v dA^T), so P^T and dS^T enter dv's and
    dk's products without a transpose; each element is the same dot product over D and the
    same elementwise steps: the same bits."""
    sb = tl.program_id(0) // (BLOCK // KEYS)
    part = tl.program_id(0) % (BLOCK // KEYS)
    kvh = tl.program_id(1)
    s = sb // NB
    b = sb % NB
    rowb = tl.load(block_rows_ptr + s * NB + b).to(tl.int32)
    klen = tl.load(key_len_ptr + s).to(tl.int32)
    if (rowb >= 0) & (b * BLOCK + part * KEYS < klen):
        j = part * KEYS + tl.arange(0, KEYS)  # the program's keys within the block
        jq = tl.arange(0, BLOCK)  # a query block's slots
        d = tl.arange(0, BLOCK_D)
        dmask = d[None, :] < D
        jpos = b * BLOCK + j
        krow = rowb + j
        kmask = (jpos < klen) & (krow < N)
        kv_off = (krow.to(tl.int64)[:, None] * Hkv + kvh) * D + d[None, :]
        kt = tl.load(k_ptr + kv_off, mask=kmask[:, None] & dmask, other=0.0)
        vt = tl.load(v_ptr + kv_off, mask=kmask[:, None] & dmask, other=0.0)
        dk = tl.zeros((KEYS, BLOCK_D), tl.float32)
        dv = tl.zeros((KEYS, BLOCK_D), tl.float32)
        qb_hi = NB - 1
        if LOCAL:
            qb_hi = tl.minimum(qb_hi, (b * BLOCK + BLOCK - 1 + window - 1) // BLOCK)
        for qb in range(b, qb_hi + 1):
            if TRANS:
                dk, dv = _dkv_block_t(q_ptr, da_ptr, lse_ptr, delta_ptr, qrow_ptr, kt, vt, s,
                                      NB, qb, jpos, kmask, window, kvh, G, Hq, D, d, dmask, c,
                                      dk, dv, LOCAL, INTERPRET, IEEE, BLOCK)  # fmt: skip
            else:
                qpos = qb * BLOCK + jq  # the block's query slots, by position
                tok = tl.load(qrow_ptr + (s * NB + qb).to(tl.int64) * BLOCK + jq)
                has = tok >= 0
                # vis[i, key]: query slot i sees key j (a key is never past key_len here)
                vis = (jpos[None, :] <= qpos[:, None]) & has[:, None] & kmask[None, :]
                if LOCAL:
                    vis = vis & (jpos[None, :] > qpos[:, None] - window)
                dk, dv = _dkv_heads(q_ptr, da_ptr, lse_ptr, delta_ptr, kt, vt, tok, has, vis,
                                    kvh, G, Hq, D, d, dmask, c, dk, dv, INTERPRET, IEEE)
        st = kmask[:, None] & dmask
        tl.store(dk_ptr + kv_off, cast(dk * scale, dk_ptr.dtype.element_ty, INTERPRET), mask=st)
        tl.store(dv_ptr + kv_off, cast(dv, dv_ptr.dtype.element_ty, INTERPRET), mask=st)
