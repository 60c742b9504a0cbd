"""StrictLinear: an nn.Linear whose matmul is the batch-invariant ``dense_gemm``."""

from __future__ import annotations

import torch

from opcontract import dispatch


class StrictLinear(torch.nn.Linear):
    """Drop-in nn.Linear (same parameters and state-dict keys) routed through dense_gemm.

    Any leading dimensions are flattened into rows. Works with autograd and under
    torch.compile (the op is a torch.library custom op).
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
        rows = x.reshape(-1, self.in_features)
        return self._gemm(rows, self.weight, self.bias).reshape(*x.shape[:-1], self.out_features)
