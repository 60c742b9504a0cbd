"""Registrations of the torch backend's implementations."""

from __future__ import annotations

import torch

from opcontract.backends.dense_gemm import segmented_declaration, strict_declaration
from opcontract.backends.registry import register
from opcontract.backends.torch import dense_gemm as dg
from opcontract.backends.torch import fused_add_rms_norm as fan
from opcontract.backends.torch import gated_attention as ga
from opcontract.backends.torch import linear_cross_entropy as lce
from opcontract.backends.torch import normalized_embedding as emb
from opcontract.backends.torch import qk_norm_rope as qkr
from opcontract.backends.torch import rms_norm as rn
from opcontract.backends.torch import segmented_gemm as sg
from opcontract.backends.torch import softcap_logits as slg
from opcontract.backends.torch import softcap_logprob as slp
from opcontract.backends.torch import swiglu as sw
from opcontract.backends.torch import vocab_slice as vs
from opcontract.contracts import get_contract
from opcontract.contracts.schema import ReductionPlan

_FLOATS = ("bfloat16", "float16", "float32")


def _plan(**kw) -> ReductionPlan:
    return ReductionPlan(accumulate="float32", **kw)


def _recomputed(op: str, forward):
    """A backward for stock code: its forward recomputed under autograd from the saved
    inputs, differentiated by torch (in whatever order torch's kernels take)."""
    c = get_contract(op)
    diff = [n for n, o in c.outputs.items() if o.differentiable]

    def backward(config, saved, grads, needs, **params):
        leaves = {
            n: (t.detach().requires_grad_(bool(needs.get(n))) if t is not None else None)
            for n, t in saved.items()
            if n in c.inputs
        }
        with torch.enable_grad():
            out = dict(zip(c.outputs, forward(config, **leaves, **params), strict=False))
            pairs = [
                (out[n], grads[n]) for n in diff if grads[n] is not None and out[n] is not None
            ]
            wrt = [n for n in c.grads if needs.get(n) and leaves.get(n) is not None]
            got = torch.autograd.grad(
                [o for o, _ in pairs], [leaves[n] for n in wrt], [g for _, g in pairs],
                allow_unused=True,
            )  # fmt: skip
        return dict(zip(wrt, got, strict=True))

    return backward


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
# The strict head's backward plans (the contracts' equal-bits ``plans``).
_HEAD_PLANS = dict(
    config_space=slp.CONFIG_SPACE,
    default_config=lambda call: dict(slp.DEFAULT_PLAN),
    plan_memory=lambda call, config: slp.plan_memory(
        call.sizes["T"], call.sizes["H"], call.sizes["V"], call.dtype, config
    ),
    backward_only=tuple(slp.CONFIG_SPACE),
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


def _stock(fn):
    return lambda config, **kw: fn(**kw)


_SLP_PLAN = {
    **_HEAD_PLAN,
    "vocab_entropy": _plan(block=slp.VOCAB_BLOCK, merge="online_max_rescale"),
    "vocab_zsum": _plan(block=slp.VOCAB_BLOCK),
    "vocab_sq": _plan(block=slp.VOCAB_BLOCK, merge="online_max_rescale"),
}
register(
    op="softcap_logprob",
    name="torch.strict",
    forward=slp.forward,
    backward=slp.backward,
    plan=_SLP_PLAN,
    summary="portable strict path: elementwise float32 ops in the contract's order",
    **_STRICT,
    **_HEAD_PLANS,
)
register(
    op="softcap_logprob",
    name="torch.eager",
    forward=_stock(slp.eager_forward),
    backward=_recomputed("softcap_logprob", _stock(slp.eager_forward)),
    plan={name: _LIBRARY for name in _SLP_PLAN},
    summary="stock eager torch (cuBLAS/CPU BLAS); not batch-invariant",
    **_EAGER,
)

register(
    op="softcap_logits",
    name="torch.strict_logits",
    forward=slg.forward,
    plan={"gemm_k": _HEAD_PLAN["gemm_k"], "vocab_lse": _HEAD_PLAN["vocab_lse"]},
    summary="the sampler head: the strict softcap_logprob forward, its logits kept",
    **{**_STRICT, "grad_invariances": {}},
)

_LCE_PLAN = {
    **_HEAD_PLAN,
    "vocab_zsum": _plan(block=slp.VOCAB_BLOCK),
    "token_sum": _plan(block=1, order="pairwise"),
}
register(
    op="linear_cross_entropy",
    name="torch.strict_ce",
    forward=lce.forward,
    backward=lce.backward,
    plan=_LCE_PLAN,
    summary="the strict torch head, reduced over tokens by a fixed pairwise tree",
    **_STRICT,
    **_HEAD_PLANS,
)
register(
    op="linear_cross_entropy",
    name="torch.eager_ce",
    forward=_stock(lce.eager),
    backward=_recomputed("linear_cross_entropy", _stock(lce.eager)),
    plan={name: _LIBRARY for name in _LCE_PLAN},
    summary="stock torch cross_entropy on library-GEMM logits",
    **_EAGER,
)

_NORM_PLAN = {
    "row_square": _plan(block=1, order="tree"),
    "row_dot": _plan(block=1, order="tree"),
    "dweight_t": _plan(block=rn.DW_ROWS, split="none"),
}
_NORM_GRADS = {"x": ("run_to_run", "batch"), "weight": ("run_to_run",)}
register(
    op="rms_norm",
    name="torch.strict_norm",
    forward=rn.forward,
    backward=rn.backward,
    plan=_NORM_PLAN,
    summary="elementwise float32 ops, pairwise-tree row sums",
    **{**_STRICT, "grad_invariances": _NORM_GRADS},
)
register(
    op="fused_add_rms_norm",
    name="torch.strict_add_norm",
    forward=fan.forward,
    backward=fan.backward,
    plan=_NORM_PLAN,
    summary="float32 sum rounded once, then the strict RMSNorm",
    **{**_STRICT, "grad_invariances": {**_NORM_GRADS, "residual": ("run_to_run", "batch")}},
)

register(
    op="swiglu",
    name="torch.strict_swiglu",
    forward=sw.forward,
    backward=sw.backward,
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
    forward=emb.forward,
    backward=emb.backward,
    plan={
        "row_square": _plan(block=1, order="tree"),
        "row_dot": _plan(block=1, order="tree"),
        "dtable_t": _plan(block=1),
    },
    summary="gather, strict weightless RMSNorm; table gradient summed token by token",
    **{**_STRICT, "grad_invariances": {"table": ("run_to_run",)}},
)

_GEMM = strict_declaration()
register(
    op="dense_gemm",
    name="torch.strict_gemm",
    forward=dg.forward,
    backward=dg.backward,
    summary="elementwise float32, 256-element promoted partials",
    **{**_STRICT, **_GEMM},
)
register(
    op="dense_gemm",
    name="torch.cublas",
    forward=_stock(dg.cublas_forward),
    backward=_recomputed("dense_gemm", _stock(dg.cublas_forward)),
    plan={name: _LIBRARY for name in _GEMM["plan"]},
    summary="stock F.linear (cuBLAS / CPU BLAS): not batch-invariant",
    **{
        **_EAGER,
        "features": ("library_gemm",),
        "grad_invariances": {"x": (), "weight": (), "bias": ()},
    },
)

register(
    op="segmented_gemm",
    name="torch.strict_segmented_gemm",
    forward=sg.forward,
    backward=sg.backward,
    summary="elementwise float32: dense_gemm's strict K sum per segment, an adjacent-pair tree",
    **{**_STRICT, **segmented_declaration()},
)

register(
    op="vocab_slice_stats",
    name="torch.strict_slice_stats",
    forward=vs.stats_forward,
    plan={
        "gemm_k": _plan(block=1),
        "vocab_lse": _plan(block=slp.VOCAB_BLOCK, merge="online_max_rescale", split="fixed_blocks"),
        "vocab_entropy": _plan(block=slp.VOCAB_BLOCK, merge="online_max_rescale",
                               split="fixed_blocks"),
        "vocab_argmax": ReductionPlan(accumulate="int64", block=slp.VOCAB_BLOCK,
                                      merge="argmax_lowest", split="fixed_blocks"),
        "segment_tree": _plan(block=1, order="pairwise", merge="online_max_rescale"),
    },
    summary="softcap_logprob's strict blocks per segment, an adjacent-pair tree of merges",
    **{**_STRICT, "grad_invariances": {}},
)
register(
    op="vocab_slice_grad",
    name="torch.strict_slice_grad",
    forward=vs.grad_forward,
    plan={
        "gemm_k": _plan(block=1),
        "grad_hidden_v": _plan(block=slp.GRAD_CHUNK, split="fixed_blocks"),
        "segment_tree": _plan(block=1, order="pairwise"),
        "grad_weight_t": _plan(block=1),
    },
    summary="softcap_logprob's strict backward blocks per segment, an adjacent-pair tree",
    **{**_STRICT, "grad_invariances": {}},
)

register(
    op="qk_norm_rope",
    name="torch.strict_qk",
    forward=qkr.forward,
    backward=qkr.backward,
    plan={
        "row_square": _plan(block=1, order="tree"),
        "row_dot": _plan(block=1, order="tree"),
    },
    summary="elementwise float32, pairwise-tree head sums, float64 angles rounded once",
    **{**_STRICT, "grad_invariances": {"q": ("run_to_run", "batch"), "k": ("run_to_run", "batch")}},
)

register(
    op="gated_attention",
    name="torch.strict_attention",
    forward=ga.forward,
    backward=ga.backward,
    plan={
        "qk_d": _plan(block=1),
        "key_blocks": _plan(block=ga.BLOCK, merge="online_max_rescale"),
        "key_chunks": _plan(block=ga.CHUNK, merge="online_max_rescale"),
        "grad_dq_keys": _plan(block=ga.BLOCK),
        "grad_dkv_queries": _plan(block=ga.QBLOCK),
        "grad_delta_d": _plan(block=1, order="tree"),
    },
    summary="the chunked online softmax row by row, elementwise float32 in a fixed order",
    **{
        **_STRICT,
        "grad_invariances": {
            "q": ("run_to_run", "batch"),
            "k": ("run_to_run",),
            "v": ("run_to_run",),
            "gate": ("run_to_run", "batch"),
        },
    },
)
