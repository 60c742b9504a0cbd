"""linear_cross_entropy on the Triton softcap_logprob head, reduced like every backend."""

from __future__ import annotations

import functools

from opcontract.backends.torch.linear_cross_entropy import loss_from_head
from opcontract.backends.triton import softcap_logprob as slp


def fused(hidden, weight, targets, *, config=None, **params):
    return loss_from_head(
        functools.partial(slp.head, config=config), hidden, weight, targets, **params
    )
