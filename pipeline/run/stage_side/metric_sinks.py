"""Where a stage's metrics go besides its ``events.jsonl``: TensorBoard event files, and W&B if asked.

:class:`pipeline.run.stage_side.runtime.StageContext` hands every ``metric`` event to the sinks opened here, on
the executing host, so a run directory gets its TensorBoard files whether or not a console is
attached, and ``tensorboard --logdir RUN/tensorboard`` shows the curves the console draws:

* **TensorBoard** (the ``tensorboard`` package, in the ``pipeline`` extra): its own event-file writer
  (``tensorboard.summary.writer.event_file_writer.EventFileWriter``: protobuf records, a background
  flush every 10 s, closed at exit). Attempt 1 of stage ``S`` writes in ``RUN/tensorboard/S/``, attempt
  N in ``RUN/tensorboard/S/attempt-N/``, so TensorBoard shows a retried stage's attempts as runs side by
  side. The tag is the metric's name (``loss``, ``acc_0``…), with ``/label`` when the event carries a
  ``label`` (the benchmark's ``baseline`` / ``eagle3``). The step is the event's ``step`` (the
  training step); metrics without one (tokens/s of regeneration and extraction) count samples
  ``0, 1, 2…`` per tag, and TensorBoard's *relative* / *wall* axes plot them over time.
  Without the package the stage says so once (an ``info`` message) and writes nothing else.
* **W&B** (the ``wandb`` extra), only when the plan has a ``[wandb]`` section: ``project``
  (required), ``entity``, ``mode`` (``online`` | ``offline``, default ``offline``: files under
  ``RUN/wandb/``, ``wandb sync`` uploads them later), ``group`` (default: the run's name). One W&B run
  per stage attempt, named ``<stage>`` (``<stage>-attempt-N`` for retries).

A sink never fails a stage: an error disables it and is reported once as a ``warning`` message.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pipeline.run.plan.sections import WandbSection
from pipeline.run.rundir.files import private_dir

FLUSH_S = 10
Say = Callable[[str, str], None]  # (text, level)


class Sink(Protocol):
    def add(self, tag: str, value: float, step: int, wall_time: float) -> None: ...
    def close(self) -> None: ...


def tag_of(name: str, extra: dict[str, Any]) -> str:
    label = extra.get("label")
    return f"{name}/{label}" if isinstance(label, str) and label else name


def attempt_dir(root: Path, stage_id: str, attempt: int) -> Path:
    return root / stage_id if attempt <= 1 else root / stage_id / f"attempt-{attempt}"


class TensorBoardSink:
    """Scalars as TensorBoard event files, through TensorBoard's own writer."""

    def __init__(self, logdir: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        private_dir(logdir)  # 0700 (its event files are 0600: the stage runs under umask 077)
        self.logdir = logdir
        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(logdir), max_queue_size=100, flush_secs=FLUSH_S)

    def add(self, tag: str, value: float, step: int, wall_time: float) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value)])
        self._writer.add_event(self._event(wall_time=wall_time, step=step, summary=summary))

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One W&B run per stage attempt (offline by default: files under ``RUN/wandb``)."""

    def __init__(self, cfg: WandbSection, run_dir: Path, run_name: str, stage_id: str, attempt: int) -> None:
        import wandb

        self._wandb = wandb
        name = stage_id if attempt <= 1 else f"{stage_id}-attempt-{attempt}"
        private_dir(run_dir / "wandb")
        self.run = wandb.init(
            project=str(cfg.project),
            entity=cfg.entity,
            group=cfg.group or run_name,
            name=name,
            job_type=stage_id.split(".")[0],
            dir=str(run_dir),
            mode="online" if cfg.mode == "online" else "offline",
            reinit="create_new",
            config={"stage": stage_id, "attempt": attempt},
        )
        self.run.define_metric("*", step_metric="step")

    def add(self, tag: str, value: float, step: int, wall_time: float) -> None:
        self.run.log({tag: value, "step": step})

    def close(self) -> None:
        self.run.finish()


class MetricSinks:
    """The sinks of one stage attempt, opened on the first metric and closed at exit."""

    def __init__(
        self,
        run_dir: Path | None,
        stage_id: str,
        attempt: int,
        say: Say,
        wandb_cfg: Callable[[], WandbSection | None] = lambda: None,
        run_name: str = "",
    ) -> None:
        self.run_dir, self.stage_id, self.attempt = run_dir, stage_id, attempt
        self._say = say
        self._wandb_cfg = wandb_cfg
        self._run_name = run_name
        self._sinks: list[Sink] | None = None
        self._counts: dict[str, int] = {}

    def _open(self) -> list[Sink]:
        sinks: list[Sink] = []
        if self.run_dir is None:
            return sinks
        try:
            sinks.append(
                TensorBoardSink(attempt_dir(self.run_dir / "tensorboard", self.stage_id, self.attempt))
            )
        except ImportError:
            self._say(
                "tensorboard is not installed: no TensorBoard event files for this stage "
                "(pip install tensorboard)",
                "info",
            )
        except Exception as exc:  # a sink never fails a stage
            self._say(f"TensorBoard files disabled: {exc}", "warning")
        try:
            cfg = self._wandb_cfg()
        except Exception:
            cfg = None
        if cfg:
            try:
                sinks.append(WandbSink(cfg, self.run_dir, self._run_name, self.stage_id, self.attempt))
            except ImportError:
                self._say(
                    "the plan has [wandb] but wandb is not installed (pip install 'aerie[wandb]')", "warning"
                )
            except Exception as exc:
                self._say(f"W&B disabled: {exc}", "warning")
        atexit.register(self.close)
        return sinks

    def add(self, name: str, value: float, step: int | None, wall_time: float, extra: dict[str, Any]) -> None:
        if self._sinks is None:
            self._sinks = self._open()
        if not self._sinks:
            return
        tag = tag_of(name, extra)
        if step is None:
            step = self._counts.get(tag, 0)
            self._counts[tag] = step + 1
        for sink in list(self._sinks):
            try:
                sink.add(tag, value, int(step), wall_time)
            except Exception as exc:
                self._sinks.remove(sink)
                self._say(f"{type(sink).__name__} disabled: {exc}", "warning")

    def close(self) -> None:
        for sink in self._sinks or []:
            with contextlib.suppress(Exception):  # at exit: nothing left to tell
                sink.close()
        self._sinks = []
