"""The console's event stream and audit view over SSH (a real loopback sshd, conftest_ssh) follow an
events file and the audit log across their rotations: through the remote agent, every event and entry
arrives once, in order, none lost at the boundary."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from console.audit_trail import AuditTrail
from console.model import RunModel
from console.ssh.connection import HostConnection, SshTarget
from console.ssh.transport import RemoteLayout, SshTransport
from pipeline.run.rundir import audit
from pipeline.run.rundir.events import Event, EventWriter
from pipeline.run.rundir.layout import write_json
from tests.runs import ROOT

pytest_plugins = ["conftest_ssh"]
pytestmark = [pytest.mark.ssh]


async def test_events_and_audit_across_rotation_over_ssh(
    tmp_path: Path, target: SshTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AERIE_ROTATE_BYTES_EVENTS", "1500")
    monkeypatch.setenv("AERIE_ROTATE_BYTES_AUDIT", "900")
    run = tmp_path / "run"
    (run / "stages").mkdir(parents=True)
    (run / "plan.toml").write_text("[run]\nname = 'r'\n")  # what the agent checks for a run dir
    write_json(run / "state.json", {"run": "r", "stages": [{"id": "a", "family": "a", "state": "running"}]})
    layout = RemoteLayout(root=str(run), python=sys.executable, pythonpath=str(ROOT))
    transport = SshTransport(HostConnection(target), layout)
    model = RunModel(transport, backfill=False)
    trail = AuditTrail(transport)
    applied: list[Event] = []
    model.listeners.append(lambda st, ev: applied.append(ev))
    try:
        await model.poll()
        with EventWriter(run / "stages" / "a" / "events.jsonl") as w:
            w.emit("started", attempt=1, pid=1)
            for i in range(150):
                w.emit("progress", done=i, total=150)
                if i % 5 == 0:
                    audit.append(run, audit.entry("pause", f"s{i}", "done", via="console", who="ana@laptop"))
                if i % 6 == 0:
                    await model.poll()
                    await trail.poll()
        for _ in range(8):
            await model.poll()
            await trail.poll()
    finally:
        await transport.close()
    assert (run / "stages" / "a" / "events.3.jsonl").exists() and (run / "audit.2.jsonl").exists()
    assert [e.get("done") for e in applied if e.type == "progress"] == list(range(150))
    assert [e.type for e in applied].count("started") == 1
    assert [e.stage for e in trail.entries] == [f"s{i}" for i in range(0, 150, 5)]


async def test_preflight_creates_the_remote_run_dir_private(ssh_plan) -> None:  # noqa: ANN001
    """The SSH bootstrap makes the remote run dir and its ``.aerie`` 0700 and what it writes 0600, whatever
    the sshd's umask, before any supervisor tightens it."""
    from console.ssh.preflight import preflight
    from pipeline.run.plan import dag as plan_mod

    plan = plan_mod.load(ssh_plan('[[stage]]\nid = "a"\ncommand = "true"\n'))
    remote = Path(plan.executor.remote_dir)
    rep = await preflight(plan)
    assert rep.ok, rep.render()
    assert remote.stat().st_mode & 0o777 == 0o700
    assert (remote / ".aerie").stat().st_mode & 0o777 == 0o700
    assert (remote / ".aerie" / "layout.json").stat().st_mode & 0o777 == 0o600
