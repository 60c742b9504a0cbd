"""vocab_slice_stats and vocab_slice_grad in plain torch: the float64 oracles and the strict
paths, built from softcap_logprob's strict blocks (the same logits, the same block merges),
each segment of the slice from its own start, the segments met by an adjacent-pair tree."""

from __future__ import annotations

import torch

from opcontract.backends.fixed_order import (
    adjacent_tree_merge,
    adjacent_tree_sum,
    merge_argmax,
)
from opcontract.backends.torch.softcap_logprob import _rows_backward, block_walk, logits64


def _dz64(hidden, weight, multiplier, softcap):
    y = (hidden.double() @ weight.double().T) * multiplier
    if softcap is None:
        return torch.full_like(y, multiplier)
    return multiplier * (1.0 - torch.tanh(y / softcap) ** 2)


def reference_stats(hidden, weight, targets, *, multiplier=1.0, softcap=None, segments=1,
                    return_entropy=False, return_predicted=False):  # fmt: skip
    from opcontract.outputs import SliceStatsOutput

    z = logits64(hidden, weight, multiplier, softcap)
    t = targets.long()
    m = z.max(dim=1).values if z.shape[1] else z.new_full((z.shape[0],), -torch.inf)
    e = torch.exp(z - m[:, None])
    s = e.sum(dim=1)
    here = t >= 0
    zt = torch.where(here, z.gather(1, torch.where(here, t, 0)[:, None])[:, 0], 0.0)
    w = (e * z).sum(dim=1) if return_entropy else None
    pred = z.argmax(dim=1) if return_predicted else None  # the first of the maxima
    return SliceStatsOutput(m, s, zt, w, pred)


def reference_grad(hidden, weight, targets, lse, grad_logprob, *, multiplier=1.0,
                   softcap=None, segments=1):  # fmt: skip
    from opcontract.outputs import SliceGradOutput

    z = logits64(hidden, weight, multiplier, softcap)
    p = torch.exp(z - lse.double()[:, None])
    onehot = (torch.arange(z.shape[1])[None, :] == targets.long()[:, None]).double()
    g = grad_logprob.double()[:, None] * (onehot - p) * _dz64(hidden, weight, multiplier, softcap)
    return SliceGradOutput(g @ weight.double(), g.T @ hidden.double())


def _segment_stats(h32, weight, t, multiplier, softcap):
    """(max, sum, target logit or 0, sum exp(z - max) z, argmax) of one segment:
    softcap_logprob's vocab_lse, vocab_entropy and vocab_argmax walks."""
    w = block_walk(h32, weight, t, multiplier, softcap)
    return w.max, w.sum, w.z_target, w.zsum, (w.arg_max, w.arg_idx)


def stats_forward(config, hidden, weight, targets, *, multiplier, softcap, segments,
                  return_entropy=False, return_predicted=False):  # fmt: skip
    V = weight.shape[0]
    width = V // segments
    h32, t = hidden.float(), targets.long()
    parts, zts, args = [], [], []
    for s in range(segments):
        lo = s * width
        local = torch.where((t >= lo) & (t < lo + width), t - lo, -1)
        m, ssum, zt, w, (am, ai) = _segment_stats(h32, weight[lo : lo + width], local,
                                                  multiplier, softcap)  # fmt: skip
        parts.append((m, ssum, w) if return_entropy else (m, ssum))
        zts.append(zt)
        args.append((am, ai + lo))
    merged = adjacent_tree_merge(parts)
    zsum = merged[2] if return_entropy else None
    pred = adjacent_tree_merge(args, merge_argmax)[1] if return_predicted else None
    zt = adjacent_tree_sum(torch.stack(zts))  # one segment holds a target: exact
    return merged[0], merged[1], zt, zsum, pred


def grad_forward(config, hidden, weight, targets, lse, grad_logprob, *, multiplier, softcap,
                 segments):  # fmt: skip
    V, H = weight.shape
    width = V // segments
    h32, t = hidden.float(), targets.long()
    gl = grad_logprob.float()
    grad_w = torch.zeros(V, H, dtype=weight.dtype, device=weight.device)
    parts = []
    for s in range(segments):
        lo = s * width
        local = torch.where((t >= lo) & (t < lo + width), t - lo, -1)
        gw = grad_w[lo : lo + width]
        parts.append(
            _rows_backward(h32, weight[lo : lo + width], local, lse.float(), None, gl, None, None,
                           hidden.dtype, multiplier, softcap, grad_w=gw, buffer=False,
                           need_hidden=True)
        )  # fmt: skip
    return adjacent_tree_sum(torch.stack(parts)), grad_w
