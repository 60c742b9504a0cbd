"""contract-lint: check contract files and every registered implementation's declaration.

    contract-lint                 # the shipped contracts and all implementations
    contract-lint path/to/op.yaml # given files (or folders of *.yaml)
    contract-lint --json          # one JSON object for machines
    contract-lint --conformance [--op OP] [--device cpu|cuda]
                                  # also run the conformance kit on this machine

Exit 0 when clean; exit 1 with one ``path:line: message`` per problem; exit 2 for an
unknown ``--op`` (the message lists the known ops).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from opcontract.backends.registry import declaration_problems, implementations
from opcontract.cli import UsageError, add_version, entry_point, unknown
from opcontract.contracts.loader import load_contract_file, shipped_contract_paths
from opcontract.contracts.schema import Contract
from opcontract.errors import ContractFileError


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def _expand(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.glob("*.yaml")) if p.is_dir() else [p])
    return out


def _reference_problem(c: Contract) -> Problem | None:
    module, _, name = c.reference.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        return Problem(c.path, c.line_of("reference"), f"reference {c.reference!r} not found: {e}")
    if not callable(fn):
        return Problem(c.path, c.line_of("reference"), f"reference {c.reference!r} is not callable")
    return None


def lint(paths: list[str] | None = None) -> tuple[list[Problem], dict[str, Contract]]:
    """Problems found, and the contracts that loaded cleanly (by op)."""
    files = _expand(paths) if paths else shipped_contract_paths()
    problems: list[Problem] = []
    contracts: dict[str, Contract] = {}
    for f in files:
        try:
            c = load_contract_file(f)
        except ContractFileError as e:
            problems.extend(Problem(p, line, msg) for p, line, msg in e.problems)
            continue
        if c.op in contracts:
            problems.append(
                Problem(
                    str(f),
                    c.line_of("op"),
                    f"op '{c.op}' already defined in {contracts[c.op].path}",
                )
            )
            continue
        ref = _reference_problem(c)
        if ref:
            problems.append(ref)
        contracts[c.op] = c

    impls = implementations()
    for impl in impls:
        c = contracts.get(impl.op)
        if c is None:
            if not paths:
                problems.append(
                    Problem(*impl.source, f"{impl.name}: no contract for op '{impl.op}'")
                )
            continue
        if impl.relaxed_only:
            continue
        for msg in declaration_problems(impl, c):
            problems.append(Problem(*impl.source, f"{impl.name} ({impl.op}): {msg}"))
    for op, c in contracts.items():
        ok = [
            i for i in impls if i.op == op and not i.relaxed_only and not declaration_problems(i, c)
        ]
        if not ok:
            problems.append(
                Problem(
                    c.path,
                    c.line_of("op"),
                    f"op '{op}' has no implementation that satisfies its contract",
                )
            )
    return problems, contracts


def conformance(contracts: dict[str, Contract], device: str, only: str | None) -> list[Problem]:
    """Run the kit for every implementation that may serve this device; one line per check."""
    import torch

    from opcontract.backends.registry import CallInfo, rejection
    from opcontract.conformance import run_kit
    from opcontract.dispatch.device import device_of

    dev = device_of(torch.empty(0, device=device))
    problems: list[Problem] = []
    for op, c in contracts.items():
        if only and op != only:
            continue
        for impl in implementations(op):
            if impl.relaxed_only:
                continue
            for dtype in impl.dtypes:
                call = CallInfo(dev, dtype, c.conformance.cases[0].sizes, {})
                why = rejection(impl, c, call, "strict")
                if why:
                    print(f"skip {impl.name} {dtype}: {why}")
                    continue
                for r in run_kit(impl, c, dtype, device=device):
                    print(f"{'ok  ' if r.ok else 'FAIL'} {impl.name} {dtype} {r.check}: {r.detail}")
                    if not r.ok:
                        problems.append(
                            Problem(*impl.source, f"{impl.name} {dtype} {r.check}: {r.detail}")
                        )
    return problems


@entry_point("contract-lint")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="contract-lint", description=__doc__.split("\n")[0])
    add_version(ap)
    ap.add_argument("paths", nargs="*", help="contract files or folders (default: shipped)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--conformance", action="store_true", help="also run the conformance kit")
    ap.add_argument("--op", default=None, help="with --conformance: only this op")
    ap.add_argument("--device", default=None, help="with --conformance: cpu or cuda")
    args = ap.parse_args(argv)
    problems, contracts = lint(args.paths or None)
    if args.op is not None and args.op not in contracts:
        err = unknown(args.op, {"op": contracts})
        if problems:  # the op's own file may be among those that didn't load
            err = UsageError(f"{err} (and {len(problems)} problem(s): run without --op)")
        raise err
    if args.conformance and not problems:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        problems += conformance(contracts, device, args.op)
    if args.json:
        print(
            json.dumps(
                {
                    "ok": not problems,
                    "problems": [p.__dict__ for p in problems],
                    "contracts": {
                        op: {"path": c.path, "version": c.version, "sha256": c.sha256}
                        for op, c in contracts.items()
                    },
                    "implementations": [
                        {
                            "name": i.name,
                            "op": i.op,
                            "backend": i.backend,
                            "relaxed_only": i.relaxed_only,
                        }
                        for i in implementations()
                        if i.op in contracts
                    ],
                },
                indent=2,
            )
        )
    else:
        for p in problems:
            print(p)
        if not problems:
            n = sum(1 for i in implementations() if i.op in contracts)
            print(f"contract-lint: {len(contracts)} contract(s), {n} implementation(s): clean")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
