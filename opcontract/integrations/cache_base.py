"""What the patched model's two KV caches (``OpcontractKVCache``, ``OpcontractStaticCache``)
share: the text config's layer kinds, and the parts of transformers' ``Cache`` interface they
answer alike."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache


class OpcontractPatchError(TypeError):
    """The model is not one this patch has validated; nothing was changed."""


class LayerKindsCache(Cache):
    """A ``Cache`` with one entry per decoder layer, each ``"local"`` (sliding window) or
    ``"global"``. Written only by opcontract's patched attention (``update``, the stock
    attention's path, refuses); no beam search, no cropping."""

    def __init__(self, config: Any, backend: str | None) -> None:
        super().__init__(layers=[])
        text = config.get_text_config(decoder=True)
        self.kinds = ["local" if t == "sliding_attention" else "global" for t in text.layer_types]
        self.window = text.sliding_window
        self.backend = backend

    def __len__(self) -> int:
        return len(self.kinds)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    @property
    def is_sliding(self) -> list[bool]:
        return [k == "local" for k in self.kinds]

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.kinds)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.kinds)

    def update(self, *args: Any, **kwargs: Any):
        raise OpcontractPatchError(
            f"{type(self).__name__} is written only by opcontract's patched attention; a stock "
            "attention forward reached it (is the model patched with apply_opcontract?)"
        )

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__}: beam search is not supported")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{type(self).__name__}: cropping is not supported")
