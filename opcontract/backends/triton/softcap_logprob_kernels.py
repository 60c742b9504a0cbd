"""Triton kernels of softcap_logprob, forward and backward.

Forward: a partials kernel computes, for one tile of BLOCK_T rows and one vocabulary block
of BLOCK_V columns, the float32 logits, the multiplier and soft cap in float32, and the
row partials of the block: max, sum of exp(z - max), (optionally) sum of exp(z - max)*z,
the first column at the max, sum of z and sum of exp(2 (z - max)), and z at the target when
the target falls in the block. ``_merge_kernel`` walks each row's blocks in ascending order.

Three partials kernels compute the same tiles with the same arithmetic and differ only
in how tiles are scheduled and operands loaded: ``_partials_kernel`` (one program per
tile, pointer loads), ``_partials_persistent_kernel`` (one program per SM looping over
tiles) and ``_partials_tma_kernel`` (persistent, operands through TMA descriptors).

gemm_k: the tensor cores sum PROMOTE K steps into a fresh float32 partial, which is then
added to the running sum with an IEEE float32 add, in ascending order.

Backward, per vocabulary chunk in ascending order: ``_grad_logits_kernel`` recomputes the
chunk's logits (same tiles, same bits as the forward) and writes g = dlogprob/dacc in the
input dtype; ``dense_gemm_kernels._gemm_kernel`` then computes grad_weight[chunk] = g.T @ hidden
(the K loop over tokens, written once) and grad_hidden += g @ weight[chunk] (a float32
buffer).

Every reduction's order is fixed by the block sizes and the warp layout, never by T or by
a row's position: a row's bits are the same in any batch.
"""

# fmt: off
from __future__ import annotations

import triton
import triton.language as tl

from opcontract.backends.triton.dense_gemm_kernels import _dot_block, _flush_at, _tile_coords


