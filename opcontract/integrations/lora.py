"""PEFT LoRA layers on opcontract's ``dense_gemm``: adapters train and generate strictly.

A LoRA layer (``peft.tuners.lora.Linear``) wraps a projection: ``y = base(x) + B(A(drop(x)))
* scaling`` for each active adapter. Patched, the base projection and both adapter products
run through ``dense_gemm`` (batch-invariant, float32 accumulation in fixed 256-element
partials), composed in PEFT's order and dtypes: ``x`` cast to the adapter's dtype, the sum in
the wider dtype, one cast back to the base output's. The adapter weights are read at call
time, so an adapter added later, a merge or ``disable_adapter()`` need no re-patch.

Served: plain LoRA (any rank, alpha, rsLoRA scaling, dropout, ``lora_bias``), several
adapters, merged adapters, adapters disabled. Refused with an error naming the layer: LoRA
variants (DoRA, aLoRA, ...: ``lora_variant``), mixed-adapter batches (``adapter_names``), a
base layer that is not an ``nn.Linear``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from opcontract.integrations.cache_base import OpcontractPatchError

MARK = "_opcontract_proj"  # set on every module whose forward is opcontract's


def lora_linear_type() -> type | None:
    """``peft.tuners.lora.Linear`` when PEFT is imported (no model holds one otherwise)."""
    if "peft" not in sys.modules:
        return None
    from peft.tuners.lora import Linear

    return Linear


def is_lora_linear(mod: nn.Module) -> bool:
    cls = lora_linear_type()
    return cls is not None and isinstance(mod, cls)


def is_peft_wrapper(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (whose ``get_base_model()`` is the model)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel``; any other model as it is."""
    return model.get_base_model() if is_peft_wrapper(model) else model


def describe(mod: nn.Module) -> str:
    cls = type(mod)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_lora_linear(mod: nn.Module, where: str) -> None:
    """Raise :class:`OpcontractPatchError` unless ``mod`` is a LoRA layer this module serves."""
    base = mod.base_layer
    if type(base) is not nn.Linear and MARK not in vars(base):
        raise OpcontractPatchError(
            f"{where}.base_layer: a LoRA layer over {describe(base)}; opcontract patches LoRA "
            "over nn.Linear only"
        )
    if getattr(mod, "fan_in_fan_out", False):
        raise OpcontractPatchError(f"{where}: LoRA with fan_in_fan_out=True over nn.Linear")
    for name in mod.lora_A:
        if name in mod.lora_variant:
            raise OpcontractPatchError(
                f"{where}: adapter {name!r} is a LoRA variant "
                f"({type(mod.lora_variant[name]).__name__}: DoRA, aLoRA, ...); opcontract serves "
                "plain LoRA"
            )
        a, b = mod.lora_A[name], mod.lora_B[name]
        if type(a) is not nn.Linear or type(b) is not nn.Linear:
            raise OpcontractPatchError(
                f"{where}: adapter {name!r} has lora_A {describe(a)} and lora_B {describe(b)}; "
                "expected nn.Linear"
            )


def patch_lora_linear(
    mod: nn.Module,
    where: str,
    patch_linear: Callable[[nn.Linear], None],
    gemm: Callable[..., torch.Tensor],
) -> None:
    """Route ``mod`` (checked by :func:`check_lora_linear`) through ``gemm``: its base layer
    by ``patch_linear``, each active adapter's two products in the forward below."""
    check_lora_linear(mod, where)
    if MARK not in vars(mod.base_layer):
        patch_linear(mod.base_layer)

    def product(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
        y = gemm(x.reshape(-1, x.shape[-1]), lin.weight, lin.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:
            raise OpcontractPatchError(
                f"{where}: a LoRA layer called with {sorted(kwargs) or 'extra arguments'} "
                "(adapter_names: mixed-adapter batches are not served)"
            )
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x)
        if self.merged:
            return self.base_layer(x)
        result = self.base_layer(x)
        dtype = result.dtype
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            if name in self.lora_variant:
                raise OpcontractPatchError(
                    f"{where}: adapter {name!r} is a LoRA variant; opcontract serves plain LoRA"
                )
            a, b = self.lora_A[name], self.lora_B[name]
            x = self._cast_input_dtype(x, a.weight.dtype)
            delta = product(product(self.lora_dropout[name](x), a), b)
            result = result + delta * self.scaling[name]
        return result.to(dtype)

    mod.forward = types.MethodType(forward, mod)
    object.__setattr__(mod, MARK, True)
