"""Train = rollout on the tiny random Muse Glimmer (CPU): how many generated tokens' rollout
log-probs differ from the trainer's for the same finished sequences, stock and patched.

    python benchmarks/hf_train_rollout.py --out benchmarks/results/hf_train_rollout_cpu.json

Each row is ``opcontract.integrations.parity.train_rollout_mismatches``: 4 left-padded
prompts of 3/9/5/12 tokens, 12 new tokens each (sampled with seed 0, or greedy), float32
and bfloat16; the trainer's side either a training forward's logits then one log-softmax
(patched: ``token_logprobs``) or TRL 1.16's ``fused_lm_head=True`` (stock: TRL's chunked
head; patched: ``integrations.trl``'s). What ``make demo`` prints (its TRL, sampled rows).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_stamp  # noqa: E402

from opcontract.integrations.parity import train_rollout_mismatches  # noqa: E402

LENGTHS, NEW = (3, 9, 5, 12), 12
COMMAND = "python benchmarks/hf_train_rollout.py --out benchmarks/results/hf_train_rollout_cpu.json"


def markdown(result: dict) -> str:
    """The docs table: tokens whose rollout log-prob differs from the trainer's (max abs)."""
    rows = result["rows"]
    cols = [(d, p) for p in (False, True) for d in ("float32", "bfloat16")]
    head = " | ".join(f"{'patched' if p else 'stock'} {d}" for d, p in cols)
    lines = [f"| tokens differ of 48 (max abs diff) | {head} |", "| --- |" + " --- |" * 4]
    for sample in (True, False):
        for trainer in ("trl", "logits"):
            cells = []
            for d, p in cols:
                r = next(r for r in rows if (r["dtype"], r["patched"], r["sample"],
                                             r["trainer_head"]) == (d, p, sample, trainer))
                cells.append(f"{r['differ']} ({r['max_abs_diff']:.1e})")
            what = ("TRL's fused_lm_head=True" if trainer == "trl"
                    else "a training forward's logits")  # fmt: skip
            lines.append(f"| {'sampled' if sample else 'greedy'}, trainer: {what} | "
                         + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--markdown", type=Path, help="print the docs table from a result file")
    args = ap.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return
    rows = []
    for sample in (True, False):
        for head in ("trl", "logits"):
            for patched in (False, True):
                for dtype in (torch.float32, torch.bfloat16):
                    r = train_rollout_mismatches(dtype, patched=patched, trainer_head=head,
                                                 lengths=LENGTHS, new_tokens=NEW, sample=sample)
                    print(json.dumps(r))
                    rows.append(r)
    env = env_stamp()
    env.update({m: importlib.metadata.version(m) for m in ("transformers", "trl")})
    result = {"benchmark": "hf_train_rollout", "command": COMMAND, "env": env,
              "model": "opcontract.integrations.tiny.tiny_muse_glimmer (seed 0)", "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
