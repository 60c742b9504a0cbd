"""The search space of an implementation: its declared config space, nothing the contract pins.

Order-determining choices (a GEMM's K step, the vocabulary block, promotion) are constants
of the implementation, written into its declared plan; they never appear in a config space.
Whether the rest truly leaves the bits alone is checked per candidate by ``verify``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from opcontract.backends.registry import Implementation


def search_space(impl: Implementation, narrow: dict | None = None) -> dict[str, tuple]:
    """Parameter -> candidate values; ``narrow``: a subset of the values for some of them."""
    return {k: tuple((narrow or {}).get(k, v)) for k, v in impl.config_space.items()}


def candidates(impl: Implementation, base: dict, narrow: dict | None = None) -> Iterator[dict]:
    """Every config of the (narrowed) space (the base config's other keys kept)."""
    space = search_space(impl, narrow)
    keys = sorted(space)
    for values in itertools.product(*(space[k] for k in keys)):
        yield {**base, **dict(zip(keys, values, strict=True))}
