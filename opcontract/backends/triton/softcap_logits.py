"""Host code of the Triton softcap_logits (the sampler's head): softcap_logprob's forward with
its partials kernel also storing z, so the logits and lse are that op's, bit for bit."""

from __future__ import annotations

import torch

from opcontract.backends.triton import softcap_logprob as slp

CONFIG_SPACE = {k: v for k, v in slp.CONFIG_SPACE.items() if k not in slp.BACKWARD_ONLY}


def default_config(dtype: str, T: int | None = None) -> dict:
    """softcap_logprob's canonical forward config for this dtype and T's bucket."""
    cfg = slp.default_config(dtype, T)
    return {k: v for k, v in cfg.items() if k not in slp.BACKWARD_ONLY}


def forward(config, hidden, weight, *, multiplier, softcap):
    """(logits, lse) from softcap_logprob's kernels (no target: every row's logprob unused)."""
    T = hidden.shape[0]
    no_target = torch.full((T,), -1, dtype=torch.int64, device=hidden.device)
    r = slp.forward_all(hidden, weight, no_target, multiplier=multiplier, softcap=softcap,
                        ignore_index=-1, logits=True, config=config)  # fmt: skip
    return r.logits, r.lse
