"""dense_gemm in plain torch: the float64 oracle, the strict path and stock F.linear.

Strict: elementwise IEEE operations only. Each 256-element slice of K is summed one
element at a time into a fresh float32 partial; partials are added in ascending order.
"""

from __future__ import annotations

import torch

from opcontract.backends.dense_gemm import K_BLOCK, needed
from opcontract.backends.fixed_order import pairwise_sum


def reference(x, weight, bias=None):
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def _promoted_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 a [M, K] @ b [K, N]: K_BLOCK partials from zero, added in ascending order."""
    M, K = a.shape
    acc = torch.zeros(M, b.shape[1], dtype=torch.float32, device=a.device)
    for k0 in range(0, K, K_BLOCK):
        part = torch.zeros_like(acc)
        for k in range(k0, min(k0 + K_BLOCK, K)):
            part = part + a[:, k : k + 1] * b[k]
        acc = acc + part
    return acc


def strict_forward(x, weight, bias):
    acc = _promoted_matmul(x.float(), weight.float().T)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


def strict_backward(dy, x, weight, has_bias, needs=None):
    """(dx, dw, db); ``needs`` (default all) leaves an unneeded one None, not computed."""
    need = needed(needs, has_bias)
    dy32 = dy.float()
    dx = _promoted_matmul(dy32, weight.float()).to(x.dtype) if need["x"] else None
    dw = None
    if need["weight"]:
        dw = _promoted_matmul(dy32.T.contiguous(), x.float()).to(weight.dtype)
    db = None
    if need["bias"]:  # grad_bias_m: a fixed pairwise tree over rows
        db = pairwise_sum(dy32).to(weight.dtype, copy=True)
    return dx, dw, db


def forward(config, x, weight, bias):
    return (strict_forward(x, weight, bias),)


def backward(config, saved, grads, needs, **params):
    has_bias = saved["bias"] is not None
    dx, dw, db = strict_backward(grads["y"], saved["x"], saved["weight"], has_bias, needs)
    return {"x": dx, "weight": dw, "bias": db}


def cublas_forward(x, weight, bias=None):
    """Stock F.linear: the library chooses the reduction, and changes it with M."""
    return (torch.nn.functional.linear(x, weight, bias),)
