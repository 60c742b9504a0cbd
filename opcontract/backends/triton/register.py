"""Registrations of the Triton backend's implementations. Importing this never imports Triton."""

from __future__ import annotations

from opcontract.backends.dense_gemm import segmented_declaration, strict_declaration
from opcontract.backends.registry import register
from opcontract.backends.triton import dense_gemm as dg
from opcontract.backends.triton import device_reason, missing_library
from opcontract.backends.triton import fused_add_rms_norm as fan
from opcontract.backends.triton import gated_attention as ga
from opcontract.backends.triton import linear_cross_entropy as lce
from opcontract.backends.triton import normalized_embedding as emb
from opcontract.backends.triton import qk_norm_rope as qkr
from opcontract.backends.triton import rms_norm as rn
from opcontract.backends.triton import segmented_gemm as sg
from opcontract.backends.triton import softcap_logits as slg
from opcontract.backends.triton import softcap_logprob as slp
from opcontract.backends.triton import swiglu as tsw
from opcontract.backends.triton.forward_plan import forward_plan
from opcontract.contracts.schema import ReductionPlan


def _plan(**kw) -> ReductionPlan:
    return ReductionPlan(accumulate="float32", **kw)


# What every Triton implementation shares: where it runs and why it may not.
_TRITON = dict(
    backend="triton",
    devices=("cuda", "cpu"),
    capability=((8, 0), (12, 1)),
    dtypes=("bfloat16", "float16", "float32"),
    invariances=("run_to_run", "batch"),
    available=missing_library,
    device_check=device_reason,
    priority={"cuda": 20, "cpu": 5},
)

# The LM head's reductions, shared by softcap_logprob and linear_cross_entropy.
_HEAD_PLAN = {
    "gemm_k": _plan(block=slp.GEMM_K_BLOCK),
    "vocab_lse": _plan(block=slp.BLOCK_V, merge="online_max_rescale", split="fixed_blocks"),
    "vocab_argmax": ReductionPlan(
        accumulate="int64", block=slp.BLOCK_V, merge="argmax_lowest", split="fixed_blocks"
    ),
    "grad_hidden_v": _plan(block=slp.GRAD_CHUNK),
    "grad_weight_t": _plan(block=slp.GEMM_K_BLOCK),
}
def head_plan_memory(call, config: dict, grad_gemm: str = "triton",
                     logits_acc: bool = False) -> dict[str, int]:  # fmt: skip
    """The head's backward plans' memory for a call, its grad_weight GEMM on ``grad_gemm``
    (which decides the token padding, slp.GRAD_K_ALIGN), g's logits through a float32 acc
    where ``logits_acc``."""
    return slp.plan_memory(call.sizes["T"], call.sizes["H"], call.sizes["V"], call.dtype,
                           config, k_align=slp.GRAD_K_ALIGN[grad_gemm],
                           logits_acc=logits_acc)  # fmt: skip


HEAD = dict(
    _TRITON,
    layout={"*": "rows", "targets": "contiguous"},
    grad_invariances={"hidden": ("run_to_run", "batch"), "weight": ("run_to_run",)},
    features=("approx_transcendentals",),
    config_space=slp.CONFIG_SPACE,
    default_config=lambda call: slp.default_config(call.dtype, call.sizes.get("T")),
    plan_memory=lambda call, config: head_plan_memory(call, config),
    backward_only=slp.BACKWARD_ONLY,
)

# The head's declarations, which the CuTe backend's heads share (cute/register.py).
LOGPROB_PLAN = {
    **_HEAD_PLAN,
    "vocab_entropy": _plan(block=slp.BLOCK_V, merge="online_max_rescale", split="fixed_blocks"),
    "vocab_zsum": _plan(block=slp.BLOCK_V, split="fixed_blocks"),
    "vocab_sq": _plan(block=slp.BLOCK_V, merge="online_max_rescale", split="fixed_blocks"),
}
CE_PLAN = {
    **_HEAD_PLAN,
    "vocab_zsum": _plan(block=slp.BLOCK_V, split="fixed_blocks"),
    "token_sum": _plan(block=1, order="pairwise"),
}

register(
    op="softcap_logprob",
    name="triton.fused",
    forward=slp.forward,
    backward=slp.logprob_backward,
    plan=LOGPROB_PLAN,
    summary="one fused GEMM + soft cap + per-block logsumexp kernel, then an ordered merge",
    **HEAD,
)

register(
    op="linear_cross_entropy",
    name="triton.fused_ce",
    forward=lce.forward,
    backward=lce.backward,
    plan=CE_PLAN,
    summary="the fused Triton head, reduced over tokens by a fixed pairwise tree",
    **HEAD,
)

register(
    op="softcap_logits",
    name="triton.logits",
    forward=slg.forward,
    plan={
        "gemm_k": _HEAD_PLAN["gemm_k"],
        "vocab_lse": _HEAD_PLAN["vocab_lse"],
    },
    summary="the sampler head: softcap_logprob's partials kernel also storing z [T, V]",
    **{
        **HEAD,
        "grad_invariances": {},
        "config_space": slg.CONFIG_SPACE,
        "default_config": lambda call: slg.default_config(call.dtype, call.sizes.get("T")),
        "layout": {"*": "rows"},
    },
)

