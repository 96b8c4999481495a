"""Why a stage died of a signal: the kernel's OOM killer, or someone else.

A stage the kernel kills for memory simply receives SIGKILL; nothing in the exit status says why.
The launcher therefore takes a reading of the OOM counters when an attempt starts and again when it
ends, and :func:`describe` turns a signal death into a sentence an operator can act on:

* the memory cgroup the stage ran in (cgroup v2 ``memory.events`` ``oom_kill``, or v1
  ``memory.oom_control`` ``oom_kill``) counted a new OOM kill: the stage hit the cgroup's memory
  limit (the container's, or one the operator set);
* else the host's ``/proc/vmstat`` ``oom_kill`` counter rose: the kernel ran out of memory host-wide
  and chose this stage;
* else a SIGKILL that Aerie did not send came from outside (an operator, a scheduler, a container
  runtime) — the OOM killer stays the likely cause when no counter can be read, and the message says so.

Only the standard library; it runs on the executing host.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class OomReading:
    """OOM kill counters at one moment (None: not readable here)."""

    cgroup: str | None  # the memory cgroup's path, e.g. "/aerie-test-1"
    cgroup_kills: int | None
    host_kills: int | None

    def to_dict(self) -> dict[str, object]:
        return {"cgroup": self.cgroup, "cgroup_kills": self.cgroup_kills, "host_kills": self.host_kills}

    @classmethod
    def from_dict(cls, d: dict) -> OomReading:
        return cls(d.get("cgroup"), d.get("cgroup_kills"), d.get("host_kills"))


def _counter(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        return None
    return None


def memory_cgroup(pid: int | str = "self") -> tuple[str | None, Path | None]:
    """The memory cgroup of ``pid`` and the file holding its OOM kill counter (v1 or v2)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:  # cgroup v1: "4:memory:/path"
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            f = CGROUP_ROOT / "memory" / path.lstrip("/") / "memory.oom_control"
            return path, f if f.is_file() else None
    for (
        line
    ) in lines:  # cgroup v2: "0::/path" (mounted at /sys/fs/cgroup, or /sys/fs/cgroup/unified in hybrid mode)
        hier, _, path = line.split(":", 2)
        if hier == "0":
            for base in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
                f = base / path.lstrip("/") / "memory.events"
                if f.is_file():
                    return path, f
            return path, None
    return None, None


def reading(pid: int | str = "self") -> OomReading:
    path, counter = memory_cgroup(pid)
    return OomReading(
        path, _counter(counter, "oom_kill") if counter else None, _counter(Path("/proc/vmstat"), "oom_kill")
    )


def describe(sig: int, before: OomReading | None, after: OomReading | None, sent_by_aerie: bool) -> str:
    """One line: which signal, and the likely cause."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    head = f"killed by signal {sig} ({name})"
    if sent_by_aerie:
        return f"{head}, sent by Aerie (kill)"
    if sig != signal.SIGKILL:
        return head
    if before and after:
        if (
            before.cgroup == after.cgroup
            and before.cgroup_kills is not None
            and after.cgroup_kills is not None
            and after.cgroup_kills > before.cgroup_kills
        ):
            return (
                f"{head}: out of memory — the kernel's OOM killer, at the memory limit of cgroup "
                f"{after.cgroup} (oom_kill {before.cgroup_kills} -> {after.cgroup_kills}); give the stage "
                "more memory or smaller batches, then retry"
            )
        if before.cgroup != after.cgroup and after.cgroup_kills:
            return (
                f"{head}: out of memory — the kernel's OOM killer, at the memory limit of cgroup "
                f"{after.cgroup} (oom_kill {after.cgroup_kills}); give the stage more memory or smaller "
                "batches, then retry"
            )
        if (
            before.host_kills is not None
            and after.host_kills is not None
            and after.host_kills > before.host_kills
        ):
            return (
                f"{head}: out of memory — the kernel's OOM killer ran on this host during the attempt "
                f"(oom_kill {before.host_kills} -> {after.host_kills}); free memory or use smaller batches, "
                "then retry"
            )
        if after.cgroup_kills is not None or after.host_kills is not None:
            return (
                f"{head}, not sent by Aerie and no OOM kill was recorded: something outside Aerie killed it "
                "(an operator, a scheduler or container runtime); likely cause otherwise: out of memory"
            )
    return f"{head}, not sent by Aerie: likely the kernel's OOM killer (out of memory), or a kill from outside Aerie"
