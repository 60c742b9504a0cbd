"""Host code of the Triton qk_norm_rope: one launch over (token, head) for q and k together."""

from __future__ import annotations

import torch

from opcontract.backends.placement import on_device
from opcontract.backends.qk_norm_rope import inv_freq
from opcontract.backends.triton.launch import launch


def _meta(D: int, layer: str) -> dict:
    half = D // 2
    return dict(HALF=half, BLOCK=max(16, 1 << max(half - 1, 0).bit_length()),
                ROPE=layer == "local", num_warps=1 if half <= 128 else 4)  # fmt: skip


def _freq(layer, rope_theta, D, device):
    if layer == "local":
        return inv_freq(rope_theta, D, device)
    return torch.empty(1, dtype=torch.float64, device=device)


def forward(config, q, k, positions, *, layer, rope_theta, qk_scale, eps):
    """(q_out, k_out, rstd_q, rstd_k)."""
    from opcontract.backends.triton import qk_norm_rope_kernels as kk

    T, Hq, D = q.shape
    Hkv = k.shape[1]
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    rq = torch.empty((T, Hq), dtype=torch.float32, device=q.device)
    rk = torch.empty((T, Hkv), dtype=torch.float32, device=q.device)
    if T and Hq + Hkv:
        positions = on_device(positions, q.device)
        launch(kk._qk_fwd_kernel, (T, Hq + Hkv), q, k, qo, ko, rq, rk, positions,
               _freq(layer, rope_theta, D, q.device), Hq, Hkv, float(qk_scale), float(eps),
               **_meta(D, layer))  # fmt: skip
    return qo, ko, rq, rk


def backward(config, saved, grads, needs, *, layer, rope_theta, qk_scale, eps):
    from opcontract.backends.triton import qk_norm_rope_kernels as kk

    q, k = saved["q"], saved["k"]
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    gq = grads["q_out"] if grads["q_out"] is not None else torch.zeros_like(q)
    gk = grads["k_out"] if grads["k_out"] is not None else torch.zeros_like(k)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    if T and Hq + Hkv:
        launch(kk._qk_bwd_kernel, (T, Hq + Hkv), q, k, gq.contiguous(), gk.contiguous(),
               saved["rstd_q"], saved["rstd_k"], dq, dk, on_device(saved["positions"], q.device),
               _freq(layer, rope_theta, D, q.device), Hq, Hkv, float(qk_scale),
               **_meta(D, layer))  # fmt: skip
    return {"q": dq if needs["q"] else None, "k": dk if needs["k"] else None}
