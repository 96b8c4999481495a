"""The ssh executor against a real OpenSSH sshd on loopback: runs, drops, host keys, kill, preflight.

The "remote" is this machine reached through sshd, so the tests can look behind the connection
(the remote run dir, /proc) to check what the console saw against what really happened.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import wait_for

from console.model import RunModel
from console.ssh.connection import HostConnection, HostKeyError, SshError, SshTarget, parse_ssh_url
from console.ssh.preflight import preflight
from console.ssh.transport import SshTransport, load_layout, start_remote_run
from pipeline.run.hosts.procs import group_members, read_stat
from pipeline.run.plan import dag as plan_mod
from pipeline.run.rundir.events import read_all
from pipeline.run.rundir.protocol import Message, kind_of, to_event

pytest_plugins = ["conftest_ssh"]
pytestmark = [pytest.mark.ssh, pytest.mark.slow]


async def poll_until(model: RunModel, pred, timeout_s: float = 60.0, every_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await model.poll()
        if pred():
            return
        await asyncio.sleep(every_s)
    raise AssertionError(
        f"timed out; model error={model.error!r} stages={ {s: v.state for s, v in model.stages.items()} }"
    )


async def bootstrap(plan_path: Path, conn: HostConnection) -> SshTransport:
    plan = plan_mod.load(plan_path)
    rep = await preflight(plan, conn)
    assert rep.ok, rep.render()
    assert rep.layout is not None
    await start_remote_run(conn, rep.layout)
    return SshTransport(conn, rep.layout, owns_connection=False)


# ------------------------------------------------------------------------------------------------
async def test_two_stage_plan_runs_to_completion_over_ssh(sshd, known_hosts, ssh_plan, tmp_path):
    # The host is an ssh-config alias (as in ~/.ssh/config); the remote run dir does not exist yet,
    # and the host's own pipeline is bypassed so the SFTP upload path is what runs the stages.
    cfg = sshd.ssh_config(tmp_path / "ssh_config", "aerie-box", known_hosts)
    plan_path = ssh_plan(
        """
        [[stage]]
        id = "make"
        command = "echo made-remotely > out.txt"

        [[stage]]
        id = "use"
        after = ["make"]
        command = "cat ../../make/out/out.txt"
        """,
        executor='host = "aerie-box"\n',
        options=f'ssh_config = "{cfg}", pipeline = "upload"',
    )
    plan = plan_mod.load(plan_path)
    remote = Path(plan.executor.remote_dir)
    assert not remote.parent.exists()

    rep = await preflight(plan)
    assert rep.ok, rep.render()
    assert [c.name for c in rep.checks] == ["connection", "python", "run dir", "pipeline", "plan", "disk"]
    assert remote.is_dir() and (remote / "plan.submitted.toml").read_text() == plan_path.read_text()
    assert (
        rep.layout
        and rep.layout.pythonpath
        and rep.layout.pythonpath.startswith(str(remote / ".aerie" / "pkg-"))
    )
    assert (Path(rep.layout.pythonpath) / "pipeline" / "run" / "hosts" / "remote_agent.py").is_file()
    assert "free at" in rep.render()

    conn = HostConnection(SshTarget.from_executor(plan.executor))
    async with conn:
        assert conn.status.host == "aerie-box"
        await start_remote_run(conn, rep.layout)
        transport = SshTransport(conn, rep.layout, owns_connection=False)
        model = RunModel(transport)
        model.watch_log("use")
        await poll_until(model, lambda: model.done)
        assert {s: v.state for s, v in model.stages.items()} == {"make": "succeeded", "use": "succeeded"}
        await model.poll()
        assert "made-remotely" in "\n".join(model.stages["use"].log)
        assert transport.status.state == "connected" and transport.status.rtt_ms is not None
        # What served the console (and started the stages) is the uploaded package, not the host's own.
        assert transport.remote_pipeline == str(Path(rep.layout.pythonpath) / "pipeline")
        await transport.close()

    # Another terminal attaches with just ssh://host/path (layout recorded at bootstrap).
    url_target, path = parse_ssh_url(f"ssh://{sshd.user}@127.0.0.1:{sshd.port}{remote}")
    url_target = SshTarget(
        **{**url_target.__dict__, "identity": str(sshd.client_key), "known_hosts": str(known_hosts)}
    )
    async with HostConnection(url_target) as conn2:
        layout = await load_layout(conn2, path)
        assert layout.root == str(remote)
        t2 = SshTransport(conn2, layout, owns_connection=False)
        m2 = RunModel(t2)
        await poll_until(m2, lambda: m2.loaded and len(m2.stages["use"].events) >= 2)
        assert m2.stages["use"].state == "succeeded"
        assert [kind_of(e) for e in m2.stages["use"].events] == ["started", "finished"]
        await t2.close()


async def test_drop_mid_stage_stage_keeps_running_and_every_event_is_seen_once(
    sshd, ssh_plan, fast_conn, tmp_path
):
    n = 40
    script = tmp_path / "tick.py"
    script.write_text(
        "import time\nfrom pipeline.run.stage_side.runtime import StageContext\nctx = StageContext.from_env()\n"
        f"for i in range({n}):\n    ctx.message(f'tick {{i}}')\n    time.sleep(0.1)\n"
    )
    plan_path = ssh_plan(f"""
        [[stage]]
        id = "tick"
        command = "{sys.executable} {script}"
        """)
    conn = fast_conn()
    async with conn:
        transport = await bootstrap(plan_path, conn)
        model = RunModel(transport)
        events_file = Path(transport.run_root) / "stages" / "tick" / "events.jsonl"

        def ticks() -> list[str]:
            st = model.stages.get("tick")
            return [e.text for e in st.events if isinstance(e, Message)] if st else []

        await poll_until(model, lambda: len(ticks()) >= 5)
        before = len(read_all(events_file))
        sshd.drop()
        labels = []
        for _ in range(15):  # 1.5 s with the host unreachable
            await model.poll()
            labels.append(transport.status.label())
            await asyncio.sleep(0.1)
        assert model.error and "disconnected" in model.error
        assert any("disconnected — retrying (" in lab for lab in labels), labels
        during = len(read_all(events_file))
        assert during > before + 5, "the stage must keep running while the connection is down"
        sshd.start()
        await poll_until(model, lambda: model.stages["tick"].state == "succeeded", timeout_s=30)
        await model.poll()
        assert conn.drops == 1 and transport.status.state == "connected"
        assert ticks() == [f"tick {i}" for i in range(n)]  # every one, once, in order
        shown = [to_event(e).to_json() for e in model.stages["tick"].events]
        on_disk = [e.to_json() for e in read_all(events_file)]
        assert shown == on_disk
        await transport.close()


async def test_changed_host_key_is_refused_with_instructions(sshd, target, fast_conn):
    conn = fast_conn()
    await conn.connect()
    try:
        # The container is rebuilt with a new host key while we are connected.
        sshd.drop()
        sshd.new_host_key()
        sshd.start()
        await asyncio.wait_for(_until(lambda: conn.fatal is not None), 20)
        assert isinstance(conn.fatal, HostKeyError) and conn.fatal.changed
        assert not conn.connected
        assert "refused — not retrying" in conn.status.label() and "CHANGED" in conn.status.detail
        retries = conn.status.retries
        await asyncio.sleep(0.8)
        assert conn.status.retries == retries, "a changed key must stop the retries, not be hammered"
    finally:
        await conn.close()
    with pytest.raises(HostKeyError) as exc:
        await HostConnection(target).connect()
    msg = str(exc.value)
    assert "CHANGED" in msg and "ssh-keygen -R" in msg and exc.value.fingerprint in msg


async def test_unknown_host_key_is_refused_never_trusted_on_first_use(sshd, target, tmp_path):
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    t = SshTarget(**{**target.__dict__, "known_hosts": str(empty)})
    with pytest.raises(HostKeyError) as exc:
        await HostConnection(t).connect()
    assert not exc.value.changed
    assert "not in known_hosts" in str(exc.value) and "ssh-keyscan" in str(exc.value)
    assert empty.read_text() == ""  # nothing was added behind the operator's back


async def test_kill_over_ssh_ends_the_group_and_spares_a_same_named_stranger(ssh_plan, fast_conn):
    plan_path = ssh_plan("""
        [[stage]]
        id = "sleepy"
        command = "sleep 300 & sleep 300; wait"
        kill_grace_s = 3
        """)
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)  # same name, not ours
    try:
        conn = fast_conn()
        async with conn:
            transport = await bootstrap(plan_path, conn)
            model = RunModel(transport)
            await poll_until(
                model,
                lambda: (
                    "sleepy" in model.stages
                    and model.stages["sleepy"].state == "running"
                    and model.stages["sleepy"].pgid is not None
                ),
            )
            pgid = model.stages["sleepy"].pgid
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: wait_for(lambda: len(group_members(pgid)) >= 3, 10, "stage group up")
            )
            res = await transport.ctl("kill", "sleepy")
            assert res.returncode == 0, res
            await poll_until(model, lambda: model.stages["sleepy"].state == "killed")
            assert group_members(pgid) == []
            st = read_stat(stranger.pid)
            assert st is not None and st.state not in ("Z", "X") and stranger.poll() is None
            # retry goes through the same channel and starts attempt 2
            res = await transport.ctl("retry", "sleepy")
            assert res.returncode == 0, res
            await poll_until(
                model,
                lambda: model.stages["sleepy"].attempt == 2 and model.stages["sleepy"].state == "running",
            )
            assert (await transport.ctl("kill", "sleepy")).returncode == 0
            await poll_until(model, lambda: model.stages["sleepy"].state == "killed")
            refused = await transport.ctl("pause", "sleepy")
            assert refused.returncode == 3 and "not running" in refused.message
            await transport.close()
    finally:
        stranger.kill()
        stranger.wait()


async def test_preflight_refuses_a_missing_python_and_creates_nothing(ssh_plan, tmp_path):
    remote = tmp_path / "remote-x" / "run"
    plan = plan_mod.load(
        ssh_plan('[[stage]]\nid = "a"\ncommand = "true"\n', remote_dir=remote, python="/nonexistent/python3")
    )
    rep = await preflight(plan)
    assert not rep.ok
    failed = [c for c in rep.checks if not c.ok]
    assert [c.name for c in failed] == ["python"]
    assert "/nonexistent/python3" in failed[0].detail and "[executor] python" in failed[0].detail
    assert "REFUSED" in rep.render()
    assert not remote.parent.exists()


async def test_preflight_refuses_a_run_dir_holding_another_plan(ssh_plan, fast_conn):
    first = ssh_plan('[[stage]]\nid = "a"\ncommand = "true"\n', name="first.toml")
    conn = fast_conn()
    async with conn:
        transport = await bootstrap(first, conn)
        other = ssh_plan('[[stage]]\nid = "b"\ncommand = "true"\n', name="other.toml")
        rep = await preflight(plan_mod.load(other), conn)
        assert not rep.ok
        bad = [c for c in rep.checks if not c.ok]
        assert [c.name for c in bad] == ["run dir"] and "different plan" in bad[0].detail
        assert "aerie attach" in bad[0].detail
        # The same plan again is a re-attach, not an error.
        again = await preflight(plan_mod.load(first), conn)
        assert again.ok and "re-attaching" in again.render()
        await transport.close()


async def test_channels_stay_within_the_servers_max_sessions(tmp_path, known_hosts, sshd):
    from sshd import LoopbackSshd

    tight = LoopbackSshd(tmp_path / "tight", max_sessions=2)
    tight.start()
    try:
        kh = tight.write_known_hosts(tmp_path / "kh_tight")
        base = SshTarget(
            host="127.0.0.1",
            port=tight.port,
            user=tight.user,
            identity=str(tight.client_key),
            known_hosts=str(kh),
        )
        # A client that ignores the server's limit gets channels refused (held longer than it retries)...
        async with HostConnection(SshTarget(**{**base.__dict__, "max_sessions": 10})) as greedy:
            results = await asyncio.gather(
                *(greedy.run("sleep 2; echo ok") for _ in range(5)), return_exceptions=True
            )
            assert any(isinstance(r, SshError) and "MaxSessions" in str(r) for r in results)
        # ...one that keeps within it queues them and every command succeeds.
        async with HostConnection(SshTarget(**{**base.__dict__, "max_sessions": 2})) as polite:
            peak = 0

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, polite.sessions_in_use)
                    await asyncio.sleep(0.01)

            w = asyncio.get_running_loop().create_task(watch())
            results = await asyncio.gather(*(polite.run("sleep 0.3; echo ok") for _ in range(5)))
            w.cancel()
            assert [r.stdout.strip() for r in results] == ["ok"] * 5
            assert peak == 2
    finally:
        tight.drop()


async def _until(pred, every_s: float = 0.05) -> None:
    while not pred():
        await asyncio.sleep(every_s)


async def test_polls_cancelled_mid_connect_do_not_leak_channels(ssh_plan, fast_conn, target):
    # The console's poll worker is exclusive: every tick cancels the previous poll, which may be
    # in the middle of starting the remote agent (a login shell + python: ~0.3 s here).
    first = ssh_plan('[[stage]]\nid = "a"\ncommand = "true"\n')
    async with fast_conn() as setup:
        layout = (await bootstrap(first, setup)).layout
    conn = fast_conn(SshTarget(**{**target.__dict__, "max_sessions": 3}))
    async with conn:
        transport = SshTransport(conn, layout, owns_connection=False)
        for _ in range(12):  # more than max_sessions cancelled starts
            task = asyncio.get_running_loop().create_task(transport.read_many([("state.json", 0)]))
            await asyncio.sleep(0.02)
            task.cancel()
        res = await asyncio.wait_for(transport.read_many([("plan.toml", 0)]), 20)
        assert res[0].size > 0 and b"[executor]" in res[0].data
        assert conn.sessions_in_use == 1  # just the agent's channel
        await transport.close()


async def test_a_misspelt_executor_option_is_named_not_ignored(ssh_plan):
    plan = plan_mod.load(ssh_plan('[[stage]]\nid = "a"\ncommand = "true"\n', options='know_hosts = "/x"'))
    rep = await preflight(plan)
    assert not rep.ok and [c.name for c in rep.checks] == ["plan"]
    assert f"{plan.path}: executor.options.know_hosts: unknown key" in rep.checks[0].detail


async def test_preflight_runs_the_deep_chain_check_on_the_host(ssh_plan, tmp_path):
    """An EAGLE-3 plan is checked on the host against the host's copy of the target (here a tiny
    Kimi-K2.5-architecture model): the chain's findings are preflight lines, and a bad one stops it."""
    from tests.kimi_fixture import build_tiny_kimi

    model = build_tiny_kimi(tmp_path / "kimi")
    body = f"""
        [target]
        model = "{model}"
        max_length = 256
        [extract]
        aux_layers = [4, 1, 2]
        [vocab]
        draft_vocab_size = VOCAB
        [[stage]]
        id = "extract"
        run = "extract"
        """
    rep = await preflight(plan_mod.load(ssh_plan(body.replace("VOCAB", "128"))))
    assert rep.ok, rep.render()
    lines = {c.name: c for c in rep.checks}
    assert (
        "kimi_k25" in lines["chain: architecture"].detail
        or "deepseek_v3" in lines["chain: architecture"].detail
    )
    assert lines["chain: aux layers"].detail.startswith("[1, 2, 4]")
    assert "trained" in lines["chain: chat template"].detail

    rep = await preflight(
        plan_mod.load(
            ssh_plan(
                body.replace("VOCAB", "100000"), name="bad.toml", remote_dir=tmp_path / "remote2" / "run"
            )
        )
    )
    assert not rep.ok
    bad = [c for c in rep.checks if not c.ok]
    assert [c.name for c in bad] == ["chain: draft vocab"] and "vocab.draft_vocab_size" in bad[0].detail


