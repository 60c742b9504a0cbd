"""Muse Glimmer in Hugging Face transformers, routed through opcontract's ops.

>>> from opcontract.integrations.transformers import apply_opcontract
>>> model = apply_opcontract(MuseGlimmerForConditionalGeneration(config))
>>> out = model.generate(ids, attention_mask=mask, max_new_tokens=8)   # an OpcontractKVCache

An instance patch of ``MuseGlimmerForConditionalGeneration``'s text path (the vision tower,
adapter and projection are left as they are): the normalised embedding, every RMSNorm, the
q/k/v/gate/o and MLP projections (``dense_gemm``), ``qk_norm_rope``, ``gated_attention``,
``swiglu`` and the soft-capped LM head. Parameters, buffers and state-dict keys are unchanged;
only module ``forward`` methods (instance attributes) and the text config's attention
implementation name change.

What a token's bits depend on is fixed in one place each:

- Positions come from the attention mask and nothing else: a token's position is the number
  of real tokens before it in its row (``cumsum(mask) - 1``), in a training forward and in
  every generation step alike. Explicit ``position_ids`` must agree with that (or raise).
- Attention goes through transformers' interfaces under the name ``"opcontract"``: a mask
  function (``AttentionMaskInterface``) that hands the 2-D padding mask through unchanged,
  and an attention function (``AttentionInterface``) that takes the gate as a keyword and
  returns the gated output. Without a cache it calls ``opcontract.attention.padded``; with an
  :class:`OpcontractKVCache` it appends the real tokens to one ``PagedKVCache`` per layer and
  attends there. ``generate()`` gets an ``OpcontractKVCache`` unless given another cache;
  any other ``Cache`` is refused.
- The head returns ``softcap_logits``'s float32 logits (never rounded to the model dtype)
  and their ``lse``; ``labels`` give the mean next-token loss through ``softcap_logprob``.
  :func:`token_logprobs` is the trainer's per-token log-probability of given tokens, and
  :func:`generate_with_logprobs` records each generated token's as it is sampled: the same
  bits. TRL's trainers: :mod:`opcontract.integrations.trl`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, masking_utils
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.muse_glimmer import modeling_muse_glimmer as mg

from opcontract import attention as _attention
from opcontract import dispatch
from opcontract.backends.placement import on_device
from opcontract.integrations import lora
from opcontract.integrations.cache_base import LayerKindsCache, OpcontractPatchError
from opcontract.integrations.positions import (
    Packing,
    packing_from_position_ids,
    positions_from_mask,
)
from opcontract.integrations.static_cache import CacheStep, OpcontractStaticCache, require
from opcontract.outputs import LogprobOutput

ATTN_IMPLEMENTATION = "opcontract"
SAMPLER_ROWS = 256  # softcap_logits serves at most this many rows a call
SHARDED_HEAD = "_opcontract_sharded_head"  # set by opcontract.parallel (head="vocab")
_FLAG = "_opcontract_patched"
_BACKEND = "_opcontract_backend"
OPCONTRACT_FORWARD = "_opcontract_forward"  # the patched forward, kept on the instance
_STATIC = "_opcontract_static_cache"  # generate()'s last OpcontractStaticCache

__all__ = [
    "ATTN_IMPLEMENTATION",
    "OpcontractCausalLMOutput",
    "OpcontractKVCache",
    "OpcontractPatchError",
    "OpcontractStaticCache",
    "Rollout",
    "apply_opcontract",
    "generate_with_logprobs",
    "is_patched",
    "logprob_head",
    "patched_backend",
    "positions_from_mask",
    "token_logprobs",
]


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`apply_opcontract` has patched ``model`` (or a ``PeftModel``'s model)."""
    return bool(vars(lora.unwrap(model)).get(_FLAG, False))


# -- the KV cache generate() uses ---------------------------------------------------------


class OpcontractKVCache(LayerKindsCache):
    """A transformers ``Cache`` holding one :class:`opcontract.attention.PagedKVCache` per
    decoder layer, one sequence per batch row.

    Only real tokens (mask 1) are stored, at their mask-derived positions, as post-norm,
    post-RoPE keys and values written by the same ``qk_norm_rope`` op training uses; padding
    never enters a page. ``get_seq_length`` counts columns (real and padding), which is what
    ``generate()`` slices its inputs by. ``update`` (the stock attention's path) refuses:
    only the patched attention writes here. Beam reordering and cropping are not supported.
    """

    def __init__(self, config: Any, *, backend: str | None = None) -> None:
        super().__init__(config, backend)
        self.paged: list[_attention.PagedKVCache | None] = [None] * len(self.kinds)
        self.columns = [0] * len(self.kinds)
        self._tokens: tuple | None = None  # the last step's real tokens (see _real_tokens)
        # the padding mask of the forward now running, read to the host once by the patched
        # model's forward (set around its layers: a bare model call reads it per step)
        self._host_mask: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"OpcontractKVCache(layers={len(self.kinds)}, columns={self.columns[:1]})"

    # -- what generate() and the mask utilities read
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns[layer_idx] if layer_idx < len(self.columns) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def reset(self) -> None:
        self.paged = [None] * len(self.kinds)
        self.columns = [0] * len(self.kinds)
        self._tokens = None
        self._host_mask = None

    def _real_tokens(self, mask: torch.Tensor, seen: int, device: torch.device) -> tuple:
        """(rows, positions) on the host and (rows, columns) on ``device`` of this step's real
        tokens, and the host [B, Lq] positions of every column (-1 at padding): computed once
        per step, not once per layer, from the host copy of the forward's mask where the
        patched model's forward made one (else one read-back of ``mask``)."""
        host = self._host_mask
        src = host if host is not None and host.shape == mask.shape else mask
        hit = self._tokens
        if hit is not None and hit[0] is src and hit[1] == seen and hit[2] == device:
            return hit[3]
        grid = positions_from_mask(src.cpu())[:, seen:]  # the host copy as it is
        rows, cols = (grid >= 0).nonzero(as_tuple=True)  # row-major: each row's tokens in order
        found = (rows, grid[rows, cols], on_device(rows, device), on_device(cols, device),
                 grid)  # fmt: skip
        self._tokens = (src, seen, device, found)
        return found

    def query_positions(self, layer_idx: int, mask: torch.Tensor, device: torch.device):
        """[B * Lq] int64 on the host: the logical position of each of this call's columns of
        ``mask`` [B, columns + Lq] (padding's clamped to 0: its rows are never read)."""
        grid = self._real_tokens(mask, self.columns[layer_idx], device)[4]
        return grid.clamp(min=0).reshape(-1)

    # -- the attention's path
    def step(self, layer_idx: int, q, k, v, gate, mask: torch.Tensor, *, scale: float):
        """Append this call's real tokens of one layer and attend over the layer's cache.

        q, gate [B, Lq, Hq, D], k, v [B, Lq, Hkv, D]; mask [B, columns + Lq], the whole
        padding mask so far. Returns [B, Lq, Hq, D], zeros at padding."""
        B, Lq = q.shape[:2]
        seen = self.columns[layer_idx]
        if mask.shape != (B, seen + Lq):
            raise ValueError(
                f"OpcontractKVCache layer {layer_idx}: the attention mask is "
                f"{tuple(mask.shape)}, expected [{B}, {seen} cached + {Lq} new columns]"
            )
        paged = self.paged[layer_idx]
        if paged is None:
            kind = self.kinds[layer_idx]
            paged = _attention.PagedKVCache(
                layer=kind, kv_heads=k.shape[2], head_dim=k.shape[3], dtype=k.dtype,
                device=k.device, sequences=B, window=self.window if kind == "local" else None,
                scale=scale, backend=self.backend,
            )  # fmt: skip
            self.paged[layer_idx] = paged
        elif paged.sequences != B:
            raise ValueError(
                f"OpcontractKVCache holds {paged.sequences} sequences, got a batch of {B}"
            )
        rows, positions, r, c, _ = self._real_tokens(mask, seen, q.device)
        if rows.numel() == B * Lq:  # every column real (a decode step): rows in order, views
            flat = (t.reshape(B * Lq, *t.shape[2:]) for t in (q, k, v, gate))
            out = paged.step(rows, positions, *flat).view(q.shape)
        else:
            out = q.new_zeros(q.shape)
            if rows.numel():
                out[r, c] = paged.step(rows, positions, q[r, c], k[r, c], v[r, c], gate[r, c])
        self.columns[layer_idx] = seen + Lq
        return out


