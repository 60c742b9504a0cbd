"""opcontract-tune: offline tuning that cannot change numerics.

    opcontract-tune sweep SWEEP.yaml --table TABLE.json [--trials N] [--timeout S] [--storage URL]
                          [--only OP,...] [--max-batch N] [--min-batch N] [--compile-workers N]
    opcontract-tune show [--table TABLE.json]
    opcontract-tune verify [--table TABLE.json] [--only OP,...] [--no-progress]

Exit 0 on success; 1 with a message on a bad sweep file, an unwritable storage or table,
a study that failed (each one's reason listed at the end), an entry that no longer
verifies, or a missing [tune] extra (optuna, tqdm: the message has the install line); 2 for
an unknown name in --only (the message lists the known ops and implementations).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opcontract.cli import UsageError, add_version, entry_point, require_extra, unknown
from opcontract.tables.db import USER_TABLES, TuningDB, table_paths


def _report(r) -> None:
    if r.error:  # run_sweep printed it, and the end of the sweep lists it again
        return
    moved = sorted({k for _, ks in r.rejected for k in ks})
    speed = "no verified config"
    if r.unequal_to:
        speed = f"bits differ from {r.unequal_to}'s: no entry"
    elif r.best:
        speed = f"{r.best_ms:.4g} ms vs default {r.default_ms:.4g} ms"
    print(
        f"{r.op:22s} {r.implementation:16s} {r.dtype:9s} batch {r.bucket:6d}: {speed}; "
        f"best {r.best}; {len(r.rejected)} rejected" + (f" (moved bits: {moved})" if moved else ""),
        flush=True,
    )


def _only(text: str | None) -> set[str] | None:
    """The names of ``--only``, each a known op or implementation."""
    if text is None:
        return None
    from opcontract.backends.registry import implementations
    from opcontract.contracts import load_all

    names = {n.strip() for n in text.split(",") if n.strip()}
    if not names:
        raise UsageError(f"--only {text!r} names no op or implementation")
    ops, impls = set(load_all()), {i.name for i in implementations()}
    strangers = sorted(names - ops - impls)
    if strangers:
        raise unknown(strangers[0], {"op": ops, "implementation": impls})
    return names


def _sweep(args) -> int:
    require_extra("tune", ("optuna", "tqdm"), "opcontract-tune sweep")
    from opcontract.tuning.sweep import SweepError, load_sweep, run_sweep

    only = _only(args.only)
    device = args.device or ("cuda" if _cuda() else "cpu")
    try:
        sweep = load_sweep(args.sweep)
        results = run_sweep(
            sweep,
            args.table,
            storage=args.storage,
            trials=args.trials,
            timeout=args.timeout,
            device=device,
            progress=not args.no_progress,
            only=only,
            on_result=_report,
            compile_workers=args.compile_workers,
            max_batch=args.max_batch,
            min_batch=args.min_batch,
        )
    except (SweepError, OSError) as e:
        print(f"opcontract-tune: {e}", file=sys.stderr)
        return 1
    failed = [r for r in results if r.error]
    if not failed:
        return 0
    print(
        f"opcontract-tune: {len(failed)} of {len(results)} studies failed, no entry for them:",
        *(f"  {r.op} {r.implementation} {r.dtype} batch {r.bucket}: {r.error}" for r in failed),
        sep="\n",
        file=sys.stderr,
    )
    if device == "cpu" and any(_triton_off_gpu(r.implementation) for r in failed):
        print(
            "opcontract-tune: no GPU: set TRITON_INTERPRET=1 to run Triton on the CPU",
            file=sys.stderr,
        )
    return 1


def _triton_off_gpu(name: str) -> bool:
    """A Triton implementation on the CPU, without the interpreter that runs it there."""
    from opcontract.backends.registry import implementation
    from opcontract.backends.triton import interpreting

    return implementation(name).backend == "triton" and not interpreting()


def _db(args) -> TuningDB:
    return TuningDB([Path(args.table)] if args.table else table_paths())


def _show(args) -> int:
    db = _db(args)
    if not db.entries:
        print("no tuning entries")
    for e in db.entries:
        k = e.key
        ms = f"{e.median_ms:.4g} ms" if e.median_ms is not None else "-"
        print(
            f"{k['gpu']} {k['capability']} {k['op']} {k['implementation']} {k['dtype']} "
            f"{k['shape']} bucket {k['bucket']}: {e.config} ({ms}; "
            f"torch {e.stamp.get('torch')}, "
            f"triton {e.stamp.get('triton')}; {e.source})"
        )
    return 0


def _verify(args) -> int:
    """Each entry's config against its canonical config, and the implementations tabled for
    one call against each other (dispatch may switch between them per bucket)."""
    require_extra("tune", ("tqdm",), "opcontract-tune verify")
    from tqdm import tqdm

    from opcontract.backends.registry import implementation
    from opcontract.contracts import get_contract
    from opcontract.tables.db import device_key, entry_problem
    from opcontract.tuning.verify import _device_info, check, prepare, same_bits

    device = args.device or ("cuda" if _cuda() else "cpu")
    here = device_key(_device_info(device))
    only = _only(args.only)
    bad = checked = 0
    first = None  # (call, implementation, canonical bits)
    entries = [
        e
        for e in _db(args).entries
        if (e.key["gpu"], e.key["capability"]) == here
        and (only is None or e.key["op"] in only or e.key["implementation"] in only)
    ]
    ordered = sorted(entries, key=lambda e: [str(e.key[f]) for f in _CALL])
    for e in tqdm(ordered, desc="verify", unit="entry", disable=args.no_progress):
        k = e.key
        c = get_contract(k["op"])
        fixed = dict(kv.split("=") for kv in k["shape"].split(",") if kv)
        sizes = {**{s: int(v) for s, v in fixed.items()}, c.conformance.batch_dim: k["bucket"]}
        impl = implementation(k["implementation"])
        checked += 1
        why = entry_problem(e, impl, c.numerics_sha256)
        if why:  # the check dispatch makes: such an entry is never used
            bad += 1
            print(f"FAIL {e.describe()}: {why}", flush=True)
            continue
        probe = prepare(impl, c, k["dtype"], sizes, device=device)
        call = tuple(k[f] for f in _CALL)
        if first is None or first[0] != call:
            first = (call, k["implementation"], probe.bits)
        verdict = check(probe, e.config)
        why = None
        if not verdict.ok:
            why = verdict.detail
        elif not same_bits(first[2], probe.bits):
            why = f"bits differ from {first[1]}'s, tabled for the same call"
        if why:
            bad += 1
            print(f"FAIL {e.describe()}: {why}", flush=True)
    print(f"verified {checked - bad} of {checked} entries for {here[0]}")
    return 1 if bad else 0


_CALL = ("op", "dtype", "shape", "bucket")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@entry_point("opcontract-tune")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="opcontract-tune", description=__doc__.split("\n")[0])
    add_version(ap)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sw = sub.add_parser("sweep", help="run a sweep file")
    sw.add_argument("sweep")
    sw.add_argument(
        "--table",
        default=str(USER_TABLES / "tuned.json"),
        help="table to write (default: the user table dispatch reads)",
    )
    sw.add_argument(
        "--trials",
        type=int,
        default=20,
        help="per study, in all: a resumed study runs what is left",
    )
    sw.add_argument("--timeout", type=float, default=None, help="seconds per study")
    sw.add_argument("--storage", default=None, help="sqlite:///FILE or a journal file path")
    sw.add_argument("--device", choices=("cuda", "cpu"), default=None)
    sw.add_argument("--no-progress", action="store_true")
    sw.add_argument("--only", default=None, help="comma-separated ops or implementations to tune")
    sw.add_argument("--max-batch", type=int, default=None, help="tune batch sizes up to this")
    sw.add_argument("--min-batch", type=int, default=None, help="tune batch sizes from this")
    sw.add_argument(
        "--compile-workers",
        type=int,
        default=0,
        help="compile every candidate first in this many processes (0: compile as tuned)",
    )
    for name in ("show", "verify"):
        p = sub.add_parser(name)
        p.add_argument("--table", default=None)
        if name == "verify":
            p.add_argument("--only", default=None, help="comma-separated ops or implementations")
            p.add_argument("--no-progress", action="store_true")
            p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    args = ap.parse_args(argv)
    return {"sweep": _sweep, "show": _show, "verify": _verify}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
