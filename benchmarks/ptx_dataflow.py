"""The float32 arithmetic behind each stored value of a PTX kernel, as an expression: which
products an fma fused, which were rounded apart, in what order. Two kernels that should give
the same bits for the same inputs must build the same expression for every stored element.

    python benchmarks/ptx_dataflow.py a.ptx b.ptx   # the distinct expressions of each

Leaves: ``P:<name>`` a kernel parameter (names given by the caller, else its PTX name),
``LD:<name>`` a load from the pointer parameter ``<name>``, ``MMA`` a tensor-core result,
``PHI`` a register written in more than one place (a loop's running value), immediates as
written (``0f3F800000``), ``I`` anything integer, ``IPRED`` an integer comparison.
"""

from __future__ import annotations

import collections
import re
import sys

_INSTRUCTION = re.compile(r"^\s*(@!?%p\d+\s+)?([a-z][\w.]*)\s+(.*?);\s*$")
_SIDE_EFFECTS = ("st.", "bar", "bra", "ret", "wgmma.fence", "wgmma.commit", "wgmma.wait",
                 "fence", "cp.async", "mbarrier")  # fmt: skip


def _instructions(ptx: str):
    for line in ptx.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            _pred, op, rest = m.groups()
            yield op, [x.strip() for x in re.split(r",(?![^{]*})", rest)]


class Dataflow:
    """Definitions of every register of one PTX kernel, and expressions built from them."""

    def __init__(self, ptx: str, names: list[str] | None = None):
        self.defs: dict[str, list] = collections.defaultdict(list)
        self.stores: list[list[str]] = []
        for op, ops in _instructions(ptx):
            if op.startswith(_SIDE_EFFECTS):
                continue
            for reg in re.findall(r"%\w+", ops[0]):
                self.defs[reg].append((op, ops[1:]))
            if op.startswith("cvt.rn.bf16") or op.startswith("cvt.rn.f16"):
                self.stores.append(ops[1:])
        params = re.findall(r"\.param [^\n,)]*?(\w+_param_\d+)", ptx.split("{", 1)[0])
        names = names or []
        self.params = {p: (names[i] if i < len(names) else p) for i, p in enumerate(params)}
        self._memo: dict[str, str] = {}

    def _pointer(self, reg: str, depth: int = 0) -> str:
        """The pointer parameter an address register derives from."""
        for op, args in self.defs.get(reg, []) if depth < 40 else []:
            if op.startswith("ld.param"):
                return self.params.get(args[0].strip("[] "), "?")
            for a in args:
                for r in re.findall(r"%rd\d+", a):
                    found = self._pointer(r, depth + 1)
                    if found != "?":
                        return found
        return "?"

    def _one(self, op: str, args: list[str], stack: tuple) -> str:
        if op.startswith("ld.param"):
            return "P:" + self.params.get(args[0].strip("[] "), args[0])
        if op.startswith(("ld.global", "ld.shared")):
            base = re.findall(r"%rd\d+", args[0])
            return "LD:" + (self._pointer(base[0]) if base else "?")
        if op.startswith("wgmma.mma_async") or op.startswith("mma."):
            return "MMA"
        if op.startswith("mov") and len(args) == 1:
            return self.expr(args[0], stack)
        if (".f32" in op and not op.startswith("cvt.rn.f32.s")) or op.startswith("selp"):
            return op + "(" + ",".join(self.expr(a, stack) for a in args) + ")"
        if op.startswith("cvt.rn.f32.s"):
            return op + "(I)"
        return "IPRED" if op.startswith("setp") else "I"

    def expr(self, tok: str, stack: tuple = ()) -> str:
        """The expression of register ``tok`` (or ``tok`` itself, an immediate)."""
        tok = tok.strip()
        if not tok.startswith("%"):
            return "0" if tok in ("0f00000000", "0") else tok
        if tok in stack:
            return "PHI"
        if tok not in self._memo:
            ds = self.defs.get(tok, [])
            if len(ds) != 1:  # a loop's running value, or a masked load and its default
                loads = [self._one(op, a, stack + (tok,)) for op, a in ds if op.startswith("ld.")]
                self._memo[tok] = loads[0] if loads else "PHI"
            else:
                self._memo[tok] = self._one(*ds[0], stack + (tok,))
        return self._memo[tok]

    def stored(self, rename: dict[str, str] | None = None) -> collections.Counter:
        """How many stored elements (operands of the bf16/f16 conversions) have each
        expression; ``rename`` maps leaves to common names (a loaded acc to ``PHI``, say)."""
        out: collections.Counter = collections.Counter()
        for operands in self.stores:
            for reg in operands:
                e = self.expr(reg)
                for a, b in (rename or {}).items():
                    e = e.replace(a, b)
                out[e] += 1
        return out


def main() -> int:
    for path in sys.argv[1:]:
        forms = Dataflow(open(path).read()).stored()
        print(path, len(forms), "distinct expressions over", sum(forms.values()), "elements")
        for e, n in forms.most_common():
            print(f"  {n:5d}  {e[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
