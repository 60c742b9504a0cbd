"""Host code of the CuTe DSL dense_gemm (SM90): shapes, TMA-ready operands, the compile cache,
the launch, and forward/backward in the signature of the other backends' dense_gemm.

Importing this module never imports CUTLASS; the first call does.

The kernel (dense_gemm_kernels.py) computes c = a @ b.T with a [M, K], b [N, K] (K-major, or
MN-major transposed views), with the contract's gemm_k numerics (256-element float32 partials,
ascending); ``gemm(..., addend=)`` adds a float32 [M, N] matrix after the sum or starts the sum
from it (the LM head's backward), into a float32 or 16-bit output. TMA needs 16-byte
aligned rows: operands whose K is not a multiple of 8 (or that are strided or misaligned) are
copied into zero-padded buffers, and an output whose N is not a multiple of 8 is written into
a padded buffer and copied out. Zero padding along K is what the kernel's K tail sees anyway
(TMA's zero fill, like Triton's masked loads), so padding moves no bits.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from opcontract.backends.dense_gemm import (
    K_BLOCK,  # noqa: F401 - the kernel's CHUNK_K, by contract
    needed,
)
from opcontract.backends.fixed_order import pairwise_sum

CONFIG = {"tile_m": 128, "tile_n": 128, "group_m": 8, "overlap": 1}
# Tile sizes along M and N decide which CTA computes an element, and group_m (row tiles
# that share each column block in L2) when; neither the order of an element's sum. overlap
# (where K is a multiple of 512) adds a chunk's partial while the next chunk's MMAs run:
# the same operations, in the same order.
CONFIG_SPACE = {
    "tile_m": (64, 128),
    "tile_n": (64, 128),
    "group_m": (1, 4, 8, 16),
    "overlap": (0, 1),
}
OVERLAP_K = 512  # K multiple the overlapped main loop needs (steps of 8 k-tiles of 64)
_ALIGN = 8  # elements of 2 bytes per 16 bytes: TMA's stride and base alignment

_compiled: dict[tuple, Any] = {}


def default_config() -> dict:
    """The canonical config (one config for every M: batch invariance needs no tuning)."""
    return dict(CONFIG)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _mn_major(t: torch.Tensor) -> bool:
    """Whether TMA can read ``t`` [R, C] (R the M or N extent, C the K extent) as it is,
    MN-major: unit row stride (a transposed view of a row-major matrix), R and the column
    stride multiples of 8, a 16-byte aligned base, and C a multiple of 8 (no K padding). The
    WGMMA reads MN-major tiles from shared memory; the products and their order along K are
    those of the K-major layout."""
    R, C = t.shape
    return (
        t.stride(0) == 1
        and R % _ALIGN == 0
        and C % _ALIGN == 0
        and t.stride(1) >= R
        and t.stride(1) % _ALIGN == 0
        and t.data_ptr() % 16 == 0
    )


def _tma_ready(t: torch.Tensor, cols: int) -> torch.Tensor:
    """``t`` [R, C] itself when TMA can read it as [R, cols] (cols == C, unit column stride,
    16-byte aligned rows and base), else a zero-padded contiguous [R, cols] copy."""
    R, C = t.shape
    if (
        C == cols
        and t.stride(1) == 1
        and t.stride(0) >= cols
        and t.stride(0) % _ALIGN == 0
        and t.data_ptr() % 16 == 0
    ):
        return t
    out = t.new_zeros(R, cols)
    out[:, :C] = t
    return out


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _no_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # the kernel compiled without bias never reads it
    return torch.zeros(_ALIGN, dtype=dtype, device=device)


@functools.cache
def _no_addend(device: torch.device) -> torch.Tensor:
    # the kernel compiled without an addend never reads it
    return torch.zeros(1, _ALIGN, dtype=torch.float32, device=device)


def _writable(t: torch.Tensor | None, M: int, N: int, dtype: torch.dtype) -> bool:
    """Whether the kernel's TMA store can write ``t`` [M, N] in place: row-major with unit
    column stride, N and the row stride multiples of 8, a 16-byte aligned base."""
    return (
        t is not None
        and t.shape == (M, N)
        and t.dtype == dtype
        and t.stride(1) == 1
        and N % _ALIGN == 0
        and t.stride(0) >= N
        and t.stride(0) % _ALIGN == 0
        and t.data_ptr() % 16 == 0
    )


@functools.cache
def _tvm_ffi() -> bool:
    """Whether compiled kernels take torch tensors through TVM FFI (``apache-tvm-ffi``):
    a C-level call that reads the stream from torch, instead of building DLPack views and
    CUDA stream objects in Python on every call."""
    try:
        import tvm_ffi  # noqa: F401
    except Exception:
        return False
    return True


def _cute_tensor(t: torch.Tensor, leading_dim: int):
    from cutlass.cute.runtime import from_dlpack

    align = 16 if t.dim() == 2 else t.element_size()
    # DLPack refuses tensors that require grad; the kernel only reads or writes the buffer
    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=leading_dim)


def _fake_args(
    dtype: torch.dtype, a_mn: bool = False, b_mn: bool = False, out: torch.dtype | None = None
) -> tuple:
    """Compile-time stand-ins for (a, b, c, bias, addend, num_ctas, stream) under TVM FFI:
    c in ``out`` (default the input dtype), the addend float32; row-major
    matrices with any row count, 8-divisible column count and row stride, 16-byte aligned
    (what the host guarantees); the stream is the caller's current torch stream."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dt = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]

    def matrix(mn: bool = False, dt=dt):
        if mn:  # a transposed view: unit stride along the rows
            return make_fake_tensor(
                dt,
                (cute.sym_int64(divisibility=_ALIGN), cute.sym_int64(divisibility=_ALIGN)),
                (1, cute.sym_int64(divisibility=_ALIGN)),
                assumed_align=16,
            )
        return make_fake_tensor(
            dt,
            (cute.sym_int64(), cute.sym_int64(divisibility=_ALIGN)),
            (cute.sym_int64(divisibility=_ALIGN), 1),
            assumed_align=16,
        )

    bias = make_fake_tensor(dt, (cute.sym_int64(),), (1,), assumed_align=2)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    c = matrix() if out in (None, dtype) else matrix(dt=cutlass.Float32)
    addend = make_fake_tensor(
        cutlass.Float32,
        (cute.sym_int64(), cute.sym_int64()),
        (cute.sym_int64(), 1),
        assumed_align=4,
    )
    return matrix(a_mn), matrix(b_mn), c, bias, addend, cutlass.Int32(1), stream


