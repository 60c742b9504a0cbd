"""segmented_gemm on the Triton GEMM: each K segment one launch of dense_gemm's kernel into
a float32 plane (its 256-element promoted partials from the segment's start), the planes
added by the adjacent-pair tree (IEEE float32 adds)."""

from __future__ import annotations

import torch

from opcontract.backends.fixed_order import adjacent_tree_sum
from opcontract.backends.triton.dense_gemm import _gemm


def _planes(a, b_rows, segments: int, config, *, b_is_nk: bool) -> torch.Tensor:
    """float32 [M, R] a times b over R cut into ``segments``: b_rows is [N, R] (b_is_nk,
    the forward's weight) or [R, N] (the backward's weight)."""
    M, R = a.shape
    N = b_rows.shape[0] if b_is_nk else b_rows.shape[1]
    width = R // segments
    planes = torch.empty(segments, M, N, dtype=torch.float32, device=a.device)
    if M and N and width:
        for s in range(segments):
            lo, hi = s * width, (s + 1) * width
            if b_is_nk:
                b, sb = b_rows[:, lo:hi], (1, b_rows.stride(0))
            else:
                b, sb = b_rows[lo:hi], (b_rows.stride(0), 1)
            _gemm(a[:, lo:hi], b, planes[s], None, M, N, width, (a.stride(0), 1), sb, config)
    else:
        planes.zero_()
    return adjacent_tree_sum(planes)


def forward(config, x, weight, *, segments, grad_segments):
    x, weight = x.contiguous(), weight.contiguous()
    return (_planes(x, weight, segments, config, b_is_nk=True),)


def backward(config, saved, grads, needs, *, segments, grad_segments):
    x, w = saved["x"].contiguous(), saved["weight"].contiguous()
    g = grads["acc"]
    M, N = x.shape[0], w.shape[0]
    g = torch.zeros(M, N, dtype=x.dtype, device=x.device) if g is None else g.to(x.dtype)
    g = g.contiguous()
    dx = dw = None
    if needs["x"]:  # dx [M, K] = g [M, N] @ w [N, K], N in grad_segments
        dx = _planes(g, w, grad_segments, config, b_is_nk=False).to(x.dtype)
    if needs["weight"]:  # dw [N, K] = g.T [N, M] @ x [M, K], the token loop in one program
        K = x.shape[1]
        dw = torch.empty_like(w)
        if N and K and M:
            cfg = {**(config or {}), "parallel_partials": False}
            _gemm(g, x, dw, None, N, K, M, (1, g.stride(0)), (x.stride(0), 1), cfg)
        else:
            dw.zero_()
    return {"x": dx, "weight": dw}
