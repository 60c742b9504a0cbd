"""Context parallelism that keeps the bits: every training sequence cut into contiguous
chunks, one per rank, and every log-prob and gradient equal to one rank's, bitwise.

Every rank is given the whole batch (ids, mask, labels) and embeds it; right after the
embedding each rank keeps rows ``[lo, hi)`` of the sequence dimension and runs the decoder
layers on them; the last layer's output is gathered back to the whole sequence, so the
final norm, the LM head and the loss run on the same rows, in the same calls, as on one
rank. Attention
gathers the chunks' queries, keys, values and gate (an all-gather moves bits, it adds
nothing) and runs the one-rank call, keeping its own rows.

What a chunk cannot compute alone is a sum over the sequence: a weight's gradient (the
contracts add 256-row blocks of tokens in order, and a chunk of every row of a padded batch
is not a run of blocks) and attention's dK / dV (over every later query). So a layer's
backward gathers its input and its output gradient and runs the one-rank backward of the
whole sequence on every rank: the same ops on the same rows, hence the same bits; the rank
keeps its rows of the input gradient, and every rank holds the full weight gradients (as
after a data-parallel all-reduce, without one). The forward is split; the backward is that
of one rank, on every rank (``provenance`` says so). ``combine="all_reduce"`` is the
negative control: layers differentiated on their own chunk, the weight gradients and the
gathered keys' gradients summed by the collective, as stock context parallelism does.

PyTorch's own ``torch.distributed.tensor.experimental.context_parallel`` does not serve
here: it replaces ``scaled_dot_product_attention`` with ring attention, whose merge of
partial softmaxes across ranks is its own order, and this model does not call SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from opcontract.parallel.collectives import Ranks, _all_gather
from opcontract.parallel.styles import COMBINES, ParallelPlanError

_STATE = "_opcontract_cp"
_PROVENANCE = "_opcontract_context_parallel"


@dataclass
class ContextState:
    """A model's context-parallel place: the ranks, the combine, and whether the chunked
    forward is on (off while a layer's backward reruns the whole sequence)."""

    ranks: Ranks
    combine: str
    active: bool = True
    length: int = 0  # the whole sequence's, set as the embedding's output is split

    def chunk(self, length: int) -> int:
        """Rows per rank of a sequence of ``length``: ceil(length / degree)."""
        return -(-length // self.ranks.size)

    def bounds(self, length: int) -> tuple[int, int]:
        """This rank's rows [lo, hi) of a sequence of ``length``: chunks of ``chunk``, the
        last one shorter (or empty)."""
        size = self.chunk(length)
        lo = min(length, self.ranks.rank * size)
        return lo, min(length, lo + size)

    def rows(self, length: int, local: int) -> slice:
        """Where a call's ``local`` rows sit in a mask of ``length`` columns."""
        if not self.active or local == length:
            return slice(length - local, length)
        lo, hi = self.bounds(length)
        if hi - lo != local:
            raise ParallelPlanError(
                f"context parallel: {local} rows in this call, but rank {self.ranks.rank}'s "
                f"chunk of {length} is {hi - lo}"
            )
        return slice(lo, hi)


def _gather_rows(t: torch.Tensor, cp: ContextState, length: int) -> torch.Tensor:
    """Every rank's chunk of dim 1, in rank order: the whole sequence (padded chunks trimmed)."""
    pad = cp.chunk(length) - t.shape[1]
    if pad:
        t = torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1)
    return torch.cat(_all_gather(t, cp.ranks), dim=1)[:, :length]


class _Shard(torch.autograd.Function):
    """Rows [lo, hi) of the whole sequence. Backward: the ranks' gradients gathered into the
    whole sequence's (the layers' backward makes them equal to one rank's)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cp: ContextState) -> torch.Tensor:
        ctx.cp = cp
        cp.length = n = t.shape[1]
        size, last = cp.chunk(n), cp.ranks.size - 1
        if last and last * size >= n:  # the last rank gets no rows: every rank sees this
            raise ParallelPlanError(
                f"context parallel: a sequence of {n} leaves rank {last} of {cp.ranks.size} "
                f"no rows (chunks of {size}); pad the batch to at least {last * size + 1} "
                "columns"
            )
        lo, hi = cp.bounds(n)
        return t[:, lo:hi]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _gather_rows(g.contiguous(), ctx.cp, ctx.cp.length), None


class _Gather(torch.autograd.Function):
    """The whole sequence from the ranks' chunks. Backward: this rank's rows of the gradient,
    which every rank computes alike (what reads the gathered tensor runs on every rank);
    ``reduce``: the ranks' partial gradients summed by the collective first (the control)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cp: ContextState, length: int, reduce: bool):
        ctx.cp, ctx.length, ctx.reduce = cp, length, reduce
        return _gather_rows(t, cp, length)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.reduce:
            g = g.contiguous().clone()
            dist.all_reduce(g, group=ctx.cp.ranks.group)
        lo, hi = ctx.cp.bounds(ctx.length)
        return g[:, lo:hi], None, None, None


class _LayerOnWholeSequence(torch.autograd.Function):
    """A decoder layer on this rank's chunk; its backward is one rank's backward of the whole
    sequence (input and output gradient gathered), this rank keeping its rows of dx."""

    @staticmethod
    def forward(ctx, h, cp, run, kw, *params):
        ctx.save_for_backward(h)
        ctx.cp, ctx.run, ctx.kw, ctx.length = cp, run, kw, kw["attention_mask"].shape[1]
        ctx.params = params
        return run(h, **kw)

    @staticmethod
    def backward(ctx, g):
        (h,) = ctx.saved_tensors
        cp, n = ctx.cp, ctx.length
        params = [p for p in ctx.params if p.requires_grad]
        h_all, g_all = _gather_rows(h, cp, n), _gather_rows(g.contiguous(), cp, n)
        cp.active = False
        try:
            with torch.enable_grad():
                leaf = h_all.detach().requires_grad_()
                out = ctx.run(leaf, **ctx.kw)
                grads = torch.autograd.grad(out, [leaf, *params], g_all, allow_unused=True)
        finally:
            cp.active = True
        lo, hi = cp.bounds(n)
        by_param = dict(zip(map(id, params), grads[1:], strict=True))
        dparams = [by_param.get(id(p)) for p in ctx.params]
        return grads[0][:, lo:hi], None, None, None, *dparams


def _layer_forward(layer: nn.Module, cp: ContextState):
    run = layer.forward  # the patched instance forward

    def forward(hidden_states: torch.Tensor, **kw: Any) -> torch.Tensor:
        if cp.active and kw.get("past_key_values") is not None:
            raise ParallelPlanError("context parallel serves training forwards, not a KV cache")
        if cp.active and kw.get("attention_mask") is None:
            raise ParallelPlanError("context parallel needs the attention_mask of the batch")
        if not cp.active or cp.combine == "all_reduce":
            return run(hidden_states, **kw)
        return _LayerOnWholeSequence.apply(hidden_states, cp, run, kw, *run.__self__.parameters())

    return forward


def _attention(cp: ContextState):
    from opcontract import attention as _attn

    def call(q, k, v, gate, mask, **kw):
        n = mask.shape[1]
        if not cp.active or q.shape[1] == n:
            return _attn.padded(q, k, v, gate, mask, **kw)
        reduce = cp.combine == "all_reduce"
        whole = [_Gather.apply(t.contiguous(), cp, n, reduce) for t in (q, k, v, gate)]
        lo, hi = cp.bounds(n)
        return _attn.padded(*whole, mask, **kw)[:, lo:hi]

    return call


def _reduce_grads(model: nn.Module, cp: ContextState) -> None:
    """The negative control: each layer weight's gradient summed over ranks by the collective."""

    def hook(p: torch.Tensor) -> None:
        dist.all_reduce(p.grad, group=cp.ranks.group)

    for layer in model.model.language_model.layers:
        for p in layer.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)


