"""TRL's trainers on opcontract's LM head: one call after building the trainer.

>>> trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
>>> opcontract.integrations.trl.enable(trainer)        # patches the model if it is not yet
>>> trainer.train()

TRL 1.16 trains through ``model(..., labels=labels, fused_lm_head=True)``: at init each
trainer calls ``add_fused_lm_head(model, temperature=..., outputs=...)``, which wraps the
model's forward with TRL's chunked head (``ChunkedLogProbFunction``) returning
``FusedCausalLMOutput(log_probs, entropy, is_top1, ...)``. :func:`enable` replaces that head,
on ``trainer.model`` and ``trainer.ref_model``, with one that computes the same fields from
opcontract's ``softcap_logprob`` (log-prob, entropy, argmax in one pass over the vocabulary,
float32 from the GEMM accumulator on, never a [T, V] logits tensor), after checking what TRL
asked for: the fields (``log_probs``, ``entropy``, ``is_top1``, ``mean_logits``: DPO's and
KTO's logits metrics, ``log_sum_sq_probs``: DPO's WPO weights) and the temperature (the
contract's ``temperature``: softmax(z / temperature), as TRL's head). Anything else is an
:class:`OpcontractPatchError` naming it, with nothing changed. The per-token log-probs are
then bitwise those of :func:`~opcontract.integrations.transformers.token_logprobs` and of the
rollout's (:func:`~opcontract.integrations.transformers.generate_with_logprobs`), at the same
temperature.
"""

from __future__ import annotations

import functools
import inspect
import math
import types
from typing import Any

import torch
from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager
from torch import nn
from trl.trainer.utils import FusedCausalLMOutput

from opcontract.integrations import lora
from opcontract.integrations import transformers as _hf
from opcontract.integrations.transformers import OpcontractPatchError

SERVED = ("log_probs", "entropy", "is_top1", "mean_logits", "log_sum_sq_probs")  # fields served
OUTPUTS = ("log_probs", "entropy", "is_top1")  # what a head nobody asked anything of computes
_TRL_HEAD = "add_fused_lm_head.<locals>._fused_forward"
_HEAD_FLAG = "_opcontract_trl_head"

__all__ = ["OUTPUTS", "SERVED", "enable", "install_head", "is_enabled"]


def _amp_wrapped(model: nn.Module) -> bool:
    """Whether accelerate's mixed-precision wrapper (autocast, outputs to float32) sits around
    the head: ``prepare_model`` keeps what it wrapped as ``_original_forward``. GRPO prepares
    its reference model at init, before :func:`enable` can run."""
    inner = vars(model).get("_original_forward")
    return inner is not None and vars(model).get("forward") is not inner


def _head_of(model: nn.Module) -> Any:
    return vars(model).get("_original_forward" if _amp_wrapped(model) else "forward")


def is_enabled(model: nn.Module) -> bool:
    """Whether the model's head is opcontract's (:func:`install_head`), under accelerate's
    mixed-precision wrapper or not (a ``PeftModel``: its model's)."""
    return bool(getattr(_head_of(lora.unwrap(model)), _HEAD_FLAG, False))


