"""A vocabulary-parallel LM head for selected-token log-probabilities and the sampler.

Each rank holds a contiguous slice of the head's rows (``segments / t`` of its fixed
vocabulary segments). Forward: ``vocab_slice_stats`` gives each rank's (max, sum, target
logit) partials, gathered and merged by the top of the same adjacent-pair tree every rank
runs, so lse and log-probs are the one-rank bits. Backward: ``vocab_slice_grad`` given that
lse, each rank's float32 grad_hidden partial tree-combined, then the one rounding; each
rank's grad_weight is its slice's. The sampler's logits are the slices' float32 logits
gathered (no add), with the same lse: ``logits[y] - lse`` is the trainer's log-prob.
"""

from __future__ import annotations

import torch

from opcontract import dispatch
from opcontract.backends.fixed_order import adjacent_tree_merge, adjacent_tree_sum, merge_argmax
from opcontract.parallel.collectives import Ranks, _all_gather


def _log(x: torch.Tensor) -> torch.Tensor:  # float64, rounded once (softcap_logprob's lse)
    return torch.log(x.double()).float()


class VocabParallelHead:
    """The head's math over this rank's slice [lo, hi) of the vocabulary."""

    def __init__(self, ranks: Ranks, lo: int, hi: int, segments: int, multiplier: float,
                 softcap: float | None, backend: str | None) -> None:  # fmt: skip
        self.ranks, self.lo, self.hi, self.segments = ranks, lo, hi, segments
        self.kw = dict(multiplier=multiplier, softcap=softcap)
        self.stats = dispatch.op("vocab_slice_stats", backend=backend)
        self.grad = dispatch.op("vocab_slice_grad", backend=backend)
        self.logits_op = dispatch.op("softcap_logits", backend=backend)

    def local_targets(self, targets: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        t = targets.long()
        return torch.where(keep & (t >= self.lo) & (t < self.hi), t - self.lo, -1)

    def lse_and_target(self, hidden, weight, local) -> tuple[torch.Tensor, torch.Tensor]:
        st = self.stats(hidden, weight, local, segments=self.segments, **self.kw)
        parts = _all_gather(torch.stack([st.row_max, st.row_sumexp, st.target_logit]), self.ranks)
        m, s = adjacent_tree_merge([(p[0], p[1]) for p in parts])
        return m + _log(s), adjacent_tree_sum(torch.stack([p[2] for p in parts]))

    def entropy_and_argmax(self, hidden, weight, entropy: bool, predicted: bool):
        """(entropy [T] | None, argmax over the whole vocabulary [T] | None): each slice's
        (max, sum, sum exp(z - max) z) merged by the tree's top as the lse is, entropy =
        lse - zsum / sum (softcap_logprob's form); the argmax the lowest slice's among the
        largest maxima, at its index."""
        st = self.stats(hidden, weight, torch.full_like(hidden[:, 0], -1, dtype=torch.long),
                        segments=self.segments, return_entropy=entropy,
                        return_predicted=predicted, **self.kw)  # fmt: skip
        ent = pred = maxima = None
        if entropy:
            parts = _all_gather(torch.stack([st.row_max, st.row_sumexp, st.row_zsum]), self.ranks)
            m, s, w = adjacent_tree_merge([tuple(p) for p in parts])
            ent = (m + _log(s)) - w / s
            maxima = [p[0] for p in parts]
        if predicted:
            maxima = maxima or _all_gather(st.row_max, self.ranks)
            where = _all_gather(st.predicted + self.lo, self.ranks)
            pred = adjacent_tree_merge(list(zip(maxima, where, strict=True)), merge_argmax)[1]
        return ent, pred

    def logprob(self, hidden, weight, targets, ignore_index: int = -100) -> torch.Tensor:
        return _Logprob.apply(hidden, weight, targets, self, ignore_index)

    def head_outputs(self, hidden, weight, entropy: bool, predicted: bool):
        """(entropy, predicted) of ``entropy_and_argmax``; the entropy carries no gradient
        here: a loss that differentiates it raises in backward (not served yet)."""
        with torch.no_grad():
            ent, pred = self.entropy_and_argmax(hidden, weight, entropy, predicted)
        if ent is not None and hidden.requires_grad:
            ent = _NoEntropyGrad.apply(ent, hidden)
        return ent, pred

    def logits(self, hidden, weight) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits [T, V] gathered from the slices, lse [T]) for T <= 256 rows."""
        with torch.no_grad():
            mine = self.logits_op(hidden, weight, **self.kw).logits
            full = torch.cat(_all_gather(mine, self.ranks), dim=1)
            none = torch.full((hidden.shape[0],), -1, dtype=torch.long, device=hidden.device)
            lse, _ = self.lse_and_target(hidden, weight, none)
        return full, lse


class _NoEntropyGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entropy, hidden):
        return entropy.clone()

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError(
            "the entropy's gradient through a vocabulary-parallel head is not served yet; "
            "detach it, or parallelize with head='replicate'"
        )


class _Logprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, head: VocabParallelHead, ignore_index: int):
        keep = targets.long() != ignore_index
        local = head.local_targets(targets, keep)
        with torch.no_grad():
            lse, zt = head.lse_and_target(hidden, weight, local)
        ctx.save_for_backward(hidden, weight, local, lse, keep)
        ctx.head = head
        return torch.where(keep, zt - lse, 0.0)

    @staticmethod
    def backward(ctx, g):
        hidden, weight, local, lse, keep = ctx.saved_tensors
        head = ctx.head
        gl = torch.where(keep, g.float(), 0.0)
        with torch.no_grad():
            r = head.grad(hidden, weight, local, lse, gl, segments=head.segments, **head.kw)
            gh = adjacent_tree_sum(torch.stack(_all_gather(r.grad_hidden, head.ranks)))
        return gh.to(hidden.dtype), r.grad_weight, None, None, None
