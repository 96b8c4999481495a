"""The prep stage's settings: the plan's ``[prep]`` for one dataset, with its row length and overrides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.run.plan.dag import Dataset, Plan, PlanError


@dataclass(frozen=True)
class PrepSettings:
    shard_rows: int
    batch_rows: int
    reject_threshold: float
    check_rows: int
    reject_messages: int
    tokenizer_threads: int
    template_kwargs: dict[str, Any]
    max_length: int  # tokens per row: [target] max_length, else TargetSection.DEFAULT_ROW_LENGTH

    @classmethod
    def from_plan(cls, plan: Plan, ds: Dataset | None = None) -> PrepSettings:
        """``[prep]`` plus the target's row length; a dataset's ``options.reject_threshold`` overrides the plan's."""
        sec = plan.settings.prep
        thr: Any = sec.reject_threshold
        if ds is not None and "reject_threshold" in ds.options:
            thr = ds.options["reject_threshold"]
            if isinstance(thr, bool) or not isinstance(thr, int | float) or not 0 <= thr <= 1:
                raise PlanError(
                    plan.path,
                    f"datasets[{ds.name}].options.reject_threshold",
                    f"expected a fraction between 0 and 1, got {thr!r}",
                )
        return cls(
            shard_rows=sec.shard_rows,
            batch_rows=sec.batch_rows,
            reject_threshold=float(thr),
            check_rows=sec.check_rows,
            reject_messages=sec.reject_messages,
            tokenizer_threads=sec.tokenizer_threads,
            template_kwargs=plan.template_kwargs(ds.name if ds is not None else None),
            max_length=plan.target.row_length,
        )
