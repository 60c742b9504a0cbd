"""Write the part of a sweep file whose ops have the given sizes (a run that tunes only the
shapes a model calls, e.g. the Hugging Face patch's separate projections).

    python benchmarks/sweep_subset.py opcontract/tuning/sweeps/muse_glimmer.yaml \
        --sizes N=4096,K=6656 N=256,K=6656 N=19968,K=6656 --out /tmp/hf_projections.yaml
"""

from __future__ import annotations

import argparse

import yaml


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sweep")
    ap.add_argument("--sizes", nargs="+", required=True, help="e.g. N=256,K=6656 (all must match)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    wanted = [{k: int(v) for k, v in (kv.split("=") for kv in s.split(","))} for s in a.sizes]
    doc = yaml.safe_load(open(a.sweep))
    doc["ops"] = [o for o in doc["ops"] if any(o.get("sizes") == w for w in wanted)]
    doc["name"] = f"{doc['name']}-subset"
    with open(a.out, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    print(f"{len(doc['ops'])} sweep entries -> {a.out}")


if __name__ == "__main__":
    main()
