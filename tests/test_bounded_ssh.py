"""Bounded reads over SSH (issue 37, item 4): through a real loopback sshd and the remote agent, the console keeps
reading a stage's events past a 5 MiB line, and fills its board from a state.json of 10,000 stages (read in
bounded answers, :func:`console.transport.read_whole`)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from runs import wait_for
from test_bounded import N_BIG, big_run

from console.model import READ_WINDOW, RunModel
from console.ssh.connection import HostConnection
from console.ssh.preflight import preflight
from console.ssh.transport import SshTransport, start_remote_run
from pipeline.run.plan import dag as plan_mod
from pipeline.run.rundir.layout import RunDir
from pipeline.run.supervise.run_setup import supervisor_alive

pytest_plugins = ["conftest_ssh"]
pytestmark = [pytest.mark.ssh, pytest.mark.slow]

STAGE = """
import sys, time
from pathlib import Path
from pipeline.run.stage_side.runtime import StageContext
ctx = StageContext.from_env()
ctx.progress(1, 2, unit="steps", force=True)
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.05)
with open(ctx.events_path, "ab") as fh:  # bypassing the event writer: one 5 MiB line
    fh.write(b'{"type":"message","t":1,"level":"info","text":"' + b"x" * (5 << 20) + b'"}\\n')
ctx.progress(2, 2, unit="steps", force=True)
ctx.message("after the long line")
"""


async def poll_until(model: RunModel, pred: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await model.poll()
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; model error={model.error!r}")


async def test_over_ssh_a_5mib_line_is_skipped_and_a_10000_stage_state_fills_the_model(
    ssh_plan: Callable[..., Path], fast_conn: Callable[..., HostConnection], tmp_path: Path
) -> None:
    (tmp_path / "stage.py").write_text(STAGE)
    go = tmp_path / "go"
    plan_path = ssh_plan(
        f'[[stage]]\nid = "big"\ncommand = "{sys.executable} {tmp_path / "stage.py"} {go}"\n'
    )
    plan = plan_mod.load(plan_path)
    remote = RunDir(plan.executor.remote_dir)
    async with fast_conn() as conn:
        rep = await preflight(plan, conn)
        assert rep.ok and rep.layout is not None, rep.render()
        await start_remote_run(conn, rep.layout)
        transport = SshTransport(conn, rep.layout, owns_connection=False)
        try:
            model = RunModel(transport)
            await poll_until(
                model, lambda: "big" in model.stages and model.stages["big"].progress.done == 1, "p1"
            )
            go.touch()  # attached and reading when the 5 MiB line lands
            texts = lambda: [getattr(e, "text", None) for e in model.stages["big"].events]  # noqa: E731
            await poll_until(model, lambda: "after the long line" in texts(), "the event after the long line")
            assert any(f"{READ_WINDOW:,}-byte window" in str(t) for t in texts())

            # The run is done and its supervisor gone; a 10,000-stage snapshot takes its state.json's place.
            await poll_until(model, lambda: model.done, "the run done")
            wait_for(lambda: not supervisor_alive(remote), timeout=30, what="the supervisor's exit")
            (tmp_path / "big").mkdir()
            big = big_run(tmp_path / "big")
            big.state_path.replace(remote.state_path)
            assert remote.state_path.stat().st_size > 4 * READ_WINDOW
            await poll_until(model, lambda: len(model.order) == N_BIG, "10,000 stages in the model")
            assert model.error is None and model.stages["s09999"].progress.done == 9999
        finally:
            await transport.close()
