"""The vocabulary-parallel head's entropy and argmax: each slice's vocab_slice_stats partials
(max, sum, sum exp(z - max) z; the slice's argmax) merged by the top of one adjacent-pair
tree give the same bits at every number of slices; without ranks, the slices are called
one by one here (the gloo tests run them on ranks)."""

from __future__ import annotations

import pytest
import torch

from opcontract import dispatch
from opcontract.backends.fixed_order import adjacent_tree_merge, merge_argmax, merge_max_sum

SEGMENTS, V, H, T = 8, 8 * 40, 24, 11
KW = dict(multiplier=0.3, softcap=20.0)


def _slices(hidden, weight, t: int):
    """(entropy, argmax) from ``t`` slices of the vocabulary, merged as the head merges."""
    op = dispatch.op("vocab_slice_stats")
    none = torch.full((hidden.shape[0],), -1, dtype=torch.long)
    rows = V // t
    stats = [op(hidden, weight[r * rows : (r + 1) * rows], none, segments=SEGMENTS // t,
                return_entropy=True, return_predicted=True, **KW) for r in range(t)]  # fmt: skip
    m, s, w = adjacent_tree_merge([(x.row_max, x.row_sumexp, x.row_zsum) for x in stats])
    lse = m + torch.log(s.double()).float()
    pred = adjacent_tree_merge(
        [(x.row_max, x.predicted + r * rows) for r, x in enumerate(stats)], merge_argmax
    )[1]
    return lse - w / s, pred


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_entropy_and_argmax_are_the_same_bits_at_every_degree(dtype):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    lead = hidden.float().mean(dim=0)
    weight[37] = weight[250] = (4.0 * lead / lead.norm()).to(dtype)  # a tie across slices
    one = _slices(hidden, weight, 1)
    assert (one[1] == 37).any() and not (one[1] == 250).any()  # the lower index wins
    for t in (2, 4, 8):
        ent, pred = _slices(hidden, weight, t)
        assert torch.equal(ent, one[0]), t
        assert torch.equal(pred, one[1]), t
    z = (hidden.double() @ weight.double().T) * KW["multiplier"]
    z = KW["softcap"] * torch.tanh(z / KW["softcap"])
    p = torch.softmax(z, dim=1)
    want = -(p * torch.log(p)).sum(dim=1)
    assert float((one[0].double() - want).norm() / want.norm()) < 1e-5
    assert torch.equal(one[1], z.argmax(dim=1))


def test_merge_carries_extra_sums_with_the_sum_factors():
    a = (torch.tensor([1.0, 3.0]), torch.tensor([2.0, 5.0]), torch.tensor([0.5, -1.0]))
    b = (torch.tensor([2.0, 1.0]), torch.tensor([4.0, 1.5]), torch.tensor([1.5, 2.0]))
    m, s, w = merge_max_sum(a, b)
    m2, s2 = merge_max_sum(a[:2], b[:2])
    assert torch.equal(m, m2) and torch.equal(s, s2)  # the (max, sum) bits are unchanged
    fa, fb = torch.exp((a[0] - m).double()).float(), torch.exp((b[0] - m).double()).float()
    assert torch.allclose(w, a[2] * fa + b[2] * fb)


def test_argmax_merge_keeps_the_lower_index_on_ties():
    a = (torch.tensor([2.0, 1.0, 3.0]), torch.tensor([4, 5, 6]))
    b = (torch.tensor([2.0, 1.5, 1.0]), torch.tensor([40, 50, 60]))
    m, i = merge_argmax(a, b)
    assert m.tolist() == [2.0, 1.5, 3.0] and i.tolist() == [4, 50, 6]


def test_entropy_gradient_through_the_vocabulary_parallel_head_raises():
    from opcontract.parallel.collectives import Ranks
    from opcontract.parallel.head import VocabParallelHead

    head = VocabParallelHead(Ranks(None, 0, 1), 0, V, SEGMENTS, 0.3, 20.0, None)
    hidden = torch.randn(T, H, requires_grad=True)
    weight = torch.randn(V, H) * 0.5
    ent, pred = head.head_outputs(hidden, weight, True, True)
    assert ent.shape == (T,) and pred.dtype == torch.int64
    with pytest.raises(NotImplementedError, match="entropy's gradient through a vocabulary"):
        ent.sum().backward()
