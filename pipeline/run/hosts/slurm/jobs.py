"""The Slurm executor's supervisor side: each stage attempt is one Slurm job, known by its job id.

``[executor] kind = "slurm"``: instead of spawning the launcher, the supervisor submits a batch
script that runs it (``python -m pipeline.run.stage_side.launcher RUN STAGE ATTEMPT``) on the job's first node;
the run directory is on the shared filesystem, so the launcher's ``proc.json``, ``exit.json``, events
and log land where the console already reads them.

Identity is the job id, written down around ``sbatch``: ``slurm.json`` first says *submitting* with
the job's unique name, then *submitted* with its id. A supervisor killed in between finds the job by
name (``squeue``/``sacct``) on its next start instead of submitting again; only when Slurm knows no
job of that name after :data:`SUBMIT_GRACE_S` is the attempt submitted anew. Control never uses a
pid (the job's processes are on nodes the supervisor may not see): kill is ``scancel`` (then
``scancel --signal=KILL`` after the grace period), a pause that reaches no safe point becomes
``scontrol suspend`` (or a clear message where Slurm refuses it), resume is ``scontrol resume``.
A job that ended without the launcher's exit record (cancelled or pre-empted outside Aerie, its
time limit, a lost node) is recorded with Slurm's state and exit code.
"""

from __future__ import annotations

import contextlib
import secrets
import shlex
import sys
import time
from collections.abc import Callable

from pipeline.run.hosts.procs import package_root
from pipeline.run.hosts.slurm import commands as slurm
from pipeline.run.plan.dag import StageSpec
from pipeline.run.plan.sections import SlurmSection
from pipeline.run.rundir.events import EventWriter
from pipeline.run.rundir.files import open_private_append, private_dir
from pipeline.run.rundir.layout import RunDir, StageDir, read_json, write_atomic, write_json
from pipeline.run.rundir.stage_row import ExitStatus, StageState
from pipeline.run.rundir.stage_status import StageStatus, finish, record_lost

SUBMIT_GRACE_S = 30.0  # a job name Slurm does not know this long after "submitting" was never submitted
EXIT_GRACE_S = 10.0  # an ended job's launcher may still be writing exit.json over the shared filesystem
QUERY_EVERY_S = 1.0  # ask Slurm about the running jobs at most this often: one squeue call for all of them


def job_name(sid: str, attempt: int, token: str) -> str:
    return f"aerie-{sid}-{attempt}-{token}"


def batch_script(run: RunDir, sid: str, attempt: int, python: str) -> str:
    pkg_root = package_root()  # the folder holding pipeline/, shared with the nodes
    q = shlex.quote
    return (
        "#!/bin/sh\n"
        f"# Aerie: stage {sid}, attempt {attempt} of run {run.root}\n"
        f"export PYTHONPATH={q(pkg_root)}${{PYTHONPATH:+:$PYTHONPATH}}\n"
        "export AERIE_EXECUTOR=slurm\n"
        f"exec {q(python)} -m pipeline.run.stage_side.launcher {q(str(run.root))} {q(sid)} {attempt}\n"
    )


