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


def _exp(x: torch.Tensor) -> torch.Tensor:  # float64, rounded once: the same on any device
    return torch.exp(x.double()).float()


def merge_max_sum(a: tuple, b: tuple) -> tuple[torch.Tensor, ...]:
    """The online max / rescale merge of two (max, sum of exp(z - max), *more sums) row
    partials: M = max(m1, m2), S = S1 exp(m1 - M) + S2 exp(m2 - M), every further sum (such
    as sum exp(z - max) z) rescaled by the same two factors."""
    m = torch.maximum(a[0], b[0])
    fa, fb = _exp(a[0] - m), _exp(b[0] - m)
    return (m, *(x * fa + y * fb for x, y in zip(a[1:], b[1:], strict=True)))


def merge_argmax(a: tuple, b: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, index) of two row partials, ``a`` covering the lower indices: b only where its
    max is larger (ties go to the lowest index)."""
    take = b[0] > a[0]
    return torch.where(take, b[0], a[0]), torch.where(take, b[1], a[1])


def adjacent_tree_merge(parts: list, merge=merge_max_sum) -> tuple[torch.Tensor, ...]:
    """Row partials (a power-of-two count, ascending) merged by the adjacent-pair tree:
    (max, sum, ...) by ``merge_max_sum``, or by ``merge`` (``merge_argmax``)."""
    if len(parts) & (len(parts) - 1) or not parts:
        raise ValueError(f"adjacent_tree_merge needs a power-of-two count, got {len(parts)}")
    while len(parts) > 1:
        parts = [merge(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    return tuple(parts[0])
