"""Triton GEMM building blocks: tile order, the promoted K step, and a strided GEMM kernel.

gemm_k: the tensor cores sum PROMOTE K steps into a fresh float32 partial, which is then
added to the running sum with an IEEE float32 add, in ascending order. A row's result
depends only on that row: tile sizes along M and N move no bits (verified on the H200 for
the configs in use), the K step and PROMOTE do.
"""

# fmt: off
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_coords(tile, n_t, n_v, GROUP: tl.constexpr):
    # Grouped order (GROUP row tiles share each column block in L2): it decides when a
    # tile runs, never what it computes.
    per_group = GROUP * n_v
    t_first = (tile // per_group) * GROUP
    group_rows = tl.minimum(n_t - t_first, GROUP)
    pid_t = t_first + (tile % per_group) % group_rows
    pid_v = (tile % per_group) // group_rows
    return pid_t, pid_v


@triton.jit
def _dot_block(a, b, acc, part, fresh, flush, INTERPRET: tl.constexpr, PROMOTE: tl.constexpr):
    """Add one K step of a @ b into (acc, part); returns (acc, part).

    PROMOTE 0: the tensor cores accumulate across all of K. Their accumulation truncates,
    and its bias grows with K (3e-6 rel. error at H = 6656 on the H200).
    PROMOTE n > 0: the tensor cores accumulate n steps into ``part``, started from
    ``fresh`` (zeros the compiler can't fold into the dot); at ``flush`` (every n-th step,
    and the last) ``part`` is added to ``acc`` with an IEEE float32 add.
    """
    if INTERPRET:
        # The interpreter's tl.dot is numpy's matmul, whose per-row order depends on the
        # row's place in the tile; an elementwise product and a sum over the K step
        # treat every row alike. Float32 first: the interpreter can't do bf16 arithmetic.
        part += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif PROMOTE == 0:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        part = tl.dot(a, b, part, input_precision="ieee")
    if INTERPRET or PROMOTE > 0:
        if flush:
            acc += part
            part = fresh
    return acc, part


@triton.jit
def _flush_at(k0, K, BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr):
    flush = k0 + BLOCK_K >= K
    if PROMOTE > 0:
        flush = flush | ((k0 // BLOCK_K) % PROMOTE == PROMOTE - 1)
    return flush


SUM_UNROLL = tl.constexpr(8)  # planes whose loads the CHUNK epilogue issues together


@triton.jit
def _sum_planes(acc, base_ptr, offs, mask, n_planes, stride_plane, UNROLL: tl.constexpr,
                CACHE: tl.constexpr):
    """acc + plane_0 + plane_1 + ... at ``offs``, ascending, float32 (plane j at
    ``base_ptr + j * stride_plane``): UNROLL planes' loads are issued ahead of their adds.
    A plane past n_planes loads as +0, and acc + 0 is acc (acc starts at +0, so it is never
    -0)."""
    for j0 in range(0, n_planes, UNROLL):
        for u in tl.static_range(UNROLL):
            j = j0 + u
            live = mask & ((offs * 0 + j) < n_planes)
            acc += tl.load(base_ptr + j * stride_plane + offs, mask=live, other=0.0,
                           cache_modifier=CACHE)
    return acc


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                 stride_bn, stride_cm, stride_cn, stride_cchunk, zero, out_ptr, arrivals_ptr,
                 ACCUMULATE: tl.constexpr, BIAS: tl.constexpr, INTERPRET: tl.constexpr,
                 PROMOTE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, CHUNK: tl.constexpr, FUSE_SUM: tl.constexpr,
                 SEEDED: tl.constexpr):
    """c = a @ b (+ bias, in float32; ACCUMULATE: c += a @ b, c float32), the K loop
    ascending, no split.

    ACCUMULATE adds the whole K sum to c once: c + (((0 + p_0) + p_1) + ...). SEEDED
    (with ACCUMULATE, no bias) starts the running sum at c instead: ((c + p_0) + p_1) + ...,
    and stores it into out (c's strides; c itself, or the result in its own dtype after the
    last call), so consecutive calls over K chunks whose edges fall on promoted partials
    (multiples of PROMOTE * BLOCK_K) give one call over all of K, rounding included.

    CHUNK > 0 (a multiple of PROMOTE * BLOCK_K): program (tile, j) computes only K chunk j,
    as 0 + its promoted partial, into float32 plane j of c (``stride_cchunk`` apart; planes
    and out row-major, rows ``stride_cm`` apart). The planes are then added in ascending
    order from zero (+ bias) and cast once into out: by ``_add_partials_kernel`` in a
    second launch, or (FUSE_SUM) in this one, by the tile's last program to arrive, which
    an arrival counter elects (the only atomic: it orders no arithmetic) and which resets
    the counter to zero. Every addition and its order are the sequential loop's.
    """
    tile = tl.program_id(0)
    pid_m, pid_n = _tile_coords(tile, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    k_lo = 0
    k_hi = K
    if CHUNK > 0:
        k_lo = tl.program_id(1) * CHUNK
        k_hi = tl.minimum(K, k_lo + CHUNK)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    ks64 = ks.to(tl.int64) + k_lo
    a_ptrs = a_ptr + (rm % M).to(tl.int64)[:, None] * stride_am + ks64[None, :] * stride_ak
    b_ptrs = b_ptr + ks64[:, None] * stride_bk + (rn % N).to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    fresh = acc + zero
    part = fresh
    if SEEDED:  # the running sum continues from c: partials are added to it one by one
        seed = rm.to(tl.int64)[:, None] * stride_cm + rn.to(tl.int64)[None, :] * stride_cn
        acc = tl.load(c_ptr + seed, mask=(rm < M)[:, None] & (rn < N)[None, :], other=0.0)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + ks) < k_hi
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc, part = _dot_block(a, b, acc, part, fresh, _flush_at(k0, k_hi, BLOCK_K, PROMOTE),
                               INTERPRET, PROMOTE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    offs = rm.to(tl.int64)[:, None] * stride_cm + rn.to(tl.int64)[None, :] * stride_cn
    c_mask = (rm < M)[:, None] & (rn < N)[None, :]
    if CHUNK > 0:  # planes and out are row-major, rows stride_cm apart
        offs = rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptr + tl.program_id(1).to(tl.int64) * stride_cchunk + offs, acc, mask=c_mask)
    if CHUNK > 0 and FUSE_SUM:
        tl.debug_barrier()  # every thread's part of the plane is written before the count
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:
            acc = _sum_planes(fresh, c_ptr, offs, c_mask, tl.num_programs(1), stride_cchunk,
                              SUM_UNROLL, ".cg")
            if BIAS:
                acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=c_mask)
            tl.atomic_xchg(arrivals_ptr + tile, 0)
    if CHUNK == 0:
        if BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if SEEDED:
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=c_mask)
        else:
            if ACCUMULATE:  # a chunk's partial added to a float32 buffer
                acc = tl.load(c_ptr + offs, mask=c_mask, other=0.0) + acc
            tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _add_partials_kernel(parts_ptr, c_ptr, bias_ptr, total, N, n_chunks, stride_chunk,
                         BIAS: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """c = ((0 + part_0) + part_1) + ... (+ bias), all float32, cast once: the sequential
    GEMM's epilogue over the planes that ``_gemm_kernel`` wrote with CHUNK > 0 and not
    FUSE_SUM (and, without bias, the RMSNorm backward's sum of its weight-gradient
    partials), UNROLL planes' loads ahead of their adds (_sum_planes)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = _sum_planes(tl.zeros((BLOCK,), dtype=tl.float32), parts_ptr, offs, ok, n_chunks,
                      stride_chunk, UNROLL, "")
    if BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)
