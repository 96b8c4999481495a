"""The supervisor with real processes: DAG runs, failure propagation, retry, pause, kill, re-attach."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.run.hosts.procs import ProcIdentity, StrangerError, read_stat, signal_group
from pipeline.run.rundir.layout import read_json, write_json
from tests.runs import (
    ctl,
    events,
    kill_run_stages,
    make_run,
    pid_alive,
    stage_state,
    start_supervisor,
    states,
    stop,
    wait_done,
    wait_for,
)

PY = sys.executable
WORKER = """
import sys, time
from pipeline.run.stage_side.runtime import StageContext
ctx = StageContext.from_env()
n, delay = int(sys.argv[1]), float(sys.argv[2])
for i in range(n):
    ctx.safe_point()
    ctx.progress(i + 1, n, unit="steps", force=True)
    time.sleep(delay)
"""


@pytest.fixture
def worker(tmp_path: Path) -> str:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return f"{PY} {path}"


@pytest.fixture
def cleanup() -> list:
    runs: list = []
    yield runs
    for run, sup in runs:
        if sup is not None:
            stop(sup)
        kill_run_stages(run)


def test_dag_runs_failure_propagates_and_retry_completes(tmp_path: Path, cleanup: list) -> None:
    flag = tmp_path / "input-ok"
    run = make_run(
        tmp_path,
        f"""
        [run]
        name = "dag"
        dir = "run"
        [resources]
        cpu_slots = 2
        [[stage]]
        id = "a"
        command = "echo a > $AERIE_OUT/a.txt"
        [[stage]]
        id = "b"
        command = "test -f {flag} || {{ echo 'input missing: {flag}' >&2; exit 3; }}"
        after = ["a"]
        [[stage]]
        id = "c"
        command = "echo c"
        after = ["b"]
        [[stage]]
        id = "d"
        command = "echo d"
        after = ["a"]
    """,
    )
    sup = start_supervisor(run)
    cleanup.append((run, sup))
    st = wait_done(run)
    assert st == {"a": "succeeded", "b": "failed", "c": "upstream-failed", "d": "succeeded"}
    assert (run.stage("a").out / "a.txt").read_text() == "a\n"
    assert "input missing" in run.stage("b").log.read_text()
    assert stage_state(run, "c")["reason"] == "b failed"
    assert sup.wait(10) == 0  # the supervisor exits once every stage is finished

    flag.write_text("fixed")
    res = ctl(run, "retry", "b")  # starts a supervisor again, since none runs
    assert res.returncode == 0, res.stderr
    assert "attempt 2" in res.stdout
    st = wait_done(run)
    assert st == {"a": "succeeded", "b": "succeeded", "c": "succeeded", "d": "succeeded"}
    assert [e.get("attempt") for e in events(run, "b", "started")] == [1, 2]
    assert len(events(run, "a", "started")) == 1  # nothing upstream ran again


def test_pause_holds_progress_and_resume_continues(tmp_path: Path, worker: str, cleanup: list) -> None:
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "w"
        command = "{worker} 400 0.02"
    """,
    )
    sup = start_supervisor(run)
    cleanup.append((run, sup))
    wait_for(lambda: len(events(run, "w", "progress")) > 5, 30, "progress")
    res = ctl(run, "pause", "w")
    assert res.returncode == 0, res.stderr
    wait_for(lambda: states(run).get("w") == "paused", 10, "paused state")
    acks = [e for e in events(run, "w", "message") if e.get("code") == "paused"]
    assert acks, "the stage acknowledged the pause at a safe point"
    n_paused = len(events(run, "w", "progress"))
    time.sleep(1.0)
    assert len(events(run, "w", "progress")) == n_paused, "no progress while paused"
    assert ctl(run, "resume", "w").returncode == 0
    wait_for(lambda: len(events(run, "w", "progress")) > n_paused + 5, 20, "progress after resume")
    assert wait_done(run)["w"] == "succeeded"
    assert events(run, "w", "progress")[-1].get("done") == 400


