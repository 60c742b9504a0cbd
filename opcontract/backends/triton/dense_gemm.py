"""Host code of the Triton dense_gemm: the shared promoted GEMM kernel, forward and backward."""

from __future__ import annotations

import functools

import torch

from opcontract.backends.dense_gemm import K_BLOCK, needed  # K_BLOCK: the contract's gemm_k block
from opcontract.backends.fixed_order import pairwise_sum
from opcontract.backends.placement import may_keep
from opcontract.backends.triton import interpreting
from opcontract.backends.triton.launch import launch, prepared

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
KEPT_PLANES_BYTES = 1 << 20  # a fused call plan keeps partials up to this size (M = 1)
ADD_BLOCK = 512  # elements per program of the second launch's plane sum
ADD_UNROLL = 8  # planes whose loads are issued together (the adds stay in plane order)
_ARRIVALS: dict[tuple[int, int], torch.Tensor] = {}


# Decode-sized calls (M <= 64 rows) stream the weight: narrow M tiles, and the K partials
# in parallel where the tiles alone would leave most SMs idle. Taken from the H200 table's
# tuned decode entries (M = 1 / 16 / 64 of the Muse Glimmer projections); untuned, a call of
# M = 1 ran the 128 x 128 tiles on N / 128 programs: q_proj 95 us against F.linear's 18
# (benchmarks/results/host_time_matcher_h200.json). No choice here changes a bit.
SMALL_M_CONFIG = {
    16: {"block_m": 16, "block_n": 128, "group_m": 1, "num_warps": 4, "num_stages": 3},
    64: {"block_m": 64, "block_n": 32, "group_m": 1, "num_warps": 4, "num_stages": 4},
}
ONE_WAVE_TILES = 128  # below this many tiles, a small-M call computes its partials in parallel


