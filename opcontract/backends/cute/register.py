"""Registrations of the CuTe DSL backend's implementations. Importing this never imports
CUTLASS: kernels and the library load on the first call."""

from __future__ import annotations

import functools

from opcontract.backends import triton as triton_backend
from opcontract.backends.cute import dense_gemm as dg
from opcontract.backends.cute import missing_library
from opcontract.backends.dense_gemm import strict_declaration
from opcontract.backends.registry import register
from opcontract.backends.triton import linear_cross_entropy as tlce
from opcontract.backends.triton import softcap_logprob as tslp
from opcontract.backends.triton.register import CE_PLAN, HEAD, LOGPROB_PLAN, head_plan_memory

# What every CuTe implementation shares: SM90 kernels (TMA, WGMMA, setmaxnreg), 16-bit floats.
_CUTE = dict(
    backend="cute",
    devices=("cuda",),
    capability=((9, 0), (9, 0)),
    dtypes=("bfloat16", "float16"),
    invariances=("run_to_run", "batch"),
    available=missing_library,
    # Above Triton (20): on the H200 it passed the conformance kit (bf16, fp16, forward and
    # gradients), its rows are bitwise equal to triton.gemm's on the four Muse Glimmer shapes
    # at every M tried, forward and backward, and it is faster from M = 256 up
    # (benchmarks/results/cute_gemm_h200.json). Where a tuning table times both, the faster
    # one per bucket serves; their equal bits keep that batch-invariant.
    priority={"cuda": 30},
)

register(
    op="dense_gemm",
    name="cute.gemm",
    forward=dg.gemm_forward,
    backward=dg.gemm_backward,
    layout={"*": "any"},  # copies into TMA-ready buffers itself where it must
    config_space=dg.CONFIG_SPACE,
    default_config=lambda call: dg.default_config(),
    **strict_declaration(),
    summary=(
        "warp-specialised TMA + WGMMA GEMM (SM90), K in 256-element float32 partials promoted "
        "in registers, no split-K, bias in float32; backward by the same kernel"
    ),
    **_CUTE,
)


def _head_libraries() -> str | None:
    """The heads run Triton kernels and CuTe GEMMs: why either is missing, or None."""
    return missing_library() or triton_backend.missing_library()


# The LM head with its backward's GEMMs (grad_weight = g.T @ hidden; grad_hidden summed over
# vocabulary chunks in a float32 buffer, or grad_weight over token chunks) on the CuTe
# mainloop, through its float32 addend epilogues; from ACC_MIN_T rows the forward's logits GEMM
# too (the partials read its float32 acc back); the logits' gradient g is triton.fused's
# kernel. The GEMMs' numerics are Triton's (256-element promoted partials, the float32 sums
# added in the same order), so every output and gradient is triton.fused's, bit for bit
# (tests/test_cute_head.py, on the H200 and H100). Above triton.fused (20): where both may serve
# and no table times them, the CuTe head serves. The backward's g reads its logits from a
# CuTe acc too (logits_gemm), from ACC_MIN_T rows: g's add of two products is an explicit fma
# in both g kernels (tests/test_head_ptx.py), so the elementwise kernel gives the fused one's
# bits.
_CUTE_HEAD = dict(
    HEAD,
    **{**_CUTE, "available": _head_libraries, "priority": {"cuda": 30}},
    plan_memory=functools.partial(head_plan_memory, grad_gemm="cute", logits_acc=True),
)
register(
    op="softcap_logprob",
    name="cute.fused",
    forward=functools.partial(tslp.forward, logits_gemm="cute"),
    backward=functools.partial(tslp.logprob_backward, grad_gemm="cute", logits_gemm="cute"),
    plan=LOGPROB_PLAN,
    summary="triton.fused's head with its GEMMs on the CuTe mainloop (same bits)",
    **_CUTE_HEAD,
)
register(
    op="linear_cross_entropy",
    name="cute.fused_ce",
    forward=functools.partial(tlce.forward, logits_gemm="cute"),
    backward=functools.partial(tlce.backward, grad_gemm="cute", logits_gemm="cute"),
    plan=CE_PLAN,
    summary="triton.fused_ce's head with its GEMMs on the CuTe mainloop (same bits)",
    **_CUTE_HEAD,
)
