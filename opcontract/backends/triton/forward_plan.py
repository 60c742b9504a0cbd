"""Call plans (``plan_no_grad``) for implementations whose host work reads index values
each call (qk_norm_rope's positions, gated_attention's tile table): the plan is the
implementation's forward itself, reached without the op shell's full path once a signature
ran. Dispatch checks the index values before every call of such a plan (they must be on the
host: see ``OpFunction._plan``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def forward_plan(forward: Callable[..., tuple]) -> Callable[..., Any]:
    """``plan_no_grad`` calling ``forward(config, *inputs, **params)``; the plan declines
    (None) a call with a non-contiguous tensor, which the shell then copies (the layout these
    implementations declare)."""

    def plan_no_grad(config: dict, inputs: dict, params: dict, lead) -> Callable | None:
        if lead is not None:
            return None
        kw = dict(params)

        def run(*args: Any) -> tuple | None:
            for a in args:
                if a is not None and not a.is_contiguous():
                    return None
            return forward(config, *args, **kw)

        return run

    return plan_no_grad
