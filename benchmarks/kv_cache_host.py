"""Host time of PagedKVCache's bookkeeping (checks, page table, eviction), no attention.

    python benchmarks/kv_cache_host.py --out results.json [--label new]

A local layer's cache (window 2048) for 16 sequences: one prefill append of 2600 positions
each, then 20 decode steps of one token per sequence (append, evict, and the table and
lengths a launch reads); the median step. Shapes are tiny (2 KV heads of 8) so the copies
cost nothing: what is timed is the Python per token and per page. Run it under another
checkout's PYTHONPATH (``--label``) to compare two commits on one host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import env_stamp  # noqa: E402

from opcontract.attention import PagedKVCache  # noqa: E402

B, L, HKV, D = 16, 2600, 2, 8


def measure() -> dict:
    c = PagedKVCache(layer="local", window=2048, kv_heads=HKV, head_dim=D,
                     dtype=torch.bfloat16, device="cpu", sequences=B, backend="torch")  # fmt: skip
    seq, pos = torch.arange(B).repeat_interleave(L), torch.arange(L).repeat(B)
    k = torch.randn(B * L, HKV, D).bfloat16()
    t0 = time.perf_counter()
    c.append(seq, pos, k, k)
    c.evict()
    prefill = time.perf_counter() - t0
    steps = []
    for i in range(20):
        s1, p1 = torch.arange(B), torch.full((B,), L + i)
        k1 = torch.randn(B, HKV, D).bfloat16()
        t0 = time.perf_counter()
        c.append(s1, p1, k1, k1)
        c.evict()
        c.table, c.lengths  # noqa: B018 (what attend() reads)
        steps.append(time.perf_counter() - t0)
    return {"prefill_append_ms": prefill * 1e3,
            "decode_step_us": statistics.median(steps) * 1e6,
            "pages_evicted": c.pages_evicted}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="new")
    a = ap.parse_args()
    row = {"label": a.label, "sequences": B, "prefill_positions": L, **measure()}
    print(json.dumps(row))
    path = Path(a.out)
    old = json.loads(path.read_text()) if path.exists() else {"rows": []}
    rows = [r for r in old.get("rows", []) if r.get("label") != a.label] + [row]
    path.write_text(json.dumps({"benchmark": "kv_cache_host", "command": " ".join(
        ["python", *sys.argv]), "env": env_stamp(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
