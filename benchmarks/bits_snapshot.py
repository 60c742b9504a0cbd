"""Bit snapshot of every op: proof that a refactor of the op shell changes no bits.

For every shipped contract, every conformance case, every implementation that is not
``relaxed_only`` and every dtype in (float32, bfloat16, float16), the script builds the
case's inputs with a fixed seed, calls the op through dispatch with that implementation
forced and every optional output asked for, and records the shape, dtype and sha256 of the
raw bytes of every output. Where the contract declares gradients it calls the op again on
``detach().clone().requires_grad_()`` leaves of the inputs named in ``contract.grads``
(those outputs are recorded too, as ``<name>[grad]``: the call that saves for backward may
take another path) and records every gradient of sum(out.double() * upstream) over the
differentiable outputs, ``upstream`` fixed random float64 tensors, taken with
torch.autograd.grad. Per op, case 0 is also run at extra batch sizes (``case0@T=0``,
``@T=1``, ``@T=65``: the empty call, decode size, and past the Triton kernels' 64-row
thresholds). Eager calls only, no torch.compile.

An implementation dispatch refuses on this device (NoBackendError) is recorded as one row
``{"skipped": reason}``; any other exception as ``{"error": ...}`` (the run then exits 2).

It uses only the public API (``dispatch.op(op, backend=impl)``,
``backends.registry.implementations``, ``contracts.load_all``,
``conformance.inputs.make_inputs``, ``conformance.checks.with_optional_outputs``), so the
same file runs unchanged before and after a refactor; compare the two JSON files:

    python benchmarks/bits_snapshot.py --device cpu \\
        --out benchmarks/results/bits_snapshot_cpu_<commit>.json
    python benchmarks/bits_snapshot.py --device cuda --commit <commit> --out /tmp/after.json
    python benchmarks/bits_snapshot.py --compare before.json after.json

``--compare`` prints every row whose hash, shape or dtype differs or that is in one file
only, and a summary; it exits 1 if any differ, else 0. Files are only comparable when they
come from the same device and the same torch / Triton versions (printed as a warning
otherwise). On the CPU (``--device cpu``) TRITON_INTERPRET=1 is set before opcontract is
imported, so the Triton implementations run in Triton's interpreter; ``--threads`` (default
1) fixes torch's CPU thread count. Calls slower than ``--slow`` seconds (default 20) are
reported. ``--ops`` / ``--dtypes`` restrict a run (for a quick look; a snapshot is the
whole set).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
SEED = 20240601  # inputs of case i: SEED + i; upstream gradient of output j: SEED + 1000 + j
# Extra batch sizes per op, applied to case 0: T = 0 (the empty call's own branches),
# T = 1 (decode) and T = 65, just past the Triton kernels' 64-row thresholds (rms/add-norm
# W_FIRST, softcap_logprob's SMALL_T, the norms' 64-row backward parts), where no
# conformance case of fused_add_rms_norm, softcap_logprob or linear_cross_entropy is.
EXTRA_BATCH = (0, 1, 65)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--out", type=Path, help="JSON file to write")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    p.add_argument("--merge", nargs="+", type=Path, help="join partial snapshots into --out")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    p.add_argument("--commit", help="opcontract commit to record (default: git rev-parse HEAD)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--slow", type=float, default=20.0, help="report calls slower than this (s)")
    p.add_argument("--ops", nargs="*", help="only these ops")
    p.add_argument("--dtypes", nargs="*", choices=DTYPES, help="only these dtypes")
    p.add_argument("--no-extra", action="store_true", help="skip the extra batch sizes")
    args = p.parse_args(argv)
    if not args.compare and not args.out:
        p.error("--out is required unless --compare")
    return args


# ---------------------------------------------------------------------------- snapshot


def _git_commit() -> str | None:
    repo = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except Exception:
        return None
    return rev if len(rev) == 40 else None


def _digest(t):
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def _tensor_row(name, t) -> dict:
    return {
        "tensor": name,
        "shape": list(t.shape),
        "tensor_dtype": str(t.dtype).removeprefix("torch."),
        "sha256": _digest(t),
    }


def _named(contract, result) -> list[tuple[str, object]]:
    """The result's tensors in order, by name (None fields skipped)."""
    import torch

    names = list(contract.outputs)
    if isinstance(result, torch.Tensor):
        return [(names[0], result)]
    fields = getattr(result, "_fields", None) or names
    out = []
    for i, value in enumerate(result):
        if isinstance(value, torch.Tensor):
            out.append((fields[i] if i < len(fields) else f"output{i}", value))
    return out


