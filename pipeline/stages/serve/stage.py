"""The serve stage's main loop: preflight, launch, follow the log, poll health, stop cleanly.

The server child stays in the stage's process group, so the supervisor's group signals reach it
even if this process dies; this process is also a child subreaper, so helpers the server starts
(SGLang's scheduler and detokenizer processes) stay its descendants and are stopped with it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, NoReturn

from pipeline import tested_versions
from pipeline.eagle3 import provenance
from pipeline.run.hosts.procs import ProcIdentity, read_stat
from pipeline.run.plan.dag import PlanError
from pipeline.run.rundir.layout import RunDir, write_json
from pipeline.run.rundir.stage_row import HealthState
from pipeline.run.stage_side.runtime import StageContext, add_common_args, fail
from pipeline.serving.sglang_args import MODES, ServerSettings, draft_path, settings_from_plan
from pipeline.serving.sglang_log import ServerStats, parse_line
from pipeline.stages.serve import backends, draft_flags, preflight
from pipeline.stages.serve.health import HealthTracker, probe

METRIC_INTERVAL_S = 1.0  # at most one metric set per batch kind per second
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(root: int) -> list[ProcIdentity]:
    """Live descendants of ``root`` (children first), from ``/proc``."""
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = read_stat(int(entry.name))
            if st is not None and st.state not in ("Z", "X"):
                kids[st.ppid].append(st.pid)
    out: list[ProcIdentity] = []
    todo = list(kids.get(root, []))
    while todo:
        pid = todo.pop(0)
        st = read_stat(pid)
        if st is None:
            continue
        out.append(ProcIdentity(pid, st.pgid, st.start_time, ""))
        todo.extend(kids.get(pid, []))
    return out


class LogFollower(threading.Thread):
    """Copies the server's output to the stage log line by line and turns lines into metrics."""

    def __init__(self, stream: IO[bytes], ctx: StageContext, stats: ServerStats) -> None:
        super().__init__(daemon=True, name="server-log")
        self.stream, self.ctx, self.stats = stream, ctx, stats
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.lock = threading.Lock()
        self._last_emit: dict[str, float] = {}
        self.ready_marker = False

    def run(self) -> None:
        out = sys.stdout.buffer
        for raw in iter(self.stream.readline, b""):
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            rec = parse_line(text)
            if (
                rec is not None
                and rec.kind == "access"
                and rec.fields.get("path") == "/health"
                and rec.fields.get("status") == 200
            ):
                continue  # our own health probes: one line every few seconds would bury the server's lines
            with contextlib.suppress(OSError, ValueError):
                out.write(raw)
                out.flush()
            self.tail.append(text)
            if rec is None:
                continue
            with self.lock:
                self.stats.update(rec)
            if rec.kind == "ready":
                self.ready_marker = True
            elif rec.kind in ("decode", "prefill"):
                now = time.monotonic()
                if now - self._last_emit.get(rec.kind, 0.0) >= METRIC_INTERVAL_S:
                    self._last_emit[rec.kind] = now
                    for name, value in rec.metrics().items():
                        self.ctx.metric(name, value, batch=rec.kind, rank=rec.rank)


