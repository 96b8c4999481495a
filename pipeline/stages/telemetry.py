"""The telemetry agent: ``python -m pipeline.stages.telemetry --plan PLAN`` (a service stage).

On the executing host, every ``[telemetry] interval_s`` (default 2) it appends one sample to
``out/telemetry.jsonl``: one JSON record per GPU, one for the run-dir filesystem and one for the
host. Records share the sample's ``seq`` and ``t``::

    {"kind":"meta", "v":1, "host", "pid", "interval_s", "run_dir", "gpus_expected",
     "nvml":{"ok":true, "source", "driver", "nvml", "cuda_driver", "count", "xid_events"} | {"ok":false, "error"}}
    {"kind":"gpu", "seq", "t", "index", "name", "uuid", "util", "mem_util", "mem_used", "mem_total",
     "temp_c", "power_w", "power_cap_w", "sm_clock_mhz", "sm_clock_max_mhz", "pstate",
     "ecc_uncorrected", "ecc_corrected", "xid", "procs":[{"pid", "mem", "type", "owner", "name"}]}
    {"kind":"disk", "seq", "t", "path", "mount", "total", "used", "avail", "rate_bps", "reserve",
     "projected_remaining"}
    {"kind":"host", "seq", "t", "cpu_pct", "ncpu", "load1", "mem_total", "mem_available",
     "swap_total", "swap_free", "agent_cpu_s"}

Values NVML does not expose on a device are ``null``. ``procs[].owner`` is the stage that owns the
process (see :mod:`pipeline.run.hosts.gpus`) or ``"foreign"``. A ``meta`` record opens every file. The file
is capped at ``[telemetry] max_mb`` (default 16): it is then renamed to ``telemetry.jsonl.1``
(replacing the older one) and a new file starts, so the agent never uses more than twice the cap.

Without an NVIDIA driver the agent says so once (a ``message`` event and the ``meta`` record) and
keeps reporting disk and host. No reading error stops it; SIGTERM or SIGINT ends it at once, cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.run.hosts.gpus import GpuSource, GpuUnavailable, NvmlSource, annotate_owners
from pipeline.run.plan.dag import Plan
from pipeline.run.plan.sections import TelemetrySection
from pipeline.run.rundir.layout import RunDir, read_json
from pipeline.run.rundir.stage_row import HealthState
from pipeline.run.stage_side.runtime import StageContext, add_common_args, fail
from pipeline.run.supervise import budget

FILE_NAME = "telemetry.jsonl"
_DEFAULTS = TelemetrySection()
SCHEMA_VERSION = 1


# ------------------------------------------------------------------------------------ host
class HostReader:
    """CPU busy share since the previous reading (from ``/proc/stat``), memory from ``/proc/meminfo``."""

    def __init__(self) -> None:
        self._prev = self._cpu_times()
        self.ncpu = os.cpu_count() or 1

    @staticmethod
    def _cpu_times() -> tuple[int, int] | None:
        try:
            with open("/proc/stat", "rb") as fh:
                parts = fh.readline().split()
        except OSError:
            return None
        vals = [int(x) for x in parts[1:9]]
        idle = vals[3] + vals[4]  # idle + iowait
        return sum(vals), idle

    @staticmethod
    def _meminfo() -> dict[str, int]:
        out: dict[str, int] = {}
        try:
            with open("/proc/meminfo", "rb") as fh:
                for line in fh:
                    key, _, rest = line.partition(b":")
                    if key in (b"MemTotal", b"MemAvailable", b"SwapTotal", b"SwapFree"):
                        out[key.decode()] = int(rest.split()[0]) * 1024
        except OSError:
            pass
        return out

    def read(self) -> dict[str, Any]:
        cur = self._cpu_times()
        pct = None
        # Under ~50 ms of CPU ticks since the last reading the share is noise: keep the old base.
        if cur and self._prev and cur[0] - self._prev[0] >= 5 * self.ncpu:
            dt, didle = cur[0] - self._prev[0], cur[1] - self._prev[1]
            pct = round(100.0 * (dt - didle) / dt, 1)
            self._prev = cur
        elif not self._prev:
            self._prev = cur
        mem = self._meminfo()
        try:
            load1 = round(os.getloadavg()[0], 2)
        except OSError:
            load1 = None
        return {
            "cpu_pct": pct,
            "ncpu": self.ncpu,
            "load1": load1,
            "mem_total": mem.get("MemTotal"),
            "mem_available": mem.get("MemAvailable"),
            "swap_total": mem.get("SwapTotal"),
            "swap_free": mem.get("SwapFree"),
            "agent_cpu_s": round(time.process_time(), 6),
        }


# ------------------------------------------------------------------------------------ file
class CappedLog:
    """An append-only JSONL file that rotates to ``NAME.1`` once it passes ``max_bytes``."""

    def __init__(self, path: Path, max_bytes: int, header: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.header = header
        self._fd = -1
        self._size = 0
        self._open()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size
        if self._size == 0:
            self._write([self.header()])

    def _write(self, records: list[dict[str, Any]]) -> None:
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
        os.write(self._fd, data)  # one write per sample: readers never see half a sample's line
        self._size += len(data)

    def append(self, records: list[dict[str, Any]]) -> None:
        if self._size >= self.max_bytes:
            self.rotate()
        self._write(records)

    def rotate(self) -> None:
        os.close(self._fd)
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._open()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# ----------------------------------------------------------------------------------- agent
class Agent:
    """Takes samples; knows nothing about the loop or signals (so benchmarks can drive it)."""

    def __init__(
        self,
        source: GpuSource,
        out: Path,
        run: RunDir | None = None,
        plan: Plan | None = None,
        interval_s: float = _DEFAULTS.interval_s,
        max_bytes: int = int(_DEFAULTS.max_mb * 2**20),
        projection_every_s: float = _DEFAULTS.projection_every_s,
        message: Callable[..., None] | None = None,
    ) -> None:
        self.source = source
        self.run = run
        self.plan = plan
        self.disk_path = run.root if run is not None else out
        self._mount: str | None = None
        self.interval_s = interval_s
        self.projection_every_s = projection_every_s
        self.message = message or (lambda text, **kw: print(f"telemetry: {text}", file=sys.stderr))
        self.host = HostReader()
        self.seq = 0
        self.nvml: dict[str, Any] = {"ok": False, "error": "not started"}
        self._gpu_ok = False
        self._prev_disk: tuple[float, int] | None = None
        self._projection: tuple[float, int | None] | None = None
        self._reported: set[str] = set()
        self._start_source()
        self.log = CappedLog(out / FILE_NAME, max_bytes, self.meta)

    @property
    def gpus_expected(self) -> bool:
        return bool(self.plan and self.plan.gpus)

    def meta(self) -> dict[str, Any]:
        return {
            "kind": "meta",
            "v": SCHEMA_VERSION,
            "t": round(time.time(), 3),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "interval_s": self.interval_s,
            "run_dir": str(self.disk_path),
            "gpus_expected": self.gpus_expected,
            "nvml": self.nvml,
        }

    def _start_source(self) -> None:
        try:
            info = self.source.open()
            self.nvml = {"ok": True, **info}
            self._gpu_ok = True
            self.message(
                f"GPU telemetry from {info.get('source', 'nvml')}: {info.get('count', 0)} GPU(s), "
                f"driver {info.get('driver')}",
                code="gpu-telemetry",
            )
        except GpuUnavailable as exc:
            self.nvml = {"ok": False, "error": str(exc)}
            level = "warning" if self.gpus_expected else "info"
            self.message(f"no GPU readings: {exc}; reporting disk and host only", level=level, code="no-gpu")

    def _once(self, key: str, text: str) -> None:
        """Report a reading problem once per kind (the agent keeps going)."""
        if key not in self._reported:
            self._reported.add(key)
            self.message(text, level="warning", code="telemetry-error")

    def _gpus(self) -> list[dict[str, Any]]:
        if not self._gpu_ok:
            return []
        try:
            gpus = self.source.sample()
        except GpuUnavailable as exc:
            self._once("gpu", f"GPU readings stopped: {exc}")
            return []
        except Exception as exc:  # noqa: BLE001 - never let a driver hiccup kill the agent
            self._once("gpu", f"GPU sample failed: {type(exc).__name__}: {exc}")
            return []
        try:
            annotate_owners(gpus, self.run)
        except Exception as exc:  # noqa: BLE001
            self._once("owners", f"cannot map GPU processes to stages: {exc}")
        return gpus

    def _projected_remaining(self, now: float) -> int | None:
        if self.plan is None or self.run is None:
            return None
        if self._projection and now - self._projection[0] < self.projection_every_s:
            return self._projection[1]
        value: int | None
        try:
            state = read_json(self.run.state_path) or {}
            states = {s["id"]: s.get("state", "pending") for s in state.get("stages", [])}
            value = budget.remaining_projected_output(self.plan, self.run, states)
        except Exception as exc:  # noqa: BLE001
            self._once("projection", f"cannot project the remaining output: {exc}")
            value = None
        self._projection = (now, value)
        return value

    def _disk(self, now: float) -> dict[str, Any]:
        try:
            total, used, avail = budget.disk_free(self.disk_path)
        except OSError as exc:
            self._once("disk", f"cannot read the run-dir filesystem {self.disk_path}: {exc}")
            return {"path": str(self.disk_path), "total": None, "used": None, "avail": None, "rate_bps": None}
        rate = None
        if self._prev_disk and now > self._prev_disk[0]:
            rate = round((used - self._prev_disk[1]) / (now - self._prev_disk[0]), 1)
        self._prev_disk = (now, used)
        reserve = None
        if self.plan is not None:
            try:
                reserve = budget.reserve_bytes(self.plan)
            except budget.BudgetError:
                reserve = None
        if self._mount is None:
            self._mount = budget.mount_of(self.disk_path)
        return {
            "path": str(self.disk_path),
            "mount": self._mount,  # the filesystem measured (mount point, device): the meter names it
            "total": total,
            "used": used,
            "avail": avail,
            "rate_bps": rate,
            "reserve": reserve,
            "projected_remaining": self._projected_remaining(now),
        }

    def sample(self) -> list[dict[str, Any]]:
        """Take one sample and append it; returns the records written."""
        self.seq += 1
        now = time.time()
        head = {"seq": self.seq, "t": round(now, 3)}
        records: list[dict[str, Any]] = [{"kind": "gpu", **head, **g} for g in self._gpus()]
        records.append({"kind": "disk", **head, **self._disk(now)})
        try:
            host = self.host.read()
        except Exception as exc:  # noqa: BLE001
            self._once("host", f"cannot read host CPU/memory: {exc}")
            host = {}
        records.append({"kind": "host", **head, **host})
        try:
            self.log.append(records)
        except OSError as exc:
            self._once("write", f"cannot write {self.log.path}: {exc}")
        return records

    def close(self) -> None:
        self.log.close()
        with contextlib.suppress(Exception):
            self.source.close()


# ---------------------------------------------------------------------------- the stage
def settings(plan: Plan | None) -> tuple[float, float, float]:
    """(interval_s, max_mb, projection_every_s): the plan's ``[telemetry]`` (checked when it loaded)."""
    t = plan.settings.telemetry if plan else TelemetrySection()
    return t.interval_s, t.max_mb, t.projection_every_s


