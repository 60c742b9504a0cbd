"""RMSNorm (optionally fused with the residual add) as torch.library custom ops with
registered autograd, opaque to torch.compile so the compiler can't change their bits."""

from __future__ import annotations

import torch

from opcontract.backends.direct import bypass_op
from opcontract.outputs import AddNormOutput


def _backend(name: str):
    if name == "torch":
        from opcontract.backends.torch import norms as m

        return m.strict_forward, m.strict_backward
    if name == "triton":
        from opcontract.backends.triton import norms as m

        return m.forward, m.backward
    raise ValueError(f"no RMSNorm backend {name!r}")


def _add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    backend: str,
    variant: str,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, residual_out or an empty tensor, rstd)."""
    fwd, _ = _backend(backend)
    y, rout, rstd = fwd(x, weight, residual, variant, eps)
    return y, rout if rout is not None else x.new_empty((0,)), rstd


add_rms_norm = torch.library.custom_op("opcontract::add_rms_norm", _add_rms_norm, mutates_args=())


@add_rms_norm.register_fake
def _(x, weight, residual, backend, variant, eps):
    return (
        torch.empty_like(x),
        torch.empty_like(x) if residual is not None else x.new_empty((0,)),
        x.new_empty((x.shape[0],), dtype=torch.float32),
    )


def _add_rms_norm_backward(
    dy: torch.Tensor,
    d_residual_out: torch.Tensor | None,
    x_in: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    backend: str,
    variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight or an empty tensor)."""
    _, bwd = _backend(backend)
    dx, dw = bwd(dy, d_residual_out, x_in, weight, rstd, variant)
    return dx, dw if dw is not None else dx.new_empty((0,))


add_rms_norm_backward = torch.library.custom_op(
    "opcontract::add_rms_norm_backward", _add_rms_norm_backward, mutates_args=()
)


@add_rms_norm_backward.register_fake
def _(dy, d_residual_out, x_in, weight, rstd, backend, variant):
    return torch.empty_like(x_in), (
        torch.empty_like(weight) if weight is not None else x_in.new_empty((0,))
    )


def _setup(ctx, inputs, output):
    x, weight, residual, backend, variant, _ = inputs
    y, rout, rstd = output
    ctx.save_for_backward(rout if residual is not None else x, weight, rstd)
    ctx.args = (backend, variant, residual is not None)


def _backward(ctx, dy, d_rout, _d_rstd):
    x_in, weight, rstd = ctx.saved_tensors
    backend, variant, fused = ctx.args
    if dy is None:
        dy = torch.zeros_like(x_in)
    dres = d_rout if fused and d_rout is not None and d_rout.numel() else None
    f = _add_rms_norm_backward if bypass_op(dy, dres, x_in, weight) else add_rms_norm_backward
    dx, dw = f(dy, dres, x_in, weight, rstd, backend, variant)
    return dx, (dw if weight is not None else None), (dx if fused else None), None, None, None


add_rms_norm.register_autograd(_backward, setup_context=_setup)


def rms_norm(backend: str, x, weight=None, *, variant="plain", eps=1e-6):
    f = _add_rms_norm if bypass_op(x, weight) else add_rms_norm
    return f(x, weight, None, backend, variant, float(eps))[0]


def fused_add_rms_norm(backend: str, x, residual, weight=None, *, variant="plain", eps=1e-6):
    f = _add_rms_norm if bypass_op(x, residual, weight) else add_rms_norm
    y, rout, _ = f(x, weight, residual, backend, variant, float(eps))
    return AddNormOutput(y, rout)


def _embedding_backend(name: str):
    if name == "torch":
        from opcontract.backends.torch import norms as m
    elif name == "triton":
        from opcontract.backends.triton import norms as m
    else:
        raise ValueError(f"no embedding backend {name!r}")
    return m.embedding_forward, m.embedding_backward


def _normalized_embedding_op(
    ids: torch.Tensor, table: torch.Tensor, backend: str, eps: float, want_raw: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, raw, rstd); raw is [0, H] (never written) unless ``want_raw``."""
    return _embedding_backend(backend)[0](ids, table, eps, want_raw)


normalized_embedding_op = torch.library.custom_op(
    "opcontract::normalized_embedding", _normalized_embedding_op, mutates_args=()
)


@normalized_embedding_op.register_fake
def _(ids, table, backend, eps, want_raw):
    T, H = ids.shape[0], table.shape[1]
    return (
        table.new_empty((T, H)),
        table.new_empty((T if want_raw else 0, H)),
        table.new_empty((T,), dtype=torch.float32),
    )


def _normalized_embedding_backward(
    dy: torch.Tensor,
    d_raw: torch.Tensor | None,
    ids: torch.Tensor,
    table: torch.Tensor,
    rstd: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    return _embedding_backend(backend)[1](dy, d_raw, ids, table, rstd)


normalized_embedding_backward = torch.library.custom_op(
    "opcontract::normalized_embedding_backward", _normalized_embedding_backward, mutates_args=()
)


@normalized_embedding_backward.register_fake
def _(dy, d_raw, ids, table, rstd, backend):
    return torch.empty_like(table)


def _embed_setup(ctx, inputs, output):
    ids, table, backend, _, want_raw = inputs
    ctx.save_for_backward(ids, table, output[2])
    ctx.backend = backend
    ctx.want_raw = want_raw


def _embed_backward(ctx, dy, d_raw, _d_rstd):
    ids, table, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros(ids.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
    if not ctx.want_raw:  # raw was not returned: its [0, H] placeholder has no gradient
        d_raw = None
    f = (
        _normalized_embedding_backward
        if bypass_op(dy, d_raw, table)
        else normalized_embedding_backward
    )
    dtable = f(dy, d_raw, ids, table, rstd, ctx.backend)
    return None, dtable, None, None, None


normalized_embedding_op.register_autograd(_embed_backward, setup_context=_embed_setup)


def normalized_embedding(backend: str, ids, table, *, eps=1e-5, return_raw=False):
    from opcontract.outputs import EmbeddingOutput

    f = _normalized_embedding_op if bypass_op(ids, table) else normalized_embedding_op
    y, raw, _ = f(ids, table, backend, float(eps), bool(return_raw))
    return EmbeddingOutput(y, raw) if return_raw else y
