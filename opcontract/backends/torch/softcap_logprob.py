"""softcap_logprob in plain torch: the float64 oracle, the portable strict path, and stock eager.

The strict path uses only elementwise IEEE operations (one rounding per multiply and per
add), so the order of every reduction is written in this file and nowhere else:

* gemm_k: one float32 accumulator per logit; the K dimension is walked one element at a
  time in ascending order (block 1): ``acc = acc + h[:, k] * w[:, k]``.
* vocab_lse: the vocabulary is walked in blocks of ``VOCAB_BLOCK``; within a block the
  sum of exponentials is a fixed pairwise tree (halving the width each step); block
  partials are merged in ascending order with the online max rescale.
"""

from __future__ import annotations

import torch

VOCAB_BLOCK = 128


def _softcap(y: torch.Tensor, softcap: float | None) -> torch.Tensor:
    if softcap is None:
        return y
    return softcap * torch.tanh(y / softcap)


def _capped_logits(acc: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
    """The contract's float32 epilogue: softcap * tanh(acc * (multiplier / softcap))."""
    if softcap is None:
        return acc * multiplier
    scale = torch.tensor(multiplier / softcap, dtype=torch.float32, device=acc.device)
    return softcap * torch.tanh(acc * scale)


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    multiplier: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    row_block: int = 256,
) -> torch.Tensor:
    """Float64 oracle: the contract's math with every operation in float64. Returns float64 [T]."""
    w = weight.double()
    out = torch.zeros(hidden.shape[0], dtype=torch.float64, device=hidden.device)
    for r0 in range(0, hidden.shape[0], row_block):
        h = hidden[r0 : r0 + row_block].double()
        z = _softcap((h @ w.T) * multiplier, softcap)
        t = targets[r0 : r0 + row_block].long()
        keep = t != ignore_index
        zt = z.gather(1, torch.where(keep, t, 0)[:, None])[:, 0]
        out[r0 : r0 + row_block] = torch.where(keep, zt - torch.logsumexp(z, dim=1), 0.0)
    return out


def _pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by a fixed halving tree of elementwise adds."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def strict_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    multiplier: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The contract's math in the contract's order, on any torch device. Float32 [T]."""
    T, H = hidden.shape
    V = weight.shape[0]
    h = hidden.float()
    t = targets.long()
    run_max = torch.full((T,), float("-inf"), dtype=torch.float32, device=hidden.device)
    run_sum = torch.zeros(T, dtype=torch.float32, device=hidden.device)
    z_target = torch.zeros(T, dtype=torch.float32, device=hidden.device)
    for v0 in range(0, V, VOCAB_BLOCK):  # ascending vocabulary blocks: the bits depend on it
        w = torch.zeros(VOCAB_BLOCK, H, dtype=torch.float32, device=hidden.device)
        nv = min(VOCAB_BLOCK, V - v0)
        w[:nv] = weight[v0 : v0 + nv].float()
        acc = torch.zeros(T, VOCAB_BLOCK, dtype=torch.float32, device=hidden.device)
        for k in range(H):  # gemm_k: ascending, one rounding per multiply and per add
            acc = acc + h[:, k : k + 1] * w[:, k]
        z = _capped_logits(acc, multiplier, softcap)
        valid = torch.arange(VOCAB_BLOCK, device=hidden.device) < nv
        z = torch.where(valid, z, float("-inf"))
        m_b = z.max(dim=1).values
        s_b = _pairwise_sum(torch.exp(z - m_b[:, None]))
        new_max = torch.maximum(run_max, m_b)
        run_sum = run_sum * torch.exp(run_max - new_max) + s_b * torch.exp(m_b - new_max)
        run_max = new_max
        hit = (t >= v0) & (t < v0 + nv)
        zt = z.gather(1, torch.where(hit, t - v0, 0)[:, None])[:, 0]
        z_target = torch.where(hit, zt, z_target)
    lse = run_max + torch.log(run_sum)
    return torch.where(t != ignore_index, z_target - lse, 0.0)


def eager_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    multiplier: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Stock eager: library GEMM, logits rounded to the input dtype, full [T, V] in memory."""
    z = _softcap((hidden @ weight.T).float() * multiplier, softcap)
    t = targets.long()
    keep = t != ignore_index
    logp = torch.log_softmax(z, dim=-1).gather(1, torch.where(keep, t, 0)[:, None])[:, 0]
    return torch.where(keep, logp, 0.0)
