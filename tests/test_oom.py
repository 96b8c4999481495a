"""OOM kills (issue 18, item 3): reported as killed by signal 9 with the likely cause; retry resumes from a checkpoint.

* A real kernel OOM kill: the run's supervisor is started inside a memory cgroup this test creates
  (cgroup v1 ``memory.limit_in_bytes`` or v2 ``memory.max``, whichever this machine has; every launcher and
  stage inherits it, as in a container with a memory limit). Once the real ``train`` stage has written a
  checkpoint the test lowers the limit to just above the cgroup's usage and lets a small memory hog in the
  same cgroup push it over: the kernel's OOM killer kills the biggest process — the training stage. The
  stage must be reported ``killed by signal 9 (SIGKILL): out of memory — the kernel's OOM killer, at the
  memory limit of cgroup ...``, and the plan's retry policy must run attempt 2, which resumes from the
  checkpoint (no step before it is trained again) and succeeds.
* A SIGKILL from outside (no cgroup needed): the stage is reported killed by signal 9, not by Aerie, with
  the OOM killer as the likely cause only where no OOM counter could rule it out; retry resumes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.run.hosts.procs import group_members
from pipeline.run.rundir.layout import read_json
from tests.eagle3_fixtures import TEST_SECTIONS, shared, tiny_llama
from tests.runs import ROOT, events, kill_run_stages, make_run, start_supervisor, stop, wait_done, wait_for

CG = Path("/sys/fs/cgroup")


class MemCgroup:
    """A memory cgroup made by the test (v1 or v2), removed at the end."""

    def __init__(self) -> None:
        name = f"aerie-oom-{uuid.uuid4().hex[:8]}"
        if (CG / "memory" / "cgroup.procs").is_file():  # v1 memory hierarchy
            self.v2, self.path = False, CG / "memory" / name
        elif (
            "memory" in (CG / "cgroup.controllers").read_text().split()
            if (CG / "cgroup.controllers").is_file()
            else False
        ):
            self.v2, self.path = True, CG / name
        else:
            raise OSError("no memory cgroup controller here")
        self.path.mkdir()
        self.name = "/" + name

    def set_limit(self, nbytes: int | None) -> None:
        f = "memory.max" if self.v2 else "memory.limit_in_bytes"
        (self.path / f).write_text(
            "max" if nbytes is None and self.v2 else str(-1 if nbytes is None else nbytes)
        )

    def usage(self) -> int:
        return int((self.path / ("memory.current" if self.v2 else "memory.usage_in_bytes")).read_text())

    def join(self) -> None:
        """preexec_fn: put the new child in the cgroup before it execs."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]

    def remove(self) -> None:
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


@pytest.fixture()
def memcg() -> Iterator[MemCgroup]:
    try:
        cg = MemCgroup()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup here ({exc}); the SIGKILL-from-outside test still runs")
    try:
        yield cg
    finally:
        cg.set_limit(None)
        cg.remove()


def train_plan(ext: Path, voc: Path) -> str:
    train = {**TEST_SECTIONS["train"], "steps": 40, "checkpoint_every": 5}
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in train.items())
    return f"""
[run]
name = "oom"
dir = "run"
[target]
model = "{tiny_llama()}"
max_length = 256
[train]
{lines}
[[stage]]
id = "train"
run = "train"
args = ["--input", "{ext}", "--input", "{voc}"]
retry = {{ max_attempts = 2, backoff_s = 3 }}
"""


def losses_by_attempt(run, sid: str) -> dict[int, list[int]]:  # noqa: ANN001
    out: dict[int, list[int]] = {}
    attempt = 0
    for e in events(run, sid):
        if e.type == "started":
            attempt = e.get("attempt")
        elif e.type == "metric" and e.get("name") == "loss":
            out.setdefault(attempt, []).append(e.get("step"))
    return out


