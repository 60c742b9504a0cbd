"""generate(cache_implementation="static") on a patched model: OpcontractStaticCache, the
same bits as the dynamic OpcontractKVCache and as a training forward, eager and under
torch.compile (one graph for every decode step and for the next call), and its bad input."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import CompileConfig  # noqa: E402

from opcontract.integrations.tiny import left_padded, tiny_muse_glimmer  # noqa: E402
from opcontract.integrations.transformers import (  # noqa: E402
    OpcontractPatchError,
    OpcontractStaticCache,
    apply_opcontract,
    generate_with_logprobs,
    token_logprobs,
)

LENS = [2, 7, 4, 5]
NEW = 8


def compiled(fullgraph: bool = True) -> CompileConfig:
    """generate()'s compile config for the CPU: the graph without Inductor's code generation
    (CUDA graphs, mode "reduce-overhead", are the GPU test's)."""
    cc = CompileConfig(backend="aot_eager", fullgraph=fullgraph, mode=None)
    cc._compile_all_devices = True  # generate() compiles only on accelerators otherwise
    return cc


def rollout(model, ids, mask, seed: int = 0, **kw):
    torch.manual_seed(seed)
    return generate_with_logprobs(model, ids, mask, max_new_tokens=NEW, **kw)


def training(model, ro, width: int) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model, ro.sequences, ro.attention_mask)[:, width - 1 :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_static_cache_gives_the_dynamic_caches_and_trainings_bits(dtype, sample):
    model = apply_opcontract(tiny_muse_glimmer(dtype), backend="torch")
    ids, mask = left_padded(LENS)
    dynamic = rollout(model, ids, mask, do_sample=sample)
    static = rollout(model, ids, mask, do_sample=sample, cache_implementation="static")
    assert isinstance(model._opcontract_static_cache, OpcontractStaticCache)
    assert torch.equal(static.sequences, dynamic.sequences)
    differ = int((static.logprobs != dynamic.logprobs).sum())
    assert differ == 0, f"{differ} of {static.logprobs.numel()} log-probs differ"
    train = training(model, static, ids.shape[1])
    assert int((static.logprobs != train).sum()) == 0


def test_compiled_static_decode_is_one_graph_with_the_eager_bits():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = apply_opcontract(tiny_muse_glimmer(torch.bfloat16), backend="torch")
    ids, mask = left_padded(LENS)
    eager = rollout(model, ids, mask, do_sample=True, cache_implementation="static")
    cache = model._opcontract_static_cache
    ro = rollout(model, ids, mask, do_sample=True, cache_implementation="static",
                 compile_config=compiled())  # fmt: skip
    assert counters["stats"]["unique_graphs"] == 1  # fullgraph: no break, no recompile
    assert torch.equal(ro.sequences, eager.sequences)
    assert torch.equal(ro.logprobs, eager.logprobs)
    assert torch.equal(ro.logprobs, training(model, ro, ids.shape[1]))
    # another batch of prompts of other widths: the same cache, the same graph
    ids2, mask2 = left_padded([3, 9, 1, 6], seed=5)
    ro2 = rollout(model, ids2, mask2, seed=1, do_sample=True, cache_implementation="static",
                  compile_config=compiled())  # fmt: skip
    assert model._opcontract_static_cache is cache
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(ro2.logprobs, training(model, ro2, ids2.shape[1]))
    # the comparison sees a change: another prompt's first token moves the bits
    assert not torch.equal(ro2.logprobs[:, 0], ro.logprobs[:, 0])


def test_a_batch_of_other_size_gets_a_new_cache():
    model = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    ids, mask = left_padded(LENS)
    rollout(model, ids, mask, cache_implementation="static")
    first = model._opcontract_static_cache
    rollout(model, ids, mask, cache_implementation="static")
    assert model._opcontract_static_cache is first  # emptied and reused
    one = rollout(model, ids[1:2], mask[1:2], cache_implementation="static")
    assert model._opcontract_static_cache is not first
    assert model._opcontract_static_cache.batch_size == 1
    assert torch.equal(one.logprobs, training(model, one, ids.shape[1]))


def test_a_chunked_prefill_then_decode_by_hand():
    """Steps of several new columns (a prompt in two chunks, one of them padded), then
    one-token steps without a mask: the training forward's log-probs at every position."""
    model = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    ids, mask = left_padded(LENS)
    cache = OpcontractStaticCache(model.config, batch_size=len(LENS), max_cache_len=40,
                                  device="cpu", dtype=torch.float32, backend="torch")  # fmt: skip
    logits = []
    with torch.no_grad():
        for a, b in ((0, 6), (6, ids.shape[1])):  # padding inside, each row real at the end
            out = model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache)
        seq, full = ids, mask
        for _ in range(3):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            logits.append(out.logits[:, -1].gather(-1, nxt)[:, 0] - out.lse[:, -1])
            seq = torch.cat([seq, nxt], dim=1)
            full = torch.cat([full, torch.ones_like(nxt)], dim=1)
            out = model(input_ids=nxt, past_key_values=cache)
        lp = torch.stack(logits, dim=1)
        train = token_logprobs(model, seq, full)[:, ids.shape[1] - 1 :]
    assert torch.equal(lp, train)
    assert cache.get_seq_length() == seq.shape[1]  # every column stepped, padding included
    assert cache.lengths.tolist() == [n + 3 for n in LENS]  # real tokens only


