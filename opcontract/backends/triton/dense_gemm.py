"""Host code of the Triton dense_gemm: the shared promoted GEMM kernel, forward and backward."""

from __future__ import annotations

import torch

from opcontract.backends.gemm_op import K_BLOCK  # the contract's gemm_k block
from opcontract.backends.torch.linear_cross_entropy import pairwise_sum
from opcontract.backends.triton import interpreting

STEP_K = {"bfloat16": 64, "float16": 64, "float32": 32}
CONFIG = {"block_m": 128, "block_n": 128, "group_m": 8, "num_warps": 8, "num_stages": 3}
INTERPRETER_CONFIG = {"block_m": 32, "block_n": 64}
# Tile sizes along M and N, launch order and pipelining: none decides a reduction's order
# (the tuner verifies that bitwise for every candidate).
CONFIG_SPACE = {
    "block_m": (16, 32, 64, 128),
    "block_n": (32, 64, 128, 256),
    "group_m": (1, 8),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
}


def default_config() -> dict:
    return dict(CONFIG, **(INTERPRETER_CONFIG if interpreting() else {}))


def _gemm(a, b, c, bias, M, N, K, sa, sb, config=None):
    from opcontract.backends.triton.gemm_kernels import _gemm_kernel

    cfg = {**default_config(), **(config or {})}
    step = STEP_K[str(a.dtype).removeprefix("torch.")]
    grid = (-(-M // cfg["block_m"]) * -(-N // cfg["block_n"]),)
    _gemm_kernel[grid](
        a,
        b,
        c,
        bias if bias is not None else c,
        M,
        N,
        K,
        *sa,
        *sb,
        c.stride(0),
        1,
        0.0,
        ACCUMULATE=False,
        BIAS=bias is not None,
        INTERPRET=interpreting(),
        PROMOTE=K_BLOCK // step,
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=step,
        GROUP_M=cfg["group_m"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def forward(x, weight, bias, config=None):
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        _gemm(x, weight, y, bias, M, N, K, (x.stride(0), 1), (1, weight.stride(0)), config)
    return y


def backward(dy, x, weight, has_bias, config=None):
    dy = dy.contiguous()
    x = x.contiguous()
    weight = weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    dx = torch.empty_like(x)
    dw = torch.empty_like(weight)
    if M and K:  # dx [M, K] = dy [M, N] @ weight [N, K]
        _gemm(dy, weight, dx, None, M, K, N, (dy.stride(0), 1), (weight.stride(0), 1), config)
    if N and K:  # dw [N, K] = dy.T [N, M] @ x [M, K]
        _gemm(dy, x, dw, None, N, K, M, (1, dy.stride(0)), (x.stride(0), 1), config)
    if M == 0:
        dw.zero_()
    db = None
    if has_bias:  # grad_bias_m: a fixed pairwise tree over rows
        db = pairwise_sum(dy.float()).to(weight.dtype, copy=True)
    return dx, dw, db
