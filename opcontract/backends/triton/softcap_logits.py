"""Host code of the Triton softcap_logits (the sampler's head): softcap_logprob's forward with
its partials kernel also storing z, so the logits and lse are that op's, bit for bit."""

from __future__ import annotations

import torch

from opcontract.backends.triton import softcap_logprob as slp

CONFIG_SPACE = {k: v for k, v in slp.CONFIG_SPACE.items() if k not in slp.BACKWARD_ONLY}


# Storing z stages the [block_t, 128] float32 tile through shared memory: compiled for sm_90,
# the TMA kernel needs 262168 bytes at 128 rows and 3 stages (the limit is 232448), 196624 at
# 2 stages, 180248 at 64 rows and 3. Stages never move a bit (a free parameter the tuner
# verifies).
MAX_STAGES_128_ROWS = 2


def default_config(dtype: str, T: int | None = None) -> dict:
    """softcap_logprob's canonical forward config for this dtype and T's bucket, with at most
    two stages at 128-row tiles (what fits beside the z tile)."""
    cfg = slp.default_config(dtype, T)
    if cfg["block_t"] >= 128:
        cfg["num_stages"] = min(cfg["num_stages"], MAX_STAGES_128_ROWS)
    return {k: v for k, v in cfg.items() if k not in slp.BACKWARD_ONLY}


def forward(config, hidden, weight, *, multiplier, softcap, temperature=1.0):
    """(logits, lse) from softcap_logprob's kernels (no target: every row's logprob unused)."""
    T = hidden.shape[0]
    no_target = torch.full((T,), -1, dtype=torch.int64, device=hidden.device)
    r = slp.forward_all(hidden, weight, no_target, multiplier=multiplier, softcap=softcap,
                        ignore_index=-1, logits=True, config=config,
                        temperature=temperature)  # fmt: skip
    return r.logits, r.lse