def test_eager_and_compiled_steps_share_one_cache():
    """Eager steps keep a host copy of the lengths (their index inputs on the host); a
    compiled step moves only the device copy, and the next eager step reads it back. Steps
    of both kinds in turn: the training log-probs."""
    torch._dynamo.reset()
    model = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    ids, mask = left_padded(LENS)
    cache = _cache(model, length=40)
    compiled_model = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        assert cache._host_len == LENS
        seq, full, lps = ids, mask, []
        for fn in (compiled_model, compiled_model, model, compiled_model, model):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            lps.append(out.logits[:, -1].gather(-1, nxt)[:, 0] - out.lse[:, -1])
            seq = torch.cat([seq, nxt], dim=1)
            full = torch.cat([full, torch.ones_like(nxt)], dim=1)
            out = fn(input_ids=nxt, past_key_values=cache)
            host = cache._host_len
            assert (host is None) == (fn is compiled_model)
            assert host is None or host == cache.lengths.tolist()
        train = token_logprobs(model, seq, full)[:, ids.shape[1] - 1 :]
    assert torch.equal(torch.stack(lps, dim=1), train)
    assert cache.get_seq_length() == full.shape[1]


def _cache(model, B: int = 4, length: int = 16) -> OpcontractStaticCache:
    return OpcontractStaticCache(model.config, batch_size=B, max_cache_len=length,
                                 device="cpu", dtype=torch.float32, backend="torch")  # fmt: skip


def test_static_cache_bad_input():
    model = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    ids, mask = left_padded(LENS)
    with torch.no_grad():
        with pytest.raises(ValueError, match="holds 3 sequences, got a batch of 4"):
            model(input_ids=ids, attention_mask=mask, past_key_values=_cache(model, B=3))
        with pytest.raises(ValueError, match="holds 128 positions a sequence"):
            long = torch.randint(3, 90, (4, 130))
            model(input_ids=long, past_key_values=_cache(model))
        cache = _cache(model)
        right = mask.flip(1)
        with pytest.raises(ValueError, match=r"attention_mask: rows \[0, 2, 3\] are not left"):
            model(input_ids=ids, attention_mask=right, past_key_values=cache)
        with pytest.raises(ValueError, match="labels with a KV cache"):
            model(input_ids=ids, attention_mask=mask, labels=ids, past_key_values=cache)
        with pytest.raises(ValueError, match="position_ids given disagree"):
            model(input_ids=ids, attention_mask=mask, past_key_values=cache,
                  position_ids=torch.arange(ids.shape[1])[None])  # fmt: skip
        assert cache.get_seq_length() == 0  # nothing above stepped the cache
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        with pytest.raises(ValueError, match="real tokens before the new columns"):
            m = torch.cat([mask, torch.ones(4, 1, dtype=mask.dtype)], dim=1)
            m[0, :-1] = 0
            model(input_ids=ids[:, :1], attention_mask=m, past_key_values=cache)
        with pytest.raises(OpcontractPatchError, match="written only by opcontract"):
            cache.update(None, None, 0)
    with pytest.raises(OpcontractPatchError, match="'offloaded'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2,
                       cache_implementation="offloaded")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hidden", [32, 512])
def test_static_decode_under_cuda_graphs_gives_the_eager_bits(hidden):
    """generate()'s own compile on a GPU (Inductor, "reduce-overhead": CUDA graphs), default
    dispatch (Triton): the bits of the eager dynamic cache and of training. Hidden 512: the
    projections' K spans two gemm_k blocks, so a decode step's GEMMs sum parallel partials
    with arrival counters, which must not be kept from the graph's warm-up (its pool)."""
    model = apply_opcontract(tiny_muse_glimmer(torch.bfloat16, hidden=hidden).cuda())
    ids, mask = (t.cuda() for t in left_padded(LENS))
    eager = rollout(model, ids, mask, do_sample=True)
    for _ in range(2):  # the first call compiles and records; the second replays
        ro = rollout(model, ids, mask, do_sample=True, cache_implementation="static")
        assert torch.equal(ro.sequences, eager.sequences)
        assert torch.equal(ro.logprobs, eager.logprobs)
        assert torch.equal(ro.logprobs, training(model, ro, ids.shape[1]))


def test_compiled_static_decode_with_the_triton_ops_is_one_graph():
    """The Triton ops (the interpreter on the CPU): their eager fast path keeps per-signature
    state that a traced call must not read (dynamo would guard on it and trace again when an
    eager prefill changed it). Two calls with prompts of other widths: one graph, and the
    training bits."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = apply_opcontract(tiny_muse_glimmer(torch.bfloat16), backend="triton")
    for seed, lens in ((1, [2, 5]), (2, [6, 3])):
        ids, mask = left_padded(lens, seed=seed)
        torch.manual_seed(seed)
        ro = generate_with_logprobs(model, ids, mask, max_new_tokens=3, do_sample=True,
                                    cache_implementation="static",
                                    compile_config=compiled())  # fmt: skip
        with torch.no_grad():
            train = token_logprobs(model, ro.sequences, ro.attention_mask, backend="triton")
        assert torch.equal(ro.logprobs, train[:, ids.shape[1] - 1 :])
    assert counters["stats"]["unique_graphs"] == 1