def test_pause_sigstops_a_stage_that_has_no_safe_points(tmp_path: Path, cleanup: list) -> None:
    counter = tmp_path / "ticks"
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "busy"
        command = "while true; do echo tick >> {counter}; sleep 0.05; done"
        pause_grace_s = 0.5
        kill_grace_s = 2
    """,
    )
    sup = start_supervisor(run)
    cleanup.append((run, sup))
    wait_for(lambda: counter.exists() and counter.stat().st_size > 20, 20, "ticks")
    assert ctl(run, "pause", "busy").returncode == 0
    wait_for(lambda: states(run).get("busy") == "paused", 10, "SIGSTOP after the grace period")
    pid = stage_state(run, "busy")["pid"]
    assert read_stat(pid).state == "T"
    size = counter.stat().st_size
    time.sleep(0.6)
    assert counter.stat().st_size == size
    assert ctl(run, "resume", "busy").returncode == 0
    wait_for(lambda: counter.stat().st_size > size, 10, "ticks after SIGCONT")
    assert ctl(run, "kill", "busy").returncode == 0
    assert wait_done(run)["busy"] == "killed"


def test_kill_ends_the_group_and_spares_a_look_alike(tmp_path: Path, cleanup: list) -> None:
    child_pid = tmp_path / "child.pid"
    cmd = f"sleep 300 & echo $! > {child_pid}; wait"
    # A foreign process with exactly the stage's command line, started outside Aerie.
    foreign = subprocess.Popen(
        ["/bin/sh", "-c", cmd.replace(str(child_pid), str(tmp_path / "foreign.pid"))], start_new_session=True
    )
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "long"
        command = "{cmd}"
        kill_grace_s = 3
        [[stage]]
        id = "after-long"
        command = "true"
        after = ["long"]
    """,
    )
    sup = start_supervisor(run)
    cleanup.append((run, sup))
    try:
        wait_for(lambda: child_pid.exists() and child_pid.read_text().strip(), 20, "the stage's child")
        child = int(child_pid.read_text())
        stage_pid = wait_for(lambda: stage_state(run, "long").get("pid"), 10, "the stage's recorded pid")
        res = ctl(run, "kill", "long")
        assert res.returncode == 0, res.stderr
        assert wait_done(run) == {"long": "killed", "after-long": "upstream-failed"}
        wait_for(lambda: not pid_alive(child), 10, "the stage's child to die")
        # the launcher ends just after recording the exit the supervisor derived "killed" from
        wait_for(lambda: not pid_alive(stage_pid), 10, "the stage's launcher to end")
        assert foreign.poll() is None, "the look-alike process outside Aerie survives"
        assert events(run, "long", "finished")[-1].get("status") == "killed"
    finally:
        os.killpg(foreign.pid, signal.SIGKILL)
        foreign.wait()


def test_a_recycled_pid_is_never_signalled(tmp_path: Path) -> None:
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        real = read_stat(stranger.pid)
        # What a launcher would have recorded for an earlier process that had this pid.
        old = ProcIdentity(pid=stranger.pid, pgid=stranger.pid, start_time=real.start_time - 1, boot_id="")
        assert not old.is_alive()
        with pytest.raises(StrangerError):
            signal_group(old, signal.SIGTERM)
        time.sleep(0.2)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_kill_refuses_when_the_recorded_pid_was_recycled(tmp_path: Path, cleanup: list) -> None:
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    run = make_run(
        tmp_path,
        """
        [run]
        dir = "run"
        [[stage]]
        id = "s"
        command = "sleep 300"
    """,
    )
    try:
        # The stage ran once, its launcher vanished, and the pid now belongs to a stranger.
        sd = run.stage("s")
        real = read_stat(stranger.pid)
        write_json(sd.launch, {"attempt": 1, "t": time.time()})
        write_json(
            sd.proc,
            {
                "attempt": 1,
                "pid": stranger.pid,
                "pgid": stranger.pid,
                "start_time": real.start_time - 7,
                "boot_id": "",
                "t": time.time(),
            },
        )
        sup = start_supervisor(run)
        cleanup.append((run, sup))
        wait_for(lambda: states(run).get("s") == "failed", 10, "the lost stage to be marked failed")
        res = ctl(run, "kill", "s")
        assert res.returncode == 3 and "not running" in res.stderr
        time.sleep(0.3)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_supervisor_sigkilled_mid_run_reattaches_without_restarting(
    tmp_path: Path, worker: str, cleanup: list
) -> None:
    starts = tmp_path / "starts.log"
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [resources]
        cpu_slots = 2
        [[stage]]
        id = "one"
        command = "echo one >> {starts}; {worker} 60 0.05"
        [[stage]]
        id = "two"
        command = "echo two >> {starts}; {worker} 60 0.05"
        [[stage]]
        id = "three"
        command = "echo three >> {starts}"
        after = ["one", "two"]
    """,
    )
    sup = start_supervisor(run)
    wait_for(
        lambda: all(stage_state(run, s).get("pid") and states(run)[s] == "running" for s in ("one", "two")),
        20,
        "both running",
    )
    pids = {s: stage_state(run, s)["pid"] for s in ("one", "two")}
    os.killpg(sup.pid, signal.SIGKILL)
    sup.wait()
    assert all(pid_alive(p) for p in pids.values()), "stages outlive their supervisor"
    sup2 = start_supervisor(run)
    cleanup.append((run, sup2))
    wait_for(
        lambda: (read_json(run.state_path) or {}).get("supervisor", {}).get("pid") == sup2.pid,
        10,
        "new supervisor",
    )
    assert states(run)["one"] in ("running", "succeeded")
    assert wait_done(run) == {"one": "succeeded", "two": "succeeded", "three": "succeeded"}
    assert sorted(starts.read_text().split()) == ["one", "three", "two"], "no stage started twice"
    assert stage_state(run, "one")["pid"] == pids["one"]


def test_automatic_retry_policy(tmp_path: Path, cleanup: list) -> None:
    counter = tmp_path / "count"
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "flaky"
        command = "echo x >> {counter}; test $(wc -l < {counter}) -ge 2"
        retry = {{ max_attempts = 3, backoff_s = 0.2 }}
        [[stage]]
        id = "never"
        command = "exit 1"
    """,
    )
    sup = start_supervisor(run)
    cleanup.append((run, sup))
    st = wait_done(run)
    assert st == {"flaky": "succeeded", "never": "failed"}
    assert stage_state(run, "flaky")["attempt"] == 2
    assert stage_state(run, "never")["attempt"] == 1  # retries are off by default


