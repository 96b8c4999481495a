"""GPU readings behind one small interface, and who owns each GPU process.

:class:`GpuSource` is what the telemetry agent and the GPU guard ask for GPU state: ``open()``
returns facts about the driver (or raises :class:`GpuUnavailable` with a reason an operator can
act on), ``sample()`` returns one plain dict per GPU. :class:`NvmlSource` is the real one, on
``nvidia-ml-py`` (``pynvml``); every optional NVML query (ECC, XID events, clocks) that a device or
a sandbox does not support becomes ``None`` instead of an error. :class:`FakeNvmlReplay` is a fake
NVML for tests and benchmarks on machines without a GPU: it replays GPU records recorded on a real
GPU (``tests/fixtures/telemetry/``), optionally replicated to more GPUs.

:func:`owner_map` and :func:`owner_of` map a GPU process to the Aerie stage that launched it,
through the pgid its launcher recorded in ``stages/<id>/proc.json`` (or the pgid of an ancestor,
for a child that started its own session); everything else is ``"foreign"``.

Plan GPU ids are NVML indices (the numbers ``nvidia-smi`` shows).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from pipeline.run.hosts.procs import ProcIdentity, read_stat
from pipeline.run.rundir.layout import RunDir, read_json

FOREIGN = "foreign"


class GpuUnavailable(RuntimeError):
    """No GPU readings on this host (no driver, no library, NVML failed); the text says which."""


class GpuSource(Protocol):
    def open(self) -> dict[str, Any]:
        """Start the source; returns ``{driver, nvml, count, source}``. Raises :class:`GpuUnavailable`."""
        ...

    def sample(self) -> list[dict[str, Any]]:
        """One dict per GPU (see :meth:`NvmlSource.sample` for the fields)."""
        ...

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------- NVML
def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


class NvmlSource:
    """Real GPU readings through NVML (``nvidia-ml-py``)."""

    def __init__(self) -> None:
        self._nv: Any = None
        self._handles: list[Any] = []
        self._static: list[dict[str, Any]] = []
        self._events: Any = None
        self._xid_supported = False

    def open(self) -> dict[str, Any]:
        try:
            import pynvml as nv
        except ImportError:
            raise GpuUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from None
        try:
            nv.nvmlInit()
        except nv.NVMLError_LibraryNotFound:
            raise GpuUnavailable(
                "no NVIDIA driver on this host (NVML library libnvidia-ml.so.1 not found)"
            ) from None
        except nv.NVMLError_DriverNotLoaded:
            raise GpuUnavailable("the NVIDIA driver is not loaded on this host") from None
        except nv.NVMLError as exc:
            raise GpuUnavailable(f"NVML failed to start: {exc}") from None
        except OSError as exc:  # a broken library file
            raise GpuUnavailable(f"NVML could not be loaded: {exc}") from None
        self._nv = nv
        try:
            count = nv.nvmlDeviceGetCount()
            self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except nv.NVMLError as exc:
            self.close()
            raise GpuUnavailable(f"NVML cannot list the GPUs: {exc}") from None
        self._static = [self._static_info(i, h) for i, h in enumerate(self._handles)]
        self._open_xid_events()
        return {
            "source": "nvml",
            "driver": self._try(nv.nvmlSystemGetDriverVersion, conv=_text),
            "nvml": self._try(nv.nvmlSystemGetNVMLVersion, conv=_text),
            "cuda_driver": self._try(nv.nvmlSystemGetCudaDriverVersion_v2),
            "count": len(self._handles),
            "xid_events": self._xid_supported,
        }

    def _try(self, fn: Any, *args: Any, conv: Any = None) -> Any:
        try:
            v = fn(*args)
        except self._nv.NVMLError:
            return None
        return conv(v) if conv is not None and v is not None else v

    def _static_info(self, i: int, h: Any) -> dict[str, Any]:
        nv = self._nv
        return {
            "index": i,
            "name": self._try(nv.nvmlDeviceGetName, h, conv=_text),
            "uuid": self._try(nv.nvmlDeviceGetUUID, h, conv=_text),
            "sm_clock_max_mhz": self._try(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
        }

    def _open_xid_events(self) -> None:
        nv = self._nv
        try:
            self._events = nv.nvmlEventSetCreate()
            for h in self._handles:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._events)
            self._xid_supported = True
        except nv.NVMLError:
            self._xid_supported = False

    def _drain_xids(self) -> dict[int, list[int]]:
        """XID critical errors that arrived since the last sample, by GPU index (never blocks)."""
        out: dict[int, list[int]] = {}
        if not self._xid_supported:
            return out
        nv = self._nv
        for _ in range(64):
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:  # Timeout: nothing pending (or the wait is not supported)
                break
            idx = self._try(nv.nvmlDeviceGetIndex, data.device)
            out.setdefault(int(idx) if idx is not None else -1, []).append(int(data.eventData))
        return out

    def _procs(self, h: Any) -> list[dict[str, Any]] | None:
        nv = self._nv
        seen: dict[int, dict[str, Any]] = {}
        ok = False
        for kind, fn in (
            ("compute", nv.nvmlDeviceGetComputeRunningProcesses),
            ("graphics", nv.nvmlDeviceGetGraphicsRunningProcesses),
        ):
            try:
                plist = fn(h)
            except nv.NVMLError:
                continue
            ok = True
            for p in plist:
                mem = p.usedGpuMemory
                prev = seen.get(p.pid)
                if prev is None:
                    seen[p.pid] = {
                        "pid": int(p.pid),
                        "mem": int(mem) if mem is not None else None,
                        "type": kind,
                    }
                elif mem is not None:
                    prev["mem"] = (prev["mem"] or 0) + int(mem)
        return list(seen.values()) if ok else None

    def sample(self) -> list[dict[str, Any]]:
        nv = self._nv
        if nv is None:
            raise GpuUnavailable("NVML is not open")
        xids = self._drain_xids()
        out = []
        for st, h in zip(self._static, self._handles, strict=True):
            util = self._try(nv.nvmlDeviceGetUtilizationRates, h)
            mem = self._try(nv.nvmlDeviceGetMemoryInfo, h)
            power = self._try(nv.nvmlDeviceGetPowerUsage, h)
            cap = self._try(nv.nvmlDeviceGetEnforcedPowerLimit, h)
            rec = {
                **st,
                "util": util.gpu if util is not None else None,
                "mem_util": util.memory if util is not None else None,
                "mem_used": int(mem.used) if mem is not None else None,
                "mem_total": int(mem.total) if mem is not None else None,
                "temp_c": self._try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                "power_w": round(power / 1000.0, 1) if power is not None else None,
                "power_cap_w": round(cap / 1000.0, 1) if cap is not None else None,
                "sm_clock_mhz": self._try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
                "pstate": self._try(nv.nvmlDeviceGetPerformanceState, h),
                "ecc_uncorrected": self._try(
                    nv.nvmlDeviceGetTotalEccErrors,
                    h,
                    nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    nv.NVML_VOLATILE_ECC,
                ),
                "ecc_corrected": self._try(
                    nv.nvmlDeviceGetTotalEccErrors,
                    h,
                    nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                    nv.NVML_VOLATILE_ECC,
                ),
                "xid": xids.get(st["index"], []) if self._xid_supported else None,
                "procs": self._procs(h),
            }
            out.append(rec)
        return out

    def close(self) -> None:
        if self._nv is None:
            return
        try:
            if self._events is not None:
                self._nv.nvmlEventSetFree(self._events)
            self._nv.nvmlShutdown()
        except self._nv.NVMLError:
            pass
        self._nv, self._events = None, None


# ---------------------------------------------------------------------------------- the fake
GPU_FIELDS = (
    "index",
    "name",
    "uuid",
    "sm_clock_max_mhz",
    "util",
    "mem_util",
    "mem_used",
    "mem_total",
    "temp_c",
    "power_w",
    "power_cap_w",
    "sm_clock_mhz",
    "pstate",
    "ecc_uncorrected",
    "ecc_corrected",
    "xid",
    "procs",
)


class FakeNvmlReplay:
    """A FAKE NVML: replays GPU records recorded by the telemetry agent on a real GPU.

    Each call of :meth:`sample` returns the next recorded sample (cycling). ``replicate=8`` turns a
    one-GPU recording into eight GPUs (indices 0..7, copies of the recorded GPU, uuids suffixed),
    for benchmarks and rendering tests of a full node. Owners are stripped: they are derived anew.
    """

    def __init__(self, fixture: Path | str, replicate: int = 1) -> None:
        self.fixture = Path(fixture)
        self.replicate = replicate
        self.meta: dict[str, Any] = {}
        self.samples: list[list[dict[str, Any]]] = []
        self._i = 0

    def open(self) -> dict[str, Any]:
        by_seq: dict[int, list[dict[str, Any]]] = {}
        for n, line in enumerate(self.fixture.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{self.fixture}: line {n}: not JSON: {exc}") from None
            if rec.get("kind") == "meta" and not self.meta:
                self.meta = dict(rec.get("nvml") or {})
            elif rec.get("kind") == "gpu":
                g = {k: rec.get(k) for k in GPU_FIELDS}
                if g["procs"] is not None:
                    g["procs"] = [{k: p.get(k) for k in ("pid", "mem", "type")} for p in g["procs"]]
                by_seq.setdefault(int(rec.get("seq", n)), []).append(g)
        if not by_seq:
            raise GpuUnavailable(f"{self.fixture}: no GPU records to replay")
        self.samples = [by_seq[k] for k in sorted(by_seq)]
        count = len(self.samples[0]) * self.replicate
        return {**self.meta, "source": f"fake-nvml-replay:{self.fixture.name}", "count": count}

    def sample(self) -> list[dict[str, Any]]:
        base = self.samples[self._i % len(self.samples)]
        self._i += 1
        out = []
        for r in range(self.replicate):
            for g in base:
                c = dict(g)
                c["index"] = r * len(base) + int(g["index"] or 0)
                if r and c.get("uuid"):
                    c["uuid"] = f"{c['uuid']}-replica{r}"
                if c["procs"] is not None:
                    c["procs"] = [dict(p) for p in c["procs"]]
                out.append(c)
        return out

    def close(self) -> None:
        return None


# ------------------------------------------------------------------------------- ownership
def proc_name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def owner_map(run: RunDir | None) -> dict[int, str]:
    """pgid -> stage id for the latest launched attempt of every stage that recorded a process group.

    A group whose leader has exited still counts while members remain (a pgid is not reused while
    its group exists), unless the leader's pid now belongs to a new process leading a new group.
    """
    out: dict[int, str] = {}
    if run is None or not run.stages_dir.is_dir():
        return out
    for sid in run.stage_ids():
        try:
            proc = read_json(run.stage(sid).proc)
        except (ValueError, OSError):
            continue
        if not proc:
            continue
        try:
            ident = ProcIdentity.from_dict(proc)
        except (KeyError, TypeError, ValueError):
            continue
        if not ident.is_same_process():
            st = read_stat(ident.pid)
            if st is not None and ident.pid == ident.pgid and st.pgid == ident.pgid:
                continue  # recycled leader pid leading a new group: not ours
        out[ident.pgid] = sid
    return out


def owner_of(pid: int, groups: dict[int, str], max_depth: int = 32) -> str:
    """The stage owning ``pid`` (its pgid, or an ancestor's, was recorded), else ``"foreign"``."""
    cur = pid
    for _ in range(max_depth):
        st = read_stat(cur)
        if st is None:
            return FOREIGN
        if st.pgid in groups:
            return groups[st.pgid]
        if st.ppid <= 1:
            return FOREIGN
        cur = st.ppid
    return FOREIGN


def annotate_owners(gpus: Iterable[dict[str, Any]], run: RunDir | None) -> None:
    """Add ``owner`` and ``name`` to every process of every GPU record, in place."""
    groups: dict[int, str] | None = None
    for g in gpus:
        for p in g.get("procs") or ():
            if groups is None:
                groups = owner_map(run)
            pid = int(p["pid"])
            p["owner"] = owner_of(pid, groups)
            p["name"] = proc_name(pid)


# --------------------------------------------------------------------------------- holders
class GpuProbe:
    """A cached view of which processes hold which GPU, for admission checks (TTL seconds).

    The source is opened on first use; when it is unavailable (no driver) that is remembered and
    :meth:`holders` returns ``None`` from then on: a host without NVML cannot be checked.
    """

    def __init__(self, source: GpuSource | None = None, ttl_s: float = 2.0) -> None:
        self.source = source or NvmlSource()
        self.ttl_s = ttl_s
        self.unavailable: str | None = None
        self._opened = False
        self._cache: tuple[float, list[dict[str, Any]]] | None = None

    def readings(self) -> list[dict[str, Any]] | None:
        if self.unavailable:
            return None
        now = time.monotonic()
        if self._cache and now - self._cache[0] < self.ttl_s:
            return self._cache[1]
        try:
            if not self._opened:
                self.source.open()
                self._opened = True
            gpus = self.source.sample()
        except GpuUnavailable as exc:
            self.unavailable = str(exc)
            return None
        self._cache = (now, gpus)
        return gpus

    def holders(self, run: RunDir | None) -> dict[int, list[dict[str, Any]]] | None:
        """GPU index -> its processes (pid, mem, owner, name); ``None`` when GPUs cannot be read."""
        gpus = self.readings()
        if gpus is None:
            return None
        gpus = [dict(g, procs=[dict(p) for p in g.get("procs") or ()]) for g in gpus]
        annotate_owners(gpus, run)
        return {int(g["index"]): g["procs"] for g in gpus}
