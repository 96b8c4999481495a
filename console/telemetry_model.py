"""Telemetry for the console: the agent's records parsed into meters, bounded history and projections.

Pure: no files, no processes, no Textual. Feed it the lines of ``telemetry.jsonl`` (the record
format is in :mod:`pipeline.stages.telemetry`) with :meth:`TelemetryModel.feed`, or let it follow the file
through a transport with :meth:`~TelemetryModel.read_request` / :meth:`~TelemetryModel.ingest`.

It keeps, per GPU, the latest reading and the last ``history_s`` seconds of utilisation and memory
(for sparklines); for the run-dir filesystem the latest numbers, the growth rate over the last
``rate_window_s`` and a projection ("full in 5 h 10 m at 310 MiB/s") that turns into a warning when
the output the unfinished stages are still projected to write does not fit; host CPU and RAM.
Every buffer is bounded, whatever the run's length or the number of GPUs.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from console import fmt
from pipeline.run.projection.text import use_percent

TELEMETRY_FILE = "telemetry.jsonl"


# Formatting is shared with the rest of the console (one duration style on every pane).
size, duration = fmt.size, fmt.duration


def rate(bps: float | None) -> str:
    return fmt.byte_rate(bps)


# ------------------------------------------------------------------------------- the views
@dataclass
class GpuView:
    index: int
    history: int
    name: str = ""
    uuid: str = ""
    t: float = 0.0
    util: float | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    temp_c: float | None = None
    power_w: float | None = None
    power_cap_w: float | None = None
    sm_clock_mhz: int | None = None
    ecc_uncorrected: int | None = None
    xid_total: int = 0
    procs: list[dict[str, Any]] = field(default_factory=list)
    util_hist: deque[float] = field(default_factory=deque)
    mem_hist: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.util_hist = deque(maxlen=self.history)
        self.mem_hist = deque(maxlen=self.history)

    @property
    def mem_fraction(self) -> float | None:
        if self.mem_used is None or not self.mem_total:
            return None
        return self.mem_used / self.mem_total

    @property
    def owners(self) -> list[str]:
        """Who holds this GPU: stage ids, then ``foreign pid N`` entries; empty when idle."""
        stages = sorted({str(p.get("owner")) for p in self.procs if p.get("owner") not in (None, "foreign")})
        foreign = [f"foreign pid {p.get('pid')}" for p in self.procs if p.get("owner") in (None, "foreign")]
        return [str(s) for s in stages] + foreign

    @property
    def has_foreign(self) -> bool:
        return any(p.get("owner") in (None, "foreign") for p in self.procs)

    def apply(self, r: dict[str, Any]) -> None:
        self.t = float(r.get("t") or 0.0)
        self.name = str(r.get("name") or self.name)
        self.uuid = str(r.get("uuid") or self.uuid)
        self.util = _num(r.get("util"))
        self.mem_used = _int(r.get("mem_used"))
        self.mem_total = _int(r.get("mem_total"))
        self.temp_c = _num(r.get("temp_c"))
        self.power_w = _num(r.get("power_w"))
        self.power_cap_w = _num(r.get("power_cap_w"))
        self.sm_clock_mhz = _int(r.get("sm_clock_mhz"))
        self.ecc_uncorrected = _int(r.get("ecc_uncorrected"))
        xid = r.get("xid")
        if isinstance(xid, list):
            self.xid_total += len(xid)
        procs = r.get("procs")
        self.procs = [p for p in procs if isinstance(p, dict)] if isinstance(procs, list) else []
        self.util_hist.append(self.util if self.util is not None else 0.0)
        frac = self.mem_fraction
        self.mem_hist.append(100.0 * frac if frac is not None else 0.0)


@dataclass
class DiskView:
    rate_window_s: float
    path: str = ""
    mount: str = ""  # the filesystem measured: its mount point (and device), from the agent
    t: float = 0.0
    total: int | None = None
    used: int | None = None
    avail: int | None = None
    reserve: int | None = None
    projected_remaining: int | None = None
    points: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=512))

    def apply(self, r: dict[str, Any]) -> None:
        self.t = float(r.get("t") or 0.0)
        self.path = str(r.get("path") or self.path)
        self.mount = str(r.get("mount") or self.mount)
        self.total, self.used, self.avail = _int(r.get("total")), _int(r.get("used")), _int(r.get("avail"))
        self.reserve = _int(r.get("reserve"))
        if "projected_remaining" in r:
            self.projected_remaining = _int(r.get("projected_remaining"))
        if self.used is not None:
            self.points.append((self.t, self.used))
            while len(self.points) > 2 and self.t - self.points[0][0] > self.rate_window_s:
                self.points.popleft()

    @property
    def where(self) -> str:
        """The filesystem measured, as the meter and the projection name it (an older agent: the run dir)."""
        return self.mount or self.path or "?"

    @property
    def used_bytes(self) -> int | None:
        """The blocks in use, as ``df``'s Used: the agent's ``used`` (total − free), else total − available (an
        agent that sent no ``used``: then used + available is the total)."""
        if self.used is not None:
            return self.used
        return None if self.total is None or self.avail is None else self.total - self.avail

    @property
    def used_fraction(self) -> float | None:
        """``df``'s Use%: used / (used + available), ``used`` being the blocks in use (total − free). Root's
        reserved blocks are in neither, so this is not (total − available) / total: on a disk whose size
        counts more than either (a thin-provisioned virtual disk) that read 72 % where df says 27 %."""
        used = self.used_bytes
        if used is None or self.avail is None or used + self.avail <= 0:
            return None
        return used / (used + self.avail)

    @property
    def use_percent(self) -> int | None:
        """:attr:`used_fraction` in whole per cent as ``df`` prints it: rounded up (29.2 % is 30 %)."""
        used = self.used_bytes
        return None if used is None or self.avail is None else use_percent(used, self.avail)

    @property
    def rate_bps(self) -> float | None:
        """Growth of the filesystem's used bytes over the rate window (negative: shrinking)."""
        if len(self.points) < 2:
            return None
        (t0, u0), (t1, u1) = self.points[0], self.points[-1]
        return (u1 - u0) / (t1 - t0) if t1 > t0 else None

    @property
    def room(self) -> int | None:
        """Free space left for outputs: available minus the plan's reserve."""
        if self.avail is None:
            return None
        return self.avail - (self.reserve or 0)

    @property
    def full_in_s(self) -> float | None:
        """Seconds until the available space is used up at the current rate; ``None`` if not growing."""
        r = self.rate_bps
        if r is None or r <= 0 or self.avail is None:
            return None
        return self.avail / r

    def status(self) -> tuple[str, str]:
        """(text, level) for the disk meter: level is ``ok``, ``warning`` or ``error``."""
        parts, level = self.status_parts()
        return f"{self.where}: " + " · ".join(parts), level

    def status_parts(self) -> tuple[list[str], str]:
        """The disk meter's facts, most important first (a narrow meter shows the first that fit)."""
        if self.avail is None:
            return ["disk: no reading"], "warning"
        room = self.room if self.room is not None else self.avail
        parts = [f"{size(self.avail)} free of {size(self.total)}"]
        full = self.full_in_s
        if full is not None:
            parts.append(f"full in {duration(full)} at {rate(self.rate_bps)}")
        elif self.rate_bps is not None:
            parts.append("not growing")
        level = "ok"
        need = self.projected_remaining
        if need:
            if need > room:
                parts.append(
                    f"⚠ {size(need)} still to write: {size(need - room)} short"
                    + (f" (reserve {size(self.reserve)})" if self.reserve else "")
                )
                level = "warning"
            else:
                parts.append(f"{size(need)} still to write: fits")
        if room <= 0:
            level = "error"
            parts.append("below the reserve")
        if level != "ok":  # the warning before the growth rate
            parts[1:] = sorted(parts[1:], key=lambda p: p.startswith(("full in", "not growing")))
        return parts, level