def default_config(M: int | None = None, N: int | None = None) -> dict:
    """The canonical config; for a call of M <= 64 rows (decode), SMALL_M_CONFIG's tiles."""
    cfg = dict(CONFIG)
    if M is not None and N is not None and 0 < M <= 64 and not interpreting():
        cfg.update(SMALL_M_CONFIG[16 if M <= 16 else 64])
        tiles = -(-M // cfg["block_m"]) * -(-N // cfg["block_n"])
        cfg["parallel_partials"] = tiles < ONE_WAVE_TILES
    return dict(cfg, **(INTERPRETER_CONFIG if interpreting() else {}))


def _arrivals(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-tile arrival counters for a fused parallel-partials launch, zero before it and
    after it (each tile's last program resets its own). Kept per stream, since launches on
    one stream never overlap (fuse_sum keeps graph captures off them)."""
    if device.type != "cuda" or not may_keep(device):  # a graph's pool: the call's own
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    buf = _ARRIVALS.get(key)
    if buf is None or buf.numel() < tiles:
        buf = _ARRIVALS[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return buf


# Up to the q/k/v/gate grouping's 116 MB weight: fused, it took 0.98x F.linear's host time
# against 1.38x for two launches, and 36.2 us of GPU time against 36.9
# (benchmarks/results/host_time_qkv_fused_h200.json, host_time_addresses_h200.json).
FUSE_MAX_BYTES = 128 << 20


def fuse_sum(device: torch.device, weight_bytes: int) -> bool:
    """Whether parallel partials are summed in their own launch (by each tile's last
    program) or by a second one. The bits are the same. One launch costs less host time,
    which decides an eager call whose weight streams about as fast as the host issues the
    call (o_proj and the q/k/v/gate grouping at M = 1 on the H200); a second launch is kept
    for larger weights and for a CUDA graph, where host time doesn't count
    (benchmarks/results/host_profile_h200.json)."""
    if device.type != "cuda":
        return True
    return weight_bytes <= FUSE_MAX_BYTES and not torch.cuda.is_current_stream_capturing()


@functools.cache
def _kernels():
    from opcontract.backends.triton import dense_gemm_kernels

    return dense_gemm_kernels


def _decide(a, c, M, N, K, config):
    """(config, parallel partials, fused sum, tiles, K chunks) of a call."""
    cfg = config
    if cfg is None or not cfg.keys() >= CONFIG.keys():  # a complete config is taken as given
        cfg = {**default_config(M, N), **(cfg or {})}
    chunks = -(-K // K_BLOCK)
    parallel = cfg["parallel_partials"] and chunks > 1 and chunks * M * N * 4 <= PARTIALS_BYTES
    tiles = -(-M // cfg["block_m"]) * -(-N // cfg["block_n"])
    fuse = parallel and fuse_sum(c.device, N * K * a.element_size())
    return cfg, parallel, fuse, tiles, chunks


def _launches(a, b, c, bias, planes, arrivals, M, N, K, sa, sb, decided) -> list[tuple]:
    """The (kernel, grid, runtime arguments, constexprs) of each launch, in order."""
    gk = _kernels()
    cfg, parallel, fuse, tiles, chunks = decided
    step = STEP_K[a.dtype]
    out = [
        (
            gk._gemm_kernel,
            (tiles, chunks if parallel else 1),
            (
                a, b, planes, bias if bias is not None else c, M, N, K, *sa, *sb,
                N if parallel else c.stride(0), 1, M * N if parallel else 0, 0.0, c,
                arrivals if fuse else c,
            ),
            dict(
                ACCUMULATE=False,
                BIAS=bias is not None,
                INTERPRET=interpreting(),
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
            ),
        )
    ]  # fmt: skip
    if parallel and not fuse:
        out.append(
            (
                gk._add_partials_kernel,
                (-(-M * N // ADD_BLOCK),),
                (planes, c, bias if bias is not None else planes, M * N, N, chunks, M * N),
                dict(BIAS=bias is not None, BLOCK=ADD_BLOCK, UNROLL=ADD_UNROLL, num_warps=4),
            )
        )
    return out


def _planes(M, N, chunks, device):
    return torch.empty(chunks, M, N, dtype=torch.float32, device=device)


def _gemm(a, b, c, bias, M, N, K, sa, sb, config=None):
    decided = _decide(a, c, M, N, K, config)
    _, parallel, fuse, tiles, chunks = decided
    # c is contiguous [M, N] where partials are parallel (forward's y or backward's dx), as
    # a plane is
    planes = _planes(M, N, chunks, c.device) if parallel else c
    arrivals = _arrivals(c.device, tiles) if fuse else None
    for kernel, grid, args, meta in _launches(a, b, c, bias, planes, arrivals, M, N, K, sa, sb,
                                              decided):  # fmt: skip
        launch(kernel, grid, *args, **meta)


def forward(x, weight, bias, config=None):
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        _gemm(x, weight, y, bias, M, N, K, (x.stride(0), 1), (1, weight.stride(0)), config)
    return y


def backward(dy, x, weight, has_bias, config=None, needs=None):
    """(dx, dw, db); ``needs`` (``{"x", "weight", "bias"}: bool``, default all) leaves an
    unneeded one None and its GEMM unrun (each gradient is its own sum: no bit moves)."""
    need = needed(needs, has_bias)
    dy = dy.contiguous()
    x = x.contiguous()
    weight = weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    dx = dw = db = None
    if need["x"]:
        dx = torch.empty_like(x)
        if M and K:  # dx [M, K] = dy [M, N] @ weight [N, K]
            _gemm(dy, weight, dx, None, M, K, N, (dy.stride(0), 1), (weight.stride(0), 1),
                  config)  # fmt: skip
    if need["weight"]:
        dw = torch.empty_like(weight)
        if N and K:  # dw [N, K] = dy.T [N, M] @ x [M, K]; the token loop stays in one program
            dw_config = {**(config or {}), "parallel_partials": False}
            _gemm(dy, x, dw, None, N, K, M, (1, dy.stride(0)), (x.stride(0), 1), dw_config)
        if M == 0:
            dw.zero_()
    if need["bias"]:  # grad_bias_m: a fixed pairwise tree over rows
        db = pairwise_sum(dy.float()).to(weight.dtype, copy=True)
    return dx, dw, db


def gemm_forward(config, x, weight, bias):
    return (forward(x, weight, bias, config),)


def plan(config, x, weight, bias, lead):
    """The forward's call plan (see launch.prepared): y from the caller's (x, weight, None),
    x and weight contiguous, x with any leading dims; None where it can't serve a call. A
    biased call has none (no projection of the models served here has a bias)."""
    if x.device.type != "cuda" or not x.is_contiguous() or not weight.is_contiguous():
        return None
    if bias is not None or torch.cuda.is_current_stream_capturing():
        return None
    M, K = x.shape
    N = weight.shape[0]
    if not (M and N):
        return None
    shape = (*(lead or (M,)), N)
    y = torch.empty(shape, dtype=x.dtype, device=x.device)
    c = y.view(M, N)
    decided = _decide(x, c, M, N, K, config)
    _, parallel, fuse, tiles, chunks = decided
    if fuse and not may_keep(x.device):  # a fused plan keeps its partials and counters
        return None
    planes = _planes(M, N, chunks, x.device) if parallel else c
    arrivals = _arrivals(x.device, tiles) if fuse else None
    launches = _launches(x, weight, c, bias, planes, arrivals, M, N, K, (x.stride(0), 1),
                         (1, weight.stride(0)), decided)  # fmt: skip
    # the first launch's x and weight are the caller's; the rest are fresh or the plan's own
    gos = [prepared(*step, checked=(0, 1) if i == 0 else ()) for i, step in enumerate(launches)]
    if None in gos:
        return None
    scalars = launches[0][2][4:-2]  # M .. the bias-free zero: fixed by the signature
    sum_scalars = launches[1][2][3:] if len(launches) > 1 else ()
    dtype, device, empty = x.dtype, x.device, torch.empty
    del launches, x, weight, bias  # the plan keeps no example tensor
    index = device.index
    stream0 = torch._C._cuda_getCurrentRawStream(index)
    stream_of = torch._C._cuda_getCurrentRawStream
    capturing = torch._C._cuda_isCurrentStreamCapturing

    if not parallel:

        def run_tiled(x, weight, bias):
            if not (x.is_contiguous() and weight.is_contiguous()):
                return None
            y = empty(shape, dtype=dtype, device=device)
            yp = y.data_ptr()
            ok = gos[0](x.data_ptr(), weight.data_ptr(), yp, yp, *scalars, yp, yp)
            return (y,) if ok else None

        return run_tiled

    planes_shape = (chunks, M, N)
    f32 = torch.float32

    if fuse:
        # The plan's own partials on its stream, as the arrival counters are: launches on
        # one stream run one after another, and each writes its planes before it reads them.
        kept = planes if planes.numel() * 4 <= KEPT_PLANES_BYTES else None
        kept_p, arrivals_p = kept.data_ptr() if kept is not None else 0, arrivals.data_ptr()

        def run_fused(x, weight, bias):
            if not (x.is_contiguous() and weight.is_contiguous()):
                return None
            if stream_of(index) != stream0 or capturing():
                return None  # another stream's arrival counters, or a graph capture
            y = empty(shape, dtype=dtype, device=device)
            p = None if kept is not None else empty(planes_shape, dtype=f32, device=device)
            pp = kept_p if p is None else p.data_ptr()  # p lives until the launch is queued
            yp = y.data_ptr()
            ok = gos[0](x.data_ptr(), weight.data_ptr(), pp, yp, *scalars, yp, arrivals_p)
            return (y,) if ok else None

        return run_fused

    def run_two_launches(x, weight, bias):
        if not (x.is_contiguous() and weight.is_contiguous()):
            return None
        y = empty(shape, dtype=dtype, device=device)
        p = empty(planes_shape, dtype=f32, device=device)
        yp, pp = y.data_ptr(), p.data_ptr()
        if not gos[0](x.data_ptr(), weight.data_ptr(), pp, yp, *scalars, yp, yp):
            return None
        if not gos[1](pp, yp, pp, *sum_scalars):
            raise RuntimeError("dense_gemm plan: the partials' sum did not launch")
        return (y,)

    return run_two_launches


def gemm_plan_no_grad(config, inputs, params, lead):
    return plan(config, inputs["x"], inputs["weight"], inputs["bias"], lead)


def gemm_backward(config, saved, grads, needs, **params):
    dx, dw, db = backward(grads["y"], saved["x"], saved["weight"], saved["bias"] is not None,
                          config, needs)  # fmt: skip
    return {"x": dx, "weight": dw, "bias": db}
