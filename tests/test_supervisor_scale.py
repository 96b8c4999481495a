"""The supervisor at any scale or write speed (issue 46): it says "slow" when it is slow and "cannot write"
only when a write failed; a stage without a log yet logs nothing; a fast writer never stalls its
heartbeat nor passes the stage log's bound; 10,000 stages stay operable."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.run.rundir import growth
from pipeline.run.rundir.layout import RunDir, read_json, write_json
from pipeline.run.supervise.liveness import STALE_S, liveness, try_lock
from tests.runs import kill_run_stages, make_run, stage_state, start_supervisor, states, stop


def _held_run(tmp_path: Path) -> RunDir:
    return make_run(tmp_path, '[run]\ndir = "run"\n[[stage]]\nid = "a"\ncommand = "true"\n')


def test_a_slow_supervisor_is_called_slow_and_a_failed_write_cannot_write(tmp_path: Path) -> None:
    """A supervisor that holds the lock but wrote no snapshot for a while: "slow" while nothing failed;
    "cannot write" only with a failed write's alert (its text)."""
    run = _held_run(tmp_path)
    lock = try_lock(run.root)
    assert lock is not None
    try:
        write_json(run.supervisor_path, {"pid": os.getpid(), "t": time.time()})
        state = {"supervisor": {"pid": os.getpid(), "t": time.time() - STALE_S - 20, "alerts": []}}
        rep = liveness(run, state)
        assert rep["verdict"] == "silent", rep
        assert "slow" in rep["text"] and "cannot write" not in rep["text"], rep["text"]
        state["supervisor"]["alerts"] = [  # type: ignore[index]
            {"code": "tick_failed", "text": "supervisor error (ValueError: x)", "resolved": None},
        ]
        assert "cannot write" not in liveness(run, state)["text"]
        state["supervisor"]["alerts"].append(  # type: ignore[index]
            {"code": "write_failed", "text": "cannot write the run directory: EIO", "resolved": None}
        )
        rep = liveness(run, state)
        assert "cannot write: cannot write the run directory: EIO" in rep["text"], rep["text"]
    finally:
        for fd in lock:
            if fd is not None:
                os.close(fd)


# ------------------------------------------------------------------------------------------ fast writers
def _stage_dir_bytes(path: Path) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))


def _watch(run: RunDir, sid: str, until: Callable[[], bool], timeout: float) -> tuple[int, float]:
    """Sample the stage directory's size and the age of state.json's heartbeat until ``until()``: the
    largest size and the stalest heartbeat seen."""
    biggest, stalest = 0, 0.0
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"not done within {timeout:g}s"
        with contextlib.suppress(OSError):
            biggest = max(biggest, _stage_dir_bytes(run.stage(sid).path))
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            stalest = max(stalest, time.time() - float(read_json(run.state_path)["supervisor"]["t"]))
        time.sleep(0.2)
    return biggest, stalest


@pytest.mark.slow
def test_a_4gib_burst_keeps_the_log_bounded_and_the_heartbeat_fresh(tmp_path: Path) -> None:
    """A stage printing 4 GiB as fast as `yes` can: its directory stays within the stage log's bound
    (256 MiB x 3, plus its small records), state.json's heartbeat is never more than 5 s old, and the
    stage's last line — why it failed — is in the current stage.log and in its failure reason."""
    run = make_run(
        tmp_path,
        """
        [run]
        dir = "run"
        [[stage]]
        id = "burst"
        command = "yes 'aerie burst: a line of output, again and again' | head -c 4G; echo 'RuntimeError: the last words'; exit 3"
        """,
    )
    sup = start_supervisor(run, poll=0.5)
    try:
        biggest, stalest = _watch(run, "burst", lambda: states(run).get("burst") == "failed", 900)
    finally:
        stop(sup)
        kill_run_stages(run)
    bound = growth.bound("log")
    assert biggest <= bound + (1 << 20), f"{biggest:,} bytes > {bound:,}"
    assert stalest <= 5.0, f"state.json's heartbeat was {stalest:.1f}s old"
    sd = run.stage("burst")
    assert (sd.path / "stage.2.log").exists()
    assert (
        sd.log.read_bytes().endswith(b"RuntimeError: the last words\n")
        or b"the last words" in sd.log.read_bytes()[-4096:]
    )
    assert "RuntimeError: the last words" in (stage_state(run, "burst").get("reason") or "")


HUGE_LINE = r"""
import json, os, sys, time
from pipeline.run.stage_side.runtime import StageContext
ctx = StageContext.from_env()
ctx.progress(0, 10, unit="steps", force=True)
path = os.path.join(os.environ["AERIE_RUN_DIR"], "stages", os.environ["AERIE_STAGE_ID"], "events.jsonl")
with open(path, "ab") as fh:  # a raw 100 MiB line, past the event writer
    fh.write(b'{"type":"message","t":1,"level":"info","text":"' + b"x" * (100 << 20) + b'"}\n')
waits = []
for i in range(1, 11):
    t0 = time.perf_counter()
    ctx.progress(i, 10, unit="steps", force=True)
    waits.append(time.perf_counter() - t0)
    time.sleep(0.05)
print("longest event write", max(waits), flush=True)
(ctx.out / "waits.json").write_text(json.dumps(waits))
"""


