"""SwiGLU as torch.library custom ops with registered autograd (opaque to torch.compile)."""

from __future__ import annotations

import functools
import json

import torch

from opcontract.backends.direct import bypass_op
from opcontract.backends.op_config import config_string


@functools.lru_cache(maxsize=64)
def _backend(name: str, config: str = ""):
    """(forward(gate, up), backward(dy, gate, up)) of a backend; ``config``: launch config
    as JSON (Triton's block and warps: none of them changes a bit of this elementwise op)."""
    if name == "torch":
        from opcontract.backends.torch import swiglu as m

        return m.strict_forward, m.strict_backward
    if name == "triton":
        from opcontract.backends.triton import swiglu as m

        cfg = json.loads(config) if config else None
        return (
            functools.partial(m.forward, config=cfg),
            functools.partial(m.backward, config=cfg),
        )
    raise ValueError(f"no SwiGLU backend {name!r}")


def _out_shape(gate, up):
    return (gate.shape[0], gate.shape[-1] if up is not None else gate.shape[-1] // 2)


def _swiglu_op(
    gate: torch.Tensor, up: torch.Tensor | None, backend: str, config: str
) -> torch.Tensor:
    return _backend(backend, config)[0](gate, up)


swiglu_op = torch.library.custom_op("opcontract::swiglu", _swiglu_op, mutates_args=())


@swiglu_op.register_fake
def _(gate, up, backend, config):
    return gate.new_empty(_out_shape(gate, up))


def _swiglu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None, backend: str, config: str
) -> tuple[torch.Tensor, torch.Tensor]:
    dg, du = _backend(backend, config)[1](dy, gate, up)
    return dg, du if du is not None else dg.new_empty((0,))


swiglu_backward = torch.library.custom_op(
    "opcontract::swiglu_backward", _swiglu_backward, mutates_args=()
)


@swiglu_backward.register_fake
def _(dy, gate, up, backend, config):
    return torch.empty_like(gate), (
        torch.empty_like(up) if up is not None else gate.new_empty((0,))
    )


def _setup(ctx, inputs, output):
    gate, up, backend, config = inputs
    ctx.save_for_backward(gate, up)
    ctx.args = (backend, config)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    f = _swiglu_backward if bypass_op(dy, gate, up) else swiglu_backward
    dg, du = f(dy, gate, up, *ctx.args)
    return dg, (du if up is not None else None), None, None


swiglu_op.register_autograd(_backward, setup_context=_setup)


def swiglu(backend: str, gate, up=None, *, layout="separate", config=None):
    cfg = config_string(config)
    return (_swiglu_op if bypass_op(gate, up) else swiglu_op)(gate, up, backend, cfg)
