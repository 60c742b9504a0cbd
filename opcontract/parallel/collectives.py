"""The cross-rank steps of the strict styles, as autograd functions over a process group.

Every combine gathers the ranks' float32 partials (an all-gather moves bits, it adds
nothing) and adds them locally by ``adjacent_tree_sum``: the top of the same tree a single
rank computes. Because every rank then runs the same replicated arithmetic, every rank
holds the same gradient of the gathered tensor, and a rank's partial takes its own slice of
it: no collective in that backward. ``all_reduce`` forms are the negative control (the
collective's own order, as Megatron and DTensor's ``Partial`` reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from opcontract.backends.fixed_order import adjacent_tree_sum


@dataclass(frozen=True)
class Ranks:
    """This rank's place in a 1-D tensor-parallel group (``group`` None: one rank, no
    collectives)."""

    group: object | None
    rank: int
    size: int

    @classmethod
    def of(cls, mesh) -> Ranks:
        if mesh is None:
            return cls(None, 0, 1)
        if mesh.ndim != 1:
            raise ValueError(f"the strict styles take a 1-D device mesh, got {mesh.ndim}-D")
        return cls(mesh.get_group(), mesh.get_local_rank(), mesh.size())


def _all_gather(t: torch.Tensor, ranks: Ranks) -> list[torch.Tensor]:
    if ranks.group is None:
        return [t]
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(ranks.size)]
    dist.all_gather(out, t, group=ranks.group)
    return out


class _GatherPartials(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, ranks: Ranks) -> torch.Tensor:
        ctx.rank = ranks.rank
        return torch.stack(_all_gather(t, ranks))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g[ctx.rank], None


def gather_partials(t: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """[size, *t.shape]: every rank's ``t`` in rank order. Backward: this rank's slice."""
    return _GatherPartials.apply(t, ranks)


def tree_combine(t: torch.Tensor, ranks: Ranks, owners: tuple[int, ...] | None = None):
    """The ranks' partials ``t`` (float32) gathered and added by the adjacent-pair tree,
    ``owners`` (ascending) naming the ranks whose partials are the leaves (one per distinct
    shard; default all)."""
    parts = gather_partials(t, ranks)
    if owners is not None and len(owners) != ranks.size:
        parts = parts[list(owners)]
    return adjacent_tree_sum(parts)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, ranks: Ranks) -> torch.Tensor:
        t = t.clone()
        if ranks.group is not None:
            dist.all_reduce(t, group=ranks.group)
        return t

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


def all_reduce(t: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """The negative control: the collective's own sum (backward: identity)."""
    return _AllReduce.apply(t, ranks)


class _TakeRows(torch.autograd.Function):
    """Rows [lo, hi) of a replicated weight. Backward: the full weight's gradient on every
    rank, each block of rows taken from the first rank that holds it (replicas agree)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, lo: int, hi: int, ranks: Ranks, owners: tuple[int, ...]):
        ctx.shape, ctx.ranks, ctx.owners = w.shape, ranks, owners
        return w[lo:hi]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        parts = _all_gather(g, ctx.ranks)
        return torch.cat([parts[r] for r in ctx.owners]), None, None, None, None


def take_rows(w, lo: int, hi: int, ranks: Ranks, owners: tuple[int, ...]) -> torch.Tensor:
    return _TakeRows.apply(w, lo, hi, ranks, owners)
