"""Muse Glimmer's attention in its three call forms, on the one ``gated_attention`` op:
training (packed or padded sequences), prefill (a chunk of tokens appended to a KV cache)
and decode (a token or a few per sequence). Each form only builds the op's key table; the
op's numerics fix a query's bits by its position and its sequence's keys, so a token gets
the same output in every form.

>>> out = attention.packed(q, k, v, gate, cu_seqlens, layer="local", window=2048)
>>> cache = attention.PagedKVCache(layer="local", window=2048, kv_heads=2, head_dim=128,
...                                dtype=torch.bfloat16, device="cuda", sequences=4)
>>> out = cache.step(seq, positions, q, k, v, gate)   # prefill or decode: append, attend
"""

from __future__ import annotations

import torch

from opcontract import dispatch
from opcontract.backends.placement import on_device
from opcontract.contracts import get_contract
from opcontract.errors import ContractViolation

BLOCK = get_contract("gated_attention").reductions["key_blocks"].block
_op = dispatch.op("gated_attention")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fn(backend: str | None, config: dict | None):
    if backend is None and config is None:
        return _op
    return dispatch.op("gated_attention", backend=backend, config=config)


def packed_index(cu_seqlens, rows: int, device) -> tuple[torch.Tensor, ...]:
    """The op's key table for packed sequences (sequence s at rows cu_seqlens[s] ..
    cu_seqlens[s + 1] - 1 of ``rows``, its tokens at positions 0, 1, ...): (positions, seq,
    block table, key lengths) on ``device``. Build once, pass to :func:`packed` per layer."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ContractViolation(
            "gated_attention", "cu_seqlens", "call.cu_seqlens",
            f"must start at 0 and not decrease, got {cu[:8]}",
        )  # fmt: skip
    if cu[-1] != rows:
        raise ContractViolation(
            "gated_attention", "cu_seqlens", "call.cu_seqlens",
            f"ends at {cu[-1]}, but q and k have {rows} rows",
        )  # fmt: skip
    lens = [b - a for a, b in zip(cu, cu[1:], strict=False)]
    nb = max(1, max((_cdiv(n, BLOCK) for n in lens), default=1))
    table = torch.full((len(lens), nb), -1, dtype=torch.int64)
    seq = torch.empty(cu[-1], dtype=torch.int64)
    positions = torch.empty(cu[-1], dtype=torch.int64)
    for s, (a, n) in enumerate(zip(cu, lens, strict=False)):
        table[s, : _cdiv(n, BLOCK)] = a + BLOCK * torch.arange(_cdiv(n, BLOCK))
        seq[a : a + n] = s
        positions[a : a + n] = torch.arange(n)
    key_len = torch.tensor(lens, dtype=torch.int64)
    return tuple(t.to(device) for t in (positions, seq, table, key_len))


def packed(q, k, v, gate, cu_seqlens, *, layer, window=None, scale=None, backend=None,
           config=None, index=None):  # fmt: skip
    """Training over packed sequences: q, gate [T, Hq, D], k, v [T, Hkv, D], sequence s at
    rows cu_seqlens[s] .. cu_seqlens[s + 1] - 1, its tokens at positions 0, 1, ...
    ``index``: :func:`packed_index` of the same cu_seqlens, built once for many layers."""
    if q.shape[0] != k.shape[0]:
        raise ContractViolation(
            "gated_attention", "cu_seqlens", "call.cu_seqlens",
            f"q has {q.shape[0]} rows and k {k.shape[0]}",
        )  # fmt: skip
    if index is None:
        index = packed_index(cu_seqlens, q.shape[0], q.device)
    elif index[0].shape[0] != q.shape[0]:
        raise ContractViolation(
            "gated_attention", "index", "call.index",
            f"built for {index[0].shape[0]} rows, q has {q.shape[0]}",
        )  # fmt: skip
    f = _fn(backend, config)
    return f(q, k, v, gate, *index, layer=layer, window=window, scale=scale)


def padded(q, k, v, gate, attention_mask, *, layer, window=None, scale=None, backend=None,
           config=None):  # fmt: skip
    """Training over a padded batch: q, gate [B, L, Hq, D], k, v [B, L, Hkv, D] and
    attention_mask [B, L] (1 where a token is real). Each row's real tokens must be one run
    (left or right padding, no holes); its first real token is position 0. Padding rows give 0."""
    B, L = attention_mask.shape
    m = attention_mask.to(torch.bool).cpu()
    counts = m.sum(dim=1)
    starts = torch.where(counts > 0, m.int().argmax(dim=1), 0)
    for b in range(B):
        run = m[b, int(starts[b]) : int(starts[b]) + int(counts[b])]
        if not bool(run.all()):
            raise ContractViolation(
                "gated_attention", "attention_mask", "call.attention_mask",
                f"row {b}'s real tokens are not one run (a hole in the mask)",
            )  # fmt: skip
    nb = max(1, _cdiv(L, BLOCK))
    table = torch.full((B, nb), -1, dtype=torch.int64)
    for b in range(B):
        n = int(counts[b])
        table[b, : _cdiv(n, BLOCK)] = b * L + int(starts[b]) + BLOCK * torch.arange(_cdiv(n, BLOCK))
    pos = torch.where(m, torch.cumsum(m.long(), dim=1) - 1, -1).reshape(-1)
    seq = torch.arange(B).repeat_interleave(L)
    dev = q.device
    f = _fn(backend, config)
    out = f(q.reshape(B * L, *q.shape[2:]), k.reshape(B * L, *k.shape[2:]),
            v.reshape(B * L, *v.shape[2:]), gate.reshape(B * L, *gate.shape[2:]), pos.to(dev),
            seq.to(dev), table.to(dev), counts.to(dev), layer=layer, window=window,
            scale=scale)  # fmt: skip
    return out.reshape(B, L, *out.shape[1:])


class PagedKVCache:
    """One attention layer's K and V for a set of sequences, in pages of 128 positions (the
    contract's key blocks: block b of a sequence, positions b*128 .. b*128 + 127, is one
    page). It holds post-norm, post-RoPE keys and values in the model dtype, as training
    computes them; a local layer frees the pages no later query can see (which changes no
    bit: no query ever reads them).

    ``step(seq, positions, q, k, v, gate)`` appends the tokens' keys and values, then
    attends: prefill (a chunk of tokens per sequence) and decode (one or a few) alike. Each
    sequence's new positions must continue where it stands (its next position first).
    """

    def __init__(self, *, layer: str, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device, sequences: int, window: int | None = None, scale: float | None = None,
                 backend: str | None = None, config: dict | None = None,
                 pages: int = 16) -> None:  # fmt: skip
        if layer not in ("local", "global"):
            raise ContractViolation("gated_attention", "layer", "cache.layer", f"{layer!r}")
        if (layer == "local") != (window is not None):
            raise ContractViolation(
                "gated_attention", "window", "cache.window",
                "a local layer's cache needs its window, a global layer's has none",
            )  # fmt: skip
        self.layer, self.window, self.scale = layer, window, scale
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self.device = torch.empty(0, device=device).device  # cuda -> cuda:<current>
        self._f = _fn(backend, config)
        self.k = torch.zeros(pages * BLOCK, kv_heads, head_dim, dtype=dtype, device=self.device)
        self.v = torch.zeros_like(self.k)
        self.free = list(range(pages))[::-1]
        # host bookkeeping in Python lists (a tensor element access per token costs
        # microseconds): each sequence's first store row per key block (-1: absent), its
        # length, and its lowest block not yet evicted
        self._rows: list[list[int]] = [[-1] for _ in range(sequences)]
        self._len: list[int] = [0] * sequences
        self._low: list[int] = [0] * sequences
        self.pages_evicted = 0
        self._table: torch.Tensor | None = None  # the table as a tensor, until a block moves

    @property
    def table(self) -> torch.Tensor:
        """[sequences, blocks] int64 (host): the first store row of each key block, -1 where
        absent (not yet written, or evicted)."""
        return self._block_table().clone()

    def _block_table(self) -> torch.Tensor:
        """``table``, built again only after a block was added or freed or the table widened
        (a decode step mostly writes inside its last block); the op only reads it."""
        if self._table is None:
            self._table = torch.tensor(self._rows, dtype=torch.int64)
        return self._table

    @property
    def sequences(self) -> int:
        """How many sequences the cache holds rows for."""
        return len(self._len)

    @property
    def lengths(self) -> torch.Tensor:
        """[sequences] int64 (host): how many positions of each sequence the cache holds."""
        return torch.tensor(self._len, dtype=torch.int64)

    # -- bookkeeping (host side)
    def _check(self, seq, positions, k, v, q=None, gate=None) -> list[tuple[int, int, int]]:
        """(token index, sequence, position) of every token, after validating the step."""
        parts = [("k", k, self.kv_heads), ("v", v, self.kv_heads)]
        if q is not None:
            hq = q.shape[1] if q.dim() == 3 and q.shape[1] % self.kv_heads == 0 else -1
            parts += [("q", q, hq), ("gate", gate, hq)]
        for name, t, heads in parts:
            if t.dim() != 3 or t.shape[0] != k.shape[0]:
                raise ContractViolation(
                    "gated_attention", name, "cache.geometry",
                    f"must be [tokens={k.shape[0]}, heads, {self.head_dim}], got {tuple(t.shape)}",
                )  # fmt: skip
            if t.dtype != self.dtype or t.device != self.device:
                raise ContractViolation(
                    "gated_attention", name, "cache.dtype",
                    f"is {t.dtype} on {t.device}; the cache holds {self.dtype} on {self.device}",
                )  # fmt: skip
            if tuple(t.shape[1:]) != (heads, self.head_dim):
                want = (
                    (heads, self.head_dim)
                    if heads > 0
                    else f"(k x {self.kv_heads}, {self.head_dim})"
                )
                raise ContractViolation(
                    "gated_attention", name, "cache.geometry",
                    f"has heads x dim {tuple(t.shape[1:])}; the cache {want}",
                )  # fmt: skip
        if seq.dim() != 1 or positions.shape != seq.shape or seq.shape[0] != k.shape[0]:
            raise ContractViolation(
                "gated_attention", "positions", "cache.geometry",
                f"seq {tuple(seq.shape)} and positions {tuple(positions.shape)} must both be "
                f"[tokens] with one entry per row of k ({k.shape[0]})",
            )  # fmt: skip
        seqs, pos = seq.tolist(), positions.tolist()
        nxt = {}
        out = []
        n_seq = len(self._len)
        for i, (s, p) in enumerate(zip(seqs, pos, strict=True)):
            if not 0 <= s < n_seq:
                raise ContractViolation("gated_attention", "seq", "cache.seq", f"no sequence {s}")
            want = nxt.get(s, self._len[s])
            if p != want:
                raise ContractViolation(
                    "gated_attention", "positions", "cache.positions",
                    f"sequence {s}'s next position is {want}, got {p} (token {i})",
                )  # fmt: skip
            nxt[s] = p + 1
            out.append((i, s, p))
        return out

    def _ensure(self, blocks_needed: int) -> None:
        more = blocks_needed - len(self._rows[0])
        if more > 0:
            self._table = None
            for r in self._rows:
                r.extend([-1] * more)

    def _page(self) -> int:
        if not self.free:  # double the store (rows are addressed by offset: nothing moves)
            n = self.k.shape[0] // BLOCK
            self.k = torch.cat([self.k, torch.zeros_like(self.k)])
            self.v = torch.cat([self.v, torch.zeros_like(self.v)])
            self.free = list(range(2 * n - 1, n - 1, -1))
        return self.free.pop()

    def append(self, seq, positions, k, v, *, q=None, gate=None) -> None:
        """Write the tokens' keys and values (all checks first, of q and gate too when
        given: a step that raises writes nothing)."""
        tokens = self._check(seq, positions, k, v, q, gate)
        top = max((p for _, _, p in tokens), default=-1)
        self._ensure(top // BLOCK + 1)
        rows = []
        for _, s, p in tokens:
            b = p // BLOCK
            blocks = self._rows[s]
            if blocks[b] < 0:
                blocks[b] = self._page() * BLOCK
                self._table = None
            rows.append(blocks[b] + p % BLOCK)
        if rows:  # built on the host, copied without waiting for the GPU's queue
            idx = on_device(torch.tensor(rows), self.device)
            self.k.index_copy_(0, idx, k)
            self.v.index_copy_(0, idx, v)
        for _, s, p in tokens:
            self._len[s] = max(self._len[s], p + 1)

    def evict(self) -> int:
        """Free the pages of a local layer that no later query can see; returns how many."""
        if self.layer != "local":
            return 0
        freed = 0
        for s, blocks in enumerate(self._rows):
            lowest = self._len[s] - self.window + 1  # the next query's first key
            b = self._low[s]  # every block below it is evicted already (lengths only grow)
            while b < len(blocks) and (b + 1) * BLOCK <= lowest:
                if blocks[b] >= 0:
                    self.free.append(blocks[b] // BLOCK)
                    blocks[b] = -1
                    freed += 1
                    self._table = None
                b += 1
            self._low[s] = b
        self.pages_evicted += freed
        return freed

    def attend(self, seq, positions, q, gate):
        """The queries' gated attention over what the cache holds. With ``seq`` and
        ``positions`` on the CPU the op gets every index input on the host (it checks their
        values without waiting for the GPU, then copies them); else all on the cache's device."""
        index = (positions, seq, self._block_table(), self.lengths)
        if seq.device.type != "cpu" or positions.device.type != "cpu":
            index = tuple(on_device(t, self.device) for t in index)
        return self._f(q, self.k, self.v, gate, *index, layer=self.layer, window=self.window,
                       scale=self.scale)  # fmt: skip

    def step(self, seq, positions, q, k, v, gate, *, evict: bool = True):
        """Append, attend, then (local layers) evict: one prefill chunk or decode step."""
        self.append(seq, positions, k, v, q=q, gate=gate)
        out = self.attend(seq, positions, q, gate)
        if evict:
            self.evict()
        return out
