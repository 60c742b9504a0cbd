"""The LM head as a torch.library custom op: ``opcontract::lm_head`` and its backward.

Both backends' softcap_logprob and linear_cross_entropy run through this op, so
torch.compile treats them as opaque: the compiler can neither fuse nor reorder the
arithmetic inside (it would change bits: a fused multiply-add is not a multiply and an
add), and it sees the shapes through the fake implementations. Autograd is registered on
the op; the backward is an op of its own.

Outputs not asked for come back as empty tensors (custom ops can't return None).
"""

from __future__ import annotations

import json

import torch

from opcontract.backends.direct import bypass_op
from opcontract.backends.op_config import config_string

_EMPTY_F = (0,)


def _backend(name: str):
    """(forward_all, backward) of a backend, imported on first use."""
    if name == "torch":
        from opcontract.backends.torch import softcap_logprob as m

        def fwd(
            hidden,
            weight,
            targets,
            multiplier,
            softcap,
            ignore_index,
            entropy,
            argmax,
            zsum,
            config,
        ):
            lp, ent, pred, lse, mean_z, smooth = m.strict_forward_all(
                hidden, weight, targets, multiplier, softcap, ignore_index
            )
            return lp, ent, pred, smooth, lse, mean_z

        def bwd(*args, **kw):
            return m.strict_backward(*args, **kw)

        return fwd, bwd
    if name == "triton":
        from opcontract.backends.triton import softcap_logprob as m

        def fwd(
            hidden,
            weight,
            targets,
            multiplier,
            softcap,
            ignore_index,
            entropy,
            argmax,
            zsum,
            config,
        ):
            r = m.forward_all(
                hidden,
                weight,
                targets,
                multiplier=multiplier,
                softcap=softcap,
                ignore_index=ignore_index,
                entropy=entropy,
                argmax=argmax,
                zsum=zsum,
                config=config,
            )
            return r.logprob, r.entropy, r.predicted, r.smooth, r.lse, r.mean_z

        def bwd(
            hidden,
            weight,
            targets,
            lse,
            mean_z,
            gl,
            ge,
            gs,
            multiplier,
            softcap,
            ignore_index,
            need_hidden,
            need_weight,
        ):
            return m.backward(
                hidden,
                weight,
                targets,
                lse,
                mean_z,
                gl,
                ge,
                gs,
                multiplier=multiplier,
                softcap=softcap,
                ignore_index=ignore_index,
                need_hidden=need_hidden,
                need_weight=need_weight,
            )

        return fwd, bwd
    raise ValueError(f"no LM-head backend {name!r}")


def _or_empty(t, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return t if t is not None else like.new_empty(_EMPTY_F, dtype=dtype)


def _lm_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    backend: str,
    multiplier: float,
    softcap: float | None,
    ignore_index: int,
    entropy: bool,
    argmax: bool,
    zsum: bool,
    config: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob, entropy, predicted, smooth, lse, mean_z); unasked outputs are empty."""
    fwd, _ = _backend(backend)
    lp, ent, pred, smooth, lse, mean_z = fwd(
        hidden,
        weight,
        targets,
        multiplier,
        softcap,
        ignore_index,
        entropy,
        argmax,
        zsum,
        json.loads(config) if config else None,
    )
    # torch's forward computes everything; keep only what was asked for
    return (
        lp,
        _or_empty(ent if entropy else None, lp),
        _or_empty(pred if argmax else None, lp, torch.int64),
        _or_empty(smooth if zsum else None, lp),
        lse,
        _or_empty(mean_z if entropy else None, lp),
    )


lm_head = torch.library.custom_op("opcontract::lm_head", _lm_head, mutates_args=())


@lm_head.register_fake
def _(
    hidden,
    weight,
    targets,
    backend,
    multiplier,
    softcap,
    ignore_index,
    entropy,
    argmax,
    zsum,
    config,
):
    T = hidden.shape[0]
    f = hidden.new_empty((T,), dtype=torch.float32)
    e = hidden.new_empty(_EMPTY_F, dtype=torch.float32)
    return (
        f,
        f.new_empty((T,)) if entropy else e,
        hidden.new_empty((T,) if argmax else _EMPTY_F, dtype=torch.int64),
        f.new_empty((T,)) if zsum else e,
        f.new_empty((T,)),
        f.new_empty((T,)) if entropy else e,
    )


def _lm_head_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    mean_z: torch.Tensor,
    g_logprob: torch.Tensor,
    g_entropy: torch.Tensor,
    g_smooth: torch.Tensor,
    backend: str,
    multiplier: float,
    softcap: float | None,
    ignore_index: int,
    has_entropy: bool,
    has_smooth: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight) in the contract's order."""
    _, bwd = _backend(backend)
    gh, gw = bwd(
        hidden,
        weight,
        targets,
        lse,
        mean_z if has_entropy else None,
        g_logprob,
        g_entropy if has_entropy else None,
        g_smooth if has_smooth else None,
        multiplier=multiplier,
        softcap=softcap,
        ignore_index=ignore_index,
        need_hidden=True,
        need_weight=True,
    )
    return gh, gw


lm_head_backward = torch.library.custom_op(
    "opcontract::lm_head_backward", _lm_head_backward, mutates_args=()
)


@lm_head_backward.register_fake
def _(
    hidden,
    weight,
    targets,
    lse,
    mean_z,
    g_logprob,
    g_entropy,
    g_smooth,
    backend,
    multiplier,
    softcap,
    ignore_index,
    has_entropy,
    has_smooth,
):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    hidden, weight, targets, backend, multiplier, softcap, ignore_index, entropy, _, zsum, _ = (
        inputs
    )
    ctx.save_for_backward(hidden, weight, targets, output[4], output[5])
    ctx.args = (backend, multiplier, softcap, ignore_index, entropy, zsum)


def _backward(ctx, g_lp, g_ent, _g_pred, g_smooth, _g_lse, _g_mean_z):
    hidden, weight, targets, lse, mean_z = ctx.saved_tensors
    backend, multiplier, softcap, ignore_index, entropy, zsum = ctx.args
    zeros = torch.zeros_like(lse)
    f = _lm_head_backward if bypass_op(hidden, weight, g_lp, g_ent, g_smooth) else lm_head_backward
    gh, gw = f(
        hidden,
        weight,
        targets,
        lse,
        mean_z,
        g_lp if g_lp is not None else zeros,
        g_ent if (entropy and g_ent is not None) else zeros,
        g_smooth if (zsum and g_smooth is not None) else zeros,
        backend,
        multiplier,
        softcap,
        ignore_index,
        entropy and g_ent is not None,
        zsum and g_smooth is not None,
    )
    return gh, gw, None, None, None, None, None, None, None, None, None


lm_head.register_autograd(_backward, setup_context=_setup)


def head(
    backend: str,
    hidden,
    weight,
    targets,
    *,
    multiplier=1.0,
    softcap=None,
    ignore_index=-100,
    entropy=False,
    argmax=False,
    zsum=False,
    config=None,
):
    """Differentiable (logprob, entropy | None, predicted | None, smooth | None)."""
    f = _lm_head if bypass_op(hidden, weight, targets) else lm_head
    lp, ent, pred, smooth, _, _ = f(
        hidden,
        weight,
        targets,
        backend,
        float(multiplier),
        None if softcap is None else float(softcap),
        int(ignore_index),
        bool(entropy),
        bool(argmax),
        bool(zsum),
        config_string(config),
    )
    return (lp, ent if entropy else None, pred if argmax else None, smooth if zsum else None)
