"""Bytes autograd keeps for the backward of one training step (loss and backward of one
sequence), stock Muse Glimmer against the opcontract patch, per token and layer, by dtype
and trailing shape. A width-scaled model on the CPU: every width of the real text model
divided by ``--scale`` (H 6656, I 19968, 32 q heads on 2 KV heads), 4 layers, bf16. What
an op saves is its contract's ``backward.saves``, the same for every backend, so the CPU
count is the GPU's; transient buffers inside a backward are not counted.

    python benchmarks/hf_saved_activations.py --T 512 \
        --out benchmarks/results/hf_saved_activations_cpu.json
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

LAYERS = 4


def build(scale: int, vocab: int):
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    torch.manual_seed(0)
    text = dict(
        vocab_size=vocab, hidden_size=6656 // scale, intermediate_size=19968 // scale,
        num_hidden_layers=LAYERS, num_attention_heads=32, num_key_value_heads=2,
        head_dim=128 // scale, sliding_window=2048 // scale, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, max_position_embeddings=65536,
    )  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    cfg = MuseGlimmerConfig(
        text_config=text, vision_config=vision, out_hidden_size=16, projector_hidden_size=16
    )
    return MuseGlimmerForConditionalGeneration(cfg).to(torch.bfloat16).train()


def saved(model, T: int, vocab: int) -> dict[tuple, int]:
    """{(dtype, trailing shape): bytes} of the tensors the step saves (weights excluded, each
    storage once)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in weights and s.data_ptr() not in seen:
            seen[s.data_ptr()] = (
                str(t.dtype).removeprefix("torch."),
                tuple(t.shape[1:]),
                s.nbytes(),
            )
        return t

    ids = torch.randint(3, vocab, (1, T), generator=torch.Generator().manual_seed(T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    by: dict[tuple, int] = collections.Counter()
    for dtype, shape, n in seen.values():
        by[dtype, shape] += n
    return by


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from opcontract.integrations.transformers import apply_opcontract

    rows = []
    for provider in ("stock", "opcontract"):
        model = build(a.scale, a.vocab)
        if provider == "opcontract":
            model = apply_opcontract(model)
        by = saved(model, a.T, a.vocab)
        per = {f"{d} {list(s)}": round(n / a.T / LAYERS / 1e3, 3) for (d, s), n in
               sorted(by.items(), key=lambda kv: -kv[1])}  # fmt: skip
        total = sum(by.values())
        row = dict(provider=provider, T=a.T, scale=a.scale, saved_mb=round(total / 1e6, 2),
                   kb_per_token_layer=round(total / a.T / LAYERS / 1e3, 2),
                   kb_per_token_layer_at_real_width=round(total / a.T / LAYERS / 1e3 * a.scale, 1),
                   by_dtype_and_shape=per)  # fmt: skip
        print({k: v for k, v in row.items() if k != "by_dtype_and_shape"}, flush=True)
        rows.append(row)
    common.write(a.out, {"benchmark": "hf_saved_activations", "env": common.env_stamp(),
                         "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
