"""gated_attention's checks of a call's values that every backend relies on (run before any
kernel, like the contract's index ranges): no two queries of a sequence at one position
(the backward sums a key's gradient over its queries in position order), every query inside
its sequence's keys, and every key block a query can see present in the block table. The
call forms (training, prefill, decode) check more: their tokens' positions consecutive."""

from __future__ import annotations

import numpy as np
import torch

from opcontract.contracts import get_contract
from opcontract.errors import ContractViolation

_C = get_contract("gated_attention")
BLOCK = _C.reductions["key_blocks"].block
# below this many query rows the host-side work on index inputs (these checks, the Triton
# tile table and chunk count) walks Python lists: quicker than numpy's per-call overhead
FEW_ROWS = 32


def check_call(inputs: dict, params: dict):
    """The checks as device flags and the function that raises for the first one set (see
    ``validate.check_values``: read back with the index ranges, in one host sync, and
    finished only once every range holds); None for a call without queries."""
    index = [inputs[n] for n in ("positions", "seq", "block_rows", "key_len")]
    if all(t.device.type == "cpu" for t in index) and _holds_on_host(*index, params):
        return None  # every check holds, found without a torch op (a decode step's cost)
    positions, seq = inputs["positions"].long(), inputs["seq"].long()
    block_rows, key_len = inputs["block_rows"], inputs["key_len"].long()
    S = block_rows.shape[0]
    if positions.numel() == 0 or S == 0:
        return None  # no query, or no sequence (the range of seq then fails first)
    seq = seq.clamp(0, S - 1)  # indexes safely before the ranges are read back
    live = positions >= 0
    # distinct positions per sequence: sort the rows by (sequence, position), each row
    # without a query at a distinct negative key (no boolean indexing: no host sync)
    none = -1 - torch.arange(positions.shape[0], device=positions.device)
    key = torch.where(live, seq * (1 << 31) + positions, none)
    sorted_key = torch.sort(key).values
    dup = sorted_key[1:] == sorted_key[:-1]
    beyond = live & (positions >= key_len[seq])
    # every block from the lowest visible position's block to the query's own must be present
    if params["layer"] == "local":
        lo = (positions - params["window"] + 1).clamp(min=0)
    else:
        lo = torch.zeros_like(positions)
    nb = block_rows.shape[1]
    b = torch.arange(nb, device=positions.device)
    need = live[:, None] & (b >= lo[:, None] // BLOCK) & (b <= positions[:, None] // BLOCK)
    missing = need & (block_rows[seq].long() < 0)
    short = positions // BLOCK >= nb
    flags = torch.stack([dup.any(), beyond.any(), missing.any(), short.any()]).long()

    def finish(values: list[int]) -> None:
        if values[0]:
            k = int(sorted_key[1:][dup][0])
            raise ContractViolation(
                "gated_attention", "positions", "inputs.positions.values",
                f"two queries of sequence {k >> 31} at position {k & ((1 << 31) - 1)}: a "
                f"sequence's queries must be at distinct positions",
            )  # fmt: skip
        if values[1]:
            t = int(beyond.nonzero()[0, 0])
            raise ContractViolation(
                "gated_attention", "positions", "inputs.positions.values",
                f"query {t} at position {int(positions[t])} but its sequence's keys end at "
                f"{int(key_len[seq[t]])} (key_len)",
            )  # fmt: skip
        if values[2]:
            t, blk = (int(x) for x in missing.nonzero()[0])
            raise ContractViolation(
                "gated_attention", "block_rows", "inputs.block_rows.values",
                f"query {t} (sequence {int(seq[t])}, position {int(positions[t])}) sees key "
                f"block {blk}, which block_rows marks absent (-1)",
            )  # fmt: skip
        if values[3]:
            top = int(positions.max())
            raise ContractViolation(
                "gated_attention", "block_rows", "inputs.block_rows.shape[1]",
                f"a query at position {top} needs block {top // BLOCK}, but block_rows has {nb}",
            )  # fmt: skip

    return flags, finish


def _holds_on_host(positions, seq, block_rows, key_len, params) -> bool:
    """Whether every check of ``check_call`` holds, computed on host tensors without a torch
    op: over Python lists below FEW_ROWS queries, else in numpy. False also where an index is
    out of its range: the torch path then finds what to report, after the ranges."""
    S, nb = block_rows.shape
    if positions.numel() == 0 or S == 0:
        return True
    if positions.numel() < FEW_ROWS and key_len.shape == (S,):
        return _holds_in_python(positions.tolist(), seq.tolist(), block_rows, key_len.tolist(),
                                params)  # fmt: skip
    pos, sq = positions.numpy(), seq.numpy()
    rows, lens = block_rows.numpy(), key_len.numpy()
    if sq.min() < 0 or sq.max() >= S or lens.shape != (S,):
        return False
    live = pos >= 0
    if not live.all():
        pos, sq = pos[live], sq[live]
        if pos.size == 0:
            return True
    pos, sq = pos.astype(np.int64), sq.astype(np.int64)
    if pos.size > 1:
        key = np.sort(sq * (1 << 31) + pos)
        if (key[1:] == key[:-1]).any():
            return False  # two queries of a sequence at one position
    if (pos >= lens[sq]).any():
        return False  # a query beyond its sequence's keys
    hi = pos // BLOCK
    if hi.max() >= nb:
        return False  # a query past the block table
    lo = np.maximum(pos - params["window"] + 1, 0) // BLOCK if params["layer"] == "local" else 0
    # absent blocks per sequence, counted up to each block: none between lo and hi
    absent = np.zeros((S, nb + 1), dtype=np.int64)
    np.cumsum(rows < 0, axis=1, out=absent[:, 1:])
    return not (absent[sq, hi + 1] - absent[sq, lo] > 0).any()


def _holds_in_python(pos: list, seq: list, block_rows, lens: list, params) -> bool:
    """``_holds_on_host`` for a few queries, over Python lists."""
    S, nb = block_rows.shape
    local, window = params["layer"] == "local", params["window"]
    table = None
    seen = set()
    for p, s in zip(pos, seq, strict=True):
        if not 0 <= s < S:
            return False
        if p < 0:
            continue
        if (s, p) in seen or p >= lens[s] or p // BLOCK >= nb:
            return False
        seen.add((s, p))
        if table is None:
            table = block_rows.tolist()
        lo = max(p - window + 1, 0) // BLOCK if local else 0
        if min(table[s][lo : p // BLOCK + 1]) < 0:
            return False
    return True