# -- transformers' attention and mask interfaces -----------------------------------------


def _padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask function registered as "opcontract": the 2-D padding mask, unchanged
    (causality, the window and positions are the op's, derived from it)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch_size, kv_length):
        raise ValueError(
            f"opcontract attention takes a 2-D padding mask [{batch_size}, {kv_length}], "
            f"got {tuple(attention_mask.shape)}"
        )
    last = _LAST_MASK[0]
    if last is not None and last[0] is attention_mask and last[2] == attention_mask._version:
        return last[1]  # the other layer kind's mask of this forward: the same object, so
        # the cache finds this step's real tokens once (OpcontractKVCache._real_tokens)
    out = attention_mask.to(torch.bool)
    _LAST_MASK[0] = (attention_mask, out, attention_mask._version)
    return out


_LAST_MASK: list = [None]  # (the last 2-D mask given, its bool form, its version)


def _gated_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    gate: torch.Tensor | None = None,
    past_key_values: Cache | None = None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    dropout: float = 0.0,
    backend: str | None = None,
    opcontract_step: CacheStep | None = None,
    opcontract_packing: Packing | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as "opcontract": gated_attention over query
    [B, Hq, Lq, D], key/value [B, Hkv, Lq, D] (this call's tokens; the cache holds the rest)
    and gate [B, Lq, Hq, D]. Returns the gated output [B, Lq, Hq, D] and no weights."""
    if gate is None:
        raise ValueError("opcontract attention needs the gate (call it from the patched model)")
    if dropout:
        raise ValueError("opcontract attention has no dropout; set attention_dropout to 0")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    B, Lq = q.shape[:2]
    kind = "local" if sliding_window else "global"
    if opcontract_packing is not None:  # whole sequences back to back in each row
        if past_key_values is not None or getattr(module, "_opcontract_attention", None):
            raise OpcontractPatchError(
                "packed sequences: a training forward without a KV cache or tensor parallelism"
            )
        flat = [t.reshape(B * Lq, *t.shape[2:]) for t in (q, k, v, gate)]
        cu, index = opcontract_packing.cu_seqlens, opcontract_packing.index
        if q.device not in index:  # the first layer builds it; every layer reads the same
            index[q.device] = _attention.packed_index(cu, B * Lq, q.device)
        out = _attention.packed(*flat, cu, layer=kind, window=sliding_window, scale=scaling,
                                backend=backend, index=index[q.device])  # fmt: skip
        return out.reshape(B, Lq, *out.shape[1:]), None
    if isinstance(past_key_values, OpcontractStaticCache):
        if opcontract_step is None:
            raise OpcontractPatchError("OpcontractStaticCache: the attention got no step (call "
                                       "the patched model's forward)")  # fmt: skip
        out = past_key_values.attend(module.layer_idx, opcontract_step, q, k, v, gate,
                                     scale=scaling)  # fmt: skip
        return out, None
    if isinstance(past_key_values, OpcontractKVCache):
        seen = past_key_values.get_seq_length(module.layer_idx)
        mask = attention_mask
        if mask is None:
            mask = torch.ones(B, seen + Lq, dtype=torch.bool, device=q.device)
        out = past_key_values.step(module.layer_idx, q, k, v, gate, mask, scale=scaling)
        return out, None
    if past_key_values is not None:
        raise OpcontractPatchError(
            f"opcontract attention keeps its KV cache in an OpcontractKVCache, got "
            f"{type(past_key_values).__name__}"
        )
    mask = attention_mask
    if mask is None:
        mask = torch.ones(B, Lq, dtype=torch.bool, device=q.device)
    run = getattr(module, "_opcontract_attention", None) or _attention.padded  # TP replicas
    out = run(q, k, v, gate, mask, layer=kind, window=sliding_window, scale=scaling,
              backend=backend)  # fmt: skip
    return out, None


AttentionInterface.register(ATTN_IMPLEMENTATION, _gated_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _padding_mask)


# -- patched forwards (bound to module instances) -----------------------------------------


_OPS: dict[tuple[str, str | None], Any] = {}


def _op(name: str, backend: str | None):
    """``dispatch.op(name, backend=backend)``, built once: a forward that torch.compile
    traces reads it from here instead of building it (which reads the contract files)."""
    fn = _OPS.get((name, backend))
    if fn is None:
        fn = _OPS[name, backend] = dispatch.op(name, backend=backend)
    return fn


def _rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply a [T, H] -> [T, N] op over any leading dimensions."""
    y = fn(x.reshape(-1, x.shape[-1]))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _patch_linear(lin: nn.Linear, backend: str | None) -> None:
    gemm = dispatch.op("dense_gemm", backend=backend)

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return _rows(lambda r: gemm(r, self.weight, self.bias), x)

    lin.forward = types.MethodType(forward, lin)
    object.__setattr__(lin, lora.MARK, True)


def _patch_projection(owner: nn.Module, name: str, where: str, backend: str | None) -> None:
    """``owner.<name>``: an nn.Linear, or PEFT's LoRA layer over one (both through
    dense_gemm)."""
    mod = owner._modules[name]
    if lora.is_lora_linear(mod):
        lora.patch_lora_linear(mod, f"{where}.{name}", lambda lin: _patch_linear(lin, backend),
                               dispatch.op("dense_gemm", backend=backend))  # fmt: skip
    else:
        _patch_linear(mod, backend)


def _need_projection(owner: nn.Module, name: str, where: str) -> nn.Module:
    """``owner.<name>`` when it is an nn.Linear or a LoRA layer this patch serves."""
    mod = getattr(owner, name, None)
    if mod is not None and lora.is_lora_linear(mod):
        lora.check_lora_linear(mod, f"{where}.{name}")
        return mod
    return _need(owner, name, nn.Linear, where)


def _proj(owner: nn.Module, name: str, where: str) -> nn.Module:
    """``owner.<name>``, refused when something replaced it after patching (e.g. PEFT's
    ``get_peft_model`` on a patched model: its adapter products would run unpatched)."""
    mod = owner._modules[name]
    if not mod.__dict__.get(lora.MARK, False):
        raise OpcontractPatchError(
            f"{where}.{name} is {lora.describe(mod)}, put there after apply_opcontract; call "
            "apply_opcontract(model) again (it patches PEFT's LoRA layers) before running it"
        )
    return mod


def _patch_norm(norm: nn.Module, variant: str, backend: str | None) -> None:
    op = dispatch.op("rms_norm", backend=backend)

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        w = None if variant == "weightless" else self.weight
        return _rows(lambda r: op(r, w, variant=variant, eps=self.eps), x)

    norm.forward = types.MethodType(forward, norm)


def _patch_embedding(emb: nn.Embedding, backend: str | None) -> None:
    op = dispatch.op("normalized_embedding", backend=backend)

    def forward(self: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        y = op(flat, self.weight, eps=self.embed_norm.eps)
        if self.padding_idx is not None and torch.is_grad_enabled() and y.requires_grad:
            # nn.Embedding's padding_idx: that row never gets a gradient (the same values;
            # a stock pad row is zeros, where the norm's gradient is ~1/sqrt(eps))
            pad = (flat == self.padding_idx)[:, None]
            y = torch.where(pad, y.detach(), y)
        return y.reshape(*input_ids.shape, y.shape[-1])

    emb.forward = types.MethodType(forward, emb)
    object.__setattr__(emb, lora.MARK, True)


def _head_weight(model: nn.Module) -> torch.Tensor:
    """``model.lm_head.weight``, refused when something replaced the head after patching
    (a LoRA layer's ``weight`` is its base weight: the fused head would drop the adapter)."""
    head = model._modules["lm_head"]
    if not head.__dict__.get(lora.MARK, False):
        raise OpcontractPatchError(
            f"model.lm_head is {lora.describe(head)}, put there after apply_opcontract; the "
            "fused head reads lm_head.weight alone (leave lm_head out of LoRA's target_modules "
            "and modules_to_save)"
        )
    return head.weight


def _check_embedding(model: nn.Module) -> None:
    emb = model.model.language_model._modules["embed_tokens"]
    if not emb.__dict__.get(lora.MARK, False):
        raise OpcontractPatchError(
            f"model.model.language_model.embed_tokens is {lora.describe(emb)}, put there after "
            "apply_opcontract (leave embed_tokens out of LoRA's target_modules and "
            "modules_to_save)"
        )


def _patch_mlp(mlp: nn.Module, where: str, backend: str | None) -> None:
    op = dispatch.op("swiglu", backend=backend)

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        g, u = _proj(self, "gate_proj", where)(x), _proj(self, "up_proj", where)(x)
        y = op(g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1])).reshape(g.shape)
        return _proj(self, "down_proj", where)(y)

    mlp.forward = types.MethodType(forward, mlp)


def _patch_attention(
    attn: nn.Module, kind: str, rope_theta: float | None, where: str, backend: str | None
) -> None:
    qk_op = dispatch.op("qk_norm_rope", backend=backend)

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,  # the stock rotary's cos/sin: unused (qk_norm_rope)
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        B, L, _ = hidden_states.shape
        D = self.head_dim
        q = _proj(self, "q_proj", where)(hidden_states).view(B, L, -1, D)
        k = _proj(self, "k_proj", where)(hidden_states).view(B, L, -1, D)
        v = _proj(self, "v_proj", where)(hidden_states).view(B, L, -1, D)
        gate = _proj(self, "gate_proj", where)(hidden_states).view(B, L, -1, D)
        step = kwargs.get("opcontract_step")  # OpcontractStaticCache's, from the top forward
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                "opcontract attention derives positions from a 2-D padding mask; got a "
                f"{attention_mask.dim()}-D mask"
            )
        mask = attention_mask
        if mask is None and step is None:
            seen = past_key_values.get_seq_length(self.layer_idx) if past_key_values else 0
            mask = torch.ones(B, seen + L, dtype=torch.bool, device=q.device)
        cp = getattr(self, "_opcontract_cp", None)  # opcontract.parallel.context's chunk
        packing = kwargs.get(PACKING_KWARG)
        if packing is not None:
            if step is not None or cp is not None or past_key_values is not None:
                raise OpcontractPatchError(
                    "packed sequences: a training forward without a KV cache or context "
                    "parallelism"
                )
            pos = packing.positions
        elif step is not None:
            pos = step.positions.clamp(min=0)  # padding's never read
        elif cp is None and isinstance(past_key_values, OpcontractKVCache):
            pos = past_key_values.query_positions(self.layer_idx, mask, q.device)  # host
        else:
            rows = slice(-L, None) if cp is None else cp.rows(mask.shape[1], L)
            pos = positions_from_mask(mask)[:, rows].clamp(min=0)  # padding's never read
        qk = qk_op(q.reshape(B * L, -1, D), k.reshape(B * L, -1, D), pos.reshape(-1),
                   layer=kind, rope_theta=rope_theta, qk_scale=self.qk_scale_factor,
                   eps=self.qk_norm.eps)  # fmt: skip
        impl = self.config._attn_implementation
        if impl != ATTN_IMPLEMENTATION:
            raise OpcontractPatchError(
                f"the patched attention runs under attn_implementation={ATTN_IMPLEMENTATION!r}, "
                f"the config says {impl!r}"
            )
        fn = ALL_ATTENTION_FUNCTIONS[impl]
        out, _ = fn(
            self,
            qk.q_out.view(B, L, -1, D).transpose(1, 2),
            qk.k_out.view(B, L, -1, D).transpose(1, 2),
            v.transpose(1, 2),
            attention_mask,
            gate=gate,
            past_key_values=past_key_values,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            dropout=self.attention_dropout if self.training else 0.0,
            backend=backend,
            opcontract_step=step,
            opcontract_packing=packing,
        )
        return _proj(self, "o_proj", where)(out.reshape(B, L, -1)), None

    attn.forward = types.MethodType(forward, attn)


