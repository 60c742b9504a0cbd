"""A static KV cache for a patched Muse Glimmer: ``generate(cache_implementation="static")``
and torch.compile's CUDA graphs.

>>> out = model.generate(ids, attention_mask=mask, max_new_tokens=64,
...                      cache_implementation="static")   # compiled decode on a GPU

Every layer's keys and values live in a store of fixed size, ``batch x blocks x 128`` rows
(sequence b's key block j at rows ``(b * blocks + j) * 128`` onwards), addressed through a
block table that never changes; each sequence's length is a device tensor. A step whose new
columns are all real tokens (every decode step of ``generate()``) takes its positions from
those lengths on the device, writes with ``index_copy_`` and attends: nothing is read back
and nothing allocated outside the graph, so ``torch.compile`` (mode "reduce-overhead": CUDA
graphs) captures it, and ``generate()`` compiles it by itself on a GPU. A step with padding
among its new columns (a left-padded prefill) finds its real tokens from the host copy of
the mask, as :class:`~opcontract.integrations.transformers.OpcontractKVCache` does.

The bits are OpcontractKVCache's and a training forward's: the same ``gated_attention`` op
over the same key blocks at the same positions (the store's layout enters no bit: the op
addresses keys by position). Local layers keep every position (nothing is evicted): each
layer holds ``batch x max_cache_len`` keys and values, as the stock StaticCache's global
layers do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from opcontract import attention as _attention
from opcontract.backends.placement import on_device
from opcontract.integrations.cache_base import LayerKindsCache
from opcontract.integrations.positions import positions_from_mask

BLOCK = _attention.BLOCK


@dataclasses.dataclass
class CacheStep:
    """One forward's new tokens, computed once for every layer (see ``begin``).

    ``positions`` [B * L] int64 (-1 at padding: no query there), ``seq`` [B * L] each row's
    sequence, ``key_len`` [B] every sequence's length after the step and ``table`` the block
    table: the op's index inputs, all on the host (an eager step: the op checks them without
    a wait) or all on the device (a compiled one). ``rows`` the store row of each real token
    (on the device), ``real`` (batch rows, columns) of the real tokens where some new column
    is padding (None: every one is real, in order), ``host_len`` the lengths after the step
    as a list (an eager step's, for the cache's host copy)."""

    positions: torch.Tensor
    seq: torch.Tensor
    key_len: torch.Tensor
    table: torch.Tensor
    rows: torch.Tensor
    real: tuple[torch.Tensor, torch.Tensor] | None
    columns: int
    host_len: list[int] | None = None


def require(ok: torch.Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok`` (a bool tensor) holds. Where the answer
    would cost a wait for the GPU, or while torch.compile traces, a device-side assert with
    the same message instead (no read-back: a decode step stays capturable)."""
    if torch.compiler.is_compiling() or ok.device.type != "cpu":
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message)


