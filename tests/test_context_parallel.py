"""Context parallelism on real torch.distributed (gloo, CPU processes): the tiny Muse Glimmer
at the real layer schedule, its sequences split over 2 ranks, the loss, the log-probs and
every gradient equal to one rank's, bitwise; the collective's own sums as the negative
control."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from opcontract.parallel import selfcheck  # noqa: E402
from opcontract.parallel.collectives import Ranks  # noqa: E402
from opcontract.parallel.context import ContextState, context_parallel_muse_glimmer  # noqa: E402
from opcontract.parallel.selfcheck import mismatches  # noqa: E402
from opcontract.parallel.styles import ParallelPlanError  # noqa: E402
from opcontract.parallel.trace import first_difference  # noqa: E402


def run(world: int, tmp_path, dtype, **kw) -> list[dict]:
    results = selfcheck.run(world, str(tmp_path), dtype, context=True, **kw)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise AssertionError(f"ranks failed: {errors}")
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cp2_gives_the_one_rank_bits(dtype, tmp_path):
    one = selfcheck.step(None, dtype, shard=False)  # the unsharded patched model
    assert len(one["grads"]) > 20
    for r, res in enumerate(run(2, tmp_path, dtype)):
        assert mismatches(res, one) == {}, f"rank {r}"
        assert first_difference(res["trace"], one["trace"]) is None  # chunks gathered
        assert len(res["trace"]) == len(one["trace"]) > 30
        p = res["provenance"]
        assert (p["degree"], p["rank"], p["combine"]) == (2, r, "tree")
        assert "one-rank backward" in p["backward"]


def test_cp4_gives_the_one_rank_bits(tmp_path):
    """Four chunks of a 13-column batch (4, 4, 4, 1 rows): the one-rank bits on every rank."""
    lengths = [7, 5, 13]
    one = selfcheck.step(None, torch.float32, shard=False, lengths=lengths)
    for r, res in enumerate(run(4, tmp_path, torch.float32, lengths=lengths)):
        assert mismatches(res, one) == {}, f"rank {r}"
        assert res["provenance"]["degree"] == 4


def test_a_rank_left_without_rows_is_refused():
    """9 columns over 4 ranks leave the last none: refused, on every rank alike (each
    computes every rank's chunk), before any collective."""
    from opcontract.parallel.context import _Shard

    for rank in range(4):
        cp = ContextState(Ranks(None, rank, 4), "tree")
        with pytest.raises(ParallelPlanError, match="leaves rank 3 of 4 no rows.*at least 10"):
            _Shard.apply(torch.zeros(1, 9, 2), cp)
    cp = ContextState(Ranks(None, 3, 4), "tree")
    assert _Shard.apply(torch.zeros(1, 10, 2), cp).shape == (1, 1, 2)


def test_cp_collective_sums_differ(tmp_path):
    """Stock context parallelism (each chunk's weight gradients and gathered keys' gradients
    summed by the collective): the forward's bits stay, the gradients' move."""
    one = selfcheck.step(None, torch.float32, shard=False)
    res = run(2, tmp_path, torch.float32, combine="all_reduce")[0]
    bad = mismatches(res, one)
    assert "loss" not in bad and "logprobs" not in bad  # the forward is the one rank's
    assert any(k.endswith("o_proj.weight") for k in bad) and len(bad) > 20, bad


def test_one_rank_context_parallel_is_the_plain_model():
    one = selfcheck.step(None, torch.float32, shard=False)
    assert mismatches(selfcheck.step(None, torch.float32, context=True), one) == {}


@pytest.mark.parametrize("size, rank, length, want", [
    (2, 0, 9, (0, 5)), (2, 1, 9, (5, 9)), (3, 2, 7, (6, 7)), (4, 3, 9, (9, 9)), (1, 0, 4, (0, 4)),
])  # fmt: skip
def test_chunks_are_contiguous_and_cover_the_sequence(size, rank, length, want):
    cp = ContextState(Ranks(None, rank, size), "tree")
    assert cp.bounds(length) == want
    lo, hi = want
    assert cp.rows(length, hi - lo) == slice(lo, hi)
    assert cp.rows(length, length) == slice(0, length)  # a whole-sequence call (backward)
    cp.active = False
    assert cp.rows(length + 3, 3) == slice(length, length + 3)  # as without context parallel


def test_a_chunk_of_the_wrong_size_is_refused():
    cp = ContextState(Ranks(None, 0, 2), "tree")
    with pytest.raises(ParallelPlanError, match="3 rows in this call, but rank 0's chunk of 9"):
        cp.rows(9, 3)


def test_bad_models_are_refused():
    from opcontract.integrations.tiny import tiny_muse_glimmer
    from opcontract.integrations.transformers import apply_opcontract
    from opcontract.parallel import parallelize_muse_glimmer

    with pytest.raises(ParallelPlanError, match="patched by apply_opcontract"):
        context_parallel_muse_glimmer(tiny_muse_glimmer(), None)
    m = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    with pytest.raises(ParallelPlanError, match="combine must be one of"):
        context_parallel_muse_glimmer(m, None, combine="ring")
    context_parallel_muse_glimmer(m, None)
    with pytest.raises(ParallelPlanError, match="already context-parallel"):
        context_parallel_muse_glimmer(m, None)
    tp = parallelize_muse_glimmer(apply_opcontract(tiny_muse_glimmer(), backend="torch"), None)
    with pytest.raises(ParallelPlanError, match="tensor-parallel model is not served"):
        context_parallel_muse_glimmer(tp, None)


def test_calls_context_parallel_cannot_split_are_refused():
    from opcontract.integrations.tiny import left_padded, tiny_muse_glimmer
    from opcontract.integrations.transformers import OpcontractKVCache, apply_opcontract

    m = context_parallel_muse_glimmer(apply_opcontract(tiny_muse_glimmer(), backend="torch"), None)
    ids, mask = left_padded([5, 3])
    with pytest.raises(ParallelPlanError, match="needs the attention_mask"):
        m(input_ids=ids)
    with pytest.raises(ParallelPlanError, match="not a KV cache"):
        m(input_ids=ids, attention_mask=mask, past_key_values=OpcontractKVCache(m.config))
