"""Strict ``ParallelStyle``s: column- and row-parallel ``nn.Linear`` over ``segmented_gemm``.

Both cut the sharded reduction into ``segments`` fixed parts (the largest tensor-parallel
degree supported), so a rank of degree t reduces ``segments / t`` of them and the ranks'
float32 partials finish the same adjacent-pair tree (``collectives``):

- **column-parallel** (output features sharded, input replicated): the forward needs no
  combine; the backward's dx sums over the sharded N, each rank's float32 partial over its
  N segments, the partials tree-combined before the one rounding to the input dtype.
- **row-parallel** (input features sharded): each rank's float32 subtree over its K
  segments, the subtrees tree-combined, then the one rounding; the backward is local.

Weights become DTensor parameters (``Shard(0)`` / ``Shard(1)``; ``Replicate()`` for rows a
group of ranks shares, such as KV heads at a degree above their count). ``combine=
"all_reduce"`` is the negative control: each rank's partial in the sequential order of
``segments=1``, summed by the collective, as stock tensor parallelism does.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from opcontract import dispatch
from opcontract.backends.fixed_order import adjacent_tree_sum
from opcontract.parallel.collectives import (
    Ranks,
    _all_gather,
    all_reduce,
    gather_partials,
    take_rows,
    tree_combine,
)

COMBINES = ("tree", "all_reduce")


class ParallelPlanError(ValueError):
    """A sharding the strict styles cannot serve (raised on every rank, before any collective
    that could hang)."""


def _param(t: torch.Tensor, mesh, placement, full: torch.Tensor | None = None) -> nn.Parameter:
    if mesh is None:
        return nn.Parameter(t)
    kw = {} if full is None else dict(shape=full.shape, stride=full.stride())  # uneven shards
    return nn.Parameter(DTensor.from_local(t, mesh, [placement], run_check=False, **kw))


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _check_linear(module: nn.Module, where: str) -> None:
    if not isinstance(module, nn.Linear):
        raise ParallelPlanError(f"{where}: expected nn.Linear, got {type(module).__name__}")
    if module.bias is not None:
        raise ParallelPlanError(
            f"{where}: a bias is not served (its gradient would sum rows in autograd's order)"
        )


class _Strict(ParallelStyle):
    def __init__(self, *, segments: int = 8, combine: str = "tree", backend: str | None = None):
        if segments < 1 or segments & (segments - 1):
            raise ParallelPlanError(f"segments must be a power of two, got {segments}")
        if combine not in COMBINES:
            raise ParallelPlanError(f"combine must be one of {COMBINES}, got {combine!r}")
        self.segments, self.combine, self.backend = segments, combine, backend

    def __repr__(self) -> str:
        return f"{type(self).__name__}(segments={self.segments}, combine={self.combine!r})"


class _ColwiseGemm(torch.autograd.Function):
    """y = x @ w.T in the input dtype (the rank's output columns). Backward: the rank's dx
    partial over its N segments (``segmented_gemm`` of dy and w.T, float32), the owners'
    partials tree-combined, then the one rounding; dw = dy.T @ x, local."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, how: tuple) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.how = how
        with torch.no_grad():
            return how[0](x, w).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        op, ranks, owners, segments, combine = ctx.how
        dy = dy.to(x.dtype).contiguous()
        dx = dw = None
        with torch.no_grad():
            if ctx.needs_input_grad[0]:
                part = op(dy, w.T, segments=segments)  # float32 [M, K], over this rank's N
                if combine == "tree":
                    parts = _all_gather(part, ranks)
                    dx = adjacent_tree_sum(torch.stack([parts[r] for r in owners]))
                else:
                    dx = all_reduce(part, ranks)
                dx = dx.to(x.dtype)
            if ctx.needs_input_grad[1]:
                dw = op(dy.T, x.T).to(w.dtype)
        return dx, dw, None


class StrictColwiseParallel(_Strict):
    """Output features sharded over the mesh. ``shards`` (default: the degree) below the
    degree replicates each block of rows over ``degree / shards`` ranks (the KV heads'
    policy); the backward then takes one partial per block."""

    def __init__(self, *, shards: int | None = None, **kw) -> None:
        super().__init__(**kw)
        self.shards = shards

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_linear(module, "StrictColwiseParallel")
        ranks = Ranks.of(device_mesh)
        t, S = ranks.size, self.segments
        shards = t if self.shards is None else min(t, self.shards)
        N, K = module.weight.shape
        if t % shards or N % S or S % shards:
            raise ParallelPlanError(
                f"column-parallel over {t} ranks in {shards} shards: the {N} output features "
                f"must split into {S} segments, and {S} into the shards (and the shards into "
                f"the ranks)"
            )
        block = ranks.rank * shards // t
        owners = tuple(s * t // shards for s in range(shards))
        lo, hi = block * (N // shards), (block + 1) * (N // shards)
        full = module.weight.detach()
        replicated = shards < t
        if replicated:
            module.weight = _param(full.clone(), device_mesh, Replicate())
        else:
            module.weight = _param(full[lo:hi].clone(), device_mesh, Shard(0))
        op = dispatch.op("segmented_gemm", backend=self.backend)
        how = (op, ranks, owners, S // shards if self.combine == "tree" else 1, self.combine)

        def forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            w = _local(mod.weight)
            if replicated:
                w = take_rows(w, lo, hi, ranks, owners)
            y = _ColwiseGemm.apply(x.reshape(-1, K), w, how)
            return y.reshape(*x.shape[:-1], hi - lo)

        module.forward = types.MethodType(forward, module)
        module._opcontract_tp = dict(
            style="colwise", shards=shards, rows=(lo, hi), segments=S, combine=self.combine
        )
        return module


class StrictRowwiseParallel(_Strict):
    """Input features sharded over the mesh (the input arrives sharded: the previous
    column-parallel layer's output); the output replicated on every rank."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_linear(module, "StrictRowwiseParallel")
        ranks = Ranks.of(device_mesh)
        t, S = ranks.size, self.segments
        N, K = module.weight.shape
        if K % S or S % t:
            raise ParallelPlanError(
                f"row-parallel over {t} ranks: the {K} input features must split into {S} "
                f"segments, and {S} into the ranks"
            )
        cols = K // t
        lo, hi = ranks.rank * cols, (ranks.rank + 1) * cols
        module.weight = _param(module.weight.detach()[:, lo:hi].clone(), device_mesh, Shard(1))
        op = dispatch.op("segmented_gemm", backend=self.backend)
        combine = self.combine

        def forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            w = _local(mod.weight)
            flat = x.reshape(-1, cols)
            if combine == "tree":
                acc = tree_combine(op(flat, w, segments=S // t), ranks)
            else:
                acc = all_reduce(op(flat, w), ranks)
            return acc.to(x.dtype).reshape(*x.shape[:-1], N)

        module.forward = types.MethodType(forward, module)
        module._opcontract_tp = dict(style="rowwise", cols=(lo, hi), segments=S, combine=combine)
        return module


class StrictVocabParallelEmbedding(ParallelStyle):
    """Muse Glimmer's normalized embedding with its table's rows sharded (``torch.chunk``
    sizes, so any vocabulary). Each rank looks up the tokens it owns through
    ``normalized_embedding`` (a row's gradient then sums the same tokens in the same order as
    on one rank), the ranks' rows are gathered and each token takes its owner's: no add."""

    def __init__(self, *, backend: str | None = None) -> None:
        self.backend = backend

    def __repr__(self) -> str:
        return "StrictVocabParallelEmbedding()"

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or not hasattr(module, "embed_norm"):
            raise ParallelPlanError(
                f"StrictVocabParallelEmbedding: expected Muse Glimmer's normalized embedding, "
                f"got {type(module).__name__}"
            )
        ranks = Ranks.of(device_mesh)
        full = module.weight.detach()
        V, H = full.shape
        size = -(-V // ranks.size)
        lo, hi = min(V, ranks.rank * size), min(V, (ranks.rank + 1) * size)
        module.weight = _param(full[lo:hi].clone(), device_mesh, Shard(0), full)
        op = dispatch.op("normalized_embedding", backend=self.backend)

        def forward(mod: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
            flat = input_ids.reshape(-1)
            bad = (flat < 0) | (flat >= V)
            if bool(bad.any()):
                raise ValueError(
                    f"input_ids: {int(bad.sum())} ids outside the vocabulary [0, {V}), e.g. "
                    f"{int(flat[bad][0])}"
                )
            idx = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)
            mine = op(flat[idx] - lo, _local(mod.weight), eps=mod.embed_norm.eps)
            rows = mine.new_zeros(flat.shape[0], H).index_put((idx,), mine)
            y = gather_partials(rows, ranks)[flat // size, torch.arange(flat.shape[0])]
            if mod.padding_idx is not None and torch.is_grad_enabled() and y.requires_grad:
                pad = (flat == mod.padding_idx)[:, None]  # as the unsharded patch: no gradient
                y = torch.where(pad, y.detach(), y)
            return y.reshape(*input_ids.shape, H)

        module.forward = types.MethodType(forward, module)
        module._opcontract_tp = dict(style="vocab_embedding", rows=(lo, hi))
        return module
