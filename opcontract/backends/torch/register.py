"""Registrations of the torch backend's implementations."""

from __future__ import annotations

from opcontract.backends.registry import register
from opcontract.backends.torch import softcap_logprob as slp
from opcontract.contracts.schema import ReductionPlan

_FLOATS = ("bfloat16", "float16", "float32")


def _call(fn):
    return lambda config, **kw: fn(**kw)


register(
    op="softcap_logprob",
    backend="torch",
    name="torch.strict",
    run=_call(slp.strict_forward),
    devices=("cpu", "cuda"),
    dtypes=_FLOATS,
    plan={
        "gemm_k": ReductionPlan(accumulate="float32", block=1),
        "vocab_lse": ReductionPlan(
            accumulate="float32", block=slp.VOCAB_BLOCK, merge="online_max_rescale", split="none"
        ),
    },
    invariances=("run_to_run", "batch"),
    priority={"cpu": 10, "cuda": 1},
    summary="portable strict path: elementwise float32 ops in the contract's order",
)

register(
    op="softcap_logprob",
    backend="torch",
    name="torch.eager",
    run=_call(slp.eager_forward),
    devices=("cpu", "cuda"),
    dtypes=_FLOATS,
    plan={
        "gemm_k": ReductionPlan(
            accumulate="float32", block="library", order="library", split="library"
        ),
        "vocab_lse": ReductionPlan(
            accumulate="float32",
            block="library",
            order="library",
            split="library",
            merge="online_max_rescale",
        ),
    },
    invariances=(),
    features=("library_gemm", "full_logits", "undeclared_cast"),
    relaxed_only=True,
    priority={"cpu": 1, "cuda": 1},
    summary="stock eager torch (cuBLAS/CPU BLAS); not batch-invariant",
)