class ServeStage:
    def __init__(self, ctx: StageContext, settings: ServerSettings, kill_grace_s: float) -> None:
        self.ctx = ctx
        self.s = settings
        self.kill_grace_s = kill_grace_s
        self.stop = threading.Event()
        self.stop_signal: int | None = None
        self.child: subprocess.Popen | None = None
        self.stats = ServerStats()
        self.follower: LogFollower | None = None
        self.endpoint = ctx.out / "endpoint.json"

    # -- signals ------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = signum
        self.stop.set()

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    # -- helpers ------------------------------------------------------------------------------
    def unhealthy_fail(self, text: str, code: int = 1) -> NoReturn:
        self.ctx.health(HealthState.UNHEALTHY, detail=text[:300])
        fail(self.ctx, text, code)

    def forced(self) -> bool:
        if self.ctx.run_dir is None:
            return False
        sd = RunDir(self.ctx.run_dir).stage(self.ctx.stage_id)
        return sd.record_for(sd.force_marker, self.ctx.attempt) is not None

    def advertised_url(self) -> str:
        """The URL clients use. Under Slurm a server listening on every interface (``[serve] host =
        "0.0.0.0"``) is reached at its node's name: regen jobs run on other nodes."""
        if os.environ.get("AERIE_EXECUTOR") == "slurm" and self.s.host in ("0.0.0.0", "::", ""):
            import socket

            return f"http://{socket.gethostname()}:{self.s.port}"
        return self.s.url

    def write_endpoint(self, state: str) -> None:
        write_json(
            self.endpoint,
            {
                "url": self.advertised_url(),
                "host": self.s.host,
                "port": self.s.port,
                "backend": self.s.backend,
                "model": self.s.model,
                "served_model_name": self.s.served_model_name,
                "state": state,
                "pid": self.child.pid if self.child else None,
                "attempt": self.ctx.attempt,
                "t": time.time(),
                "speculative": self.s.speculative is not None,
            },
        )

    # -- phases -------------------------------------------------------------------------------
    def preflight(self) -> None:
        from dataclasses import replace

        if self.s.port == 0:
            self.s = replace(self.s, port=preflight.pick_free_port(self.s.host))
            self.ctx.message(f"picked free port {self.s.port} on {self.s.host}")
        problem = preflight.port_problem(self.s.host, self.s.port)
        if problem:
            self.unhealthy_fail(
                f"{problem}: stop that server or set [serve] port to another port (0 = any free)", 3
            )
        problem, note = preflight.gpu_problem(self.s.gpus, self.ctx.run_dir, self.ctx.stage_id)
        if note:
            self.ctx.message(note, level="warning", code="gpu-guard-skipped")
        if problem:
            if self.forced():
                self.ctx.message(f"GPU guard overridden (--force): {problem}", level="warning", code="forced")
            else:
                where = self.ctx.run_dir or "RUN"
                self.unhealthy_fail(
                    f"GPU guard: {problem} — stop it, or override once with "
                    f"`python -m pipeline.run.supervise.ctl {where} force {self.ctx.stage_id}`",
                    3,
                )

    def launch(self) -> None:
        argv, extra_env = backends.launch(self.s, sys.executable)
        env = {**os.environ, **extra_env}
        self.ctx.message(
            "launching " + self.s.backend + " server: $ " + " ".join(argv), code="launch", argv=argv
        )
        try:
            child = self.child = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(self.ctx.out),
            )
        except OSError as exc:
            self.unhealthy_fail(f"cannot start the server ({argv[0]}): {exc}", 127)
        assert child.stdout is not None
        self.follower = LogFollower(child.stdout, self.ctx, self.stats)
        self.follower.start()
        self.write_endpoint("starting")

    def watch(self) -> int:
        """Poll health until stopped (0) or the server dies / never becomes ready (1)."""
        assert self.child is not None and self.follower is not None
        tracker = HealthTracker(self.s.startup_timeout_s, self.s.unhealthy_after)
        t0 = time.monotonic()
        last_requests = -1
        last_detail = ""
        while not self.stop.is_set():
            rc = self.child.poll()
            if rc is not None:
                last = (
                    next((ln for ln in reversed(self.follower.tail) if ln.strip()), "")
                    if self.follower
                    else ""
                )
                phase = "after it was ready" if tracker.ever_ready else "during startup"
                self.ctx.health(HealthState.UNHEALTHY, detail=f"server exited with code {rc}")
                self.ctx.message(
                    f"the server exited with code {rc} {phase}"
                    + (f": {last[:300]}" if last else "")
                    + " (full output in the stage log)",
                    level="error",
                    code="server-exited",
                )
                self.write_endpoint("exited")
                return 1
            ok, detail = probe(self.s.host, self.s.port, self.s.health_timeout_s)
            elapsed = time.monotonic() - t0
            change = tracker.update(ok, elapsed)
            if not ok:
                last_detail = detail
            if change == HealthState.READY:
                self.write_endpoint("ready")
                self.ctx.health(HealthState.READY, url=self.s.url)
                self.ctx.message(f"server ready at {self.s.url} after {elapsed:.0f}s", code="ready")
            elif change == HealthState.UNHEALTHY:
                if tracker.startup_expired:
                    self.ctx.health(
                        HealthState.UNHEALTHY,
                        detail=f"no healthy answer within {self.s.startup_timeout_s:g}s",
                    )
                    self.ctx.message(
                        f"the server did not become healthy within {self.s.startup_timeout_s:g}s "
                        f"(last probe: {last_detail}); stopping it",
                        level="error",
                        code="startup-timeout",
                    )
                    self.write_endpoint("unhealthy")
                    return 1
                self.ctx.health(HealthState.UNHEALTHY, detail=last_detail[:300])
                self.ctx.message(
                    f"health check failed {tracker.failures} times in a row: {last_detail}",
                    level="warning",
                    code="unhealthy",
                )
                self.write_endpoint("unhealthy")
            with self.follower.lock:
                reqs, errs = self.stats.requests, self.stats.errors
            if reqs != last_requests:
                last_requests = reqs
                self.ctx.metric("requests", reqs, errors_5xx=errs)
            self.stop.wait(
                self.s.health_interval_s if tracker.ever_ready else min(1.0, self.s.health_interval_s)
            )
        return 0

    def shutdown(self) -> None:
        """Stop the server child and everything it started; never leaves one behind."""
        child = self.child
        if child is None:
            return
        budget = max(1.0, min(self.s.stop_timeout_s, self.kill_grace_s - 1.5))
        family = descendants(os.getpid())
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)  # may already have it from the group signal: harmless
            try:
                child.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                self.ctx.message(f"the server ignored SIGTERM for {budget:g}s: SIGKILL", level="warning")
        # Whatever of the server's family is left (or ignored SIGTERM) gets SIGKILL, by recorded identity.
        everyone = {p.pid: p for p in family + descendants(os.getpid())}
        for ident in everyone.values():
            st = read_stat(ident.pid)
            if st is not None and st.start_time == ident.start_time and st.state not in ("Z", "X"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(ident.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)
        self._reap()
        if self.follower is not None:
            self.follower.join(timeout=2)
        self.write_endpoint("stopped")
        self.ctx.health(HealthState.STOPPED)

    @staticmethod
    def _reap() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def stop_reason(self) -> str | None:
        if self.ctx.run_dir is None:
            return None
        sd = RunDir(self.ctx.run_dir).stage(self.ctx.stage_id)
        killed = sd.record_for(sd.kill_marker, self.ctx.attempt)
        return killed.get("reason") if killed else None


def resolve(ctx: StageContext, mode: str, draft: str | None) -> tuple[str | None, ServerSettings, float]:
    """The server this stage launches, the draft's method (``--mode eagle3``) and the stage's kill grace."""
    plan = ctx.plan
    try:
        spec = plan.stage(ctx.stage_id)
        gpus, kill_grace, cpu = spec.gpus, spec.kill_grace_s, spec.cpu
    except KeyError:
        gpus, kill_grace, cpu = (), 10.0, 1
    method, flags = None, None
    if mode == "eagle3":  # the draft's own method's flags (its provenance says which method)
        method, flags = draft_flags.serve_flags(plan, Path(draft_path(plan, draft)))
    settings = settings_from_plan(plan, mode, gpus=gpus, draft=draft, cpu=cpu, flags=flags)
    return method, settings, kill_grace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.stages.serve", description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument(
        "--mode",
        choices=MODES,
        default="plain",
        help="eagle3: serve with the [deploy] draft, launched with its own method's flags (EAGLE-3, DFlash, ...)",
    )
    ap.add_argument(
        "--draft", default=None, help="EAGLE-3 draft checkpoint (overrides [deploy] draft_model_path)"
    )
    ap.add_argument("--dataset", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    ctx = StageContext.from_cli(args)
    try:
        method, settings, kill_grace = resolve(ctx, args.mode, args.draft)
    except PlanError as exc:
        ctx.health(HealthState.UNHEALTHY, detail="bad plan")
        fail(ctx, str(exc), 2)
    if settings.speculative is not None:  # the draft must be one trained for the target served here
        verdict = provenance.check(settings.speculative.draft_model_path, settings.model)
        if not verdict.ok:
            ctx.health(HealthState.UNHEALTHY, detail="draft trained for another target")
            fail(ctx, verdict.detail, 2)
        ctx.message(
            verdict.detail, level="warning" if verdict.level == "warn" else "info", code="draft_provenance"
        )
        ctx.message(
            f"serving the {method} draft: {' '.join(settings.speculative.flags)}", code="draft_method"
        )
    if settings.backend == "sglang":  # in seconds, with the table's line, before the server loads a model
        refusal = tested_versions.stage_refusal(ctx.plan, "serve")
        if refusal:
            ctx.health(HealthState.UNHEALTHY, detail="SGLang")
            fail(ctx, f'{ctx.plan.path}: serve.backend = "sglang": {refusal}', 2)
    stage = ServeStage(ctx, settings, kill_grace)
    stage.install_signals()
    become_subreaper()
    ctx.health(HealthState.STARTING)
    stage.preflight()
    rc = 0  # a stop before the launch is a clean stop
    try:
        if not stage.stop.is_set():
            stage.launch()
            rc = stage.watch()
    finally:
        stage.shutdown()
    if stage.stop.is_set() and rc == 0:
        reason = stage.stop_reason()
        ctx.message(
            f"server stopped ({'no longer needed' if reason == 'stop' else reason or 'signal'})",
            code="stopped",
        )
        ctx.close()
        return 0 if reason in (None, "stop") else 128 + (stage.stop_signal or signal.SIGTERM)
    ctx.close()
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
