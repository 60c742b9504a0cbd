"""Where g computed from a CuTe acc (the backward's ``logits_gemm="cute"``) leaves
triton.fused's bits: linear_cross_entropy's head at T = 300, H 512, V 9000, soft cap 30,
label smoothing 0.1 (reduction sum), both plans; the forward with the acc apart beside it.

    python benchmarks/cute_head_g_parity.py --out results.json

Reported: for each forward output, and for each (logits_gemm, grad_gemm) pair of the
backward, the number of elements that differ from the fused Triton kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from common import env_stamp, write  # noqa: E402
from helpers import head_inputs  # noqa: E402

from opcontract.backends import linear_cross_entropy as lce  # noqa: E402
from opcontract.backends.triton import interpreting  # noqa: E402
from opcontract.backends.triton import softcap_logprob as slp  # noqa: E402
from opcontract.backends.triton import softcap_logprob_kernels as k  # noqa: E402
from opcontract.backends.triton.dense_gemm_kernels import _tile_coords  # noqa: E402

NAMES = ("grad_hidden", "grad_weight")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    T, H, V = 300, 512, 9000
    h, w, t = (x.cuda() for x in head_inputs(T=T, H=H, V=V, dtype=torch.bfloat16, ignore=(1,)))
    kw = dict(multiplier=1.0, softcap=30.0, ignore_index=-100)
    slp.ACC_MIN_T, slp.ACC_BYTES = 1, 4 * 2048 * 2048
    cfg = {**slp.default_config("bfloat16", T), "num_stages": 2}  # z staged: 2 stages fit
    runs = {lg: slp.forward_all(h, w, t, **kw, argmax=True, zsum=True, logits=True, config=cfg,
                                logits_gemm=lg) for lg in (None, "cute")}  # fmt: skip
    fields = zip(runs[None]._fields, runs[None], runs["cute"], strict=True)
    forward = {f: int((x != y).sum()) for f, x, y in fields if x is not None}
    z0, z1 = runs[None].logits, runs["cute"].logits  # z from the fused tile and from the acc
    forward["logits_differing_bits"] = int((z0.view(torch.int32) != z1.view(torch.int32)).sum())
    g_lp, g_sm = lce.head_grads(torch.tensor(1.7, device="cuda"), t, ignore_index=-100,
                                reduction="sum", label_smoothing=0.1)  # fmt: skip
    backward = []
    for plan in ("vocab_chunks", "token_chunks"):
        base = None
        for lg, gg in ((None, "triton"), (None, "cute"), ("cute", "cute"), ("cute", "triton")):
            got = slp.backward(h, w, t, runs[None].lse, None, g_lp, None, g_sm, **kw, plan=plan,
                               token_chunk=512, grad_gemm=gg, logits_gemm=lg)  # fmt: skip
            base = got if base is None else base
            differing = {n: int((a != b).sum()) for n, a, b in zip(NAMES, got, base, strict=True)}
            backward.append(
                {"plan": plan, "logits_gemm": lg, "grad_gemm": gg, "differing": differing}
            )
            print(backward[-1], flush=True)
    detail = _g_detail(h, w, t, runs[None].lse, g_lp, g_sm, kw)
    for chunk in detail["chunks"]:
        for e in chunk["first"]:  # z there from the forward's fused tile and from the acc
            e["z_fused"], e["z_acc"] = float(z0[e["row"], e["col"]]), float(z1[e["row"], e["col"]])
    print(detail, flush=True)
    write(args.out, {"benchmark": "cute_head_g_parity", "env": env_stamp(),
                     "shape": {"T": T, "H": H, "V": V}, "forward_differing": forward,
                     "backward": backward, "g_detail": detail})  # fmt: skip
    return 0


@triton.jit
def _tile_acc_kernel(h_ptr, w_ptr, out_ptr, T, V, H, stride_h, stride_w, stride_o, v_first,
                     n_cols, zero, INTERPRET: tl.constexpr, PROMOTE: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_T: tl.constexpr):
    pid_t, pid_local = _tile_coords(tl.program_id(0), tl.cdiv(T, BLOCK_T),
                                    tl.cdiv(n_cols, BLOCK_V), GROUP_T)
    pid_v = v_first // BLOCK_V + pid_local
    acc = k._logits_tile_pointers(h_ptr, w_ptr, T, V, H, stride_h, stride_w, pid_t, pid_v,
                                  zero, INTERPRET, PROMOTE, EVEN_K, BLOCK_T, BLOCK_V, BLOCK_K)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    local = pid_local * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = (rows < T)[:, None] & (local < n_cols)[None, :] & ((v_first + local) < V)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + local[None, :], acc, mask=ok)


def _tile_acc(h, w, c0, n):
    """acc [T, n] as the fused g kernel's tiles compute it (``_logits_tile_pointers`` with
    the backward's config for this T), stored unrounded: what its epilogue starts from."""
    T, H = h.shape
    V = w.shape[0]
    cfg = slp.default_config("bfloat16", T)
    bk = slp.BLOCK_K["bfloat16"]
    out = torch.full((T, n), float("nan"), device=h.device)
    grid = (triton.cdiv(T, cfg["block_t"]) * triton.cdiv(n, slp.BLOCK_V),)
    _tile_acc_kernel[grid](h, w, out, T, V, H, h.stride(0), w.stride(0), out.stride(0), c0, n,
                           0.0, INTERPRET=interpreting(), PROMOTE=slp.GEMM_K_BLOCK // bk,
                           EVEN_K=H % bk == 0, BLOCK_T=cfg["block_t"], BLOCK_V=slp.BLOCK_V,
                           BLOCK_K=bk, GROUP_T=cfg["group_t"], num_warps=cfg["num_warps"],
                           num_stages=cfg["num_stages"])  # fmt: skip
    return out


