"""dense_gemm's declaration that every backend's strict implementation shares: K (and N, M
in the backward) in the contract's 256-element float32 partials added in ascending order,
the bias gradient by a fixed pairwise tree."""

from __future__ import annotations

from opcontract.contracts import get_contract
from opcontract.contracts.schema import ReductionPlan

K_BLOCK = get_contract("dense_gemm").reductions["gemm_k"].block


def needed(needs: dict | None, has_bias: bool) -> dict[str, bool]:
    """Which of dx, dweight, dbias a backward computes: autograd's ``needs`` (None: all),
    dbias only where there is a bias. Each is its own sum, so skipping one moves no bit."""
    needs = needs or {}
    return {
        "x": needs.get("x", True),
        "weight": needs.get("weight", True),
        "bias": has_bias and needs.get("bias", True),
    }


def strict_declaration() -> dict:
    """The ``plan`` and ``grad_invariances`` of a strict dense_gemm implementation."""

    def plan(**kw) -> ReductionPlan:
        return ReductionPlan(accumulate="float32", **kw)

    return dict(
        plan={
            "gemm_k": plan(block=K_BLOCK),
            "grad_x_n": plan(block=K_BLOCK),
            "grad_weight_m": plan(block=K_BLOCK),
            "grad_bias_m": plan(block=1, order="pairwise"),
        },
        grad_invariances={
            "x": ("run_to_run", "batch"),
            "weight": ("run_to_run",),
            "bias": ("run_to_run",),
        },
    )


def segmented_declaration() -> dict:
    """The ``plan`` and ``grad_invariances`` of a segmented_gemm implementation: dense_gemm's
    strict K (and dx's N) sums per segment, the segments met by an adjacent-pair tree."""

    def plan(**kw) -> ReductionPlan:
        return ReductionPlan(accumulate="float32", **kw)

    return dict(
        plan={
            "gemm_k": plan(block=K_BLOCK, split="fixed_blocks"),
            "segment_tree": plan(block=1, order="pairwise"),
            "grad_x_n": plan(block=K_BLOCK, split="fixed_blocks"),
            "grad_segment_tree": plan(block=1, order="pairwise"),
            "grad_weight_m": plan(block=K_BLOCK),
        },
        grad_invariances={"x": ("run_to_run", "batch"), "weight": ("run_to_run",)},
    )
