"""Registrations of the torch backend's implementations."""

from __future__ import annotations

import functools

from opcontract.backends import gemm_op, norm_op, swiglu_op
from opcontract.backends.registry import register
from opcontract.backends.torch import dense_gemm as dg
from opcontract.backends.torch import linear_cross_entropy as lce
from opcontract.backends.torch import softcap_logprob as slp
from opcontract.contracts.schema import ReductionPlan

_FLOATS = ("bfloat16", "float16", "float32")


def _call(fn):
    return lambda config, **kw: fn(**kw)


def _plan(**kw) -> ReductionPlan:
    return ReductionPlan(accumulate="float32", **kw)


# The strict LM head's reductions, shared by softcap_logprob and linear_cross_entropy.
_HEAD_PLAN = {
    "gemm_k": _plan(block=1),
    "vocab_lse": _plan(block=slp.VOCAB_BLOCK, merge="online_max_rescale"),
    "vocab_argmax": ReductionPlan(accumulate="int64", block=slp.VOCAB_BLOCK, merge="argmax_lowest"),
    "grad_hidden_v": _plan(block=slp.GRAD_CHUNK),
    "grad_weight_t": _plan(block=1),
}
_STRICT = dict(
    backend="torch",
    devices=("cpu", "cuda"),
    dtypes=_FLOATS,
    invariances=("run_to_run", "batch"),
    grad_invariances={"hidden": ("run_to_run", "batch"), "weight": ("run_to_run",)},
    priority={"cpu": 10, "cuda": 1},
)
# Stock eager torch: a vendor GEMM and library reductions, in no declared order.
_LIBRARY = _plan(block="library", order="library", split="library")
_EAGER = dict(
    backend="torch",
    devices=("cpu", "cuda"),
    dtypes=_FLOATS,
    invariances=(),
    grad_invariances={"hidden": (), "weight": ()},
    features=("library_gemm", "full_logits", "undeclared_cast"),
    relaxed_only=True,
    priority={"cpu": 1, "cuda": 1},
)

_SLP_PLAN = {
    **_HEAD_PLAN,
    "vocab_entropy": _plan(block=slp.VOCAB_BLOCK, merge="online_max_rescale"),
}
register(
    op="softcap_logprob",
    name="torch.strict",
    run=_call(slp.strict_forward),
    plan=_SLP_PLAN,
    summary="portable strict path: elementwise float32 ops in the contract's order",
    **_STRICT,
)
register(
    op="softcap_logprob",
    name="torch.eager",
    run=_call(slp.eager_forward),
    plan={name: _LIBRARY for name in _SLP_PLAN},
    summary="stock eager torch (cuBLAS/CPU BLAS); not batch-invariant",
    **_EAGER,
)

_LCE_PLAN = {
    **_HEAD_PLAN,
    "vocab_zsum": _plan(block=slp.VOCAB_BLOCK),
    "token_sum": _plan(block=1, order="pairwise"),
}
register(
    op="linear_cross_entropy",
    name="torch.strict_ce",
    run=_call(lce.strict),
    plan=_LCE_PLAN,
    summary="the strict torch head, reduced over tokens by a fixed pairwise tree",
    **_STRICT,
)
register(
    op="linear_cross_entropy",
    name="torch.eager_ce",
    run=_call(lce.eager),
    plan={name: _LIBRARY for name in _LCE_PLAN},
    summary="stock torch cross_entropy on library-GEMM logits",
    **_EAGER,
)

_NORM_PLAN = {
    "row_square": _plan(block=1, order="tree"),
    "row_dot": _plan(block=1, order="tree"),
    "dweight_t": _plan(block=64, split="none"),
}
_NORM_GRADS = {"x": ("run_to_run", "batch"), "weight": ("run_to_run",)}
register(
    op="rms_norm",
    name="torch.strict_norm",
    run=_call(functools.partial(norm_op.rms_norm, "torch")),
    plan=_NORM_PLAN,
    summary="elementwise float32 ops, pairwise-tree row sums",
    **{**_STRICT, "grad_invariances": _NORM_GRADS},
)
register(
    op="fused_add_rms_norm",
    name="torch.strict_add_norm",
    run=_call(functools.partial(norm_op.fused_add_rms_norm, "torch")),
    plan=_NORM_PLAN,
    summary="float32 sum rounded once, then the strict RMSNorm",
    **{**_STRICT, "grad_invariances": {**_NORM_GRADS, "residual": ("run_to_run", "batch")}},
)

register(
    op="swiglu",
    name="torch.strict_swiglu",
    run=_call(functools.partial(swiglu_op.swiglu, "torch")),
    plan={},
    summary="elementwise float32, one cast",
    **{
        **_STRICT,
        "grad_invariances": {"gate": ("run_to_run", "batch"), "up": ("run_to_run", "batch")},
    },
)

register(
    op="normalized_embedding",
    name="torch.strict_embedding",
    run=_call(functools.partial(norm_op.normalized_embedding, "torch")),
    plan={
        "row_square": _plan(block=1, order="tree"),
        "row_dot": _plan(block=1, order="tree"),
        "dtable_t": _plan(block=1),
    },
    summary="gather, strict weightless RMSNorm; table gradient summed token by token",
    **{**_STRICT, "grad_invariances": {"table": ("run_to_run",)}},
)

_GEMM = gemm_op.strict_declaration()
register(
    op="dense_gemm",
    name="torch.strict_gemm",
    run=_call(functools.partial(gemm_op.dense_gemm, "torch")),
    summary="elementwise float32, 256-element promoted partials",
    **{**_STRICT, **_GEMM},
)
register(
    op="dense_gemm",
    name="torch.cublas",
    run=_call(dg.cublas_forward),
    plan={name: _LIBRARY for name in _GEMM["plan"]},
    summary="stock F.linear (cuBLAS / CPU BLAS): not batch-invariant",
    **{
        **_EAGER,
        "features": ("library_gemm",),
        "grad_invariances": {"x": (), "weight": (), "bias": ()},
    },
)
