"""linear_cross_entropy in plain torch: the float64 oracle, the reduction over tokens that
every backend shares, and the strict and stock eager implementations."""

from __future__ import annotations

from collections.abc import Callable

import torch

from opcontract.backends.torch import softcap_logprob as slp
from opcontract.outputs import CrossEntropyOutput


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 by a fixed halving tree over zeros-padded 2**k entries.

    Elementwise adds only, so the result is the same on every device and every run
    (differentiable). Used for token_sum and for bias gradients.
    """
    n = x.shape[0]
    size = 1 << max(n - 1, 0).bit_length()
    x = torch.cat([x, x.new_zeros(size - n, *x.shape[1:])]) if size > n else x
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x.reshape(x.shape[1:])


def reduce_tokens(per_token: torch.Tensor, keep: torch.Tensor, reduction: str) -> torch.Tensor:
    """Reduce a [T] float32 per-token value (0 at ignored rows) as the contract says."""
    if reduction == "none":
        return per_token
    total = pairwise_sum(per_token)
    if reduction == "sum":
        return total
    count = keep.sum().clamp(min=1).to(per_token.dtype)
    return total / count


def loss_from_head(
    head: Callable,
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
):
    """The contract's loss from a differentiable head (logprob, entropy, predicted, smooth)."""
    logprob, _, predicted, smooth = head(
        hidden,
        weight,
        targets,
        multiplier=multiplier,
        softcap=softcap,
        ignore_index=ignore_index,
        argmax=return_token_accuracy,
        zsum=label_smoothing > 0,
    )
    t = targets.long()
    keep = t != ignore_index
    per_token = (
        -logprob
        if label_smoothing == 0
        else (-(1.0 - label_smoothing) * logprob + label_smoothing * smooth)
    )
    per_token = torch.where(keep, per_token, 0.0)
    loss = reduce_tokens(per_token, keep, reduction)
    if not return_token_accuracy:
        return loss
    hits = (keep & (predicted == t)).to(torch.float32)
    return CrossEntropyOutput(loss, reduce_tokens(hits, keep, reduction))


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
):
    """Float64 oracle (differentiable)."""
    y = (hidden.double() @ weight.double().T) * multiplier
    z = y if softcap is None else softcap * torch.tanh(y / softcap)
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
    hits = (keep & (z.argmax(dim=1) == t)).double()
    return CrossEntropyOutput(loss, red[reduction](hits))


def strict(hidden, weight, targets, **params):
    """The strict torch head, reduced by ``reduce_tokens``."""
    return loss_from_head(slp.head, hidden, weight, targets, **params)


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
):
    """Stock eager: library GEMM, logits from the input dtype, torch's cross_entropy."""
    y = (hidden @ weight.T).float() * multiplier
    z = y if softcap is None else softcap * torch.tanh(y / softcap)
    loss = torch.nn.functional.cross_entropy(
        z,
        targets.long(),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    if not return_token_accuracy:
        return loss
    keep = targets.long() != ignore_index
    hits = (keep & (z.argmax(-1) == targets.long())).float()
    return CrossEntropyOutput(loss, reduce_tokens(hits, keep, reduction))