def test_retry_fresh_clears_only_the_stage_outputs(tmp_path: Path, cleanup: list) -> None:
    keep = tmp_path / "outside.txt"
    keep.write_text("not ours")
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "s"
        command = "test -f $AERIE_OUT/marker && exit 0; touch $AERIE_OUT/marker; ln -s {keep} $AERIE_OUT/link; exit 1"
    """,
    )
    sup = start_supervisor(run)
    cleanup.append((run, sup))
    assert wait_done(run) == {"s": "failed"}
    assert (run.stage("s").out / "marker").exists()
    res = ctl(run, "retry", "s", "--fresh")
    assert res.returncode == 0 and "outputs cleared" in res.stdout
    assert wait_done(run) == {"s": "failed"}  # fresh start: the marker was gone, so it failed again
    assert keep.read_text() == "not ours"  # the symlink's target outside the run dir is untouched
    res = ctl(run, "retry", "s")
    assert wait_done(run) == {"s": "succeeded"}  # plain retry resumes from what exists


def test_ctl_errors_have_exit_codes(tmp_path: Path, cleanup: list) -> None:
    run = make_run(
        tmp_path,
        """
        [run]
        dir = "run"
        [[stage]]
        id = "s"
        command = "true"
    """,
    )
    sup = start_supervisor(run)
    cleanup.append((run, sup))
    wait_done(run)
    assert ctl(run, "pause", "nope").returncode == 2
    res = ctl(run, "kill", "s")
    assert res.returncode == 3 and "not running" in res.stderr
    res = subprocess.run(
        [PY, "-m", "pipeline.run.supervise.ctl", str(tmp_path / "missing"), "status"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "no such run" in res.stderr


def test_service_is_stopped_when_its_users_are_done(tmp_path: Path, cleanup: list) -> None:
    svc = tmp_path / "svc.py"
    svc.write_text(
        "import time\nfrom pipeline.run.stage_side.runtime import StageContext\nctx = StageContext.from_env()\n"
        "ctx.health('starting')\ntime.sleep(0.3)\nctx.health('ready')\nwhile True:\n    time.sleep(0.1)\n"
    )
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [resources]
        cpu_slots = 2
        [[stage]]
        id = "server"
        command = "{PY} {svc}"
        service = true
        [[stage]]
        id = "client"
        command = "echo using the server"
        uses = ["server"]
        [[stage]]
        id = "gpu-job"
        command = "echo server is down"
        after = ["server", "client"]
    """,
    )
    sup = start_supervisor(run)
    cleanup.append((run, sup))
    assert wait_done(run) == {"server": "succeeded", "client": "succeeded", "gpu-job": "succeeded"}
    client_start = events(run, "client", "started")[0].t
    ready = next(e for e in events(run, "server", "health") if e.get("state") == "ready").t
    server_end = events(run, "server", "finished")[0].t
    gpu_start = events(run, "gpu-job", "started")[0].t
    assert ready <= client_start, "the user starts only once the service is ready"
    assert server_end <= gpu_start, "a stage `after` a service waits until it has been stopped"


