"""What one split-decode chunk program can read in Triton at Muse Glimmer's geometry, and what
each step toward the contract's chunk costs: a ladder of small chunk kernels timed beside
opcontract's chunk kernel (GPU time from the profiler, the KV bytes read against the copy
rate).

    python benchmarks/attention_decode_ceiling.py --out results.json [--B 1,8,64] [--L 8192]

Every rung runs one program per (sequence, KV head, chunk of ``cb`` blocks of 128 keys), as
the split decode does, for one query token per sequence (a 16-row tile: the 16 query heads of
a KV head), with 4 warps:

- ``read``: K and V loaded block by block and summed per channel (no product): the loads.
- ``dots``: Q Kᵀ and P V with P the scores cast to bf16: the loads and the two products.
- ``softmax``: the usual online softmax (``tl.max``, ``tl.sum``, rescale) around the dots.
- ``chain``: ``softmax`` with the row sum in the contract's order (``_block_sum``).

Each rung with pointers and with tensor descriptors (``/desc``: TMA), at 1 to 3 stages. The
rungs leave partials in a workspace as the chunk kernel does; no rung is checked for bits
(only the opcontract row is the contract's).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from attention_decode_explore import decode_fn, inputs  # noqa: E402

from opcontract.backends.triton.gated_attention_kernels import _block_sum  # noqa: E402

HQ, HKV, D, BLOCK = 32, 2, 128, 128
RUNGS = {"read": 0, "dots": 1, "softmax": 2, "chain": 3}


@triton.jit
def _chunk_ceiling(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, o_ptr, N, L, NC, c, HKV: tl.constexpr,
                   D: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr, CB: tl.constexpr,
                   RUNG: tl.constexpr, DESC: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)  # (sequence, KV head, chunk), chunk fastest
    ch = pid % NC
    kvh = (pid // NC) % HKV
    b = pid // (NC * HKV)
    r = tl.arange(0, G)
    j = tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + ((b * HKV + kvh) * G + r)[:, None] * D + d[None, :])
    row0 = b.to(tl.int64) * L + ch * (CB * BLOCK)
    if DESC:
        kd = tl.make_tensor_descriptor(k_ptr, shape=[N, HKV * D], strides=[HKV * D, 1],
                                       block_shape=[BLOCK, D])
        vd = tl.make_tensor_descriptor(v_ptr, shape=[N, HKV * D], strides=[HKV * D, 1],
                                       block_shape=[BLOCK, D])
    m = tl.full((G,), float("-inf"), tl.float32)
    lsum = tl.zeros((G,), tl.float32)
    o = tl.zeros((G, D), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for i in tl.range(0, CB, num_stages=STAGES):
        if DESC:
            kt = kd.load([(row0 + i * BLOCK).to(tl.int32), kvh * D])
            vt = vd.load([(row0 + i * BLOCK).to(tl.int32), kvh * D])
        else:
            off = (row0 + i * BLOCK + j)[:, None] * (HKV * D) + kvh * D + d[None, :]
            kt = tl.load(k_ptr + off)
            vt = tl.load(v_ptr + off)
        if RUNG == 0:
            acc += tl.sum(kt.to(tl.float32) + vt.to(tl.float32), axis=0)
        elif RUNG == 1:
            s = tl.dot(q, tl.trans(kt))
            o = tl.dot(s.to(vt.dtype), vt, o)
        else:
            s = tl.dot(q, tl.trans(kt)) * c
            m_new = tl.maximum(m, tl.max(s, axis=1))
            a = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            if RUNG == 2:
                lsum = lsum * a + tl.sum(p, axis=1)
            else:
                lsum = lsum * a + _block_sum(p, BLOCK, False)
            o = tl.dot(p.to(vt.dtype), vt, o * a[:, None])
            m = m_new
    slot = pid.to(tl.int64) * G + r
    if RUNG == 0:
        tl.store(o_ptr + pid.to(tl.int64) * G * D + d, acc)
    else:
        tl.store(m_ptr + slot, m)
        tl.store(l_ptr + slot, lsum)
        tl.store(o_ptr + slot[:, None] * D + d[None, :], o)


def rung_fn(q, k, v, B, L, rung, desc, stages, cb=4):
    G = HQ // HKV
    NC = L // (cb * BLOCK)
    n = B * HKV * NC
    m = torch.empty(n * G, device="cuda")
    lsum = torch.empty_like(m)
    o = torch.empty(n * G * D, device="cuda")
    c = D**-0.5 * 1.4426950408889634

    def fn():
        _chunk_ceiling[(n,)](q, k, v, m, lsum, o, B * L, L, NC, c, HKV, D, G, BLOCK, cb,
                             RUNGS[rung], desc, stages, num_warps=4)  # fmt: skip

    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--B", default="1,8,64")
    ap.add_argument("--L", default="8192")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--rungs", default=",".join(RUNGS))
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    copy = common.copy_gbps()
    rows: list = []
    payload = {"benchmark": "attention_decode_ceiling", "env": common.env_stamp(),
               "command": " ".join(["python", *sys.argv]), "ceilings": {"copy_gbps": copy},
               "note": a.note, "rows": rows}  # fmt: skip
    t0 = time.time()
    for L, B in itertools.product(map(int, a.L.split(",")), map(int, a.B.split(","))):
        q, k, v, gate, _, seq, table, key_len = inputs(B, L)
        nbytes = 2 * B * L * HKV * D * 2
        programs = B * HKV * (L // (4 * BLOCK))
        cfg = {"split": 1, "block_m": 16, "num_warps": 4, "num_stages": 2, "interior": 1}
        fn = decode_fn(cfg, q, k, v, gate, key_len - 1, seq, table, key_len)[0]
        fn()
        us = common.kernel_us(fn, calls=20)
        chunk_us = sum(t for name, t in us.items() if "chunk" in name)
        rows.append(dict(B=B, L=L, programs=programs, name="opcontract chunk kernel",
                         kernel_us={n: round(t, 2) for n, t in us.items()},
                         of_copy_chunk=nbytes / (chunk_us * 1e-6) / 1e9 / copy))  # fmt: skip
        print(rows[-1], flush=True)
        for rung, desc, st in itertools.product(a.rungs.split(","), (0, 1),
                                                map(int, a.stages.split(","))):
            row = dict(B=B, L=L, programs=programs, name=rung + ("/desc" if desc else ""),
                       stages=st)  # fmt: skip
            try:
                f = rung_fn(q, k, v, B, L, rung, desc, st)
                f()
                us = sum(common.kernel_us(f, calls=20).values())
                row.update(kernel_us=round(us, 2), gbps=nbytes / us / 1e3,
                           of_copy=nbytes / us / 1e3 / copy)  # fmt: skip
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:300]
            rows.append(row)
            print(row, flush=True)
        del q, k, v, gate
        torch.cuda.empty_cache()
        common.write(a.out, payload)
    payload["seconds"] = round(time.time() - t0, 1)
    common.write(a.out, payload)


if __name__ == "__main__":
    main()
