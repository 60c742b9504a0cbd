"""Training and decode throughput of Muse Glimmer at real width in HF transformers, stock
(sdpa), patched (``apply_opcontract``, default dispatch) and Liger's instance patch
(``apply_liger_kernel_to_muse_glimmer``, where liger-kernel is installed), on the GPU.

    python benchmarks/hf_throughput_gpu.py --out results.json [--layers 4]
        [--providers stock,opcontract,liger]   (also: opcontract-pinned, the index copies
                                                staged through pinned memory)

Training: one sequence of T tokens, ``model(input_ids, labels=input_ids)`` then
``loss.backward()`` (no optimizer step), median of 3 timed steps after one warm-up; tokens/s
and the peak memory allocated during a step. Decode: ``generate`` of 32 new tokens (greedy,
the model's own KV cache) after a prompt of 128 tokens; generated tokens/s over the whole
call (prefill included). ``--decode-modes``: ``eager`` (stock DynamicCache, patched
OpcontractKVCache) and ``static`` (``cache_implementation="static"``: stock StaticCache,
patched OpcontractStaticCache; generate() compiles the decode step, torch.compile
"reduce-overhead": CUDA graphs; the first, untimed call compiles).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from hf_train_rollout_gpu import make_model  # noqa: E402


def train_row(model, T: int, vocab: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(T)
    ids = torch.randint(3, vocab, (1, T), device="cuda", generator=g)
    model.zero_grad(set_to_none=True)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    return dict(mode="train", T=T, seconds=s, tokens_per_s=T / s,
                peak_gb=(torch.cuda.max_memory_allocated() - base) / 1e9)  # fmt: skip


def decode_inputs(B: int, vocab: int, new: int, cache: str) -> tuple:
    """(prompt ids [B, 128], generate() keywords) of a decode row: random tokens seeded by B,
    ``new`` greedy tokens, the static cache where ``cache`` says so."""
    g = torch.Generator(device="cuda").manual_seed(B)
    ids = torch.randint(3, vocab, (B, 128), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    if cache == "static":
        kw["cache_implementation"] = "static"
    return ids, kw


def decode_row(model, B: int, vocab: int, new: int = 32, cache: str = "eager") -> dict:
    from opcontract.integrations.transformers import is_patched

    ids, kw = decode_inputs(B, vocab, new, cache)
    counts: collections.Counter = collections.Counter()
    with torch.no_grad():
        if cache == "eager" and is_patched(model):
            with common.implementations_run(counts):  # which implementation served each op
                model.generate(ids, **kw)
        else:
            model.generate(ids, **kw)
        torch.cuda.synchronize()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    s = min(times)
    return dict(mode="decode", cache=cache, B=B, new_tokens=new, seconds=s,
                tokens_per_s=B * new / s, implementations=dict(counts))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--train", default="4096,8192")
    ap.add_argument("--decode", default="1,16")
    ap.add_argument("--decode-modes", default="eager,static")
    ap.add_argument("--providers", default="stock,opcontract,liger")
    ap.add_argument("--note", default="", help="e.g. the tree the run measured")
    a = ap.parse_args()
    import transformers

    payload = {"benchmark": "hf_throughput_gpu", "env": common.env_stamp(),
               "transformers": transformers.__version__, "layers": a.layers,
               "note": a.note,
               "rows": []}  # fmt: skip
    cases = [("train", int(t)) for t in a.train.split(",") if t]
    cases += [(f"decode-{m}", int(b)) for m in a.decode_modes.split(",") if m
              for b in a.decode.split(",") if b]  # fmt: skip
    model = None
    for provider in a.providers.split(","):
        try:
            model = provider_model(provider, model, a.layers)
        except Exception as e:  # noqa: BLE001
            model = None
            print(f"{provider}: {type(e).__name__}: {e}"[:600], flush=True)
        if model is None:
            payload["rows"].append(dict(provider=provider, error="unavailable"))
            continue
        vocab = model.config.text_config.vocab_size
        for mode, n in cases:
            try:
                if mode == "train":
                    model.train()
                    row = train_row(model, n, vocab)
                else:
                    model.eval()
                    row = decode_row(model, n, vocab, cache=mode.split("-")[1])
            except Exception as e:  # noqa: BLE001
                row = dict(mode=mode, n=n, error=f"{type(e).__name__}: {e}"[:600])
            row["provider"] = PROVIDERS[provider]
            payload["rows"].append(row)
            print(row, flush=True)
            common.write(a.out, payload)
            torch.cuda.empty_cache()
    common.write(a.out, payload)


PROVIDERS = {"stock": "stock (sdpa)", "opcontract": "opcontract",
             "opcontract-pinned": "opcontract, index copies staged through pinned memory",
             "liger": "liger (apply_liger_kernel_to_muse_glimmer)"}  # fmt: skip


def provider_model(provider: str, previous, layers: int):
    """The model a provider runs: stock a fresh one; opcontract the previous model patched
    (stock's, so both run the same weights) or a fresh one; liger a fresh one patched by
    Liger's instance patch (last: it also replaces module-level classes). None: unavailable."""
    from opcontract.integrations.transformers import apply_opcontract

    if previous is not None:
        previous.__dict__.pop("_compiled_call", None)  # the last provider's compiled decode
    torch._dynamo.reset()
    if provider == "stock":
        return make_model(layers).train()
    from opcontract.backends import placement

    placement.PINNED_STAGING = provider == "opcontract-pinned"
    if provider in ("opcontract", "opcontract-pinned"):
        if previous is None or hasattr(previous, "_liger"):
            previous = make_model(layers).train()
        return apply_opcontract(previous)  # a patched model is returned as it is
    if provider == "liger":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_muse_glimmer
        except ImportError as e:
            print("liger unavailable:", repr(e)[:200], flush=True)
            return None
        del previous
        torch.cuda.empty_cache()
        model = make_model(layers).train()
        apply_liger_kernel_to_muse_glimmer(model=model)
        model._liger = True
        return model
    raise SystemExit(f"unknown provider {provider!r}; known: {sorted(PROVIDERS)}")


if __name__ == "__main__":
    main()
