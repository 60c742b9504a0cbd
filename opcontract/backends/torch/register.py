"""Registrations of the torch backend's implementations."""

from __future__ import annotations

from opcontract.backends.registry import register
from opcontract.backends.torch import linear_cross_entropy as lce
from opcontract.backends.torch import softcap_logprob as slp
from opcontract.contracts.schema import ReductionPlan

_FLOATS = ("bfloat16", "float16", "float32")


def _call(fn):
    return lambda config, **kw: fn(**kw)


def _plan(**kw) -> ReductionPlan:
    return ReductionPlan(accumulate="float32", **kw)


register(
    op="softcap_logprob",
    backend="torch",
    name="torch.strict",
    run=_call(slp.strict_forward),
    devices=("cpu", "cuda"),
    dtypes=_FLOATS,
    plan={
        "gemm_k": _plan(block=1),
        "vocab_lse": _plan(block=slp.VOCAB_BLOCK, merge="online_max_rescale"),
        "vocab_entropy": _plan(block=slp.VOCAB_BLOCK, merge="online_max_rescale"),
        "vocab_argmax": ReductionPlan(
            accumulate="int64", block=slp.VOCAB_BLOCK, merge="argmax_lowest"
        ),
        "grad_hidden_v": _plan(block=slp.GRAD_CHUNK),
        "grad_weight_t": _plan(block=1),
    },
    invariances=("run_to_run", "batch"),
    grad_invariances={"hidden": ("run_to_run", "batch"), "weight": ("run_to_run",)},
    priority={"cpu": 10, "cuda": 1},
    summary="portable strict path: elementwise float32 ops in the contract's order",
)

_LIBRARY = _plan(block="library", order="library", split="library")
register(
    op="softcap_logprob",
    backend="torch",
    name="torch.eager",
    run=_call(slp.eager_forward),
    devices=("cpu", "cuda"),
    dtypes=_FLOATS,
    plan={
        "gemm_k": _LIBRARY,
        "vocab_lse": _LIBRARY,
        "vocab_entropy": _LIBRARY,
        "grad_hidden_v": _LIBRARY,
        "grad_weight_t": _LIBRARY,
    },
    invariances=(),
    grad_invariances={"hidden": (), "weight": ()},
    features=("library_gemm", "full_logits", "undeclared_cast"),
    relaxed_only=True,
    priority={"cpu": 1, "cuda": 1},
    summary="stock eager torch (cuBLAS/CPU BLAS); not batch-invariant",
)

_LCE_STRICT_PLAN = {
    "gemm_k": _plan(block=1),
    "vocab_lse": _plan(block=slp.VOCAB_BLOCK, merge="online_max_rescale"),
    "vocab_argmax": ReductionPlan(accumulate="int64", block=slp.VOCAB_BLOCK, merge="argmax_lowest"),
    "vocab_zsum": _plan(block=slp.VOCAB_BLOCK),
    "token_sum": _plan(block=1, order="pairwise"),
    "grad_hidden_v": _plan(block=slp.GRAD_CHUNK),
    "grad_weight_t": _plan(block=1),
}
register(
    op="linear_cross_entropy",
    backend="torch",
    name="torch.strict_ce",
    run=_call(lce.strict),
    devices=("cpu", "cuda"),
    dtypes=_FLOATS,
    plan=_LCE_STRICT_PLAN,
    invariances=("run_to_run", "batch"),
    grad_invariances={"hidden": ("run_to_run", "batch"), "weight": ("run_to_run",)},
    priority={"cpu": 10, "cuda": 1},
    summary="the strict torch head, reduced over tokens by a fixed pairwise tree",
)
register(
    op="linear_cross_entropy",
    backend="torch",
    name="torch.eager_ce",
    run=_call(lce.eager),
    devices=("cpu", "cuda"),
    dtypes=_FLOATS,
    plan={name: _LIBRARY for name in _LCE_STRICT_PLAN},
    invariances=(),
    grad_invariances={"hidden": (), "weight": ()},
    features=("library_gemm", "full_logits", "undeclared_cast"),
    relaxed_only=True,
    priority={"cpu": 1, "cuda": 1},
    summary="stock torch cross_entropy on library-GEMM logits",
)
