"""Attention at a tensor-parallel degree above the KV-head count (the ``replicate`` policy).

Each rank holds ``Hq / t`` query heads and one KV head, shared by the ``t / Hkv`` ranks of
its replica group. The forward of a query head needs only its own KV head: local. The
gradient of a KV head sums over every query head of its group, which the group splits; so
the backward gathers the group's query heads, gate and output gradient (bits moved, none
added) and every replica runs the group's whole backward through the same op, giving the
one-rank dK and dV bitwise. It costs each rank ``t / Hkv`` times its share of the
attention backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from opcontract.parallel.collectives import Ranks, _all_gather


class _ReplicaGroupAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, gate, mask, run, ranks, group, kw):
        ctx.save_for_backward(q, k, v, gate, mask)
        ctx.run, ctx.ranks, ctx.group, ctx.kw = run, ranks, group, kw
        with torch.no_grad():
            return run(q, k, v, gate, mask, **kw)

    @staticmethod
    def backward(ctx, g):
        q, k, v, gate, mask = ctx.saved_tensors
        ranks, group = ctx.ranks, ctx.group

        def whole_group(t: torch.Tensor) -> torch.Tensor:  # [B, L, h, D], heads in rank order
            parts = _all_gather(t, ranks)
            return torch.cat([parts[r] for r in group], dim=2)

        qg, gg, dout = whole_group(q), whole_group(gate), whole_group(g.contiguous())
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (qg, k, v, gg)]
            out = ctx.run(*leaves, mask, **ctx.kw)
            dq, dk, dv, dgate = torch.autograd.grad(out, leaves, dout)
        h = q.shape[2]
        i = group.index(ranks.rank)
        own = slice(i * h, (i + 1) * h)
        return dq[:, :, own], dk, dv, dgate[:, :, own], None, None, None, None, None


def replica_group_attention(run: Callable, ranks: Ranks, group: tuple[int, ...]) -> Callable:
    """``run`` (``opcontract.attention.padded``'s signature) with the backward above;
    ``group``: the ranks sharing this rank's KV head, ascending."""

    def call(q, k, v, gate, mask, **kw):
        return _ReplicaGroupAttention.apply(q, k, v, gate, mask, run, ranks, group, kw)

    return call
