"""Validate first: read the first rows of a dataset and report every malformed one before real work starts.

``--check N`` runs only this (nothing is written) and fails on any malformed row; a full run does it
on ``[prep] check_rows`` rows and stops when more of them than the reject threshold are malformed, which
is what a wrong source, a renamed column or a changed schema looks like.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.data import sources
from pipeline.data.tokenise import ChatTokenizer
from pipeline.run.plan.dag import Dataset
from pipeline.stages.prep.rows import Outcome, RowProcessor


@dataclass
class CheckReport:
    dataset: str
    rows: int = 0
    problems: list[Outcome] = field(default_factory=list)
    duplicates: int = 0
    dropped: int = 0

    @property
    def reject_rate(self) -> float:
        return len(self.problems) / self.rows if self.rows else 0.0

    def lines(self, limit: int = 20) -> list[str]:
        out = [
            f"{self.dataset}: row {p.row}"
            + (f" (line {p.line})" if p.line else "")
            + f": {p.field}: {p.reason}"
            for p in self.problems[:limit]
        ]
        if len(self.problems) > limit:
            out.append(f"{self.dataset}: ... and {len(self.problems) - limit} more")
        return out

    def summary(self) -> str:
        return (
            f"{self.dataset}: checked {self.rows} rows: {self.rows - len(self.problems)} valid, "
            f"{len(self.problems)} malformed, {self.duplicates} duplicates, {self.dropped} without target tokens"
        )


def check_dataset(
    ds: Dataset, tokenizer: ChatTokenizer | None, n: int, cache_dir: Path, batch_rows: int = 64
) -> CheckReport:
    """Validate (and for target-native datasets, tokenise) the first ``n`` rows of ``ds``."""
    src = sources.get(ds.source)
    proc = RowProcessor(src, ds.kind, ds.options, tokenizer)
    report = CheckReport(ds.name)
    rows = sources.open_rows(src, ds.path, ds.split, ds.config, ds.options, cache_dir)
    for batch in iter(lambda: list(itertools.islice(rows, batch_rows)), []):
        batch = batch[: n - report.rows]
        for o in proc.process(batch):
            report.rows += 1
            if o.kind == "reject":
                report.problems.append(o)
            elif o.kind == "duplicate":
                report.duplicates += 1
            elif o.kind == "dropped":
                report.dropped += 1
        if report.rows >= n:
            break
    return report
