"""Tuned configs against each implementation's default config, on the sweep's own calls.

    python benchmarks/tuned_dispatch.py opcontract/tuning/sweeps/muse_glimmer.yaml \
        --table opcontract/tables/h200.json --out results.json

For every (op, implementation, dtype, batch) of the sweep that has an entry in the table:
the median time with the default config and with the tuned one (same fresh inputs; forward,
or forward and backward where the sweep item's objective is ``train``), a
bitwise check that both give the same outputs and gradients, and the entry that dispatch
names in its provenance when the table is on the tuning path.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import env_stamp, write  # noqa: E402

from opcontract import dispatch  # noqa: E402
from opcontract.backends.registry import implementation  # noqa: E402
from opcontract.contracts import get_contract  # noqa: E402
from opcontract.dispatch.device import device_of  # noqa: E402
from opcontract.tables import db  # noqa: E402
from opcontract.tuning.sweep import load_sweep, time_ms, workload  # noqa: E402
from opcontract.tuning.verify import check, prepare  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sweep")
    ap.add_argument("--table", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ[db.ENV] = str(Path(args.table).resolve())
    db.reload()
    table = db.TuningDB([Path(args.table)])
    sweep = load_sweep(args.sweep)
    rows = []
    result = {"benchmark": "tuned_dispatch", "env": env_stamp(), "rows": rows}
    for item in sweep.ops:
        c = get_contract(item.op)
        impl = implementation(item.implementation)
        for dt in sweep.dtypes:
            for b in item.batch:
                sizes = {**item.sizes, c.conformance.batch_dim: b}
                entry = table.lookup(
                    device_of(torch.empty(0, device=args.device)),
                    item.op,
                    impl.name,
                    dt,
                    db.shape_key(sizes, c.conformance.batch_dim),
                    db.bucket_of(b),
                    c.sha256,
                )
                if entry is None:
                    print(f"{item.op} {impl.name} {dt} {b}: no entry", flush=True)
                    continue
                probe = prepare(impl, c, dt, sizes, device=args.device, params=item.params)
                tuned = {**probe.canonical, **entry.config}
                work = workload(probe, item.objective)  # what the sweep timed
                default_ms = time_ms(work(probe.canonical), args.device, item.timing)
                tuned_ms = time_ms(work(tuned), args.device, item.timing)
                verdict = check(probe, entry.config)
                dispatch.op(item.op, backend=impl.name)(**probe.inputs, **probe.params)
                prov = dispatch.last_provenance()
                rows.append(
                    {
                        "op": item.op,
                        "implementation": impl.name,
                        "dtype": dt,
                        "sizes": sizes,
                        "objective": item.objective,
                        "default_config": probe.canonical,
                        "tuned_config": entry.config,
                        "default_ms": default_ms,
                        "tuned_ms": tuned_ms,
                        "speedup": default_ms / tuned_ms,
                        "bitwise_equal": verdict.ok,
                        "dispatch_entry": prov.tuning_entry,
                        "dispatch_config_is_tuned": prov.config == tuned,
                    }
                )
                print(
                    f"{item.op:20s} {impl.name:16s} {dt:9s} {b:6d} default {default_ms:8.3f} ms"
                    f" tuned {tuned_ms:8.3f} ms x{default_ms / tuned_ms:5.2f}"
                    f" equal={verdict.ok} dispatch_uses_entry={prov.config == tuned}",
                    flush=True,
                )
                write(args.out, result)  # after every row: a time limit keeps what was done
    write(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
