"""`Gate`: a check that returns its verdict together with the numbers behind it.

Notebooks assert gates (`assert gate, gate`), so a failing gate prints
what it measured, and a gate that could not fail would be visible as one whose numbers never
move.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Gate:
    name: str
    passed: bool
    numbers: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.numbers.items())
        return f"{self.name}: {'pass' if self.passed else 'FAIL'} ({shown})"