@dataclass
class HostView:
    history: int
    t: float = 0.0
    cpu_pct: float | None = None
    ncpu: int | None = None
    load1: float | None = None
    mem_total: int | None = None
    mem_available: int | None = None
    agent_cpu_s: float | None = None
    cpu_hist: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.cpu_hist = deque(maxlen=self.history)

    @property
    def mem_used(self) -> int | None:
        if self.mem_total is None or self.mem_available is None:
            return None
        return self.mem_total - self.mem_available

    @property
    def mem_fraction(self) -> float | None:
        used = self.mem_used
        return used / self.mem_total if used is not None and self.mem_total else None

    def apply(self, r: dict[str, Any]) -> None:
        self.t = float(r.get("t") or 0.0)
        self.cpu_pct = _num(r.get("cpu_pct"))
        self.ncpu = _int(r.get("ncpu"))
        self.load1 = _num(r.get("load1"))
        self.mem_total, self.mem_available = _int(r.get("mem_total")), _int(r.get("mem_available"))
        self.agent_cpu_s = _num(r.get("agent_cpu_s"))
        if self.cpu_pct is not None:
            self.cpu_hist.append(self.cpu_pct)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


# ------------------------------------------------------------------------------- the model
class TelemetryModel:
    """Everything the meters show, from telemetry records. ``version`` changes when anything did."""

    def __init__(
        self,
        history_s: float = 300.0,
        interval_s: float = 2.0,
        rate_window_s: float = 60.0,
        path: str = f"stages/telemetry/out/{TELEMETRY_FILE}",
        tail_bytes: int = 1 << 20,
    ) -> None:
        self.history_s = history_s
        self.interval_s = interval_s
        self.rate_window_s = rate_window_s
        self.path = path
        self.tail_bytes = tail_bytes
        self.version = 0
        self.records = 0
        self.bad_lines = 0
        self.meta: dict[str, Any] = {}
        self.gpus: dict[int, GpuView] = {}
        self.disk: DiskView | None = None
        self.host: HostView | None = None
        self.last_t = 0.0
        # Following the file through a transport:
        self._offset = 0
        self._ino = 0
        self._primed = False
        self._skip_partial = False
        self._buf = b""

    @property
    def history(self) -> int:
        return max(2, int(self.history_s / max(self.interval_s, 0.1)))

    # -- status -------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return bool(self.meta) or self.records > 0

    @property
    def nvml_ok(self) -> bool | None:
        nv = self.meta.get("nvml")
        return bool(nv.get("ok")) if isinstance(nv, dict) else (True if self.gpus else None)

    @property
    def gpu_note(self) -> str:
        """Why there are no GPU rows (empty when there are)."""
        if self.gpus:
            return ""
        if not self.started:
            return "waiting for telemetry…"
        nv = self.meta.get("nvml") if isinstance(self.meta.get("nvml"), dict) else {}
        if nv and not nv.get("ok"):
            return f"no GPU readings: {nv.get('error', 'NVML unavailable')}"
        return "no GPUs on this host"

    def age_s(self, now: float) -> float | None:
        return now - self.last_t if self.last_t else None

    def stale(self, now: float) -> bool:
        """No sample for three intervals (the agent stopped, or the host is unreachable)."""
        age = self.age_s(now)
        return age is not None and age > 3 * self.interval_s + 2

    def gpu_rows(self) -> list[GpuView]:
        return [self.gpus[i] for i in sorted(self.gpus)]

    # -- parsing ------------------------------------------------------------------------------
    def feed(self, lines: Iterable[str | bytes]) -> int:
        """Apply complete lines; returns how many were telemetry records. Bad lines are counted."""
        n = 0
        for line in lines:
            if isinstance(line, bytes):
                line = line.decode(errors="replace")
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                self.bad_lines += 1
                continue
            if not isinstance(rec, dict) or not self.apply(rec):
                self.bad_lines += 1
                continue
            n += 1
        if n:
            self.version += 1
        return n

    def apply(self, rec: dict[str, Any]) -> bool:
        kind = rec.get("kind")
        t = _num(rec.get("t"))
        if t is not None:
            self.last_t = max(self.last_t, t)
        if kind == "meta":
            self.meta = rec
            iv = _num(rec.get("interval_s"))
            if iv and iv > 0 and iv != self.interval_s:
                self.interval_s = iv
                self._resize()
            nv = rec.get("nvml")
            if isinstance(nv, dict) and isinstance(nv.get("count"), int):
                for i in [i for i in self.gpus if i >= nv["count"]]:
                    del self.gpus[i]  # a restarted agent on a host with fewer GPUs
            return True
        if kind == "gpu":
            idx = _int(rec.get("index"))
            if idx is None or idx < 0:
                return False
            gv = self.gpus.get(idx)
            if gv is None:
                gv = self.gpus[idx] = GpuView(idx, self.history)
            gv.apply(rec)
        elif kind == "disk":
            if self.disk is None:
                self.disk = DiskView(self.rate_window_s)
            self.disk.apply(rec)
        elif kind == "host":
            if self.host is None:
                self.host = HostView(self.history)
            self.host.apply(rec)
        else:
            return False
        self.records += 1
        return True

    def _resize(self) -> None:
        for g in self.gpus.values():
            g.history = self.history
            g.util_hist = deque(g.util_hist, maxlen=self.history)
            g.mem_hist = deque(g.mem_hist, maxlen=self.history)
        if self.host is not None:
            self.host.history = self.history
            self.host.cpu_hist = deque(self.host.cpu_hist, maxlen=self.history)

    def reset(self) -> None:
        """Forget everything (the file was replaced: a new agent, or a rotation)."""
        self.meta, self.gpus, self.disk, self.host = {}, {}, None, None
        self.records, self.last_t = 0, 0.0
        self.version += 1

    # -- following the file -------------------------------------------------------------------
    def read_request(self) -> tuple[str, int]:
        """The (run-relative path, offset) to read next through the console's transport."""
        return self.path, self._offset

    def ingest(self, data: bytes, size: int, ino: int = 0) -> bool:
        """Apply bytes read at :meth:`read_request`'s offset (``size``: the file's size, -1 if absent).

        On the first read of a long file only its first line (the ``meta`` record) is used and the
        next read jumps to the last ``tail_bytes``, enough for the history; a rotated or replaced
        file starts over, keeping the history. Returns True when the meters changed.
        """
        if size < 0:
            return False
        if (self._ino and ino and ino != self._ino) or size < self._offset:
            self._offset, self._primed, self._skip_partial, self._buf = 0, False, False, b""
            self._ino = ino
            return False
        self._ino = ino
        if not self._primed:
            self._primed = True
            if self._offset == 0 and size > self.tail_bytes:
                first, nl, _ = data.partition(b"\n")
                changed = bool(nl) and self.feed([first]) > 0
                self._offset, self._skip_partial = size - self.tail_bytes, True
                return changed
        end = data.rfind(b"\n")
        if end < 0:
            return False
        lines = data[: end + 1].splitlines()
        self._offset += end + 1
        if self._skip_partial and lines:
            lines, self._skip_partial = lines[1:], False
        return self.feed(lines) > 0


def telemetry_path(stage_id: str = "telemetry") -> str:
    """Run-relative path of a telemetry stage's file."""
    return f"stages/{stage_id}/out/{TELEMETRY_FILE}"


def find_telemetry_stage(stages: Iterable[Any]) -> str | None:
    """The id of the first stage running ``pipeline.stages.telemetry`` (``StageSpec``-like objects or dicts)."""
    for s in stages:
        run = s.get("run") if isinstance(s, dict) else getattr(s, "run", None)
        sid = s.get("id") if isinstance(s, dict) else getattr(s, "id", None)
        if run == "telemetry" and sid:
            return str(sid)
    return None