@triton.jit
def _tanh(x):
    # float32 tanh without libdevice (the interpreter lacks it). |x| < 0.625: odd minimax
    # polynomial (Cephes tanhf); else 1 - 2/(exp(2|x|) + 1) with the sign restored, the
    # division the hardware's approximate one (<= 2 ulp; IEEE division costs ~10x more).
    # |x| is clamped at 15, where tanh already rounds to 1 in float32; NaN stays NaN (the
    # float64 math's tanh(NaN)), so a NaN logit is never capped to a finite one.
    ax = tl.minimum(tl.abs(x), 15.0, propagate_nan=tl.PropagateNan.ALL)
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
def _logits_tile_pointers(h_ptr, w_ptr, T, V, H, stride_h, stride_w, pid_t, pid_v, zero,
                          INTERPRET: tl.constexpr, PROMOTE: tl.constexpr, EVEN_K: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc[BLOCK_T, BLOCK_V] = hidden[rows] @ weight[cols].T, gemm_k in ascending K steps."""
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    # Out-of-range rows/columns read a valid row instead of masking; their results are
    # discarded, and no valid row or column ever reads them.
    h_ptrs = h_ptr + (rows % T).to(tl.int64)[:, None] * stride_h + ks[None, :]
    w_ptrs = w_ptr + (cols % V).to(tl.int64)[None, :] * stride_w + ks[:, None]
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    fresh = acc + zero
    part = fresh
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            a = tl.load(h_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = (k0 + ks) < H
            a = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc, part = _dot_block(a, b, acc, part, fresh, _flush_at(k0, H, BLOCK_K, PROMOTE),
                               INTERPRET, PROMOTE)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _capped(acc, scale, softcap, HAS_CAP: tl.constexpr):
    """(z, t): z = softcap * t with t = tanh(acc * scale); without a cap z = acc * scale."""
    if HAS_CAP:
        t = _tanh(acc * scale)
        z = softcap * t
    else:
        t = acc
        z = acc * scale
    return z, t


@triton.jit
def _tile_partials(acc, t_ptr, pmax_ptr, psum_ptr, pzs_ptr, parg_ptr, pzsum_ptr, psq_ptr, zt_ptr,
                   z_ptr, T, V, pid_t, pid_v, scale, softcap,
                   HAS_CAP: tl.constexpr, ENTROPY: tl.constexpr, ARGMAX: tl.constexpr,
                   ZSUM: tl.constexpr, SQ: tl.constexpr, LOGITS: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < T
    z, _t = _capped(acc, scale, softcap, HAS_CAP)
    if LOGITS:  # the sampler head: z itself, the very values the partials below reduce
        z_ptrs = z_ptr + rows.to(tl.int64)[:, None] * V + cols[None, :]
        tl.store(z_ptrs, z, mask=row_ok[:, None] & (cols < V)[None, :])
    z = tl.where((cols < V)[None, :], z, float("-inf"))
    m = tl.max(z, axis=1)
    e = tl.exp(z - m[:, None])
    part = pid_v.to(tl.int64) * T + rows
    tl.store(pmax_ptr + part, m, mask=row_ok)
    tl.store(psum_ptr + part, tl.sum(e, axis=1), mask=row_ok)
    z_ok = tl.where((cols < V)[None, :], z, 0.0)  # e is 0 there; avoid 0 * -inf
    if ENTROPY:
        tl.store(pzs_ptr + part, tl.sum(e * z_ok, axis=1), mask=row_ok)
    if ZSUM:
        tl.store(pzsum_ptr + part, tl.sum(z_ok, axis=1), mask=row_ok)
    if SQ:  # vocab_sq: exp(2 (z - m)), 0 past V (z = -inf there); 2 (z - m) is exact
        tl.store(psq_ptr + part, tl.sum(tl.exp(2.0 * (z - m[:, None])), axis=1), mask=row_ok)
    if ARGMAX:
        first = tl.min(tl.where(z == m[:, None], cols[None, :], V), axis=1)  # lowest at max
        tl.store(parg_ptr + part, first, mask=row_ok)
    tgt = tl.load(t_ptr + rows, mask=row_ok, other=-1)
    z_t = tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)  # one term: exact
    in_block = (tgt >= pid_v * BLOCK_V) & (tgt < pid_v * BLOCK_V + BLOCK_V)
    tl.store(zt_ptr + rows, z_t, mask=row_ok & in_block)


@triton.jit
def _partials_kernel(h_ptr, w_ptr, t_ptr, pmax_ptr, psum_ptr, pzs_ptr, parg_ptr, pzsum_ptr,
                     psq_ptr, zt_ptr, z_ptr,
                     T, V, H, stride_h, stride_w, scale, softcap, zero,
                     HAS_CAP: tl.constexpr, ENTROPY: tl.constexpr, ARGMAX: tl.constexpr,
                     ZSUM: tl.constexpr, SQ: tl.constexpr, LOGITS: tl.constexpr,
                     INTERPRET: tl.constexpr,
                     PROMOTE: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_T: tl.constexpr):
    pid_t, pid_v = _tile_coords(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.cdiv(V, BLOCK_V),
                                GROUP_T)
    acc = _logits_tile_pointers(h_ptr, w_ptr, T, V, H, stride_h, stride_w, pid_t, pid_v, zero,
                                INTERPRET, PROMOTE, EVEN_K, BLOCK_T, BLOCK_V, BLOCK_K)
    _tile_partials(acc, t_ptr, pmax_ptr, psum_ptr, pzs_ptr, parg_ptr, pzsum_ptr, psq_ptr, zt_ptr,
                   z_ptr, T, V, pid_t, pid_v, scale, softcap, HAS_CAP, ENTROPY, ARGMAX, ZSUM, SQ,
                   LOGITS, BLOCK_T, BLOCK_V)


@triton.jit
def _partials_persistent_kernel(h_ptr, w_ptr, t_ptr, pmax_ptr, psum_ptr, pzs_ptr, parg_ptr,
                                pzsum_ptr, psq_ptr, zt_ptr, z_ptr, T, V, H, stride_h, stride_w,
                                scale, softcap, zero,
                                HAS_CAP: tl.constexpr, ENTROPY: tl.constexpr,
                                ARGMAX: tl.constexpr, ZSUM: tl.constexpr, SQ: tl.constexpr,
                                LOGITS: tl.constexpr,
                                INTERPRET: tl.constexpr,
                                PROMOTE: tl.constexpr, EVEN_K: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                                BLOCK_K: tl.constexpr, GROUP_T: tl.constexpr,
                                NUM_PROGRAMS: tl.constexpr):
    n_t = tl.cdiv(T, BLOCK_T)
    n_v = tl.cdiv(V, BLOCK_V)
    for tile in tl.range(tl.program_id(0), n_t * n_v, NUM_PROGRAMS, flatten=True):
        pid_t, pid_v = _tile_coords(tile, n_t, n_v, GROUP_T)
        acc = _logits_tile_pointers(h_ptr, w_ptr, T, V, H, stride_h, stride_w, pid_t, pid_v,
                                    zero, INTERPRET, PROMOTE, EVEN_K, BLOCK_T, BLOCK_V, BLOCK_K)
        _tile_partials(acc, t_ptr, pmax_ptr, psum_ptr, pzs_ptr, parg_ptr, pzsum_ptr, psq_ptr,
                       zt_ptr, z_ptr, T, V, pid_t, pid_v, scale, softcap, HAS_CAP, ENTROPY, ARGMAX,
                       ZSUM, SQ, LOGITS, BLOCK_T, BLOCK_V)


@triton.jit
def _partials_tma_kernel(h_desc, w_desc, t_ptr, pmax_ptr, psum_ptr, pzs_ptr, parg_ptr, pzsum_ptr,
                         psq_ptr, zt_ptr, z_ptr,
                         T, V, H, scale, softcap, zero,
                         HAS_CAP: tl.constexpr, ENTROPY: tl.constexpr, ARGMAX: tl.constexpr,
                         ZSUM: tl.constexpr, SQ: tl.constexpr, LOGITS: tl.constexpr,
                         INTERPRET: tl.constexpr,
                         PROMOTE: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_T: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    # TMA zero-fills reads past T, V and H: zeros add nothing to a valid row's sums.
    n_t = tl.cdiv(T, BLOCK_T)
    n_v = tl.cdiv(V, BLOCK_V)
    for tile in tl.range(tl.program_id(0), n_t * n_v, NUM_PROGRAMS, flatten=True):
        pid_t, pid_v = _tile_coords(tile, n_t, n_v, GROUP_T)
        acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
        fresh = acc + zero
        part = fresh
        for k0 in range(0, H, BLOCK_K):
            a = h_desc.load([pid_t * BLOCK_T, k0])
            b = w_desc.load([pid_v * BLOCK_V, k0])
            acc, part = _dot_block(a, tl.trans(b), acc, part, fresh,
                                   _flush_at(k0, H, BLOCK_K, PROMOTE), INTERPRET, PROMOTE)
        _tile_partials(acc, t_ptr, pmax_ptr, psum_ptr, pzs_ptr, parg_ptr, pzsum_ptr, psq_ptr,
                       zt_ptr, z_ptr, T, V, pid_t, pid_v, scale, softcap, HAS_CAP, ENTROPY, ARGMAX,
                       ZSUM, SQ, LOGITS, BLOCK_T, BLOCK_V)


@triton.jit
def _merge_start(T, BLOCK_R: tl.constexpr):
    """The program's rows, which of them exist, and their empty running state (max -inf,
    sums 0, argmax 0): what ``_merge_one`` folds blocks onto."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    zero = tl.zeros((BLOCK_R,), tl.float32)
    return (rows, rows < T, tl.full((BLOCK_R,), float("-inf"), tl.float32), zero, zero,
            tl.zeros((BLOCK_R,), tl.int64), zero, zero)


