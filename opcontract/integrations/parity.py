"""Parity of a patched Muse Glimmer with the unpatched model run in float64.

>>> report = parity(lambda: MuseGlimmerForConditionalGeneration.from_pretrained(path),
...                 input_ids, attention_mask, dtype=torch.bfloat16)

One training step's worth of quantities, on the same weights (the model's, in ``dtype``; the
oracle is the stock model with those weights cast to float64, positions from the mask):

- ``loss``: the mean next-token loss over labelled tokens;
- ``log_probs``, ``entropy``: per labelled token;
- ``token_accuracy``: the fraction of labelled tokens whose argmax is the label, and how many
  tokens' argmax differs from the oracle's;
- ``grad/<parameter>``: every parameter's gradient of that loss (the text path and the LM
  head; the vision tower takes no part in a text forward and has none).

The patched side is what TRL trains through: ``model(..., labels=..., fused_lm_head=True)``
on opcontract's head (:func:`opcontract.integrations.trl.install_head`). Each entry holds the
max and mean absolute difference and the max absolute value of the oracle.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from opcontract.integrations.transformers import apply_opcontract, positions_from_mask


def _stats(got: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (got.double() - ref.double()).abs()
    return {
        "max_abs_diff": float(d.max()) if d.numel() else 0.0,
        "mean_abs_diff": float(d.mean()) if d.numel() else 0.0,
        "ref_max_abs": float(ref.double().abs().max()) if ref.numel() else 0.0,
        "n": int(d.numel()),
    }


def _oracle(model: nn.Module, ids, mask, labels) -> dict:
    """The stock model in float64: logits -> log_softmax in float64 (transformers' own loss
    upcasts to float32 only, so it is computed here)."""
    pid = positions_from_mask(mask).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pid).logits[:, :-1]
    tgt = labels[:, 1:]
    keep = tgt != -100
    logp = logits.log_softmax(-1)
    lp = logp.gather(-1, tgt.clamp(min=0)[..., None])[..., 0][keep]
    ent = -(logp.exp() * logp).sum(-1)[keep]
    loss = -lp.sum() / keep.sum().clamp(min=1)
    loss.backward()
    pred = logits.argmax(-1)[keep]
    return dict(loss=loss.detach(), log_probs=lp.detach(), entropy=ent.detach(), predicted=pred,
                target=tgt[keep])  # fmt: skip


def parity(
    make_model: Callable[[], nn.Module],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    dtype: torch.dtype,
    labels: torch.Tensor | None = None,
    backend: str | None = None,
    patched: bool = True,
) -> dict:
    """Compare ``make_model()`` (a fresh unpatched ``MuseGlimmerForConditionalGeneration``;
    called twice, it must give the same weights) in ``dtype``, patched by opcontract (or, with
    ``patched=False``, the stock model's own logits path in ``dtype``: the baseline), with the
    stock model in float64 on the same weights. ``labels`` default to the input ids on real
    tokens. Returns ``{"loss": stats, "log_probs": ..., "entropy": ...,
    "token_accuracy": {...}, "grad": {name: stats}}``."""
    from opcontract.integrations.trl import install_head

    if labels is None:
        labels = input_ids.masked_fill(attention_mask == 0, -100)
    model = make_model().to(dtype).train()
    ref_model = make_model().to(dtype).double().train()  # the same weights, rounded to dtype
    ref = _oracle(ref_model, input_ids, attention_mask, labels)
    keep = labels[:, 1:] != -100
    if patched:
        apply_opcontract(model, backend=backend)
        install_head(model)
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                    fused_lm_head=True)  # fmt: skip
        loss, lp, ent, top1 = out.loss, out.log_probs[keep], out.entropy[keep], out.is_top1[keep]
    else:
        pid = positions_from_mask(attention_mask).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=pid).logits[:, :-1].float()  # fmt: skip
        logp = logits.log_softmax(-1)
        tgt = labels[:, 1:].clamp(min=0)
        lp = logp.gather(-1, tgt[..., None])[..., 0][keep]
        ent = -(logp.exp() * logp).sum(-1)[keep]
        loss = -lp.sum() / keep.sum().clamp(min=1)
        pred = logits.argmax(-1)[keep]
        top1 = pred == ref["target"]
    loss.backward()
    ref_params = dict(ref_model.named_parameters())
    grads = {}
    for name, p in model.named_parameters():
        r = ref_params[name].grad
        if p.grad is None or r is None:
            if (p.grad is None) != (r is None):
                raise AssertionError(f"{name}: a gradient on one side only")
            continue
        grads[name] = _stats(p.grad, r)
    ref_acc = (ref["predicted"] == ref["target"]).double().mean()
    acc = top1.double().mean()
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "patched": patched,
        "tokens": int(keep.sum()),
        "loss": _stats(loss.detach().reshape(1), ref["loss"].reshape(1)),
        "log_probs": _stats(lp.detach(), ref["log_probs"]),
        "entropy": _stats(ent.detach(), ref["entropy"]),
        "token_accuracy": {
            "value": float(acc),
            "ref_value": float(ref_acc),
            "abs_diff": float((acc - ref_acc).abs()),
            "top1_disagreements": int((top1 != (ref["predicted"] == ref["target"])).sum()),
        },
        "grad": grads,
    }


def train_rollout_mismatches(
    dtype: torch.dtype,
    *,
    patched: bool,
    trainer_head: str,
    lengths: tuple[int, ...] = (3, 9, 5, 12),
    new_tokens: int = 16,
    sample: bool = True,
    seed: int = 0,
    make_model: Callable[..., nn.Module] | None = None,
) -> dict:
    """How many generated tokens' rollout log-probs differ (``!=``, per token) from the
    trainer's for the same finished sequences, on the tiny random Muse Glimmer.

    Rollout: the stock model's ``generate(output_logits=True)`` then one log-softmax (what a
    rollout built on transformers stores); patched, :func:`generate_with_logprobs`.
    ``trainer_head``: ``"logits"`` (a training forward's logits, then one log-softmax;
    patched, :func:`token_logprobs`) or ``"trl"`` (TRL 1.16's ``fused_lm_head=True``: its
    chunked head on the stock model, opcontract's on the patched one). Left-padded prompts of
    mixed lengths, no position ids (as a trainer calls the model)."""
    from opcontract.integrations.tiny import left_padded, tiny_muse_glimmer
    from opcontract.integrations.transformers import generate_with_logprobs, token_logprobs

    make_model = make_model or tiny_muse_glimmer
    model = make_model(dtype)
    ids, mask = left_padded(list(lengths))
    P = ids.shape[1]
    torch.manual_seed(seed)
    kw = dict(max_new_tokens=new_tokens, do_sample=sample)
    if patched:
        apply_opcontract(model)
        ro = generate_with_logprobs(model, ids, mask, **kw)
        seq, full, ro_lp = ro.sequences, ro.attention_mask, ro.logprobs
    else:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, output_logits=True,
                                 return_dict_in_generate=True, **kw)  # fmt: skip
        seq = out.sequences
        full = torch.cat([mask, torch.ones_like(seq[:, P:])], dim=1)
        y = seq[:, P:, None]
        ro_lp = torch.stack(out.logits, dim=1).float().log_softmax(-1).gather(-1, y)[..., 0]
    with torch.no_grad():
        if trainer_head == "trl":
            labels = seq.masked_fill(full == 0, -100)
            if patched:
                from opcontract.integrations.trl import install_head

                install_head(model)
            else:
                from trl.trainer.utils import add_fused_lm_head

                add_fused_lm_head(model)
            tr_lp = model(input_ids=seq, attention_mask=full, labels=labels,
                          fused_lm_head=True).log_probs[:, P - 1 :]  # fmt: skip
        elif patched:
            tr_lp = token_logprobs(model, seq, full)[:, P - 1 :]
        else:
            logits = model(input_ids=seq, attention_mask=full).logits[:, P - 1 : -1]
            tr_lp = logits.float().log_softmax(-1).gather(-1, seq[:, P:, None])[..., 0]
    d = (ro_lp - tr_lp).abs()
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "patched": patched,
        "trainer_head": trainer_head,
        "sample": sample,
        "prompt_lengths": list(lengths),
        "new_tokens": new_tokens,
        "differ": int((ro_lp != tr_lp).sum()),
        "tokens": int(ro_lp.numel()),
        "max_abs_diff": float(d.max()),
    }