# whether a patched layer checkpoints itself: not where the layer's __call__ already does
_SELF_CHECKPOINT = "__call__" not in GradientCheckpointingLayer.__dict__


def _patch_decoder_layer(layer: nn.Module, backend: str | None) -> None:
    """The sandwich order of the stock layer; the residual add after attention and the
    pre-feed-forward norm become one fused_add_rms_norm (same sum: float32, rounded once).

    Gradient checkpointing (``model.gradient_checkpointing_enable()``, TRL's default) is
    carried over: where the stock layer checkpoints its class ``forward`` (transformers 5.2x),
    which this instance forward replaces, it checkpoints itself through the same
    ``_gradient_checkpointing_func``; where the layer's ``__call__`` checkpoints (5.17), that
    one does, around this forward. The recompute runs the same ops on the same inputs: the
    same bits."""
    add_norm = dispatch.op("fused_add_rms_norm", backend=backend)

    def body(self: nn.Module, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        shape = hidden_states.shape
        a, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        a = self.post_attention_layernorm(a)
        ff = self.pre_feedforward_layernorm
        fused = add_norm(a.reshape(-1, shape[-1]), hidden_states.reshape(-1, shape[-1]),
                         ff.weight, variant="centred", eps=ff.eps)  # fmt: skip
        residual = fused.residual_out.reshape(shape)
        m = self.post_feedforward_layernorm(self.mlp(fused.y.reshape(shape)))
        return residual + m

    def forward(self: nn.Module, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if _SELF_CHECKPOINT and getattr(self, "gradient_checkpointing", False) and self.training:
            if kwargs.get("past_key_values") is not None:
                raise ValueError(
                    "past_key_values with gradient checkpointing: the recompute would write "
                    "the KV cache a second time"
                )
            step = functools.partial(body, self, **kwargs)
            return self._gradient_checkpointing_func(step, hidden_states)
        return body(self, hidden_states, **kwargs)

    layer.forward = types.MethodType(forward, layer)


def _head(model: nn.Module, hidden: torch.Tensor, backend: str | None):
    """softcap_logits over [..., H] rows, SAMPLER_ROWS at a time (batch-invariant: the
    chunking changes no bit). (logits float32 [..., V], lse float32 [...]): logits[y] - lse
    is softcap_logprob's log-prob of y, bitwise."""
    text = model.config.text_config
    op = _op("softcap_logits", backend)
    flat = hidden.reshape(-1, hidden.shape[-1])
    weight = _head_weight(model)
    sharded = getattr(model, SHARDED_HEAD, None)  # opcontract.parallel's vocabulary slices
    if sharded is not None:
        w = weight.to_local() if hasattr(weight, "to_local") else weight
        parts = [sharded.logits(flat[i : i + SAMPLER_ROWS], w)
                 for i in range(0, flat.shape[0], SAMPLER_ROWS)]  # fmt: skip
    else:
        parts = [
            op(flat[i : i + SAMPLER_ROWS], weight,
               multiplier=text.output_multiplier, softcap=text.final_logit_softcapping)
            for i in range(0, flat.shape[0], SAMPLER_ROWS)
        ]  # fmt: skip
    if parts:
        logits, lse = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    else:
        logits = flat.new_zeros(0, model.lm_head.out_features, dtype=torch.float32)
        lse = flat.new_zeros(0, dtype=torch.float32)
    return logits.reshape(*hidden.shape[:-1], logits.shape[-1]), lse.reshape(hidden.shape[:-1])


def logprob_head(
    model: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    entropy: bool = False,
    predicted: bool = False,
    backend: str | None = None,
    temperature: float = 1.0,
    mean_logits: bool = False,
    log_sum_sq_probs: bool = False,
):
    """The trainer's head: softcap_logprob over final hidden rows [T, H] and their targets
    [T] (-100 ignored), with the model's multiplier and soft cap, of softmax(z /
    ``temperature``). A ``LogprobOutput`` (``logprob`` [T] float32; ``entropy``,
    ``predicted``, ``mean_logits`` and ``log_sum_sq_probs`` (log sum_v p^2, no gradient) when
    asked). Rows are batch-invariant: a row's bits do not depend on the other rows in the
    call. ``backend`` None: the one the model was patched with (the head its own forward and
    generation run)."""
    model = lora.unwrap(model)
    if backend is None and is_patched(model):
        backend = patched_backend(model)
    text = model.config.text_config
    sharded = getattr(model, SHARDED_HEAD, None)  # opcontract.parallel's vocabulary slices
    if sharded is not None:
        asked = [f"temperature={temperature!r}"] if temperature != 1.0 else []
        asked += [n for n, on in (("mean_logits", mean_logits),
                                  ("log_sum_sq_probs", log_sum_sq_probs)) if on]  # fmt: skip
        if asked:
            raise ValueError(
                f"{', '.join(asked)}: the vocabulary-parallel head serves no temperature, "
                "mean_logits or log_sum_sq_probs (its vocab_slice contracts declare none); use "
                "an unsharded head"
            )
        w = _head_weight(model)
        w = w.to_local() if hasattr(w, "to_local") else w
        lp = sharded.logprob(hidden, w, targets)
        if not (entropy or predicted):
            return LogprobOutput(logprob=lp)
        ent, pred = sharded.head_outputs(hidden, w, entropy, predicted)  # entropy: no gradient
        return LogprobOutput(logprob=lp, entropy=ent, predicted=pred)
    out = _op("softcap_logprob", backend)(
        hidden, _head_weight(model), targets, multiplier=text.output_multiplier,
        softcap=text.final_logit_softcapping, return_entropy=entropy, return_predicted=predicted,
        temperature=temperature, return_mean_logits=mean_logits,
        return_log_sum_sq_probs=log_sum_sq_probs,
    )  # fmt: skip
    return LogprobOutput(logprob=out) if isinstance(out, torch.Tensor) else out


@dataclasses.dataclass
class OpcontractCausalLMOutput(mg.MuseGlimmerCausalLMOutputWithPast):
    """The stock output, with ``lse`` [B, kept positions] float32: the log-sum-exp of each
    row of ``logits`` as softcap_logprob merges it (``logits[..., y] - lse`` is its log-prob),
    and ``token_accuracy`` (the fraction of labelled tokens whose argmax is the label) when
    asked with ``return_token_accuracy=True``. Training with labels returns no logits.
    ``head_hidden`` [B, kept positions, H]: the final hidden rows the logits came from."""

    lse: torch.FloatTensor | None = None
    token_accuracy: torch.FloatTensor | None = None
    head_hidden: torch.FloatTensor | None = None


def _check_position_ids(
    position_ids: torch.Tensor | None, mask: torch.Tensor | None, L: int, offset: int = 0
):
    """Explicit position ids must be the mask's (on real tokens): positions have one source.
    Without a mask every token is real: positions offset .. offset + L - 1 (offset: the
    columns already cached). Packed rows (position ids restarting) are ``_packing``'s."""
    if position_ids is None:
        return
    if mask is None:
        want = torch.arange(offset, offset + L, device=position_ids.device)[None]
        want = want.expand(position_ids.shape[0], L)
    else:
        want = positions_from_mask(mask)[:, -L:]
    got = position_ids.to(want.device).expand_as(want)
    if bool(((got != want) & (want >= 0)).any()):  # one read-back
        raise ValueError(
            "opcontract derives positions from the attention mask (cumsum(mask) - 1); the "
            "position_ids given disagree on real tokens (packed sequences, position ids "
            "restarting within a row, are served in training forwards without padding or a "
            "KV cache)"
        )


PACKING_KWARG = "opcontract_packing"  # the text model's kwarg that carries a Packing


def _packing(position_ids: torch.Tensor | None, mask: torch.Tensor | None, ref: torch.Tensor,
             seen: int = 0, cache: bool = False) -> dict[str, Packing]:  # fmt: skip
    """{PACKING_KWARG: Packing} for a padding-free training batch (position ids restarting
    within a row: whole sequences back to back, as TRL's ``padding_free`` collator makes
    them), else {} after ``_check_position_ids``: with padding in the mask, or a KV cache
    (generation), positions are the mask's, and restarting position ids a ValueError."""
    B, L = ref.shape[:2]
    if position_ids is not None and not cache and seen == 0:
        if mask is None or bool(mask.to(torch.bool).all()):  # padding: the mask's positions
            packing = packing_from_position_ids(position_ids, B)
            if packing is not None:
                return {PACKING_KWARG: packing}
    _check_position_ids(position_ids, mask, L, seen)
    return {}


def _to_host(mask: torch.Tensor, position_ids: torch.Tensor | None) -> tuple:
    """The padding mask and the position ids (if given) on the host, in one read-back."""
    if position_ids is None:
        return mask.cpu(), None
    both = torch.cat([mask.reshape(-1).long(), position_ids.reshape(-1).long()]).cpu()
    n = mask.numel()
    return both[:n].view(mask.shape).to(mask.dtype), both[n:].view(position_ids.shape)


def _check_generation_mask(mask: torch.Tensor | None) -> None:
    """With a KV cache every row must be left-padded: padding, then one run of real tokens up
    to the last column. Right padding (or a hole) would have the next token predicted from a
    padding position, or attend past a gap that training refuses."""
    if mask is None:
        return
    m = mask.to(torch.bool)
    bad = (m[:, :-1] & ~m[:, 1:]).any(dim=1) | ~m[:, -1]
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask: rows {rows} are not left-padded (padding, then real tokens up to "
            "the last column); generation with right padding or holes would predict from a "
            "padding position. Pad prompts on the left (tokenizer.padding_side = 'left')"
        )


def _lm_output(model: nn.Module, backend: str | None, outputs: Any, labels, logits_to_keep,
               num_items_in_batch, skip_logits: bool | None = None,
               return_token_accuracy: bool = False) -> OpcontractCausalLMOutput:  # fmt: skip
    """The head over the text model's ``outputs``: logits and lse of the kept positions
    (unless skipped: by default when training with labels), and with ``labels`` the
    next-token loss through linear_cross_entropy (no [B, S, V] logits) and, when asked, the
    token accuracy."""
    hidden = outputs.last_hidden_state
    if return_token_accuracy and labels is None:
        raise ValueError("return_token_accuracy=True needs labels")
    if skip_logits is None:
        skip_logits = labels is not None and model.training
    logits = lse = kept_hidden = None
    if not skip_logits:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        kept_hidden = hidden[:, keep, :]
        logits, lse = _head(model, kept_hidden, backend)
    loss = accuracy = None
    if labels is not None:
        h = hidden[:, :-1, :].reshape(-1, hidden.shape[-1])
        tgt = labels[:, 1:].reshape(-1).to(hidden.device)
        kept = (tgt != -100).sum().clamp(min=1)
        n = kept if num_items_in_batch is None else num_items_in_batch
        total, hits = _label_loss(model, h, tgt, backend, return_token_accuracy)
        loss = total / n  # all labels -100: a zero loss that still has a backward
        accuracy = None if hits is None else hits / kept
    return OpcontractCausalLMOutput(
        loss=loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        lse=lse,
        token_accuracy=accuracy,
        head_hidden=kept_hidden,
    )


def _label_loss(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                backend: str | None, accuracy: bool):  # fmt: skip
    """(summed next-token loss, summed argmax hits or None) over rows [T, H] and targets
    [T] (-100 ignored): linear_cross_entropy (reduction sum: a fixed pairwise tree over the
    rows), or the vocabulary-parallel head's log-probs when the head is sharded."""
    if getattr(model, SHARDED_HEAD, None) is not None:
        out = logprob_head(model, hidden, targets, predicted=accuracy, backend=backend)
        hits = None
        if accuracy:
            hits = ((out.predicted == targets) & (targets != -100)).sum().float()
        return -out.logprob.sum(), hits
    text = model.config.text_config
    out = _op("linear_cross_entropy", backend)(
        hidden, _head_weight(model), targets, multiplier=text.output_multiplier,
        softcap=text.final_logit_softcapping, reduction="sum",
        return_token_accuracy=accuracy,
    )  # fmt: skip
    if isinstance(out, torch.Tensor):
        return out, None
    return out.loss, out.token_accuracy


def _static_forward(model: nn.Module, backend: str | None, input_ids, attention_mask,
                    position_ids, cache: OpcontractStaticCache, inputs_embeds, labels,
                    logits_to_keep, **kwargs: Any) -> OpcontractCausalLMOutput:  # fmt: skip
    """The patched forward with an :class:`OpcontractStaticCache`: the step's positions once
    (from the cache's lengths where every new column is real, else from the host mask), then
    the layers, each writing its keys and attending through the step. Without a mask, or
    under torch.compile, nothing is read back."""
    ref = input_ids if input_ids is not None else inputs_embeds
    B, L = ref.shape[:2]
    if labels is not None:
        raise ValueError("labels with a KV cache: a training forward takes no cache")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            "opcontract attention derives positions from a 2-D padding mask; got a "
            f"{attention_mask.dim()}-D mask"
        )
    mask = attention_mask
    if mask is not None and not torch.compiler.is_compiling():
        mask = mask.cpu()  # one read-back: for the check and the step's positions
        _check_generation_mask(mask)
    step = cache.begin(mask, B, L)
    grid = step.positions.view(B, L)
    if position_ids is not None:
        got = position_ids.to(grid.device).expand_as(grid)
        require(((got == grid) | (grid < 0)).all(),
                "opcontract derives positions from the attention mask (cumsum(mask) - 1); the "
                "position_ids given disagree on real tokens")  # fmt: skip
    masks = {"full_attention": None, "sliding_attention": None}  # the step carries them
    # the stock rotary's position ids (its cos/sin are not read): the step's where they are
    # on the model's device, else generate()'s own (from the host column count)
    rotary = grid.clamp(min=0) if grid.device == ref.device else None
    outputs = model.model(
        input_ids=input_ids,
        attention_mask=masks,
        position_ids=rotary,
        past_key_values=cache,
        inputs_embeds=inputs_embeds,
        use_cache=True,
        opcontract_step=step,
        **kwargs,
    )
    cache.end(step)
    return _lm_output(model, backend, outputs, labels, logits_to_keep, None)


def _patch_top(model: nn.Module, backend: str | None) -> None:
    def forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        skip_logits: bool | None = None,
        return_token_accuracy: bool = False,
        **kwargs: Any,
    ) -> OpcontractCausalLMOutput:
        ref = input_ids if input_ids is not None else inputs_embeds
        _check_embedding(self)
        if isinstance(past_key_values, OpcontractStaticCache):
            return _static_forward(self, backend, input_ids, attention_mask, position_ids,
                                   past_key_values, inputs_embeds, labels, logits_to_keep,
                                   **kwargs)  # fmt: skip
        seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        host_mask = None
        if isinstance(past_key_values, OpcontractKVCache) and attention_mask is not None:
            host_mask, position_ids = _to_host(attention_mask, position_ids)  # one read-back
        mask = attention_mask if host_mask is None else host_mask
        cache = past_key_values is not None or bool(use_cache)
        kwargs.update(_packing(position_ids, mask, ref, seen, cache))
        if labels is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError(
                f"logits_to_keep={logits_to_keep!r} with labels: the labels loss covers every "
                "labelled position, logits_to_keep only the returned logits; pass one of them"
            )
        if past_key_values is None and use_cache:  # a plain forward builds no cache
            past_key_values = OpcontractKVCache(self.config, backend=backend)
        if past_key_values is not None and not isinstance(past_key_values, OpcontractKVCache):
            raise OpcontractPatchError(
                f"a model patched by opcontract needs an OpcontractKVCache, got "
                f"{type(past_key_values).__name__}"
            )
        if past_key_values is not None:
            _check_generation_mask(mask)
            past_key_values._host_mask = host_mask  # the layers' real tokens, without a wait
        try:
            outputs = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                use_cache=past_key_values is not None,
                **kwargs,
            )
        finally:
            if past_key_values is not None:
                past_key_values._host_mask = None
        return _lm_output(self, backend, outputs, labels, logits_to_keep, num_items_in_batch,
                          skip_logits, return_token_accuracy)  # fmt: skip

    model.forward = types.MethodType(forward, model)
    object.__setattr__(model, OPCONTRACT_FORWARD, model.forward)  # what integrations.trl wraps

    prepare = model._prepare_cache_for_generation

    def prepare_cache(generation_config: Any, model_kwargs: dict, generation_mode: Any,
                      batch_size: int, max_cache_length: int):  # fmt: skip
        impl = generation_config.cache_implementation
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache:
            if impl == "static":
                rows = max(generation_config.num_beams or 1,
                           generation_config.num_return_sequences or 1) * batch_size  # fmt: skip
                length = max(max_cache_length, generation_config.max_cache_len or 0)
                model_kwargs["past_key_values"] = _static_cache(model, backend, rows, length)
                return None
            if impl not in (None, "dynamic"):
                raise OpcontractPatchError(
                    f"cache_implementation={impl!r}: a model patched by opcontract generates "
                    "with its own caches: OpcontractKVCache (the default, 'dynamic') or "
                    "OpcontractStaticCache ('static')"
                )
            model_kwargs["past_key_values"] = OpcontractKVCache(model.config, backend=backend)
        return prepare(generation_config, model_kwargs, generation_mode, batch_size,
                       max_cache_length)  # fmt: skip

    model._prepare_cache_for_generation = prepare_cache
    stock_masks = getattr(model, "create_masks_for_generate", None)
    stock_masks = stock_masks or masking_utils.create_masks_for_generate

    def masks_for_generate(*args: Any, attention_mask=None, past_key_values=None,
                           is_first_iteration: bool = False, **kw: Any):  # fmt: skip
        """generate()'s hook for a compileable cache's masks. With an OpcontractStaticCache:
        the 2-D padding mask at the prefill (its padding is found from it), none at a decode
        step, whose one new column generate() makes real (the cache's lengths give the
        positions: nothing read back, one shape for every step)."""
        if isinstance(past_key_values, OpcontractStaticCache):
            return attention_mask if is_first_iteration else None
        return stock_masks(*args, attention_mask=attention_mask, past_key_values=past_key_values,
                           is_first_iteration=is_first_iteration, **kw)  # fmt: skip

    model.create_masks_for_generate = masks_for_generate


