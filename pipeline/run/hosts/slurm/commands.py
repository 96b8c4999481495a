"""Talking to Slurm: the only place Aerie runs ``sbatch``, ``squeue``, ``sacct``, ``scontrol`` and ``scancel``.

A stage's resources become ``sbatch`` options (:func:`sbatch_options`: ``cpu`` -> ``--cpus-per-task``,
its GPU count -> ``--gpus-per-node``, ``nodes`` -> ``--nodes``, then ``[slurm]`` partition, account,
qos, time and extra, each overridable per stage). Jobs are named and found by their job id, or by
the unique ``--job-name`` Aerie gave them (:func:`find_by_name`) when a supervisor died between
``sbatch`` and writing the id down. A job's state, exit code and signal come from ``sacct`` where
the cluster keeps accounting, else from ``scontrol show job`` (which forgets a job ``MinJobAge``
seconds after it ends).

Every command is one argv (never a shell), with a timeout; a failure raises :class:`SlurmError`
carrying Slurm's own message. Standard library only.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline.run.plan.dag import StageSpec
from pipeline.run.plan.sections import SlurmSection

TIMEOUT_S = float(os.environ.get("AERIE_SLURM_TIMEOUT_S", "30"))  # how long a Slurm command may take
# Slurm job states (``squeue``/``sacct`` long names): waiting for nodes, holding them, and done.
QUEUED = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "POWER_UP_NODE"}
ACTIVE = {"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD"}
GONE = "GONE"  # Slurm no longer knows the job (purged after MinJobAge, or never existed)


class SlurmError(RuntimeError):
    """A Slurm command failed; the message is Slurm's own (``sbatch: error: ...``)."""


class SlurmTimeout(SlurmError):
    """A Slurm command got no answer in time: what it asked for may still have happened (a job submitted)."""


def available() -> str | None:
    """None when the Slurm client commands are on PATH, else what is missing."""
    missing = [c for c in ("sbatch", "squeue", "scancel", "scontrol", "sinfo") if shutil.which(c) is None]
    return f"Slurm commands not found on PATH: {', '.join(missing)}" if missing else None


def _run(argv: list[str], timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]}: command not found (is Slurm installed on this host?)") from None
    except subprocess.TimeoutExpired:
        raise SlurmTimeout(f"{argv[0]} did not answer within {timeout_s:g}s (is slurmctld up?)") from None


def _why(p: subprocess.CompletedProcess[str]) -> str:
    lines = [x.strip() for x in (p.stderr or p.stdout or "").splitlines() if x.strip()]
    return "; ".join(lines[-3:]) or f"exit status {p.returncode}"


def sbatch_options(section: SlurmSection, spec: StageSpec) -> list[str]:
    """The ``sbatch`` options for ``spec``: its resources, then ``[slurm]`` with the stage's overrides."""
    cfg = {**section.given(), **spec.slurm}
    opts = [f"--nodes={spec.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={max(1, spec.cpu)}"]
    if spec.gpus:
        opts.append(f"--gpus-per-node={len(spec.gpus)}")
    for key in ("partition", "account", "qos", "time"):
        if cfg.get(key) is not None:
            opts.append(f"--{key}={cfg[key]}")
    return opts + [str(x) for x in section.extra] + [str(x) for x in spec.slurm.get("extra", [])]


def submit(script: Path, name: str, comment: str, log: Path, workdir: Path, options: list[str]) -> str:
    """``sbatch --parsable``: returns the job id, or raises :class:`SlurmError` with Slurm's reason."""
    argv = [
        "sbatch",
        "--parsable",
        f"--job-name={name}",
        f"--comment={comment}",
        f"--output={log}",
        "--open-mode=append",
        f"--chdir={workdir}",
        "--export=ALL",
        "--kill-on-invalid-dep=yes",
        # A pre-empted or failed job must not run the same attempt again behind Aerie's back: it ends, and
        # the stage's retry policy decides.
        "--no-requeue",
        *options,
        str(script),
    ]
    p = _run(argv)
    job = p.stdout.strip().split(";")[0] if p.returncode == 0 else ""
    if not job.isdigit():
        raise SlurmError(_why(p))
    return job


def find_by_name(name: str) -> list[str]:
    """Job ids with this (Aerie-unique) name, queued, running or recently ended."""
    ids: list[str] = []
    p = _run(["squeue", "--noheader", "--states=all", f"--name={name}", "--format=%i"])
    if p.returncode == 0:
        ids += [x.strip() for x in p.stdout.split() if x.strip().isdigit()]
    if accounting():
        p = _run(
            [
                "sacct",
                "--noheader",
                "--parsable2",
                "--allocations",
                f"--name={name}",
                "--format=JobIDRaw",
                "--starttime=now-30days",
            ]
        )
        if p.returncode == 0:
            ids += [x.strip() for x in p.stdout.split() if x.strip().isdigit() and x.strip() not in ids]
    return ids


