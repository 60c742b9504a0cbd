"""Host syncs per eager decode step of Muse Glimmer in HF transformers, stock and patched.

    python benchmarks/decode_syncs.py --out results.json [--layers 4] [--batch 1]

A decode step that waits for the GPU can't queue the next kernels while the current ones
run: each sync costs the GPU's remaining queue plus a host round trip. With
``torch.cuda.set_sync_debug_mode("warn")`` every synchronizing call warns; the warnings of
``generate`` with 1 and with ``1 + steps`` new tokens are counted by the first frame inside
opcontract or transformers (the difference over ``steps`` is the per-step count).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from hf_train_rollout_gpu import make_model, prompts  # noqa: E402

_ROOTS = ("opcontract/", "transformers/")


def _where() -> str:
    """The innermost frame in opcontract or transformers (else the innermost frame)."""
    frames = traceback.extract_stack()[:-3]
    for fr in reversed(frames):
        if any(r in fr.filename for r in _ROOTS):
            tail = fr.filename.split("site-packages/")[-1].split("/work/")[-1]
            return f"{tail}:{fr.lineno} {fr.name}"
    fr = frames[-1]
    return f"{fr.filename}:{fr.lineno} {fr.name}"


def count_syncs(fn) -> collections.Counter:
    seen: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            seen[_where()] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        old = warnings.showwarning
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
    return seen


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile", default="", help="cProfile the patched decode into this file")
    ap.add_argument("--time", type=int, default=0,
                    help="also time generate of this many new tokens (median of 3)")  # fmt: skip
    args = ap.parse_args()
    from opcontract.integrations.transformers import apply_opcontract

    model = make_model(args.layers)
    vocab = model.config.text_config.vocab_size
    ids, mask = prompts([args.prompt] * args.batch, vocab)
    rows = []
    for provider in ("stock (sdpa)", "opcontract"):
        if provider == "opcontract":
            apply_opcontract(model)

        def gen(n):
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                               do_sample=False)  # fmt: skip

        gen(2)  # compile and warm up
        one, more = count_syncs(lambda: gen(1)), count_syncs(lambda: gen(1 + args.steps))
        per_step = {k: (more[k] - one.get(k, 0)) / args.steps for k in more}
        per_step = {k: v for k, v in sorted(per_step.items(), key=lambda kv: -kv[1]) if v}
        row = {
            "provider": provider,
            "batch": args.batch,
            "prompt": args.prompt,
            "layers": args.layers,
            "syncs_per_decode_step": sum(per_step.values()),
            "syncs_in_prefill_and_first_token": sum(one.values()),
            "per_step_by_location": per_step,
        }
        if args.time:
            row["new_tokens"] = args.time
            row["seconds"] = common.wall_s(lambda: gen(args.time))
            row["tokens_per_s"] = args.time * args.batch / row["seconds"]  # prefill included
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
        if args.profile and provider == "opcontract":
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.runcall(gen, 1 + args.steps)
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(60)
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
            Path(args.profile).write_text(text.getvalue())
    out = {
        "benchmark": "decode_syncs",
        "command": " ".join(["python", *sys.argv]),
        "env": common.env_stamp(),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
