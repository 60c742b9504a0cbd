"""SwiGLU in plain torch: the float64 oracle and the strict float32 path (elementwise)."""

from __future__ import annotations

import torch

from opcontract.backends.torch import elementwise as ew


def split(gate: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) views: the two tensors, or the halves of a packed [T, 2I] tensor."""
    if up is not None:
        return gate, up
    half = gate.shape[-1] // 2
    return gate[..., :half], gate[..., half:]


def reference(gate, up=None, *, layout="separate"):
    g, u = split(gate.double(), None if up is None else up.double())
    return torch.nn.functional.silu(g) * u


def strict_forward(gate, up):
    g, u = split(gate, up)
    g32 = g.float()
    return (g32 * ew.sigmoid(g32) * u.float()).to(gate.dtype)


def strict_backward(dy, gate, up):
    """(d gate, d up | None): d gate is [T, 2I] when packed (up is None)."""
    g, u = split(gate, up)
    g32, u32, dy32 = g.float(), u.float(), dy.float()
    s = ew.sigmoid(g32)
    dg = (dy32 * u32 * s * (1.0 + g32 * (1.0 - s))).to(gate.dtype)
    du = (dy32 * g32 * s).to(gate.dtype)
    if up is None:
        return torch.cat([dg, du], dim=-1), None
    return dg, du


def forward(config, gate, up, *, layout):
    return (strict_forward(gate, up),)


def backward(config, saved, grads, needs, *, layout):
    dg, du = strict_backward(grads["y"], saved["gate"], saved["up"])
    return {"gate": dg, "up": du}
