"""Reaching a run directory on a host that Aerie's ssh bootstrap did not set up: a run started there with
``aerie run`` or ``aerie demo`` (or ``python -m pipeline.run.supervise.run_setup``), so it has no
``.aerie/layout.json`` saying which interpreter and which ``pipeline`` to run its agent with.

:func:`adopt_layout` finds them the way the run itself was run: the interpreter its supervisor recorded in
``supervisor.json`` (``python``), else the host's ``python3``; it probes that interpreter (the preflight's probe:
version, the run dir, the host's ``pipeline`` and its agent protocol) and, when the host has no ``pipeline`` that
speaks this console's protocol, uploads this console's copy into ``RUN/.aerie/pkg-<hash>/`` (as the preflight
does; the only thing it writes, and only inside the run directory). Nothing is recorded: the next attach probes
again, so an upgrade of the host's Aerie is picked up.
"""

from __future__ import annotations

import json
import posixpath

import asyncssh

from console.ssh.connection import HostConnection, SshError
from console.ssh.preflight import _probe, _upload_package
from console.ssh.transport import AGENT_PROTOCOL, RemoteLayout, sftp_path

FALLBACK_PYTHON = "python3"


async def recorded_python(conn: HostConnection, remote_dir: str) -> str | None:
    """The interpreter the run's supervisor ran under (``RUN/supervisor.json``), if it said."""
    try:
        async with (
            conn.sftp() as sftp,
            sftp.open(sftp_path(posixpath.join(remote_dir, "supervisor.json")), "rb") as fh,
        ):
            rec = json.loads(await fh.read())
    except (asyncssh.SFTPError, ValueError, UnicodeDecodeError):
        return None
    py = rec.get("python") if isinstance(rec, dict) else None
    return py if isinstance(py, str) and py else None


async def adopt_layout(conn: HostConnection, remote_dir: str) -> RemoteLayout:
    """The layout of a run directory without ``layout.json``; :class:`SshError` naming the host and the
    directory when it is no Aerie run, or no usable Python is there."""
    where = f"{conn.target.label}:{remote_dir}"
    tried: list[str] = []
    info: dict | None = None
    for py in dict.fromkeys(p for p in (await recorded_python(conn, remote_dir), FALLBACK_PYTHON) if p):
        found, err = await _probe(conn, py, None, {"root": remote_dir})
        if found is not None and found.get("version_ok"):
            info = found
            break
        tried.append(err or f"{py}: Python {found and found.get('python')} is too old")
    if info is None:
        raise SshError(f"{where}: no Python 3.11+ to read the run with ({'; '.join(tried)})")
    root = str(info["root"])
    if not info.get("plan_sha256"):
        raise SshError(
            f"{conn.target.label}:{root}: no Aerie run there (no plan.toml); start one with `aerie run PLAN`"
        )
    if info.get("protocol") == AGENT_PROTOCOL:
        return RemoteLayout(root=root, python=str(info["executable"]))  # the host's own pipeline
    try:
        async with conn.sftp() as sftp:
            pythonpath, _what = await _upload_package(sftp, root)
    except (asyncssh.SFTPError, OSError) as exc:
        why = info.get("pipeline_error") or f"its pipeline speaks agent protocol {info.get('protocol')}"
        raise SshError(
            f"{conn.target.label}:{root}: the host's Python cannot read the run ({why}) and uploading this "
            f"console's pipeline into {root}/.aerie failed: {exc}"
        ) from None
    return RemoteLayout(root=root, python=str(info["executable"]), pythonpath=pythonpath)
