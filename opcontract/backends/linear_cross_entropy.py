"""linear_cross_entropy's reduction over tokens, shared by every backend's implementation.

A backend's head gives per-token float32 log-probabilities (and, with label smoothing,
``smooth = lse - mean_v z``, and with token accuracy the argmax). This module turns them
into the contract's loss and accuracy, and turns the loss's upstream gradient back into the
head's per-token gradients: by autograd over the very ops of the forward, so those
gradients carry exactly the roundings the forward's arithmetic implies.
"""

from __future__ import annotations

import torch

from opcontract.backends.fixed_order import pairwise_sum


def reduce_tokens(per_token: torch.Tensor, keep: torch.Tensor, reduction: str) -> torch.Tensor:
    """Reduce a [T] float32 per-token value (0 at ignored rows) as the contract says: the
    token_sum tree (``pairwise_sum``), divided by the kept count for ``mean``."""
    if reduction == "none":
        return per_token
    total = pairwise_sum(per_token)
    if reduction == "sum":
        return total
    count = keep.sum().clamp(min=1).to(per_token.dtype)
    return total / count


def per_token_loss(logprob, smooth, keep, label_smoothing: float) -> torch.Tensor:
    """lse - (1 - eps) z_t - eps mean_v z per kept token (0 elsewhere)."""
    if label_smoothing == 0:
        per_token = -logprob
    else:
        per_token = -(1.0 - label_smoothing) * logprob + label_smoothing * smooth
    return torch.where(keep, per_token, 0.0)


def loss_and_accuracy(
    logprob, smooth, predicted, targets, *, ignore_index, reduction, label_smoothing
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, token accuracy or None when ``predicted`` is None)."""
    t = targets.long()
    keep = t != ignore_index
    loss = reduce_tokens(per_token_loss(logprob, smooth, keep, label_smoothing), keep, reduction)
    if predicted is None:
        return loss, None
    hits = (keep & (predicted == t)).to(torch.float32)
    return loss, reduce_tokens(hits, keep, reduction)


def head_grads(
    grad_loss, targets, *, ignore_index, reduction, label_smoothing
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d loss / d logprob, d loss / d smooth or None), with the roundings autograd gives the
    forward's ops: the token sum's tree passes the gradient through its adds unchanged
    (divided once by the kept count for ``mean``), ``where`` zeroes the ignored rows, and
    the smoothing weights multiply it as float32 scalars (they are linear: the values of
    logprob and smooth don't enter)."""
    T = targets.shape[0]
    keep = targets.long() != ignore_index
    if grad_loss is None:
        grad_loss = torch.zeros((T,) if reduction == "none" else (), device=targets.device)
    g = grad_loss
    if reduction == "mean":
        g = g / keep.sum().clamp(min=1).to(torch.float32)
    g = torch.where(keep, g.expand(T) if g.dim() == 0 else g, 0.0)
    if label_smoothing == 0:
        return -g, None
    return g * -(1.0 - label_smoothing), g * label_smoothing
