"""Registrations of the Triton backend's implementations. Importing this never imports Triton."""

from __future__ import annotations

from opcontract.backends.registry import register
from opcontract.backends.triton import device_reason, missing_library
from opcontract.backends.triton import linear_cross_entropy as lce
from opcontract.backends.triton import softcap_logprob as slp
from opcontract.contracts.schema import ReductionPlan


def _run_softcap_logprob(config, **kw):
    return slp.softcap_logprob_forward(**kw, config=config)


register(
    op="softcap_logprob",
    backend="triton",
    name="triton.fused",
    run=_run_softcap_logprob,
    devices=("cuda", "cpu"),
    capability=((8, 0), (12, 1)),
    dtypes=("bfloat16", "float16", "float32"),
    plan={
        "gemm_k": ReductionPlan(accumulate="float32", block=slp.GEMM_K_BLOCK),
        "vocab_entropy": ReductionPlan(
            accumulate="float32",
            block=slp.BLOCK_V,
            merge="online_max_rescale",
            split="fixed_blocks",
        ),
        "vocab_argmax": ReductionPlan(
            accumulate="int64", block=slp.BLOCK_V, merge="argmax_lowest", split="fixed_blocks"
        ),
        "grad_hidden_v": ReductionPlan(accumulate="float32", block=slp.GRAD_CHUNK),
        "grad_weight_t": ReductionPlan(accumulate="float32", block=slp.GEMM_K_BLOCK),
        "vocab_lse": ReductionPlan(
            accumulate="float32",
            block=slp.BLOCK_V,
            merge="online_max_rescale",
            split="fixed_blocks",
        ),
    },
    invariances=("run_to_run", "batch"),
    grad_invariances={"hidden": ("run_to_run", "batch"), "weight": ("run_to_run",)},
    features=("approx_transcendentals",),
    config_space=slp.CONFIG_SPACE,
    default_config=lambda call: slp.default_config(call.dtype, call.sizes.get("T")),
    available=missing_library,
    device_check=device_reason,
    priority={"cuda": 20, "cpu": 5},
    summary="one fused GEMM + soft cap + per-block logsumexp kernel, then an ordered merge",
)

register(
    op="linear_cross_entropy",
    backend="triton",
    name="triton.fused_ce",
    run=lambda config, **kw: lce.fused(**kw, config=config),
    devices=("cuda", "cpu"),
    capability=((8, 0), (12, 1)),
    dtypes=("bfloat16", "float16", "float32"),
    plan={
        "gemm_k": ReductionPlan(accumulate="float32", block=slp.GEMM_K_BLOCK),
        "vocab_lse": ReductionPlan(
            accumulate="float32",
            block=slp.BLOCK_V,
            merge="online_max_rescale",
            split="fixed_blocks",
        ),
        "vocab_argmax": ReductionPlan(
            accumulate="int64", block=slp.BLOCK_V, merge="argmax_lowest", split="fixed_blocks"
        ),
        "vocab_zsum": ReductionPlan(accumulate="float32", block=slp.BLOCK_V, split="fixed_blocks"),
        "token_sum": ReductionPlan(accumulate="float32", block=1, order="pairwise"),
        "grad_hidden_v": ReductionPlan(accumulate="float32", block=slp.GRAD_CHUNK),
        "grad_weight_t": ReductionPlan(accumulate="float32", block=slp.GEMM_K_BLOCK),
    },
    invariances=("run_to_run", "batch"),
    grad_invariances={"hidden": ("run_to_run", "batch"), "weight": ("run_to_run",)},
    features=("approx_transcendentals",),
    config_space=slp.CONFIG_SPACE,
    default_config=lambda call: slp.default_config(call.dtype, call.sizes.get("T")),
    available=missing_library,
    device_check=device_reason,
    priority={"cuda": 20, "cpu": 5},
    summary="the fused Triton head, reduced over tokens by a fixed pairwise tree",
)
