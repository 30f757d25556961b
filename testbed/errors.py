"""The testbed's errors. Each maps to an exit status, so the CLI never has to guess."""
from __future__ import annotations


class TestbedError(Exception):
    """Base class; ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class SpecError(TestbedError):
    """Bad input: names the field, what is wrong, and what would be accepted."""

    exit_code = 2

    def __init__(self, field: str, problem: str, accepted: str = "") -> None:
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
