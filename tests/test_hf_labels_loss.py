"""The patched model's ``labels`` path: the loss through linear_cross_entropy without
[B, S, V] logits, ``return_token_accuracy``, ``skip_logits``; against the stock model in
float64 (tiny random Muse Glimmer, real transformers classes, the CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from opcontract.integrations import transformers as hf  # noqa: E402
from opcontract.integrations.tiny import left_padded, tiny_muse_glimmer  # noqa: E402

LENS = [3, 9, 5, 7]


def batch():
    ids, mask = left_padded(LENS, seed=5)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def stock_float64(ids, mask, labels):
    """Loss and token accuracy of the unpatched model in float64 (positions from the mask)."""
    pid = hf.positions_from_mask(mask).clamp(min=0)
    with torch.no_grad():
        out = tiny_muse_glimmer().double()(ids, attention_mask=mask, position_ids=pid,
                                           labels=labels)  # fmt: skip
    tgt = labels[:, 1:]
    kept = tgt != -100
    hits = (out.logits[:, :-1].argmax(-1) == tgt) & kept
    return out.loss, hits.sum() / kept.sum()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_training_with_labels_gives_loss_and_accuracy_without_logits(backend, monkeypatch):
    ids, mask, labels = batch()
    model = hf.apply_opcontract(tiny_muse_glimmer(), backend=backend).train()

    def no_logits(*args, **kwargs):
        raise AssertionError("the labels path must not build [B, S, V] logits")

    monkeypatch.setattr(hf, "_head", no_logits)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, return_token_accuracy=True)
    assert out.logits is None and out.lse is None
    ref_loss, ref_acc = stock_float64(ids, mask, labels)
    assert abs(out.loss.item() - ref_loss.item()) / ref_loss.item() < 4e-6
    assert out.token_accuracy.item() == pytest.approx(ref_acc.item(), abs=1e-7)
    out.loss.backward()
    grads = [p.grad for p in model.model.language_model.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    assert model.lm_head.weight.grad is not None


def test_eval_returns_logits_and_the_same_loss_bits():
    ids, mask, labels = batch()
    model = hf.apply_opcontract(tiny_muse_glimmer(), backend="torch")
    train = model.train()(input_ids=ids, attention_mask=mask, labels=labels)
    ev = model.eval()(input_ids=ids, attention_mask=mask, labels=labels)
    assert train.logits is None and ev.logits is not None
    assert ev.logits.shape == (*ids.shape, model.config.text_config.vocab_size)
    assert torch.equal(train.loss, ev.loss)
    assert ev.token_accuracy is None  # not asked


def test_skip_logits_overrides_the_default():
    ids, mask, labels = batch()
    model = hf.apply_opcontract(tiny_muse_glimmer(), backend="torch")
    assert model.train()(input_ids=ids, attention_mask=mask, labels=labels,
                         skip_logits=False).logits is not None  # fmt: skip
    assert model.eval()(input_ids=ids, attention_mask=mask, skip_logits=True).logits is None


def test_num_items_in_batch_divides_the_same_sum():
    ids, mask, labels = batch()
    model = hf.apply_opcontract(tiny_muse_glimmer(), backend="torch").train()
    mean = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    kept = int((labels[:, 1:] != -100).sum())
    assert torch.equal(model(input_ids=ids, attention_mask=mask, labels=labels,
                             num_items_in_batch=kept).loss, mean)  # fmt: skip
    twice = model(input_ids=ids, attention_mask=mask, labels=labels,
                  num_items_in_batch=2 * kept).loss  # fmt: skip
    assert abs(twice.item() * 2 - mean.item()) <= 1e-6 * abs(mean.item())


def test_token_accuracy_without_labels_is_an_error():
    ids, mask, _ = batch()
    model = hf.apply_opcontract(tiny_muse_glimmer(), backend="torch")
    with pytest.raises(ValueError, match="return_token_accuracy"):
        model(input_ids=ids, attention_mask=mask, return_token_accuracy=True)