def _upstream(contract, outs: dict, device) -> dict:
    """Fixed random float64 upstream gradients for the differentiable outputs present."""
    import torch

    up = {}
    for j, (name, spec) in enumerate(contract.outputs.items()):
        if spec.differentiable and name in outs:
            gen = torch.Generator().manual_seed(SEED + 1000 + j)
            up[name] = torch.randn(outs[name].shape, generator=gen, dtype=torch.float64)
            up[name] = up[name].to(device)
    return up


def _resized(case, sizes: dict):
    """A copy of a conformance case with other sizes (a pydantic model, or a dataclass)."""
    if hasattr(case, "model_copy"):
        return case.model_copy(update={"sizes": sizes})
    import dataclasses

    return dataclasses.replace(case, sizes=sizes)


def _cases(contract, extra: bool) -> list[tuple[str, int, object]]:
    """(label, seed, case): the conformance cases, then case 0 at the extra batch sizes."""
    cases = [(f"case{i}", SEED + i, c) for i, c in enumerate(contract.conformance.cases)]
    if extra and cases:
        base = contract.conformance.cases[0]
        bdim = contract.conformance.batch_dim
        for n in EXTRA_BATCH:
            if base.sizes.get(bdim) != n:
                sizes = {**base.sizes, bdim: n}
                cases.append((f"case0@{bdim}={n}", SEED, _resized(base, sizes)))
    return cases


def _run_combo(contract, impl: str, case, dtype: str, seed: int, device: str) -> list[dict]:
    """Rows (without the op / implementation / dtype / case keys) of one combination."""
    import torch

    from opcontract import dispatch
    from opcontract.conformance.checks import with_optional_outputs
    from opcontract.conformance.inputs import make_inputs

    fn = dispatch.op(contract.op, backend=impl)
    inputs, params = make_inputs(contract, case, dtype, seed=seed, device=device)
    params = with_optional_outputs(contract, params)
    rows = [_tensor_row(n, t) for n, t in _named(contract, fn(**inputs, **params))]
    if not contract.grads:
        return rows
    names = [k for k in contract.grads if inputs.get(k) is not None]
    leaves = {
        k: (v.detach().clone().requires_grad_(True) if k in names else v) for k, v in inputs.items()
    }
    outs = dict(_named(contract, fn(**leaves, **params)))
    rows += [_tensor_row(f"{n}[grad]", t) for n, t in outs.items()]
    up = _upstream(contract, outs, device)
    loss = sum((outs[n].double() * u).sum() for n, u in up.items())
    grads = torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True)
    for k, g in zip(names, grads, strict=True):
        if g is None:
            rows.append(
                {"tensor": f"grad.{k}", "shape": None, "tensor_dtype": None, "sha256": "none"}
            )
        else:
            rows.append(_tensor_row(f"grad.{k}", g))
    return rows


def snapshot(args: argparse.Namespace) -> int:
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton (imported by opcontract) loads
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            sys.exit("triton was imported before TRITON_INTERPRET=1 could be set")
        os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(args.threads)

    import triton

    import opcontract
    from opcontract.backends.registry import implementations
    from opcontract.contracts import load_all

    env = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "capability": list(torch.cuda.get_device_capability()) if device == "cuda" else None,
        "commit": args.commit or _git_commit(),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        "torch_threads": torch.get_num_threads(),
        "seed": SEED,
        "extra_batch": [] if args.no_extra else list(EXTRA_BATCH),
    }
    print(f"env: {json.dumps(env)}", flush=True)
    rows: list[dict] = []
    timings: list[dict] = []
    slow: list[str] = []
    errors = 0
    start = time.perf_counter()
    contracts = load_all()
    for op_name in sorted(contracts):
        if args.ops and op_name not in args.ops:
            continue
        contract = contracts[op_name]
        impls = [i.name for i in implementations(op_name) if not i.relaxed_only]
        for label, seed, case in _cases(contract, not args.no_extra):
            for impl in impls:
                for dtype in args.dtypes or DTYPES:
                    key = {"op": op_name, "implementation": impl, "dtype": dtype, "case": label}
                    t0 = time.perf_counter()
                    try:
                        got = _run_combo(contract, impl, case, dtype, seed, device)
                        rows += [{**key, **r} for r in got]
                        what = f"{len(got)} tensors"
                    except opcontract.NoBackendError as e:
                        reason = " ".join(str(e).split())
                        rows.append({**key, "skipped": reason})
                        what = f"skipped: {reason}"
                    except Exception as e:  # recorded, so a comparison shows it
                        errors += 1
                        rows.append({**key, "error": f"{type(e).__name__}: {e}"})
                        what = f"ERROR {type(e).__name__}: {e}"
                    dt = time.perf_counter() - t0
                    timings.append({**key, "seconds": round(dt, 3)})
                    tag = f"{op_name} {label} {impl} {dtype}"
                    if dt > args.slow:
                        slow.append(f"{tag}: {dt:.1f} s")
                    print(
                        f"[{time.perf_counter() - start:7.1f}s] {tag}: {what} ({dt:.2f} s)",
                        flush=True,
                    )
    total = time.perf_counter() - start
    hashed = sum("sha256" in r for r in rows)
    skipped = sum("skipped" in r for r in rows)
    result = {
        "benchmark": "bits_snapshot",
        "command": " ".join(sys.argv),
        "env": env,
        "summary": {
            "tensors": hashed,
            "skipped": skipped,
            "errors": errors,
            "seconds": round(total, 1),
            "slow_calls": slow,
        },
        "rows": rows,
        "timings": timings,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{hashed} tensors hashed, {skipped} combinations skipped, {errors} errors, "
        f"{total:.1f} s -> {args.out}"
    )
    for s in slow:
        print(f"slow (> {args.slow:g} s): {s}")
    return 2 if errors else 0


