"""The stage side of the run model: what a running stage uses to report and to honour pauses.

A built-in stage does::

    ctx = StageContext.from_cli(args)        # or StageContext.from_env()
    for batch in work:
        ctx.safe_point()                      # blocks here while a pause is requested
        ...
        ctx.progress(done, total, unit="rows")
    ctx.metric("loss", 1.23, step=10)

Under the supervisor the launcher sets ``AERIE_*`` variables (run dir, stage id, attempt, out dir,
inputs); run by hand (``python -m pipeline.stages.prep --plan P --dataset D --out DIR``) events go to a
file in the out dir and a short form to stderr, so every stage is also a plain program.
Under a run, metrics also go to ``RUN/tensorboard/<stage>/`` (and W&B when the plan asks), see
:mod:`pipeline.run.stage_side.metric_sinks`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from pipeline.run.hosts import nospace
from pipeline.run.plan import dag as plan_mod
from pipeline.run.plan.builtin_models import ModelAssetError
from pipeline.run.plan.sections import WandbSection
from pipeline.run.rundir.events import EventWriter, make
from pipeline.run.rundir.layout import RunDir
from pipeline.run.rundir.stage_row import HealthState
from pipeline.run.stage_side.env_names import (  # re-exported: stages and tests import them from here
    ENV_ATTEMPT,
    ENV_INPUTS,
    ENV_OUT,
    ENV_PLAN,
    ENV_RUN,
    ENV_STAGE,
)
from pipeline.run.stage_side.metric_sinks import MetricSinks


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The arguments every built-in stage accepts."""
    ap.add_argument("--plan", type=Path, default=os.environ.get(ENV_PLAN), help="plan file")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: the stage's out/)")
    ap.add_argument("--stage", default=os.environ.get(ENV_STAGE), help="stage id (set by the launcher)")


class StageContext:
    """Events, pause handling and paths for one running stage."""

    def __init__(
        self,
        stage_id: str,
        out: Path,
        events_path: Path,
        plan_path: Path | None,
        run_dir: Path | None = None,
        attempt: int = 1,
        inputs: dict[str, Path] | None = None,
        echo: bool = False,
    ) -> None:
        self.stage_id = stage_id
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.plan_path = plan_path
        self.run_dir = run_dir
        self.attempt = attempt
        self.inputs = inputs or {}
        self.events_path = events_path
        self._writer = EventWriter(events_path)
        self._echo = echo
        self._pause_flag = RunDir(run_dir).stage(stage_id).pause_flag if run_dir else None
        self._last_progress = 0.0
        self._plan: plan_mod.Plan | None = None
        # Under torchrun every rank runs the stage; rank 0 alone speaks for it (no duplicate events,
        # one writer of the TensorBoard/W&B files).
        self.quiet = int(os.environ.get("RANK", "0") or 0) != 0
        self._sinks = MetricSinks(
            None if self.quiet else run_dir,
            stage_id,
            attempt,
            lambda text, level: self.message(text, level=level),
            wandb_cfg=self._wandb_cfg,
            run_name=run_dir.name if run_dir else "",
        )
        _install_nospace_hook(self)

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_env(
        cls, out: Path | None = None, plan_path: Path | None = None, stage_id: str | None = None
    ) -> StageContext:
        run = os.environ.get(ENV_RUN)
        sid = stage_id or os.environ.get(ENV_STAGE) or "standalone"
        if run:
            sd = RunDir(run).stage(sid)
            inputs = {k: Path(v) for k, v in json.loads(os.environ.get(ENV_INPUTS, "{}")).items()}
            return cls(
                sid,
                Path(os.environ.get(ENV_OUT, sd.out)),
                sd.events,
                plan_path or Path(os.environ.get(ENV_PLAN, RunDir(run).plan_path)),
                Path(run),
                int(os.environ.get(ENV_ATTEMPT, "1")),
                inputs,
            )
        if out is None:
            raise SystemExit("not under the supervisor: pass --out DIR for the stage's outputs")
        return cls(sid, out, out / "events.jsonl", plan_path, echo=True)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> StageContext:
        return cls.from_env(out=args.out, plan_path=args.plan, stage_id=args.stage)

    @property
    def plan(self) -> plan_mod.Plan:
        if self._plan is None:
            if self.plan_path is None:
                raise SystemExit("no plan: pass --plan PLAN")
            self._plan = plan_mod.load(self.plan_path, run_dir=self.run_dir)
        return self._plan

    def _wandb_cfg(self) -> WandbSection | None:
        """The plan's ``[wandb]`` section, if there is a plan and it has one."""
        if self.plan_path is None:
            return None
        try:
            return self.plan.settings.wandb
        except plan_mod.PlanError:
            return None

    # -- events -----------------------------------------------------------------------------
    def emit(self, type_: str, **data: Any) -> None:
        if self.quiet:
            return
        ev = make(type_, **data)
        self._writer.write(ev)
        if self._echo:
            print(f"[{self.stage_id}] {ev.to_json()}", file=sys.stderr, flush=True)

    def progress(
        self,
        done: float,
        total: float | None = None,
        unit: str = "items",
        key: str | None = None,
        force: bool = False,
        **extra: Any,
    ) -> None:
        """Report progress; rate-limited to ~4/s unless ``force`` (always force the last one)."""
        now = time.monotonic()
        if not force and now - self._last_progress < 0.25 and (total is None or done < total):
            return
        self._last_progress = now
        self.emit("progress", done=done, total=total, unit=unit, key=key, **extra)

    def metric(self, name: str, value: float, step: int | None = None, **extra: Any) -> None:
        """A numeric metric: an event, and a point in the run's TensorBoard (and W&B) files."""
        if self.quiet:
            return
        ev = make("metric", name=name, value=float(value), step=step, **extra)
        self._writer.write(ev)
        if self._echo:
            print(f"[{self.stage_id}] {ev.to_json()}", file=sys.stderr, flush=True)
        self._sinks.add(name, float(value), step, ev.t, extra)

    def message(self, text: str, level: str = "info", code: str | None = None, **extra: Any) -> None:
        self.emit("message", text=text, level=level, code=code, **extra)

    def health(self, state: HealthState, **extra: Any) -> None:
        self.emit("health", state=state, **extra)

    # -- pause ------------------------------------------------------------------------------
    def pause_requested(self) -> bool:
        return self._pause_flag is not None and self._pause_flag.exists()

    def safe_point(self, poll_s: float = 0.2) -> None:
        """Call between units of work: blocks while a pause is requested, announcing it once."""
        if not self.pause_requested():
            return
        self.message("paused at a safe point", code="paused")
        while self.pause_requested():
            time.sleep(poll_s)
        self.message("resumed", code="resumed")

    def close(self) -> None:
        self._sinks.close()
        self._writer.close()


