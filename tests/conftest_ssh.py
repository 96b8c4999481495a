"""Fixtures for the SSH tests: a real loopback sshd, its known_hosts, and ssh plans pointing at it.

Loaded by the SSH test modules with ``pytest_plugins = ["conftest_ssh"]``. Every test gets its own
sshd (started in ~50 ms) so stopping, restarting or re-keying it never leaks into another test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from runs import kill_run_stages
from sshd import LoopbackSshd, sshd_available

from console.ssh.connection import HostConnection, SshTarget
from pipeline.run.hosts.procs import ProcIdentity, StrangerError, signal_group
from pipeline.run.rundir.layout import RunDir, read_json


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[LoopbackSshd]:
    why = sshd_available()
    if why:
        if os.environ.get("AERIE_REQUIRE_SSHD") == "1":  # CI: these tests must run, not skip
            pytest.fail(why)
        pytest.skip(why)
    server = LoopbackSshd(tmp_path / "sshd")
    server.start()
    try:
        yield server
    finally:
        server.drop()


@pytest.fixture
def known_hosts(sshd: LoopbackSshd, tmp_path: Path) -> Path:
    """A known_hosts file that trusts the loopback sshd's host key (and nothing else)."""
    return sshd.write_known_hosts(tmp_path / "known_hosts")


@pytest.fixture
def target(sshd: LoopbackSshd, known_hosts: Path) -> SshTarget:
    return SshTarget(
        host="127.0.0.1",
        port=sshd.port,
        user=sshd.user,
        identity=str(sshd.client_key),
        known_hosts=str(known_hosts),
        keepalive_s=1.0,
        connect_timeout_s=5.0,
    )


@pytest.fixture
def fast_conn(target: SshTarget) -> Callable[..., HostConnection]:
    """A connection factory with a short reconnect backoff (tests do not wait 15 s)."""

    def make(t: SshTarget | None = None) -> HostConnection:
        return HostConnection(t or target, backoff_s=(0.1, 0.5))

    return make


@pytest.fixture
def ssh_plan(sshd: LoopbackSshd, known_hosts: Path, tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Write an ssh plan for the loopback sshd; ``stages`` is the TOML of its [[stage]] tables.

    Afterwards the runs these plans created on the "remote" are stopped by their recorded
    identities (stage groups, then the supervisor), so a failing test leaves nothing running.
    """
    remotes: list[Path] = []

    def write(
        stages: str,
        name: str = "plan.toml",
        remote_dir: Path | None = None,
        python: str = sys.executable,
        options: str = "",
        executor: str | None = None,
    ) -> Path:
        remote = remote_dir or tmp_path / "remote" / "not" / "yet" / "there" / "run"
        remotes.append(remote)
        ex = executor or textwrap.dedent(f"""\
            host = "127.0.0.1"
            port = {sshd.port}
            user = "{sshd.user}"
            identity = "{sshd.client_key}"
            """)
        body = (
            f'[run]\nname = "ssh-test"\ndir = "local-run"\n\n[executor]\nkind = "ssh"\n{ex}'
            f'remote_dir = "{remote}"\npython = "{python}"\n'
            f'options = {{known_hosts = "{known_hosts}", keepalive_s = 1.0{", " + options if options else ""}}}\n\n'
            "[resources]\ncpu_slots = 2\n\n" + textwrap.dedent(stages)
        )
        path = tmp_path / name
        path.write_text(body)
        return path

    yield write
    for remote in remotes:
        stop_remote_run(remote)


def stop_remote_run(root: Path) -> None:
    """Stop a run's stage groups and its supervisor by their recorded pid + start time (never by name)."""
    run = RunDir(root)
    if not run.exists():
        return
    kill_run_stages(run)
    rec = read_json(run.supervisor_path)
    if rec:
        with contextlib.suppress(StrangerError, PermissionError):
            signal_group(ProcIdentity.from_dict(rec), signal.SIGTERM)
