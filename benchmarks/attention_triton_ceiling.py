"""What a Triton attention forward can reach at Muse Glimmer's geometry, and what each of the
contract's structural demands costs: a ladder of small causal GQA forward kernels (no gate,
one contiguous sequence, finite inputs) timed beside opcontract's kernel, SDPA and FA4.

    python benchmarks/attention_triton_ceiling.py --out results.json [--lengths 8192,16384]

The ladder (each rung one change):

- ``textbook``: the usual flash forward, one float32 accumulator, the diagonal blocks masked.
  ``pack`` 0 tiles a head's query tokens (BLOCK_M tokens of one head); 1 tiles GQA rows as
  opcontract does (BLOCK_M / G tokens x the G heads of a KV head).
- ``merge`` 1: keys in chunks of ``cb`` blocks, each chunk's (m, l, o) from empty and merged
  into the running state, the running O waiting in a float32 buffer in memory (opcontract's
  fused kernel); 2: the running O in registers (two accumulators); 3: as 2 in one flat loop,
  the merge under a branch at each chunk's end.
- ``desc``: K and V loaded through tensor descriptors (TMA) instead of pointers.
- ``arith`` (a block's update as the contract writes it, from opcontract's device functions):
  1 the score a rounded product (``_mul_rn``), 2 the row sum in the contract's fixed order
  (``_block_sum``), 3 both.

Merge rungs 1-3 compute the same operations in the same order, so their outputs are compared
with ``torch.equal``; every rung is compared with SDPA by the relative error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from opcontract.backends.triton.gated_attention_kernels import _block_sum, _mul_rn  # noqa: E402

HQ, HKV, D = 32, 2, 128


@triton.jit
def _update(q, k, v, s_pos, j, m, lsum, o, c, MASKED: tl.constexpr, ARITH: tl.constexpr = 0):
    if ARITH % 2 == 1:
        s = _mul_rn(tl.dot(q, tl.trans(k)), c, False)
    else:
        s = tl.dot(q, tl.trans(k)) * c
    if MASKED:
        s = tl.where(j[None, :] <= s_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    a = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    if ARITH >= 2:
        lsum = lsum * a + _block_sum(p, 128, False)
    else:
        lsum = lsum * a + tl.sum(p, axis=1)
    o = o * a[:, None]
    o = tl.dot(p.to(v.dtype), v, o)
    return m_new, lsum, o


@triton.jit
def _load_kv(k_ptr, v_ptr, kd, vd, b, kvh, Hkv: tl.constexpr, D: tl.constexpr,
             BLOCK_N: tl.constexpr, DESC: tl.constexpr, rows_ptr=None):
    if rows_ptr is not None:  # the block's first row from a table (opcontract's block_rows)
        j = tl.arange(0, BLOCK_N)
        d = tl.arange(0, D)
        rowb = tl.load(rows_ptr + b)
        base = (rowb.to(tl.int64) * Hkv + kvh) * D
        off = j[:, None] * (Hkv * D) + d[None, :]
        k = tl.load(k_ptr + base + off)
        v = tl.load(v_ptr + base + off)
    elif DESC:
        k = kd.load([b * BLOCK_N, kvh * D])
        v = vd.load([b * BLOCK_N, kvh * D])
    else:
        j = tl.arange(0, BLOCK_N)
        d = tl.arange(0, D)
        off = ((b * BLOCK_N + j).to(tl.int64)[:, None] * Hkv + kvh) * D + d[None, :]
        k = tl.load(k_ptr + off)
        v = tl.load(v_ptr + off)
    return k, v


@triton.jit
def _blocks(q, k_ptr, v_ptr, kd, vd, pos, lo, hi, kvh, m, lsum, o, c, Hkv: tl.constexpr,
            D: tl.constexpr, BLOCK_N: tl.constexpr, DESC: tl.constexpr, MASKED: tl.constexpr,
            STAGES: tl.constexpr, rows_ptr=None, ARITH: tl.constexpr = 0):
    for b in tl.range(lo, hi, num_stages=STAGES):
        k, v = _load_kv(k_ptr, v_ptr, kd, vd, b, kvh, Hkv, D, BLOCK_N, DESC, rows_ptr)
        j = b * BLOCK_N + tl.arange(0, BLOCK_N)
        m, lsum, o = _update(q, k, v, pos, j, m, lsum, o, c, MASKED, ARITH)
    return m, lsum, o


@triton.jit
def _merge(M, Lr, run_o, m, lsum, o):
    M2 = tl.maximum(M, m)
    A = tl.exp2(M - M2)
    C = tl.exp2(m - M2)
    return M2, tl.math.fma(Lr, A, lsum * C), tl.math.fma(run_o, A[:, None], o * C[:, None])


@triton.jit
def _ceiling_fwd(q_ptr, k_ptr, v_ptr, out_ptr, buf_ptr, rows_ptr, L, c, Hq: tl.constexpr,
                 Hkv: tl.constexpr, D: tl.constexpr, PACK: tl.constexpr, MERGE: tl.constexpr,
                 CB: tl.constexpr, DESC: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, STAGES: tl.constexpr, INDIRECT: tl.constexpr = False,
                 ARITH: tl.constexpr = 0):
    G: tl.constexpr = Hq // Hkv
    pid = tl.program_id(0)
    hid = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    if PACK:
        TOK: tl.constexpr = BLOCK_M // G
        tok = pid * TOK + r // G
        head = hid * G + r % G
        kvh = hid
        lo_pos = pid * TOK
        hi_pos = pid * TOK + TOK - 1
    else:
        tok = pid * BLOCK_M + r
        head = r * 0 + hid
        kvh = hid // G
        lo_pos = pid * BLOCK_M
        hi_pos = pid * BLOCK_M + BLOCK_M - 1
    d = tl.arange(0, D)
    q_off = (tok.to(tl.int64)[:, None] * Hq + head[:, None]) * D + d[None, :]
    q = tl.load(q_ptr + q_off)
    if DESC:
        kd = tl.make_tensor_descriptor(k_ptr, shape=[L, Hkv * D], strides=[Hkv * D, 1],
                                       block_shape=[BLOCK_N, D])
        vd = tl.make_tensor_descriptor(v_ptr, shape=[L, Hkv * D], strides=[Hkv * D, 1],
                                       block_shape=[BLOCK_N, D])
    else:
        kd = k_ptr
        vd = v_ptr
    n_full = (lo_pos + 1) // BLOCK_N  # blocks every row sees whole
    n_all = hi_pos // BLOCK_N + 1
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    lsum = tl.zeros((BLOCK_M,), tl.float32)
    o = tl.zeros((BLOCK_M, D), tl.float32)
    if MERGE == 0:
        m, lsum, o = _blocks(q, k_ptr, v_ptr, kd, vd, tok, 0, n_full, kvh, m, lsum, o, c, Hkv,
                             D, BLOCK_N, DESC, False, STAGES)
        m, lsum, o = _blocks(q, k_ptr, v_ptr, kd, vd, tok, n_full, n_all, kvh, m, lsum, o, c,
                             Hkv, D, BLOCK_N, DESC, True, 1)
        M = m
        Lr = lsum
        run_o = o
    elif MERGE == 3:
        M = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        Lr = tl.zeros((BLOCK_M,), tl.float32)
        run_o = tl.zeros((BLOCK_M, D), tl.float32)
        for b in tl.range(0, n_full, num_stages=STAGES):
            k, v = _load_kv(k_ptr, v_ptr, kd, vd, b, kvh, Hkv, D, BLOCK_N, DESC)
            j = b * BLOCK_N + tl.arange(0, BLOCK_N)
            m, lsum, o = _update(q, k, v, tok, j, m, lsum, o, c, False)
            if (b % CB == CB - 1) | (b == n_all - 1):
                M, Lr, run_o = _merge(M, Lr, run_o, m, lsum, o)
                m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
                lsum = tl.zeros((BLOCK_M,), tl.float32)
                o = tl.zeros((BLOCK_M, D), tl.float32)
        for b in range(n_full, n_all):
            k, v = _load_kv(k_ptr, v_ptr, kd, vd, b, kvh, Hkv, D, BLOCK_N, DESC)
            j = b * BLOCK_N + tl.arange(0, BLOCK_N)
            m, lsum, o = _update(q, k, v, tok, j, m, lsum, o, c, True)
            if (b % CB == CB - 1) | (b == n_all - 1):
                M, Lr, run_o = _merge(M, Lr, run_o, m, lsum, o)
                m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
                lsum = tl.zeros((BLOCK_M,), tl.float32)
                o = tl.zeros((BLOCK_M, D), tl.float32)
    else:
        M = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        Lr = tl.zeros((BLOCK_M,), tl.float32)
        run_o = tl.zeros((BLOCK_M, D), tl.float32)
        for ch in range(0, (n_all + CB - 1) // CB):
            first = ch * CB
            last = tl.minimum(first + CB, n_all)
            m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            lsum = tl.zeros((BLOCK_M,), tl.float32)
            o = tl.zeros((BLOCK_M, D), tl.float32)
            if INDIRECT:
                m, lsum, o = _blocks(q, k_ptr, v_ptr, kd, vd, tok, first,
                                     tl.minimum(last, n_full), kvh, m, lsum, o, c, Hkv, D,
                                     BLOCK_N, DESC, False, STAGES, rows_ptr, ARITH)
            else:
                m, lsum, o = _blocks(q, k_ptr, v_ptr, kd, vd, tok, first,
                                     tl.minimum(last, n_full), kvh, m, lsum, o, c, Hkv, D,
                                     BLOCK_N, DESC, False, STAGES, None, ARITH)
            m, lsum, o = _blocks(q, k_ptr, v_ptr, kd, vd, tok, tl.maximum(first, n_full), last,
                                 kvh, m, lsum, o, c, Hkv, D, BLOCK_N, DESC, True, 1)
            if MERGE == 1:
                later = tl.full((BLOCK_M, 1), ch, tl.int32) > 0
                prev = tl.load(buf_ptr + q_off, mask=later, other=0.0)
                M, Lr, prev = _merge(M, Lr, prev, m, lsum, o)
                tl.store(buf_ptr + q_off, prev)
                tl.debug_barrier()
            else:
                M, Lr, run_o = _merge(M, Lr, run_o, m, lsum, o)
        if MERGE == 1:
            run_o = tl.load(buf_ptr + q_off)
    out = run_o / Lr[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty))


def ceiling(q, k, v, buf, pack, merge, cb, desc, block_m, block_n, warps, stages, indirect=0,
            arith=0):
    L = q.shape[0]
    rows = torch.arange(0, L, block_n, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    c = (D ** -0.5) * 1.4426950408889634
    G = HQ // HKV
    if pack:
        grid = (L // (block_m // G), HKV)
    else:
        grid = (L // block_m, HQ)
    _ceiling_fwd[grid](q, k, v, out, buf, rows, L, c, HQ, HKV, D, pack, merge, cb, desc,
                       block_m, block_n, stages, bool(indirect), arith, num_warps=warps,
                       num_stages=stages)
    return out


LADDER = [
    # (name, pack, merge, cb, desc, block_m, block_n, warps, stages[, indirect[, arith]])
    ("textbook/head", 0, 0, 4, 0, 128, 128, 8, 2),
    ("textbook/head", 0, 0, 4, 0, 128, 64, 8, 3),
    ("textbook/head", 0, 0, 4, 0, 128, 64, 4, 3),
    ("textbook/head/desc", 0, 0, 4, 1, 128, 128, 8, 2),
    ("textbook/head/desc", 0, 0, 4, 1, 128, 64, 8, 3),
    ("textbook/gqa", 1, 0, 4, 0, 128, 128, 8, 2),
    ("textbook/gqa", 1, 0, 4, 0, 128, 64, 8, 3),
    ("textbook/gqa/desc", 1, 0, 4, 1, 128, 128, 8, 2),
    ("textbook/gqa/desc", 1, 0, 4, 1, 128, 64, 8, 3),
    ("merge_mem/gqa", 1, 1, 4, 0, 128, 128, 8, 2),
    ("merge_mem/gqa/desc", 1, 1, 4, 1, 128, 128, 8, 2),
    ("merge_reg/gqa", 1, 2, 4, 0, 128, 128, 8, 2),
    ("merge_reg/gqa/desc", 1, 2, 4, 1, 128, 128, 8, 2),
    ("merge_flat/gqa", 1, 3, 4, 0, 128, 128, 8, 2),
    ("merge_flat/gqa/desc", 1, 3, 4, 1, 128, 128, 8, 2),
    ("merge_flat/gqa/desc", 1, 3, 4, 1, 128, 128, 8, 3),
    ("merge_reg/gqa/cb16", 1, 2, 16, 0, 128, 128, 8, 2),
    ("merge_reg/gqa/indirect", 1, 2, 4, 0, 128, 128, 8, 2, 1),
    ("merge_reg/gqa/indirect", 1, 2, 4, 0, 128, 128, 8, 3, 1),
    ("merge_flat/gqa/desc/cb16", 1, 3, 16, 1, 128, 128, 8, 2),
    ("merge_reg/gqa/mul_rn", 1, 2, 4, 0, 128, 128, 8, 2, 0, 1),
    ("merge_reg/gqa/row_sum", 1, 2, 4, 0, 128, 128, 8, 2, 0, 2),
    ("merge_reg/gqa/contract_arith", 1, 2, 4, 0, 128, 128, 8, 2, 0, 3),
    ("merge_reg/gqa/indirect/contract_arith", 1, 2, 4, 0, 128, 128, 8, 2, 1, 3),
]


def run_length(L: int, a: argparse.Namespace, rows: list, payload: dict) -> None:
    """Every provider and rung at one length, into rows."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(L)
    q = torch.randn(L, HQ, D, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(L, HKV, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    buf = torch.empty(L, HQ, D, device="cuda", dtype=torch.float32)
    flops = 4.0 * HQ * D * L * (L + 1) / 2

    def sdpa():
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, enable_gqa=True)[0].transpose(0, 1)

    ref = sdpa().float()

    def record(name, fn, **extra):
        try:
            out = fn()
            ms = common.bench(fn, rep_ms=200)[0]
        except Exception as e:  # noqa: BLE001 (a config the GPU or compiler refuses)
            rows.append(dict(L=L, name=name, **extra, error=f"{type(e).__name__}: {e}"[:300]))
            print(rows[-1], flush=True)
            return None
        err = ((out.float() - ref).norm() / ref.norm()).item()
        rows.append(dict(L=L, name=name, **extra, ms=ms, tflops=flops / ms / 1e9,
                         rel_err_vs_sdpa=err))
        print(rows[-1], flush=True)
        common.write(a.out, payload)
        return out

    record("sdpa", sdpa)
    try:
        if not a.peers:
            raise ImportError("peers off (--peers 0)")
        from flash_attn.cute import flash_attn_func

        for det in (False, True):
            record("fa4" + ("_deterministic" if det else ""),
                   lambda det=det: _first(flash_attn_func(q[None], k[None], v[None], causal=True,
                                                          deterministic=det))[0])
    except Exception as e:  # noqa: BLE001
        rows.append(dict(L=L, name="fa4", error=repr(e)[:300]))
    if a.ours:
        from opcontract import attention

        gate = torch.full_like(q, 30.0)  # sigmoid(30) = 1 in float32: out = attn
        cu = torch.tensor([0, L], device="cuda")
        for cfg in ({}, {"reg_o": 1}, {"reg_o": 1, "num_stages": 3}):
            record("opcontract", lambda cfg=cfg: attention.packed(
                q, k, v, gate, cu, layer="global", backend="triton", config=cfg), config=cfg)
    merged = {}
    for name, pack, merge, cb, desc, bm, bn, w, st, *ind in LADDER:
        if a.only and a.only not in name:
            continue
        cfg = dict(pack=pack, merge=merge, cb=cb, desc=desc, block_m=bm, block_n=bn,
                   warps=w, stages=st, indirect=ind[0] if ind else 0,
                   arith=ind[1] if len(ind) > 1 else 0)
        out = record(name, lambda cfg=cfg: ceiling(q, k, v, buf, **cfg), config=cfg)
        if out is not None and merge and bn == 128:
            same = (cb, cfg["arith"])  # rungs of the same chunks and the same arithmetic
            if same in merged:
                rows[-1]["equal_to_first_merge_rung"] = bool(torch.equal(out, merged[same]))
            else:
                merged[same] = out
    common.write(a.out, payload)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--ours", type=int, default=1)
    ap.add_argument("--only", default="", help="rungs whose name holds this")
    ap.add_argument("--peers", type=int, default=1)
    a = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    rows: list = []
    payload = {"benchmark": "attention_triton_ceiling", "env": common.env_stamp(),
               "command": " ".join(["python", *sys.argv]),
               "matmul_tflops": common.matmul_tflops(), "rows": rows}
    for L in (int(x) for x in a.lengths.split(",")):
        run_length(L, a, rows, payload)
        torch.cuda.empty_cache()
    common.write(a.out, payload)


def _first(r):
    return r if isinstance(r, tuple) else (r,)


if __name__ == "__main__":
    main()