@triton.jit
def _merge_store(run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq, zt_ptr, t_ptr,
                 logprob_ptr, lse_ptr, entropy_ptr, meanz_ptr, pred_ptr, smooth_ptr, zmean_ptr,
                 sq_ptr, rows, row_ok, V, ignore_index, ENTROPY: tl.constexpr,
                 ARGMAX: tl.constexpr, ZSUM: tl.constexpr, SQ: tl.constexpr):
    """The merged rows' outputs from their running state."""
    log_sum = tl.log(run_sum)
    lse = run_max + log_sum
    tgt = tl.load(t_ptr + rows, mask=row_ok, other=ignore_index)
    z_t = tl.load(zt_ptr + rows, mask=row_ok & (tgt != ignore_index), other=0.0)
    tl.store(logprob_ptr + rows, tl.where(tgt == ignore_index, 0.0, z_t - lse), mask=row_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    if ENTROPY:
        mean_z = run_zs / run_sum
        tl.store(meanz_ptr + rows, mean_z, mask=row_ok)
        tl.store(entropy_ptr + rows, lse - mean_z, mask=row_ok)
    if ARGMAX:
        tl.store(pred_ptr + rows, arg_idx, mask=row_ok)
    if ZSUM:  # mean_v z, and label smoothing's term lse - mean_v z
        z_mean = run_zsum / V
        tl.store(zmean_ptr + rows, z_mean, mask=row_ok)
        tl.store(smooth_ptr + rows, lse - z_mean, mask=row_ok)
    if SQ:  # log sum_v p^2 = log(S2) - 2 log(S)
        tl.store(sq_ptr + rows, tl.log(run_sq) - 2.0 * log_sum, mask=row_ok)


@triton.jit
def _halves(x):
    """x [R, 2n] as (its even columns, its odd columns), each [R, n]: registers renamed."""
    return tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))


