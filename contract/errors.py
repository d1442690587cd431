"""The one error type of the contract: a value that crosses a process boundary and breaks it."""

from __future__ import annotations

#: Every value ContractError.reason can take (a bounded label set for counters).
REASONS = (
    "too_large",
    "not_utf8",
    "not_json",
    "not_object",
    "wrong_version",
    "missing_field",
    "bad_type",
    "out_of_range",
)


class ContractError(ValueError):
    """A record or answer that breaks the contract.

    ``reason`` is one of :data:`REASONS`; ``field`` names the offending field (dotted for
    nested ones: ``ranks[3].recent[0].step``) when there is one; the message says which
    field and why.
    """

    def __init__(self, reason: str, message: str, field: str | None = None) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown contract error reason {reason!r}")
        super().__init__(message)
        self.reason = reason
        self.field = field

    def __reduce__(self):
        return (type(self), (self.reason, str(self), self.field))

    def within(self, prefix: str) -> ContractError:
        """The same error, its field named inside ``prefix`` (a nested model's parent)."""
        message = str(self)
        if self.field is None:
            return type(self)(self.reason, f"{prefix}: {message}", prefix)
        field = f"{prefix}.{self.field}"
        if message.startswith(self.field + ":"):
            message = field + message[len(self.field) :]
        return type(self)(self.reason, message, field)
