"""StrictLinear: an nn.Linear whose matmul is the batch-invariant ``dense_gemm``."""

from __future__ import annotations

import torch

from opcontract import dispatch


class StrictLinear(torch.nn.Linear):
    """Drop-in nn.Linear (same parameters and state-dict keys) routed through dense_gemm.

    Any leading dimensions (dense_gemm's batch dims; a 1-D input is one row, as in
    nn.Linear). Works with autograd, under autocast (inputs cast as nn.Linear casts them) and
    under torch.compile (the op is a torch.library custom op).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        backend: str | None = None,
        mode: str = "strict",
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._gemm = dispatch.op("dense_gemm", backend=backend, mode=mode)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, **kw) -> StrictLinear:
        """A StrictLinear sharing ``linear``'s parameters."""
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            **kw,
        )
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 1:
            return self._gemm(x[None], self.weight, self.bias)[0]
        return self._gemm(x, self.weight, self.bias)
