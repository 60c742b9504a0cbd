"""Read contract YAML files (``yaml.safe_load`` semantics) with a line for every problem."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import yaml
from pydantic import ValidationError

from opcontract.contracts.schema import Contract, semantic_problems
from opcontract.errors import ContractFileError

OPS_DIR = Path(__file__).parent / "ops"


def _line_map(node: yaml.Node, path: tuple, lines: dict, dups: list) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for key, value in node.value:
            k = key.value
            if k in seen:
                dups.append((key.start_mark.line + 1, f"duplicate key '{k}'"))
            seen.add(k)
            lines[path + (k,)] = key.start_mark.line + 1
            _line_map(value, path + (k,), lines, dups)
            lines[path + (k,)] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_map(item, path + (i,), lines, dups)


def _line_for(loc: tuple, lines: dict) -> int:
    # pydantic locations may carry union tags ('list[...]', 'SameAs'): skip what isn't a key
    path: tuple = ()
    for part in loc:
        if path + (part,) in lines:
            path = path + (part,)
    return lines.get(path, 1)


def parse_contract(text: str, path: str = "<memory>") -> Contract:
    """Parse and validate one contract; raise ContractFileError listing every problem."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        raise ContractFileError(
            [(path, line, f"YAML syntax: {getattr(e, 'problem', e)}")]
        ) from None
    if not isinstance(data, dict) or node is None:
        raise ContractFileError([(path, 1, "a contract is a YAML mapping")])
    lines: dict = {}
    dups: list = []
    _line_map(node, (), lines, dups)
    problems = [(path, line, msg) for line, msg in dups]
    try:
        contract = Contract.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            loc = tuple(err["loc"])
            where = ".".join(str(p) for p in loc) or "(top)"
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append((path, _line_for(loc, lines), f"{where}: {msg}"))
        raise ContractFileError(sorted(set(problems), key=lambda p: p[1])) from None
    for loc, msg in semantic_problems(contract):
        problems.append((path, _line_for(loc, lines), f"{'.'.join(map(str, loc))}: {msg}"))
    if problems:
        raise ContractFileError(problems)
    contract._path = path
    contract._sha256 = hashlib.sha256(text.encode()).hexdigest()
    contract._lines = lines
    return contract


def load_contract_file(path: str | Path) -> Contract:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ContractFileError([(str(p), 1, f"cannot read: {e.strerror}")]) from None
    return parse_contract(text, str(p))


def shipped_contract_paths() -> list[Path]:
    return sorted(OPS_DIR.glob("*.yaml"))


@functools.cache
def load_all() -> dict[str, Contract]:
    """Every shipped contract by op name. A malformed shipped contract raises ContractFileError."""
    out: dict[str, Contract] = {}
    for p in shipped_contract_paths():
        c = load_contract_file(p)
        out[c.op] = c
    return out


def get_contract(op: str) -> Contract:
    contracts = load_all()
    if op not in contracts:
        raise KeyError(f"no contract for op '{op}'; known ops: {sorted(contracts)}")
    return contracts[op]
