"""Tensor parallelism on real torch.distributed (gloo, CPU processes): the tiny Muse Glimmer
at the real layer schedule, log-probs and every gradient at TP 2 and 4 equal to one rank,
bitwise; the collective's own all-reduce as the negative control."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from opcontract.parallel import selfcheck  # noqa: E402
from opcontract.parallel.selfcheck import mismatches  # noqa: E402
from opcontract.parallel.trace import first_difference  # noqa: E402


def run(world: int, tmp_path, dtype=torch.float32, **kw) -> list[dict]:
    results = selfcheck.run(world, str(tmp_path), dtype, **kw)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise AssertionError(f"ranks failed: {errors}")
    return results


@pytest.fixture(scope="module")
def one_rank():
    return {dt: selfcheck.step(None, dt) for dt in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("world, kv_policy", [(2, "split"), (4, "replicate")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tp_degree_gives_the_one_rank_bits(world, kv_policy, dtype, one_rank, tmp_path):
    results = run(world, tmp_path, dtype, kv_policy=kv_policy)
    ref = one_rank[dtype]
    assert len(ref["grads"]) > 20  # every layer's projections, norms, embedding, head
    for r, res in enumerate(results):
        assert mismatches(res, ref) == {}, f"rank {r}"
        assert first_difference(res["trace"], ref["trace"]) is None
        assert len(res["trace"]) > 30  # embedding, norms, attention, MLP, layers
        p = res["provenance"]
        assert (p["degree"], p["rank"], p["segments"]) == (world, r, 8)
        assert p["kv_policy"] == kv_policy and p["reduction_form"].startswith("segmented_gemm")
        shapes = res["local_shapes"]  # tiny: 4 query heads, 2 KV heads of 8, intermediate 48
        assert shapes["model.language_model.layers.0.self_attn.q_proj.weight"] == (32 // world, 32)
        assert shapes["model.language_model.layers.0.mlp.down_proj.weight"] == (32, 48 // world)
        kv = (16 // world, 32) if kv_policy == "split" else (16, 32)  # replicate: both heads
        assert shapes["model.language_model.layers.0.self_attn.k_proj.weight"] == kv
        size = -(-97 // world)  # the vocabulary's rows in torch.chunk sizes
        rows = min(97, (r + 1) * size) - min(97, r * size)
        assert shapes["model.language_model.embed_tokens.weight"] == (rows, 32)
        assert p["kv_replica_group"] == ([r] if world <= 2 else [r // 2 * 2, r // 2 * 2 + 1])


def test_tp8_gives_the_one_rank_bits(tmp_path):
    """TP 8 on the tiny model with 8 query heads: one query head a rank, each KV head
    replicated by a group of 4 ranks; every rank holds the one-rank bits."""
    ref = selfcheck.step(None, torch.float32, heads=8)
    for r, res in enumerate(run(8, tmp_path, torch.float32, kv_policy="replicate", heads=8)):
        assert mismatches(res, ref) == {}, f"rank {r}"
        p = res["provenance"]
        assert (p["degree"], p["kv_shards"]) == (8, 2)
        assert p["kv_replica_group"] == list(range(r // 4 * 4, r // 4 * 4 + 4))
        shapes = res["local_shapes"]
        assert shapes["model.language_model.layers.0.self_attn.q_proj.weight"] == (8, 32)
        assert shapes["model.language_model.layers.0.self_attn.k_proj.weight"] == (16, 32)
        assert shapes["model.language_model.layers.0.mlp.down_proj.weight"] == (32, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sharded_rollout_equals_training_at_every_degree(dtype, tmp_path):
    """A rollout engine at TP 2 (generate with the KV cache) and a trainer at TP 1 give every
    completion token the same log-prob, bitwise; so does each degree with itself."""
    one = selfcheck.rollout(None, dtype)
    assert one["rollout"].shape == (3, 6) and bool((one["rollout"] < 0).all())
    assert torch.equal(one["rollout"], one["train"])
    for r, res in enumerate(run(2, tmp_path, dtype, what="rollout")):
        assert torch.equal(res["sequences"], one["sequences"]), f"rank {r}"
        assert torch.equal(res["rollout"], one["train"]), f"rank {r}"
        assert torch.equal(res["train"], one["train"]), f"rank {r}"


@pytest.mark.parametrize(
    "world, kv_policy, dtype",
    [(2, "split", torch.float32), (4, "replicate", torch.float32), (2, "split", torch.bfloat16)],
    ids=["tp2-fp32", "tp4-fp32", "tp2-bf16"],
)
def test_vocab_parallel_head_gives_the_one_rank_bits(world, kv_policy, dtype, tmp_path):
    """The LM head's rows sharded too (head="vocab", a vocabulary of 104 = 8 segments of 13):
    loss, log-probs, entropy, argmax and every gradient, the head's included, equal one
    rank's."""
    ref = selfcheck.step(None, dtype, vocab=104, head="vocab")
    plain = selfcheck.step(None, dtype, vocab=104)
    assert mismatches(ref, plain)  # the segmented head is its own arithmetic
    for r, res in enumerate(run(world, tmp_path, dtype, vocab=104, head="vocab",
                                kv_policy=kv_policy)):  # fmt: skip
        assert mismatches(res, ref) == {}, f"rank {r}"  # entropy and argmax included
        assert res["entropy"].shape == res["predicted"].shape == (3 * 8,)
        assert res["local_shapes"]["lm_head.weight"] == (104 // world, 32)
        assert res["provenance"]["head"] == "vocab"


def test_sharded_rollout_with_the_static_cache(tmp_path):
    """generate(cache_implementation="static") at TP 2: each rank's static cache holds its
    share of the KV heads (made at the first step), and the completions and their log-probs
    are the one-rank training bits."""
    one = selfcheck.rollout(None, torch.float32)
    for r, res in enumerate(run(2, tmp_path, what="rollout", cache_implementation="static")):
        assert torch.equal(res["sequences"], one["sequences"]), f"rank {r}"
        assert torch.equal(res["rollout"], one["train"]), f"rank {r}"


def test_vocab_parallel_rollout_equals_training(tmp_path):
    one = selfcheck.rollout(None, torch.bfloat16, vocab=104, head="vocab")
    assert torch.equal(one["rollout"], one["train"])
    for res in run(2, tmp_path, torch.bfloat16, what="rollout", vocab=104, head="vocab"):
        assert torch.equal(res["sequences"], one["sequences"])
        assert torch.equal(res["rollout"], one["train"])


def test_all_reduce_control_differs(tmp_path):
    """Stock tensor parallelism (each rank's partial in sequential order, summed by the
    collective) against the unsharded patched model: the bits move."""
    ref = selfcheck.step(None, torch.float32, shard=False)
    res = run(2, tmp_path, torch.float32, combine="all_reduce")[0]
    bad = mismatches(res, ref)
    assert "logprobs" in bad and any(k.endswith("o_proj.weight") for k in bad), bad
    # the activation trace names the first op where the runs part: the first combine
    i, name = first_difference(res["trace"], ref["trace"])
    assert name == "model.language_model.layers.0.self_attn.o_proj", (i, name)
    assert res["trace"][:i] == ref["trace"][:i] and i > 0


def _errors(world, tmp_path, **kw) -> list[str]:
    return [r.get("error", "") for r in selfcheck.run(world, str(tmp_path), **kw)]


@pytest.mark.parametrize(
    "world, kw, says",
    [
        (4, {}, "exceeds the 2 KV heads: pass kv_policy='replicate'"),
        (2, {"segments": 1}, "degree 2 exceeds segments=1"),
        (2, {"kv_policy": "mirror"}, "kv_policy must be one of"),
        (2, {"fake_version_rank": 1}, "ranks disagree on opcontract's version"),
        (2, {"head": "vocab"}, "the vocabulary of 97 does not split into segments=8"),
    ],
)
def test_bad_plans_fail_on_every_rank(world, kw, says, tmp_path):
    errors = _errors(world, tmp_path, **kw)
    assert all("ParallelPlanError" in e and says in e for e in errors), errors


def test_degree_must_divide_the_heads():
    from opcontract.integrations.tiny import tiny_muse_glimmer
    from opcontract.parallel.muse_glimmer import _check
    from opcontract.parallel.styles import ParallelPlanError

    text = tiny_muse_glimmer().config.text_config  # 4 query heads, 2 KV heads
    with pytest.raises(ParallelPlanError, match="does not divide the 4 query heads"):
        _check(text, 8, 8, "replicate")
    assert _check(text, 4, 8, "replicate") == 2 and _check(text, 2, 8, "split") == 2
