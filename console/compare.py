"""Other runs overlaid in the metrics view (``aerie attach RUN --compare OTHER[,…]``, or ``c`` there).

Each other run is a :class:`~console.model.RunModel` over its own run directory, read by the same event
readers as the console's own run (local run directories), so the metrics view can draw the same metric
of the same stage from several runs in one panel, a curve per run — two training recipes side by side,
as TensorBoard shows runs. A run directory that is not one is refused with its path in the message.
Either run may be remote: ``--compare ssh://host/path/to/run`` reads the other run over SSH, through the
same transport as ``aerie attach ssh://…`` (:func:`console.ssh.commands.attach_transport`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from console.model import RunModel, StageView
from console.series import Series
from console.transport import LocalTransport
from pipeline.run.rundir.layout import RunDir


class CompareError(ValueError):
    """A run directory to compare with that cannot be used (the message names it)."""


@dataclass
class OtherRun:
    """One run to compare with: its directory, its model (polled while the metrics view shows it)."""

    root: str
    model: RunModel = field(repr=False)
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.model.run_name or Path(self.root).name

    async def refresh(self) -> bool:
        """Read what is new in the other run; True when something changed."""
        first = not self.model.loaded
        changed = await self.model.poll()
        if first:  # the first poll reads state.json; the stages' events start with the next
            changed |= await self.model.poll()
        return bool(changed)

    def stage_like(self, stage: StageView) -> StageView | None:
        """The other run's stage of the same id, else the first of the same family (``train``, ``bench``)."""
        st = self.model.stages.get(stage.id)
        if st is None:
            st = next((s for s in self.model.stages.values() if s.family == stage.family), None)
        return st

    def series(self, stage: StageView, name: str) -> tuple[Series | None, str]:
        """The other run's curve of ``name`` for the stage like ``stage``, or why there is none."""
        if self.model.error:
            return None, f"{self.name}: {self.model.error}"
        st = self.stage_like(stage)
        if st is None:
            return (
                None,
                f"{self.name} has no stage {stage.id}" if self.model.loaded else f"{self.name}: loading",
            )
        s = st.history.get(name)
        if s is None or not len(s):
            return None, f"{self.name} has no {name} in {st.id}"
        return s, ""


def open_other(path: str) -> OtherRun:
    """The run in ``path`` (a directory, or ``ssh://host/dir``) to compare with; :class:`CompareError` naming
    the path if it is not a run (or, over SSH, why it cannot be reached)."""
    if path.startswith("ssh://"):
        import asyncio

        from console.ssh.commands import attach_transport

        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()  # inside the console: connecting here would block its screen
            raise CompareError(
                f"{path}: an ssh:// run is compared from the command line: aerie attach RUN --compare {path}"
            )

        t = attach_transport(path)  # says on stderr why not (unreachable host, no run there …)
        if isinstance(t, int):
            raise CompareError(f"{path}: cannot open that run over SSH (the reason is above)")
        return OtherRun(path, RunModel(t))
    p = Path(path).expanduser()
    if not p.is_dir():
        raise CompareError(f"{path}: no such directory (compare with a run directory)")
    if not RunDir(p).exists():
        raise CompareError(f"{path}: not a run directory (expected plan.toml and stages/ there)")
    return OtherRun(str(p.resolve()), RunModel(LocalTransport(str(p.resolve()))))


def name_runs(this_name: str, this_root: str, others: list[OtherRun]) -> str:
    """Labels that tell the runs apart: the run's name, with its directory when two runs share a name.

    Sets each other run's ``label`` and returns this run's."""
    names = [this_name or Path(this_root).name] + [o.model.run_name or Path(o.root).name for o in others]
    roots = [this_root, *(o.root for o in others)]
    labels = []
    for n, r in zip(names, roots, strict=True):
        tail = "/".join(Path(r).parts[-2:])
        labels.append(f"{n} ({tail})" if names.count(n) > 1 else n)
    for o, lab in zip(others, labels[1:], strict=True):
        o.label = lab
    return labels[0]