@pytest.mark.slow
def test_a_kernel_oom_kill_is_reported_and_the_retry_resumes_from_the_checkpoint(
    tmp_path_factory, tmp_path: Path, memcg: MemCgroup
) -> None:
    ext, voc = shared(tmp_path_factory, "ext"), shared(tmp_path_factory, "voc")
    run = make_run(tmp_path, train_plan(ext, voc))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    sup = subprocess.Popen(
        [sys.executable, "-m", "pipeline.run.supervise.supervisor", str(run.root), "--poll", "0.1"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=memcg.join,
    )
    hog = None
    try:
        wait_for(
            lambda: any(e.get("code") == "checkpoint" for e in events(run, "train")), 600, "a checkpoint"
        )
        usage = memcg.usage()
        memcg.set_limit(usage + (48 << 20))
        # The hog grows 8 MiB at a time in the same cgroup; the biggest process there is the training stage.
        hog = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import time\nb = []\nfor _ in range(64):\n"
                " b.append(bytearray(8 << 20)); time.sleep(0.05)\ntime.sleep(120)",
            ],
            preexec_fn=memcg.join,
            start_new_session=True,
        )
        sd = run.stage("train")
        wait_for(lambda: (read_json(sd.exit) or {}).get("attempt") == 1, 120, "the OOM kill of attempt 1")
        hog.kill()
        hog.wait()
        memcg.set_limit(None)  # before the retry's 3 s backoff ends
        first = read_json(sd.exit)
        assert first["signal"] == "SIGKILL" and first["returncode"] == -9, first
        assert first["detail"].startswith(
            "killed by signal 9 (SIGKILL): out of memory — the kernel's OOM killer"
        )
        assert f"cgroup {memcg.name}" in first["detail"], first["detail"]
        msgs = [e for e in events(run, "train", "message") if e.get("code") == "signal"]
        assert msgs and "OOM killer" in msgs[0].get("text")
        assert wait_done(run, 900) == {"train": "succeeded"}
    finally:
        if hog and hog.poll() is None:
            hog.kill()
        stop(sup)
        kill_run_stages(run)
    steps = losses_by_attempt(run, "train")
    resumed = [e for e in events(run, "train") if e.get("code") == "resumed_from_checkpoint"]
    assert resumed, "attempt 2 did not resume from the checkpoint"
    ckpt = resumed[0].get("step")
    assert ckpt >= 5 and ckpt % 5 == 0
    assert min(steps[2]) == ckpt + 1 and max(steps[2]) == 40  # nothing before the checkpoint trained again
    assert max(steps[1]) >= ckpt


COUNTER = r"""
import json, os, sys, time
out = os.environ["AERIE_OUT"]
ck = os.path.join(out, "ckpt.json")
start = json.load(open(ck))["next"] if os.path.exists(ck) else 0
print("resuming at", start, flush=True)
with open(os.path.join(out, "steps.log"), "a") as log:
    log.write(f"attempt {os.environ['AERIE_ATTEMPT']} from {start}\n")
for i in range(start, 30):
    time.sleep(0.1)
    tmp = ck + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"next": i + 1}, fh)
        fh.flush(); os.fsync(fh.fileno())
    os.replace(tmp, ck)
"""


def test_a_sigkill_from_outside_is_reported_with_its_likely_cause_and_the_retry_resumes(
    tmp_path: Path,
) -> None:
    (tmp_path / "counter.py").write_text(COUNTER)
    run = make_run(
        tmp_path,
        f"""
[run]
name = "kill9"
dir = "run"
[[stage]]
id = "count"
command = "exec {sys.executable} {tmp_path / "counter.py"}"
retry = {{ max_attempts = 2, backoff_s = 0.5 }}
""",
    )
    sup = start_supervisor(run)
    try:
        sd = run.stage("count")
        wait_for(lambda: (read_json(sd.out / "ckpt.json") or {}).get("next", 0) >= 5, 60, "5 steps")
        launcher = read_json(sd.proc)
        (stage_pid,) = [p for p in group_members(launcher["pgid"]) if p != launcher["pid"]]
        os.kill(stage_pid, signal.SIGKILL)  # only the stage, as the OOM killer would: never its launcher
        assert wait_done(run, 60) == {"count": "succeeded"}
    finally:
        stop(sup)
        kill_run_stages(run)
    fin = events(run, "count", "finished")
    assert [e.get("status") for e in fin] == ["failed", "succeeded"]
    detail = fin[0].get("detail")
    assert detail.startswith("killed by signal 9 (SIGKILL), not sent by Aerie"), detail
    oom_counters = Path("/proc/vmstat").read_text().count("oom_kill ") > 0
    assert ("no OOM kill was recorded" in detail) == oom_counters
    assert "out of memory" in detail  # the likely cause is named either way
    log = (sd.out / "steps.log").read_text().splitlines()
    assert (
        log[0] == "attempt 1 from 0" and log[1].startswith("attempt 2 from ") and int(log[1].split()[-1]) >= 5
    )
    assert (read_json(sd.out / "ckpt.json") or {}).get("next") == 30


def test_describe_names_each_cause() -> None:
    from pipeline.run.hosts.oom import OomReading, describe

    a, b = OomReading("/x", 0, 10), OomReading("/x", 1, 11)
    assert "at the memory limit of cgroup /x (oom_kill 0 -> 1)" in describe(9, a, b, False)
    assert "ran on this host" in describe(9, OomReading("/", None, 3), OomReading("/", None, 4), False)
    assert describe(9, a, a, True) == "killed by signal 9 (SIGKILL), sent by Aerie (kill)"
    assert describe(11, a, a, False) == "killed by signal 11 (SIGSEGV)"
    assert "likely the kernel's OOM killer" in describe(
        9, OomReading(None, None, None), OomReading(None, None, None), False
    )
