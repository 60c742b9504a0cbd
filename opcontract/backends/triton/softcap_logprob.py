"""Host code of the Triton softcap_logprob: shapes, buffers, grids, the autograd Function."""

from __future__ import annotations

from typing import NamedTuple

import torch

from opcontract.backends.softcap_head import head_constants
from opcontract.backends.triton import interpreting
from opcontract.backends.triton.launch import launch
from opcontract.contracts import get_contract

_C = get_contract("softcap_logprob")
BLOCK_V = _C.reductions["vocab_lse"].block  # one partial per 128 vocabulary columns
# gemm_k, as declared in the plan: the tensor cores sum GEMM_K_BLOCK elements of H into a
# fresh float32 partial, and partials are added in ascending order with IEEE float32 adds.
# (The tensor cores' own accumulation truncates: left to run over all of H = 6656 its
# bias costs 3e-6 rel. error; promoted every 256 elements, 1e-7. H200 measurements in
# benchmarks/results/softcap_logprob_forward_explore_h200.json.)
GEMM_K_BLOCK = 256
# The K step of one loaded tile, per dtype (shared memory: 3 stages of 128-row tiles).
BLOCK_K = {"bfloat16": 128, "float16": 128, "float32": 64}

# Backward plans (the contract's ``plans``, equal bits): vocab_chunks walks the vocabulary
# in GRAD_CHUNK columns (grad_weight[chunk] one GEMM over all tokens, no [V, H] float32
# buffer); token_chunks walks the tokens in chunks of token_chunk rows (a multiple of
# GEMM_K_BLOCK, so a chunk's edges fall on grad_weight_t's promoted partials), adding each
# chunk's partials to a float32 [V, H] buffer in the same ascending order.
PLANS = ("vocab_chunks", "token_chunks")
TOKEN_CHUNKS = (256, 512, 1024, 2048)
_BASE = {"programs_per_sm": 1, "group_t": 8, "backward_plan": "vocab_chunks", "token_chunk": 1024}
DEFAULT_CONFIG = {
    "bfloat16": {**_BASE, "schedule": "tma", "block_t": 128, "num_warps": 8, "num_stages": 3},
    "float16": {**_BASE, "schedule": "tma", "block_t": 128, "num_warps": 8, "num_stages": 3},
    "float32": {**_BASE, "schedule": "tiles", "block_t": 32, "num_warps": 4, "num_stages": 2},
}
# Under the interpreter each K step is an explicit [block_t, 128, BLOCK_K] product, capped
# at 2**20 elements by Triton: smaller row tiles there (block_t never changes a row's bits).
INTERPRETER_BLOCK_T = 32

CONFIG_SPACE = {
    "schedule": ("tiles", "persistent", "tma", "apart"),
    "programs_per_sm": (1, 2),
    "block_t": (64, 128),
    "group_t": (1, 4, 8, 16),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
    "backward_plan": PLANS,
    "token_chunk": TOKEN_CHUNKS,
}
BACKWARD_ONLY = ("backward_plan", "token_chunk")  # config keys the forward never reads


# Decode-sized calls (T <= 64) waste half of a 128-row tile's MMA work: 64-row tiles.
# The two canonical tiles, (64 rows, 4 warps) and (128 rows, 8 warps), give the same bits
# (benchmarks/results/softcap_logprob_forward_explore_h200.json); so do 128 rows on 4 warps
# and any programs_per_sm. 64 rows on 8 warps does not: the H200 sweep's verification
# rejected it in every bucket (benchmarks/results/tuning_sweep_h200.json), never timed.
# Backward: grad_hidden accumulates one vocabulary chunk at a time (the contract's
# grad_hidden_v block); the gradient GEMMs promote every GEMM_K_BLOCK elements of K too.
GRAD_CHUNK = _C.reductions["grad_hidden_v"].block
GRAD_GEMM = {"block_m": 128, "block_n": 128, "group_m": 8, "num_warps": 8, "num_stages": 3}
GRAD_GEMM_INTERPRETER = {"block_m": 32, "block_n": 64}