def _dlpack_args(a, b, c, bias, addend, num_ctas):
    import cuda.bindings.driver as cuda
    import cutlass

    stream = cuda.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
    return (
        _cute_tensor(a, 0 if a.stride(0) == 1 and a.stride(1) != 1 else 1),
        _cute_tensor(b, 0 if b.stride(0) == 1 and b.stride(1) != 1 else 1),
        _cute_tensor(c, 1),
        _cute_tensor(bias, 0),
        _cute_tensor(addend, 1),
        cutlass.Int32(num_ctas),
        stream,
    )


def compile_kernel(key: tuple, args: tuple | None = None) -> Any:
    """The kernel of ``key`` (dtype, tile_m, tile_n, group_m, has_bias, overlap, a and b
    MN-major, output dtype, addend mode) compiled: for TVM FFI's stand-in arguments when
    ``args`` is None, else for these DLPack arguments. Needs no GPU where CUTE_DSL_ARCH names
    the target (sm_90a): what the CPU can check of the kernel is that it compiles."""
    import cutlass.cute as cute

    from opcontract.backends.cute.dense_gemm_kernels import PromotedGemmSm90

    dtype, tile_m, tile_n, group_m, has_bias, overlap, a_mn, b_mn, out, mode = key
    kernel = PromotedGemmSm90(tile_m, tile_n, has_bias, group_m, overlap, mode)
    if args is None:
        return cute.compile(kernel, *_fake_args(dtype, a_mn, b_mn, out), options="--enable-tvm-ffi")
    return cute.compile(kernel, *args)


