"""Fixed-order float sums that every backend's host code may share: elementwise adds in a
tree fixed by the length alone, so the result is the same on every device and every run.

``pairwise_sum`` reduces dim 0 (token sums, bias gradients); ``tree_sum`` the last dim
(RMSNorm's row sums). Both pad with zeros to a power of two and halve the width each step:
``x[:half] + x[half:]``. Differentiable.
"""

from __future__ import annotations

import torch


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 by a fixed halving tree over zero-padded 2**k entries."""
    n = x.shape[0]
    size = 1 << max(n - 1, 0).bit_length()
    x = torch.cat([x, x.new_zeros(size - n, *x.shape[1:])]) if size > n else x
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x.reshape(x.shape[1:])


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by a fixed halving tree over zero-padded 2**k entries."""
    n = x.shape[-1]
    size = 1 << max(n - 1, 0).bit_length()
    if size > n:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], size - n)], dim=-1)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def adjacent_tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 (a power-of-two length) by adding neighbours: ``x[0::2] + x[1::2]``
    each step. Every aligned run of 2**j entries is a subtree, so a rank holding a
    contiguous share reduces it alone and the ranks' results finish the same tree."""
    n = x.shape[0]
    if n & (n - 1):
        raise ValueError(f"adjacent_tree_sum needs a power-of-two length, got {n}")
    while x.shape[0] > 1:
        x = x[0::2] + x[1::2]
    return x[0]
