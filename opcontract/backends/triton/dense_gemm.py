"""Host code of the Triton dense_gemm: the shared promoted GEMM kernel, forward and backward."""

from __future__ import annotations

import functools

import torch

from opcontract.backends.dense_gemm import K_BLOCK  # the contract's gemm_k block
from opcontract.backends.fixed_order import pairwise_sum
from opcontract.backends.triton import interpreting
from opcontract.backends.triton.launch import launch

STEP_K = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}
CONFIG = {
    "block_m": 128,
    "block_n": 128,
    "group_m": 8,
    "num_warps": 8,
    "num_stages": 3,
    "parallel_partials": False,
}
INTERPRETER_CONFIG = {"block_m": 32, "block_n": 64}
# Tile sizes along M and N, launch order and pipelining: none decides a reduction's order
# (the tuner verifies that bitwise for every candidate). parallel_partials: the contract's
# 256-element K partials of a small-M call computed by separate programs (a GEMV streams
# the weight with every SM), then added in ascending order from zero, as the K loop adds
# them (see fuse_sum); used where their float32 planes fit in PARTIALS_BYTES.
CONFIG_SPACE = {
    "block_m": (16, 32, 64, 128),
    "block_n": (32, 64, 128, 256),
    "group_m": (1, 8),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
    "parallel_partials": (False, True),
}
PARTIALS_BYTES = 64 << 20
ADD_BLOCK = 512  # elements per program of the second launch's plane sum
ADD_UNROLL = 8  # planes whose loads are issued together (the adds stay in plane order)
_ARRIVALS: dict[tuple[int, int], torch.Tensor] = {}


def default_config() -> dict:
    return dict(CONFIG, **(INTERPRETER_CONFIG if interpreting() else {}))


def _arrivals(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-tile arrival counters for a fused parallel-partials launch, zero before it and
    after it (each tile's last program resets its own). Kept per stream, since launches on
    one stream never overlap (fuse_sum keeps graph captures off them)."""
    if device.type != "cuda":
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    buf = _ARRIVALS.get(key)
    if buf is None or buf.numel() < tiles:
        buf = _ARRIVALS[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return buf


FUSE_MAX_BYTES = 64 << 20  # weights whose stream is shorter than a call's host time


def fuse_sum(device: torch.device, weight_bytes: int) -> bool:
    """Whether parallel partials are summed in their own launch (by each tile's last
    program) or by a second one. The bits are the same. One launch costs less host time,
    which decides an eager call whose weight streams faster than the host issues the call
    (o_proj at M = 1 on the H200); the last program's sum costs GPU time, which decides
    the rest, and a CUDA graph, where host time doesn't count
    (benchmarks/results/host_profile_h200.json)."""
    if device.type != "cuda":
        return True
    return weight_bytes <= FUSE_MAX_BYTES and not torch.cuda.is_current_stream_capturing()


@functools.cache
def _kernels():
    from opcontract.backends.triton import dense_gemm_kernels

    return dense_gemm_kernels


def _gemm(a, b, c, bias, M, N, K, sa, sb, config=None):
    gk = _kernels()
    interp = interpreting()
    cfg = config
    if cfg is None or not cfg.keys() >= CONFIG.keys():  # a complete config is taken as given
        cfg = {**default_config(), **(cfg or {})}
    step = STEP_K[a.dtype]
    chunks = -(-K // K_BLOCK)
    parallel = cfg["parallel_partials"] and chunks > 1 and chunks * M * N * 4 <= PARTIALS_BYTES
    tiles = -(-M // cfg["block_m"]) * -(-N // cfg["block_n"])
    fuse = parallel and fuse_sum(c.device, N * K * a.element_size())
    if parallel:  # c is contiguous [M, N] here (forward's y or backward's dx), as a plane is
        planes = torch.empty(chunks, M, N, dtype=torch.float32, device=c.device)
    else:
        planes = c
    launch(
        gk._gemm_kernel,
        (tiles, chunks if parallel else 1),
        a,
        b,
        planes,
        bias if bias is not None else c,
        M,
        N,
        K,
        *sa,
        *sb,
        N if parallel else c.stride(0),
        1,
        M * N if parallel else 0,
        0.0,
        c,
        _arrivals(c.device, tiles) if fuse else c,
        ACCUMULATE=False,
        BIAS=bias is not None,
        INTERPRET=interp,
        PROMOTE=K_BLOCK // step,
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=step,
        GROUP_M=cfg["group_m"],
        CHUNK=K_BLOCK if parallel else 0,
        FUSE_SUM=fuse,
        SEEDED=False,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if parallel and not fuse:
        launch(
            gk._add_partials_kernel,
            (-(-M * N // ADD_BLOCK),),
            planes,
            c,
            bias if bias is not None else planes,
            M * N,
            N,
            chunks,
            M * N,
            BIAS=bias is not None,
            BLOCK=ADD_BLOCK,
            UNROLL=ADD_UNROLL,
            num_warps=4,
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
    if N and K:  # dw [N, K] = dy.T [N, M] @ x [M, K]; the token loop stays in one program
        dw_config = {**(config or {}), "parallel_partials": False}
        _gemm(dy, x, dw, None, N, K, M, (1, dy.stride(0)), (x.stride(0), 1), dw_config)
    if M == 0:
        dw.zero_()
    db = None
    if has_bias:  # grad_bias_m: a fixed pairwise tree over rows
        db = pairwise_sum(dy.float()).to(weight.dtype, copy=True)
    return dx, dw, db


def gemm_forward(config, x, weight, bias):
    return (forward(x, weight, bias, config),)


def gemm_backward(config, saved, grads, needs, **params):
    dx, dw, db = backward(grads["y"], saved["x"], saved["weight"], saved["bias"] is not None,
                          config)  # fmt: skip
    return {"x": dx, "weight": dw, "bias": db}
