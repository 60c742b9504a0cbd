"""Host wrapper of the Triton softcap_logprob forward: shapes, buffers, grids."""

from __future__ import annotations

import torch

from opcontract.backends.triton import interpreting

BLOCK_V = 128  # the contract's vocab_lse block: one partial per 128 columns
# gemm_k, as declared in the plan: the tensor cores sum GEMM_K_BLOCK elements of H into a
# fresh float32 partial, and partials are added in ascending order with IEEE float32 adds.
# (The tensor cores' own accumulation truncates: left to run over all of H = 6656 its
# bias costs 3e-6 rel. error; promoted every 256 elements, 1e-7. H200 measurements in
# benchmarks/results/softcap_logprob_forward_explore_h200.json.)
GEMM_K_BLOCK = 256
# The K step of one loaded tile, per dtype (shared memory: 3 stages of 128-row tiles).
BLOCK_K = {"bfloat16": 128, "float16": 128, "float32": 64}

_BASE = {"programs_per_sm": 1, "group_t": 8}
DEFAULT_CONFIG = {
    "bfloat16": {**_BASE, "schedule": "tma", "block_t": 128, "num_warps": 8, "num_stages": 3},
    "float16": {**_BASE, "schedule": "tma", "block_t": 128, "num_warps": 8, "num_stages": 3},
    "float32": {**_BASE, "schedule": "tiles", "block_t": 32, "num_warps": 4, "num_stages": 2},
}
# Under the interpreter each K step is an explicit [block_t, 128, BLOCK_K] product, capped
# at 2**20 elements by Triton: smaller row tiles there (block_t never changes a row's bits).
INTERPRETER_BLOCK_T = 32

CONFIG_SPACE = {
    "schedule": ("tiles", "persistent", "tma"),
    "programs_per_sm": (1, 2),
    "block_t": (64, 128),
    "group_t": (1, 4, 8, 16),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
}


# Decode-sized calls (T <= 64) waste half of a 128-row tile's MMA work: 64-row tiles.
# block_t, num_warps and programs_per_sm leave every output bit unchanged (verified on the
# H200: benchmarks/results/softcap_logprob_forward_explore_h200.json).
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


def softcap_logprob_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    multiplier: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    config: dict | None = None,
    _pinned: dict | None = None,
) -> torch.Tensor:
    """Float32 [T] log-probabilities. ``config`` takes keys of CONFIG_SPACE.

    ``_pinned`` overrides the contract-pinned blocks (``block_v``, ``block_k``,
    ``promote``: K steps per promoted partial, 0 for never): for
    benchmarks exploring other contracts only; the result then breaks this contract.
    """
    from opcontract.backends.triton.softcap_logprob_kernels import (
        _merge_kernel,
        _partials_kernel,
        _partials_persistent_kernel,
        _partials_tma_kernel,
    )

    cfg = default_config(str(hidden.dtype).removeprefix("torch."), hidden.shape[0])
    cfg.update(config or {})
    block_v = (_pinned or {}).get("block_v", BLOCK_V)
    dtype = str(hidden.dtype).removeprefix("torch.")
    block_k = (_pinned or {}).get("block_k", BLOCK_K[dtype])
    promote = (_pinned or {}).get("promote", GEMM_K_BLOCK // block_k)
    T, H = hidden.shape
    V = weight.shape[0]
    out = torch.empty(T, dtype=torch.float32, device=hidden.device)
    if T == 0:
        return out
    hidden = _rows_contiguous(hidden)
    weight = _rows_contiguous(weight)
    targets = targets.contiguous()
    n_blocks = triton_cdiv(V, block_v)
    pmax = torch.empty((n_blocks, T), dtype=torch.float32, device=hidden.device)
    psum = torch.empty_like(pmax)
    z_t = torch.empty(T, dtype=torch.float32, device=hidden.device)
    bt = cfg["block_t"]
    common = dict(
        HAS_CAP=softcap is not None,
        INTERPRET=interpreting(),
        PROMOTE=promote,
        BLOCK_T=bt,
        BLOCK_V=block_v,
        BLOCK_K=block_k,
        GROUP_T=cfg["group_t"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if softcap is None:
        scalars = (float(multiplier), 1.0, 0.0)
    else:  # the contract's scale: multiplier / softcap in float64, rounded once to float32
        scalars = (multiplier / softcap, float(softcap), 0.0)
    n_tiles = triton_cdiv(T, bt) * n_blocks
    schedule = cfg["schedule"]
    if schedule == "tiles":
        _partials_kernel[(n_tiles,)](
            hidden,
            weight,
            targets,
            pmax,
            psum,
            z_t,
            T,
            V,
            H,
            hidden.stride(0),
            weight.stride(0),
            *scalars,
            EVEN_K=H % block_k == 0,
            **common,
        )
    else:
        programs = min(n_tiles, _num_sms(hidden.device) * cfg["programs_per_sm"])
        if schedule == "persistent":
            _partials_persistent_kernel[(programs,)](
                hidden,
                weight,
                targets,
                pmax,
                psum,
                z_t,
                T,
                V,
                H,
                hidden.stride(0),
                weight.stride(0),
                *scalars,
                EVEN_K=H % block_k == 0,
                NUM_PROGRAMS=programs,
                **common,
            )
        elif schedule == "tma" and _tma_ok(hidden, weight):
            from triton.tools.tensor_descriptor import TensorDescriptor

            h_desc = TensorDescriptor.from_tensor(hidden, [bt, block_k])
            w_desc = TensorDescriptor.from_tensor(weight, [block_v, block_k])
            _partials_tma_kernel[(programs,)](
                h_desc,
                w_desc,
                targets,
                pmax,
                psum,
                z_t,
                T,
                V,
                H,
                *scalars,
                NUM_PROGRAMS=programs,
                **common,
            )
        elif schedule == "tma":  # rows not 16-byte aligned: same tiles, same bits, no TMA
            _partials_persistent_kernel[(programs,)](
                hidden,
                weight,
                targets,
                pmax,
                psum,
                z_t,
                T,
                V,
                H,
                hidden.stride(0),
                weight.stride(0),
                *scalars,
                EVEN_K=H % block_k == 0,
                NUM_PROGRAMS=programs,
                **common,
            )
        else:
            raise ValueError(f"unknown schedule {schedule!r}; one of {CONFIG_SPACE['schedule']}")
    block_r = 128
    _merge_kernel[(triton_cdiv(T, block_r),)](
        pmax,
        psum,
        z_t,
        targets,
        out,
        T,
        n_blocks,
        int(ignore_index),
        BLOCK_R=block_r,
    )
    return out


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned base pointers and row strides."""
    return all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors
    )


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a couple of programs exercise the tile loop
    return torch.cuda.get_device_properties(device).multi_processor_count


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
