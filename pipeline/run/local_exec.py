"""The local executor: each attempt is a launcher process group on this host.

The launcher (:mod:`pipeline.run.launcher`) is started in a new session, so it leads a process group
of its own, and records its pid, pgid and kernel start time in ``proc.json``. Every signal goes to
that recorded group and only while the recorded leader is still the same process
(:func:`pipeline.run.procs.signal_group`): pause is SIGSTOP, resume SIGCONT, kill SIGTERM then SIGKILL.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable

from pipeline.run.files import open_private_append
from pipeline.run.plan import StageSpec
from pipeline.run.procs import ProcIdentity, StrangerError, env_with_pipeline, signal_group
from pipeline.run.rundir import RunDir, StageDir
from pipeline.run.stage_row import StageState
from pipeline.run.stage_status import StageStatus, finish, record_lost

LAUNCH_TIMEOUT_S = 30.0  # a launch intent whose launcher never wrote proc.json (no child to ask) is lost


class LocalProcesses:
    """Starts, follows and signals the launcher process groups of one run's stages."""

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

    # ------------------------------------------------------------------------------ identity
    def identity(self, sid: str) -> ProcIdentity | None:
        sd = self.run.stage(sid)
        proc = sd.record_for(sd.proc, sd.attempt())
        return ProcIdentity.from_dict(proc) if proc else None

    def _signal(self, sid: str, sig: int) -> bool:
        ident = self.identity(sid)
        if ident is None:
            return False
        try:
            return signal_group(ident, sig)
        except StrangerError as exc:
            self.log(f"{sid}: {exc}")
            return False

    def _pgid(self, sid: str) -> int | None:
        ident = self.identity(sid)
        return ident.pgid if ident else None

    # -------------------------------------------------------------------------------- launch
    def launch(self, sid: str, attempt: int) -> None:
        sd = self.run.stage(sid)
        logfh = open_private_append(sd.log)  # 0600 whatever the umask
        try:
            child = subprocess.Popen(
                [self.python, "-m", "pipeline.run.launcher", str(self.run.root), sid, str(attempt)],
                stdin=subprocess.DEVNULL,
                stdout=logfh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=str(self.run.root),
                env=env_with_pipeline(),
            )
        finally:
            logfh.close()
        self.children[sid] = child
        self.log(f"{sid}: launched attempt {attempt} (launcher pid {child.pid})")

    # -------------------------------------------------------------------------------- derive
    def derive(self, st: StageStatus, sd: StageDir, attempt: int, acked: bool) -> StageStatus | None:
        proc = sd.record_for(sd.proc, attempt)
        if proc:
            ident = ProcIdentity.from_dict(proc)
            st.pid, st.pgid, st.started_at = ident.pid, ident.pgid, proc.get("t")
            ex = sd.record_for(sd.exit, attempt)
            if ident.is_alive() and ex is None:
                pause = sd.pause_flag.exists()
                st.state = (
                    StageState.PAUSED if pause and (acked or ident.is_stopped()) else StageState.RUNNING
                )
                st.pausing = pause and st.state == StageState.RUNNING
                return st
            if ex is None:
                ex = record_lost(sd, attempt, "the stage's launcher died without recording an exit", self.log)
            return finish(st, sd, ex, attempt, self.specs[sd.id])
        launch = sd.record_for(sd.launch, attempt)
        if not launch:
            return None
        ex = sd.record_for(sd.exit, attempt)
        if ex:
            return finish(st, sd, ex, attempt, self.specs[sd.id])
        child = self.children.get(sd.id)
        age = time.time() - float(launch.get("t", 0))
        if (child is not None and child.poll() is not None) or (child is None and age > LAUNCH_TIMEOUT_S):
            ex = record_lost(sd, attempt, "the launcher never reported its pid", self.log)
            return finish(st, sd, ex, attempt, self.specs[sd.id])
        st.state, st.reason = StageState.RUNNING, "starting"
        return st

    # ------------------------------------------------------------------------------- control
    def freeze(self, sid: str) -> str | None:
        self._signal(sid, signal.SIGSTOP)
        self.log(f"{sid}: SIGSTOP to pgid {self._pgid(sid)}")
        return None

    def thaw(self, sid: str, frozen: bool) -> None:
        self._signal(sid, signal.SIGCONT)  # whatever the record says: a stopped group must not stay stopped

    def terminate(self, sid: str, frozen: bool, reason: str) -> str:
        pgid = self._pgid(sid)
        self._signal(sid, signal.SIGTERM)
        self._signal(sid, signal.SIGCONT)  # a stopped group must run to act on SIGTERM
        self.log(f"{sid}: SIGTERM to pgid {pgid} ({reason})")
        grace = self.specs[sid].kill_grace_s
        return f"{sid}: SIGTERM sent to process group {pgid}; SIGKILL after {grace:g}s"

    def kill(self, sid: str) -> str:
        self._signal(sid, signal.SIGKILL)
        return f"SIGKILL to pgid {self._pgid(sid)}"

    def poll(self) -> None:
        for sid, child in list(self.children.items()):
            if child.poll() is not None:
                del self.children[sid]
