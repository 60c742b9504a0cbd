"""The Triton gated_attention training forward: each kernel version and tile config timed
side by side, its bits compared with the reference version's (torch.equal per output).

    python benchmarks/attention_forward_explore.py --out results.json [--before MODULE] \
        [--configs '[{"block_m": 128, "num_stages": 2, "interior": 1}]']

``--before``: a module holding an earlier ``gated_attention_kernels`` (same kernel
signatures; e.g. ``git show REV:opcontract/backends/triton/gated_attention_kernels.py >
benchmarks/_kernels_before.py``, then ``--before _kernels_before``); its default config is
the bit reference and the time to beat. Without it the
current kernels' default config is the reference. Muse Glimmer geometry (32 q heads, 2 KV
heads, head_dim 128, bf16), one sequence of L tokens per call, global and local (window
2048) layers; FLOPs are the causal (windowed) forward's 4 * Hq * D per visible key.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import opcontract.backends.triton as tpkg  # noqa: E402
from opcontract import attention  # noqa: E402
from opcontract.backends.triton import gated_attention_kernels  # noqa: E402, F401

HQ, HKV, D, WINDOW = 32, 2, 128, 2048
CONFIGS = [
    {"block_m": 128, "num_stages": 1},
    {"block_m": 128, "num_stages": 2},
    {"block_m": 64, "num_stages": 1},
    {"block_m": 64, "num_stages": 2},
]


def visible_keys(L: int, window: int | None) -> int:
    return sum(min(p + 1, window) if window else p + 1 for p in range(L))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--before", default=None)
    ap.add_argument("--lengths", default="2048,8192,16384")
    ap.add_argument("--configs", default=None,
                    help='a JSON list of configs, e.g. \'[{"block_m": 128, "interior": 1}]\'')
    ap.add_argument("--note", default="", help="recorded in the JSON (e.g. the tree run)")
    a = ap.parse_args()
    configs = json.loads(a.configs) if a.configs else CONFIGS
    now = tpkg.gated_attention_kernels
    versions = {"current": now}
    if a.before:
        versions = {"before": importlib.import_module(a.before), **versions}
    rows = []
    payload = {"benchmark": "attention_forward_explore", "env": common.env_stamp(),
               "command": " ".join(["python", *sys.argv]), "note": a.note,
               "rows": rows}  # fmt: skip
    for L in (int(x) for x in a.lengths.split(",")):
        g = torch.Generator(device="cuda").manual_seed(L)
        q, gate = (torch.randn(L, HQ, D, device="cuda", generator=g).bfloat16() for _ in range(2))
        k, v = (torch.randn(L, HKV, D, device="cuda", generator=g).bfloat16() for _ in range(2))
        cu = torch.tensor([0, L], device="cuda")
        for kind in ("global", "local"):
            kw = dict(layer="local", window=WINDOW) if kind == "local" else dict(layer="global")
            flops = 4.0 * HQ * D * visible_keys(L, WINDOW if kind == "local" else None)
            ref = None
            for name, mod in versions.items():
                tpkg.gated_attention_kernels = mod  # what the host wrapper imports
                cfgs = configs if name == "current" else configs[:1]
                for cfg in cfgs:
                    cfg = {"split": 0, **cfg}

                    run = functools.partial(attention.packed, q, k, v, gate, cu,
                                            backend="triton", config=cfg, **kw)  # fmt: skip

                    try:
                        out = run()
                        ms = common.bench(run, rep_ms=200)[0]
                    except Exception as e:  # noqa: BLE001 (a config the GPU refuses)
                        rows.append(dict(version=name, L=L, layer=kind, config=cfg,
                                         error=f"{type(e).__name__}: {e}"[:300]))  # fmt: skip
                        print(rows[-1], flush=True)
                        continue
                    ref = out if ref is None else ref
                    rows.append(dict(version=name, L=L, layer=kind, config=cfg, ms=ms,
                                     tflops=flops / ms / 1e9,
                                     equal_to_reference=bool(torch.equal(out, ref))))  # fmt: skip
                    print(rows[-1], flush=True)
                    common.write(a.out, payload)
            tpkg.gated_attention_kernels = now
        torch.cuda.empty_cache()
    common.write(a.out, payload)


if __name__ == "__main__":
    main()
