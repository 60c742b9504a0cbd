"""softcap_logits (the sampler's head) in plain torch: the float64 oracle and the strict path,
which is softcap_logprob's strict forward with its logits kept (the same z, the same lse)."""

from __future__ import annotations

import torch

from opcontract.backends.torch import softcap_logprob as slp


def reference(hidden, weight, *, multiplier: float = 1.0, softcap: float | None = None,
              temperature: float = 1.0):  # fmt: skip
    """Float64 oracle: (logits, lse) as a SamplerHeadOutput."""
    from opcontract.outputs import SamplerHeadOutput

    z = slp.logits64(hidden, weight, multiplier, softcap, temperature)
    return SamplerHeadOutput(z, torch.logsumexp(z, dim=1))


def forward(config, hidden, weight, *, multiplier, softcap, temperature=1.0):
    """(logits, lse): softcap_logprob's strict forward, every block's z stored as it is made."""
    T, V = hidden.shape[0], weight.shape[0]
    logits = torch.empty(T, V, dtype=torch.float32, device=hidden.device)
    no_target = torch.full((T,), -1, dtype=torch.int64, device=hidden.device)
    _, _, _, lse, *_ = slp.strict_forward_all(
        hidden, weight, no_target, multiplier, softcap, -1, z_out=logits, temperature=temperature
    )
    return logits, lse