async def test_preflight_weighs_the_hosts_sglang_against_the_tested_versions(ssh_plan, tmp_path):
    """The host's real SGLang (the parser install: 0.5.23, known broken for the capture through its runner):
    a plan that only serves gets a warning naming the release; a plan that captures through it is refused
    before anything else runs on the host (no chain check)."""
    import importlib.metadata

    from pipeline import tested_versions

    try:
        installed = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang is not installed: pip install --no-deps -r .ci/sglang-parser-requirements.txt")
    row = tested_versions.stack_of(installed)
    assert row is not None and row.broken_for == ("capture",), "this test needs a release broken for capture"
    serve = '[[stage]]\nid = "serve"\nrun = "serve"\nservice = true\n'
    rep = await preflight(plan_mod.load(ssh_plan(serve, options='pipeline = "upload"')))
    line = {c.name: c for c in rep.checks}["sglang"]
    assert rep.ok and line.ok and line.warning, rep.render()
    assert f"SGLang {installed} is untested for serve" in line.detail

    capture = (
        '[target]\nmodel = "/nowhere/kimi"\nengine = "sglang"\n[[stage]]\nid = "extract"\nrun = "extract"\n'
    )
    rep = await preflight(
        plan_mod.load(
            ssh_plan(
                capture, name="cap.toml", remote_dir=tmp_path / "r2" / "run", options='pipeline = "upload"'
            )
        )
    )
    assert not rep.ok and rep.failed == ["sglang"], rep.render()
    detail = rep.checks[-1].detail
    assert f"SGLang {installed} is known broken for capture" in detail and "fill_len" in detail
    assert "0.5.14" in detail and "constraints-gpu.txt" in detail
    assert not any(c.name.startswith("chain") for c in rep.checks)
