"""The supervisor: schedules a run's stages from the files in its run directory.

``python -m pipeline.run.supervisor RUN`` runs on the executing host, detached from any console.
Each tick it derives every stage's state from the run directory (see :mod:`pipeline.run.rundir`),
carries out queued control requests, enforces pause and kill grace periods, starts ready stages
whose resources are free, stops services nobody needs any more and writes ``state.json``.

Because state is *derived* from files the launchers wrote, a new supervisor started on an existing
run dir (after the old one was SIGKILLed, or on another day) re-attaches: running stages stay
running, finished ones keep their result, and nothing is started twice (a ``launch.json`` intent
is written before every spawn, and a launch whose launcher never reported is failed, not retried).
An ``flock`` on ``supervisor.lock`` keeps one supervisor per run dir.

How each stage's state is read from its files is :mod:`pipeline.run.stage_state`; this module
acts on those states.

Over 450 lines because it is one loop's decisions — admission, pause/kill grace, services, retries —
which share its state; setting a run up is :mod:`.run_setup`, reading states is :mod:`.stage_state`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.run import audit, growth, nospace
from pipeline.run import plan as plan_mod
from pipeline.run.events import EventWriter
from pipeline.run.executor import Executor, make_executor
from pipeline.run.force_text import force_message
from pipeline.run.plan import StageSpec
from pipeline.run.procs import ProcIdentity
from pipeline.run.run_setup import (
    ModelMissing,
    SupervisorError,
    check_model,
    create_run,
    spawn_detached,
    supervisor_alive,
)
from pipeline.run.rundir import RunDir, StageDir, read_json, write_json
from pipeline.run.stage_row import SATISFIED, TERMINAL, StageState
from pipeline.run.stage_state import StateDeriver
from pipeline.run.stage_status import StageStatus

AdmissionCheck = Callable[[StageSpec, "Supervisor"], "str | None"]


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
        self.run = run
        self.python = python
        self.poll_s = poll_s
        self.plan = plan_mod.load(run.plan_path, run_dir=run.root)
        self.specs: dict[str, StageSpec] = {}
        for sid in run.stage_ids():
            self.specs[sid] = StageSpec.from_dict(read_json(run.stage(sid).spec))
        self.order = list(self.specs)
        self.log_fh = growth.RotatingLog(run.supervisor_log)  # 0600, reopened past its size limit
        # Where attempts run: local process groups, or Slurm jobs (pipeline.run.executor).
        self.executor: Executor = make_executor(self.plan, run, self.specs, self.log, python)
        self.deriver = StateDeriver(run, self.specs, self.log, self.executor)
        self.status: dict[str, StageStatus] = {}
        self.admission: list[AdmissionCheck] = list(admission or [])
        self._last_written: str = ""
        self._last_write_t = 0.0
        self._nospace_logged = 0.0
        self._identity_pending = False
        self._lock_fd: int | None = None
        self._refused: dict[str, str] = {}
        self._beside_logged: dict[
            str, str
        ] = {}  # why a stage is not started beside its last attempt, logged once
        # copy-truncate any stage.log past its limit (pipeline.run.growth)
        self.log_rotator = growth.LogRotator(lambda: ((s, self.sd(s).log) for s in self.order), self.log)

    # ----------------------------------------------------------------------------------- utils
    def log(self, text: str) -> None:
        with contextlib.suppress(OSError):  # a full disk loses log lines, never the supervisor
            self.log_fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")

    def acquire_lock(self) -> bool:
        fd = os.open(self.run.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        self._write_identity()
        return True

    def _write_identity(self) -> None:
        """supervisor.json (who supervises this run); on a full disk, again at each tick until it is written."""
        try:
            write_json(self.run.supervisor_path, {**ProcIdentity.of_self().to_dict(), "t": time.time()})
            self._identity_pending = False
        except OSError as exc:
            if not nospace.is_nospace(exc):
                raise
            self._identity_pending = True

    def sd(self, sid: str) -> StageDir:
        return self.run.stage(sid)

    # ------------------------------------------------------------------------------ derivation
    def refresh(self) -> None:
        # Plan order is dependency-consistent, so each stage sees its deps' fresh state.
        for sid in self.order:
            self.status[sid] = self.deriver.derive(sid, self.status)

    # ------------------------------------------------------------------------------- actions
    def do_pause(self, sid: str) -> str:
        st = self.status[sid]
        if st.state != StageState.RUNNING:
            raise SupervisorError(f"{sid} is {st.state}, not running: nothing to pause")
        write_json(self.sd(sid).pause_flag, {"attempt": st.attempt, "t": time.time()})
        return (
            f"{sid}: pause requested (safe point, then {self.executor.freeze_how} after "
            f"{self.specs[sid].pause_grace_s:g}s)"
        )

    def do_resume(self, sid: str) -> str:
        sd = self.sd(sid)
        st = self.status[sid]
        if not sd.pause_flag.exists() and st.state != StageState.PAUSED:
            raise SupervisorError(f"{sid} is {st.state}, not paused")
        flag = read_json(sd.pause_flag) or {}
        sd.pause_flag.unlink(missing_ok=True)
        self.executor.thaw(sid, frozen=bool(flag.get("stopped")))
        return f"{sid}: resumed"

    def do_kill(self, sid: str, reason: str = "operator") -> str:
        st = self.status[sid]
        if st.state not in (StageState.RUNNING, StageState.PAUSED):
            raise SupervisorError(f"{sid} is {st.state}, not running: nothing to kill")
        sd = self.sd(sid)
        write_json(sd.kill_marker, {"attempt": st.attempt, "t": time.time(), "reason": reason})
        flag = read_json(sd.pause_flag) or {}
        sd.pause_flag.unlink(missing_ok=True)
        return self.executor.terminate(sid, frozen=bool(flag.get("stopped")), reason=reason)

    def do_retry(self, sid: str, fresh: bool = False) -> str:
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

    def forced(self, sid: str) -> bool:
        sd = self.sd(sid)
        return sd.record_for(sd.force_marker, sd.attempt()) is not None

    def handle_requests(self) -> int:
        done_dir = self.run.requests_dir / "done"
        handled = 0
        for path, req in self.run.pending_requests():
            handled += 1
            sid, action = req.get("stage", ""), req.get("action", "")
            ok, msg = True, ""
            try:
                if sid not in self.specs:
                    raise SupervisorError(f"unknown stage {sid!r}")
                fn = {
                    "pause": self.do_pause,
                    "resume": self.do_resume,
                    "kill": self.do_kill,
                    "skip": self.do_skip,
                    "force": self.do_force,
                }.get(action)
                if action == "retry":
                    msg = self.do_retry(sid, fresh=bool(req.get("fresh")))
                elif fn is not None:
                    msg = fn(sid)
                else:
                    raise SupervisorError(f"unknown action {action!r}")
                self.status[sid] = self.deriver.derive(sid, self.status)
            except SupervisorError as exc:
                ok, msg = False, str(exc)
            self.log(f"request {action} {sid}: {'ok' if ok else 'refused'}: {msg}")
            # the audit line before `done`: a crash in between may repeat it, never lose it
            audit.record_request(self.run.root, req, ok, msg)
            write_json(done_dir / path.name, {**req, "ok": ok, "message": msg, "done_t": time.time()})
            path.unlink(missing_ok=True)
        return handled

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
        cpu, gpus = self._held()
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
        write_json(sd.launch, {"attempt": attempt, "t": time.time(), "supervisor": os.getpid()})
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

    def schedule(self) -> int:
        now = time.time()
        launched = 0
        self._refused = {}
        for sid in self.order:
            st = self.status[sid]
            if st.state == StageState.FAILED and st.retry_at is not None and now >= st.retry_at:
                self.log(
                    f"{sid}: automatic retry (attempt {st.attempt + 1} of {self.specs[sid].retry.max_attempts})"
                )
                try:
                    self.do_retry(sid)
                except SupervisorError as exc:  # processes of the failed attempt still run
                    self._log_once(sid, f"automatic retry postponed: {exc}")
                    continue
                self.status[sid] = self.deriver.derive(sid, self.status)
                st = self.status[sid]
            if st.state != StageState.READY:
                continue
            why = self.why_not_admitted(self.specs[sid])
            if why:
                st.state, st.reason = StageState.PENDING, why
                self._refused[sid] = why
                continue
            why = self.launch(sid)
            if why:
                st.state, st.reason = StageState.PENDING, why
                self._refused[sid] = why
                continue
            launched += 1
            self.status[sid] = self.deriver.derive(sid, self.status)
        return launched

    def enforce(self) -> None:
        """Pause and kill grace periods; stop services nobody needs any more."""
        now = time.time()
        for sid, st in self.status.items():
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
        self.executor.poll()

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
        return {
            "run": self.plan.name,
            "run_dir": str(self.run.root),
            "executor": self.plan.executor.kind,
            "supervisor": {"pid": os.getpid(), "t": time.time()},
            "stages": [asdict(self.status[s]) for s in self.order],
            "done": self.finished(),
        }

    def write_state(self, force: bool = False) -> None:
        snap = self.snapshot()
        body = repr(snap["stages"])
        now = time.time()
        if force or body != self._last_written or now - self._last_write_t > 5.0:
            try:
                write_json(self.run.state_path, snap)
            except OSError as exc:
                if not nospace.is_nospace(exc):
                    raise
                # A full disk: readers keep the previous state.json, whole (atomic rename); next tick retries.
                return
            self._last_written, self._last_write_t = body, now

    def finished(self) -> bool:
        return all(st.state in TERMINAL and st.retry_at is None for st in self.status.values())

    def tick(self) -> None:
        if self._identity_pending:
            self._write_identity()
        self.refresh()
        acted = self.handle_requests()
        self.enforce()
        launched = self.schedule()
        if acted or launched:
            self.refresh()  # dependants of what just changed see it in this snapshot
            for sid, why in self._refused.items():
                if self.status[sid].state == StageState.READY:  # keep showing why it is not admitted
                    self.status[sid].state, self.status[sid].reason = StageState.PENDING, why
        self.write_state()
        self.log_rotator.tick()

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
            except OSError as exc:
                if not nospace.is_nospace(exc):
                    raise
                # A full disk: every file we write is atomic (temp + rename) or whole-line, so nothing is
                # torn; keep supervising and try again next tick (the stages' own errors say which disk).
                now = time.time()
                if now - self._nospace_logged > 60:
                    self._nospace_logged = now
                    with contextlib.suppress(OSError):
                        self.log(
                            f"cannot write the run directory: {nospace.describe(self.run.root)}; retrying"
                        )
                time.sleep(self.poll_s)
                continue
            if exit_when_done and self.finished() and not any(True for _ in self.run.pending_requests()):
                self.write_state(force=True)
                self.log("every stage is finished: supervisor exits")
                break
            time.sleep(self.poll_s)
        self.write_state(force=True)
        return 0


def default_admission() -> list[AdmissionCheck]:
    """Admission checks every supervisor applies besides CPU/GPU slots (extended by later modules)."""
    from pipeline.run.budget import disk_budget_check, gpu_guard_check

    return [disk_budget_check, gpu_guard_check]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.run.supervisor", description=__doc__.split("\n")[0])
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
