"""dense_gemm as torch.library custom ops with registered autograd (opaque to torch.compile)."""

from __future__ import annotations

import functools
import json

import torch

from opcontract.backends.direct import bypass_op
from opcontract.backends.op_config import config_string
from opcontract.contracts.schema import ReductionPlan

K_BLOCK = 256  # the contract's gemm_k block: one promoted float32 partial per 256 of K


def strict_declaration() -> dict:
    """The plan and gradient invariances every strict dense_gemm implementation declares:
    K (and N, M in the backward) in 256-element promoted float32 partials, the bias
    gradient by a fixed pairwise tree."""

    def plan(**kw) -> ReductionPlan:
        return ReductionPlan(accumulate="float32", **kw)

    return dict(
        plan={
            "gemm_k": plan(block=K_BLOCK),
            "grad_x_n": plan(block=K_BLOCK),
            "grad_weight_m": plan(block=K_BLOCK),
            "grad_bias_m": plan(block=1, order="pairwise"),
        },
        grad_invariances={
            "x": ("run_to_run", "batch"),
            "weight": ("run_to_run",),
            "bias": ("run_to_run",),
        },
    )


@functools.lru_cache(maxsize=256)
def _backend(name: str, config: str):
    """(forward, backward) of a backend with its launch config (JSON) bound; memoised, so a
    call parses no JSON."""
    cfg = json.loads(config) if config else None
    if name == "torch":
        from opcontract.backends.torch import dense_gemm as m

        return m.strict_forward, m.strict_backward
    if name == "triton":
        from opcontract.backends.triton import dense_gemm as m

        return (lambda *a: m.forward(*a, config=cfg)), (lambda *a: m.backward(*a, config=cfg))
    if name == "cute":
        from opcontract.backends.cute import dense_gemm as m

        return (lambda *a: m.forward(*a, config=cfg)), (lambda *a: m.backward(*a, config=cfg))
    raise ValueError(f"no dense_gemm backend {name!r}")


def _dense_gemm_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str, config: str
) -> torch.Tensor:
    return _backend(backend, config)[0](x, weight, bias)


dense_gemm_op = torch.library.custom_op("opcontract::dense_gemm", _dense_gemm_op, mutates_args=())


@dense_gemm_op.register_fake
def _(x, weight, bias, backend, config):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _dense_gemm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    has_bias: bool,
    backend: str,
    config: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _backend(backend, config)[1](dy, x, weight, has_bias)
    return dx, dw, db if db is not None else weight.new_empty((0,))


dense_gemm_backward = torch.library.custom_op(
    "opcontract::dense_gemm_backward", _dense_gemm_backward, mutates_args=()
)


@dense_gemm_backward.register_fake
def _(dy, x, weight, has_bias, backend, config):
    return (
        torch.empty_like(x),
        torch.empty_like(weight),
        weight.new_empty((weight.shape[0],) if has_bias else (0,)),
    )


def _setup(ctx, inputs, output):
    x, weight, bias, backend, config = inputs
    ctx.save_for_backward(x, weight)
    ctx.args = (bias is not None, backend, config)


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    has_bias, backend, config = ctx.args
    f = _dense_gemm_backward if bypass_op(dy, x, weight) else dense_gemm_backward
    dx, dw, db = f(dy, x, weight, has_bias, backend, config)
    return dx, dw, (db if has_bias else None), None, None


dense_gemm_op.register_autograd(_backward, setup_context=_setup)


def dense_gemm(backend: str, x, weight, bias=None, *, config=None):
    f = _dense_gemm_op if bypass_op(x, weight, bias) else dense_gemm_op
    return f(x, weight, bias, backend, config_string(config))
