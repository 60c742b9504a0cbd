"""When an op's public wrapper may call its implementation function itself, skipping the
torch.library op around it (the same function, so the same bits).

The library op exists for autograd and for torch.compile (which must not trace into a
kernel). A plain eager call that builds no autograd graph needs neither, and the op's
Python dispatch costs tens of microseconds per call: at decode sizes, more than the kernel.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def bypass_op(*tensors: torch.Tensor | None) -> bool:
    """True when no autograd graph is being built, nothing traces the call, no dispatch
    mode or tensor subclass is in play."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or (grad and t.requires_grad):
            return False
    return True
