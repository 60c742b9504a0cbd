"""What bounds the Triton attention backward's dk/dv kernel: one program per (key block, KV
head) walking its query blocks with the group's 16 q heads inside (the contract's order:
query blocks ascending, heads within a block), against the same kernel launched with one
q head a program (k and v repeated per q head: 16x the programs, the heads' partials left
to be summed) — what a contract whose head sum is outermost could run. GPU kernel time
(torch.profiler) of each, and of the dq kernel, one sequence, Muse Glimmer geometry, bf16.
Index tensors and the saved row statistics are built the way the op's backward builds them;
values are random (the time does not depend on them; the outputs are not compared).

    python benchmarks/attention_dkv_heads.py --out results.json [--lengths 8192,16384]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from attention_kernel_time import kernel_ms, visible_keys  # noqa: E402

from opcontract.backends.torch import gated_attention as ref  # noqa: E402
from opcontract.backends.triton import gated_attention as ga  # noqa: E402
from opcontract.backends.triton import gated_attention_kernels as kk  # noqa: E402
from opcontract.backends.triton.launch import launch  # noqa: E402

HQ, HKV, D, WINDOW = 32, 2, 128, 2048


def dkv(q, k, v, da, delta, lse, block_rows, key_len, qrow, hkv, *, local, warps, stages):
    """One launch of the dk/dv kernel with ``hkv`` KV heads (HQ // hkv q heads a group)."""
    N, NB = k.shape[0], block_rows.shape[1]
    dk, dv = torch.empty(N, hkv, D, device="cuda", dtype=k.dtype), torch.empty_like(k)
    c = ref.score_factor(D, None)
    launch(kk._attn_bwd_dkv_kernel, (NB, hkv), q, k, v, da, delta, lse, block_rows, key_len,
           qrow, dk, dv, N, HQ, hkv, HQ // hkv, D, NB, WINDOW if local else 0, c, 0.088,
           LOCAL=local, INTERPRET=False, IEEE=False, BLOCK=ga.BLOCK, BLOCK_D=D, KEYS=ga.BLOCK,
           num_warps=warps, num_stages=stages)  # fmt: skip
    return dk, dv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="8192,16384")
    a = ap.parse_args()
    rows: list[dict] = []
    payload = {"benchmark": "attention_dkv_heads", "env": common.env_stamp(),
               "command": " ".join(["python", *sys.argv]), "rows": rows}  # fmt: skip
    for L in (int(x) for x in a.lengths.split(",")):
        g = torch.Generator(device="cuda").manual_seed(L)
        q, da = (torch.randn(L, HQ, D, device="cuda", generator=g).bfloat16() for _ in range(2))
        k, v = (torch.randn(L, HKV, D, device="cuda", generator=g).bfloat16() for _ in range(2))
        lse = torch.randn(L, HQ, device="cuda", generator=g) + 12.0
        delta = torch.randn(L, HQ, device="cuda", generator=g)
        NB = -(-L // ga.BLOCK)
        positions = torch.arange(L, device="cuda", dtype=torch.int32)
        seq = torch.zeros(L, device="cuda", dtype=torch.int32)
        block_rows = (torch.arange(NB, device="cuda", dtype=torch.int32) * ga.BLOCK)[None]
        key_len = torch.tensor([L], device="cuda", dtype=torch.int32)
        qrow = ga.query_slots(positions, seq, 1, NB)
        k_rep, v_rep = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
        for kind in ("global", "local"):
            local = kind == "local"
            bwd_flops = 2.5 * 4.0 * HQ * D * visible_keys(L, WINDOW if local else None)
            dkv_flops = bwd_flops * 4 / 5  # dk, dv and the two recomputed products of five
            for warps, stages in ((8, 1), (4, 1), (8, 2), (4, 2)):
                for name, args in (("group_per_program", (k, v, HKV)),
                                   ("head_per_program", (k_rep, v_rep, HQ))):  # fmt: skip
                    kk_, vv_, hkv = args
                    run = functools.partial(dkv, q, kk_, vv_, da, delta, lse, block_rows,
                                            key_len, qrow, hkv, local=local, warps=warps,
                                            stages=stages)  # fmt: skip

                    try:
                        ms = sum(kernel_ms(run).values())
                    except Exception as e:  # noqa: BLE001 (a launch the GPU refuses)
                        rows.append(dict(L=L, layer=kind, variant=name, num_warps=warps,
                                         num_stages=stages, error=repr(e)[:300]))  # fmt: skip
                        print(rows[-1], flush=True)
                        continue
                    rows.append(dict(L=L, layer=kind, variant=name, num_warps=warps,
                                     num_stages=stages, kernel_ms=ms,
                                     tflops=dkv_flops / ms / 1e9))  # fmt: skip
                    print(rows[-1], flush=True)
                    common.write(a.out, payload)
        del k_rep, v_rep
        torch.cuda.empty_cache()
    common.write(a.out, payload)


if __name__ == "__main__":
    main()