def _g_detail(h, w, t, lse, g_lp, g_sm, kw) -> dict:
    """vocab_chunks' g chunk by chunk as the grad_weight GEMM reads it, fused kernel against
    the CuTe acc, the first differing elements with their acc from both GEMMs; and the acc of
    each chunk's columns by the CuTe and the Triton GEMM, compared (bits, signed zeros too)."""
    seen: dict = {None: [], "cute": []}
    mm = slp.GRAD_GEMMS["triton"]
    for lg in seen:
        def recording(a, b, c, *, _lg=lg, **o):
            if a.shape[1] == h.shape[0]:  # grad_weight's g.T (K = T)
                seen[_lg].append(a.T.clone())
            return mm(a, b, c, **o)

        slp.GRAD_GEMMS["triton"] = recording
        try:
            slp.backward(h, w, t, lse, None, g_lp, None, g_sm, **kw, plan="vocab_chunks",
                         logits_gemm=lg)  # fmt: skip
        finally:
            slp.GRAD_GEMMS["triton"] = mm
    chunks, c0 = [], 0
    for a, b in zip(seen[None], seen["cute"], strict=True):
        n = a.shape[1]
        acc_t = torch.empty(h.shape[0], n, device="cuda")
        acc_c = torch.empty_like(acc_t)
        slp.LOGITS_GEMMS["triton"](h, w[c0 : c0 + n], acc_t)
        slp.LOGITS_GEMMS["cute"](h, w[c0 : c0 + n], acc_c)
        bits = acc_t.view(torch.int32) != acc_c.view(torch.int32)
        acc_f = _tile_acc(h, w, c0, n)
        tile_bits = acc_f.view(torch.int32) != acc_c.view(torch.int32)
        where = (a.view(torch.int16) != b.view(torch.int16)).nonzero().tolist()
        chunks.append({
            "columns": [c0, c0 + n], "g_differing_bits": len(where),
            "acc_differing_bits": int(bits.sum()),
            "fused_tile_acc_differing_bits": int(tile_bits.sum()),
            "fused_tile_acc_first": [[r, c0 + c, float(acc_f[r, c]), float(acc_c[r, c])]
                                     for r, c in tile_bits.nonzero().tolist()[:8]],
            "first": [{"row": r, "col": c0 + c, "target": int(t[r]), "g_fused": float(a[r, c]),
                       "g_acc": float(b[r, c]), "acc_triton": float(acc_t[r, c]),
                       "acc_cute": float(acc_c[r, c]), "acc_fused_tile": float(acc_f[r, c])}
                      for r, c in where[:8]],
        })  # fmt: skip
        c0 += n
    return {"chunks": chunks}


if __name__ == "__main__":
    sys.exit(main())