def _trl_request(model: nn.Module, where: str) -> tuple[tuple[str, ...], float]:
    """The outputs and temperature TRL's installed head was asked for (checked against what
    opcontract serves); (OUTPUTS, 1.0) when TRL installed none."""
    fwd = _head_of(model)
    if fwd is None or is_enabled(model):
        return OUTPUTS, 1.0
    fn = getattr(fwd, "__func__", fwd)
    code = getattr(fn, "__code__", None)  # functools.wraps renames the function, not its code
    if code is None or code.co_qualname != _TRL_HEAD or "trl" not in code.co_filename:
        if _hf.is_patched(model) and fwd is getattr(model, _hf.OPCONTRACT_FORWARD, None):
            return OUTPUTS, 1.0
        raise OpcontractPatchError(
            f"{where}.forward is {getattr(fn, '__qualname__', fn)!r}, neither TRL's fused head "
            "nor opcontract's; replacing it would drop whatever it does"
        )
    asked = inspect.getclosurevars(fn).nonlocals
    temperature = asked.get("temperature")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not (math.isfinite(temperature) and temperature > 0)
    ):
        raise OpcontractPatchError(
            f"{where}: TRL's fused head was given temperature={temperature!r}; softcap_logprob's "
            "temperature must be a number > 0 and finite"
        )
    if temperature != 1.0 and getattr(model, _hf.SHARDED_HEAD, None) is not None:
        raise OpcontractPatchError(
            f"{where}: temperature={temperature!r} with a vocabulary-parallel head, which has "
            "no temperature; train at temperature 1.0 or with an unsharded head"
        )
    outputs = tuple(asked.get("outputs", ()))
    extra = [o for o in outputs if o not in SERVED]
    if extra:
        raise OpcontractPatchError(
            f"{where}: TRL's fused head was asked for outputs {extra}; opcontract's head serves "
            f"{list(SERVED)}"
        )
    unsharded = [o for o in outputs if o in ("mean_logits", "log_sum_sq_probs")]
    if unsharded and getattr(model, _hf.SHARDED_HEAD, None) is not None:
        raise OpcontractPatchError(
            f"{where}: TRL's fused head was asked for {unsharded} with a vocabulary-parallel "
            "head, which serves neither (its vocab_slice contracts declare none); train with an "
            "unsharded head"
        )
    # cast_lm_head_to_fp32 needs nothing: a product of two bfloat16 numbers is exact in
    # float32, and softcap_logprob accumulates and soft-caps in float32 already.
    return outputs, float(temperature)


def enable(trainer: Any, *, backend: str | None = None) -> Any:
    """Make ``trainer`` (a TRL 1.16 trainer: SFT, GRPO, ...) compute ``log_probs``,
    ``entropy`` and ``is_top1`` through opcontract's head, on ``trainer.model`` and, when
    there is one, ``trainer.ref_model``. Call it after building the trainer and before
    ``train()``. A model not yet patched is patched with
    :func:`~opcontract.integrations.transformers.apply_opcontract` (``backend``); a patched one
    keeps the backend it was patched with (another non-None ``backend`` raises). Everything
    is checked before anything changes; idempotent. Returns the trainer."""
    # TRL puts its head on a PeftModel's model (get_base_model()); the LoRA layers inside are
    # patched with the rest (opcontract.integrations.lora)
    models = [("trainer.model", lora.unwrap(trainer.model))]
    if getattr(trainer, "ref_model", None) is not None:
        models.append(("trainer.ref_model", trainer.ref_model))
    plans = []
    for where, model in models:
        if not _hf.is_patched(model):
            _hf._plan(model)  # raises OpcontractPatchError (nothing changed) on a model it can't
            chosen = backend
        else:
            _hf._refresh_plan(model)  # LoRA layers added since patching: checked here
            chosen = _hf.patched_backend(model)
            if backend is not None and backend != chosen:
                raise OpcontractPatchError(
                    f"backend={backend!r}: {where} is already patched with backend={chosen!r}"
                )
        plans.append((model, _trl_request(model, where), chosen))
    for model, (outputs, temperature), chosen in plans:
        _hf.apply_opcontract(model, backend=chosen)  # on a patched one: LoRA layers added since
        if is_enabled(model):
            continue
        amp = _amp_wrapped(model)
        install_head(model, outputs=outputs, temperature=temperature)
        if amp:  # wrap the new head as accelerate wrapped TRL's (the same autocast)
            acc = trainer.accelerator
            ctx = get_mixed_precision_context_manager(acc.native_amp, acc.autocast_handler)
            model._original_forward = model.forward
            model.forward = types.MethodType(
                convert_outputs_to_fp32(ctx(model.forward.__func__)), model
            )
    return trainer


