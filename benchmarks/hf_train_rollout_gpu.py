"""Train = rollout on the GPU at Muse Glimmer's real width: a random 4-layer
``MuseGlimmerForConditionalGeneration`` (H 6656, I 19968, 32/2 heads of 128, V 202048, three
local layers with the 2048 window and one global), bf16, stock and patched.

    python benchmarks/hf_train_rollout_gpu.py --out results.json [--layers 4] [--new 32]

Left-padded prompts of 300 / 2500 / 1200 / 2100 random tokens (across the window), ``--new``
generated tokens each, greedy and sampled. Rollout: stock, ``generate(output_logits=True)``
then one log-softmax; patched, ``generate_with_logprobs``. Trainer: one forward over the
finished sequences (stock: its logits, one log-softmax; patched: ``token_logprobs``), batched
and one sequence at a time. Counted per token with ``!=``; the max abs diff beside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

LENGTHS = (300, 2500, 1200, 2100)
DEV = "cuda"


def make_model(layers: int):
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    torch.manual_seed(0)
    kinds = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
    text = dict(num_hidden_layers=layers, layer_types=(kinds * layers)[:layers], pad_token_id=0,
                eos_token_id=None, bos_token_id=1)  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    cfg = MuseGlimmerConfig(text_config=text, vision_config=vision, out_hidden_size=16,
                            projector_hidden_size=16)  # fmt: skip
    with torch.device(DEV):
        model = MuseGlimmerForConditionalGeneration(cfg).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():  # the stock init leaves the norms at 1 and the head tiny
        for name, p in model.model.language_model.named_parameters():
            if "layernorm" in name:
                p.normal_(0.0, 0.3)
        model.lm_head.weight.normal_(0.0, 0.05)
    return model


def prompts(lengths, vocab: int):
    from opcontract.integrations.tiny import left_padded

    ids, mask = left_padded(list(lengths), vocab=vocab)  # seed 1: the prompts measured
    return ids.to(DEV), mask.to(DEV)


def one_case(model, patched: bool, sample: bool, new: int, vocab: int) -> dict:
    from opcontract.integrations.transformers import generate_with_logprobs, token_logprobs

    ids, mask = prompts(LENGTHS, vocab)
    P = ids.shape[1]
    torch.manual_seed(0)
    kw = dict(max_new_tokens=new, do_sample=sample)
    t0 = time.time()
    with torch.no_grad():
        if patched:
            ro = generate_with_logprobs(model, ids, mask, **kw)
            seq, full, ro_lp = ro.sequences, ro.attention_mask, ro.logprobs
        else:
            out = model.generate(ids, attention_mask=mask, output_logits=True,
                                 return_dict_in_generate=True, **kw)  # fmt: skip
            seq = out.sequences
            full = torch.cat([mask, torch.ones_like(seq[:, P:])], dim=1)
            lg = torch.stack(out.logits, dim=1).float().log_softmax(-1)
            ro_lp = lg.gather(-1, seq[:, P:, None])[..., 0]
            del out, lg
        gen_s = time.time() - t0

        def trainer(s, m):
            if patched:
                return token_logprobs(model, s, m)[:, P - 1 :]
            logits = model(input_ids=s, attention_mask=m).logits[:, P - 1 : -1]
            return logits.float().log_softmax(-1).gather(-1, s[:, P:, None])[..., 0]

        tr = trainer(seq, full)
        alone = torch.cat([trainer(seq[b : b + 1], full[b : b + 1]) for b in range(len(LENGTHS))])
    if DEV == "cuda":
        torch.cuda.empty_cache()
    d = (ro_lp - tr).abs()
    return dict(patched=patched, sample=sample, new_tokens=new, prompt_lengths=list(LENGTHS),
                tokens=int(ro_lp.numel()), differ=int((ro_lp != tr).sum()),
                max_abs_diff=float(d.max()),
                batched_vs_alone_differ=int((tr != alone).sum()),
                generate_seconds=round(gen_s, 1))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    a = ap.parse_args()
    import transformers

    from opcontract.integrations.transformers import apply_opcontract

    payload = {"benchmark": "hf_train_rollout_gpu", "env": common.env_stamp(),
               "transformers": transformers.__version__, "layers": a.layers,
               "rows": []}  # fmt: skip
    model = make_model(a.layers)
    vocab = model.config.text_config.vocab_size
    for patched in (False, True):
        if patched:
            apply_opcontract(model)
        for sample in (False, True):
            try:
                payload["rows"].append(one_case(model, patched, sample, a.new, vocab))
            except Exception as e:  # noqa: BLE001
                payload["rows"].append(dict(patched=patched, sample=sample,
                                            error=f"{type(e).__name__}: {e}"[:600]))  # fmt: skip
            print(payload["rows"][-1], flush=True)
            common.write(a.out, payload)


if __name__ == "__main__":
    main()