SMALL_T = 64
SMALL_T_CONFIG = {"block_t": 64, "num_warps": 4, "programs_per_sm": 2}


def default_config(dtype: str, T: int | None = None) -> dict:
    """The canonical config for a call: a function of dtype and of T's bucket only."""
    cfg = dict(DEFAULT_CONFIG[dtype])
    if T is not None and T <= SMALL_T and dtype != "float32":
        cfg.update(SMALL_T_CONFIG)
    if interpreting():
        cfg["block_t"] = INTERPRETER_BLOCK_T
    return cfg


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned base pointers and row strides."""
    return all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors
    )


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a couple of programs exercise the tile loop
    return torch.cuda.get_device_properties(device).multi_processor_count


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _scalars(
    multiplier: float, softcap: float | None, temperature: float = 1.0
) -> tuple[float, float]:
    """(scale, outer) of z = outer * tanh(acc * scale), or z = acc * scale without a cap
    (outer unused): ``head_constants``, each formed in float64 and rounded once to float32
    as a kernel argument."""
    scale, outer, _ = head_constants(multiplier, softcap, temperature)
    return float(scale), 1.0 if outer is None else float(outer)


class HeadResult(NamedTuple):
    logprob: torch.Tensor
    entropy: torch.Tensor | None
    predicted: torch.Tensor | None
    lse: torch.Tensor
    mean_z: torch.Tensor | None
    smooth: torch.Tensor | None  # lse - mean_v z: label smoothing's term
    logits: torch.Tensor | None = None  # z [T, V] float32: the sampler head's
    mean_logits: torch.Tensor | None = None  # mean_v z, with zsum
    log_sum_sq_probs: torch.Tensor | None = None  # log sum_v p^2, with sq


def forward_all(
    hidden,
    weight,
    targets,
    *,
    multiplier=1.0,
    softcap=None,
    ignore_index=-100,
    entropy=False,
    argmax=False,
    zsum=False,
    sq=False,
    logits=False,
    config=None,
    _pinned=None,
    temperature=1.0,
    logits_gemm=None,
):
    """HeadResult of [T] tensors; entropy/mean_z, predicted, smooth/mean_logits (``zsum``) and
    log_sum_sq_probs (``sq``) only when asked for;
    with ``logits`` also z [T, V] float32, stored by the partials kernel from the very tile
    values it reduces (the sampler head).

    ``logits_gemm`` (a key of LOGITS_GEMMS, from ACC_MIN_T rows): the logits' GEMM runs apart
    into a float32 acc, a vocabulary chunk at a time, and the partials kernel reads it (the
    same acc and the same epilogue, so the same bits).

    ``config`` takes keys of CONFIG_SPACE. ``_pinned`` overrides the contract-pinned blocks
    (``block_v``, ``block_k``, ``promote``: K steps per promoted partial, 0 for never):
    for benchmarks exploring other contracts only; the result then breaks this contract.
    """
    from opcontract.backends.triton import softcap_logprob_kernels as k

    T, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    cfg = default_config(_dtype(hidden), T)
    cfg.update(config or {})
    pinned = _pinned or {}
    block_v = pinned.get("block_v", BLOCK_V)
    block_k = pinned.get("block_k", BLOCK_K[_dtype(hidden)])
    promote = pinned.get("promote", GEMM_K_BLOCK // block_k)
    f32 = dict(dtype=torch.float32, device=dev)
    logprob, lse = torch.empty(T, **f32), torch.empty(T, **f32)
    ent = torch.empty(T, **f32) if entropy else None
    mean_z = torch.empty(T, **f32) if entropy else None
    pred = torch.empty(T, dtype=torch.int64, device=dev) if argmax else None
    smooth = torch.empty(T, **f32) if zsum else None
    z_mean = torch.empty(T, **f32) if zsum else None
    log_sum_sq = torch.empty(T, **f32) if sq else None
    z = torch.empty(T, V, **f32) if logits else None
    result = HeadResult(logprob, ent, pred, lse, mean_z, smooth, z, z_mean, log_sum_sq)
    if T == 0:
        return result
    hidden, weight, targets = (
        _rows_contiguous(hidden),
        _rows_contiguous(weight),
        targets.contiguous(),
    )
    n_blocks = cdiv(V, block_v)
    pmax = torch.empty((n_blocks, T), **f32)
    psum = torch.empty_like(pmax)
    pzs = torch.empty_like(pmax) if entropy else pmax
    parg = torch.empty((n_blocks, T), dtype=torch.int32, device=dev) if argmax else pmax
    pzsum = torch.empty_like(pmax) if zsum else pmax
    psq = torch.empty_like(pmax) if sq else pmax
    z_t = torch.empty(T, **f32)
    bt = cfg["block_t"]
    flags = dict(
        HAS_CAP=softcap is not None,
        ENTROPY=entropy,
        ARGMAX=argmax,
        ZSUM=zsum,
        SQ=sq,
        LOGITS=logits,
        INTERPRET=interpreting(),
        PROMOTE=promote,
        BLOCK_T=bt,
        BLOCK_V=block_v,
        BLOCK_K=block_k,
        GROUP_T=cfg["group_t"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    outs = (targets, pmax, psum, pzs, parg, pzsum, psq, z_t, z if logits else pmax)
    scalars = (*_scalars(multiplier, softcap, temperature), 0.0)
    n_tiles = cdiv(T, bt) * n_blocks
    programs = min(n_tiles, _num_sms(dev) * cfg["programs_per_sm"])
    schedule = cfg["schedule"]
    if schedule not in CONFIG_SPACE["schedule"]:
        raise ValueError(f"unknown schedule {schedule!r}; one of {CONFIG_SPACE['schedule']}")
    if not _pinned and (schedule == "apart" or (logits_gemm is not None and T >= ACC_MIN_T)):
        mm = LOGITS_GEMMS[logits_gemm] if logits_gemm and T >= ACC_MIN_T else _logits_decode
        zero = torch.zeros(max(block_v, 16), dtype=hidden.dtype, device=dev)
        width = acc_columns(T, V)
        buf = torch.empty(T * width, **f32)
        for c0 in range(0, V, width):  # any width: each tile's partials are its own
            n = min(width, V - c0)
            acc = buf[: T * n].view(T, n)
            mm(hidden, weight[c0 : c0 + n], acc)
            launch(
                k._partials_from_acc_kernel,
                (cdiv(T, bt) * cdiv(n, block_v),),
                acc,
                acc.stride(0),
                zero,
                *outs,
                T,
                V,
                c0,
                n,
                *scalars[:2],
                **{f: flags[f] for f in ("HAS_CAP", "ENTROPY", "ARGMAX", "ZSUM", "SQ")},
                **{f: flags[f] for f in ("LOGITS", "INTERPRET", "BLOCK_T", "BLOCK_V")},
                GROUP_T=cfg["group_t"],
                num_warps=cfg["num_warps"],
            )
    elif schedule == "tma" and _tma_ok(hidden, weight):
        from triton.tools.tensor_descriptor import TensorDescriptor

        launch(
            k._partials_tma_kernel,
            (programs,),
            TensorDescriptor.from_tensor(hidden, [bt, block_k]),
            TensorDescriptor.from_tensor(weight, [block_v, block_k]),
            *outs,
            T,
            V,
            H,
            *scalars,
            NUM_PROGRAMS=programs,
            **flags,
        )
    else:  # "tma" without 16-byte aligned rows: the same tiles, the same bits, no TMA
        args = (hidden, weight, *outs, T, V, H, hidden.stride(0), weight.stride(0), *scalars)
        if schedule == "tiles":
            launch(
                k._partials_kernel,
                (n_tiles,),
                *args,
                EVEN_K=H % block_k == 0,
                **flags,
            )
        else:
            launch(
                k._partials_persistent_kernel,
                (programs,),
                *args,
                EVEN_K=H % block_k == 0,
                NUM_PROGRAMS=programs,
                **flags,
            )
    block_r = 128
    launch(
        k._merge_kernel,
        (cdiv(T, block_r),),
        pmax,
        psum,
        pzs,
        parg,
        pzsum,
        psq,
        z_t,
        targets,
        logprob,
        lse,
        ent if entropy else lse,
        mean_z if entropy else lse,
        pred if argmax else lse,
        smooth if zsum else lse,
        z_mean if zsum else lse,
        log_sum_sq if sq else lse,
        T,
        V,
        n_blocks,
        int(ignore_index),
        ENTROPY=entropy,
        ARGMAX=argmax,
        ZSUM=zsum,
        SQ=sq,
        BLOCK_R=block_r,
    )
    return result


def _gemm(a, b, c, M, N, K, sa, sb, sc, accumulate, seeded=False, out=None):
    """c (+)= a @ b with the strides given as (row, col) pairs; the K loop ascending.
    ``seeded``: the running sum starts at c and goes to ``out`` (c's strides; default c),
    see ``_gemm_kernel``'s SEEDED."""
    from opcontract.backends.triton import dense_gemm_kernels as k

    cfg = dict(GRAD_GEMM, **(GRAD_GEMM_INTERPRETER if interpreting() else {}))
    block_k = BLOCK_K[_dtype(a)]
    grid = (cdiv(M, cfg["block_m"]) * cdiv(N, cfg["block_n"]),)
    launch(
        k._gemm_kernel,
        grid,
        a,
        b,
        c,
        c,
        M,
        N,
        K,
        *sa,
        *sb,
        *sc,
        0,
        0.0,
        c if out is None else out,
        c,
        ACCUMULATE=accumulate,
        BIAS=False,
        INTERPRET=interpreting(),
        PROMOTE=GEMM_K_BLOCK // block_k,
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=block_k,
        GROUP_M=cfg["group_m"],
        CHUNK=0,
        FUSE_SUM=False,
        SEEDED=seeded,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def _mm_triton(a, b, c, *, accumulate=False, seeded=False, out=None):
    """c (+)= a [M, K] @ b [K, N] for strided views, by ``_gemm``."""
    M, K = a.shape
    _gemm(a, b, c, M, b.shape[1], K, a.stride(), b.stride(), c.stride(), accumulate, seeded, out)


def _mm_cute(a, b, c, *, accumulate=False, seeded=False, out=None):
    """``_mm_triton`` on the CuTe DSL GEMM (SM90, 16-bit inputs): the same 256-element
    promoted partials, so the same bits; the float32 sums by its addend epilogues."""
    from opcontract.backends.cute.dense_gemm import gemm

    if not accumulate:
        gemm(a, b.T, out=c)
    else:
        gemm(a, b.T, out=c if out is None else out, addend=c, seed=seeded)


GRAD_GEMMS = {"triton": _mm_triton, "cute": _mm_cute}
# The token count grad_weight's GEMM (K = T) reads is rounded up to this with zero rows: what
# the K tail's zero fill gives anyway (no bit moves), and the CuTe GEMM's TMA then reads g.T
# and hidden.T in place, where an unaligned K would copy both into padded buffers per chunk.
GRAD_K_ALIGN = {"triton": 1, "cute": 8}


def _logits_triton(hidden, weight_rows, acc):
    """acc [T, n] float32 = hidden @ weight_rows.T by ``_gemm``: the partials kernels' gemm_k."""
    _mm_triton(hidden, weight_rows.T, acc)


def _logits_cute(hidden, weight_rows, acc):
    """``_logits_triton`` on the CuTe DSL GEMM (the same promoted partials, the same acc)."""
    from opcontract.backends.cute.dense_gemm import gemm

    gemm(hidden, weight_rows, out=acc)


def logits_dense(hidden, weight_rows, acc, tile: dict):
    """acc [T, n] float32 = hidden @ weight_rows.T by the dense GEMM's kernel at ``tile``
    (keys of its CONFIG), whose tiles never move a bit (dense_gemm's tuner verifies that)."""
    from opcontract.backends.triton import dense_gemm as tdg

    T, H = hidden.shape
    cfg = dict(tdg.CONFIG, **tile, parallel_partials=False)
    tdg._gemm(hidden, weight_rows, acc, None, T, weight_rows.shape[0], H, (hidden.stride(0), 1),
              (1, weight_rows.stride(0)), cfg)  # fmt: skip


def _logits_decode(hidden, weight_rows, acc):
    """``logits_dense`` at DECODE_GEMM's row tile for T (the schedule "apart")."""
    logits_dense(hidden, weight_rows, acc, DECODE_GEMM[16 if hidden.shape[0] <= 16 else 64])


# The schedule "apart" at decode sizes: the weight streams through narrow row tiles of the
# dense GEMM's kernel (the forward kernels' 64-row tiles run MMAs mostly on padding there).
DECODE_GEMM = {
    16: {"block_m": 16, "block_n": 128, "group_m": 1, "num_warps": 4, "num_stages": 3},
    64: {"block_m": 64, "block_n": 64, "group_m": 1, "num_warps": 4, "num_stages": 4},
}

# The logits' GEMM apart from the epilogue (``logits_gemm``): from ACC_MIN_T rows, where the
# float32 acc round trip (T x ACC_BYTES per vocabulary chunk) is small beside the GEMM.
LOGITS_GEMMS = {"triton": _logits_triton, "cute": _logits_cute}
ACC_MIN_T = 1024
ACC_BYTES = 256 << 20


def acc_columns(T: int, V: int) -> int:
    """Vocabulary columns of one float32 acc chunk: within ACC_BYTES, a multiple of BLOCK_V."""
    fit = ACC_BYTES // (4 * max(T, 1)) // BLOCK_V * BLOCK_V
    return min(max(BLOCK_V, fit), cdiv(V, BLOCK_V) * BLOCK_V)


def plan_memory(T: int, H: int, V: int, dtype: str, config: dict,
                k_align: int = 1, logits_acc: bool = False) -> dict[str, int]:  # fmt: skip
    """Bytes each backward plan allocates beyond its inputs and the gradients it returns:
    vocab_chunks g [Tk, GRAD_CHUNK] (input dtype), grad_hidden's float32 [T, H] and, where
    T is not a multiple of ``k_align`` (GRAD_K_ALIGN), hidden zero-padded to Tk rows;
    token_chunks g [C, V], a chunk's float32 grad_hidden [C, H] and the float32 [V, H]
    grad_weight buffer (C = min(token_chunk, T)). ``logits_acc`` (g's logits by a GEMM
    apart, ``logits_gemm``): each plan's float32 acc chunk from ACC_MIN_T rows."""
    size = 2 if dtype in ("bfloat16", "float16") else 4
    c = min(int(config.get("token_chunk", _BASE["token_chunk"])), T)
    tk = cdiv(T, k_align) * k_align

    def acc(rows: int, n: int) -> int:
        if not logits_acc or rows < ACC_MIN_T:
            return 0
        return rows * min(acc_columns(rows, V), cdiv(n, BLOCK_V) * BLOCK_V) * 4

    return {
        "vocab_chunks": tk * min(GRAD_CHUNK, V) * size + T * H * 4 + (tk > T) * tk * H * size
        + acc(T, min(GRAD_CHUNK, V)),
        "token_chunks": c * V * size + c * H * 4 + V * H * 4 + acc(c, V),
    }


# fmt: off
def _grad_logits(hidden, weight, targets, lse, mean_z, gl, ge, gs, g, c0, n, cfg, *,
                 multiplier, softcap, ignore_index, entropy, smooth, temperature=1.0,
                 logits_gemm=None):
    """g[:, :n] = the logits' gradient of vocabulary columns [c0, c0 + n) for hidden's rows,
    in the input dtype (the forward's tiles: the same z, bit for bit). ``logits_gemm``: the
    acc from that GEMM apart (see forward_all), g from it elementwise."""
    from opcontract.backends.triton import softcap_logprob_kernels as k

    T, H = hidden.shape
    V = weight.shape[0]
    block_k = BLOCK_K[_dtype(hidden)]
    scale, cap = _scalars(multiplier, softcap, temperature)
    dz = head_constants(multiplier, softcap, temperature)[2]
    if logits_gemm is not None and T >= ACC_MIN_T:
        mm = LOGITS_GEMMS[logits_gemm]
        width = min(acc_columns(T, V), cdiv(n, BLOCK_V) * BLOCK_V)
        buf = torch.empty(T * width, dtype=torch.float32, device=hidden.device)
        for v0 in range(c0, c0 + n, width):
            w = min(width, c0 + n - v0)
            acc = buf[: T * w].view(T, w)
            mm(hidden, weight[v0:v0 + w], acc)
            launch(
                k._grad_logits_from_acc_kernel, (cdiv(T, cfg["block_t"]) * cdiv(w, BLOCK_V),),
                acc, acc.stride(0), targets, lse, mean_z if mean_z is not None else lse,
                gl, ge, gs, g, T, V, g.stride(0), v0, w, c0,
                scale, cap, float(dz), int(ignore_index),
                HAS_CAP=softcap is not None, ENTROPY=entropy, SMOOTH=smooth,
                BLOCK_T=cfg["block_t"], BLOCK_V=BLOCK_V, GROUP_T=cfg["group_t"],
                num_warps=cfg["num_warps"])
        return
    grid = (cdiv(T, cfg["block_t"]) * cdiv(n, BLOCK_V),)
    launch(
        k._grad_logits_kernel, grid,
        hidden, weight, targets, lse, mean_z if mean_z is not None else lse, gl, ge, gs, g,
        T, V, H, hidden.stride(0), weight.stride(0), g.stride(0), c0, n,
        scale, cap, float(dz), int(ignore_index), 0.0,
        HAS_CAP=softcap is not None, ENTROPY=entropy, SMOOTH=smooth, INTERPRET=interpreting(),
        PROMOTE=GEMM_K_BLOCK // block_k, EVEN_K=H % block_k == 0,
        BLOCK_T=cfg["block_t"], BLOCK_V=BLOCK_V, BLOCK_K=block_k, GROUP_T=cfg["group_t"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def backward(hidden, weight, targets, lse, mean_z, grad_logprob, grad_entropy, grad_smooth, *,
             multiplier, softcap, ignore_index, need_hidden=True, need_weight=True,
             plan="vocab_chunks", token_chunk=1024, temperature=1.0, grad_gemm="triton",
             logits_gemm=None):
    """(grad_hidden, grad_weight) by one of the equal-bits plans (see PLANS), their GEMMs on
    ``grad_gemm`` (GRAD_GEMMS: equal bits), g's logits by ``logits_gemm`` (see forward_all).

    vocab_chunks: per vocabulary chunk, ascending, g recomputed and rounded to the input
    dtype; grad_weight[chunk] = g.T @ hidden written once; grad_hidden summed chunk by chunk
    in a float32 buffer and rounded once. token_chunks: per chunk of token_chunk rows,
    ascending, g over the whole vocabulary; the rows' grad_hidden summed over the same
    vocabulary chunks in the same order; grad_weight's 256-token partials added to a float32
    [V, H] buffer in ascending order, rounded once at the end."""
    if plan not in PLANS:
        raise ValueError(f"unknown backward plan {plan!r}; one of {PLANS}")
    mm = GRAD_GEMMS[grad_gemm]
    if token_chunk % GEMM_K_BLOCK:
        raise ValueError(f"token_chunk {token_chunk} is not a multiple of {GEMM_K_BLOCK}")
    T, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    hidden, weight = _rows_contiguous(hidden), _rows_contiguous(weight)
    cfg = default_config(_dtype(hidden), T)  # the forward's tiles for this T, in every chunk
    if T == 0:
        grad_h = torch.zeros(T, H, dtype=hidden.dtype, device=dev) if need_hidden else None
        return grad_h, (torch.zeros_like(weight) if need_weight else None)
    gl = grad_logprob.float().contiguous()
    ge = grad_entropy.float().contiguous() if grad_entropy is not None else gl
    gs = grad_smooth.float().contiguous() if grad_smooth is not None else gl
    head = dict(multiplier=multiplier, softcap=softcap, ignore_index=ignore_index,
                entropy=grad_entropy is not None, smooth=grad_smooth is not None,
                temperature=temperature, logits_gemm=logits_gemm)
    if plan == "token_chunks":
        return _backward_token_chunks(hidden, weight, targets, lse, mean_z, gl, ge, gs, cfg,
                                      head, need_hidden, need_weight, token_chunk, mm)
    grad_h = torch.zeros(T, H, dtype=torch.float32, device=dev) if need_hidden else None
    grad_w = torch.zeros_like(weight) if need_weight else None
    tk = cdiv(T, GRAD_K_ALIGN[grad_gemm]) * GRAD_K_ALIGN[grad_gemm] if need_weight else T
    g = torch.empty(tk, GRAD_CHUNK, dtype=hidden.dtype, device=dev)
    rows = hidden
    if tk > T:  # grad_weight's K padded once with zero rows (see GRAD_K_ALIGN)
        g[T:].zero_()
        rows = torch.zeros(tk, H, dtype=hidden.dtype, device=dev)
        rows[:T] = hidden
    for c0 in range(0, V, GRAD_CHUNK):  # grad_hidden_v: ascending chunks
        n = min(GRAD_CHUNK, V - c0)
        _grad_logits(hidden, weight, targets, lse, mean_z, gl, ge, gs, g, c0, n, cfg, **head)
        if need_weight:  # grad_weight_t: [n, H] = g[:, :n].T @ hidden, K = T
            mm(g[:, :n].T, rows, grad_w[c0:c0 + n])
        if need_hidden:  # [T, H] += g[:, :n] @ weight[chunk], K = n
            mm(g[:T, :n], weight[c0:c0 + n], grad_h, accumulate=True)
    return (grad_h.to(hidden.dtype) if need_hidden else None), grad_w


def _backward_token_chunks(hidden, weight, targets, lse, mean_z, gl, ge, gs, cfg, head,
                           need_hidden, need_weight, token_chunk, mm):
    """The token_chunks plan: the vocab_chunks plan's additions, regrouped by token chunk."""
    T, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    rows = min(token_chunk, T)
    g = torch.empty(rows, V, dtype=hidden.dtype, device=dev)
    grad_h = torch.empty(T, H, dtype=hidden.dtype, device=dev) if need_hidden else None
    chunk_h = torch.empty(rows, H, dtype=torch.float32, device=dev) if need_hidden else None
    acc_w = torch.zeros(V, H, dtype=torch.float32, device=dev) if need_weight else None
    grad_w = torch.empty(V, H, dtype=weight.dtype, device=dev) if need_weight else None
    for t0 in range(0, T, token_chunk):  # ascending token chunks, edges on 256-token partials
        m = min(token_chunk, T - t0)
        h = hidden[t0:t0 + m]
        mz = mean_z[t0:t0 + m] if mean_z is not None else None
        _grad_logits(h, weight, targets[t0:t0 + m], lse[t0:t0 + m], mz, gl[t0:t0 + m],
                     ge[t0:t0 + m], gs[t0:t0 + m], g, 0, V, cfg, **head)
        if need_hidden:  # the rows' grad_hidden_v: the same chunks, the same order
            chunk_h.zero_()
            for c0 in range(0, V, GRAD_CHUNK):
                n = min(GRAD_CHUNK, V - c0)
                mm(g[:m, c0:c0 + n], weight[c0:c0 + n], chunk_h[:m], accumulate=True)
            grad_h[t0:t0 + m] = chunk_h[:m].to(hidden.dtype)
        if need_weight:  # grad_weight_t: the buffer's running sum continues, K = m; the
            # last chunk writes it rounded once, by the kernel's cast as in vocab_chunks
            last = t0 + token_chunk >= T
            mm(g[:m].T, h, acc_w, accumulate=True, seeded=True, out=grad_w if last else acc_w)
    return grad_h, grad_w


def forward(config, hidden, weight, targets, *, multiplier, softcap, ignore_index,
            return_entropy, return_predicted, temperature=1.0, return_mean_logits=False,
            return_log_sum_sq_probs=False, logits_gemm=None):
    """(logprob, entropy, predicted, mean_logits, log_sum_sq_probs, lse, mean_z) in the
    contract's order; None where not asked for."""
    r = forward_all(hidden, weight, targets, multiplier=multiplier, softcap=softcap,
                    ignore_index=ignore_index, entropy=return_entropy, argmax=return_predicted,
                    zsum=return_mean_logits, sq=return_log_sum_sq_probs, config=config,
                    temperature=temperature, logits_gemm=logits_gemm)
    return (r.logprob, r.entropy, r.predicted, r.mean_logits, r.log_sum_sq_probs, r.lse,
            r.mean_z)


def head_backward(config, saved, g_logprob, g_entropy, g_smooth, needs, *, multiplier,
                  softcap, ignore_index, temperature=1.0, grad_gemm="triton", logits_gemm=None):
    """{hidden, weight} of the head, for softcap_logprob's and linear_cross_entropy's grads,
    by the config's backward plan, its GEMMs on ``grad_gemm``, g's logits by
    ``logits_gemm``."""
    lse = saved["lse"]
    gh, gw = backward(
        saved["hidden"], saved["weight"], saved["targets"], lse,
        saved.get("mean_z") if g_entropy is not None else None,
        g_logprob if g_logprob is not None else torch.zeros_like(lse), g_entropy, g_smooth,
        multiplier=multiplier, softcap=softcap, ignore_index=ignore_index,
        need_hidden=needs["hidden"], need_weight=needs["weight"],
        plan=config.get("backward_plan", _BASE["backward_plan"]),
        token_chunk=config.get("token_chunk", _BASE["token_chunk"]), temperature=temperature,
        grad_gemm=grad_gemm, logits_gemm=logits_gemm)
    return {"hidden": gh, "weight": gw}


def logprob_backward(config, saved, grads, needs, *, multiplier, softcap, ignore_index,
                     return_entropy, return_predicted, temperature=1.0,
                     return_mean_logits=False, return_log_sum_sq_probs=False,
                     grad_gemm="triton", logits_gemm=None):
    g_ent = grads["entropy"] if return_entropy else None
    return head_backward(config, saved, grads["logprob"], g_ent, None, needs,
                         multiplier=multiplier, softcap=softcap, ignore_index=ignore_index,
                         temperature=temperature, grad_gemm=grad_gemm,
                         logits_gemm=logits_gemm)


def explore_forward(hidden, weight, targets, *, _pinned, multiplier=1.0, softcap=None,
                    ignore_index=-100, config=None):
    """Float32 [T] log-probabilities with contract-pinned blocks overridden (``_pinned``: see
    forward_all): for benchmarks exploring other contracts only, never dispatched."""
    return forward_all(hidden, weight, targets, multiplier=multiplier, softcap=softcap,
                       ignore_index=ignore_index, config=config, _pinned=_pinned).logprob
# fmt: on
