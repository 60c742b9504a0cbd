"""Host code of the Triton gated_attention: the tile table (runs of a sequence's query rows,
BLOCK_M // G tokens a tile), the launch, and (for now) the backward through the torch strict
path's formulas on the Triton forward's residuals."""

from __future__ import annotations

import torch

from opcontract.backends.torch import gated_attention as ref
from opcontract.backends.triton import interpreting
from opcontract.backends.triton.launch import launch

BLOCK = ref.BLOCK
CHUNK_BLOCKS = ref.CHUNK // ref.BLOCK
BLOCK_M = 128  # query rows (tokens x heads of a KV group) a tile


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(n - 1, 0).bit_length())


def tiles(seq: torch.Tensor, per_tile: int) -> torch.Tensor:
    """[n, 3] int32 (first row, tokens, sequence): each run of consecutive rows of one
    sequence cut into tiles of ``per_tile`` tokens."""
    s = seq.tolist()
    out = []
    i = 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i] and j - i < per_tile:
            j += 1
        out.append((i, j - i, s[i]))
        i = j
    return torch.tensor(out or [(0, 0, 0)], dtype=torch.int32, device=seq.device)


def forward(config, q, k, v, gate, positions, seq, block_rows, key_len, *, layer, window, scale):
    """(out, lse, attn)."""
    from opcontract.backends.triton import gated_attention_kernels as kk

    T, Hq, D = q.shape
    N, Hkv, _ = k.shape
    G = Hq // Hkv
    out = torch.empty_like(q)
    attn = torch.empty((T, Hq, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((T, Hq), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse, attn
    block_m = min(BLOCK_M, _pow2(G)) if G > BLOCK_M // 2 else BLOCK_M
    block_m = max(block_m, _pow2(G))
    table = tiles(seq, max(1, block_m // G))
    c = ref.score_factor(D, scale)
    launch(kk._attn_fwd_kernel, (table.shape[0], Hkv), q, k, v, gate, positions,
           block_rows, key_len, table, out, attn, lse, T, N, Hq, Hkv, G, D,
           block_rows.shape[1], int(window or 0), c, LOCAL=layer == "local",
           INTERPRET=interpreting(), IEEE=q.dtype == torch.float32, BLOCK_M=block_m,
           BLOCK=BLOCK, BLOCK_D=_pow2(D), CHUNK_BLOCKS=CHUNK_BLOCKS,
           num_warps=4 if block_m <= 64 else 8)  # fmt: skip
    return out, lse, attn


def backward(config, saved, grads, needs, *, layer, window, scale):
    """The contract's backward (P recomputed from the forward's lse), by the strict path."""
    return ref.backward(config, saved, grads, needs, layer=layer, window=window, scale=scale)
