"""Parity of the patched tiny Muse Glimmer with the unpatched model in float64 (CPU).

    python benchmarks/hf_parity.py --out benchmarks/results/hf_parity_cpu.json
    python benchmarks/hf_parity.py --markdown benchmarks/results/hf_parity_cpu.json

Loss, per-token log-probs and entropy, token accuracy and every parameter's gradient of the
patched model (opcontract's ops, TRL's ``fused_lm_head=True`` calling convention) in float32
and bfloat16, and of the stock model's own logits path in the same dtype (the baseline),
each against the stock model in float64 on the same weights (``opcontract.integrations.
parity``). Two batches: left-padded prompts (a rollout) and right-padded rows (TRL's SFT
collator), of prompts and the model's own greedy continuations; labels are the input ids on
real tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_stamp  # noqa: E402

from opcontract.integrations.parity import parity  # noqa: E402
from opcontract.integrations.tiny import left_padded, tiny_muse_glimmer  # noqa: E402
from opcontract.integrations.transformers import apply_opcontract  # noqa: E402

LENGTHS = [2, 7, 4, 9]  # prompts; each continues with NEW greedy tokens of the model's own
NEW = 8
COMMAND = "python benchmarks/hf_parity.py --out benchmarks/results/hf_parity_cpu.json"


def batches() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Prompts and the model's own greedy continuations (so that token accuracy is neither 0
    nor 1), left-padded as a rollout is; and the same rows right-padded."""
    ids, mask = left_padded(LENGTHS, seed=7)
    model = apply_opcontract(tiny_muse_glimmer(), backend="torch")
    with torch.no_grad():
        ids = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    mask = torch.cat([mask, torch.ones(len(LENGTHS), NEW, dtype=mask.dtype)], dim=1)
    right_ids, right_mask = ids.clone(), mask.clone()
    for b in range(len(LENGTHS)):  # the same tokens, padding moved to the right
        right_ids[b] = torch.cat([ids[b, mask[b].bool()], ids[b, ~mask[b].bool()]])
        right_mask[b] = torch.cat([mask[b, mask[b].bool()], mask[b, ~mask[b].bool()]])
    return {"left-padded": (ids, mask), "right-padded": (right_ids, right_mask)}


def run() -> dict:
    rows = []
    for case, (ids, mask) in batches().items():
        for dtype in (torch.float32, torch.bfloat16):
            for patched in (True, False):
                r = parity(tiny_muse_glimmer, ids, mask, dtype=dtype, patched=patched,
                           backend="torch" if patched else None)  # fmt: skip
                rows.append({"case": case, "prompt_lengths": LENGTHS, "new_tokens": NEW, **r})
    return {
        "benchmark": "hf_parity",
        "command": COMMAND,
        "env": {**env_stamp(), "transformers": _version("transformers"), "trl": _version("trl")},
        "model": "opcontract.integrations.tiny.tiny_muse_glimmer (seed 0)",
        "rows": rows,
    }


def _version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)


def _group(name: str) -> str:
    name = name.removeprefix("model.language_model.")
    return re.sub(r"layers\.\d+\.", "layers.*.", name)


def grad_groups(row: dict) -> dict[str, dict]:
    """Per parameter kind (layers.* merged): the max of the max abs diffs, the element-weighted
    mean abs diff, and the largest max abs diff relative to that parameter's oracle max."""
    out: dict[str, dict] = {}
    for name, s in row["grad"].items():
        g = out.setdefault(_group(name), {"max": 0.0, "sum": 0.0, "n": 0, "rel": 0.0})
        g["max"] = max(g["max"], s["max_abs_diff"])
        g["sum"] += s["mean_abs_diff"] * s["n"]
        g["n"] += s["n"]
        g["rel"] = max(g["rel"], s["max_abs_diff"] / max(s["ref_max_abs"], 1e-30))
    return {k: dict(max=v["max"], mean=v["sum"] / v["n"], rel=v["rel"]) for k, v in out.items()}


def markdown(result: dict, case: str = "left-padded") -> str:
    rows = [r for r in result["rows"] if r["case"] == case]
    order = [(r["dtype"], r["patched"]) for r in rows]
    head = " | ".join(f"{'patched' if p else 'stock'} {d}" for d, p in order)
    lines = [f"| max / mean abs diff vs stock float64 | {head} |",
             "| --- |" + " --- |" * len(rows)]  # fmt: skip
    for q in ("loss", "log_probs", "entropy"):
        cells = [f"{r[q]['max_abs_diff']:.1e} / {r[q]['mean_abs_diff']:.1e}" for r in rows]
        lines.append(f"| {q} | " + " | ".join(cells) + " |")
    acc = [r["token_accuracy"] for r in rows]
    cells = [f"{a['value']:.4f} / {a['ref_value']:.4f} ({a['top1_disagreements']})" for a in acc]
    lines.append("| token accuracy / float64's on the same weights (tokens whose top-1 differs) | "
                 + " | ".join(cells) + " |")  # fmt: skip
    groups = [grad_groups(r) for r in rows]
    for name in groups[0]:
        cells = [f"{g[name]['max']:.1e} / {g[name]['mean']:.1e}" for g in groups]
        lines.append(f"| grad `{name}` | " + " | ".join(cells) + " |")
    worst = [f"{max(v['rel'] for v in g.values()):.1e}" for g in groups]
    lines.append("| worst gradient: max abs diff / float64's max abs | " + " | ".join(worst) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--markdown", type=Path, help="print the docs table from a result file")
    args = ap.parse_args()
    if args.markdown:
        result = json.loads(args.markdown.read_text())
        for case in dict.fromkeys(r["case"] for r in result["rows"]):
            n = next(r["tokens"] for r in result["rows"] if r["case"] == case)
            print(f"\n{case} ({n} labelled tokens)\n")
            print(markdown(result, case))
        return
    result = run()
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
