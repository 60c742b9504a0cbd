"""Host code of the Triton SwiGLU kernels."""

from __future__ import annotations

import torch

from opcontract.backends.triton.launch import launch

CONFIG = {"block": 1024, "num_warps": 4}
# Elementwise: which program computes an element, and with how many warps, moves no bits.
CONFIG_SPACE = {"block": (512, 1024, 2048, 4096), "num_warps": (2, 4, 8)}


def _launch(config: dict | None) -> tuple[int, int]:
    cfg = {**CONFIG, **(config or {})}
    return int(cfg["block"]), int(cfg["num_warps"])


def _halves(gate, up):
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    if up is not None:
        return gate, (up if up.stride(-1) == 1 else up.contiguous()), gate.shape[-1]
    half = gate.shape[-1] // 2
    return gate, gate[:, half:], half


def forward(gate, up, config=None):
    from opcontract.backends.triton.swiglu_kernels import _swiglu_fwd_kernel

    block, warps = _launch(config)
    g, u, n = _halves(gate, up)
    y = torch.empty((g.shape[0], n), dtype=g.dtype, device=g.device)
    if y.numel():
        launch(
            _swiglu_fwd_kernel,
            (g.shape[0], -(-n // block)),
            g,
            u,
            y,
            n,
            g.stride(0),
            u.stride(0),
            y.stride(0),
            BLOCK=block,
            num_warps=warps,
        )
    return y


def backward(dy, gate, up, config=None):
    """(d gate, d up | None): d gate is [T, 2I] when packed (up is None)."""
    from opcontract.backends.triton.swiglu_kernels import _swiglu_bwd_kernel

    block, warps = _launch(config)
    g, u, n = _halves(gate, up)
    dy = dy.contiguous()
    if up is None:
        d = torch.empty_like(g)
        dg, du = d[:, :n], d[:, n:]
    else:
        dg, du = torch.empty_like(g), torch.empty_like(u)
    if dy.numel():
        launch(
            _swiglu_bwd_kernel,
            (g.shape[0], -(-n // block)),
            dy,
            g,
            u,
            dg,
            du,
            n,
            dy.stride(0),
            g.stride(0),
            u.stride(0),
            dg.stride(0),
            du.stride(0),
            BLOCK=block,
            num_warps=warps,
        )
    return (d, None) if up is None else (dg, du)


def swiglu_forward(config, gate, up, *, layout):
    return (forward(gate, up, config),)


def swiglu_backward(config, saved, grads, needs, *, layout):
    dg, du = backward(grads["y"], saved["gate"], saved["up"], config)
    return {"gate": dg, "up": du}
