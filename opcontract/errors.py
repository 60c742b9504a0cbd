"""Exceptions raised by opcontract. Each message names the argument or contract field at fault.

The base class's ``__init__`` is called by name, not through ``super()``, so that
torch.compile can raise these while it traces a call (it then reports them as they are).
"""

from __future__ import annotations


class ContractViolation(ValueError):
    """A call does not satisfy its op's contract (shape, dtype, device, value or parameter)."""

    def __init__(self, op: str, argument: str, field: str, message: str) -> None:
        self.op = op
        self.argument = argument
        self.field = field
        ValueError.__init__(
            self, f"{op}: argument '{argument}' violates contract field '{field}': {message}"
        )


class NoBackendError(RuntimeError):
    """No registered implementation may serve this call; lists every implementation and why."""

    def __init__(self, op: str, rejected: dict[str, str], requested: str | None = None) -> None:
        self.op = op
        self.rejected = dict(rejected)
        head = f"{op}: no implementation satisfies the contract for this call"
        if requested:
            own = [
                f"{name}: {why}"
                for name, why in rejected.items()
                if requested in (name, name.split(".")[0])
            ]
            head = f"{op}: requested backend '{requested}' cannot serve this call"
            if own:
                head += ": " + "; ".join(own)
        lines = [f"  {name}: {reason}" for name, reason in rejected.items()] or [
            "  (none registered)"
        ]
        RuntimeError.__init__(self, head + "\n" + "\n".join(lines))


class ContractFileError(ValueError):
    """A contract file is malformed. Carries one ``path:line: message`` entry per problem."""

    def __init__(self, problems: list[tuple[str, int, str]]) -> None:
        self.problems = problems
        ValueError.__init__(self, "\n".join(f"{p}:{line}: {msg}" for p, line, msg in problems))
