"""The LM head's two backward plans and the sampler's head on the GPU, Muse Glimmer's head
(H 6656, V 202048, multiplier 1/sqrt(26), soft cap 20, bf16).

    python benchmarks/lm_head_plans.py --out results.json [--train-tokens 8192] [--decode 1,64,256]

Plans: forward+backward of softcap_logprob (with entropy) and linear_cross_entropy (mean)
under ``vocab_chunks`` and ``token_chunks``; every output and gradient compared with
torch.equal; time (do_bench median) against the floor 6*T*H*V at the measured matmul rate;
peak memory beyond the inputs. Sampler: ``softcap_logits`` at decode batch sizes, whether
``logits[t, y] - lse[t]`` is bitwise ``softcap_logprob(...)[t]`` for every row and every
target drawn, and its time against reading the weight once at the measured copy rate.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from opcontract import dispatch  # noqa: E402

H, V = 6656, 202048
DEV = "cuda"
PARAMS = {"multiplier": 1 / math.sqrt(26), "softcap": 20.0}


def _inputs(T: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = torch.randn(T, H, device=DEV, generator=g).bfloat16()
    w = (torch.randn(V, H, device=DEV, generator=g) * 0.02).bfloat16()
    t = torch.randint(0, V, (T,), device=DEV, generator=g)
    return h, w, t


def plan_rows(T: int, matmul: float) -> list[dict]:
    h, w, t = _inputs(T, T)
    rows = []
    for op, kw in (("softcap_logprob", {"return_entropy": True}),
                   ("linear_cross_entropy", {"reduction": "mean"})):  # fmt: skip
        ref = None
        for plan in ("vocab_chunks", "token_chunks"):
            run = dispatch.op(op, backend="triton", plan=plan)
            hh = h.detach().clone().requires_grad_(True)
            ww = w.detach().clone().requires_grad_(True)

            def step(run=run, hh=hh, ww=ww, kw=kw):
                out = run(hh, ww, t, **PARAMS, **kw)
                outs = [out] if isinstance(out, torch.Tensor) else [o for o in out if o is not None]
                diff = [o for o in outs if o.requires_grad]
                ups = [torch.ones_like(o) for o in diff]
                grads = torch.autograd.grad(diff, [hh, ww], ups)
                return [o.detach() for o in outs] + list(grads)

            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            bits = step()
            peak = torch.cuda.max_memory_allocated() - base
            ms = common.bench(step, rep_ms=300)[0]
            floor = 6.0 * T * H * V / (matmul * 1e9)
            ref = bits if ref is None else ref
            equal = len(bits) == len(ref) and all(
                torch.equal(a, b) for a, b in zip(bits, ref, strict=True)
            )
            rows.append(dict(op=op, plan=plan, T=T, ms=ms, floor_ms=floor, ratio=ms / floor,
                             peak_extra_gb=peak / 1e9, bits_equal_to_vocab_chunks=equal,
                             provenance=str(dispatch.last_provenance().backward_plan)))  # fmt: skip
            print(rows[-1], flush=True)
            del bits
            torch.cuda.empty_cache()
    return rows


def sampler_rows(Ts: list[int], copy: float) -> list[dict]:
    rows = []
    w = None
    for T in Ts:
        h, w_, _ = _inputs(T, 100 + T)
        w = w_ if w is None else w
        out = dispatch.op("softcap_logits", backend="triton")(h, w, **PARAMS)
        logits, lse = out
        mismatches = 0
        for trial in range(3):  # targets drawn per row: each a gather from the same logits
            y = torch.randint(0, V, (T,), device=DEV,
                              generator=torch.Generator(device=DEV).manual_seed(trial))  # fmt: skip
            lp = dispatch.op("softcap_logprob", backend="triton")(h, w, y, **PARAMS)
            lp = lp if isinstance(lp, torch.Tensor) else lp[0]
            mismatches += int((logits.gather(1, y[:, None])[:, 0] - lse != lp).sum())
        run = dispatch.op("softcap_logits", backend="triton")
        ms = common.bench(lambda run=run, h=h, w=w: run(h, w, **PARAMS), rep_ms=200)[0]
        floor = V * H * 2 / (copy * 1e6)  # the weight read once
        rows.append(dict(op="softcap_logits", T=T, ms=ms, weight_read_floor_ms=floor,
                         ratio=ms / floor, rows_checked=3 * T, logprob_mismatches=mismatches,
                         implementation=dispatch.last_provenance().implementation))  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--train-tokens", default="8192")
    ap.add_argument("--decode", default="1,64,256")
    a = ap.parse_args()
    payload = {"benchmark": "lm_head_plans", "env": common.env_stamp(),
               "ceilings": {"matmul_tflops": common.matmul_tflops(),
                            "copy_gbps": common.copy_gbps()},
               "shape": {"H": H, "V": V, **PARAMS, "dtype": "bfloat16"}}  # fmt: skip
    payload["sampler"] = sampler_rows([int(x) for x in a.decode.split(",")],
                                      payload["ceilings"]["copy_gbps"])  # fmt: skip
    common.write(a.out, payload)
    payload["plans"] = []
    for T in (int(x) for x in a.train_tokens.split(",")):
        payload["plans"] += plan_rows(T, payload["ceilings"]["matmul_tflops"])
        common.write(a.out, payload)


if __name__ == "__main__":
    main()
