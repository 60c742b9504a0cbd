"""Which LM-head implementation serves the HF labels loss, and what each candidate costs:
``linear_cross_entropy`` as ``apply_opcontract``'s ``_label_loss`` calls it (reduction sum,
Muse Glimmer's multiplier and soft cap, bf16 at real width), for each T given (T = S - 1 rows
for one sequence of S tokens), with dispatch's choice and each forced implementation side by
side: ``explain``'s report, forward+backward median ms, and whether the loss and both
gradients equal the default's bits.

    python benchmarks/head_dispatch_probe.py --T 8191,8192 --out probe.json
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import opcontract.dispatch as dispatch  # noqa: E402

H, V = 6656, 202048
MULTIPLIER, SOFTCAP = 26**-0.5, 20.0


def probe(T: int, backends: list[str | None]) -> dict:
    g = torch.Generator(device="cuda").manual_seed(T)
    h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w.requires_grad_()
    y = torch.randint(0, V, (T,), device="cuda", generator=g)
    kw = dict(multiplier=MULTIPLIER, softcap=SOFTCAP, reduction="sum")
    rows, ref = [], None
    for backend in backends:
        rep = dispatch.explain("linear_cross_entropy", h, w, y, backend=backend, **kw)
        f = dispatch.op("linear_cross_entropy", backend=backend)

        def step(f=f):
            h.grad = w.grad = None
            f(h, w, y, **kw).backward()

        counts: collections.Counter = collections.Counter()
        with common.implementations_run(counts):
            step()
        bits = (f(h, w, y, **kw).detach().clone(), h.grad.clone(), w.grad.clone())
        ref = ref or bits
        med, p20, p80 = common.bench(step, warmup_ms=200, rep_ms=2000)
        rows.append({
            "backend": backend,
            "explain": {"implementation": rep.implementation, "plan": rep.plan,
                        "accepted": rep.accepted, "rejected": rep.rejected,
                        "tuning_entry": rep.tuning_entry},
            "ran": dict(counts),
            "fwd_bwd_ms": med, "p20_ms": p20, "p80_ms": p80,
            "equal_to_default": [torch.equal(a, b) for a, b in zip(bits, ref, strict=True)],
        })  # fmt: skip
        print(
            T,
            backend,
            rep.implementation,
            rep.plan,
            f"{med:.2f} ms",
            dict(counts),
            rows[-1]["equal_to_default"],
            flush=True,
        )
    return {"T": T, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="8191,8192")
    ap.add_argument("--backends", default="default,triton.fused_ce,cute.fused_ce")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    backends = [None if b == "default" else b for b in a.backends.split(",")]
    results = [probe(int(t), backends) for t in a.T.split(",")]
    common.write(a.out, {"env": common.env_stamp(), "H": H, "V": V, "results": results})


if __name__ == "__main__":
    main()