_NORM = dict(
    _TRITON,
    layout={"*": "contiguous"},
    plan={
        "row_square": _plan(block=1, order="tree"),
        "row_dot": _plan(block=1, order="tree"),
        "dweight_t": _plan(block=64, split="fixed_blocks"),
    },
)
_NORM_GRADS = {"x": ("run_to_run", "batch"), "weight": ("run_to_run",)}
register(
    op="rms_norm",
    name="triton.norm",
    forward=rn.forward,
    forward_no_grad=rn.forward_no_grad,
    plan_no_grad=rn.plan_no_grad,
    backward=rn.backward,
    grad_invariances=_NORM_GRADS,
    summary="one program per row; weight gradient from ordered 64-row partials",
    **_NORM,
)
register(
    op="fused_add_rms_norm",
    name="triton.add_norm",
    forward=fan.forward,
    forward_no_grad=fan.forward_no_grad,
    plan_no_grad=fan.plan_no_grad,
    backward=fan.backward,
    grad_invariances={**_NORM_GRADS, "residual": ("run_to_run", "batch")},
    summary="residual add and RMSNorm in one pass; ordered weight-gradient partials",
    **_NORM,
)

register(
    op="swiglu",
    name="triton.swiglu",
    forward=tsw.swiglu_forward,
    plan_no_grad=tsw.swiglu_plan_no_grad,
    backward=tsw.swiglu_backward,
    layout={"*": "rows", "y": "contiguous"},
    config_space=tsw.CONFIG_SPACE,
    default_config=lambda call: dict(tsw.CONFIG),
    plan={},
    grad_invariances={"gate": ("run_to_run", "batch"), "up": ("run_to_run", "batch")},
    features=("approx_transcendentals",),
    summary="elementwise, float32 inside, one cast per output",
    **_TRITON,
)

register(
    op="normalized_embedding",
    name="triton.embedding",
    forward=emb.forward,
    backward=emb.backward,
    layout={"*": "contiguous", "table": "rows"},
    plan={
        "row_square": _plan(block=1, order="tree"),
        "row_dot": _plan(block=1, order="tree"),
        "dtable_t": _plan(block=1),
    },
    grad_invariances={"table": ("run_to_run",)},
    summary="fused gather + norm; table gradient per row over stably sorted tokens",
    **_TRITON,
)

def _m_n(call) -> tuple[int | None, int | None]:
    sizes = getattr(call, "sizes", None) or {}
    return sizes.get("M"), sizes.get("N")


register(
    op="dense_gemm",
    name="triton.gemm",
    forward=dg.gemm_forward,
    plan_no_grad=dg.gemm_plan_no_grad,
    backward=dg.gemm_backward,
    layout={"*": "rows", "bias": "contiguous", "y": "contiguous"},
    config_space=dg.CONFIG_SPACE,
    default_config=lambda call: dg.default_config(*_m_n(call)),
    **strict_declaration(),
    summary=(
        "tiled GEMM, K in 256-element promoted partials added in ascending order (by the "
        "K loop, or by a second pass over partials computed in parallel), no split-K, "
        "bias in float32"
    ),
    **_TRITON,
)

register(
    op="segmented_gemm",
    name="triton.segmented_gemm",
    forward=sg.forward,
    backward=sg.backward,
    layout={"*": "rows", "acc": "contiguous"},
    config_space=dg.CONFIG_SPACE,
    default_config=lambda call: dg.default_config(),
    summary="dense_gemm's Triton kernel per segment into float32 planes, an adjacent-pair tree",
    **_TRITON,
    **segmented_declaration(),
)

register(
    op="qk_norm_rope",
    name="triton.qk",
    forward=qkr.forward,
    plan_no_grad=forward_plan(qkr.forward),
    backward=qkr.backward,
    layout={"*": "contiguous"},
    plan={
        "row_square": _plan(block=1, order="tree"),
        "row_dot": _plan(block=1, order="tree"),
    },
    grad_invariances={"q": ("run_to_run", "batch"), "k": ("run_to_run", "batch")},
    summary="one program per (token, head): halves' tree sums, float64 angles, one rounding",
    **_TRITON,
)

register(
    op="gated_attention",
    name="triton.attention",
    forward=ga.forward,
    plan_no_grad=forward_plan(ga.forward),
    backward=ga.backward,
    layout={"*": "contiguous"},
    plan={
        "qk_d": _plan(block=16),
        "key_blocks": _plan(block=ga.BLOCK, merge="online_max_rescale"),
        "key_chunks": _plan(block=ga.CHUNK_BLOCKS * ga.BLOCK, merge="online_max_rescale"),
        "grad_dq_keys": _plan(block=ga.BLOCK),
        "grad_dkv_queries": _plan(block=ga.BLOCK),
        "grad_delta_d": _plan(block=1, order="tree"),
    },
    grad_invariances={
        "q": ("run_to_run", "batch"),
        "k": ("run_to_run",),
        "v": ("run_to_run",),
        "gate": ("run_to_run", "batch"),
    },
    features=("approx_transcendentals",),
    config_space=ga.CONFIG_SPACE,
    default_config=ga.default_config,
    summary="GQA rows of one sequence a tile, position-aligned key blocks, chunks merged in order",
    **_TRITON,
)
