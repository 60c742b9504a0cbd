"""apply_opcontract on a tiny random Muse Glimmer (real transformers classes, built here).

Train = rollout: each greedy token's log-prob from ``generate()`` (left-padded batch of mixed
prompt lengths, with the KV cache; ``output_logits`` -> log_softmax) against the same token's
log-prob from one training forward over the finished sequences, ``torch.equal`` per token.
Measured on the CPU (torch 2.13, transformers 5.23), 4 prompts of 2/7/4/5 tokens, 6 new
tokens each (24 tokens):

| model | float32 | bfloat16 |
| --- | --- | --- |
| patched, batch 4 and each prompt alone | 0 / 24 | 0 / 24 |
| stock (DynamicCache, sdpa), batch 4 | 19 / 24 (max 1.9e-6) | 24 / 24 (max 4.4e-2) |

The stock counts are a negative control (asserted > 0: the comparison can see a difference).
Against the stock model in float64 (the oracle, positions from the mask), the patched float32
model's logits on real tokens sit at a relative error of 9.3e-7 (stock float32: 7.0e-7), the
bfloat16 model's at 1.6e-2 (stock bfloat16: 2.4e-2); asserted below 4e-6 and 2e-2, and the
same for the ``labels`` loss.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    DynamicCache,
    MuseGlimmerConfig,
    MuseGlimmerForConditionalGeneration,
)

from opcontract.integrations.transformers import (  # noqa: E402
    OpcontractKVCache,
    OpcontractPatchError,
    apply_opcontract,
    is_patched,
    positions_from_mask,
    token_logprobs,
)

VOCAB, NEW = 97, 6
LENS = [2, 7, 4, 5]  # prompt lengths, left-padded to 7


def tiny(dtype: torch.dtype = torch.float32, seed: int = 0) -> MuseGlimmerForConditionalGeneration:
    """4 layers (3 local with a window of 4, 1 global NoPE), GQA 4/2, head_dim 8. The norm
    weights are redrawn (the stock init sets them all to 1)."""
    torch.manual_seed(seed)
    text = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
        pad_token_id=0, eos_token_id=None, bos_token_id=1, max_position_embeddings=128,
    )  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    cfg = MuseGlimmerConfig(
        text_config=text, vision_config=vision, out_hidden_size=16, projector_hidden_size=16
    )
    model = MuseGlimmerForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if "layernorm" in name:
                p.normal_(0.0, 0.3)
            elif name == "norm.weight":
                p.normal_(1.0, 0.3)
        model.lm_head.weight.normal_(0.0, 1.0)
    return model.to(dtype)


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    L = max(LENS)
    ids = torch.zeros(len(LENS), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(LENS):
        ids[b, L - n :] = torch.randint(2, VOCAB, (n,), generator=g)
        mask[b, L - n :] = 1
    return ids, mask


def rollout_and_train(model, ids, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rollout log-probs, training log-probs) of the greedy tokens, each [B, NEW], and the
    rollout's logits [B, NEW, V]."""
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip
    seq, P = out.sequences, ids.shape[1]
    full = torch.cat([mask, torch.ones(len(ids), NEW, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        train = model(seq, attention_mask=full).logits[:, P - 1 : -1]
    logits = torch.stack(out.logits, dim=1)
    y = seq[:, P:, None]
    ro = logits.float().log_softmax(-1).gather(-1, y)[..., 0]
    tr = train.float().log_softmax(-1).gather(-1, y)[..., 0]
    return ro, tr, logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_train_equals_rollout(dtype):
    ids, mask = prompts()
    model = apply_opcontract(tiny(dtype), backend="torch")
    ro, tr, _ = rollout_and_train(model, ids, mask)
    assert int((ro != tr).sum()) == 0, f"{int((ro != tr).sum())} of {ro.numel()} tokens differ"
    for b in range(len(LENS)):  # batch 1 (still left-padded): the same bits as in the batch
        ro1, tr1, _ = rollout_and_train(model, ids[b : b + 1], mask[b : b + 1])
        assert torch.equal(ro1, tr1)
        assert torch.equal(ro1[0], ro[b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stock_model_mismatches(dtype):
    """Negative control: the same comparison on the unpatched model sees differences."""
    ids, mask = prompts()
    ro, tr, _ = rollout_and_train(tiny(dtype), ids, mask)
    mismatches = int((ro != tr).sum())
    print(f"stock {dtype}: {mismatches} of {ro.numel()} tokens differ")
    assert mismatches > 0


def test_generate_uses_the_opcontract_cache_and_token_logprobs_agree():
    ids, mask = prompts()
    model = apply_opcontract(tiny(), backend="torch")
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
        return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip
    cache = out.past_key_values
    assert isinstance(cache, OpcontractKVCache)
    assert cache.get_seq_length() == ids.shape[1] + NEW - 1  # the last token is never fed
    # each sequence holds its real tokens only, at positions 0 .. n - 1
    assert cache.paged[0].lengths.tolist() == [n + NEW - 1 for n in LENS]
    # the trainer's per-token log-probs (softcap_logprob) do not depend on the batch
    full = torch.cat([mask, torch.ones(len(ids), NEW, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        lp = token_logprobs(model, out.sequences, full, backend="torch")
        for b in range(len(LENS)):
            lp1 = token_logprobs(model, out.sequences[b : b + 1], full[b : b + 1], backend="torch")
            assert torch.equal(lp1[0], lp[b])
    assert bool((lp[:, ids.shape[1] - 1 :] < 0).all())


def test_state_dict_unchanged_and_idempotent():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_opcontract(model) is model
    assert is_patched(model)
    forward = model.forward
    assert apply_opcontract(model) is model and model.forward is forward
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the vision tower is not patched: none of its modules has an instance forward
    assert not any("forward" in vars(m) for m in model.model.vision_tower.modules())
    assert model.config.vision_config._attn_implementation != "opcontract"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 4e-6), (torch.bfloat16, 2e-2)])
def test_parity_with_stock_float64(dtype, tol):
    """Relative error of the logits on real tokens against the stock model in float64."""
    ids, mask = prompts()
    pid = positions_from_mask(mask).clamp(min=0)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        ref = tiny().double()(ids, attention_mask=mask, position_ids=pid, labels=labels)
    model = apply_opcontract(tiny(dtype), backend="torch").train()
    got = model(ids, attention_mask=mask, labels=labels, skip_logits=False)
    real = mask.bool()
    diff = got.logits.detach().double() - ref.logits
    err = float(diff[real].norm() / ref.logits[real].norm())
    loss_err = abs(got.loss.item() - ref.loss.item()) / ref.loss.item()
    print(f"patched {dtype}: logits {err:.2e}, loss {loss_err:.2e} relative to stock float64")
    assert err < tol and loss_err < tol
    got.loss.backward()  # the training path has a backward through every op
    grads = [p.grad for p in model.model.language_model.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)


def _unpatched(model) -> bool:
    return not is_patched(model) and not any("forward" in vars(m) for m in model.modules())


def test_fail_closed_unknown_class():
    model = tiny()
    with pytest.raises(OpcontractPatchError, match="MuseGlimmerForConditionalGeneration"):
        apply_opcontract(model.model)
    assert _unpatched(model)


def test_fail_closed_missing_module():
    model = tiny()
    del model.model.language_model.layers[3].self_attn.gate_proj
    with pytest.raises(OpcontractPatchError, match=r"layers\.3\.self_attn\.gate_proj"):
        apply_opcontract(model)
    assert _unpatched(model)  # layers 0-2 were fine, and still nothing was patched


def test_fail_closed_rope_on_a_global_layer():
    model = tiny()
    model.config.text_config.layer_rope_theta[3] = 10000.0
    with pytest.raises(OpcontractPatchError, match="layer_rope_theta"):
        apply_opcontract(model)
    assert _unpatched(model)


def test_fail_closed_at_call_time():
    ids, mask = prompts()
    model = apply_opcontract(tiny(), backend="torch")
    with pytest.raises(OpcontractPatchError, match="DynamicCache"):
        model(ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1])[None])
    with pytest.raises(OpcontractPatchError, match="cache_implementation"):
        model.generate(
            ids, attention_mask=mask, max_new_tokens=1, cache_implementation="sliding_window"
        )


def test_train_equals_rollout_across_a_key_block_and_eviction():
    """A row that crosses the 128-position key block (and page) boundary while generating; the
    local layers' cache frees its first page (window 4) and the bits stay the training's."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, VOCAB, (2, 125), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :122] = 0  # the second prompt has 3 tokens
    ids[mask == 0] = 0
    model = apply_opcontract(tiny(), backend="torch")
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip
    local = out.past_key_values.paged[0]
    assert local.layer == "local" and local.pages_evicted >= 1
    full = torch.cat([mask, torch.ones(2, 8, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        train = model(out.sequences, attention_mask=full).logits[:, 124:-1]
    assert torch.equal(torch.stack(out.logits, dim=1), train)
