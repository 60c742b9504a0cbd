"""Host code of the Triton SwiGLU kernels."""

from __future__ import annotations

import torch

from opcontract.backends.triton.launch import launch, prepared

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


def _forward_launch(g, u, y, n, config):
    from opcontract.backends.triton.swiglu_kernels import _swiglu_fwd_kernel

    block, warps = _launch(config)
    grid = (g.shape[0], -(-n // block))
    args = (g, u, y, n, g.stride(0), u.stride(0), y.stride(0))
    return _swiglu_fwd_kernel, grid, args, {"BLOCK": block, "num_warps": warps}


def forward(gate, up, config=None):
    g, u, n = _halves(gate, up)
    y = torch.empty((g.shape[0], n), dtype=g.dtype, device=g.device)
    if y.numel():
        kernel, grid, args, meta = _forward_launch(g, u, y, n, config)
        launch(kernel, grid, *args, **meta)
    return y


def plan(config, gate, up, lead):
    """The forward's call plan (see launch.prepared): y from the caller's contiguous (gate,
    up), any leading dims; None where it can't serve a call."""
    if gate.device.type != "cuda" or not gate.is_contiguous():
        return None
    if up is not None and not up.is_contiguous():
        return None
    g, u, n = _halves(gate, up)
    shape = (*(lead or g.shape[:1]), n)
    y = torch.empty(shape, dtype=g.dtype, device=g.device)
    if not y.numel():
        return None
    kernel, grid, args, meta = _forward_launch(g, u, y, n, config)
    # packed: up's address is inside gate's storage; y is fresh
    go = prepared(kernel, grid, args, meta, checked=(0, 1))
    if go is None:
        return None
    scalars, dtype, device, empty = args[3:], g.dtype, g.device, torch.empty
    if up is None:
        offset = n * g.element_size()

        def run_packed(gate, up):
            if not gate.is_contiguous():
                return None
            y = empty(shape, dtype=dtype, device=device)
            p = gate.data_ptr()
            return (y,) if go(p, p + offset, y.data_ptr(), *scalars) else None

        return run_packed

    def run_separate(gate, up):
        if not (gate.is_contiguous() and up.is_contiguous()):
            return None
        y = empty(shape, dtype=dtype, device=device)
        return (y,) if go(gate.data_ptr(), up.data_ptr(), y.data_ptr(), *scalars) else None

    return run_separate


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


def swiglu_plan_no_grad(config, inputs, params, lead):
    return plan(config, inputs["gate"], inputs["up"], lead)


def swiglu_backward(config, saved, grads, needs, *, layout):
    dg, du = backward(grads["y"], saved["gate"], saved["up"], config)
    return {"gate": dg, "up": du}
