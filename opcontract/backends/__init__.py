"""Backends. ``load()`` registers every implementation; a backend whose library is missing
still registers, and its implementations are rejected with that reason."""

from __future__ import annotations

import importlib

_MODULES = (
    "opcontract.backends.torch.register",
    "opcontract.backends.triton.register",
    "opcontract.backends.cute.register",
)
_loaded = False


def load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _MODULES:
        importlib.import_module(mod)