def _static_cache(model: nn.Module, backend: str | None, batch_size: int,
                  max_cache_len: int) -> OpcontractStaticCache:  # fmt: skip
    """The model's static cache for a generate() call, emptied: the last one where it fits
    (the same stores: torch.compile's graphs stay valid), else a new one."""
    text = model.model.language_model
    device, dtype = text.embed_tokens.weight.device, text.embed_tokens.weight.dtype
    cache = getattr(model, _STATIC, None)
    if cache is not None and cache.fits(batch_size, max_cache_len, device, dtype):
        cache.reset()
        return cache
    cache = OpcontractStaticCache(model.config, batch_size=batch_size,
                                  max_cache_len=max_cache_len, device=device, dtype=dtype,
                                  backend=backend)  # fmt: skip
    object.__setattr__(model, _STATIC, cache)
    return cache


# -- validation (before anything changes) and the entry point -----------------------------


def _need(owner: nn.Module, name: str, cls: type | tuple[type, ...], where: str) -> nn.Module:
    mod = getattr(owner, name, None)
    if mod is None:
        raise OpcontractPatchError(f"{where}.{name}: expected a module, found none")
    if not isinstance(mod, cls):
        want = cls.__name__ if isinstance(cls, type) else " or ".join(c.__name__ for c in cls)
        raise OpcontractPatchError(f"{where}.{name}: expected {want}, found {lora.describe(mod)}")
    return mod