@triton.jit
def _merge_one(run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq, m, s, zs, idx, zsum, s2,
               ENTROPY: tl.constexpr, ARGMAX: tl.constexpr, ZSUM: tl.constexpr,
               SQ: tl.constexpr):
    """One block's partials onto the running state, its fmas written out (the forms sm_90
    compiled for the plain expression: left to the compiler, an unrolled merge contracted the
    other product and moved bits on the H200)."""
    new_max = tl.maximum(run_max, m)
    d_old = run_max - new_max
    d_new = m - new_max
    old_scale = tl.exp(d_old)
    b_scale = tl.exp(d_new)
    run_sum = tl.math.fma(run_sum, old_scale, b_scale * s)
    if ENTROPY:
        run_zs = tl.math.fma(run_zs, old_scale, b_scale * zs)
    if ARGMAX:  # a later block wins only with a strictly larger max
        arg_idx = tl.where(m > run_max, idx.to(tl.int64), arg_idx)
    if ZSUM:
        run_zsum = run_zsum + zsum
    if SQ:
        run_sq = tl.math.fma(run_sq, tl.exp(d_old + d_old), tl.exp(d_new + d_new) * s2)
    return new_max, run_sum, run_zs, arg_idx, run_zsum, run_sq


@triton.jit
def _load_four(pmax_ptr, psum_ptr, pzs_ptr, parg_ptr, pzsum_ptr, psq_ptr, b0, rows, row_ok, T,
               NUM_BLOCKS, ENTROPY: tl.constexpr, ARGMAX: tl.constexpr, ZSUM: tl.constexpr,
               SQ: tl.constexpr):
    """Blocks b0 .. b0 + 3 of the rows' partials as [BLOCK_R, 4] tiles; a block past the last
    reads as neutral partials (max -inf, sums 0, zsum -0.0), which merge as no-ops."""
    blk = b0 + tl.arange(0, 4)
    part = blk[None, :].to(tl.int64) * T + rows[:, None].to(tl.int64)
    ok = row_ok[:, None] & (blk[None, :] < NUM_BLOCKS)
    m = tl.load(pmax_ptr + part, mask=ok, other=float("-inf"))
    s = tl.load(psum_ptr + part, mask=ok, other=0.0)
    zs = m
    idx = part.to(tl.int32)
    zsum = m
    s2 = m
    if ENTROPY:
        zs = tl.load(pzs_ptr + part, mask=ok, other=0.0)
    if ARGMAX:
        idx = tl.load(parg_ptr + part, mask=ok, other=0)
    if ZSUM:
        zsum = tl.load(pzsum_ptr + part, mask=ok, other=-0.0)
    if SQ:
        s2 = tl.load(psq_ptr + part, mask=ok, other=0.0)
    return m, s, zs, idx, zsum, s2


@triton.jit
def _quarters(x):
    """x [R, 4] as its four columns, each [R], in order: registers renamed."""
    ev, od = _halves(x)
    c0, c2 = tl.split(ev)
    c1, c3 = tl.split(od)
    return c0, c1, c2, c3


