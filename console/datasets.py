"""The per-dataset progress rows: every stage working on one dataset (the preps, the regenerations).

Pure: built from the run model's :class:`~console.model.StageView` objects. A row has the rows
done against the quota, the recent rate, the ETA, the rejects (malformed source rows for a prep,
failed requests for a regeneration) and the state. Rows are sorted by state — what needs the
operator first (failed, killed, unhealthy), then running, paused, pending, done — then by ETA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from console.model import RunModel, StageView
from console.states import look
from pipeline.run.rundir.stage_row import StageState


@dataclass(frozen=True)
class DatasetRow:
    stage: str
    dataset: str
    family: str
    state: str
    done: float
    total: float | None
    unit: str
    rate: float | None
    eta_s: float | None
    rejects: int
    note: str

    @property
    def fraction(self) -> float | None:
        return None if not self.total else max(0.0, min(1.0, self.done / self.total))


def row_for(st: StageView) -> DatasetRow:
    running = st.state == StageState.RUNNING
    prog = st.progress
    note = (
        st.reason
        if st.state in (StageState.PENDING, StageState.FAILED, StageState.KILLED, StageState.UPSTREAM_FAILED)
        else ""
    )
    return DatasetRow(
        stage=st.id,
        dataset=st.dataset or st.id,
        family=st.family,
        state=st.display_state,
        done=prog.done,
        total=prog.total,
        unit=prog.unit or "rows",
        rate=prog.rate() if running else None,
        eta_s=prog.eta_s() if running else None,
        rejects=st.rejects,
        note=note,
    )


def sort_key(r: DatasetRow) -> tuple:
    return (look(r.state).dataset_rank, math.inf if r.eta_s is None else r.eta_s, r.dataset, r.family)


def dataset_rows(model: RunModel) -> list[DatasetRow]:
    """One row per stage that works on a dataset, sorted by state then ETA."""
    rows = [row_for(model.stages[sid]) for sid in model.order if model.stages[sid].dataset]
    return sorted(rows, key=sort_key)