def install_head(
    model: nn.Module, *, outputs: tuple[str, ...] = OUTPUTS, temperature: float = 1.0
) -> nn.Module:
    """Give a patched model TRL's fused-head calling convention on opcontract's head (the
    backend it was patched with): ``model(..., labels=labels, fused_lm_head=True)`` returns a
    ``FusedCausalLMOutput`` whose per-token fields are zero where the next-token label is
    -100, of softmax(z / ``temperature``) as TRL's head at that temperature; without
    ``fused_lm_head`` the call is the patched forward's (generation is unchanged)."""
    given, model = model, lora.unwrap(model)  # a PeftModel: the head goes on its model
    if not _hf.is_patched(model):
        raise OpcontractPatchError("install_head: the model is not patched by apply_opcontract")
    backend = _hf.patched_backend(model)
    extra = [o for o in outputs if o not in SERVED]
    if extra:
        raise OpcontractPatchError(f"install_head: outputs {extra}; served: {list(SERVED)}")
    base = getattr(model, _hf.OPCONTRACT_FORWARD)
    want_entropy, want_top1 = "entropy" in outputs, "is_top1" in outputs
    want_mean, want_sq = "mean_logits" in outputs, "log_sum_sq_probs" in outputs

    @functools.wraps(base.__func__)  # generate() reads the forward's signature
    def forward(
        self: nn.Module,
        *args: Any,
        fused_lm_head: bool = False,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs: Any,
    ):
        if not fused_lm_head:
            if shift_labels is not None:
                raise ValueError("shift_labels is read only with fused_lm_head=True")
            return base(*args, labels=labels, num_items_in_batch=num_items_in_batch, **kwargs)
        if args:
            raise TypeError("fused_lm_head=True takes keyword arguments only")
        if (labels is None) == (shift_labels is None):
            raise ValueError("fused_lm_head=True needs exactly one of labels and shift_labels")
        if kwargs.get("logits_to_keep", 0) != 0:
            raise ValueError("logits_to_keep with fused_lm_head=True: the head returns no logits")
        if kwargs.pop("past_key_values", None) is not None:
            raise ValueError("past_key_values with fused_lm_head=True: a training forward")
        kwargs.pop("use_cache", None)
        kwargs.pop("logits_to_keep", None)
        ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        _hf._check_embedding(self)
        packing = _hf._packing(kwargs.get("position_ids"), kwargs.get("attention_mask"), ids)
        hidden = self.model(**kwargs, **packing, use_cache=False).last_hidden_state
        if shift_labels is None:
            hidden, tgt = hidden[:, :-1], labels[:, 1:]
        else:
            tgt = shift_labels
        tgt = tgt.to(hidden.device)
        mask = tgt != -100
        # only the labelled rows go through the head: each row's bits are its own (batch dims)
        out = _hf.logprob_head(self, hidden[mask], tgt[mask], entropy=want_entropy,
                               predicted=want_top1, backend=backend, temperature=temperature,
                               mean_logits=want_mean, log_sum_sq_probs=want_sq)  # fmt: skip

        def scatter(x: torch.Tensor | None) -> torch.Tensor | None:
            # masked_scatter keeps an all-ignored batch connected to the graph (a zero loss)
            return None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x)

        log_probs, entropy = scatter(out.logprob), scatter(out.entropy)
        is_top1 = scatter(out.predicted == tgt[mask]) if want_top1 else None
        mean = scatter(out.mean_logits) if want_mean else None
        # log_sum_sq_probs: non-differentiable (the contract's; TRL's marks it so too)
        sq = scatter(out.log_sum_sq_probs.detach()) if want_sq else None
        n = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / n,
            log_probs=log_probs,
            entropy=entropy,
            is_top1=is_top1,
            mean_logits=mean,
            log_sum_sq_probs=sq,
            label_mask=mask,
        )

    forward.__dict__[_HEAD_FLAG] = True
    model.forward = types.MethodType(forward, model)
    return given
