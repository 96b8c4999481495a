"""The supervisor: schedules a run's stages from the files in its run directory.

``python -m pipeline.run.supervise.supervisor RUN`` runs on the executing host, detached from any console.
Each tick it derives every stage's state from the run directory (see :mod:`pipeline.run.rundir.layout`),
carries out queued control requests, enforces pause and kill grace periods, starts ready stages
whose resources are free, stops services nobody needs any more and writes ``state.json``.

Because state is *derived* from files the launchers wrote, a new supervisor started on an existing
run dir (after the old one was SIGKILLed, or on another day) re-attaches: running stages stay
running, finished ones keep their result, and nothing is started twice (a ``launch.json`` intent
is written before every spawn, and a launch whose launcher never reported is failed, not retried).
An ``flock`` on the run directory itself keeps one supervisor per run dir, whatever files are deleted
(:mod:`pipeline.run.supervise.liveness`).

It survives its own faults (:mod:`pipeline.run.supervise.faults`): a write that fails (read-only or immutable run
dir, ``EIO``, a full disk) or a corrupt per-stage file is logged, shown as an alert in ``state.json``
(``supervisor.alerts``) and retried with backoff; a corrupt file holds only its stage, and nothing raised
in one tick ends the loop.

How each stage's state is read from its files is :mod:`pipeline.run.supervise.stage_state`; this module
acts on those states.

Over 450 lines because it is one loop's decisions — admission, pause/kill grace, services, retries, and
what each of its faults holds back (a stage, a request, a write) — which share its state; setting a run up is :mod:`.run_setup`, reading states is :mod:`.stage_state`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from pipeline.run.alerts import watcher as alert_watcher
from pipeline.run.hosts.executor import Executor, make_executor
from pipeline.run.hosts.procs import CannotSignal, ProcIdentity
from pipeline.run.plan import dag as plan_mod
from pipeline.run.plan.dag import StageSpec
from pipeline.run.rundir import audit, growth
from pipeline.run.rundir.events import EventWriter
from pipeline.run.rundir.files import CorruptFileError
from pipeline.run.rundir.layout import RunDir, StageDir, read_json, write_atomic, write_json
from pipeline.run.rundir.stage_row import SATISFIED, TERMINAL, StageState
from pipeline.run.rundir.stage_status import StageStatus
from pipeline.run.rundir.state_file import SnapshotRow, StateSnapshot
from pipeline.run.supervise.faults import (
    STAGE_RECORDS,
    Backoff,
    Faults,
    GuardedRunDir,
    describe_os_error,
    rel,
    stage_file_problem,
)
from pipeline.run.supervise.force_text import CHECKS, force_message
from pipeline.run.supervise.liveness import HEARTBEAT_S, try_lock
from pipeline.run.supervise.run_setup import (
    ModelMissing,
    SupervisorError,
    check_model,
    create_run,
    spawn_detached,
    supervisor_alive,
)
from pipeline.run.supervise.stage_state import StateDeriver

AdmissionCheck = Callable[[StageSpec, "Supervisor"], "str | None"]
# What a damaged per-stage file raises while a stage is derived or acted on: it holds that stage only.
STAGE_FAULTS = (OSError, ValueError, TypeError, KeyError, AttributeError)


class Supervisor:
    def __init__(
        self,
        run: RunDir,
        python: str = sys.executable,
        poll_s: float = 0.5,
        admission: list[AdmissionCheck] | None = None,
    ) -> None:
        if not run.exists():
            raise SupervisorError(f"{run.root}: not a run directory (no plan.toml / stages/)")
        self.run: RunDir = GuardedRunDir(run.root, self._attempt_fallback)
        run = self.run
        self.python = python
        self.poll_s = poll_s
        self.log_fh: growth.RotatingLog | TextIO
        try:  # a run dir that cannot be written (read-only) is still supervised; the log goes to stderr
            self.log_fh = growth.RotatingLog(run.supervisor_log)  # 0600, reopened past its size limit
        except OSError:
            self.log_fh = sys.stderr
        self.faults = Faults(self.log)
        self.plan = plan_mod.load(run.plan_path, run_dir=run.root)
        self.specs: dict[str, StageSpec] = {}
        self._planned = {s.id: s for s in self.plan.stages}
        self._spec_damaged: set[str] = set()  # followed with the plan's definition, not started
        for sid in run.stage_ids():
            self.specs[sid] = self._spec(sid)
        self.order = list(self.specs)
        # Where attempts run: local process groups, or Slurm jobs (pipeline.run.hosts.executor).
        self.executor: Executor = make_executor(self.plan, run, self.specs, self.log, python)
        self.deriver = StateDeriver(run, self.specs, self.log, self.executor)
        self.status: dict[str, StageStatus] = {}
        self.admission: list[AdmissionCheck] = list(admission or [])
        self._last_written: str = ""
        self._last_write_t = 0.0
        self._identity_pending = False
        self._lock: tuple[int, int | None] | None = None
        self._refused: dict[str, str] = {}
        self._beside_logged: dict[
            str, str
        ] = {}  # why a stage is not started beside its last attempt, logged once
        self.state_backoff = Backoff()  # state.json after a failed write
        self.tick_backoff = Backoff()  # the whole tick after an unexpected error
        self._held_stages: set[str] = (
            set()
        )  # stages whose files are damaged: followed, never started or signalled
        self._guessed: dict[str, int] = {}  # stages read with a fallback attempt (attempt.json damaged)
        self._acted: dict[str, tuple[bool, str]] = {}  # requests acted on whose answer is not written yet
        # What keeps a tick O(stages + changes) (docs/performance.md, "The supervisor at scale"): only the
        # stages that can change are derived from their files each tick (:meth:`_to_derive`), the rest by a
        # slow sweep; the schedule pass runs when something changed; state.json is serialised when it did.
        self._due: set[str] = set(self.order)  # derive these at the next refresh (acted on, launched, new)
        self._keys: dict[str, tuple[Any, ...]] = {}  # what dependants see of a stage, as last derived
        self._dependants: dict[str, list[str]] = {s: [] for s in self.order}
        for sid, spec in self.specs.items():
            for dep in {*spec.after, *spec.uses}:
                self._dependants.setdefault(dep, []).append(sid)
        self._active: set[str] = set()  # running or paused when this tick's refresh began
        self._sweep_at = 0  # the next stage of the sweep (a file edited by hand is seen within a sweep)
        self._changed = True  # a row changed since state.json was last written
        self._sched_dirty = True  # something changed that the schedule pass must look at
        self._sched_full_t = 0.0  # last schedule pass over every waiting stage (admission checks re-run)
        self._next_retry_at: float | None = None
        self._held_now: tuple[int, set[int]] | None = None  # CPU/GPUs held, during one schedule pass
        self._write_s = 0.0  # how long serialising state.json last took
        # every alert rule, once per cycle, from the run's files (pipeline.run.alerts): no front end needed
        self.alerts = alert_watcher.for_plan(
            run, self.plan.settings.alerts, self.plan.executor.kind, self.log
        )

    # ----------------------------------------------------------------------------------- utils
    def log(self, text: str) -> None:
        with contextlib.suppress(OSError):  # a full disk loses log lines, never the supervisor
            self.log_fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")

    def acquire_lock(self) -> bool:
        """The run's lock: an flock on the run directory's own fd (nothing to delete from under us)."""
        self._lock = try_lock(self.run.root)
        if self._lock is None:
            return False
        self._write_identity()
        return True

    def _write_identity(self) -> None:
        """supervisor.json (who supervises this run: information, the lock is what counts); when it cannot be
        written, or someone deleted it, it is written again at the next tick."""
        try:
            # ``python``: the interpreter, so an ``ssh://`` attach of a run started on its host runs its agent alike
            write_json(
                self.run.supervisor_path,
                {**ProcIdentity.of_self().to_dict(), "t": time.time(), "python": sys.executable},
            )
            self._identity_pending = False
        except OSError as exc:
            self._identity_pending = True
            self.write_failed(exc, self.run.supervisor_path)

    # -------------------------------------------------------------------------------- faults
    def write_failed(self, exc: OSError, path: Path | str | None = None, stage: str | None = None) -> None:
        """A write that failed: an alert (one per directory), retried by whoever wrote."""
        where = Path(path) if path else Path(exc.filename) if isinstance(exc.filename, str) else self.run.root
        if where.name.startswith(".") and where.name.endswith(".partial"):  # write_atomic's temp file
            where = where.with_name(where.name[1:].rsplit(".", 2)[0])
        key = f"write:{where if where.is_dir() else where.parent}"
        self.faults.report(
            "write_failed",
            key,
            f"cannot write the run directory: {describe_os_error(exc, self.run.root)} "
            f"({rel(where, self.run.root)}); retrying with backoff",
            where,
            stage,
        )

    def _spec(self, sid: str) -> StageSpec:
        """A stage's spec.json. A deleted one is written again from the plan (it was made from it); a damaged
        one is left as it is, the plan's definition is used to follow the stage, and the stage is not started
        (its launcher reads spec.json) until the file is fixed or deleted."""
        path = self.run.stage(sid).spec
        try:
            raw = read_json(path)
            if raw is None and sid in self._planned:
                write_json(path, self._planned[sid].to_dict())
                return self._planned[sid]
            return StageSpec.from_dict(raw)
        except (ValueError, TypeError, KeyError, AttributeError, OSError) as exc:
            if sid not in self._planned:
                raise SupervisorError(
                    f"{path}: unreadable ({exc}) and the plan has no stage {sid!r}"
                ) from None
            self._spec_damaged.add(sid)
            self.faults.report(
                "corrupt_file",
                f"file:{sid}:spec.json",
                f"stages/{sid}/spec.json is unreadable ({exc}): {sid} is followed with the plan's definition "
                "but not started; fix the file, or delete it and Aerie writes it again from plan.toml",
                path,
                sid,
            )
            return self._planned[sid]

    def _recheck_specs(self) -> None:
        """A damaged spec.json that was fixed or deleted (then written again) frees its stage."""
        for sid in list(self._spec_damaged):
            self._spec_damaged.discard(sid)
            spec = self._spec(sid)
            if sid not in self._spec_damaged:
                self.specs[sid] = spec
                self._touched(sid)
                self.faults.resolve(f"file:{sid}:spec.json")

    def _attempt_fallback(self, sid: str, exc: Exception) -> int:
        """attempt.json is damaged: the attempt last known, else the highest any record of the stage names."""
        prev = self.status.get(sid) if hasattr(self, "status") else None
        n = self._guessed.get(sid) or (prev.attempt if prev else 0)
        if not n:
            sd = StageDir(self.run.stages_dir / sid, sid)
            for name in STAGE_RECORDS[1:-1]:
                try:
                    rec = read_json(sd.path / name)
                    a = rec.get("attempt") if isinstance(rec, dict) else None
                except (ValueError, OSError):
                    a = None
                if isinstance(a, int) and not isinstance(a, bool):
                    n = max(n, a)
        n = max(1, n)
        self._guessed[sid] = n
        path = self.run.stages_dir / sid / "attempt.json"
        why = (
            "is not valid JSON"
            if isinstance(exc, CorruptFileError)
            else f"has no whole attempt number ({exc})"
        )
        self.faults.report(
            "corrupt_file",
            f"file:{sid}:attempt.json",
            f"stages/{sid}/attempt.json {why}: treated as attempt {n}; {sid} is followed but not started "
            "or retried automatically until the file is fixed or deleted",
            path,
            sid,
        )
        return n

    def _stage_fault(self, sid: str, exc: BaseException, doing: str) -> None:
        """Something about one stage failed: hold that stage (its last known state stays), say which file."""
        if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError | IsADirectoryError):
            found = None if isinstance(exc.filename, str) else stage_file_problem(self.sd(sid).path)
            if found is None:
                self.write_failed(exc, None, sid)
                return
        else:
            found = stage_file_problem(self.sd(sid).path, exc)
        self._held_stages.add(sid)
        prev = self.status.get(sid)
        state = prev.state if prev else StageState.PENDING
        if found:
            path, what = found
            text = (
                f"{rel(path, self.run.root)} {what}: {sid} is held at its last known state ({state}); "
                "nothing is started or signalled for it, and control actions other than retry are refused, "
                "until the file is fixed or deleted"
            )
        else:
            path = self.sd(sid).path
            text = f"{sid}: {doing} failed ({type(exc).__name__}: {exc}); {sid} is held at its last known state ({state})"
        self.faults.report("corrupt_file", f"file:{sid}", text, path, sid)
        if prev is None:
            spec = self.specs[sid]
            prev = StageStatus(id=sid, family=spec.family, dataset=spec.dataset, service=spec.service)
        prev.reason = text
        self.status[sid] = prev
        self._changed = True

    def sd(self, sid: str) -> StageDir:
        return self.run.stage(sid)

    # ------------------------------------------------------------------------------ derivation
    def refresh(self) -> None:
        """Derive the stages that can have changed (:meth:`_to_derive`) from their files; a stage whose
        state changed has its dependants derived too (plan order is dependency-consistent, so each stage
        sees its deps' fresh state)."""
        self._recheck_specs()
        todo = self._to_derive()
        for sid in self.order:
            if sid not in todo:
                continue
            self._held_stages.discard(sid)
            self._guessed.pop(sid, None)
            prev = self.status.get(sid)
            try:
                new = self.status[sid] = self.deriver.derive(sid, self.status)
            except STAGE_FAULTS as exc:
                self._stage_fault(sid, exc, "reading its state")
                continue
            keys = [k for k in self.faults.open_keys("corrupt_file", sid) if not k.endswith(":spec.json")]
            if sid in self._guessed:
                new.reason = self.faults.alerts[f"file:{sid}:attempt.json"].text
            elif keys and stage_file_problem(self.sd(sid).path) is not None:
                self._held_stages.add(sid)  # a record read only when acting (kill.json…) is still damaged
                new.reason = self.faults.alerts[keys[-1]].text
            else:
                for key in keys:
                    self.faults.resolve(key)
            if prev is not None and self._refused.get(sid) == prev.reason and new.state == StageState.READY:
                # derived ready again, but the last schedule pass refused it: that answer stands until the next
                # pass (a change elsewhere, or ADMISSION_RECHECK_S), so a swept held stage dirties nothing
                new.state, new.reason = StageState.PENDING, prev.reason
            waits = new.state in (
                StageState.PENDING,
                StageState.READY,
            )  # the same to a dependant: not satisfied
            seen = (StageState.PENDING if waits else new.state, new.health, new.retry_at, new.attempt)
            if self._keys.get(sid) != seen:  # what its dependants wait on moved: derive them too
                self._keys[sid] = seen
                todo.update(self._dependants.get(sid, ()))
                self._sched_dirty = True
            if prev != new:
                self._changed = True
                if prev is None or prev.state != new.state:  # e.g. ready again once a damaged file is fixed
                    self._sched_dirty = True
        for sid in self._held_stages | set(self._guessed) | self._spec_damaged:  # what _blocked holds
            if sid in self.status and self.status[sid].state == StageState.READY:
                self.status[sid].state = StageState.PENDING
                self._changed = True

    SWEEP_PER_S = 100.0  # stages a second derived besides the active ones: hand edits are seen within a sweep

    def _to_derive(self) -> set[str]:
        """The stages whose files can have changed since the last refresh: the running and paused ones (their
        launchers write), those acted on or launched, those with a damaged file (re-read until fixed), plus
        the next slice of a sweep over every stage (a file edited by hand). A waiting or finished stage's
        files change only through this supervisor, so it is not read again each tick."""
        todo, self._due = self._due, set()
        todo |= self._held_stages | set(self._guessed) | self._spec_damaged
        self._active = {
            sid
            for sid, st in self.status.items()
            if st.state in (StageState.RUNNING, StageState.PAUSED) or st.pausing
        }
        todo |= self._active
        todo.update(s for s in self.order if s not in self.status)
        n = max(1, int(self.SWEEP_PER_S * max(self.poll_s, 0.05) + 0.999))
        if self.order:
            for i in range(min(n, len(self.order))):
                todo.add(self.order[(self._sweep_at + i) % len(self.order)])
            self._sweep_at = (self._sweep_at + n) % len(self.order)
        return todo

    def _blocked(self, sid: str) -> bool:
        """A stage with a damaged file is followed, but nothing is started or signalled for it."""
        return sid in self._held_stages or sid in self._guessed or sid in self._spec_damaged

    # ------------------------------------------------------------------------------- actions
    def do_pause(self, sid: str) -> str:
        self._touched(sid)
        st = self.status[sid]
        if st.state != StageState.RUNNING:
            raise SupervisorError(f"{sid} is {st.state}, not running: nothing to pause")
        write_json(self.sd(sid).pause_flag, {"attempt": st.attempt, "t": time.time()})
        return (
            f"{sid}: pause requested (safe point, then {self.executor.freeze_how} after "
            f"{self.specs[sid].pause_grace_s:g}s)"
        )

    def do_resume(self, sid: str) -> str:
        self._touched(sid)
        sd = self.sd(sid)
        st = self.status[sid]
        if not sd.pause_flag.exists() and st.state != StageState.PAUSED:
            raise SupervisorError(f"{sid} is {st.state}, not paused")
        flag = read_json(sd.pause_flag) or {}
        sd.pause_flag.unlink(missing_ok=True)
        self.executor.thaw(sid, frozen=bool(flag.get("stopped")))
        return f"{sid}: resumed"

    def do_kill(self, sid: str, reason: str = "operator") -> str:
        self._touched(sid)
        st = self.status[sid]
        if st.state not in (StageState.RUNNING, StageState.PAUSED):
            raise SupervisorError(f"{sid} is {st.state}, not running: nothing to kill")
        sd = self.sd(sid)
        write_json(sd.kill_marker, {"attempt": st.attempt, "t": time.time(), "reason": reason})
        flag = read_json(sd.pause_flag) or {}
        sd.pause_flag.unlink(missing_ok=True)
        try:
            return self.executor.terminate(sid, frozen=bool(flag.get("stopped")), reason=reason)
        except CannotSignal as exc:  # nothing was signalled: refused (non-zero exit), no kill pending
            sd.kill_marker.unlink(missing_ok=True)
            raise SupervisorError(str(exc)) from None

    def do_retry(self, sid: str, fresh: bool = False) -> str:
        self._touched(sid)
        st = self.status[sid]
        if st.state not in (
            StageState.FAILED,
            StageState.KILLED,
            StageState.UPSTREAM_FAILED,
            StageState.SKIPPED,
        ):
            msg = f"{sid} is {st.state}: only failed, killed or skipped stages can be retried"
            if st.state in (StageState.RUNNING, StageState.PAUSED) and st.reason:
                msg += f" ({st.reason}); {self._kill_first(sid)}"
            raise SupervisorError(msg)
        if st.state == StageState.UPSTREAM_FAILED:
            raise SupervisorError(f"{sid} is upstream-failed ({st.reason}): retry the failed upstream stage")
        self._refuse_beside_survivors(sid, "retry")
        sd = self.sd(sid)
        if fresh:
            sd.clear_outputs(self.run)
        sd.pause_flag.unlink(missing_ok=True)
        write_json(sd.attempt_file, {"attempt": st.attempt + 1, "t": time.time(), "fresh": fresh})
        return f"{sid}: attempt {st.attempt + 1} queued" + (" (outputs cleared)" if fresh else "")

    def do_skip(self, sid: str) -> str:
        self._touched(sid)
        st = self.status[sid]
        if st.state not in (
            StageState.PENDING,
            StageState.READY,
            StageState.UPSTREAM_FAILED,
            StageState.FAILED,
            StageState.KILLED,
        ):
            raise SupervisorError(f"{sid} is {st.state}: only a stage that is not running can be skipped")
        self._refuse_beside_survivors(sid, "skip")
        sd = self.sd(sid)
        att = st.attempt + (1 if st.state in (StageState.FAILED, StageState.KILLED) else 0)
        write_json(sd.attempt_file, {"attempt": att, "t": time.time()})
        write_json(sd.path / "skip.json", {"attempt": att, "t": time.time()})
        return f"{sid}: skipped"

    def _touched(self, sid: str) -> None:
        """An action on ``sid``: derived again at the next refresh, and the next schedule pass looks."""
        self._due.add(sid)
        self._changed = self._sched_dirty = True

    def _log_once(self, sid: str, text: str) -> None:
        if self._beside_logged.get(sid) != text:
            self._beside_logged[sid] = text
            self.log(f"{sid}: {text}")

    def _kill_first(self, sid: str) -> str:
        return f"kill it first (aerie kill {self.run.root} {sid})"

    def _refuse_beside_survivors(self, sid: str, action: str) -> None:
        """A stage never runs twice: no retry, skip or launch while a process of its last attempt lives."""
        left = self.executor.survivors(sid)
        if left:
            raise SupervisorError(f"cannot {action} {sid}: {left}; {self._kill_first(sid)}")

    def do_force(self, sid: str) -> str:
        """Let a stage past the admission checks (disk budget, GPU guard) once, recorded in its events."""
        self._touched(sid)
        st = self.status[sid]
        if st.state not in (StageState.PENDING, StageState.READY):
            raise SupervisorError(f"{sid} is {st.state}: --force applies to a stage waiting to start")
        write_json(self.sd(sid).force_marker, {"attempt": st.attempt, "t": time.time()})
        # Say what it will do and when: a forced stage still waits for its dependencies, services and slots.
        spec = self.specs[sid]
        waiting = [
            (d, str(ds.state) if ds else "unknown")
            for d in spec.after
            if (ds := self.status.get(d)) is None or ds.state not in SATISFIED
        ]
        reason = st.reason or ""
        if st.state == StageState.READY:  # forced now, so only CPU/GPU slots can still hold it
            reason = self.why_not_admitted(spec) or self._refused.get(sid, "")
        return force_message(sid, st.attempt, waiting, reason)

    def do_unforce(self, sid: str) -> str:
        """Disarm a ``force`` armed for the stage's current attempt (``aerie force --cancel``): it waits for the
        admission checks again. Refused when none is armed, or when the stage has started (the override is used)."""
        st = self.status[sid]
        if not self.forced(sid):
            raise SupervisorError(f"{sid}: no --force is armed for attempt {st.attempt}")
        if st.state not in (StageState.PENDING, StageState.READY):
            raise SupervisorError(f"{sid} is {st.state}: its --force was used when it started")
        self.sd(sid).force_marker.unlink(missing_ok=True)
        return f"{sid}: --force disarmed for attempt {st.attempt}; it waits for {CHECKS} again"

    def forced(self, sid: str) -> bool:
        sd = self.sd(sid)
        return sd.record_for(sd.force_marker, sd.attempt()) is not None

    def handle_requests(self) -> int:
        """Act on queued control requests. A write that fails leaves the request queued (its action is not
        repeated when only its answer could not be written); the rest of the tick goes on."""
        try:
            return self._handle_requests()
        except OSError as exc:  # the requests directory itself cannot be read
            self.write_failed(exc, self.run.requests_dir)
            return 0

    def _handle_requests(self) -> int:
        done_dir = self.run.requests_dir / "done"
        handled = 0
        for path, req in self.run.pending_requests():
            handled += 1
            if not isinstance(req, dict):
                req = {"action": "?", "stage": "?"}
            sid, action = str(req.get("stage", "")), str(req.get("action", ""))
            if path.name in self._acted:  # acted on already; only its answer could not be written
                ok, msg = self._acted[path.name]
            else:
                try:
                    ok, msg = self._act(sid, action, req)
                except OSError as exc:  # nothing answered: the request stays queued and is tried again
                    self.write_failed(exc, None, sid if sid in self.specs else None)
                    return handled
                self._acted[path.name] = (ok, msg)
                self.log(f"request {action} {sid}: {'ok' if ok else 'refused'}: {msg}")
            try:
                # the audit line before `done`: a crash in between may repeat it, never lose it
                audit.record_request(self.run.root, req, ok, msg)
                write_json(done_dir / path.name, {**req, "ok": ok, "message": msg, "done_t": time.time()})
                path.unlink(missing_ok=True)
            except OSError as exc:  # answered on a later tick, without acting again
                self.write_failed(exc, done_dir / path.name)
                return handled
            self._acted.pop(path.name, None)
        return handled

    def _act(self, sid: str, action: str, req: dict[str, Any]) -> tuple[bool, str]:
        """Carry out one control request: (ok, message). A write that fails raises OSError (not answered)."""
        ok, msg = True, ""
        try:
            if sid not in self.specs:
                raise SupervisorError(f"unknown stage {sid!r}")
            if action != "retry" and sid in self._held_stages:
                raise SupervisorError(self.status[sid].reason)
            fn = {
                "pause": self.do_pause,
                "resume": self.do_resume,
                "kill": self.do_kill,
                "skip": self.do_skip,
                "force": self.do_force,
                "unforce": self.do_unforce,
            }.get(action)
            if action == "retry":
                msg = self.do_retry(sid, fresh=bool(req.get("fresh")))
            elif fn is not None:
                msg = fn(sid)
            else:
                raise SupervisorError(f"unknown action {action!r}")
            self.status[sid] = self.deriver.derive(sid, self.status)
            self._due.add(sid)  # its dependants see the change at the next refresh
            self._changed = self._sched_dirty = True
        except SupervisorError as exc:
            ok, msg = False, str(exc)
        except OSError:
            raise
        except STAGE_FAULTS as exc:  # a damaged file of this stage: refused, naming it
            found = stage_file_problem(self.sd(sid).path, exc) if sid in self.specs else None
            where = f"{rel(found[0], self.run.root)} {found[1]}" if found else f"{type(exc).__name__}: {exc}"
            ok, msg = False, f"{sid}: cannot {action}: {where}; fix or delete the file"
        return ok, msg

    # ---------------------------------------------------------------------------- scheduling
    def _held(self) -> tuple[int, set[int]]:
        cpu, gpus = 0, set[int]()
        if not self.executor.uses_local_slots:  # e.g. Slurm schedules CPUs and GPUs on its nodes
            return cpu, gpus
        for sid, st in self.status.items():
            if st.state in (StageState.RUNNING, StageState.PAUSED):
                cpu += self.specs[sid].cpu
                gpus |= set(self.specs[sid].gpus)
        return cpu, gpus

    def why_not_admitted(self, spec: StageSpec) -> str | None:
        cpu, gpus = self._held_now if self._held_now is not None else self._held()
        if self.executor.uses_local_slots and cpu + spec.cpu > self.plan.cpu_slots:
            return f"waiting for CPU slots ({cpu}/{self.plan.cpu_slots} in use)"
        busy = gpus & set(spec.gpus)
        if busy:
            holders = [
                s
                for s, st in self.status.items()
                if st.state in (StageState.RUNNING, StageState.PAUSED) and set(self.specs[s].gpus) & busy
            ]
            return f"waiting for GPUs {sorted(busy)} (held by {', '.join(holders)})"
        if self.forced(spec.id):
            return None
        for check in self.admission:
            why = check(spec, self)
            if why:
                return why
        return None

    def launch(self, sid: str) -> str | None:
        """Start the stage's current attempt; returns why not when processes of an earlier one still run
        (defence in depth: retry and skip refuse then already)."""
        sd = self.sd(sid)
        attempt = sd.attempt()
        try:
            self._refuse_beside_survivors(sid, f"start attempt {attempt} of")
        except SupervisorError as exc:
            self._log_once(sid, str(exc))
            return str(exc)
        sd.pause_flag.unlink(missing_ok=True)
        write_json(
            sd.launch,
            {
                "attempt": attempt,
                "t": time.time(),
                "supervisor": os.getpid(),
                "stage": self.specs[sid].launch_fields(),
            },
        )
        self.executor.launch(sid, attempt)
        if self.forced(sid):
            with EventWriter(sd.events) as w:
                w.emit(
                    "message",
                    level="warning",
                    code="forced",
                    attempt=attempt,
                    text="started with --force: admission checks (disk budget, GPU guard) overridden",
                )
        return None

    ADMISSION_RECHECK_S = 5.0  # a full schedule pass at least this often: admission checks read the host

    def schedule(self) -> int:
        """Start what is ready and admitted, in plan order. A pass over every waiting stage runs only when
        something changed (a state, a request, a launch), a retry is due, or the admission checks are due
        again; else the refusals stand as they are (10,000 stages held by two slots cost nothing)."""
        now = time.time()
        due_retry = self._next_retry_at is not None and now >= self._next_retry_at
        if not (self._sched_dirty or due_retry or now - self._sched_full_t >= self.ADMISSION_RECHECK_S):
            return 0
        self._sched_dirty, self._sched_full_t, self._next_retry_at = False, now, None
        launched = 0
        refused_before, self._refused = self._refused, {}
        self._held_now = self._held()
        try:
            for sid in self.order:
                st = self.status.get(sid)
                if st is None or self._blocked(sid):
                    continue
                if st.state == StageState.PENDING and refused_before.get(sid) == st.reason:
                    st.state = StageState.READY  # what it was derived as: ready, waiting for admission
                if st.state != StageState.READY and st.retry_at is None:
                    continue
                try:
                    launched += self._schedule_one(sid, now)
                except STAGE_FAULTS as exc:  # this stage waits (a failed write is retried next tick)
                    self._stage_fault(sid, exc, "starting it")
        finally:
            self._held_now = None
        return launched

    def _schedule_one(self, sid: str, now: float) -> int:
        st = self.status[sid]
        if st.state == StageState.FAILED and st.retry_at is not None and now < st.retry_at:
            self._next_retry_at = min(self._next_retry_at or st.retry_at, st.retry_at)
        if st.state == StageState.FAILED and st.retry_at is not None and now >= st.retry_at:
            self.log(
                f"{sid}: automatic retry (attempt {st.attempt + 1} of {self.specs[sid].retry.max_attempts})"
            )
            try:
                self.do_retry(sid)
            except SupervisorError as exc:  # processes of the failed attempt still run
                self._log_once(sid, f"automatic retry postponed: {exc}")
                return 0
            self.status[sid] = self.deriver.derive(sid, self.status)
            self._due.add(sid)
            self._changed = True
            st = self.status[sid]
        if st.state != StageState.READY:
            return 0
        why = self.why_not_admitted(self.specs[sid])
        if not why:
            why = self.launch(sid)  # None when started; why not, beside a live earlier attempt
        if why:
            if st.reason != why:
                self._changed = True
            st.state, st.reason = StageState.PENDING, why
            self._refused[sid] = why
            return 0
        self.status[sid] = self.deriver.derive(sid, self.status)
        self._due.add(sid)
        self._changed = self._sched_dirty = True
        if self._held_now is not None and self.executor.uses_local_slots:  # what it holds from now on
            spec = self.specs[sid]
            self._held_now = (self._held_now[0] + spec.cpu, self._held_now[1] | set(spec.gpus))
        return 1

    def enforce(self) -> None:
        """Pause and kill grace periods; stop services nobody needs any more."""
        now = time.time()
        for sid in [s for s in self.order if s in self._active]:  # running or paused as this tick began
            st = self.status[sid]
            if self._blocked(sid) or st.state not in (StageState.RUNNING, StageState.PAUSED):
                continue  # grace periods and services concern a running or paused attempt only
            try:
                self._enforce_one(sid, now)
            except STAGE_FAULTS as exc:
                self._stage_fault(sid, exc, "enforcing its pause or kill")
        self.executor.poll()

    def _enforce_one(self, sid: str, now: float) -> None:
        st = self.status[sid]
        sd = self.sd(sid)
        spec = self.specs[sid]
        if st.pausing:
            self._freeze(sid, st.attempt, now)
        killed = sd.record_for(sd.kill_marker, st.attempt)
        if (
            killed
            and st.state in (StageState.RUNNING, StageState.PAUSED)
            and not killed.get("sigkill")
            and now - float(killed["t"]) > spec.kill_grace_s
        ):
            self.log(f"{sid}: still running after {spec.kill_grace_s:g}s: {self.executor.kill(sid)}")
            write_json(sd.kill_marker, {**killed, "sigkill": now})
        if (
            spec.service
            and st.state in (StageState.RUNNING, StageState.PAUSED)
            and not killed
            and self._service_idle(sid)
        ):
            self.do_kill(sid, reason="stop")
            self.log(f"{sid}: service no longer needed: stopping it")

    def _freeze(self, sid: str, attempt: int, now: float) -> None:
        """A stage that reached no safe point within its grace: freeze it where it is (SIGSTOP to its group,
        ``scontrol suspend`` of its job), or say why that cannot be done."""
        sd, spec = self.sd(sid), self.specs[sid]
        flag = read_json(sd.pause_flag) or {}
        if (
            now - float(flag.get("t", now)) <= spec.pause_grace_s
            or flag.get("stopped")
            or flag.get("cannot_freeze")
        ):
            return
        why = self.executor.freeze(sid)
        if why is None:
            write_json(sd.pause_flag, {**flag, "stopped": now})
            self.log(f"{sid}: no safe point within {spec.pause_grace_s:g}s: {self.executor.freeze_how}")
            return
        text = f"cannot freeze this stage: {why}; it pauses at its next safe point, or kill it"
        write_json(sd.pause_flag, {**flag, "cannot_freeze": text})
        with EventWriter(sd.events) as w:
            w.emit("message", level="warning", code="cannot_freeze", attempt=attempt, text=text)
        self.log(f"{sid}: {text}")

    def _service_idle(self, sid: str) -> bool:
        users = [s for s in self.order if sid in self.specs[s].uses]
        waiting_after = [s for s in self.order if sid in self.specs[s].after]
        others = [s for s in self.order if not self.specs[s].service]
        if users:
            return all(self.status[u].state in TERMINAL for u in users)
        if waiting_after:
            return True
        return bool(others) and all(self.status[o].state in TERMINAL for o in others)

    # ---------------------------------------------------------------------------------- loop
    def snapshot(self) -> dict[str, Any]:
        # the typed, versioned snapshot (pipeline.run.rundir.state_file): each row with its display state
        return StateSnapshot(
            run=self.plan.name,
            run_dir=str(self.run.root),
            executor=self.plan.executor.kind,
            supervisor={"pid": os.getpid(), "t": time.time(), "alerts": self.faults.section()},
            stages=[SnapshotRow(self.status[s], self.status[s].progress) for s in self.order],
            done=self.finished(),
        ).to_dict()

    def write_state(self, force: bool = False, now_or_never: bool = False) -> bool:
        """state.json when something changed, and at least every HEARTBEAT_S (its ``supervisor.t`` is the
        heartbeat front ends judge). A failed write keeps the previous state.json whole (atomic rename), raises
        an alert and is retried with backoff; the first write that succeeds carries the alert. True when
        state.json holds the current snapshot."""
        now = time.time()
        if not now_or_never and not self.state_backoff.ready(now):
            return False
        alerts = repr([(a["code"], a["text"], a["resolved"]) for a in self.faults.section()])
        changed = self._changed or alerts != self._last_written
        # A huge run's changes are written at most every 10 serialisations' time (60 ms at 10,000 stages).
        soon = now - self._last_write_t < min(1.0, 10 * self._write_s)
        # the heartbeat is checked once a tick: one poll early, so no two snapshots are more than HEARTBEAT_S apart
        beat = now - self._last_write_t >= HEARTBEAT_S - self.poll_s
        if force or beat or (changed and not soon):
            t0 = time.monotonic()
            try:
                snap = self.snapshot()
                write_atomic(self.run.state_path, json.dumps(snap, separators=(",", ":")) + "\n")
            except OSError as exc:
                self.state_backoff.failed(now)
                self.write_failed(exc, self.run.state_path)
                return False
            self._write_s = time.monotonic() - t0
            self.state_backoff.ok()
            self._last_written, self._last_write_t, self._changed = alerts, now, False
            self._resolve_writes()
        return True

    def _resolve_writes(self) -> None:
        """state.json was written: end the write alerts of every directory that is writable again."""
        for key in self.faults.open_keys("write_failed"):
            where = Path(key.split(":", 1)[1])
            if os.access(where if where.is_dir() else self.run.root, os.W_OK):
                self.faults.resolve(key)

    def finished(self) -> bool:
        return all(st.state in TERMINAL and st.retry_at is None for st in self.status.values())

    def tick(self) -> None:
        if self._identity_pending or not self.run.supervisor_path.exists():
            self._write_identity()  # deleted under us: information only, but written again
        self.refresh()
        acted = self.handle_requests()
        self.enforce()
        launched = self.schedule()
        if acted or launched:
            self.refresh()  # dependants of what just changed see it in this snapshot
            for sid, why in self._refused.items():
                if self.status[sid].state == StageState.READY:  # keep showing why it is not admitted
                    self.status[sid].state, self.status[sid].reason = StageState.PENDING, why
                    self._sched_dirty = True
        self._watch_alerts()  # before state.json: whoever sees a stage failed finds its alert recorded
        self.write_state()  # stage logs rotate in their own writers (pipeline.run.stage_side.log_writer)

    def _watch_alerts(self) -> None:
        """The alert rules' cycle (pipeline.run.alerts.watcher); its faults are said, never end the tick."""
        try:
            self.alerts.tick(dict(self.status), time.time())
            self.faults.resolve("alerts")
        except Exception as exc:  # noqa: BLE001 - a rule's bug must not stop supervision
            self.faults.report("tick_failed", "alerts", f"alert rules failed ({type(exc).__name__}: {exc})")

    def run_forever(self, exit_when_done: bool = True) -> int:
        if not self.acquire_lock():
            print(f"a supervisor is already running for {self.run.root}", file=sys.stderr)
            return 0
        self.log(f"supervisor {os.getpid()} attached to {self.run.root}")
        stop = False

        def _stop(*_: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        while not stop:
            try:
                self.tick()
            except Exception as exc:  # nothing in one tick ends supervision: said, then tried again
                self._tick_failed(exc)
                time.sleep(max(self.poll_s, self.tick_backoff.failed(time.time())))
                continue
            self.tick_backoff.ok()
            self.faults.resolve("tick")
            # A finished run's supervisor exits once its last snapshot is on disk (not while it cannot be).
            if exit_when_done and self.finished() and not self._pending() and self.write_state(force=True):
                self.log("every stage is finished: supervisor exits")
                break
            time.sleep(self.poll_s)
        self.write_state(force=True, now_or_never=True)
        self.alerts.close()  # the hooks still running: bounded by their timeout
        return 0

    def _pending(self) -> bool:
        try:
            return any(True for _ in self.run.pending_requests())
        except OSError:
            return True

    def _tick_failed(self, exc: Exception) -> None:
        """An error no narrower handler took: an alert, the traceback in the log (rate-limited with it)."""
        if isinstance(exc, OSError):
            self.write_failed(exc)
            return
        first = "tick" not in self.faults.open_keys("tick_failed")
        self.faults.report(
            "tick_failed",
            "tick",
            f"supervisor error ({type(exc).__name__}: {exc}); retrying with backoff; see supervisor.log",
        )
        if first:
            self.log("".join(traceback.format_exception(exc)).rstrip())


def default_admission() -> list[AdmissionCheck]:
    """Admission checks every supervisor applies besides CPU/GPU slots (extended by later modules)."""
    from pipeline.run.supervise.budget import disk_budget_check, gpu_guard_check

    return [disk_budget_check, gpu_guard_check]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.run.supervise.supervisor", description=__doc__.split("\n")[0]
    )
    ap.add_argument("run", nargs="?", help="run directory")
    ap.add_argument("--create", metavar="PLAN", help="create the run directory from PLAN first")
    ap.add_argument("--detach", action="store_true", help="start in the background and return")
    ap.add_argument("--poll", type=float, default=0.5)
    args = ap.parse_args(argv)
    os.umask(0o077)  # everything the supervisor creates (lock, state, requests/done) is 0600/0700
    try:
        if args.create:
            plan = plan_mod.load(args.create, run_dir=args.run)
            check_model(plan)
            run = create_run(plan, Path(args.run) if args.run else None)
        elif args.run:
            run = RunDir(args.run)
        else:
            ap.error("give a run directory or --create PLAN")
        if args.detach:
            if not supervisor_alive(run):
                spawn_detached(run.root)
            print(run.root)
            return 0
        return Supervisor(run, poll_s=args.poll, admission=default_admission()).run_forever()
    except (plan_mod.PlanError, SupervisorError, ModelMissing) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
