"""The soft-capped head's float32 constants, shared by every backend's softcap_logprob,
softcap_logits and linear_cross_entropy (so a temperature moves the same bits everywhere)."""

from __future__ import annotations


def head_constants(multiplier: float, softcap: float | None,
                   temperature: float = 1.0) -> tuple[float, float | None, float]:  # fmt: skip
    """(scale, outer, dz): z = outer * tanh(acc * scale) with a cap (z = acc * scale without
    one, outer None) and dz/dacc = dz (* (1 - tanh^2) with a cap). Each is formed in float64
    from the params and rounded once to float32 where it is used: scale = multiplier /
    softcap, outer = softcap / temperature (scale = multiplier / temperature without a cap),
    dz = multiplier / temperature. At temperature 1.0 each is the param itself."""
    dz = multiplier / temperature
    if softcap is None:
        return dz, None, dz
    return multiplier / softcap, softcap / temperature, dz
