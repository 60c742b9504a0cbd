"""Host time per eager decode step of the patched Muse Glimmer, split by function.

    python benchmarks/decode_host_split.py --out results.json [--layers 4] [--batch 1]

Each listed function is wrapped in a wall-clock timer (inclusive: a function's time holds
the functions it calls). ``generate`` runs with 1 and with ``1 + steps`` new tokens; the
difference over ``steps`` is the time a decode step spends in each, beside the step's wall
time. Op calls are split by op name. The timers add about a microsecond a call; cProfile's
per-call cost would distort a path of many small calls more.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from hf_train_rollout_gpu import make_model, prompts  # noqa: E402

TOTALS: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def _timed(label, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            name = label(args) if callable(label) else label
            TOTALS[name] += time.perf_counter() - t0
            CALLS[name] += 1

    return wrapper


def instrument(model) -> None:
    """Wrap the decode path's functions (after ``apply_opcontract``)."""
    from opcontract import attention, dispatch
    from opcontract.backends import gated_attention as ga_checks
    from opcontract.backends.triton import gated_attention as tga
    from opcontract.dispatch import shell, validate
    from opcontract.integrations import transformers as hf

    op_call = dispatch.OpFunction.__call__
    dispatch.OpFunction.__call__ = _timed(lambda a: f"op {a[0].name}", op_call)
    for owner, names in (
        (attention.PagedKVCache, ("append", "attend", "evict")),
        (hf.OpcontractKVCache, ("step", "_real_tokens", "query_positions")),
    ):
        for n in names:
            setattr(owner, n, _timed(f"{owner.__name__}.{n}", getattr(owner, n)))
    for mod, names in (
        (tga, ("plan_forward", "run_forward", "tiles", "on_device_int32", "launch")),
        (dispatch, ("check_values",)),  # the value checks that call plans run
        (validate, ("check_values",)),
        (shell, ("check_values",)),
        (ga_checks, ("check_call",)),
    ):
        for n in names:
            if hasattr(mod, n):
                setattr(mod, n, _timed(f"{mod.__name__.split('.')[-1]}.{n}", getattr(mod, n)))
    layers = model.model.language_model.layers
    for layer in layers:
        layer.self_attn.forward = _timed("self_attn.forward", layer.self_attn.forward)
        layer.mlp.forward = _timed("mlp.forward", layer.mlp.forward)
        layer.forward = _timed("decoder_layer.forward", layer.forward)
    model.forward = _timed("model.forward", model.forward)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    from opcontract.integrations.transformers import apply_opcontract

    model = apply_opcontract(make_model(args.layers).eval())
    vocab = model.config.text_config.vocab_size
    ids, mask = prompts([args.prompt] * args.batch, vocab)

    def gen(n):
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                           min_new_tokens=n, do_sample=False)  # fmt: skip

    gen(2)
    plain = (common.wall_s(lambda: gen(1 + args.steps)) - common.wall_s(lambda: gen(1)))
    plain /= args.steps
    instrument(model)
    gen(2)
    per = {}
    runs = []
    for n in (1, 1 + args.steps):
        TOTALS.clear()
        CALLS.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen(n)
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0, dict(TOTALS), dict(CALLS)))
    (w1, t1, c1), (w2, t2, c2) = runs
    for k in t2:
        per[k] = {
            "us_per_step": (t2[k] - t1.get(k, 0.0)) / args.steps * 1e6,
            "calls_per_step": (c2[k] - c1.get(k, 0)) / args.steps,
        }
    per = dict(sorted(per.items(), key=lambda kv: -kv[1]["us_per_step"]))
    row = {
        "batch": args.batch,
        "prompt": args.prompt,
        "layers": args.layers,
        "wall_ms_per_step_uninstrumented": plain * 1e3,
        "wall_ms_per_step_instrumented": (w2 - w1) / args.steps * 1e3,
        "by_function": per,
    }
    print(f"B={args.batch}: {plain * 1e3:.2f} ms a step ({row['wall_ms_per_step_instrumented']:.2f}"
          " instrumented)")  # fmt: skip
    for k, v in per.items():
        print(f"  {v['us_per_step']:9.1f} us  {v['calls_per_step']:5.1f} calls  {k}")
    out = {
        "benchmark": "decode_host_split",
        "env": common.env_stamp(),
        "note": args.note,
        "rows": [row],
    }
    common.write(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
