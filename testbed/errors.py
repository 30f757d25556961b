"""The testbed's errors. Each maps to an exit status, so the CLI never has to guess."""
from __future__ import annotations

import reprlib

QUOTE_CHARS = 80    # an error message quotes at most this much of a value from the input
_FIELD_CHARS = 120  # a field path names user keys too; past this it is cut as well


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters (ending in "..."), computed without ever
    building the whole repr: a value from a YAML alias bomb quotes in microseconds."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = limit
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 3, 8, 8, 8, 8
    try:
        text = r.repr(value)
    except ValueError:            # an int too long for str() (over 4300 digits)
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class TestbedError(Exception):
    """Base class; ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class SpecError(TestbedError):
    """Bad input: names the field, what is wrong, and what would be accepted."""

    exit_code = 2

    def __init__(self, field: str, problem: str, accepted: str = "") -> None:
        if len(field) > _FIELD_CHARS:
            field = field[:_FIELD_CHARS - 3] + "..."
        self.field = field
        self.problem = problem
        self.accepted = accepted
        text = f"{field}: {problem}"
        if accepted:
            text += f"; expected {accepted}"
        super().__init__(text)


class CapabilityError(SpecError):
    """The topology asks for something this kernel cannot emulate (e.g. delay without netem)."""


class ShapingMismatch(TestbedError):
    """The kernel's read-back shaping differs from what was asked: never claimed as applied."""


class FabricError(TestbedError):
    """Building, changing or tearing down the fabric failed."""
