"""The local executor: each attempt is a launcher process group on this host, and what left it.

The launcher (:mod:`pipeline.run.stage_side.launcher`) is started in a new session, so it leads a process group
of its own, and records its pid, pgid, kernel start time and attempt token in ``proc.json``. The
attempt's processes are that group plus every process carrying the token that left it
(:func:`pipeline.run.hosts.procs.attempt_members`); every signal goes to them and only them
(:func:`pipeline.run.hosts.procs.signal_attempt`): pause is SIGSTOP, resume SIGCONT, kill SIGTERM then SIGKILL.

**A launcher that dies alone** (``kill -9`` of its pid, an OOM kill of just it) leaves the stage running
under init. Such an attempt is *re-adopted*, as pueue owns the group it spawned: it stays running, with
the reason "launcher lost: following its N processes (pgid X)", pause/resume/kill act on all of them,
and when the last one has ended the attempt is recorded failed ("launcher was killed; the stage's
processes ended, exit status unknown"), so its retry policy applies. Re-adopting, not killing, because
the stage itself is fine — it may be day 3 of a training — and only its bookkeeper is gone; killing it
would turn a lost exit code into lost work, and the operator can always kill it.

**Processes left behind by an ended attempt** (the launcher recorded its exit, but something the stage
started still runs, e.g. a ``setsid`` server) are stopped as systemd stops a unit's cgroup: SIGTERM,
SIGKILL after the stage's ``kill_grace_s``; until they are gone the stage shows running ("exited …;
stopping the N processes it left running"), so neither its dependants nor its next attempt start
beside them (:meth:`LocalProcesses.survivors` is the guard the supervisor checks before a launch).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pipeline.run.hosts.procs import (
    ENV_RUN_MARK,
    ENV_STAGE_MARK,
    ENV_TOKEN,
    CannotSignal,
    ProcIdentity,
    ProcStat,
    ProcTable,
    StrangerError,
    attempt_members,
    boot_id,
    describe_members,
    describe_pids,
    env_with_pipeline,
    process_table,
    signal_attempt,
    signal_processes,
    stage_processes,
)
from pipeline.run.plan.dag import StageSpec
from pipeline.run.rundir.files import open_private_append
from pipeline.run.rundir.layout import RunDir, StageDir, read_json
from pipeline.run.rundir.stage_row import DisplayState, StageState
from pipeline.run.rundir.stage_status import StageStatus, finish, record_lost

# The launcher and the log writer run as scripts, by path (``pipeline`` itself comes from ``PYTHONPATH``, as
# ``env_with_pipeline`` sets it): ``-m`` first imports ``runpy`` and ``importlib.util``, ~4 ms of CPU each a launch
# (bench/launch_cost.py; docs/performance.md, "Launches"). Neither's folder holds a name of the standard library.
LAUNCHER_SCRIPT = str(Path(__file__).resolve().parent.parent / "stage_side" / "launcher.py")
LOG_WRITER_SCRIPT = str(Path(__file__).resolve().parent.parent / "stage_side" / "log_writer.py")
LAUNCH_TIMEOUT_S = 30.0  # a launch intent whose launcher never wrote proc.json (no child to ask) is lost
LAUNCH_THREADS = 4  # launches forking at once (each waits for its child's exec)
TABLE_TTL_S = 0.3  # one process table serves the stages derived within this long (one tick)
LOST_LAUNCHER = "launcher was killed; the stage's processes ended, exit status unknown"
REBOOTED = "the host restarted during the attempt (a new boot): exit status unknown"


@dataclass
class Leftovers:
    """Processes an ended attempt left running, and how far stopping them has gone."""

    attempt: int
    seen: float  # monotonic time they were first seen
    termed: bool = False
    killed: bool = False


class LocalProcesses:
    """Starts, follows and signals the process trees of one run's stages' attempts."""

    kind = "local"
    uses_local_slots = True
    freeze_how = "SIGSTOP"

    def __init__(
        self,
        run: RunDir,
        specs: dict[str, StageSpec],
        log: Callable[[str], None],
        python: str = sys.executable,
    ) -> None:
        self.run = run
        self.specs = specs
        self.log = log
        self.python = python
        self.children: dict[str, subprocess.Popen] = {}  # launchers this supervisor started, until reaped
        self.log_writers: list[subprocess.Popen] = []  # their stage log writers, until reaped
        self._pool: ThreadPoolExecutor | None = None  # where launches fork (LAUNCH_THREADS)
        self._spawning: dict[str, tuple[int, Future[tuple[subprocess.Popen, subprocess.Popen]]]] = {}
        self._table: tuple[float, float, ProcTable] | None = None  # (monotonic, wall time, table)
        self._ended: set[tuple[str, int, int, int]] = set()  # (sid, attempt, pid, start): no process left
        self._leftovers: dict[str, Leftovers] = {}
        self._adopted: set[tuple[str, int]] = set()  # attempts whose launcher was lost, said once in the log

    # ------------------------------------------------------------------------------ identity
    def identity(self, sid: str) -> ProcIdentity | None:
        sd = self.run.stage(sid)
        proc = sd.record_for(sd.proc, sd.attempt())
        return ProcIdentity.from_dict(proc) if proc else None

    def table(self, fresh: bool = False) -> ProcTable:
        """The host's process table, shared by the stages derived in one tick (one pass over /proc)."""
        now = time.monotonic()
        if fresh or self._table is None or now - self._table[0] > TABLE_TTL_S:
            self._table = (now, time.time(), process_table())
        return self._table[2]

    def members(self, ident: ProcIdentity, since: float, fresh: bool = False) -> list[ProcStat]:
        """The attempt's live processes, from a table taken after ``since`` (wall time: the attempt's
        launcher had started by then, so a table that shows none of them is final)."""
        self.table(fresh)
        assert self._table is not None
        if self._table[1] < since:
            self.table(fresh=True)
        return attempt_members(ident, self._table[2])

    def _signal(self, sid: str, sig: int) -> list[int]:
        ident = self.identity(sid)
        if ident is None:  # proc.json damaged or gone: the processes marked as the stage's, one by one
            return signal_processes(stage_processes(self.run.root, sid, self.table(fresh=True)), sig)
        try:
            return signal_attempt(ident, sig, self.table(fresh=True))
        except StrangerError as exc:
            self.log(f"{sid}: {exc}")
            return []

    def _pgid(self, sid: str) -> int | None:
        ident = self.identity(sid)
        return ident.pgid if ident else None

    def survivors(self, sid: str) -> str | None:
        """Processes of the stage's last started attempt that still run, said for the operator (None: none).

        Reads ``proc.json`` whatever attempt it is for: the supervisor asks before it starts another one."""
        sd = self.run.stage(sid)
        proc = read_json(sd.proc)
        if not proc or "pid" not in proc:
            return self._unrecorded(sid)
        ident = ProcIdentity.from_dict(proc)
        attempt = int(proc.get("attempt", 0))
        if (sid, attempt, ident.pid, ident.start_time) in self._ended:
            return None
        left = attempt_members(ident, self.table(fresh=True))
        if not left:
            return None
        return f"attempt {attempt} of {sid} still has {describe_members(ident, left)}"

    def _unrecorded(self, sid: str) -> str | None:
        """No ``proc.json``: processes of the stage found by the marks in their environment, said for the
        operator (None: none, or the stage was never launched)."""
        sd = self.run.stage(sid)
        if not (sd.launch.exists() or sd.log.exists() or sd.events.exists()):
            return None  # never launched: nothing to look for
        found = stage_processes(self.run.root, sid, self.table(fresh=True))
        if not found:
            return None
        return f"{sid} still has {self._marked(found)}"

    @staticmethod
    def _marked(found: list[ProcStat]) -> str:
        n = len(found)
        return (
            f"{n} process{'es' if n != 1 else ''} with no record (proc.json missing; found by the run and "
            f"stage marked in their environment: {describe_pids([m.pid for m in found])})"
        )

    # -------------------------------------------------------------------------------- launch
    def launch(self, sid: str, attempt: int) -> None:
        """Start the attempt's launcher, its stdout and stderr a pipe to a log writer of its own
        (:mod:`pipeline.run.stage_side.log_writer`): the stage's output never passes through this process,
        and rotating ``stage.log`` is the writer's job, by rename. The two ``fork``+``exec``s run on a small
        pool of threads (:data:`LAUNCH_THREADS`): on a loaded host each waits ~50 ms for its child to be
        scheduled, and the loop does not wait with it; the stage shows "starting" meanwhile."""
        sd = self.run.stage(sid)
        env = env_with_pipeline()
        env.pop(ENV_TOKEN, None)  # the launcher marks its own attempt; it belongs to no other
        # The run and stage in the launcher's environment (and so in every process the stage starts): its
        # processes are found by them even when proc.json is damaged or gone (procs.stage_processes).
        marked = {**env, ENV_RUN_MARK: str(self.run.root), ENV_STAGE_MARK: sid}
        self.children.pop(sid, None)  # an earlier attempt's launcher, already ended (reaped by Popen)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(LAUNCH_THREADS, thread_name_prefix="aerie-launch")
        self._spawning[sid] = (attempt, self._pool.submit(self._spawn, sd, attempt, env, marked))

    def _spawn(
        self, sd: StageDir, attempt: int, env: dict[str, str], marked: dict[str, str]
    ) -> tuple[subprocess.Popen, subprocess.Popen]:
        """The log writer, then the launcher writing into its pipe (on a pool thread)."""
        read_end, write_end = os.pipe()
        try:
            with open_private_append(sd.log) as errfh:  # the writer's own traceback, if it ever fails
                writer = subprocess.Popen(
                    [self.python, "-S", LOG_WRITER_SCRIPT, str(sd.log)],  # -S: stdlib only
                    stdin=read_end,
                    stdout=subprocess.DEVNULL,
                    stderr=errfh,
                    start_new_session=True,  # outside the attempt's group: a kill never stops it first
                    cwd=str(self.run.root),
                    env=env,
                )
            child = subprocess.Popen(
                # -S: stdlib only (its stage starts with site); a launch costs ~30 ms less
                [self.python, "-S", LAUNCHER_SCRIPT, str(self.run.root), sd.id, str(attempt)],
                stdin=subprocess.DEVNULL,
                stdout=write_end,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=str(self.run.root),
                env=marked,
            )
        finally:
            os.close(read_end)
            os.close(write_end)
        return writer, child

    def _spawned(self) -> None:
        """Take the launches the pool finished: their launchers to follow, or why one could not start."""
        for sid, (attempt, fut) in list(self._spawning.items()):
            if not fut.done():
                continue
            del self._spawning[sid]
            try:
                writer, child = fut.result()
            except OSError as exc:  # no launcher: the attempt is recorded failed, its retry policy applies
                record_lost(self.run.stage(sid), attempt, f"cannot start its launcher: {exc}", self.log)
                continue
            self.log_writers.append(writer)
            self.children[sid] = child
            self.log(f"{sid}: launched attempt {attempt} (launcher pid {child.pid})")

    # -------------------------------------------------------------------------------- derive
    def derive(self, st: StageStatus, sd: StageDir, attempt: int, acked: bool) -> StageStatus | None:
        if self._spawning:
            self._spawned()
        proc = sd.record_for(sd.proc, attempt)
        if proc:
            ident = ProcIdentity.from_dict(proc)
            st.pid, st.pgid, st.started_at = ident.pid, ident.pgid, proc.get("t")
            ex = sd.record_for(sd.exit, attempt)
            if ident.is_alive() and ex is None:
                self._running(st, sd, acked, stopped=ident.is_stopped())
                return st
            key = (sd.id, attempt, ident.pid, ident.start_time)
            if key not in self._ended:
                followed = self._follow(st, sd, attempt, ident, ex, acked, float(proc.get("t", 0)))
                if followed is not None:
                    return followed
                self._ended.add(key)
                self._leftovers.pop(sd.id, None)
            if ex is None:
                rebooted = ident.boot_id and ident.boot_id != boot_id()
                ex = record_lost(sd, attempt, REBOOTED if rebooted else LOST_LAUNCHER, self.log)
            return finish(st, sd, ex, attempt, self.specs[sd.id])
        launch = sd.record_for(sd.launch, attempt)
        if not launch:
            return None
        ex = sd.record_for(sd.exit, attempt)
        if ex:
            return finish(st, sd, ex, attempt, self.specs[sd.id])
        child = None if sd.id in self._spawning else self.children.get(sd.id)  # forking: not yet known
        if (
            child is None
            and sd.id not in self._spawning
            and sd.record_for(sd.kill_marker, attempt)
            and not stage_processes(self.run.root, sd.id, self.table())
        ):
            # Killed while starting, no launcher of this supervisor's coming (a supervisor that died between
            # the intent and the fork left it) and no process of the stage: no launch timeout to wait out.
            ex = record_lost(sd, attempt, "killed before its launcher started", self.log)
            return finish(st, sd, ex, attempt, self.specs[sd.id])
        age = time.time() - float(launch.get("t", 0))
        if (child is not None and child.poll() is not None) or (child is None and age > LAUNCH_TIMEOUT_S):
            found = stage_processes(self.run.root, sd.id, self.table())
            if found:  # proc.json lost under a live attempt: followed, never counted lost (nor retried)
                self._running(st, sd, acked, stopped=all(m.state in ("T", "t") for m in found))
                st.reason = f"following {self._marked(found)}"
                return st
            ex = record_lost(sd, attempt, "the launcher never reported its pid", self.log)
            return finish(st, sd, ex, attempt, self.specs[sd.id])
        st.state, st.reason, st.display = StageState.RUNNING, "starting", DisplayState.STARTING
        return st

    @staticmethod
    def _running(st: StageStatus, sd: StageDir, acked: bool, stopped: bool) -> None:
        pause = sd.pause_flag.exists()
        st.state = StageState.PAUSED if pause and (acked or stopped) else StageState.RUNNING
        st.pausing = pause and st.state == StageState.RUNNING

    def _follow(
        self,
        st: StageStatus,
        sd: StageDir,
        attempt: int,
        ident: ProcIdentity,
        ex: dict | None,
        acked: bool,
        since: float,
    ) -> StageStatus | None:
        """An attempt whose launcher is gone or has recorded its exit, while processes of it may live:
        the stage's state while they do, None once none is left (a fresh look confirms it first)."""
        cached = self.members(ident, since)
        if not cached:
            return None  # no process of it at all, in a table taken after it started: none ever again
        left = [m for m in cached if m.pid != ident.pid]
        if ex is not None or not left:
            # What would be acted on (processes left behind, an exit recorded on the stage's behalf) is
            # confirmed by a fresh look, taken after the exit record or the launcher's death was seen: the
            # shared table may predate the stage's last forks and exits. After either, only processes
            # other than the launcher can start new ones.
            left = [m for m in self.members(ident, since, fresh=True) if m.pid != ident.pid]
        if not left:
            return None
        what = describe_members(ident, left)
        if ex is None:  # re-adopted: the stage runs on without its launcher
            self._running(st, sd, acked, stopped=all(m.state in ("T", "t") for m in left))
            st.reason = f"launcher lost: following its {what}"
            if (sd.id, attempt) not in self._adopted:
                self._adopted.add((sd.id, attempt))
                self.log(
                    f"{sd.id}: attempt {attempt}: the launcher (pid {ident.pid}) died; following its {what}"
                )
            return st
        # Ended, but something it started still runs: stop it (poll), and show the stage running until then.
        lo = self._leftovers.get(sd.id)
        if lo is None or lo.attempt != attempt:
            self._leftovers[sd.id] = Leftovers(attempt, time.monotonic())
            self.log(
                f"{sd.id}: attempt {attempt} ended (exit {ex.get('returncode')}) but left {what} running"
            )
        st.state = StageState.RUNNING
        st.pausing = False
        st.reason = f"exited ({ex.get('returncode')}); stopping the {what} it left running"
        return st

    # ------------------------------------------------------------------------------- control
    def freeze(self, sid: str) -> str | None:
        reached = self._signal(sid, signal.SIGSTOP)
        self.log(f"{sid}: SIGSTOP to pgid {self._pgid(sid)} ({len(reached)} processes)")
        return None

    def thaw(self, sid: str, frozen: bool) -> None:
        self._signal(sid, signal.SIGCONT)  # whatever the record says: a stopped group must not stay stopped

    def terminate(self, sid: str, frozen: bool, reason: str) -> str:
        pgid = self._pgid(sid)
        reached = self._signal(sid, signal.SIGTERM)
        if pgid is None:
            self._signal(sid, signal.SIGCONT)
            if not reached and self._launching(sid):
                # Between the launch intent and the launcher's proc.json: the launcher reads the kill marker
                # before it starts the stage, and an intent no launcher will take up is recorded killed.
                self.log(
                    f"{sid}: kill before its launcher reported ({reason}): the stage will not be started"
                )
                return f"{sid}: killed while starting; the stage will not be started"
            if not reached:
                raise CannotSignal(
                    f"cannot kill {sid}: its proc.json is missing and no process marked as its own was found"
                )
            grace = self.specs[sid].kill_grace_s
            what = f"SIGTERM sent to {len(reached)} process{'es' if len(reached) != 1 else ''}"
            self.log(f"{sid}: {what} found by their marks ({describe_pids(reached)}; {reason})")
            return f"{sid}: {what} found by their marks (proc.json missing; {describe_pids(reached)}); SIGKILL after {grace:g}s"
        self._signal(sid, signal.SIGCONT)  # a stopped process must run to act on SIGTERM
        outside = self._outside(sid, reached)
        self.log(f"{sid}: SIGTERM to pgid {pgid}{outside} ({reason})")
        grace = self.specs[sid].kill_grace_s
        return f"{sid}: SIGTERM sent to process group {pgid}{outside}; SIGKILL after {grace:g}s"

    def _launching(self, sid: str) -> bool:
        """The stage's current attempt has its launch intent and no exit yet (``terminate`` found no proc.json
        after it wrote the kill marker, so a launcher still to report reads the marker: proc.json is not read
        again here, since one written since then belongs to a launcher that will see the marker)."""
        sd = self.run.stage(sid)
        attempt = sd.attempt()
        return bool(sd.record_for(sd.launch, attempt) and not sd.record_for(sd.exit, attempt))

    def kill(self, sid: str) -> str:
        reached = self._signal(sid, signal.SIGKILL)
        if self._pgid(sid) is None:
            return f"SIGKILL to {len(reached)} processes found by their marks"
        return f"SIGKILL to pgid {self._pgid(sid)}{self._outside(sid, reached)}"

    def _outside(self, sid: str, reached: list[int]) -> str:
        """' and 2 processes that left it (pids …)' for the members reached outside the recorded group."""
        pgid = self._pgid(sid)
        table = {st.pid: st for st, _ in self.table().procs}
        out = [p for p in reached if p in table and table[p].pgid != pgid]
        if not out:
            return ""
        n = len(out)
        return f" and {n} process{'es' if n != 1 else ''} that left it ({describe_pids(out)})"

    def poll(self) -> None:
        self._spawned()
        for sid, child in list(self.children.items()):
            if child.poll() is not None:
                del self.children[sid]
        self.log_writers = [w for w in self.log_writers if w.poll() is None]
        self._stop_leftovers()

    def _stop_leftovers(self) -> None:
        """SIGTERM what an ended attempt left running, SIGKILL after the stage's kill grace."""
        for sid, lo in list(self._leftovers.items()):
            sd = self.run.stage(sid)
            proc = sd.record_for(sd.proc, lo.attempt)
            if proc is None:
                del self._leftovers[sid]
                continue
            ident = ProcIdentity.from_dict(proc)
            grace = self.specs[sid].kill_grace_s
            try:
                if not lo.termed:
                    lo.termed = True
                    pids = signal_attempt(ident, signal.SIGTERM, self.table(fresh=True))
                    signal_attempt(ident, signal.SIGCONT, self.table())
                    if pids:
                        self.log(
                            f"{sid}: SIGTERM to the {len(pids)} processes attempt {lo.attempt} left running"
                        )
                elif not lo.killed and time.monotonic() - lo.seen > grace:
                    lo.killed = True
                    pids = signal_attempt(ident, signal.SIGKILL, self.table(fresh=True))
                    if pids:
                        self.log(f"{sid}: still running after {grace:g}s: SIGKILL to {len(pids)} processes")
            except StrangerError as exc:
                self.log(f"{sid}: {exc}")
                del self._leftovers[sid]
