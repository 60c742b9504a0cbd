"""Muse Glimmer's tensor-parallel plan on the strict styles, with its checks and provenance.

The plan is transformers' ``base_model_tp_plan`` (and TorchTitan's): q/k/v/gate column-wise,
o row-wise, the MLP's gate/up column-wise and down row-wise, the embedding's table
vocabulary-parallel; norms and the LM head replicated. KV heads split while the degree
divides them; above their count the ``replicate`` policy gives each replica group one KV
head (``opcontract.parallel.attention``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

import opcontract
from opcontract.contracts import get_contract
from opcontract.parallel.attention import replica_group_attention
from opcontract.parallel.collectives import Ranks
from opcontract.parallel.styles import (
    ParallelPlanError,
    StrictColwiseParallel,
    StrictRowwiseParallel,
    StrictVocabParallelEmbedding,
)

KV_POLICIES = ("split", "replicate")
HEADS = ("replicate", "vocab")
LAYERS = "model.language_model.layers"
_PROVENANCE = "_opcontract_parallel"
_OPS = ("segmented_gemm", "gated_attention", "qk_norm_rope", "swiglu", "rms_norm")


def tp_plan(*, segments: int = 8, kv_shards: int | None = None, combine: str = "tree",
            backend: str | None = None) -> dict[str, Any]:  # fmt: skip
    """{module path pattern: style} for ``parallelize_module`` (``*``: every layer)."""
    kw = dict(segments=segments, combine=combine, backend=backend)
    col, row = StrictColwiseParallel(**kw), StrictRowwiseParallel(**kw)
    kv = StrictColwiseParallel(shards=kv_shards, **kw)
    a, m = f"{LAYERS}.*.self_attn", f"{LAYERS}.*.mlp"
    return {
        "model.language_model.embed_tokens": StrictVocabParallelEmbedding(backend=backend),
        f"{a}.q_proj": col, f"{a}.k_proj": kv, f"{a}.v_proj": kv, f"{a}.gate_proj": col,
        f"{a}.o_proj": row, f"{m}.gate_proj": col, f"{m}.up_proj": col, f"{m}.down_proj": row,
    }  # fmt: skip


def _fingerprint() -> str:
    h = hashlib.sha256(opcontract.__version__.encode())
    for op in _OPS:
        c = get_contract(op)
        h.update(f"{op}:{c.version}:{c.numerics_sha256}".encode())
    return h.hexdigest()[:16]


def _agree(ranks: Ranks) -> None:
    """Every rank raises if any rank runs other contracts (one gather, then no collective)."""
    if ranks.group is None:
        return
    mine = _fingerprint()
    every: list[Any] = [None] * ranks.size
    dist.all_gather_object(every, mine, group=ranks.group)
    if len(set(every)) > 1:
        raise ParallelPlanError(
            f"ranks disagree on opcontract's version or contracts: {every} (rank order)"
        )


def _check(text, t: int, segments: int, kv_policy: str) -> int:
    """The KV shards, or ParallelPlanError naming what does not divide."""
    if kv_policy not in KV_POLICIES:
        raise ParallelPlanError(f"kv_policy must be one of {KV_POLICIES}, got {kv_policy!r}")
    if t > segments:
        raise ParallelPlanError(f"degree {t} exceeds segments={segments} (the largest served)")
    hq, hkv, inter = text.num_attention_heads, text.num_key_value_heads, text.intermediate_size
    if hq % t:
        raise ParallelPlanError(f"degree {t} does not divide the {hq} query heads")
    if inter % t:
        raise ParallelPlanError(f"degree {t} does not divide intermediate_size {inter}")
    if t <= hkv:
        if hkv % t:
            raise ParallelPlanError(f"degree {t} does not divide the {hkv} KV heads")
        return t
    if kv_policy != "replicate":
        raise ParallelPlanError(
            f"degree {t} exceeds the {hkv} KV heads: pass kv_policy='replicate' (each KV head "
            f"held by {t // hkv if t % hkv == 0 else '?'} ranks)"
        )
    if t % hkv:
        raise ParallelPlanError(f"degree {t} is not a multiple of the {hkv} KV heads")
    return hkv


def parallelize_muse_glimmer(
    model: nn.Module,
    mesh,
    *,
    segments: int = 8,
    kv_policy: str = "split",
    combine: str = "tree",
    head: str = "replicate",
) -> nn.Module:
    """Shard a patched Muse Glimmer (``apply_opcontract``) over a 1-D ``DeviceMesh`` (None:
    one rank, the same segmented arithmetic). Every degree dividing ``segments`` gives the
    same log-probabilities and gradients, bitwise. Raises ``ParallelPlanError`` on every
    rank, before sharding, when a degree does not divide what it must. ``head="vocab"``
    shards the LM head's rows too (``opcontract.parallel.head``: log-probs, the loss, the
    entropy without its gradient, the argmax), which needs the vocabulary to split into
    ``segments``."""
    from opcontract.integrations.transformers import is_patched, patched_backend

    if not is_patched(model):
        raise ParallelPlanError(
            "parallelize_muse_glimmer needs a model patched by apply_opcontract"
        )
    if getattr(model, _PROVENANCE, None) is not None:
        raise ParallelPlanError("the model is already parallelized")
    ranks = Ranks.of(mesh)
    text = model.config.text_config
    kv_shards = _check(text, ranks.size, segments, kv_policy)
    if head not in HEADS:
        raise ParallelPlanError(f"head must be one of {HEADS}, got {head!r}")
    if head == "vocab" and text.vocab_size % segments:
        raise ParallelPlanError(
            f"head='vocab': the vocabulary of {text.vocab_size} does not split into "
            f"segments={segments}"
        )
    _agree(ranks)
    backend = patched_backend(model)
    plan = tp_plan(segments=segments, kv_shards=kv_shards, combine=combine, backend=backend)
    if mesh is None:
        for pattern, style in plan.items():
            for name, mod in model.named_modules():
                if _matches(pattern, name):
                    style._apply(mod, None)
    else:
        parallelize_module(model, mesh, plan)
    t = ranks.size
    rep = t // kv_shards  # ranks per KV head
    group = tuple(range(ranks.rank // rep * rep, ranks.rank // rep * rep + rep))
    if head == "vocab":
        _shard_head(model, mesh, ranks, segments, backend)
    if kv_shards < t:
        from opcontract import attention as _attention

        for layer in model.model.language_model.layers:
            layer.self_attn._opcontract_attention = replica_group_attention(
                _attention.padded, ranks, group
            )
    object.__setattr__(
        model,
        _PROVENANCE,
        dict(
            degree=t,
            rank=ranks.rank,
            segments=segments,
            combine=combine,
            kv_policy=kv_policy if kv_shards < t else "split",
            kv_shards=kv_shards,
            kv_replica_group=list(group),
            reduction_form="segmented_gemm adjacent-pair tree"
            if combine == "tree"
            else "collective all_reduce (negative control)",
            contracts={op: get_contract(op).version for op in _OPS},
            fingerprint=_fingerprint(),
            plan={k: repr(v) for k, v in plan.items()},
            head=head,
        ),  # fmt: skip
    )
    return model


def _shard_head(model: nn.Module, mesh, ranks: Ranks, segments: int, backend) -> None:
    from torch.distributed.tensor import Shard

    from opcontract.integrations.transformers import SHARDED_HEAD
    from opcontract.parallel.head import VocabParallelHead
    from opcontract.parallel.styles import _param

    text = model.config.text_config
    lm = model.lm_head
    V = lm.weight.shape[0]
    rows = V // ranks.size
    lo, hi = ranks.rank * rows, (ranks.rank + 1) * rows
    lm.weight = _param(lm.weight.detach()[lo:hi].clone(), mesh, Shard(0))
    sharded = VocabParallelHead(ranks, lo, hi, segments // ranks.size, text.output_multiplier,
                                text.final_logit_softcapping, backend)  # fmt: skip
    object.__setattr__(model, SHARDED_HEAD, sharded)


def _matches(pattern: str, name: str) -> bool:
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(a in ("*", b) for a, b in zip(p, n, strict=True))


def provenance(model: nn.Module) -> dict[str, Any]:
    """How the model was sharded: degree, rank, KV policy and replica group, the reduction
    form and the contract versions (to trace a mismatch between two runs)."""
    p = getattr(model, _PROVENANCE, None)
    if p is None:
        raise ParallelPlanError("the model is not parallelized")
    return dict(p)
