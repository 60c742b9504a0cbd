"""Host code of the Triton normalized embedding: a fused gather + weightless RMSNorm, and a
table gradient summed per row over the stably sorted tokens."""

from __future__ import annotations

import torch

from opcontract.backends.triton.launch import launch
from opcontract.backends.triton.rms_norm import row_block, row_warps

# table rows per program of the embedding backward (whole rows). H200, V = 202048,
# H = 6656, graph replay, T = 8192 / 32768: 8 / 16 / 32 rows took 0.881 / 0.869 / 0.889 ms
# and 1.268 / 1.243 / 1.263 ms; a memset of the table alone takes 0.79 ms. Loading each
# program's row ranges and first tokens up front took 0.98-1.02 / 1.38-1.41 ms, and was
# removed (benchmarks/results/norm_kernels_explore_h200.json at 72d0f87)
EMBED_ROWS = 16


def embedding_forward(ids, table, eps, want_raw=True):
    """(y, raw, rstd); raw is [0, H] (never written) unless ``want_raw``."""
    from opcontract.backends.triton import normalized_embedding_kernels as k

    T, H = ids.shape[0], table.shape[1]
    table = table if table.stride(-1) == 1 else table.contiguous()
    y = torch.empty((T, H), dtype=table.dtype, device=table.device)
    raw = torch.empty((T if want_raw else 0, H), dtype=table.dtype, device=table.device)
    rstd = torch.empty(T, dtype=torch.float32, device=table.device)
    if T:
        bh = row_block(H)
        launch(
            k._embed_fwd_kernel,
            (T,),
            ids.contiguous(),
            table,
            y,
            raw if want_raw else y,
            rstd,
            H,
            table.stride(0),
            float(eps),
            RAW=want_raw,
            BLOCK_H=bh,
            num_warps=row_warps(bh),
        )
    return y, raw, rstd


def embedding_backward(dy, d_raw, ids, table, rstd):
    """dtable: per table row, its tokens' float32 gradients summed in ascending token order,
    rounded once; rows no token used are zeros. No host sync (the pass can be captured in a
    CUDA graph) and no [T, H] intermediate: one pass over the table, whole rows.
    """
    from opcontract.backends.triton import normalized_embedding_kernels as k

    V, H = table.shape
    table = table if table.stride(-1) == 1 else table.contiguous()
    dtable = torch.empty((V, H), dtype=table.dtype, device=table.device)
    if V == 0 or H == 0:
        return dtable
    # ids are in [0, V) (validated) and V < 2**31: int32 keys sort in half the passes
    ids32 = ids.to(torch.int32)
    order = torch.argsort(ids32, stable=True)  # each id's tokens stay in ascending order
    rows = torch.arange(V, device=ids.device, dtype=torch.int32)
    ends = torch.searchsorted(ids32[order], rows, right=True)  # row v: [ends[v - 1], ends[v])
    bh = row_block(H)
    launch(
        k._embed_bwd_kernel,
        (-(-V // EMBED_ROWS),),
        dy.contiguous(),
        d_raw.contiguous() if d_raw is not None else dy,
        order,
        ends,
        table,
        rstd,
        dtable,
        V,
        H,
        table.stride(0),
        HAS_DRAW=d_raw is not None,
        ROWS=EMBED_ROWS,
        BLOCK_H=bh,
        num_warps=row_warps(bh),  # with BLOCK_H, the forward's row tree
    )
    return dtable


def forward(config, ids, table, *, eps, return_raw):
    """(y, raw or None, rstd)."""
    y, raw, rstd = embedding_forward(ids, table, eps, return_raw)
    return y, (raw if return_raw else None), rstd


def backward(config, saved, grads, needs, *, eps, return_raw):
    ids, table, rstd = saved["ids"], saved["table"], saved["rstd"]
    dy = grads["y"]
    if dy is None:
        dy = torch.zeros(ids.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
    d_raw = grads["raw"] if return_raw else None
    return {"table": embedding_backward(dy, d_raw, ids, table, rstd)}
