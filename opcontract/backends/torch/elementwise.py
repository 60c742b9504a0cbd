"""Position-independent float32 transcendentals for the strict torch paths.

On the CPU, torch evaluates float32 exp/tanh/sigmoid with SIMD code for whole vectors and a
scalar routine for the tail, and the two can differ in the last bit: an element's result
then depends on where it sits in the tensor, so on the batch size (the conformance kit
caught it: sigmoid of the same element, alone vs in a batch of 37). Evaluating in float64
and rounding once to float32 makes the float32 result the same wherever it is computed,
except in the vanishing case where the two float64 results straddle a float32 rounding
boundary.
"""

from __future__ import annotations

import torch


def exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double()).float()


def log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.double()).float()


def tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x.double()).float()


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x.double()).float()


def exp2(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(x.double()).float()


def log2(x: torch.Tensor) -> torch.Tensor:
    return torch.log2(x.double()).float()