@triton.jit
def _merge_four(run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq, m, s, zs, idx, zsum, s2,
                ENTROPY: tl.constexpr, ARGMAX: tl.constexpr, ZSUM: tl.constexpr,
                SQ: tl.constexpr):
    """Four blocks' [BLOCK_R, 4] partials onto the running state, one block after another."""
    m0, m1, m2, m3 = _quarters(m)
    s0, s1, s2_, s3 = _quarters(s)
    zs0, zs1, zs2, zs3 = _quarters(zs)
    i0, i1, i2, i3 = _quarters(idx)
    z0, z1, z2, z3 = _quarters(zsum)
    q0, q1, q2, q3 = _quarters(s2)
    run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq = _merge_one(
        run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq, m0, s0, zs0, i0, z0, q0,
        ENTROPY, ARGMAX, ZSUM, SQ)
    run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq = _merge_one(
        run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq, m1, s1, zs1, i1, z1, q1,
        ENTROPY, ARGMAX, ZSUM, SQ)
    run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq = _merge_one(
        run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq, m2, s2_, zs2, i2, z2, q2,
        ENTROPY, ARGMAX, ZSUM, SQ)
    return _merge_one(run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq, m3, s3, zs3, i3,
                      z3, q3, ENTROPY, ARGMAX, ZSUM, SQ)


@triton.jit
def _merge_kernel(pmax_ptr, psum_ptr, pzs_ptr, parg_ptr, pzsum_ptr, psq_ptr, zt_ptr, t_ptr,
                  logprob_ptr, lse_ptr, entropy_ptr, meanz_ptr, pred_ptr, smooth_ptr,
                  zmean_ptr, sq_ptr, T, V, NUM_BLOCKS, ignore_index,
                  ENTROPY: tl.constexpr, ARGMAX: tl.constexpr, ZSUM: tl.constexpr,
                  SQ: tl.constexpr, BLOCK_R: tl.constexpr):
    """Each row's block partials in ascending order (vocab_*: online max rescale), one block
    after another (``_merge_one``). The partials are read four blocks a tile, eight blocks
    ahead of the chain, so the loads are in flight while it runs: the chain, not memory,
    sets the pace (on the H100, 245 -> 129 us at T = 1 and 322 -> 132 us at T = 64 with
    every output on, against a loop that read each block as it merged it, same bits:
    benchmarks/results/sampler_head_apart_h100.json)."""
    rows, row_ok, run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq = _merge_start(T, BLOCK_R)
    a_m, a_s, a_zs, a_i, a_z, a_q = _load_four(pmax_ptr, psum_ptr, pzs_ptr, parg_ptr, pzsum_ptr,
                                               psq_ptr, 0, rows, row_ok, T, NUM_BLOCKS,
                                               ENTROPY, ARGMAX, ZSUM, SQ)
    b_m, b_s, b_zs, b_i, b_z, b_q = _load_four(pmax_ptr, psum_ptr, pzs_ptr, parg_ptr, pzsum_ptr,
                                               psq_ptr, 4, rows, row_ok, T, NUM_BLOCKS,
                                               ENTROPY, ARGMAX, ZSUM, SQ)
    for b0 in range(0, NUM_BLOCKS, 4):
        c_m, c_s, c_zs, c_i, c_z, c_q = _load_four(pmax_ptr, psum_ptr, pzs_ptr, parg_ptr,
                                                   pzsum_ptr, psq_ptr, b0 + 8, rows, row_ok, T,
                                                   NUM_BLOCKS, ENTROPY, ARGMAX, ZSUM, SQ)
        run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq = _merge_four(
            run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq, a_m, a_s, a_zs, a_i, a_z, a_q,
            ENTROPY, ARGMAX, ZSUM, SQ)
        a_m, a_s, a_zs, a_i, a_z, a_q = b_m, b_s, b_zs, b_i, b_z, b_q
        b_m, b_s, b_zs, b_i, b_z, b_q = c_m, c_s, c_zs, c_i, c_z, c_q
    _merge_store(run_max, run_sum, run_zs, arg_idx, run_zsum, run_sq, zt_ptr, t_ptr,
                 logprob_ptr, lse_ptr, entropy_ptr, meanz_ptr, pred_ptr, smooth_ptr, zmean_ptr,
                 sq_ptr, rows, row_ok, V, ignore_index, ENTROPY, ARGMAX, ZSUM, SQ)