class OpcontractStaticCache(LayerKindsCache):
    """A transformers ``Cache`` of fixed size for a patched model (``is_compileable``): one
    key and one value store per decoder layer, one sequence per batch row, the lengths on the
    device. Only real tokens (mask 1) are stored, at their mask-derived positions.

    ``generate()`` on a patched model builds one for ``cache_implementation="static"`` and
    keeps it on the model for the next call of the same batch size (a new store would make
    torch.compile trace again). ``update`` (the stock attention's path) refuses, as do beam
    reordering and cropping."""

    def __init__(
        self,
        config: Any,
        *,
        batch_size: int,
        max_cache_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
        backend: str | None = None,
    ) -> None:
        super().__init__(config, backend)
        self.sequences = batch_size
        self.blocks = max(1, -(-max_cache_len // BLOCK))
        self.capacity = self.blocks * BLOCK  # positions a sequence: whole key blocks
        self.dtype = dtype
        self.device = torch.empty(0, device=device).device
        self._op = _attention._fn(backend, None)
        dev = self.device
        # each layer's stores, made at its first step with the heads its attention gives
        # (a tensor-parallel rank's share): [batch x max_cache_len, heads, head_dim]
        self.keys: list[torch.Tensor | None] = [None] * len(self.kinds)
        self.values: list[torch.Tensor | None] = [None] * len(self.kinds)
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=dev)
        self.columns = torch.zeros((), dtype=torch.int64, device=dev)  # real and padding
        first = torch.arange(batch_size, device=dev) * self.blocks
        self.table = (first[:, None] + torch.arange(self.blocks, device=dev)) * BLOCK
        self.first_row = first * BLOCK
        # host copies for eager steps (None: unknown, a compiled step moved the device ones)
        self.host_table = self.table.cpu()
        self._host_len: list[int] | None = [0] * batch_size
        self._host_columns: int | None = 0
        if not torch.compiler.is_compiling():  # fixed addresses: no copy, no CUDA graph skip
            for t in (self.lengths, self.columns, self.table, self.first_row):
                torch._dynamo.mark_static_address(t)

    def __repr__(self) -> str:
        return (f"OpcontractStaticCache(layers={len(self.kinds)}, batch={self.sequences}, "
                f"max_cache_len={self.capacity})")  # fmt: skip

    def fits(self, batch_size: int, max_cache_len: int, device, dtype) -> bool:
        """Whether this cache can serve a generate() call of these sizes (after ``reset``)."""
        return (batch_size == self.sequences and max_cache_len <= self.capacity
                and torch.empty(0, device=device).device == self.device
                and dtype == self.dtype)  # fmt: skip

    # -- what generate() and the mask utilities read
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns (real and padding) stepped so far: the host copy, else read back from the
        device after compiled steps (a compiled step never asks)."""
        if self._host_columns is None:
            self._host_columns = int(self.columns)
        return self._host_columns

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.capacity, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    @property
    def batch_size(self) -> int:
        return self.sequences

    @property
    def max_cache_len(self) -> int:
        return self.capacity

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return True

    def reset(self) -> None:
        """Empty every sequence (in place: the stores keep their addresses)."""
        self.lengths.zero_()
        self.columns.zero_()
        self._host_len, self._host_columns = [0] * self.sequences, 0

    def _lengths(self) -> list[int]:
        """Each sequence's length on the host: the host copy, else read back once."""
        if self._host_len is None:
            self._host_len = self.lengths.tolist()
        return self._host_len

    # -- a forward's step: begin (once), attend (each layer), end (once)
    def begin(self, mask: torch.Tensor | None, B: int, L: int) -> CacheStep:
        """The step of a forward over [B, L] new columns. ``mask``: None where every new
        column is a real token (decode); else the whole padding mask so far [B, columns + L]
        (read on the host: not while torch.compile traces, where it is checked on the device
        to be all real in its new columns and to agree with the lengths)."""
        if B != self.sequences:
            raise ValueError(f"OpcontractStaticCache holds {self.sequences} sequences, got a "
                             f"batch of {B}")  # fmt: skip
        if not torch.compiler.is_compiling():
            return self._host_step(mask, B, L) if mask is not None else self._eager_step(B, L)
        self._host_len = self._host_columns = None  # the device copies move on alone
        if mask is not None:
            m = mask.to(torch.bool)
            require(m[:, -L:].all() & (m.sum(dim=1) == self.lengths + L).all(),
                    "opcontract's static cache under torch.compile takes steps whose new "
                    "columns are all real tokens, after the columns it holds")  # fmt: skip
        pos = self.lengths[:, None] + torch.arange(L, device=self.device)
        key_len = self.lengths + L
        require(key_len.max() <= self.capacity,
                f"OpcontractStaticCache holds {self.capacity} positions a sequence; a "
                f"step would pass it")  # fmt: skip
        rows = (self.first_row[:, None] + pos).reshape(-1)
        seq = torch.arange(B * L, device=self.device) // L
        return CacheStep(pos.reshape(-1), seq, key_len, self.table, rows, None, L)

    def _eager_step(self, B: int, L: int) -> CacheStep:
        """Every new column real, not compiled: the positions from the host copy of the
        lengths, the op's index inputs on the host (checked there without a wait), the store
        rows copied over without a wait."""
        lens = self._lengths()
        top = max(lens) + L
        if top > self.capacity:
            raise ValueError(f"OpcontractStaticCache holds {self.capacity} positions a "
                             f"sequence; this step needs {top}")  # fmt: skip
        pos = [n + j for n in lens for j in range(L)]
        rows = [b * self.capacity + p for b, n in enumerate(lens) for p in range(n, n + L)]
        after = [n + L for n in lens]
        seq = torch.arange(B).repeat_interleave(L)
        rows_dev = on_device(torch.tensor(rows), self.device)
        return CacheStep(torch.tensor(pos), seq, torch.tensor(after), self.host_table, rows_dev,
                         None, L, after)  # fmt: skip

    def _host_step(self, mask: torch.Tensor, B: int, L: int) -> CacheStep:
        seen = self.get_seq_length()
        if tuple(mask.shape) != (B, seen + L):
            raise ValueError(f"OpcontractStaticCache: the attention mask is {tuple(mask.shape)}, "
                             f"expected [{B}, {seen} cached + {L} new columns]")  # fmt: skip
        grid = positions_from_mask(mask.cpu())
        before = (grid[:, :seen] >= 0).sum(dim=1)
        if before.tolist() != self._lengths():
            raise ValueError("OpcontractStaticCache: the attention mask's real tokens before "
                             "the new columns are not the ones the cache holds")  # fmt: skip
        grid = grid[:, seen:]
        key_len = torch.maximum(grid.max(dim=1).values + 1, before)
        if int(key_len.max()) > self.capacity:
            raise ValueError(f"OpcontractStaticCache holds {self.capacity} positions a "
                             f"sequence; this step needs {int(key_len.max())}")  # fmt: skip
        r, c = (grid >= 0).nonzero(as_tuple=True)  # row-major: each row's tokens in order
        rows = r * self.capacity + grid[r, c]
        seq = torch.arange(B).repeat_interleave(L)
        dev = self.device
        real = None if r.numel() == B * L else (on_device(r, dev), on_device(c, dev))
        return CacheStep(grid.reshape(-1), seq, key_len, self.host_table, on_device(rows, dev),
                         real, L, key_len.tolist())  # fmt: skip

    def attend(self, layer_idx: int, step: CacheStep, q, k, v, gate, *, scale: float | None):
        """Write this step's real keys and values of one layer, then attend over the layer's
        store. q, gate [B, L, Hq, D], k, v [B, L, Hkv, D]; returns [B, L, Hq, D], zeros at
        padding."""
        B, L = q.shape[:2]
        if step.real is None:
            k_new, v_new = k.reshape(B * L, *k.shape[2:]), v.reshape(B * L, *v.shape[2:])
        else:
            k_new, v_new = k[step.real], v[step.real]
        keys, values = self._stores(layer_idx, k)
        keys.index_copy_(0, step.rows, k_new)
        values.index_copy_(0, step.rows, v_new)
        kind = self.kinds[layer_idx]
        out = self._op(q.reshape(B * L, *q.shape[2:]), keys, values,
                       gate.reshape(B * L, *gate.shape[2:]), step.positions, step.seq,
                       step.table, step.key_len, layer=kind,
                       window=self.window if kind == "local" else None, scale=scale)  # fmt: skip
        return out.view(q.shape)

    def _stores(self, layer_idx: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value stores, made at its first step (an eager prefill: their
        addresses then stay fixed for torch.compile)."""
        keys = self.keys[layer_idx]
        shape = (self.sequences * self.capacity, *k.shape[2:])
        if keys is None:
            if k.dtype != self.dtype or k.device != self.device:
                raise ValueError(
                    f"OpcontractStaticCache holds {self.dtype} on {self.device}; layer "
                    f"{layer_idx}'s keys are {k.dtype} on {k.device}"
                )
            keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
            values = torch.zeros_like(keys)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(keys)
                torch._dynamo.mark_static_address(values)
            self.keys[layer_idx], self.values[layer_idx] = keys, values
        elif tuple(keys.shape) != shape:
            raise ValueError(f"OpcontractStaticCache layer {layer_idx} holds keys of "
                             f"{tuple(keys.shape[1:])}, got {tuple(k.shape[2:])}")  # fmt: skip
        return keys, self.values[layer_idx]

    def end(self, step: CacheStep) -> None:
        """Every layer has written its keys: the lengths and columns move on (an eager
        step's host copies with them)."""
        self.lengths.copy_(on_device(step.key_len, self.device))
        self.columns.add_(step.columns)
        if step.host_len is not None:
            self._host_len = step.host_len
            if self._host_columns is not None:
                self._host_columns += step.columns