@dataclass(frozen=True)
class JobInfo:
    """What Slurm says about one job."""

    job_id: str
    state: str  # PENDING, RUNNING, SUSPENDED, COMPLETED, FAILED, CANCELLED, TIMEOUT, PREEMPTED, ... or GONE
    reason: str = ""
    exit_code: int | None = None
    signal: int | None = None
    nodes: str = ""

    @property
    def queued(self) -> bool:
        return self.state in QUEUED

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def ended(self) -> bool:
        return not self.queued and not self.active

    def describe(self) -> str:
        """One line for an ended job: "Slurm job 12 was CANCELLED (outside Aerie: scancel or an administrator)"."""
        how = {
            "CANCELLED": "was CANCELLED outside Aerie (scancel or an administrator)",
            "PREEMPTED": "was PREEMPTED by Slurm (a higher-priority job took its nodes)",
            "TIMEOUT": "reached its time limit (TIMEOUT): raise [slurm] time",
            "NODE_FAIL": "lost a node (NODE_FAIL)",
            "OUT_OF_MEMORY": "ran out of memory (OUT_OF_MEMORY)",
            "BOOT_FAIL": "could not boot its nodes (BOOT_FAIL)",
            "DEADLINE": "missed its deadline (DEADLINE)",
            GONE: "is no longer known to Slurm (purged, or never started)",
        }.get(self.state, f"ended {self.state}")
        sig = f", signal {signal.Signals(self.signal).name}" if self.signal else ""
        code = f" (exit {self.exit_code}{sig})" if self.exit_code is not None and self.state != GONE else ""
        return f"Slurm job {self.job_id} {how}{code}"


_ACCOUNTING: dict[str, bool] = {}


def accounting() -> bool:
    """Does this cluster keep job accounting (``sacct`` answers)? Asked once per process and ``SLURM_CONF``."""
    key = os.environ.get("SLURM_CONF", "")
    if key not in _ACCOUNTING:
        try:
            p = _run(["sacct", "--noheader", "--parsable2", "--allocations", "--format=JobIDRaw", "--jobs=1"])
            _ACCOUNTING[key] = p.returncode == 0 and "disabled" not in (p.stderr + p.stdout).lower()
        except SlurmError:
            _ACCOUNTING[key] = False
    return _ACCOUNTING[key]


def _exit_pair(text: str) -> tuple[int | None, int | None]:
    m = re.match(r"(\d+):(\d+)", text.strip())
    if not m:
        return None, None
    return int(m.group(1)), (int(m.group(2)) or None)


def query(job_id: str) -> JobInfo:
    """Slurm's view of one job (``sacct`` where there is accounting, else ``scontrol show job``)."""
    if accounting():
        p = _run(
            [
                "sacct",
                "--noheader",
                "--parsable2",
                "--allocations",
                f"--jobs={job_id}",
                "--format=JobIDRaw,State,ExitCode,NodeList,Reason",
            ]
        )
        rows = [r.split("|") for r in p.stdout.splitlines() if r.startswith(f"{job_id}|")]
        if p.returncode == 0 and rows:
            _id, state, code, nodes, reason = (rows[0] + [""] * 5)[:5]
            rc, sig = _exit_pair(code)
            return JobInfo(job_id, state.split()[0] if state else "UNKNOWN", reason, rc, sig, nodes)
    p = _run(["scontrol", "show", "job", "--oneliner", job_id])
    if p.returncode != 0:
        if "invalid job id" in _why(p).lower():
            return JobInfo(job_id, GONE)
        raise SlurmError(_why(p))

    def field(key: str) -> str:
        m = re.search(rf"(?:^|\s){key}=(\S*)", p.stdout)
        return m.group(1) if m else ""

    rc, sig = _exit_pair(field("ExitCode"))
    nodes = field("NodeList")
    return JobInfo(
        job_id, field("JobState") or "UNKNOWN", field("Reason"), rc, sig, "" if nodes == "(null)" else nodes
    )


def states(job_ids: list[str]) -> dict[str, JobInfo]:
    """Many jobs' state, reason and nodes in one ``squeue`` call (no exit codes: see :func:`query`).
    Jobs slurmctld no longer knows are absent from the answer."""
    if not job_ids:
        return {}
    p = _run(["squeue", "--noheader", "--states=all", "--format=%i|%T|%r|%N", f"--jobs={','.join(job_ids)}"])
    if p.returncode != 0:
        if "invalid job id" in _why(p).lower():
            return {}
        raise SlurmError(_why(p))
    out: dict[str, JobInfo] = {}
    for line in p.stdout.splitlines():
        cols = line.strip().split("|")
        if len(cols) == 4 and cols[0] in job_ids:
            out[cols[0]] = JobInfo(cols[0], cols[1], cols[2], None, None, cols[3])
    return out


def cancel(job_id: str, kill: bool = False) -> None:
    """``scancel``: Slurm's SIGTERM to every process of the job, SIGKILL after its KillWait;
    ``kill``: SIGKILL to every step (the batch script's included) at once."""
    argv = ["scancel", *(["--signal=KILL", "--full"] if kill else []), job_id]
    p = _run(argv)
    if p.returncode != 0:
        raise SlurmError(_why(p))


def suspend(job_id: str) -> None:
    """``scontrol suspend``: Slurm freezes every process of the job (operators and admins only)."""
    p = _run(["scontrol", "suspend", job_id])
    if p.returncode != 0:
        raise SlurmError(_why(p))


def resume(job_id: str) -> None:
    p = _run(["scontrol", "resume", job_id])
    if p.returncode != 0:
        raise SlurmError(_why(p))


def hostnames(nodelist: str) -> list[str]:
    """``n[1-2]`` -> ``["n1", "n2"]`` (``scontrol show hostnames``)."""
    p = _run(["scontrol", "show", "hostnames", nodelist])
    if p.returncode != 0:
        raise SlurmError(_why(p))
    return p.stdout.split()


def node_address(node: str) -> str:
    """The address other nodes reach ``node`` at (its ``NodeAddr``; the name where Slurm gives none)."""
    p = _run(["scontrol", "show", "node", "--oneliner", node])
    m = re.search(r"(?:^|\s)NodeAddr=(\S+)", p.stdout) if p.returncode == 0 else None
    return m.group(1) if m else node
