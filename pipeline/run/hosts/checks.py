"""Preflight checks and their report: one type and one look for every check Aerie runs before a run.

The deep check of a plan (``aerie plan check --deep``: :mod:`pipeline.eagle3.chain_check`), the SSH
preflight (``console/ssh/preflight.py``) and the Slurm preflight (:mod:`pipeline.run.hosts.slurm.preflight`) each
fill a :class:`CheckReport` and print it the same way, one line per check::

    deep check of examples/kimi-k2.5.toml:
      ok   architecture   deepseek_v3, 61 layers, …
      warn versions       transformers 5.25.0 was not tested …
      FAIL gpu memory     per rank: … does not fit

Standard library only (the Slurm preflight runs on a login node with nothing else).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Check:
    name: str  # what was checked, one word or two ("" where the detail says it all)
    ok: bool
    detail: str  # what was found, or what is wrong and how to fix it
    warning: bool = False  # ok, but the operator should know (an untested version, a guess)

    @property
    def mark(self) -> str:
        return "FAIL" if not self.ok else "warn" if self.warning else "ok"

    def line(self, name_width: int = 0) -> str:
        return f"  {self.mark:<4} {self.name:<{name_width}} {self.detail}"


@dataclass
class CheckReport:
    title: str = ""  # the report's first line, e.g. "deep check of PLAN:"
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, ok: bool, detail: str, warning: bool = False) -> bool:
        """Record a check; returns ``ok`` (so a caller can stop at the first failure it depends on)."""
        self.checks.append(Check(name, ok, detail, warning))
        return ok

    @property
    def ok(self) -> bool:
        """Every check passed (and there was at least one: a report of nothing proves nothing)."""
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[str]:
        return [c.name or c.detail for c in self.checks if not c.ok]

    def lines(self) -> list[str]:
        width = max((len(c.name) for c in self.checks), default=0)
        width = width and max(width, 10)  # names in a column; none at all where no check has one
        return [self.title, *(c.line(width) for c in self.checks)]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checks": [asdict(c) for c in self.checks]}
