"""Parity of the patched tiny Muse Glimmer (TRL's fused_lm_head=True path on opcontract's ops)
with the stock model run in float64 on the same weights: loss, per-token log-probs and
entropy, token accuracy, and every parameter's gradient (opcontract.integrations.parity).

Tolerances (the measured values are in docs/transformers.md, from
benchmarks/results/hf_parity_cpu.json; the stock model in the same dtype sits at about the
same distance from float64):

| | float32 | bfloat16 |
| --- | --- | --- |
| loss, abs | 1e-6 | 1e-2 |
| log_probs, entropy: max abs | 2e-5 | 0.2 |
| tokens whose top-1 differs from float64's | 0 | 2 |
| each gradient: max abs diff / max abs of float64's | 5e-5 | 0.35 |
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")

from opcontract.integrations.parity import parity  # noqa: E402
from opcontract.integrations.tiny import PAD, left_padded, tiny_muse_glimmer  # noqa: E402
from opcontract.integrations.transformers import apply_opcontract  # noqa: E402

TOL = {
    torch.float32: dict(loss=1e-6, per_token=2e-5, top1=0, grad=5e-5),
    torch.bfloat16: dict(loss=1e-2, per_token=0.2, top1=2, grad=0.35),
}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts and the model's own greedy continuations."""
    ids, mask = left_padded([2, 6, 3], seed=11)
    model = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    with torch.no_grad():
        ids = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    return ids, torch.cat([mask, torch.ones(3, 6, dtype=mask.dtype)], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_with_stock_float64(dtype):
    ids, mask = batch()
    r = parity(tiny_muse_glimmer, ids, mask, dtype=dtype, backend="torch")
    tol = TOL[dtype]
    n_params = sum(1 for n, _ in tiny_muse_glimmer().named_parameters()
                   if n.startswith("model.language_model.") or n == "lm_head.weight")  # fmt: skip
    assert len(r["grad"]) == n_params  # every text-path parameter and the head
    assert r["loss"]["max_abs_diff"] <= tol["loss"]
    assert r["log_probs"]["max_abs_diff"] <= tol["per_token"]
    assert r["entropy"]["max_abs_diff"] <= tol["per_token"]
    assert r["token_accuracy"]["top1_disagreements"] <= tol["top1"]
    assert 0.0 < r["token_accuracy"]["ref_value"] < 1.0
    worst = {k: v["max_abs_diff"] / v["ref_max_abs"] for k, v in r["grad"].items()}
    bad = {k: f"{v:.2e}" for k, v in worst.items() if v > tol["grad"]}
    assert not bad, bad
    print(f"{dtype}: worst gradient {max(worst.values()):.2e}, log_probs "
          f"{r['log_probs']['max_abs_diff']:.2e}")  # fmt: skip


def test_padding_row_of_the_embedding_gets_no_gradient():
    """nn.Embedding's padding_idx, as in the stock model: the pad row (zeros) gets no
    gradient, although the first real token of a left-padded row is predicted from a padding
    position (and the weightless norm's gradient at a zero row is ~1/sqrt(eps))."""
    ids, mask = left_padded([2, 5], seed=3)
    labels = ids.masked_fill(mask == 0, -100)
    model = apply_opcontract(tiny_muse_glimmer(), backend="torch").train()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    emb = model.model.language_model.embed_tokens
    assert emb.padding_idx == PAD
    assert bool((emb.weight.grad[PAD] == 0).all())
    read = ids[:, :-1][mask[:, :-1].bool()]  # real tokens some later token depends on
    assert bool((emb.weight.grad[read].abs().sum(-1) > 0).all())


def test_gradient_checkpointing_gives_the_same_gradients_bitwise():
    ids, mask = left_padded([3, 7], seed=4)
    labels = ids.masked_fill(mask == 0, -100)
    grads, calls = [], []
    for ckpt in (False, True):
        model = apply_opcontract(tiny_muse_glimmer(), backend="torch").train()
        if ckpt:
            model.gradient_checkpointing_enable({"use_reentrant": False})
            for layer in model.model.language_model.layers:  # count the checkpointed calls
                f = layer._gradient_checkpointing_func
                layer._gradient_checkpointing_func = lambda *a, f=f, **k: (calls.append(1),
                                                                         f(*a, **k))[1]  # fmt: skip
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert len(calls) == 4  # each of the 4 patched layers checkpointed itself
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
