"""Host time of one decode call of the Triton attention on the CPU, its kernels not launched.

    python benchmarks/attention_host_cpu.py --out results.json [--batch 1,16,64]

What the host does per layer and decode step before any kernel runs, apart from what the GPU
adds (its API calls: copies, allocations, launches): a local layer's PagedKVCache at Muse
Glimmer's geometry (32 q heads on 2 KV heads, head_dim 128, bf16) holding 128 positions per
sequence, then one-token steps. Timed parts: the cache's append; the whole op call through
dispatch (``attend``); inside it, the index value checks (``check_values``), the Triton plan
(``plan_forward``: tile table, split, workspace) and ``forward`` (plan, outputs, launches).
The launcher is replaced by a no-op for this measurement only (``TRITON_INTERPRET=1`` so
Triton imports without a GPU), so no kernel runs: the outputs are never read. Under
``torch.no_grad``, as ``generate()`` calls it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import env_stamp, write  # noqa: E402

HQ, HKV, D, CACHED = 32, 2, 128, 128


def median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(B: int, n: int) -> dict:
    from opcontract.attention import PagedKVCache
    from opcontract.backends.triton import gated_attention as ga
    from opcontract.dispatch.validate import check_values, signature

    ga.launch = lambda *args, **kw: None  # host time only: no kernel runs
    c = PagedKVCache(layer="local", window=2048, kv_heads=HKV, head_dim=D, dtype=torch.bfloat16,
                     device="cpu", sequences=B, backend="triton", pages=4 * B)  # fmt: skip
    g = torch.Generator().manual_seed(B)

    def rows(n_rows: int, heads: int) -> torch.Tensor:
        return torch.randn(n_rows, heads, D, generator=g).bfloat16()

    c.append(torch.arange(B).repeat_interleave(CACHED), torch.arange(CACHED).repeat(B),
             rows(B * CACHED, HKV), rows(B * CACHED, HKV))  # fmt: skip
    seq = torch.arange(B)
    q, gate, k, v = rows(B, HQ), rows(B, HQ), rows(B, HKV), rows(B, HKV)
    nxt = [CACHED]

    def append():
        c.append(seq, torch.full((B,), nxt[0], dtype=torch.int64), k, v, q=q, gate=gate)
        nxt[0] += 1

    out = {"B": B, "append_us": median_us(append, n)}
    pos = torch.full((B,), nxt[0] - 1, dtype=torch.int64)
    table, lens = c._block_table(), c.lengths
    kw = dict(layer="local", window=2048, scale=None)
    inputs = dict(q=q, k=c.k, v=c.v, gate=gate, positions=pos, seq=seq, block_rows=table,
                  key_len=lens)  # fmt: skip
    sizes = dict(T=B, N=c.k.shape[0], Hq=HQ, Hkv=HKV, D=D, S=B, NB=table.shape[1])
    sig = signature("gated_attention")
    out["attend_us"] = median_us(lambda: c.attend(seq, pos, q, gate), n)
    out["check_values_us"] = median_us(lambda: check_values(sig, dict(inputs), kw, sizes), n)
    out["plan_forward_us"] = median_us(
        lambda: ga.plan_forward({}, q, c.k, pos, seq, table, **kw), n
    )
    out["forward_us"] = median_us(
        lambda: ga.forward({}, q, c.k, c.v, gate, pos, seq, table, lens, **kw), n
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--n", type=int, default=400)
    a = ap.parse_args()
    payload = {"benchmark": "attention_host_cpu", "env": env_stamp(), "rows": []}
    for B in (int(b) for b in a.batch.split(",")):
        with torch.no_grad():  # as generate() runs: dispatch's no-grad fast path
            row = measure(B, a.n)
        print(row, flush=True)
        payload["rows"].append(row)
    write(a.out, payload)


if __name__ == "__main__":
    main()
