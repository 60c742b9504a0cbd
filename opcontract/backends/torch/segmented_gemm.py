"""segmented_gemm in plain torch: the float64 oracle and the strict path (elementwise IEEE
operations: each segment as dense_gemm's strict K sum, the segments by an adjacent-pair
tree)."""

from __future__ import annotations

import torch

from opcontract.backends.fixed_order import adjacent_tree_sum
from opcontract.backends.torch.dense_gemm import _promoted_matmul


def reference(x, weight, segments=1, grad_segments=1):
    return x.double() @ weight.double().T


def segment_tree(a: torch.Tensor, b: torch.Tensor, segments: int) -> torch.Tensor:
    """float32 a [M, R] @ b [R, N], R cut into ``segments`` equal parts, each a promoted
    sum from its own start, the parts added by the adjacent-pair tree."""
    width = a.shape[1] // segments
    parts = [
        _promoted_matmul(a[:, s * width : (s + 1) * width], b[s * width : (s + 1) * width])
        for s in range(segments)
    ]
    return adjacent_tree_sum(torch.stack(parts))


def forward(config, x, weight, *, segments, grad_segments):
    return (segment_tree(x.float(), weight.float().T, segments),)


def backward(config, saved, grads, needs, *, segments, grad_segments):
    x, w = saved["x"], saved["weight"]
    g = grads["acc"]
    g = (
        torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
        if g is None
        else g.to(x.dtype).float()  # grad_x_n.in, grad_weight_m.in: the input dtype
    )
    dx = segment_tree(g, w.float(), grad_segments).to(x.dtype) if needs["x"] else None
    dw = segment_tree(g.T.contiguous(), x.float(), 1).to(w.dtype) if needs["weight"] else None
    return {"x": dx, "weight": dw}
