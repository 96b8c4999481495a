"""The prep stage's settings: the plan's ``[prep]`` table, checked, with defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.run.plan import Dataset, Plan, PlanError

KNOWN = {
    "shard_rows": "rows per output shard (the unit of resume)",
    "batch_rows": "rows tokenised per batch (a pause waits at most one batch)",
    "reject_threshold": "fraction of malformed rows above which the stage fails",
    "check_rows": "rows validated before the full run starts",
    "reject_messages": "rejects announced as message events per attempt (all go to rejects.jsonl)",
    "tokenizer_threads": "threads the fast tokenizer may use (the stage holds cpu slots for this many)",
    "template_kwargs": "extra variables for the chat template (e.g. a thinking switch)",
}


@dataclass(frozen=True)
class PrepSettings:
    shard_rows: int = 2000
    batch_rows: int = 64
    reject_threshold: float = 0.05
    check_rows: int = 64
    reject_messages: int = 20
    tokenizer_threads: int = 1
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_length: int = 4096

    @classmethod
    def from_plan(cls, plan: Plan, ds: Dataset | None = None) -> PrepSettings:
        """``[prep]`` plus ``target.max_length``; a dataset's ``options.reject_threshold`` overrides the plan's."""
        sec = plan.section("prep")
        for k in sec:
            if k not in KNOWN:
                raise PlanError(plan.path, f"prep.{k}", f"unknown key (known: {', '.join(sorted(KNOWN))})")
        vals: dict[str, Any] = {}
        for k in ("shard_rows", "batch_rows", "check_rows", "reject_messages", "tokenizer_threads"):
            if k in sec:
                v = sec[k]
                if isinstance(v, bool) or not isinstance(v, int) or v < (0 if k == "reject_messages" else 1):
                    raise PlanError(plan.path, f"prep.{k}", f"expected a positive integer, got {v!r}")
                vals[k] = v
        thr = sec.get("reject_threshold", cls.reject_threshold)
        key = "prep.reject_threshold"
        if ds is not None and "reject_threshold" in ds.options:
            thr, key = ds.options["reject_threshold"], f"datasets[{ds.name}].options.reject_threshold"
        if isinstance(thr, bool) or not isinstance(thr, int | float) or not 0 <= thr <= 1:
            raise PlanError(plan.path, key, f"expected a fraction between 0 and 1, got {thr!r}")
        vals["reject_threshold"] = float(thr)
        tk = sec.get("template_kwargs", {})
        if not isinstance(tk, dict):
            raise PlanError(plan.path, "prep.template_kwargs", "expected a table")
        vals["template_kwargs"] = dict(tk)
        ml = plan.target.get("max_length", cls.max_length)
        if ml < 16:
            raise PlanError(plan.path, "target.max_length", f"must be at least 16, got {ml}")
        vals["max_length"] = ml
        return cls(**vals)
