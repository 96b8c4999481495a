"""The launcher wrapper: ``python -m pipeline.run.stage_side.launcher RUN STAGE ATTEMPT`` (the local executor
runs this file by path, ``python -S …/launcher.py``, to spare every launch ``runpy``'s imports).

The supervisor starts this in a new session (so it leads a fresh process group), detached, with
stdin from /dev/null and stdout/stderr a pipe to the stage's log writer
(:mod:`pipeline.run.stage_side.log_writer`), which the stage inherits. The launcher

1. records its pid, pgid, kernel start time and a random attempt token in ``proc.json`` (atomically),
   before the stage starts, so every process of the attempt can be found from that record,
2. writes the ``started`` event and a banner line in the log,
3. runs the stage (a built-in ``python -m pipeline.X`` or the operator's ``/bin/sh -c`` command)
   as a child in the same process group, with the ``AERIE_*`` environment; ``AERIE_ATTEMPT_TOKEN``
   marks each process the stage starts, including one that leaves the group
   (:func:`pipeline.run.hosts.procs.attempt_members`),
4. writes ``exit.json`` and the ``finished`` event when the child ends; for a failure both carry
   ``error``, the log line that says why (the exception, or the last error / non-empty line).

Under the Slurm executor (``AERIE_EXECUTOR=slurm``) it is the batch script's process and exits with
the stage's status, so Slurm's accounting says FAILED for a failed stage. It survives SIGTERM (ignored here, so the child's death is still recorded); a SIGKILL to the
group ends it too. A launcher killed alone (``kill -9`` of its pid) leaves the stage running under init:
the supervisor then follows the attempt's processes and records the exit when the last one has ended
(:mod:`pipeline.run.hosts.local_exec`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.run.hosts import oom
from pipeline.run.hosts.procs import ENV_TOKEN, ProcIdentity, env_with_pipeline, new_token
from pipeline.run.rundir.events import EventWriter
from pipeline.run.rundir.files import private_dir
from pipeline.run.rundir.growth import read_tail
from pipeline.run.rundir.layout import RunDir, StageDir, read_json, write_json
from pipeline.run.rundir.stage_row import ExitStatus
from pipeline.run.stage_side.env_names import (
    ENV_ATTEMPT,
    ENV_INPUTS,
    ENV_OUT,
    ENV_PLAN,
    ENV_RUN,
    ENV_STAGE,
    ENV_THREADS,
)


def stage_argv(stage: dict[str, Any], run: RunDir, python: str) -> list[str]:
    """The stage's command line, from its launch fields (:meth:`StageSpec.launch_fields`)."""
    if stage.get("module"):
        return [
            python,
            "-m",
            stage["module"],
            "--plan",
            str(run.plan_path),
            "--stage",
            stage["id"],
            *stage["args"],
        ]
    return ["/bin/sh", "-c", str(stage["command"])]


def launch_fields(sd: StageDir, attempt: int) -> dict[str, Any]:
    """What to start: the fields the supervisor wrote into this attempt's ``launch.json``; from ``spec.json``
    when that record predates them (a launch by an older supervisor, during an upgrade)."""
    rec = read_json(sd.launch)
    if isinstance(rec, dict) and rec.get("attempt") == attempt and isinstance(rec.get("stage"), dict):
        return rec["stage"]
    from pipeline.run.plan.stages import StageSpec  # the plan's modules, only on this path

    return StageSpec.from_dict(read_json(sd.spec)).launch_fields()


def under_slurm() -> bool:
    return os.environ.get("AERIE_EXECUTOR") == "slurm"


