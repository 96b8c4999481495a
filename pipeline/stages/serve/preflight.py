"""Checks before a server starts: the port is free, the stage's GPUs hold no one else's process.

A taken port is named with the process listening on it when ``/proc`` shows it. The GPU check
reuses :mod:`pipeline.run.hosts.gpus` (NVML; a host without NVML cannot be checked and says so).
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Any

from pipeline.run.rundir.layout import RunDir


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now (``[serve] port = 0``)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _listen_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


def port_holder(port: int) -> str | None:
    """``'pid 123 (python3)'`` for the process listening on ``port``, when ``/proc`` tells."""
    inodes = _listen_inodes(port)
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path) in targets:
                    comm = Path(f"/proc/{entry.name}/comm").read_text().strip()
                    return f"pid {entry.name} ({comm})"
        except OSError:
            continue
    return "a process this user cannot see"


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, or ``None`` when it is free."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                who = port_holder(port)
                return f"port {port} on {host} is already in use" + (f" by {who}" if who else "")
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def gpu_problem(
    gpus: tuple[int, ...], run_root: Path | None, stage_id: str, probe: Any = None
) -> tuple[str | None, str | None]:
    """``(problem, note)``: a refusal naming the GPU, pid and owner of each process on ``gpus`` that
    is not this stage's; or a note when GPUs cannot be read on this host. ``probe``: a
    :class:`pipeline.run.hosts.gpus.GpuProbe` (default: real NVML)."""
    if not gpus:
        return None, None
    from pipeline.run.hosts.gpus import GpuProbe

    probe = probe or GpuProbe()
    holders = probe.holders(RunDir(run_root) if run_root else None)
    if holders is None:
        return None, f"GPU guard skipped: {probe.unavailable}"
    taken = []
    for g in gpus:
        if g not in holders:
            taken.append(f"GPU {g} does not exist on this host (GPUs: {sorted(holders)})")
        for p in holders.get(g, []):
            if p.get("owner") == stage_id:
                continue
            who = "foreign" if p.get("owner") == "foreign" else f"of stage {p.get('owner')}"
            taken.append(f"GPU {g} held by pid {p['pid']} ({p.get('name') or '?'}, {who})")
    return ("; ".join(taken) or None), None
