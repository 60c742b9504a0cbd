"""The Triton gated_attention training forward: GPU kernel time per call (torch.profiler,
every kernel the call launches) beside the eager call's time (do_bench), per config, each
output compared with the default config's by ``torch.equal``.

    python benchmarks/attention_kernel_time.py --out results.json [--lengths 8192,16384] \
        [--configs '[{}, {"reg_o": 1}]'] [--backward]

An eager ``attention.packed`` call reads its index tensors back to the host (validation and
the tile table), which waits for the GPU and leaves it idle while the host works: at these
lengths the eager time is mostly that. The kernel time is what the op costs the GPU, and what
a peer's kernel is compared with. Muse Glimmer geometry (32 q heads, 2 KV heads, head_dim
128, bf16), one sequence of L tokens, global and local (window 2048) layers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from opcontract import attention  # noqa: E402

HQ, HKV, D, WINDOW = 32, 2, 128, 2048


def kernel_ms(fn, runs: int = 5) -> dict[str, float]:
    """Milliseconds of GPU time per call, by kernel name (the Triton kernels by name, the
    rest summed as ``other``)."""
    out: dict[str, float] = {}
    for name, us in common.kernel_us(fn, calls=runs).items():
        name = name if name.startswith("_attn") else "other"
        out[name] = out.get(name, 0.0) + us / 1e3
    return out


def visible_keys(L: int, window: int | None) -> int:
    return sum(min(p + 1, window) if window else p + 1 for p in range(L))


def run_length(L: int, configs: list[dict], rows: list, out_path: str, payload: dict,
               backward: bool = False) -> None:
    g = torch.Generator(device="cuda").manual_seed(L)
    q, gate = (torch.randn(L, HQ, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(L, HKV, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    up = torch.randn(L, HQ, D, device="cuda", generator=g).bfloat16()
    leaves = [t.requires_grad_(backward) for t in (q, k, v, gate)]
    cu = torch.tensor([0, L], device="cuda")
    for kind in ("global", "local"):
        kw = dict(layer="local", window=WINDOW) if kind == "local" else dict(layer="global")
        # forward+backward: 3.5x the forward's FLOPs (FlashAttention's convention)
        flops = 4.0 * HQ * D * visible_keys(L, WINDOW if kind == "local" else None)
        flops *= 3.5 if backward else 1.0
        ref = None
        for cfg in configs:

            def run(cfg=cfg, kw=kw):
                out = attention.packed(q, k, v, gate, cu, backend="triton", config=cfg, **kw)
                if not backward:
                    return out
                grads = torch.autograd.grad(out, leaves, up)
                return torch.cat([out.flatten(), *(x.flatten() for x in grads)])

            try:
                out = run()
                kms = kernel_ms(run)
                eager = common.bench(run, rep_ms=200)[0]
            except Exception as e:  # noqa: BLE001 (a config the GPU refuses)
                rows.append(dict(L=L, layer=kind, config=cfg, error=repr(e)[:300]))
                print(rows[-1], flush=True)
                continue
            ref = out if ref is None else ref
            attn_ms = sum(t for n, t in kms.items() if n.startswith("_attn"))
            rows.append(dict(L=L, layer=kind, config=cfg, kernel_ms=attn_ms,
                             kernel_tflops=flops / attn_ms / 1e9, kernels=kms, eager_ms=eager,
                             equal_to_default=bool(torch.equal(out, ref))))
            print(rows[-1], flush=True)
            common.write(out_path, payload)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--configs", default='[{}, {"reg_o": 1}, {"reg_o": 1, "edge": 1}]')
    ap.add_argument("--note", default="")
    ap.add_argument("--backward", action="store_true",
                    help="time forward+backward (every kernel; outputs and gradients compared)")
    a = ap.parse_args()
    rows = []
    payload = {"benchmark": "attention_kernel_time", "env": common.env_stamp(),
               "command": " ".join(["python", *sys.argv]), "note": a.note, "rows": rows}
    for L in (int(x) for x in a.lengths.split(",")):
        run_length(L, json.loads(a.configs), rows, a.out, payload, a.backward)
        torch.cuda.empty_cache()
    common.write(a.out, payload)


if __name__ == "__main__":
    main()
