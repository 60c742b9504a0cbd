"""Named results returned when an op's optional outputs are asked for."""

from __future__ import annotations

from typing import NamedTuple

import torch


class LogprobOutput(NamedTuple):
    """softcap_logprob with return_entropy / return_predicted: None for fields not asked for."""

    logprob: torch.Tensor
    entropy: torch.Tensor | None = None
    predicted: torch.Tensor | None = None


class CrossEntropyOutput(NamedTuple):
    """linear_cross_entropy with return_token_accuracy=True."""

    loss: torch.Tensor
    token_accuracy: torch.Tensor | None = None


class AddNormOutput(NamedTuple):
    """fused_add_rms_norm: the normalised rows and the residual stream to keep."""

    y: torch.Tensor
    residual_out: torch.Tensor


class EmbeddingOutput(NamedTuple):
    """normalized_embedding with return_raw=True."""

    y: torch.Tensor
    raw: torch.Tensor | None = None