class SlurmJobs:
    """Submits, follows and controls the Slurm jobs of one run's stages (the :class:`~pipeline.run.hosts.executor.
    Executor` of ``[executor] kind = "slurm"``)."""

    kind = "slurm"
    uses_local_slots = False  # Slurm schedules CPUs and GPUs on its nodes
    freeze_how = "scontrol suspend"

    def __init__(
        self,
        run: RunDir,
        specs: dict[str, StageSpec],
        section: SlurmSection,
        log: Callable[[str], None],
        python: str = sys.executable,
    ) -> None:
        self.run = run
        self.specs = specs
        self.section = section
        self.log = log
        self.python = python
        self._cache: dict[str, tuple[float, slurm.JobInfo]] = {}
        self._asked: dict[str, float] = {}  # job -> when a stage last asked about it
        self._ended_seen: dict[str, float] = {}

    # ------------------------------------------------------------------------------- records
    def record(self, sd: StageDir, attempt: int) -> dict | None:
        rec = sd.record_for(sd.slurm_job, attempt)
        return rec if rec and rec.get("state") != "abandoned" else None

    def job_id(self, sid: str) -> str | None:
        sd = self.run.stage(sid)
        rec = self.record(sd, sd.attempt())
        return str(rec["job_id"]) if rec and rec.get("job_id") else None

    # -------------------------------------------------------------------------------- submit
    def launch(self, sid: str, attempt: int) -> None:
        """Submit attempt ``attempt`` of ``sid``: name recorded before ``sbatch``, id after."""
        sd = self.run.stage(sid)
        spec = self.specs[sid]
        token = secrets.token_hex(6)
        name = job_name(sid, attempt, token)
        script = sd.path / f"job-{attempt}.sh"
        write_atomic(script, batch_script(self.run, sid, attempt, self.python))
        private_dir(sd.out)
        rec = {"attempt": attempt, "name": name, "token": token, "state": "submitting", "t": time.time()}
        write_json(sd.slurm_job, rec)
        options = slurm.sbatch_options(self.section, spec)
        try:
            job = slurm.submit(script, name, f"aerie:{token}", sd.log, sd.out, options)
        except slurm.SlurmTimeout as exc:
            # No answer is not a refusal: slurmctld may still create the job. The "submitting" record stays, so
            # the job is found by its name, or the attempt is submitted again once Slurm knows no such job.
            self.log(f"{sid}: attempt {attempt}: {exc}; looking for job {name} before submitting again")
            write_json(sd.slurm_job, {**rec, "unanswered_t": time.time()})
            return
        except slurm.SlurmError as exc:
            self._rejected(sd, rec, str(exc))
            return
        write_json(sd.slurm_job, {**rec, "state": "submitted", "job_id": job, "submitted_t": time.time()})
        self.log(f"{sid}: attempt {attempt} submitted as Slurm job {job} ({' '.join(options)})")

    def _rejected(self, sd: StageDir, rec: dict, why: str) -> None:
        attempt = rec["attempt"]
        write_json(sd.slurm_job, {**rec, "state": "rejected", "error": why})
        detail = f"Slurm rejected the job: {why}"
        write_json(
            sd.exit,
            {
                "attempt": attempt,
                "returncode": None,
                "signal": None,
                "t": time.time(),
                "detail": detail,
                "recorded_by": "supervisor",
            },
        )
        with contextlib.suppress(OSError), open_private_append(sd.log) as fh:
            fh.write(f"===== aerie: {sd.id} attempt {attempt}: {detail} =====\n".encode())
        with EventWriter(sd.events) as w:
            w.emit("message", level="error", code="slurm_rejected", text=detail)
            w.emit("finished", status=ExitStatus.FAILED, detail=detail)
        self.log(f"{sd.id}: attempt {attempt}: {detail}")

    # ------------------------------------------------------------------------------- observe
    def info(self, job: str, fresh: bool = False) -> slurm.JobInfo | None:
        """Slurm's view of ``job`` (cached for :data:`QUERY_EVERY_S`); None while Slurm does not answer.

        One ``squeue`` call refreshes every job a stage asked about lately, however many run; only a job
        that ended (or that slurmctld forgot) costs a call of its own, for its exit code (``sacct``/``scontrol``).
        """
        now = time.monotonic()
        self._asked[job] = now
        hit = self._cache.get(job)
        if hit and not fresh and now - hit[0] < QUERY_EVERY_S:
            return hit[1]
        for j, t in list(self._asked.items()):
            if now - t > 10 * QUERY_EVERY_S:  # no stage follows it any more
                del self._asked[j]
                self._cache.pop(j, None)
        batch = sorted(
            j for j in self._asked if j == job or not (j in self._cache and self._cache[j][1].ended)
        )
        try:
            seen = slurm.states(batch)
        except slurm.SlurmError as exc:
            self.log(f"Slurm jobs {', '.join(batch)}: cannot query: {exc}")
            return hit[1] if hit else None
        for j in batch:
            got = seen.get(j)
            if got is None or got.ended:
                try:
                    got = slurm.query(j)
                except slurm.SlurmError as exc:
                    self.log(f"Slurm job {j}: cannot query: {exc}")
                    continue
            self._cache[j] = (now, got)
        hit = self._cache.get(job)
        return hit[1] if hit else None

    def derive(self, st: StageStatus, sd: StageDir, attempt: int, acked: bool) -> StageStatus | None:
        """The state of a stage whose attempt went to Slurm; None when the attempt was not submitted."""
        rec = self.record(sd, attempt)
        if rec is None:
            return None
        proc = sd.record_for(sd.proc, attempt)
        if proc:
            st.started_at = proc.get("t")
        ex = sd.record_for(sd.exit, attempt)
        job = str(rec["job_id"]) if rec.get("job_id") else None
        if job is None and rec.get("state") == "submitting":
            # The supervisor died around sbatch: find the job by its name (never submit it twice).
            job = self._find_lost_submission(sd, rec, may_abandon=ex is None)
            if job is None and ex is None:
                if self.record(sd, attempt) is None:
                    return None  # never reached Slurm: the attempt is submitted again
                st.state, st.reason, st.queued = StageState.RUNNING, "submitting to Slurm", True
                return st
        st.job = job
        if ex:
            if job and ex.get("returncode") != 0 and "slurm_state" not in ex:
                ex = self._annotate(sd, ex, job)
                if "slurm_state" not in ex:  # the job is still ending: wait for Slurm's verdict
                    st.state, st.reason = StageState.RUNNING, f"Slurm job {job} ending"
                    return st
            return finish(st, sd, ex, attempt, self.specs[sd.id])
        if job is None:
            ex = record_lost(sd, attempt, "no Slurm job id recorded", self.log)
            return finish(st, sd, ex, attempt, self.specs[sd.id])
        info = self.info(job)
        if info is None:
            st.state, st.reason = StageState.RUNNING, f"Slurm job {job}: Slurm is not answering"
            return st
        if info.queued:
            st.state, st.reason = (
                StageState.RUNNING,
                f"queued: Slurm job {job} {info.state.lower()} ({info.reason})",
            )
            st.pausing = sd.pause_flag.exists()  # nothing to freeze yet: Slurm will say so
            st.queued = True
            return st
        if info.active:
            self._ended_seen.pop(job, None)
            pause = sd.pause_flag.exists()
            st.state = (
                StageState.PAUSED if pause and (acked or info.state == "SUSPENDED") else StageState.RUNNING
            )
            st.pausing = pause and st.state == StageState.RUNNING
            st.reason = f"Slurm job {job} on {info.nodes}" if info.nodes else f"Slurm job {job}"
            return st
        # Ended in Slurm's eyes, no exit record yet: give the launcher a moment, then record it ourselves.
        first = self._ended_seen.setdefault(job, time.monotonic())
        if time.monotonic() - first < EXIT_GRACE_S:
            st.state, st.reason = (
                StageState.RUNNING,
                f"Slurm job {job} {info.state.lower()}: collecting its exit",
            )
            return st
        ex = self._record_ended(sd, attempt, info)
        return finish(st, sd, ex, attempt, self.specs[sd.id])

    def _find_lost_submission(self, sd: StageDir, rec: dict, may_abandon: bool = True) -> str | None:
        """A 'submitting' record without an id (the supervisor died around sbatch, or sbatch got no answer in
        time): find the job by its name."""
        try:
            ids = slurm.find_by_name(rec["name"])
        except slurm.SlurmError as exc:
            self.log(f"{sd.id}: cannot look for job {rec['name']}: {exc}")
            return None
        if ids:
            job = ids[0]
            write_json(
                sd.slurm_job, {**rec, "state": "submitted", "job_id": job, "found_by_name": time.time()}
            )
            self.log(
                f"{sd.id}: attempt {rec['attempt']}: found Slurm job {job} by its name {rec['name']} "
                "(sbatch got no answer, or the supervisor died, before its id was recorded): not submitting again"
            )
            return job
        since = float(rec.get("unanswered_t", rec.get("t", 0)))  # an sbatch that timed out: from then on
        if may_abandon and time.time() - since > SUBMIT_GRACE_S:
            write_json(sd.slurm_job, {**rec, "state": "abandoned", "abandoned_t": time.time()})
            self.log(
                f"{sd.id}: attempt {rec['attempt']}: Slurm has no job named {rec['name']}: "
                "its submission never reached Slurm; submitting it now"
            )
        return None

    def _annotate(self, sd: StageDir, ex: dict, job: str) -> dict:
        """A failed attempt whose job Slurm ended itself (cancelled outside Aerie, pre-empted, timed out)
        says so, once Slurm has the job's final state."""
        info = self.info(job)
        if info is None or not info.ended:
            first = self._ended_seen.setdefault(f"exit:{job}", time.monotonic())
            if time.monotonic() - first < EXIT_GRACE_S:
                return ex
            info = slurm.JobInfo(
                job, info.state if info else "UNKNOWN"
            )  # give up waiting: record what we know
        ex = {**ex, "slurm_state": info.state}
        if info.state in (
            "CANCELLED",
            "PREEMPTED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
            "DEADLINE",
        ) and not sd.record_for(sd.kill_marker, int(ex["attempt"])):
            ex["detail"] = info.describe()
            ex.pop("error", None)
        with contextlib.suppress(OSError):
            write_json(sd.exit, ex)
        return ex

    def _record_ended(self, sd: StageDir, attempt: int, info: slurm.JobInfo) -> dict:
        killed = sd.record_for(sd.kill_marker, attempt)
        ex = sd.record_for(sd.exit, attempt)
        if ex:
            return ex
        # Without the launcher's record the stage never counts as succeeded: a job cancelled while queued
        # ends "0:0" too. A non-zero code from Slurm is kept.
        ex = {
            "attempt": attempt,
            "returncode": info.exit_code or None,
            "t": time.time(),
            "recorded_by": "supervisor",
            "signal": None,
            "slurm_state": info.state,
            "detail": info.describe() if not killed else f"Slurm job {info.job_id} cancelled by Aerie",
        }
        if info.state == "COMPLETED" and not info.exit_code:
            ex["detail"] = f"Slurm job {info.job_id} completed but its launcher wrote no exit record"
        write_json(sd.exit, ex)
        with EventWriter(sd.events) as w:
            if not killed:
                w.emit("message", level="error", code="slurm_ended", text=ex["detail"])
            w.emit("finished", status=ExitStatus.KILLED if killed else ExitStatus.FAILED, detail=ex["detail"])
        self.log(f"{sd.id}: attempt {attempt}: {ex['detail']}")
        return ex

    # ------------------------------------------------------------------------------- control
    def _cancel(self, sid: str, hard: bool = False) -> str:
        job = self.job_id(sid)
        if job is None:
            return f"{sid}: no Slurm job id recorded yet; it is cancelled once found"
        try:
            slurm.cancel(job, kill=hard)
        except slurm.SlurmError as exc:
            self.log(f"{sid}: scancel {job}: {exc}")
            return f"{sid}: scancel of Slurm job {job} failed: {exc}"
        self._cache.pop(job, None)
        return f"{sid}: scancel{' --signal=KILL' if hard else ''} sent to Slurm job {job}"

    def _mark_cancelled(self, sid: str) -> None:
        sd = self.run.stage(sid)
        write_json(sd.kill_marker, {**(read_json(sd.kill_marker) or {}), "scancel": time.time()})

    def terminate(self, sid: str, frozen: bool, reason: str) -> str:
        """``scancel`` (Slurm's SIGTERM to every process of the job); a suspended job acts on it once resumed."""
        if frozen:
            self.thaw(sid, frozen)
        msg = self._cancel(sid)
        if self.job_id(sid):
            self._mark_cancelled(sid)
        self.log(f"{msg} ({reason})")
        return f"{msg}; scancel --signal=KILL after {self.specs[sid].kill_grace_s:g}s"

    def kill(self, sid: str) -> str:
        return self._cancel(sid, hard=True)

    def freeze(self, sid: str) -> str | None:
        """``scontrol suspend``; None when done, else why Slurm would not."""
        job = self.job_id(sid)
        if job is None:
            return "no Slurm job id recorded"
        try:
            slurm.suspend(job)
        except slurm.SlurmError as exc:
            return f"Slurm refused to suspend its job ({exc})"
        self._cache.pop(job, None)
        return None

    def thaw(self, sid: str, frozen: bool) -> None:
        """``scontrol resume`` of a job :meth:`freeze` suspended (one that was not needs nothing)."""
        job = self.job_id(sid)
        if job is None or not frozen:
            return
        try:
            slurm.resume(job)
        except slurm.SlurmError as exc:
            self.log(f"{sid}: scontrol resume {job}: {exc}")
        self._cache.pop(job, None)

    def poll(self) -> None:
        """Re-send a kill asked while the job id was still being found, once it is."""
        for sid in self.pending_kills():
            self.log(self._cancel(sid))
            self._mark_cancelled(sid)

    def survivors(self, sid: str) -> str | None:
        """Slurm owns the job's cgroup, so an attempt runs exactly while its job is queued or active."""
        rec = read_json(self.run.stage(sid).slurm_job)
        if not rec or not rec.get("job_id") or rec.get("state") == "abandoned":
            return None
        job = str(rec["job_id"])
        info = self.info(job)
        if info is None or not (info.active or info.queued):
            return None  # ended, or Slurm is not answering (an sbatch would not go through either)
        return f"attempt {rec.get('attempt')} of {sid} is still Slurm job {job} ({info.state.lower()})"

    def pending_kills(self) -> list[str]:
        """Stages whose kill was asked before their job id was known (re-sent once it is)."""
        out = []
        for sid in self.specs:
            sd = self.run.stage(sid)
            k = read_json(sd.kill_marker) or {}
            if k and int(k.get("attempt", 0)) == sd.attempt() and not k.get("scancel") and self.job_id(sid):
                out.append(sid)
        return out