@triton.jit
def _grad_tile(acc, rows, cols, t_ptr, lse_ptr, meanz_ptr, gl_ptr, ge_ptr, gs_ptr, g_ptr,
               T, V, stride_g, v_first, n_cols, scale, softcap, multiplier, ignore_index,
               HAS_CAP: tl.constexpr, ENTROPY: tl.constexpr, SMOOTH: tl.constexpr):
    """Store g = dz/dacc * dL/dz of one acc tile (global rows and columns) in g's dtype."""
    row_ok = rows < T
    col_ok = (cols < V) & (cols < v_first + n_cols)
    z, t = _capped(acc, scale, softcap, HAS_CAP)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(t_ptr + rows, mask=row_ok, other=ignore_index)
    gl = tl.load(gl_ptr + rows, mask=row_ok & (tgt != ignore_index), other=0.0)
    p = tl.exp(z - lse[:, None])
    # Where two products meet in one add, the fma that fuses one of them is written out.
    # Left to the compiler, it fused either, chosen per element by its register in the tile
    # (sm_90: 31 of a thread's 64 elements one way, the rest the other), so g moved with the
    # tile layout and differed between kernels (tests/test_head_ptx.py). The forms are those
    # sm_90 compiled before wherever it compiled one: the entropy term rounded and the loss
    # term fused; with smoothing, gz so far rounded and the smoothing product fused.
    hit = tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0)
    if ENTROPY:
        ge = tl.load(ge_ptr + rows, mask=row_ok, other=0.0)
        mean_z = tl.load(meanz_ptr + rows, mask=row_ok, other=0.0)
        # x * -1.0, not -x: Triton writes -x as 0 - x, which an fma would swallow
        gz = tl.math.fma(gl[:, None], hit - p, ge[:, None] * p * (z - mean_z[:, None]) * -1.0)
    else:
        gz = gl[:, None] * (hit - p)
    if SMOOTH:  # d(lse - mean_v z)/dz = p - 1/V
        gs = tl.load(gs_ptr + rows, mask=row_ok, other=0.0)
        gz = tl.math.fma(gs[:, None], p - 1.0 / V, gz)
    if HAS_CAP:
        gz = gz * (multiplier * (1.0 - t * t))  # one product: one fma, nothing to choose
    else:
        gz = gz * multiplier
    g = tl.where(col_ok[None, :], gz, 0.0)
    g_ptrs = g_ptr + rows.to(tl.int64)[:, None] * stride_g + (cols - v_first)[None, :]
    tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty),
             mask=row_ok[:, None] & ((cols - v_first) < n_cols)[None, :])


@triton.jit
def _grad_logits_kernel(h_ptr, w_ptr, t_ptr, lse_ptr, meanz_ptr, gl_ptr, ge_ptr, gs_ptr, g_ptr,
                        T, V, H, stride_h, stride_w, stride_g, v_first, n_cols,
                        scale, softcap, multiplier, ignore_index, zero,
                        HAS_CAP: tl.constexpr, ENTROPY: tl.constexpr, SMOOTH: tl.constexpr,
                        INTERPRET: tl.constexpr, PROMOTE: tl.constexpr, EVEN_K: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_T: tl.constexpr):
    """g[t, v - v_first] = dz/dacc * dL/dz for the chunk's columns, in g's dtype."""
    pid_t, pid_local = _tile_coords(tl.program_id(0), tl.cdiv(T, BLOCK_T),
                                    tl.cdiv(n_cols, BLOCK_V), GROUP_T)
    pid_v = v_first // BLOCK_V + pid_local
    acc = _logits_tile_pointers(h_ptr, w_ptr, T, V, H, stride_h, stride_w, pid_t, pid_v, zero,
                                INTERPRET, PROMOTE, EVEN_K, BLOCK_T, BLOCK_V, BLOCK_K)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    _grad_tile(acc, rows, cols, t_ptr, lse_ptr, meanz_ptr, gl_ptr, ge_ptr, gs_ptr, g_ptr,
               T, V, stride_g, v_first, n_cols, scale, softcap, multiplier, ignore_index,
               HAS_CAP, ENTROPY, SMOOTH)


# From a stored acc: the logits' GEMM run apart (the CuTe mainloop, with the same promoted
# partials, so the same acc), acc[T, n_cols] float32 for columns [v_first, v_first + n_cols),
# v_first a multiple of BLOCK_V. The epilogues are the fused kernels' own functions.

