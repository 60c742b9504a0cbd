"""A launch config as the string a torch.library op takes, encoded once per distinct config."""

from __future__ import annotations

import functools
import json
from typing import Any


@functools.lru_cache(maxsize=1024)
def _encode(items: tuple) -> str:
    return json.dumps(dict(items), sort_keys=True)


def config_string(config: dict[str, Any] | None) -> str:
    """``json.dumps(config, sort_keys=True)``, or "" for no config; memoised per config."""
    if not config:
        return ""
    try:
        return _encode(tuple(sorted(config.items())))
    except TypeError:  # an unhashable value: encode it every time
        return json.dumps(config, sort_keys=True)
