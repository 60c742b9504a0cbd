"""Triton kernels of softcap_logprob's forward.

Two launches. A partials kernel computes, for one tile of BLOCK_T rows and one vocabulary
block of BLOCK_V columns, the float32 logits (K loop in ascending blocks of BLOCK_K into
one float32 accumulator), the multiplier and soft cap in float32, and the row partials of
the block: max, sum of exp(z - max), and z at the target when the target falls in the
block. ``_merge_kernel`` then walks the blocks of each row in ascending order.

Three partials kernels compute the same tiles with the same arithmetic and differ only
in how tiles are scheduled and operands loaded: ``_partials_kernel`` (one program per
tile, pointer loads), ``_partials_persistent_kernel`` (one program per SM looping over
tiles, so the next tile's loads overlap this tile's epilogue) and
``_partials_tma_kernel`` (persistent, operands through TMA tensor descriptors).

Every reduction's order is fixed by BLOCK_K, BLOCK_V and the warp layout, never by T or
by a row's position: a row's bits are the same in any batch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # float32 tanh without libdevice (the interpreter lacks it). |x| < 0.625: odd minimax
    # polynomial (Cephes tanhf); else 1 - 2/(exp(2|x|) + 1) with the sign restored, the
    # division the hardware's approximate one (<= 2 ulp; IEEE division costs ~10x more).
    # |x| is clamped at 15, where tanh already rounds to 1 in float32.
    ax = tl.minimum(tl.abs(x), 15.0)
    x2 = x * x
    p = x2 * -5.70498872745e-3 + 2.06390887954e-2
    p = p * x2 - 5.37397155531e-2
    p = p * x2 + 1.33314422036e-1
    p = p * x2 - 3.33332819422e-1
    small = x + x * x2 * p
    big = 1.0 - 2.0 / (tl.exp(2.0 * ax) + 1.0)
    big = tl.where(x < 0, -big, big)
    return tl.where(ax < 0.625, small, big)


@triton.jit
def _tile_coords(tile, T, V, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, GROUP_T: tl.constexpr):
    # Grouped order (GROUP_T row tiles share each weight block in L2): it decides when a
    # tile runs, never what it computes.
    n_t = tl.cdiv(T, BLOCK_T)
    n_v = tl.cdiv(V, BLOCK_V)
    per_group = GROUP_T * n_v
    t_first = (tile // per_group) * GROUP_T
    group_rows = tl.minimum(n_t - t_first, GROUP_T)
    pid_t = t_first + (tile % per_group) % group_rows
    pid_v = (tile % per_group) // group_rows
    return pid_t, pid_v


@triton.jit
def _dot_block(a, b, acc, part, fresh, flush, INTERPRET: tl.constexpr, PROMOTE: tl.constexpr):
    """gemm_k: add one K block of a @ b.T; returns (acc, part).

    PROMOTE 0: the tensor cores accumulate across all of H. Their accumulation
    truncates, and its bias grows with the number of blocks (3e-6 rel. error at
    H = 6656 on the H200).
    PROMOTE n > 0: the tensor cores accumulate n blocks into ``part``, started from
    ``fresh`` (zeros the compiler can't fold into the dot); at ``flush`` (every n-th
    block, and the last) ``part`` is added to ``acc`` with an IEEE float32 add.
    """
    if INTERPRET:
        # The interpreter's tl.dot is numpy's matmul, whose per-row order depends on the
        # row's place in the tile; an elementwise product and a sum over the K block
        # treat every row alike. Float32 first: the interpreter can't do bf16 arithmetic.
        part += tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)
    elif PROMOTE == 0:
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        part = tl.dot(a, tl.trans(b), part, input_precision="ieee")
    if INTERPRET or PROMOTE > 0:
        if flush:
            acc += part
            part = fresh
    return acc, part


@triton.jit
def _gemm_tile_pointers(
    h_ptr,
    w_ptr,
    T,
    V,
    H,
    stride_h,
    stride_w,
    pid_t,
    pid_v,
    zero,
    INTERPRET: tl.constexpr,
    PROMOTE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    # Out-of-range rows/columns read a valid row instead of masking; their results are
    # discarded, and no valid row or column ever reads them.
    h_ptrs = h_ptr + (rows % T).to(tl.int64)[:, None] * stride_h + ks[None, :]
    w_ptrs = w_ptr + (cols % V).to(tl.int64)[:, None] * stride_w + ks[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    fresh = acc + zero
    part = fresh
    for k0 in range(0, H, BLOCK_K):  # gemm_k: ascending K blocks, one float32 accumulator
        flush = k0 + BLOCK_K >= H
        if PROMOTE > 0:
            flush = flush | ((k0 // BLOCK_K) % PROMOTE == PROMOTE - 1)
        if EVEN_K:
            a = tl.load(h_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = (k0 + ks) < H
            a = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        acc, part = _dot_block(a, b, acc, part, fresh, flush, INTERPRET, PROMOTE)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _tile_partials(
    acc,
    t_ptr,
    pmax_ptr,
    psum_ptr,
    zt_ptr,
    T,
    V,
    pid_t,
    pid_v,
    scale,
    softcap,
    HAS_CAP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < T
    if HAS_CAP:
        z = softcap * _tanh(acc * scale)
    else:
        z = acc * scale
    z = tl.where((cols < V)[None, :], z, float("-inf"))
    m = tl.max(z, axis=1)
    s = tl.sum(tl.exp(z - m[:, None]), axis=1)
    part = pid_v.to(tl.int64) * T + rows
    tl.store(pmax_ptr + part, m, mask=row_ok)
    tl.store(psum_ptr + part, s, mask=row_ok)
    tgt = tl.load(t_ptr + rows, mask=row_ok, other=-1)
    z_t = tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)  # one term: exact
    in_block = (tgt >= pid_v * BLOCK_V) & (tgt < pid_v * BLOCK_V + BLOCK_V)
    tl.store(zt_ptr + rows, z_t, mask=row_ok & in_block)


@triton.jit
def _partials_kernel(
    h_ptr,
    w_ptr,
    t_ptr,
    pmax_ptr,
    psum_ptr,
    zt_ptr,
    T,
    V,
    H,
    stride_h,
    stride_w,
    scale,
    softcap,
    zero,
    HAS_CAP: tl.constexpr,
    INTERPRET: tl.constexpr,
    PROMOTE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_T: tl.constexpr,
):
    pid_t, pid_v = _tile_coords(tl.program_id(0), T, V, BLOCK_T, BLOCK_V, GROUP_T)
    acc = _gemm_tile_pointers(
        h_ptr,
        w_ptr,
        T,
        V,
        H,
        stride_h,
        stride_w,
        pid_t,
        pid_v,
        zero,
        INTERPRET,
        PROMOTE,
        EVEN_K,
        BLOCK_T,
        BLOCK_V,
        BLOCK_K,
    )
    _tile_partials(
        acc,
        t_ptr,
        pmax_ptr,
        psum_ptr,
        zt_ptr,
        T,
        V,
        pid_t,
        pid_v,
        scale,
        softcap,
        HAS_CAP,
        BLOCK_T,
        BLOCK_V,
    )


@triton.jit
def _partials_persistent_kernel(
    h_ptr,
    w_ptr,
    t_ptr,
    pmax_ptr,
    psum_ptr,
    zt_ptr,
    T,
    V,
    H,
    stride_h,
    stride_w,
    scale,
    softcap,
    zero,
    HAS_CAP: tl.constexpr,
    INTERPRET: tl.constexpr,
    PROMOTE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_T: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    n_tiles = tl.cdiv(T, BLOCK_T) * tl.cdiv(V, BLOCK_V)
    for tile in tl.range(tl.program_id(0), n_tiles, NUM_PROGRAMS, flatten=True):
        pid_t, pid_v = _tile_coords(tile, T, V, BLOCK_T, BLOCK_V, GROUP_T)
        acc = _gemm_tile_pointers(
            h_ptr,
            w_ptr,
            T,
            V,
            H,
            stride_h,
            stride_w,
            pid_t,
            pid_v,
            zero,
            INTERPRET,
            PROMOTE,
            EVEN_K,
            BLOCK_T,
            BLOCK_V,
            BLOCK_K,
        )
        _tile_partials(
            acc,
            t_ptr,
            pmax_ptr,
            psum_ptr,
            zt_ptr,
            T,
            V,
            pid_t,
            pid_v,
            scale,
            softcap,
            HAS_CAP,
            BLOCK_T,
            BLOCK_V,
        )


@triton.jit
def _partials_tma_kernel(
    h_desc,
    w_desc,
    t_ptr,
    pmax_ptr,
    psum_ptr,
    zt_ptr,
    T,
    V,
    H,
    scale,
    softcap,
    zero,
    HAS_CAP: tl.constexpr,
    INTERPRET: tl.constexpr,
    PROMOTE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_T: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    # TMA zero-fills reads past T, V and H: zeros add nothing to a valid row's sums.
    n_tiles = tl.cdiv(T, BLOCK_T) * tl.cdiv(V, BLOCK_V)
    for tile in tl.range(tl.program_id(0), n_tiles, NUM_PROGRAMS, flatten=True):
        pid_t, pid_v = _tile_coords(tile, T, V, BLOCK_T, BLOCK_V, GROUP_T)
        acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
        fresh = acc + zero
        part = fresh
        for k0 in range(0, H, BLOCK_K):  # gemm_k: ascending K blocks
            flush = k0 + BLOCK_K >= H
            if PROMOTE > 0:
                flush = flush | ((k0 // BLOCK_K) % PROMOTE == PROMOTE - 1)
            a = h_desc.load([pid_t * BLOCK_T, k0])
            b = w_desc.load([pid_v * BLOCK_V, k0])
            acc, part = _dot_block(a, b, acc, part, fresh, flush, INTERPRET, PROMOTE)
        _tile_partials(
            acc,
            t_ptr,
            pmax_ptr,
            psum_ptr,
            zt_ptr,
            T,
            V,
            pid_t,
            pid_v,
            scale,
            softcap,
            HAS_CAP,
            BLOCK_T,
            BLOCK_V,
        )


@triton.jit
def _merge_kernel(
    pmax_ptr,
    psum_ptr,
    zt_ptr,
    t_ptr,
    out_ptr,
    T,
    NUM_BLOCKS,
    ignore_index,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < T
    run_max = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_R,), tl.float32)
    for b in range(0, NUM_BLOCKS):  # vocab_lse: ascending blocks, online max rescale
        part = b * T + rows.to(tl.int64)
        m = tl.load(pmax_ptr + part, mask=row_ok, other=0.0)
        s = tl.load(psum_ptr + part, mask=row_ok, other=1.0)
        new_max = tl.maximum(run_max, m)
        run_sum = run_sum * tl.exp(run_max - new_max) + s * tl.exp(m - new_max)
        run_max = new_max
    lse = run_max + tl.log(run_sum)
    tgt = tl.load(t_ptr + rows, mask=row_ok, other=ignore_index)
    z_t = tl.load(zt_ptr + rows, mask=row_ok & (tgt != ignore_index), other=0.0)
    tl.store(out_ptr + rows, tl.where(tgt == ignore_index, 0.0, z_t - lse), mask=row_ok)