def _projections(layer: nn.Module, where: str) -> list[tuple[nn.Module, str, str]]:
    """(owner, name, owner's path) of a decoder layer's eight projections."""
    sa, mlp = layer.self_attn, layer.mlp
    attn = [(sa, n, f"{where}.self_attn") for n in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                                    "o_proj")]  # fmt: skip
    return attn + [(mlp, n, f"{where}.mlp") for n in ("gate_proj", "up_proj", "down_proj")]


def _refresh_plan(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """The projections of a patched model replaced since patching (PEFT's LoRA layers), each
    checked; the head and embedding must be the patched ones. Raises before any change."""
    _head_weight(model)
    _check_embedding(model)
    where = "model.model.language_model"
    todo = []
    for i, layer in enumerate(model.model.language_model.layers):
        for owner, name, path in _projections(layer, f"{where}.layers.{i}"):
            if not owner._modules[name].__dict__.get(lora.MARK, False):
                _need_projection(owner, name, path)
                todo.append((owner, name, path))
    return todo


def _plan(model: nn.Module) -> list[Callable[[str | None], None]]:
    """Every patch to apply, after checking everything they rely on; raises before any."""
    if type(model) is not mg.MuseGlimmerForConditionalGeneration:
        raise OpcontractPatchError(
            f"apply_opcontract patches MuseGlimmerForConditionalGeneration, got "
            f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', None)!r})"
        )
    if model.config.model_type != "muse_glimmer":
        raise OpcontractPatchError(f"model_type {model.config.model_type!r} is not muse_glimmer")
    text = model.config.text_config
    base = _need(model, "model", mg.MuseGlimmerModel, "model")
    lm = _need(base, "language_model", mg.MuseGlimmerTextModel, "model.model")
    if lm.config is not text:
        raise OpcontractPatchError("model.model.language_model.config is not config.text_config")
    head = _need(model, "lm_head", nn.Linear, "model")  # a LoRA head: refused (not nn.Linear)
    if head.bias is not None:
        raise OpcontractPatchError("model.lm_head has a bias; softcap_logprob's head has none")
    if text.hidden_activation != "silu":
        raise OpcontractPatchError(f"hidden_activation {text.hidden_activation!r} is not silu")
    if text.rope_parameters.get("rope_type", "default") != "default":
        raise OpcontractPatchError(f"rope_type {text.rope_parameters['rope_type']!r} unsupported")
    if text.final_logit_softcapping is None or text.final_logit_softcapping <= 0:
        raise OpcontractPatchError("final_logit_softcapping must be a positive number")
    where = "model.model.language_model"
    emb = _need(lm, "embed_tokens", mg.MuseGlimmerTextNormedEmbedding, where)
    _need(emb, "embed_norm", mg.MuseGlimmerRMSNorm, f"{where}.embed_tokens")
    if emb.embed_norm.with_scale:
        raise OpcontractPatchError(f"{where}.embed_tokens.embed_norm has a weight")
    final = _need(lm, "norm", mg.MuseGlimmerRMSNorm, where)
    if not final.with_scale:
        raise OpcontractPatchError(f"{where}.norm is weightless; Muse Glimmer's has a weight")
    layers = _need(lm, "layers", nn.ModuleList, where)
    if len(layers) != text.num_hidden_layers or len(text.layer_types) != len(layers):
        raise OpcontractPatchError(
            f"{where}.layers: {len(layers)} layers, config says {text.num_hidden_layers}"
        )
    steps: list[Callable[[str | None], None]] = [
        lambda b: _patch_embedding(emb, b),
        lambda b: _patch_norm(emb.embed_norm, "weightless", b),
        lambda b: _patch_norm(final, "plain", b),
        lambda b: _patch_linear(head, b),
        lambda b: _patch_top(model, b),
    ]
    centred = mg.MuseGlimmerTextCenteredRMSNorm
    for i, layer in enumerate(layers):
        w = f"{where}.layers.{i}"
        if not isinstance(layer, mg.MuseGlimmerTextDecoderLayer):
            raise OpcontractPatchError(f"{w}: expected MuseGlimmerTextDecoderLayer")
        sa = _need(layer, "self_attn", mg.MuseGlimmerTextAttention, w)
        mlp = _need(layer, "mlp", mg.MuseGlimmerTextMLP, w)
        projections = _projections(layer, w)
        for owner, name, where_ in projections:
            _need_projection(owner, name, where_)
        norms = [
            _need(layer, n, centred, w)
            for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm")
        ]  # fmt: skip
        qk_norm = _need(sa, "qk_norm", mg.MuseGlimmerRMSNorm, f"{w}.self_attn")
        if qk_norm.with_scale:
            raise OpcontractPatchError(f"{w}.self_attn.qk_norm has a weight; qk_norm_rope has none")
        local = text.layer_types[i] == "sliding_attention"
        if text.layer_types[i] not in ("sliding_attention", "full_attention"):
            raise OpcontractPatchError(f"{w}: layer type {text.layer_types[i]!r} unsupported")
        if local != bool(text.layer_rope_theta[i]):
            raise OpcontractPatchError(
                f"{w}: qk_norm_rope ties RoPE to the local (sliding) layers, but this layer is "
                f"{text.layer_types[i]} with layer_rope_theta {text.layer_rope_theta[i]}"
            )
        if local and sa.sliding_window != text.sliding_window:
            raise OpcontractPatchError(f"{w}.self_attn.sliding_window disagrees with the config")
        kind = "local" if local else "global"
        theta = float(text.rope_parameters["rope_theta"]) if local else None
        steps += [lambda b, o=o, n=n, p=p: _patch_projection(o, n, p, b)
                  for o, n, p in projections]  # fmt: skip
        steps += [lambda b, m=m: _patch_norm(m, "centred", b) for m in norms]
        steps += [
            lambda b, m=qk_norm: _patch_norm(m, "weightless", b),
            lambda b, m=mlp, w=w: _patch_mlp(m, f"{w}.mlp", b),
            lambda b, m=sa, k=kind, t=theta, w=w: _patch_attention(m, k, t, f"{w}.self_attn", b),
            lambda b, m=layer: _patch_decoder_layer(m, b),
        ]
    return steps


def apply_opcontract(model: nn.Module, *, backend: str | None = None) -> nn.Module:
    """Patch ``model`` (a ``MuseGlimmerForConditionalGeneration``, or a ``peft.PeftModel``
    around one) in place and return it.

    ``backend`` forces one backend for every op (``"torch"``: the portable strict path);
    None lets dispatch choose per op. Idempotent: on a patched model it only patches the
    projections replaced since (PEFT's LoRA layers, :mod:`opcontract.integrations.lora`),
    asked for another backend than it was patched with, it raises. Raises
    :class:`OpcontractPatchError` (and changes nothing) on a model it does not know. The
    vision tower, adapter and projection are not patched.

    The patched forwards read the parameters at call time, so ``model.to(dtype)`` after
    patching gives the bits of a model patched after the move; a dtype outside the ops'
    contracts (float64) is refused at call time by the first op, naming it.
    """
    inner = lora.unwrap(model)
    if is_patched(inner):
        if backend != patched_backend(inner):
            raise OpcontractPatchError(
                f"backend={backend!r}: the model is already patched with "
                f"backend={patched_backend(inner)!r}; patch a fresh model to change it"
            )
        for owner, name, path in _refresh_plan(inner):
            _patch_projection(owner, name, path, backend)
        return model
    steps = _plan(inner)
    for step in steps:
        step(backend)
    inner.config.text_config._attn_implementation = ATTN_IMPLEMENTATION
    object.__setattr__(inner, _BACKEND, backend)
    object.__setattr__(inner, _FLAG, True)
    return model


def patched_backend(model: nn.Module) -> str | None:
    """The ``backend`` a patched model was patched with (None: dispatch chooses per op)."""
    if not is_patched(model):
        raise OpcontractPatchError("patched_backend: the model is not patched")
    return vars(lora.unwrap(model))[_BACKEND]


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    backend: str | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The training forward's log-probability of each next token: [B, L - 1] float32,
    entry t the log-prob of input_ids[:, t + 1] given the tokens up to t (softcap_logprob,
    the head the trainer takes, of softmax(z / ``temperature``)). Padding targets give 0.
    ``backend`` None: the one the model was patched with (its generation's)."""
    model = lora.unwrap(model)
    if backend is None and is_patched(model):
        backend = patched_backend(model)
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask,
                         use_cache=False).last_hidden_state  # fmt: skip
    tgt = input_ids[:, 1:]
    if attention_mask is not None:
        tgt = tgt.masked_fill(attention_mask[:, 1:] == 0, -100)
    lp = logprob_head(model, hidden[:, :-1, :].reshape(-1, hidden.shape[-1]), tgt.reshape(-1),
                      backend=backend, temperature=temperature).logprob  # fmt: skip
    return lp.reshape(tgt.shape)


@dataclasses.dataclass(frozen=True)
class Rollout:
    """What a rollout stores: ``sequences`` [B, P + N] (prompt and completion),
    ``attention_mask`` [B, P + N] over them (the prompt's, then ones), ``logprobs`` [B, N]
    float32, each sampled token's log-prob under the distribution the model returned
    (``logits[y] - lse`` of softcap_logits: softcap_logprob's bits), and ``completion_mask``
    [B, N] (1 up to and including the first end-of-sequence token)."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    logprobs: torch.Tensor
    completion_mask: torch.Tensor


def generate_with_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    logprob_temperature: float = 1.0,
    **generate_kwargs: Any,
) -> Rollout:
    """``model.generate(...)`` on a patched model, recording each generated token's log-prob
    from opcontract's head as it is sampled (greedy or sampled; left-padded prompts;
    ``num_return_sequences`` samples per prompt, rows in generate's order: prompt 0's first).
    Beam search (``num_beams`` > 1, given or in the generation config) is refused.

    A forward hook keeps the last position's float32 logits and lse of each step; the next
    step's input token is the one sampled from them, so its log-prob is taken then (and the
    last one after generate returns): memory [B, V], not [B, N, V]. The log-prob is of the
    model's distribution, before any logits processor (temperature, top-k, ...): exactly
    what :func:`token_logprobs` gives a training forward over the finished sequences.
    ``logprob_temperature``: record the log-prob of softmax(z / temperature) instead (what a
    trainer at that temperature scores, e.g. GRPO's; pass the sampling temperature): the
    hook then keeps the last position's final hidden row and runs softcap_logprob at that
    temperature on it, so the value is ``token_logprobs(..., temperature=...)``'s, bitwise."""
    model = lora.unwrap(model)  # PeftModel.generate is its model's, adapters active
    if not is_patched(model):
        raise OpcontractPatchError("generate_with_logprobs: the model is not patched")
    config = generate_kwargs.get("generation_config") or model.generation_config
    beams = generate_kwargs.get("num_beams", getattr(config, "num_beams", 1))
    if beams not in (None, 1):  # beam search reorders rows between steps: no row to record
        raise ValueError(f"generate_with_logprobs: num_beams={beams!r} is not supported "
                         "(beam search; sample with num_return_sequences instead)")  # fmt: skip
    tempered = float(logprob_temperature) != 1.0
    if tempered and not (math.isfinite(logprob_temperature) and logprob_temperature > 0):
        raise ValueError(f"logprob_temperature={logprob_temperature!r}: must be > 0 and finite")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    steps: list[torch.Tensor] = []
    last: list[tuple[torch.Tensor, ...]] = []

    def logprob_of(kept: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor:
        """[B] log-probs of tokens y [B, 1] from what the hook kept for their step."""
        if tempered:
            return logprob_head(model, kept[0], y[:, 0], backend=patched_backend(model),
                                temperature=logprob_temperature).logprob  # fmt: skip
        logits, lse = kept
        return logits.gather(-1, y)[:, 0] - lse

    @torch.compiler.disable  # runs after a compiled forward, on its outputs
    def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if last:  # this call's last input token was sampled from the previous call's row
            kept = last.pop()
            steps.append(logprob_of(kept, ids[:, -1:].to(kept[0].device)))
        # copies: a CUDA-graph replay (the static cache's compiled decode) writes the next
        # step's outputs into the same buffers before this row's token is known
        if tempered:
            last.append((out.head_hidden[:, -1].detach().clone(),))
        else:
            last.append((out.logits[:, -1].detach().clone(), out.lse[:, -1].detach().clone()))

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            seq = model.generate(input_ids, attention_mask=attention_mask, **generate_kwargs)
    finally:
        handle.remove()
    if not isinstance(seq, torch.Tensor):
        seq = seq.sequences
    P, N = input_ids.shape[1], seq.shape[1] - input_ids.shape[1]
    if N:
        kept = last.pop()
        with torch.no_grad():
            steps.append(logprob_of(kept, seq[:, -1:].to(kept[0].device)))
    lp = torch.stack(steps, dim=1) if steps else seq.new_zeros(seq.shape[0], 0, dtype=torch.float32)
    if lp.shape[1] != N:
        raise RuntimeError(f"generate_with_logprobs: {lp.shape[1]} forward steps for {N} tokens")
    eos = generate_kwargs.get("eos_token_id", config.eos_token_id)
    comp = seq[:, P:]
    done = torch.zeros_like(comp, dtype=torch.bool)
    if eos is not None:
        is_eos = torch.isin(comp, torch.as_tensor(eos, device=comp.device).flatten())
        done = (torch.cumsum(is_eos.int(), dim=1) - is_eos.int()) > 0  # after the first eos
    per_prompt = seq.shape[0] // input_ids.shape[0]  # num_return_sequences: rows repeated
    prompt_mask = attention_mask.repeat_interleave(per_prompt, dim=0)
    full = torch.cat([prompt_mask, torch.ones_like(comp, dtype=attention_mask.dtype)], dim=1)
    return Rollout(sequences=seq, attention_mask=full, logprobs=lp, completion_mask=(~done).int())
