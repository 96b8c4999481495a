"""The ``aerie`` CLI and the console over SSH, as an operator uses them: ~/.ssh/config alias, real sshd.

HOME points at a temporary directory holding ``.ssh/config`` (alias ``aerie-box``) and
``.ssh/known_hosts``, so nothing here depends on the machine's own ssh setup and the plan names
only the alias — exactly what an operator writes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest_ssh import stop_remote_run
from rich.text import Text
from textual.widgets import Static

from console.app import AerieApp
from console.ssh.commands import start_remote
from pipeline.run.plan import dag as plan_mod

pytest_plugins = ["conftest_ssh"]
pytestmark = [pytest.mark.ssh, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def home(sshd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    (h / ".ssh").mkdir(parents=True)
    kh = sshd.write_known_hosts(h / ".ssh" / "known_hosts")
    cfg = h / ".ssh" / "config"
    cfg.write_text(
        f"Host aerie-box\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
        f"  IdentityFile {sshd.client_key}\n  UserKnownHostsFile {kh}\n"
    )
    monkeypatch.setenv("HOME", str(h))
    return h


@pytest.fixture
def alias_plan(home: Path, tmp_path: Path) -> Iterator[Callable[..., tuple[Path, Path]]]:
    """A plan naming only the alias; the run it creates on the "remote" is stopped afterwards."""
    remote = tmp_path / "remote" / "runs" / "cli"

    def write(stages: str, python: str = sys.executable) -> tuple[Path, Path]:
        plan = tmp_path / "cli.toml"
        plan.write_text(
            f'[run]\nname = "cli"\ndir = "local"\n\n[executor]\nkind = "ssh"\nhost = "aerie-box"\n'
            f'remote_dir = "{remote}"\npython = "{python}"\n\n[resources]\ncpu_slots = 2\n\n{stages}'
        )
        return plan, remote

    yield write
    stop_remote_run(remote)


def aerie(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "console.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


TWO = (
    '[[stage]]\nid = "make"\ncommand = "echo hello > f; sleep 0.5"\n\n'
    '[[stage]]\nid = "use"\nafter = ["make"]\ncommand = "cat ../../make/out/f"\n'
)


def test_preflight_run_status_and_attach_from_the_command_line(alias_plan):
    plan, remote = alias_plan(TWO)
    p = aerie("preflight", str(plan))
    assert p.returncode == 0, p.stderr
    assert "preflight aerie-box:" in p.stderr and "ready" in p.stderr
    assert not (remote / "stages").exists(), "preflight starts nothing"

    p = aerie("run", str(plan), "--headless", "--poll", "0.2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "run succeeded" in p.stdout

    url = f"ssh://aerie-box{remote}"
    p = aerie("status", url)
    assert p.returncode == 0, p.stderr
    table, projection = p.stdout.split("\n\n", 1)  # the stages, then the run's projection (made on the host)
    lines = {ln.split()[0]: ln.split()[1] for ln in table.splitlines()}
    assert lines == {"make": "succeeded", "use": "succeeded"}
    assert "run: 100% of the estimated work, 2/2 stages done" in projection and "finish: ended" in projection

    p = aerie("kill", url, "make")
    assert p.returncode == 3 and "not running" in p.stderr
    p = aerie("status", url)  # the refusal is in the host's audit log, shown from here
    assert (
        "audit log (last 1 of 1" in p.stdout and "via cli  kill make  refused: make is succeeded" in p.stdout
    )

    p = aerie("attach", str(plan), "--headless", "--poll", "0.2")
    assert p.returncode == 0 and "run succeeded" in p.stdout


def test_ssh_url_reaches_a_run_started_on_the_host_itself(home: Path, tmp_path: Path) -> None:
    """``aerie run`` on host H (no ssh bootstrap, no layout.json): attach, status and --compare from elsewhere
    reach it by ``ssh://H/path``, its agent run by the interpreter its supervisor recorded. A run dir whose
    supervisor never ran gets this console's pipeline uploaded into its ``.aerie/`` for the host's python3."""
    plan = tmp_path / "local.toml"
    hosted = tmp_path / "on-the-host" / "r1"
    plan.write_text(f'[run]\nname = "hosted"\ndir = "{hosted}"\n\n[resources]\ncpu_slots = 2\n\n{TWO}')
    try:
        p = aerie("run", str(plan), "--headless", "--poll", "0.2")
        assert p.returncode == 0, p.stdout + p.stderr
        assert not (hosted / ".aerie" / "layout.json").exists(), "started on the host: no ssh bootstrap"
        url = f"ssh://aerie-box{hosted}"
        p = aerie("status", url)
        assert p.returncode == 0, p.stderr
        table = p.stdout.split("\n\n", 1)[0]
        assert {ln.split()[0]: ln.split()[1] for ln in table.splitlines()} == {
            "make": "succeeded",
            "use": "succeeded",
        }
        p = aerie("attach", url, "--headless", "--poll", "0.2")
        assert p.returncode == 0 and "run succeeded" in p.stdout, p.stdout + p.stderr
        assert not list((hosted / ".aerie").glob("pkg-*")), "the host's own pipeline ran the agent"
        from console.compare import open_other

        other = open_other(url)  # what `aerie attach RUN --compare ssh://…` opens

        async def read_other() -> set[str]:
            try:
                await other.model.poll()
                return set(other.model.stages)
            finally:
                await other.model.transport.close()

        assert asyncio.run(read_other()) == {"make", "use"}
        p = aerie("retry", url, "use")  # a control verb reaches it too: the host's run answers, and audits it
        assert p.returncode == 3 and "use is succeeded: only failed, killed or skipped" in p.stderr, p.stderr
        audit_lines = [json.loads(ln) for ln in (hosted / "audit.jsonl").read_text().splitlines()]
        assert any(a.get("action") == "retry" and a.get("stage") == "use" for a in audit_lines), audit_lines
    finally:
        stop_remote_run(hosted)

    bare = tmp_path / "on-the-host" / "r2"  # created, its supervisor never started: nothing recorded
    from pipeline.run.supervise.run_setup import create_run

    create_run(plan_mod.load(plan, run_dir=bare), bare)
    p = aerie("status", f"ssh://aerie-box{bare}")
    assert p.returncode == 0, p.stderr
    table = p.stdout.split("\n\n", 1)[0]
    assert {ln.split()[0]: ln.split()[1] for ln in table.splitlines()} == {
        "make": "waiting",
        "use": "waiting",
    }
    assert list((bare / ".aerie").glob("pkg-*/pipeline/run/hosts/remote_agent.py")), "the agent was uploaded"
    p = aerie("status", f"ssh://aerie-box{tmp_path}")
    assert p.returncode == 2 and "no Aerie run there (no plan.toml)" in p.stderr, p.stderr


def test_preflight_refusal_exits_2_with_the_failed_check(alias_plan):
    plan, remote = alias_plan('[[stage]]\nid = "a"\ncommand = "true"\n', python="/no/such/python3")
    p = aerie("preflight", str(plan))
    assert p.returncode == 2
    assert "FAIL python" in p.stderr and "REFUSED" in p.stderr
    p = aerie("run", str(plan), "--headless")
    assert p.returncode == 2 and "REFUSED" in p.stderr
    assert not remote.exists()


async def test_console_header_shows_host_rtt_and_a_drop(alias_plan, tmp_path, sshd):
    # The stage holds at 50/100 until the test releases it, so a loaded machine cannot let it finish before
    # the console has seen it running (CI once saw "1 succeeded" before the first poll).
    release = tmp_path / "release"
    script = tmp_path / "slow.py"
    script.write_text(
        "import os, time\nfrom pipeline.run.stage_side.runtime import StageContext\nc = StageContext.from_env()\n"
        "for i in range(100):\n    c.progress(i + 1, 100, force=True)\n    time.sleep(0.05)\n"
        f"    while i == 49 and not os.path.exists({str(release)!r}):\n        time.sleep(0.1)\n"
    )
    plan, _remote = alias_plan(f'[[stage]]\nid = "slow"\ncommand = "{sys.executable} {script}"\n')
    transport = await asyncio.to_thread(start_remote, plan_mod.load(plan))  # preflight, bootstrap, supervisor
    assert not isinstance(transport, int)
    transport.conn.backoff_s = (0.1, 0.5)
    app = AerieApp(transport, poll_s=0.2)

    def header() -> str:
        c = app.query_one("#header", Static).content
        return c.plain if isinstance(c, Text) else str(c)

    async with app.run_test(size=(140, 30)) as pilot:
        pilot.describe = lambda: f"header={header()!r} error={app.model.error!r}"  # type: ignore[attr-defined]
        await _until(
            pilot, lambda: app.model.stages.get("slow") and app.model.stages["slow"].state == "running"
        )
        await _until(pilot, lambda: "rtt" in header())
        assert "aerie-box" in header()
        sshd.drop()
        await _until(
            pilot, lambda: "disconnected — retrying" in header(), timeout=40
        )  # loaded CI: slow to notice
        sshd.start()
        await _until(pilot, lambda: "rtt" in header() and "disconnected" not in header())
        assert app.model.stages["slow"].state == "running"
        release.touch()
        await _until(pilot, lambda: app.model.stages["slow"].state == "succeeded", timeout=30)
        assert app.model.stages["slow"].progress.done == 100
    await transport.close()


async def _until(pilot, pred, timeout: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        await pilot.pause(0.1)
    raise AssertionError(f"timed out: {getattr(pilot, 'describe', lambda: '')()}")


def test_aerie_watch_over_ssh_delivers_each_alert_once_across_a_dropped_connection(
    alias_plan, sshd, tmp_path
):
    """Issue 44: ``aerie run --detach`` on the host, ``aerie watch ssh://…`` here running the user's own hook; the
    connection is killed (sshd and every session it serves) while a second stage fails; after it comes back the
    second alert is delivered, the first is not delivered again, and a restarted watch delivers nothing twice."""
    plan, remote = alias_plan(
        '[[stage]]\nid = "early"\ncommand = "sleep 1; exit 3"\n\n'
        '[[stage]]\nid = "late"\ncommand = "sleep 10; exit 4"\n'
    )
    # the host runs this checkout's pipeline (uploaded), whatever the machine has installed
    plan.write_text(
        plan.read_text().replace("[resources]", 'options = { pipeline = "upload" }\n\n[resources]')
    )
    p = aerie("run", str(plan), "--detach")
    assert p.returncode == 0, p.stderr
    assert "aerie watch" in p.stderr
    url = p.stdout.splitlines()[0]  # what --detach prints: the run, for attach and watch
    assert url == f"ssh://aerie-box{remote}"
    out = tmp_path / "paged"
    env = dict(os.environ, PYTHONPATH=str(ROOT), AERIE_HOME=str(tmp_path / "aerie-home"))
    argv = [sys.executable, "-m", "console.cli", "watch", url, "--until-done", "--poll", "0.3"]
    argv += ["--command", f'echo "$AERIE_ALERT_ID $AERIE_ALERT_KIND $AERIE_ALERT_STAGE" >> {out}']
    log = (tmp_path / "watch.log").open("w")
    watcher = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait(lambda: out.exists() and "early" in out.read_text(), 60, "the first alert delivered")
        sshd.drop()  # the connection dies, as a network cut would
        alerts = remote / "alerts.jsonl"
        _wait(lambda: b'"late"' in alerts.read_bytes(), 60, "the second alert raised while disconnected")
        assert "late" not in out.read_text()
        sshd.start()
        assert watcher.wait(120) == 0, (tmp_path / "watch.log").read_text()
    finally:
        if watcher.poll() is None:
            watcher.kill()
        log.close()
    assert out.read_text().splitlines() == ["1 stage-failed early", "2 stage-failed late"]
    said = (tmp_path / "watch.log").read_text()
    assert "cannot read the run" in said and "reading the run again" in said, said
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "alerts after #2" in again.stdout
    assert out.read_text().splitlines() == ["1 stage-failed early", "2 stage-failed late"], "nothing twice"


def _wait(pred: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