def _install_nospace_hook(ctx: StageContext) -> None:
    """A stage that dies of a full disk says which disk, as its last words (whatever stage it is).

    Installed by every :class:`StageContext`: an uncaught ``ENOSPC``/``EDQUOT`` (also one pyarrow or
    torch re-raised with the text only) becomes an ``error`` message event naming the device, and an
    ``error: no space left on device ...`` line in the stage's log, before the usual traceback. Both
    are best effort — the disk is full — and the launcher names the device in ``exit.json`` too.

    A target the stage cannot load for a reason a plan key decides (:class:`ModelAssetError`: custom code
    without ``target.trust_remote_code``, a model type transformers does not know, a tiktoken tokenizer
    without ``tiktoken``) ends the same way: its message as the stage's ``error`` event and log line."""
    global _NOSPACE_CTX
    first = _NOSPACE_CTX is None
    _NOSPACE_CTX = (
        ctx  # the latest context speaks (a stage may make more than one): one message, not one each
    )
    if not first:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        c = _NOSPACE_CTX
        text, code = "", ""
        if c is not None and nospace.is_nospace(exc):
            text, code = f"{nospace.describe(c.out)}: {exc}", "nospace"
        elif c is not None and isinstance(exc, ModelAssetError):  # names the plan key that decides it
            text, code = str(exc), "model"
        if c is not None and text:
            with contextlib.suppress(OSError), EventWriter(c.events_path) as w:  # the stage may have closed c
                w.emit("message", text=text, level="error", code=code)
            with contextlib.suppress(OSError):
                print(f"error: {text}", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            previous(kind, exc, tb)

    sys.excepthook = hook


_NOSPACE_CTX: StageContext | None = None


def fail(ctx: StageContext | None, text: str, code: int = 1) -> NoReturn:
    """Stop the stage with a clear error (an ``error`` message event, then exit ``code``)."""
    if ctx is not None:
        ctx.message(text, level="error")
    print(f"error: {text}", file=sys.stderr, flush=True)
    raise SystemExit(code)