@pytest.mark.slow
def test_a_100mib_event_line_rotates_in_linear_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage writes a raw 100 MiB line into its events file, then its next events: the file rotates (its
    limit is 64 MiB), no event write waits long on it, the heartbeat stays fresh, and the supervisor still
    has the stage's attempt and last progress from the carried head."""
    (tmp_path / "huge.py").write_text(HUGE_LINE)
    run = make_run(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [[stage]]
        id = "huge"
        command = "{sys.executable} {tmp_path / "huge.py"}"
        """,
    )
    sup = start_supervisor(run, poll=0.5)
    try:
        _big, stalest = _watch(run, "huge", lambda: states(run).get("huge") in ("succeeded", "failed"), 300)
    finally:
        stop(sup)
        kill_run_stages(run)
    assert states(run)["huge"] == "succeeded", stage_state(run, "huge")
    assert stalest <= 5.0, f"state.json's heartbeat was {stalest:.1f}s old"
    sd = run.stage("huge")
    assert (sd.path / "events.1.jsonl").exists()
    waits = json.loads((sd.out / "waits.json").read_text())
    assert max(waits) < 1.0, waits  # generous: bench/event_rotation.py measures it (~20 ms)
    assert (stage_state(run, "huge").get("progress") or {}).get("done") == 10


# ------------------------------------------------------------------------------------------ 10,000 stages
def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_10000_ready_stages_held_by_two_slots_stay_operable(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The issue's acceptance: 10,000 ready stages held by `cpu_slots = 2` cost a real supervisor at most
    15 % of a core; state.json is rewritten at least every 2 s (plus a scheduling second on a loaded
    host); a control action is answered within 2 s (5 s here); `aerie status` prints the run."""
    from pipeline.run.plan import dag as plan_mod
    from pipeline.run.supervise.ctl import request
    from pipeline.run.supervise.run_setup import create_run
    from tests.test_bounded import aerie

    shm = Path("/dev/shm")
    base = (
        Path(tempfile.mkdtemp(dir=shm))
        if shm.is_dir() and os.access(shm, os.W_OK)
        else tmp_path_factory.mktemp("n")
    )
    try:
        n = 10_000
        body = '[run]\nname = "scale"\ndir = "run"\n[resources]\ncpu_slots = 2\n' + "".join(
            f'[[stage]]\nid = "s{i:05d}"\ncommand = "sleep 600"\n' for i in range(n)
        )
        (base / "plan.toml").write_text(body)
        run = create_run(plan_mod.load(base / "plan.toml", run_dir=base / "run"), base / "run")
        sup = start_supervisor(run, poll=0.5)
        try:
            deadline = time.monotonic() + 300
            while sum(1 for s in states(run).values() if s == "running") < 2:
                assert time.monotonic() < deadline, "two stages never started"
                time.sleep(0.5)
            time.sleep(5)  # the first ticks read every stage once
            c0, t0, last, gaps = _cpu_s(sup.pid), time.monotonic(), None, [0.0]
            while time.monotonic() - t0 < 20:
                with contextlib.suppress(OSError, ValueError, TypeError, KeyError, AttributeError):
                    # the heartbeat from the snapshot's head (supervisor comes before the 10,000 rows): parsing
                    # the whole 3 MB file ten times a second would load the very host the test measures
                    with run.state_path.open("rb") as fh:
                        head = fh.read(4096).decode("utf-8", "replace")
                    t = float(re.search(r'"supervisor":\{"pid":\d+,"t":([0-9.e+]+)', head).group(1))  # type: ignore[union-attr]
                    if last is not None and t != last:
                        gaps.append(t - last)
                    last = t
                time.sleep(0.1)
            cpu = (_cpu_s(sup.pid) - c0) / (time.monotonic() - t0)
            q0 = time.monotonic()
            code, msg = request(run, "skip", f"s{n - 1:05d}", timeout_s=30)
            control = time.monotonic() - q0
            s0 = time.monotonic()
            res = aerie("status", str(run.root))
            took = time.monotonic() - s0
        finally:
            stop(sup)
            kill_run_stages(run)
        print(
            f"10,000 held: {cpu:.1%} of a core, snapshots at most {max(gaps):.1f}s apart, "
            f"control {control:.2f}s, aerie status {took:.1f}s"
        )
        assert cpu <= 0.15, f"{cpu:.1%} of a core"
        assert max(gaps) <= 3.0, gaps
        assert code == 0 and control <= 5.0, (code, msg, control)
        assert res.returncode == 0 and res.stdout.count("\n") > n
        assert took <= 30, took  # 5 s on an idle 2-core machine; here the suite shares it
    finally:
        shutil.rmtree(base, ignore_errors=True)
