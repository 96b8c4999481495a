"""Read-only watchers and the audit log over SSH: the console on a real loopback sshd (conftest_ssh).

Cheap by design: the run is created and supervised on this machine and reached through sshd with the
layout bootstrap would have recorded, so there is no preflight or upload — only the connection, the
remote agent and ``pipeline.run.supervise.ctl`` on the "host", which is what a watcher and an action go through.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from console.app import AerieApp
from console.ssh.connection import HostConnection, SshTarget
from console.ssh.transport import LAYOUT_FILE, RemoteLayout, SshTransport
from pipeline.run.rundir import audit
from pipeline.run.rundir.layout import RunDir
from tests.runs import ROOT, kill_run_stages, make_run, start_supervisor, stop
from tests.test_audit import entries
from tests.test_console import WORKER, until

pytest_plugins = ["conftest_ssh"]
pytestmark = [pytest.mark.ssh]


@pytest.fixture
def run_over_ssh(tmp_path: Path) -> Iterator[RunDir]:
    (tmp_path / "w.py").write_text(WORKER)
    run = make_run(
        tmp_path,
        f"""
        [run]
        name = "watched"
        dir = "run"
        [[stage]]
        id = "work"
        command = "{sys.executable} {tmp_path / "w.py"} 600"
    """,
    )
    layout = RemoteLayout(root=str(run.root), python=sys.executable, pythonpath=str(ROOT))
    (run.root / LAYOUT_FILE).parent.mkdir(parents=True, exist_ok=True)
    (run.root / LAYOUT_FILE).write_text(layout.to_json())
    sup = start_supervisor(run)
    yield run
    stop(sup)
    kill_run_stages(run)


async def _press_pause(layout: RemoteLayout, target: SshTarget, read_only: bool) -> AerieApp:
    """A console over SSH on the running stage; ``p`` pressed once."""
    transport = SshTransport(HostConnection(target), layout)
    app = AerieApp(transport, poll_s=0.2, alerts=False, user_config={}, read_only=read_only)
    stages = app.model.stages
    async with app.run_test(size=(140, 36)) as pilot:
        await until(pilot, lambda: "work" in stages and stages["work"].state == "running", what="running")
        await pilot.press("p")
        if read_only:
            await pilot.pause(0.5)
        else:
            await until(pilot, lambda: stages["work"].state == "paused", what="paused over ssh")
    await transport.close()
    return app


async def test_over_ssh_a_read_only_console_sends_nothing_and_a_full_one_is_audited(
    run_over_ssh: RunDir, target: SshTarget
) -> None:
    run = run_over_ssh
    layout = RemoteLayout.from_json((run.root / LAYOUT_FILE).read_text(), "layout")
    app = await _press_pause(layout, target, read_only=True)
    assert [n.message[:36] for n in app._notifications] == ["read-only: this console only watches"]
    assert not (run.root / "requests").exists() and not (run.root / audit.AUDIT_FILE).exists()
    assert app.model.stages["work"].state == "running"

    await _press_pause(layout, target, read_only=False)
    (line,) = entries(run)
    assert (line["action"], line["stage"], line["via"], line["outcome"]) == (
        "pause",
        "work",
        "console",
        "done",
    )
    assert line["who"] == audit.identity()  # the operator where the console runs, sent over the link
