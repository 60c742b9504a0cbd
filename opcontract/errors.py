"""Exceptions raised by opcontract. Each message names the argument or contract field at fault."""

from __future__ import annotations


class ContractViolation(ValueError):
    """A call does not satisfy its op's contract (shape, dtype, device, value or parameter)."""

    def __init__(self, op: str, argument: str, field: str, message: str) -> None:
        self.op = op
        self.argument = argument
        self.field = field
        super().__init__(
            f"{op}: argument '{argument}' violates contract field '{field}': {message}"
        )


class NoBackendError(RuntimeError):
    """No registered implementation may serve this call; lists every implementation and why."""

    def __init__(self, op: str, rejected: dict[str, str], requested: str | None = None) -> None:
        self.op = op
        self.rejected = dict(rejected)
        head = (
            f"{op}: requested backend '{requested}' cannot serve this call"
            if requested
            else f"{op}: no implementation satisfies the contract for this call"
        )
        lines = [f"  {name}: {reason}" for name, reason in rejected.items()] or [
            "  (none registered)"
        ]
        super().__init__(head + "\n" + "\n".join(lines))


class ContractFileError(ValueError):
    """A contract file is malformed. Carries one ``path:line: message`` entry per problem."""

    def __init__(self, problems: list[tuple[str, int, str]]) -> None:
        self.problems = problems
        super().__init__("\n".join(f"{p}:{line}: {msg}" for p, line, msg in problems))