# ---------------------------------------------------------------------------- compare

_KEY = ("op", "implementation", "dtype", "case", "tensor")


def _index(path: Path) -> tuple[dict, dict]:
    data = json.loads(path.read_text())
    out = {}
    for r in data["rows"]:
        k = tuple(r.get(f) for f in _KEY)
        if k in out:
            raise SystemExit(f"{path}: duplicate row {k}")
        out[k] = r
    return data.get("env", {}), out


def _state(r: dict) -> str:
    if "skipped" in r:
        return "skipped"
    if "error" in r:
        return f"error: {r['error']}"
    return f"{r['tensor_dtype']}{r['shape']} {r['sha256'][:16]}"


def compare(a_path: Path, b_path: Path) -> int:
    env_a, a = _index(a_path)
    env_b, b = _index(b_path)
    for f in ("device_name", "torch", "triton", "TRITON_INTERPRET"):
        if env_a.get(f) != env_b.get(f):
            print(f"warning: {f} differs: {env_a.get(f)!r} vs {env_b.get(f)!r}")
    print(f"A: {a_path} (commit {env_a.get('commit')})")
    print(f"B: {b_path} (commit {env_b.get('commit')})")
    same = differ = only_a = only_b = notes = 0

    def name(k):
        return " ".join(str(x) for x in k if x is not None)

    for k in sorted(set(a) | set(b), key=lambda k: tuple(str(x) for x in k)):
        ra, rb = a.get(k), b.get(k)
        if rb is None:
            only_a += 1
            print(f"only in A: {name(k)}: {_state(ra)}")
        elif ra is None:
            only_b += 1
            print(f"only in B: {name(k)}: {_state(rb)}")
        elif "skipped" in ra and "skipped" in rb:
            same += 1
            if ra["skipped"] != rb["skipped"]:  # still skipped: wording is not bits
                notes += 1
                print(
                    f"note: {name(k)}: skip reason changed:\n  A: {ra['skipped']}\n"
                    f"  B: {rb['skipped']}"
                )
        elif all(ra.get(f) == rb.get(f) for f in ("sha256", "shape", "tensor_dtype", "error")):
            same += 1
        else:
            differ += 1
            print(f"DIFFERS: {name(k)}: A {_state(ra)} | B {_state(rb)}")
    bad = differ + only_a + only_b
    print(
        f"{same} rows equal, {differ} differ, {only_a} only in A, {only_b} only in B"
        f"{f', {notes} skip reasons reworded' if notes else ''}: "
        f"{'0 differences' if not bad else f'{bad} differences'}"
    )
    return 1 if bad else 0


def merge(parts: list[Path], out: Path) -> int:
    """One snapshot from several runs of it (``--ops`` subsets run side by side): the first
    part's env, every part's rows and timings."""
    data = [json.loads(p.read_text()) for p in parts]
    joined = dict(data[0])
    joined["rows"] = [r for d in data for r in d["rows"]]
    for key in ("timings", "slow"):
        if isinstance(data[0].get(key), list):
            joined[key] = [t for d in data for t in d.get(key, [])]
        elif isinstance(data[0].get(key), dict):
            joined[key] = {k: v for d in data for k, v in d.get(key, {}).items()}
    joined["merged_from"] = [str(p) for p in parts]
    out.write_text(json.dumps(joined, indent=1))
    print(f"merged {len(parts)} snapshots: {len(joined['rows'])} rows -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.compare:
        return compare(*args.compare)
    if args.merge:
        return merge(args.merge, args.out)
    return snapshot(args)


if __name__ == "__main__":
    sys.exit(main())