def stage_env(stage: dict[str, Any], run: RunDir, attempt: int, token: str = "") -> dict[str, str]:
    sd = run.stage(stage["id"])
    inputs = {dep: str(run.stage(dep).out) for dep in stage["after"]}
    env = dict(os.environ)
    if stage["cpu"] > 0 and not stage["gpus"] and "OMP_NUM_THREADS" not in env and not under_slurm():
        # A CPU stage computes on the slots it holds, not on every core: torch's default (one thread per
        # core) beside other stages oversubscribes the cores, and OpenMP threads then spin waiting for
        # each other (measured: docs/performance.md, "CPU threads of a stage"). Under Slurm the job's
        # cgroup already holds it to its cpus-per-task, which torch's default follows.
        env["OMP_NUM_THREADS"] = env[ENV_THREADS] = str(stage["cpu"])
        # Threads that wait sleep instead of spinning: libgomp's spinning threads, beside another busy
        # process, took 4-5x the CPU for the same decoding (docs/performance.md, "OpenMP threads that wait").
        if "OMP_NUM_THREADS" not in stage["env"]:  # the plan's own thread count keeps libgomp's own policy
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.update(stage["env"])
    env = env_with_pipeline(env)  # built-in stages import `pipeline` from wherever the launcher did
    env.update(
        {
            ENV_RUN: str(run.root),
            ENV_STAGE: stage["id"],
            ENV_ATTEMPT: str(attempt),
            ENV_OUT: str(sd.out),
            ENV_INPUTS: json.dumps(inputs),
            ENV_PLAN: str(run.plan_path),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if token:
        env[ENV_TOKEN] = token  # after the plan's env: a stage cannot unset the mark of its own attempt
    return env


LOG_DRAIN_S = 2.0  # the longest the launcher waits for the log writer to write the stage's last bytes


def attempt_tail(log: os.PathLike[str] | str, end_banner: str, within_s: float = LOG_DRAIN_S) -> str:
    """The end of the attempt's output, up to ``end_banner`` (the line the launcher printed once the stage
    had exited; "" when it could not: the tail as it is). Its stdout is the log writer's pipe, which hands bytes on in order: once the banner is in
    ``log`` (or, just rotated, the generation before it) every byte the stage wrote before is too. So this
    waits for the banner itself, not for the pipe to look empty and the file to look still (CI: after a 4 GiB
    burst the writer's last write, or a rotation, came later than any fixed pause). Bounded: a writer that
    is gone, or a process the stage left running that writes on, costs ``within_s`` at most, and then the
    tail is taken as it is."""
    from pipeline.run.rundir.logscan import ERROR_TAIL_BYTES  # a failure's path only

    mark = end_banner.encode()
    deadline = time.monotonic() + within_s
    while True:
        try:
            data = read_tail(Path(log), ERROR_TAIL_BYTES + len(mark) + 1)
        except OSError:
            data = b""
        at = data.rfind(mark)
        if at >= 0:
            data = data[:at]
            break
        if time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return data[-ERROR_TAIL_BYTES:].decode(errors="replace")


def failure_line(tail: str) -> str:
    """Why the attempt failed, in one line, from the end of its output (see ``logscan.last_error_line``)."""
    from pipeline.run.rundir.logscan import last_error_line  # a failure's path only

    return last_error_line(tail)


def _ran_out_of_space(sd: StageDir, tail: str) -> bool:
    """Did the stage die of a full disk? Its filesystem is (nearly) full, or its output's tail says so."""
    from pipeline.run.hosts import nospace  # a failure's path only

    try:
        st = os.statvfs(sd.out)
        if st.f_bavail * st.f_frsize < 64 * 1024:
            return True
    except OSError:
        pass
    tail = tail.rsplit(f"===== aerie: {sd.id} attempt ", 1)[-1].lower()  # this attempt's lines only
    return any(t.lower() in tail for t in nospace.NOSPACE_TEXT)


PROC_WRITE_S = (
    20.0  # proc.json: under the supervisor's LAUNCH_TIMEOUT_S, after which it counts the launch lost
)
EXIT_WRITE_S = 3600.0  # exit.json: a run dir read-only (a remount, an immutable flag) for up to an hour


def _write_record(path: Path, record: dict, within_s: float) -> None:
    """A record the supervisor derives state from, retried with backoff (0.5 s doubling to 30 s) on any write
    error — a full disk (the stage's failure usually frees its temp files), a run dir remounted read-only or
    made immutable for a while, EIO — until ``within_s``; then the error is raised. While the launcher retries
    ``exit.json`` it is alive, so the stage shows running, never a false 'launcher died'; if the record
    still cannot be written the supervisor records the exit itself."""
    deadline = time.monotonic() + within_s
    wait = 0.5
    while True:
        try:
            write_json(path, record)
            return
        except OSError as exc:
            if time.monotonic() + wait > deadline:
                raise
            with contextlib.suppress(OSError):
                print(f"aerie: cannot write {path.name} ({exc}); retrying in {wait:g}s", flush=True)
            time.sleep(wait)
            wait = min(wait * 2, 30.0)


class _Events:
    """The launcher's events, best effort: a write error (a read-only run dir, a full disk) loses an event
    line, never the stage — proc.json and exit.json are what the supervisor derives state from."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer: EventWriter | None = None

    def emit(self, type_: str, **data: object) -> None:
        try:
            if self._writer is None:
                self._writer = EventWriter(self.path)
            self._writer.emit(type_, **data)
        except OSError as exc:
            with contextlib.suppress(OSError):
                print(f"aerie: cannot write the {type_} event ({exc})", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print("usage: python -m pipeline.run.stage_side.launcher RUN STAGE ATTEMPT", file=sys.stderr)
        return 2
    os.umask(0o077)  # what the stage and its libraries create (out/, checkpoints) is private too
    run, stage_id, attempt = RunDir(argv[0]), argv[1], int(argv[2])
    sd = run.stage(stage_id)
    stage = launch_fields(sd, attempt)
    ident = ProcIdentity.of_self(token=new_token())
    _write_record(sd.proc, {"attempt": attempt, **ident.to_dict(), "t": time.time()}, PROC_WRITE_S)
    private_dir(sd.out)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the stage; we record it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    events = _Events(sd.events)
    if sd.record_for(sd.kill_marker, attempt):  # killed while it started (after proc.json: no signal missed)
        _never_started(sd, attempt, events, None, ExitStatus.KILLED, "killed before the stage started")
        return 0
    argv_child = stage_argv(stage, run, sys.executable)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with contextlib.suppress(OSError):  # the log's banner, best effort like the events
        print(f"===== aerie: {stage_id} attempt {attempt} started {stamp} pid {ident.pid} =====", flush=True)
        print(f"===== $ {' '.join(argv_child)}", flush=True)
    events.emit("started", attempt=attempt, pid=ident.pid, pgid=ident.pgid)
    oom_before = oom.reading()  # to tell an OOM kill from any other SIGKILL when the child dies
    try:
        child = start_stage(argv_child, stage_env(stage, run, attempt, ident.token), str(sd.out))
    except OSError as exc:
        print(f"aerie: cannot start stage: {exc}", flush=True)
        _never_started(sd, attempt, events, 127, ExitStatus.FAILED, str(exc))
        return 127
    rc = _wait(child)
    _finish(sd, stage_id, attempt, rc, oom_before, events)
    if os.environ.get("AERIE_EXECUTOR") == "slurm":
        # Slurm's record of the job (sacct, scontrol) carries the stage's own status, as a shell reports it.
        return rc if rc >= 0 else 128 - rc
    return 0


def _never_started(
    sd: StageDir, attempt: int, events: _Events, rc: int | None, status: ExitStatus, detail: str
) -> None:
    """Record an attempt whose stage was never started (``exit.json``, the ``finished`` event)."""
    _write_record(
        sd.exit,
        {"attempt": attempt, "returncode": rc, "signal": None, "t": time.time(), "detail": detail},
        EXIT_WRITE_S,
    )
    events.emit("finished", status=status, detail=detail, **({} if rc is None else {"returncode": rc}))


def start_stage(argv: list[str], env: dict[str, str], cwd: str) -> int:
    """Start the stage as a child in the launcher's process group (stdin from /dev/null, SIGTERM and SIGINT
    back to their defaults, output to the log writer's pipe the launcher holds) and return its pid; an
    ``OSError`` when it cannot be started (what ``exec`` said). ``fork`` + ``execve`` by hand, as
    ``subprocess`` does, without importing it into every launcher (~5 ms a launch: docs/performance.md,
    "Launches"); the launcher has one thread, and every descriptor Python opened is close-on-exec."""
    rd, wr = os.pipe()  # close-on-exec: end of file when the exec succeeded, else why it failed
    pid = os.fork()
    if pid == 0:  # the child: only async-signal-safe steps, then exec or _exit
        try:
            os.close(rd)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            os.chdir(cwd)
            os.execve(argv[0], argv, env)
        except BaseException as exc:  # noqa: BLE001 (whatever it is, the parent is told and the child ends)
            with contextlib.suppress(BaseException):
                errno_ = getattr(exc, "errno", None) or 0
                why = (
                    f"{errno_}\0{getattr(exc, 'strerror', None) or exc}\0{getattr(exc, 'filename', '') or ''}"
                )
                os.write(wr, why.encode(errors="replace"))
        finally:
            os._exit(127)
    os.close(wr)
    try:
        said = b""
        while chunk := os.read(rd, 4096):
            said += chunk
    finally:
        os.close(rd)
    if said:
        os.waitpid(pid, 0)  # the child that could not exec: reaped here, never a zombie
        code, text, filename = (said.decode(errors="replace").split("\0") + ["", ""])[:3]
        if filename:
            raise OSError(int(code) if code.isdigit() else 0, text, filename)
        raise OSError(int(code) if code.isdigit() else 0, text)
    return pid


def _wait(pid: int) -> int:
    """The child's return code (negative: the signal that ended it), however often a signal interrupts."""
    while True:
        try:
            _, status = os.waitpid(pid, 0)
        except InterruptedError:
            continue
        return os.waitstatus_to_exitcode(status)


def _finish(
    sd: StageDir, stage_id: str, attempt: int, rc: int, oom_before: oom.OomReading, events: _Events
) -> ExitStatus:
    """Record how the attempt ended (``exit.json``, the ``finished`` event) and return its status."""
    sig = -rc if rc < 0 else None
    sig_name = signal.Signals(sig).name if sig else None
    killed = sd.record_for(sd.kill_marker, attempt)
    if rc == 0:
        status = ExitStatus.SUCCEEDED
    elif killed:
        # A service the supervisor stopped because its users were done has done its job.
        status = ExitStatus.SUCCEEDED if killed.get("reason") == "stop" else ExitStatus.KILLED
    else:
        status = ExitStatus.FAILED
    record: dict[str, Any] = {"attempt": attempt, "returncode": rc, "signal": sig_name, "t": time.time()}
    if sig:
        # "killed by signal 9 (SIGKILL): out of memory — the kernel's OOM killer, at the memory limit of ..."
        record["detail"] = oom.describe(sig, oom_before, oom.reading(), sent_by_aerie=bool(killed))
        with contextlib.suppress(OSError):
            print(f"aerie: {stage_id} {record['detail']}", flush=True)
        if not killed:
            events.emit("message", level="error", code="signal", signal=sig, text=record["detail"])
    # The attempt's last line in the log, printed before its output is read: it marks where that output ends.
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    banner = f"===== aerie: {stage_id} attempt {attempt} {status} (rc {rc}) {stamp} ====="
    try:
        print(banner, flush=True)
    except OSError:
        banner = ""  # nothing to wait for: the tail as it is
    if status == ExitStatus.FAILED or rc > 0:
        tail = attempt_tail(sd.log, banner)
        why = failure_line(tail) if status == ExitStatus.FAILED else ""
        if why:
            record["error"] = why
        if rc > 0 and _ran_out_of_space(sd, tail):
            # "exit 1: no space left on device /dev/sdb1 (ext4 at /data, 0 B free of 2.0 TiB)"
            from pipeline.run.hosts import nospace

            record["detail"] = f"exit {rc}: {nospace.describe(sd.out)}"
    why = record.get("error", "")
    _write_record(sd.exit, record, EXIT_WRITE_S)
    with contextlib.suppress(OSError):  # a full disk: the exit record above is what counts
        events.emit(
            "finished",
            status=status,
            returncode=rc,
            detail=record.get("detail") or sig_name,
            **({"error": why} if why else {}),
        )
    return status


if __name__ == "__main__":
    raise SystemExit(main())
