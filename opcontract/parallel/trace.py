"""Trace a forward's replicated activations, to find the first op where two runs part.

Two runs at different tensor-parallel degrees (or two machines) compute the same
replicated activations, bit for bit, when they agree: the embedding, every norm, each
attention and MLP output (after the row-parallel combine), each layer's output. A hook on
each such module records its output's SHA-256 in call order; ``first_difference`` names the
first module whose bits differ. Column-parallel roles (a rank's shard when sharded) are
not traced, sharded or not, so a sharded run's trace lines up with an unsharded one's.
Under context parallelism (``opcontract.parallel.context``) a module's output over a rank's
chunk of the sequence is gathered into the whole sequence before it is digested (every rank
runs the same hooks in the same order), so a CP run's trace lines up with one rank's too.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
from torch import nn


def _digest(t: torch.Tensor) -> str:
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(b).hexdigest()[:16]


def _column_roles() -> list[str]:
    """The plan's column-parallel module patterns."""
    from opcontract.parallel.muse_glimmer import tp_plan
    from opcontract.parallel.styles import StrictColwiseParallel

    return [p for p, st in tp_plan().items() if isinstance(st, StrictColwiseParallel)]


def _replicated(name: str, cols: list[str]) -> bool:
    """Not a column-parallel role of the plan (sharded or not), not a per-head op."""
    from opcontract.parallel.muse_glimmer import _matches

    return not any(_matches(p, name) for p in cols) and not name.endswith(("qk_norm", "rotary_emb"))


@contextlib.contextmanager
def activation_trace(model: nn.Module) -> Iterator[list[tuple[str, str]]]:
    """``with activation_trace(model) as trace: model(...)``: trace holds (module name,
    output digest) for every replicated module's call, in call order."""
    records: list[tuple[str, str]] = []
    handles = []
    cols = _column_roles()
    cp = getattr(model, "_opcontract_cp", None)
    for name, mod in model.named_modules():
        if not name or not _replicated(name, cols):
            continue

        def hook(m, args, out, name=name):
            t = out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)
            if isinstance(t, torch.Tensor):
                records.append((name, _digest(_whole(t, cp))))

        handles.append(mod.register_forward_hook(hook))
    try:
        yield records
    finally:
        for h in handles:
            h.remove()


def _whole(t: torch.Tensor, cp) -> torch.Tensor:
    """``t``, or the whole sequence when it is a context-parallel rank's chunk of it."""
    if cp is None or not cp.active or t.dim() < 2 or t.shape[1] == cp.length:
        return t
    from opcontract.parallel.context import _gather_rows

    return _gather_rows(t.detach().contiguous(), cp, cp.length)


def first_difference(a: list, b: list) -> tuple[int, str] | None:
    """(index, module name) of the first traced call whose bits (or whose module) differ;
    None when the traces are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i, x[0] if x[0] == y[0] else f"{x[0]} / {y[0]}"
    if len(a) != len(b):
        n = min(len(a), len(b))
        return n, (a if len(a) > n else b)[n][0]
    return None