@triton.jit
def _load_acc_tile(acc_ptr, stride_acc, T, rows, local_cols, n_cols, zero_ptr,
                   INTERPRET: tl.constexpr, MMA_LAYOUT: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    """One [BLOCK_T, BLOCK_V] acc tile (0 past T and n_cols). MMA_LAYOUT: the tile is passed
    through a tensor-core dot of zeros (acc + 0 = acc: the running sum is never -0), which
    gives it the accumulator layout of the fused kernels' dot, so the epilogue's row sums
    take their thread and lane order."""
    ptrs = acc_ptr + rows.to(tl.int64)[:, None] * stride_acc + local_cols[None, :]
    acc = tl.load(ptrs, mask=(rows < T)[:, None] & (local_cols < n_cols)[None, :], other=0.0)
    if MMA_LAYOUT and not INTERPRET:
        za = tl.load(zero_ptr + tl.arange(0, BLOCK_T)[:, None] * 0 + tl.arange(0, 16)[None, :])
        zb = tl.load(zero_ptr + tl.arange(0, 16)[:, None] * 0 + tl.arange(0, BLOCK_V)[None, :])
        acc = tl.dot(za, zb, acc, input_precision="ieee")
    return acc


@triton.jit
def _partials_from_acc_kernel(acc_ptr, stride_acc, zero_ptr, t_ptr, pmax_ptr, psum_ptr,
                              pzs_ptr, parg_ptr, pzsum_ptr, psq_ptr, zt_ptr, z_ptr,
                              T, V, v_first, n_cols, scale, softcap,
                              HAS_CAP: tl.constexpr, ENTROPY: tl.constexpr,
                              ARGMAX: tl.constexpr, ZSUM: tl.constexpr, SQ: tl.constexpr,
                              LOGITS: tl.constexpr, INTERPRET: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                              GROUP_T: tl.constexpr):
    pid_t, pid_local = _tile_coords(tl.program_id(0), tl.cdiv(T, BLOCK_T),
                                    tl.cdiv(n_cols, BLOCK_V), GROUP_T)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    local_cols = pid_local * BLOCK_V + tl.arange(0, BLOCK_V)
    acc = _load_acc_tile(acc_ptr, stride_acc, T, rows, local_cols, n_cols, zero_ptr,
                         INTERPRET, True, BLOCK_T, BLOCK_V)
    _tile_partials(acc, t_ptr, pmax_ptr, psum_ptr, pzs_ptr, parg_ptr, pzsum_ptr, psq_ptr, zt_ptr,
                   z_ptr, T, V, pid_t, v_first // BLOCK_V + pid_local, scale, softcap, HAS_CAP,
                   ENTROPY, ARGMAX, ZSUM, SQ, LOGITS, BLOCK_T, BLOCK_V)


@triton.jit
def _grad_logits_from_acc_kernel(acc_ptr, stride_acc, t_ptr, lse_ptr, meanz_ptr, gl_ptr,
                                 ge_ptr, gs_ptr, g_ptr, T, V, stride_g, v_first, n_cols,
                                 g_first, scale, softcap, multiplier, ignore_index,
                                 HAS_CAP: tl.constexpr, ENTROPY: tl.constexpr,
                                 SMOOTH: tl.constexpr, BLOCK_T: tl.constexpr,
                                 BLOCK_V: tl.constexpr, GROUP_T: tl.constexpr):
    """``_grad_logits_kernel`` from a stored acc (elementwise: no layout to match); g's
    column 0 is vocabulary column g_first."""
    pid_t, pid_local = _tile_coords(tl.program_id(0), tl.cdiv(T, BLOCK_T),
                                    tl.cdiv(n_cols, BLOCK_V), GROUP_T)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    local_cols = pid_local * BLOCK_V + tl.arange(0, BLOCK_V)
    acc = _load_acc_tile(acc_ptr, stride_acc, T, rows, local_cols, n_cols, acc_ptr,
                         True, False, BLOCK_T, BLOCK_V)
    _grad_tile(acc, rows, v_first + local_cols, t_ptr, lse_ptr, meanz_ptr, gl_ptr, ge_ptr,
               gs_ptr, g_ptr + (v_first - g_first), T, V, stride_g, v_first, n_cols, scale,
               softcap, multiplier, ignore_index, HAS_CAP, ENTROPY, SMOOTH)
