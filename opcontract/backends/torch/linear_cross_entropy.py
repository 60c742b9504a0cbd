"""linear_cross_entropy in plain torch: the float64 oracle, the strict implementation (the
strict head reduced by ``backends.linear_cross_entropy``) and stock eager."""

from __future__ import annotations

import torch

from opcontract.backends import linear_cross_entropy as lce
from opcontract.backends.torch import softcap_logprob as slp


def reference(
    hidden,
    weight,
    targets,
    *,
    multiplier=1.0,
    softcap=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    return_token_accuracy=False,
    temperature=1.0,
):
    """Float64 oracle (differentiable)."""
    z = slp.logits64(hidden, weight, multiplier, softcap, temperature)
    t = targets.long()
    keep = t != ignore_index
    lse = torch.logsumexp(z, dim=1)
    zt = z.gather(1, torch.where(keep, t, 0)[:, None])[:, 0]
    per_token = lse - (1 - label_smoothing) * zt - label_smoothing * z.mean(dim=1)
    per_token = torch.where(keep, per_token, 0.0)
    count = keep.sum().clamp(min=1)
    red = {"none": lambda x: x, "sum": lambda x: x.sum(), "mean": lambda x: x.sum() / count}
    loss = red[reduction](per_token)
    if not return_token_accuracy:
        return loss
    from opcontract.outputs import CrossEntropyOutput

    hits = (keep & (z.argmax(dim=1) == t)).double()
    return CrossEntropyOutput(loss, red[reduction](hits))


def forward(
    config,
    hidden,
    weight,
    targets,
    *,
    multiplier,
    softcap,
    ignore_index,
    reduction,
    label_smoothing,
    return_token_accuracy,
    temperature=1.0,
):
    """(loss, token_accuracy, lse): the strict torch head, reduced over tokens."""
    lp, _, pred, lse, _, smooth, *_ = slp.strict_forward_all(
        hidden, weight, targets, multiplier, softcap, ignore_index, temperature=temperature
    )
    loss, acc = lce.loss_and_accuracy(
        lp, smooth if label_smoothing > 0 else None, pred if return_token_accuracy else None,
        targets, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing,
    )  # fmt: skip
    return loss, acc, lse


def backward(
    config,
    saved,
    grads,
    needs,
    *,
    multiplier,
    softcap,
    ignore_index,
    reduction,
    label_smoothing,
    return_token_accuracy,
    temperature=1.0,
):
    """{hidden, weight}: the loss's gradient taken back to the head's, then its backward."""
    targets = saved["targets"]
    g_lp, g_sm = lce.head_grads(
        grads["loss"], targets, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing,
    )  # fmt: skip
    gh, gw = slp.strict_backward(
        saved["hidden"], saved["weight"], targets, saved["lse"], None, g_lp, None, g_sm,
        multiplier, softcap, ignore_index,
        need_hidden=needs["hidden"], need_weight=needs["weight"],
        plan=config.get("backward_plan", "vocab_chunks"),
        token_chunk=config.get("token_chunk", slp.DEFAULT_PLAN["token_chunk"]),
        temperature=temperature,
    )  # fmt: skip
    return {"hidden": gh, "weight": gw}


def eager(
    hidden,
    weight,
    targets,
    *,
    multiplier=1.0,
    softcap=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    return_token_accuracy=False,
    temperature=1.0,
):
    """Stock eager: library GEMM, logits from the input dtype, torch's cross_entropy."""
    y = (hidden @ weight.T).float() * multiplier
    z = y if softcap is None else softcap * torch.tanh(y / softcap)
    z = z if temperature == 1.0 else z / temperature
    loss = torch.nn.functional.cross_entropy(
        z,
        targets.long(),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    keep = targets.long() != ignore_index
    hits = (keep & (z.argmax(-1) == targets.long())).float()
    acc = lce.reduce_tokens(hits, keep, reduction) if return_token_accuracy else None
    return loss, acc, torch.logsumexp(z, dim=-1)