def run_loop(agent: Agent, ctx: StageContext | None, samples: int | None = None) -> str:
    """Sample every interval until SIGTERM/SIGINT (or ``samples`` taken). Returns why it stopped.

    The two signals are blocked and collected with ``sigtimedwait``, so a stop request ends the
    wait at once and never interrupts a half-written sample.
    """
    stops = {signal.SIGTERM, signal.SIGINT}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        taken = 0
        while True:
            if ctx is not None:
                ctx.safe_point()
            t0 = time.monotonic()
            agent.sample()
            taken += 1
            if taken == 1 and ctx is not None:
                ctx.health(HealthState.READY)
            if samples is not None and taken >= samples:
                return f"{taken} samples taken"
            wait = max(0.0, agent.interval_s - (time.monotonic() - t0))
            sig = signal.sigtimedwait(stops, wait)
            if sig is not None:
                return f"stopped by {signal.Signals(sig.si_signo).name}"
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.stages.telemetry", description=__doc__.split("\n")[0]
    )
    add_common_args(ap)
    ap.add_argument(
        "--interval", type=float, default=None, help="seconds between samples (overrides the plan)"
    )
    ap.add_argument("--samples", type=int, default=None, help="stop after N samples (default: until SIGTERM)")
    args = ap.parse_args(argv)
    ctx = StageContext.from_cli(args)
    plan = ctx.plan if ctx.plan_path is not None else None
    try:
        interval, max_mb, proj_every = settings(plan)
    except ValueError as exc:
        fail(ctx, str(exc), code=2)
    if args.interval is not None:
        if args.interval <= 0:
            fail(ctx, f"--interval must be positive, got {args.interval}", code=2)
        interval = args.interval
    run = RunDir(ctx.run_dir) if ctx.run_dir else None
    agent = Agent(
        NvmlSource(),
        ctx.out,
        run=run,
        plan=plan,
        interval_s=interval,
        max_bytes=int(max_mb * 2**20),
        projection_every_s=proj_every,
        message=ctx.message,
    )
    try:
        why = run_loop(agent, ctx, samples=args.samples)
    finally:
        agent.close()
    ctx.message(f"telemetry agent stopped ({why})", code="telemetry-stopped")
    ctx.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