def test_resources_limit_concurrency(tmp_path: Path, cleanup: list) -> None:
    log = tmp_path / "spans"
    body = """
        [run]
        dir = "run"
        [resources]
        cpu_slots = 2
        gpus = [0]
    """
    for i in range(4):
        body += f"""
        [[stage]]
        id = "c{i}"
        command = "echo start $(date +%s.%N) >> {log}; sleep 0.6; echo end $(date +%s.%N) >> {log}"
        """
    body += """
        [[stage]]
        id = "g1"
        command = "sleep 0.3"
        gpus = [0]
        cpu = 0
        [[stage]]
        id = "g2"
        command = "sleep 0.3"
        gpus = [0]
        cpu = 0
    """
    run = make_run(tmp_path, body)
    sup = start_supervisor(run)
    cleanup.append((run, sup))
    assert set(wait_done(run).values()) == {"succeeded"}
    marks = sorted((float(t), kind) for kind, t in (line.split() for line in log.read_text().splitlines()))
    running = peak = 0
    for _, kind in marks:
        running += 1 if kind == "start" else -1
        peak = max(peak, running)
    assert peak == 2, "never more CPU stages than cpu_slots"
    g1 = events(run, "g1", "started")[0].t, events(run, "g1", "finished")[0].t
    g2 = events(run, "g2", "started")[0].t, events(run, "g2", "finished")[0].t
    assert g1[1] <= g2[0] or g2[1] <= g1[0], "two stages never hold the same GPU"


def test_a_cpu_stage_computes_on_the_slots_it_holds(
    tmp_path: Path, cleanup: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's default is a thread per core: three CPU stages side by side on a 2-slot host would run six
    spinning threads on two cores. Each stage gets ``OMP_NUM_THREADS`` = its CPU slots; a GPU stage keeps
    torch's default, and what the operator set (the plan's ``env`` or the environment) wins. Threads Aerie
    chose sleep when they wait (``OMP_WAIT_POLICY=PASSIVE``): spinning ones beside another busy stage took
    4-5x the CPU (bench/omp_wait.py)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    show = "echo threads=${OMP_NUM_THREADS:-unset} ${OMP_WAIT_POLICY:-spin}"
    body = f"""
        [run]
        dir = "run"
        [resources]
        cpu_slots = 4
        gpus = [0]
        [[stage]]
        id = "one"
        command = "{show}"
        [[stage]]
        id = "three"
        command = "{show}"
        cpu = 3
        [[stage]]
        id = "gpu"
        command = "{show}"
        gpus = [0]
        [[stage]]
        id = "waits"
        command = "{show}"
        cpu = 0
        [[stage]]
        id = "operator"
        command = "{show}"
        cpu = 2
        env = {{OMP_NUM_THREADS = "7"}}
    """
    run = make_run(tmp_path, body)
    sup = start_supervisor(run)
    cleanup.append((run, sup))
    assert set(wait_done(run).values()) == {"succeeded"}
    said = {
        sid: next(line for line in run.stage(sid).log.read_text().splitlines() if line.startswith("threads="))
        for sid in ("one", "three", "gpu", "waits", "operator")
    }
    assert said == {
        "one": "threads=1 PASSIVE",
        "three": "threads=3 PASSIVE",
        "gpu": "threads=unset spin",
        "waits": "threads=unset spin",
        "operator": "threads=7 spin",
    }


def test_the_ranks_of_a_cpu_stage_share_its_slots() -> None:
    from pipeline.run.stage_side.ranks import rank_threads

    ours = {"OMP_NUM_THREADS": "4", "AERIE_CPU_THREADS": "4"}
    assert rank_threads(ours, 2) == {"OMP_NUM_THREADS": "2"}, "4 slots over 2 torchrun ranks: 2 threads each"
    assert rank_threads(ours, 8) == {"OMP_NUM_THREADS": "1"}, "never fewer than one"
    assert rank_threads({"OMP_NUM_THREADS": "6", "AERIE_CPU_THREADS": "4"}, 2) == {}, "the operator's 6 stays"
    assert rank_threads({}, 2) == {}, "nothing chosen by Aerie (a GPU stage, Slurm): torchrun's own default"
