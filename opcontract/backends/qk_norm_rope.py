"""qk_norm_rope's rotary frequencies, shared by every backend: theta^(-2i/D) for i < D/2,
computed once per (theta, D) in float64 on the host, so that every backend multiplies each
position by the same float64 values (the angle p * theta^(-2i/D) is then one IEEE multiply)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=64)
def _inv_freq(theta: float, dim: int) -> tuple[float, ...]:
    return tuple(theta ** (-2.0 * i / dim) for i in range(dim // 2))


@functools.lru_cache(maxsize=64)
def inv_freq(theta: float, dim: int, device: torch.device) -> torch.Tensor:
    """[D/2] float64 on ``device`` (cached)."""
    return torch.tensor(_inv_freq(float(theta), dim), dtype=torch.float64, device=device)


def cos_sin(positions: torch.Tensor, theta: float, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [T, D/2] of the contract's float64 angles, each rounded once."""
    a = positions.to(torch.float64)[:, None] * inv_freq(theta, dim, positions.device)[None, :]
    return torch.cos(a).float(), torch.sin(a).float()