def context_parallel_muse_glimmer(model: nn.Module, mesh, *, combine: str = "tree") -> nn.Module:
    """Split a patched Muse Glimmer's training sequences over a 1-D ``DeviceMesh`` (see the
    module docstring). Call the model with the whole batch on every rank; the loss, the
    log-probs and every gradient are one rank's, bitwise, on every rank."""
    from opcontract.integrations.transformers import is_patched
    from opcontract.parallel.muse_glimmer import _agree, _fingerprint

    if not is_patched(model):
        raise ParallelPlanError("context parallel needs a model patched by apply_opcontract")
    if getattr(model, _PROVENANCE, None) is not None:
        raise ParallelPlanError("the model is already context-parallel")
    if getattr(model, "_opcontract_parallel", None) is not None:
        raise ParallelPlanError("context parallel on a tensor-parallel model is not served yet")
    if combine not in COMBINES:
        raise ParallelPlanError(f"combine must be one of {COMBINES}, got {combine!r}")
    ranks = Ranks.of(mesh)
    _agree(ranks)
    cp = ContextState(ranks, combine)
    text = model.model.language_model
    text.embed_tokens.register_forward_hook(lambda m, a, out: _Shard.apply(out, cp))
    text.norm.register_forward_pre_hook(  # the final norm and the head: the whole sequence
        lambda m, a: (_Gather.apply(a[0], cp, cp.length, False), *a[1:]) if cp.active else None
    )
    for layer in text.layers:
        layer.forward = _layer_forward(layer, cp)
        object.__setattr__(layer.self_attn, _STATE, cp)
        layer.self_attn._opcontract_attention = _attention(cp)
    if combine == "all_reduce" and ranks.group is not None:
        _reduce_grads(model, cp)
    object.__setattr__(model, _STATE, cp)
    object.__setattr__(model, _PROVENANCE, dict(
        degree=ranks.size, rank=ranks.rank, combine=combine,
        chunks="contiguous rows of each sequence, ceil(L / degree) per rank",
        forward="decoder layers on the rank's chunk; attention on the gathered sequence",
        backward=("each layer's one-rank backward of the gathered sequence, on every rank"
                  if combine == "tree" else "the chunk's own, summed by the collective (control)"),
        head="the gathered sequence, on every rank", fingerprint=_fingerprint(),
    ))  # fmt: skip
    return model


def provenance(model: nn.Module) -> dict[str, Any]:
    """How the model's sequences are split (degree, rank, the forward's and backward's form)."""
    p = getattr(model, _PROVENANCE, None)
    if p is None:
        raise ParallelPlanError("the model is not context-parallel")
    return dict(p)
