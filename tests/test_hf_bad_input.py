"""Bad input to the patched Muse Glimmer (issue 19): patching twice, patching after moving
the dtype, labels all -100, attention masks with holes or right padding at generation,
``logits_to_keep`` with labels. Each gives the correct result or a clear error naming the
argument; never a silently unpatched module.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")

from opcontract.errors import ContractViolation  # noqa: E402
from opcontract.integrations import trl as oc_trl  # noqa: E402
from opcontract.integrations.tiny import left_padded, tiny_muse_glimmer  # noqa: E402
from opcontract.integrations.transformers import (  # noqa: E402
    OpcontractPatchError,
    apply_opcontract,
    is_patched,
    patched_backend,
    token_logprobs,
)

LENS = [3, 6]


def patched(dtype=torch.float32):
    return apply_opcontract(tiny_muse_glimmer(dtype), backend="torch")


def instance_forwards(model) -> dict[str, object]:
    return {n: vars(m)["forward"] for n, m in model.named_modules() if "forward" in vars(m)}


# -- patching twice -------------------------------------------------------------------------


def test_patching_twice_changes_nothing():
    model = patched()
    before = instance_forwards(model)
    assert len(before) > 50  # every text-path module carries an instance forward
    assert apply_opcontract(model, backend="torch") is model
    assert instance_forwards(model) == before


def test_patching_twice_with_another_backend_raises():
    model = patched()
    before = instance_forwards(model)
    with pytest.raises(OpcontractPatchError, match="backend=None.*backend='torch'"):
        apply_opcontract(model)
    assert instance_forwards(model) == before and patched_backend(model) == "torch"


def test_enable_then_patch_again_keeps_the_trl_head():
    model = patched()
    oc_trl.install_head(model)
    head = model.forward
    assert apply_opcontract(model, backend="torch") is model and model.forward is head
    assert oc_trl.is_enabled(model)


# -- patching after moving the dtype (the device: one CPU here) -----------------------------


def test_dtype_moves_before_or_after_patching_give_the_same_bits():
    ids, mask = left_padded(LENS)
    moved_after = apply_opcontract(tiny_muse_glimmer(), backend="torch").to(torch.bfloat16)
    moved_before = apply_opcontract(tiny_muse_glimmer().to(torch.bfloat16), backend="torch")
    with torch.no_grad():
        after = token_logprobs(moved_after, ids, mask)
        assert torch.equal(after, token_logprobs(moved_before, ids, mask))
        assert torch.equal(after, token_logprobs(patched(torch.bfloat16), ids, mask))
        assert not torch.equal(after, token_logprobs(patched(), ids, mask))  # bits did move
        # and back to float32: the bf16-rounded weights, as a model patched after both moves
        back = token_logprobs(moved_after.float(), ids, mask)
        ref = apply_opcontract(tiny_muse_glimmer().to(torch.bfloat16).float(), backend="torch")
        assert torch.equal(back, token_logprobs(ref, ids, mask))


def test_float64_after_patching_is_refused_naming_the_dtype():
    model = patched().double()
    ids, mask = left_padded(LENS)
    with pytest.raises(ContractViolation, match="float64"):
        model(input_ids=ids, attention_mask=mask)
    assert is_patched(model)


# -- labels all -100 --------------------------------------------------------------------------


def test_labels_all_ignored_give_a_zero_loss_with_a_backward():
    ids, mask = left_padded(LENS)
    labels = torch.full_like(ids, -100)
    model = patched().train()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.loss.item() == 0.0
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(bool((g == 0).all()) for g in grads)


def test_fused_head_with_labels_all_ignored():
    ids, mask = left_padded(LENS)
    model = oc_trl.install_head(patched().train())
    out = model(input_ids=ids, attention_mask=mask, labels=torch.full_like(ids, -100),
                fused_lm_head=True)  # fmt: skip
    assert out.loss.item() == 0.0 and not bool(out.label_mask.any())
    for t in (out.log_probs, out.entropy):
        assert t.shape == (len(LENS), ids.shape[1] - 1) and bool((t == 0).all())
    assert not bool(out.is_top1.any())
    out.loss.backward()  # an all-ignored micro-batch still has a (zero) backward
    assert all(bool((p.grad == 0).all()) for p in model.parameters() if p.grad is not None)


# -- attention masks with holes, right padding at generation ---------------------------------


def test_mask_with_a_hole_in_training_is_refused_naming_the_mask():
    ids, mask = left_padded(LENS)
    mask[1, 2] = 0  # row 1: real, padding, real
    model = patched()
    with pytest.raises(ContractViolation, match="attention_mask.*hole"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ContractViolation, match="attention_mask"):
        token_logprobs(model, ids, mask)


@pytest.mark.parametrize("layout", ["hole", "right-padded"])
def test_generation_from_a_mask_that_is_not_left_padded_is_refused(layout):
    ids, mask = left_padded(LENS)
    if layout == "hole":
        mask[1, 2] = 0
        rows = [1]
    else:  # row 0 has 3 real tokens of 6: move them to the front
        ids[0] = torch.cat([ids[0, 3:], ids[0, :3]])
        mask[0] = torch.tensor([1, 1, 1, 0, 0, 0])
        rows = [0]
    model = patched()
    with pytest.raises(ValueError, match=re.escape(f"attention_mask: rows {rows} are not left")):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_right_padding_in_training_is_correct():
    """Right padding (TRL's SFT collator) is fine for a training forward: each row's
    log-probs are those of the same row left-padded, bitwise."""
    ids, mask = left_padded(LENS)
    right_ids, right_mask = ids.clone(), mask.clone()
    right_ids[0] = torch.cat([ids[0, 3:], ids[0, :3]])
    right_mask[0] = torch.tensor([1, 1, 1, 0, 0, 0])
    model = patched()
    with torch.no_grad():
        left = token_logprobs(model, ids, mask)
        right = token_logprobs(model, right_ids, right_mask)
    assert torch.equal(right[0, :2], left[0, 3:])
    assert torch.equal(right[1], left[1])


# -- logits_to_keep with labels ---------------------------------------------------------------


def test_logits_to_keep_with_labels_is_refused_naming_it():
    ids, mask = left_padded(LENS)
    labels = ids.masked_fill(mask == 0, -100)
    model = patched()
    with pytest.raises(ValueError, match="logits_to_keep=2 with labels"):
        model(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=2)
    oc_trl.install_head(model)
    with pytest.raises(ValueError, match="logits_to_keep with fused_lm_head=True"):
        model(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=2,
              fused_lm_head=True)  # fmt: skip


def test_logits_to_keep_alone_keeps_the_last_positions_bitwise():
    ids, mask = left_padded(LENS)
    model = patched()
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask)
        last = model(input_ids=ids, attention_mask=mask, logits_to_keep=2)
    assert torch.equal(last.logits, full.logits[:, -2:])
    assert torch.equal(last.lse, full.lse[:, -2:])


def test_packed_rows_without_a_mask_are_read_as_their_sequences():
    """TRL's padding-free packing hands position ids that restart within a row and no mask:
    each run is its own sequence (never silently one), through the plain forward and the
    fused head alike (tests/test_hf_packed.py has the rest); with a KV cache they are refused
    naming position_ids; position ids that agree (0 .. L - 1) give the same bits."""
    ids, _ = left_padded([8], seed=2)
    model = oc_trl.install_head(patched())
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    labels = ids.clone()
    labels[packed == 0] = -100
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=packed).logits
        fused = model(input_ids=ids, position_ids=packed, labels=labels, fused_lm_head=True)
        for a, b in ((0, 3), (3, 8)):
            assert torch.equal(logits[:, a:b], model(input_ids=ids[:, a:b]).logits)
            want = token_logprobs(model, ids[:, a:b])
            assert torch.equal(fused.log_probs[:, a : b - 1], want)
    with pytest.raises(ValueError, match="position_ids"):
        model(input_ids=ids, position_ids=packed, use_cache=True)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        same = model(input_ids=ids, position_ids=torch.arange(8)[None]).logits
    assert torch.equal(plain, same)