def _launch(key: tuple, a, b, c, bias, addend, num_ctas: int) -> None:
    """Compile once per key (dtype, tiles, group, bias, overlap, a and b MN-major, output
    dtype, addend mode), then launch on the current stream."""
    ffi = _tvm_ffi()
    args = None if ffi else _dlpack_args(a, b, c, bias, addend, num_ctas)
    fn = _compiled.get(key)
    if fn is None:
        fn = compile_kernel(key, args)
        _compiled[key] = fn
    if ffi:  # DLPack refuses tensors that require grad; the kernel only reads them
        fn(_plain(a), _plain(b), c, _plain(bias), _plain(addend), num_ctas)
    else:
        fn(*args)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad else t


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: dict | None = None,
    *,
    out: torch.Tensor | None = None,
    addend: torch.Tensor | None = None,
    seed: bool = False,
) -> torch.Tensor:
    """c [M, N] = a [M, K] @ b [N, K].T (+ bias [N], in float32), in a's dtype (bf16/fp16).

    gemm_k numerics: 256-element K partials in float32, ascending, one cast at the end.
    ``addend`` (float32 [M, N], no bias): c = addend + the sum, or with ``seed`` the sum
    starts from addend instead of +0, ((addend + p_0) + p_1) + ..., so that calls over K
    ranges cut on 256-element chunks chain into one call's bits. ``out`` (a's dtype, or
    float32: the sum unrounded) receives c; it may be the addend itself.
    """
    cfg = {**CONFIG, **(config or {})}
    M, K = a.shape
    N = b.shape[0]
    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype:
        raise TypeError(f"cute dense_gemm serves bfloat16/float16, got {a.dtype}, {b.dtype}")
    if bias is not None and bias.dtype != a.dtype:
        raise TypeError(f"bias dtype {bias.dtype} differs from {a.dtype}")
    if addend is not None:
        if bias is not None:
            raise ValueError("addend and bias are exclusive")
        if addend.dtype != torch.float32 or addend.shape != (M, N) or addend.stride(1) != 1:
            raise ValueError(f"addend must be float32 [{M}, {N}] with unit column stride")
    elif seed:
        raise ValueError("seed needs an addend")
    out_dtype = a.dtype if out is None else out.dtype
    if out_dtype not in (a.dtype, torch.float32):
        raise TypeError(f"out dtype {out_dtype}: {a.dtype} or float32")
    if M == 0 or N == 0:
        return a.new_empty(M, N, dtype=out_dtype) if out is None else out
    if K == 0:  # an empty sum: +0 (+ bias) in float32, or the addend (+ 0), one cast
        acc = torch.zeros(M, N, dtype=torch.float32, device=a.device)
        if bias is not None:
            acc = acc + bias.float()
        elif addend is not None:
            acc = addend.clone() if seed else addend + acc
        return acc.to(out_dtype) if out is None else out.copy_(acc)
    Kp = _round_up(K, _ALIGN)
    Np = _round_up(N, _ALIGN)
    a_mn, b_mn = _mn_major(a), _mn_major(b)  # transposed views are read as they are
    a = a if a_mn else _tma_ready(a, Kp)
    b = b if b_mn else _tma_ready(b, Kp)
    in_place = _writable(out, M, N, out_dtype)
    c = out if in_place else torch.empty(M, Np, dtype=out_dtype, device=a.device)
    bias_t = bias.contiguous() if bias is not None else _no_bias(a.device, a.dtype)
    addend_t = addend if addend is not None else _no_addend(a.device)
    mode = "none" if addend is None else ("seed" if seed else "add")
    tile_m, tile_n = int(cfg["tile_m"]), int(cfg["tile_n"])
    tiles = -(-M // tile_m) * -(-N // tile_n)
    num_ctas = min(tiles, _sm_count(a.device.index or 0))
    overlap = bool(int(cfg.get("overlap", 0))) and Kp % OVERLAP_K == 0
    key = (a.dtype, tile_m, tile_n, int(cfg["group_m"]), bias is not None, overlap, a_mn, b_mn,
           out_dtype, mode)  # fmt: skip
    if a.device.type != "cuda" or a.device.index == torch.cuda.current_device():
        _launch(key, a, b, c, bias_t, addend_t, num_ctas)
    else:  # the kernel launches on the current device: make it a's
        with torch.cuda.device(a.device):
            _launch(key, a, b, c, bias_t, addend_t, num_ctas)
    if in_place:
        return out
    c = c if Np == N else c[:, :N]
    return c.contiguous() if out is None else out.copy_(c)


def forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: dict | None = None
) -> torch.Tensor:
    """y = x @ weight.T (+ bias): the contract's forward."""
    return gemm(x, weight, bias, config)


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    has_bias: bool,
    config: dict | None = None,
    needs: dict | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight, dbias) with the same kernel, its transposed operands read MN-major in
    place (no copies); ``needs`` (default all) leaves an unneeded one None and its GEMM unrun.

    grad_x_n: dx = dy @ weight, partials of 256 along N; grad_weight_m: dw = dy.T @ x,
    partials of 256 along M; grad_bias_m: a fixed pairwise tree over rows.
    """
    need = needed(needs, has_bias)
    dy = dy.contiguous()
    dx = gemm(dy, weight.T, None, config) if need["x"] else None  # [M, N] @ [K, N].T
    dw = None
    if need["weight"]:  # [N, M] @ [K, M].T
        dw = gemm(dy.T, x.T, None, config)
    db = pairwise_sum(dy.float()).to(weight.dtype, copy=True) if need["bias"] else None
    return dx, dw, db


def gemm_forward(config, x, weight, bias):
    return (forward(x, weight, bias, config),)


def gemm_backward(config, saved, grads, needs, **params):
    dx, dw, db = backward(
        grads["y"], saved["x"], saved["weight"], saved["bias"] is not None, config, needs
    )
    return {"x": dx, "weight": dw, "bias": db}
