"""Hostile paths over SSH (issue 18, item 5): a remote run directory full of shell syntax is used verbatim.

Over SSH, Aerie's commands do pass through the remote user's shell (exec channels), so this is where a
path with spaces, quotes, ``;``, ``$()``, backquotes or non-ASCII could be interpreted. A real plan on a
real sshd with such a ``remote_dir`` goes through preflight (makedirs, SFTP upload of the pipeline,
plan check on the host), starts its supervisor, runs, is watched, and is controlled (a retry through
``pipeline.run.supervise.ctl`` on the host): everything succeeds, the stage sees its run directory byte for byte,
and nothing named in the path is ever executed.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from console.model import RunModel
from console.ssh.connection import HostConnection, SshTarget
from console.ssh.preflight import preflight
from console.ssh.transport import SshTransport, start_remote_run
from pipeline.run.plan import dag as plan_mod

pytest_plugins = ["conftest_ssh"]
pytestmark = [pytest.mark.ssh, pytest.mark.slow]

# The substitutions only print: if a shell ever interpreted the path it would name another directory (still
# under the test's tmp dir, where the test looks for it) — a regression never touches anything else.
WEIRD = "re mote; $(printf PWNED1) `printf PWNED2` 'q' é ☃"


async def poll_until(model: RunModel, pred, timeout_s: float = 60.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await model.poll()
        if pred():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out; model error={model.error!r}")


async def test_a_remote_run_dir_full_of_shell_syntax_is_used_verbatim(ssh_plan, tmp_path: Path) -> None:
    remote = tmp_path / WEIRD / "run"
    plan_path = ssh_plan(
        """
        [[stage]]
        id = "where"
        command = 'printf "%s" "$AERIE_RUN_DIR" > where.txt; test -f again || { touch again; exit 1; }'
        """,
        remote_dir=remote,
        options='pipeline = "upload"',
    )
    plan = plan_mod.load(plan_path)
    rep = await preflight(plan)
    assert rep.ok, rep.render()
    assert rep.layout is not None and rep.layout.pythonpath and WEIRD in rep.layout.pythonpath
    async with HostConnection(SshTarget.from_executor(plan.executor)) as conn:
        await start_remote_run(conn, rep.layout)
        transport = SshTransport(conn, rep.layout, owns_connection=False)
        model = RunModel(transport)
        await poll_until(model, lambda: model.done)
        assert {s: v.state for s, v in model.stages.items()} == {
            "where": "failed"
        }  # attempt 1 fails on purpose
        res = await transport.ctl("retry", "where")  # a control action through the host's shell
        assert res.returncode == 0, res.stderr
        await poll_until(model, lambda: model.stages["where"].attempt == 2 and model.done)
        assert model.stages["where"].state == "succeeded"
        await transport.close()
    assert (remote / "stages" / "where" / "out" / "where.txt").read_text() == str(remote)
    assert not [p for p in tmp_path.rglob("*PWNED*") if "$(" not in p.name], "a $() or backquote was executed"
